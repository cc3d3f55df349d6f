"""Routing (DESIGN section 4): the table rows this machine can exercise, explicit vs automatic."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

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
    """backend= > use_backend() > XPKERNELS_BACKEND, each level seen through the error it names."""
    arrays = _arrays(np)
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    with pytest.raises(BackendError, match=f"from {registry.ENV_VAR}"):
        resolve("rms_norm", arrays)
    assert resolve("rms_norm", arrays, backend="array_api").backend == "array_api"
    with xk.use_backend("array_api"):
        assert resolve("rms_norm", arrays).backend == "array_api"
        with pytest.raises(BackendError, match=r"from backend="):
            resolve("rms_norm", arrays, backend="triton")
        with xk.use_backend(None):
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
        with xk.use_backend(None):
            assert resolve("rms_norm", arrays).backend == "triton"
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
