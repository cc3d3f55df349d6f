"""attention and decode_attention on NumPy: tiling, masking, layouts, memory, GQA, decode equivalence.

The conformance suite checks every declared case against float64 references
on every target; these tests pin what it cannot see from outside: that the
array_api kernels really tile (bounded memory at Sq = Sk = 8192, results that
do not depend on the tile sizes), that BSHD views are used in place, that fully
masked rows raise no floating-point warnings, and the contracts tying decode
to attention and GQA to repeated heads.
"""

from __future__ import annotations

import math
import tracemalloc
import zlib

import numpy as np
import pytest
from xpkernels.backends.array_api import attention as attention_impl
from xpkernels.backends.array_api import decode_attention as decode_impl

import xpkernels as xk
from xpkernels.attention import AttentionCheckpoints
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref


def _naive(q, k, v, do, *, causal=False, scale=None, input_pos=0, q_lengths=None, k_lengths=None):
    """Float64 full-matrix attention: o, m, l, dq, dk, dv (fully masked rows: 0, -inf, 0, 0)."""
    q, k, v, do = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = ref.attention_keep(
        q.shape[0], q.shape[2], k.shape[2], causal=causal, input_pos=input_pos,
        q_lengths=q_lengths, k_lengths=k_lengths,
    )
    o, m, l_sum, _ = ref.attention(q, k, v, scale=scale, keep=keep)
    return (o, m, l_sum, *ref.attention_backward(q, k, v, do, scale=scale, keep=keep))


def _inputs(rng, batch, heads, kv_heads, sq, sk, d, dv=None, dtype=np.float64):
    dv = dv or d
    q = rng.standard_normal((batch, heads, sq, d)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, sk, d)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, sk, dv)).astype(dtype)
    do = rng.standard_normal((batch, heads, sq, dv)).astype(dtype)
    return q, k, v, do


def _run(q, k, v, do, **options):
    """In-place forward and backward into NaN-filled buffers; returns o, m, l, dq, dk, dv."""
    o = np.full((*q.shape[:3], v.shape[3]), np.nan, dtype=q.dtype)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    ck.m[...] = np.nan
    ck.l[...] = np.nan
    xk.attention_(o, q, k, v, checkpoints=ck, **options)
    O, Q, K, V = Duplicated(o, do), *(Duplicated(a, np.full_like(a, np.nan)) for a in (q, k, v))
    xk.attention_backward_(O, Q, K, V, checkpoints=ck, **options)
    return o, ck.m, ck.l, Q.shadow, K.shadow, V.shadow


def _small_tiles(monkeypatch, tile_elements, key_tile):
    monkeypatch.setattr(attention_impl, "TILE_ELEMENTS", tile_elements)
    monkeypatch.setattr(attention_impl, "KEY_TILE", key_tile)


TILED_CASES = {
    "gqa2-causal-lengths": dict(shape=(2, 4, 2, 37, 53, 16, 8), causal=True, input_pos=[0, 5],
                                q_lengths=[37, 20], k_lengths=[53, 11]),
    "mqa-noncausal-lengths": dict(shape=(2, 4, 1, 37, 53, 16, 16), q_lengths=[30, 37], k_lengths=[53, 10]),
    "causal-square-odd": dict(shape=(1, 2, 2, 70, 70, 40, 40), causal=True),
    "pos-beyond-keys": dict(shape=(3, 2, 1, 9, 66, 16, 24), causal=True, input_pos=[3, 0, 60],
                            q_lengths=[9, 4, 9], k_lengths=[66, 66, 5]),
    "sq-gt-sk-causal": dict(shape=(1, 2, 2, 90, 30, 16, 16), causal=True, scale=0.3),
}


@pytest.mark.parametrize("tile_elements,key_tile", [(64, 8), (512, 16), (1 << 18, 1024)])
@pytest.mark.parametrize("name", sorted(TILED_CASES))
def test_tiled_kernels_match_full_matrix_reference(name, tile_elements, key_tile, monkeypatch):
    """Forward, checkpoints and gradients agree with the full-matrix reference for any tile sizes."""
    case = dict(TILED_CASES[name])
    _small_tiles(monkeypatch, tile_elements, key_tile)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, do = _inputs(rng, *case.pop("shape"))
    options = {n: np.asarray(x) if isinstance(x, list) else x for n, x in case.items()}
    got = _run(q, k, v, do, **options)
    want = _naive(q, k, v, do, **case)
    for what, a, b in zip(("o", "m", "l", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=what)
    inference = xk.attention(q, k, v, **options)  # no checkpoints: the row max may be skipped
    np.testing.assert_allclose(inference, want[0], rtol=2e-6, atol=2e-6, err_msg="o without checkpoints")


@pytest.mark.parametrize("early,late", [(1.0, 1.0), (1.0, 30.0), (-30.0, 1.0)])
def test_scores_beyond_the_safe_exponent_stay_exact(early, late, monkeypatch):
    """Scores whose row max leaves +-SAFE_EXPONENT (shifted exponent), and tiles switching paths either way.

    ``late=30``: later key tiles raise the running max far above the bound;
    ``early=-30``: every score of the first key tiles is far below -bound,
    then ordinary keys bring the max back inside it.
    """
    _small_tiles(monkeypatch, 256, 16)
    rng = np.random.default_rng(7)
    q, k, v, do = _inputs(rng, 1, 2, 1, 20, 64, 16, dtype=np.float32)
    q = np.abs(q)
    k[:, :, :32] = early * np.abs(k[:, :, :32])
    k[:, :, 32:] *= late
    got = _run(q, k, v, do, causal=True, input_pos=40)
    want = _naive(q, k, v, do, causal=True, input_pos=40)
    assert np.all(np.isfinite(got[1]))
    got = (*got, xk.attention(q, k, v, causal=True, input_pos=40))  # no checkpoints
    want = (*want, want[0])
    for what, a, b in zip(("o", "m", "l", "dq", "dk", "dv", "o without checkpoints"), got, want, strict=True):
        scale = max(float(np.max(np.abs(b))), 1.0)
        np.testing.assert_allclose(a / scale, b / scale, rtol=0, atol=2e-5, err_msg=what)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_fully_masked_rows_are_zero_without_warnings(dtype):
    """k_lengths 0, queries past q_lengths: o = 0, m = -inf, l = 0, zero gradients, no FP warnings."""
    rng = np.random.default_rng(3)
    q, k, v, do = _inputs(rng, 3, 4, 2, 12, 70, 16, dtype=dtype)
    options = dict(causal=True, input_pos=np.asarray([0, 4, 2]), q_lengths=np.asarray([12, 5, 12]),
                   k_lengths=np.asarray([70, 70, 0]))
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        o, m, l_sum, dq, dk, dv = _run(q, k, v, do, **options)
    masked = np.zeros((3, 4, 12), dtype=bool)  # (B, H, Sq)
    masked[1, :, 5:] = True
    masked[2] = True
    for a in (o, dq):
        assert np.all(a[masked] == 0)
        assert not np.isnan(a).any()
    assert np.all(m[masked] == -np.inf) and np.all(l_sum[masked] == 0)
    assert np.all(np.isfinite(m[~masked])) and np.all(l_sum[~masked] > 1 - 1e-6)
    assert np.all(dk[2] == 0) and np.all(dv[2] == 0)
    assert not np.isnan(dk).any() and not np.isnan(dv).any()


def _bshd(a):
    """``a`` (B, H, S, D) as a view of a (B, S, H, D) buffer; also returns the buffer."""
    buffer = np.ascontiguousarray(a.transpose(0, 2, 1, 3))
    return buffer.transpose(0, 2, 1, 3), buffer


def test_bshd_views_match_bhsd_without_copies(monkeypatch):
    """BSHD views give BHSD's results, written straight into the caller's buffers, with no copy of any input."""
    _small_tiles(monkeypatch, 2048, 32)
    rng = np.random.default_rng(5)
    q, k, v, do = _inputs(rng, 2, 4, 2, 512, 512, 64, dtype=np.float32)
    options = dict(causal=True, input_pos=3)
    want = _run(q, k, v, do, **options)

    (qv, _), (kv, _), (vv, _), (dov, _) = (_bshd(a) for a in (q, k, v, do))
    ov, o_buf = _bshd(np.full_like(q, np.nan))
    shadows = [_bshd(np.full_like(a, np.nan)) for a in (q, k, v)]
    ck = xk.allocate_checkpoints(xk.attention_, qv, kv, vv)
    scratch = xk.allocate_scratchspace(xk.attention_backward_, ov, qv, kv, vv)
    O = Duplicated(ov, dov)
    Q, K, V = (Duplicated(a, s) for a, (s, _) in zip((qv, kv, vv), shadows, strict=True))
    tracemalloc.start()
    try:
        xk.attention_(ov, qv, kv, vv, checkpoints=ck, **options)
        xk.attention_backward_(O, Q, K, V, checkpoints=ck, scratch=scratch, **options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < q.nbytes / 4, f"peak {peak} bytes: an input was copied ({q.nbytes} bytes each)"
    np.testing.assert_allclose(o_buf.transpose(0, 2, 1, 3), want[0], rtol=1e-6, atol=1e-6)
    for (_, buf), w, what in zip(shadows, want[3:], ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(buf.transpose(0, 2, 1, 3), w, rtol=1e-5, atol=1e-5, err_msg=what)


@pytest.mark.slow
def test_memory_is_bounded_by_the_tile_budget_at_8192():
    """Sq = Sk = 8192: forward and backward extra memory stay a few tiles, far below one Sq x Sk matrix."""
    n, d = 8192, 16
    rng = np.random.default_rng(11)
    q, k, v, do = _inputs(rng, 1, 1, 1, n, n, d, dtype=np.float32)
    o = np.empty_like(q)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
    scratch = xk.allocate_scratchspace(xk.attention_backward_, O, Q, K, V)
    budget = 8 * attention_impl.TILE_ELEMENTS * 4
    tracemalloc.start()
    try:
        xk.attention_(o, q, k, v, causal=True, checkpoints=ck)
        _, forward_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        xk.attention_backward_(O, Q, K, V, checkpoints=ck, scratch=scratch, causal=True)
        _, backward_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full_matrix = n * n * 4
    assert forward_peak <= budget, f"forward peak {forward_peak} > {budget} bytes"
    assert backward_peak <= budget, f"backward peak {backward_peak} > {budget} bytes"
    assert max(forward_peak, backward_peak) < full_matrix / 16
    for r in (0, 1, 4095, 8191):  # query r attends to keys 0 .. r
        want = _naive(q[:, :, r : r + 1], k[:, :, : r + 1], v[:, :, : r + 1], do[:, :, r : r + 1])[0]
        np.testing.assert_allclose(o[:, :, r : r + 1], want, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")


def test_gqa_gradients_are_group_sums_of_repeated_heads():
    """dk, dv of a kv head = sums over its query heads of the gradients with K/V repeated per head."""
    rng = np.random.default_rng(13)
    q, k, v, do = _inputs(rng, 2, 8, 2, 40, 48, 16, dtype=np.float32)
    options = dict(causal=True, input_pos=np.asarray([8, 0]), k_lengths=np.asarray([48, 30]))
    o, _, _, dq, dk, dv = _run(q, k, v, do, **options)
    k_rep, v_rep = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)
    o_r, _, _, dq_r, dk_r, dv_r = _run(q, k_rep, v_rep, do, **options)
    np.testing.assert_allclose(o, o_r, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 4, 48, 16).sum(axis=2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 4, 48, 16).sum(axis=2), rtol=1e-5, atol=1e-5)


def test_input_pos_int_equals_array_and_allocating_equals_inplace():
    rng = np.random.default_rng(17)
    q, k, v, do = _inputs(rng, 2, 4, 2, 24, 40, 16, dtype=np.float32)
    options = dict(causal=True, q_lengths=np.asarray([24, 13]), k_lengths=np.asarray([40, 29]))
    inplace = _run(q, k, v, do, input_pos=6, **options)
    as_array = _run(q, k, v, do, input_pos=np.asarray([6, 6], dtype=np.int32), **options)
    for a, b in zip(inplace, as_array, strict=True):
        np.testing.assert_array_equal(a, b)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    o = xk.attention(q, k, v, input_pos=6, checkpoints=ck, **options)
    grads = xk.attention_backward(do, q, k, v, o, checkpoints=ck, input_pos=6, **options)
    np.testing.assert_array_equal(o, inplace[0])
    np.testing.assert_array_equal(ck.m, inplace[1])
    np.testing.assert_array_equal(ck.l, inplace[2])
    for a, b in zip(grads, inplace[3:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_reused_buffers_hold_nothing_between_calls():
    """Checkpoints and scratch allocated once serve a second, different call correctly."""
    rng = np.random.default_rng(19)
    first = _inputs(rng, 1, 2, 1, 30, 30, 16, dtype=np.float32)
    second = _inputs(rng, 1, 2, 1, 30, 30, 16, dtype=np.float32)
    o = np.empty_like(first[0])
    ck = xk.allocate_checkpoints(xk.attention_, first[0], first[1], first[2])
    shadows = [np.empty_like(a) for a in first[:3]]
    scratch = xk.allocate_scratchspace(
        xk.attention_backward_, Duplicated(o), *(Duplicated(a, s) for a, s in zip(first[:3], shadows, strict=True))
    )
    for q, k, v, do in (first, second):
        xk.attention_(o, q, k, v, causal=True, checkpoints=ck)
        args = (Duplicated(o, do), *(Duplicated(a, s) for a, s in zip((q, k, v), shadows, strict=True)))
        xk.attention_backward_(*args, checkpoints=ck, scratch=scratch, causal=True)
    want = _naive(*second, causal=True)
    np.testing.assert_allclose(o, want[0], rtol=2e-5, atol=2e-5)
    for got, w in zip(shadows, want[3:], strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)


def test_checkpoints_feed_the_backward_as_a_contract():
    """The backward reads only (m, l): reference checkpoints give the reference gradients."""
    rng = np.random.default_rng(23)
    q, k, v, do = _inputs(rng, 1, 2, 2, 20, 33, 16)
    want = _naive(q, k, v, do, causal=True, k_lengths=[20])
    ck = AttentionCheckpoints(m=want[1].astype(np.float32), l=want[2].astype(np.float32))
    dq, dk, dv = xk.attention_backward(do, q, k, v, want[0], checkpoints=ck, causal=True,
                                       k_lengths=np.asarray([20]))
    for got, w in zip((dq, dk, dv), want[3:], strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def _decode_reference(q, k_cache, v_cache, lengths):
    """Decode as attention: one query at position lengths[b] - 1, causal, over keys 0 .. lengths[b] - 1."""
    out = np.zeros((*q.shape[:2], v_cache.shape[3]), dtype=q.dtype)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        o = xk.attention(q[b : b + 1, :, None, :], k_cache[b : b + 1], v_cache[b : b + 1], causal=True,
                         input_pos=int(n) - 1)
        out[b] = o[0, :, 0, :]
    return out


def test_decode_equals_attention_for_every_split_count(monkeypatch):
    """n_splits from 1 to beyond the number of key tiles (and beyond the length) all give attention's result."""
    monkeypatch.setattr(decode_impl, "TILE_ELEMENTS", 16 * 24)  # key tiles of 16 keys
    rng = np.random.default_rng(29)
    batch, heads, kv_heads, smax, d, dv = 4, 4, 2, 100, 16, 24
    q = rng.standard_normal((batch, heads, d))
    k_cache = rng.standard_normal((batch, kv_heads, smax, d))
    v_cache = rng.standard_normal((batch, kv_heads, smax, dv))
    lengths = np.asarray([100, 0, 1, 57])
    want = _decode_reference(q, k_cache, v_cache, lengths)
    assert np.all(want[1] == 0)
    n_tiles = math.ceil(smax / 16)
    for n_splits in [*range(1, n_tiles + 3), 150]:
        o = np.full((batch, heads, dv), np.nan)
        scratch = xk.allocate_scratchspace(xk.decode_attention_, o, q, n_splits=n_splits)
        xk.decode_attention_(o, q, k_cache, v_cache, lengths, scratch=scratch)
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12, err_msg=f"n_splits={n_splits}")
        np.testing.assert_array_equal(
            xk.decode_attention(q, k_cache, v_cache, lengths, n_splits=n_splits), o
        )


@pytest.mark.filterwarnings("error")
def test_decode_zero_lengths_give_zeros():
    q = np.ones((3, 2, 8), dtype=np.float32)
    cache = np.ones((3, 1, 5, 8), dtype=np.float32)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        o = xk.decode_attention(q, cache, cache, np.zeros(3, dtype=np.int64), n_splits=2)
    np.testing.assert_array_equal(o, np.zeros((3, 2, 8), dtype=np.float32))


def test_decode_bshd_cache_view_is_read_in_place():
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k_cache = rng.standard_normal((2, 2, 40, 32)).astype(np.float32)
    v_cache = rng.standard_normal((2, 2, 40, 32)).astype(np.float32)
    lengths = np.asarray([40, 17])
    want = xk.decode_attention(q, k_cache, v_cache, lengths, n_splits=3)
    k_view, _ = _bshd(k_cache)
    v_view, _ = _bshd(v_cache)
    got = xk.decode_attention(q, k_view, v_view, lengths, n_splits=3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
