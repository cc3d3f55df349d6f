"""Launch code shared by the row kernels (``rms_norm.cu``, ``layer_norm.cu``, ``softmax.cu``,
``swiglu.cu``: ``rows.cuh``).

Rows of up to ``WARP_MAX_M`` elements
get a warp each (``WARP_ROWS`` rows per block), wider rows a block each;
every thread keeps ``CACHE_ELEMENTS`` elements (``SCALAR_CACHE`` on the
scalar path) of its row in registers and streams the rest. Accesses are
128-bit vectors whenever the row length, strides and addresses allow.
"""

from __future__ import annotations

import numpy as np

from ._loader import address, loader_for

CACHE_ELEMENTS = 16  #: elements of a row each thread keeps in registers (vector path)
SCALAR_CACHE = 4  #: the same for the scalar path (unaligned rows), whose loads need more registers
WARP_MAX_M = 32 * CACHE_ELEMENTS  #: longest row served by the warp-per-row kernels (vector path)
WARP_ROWS = 8  #: rows (warps) per block of the warp-per-row kernels
MAX_THREADS = 1024  #: threads per block of the block-per-row forwards
BACKWARD_MAX_THREADS = 512  #: threads per block of the block-per-row backwards (they keep two rows)
DEFAULT_SHARED = 48 * 1024  #: dynamic shared memory usable without raising the kernel's limit
REDUCE_THREADS = 256  #: threads per block of the reduce_partials kernel

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
#: The instantiations of rows.cuh's ``reduce_partials`` kernel, one per output dtype.
REDUCE_EXPRESSIONS = [f"reduce_partials<{t}>" for t in CTYPES.values()]
NULL = np.uint64(0)  #: a null pointer argument (CuPy passes None as 0xffffffff)


def ctype(op: str, name: str, a) -> str:
    """The CUDA C type of ``a``'s dtype; TypeError naming ``op`` and ``name`` when unsupported."""
    t = CTYPES.get(str(a.dtype))
    if t is None:
        raise TypeError(
            f"cupy {op}: {name} has dtype {a.dtype}; supported: float32, float16, bfloat16"
        )
    return t


def kind(op: str, name: str, a) -> np.int32:
    """The kernels' kind of ``a``'s dtype (0: float32, 1: float16, 2: bfloat16); TypeError as
    :func:`ctype`'s."""
    ctype(op, name, a)
    return np.int32(list(CTYPES).index(str(a.dtype)))


def index_bytes(op: str, name: str, a) -> np.int32:
    """Bytes per element of an int32 or int64 ``a``; TypeError naming ``op`` and ``name`` else."""
    size = {"int32": 4, "int64": 8}.get(str(a.dtype))
    if size is None:
        raise TypeError(f"cupy {op}: {name} has dtype {a.dtype}; supported: int32, int64")
    return np.int32(size)


def float32s(op: str, **arrays) -> None:
    """TypeError naming ``op`` and the array unless every one of ``arrays`` (or None) is float32."""
    for name, a in arrays.items():
        if a is not None and str(a.dtype) != "float32":
            raise TypeError(f"cupy {op}: {name} must be float32, got {a.dtype}")


def same_type(op: str, first: str, lead, *others) -> str:
    """The CUDA C type of ``lead`` (named ``first``), which every one of ``others`` must share."""
    t = ctype(op, first, lead)
    for other in others:
        if other.dtype != lead.dtype:
            raise TypeError(
                f"cupy {op}: every array must have {first}'s dtype {lead.dtype}, got {other.dtype}"
            )
    return t


def mixed(*arrays) -> bool:
    """True when the float arrays among ``arrays`` (None skipped) have more than one dtype."""
    return len({str(a.dtype) for a in arrays if a is not None}) > 1


def in_float32(arrays, outputs=()):
    """``arrays`` for kernels compiled for one dtype, when a call mixes them: every one in
    float32 (None stays None), and the ``finish()`` that completes the call.

    Inputs are copied to float32 (exactly: it holds every 16-bit value); the
    outputs (``outputs``, indices into ``arrays``) not already float32 are
    float32 temporaries that ``finish()`` writes into them, one rounding, as a
    kernel storing its float32 result would: the results are those of a
    kernel taking each array in its own dtype, at the cost of the copies.
    """
    staged, written = list(arrays), []
    for i, a in enumerate(arrays):
        if a is not None and str(a.dtype) not in CTYPES:
            raise TypeError(f"cupy: dtype {a.dtype}; supported: float32, float16, bfloat16")
        if a is not None and str(a.dtype) != "float32":
            staged[i] = a.astype("float32")
            if i in outputs:
                written.append((a, staged[i]))

    def finish() -> None:
        for out, temporary in written:
            out[...] = temporary

    return tuple(staged), finish


def stride(a, axis: int = 0) -> int:
    """Elements between consecutive indices of ``a`` along ``axis``."""
    return a.strides[axis] // a.itemsize


def strides(a, axes) -> list[np.int64]:
    """Elements between consecutive indices of ``a`` along each of ``axes`` (zeros for None)."""
    return [np.int64(0 if a is None else stride(a, axis)) for axis in axes]


def aligned(a, axes, n: int) -> bool:
    """Every stride of ``a`` along ``axes`` (of extent above 1) is a multiple of ``n`` elements."""
    return all(a.shape[i] <= 1 or stride(a, i) % n == 0 for i in axes)


def ptr(a):
    """``a``, or a null pointer when ``a`` is None."""
    return NULL if a is None else a


def vector(rows2d, vectors=()) -> int:
    """Elements per access: 16 bytes' worth when every row start and vector allows it, else 1.

    ``rows2d`` are ``(rows, M)`` arrays of one dtype; ``vectors`` are ``(M,)``
    contiguous arrays (or None) read with the same element offsets.
    """
    v = 16 // rows2d[0].itemsize
    m = rows2d[0].shape[1]
    ok = m % v == 0 and all(address(a) % 16 == 0 and aligned(a, (0,), v) for a in rows2d)
    return v if ok and all(a is None or address(a) % (v * a.itemsize) == 0 for a in vectors) else 1


def cache(v: int) -> int:
    """Vectors of ``v`` elements each thread keeps in registers."""
    return CACHE_ELEMENTS // v if v > 1 else SCALAR_CACHE


def warp_max(v: int) -> int:
    """Longest row the warp-per-row kernels serve with ``v``-element accesses."""
    return 32 * v * cache(v)


def vectors(*types: str) -> list[int]:
    """The access widths compiled for arrays of element ``types``: scalar, and 16 bytes of the
    narrowest."""
    return sorted({1, 16 // min(ITEMSIZE[t] for t in types)})


def expressions(op: str, kernels, *types: str) -> list[str]:
    """Instantiations ``<op>_<kernel><types..., V, C>`` of each kernel for both access widths."""
    t = ",".join(types)
    return [f"{op}_{k}<{t},{v},{cache(v)}>" for v in vectors(types[0]) for k in kernels]


def block_threads(m: int, v: int, limit: int) -> int:
    """Threads of a block-per-row kernel: enough to hold the row in registers, within [32, limit]."""
    threads = -(-m // (v * cache(v)))
    return max(32, min(limit, -(-threads // 32) * 32))


def raise_shared_limit(kernel, shared: int) -> None:
    """Let ``kernel`` use ``shared`` bytes of dynamic shared memory (beyond the default 48 KiB)."""
    if shared > DEFAULT_SHARED and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared


def row_args(arrays, rows: int, m: int) -> tuple:
    """``(*arrays, rows, M, row stride of each array)``: the arguments of the kernels that take
    only same-shaped ``(rows, M)`` arrays (softmax, SwiGLU)."""
    return (*arrays, np.int64(rows), np.int32(m), *(np.int64(stride(a)) for a in arrays))


def launch(kernel_of, rows: int, m: int, v: int, args, threads_limit: int) -> None:
    """Run ``kernel_of("warp")`` over ``rows`` rows of ``m`` elements (``v`` per access) when
    they fit a warp, else ``kernel_of("block")`` (at most ``threads_limit`` threads)."""
    if m <= warp_max(v):
        kernel_of("warp")((-(-rows // WARP_ROWS),), (32, WARP_ROWS), args)
    else:
        kernel_of("block")((rows,), (block_threads(m, v, threads_limit),), args)


def partial_rows(rows: int, m: int, like, per_sm: int) -> int:
    """Rows of a backward's partial sums: ``per_sm`` per multiprocessor, at most one per row tile."""
    tiles = -(-rows // WARP_ROWS) if m <= WARP_MAX_M else rows
    return max(1, min(per_sm * loader_for(like).sm_count(like), tiles))


def backward_grid(rows: int, m: int, v: int, partial, like, blocks_per_sm: int) -> int:
    """Blocks of a backward: one per row of ``partial``, else one per row tile (a warp's rows or
    a row), at most ``blocks_per_sm`` per multiprocessor."""
    if partial is not None:
        return partial.shape[0]
    tiles = -(-rows // WARP_ROWS) if m <= warp_max(v) else rows
    return min(tiles, blocks_per_sm * loader_for(like).sm_count(like))


def launch_backward(kernel_of, grid: int, m: int, v: int, args, sums: int, smem_max: int) -> None:
    """Run a norm's backward over ``grid`` blocks with ``sums`` column sums (dw, db) to keep.

    ``kernel_of("warp")`` when the rows fit a warp (its warps' sums meet in shared memory),
    else ``kernel_of("block")``, which takes one more argument: whether the sums are kept in
    shared memory (when they fit ``smem_max`` bytes) rather than in the partial rows.
    """
    block: tuple[int, ...]
    if m <= warp_max(v):
        kernel, block, shared = kernel_of("warp"), (32, WARP_ROWS), sums * WARP_ROWS * m * 4
    else:
        in_smem = sums > 0 and sums * m * 4 <= smem_max
        kernel, block = kernel_of("block"), (block_threads(m, v, BACKWARD_MAX_THREADS),)
        shared, args = (sums * m * 4 if in_smem else 0), (*args, np.int32(1 if in_smem else 0))
    raise_shared_limit(kernel, shared)
    kernel((grid,), block, tuple(args), shared_mem=shared)


def partial_strides(op: str, partial) -> tuple[np.int64, np.int64]:
    """Row and column strides of a float32 ``(P, M)`` partial (zeros for None)."""
    if partial is None:
        return np.int64(0), np.int64(0)
    if str(partial.dtype) != "float32":
        raise TypeError(f"cupy {op}: the partials must be float32, got {partial.dtype}")
    return np.int64(stride(partial, 0)), np.int64(stride(partial, 1))


def reduce(op: str, name: str, module_of, partial, out) -> None:
    """``out[:] = partial.sum(0)`` by the ``reduce_partials`` kernel of ``module_of(TOut)``, the
    compiled module with ``REDUCE_EXPRESSIONS`` (float32 sums in a fixed order); ``name`` is
    what ``out`` holds, for the dtype error."""
    c = ctype(op, name, out)
    p, m = partial.shape
    if m == 0:
        return
    module_of(c).get_function(f"reduce_partials<{c}>")(
        (-(-m // REDUCE_THREADS),),
        (REDUCE_THREADS,),
        (
            partial,
            out,
            np.int32(p),
            np.int32(m),
            np.int64(stride(partial, 0)),
            np.int64(stride(partial, 1)),
            np.int64(stride(out)),
        ),
    )
