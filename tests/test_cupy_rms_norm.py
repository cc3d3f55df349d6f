"""The cupy backend's RMSNorm kernels, run unchanged through the CPU harness (xpkernels.testing.cudacpu)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer
from xpkernels.backends.cupy import _rows as geometry
from xpkernels.backends.cupy import rms_norm as R

from xpkernels.testing import cudacpu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPS = 1e-5


@pytest.fixture(params=["default", "shuffled"])
def harness(request):
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _tol(dtype, n_terms: int) -> float:
    """Relative to the largest reference value: output rounding plus float32 accumulation."""
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


def _rows(rng, rows, m, dtype, pad):
    """A (rows, m) view into a wider buffer (row stride m + pad); values in dtype."""
    base = rng.standard_normal((rows, m + pad)).astype(dtype)
    return base[:, :m]


def _reference(x, w, dy, offset):
    x64 = np.asarray(x).astype(np.float64)
    w64 = np.ones(x.shape[1]) if w is None else np.asarray(w).astype(np.float64)
    wp = w64 + offset
    rstd = (
        1.0 / np.sqrt((x64**2).mean(axis=1) + EPS) if x.shape[1] else np.full(x.shape[0], EPS**-0.5)
    )
    xh = x64 * rstd[:, None]
    y = xh * wp
    g = np.asarray(dy).astype(np.float64) * wp
    proj = xh * (g * xh).mean(axis=1, keepdims=True)
    dx = rstd[:, None] * (g - proj)
    # dx cancels: its error scales with the terms it subtracts, not with the result
    dx_scale = (rstd[:, None] * (np.abs(g) + np.abs(proj))).max(initial=0.0)
    dw = (np.asarray(dy).astype(np.float64) * xh).sum(axis=0)
    return y, rstd, (dx, dx_scale), dw


# (rows, M, row padding): warp and block kernels, vector and scalar access,
# odd rows, M not a multiple of the vector width, padded row strides.
SHAPES = [
    (1, 1, 0),
    (3, 31, 1),
    (13, 64, 8),
    (9, 60, 0),
    (5, 520, 8),
    (4, 1001, 3),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "m", "pad"), SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_and_backward_match_float64(harness, dtype, rows, m, pad, with_weight):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(rows * 1000 + m)
    x = _rows(rng, rows, m, dt, pad)
    dy = _rows(rng, rows, m, dt, pad)
    w = (rng.standard_normal(m) * 0.5 + 1).astype(dt) if with_weight else None
    offset = 0.25
    y_ref, rstd_ref, dx_ref, dw_ref = _reference(x, w, dy, offset)
    y = np.full((rows, m), np.nan, dt)
    rstd = np.full(rows, np.nan, np.float32)
    R.forward(y, x, w, rstd, eps=EPS, offset=offset)
    _close(y, y_ref, dt, m, "y")
    _close(rstd, rstd_ref, np.float32, m, "rstd")
    dx = np.full((rows, m + pad), np.nan, dt)[:, :m]
    p = R.partials(rows, m, x)
    dw_partial = np.full((p, m), np.nan, np.float32)
    R.backward(dy, x, w, rstd, dx, dw_partial, offset=offset, accumulate=False)
    _close(dx, dx_ref[0], dt, m, "dx", dx_ref[1])
    dw = np.full(m, np.nan, dt)
    R.reduce_partials(dw_partial, dw)
    _close(dw, dw_ref, dt, rows * m, "dw")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_rows_stream_and_sum_dw_in_global_memory(harness, dtype, monkeypatch):
    # Few threads per block: most of each row is re-read (streaming); dw sums in dw_partial itself.
    monkeypatch.setattr(geometry, "MAX_THREADS", 32)
    monkeypatch.setattr(geometry, "BACKWARD_MAX_THREADS", 32)
    monkeypatch.setattr(R, "SMEM_ACC_MAX_BYTES", 0)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(7)
    rows, m = 6, 1000
    x, dy = _rows(rng, rows, m, dt, 8), _rows(rng, rows, m, dt, 8)
    w = rng.standard_normal(m).astype(np.float32)  # float32 weight under a low-precision x
    y_ref, _, dx_ref, dw_ref = _reference(x, w, dy, 0.0)
    y, rstd = np.empty((rows, m), dt), np.empty(rows, np.float32)
    R.forward(y, x, w, rstd, eps=EPS, offset=0.0)
    _close(y, y_ref, dt, m, "y")
    dx, dw_partial = np.empty((rows, m), dt), np.full((3, m), np.nan, np.float32)
    R.backward(dy, x, w, rstd, dx, dw_partial, offset=0.0, accumulate=False)
    _close(dx, dx_ref[0], dt, m, "dx", dx_ref[1])
    dw = np.empty(m, np.float32)
    R.reduce_partials(dw_partial, dw)
    _close(dw, dw_ref, np.float32, rows * m, "dw")


@pytest.mark.parametrize("m", [48, 700])
def test_in_place_accumulate_and_spare_partials(harness, m):
    rng = np.random.default_rng(m)
    rows = 5
    x = rng.standard_normal((rows, m)).astype(np.float32)
    dy = rng.standard_normal((rows, m)).astype(np.float32)
    w = rng.standard_normal(m).astype(np.float32)
    y_ref, _, dx_ref, dw_ref = _reference(x, w, dy, 0.0)
    xy = x.copy()
    rstd = np.empty(rows, np.float32)
    R.forward(xy, xy, w, rstd, eps=EPS, offset=0.0)  # y aliases x
    _close(xy, y_ref, np.float32, m, "y in place")
    p = rows + 3  # more partial rows than row tiles: the spare ones are zeroed
    dw_partial = np.full((p, m), np.nan, np.float32)
    dx = np.empty((2, m), np.float32)
    R.backward(dy[:2], x[:2], w, rstd[:2], dx, dw_partial, offset=0.0, accumulate=False)
    dxy = dy.copy()
    R.backward(
        dxy[2:], x[2:], w, rstd[2:], dxy[2:], dw_partial, offset=0.0, accumulate=True
    )  # dx aliases dy
    _close(dx, dx_ref[0][:2], np.float32, m, "dx, first group", dx_ref[1])
    _close(dxy[2:], dx_ref[0][2:], np.float32, m, "dx in place, second group", dx_ref[1])
    dw = np.empty(m, np.float32)
    R.reduce_partials(dw_partial, dw)
    _close(dw, dw_ref, np.float32, rows * m, "dw accumulated over two row groups")


def test_no_rows_zeroes_the_partials(harness):
    x = np.empty((0, 40), np.float32)
    dw_partial = np.full((2, 40), np.nan, np.float32)
    R.backward(x, x, None, np.empty(0, np.float32), x, dw_partial, offset=0.0, accumulate=False)
    np.testing.assert_array_equal(dw_partial, 0.0)


def test_backward_is_deterministic():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 300)).astype(np.float16)
    dy = rng.standard_normal((40, 300)).astype(np.float16)
    rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + EPS)).astype(np.float32)
    results = []
    for schedule in ("default", "shuffled:7"):
        with cudacpu.emulate(schedule=schedule):
            part = np.empty((R.partials(40, 300, x), 300), np.float32)
            dw = np.empty(300, np.float32)
            R.backward(dy, x, None, rstd, np.empty_like(x), part, offset=0.0, accumulate=False)
            R.reduce_partials(part, dw)
            results.append(dw)
    np.testing.assert_array_equal(results[0], results[1])


def test_unsupported_dtypes_are_refused_and_unpaired_ones_run_in_float32():
    x = np.zeros((2, 8), np.float64)
    x16 = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float16)
    w = np.linspace(-1, 1, 8)
    with cudacpu.emulate():
        with pytest.raises(TypeError, match="float64"):
            R.forward(x, x, None, None, eps=EPS, offset=0.0)
        assert R.supports(x16, w.astype(ml_dtypes.bfloat16)) is not None
        y, y32 = np.empty((2, 8), np.float16), np.empty((2, 8), np.float32)
        R.forward(y, x16, w.astype(ml_dtypes.bfloat16), None, eps=EPS, offset=0.0)
        w32 = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        R.forward(y32, x16.astype(np.float32), w32, None, eps=EPS, offset=0.0)
        np.testing.assert_array_equal(y, y32.astype(np.float16))
    assert R.supports(np.zeros(1, np.float16), np.zeros(1, np.float32)) is None


def test_launchers_need_neither_torch_nor_triton_and_cpu_runs_import_no_cupy():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import numpy as np\n"
        "from xpkernels.backends.cupy import rms_norm\n"
        "from xpkernels.testing import cudacpu\n"
        "x = np.ones((2, 8), np.float32); y = np.empty_like(x)\n"
        "with cudacpu.emulate():\n"
        "    rms_norm.forward(y, x, None, None, eps=1e-6, offset=0.0)\n"
        "assert 'cupy' not in sys.modules, 'the CPU path imported cupy'\n"
        "print(float(y[0, 0]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert abs(float(proc.stdout) - 1.0) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_block_kernel_with_many_rows_per_block(harness, dtype):
    # Two partial rows for 12 wide rows: each block normalises 6 rows, reusing its reduction scratch.
    dt = DTYPES[dtype]
    rng = np.random.default_rng(11)
    rows, m = 12, 1200  # 1200 / CACHE_ELEMENTS -> 96 threads: three warps per block
    x = cudacpu.empty((rows, m), dt)
    dy = cudacpu.empty((rows, m), dt)
    x[...], dy[...] = rng.standard_normal((rows, m)), rng.standard_normal((rows, m))
    w = cudacpu.empty(m, dt)
    w[...] = rng.standard_normal(m)
    assert R.vector((x, dy), (w,)) == 16 // x.itemsize, "aligned rows take 128-bit accesses"
    _, rstd_ref, dx_ref, dw_ref = _reference(x, w, dy, 0.0)
    rstd = rstd_ref.astype(np.float32)
    dx, dw_partial = np.empty((rows, m), dt), np.full((2, m), np.nan, np.float32)
    R.backward(dy, x, w, rstd, dx, dw_partial, offset=0.0, accumulate=False)
    _close(dx, dx_ref[0], dt, m, "dx", dx_ref[1])
    dw = np.empty(m, dt)
    R.reduce_partials(dw_partial, dw)
    _close(dw, dw_ref, dt, rows * m, "dw")


def test_thread_per_cuda_thread_mode_gives_the_same_results():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 600)).astype(np.float32)
    w = rng.standard_normal(600).astype(np.float32)
    outs = []
    for mode in ("fibers", "threads"):
        with cudacpu.emulate(mode=mode):
            y, rstd = np.empty_like(x), np.empty(5, np.float32)
            R.forward(y, x, w, rstd, eps=EPS, offset=0.0)
            dx, part = np.empty_like(x), np.empty((2, 600), np.float32)
            R.backward(x, x, w, rstd, dx, part, offset=0.0, accumulate=False)
            outs.append((y, rstd, dx, part))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import rms_norm as R
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
with cudacpu.emulate():
    for rows, m, dt in ((9, 60, np.float32), (3, 600, ml_dtypes.bfloat16)):
        x = cudacpu.empty((rows, m), dt); x[...] = rng.standard_normal((rows, m))
        w = cudacpu.empty(m, dt); w[...] = 1.5
        y, rstd = cudacpu.empty((rows, m), dt), cudacpu.empty(rows, np.float32)
        R.forward(y, x, w, rstd, eps=1e-5, offset=0.0)
        dx, part = cudacpu.empty((rows, m), dt), cudacpu.empty((2, m), np.float32)
        R.backward(x, x, w, rstd, dx, part, offset=0.0, accumulate=False)
        dw = cudacpu.empty(m, dt)
        R.reduce_partials(part, dw)
        ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * 1.5
        assert np.abs(y.astype(np.float64) - ref).max() < 0.05
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_kernels_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)
