"""The backend protocol (DESIGN section 4): every declared backend and op against its contract.

Walks ``registry.BACKENDS``: each op module provides the functions its
protocol class declares with compatible signatures, provides exactly the
hooks its capability declares, and declares only scratch fields the protocol
lets it leave out. Then the behaviour the fronts build on: undeclared hooks
take the protocol's defaults, scratch a backend does not use is never
allocated, ``supports`` answers with reasons, and routing NumPy calls
imports no other array library.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest

_HAS_TRITON = (
    importlib.util.find_spec("torch") is not None and importlib.util.find_spec("triton") is not None
)
if _HAS_TRITON:
    import torch

    if (
        not torch.cuda.is_available()
    ):  # the Triton interpreter must be chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")

from xpkernels.backends import protocol
from xpkernels.backends.protocol import PRIMITIVES, Backend, Call, Capability

import xpkernels as xk
from xpkernels import registry
from xpkernels.buffers import Duplicated
from xpkernels.registry import BackendError, resolve

PAIRS = [(b, op) for b in registry.BACKENDS for op in b.ops]


def _signature_problem(name, provided, declared) -> str | None:
    """Why ``provided`` cannot be called as ``declared`` (a function or its Signature) is, or None.

    Positional parameters must match in order, keyword-only ones by name.
    """
    if not isinstance(declared, inspect.Signature):
        declared = inspect.signature(declared)
    want = list(declared.parameters.values())
    have = list(inspect.signature(provided).parameters.values())
    keywords = {q.name: q for q in have if q.kind == q.KEYWORD_ONLY}
    positional = [q for q in have if q.kind != q.KEYWORD_ONLY]
    for i, p in enumerate(w for w in want if w.kind != w.KEYWORD_ONLY):
        if i >= len(positional):
            return f"{name} lacks parameter {p.name!r}"
        q = positional[i]
        if (q.name, q.kind) != (p.name, p.kind):
            return f"{name} has parameter {q.name!r} ({q.kind.description}) where the protocol has {p.name!r} ({p.kind.description})"
    for p in (w for w in want if w.kind == w.KEYWORD_ONLY):
        if p.name not in keywords:
            return f"{name} lacks keyword-only parameter {p.name!r} (it has {sorted(keywords)})"
    named = {p.name for p in want}
    extra = [
        q.name
        for q in have
        if q.name not in named
        and q.default is inspect.Parameter.empty
        and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
    ]
    if extra:
        return f"{name} requires parameters the protocol does not pass: {', '.join(extra)}"
    return None


def conformance_problems(module, op: str, capability: Capability) -> list[str]:
    """Every way ``module`` (a backend's module for ``op``) departs from the protocol."""
    primitive = PRIMITIVES[op]
    problems = []
    for name, declared in primitive.functions().items():
        provided = getattr(module, name, None)
        if not callable(provided):
            problems.append(f"{op}: missing {name}")
            continue
        problem = _signature_problem(name, provided, declared)
        if problem:
            problems.append(f"{op}: {problem}")
    for name in capability.hooks:
        if name not in primitive.hooks:
            problems.append(f"{op}: declares hook {name!r}, which the protocol does not have")
    for name, default in primitive.hooks.items():
        provided = getattr(module, name, None)
        if name in capability.hooks:
            if not callable(provided):
                problems.append(f"{op}: declares hook {name} but does not provide it")
            else:
                problem = _signature_problem(name, provided, default)
                if problem:
                    problems.append(f"{op}: {problem}")
        elif provided is not None:
            problems.append(
                f"{op}: provides hook {name} without declaring it (the fronts would ignore it)"
            )
    for name in capability.scratch or ():
        if name not in primitive.optional_scratch:
            problems.append(
                f"{op}: declares scratch {name!r}, not an optional scratch field of {op}"
            )
    for dt in capability.dtypes:
        if dt not in protocol.FLOAT_DTYPES:
            problems.append(f"{op}: declares unknown dtype {dt!r}")
    return problems


def test_every_op_of_the_registry_has_a_protocol():
    assert registry.OPS == tuple(PRIMITIVES)
    for b in registry.BACKENDS:
        assert set(b.ops) <= set(PRIMITIVES), b.name
        assert b.module == f"xpkernels.backends.{b.name}"
    assert {b.name for b in registry.BACKENDS} >= {"array_api", "triton", "cupy"}
    assert registry.FALLBACK in {b.name for b in registry.BACKENDS}


@pytest.mark.parametrize(("backend", "op"), PAIRS, ids=[f"{b.name}-{op}" for b, op in PAIRS])
def test_backend_module_provides_what_the_protocol_declares(backend, op):
    missing = backend.missing_requirement()
    if missing:
        pytest.skip(f"{backend.name}: {missing}")
    module = importlib.import_module(f"{backend.module}.{op}")
    assert conformance_problems(module, op, backend.ops[op]) == []


def test_the_conformance_check_reports_each_departure():
    """A module with a missing backward, a renamed parameter, an undeclared and a missing hook."""

    def forward(y, x, w, rstd, *, eps, shift):
        """Renamed ``offset``."""

    def partials(rows, m, like):
        return 1

    module = types.SimpleNamespace(forward=forward, partials=partials)
    capability = Capability(
        dtypes=("float32", "float8"), hooks=("reduce_partials",), scratch=("dw_partial",)
    )
    problems = "\n".join(conformance_problems(module, "rms_norm", capability))
    assert "missing backward" in problems
    assert "'shift'" in problems and "'offset'" in problems
    assert "declares hook reduce_partials but does not provide it" in problems
    assert "provides hook partials without declaring it" in problems
    assert "not an optional scratch field" in problems
    assert "unknown dtype 'float8'" in problems


def test_extra_required_parameters_are_reported_and_defaulted_ones_accepted():
    def declared(a, *, b): ...

    def defaulted(a, *, b, c=1): ...

    def required(a, *, b, c): ...

    assert _signature_problem("f", defaulted, declared) is None
    assert "requires parameters the protocol does not pass: c" in _signature_problem(
        "f", required, declared
    )


def test_registry_logic_names_no_backend():
    for fn in (registry.resolve, registry.backends, registry._route, registry.Route.hook):
        source = inspect.getsource(fn)
        assert '"triton"' not in source and '"array_api"' not in source, fn.__name__


# -- supports(op, call) ------------------------------------------------------------------------


def _by_name(name) -> Backend:
    return next(b for b in registry.BACKENDS if b.name == name)


def test_supports_answers_with_the_reason():
    array_api, triton = _by_name("array_api"), _by_name("triton")
    assert array_api.supports("flex_attention", Call("cupy", "cuda", ("float16",), 512))
    assert array_api.supports("rms_norm", Call("numpy", "cpu", ("float64",))).reason == ""
    if triton.missing_requirement():
        answer = triton.supports("rms_norm", Call("torch", "cuda", ("float32",)))
        assert not answer and "is not installed" in answer.reason
        return
    cases = [
        ("rms_norm", Call("numpy", "cpu", ("float32",)), "serves torch arrays, not numpy"),
        ("rms_norm", Call("torch", "meta", ("float32",)), "serves cuda, cpu devices, not meta"),
        ("softmax", Call("torch", "cpu", ("float64",)), "not float64"),
        ("attention", Call("torch", "cpu", ("float16",), 512), "head dims up to 256, not 512"),
    ]
    for op, call, reason in cases:
        answer = triton.supports(op, call)
        assert not answer and reason in answer.reason, (op, answer)


def test_triton_device_check_lives_with_its_declaration(monkeypatch):
    triton = _by_name("triton")
    if triton.missing_requirement():
        pytest.skip(f"triton: {triton.missing_requirement()}")
    call = Call("torch", "cpu", ("float32",))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton.supports("rms_norm", call)
    monkeypatch.delenv("TRITON_INTERPRET")
    answer = triton.supports("rms_norm", call)
    assert not answer and "set TRITON_INTERPRET=1" in answer.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    listed = next(row for row in xk.backends() if row.name == "triton")
    assert not listed.available
    assert "torch reports no CUDA device" in listed.reason and "TRITON_INTERPRET" in listed.reason


def test_missing_requirement_is_the_reason_everywhere(monkeypatch):
    fake = Backend(
        name="fake",
        namespaces=("numpy",),
        devices=("cpu",),
        module="xpkernels.backends.fake",
        requires=("no_such_module_xpkernels",),
        ops={"softmax": Capability(dtypes=("float32",))},
    )
    assert (
        fake.supports("softmax", Call("numpy", "cpu")).reason
        == "no_such_module_xpkernels is not installed"
    )
    assert fake.availability().reason == "no_such_module_xpkernels is not installed"
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, fake))
    monkeypatch.setitem(registry._BY_NAME, "fake", fake)
    rows = {row.name: row for row in xk.backends()}
    assert not rows["fake"].available and "not installed" in rows["fake"].reason
    with pytest.raises(
        BackendError, match="backend 'fake'.*no_such_module_xpkernels is not installed"
    ):
        resolve("softmax", {"x": np.ones((2, 3), np.float32)}, backend="fake")


# -- hooks through the protocol ----------------------------------------------------------------


@pytest.fixture
def array_api_without_hooks(monkeypatch):
    """The array_api backend declared with no hooks: the fronts must use the protocol's defaults."""
    spec = _by_name("array_api")
    bare = dataclasses.replace(
        spec, ops={op: dataclasses.replace(c, hooks=()) for op, c in spec.ops.items()}
    )
    monkeypatch.setitem(registry._BY_NAME, "array_api", bare)
    return bare


def test_route_hooks_are_the_declared_functions():
    route = resolve("rms_norm", {"x": np.ones((4, 8), np.float32)})
    assert route.hook("partials") is route.impl.partials
    assert route.hook("reduce_partials") is route.impl.reduce_partials


def test_undeclared_hooks_fall_back_to_the_protocol_defaults(array_api_without_hooks):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    dy = rng.standard_normal((64, 48)).astype(np.float32)
    route = resolve("rms_norm", {"x": x})
    assert route.hook("partials") is protocol.partials
    assert route.hook("reduce_partials") is protocol.reduce_partials
    scratch = xk.allocate_scratchspace(
        xk.rms_norm_backward_, Duplicated(x), Duplicated(x), Duplicated(w)
    )
    assert scratch.dw_partial.shape == (1, 48)

    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    xk.rms_norm(x, w, checkpoints=ck)
    dx, dw = xk.rms_norm_backward(dy, x, w, checkpoints=ck)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(dw, np.sum(dy64 * x64 * rstd, axis=0), rtol=1e-4, atol=1e-4)
    assert dx.shape == x.shape

    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 40, 16)).astype(np.float32)
    scratch = xk.allocate_scratchspace(xk.decode_attention_, np.empty((1, 2, 16), np.float32), q, k)
    assert scratch.o_partial.shape[2] == 1  # protocol.default_splits

    route = resolve("flex_attention", {"q": q})
    assert route.hook("default_tiles")(300, 500, 2, False) == (protocol.DEFAULT_TILE,) * 2
    qf = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
    kf = rng.standard_normal((1, 1, 20, 8)).astype(np.float32)
    got = xk.flex_attention(qf, kf, kf, mask_mod=xk.mods.CausalMask())
    want = xk.attention(qf, kf, kf, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_default_reduce_partials_sums_rows_in_the_output_dtype():
    partial = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.empty(4, np.float16)
    protocol.reduce_partials(partial, out)
    np.testing.assert_array_equal(out, np.array([12, 15, 18, 21], np.float16))


# -- scratch the backend does not use ----------------------------------------------------------


def _attention_args(xp_asarray, seed=0, sq=6, sk=5, d=4):
    rng = np.random.default_rng(seed)
    q, k, v, do = (
        rng.standard_normal(s).astype(np.float32)
        for s in ((1, 2, sq, d), (1, 1, sk, d), (1, 1, sk, d), (1, 2, sq, d))
    )
    return tuple(xp_asarray(a) for a in (q, k, v, do))


def test_array_api_scratch_has_every_field_and_refuses_a_missing_one():
    q, k, v, do = _attention_args(np.asarray)
    o = xk.attention(q, k, v)
    O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
    for forward, backward in (
        (xk.attention_, xk.attention_backward_),
        (xk.flex_attention_, xk.flex_attention_backward_),
    ):
        scratch = xk.allocate_scratchspace(backward, O, Q, K, V)
        assert scratch.delta.shape == (1, 2, 6) and scratch.dq_accum.shape == (1, 2, 6, 4)
        ck = xk.allocate_checkpoints(forward, q, k, v)
        forward(o, q, k, v, checkpoints=ck)
        with pytest.raises(
            ValueError, match=r"scratch\.dq_accum is None but backend 'array_api' needs it"
        ):
            backward(O, Q, K, V, checkpoints=ck, scratch=scratch._replace(dq_accum=None))


@pytest.mark.skipif(not _HAS_TRITON, reason="the triton backend needs torch and triton")
def test_triton_attention_scratch_has_no_dq_accum(monkeypatch):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for Triton kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _attention_args(lambda a: torch.from_numpy(a).to(device))
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    o = xk.attention(q, k, v, causal=True, checkpoints=ck, backend="array_api")
    O = Duplicated(o, do)
    Q, K, V = (Duplicated(a, torch.full_like(a, float("nan"))) for a in (q, k, v))

    scratch = xk.allocate_scratchspace(xk.attention_backward_, O, Q, K, V, backend="triton")
    assert scratch.dq_accum is None and scratch.delta.shape == (1, 2, 6)
    xk.attention_backward_(
        O, Q, K, V, checkpoints=ck, scratch=scratch, causal=True, backend="triton"
    )
    want = xk.attention_backward(do, q, k, v, o, checkpoints=ck, causal=True, backend="array_api")
    for got, expected in zip((Q.shadow, K.shadow, V.shadow), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    front = importlib.import_module("xpkernels._attention_front")  # allocates the scratch
    shapes = []
    real = front.empty_accumulator

    def recording(like, shape):
        shapes.append(tuple(shape))
        return real(like, shape)

    monkeypatch.setattr(front, "empty_accumulator", recording)
    xk.attention_backward_(O, Q, K, V, checkpoints=ck, causal=True, backend="triton")
    assert shapes == [(1, 2, 6)], "the triton backward allocated more than delta"
    shapes.clear()
    xk.attention_backward_(O, Q, K, V, checkpoints=ck, causal=True, backend="array_api")
    assert shapes == [(1, 2, 6), (1, 2, 6, 4)]


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module in ``sys.modules`` whose device count the test sets."""
    state = {"count": 1}

    def device_count():
        if isinstance(state["count"], Exception):
            raise state["count"]
        return state["count"]

    runtime = types.SimpleNamespace(getDeviceCount=device_count)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return state


def test_cupy_declaration_serves_cupy_arrays_on_cuda(fake_cupy):
    cupy = _by_name("cupy")
    call = Call("cupy", "cuda", ("bfloat16", "float32"))
    assert cupy.supports("rms_norm", call)
    cases = [
        (
            "flex_attention",
            Call("cupy", "cuda", ("float16",), 64, ("deterministic_score_mod_grad",)),
            "cannot give bit-identical score-mod gradients",
        ),
        ("attention", Call("cupy", "cuda", ("float16",), 192), "head dims up to 128, not 192"),
        ("rms_norm", Call("cupy", "cuda", ("float64",)), "not float64"),
        ("rms_norm", Call("torch", "cuda", ("float32",)), "serves cupy, numpy arrays, not torch"),
        (
            "rms_norm",
            Call("numpy", "cpu", ("float32",)),
            "only inside xpkernels.testing.cudacpu.emulate()",
        ),
    ]
    for op, c, reason in cases:
        answer = cupy.supports(op, c)
        assert not answer and reason in answer.reason, (op, answer)
    fake_cupy["count"] = 0
    answer = cupy.supports("rms_norm", call)
    assert not answer and answer.reason == "cupy sees no CUDA device"
    fake_cupy["count"] = RuntimeError("cudaErrorNoDevice")
    answer = cupy.supports("rms_norm", call)
    assert (
        not answer and "cupy sees no CUDA device (RuntimeError: cudaErrorNoDevice)" in answer.reason
    )


def test_cupy_device_check_without_cupy_imported(monkeypatch, tmp_path):
    """Not imported: installation by find_spec, a GPU by the driver's /proc entry -- CuPy stays unimported."""
    cupy_pkg = importlib.import_module("xpkernels.backends.cupy")
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    real_find_spec = importlib.util.find_spec
    installed = {"cupy": None}

    def find_spec(name, *args):
        return installed[name] if name in installed else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cupy_pkg.device_problem("cuda") == "cupy is not installed"
    installed["cupy"] = object()
    monkeypatch.setattr(cupy_pkg, "_NVIDIA_GPUS", str(tmp_path / "gpus"))
    assert "no NVIDIA GPU found" in cupy_pkg.device_problem("cuda")
    (tmp_path / "gpus" / "0000:00:01.0").mkdir(parents=True)
    assert cupy_pkg.device_problem("cuda") is None
    assert "cupy" not in sys.modules
    listed = next(row for row in xk.backends() if row.name == "cupy")
    assert listed.available and "cupy" not in sys.modules


def test_cupy_serves_numpy_only_inside_emulate(monkeypatch):
    from xpkernels.testing import cudacpu

    cupy = _by_name("cupy")
    call = Call("numpy", "cpu", ("float16",))
    assert not cupy.supports("rms_norm", call)
    with cudacpu.emulate():
        assert cupy.supports("rms_norm", call)
        answer = cupy.supports("rms_norm", Call("cupy", "cuda", ("float32",)))
        assert not answer and "serves NumPy arrays only" in answer.reason
        assert next(row for row in xk.backends() if row.name == "cupy").available
        monkeypatch.setenv("XPKERNELS_CUDACPU_CXX", "no-such-compiler-xk")
        answer = cupy.supports("rms_norm", call)
        assert not answer and "'no-such-compiler-xk', which is not found" in answer.reason
    assert not cupy.supports("rms_norm", call)


# -- routing imports only what the caller uses -------------------------------------------------


def test_routing_numpy_imports_no_other_array_library():
    """Every op routed for NumPy arrays, automatically and explicitly, imports no torch/triton/cupy."""
    code = (
        "import sys, numpy as np, xpkernels as xk\n"
        "from xpkernels.registry import OPS, BackendError, resolve\n"
        "from xpkernels.backends.protocol import PRIMITIVES\n"
        "x = np.ones((1, 2, 3, 4), np.float32)\n"
        "for op in OPS:\n"
        "    assert resolve(op, {'q': x}).backend == 'array_api'\n"
        "    module = PRIMITIVES[op].rows_of or op\n"
        "    assert resolve(op, {'q': x}, backend='array_api').impl.__name__.endswith(module)\n"
        "    try:\n"
        "        resolve(op, {'q': x}, backend='triton')\n"
        "    except BackendError as e:\n"
        "        assert 'not numpy' in str(e) or 'not installed' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(op)\n"
        "    try:\n"
        "        resolve(op, {'q': x}, backend='cupy')\n"
        "    except BackendError as e:\n"
        "        assert 'emulate()' in str(e) or 'no ' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(op)\n"
        "o = xk.attention(x, x, x)\n"
        "sc = xk.allocate_scratchspace(xk.attention_backward_, o, x, x, x)\n"
        "bad = [m for m in ('torch', 'cupy', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
