"""Routing (DESIGN section 4): the table rows this machine can exercise, explicit vs automatic."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings

import numpy as np
import pytest
from xpkernels.backends.protocol import PRIMITIVES

import xpkernels as xk
from xpkernels import registry
from xpkernels.registry import BackendError, resolve


@pytest.fixture
def torch():
    """The torch module; the tests that route torch tensors skip, saying so, without it."""
    return pytest.importorskip("torch", reason="torch is not installed: no torch tensors to route")


@pytest.fixture
def triton_interpretable(torch, monkeypatch):
    """torch, with triton installed and its interpreter selected for CPU tensors."""
    pytest.importorskip("triton", reason="triton is not installed: no triton backend to route to")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch


def _arrays(mod):
    return {"x": mod.asarray(np.ones((2, 4), np.float32)), "w": mod.asarray(np.ones(4, np.float32))}


@pytest.mark.parametrize("namespace", ["numpy", "torch", "array_api_strict"])
def test_automatic_route_on_cpu_is_array_api(namespace, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    mod = pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    assert resolve("rms_norm", _arrays(mod)).backend == "array_api"


def test_triton_on_cpu_tensors_only_when_asked_and_interpreted(triton_interpretable, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    arrays = _arrays(triton_interpretable)
    assert resolve("rms_norm", arrays).backend == "array_api"
    assert resolve("rms_norm", arrays, backend="triton").backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendError, match="set TRITON_INTERPRET=1 before importing"):
        resolve("rms_norm", arrays, backend="triton")


def test_explicit_choice_that_cannot_serve_raises():
    """Whatever is installed, triton never serves NumPy arrays, and the error says why."""
    refusal = r"'triton' \(from backend=\) cannot serve numpy arrays on cpu: \w"
    with pytest.raises(BackendError, match=refusal):
        resolve("rms_norm", _arrays(np), backend="triton")
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        resolve("rms_norm", _arrays(np), backend="nope")


def test_triton_refusals_name_the_capability(triton_interpretable):
    torch = triton_interpretable
    with pytest.raises(BackendError, match="serves torch arrays, not numpy"):
        resolve("rms_norm", _arrays(np), backend="triton")
    x = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(BackendError, match="not float64"):
        resolve("rms_norm", {"x": x}, backend="triton")


def test_explicit_choice_precedence_on_numpy(monkeypatch):
    """backend= > use_backend() > XPKERNELS_BACKEND, each level seen through the error it names;
    use_backend(None) is automatic routing, whatever the environment variable says."""
    arrays = _arrays(np)
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    with pytest.raises(BackendError, match=f"from {registry.ENV_VAR}"):
        resolve("rms_norm", arrays)
    assert resolve("rms_norm", arrays, backend="array_api").backend == "array_api"
    with xk.use_backend("array_api"):
        assert resolve("rms_norm", arrays).backend == "array_api"
        with pytest.raises(BackendError, match=r"from backend="):
            resolve("rms_norm", arrays, backend="triton")
        with xk.use_backend(None):  # automatic routing, over the environment variable too
            assert resolve("rms_norm", arrays).backend == "array_api"
            with xk.use_backend("triton"):
                with pytest.raises(BackendError, match=r"from use_backend\(\)"):
                    resolve("rms_norm", arrays)
    with pytest.raises(BackendError, match=f"from {registry.ENV_VAR}"):
        resolve("rms_norm", arrays)
    monkeypatch.delenv(registry.ENV_VAR)
    with xk.use_backend("triton"):
        with pytest.raises(BackendError, match=r"from use_backend\(\)"):
            resolve("rms_norm", arrays)
        assert resolve("rms_norm", arrays, backend="array_api").backend == "array_api"
    assert resolve("rms_norm", arrays).backend == "array_api"


def test_explicit_choice_precedence(triton_interpretable, monkeypatch):
    arrays = _arrays(triton_interpretable)
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    assert resolve("rms_norm", arrays).backend == "triton"
    with xk.use_backend("array_api"):
        assert resolve("rms_norm", arrays).backend == "array_api"
        assert resolve("rms_norm", arrays, backend="triton").backend == "triton"
        with xk.use_backend(None):  # automatic: torch CPU tensors route to array_api
            assert resolve("rms_norm", arrays).backend == "array_api"
    monkeypatch.setenv(registry.ENV_VAR, "bogus")
    with pytest.raises(BackendError, match="from XPKERNELS_BACKEND"):
        resolve("rms_norm", arrays)


def test_use_backend_rejects_unknown_names():
    with pytest.raises(BackendError, match="unknown backend"):
        with xk.use_backend("nope"):
            pass


@pytest.mark.parametrize("namespace", ["torch", "array_api_strict"])
def test_mixed_namespaces_name_the_arguments(namespace):
    mod = pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    x = np.ones((2, 4), np.float32)
    w = mod.asarray(np.ones(4, np.float32))
    with pytest.raises(TypeError, match=f"w is a {namespace} array but x is a numpy array"):
        xk.rms_norm(x, w)


def test_mixed_devices_name_the_arguments(torch):
    x = torch.ones(2, 4)
    w = torch.ones(4, device="meta")
    with pytest.raises(TypeError, match="w is on device meta but x is on"):
        resolve("rms_norm", {"x": x, "w": w})


def test_mixed_devices_name_the_arguments_without_torch():
    strict = pytest.importorskip("array_api_strict", reason="array_api_strict is not installed")
    x = strict.asarray(np.ones((2, 4), np.float32))
    w = strict.asarray(np.ones(4, np.float32), device=strict.Device("device1"))
    with pytest.raises(TypeError, match="w is on device .*device1.* but x is on"):
        resolve("rms_norm", {"x": x, "w": w})


def test_cuda_tensors_fall_back_with_one_warning(torch, monkeypatch):
    """The torch/cuda row: with no usable triton the call runs on array_api, warned once."""
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "device_kind", lambda x: "cuda")
    monkeypatch.setattr(registry, "_WARNED", set())
    arrays = _arrays(torch)
    with pytest.warns(RuntimeWarning, match="falls back to the array_api backend"):
        assert resolve("rms_norm", arrays).backend == "array_api"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("rms_norm", arrays).backend == "array_api"


def test_backends_lists_every_declared_backend_with_reasons():
    rows = {b.name: b for b in xk.backends()}
    assert set(rows) == {b.name for b in registry.BACKENDS}
    assert rows["array_api"].available and rows["array_api"].reason == ""
    for row in rows.values():
        assert row.available or row.reason


def test_routing_numpy_calls_imports_no_other_array_library():
    code = (
        "import sys, numpy as np, xpkernels as xk\n"
        "x = np.ones((3, 8), np.float32); w = np.ones(8, np.float32)\n"
        "xk.rms_norm(x, w)\n"
        "bad = [m for m in ('torch', 'cupy', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the cupy row ------------------------------------------------------------------------------


@pytest.fixture
def cupy_arrays_on_cuda(monkeypatch):
    """NumPy arrays that routing sees as CuPy arrays on CUDA, with a stand-in ``cupy`` seeing devices."""
    import types

    state = {"count": 1}
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: state["count"])
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "namespace_name", lambda xp: "cupy")
    monkeypatch.setattr(registry, "device_kind", lambda x: "cuda")
    monkeypatch.setattr(registry, "_WARNED", set())
    return state


def test_cupy_arrays_on_cuda_route_to_cupy(cupy_arrays_on_cuda):
    route = resolve("rms_norm", _arrays(np))
    assert route.backend == "cupy" and route.impl.__name__ == "xpkernels.backends.cupy.rms_norm"
    assert route.hook("partials") is route.impl.partials


def test_cupy_calls_it_cannot_serve_fall_back_with_one_warning(cupy_arrays_on_cuda):
    # Every op has CUDA C kernels (merge_attention_states too); float64 has none.
    assert resolve("merge_attention_states", _arrays(np)).backend == "cupy"
    arrays = {name: a.astype(np.float64) for name, a in _arrays(np).items()}
    with pytest.warns(
        RuntimeWarning,
        match="because backend 'cupy' cannot serve it: its rms_norm supports .*, not float64",
    ):
        assert resolve("rms_norm", arrays).backend == "array_api"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("rms_norm", arrays).backend == "array_api"
    with pytest.raises(
        BackendError,
        match="'cupy' .* cannot serve cupy arrays on cuda: its rms_norm supports .*, not float64",
    ):
        resolve("rms_norm", arrays, backend="cupy")


def test_cupy_without_a_device_falls_back_or_refuses(cupy_arrays_on_cuda):
    cupy_arrays_on_cuda["count"] = 0
    arrays = _arrays(np)
    with pytest.warns(RuntimeWarning, match="cannot serve it: cupy sees no CUDA device"):
        assert resolve("rms_norm", arrays).backend == "array_api"
    with pytest.raises(
        BackendError, match="cannot serve cupy arrays on cuda: cupy sees no CUDA device"
    ):
        resolve("rms_norm", arrays, backend="cupy")


def test_explicit_cupy_on_numpy_needs_emulate(monkeypatch):
    from xpkernels.testing import cudacpu

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    arrays = _arrays(np)
    refusal = r"'cupy' \(from backend=\) cannot serve numpy arrays on cpu: .*cudacpu\.emulate\(\)"
    with pytest.raises(BackendError, match=refusal):
        resolve("rms_norm", arrays, backend="cupy")
    with cudacpu.emulate():
        assert resolve("rms_norm", arrays).backend == "array_api"
        assert resolve("rms_norm", arrays, backend="cupy").backend == "cupy"
        assert resolve("merge_attention_states", arrays, backend="cupy").backend == "cupy"
        float64 = {name: a.astype(np.float64) for name, a in arrays.items()}
        with pytest.raises(BackendError, match="its rms_norm supports .*, not float64"):
            resolve("rms_norm", float64, backend="cupy")


def test_backends_lists_cupy_with_its_reason(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    row = next(b for b in xk.backends() if b.name == "cupy")
    # cupy serves every declared primitive (linear cross-entropy through its cross_entropy)
    served = tuple(op for op in registry.OPS if PRIMITIVES[op].rows_of is None)
    assert row.ops == served and row.namespaces == ("cupy", "numpy")
    if importlib.util.find_spec("cupy") is None:
        assert not row.available
        assert "cupy is not installed" in row.reason and "cudacpu.emulate()" in row.reason


def test_cupy_launch_path_needs_neither_torch_nor_triton():
    """Routing and the launchers, on the CPU harness, with torch and triton unimportable."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton'):\n"
        "            raise ImportError(f'{name} is made unimportable')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, xpkernels as xk\n"
        "from xpkernels.testing import cudacpu\n"
        "x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8); w = np.ones(8, np.float32)\n"
        "ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)\n"
        "with cudacpu.emulate():\n"
        "    y = xk.rms_norm(x, w, checkpoints=ck, backend='cupy')\n"
        "    grads = xk.rms_norm_backward(np.ones_like(x), x, w, checkpoints=ck, backend='cupy')\n"
        "np.testing.assert_allclose(y, xk.rms_norm(x, w), rtol=1e-6, atol=1e-6)\n"
        "assert all(np.isfinite(np.asarray(g)).all() for g in grads)\n"
        "bad = [m for m in ('torch', 'triton', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_bfloat16_arrays_route_and_run():
    """NumPy arrays of ml_dtypes' bfloat16 (which ``xp.isdtype`` cannot classify) route to
    array_api and compute in float32: each result is the float32 call's on the same values,
    rounded once to bfloat16 (half a bfloat16 ulp, plus float32 noise)."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy has bfloat16 only through it")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(bf16)

    def check(got, want):
        assert got.dtype == bf16
        want = np.asarray(want, np.float32)
        slack = 2.0**-8 * np.abs(want) + 64 * np.finfo(np.float32).eps * np.max(np.abs(want))
        assert np.all(np.abs(got.astype(np.float32) - want) <= slack)

    x, w, dy = draw(6, 40), draw(40), draw(6, 40)
    f32 = [a.astype(np.float32) for a in (x, w, dy)]
    check(xk.rms_norm(x, w), xk.rms_norm(*f32[:2]))
    check(xk.swiglu(x, dy), xk.swiglu(f32[0], f32[2]))
    q, k, v = draw(1, 2, 9, 8), draw(1, 2, 11, 8), draw(1, 2, 11, 8)
    check(
        xk.attention(q, k, v, causal=True),
        xk.attention(*(a.astype(np.float32) for a in (q, k, v)), causal=True),
    )
    with pytest.raises(TypeError, match=r"attention_: q must have dtype in .*, got int32"):
        xk.attention(*(a.astype(np.int32) for a in (q, k, v)))
