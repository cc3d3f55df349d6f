"""The cupy backend's decode-attention kernels, run unchanged through the CPU harness.

What the conformance suite's cupy-cpu targets do not reach: bfloat16, query
groups larger than one block's chunk of heads, head dims of every lane width,
paged caches with softcap and a window, lengths past the cache (clamped), NaN
reaching exactly its head, and the split count chosen to fill whole waves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from xpkernels.backends.cupy import decode_attention as dec
from xpkernels.backends.cupy._loader import loader_for

from xpkernels.testing import cudacpu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module", params=["default", "shuffled"])
def harness(request):
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _reference(q, k, v, lengths, scale, softcap=None, window=None):
    """float64 decode attention over a contiguous cache (B, Hkv, Smax, D)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    batch, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros((batch, heads, v.shape[-1]))
    for b in range(batch):
        n = min(max(int(lengths[b]), 0), k.shape[2])
        lo = max(0, n - window) if window else 0
        for h in range(heads):
            s = scale * (k[b, h // group, lo:n] @ q[b, h])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if s.size:
                p = np.exp(s - s.max())
                out[b, h] = p @ v[b, h // group, lo:n] / p.sum()
    return out


def _pages(k, page_size, seed):
    """The contiguous cache (B, Hkv, Smax, D) cut into pages shuffled by ``seed``, and the table."""
    batch, kv_heads, smax, d = k.shape
    per = -(-smax // page_size)
    order = np.random.default_rng(seed).permutation(batch * per)
    pages = np.zeros((batch * per + 1, kv_heads, page_size, d), k.dtype)
    table = np.zeros((batch, per), np.int32)
    for b in range(batch):
        for i in range(per):
            page = order[b * per + i]
            chunk = k[b, :, i * page_size : (i + 1) * page_size]
            pages[page, :, : chunk.shape[1]] = chunk
            table[b, i] = page
    return pages, table


def _run(q, k, v, lengths, n_splits, **options):
    batch, heads, _ = q.shape
    dv = v.shape[-1]
    o = np.full((batch, heads, dv), np.nan, q.dtype)
    o_partial = np.full((batch, heads, n_splits, dv), np.nan, np.float32)
    m_partial = np.full((batch, heads, n_splits), np.nan, np.float32)
    l_partial = np.full((batch, heads, n_splits), np.nan, np.float32)
    dec.forward(o, q, k, v, lengths, o_partial, m_partial, l_partial, **options)
    return o.astype(np.float64)


def _tolerance(dtype, keys):
    eps = float(ml_dtypes.finfo(dtype).eps if dtype is ml_dtypes.bfloat16 else np.finfo(dtype).eps)
    return 8 * eps + 8 * math.sqrt(keys) * float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(
    "heads, kv_heads, d, dv",
    [(12, 1, 40, 72), (4, 2, 16, 16), (8, 8, 128, 64), (3, 1, 256, 200)],
    ids=["group12-two-chunks", "group2-d16", "mha-d128", "group3-d256"],
)
def test_contiguous_cache_matches_float64(harness, dtype, heads, kv_heads, d, dv):
    rng = np.random.default_rng(heads * 1000 + d)
    t = DTYPES[dtype]
    smax, lengths = 77, np.array([0, 5, 77, 120], np.int64)  # 120: clamped to the cache
    q = rng.standard_normal((4, heads, d)).astype(t)
    k = rng.standard_normal((4, kv_heads, smax, d)).astype(t)
    v = rng.standard_normal((4, kv_heads, smax, dv)).astype(t)
    scale = 1 / math.sqrt(d)
    expected = _reference(q, k, v, lengths, scale)
    out = _run(q, k, v, lengths, 3, scale=scale)
    np.testing.assert_allclose(out, expected, atol=_tolerance(t, smax), rtol=0)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_cache_with_softcap_and_window(harness, page_size, dtype):
    rng = np.random.default_rng(page_size)
    t = DTYPES[dtype]
    batch, heads, kv_heads, smax, d = 3, 4, 2, 70, 32
    lengths = np.array([70, 33, 1], np.int32)
    q = (3 * rng.standard_normal((batch, heads, d))).astype(t)
    k = rng.standard_normal((batch, kv_heads, smax, d)).astype(t)
    v = rng.standard_normal((batch, kv_heads, smax, d)).astype(t)
    k_pages, table = _pages(k, page_size, seed=7)
    v_pages, v_table = _pages(v, page_size, seed=7)
    assert (table == v_table).all()
    scale = 1 / math.sqrt(d)
    for softcap, window in ((None, None), (5.0, None), (None, 20), (2.0, 7)):
        expected = _reference(q, k, v, lengths, scale, softcap, window)
        out = _run(
            q,
            k_pages,
            v_pages,
            lengths,
            2,
            scale=scale,
            softcap=softcap,
            window=window,
            block_table=table,
        )
        np.testing.assert_allclose(
            out, expected, atol=_tolerance(t, smax), rtol=0, err_msg=f"{softcap} {window}"
        )


def test_out_of_range_pages_are_clamped_not_read_outside(harness):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    pages = rng.standard_normal((3, 1, 4, 16)).astype(np.float32)
    table = np.array([[0, 7, -5]], np.int32)  # 7 -> page 2, -5 -> page 0
    clamped = np.array([[0, 2, 0]], np.int32)
    lengths = np.array([12], np.int32)
    out = _run(q, pages, pages, lengths, 1, scale=0.25, block_table=table)
    same = _run(q, pages, pages, lengths, 1, scale=0.25, block_table=clamped)
    np.testing.assert_array_equal(out, same)


def test_nan_reaches_only_its_head(harness):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, 40, 32)).astype(np.float32)
    q[1, 3, 5] = np.nan
    out = _run(q, k, k, np.array([40, 40], np.int64), 4, scale=0.2)
    assert np.isnan(out[1, 3]).all()
    out[1, 3] = 0.0
    assert np.isfinite(out).all()


def test_default_splits_fill_whole_waves(harness):
    like = np.zeros(1, np.float32)
    slots = dec.BLOCKS_PER_SM * loader_for(like).sm_count(like)
    splits = dec.default_splits(16, 8, 32768, like)
    cap = min(dec.MAX_SPLITS, -(-32768 // dec.MIN_SPLIT_KEYS))
    assert 1 <= splits <= cap

    def filled(s):
        return 128 * s / (-(-(128 * s) // slots) * slots)

    assert filled(splits) >= dec.WAVE_FILL
    assert all(filled(s) < dec.WAVE_FILL for s in range(1, splits))
    assert dec.default_splits(16, 8, 100, like) == 1  # one split per MIN_SPLIT_KEYS keys at most
