"""merge_attention_states: attention over A union B from attention over A and over B.

The conformance suite checks the merge against its float64 formula on every
target; these tests pin what users rely on it for: that it IS attention over
the union of two disjoint key sets (o, m and l), that the per-part attention
backward with the merged state gives the union's gradients (the identity ring
attention builds on), that empty states merge without NaN, which aliasing is
allowed, that nothing is written on bad input, and the torch autograd wiring.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.attention import AttentionCheckpoints
from xpkernels.buffers import Duplicated
from xpkernels.testing import harness
from xpkernels.testing import references as ref

harness.select_triton_interpreter()  # before any Triton kernel is defined

#: Float32 results against float64 references: a few units in the last place of float32,
#: summed over the keys and head dims of these small shapes.
_TOL32 = 2e-5


def _rel(actual, expected) -> float:
    """Largest difference, relative to the largest magnitude (>= 1); matching infinities are equal."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(actual - expected))
    finite = np.isfinite(expected)
    return float(np.max(diff, initial=0.0)) / max(
        float(np.max(np.abs(expected[finite]), initial=0)), 1.0
    )


def _on_triton(arrays):
    """``arrays`` as torch tensors where the triton backend runs them (CUDA, else the
    interpreter); skips with the reason when it cannot run here."""
    torch = pytest.importorskip("torch", reason="the triton backend runs on torch tensors")
    pytest.importorskip("triton", reason="triton is not installed")
    from xpkernels.backends.triton import device_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = device_problem(device)
    if problem:
        pytest.skip(f"triton: {problem}")
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def _host(a) -> np.ndarray:
    """``a`` (NumPy array or torch tensor, any device) as a NumPy array."""
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def _split_options(options, split, sk):
    """The attention options of the parts ``keys[:split]`` and ``keys[split:]`` of ``options``."""
    k_lengths = options.get("k_lengths")
    input_pos = options.get("input_pos", 0)
    first = {**options}
    second = {**options, "input_pos": input_pos - split}  # key j of part B sits at split + j
    if k_lengths is not None:
        first["k_lengths"] = np.minimum(k_lengths, split).astype(k_lengths.dtype)
        second["k_lengths"] = np.clip(k_lengths - split, 0, sk - split).astype(k_lengths.dtype)
    return first, second


def _attention_state(q, k, v, **options):
    o = np.full((*q.shape[:3], v.shape[3]), np.nan, dtype=q.dtype)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, checkpoints=ck, **options)
    return o, ck


#: (causal, heads, kv_heads, k_lengths, q_lengths, input_pos): k_lengths <= split leave part B
#: empty for every row of that batch; causal rows before the split see part A only;
#: q_lengths empties some rows on both sides; a negative input_pos empties early rows entirely.
_LAYOUTS = [
    pytest.param(False, 2, 2, None, None, 0, id="full-mha"),
    pytest.param(True, 4, 2, None, None, 3, id="causal-gqa"),
    pytest.param(False, 4, 1, (5, 11), None, 0, id="lengths-one-side-empty-mqa"),
    pytest.param(True, 6, 3, (13, 4), (7, 2), 2, id="causal-lengths-gqa"),
    pytest.param(True, 2, 2, None, None, -3, id="causal-both-sides-empty"),
]


def _problem(causal, heads, kv_heads, k_lengths, q_lengths, input_pos, seed=0):
    rng = np.random.default_rng(seed)
    batch, sq, sk, d, dv = 2, 7, 13, 8, 6
    q = rng.standard_normal((batch, heads, sq, d)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, sk, d)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, sk, dv)).astype(np.float32)
    do = rng.standard_normal((batch, heads, sq, dv)).astype(np.float32)
    options = {"causal": causal, "input_pos": input_pos}
    if k_lengths is not None:
        options["k_lengths"] = np.asarray(k_lengths, dtype=np.int32)
    if q_lengths is not None:
        options["q_lengths"] = np.asarray(q_lengths, dtype=np.int32)
    return q, k, v, do, options


def _merged(q, k, v, options, split, backend=None):
    """``(o, ck, parts)``: attention over keys[:split] and keys[split:], merged into ``ck``."""
    sk = k.shape[2]
    first, second = _split_options(options, split, sk)
    o_a, ck_a = _attention_state(q, k[:, :, :split], v[:, :, :split], **first)
    o_b, ck_b = _attention_state(q, k[:, :, split:], v[:, :, split:], **second)
    o = np.full_like(o_a, np.nan)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.merge_attention_states_(
        o, ck.m, ck.l, o_a, ck_a.m, ck_a.l, o_b, ck_b.m, ck_b.l, checkpoints=ck, backend=backend
    )
    parts = [(slice(0, split), first), (slice(split, sk), second)]
    return o, ck, parts


@pytest.mark.parametrize(
    ("causal", "heads", "kv_heads", "k_lengths", "q_lengths", "input_pos"), _LAYOUTS
)
def test_merge_is_attention_over_the_union_forward(
    causal, heads, kv_heads, k_lengths, q_lengths, input_pos
):
    q, k, v, _, options = _problem(causal, heads, kv_heads, k_lengths, q_lengths, input_pos)
    o_union, ck_union = _attention_state(q, k, v, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no -inf - -inf, no 0 / 0 on empty rows
        o, ck, _ = _merged(q, k, v, options, split=5)
    assert not np.isnan(o).any() and not np.isnan(ck.m).any() and not np.isnan(ck.l).any()
    assert _rel(o, o_union) <= _TOL32
    assert _rel(ck.l, ck_union.l) <= _TOL32
    assert _rel(ck.m, ck_union.m) <= _TOL32  # a max of maxes (scores rounded per matmul)
    empty = ck_union.l == 0
    np.testing.assert_array_equal(ck.l[empty], 0.0)
    np.testing.assert_array_equal(o[empty], 0.0)


@pytest.mark.parametrize(
    ("causal", "heads", "kv_heads", "k_lengths", "q_lengths", "input_pos"), _LAYOUTS
)
def test_per_part_backward_with_the_merged_state_is_the_union_backward(
    causal, heads, kv_heads, k_lengths, q_lengths, input_pos
):
    q, k, v, do, options = _problem(causal, heads, kv_heads, k_lengths, q_lengths, input_pos)
    o, ck, parts = _merged(q, k, v, options, split=5)
    dq = np.zeros_like(q)
    dk, dv = np.full_like(k, np.nan), np.full_like(v, np.nan)
    for keys, part_options in parts:
        Q = Duplicated(q, np.full_like(q, np.nan))
        K = Duplicated(k[:, :, keys], np.full_like(k[:, :, keys], np.nan))
        V = Duplicated(v[:, :, keys], np.full_like(v[:, :, keys], np.nan))
        xk.attention_backward_(Duplicated(o, do), Q, K, V, checkpoints=ck, **part_options)
        dq += Q.shadow
        dk[:, :, keys], dv[:, :, keys] = K.shadow, V.shadow
    keep = ref.attention_keep(
        q.shape[0],
        q.shape[2],
        k.shape[2],
        causal=causal,
        input_pos=input_pos,
        q_lengths=options.get("q_lengths"),
        k_lengths=options.get("k_lengths"),
    )
    scale = 1 / math.sqrt(q.shape[3])
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    want = ref.attention_backward(*f64[:3], f64[3], scale=scale, keep=keep)
    o_union, ck_union = _attention_state(q, k, v, **options)
    union = xk.attention_backward(do, q, k, v, o_union, checkpoints=ck_union, **options)
    for got, expected, from_union in zip((dq, dk, dv), want, union):
        assert _rel(got, expected) <= 1e-4  # attention's float32 backward floor
        assert _rel(got, from_union) <= 1e-4


def test_merged_checkpoints_need_checkpoints_to_feed_the_backward():
    q, k, v, do, options = _problem(True, 2, 2, None, None, 3)
    o, ck, parts = _merged(q, k, v, options, split=5)
    keys, part_options = parts[1]
    hand_built = AttentionCheckpoints(m=ck.m, l=ck.l)  # the same arrays, no forward record
    D = [Duplicated(a, np.empty_like(a)) for a in (q, k[:, :, keys], v[:, :, keys])]
    with pytest.raises(ValueError, match="checkpoints were never written by a forward"):
        xk.attention_backward_(Duplicated(o, do), *D, checkpoints=hand_built, **part_options)
    o_a, ck_a = _attention_state(q, k, v, **options)
    other = xk.allocate_checkpoints(xk.attention_, q, k, v)
    with pytest.raises(ValueError, match="checkpoints.m and checkpoints.l must be the very arrays"):
        xk.merge_attention_states_(
            o, ck.m, ck.l, o_a, ck_a.m, ck_a.l, o_a, ck_a.m, ck_a.l, checkpoints=other
        )
    with pytest.raises(TypeError, match="checkpoints must be an AttentionCheckpoints"):
        xk.merge_attention_states_(
            o, ck.m, ck.l, o_a, ck_a.m, ck_a.l, o_a, ck_a.m, ck_a.l, checkpoints=(ck.m, ck.l)
        )


def _states(seed=0, shape=(2, 3, 4, 5), empty_a=(), empty_b=()):
    rng = np.random.default_rng(seed)
    out = []
    for empty in (empty_a, empty_b):
        o = rng.standard_normal(shape).astype(np.float32)
        m = (rng.standard_normal(shape[:3]) * 2).astype(np.float32)
        lse_sum = (1 + rng.random(shape[:3]) * 10).astype(np.float32)
        for row in empty:
            o[row], m[row], lse_sum[row] = np.nan, -np.inf, 0.0  # an empty side's o is never read
        out += [o, m, lse_sum]
    return out


@pytest.mark.parametrize("backend", ["array_api", "triton"])
def test_empty_states_merge_without_nan(backend):
    both, only_a, only_b = (0, 0, 0), (0, 1, 2), (1, 2, 3)
    states = _states(empty_a=(both, only_a), empty_b=(both, only_b))
    if backend == "triton":
        states = _on_triton(states)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, m, lse_sum = (_host(a) for a in xk.merge_attention_states(*states, backend=backend))
    assert not np.isnan(o).any() and not np.isnan(m).any() and not np.isnan(lse_sum).any()
    assert m[both] == -np.inf and lse_sum[both] == 0 and (o[both] == 0).all()
    o_a, m_a, l_a, o_b, m_b, l_b = (_host(a) for a in states)
    np.testing.assert_array_equal(o[only_a], o_b[only_a])  # w_b = 1 exactly
    assert (m[only_a], lse_sum[only_a]) == (m_b[only_a], l_b[only_a])
    np.testing.assert_array_equal(o[only_b], o_a[only_b])
    # Backward: zero gradients to an empty side, none NaN.
    do = np.ones_like(o)
    args = [do, o, m, lse_sum]
    if backend == "triton":
        args = _on_triton(args)
    grads = xk.merge_attention_states_backward(*args, *states, backend=backend)
    do_a, do_b, dlse_a, dlse_b = (_host(g) for g in grads)
    for g in (do_a, do_b, dlse_a, dlse_b):
        assert not np.isnan(g).any()
    assert (do_a[both] == 0).all() and (do_b[both] == 0).all() and dlse_a[only_a] == 0
    np.testing.assert_array_equal(do_b[only_a], do[only_a])
    assert dlse_b[only_a] == 0  # w_b = 1, o = o_b: rowsum(do * (o_b - o)) = 0


@pytest.mark.parametrize("side", ["a", "b"])
def test_output_may_be_a_side_itself(side):
    states = _states(seed=1)
    want = xk.merge_attention_states(*states)
    inplace = [a.copy() for a in states]
    o, m, lse_sum = inplace[:3] if side == "a" else inplace[3:]
    xk.merge_attention_states_(o, m, lse_sum, *inplace)
    for got, expected in zip((o, m, lse_sum), want):
        np.testing.assert_array_equal(got, expected)


def test_partial_overlap_and_other_aliasing_are_refused():
    o_a, m_a, l_a, o_b, m_b, l_b = _states(seed=2)
    big = np.zeros((2, 3, 5, 5), dtype=np.float32)
    big[:, :, 1:] = o_a
    shifted = big[:, :, 1:]  # o_a's values, in memory overlapping big[:, :, :4]
    with pytest.raises(ValueError, match=r"o shares memory with o_a;.*not overlap it partly"):
        xk.merge_attention_states_(
            big[:, :, :4], m_a.copy(), l_a.copy(), shifted, m_a, l_a, o_b, m_b, l_b
        )
    with pytest.raises(ValueError, match="m shares memory with l_a"):
        xk.merge_attention_states_(
            np.empty_like(o_a), l_a, np.empty_like(l_a), o_a, m_a, l_a, o_b, m_b, l_b
        )


def test_backward_shadow_may_be_do_itself():
    states = _states(seed=3)
    o, m, lse_sum = xk.merge_attention_states(*states)
    rng = np.random.default_rng(0)
    do, dlse = (
        rng.standard_normal(o.shape).astype(np.float32),
        rng.standard_normal(m.shape).astype(np.float32),
    )
    want = xk.merge_attention_states_backward(do, o, m, lse_sum, *states, dlse=dlse)
    do_alias, dlse_alias = do.copy(), dlse.copy()
    o_a, m_a, l_a, o_b, m_b, l_b = states
    O_a = Duplicated(o_a, do_alias)
    O_b = Duplicated(o_b, np.full_like(o_b, np.nan))
    dlse_b = np.full_like(dlse, np.nan)
    xk.merge_attention_states_backward_(
        Duplicated(o, do_alias),
        m,
        lse_sum,
        O_a,
        m_a,
        l_a,
        O_b,
        m_b,
        l_b,
        dlse_a=dlse_alias,
        dlse_b=dlse_b,
        dlse=dlse_alias,
    )
    for got, expected in zip((O_a.shadow, O_b.shadow, dlse_alias, dlse_b), want):
        np.testing.assert_array_equal(got, expected)


def test_backward_matches_the_reference_with_and_without_dlse():
    states = _states(seed=4, empty_a=((0, 0, 1),), empty_b=((1, 2, 3),))
    o, m, lse_sum = xk.merge_attention_states(*states)
    rng = np.random.default_rng(1)
    do, dlse = rng.standard_normal(o.shape), rng.standard_normal(m.shape)
    f64 = [np.where(np.isnan(a), 0.0, a).astype(np.float64) for a in states]
    for given in (None, dlse):
        got = xk.merge_attention_states_backward(
            do.astype(np.float32),
            o,
            m,
            lse_sum,
            *states,
            dlse=None if given is None else given.astype(np.float32),
        )
        want = ref.merge_attention_states_backward(*f64, do, 0.0 if given is None else given)
        for g, w in zip(got, want):
            assert _rel(g, w) <= _TOL32


def test_nothing_is_written_on_bad_input():
    o_a, m_a, l_a, o_b, m_b, l_b = _states(seed=5)
    o, m, lse_sum = (np.full_like(a, np.nan) for a in (o_a, m_a, l_a))
    with pytest.raises(ValueError, match=r"m_b must have shape \(2, 3, 4\)"):
        xk.merge_attention_states_(o, m, lse_sum, o_a, m_a, l_a, o_b, m_b[:, :, :3], l_b)
    with pytest.raises(TypeError, match="l_b must be float32"):
        xk.merge_attention_states_(o, m, lse_sum, o_a, m_a, l_a, o_b, m_b, l_b.astype(np.float16))
    read_only = np.full_like(m_a, np.nan)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="m is read-only"):
        xk.merge_attention_states_(o, read_only, lse_sum, o_a, m_a, l_a, o_b, m_b, l_b)
    assert np.isnan(o).all() and np.isnan(m).all() and np.isnan(lse_sum).all()
    do_a = np.full_like(o_a, np.nan)
    with pytest.raises(ValueError, match=r"dlse must have shape \(2, 3, 4\)"):
        xk.merge_attention_states_backward_(
            Duplicated(o_a, o_a),
            m_a,
            l_a,
            Duplicated(o_a, do_a),
            m_a,
            l_a,
            Duplicated(o_b, np.empty_like(o_b)),
            m_b,
            l_b,
            dlse_a=np.empty_like(m_a),
            dlse_b=np.empty_like(m_a),
            dlse=m_a[:, :, :2],
        )
    assert np.isnan(do_a).all()


def test_float64_states_need_float64_outputs():
    states = [a.astype(np.float64) for a in _states(seed=6)]
    o, m, lse_sum = xk.merge_attention_states(*states)
    assert o.dtype == m.dtype == lse_sum.dtype == np.float64
    want = ref.merge_attention_states(*states)
    for got, expected in zip((o, m, lse_sum), want):
        assert _rel(got, expected) <= 1e-12
    with pytest.raises(TypeError, match=r"m_a must be float32 \(or float64 with float64 o\)"):
        xk.merge_attention_states(states[0], states[1].astype(np.float16), *states[2:])
    f32 = [a.astype(np.float32) for a in states]
    with pytest.raises(TypeError, match="m_a must be float32, got float64"):
        xk.merge_attention_states(f32[0], states[1], *f32[2:])


# --------------------------------------------------------------------------- torch


def test_gradcheck_float64_through_a_chain_of_merges():
    """Autograd of ``merge(merge(a, b), c)`` -- all of o, m, l used -- against finite differences."""
    torch = pytest.importorskip("torch", reason="torch autograd needs torch")
    rng = np.random.default_rng(7)
    shape = (1, 2, 3, 4)
    leaves = []
    for _ in range(3):
        leaves += [
            torch.tensor(rng.standard_normal(shape), requires_grad=True),
            torch.tensor(rng.standard_normal(shape[:3]) * 2, requires_grad=True),
            torch.tensor(1 + rng.random(shape[:3]) * 5, requires_grad=True),
        ]

    def chain(*arrays):
        ab = xk.merge_attention_states(*arrays[:6])
        o, m, lse_sum = xk.merge_attention_states(*ab, *arrays[6:])
        return o, m, lse_sum

    assert torch.autograd.gradcheck(chain, leaves)
    assert torch.autograd.gradcheck(lambda *a: xk.merge_attention_states(*a), leaves[:6])


def test_torch_autograd_triton_matches_array_api():
    states = _states(seed=8, empty_a=((0, 0, 0),))
    states[0][0, 0, 0] = 0.0
    tensors = _on_triton(states)
    import torch

    results = []
    for backend in ("array_api", "triton"):
        leaves = [t.clone().requires_grad_() for t in tensors]
        o, m, lse_sum = xk.merge_attention_states(*leaves, backend=backend)
        loss = (
            (o * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum()
            + torch.where(m.isfinite(), m, 0).sum()
            + lse_sum.sum()
        )
        loss.backward()
        results.append([t.grad for t in leaves])
    for a, b in zip(*results):
        assert not torch.isnan(b).any()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_inplace_front_refuses_tensors_that_require_grad():
    torch = pytest.importorskip("torch", reason="autograd needs torch")
    states = [torch.from_numpy(a) for a in _states(seed=9)]
    states[1].requires_grad_()
    outs = [torch.empty_like(states[i]) for i in range(3)]
    with pytest.raises(ValueError, match="m_a requires grad"):
        xk.merge_attention_states_(*outs, *states)


def test_triton_union_identity_through_the_interpreter():
    q, k, v, _, options = _problem(True, 4, 2, (13, 4), (7, 2), 2, seed=3)
    o_union, ck_union = _attention_state(q, k, v, **options)
    first, second = _split_options(options, 5, k.shape[2])
    o_a, ck_a = _attention_state(q, k[:, :, :5], v[:, :, :5], **first)
    o_b, ck_b = _attention_state(q, k[:, :, 5:], v[:, :, 5:], **second)
    # A BSHD buffer viewed as BHSD for o: strides other than the last are free.
    states = _on_triton([o_a, ck_a.m, ck_a.l, o_b, ck_b.m, ck_b.l])
    fresh = [np.full(shape, np.nan, np.float32) for shape in ((2, 7, 4, 6), (2, 4, 7), (2, 4, 7))]
    o_bshd, m, lse_sum = _on_triton(fresh)
    o = o_bshd.permute(0, 2, 1, 3)
    xk.merge_attention_states_(o, m, lse_sum, *states, backend="triton")
    assert _rel(_host(o), o_union) <= _TOL32
    assert _rel(_host(lse_sum), ck_union.l) <= _TOL32
    assert _rel(_host(m), ck_union.m) <= _TOL32


def _torch_leaves(seed):
    torch = pytest.importorskip("torch", reason="torch autograd needs torch")
    return [torch.tensor(a, requires_grad=True) for a in _states(seed=seed)]


def _loss(o, m, lse_sum):
    return (o * o).sum() + m.sum() + lse_sum.sum()


def test_double_backward_is_refused():
    leaves = _torch_leaves(10)
    import torch

    grads = torch.autograd.grad(
        _loss(*xk.merge_attention_states(*leaves)), leaves, create_graph=True
    )
    with pytest.raises(RuntimeError, match=r"xpkernels\.merge_attention_states: double backward"):
        sum(g.sum() for g in grads).backward()


def test_compile_fullgraph_matches_eager():
    """``torch.compile(fullgraph=True)`` traces through the op (register_fake) and its autograd."""
    leaves = _torch_leaves(11)
    import torch

    compiled = torch.compile(lambda *a: _loss(*xk.merge_attention_states(*a)), fullgraph=True)
    compiled(*leaves).backward()
    eager = [t.detach().clone().requires_grad_() for t in leaves]
    _loss(*xk.merge_attention_states(*eager)).backward()
    for got, want in zip(leaves, eager):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_cpu_tensors_take_the_numpy_path(dtype):
    """PyTorch CPU tensors run on NumPy through zero-copy views: the same merged state and
    gradients, bit for bit, as NumPy arrays (empty rows on either side, with and without dlse)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    states = [a.astype(dtype) for a in _states(seed=6, empty_a=((0, 0, 1),), empty_b=((1, 2, 3),))]
    rng = np.random.default_rng(7)
    do = rng.standard_normal(states[0].shape).astype(dtype)
    dlse = rng.standard_normal(states[1].shape).astype(dtype)

    def run(convert):
        held = [convert(a) for a in states]
        merged = xk.merge_attention_states(*held)
        grads = xk.merge_attention_states_backward(convert(do), *merged, *held, dlse=convert(dlse))
        return [a if isinstance(a, np.ndarray) else a.numpy() for a in (*merged, *grads)]

    want = run(np.copy)
    got = run(lambda a: torch.from_numpy(a.copy()))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
