"""What the ``xpkernels`` torch.library ops share, and the little of them that is irregular.

The ops themselves are generated, every one of them, from the primitives'
declared signatures by :mod:`xpkernels.torch._declared`. This module holds
the pieces they share -- op names, the double-backward guard, the
checkpoints record -- and the two parts a declaration does not say:

- a forward-only primitive (one whose backward reads nothing: decode
  attention) has a ``p_backward`` op that raises, with a message saying
  what to do instead (:data:`xpkernels._autograd.NO_BACKWARD`);
- the merge of attention states (kind ``"merge"``) differentiates its ``m``
  and ``l`` outputs through the log-sum-exp ``lse = m + log l``, which its
  in-place backward takes as ``dlse`` arguments: :func:`merge_backward_`
  turns the cotangents of ``(o, m, l)`` into that form and back, and
  :func:`merge_setup` refuses states whose ``m`` and ``l`` would lose a
  gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..buffers import Checkpoints, Duplicated, record_forward
from ..merge_attention_states import merge_attention_states_backward_

__all__ = ["merge_backward_", "merge_setup"]

_NAMESPACE = "xpkernels"


def _name(op: str) -> str:
    return f"{_NAMESPACE}::{op}"


def _no_double_backward(op: str, inputs, grads):
    """``grads`` as they are, or -- under ``create_graph=True`` -- aliases whose backward raises."""
    if not torch.is_grad_enabled():
        return grads
    if not any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        return grads
    present = [i for i, g in enumerate(grads) if isinstance(g, Tensor)]
    error = torch._C._functions.DelayedError(
        f"xpkernels.{op}: double backward (a backward through create_graph=True gradients) is "
        "not supported: xpkernels' backward kernels are not themselves differentiable".encode(),
        len(present),
    )
    aliased = error(*[grads[i].detach().requires_grad_() for i in present])
    if isinstance(aliased, Tensor):
        aliased = (aliased,)
    out = list(grads)
    for i, g in zip(present, aliased):
        out[i] = g
    return tuple(out)


def _last_axis_contiguous(t: Tensor) -> Tensor:
    """Autograd may hand a broadcast cotangent (stride 0): give the kernels a stride-1 last axis."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _written(checkpoints, forward: str):
    """Checkpoints rebuilt from an op's tensors, recorded as written by ``forward``.

    A checkpoint tensor carries no record of its forward's options; an op
    backward receives them as its own arguments instead -- for the
    functional ops from autograd, which saved the forward's options with
    its checkpoints -- so no option is recorded here for the front to
    compare.
    """
    if isinstance(checkpoints, Checkpoints):
        record_forward(checkpoints, forward, {})
    return checkpoints


def merge_setup(inputs: dict) -> None:
    """Refuse a merge whose ``o`` side requires grad while its ``m`` and ``l`` do not.

    The gradient of a merged state reaches a side's ``m`` and ``l`` too;
    when they do not require grad (the checkpoints of
    ``torch.ops.xpkernels.attention`` are not differentiable) that part
    would be lost silently.
    """
    for side in ("a", "b"):
        o_s, m_s, l_s = (inputs[f"{n}_{side}"] for n in ("o", "m", "l"))
        if o_s.requires_grad and not (m_s.requires_grad or l_s.requires_grad):
            raise RuntimeError(
                f"xpkernels.merge_attention_states: o_{side} requires grad but m_{side} and "
                f"l_{side} do not, so the merge's gradient through them would be lost (the "
                "checkpoints returned by torch.ops.xpkernels.attention are not differentiable). "
                "Merge under torch.no_grad() and run the backward yourself "
                "(merge_attention_states_backward_, then attention_backward_ on each part with "
                "the merged checkpoints), or give states whose m and l require grad"
            )


def merge_backward_(a: dict, backend) -> None:
    """The merge's backward from the cotangents of ``(o, m, l)`` into the gradients of both states.

    ``a`` maps the op's parameter names to tensors: cotangents ``do``,
    ``dm``, ``dl``, the primals the backward reads and the gradient buffers
    ``do_a``, ``dm_a``, ``dl_a``, ``do_b``, ``dm_b``, ``dl_b`` (overwritten).
    With ``l = exp(lse - m)``: ``dm dm_merged + dl dl_merged = (dm - l dl)
    d(max(m_a, m_b)) + l dl dlse`` (module docstring of
    :mod:`xpkernels.merge_attention_states`), so the in-place backward gets
    ``dlse = l dl`` and writes ``dlse_a``, ``dlse_b`` into ``dm_a``, ``dm_b``;
    ``dl_a = dlse_a / l_a`` (0 where ``l_a = 0``), and ``dm - l dl`` goes to
    ``dm`` of the side holding the max (side a on a tie).
    """
    dlse = a["l"] * a["dl"]
    merge_attention_states_backward_(
        Duplicated(a["o"], a["do"]),
        a["m"],
        a["l"],
        Duplicated(a["o_a"], a["do_a"]),
        a["m_a"],
        a["l_a"],
        Duplicated(a["o_b"], a["do_b"]),
        a["m_b"],
        a["l_b"],
        dlse_a=a["dm_a"],
        dlse_b=a["dm_b"],
        dlse=dlse,
        backend=backend,
    )
    at_max = a["dm"] - dlse
    side_a = a["m_a"] >= a["m_b"]
    for side, kept in (("a", side_a), ("b", ~side_a)):
        l_side, dm_side = a[f"l_{side}"], a[f"dm_{side}"]
        positive = l_side > 0
        a[f"dl_{side}"].copy_(
            torch.where(positive, dm_side / torch.where(positive, l_side, 1.0), 0.0)
        )
        dm_side.add_(torch.where(kept, at_max, 0.0))
