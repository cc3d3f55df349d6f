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


@pytest.mark.parametrize("offset", [-100.0, 100.0])
def test_far_from_zero_scores_after_masked_tiles_are_stable(offset):
    """Softmax ignores a constant shift: rows whose first kept keys come late, at scores ~ +-100."""
    q, k, v, do = qkvo(n_q=40, n_kv=400)
    late = xm.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx >= 150 + 5 * q_idx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shifted = forward_and_backward(
            q, k, v, do, mask_mod=late, score_mod=lambda s, b, h, q_idx, kv_idx: s + offset
        )
    plain = forward_and_backward(q, k, v, do, mask_mod=late)
    np.testing.assert_allclose(shifted[0], plain[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shifted[1].m, plain[1].m + offset, rtol=1e-6)
    np.testing.assert_allclose(shifted[1].l, plain[1].l, rtol=1e-5)
    for a, b in zip(shifted[2], plain[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


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
    s = np.where(kv_idx <= q_idx, score_mod(raw, 0, 0, q_idx, kv_idx), -np.inf) if causal else (
        score_mod(raw, 0, 0, q_idx, kv_idx)
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
