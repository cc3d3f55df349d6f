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
from xpkernels.buffers import allocate_checkpoints, grad_shadow
from xpkernels.flex_attention import (
    flex_attention,
    flex_attention_,
    flex_attention_backward,
)

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
    np.testing.assert_allclose(ck_f.m, ck_a.m, rtol=1e-6)
    np.testing.assert_allclose(ck_f.l, ck_a.l, rtol=1e-5)
    for name, a, f in zip("qkv", grads_a, grads_f):
        np.testing.assert_allclose(f, a, rtol=1e-4, atol=1e-5, err_msg=name)


def test_checkpoints_interchange_with_attention():
    """Flex's (m, l) feed attention's backward and vice versa: one contract."""
    q, k, v, do = qkvo(n_q=40, n_kv=200)
    ck = allocate_checkpoints(attention_, q, k, v)
    o = flex_attention(q, k, v, checkpoints=ck, mask_mod=xm.CausalMask(), input_pos=160)
    expected = attention_backward(do, q, k, v, o, checkpoints=ck, causal=True, input_pos=160)
    flex_ck = allocate_checkpoints(flex_attention_, q, k, v)
    attention_(np.empty_like(o), q, k, v, checkpoints=flex_ck, causal=True, input_pos=160)
    got = flex_attention_backward(
        do, q, k, v, o, checkpoints=flex_ck, mask_mod=xm.CausalMask(), input_pos=160
    )
    for a, f in zip(expected, got):
        np.testing.assert_allclose(f, a, rtol=1e-4, atol=1e-5)


class TileCounter:
    """Records every (rows, key span, state) chunk the backend computes, and mask evaluations."""

    def __init__(self, monkeypatch, mask):
        self.chunks, self.mask_runs = [], 0
        scores = backend._Tiles.scores
        run = xm.BoundGraph.run

        def counting_scores(tiles, s, b, g, r0, r1, j0, j1, state):
            self.chunks.append((b, g, r0, j0, state))
            return scores(tiles, s, b, g, r0, r1, j0, j1, state)

        def counting_run(bound, grid, score=None):
            if bound.graph is mask.graph:
                self.mask_runs += 1
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
    as_score = xm.ScoreMod(lambda s, b, h, q_idx, kv_idx: xm.where(kv_idx + 20 <= q_idx, s, -math.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_score = forward_and_backward(q, k, v, do, score_mod=as_score)
    by_mask = forward_and_backward(q, k, v, do, mask_mod=late)
    np.testing.assert_allclose(by_score[0], by_mask[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(by_score[1].m[:, :, :20], -np.inf)
    for a, b in zip(by_score[2], by_mask[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


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
    """Every Python block of docs/flex.md in order: mods, built-ins, training, block masks."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)
    assert namespace["losses"][-1] < 0.01 * namespace["losses"][0]
