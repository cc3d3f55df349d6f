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
from dataclasses import dataclass

import triton
import triton.language as tl

from ._common import _sm_count, traced

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
#: still works. Loops that are never pipelined (over GQA heads, over decode
#: splits) are ``while`` loops everywhere.
RANGE_LOOPS = tl.constexpr(not interpreted())


#: Whether kernels run through the interpreter, as a compile-time value.
INTERPRETED = tl.constexpr(interpreted())


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
def kv_tile(
    k_base,
    v_base,
    n0,
    stride_kn,
    stride_vn,
    offs_n,
    offs_d,
    offs_dv,
    k_len,
    D,
    DV,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
):
    """The K and V tiles of keys ``n0 + offs_n``; ``MASKED`` zero-fills keys ``>= k_len``."""
    key_off = tl.cast(n0, tl.int64)
    k_ptrs = k_base + key_off * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = v_base + key_off * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :]
    if MASKED:
        # Mask on the key axis alone where the head dim fills the tile, so a masked
        # tile is loaded by the same 16-byte vectors as a full one.
        key_ok = ((n0 + offs_n) < k_len)[:, None]
        if EVEN_D:
            k = tl.load(k_ptrs, mask=key_ok, other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok & (offs_d[None, :] < D), other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs, mask=key_ok, other=0.0)
        else:
            v = tl.load(v_ptrs, mask=key_ok & (offs_dv[None, :] < DV), other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    return k, v


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


def launch(kernel, tuned, table: TileTable, grid, args, meta, work: int, like) -> None:
    """Run ``kernel`` with ``table``'s tile, or its tuned wrapper ``tuned`` on large CUDA problems.

    ``grid(blocks)`` maps the chosen ``BLOCK_M``/``BLOCK_N`` to the launch grid;
    ``meta`` must hold ``BLOCK_D``.
    """
    if use_autotune(work, like):
        traced(tuned, like)[grid](*args, **meta)
        return
    tile = table.choose(meta["BLOCK_D"], like.element_size())
    blocks = tile.blocks()
    traced(kernel, like)[grid(blocks)](
        *args, **meta, **blocks, num_warps=tile.num_warps, num_stages=tile.num_stages
    )


def scalar_or_pointer(value, like):
    """``(pointer_argument, scalar, is_array)`` for an int-or-array option such as ``input_pos``.

    Integers travel as kernel scalars (the pointer slot gets ``like``, never
    read); arrays are read per batch inside the kernel.
    """
    if isinstance(value, int):
        return like, value, False
    return value, 0, True
