"""The SwiGLU backend modules (array_api, triton, cupy), driven directly on 2-D row views.

What the conformance templates cannot see from the fronts: every backend's
module on the ``(rows, M)`` views the fronts pass -- padded row strides (and
nothing written between rows), rows that do not fill the last tile, M odd or
not a multiple of the vector width, M = 1, tiles shrunk so that small rows
cross many row and column tiles, the in-place aliases (``y`` is ``a`` or
``b``, ``da`` or ``db`` is ``dy``), large ``|a|`` without an overflow warning,
and NaN / +-inf against ``torch.nn.functional.silu``.

Triton runs through its interpreter on CPU tensors (``TRITON_INTERPRET=1`` is
set here before its kernels are imported) or on CUDA when torch sees a GPU;
the CUDA C of the cupy backend runs unchanged through
``xpkernels.testing.cudacpu`` in its default and shuffled schedules, bfloat16
through ``ml_dtypes``.

Tolerances come from the dtypes, per element: the output's rounding
(``2 eps_out |ref|``), the float32 computation (``8 eps_acc`` times the
magnitude of the terms the result is made of, with the sigmoid's relative
error amplified by ``|a| (1 - s)``) and one smallest normal of the output
(flushed subnormals).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import zlib

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer

from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

_TORCH = importlib.util.find_spec("torch") is not None
_TRITON = _TORCH and importlib.util.find_spec("triton") is not None
if _TORCH:
    import torch

    _DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    if _DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
_TRITON = _TRITON and (_DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
if _TRITON:
    from xpkernels.backends.triton import swiglu as triton_swiglu

from xpkernels.backends.array_api import _blocks
from xpkernels.backends.array_api import swiglu as array_api_swiglu
from xpkernels.backends.cupy import _rows
from xpkernels.backends.cupy import swiglu as cupy_swiglu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

#: (mantissa bits, smallest normal exponent) of each dtype: its eps and smallest normal.
_FORMAT = {
    "float64": (52, -1022),
    "float32": (23, -126),
    "float16": (10, -14),
    "bfloat16": (7, -126),
}


def _eps(dtype: str) -> float:
    return 2.0 ** -_FORMAT[dtype][0]


def _tiny(dtype: str) -> float:
    return 2.0 ** _FORMAT[dtype][1]


# ---------------------------------------------------------------- the backends under test


class _Runner:
    """One backend module on one kind of array: builds padded row views, runs, reads back."""

    def __init__(self, name, module, dtypes, context=contextlib.nullcontext):
        self.name, self.module, self.dtypes, self.context = name, module, dtypes, context

    def rows(self, values, dtype, pad, fill=np.nan):
        """``values`` (2-D float64) as ``dtype``, in a buffer of rows ``pad`` elements longer."""
        raise NotImplementedError

    def empty(self, rows, m, dtype, pad):
        return self.rows(np.full((rows, m), np.nan), dtype, pad)

    def numpy(self, a) -> np.ndarray:
        raise NotImplementedError

    def gap(self, a) -> np.ndarray:
        """The padding past column M of every row of ``a``'s buffer."""
        raise NotImplementedError


class _NumpyRunner(_Runner):
    _TYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}

    def _type(self, dtype):
        return ml_dtypes.bfloat16 if dtype == "bfloat16" else self._TYPES[dtype]

    def rows(self, values, dtype, pad, fill=np.nan):
        rows, m = values.shape
        base = cudacpu.empty((rows, m + pad), self._type(dtype))  # 16-byte aligned data
        base[...] = fill
        base[:, :m] = values
        return base[:, :m]

    def numpy(self, a):
        return np.asarray(a).astype(np.float64)

    def gap(self, a):
        rows, m = a.shape
        pad = a.strides[0] // a.itemsize - m if rows else 0
        whole = np.lib.stride_tricks.as_strided(a, (rows, m + pad), a.strides, writeable=False)
        return whole[:, m:].astype(np.float64)


class _TorchRunner(_Runner):
    def rows(self, values, dtype, pad, fill=np.nan):
        rows, m = values.shape
        base = torch.full((rows, m + pad), fill, dtype=getattr(torch, dtype), device=_DEVICE)
        base[:, :m] = torch.from_numpy(np.asarray(values, dtype=np.float64))
        return base[:, :m]

    def numpy(self, a):
        return a.detach().to("cpu", torch.float64).numpy()

    def gap(self, a):
        return a._base[:, a.shape[1] :].to("cpu", torch.float64).numpy()


def _runners():
    """``(runner or None, skip reason or None)`` for each backend module and array kind."""
    cupy_dtypes = ("float32", "float16", "bfloat16")
    no_torch = None if _TORCH else "torch is not installed"
    no_triton = None if _TRITON else "triton (with torch) is not installed"
    found = [
        (
            _NumpyRunner("array_api-numpy", array_api_swiglu, ("float64", "float32", "float16")),
            None,
        ),
        (
            _TorchRunner(
                "array_api-torch", array_api_swiglu, ("float64", "float32", "float16", "bfloat16")
            )
            if _TORCH
            else None,
            no_torch,
        ),
        (_TorchRunner("triton", triton_swiglu, cupy_dtypes) if _TRITON else None, no_triton),
    ]
    for schedule in ("default", "shuffled"):
        found.append(
            (
                _NumpyRunner(
                    f"cupy-{schedule}",
                    cupy_swiglu,
                    cupy_dtypes,
                    lambda schedule=schedule: cudacpu.emulate(schedule=schedule),
                ),
                None,
            )
        )
    return found


_IDS = ["array_api-numpy", "array_api-torch", "triton", "cupy-default", "cupy-shuffled"]


def _skip(reason):
    return [pytest.mark.skip(reason=reason)] if reason else []


#: Every backend module on its arrays.
RUNNERS = [
    pytest.param(r, id=name, marks=_skip(reason)) for name, (r, reason) in zip(_IDS, _runners())
]
#: Every backend module on its arrays, with each dtype it runs.
RUNNER_DTYPES = [
    pytest.param(r, dtype, id=f"{name}-{dtype}", marks=_skip(reason))
    for name, (r, reason) in zip(_IDS, _runners())
    for dtype in (r.dtypes if r is not None else ("float32",))
]


@pytest.fixture(params=RUNNERS)
def runner(request):
    """A backend module on its arrays, inside its context (``cudacpu.emulate`` for cupy)."""
    with request.param.context():
        yield request.param


@pytest.fixture(params=["shipped", "small-tiles"])
def variant(request, runner, monkeypatch):
    """The shipped launch geometry, or tiles so small that the test rows cross many of them.

    ``small-tiles``: array_api blocks of 64 elements (many blocks, several
    worker threads on NumPy); Triton tiles of 64 bytes along a row and 256
    (forward) / 128 (backward) in all; cupy blocks of 32 threads, at most two
    blocks along a row, which then stride over the rest of it.
    """
    if request.param == "small-tiles":
        if runner.module is array_api_swiglu:
            monkeypatch.setattr(_blocks, "ROW_BLOCK_ELEMENTS", 64)
        elif runner.module is cupy_swiglu:
            monkeypatch.setattr(cupy_swiglu, "THREADS", 32)
            monkeypatch.setattr(cupy_swiglu, "MAX_COLUMN_BLOCKS", 2)
        else:
            monkeypatch.setattr(runner.module, "COLUMN_BYTES", 64)
            monkeypatch.setattr(runner.module, "TILE_BYTES", {"forward": 256, "backward": 128})
    return request.param


# ---------------------------------------------------------------- inputs and references


def _rng(*seed):
    return np.random.default_rng(zlib.crc32("/".join(map(str, seed)).encode()))


#: Gate values far out in both tails; every fifth input element is one of them.
LARGE_A = (60.0, -60.0, 1e4, -1e4, 30.0, -30.0, 16.0, -16.0, 12.0, 9.0, 6.0)


def _values(rows, m, seed):
    """Float64 ``a`` (scale 3, with :data:`LARGE_A` spread in), ``b`` and ``dy`` in [-2, 2]."""
    rng = _rng(rows, m, seed)
    a = rng.standard_normal((rows, m)) * 3
    flat = a.reshape(-1)
    flat[::5] = np.resize(LARGE_A, flat[::5].size)
    return a, rng.uniform(-2, 2, (rows, m)), rng.uniform(-2, 2, (rows, m))


def _scales(a, b, dy):
    """Per element, the magnitudes of the terms ``y``, ``da`` and ``db`` are made of.

    The sigmoid's relative error (from ``exp``: about ``|a|`` float32 units at
    large ``|a|``) reaches ``s`` through ``1 - s``, hence the factor ``1 + |a| (1 - s)``.
    """
    e = np.exp(-np.abs(a))
    s = np.where(a >= 0, 1 / (1 + e), e / (1 + e))
    amp = 1 + np.abs(a) * (1 - s)
    y = np.abs(a * b) * s * amp
    da = np.abs(dy * b) * s * (amp + (1 + np.abs(a)) * np.abs(a) * (1 - s))
    db = np.abs(dy * a) * s * amp
    return y, da, db


def _assert_close(got, want, scale, dtype, what):
    """``|got - want| <= 2 eps_out |want| + 8 eps_acc scale + tiny_out``, element by element."""
    eps_acc = _eps("float64" if dtype == "float64" else "float32")
    bound = 2 * _eps(dtype) * np.abs(want) + 8 * eps_acc * scale + _tiny(dtype)
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / bound, 0)), err.shape)
        pytest.fail(
            f"{what}: {int(bad.sum())} elements off; worst at {i}: got {got[i]!r}, "
            f"want {want[i]!r}, bound {bound[i]:.3g}"
        )


def _run(runner, a, b, dy, dtype):
    """Forward and backward into NaN-filled padded outputs; returns them (backend arrays)."""
    rows, m = a.shape
    y, da, db = (runner.empty(rows, m, dtype, pad=3) for _ in range(3))
    runner.module.forward(y, a, b)
    runner.module.backward(dy, a, b, da, db)
    return y, da, db


# ---------------------------------------------------------------- accuracy

# (rows, M, row padding): one element; M = 1 over many rows; M odd; rows that do not fill
# a tile; aligned rows (16-byte vectors) with an aligned padding; M not a multiple of the
# vector width; rows wider than one tile along the row (several column tiles or blocks).
SHAPES = [(1, 1, 0), (300, 1, 1), (3, 5, 3), (37, 100, 4), (13, 64, 8), (4, 1001, 3), (3, 2500, 16)]


@pytest.mark.parametrize(("runner", "dtype"), RUNNER_DTYPES, indirect=["runner"])
@pytest.mark.parametrize(("rows", "m", "pad"), SHAPES)
def test_forward_backward_match_float64(runner, variant, dtype, rows, m, pad):
    a64, b64, dy64 = _values(rows, m, "accuracy")
    a, b, dy = (runner.rows(v, dtype, pad) for v in (a64, b64, dy64))
    exact = [runner.numpy(v) for v in (a, b, dy)]  # the rounded inputs' float64 values
    y, da, db = _run(runner, a, b, dy, dtype)
    y_ref = ref.swiglu(exact[0], exact[1])
    da_ref, db_ref = ref.swiglu_backward(*exact)
    y_scale, da_scale, db_scale = _scales(*exact)
    _assert_close(runner.numpy(y), y_ref, y_scale, dtype, "y")
    _assert_close(runner.numpy(da), da_ref, da_scale, dtype, "da")
    _assert_close(runner.numpy(db), db_ref, db_scale, dtype, "db")
    for name, out in (("y", y), ("da", da), ("db", db)):
        assert np.isnan(runner.gap(out)).all(), f"{name}: a kernel wrote past column M"
    np.testing.assert_array_equal(runner.numpy(a), exact[0], err_msg="a must not be written")


def test_nan_and_inf_behave_as_torch_silu(runner):
    """NaN in any input propagates; ``a = +-inf`` gives torch's results (float64 autograd
    of ``silu(a) * b``): ``y(+inf) = +-inf``, ``y(-inf)`` and ``da(+-inf)`` NaN, and
    ``db(-inf)`` NaN. ``inf * 0`` is an invalid operation to NumPy (the array_api
    backend, the Triton interpreter), which would warn: silenced here, results checked."""
    torch_ = pytest.importorskip("torch", reason="the oracle is torch.nn.functional.silu")
    inf, nan = np.inf, np.nan
    a = np.array(
        [
            [inf, -inf, nan, 60.0, -60.0, 1e4, -1e4, 0.0, -0.0, 1.0, -1.2785, 3.0],
            [-inf, inf, 2.0, -2.0, nan, 0.5, -1e4, 1e4, -0.5, 7.0, -7.0, 0.0],
        ]
    )
    b = np.array(
        [
            [1.5, -1.5, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0, 1.0],
            [-0.5, 0.5, nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0],
        ]
    )
    dy = np.array(
        [
            [1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0],
            [1.0, -2.0, 1.0, 1.0, 1.0, nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    for dtype in runner.dtypes:
        if dtype == "float64":
            continue
        ins = [runner.rows(v, dtype, pad=2) for v in (a, b, dy)]
        exact = [runner.numpy(v) for v in ins]
        with np.errstate(invalid="ignore"):
            y, da, db = _run(runner, *ins, dtype)
            a_t, b_t = (torch_.tensor(v, requires_grad=True) for v in exact[:2])
            y_t = torch_.nn.functional.silu(a_t) * b_t
            y_t.backward(torch_.tensor(exact[2]))
            wants = {"y": y_t, "da": a_t.grad, "db": b_t.grad}
            scales = dict(zip(("y", "da", "db"), _scales(*exact)))
            for name, got in (("y", y), ("da", da), ("db", db)):
                got, want = runner.numpy(got), wants[name].detach().numpy()
                np.testing.assert_array_equal(
                    np.isnan(got), np.isnan(want), err_msg=f"{name} {dtype}: NaN positions"
                )
                finite = np.isfinite(want)
                np.testing.assert_array_equal(
                    got[~finite & ~np.isnan(want)],
                    want[~finite & ~np.isnan(want)],
                    err_msg=f"{name} {dtype}: infinities",
                )
                _assert_close(
                    got[finite], want[finite], scales[name][finite], dtype, f"{name} {dtype}"
                )


def test_large_gates_warn_nothing_and_saturate(runner):
    """``|a|`` up to 1e4 (whose ``exp(|a|)`` overflows every float type): no warning (the
    test configuration turns RuntimeWarning into errors), ``silu(a) = a`` for large positive
    ``a``, ``-0`` for large negative ``a``, and the derivative 1 / 0 there."""
    a64 = np.array([[60.0, -60.0, 1e4, -1e4, 100.0, -100.0, 89.0, -89.0]])
    ones = np.ones_like(a64)
    dtype = "float32"
    a, b, dy = (runner.rows(v, dtype, pad=0) for v in (a64, ones, ones))
    y, da, db = (runner.numpy(v) for v in _run(runner, a, b, dy, dtype))
    positive = a64 > 0
    np.testing.assert_array_equal(y[positive], a64[positive])
    np.testing.assert_array_equal(da[positive], 1.0)
    assert np.all(np.abs(y[~positive]) < 1e-24) and np.all(np.abs(da[~positive]) < 1e-22)
    np.testing.assert_array_equal(db, y)


# ---------------------------------------------------------------- aliasing


@pytest.mark.parametrize(("rows", "m", "pad"), [(9, 100, 4), (5, 37, 3), (6, 64, 0)])
def test_in_place_aliases_give_the_unaliased_results(runner, variant, rows, m, pad):
    """``y`` the very same array as ``a`` or as ``b``; ``da`` or ``db`` the very same as ``dy``."""
    dtype = "float32"
    a64, b64, dy64 = _values(rows, m, "alias")

    def fresh():
        return [runner.rows(v, dtype, pad) for v in (a64, b64, dy64)]

    a, b, dy = fresh()
    y, da, db = (runner.numpy(v) for v in _run(runner, a, b, dy, dtype))
    a, b, dy = fresh()
    runner.module.forward(a, a, b)
    np.testing.assert_array_equal(runner.numpy(a), y, err_msg="y is a")
    a, b, dy = fresh()
    runner.module.forward(b, a, b)
    np.testing.assert_array_equal(runner.numpy(b), y, err_msg="y is b")
    a, b, dy = fresh()
    db_out = runner.empty(rows, m, dtype, pad)
    runner.module.backward(dy, a, b, dy, db_out)
    np.testing.assert_array_equal(runner.numpy(dy), da, err_msg="da is dy")
    np.testing.assert_array_equal(runner.numpy(db_out), db, err_msg="db beside da is dy")
    a, b, dy = fresh()
    da_out = runner.empty(rows, m, dtype, pad)
    runner.module.backward(dy, a, b, da_out, dy)
    np.testing.assert_array_equal(runner.numpy(dy), db, err_msg="db is dy")
    np.testing.assert_array_equal(runner.numpy(da_out), da, err_msg="da beside db is dy")


def test_no_rows_and_empty_rows_write_nothing(runner):
    for rows, m in ((0, 8), (3, 0)):
        a = runner.rows(np.zeros((rows, m)), "float32", pad=2)
        runner.module.forward(a, a, a)
        runner.module.backward(a, a, a, a, a)
        assert np.isnan(runner.gap(a)).all()


# ---------------------------------------------------------------- launch geometry


@pytest.mark.skipif(not _TRITON, reason="triton (with torch) is not installed")
@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("m", [1, 5, 64, 100, 1001, 2048, 4096, 65536, 151936])
def test_triton_tile_config(pass_, itemsize, m):
    tile_rows, block_m, warps = triton_swiglu.tile_config(m, itemsize, pass_)
    for n in (tile_rows, block_m, warps):
        assert n >= 1 and n & (n - 1) == 0, "powers of two"
    assert (block_m * itemsize) % 16 == 0, "a tile's row spans whole 16-byte vectors"
    assert block_m * itemsize <= max(triton_swiglu.COLUMN_BYTES, 16)
    assert tile_rows * block_m * itemsize == triton_swiglu.TILE_BYTES[pass_]
    per_thread = tile_rows * block_m * itemsize // (32 * warps)
    assert per_thread == 16 * triton_swiglu.VECTORS_PER_THREAD[pass_], "whole 16-byte vectors"
    if m * itemsize <= triton_swiglu.COLUMN_BYTES:
        assert block_m >= m, "a short row fits one tile"


@pytest.mark.parametrize(
    ("rows", "m", "v"),
    [(1, 1, 1), (300, 1, 1), (7, 5, 1), (13, 64, 4), (3, 2500, 8), (2, 10**6, 4)],
)
def test_cupy_geometry_covers_every_element(rows, m, v):
    u = _rows.cache(v)
    (gx, gy), (x, y) = cupy_swiglu._geometry(rows, m, v, u)
    assert x * y == cupy_swiglu.THREADS and x & (x - 1) == 0
    assert gx * y >= rows > (gx - 1) * y, "the blocks cover the rows, none idle"
    assert gy <= cupy_swiglu.MAX_COLUMN_BLOCKS
    steps = -(-m // (v * u))
    assert x * gy >= min(steps, x * cupy_swiglu.MAX_COLUMN_BLOCKS)
    assert x <= max(steps, 1) * 2, "no more threads along a row than twice its steps"


def test_cupy_takes_128_bit_accesses_where_aligned_and_refuses_mixed_dtypes():
    runner = _NumpyRunner("cupy", cupy_swiglu, ())
    aligned = [runner.rows(np.ones((4, 64)), "bfloat16", pad=8) for _ in range(3)]
    assert _rows.vector(aligned) == 8
    assert _rows.vector([*aligned, runner.rows(np.ones((4, 64)), "bfloat16", pad=3)]) == 1
    assert _rows.vector([runner.rows(np.ones((4, 63)), "bfloat16", pad=1)]) == 1
    assert len(cupy_swiglu.name_expressions()) == 12, "3 dtypes x 2 widths x 2 passes"
    x32, x16 = np.ones((2, 8), np.float32), np.ones((2, 8), np.float16)
    with cudacpu.emulate():
        with pytest.raises(TypeError, match="every array must have a's dtype"):
            cupy_swiglu.forward(x32, x16, x16)
        with pytest.raises(TypeError, match="a has dtype float64"):
            cupy_swiglu.backward(*(np.ones((2, 8)),) * 5)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import swiglu
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
with cudacpu.emulate():
    for dtype, m in ((np.float32, 64), (ml_dtypes.bfloat16, 37)):  # vector and scalar paths
        a, b, dy = (cudacpu.empty((3, m), dtype) for _ in range(3))
        for v in (a, b, dy):
            v[...] = rng.standard_normal((3, m))
        y, da, db = (cudacpu.empty((3, m), dtype) for _ in range(3))
        swiglu.forward(y, a, b)
        swiglu.backward(dy, a, b, da, db)
        swiglu.backward(dy, a, b, dy, db)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        assert np.abs(y - a64 / (1 + np.exp(-a64)) * b64).max() < 0.05
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_cupy_kernels_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)
