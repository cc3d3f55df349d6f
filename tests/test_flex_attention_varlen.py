"""flex_attention_varlen: packed FlexAttention is flex_attention of each sequence alone.

The mods must see the sequence index as ``b`` and positions counted from
each sequence's start: outputs, checkpoints, dq/dk/dv and the score mod's
array gradients (summed over the sequences) equal running every sequence
through :func:`xpkernels.flex_attention` with ``b`` fixed to its index
(float64), over zero-length query and key sequences, one-token sequences and
bottom-right causal alignment. Band masks skip tiles per sequence. On torch,
``loss.backward()`` reaches q, k, v and the mod's tensors, gradcheck passes
and ``torch.compile(fullgraph=True)`` traces the op. The float64 reference
over every target lives in the conformance spec.
"""

from __future__ import annotations

import numpy as np
import pytest
from xpkernels.backends.array_api import flex_attention as array_api_flex

import xpkernels as xk
from xpkernels import mods as xm
from xpkernels.buffers import grad_shadow

Q_LENS = (5, 0, 40, 1, 3)
K_LENS = (9, 4, 40, 0, 12)
H, HKV, D = 4, 2, 8


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(rng, q_lens=Q_LENS, k_lens=K_LENS):
    tq, tk = sum(q_lens), sum(k_lens)
    q = rng.standard_normal((tq, H, D))
    k = rng.standard_normal((tk, HKV, D))
    v = rng.standard_normal((tk, HKV, D))
    do = rng.standard_normal((tq, H, D))
    return q, k, v, do, _cu(q_lens), _cu(k_lens)


def _score(temp, table, b=None):
    """A temperature per sequence and a relative-position bias; ``b`` given fixes the sequence."""

    def fn(score, bb, h, q_idx, kv_idx, *, temp, table):
        index = xm.minimum(xm.maximum(q_idx - kv_idx, -3), 3) + 3
        return score * temp[bb if b is None else b] + table[h, index]

    return xm.ScoreMod(fn, temp=temp, table=table)


def _bottom_right(q_lens=Q_LENS, k_lens=K_LENS):
    return np.array([sk - sq for sq, sk in zip(q_lens, k_lens)], dtype=np.int64)


def _heads_first(a):
    return a.transpose(1, 0, 2)[None]


def test_equals_flex_of_each_sequence_with_b_the_sequence_index():
    rng = np.random.default_rng(0)
    q, k, v, do, cq, ck = _inputs(rng)
    temp, table = rng.standard_normal(len(Q_LENS)), rng.standard_normal((H, 7))
    mask, pos = xm.CausalMask(), _bottom_right()
    score = _score(temp, table)
    ckpt = xk.allocate_checkpoints(xk.flex_attention_varlen_, q, k, v)
    o = xk.flex_attention_varlen(
        q, k, v, cq, ck, score_mod=score, mask_mod=mask, input_pos=pos, checkpoints=ckpt
    )
    grads = grad_shadow(score)
    dq, dk, dv = xk.flex_attention_varlen_backward(
        do,
        q,
        k,
        v,
        o,
        cq,
        ck,
        checkpoints=ckpt,
        score_mod=score,
        score_mod_grad=grads,
        mask_mod=mask,
        input_pos=pos,
    )
    temp_grad, table_grad = np.zeros_like(temp), np.zeros_like(table)
    for b in range(len(Q_LENS)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = _heads_first(q[qs]), _heads_first(k[ks]), _heads_first(v[ks])
        alone = _score(temp, table, b)
        c = xk.allocate_checkpoints(xk.flex_attention_, qb, kb, vb)
        ob = xk.flex_attention(
            qb, kb, vb, score_mod=alone, mask_mod=mask, input_pos=int(pos[b]), checkpoints=c
        )
        g = grad_shadow(alone)
        dqb, dkb, dvb = xk.flex_attention_backward(
            _heads_first(do[qs]),
            qb,
            kb,
            vb,
            ob,
            checkpoints=c,
            score_mod=alone,
            score_mod_grad=g,
            mask_mod=mask,
            input_pos=int(pos[b]),
        )
        np.testing.assert_allclose(_heads_first(o[qs]), ob, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(ckpt.m[None, :, qs], c.m)
        np.testing.assert_array_equal(ckpt.l[None, :, qs], c.l)
        for packed, alone_grad in ((dq[qs], dqb), (dk[ks], dkb), (dv[ks], dvb)):
            np.testing.assert_allclose(_heads_first(packed), alone_grad, rtol=1e-12, atol=1e-12)
        fields = dict(g.items())
        temp_grad += fields["temp"]
        table_grad += fields["table"]
    fields = dict(grads.items())
    np.testing.assert_allclose(fields["temp"], temp_grad, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fields["table"], table_grad, rtol=1e-12, atol=1e-12)
    # the sequence without keys keeps nothing; the one without queries gets no key gradient
    empty_keys = slice(cq[3], cq[4])
    assert np.all(o[empty_keys] == 0) and np.all(ckpt.m[:, empty_keys] == -np.inf)
    assert np.all(dk[ck[1] : ck[2]] == 0) and np.all(dv[ck[1] : ck[2]] == 0)
    assert temp_grad[1] == 0 and temp_grad[3] == 0


def test_band_masks_skip_tiles_per_sequence(monkeypatch):
    """A causal sequence of 300 visits its lower triangle of tiles; a sequence of 10 one tile."""
    rng = np.random.default_rng(1)
    q_lens = k_lens = (300, 10)
    q, k, v, _, cq, ck = _inputs(rng, q_lens, k_lens)
    visited = []
    forward = array_api_flex.forward

    def spy(*args, plan, **kwargs):
        visited.append(plan.states.shape[2:] + (int(np.count_nonzero(plan.states)),))
        return forward(*args, plan=plan, **kwargs)

    monkeypatch.setattr(array_api_flex, "forward", spy)
    o = xk.flex_attention_varlen(q, k, v, cq, ck, mask_mod=xm.CausalMask())
    (tiles_q, tiles_k, kept), short = visited
    assert tiles_q == tiles_k > 1 and kept == tiles_q * (tiles_q + 1) // 2  # the lower triangle
    assert short == (1, 1, 1)
    expected = xk.attention_varlen(q, k, v, cq, ck, causal=True)
    np.testing.assert_allclose(o, expected, rtol=1e-12, atol=1e-12)


def test_torch_backward_reaches_inputs_and_mod_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q_lens, k_lens = (3, 0, 4, 1), (5, 2, 4, 0)
    q, k, v, do, cq, ck = (torch.from_numpy(a) for a in _inputs(rng, q_lens, k_lens))
    pos = torch.from_numpy(_bottom_right(q_lens, k_lens))
    temp = torch.from_numpy(rng.standard_normal(len(q_lens)))
    table = torch.from_numpy(rng.standard_normal((H, 7)) * 0.3)
    leaves = [a.clone().requires_grad_() for a in (q, k, v, temp, table)]

    def f(q, k, v, temp, table):
        mod = _score(temp, table)
        return xk.flex_attention_varlen(
            q, k, v, cq, ck, score_mod=mod, mask_mod=xm.CausalMask(), input_pos=pos
        )

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5, rtol=1e-4)
    f(*leaves).backward(do)
    score = _score(temp, table)
    ckpt = xk.allocate_checkpoints(xk.flex_attention_varlen_, q, k, v)
    options = {"score_mod": score, "mask_mod": xm.CausalMask(), "input_pos": pos}
    o = xk.flex_attention_varlen(q, k, v, cq, ck, checkpoints=ckpt, **options)
    grads = grad_shadow(score)
    expected = xk.flex_attention_varlen_backward(
        do, q, k, v, o, cq, ck, checkpoints=ckpt, score_mod_grad=grads, **options
    )
    fields = dict(grads.items())
    for leaf, e in zip(leaves, (*expected, fields["temp"], fields["table"])):
        torch.testing.assert_close(leaf.grad, e)
    with pytest.raises(ValueError, match="temp.* requires grad"):
        xk.flex_attention_varlen_(
            torch.empty_like(o), q, k, v, cq, ck, score_mod=_score(leaves[3], table)
        )


def test_torch_compile_fullgraph_forward_and_backward():
    """The mods are filed once at trace time; the mod's Parameter is a graph input and learns."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q_lens, k_lens = (2, 4), (5, 3)
    q, k, v, do, cq, ck = (torch.from_numpy(a).float() for a in _inputs(rng, q_lens, k_lens))
    cq, ck = cq.int(), ck.int()
    temp = torch.nn.Parameter(torch.tensor([0.5, 2.0]))
    mod, mask = _score(temp, torch.zeros(H, 7)), xm.CausalMask()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(q, k, v):
        o = xk.flex_attention_varlen(
            q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=5, score_mod=mod, mask_mod=mask
        )
        return (o * do).sum()

    leaves = [a.clone().requires_grad_() for a in (q, k, v)]
    torch.compile(f, fullgraph=True, backend=backend)(*leaves).backward()
    assert any("xpkernels.flex_attention_varlen" in s for s in seen), seen
    compiled_temp_grad, temp.grad = temp.grad.clone(), None
    eager = [a.clone().requires_grad_() for a in (q, k, v)]
    f(*eager).backward()
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a.grad, e.grad)
    torch.testing.assert_close(compiled_temp_grad, temp.grad)
