"""Autograd through the allocating fronts: xpkernels' own backward runs, no gradient is ever dropped.

- ``xk.rms_norm(x, w)`` (and every allocating front) on tensors that require
  grad records one ``xpkernels`` op, whose backward is xpkernels' backward
  kernel; the gradient reaches layers before it (array_api AND triton);
- nothing of the tile arithmetic is kept for autograd: what is saved is the
  inputs, the output and the checkpoints, and the backward's peak memory
  does not grow with ``Sq x Sk``;
- the in-place fronts refuse tensors that require grad in grad mode (naming
  them) and accept them under ``torch.no_grad()``;
- double backward, meta tensors and ``checkpoints=`` with autograd are clear
  errors.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no xpkernels.torch")

from xpkernels.backends.array_api import attention as array_api_attention
from xpkernels.backends.array_api import rms_norm as array_api_rms_norm

import xpkernels as xk
from xpkernels import Duplicated


def _f64(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=grad)


def test_the_front_records_one_xpkernels_op_and_runs_its_backward(monkeypatch):
    calls = []
    original = array_api_rms_norm.backward

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(array_api_rms_norm, "backward", spy)
    x, w = _f64(3, 5), _f64(5, seed=1)
    y = xk.rms_norm(x, w)
    assert "xpkernels_rms_norm" in type(y.grad_fn).__name__
    assert calls == []
    y.backward(torch.ones_like(y))
    assert calls == [(3, 5)]
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.rms_norm(ref_x, (5,), ref_w, eps=1e-6).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_without_grad_the_front_records_nothing():
    x, w = _f64(3, 5, grad=False), _f64(5, grad=False)
    assert xk.rms_norm(x, w).grad_fn is None
    x.requires_grad_()
    with torch.no_grad():
        assert xk.rms_norm(x, w).grad_fn is None


def _earlier_layer_losses(backend, dtype, norm_only=False):
    """``lin -> rms_norm -> attention -> layer_norm -> softmax -> head``; returns the grads of ``lin``."""
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(8, 8, dtype=dtype)
    head = torch.nn.Linear(8, 3, dtype=dtype)
    with torch.no_grad():
        for p in (*lin.parameters(), *head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    gain = torch.nn.Parameter(torch.rand(8, generator=g, dtype=dtype) + 0.5)
    x = torch.randn(2, 4, 8, generator=g, dtype=dtype)

    def model(ops):
        h = ops["rms_norm"](lin(x), gain)
        if not norm_only:
            heads = h.view(2, 4, 2, 4).transpose(1, 2)  # (B, H, S, D) view of BSHD memory
            a = ops["attention"](heads, heads, heads).transpose(1, 2).reshape(2, 4, 8)
            h = ops["softmax"](ops["layer_norm"](h + a, gain))
        return head(h).square().mean()

    xpk = {
        "rms_norm": lambda h, w: xk.rms_norm(h, w, backend=backend),
        "attention": lambda q, k, v: xk.attention(q, k, v, causal=True, backend=backend),
        "layer_norm": lambda h, w: xk.layer_norm(h, w, backend=backend),
        "softmax": lambda h: xk.softmax(h, backend=backend),
    }
    F = torch.nn.functional
    reference = {
        "rms_norm": lambda h, w: F.rms_norm(h, (8,), w, eps=1e-6),
        "attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "layer_norm": lambda h, w: F.layer_norm(h, (8,), w, eps=1e-5),
        "softmax": lambda h: torch.softmax(h, dim=-1),
    }
    grads = []
    for ops in (xpk, reference):
        for p in (*lin.parameters(), gain):
            p.grad = None
        model(ops).backward()
        grads.append([lin.weight.grad.clone(), lin.bias.grad.clone(), gain.grad.clone()])
    return grads


def test_gradient_reaches_an_earlier_layer_array_api():
    got, want = _earlier_layer_losses("array_api", torch.float64)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


def test_gradient_reaches_an_earlier_layer_triton():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "CPU tensors run Triton kernels only with TRITON_INTERPRET=1 (set by the harness)"
        )
    got, want = _earlier_layer_losses("triton", torch.float32)
    for g, w in zip(got, want):
        assert torch.count_nonzero(g) > 0
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


def test_backend_choice_of_the_forward_is_the_backward_s(monkeypatch):
    """The forward's backend (here from use_backend) runs the backward, even outside the block."""
    calls = []
    original = array_api_rms_norm.backward
    monkeypatch.setattr(
        array_api_rms_norm, "backward", lambda *a, **k: (calls.append(1), original(*a, **k))
    )
    x, w = _f64(2, 4), _f64(4)
    with xk.use_backend("array_api"):
        y = xk.rms_norm(x, w)
    y.sum().backward()
    assert calls == [1]


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda t, g: xk.rms_norm_(torch.empty_like(t), t, g), "x"),
        (lambda t, g: xk.rms_norm_(torch.empty_like(t), t.detach(), g), "w"),
        (lambda t, g: xk.layer_norm_(torch.empty_like(t), t, g), "x"),
        (lambda t, g: xk.softmax_(torch.empty_like(t), Duplicated(t)), "x.primal"),
        (
            lambda t, g: xk.attention_(
                torch.empty(1, 1, 2, 3, dtype=t.dtype),
                *(t.detach().view(1, 1, 2, 3),) * 2,
                t.view(1, 1, 2, 3),
            ),
            "v",
        ),
        (
            lambda t, g: xk.rms_norm_backward_(
                Duplicated(t.detach(), t.detach()),
                Duplicated(t, torch.empty_like(t)),
                g.detach(),
                checkpoints=xk.allocate_checkpoints(xk.rms_norm_, t),
            ),
            "X.primal",
        ),
    ],
)
def test_inplace_fronts_refuse_tensors_that_require_grad(call, name):
    x, w = _f64(2, 3), _f64(3)
    out_before = x.detach().clone()
    with pytest.raises(
        ValueError, match=rf"{name} requires grad.*allocating xpkernels\.\w+\(.*torch\.no_grad\(\)"
    ):
        call(x, w)
    torch.testing.assert_close(x.detach(), out_before)
    with torch.no_grad():
        if name != "X.primal":
            call(x, w)


def test_inplace_decode_points_at_no_grad_not_at_its_allocating_form():
    """decode_attention has no backward: its in-place refusal must not send the caller to an
    allocating call whose backward then fails."""
    q = _f64(1, 2, 8).requires_grad_()
    cache = _f64(1, 1, 5, 8)
    with pytest.raises(ValueError, match=r"decode_attention has no backward .*torch\.no_grad"):
        xk.decode_attention_(
            torch.empty(1, 2, 8, dtype=q.dtype), q, cache, cache, torch.tensor([5])
        )


def test_forward_mode_tangents_are_refused_not_dropped():
    """A dual tensor's tangent would be lost (the ops implement reverse mode only): refused,
    naming the argument, by the allocating and the in-place fronts."""
    import torch.autograd.forward_ad as fwAD

    x = _f64(2, 3)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match=r"softmax_?: x carries a forward-mode"):
            xk.softmax(dual)
        with pytest.raises(NotImplementedError, match=r"rms_norm_: x carries a forward-mode"):
            xk.rms_norm_(torch.empty_like(x), dual)
        xk.softmax(x)  # no tangent: runs


def test_inplace_front_refuses_a_score_mod_parameter():
    from xpkernels.mods import AliBiScore

    q = _f64(1, 2, 3, 4, grad=False)
    slopes = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"AliBiScore\.slopes requires grad"):
        xk.flex_attention_(torch.empty_like(q), q, q, q, score_mod=AliBiScore(slopes))


@pytest.mark.parametrize(
    "front", ["rms_norm", "layer_norm", "softmax", "attention", "flex_attention"]
)
def test_double_backward_is_refused(front):
    x, w = _f64(1, 2, 3, 4), _f64(4)
    calls = {
        "rms_norm": lambda: xk.rms_norm(x, w),
        "layer_norm": lambda: xk.layer_norm(x, w),
        "softmax": lambda: xk.softmax(x),
        "attention": lambda: xk.attention(x, x, x),
        "flex_attention": lambda: xk.flex_attention(x, x, x),
    }
    y = calls[front]()
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(
        RuntimeError, match=rf"xpkernels\.{front}: double backward .* not supported"
    ):
        g.sum().backward()


def test_meta_tensors_are_refused_by_name():
    x = torch.empty(2, 3, device="meta", requires_grad=True)
    w = torch.ones(3)
    with pytest.raises(TypeError, match=r"rms_norm: x is on device meta but w is on cpu: a meta"):
        xk.rms_norm(x, w)
    with pytest.raises(TypeError, match=r"rms_norm_: w is on device meta but x is on cpu"):
        xk.rms_norm_(torch.empty(2, 3), torch.ones(2, 3), torch.empty(3, device="meta"))
    with pytest.raises(
        TypeError, match=r"rms_norm: x is a meta tensor: a meta tensor holds no data"
    ):
        xk.rms_norm(x, w.to("meta"))
    with pytest.raises(TypeError, match=r"attention: k is on device meta"):
        q = torch.ones(1, 1, 2, 3, requires_grad=True)
        xk.attention(q, q.detach().to("meta"), q.detach())


def test_checkpoints_with_autograd_is_a_clear_error():
    x, w = _f64(2, 3), _f64(3)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x)
    with pytest.raises(ValueError, match=r"checkpoints=.*autograd saves the checkpoints"):
        xk.rms_norm(x, w, checkpoints=ck)


def test_validation_runs_before_anything_is_recorded():
    x, w = _f64(2, 3), _f64(4)
    with pytest.raises(ValueError, match=r"w must have shape \(3,\)"):
        xk.rms_norm(x, w)
    with pytest.raises(ValueError, match=r"eps must be finite and > 0"):
        xk.rms_norm(x, w, eps=0.0)


def _saved_bytes(fn):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved), len(saved)


def _peak_rss_growth(fn) -> int:
    """Bytes the process's peak RSS rises above its RSS at the start of ``fn`` (Linux)."""

    def field(name):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(name)

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    start = field("VmRSS:")
    fn()
    return field("VmHWM:") - start


_LONG_SEQUENCE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, xpkernels as xk
from test_torch_autograd import _peak_rss_growth, _saved_bytes
s, d = 4096, 16
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, s, d, generator=g, requires_grad=True) for _ in range(3))
out, saved, count = _saved_bytes(lambda: xk.attention(q, k, v, causal=True))
do = torch.randn(out.shape, generator=g)
growth = _peak_rss_growth(lambda: out.backward(do))
ok = all(t.grad is not None for t in (q, k, v))
print(json.dumps({"saved": saved, "count": count, "growth": growth, "grads": ok}))
"""


def test_no_tile_intermediate_is_kept_for_autograd_on_a_long_sequence():
    """Sq = Sk = 4096: the full score matrix would be 64 MiB; autograd keeps O(S * D).

    Measured in a fresh process, so the heap state of earlier tests does not
    blur the backward's peak.
    """
    import json
    import subprocess

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak memory is read from /proc/self (Linux only)")
    here = os.path.dirname(os.path.abspath(__file__))
    # A fixed mmap threshold: glibc otherwise raises it after the first tile is freed, keeps
    # later freed tiles on its heap, and the peak then measures the allocator's retention
    # (11-18 MB from run to run here) rather than the live tiles (about 12 MB every run).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    run = subprocess.run(
        [sys.executable, "-c", _LONG_SEQUENCE, here],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    s, d = 4096, 16
    per_row = 4 * d * 4 + 2 * 4  # q, k, v, o (float32 rows of D) and the checkpoints m, l
    assert got["saved"] <= s * per_row, got
    # dq, dk, dv plus a few tile temporaries (NUMPY_TILE_ELEMENTS float32 each, the larger
    # budget) -- far below the 64 MiB score matrix, and below what recording the tile
    # arithmetic keeps (35 MiB measured).
    bound = 3 * s * d * 4 + 8 * array_api_attention.NUMPY_TILE_ELEMENTS * 4
    assert got["growth"] < bound, (got, bound)
    assert got["grads"]


@pytest.mark.parametrize(
    "forward",
    [
        lambda t: torch.ops.xpkernels.rms_norm(t, None, 1e-6, 0.0, None),
        lambda t: torch.ops.xpkernels.layer_norm(t, None, None, 1e-5, None),
        lambda t: torch.ops.xpkernels.attention(
            *(t.view(1, 1, 3, 4),) * 3, None, None, None, True, None, 0, None
        ),
    ],
)
def test_checkpoint_outputs_are_not_differentiable(forward):
    """No gradient can flow into a checkpoint output and be dropped: they do not require grad."""
    t = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out, *checkpoints = forward(t)
    assert out.requires_grad
    assert not any(c.requires_grad for c in checkpoints)


def test_merging_attention_outputs_whose_checkpoints_lack_gradients_raises():
    """o_a from attention with its non-differentiable (m, l): a merge would lose their gradient."""
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    o, m, l = torch.ops.xpkernels.attention(q, q, q, None, None, None, False, None, 0, None)
    with pytest.raises(RuntimeError, match="o_a requires grad but m_a and l_a do not"):
        torch.ops.xpkernels.merge_attention_states(o, m, l, o.detach(), m, l, None)
