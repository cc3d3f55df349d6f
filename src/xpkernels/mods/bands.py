"""Tile skipping from the bands masks declare: tile states and tile plans.

The states SKIP / PARTIAL / FULL, :func:`band_states`, :func:`exact_band`,
:class:`TilePlan`, :func:`plan_tiles`, and the kernels' view of a plan
shared by the GPU backends: :func:`kernel_states` (a plan's states at a
kernel's tiles) and :func:`tile_lists_of` (per row of tiles, the tiles it
visits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .library import MaskMod

#: Tile states of a :class:`BlockMask` / tile plan.
SKIP, PARTIAL, FULL = 0, 1, 2


def _n_tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def band_states(
    mask: MaskMod, position: int, n_q: int, n_kv: int, tile_m: int, tile_n: int
) -> np.ndarray:
    """``(NQ, NK)`` int8 tile states of ``mask`` from its band (queries at ``position + row``).

    SKIP: no key of the tile can be kept by any query of the tile; FULL:
    every pair is surely kept; PARTIAL otherwise. Sound for any mask (non-band
    masks give PARTIAL everywhere).
    """
    nq_tiles, nk_tiles = _n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n)
    rows = np.minimum(np.arange(nq_tiles * tile_m), n_q - 1) + position
    lo, hi, flo, fhi = (np.reshape(x, (nq_tiles, tile_m)) for x in mask._band(rows, n_kv))
    k_first = np.arange(nk_tiles) * tile_n
    k_last = np.minimum(k_first + tile_n, n_kv) - 1
    lo, hi = lo.min(axis=1)[:, None], hi.max(axis=1)[:, None]
    flo, fhi = flo.max(axis=1)[:, None], fhi.min(axis=1)[:, None]
    some = (lo <= k_last[None, :]) & (hi >= k_first[None, :]) & (lo <= hi)
    full = (flo <= k_first[None, :]) & (fhi >= k_last[None, :])
    return np.where(full, FULL, np.where(some, PARTIAL, SKIP)).astype(np.int8)


@dataclass(frozen=True)
class TilePlan:
    """Which (query tile, key tile) pairs a kernel visits, and where it must evaluate the mask.

    ``states`` is ``(Bp, Hp, NQ, NK)`` int8 with ``Bp`` in {1, B} and ``Hp``
    in {1, H}: SKIP (0), PARTIAL (1, evaluate the mask), FULL (2, every pair
    kept). ``bands``, when not None, says that the mask keeps exactly one
    interval of keys per query row, the same for every head: per entry of
    ``states``' first axis, ``(lo, hi)`` int64 ``(NQ rows,)`` arrays, every
    row keeping keys ``lo <= kv <= hi`` and no other (:func:`exact_band`). A
    kernel may use them instead of evaluating the mask; tiles stay the plan.
    """

    tile_m: int
    tile_n: int
    states: np.ndarray
    bands: tuple | None = None

    def group(self, b: int, h0: int, h1: int) -> np.ndarray:
        """``(NQ, NK)`` states for query heads ``[h0, h1)`` of batch ``b``.

        Visited if any head visits; FULL only if FULL for every head.
        """
        s = self.states[b if self.states.shape[0] > 1 else 0]
        s = s[h0:h1] if s.shape[0] > 1 else s
        visited = np.any(s != SKIP, axis=0)
        full = np.all(s == FULL, axis=0)
        return np.where(full, FULL, np.where(visited, PARTIAL, SKIP)).astype(np.int8)


def plan_tiles(mask, block_mask, *, block_sparse, n_q, n_kv, positions, tile_m, tile_n) -> TilePlan:
    """The tile plan of a flex call.

    Parameters
    ----------
    mask : MaskMod or None
        The call's mask (None: every key).
    block_mask : BlockMask or None
        Precomputed tile states (its tiles are used); None derives them
        from ``mask``'s band with tiles ``tile_m`` x ``tile_n``.
    block_sparse : bool
        False visits every tile and evaluates the mask everywhere (the dense path).
    positions : tuple of int
        ``input_pos`` per batch.
    """
    if block_mask is not None:
        tile_m, tile_n = block_mask.tile_m, block_mask.tile_n
    shape = (_n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n))
    if mask is None:
        return TilePlan(tile_m, tile_n, np.full((1, 1) + shape, FULL, dtype=np.int8))
    if not block_sparse:
        return TilePlan(tile_m, tile_n, np.full((1, 1) + shape, PARTIAL, dtype=np.int8))
    if block_mask is not None:
        return TilePlan(tile_m, tile_n, block_mask.states)
    distinct = {p: band_states(mask, p, n_q, n_kv, tile_m, tile_n) for p in set(positions)}
    states = np.stack([distinct[p] for p in positions])[:, None]
    exact = {p: exact_band(mask, p, n_q, n_kv) for p in set(positions)}
    bands = None if None in exact.values() else tuple(exact[p] for p in positions)
    return TilePlan(tile_m, tile_n, states, bands)


def exact_band(mask: MaskMod, position: int, n_q: int, n_kv: int):
    """``(lo, hi)``: int64 ``(n_q,)`` arrays such that query row ``r`` (at ``position + r``)
    keeps exactly the keys ``lo[r] <= kv <= hi[r]``, or None unless ``mask``'s band says so
    (its possible and its sure keys agree within ``[0, n_kv)``) with at least one key for
    every row."""
    if n_q == 0 or n_kv == 0:
        return None
    rows = np.arange(n_q, dtype=np.int64) + position
    lo, hi, full_lo, full_hi = (np.asarray(x, dtype=np.int64) for x in mask._band(rows, n_kv))
    lo, hi = np.maximum(lo, 0), np.minimum(hi, n_kv - 1)
    exact = (np.maximum(full_lo, 0) == lo) & (np.minimum(full_hi, n_kv - 1) == hi) & (lo <= hi)
    return (lo, hi) if bool(np.all(exact)) else None


def kernel_states(states, tile_m, tile_n, block_m, block_n, n_q, n_kv):
    """``(Bp, Hp, NQ, NK)`` states of kernel tiles ``block_m`` x ``block_n``, and whether each
    lies in one plan tile.

    ``states`` are a plan's ``(Bp, Hp, NQp, NKp)`` states at tiles ``tile_m`` x
    ``tile_n``. When the kernel's tiles divide the plan's, each takes its plan
    tile's state (exact); otherwise a kernel tile straddling plan tiles is
    SKIP or FULL only when all it covers are, else PARTIAL, and a kernel then
    reads each pair's plan state there.
    """
    nq, nk = _n_tiles(n_q, block_m), _n_tiles(n_kv, block_n)
    exact = tile_m % block_m == 0 and tile_n % block_n == 0
    if exact:
        rows = np.arange(nq) * block_m // tile_m
        cols = np.arange(nk) * block_n // tile_n
        return states[:, :, rows][:, :, :, cols], True
    low = np.full(states.shape[:2] + (nq, nk), FULL, dtype=np.int8)
    high = np.full(states.shape[:2] + (nq, nk), SKIP, dtype=np.int8)
    for i in range(nq):
        r0, r1 = i * block_m // tile_m, (min(n_q, (i + 1) * block_m) - 1) // tile_m
        band = states[:, :, r0 : r1 + 1]
        for j in range(nk):
            c0, c1 = j * block_n // tile_n, (min(n_kv, (j + 1) * block_n) - 1) // tile_n
            tile = band[:, :, :, c0 : c1 + 1]
            low[:, :, i, j] = tile.min(axis=(2, 3))
            high[:, :, i, j] = tile.max(axis=(2, 3))
    combined = np.where(high == SKIP, SKIP, np.where(low == FULL, FULL, PARTIAL))
    return combined.astype(np.int8), False


def tile_lists_of(states, axis):
    """``(count, entries)``: per row of kernel ``states`` along ``axis`` (2: rows are query
    tiles, 3: key tiles), how many tiles it visits and which, as int32 ``tile * 4 + state``
    (visited tiles first, in order; the entries past ``count`` are never read)."""
    s = states if axis == 2 else np.swapaxes(states, 2, 3)
    visited = s != SKIP
    count = visited.sum(axis=3).astype(np.int32)
    index = np.arange(s.shape[3], dtype=np.int32)
    order = np.argsort(~visited, axis=3, kind="stable").astype(np.int32)
    entries = np.take_along_axis(index[None, None, None, :] * 4 + s.astype(np.int32), order, 3)
    return np.ascontiguousarray(count), np.ascontiguousarray(entries.astype(np.int32))
