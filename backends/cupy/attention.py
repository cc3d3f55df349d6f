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

from ._loader import OPTIONS, address, loader_for
from ._rows import CTYPES, ITEMSIZE, NULL, raise_shared_limit

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


def _strides(a, axes) -> list:
    return [np.int64(a.strides[axis] // a.itemsize) for axis in axes]


def _vector_ok(a, width: int) -> np.int32:
    """1 when every row of ``a`` (rank 4, ``width`` elements used) allows 16-byte loads."""
    v = 16 // a.itemsize
    ok = width % v == 0 and address(a) % 16 == 0
    ok = ok and all(a.shape[i] <= 1 or (a.strides[i] // a.itemsize) % v == 0 for i in range(3))
    return np.int32(1 if ok else 0)


def _index(name: str, a, batch: int):
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


def forward(o, q, k, v, m, l, *, scale, causal, input_pos, q_lengths, k_lengths) -> None:
    """Write ``o`` (and the checkpoints ``m``, ``l`` unless None) for validated inputs.

    ``o``: (B, H, Sq, Dv); ``q``: (B, H, Sq, D); ``k``: (B, Hkv, Sk, D); ``v``:
    (B, Hkv, Sk, Dv); ``m``, ``l``: (B, H, Sq) float32 or None; ``input_pos``
    an int or a (B,) integer array; ``q_lengths``/``k_lengths`` None or (B,)
    integer arrays; ``scale`` a float.
    """
    t = CTYPES.get(str(q.dtype))
    if t is None or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"cupy attention: q, k and v must share one of float32, float16, bfloat16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    o_kind = _OUT_KINDS.get(str(o.dtype))
    if o_kind is None:
        raise TypeError(f"cupy attention: o must be float32, float16 or bfloat16, got {o.dtype}")
    if (m is None) != (l is None) or any(
        a is not None and str(a.dtype) != "float32" for a in (m, l)
    ):
        raise TypeError("cupy attention: the checkpoints m and l must both be float32 or None")
    batch, heads, sq, d = q.shape
    kv_heads, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"cupy attention: head dims up to {MAX_HEAD_DIM}, got {d}/{dv}")
    q_tiles = -(-sq // BLOCK_M)
    if max(sq, sk) > _INT32_MAX or batch * heads * q_tiles > _INT32_MAX:
        raise ValueError(
            f"cupy attention: Sq, Sk and B * H * ceil(Sq / {BLOCK_M}) must stay below 2**31, "
            f"got Sq={sq}, Sk={sk}, B={batch}, H={heads}"
        )
    if batch == 0 or heads == 0 or sq == 0:
        return
    dmax = next(n for n in HEAD_DIMS if n >= max(d, dv))
    name = _kernel_name(t, dmax)
    if isinstance(input_pos, int):
        pos = _index("input_pos", None, batch)
        pos_value = np.int64(min(sk, max(-sq, input_pos)))
    else:
        pos, pos_value = _index("input_pos", input_pos, batch), np.int64(0)
    shared = shared_bytes(t, dmax)
    kernel = loader_for(q).module(SOURCE, [name], OPTIONS).get_function(name)
    raise_shared_limit(kernel, shared)
    zeros = [np.int64(0)] * 3
    kernel(
        (batch * heads * q_tiles,),
        (32 * WARPS,),
        (
            o,
            np.int32(o_kind),
            NULL if m is None else m,
            NULL if l is None else l,
            q,
            k,
            v,
            *_index("q_lengths", q_lengths, batch),
            *_index("k_lengths", k_lengths, batch),
            *pos,
            pos_value,
            np.int32(heads),
            np.int32(heads // kv_heads),
            np.int32(sq),
            np.int32(sk),
            np.int32(d),
            np.int32(dv),
            np.int32(q_tiles),
            np.int32(1 if causal else 0),
            np.float32(scale * np.log2(np.e)),
            _vector_ok(q, d),
            _vector_ok(k, d),
            _vector_ok(v, dv),
            np.uint64(shared),
            *_strides(q, (0, 1, 2)),
            *_strides(k, (0, 1, 2)),
            *_strides(v, (0, 1, 2)),
            *_strides(o, (0, 1, 2)),
            *(zeros if m is None else _strides(m, (0, 1, 2))),
            *(zeros if l is None else _strides(l, (0, 1, 2))),
        ),
        shared_mem=shared,
    )


def _check_float(name: str, a) -> np.int32:
    """The kind (0: float32, 1: float16, 2: bfloat16) of a gradient or cotangent array."""
    kind = _OUT_KINDS.get(str(a.dtype))
    if kind is None:
        raise TypeError(
            f"cupy attention backward: {name} must be float32, float16 or bfloat16, got {a.dtype}"
        )
    return np.int32(kind)


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
    """Overwrite ``dq``, ``dk``, ``dv`` in full for validated inputs (three CUDA C kernels).

    Recomputes each tile's probabilities from the checkpoints ``m``, ``l``
    (the natural-log contract, from a forward on any backend); ``delta``
    (B, H, Sq) float32 receives ``rowsum(do * o)`` (0 past ``q_lengths``).
    ``dq_accum`` is not used (None: dQ is its own pass). ``do``, ``o``,
    ``dq``, ``dk``, ``dv`` may each be float32, float16 or bfloat16. Shapes
    and options as :func:`forward`.
    """
    t = CTYPES.get(str(q.dtype))
    if t is None or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"cupy attention backward: q, k and v must share one of float32, float16, bfloat16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    kinds = {
        name: _check_float(name, a) for name, a in dict(do=do, o=o, dq=dq, dk=dk, dv=dv).items()
    }
    if any(str(a.dtype) != "float32" for a in (m, l, delta)):
        raise TypeError("cupy attention backward: m, l and delta must be float32")
    batch, heads, sq, d = q.shape
    kv_heads, sk, d_v = k.shape[1], k.shape[2], v.shape[3]
    if max(d, d_v) > MAX_HEAD_DIM:
        raise ValueError(f"cupy attention: head dims up to {MAX_HEAD_DIM}, got {d}/{d_v}")
    q_tiles, kv_tiles = -(-sq // BLOCK_M), -(-sk // BLOCK_M)
    if (
        max(sq, sk) > _INT32_MAX
        or batch * heads * max(q_tiles * BLOCK_M, sq) > _INT32_MAX
        or batch * kv_heads * kv_tiles > _INT32_MAX
    ):
        raise ValueError(
            "cupy attention backward: Sq, Sk, B * H * Sq and B * Hkv * ceil(Sk / "
            f"{BLOCK_M}) must stay below 2**31, got B={batch}, H={heads}, Hkv={kv_heads}, "
            f"Sq={sq}, Sk={sk}"
        )
    if batch == 0 or kv_heads == 0 or (sk == 0 and sq == 0):
        return
    dmax = next(n for n in HEAD_DIMS if n >= max(d, d_v))
    dkdv_name, dq_name = _backward_names(t, dmax)
    module = loader_for(q).module(SOURCE, [DELTA_KERNEL, dkdv_name, dq_name], OPTIONS)
    if isinstance(input_pos, int):
        pos = _index("input_pos", None, batch)
        pos_value = np.int64(min(sk, max(-sq, input_pos)))
    else:
        pos, pos_value = _index("input_pos", input_pos, batch), np.int64(0)
    q_len, k_len = _index("q_lengths", q_lengths, batch), _index("k_lengths", k_lengths, batch)
    bhs = (0, 1, 2)
    if sq > 0:
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
                *q_len,
                np.int32(heads),
                np.int32(sq),
                np.int32(d_v),
                np.int32(rows),
                *_strides(delta, bhs),
                *_strides(do, bhs),
                *_strides(o, bhs),
            ),
        )
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
        *k_len,
        *pos,
        pos_value,
    )
    dims = (
        np.int32(sq),
        np.int32(sk),
        np.int32(d),
        np.int32(d_v),
    )
    flags = (
        np.int32(1 if causal else 0),
        np.float32(scale),
        np.float32(scale * np.log2(np.e)),
        _vector_ok(q, d),
        _vector_ok(k, d),
        _vector_ok(v, d_v),
    )
    strides = (
        *_strides(q, bhs),
        *_strides(k, bhs),
        *_strides(v, bhs),
        *_strides(do, bhs),
        *_strides(m, bhs),
        *_strides(l, bhs),
        *_strides(delta, bhs),
    )
    if sk > 0:
        shared = backward_shared_bytes(t, dmax, "dkdv")
        kernel = module.get_function(dkdv_name)
        raise_shared_limit(kernel, shared)
        kernel(
            (batch * kv_heads * kv_tiles,),
            (32 * WARPS,),
            (
                dk,
                kinds["dk"],
                dv,
                kinds["dv"],
                *common,
                np.int32(kv_heads),
                np.int32(heads // kv_heads),
                *dims,
                np.int32(kv_tiles),
                *flags,
                np.uint64(shared),
                *strides,
                *_strides(dk, bhs),
                *_strides(dv, bhs),
            ),
            shared_mem=shared,
        )
    if sq > 0 and heads > 0:
        shared = backward_shared_bytes(t, dmax, "dq")
        kernel = module.get_function(dq_name)
        raise_shared_limit(kernel, shared)
        kernel(
            (batch * heads * q_tiles,),
            (32 * WARPS,),
            (
                dq,
                kinds["dq"],
                *common,
                np.int32(heads),
                np.int32(heads // kv_heads),
                *dims,
                np.int32(q_tiles),
                *flags,
                np.uint64(shared),
                *strides,
                *_strides(dq, bhs),
            ),
            shared_mem=shared,
        )
