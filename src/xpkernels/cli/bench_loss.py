"""The CPU bench rows of the losses: cross-entropy and linear cross-entropy.

:func:`loss_benches` gives :func:`.bench_cases.benches` the rows of ``--op
cross_entropy`` and ``--op linear_cross_entropy`` (shapes in
:data:`.bench_cases.SHAPES`); the inputs, work formulas, xpkernels calls and
PyTorch compositions are those ``bench/gpu.py`` times too
(:mod:`.bench_work`).

- ``cross_entropy`` forward and backward against ``F.cross_entropy`` (GB/s of
  the logits' bytes); xpkernels' backward writes the gradient into a buffer of
  its own, not over the logits.
- ``linear_cross_entropy`` forward and backward against ``F.cross_entropy(x @
  W.T, t)`` (TFLOP/s of the composition's products); a training step
  (forward and autograd backward) on PyTorch tensors, ``xpkernels autograd``
  (the fused op) against the composition; then, on NumPy arrays,
  forward+backward -- the forward then the backward, and the fused forward
  (Duplicated ``x`` and ``W``: three products, not four) -- against
  :func:`numpy_linear_cross_entropy`, the NumPy composition that forms the
  full logits, with each side's peak memory (:func:`peak_bytes`, tracemalloc)
  in the rows' formula: the issue's target is at most 2 chunks of extra memory
  for xpkernels, where the composition needs the ``N x V`` logits.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from ..buffers import allocate_scratchspace
from .bench_rows import Bench, Row, compare, torch_setup, xpk_setup
from .bench_work import (
    Arrays,
    cross_entropy_calls,
    cross_entropy_inputs,
    cross_entropy_work,
    linear_cross_entropy_calls,
    linear_cross_entropy_fused,
    linear_cross_entropy_inputs,
    linear_cross_entropy_step,
    linear_cross_entropy_work,
    numpy_random,
    torch_cross_entropy,
    torch_linear_cross_entropy,
    torch_tensor,
)

#: What each side of the forward+backward rows is called: xpkernels and the composition.
COMPOSITION = "numpy logits"


def loss_benches(
    op: str, shape: dict[str, int], arrays: Arrays, repeats: int, with_torch: bool
) -> list[Bench]:
    """The rows of loss ``op`` (``cross_entropy`` or ``linear_cross_entropy``) at ``shape``."""
    if op == "cross_entropy":
        return _cross_entropy_benches(shape, arrays, repeats, with_torch)
    return _linear_benches(shape, arrays, repeats, with_torch)


# --------------------------------------------------------------------------- cross-entropy


def _cross_entropy_benches(shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    """Cross-entropy (mean over the rows) forward and backward against ``F.cross_entropy``
    (forward under ``torch.no_grad()``, backward by autograd to the logits)."""
    n, v = shape["N"], shape["V"]
    inputs = cross_entropy_inputs(n, v, numpy_random(10))
    benches = []
    for pass_ in ("forward", "backward"):
        ours = ("xpkernels", xpk_setup(pass_, cross_entropy_calls, arrays, inputs))
        theirs = ("torch", _torch_setup(pass_, torch_cross_entropy, inputs, ("logits",)))
        work = cross_entropy_work(pass_, n, v, 4)
        side = theirs if with_torch else None
        benches += compare("cross_entropy", pass_, f"{n}x{v}", "GB/s", work, repeats, ours, side)
    return benches


def _torch_setup(pass_: str, loss: Callable, inputs: dict[str, Any], wanted: tuple):
    """The setup of one pass of the PyTorch composition ``loss(*inputs, targets)``: the forward
    under ``torch.no_grad()``, or the autograd backward to the inputs named ``wanted``."""

    def make(grad):
        tensors = tuple(torch_tensor(inputs[name], grad) for name in wanted)
        targets = torch_tensor(inputs["targets"])
        return (lambda: loss(*tensors, targets)), tensors, None

    return torch_setup(pass_, make)


# --------------------------------------------------------------------------- linear cross-entropy


def _linear_benches(shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    """Linear cross-entropy forward and backward against ``F.cross_entropy(x @ W.T, t)``; then
    (NumPy arrays only: tracemalloc sees NumPy's allocations, not PyTorch's) forward+backward,
    unfused and fused, against the NumPy composition, with every side's peak memory."""
    n, h, v = shape["N"], shape["H"], shape["V"]
    inputs = linear_cross_entropy_inputs(n, h, v, numpy_random(11))
    shape_text = f"{n}x{h}x{v}"
    benches = []
    op = "linear_cross_entropy"
    for pass_ in ("forward", "backward"):
        ours = ("xpkernels", xpk_setup(pass_, linear_cross_entropy_calls, arrays, inputs))
        theirs = ("torch", _torch_setup(pass_, torch_linear_cross_entropy, inputs, ("x", "weight")))
        work = linear_cross_entropy_work(pass_, n, h, v)
        side = theirs if with_torch else None
        benches += compare(op, pass_, shape_text, "TFLOP/s", work, repeats, ours, side)
    step = linear_cross_entropy_work("fwd+bwd", n, h, v)
    if arrays.library != "numpy":
        if with_torch:
            ours = ("xpkernels autograd", _step_setup(_xpk_loss, inputs))
            theirs = ("torch", _step_setup(torch_linear_cross_entropy, inputs))
            benches += compare(op, "fwd+bwd", shape_text, "TFLOP/s", step, repeats, ours, theirs)
        return benches
    rows: list[Row] = []
    ours = ("xpkernels", _xpk_step_setup(inputs, rows, step[1]))
    theirs = (COMPOSITION, _numpy_step_setup(inputs))
    benches += compare(op, "fwd+bwd", shape_text, "TFLOP/s", step, repeats, ours, theirs)
    baseline = f"{op}/fwd+bwd/{COMPOSITION}"
    fused = Row(op, "fwd+bwd", "xpkernels fused", shape_text, "TFLOP/s", *step, baseline)
    benches.append(
        Bench(fused, lambda: linear_cross_entropy_fused(Arrays("numpy"), inputs), repeats)
    )
    rows += [bench.row for bench in benches[-3:]]
    return benches


def _xpk_loss(x, weight, targets):
    """``xpkernels.linear_cross_entropy`` (mean): under autograd its fused op (gradients formed
    in the forward, three products)."""
    from .. import linear_cross_entropy

    return linear_cross_entropy(x, weight, targets)


def _step_setup(loss: Callable, inputs: dict[str, Any]):
    """A training step on PyTorch tensors: ``loss(x, weight, targets)`` and the autograd
    gradients of x and the weight."""

    def setup():
        import torch

        x, weight = (torch_tensor(inputs[name], True) for name in ("x", "weight"))
        targets = torch_tensor(inputs["targets"])
        return lambda: torch.autograd.grad(loss(x, weight, targets), (x, weight))

    return setup


def numpy_linear_cross_entropy(x, weight, targets, dx, dweight) -> float:
    """The NumPy composition linear cross-entropy replaces, written to hold as little as NumPy
    lets it: the full ``(N, V)`` logits ``x @ weight.T`` -- the one ``N x V`` array, turned
    into the softmax, then into the gradient, in place -- ``dx`` and ``dweight`` written into
    the given arrays. Returns the loss (the mean over the rows)."""
    rows = np.arange(x.shape[0])
    z = x @ weight.T
    z -= np.max(z, axis=1, keepdims=True)
    picked = z[rows, targets]
    np.exp(z, out=z)
    sums = np.sum(z, axis=1, keepdims=True)
    loss = float(np.mean(np.log(sums[:, 0]) - picked))
    z /= sums
    z[rows, targets] -= 1.0
    z /= x.shape[0]
    np.matmul(z, weight, out=dx)
    np.matmul(z.T, x, out=dweight)
    return loss


def peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes allocated at once during ``run()`` beyond those allocated when it starts,
    as tracemalloc counts them (NumPy reports its arrays' data to it)."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not tracing:
            tracemalloc.stop()
    return peak - start


def linear_memory(inputs: dict[str, Any]) -> dict[str, Any]:
    """The peak extra memory of one forward+backward of linear cross-entropy on NumPy arrays,
    each side's gradients ``dx``, ``dW`` allocated beforehand (results, not working memory),
    in bytes: ``xpkernels`` (forward then backward, :func:`.bench_work.linear_cross_entropy_step`:
    the checkpoints, scratch at its default chunk and loss allocated inside), ``fused`` (the
    forward given Duplicated ``x`` and ``W``: its scratch and loss inside), ``composition``
    (:func:`numpy_linear_cross_entropy`); the ``chunk``'s bytes and ``rows``, and the ``logits``
    (``N x V``) bytes they are counted in."""
    import xpkernels as xk

    x, weight, targets = (inputs[name] for name in ("x", "weight", "targets"))
    dx, dweight = np.empty_like(x), np.empty_like(weight)
    arrays = Arrays("numpy")
    chunk = allocate_scratchspace(xk.linear_cross_entropy_, x, weight, targets).logits
    sides = {
        "xpkernels": lambda: linear_cross_entropy_step(arrays, inputs, dx, dweight),
        "fused": lambda: linear_cross_entropy_fused(arrays, inputs, dx, dweight)(),
        "composition": lambda: numpy_linear_cross_entropy(x, weight, targets, dx, dweight),
    }
    for run in sides.values():  # once untraced: imports and caches of a first call
        run()
    return {
        **{side: peak_bytes(run) for side, run in sides.items()},
        "chunk": chunk.nbytes,
        "rows": chunk.shape[0],
        "logits": x.shape[0] * weight.shape[0] * x.itemsize,
    }


def memory_note(memory: dict[str, Any]) -> str:
    """:func:`linear_memory`'s figures in MiB, ours in chunks and the composition's in ``N x V``
    logits."""
    mib, chunk, logits = 2**20, memory["chunk"], memory["logits"]
    ours, fused, theirs = (memory[k] for k in ("xpkernels", "fused", "composition"))
    return (
        f"peak extra memory, tracemalloc over NumPy float32 (inputs and dx, dW allocated "
        f"before): xpkernels {ours / mib:.2f} MiB = {ours / chunk:.2f} chunks of "
        f"{memory['rows']} x V rows ({chunk / mib:.2f} MiB; target: at most 2), fused "
        f"{fused / mib:.2f} MiB = {fused / chunk:.2f} chunks, {COMPOSITION} "
        f"{theirs / mib:.2f} MiB = {theirs / logits:.2f} x the N x V logits "
        f"({logits / mib:.2f} MiB)"
    )


def _xpk_step_setup(inputs: dict[str, Any], rows: list[Row], formula: str):
    """xpkernels' forward then backward on NumPy arrays, its buffers allocated beforehand. The
    first setup measures every side's peak memory (:func:`linear_memory`, untimed) and writes
    ``formula`` and that note into ``rows`` (the comparison's rows)."""
    measured: list[str] = []

    def setup():
        if not measured:
            measured.append(memory_note(linear_memory(inputs)))
            for row in rows:
                row.formula = f"{formula}; {measured[0]}"
        calls = linear_cross_entropy_calls(Arrays("numpy"), inputs)

        def step():
            calls.forward()
            calls.backward()

        return step

    return setup


def _numpy_step_setup(inputs: dict[str, Any]):
    """The NumPy composition's forward+backward, ``dx`` and ``dW`` allocated beforehand."""

    def setup():
        x, weight, targets = (inputs[name] for name in ("x", "weight", "targets"))
        dx, dweight = np.empty_like(x), np.empty_like(weight)
        return lambda: numpy_linear_cross_entropy(x, weight, targets, dx, dweight)

    return setup
