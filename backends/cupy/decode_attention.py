r"""Split-KV decode attention in CUDA C (``decode_attention.cu``), launched through the module loader.

One query per (batch, head) against the first ``lengths[b]`` keys of a
contiguous ``(B, Hkv, Smax, D)`` cache or of a paged cache (``block_table``),
with optional ``softcap`` and sliding ``window``, as the front defines them
(:mod:`xpkernels.decode_attention`). ``decode_split`` runs a block of four
warps per (batch x split, kv head x chunk of up to ``MAX_GROUP_CHUNK`` query
heads): a key's row is spread over a warp's lanes (element ``e`` on lane
``e % 32``), so every key and value is read once, coalesced, for all the
chunk's heads; the warps' online-softmax
states merge in shared memory into the split's ``(o, m, l)``. ``decode_combine``
merges the splits with the log-sum-exp combine. Accumulation is float32;
``lengths`` and page indices are clamped in the kernel, so no device value
makes it read outside the cache.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._loader import OPTIONS, loader_for
from ._rows import CTYPES, ptr, raise_shared_limit, strides

__all__ = ["default_splits", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("decode_attention.cu")
#: Warps of a split block (``WARPS`` in the .cu).
WARPS = 4
#: Most query heads one split block serves; larger groups take several chunks.
MAX_GROUP_CHUNK = 8
#: Head dims a lane holds: ``32 * DPL`` elements of a row for DPL in this tuple.
LANE_ELEMENTS = (1, 2, 4, 8)
#: Largest head dim served (32 lanes x 8 elements).
MAX_HEAD_DIM = 32 * LANE_ELEMENTS[-1]
#: Split blocks one SM holds at once, assumed by :func:`default_splits` (128 threads each).
BLOCKS_PER_SM = 4
#: Fewest keys a default split holds.
MIN_SPLIT_KEYS = 256
#: Most splits :func:`default_splits` returns.
MAX_SPLITS = 128
#: Share of its waves' block slots a default grid must fill (more splits add combine work).
WAVE_FILL = 0.9
_INDEX_TYPES = {"int32": "int", "int64": "long long"}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _chunk(group: int) -> int:
    """Query heads per split block: the group rounded up to a power of two, at most the cap."""
    return min(_pow2(group), MAX_GROUP_CHUNK)


def _lane_elements(d: int, dv: int) -> int:
    """Elements of a row per lane covering both head dims."""
    width = max(d, dv, 1)
    return next(n for n in LANE_ELEMENTS if 32 * n >= width)


def _split_name(t: str, i: str, g: int, dpl: int) -> str:
    return f"decode_split<{t},{i},{g},{dpl}>"


def _combine_name(t: str, i: str) -> str:
    return f"decode_combine<{t},{i}>"


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    out = []
    for t in CTYPES.values():
        for i in _INDEX_TYPES.values():
            out.append(_combine_name(t, i))
            for g in (1, 2, 4, 8):
                out += [_split_name(t, i, g, dpl) for dpl in LANE_ELEMENTS]
    return out


def default_splits(batch: int, kv_heads: int, max_len: int, like) -> int:
    """Splits per cache filling whole waves of ``BLOCKS_PER_SM`` blocks per SM.

    Among the split counts allowed (at most one per ``MIN_SPLIT_KEYS`` keys
    and at most ``MAX_SPLITS``), the fewest whose grid fills its waves to at
    least ``WAVE_FILL`` (else the fullest).
    """
    slots = BLOCKS_PER_SM * loader_for(like).sm_count(like)
    blocks = max(batch * kv_heads, 1)
    cap = max(1, min(MAX_SPLITS, -(-max_len // MIN_SPLIT_KEYS)))

    def filled(s: int) -> float:
        grid = blocks * s
        return grid / (-(-grid // slots) * slots)

    full = [s for s in range(1, cap + 1) if filled(s) >= WAVE_FILL]
    return full[0] if full else max(range(1, cap + 1), key=lambda s: (filled(s), -s))


def forward(
    o,
    q,
    k,
    v,
    lengths,
    o_partial,
    m_partial,
    l_partial,
    *,
    scale,
    softcap=None,
    window=None,
    block_table=None,
) -> None:
    """Write ``o`` by ``decode_split`` then ``decode_combine``; the split scratch is overwritten.

    The contract of :class:`xpkernels.backends.protocol.DecodeAttentionModule`.
    """
    t, to = CTYPES.get(str(q.dtype)), CTYPES.get(str(o.dtype))
    if t is None or to is None or any(a.dtype != q.dtype for a in (k, v)):
        raise TypeError(
            f"cupy decode_attention: q, k and v must share one of float32, float16, bfloat16 and o "
            f"have one of them; got {q.dtype}, {k.dtype}, {v.dtype}, {o.dtype}"
        )
    index = _INDEX_TYPES.get(str(lengths.dtype))
    if index is None:
        raise TypeError(
            f"cupy decode_attention: lengths must be int32 or int64, got {lengths.dtype}"
        )
    if any(str(a.dtype) != "float32" for a in (o_partial, m_partial, l_partial)):
        raise TypeError("cupy decode_attention: the split scratch must be float32")
    batch, heads, d = q.shape
    kv_heads, dv = k.shape[1], v.shape[-1]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"cupy decode_attention: head dims up to {MAX_HEAD_DIM}, got {d}/{dv}")
    if batch == 0 or heads == 0:
        return
    if block_table is None:
        smax, page_size, num_pages = k.shape[2], max(k.shape[2], 1), batch
    else:
        page_size, num_pages = k.shape[2], k.shape[0]
        smax = block_table.shape[1] * page_size
    if smax >= 2**31:
        raise ValueError(f"cupy decode_attention: caches of up to 2**31 - 1 positions, got {smax}")
    group = heads // kv_heads
    g = _chunk(group)
    chunks = -(-group // g)
    n_splits = o_partial.shape[2]
    dpl = _lane_elements(d, dv)
    loader = loader_for(q)
    module = loader.module(
        SOURCE, [_split_name(t, index, g, dpl), _combine_name(to, index)], OPTIONS
    )
    if smax > 0:
        split = module.get_function(_split_name(t, index, g, dpl))
        shared = WARPS * g * (2 + 32 * dpl) * 4
        raise_shared_limit(split, shared)
        split(
            (batch * n_splits, kv_heads * chunks),
            (32 * WARPS,),
            (
                o_partial,
                m_partial,
                l_partial,
                q,
                k,
                v,
                lengths,
                ptr(block_table),
                np.int32(group),
                np.int32(chunks),
                np.int32(n_splits),
                np.int32(d),
                np.int32(dv),
                np.int32(smax),
                np.int32(page_size),
                np.int64(num_pages),
                np.float32(scale),
                np.float32(0.0 if softcap is None else softcap),
                np.float32(0.0 if softcap is None else 1.0 / softcap),
                np.int32(0 if window is None else min(window, smax)),
                *strides(q, (0, 1)),
                *strides(k, (0, 1, 2)),
                *strides(v, (0, 1, 2)),
                *strides(block_table, (0, 1)),  # zeros without a table
                *strides(lengths, (0,)),
                *strides(o_partial, (0, 1, 2)),
                *strides(m_partial, (0, 1, 2)),
                *strides(l_partial, (0, 1, 2)),
            ),
            shared_mem=shared,
        )
    module.get_function(_combine_name(to, index))(  # o in its own dtype
        (batch * heads,),
        (128,),
        (
            o,
            o_partial,
            m_partial,
            l_partial,
            lengths,
            np.int32(heads),
            np.int32(n_splits),
            np.int32(dv),
            np.int32(smax),
            *strides(o, (0, 1)),
            *strides(lengths, (0,)),
            *strides(o_partial, (0, 1, 2)),
            *strides(m_partial, (0, 1, 2)),
            *strides(l_partial, (0, 1, 2)),
        ),
    )
