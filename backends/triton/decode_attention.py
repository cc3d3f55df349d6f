r"""Split-KV decode attention on Triton (one new query per head over a KV cache).

Decode is bound by reading the cache, so the kernels are built to stream K
and V once at full bandwidth:

1. ``_split_kernel``: one program per (split, batch, kv head). Batch ``b``'s
   keys ``[0, lengths[b])`` are cut into ``n_splits`` chunks (whole key tiles
   each); a program streams its chunk once for ALL the query heads of its GQA
   group, in the transposed form: ``s^T = K q^T`` (``(BLOCK_N, D) x (D, group)``)
   and ``o^T += V^T p^T`` (``(DV, BLOCK_N) x (BLOCK_N, group)``), so the rows
   (M) of both products are the key tile and the value dims, never the small
   group (wgmma needs M a multiple of 64). It runs the online softmax in base 2
   down the key axis and writes, per query head and split, ``m_partial`` (the
   chunk's score max ``m_s``, natural-log units), ``l_partial``
   (``l_s = sum exp(s - m_s)``) and ``o_partial`` (the unnormalised
   ``sum exp(s - m_s) v``). Only the last, partial tile of a chunk evaluates a
   mask; an empty chunk writes ``o = 0, m = -inf, l = 0``. Options, each a
   compile-time flag so the plain contiguous kernel is unchanged: a paged
   cache (``PAGED``: keys found through the block table, one lookup per tile
   when pages hold whole tiles, else one per key; page indices clamped to
   ``[0, num_pages)``), a sliding window (``HAS_WINDOW``: the chunks cut only
   the keys the query sees, the tile holding the window's first key is
   masked below it) and a score cap (``HAS_SOFTCAP``).
2. ``_combine_kernel``: one program per (batch, query head) merges the splits,

.. math::

    o = \frac{\sum_s e^{m_s - M} o_s}{\sum_s e^{m_s - M} l_s}, \qquad M = \max_s m_s,

   and writes 0 when every split is empty (``lengths[b] == 0``).

:func:`default_splits` picks ``n_splits`` so that ``batch * kv_heads * n_splits``
programs keep every streaming multiprocessor busy, without cutting a cache
into chunks shorter than ``MIN_SPLIT_KEYS``.
"""

from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from ._attn_common import (
    KV,
    LN2_CONST,
    LOG2E,
    LOG2E_CONST,
    Cols,
    Rows,
    Tile,
    TileTable,
    autotuned,
    dim_block,
    head_class,
    head_meta,
    kv_tile,
    launch,
    load_tile,
    sm_count,
    strides_of,
    tile_loop,
)
from ._common import launch_context, traced

__all__ = ["default_splits", "forward"]

#: Split programs one SM holds at once, by head-dim class, for 2-byte inputs at the
#: default tile (the sm_90 build's occupancy: registers and shared memory; the offline
#: compile test holds the D=64 and D=128 entries against the compiled kernels).
SPLIT_PROGRAMS_PER_SM = {64: 4, 128: 2, 256: 3}
#: Share of its waves' program slots a default grid must fill (more splits add combine work).
WAVE_FILL = 0.9
#: Fewest keys a default split holds (shorter chunks cost more to combine than they save).
MIN_SPLIT_KEYS = 256
#: Most splits :func:`default_splits` returns.
MAX_SPLITS = 128

#: One (batch, kv head) of the cache: its K and V :data:`~._attn_common.KV` (the key
#: slots of one page when paged), the element strides between pages of K and V, the
#: batch's block-table row and the stride along it, the page count and the logical
#: cache length ``Smax``.
Cache = namedtuple("Cache", ["kv", "page_k", "page_v", "table", "stride_table", "pages", "Smax"])


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one ``exp2`` of a non-positive argument (no overflow, exact sign)."""
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E_CONST))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _kv_tile(
    cache,
    n0,
    offs_n,
    cols,
    lo,
    length,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The K and V tiles of keys ``n0 + offs_n`` of the :class:`Cache`; ``MASKED`` zero-fills
    keys outside ``[lo, length)``.

    Contiguous caches (``PAGED`` false, no window) load as attention does. Pages:
    key ``j`` is slot ``j % PAGE_SIZE`` of page ``block_table[b, j // PAGE_SIZE]``
    (clamped to ``[0, num_pages)``), looked up once per tile when a tile lies
    within one page (``PAGE_SIZE % BLOCK_N == 0``; tiles start at multiples
    of ``BLOCK_N``), else once per key.
    """
    kv = cache.kv
    if not PAGED and not HAS_WINDOW:
        k, v = kv_tile(kv, n0, offs_n, cols, length, MASKED, EVEN_D, EVEN_DV)
    else:
        keys = n0 + offs_n
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:
                page = tl.load(cache.table + (n0 // PAGE_SIZE).to(tl.int64) * cache.stride_table)
                page = tl.minimum(tl.maximum(page, 0), cache.pages - 1).to(tl.int64)
                slots = (n0 % PAGE_SIZE + offs_n).to(tl.int64)
                k_rows = kv.k.base + page * cache.page_k + slots[:, None] * kv.k.stride
                v_rows = kv.v.base + page * cache.page_v + slots[:, None] * kv.v.stride
            else:
                # A tile spans pages: one block-table entry per key (keys past Smax read none).
                pages = tl.load(
                    cache.table + (keys // PAGE_SIZE).to(tl.int64) * cache.stride_table,
                    mask=keys < cache.Smax,
                    other=0,
                )
                pages = tl.minimum(tl.maximum(pages, 0), cache.pages - 1).to(tl.int64)
                slots = (keys % PAGE_SIZE).to(tl.int64)
                k_rows = kv.k.base + pages[:, None] * cache.page_k + slots[:, None] * kv.k.stride
                v_rows = kv.v.base + pages[:, None] * cache.page_v + slots[:, None] * kv.v.stride
        else:
            key_off = tl.cast(n0, tl.int64)
            k_rows = kv.k.base + key_off * kv.k.stride + offs_n[:, None] * kv.k.stride
            v_rows = kv.v.base + key_off * kv.v.stride + offs_n[:, None] * kv.v.stride
        key_ok = keys < length
        if HAS_WINDOW:
            key_ok = key_ok & (keys >= lo)
        k = load_tile(k_rows + cols.d[None, :], key_ok[:, None], cols.d, cols.D, MASKED, EVEN_D)
        v = load_tile(v_rows + cols.dv[None, :], key_ok[:, None], cols.dv, cols.DV, MASKED, EVEN_DV)
    return k, v


@triton.jit
def _decode_step(
    carry,
    n0,
    ctx,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update of ``carry = (acc, m_i, l_i)`` (``acc`` is ``o^T``) by the key tile
    at ``n0``; ``MASKED`` checks keys in ``[lo, length)``.

    ``ctx``: the transposed query tile ``q_t``, the :class:`Cache`, the
    :data:`~._attn_common.Cols`, the key offsets of a tile, ``lo``, ``length``,
    ``scale * log2 e`` and ``softcap * log2 e``. Every tile visited holds at least
    one key in ``[lo, length)``, so the running max is finite after the first
    tile (no ``-inf - -inf``).
    """
    acc, m_i, l_i = carry
    q_t, cache, cols, offs_n, lo, length, qk_scale, softcap = ctx
    k, v = _kv_tile(
        cache, n0, offs_n, cols, lo, length,
        MASKED, EVEN_D, EVEN_DV, PAGED, PAGE_SIZE, HAS_WINDOW, BLOCK_N,
    )  # fmt: skip
    # Transposed: the keys are the M rows of s^T = K q^T and the value dims those of
    # o^T = V^T p^T, so both dots have M >= 64 (wgmma) however small the GQA group.
    s = tl.dot(k.to(q_t.dtype), q_t, input_precision=PRECISION) * qk_scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if MASKED:
        keys = n0 + offs_n
        key_ok = keys < length
        if HAS_WINDOW:
            key_ok = key_ok & (keys >= lo)
        s = tl.where(key_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    p = tl.exp2(s - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha[None, :]
    acc = tl.dot(tl.trans(v.to(q_t.dtype)), p.to(q_t.dtype), acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(
    do_not_specialize=[
        "HKV",
        "GROUP",
        "Smax",
        "n_splits",
        "D",
        "DV",
        "stride_btb",
        "stride_btp",
        "num_pages",
        "window",
    ]
)
def _split_kernel(
    q_ptr, k_ptr, v_ptr,  # (B,H,D) queries; (B,Hkv,Smax,D) and (B,Hkv,Smax,DV) caches, or their pages
    lengths_ptr,  # (B,) valid keys per batch
    bt_ptr,  # (B, max_pages) int32 block table (PAGED; never read otherwise)
    o_part_ptr, m_part_ptr, l_part_ptr,  # (B,H,S,DV), (B,H,S), (B,H,S) float32 scratch
    stride_qb, stride_qh,  # q strides (last axis contiguous)
    stride_kb, stride_kh, stride_kn,  # k cache strides (batch, or page when PAGED; head; key slot)
    stride_vb, stride_vh, stride_vn,  # v cache strides, the same way
    stride_btb, stride_btp,  # block table strides
    stride_opb, stride_oph, stride_ops,  # o_partial strides
    stride_mpb, stride_mph, stride_mps,  # m_partial strides
    stride_lpb, stride_lph, stride_lps,  # l_partial strides
    HKV, GROUP, Smax, n_splits,  # kv heads, query heads per kv head, (logical) cache length, splits
    num_pages,  # pages of k/v (PAGED): block-table entries are clamped to [0, num_pages)
    window,  # keys the query sees (HAS_WINDOW)
    qk_scale,  # scale * log2(e)
    softcap,  # softcap * log2(e) (HAS_SOFTCAP)
    D, DV,  # head dims
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    PAGED: tl.constexpr,  # k/v are pages addressed through the block table
    PAGE_SIZE: tl.constexpr,  # keys per page (PAGED)
    HAS_WINDOW: tl.constexpr,  # the query sees only the last `window` keys
    HAS_SOFTCAP: tl.constexpr,  # scores are capped by softcap * tanh(s / softcap)
    BLOCK_G: tl.constexpr,  # query heads of a group, padded to >= 16 (the N of both dots)
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
    BLOCK_N: tl.constexpr,  # key tile
):  # fmt: skip
    """One split of one (batch, kv head), for all the query heads of its group."""
    pid_s = tl.program_id(0) % n_splits
    pid_bkv = tl.program_id(0) // n_splits
    b = (pid_bkv // HKV).to(tl.int64)
    kvh = pid_bkv % HKV
    # Read at int64 and clamped to [0, Smax]: no length wraps or leads a load past the cache.
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + b).to(tl.int64), 0), Smax).to(tl.int32)
    # The keys the query sees, [lo, length), cut into chunks of whole tiles from lo's tile.
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    else:
        lo = length * 0
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(length - lo_tile, n_splits), BLOCK_N) * BLOCK_N
    start = lo_tile + pid_s * chunk
    end = tl.minimum(start + chunk, length)
    if HAS_WINDOW:
        # The tile holding lo is masked below it; the tiles after it are whole.
        head_end = tl.minimum(tl.maximum(start, tl.cdiv(lo, BLOCK_N) * BLOCK_N), end)
    else:
        head_end = start
    full_end = head_end + (tl.maximum(end - head_end, 0) // BLOCK_N) * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    cols = Cols(tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), D, DV)
    head_ok = offs_g < GROUP
    heads = (kvh * GROUP + offs_g).to(tl.int64)
    # The (padded group, D) query tile in one load, masked on the D axis only for odd D
    # (a row mask alone keeps 16-byte vectors), then transposed for s^T = K q^T.
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + cols.d[None, :]
    q = load_tile(q_ptrs, head_ok[:, None], cols.d, D, True, EVEN_D)
    q_t = tl.trans(q.to(DOT_TYPE))
    kvh64 = kvh.to(tl.int64)
    if PAGED:
        kv = KV(
            Rows(k_ptr + kvh64 * stride_kh, stride_kn), Rows(v_ptr + kvh64 * stride_vh, stride_vn)
        )
    else:
        kv = KV(
            Rows(k_ptr + b * stride_kb + kvh64 * stride_kh, stride_kn),
            Rows(v_ptr + b * stride_vb + kvh64 * stride_vh, stride_vn),
        )
    cache = Cache(kv, stride_kb, stride_vb, bt_ptr + b * stride_btb, stride_btp, num_pages, Smax)
    ctx = (q_t, cache, cols, tl.arange(0, BLOCK_N), lo, length, qk_scale, softcap)

    acc = tl.zeros((BLOCK_DV, BLOCK_G), dtype=tl.float32)  # o^T
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    carry = (acc, m_i, l_i)
    if HAS_WINDOW:
        carry = tile_loop(
            _decode_step, carry, start, head_end, BLOCK_N, ctx,
            (True, EVEN_D, EVEN_DV, PRECISION, PAGED, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N),
        )  # fmt: skip
    carry = tile_loop(
        _decode_step, carry, head_end, full_end, BLOCK_N, ctx,
        (False, EVEN_D, EVEN_DV, PRECISION, PAGED, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N),
    )  # fmt: skip
    acc, m_i, l_i = tile_loop(
        _decode_step, carry, full_end, end, BLOCK_N, ctx,
        (True, EVEN_D, EVEN_DV, PRECISION, PAGED, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N),
    )  # fmt: skip

    live = l_i > 0.0
    split = pid_s.to(tl.int64)
    o_part = o_part_ptr + b * stride_opb + split * stride_ops
    tl.store(
        o_part + heads[:, None] * stride_oph + cols.dv[None, :],
        tl.trans(acc),
        mask=head_ok[:, None] & (cols.dv[None, :] < DV),
    )
    tl.store(
        m_part_ptr + b * stride_mpb + heads * stride_mph + split * stride_mps,
        tl.where(live, m_i * LN2_CONST, float("-inf")),
        mask=head_ok,
    )
    tl.store(
        l_part_ptr + b * stride_lpb + heads * stride_lph + split * stride_lps,
        tl.where(live, l_i, 0.0),
        mask=head_ok,
    )


@triton.jit(do_not_specialize=["H", "n_splits", "DV"])
def _combine_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr,  # (B,H,S,DV), (B,H,S), (B,H,S) float32 split results
    o_ptr,  # (B,H,DV) output, overwritten
    stride_opb, stride_oph, stride_ops,  # o_partial strides
    stride_mpb, stride_mph, stride_mps,  # m_partial strides
    stride_lpb, stride_lph, stride_lps,  # l_partial strides
    stride_ob, stride_oh,  # o strides
    H, n_splits, DV,  # query heads, splits, value head dim
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,  # splits per step, padded value head dim
):  # fmt: skip
    """The splits of one (batch, query head) merged into ``o``."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    op_base = o_part_ptr + b * stride_opb + h * stride_oph
    m_base = m_part_ptr + b * stride_mpb + h * stride_mph
    l_base = l_part_ptr + b * stride_lpb + h * stride_lph

    m_run = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    s0 = 0
    while s0 < n_splits:
        splits = s0 + offs_s
        m_run = tl.maximum(
            m_run,
            tl.load(m_base + splits * stride_mps, mask=splits < n_splits, other=float("-inf")),
        )
        s0 += BLOCK_S
    m_max = tl.max(m_run, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)

    acc = tl.zeros((BLOCK_S, BLOCK_DV), dtype=tl.float32)
    weight_sum = tl.zeros((BLOCK_S,), dtype=tl.float32)
    s0 = 0
    while s0 < n_splits:
        splits = s0 + offs_s
        ok = splits < n_splits
        m = tl.load(m_base + splits * stride_mps, mask=ok, other=float("-inf"))
        l = tl.load(l_base + splits * stride_lps, mask=ok, other=0.0)
        weight = tl.exp(m - m_ref)
        part = tl.load(
            op_base + splits[:, None].to(tl.int64) * stride_ops + offs_dv[None, :],
            mask=ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        acc += weight[:, None] * part
        weight_sum += weight * l
        s0 += BLOCK_S
    total = tl.sum(weight_sum, 0)
    o = tl.sum(acc, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + offs_dv,
        o.to(o_ptr.dtype.element_ty),
        mask=offs_dv < DV,
    )


# Key tiles per head-dim class; the query rows are the (padded) GQA group.
# Each fits sm_90 shared memory without register spills.
_SPLIT_TILES = TileTable(
    default={64: Tile(None, 64, 4, 3), 128: Tile(None, 64, 4, 3), 256: Tile(None, 32, 4, 2)},
    wide_default={64: Tile(None, 64, 4, 2), 128: Tile(None, 32, 8, 2), 256: Tile(None, 16, 4, 2)},
    candidates={
        64: (Tile(None, 64, 4, 3), Tile(None, 128, 4, 3), Tile(None, 128, 8, 4)),
        128: (Tile(None, 64, 4, 3), Tile(None, 128, 8, 3), Tile(None, 64, 4, 4)),
        256: (Tile(None, 32, 4, 2), Tile(None, 64, 8, 2), Tile(None, 32, 4, 3)),
    },
)
_split_tuned = autotuned(
    _split_kernel,
    _SPLIT_TILES,
    ["n_splits", "BLOCK_G", "BLOCK_D", "BLOCK_DV", "PAGED", "PAGE_SIZE", "HAS_WINDOW"],
)
_COMBINE_SPLITS = 16


def forward(
    o,
    q,
    k,
    v,
    lengths,
    o_partial,
    m_partial,
    l_partial,
    *,
    scale,
    softcap=None,
    window=None,
    block_table=None,
) -> None:
    """Decode attention into ``o``, through the split scratch buffers (float32 here).

    ``lengths`` and the block table's entries are clamped in the kernels; with ``window``
    the splits cut only the keys the query sees, and no split visits a tile before them.
    The contract of :class:`xpkernels.backends.protocol.DecodeAttentionModule`.
    """
    B, H, D = q.shape
    Hkv, DV = k.shape[1], v.shape[-1]
    paged = block_table is not None
    Smax = block_table.shape[1] * k.shape[2] if paged else k.shape[2]
    n_splits = o_partial.shape[2]
    if B == 0 or H == 0:
        return
    group = H // Hkv
    meta = {
        **head_meta(q, v),
        "PAGED": paged,
        "PAGE_SIZE": k.shape[2] if paged else 1,
        "HAS_WINDOW": window is not None,
        "HAS_SOFTCAP": softcap is not None,
        "BLOCK_G": max(16, triton.next_power_of_2(group)),
    }
    table = block_table if paged else lengths  # never read when not paged
    scratch = (o_partial, m_partial, l_partial)
    tensors = (q, k, v, lengths, table, *scratch, *q.stride()[:2], *strides_of(k, v))
    table_strides = block_table.stride() if paged else (0, 0)
    pages, keys_seen = (k.shape[0] if paged else 1), (0 if window is None else window)
    scales = (scale * LOG2E, 1.0 if softcap is None else softcap * LOG2E)
    sizes = (Hkv, group, Smax, n_splits, pages, keys_seen, *scales, D, DV)
    args = (*tensors, *table_strides, *strides_of(*scratch), *sizes)
    with launch_context(_split_kernel, q):
        grid = (n_splits * B * Hkv,)
        launch(_split_kernel, _split_tuned, _SPLIT_TILES, grid, args, meta, B * Hkv * Smax * D, q)
        args = (*scratch, o, *strides_of(*scratch), *o.stride()[:2], H, n_splits, DV)
        traced(_combine_kernel, q)[(B * H,)](
            *args, BLOCK_S=_COMBINE_SPLITS, BLOCK_DV=meta["BLOCK_DV"]
        )


def default_splits(batch: int, kv_heads: int, max_len: int, like) -> int:
    """Splits per (batch, kv head) for a cache of ``max_len`` keys like ``like`` (the K cache).

    The grid of ``batch * kv_heads * splits`` programs is sized to whole
    waves: among the split counts allowed (at most one per ``MIN_SPLIT_KEYS``
    keys and at most ``MAX_SPLITS``), the fewest whose grid fills its waves to
    at least :data:`WAVE_FILL` (else the fullest), where a wave is the SM
    count times :data:`SPLIT_PROGRAMS_PER_SM` (one SM on CPU).
    """
    per_sm = SPLIT_PROGRAMS_PER_SM[head_class(dim_block(like.shape[-1]))]
    slots = per_sm * sm_count(like)
    programs = max(batch * kv_heads, 1)
    cap = max(1, min(MAX_SPLITS, triton.cdiv(max_len, MIN_SPLIT_KEYS)))

    def filled(splits: int) -> float:
        grid = programs * splits
        return grid / (triton.cdiv(grid, slots) * slots)

    full = [splits for splits in range(1, cap + 1) if filled(splits) >= WAVE_FILL]
    return full[0] if full else max(range(1, cap + 1), key=lambda splits: (filled(splits), -splits))
