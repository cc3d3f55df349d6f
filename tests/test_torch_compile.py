"""``torch.compile(fullgraph=True)`` of functions calling the allocating fronts, forward and backward on CPU.

``fullgraph=True`` turns any graph break into an error; the compiled graphs
must hold the ``xpkernels`` ops (not the array_api backend's tile arithmetic),
give the eager gradients, and no warning may come from xpkernels' code.
Compiling takes tens of seconds on a small machine, so a few representative
functions are compiled, on tiny shapes.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no torch.compile")

import xpkernels as xk
from xpkernels.mods import AliBiScore, SlidingWindowMask
from xpkernels.torch import nn as xnn

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(xk.__file__)))


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g, requires_grad=True)

    return t(2, 3, 8), t(8), t(8), t(1, 4, 5, 8), t(1, 2, 5, 8), t(1, 2, 5, 8)


def _block(x, w, b, q, k, v):
    h = xk.rms_norm(x, w)
    h = xk.layer_norm(h, w, b)
    o = xk.attention(q, k, v, causal=True)
    return (xk.softmax(h) * h).sum() + o.square().sum()


def _compiled_grads(fn, inputs):
    compiled = torch.compile(fn, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(*inputs)
        loss.backward()
    ours = [w for w in caught if os.path.abspath(w.filename).startswith(SOURCE)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    return loss, [t.grad for t in inputs]


def test_compile_fullgraph_forward_backward_matches_eager():
    inputs = _inputs()
    loss, grads = _compiled_grads(_block, inputs)
    eager_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    eager = _block(*eager_inputs)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for got, want in zip(grads, (t.grad for t in eager_inputs)):
        torch.testing.assert_close(got, want)


def test_compiled_graph_calls_the_xpkernels_ops():
    """The traced graph holds one op per call, not the array_api backend's arithmetic."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    norm = xnn.RMSNorm(8)
    inputs = _inputs(1)
    torch.compile(lambda x: norm(x).sum(), fullgraph=True, backend=backend)(inputs[0]).backward()
    assert any("xpkernels.rms_norm" in s for s in seen), seen
    assert inputs[0].grad is not None and norm.weight.grad is not None


def test_a_mod_built_inside_the_compiled_function_is_refused_at_trace_time():
    """torch.compile rebuilds an object made in the traced frame without the graph its
    constructor traced: the call says so, naming where to build the mod, before any kernel."""
    q = torch.randn(1, 2, 5, 4)

    def f(q):
        return xk.flex_attention(q, q, q, mask_mod=SlidingWindowMask(2))

    with pytest.raises(
        Exception, match=r"SlidingWindowMask of this torch.compile'd call was built"
    ):
        torch.compile(f, fullgraph=True, backend="eager")(q)


def test_compile_fullgraph_flex_attention_with_a_learnable_score_mod():
    """The mods are filed once at trace time; the captured Parameter is a graph input and learns."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25]))
    mod, mask = AliBiScore(slopes), SlidingWindowMask(2)
    q = torch.randn(1, 2, 5, 4, requires_grad=True)

    def f(q):
        return xk.flex_attention(q, q, q, score_mod=mod, mask_mod=mask).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    compiled(q).backward()
    got = (q.grad.clone(), slopes.grad.clone())
    assert any("xpkernels.flex_attention" in s for s in seen), seen
    q.grad = slopes.grad = None
    f(q).backward()
    torch.testing.assert_close(got[0], q.grad)
    torch.testing.assert_close(got[1], slopes.grad)
    with torch.no_grad():
        slopes.mul_(2.0)  # a new value, same Parameter: the compiled graph reads it
    want = f(q)
    torch.testing.assert_close(compiled(q), want)


def test_compile_fullgraph_with_symbolic_float_options():
    """A float option Dynamo traces symbolically (dynamic=True, or a float argument that
    changes between calls) goes to the op unchecked; the op checks its value at run time."""
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    compiled = torch.compile(lambda x, w: xk.rms_norm(x, w), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), xk.rms_norm(x, w))

    def f(x, w, eps):
        return xk.rms_norm(x, w, eps=eps)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for eps in (0.1, 0.2, 0.3):
        torch.testing.assert_close(compiled(x, w, eps), f(x, w, eps))
    with pytest.raises(ValueError, match=r"eps must be finite and > 0, got -1.0"):
        compiled(x, w, -1.0)
    weight, targets = torch.randn(5, 8, requires_grad=True), torch.tensor([3, 0, -100, 1])

    def loss(x, weight, smoothing):  # the fused linear cross-entropy checks its own options
        return xk.linear_cross_entropy(x, weight, targets, label_smoothing=smoothing)

    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    for smoothing in (0.1, 0.2, 0.3):
        torch.testing.assert_close(compiled(x, weight, smoothing), loss(x, weight, smoothing))
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 1\], got 2.0"):
        compiled(x, weight, 2.0)


def test_compiled_decode_loop_keeps_input_pos_symbolic():
    """An int input_pos that changes between calls compiles one dynamic graph after the
    first, not one per value."""
    from torch._dynamo.testing import CompileCounter

    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)

    def f(q, k, pos):
        return xk.attention(q, k, k, causal=True, input_pos=pos)

    counter = CompileCounter()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for pos in range(2, 12):
        torch.testing.assert_close(compiled(q, k, pos), f(q, k, pos))
    assert counter.frame_count <= 2, counter.frame_count


def test_checkpoints_of_an_allocating_call_under_compile_say_why_they_are_refused():
    """Eager, checkpoints= on an allocating call with nothing requiring grad fills them; a
    compiled call runs the op, which cannot: refused for that reason, not for a gradient."""
    x, w = torch.randn(4, 8), torch.ones(8)
    checkpoints = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    xk.rms_norm(x, w, checkpoints=checkpoints)
    assert bool((checkpoints.rstd != 0).all())

    def f(x, w):
        return xk.rms_norm(x, w, checkpoints=checkpoints)

    with pytest.raises(Exception, match=r"checkpoints= is not supported inside torch.compile"):
        torch.compile(f, fullgraph=True, backend="eager")(x, w)
    with pytest.raises(Exception, match=r"an input requires grad"):
        torch.compile(f, fullgraph=True, backend="eager")(x.requires_grad_(), w)
