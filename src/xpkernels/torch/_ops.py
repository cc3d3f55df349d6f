"""The ``xpkernels`` namespace of ``torch.library`` custom ops.

Per primitive ``p``, and mirroring the Python fronts:

- ``xpkernels::p_`` -- the out variant: writes caller buffers (exactly the
  ones named in ``mutates_args``), returns nothing;
- ``xpkernels::p`` -- the functional forward: returns the output AND the
  checkpoints (``rstd``; ``mean, rstd``; ``m, l``) as tensors, so autograd
  saves them for the backward instead of recomputing anything;
- ``xpkernels::p_backward_`` / ``xpkernels::p_backward`` -- the backward,
  out variant and functional.

Every op has a ``register_fake`` (shapes and dtypes only), so
``torch.compile`` and ``torch.export`` see through it without running a
kernel; every functional forward has a ``register_autograd`` whose backward
calls the functional backward op (xpkernels' own backward kernels, on
whichever backend the forward used). Implementations call the in-place
fronts under ``torch.no_grad()``, so all validation of the fronts applies and
no backend records autograd through its own arithmetic. A backward run with
``create_graph=True`` returns gradients whose own backward raises "double
backward is not supported".

The functional ops the Triton backend serves are defined through
:func:`xpkernels.torch._triton.functional_op`: each also has a
``torch.library.triton_op`` twin ``xpkernels::p_triton``, which
``torch.compile`` traces into on CUDA (the graph holds the Triton kernels).

The flex attention ops are in :mod:`xpkernels.torch._flex`, the packed
(varlen) ops in :mod:`xpkernels.torch._varlen` and
:mod:`xpkernels.torch._flex_varlen`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention import AttentionCheckpoints, attention_, attention_backward_
from ..buffers import Checkpoints, Duplicated, allocate_checkpoints, record_forward
from ..decode_attention import DecodeAttentionScratch, decode_attention_
from ..merge_attention_states import merge_attention_states_, merge_attention_states_backward_
from ._triton import functional_op

__all__ = ["OPS"]

_NAMESPACE = "xpkernels"


def _name(op: str) -> str:
    return f"{_NAMESPACE}::{op}"


def _rows(x: Tensor) -> int:
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return rows


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


def _checkpoints_not_differentiable(ctx, *checkpoints) -> None:
    """Mark a functional forward's checkpoint outputs as not differentiable.

    The forwards return their checkpoints (``rstd``; ``mean, rstd``; ``m, l``)
    so that autograd saves them; xpkernels' backward differentiates the first
    output only. Marked, they have ``requires_grad=False``, as torch marks the
    indices of ``max``: no gradient can flow into them and be dropped.
    """
    ctx.mark_non_differentiable(*checkpoints)


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


def _input_pos(input_pos: int, input_pos_array: Tensor | None):
    return input_pos if input_pos_array is None else input_pos_array


# --------------------------------------------------------------------------- attention


def _attention_rows(q: Tensor, v: Tensor):
    o = q.new_empty((*q.shape[:3], v.shape[3]))
    return o, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(_name("attention_"), mutates_args=("o", "m", "l"))
def attention_out(
    o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    m: Tensor | None,
    l: Tensor | None,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    q_lengths: Tensor | None,
    k_lengths: Tensor | None,
    backend: str | None,
) -> None:
    """``attention_`` into ``o`` (and the checkpoints ``m``, ``l`` when given, both or neither)."""
    with torch.no_grad():
        checkpoints = None if m is None else AttentionCheckpoints(m=m, l=l)
        attention_(
            o,
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            q_lengths=q_lengths,
            k_lengths=k_lengths,
            checkpoints=checkpoints,
            backend=backend,
        )


@attention_out.register_fake
def _(o, q, k, v, m, l, causal, scale, input_pos, input_pos_array, q_lengths, k_lengths, backend):
    return None


@functional_op("attention")
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    q_lengths: Tensor | None,
    k_lengths: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward: ``(o, m, l)``."""
    with torch.no_grad():
        o, _ = _attention_rows(q, v)
        checkpoints = allocate_checkpoints(attention_, q, k, v)
        attention_(
            o,
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            q_lengths=q_lengths,
            k_lengths=k_lengths,
            checkpoints=checkpoints,
            backend=backend,
        )
    return o, checkpoints.m, checkpoints.l


@attention.register_fake
def _(q, k, v, causal, scale, input_pos, input_pos_array, q_lengths, k_lengths, backend):
    o, m = _attention_rows(q, v)
    return o, m, torch.empty_like(m)


@torch.library.custom_op(
    _name("attention_backward_"), mutates_args=("dq", "dk", "dv", "delta", "dq_accum")
)
def attention_backward_out(
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
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    q_lengths: Tensor | None,
    k_lengths: Tensor | None,
    backend: str | None,
) -> None:
    """``attention_backward_`` into ``dq``, ``dk``, ``dv`` (scratch ``delta``, ``dq_accum`` optional)."""
    from ..attention import AttentionBackwardScratch

    with torch.no_grad():
        scratch = None
        if delta is not None:
            scratch = AttentionBackwardScratch(delta=delta, dq_accum=dq_accum)
        attention_backward_(
            Duplicated(o, do),
            Duplicated(q, dq),
            Duplicated(k, dk),
            Duplicated(v, dv),
            checkpoints=_written(AttentionCheckpoints(m=m, l=l), "attention_"),
            scratch=scratch,
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            q_lengths=q_lengths,
            k_lengths=k_lengths,
            backend=backend,
        )


@attention_backward_out.register_fake
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
    delta,
    dq_accum,
    causal,
    scale,
    input_pos,
    input_pos_array,
    q_lengths,
    k_lengths,
    backend,
):
    return None


@functional_op("attention_backward")
def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    causal: bool,
    scale: float | None,
    input_pos: int,
    input_pos_array: Tensor | None,
    q_lengths: Tensor | None,
    k_lengths: Tensor | None,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward: ``(dq, dk, dv)``."""
    with torch.no_grad():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        attention_backward_(
            Duplicated(o, do),
            Duplicated(q, dq),
            Duplicated(k, dk),
            Duplicated(v, dv),
            checkpoints=_written(AttentionCheckpoints(m=m, l=l), "attention_"),
            causal=causal,
            scale=scale,
            input_pos=_input_pos(input_pos, input_pos_array),
            q_lengths=q_lengths,
            k_lengths=k_lengths,
            backend=backend,
        )
    return dq, dk, dv


@attention_backward.register_fake
def _(
    do, q, k, v, o, m, l, causal, scale, input_pos, input_pos_array, q_lengths, k_lengths, backend
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, input_pos, input_pos_array, q_lengths, k_lengths, backend = inputs
    o, m, l = output
    ctx.save_for_backward(q, k, v, o, m, l, input_pos_array, q_lengths, k_lengths)
    ctx.options = (causal, scale, input_pos, backend)
    _checkpoints_not_differentiable(ctx, m, l)


def _attention_grad(ctx, do, _dm, _dl):
    q, k, v, o, m, l, input_pos_array, q_lengths, k_lengths = ctx.saved_tensors
    causal, scale, input_pos, backend = ctx.options
    dq, dk, dv = torch.ops.xpkernels.attention_backward(
        _last_axis_contiguous(do),
        q,
        k,
        v,
        o,
        m,
        l,
        causal,
        scale,
        input_pos,
        input_pos_array,
        q_lengths,
        k_lengths,
        backend,
    )
    dq, dk, dv = _no_double_backward("attention", (do, q, k, v), (dq, dk, dv))
    return dq, dk, dv, None, None, None, None, None, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


# --------------------------------------------------------------------------- decode_attention


@torch.library.custom_op(
    _name("decode_attention_"), mutates_args=("o", "o_partial", "m_partial", "l_partial")
)
def decode_attention_out(
    o: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    block_table: Tensor | None,
    o_partial: Tensor | None,
    m_partial: Tensor | None,
    l_partial: Tensor | None,
    scale: float | None,
    softcap: float | None,
    window: int | None,
    n_splits: int | None,
    backend: str | None,
) -> None:
    """``decode_attention_`` into ``o`` (through the caller's scratch when given, all three or none).

    With ``block_table``, ``k_cache`` and ``v_cache`` are the pages of a paged cache.
    """
    with torch.no_grad():
        scratch = None
        if o_partial is not None:
            scratch = DecodeAttentionScratch(o_partial, m_partial, l_partial)
        decode_attention_(
            o,
            q,
            k_cache,
            v_cache,
            lengths,
            block_table=block_table,
            scale=scale,
            softcap=softcap,
            window=window,
            scratch=scratch,
            n_splits=n_splits,
            backend=backend,
        )


@decode_attention_out.register_fake
def _(
    o,
    q,
    k_cache,
    v_cache,
    lengths,
    block_table,
    o_partial,
    m_partial,
    l_partial,
    scale,
    softcap,
    window,
    n_splits,
    backend,
):
    return None


@functional_op("decode_attention")
def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    block_table: Tensor | None,
    scale: float | None,
    softcap: float | None,
    window: int | None,
    n_splits: int | None,
    backend: str | None,
) -> Tensor:
    """Decode attention (forward only): ``o (B, H, Dv)``; pages in ``k_cache``/``v_cache`` with ``block_table``."""
    with torch.no_grad():
        o = q.new_empty((*q.shape[:2], v_cache.shape[3]))
        decode_attention_(
            o,
            q,
            k_cache,
            v_cache,
            lengths,
            block_table=block_table,
            scale=scale,
            softcap=softcap,
            window=window,
            n_splits=n_splits,
            backend=backend,
        )
    return o


@decode_attention.register_fake
def _(q, k_cache, v_cache, lengths, block_table, scale, softcap, window, n_splits, backend):
    return q.new_empty((*q.shape[:2], v_cache.shape[3]))


_DECODE_NO_BACKWARD = (
    "xpkernels.decode_attention has no backward (it is the forward-only kernel for "
    "generation): run it under torch.no_grad(), or train with xpkernels.attention(q, k, v, "
    "causal=True, input_pos=...), whose backward xpkernels provides"
)


@torch.library.custom_op(_name("decode_attention_backward"), mutates_args=())
def decode_attention_backward(
    do: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Raises: decode attention is forward only.

    An op rather than an exception in the autograd formula, so that
    ``torch.compile`` can trace a graph holding ``decode_attention`` (with
    its fake implementation) and the error comes when a backward really
    runs through it.
    """
    raise RuntimeError(_DECODE_NO_BACKWARD)


@decode_attention_backward.register_fake
def _(do, q, k_cache, v_cache):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def _decode_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])


def _decode_grad(ctx, do):
    q, k_cache, v_cache = ctx.saved_tensors
    dq, dk, dv = torch.ops.xpkernels.decode_attention_backward(do, q, k_cache, v_cache)
    return dq, dk, dv, None, None, None, None, None, None, None


decode_attention.register_autograd(_decode_grad, setup_context=_decode_setup)


# --------------------------------------------------------------------------- merge_attention_states


@torch.library.custom_op(_name("merge_attention_states_"), mutates_args=("o", "m", "l"))
def merge_attention_states_out(
    o: Tensor,
    m: Tensor,
    l: Tensor,
    o_a: Tensor,
    m_a: Tensor,
    l_a: Tensor,
    o_b: Tensor,
    m_b: Tensor,
    l_b: Tensor,
    backend: str | None,
) -> None:
    """``merge_attention_states_`` into ``o``, ``m``, ``l``."""
    with torch.no_grad():
        merge_attention_states_(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, backend=backend)


@merge_attention_states_out.register_fake
def _(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, backend):
    return None


@functional_op("merge_attention_states")
def merge_attention_states(
    o_a: Tensor,
    m_a: Tensor,
    l_a: Tensor,
    o_b: Tensor,
    m_b: Tensor,
    l_b: Tensor,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The merge of two attention states: ``(o, m, l)``."""
    with torch.no_grad():
        o, m, l = torch.empty_like(o_a), torch.empty_like(m_a), torch.empty_like(m_a)
        merge_attention_states_(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, backend=backend)
    return o, m, l


@merge_attention_states.register_fake
def _(o_a, m_a, l_a, o_b, m_b, l_b, backend):
    return torch.empty_like(o_a), torch.empty_like(m_a), torch.empty_like(m_a)


@torch.library.custom_op(
    _name("merge_attention_states_backward_"), mutates_args=("do_a", "do_b", "dlse_a", "dlse_b")
)
def merge_attention_states_backward_out(
    do: Tensor,
    dlse: Tensor | None,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    o_a: Tensor,
    m_a: Tensor,
    l_a: Tensor,
    o_b: Tensor,
    m_b: Tensor,
    l_b: Tensor,
    do_a: Tensor,
    do_b: Tensor,
    dlse_a: Tensor,
    dlse_b: Tensor,
    backend: str | None,
) -> None:
    """``merge_attention_states_backward_`` into ``do_a``, ``do_b``, ``dlse_a``, ``dlse_b``."""
    with torch.no_grad():
        merge_attention_states_backward_(
            Duplicated(o, do),
            m,
            l,
            Duplicated(o_a, do_a),
            m_a,
            l_a,
            Duplicated(o_b, do_b),
            m_b,
            l_b,
            dlse_a=dlse_a,
            dlse_b=dlse_b,
            dlse=dlse,
            backend=backend,
        )


@merge_attention_states_backward_out.register_fake
def _(do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, do_b, dlse_a, dlse_b, backend):
    return None


@functional_op("merge_attention_states_backward")
def merge_attention_states_backward(
    do: Tensor,
    dlse: Tensor | None,
    o: Tensor,
    m: Tensor,
    l: Tensor,
    o_a: Tensor,
    m_a: Tensor,
    l_a: Tensor,
    o_b: Tensor,
    m_b: Tensor,
    l_b: Tensor,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Merge backward: ``(do_a, do_b, dlse_a, dlse_b)``."""
    with torch.no_grad():
        do_a, do_b = torch.empty_like(o_a), torch.empty_like(o_b)
        dlse_a, dlse_b = torch.empty_like(m_a), torch.empty_like(m_a)
        merge_attention_states_backward_(
            Duplicated(o, do),
            m,
            l,
            Duplicated(o_a, do_a),
            m_a,
            l_a,
            Duplicated(o_b, do_b),
            m_b,
            l_b,
            dlse_a=dlse_a,
            dlse_b=dlse_b,
            dlse=dlse,
            backend=backend,
        )
    return do_a, do_b, dlse_a, dlse_b


@merge_attention_states_backward.register_fake
def _(do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, backend):
    return (
        torch.empty_like(o_a),
        torch.empty_like(o_b),
        torch.empty_like(m_a),
        torch.empty_like(m_a),
    )


def _merge_setup(ctx, inputs, output):
    o_a, m_a, l_a, o_b, m_b, l_b, backend = inputs
    for side, (o_s, m_s, l_s) in (("a", (o_a, m_a, l_a)), ("b", (o_b, m_b, l_b))):
        if o_s.requires_grad and not (m_s.requires_grad or l_s.requires_grad):
            raise RuntimeError(
                f"xpkernels.merge_attention_states: o_{side} requires grad but m_{side} and "
                f"l_{side} do not, so the merge's gradient through them would be lost (the "
                "checkpoints returned by torch.ops.xpkernels.attention are not differentiable). "
                "Merge under torch.no_grad() and run the backward yourself "
                "(merge_attention_states_backward_, then attention_backward_ on each part with "
                "the merged checkpoints), or give states whose m and l require grad"
            )
    ctx.save_for_backward(o_a, m_a, l_a, o_b, m_b, l_b, *output)
    ctx.backend = backend


def _merge_grad(ctx, do, dm, dl):
    """Cotangents ``(do, dm, dl)`` of the merged ``(o, m, l)`` to those of both states.

    With ``l = exp(lse - m)``: ``dm dm_merged + dl dl_merged = (dm - l dl) d(max(m_a, m_b))
    + l dl dlse`` (module docstring of :mod:`xpkernels.merge_attention_states`), so the
    backward gets ``dlse = l dl``; ``dm - l dl`` goes to ``dm`` of the side holding the max
    (side a on a tie). Then ``dm_a = dlse_a`` (+ that term) and ``dl_a = dlse_a / l_a``
    (0 where ``l_a = 0``).
    """
    o_a, m_a, l_a, o_b, m_b, l_b, o, m, l = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else _last_axis_contiguous(do)
    dlse = None if dl is None else l * dl
    do_a, do_b, dlse_a, dlse_b = torch.ops.xpkernels.merge_attention_states_backward(
        do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, ctx.backend
    )
    dm_a, dm_b = dlse_a, dlse_b
    if dm is not None or dl is not None:
        at_max = dm if dm is not None else torch.zeros_like(m)
        if dlse is not None:
            at_max = at_max - dlse
        side_a = m_a >= m_b
        dm_a = dm_a + torch.where(side_a, at_max, 0.0)
        dm_b = dm_b + torch.where(side_a, 0.0, at_max)

    def per_l(dlse_side, l_side):
        positive = l_side > 0
        return torch.where(positive, dlse_side / torch.where(positive, l_side, 1.0), 0.0)

    grads = (do_a, dm_a, per_l(dlse_a, l_a), do_b, dm_b, per_l(dlse_b, l_b))
    grads = _no_double_backward("merge_attention_states", (do, o_a, m_a, l_a, o_b, m_b, l_b), grads)
    return (*grads, None)


merge_attention_states.register_autograd(_merge_grad, setup_context=_merge_setup)


#: Every op registered here, by its name in the ``xpkernels`` namespace.
OPS = tuple(
    sorted(
        op._qualname.split("::", 1)[1]
        for op in list(globals().values())
        if isinstance(op, torch._library.custom_ops.CustomOpDef)
    )
)
