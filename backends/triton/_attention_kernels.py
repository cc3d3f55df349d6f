"""The Triton kernels of attention and attention_varlen: the forward, the delta, dK/dV and dQ
passes and the steps and contexts they share (the math and the masking rules are in
:mod:`.attention`'s docstring; its host code launches these).
"""

from __future__ import annotations

from collections import namedtuple

import triton
import triton.language as tl

from ._attn_common import (
    KV,
    BackwardRows,
    Cols,
    Strided,
    backward_heads,
    head_rows,
    kv_tile,
    load_rows,
    query_tile,
    softmax_update,
    store_output,
    store_rows,
    tile_loop,
)

#: The query and key extents of batch (or packed sequence) ``b``, from :func:`_sequence_context`.
Sequence = namedtuple("Sequence", ["bq", "bk", "q_len", "k_len", "pos0", "q_rows", "k_rows"])


@triton.jit
def _visible(n0, offs_n, q_pos, k_len, CAUSAL: tl.constexpr):
    """Mask ``(rows, keys)`` of the key tile at ``n0``: keys ``< k_len``, ``<= q_pos`` if causal."""
    keys = n0 + offs_n
    visible = (keys < k_len)[None, :]
    if CAUSAL:
        visible = visible & (keys[None, :] <= q_pos[:, None])
    return visible


@triton.jit
def _forward_step(
    carry,
    n0,
    ctx,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online-softmax update of ``carry = (acc, m_i, l_i)`` by the key tile at ``n0``.

    ``ctx``: the query tile ``q``, its :data:`~._attn_common.KV` and
    :data:`~._attn_common.Cols`, the key offsets of a tile, the rows' query
    positions ``q_pos``, the valid keys ``k_len`` and ``scale * log2 e``. With
    ``MASKED`` the tile is checked against ``k_len`` and (``CAUSAL``) ``q_pos``;
    without it every key is visible to every row.
    """
    acc, m_i, l_i = carry
    q, kv, cols, offs_n, q_pos, k_len, qk_scale = ctx
    k, v = kv_tile(kv, n0, offs_n, cols, k_len, MASKED, EVEN_D, EVEN_DV)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(_visible(n0, offs_n, q_pos, k_len, CAUSAL), s, float("-inf"))
    p, acc, m_i, l_i = softmax_update(acc, m_i, l_i, s)
    if MASKED and CAUSAL:
        # p = 0 on masked pairs, but 0 * NaN is NaN: non-finite values enter the
        # product as 0, and a row gets NaN in column c when it sees the first
        # non-finite value of that column (visibility is monotone in the key).
        finite = tl.abs(v.to(tl.float32)) < float("inf")
        first_bad = tl.min(tl.where(finite, 2147483647, (n0 + offs_n)[:, None]), 0)
        v = tl.where(finite, v, 0.0).to(q.dtype)
        acc = tl.dot(p.to(q.dtype), v, acc, input_precision=PRECISION)
        acc = tl.where(first_bad[None, :] <= q_pos[:, None], float("nan"), acc)
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _clamped(ptr, b, low, high):
    """``ptr[b]`` (any integer width) loaded at int64, clamped to ``[low, high]`` and narrowed to int32."""
    value = tl.load(ptr + b).to(tl.int64)
    return tl.minimum(tl.maximum(value, low), high).to(tl.int32)


@triton.jit
def _sequence_context(
    b, q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, Sq, Sk, HAS_QLEN, HAS_KLEN, POS_ARRAY, VARLEN
):
    """The :class:`Sequence` of batch or sequence ``b``.

    ``bq``/``bk`` (int64) index the batch axis of q-side and k-side tensors:
    ``b`` itself, or with ``VARLEN`` the first token of sequence ``b`` (the
    host then passes each tensor's token stride as its batch stride).
    ``q_len``/``k_len`` count the valid queries and keys, ``pos0`` is the
    position of query 0, and ``q_rows``/``k_rows`` bound the rows a program
    may store: ``Sq``/``Sk``, or the sequence's own lengths with ``VARLEN``,
    whose pointers ``q_len_ptr``/``k_len_ptr`` are the ``(B + 1,)`` prefix sums
    and ``Sq``/``Sk`` the packed lengths.

    Array values are read at int64 and clamped where clamping changes no
    result: lengths (and starts and ends) to ``[0, S]``, the position to
    ``[-Sq, Sk]`` (from ``Sk`` on every key is visible, up to ``-Sq`` none is),
    so no value wraps or leads a load out of bounds. ``pos_scalar`` arrives clamped.
    """
    if VARLEN:
        q_start = _clamped(q_len_ptr, b, 0, Sq)
        q_len = _clamped(q_len_ptr, b + 1, q_start, Sq) - q_start
        k_start = _clamped(k_len_ptr, b, 0, Sk)
        k_len = _clamped(k_len_ptr, b + 1, k_start, Sk) - k_start
        rows = (q_start.to(tl.int64), k_start.to(tl.int64), q_len, k_len)
    else:
        q_len = Sq
        if HAS_QLEN:
            q_len = _clamped(q_len_ptr, b, 0, Sq)
        k_len = Sk
        if HAS_KLEN:
            k_len = _clamped(k_len_ptr, b, 0, Sk)
        rows = (b.to(tl.int64), b.to(tl.int64), Sq, Sk)
    pos0 = pos_scalar
    if POS_ARRAY:
        pos0 = _clamped(pos_ptr, b, -Sq, Sk)
    bq, bk, q_rows, k_rows = rows
    return Sequence(bq, bk, q_len, k_len, pos0, q_rows, k_rows)


@triton.jit
def _key_tiles(
    step, carry, ctx, start_m, seq,
    CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``carry`` through ``step`` (:func:`_forward_step` or :func:`_dq_step`, with ``ctx``) over
    the key tiles the query tile at ``start_m`` of the :class:`Sequence` ``seq`` sees.

    Keys ``[0, full_end)`` are visible to every row of the tile (unmasked steps),
    keys ``[full_end, hi)`` need a mask, keys from ``hi`` on are seen by none.
    """
    if CAUSAL:
        full_end = tl.minimum(seq.k_len, seq.pos0 + start_m + 1)
        hi = tl.minimum(seq.k_len, seq.pos0 + start_m + BLOCK_M)
    else:
        full_end = seq.k_len
        hi = seq.k_len
    live = start_m < seq.q_len
    # Negative where the tile's rows precede key 0 (input_pos < 0): no keys.
    full_end = (tl.maximum(tl.where(live, full_end, 0), 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.where(live, hi, 0), 0)
    carry = tile_loop(
        step, carry, 0, full_end, BLOCK_N, ctx, (False, CAUSAL, EVEN_D, EVEN_DV, PRECISION)
    )
    return tile_loop(
        step, carry, full_end, hi, BLOCK_N, ctx, (True, CAUSAL, EVEN_D, EVEN_DV, PRECISION)
    )


@triton.jit
def _query_tile(
    q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, H, GROUP, Sq, Sk, D, DV,
    CAUSAL: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, POS_ARRAY: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """``(seq, h, kvh, start_m, row_off, offs_m, rows, row_ok, cols)`` of this program in a 1-D
    grid of ``tiles * B * H`` (arguments as :func:`_forward_kernel`'s): its :class:`Sequence`,
    query and kv head (int64), first row (and at int64), the tile's row offsets, rows and
    which of them are queries, and the :data:`~._attn_common.Cols`.

    Consecutive programs share a head (and so its K/V in L2). Causal tiles
    run last-first: the tiles with the most keys start earliest, which
    shortens the tail of the launch. With ``VARLEN`` the grid is 2-D,
    ``(tiles of max_seqlen_q, B * H)`` (``Sq`` is then the packed length).
    """
    if VARLEN:
        n_tiles = tl.num_programs(0)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    else:
        n_tiles = tl.cdiv(Sq, BLOCK_M)
        pid = tl.program_id(0)
        pid_m = pid % n_tiles
        pid_bh = pid // n_tiles
    if CAUSAL:
        pid_m = n_tiles - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    kvh = (h // GROUP).to(tl.int64)
    seq = _sequence_context(
        b, q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, Sq, Sk, HAS_QLEN, HAS_KLEN, POS_ARRAY, VARLEN
    )
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    cols = Cols(tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), D, DV)
    rows = start_m + offs_m
    row_ok = rows < seq.q_len
    row_off = start_m.to(tl.int64)
    return seq, h.to(tl.int64), kvh, start_m, row_off, offs_m, rows, row_ok, cols


_SIZES = ["H", "GROUP", "Sq", "Sk", "pos_scalar", "D", "DV"]


@triton.jit(do_not_specialize=_SIZES)
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr,  # (B,H,Sq) float32 checkpoints; unused unless STORE_STATS
    q_len_ptr, k_len_ptr, pos_ptr,  # (B,) integers; read only if HAS_QLEN / HAS_KLEN / POS_ARRAY
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row; last axis contiguous)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_ob, stride_oh, stride_om,  # o strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    H, GROUP, Sq, Sk,  # query heads, query heads per kv head, query and key lengths
    pos_scalar,  # input_pos when it is one integer
    qk_scale,  # scale * log2(e)
    D, DV,  # head dims of q/k and v/o
    CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, POS_ARRAY: tl.constexpr,  # which arrays to read
    STORE_STATS: tl.constexpr,  # write the m, l checkpoints
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query and key tile
    VARLEN: tl.constexpr = False,  # packed sequences (see _sequence_context)
):  # fmt: skip
    """One query tile of one (batch, head): ``o`` and, with ``STORE_STATS``, ``m`` and ``l``."""
    seq, h, kvh, start_m, row_off, offs_m, rows, row_ok, cols = _query_tile(
        q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, H, GROUP, Sq, Sk, D, DV,
        CAUSAL, HAS_QLEN, HAS_KLEN, POS_ARRAY, BLOCK_D, BLOCK_DV, BLOCK_M, VARLEN,
    )  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)

    q_head = head_rows(Strided(q_ptr, stride_qb, stride_qh, stride_qm), seq.bq, h)
    q = load_rows(q_head, row_off, offs_m, row_ok, cols.d, D, True, EVEN_D).to(DOT_TYPE)
    kv = KV(
        head_rows(Strided(k_ptr, stride_kb, stride_kh, stride_kn), seq.bk, kvh),
        head_rows(Strided(v_ptr, stride_vb, stride_vh, stride_vn), seq.bk, kvh),
    )
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    ctx = (q, kv, cols, offs_n, seq.pos0 + rows, seq.k_len, qk_scale)
    acc, m_i, l_i = _key_tiles(
        _forward_step, (acc, m_i, l_i), ctx, start_m, seq,
        CAUSAL, EVEN_D, EVEN_DV, PRECISION, BLOCK_M, BLOCK_N,
    )  # fmt: skip

    live = row_ok & (l_i != 0.0)  # a NaN sum (a row that saw NaN) stays live: o, m, l NaN
    out = (
        head_rows(Strided(o_ptr, stride_ob, stride_oh, stride_om), seq.bq, h),
        head_rows(Strided(m_ptr, stride_mb, stride_mh, stride_mm), seq.bq, h),
        head_rows(Strided(l_ptr, stride_lb, stride_lh, stride_lm), seq.bq, h),
    )
    state = (acc, m_i, l_i)
    in_bounds = rows < seq.q_rows
    store_output(out, row_off, state, live, offs_m, in_bounds, cols, EVEN_DV, STORE_STATS)


@triton.jit(do_not_specialize=["H", "Sq", "DV"])
def _delta_kernel(
    o_ptr, do_ptr, delta_ptr,  # (B,H,Sq,DV) output and its cotangent; (B,H,Sq) float32 delta
    q_len_ptr,  # (B,) valid query counts; unused unless HAS_QLEN
    stride_ob, stride_oh, stride_om,  # o strides
    stride_dob, stride_doh, stride_dom,  # do strides
    stride_deb, stride_deh, stride_dem,  # delta strides
    H, Sq, DV,  # query heads, query length, value head dim
    HAS_QLEN: tl.constexpr,
    EVEN_DV: tl.constexpr,  # DV == BLOCK_DV
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,  # row tile, padded value head dim
    VARLEN: tl.constexpr = False,  # q_len_ptr: (B + 1,) prefix sums; grid (tiles, B * H)
):  # fmt: skip
    """``delta = rowsum(do * o)`` in float32; 0 for rows ``>= q_lengths[b]``."""
    if VARLEN:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        seq = pid_bh // H
        q_start = _clamped(q_len_ptr, seq, 0, Sq)
        q_len = _clamped(q_len_ptr, seq + 1, q_start, Sq) - q_start
        b = q_start.to(tl.int64)
        q_rows = q_len
    else:
        n_tiles = tl.cdiv(Sq, BLOCK_M)
        pid_m = tl.program_id(0) % n_tiles
        pid_bh = tl.program_id(0) // n_tiles
        b = (pid_bh // H).to(tl.int64)
        q_len = Sq
        if HAS_QLEN:
            q_len = _clamped(q_len_ptr, b, 0, Sq)
        q_rows = Sq
    h = (pid_bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = (start_m + offs_m) < q_len
    row_off = start_m.to(tl.int64)
    o_head = head_rows(Strided(o_ptr, stride_ob, stride_oh, stride_om), b, h)
    o = load_rows(o_head, row_off, offs_m, row_ok, offs_dv, DV, True, EVEN_DV)
    do_head = head_rows(Strided(do_ptr, stride_dob, stride_doh, stride_dom), b, h)
    do = load_rows(do_head, row_off, offs_m, row_ok, offs_dv, DV, True, EVEN_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    out = head_rows(Strided(delta_ptr, stride_deb, stride_deh, stride_dem), b, h)
    ptrs = out.base + row_off * out.stride + offs_m * out.stride
    tl.store(ptrs, delta, mask=(start_m + offs_m) < q_rows)


@triton.jit
def _dkdv_step(
    carry,
    m0,
    ctx,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
):
    """Add the query tile at ``m0`` of one query head to a key tile's ``carry = (dk, dv)``
    (``dk`` unscaled).

    ``ctx``: the key tile ``k``, ``v`` and its key positions, the head's
    :data:`~._attn_common.BackwardRows`, the :data:`~._attn_common.Cols`, the query row
    offsets of a tile, the :class:`Sequence` and ``scale * log2 e``.
    ``WITH_DK`` / ``WITH_DV`` select the gradients formed (the other is
    returned as given): dV alone needs neither ``dp`` nor ``v``.

    Transposed form: every product has the key tile as its M dimension --
    ``s^T = k q^T`` and ``dp^T = v dO^T`` are ``(BLOCK_N, BLOCK_M)``, then
    ``dv += p^T dO`` and ``dk += ds^T q`` -- so with ``BLOCK_N >= 64`` each
    lowers to a warpgroup MMA on Hopper, Q and dO being the shared-memory B
    operands. ``MASKED`` applies the causal mask (query tiles crossing the
    diagonal); rows ``>= q_len`` are excluded by the loads (``P = 0`` there).
    """
    dk, dv = carry
    k, v, key_pos, head, cols, offs_m, seq, qk_scale = ctx
    rows = m0 + offs_m
    row_ok = rows < seq.q_len
    row_off = tl.cast(m0, tl.int64)
    q, do, lse2, delta = query_tile(head, row_off, offs_m, row_ok, cols, EVEN_D, EVEN_DV, k.dtype)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:
        # Masked pairs get p = ds = 0 by selection (never 0 * NaN); a query
        # row's non-finite entries enter dK as 0 -- the pairs that see them
        # carry NaN in ds already.
        visible = key_pos[:, None] <= (seq.pos0 + rows)[None, :]
        p_t = tl.where(visible, p_t, 0.0)
        if WITH_DV:
            dv = tl.dot(p_t.to(k.dtype), do, dv, input_precision=PRECISION)
        if WITH_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = tl.where(visible, p_t * (dp_t - delta[None, :]), 0.0)
            q_finite = tl.where(tl.abs(q.to(tl.float32)) < float("inf"), q, 0.0).to(k.dtype)
            dk = tl.dot(ds_t.to(k.dtype), q_finite, dk, input_precision=PRECISION)
    else:
        if WITH_DV:
            dv = tl.dot(p_t.to(k.dtype), do, dv, input_precision=PRECISION)
        if WITH_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(k.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(
    tile,
    cols,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr,
    MASK_ALL: tl.constexpr,
):
    """dK and/or dV (``WITH_DK``, ``WITH_DV``) of one key tile of one (batch, kv head),
    summed over the GQA group and stored.

    ``tile`` (from :func:`_dkdv_kernel`): the :data:`~._attn_common.BackwardRows`, the K and V, and the
    dK and dV (:data:`~._attn_common.KV`) as :data:`~._attn_common.Strided` tensors, the
    batch's :class:`Sequence`, the kv head, the key tile's first key, the query heads per
    kv head, the softmax scale and ``scale * log2 e``; the flags as :func:`_dkdv_kernel`'s.

    ``MASK_ALL`` (causal): every query tile from the diagonal on goes through the masked
    step, in one loop, instead of the masked tiles then the full ones in a second loop.
    The mask is then evaluated where it keeps every pair -- a compare and two selects per
    pair, and in the dK program a pass of the Q tile through registers (non-finite entries
    to 0, as on the diagonal) -- but one pipelined loop holds fewer registers than two:
    the split programs' causal build compiles without spills only this way (sm_90, 64
    keys, 3 stages: 248 registers; with two loops 18 bytes spill).
    """
    tensors, kv, grads, seq, kvh, start_n, group, scale, qk_scale = tile
    kvh64 = kvh.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    key_pos = start_n + offs_n
    key_ok = key_pos < seq.k_len
    key_off = start_n.to(tl.int64)
    k_head = head_rows(kv.k, seq.bk, kvh64)
    v_head = head_rows(kv.v, seq.bk, kvh64)
    k = load_rows(k_head, key_off, offs_n, key_ok, cols.d, cols.D, True, EVEN_D).to(DOT_TYPE)
    v = load_rows(v_head, key_off, offs_n, key_ok, cols.dv, cols.DV, True, EVEN_DV)
    v = v.to(k.dtype)
    dk = tl.zeros(k.shape, dtype=tl.float32)
    dv = tl.zeros(v.shape, dtype=tl.float32)

    # Query tiles [m_lo, m_full) cross the causal diagonal; from m_full on every
    # row sees every valid key of the tile. A tile past k_len visits none.
    m_lo = 0
    m_full = 0
    if CAUSAL:
        last_key = tl.minimum(start_n + BLOCK_N, seq.k_len) - 1
        m_lo = (tl.maximum(start_n - seq.pos0, 0) // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(tl.maximum(last_key - seq.pos0, 0), BLOCK_M) * BLOCK_M
    key_tile_live = start_n < seq.k_len
    m_lo = tl.where(key_tile_live, m_lo, seq.q_len)
    m_full = tl.where(key_tile_live, m_full, seq.q_len)
    m_diag_end = tl.minimum(m_full, seq.q_len)
    if MASK_ALL:
        m_diag_end = seq.q_len
    g = 0
    while g < group:
        head = backward_heads(tensors, seq.bq, (kvh * group + g).to(tl.int64))
        ctx = (k, v, key_pos, head, cols, offs_m, seq, qk_scale)
        if CAUSAL:
            dk, dv = tile_loop(
                _dkdv_step, (dk, dv), m_lo, m_diag_end, BLOCK_M, ctx,
                (True, EVEN_D, EVEN_DV, PRECISION, WITH_DK, WITH_DV),
            )  # fmt: skip
        if not (CAUSAL and MASK_ALL):
            dk, dv = tile_loop(
                _dkdv_step, (dk, dv), m_full, seq.q_len, BLOCK_M, ctx,
                (False, EVEN_D, EVEN_DV, PRECISION, WITH_DK, WITH_DV),
            )  # fmt: skip
        g += 1

    in_bounds = key_pos < seq.k_rows
    if WITH_DK:
        dk = tl.where(key_ok[:, None], dk * scale, 0.0)
        dk_head = head_rows(grads.k, seq.bk, kvh64)
        store_rows(dk_head, key_off, offs_n, in_bounds, cols.d, cols.D, dk, EVEN_D)
    if WITH_DV:
        dv = tl.where(key_ok[:, None], dv, 0.0)
        dv_head = head_rows(grads.v, seq.bk, kvh64)
        store_rows(dv_head, key_off, offs_n, in_bounds, cols.dv, cols.DV, dv, EVEN_DV)


@triton.jit(do_not_specialize=["HKV", "GROUP", "Sq", "Sk", "pos_scalar", "D", "DV"])
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr, delta_ptr,  # (B,H,Sq) float32 checkpoints and delta
    dk_ptr, dv_ptr,  # (B,Hkv,Sk,D), (B,Hkv,Sk,DV) shadows, overwritten
    q_len_ptr, k_len_ptr, pos_ptr,  # (B,) integers; read only if HAS_QLEN / HAS_KLEN / POS_ARRAY
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_dob, stride_doh, stride_dom,  # do strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    stride_deb, stride_deh, stride_dem,  # delta strides
    stride_dkb, stride_dkh, stride_dkn,  # dk strides
    stride_dvb, stride_dvh, stride_dvn,  # dv strides
    HKV, GROUP, Sq, Sk,  # kv heads, query heads per kv head, query and key lengths
    pos_scalar,  # input_pos when it is one integer
    scale, qk_scale,  # softmax scale, and scale * log2(e)
    D, DV,  # head dims
    CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, POS_ARRAY: tl.constexpr,  # which arrays to read
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # the padded head dims equal D, DV
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query tile, key tile
    SPLIT: tl.constexpr = False,  # two programs per key tile: dV in the even one, dK in the odd
    VARLEN: tl.constexpr = False,  # packed sequences; grid (key tiles of max_seqlen_k, B * Hkv)
):  # fmt: skip
    """One key tile of one (batch, kv head): dK and dV, summed over the GQA group.

    With ``SPLIT`` (head dims of 256, see :func:`dkdv_split`) the grid has two
    programs per key tile, next to each other so that they read the same Q
    and dO tiles from L2 at about the same time: the even one forms dV, the
    odd one dK. Each then holds one ``(BLOCK_N, 256)`` float32 accumulator
    instead of two, which is what lets a 64-key tile -- the M dimension of
    Hopper's warpgroup MMA -- fit the register file without spilling. The
    price is ``s^T = k q^T`` formed twice: per key and query tile the pair
    forms 5 products of ``2 * BLOCK_N * BLOCK_M * D`` FLOPs (s, dv | s, dp,
    dk) instead of 4, so this kernel does 1.25x the FLOPs and the backward
    (dQ forms 3) 8/7 = 1.14x. Splitting the head dim of both accumulators
    instead would form s and dp in both programs (6 products, 1.5x); 16
    warps, or 1 stage, spill at 64 keys with both accumulators. FA3's sm_90
    hdim-256 backward keeps both in one program (64 queries x 80 keys over two
    MMA warpgroups, producer warps handing their registers to them) and adds
    dQ by float32 atomics, so it is not deterministic at that head dim; this
    backend keeps its deterministic dQ pass instead.
    """
    if VARLEN:
        pid_n = tl.program_id(0)
        pid_bkv = tl.program_id(1)
        if SPLIT:
            part = pid_n % 2
            pid_n = pid_n // 2
    else:
        n_tiles = tl.cdiv(Sk, BLOCK_N)
        pid = tl.program_id(0)
        if SPLIT:
            part = pid % 2
            pid = pid // 2
        pid_n = pid % n_tiles
        pid_bkv = pid // n_tiles
    b = pid_bkv // HKV
    kvh = pid_bkv % HKV
    seq = _sequence_context(
        b, q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, Sq, Sk, HAS_QLEN, HAS_KLEN, POS_ARRAY, VARLEN
    )
    tensors = BackwardRows(
        Strided(q_ptr, stride_qb, stride_qh, stride_qm),
        Strided(do_ptr, stride_dob, stride_doh, stride_dom),
        Strided(m_ptr, stride_mb, stride_mh, stride_mm),
        Strided(l_ptr, stride_lb, stride_lh, stride_lm),
        Strided(delta_ptr, stride_deb, stride_deh, stride_dem),
    )
    kv = KV(
        Strided(k_ptr, stride_kb, stride_kh, stride_kn),
        Strided(v_ptr, stride_vb, stride_vh, stride_vn),
    )
    grads = KV(
        Strided(dk_ptr, stride_dkb, stride_dkh, stride_dkn),
        Strided(dv_ptr, stride_dvb, stride_dvh, stride_dvn),
    )
    tile = (tensors, kv, grads, seq, kvh, pid_n * BLOCK_N, GROUP, scale, qk_scale)
    cols = Cols(tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), D, DV)
    if not SPLIT:
        _dkdv_program(
            tile, cols, CAUSAL, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_M, BLOCK_N,
            True, True, False,
        )  # fmt: skip
    elif part == 0:
        _dkdv_program(
            tile, cols, CAUSAL, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_M, BLOCK_N,
            False, True, True,
        )  # fmt: skip
    else:
        _dkdv_program(
            tile, cols, CAUSAL, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_M, BLOCK_N,
            True, False, True,
        )  # fmt: skip


@triton.jit
def _dq_step(
    dq,
    n0,
    ctx,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Add the key tile at ``n0`` to a query tile's ``dq`` (unscaled); ``MASKED`` as forward.

    ``ctx``: the query tile's ``q``, ``do``, ``lse2`` and ``delta``, then as
    :func:`_forward_step`'s from the :data:`~._attn_common.KV` on.
    """
    q, do, lse2, delta, kv, cols, offs_n, q_pos, k_len, qk_scale = ctx
    k, v = kv_tile(kv, n0, offs_n, cols, k_len, MASKED, EVEN_D, EVEN_DV)
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v.to(q.dtype)), input_precision=PRECISION)
    if MASKED:
        # As in _dkdv_step: ds = 0 on masked pairs by selection, non-finite keys
        # enter dQ as 0 (the pairs that see them carry NaN in ds).
        visible = _visible(n0, offs_n, q_pos, k_len, CAUSAL)
        ds = tl.where(visible, p * (dp - delta[:, None]), 0.0)
        k = tl.where(tl.abs(k.to(tl.float32)) < float("inf"), k, 0.0).to(q.dtype)
    else:
        ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(q.dtype), k, dq, input_precision=PRECISION)


@triton.jit(do_not_specialize=_SIZES)
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr, delta_ptr,  # (B,H,Sq) float32 checkpoints and delta
    dq_ptr,  # (B,H,Sq,D) shadow, overwritten
    q_len_ptr, k_len_ptr, pos_ptr,  # (B,) integers; read only if HAS_QLEN / HAS_KLEN / POS_ARRAY
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_dob, stride_doh, stride_dom,  # do strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    stride_deb, stride_deh, stride_dem,  # delta strides
    stride_dqb, stride_dqh, stride_dqm,  # dq strides
    H, GROUP, Sq, Sk,  # query heads, query heads per kv head, query and key lengths
    pos_scalar,  # input_pos when it is one integer
    scale, qk_scale,  # softmax scale, and scale * log2(e)
    D, DV,  # head dims
    CAUSAL: tl.constexpr,
    HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, POS_ARRAY: tl.constexpr,  # which arrays to read
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query tile, key tile
    VARLEN: tl.constexpr = False,  # packed sequences (see _sequence_context)
):  # fmt: skip
    """One query tile of one (batch, head): dQ."""
    seq, h, kvh, start_m, row_off, offs_m, rows, row_ok, cols = _query_tile(
        q_len_ptr, k_len_ptr, pos_ptr, pos_scalar, H, GROUP, Sq, Sk, D, DV,
        CAUSAL, HAS_QLEN, HAS_KLEN, POS_ARRAY, BLOCK_D, BLOCK_DV, BLOCK_M, VARLEN,
    )  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)

    tensors = BackwardRows(
        Strided(q_ptr, stride_qb, stride_qh, stride_qm),
        Strided(do_ptr, stride_dob, stride_doh, stride_dom),
        Strided(m_ptr, stride_mb, stride_mh, stride_mm),
        Strided(l_ptr, stride_lb, stride_lh, stride_lm),
        Strided(delta_ptr, stride_deb, stride_deh, stride_dem),
    )
    head = backward_heads(tensors, seq.bq, h)
    q, do, lse2, delta = query_tile(head, row_off, offs_m, row_ok, cols, EVEN_D, EVEN_DV, DOT_TYPE)
    kv = KV(
        head_rows(Strided(k_ptr, stride_kb, stride_kh, stride_kn), seq.bk, kvh),
        head_rows(Strided(v_ptr, stride_vb, stride_vh, stride_vn), seq.bk, kvh),
    )
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    ctx = (q, do, lse2, delta, kv, cols, offs_n, seq.pos0 + rows, seq.k_len, qk_scale)
    dq = _key_tiles(
        _dq_step, dq, ctx, start_m, seq, CAUSAL, EVEN_D, EVEN_DV, PRECISION, BLOCK_M, BLOCK_N
    )

    dq = tl.where(row_ok[:, None], dq * scale, 0.0)
    dq_head = head_rows(Strided(dq_ptr, stride_dqb, stride_dqh, stride_dqm), seq.bq, h)
    store_rows(dq_head, row_off, offs_m, rows < seq.q_rows, cols.d, D, dq, EVEN_D)
