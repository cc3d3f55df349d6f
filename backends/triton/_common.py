"""Shared pieces of the Triton row kernels: launch checks, launch configurations, partial sums.

Row kernels (norms, softmax) see 2-D ``(rows, M)`` views with a contiguous last
axis and an arbitrary row stride, passed explicitly. Each program handles
tiles of ``ROWS x BLOCK_M`` elements:

- **fused**: the padded row fits in registers (``BLOCK_M = next_pow2(M)``):
  one read of the input per pass; short rows are packed several per tile;
- **streaming**: wider rows are read in ``BLOCK_M`` chunks twice, first to
  reduce, then to write; the first pass asks the cache to keep the row
  (``evict_last``) so the second pass mostly hits L2.

The Triton 3.6 interpreter cannot run ``range`` over a run-time bound with
NumPy >= 2.4 (its scalars are 1-element arrays, which NumPy no longer turns
into indices). So loops over the chunks of a streaming row run to a
``constexpr`` count (``N_CHUNKS``: one compilation per chunk count) and stay
``for`` loops the compiler may software-pipeline, while the persistent loop of
a partial-sum backward over its row tiles, whose trip count depends on the
number of rows, is a ``while`` loop (one whole tile per iteration).

Partial sums: a backward that reduces ``dW``/``dB`` runs ``P`` programs; program
``p`` walks row tiles ``p, p + P, ...``, keeps its sums in registers (fused) or
in its own row of the caller's ``(P, M)`` float32 scratch (streaming), and
finally owns row ``p`` of the scratch outright; :func:`reduce_partials` then
sums the ``P`` rows in a fixed order. No atomics, no locks, deterministic.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton.runtime.interpreter import InterpretedFunction

from xpkernels.registry import BackendError

__all__ = [
    "ELEMENTS_PER_THREAD",
    "FUSED_LIMIT",
    "MAX_WARPS",
    "STREAM_BLOCK",
    "STREAM_ROWS",
    "TILE_BYTES",
    "VECTOR_BYTES",
    "RowConfig",
    "fill_empty_row_checkpoints",
    "launch",
    "launch_context",
    "launch_rows",
    "load_chunk",
    "load_row_vector",
    "load_tile",
    "partial_programs",
    "resident_programs",
    "reduce_partials",
    "row_chunk",
    "row_config",
    "row_strides",
    "store_tile",
    "traced",
    "tracing",
]

#: Bytes of one vector load or store (128 bits): the smallest ``BLOCK_M`` in bytes.
VECTOR_BYTES = 16
#: Longest padded row (elements) a fused kernel holds in registers, per pass.
#: The backward keeps ``x``, ``dy``, the weight and the ``dW`` sum live, hence half.
FUSED_LIMIT = {"forward": 16384, "backward": 8192}
#: Chunk length (elements) of the streaming kernels, per pass.
STREAM_BLOCK = {"forward": 4096, "backward": 1024}
#: Rows per tile of the streaming kernels: the backward amortises its read-add-write
#: of the program's ``dW`` partial row over several rows.
STREAM_ROWS = {"forward": 1, "backward": 4}
#: Input bytes a fused tile aims for, per pass: short rows are packed until a tile holds this much.
TILE_BYTES = {"forward": 16384, "backward": 8192}
#: Elements of a tile each thread holds, per pass: sets ``num_warps`` (at most
#: ``MAX_WARPS``). The backward keeps more tensors live, so it spreads a tile wider;
#: compiled for sm_90a (ptxas, M from 64 to 65536) every kernel needs at most
#: 127 registers per thread and none spills.
ELEMENTS_PER_THREAD = {"forward": 16, "backward": 8}
MAX_WARPS = 16
#: Registers of one SM (sm_80 and sm_90), allocated per thread in units of 8.
SM_REGISTERS = 65536
#: Most programs per SM a partial-sum backward launches on CUDA, and its program count on CPU.
MAX_PROGRAMS_PER_SM = 2
CPU_PROGRAMS = 4


@dataclass(frozen=True)
class RowConfig:
    """How a row kernel is launched for one ``(M, dtype, pass)``.

    Attributes
    ----------
    block_m : int
        Columns per tile: the padded row (fused) or one chunk (streaming).
    rows : int
        Rows per tile.
    num_warps : int
        Warps per program.
    n_chunks : int
        Chunks per row: 1 for fused kernels.
    """

    block_m: int
    rows: int
    num_warps: int
    n_chunks: int

    @property
    def streaming(self) -> bool:
        """True when a row is read in chunks, twice."""
        return self.n_chunks > 1

    def tiles(self, rows: int) -> int:
        """Tiles covering ``rows`` rows."""
        return triton.cdiv(rows, self.rows)

    @property
    def meta(self) -> dict:
        """The launch keywords: ``ROWS``, ``BLOCK_M``, ``num_warps``, and ``N_CHUNKS`` when streaming."""
        meta = {"ROWS": self.rows, "BLOCK_M": self.block_m, "num_warps": self.num_warps}
        if self.streaming:
            meta["N_CHUNKS"] = self.n_chunks
        return meta


def row_strides(*tensors) -> tuple[int, ...]:
    """Each tensor's stride between rows (axis 0): a row kernel's stride arguments; 0 for None."""
    return tuple(0 if t is None else t.stride(0) for t in tensors)


def _warps(elements: int, pass_: str) -> int:
    return max(1, min(MAX_WARPS, elements // (32 * ELEMENTS_PER_THREAD[pass_])))


def row_config(m: int, itemsize: int, pass_: str) -> RowConfig:
    """The launch configuration of a row kernel.

    Parameters
    ----------
    m : int
        Row length.
    itemsize : int
        Bytes per element of the row input.
    pass_ : {"forward", "backward"}
        Which pass (the backward keeps more tensors live).

    Returns
    -------
    RowConfig
    """
    vector = VECTOR_BYTES // itemsize
    padded = max(triton.next_power_of_2(m), vector)
    if padded <= FUSED_LIMIT[pass_]:
        rows = max(1, TILE_BYTES[pass_] // (itemsize * padded))
        return RowConfig(padded, rows, _warps(rows * padded, pass_), 1)
    block = STREAM_BLOCK[pass_]
    rows = STREAM_ROWS[pass_]
    return RowConfig(block, rows, _warps(rows * block, pass_), triton.cdiv(m, block))


@functools.cache
def _sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached: one query per device).

    The one definition: the row kernels' partial sums and the attention
    kernels' :func:`~._attn_common.sm_count` both read it.
    """
    return torch.cuda.get_device_properties(index).multi_processor_count


def resident_programs(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps using ``registers`` per thread that one SM holds at once.

    Registers bound the row kernels' occupancy (their shared memory is a few
    KiB); capped at :data:`MAX_PROGRAMS_PER_SM`, never below one.
    """
    allocated = -(-registers // 8) * 8
    return max(1, min(MAX_PROGRAMS_PER_SM, SM_REGISTERS // (allocated * 32 * num_warps)))


def partial_programs(
    rows: int, m: int, like, registers: dict[bool, int], config: RowConfig | None = None
) -> int:
    """Programs (and partial-sum rows ``P``) of a backward that reduces ``dW``/``dB``.

    On CUDA, one whole wave: the SM count times the programs one SM holds
    (:func:`resident_programs` of the kernel's registers and warps), so no
    program waits for another to finish and no partial row is added for
    nothing. A few on CPU. Never more than the tiles of ``rows`` rows, never
    fewer than one.

    Parameters
    ----------
    rows : int
        Rows of the whole backward.
    m : int
        Row length.
    like : torch.Tensor
        The backward's input ``x`` (device and dtype).
    registers : dict of bool to int
        Registers per thread of the kernel's sm_90 build, by whether it
        streams (``RowConfig.streaming``); ``tests/test_compile_report.py``
        holds them against the compiled kernels.
    config : RowConfig, optional
        The kernel's launch configuration, when it is not
        ``row_config(m, ..., "backward")``.

    Returns
    -------
    int
    """
    if config is None:
        config = row_config(m, like.element_size(), "backward")
    if like.device.type == "cuda":
        index = like.device.index if like.device.index is not None else torch.cuda.current_device()
        per_sm = resident_programs(registers[config.streaming], config.num_warps)
        cap = per_sm * _sm_count(index)
    else:
        cap = CPU_PROGRAMS
    return max(1, min(cap, config.tiles(rows)))


def tracing(tensor) -> bool:
    """Whether torch is tracing the call ``tensor`` belongs to (fake tensors, ``torch.compile``).

    Then no kernel runs: launches are recorded through :func:`traced`, and no
    device is entered or queried.
    """
    return is_fake(tensor) or torch.compiler.is_compiling()


def traced(kernel, like):
    """``kernel`` as launched for tensors like ``like``: through ``wrap_triton`` while traced.

    The ``xpkernels::*_triton`` ops (``xpkernels.torch``) are
    ``torch.library.triton_op`` s: under ``torch.compile`` their
    implementation runs on fake tensors, and each wrapped launch becomes a
    node of the graph that Inductor compiles with the kernel itself. On real
    tensors the kernel launches directly (wrapping costs a dispatch per launch).
    """
    return torch.library.wrap_triton(kernel) if tracing(like) else kernel


def launch_context(kernel, tensor):
    """The context a launch of ``kernel`` on ``tensor``'s device runs in.

    CUDA launches go to the tensor's device (Triton launches on the current
    one); while torch traces (:func:`tracing`) nothing launches and no device
    is entered. CPU tensors run only through the Triton interpreter, which
    Triton chooses when a kernel is defined: ``TRITON_INTERPRET=1`` must be
    set before ``xpkernels.backends.triton`` is imported.

    Raises
    ------
    BackendError
        CPU tensors, but the kernels were compiled for a GPU.
    """
    if tracing(tensor):
        return contextlib.nullcontext()
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    if not isinstance(kernel, InterpretedFunction):
        raise BackendError(
            "triton: torch CPU tensors run only through the Triton interpreter, but "
            "xpkernels.backends.triton was imported without TRITON_INTERPRET=1; set "
            "TRITON_INTERPRET=1 in the environment before importing xpkernels' triton kernels"
        )
    return contextlib.nullcontext()


def launch(kernel, like, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` for tensors like ``like``: in its :func:`launch_context`,
    through :func:`traced`."""
    with launch_context(kernel, like):
        traced(kernel, like)[grid](*args, **meta)


def launch_rows(fused, streaming, config: RowConfig, like, *args, programs=None, **meta) -> None:
    """Launch a row kernel over the ``(rows, M)`` tensor ``like``: ``streaming`` when ``config``
    streams, else ``fused``, with ``config.meta``; one program per row tile unless ``programs``."""
    kernel = streaming if config.streaming else fused
    grid = (config.tiles(like.shape[0]) if programs is None else programs,)
    launch(kernel, like, grid, *args, **meta, **config.meta)


def fill_empty_row_checkpoints(eps: float, rstd, mean=None) -> None:
    """Write the checkpoints of rows with no columns (``M = 0``), as the array_api backend does.

    Every sum over an empty row is 0 and is divided by ``max(M, 1)``: the mean
    and the mean square are 0, so ``rstd = 1/sqrt(eps)`` (finite: ``eps > 0``).
    The row kernels, which divide by ``M``, are not launched for such rows.

    Parameters
    ----------
    eps : float
        Added to the mean square (or variance); positive.
    rstd, mean : torch.Tensor or None
        ``(rows,)`` float32 checkpoints to fill; None ones are skipped.
    """
    if rstd is not None:
        rstd.fill_(1.0 / math.sqrt(eps))
    if mean is not None:
        mean.zero_()


@triton.jit
def load_tile(ptr, r, cols, stride, mask):
    """The tile of the ``(rows, M)`` array at ``ptr`` (rows ``stride`` apart) in float32, 0
    outside ``mask``: rows ``r`` (a column), columns ``cols`` (a row)."""
    return tl.load(ptr + r * stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, r, cols, stride, mask, value):
    """Store the float32 tile ``value`` into the array at ``ptr``, in its dtype (as :func:`load_tile`)."""
    tl.store(ptr + r * stride + cols, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_chunk(k, m, row_ok, BLOCK_M: tl.constexpr):
    """Chunk ``k`` of a streaming row tile: its columns, which of them lie in the row (``< m``),
    and the mask of its elements (rows ``row_ok``, columns in the row)."""
    cols = k * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < m
    return cols, col_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def load_chunk(row_ptrs, cols, mask, EVICT: tl.constexpr):
    """Columns ``cols`` of the rows starting at ``row_ptrs`` (a column) in float32, 0 outside
    ``mask``; ``EVICT``, the cache's eviction policy."""
    x = tl.load(row_ptrs + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT)
    return x.to(tl.float32)


@triton.jit
def load_row_vector(ptr, cols, col_ok, ROWS: tl.constexpr):
    """``ptr[cols]`` (0 where not ``col_ok``) as float32, repeated down ``ROWS`` rows.

    Loaded as a ``(ROWS, BLOCK)`` tile, in the layout of the row tile it
    scales: each thread reads its own 16-byte run of the vector (the copies
    down the rows are L1 hits). A 1-D load of a chunk spread over a wide tile's
    threads would be split into 2- or 4-byte pieces and re-laid out through
    shared memory.
    """
    ptrs = tl.broadcast_to(ptr + cols[None, :], (ROWS, cols.shape[0]))
    mask = tl.broadcast_to(col_ok[None, :], (ROWS, cols.shape[0]))
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _reduce_partials_kernel(
    partial_ptr,  # (P, M) float32 partial sums
    total_ptr,  # (M,) column sums: out, or row 0 of partial (then cast by _cast_row_kernel)
    p, m,  # number of partial rows P, row length M
    stride_partial_p, stride_partial_m,  # element strides between partial rows, along a row
    stride_total,  # element stride of total
    BLOCK_P: tl.constexpr,  # partial rows summed per step
    BLOCK_N: tl.constexpr,  # columns per program
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < m
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    start = 0
    while start < p:
        prow = start + tl.arange(0, BLOCK_P)
        mask = (prow < p)[:, None] & col_ok[None, :]
        rows64 = prow.to(tl.int64)[:, None]
        ptrs = partial_ptr + rows64 * stride_partial_p + cols64[None, :] * stride_partial_m
        acc += tl.load(ptrs, mask=mask, other=0.0)
        start += BLOCK_P
    total = tl.sum(acc, axis=0)
    tl.store(total_ptr + cols64 * stride_total, total.to(total_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _cast_row_kernel(
    src_ptr, out_ptr,  # (M,) float32 column sums, (M,) output of a 16-bit float dtype
    m,  # row length M
    stride_src, stride_out,  # element strides of src and out
    BLOCK: tl.constexpr,  # columns per program: 8 per thread, one 16-byte store each
):  # fmt: skip
    cols = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = cols < m
    total = tl.load(src_ptr + cols * stride_src, mask=ok, other=0.0)
    tl.store(out_ptr + cols * stride_out, total.to(out_ptr.dtype.element_ty), mask=ok)


#: Columns per program (one 128-byte line of float32) and partial rows per step of
#: the reduction: narrow column blocks give M / 32 programs (128 at M = 4096).
REDUCE_BLOCK_N = 32
REDUCE_BLOCK_P = 64
#: Warps and columns per program of the cast to a 16-bit ``out``: 8 columns a thread
#: (a 16-byte store; fewer columns than ``8 x threads`` would split it into 2-byte ones).
CAST_WARPS = 4
CAST_BLOCK = 8 * 32 * CAST_WARPS


def reduce_partials(partial, out) -> None:
    """``out[:] = partial.sum(0)``, accumulated in float32, written in ``out``'s dtype.

    The column sums of the narrow column blocks go straight to a float32
    ``out``; for a 16-bit ``out`` they overwrite row 0 of ``partial`` (each
    block's program has read its columns of every row first) and a second
    kernel casts them into ``out`` with 16-byte stores. ``partial`` (float32) and ``out``
    may have any strides. The contract of :func:`xpkernels.backends.protocol.reduce_partials`.
    """
    p, m = partial.shape
    if m == 0:
        return
    direct = out.dtype == partial.dtype or p == 0
    total = out if direct else partial[0]
    args = (partial, total, p, m, *partial.stride(), total.stride(0))
    meta = {"BLOCK_P": REDUCE_BLOCK_P, "BLOCK_N": REDUCE_BLOCK_N, "num_warps": 4}
    launch(_reduce_partials_kernel, partial, (triton.cdiv(m, REDUCE_BLOCK_N),), *args, **meta)
    if not direct:
        args = (total, out, m, total.stride(0), out.stride(0))
        meta = {"BLOCK": CAST_BLOCK, "num_warps": CAST_WARPS}
        launch(_cast_row_kernel, partial, (triton.cdiv(m, CAST_BLOCK),), *args, **meta)
