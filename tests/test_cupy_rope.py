"""The cupy backend's rotary-embedding kernel (``rope.cu``), run unchanged through the CPU harness
(``xpkernels.testing.cudacpu``) in its default and shuffled schedules.

Both passes against the float64 reference (``xpkernels.testing.references.rope``)
in float32, float16 and bfloat16 (``ml_dtypes``), both pair layouts, full and
partial rotary dims, the 128-bit and the scalar paths (R2 not a multiple of
the vector width, misaligned table rows), odd S and H, tables shared over the
batch (stride 0) or per batch in every table dtype, position ids absent, int32
or int64, BSHD views of padded buffers (nothing written outside the view: NaN
sentinels), blocks so small that threads stride over units and heads, the
in-place aliases, the forward-then-backward round trip, empty arrays, the
CUDA C compiled by NVRTC and bugs planted in it that these checks must catch.

Tolerances come from the dtypes, per element: the output's rounding
(``2 eps_out |want|``), the float32 computation (``8 eps_32`` times
``|x1 c| + |x2 s|``, the terms of the pair) and one smallest normal of the
output; the copied elements must be exact.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report
from xpkernels.backends.cupy import rope

from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TABLE_DTYPES = {**DTYPES, "float64": np.float64}
#: (mantissa bits, smallest normal exponent) of each dtype: its eps and smallest normal.
_FORMAT = {"float32": (23, -126), "float16": (10, -14), "bfloat16": (7, -126)}


def _eps(dtype: str) -> float:
    return 2.0 ** -_FORMAT[dtype][0]


def _tiny(dtype: str) -> float:
    return 2.0 ** _FORMAT[dtype][1]


@pytest.fixture(scope="module", params=["default", "shuffled"])
def harness(request):
    """One loader per schedule for the whole module (each dtype's module compiled once)."""
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _rng(*seed):
    return np.random.default_rng(zlib.crc32("/".join(map(str, seed)).encode()))


# ---------------------------------------------------------------- arrays


def _view(base, d: int, layout: str):
    """The ``(B, H, S, d)`` view of a buffer: ``(B, H, S, d + pad)`` rows, or ``(B, S, H, d + pad)``
    seen as BHSD (``layout`` "bshd")."""
    view = base[..., :d]
    return view.transpose(0, 2, 1, 3) if layout == "bshd" else view


def _heads(values, dtype: str, layout: str = "bhsd", pad: int = 0):
    """``(base, view)``: float64 ``values`` ``(B, H, S, D)`` as ``dtype`` in a NaN-filled buffer."""
    b, h, s, d = values.shape
    shape = (b, s, h, d + pad) if layout == "bshd" else (b, h, s, d + pad)
    base = cudacpu.empty(shape, DTYPES[dtype])
    base[...] = np.nan
    view = _view(base, d, layout)
    view[...] = values
    return base, view


def _outside(base, d: int, layout: str):
    """The elements of ``base`` outside its view, as float64."""
    inside = np.zeros(base.shape, bool)
    _view(inside, d, layout)[...] = True
    return base[~inside].astype(np.float64)


def _tables(rng, batch: int, p: int, r2: int, dtype: str, shared: bool, pad: int):
    """``(cos, sin)`` ``(B, P, R2)`` of random angles in ``dtype``, rows ``pad`` elements apart
    beyond ``R2``; ``shared``: one table broadcast over the batch (batch stride 0)."""
    angles = rng.uniform(-8, 8, (1 if shared else batch, p, r2))
    out = []
    for f in (np.cos, np.sin):
        base = cudacpu.empty((*angles.shape[:2], r2 + pad), TABLE_DTYPES[dtype])
        base[...] = np.nan
        base[..., :r2] = f(angles)
        table = base[..., :r2]
        out.append(np.broadcast_to(table, (batch, p, r2)) if shared else table)
    return tuple(out)


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _pair_scale(x, cos, sin, position_ids, interleaved):
    """``|x1 c| + |x2 s|`` of each element's pair (0 past the rotary dim)."""
    r2 = cos.shape[2]
    b, _, s, _ = x.shape
    pos = np.broadcast_to(np.arange(s), (b, s)) if position_ids is None else position_ids
    rows = np.arange(b)[:, None]
    c, sn = (np.abs(t[rows, pos][:, None]) for t in (cos, sin))
    first = (slice(None),) * 3 + (slice(0, 2 * r2, 2) if interleaved else slice(0, r2),)
    second = (slice(None),) * 3 + (slice(1, 2 * r2, 2) if interleaved else slice(r2, 2 * r2),)
    ax = np.abs(x)
    term = ax[first] * c + ax[second] * sn
    scale = np.zeros_like(x)
    scale[first] = scale[second] = term
    return scale


def _assert_close(got, want, scale, dtype, what):
    """``|got - want| <= 2 eps_out |want| + 8 eps_32 scale + tiny_out``, element by element."""
    bound = 2 * _eps(dtype) * np.abs(want) + 8 * _eps("float32") * scale + _tiny(dtype)
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / bound, 0)), err.shape)
        pytest.fail(
            f"{what}: {int(bad.sum())} elements off; worst at {i}: got {got[i]!r}, "
            f"want {want[i]!r}, bound {bound[i]:.3g}"
        )


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One problem: shapes, memory layouts, tables and position ids."""

    name: str
    b: int
    h: int
    s: int
    d: int
    r2: int
    p: int  #: table rows
    layout: str = "bhsd"  #: "bshd": a (B, S, H, D + pad) buffer seen as BHSD
    pad: int = 0  #: elements past D in each row of x's and out's buffers
    table: str = "x"  #: the tables' dtype ("x": x's)
    shared: bool = False  #: one table over the batch (batch stride 0)
    table_pad: int = 0  #: elements past R2 in each table row
    positions: str | None = None  #: position ids' dtype, or None
    vector: bool | None = None  #: whether 128-bit accesses are taken (None: per dtype)

    def arrays(self, dtype: str):
        """``(x_base, x, cos, sin, position_ids)``, seeded by the case and dtype."""
        rng = _rng(self.name, dtype)
        values = rng.standard_normal((self.b, self.h, self.s, self.d)) * 3
        x_base, x = _heads(values, dtype, self.layout, self.pad)
        table = dtype if self.table == "x" else self.table
        cos, sin = _tables(rng, self.b, self.p, self.r2, table, self.shared, self.table_pad)
        pos = None
        if self.positions is not None:
            pos = rng.integers(0, self.p, (self.b, self.s)).astype(self.positions)
        return x_base, x, cos, sin, pos

    def empty(self, dtype: str):
        """``(base, view)`` of a NaN-filled output."""
        return _heads(
            np.full((self.b, self.h, self.s, self.d), np.nan), dtype, self.layout, self.pad
        )


CASES = [
    # every pair rotated, contiguous BHSD, tables of x's dtype per batch, rows 0..S-1
    Case("full", 2, 3, 5, 64, 32, 5, vector=True),
    # partial rotary (R = 32 of D = 48) in a padded BSHD view; float32 tables shared over the
    # batch with padded rows; int64 position ids into P = 11 rows
    Case("partial-bshd", 2, 5, 7, 48, 16, 11, "bshd", 8, "float32", True, 4, "int64", True),
    # R2 = 13: scalar; D = 30, odd H and S, a padded BSHD view; float64 tables; int32 ids
    Case("scalar-odd", 3, 3, 5, 30, 13, 9, "bshd", 3, "float64", False, 1, "int32", False),
    # x allows vectors, the float16 tables' odd row stride does not: scalar
    Case("scalar-tables", 2, 1, 9, 64, 32, 12, "bhsd", 0, "float16", False, 1, "int32", False),
    # R2 = 4: 16-bit rows are vectors only interleaved (R = 8 is a vector, R2 is not)
    Case("short-r2", 1, 7, 3, 40, 4, 6, "bshd", 8, "bfloat16", True, 4, "int64"),
]


def _run(case: Case, dtype: str, interleaved: bool):
    """Forward and backward of :meth:`Case.arrays` into NaN-filled outputs; returns the inputs
    and the outputs' ``(base, view)``."""
    x_base, x, cos, sin, pos = case.arrays(dtype)
    fwd, bwd = case.empty(dtype), case.empty(dtype)
    rope.forward(fwd[1], x, cos, sin, pos, interleaved=interleaved)
    rope.backward(bwd[1], x, cos, sin, pos, interleaved=interleaved)
    return (x_base, x, cos, sin, pos), fwd, bwd


def _check(case: Case, dtype: str, interleaved: bool) -> None:
    """Both passes held to the reference; outputs written inside their views only, x unchanged."""
    (x_base, x, cos, sin, pos), fwd, bwd = _run(case, dtype, interleaved)
    x64, cos64, sin64 = _f64(x), _f64(cos), _f64(sin)
    scale = _pair_scale(x64, cos64, sin64, pos, interleaved)
    r = 2 * case.r2
    for inverse, (base, got) in ((False, fwd), (True, bwd)):
        what = f"{case.name} {dtype} interleaved={interleaved} inverse={inverse}"
        want = ref.rope(
            x64, cos64, sin64, position_ids=pos, interleaved=interleaved, inverse=inverse
        )
        got64 = _f64(got)
        _assert_close(got64[..., :r], want[..., :r], scale[..., :r], dtype, what)
        np.testing.assert_array_equal(got64[..., r:], x64[..., r:], err_msg=f"{what}: the tail")
        assert np.isnan(_outside(base, case.d, case.layout)).all(), f"{what}: wrote outside"
    assert np.isnan(_outside(x_base, case.d, case.layout)).all()
    np.testing.assert_array_equal(_f64(x), x64, err_msg="x must not be written")


@pytest.fixture(params=["shipped", "small-blocks"])
def variant(request, monkeypatch):
    """The shipped geometry, or blocks of 16 threads and at most 2 blocks along the heads: threads
    stride over the units of a row and over the heads."""
    if request.param == "small-blocks":
        monkeypatch.setattr(rope, "THREADS", 16)
        monkeypatch.setattr(rope, "MAX_HEAD_BLOCKS", 2)
    return request.param


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_reference(harness, variant, case, dtype, interleaved):
    if case.vector is not None:
        _, x, cos, sin, _ = case.arrays(dtype)
        v = rope._vector((x, x), (cos, sin), case.r2, case.d, interleaved)
        assert (v > 1) == case.vector, f"access width {v}"
    _check(case, dtype, interleaved)


# ---------------------------------------------------------------- aliasing and round trip


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["vector", "scalar"])
def test_in_place_gives_the_out_of_place_results(harness, case, interleaved):
    """``out`` the very same array as ``x`` (``dx`` as ``dout``): bitwise the out-of-place results,
    the tail past R kept, nothing written outside the view."""
    for dtype in ("float32", "bfloat16"):
        (_, _, cos, sin, pos), fwd, bwd = _run(case, dtype, interleaved)
        for launch, (_, want) in ((rope.forward, fwd), (rope.backward, bwd)):
            base, x = case.arrays(dtype)[:2]
            launch(x, x, cos, sin, pos, interleaved=interleaved)
            np.testing.assert_array_equal(_f64(x), _f64(want), err_msg=f"{launch.__name__}")
            assert np.isnan(_outside(base, case.d, case.layout)).all()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_undoes_forward(harness, dtype, interleaved):
    """Forward then backward (in place) gives x back, to the outputs' rounding:
    ``3 eps_out (|x1| + |x2|)`` per pair (float32 tables of unit norm)."""
    case = Case("round-trip", 2, 3, 7, 48, 16, 10, "bshd", 8, "float32", True, 0, "int64")
    _, x, cos, sin, pos = case.arrays(dtype)
    x0 = _f64(x)
    rope.forward(x, x, cos, sin, pos, interleaved=interleaved)
    rope.backward(x, x, cos, sin, pos, interleaved=interleaved)
    ones = np.ones_like(_f64(cos))
    pair = _pair_scale(x0, ones, ones, pos, interleaved)
    bound = 3 * _eps(dtype) * pair + _tiny(dtype)
    err = np.abs(_f64(x) - x0)
    assert (err <= bound).all(), f"round trip off by {np.max(err - bound):.3g} beyond its bound"
    np.testing.assert_array_equal(_f64(x)[..., 32:], x0[..., 32:])


# ---------------------------------------------------------------- edges and errors


def test_empty_arrays_launch_nothing(harness, monkeypatch):
    """No rows, heads or elements (and in place without pairs: nothing to do): no launch."""

    def no_launch(_):
        raise AssertionError("launched on an empty problem")

    monkeypatch.setattr(rope, "loader_for", no_launch)
    for b, h, s, d, r2 in ((0, 2, 3, 8, 4), (2, 0, 3, 8, 4), (2, 2, 0, 8, 4), (2, 2, 3, 0, 0)):
        x = cudacpu.zeros((b, h, s, d))
        cos = cudacpu.zeros((b, 4, r2))
        rope.forward(np.empty_like(x), x, cos, cos, None, interleaved=False)
        rope.backward(x, x, cos, cos, None, interleaved=True)
    x = cudacpu.zeros((2, 2, 3, 8))
    no_pairs = cudacpu.zeros((2, 3, 0))
    rope.forward(x, x, no_pairs, no_pairs, None, interleaved=False)


def test_no_pairs_copies_every_element_bit_for_bit(harness):
    x = cudacpu.empty((2, 3, 5, 16), np.float16)
    x[...] = _rng("copy").standard_normal(x.shape)
    x[0, 0, 0, :3] = (np.nan, np.inf, -0.0)
    out = cudacpu.zeros(x.shape, np.float16)
    no_pairs = cudacpu.zeros((2, 5, 0))
    rope.forward(out, x, no_pairs, no_pairs, None, interleaved=True)
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))


def test_dtypes_are_checked(harness):
    x32, x16 = cudacpu.zeros((1, 1, 2, 8)), cudacpu.zeros((1, 1, 2, 8), np.float16)
    table = cudacpu.zeros((1, 2, 4))
    with pytest.raises(TypeError, match="cupy rope: every array must have x's dtype"):
        rope.forward(x16, x32, table, table, None, interleaved=False)
    with pytest.raises(TypeError, match="cupy rope: x has dtype float64"):
        rope.forward(*(np.zeros((1, 1, 2, 8)),) * 2, table, table, None, interleaved=False)
    with pytest.raises(TypeError, match="sin must have cos's dtype float32"):
        rope.forward(x32, x32, table, table.astype(np.float16), None, interleaved=False)
    with pytest.raises(TypeError, match="cos has dtype int32"):
        rope.forward(x32, x32, *(table.astype(np.int32),) * 2, None, interleaved=False)
    with pytest.raises(TypeError, match="position_ids has dtype int16"):
        rope.backward(x32, x32, table, table, np.zeros((1, 2), np.int16), interleaved=False)
    with pytest.raises(ValueError, match="5 rotated pairs need a head dim of 10, got 8"):
        rope.forward(x32, x32, *(cudacpu.zeros((1, 2, 5)),) * 2, None, interleaved=False)


# ---------------------------------------------------------------- access width and geometry


def test_access_width_follows_layout_rows_and_tables():
    def width(d=64, r2=32, interleaved=False, dtype=np.float16, x_offset=0, table=None):
        x = cudacpu.zeros((2 * 3 * 4 * d + x_offset,), dtype)[x_offset:].reshape(2, 3, 4, d)
        t = cudacpu.zeros((2, 9, r2), np.float32) if table is None else table
        return rope._vector((x, x), (t, t), r2, d, interleaved)

    def table(dtype, offset=0, row=32):
        return cudacpu.zeros((2 * 9 * row + offset,), dtype)[offset:].reshape(2, 9, row)[..., :32]

    assert width() == 8 and width(dtype=np.float32) == 4
    assert width(d=40, r2=4) == 1, "half layout: R2 a multiple of 8"
    assert width(d=40, r2=4, interleaved=True) == 8, "interleaved: R = 8 a multiple of 8"
    assert width(d=68) == 1, "D (and the row strides) not a multiple of 8"
    assert width(x_offset=4) == 1, "x not 16-byte aligned"
    assert width(table=table(np.float32, 2)) == 1, "float32 table rows not 16-byte aligned"
    assert width(table=table(np.float32, 2), interleaved=True, dtype=np.float32) == 4, (
        "2 float32 per unit: 8-byte pieces"
    )
    assert width(table=table(np.float64, 2)) == 8, "float64 tables read 16 bytes at a time"
    assert width(table=table(np.float64, 1)) == 1
    assert width(table=table(np.float16, row=33)) == 1, "a table row stride not a multiple of 8"
    shared = np.broadcast_to(table(np.float16)[:1], (2, 9, 32))
    assert width(table=shared) == 8, "batch stride 0"


@pytest.mark.parametrize(
    ("rows", "units", "heads"),
    [(1, 1, 1), (300, 1, 5), (7, 25, 32), (5, 600, 3), (4096, 8, 200000)],
)
def test_geometry_covers_every_unit(rows, units, heads):
    (gx, gy), (x, y) = rope._geometry(rows, units, heads)
    assert x * y == rope.THREADS and x & (x - 1) == 0
    assert gx * y >= rows > (gx - 1) * y, "the blocks cover the rows, none idle"
    assert x >= min(units, rope.THREADS) and x < 2 * max(units, 1)
    assert gy == min(rope.MAX_HEAD_BLOCKS, -(-heads // rope.HEADS))


# ---------------------------------------------------------------- NVRTC and sanitizers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_builds_every_instantiation_with_128_bit_rows(arch):
    report = nvrtc_report()
    entry = report.compile_source(rope.SOURCE, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(rope.name_expressions())
    assert len(entry["kernels"]) == 12, "3 dtypes x 2 widths x 2 layouts"
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        if name.startswith(("rope<float,4,", "rope<__half,8,", "rope<__nv_bfloat16,8,")):
            assert k["global_load_bits"] == 128 and k["global_store_bits"] == 128, (name, k)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import rope
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
with cudacpu.emulate():
    for dtype, d, r2 in ((ml_dtypes.bfloat16, 48, 16), (np.float32, 30, 13)):  # vector, scalar
        x = cudacpu.empty((2, 3, 5, d), dtype)
        x[...] = rng.standard_normal(x.shape)
        cos, sin = (cudacpu.empty((2, 7, r2), np.float32) for _ in range(2))
        cos[...], sin[...] = rng.standard_normal((2, 2, 7, r2))
        pos = rng.integers(0, 7, (2, 5)).astype(np.int32)
        for interleaved in (False, True):
            out = cudacpu.empty(x.shape, dtype)
            rope.forward(out, x, cos, sin, pos, interleaved=interleaved)
            shared = np.broadcast_to(cos[:1], cos.shape)  # batch stride 0
            rope.backward(x, x, shared, sin, None, interleaved=interleaved)
            assert np.isfinite(out.astype(np.float32)).all()
print("clean")
"""


def test_runs_clean_under_address_sanitizer():
    assert_clean_under_sanitizer(SANITIZED_RUN, "address")


# ---------------------------------------------------------------- planted bugs


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # the second element's sine term with the wrong sign
        ("y2 = xk::from_float<T>(x2 * c + x1 * s)", "y2 = xk::from_float<T>(x2 * c - x1 * s)"),
        # interleaved vectors paired as (e, e + E / 2), not (2e, 2e + 1)
        ("const int i1 = 2 * e, i2 = 2 * e + 1;", "const int i1 = e, i2 = e + Q * V / 2;"),
        # the table row of query s rather than of its position id
        ("b * s_cos_b + p * s_cos_p", "b * s_cos_b + s * s_cos_p"),
    ],
)
def test_a_bug_planted_in_the_cuda_c_is_caught(tmp_path, monkeypatch, old, new):
    source = rope.SOURCE.read_text()
    assert old in source
    planted = tmp_path / rope.SOURCE.name
    planted.write_text(source.replace(old, new, 1))
    monkeypatch.setattr(rope, "SOURCE", planted)
    with cudacpu.emulate(), pytest.raises(pytest.fail.Exception):
        for interleaved in (False, True):
            _check(CASES[1], "float32", interleaved)
