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
from xpkernels.backends.array_api import _attention_numpy as numpy_tiles
from xpkernels.backends.array_api import attention as attention_impl
from xpkernels.backends.array_api import decode_attention as decode_impl

import xpkernels as xk
from xpkernels.attention import AttentionCheckpoints
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.harness import max_error
from xpkernels.testing.tolerances import floor


def _naive(q, k, v, do, *, causal=False, scale=None, input_pos=0, q_lengths=None, k_lengths=None):
    """Float64 full-matrix attention: o, m, l, dq, dk, dv (fully masked rows: 0, -inf, 0, 0)."""
    q, k, v, do = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = ref.attention_keep(
        q.shape[0],
        q.shape[2],
        k.shape[2],
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
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
    """Tiles of ``tile_elements`` scores and ``key_tile`` keys, the NumPy forward's too."""
    for prefix in ("", "NUMPY_"):
        monkeypatch.setattr(attention_impl, prefix + "TILE_ELEMENTS", tile_elements)
        monkeypatch.setattr(attention_impl, prefix + "KEY_TILE", key_tile)
    for chunk in ("MASKED_KEY_CHUNK", "FORWARD_KEY_CHUNK"):  # several chunks per diagonal tile
        monkeypatch.setattr(numpy_tiles, chunk, 3)


TILED_CASES = {
    "gqa2-causal-lengths": dict(
        shape=(2, 4, 2, 37, 53, 16, 8),
        causal=True,
        input_pos=[0, 5],
        q_lengths=[37, 20],
        k_lengths=[53, 11],
    ),
    "mqa-noncausal-lengths": dict(
        shape=(2, 4, 1, 37, 53, 16, 16), q_lengths=[30, 37], k_lengths=[53, 10]
    ),
    "causal-square-odd": dict(shape=(1, 2, 2, 70, 70, 40, 40), causal=True),
    "pos-beyond-keys": dict(
        shape=(3, 2, 1, 9, 66, 16, 24),
        causal=True,
        input_pos=[3, 0, 60],
        q_lengths=[9, 4, 9],
        k_lengths=[66, 66, 5],
    ),
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
    np.testing.assert_allclose(
        inference, want[0], rtol=2e-6, atol=2e-6, err_msg="o without checkpoints"
    )


@pytest.mark.parametrize("name", sorted(TILED_CASES))
def test_numpy_tiles_run_on_bounded_finite_inputs_and_agree_with_the_generic_tiles(
    name, monkeypatch
):
    """float32 inputs whose scores are bounded take the NumPy tiles (base-2 exponentials,
    query-major rows, a chunked causal diagonal) in every forward tile and backward item; they
    agree with the Array API tiles, which large scores take, within float32's floors."""
    case = dict(TILED_CASES[name])
    _small_tiles(monkeypatch, 512, 16)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, do = _inputs(rng, *case.pop("shape"), dtype=np.float32)
    options = {n: np.asarray(x) if isinstance(x, list) else x for n, x in case.items()}
    taken = {"forward": [], "backward": []}
    for pass_, function in (
        ("forward", "forward_tile"),
        ("backward", "backward_item"),
    ):
        real = getattr(numpy_tiles, function)

        def spy(*args, _real=real, _log=taken[pass_], **kwargs):
            _log.append(_real(*args, **kwargs))
            return _log[-1]

        monkeypatch.setattr(numpy_tiles, function, spy)
    fast = _run(q, k, v, do, **options)
    assert taken["forward"] and all(taken["forward"]), taken["forward"]
    assert taken["backward"] and all(taken["backward"]), taken["backward"]
    for function in ("forward_tile", "backward_item"):
        monkeypatch.setattr(numpy_tiles, function, lambda *args, **kwargs: False)
    generic = _run(q, k, v, do, **options)
    want = _naive(q, k, v, do, **case)
    passes = ("forward", "checkpoints", "checkpoints", "backward", "backward", "backward")
    for what, pass_, a, b, w in zip(
        ("o", "m", "l", "dq", "dk", "dv"), passes, fast, generic, want, strict=True
    ):
        bound = floor("attention", pass_, "float32")
        assert max_error(a, w) <= bound, f"{what}: NumPy tiles against the reference"
        assert max_error(b, w) <= bound, f"{what}: Array API tiles against the reference"


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
    for what, a, b in zip(
        ("o", "m", "l", "dq", "dk", "dv", "o without checkpoints"), got, want, strict=True
    ):
        scale = max(float(np.max(np.abs(b))), 1.0)
        np.testing.assert_allclose(a / scale, b / scale, rtol=0, atol=2e-5, err_msg=what)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_fully_masked_rows_are_zero_without_warnings(dtype):
    """k_lengths 0, queries past q_lengths: o = 0, m = -inf, l = 0, zero gradients, no FP warnings."""
    rng = np.random.default_rng(3)
    q, k, v, do = _inputs(rng, 3, 4, 2, 12, 70, 16, dtype=dtype)
    options = dict(
        causal=True,
        input_pos=np.asarray([0, 4, 2]),
        q_lengths=np.asarray([12, 5, 12]),
        k_lengths=np.asarray([70, 70, 0]),
    )
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
    budget = 8 * attention_impl.NUMPY_TILE_ELEMENTS * 4  # the larger of the two budgets
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
        want = _naive(q[:, :, r : r + 1], k[:, :, : r + 1], v[:, :, : r + 1], do[:, :, r : r + 1])[
            0
        ]
        np.testing.assert_allclose(
            o[:, :, r : r + 1], want, rtol=1e-5, atol=1e-5, err_msg=f"row {r}"
        )


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
        xk.attention_backward_,
        Duplicated(o),
        *(Duplicated(a, s) for a, s in zip(first[:3], shadows, strict=True)),
    )
    for q, k, v, do in (first, second):
        xk.attention_(o, q, k, v, causal=True, checkpoints=ck)
        args = (
            Duplicated(o, do),
            *(Duplicated(a, s) for a, s in zip((q, k, v), shadows, strict=True)),
        )
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
    k_lengths = np.asarray([20])
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(np.empty_like(q), q, k, v, causal=True, k_lengths=k_lengths, checkpoints=ck)
    ck.m[...], ck.l[...] = want[1], want[2]  # the reference's values, in the record of a forward
    dq, dk, dv = xk.attention_backward(
        do, q, k, v, want[0], checkpoints=ck, causal=True, k_lengths=k_lengths
    )
    for got, w in zip((dq, dk, dv), want[3:], strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def _decode_reference(q, k_cache, v_cache, lengths):
    """Decode as attention: one query at position lengths[b] - 1, causal, over keys 0 .. lengths[b] - 1."""
    out = np.zeros((*q.shape[:2], v_cache.shape[3]), dtype=q.dtype)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        o = xk.attention(
            q[b : b + 1, :, None, :],
            k_cache[b : b + 1],
            v_cache[b : b + 1],
            causal=True,
            input_pos=int(n) - 1,
        )
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
    for n_splits in [*range(1, n_tiles + 3), smax]:
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


def _tol(dtype):
    """Error allowed against the float64 reference for results computed in ``dtype`` (a few hundred ulps)."""
    return 512 * float(np.finfo(dtype).eps)


def _as(namespace, a):
    """A NumPy array ``a`` as an array of ``namespace`` ("numpy" or "torch", CPU)."""
    if namespace == "torch" and isinstance(a, np.ndarray):
        torch = pytest.importorskip("torch", reason="the torch namespace needs torch")
        return torch.from_numpy(np.ascontiguousarray(a))
    return a


def _run_in(namespace, q, k, v, do, **options):
    """:func:`_run` with every array (options included) converted to ``namespace``; results as NumPy."""
    arrays = [_as(namespace, a) for a in (q, k, v, do)]
    options = {n: _as(namespace, x) for n, x in options.items()}
    if namespace == "numpy":
        return _run(*arrays, **options)
    import torch

    q_t, k_t, v_t, do_t = arrays
    o = torch.full((*q_t.shape[:3], v_t.shape[3]), torch.nan, dtype=q_t.dtype)
    ck = xk.allocate_checkpoints(xk.attention_, q_t, k_t, v_t)
    xk.attention_(o, q_t, k_t, v_t, checkpoints=ck, **options)
    O, Q, K, V = (
        Duplicated(o, do_t),
        *(Duplicated(a, torch.full_like(a, torch.nan)) for a in (q_t, k_t, v_t)),
    )
    xk.attention_backward_(O, Q, K, V, checkpoints=ck, **options)
    return tuple(a.numpy() for a in (o, ck.m, ck.l, Q.shadow, K.shadow, V.shadow))


NAMESPACES = ["numpy", "torch"]
OUTPUTS = ("o", "m", "l", "dq", "dk", "dv")


def _assert_matches(got, want, dtype, rows=None, what=OUTPUTS):
    """``got`` equals ``want`` (the float64 reference) within the dtype's tolerance; ``rows`` selects query rows of o, m, l, dq."""
    for name in what:
        a, b = got[OUTPUTS.index(name)], want[OUTPUTS.index(name)]
        if rows is not None and name in ("o", "m", "l", "dq"):
            a, b = a[:, :, rows], b[:, :, rows]
        finite = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), finite), (
            f"{name}: non-finite where the reference is finite or back"
        )
        assert np.array_equal(a[~finite], b[~finite]), f"{name}: infinities differ"
        scale = max(float(np.max(np.abs(b[finite]), initial=0.0)), 1.0)
        # Checkpoints are float32, and the gradients are rebuilt from them.
        tol = _tol(dtype) if name == "o" else max(_tol(dtype), _tol(np.float32))
        np.testing.assert_allclose(
            a[finite] / scale, b[finite] / scale, rtol=0, atol=tol, err_msg=name
        )


NEGATIVE_POSITIONS = [
    pytest.param(namespace, pos, id=f"{namespace}-{name}")
    for name, pos in (("int", -3), ("array", [-3, -12]), ("int-min", -(2**31 - 1)))
    for namespace in NAMESPACES
] + [  # device arrays hold any int64 value: the kernels clamp, the front does not read them
    pytest.param("torch", pos, id=f"torch-{name}")
    for name, pos in (("huge-negative", [-1, -(2**62)]), ("huge-both", [2**62, -5]))
]


@pytest.mark.parametrize("namespace,input_pos", NEGATIVE_POSITIONS)
def test_negative_input_pos_gives_bottom_right_alignment(namespace, input_pos, monkeypatch):
    """``input_pos = Sk - Sq`` (< 0 for Sq > Sk): queries before key 0 see nothing (o = 0, m = -inf, l = 0, dq = 0)."""
    _small_tiles(monkeypatch, 64, 4)
    rng = np.random.default_rng(41)
    q, k, v, do = _inputs(rng, 2, 2, 1, 13, 10, 8)
    pos = np.asarray(input_pos, dtype=np.int64) if isinstance(input_pos, list) else input_pos
    got = _run_in(namespace, q, k, v, do, causal=True, input_pos=pos)
    want = _naive(q, k, v, do, causal=True, input_pos=np.clip(np.asarray(input_pos), -13, 10))
    _assert_matches(got, want, np.float64)
    blind = (
        np.broadcast_to(np.asarray(input_pos), (2,))[:, None] + np.arange(13)[None, :] < 0
    )  # (B, Sq)
    o, m, l_sum, dq = got[:4]
    assert blind.any()
    assert np.all(o[blind[:, None, :].repeat(2, 1)] == 0) and np.all(
        dq.transpose(0, 2, 1, 3)[blind] == 0
    )
    assert np.all(m.transpose(0, 2, 1)[blind] == -np.inf) and np.all(
        l_sum.transpose(0, 2, 1)[blind] == 0
    )


def test_bottom_right_alignment_matches_torch_sdpa_lower_right():
    """``input_pos = Sk - Sq`` is torch's ``causal_lower_right`` (Sq < Sk: every row sees a key)."""
    torch = pytest.importorskip("torch", reason="the oracle is torch's SDPA")
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(43)
    q, k, v, _ = _inputs(rng, 1, 2, 2, 5, 12, 8)
    got = xk.attention(q, k, v, causal=True, input_pos=12 - 5)
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=causal_lower_right(5, 12)
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=_tol(np.float64))


def test_allocating_backward_accepts_broadcast_kv_views():
    """K/V shared across the batch as ``np.broadcast_to`` views: gradients come back contiguous and correct."""
    rng = np.random.default_rng(47)
    q, k1, v1, do = _inputs(rng, 3, 2, 1, 9, 11, 8)
    k, v = np.broadcast_to(k1[:1], (3, 1, 11, 8)), np.broadcast_to(v1[:1], (3, 1, 11, 8))
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    o = xk.attention(q, k, v, causal=True, checkpoints=ck)
    dq, dk, dv = xk.attention_backward(do, q, k, v, o, checkpoints=ck, causal=True)
    _assert_matches((o, ck.m, ck.l, dq, dk, dv), _naive(q, k, v, do, causal=True), np.float64)
    assert dk.flags.c_contiguous and dv.flags.c_contiguous and dk.shape == k.shape


@pytest.mark.parametrize("causal", ["no", 1, None, np.True_])
def test_causal_must_be_a_bool_in_forward_and_backward(causal):
    rng = np.random.default_rng(53)
    q, k, v, do = _inputs(rng, 1, 2, 2, 4, 4, 8)
    o = np.full_like(q, 7.0)
    with pytest.raises(TypeError, match="attention_: causal must be a bool"):
        xk.attention_(o, q, k, v, causal=causal)
    assert np.all(o == 7.0)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, checkpoints=ck)
    shadows = [np.full_like(a, 7.0) for a in (q, k, v)]
    with pytest.raises(TypeError, match="attention_backward_: causal must be a bool"):
        xk.attention_backward_(
            Duplicated(o, do), *map(Duplicated, (q, k, v), shadows), checkpoints=ck, causal=causal
        )
    assert all(np.all(s == 7.0) for s in shadows)


@pytest.mark.parametrize(
    "input_pos",
    [2**31, -(2**40), np.asarray([0, 2**40]), np.asarray([-(2**31), 0])],
    ids=["int", "negative-int", "array", "negative-array"],
)
def test_host_input_pos_beyond_the_index_type_is_refused(input_pos):
    """Host values (Python ints, NumPy arrays) must fit the kernels' int32 index type; nothing is written."""
    rng = np.random.default_rng(59)
    q, k, v, _ = _inputs(rng, 2, 1, 1, 4, 4, 8)
    o = np.full_like(q, 7.0)
    with pytest.raises(
        ValueError, match=r"attention_: input_pos must lie in \[-2147483647, 2147483647\]"
    ):
        xk.attention_(o, q, k, v, causal=True, input_pos=input_pos)
    assert np.all(o == 7.0)


def test_input_pos_numpy_scalars_are_ints_and_float_arrays_are_refused():
    rng = np.random.default_rng(59)
    q, k, v, _ = _inputs(rng, 1, 1, 1, 4, 4, 8)
    np.testing.assert_array_equal(
        xk.attention(q, k, v, causal=True, input_pos=np.int64(-2)),
        xk.attention(q, k, v, causal=True, input_pos=-2),
    )
    with pytest.raises(TypeError, match=r"input_pos must have dtype int32 or int64"):
        xk.attention(q, k, v, input_pos=np.zeros(1))


def _clean_reference(q, k, v, do, **options):
    """The float64 reference with every non-finite input replaced by 0 (what rows that cannot see it get)."""
    return _naive(*(np.where(np.isfinite(a), a, 0.0) for a in (q, k, v, do)), **options)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_key_or_value_reaches_only_the_rows_that_see_it(namespace, where, monkeypatch):
    """Causal: rows before a NaN key/value stay finite and exact; rows at or after it are NaN."""
    _small_tiles(monkeypatch, 64, 4)
    rng = np.random.default_rng(61)
    q, k, v, do = _inputs(rng, 1, 2, 1, 12, 12, 8)
    {"k": k, "v": v}[where][0, 0, 6, 3] = np.nan
    got = _run_in(namespace, q, k, v, do, causal=True)
    want = _clean_reference(q, k, v, do, causal=True)
    _assert_matches(got, want, np.float64, rows=slice(0, 6), what=("o", "m", "l", "dq"))
    o, m, l_sum, dq, dk, dv = got
    assert np.all(np.isnan(o[:, :, 6:]).any(axis=-1)) and np.all(
        np.isnan(dq[:, :, 6:]).any(axis=-1)
    )
    if where == "k":
        assert np.all(np.isnan(m[:, :, 6:])) and np.all(np.isnan(l_sum[:, :, 6:]))


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_nan_beyond_k_lengths_and_q_lengths_is_never_seen(namespace, monkeypatch):
    _small_tiles(monkeypatch, 64, 4)
    rng = np.random.default_rng(67)
    q, k, v, do = _inputs(rng, 2, 2, 2, 9, 14, 8)
    options = dict(
        causal=True,
        input_pos=np.asarray([5, -2]),
        q_lengths=np.asarray([9, 6]),
        k_lengths=np.asarray([10, 7]),
    )
    k[0, :, 10:] = v[0, :, 10:] = np.nan
    k[1, :, 7:] = v[1, :, 7:] = np.inf
    q[1, :, 6:] = do[1, :, 6:] = np.nan
    got = _run_in(namespace, q, k, v, do, **options)
    assert all(
        np.isfinite(a[np.isfinite(b)]).all()
        for a, b in zip(got, _clean_reference(q, k, v, do, **options))
    )
    _assert_matches(got, _clean_reference(q, k, v, do, **options), np.float64)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_one_query_row_affects_only_that_row(namespace, causal, monkeypatch):
    """NaN in q[b, h, i]: o, m, l, dq of that row are NaN, dk/dv of the keys it sees are NaN; nothing else."""
    _small_tiles(
        monkeypatch, 64, 8
    )  # query tiles of 3 rows meet key tiles of 8: row 3 shares tiles with keys > 3
    rng = np.random.default_rng(71)
    q, k, v, do = _inputs(rng, 1, 2, 1, 10, 10, 8)
    q[0, 1, 3, 0] = np.nan
    got = _run_in(namespace, q, k, v, do, causal=causal)
    want = _naive(*(np.where(np.isfinite(a), a, 0.0) for a in (q, k, v, do)), causal=causal)
    o, m, l_sum, dq, dk, dv = got
    nan_row = np.zeros((1, 2, 10), dtype=bool)
    nan_row[0, 1, 3] = True
    for a in (o, dq):
        assert np.all(np.isnan(a[nan_row])) and np.all(np.isfinite(a[~nan_row]))
    assert np.isnan(m[nan_row]).all() and np.isnan(l_sum[nan_row]).all()
    seen = np.arange(10) <= 3 if causal else np.ones(10, dtype=bool)
    for a in (dk, dv):
        assert np.all(np.isnan(a[0, 0, seen]).any(axis=-1)) and np.all(np.isfinite(a[0, 0, ~seen]))
    other = np.ones(10, dtype=bool)
    other[3] = False
    _assert_matches(
        [a[:, :1] for a in got], [a[:, :1] for a in want], np.float64, what=("o", "m", "l", "dq")
    )
    _assert_matches(got, want, np.float64, rows=other, what=("o", "m", "l", "dq"))
    if causal:
        _assert_matches(
            [None] * 4 + [a[:, :, 4:] for a in got[4:]],
            [None] * 4 + [a[:, :, 4:] for a in want[4:]],
            np.float64,
            what=("dk", "dv"),
        )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_out_of_range_device_lengths_and_positions_are_clamped_by_the_kernels(namespace):
    """Past the front (whose value checks of device arrays run only in debug mode) the kernels clamp:
    lengths to [0, S], positions to [-Sq, Sk]; nothing is read out of bounds and results equal the clamped call."""
    rng = np.random.default_rng(73)
    q, k, v, do = _inputs(rng, 3, 2, 1, 6, 9, 8)
    raw = dict(
        input_pos=np.asarray([2**40, -(2**40), 3]),
        q_lengths=np.asarray([-4, 2**33, 5]),
        k_lengths=np.asarray([2**35, 4, -(2**34)]),
    )
    clamped = dict(
        input_pos=np.asarray([9, -6, 3]),
        q_lengths=np.asarray([0, 6, 5]),
        k_lengths=np.asarray([9, 4, 0]),
    )
    want = _naive(q, k, v, do, causal=True, **clamped)
    arrays = [_as(namespace, a) for a in (q, k, v, do)]
    options = {n: _as(namespace, a) for n, a in raw.items()}
    xp = np if namespace == "numpy" else __import__("torch")
    o = xp.full((3, 2, 6, 8), math.nan, dtype=xp.float64)
    m, l_sum = (
        xp.full((3, 2, 6), math.nan, dtype=xp.float32),
        xp.full((3, 2, 6), math.nan, dtype=xp.float32),
    )
    attention_impl.forward(o, *arrays[:3], m, l_sum, scale=1 / math.sqrt(8), causal=True, **options)
    grads = [xp.full(a.shape, math.nan, dtype=xp.float64) for a in arrays[:3]]
    delta, dq_accum = (
        xp.empty((3, 2, 6), dtype=xp.float64),
        xp.empty((3, 2, 6, 8), dtype=xp.float64),
    )
    attention_impl.backward(
        arrays[3],
        *arrays[:3],
        o,
        m,
        l_sum,
        *grads,
        delta,
        dq_accum,
        scale=1 / math.sqrt(8),
        causal=True,
        **options,
    )
    got = [np.asarray(a) for a in (o, m, l_sum, *grads)]
    _assert_matches(got, want, np.float32, what=("o", "dq", "dk", "dv"))


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_decode_clamps_out_of_range_device_lengths(namespace):
    rng = np.random.default_rng(79)
    q, k_cache, v_cache = (
        rng.standard_normal((3, 2, 8)),
        rng.standard_normal((3, 1, 7, 8)),
        rng.standard_normal((3, 1, 7, 8)),
    )
    want = _decode_reference(q, k_cache, v_cache, [7, 0, 4])
    xp = (
        np
        if namespace == "numpy"
        else pytest.importorskip("torch", reason="the torch namespace needs torch")
    )
    arrays = [_as(namespace, a) for a in (q, k_cache, v_cache, np.asarray([2**36, -(2**33), 4]))]
    o = xp.full((3, 2, 8), math.nan, dtype=xp.float64)
    scratch = [
        xp.full(shape, math.nan, dtype=xp.float64) for shape in ((3, 2, 3, 8), (3, 2, 3), (3, 2, 3))
    ]
    decode_impl.forward(o, *arrays, *scratch, scale=1 / math.sqrt(8))
    np.testing.assert_allclose(np.asarray(o), want, rtol=0, atol=_tol(np.float64))


def test_decode_n_splits_is_bounded_by_the_cache_length():
    """At most one split per cache entry (``max(1, Smax)``), through n_splits, the scratch or its allocator."""
    q = np.ones((1, 2, 8))
    cache = np.ones((1, 1, 8, 8))
    lengths = np.asarray([8])
    o = np.full((1, 2, 8), 7.0)
    with pytest.raises(
        ValueError, match=r"decode_attention_: n_splits must be <= 8 \(one split per cache entry"
    ):
        xk.decode_attention_(o, q, cache, cache, lengths, n_splits=10**6)
    scratch = xk.allocate_scratchspace(xk.decode_attention_, o, q, n_splits=9)
    with pytest.raises(
        ValueError, match=r"scratch.o_partial.shape\[2\] \(its n_splits\) must be <= 8"
    ):
        xk.decode_attention_(o, q, cache, cache, lengths, scratch=scratch)
    assert np.all(o == 7.0)
    with pytest.raises(
        ValueError, match=r"allocate_scratchspace\(decode_attention_\): n_splits must be <= 8"
    ):
        xk.allocate_scratchspace(xk.decode_attention_, o, q, cache, n_splits=9)
    empty = np.ones((1, 1, 0, 8))
    np.testing.assert_array_equal(
        xk.decode_attention(q, empty, empty, np.asarray([0]), n_splits=1), 0
    )
    np.testing.assert_allclose(xk.decode_attention(q, cache, cache, lengths, n_splits=8), 1.0)


# ---- the call contract (DESIGN section 6) ----------------------------------------------------


def _forward(q, k, v, **options):
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    o = np.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype)
    xk.attention_(o, q, k, v, checkpoints=ck, **options)
    return o, ck


def _backward_args(q, k, v, o, do):
    return Duplicated(o, do), *(Duplicated(a, np.full_like(a, 7.0)) for a in (q, k, v))


@pytest.mark.parametrize(
    "forward_options,backward_options,option",
    [
        (dict(causal=True), dict(), "causal"),
        (dict(scale=0.5), dict(scale=0.25), "scale"),
        (dict(causal=True, input_pos=-2), dict(causal=True, input_pos=0), "input_pos"),
        (dict(k_lengths=np.asarray([3, 5])), dict(k_lengths=np.asarray([3, 4])), "k_lengths"),
        (dict(q_lengths=np.asarray([3, 5])), dict(), "q_lengths"),
    ],
)
def test_backward_with_other_options_than_the_forward_names_the_option(
    forward_options, backward_options, option
):
    rng = np.random.default_rng(83)
    q, k, v, do = _inputs(rng, 2, 2, 1, 5, 6, 8)
    o, ck = _forward(q, k, v, **forward_options)
    args = _backward_args(q, k, v, o, do)
    with pytest.raises(
        ValueError, match=f"attention_backward_: {option}=.* differs from the forward"
    ):
        xk.attention_backward_(*args, checkpoints=ck, **backward_options)
    assert all(np.all(d.shadow == 7.0) for d in args[1:])
    same = {n: np.array(a) if isinstance(a, np.ndarray) else a for n, a in forward_options.items()}
    xk.attention_backward_(*args, checkpoints=ck, **same)  # equal NumPy values are the same option
    assert not any(np.any(d.shadow == 7.0) for d in args[1:])


def test_a_lengths_array_refilled_after_the_forward_is_refused():
    """The record holds the forward's NumPy values: the same buffer refilled before the
    backward (a training loop reusing it) is another option, named with both values."""
    rng = np.random.default_rng(84)
    q, k, v, do = _inputs(rng, 2, 2, 1, 5, 6, 8)
    lengths = np.asarray([3, 5])
    o, ck = _forward(q, k, v, k_lengths=lengths)
    lengths[0] = 6
    args = _backward_args(q, k, v, o, do)
    with pytest.raises(ValueError, match=r"k_lengths=\[6, 5\] .* had k_lengths=\[3, 5\]"):
        xk.attention_backward_(*args, checkpoints=ck, k_lengths=lengths)
    assert all(np.all(d.shadow == 7.0) for d in args[1:])
    lengths[0] = 3
    xk.attention_backward_(*args, checkpoints=ck, k_lengths=lengths)


def test_checkpoints_no_forward_wrote_are_refused():
    rng = np.random.default_rng(89)
    q, k, v, do = _inputs(rng, 1, 2, 2, 4, 4, 8)
    o, _ = _forward(q, k, v)
    by_hand = AttentionCheckpoints(
        m=np.zeros((1, 2, 4), np.float32), l=np.ones((1, 2, 4), np.float32)
    )
    fresh = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, checkpoints=None)  # inference: records nothing
    for ck in (by_hand, fresh):
        with pytest.raises(
            ValueError, match="attention_backward_: checkpoints were never written by a forward"
        ):
            xk.attention_backward_(*_backward_args(q, k, v, o, do), checkpoints=ck)


def test_outputs_overlapping_inputs_are_refused_before_any_write():
    """``attention_(k, q, k, v)`` and shadows sharing memory give a ValueError naming both arguments."""
    rng = np.random.default_rng(97)
    q, k, v, do = _inputs(rng, 1, 2, 2, 6, 6, 8, dtype=np.float32)
    before = k.copy()
    with pytest.raises(ValueError, match="attention_: o shares memory with k"):
        xk.attention_(k, q, k, v)
    np.testing.assert_array_equal(k, before)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    with pytest.raises(ValueError, match="attention_: checkpoints.m shares memory with q"):
        xk.attention_(np.empty_like(q), q, k, v, checkpoints=ck._replace(m=q[:, :, :, 0]))
    o, ck = _forward(q, k, v)
    shared = np.full_like(k, 7.0)
    O, Q = Duplicated(o, do), Duplicated(q, np.full_like(q, 7.0))
    with pytest.raises(ValueError, match="attention_backward_: .* shares memory with"):
        xk.attention_backward_(O, Q, Duplicated(k, shared), Duplicated(v, shared), checkpoints=ck)
    with pytest.raises(
        ValueError, match="attention_backward_: Q.shadow shares memory with O.shadow"
    ):
        xk.attention_backward_(
            O, Duplicated(q, do), *(Duplicated(a, np.empty_like(a)) for a in (k, v)), checkpoints=ck
        )
    assert np.all(Q.shadow == 7.0) and np.all(shared == 7.0)


def test_read_only_outputs_and_grad_requiring_tensors_are_refused():
    rng = np.random.default_rng(101)
    q, k, v, do = _inputs(rng, 1, 2, 2, 4, 4, 8)
    o = np.full_like(q, 7.0)
    o.flags.writeable = False
    with pytest.raises(ValueError, match="attention_: o is read-only"):
        xk.attention_(o, q, k, v)
    o, ck = _forward(q, k, v)
    O, Q, K, V = _backward_args(q, k, v, o, do)
    V.shadow.flags.writeable = False
    with pytest.raises(ValueError, match="attention_backward_: V.shadow is read-only"):
        xk.attention_backward_(O, Q, K, V, checkpoints=ck)
    assert np.all(Q.shadow == 7.0)
    out = np.full((1, 2, 8), 7.0)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="decode_attention_: o is read-only"):
        xk.decode_attention_(out, q[:, :, 0], k, v, np.asarray([4]))
    torch = pytest.importorskip("torch", reason="torch is not installed")
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
    ot = torch.zeros_like(qt, requires_grad=True)
    with pytest.raises(ValueError, match="attention_: o requires grad"):
        xk.attention_(ot, qt, kt, vt)
    assert torch.all(ot == 0)


def test_decode_output_overlapping_an_input_is_refused():
    rng = np.random.default_rng(103)
    q, cache = rng.standard_normal((2, 2, 8)), rng.standard_normal((2, 1, 5, 8))
    before = q.copy()
    with pytest.raises(ValueError, match="decode_attention_: o shares memory with q"):
        xk.decode_attention_(q, q, cache, cache, np.asarray([5, 2]))
    np.testing.assert_array_equal(q, before)
    scratch = xk.allocate_scratchspace(xk.decode_attention_, np.empty_like(q), q, n_splits=2)
    with pytest.raises(
        ValueError,
        match="decode_attention_: scratch.m_partial shares memory with scratch.l_partial",
    ):
        xk.decode_attention_(
            np.empty_like(q),
            q,
            cache,
            cache,
            np.asarray([5, 2]),
            scratch=scratch._replace(l_partial=scratch.m_partial),
        )


def test_device_lengths_are_value_checked_in_debug_mode_only():
    """Outside debug mode a torch k_lengths past Sk reaches the kernels, which clamp it; debug mode refuses it."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rng = np.random.default_rng(107)
    q, k, v, _ = (torch.from_numpy(a) for a in _inputs(rng, 2, 2, 1, 5, 6, 8))
    lengths = torch.tensor([99, -3])
    got = xk.attention(q, k, v, causal=True, k_lengths=lengths, input_pos=torch.tensor([2**40, -7]))
    want = xk.attention(
        q, k, v, causal=True, k_lengths=torch.tensor([6, 0]), input_pos=torch.tensor([6, -5])
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with (
        xk.debug(),
        pytest.raises(
            ValueError, match=r"attention: k_lengths must lie in \[0, 6\]|attention_: k_lengths"
        ),
    ):
        xk.attention(q, k, v, k_lengths=lengths)
    with (
        xk.debug(),
        pytest.raises(ValueError, match=r"decode_attention_: lengths must lie in \[0, 6\]"),
    ):
        xk.decode_attention(q[:, :, 0], k, v, lengths)


def _run_torch(q, k, v, do, **options):
    """:func:`_run` over PyTorch CPU tensors (``options``' arrays converted too); NumPy results."""
    torch = pytest.importorskip("torch")
    t = {
        name: torch.from_numpy(np.ascontiguousarray(a))
        for name, a in options.items()
        if isinstance(a, np.ndarray)
    }
    tq, tk, tv, tdo = (torch.from_numpy(a.copy()) for a in (q, k, v, do))
    o = torch.full((*q.shape[:3], v.shape[3]), math.nan, dtype=tq.dtype)
    ck = xk.allocate_checkpoints(xk.attention_, tq, tk, tv)
    ck.m[...] = math.nan
    ck.l[...] = math.nan
    xk.attention_(o, tq, tk, tv, checkpoints=ck, **{**options, **t})
    O, Q, K, V = (
        Duplicated(o, tdo),
        *(Duplicated(a, torch.full_like(a, math.nan)) for a in (tq, tk, tv)),
    )
    xk.attention_backward_(O, Q, K, V, checkpoints=ck, **{**options, **t})
    return tuple(a.numpy() for a in (o, ck.m, ck.l, Q.shadow, K.shadow, V.shadow))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_cpu_tensors_take_the_numpy_path(dtype):
    """PyTorch CPU tensors run through zero-copy NumPy views: the very same results, bit for bit,
    as NumPy arrays (GQA, causal, lengths: every branch of the tiles)."""
    rng = np.random.default_rng(21)
    q, k, v, do = _inputs(rng, 2, 4, 2, 300, 700, 16, dtype=dtype)
    options = dict(
        causal=True, input_pos=5, q_lengths=np.array([300, 200]), k_lengths=np.array([700, 650])
    )
    want = _run(q, k, v, do, **options)
    got = _run_torch(q, k, v, do, **options)
    for w, g, what in zip(want, got, ("o", "m", "l", "dq", "dk", "dv"), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=what)


def test_worker_threads_change_nothing_and_blas_threads_are_restored(monkeypatch):
    """Tiles shared among worker threads give the results of one thread, bit for bit, and
    NumPy's BLAS thread count is back to the caller's after each call."""
    from xpkernels.backends.array_api import _blocks

    rng = np.random.default_rng(22)
    q, k, v, do = _inputs(rng, 2, 4, 2, 300, 700, 16, dtype=np.float32)
    options = dict(causal=True, input_pos=5, q_lengths=np.array([300, 200]))
    monkeypatch.setattr(_blocks, "_cores", lambda: 4)
    blas = _blocks._numpy_openblas()
    before = None if blas is None else blas[0]()
    threaded = _run(q, k, v, do, **options)
    if blas is not None:
        assert blas[0]() == before
    monkeypatch.setattr(_blocks, "MAX_WORKERS", 1)
    single = _run(q, k, v, do, **options)
    for a, b, what in zip(threaded, single, ("o", "m", "l", "dq", "dk", "dv"), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=what)
