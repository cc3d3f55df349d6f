r"""Fused multi-head attention on Triton: FA2-style forward, three-kernel backward.

Forward, one program per (query tile, batch, query head). The scores of a
tile, ``s = q k^T * scale``, are kept in base 2 (``scale * log2 e`` is folded
into one multiply) and reduced by the online softmax with ``exp2``; the row
max is converted to natural-log units only when it is stored, so the
checkpoints follow the backend-neutral contract ``m = max_j s_j``,
``l = sum_j exp(s_j - m)``. Key tiles are visited in two passes: the tiles
every query row of the tile may see in full (never evaluating a mask), then
the tiles that cross the causal diagonal or the end of ``k_lengths[b]``.
GQA reads kv head ``h // (H // Hkv)`` directly; K and V are never repeated.

Backward, with ``P = exp(s - m) / l`` rebuilt from the checkpoints as
``exp2(s * log2 e - lse2)``, ``lse2 = m log2 e + log2 l``:

.. math::

    \delta_i = \textstyle\sum_d dO_{id} O_{id}, \qquad
    dS = P \circ (dO\,V^T - \delta), \qquad
    dQ = \mathrm{scale}\; dS\,K, \quad dK = \mathrm{scale}\; dS^T Q, \quad dV = P^T dO

1. ``_delta_kernel`` computes ``delta`` into the scratch buffer;
2. ``_dkdv_kernel``: one program per (key tile, batch, kv head) loops over the
   query heads of its GQA group and the query tiles that see it, so dK and dV
   are summed over the group in registers and stored once (no atomics); at
   head dims of 256, two programs per key tile, one for dV and one for dK
   (see ``_dkdv_kernel``);
3. ``_dq_kernel``: one program per query tile recomputes ``P`` and ``dS`` and
   writes dQ straight into the shadow in its dtype.

dQ by a separate pass (rather than float32 atomics into ``dq_accum``) makes
the backward deterministic -- the same inputs give bit-identical gradients --
at the price of recomputing ``q k^T`` and ``dO V^T`` once more; the scratch
``dq_accum`` is therefore not used by this backend.

Fully masked query rows (``i >= q_lengths[b]``, or no visible key) get
``o = 0``, ``m = -inf``, ``l = 0`` and zero gradients; keys ``j >= k_lengths[b]``
get zero dK and dV. Every stride is passed to the kernels (BSHD views work
without copies); batch, head and tile offsets are computed in int64.

Lengths and positions: array values are loaded at int64 and clamped where
clamping changes no result (lengths to ``[0, S]``, ``input_pos`` to
``[-Sq, Sk]``) before they narrow to int32, and an int ``input_pos`` is
clamped the same way on the host, so no value wraps, none is read on the host,
and none leads a load out of bounds. Causal rows before key 0 (negative
``input_pos``) see no key.

Packed variable-length batches (:mod:`.attention_varlen`) run these same
kernels with the compile-time flag ``VARLEN``: a 2-D grid over the tiles of
the longest sequence, the ``(B + 1,)`` prefix sums in the slots of the
length arrays, and each sequence's first token as the batch offset (see
:func:`_sequence_context`). ``VARLEN=False`` compiles to the kernels above,
unchanged.

Non-finite inputs reach exactly the rows that see them. Masked scores are
selected to ``-inf`` (never added to), the row max ignores NaN (as the GPU's
``max.f32`` does) so a NaN score makes ``exp2(s - m)`` and the row's sum NaN,
and a row whose sum is NaN keeps it (o, m, l NaN) instead of being taken for
a fully masked one. In tiles crossing the causal diagonal the products whose
left operand is 0 on masked pairs would spread ``0 * NaN``: there ``ds`` is
selected to 0, non-finite values of V (forward), K (dQ) and Q (dK) enter the
product as 0, the pairs that see them carrying NaN through ``p`` or ``ds``
(or, for V, by marking each row at or past a column's first non-finite value).
"""

from __future__ import annotations

from ._attention_kernels import _delta_kernel, _dkdv_kernel, _dq_kernel, _forward_kernel
from ._attn_common import (
    LOG2E,
    Tile,
    TileTable,
    autotuned,
    dim_block,
    head_class,
    head_meta,
    launch,
    scalar_or_pointer,
    strides_of,
    tile_grid,
)
from ._common import launch_context, traced

__all__ = ["backward", "forward"]

# Tiles per head-dim class (64, 128, 256), chosen so that the sm_90 build of
# each kernel fits shared memory without spilling registers (checked by
# compiling for sm_90 and reading the cubin's resource usage). Float32 uses
# IEEE products on CUDA cores, which need far more registers: smaller tiles.
_FORWARD_TILES = TileTable(
    default={64: Tile(128, 64, 8, 2), 128: Tile(128, 64, 8, 2), 256: Tile(64, 32, 8, 3)},
    wide_default={64: Tile(32, 32, 4, 2), 128: Tile(32, 16, 8, 1), 256: Tile(32, 16, 8, 1)},
    candidates={
        64: (Tile(128, 64, 4, 3), Tile(128, 128, 8, 3), Tile(128, 64, 8, 3), Tile(64, 64, 4, 3)),
        128: (Tile(128, 64, 8, 3), Tile(128, 128, 8, 3), Tile(128, 64, 8, 2), Tile(64, 64, 8, 2)),
        256: (Tile(64, 32, 8, 3), Tile(64, 16, 8, 3), Tile(64, 16, 8, 2)),
    },
)
# dK/dV: BLOCK_N keys per program, BLOCK_M query rows per step. BLOCK_N is the M
# dimension of every product (wgmma from 64). At D=256 a 64-key program holding both
# accumulators spills (two 64x256 float32 tiles), so that class splits dK and dV over
# two programs (_DKDV_SPLIT_TILES, see dkdv_split); this table holds the one-program
# tiles (also flex attention's). Every candidate compiles for sm_90 without spills,
# causal or not.
_DKDV_TILES = TileTable(
    default={64: Tile(32, 64, 4, 3), 128: Tile(32, 64, 8, 2), 256: Tile(32, 32, 8, 2)},
    wide_default={64: Tile(32, 32, 8, 1), 128: Tile(16, 16, 4, 1), 256: Tile(16, 16, 4, 1)},
    candidates={
        64: (Tile(32, 64, 4, 3), Tile(32, 128, 8, 3)),
        128: (Tile(32, 64, 8, 2), Tile(16, 128, 8, 2)),
        256: (Tile(32, 32, 8, 2),),
    },
)
# dK/dV split over two programs per key tile (head dims of 256): one float32
# accumulator each, so 64 keys fit with 16-row query steps and 3 stages (Triton 3.6:
# 233/248 registers non-causal/causal; causal spills at 2 stages, 32-row steps spill;
# Triton 3.9 spills 17 bytes in the causal build).
_DKDV_SPLIT_TILES = TileTable(
    default={256: Tile(16, 64, 8, 3)},
    wide_default={256: Tile(16, 16, 4, 1)},
    candidates={256: (Tile(16, 64, 8, 3),)},
)
# dQ: BLOCK_M query rows per program (the M dimension of every product: wgmma from 64),
# BLOCK_N keys per step. At D=256, 64 rows fit with 16-key steps (32 spill).
_DQ_TILES = TileTable(
    default={64: Tile(64, 64, 4, 3), 128: Tile(128, 64, 8, 2), 256: Tile(64, 16, 8, 2)},
    wide_default={64: Tile(32, 32, 4, 2), 128: Tile(16, 16, 4, 1), 256: Tile(16, 16, 8, 1)},
    candidates={
        64: (Tile(128, 64, 8, 3), Tile(64, 64, 4, 3), Tile(128, 32, 4, 3)),
        128: (Tile(128, 32, 8, 3), Tile(128, 64, 8, 2), Tile(64, 64, 8, 3)),
        256: (Tile(64, 16, 8, 2), Tile(32, 32, 4, 2), Tile(32, 64, 8, 2)),
    },
)
_TUNE_KEY = ["Sq", "Sk", "BLOCK_D", "BLOCK_DV", "CAUSAL"]
_forward_tuned = autotuned(_forward_kernel, _FORWARD_TILES, _TUNE_KEY)
_dkdv_tuned = autotuned(_dkdv_kernel, _DKDV_TILES, _TUNE_KEY)
_dkdv_split_tuned = autotuned(_dkdv_kernel, _DKDV_SPLIT_TILES, _TUNE_KEY)
_dq_tuned = autotuned(_dq_kernel, _DQ_TILES, _TUNE_KEY)
#: Elements of one ``delta`` tile (rows x padded Dv): 64 per thread of 4 warps.
_DELTA_TILE = 8192


def dkdv_split(block_d: int) -> bool:
    """Whether :func:`_dkdv_kernel` runs two programs per key tile (dV, dK): head dims of 256."""
    return head_class(block_d) == 256


def dkdv_launch(key_grid, meta):
    """``(tuned, table, grid, meta)`` that :func:`launch` takes for :func:`_dkdv_kernel`.

    ``key_grid(blocks)`` counts key tiles on its axis 0; with :func:`dkdv_split` the grid
    doubles that axis, the tiles come from ``_DKDV_SPLIT_TILES`` and ``meta`` gains ``SPLIT``.
    """
    if not dkdv_split(meta["BLOCK_D"]):
        return _dkdv_tuned, _DKDV_TILES, key_grid, meta

    def grid(blocks):
        tiles, *rest = key_grid(blocks)
        return (2 * tiles, *rest)

    return _dkdv_split_tuned, _DKDV_SPLIT_TILES, grid, {**meta, "SPLIT": True}


def kernel_options(q, v, input_pos, extents, lengths, **flags):
    """``(pointers, pos_scalar, meta)`` of an attention launch: the pointer arguments of the two
    ``lengths`` arrays (``q`` for a None one, never read) and of ``input_pos``, ``input_pos``
    as a kernel scalar, and the compile-time arguments, ``flags`` included. An int
    ``input_pos`` is clamped here to ``[-Sq, Sk]`` (``extents``), as the kernels clamp arrays."""
    if isinstance(input_pos, int):
        input_pos = min(max(input_pos, -extents[0]), extents[1])
    pos_arg, pos_scalar, pos_array = scalar_or_pointer(input_pos, q)
    pointers = (*(q if a is None else a for a in lengths), pos_arg)
    return pointers, pos_scalar, {**head_meta(q, v), "POS_ARRAY": pos_array, **flags}


def _options(q, k, v, input_pos, causal, q_lengths, k_lengths):
    has_lengths = {"HAS_QLEN": q_lengths is not None, "HAS_KLEN": k_lengths is not None}
    extents, lengths = (q.shape[2], k.shape[2]), (q_lengths, k_lengths)
    return kernel_options(q, v, input_pos, extents, lengths, CAUSAL=bool(causal), **has_lengths)


def launch_delta(like, args, dv, rows, programs, *, has_qlen, varlen=False) -> None:
    """``delta = rowsum(do * o)``: :func:`_delta_kernel` over its positional ``args`` (value
    head dim ``dv``), tiles of ``rows`` rows for each of ``programs`` (batch x heads)."""
    block_dv = dim_block(dv)
    block_m = _DELTA_TILE // block_dv
    grid = tile_grid(rows, "BLOCK_M", programs, varlen)({"BLOCK_M": block_m})
    meta = {"HAS_QLEN": has_qlen, "EVEN_DV": block_dv == dv, "VARLEN": varlen}
    traced(_delta_kernel, like)[grid](*args, **meta, BLOCK_M=block_m, BLOCK_DV=block_dv)


def forward(o, q, k, v, m, l, *, scale, causal, input_pos, q_lengths, k_lengths) -> None:
    """Attention forward into ``o`` and, unless ``m`` is None, the checkpoints ``m`` and ``l``.

    ``m`` is the row max of ``s = q k^T * scale`` in natural-log units, ``l`` the sum of
    ``exp(s - m)``; ``causal`` keeps the keys at positions ``<=`` the query's, query 0 being
    at ``input_pos``; ``q_lengths``/``k_lengths`` count the valid queries and keys. Parameters:
    the ``attention`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    B, H, Sq, D = q.shape
    Hkv, Sk, DV = k.shape[1], k.shape[2], v.shape[-1]
    if o.numel() == 0:
        return
    pointers, pos_scalar, meta = _options(q, k, v, input_pos, causal, q_lengths, k_lengths)
    meta["STORE_STATS"] = m is not None
    stats = (o, o) if m is None else (m, l)  # o is never read without STORE_STATS
    tensors = (q, k, v, o, *stats, *pointers, *strides_of(q, k, v, o, m, l))
    args = (*tensors, H, H // Hkv, Sq, Sk, pos_scalar, scale * LOG2E, D, DV)
    grid = tile_grid(Sq, "BLOCK_M", B * H)
    launch(_forward_kernel, _forward_tuned, _FORWARD_TILES, grid, args, meta, B * H * Sq * Sk, q)


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
    scale,
    causal,
    input_pos,
    q_lengths,
    k_lengths,
) -> None:
    """Attention backward: overwrites ``dq``, ``dk``, ``dv`` (and the scratch ``delta``).

    Reads checkpoints from any backend's forward; ``dk`` and ``dv`` are summed over each GQA
    group; ``delta`` receives ``rowsum(do * o)``; ``dq_accum`` is None (dQ is a separate,
    deterministic pass, so the backend's declaration leaves it out of its scratch). Parameters:
    the ``attention`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    B, H, Sq, D = q.shape
    Hkv, Sk, DV = k.shape[1], k.shape[2], v.shape[-1]
    if B == 0 or H == 0:
        return
    pointers, pos_scalar, meta = _options(q, k, v, input_pos, causal, q_lengths, k_lengths)
    reads = (q, k, v, do, m, l, delta)
    sizes = (H // Hkv, Sq, Sk, pos_scalar, scale, scale * LOG2E, D, DV)
    work = B * H * Sq * Sk
    with launch_context(_dq_kernel, q):
        if Sq > 0:
            args = (o, do, delta, pointers[0], *strides_of(o, do, delta), H, Sq, DV)
            launch_delta(q, args, DV, Sq, B * H, has_qlen=meta["HAS_QLEN"])
        if Sk > 0:
            args = (*reads, dk, dv, *pointers, *strides_of(*reads, dk, dv), Hkv, *sizes)
            tuned, table, grid, dkdv_meta = dkdv_launch(tile_grid(Sk, "BLOCK_N", B * Hkv), meta)
            launch(_dkdv_kernel, tuned, table, grid, args, dkdv_meta, work, q)
        if Sq > 0:
            args = (*reads, dq, *pointers, *strides_of(*reads, dq), H, *sizes)
            grid = tile_grid(Sq, "BLOCK_M", B * H)
            launch(_dq_kernel, _dq_tuned, _DQ_TILES, grid, args, meta, work, q)
