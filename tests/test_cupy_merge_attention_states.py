"""The cupy backend's merge of two attention states (``merge_attention_states.cu``), run
unchanged through the CPU harness.

What the conformance suite's cupy-cpu targets do not reach: bfloat16 (NumPy
has none), output and gradient dtypes other than the states', padded row
strides and odd head dims (scalar and 8-byte accesses), many lanes per row
looping over a long row, NaN and infinities placed where the array_api
backend's results are known, outputs that are their inputs, planted kernel
bugs the tests must catch, and the NVRTC build for sm_80/sm_90 (no warnings,
no spills, 128-bit accesses where rows allow).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report
from xpkernels.backends.cupy import merge_attention_states as M

import xpkernels as xk
from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPS32 = float(np.finfo(np.float32).eps)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["default", "shuffled"])
def harness(request):
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _eps(t) -> float:
    return float(ml_dtypes.finfo(t).eps if t is ml_dtypes.bfloat16 else np.finfo(t).eps)


def _tile(values, t, pad=0, bshd=False):
    """``values`` ``(B, H, S, Dv)`` in dtype ``t``: rows padded by ``pad`` elements, or a view
    of a ``(B, S, H, Dv)`` buffer."""
    batch, heads, seq, dv = values.shape
    if bshd:
        base = np.zeros((batch, seq, heads, dv + pad), t)
        base[..., :dv] = values.transpose(0, 2, 1, 3)
        return base[..., :dv].transpose(0, 2, 1, 3)
    base = np.zeros((batch, heads, seq, dv + pad), t)
    base[..., :dv] = values
    return base[..., :dv]


def _stat(values, bshd=False):
    """``values`` ``(B, H, S)`` as float32, a view of a ``(B, S, H)`` buffer when ``bshd``."""
    if bshd:
        return np.ascontiguousarray(values.transpose(0, 2, 1), np.float32).transpose(0, 2, 1)
    return values.astype(np.float32)


def _states(rng, shape, t, pad=0, bshd=False, empty=0.0):
    """Two states ``[o_a, m_a, l_a, o_b, m_b, l_b]``; about ``empty`` of each side's rows empty
    (``m = -inf``, ``l = 0``, ``o`` NaN: never read), the first row empty on both sides."""
    out = []
    for _ in range(2):
        o = rng.standard_normal(shape)
        m = rng.standard_normal(shape[:3]) * 3
        lse_sum = 1 + rng.random(shape[:3]) * 30
        gone = rng.random(shape[:3]) < empty
        if empty:
            gone.flat[0] = True
        o[gone], m[gone], lse_sum[gone] = np.nan, -np.inf, 0.0
        out += [_tile(o, t, pad, bshd), _stat(m, bshd), _stat(lse_sum, bshd)]
    return out


def _f64(states):
    """float64 copies, an empty side's NaN ``o`` as 0 (the reference multiplies it by 0)."""
    return [np.where(np.isnan(a), 0.0, np.asarray(a).astype(np.float64)) for a in states]


def _forward(states, o_dtype=None):
    o_a, m_a = states[0], states[1]
    o = np.full(o_a.shape, np.nan, o_dtype or o_a.dtype)
    m, lse_sum = np.full(m_a.shape, np.nan, np.float32), np.full(m_a.shape, np.nan, np.float32)
    M.forward(o, m, lse_sum, *states)
    return o, m, lse_sum


def _backward(do, dlse, o, m, lse_sum, states, grad_dtype=None):
    o_a, m_a = states[0], states[1]
    do_a = np.full(o_a.shape, np.nan, grad_dtype or o_a.dtype)
    do_b = np.full(o_a.shape, np.nan, grad_dtype or o_a.dtype)
    dlse_a = np.full(m_a.shape, np.nan, np.float32)
    dlse_b = np.full(m_a.shape, np.nan, np.float32)
    M.backward(do, dlse, o, m, lse_sum, *states, do_a, dlse_a, do_b, dlse_b)
    return do_a, do_b, dlse_a, dlse_b


def _weights(states):
    """float64 ``(w_a, w_b)`` of each row (0 on an empty side)."""
    _, m_a, l_a, _, m_b, l_b = _f64(states)
    m = np.maximum(m_a, m_b)
    shift = np.where(m == -np.inf, 0.0, m)
    scaled_a, scaled_b = l_a * np.exp(m_a - shift), l_b * np.exp(m_b - shift)
    total = scaled_a + scaled_b
    inv = np.where(total > 0, 1 / np.where(total > 0, total, 1), 0)
    return scaled_a * inv, scaled_b * inv


def _check_forward(got, states, t):
    """o within rounding to ``t`` after float32 sums; m exact; l within float32 rounding."""
    o, m, lse_sum = got
    f64 = _f64(states)
    want_o, want_m, want_l = ref.merge_attention_states(*f64)
    scale = max(1.0, float(np.abs(want_o).max(initial=0.0)))
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=4 * _eps(t) * scale, rtol=0)
    np.testing.assert_array_equal(m, want_m.astype(np.float32))
    np.testing.assert_allclose(lse_sum, want_l, rtol=8 * EPS32, atol=0)


def _check_backward(got, do, dlse, o, states, t):
    """do_a, do_b within rounding to ``t``; dlse_a, dlse_b within ``t``'s rounding of ``o`` and
    float32 sums over Dv, relative to the terms they sum."""
    f64 = _f64(states)
    do64, dlse64, o64 = (np.asarray(a).astype(np.float64) for a in (do, dlse, o))
    want = ref.merge_attention_states_backward(*f64, do64, dlse64)
    dv = o.shape[3]
    for name, g, w in zip(("do_a", "do_b"), got[:2], want[:2]):
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        tol = 4 * _eps(t) * scale
        np.testing.assert_allclose(g.astype(np.float64), w, atol=tol, rtol=0, err_msg=name)
    for name, g, w, weight, o_side in zip(
        ("dlse_a", "dlse_b"), got[2:], want[2:], _weights(states), (f64[0], f64[3])
    ):
        terms = weight * ((np.abs(do64) * (np.abs(o_side) + np.abs(o64))).sum(-1) + abs(dlse64))
        bound = (4 + math.sqrt(dv)) * _eps(t) * np.maximum(terms, 1.0)
        assert (np.abs(g - w) <= bound).all(), f"{name}: max error {np.abs(g - w).max():.3g}"


# (shape, row padding, BSHD layout, empty fraction): one lane per row (Dv 1, 4), a few lanes
# (Dv 8, 20, 64), 32 lanes looping (Dv 300), odd Dv (scalar and 8-byte accesses), padded rows.
CASES = [
    ((1, 1, 1, 1), 0, False, 0.0),
    ((3, 1, 4, 1), 0, False, 0.3),
    ((2, 3, 5, 8), 0, False, 0.0),
    ((2, 2, 9, 16), 0, False, 0.3),
    ((2, 4, 6, 20), 0, True, 0.2),
    ((1, 2, 7, 12), 2, False, 0.0),
    ((2, 3, 33, 64), 8, False, 0.2),
    ((1, 2, 5, 300), 4, True, 0.2),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("shape", "pad", "bshd", "empty"), CASES)
def test_forward_and_backward_match_float64(harness, dtype, shape, pad, bshd, empty):
    t = DTYPES[dtype]
    rng = np.random.default_rng(sum(shape) * 7 + pad)
    states = _states(rng, shape, t, pad, bshd, empty)
    got = _forward(states)
    _check_forward(got, states, t)
    do = _tile(rng.standard_normal(shape), t, pad, bshd)
    dlse = _stat(rng.standard_normal(shape[:3]), bshd)
    grads = _backward(do, dlse, *got, states)
    _check_backward(grads, do, dlse, got[0], states, t)
    no_dlse = _backward(do, None, *got, states)
    _check_backward(no_dlse, do, np.zeros(shape[:3], np.float32), got[0], states, t)


def test_outputs_and_gradients_in_other_dtypes(harness):
    rng = np.random.default_rng(3)
    shape = (2, 3, 7, 24)
    states = _states(rng, shape, ml_dtypes.bfloat16, empty=0.2)
    got = _forward(states, o_dtype=np.float32)  # float32 output of bfloat16 states
    _check_forward(got, states, ml_dtypes.bfloat16)
    o16 = got[0].astype(np.float16)  # the merged o handed to the backward in float16
    do = rng.standard_normal(shape).astype(np.float32)
    dlse = rng.standard_normal(shape[:3]).astype(np.float32)
    grads = _backward(do, dlse, o16, got[1], got[2], states, grad_dtype=np.float16)
    _check_backward(grads, do, dlse, o16, states, np.float16)


def test_vector_width_follows_what_every_row_allows():
    aligned16 = cudacpu.empty((2, 3, 4, 64), np.float16)
    aligned32 = cudacpu.empty((2, 3, 4, 64), np.float32)
    assert M._vector((aligned16, aligned16)) == 8  # 16 bytes of float16
    assert M._vector((aligned32, aligned32)) == 4  # 16 bytes of float32
    assert M._vector((aligned16, aligned32)) == 8  # two 16-byte float32 accesses per step
    assert M._vector((aligned16[..., :60],)) == 4  # Dv 60: 8-byte accesses
    assert M._vector((_tile(np.zeros((2, 3, 4, 64)), np.float16, pad=1),)) == 1  # odd rows
    assert M._geometry(aligned32, 4)[1:] == (16, -(-24 // 16))  # 16 lanes per row
    assert M._geometry(aligned32[..., :1], 1)[1] == 1
    assert M._geometry(np.empty((1, 1, 3, 1000), np.float32), 4)[1] == 32


def test_empty_states_merge_without_nan(harness):
    rng = np.random.default_rng(5)
    shape = (2, 3, 4, 40)
    states = _states(rng, shape, np.float32)
    o_a, m_a, l_a, o_b, m_b, l_b = states
    both, only_a, only_b = (0, 0, 0), (0, 1, 2), (1, 2, 3)
    for row in (both, only_a):
        o_a[row], m_a[row], l_a[row] = np.nan, -np.inf, 0.0  # an empty side's o is never read
    for row in (both, only_b):
        o_b[row], m_b[row], l_b[row] = np.nan, -np.inf, 0.0
    o, m, lse_sum = _forward(states)
    assert not np.isnan(o).any() and not np.isnan(m).any() and not np.isnan(lse_sum).any()
    assert m[both] == -np.inf and lse_sum[both] == 0 and (o[both] == 0).all()
    assert (m[only_a], lse_sum[only_a]) == (m_b[only_a], l_b[only_a])
    assert (m[only_b], lse_sum[only_b]) == (m_a[only_b], l_a[only_b])
    np.testing.assert_allclose(o[only_a], o_b[only_a], rtol=EPS32, atol=0)  # w_b = 1
    np.testing.assert_allclose(o[only_b], o_a[only_b], rtol=EPS32, atol=0)
    do = rng.standard_normal(shape).astype(np.float32)
    dlse = rng.standard_normal(shape[:3]).astype(np.float32)
    do_a, do_b, dlse_a, dlse_b = _backward(do, dlse, o, m, lse_sum, states)
    for g in (do_a, do_b, dlse_a, dlse_b):
        assert not np.isnan(g).any()
    assert (do_a[both] == 0).all() and (do_b[both] == 0).all()
    assert dlse_a[both] == 0 and dlse_b[both] == 0
    assert (do_a[only_a] == 0).all() and dlse_a[only_a] == 0
    assert (do_b[only_b] == 0).all() and dlse_b[only_b] == 0
    np.testing.assert_allclose(do_b[only_a], do[only_a], rtol=EPS32, atol=0)


def _nan_problem():
    """float32 states with NaN and infinities in chosen rows, cotangents with NaN in others."""
    rng = np.random.default_rng(11)
    shape = (1, 2, 8, 12)
    states = _states(rng, shape, np.float32)
    o_a, m_a, l_a, o_b, m_b, l_b = states
    m_a[0, 0, 0] = np.nan  # NaN max: o = 0, m = l = NaN
    l_b[0, 0, 1] = np.nan
    l_a[0, 0, 2] = np.inf  # an infinite sum: w_a = inf * 0
    m_b[0, 0, 3] = np.inf
    m_a[0, 0, 4], m_b[0, 0, 4] = -np.inf, -np.inf  # both -inf with l > 0: empty
    m_a[0, 0, 5] = -np.inf  # -inf with l > 0 beside a live side: weight 0
    o_a[0, 0, 6, 3] = np.nan  # a NaN value of a live side reaches its row
    o_b[0, 1, 0, 5] = np.inf
    o_b[0, 1, 1], m_b[0, 1, 1], l_b[0, 1, 1] = np.nan, -np.inf, 0.0  # never read
    do = rng.standard_normal(shape).astype(np.float32)
    do[0, 1, 2, 7] = np.nan
    dlse = rng.standard_normal(shape[:3]).astype(np.float32)
    dlse[0, 1, 3] = np.nan
    dlse[0, 1, 1] = np.inf
    return states, do, dlse


def _same_specials(got, want, what):
    """NaN and infinities where array_api has them; the finite values within float32 rounding."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    np.testing.assert_allclose(got[finite], want[finite], atol=16 * EPS32 * scale, rtol=0)


def test_nan_and_infinities_as_array_api(harness):
    states, do, dlse = _nan_problem()
    got = xk.merge_attention_states(*states, backend="cupy")
    grads = xk.merge_attention_states_backward(do, *got, *states, dlse=dlse, backend="cupy")
    with np.errstate(invalid="ignore", over="ignore"):  # NumPy warns of the NaN it makes
        want = xk.merge_attention_states(*states, backend="array_api")
        want_grads = xk.merge_attention_states_backward(
            do, *want, *states, dlse=dlse, backend="array_api"
        )
    assert np.isnan(want[1][0, 0, 0]) and np.isnan(want_grads[0]).any()  # the cases bite
    for what, g, w in zip(("o", "m", "l"), got, want):
        _same_specials(g, w, what)
    for what, g, w in zip(("do_a", "do_b", "dlse_a", "dlse_b"), grads, want_grads):
        _same_specials(g, w, what)


@pytest.mark.parametrize("side", ["a", "b"])
def test_outputs_may_be_their_inputs(harness, side):
    # 64 columns of float32: 16 lanes per row, so the row's first lane writes m and l over the
    # statistics the other lanes use (handed to them by shuffle before).
    rng = np.random.default_rng(17)
    shape = (2, 3, 9, 64)
    states = _states(rng, shape, np.float32, empty=0.2)
    want = _forward(states)
    k = 0 if side == "a" else 3
    mine = [a.copy() for a in states]
    M.forward(mine[k], mine[k + 1], mine[k + 2], *mine)
    for g, w in zip(mine[k : k + 3], want):
        np.testing.assert_array_equal(g, w)
    do = rng.standard_normal(shape).astype(np.float32)
    dlse = rng.standard_normal(shape[:3]).astype(np.float32)
    want_grads = _backward(do, dlse, *want, states)
    do_in, dlse_in = do.copy(), dlse.copy()
    outs = [None, None, None, None]  # do_a, dlse_a, do_b, dlse_b
    j = 0 if side == "a" else 2
    outs[j], outs[j + 1] = do_in, dlse_in
    outs[2 - j] = np.empty_like(do)
    outs[3 - j] = np.empty_like(dlse)
    M.backward(do_in, dlse_in, *want, *states, *outs)
    for g, w in zip(outs, (want_grads[0], want_grads[2], want_grads[1], want_grads[3])):
        np.testing.assert_array_equal(g, w)


def test_no_rows_and_no_columns(harness):
    none = np.empty((2, 0, 3, 8), np.float32), np.empty((2, 0, 3), np.float32)
    M.forward(none[0], none[1], none[1], *none, none[1], *none, none[1])
    rng = np.random.default_rng(2)
    states = _states(rng, (2, 2, 3, 0), np.float32, empty=0.3)  # Dv = 0: m and l still merge
    o, m, lse_sum = _forward(states)
    f64 = _f64(states)
    _, want_m, want_l = ref.merge_attention_states(*f64)
    np.testing.assert_array_equal(m, want_m.astype(np.float32))
    np.testing.assert_allclose(lse_sum, want_l, rtol=8 * EPS32, atol=0)


def test_unsupported_dtypes_are_refused():
    o = np.zeros((1, 2, 3, 4), np.float32)
    m = np.zeros((1, 2, 3), np.float32)
    with cudacpu.emulate():
        with pytest.raises(TypeError, match="o_a has dtype float64"):
            M.forward(o, m, m, o.astype(np.float64), m, m, o.astype(np.float64), m, m)
        with pytest.raises(TypeError, match="l_b must be float32"):
            M.forward(o, m, m, o, m, m, o, m, m.astype(np.float16))
        with pytest.raises(TypeError, match="o_b must have o_a's dtype"):
            M.forward(o, m, m, o, m, m, o.astype(np.float16), m, m)
        with pytest.raises(TypeError, match="do_b has dtype float64"):
            M.backward(o, None, o, m, m, o, m, m, o, m, m, o, m, o.astype(np.float64), m)


def _planted(tmp_path, monkeypatch, old: str, new: str):
    """Point the launchers at a copy of the .cu with ``old`` replaced by ``new`` (once)."""
    source = M.SOURCE.read_text()
    assert source.count(old) == 1, old
    path = tmp_path / "merge_attention_states.cu"
    path.write_text(source.replace(old, new))
    monkeypatch.setattr(M, "SOURCE", path)


def _empty_state_case():
    """The largest error of forward and backward over states with empty rows on either side or
    both (inf when a NaN appears)."""
    rng = np.random.default_rng(23)
    shape = (2, 2, 6, 16)
    states = _states(rng, shape, np.float16, empty=0.4)
    do = rng.standard_normal(shape).astype(np.float16)
    dlse = rng.standard_normal(shape[:3]).astype(np.float32)
    with cudacpu.emulate():
        got = _forward(states)
        grads = _backward(do, dlse, *got, states)
    f64 = _f64(states)
    want = ref.merge_attention_states(*f64)
    want_grads = ref.merge_attention_states_backward(
        *f64, do.astype(np.float64), dlse.astype(np.float64)
    )
    pairs = [(got[0], want[0]), (got[2], want[2]), *zip(grads, want_grads)]
    errors = [np.abs(np.asarray(g, np.float64) - w) for g, w in pairs]
    return max(float(np.max(np.where(np.isnan(e), np.inf, e))) for e in errors)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("(m == xk::neg_inf() ? 0.0f : m)", "m"),
        ("l == 0.0f ? 0.0f : 1.0f / l", "1.0f / l"),
        ("(wa != 0.0f ? wa * va[i] : 0.0f)", "wa * va[i]"),
        ("wb != 0.0f ? wb * (dot_b + d_lse) : 0.0f", "wb * (dot_b + d_lse)"),
    ],
    ids=["no-empty-shift", "no-inverse-guard", "empty-side-o-read", "empty-side-dlse"],
)
def test_planted_empty_state_bugs_are_caught(tmp_path, monkeypatch, old, new):
    # The error scale: float16 outputs of unit-scale values, dlse sums over 16 columns.
    tol = 64 * _eps(np.float16)
    intact = _empty_state_case()
    assert intact <= tol, intact
    _planted(tmp_path, monkeypatch, old, new)
    assert _empty_state_case() > 10 * tol


_LEADER_READS = """    if (active && lane == 0) {
        ma = m_a[row.at(s_ma_b, s_ma_h, s_ma_s)];
        la = l_a[row.at(s_la_b, s_la_h, s_la_s)];
        mb = m_b[row.at(s_mb_b, s_mb_h, s_mb_s)];
        lb = l_b[row.at(s_lb_b, s_lb_h, s_lb_s)];
    }
    ma = from_leader(ma, group);
    la = from_leader(la, group);
    mb = from_leader(mb, group);
    lb = from_leader(lb, group);
"""
#: Every lane reads the statistics itself: a lane may then read m_a after the row's first
#: lane has written m over it (m is m_a).
_EVERY_LANE_READS = _LEADER_READS.replace("active && lane == 0", "active").split("    ma = from")[0]


@pytest.mark.parametrize("schedule", ["default", "shuffled"])
def test_planted_race_on_aliased_statistics_is_caught(tmp_path, monkeypatch, schedule):
    rng = np.random.default_rng(19)
    shape = (2, 3, 9, 64)
    states = _states(rng, shape, np.float32, empty=0.2)
    results = []
    with cudacpu.emulate(schedule=schedule):
        want = _forward(states)
        for plant in (False, True):
            if plant:
                _planted(tmp_path, monkeypatch, _LEADER_READS, _EVERY_LANE_READS)
            mine = [a.copy() for a in states]
            M.forward(*mine[:3], *mine)  # merged into side a's buffers
            results.append(mine[0])
    np.testing.assert_array_equal(results[0], want[0])
    assert not np.array_equal(results[1], want[0], equal_nan=True)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import merge_attention_states as M
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
shape = (1, 2, 3, 40)  # float32: 16 lanes per row; bfloat16: 8
with cudacpu.emulate():
    for t in (np.float32, ml_dtypes.bfloat16):
        o_a, o_b, do = (cudacpu.empty(shape, t) for _ in range(3))
        o_a[...], o_b[...], do[...] = (rng.standard_normal(shape) for _ in range(3))
        m_a, l_a, m_b, l_b, dlse = (cudacpu.empty(shape[:3]) for _ in range(5))
        m_a[...], m_b[...], dlse[...] = (rng.standard_normal(shape[:3]) for _ in range(3))
        l_a[...], l_b[...] = 2.0, 3.0
        m_b[0, 0, 0], l_b[0, 0, 0] = -np.inf, 0.0
        want = o_a.astype(np.float64)[0, 0, 0]
        M.forward(o_a, m_a, l_a, o_a, m_a, l_a, o_b, m_b, l_b)  # merged into side a's buffers
        assert np.abs(o_a[0, 0, 0].astype(np.float64) - want).max() == 0, "w_a = 1 on that row"
        do_b, dlse_b = cudacpu.empty(shape, t), cudacpu.empty(shape[:3])
        M.backward(do, dlse, o_a, m_a, l_a, o_a, m_a, l_a, o_b, m_b, l_b, do, dlse, do_b, dlse_b)
        assert np.isfinite(do.astype(np.float64)).all() and np.isfinite(dlse).all()
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_in_place_merges_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_builds_every_instantiation_without_warnings_or_spills(arch):
    report = nvrtc_report()
    entry = report.compile_source(M.SOURCE, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(M.name_expressions())
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        assert k["stack_bytes"] == 0, (name, k)
        v = int(re.search(r"<(\d+)>$", name).group(1))
        if v >= 4:  # 16 bytes of float32 at V = 4, of a 16-bit dtype at V = 8
            assert k["global_load_bits"] == 128 and k["global_store_bits"] == 128, (name, k)
