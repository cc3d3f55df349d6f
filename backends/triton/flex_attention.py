r"""FlexAttention on Triton: the attention kernels' FA2 structure with generated mod code inlined.

The score and mask mods arrive as traced graphs; :mod:`._flex_host` turns
each into ``@triton.jit`` functions (:mod:`xpkernels.mods.codegen`) that the
kernels receive as compile-time arguments and call on every tile, with the
captured arrays and the graph's constants as run-time arguments (a new table
or constant never recompiles). The tile plan becomes per-tile lists: a
program walks only the tiles its list names, and evaluates the mask only on
PARTIAL ones (tiles proven full never evaluate it).

Forward, one program per (query tile, batch, query head): ``s = q k^T *
scale`` in natural units goes through the score mod, the mask selects it to
``-inf``, then it is scaled by ``log2 e`` for the online softmax in ``exp2``;
the checkpoints leave in natural-log units (``m = max s``, ``l = sum
exp(s - m)``), the contract every backend shares. GQA reads kv head
``h // (H // Hkv)``.

Backward, with ``P`` rebuilt from the checkpoints and ``dS = P (dO V^T -
delta)`` taken through the score mod's reverse mode:

1. ``delta = rowsum(dO O)`` (the attention backend's kernel);
2. one program per (key tile, batch, kv head) sums dK and dV over the GQA
   group and the query tiles visiting it (no atomics), and adds the score
   mod's array gradients into float32 partial rows of its own (in the caller's
   ``scratch.score_mod_workspace``), by load + add
   + store (repeated indices of a tile combined first: sorted, summed by a
   segmented scan, stored once); programs that provably write disjoint
   elements (an index ``kv_idx + c``, ``b + c``, ``h + c``) share a row;
3. one program per query tile recomputes ``dS`` and writes dQ;
4. the partial rows are summed in a fixed order into the accumulators, so
   the gradients are bit-identical run to run. With ``deterministic=False``
   step 2 adds with float32 atomics instead (no partial rows, no step 4;
   their order, hence the last bits of the sums, may vary between runs).

Rows that keep no key get ``o = 0``, ``m = -inf``, ``l = 0`` and zero
gradients. Every stride is passed to the kernels; batch, head and row offsets
are int64.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import _flex_host
from ._attn_common import (
    LN2_CONST,
    LOG2E_CONST,
    RANGE_LOOPS,
    dim_block,
    dot_precision,
    dot_type,
    interpreted,
    kv_tile,
    row_max,
)
from ._common import launch_context, traced
from ._flex_host import FULL_CONST, PARTIAL_CONST, Mods, strides, tile_lists, workspace_layout
from .attention import (
    _DELTA_TILE,
    _DKDV_TILES,
    _DQ_TILES,
    _FORWARD_TILES,
    _delta_kernel,
    _load_rows,
    _row_stats,
    _store_rows,
)

__all__ = ["backward", "default_tiles", "forward", "score_mod_workspace"]

#: Plan tiles on a GPU: every kernel tile of the attention kernels' tables divides them.
PLAN_TILE = 128


def default_tiles(n_q: int, n_kv: int, group: int, masked: bool) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of a plan: 16 x 16 under the interpreter, else 128 x 128."""
    tile = 16 if interpreted() else PLAN_TILE
    return tile, tile


@triton.jit
def _tile_scores(
    a,
    c,
    b,
    h,
    q_idx,
    q_row,
    n0,
    offs_n,
    row_ok,
    Sk,
    scale,
    state,
    states_base,
    stride_si,
    plan_tm,
    plan_tn,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    PRECISION: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """``(s, s_mod, keep)`` of the key tile at ``n0``: raw and modified natural scores, kept pairs.

    ``s = a c^T * scale``: ``a = q``, ``c = k`` give ``(queries, keys)`` tiles; with
    ``TRANSPOSED``, ``a = k``, ``c = q`` give ``(keys, queries)`` tiles, and ``q_idx``,
    ``q_row`` come as ``(1, BLOCK_M)``.
    """
    s = tl.dot(a, tl.trans(c), input_precision=PRECISION) * scale
    keys = n0 + offs_n
    if TRANSPOSED:
        kv_idx = keys.to(tl.int64)[:, None]
        keep = (keys < Sk)[:, None] & row_ok[None, :]
    else:
        kv_idx = keys.to(tl.int64)[None, :]
        keep = row_ok[:, None] & (keys < Sk)[None, :]
    s_mod = s
    if HAS_SCORE:
        s_mod = SCORE_FN(s, b, h, q_idx, kv_idx, q_row, score_arrs, score_consts)
    if HAS_MASK:
        if state == PARTIAL_CONST:
            inside = MASK_FN(b, h, q_idx, kv_idx, q_row, mask_arrs, mask_consts)
            if not EXACT:
                plan_state = tl.load(
                    states_base + (q_row // plan_tm) * stride_si + kv_idx // plan_tn,
                    mask=keep,
                    other=0,
                )
                inside = tl.where(plan_state == PARTIAL_CONST, inside, plan_state == FULL_CONST)
            keep = tl.where(inside, keep, False)  # a select: a mask may not span the tile
    return s, s_mod, keep, kv_idx


@triton.jit
def _entry(list_base, t):
    """``(tile, state)`` of entry ``t`` of a tile list."""
    e = tl.load(list_base + t)
    return e >> 2, e & 3


@triton.jit
def _forward_step(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    list_base,
    t,
    b,
    h,
    q_idx,
    q_row,
    row_ok,
    offs_n,
    offs_d,
    offs_dv,
    stride_kn,
    stride_vn,
    Sk,
    scale,
    D,
    DV,
    states_base,
    stride_si,
    plan_tm,
    plan_tn,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update of ``acc, m_i, l_i`` by the ``t``-th key tile of the list."""
    j, state = _entry(list_base, t)
    n0 = j * BLOCK_N
    k, v = kv_tile(
        k_base,
        v_base,
        n0,
        stride_kn,
        stride_vn,
        offs_n,
        offs_d,
        offs_dv,
        Sk,
        D,
        DV,
        True,
        EVEN_D,
        EVEN_DV,
    )
    _, s, keep, _ = _tile_scores(
        q,
        k.to(DOT_TYPE),
        b,
        h,
        q_idx,
        q_row,
        n0,
        offs_n,
        row_ok,
        Sk,
        scale,
        state,
        states_base,
        stride_si,
        plan_tm,
        plan_tn,
        score_arrs,
        score_consts,
        mask_arrs,
        mask_consts,
        SCORE_FN,
        MASK_FN,
        HAS_SCORE,
        HAS_MASK,
        EXACT,
        PRECISION,
        False,
    )
    s = tl.where(keep, s * LOG2E_CONST, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_TYPE), v.to(DOT_TYPE), acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    pos_ptr,
    count_ptr,
    list_ptr,
    states_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_cb,
    stride_ch,
    stride_eb,
    stride_eh,
    stride_ei,
    stride_sb,
    stride_sh,
    stride_si,
    plan_tm,
    plan_tn,
    H,
    GROUP,
    Sq,
    Sk,
    scale,
    D,
    DV,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    STORE_STATS: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``o`` (and ``m``, ``l``) of one (query tile, batch, head) over its listed key tiles."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    g = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    row_ok = rows < Sq
    q_row = rows.to(tl.int64)[:, None]
    q_idx = tl.load(pos_ptr + b).to(tl.int64) + q_row
    row_off = start_m.to(tl.int64)
    q = _load_rows(
        q_ptr + b * stride_qb + h * stride_qh,
        row_off,
        stride_qm,
        offs_m,
        offs_d,
        row_ok,
        D,
        EVEN_D,
    ).to(DOT_TYPE)
    k_base = k_ptr + b * stride_kb + g * stride_kh
    v_base = v_ptr + b * stride_vb + g * stride_vh
    count = tl.load(count_ptr + b * stride_cb + h * stride_ch + pid_m)
    list_base = list_ptr + b * stride_eb + h * stride_eh + pid_m * stride_ei
    states_base = states_ptr + b * stride_sb + h * stride_sh
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if RANGE_LOOPS:
        for t in range(0, count):
            acc, m_i, l_i = _forward_step(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                list_base,
                t,
                b,
                h,
                q_idx,
                q_row,
                row_ok,
                offs_n,
                offs_d,
                offs_dv,
                stride_kn,
                stride_vn,
                Sk,
                scale,
                D,
                DV,
                states_base,
                stride_si,
                plan_tm,
                plan_tn,
                score_arrs,
                score_consts,
                mask_arrs,
                mask_consts,
                SCORE_FN,
                MASK_FN,
                HAS_SCORE,
                HAS_MASK,
                EXACT,
                EVEN_D,
                EVEN_DV,
                PRECISION,
                DOT_TYPE,
                BLOCK_N,
            )
    else:
        t = 0
        while t < count:
            acc, m_i, l_i = _forward_step(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                list_base,
                t,
                b,
                h,
                q_idx,
                q_row,
                row_ok,
                offs_n,
                offs_d,
                offs_dv,
                stride_kn,
                stride_vn,
                Sk,
                scale,
                D,
                DV,
                states_base,
                stride_si,
                plan_tm,
                plan_tn,
                score_arrs,
                score_consts,
                mask_arrs,
                mask_consts,
                SCORE_FN,
                MASK_FN,
                HAS_SCORE,
                HAS_MASK,
                EXACT,
                EVEN_D,
                EVEN_DV,
                PRECISION,
                DOT_TYPE,
                BLOCK_N,
            )
            t += 1
    live = l_i != 0.0  # a NaN sum (a row that saw NaN) stays live: o, m, l NaN
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    o = tl.where(live[:, None], o, 0.0)
    o_base = o_ptr + b * stride_ob + h * stride_oh + row_off * stride_om
    _store_rows(o_base, stride_om, offs_m, offs_dv, row_ok, DV, o, EVEN_DV)
    if STORE_STATS:
        m_out = tl.where(live, m_i * LN2_CONST, float("-inf"))
        m_out = tl.where(l_i == l_i, m_out, float("nan"))
        l_out = tl.where(live, l_i, 0.0)
        m_base = m_ptr + b * stride_mb + h * stride_mh + row_off * stride_mm
        l_base = l_ptr + b * stride_lb + h * stride_lh + row_off * stride_lm
        tl.store(m_base + offs_m * stride_mm, m_out, mask=row_ok)
        tl.store(l_base + offs_m * stride_lm, l_out, mask=row_ok)


@triton.jit
def _probabilities(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    b,
    h,
    q_idx,
    q_row,
    n0,
    offs_n,
    row_ok,
    Sk,
    scale,
    state,
    states_base,
    stride_si,
    plan_tm,
    plan_tn,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    grads,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    VJP_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    PRECISION: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """``(p, ds)`` of a tile: probabilities and d loss / d (raw natural score).

    ``(queries, keys)`` tiles, or ``(keys, queries)`` with ``TRANSPOSED`` (the dK/dV
    pass, whose products then take ``p`` and ``ds`` as their left operand unchanged).
    """
    if TRANSPOSED:
        s, s_mod, keep, kv_idx = _tile_scores(
            k,
            q,
            b,
            h,
            q_idx,
            q_row,
            n0,
            offs_n,
            row_ok,
            Sk,
            scale,
            state,
            states_base,
            stride_si,
            plan_tm,
            plan_tn,
            score_arrs,
            score_consts,
            mask_arrs,
            mask_consts,
            SCORE_FN,
            MASK_FN,
            HAS_SCORE,
            HAS_MASK,
            EXACT,
            PRECISION,
            True,
        )
        p = tl.where(keep, tl.exp2(s_mod * LOG2E_CONST - lse2[None, :]), 0.0)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = tl.where(keep, p * (dp - delta[None, :]), 0.0)
    else:
        s, s_mod, keep, kv_idx = _tile_scores(
            q,
            k,
            b,
            h,
            q_idx,
            q_row,
            n0,
            offs_n,
            row_ok,
            Sk,
            scale,
            state,
            states_base,
            stride_si,
            plan_tm,
            plan_tn,
            score_arrs,
            score_consts,
            mask_arrs,
            mask_consts,
            SCORE_FN,
            MASK_FN,
            HAS_SCORE,
            HAS_MASK,
            EXACT,
            PRECISION,
            False,
        )
        p = tl.where(keep, tl.exp2(s_mod * LOG2E_CONST - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)
    if HAS_SCORE:
        ds = VJP_FN(s, b, h, q_idx, kv_idx, q_row, ds, keep, score_arrs, score_consts, grads)
        ds = tl.where(keep, ds, 0.0)
    return p, ds


@triton.jit
def _dkdv_step(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    m_base,
    l_base,
    delta_base,
    pos,
    list_base,
    t,
    b,
    h,
    n0,
    offs_m,
    offs_n,
    offs_d,
    offs_dv,
    stride_qm,
    stride_dom,
    stride_mm,
    stride_lm,
    stride_dem,
    Sq,
    Sk,
    scale,
    D,
    DV,
    states_base,
    stride_si,
    plan_tm,
    plan_tn,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    grads,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    VJP_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dK, dV contributions of the ``t``-th query tile of the list (one query head)."""
    i, state = _entry(list_base, t)
    start_m = i * BLOCK_M
    rows = start_m + offs_m
    row_ok = rows < Sq
    row_off = start_m.to(tl.int64)
    q_row = rows.to(tl.int64)[None, :]
    q_idx = pos + q_row
    q = _load_rows(q_base, row_off, stride_qm, offs_m, offs_d, row_ok, D, EVEN_D).to(DOT_TYPE)
    do = _load_rows(do_base, row_off, stride_dom, offs_m, offs_dv, row_ok, DV, EVEN_DV)
    do = do.to(DOT_TYPE)
    lse2, delta = _row_stats(
        m_base + row_off * stride_mm,
        l_base + row_off * stride_lm,
        delta_base + row_off * stride_dem,
        stride_mm,
        stride_lm,
        stride_dem,
        offs_m,
        row_ok,
    )
    p, ds = _probabilities(
        q,
        k,
        v,
        do,
        lse2,
        delta,
        b,
        h,
        q_idx,
        q_row,
        n0,
        offs_n,
        row_ok,
        Sk,
        scale,
        state,
        states_base,
        stride_si,
        plan_tm,
        plan_tn,
        score_arrs,
        score_consts,
        mask_arrs,
        mask_consts,
        grads,
        SCORE_FN,
        MASK_FN,
        VJP_FN,
        HAS_SCORE,
        HAS_MASK,
        EXACT,
        PRECISION,
        True,
    )
    dv = tl.dot(p.to(DOT_TYPE), do, dv, input_precision=PRECISION)
    dk = tl.dot(ds.to(DOT_TYPE), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    m_ptr,
    l_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    pos_ptr,
    count_ptr,
    list_ptr,
    states_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_deb,
    stride_deh,
    stride_dem,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_cb,
    stride_ch,
    stride_eb,
    stride_eh,
    stride_ei,
    stride_sb,
    stride_sh,
    stride_si,
    plan_tm,
    plan_tn,
    HKV,
    GROUP,
    Sq,
    Sk,
    scale,
    D,
    DV,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    grads,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    VJP_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK, dV of one (key tile, batch, kv head), summed over the group's heads and query tiles."""
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k, v = kv_tile(
        k_ptr + b * stride_kb + g * stride_kh,
        v_ptr + b * stride_vb + g * stride_vh,
        n0,
        stride_kn,
        stride_vn,
        offs_n,
        offs_d,
        offs_dv,
        Sk,
        D,
        DV,
        True,
        EVEN_D,
        EVEN_DV,
    )
    k = k.to(DOT_TYPE)
    v = v.to(DOT_TYPE)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    h = g * GROUP
    while h < (g + 1) * GROUP:
        count = tl.load(count_ptr + b * stride_cb + h * stride_ch + pid_n)
        list_base = list_ptr + b * stride_eb + h * stride_eh + pid_n * stride_ei
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_dob + h * stride_doh
        m_base = m_ptr + b * stride_mb + h * stride_mh
        l_base = l_ptr + b * stride_lb + h * stride_lh
        delta_base = delta_ptr + b * stride_deb + h * stride_deh
        states_base = states_ptr + b * stride_sb + h * stride_sh
        if RANGE_LOOPS:
            for t in range(0, count):
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    m_base,
                    l_base,
                    delta_base,
                    pos,
                    list_base,
                    t,
                    b,
                    h,
                    n0,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_dv,
                    stride_qm,
                    stride_dom,
                    stride_mm,
                    stride_lm,
                    stride_dem,
                    Sq,
                    Sk,
                    scale,
                    D,
                    DV,
                    states_base,
                    stride_si,
                    plan_tm,
                    plan_tn,
                    score_arrs,
                    score_consts,
                    mask_arrs,
                    mask_consts,
                    grads,
                    SCORE_FN,
                    MASK_FN,
                    VJP_FN,
                    HAS_SCORE,
                    HAS_MASK,
                    EXACT,
                    EVEN_D,
                    EVEN_DV,
                    PRECISION,
                    DOT_TYPE,
                    BLOCK_M,
                )
        else:
            t = 0
            while t < count:
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    m_base,
                    l_base,
                    delta_base,
                    pos,
                    list_base,
                    t,
                    b,
                    h,
                    n0,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_dv,
                    stride_qm,
                    stride_dom,
                    stride_mm,
                    stride_lm,
                    stride_dem,
                    Sq,
                    Sk,
                    scale,
                    D,
                    DV,
                    states_base,
                    stride_si,
                    plan_tm,
                    plan_tn,
                    score_arrs,
                    score_consts,
                    mask_arrs,
                    mask_consts,
                    grads,
                    SCORE_FN,
                    MASK_FN,
                    VJP_FN,
                    HAS_SCORE,
                    HAS_MASK,
                    EXACT,
                    EVEN_D,
                    EVEN_DV,
                    PRECISION,
                    DOT_TYPE,
                    BLOCK_M,
                )
                t += 1
        h += 1
    key_ok = (n0 + offs_n) < Sk
    key_off = n0.to(tl.int64)
    dk_base = dk_ptr + b * stride_dkb + g * stride_dkh + key_off * stride_dkn
    dv_base = dv_ptr + b * stride_dvb + g * stride_dvh + key_off * stride_dvn
    _store_rows(dk_base, stride_dkn, offs_n, offs_d, key_ok, D, dk * scale, EVEN_D)
    _store_rows(dv_base, stride_dvn, offs_n, offs_dv, key_ok, DV, dv, EVEN_DV)


@triton.jit
def _dq_step(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    list_base,
    t,
    b,
    h,
    q_idx,
    q_row,
    row_ok,
    offs_n,
    offs_d,
    offs_dv,
    stride_kn,
    stride_vn,
    Sk,
    scale,
    D,
    DV,
    states_base,
    stride_si,
    plan_tm,
    plan_tn,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    VJP_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ contribution of the ``t``-th key tile of the list."""
    j, state = _entry(list_base, t)
    n0 = j * BLOCK_N
    k, v = kv_tile(
        k_base,
        v_base,
        n0,
        stride_kn,
        stride_vn,
        offs_n,
        offs_d,
        offs_dv,
        Sk,
        D,
        DV,
        True,
        EVEN_D,
        EVEN_DV,
    )
    k = k.to(DOT_TYPE)
    _, ds = _probabilities(
        q,
        k,
        v.to(DOT_TYPE),
        do,
        lse2,
        delta,
        b,
        h,
        q_idx,
        q_row,
        n0,
        offs_n,
        row_ok,
        Sk,
        scale,
        state,
        states_base,
        stride_si,
        plan_tm,
        plan_tn,
        score_arrs,
        score_consts,
        mask_arrs,
        mask_consts,
        0,
        SCORE_FN,
        MASK_FN,
        VJP_FN,
        HAS_SCORE,
        HAS_MASK,
        EXACT,
        PRECISION,
        False,
    )
    return tl.dot(ds.to(DOT_TYPE), k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    m_ptr,
    l_ptr,
    delta_ptr,
    dq_ptr,
    pos_ptr,
    count_ptr,
    list_ptr,
    states_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_deb,
    stride_deh,
    stride_dem,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_cb,
    stride_ch,
    stride_eb,
    stride_eh,
    stride_ei,
    stride_sb,
    stride_sh,
    stride_si,
    plan_tm,
    plan_tn,
    H,
    GROUP,
    Sq,
    Sk,
    scale,
    D,
    DV,
    score_arrs,
    score_consts,
    mask_arrs,
    mask_consts,
    SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr,
    VJP_FN: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EXACT: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ of one (query tile, batch, head) over its listed key tiles."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    g = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    row_ok = rows < Sq
    row_off = start_m.to(tl.int64)
    q_row = rows.to(tl.int64)[:, None]
    q_idx = tl.load(pos_ptr + b).to(tl.int64) + q_row
    q = _load_rows(
        q_ptr + b * stride_qb + h * stride_qh,
        row_off,
        stride_qm,
        offs_m,
        offs_d,
        row_ok,
        D,
        EVEN_D,
    ).to(DOT_TYPE)
    do = _load_rows(
        do_ptr + b * stride_dob + h * stride_doh,
        row_off,
        stride_dom,
        offs_m,
        offs_dv,
        row_ok,
        DV,
        EVEN_DV,
    ).to(DOT_TYPE)
    lse2, delta = _row_stats(
        m_ptr + b * stride_mb + h * stride_mh + row_off * stride_mm,
        l_ptr + b * stride_lb + h * stride_lh + row_off * stride_lm,
        delta_ptr + b * stride_deb + h * stride_deh + row_off * stride_dem,
        stride_mm,
        stride_lm,
        stride_dem,
        offs_m,
        row_ok,
    )
    k_base = k_ptr + b * stride_kb + g * stride_kh
    v_base = v_ptr + b * stride_vb + g * stride_vh
    count = tl.load(count_ptr + b * stride_cb + h * stride_ch + pid_m)
    list_base = list_ptr + b * stride_eb + h * stride_eh + pid_m * stride_ei
    states_base = states_ptr + b * stride_sb + h * stride_sh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if RANGE_LOOPS:
        for t in range(0, count):
            dq = _dq_step(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base,
                v_base,
                list_base,
                t,
                b,
                h,
                q_idx,
                q_row,
                row_ok,
                offs_n,
                offs_d,
                offs_dv,
                stride_kn,
                stride_vn,
                Sk,
                scale,
                D,
                DV,
                states_base,
                stride_si,
                plan_tm,
                plan_tn,
                score_arrs,
                score_consts,
                mask_arrs,
                mask_consts,
                SCORE_FN,
                MASK_FN,
                VJP_FN,
                HAS_SCORE,
                HAS_MASK,
                EXACT,
                EVEN_D,
                EVEN_DV,
                PRECISION,
                DOT_TYPE,
                BLOCK_N,
            )
    else:
        t = 0
        while t < count:
            dq = _dq_step(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base,
                v_base,
                list_base,
                t,
                b,
                h,
                q_idx,
                q_row,
                row_ok,
                offs_n,
                offs_d,
                offs_dv,
                stride_kn,
                stride_vn,
                Sk,
                scale,
                D,
                DV,
                states_base,
                stride_si,
                plan_tm,
                plan_tn,
                score_arrs,
                score_consts,
                mask_arrs,
                mask_consts,
                SCORE_FN,
                MASK_FN,
                VJP_FN,
                HAS_SCORE,
                HAS_MASK,
                EXACT,
                EVEN_D,
                EVEN_DV,
                PRECISION,
                DOT_TYPE,
                BLOCK_N,
            )
            t += 1
    dq_base = dq_ptr + b * stride_dqb + h * stride_dqh + row_off * stride_dqm
    _store_rows(dq_base, stride_dqm, offs_m, offs_d, row_ok, D, dq * scale, EVEN_D)


_POSITIONS: dict = {}


def _positions(input_pos, batch, like) -> torch.Tensor:
    """``input_pos`` as a ``(B,)`` int64 tensor on ``like``'s device (host tuples cached)."""
    if not isinstance(input_pos, tuple):
        return input_pos
    values = input_pos if len(input_pos) > 1 else input_pos * batch
    key = (str(like.device), values)
    if key not in _POSITIONS:
        if len(_POSITIONS) > 256:
            _POSITIONS.clear()
        _POSITIONS[key] = _flex_host.upload(np.asarray(values, dtype=np.int64), like.device)
    return _POSITIONS[key]


def _fit(block: int, tile: int) -> int:
    """The largest power of two ``<= block`` and ``>= 16`` dividing ``tile`` (else 16)."""
    while block > 16 and tile % block:
        block //= 2
    return block


def _tile(table, block_d, like, plan):
    """``(BLOCK_M, BLOCK_N, warps, stages)``: the attention kernels' default tile for the head
    dim and input width (16 x 16 under the interpreter), halved while that makes it divide the
    plan's tiles (every kernel tile then lies in one plan tile)."""
    tile = table.choose(block_d, like.element_size())
    return (
        _fit(tile.block_m, plan.tile_m),
        _fit(tile.block_n, plan.tile_n),
        tile.num_warps,
        tile.num_stages,
    )


def _plan_arguments(lists, plan, forward_axis: bool) -> tuple:
    count, entries = (
        (lists.forward_count, lists.forward)
        if forward_axis
        else (lists.backward_count, lists.backward)
    )
    cs, es, ss = strides(count), strides(entries), strides(lists.states)
    return (
        count,
        entries,
        lists.states,
        *cs[:2],
        *es[:3],
        *ss[:3],
        plan.tile_m,
        plan.tile_n,
    )


def _meta(q, v, mods, score_mod, mask_mod, lists) -> dict:
    block_d, block_dv = dim_block(q.shape[-1]), dim_block(v.shape[-1])
    return {
        "SCORE_FN": mods.score_fn,
        "MASK_FN": mods.mask_fn,
        "HAS_SCORE": score_mod is not None,
        "HAS_MASK": mask_mod is not None,
        "EXACT": lists.exact,
        "EVEN_D": block_d == q.shape[-1],
        "EVEN_DV": block_dv == v.shape[-1],
        "PRECISION": dot_precision(q.dtype),
        "DOT_TYPE": dot_type(q.dtype),
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
    }


def forward(o, q, k, v, m, l, *, scale, input_pos, score_mod, mask_mod, plan) -> None:
    """Write ``o`` (and the checkpoints ``m``, ``l`` unless None) for validated inputs.

    Parameters
    ----------
    o : torch.Tensor ``(B, H, Sq, Dv)``, overwritten.
    q, k, v : torch.Tensor ``(B, H, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, Dv)``.
    m, l : torch.Tensor or None
        ``(B, H, Sq)`` float32 checkpoints (natural-log units), or None.
    scale : float
    input_pos : tuple of int or ``(B,)`` integer tensor
    score_mod, mask_mod : xpkernels.mods.Graph or None
    plan : xpkernels.mods.TilePlan
    """
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    store = m is not None
    if B * H * Sq == 0:
        return
    if Sk == 0:
        o.zero_()
        if store:
            m.fill_(float("-inf"))
            l.zero_()
        return
    block_m, block_n, warps, stages = _tile(_FORWARD_TILES, dim_block(q.shape[-1]), q, plan)
    lists = tile_lists(plan, Sq, Sk, block_m, block_n, q.device)
    mods = Mods.build(score_mod, mask_mod)
    meta = _meta(q, v, mods, score_mod, mask_mod, lists)
    plan_args = _plan_arguments(lists, plan, True)
    with launch_context(_forward_kernel, q):
        traced(_forward_kernel, q)[(triton.cdiv(Sq, block_m), B * H)](
            q,
            k,
            v,
            o,
            m if store else o,
            l if store else o,
            _positions(input_pos, B, q),
            *plan_args[:3],
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *o.stride()[:3],
            *(m.stride() if store else (0, 0, 0)),
            *(l.stride() if store else (0, 0, 0)),
            *plan_args[3:],
            H,
            H // Hkv,
            Sq,
            Sk,
            scale,
            q.shape[-1],
            v.shape[-1],
            mods.score_arrs,
            mods.score_consts,
            mods.mask_arrs,
            mods.mask_consts,
            **meta,
            STORE_STATS=store,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
        )


def score_mod_workspace(q, k, v, score_mod, plan, score_mod_grads, deterministic) -> int:
    """Float32 elements of the workspace :func:`backward` needs for ``score_mod_grads``.

    Raises
    ------
    ValueError
        Deterministic partial rows too large (:func:`._flex_host.workspace_layout`).
    """
    if score_mod is None or all(g is None for g in score_mod_grads):
        return 0
    B, H, Sq, D = q.shape
    if B == 0 or H == 0 or Sq == 0 or k.shape[2] == 0:
        return 0
    block_n = _tile(_DKDV_TILES, dim_block(D), q, plan)[1]
    programs = (triton.cdiv(k.shape[2], block_n), B, k.shape[1], H // k.shape[1])
    return workspace_layout(score_mod, score_mod_grads, deterministic, programs)[0]


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
    input_pos,
    score_mod,
    mask_mod,
    plan,
    score_mod_grads,
    deterministic=True,
    score_mod_workspace=None,
) -> None:
    """Overwrite ``dq``, ``dk``, ``dv`` in full and ADD the score mod's array gradients.

    ``delta`` ``(B, H, Sq)`` float32 scratch receives ``rowsum(do * o)``;
    ``dq_accum`` is not used (dQ is its own pass; the declaration leaves it
    out of the scratch). ``score_mod_grads``: one accumulator or None per
    slot of ``score_mod``. ``deterministic``: the array gradients go through
    per-program partial rows and a reduction in a fixed order (bit-identical
    run to run), else float32 atomic adds. ``score_mod_workspace``: 1-D
    float32 scratch of at least :func:`score_mod_workspace` elements (None
    when that is 0), holding those partial rows and float32 stand-ins for
    accumulators of other dtypes. Other arguments as :func:`forward`.
    """
    B, H, Sq, D = q.shape
    Hkv, Sk, DV = k.shape[1], k.shape[2], v.shape[-1]
    if B == 0 or H == 0:
        return
    if Sq == 0 or Sk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    block_d = dim_block(D)
    dkdv_tile = _tile(_DKDV_TILES, block_d, q, plan)
    programs = (triton.cdiv(Sk, dkdv_tile[1]), B, Hkv, H // Hkv)
    mods = Mods.build(
        score_mod, mask_mod, score_mod_grads, deterministic, programs, score_mod_workspace
    )
    positions = _positions(input_pos, B, q)
    common = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *m.stride(),
        *l.stride(),
        *delta.stride(),
    )
    with launch_context(_dq_kernel, q):
        delta_rows = _DELTA_TILE // dim_block(DV)
        traced(_delta_kernel, q)[(triton.cdiv(Sq, delta_rows) * B * H,)](
            o,
            do,
            delta,
            q,
            *o.stride()[:3],
            *do.stride()[:3],
            *delta.stride(),
            H,
            Sq,
            DV,
            HAS_QLEN=False,
            EVEN_DV=dim_block(DV) == DV,
            BLOCK_M=delta_rows,
            BLOCK_DV=dim_block(DV),
        )
        block_m, block_n, warps, stages = dkdv_tile
        lists = tile_lists(plan, Sq, Sk, block_m, block_n, q.device)
        args = _plan_arguments(lists, plan, False)
        traced(_dkdv_kernel, q)[(triton.cdiv(Sk, block_n), B * Hkv)](
            q,
            k,
            v,
            do,
            m,
            l,
            delta,
            dk,
            dv,
            positions,
            *args[:3],
            *common,
            *dk.stride()[:3],
            *dv.stride()[:3],
            *args[3:],
            Hkv,
            H // Hkv,
            Sq,
            Sk,
            scale,
            D,
            DV,
            mods.score_arrs,
            mods.score_consts,
            mods.mask_arrs,
            mods.mask_consts,
            mods.grads,
            **_meta(q, v, mods, score_mod, mask_mod, lists),
            VJP_FN=mods.vjp_grads,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        block_m, block_n, warps, stages = _tile(_DQ_TILES, block_d, q, plan)
        lists = tile_lists(plan, Sq, Sk, block_m, block_n, q.device)
        args = _plan_arguments(lists, plan, True)
        traced(_dq_kernel, q)[(triton.cdiv(Sq, block_m), B * H)](
            q,
            k,
            v,
            do,
            m,
            l,
            delta,
            dq,
            positions,
            *args[:3],
            *common,
            *dq.stride()[:3],
            *args[3:],
            H,
            H // Hkv,
            Sq,
            Sk,
            scale,
            D,
            DV,
            mods.score_arrs,
            mods.score_consts,
            mods.mask_arrs,
            mods.mask_consts,
            **_meta(q, v, mods, score_mod, mask_mod, lists),
            VJP_FN=mods.vjp,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
            num_stages=stages,
        )
    mods.finish()
