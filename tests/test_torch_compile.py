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
