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

import triton

from ._attn_common import LOG2E, dim_block, dot_precision, dot_type, launch, scalar_or_pointer
from ._common import launch_context, traced
from .attention import (
    _DELTA_TILE,
    _DQ_TILES,
    _FORWARD_TILES,
    _delta_kernel,
    _dkdv_kernel,
    _dq_kernel,
    _dq_tuned,
    _forward_kernel,
    _forward_tuned,
    dkdv_launch,
)

__all__ = ["forward", "backward"]


def _packed_strides(a) -> tuple[int, int, int]:
    """``(batch, head, token)`` strides of a packed ``(T, H, D)`` tensor for the ``VARLEN`` kernels."""
    return a.stride(0), a.stride(1), a.stride(0)


def _row_strides(a) -> tuple[int, int, int]:
    """``(batch, head, token)`` strides of an ``(H, T)`` array (checkpoints, ``delta``)."""
    return a.stride(1), a.stride(0), a.stride(1)


def _meta(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal):
    if isinstance(input_pos, int):  # a host value: clamped as the kernels clamp arrays
        input_pos = min(max(input_pos, -q.shape[0]), k.shape[0])
    pos_arg, pos_scalar, pos_array = scalar_or_pointer(input_pos, q)
    meta = {
        "HAS_QLEN": False,
        "HAS_KLEN": False,
        "POS_ARRAY": pos_array,
        "PRECISION": dot_precision(q.dtype),
        "DOT_TYPE": dot_type(q.dtype),
        "BLOCK_D": dim_block(q.shape[-1]),
        "BLOCK_DV": dim_block(v.shape[-1]),
        "CAUSAL": bool(causal),
        "VARLEN": True,
    }
    meta["EVEN_D"] = meta["BLOCK_D"] == q.shape[-1]
    meta["EVEN_DV"] = meta["BLOCK_DV"] == v.shape[-1]
    return (cu_seqlens_q, cu_seqlens_k, pos_arg), pos_scalar, meta


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

    Parameters
    ----------
    o, q, k, v : torch.Tensor
        ``(Tq, H, Dv)``, ``(Tq, H, D)``, ``(Tk, Hkv, D)``, ``(Tk, Hkv, Dv)``.
    m, l : torch.Tensor or None
        ``(H, Tq)`` float32 checkpoints, both None for inference.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor
        ``(B + 1,)`` int32 prefix sums, read only in the kernels.
    max_seqlen_q, max_seqlen_k : int
        Longest query / key sequence: the grid's tile count.
    scale, causal, input_pos
        As :func:`.attention.forward`, positions per sequence.
    """
    Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[0], k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    if Tq == 0 or H == 0 or batch == 0 or max_seqlen_q == 0:
        return
    pointers, pos_scalar, meta = _meta(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal)
    store_stats = m is not None
    meta["STORE_STATS"] = store_stats
    args = (
        q,
        k,
        v,
        o,
        m if store_stats else o,
        l if store_stats else o,
        *pointers,
        *_packed_strides(q),
        *_packed_strides(k),
        *_packed_strides(v),
        *_packed_strides(o),
        *(_row_strides(m) if store_stats else (0, 0, 0)),
        *(_row_strides(l) if store_stats else (0, 0, 0)),
        H,
        H // Hkv,
        Tq,
        Tk,
        pos_scalar,
        scale * LOG2E,
        D,
        DV,
    )
    with launch_context(_forward_kernel, q):
        launch(
            _forward_kernel,
            _forward_tuned,
            _FORWARD_TILES,
            lambda blocks: (triton.cdiv(max_seqlen_q, blocks["BLOCK_M"]), batch * H),
            args,
            meta,
            batch * H * max_seqlen_q * max_seqlen_k,
            q,
        )


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
    """Packed varlen attention backward: overwrites ``dq``, ``dk``, ``dv`` (and ``delta``).

    ``delta`` is ``(H, Tq)`` float32 scratch; ``dq_accum`` is not used (None).
    Shapes and options as :func:`forward`.
    """
    Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[0], k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or H == 0:
        return
    pointers, pos_scalar, meta = _meta(q, k, v, cu_seqlens_q, cu_seqlens_k, input_pos, causal)
    qk_scale = scale * LOG2E
    work = batch * H * max_seqlen_q * max_seqlen_k
    with launch_context(_dq_kernel, q):
        if max_seqlen_q > 0:
            delta_rows = _DELTA_TILE // meta["BLOCK_DV"]
            traced(_delta_kernel, q)[(triton.cdiv(max_seqlen_q, delta_rows), batch * H)](
                o,
                do,
                delta,
                cu_seqlens_q,
                *_packed_strides(o),
                *_packed_strides(do),
                *_row_strides(delta),
                H,
                Tq,
                DV,
                HAS_QLEN=False,
                EVEN_DV=meta["EVEN_DV"],
                BLOCK_M=delta_rows,
                BLOCK_DV=meta["BLOCK_DV"],
                VARLEN=True,
            )
        common = (
            *_packed_strides(q),
            *_packed_strides(k),
            *_packed_strides(v),
            *_packed_strides(do),
            *_row_strides(m),
            *_row_strides(l),
            *_row_strides(delta),
        )
        if max_seqlen_k > 0:
            tuned, table, grid, dkdv_meta = dkdv_launch(
                lambda blocks: (triton.cdiv(max_seqlen_k, blocks["BLOCK_N"]), batch * Hkv), meta
            )
            launch(
                _dkdv_kernel,
                tuned,
                table,
                grid,
                (
                    q,
                    k,
                    v,
                    do,
                    m,
                    l,
                    delta,
                    dk,
                    dv,
                    *pointers,
                    *common,
                    *_packed_strides(dk),
                    *_packed_strides(dv),
                    Hkv,
                    H // Hkv,
                    Tq,
                    Tk,
                    pos_scalar,
                    scale,
                    qk_scale,
                    D,
                    DV,
                ),
                dkdv_meta,
                work,
                q,
            )
        if max_seqlen_q > 0:
            launch(
                _dq_kernel,
                _dq_tuned,
                _DQ_TILES,
                lambda blocks: (triton.cdiv(max_seqlen_q, blocks["BLOCK_M"]), batch * H),
                (
                    q,
                    k,
                    v,
                    do,
                    m,
                    l,
                    delta,
                    dq,
                    *pointers,
                    *common,
                    *_packed_strides(dq),
                    H,
                    H // Hkv,
                    Tq,
                    Tk,
                    pos_scalar,
                    scale,
                    qk_scale,
                    D,
                    DV,
                ),
                meta,
                work,
                q,
            )
