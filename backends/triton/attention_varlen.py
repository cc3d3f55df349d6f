"""Packed variable-length attention on Triton: attention's kernels with ``VARLEN=True``.

The forward, ``delta``, dK/dV and dQ kernels of :mod:`.attention` take a
``VARLEN`` compile-time flag (flash-attn's varlen scheme): the grid is
``(tiles of max_seqlen, B, heads)`` -- 2-D, the sequence and head folded
into the second axis -- and each program loads its sequence's start and
end from the ``(B + 1,)`` prefix sums, in the slots that carry
``q_lengths``/``k_lengths`` otherwise. The packed ``(T, H, D)`` tensors are
passed as ``(1, H, T, D)`` views whose batch stride is the token stride, so
the kernels' batch offset becomes the sequence's first token. Nothing is
read on the host: starts and ends are clamped into ``[0, T]`` in the kernel,
a program stores only the rows of its own sequence, and tiles past a
sequence's length do nothing. ``max_seqlen_q``/``max_seqlen_k`` only size
the grid; rows of a sequence longer than them are not computed (the front
refuses such values where it can read the prefix sums).

Rows of the packed arrays that no sequence covers are only possible with
unchecked prefix sums; they are left unwritten here.
"""

from __future__ import annotations

from ._attention_kernels import _dkdv_kernel, _dq_kernel, _forward_kernel
from ._attn_common import LOG2E, launch, tile_grid
from ._common import launch_context
from .attention import (
    _DQ_TILES,
    _FORWARD_TILES,
    _dq_tuned,
    _forward_tuned,
    dkdv_launch,
    kernel_options,
    launch_delta,
)

__all__ = ["forward", "backward"]


def _strides(*tensors) -> tuple[int, ...]:
    """``(batch, head, token)`` strides of each packed ``(T, H, D)`` tensor or ``(H, T)`` array
    (checkpoints, ``delta``), in order, for the ``VARLEN`` kernels; zeros for None."""
    out: tuple[int, ...] = ()
    for a in tensors:
        if a is None:
            out += (0, 0, 0)
        elif a.dim() == 3:
            out += (a.stride(0), a.stride(1), a.stride(0))
        else:
            out += (a.stride(1), a.stride(0), a.stride(1))
    return out


def _options(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal):
    extents, lengths = (q.shape[0], k.shape[0]), (cu_seqlens_q, cu_seqlens_k)
    flags = {"CAUSAL": bool(causal), "HAS_QLEN": False, "HAS_KLEN": False, "VARLEN": True}
    return kernel_options(q, v, input_pos, extents, lengths, **flags)


def forward(
    o,
    q,
    k,
    v,
    m,
    l,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    input_pos,
) -> None:
    """Packed varlen attention forward into ``o`` and, unless ``m`` is None, ``m`` and ``l``.

    The prefix sums are read only in the kernels; ``max_seqlen_q``/``max_seqlen_k`` set the
    grid's tile count; ``scale``, ``causal``, ``input_pos`` as :func:`.attention.forward`,
    positions per sequence. Parameters: the ``attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[0], k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    if Tq == 0 or H == 0 or batch == 0 or max_seqlen_q == 0:
        return
    pointers, pos_scalar, meta = _options(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal)
    meta["STORE_STATS"] = m is not None
    stats = (o, o) if m is None else (m, l)  # o is never read without STORE_STATS
    tensors = (q, k, v, o, *stats, *pointers, *_strides(q, k, v, o, m, l))
    args = (*tensors, H, H // Hkv, Tq, Tk, pos_scalar, scale * LOG2E, D, DV)
    grid = tile_grid(max_seqlen_q, "BLOCK_M", batch * H, varlen=True)
    work = batch * H * max_seqlen_q * max_seqlen_k
    launch(_forward_kernel, _forward_tuned, _FORWARD_TILES, grid, args, meta, work, q)


def backward(
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
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    input_pos,
) -> None:
    """Packed varlen attention backward: overwrites ``dq``, ``dk``, ``dv`` (and ``delta``);
    ``dq_accum`` is not used (None). Parameters: the ``attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`), options as :func:`forward`."""
    Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[0], k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or H == 0:
        return
    pointers, pos_scalar, meta = _options(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal)
    reads = (q, k, v, do, m, l, delta)
    sizes = (H // Hkv, Tq, Tk, pos_scalar, scale, scale * LOG2E, D, DV)
    work = batch * H * max_seqlen_q * max_seqlen_k
    with launch_context(_dq_kernel, q):
        if max_seqlen_q > 0:
            args = (o, do, delta, cu_seqlens_q, *_strides(o, do, delta), H, Tq, DV)
            launch_delta(q, args, DV, max_seqlen_q, batch * H, has_qlen=False, varlen=True)
        if max_seqlen_k > 0:
            args = (*reads, dk, dv, *pointers, *_strides(*reads, dk, dv), Hkv, *sizes)
            grid = tile_grid(max_seqlen_k, "BLOCK_N", batch * Hkv, varlen=True)
            tuned, table, grid, dkdv_meta = dkdv_launch(grid, meta)
            launch(_dkdv_kernel, tuned, table, grid, args, dkdv_meta, work, q)
        if max_seqlen_q > 0:
            args = (*reads, dq, *pointers, *_strides(*reads, dq), H, *sizes)
            grid = tile_grid(max_seqlen_q, "BLOCK_M", batch * H, varlen=True)
            launch(_dq_kernel, _dq_tuned, _DQ_TILES, grid, args, meta, work, q)
