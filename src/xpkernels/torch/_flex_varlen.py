"""The ``xpkernels`` torch ops of packed FlexAttention (:mod:`xpkernels.flex_attention_varlen`).

As the flex ops of :mod:`xpkernels.torch._flex`: the mods travel as an
integer key (:func:`~xpkernels.torch._flex.register_flex`) and the score
mod's captured float arrays as ``score_arrays``, which receive gradients.
``xpkernels::flex_attention_varlen_`` (out variant),
``xpkernels::flex_attention_varlen`` (functional, ``(o, m, l)``),
``xpkernels::flex_attention_varlen_backward_`` and
``xpkernels::flex_attention_varlen_backward``; fakes for each and the
autograd formula of the functional forward through xpkernels' backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention_varlen import AttentionVarlenCheckpoints
from ..buffers import Duplicated, allocate_checkpoints, primal
from ..flex_attention_varlen import flex_attention_varlen_, flex_attention_varlen_backward_
from . import _flex
from ._flex import _score_grads
from ._front_args import _backend, _flex_key, _no_checkpoints, _positions, _scale
from ._ops import (
    _checkpoints_not_differentiable,
    _input_pos,
    _last_axis_contiguous,
    _name,
    _no_double_backward,
    _written,
)
from ._varlen import _max_seqlen

__all__ = ["OPS", "front"]


def _rows(q: Tensor, v: Tensor):
    o = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _options(mods: int, score_arrays, input_pos, input_pos_array, max_q, max_k, scale, backend):
    """Keyword arguments of the packed flex fronts, the score mod bound to ``score_arrays``."""
    filed = _flex.flex_mods(mods)
    return {
        "score_mod": filed.bound(score_arrays),
        "mask_mod": filed.mask_mod,
        "block_sparse": filed.block_sparse,
        "max_seqlen_q": max_q,
        "max_seqlen_k": max_k,
        "scale": scale,
        "input_pos": _input_pos(input_pos, input_pos_array),
        "backend": backend,
    }


@torch.library.custom_op(_name("flex_attention_varlen_"), mutates_args=("o", "m", "l"))
def flex_attention_varlen_out(
    o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    m: Tensor | None,
    l: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    score_arrays: list[Tensor],
    mods: int,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``flex_attention_varlen_`` into ``o`` (and ``m``, ``l`` when given), mods filed under ``mods``."""
    with torch.no_grad():
        flex_attention_varlen_(
            o,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            checkpoints=None if m is None else AttentionVarlenCheckpoints(m=m, l=l),
            **_options(
                mods,
                score_arrays,
                input_pos,
                input_pos_array,
                max_seqlen_q,
                max_seqlen_k,
                scale,
                backend,
            ),
        )


@flex_attention_varlen_out.register_fake
def _(o, q, k, v, m, l, cu_q, cu_k, score_arrays, mods, *options):
    return None


@torch.library.custom_op(_name("flex_attention_varlen"), mutates_args=())
def flex_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    score_arrays: list[Tensor],
    mods: int,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed FlexAttention forward: ``(o, m, l)``; ``score_arrays`` replace the mod's float arrays."""
    with torch.no_grad():
        o, _ = _rows(q, v)
        checkpoints = allocate_checkpoints(flex_attention_varlen_, q, k, v)
        flex_attention_varlen_(
            o,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            checkpoints=checkpoints,
            **_options(
                mods,
                score_arrays,
                input_pos,
                input_pos_array,
                max_seqlen_q,
                max_seqlen_k,
                scale,
                backend,
            ),
        )
    return o, checkpoints.m, checkpoints.l


@flex_attention_varlen.register_fake
def _(q, k, v, cu_q, cu_k, score_arrays, mods, *options):
    o, m = _rows(q, v)
    return o, m, torch.empty_like(m)


def _backward(
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
    cu_q,
    cu_k,
    score_arrays,
    mods,
    max_q,
    max_k,
    scale,
    input_pos,
    input_pos_array,
    backend,
):
    """Run the packed flex backward into ``dq``, ``dk``, ``dv``; returns the score arrays' gradients."""
    options = _options(mods, score_arrays, input_pos, input_pos_array, max_q, max_k, scale, backend)
    tree = accumulators = None
    if score_arrays:
        tree, accumulators = _score_grads(options["score_mod"], score_arrays)
    flex_attention_varlen_backward_(
        Duplicated(o, do),
        Duplicated(q, dq),
        Duplicated(k, dk),
        Duplicated(v, dv),
        cu_q,
        cu_k,
        checkpoints=_written(AttentionVarlenCheckpoints(m=m, l=l), "flex_attention_varlen_"),
        score_mod_grad=tree,
        **options,
    )
    return accumulators or []


@torch.library.custom_op(
    _name("flex_attention_varlen_backward_"), mutates_args=("dq", "dk", "dv", "score_grads")
)
def flex_attention_varlen_backward_out(
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
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    score_arrays: list[Tensor],
    score_grads: list[Tensor],
    mods: int,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``flex_attention_varlen_backward_``: ``dq``, ``dk``, ``dv`` and the score arrays' gradients.

    ``score_grads`` (one per ``score_arrays`` entry, its shape, any float
    dtype) are OVERWRITTEN with the gradients, like the other shadows.
    """
    with torch.no_grad():
        grads = _backward(
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
            cu_seqlens_q,
            cu_seqlens_k,
            score_arrays,
            mods,
            max_seqlen_q,
            max_seqlen_k,
            scale,
            input_pos,
            input_pos_array,
            backend,
        )
        for out, g in zip(score_grads, grads):
            out.copy_(g)


@flex_attention_varlen_backward_out.register_fake
def _(do, q, k, v, o, m, l, dq, dk, dv, cu_q, cu_k, score_arrays, score_grads, mods, *options):
    return None


@torch.library.custom_op(_name("flex_attention_varlen_backward"), mutates_args=())
def flex_attention_varlen_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    score_arrays: list[Tensor],
    mods: int,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Packed FlexAttention backward: ``(dq, dk, dv, score_grads)``, one grad per score array."""
    with torch.no_grad():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grads = _backward(
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
            cu_seqlens_q,
            cu_seqlens_k,
            score_arrays,
            mods,
            max_seqlen_q,
            max_seqlen_k,
            scale,
            input_pos,
            input_pos_array,
            backend,
        )
        score_grads = [g.to(a.dtype) for g, a in zip(grads, score_arrays)]
    return dq, dk, dv, score_grads


@flex_attention_varlen_backward.register_fake
def _(do, q, k, v, o, m, l, cu_q, cu_k, score_arrays, *options):
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        [torch.empty_like(a) for a in score_arrays],
    )


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, score_arrays, mods, max_q, max_k, scale, pos, pos_array, backend = inputs
    o, m, l = output
    ctx.save_for_backward(q, k, v, o, m, l, cu_q, cu_k, pos_array, *score_arrays)
    ctx.mods = _flex.flex_mods(mods)  # keeps the filed mods alive as long as this graph
    ctx.options = (mods, max_q, max_k, scale, pos, backend)
    _checkpoints_not_differentiable(ctx, m, l)


def _grad(ctx, do, _dm, _dl):
    q, k, v, o, m, l, cu_q, cu_k, input_pos_array, *score_arrays = ctx.saved_tensors
    mods, max_q, max_k, scale, input_pos, backend = ctx.options
    dq, dk, dv, score_grads = torch.ops.xpkernels.flex_attention_varlen_backward(
        _last_axis_contiguous(do),
        q,
        k,
        v,
        o,
        m,
        l,
        cu_q,
        cu_k,
        score_arrays,
        mods,
        max_q,
        max_k,
        scale,
        input_pos,
        input_pos_array,
        backend,
    )
    grads = _no_double_backward(
        "flex_attention_varlen", (do, q, k, v, *score_arrays), (dq, dk, dv, *score_grads)
    )
    return (*grads[:3], None, None, list(grads[3:]), *([None] * 7))


flex_attention_varlen.register_autograd(_grad, setup_context=_setup)


def front(fn, arrays, options):
    """The allocating front on tensors that need gradients: a call of ``xpkernels::flex_attention_varlen``."""
    _no_checkpoints(fn, options)
    q, k, v = (primal(arrays[n]) for n in ("q", "k", "v"))
    key, score_arrays, mods = _flex_key(fn, options, None)
    input_pos, input_pos_array = _positions(fn, options["input_pos"])
    o, _, _ = torch.ops.xpkernels.flex_attention_varlen(
        q,
        k,
        v,
        options["cu_seqlens_q"],
        options["cu_seqlens_k"],
        score_arrays,
        key,
        _max_seqlen(fn, "max_seqlen_q", options["max_seqlen_q"]),
        _max_seqlen(fn, "max_seqlen_k", options["max_seqlen_k"]),
        _scale(fn, options["scale"]),
        input_pos,
        input_pos_array,
        _backend(options),
    )
    del mods  # held until the op ran
    return o


#: The ops registered here, by their names in the ``xpkernels`` namespace.
OPS = (
    "flex_attention_varlen",
    "flex_attention_varlen_",
    "flex_attention_varlen_backward",
    "flex_attention_varlen_backward_",
)
