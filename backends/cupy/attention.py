r"""Attention forward and backward in CUDA C (``attention.cu``), launched through the module loader.

``attention_forward<T, BN, DMAX>`` is an FA2-style forward: a block of
``WARPS`` warps per (query tile of ``BM`` rows, batch, query head) walks the
key tiles of ``BN`` keys it can see, with the online softmax in base 2 and a
float32 output accumulator in shared memory (see the ``.cu`` for the steps).
float16 and bfloat16 run their two products on tensor cores through
``nvcuda::wmma`` (16x16x16, float32 accumulate); float32 runs them as a
SIMT loop in float32 FMAs (TF32 would not keep float32's accuracy). The head
dims D and Dv are padded with zeros to ``DMAX``, the smallest of
:data:`HEAD_DIMS` holding both, so the largest served is :data:`MAX_HEAD_DIM`
(routing sends larger ones to array_api).

Every option of the array_api backend: GQA (query head ``h`` reads kv head
``h // (H // Hkv)``, K and V never repeated), ``causal`` with ``input_pos``
(an int or a ``(B,)`` int32/int64 array), ``q_lengths``/``k_lengths``
(int32/int64), any ``scale``, BSHD and other strided views (every stride is
passed, offsets are int64), ``o`` in float32, float16 or bfloat16 whatever
the inputs' dtype, and the checkpoints ``m``, ``l`` in the backend-neutral
natural-log contract (``-inf`` and 0 on fully masked rows), so a backward on
another backend consumes them. Lengths and positions are clamped in the
kernel; no device value is read on the host.

The backward (:func:`backward`) recomputes the probabilities from those
checkpoints (written by a forward on any backend) in three kernels: a delta
kernel (``rowsum(do * o)`` into the caller's float32 scratch), one
``attention_backward_dkdv<T, BQ, DMAX>`` block per (batch, kv head, tile of
``BM`` keys) walking the query tiles of every head of the GQA group in the
transposed form (dk and dv are written once, no atomics), and one
``attention_backward_dq<T, BN, DMAX>`` block per query tile as the forward (a
separate deterministic pass: no ``dq_accum`` scratch). The same options, the
same wmma/SIMT split; fully masked rows and keys past ``k_lengths`` get zero
gradients, and ``do``, ``o``, ``dq``, ``dk``, ``dv`` may each be float32,
float16 or bfloat16. The same launchers run on a GPU (CuPy arrays,
``cupy.RawModule``) and on the CPU harness (NumPy arrays inside
``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, address, loader_for
from ._rows import CTYPES, ITEMSIZE, NULL, ptr, raise_shared_limit

__all__ = ["backward", "backward_shared_bytes", "forward", "name_expressions", "shared_bytes"]

SOURCE = Path(__file__).with_name("attention.cu")
#: Warps of a block (``WARPS`` in the .cu); each owns 16 query rows.
WARPS = 4
#: Query rows of a block's tile.
BLOCK_M = 16 * WARPS
#: Keys per tile by input type: tensor-core tiles for 16-bit inputs, smaller SIMT tiles for float.
BLOCK_N = {"float": 32, "__half": 64, "__nv_bfloat16": 64}
#: Padded head dims compiled (``DMAX``): D and Dv are padded to the smallest holding both.
HEAD_DIMS = (32, 64, 128)
#: Largest head dim (D and Dv) served.
MAX_HEAD_DIM = HEAD_DIMS[-1]
_OUT_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}
_INDEX_WIDTHS = {"int32": 4, "int64": 8}
_INT32_MAX = 2**31 - 1
#: Query rows per tile of the dK/dV kernel's walk by input type (smaller for float: shared memory).
BLOCK_Q = {"float": 16, "__half": 32, "__nv_bfloat16": 32}
#: Query rows of the delta kernel's block (one warp per row).
DELTA_ROWS = 4
DELTA_KERNEL = f"attention_backward_delta<{DELTA_ROWS}>"


def _kernel_name(t: str, dmax: int) -> str:
    return f"attention_forward<{t},{BLOCK_N[t]},{dmax}>"


def _backward_names(t: str, dmax: int) -> tuple[str, str]:
    """The dK/dV and dQ kernels of the backward for input type ``t`` and padded head dim ``dmax``."""
    return (
        f"attention_backward_dkdv<{t},{BLOCK_Q[t]},{dmax}>",
        f"attention_backward_dq<{t},{BLOCK_N[t]},{dmax}>",
    )


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    names = [_kernel_name(t, dmax) for t in CTYPES.values() for dmax in HEAD_DIMS]
    names += [n for t in CTYPES.values() for dmax in HEAD_DIMS for n in _backward_names(t, dmax)]
    return [*names, DELTA_KERNEL]


def _round32(n: int) -> int:
    return -(-n // 32) * 32


def shared_bytes(t: str, dmax: int) -> int:
    """Dynamic shared memory of one block (``Layout<T, BN, DMAX>::BYTES`` in the .cu)."""
    size, bn = ITEMSIZE[t], BLOCK_N[t]
    pad = 16 // size
    ld_t, ld_s, ld_p, ld_o = dmax + pad, bn + 4, bn + pad, dmax + 4
    regions = (
        size * BLOCK_M * ld_t,  # Q
        size * bn * ld_t,  # K
        size * bn * ld_t,  # V
        4 * BLOCK_M * ld_s,  # scores
        size * BLOCK_M * ld_p,  # probabilities
        4 * BLOCK_M * ld_o,  # output accumulator
        4 * dmax,  # first non-finite key of each V column
    )
    return sum(_round32(n) for n in regions) + 32


def backward_shared_bytes(t: str, dmax: int, kernel: str) -> int:
    """Dynamic shared memory of a ``"dkdv"`` or ``"dq"`` block (``BackwardLayout::BYTES``)."""
    size = ITEMSIZE[t]
    # dK/dV: two accumulators and three values per walked query (key limit, lse2, delta).
    walked, accumulators, row_values = (
        (BLOCK_Q[t], 2, 3) if kernel == "dkdv" else (BLOCK_N[t], 1, 0)
    )
    pad = 16 // size
    ld_t, ld_s, ld_p, ld_o = dmax + pad, walked + 4, walked + pad, dmax + 4
    regions = [
        size * BLOCK_M * ld_t,  # K or Q
        size * BLOCK_M * ld_t,  # V or dO
        size * walked * ld_t,  # Q or K
        size * walked * ld_t,  # dO or V
        4 * BLOCK_M * ld_s,  # scores
        4 * BLOCK_M * ld_s,  # dP
    ]
    if size != 4:  # P and dS (dQ: dS); float computes them in place of the scores and dP
        regions += [size * BLOCK_M * ld_p] * (2 if kernel == "dkdv" else 1)
    regions += [4 * accumulators * BLOCK_M * ld_o, 4 * row_values * walked]
    return sum(_round32(n) for n in regions) + 32


def strides(*arrays) -> list:
    """Element strides (int64) of the first three axes of each array (zeros for None)."""
    return [s for a in arrays for s in _rows.strides(a, range(3))]


def _vector_ok(a, width: int) -> np.int32:
    """1 when every row of ``a`` (rank 4, ``width`` elements used) allows 16-byte loads."""
    v = 16 // a.itemsize
    ok = width % v == 0 and address(a) % 16 == 0 and _rows.aligned(a, range(3), v)
    return np.int32(1 if ok else 0)


def sizes(q, k, v) -> tuple:
    """``(H / Hkv, Sq, Sk, D, Dv)`` as the kernels take them (int32)."""
    return tuple(
        np.int32(n)
        for n in (q.shape[1] // k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    )


def vector_flags(*arrays) -> list:
    """The kernels' 16-byte load flags of each (B, H, S, D) array, over its whole head dim."""
    return [_vector_ok(a, a.shape[3]) for a in arrays]


def index(name: str, a, batch: int):
    """``(pointer, stride, width)`` of an optional ``(B,)`` int32/int64 array (width 0: absent)."""
    if a is None:
        return NULL, np.int64(0), np.int32(0)
    width = _INDEX_WIDTHS.get(str(a.dtype))
    if width is None or a.shape != (batch,):
        raise TypeError(
            f"cupy attention: {name} must be a ({batch},) int32 or int64 array, "
            f"got {a.dtype} {tuple(a.shape)}"
        )
    return a, np.int64(a.strides[0] // a.itemsize), np.int32(width)


def input_type(what: str, q, k, v) -> str:
    """The CUDA C type of ``q``, ``k`` and ``v``; TypeError unless they share a supported dtype."""
    t = CTYPES.get(str(q.dtype))
    if t is None or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"cupy {what}: q, k and v must share one of float32, float16, bfloat16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    return t


def float_kind(what: str, name: str, a) -> np.int32:
    """The kind (0: float32, 1: float16, 2: bfloat16) of an output, gradient or cotangent."""
    kind = _OUT_KINDS.get(str(a.dtype))
    if kind is None:
        raise TypeError(f"cupy {what}: {name} must be float32, float16 or bfloat16, got {a.dtype}")
    return np.int32(kind)


def padded_head_dim(what: str, q, v) -> int:
    """``DMAX`` of q's and v's head dims: the smallest of :data:`HEAD_DIMS` holding both."""
    d, dv = q.shape[3], v.shape[3]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"cupy {what}: head dims up to {MAX_HEAD_DIM}, got {d}/{dv}")
    return next(n for n in HEAD_DIMS if n >= max(d, dv))


def check_backward_sizes(what: str, q, k) -> None:
    """ValueError unless the backward's indices (and grids) stay below 2**31."""
    batch, heads, sq, _ = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    if (
        max(sq, sk) > _INT32_MAX
        or batch * heads * max(-(-sq // BLOCK_M) * BLOCK_M, sq) > _INT32_MAX
        or batch * kv_heads * -(-sk // BLOCK_M) > _INT32_MAX
    ):
        raise ValueError(
            f"cupy {what}: Sq, Sk, B * H * Sq and B * Hkv * ceil(Sk / {BLOCK_M}) must stay "
            f"below 2**31, got B={batch}, H={heads}, Hkv={kv_heads}, Sq={sq}, Sk={sk}"
        )


def backward_kinds(what: str, do, o, dq, dk, dv, m, l, delta) -> dict:
    """The kinds of ``do``, ``o``, ``dq``, ``dk``, ``dv``; TypeError unless m, l, delta are float32."""
    if any(str(a.dtype) != "float32" for a in (m, l, delta)):
        raise TypeError(f"cupy {what}: m, l and delta must be float32")
    return {
        name: float_kind(what, name, a) for name, a in dict(do=do, o=o, dq=dq, dk=dk, dv=dv).items()
    }


def launch(module, name: str, grid: int, shared: int, args) -> None:
    """Run kernel ``name`` of ``module``: ``grid`` blocks of ``WARPS`` warps, ``shared`` bytes."""
    kernel = module.get_function(name)
    raise_shared_limit(kernel, shared)
    kernel((grid,), (32 * WARPS,), tuple(args), shared_mem=shared)


def launch_delta(module, delta, do, o, kinds, q_lengths) -> None:
    """``delta = rowsum(do * o)`` of every (B, H, Sq) row (0 past ``q_lengths``, an
    :func:`index` triple): the backward's first kernel, from ``module`` (of :data:`SOURCE`)."""
    batch, heads, sq = delta.shape
    rows = batch * heads * sq
    module.get_function(DELTA_KERNEL)(
        (-(-rows // DELTA_ROWS),),
        (32 * DELTA_ROWS,),
        (
            delta,
            do,
            kinds["do"],
            o,
            kinds["o"],
            *q_lengths,
            np.int32(heads),
            np.int32(sq),
            np.int32(do.shape[3]),
            np.int32(rows),
            *strides(delta, do, o),
        ),
    )


def _positions(input_pos, batch: int, sq: int, sk: int) -> tuple:
    """``(pointer, stride, width, value)`` of ``input_pos`` (an int: clamped to [-Sq, Sk])."""
    if isinstance(input_pos, int):
        return (*index("input_pos", None, batch), np.int64(min(sk, max(-sq, input_pos))))
    return (*index("input_pos", input_pos, batch), np.int64(0))


def forward(o, q, k, v, m, l, *, scale, causal, input_pos, q_lengths, k_lengths) -> None:
    """Write ``o`` (and the checkpoints ``m``, ``l`` unless None) by ``attention_forward``.

    ``scale`` is a float. Parameters: the ``attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    t = input_type("attention", q, k, v)
    o_kind = float_kind("attention", "o", o)
    if (m is None) != (l is None) or any(
        a is not None and str(a.dtype) != "float32" for a in (m, l)
    ):
        raise TypeError("cupy attention: the checkpoints m and l must both be float32 or None")
    dmax = padded_head_dim("attention", q, v)
    (batch, heads, sq, _), sk = q.shape, k.shape[2]
    q_tiles = -(-sq // BLOCK_M)
    if max(sq, sk) > _INT32_MAX or batch * heads * q_tiles > _INT32_MAX:
        raise ValueError(
            f"cupy attention: Sq, Sk and B * H * ceil(Sq / {BLOCK_M}) must stay below 2**31, "
            f"got Sq={sq}, Sk={sk}, B={batch}, H={heads}"
        )
    if batch == 0 or heads == 0 or sq == 0:
        return
    name = _kernel_name(t, dmax)
    shared = shared_bytes(t, dmax)
    launch(
        loader_for(q).module(SOURCE, [name], OPTIONS),
        name,
        batch * heads * q_tiles,
        shared,
        (
            o,
            o_kind,
            ptr(m),
            ptr(l),
            q,
            k,
            v,
            *index("q_lengths", q_lengths, batch),
            *index("k_lengths", k_lengths, batch),
            *_positions(input_pos, batch, sq, sk),
            np.int32(heads),
            *sizes(q, k, v),
            np.int32(q_tiles),
            np.int32(1 if causal else 0),
            np.float32(scale * np.log2(np.e)),
            *vector_flags(q, k, v),
            np.uint64(shared),
            *strides(q, k, v, o, m, l),
        ),
    )


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
    """Overwrite ``dq``, ``dk``, ``dv`` in full (three CUDA C kernels).

    Recomputes each tile's probabilities from the checkpoints ``m``, ``l``
    (the natural-log contract, from a forward on any backend); ``delta``
    receives ``rowsum(do * o)`` (0 past ``q_lengths``). ``dq_accum`` is not
    used (None: dQ is its own pass). ``do``, ``o``, ``dq``, ``dk``, ``dv`` may
    each be float32, float16 or bfloat16. Parameters: the ``attention``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    what = "attention backward"
    t = input_type(what, q, k, v)
    kinds = backward_kinds(what, do, o, dq, dk, dv, m, l, delta)
    dmax = padded_head_dim(what, q, v)
    check_backward_sizes(what, q, k)
    (batch, heads, sq, _), (_, kv_heads, sk, _) = q.shape, k.shape
    if batch == 0 or kv_heads == 0 or (sk == 0 and sq == 0):
        return
    dkdv_name, dq_name = _backward_names(t, dmax)
    module = loader_for(q).module(SOURCE, [DELTA_KERNEL, dkdv_name, dq_name], OPTIONS)
    q_len = index("q_lengths", q_lengths, batch)
    if sq > 0:
        launch_delta(module, delta, do, o, kinds, q_len)
    common = (
        q,
        k,
        v,
        do,
        kinds["do"],
        m,
        l,
        delta,
        *q_len,
        *index("k_lengths", k_lengths, batch),
        *_positions(input_pos, batch, sq, sk),
    )
    dims = sizes(q, k, v)
    flags = (
        np.int32(1 if causal else 0),
        np.float32(scale),
        np.float32(scale * np.log2(np.e)),
        *vector_flags(q, k, v),
    )
    if sk > 0:
        kv_tiles, shared = -(-sk // BLOCK_M), backward_shared_bytes(t, dmax, "dkdv")
        args = (dk, kinds["dk"], dv, kinds["dv"], *common, np.int32(kv_heads), *dims)
        args += (np.int32(kv_tiles), *flags, np.uint64(shared))
        args += (*strides(q, k, v, do, m, l, delta, dk, dv),)
        launch(module, dkdv_name, batch * kv_heads * kv_tiles, shared, args)
    if sq > 0 and heads > 0:
        q_tiles, shared = -(-sq // BLOCK_M), backward_shared_bytes(t, dmax, "dq")
        args = (dq, kinds["dq"], *common, np.int32(heads), *dims, np.int32(q_tiles), *flags)
        args += (np.uint64(shared), *strides(q, k, v, do, m, l, delta, dq))
        launch(module, dq_name, batch * heads * q_tiles, shared, args)
