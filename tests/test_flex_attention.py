"""FlexAttention: equality with attention, tile skipping, gradient accumulation, the user guide."""

from __future__ import annotations

import importlib
import math
import pathlib
import re
import warnings

import numpy as np
import pytest

from xpkernels import mods as xm
from xpkernels.attention import attention, attention_, attention_backward
from xpkernels.buffers import Duplicated, allocate_checkpoints, grad_shadow
from xpkernels.flex_attention import (
    flex_attention,
    flex_attention_,
    flex_attention_backward,
    flex_attention_backward_,
)
from xpkernels.testing.harness import max_error
from xpkernels.testing.host_reads import HostRead, no_host_reads
from xpkernels.testing.tolerances import floor

backend = importlib.import_module("xpkernels.backends.array_api.flex_attention")
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "flex.md"


def qkvo(batch=2, heads=4, kv_heads=2, n_q=96, n_kv=96, d=16, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, n_kv, d)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, n_kv, d)).astype(dtype)
    do = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    return q, k, v, do


def forward_and_backward(q, k, v, do, **options):
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, **options)
    grads = flex_attention_backward(do, q, k, v, o, checkpoints=ck, **options)
    return o, ck, grads


@pytest.mark.parametrize(
    "attention_options, flex_options",
    [
        ({}, {}),
        (
            {"input_pos": 30},
            {"input_pos": 30, "mask_mod": xm.FullMask(), "score_mod": xm.NoOpScore()},
        ),
        ({"causal": True, "input_pos": 40}, {"input_pos": 40, "mask_mod": xm.CausalMask()}),
        ({"causal": True}, {"mask_mod": lambda b, h, q_idx, kv_idx: kv_idx <= q_idx}),
    ],
)
def test_flex_equals_attention(attention_options, flex_options):
    q, k, v, do = qkvo(n_q=70, n_kv=700, d=24)
    ck_a = allocate_checkpoints(attention_, q, k, v)
    o_a = attention(q, k, v, checkpoints=ck_a, **attention_options)
    grads_a = attention_backward(do, q, k, v, o_a, checkpoints=ck_a, **attention_options)
    o_f, ck_f, grads_f = forward_and_backward(q, k, v, do, **flex_options)
    np.testing.assert_allclose(o_f, o_a, rtol=1e-5, atol=1e-6)
    # Two float32 score products summed in different orders: the checkpoints' floor.
    for name, f, a in zip("ml", ck_f, ck_a):
        assert max_error(f, a) <= floor("flex_attention", "checkpoints", "float32"), name
    for name, a, f in zip("qkv", grads_a, grads_f):
        np.testing.assert_allclose(f, a, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "attention_options, flex_options",
    [
        ({}, {}),
        ({}, {"mask_mod": xm.FullMask()}),
        ({"causal": True}, {"mask_mod": xm.CausalMask()}),
        ({"causal": True, "input_pos": 30}, {"mask_mod": xm.CausalMask(), "input_pos": 30}),
        (
            {"causal": True, "input_pos": np.array([5, 640])},
            {"mask_mod": xm.CausalMask(), "input_pos": np.array([5, 640])},
        ),
    ],
)
def test_plain_flex_runs_the_attention_tiles_on_numpy(attention_options, flex_options, monkeypatch):
    """Without a score mod, no mask or a causal one (by its exact band) runs attention's own
    tiles on NumPy: output, checkpoints and gradients bit for bit attention's."""
    calls = []

    def spy(name):
        real = getattr(backend._attention, name)

        def run(*args, **kwargs):
            calls.append(name)
            real(*args, **kwargs)

        return run

    for name in ("forward", "backward"):
        monkeypatch.setattr(backend._attention, name, spy(name))
    q, k, v, do = qkvo(n_q=70, n_kv=700, d=24)
    ck_a = allocate_checkpoints(attention_, q, k, v)
    o_a = attention(q, k, v, checkpoints=ck_a, **attention_options)
    grads_a = attention_backward(do, q, k, v, o_a, checkpoints=ck_a, **attention_options)
    calls.clear()
    o_f, ck_f, grads_f = forward_and_backward(q, k, v, do, **flex_options)
    assert calls == ["forward", "backward"]
    for got, want in zip((o_f, *ck_f, *grads_f), (o_a, *ck_a, *grads_a), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "options",
    [
        {"mask_mod": xm.SlidingWindowMask(64)},
        {"mask_mod": xm.CausalMask(), "block_sparse": False},
        {"mask_mod": xm.CausalMask(), "score_mod": xm.SoftCapScore(20.0)},
        {"mask_mod": xm.CausalMask(), "input_pos": -5},  # rows before key 0 keep no key
        {"mask_mod": xm.CausalMask() & xm.PrefixMask(300), "input_pos": 250},
    ],
)
def test_other_flex_calls_keep_the_flex_tiles(options, monkeypatch):
    """A window, a causal mask without band skipping, a score mod, empty rows or a clipped
    causal band are not plain attention: flex's own tiles run them."""
    monkeypatch.setattr(backend._attention, "forward", None)  # any call would fail
    monkeypatch.setattr(backend._attention, "backward", None)
    q, k, v, do = qkvo(n_q=70, n_kv=700, d=24)
    o, ck, _ = forward_and_backward(q, k, v, do, **options)
    assert np.isfinite(o).all()


def test_checkpoints_interchange_with_attention():
    """Flex's (m, l) equal attention's (one contract); attention's backward takes only checkpoints
    its own forward recorded (it cannot compare flex's mods with its options)."""
    q, k, v, do = qkvo(n_q=40, n_kv=200)
    flex_ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=flex_ck, mask_mod=xm.CausalMask(), input_pos=160)
    with pytest.raises(ValueError, match="attention_backward_: checkpoints were"):
        attention_backward(do, q, k, v, o, checkpoints=flex_ck, causal=True, input_pos=160)
    ck = allocate_checkpoints(attention_, q, k, v)
    attention_(np.empty_like(o), q, k, v, checkpoints=ck, causal=True, input_pos=160)
    for name in ("m", "l"):
        np.testing.assert_allclose(getattr(flex_ck, name), getattr(ck, name), rtol=1e-5, atol=1e-6)
    expected = attention_backward(do, q, k, v, o, checkpoints=ck, causal=True, input_pos=160)
    got = flex_attention_backward(
        do, q, k, v, o, checkpoints=flex_ck, mask_mod=xm.CausalMask(), input_pos=160
    )
    for a, f in zip(expected, got):
        np.testing.assert_allclose(f, a, rtol=1e-4, atol=1e-5)


class TileCounter:
    """Records every (rows, key tile, state) chunk the backend computes, and the key tiles the
    mask is evaluated on.

    A span of several ``tile_n``-key tiles (the forward merges tiles of one state in a row)
    counts each tile it covers, in both."""

    def __init__(self, monkeypatch, mask, tile_n=32):
        self.chunks, self.mask_runs = [], 0
        scores = backend._Tiles.scores
        run = xm.BoundGraph.run

        def counting_scores(tiles, s, b, g, r0, r1, j0, j1, state, **options):
            self.chunks += [(b, g, r0, j, state) for j in range(j0, j1, tile_n)]
            return scores(tiles, s, b, g, r0, r1, j0, j1, state, **options)

        def counting_run(bound, grid, score=None):
            if bound.graph is mask.graph:
                self.mask_runs += grid.ranges["kv_idx"][2] // tile_n
            return run(bound, grid, score)

        monkeypatch.setattr(backend._Tiles, "scores", counting_scores)
        monkeypatch.setattr(xm.BoundGraph, "run", counting_run)

    def reset(self):
        self.chunks, self.mask_runs = [], 0


@pytest.mark.parametrize("how", ["band", "block-mask"])
def test_skipped_tiles_are_not_computed_forward_or_backward(monkeypatch, how):
    q, k, v, do = qkvo(batch=1, heads=2, kv_heads=1, n_q=256, n_kv=256)
    mask = (
        xm.SlidingWindowMask(100) & xm.DocumentMask(np.repeat(np.arange(4), 64))
        if how == "block-mask"
        else xm.CausalMask()
    )
    options = (
        {"block_mask": xm.build_block_mask(mask, 256, 256, tile_m=32, tile_n=32)}
        if how == "block-mask"
        else {"mask_mod": mask}
    )
    plan = xm.plan_tiles(
        mask,
        options.get("block_mask"),
        block_sparse=True,
        n_q=256,
        n_kv=256,
        positions=(0,),
        tile_m=32,
        tile_n=32,
    )
    if how == "band":
        monkeypatch.setattr(backend, "default_tiles", lambda n_q, n_kv, group, masked: (32, 32))
        # the tiles as other namespaces run a causal mask (NumPy hands it to the attention tiles)
        monkeypatch.setattr(backend, "_plain_attention", lambda *args: None)
    states = plan.group(0, 0, 2)
    visited, partial = int(np.sum(states != xm.SKIP)), int(np.sum(states == xm.PARTIAL))
    assert states.size == 64 and visited < 40 and partial < visited

    counter = TileCounter(monkeypatch, mask)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, **options)
    assert len(counter.chunks) == visited
    assert counter.mask_runs == partial, "full tiles must not evaluate the mask"
    assert all(states[r0 // 32, j0 // 32] == state for _, _, r0, j0, state in counter.chunks)
    counter.reset()
    sparse = flex_attention_backward(do, q, k, v, o, checkpoints=ck, **options)
    assert len(counter.chunks) == visited and counter.mask_runs == partial

    counter.reset()
    dense_o = flex_attention(q, k, v, checkpoints=ck, block_sparse=False, **options)
    assert len(counter.chunks) == 64 and counter.mask_runs == 64
    dense = flex_attention_backward(
        do, q, k, v, dense_o, checkpoints=ck, block_sparse=False, **options
    )
    np.testing.assert_allclose(o, dense_o, rtol=1e-6, atol=1e-6)
    for name, a, b in zip("qkv", sparse, dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_score_mod_gradients_accumulate_into_the_grad_shadow():
    q, k, v, do = qkvo(n_q=50, n_kv=130, dtype=np.float64)
    mod = xm.AliBiScore(np.linspace(0.01, 0.2, 4)) >> xm.SoftCapScore(3.0)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(
        q, k, v, checkpoints=ck, score_mod=mod, mask_mod=xm.CausalMask(), input_pos=80
    )
    g = grad_shadow(mod)
    for calls in (1, 2):
        flex_attention_backward(
            do,
            q,
            k,
            v,
            o,
            checkpoints=ck,
            score_mod=mod,
            score_mod_grad=g,
            mask_mod=xm.CausalMask(),
            input_pos=80,
        )
        if calls == 1:
            once = np.array(g.slopes)
    np.testing.assert_allclose(g.slopes, 2 * once)
    assert np.abs(once).max() > 1e-3
    g.zero_()
    assert not g.slopes.any()


def test_fully_masked_rows_give_zeros_without_warnings():
    q, k, v, do = qkvo(n_q=64, n_kv=100)
    late = xm.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx + 40 <= q_idx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, ck, (dq, dk, dv) = forward_and_backward(
            q, k, v, do, mask_mod=late, score_mod=xm.SoftCapScore(5.0)
        )
    assert (
        np.all(o[:, :, :40] == 0)
        and np.all(np.isneginf(ck.m[:, :, :40]))
        and np.all(ck.l[:, :, :40] == 0)
    )
    assert np.all(dq[:, :, :40] == 0) and np.all(dk[:, :, 24:] == 0) and np.all(dv[:, :, 24:] == 0)
    assert np.isfinite(o).all() and np.isfinite(dq).all() and np.isfinite(dk).all()


def _shift_bounds(q, k, v, do, keep, offset):
    """Float64 reference and first-order bounds on what a score shift moves in float32.

    Error analysis. Softmax is exactly invariant under ``s -> s + offset``; in
    float32 the shifted run rounds every score ``s + offset`` (and, in its
    backward, the row's log-sum-exp ``lse ~ offset``), an error of at most
    ``u |s + offset|`` with ``u = eps(float32) / 2`` -- ~3.8e-6 at |score| ~ 100,
    where the unshifted run rounds |score| ~ 1. So each probability
    ``p_ij = exp(s_ij - lse_i)`` of row ``i`` moves by a relative ``|eta_ij| <=
    2 E_i``, ``E_i = u (max_j |s_ij + offset| + log n_keys)`` (one rounding of
    the score, one of the row's reference point). Propagated to first order:

    - ``o_i = sum_j p_ij v_j`` is normalised (a change common to the row
      cancels): ``|do_i| <= 2 E_i sum_j p_ij |v_j - o_i|``; ``|dl_i| / l_i <= 2 E_i``;
    - ``dv_j = sum_i p_ij do_i``: ``|d dv_j| <= sum_i 2 E_i p_ij |do_i|``;
    - ``dS_ij = p_ij (do_i . v_j - do_i . o_i)``:
      ``|d dS_ij| <= 2 E_i p_ij |do_i . v_j - do_i . o_i| + p_ij |do_i| . |d o_i|``;
    - ``dq_i = scale sum_j dS_ij k_j`` and ``dk_j = scale sum_i dS_ij q_i``: the
      same sums over ``|d dS|`` with ``|k_j|`` and ``|q_i|``.

    Returns
    -------
    reference : tuple
        Float64 ``(o, l, dq, dk, dv)``.
    bounds : tuple
        How far the shifted run's ``(o, l, dq, dk, dv)`` may move, elementwise.
    """
    u = np.finfo(np.float32).eps / 2
    group = q.shape[1] // k.shape[1]
    q64, do64 = q.astype(np.float64), do.astype(np.float64)
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = np.where(keep, scale * q64 @ k64.swapaxes(-1, -2), -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = e / l
    o = p @ v64
    dp = do64 @ v64.swapaxes(-1, -2)
    delta = (do64 * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    kv_heads = (k.shape[0], k.shape[1], group) + k.shape[2:]
    reference = (
        o,
        l[..., 0],
        scale * ds @ k64,
        (scale * ds.swapaxes(-1, -2) @ q64).reshape(kv_heads).sum(axis=2),
        (p.swapaxes(-1, -2) @ do64).reshape(kv_heads).sum(axis=2),
    )
    shifted = np.abs(np.where(keep, s + offset, 0.0)).max(axis=-1, keepdims=True)
    two_e = 2 * u * (shifted + np.log(keep.sum(axis=-1, keepdims=True)))
    o_bound = two_e * (p[..., None] * np.abs(v64[:, :, None] - o[:, :, :, None])).sum(axis=-2)
    ds_bound = two_e * p * np.abs(dp - delta) + p * (np.abs(do64) * o_bound).sum(-1, keepdims=True)
    ds_bound = np.where(keep, ds_bound, 0.0)
    bounds = (
        o_bound,
        (two_e * l)[..., 0],
        scale * ds_bound @ np.abs(k64),
        (scale * ds_bound.swapaxes(-1, -2) @ np.abs(q64)).reshape(kv_heads).sum(axis=2),
        ((two_e * p).swapaxes(-1, -2) @ np.abs(do64)).reshape(kv_heads).sum(axis=2),
    )
    return reference, bounds


@pytest.mark.parametrize("offset", [-100.0, 100.0])
def test_far_from_zero_scores_after_masked_tiles_are_stable(offset):
    """Softmax ignores a constant shift: rows whose first kept keys come late, at scores ~ +-100.

    The shifted run may differ from the plain one by what rounding its shifted
    scores moves (:func:`_shift_bounds`) plus the two runs' own float32 errors,
    each taken as twice the plain run's error against the float64 reference
    (DESIGN section 5).
    """
    n_q, n_kv = 40, 400
    q, k, v, do = qkvo(n_q=n_q, n_kv=n_kv)
    late = xm.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx >= 150 + 5 * q_idx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shifted = forward_and_backward(
            q, k, v, do, mask_mod=late, score_mod=lambda s, b, h, q_idx, kv_idx: s + offset
        )
    plain = forward_and_backward(q, k, v, do, mask_mod=late)
    keep = np.arange(n_kv)[None, :] >= 150 + 5 * np.arange(n_q)[:, None]
    reference, bounds = _shift_bounds(q, k, v, do, keep, offset)
    # Both sides round the same float32 max score plus offset once: 2 u |m| = eps |m| apart.
    np.testing.assert_allclose(shifted[1].m, plain[1].m + offset, rtol=np.finfo(np.float32).eps)
    got = (shifted[0], shifted[1].l, *shifted[2])
    want = (plain[0], plain[1].l, *plain[2])
    for name, g, w, ref, bound in zip(("o", "l", "dq", "dk", "dv"), got, want, reference, bounds):
        floor = 2 * np.max(np.abs(w - ref))
        excess = np.abs(g.astype(np.float64) - w) - (bound + floor)
        assert excess.max() <= 0, f"{name} moved {excess.max():.3g} past its bound"


def test_score_mod_may_mask_with_minus_infinity():
    """A score mod returning -inf drops keys exactly like a mask, whole rows included."""
    q, k, v, do = qkvo(n_q=50, n_kv=300)
    late = xm.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx + 20 <= q_idx)
    as_score = xm.ScoreMod(
        lambda s, b, h, q_idx, kv_idx: xm.where(kv_idx + 20 <= q_idx, s, -math.inf)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_score = forward_and_backward(q, k, v, do, score_mod=as_score)
    by_mask = forward_and_backward(q, k, v, do, mask_mod=late)
    # Equal up to float32 rounding (the mod and the mask select in different steps): the floors.
    assert max_error(by_score[0], by_mask[0]) <= floor("flex_attention", "forward", "float32")
    np.testing.assert_array_equal(by_score[1].m[:, :, :20], -np.inf)
    for a, b in zip(by_score[2], by_mask[2]):
        assert max_error(a, b) <= floor("flex_attention", "backward", "float32")


NON_FINITE_MODS = {
    "causal mask": {"mask_mod": xm.CausalMask()},
    "mask function": {"mask_mod": lambda b, h, q_idx, kv_idx: kv_idx <= q_idx},
    "score mod -inf": {
        "score_mod": lambda s, b, h, q_idx, kv_idx: xm.where(kv_idx <= q_idx, s, -math.inf)
    },
    "dense": {"mask_mod": xm.CausalMask(), "block_sparse": False},
}


def _non_finite_rows(*arrays):
    """Per array, the positions (axis 2) holding a non-finite value in any batch, head or column."""
    return [np.flatnonzero(~np.isfinite(a).all(axis=(0, 1, 3))) for a in arrays]


def _with_nan(arrays, where, position):
    arrays = {name: a.copy() for name, a in arrays.items()}
    arrays[where][0, :, position, 3] = np.nan
    return arrays


@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("mods", sorted(NON_FINITE_MODS))
def test_non_finite_inputs_reach_the_rows_that_see_them_as_in_attention(where, mods):
    """A NaN at position 100 of q, k, v or do: o, dq, dk, dv are non-finite exactly where causal
    attention's are, though the tiles holding it hide some of its pairs (256-wide tiles here)."""
    q, k, v, do = qkvo(batch=1, heads=2, kv_heads=2, n_q=300, n_kv=300)
    a = _with_nan({"q": q, "k": k, "v": v, "do": do}, where, 100)
    ck = allocate_checkpoints(attention_, a["q"], a["k"], a["v"])
    o = attention(a["q"], a["k"], a["v"], checkpoints=ck, causal=True)
    grads = attention_backward(a["do"], a["q"], a["k"], a["v"], o, checkpoints=ck, causal=True)
    want = _non_finite_rows(o, *grads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic
        got = forward_and_backward(a["q"], a["k"], a["v"], a["do"], **NON_FINITE_MODS[mods])
    for name, g, w in zip(("o", "dq", "dk", "dv"), _non_finite_rows(got[0], *got[2]), want):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("where", ["k", "v"])
def test_non_finite_key_or_value_under_a_sliding_window(where):
    """Pairs hidden on both sides of the kept band: a NaN key or value at 100 reaches the rows
    100-150 that keep it (o, dq) and the keys those rows keep (dk; dv too for a key, whose NaN
    reaches m and l)."""
    q, k, v, do = qkvo(batch=1, heads=2, kv_heads=2, n_q=300, n_kv=300)
    a = _with_nan({"q": q, "k": k, "v": v, "do": do}, where, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        o, _, grads = forward_and_backward(
            a["q"], a["k"], a["v"], a["do"], mask_mod=xm.SlidingWindowMask(50)
        )
    rows, keys = np.arange(100, 151), np.arange(50, 151)
    want = [rows, rows, keys, keys if where == "k" else np.arange(0)]
    for name, g, w in zip(("o", "dq", "dk", "dv"), _non_finite_rows(o, *grads), want):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_plain_functions_work_as_mods():
    q, k, v, _ = qkvo(n_q=30, n_kv=60)
    table = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)

    def bias(score, b, h, q_idx, kv_idx, *, table):
        return score + table[h, (q_idx - kv_idx) % 8]

    expected = flex_attention(
        q, k, v, score_mod=xm.ScoreMod(bias, table=table), mask_mod=xm.CausalMask()
    )
    got = flex_attention(
        q,
        k,
        v,
        score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.0 * q_idx + xm.where(kv_idx >= 0, 0.0, 1.0),
        mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx,
    )
    unbiased = flex_attention(q, k, v, mask_mod=xm.CausalMask())
    np.testing.assert_allclose(got, unbiased, rtol=1e-6, atol=1e-6)
    assert not np.allclose(expected, unbiased)


def test_captured_arrays_must_live_with_q():
    torch = pytest.importorskip("torch", reason="torch provides the second namespace")
    q, k, v, _ = qkvo()
    with pytest.raises(
        TypeError, match="captured AliBiScore.slopes is a torch array but o is a numpy array"
    ):
        flex_attention(q, k, v, score_mod=xm.AliBiScore(torch.ones(4)))


def test_the_user_guide_runs():
    """Every Python block of docs/flex.md in order: mods, built-ins, training, block masks, packing."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)
    assert namespace["losses"][-1] < 0.01 * namespace["losses"][0]


NONLINEAR_SCORES = {
    "silu": lambda s, b, h, q_idx, kv_idx: s / (1.0 + xm.exp(-s)),
    "tanh": lambda s, b, h, q_idx, kv_idx: xm.tanh(s),
    "exp": lambda s, b, h, q_idx, kv_idx: xm.exp(0.5 * s),
    "sqrt": lambda s, b, h, q_idx, kv_idx: xm.sqrt(s * s + 1.0),
}


def naive_grads(q, k, v, do, score_mod, causal):
    """Float64 dq, dk, dv from full matrices, the mod applied by calling it on NumPy arrays."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    raw = q @ np.swapaxes(k_rep, -1, -2) / math.sqrt(q.shape[-1])
    q_idx, kv_idx = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
    s = (
        np.where(kv_idx <= q_idx, score_mod(raw, 0, 0, q_idx, kv_idx), -np.inf)
        if causal
        else (score_mod(raw, 0, 0, q_idx, kv_idx))
    )
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v_rep
    g = p * (do @ np.swapaxes(v_rep, -1, -2) - np.sum(do * o, axis=-1, keepdims=True))
    ds, _ = xm.score_grad(score_mod, raw, g, q_idx, kv_idx)
    ds = ds / math.sqrt(q.shape[-1])
    b, kv_heads = k.shape[:2]
    dk = (np.swapaxes(ds, -1, -2) @ q).reshape(b, kv_heads, group, *k.shape[2:]).sum(axis=2)
    dv = (np.swapaxes(p, -1, -2) @ do).reshape(b, kv_heads, group, *v.shape[2:]).sum(axis=2)
    return ds @ k_rep, dk, dv


@pytest.mark.parametrize("name", sorted(NONLINEAR_SCORES))
@pytest.mark.parametrize("mask", [None, "causal-full-tiles"])
def test_backward_of_score_mods_ending_in_a_nonlinear_operation(name, mask):
    """The mod's reverse mode reads the mod's own output: it must survive ``s - lse``."""
    q, k, v, do = qkvo(batch=1, heads=2, kv_heads=1, n_q=64, n_kv=64, dtype=np.float64)
    score = xm.ScoreMod(NONLINEAR_SCORES[name])
    options = {"score_mod": score}
    if mask is not None:
        options["block_mask"] = xm.build_block_mask(xm.CausalMask(), 64, 64, tile_m=16, tile_n=16)
    _, _, got = forward_and_backward(q, k, v, do, **options)
    expected = naive_grads(q, k, v, do, score, causal=mask is not None)
    tol = 100 * np.finfo(np.float32).eps  # the checkpoints (m, l) are float32 even for float64
    for axis, a, b in zip("qkv", got, expected):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=axis)


def test_negative_input_pos_aligns_causal_masks_bottom_right():
    """``input_pos = Sk - Sq`` (Sq > Sk): the first Sq - Sk queries see nothing, the rest as flash-attn."""
    q, k, v, do = qkvo(n_q=50, n_kv=30, dtype=np.float64)
    o, ck, (dq, dk, dv) = forward_and_backward(q, k, v, do, mask_mod=xm.CausalMask(), input_pos=-20)
    assert np.all(o[:, :, :20] == 0) and np.all(dq[:, :, :20] == 0)
    assert np.all(np.isneginf(ck.m[:, :, :20])) and np.all(ck.l[:, :, :20] == 0)
    tail_o, tail_ck, tail_grads = forward_and_backward(
        q[:, :, 20:], k, v, do[:, :, 20:], mask_mod=xm.CausalMask()
    )
    np.testing.assert_allclose(o[:, :, 20:], tail_o, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ck.m[:, :, 20:], tail_ck.m, rtol=1e-6)
    for a, b in zip((dq[:, :, 20:], dk, dv), tail_grads):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    per_batch, _, _ = forward_and_backward(
        q, k, v, do, mask_mod=xm.CausalMask(), input_pos=np.array([-20, -20])
    )
    np.testing.assert_array_equal(per_batch, o)


@pytest.mark.parametrize("input_pos", [[0], [0, 1, 2]])
def test_a_wrong_length_input_pos_list_is_refused_before_any_write(input_pos):
    q, k, v, _ = qkvo(n_q=8, n_kv=8)
    o = np.full((2, 4, 8, 16), 7.0, np.float32)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    ck.m[...] = 7.0
    ck.l[...] = 7.0
    with pytest.raises(
        ValueError, match=r"flex_attention_: input_pos must have 2 entries \(one per batch\), got"
    ):
        flex_attention_(o, q, k, v, mask_mod=xm.CausalMask(), input_pos=input_pos, checkpoints=ck)
    assert np.all(o == 7.0) and np.all(ck.m == 7.0) and np.all(ck.l == 7.0)


@pytest.mark.parametrize(
    "other", [lambda: xm.AliBiScore(np.ones(4)), lambda: xm.BiasScore(np.ones((1, 1, 8, 8)))]
)
def test_score_mod_grad_of_another_mod_is_refused(other):
    q, k, v, do = qkvo(n_q=8, n_kv=8, dtype=np.float64)
    mod = xm.AliBiScore(np.linspace(0.1, 0.4, 4))
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, score_mod=mod, checkpoints=ck)
    with pytest.raises(
        TypeError,
        match=r"flex_attention_backward_: score_mod_grad does not match score_mod .*made by grad_shadow of another",
    ):
        flex_attention_backward(
            do, q, k, v, o, checkpoints=ck, score_mod=mod, score_mod_grad=grad_shadow(other())
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mask_mod": 3}, r"flex_attention_: mask_mod must be a MaskMod or a function .*got int"),
        (
            {"mask_mod": xm.SoftCapScore(2.0)},
            r"flex_attention_: mask_mod must be a MaskMod .*got SoftCapScore\(2\), a score mod",
        ),
        (
            {"score_mod": "x"},
            r"flex_attention_: score_mod must be a ScoreMod or a function .*got str",
        ),
        (
            {"score_mod": xm.CausalMask()},
            r"flex_attention_: score_mod must be a ScoreMod .*got CausalMask, a mask mod",
        ),
    ],
)
def test_bad_mod_types_name_the_function_and_argument(options, message):
    q, k, v, _ = qkvo(n_q=8, n_kv=8)
    with pytest.raises(TypeError, match=message):
        flex_attention_(np.empty((2, 4, 8, 16), np.float32), q, k, v, **options)


def test_allocating_backward_with_broadcast_keys_and_values():
    """Batch-1 K/V shared across the batch with ``np.broadcast_to``: gradients come back contiguous."""
    q, k, v, do = qkvo(batch=2, n_q=8, n_kv=8)
    k_b, v_b = np.broadcast_to(k[:1], k.shape), np.broadcast_to(v[:1], v.shape)
    ck = allocate_checkpoints(flex_attention_, q, k_b, v_b)
    o = flex_attention(q, k_b, v_b, checkpoints=ck, mask_mod=xm.CausalMask())
    dq, dk, dv = flex_attention_backward(
        do, q, k_b, v_b, o, checkpoints=ck, mask_mod=xm.CausalMask()
    )
    expected = flex_attention_backward(
        do,
        q,
        np.ascontiguousarray(k_b),
        np.ascontiguousarray(v_b),
        o,
        checkpoints=ck,
        mask_mod=xm.CausalMask(),
    )
    for a, b in zip((dq, dk, dv), expected):
        assert a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)


def _no_host_reads():
    """The shipped host-read guard (``xpkernels.testing.host_reads``), with torch."""
    torch = pytest.importorskip("torch", reason="the host-read guard is a torch tensor subclass")
    return torch, HostRead, no_host_reads


def test_in_place_calls_read_no_device_value_on_the_host():
    """input_pos and captured integer arrays on the device are never read on the host."""
    torch, HostRead, guard = _no_host_reads()
    q, k, v, do = (torch.from_numpy(a) for a in qkvo(n_q=24, n_kv=40, dtype=np.float64))
    pos = guard(torch.tensor([16, 3]))
    with pytest.raises(HostRead):
        bool(pos[0])
    doc = guard(torch.from_numpy(np.repeat(np.arange(4), 10)).reshape(1, 40).repeat(2, 1))
    bucket = guard(torch.tensor([0, 1, 2, 3, 3, 4, 4, 4]))
    table = torch.linspace(-1.0, 1.0, 20, dtype=torch.float64).reshape(4, 5)

    def bucketed(score, b, h, q_idx, kv_idx, *, bucket, table):
        return score + table[h, bucket[xm.minimum(xm.abs(q_idx - kv_idx), 7)]]

    score = xm.ScoreMod(bucketed, bucket=bucket, table=table)
    mask = xm.CausalMask() & xm.DocumentMask(doc)
    o = torch.empty_like(q)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    flex_attention_(o, q, k, v, score_mod=score, mask_mod=mask, input_pos=pos, checkpoints=ck)
    grads = [torch.empty_like(a) for a in (q, k, v)]
    g = grad_shadow(score)
    flex_attention_backward_(
        Duplicated(o, do),
        *(Duplicated(a, d) for a, d in zip((q, k, v), grads)),
        checkpoints=ck,
        score_mod=score,
        score_mod_grad=g,
        mask_mod=mask,
        input_pos=pos,
    )
    host = {
        "bucket": bucket.as_subclass(torch.Tensor).numpy(),
        "doc": doc.as_subclass(torch.Tensor).numpy(),
    }
    host_score = xm.ScoreMod(bucketed, bucket=host["bucket"], table=table.numpy())
    host_mask = xm.CausalMask() & xm.DocumentMask(host["doc"])
    ck_h = allocate_checkpoints(flex_attention_, q.numpy(), k.numpy(), v.numpy())
    o_h = flex_attention(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        score_mod=host_score,
        mask_mod=host_mask,
        input_pos=np.array([16, 3]),
        checkpoints=ck_h,
    )
    g_h = grad_shadow(host_score)
    expected = flex_attention_backward(
        do.numpy(),
        q.numpy(),
        k.numpy(),
        v.numpy(),
        o_h,
        checkpoints=ck_h,
        score_mod=host_score,
        score_mod_grad=g_h,
        mask_mod=host_mask,
        input_pos=np.array([16, 3]),
    )
    np.testing.assert_allclose(o.numpy(), o_h, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ck.m.numpy(), ck_h.m, rtol=1e-6)
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g.table.numpy(), g_h.table, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("namespace", ["numpy", "torch"])
def test_score_mods_ignoring_the_score_give_uniform_rows(namespace):
    """A mod's result that does not span the tile (no score in it) is shifted like any other."""
    q, k, v, do = qkvo(n_q=8, n_kv=8)
    if namespace == "torch":
        torch = pytest.importorskip("torch", reason="torch is the second namespace")
        q, k, v, do = (torch.from_numpy(a) for a in (q, k, v, do))
    mod = xm.ScoreMod(lambda s, b, h, q_idx, kv_idx: xm.where(kv_idx >= 0, 100.0, 0.0))
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, score_mod=mod, checkpoints=ck)
    dq, _, dv = flex_attention_backward(do, q, k, v, o, score_mod=mod, checkpoints=ck)
    mean_v = np.repeat(np.asarray(v).mean(axis=2, keepdims=True), 2, axis=1)
    np.testing.assert_allclose(
        np.asarray(o), np.broadcast_to(mean_v, o.shape), rtol=1e-5, atol=1e-6
    )
    assert np.all(np.asarray(dq) == 0) and np.isfinite(np.asarray(dv)).all()


def test_device_input_pos_evaluates_band_masks_densely_and_refuses_block_masks():
    """Device positions are not read: band skipping needs host positions, as a BlockMask does."""
    torch = pytest.importorskip("torch", reason="torch provides device arrays here")
    q, k, v, _ = (torch.from_numpy(a) for a in qkvo(n_q=40, n_kv=300))
    pos = torch.tensor([250, 7])
    expected = flex_attention(q, k, v, mask_mod=xm.CausalMask(), input_pos=[250, 7])
    got = flex_attention(q, k, v, mask_mod=xm.CausalMask(), input_pos=pos)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
    block = xm.build_block_mask(xm.CausalMask(), 40, 300, tile_m=8, tile_n=32, input_pos=[250, 7])
    np.testing.assert_allclose(
        flex_attention(q, k, v, block_mask=block, input_pos=[250, 7]).numpy(),
        expected.numpy(),
        rtol=1e-6,
        atol=1e-6,
    )
    with pytest.raises(TypeError, match=r"with a block_mask, input_pos must be an int, a list"):
        flex_attention(q, k, v, block_mask=block, input_pos=pos)


def test_numpy_integer_scalar_input_pos_is_a_host_int_for_any_namespace():
    torch = pytest.importorskip("torch", reason="torch provides the second namespace")
    q, k, v, _ = (torch.from_numpy(a) for a in qkvo(n_q=8, n_kv=16))
    expected = flex_attention(q, k, v, mask_mod=xm.CausalMask(), input_pos=3)
    got = flex_attention(q, k, v, mask_mod=xm.CausalMask(), input_pos=np.int64(3))
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_read_only_and_overlapping_outputs_are_refused_before_any_write():
    q, k, v, do = qkvo(n_q=8, n_kv=8)
    o = np.full((2, 4, 8, 16), 7.0, np.float32)
    o.flags.writeable = False
    with pytest.raises(ValueError, match="flex_attention_: o is read-only"):
        flex_attention_(o, q, k, v)
    packed = np.concatenate([k, k], axis=1)  # (2, 4, 8, 16): o would be written over k
    before = packed.copy()
    with pytest.raises(ValueError, match="flex_attention_: o shares memory with k"):
        flex_attention_(packed, q, packed[:, :2], v)
    np.testing.assert_array_equal(packed, before)
    slopes = np.linspace(0.1, 0.4, 4)
    mod = xm.AliBiScore(slopes)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, score_mod=mod, checkpoints=ck)
    g = grad_shadow(mod)
    dq = np.full_like(q, 7.0)
    with pytest.raises(
        ValueError, match="flex_attention_backward_: Q.shadow shares memory with O.shadow"
    ):
        flex_attention_backward_(
            Duplicated(o, dq[:, :, :, :16]),
            Duplicated(q, dq),
            Duplicated(k),
            Duplicated(v),
            checkpoints=ck,
            score_mod=mod,
            score_mod_grad=g,
        )
    assert np.all(dq == 7.0)


def test_debug_mode_reads_and_checks_device_values():
    """Outside debug mode device values are clamped, never read; debug mode reads and checks them."""
    import xpkernels

    torch, HostRead, guard = _no_host_reads()
    q, k, v, _ = (torch.from_numpy(a) for a in qkvo(n_q=8, n_kv=8))
    bucket = torch.tensor([0, 1, 2, 30])
    mod = xm.ScoreMod(
        lambda s, b, h, q_idx, kv_idx, *, bucket, w: s + w[bucket[kv_idx % 4]],
        bucket=bucket,
        w=torch.zeros(4),
    )
    o = torch.empty(2, 4, 8, 16)
    flex_attention_(o, q, k, v, score_mod=mod, input_pos=guard(torch.tensor([0, 2**40])))
    with xpkernels.debug(), pytest.raises(HostRead):
        flex_attention_(o, q, k, v, input_pos=guard(torch.tensor([0, 1])))
    with (
        xpkernels.debug(),
        pytest.raises(ValueError, match=r"flex_attention_: input_pos must lie in"),
    ):
        flex_attention_(o, q, k, v, input_pos=torch.tensor([0, 2**40]))
    with (
        xpkernels.debug(),
        pytest.raises(
            ValueError, match=r"w \(shape \(4,\)\) is indexed on axis 0 by values in \[0, 30\]"
        ),
    ):
        flex_attention_(o, q, k, v, score_mod=mod)


def test_backward_refuses_other_mods_or_options_than_its_forward():
    """Checkpoints record the forward's mods (traced graph and captured arrays) and options."""
    q, k, v, do = qkvo(n_q=24, n_kv=40)
    table = np.zeros((q.shape[1], 8), np.float32)

    def bias(score, b, h, q_idx, kv_idx, *, table):
        return score + table[h, xm.minimum(q_idx - kv_idx, 7) * 0]

    score = xm.ScoreMod(bias, table=table)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(
        q, k, v, checkpoints=ck, mask_mod=xm.CausalMask(), score_mod=score, input_pos=16
    )
    again = dict(mask_mod=xm.CausalMask(), score_mod=xm.ScoreMod(bias, table=table), input_pos=16)
    flex_attention_backward(do, q, k, v, o, checkpoints=ck, **again)
    for name, change in (
        ("mask_mod", dict(mask_mod=xm.SlidingWindowMask(4))),
        ("score_mod", dict(score_mod=xm.ScoreMod(bias, table=table.copy()))),
        ("input_pos", dict(input_pos=15)),
        ("scale", dict(scale=0.5)),
    ):
        with pytest.raises(
            ValueError, match=f"flex_attention_backward_: {name}=.* differs from the forward"
        ):
            flex_attention_backward(do, q, k, v, o, checkpoints=ck, **{**again, **change})


def test_a_mod_rebuilt_over_fresh_views_of_the_same_parameter_matches_its_forward():
    """Records and score_mod_grad compare captured arrays by memory, not by Python object."""
    q, k, v, do = qkvo(n_q=16, n_kv=24)
    params = np.full((2, q.shape[1]), 0.1, np.float32)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, score_mod=xm.AliBiScore(params[0]))
    mod = xm.AliBiScore(params[0])
    assert params[0] is not params[0]  # each index makes a new view object
    flex_attention_backward(
        do,
        q,
        k,
        v,
        o,
        checkpoints=ck,
        score_mod=mod,
        score_mod_grad=grad_shadow(xm.AliBiScore(params[0])),
    )
    with pytest.raises(ValueError, match="score_mod=.* differs"):
        flex_attention_backward(do, q, k, v, o, checkpoints=ck, score_mod=xm.AliBiScore(params[1]))


def test_backward_matches_a_rebuilt_block_mask_and_refuses_another():
    q, k, v, do = qkvo(n_q=24, n_kv=40)

    def blocks(tile_n):
        return xm.build_block_mask(xm.CausalMask(), 24, 40, tile_m=8, tile_n=tile_n, input_pos=16)

    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, block_mask=blocks(8), input_pos=16)
    flex_attention_backward(do, q, k, v, o, checkpoints=ck, block_mask=blocks(8), input_pos=16)
    with pytest.raises(ValueError, match="block_mask=BlockMask.* differs from the forward"):
        flex_attention_backward(do, q, k, v, o, checkpoints=ck, block_mask=blocks(16), input_pos=16)


def test_forward_evaluates_a_mask_without_heads_once_for_all_kv_heads(monkeypatch):
    """A mask that reads no head index keeps the same pairs for every kv head: each of the
    forward's worker threads evaluates it at most once per (row chunk, PARTIAL key tile) --
    which worker takes which item depends on timing -- and gets what evaluating it for every
    kv head gives, bit for bit."""
    blocks = importlib.import_module("xpkernels.backends.array_api._blocks")
    monkeypatch.setattr(blocks, "_cores", lambda: 2)
    q, k, v, _ = qkvo(batch=2, heads=8, kv_heads=4, n_q=256, n_kv=256)
    mask = xm.SlidingWindowMask(50) & xm.DocumentMask(np.repeat(np.arange(4), 64))
    monkeypatch.setattr(backend, "default_tiles", lambda n_q, n_kv, group, masked: (32, 32))
    plan = xm.plan_tiles(
        mask, None, block_sparse=True, n_q=256, n_kv=256, positions=(0,), tile_m=32, tile_n=32
    )
    partial = int(np.sum(plan.group(0, 0, 2) == xm.PARTIAL))
    counter = TileCounter(monkeypatch, mask)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, mask_mod=mask)
    # per batch and worker at most, not per kv head
    assert 2 * partial <= counter.mask_runs <= 2 * 2 * partial
    monkeypatch.setattr(backend._MaskCache, "get", lambda self, b, r0, r1, j0, compute: compute())
    counter.reset()
    want_ck = allocate_checkpoints(flex_attention_, q, k, v)
    want = flex_attention(q, k, v, checkpoints=want_ck, mask_mod=mask)
    assert counter.mask_runs == 2 * 4 * partial
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(ck.m, want_ck.m)
    np.testing.assert_array_equal(ck.l, want_ck.l)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_cpu_tensors_take_the_numpy_path(dtype):
    """PyTorch CPU tensors -- inputs, the mods' captured arrays, input_pos and the score mod's
    gradient accumulators -- run the NumPy path through zero-copy views: the same results, bit
    for bit, as NumPy arrays (forward, checkpoints, backward, score-mod gradients)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q, k, v, do = qkvo(n_q=24, n_kv=40, dtype=dtype)
    doc = np.repeat(np.arange(4), 10).reshape(1, 40).repeat(2, 0)
    bucket = np.array([0, 1, 2, 3, 3, 4, 4, 4])
    table = np.linspace(-1.0, 1.0, 20).reshape(4, 5).astype(dtype)

    def bucketed(score, b, h, q_idx, kv_idx, *, bucket, table):
        return score + table[h, bucket[xm.minimum(xm.abs(q_idx - kv_idx), 7)]]

    def run(convert):
        score = xm.ScoreMod(bucketed, bucket=convert(bucket), table=convert(table))
        mask = xm.CausalMask() & xm.DocumentMask(convert(doc))
        options = dict(score_mod=score, mask_mod=mask, input_pos=convert(np.array([16, 3])))
        qs, ks, vs, dos = (convert(a) for a in (q, k, v, do))
        ck = allocate_checkpoints(flex_attention_, qs, ks, vs)
        o = flex_attention(qs, ks, vs, checkpoints=ck, **options)
        g = grad_shadow(score)
        grads = flex_attention_backward(
            dos, qs, ks, vs, o, checkpoints=ck, score_mod_grad=g, **options
        )
        results = [o, *ck, *grads, *dict(g.items()).values()]
        return [a if isinstance(a, np.ndarray) else a.numpy() for a in results]

    want = run(np.copy)
    got = run(lambda a: torch.from_numpy(a.copy()))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
