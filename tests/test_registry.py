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

torch = pytest.importorskip("torch", reason="torch is not installed")


def _arrays(mod):
    return {"x": mod.asarray(np.ones((2, 4), np.float32)), "w": mod.asarray(np.ones(4, np.float32))}


@pytest.mark.parametrize("namespace", ["numpy", "torch", "array_api_strict"])
def test_automatic_route_on_cpu_is_array_api(namespace, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    mod = pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    assert resolve("rms_norm", _arrays(mod)).backend == "array_api"


def test_triton_on_cpu_tensors_only_when_asked_and_interpreted(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    pytest.importorskip("triton", reason="triton is not installed")
    arrays = _arrays(torch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("rms_norm", arrays).backend == "array_api"
    assert resolve("rms_norm", arrays, backend="triton").backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendError, match="set TRITON_INTERPRET=1 before importing"):
        resolve("rms_norm", arrays, backend="triton")


def test_explicit_choice_that_cannot_serve_raises():
    with pytest.raises(BackendError, match="serves torch arrays, not numpy"):
        resolve("rms_norm", _arrays(np), backend="triton")
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        resolve("rms_norm", _arrays(np), backend="nope")
    x = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(BackendError, match="not float64"):
        resolve("rms_norm", {"x": x}, backend="triton")


def test_explicit_choice_precedence(monkeypatch):
    arrays = _arrays(torch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
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


def test_mixed_namespaces_name_the_arguments():
    x = np.ones((2, 4), np.float32)
    w = torch.ones(4)
    with pytest.raises(TypeError, match="w is a torch array but x is a numpy array"):
        xk.rms_norm(x, w)


def test_mixed_devices_name_the_arguments():
    x = torch.ones(2, 4)
    w = torch.ones(4, device="meta")
    with pytest.raises(TypeError, match="w is on device meta but x is on"):
        resolve("rms_norm", {"x": x, "w": w})


def test_cuda_tensors_fall_back_with_one_warning(monkeypatch):
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
