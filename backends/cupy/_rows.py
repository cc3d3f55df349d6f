"""Launch geometry shared by the row kernels (``rms_norm.cu``, ``layer_norm.cu``, ``softmax.cu``).

Rows of up to ``WARP_MAX_M`` elements
get a warp each (``WARP_ROWS`` rows per block), wider rows a block each;
every thread keeps ``CACHE_ELEMENTS`` elements (``SCALAR_CACHE`` on the
scalar path) of its row in registers and streams the rest. Accesses are
128-bit vectors whenever the row length, strides and addresses allow.
"""

from __future__ import annotations

import numpy as np

from ._loader import address

CACHE_ELEMENTS = 16  #: elements of a row each thread keeps in registers (vector path)
SCALAR_CACHE = 4  #: the same for the scalar path (unaligned rows), whose loads need more registers
WARP_MAX_M = 32 * CACHE_ELEMENTS  #: longest row served by the warp-per-row kernels (vector path)
WARP_ROWS = 8  #: rows (warps) per block of the warp-per-row kernels
MAX_THREADS = 1024  #: threads per block of the block-per-row forwards
BACKWARD_MAX_THREADS = 512  #: threads per block of the block-per-row backwards (they keep two rows)
DEFAULT_SHARED = 48 * 1024  #: dynamic shared memory usable without raising the kernel's limit
REDUCE_THREADS = 256  #: threads per block of the reduce_partials kernels

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
NULL = np.uint64(0)  #: a null pointer argument (CuPy passes None as 0xffffffff)


def ctype(op: str, name: str, a) -> str:
    """The CUDA C type of ``a``'s dtype; TypeError naming ``op`` and ``name`` when unsupported."""
    t = CTYPES.get(str(a.dtype))
    if t is None:
        raise TypeError(
            f"cupy {op}: {name} has dtype {a.dtype}; supported: float32, float16, bfloat16"
        )
    return t


def stride(a, axis: int = 0) -> int:
    """Elements between consecutive indices of ``a`` along ``axis``."""
    return a.strides[axis] // a.itemsize


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
    ok = m % v == 0 and all(
        address(a) % 16 == 0 and (a.shape[0] <= 1 or stride(a) % v == 0) for a in rows2d
    )
    return v if ok and all(a is None or address(a) % (v * a.itemsize) == 0 for a in vectors) else 1


def cache(v: int) -> int:
    """Vectors of ``v`` elements each thread keeps in registers."""
    return CACHE_ELEMENTS // v if v > 1 else SCALAR_CACHE


def warp_max(v: int) -> int:
    """Longest row the warp-per-row kernels serve with ``v``-element accesses."""
    return 32 * v * cache(v)


def vectors(t: str) -> list[int]:
    """The access widths compiled for element type ``t``: scalar and 16-byte."""
    return sorted({1, 16 // ITEMSIZE[t]})


def block_threads(m: int, v: int, limit: int) -> int:
    """Threads of a block-per-row kernel: enough to hold the row in registers, within [32, limit]."""
    threads = -(-m // (v * cache(v)))
    return max(32, min(limit, -(-threads // 32) * 32))


def raise_shared_limit(kernel, shared: int) -> None:
    """Let ``kernel`` use ``shared`` bytes of dynamic shared memory (beyond the default 48 KiB)."""
    if shared > DEFAULT_SHARED and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
