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

from collections import namedtuple

import numpy as np
import torch
import triton
import triton.language as tl

from . import _flex_host
from ._attn_common import (
    KV,
    LOG2E_CONST,
    BackwardRows,
    Cols,
    Strided,
    backward_heads,
    dim_block,
    head_meta,
    head_rows,
    interpreted,
    kv_tile,
    launch_on,
    load_rows,
    query_tile,
    softmax_update,
    store_output,
    store_rows,
    strides_of,
    tile_loop,
)
from ._common import launch_context, traced
from ._flex_host import FULL_CONST, PARTIAL_CONST, Mods, strides, tile_lists, workspace_layout
from .attention import _DKDV_TILES, _DQ_TILES, _FORWARD_TILES, launch_delta

__all__ = ["backward", "default_tiles", "forward", "score_mod_workspace"]

#: Plan tiles on a GPU: every kernel tile of the attention kernels' tables divides them.
PLAN_TILE = 128

# The kernels take flat arguments, pointers first, as the attention kernels do. Passing
# each tensor as one (pointer, strides) tuple instead compiled (sm_90) to the same code
# everywhere but in one kernel: with its parameters so reordered the dK/dV kernel of a
# gathered relative-position score mod with atomic gradients (D=64, 255 registers)
# spilled 2 bytes.

#: The mods of one launch, a compile-time kernel argument: the generated score, mask and
#: score reverse-mode functions (:class:`._flex_host.Mods`), whether there is a score and
#: a mask mod, and whether the lists' tile states are exact (else the kernel also reads
#: each pair's state in the plan).
ModFns = namedtuple("ModFns", ["score", "mask", "vjp", "HAS_SCORE", "HAS_MASK", "EXACT"])
#: The plan's tile states of one (batch, head): base pointer, stride between query
#: tiles, and the plan's tile sizes.
PlanStates = namedtuple("PlanStates", ["base", "stride", "tile_m", "tile_n"])
#: What the mods see of a tile's query rows: their ``b``, ``h``, ``q_idx`` and ``q_row``
#: arguments (``q_idx``, ``q_row`` as ``(rows, 1)``, or ``(1, rows)`` in a transposed
#: tile), and which rows are valid.
Query = namedtuple("Query", ["b", "h", "q_idx", "q_row", "row_ok"])
#: The key tile at ``n0``: its first key, key offsets and the key count ``Sk``.
Keys = namedtuple("Keys", ["n0", "offs", "Sk"])
#: What scoring a tile reads besides ``q``, ``k`` and its rows: the softmax scale, the
#: plan's :class:`PlanStates` and the mods' run-time arguments (score arrays, score
#: constants, mask arrays, mask constants).
ScoreEnv = namedtuple("ScoreEnv", ["scale", "states", "mod_args"])


def default_tiles(n_q: int, n_kv: int, group: int, masked: bool) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of a plan: 16 x 16 under the interpreter, else 128 x 128."""
    tile = 16 if interpreted() else PLAN_TILE
    return tile, tile


@triton.jit
def _tile_list(plan, b, h, i):
    """``(count, first entry, states)`` of list ``i`` of (batch ``b``, head ``h``) in ``plan``
    (``(counts, lists, states, tile_m, tile_n)``, the first three ``(pointer, strides...)``):
    the tiles listed, a pointer to the entries, and the plan's :class:`PlanStates`."""
    counts, entries, states, tile_m, tile_n = plan
    count_ptr, stride_cb, stride_ch = counts
    list_ptr, stride_eb, stride_eh, stride_ei = entries
    states_ptr, stride_sb, stride_sh, stride_si = states
    count = tl.load(count_ptr + b * stride_cb + h * stride_ch + i)
    list_base = list_ptr + b * stride_eb + h * stride_eh + i * stride_ei
    states_base = states_ptr + b * stride_sb + h * stride_sh
    return count, list_base, PlanStates(states_base, stride_si, tile_m, tile_n)


@triton.jit
def _entry(list_base, t):
    """``(tile, state)`` of entry ``t`` of a tile list."""
    e = tl.load(list_base + t)
    return e >> 2, e & 3


@triton.jit
def _query_program(
    pos_ptr, H, GROUP, Sq, D, DV,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """``(query tile, kv head, row_off, offs_m, cols, query)`` of this program in the grid
    ``(query tiles, B * H)``: its first row at int64, the row offsets of the tile, the
    :data:`~._attn_common.Cols` and the :class:`Query` (``q_idx``, ``q_row`` as ``(rows, 1)``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    cols = Cols(tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), D, DV)
    rows = start_m + offs_m
    q_row = rows.to(tl.int64)[:, None]
    q_idx = tl.load(pos_ptr + b).to(tl.int64) + q_row
    query = Query(b, h, q_idx, q_row, rows < Sq)
    return pid_m, h // GROUP, start_m.to(tl.int64), offs_m, cols, query


@triton.jit
def _tile_scores(
    a,
    c,
    query,
    keys,
    state,
    env,
    MODS: tl.constexpr,
    PRECISION: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """``(s, s_mod, keep, kv_idx)`` of a tile in list state ``state``: raw and modified natural
    scores, kept pairs, and the mods' ``kv_idx``.

    ``s = a c^T * scale``: ``a = q``, ``c = k`` give ``(queries, keys)`` tiles; with
    ``TRANSPOSED``, ``a = k``, ``c = q`` give ``(keys, queries)`` tiles, and the
    :class:`Query` holds ``q_idx``, ``q_row`` as ``(1, BLOCK_M)``.
    """
    score_arrs, score_consts, mask_arrs, mask_consts = env.mod_args
    s = tl.dot(a, tl.trans(c), input_precision=PRECISION) * env.scale
    key = keys.n0 + keys.offs
    if TRANSPOSED:
        kv_idx = key.to(tl.int64)[:, None]
        keep = (key < keys.Sk)[:, None] & query.row_ok[None, :]
    else:
        kv_idx = key.to(tl.int64)[None, :]
        keep = query.row_ok[:, None] & (key < keys.Sk)[None, :]
    b, h, q_idx, q_row = query.b, query.h, query.q_idx, query.q_row
    s_mod = s
    if MODS.HAS_SCORE:
        s_mod = MODS.score(s, b, h, q_idx, kv_idx, q_row, score_arrs, score_consts)
    if MODS.HAS_MASK:
        if state == PARTIAL_CONST:
            inside = MODS.mask(b, h, q_idx, kv_idx, q_row, mask_arrs, mask_consts)
            if not MODS.EXACT:
                states = env.states
                cell = (q_row // states.tile_m) * states.stride + kv_idx // states.tile_n
                plan_state = tl.load(states.base + cell, mask=keep, other=0)
                inside = tl.where(plan_state == PARTIAL_CONST, inside, plan_state == FULL_CONST)
            keep = tl.where(inside, keep, False)  # a select: a mask may not span the tile
    return s, s_mod, keep, kv_idx


@triton.jit
def _forward_step(
    carry,
    t,
    ctx,
    MODS: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax update of ``carry = (acc, m_i, l_i)`` by the ``t``-th key tile of the list.

    ``ctx``: the query tile, the :data:`~._attn_common.KV`, the
    :data:`~._attn_common.Cols`, the list's first entry, the :class:`Query`,
    the key offsets of a tile, ``Sk`` and the :class:`ScoreEnv`.
    """
    acc, m_i, l_i = carry
    q, kv, cols, list_base, query, offs_n, Sk, env = ctx
    j, state = _entry(list_base, t)
    n0 = j * BLOCK_N
    k, v = kv_tile(kv, n0, offs_n, cols, Sk, True, EVEN_D, EVEN_DV)
    keys = Keys(n0, offs_n, Sk)
    _, s, keep, _ = _tile_scores(q, k.to(DOT_TYPE), query, keys, state, env, MODS, PRECISION, False)
    s = tl.where(keep, s * LOG2E_CONST, float("-inf"))
    p, acc, m_i, l_i = softmax_update(acc, m_i, l_i, s)
    acc = tl.dot(p.to(DOT_TYPE), v.to(DOT_TYPE), acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr,  # (B,H,Sq) float32 checkpoints; unused unless STORE_STATS
    pos_ptr,  # (B,) int64 position of each batch's query 0
    count_ptr, list_ptr, states_ptr,  # tile counts and lists, plan states (_plan_arguments)
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_ob, stride_oh, stride_om,  # o strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    stride_cb, stride_ch,  # tile count strides (batch, head)
    stride_eb, stride_eh, stride_ei,  # list strides (batch, head, tile)
    stride_sb, stride_sh, stride_si,  # plan state strides (batch, head, query tile)
    plan_tm, plan_tn,  # the plan's tile
    H, GROUP, Sq, Sk,  # query heads, query heads per kv head, query and key lengths
    scale,  # softmax scale
    D, DV,  # head dims of q/k and v/o
    score_arrs, score_consts, mask_arrs, mask_consts,  # the mods' run-time arguments
    MODS: tl.constexpr,  # ModFns
    STORE_STATS: tl.constexpr,  # write the m, l checkpoints
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query and key tile
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
):  # fmt: skip
    """``o`` (and ``m``, ``l``) of one (query tile, batch, head) over its listed key tiles."""
    counts = (count_ptr, stride_cb, stride_ch)
    lists = (list_ptr, stride_eb, stride_eh, stride_ei)
    plan = (counts, lists, (states_ptr, stride_sb, stride_sh, stride_si), plan_tm, plan_tn)
    mod_args = (score_arrs, score_consts, mask_arrs, mask_consts)
    pid_m, g, row_off, offs_m, cols, query = _query_program(
        pos_ptr, H, GROUP, Sq, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV
    )
    b, h, row_ok = query.b, query.h, query.row_ok
    q_rows = head_rows(Strided(q_ptr, stride_qb, stride_qh, stride_qm), b, h)
    q_tile = load_rows(q_rows, row_off, offs_m, row_ok, cols.d, D, True, EVEN_D).to(DOT_TYPE)
    kv = KV(
        head_rows(Strided(k_ptr, stride_kb, stride_kh, stride_kn), b, g),
        head_rows(Strided(v_ptr, stride_vb, stride_vh, stride_vn), b, g),
    )
    count, list_base, states = _tile_list(plan, b, h, pid_m)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    env = ScoreEnv(scale, states, mod_args)
    ctx = (q_tile, kv, cols, list_base, query, tl.arange(0, BLOCK_N), Sk, env)
    carry = (acc, m_i, l_i)
    acc, m_i, l_i = tile_loop(
        _forward_step,
        carry,
        0,
        count,
        1,
        ctx,
        (MODS, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_N),
    )
    live = l_i != 0.0  # a NaN sum (a row that saw NaN) stays live: o, m, l NaN
    out = (
        head_rows(Strided(o_ptr, stride_ob, stride_oh, stride_om), b, h),
        head_rows(Strided(m_ptr, stride_mb, stride_mh, stride_mm), b, h),
        head_rows(Strided(l_ptr, stride_lb, stride_lh, stride_lm), b, h),
    )
    state = (acc, m_i, l_i)
    store_output(out, row_off, state, live, offs_m, row_ok, cols, EVEN_DV, STORE_STATS)


@triton.jit
def _probabilities(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    query,
    keys,
    state,
    env,
    grads,
    MODS: tl.constexpr,
    PRECISION: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """``(p, ds)`` of a tile: probabilities and d loss / d (raw natural score).

    ``(queries, keys)`` tiles, or ``(keys, queries)`` with ``TRANSPOSED`` (the dK/dV
    pass, whose products then take ``p`` and ``ds`` as their left operand unchanged);
    ``grads``: the score mod's array-gradient accumulators (the dK/dV pass).
    """
    if TRANSPOSED:
        s, s_mod, keep, kv_idx = _tile_scores(k, q, query, keys, state, env, MODS, PRECISION, True)
        p = tl.where(keep, tl.exp2(s_mod * LOG2E_CONST - lse2[None, :]), 0.0)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = tl.where(keep, p * (dp - delta[None, :]), 0.0)
    else:
        s, s_mod, keep, kv_idx = _tile_scores(q, k, query, keys, state, env, MODS, PRECISION, False)
        p = tl.where(keep, tl.exp2(s_mod * LOG2E_CONST - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)
    if MODS.HAS_SCORE:
        score_arrs, score_consts, _, _ = env.mod_args
        b, h, q_idx, q_row = query.b, query.h, query.q_idx, query.q_row
        ds = MODS.vjp(s, b, h, q_idx, kv_idx, q_row, ds, keep, score_arrs, score_consts, grads)
        ds = tl.where(keep, ds, 0.0)
    return p, ds


@triton.jit
def _dkdv_step(
    carry,
    t,
    ctx,
    MODS: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dK, dV contributions (``carry = (dk, dv)``) of the ``t``-th query tile of the list (one
    query head).

    ``ctx``: the key tile's ``k``, ``v`` and :class:`Keys`, the head's
    :data:`~._attn_common.BackwardRows`, the list's first entry, ``b``, ``h``,
    the position of query 0, the query row offsets of a tile, the
    :data:`~._attn_common.Cols`, ``Sq``, the :class:`ScoreEnv` and the score
    mod's array-gradient accumulators.
    """
    dk, dv = carry
    k, v, keys, head, list_base, b, h, pos, offs_m, cols, Sq, env, grads = ctx
    i, state = _entry(list_base, t)
    start_m = i * BLOCK_M
    rows = start_m + offs_m
    row_ok = rows < Sq
    row_off = start_m.to(tl.int64)
    q_row = rows.to(tl.int64)[None, :]
    query = Query(b, h, pos + q_row, q_row, row_ok)
    q, do, lse2, delta = query_tile(head, row_off, offs_m, row_ok, cols, EVEN_D, EVEN_DV, DOT_TYPE)
    p, ds = _probabilities(
        q, k, v, do, lse2, delta, query, keys, state, env, grads, MODS, PRECISION, True
    )
    dv = tl.dot(p.to(DOT_TYPE), do, dv, input_precision=PRECISION)
    dk = tl.dot(ds.to(DOT_TYPE), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr, delta_ptr,  # (B,H,Sq) float32 checkpoints and delta
    dk_ptr, dv_ptr,  # (B,Hkv,Sk,D), (B,Hkv,Sk,DV) shadows, overwritten
    pos_ptr,  # (B,) int64 position of each batch's query 0
    count_ptr, list_ptr, states_ptr,  # tile counts and lists, plan states (_plan_arguments)
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_dob, stride_doh, stride_dom,  # do strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    stride_deb, stride_deh, stride_dem,  # delta strides
    stride_dkb, stride_dkh, stride_dkn,  # dk strides
    stride_dvb, stride_dvh, stride_dvn,  # dv strides
    stride_cb, stride_ch,  # tile count strides (batch, head)
    stride_eb, stride_eh, stride_ei,  # list strides (batch, head, tile)
    stride_sb, stride_sh, stride_si,  # plan state strides (batch, head, query tile)
    plan_tm, plan_tn,  # the plan's tile
    HKV, GROUP, Sq, Sk,  # kv heads, query heads per kv head, query and key lengths
    scale,  # softmax scale
    D, DV,  # head dims
    score_arrs, score_consts, mask_arrs, mask_consts,  # the mods' run-time arguments
    grads,  # the score mod's array-gradient accumulators (see _flex_host.Mods)
    MODS: tl.constexpr,  # ModFns (vjp: the reverse mode adding the array gradients)
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query and key tile
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
):  # fmt: skip
    """dK, dV of one (key tile, batch, kv head), summed over the group's heads and query tiles."""
    counts = (count_ptr, stride_cb, stride_ch)
    lists = (list_ptr, stride_eb, stride_eh, stride_ei)
    plan = (counts, lists, (states_ptr, stride_sb, stride_sh, stride_si), plan_tm, plan_tn)
    mod_args = (score_arrs, score_consts, mask_arrs, mask_consts)
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = Cols(tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), D, DV)
    kv = KV(
        head_rows(Strided(k_ptr, stride_kb, stride_kh, stride_kn), b, g),
        head_rows(Strided(v_ptr, stride_vb, stride_vh, stride_vn), b, g),
    )
    k_tile, v_tile = kv_tile(kv, n0, offs_n, cols, Sk, True, EVEN_D, EVEN_DV)
    k_tile = k_tile.to(DOT_TYPE)
    v_tile = v_tile.to(DOT_TYPE)
    dk_acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    keys = Keys(n0, offs_n, Sk)
    tensors = BackwardRows(
        Strided(q_ptr, stride_qb, stride_qh, stride_qm),
        Strided(do_ptr, stride_dob, stride_doh, stride_dom),
        Strided(m_ptr, stride_mb, stride_mh, stride_mm),
        Strided(l_ptr, stride_lb, stride_lh, stride_lm),
        Strided(delta_ptr, stride_deb, stride_deh, stride_dem),
    )
    h = g * GROUP
    while h < (g + 1) * GROUP:
        count, list_base, states = _tile_list(plan, b, h, pid_n)
        head = backward_heads(tensors, b, h)
        env = ScoreEnv(scale, states, mod_args)
        ctx = (k_tile, v_tile, keys, head, list_base, b, h, pos, offs_m, cols, Sq, env, grads)
        dk_acc, dv_acc = tile_loop(
            _dkdv_step, (dk_acc, dv_acc), 0, count, 1, ctx,
            (MODS, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_M),
        )  # fmt: skip
        h += 1
    key_ok = (n0 + offs_n) < Sk
    key_off = n0.to(tl.int64)
    dk_rows = head_rows(Strided(dk_ptr, stride_dkb, stride_dkh, stride_dkn), b, g)
    dv_rows = head_rows(Strided(dv_ptr, stride_dvb, stride_dvh, stride_dvn), b, g)
    store_rows(dk_rows, key_off, offs_n, key_ok, cols.d, D, dk_acc * scale, EVEN_D)
    store_rows(dv_rows, key_off, offs_n, key_ok, cols.dv, DV, dv_acc, EVEN_DV)


@triton.jit
def _dq_step(
    dq,
    t,
    ctx,
    MODS: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ contribution of the ``t``-th key tile of the list.

    ``ctx``: the query tile's ``q``, ``do``, ``lse2`` and ``delta``, then as
    :func:`_forward_step`'s from the :data:`~._attn_common.KV` on.
    """
    q, do, lse2, delta, kv, cols, list_base, query, offs_n, Sk, env = ctx
    j, state = _entry(list_base, t)
    n0 = j * BLOCK_N
    k, v = kv_tile(kv, n0, offs_n, cols, Sk, True, EVEN_D, EVEN_DV)
    k = k.to(DOT_TYPE)
    keys = Keys(n0, offs_n, Sk)
    _, ds = _probabilities(
        q, k, v.to(DOT_TYPE), do, lse2, delta, query, keys, state, env, 0, MODS, PRECISION, False
    )
    return tl.dot(ds.to(DOT_TYPE), k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B,H,Sq,D), (B,Hkv,Sk,D), (B,Hkv,Sk,DV), (B,H,Sq,DV)
    m_ptr, l_ptr, delta_ptr,  # (B,H,Sq) float32 checkpoints and delta
    dq_ptr,  # (B,H,Sq,D) shadow, overwritten
    pos_ptr,  # (B,) int64 position of each batch's query 0
    count_ptr, list_ptr, states_ptr,  # tile counts and lists, plan states (_plan_arguments)
    stride_qb, stride_qh, stride_qm,  # q strides (batch, head, row)
    stride_kb, stride_kh, stride_kn,  # k strides
    stride_vb, stride_vh, stride_vn,  # v strides
    stride_dob, stride_doh, stride_dom,  # do strides
    stride_mb, stride_mh, stride_mm,  # m strides
    stride_lb, stride_lh, stride_lm,  # l strides
    stride_deb, stride_deh, stride_dem,  # delta strides
    stride_dqb, stride_dqh, stride_dqm,  # dq strides
    stride_cb, stride_ch,  # tile count strides (batch, head)
    stride_eb, stride_eh, stride_ei,  # list strides (batch, head, tile)
    stride_sb, stride_sh, stride_si,  # plan state strides (batch, head, query tile)
    plan_tm, plan_tn,  # the plan's tile
    H, GROUP, Sq, Sk,  # query heads, query heads per kv head, query and key lengths
    scale,  # softmax scale
    D, DV,  # head dims
    score_arrs, score_consts, mask_arrs, mask_consts,  # the mods' run-time arguments
    MODS: tl.constexpr,  # ModFns (vjp: the reverse mode without array gradients)
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,  # D == BLOCK_D, DV == BLOCK_DV
    PRECISION: tl.constexpr,  # tl.dot input precision
    DOT_TYPE: tl.constexpr,  # dtype of tl.dot operands (see dot_type)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # query and key tile
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # padded head dims
):  # fmt: skip
    """dQ of one (query tile, batch, head) over its listed key tiles."""
    counts = (count_ptr, stride_cb, stride_ch)
    lists = (list_ptr, stride_eb, stride_eh, stride_ei)
    plan = (counts, lists, (states_ptr, stride_sb, stride_sh, stride_si), plan_tm, plan_tn)
    mod_args = (score_arrs, score_consts, mask_arrs, mask_consts)
    pid_m, g, row_off, offs_m, cols, query = _query_program(
        pos_ptr, H, GROUP, Sq, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV
    )
    b, h, row_ok = query.b, query.h, query.row_ok
    tensors = BackwardRows(
        Strided(q_ptr, stride_qb, stride_qh, stride_qm),
        Strided(do_ptr, stride_dob, stride_doh, stride_dom),
        Strided(m_ptr, stride_mb, stride_mh, stride_mm),
        Strided(l_ptr, stride_lb, stride_lh, stride_lm),
        Strided(delta_ptr, stride_deb, stride_deh, stride_dem),
    )
    head = backward_heads(tensors, b, h)
    q_tile, do_tile, lse2, delta_row = query_tile(
        head, row_off, offs_m, row_ok, cols, EVEN_D, EVEN_DV, DOT_TYPE
    )
    kv = KV(
        head_rows(Strided(k_ptr, stride_kb, stride_kh, stride_kn), b, g),
        head_rows(Strided(v_ptr, stride_vb, stride_vh, stride_vn), b, g),
    )
    count, list_base, states = _tile_list(plan, b, h, pid_m)
    dq_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    env = ScoreEnv(scale, states, mod_args)
    offs_n = tl.arange(0, BLOCK_N)
    ctx = (q_tile, do_tile, lse2, delta_row, kv, cols, list_base, query, offs_n, Sk, env)
    dq_acc = tile_loop(
        _dq_step, dq_acc, 0, count, 1, ctx, (MODS, EVEN_D, EVEN_DV, PRECISION, DOT_TYPE, BLOCK_N)
    )
    dq_rows = head_rows(Strided(dq_ptr, stride_dqb, stride_dqh, stride_dqm), b, h)
    store_rows(dq_rows, row_off, offs_m, row_ok, cols.d, D, dq_acc * scale, EVEN_D)


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


def _tile(table, block_d, like, plan) -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps`` and ``num_stages`` of a launch: the attention
    kernels' default tile for the head dim and input width (16 x 16 under the interpreter),
    halved while that makes it divide the plan's tiles (every kernel tile then lies in one
    plan tile)."""
    tile = table.choose(block_d, like.element_size())
    return {
        "BLOCK_M": _fit(tile.block_m, plan.tile_m),
        "BLOCK_N": _fit(tile.block_n, plan.tile_n),
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
    }


def _plan_arguments(plan, tile, n_q, n_kv, device, forward_axis: bool) -> tuple:
    """``(lists, pointers, integers)``: the plan's tile lists for the kernel ``tile``, and the
    kernels' plan arguments: the tile counts, the lists and the plan's own states; their
    strides and the plan's tile sizes."""
    lists = tile_lists(plan, n_q, n_kv, tile["BLOCK_M"], tile["BLOCK_N"], device)
    count, entries = (
        (lists.forward_count, lists.forward)
        if forward_axis
        else (lists.backward_count, lists.backward)
    )
    cs, es, ss = strides(count), strides(entries), strides(lists.states)
    pointers = (count, entries, lists.states)
    return lists, pointers, (*cs[:2], *es[:3], *ss[:3], plan.tile_m, plan.tile_n)


def _meta(q, v, mods, vjp, score_mod, mask_mod, lists) -> dict:
    """The compile-time arguments of a launch whose score reverse mode is ``vjp``."""
    has_score, has_mask = score_mod is not None, mask_mod is not None
    mod_fns = ModFns(mods.score_fn, mods.mask_fn, vjp, has_score, has_mask, lists.exact)
    return {"MODS": mod_fns, **head_meta(q, v)}


def forward(o, q, k, v, m, l, *, scale, input_pos, score_mod, mask_mod, plan) -> None:
    """Write ``o`` (and the checkpoints ``m``, ``l`` unless None) for validated inputs.

    ``m``, ``l`` in natural-log units; ``input_pos`` is a tuple of ints or a ``(B,)`` integer
    tensor, the mods :class:`xpkernels.mods.Graph` or None, ``plan`` a
    :class:`xpkernels.mods.TilePlan`. Parameters: the ``flex_attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
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
    tile = _tile(_FORWARD_TILES, dim_block(q.shape[-1]), q, plan)
    lists, plan_pointers, plan_integers = _plan_arguments(plan, tile, Sq, Sk, q.device, True)
    mods = Mods.build(score_mod, mask_mod)
    stats = (o, o) if m is None else (m, l)  # o is never read without STORE_STATS
    tensors = (q, k, v, o, *stats, _positions(input_pos, B, q), *plan_pointers)
    integers = (*strides_of(q, k, v, o, m, l), *plan_integers)
    sizes = (H, H // Hkv, Sq, Sk, scale, q.shape[-1], v.shape[-1])
    args = (*tensors, *integers, *sizes, *mods.arguments)
    meta = _meta(q, v, mods, None, score_mod, mask_mod, lists)
    grid = (triton.cdiv(Sq, tile["BLOCK_M"]), B * H)
    launch_on(_forward_kernel, q, grid, *args, **meta, **tile, STORE_STATS=store)


def score_mod_workspace(q, k, v, score_mod, plan, score_mod_grads, deterministic) -> int:
    """Float32 elements of the workspace :func:`backward` needs for ``score_mod_grads``
    (:func:`xpkernels.backends.protocol.score_mod_workspace`); ValueError when the
    deterministic partial rows are too large (:func:`._flex_host.workspace_layout`)."""
    if score_mod is None or all(g is None for g in score_mod_grads):
        return 0
    B, H, Sq, D = q.shape
    if B == 0 or H == 0 or Sq == 0 or k.shape[2] == 0:
        return 0
    block_n = _tile(_DKDV_TILES, dim_block(D), q, plan)["BLOCK_N"]
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

    ``delta`` receives ``rowsum(do * o)``; ``dq_accum`` is not used (dQ is its own pass;
    the declaration leaves it out of the scratch). ``deterministic``: the array gradients go
    through per-program partial rows and a reduction in a fixed order (bit-identical run to
    run), else float32 atomic adds; ``score_mod_workspace`` holds those partial rows and
    float32 stand-ins for accumulators of other dtypes. Parameters: the ``flex_attention``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`), as :func:`forward`.
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
    tile = _tile(_DKDV_TILES, block_d, q, plan)
    programs = (triton.cdiv(Sk, tile["BLOCK_N"]), B, Hkv, H // Hkv)
    mods = Mods.build(
        score_mod, mask_mod, score_mod_grads, deterministic, programs, score_mod_workspace
    )
    reads = (q, k, v, do, m, l, delta)
    positions = _positions(input_pos, B, q)
    sizes = (H // Hkv, Sq, Sk, scale, D, DV)
    with launch_context(_dq_kernel, q):
        args = (o, do, delta, q, *strides_of(o, do, delta), H, Sq, DV)
        launch_delta(q, args, DV, Sq, B * H, has_qlen=False)
        lists, plan_pointers, plan_integers = _plan_arguments(plan, tile, Sq, Sk, q.device, False)
        tensors = (*reads, dk, dv, positions, *plan_pointers)
        integers = (*strides_of(*reads, dk, dv), *plan_integers)
        args = (*tensors, *integers, Hkv, *sizes, *mods.arguments)
        meta = _meta(q, v, mods, mods.vjp_grads, score_mod, mask_mod, lists)
        grid = (triton.cdiv(Sk, tile["BLOCK_N"]), B * Hkv)
        traced(_dkdv_kernel, q)[grid](*args, mods.grads, **meta, **tile)
        tile = _tile(_DQ_TILES, block_d, q, plan)
        lists, plan_pointers, plan_integers = _plan_arguments(plan, tile, Sq, Sk, q.device, True)
        tensors = (*reads, dq, positions, *plan_pointers)
        integers = (*strides_of(*reads, dq), *plan_integers)
        args = (*tensors, *integers, H, *sizes, *mods.arguments)
        meta = _meta(q, v, mods, mods.vjp, score_mod, mask_mod, lists)
        grid = (triton.cdiv(Sq, tile["BLOCK_M"]), B * H)
        traced(_dq_kernel, q)[grid](*args, **meta, **tile)
    mods.finish()
