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
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from conformance.harness import TARGETS, assert_close, load_specs, quantize
from conformance.tolerances import tolerance

SPECS = load_specs()


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(map(str, parts)).encode()))


# The Triton interpreter evaluates masked-out lanes with NumPy too (e.g. -inf - -inf in a
# fully masked tile), whose RuntimeWarnings are artefacts of interpretation, not kernel
# results: they are silenced for interpreted targets only; the outputs are still checked.
_INTERPRETER_MARKS = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _marks(target, reason):
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return marks + (_INTERPRETER_MARKS if target.interpreted else [])


def _params(with_dtype=True, targets=TARGETS, backward=False):
    params = []
    for spec in SPECS:
        if backward and not spec.differentiable:
            continue
        for target in targets:
            dtypes = target.dtypes(spec.name)
            if not dtypes:
                continue
            reason = target.unavailable()
            for case in spec.cases():
                if target.interpreted and not case.interpreter:
                    continue
                for dtype in dtypes if with_dtype else (None,):
                    if target.interpreted and dtype == "float64":
                        continue
                    marks = _marks(target, reason)
                    ident = f"{spec.name}-{case.id}-{target.id}" + (f"-{dtype}" if dtype else "")
                    params.append(pytest.param(spec, case, target, dtype, marks=marks, id=ident))
    return params


def _setup(spec, case, target, dtype):
    rng = _rng(spec.name, case.id)
    inputs = spec.inputs(case, rng)
    arrays, exact = quantize(inputs, dtype, target)
    arrays = spec.arrange(case, arrays, target)
    return rng, arrays, exact


def _nan_checkpoints(spec, case, arrays, target):
    if not spec.checkpoint_names:
        return None
    ck = spec.allocate_checkpoints(case, arrays)
    for name in ck._fields:
        getattr(ck, name)[...] = float("nan")
    return ck


def _nan_grads(spec, arrays, target):
    xp = target.xp
    return {name: xp.full_like(arrays[name], float("nan")) for name in spec.grad_names}


def _cotangents(spec, case, rng, target, dtype):
    raw = spec.cotangents(case, rng)
    arrays, exact = quantize(raw, dtype, target)
    return arrays, exact


@pytest.mark.parametrize("spec,case,target,dtype", _params())
def test_forward_matches_reference(spec, case, target, dtype):
    _, arrays, exact = _setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = _nan_checkpoints(spec, case, arrays, target)
    spec.forward_(case, arrays, outs, ck, target.backend)
    ref_outs, ref_ck = spec.reference(case, exact)
    for name in spec.outputs:
        assert_close(target.to_numpy(outs[name]), ref_outs[name], tolerance(spec.name, "forward", dtype), f"output {name}")
    for name in spec.checkpoint_names:
        assert_close(
            target.to_numpy(getattr(ck, name)), ref_ck[name],
            tolerance(spec.name, "checkpoints", dtype), f"checkpoint {name}",
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
        spec.forward_(case, arrays, spec.allocate_outputs(case, arrays, target, dtype), ck, target.backend)
        for name in ck._fields:
            getattr(ck, name)[...] = target.asarray(ref_ck[name], "float32")
    return outs, ck


@pytest.mark.parametrize("spec,case,target,dtype", _params(backward=True))
def test_backward_from_reference_checkpoints(spec, case, target, dtype):
    rng, arrays, exact = _setup(spec, case, target, dtype)
    outs, ck = _reference_state(spec, case, arrays, exact, target, dtype)
    cot, cot_exact = _cotangents(spec, case, rng, target, dtype)
    grads = _nan_grads(spec, arrays, target)
    spec.backward_(case, arrays, outs, cot, grads, ck, target.backend)
    ref = spec.reference_backward(case, exact, cot_exact)
    for name in spec.grad_names:
        assert_close(target.to_numpy(grads[name]), ref[name], tolerance(spec.name, "backward", dtype), f"gradient {name}")


@pytest.mark.parametrize("spec,case,target,dtype", _params(backward=True))
def test_backward_from_own_checkpoints(spec, case, target, dtype):
    rng, arrays, exact = _setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = _nan_checkpoints(spec, case, arrays, target)
    spec.forward_(case, arrays, outs, ck, target.backend)
    cot, cot_exact = _cotangents(spec, case, rng, target, dtype)
    grads = _nan_grads(spec, arrays, target)
    spec.backward_(case, arrays, outs, cot, grads, ck, target.backend)
    ref = spec.reference_backward(case, exact, cot_exact)
    for name in spec.grad_names:
        assert_close(target.to_numpy(grads[name]), ref[name], tolerance(spec.name, "backward", dtype), f"gradient {name}")


@pytest.mark.parametrize("spec,case,target,dtype", _params())
def test_allocating_equals_inplace(spec, case, target, dtype):
    rng, arrays, _ = _setup(spec, case, target, dtype)
    outs = spec.allocate_outputs(case, arrays, target, dtype)
    ck = _nan_checkpoints(spec, case, arrays, target)
    spec.forward_(case, arrays, outs, ck, target.backend)
    ck2 = _nan_checkpoints(spec, case, arrays, target)
    outs2 = spec.forward(case, arrays, ck2, target.backend)
    for name in spec.outputs:
        np.testing.assert_array_equal(target.to_numpy(outs2[name]), target.to_numpy(outs[name]), err_msg=name)
    if not spec.differentiable:
        return
    cot, _ = _cotangents(spec, case, rng, target, dtype)
    grads = _nan_grads(spec, arrays, target)
    spec.backward_(case, arrays, outs, cot, grads, ck, target.backend)
    grads2 = spec.backward(case, arrays, outs, cot, ck2, target.backend)
    for name in spec.grad_names:
        np.testing.assert_array_equal(target.to_numpy(grads2[name]), target.to_numpy(grads[name]), err_msg=name)


def _interchange_params():
    params = []
    for spec in SPECS:
        if not (spec.differentiable and spec.checkpoint_names):
            continue
        for a in TARGETS:
            for b in TARGETS:
                if a == b or (a.namespace, a.device) != (b.namespace, b.device):
                    continue
                if "float32" not in a.dtypes(spec.name) or "float32" not in b.dtypes(spec.name):
                    continue
                reason = a.unavailable() or b.unavailable()
                for case in spec.cases():
                    if (a.interpreted or b.interpreted) and not case.interpreter:
                        continue
                    marks = _marks(a if a.interpreted else b, reason)
                    params.append(
                        pytest.param(spec, case, a, b, marks=marks, id=f"{spec.name}-{case.id}-{a.id}-to-{b.backend}")
                    )
    return params


@pytest.mark.parametrize("spec,case,producer,consumer", _interchange_params())
def test_checkpoints_interchangeable(spec, case, producer, consumer):
    """A forward on one backend feeds a backward on another."""
    dtype = "float32"
    rng, arrays, exact = _setup(spec, case, producer, dtype)
    outs = spec.allocate_outputs(case, arrays, producer, dtype)
    ck = _nan_checkpoints(spec, case, arrays, producer)
    spec.forward_(case, arrays, outs, ck, producer.backend)
    cot, cot_exact = _cotangents(spec, case, rng, producer, dtype)
    grads = _nan_grads(spec, arrays, producer)
    spec.backward_(case, arrays, outs, cot, grads, ck, consumer.backend)
    ref = spec.reference_backward(case, exact, cot_exact)
    for name in spec.grad_names:
        assert_close(producer.to_numpy(grads[name]), ref[name], tolerance(spec.name, "backward", dtype), f"gradient {name}")


def _error_params():
    params = []
    for spec in SPECS:
        for target in TARGETS:
            if target.backend != "array_api":
                continue
            reason = target.unavailable()
            for err in spec.errors():
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(err, target, marks=marks, id=f"{spec.name}-{err.id}-{target.namespace}-{target.device}"))
    return params


@pytest.mark.parametrize("err,target", _error_params())
def test_error_inputs_raise(err, target):
    with pytest.raises(err.error, match=err.match):
        err.call(target)


@pytest.mark.parametrize("spec,case,target,dtype", _params(with_dtype=False))
def test_checkpoint_allocator_shapes(spec, case, target, dtype):
    if not spec.checkpoint_names:
        pytest.skip(f"{spec.name} saves no checkpoints")
    _, arrays, exact = _setup(spec, case, target, "float32")
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
        if spec.torch_oracle
        for case in spec.cases()
    ]


@pytest.mark.parametrize("spec,case", _oracle_params())
def test_reference_matches_torch(spec, case):
    pytest.importorskip("torch", reason="torch is not installed: no PyTorch oracle")
    rng = _rng(spec.name, case.id)
    inputs = spec.inputs(case, rng)
    cot = spec.cotangents(case, rng) if spec.differentiable else {}
    ref_outs, _ = spec.reference(case, inputs)
    torch_outs, torch_grads = spec.torch_reference(case, inputs, cot)
    for name in spec.outputs:
        assert_close(ref_outs[name], torch_outs[name], 1e-9, f"output {name} vs torch")
    if spec.differentiable:
        ref_grads = spec.reference_backward(case, inputs, cot)
        for name in spec.grad_names:
            assert_close(ref_grads[name], torch_grads[name], 1e-9, f"gradient {name} vs torch")
