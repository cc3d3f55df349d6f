"""Bench rows of the torch autograd path (``python -m xpkernels bench --array torch``).

Each row times one forward AND backward of one op on torch CPU tensors:

- ``autograd``: the allocating front on tensors that require grad, then
  ``torch.autograd.grad`` -- what ``loss.backward()`` costs through the
  ``xpkernels`` ops; its baseline is the ``in-place`` row (target: at most
  10% slower);
- ``in-place``: the in-place forward and backward over buffers allocated
  once (no autograd at all); its baseline is the ``torch`` row;
- ``torch``: PyTorch's own op (``F.rms_norm``, ``F.layer_norm``,
  ``torch.softmax``, ``F.scaled_dot_product_attention``) and its autograd.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

import xpkernels as xk
from xpkernels import Duplicated, allocate_checkpoints, allocate_scratchspace

__all__ = ["autograd_benches"]

PASS = "fwd+bwd"


def _inputs(op, shapes, seed):
    rng = np.random.default_rng(seed)
    if op == "attention":
        b, h, s, d = (shapes["attention"][n] for n in ("B", "H", "S", "D"))
        return [rng.standard_normal((b, h, s, d), dtype=np.float32) for _ in range(4)]
    rows, m = shapes["rows"]
    x, dy = (rng.standard_normal((rows, m), dtype=np.float32) for _ in range(2))
    n_params = {"rms_norm": 1, "layer_norm": 2}.get(op, 0)
    params = [rng.standard_normal((m,), dtype=np.float32) for _ in range(n_params)]
    return [x, dy, *params]


def _tensors(arrays, grad):
    return [torch.from_numpy(np.ascontiguousarray(a)).requires_grad_(grad) for a in arrays]


def _split(op, tensors):
    """``(inputs, cotangent)``: the op's differentiable inputs and the output's cotangent."""
    if op == "attention":
        q, k, v, do = tensors
        return (q, k, v), do
    x, dy, *params = tensors
    return (x, *params), dy


def _options(op):
    return {"causal": True} if op == "attention" else {}


def _grad_setup(op, arrays, forward):
    """A setup of one step: ``forward(op, m)(*inputs)`` (``m``: the rows' width) and
    ``torch.autograd.grad`` of it."""

    def setup():
        inputs, cot = _split(op, _tensors(arrays, True))
        cot = cot.detach()
        call = forward(op, inputs[0].shape[-1])

        def step():
            return torch.autograd.grad(call(*inputs), inputs, cot)

        return step

    return setup


def _autograd_call(op, m):
    return functools.partial(getattr(xk, op), **_options(op))


def _inplace_setup(op, arrays):
    def setup():
        inputs, cot = _split(op, _tensors(arrays, False))
        forward_, backward_ = getattr(xk, f"{op}_"), getattr(xk, f"{op}_backward_")
        out = torch.empty(cot.shape, dtype=inputs[0].dtype)
        options = _options(op)
        D = [Duplicated(t) for t in inputs]
        Out = Duplicated(out, cot)
        saved, saved_bwd = {}, {}
        if op != "softmax":
            saved["checkpoints"] = allocate_checkpoints(forward_, *inputs)
            saved_bwd = {**saved, "scratch": allocate_scratchspace(backward_, Out, *D), **options}

        def step():
            forward_(out, *inputs, **saved, **options)
            backward_(Out, *D, **saved_bwd)

        return step

    return setup


def _torch_call(op, m):
    return {
        "rms_norm": lambda x, w: F.rms_norm(x, (m,), w, eps=1e-6),
        "layer_norm": lambda x, w, b: F.layer_norm(x, (m,), w, b, eps=1e-5),
        "softmax": lambda x: torch.softmax(x, dim=-1),
        "attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }[op]


def _work(op, shapes):
    """``(unit, work, formula, shape_text)`` of one forward + backward."""
    if op == "attention":
        b, h, s, d = (shapes["attention"][n] for n in ("B", "H", "S", "D"))
        flops = 3.5 * 4 * b * h * s * s * d / 2
        where = f"B={b}, H={h}, Sq=Sk={s}, D={d}"
        return (
            "TFLOP/s",
            flops,
            f"FLOPs = 3.5 * 4*B*H*Sq*Sk*D / 2 (causal; forward 1, backward 2.5; {where})",
            f"{b}x{h}x{s}x{d}",
        )
    rows, m = shapes["rows"]
    n_params, n_stats = {"rms_norm": (1, 1), "layer_norm": (2, 2), "softmax": (0, 0)}[op]
    size = 4
    work = (5 * rows * m + 3 * n_params * m) * size + 2 * 4 * n_stats * rows
    formula = (
        f"bytes = (5*R*M + 3*P*M)*s + 8*K*R (forward + backward: read x (twice), dy, write y, dx; "
        f"P={n_params} weights read twice, written once as grads; K={n_stats} float32 row "
        f"statistics written and read; R={rows}, M={m}, s={size})"
    )
    return "GB/s", work, formula, f"{rows}x{m}"


def autograd_benches(shapes, ops, repeats, Row, Bench) -> list:
    """The ``fwd+bwd`` rows of the chosen ops (norms, softmax, attention).

    ``Row`` and ``Bench`` are the bench command's record types.
    """
    benches = []
    for op in ("rms_norm", "layer_norm", "softmax", "attention"):
        if ops and op not in ops:
            continue
        arrays = _inputs(op, shapes, seed=3)
        unit, work, formula, shape_text = _work(op, shapes)
        for impl, setup, baseline in (
            ("autograd", _grad_setup(op, arrays, _autograd_call), "in-place"),
            ("in-place", _inplace_setup(op, arrays), "torch"),
            ("torch", _grad_setup(op, arrays, _torch_call), None),
        ):
            name = "attention (causal)" if op == "attention" else op
            row = Row(
                f"{name} [torch autograd]",
                PASS,
                impl,
                shape_text,
                unit,
                work,
                formula,
                None if baseline is None else f"{name} [torch autograd]/{PASS}/{baseline}",
            )
            benches.append(Bench(row, setup, repeats))
    return benches
