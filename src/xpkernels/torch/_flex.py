"""The ``xpkernels`` torch ops of FlexAttention (:mod:`xpkernels.flex_attention`).

As :mod:`xpkernels.torch._ops` for the other primitives. The mods are Python
objects, which an op schema cannot carry: :func:`register_flex` files them
under an integer key, and the ops receive that key plus the score mod's
captured float arrays as a tensor list (so those arrays -- ``nn.Parameter``
tables, slopes, projections -- get gradients through autograd).
``xpkernels::flex_attention_`` (out variant), ``xpkernels::flex_attention``
(functional, ``(o, m, l)``), ``xpkernels::flex_attention_backward_`` and
``xpkernels::flex_attention_backward``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
import weakref

import torch
from torch import Tensor

from ..attention import AttentionCheckpoints
from ..buffers import Duplicated, allocate_checkpoints, grad_shadow
from ..flex_attention import flex_attention_, flex_attention_backward_
from ..mods import FLOAT, Graph, as_mask_mod, as_score_mod
from ._ops import (
    _attention_rows,
    _checkpoints_not_differentiable,
    _input_pos,
    _last_axis_contiguous,
    _name,
    _no_double_backward,
    _written,
)

__all__ = ["OPS", "FlexMods", "register_flex", "flex_mods", "score_arrays"]


def score_arrays(score_mod) -> list:
    """The float arrays a score mod (or None) captures, in slot order: the flex ops' ``score_arrays``."""
    if score_mod is None:
        return []
    return [s.array for s in as_score_mod(score_mod).graph.slots if s.kind == FLOAT]


class FlexMods:
    """The Python half of a flex call: mods, block mask and which captured arrays are op inputs.

    Parameters
    ----------
    score_mod : ScoreMod or callable, optional
    mask_mod : MaskMod or callable, optional
    block_mask : BlockMask, optional
    block_sparse : bool

    Attributes
    ----------
    float_slots : tuple of int
        Indices of the score graph's captured FLOAT arrays: they travel as
        the ops' ``score_arrays`` (and receive gradients); other captured
        arrays stay with the mod.
    """

    def __init__(self, score_mod, mask_mod, block_mask, block_sparse):
        self.score_mod = None if score_mod is None else as_score_mod(score_mod)
        self.mask_mod = None if mask_mod is None else as_mask_mod(mask_mod)
        self.block_mask = block_mask
        self.block_sparse = block_sparse
        slots = () if self.score_mod is None else self.score_mod.graph.slots
        self.float_slots = tuple(i for i, s in enumerate(slots) if s.kind == FLOAT)

    def arrays(self) -> list:
        """The captured float arrays of the score mod, in slot order."""
        return score_arrays(self.score_mod)

    def bound(self, arrays):
        """The score mod reading ``arrays`` in place of its captured float arrays."""
        if self.score_mod is None:
            return None
        graph = self.score_mod.graph
        slots = list(graph.slots)
        for i, a in zip(self.float_slots, arrays):
            slots[i] = dataclasses.replace(slots[i], array=a)
        mod = copy.copy(self.score_mod)
        mod.graph = Graph(graph.nodes, graph.output, slots)
        return mod

    def options(self, arrays) -> dict:
        """Keyword arguments of the flex fronts, the score mod bound to ``arrays``."""
        return {
            "score_mod": self.bound(arrays),
            "mask_mod": self.mask_mod,
            "block_mask": self.block_mask,
            "block_sparse": self.block_sparse,
        }


_FLEX: weakref.WeakValueDictionary[int, FlexMods] = weakref.WeakValueDictionary()
_FLEX_KEEP: dict[int, FlexMods] = {}
_FLEX_KEYS = itertools.count()
_FLEX_LOCK = threading.Lock()


def register_flex(mods: FlexMods, *, keep: bool = False) -> int:
    """File ``mods`` under a new integer key for the flex ops.

    The entry lives as long as ``mods`` does (the autograd graph of a call
    holds it), or for the life of the process with ``keep=True`` (a
    compiled graph bakes the key in).
    """
    with _FLEX_LOCK:
        key = next(_FLEX_KEYS)
        _FLEX[key] = mods
        if keep:
            _FLEX_KEEP[key] = mods
    return key


def flex_mods(key: int) -> FlexMods:
    """The mods filed under ``key``; RuntimeError once they are gone."""
    mods = _FLEX.get(key)
    if mods is None:
        raise RuntimeError(
            f"xpkernels::flex_attention: no mods are filed under key {key} (the call that "
            "registered them has been released); call xpkernels.flex_attention again"
        )
    return mods


@torch.library.custom_op(_name("flex_attention_"), mutates_args=("o", "m", "l"))
def flex_attention_out(
    o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    m: Tensor | None,
    l: Tensor | None,
    score_arrays: list[Tensor],
    mods: int,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``flex_attention_`` into ``o`` (and ``m``, ``l`` when given), mods filed under ``mods``."""
    with torch.no_grad():
        checkpoints = None if m is None else AttentionCheckpoints(m=m, l=l)
        flex_attention_(
            o,
            q,
            k,
            v,
            **flex_mods(mods).options(score_arrays),
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            checkpoints=checkpoints,
            backend=backend,
        )


@flex_attention_out.register_fake
def _(o, q, k, v, m, l, score_arrays, mods, scale, input_pos, input_pos_array, backend):
    return None


@torch.library.custom_op(_name("flex_attention"), mutates_args=())
def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_arrays: list[Tensor],
    mods: int,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlexAttention forward: ``(o, m, l)``; ``score_arrays`` replace the score mod's float arrays."""
    with torch.no_grad():
        o, _ = _attention_rows(q, v)
        checkpoints = allocate_checkpoints(flex_attention_, q, k, v)
        flex_attention_(
            o,
            q,
            k,
            v,
            **flex_mods(mods).options(score_arrays),
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            checkpoints=checkpoints,
            backend=backend,
        )
    return o, checkpoints.m, checkpoints.l


@flex_attention.register_fake
def _(q, k, v, score_arrays, mods, scale, input_pos, input_pos_array, backend):
    o, m = _attention_rows(q, v)
    return o, m, torch.empty_like(m)


def _score_grads(mod, arrays):
    """Zeroed accumulators for ``arrays`` (the bound mod's float slots) and the ScoreModGrad tree."""
    tree = grad_shadow(mod, feature_grads=True)
    slots = [s for s in mod.graph.slots if s.kind == FLOAT]
    return tree, [tree.lookup(s.path, s.field) for s in slots]


@torch.library.custom_op(
    _name("flex_attention_backward_"), mutates_args=("dq", "dk", "dv", "score_grads")
)
def flex_attention_backward_out(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    score_arrays: list[Tensor],
    score_grads: list[Tensor],
    mods: int,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``flex_attention_backward_``: ``dq``, ``dk``, ``dv``, and the score arrays' gradients.

    ``score_grads`` (one per ``score_arrays`` entry, its shape, any float
    dtype) are OVERWRITTEN with the gradients, like the other shadows.
    """
    with torch.no_grad():
        grads = _flex_backward(
            do,
            q,
            k,
            v,
            o,
            m,
            l,
            dq,
            dk,
            dv,
            score_arrays,
            mods,
            scale,
            input_pos,
            input_pos_array,
            backend,
        )
        for out, g in zip(score_grads, grads):
            out.copy_(g)


@flex_attention_backward_out.register_fake
def _(
    do,
    q,
    k,
    v,
    o,
    m,
    l,
    dq,
    dk,
    dv,
    score_arrays,
    score_grads,
    mods,
    scale,
    input_pos,
    input_pos_array,
    backend,
):
    return None


def _flex_backward(
    do, q, k, v, o, m, l, dq, dk, dv, score_arrays, mods, scale, input_pos, input_pos_array, backend
):
    options = flex_mods(mods).options(score_arrays)
    tree = accumulators = None
    if score_arrays:
        tree, accumulators = _score_grads(options["score_mod"], score_arrays)
    flex_attention_backward_(
        Duplicated(o, do),
        Duplicated(q, dq),
        Duplicated(k, dk),
        Duplicated(v, dv),
        checkpoints=_written(AttentionCheckpoints(m=m, l=l), "flex_attention_"),
        score_mod_grad=tree,
        **options,
        scale=scale,
        input_pos=_input_pos(input_pos, input_pos_array),
        backend=backend,
    )
    return accumulators or []


@torch.library.custom_op(_name("flex_attention_backward"), mutates_args=())
def flex_attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    score_arrays: list[Tensor],
    mods: int,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """FlexAttention backward: ``(dq, dk, dv, score_grads)``, one score grad per score array."""
    with torch.no_grad():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grads = _flex_backward(
            do,
            q,
            k,
            v,
            o,
            m,
            l,
            dq,
            dk,
            dv,
            score_arrays,
            mods,
            scale,
            input_pos,
            input_pos_array,
            backend,
        )
        score_grads = [g.to(a.dtype) for g, a in zip(grads, score_arrays)]
    return dq, dk, dv, score_grads


@flex_attention_backward.register_fake
def _(do, q, k, v, o, m, l, score_arrays, mods, scale, input_pos, input_pos_array, backend):
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        [torch.empty_like(a) for a in score_arrays],
    )


def _flex_setup(ctx, inputs, output):
    q, k, v, score_arrays, mods, scale, input_pos, input_pos_array, backend = inputs
    o, m, l = output
    ctx.save_for_backward(q, k, v, o, m, l, input_pos_array, *score_arrays)
    ctx.mods = flex_mods(mods)  # keeps the filed mods alive as long as this graph
    ctx.options = (mods, scale, input_pos, backend)
    _checkpoints_not_differentiable(ctx, m, l)


def _flex_grad(ctx, do, _dm, _dl):
    q, k, v, o, m, l, input_pos_array, *score_arrays = ctx.saved_tensors
    mods, scale, input_pos, backend = ctx.options
    dq, dk, dv, score_grads = torch.ops.xpkernels.flex_attention_backward(
        _last_axis_contiguous(do),
        q,
        k,
        v,
        o,
        m,
        l,
        score_arrays,
        mods,
        scale,
        input_pos,
        input_pos_array,
        backend,
    )
    grads = _no_double_backward(
        "flex_attention", (do, q, k, v, *score_arrays), (dq, dk, dv, *score_grads)
    )
    return (*grads[:3], list(grads[3:]), None, None, None, None, None)


flex_attention.register_autograd(_flex_grad, setup_context=_flex_setup)


#: The ops registered here, by their names in the ``xpkernels`` namespace.
OPS = (
    "flex_attention",
    "flex_attention_",
    "flex_attention_backward",
    "flex_attention_backward_",
)
