"""The Triton row kernels across Triton releases and at the edge of the shape space.

- Rows of no columns (``M = 0``): the triton backend writes the checkpoints the
  array_api backend writes (mean and mean square 0, so ``mean = 0`` and
  ``rstd = 1/sqrt(eps)``), without NaN or a RuntimeWarning, forward and backward.
- Every mask a row kernel hands to a load or a store is a boolean array. The
  Triton interpreter splats a scalar comparison as int32; Triton 3.6 took such
  a mask as it came, Triton 3.9 refuses it ("mask has unsupported dtype"). This
  check fails on either release, so the pinned minimum catches what would
  break the newest.

They run through the Triton interpreter (``TRITON_INTERPRET=1`` is set here
before the kernels are imported); the mask check needs it, the ``M = 0`` tests
run on CUDA instead when torch sees a GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no Triton backend")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: no Triton backend", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for triton", allow_module_level=True)

from xpkernels.backends.triton import _common
from xpkernels.backends.triton import layer_norm as ln
from xpkernels.backends.triton import rms_norm as rms
from xpkernels.backends.triton import softmax as sm

import xpkernels as xk
from xpkernels.buffers import allocate_checkpoints

EPS = 1e-5
#: The array_api backend rounds eps, the square root and the reciprocal in
#: float32 (half an ulp each); the triton launcher rounds 1/sqrt(eps) once.
RSTD_RTOL = 2 * float(np.finfo(np.float32).eps)
SHAPES = [(3, 0), (2, 4, 0)]


def _tensor(shape, seed=0, dtype=torch.float32):
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return torch.asarray(values).to(dtype=dtype, device=DEVICE)


def _run(backend, forward, backward, ck_fn, args):
    """Forward then backward on one backend with every RuntimeWarning an error."""
    x = args[0]
    ck = allocate_checkpoints(ck_fn, *args)
    for field in ck:
        field.fill_(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = forward(*args, eps=EPS, checkpoints=ck, backend=backend)
        grads = backward(torch.ones_like(x), *args, checkpoints=ck, backend=backend)
    return y, ck, grads


def _assert_empty_rows_agree(triton_run, array_api_run):
    (y_t, ck_t, grads_t), (y_a, ck_a, grads_a) = triton_run, array_api_run
    assert y_t.shape == y_a.shape and y_t.numel() == 0
    for name, got, want in zip(ck_t._fields, ck_t, ck_a):
        assert torch.isfinite(got).all(), f"{name}: {got}"
        torch.testing.assert_close(got, want, rtol=RSTD_RTOL, atol=0.0, msg=name)
    for got, want in zip(grads_t, grads_a):
        assert (got is None) == (want is None)
        assert got is None or (got.shape == want.shape and got.numel() == 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_of_empty_rows_matches_array_api(shape):
    args = (_tensor(shape), _tensor(shape[-1:], seed=1))
    runs = [
        _run(backend, xk.rms_norm, xk.rms_norm_backward, xk.rms_norm_, args)
        for backend in ("triton", "array_api")
    ]
    _assert_empty_rows_agree(*runs)
    expected = torch.full(shape[:-1], EPS**-0.5, dtype=torch.float32).reshape(-1)
    torch.testing.assert_close(
        runs[0][1].rstd.cpu().reshape(-1), expected, rtol=RSTD_RTOL, atol=0.0
    )


@pytest.mark.parametrize("affine", ["w+b", "none"])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_of_empty_rows_matches_array_api(shape, affine):
    params = (_tensor(shape[-1:], seed=1), _tensor(shape[-1:], seed=2)) if affine == "w+b" else ()
    args = (_tensor(shape), *params)
    runs = [
        _run(backend, xk.layer_norm, xk.layer_norm_backward, xk.layer_norm_, args)
        for backend in ("triton", "array_api")
    ]
    _assert_empty_rows_agree(*runs)
    assert (runs[0][1].mean == 0).all()


# ------------------------------------------------------------ masks are boolean


@pytest.fixture
def mask_dtypes(monkeypatch):
    """The numpy dtypes of every mask the interpreter's loads and stores receive."""
    if DEVICE != "cpu":
        pytest.skip("the mask check reads the Triton interpreter's arrays: CUDA compiles instead")
    from triton.runtime import interpreter

    seen = set()

    def spy(original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            mask = signature.bind(*args, **kwargs).arguments["mask"]
            if mask is not None:
                seen.add(np.asarray(mask.data).dtype)
            return original(*args, **kwargs)

        return wrapper

    builder = interpreter.InterpreterBuilder
    for name in ("create_masked_load", "create_masked_store"):
        monkeypatch.setattr(builder, name, spy(getattr(builder, name)))
    return seen


@pytest.fixture(params=["fused", "fused-row-tiles", "streaming"])
def variant(request, monkeypatch):
    """Each kernel family on 100-column rows (the same tables as ``test_triton_rows``)."""
    if request.param == "fused-row-tiles":
        monkeypatch.setitem(_common.TILE_BYTES, "forward", 16)
        monkeypatch.setitem(_common.TILE_BYTES, "backward", 16)
    if request.param == "streaming":
        for pass_ in ("forward", "backward"):
            monkeypatch.setitem(_common.FUSED_LIMIT, pass_, 32)
            monkeypatch.setitem(_common.STREAM_BLOCK, pass_, 32)
    assert _common.row_config(100, 4, "backward").streaming == (request.param == "streaming")
    return request.param


@pytest.mark.parametrize("accumulate", [False, True])
def test_row_kernels_hand_only_boolean_masks_to_loads_and_stores(variant, accumulate, mask_dtypes):
    rows, m = 9, 100
    x, dy = _tensor((rows, m)), _tensor((rows, m), seed=1)
    w, b = _tensor((m,), seed=2), _tensor((m,), seed=3)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    rstd, mean = torch.empty(rows), torch.empty(rows)
    programs = rms.partials(rows, m, x)
    dw_partial, db_partial = torch.zeros(programs, m), torch.zeros(programs, m)
    dw = torch.empty(m)

    rms.forward(y, x, w, rstd, eps=EPS, offset=1.0)
    rms.backward(dy, x, w, rstd, dx, dw_partial, offset=1.0, accumulate=accumulate)
    ln.forward(y, x, w, b, mean, rstd, eps=EPS)
    ln.backward(dy, x, w, mean, rstd, dx, dw_partial, db_partial, accumulate=accumulate)
    sm.forward(y, x)
    sm.backward(y, dy, dx)
    _common.reduce_partials(dw_partial, dw)

    assert mask_dtypes == {np.dtype(bool)}, f"masks of dtype {sorted(map(str, mask_dtypes))}"
