"""attention_varlen: packed variable-length attention is attention of each sequence alone.

Every backend's outputs, checkpoints and gradients over a packed batch must
equal running each sequence by itself through :func:`xpkernels.attention`
(float64, array_api): zero-length query or key sequences, one-token
sequences, causal with ``Sq != Sk`` per sequence (top-left ``input_pos=0``
and bottom-right ``input_pos = Sk - Sq``), GQA. Bad prefix sums raise naming
the argument and write nothing; the torch ops record autograd, pass
gradcheck and trace under ``torch.compile(fullgraph=True)``; the Triton path
reads no prefix sum on the host when ``max_seqlen_*`` are given.
"""

from __future__ import annotations

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import harness
from xpkernels.testing.tolerances import floor

harness.select_triton_interpreter()  # before any Triton kernel is defined

#: Query and key lengths per sequence: an empty query sequence, an empty key
#: sequence, one-token sequences, Sq < Sk and Sq > Sk, and lengths crossing the
#: interpreter's 16-wide tiles.
Q_LENS = (3, 0, 5, 1, 18, 2)
K_LENS = (4, 2, 0, 1, 7, 20)
H, HKV, D, DV = 4, 2, 8, 6


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(rng, q_lens=Q_LENS, k_lens=K_LENS, heads=H, kv_heads=HKV):
    tq, tk = sum(q_lens), sum(k_lens)
    q = rng.standard_normal((tq, heads, D))
    k = rng.standard_normal((tk, kv_heads, D))
    v = rng.standard_normal((tk, kv_heads, DV))
    do = rng.standard_normal((tq, heads, DV))
    return q, k, v, do, _cu(q_lens), _cu(k_lens)


def _positions(kind, q_lens=Q_LENS, k_lens=K_LENS):
    """``input_pos`` of a test: 0 (starts aligned), bottom-right per sequence, or mixed values."""
    if kind == "top_left":
        return 0
    if kind == "bottom_right":
        return np.array([sk - sq for sq, sk in zip(q_lens, k_lens)], dtype=np.int64)
    return np.array([1, 0, -2, 0, 3, 9][: len(q_lens)], dtype=np.int64)


def _per_sequence(q, k, v, do, cq, ck, *, causal, input_pos):
    """Packed ``o, m, l, dq, dk, dv`` from each sequence alone through ``xk.attention`` (float64)."""
    o = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    m = np.full((q.shape[1], q.shape[0]), -np.inf)
    l_sum = np.zeros((q.shape[1], q.shape[0]))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])

        def bhsd(a, s):
            return np.ascontiguousarray(a[s].transpose(1, 0, 2)[None])

        qb, kb, vb, dob = bhsd(q, qs), bhsd(k, ks), bhsd(v, ks), bhsd(do, qs)
        pos = input_pos if isinstance(input_pos, int) else int(input_pos[b])
        ck_b = xk.allocate_checkpoints(xk.attention_, qb, kb, vb)
        ob = xk.attention(qb, kb, vb, causal=causal, input_pos=pos, checkpoints=ck_b)
        grads = xk.attention_backward(
            dob, qb, kb, vb, ob, checkpoints=ck_b, causal=causal, input_pos=pos
        )
        o[qs], m[:, qs], l_sum[:, qs] = ob[0].transpose(1, 0, 2), ck_b.m[0], ck_b.l[0]
        dq[qs] += grads[0][0].transpose(1, 0, 2)
        dk[ks] += grads[1][0].transpose(1, 0, 2)
        dv[ks] += grads[2][0].transpose(1, 0, 2)
    return o, m, l_sum, dq, dk, dv


def _host(a) -> np.ndarray:
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def _err(actual, expected) -> float:
    """Largest difference relative to the largest magnitude (>= 1); equal infinities are equal."""
    a, e = _host(actual).astype(np.float64), np.asarray(expected, dtype=np.float64)
    same = a == e
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(a - e))
    if np.isnan(diff).any():
        return float("inf")
    return float(np.max(diff, initial=0.0)) / max(
        float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)), 1.0
    )


def _torch_target(dtype_name):
    """``(convert, backend)`` for the triton backend (CUDA, else the interpreter); skips if it cannot run."""
    torch = pytest.importorskip("torch", reason="the triton backend runs on torch tensors")
    pytest.importorskip("triton", reason="triton is not installed")
    from xpkernels.backends.triton import device_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = device_problem(device)
    if problem:
        pytest.skip(f"triton: {problem}")
    dtype = getattr(torch, dtype_name)

    def convert(a):
        t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return t.to(dtype) if t.is_floating_point() else t

    return convert


def _nan_like(a):
    return a.clone().fill_(float("nan")) if hasattr(a, "detach") else np.full_like(a, np.nan)


def _run(convert, backend, q, k, v, do, cq, ck, *, causal, input_pos, **options):
    """Forward with checkpoints, then the backward, on ``backend`` into NaN-filled buffers."""
    q, k, v, do, cq, ck = (convert(a) for a in (q, k, v, do, cq, ck))
    if not isinstance(input_pos, int):
        input_pos = convert(input_pos)
    o = _nan_like(do)
    ckpt = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    ckpt = type(ckpt)(*map(_nan_like, ckpt))
    kw = {"causal": causal, "input_pos": input_pos, "backend": backend, **options}
    xk.attention_varlen_(o, q, k, v, cq, ck, checkpoints=ckpt, **kw)
    shadows = [_nan_like(a) for a in (q, k, v)]
    args = (Duplicated(o, do), *map(Duplicated, (q, k, v), shadows))
    xk.attention_varlen_backward_(*args, cq, ck, checkpoints=ckpt, **kw)
    return (o, ckpt.m, ckpt.l, *shadows)


_NAMES = ("o", "m", "l", "dq", "dk", "dv")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("positions", ["top_left", "bottom_right", "mixed"])
def test_array_api_equals_attention_per_sequence(causal, positions):
    rng = np.random.default_rng(11)
    q, k, v, do, cq, ck = _inputs(rng)
    input_pos = _positions(positions)
    expected = _per_sequence(q, k, v, do, cq, ck, causal=causal, input_pos=input_pos)
    got = _run(np.asarray, "array_api", q, k, v, do, cq, ck, causal=causal, input_pos=input_pos)
    for name, a, e in zip(_NAMES, got, expected):
        assert _err(a, e) <= 1e-12, name


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    "causal, positions", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")]
)
def test_triton_equals_attention_per_sequence(dtype, causal, positions):
    convert = _torch_target(dtype)
    rng = np.random.default_rng(12)
    q, k, v, do, cq, ck = _inputs(rng)
    input_pos = _positions(positions)
    # Rounded to the test dtype first: the reference sees exactly the inputs the kernel does.
    rounded = [_host(convert(a)).astype(np.float64) for a in (q, k, v, do)]
    expected = _per_sequence(*rounded, cq, ck, causal=causal, input_pos=input_pos)
    got = _run(convert, "triton", q, k, v, do, cq, ck, causal=causal, input_pos=input_pos)
    for name, a, e in zip(_NAMES, got, expected):
        pass_ = "forward" if name in ("o", "m", "l") else "backward"
        assert _err(a, e) <= floor("attention", pass_, dtype), name


def test_triton_given_max_seqlen_and_an_int_position():
    """``max_seqlen_*`` passed by the caller (larger than needed) give the same result."""
    convert = _torch_target("float32")
    rng = np.random.default_rng(13)
    q, k, v, do, cq, ck = _inputs(rng)
    expected = _per_sequence(q, k, v, do, cq, ck, causal=True, input_pos=2)
    options = {"max_seqlen_q": 25, "max_seqlen_k": 21}
    got = _run(convert, "triton", q, k, v, do, cq, ck, causal=True, input_pos=2, **options)
    for name, a, e in zip(_NAMES, got, expected):
        assert _err(a, e) <= floor("attention", "backward", "float32"), name


def test_max_seqlen_past_the_packed_length_counts_as_it():
    """A fixed bucket larger than this batch's packed lengths (flash-attn takes it too)."""
    rng = np.random.default_rng(16)
    q, k, v, _, cq, ck = _inputs(rng)
    want = xk.attention_varlen(q, k, v, cq, ck, causal=True)
    got = xk.attention_varlen(q, k, v, cq, ck, causal=True, max_seqlen_q=4096, max_seqlen_k=4096)
    np.testing.assert_array_equal(got, want)


def test_fully_masked_rows_and_unseen_keys():
    """An empty key sequence: o = 0, m = -inf, l = 0, dq = 0; keys of an empty query sequence: dk = dv = 0."""
    rng = np.random.default_rng(14)
    q, k, v, do, cq, ck = _inputs(rng)
    o, m, l_sum, dq, dk, dv = _run(
        np.asarray, "array_api", q, k, v, do, cq, ck, causal=False, input_pos=0
    )
    rows = slice(cq[2], cq[3])  # queries of the sequence with no keys
    assert np.all(o[rows] == 0) and np.all(m[:, rows] == -np.inf) and np.all(l_sum[:, rows] == 0)
    assert np.all(dq[rows] == 0)
    keys = slice(ck[1], ck[2])  # keys of the sequence with no queries
    assert keys.stop > keys.start and np.all(dk[keys] == 0) and np.all(dv[keys] == 0)


# --------------------------------------------------------------------------- bad input


def _bad_cases():
    good_q, good_k = _cu(Q_LENS), _cu(K_LENS)
    decreasing = good_q.copy()
    decreasing[3] = decreasing[2] - 1
    late = good_q.copy()
    late[0] = 1
    short = good_k.copy()
    short[-1] -= 1
    return [
        ("cu_seqlens_q", "non-decreasing", {"cu_seqlens_q": decreasing}),
        ("cu_seqlens_q", "start at 0", {"cu_seqlens_q": late}),
        ("cu_seqlens_k", "end at the packed length", {"cu_seqlens_k": short}),
        ("cu_seqlens_q", "dtype int32", {"cu_seqlens_q": good_q.astype(np.int64)}),
        ("cu_seqlens_k", "dtype int32", {"cu_seqlens_k": good_k.astype(np.float32)}),
        ("cu_seqlens_k", "B + 1 = 7 entries", {"cu_seqlens_k": _cu((*K_LENS[:-1], 0, K_LENS[-1]))}),
        ("cu_seqlens_q", "(B + 1,)", {"cu_seqlens_q": good_q.reshape(1, -1)}),
        ("max_seqlen_q", "at least the longest", {"max_seqlen_q": 17}),
        ("max_seqlen_k", "must lie in", {"max_seqlen_k": -1}),
        ("input_pos", "(6,)", {"input_pos": np.zeros(5, dtype=np.int64)}),
    ]


@pytest.mark.parametrize("name, words, change", _bad_cases(), ids=lambda c: str(c)[:40])
def test_bad_input_raises_naming_the_argument_and_writes_nothing(name, words, change):
    rng = np.random.default_rng(15)
    q, k, v, do, cq, ck = _inputs(rng)
    call = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, **change}
    cu_q, cu_k = call.pop("cu_seqlens_q"), call.pop("cu_seqlens_k")
    o = np.full((q.shape[0], H, DV), 7.0)
    ckpt = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    for a in ckpt:
        a[...] = 7.0
    with pytest.raises((TypeError, ValueError), match=name) as info:
        xk.attention_varlen_(o, q, k, v, cu_q, cu_k, checkpoints=ckpt, **call)
    assert words in str(info.value)
    assert np.all(o == 7.0) and all(np.all(a == 7.0) for a in ckpt)
    # The backward refuses the same input before writing any shadow.
    good = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    o_good = xk.attention_varlen(q, k, v, cq, ck, checkpoints=good)
    shadows = [np.full_like(a, 7.0) for a in (q, k, v)]
    args = (Duplicated(o_good, do), *map(Duplicated, (q, k, v), shadows))
    with pytest.raises((TypeError, ValueError), match=name):
        xk.attention_varlen_backward_(*args, cu_q, cu_k, checkpoints=good, **call)
    assert all(np.all(s == 7.0) for s in shadows)


def test_device_prefix_sums_are_checked_in_debug_mode():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    q, k, v, _, cq, ck = (torch.from_numpy(a) if hasattr(a, "shape") else a for a in _inputs(rng))
    bad = cq.clone()
    bad[-1] += 1
    o = torch.full((q.shape[0], H, DV), 7.0, dtype=q.dtype)
    xk.attention_varlen_(o, q, k, v, bad, ck)  # unchecked outside debug mode: no host read
    o.fill_(7.0)
    with xk.debug(), pytest.raises(ValueError, match="cu_seqlens_q must end at the packed"):
        xk.attention_varlen_(o, q, k, v, bad, ck)
    assert bool((o == 7.0).all())


def test_backward_refuses_other_prefix_sums_than_the_forward():
    rng = np.random.default_rng(17)
    q, k, v, do, cq, ck = _inputs(rng)
    ckpt = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    o = xk.attention_varlen(q, k, v, cq, ck, checkpoints=ckpt, causal=True)
    other = _cu((2, 1, 5, 1, 18, 2))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        xk.attention_varlen_backward(do, q, k, v, o, other, ck, checkpoints=ckpt, causal=True)
    with pytest.raises(ValueError, match="causal"):
        xk.attention_varlen_backward(do, q, k, v, o, cq, ck, checkpoints=ckpt)


# --------------------------------------------------------------------------- triton capture safety


def test_triton_reads_no_prefix_sum_on_the_host(monkeypatch):
    """With ``max_seqlen_*`` and every buffer given, the prefix sums reach the kernels unread."""
    torch = pytest.importorskip("torch")
    _torch_target("float32")
    from xpkernels.backends.triton import attention as tri_attention
    from xpkernels.backends.triton import attention_varlen as tri_varlen

    from xpkernels.testing.host_reads import no_host_reads

    device = "cuda" if torch.cuda.is_available() else "cpu"
    launched = []
    if device == "cpu":  # the interpreter copies every argument to the host: record instead

        class Kernel:
            def __getitem__(self, grid):
                return lambda *args, **meta: launched.append(args)

        monkeypatch.setattr(
            tri_varlen, "launch", lambda k, t, tab, g, args, *_: launched.append(args)
        )
        # the delta pass is attention's own launch (launch_delta), shared with varlen
        monkeypatch.setattr(tri_attention, "_delta_kernel", Kernel())
    rng = np.random.default_rng(18)
    q, k, v, do = (torch.from_numpy(a).float().to(device) for a in _inputs(rng)[:4])
    cq, ck = (no_host_reads(torch.from_numpy(c).to(device)) for c in (_cu(Q_LENS), _cu(K_LENS)))
    pos = no_host_reads(torch.tensor([0, 1, 2, 3, 4, 5], device=device))
    kw = {"max_seqlen_q": 18, "max_seqlen_k": 20, "causal": True, "input_pos": pos}
    o = torch.empty(q.shape[0], H, DV, device=device)
    ckpt = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    xk.attention_varlen_(o, q, k, v, cq, ck, checkpoints=ckpt, backend="triton", **kw)
    args = (Duplicated(o, do), *(Duplicated(a, torch.empty_like(a)) for a in (q, k, v)))
    scratch = xk.allocate_scratchspace(xk.attention_varlen_backward_, *args, backend="triton")
    assert scratch.dq_accum is None and tuple(scratch.delta.shape) == (H, q.shape[0])
    xk.attention_varlen_backward_(
        *args, cq, ck, checkpoints=ckpt, scratch=scratch, backend="triton", **kw
    )
    if device == "cpu":
        passed = {id(a) for call in launched for a in call if isinstance(a, torch.Tensor)}
        assert len(launched) == 4 and {id(cq), id(ck), id(pos)} <= passed


# --------------------------------------------------------------------------- torch autograd


def test_torch_gradcheck_and_autograd_equal_the_explicit_backward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(19)
    q_lens, k_lens = (2, 0, 3), (3, 2, 1)
    q, k, v, do, cq, ck = (torch.from_numpy(a) for a in _inputs(rng, q_lens, k_lens))
    pos = torch.tensor([1, 0, -2])
    leaves = [a.clone().requires_grad_() for a in (q, k, v)]

    def f(q, k, v):
        return xk.attention_varlen(q, k, v, cq, ck, causal=True, input_pos=pos)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5, rtol=1e-4)
    f(*leaves).backward(do)
    ckpt = xk.allocate_checkpoints(xk.attention_varlen_, q, k, v)
    o = xk.attention_varlen(q, k, v, cq, ck, causal=True, input_pos=pos, checkpoints=ckpt)
    expected = xk.attention_varlen_backward(
        do, q, k, v, o, cq, ck, checkpoints=ckpt, causal=True, input_pos=pos
    )
    for leaf, e in zip(leaves, expected):
        torch.testing.assert_close(leaf.grad, e)
    with pytest.raises(ValueError, match="requires grad"):
        xk.attention_varlen_(torch.empty_like(o), leaves[0], k, v, cq, ck)


def test_torch_compile_fullgraph_forward_and_backward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(20)
    q_lens, k_lens = (2, 4), (5, 3)
    q, k, v, do, cq, ck = (torch.from_numpy(a).float() for a in _inputs(rng, q_lens, k_lens))
    cq, ck = cq.int(), ck.int()
    leaves = [a.clone().requires_grad_() for a in (q, k, v)]

    def f(q, k, v):
        o = xk.attention_varlen(q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=5, causal=True)
        return (o * do).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(*leaves).backward()
    eager = [a.clone().requires_grad_() for a in (q, k, v)]
    f(*eager).backward()
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a.grad, e.grad)
