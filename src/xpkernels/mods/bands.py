"""Tile skipping from the bands masks declare: tile states and tile plans.

The states SKIP / PARTIAL / FULL, :func:`band_states`, :class:`TilePlan` and
:func:`plan_tiles`.
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
    kept).
    """

    tile_m: int
    tile_n: int
    states: np.ndarray

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
    return TilePlan(tile_m, tile_n, states)
