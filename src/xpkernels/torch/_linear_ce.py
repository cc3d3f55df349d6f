"""Linear cross-entropy under autograd with its gradients formed in the forward.

A reduced loss (``"mean"`` or ``"sum"``) has one cotangent for every row, so
the forward can form each chunk's gradient while the chunk's logits are at
hand (:func:`xpkernels.linear_cross_entropy_` given Duplicated inputs) and
the backward only scales the saved gradients by the cotangent: three
products in all (the logits, ``dZ W``, ``dZ^T x``) instead of the four of a
backward that forms the logits again, as Liger-Kernel's fused linear
cross-entropy does. ``xpkernels::linear_cross_entropy_fused`` is that op;
:func:`record` sends reduced calls to it and ``reduction="none"`` (whose
cotangents the forward cannot know) to the op generated from the declaration.
The saved gradients (``x``'s and the weight's shapes) live from the forward
to the backward, as the logits' gradient would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.protocol import PRIMITIVES
from ..buffers import Duplicated, primal
from ..linear_cross_entropy import linear_cross_entropy_
from ._declared import FRONTS, RULES, backend_choice
from ._ops import _name, _no_double_backward

__all__ = ["FUSED", "record"]

_GENERATED = FRONTS["linear_cross_entropy"]

#: The options, in the order the fused op takes them.
_OPTIONS = PRIMITIVES["linear_cross_entropy"].signature.options


def _loss_dtype(x: Tensor):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op(_name("linear_cross_entropy_fused"), mutates_args=())
def _fused(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    reduction: str,
    z_loss: float,
    need_dx: bool,
    need_dweight: bool,
    need_dbias: bool,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reduced loss and, where asked, the gradients of x, weight and bias for a unit
    cotangent (an unwanted one comes back empty)."""
    with torch.no_grad():
        loss = x.new_empty((), dtype=_loss_dtype(x))
        wanted = {"x": need_dx, "weight": need_dweight, "bias": need_dbias}
        given = {"x": x, "weight": weight, "bias": bias}
        args = {
            n: Duplicated(a, torch.empty_like(a)) if wanted[n] and a is not None else a
            for n, a in given.items()
        }
        linear_cross_entropy_(
            loss,
            args["x"],
            args["weight"],
            targets,
            args["bias"],
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            softcap=softcap,
            reduction=reduction,
            z_loss=z_loss,
            backend=backend,
        )
    grads = [a.shadow if isinstance(a, Duplicated) else x.new_empty((0,)) for a in args.values()]
    return loss, *grads  # type: ignore[return-value]


@_fused.register_fake
def _fused_fake(x, weight, targets, bias, *args):
    need_dx, need_dweight, need_dbias = args[5:8]
    grads = [
        torch.empty_like(a) if need and a is not None else x.new_empty((0,))
        for a, need in ((x, need_dx), (weight, need_dweight), (bias, need_dbias))
    ]
    return x.new_empty((), dtype=_loss_dtype(x)), *grads


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.needs = inputs[9:12]


def _backward(ctx, dloss, *_):
    saved = ctx.saved_tensors
    grads = [g * dloss.to(g.dtype) if need else None for g, need in zip(saved, ctx.needs)]
    flat = _no_double_backward("linear_cross_entropy", (dloss, *saved), grads)
    dx, dweight, dbias = flat
    return dx, dweight, None, dbias, *([None] * 9)


_fused.register_autograd(_backward, setup_context=_setup)

#: The fused op, by its name in the ``xpkernels`` namespace.
FUSED = "linear_cross_entropy_fused"


def record(fn: str, arrays: dict, opts: dict):
    """The autograd front of ``linear_cross_entropy``: reduced losses through the fused op,
    ``reduction="none"`` through the generated one (see the module docstring)."""
    if opts.get("reduction", "mean") == "none" or opts.get("checkpoints") is not None:
        return _GENERATED(fn, arrays, opts)
    # Checked by their declared rules, which leave a float traced by torch.compile (maybe
    # symbolic) to the op's implementation to check at run time.
    checked = [
        RULES[o.rule].encode(fn, o.name, opts.get(o.name, o.default), [])[0] for o in _OPTIONS
    ]
    x, weight, bias = (primal(arrays.get(n)) for n in ("x", "weight", "bias"))
    grad = torch.is_grad_enabled()

    def needs(t) -> bool:
        return grad and isinstance(t, Tensor) and t.requires_grad

    loss, *_ = _fused(
        x,
        weight,
        arrays["targets"],
        bias,
        *checked,
        needs(x),
        needs(weight),
        needs(bias),
        backend_choice(opts),
    )
    return loss
