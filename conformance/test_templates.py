"""Generic conformance templates, run for every spec x case x available target x dtype.

- forward vs the float64 reference (outputs and checkpoints);
- backward alone, fed the reference's checkpoints;
- backward from the forward's own checkpoints;
- in-place == allocating;
- shadows and outputs pre-filled with NaN are fully overwritten (every
  comparison below starts from NaN-filled buffers);
- checkpoints interchangeable across backends of one namespace and device;
- error inputs raise the declared error;
- allocators' shapes and dtypes;
- the float64 reference agrees with PyTorch's own op (float64 autograd).

Specs, references and the tolerance rule live in :mod:`xpkernels.testing`;
each result's tolerance is max(floor, 2 x the error of the reference formula
run in the target dtype on the same rounded inputs)
(:func:`xpkernels.testing.tolerances.allowed`). A spec without a backward has
its backward checks skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.testing import harness, tolerances
from xpkernels.testing.harness import TARGETS, assert_close, case_rng, load_specs

harness.select_triton_interpreter()

SPECS = load_specs()
_BY_NAME = {spec.name: spec for spec in SPECS}

# The Triton interpreter evaluates masked-out lanes with NumPy too (e.g. -inf - -inf in a
# fully masked tile), whose RuntimeWarnings are artefacts of interpretation, not kernel
# results: they are silenced for Triton-interpreted targets only; the outputs are still checked.
# Emulated targets (CUDA C on the CPU harness) run inside ``cudacpu.emulate()`` -- their
# ``Target.context()`` -- entered by the autouse fixture below, once per schedule.
_INTERPRETER_MARKS = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _marks(target, reason):
    marks = [pytest.mark.skip(reason=f"{target.id}: {reason}")] if reason else []
    return marks + (_INTERPRETER_MARKS if target.triton_interpreter else [])


@pytest.fixture(autouse=True)
def _target_contexts(request):
    """Run each test inside its targets' contexts (``cudacpu.emulate()`` for emulated targets)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    with contextlib.ExitStack() as stack:
        for value in params.values():
            if isinstance(value, harness.Target):
                stack.enter_context(value.context())
        yield


def _forward_only(spec, what):
    """One skipped parameter standing for every ``what`` check of a spec without a backward."""
    reason = f"{spec.name} is forward-only: no {what} to check"
    return pytest.param(
        spec,
        None,
        None,
        None,
        marks=pytest.mark.skip(reason=reason),
        id=f"{spec.name}-forward-only",
    )


def _params(with_dtype=True, targets=TARGETS, backward=False):
    params = []
    for spec in SPECS:
        if backward and spec.backward is None:
            params.append(_forward_only(spec, "backward"))
            continue
        for target in targets:
            dtypes = target.dtypes(spec.name)
            if not dtypes:
                continue
            reason = target.unavailable()
            for case in spec.cases:
                if target.interpreted and not case.interpreter:
                    continue
                for dtype in dtypes if with_dtype else (None,):
                    if target.interpreted and dtype == "float64":
                        continue
                    if dtype is not None and not case.runs_in(dtype):
                        continue
                    marks = _marks(target, reason)
                    ident = f"{spec.name}-{case.id}-{target.id}" + (f"-{dtype}" if dtype else "")
                    params.append(pytest.param(spec, case, target, dtype, marks=marks, id=ident))
    return params


# NumPy has no bfloat16: its rounded inputs come from torch on the CPU.
_BFLOAT16_HOST = harness.Target("array_api", "torch", "cpu")


@functools.cache
def _allowed(op: str, case_id: str, dtype: str) -> dict:
    """``{(pass, name): tolerance}`` of a case in ``dtype``: the rule on the case's rounded inputs."""
    spec = _BY_NAME[op]
    case = next(c for c in spec.cases if c.id == case_id)
    rounded = _BFLOAT16_HOST if dtype == "bfloat16" else harness.Target("array_api", "numpy", "cpu")
    rng = case_rng(spec, case)
    _, exact = harness.quantize(spec.inputs(case, rng), dtype, rounded)
    cot = (
        {}
        if spec.backward is None
        else harness.quantize(spec.backward.cotangents(case, rng), dtype, rounded)[1]
    )
    return tolerances.allowed(spec, case, exact, cot, dtype)


def _tol(spec, case, dtype, pass_, name):
    return _allowed(spec.name, case.id, dtype)[(pass_, name)]


def _check_grads(spec, case, target, dtype, grads, exact, cot_exact):
    ref = spec.backward.reference(case, exact, cot_exact)
    for name in ref:
        assert_close(
            target.to_numpy(grads[name]),
            ref[name],
            _tol(spec, case, dtype, "backward", name),
            f"gradient {name}",
        )


@pytest.mark.parametrize("spec,case,target,dtype", _params())
def test_forward_matches_reference(spec, case, target, dtype):
    _, arrays, exact = harness.setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = harness.nan_checkpoints(spec, case, arrays)
    spec.forward_(case, arrays, outs, ck, target.backend)
    ref_outs, ref_ck = spec.reference(case, exact)
    for name in spec.outputs:
        assert_close(
            target.to_numpy(outs[name]),
            ref_outs[name],
            _tol(spec, case, dtype, "forward", name),
            f"output {name}",
        )
    for name in spec.checkpoint_names:
        assert_close(
            target.to_numpy(getattr(ck, name)),
            ref_ck[name],
            _tol(spec, case, dtype, "checkpoints", name),
            f"checkpoint {name}",
        )


def _reference_state(spec, case, arrays, exact, target, dtype):
    """Outputs (in ``dtype``) and checkpoints (float32) holding the reference's values."""
    ref_outs, ref_ck = spec.reference(case, exact)
    outs = {name: target.asarray(ref_outs[name], dtype) for name in spec.outputs}
    ck = None
    if spec.checkpoint_names:
        ck = spec.allocate_checkpoints(case, arrays)
        # A backward accepts only checkpoints a forward wrote (and records its options in):
        # run the target's forward into them, then replace its values by the reference's.
        spec.forward_(
            case, arrays, spec.allocate_outputs(case, arrays, target, dtype), ck, target.backend
        )
        for name in ck._fields:
            getattr(ck, name)[...] = target.asarray(ref_ck[name], "float32")
    return outs, ck


@pytest.mark.parametrize("spec,case,target,dtype", _params(backward=True))
def test_backward_from_reference_checkpoints(spec, case, target, dtype):
    rng, arrays, exact = harness.setup(spec, case, target, dtype)
    outs, ck = _reference_state(spec, case, arrays, exact, target, dtype)
    cot, cot_exact = harness.cotangents(spec, case, rng, target, dtype)
    grads = harness.nan_grads(spec, arrays, target)
    spec.backward.inplace(case, arrays, outs, cot, grads, ck, target.backend)
    _check_grads(spec, case, target, dtype, grads, exact, cot_exact)


@pytest.mark.parametrize("spec,case,target,dtype", _params(backward=True))
def test_backward_from_own_checkpoints(spec, case, target, dtype):
    rng, arrays, exact = harness.setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = harness.nan_checkpoints(spec, case, arrays)
    spec.forward_(case, arrays, outs, ck, target.backend)
    cot, cot_exact = harness.cotangents(spec, case, rng, target, dtype)
    grads = harness.nan_grads(spec, arrays, target)
    spec.backward.inplace(case, arrays, outs, cot, grads, ck, target.backend)
    _check_grads(spec, case, target, dtype, grads, exact, cot_exact)


@pytest.mark.parametrize("spec,case,target,dtype", _params())
def test_allocating_equals_inplace(spec, case, target, dtype):
    rng, arrays, _ = harness.setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = harness.nan_checkpoints(spec, case, arrays)
    spec.forward_(case, arrays, outs, ck, target.backend)
    ck2 = harness.nan_checkpoints(spec, case, arrays)
    outs2 = spec.forward(case, arrays, ck2, target.backend)
    for name in spec.outputs:
        np.testing.assert_array_equal(
            target.to_numpy(outs2[name]), target.to_numpy(outs[name]), err_msg=name
        )
    if spec.backward is None:
        return
    cot, _ = harness.cotangents(spec, case, rng, target, dtype)
    grads = harness.nan_grads(spec, arrays, target)
    spec.backward.inplace(case, arrays, outs, cot, grads, ck, target.backend)
    grads2 = spec.backward.allocating(case, arrays, outs, cot, ck2, target.backend)
    for name in grads:
        np.testing.assert_array_equal(
            target.to_numpy(grads2[name]), target.to_numpy(grads[name]), err_msg=name
        )


def _interchange_params():
    params = []
    for spec in SPECS:
        if not spec.checkpoint_names:
            continue
        if spec.backward is None:
            params.append(_forward_only(spec, "backward reading checkpoints"))
            continue
        for a in TARGETS:
            for b in TARGETS:
                if a.backend == b.backend or (a.namespace, a.device) != (b.namespace, b.device):
                    continue
                if "float32" not in a.dtypes(spec.name) or "float32" not in b.dtypes(spec.name):
                    continue
                reason = a.unavailable() or b.unavailable()
                for case in spec.cases:
                    if (a.interpreted or b.interpreted) and not case.interpreter:
                        continue
                    if not case.runs_in("float32"):
                        continue
                    marks = _marks(a if a.interpreted else b, reason)
                    to = b.backend if b.schedule is None else f"{b.backend}-{b.schedule}"
                    params.append(
                        pytest.param(
                            spec,
                            case,
                            a,
                            b,
                            marks=marks,
                            id=f"{spec.name}-{case.id}-{a.id}-to-{to}",
                        )
                    )
    return params


@pytest.mark.parametrize("spec,case,producer,consumer", _interchange_params())
def test_checkpoints_interchangeable(spec, case, producer, consumer):
    """A forward on one backend feeds a backward on another."""
    dtype = "float32"
    rng, arrays, exact = harness.setup(spec, case, producer, dtype)
    outs = spec.allocate_outputs(case, arrays, producer, dtype)
    ck = harness.nan_checkpoints(spec, case, arrays)
    spec.forward_(case, arrays, outs, ck, producer.backend)
    cot, cot_exact = harness.cotangents(spec, case, rng, producer, dtype)
    grads = harness.nan_grads(spec, arrays, producer)
    spec.backward.inplace(case, arrays, outs, cot, grads, ck, consumer.backend)
    _check_grads(spec, case, producer, dtype, grads, exact, cot_exact)


def _error_params():
    """Every spec's error cases on the array_api targets; those marked ``every_backend`` (the
    generated non-array, overlap and write-before-check cases) on every target that runs the op
    (emulated ones in the default schedule only: a refused call reaches no kernel)."""
    params = []
    for spec in SPECS:
        errors = spec.errors()
        for target in TARGETS:
            if not target.dtypes(spec.name) or target.schedule not in (None, "default"):
                continue
            reason = target.unavailable()
            for err in errors:
                if target.backend != "array_api" and not err.every_backend:
                    continue
                marks = [pytest.mark.skip(reason=f"{target.id}: {reason}")] if reason else []
                params.append(
                    pytest.param(
                        err,
                        target,
                        marks=marks,
                        id=f"{spec.name}-{err.id}-{target.id}",
                    )
                )
    return params


@pytest.mark.parametrize("err,target", _error_params())
def test_error_inputs_raise(err, target):
    on_device = target.namespace not in ("numpy", "array_api_strict")
    if err.values and on_device:
        err.call(target)  # outside debug mode device values are clamped, never read on the host
        with xk.debug(), pytest.raises(err.error, match=err.match):
            err.call(target)
        return
    with pytest.raises(err.error, match=err.match):
        err.call(target)


@pytest.mark.parametrize("spec,case,target,dtype", _params(with_dtype=False))
def test_checkpoint_allocator_shapes(spec, case, target, dtype):
    if not spec.checkpoint_names:
        pytest.skip(f"{spec.name} saves no checkpoints")
    _, arrays, exact = harness.setup(spec, case, target, "float32")
    ck = spec.allocate_checkpoints(case, arrays)
    _, ref_ck = spec.reference(case, exact)
    xp = target.xp
    assert ck._fields == spec.checkpoint_names
    for name in ck._fields:
        a = getattr(ck, name)
        assert tuple(a.shape) == ref_ck[name].shape, name
        assert a.dtype == xp.float32, name


def _oracle_params():
    return [
        pytest.param(spec, case, id=f"{spec.name}-{case.id}")
        for spec in SPECS
        if spec.torch_reference is not None
        for case in spec.cases
    ]


@pytest.mark.parametrize("spec,case", _oracle_params())
def test_reference_matches_torch(spec, case):
    pytest.importorskip("torch", reason="torch is not installed: no PyTorch oracle")
    rng = case_rng(spec, case)
    inputs = spec.inputs(case, rng)
    cot = {} if spec.backward is None else spec.backward.cotangents(case, rng)
    ref_outs, _ = spec.reference(case, inputs)
    torch_outs, torch_grads = spec.torch_reference(case, inputs, cot)
    for name in spec.outputs:
        assert_close(ref_outs[name], torch_outs[name], 1e-9, f"output {name} vs torch")
    if spec.backward is not None:
        ref_grads = spec.backward.reference(case, inputs, cot)
        for name in ref_grads:
            assert_close(ref_grads[name], torch_grads[name], 1e-9, f"gradient {name} vs torch")


@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_every_spec_declares_a_quick_case_for_check(spec):
    assert any(case.quick for case in spec.cases), f"{spec.name}: no case is marked quick"
