"""The Triton target's operations at the edges of their domains, function by function.

The generated functions are called directly on one tile (Triton interpreter)
and compared with NumPy on the same values: ``pow`` over every pairing of
special bases and exponents (C's special cases, as ``numpy.power`` on
arrays), and integer floor division and remainder with zero, -1 and
int64's extremes as operands.
"""

from __future__ import annotations

import numpy as np
import pytest

from xpkernels.testing import harness

harness.select_triton_interpreter()

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from xpkernels.backends.triton._flex_host import jit_function  # noqa: E402

from xpkernels import mods as xm  # noqa: E402
from xpkernels.mods.codegen import constants, triton_source  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EPS = float(np.finfo(np.float32).eps)
TILE = 16
INF, NAN = np.inf, np.nan
BASES = [-INF, -2.5, -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0, INF, NAN, -3.0, 0.25, 7.0]
EXPONENTS = [-INF, -3.0, -2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 2.5, INF, NAN, 4.0]
I64 = np.iinfo(np.int64)
DIVIDENDS = [I64.min, I64.min + 1, -7, -6, -1, 0, 1, 5, 6, 7, 9, I64.max, -9, 2, -2, 100]
DIVISORS = [0, -1, 1, 2, -2, 3, -3, 4, 7, -7, I64.max, I64.min, 5, -5, 10, -10]


@triton.jit
def _score_tile(fn: tl.constexpr, score, out, arrs, consts, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    zero = tl.full((), 0, tl.int64)
    q, kv = rows.to(tl.int64), cols.to(tl.int64)
    s = tl.load(score + rows * BLOCK + cols)
    tl.store(out + rows * BLOCK + cols, fn(s, zero, zero, q, kv, q, arrs, consts))


@triton.jit
def _mask_tile(fn: tl.constexpr, out, arrs, consts, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    zero = tl.full((), 0, tl.int64)
    q, kv = rows.to(tl.int64), cols.to(tl.int64)
    keep = fn(zero, zero, q, kv, q, arrs, consts)
    tl.store(out + rows * BLOCK + cols, tl.where(keep, 1.0, 0.0))


def _arrays(graph) -> tuple:
    out: list = []
    for slot in graph.slots:
        out += [slot.array, *slot.array.shape, *slot.array.stride()]
    return tuple(out)


def test_pow_follows_c_special_cases():
    exponents = torch.tensor(EXPONENTS, dtype=torch.float32)
    mod = xm.ScoreMod(lambda s, b, h, q, kv, *, t: s ** t[kv], t=exponents)
    fn = jit_function(triton_source(mod.graph, "score", "f"), "f")
    base = np.asarray(BASES, np.float32)[:, None]
    score = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(base, (TILE, TILE))))
    out = torch.empty(TILE, TILE)
    consts = constants(mod.graph) or (0,)
    _score_tile[(1,)](fn, score, out, _arrays(mod.graph), consts, BLOCK=TILE)
    want = np.power(base, np.asarray(EXPONENTS, np.float32)[None, :])
    got = out.numpy()
    tol = 64 * EPS * np.abs(np.where(np.isfinite(want), want, 0.0))
    close = (got == want) | (np.isnan(got) & np.isnan(want)) | (np.abs(got - want) <= tol)
    signs = np.isnan(want) | (np.signbit(got) == np.signbit(want))
    bad = np.argwhere(~(close & signs))
    assert bad.size == 0, [(BASES[i], EXPONENTS[j], got[i, j], want[i, j]) for i, j in bad[:8]]


@pytest.mark.parametrize("op", ["floordiv", "mod"])
def test_integer_division_by_zero_minus_one_and_extremes(op):
    n = np.asarray(DIVIDENDS, np.int64)
    d = np.asarray(DIVISORS, np.int64)
    with np.errstate(all="ignore"):
        want = np.floor_divide(n[:, None], d) if op == "floordiv" else np.remainder(n[:, None], d)
    assert want[0, 1] == I64.min if op == "floordiv" else want[0, 1] == 0  # MIN // -1 wraps

    def mask(b, h, q, kv, *, n, d, e):
        return (n[q] // d[kv] if op == "floordiv" else n[q] % d[kv]) == e[q, kv]

    tables = {"n": n, "d": d, "e": np.ascontiguousarray(want)}
    mod = xm.MaskMod(mask, **{k: torch.from_numpy(v) for k, v in tables.items()})
    fn = jit_function(triton_source(mod.graph, "mask", "f"), "f")
    out = torch.empty(TILE, TILE)
    _mask_tile[(1,)](fn, out, _arrays(mod.graph), constants(mod.graph) or (0,), BLOCK=TILE)
    bad = np.argwhere(out.numpy() != 1.0)
    assert bad.size == 0, [(DIVIDENDS[i], DIVISORS[j], want[i, j]) for i, j in bad[:8]]
