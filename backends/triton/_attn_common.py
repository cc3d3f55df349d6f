"""Launch helpers shared by the Triton attention and decode-attention kernels.

Tile shapes come from a small table per head-dim class and input width. Under
the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) every kernel runs
with 16-wide tiles, the smallest ``tl.dot`` accepts, so tiny test shapes still
cross tile boundaries. On CUDA, float16/bfloat16 problems large enough to
amortise it pick among a few candidate tiles by timing each once per shape (a
bounded search through ``triton.autotune``); other launches use the table's
default, which fits Hopper's shared memory without register spills. The search
runs the kernel a dozen times on the caller's buffers at the first launch of a
shape (every kernel tuned here rewrites its outputs from its inputs, so the
result is the same): launch each shape once before capturing a CUDA graph.
"""

from __future__ import annotations

import os
from collections import namedtuple
from dataclasses import dataclass

import triton
import triton.language as tl

from ._common import _sm_count
from ._common import launch as launch_on

#: log2(e): scores are scaled by ``scale * LOG2E`` so the kernels use ``exp2``.
LOG2E = 1.4426950408889634
#: ln(2): converts a base-2 row max back to the natural-log checkpoint ``m``.
LN2 = 0.6931471805599453
#: The same two constants as kernel compile-time values.
LOG2E_CONST = tl.constexpr(LOG2E)
LN2_CONST = tl.constexpr(LN2)

#: Problem size above which CUDA launches autotune: query rows x keys x heads x
#: batch for attention, cache elements read for decode.
AUTOTUNE_MIN_WORK = 1 << 26


def interpreted() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


#: Whether tile loops are ``for`` loops (compiled: Triton software-pipelines
#: them) or ``while`` loops (the interpreter). Triton 3.6's interpreter cannot
#: run ``range`` over a run-time bound with NumPy >= 2.4 -- its scalars are
#: 1-element arrays, which NumPy no longer turns into indices (triton-lang/triton
#: issue 9171) -- while ``while`` loops test their condition with ``bool``, which
#: still works. :func:`tile_loop` is the one place that chooses; loops that are
#: never pipelined (over GQA heads, over decode splits) are ``while`` loops everywhere.
RANGE_LOOPS = tl.constexpr(not interpreted())


#: Whether kernels run through the interpreter, as a compile-time value.
INTERPRETED = tl.constexpr(interpreted())

# Kernels take flat pointer and integer arguments: ``torch.library.wrap_triton``
# (the ops ``torch.compile`` traces, see ``_common.traced``) passes only top-level
# tensors and integers through its graph -- a stride inside a tuple argument would
# be frozen into the graph as a constant. Each kernel groups its arguments into
# the records below as it starts, and its helpers take those. The records hold
# run-time values only: Triton turns the constants of a tuple assigned to a name
# into tensors, so compile-time flags travel as ``tl.constexpr`` arguments.

#: A ``(B, H, rows, ...)`` tensor: its pointer and the element strides of its batch,
#: head and row axes (the last axis is contiguous).
Strided = namedtuple("Strided", ["ptr", "stride_b", "stride_h", "stride_row"])
#: The rows of one (batch, head) of a :data:`Strided` tensor: base pointer and row stride.
Rows = namedtuple("Rows", ["base", "stride"])
#: The K and V :data:`Rows` of one (batch, kv head) (or the K and V, dK and dV tensors).
KV = namedtuple("KV", ["k", "v"])
#: The head-dim columns of a program's tiles: the offsets (``tl.arange``) of the padded
#: q/k and v widths, and the widths ``D`` and ``DV``.
Cols = namedtuple("Cols", ["d", "dv", "D", "DV"])
#: The tensors a backward reads per query row -- q, do, the checkpoints m and l, and
#: delta -- as :data:`Strided` tensors, or the :data:`Rows` of one head.
BackwardRows = namedtuple("BackwardRows", ["q", "do", "m", "l", "delta"])


@triton.jit
def head_rows(t, b, h):
    """:data:`Rows` of batch ``b``, head ``h`` (int64) of the :data:`Strided` tensor ``t``
    (or a plain ``(pointer, batch, head, row strides)`` tuple)."""
    ptr, stride_b, stride_h, stride_row = t
    return Rows(ptr + b * stride_b + h * stride_h, stride_row)


@triton.jit
def tile_loop(step, carry, lo, hi, STEP: tl.constexpr, ctx, flags):
    """``carry = step(carry, i, ctx, *flags)`` for ``i`` in ``range(lo, hi, STEP)``; the last carry.

    The one tile loop of the attention kernels: a ``for`` loop when compiled
    (which Triton software-pipelines), a ``while`` loop under the interpreter
    (see ``RANGE_LOOPS``). ``step`` is a ``@triton.jit`` function (a
    compile-time argument), ``carry`` the running values (a tensor or a tuple
    of them), ``ctx`` the run-time values the step reads, ``flags`` its
    compile-time arguments, as a tuple written in the call (see :data:`Strided`).
    """
    if RANGE_LOOPS:
        for i in range(lo, hi, STEP):
            carry = step(carry, i, ctx, *flags)
    else:
        i = lo
        while i < hi:
            carry = step(carry, i, ctx, *flags)
            i += STEP
    return carry


@triton.jit
def row_max(s):
    """Max of each row of ``s`` ignoring NaN, as the GPU's ``max.f32`` does.

    The interpreter reduces with ``numpy.nanmax``, which warns on an all-NaN
    row (a query row holding NaN), so there NaN is replaced by ``-inf`` first.
    The NaN still reaches the row through ``exp2(s - m)``.
    """
    if INTERPRETED:
        s = tl.where(s == s, s, float("-inf"))
    return tl.max(s, 1)


@triton.jit
def softmax_update(acc, m_i, l_i, s):
    """Online-softmax rescale of a query tile's running values by base-2 scores ``s``.

    Returns ``(p, acc, m, l)``: ``p = exp2(s - m)`` for the new row max ``m``
    and ``acc``, ``l`` rescaled to it (``l`` including ``p``); the caller adds
    ``p v`` to ``acc``. A row max of ``-inf`` (every score so far masked, or a NaN
    query row) is replaced by 0, which avoids ``-inf - -inf``.
    """
    m_new = tl.maximum(m_i, row_max(s))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, acc * alpha[:, None], m_new, l_i


@triton.jit
def load_tile(ptrs, row_ok, offs, width, MASK_ROWS: tl.constexpr, EVEN: tl.constexpr):
    """A ``(rows, cols)`` tile at ``ptrs``, 0 in rows not ``row_ok`` (``(rows, 1)``, with
    ``MASK_ROWS``) and in columns ``offs >= width`` (unless ``EVEN``: the tile is the width).

    A mask on the row axis alone keeps the rows loaded by the same 16-byte
    vectors as an unmasked tile.
    """
    if MASK_ROWS:
        if EVEN:
            tile = tl.load(ptrs, mask=row_ok, other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok & (offs[None, :] < width), other=0.0)
    elif EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs[None, :] < width, other=0.0)
    return tile


@triton.jit
def row_ptrs(rows, row_off, offs_m, offs_d):
    """Pointers of rows ``row_off + offs_m``, columns ``offs_d`` of :data:`Rows` ``rows``."""
    return rows.base + row_off * rows.stride + offs_m[:, None] * rows.stride + offs_d[None, :]


@triton.jit
def load_rows(
    rows, row_off, offs_m, row_ok, offs_d, D, MASK_ROWS: tl.constexpr, EVEN: tl.constexpr
):
    """Rows ``row_off + offs_m`` of :data:`Rows` ``rows``, columns ``offs_d`` (see :func:`load_tile`)."""
    ptrs = row_ptrs(rows, row_off, offs_m, offs_d)
    return load_tile(ptrs, row_ok[:, None], offs_d, D, MASK_ROWS, EVEN)


@triton.jit
def store_rows(rows, row_off, offs_m, row_ok, offs_d, D, x, EVEN: tl.constexpr):
    """Store ``x`` to rows ``row_off + offs_m`` of :data:`Rows` ``rows`` where ``row_ok``; the
    head-dim mask only if not ``EVEN``."""
    ptrs = row_ptrs(rows, row_off, offs_m, offs_d)
    x = x.to(rows.base.dtype.element_ty)
    if EVEN:
        tl.store(ptrs, x, mask=row_ok[:, None])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def kv_tile(
    kv, n0, offs_n, cols, k_len, MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr
):
    """The K and V tiles of keys ``n0 + offs_n`` of :data:`KV` ``kv``; ``MASKED`` zero-fills
    keys ``>= k_len``, ``EVEN_D`` / ``EVEN_DV``: the head dims fill the tile (no column mask).

    The key mask alone where the head dim fills the tile, so a masked tile is
    loaded by the same 16-byte vectors as a full one.
    """
    key_off = tl.cast(n0, tl.int64)
    k_ptrs = row_ptrs(kv.k, key_off, offs_n, cols.d)
    v_ptrs = row_ptrs(kv.v, key_off, offs_n, cols.dv)
    key_ok = ((n0 + offs_n) < k_len)[:, None]
    k = load_tile(k_ptrs, key_ok, cols.d, cols.D, MASKED, EVEN_D)
    v = load_tile(v_ptrs, key_ok, cols.dv, cols.DV, MASKED, EVEN_DV)
    return k, v


@triton.jit
def row_stats(m, l, delta, row_off, offs_m, row_ok):
    """Per query row ``row_off + offs_m``, from the :data:`Rows` of the checkpoints and ``delta``:
    ``lse2 = m log2 e + log2 l`` (``+inf`` if fully masked, so P = 0; NaN stays NaN) and ``delta``."""
    m_base = m.base + row_off * m.stride
    l_base = l.base + row_off * l.stride
    delta_base = delta.base + row_off * delta.stride
    m_row = tl.load(m_base + offs_m * m.stride, mask=row_ok, other=0.0)
    l_row = tl.load(l_base + offs_m * l.stride, mask=row_ok, other=0.0)
    seen = l_row != 0.0
    lse2 = tl.where(seen, m_row * LOG2E_CONST + tl.log2(tl.where(seen, l_row, 1.0)), float("inf"))
    delta_row = tl.load(delta_base + offs_m * delta.stride, mask=row_ok, other=0.0)
    return lse2, delta_row


@triton.jit
def store_output(
    out,
    row_off,
    state,
    live,
    offs_m,
    in_bounds,
    cols,
    EVEN_DV: tl.constexpr,
    STORE_STATS: tl.constexpr,
):
    """Write a query tile's ``o = acc / l_i`` (0 in rows not ``live``) from its online-softmax
    ``state = (acc, m_i, l_i)`` to rows ``row_off + offs_m`` where ``in_bounds`` of ``out``,
    the :data:`Rows` of ``o``, ``m`` and ``l``; with ``STORE_STATS`` also the checkpoints
    ``m`` (natural-log units; ``-inf`` where not live, NaN where ``l_i`` is) and ``l`` (0 where
    not live)."""
    o, m, l = out
    acc, m_i, l_i = state
    tile = acc / tl.where(live, l_i, 1.0)[:, None]
    tile = tl.where(live[:, None], tile, 0.0)
    store_rows(o, row_off, offs_m, in_bounds, cols.dv, cols.DV, tile, EVEN_DV)
    if STORE_STATS:
        m_out = tl.where(live, m_i * LN2_CONST, float("-inf"))
        m_out = tl.where(l_i == l_i, m_out, float("nan"))
        l_out = tl.where(live, l_i, 0.0)
        tl.store(m.base + row_off * m.stride + offs_m * m.stride, m_out, mask=in_bounds)
        tl.store(l.base + row_off * l.stride + offs_m * l.stride, l_out, mask=in_bounds)


@triton.jit
def backward_heads(t, b, h):
    """The :data:`BackwardRows` of batch ``b``, head ``h`` of the tensors ``t``."""
    return BackwardRows(
        head_rows(t.q, b, h),
        head_rows(t.do, b, h),
        head_rows(t.m, b, h),
        head_rows(t.l, b, h),
        head_rows(t.delta, b, h),
    )


@triton.jit
def query_tile(
    head, row_off, offs_m, row_ok, cols, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_TYPE
):
    """``(q, do, lse2, delta)`` of query rows ``row_off + offs_m`` of one head's
    :data:`BackwardRows` (0 where not ``row_ok``; ``lse2`` and ``delta`` as :func:`row_stats`)."""
    q = load_rows(head.q, row_off, offs_m, row_ok, cols.d, cols.D, True, EVEN_D).to(DOT_TYPE)
    do = load_rows(head.do, row_off, offs_m, row_ok, cols.dv, cols.DV, True, EVEN_DV)
    do = do.to(DOT_TYPE)
    lse2, delta = row_stats(head.m, head.l, head.delta, row_off, offs_m, row_ok)
    return q, do, lse2, delta


def dim_block(d: int) -> int:
    """Tile width covering a head dim ``d``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(d))


def dot_type(dtype):
    """The ``tl`` dtype of ``tl.dot`` operands for torch inputs of ``dtype``.

    The input dtype itself, except bfloat16 under the interpreter: Triton
    3.6's interpreter keeps bfloat16 as raw 16-bit integers and multiplies
    those in ``tl.dot``, so there the operands are widened to float32.
    """
    import torch

    if dtype == torch.bfloat16:
        return tl.float32 if interpreted() else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype) -> str:
    """``tl.dot`` input precision: exact IEEE products for float32 inputs (no TF32 rounding)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def head_meta(q, v) -> dict:
    """The compile-time arguments every attention kernel takes from ``q``'s dtype and the head
    dims (last axes) of ``q`` and ``v``: ``PRECISION``, ``DOT_TYPE``, the padded ``BLOCK_D``,
    ``BLOCK_DV`` and whether they equal the head dims (``EVEN_D``, ``EVEN_DV``)."""
    block_d, block_dv = dim_block(q.shape[-1]), dim_block(v.shape[-1])
    return {
        "PRECISION": dot_precision(q.dtype),
        "DOT_TYPE": dot_type(q.dtype),
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
        "EVEN_D": block_d == q.shape[-1],
        "EVEN_DV": block_dv == v.shape[-1],
    }


def sm_count(like) -> int:
    """Streaming multiprocessors of ``like``'s CUDA device; 1 for CPU tensors (the interpreter)."""
    if like.device.type != "cuda":
        return 1
    import torch

    index = like.device.index if like.device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@dataclass(frozen=True)
class Tile:
    """One launch configuration: a query-by-key tile and its warps and pipeline stages.

    ``block_m`` is None for kernels whose rows are not tiled (decode: one
    query per head).
    """

    block_m: int | None
    block_n: int
    num_warps: int
    num_stages: int

    def blocks(self) -> dict[str, int]:
        """The tile as kernel meta-parameters (``BLOCK_M``, ``BLOCK_N``)."""
        if self.block_m is None:
            return {"BLOCK_N": self.block_n}
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    def config(self) -> triton.Config:
        return triton.Config(self.blocks(), num_warps=self.num_warps, num_stages=self.num_stages)


def head_class(block_d: int) -> int:
    """Head-dim class of a tile width: 64, 128 or 256."""
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


@dataclass(frozen=True)
class TileTable:
    """Per head-dim class: a default tile and the candidates searched on large CUDA problems.

    ``default`` serves 2-byte inputs, ``wide_default`` float32 (never
    searched); both fit Hopper's shared memory. Candidates that do not fit
    are discarded by the search.
    """

    default: dict[int, Tile]
    wide_default: dict[int, Tile]
    candidates: dict[int, tuple[Tile, ...]]

    def choose(self, block_d: int, element_size: int) -> Tile:
        """The untuned tile for a head-dim width and input element size."""
        table = self.wide_default if element_size >= 4 else self.default
        tile = table[head_class(block_d)]
        if interpreted():
            return Tile(None if tile.block_m is None else 16, 16, 4, 1)
        return tile


def _time_candidate(kernel_call, quantiles):
    """``quantiles`` of the milliseconds of ``kernel_call``: 3 warm-up runs, 10 timed ones.

    Timed with CUDA events and no L2 flush, so unlike ``triton.testing.do_bench``
    the search allocates no device memory: a call with every buffer supplied
    stays allocation-free, also the first time a shape is seen.
    """
    import torch

    for _ in range(3):
        kernel_call()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    for start, end in zip(starts, ends):
        start.record()
        kernel_call()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends))
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


def autotuned(kernel, table: TileTable, key: list[str]):
    """``kernel`` wrapped in a bounded ``triton.autotune`` over ``table``'s candidates.

    The candidates tried for a launch are those of its head-dim class (read
    from the ``BLOCK_D`` launch argument); each is timed once per ``key``.
    Every kernel tuned this way overwrites its outputs from its inputs alone,
    so the repeated runs of the search leave the same results.
    """
    configs = []
    by_config = {}
    for cls, tiles in table.candidates.items():
        for tile in tiles:
            config = tile.config()
            configs.append(config)
            by_config[id(config)] = cls

    def prune(configs, named_args, **kwargs):
        cls = head_class(kwargs["BLOCK_D"])
        return [c for c in configs if by_config[id(c)] == cls]

    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": prune},
        do_bench=_time_candidate,
    )(kernel)


def use_autotune(work: int, like) -> bool:
    """Whether a launch searches tiles: 2-byte inputs on CUDA, ``work >= AUTOTUNE_MIN_WORK``."""
    return (
        like.device.type == "cuda"
        and like.element_size() == 2
        and not interpreted()
        and work >= AUTOTUNE_MIN_WORK
    )


def tile_grid(n: int, block: str, programs: int, varlen: bool = False):
    """``grid(blocks)`` for :func:`launch`: the tiles of ``n`` rows, ``blocks[block]`` rows a
    tile, for each of ``programs`` (batch x heads), on one axis, or on two with ``varlen``."""

    def grid(blocks):
        tiles = triton.cdiv(n, blocks[block])
        return (tiles, programs) if varlen else (tiles * programs,)

    return grid


def launch(kernel, tuned, table: TileTable, grid, args, meta, work: int, like) -> None:
    """Run ``kernel`` with ``table``'s tile, or its tuned wrapper ``tuned`` on large CUDA problems.

    ``grid(blocks)`` maps the chosen ``BLOCK_M``/``BLOCK_N`` to the launch grid (or
    ``grid`` is the grid itself); ``meta`` must hold ``BLOCK_D``. Launched on ``like``'s
    device (``_common.launch``).
    """
    if use_autotune(work, like):
        launch_on(tuned, like, grid, *args, **meta)
        return
    tile = table.choose(meta["BLOCK_D"], like.element_size())
    blocks = tile.blocks()
    grid = grid(blocks) if callable(grid) else grid
    launch_on(
        kernel,
        like,
        grid,
        *args,
        **meta,
        **blocks,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def strides_of(*tensors) -> tuple[int, ...]:
    """The (batch, head, row) element strides of each ``(B, H, rows, ...)`` tensor, in order:
    a kernel's stride arguments. A None tensor (never read) gives zeros."""
    return tuple(st for t in tensors for st in ((0, 0, 0) if t is None else t.stride()[:3]))


def scalar_or_pointer(value, like):
    """``(pointer_argument, scalar, is_array)`` for an int-or-array option such as ``input_pos``.

    Integers travel as kernel scalars (the pointer slot gets ``like``, never
    read); arrays are read per batch inside the kernel.
    """
    if isinstance(value, int):
        return like, value, False
    return value, 0, True
