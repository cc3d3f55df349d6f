"""The ``xpkernels`` torch.library ops: opcheck for every op and dtype, gradcheck for every functional op.

``torch.library.opcheck`` checks each op's schema (mutations declared exactly
in ``mutates_args``, no aliasing of outputs), its fake implementation against
the real one, its autograd registration and its behaviour under AOT dispatch;
``torch.autograd.gradcheck`` (float64, CPU) checks the registered backward --
xpkernels' own backward kernels -- against finite differences, for the
inputs and for the arrays a flex score mod captures.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no xpkernels.torch")

import xpkernels as xk
import xpkernels.torch as xt
from xpkernels.mods import (
    AliBiScore,
    BiasScore,
    CausalMask,
    PairFeatureScore,
    ScoreMod,
    SlidingWindowMask,
    minimum,
)
from xpkernels.torch._flex import file

ops = torch.ops.xpkernels
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _t(*shape, dtype, grad=False, generator):
    return (
        torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(grad)
    )


def _cases(dtype):
    """``(name, op, args)`` for every op in ``xt.OPS``, on small CPU tensors of ``dtype``.

    Each op takes its tensors first (cotangents, arrays, the options' tensors, checkpoints,
    gradients, scratch), then its scalar options in declared order, then ``backend``.
    """
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        return _t(*shape, dtype=dtype, grad=grad, generator=g)

    def f32(*shape):
        return torch.empty(*shape, dtype=torch.float32)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x, w, b = t(3, 8, grad=True), t(8, grad=True), t(8, grad=True)
    dy = t(3, 8)
    _, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-6, 0.0, None)
    _, mean, lrstd = ops.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5, None)
    y = ops.softmax(x.detach(), None)
    q, k, v = t(1, 4, 5, 8, grad=True), t(1, 2, 6, 8, grad=True), t(1, 2, 6, 4, grad=True)
    # input_pos_array, q_lengths, k_lengths; causal, scale, input_pos, backend
    att, att_s = (None, None, None), (True, None, 1, None)
    o, m, l = ops.attention(q.detach(), k.detach(), v.detach(), *att, *att_s)
    do = t(1, 4, 5, 4)
    lengths = torch.tensor([5, 2])
    qd, kc, vc = t(2, 4, 8), t(2, 2, 7, 8), t(2, 2, 7, 4)
    slopes = torch.rand(4, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    mods = (AliBiScore(slopes), CausalMask())
    score_key, mask_key = (file(mod) for mod in mods)
    # score_mod, mask_mod, block_mask, block_sparse, scale, input_pos (forward; backward:
    # then deterministic), backend
    flex = (score_key, mask_key, None, True, None, 0)
    flex_s, flex_b = (*flex, None), (*flex, True, None)
    fo, fm, fl = ops.flex_attention(
        q.detach(), k.detach(), v.detach(), [slopes.detach()], None, *flex_s
    )

    def state(grad=False):
        m_side = torch.randn(1, 4, 5, generator=g).requires_grad_(grad)
        l_side = (1 + torch.rand(1, 4, 5, generator=g)).requires_grad_(grad)
        return t(1, 4, 5, 4, grad=grad), m_side, l_side

    states = (*state(grad=True), *state(grad=True))
    sd = tuple(a.detach() for a in states)
    mo, mm, ml = ops.merge_attention_states(*sd, None)
    dml = (torch.randn(1, 4, 5, generator=g), torch.randn(1, 4, 5, generator=g))
    d = {"x": x.detach(), "w": w.detach(), "b": b.detach()}
    # RoPE: tables of 6 positions x 3 pairs (cos, sin), position ids of (B, S) = (1, 5)
    tables = (t(6, 3), t(6, 3))
    ids, q3, do8 = torch.tensor([[5, 0, 2, 2, 1]]), t(1, 2, 5, 8), t(1, 4, 5, 8)
    qkv = (q.detach(), k.detach(), v.detach())
    # Cross-entropy of 3 rows of 8 logits, the second ignored: ignore_index, label_smoothing,
    # softcap, reduction, z_loss, backend
    targets, ce = torch.tensor([5, -100, 2]), (-100, 0.1, 4.0, "mean", 1e-3, None)
    _, lse = ops.cross_entropy(d["x"], targets, *ce)
    ce_none = (*ce[:3], "none", *ce[4:])
    # Linear cross-entropy: x (3, 8) through a (6, 8) weight and a bias to 6 classes
    head, bias = t(6, 8, grad=True), t(6, grad=True)
    _, head_lse = ops.linear_cross_entropy(d["x"], head.detach(), targets, bias.detach(), *ce)
    lin = (d["x"], head.detach(), targets, bias.detach())
    cases = [
        ("linear_cross_entropy", ops.linear_cross_entropy, (x, head, targets, bias, *ce)),
        ("linear_cross_entropy_", ops.linear_cross_entropy_, (t(3), *lin, None, *ce_none)),
        (
            "linear_cross_entropy_backward",
            ops.linear_cross_entropy_backward,
            (t(1).reshape(()), *lin, head_lse, *ce[:5], True, None),
        ),
        (
            "linear_cross_entropy_backward_",
            ops.linear_cross_entropy_backward_,
            (t(3), *lin, head_lse, t(3, 8), t(6, 8), t(6), *ce_none),
        ),
        (
            "linear_cross_entropy_fused",
            ops.linear_cross_entropy_fused,
            (x, head, targets, bias, *ce[:5], True, True, True, None),
        ),
        ("cross_entropy", ops.cross_entropy, (x, targets, *ce)),
        ("cross_entropy_", ops.cross_entropy_, (t(3), d["x"], targets, None, *ce_none)),
        (
            "cross_entropy_backward",
            ops.cross_entropy_backward,
            (t(1).reshape(()), d["x"], targets, lse, *ce),
        ),
        (
            "cross_entropy_backward_",
            ops.cross_entropy_backward_,
            (t(3), d["x"], targets, lse, t(3, 8), *ce_none),
        ),
        ("rms_norm", ops.rms_norm, (x, w, 1e-6, 0.5, None)),
        ("rms_norm_", ops.rms_norm_, (t(3, 8), d["x"], d["w"], f32(3), 1e-6, 0.0, None)),
        ("rms_norm_backward", ops.rms_norm_backward, (dy, d["x"], d["w"], rstd, 0.0, True, None)),
        (
            "rms_norm_backward_",
            ops.rms_norm_backward_,
            (dy, d["x"], d["w"], rstd, t(3, 8), t(8), torch.empty(2, 8, dtype=acc), 0.0, None),
        ),
        ("layer_norm", ops.layer_norm, (x, w, b, 1e-5, None)),
        (
            "layer_norm_",
            ops.layer_norm_,
            (t(3, 8), d["x"], d["w"], d["b"], f32(3), f32(3), 1e-5, None),
        ),
        (
            "layer_norm_backward",
            ops.layer_norm_backward,
            (dy, d["x"], d["w"], d["b"], mean, lrstd, True, True, None),
        ),
        (
            "layer_norm_backward_",
            ops.layer_norm_backward_,
            (dy, d["x"], d["w"], d["b"], mean, lrstd, t(3, 8), t(8), t(8), None, None, None),
        ),
        ("softmax", ops.softmax, (x, None)),
        ("softmax_", ops.softmax_, (t(3, 8), d["x"], None)),
        ("softmax_backward", ops.softmax_backward, (dy, y, None)),
        ("softmax_backward_", ops.softmax_backward_, (dy, y, t(3, 8), None)),
        ("swiglu", ops.swiglu, (x, t(3, 8, grad=True), None)),
        ("swiglu_", ops.swiglu_, (t(3, 8), d["x"], dy, None)),
        ("swiglu_backward", ops.swiglu_backward, (dy, d["x"], y, None)),
        ("swiglu_backward_", ops.swiglu_backward_, (dy, d["x"], y, t(3, 8), t(3, 8), None)),
        ("geglu", ops.geglu, (x, t(3, 8, grad=True), "tanh", None)),
        ("geglu_", ops.geglu_, (t(3, 8), d["x"], dy, "none", None)),
        ("geglu_backward", ops.geglu_backward, (dy, d["x"], y, "none", None)),
        (
            "geglu_backward_",
            ops.geglu_backward_,
            (dy, d["x"], y, t(3, 8), t(3, 8), "tanh", None),
        ),
        ("rope", ops.rope, (q, t(1, 2, 5, 8, grad=True), *tables, None, False, None)),
        (
            "rope_",
            ops.rope_,
            (t(1, 4, 5, 8), t(1, 2, 5, 8), q.detach(), q3, *tables, ids, True, None),
        ),
        ("rope_backward", ops.rope_backward, (do8, t(1, 2, 5, 8), *tables, ids, False, None)),
        (
            "rope_backward_",
            ops.rope_backward_,
            (do8, t(1, 2, 5, 8), *tables, None, t(1, 4, 5, 8), t(1, 2, 5, 8), True, None),
        ),
        ("attention", ops.attention, (q, k, v, *att, *att_s)),
        (
            "attention_",
            ops.attention_,
            (t(1, 4, 5, 4), *qkv, *att, f32(1, 4, 5), f32(1, 4, 5), *att_s),
        ),
        ("attention_backward", ops.attention_backward, (do, *qkv, o, *att, m, l, *att_s)),
        (
            "attention_backward_",
            ops.attention_backward_,
            (
                do,
                *qkv,
                o,
                *att,
                m,
                l,
                t(1, 4, 5, 8),
                t(1, 2, 6, 8),
                t(1, 2, 6, 4),
                None,
                None,
                *att_s,
            ),
        ),
        # No input requires grad: opcheck's AOT test runs a backward, which raises (forward only).
        (
            "decode_attention",
            ops.decode_attention,
            (qd, kc, vc, lengths, None, None, None, None, 3, None),
        ),
        (
            "decode_attention_",
            ops.decode_attention_,
            (t(2, 4, 4), qd, kc, vc, lengths, None, None, None, None, None, None, None, 2, None),
        ),
        ("flex_attention", ops.flex_attention, (q, k, v, [slopes], None, *flex_s)),
        (
            "flex_attention_",
            ops.flex_attention_,
            (t(1, 4, 5, 4), *qkv, [slopes.detach()], None, f32(1, 4, 5), f32(1, 4, 5), *flex_s),
        ),
        (
            "flex_attention_backward",
            ops.flex_attention_backward,
            (do, *qkv, fo, [slopes.detach()], None, fm, fl, *flex_b),
        ),
        (
            "flex_attention_backward_",
            ops.flex_attention_backward_,
            (
                do,
                *qkv,
                fo,
                [slopes.detach()],
                None,
                fm,
                fl,
                t(1, 4, 5, 8),
                t(1, 2, 6, 8),
                t(1, 2, 6, 4),
                [t(4)],
                None,
                None,
                None,
                *flex_b,
            ),
        ),
        ("merge_attention_states", ops.merge_attention_states, (*states, None)),
        (
            "merge_attention_states_",
            ops.merge_attention_states_,
            (t(1, 4, 5, 4), f32(1, 4, 5), f32(1, 4, 5), *sd, None),
        ),
        (
            "merge_attention_states_backward",
            ops.merge_attention_states_backward,
            (do, *dml, mo, mm, ml, *sd, None),
        ),
        (
            "merge_attention_states_backward_",
            ops.merge_attention_states_backward_,
            (
                do,
                *dml,
                mo,
                mm,
                ml,
                *sd,
                t(1, 4, 5, 4),
                f32(1, 4, 5),
                f32(1, 4, 5),
                t(1, 4, 5, 4),
                f32(1, 4, 5),
                f32(1, 4, 5),
                None,
            ),
        ),
    ]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 5], [0, 4, 6]))
    pq, pk, pv = t(5, 4, 8, grad=True), t(6, 2, 8, grad=True), t(6, 2, 4, grad=True)
    packed = (pq.detach(), pk.detach(), pv.detach())
    # max_seqlen_q, max_seqlen_k, causal, scale, input_pos, backend
    vl_s = (3, 4, True, None, 0, None)
    vo, vm, vls = ops.attention_varlen(*packed, cu_q, cu_k, None, *vl_s)
    dvo, vgrads = t(5, 4, 4), (t(5, 4, 8), t(6, 2, 8), t(6, 2, 4), torch.empty(4, 5, dtype=acc))
    cases += [
        ("attention_varlen", ops.attention_varlen, (pq, pk, pv, cu_q, cu_k, None, *vl_s)),
        (
            "attention_varlen_",
            ops.attention_varlen_,
            (t(5, 4, 4), *packed, cu_q, cu_k, None, f32(4, 5), f32(4, 5), *vl_s),
        ),
        (
            "attention_varlen_backward",
            ops.attention_varlen_backward,
            (dvo, *packed, vo, cu_q, cu_k, None, vm, vls, *vl_s),
        ),
        (
            "attention_varlen_backward_",
            ops.attention_varlen_backward_,
            (
                dvo,
                *packed,
                vo,
                cu_q,
                cu_k,
                None,
                vm,
                vls,
                *vgrads,
                torch.empty(5, 4, 8, dtype=acc),
                *vl_s,
            ),
        ),
    ]
    # max_seqlen_q, max_seqlen_k, score_mod, mask_mod, block_sparse, scale, input_pos
    # (backward: then deterministic), backend
    fv = (3, 4, score_key, mask_key, True, None, 0)
    fv_s, fv_b = (*fv, None), (*fv, True, None)
    fvo, fvm, fvl = ops.flex_attention_varlen(*packed, cu_q, cu_k, [slopes.detach()], None, *fv_s)
    cases += [
        (
            "flex_attention_varlen",
            ops.flex_attention_varlen,
            (pq, pk, pv, cu_q, cu_k, [slopes], None, *fv_s),
        ),
        (
            "flex_attention_varlen_",
            ops.flex_attention_varlen_,
            (t(5, 4, 4), *packed, cu_q, cu_k, [slopes.detach()], None, f32(4, 5), f32(4, 5), *fv_s),
        ),
        (
            "flex_attention_varlen_backward",
            ops.flex_attention_varlen_backward,
            (dvo, *packed, fvo, cu_q, cu_k, [slopes.detach()], None, fvm, fvl, *fv_b),
        ),
        (
            "flex_attention_varlen_backward_",
            ops.flex_attention_varlen_backward_,
            (
                dvo,
                *packed,
                fvo,
                cu_q,
                cu_k,
                [slopes.detach()],
                None,
                fvm,
                fvl,
                *vgrads[:3],
                [t(4)],
                None,
                None,
                None,
                *fv_b,
            ),
        ),
    ]
    return cases, mods


#: Ops whose real implementation only raises (decode attention is forward only): tested below.
RAISING = ("decode_attention_backward",)


def test_every_op_has_a_case():
    cases, _ = _cases(torch.float32)
    assert sorted(name for name, _, _ in cases) == sorted(set(xt.OPS) - set(RAISING))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    cases, mods = _cases(dtype)  # mods: keeps the filed flex mods alive
    for name, op, args in cases:
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for xpkernels::{name} ({dtype})") from exc
    assert all(mod is not None for mod in mods)


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def _f64(*shape, generator, grad=True):
    return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=grad)


def test_gradcheck_norms_and_softmax():
    g = torch.Generator().manual_seed(1)
    x, w, b = _f64(3, 2, 7, generator=g), _f64(7, generator=g), _f64(7, generator=g)
    _gradcheck(lambda x, w: xk.rms_norm(x, w, offset=1.0), x, w)
    _gradcheck(lambda x: xk.rms_norm(x, None), x)
    _gradcheck(lambda x, w, b: xk.layer_norm(x, w, b), x, w, b)
    _gradcheck(lambda x, b: xk.layer_norm(x, None, b), x, b)
    _gradcheck(xk.softmax, x)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_rope(interleaved):
    """RoPE through the ops' autograd, with position ids; the tables get no gradient."""
    g = torch.Generator().manual_seed(3)
    q, k = _f64(2, 3, 4, 8, generator=g), _f64(2, 1, 4, 8, generator=g)
    cos, sin = _f64(6, 3, generator=g, grad=False), _f64(6, 3, generator=g, grad=False)
    ids = torch.tensor([[0, 5, 2, 2], [1, 1, 4, 3]])
    _gradcheck(lambda q, k: xk.rope(q, k, cos, sin, ids, interleaved=interleaved), q, k)


def test_rope_refuses_tables_that_require_grad():
    """The tables get no gradient: a table requiring grad is refused, not silently dropped."""
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    cos, sin = torch.randn(3, 2, requires_grad=True), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"rope: cos requires grad, but a RoPE table gets no"):
        xk.rope(q.requires_grad_(), k, cos, sin)
    with torch.no_grad():
        xk.rope(q, k, cos, sin)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_cross_entropy(reduction):
    """Cross-entropy through the ops' autograd with every option, an ignored row included."""
    g = torch.Generator().manual_seed(4)
    logits = _f64(4, 9, generator=g)
    targets = torch.tensor([3, 8, -1, 0])
    options = {"ignore_index": -1, "label_smoothing": 0.2, "softcap": 3.0, "z_loss": 0.01}
    _gradcheck(lambda x: xk.cross_entropy(x, targets, reduction=reduction, **options), logits)


def test_reduced_linear_cross_entropy_forms_its_gradients_in_the_forward():
    """A reduced loss runs the fused op (three products; the backward scales the gradients
    it saved), reduction="none" the generated one; both give PyTorch's gradients."""
    g = torch.Generator().manual_seed(6)
    x, weight = _f64(6, 4, generator=g), _f64(9, 4, generator=g)
    targets = torch.tensor([3, 8, -100, 0, 1, 2])
    for reduction, op in (("mean", "linear_cross_entropy_fused"), ("none", "linear_cross_entropy")):
        loss = xk.linear_cross_entropy(x, weight, targets, reduction=reduction)
        assert type(loss.grad_fn).__name__.startswith(f"GeneratedBackwardFor_xpkernels_{op}_")
        want = torch.nn.functional.cross_entropy(x @ weight.T, targets, reduction=reduction)
        got_grads = torch.autograd.grad(2.5 * loss.sum(), (x, weight))
        want_grads = torch.autograd.grad(2.5 * want.sum(), (x, weight))
        for got, exact in zip(got_grads, want_grads):
            assert torch.allclose(got, exact, rtol=1e-12, atol=1e-14)
    frozen = weight.detach()
    (dx,) = torch.autograd.grad(xk.linear_cross_entropy(x, frozen, targets), (x,))
    assert dx.shape == x.shape


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_linear_cross_entropy(bias):
    """Linear cross-entropy through the ops' autograd: x, the weight and the bias."""
    g = torch.Generator().manual_seed(5)
    x, weight, b = _f64(5, 4, generator=g), _f64(7, 4, generator=g), _f64(7, generator=g)
    targets = torch.tensor([3, 6, -100, 0, 1])
    options = {"label_smoothing": 0.1, "softcap": 3.0, "z_loss": 0.01}
    if bias:
        _gradcheck(
            lambda *a: xk.linear_cross_entropy(*a[:2], targets, a[2], **options), x, weight, b
        )
    else:
        _gradcheck(lambda *a: xk.linear_cross_entropy(*a, targets, **options), x, weight)


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_gradcheck_gated_activations(approximate):
    """SwiGLU (``approximate`` None) and GeGLU's two forms, through the ops' autograd."""
    g = torch.Generator().manual_seed(2)
    a, b = _f64(3, 2, 7, generator=g), _f64(3, 2, 7, generator=g)
    if approximate is None:
        _gradcheck(xk.swiglu, a, b)
    else:
        _gradcheck(lambda a, b: xk.geglu(a, b, approximate=approximate), a, b)


def test_gradcheck_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        _f64(2, 4, 3, 5, generator=g),
        _f64(2, 2, 6, 5, generator=g),
        _f64(2, 2, 6, 3, generator=g),
    )
    _gradcheck(lambda q, k, v: xk.attention(q, k, v), q, k, v)
    lengths = torch.tensor([6, 2])
    _gradcheck(
        lambda q, k, v: xk.attention(
            q, k, v, causal=True, input_pos=3, k_lengths=lengths, scale=0.7
        ),
        q,
        k,
        v,
    )


def _relative(score, b, h, q_idx, kv_idx, *, table):
    return score + table[h, minimum(q_idx - kv_idx + 7, 14)]


@pytest.mark.parametrize(
    "kind",
    ["alibi", "bias", "relative_table", "pair_feature"],
)
def test_gradcheck_flex_learnable_score_mods(kind):
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        _f64(1, 2, 4, 3, generator=g),
        _f64(1, 1, 5, 3, generator=g),
        _f64(1, 1, 5, 2, generator=g),
    )
    if kind == "alibi":
        params = (torch.rand(2, generator=g, dtype=torch.float64, requires_grad=True),)

        def make(p):
            return AliBiScore(p)
    elif kind == "bias":
        params = (_f64(1, 2, 4, 5, generator=g),)

        def make(p):
            return BiasScore(p)
    elif kind == "relative_table":
        params = (_f64(2, 15, generator=g),)

        def make(p):
            return ScoreMod(_relative, table=p)
    else:
        params = (_f64(1, 4, 2, generator=g), _f64(1, 5, 2, generator=g), _f64(2, 2, generator=g))

        def pairs(qv, kv):
            return [qv[0] * kv[0], abs(qv[1] - kv[1])]

        def make(qf, kf, proj):
            return PairFeatureScore(pairs, qf, kf, proj)

    mask = SlidingWindowMask(2)
    _gradcheck(
        lambda q, k, v, *p: xk.flex_attention(q, k, v, score_mod=make(*p), mask_mod=mask),
        q,
        k,
        v,
        *params,
    )


def test_flex_parameter_gets_its_grad_and_matches_the_materialised_reference():
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        _f64(1, 2, 4, 3, generator=g),
        _f64(1, 2, 4, 3, generator=g),
        _f64(1, 2, 4, 3, generator=g),
    )
    table = torch.nn.Parameter(torch.randn(2, 15, generator=g, dtype=torch.float64))
    out = xk.flex_attention(
        q, k, v, score_mod=ScoreMod(_relative, table=table), mask_mod=CausalMask()
    )
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * cot).sum().backward()
    got = table.grad.clone()

    ref_table = table.detach().clone().requires_grad_()
    i = torch.arange(4)[:, None]
    j = torch.arange(4)[None, :]
    s = q.detach() @ k.detach().transpose(-1, -2) / 3**0.5
    s = s + ref_table[torch.arange(2)[:, None, None], torch.clamp(i - j + 7, max=14)][None]
    s = s.masked_fill(j > i, float("-inf"))
    ref = torch.softmax(s, dim=-1) @ v.detach()
    (ref * cot).sum().backward()
    torch.testing.assert_close(got, ref_table.grad, rtol=1e-6, atol=1e-6)


def _f32(*shape, generator):
    return torch.randn(*shape, generator=generator).requires_grad_()


def _norm_and_attention(g):
    """``(name, fn, inputs)``: rms_norm and attention calls on float32 inputs that require grad."""
    x, w = _f32(4, 8, generator=g), _f32(8, generator=g)
    q, k, v = (
        _f32(1, 2, 5, 8, generator=g),
        _f32(1, 2, 5, 8, generator=g),
        _f32(1, 2, 5, 8, generator=g),
    )
    return [
        ("rms_norm", xk.rms_norm, (x, w)),
        ("attention", lambda q, k, v: xk.attention(q, k, v, causal=True), (q, k, v)),
    ]


def test_non_reentrant_checkpointing_unpacks_each_saved_tensor_once():
    """torch.utils.checkpoint(use_reentrant=False) allows one unpack per saved tensor: the
    backward reads them once and gives the gradients of the call without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    for name, fn, inputs in _norm_and_attention(torch.Generator().manual_seed(7)):
        want = torch.autograd.grad(fn(*inputs).square().sum(), inputs)
        out = checkpoint(fn, *inputs, use_reentrant=False)
        got = torch.autograd.grad(out.square().sum(), inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, msg=name)
        counts = {"pack": 0, "unpack": 0}

        def pack(t):
            counts["pack"] += 1
            return t

        def unpack(t):
            counts["unpack"] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = fn(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
        assert counts["pack"] > 0 and counts["unpack"] == counts["pack"], (name, counts)


def test_autocast_leaves_the_float32_arithmetic_of_a_recorded_call_alone():
    """Under CPU autocast, a recorded call on float32 inputs (and its gradients) is what it is
    outside autocast: the backend's own torch arithmetic is not rounded to bfloat16."""
    g = torch.Generator().manual_seed(8)
    x, weight = _f32(6, 8, generator=g), _f32(9, 8, generator=g)
    targets = torch.tensor([3, 8, -100, 0, 1, 2])
    cases = [
        *_norm_and_attention(g),
        ("softmax", xk.softmax, (x,)),
        ("linear_cross_entropy", lambda x, w: xk.linear_cross_entropy(x, w, targets), (x, weight)),
    ]
    for name, fn, inputs in cases:
        out = fn(*inputs)
        want = [out, *torch.autograd.grad(out.square().sum(), inputs)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*inputs)
            got = [out, *torch.autograd.grad(out.square().sum(), inputs)]
        for a, b in zip(got, want):
            assert a.dtype == torch.float32, name
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_a_transposed_input_that_requires_grad_is_named_in_the_error():
    """The recorded call allocates contiguous outputs, so the error names the caller's input
    (as without requires_grad), not an output the caller never passed."""
    x = torch.randn(8, 3).t()
    w = torch.ones(8)
    for requires_grad in (False, True):
        with pytest.raises(ValueError, match=r"rms_norm_: x must be contiguous along its last"):
            xk.rms_norm(x.detach().requires_grad_(requires_grad), w)
        with pytest.raises(ValueError, match=r"softmax_: x must be contiguous along its last"):
            xk.softmax(x.detach().requires_grad_(requires_grad))


def test_decode_attention_is_forward_only():
    g = torch.Generator().manual_seed(5)
    q = _f64(2, 2, 4, generator=g)
    kc, vc = _f64(2, 1, 6, 4, generator=g, grad=False), _f64(2, 1, 6, 3, generator=g, grad=False)
    lengths = torch.tensor([6, 3])
    o = xk.decode_attention(q, kc, vc, lengths)
    with torch.no_grad():
        want = xk.decode_attention(q, kc, vc, lengths)
    torch.testing.assert_close(o.detach(), want)
    assert o.requires_grad
    with pytest.raises(RuntimeError, match="decode_attention has no backward"):
        o.sum().backward()
    with pytest.raises(RuntimeError, match="decode_attention has no backward"):
        ops.decode_attention_backward(o.detach(), q.detach(), kc, vc)


def test_xpkernels_torch_imports_torch_and_xpkernels_alone_does_not():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, xpkernels as xk\n"
        "x = np.ones((2, 4), np.float32)\n"
        "xk.rms_norm(x, np.ones(4, np.float32)); xk.rms_norm_(np.empty_like(x), x, None)\n"
        "assert 'torch' not in sys.modules, 'numpy calls imported torch'\n"
        "import xpkernels.torch as xt\n"
        "assert 'torch' in sys.modules and xt.ops.rms_norm is not None\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_package_list_ships_xpkernels_torch():
    import pathlib

    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert '"xpkernels.torch",' in pyproject.read_text()  # [tool.setuptools] packages
