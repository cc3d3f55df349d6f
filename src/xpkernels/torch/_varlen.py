"""The ``xpkernels`` torch ops of packed variable-length attention (:mod:`xpkernels.attention_varlen`).

As :mod:`xpkernels.torch._ops` for attention: ``xpkernels::attention_varlen_``
(out variant), ``xpkernels::attention_varlen`` (functional, returns ``(o, m,
l)``, with a Triton twin on CUDA), ``xpkernels::attention_varlen_backward_``
and ``xpkernels::attention_varlen_backward``; fakes for each and the
autograd formula of the functional forward through xpkernels' backward.
``max_seqlen_q``/``max_seqlen_k`` are ints or None (None: the op derives
them from the prefix sums on the host when it runs); a graph that
``torch.compile`` traces into the Triton kernels on CUDA must be given them,
since tracing reads no tensor values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks as check
from ..attention_varlen import (
    AttentionVarlenBackwardScratch,
    AttentionVarlenCheckpoints,
    attention_varlen_,
    attention_varlen_backward_,
)
from ..buffers import Duplicated, allocate_checkpoints, primal
from ._front_args import _backend, _no_checkpoints, _positions, _scale
from ._ops import (
    _checkpoints_not_differentiable,
    _input_pos,
    _last_axis_contiguous,
    _name,
    _no_double_backward,
    _written,
)
from ._triton import functional_op

__all__ = ["OPS", "front"]


def _rows(q: Tensor, v: Tensor):
    o = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(_name("attention_varlen_"), mutates_args=("o", "m", "l"))
def attention_varlen_out(
    o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    m: Tensor | None,
    l: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``attention_varlen_`` into ``o`` (and the checkpoints ``m``, ``l`` when given, both or neither)."""
    with torch.no_grad():
        attention_varlen_(
            o,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            checkpoints=None if m is None else AttentionVarlenCheckpoints(m=m, l=l),
            backend=backend,
        )


@attention_varlen_out.register_fake
def _(o, q, k, v, m, l, cu_q, cu_k, max_q, max_k, causal, scale, pos, pos_array, backend):
    return None


@functional_op("attention_varlen")
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed varlen attention forward: ``(o, m, l)``."""
    with torch.no_grad():
        o, _ = _rows(q, v)
        checkpoints = allocate_checkpoints(attention_varlen_, q, k, v)
        attention_varlen_(
            o,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            checkpoints=checkpoints,
            backend=backend,
        )
    return o, checkpoints.m, checkpoints.l


@attention_varlen.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, pos, pos_array, backend):
    o, m = _rows(q, v)
    return o, m, torch.empty_like(m)


@torch.library.custom_op(
    _name("attention_varlen_backward_"), mutates_args=("dq", "dk", "dv", "delta", "dq_accum")
)
def attention_varlen_backward_out(
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
    delta: Tensor | None,
    dq_accum: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> None:
    """``attention_varlen_backward_`` into ``dq``, ``dk``, ``dv`` (scratch optional)."""
    with torch.no_grad():
        scratch = None
        if delta is not None:
            scratch = AttentionVarlenBackwardScratch(delta=delta, dq_accum=dq_accum)
        attention_varlen_backward_(
            Duplicated(o, do),
            Duplicated(q, dq),
            Duplicated(k, dk),
            Duplicated(v, dv),
            cu_seqlens_q,
            cu_seqlens_k,
            checkpoints=_written(AttentionVarlenCheckpoints(m=m, l=l), "attention_varlen_"),
            scratch=scratch,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            backend=backend,
        )


@attention_varlen_backward_out.register_fake
def _(do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum, cu_q, cu_k, *options):
    return None


@functional_op("attention_varlen_backward")
def attention_varlen_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed varlen attention backward: ``(dq, dk, dv)``."""
    with torch.no_grad():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        attention_varlen_backward_(
            Duplicated(o, do),
            Duplicated(q, dq),
            Duplicated(k, dk),
            Duplicated(v, dv),
            cu_seqlens_q,
            cu_seqlens_k,
            checkpoints=_written(AttentionVarlenCheckpoints(m=m, l=l), "attention_varlen_"),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            backend=backend,
        )
    return dq, dk, dv


@attention_varlen_backward.register_fake
def _(do, q, k, v, o, m, l, cu_q, cu_k, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, input_pos, input_pos_array, backend = inputs
    o, m, l = output
    ctx.save_for_backward(q, k, v, o, m, l, cu_q, cu_k, input_pos_array)
    ctx.options = (max_q, max_k, causal, scale, input_pos, backend)
    _checkpoints_not_differentiable(ctx, m, l)


def _grad(ctx, do, _dm, _dl):
    q, k, v, o, m, l, cu_q, cu_k, input_pos_array = ctx.saved_tensors
    max_q, max_k, causal, scale, input_pos, backend = ctx.options
    dq, dk, dv = torch.ops.xpkernels.attention_varlen_backward(
        _last_axis_contiguous(do),
        q,
        k,
        v,
        o,
        m,
        l,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal,
        scale,
        input_pos,
        input_pos_array,
        backend,
    )
    dq, dk, dv = _no_double_backward("attention_varlen", (do, q, k, v), (dq, dk, dv))
    return (dq, dk, dv, *([None] * 9))


attention_varlen.register_autograd(_grad, setup_context=_setup)


def _max_seqlen(fn, name, value):
    return None if value is None else check.index_int(fn, name, value, 0)


def front(fn, arrays, options):
    """The allocating front on tensors that need gradients: a call of ``xpkernels::attention_varlen``."""
    _no_checkpoints(fn, options)
    causal = options["causal"]
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    q, k, v = (primal(arrays[n]) for n in ("q", "k", "v"))
    cu_q, cu_k = options["cu_seqlens_q"], options["cu_seqlens_k"]
    input_pos, input_pos_array = _positions(fn, options["input_pos"])
    o, _, _ = torch.ops.xpkernels.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        _max_seqlen(fn, "max_seqlen_q", options["max_seqlen_q"]),
        _max_seqlen(fn, "max_seqlen_k", options["max_seqlen_k"]),
        causal,
        _scale(fn, options["scale"]),
        input_pos,
        input_pos_array,
        _backend(options),
    )
    return o


#: The ops registered here, by their names in the ``xpkernels`` namespace.
OPS = (
    "attention_varlen",
    "attention_varlen_",
    "attention_varlen_backward",
    "attention_varlen_backward_",
)
