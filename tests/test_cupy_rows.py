"""The cupy backend's LayerNorm and softmax kernels, run unchanged through the CPU harness.

What the conformance suite's cupy-cpu targets do not reach: bfloat16 (NumPy
has none; ``ml_dtypes`` gives it here), padded row strides, scale and shift
dtypes other than x's, the streaming paths of wide rows, partial sums kept in
global memory, accumulation over row groups, determinism, the thread mode
and the sanitizers.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer
from xpkernels.backends.cupy import _rows
from xpkernels.backends.cupy import layer_norm as L
from xpkernels.backends.cupy import softmax as S

from xpkernels.testing import cudacpu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPS = 1e-5


@pytest.fixture(scope="module", params=["default", "shuffled"])
def harness(request):
    """One loader per schedule for the whole module (each source is preprocessed once)."""
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _tol(dtype, n_terms: int) -> float:
    """Relative to the largest term: output rounding plus float32 accumulation."""
    finfo = ml_dtypes.finfo if dtype is ml_dtypes.bfloat16 else np.finfo
    return 4 * float(finfo(dtype).eps) + 4 * np.sqrt(n_terms) * float(np.finfo(np.float32).eps)


def _close(out, ref, dtype, n_terms, what, scale=None):
    """``|out - ref| <= tol * scale``; ``scale``: the largest term that entered ``ref`` (default max |ref|)."""
    out = np.asarray(out).astype(np.float64)
    if scale is None:
        scale = np.abs(ref).max(initial=0.0)
    bound = _tol(dtype, n_terms) * max(scale, 1e-30)
    err = np.abs(out - ref).max(initial=0.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _rows_of(values, dtype, pad):
    """``values`` ``(rows, m)`` in a view of a wider buffer (row stride m + pad), in ``dtype``."""
    rows, m = values.shape
    base = np.zeros((rows, m + pad), dtype)
    base[:, :m] = values
    return base[:, :m]


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _layer_norm_reference(x, w, b, dy):
    x64, dy64 = _f64(x), _f64(dy)
    m = x.shape[1]
    w64 = np.ones(m) if w is None else _f64(w)
    b64 = np.zeros(m) if b is None else _f64(b)
    mean = x64.mean(axis=1) if m else np.zeros(x.shape[0])
    var = ((x64 - mean[:, None]) ** 2).mean(axis=1) if m else np.zeros(x.shape[0])
    rstd = 1.0 / np.sqrt(var + EPS)
    xh = (x64 - mean[:, None]) * rstd[:, None]
    g = dy64 * w64
    g_mean = g.mean(axis=1, keepdims=True)
    proj = xh * (g * xh).mean(axis=1, keepdims=True)
    dx = rstd[:, None] * (g - g_mean - proj)
    # dx cancels: its error scales with the terms it subtracts, not with the result
    dx_scale = (rstd[:, None] * (np.abs(g) + np.abs(g_mean) + np.abs(proj))).max(initial=0.0)
    return {
        "y": xh * w64 + b64,
        "mean": mean,
        "rstd": rstd,
        "dx": (dx, dx_scale),
        "dw": (dy64 * xh).sum(axis=0),
        "db": dy64.sum(axis=0),
    }


def _softmax_reference(x):
    x64 = _f64(x)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _softmax_backward_reference(y, dy):
    y64, dy64 = _f64(y), _f64(dy)
    dot = (y64 * dy64).sum(axis=1, keepdims=True)
    return y64 * (dy64 - dot), (np.abs(y64) * (np.abs(dy64) + np.abs(dot))).max(initial=0.0)


def _run_layer_norm(x, w, b, dy, dx, n_partials, want_dw=True, want_db=True):
    """Forward, backward and reductions; returns the results as NumPy arrays."""
    rows, m = x.shape
    y = np.full((rows, m), np.nan, x.dtype)
    mean, rstd = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
    L.forward(y, x, w, b, mean, rstd, eps=EPS)
    dw_partial = np.full((n_partials, m), np.nan, np.float32) if want_dw else None
    db_partial = np.full((n_partials, m), np.nan, np.float32) if want_db else None
    L.backward(dy, x, w, mean, rstd, dx, dw_partial, db_partial, accumulate=False)
    out = {"y": y, "mean": mean, "rstd": rstd, "dx": dx}
    for name, partial, like in (("dw", dw_partial, w), ("db", db_partial, b)):
        if partial is not None:
            out[name] = np.full(m, np.nan, np.float32 if like is None else like.dtype)
            L.reduce_partials(partial, out[name])
    return out


def _check_layer_norm(out, ref, dt, rows, m):
    _close(out["y"], ref["y"], dt, m, "y")
    _close(out["mean"], ref["mean"], np.float32, m, "mean")
    _close(out["rstd"], ref["rstd"], np.float32, m, "rstd")
    _close(out["dx"], ref["dx"][0], dt, m, "dx", ref["dx"][1])
    for name in ("dw", "db"):
        if name in out:
            _close(out[name], ref[name], out[name].dtype.type, rows * m, name)


# (rows, M, row padding, affine): warp and block kernels, vector and scalar access,
# odd rows, M not a multiple of the vector width, padded row strides; with a scale
# and a shift, either one (one partial buffer only) or neither.
LAYER_NORM_CASES = [
    (1, 1, 0, "wb"),
    (3, 31, 1, "w"),
    (13, 64, 8, "wb"),
    (9, 60, 0, "b"),
    (5, 520, 8, "wb"),
    (4, 1001, 3, ""),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "m", "pad", "affine"), LAYER_NORM_CASES)
def test_layer_norm_matches_float64(harness, dtype, rows, m, pad, affine):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(rows * 1000 + m)
    x = _rows_of(rng.standard_normal((rows, m)) * 2 + 3, dt, pad)
    dy = _rows_of(rng.standard_normal((rows, m)), dt, pad)
    w = (rng.standard_normal(m) * 0.5 + 1).astype(dt) if "w" in affine else None
    b = rng.standard_normal(m).astype(dt) if "b" in affine else None
    ref = _layer_norm_reference(x, w, b, dy)
    dx = np.full((rows, m + pad), np.nan, dt)[:, :m]
    p = L.partials(rows, m, x)
    out = _run_layer_norm(x, w, b, dy, dx, p, want_dw=w is not None, want_db=b is not None)
    _check_layer_norm(out, ref, dt, rows, m)


@pytest.mark.parametrize("m", [512, 1000])
def test_layer_norm_rows_whose_mean_dwarfs_their_spread(harness, m):
    # Mean 1e5, spread 1: float32 holds the mean only to half an ulp of 1e5 (0.004); the
    # kernels subtract the first mean and its refinement in two steps, so y keeps float32's
    # precision relative to the spread (warp kernel at M = 512, block kernel beyond).
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((4, m)) + 1e5).astype(np.float32)
    dy = rng.standard_normal((4, m)).astype(np.float32)
    ref = _layer_norm_reference(x, None, None, dy)
    y, mean, rstd = np.empty_like(x), np.empty(4, np.float32), np.empty(4, np.float32)
    L.forward(y, x, None, None, mean, rstd, eps=EPS)
    _close(y, ref["y"], np.float32, m, "y")
    _close(mean, ref["mean"], np.float32, m, "mean")
    _close(rstd, ref["rstd"], np.float32, m, "rstd")


# (rows, M, row padding): as for LayerNorm, plus masked (-inf) logits.
SOFTMAX_CASES = [(1, 1, 0), (3, 31, 1), (13, 64, 8), (5, 520, 8), (4, 1001, 3)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "m", "pad"), SOFTMAX_CASES)
def test_softmax_matches_float64(harness, dtype, rows, m, pad):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(rows * 1000 + m)
    logits = rng.standard_normal((rows, m)) * 4
    masked = rng.random((rows, m)) < 0.3
    masked[:, 0] = False
    x = _rows_of(np.where(masked, -np.inf, logits), dt, pad)
    y = np.full((rows, m + pad), np.nan, dt)[:, :m]
    S.forward(y, x)
    _close(y, _softmax_reference(x), dt, m, "y")
    assert np.all(np.asarray(y)[masked] == 0), "masked logits give 0"
    dy = _rows_of(rng.standard_normal((rows, m)), dt, pad)
    dx = np.full((rows, m), np.nan, dt)
    S.backward(y, dy, dx)
    dx_ref, scale = _softmax_backward_reference(y, dy)
    _close(dx, dx_ref, dt, m, "dx", scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_rows_stream_and_sum_partials_in_global_memory(harness, dtype, monkeypatch):
    # Few threads per block: most of each row is streamed; dw/db sums in the partials themselves.
    monkeypatch.setattr(_rows, "MAX_THREADS", 32)
    monkeypatch.setattr(_rows, "BACKWARD_MAX_THREADS", 32)
    monkeypatch.setattr(L, "SMEM_ACC_MAX_BYTES", 0)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(7)
    rows, m = 6, 1000
    x = _rows_of(rng.standard_normal((rows, m)) + 50, dt, 8)
    dy = _rows_of(rng.standard_normal((rows, m)), dt, 8)
    w = rng.standard_normal(m).astype(np.float32)  # float32 scale and shift under a low-precision x
    b = rng.standard_normal(m).astype(np.float32)
    dx = np.empty((rows, m), dt)
    out = _run_layer_norm(x, w, b, dy, dx, 3)
    _check_layer_norm(out, _layer_norm_reference(x, w, b, dy), dt, rows, m)
    # Softmax: the row max grows in the streamed part (rescaling the running sum), -inf there too.
    logits = rng.standard_normal((rows, m)) * 3 + np.linspace(0, 30, m)
    logits[:, 700:720] = -np.inf
    x = _rows_of(logits, dt, 8)
    y = np.empty((rows, m), dt)
    S.forward(y, x)
    _close(y, _softmax_reference(x), dt, m, "softmax y")
    dx = np.empty((rows, m), dt)
    S.backward(y, dy, dx)
    dx_ref, scale = _softmax_backward_reference(y, dy)
    _close(dx, dx_ref, dt, m, "softmax dx", scale)


@pytest.mark.parametrize("m", [48, 700])
def test_layer_norm_in_place_accumulate_and_spare_partials(harness, m):
    rng = np.random.default_rng(m)
    rows = 5
    x = rng.standard_normal((rows, m)).astype(np.float32)
    dy = rng.standard_normal((rows, m)).astype(np.float32)
    w = rng.standard_normal(m).astype(np.float16)  # a float16 scale under float32 x
    b = rng.standard_normal(m).astype(np.float32)
    ref = _layer_norm_reference(x, w, b, dy)
    xy = x.copy()
    mean, rstd = np.empty(rows, np.float32), np.empty(rows, np.float32)
    L.forward(xy, xy, w, b, mean, rstd, eps=EPS)  # y aliases x
    _close(xy, ref["y"], np.float32, m, "y in place")
    p = rows + 3  # more partial rows than row tiles: the spare ones are zeroed
    dw_partial = np.full((p, m), np.nan, np.float32)
    db_partial = np.full((p, m), np.nan, np.float32)
    dx = np.empty((2, m), np.float32)
    L.backward(dy[:2], x[:2], w, mean[:2], rstd[:2], dx, dw_partial, db_partial, accumulate=False)
    dxy = dy.copy()
    L.backward(
        dxy[2:], x[2:], w, mean[2:], rstd[2:], dxy[2:], dw_partial, db_partial, accumulate=True
    )  # dx aliases dy
    _close(dx, ref["dx"][0][:2], np.float32, m, "dx, first group", ref["dx"][1])
    _close(dxy[2:], ref["dx"][0][2:], np.float32, m, "dx in place, second group", ref["dx"][1])
    for name, partial in (("dw", dw_partial), ("db", db_partial)):
        out = np.empty(m, np.float32)
        L.reduce_partials(partial, out)
        _close(out, ref[name], np.float32, rows * m, f"{name} accumulated over two row groups")


@pytest.mark.parametrize("m", [48, 700])
def test_softmax_in_place(harness, m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((5, m)).astype(np.float32)
    y = x.copy()
    S.forward(y, y)  # y aliases x
    _close(y, _softmax_reference(x), np.float32, m, "y in place")
    dy = rng.standard_normal((5, m)).astype(np.float32)
    dx_ref, scale = _softmax_backward_reference(y, dy)
    S.backward(y, dy, dy)  # dx aliases dy
    _close(dy, dx_ref, np.float32, m, "dx in place", scale)


def test_empty_rows_and_rows_of_length_zero(harness):
    x = np.empty((0, 40), np.float32)
    dw_partial = np.full((2, 40), np.nan, np.float32)
    db_partial = np.full((2, 40), np.nan, np.float32)
    none = np.empty(0, np.float32)
    L.forward(x, x, None, None, none, none, eps=EPS)
    L.backward(x, x, None, none, none, x, dw_partial, db_partial, accumulate=False)
    np.testing.assert_array_equal(dw_partial, 0.0)
    np.testing.assert_array_equal(db_partial, 0.0)
    S.forward(x, x)
    S.backward(x, x, x)
    # M = 0: every row's sums are 0, so mean 0 and rstd eps^-1/2, as on array_api.
    x0 = np.empty((3, 0), np.float32)
    mean, rstd = np.full(3, np.nan, np.float32), np.full(3, np.nan, np.float32)
    L.forward(x0, x0, None, None, mean, rstd, eps=EPS)
    np.testing.assert_array_equal(mean, 0.0)
    np.testing.assert_allclose(rstd, EPS**-0.5, rtol=1e-6)
    S.forward(x0, x0)


def test_layer_norm_backward_is_deterministic():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 300)).astype(np.float16)
    dy = rng.standard_normal((40, 300)).astype(np.float16)
    ref = _layer_norm_reference(x, None, None, dy)
    mean, rstd = ref["mean"].astype(np.float32), ref["rstd"].astype(np.float32)
    results = []
    for schedule in ("default", "shuffled:7"):
        with cudacpu.emulate(schedule=schedule):
            p = L.partials(40, 300, x)
            dwp, dbp = np.empty((p, 300), np.float32), np.empty((p, 300), np.float32)
            dw, db = np.empty(300, np.float32), np.empty(300, np.float32)
            L.backward(dy, x, None, mean, rstd, np.empty_like(x), dwp, dbp, accumulate=False)
            L.reduce_partials(dwp, dw)
            L.reduce_partials(dbp, db)
            results.append((dw, db))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_unsupported_dtypes_are_refused():
    x = np.zeros((2, 8), np.float64)
    x16 = np.zeros((2, 8), np.float16)
    with cudacpu.emulate():
        with pytest.raises(TypeError, match="x has dtype float64"):
            L.forward(x, x, None, None, None, None, eps=EPS)
        with pytest.raises(TypeError, match="b has dtype float64"):
            L.forward(x16, x16, None, np.zeros(8), None, None, eps=EPS)
        with pytest.raises(TypeError, match="partials must be float32"):
            mean = np.zeros(2, np.float32)
            dwp = np.zeros((1, 8), np.float16)
            L.backward(x16, x16, None, mean, mean, x16, dwp, None, accumulate=False)
        with pytest.raises(TypeError, match="x has dtype float64"):
            S.forward(x, x)


def test_launchers_need_neither_torch_nor_triton_and_cpu_runs_import_no_cupy():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import numpy as np\n"
        "from xpkernels.backends.cupy import layer_norm, softmax\n"
        "from xpkernels.testing import cudacpu\n"
        "x = np.ones((2, 8), np.float32); x[:, 0] = 9.0; y = np.empty_like(x)\n"
        "with cudacpu.emulate():\n"
        "    layer_norm.forward(y, x, None, None, None, None, eps=1e-6)\n"
        "    s = np.empty_like(x); softmax.forward(s, x)\n"
        "assert 'cupy' not in sys.modules, 'the CPU path imported cupy'\n"
        "print(float(y[0, 1]), float(s.sum()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ln, total = map(float, proc.stdout.split())
    assert abs(ln - (-1 / np.sqrt(7))) < 1e-5 and abs(total - 2.0) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_block_kernels_with_many_rows_per_block_and_vector_access(harness, dtype):
    # Two partial rows for 12 wide rows: each block handles 6 rows, reusing its reduction scratch.
    dt = DTYPES[dtype]
    rng = np.random.default_rng(11)
    rows, m = 12, 1200  # 1200 / CACHE_ELEMENTS -> 96 threads: three warps per block
    x, dy = cudacpu.empty((rows, m), dt), cudacpu.empty((rows, m), dt)
    x[...], dy[...] = rng.standard_normal((rows, m)), rng.standard_normal((rows, m))
    w, b = cudacpu.empty(m, dt), cudacpu.empty(m, dt)
    w[...], b[...] = rng.standard_normal(m), rng.standard_normal(m)
    assert _rows.vector((x, dy), (w, b)) == 16 // x.itemsize, "aligned rows take 128-bit accesses"
    out = _run_layer_norm(x, w, b, dy, cudacpu.empty((rows, m), dt), 2)
    _check_layer_norm(out, _layer_norm_reference(x, w, b, dy), dt, rows, m)
    y = cudacpu.empty((rows, m), dt)
    S.forward(y, x)
    _close(y, _softmax_reference(x), dt, m, "softmax y")


def test_layer_norm_sums_a_wide_row_in_more_than_48k_of_shared_memory(harness):
    # dw and db sums of 6200 columns: 49.6 KB of dynamic shared memory, beyond the default limit.
    rng = np.random.default_rng(13)
    rows, m = 3, 6200
    x, dy = rng.standard_normal((rows, m)).astype(np.float32), np.ones((rows, m), np.float32)
    w, b = np.ones(m, np.float32), np.zeros(m, np.float32)
    assert 2 * m * 4 > _rows.DEFAULT_SHARED and 2 * m * 4 <= L.SMEM_ACC_MAX_BYTES
    out = _run_layer_norm(x, w, b, dy, np.empty_like(x), 2)
    _check_layer_norm(out, _layer_norm_reference(x, w, b, dy), np.float32, rows, m)


def test_thread_per_cuda_thread_mode_gives_the_same_results():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 600)).astype(np.float32)
    w = rng.standard_normal(600).astype(np.float32)
    outs = []
    for mode in ("fibers", "threads"):
        with cudacpu.emulate(mode=mode):
            out = _run_layer_norm(x, w, w, x, np.empty_like(x), 2)
            y = np.empty_like(x)
            S.forward(y, x)
            dx = np.empty_like(x)
            S.backward(y, x, dx)
            outs.append([*out.values(), y, dx])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import layer_norm as L, softmax as S
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
with cudacpu.emulate():
    rows, m = 2, 600  # block-per-row LayerNorm, float32, with scale and shift
    x = cudacpu.empty((rows, m), np.float32); x[...] = rng.standard_normal((rows, m))
    w = cudacpu.empty(m, np.float32); w[...] = 1.5
    y, mean, rstd = cudacpu.empty((rows, m), np.float32), cudacpu.empty(rows), cudacpu.empty(rows)
    L.forward(y, x, w, w, mean, rstd, eps=1e-5)
    dx, dwp, dbp = cudacpu.empty((rows, m)), cudacpu.empty((2, m)), cudacpu.empty((2, m))
    L.backward(x, x, w, mean, rstd, dx, dwp, dbp, accumulate=False)
    dw = cudacpu.empty(m, np.float32)
    L.reduce_partials(dwp, dw)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5) * 1.5 + 1.5
    assert np.abs(y - ref).max() < 1e-4
    rows, m = 4, 64  # warp-per-row softmax, bfloat16
    xs = cudacpu.empty((rows, m), ml_dtypes.bfloat16); xs[...] = rng.standard_normal((rows, m))
    ys, dxs = cudacpu.empty((rows, m), ml_dtypes.bfloat16), cudacpu.empty((rows, m), ml_dtypes.bfloat16)
    S.forward(ys, xs)
    S.backward(ys, xs, dxs)
    assert np.abs(ys.astype(np.float64).sum(1) - 1).max() < 0.05
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_kernels_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)
