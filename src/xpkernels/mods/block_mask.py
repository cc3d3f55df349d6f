"""Precomputed tile states of any mask: :class:`BlockMask` and :func:`build_block_mask`.

Tiles a mask's band leaves undecided are evaluated densely; :func:`positions_of`
reads ``input_pos`` on the host.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

import array_api_compat
import numpy as np

from .bands import FULL, PARTIAL, SKIP, _n_tiles, band_states
from .interpret import Grid
from .ir import INT64_MAX, INT64_MIN, _to_host
from .library import CallShape, MaskMod, _non_negative_int, as_mask_mod
from .trace import _scalar

#: Elements of one dense mask evaluation in :func:`build_block_mask`.
_EVAL_ELEMENTS = 1 << 20


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Tile states of a mask for fixed lengths, tiles and positions; see :func:`build_block_mask`.

    Attributes
    ----------
    mask_mod : MaskMod
        Evaluated on PARTIAL tiles.
    states : numpy.ndarray
        ``(Bm, Hm, NQ, NK)`` int8 (host memory): SKIP 0, PARTIAL 1, FULL 2;
        ``Bm``/``Hm`` are 1 when the mask does not depend on ``b``/``h``.
    n_q, n_kv : int
        Query and key counts it was built for.
    tile_m, tile_n : int
        Queries and keys per tile; flex attention computes in these tiles.
    input_pos : tuple of int
        Query position offset per batch (one entry when shared).
    """

    mask_mod: MaskMod
    states: np.ndarray
    n_q: int
    n_kv: int
    tile_m: int
    tile_n: int
    input_pos: tuple[int, ...]

    def kv_tiles(self, b: int = 0, h: int = 0, q_tile: int = 0) -> list[int]:
        """Key tiles visited by query tile ``q_tile`` of batch ``b``, head ``h``."""
        s = self.states[
            b if self.states.shape[0] > 1 else 0, h if self.states.shape[1] > 1 else 0, q_tile
        ]
        return [int(j) for j in np.nonzero(s != SKIP)[0]]

    @property
    def density(self) -> float:
        """Fraction of tiles visited."""
        return float(np.mean(self.states != SKIP)) if self.states.size else 0.0

    def __repr__(self):
        return (
            f"BlockMask({self.mask_mod.label}, n_q={self.n_q}, n_kv={self.n_kv}, "
            f"tiles={self.tile_m}x{self.tile_n}, "
            f"states={tuple(self.states.shape)}, density={self.density:.3f})"
        )


def positions_of(fn: str, input_pos, n_q: int = 1) -> tuple[int, ...]:
    """``input_pos`` (an int, or a 1-D integer array / sequence) as a tuple of Python ints.

    Arrays of any namespace are copied to the host (a planning step, such as
    :func:`build_block_mask`; flex attention itself never reads device
    positions). Positions may be negative (queries before the first key);
    ``q_idx = input_pos + row`` for rows below ``n_q`` must fit int64.
    """
    kinds = "an int or a (B,) integer array"
    values: tuple[int, ...]
    if isinstance(input_pos, bool):
        raise TypeError(f"{fn}: input_pos must be {kinds}, got a bool")
    single = _scalar(input_pos)
    if isinstance(single, int):
        values = (single,)
    elif single is not None:
        raise TypeError(f"{fn}: input_pos must be {kinds}, got {input_pos!r}")
    elif isinstance(input_pos, (list, tuple)):
        if not all(isinstance(_scalar(x), int) and not isinstance(x, bool) for x in input_pos):
            raise TypeError(
                f"{fn}: input_pos must be {kinds}, got a {type(input_pos).__name__} "
                "holding other values than ints"
            )
        values = tuple(int(x) for x in input_pos)
    else:
        if not array_api_compat.is_array_api_obj(input_pos):
            raise TypeError(f"{fn}: input_pos must be {kinds}, got {type(input_pos).__name__}")
        host = _to_host(input_pos)
        if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"{fn}: input_pos must be {kinds}, got {host.dtype} {host.shape}")
        values = tuple(int(x) for x in host)
    last = builtins.max(values) + builtins.max(n_q, 1) - 1 if values else 0
    if values and (builtins.min(values) < INT64_MIN or last > INT64_MAX):
        raise ValueError(
            f"{fn}: input_pos must keep every query position input_pos + row within int64 "
            f"[{INT64_MIN}, {INT64_MAX}], got values in [{builtins.min(values)}, "
            f"{builtins.max(values)}] for {n_q} query rows"
        )
    return values


def build_block_mask(
    keep, n_q: int, n_kv: int, *, tile_m: int, tile_n: int, input_pos=0, n_batch=None, n_heads=None
) -> BlockMask:
    """Classify every (query tile, key tile) of a mask as skipped, partial or full, vectorised.

    Band masks are classified from their declared key ranges; tiles the band
    leaves undecided are evaluated densely, many tiles per array operation
    (no per-element Python loop), in the namespace of the arrays the mask
    captures (NumPy when it captures none).

    Parameters
    ----------
    keep : MaskMod or callable
        The mask mod, or a predicate ``(b, h, q_idx, kv_idx)`` traced like one.
    n_q, n_kv : int
        Query and key counts of the calls it will serve.
    tile_m, tile_n : int
        Queries and keys per tile (>= 1); the flex kernel computes in these tiles.
    input_pos : int or (B,) integer array
        Position of query row 0 (per batch), as given to flex attention.
    n_batch, n_heads : int, optional
        Batch size and query heads; required when the mask reads ``b`` /
        ``h`` (the states are then per batch / head).

    Returns
    -------
    BlockMask
    """
    fn = "build_block_mask"
    mask = as_mask_mod(keep, f"{fn}: keep")
    n_q, n_kv = _non_negative_int(fn, "n_q", n_q), _non_negative_int(fn, "n_kv", n_kv)
    for name, tile in (("tile_m", tile_m), ("tile_n", tile_n)):
        if _non_negative_int(fn, name, tile) < 1:
            raise ValueError(f"{fn}: {name} must be >= 1, got {tile}")
    positions = positions_of(fn, input_pos, n_q)
    batch = _extent(
        fn, "n_batch", n_batch, "b", mask, len(positions) if len(positions) > 1 else None
    )
    heads = _extent(fn, "n_heads", n_heads, "h", mask, None)
    if len(positions) > 1 and len(positions) != batch:
        raise ValueError(f"{fn}: input_pos has {len(positions)} entries but n_batch is {batch}")
    mask.validate(fn, CallShape(batch, heads, n_q, n_kv, positions))
    per_batch = mask.graph.uses("b") or len(positions) > 1
    per_head = mask.graph.uses("h")
    bm, hm = (batch if per_batch else 1), (heads if per_head else 1)
    states = np.empty((bm, hm, _n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n)), dtype=np.int8)
    for b in range(bm):
        position = positions[b] if len(positions) > 1 else positions[0]
        band = band_states(mask, position, n_q, n_kv, tile_m, tile_n)
        states[b] = band[None]
        undecided = np.argwhere(band == PARTIAL)
        if len(undecided):
            refined = _dense_states(mask, b, position, hm, undecided, n_q, n_kv, tile_m, tile_n)
            states[b, :, undecided[:, 0], undecided[:, 1]] = refined.T
    stored = positions if len(positions) > 1 else positions[:1]
    return BlockMask(mask, states, n_q, n_kv, tile_m, tile_n, stored)


def _extent(fn, name, value, axis_name, mask, default):
    if value is None:
        if mask.graph.uses(axis_name) and default is None:
            raise ValueError(
                f"{fn}: the mask reads {axis_name}; pass {name} (the number of {axis_name} values)"
            )
        return default or 1
    value = _non_negative_int(fn, name, value)
    if value < 1:
        raise ValueError(f"{fn}: {name} must be >= 1, got {value}")
    return value


def _dense_states(mask, b, position, heads, tiles, n_q, n_kv, tile_m, tile_n) -> np.ndarray:
    """``(heads, len(tiles))`` states of the listed tiles, evaluating the mask on every pair."""
    slots = mask.graph.slots
    xp = array_api_compat.array_namespace(*(s.array for s in slots)) if slots else np
    device = array_api_compat.device(slots[0].array) if slots else "cpu"
    bound = mask.graph.bind(xp, xp.float64, device)
    chunk = builtins.max(1, _EVAL_ELEMENTS // (heads * tile_m * tile_n))
    out = np.empty((heads, len(tiles)), dtype=np.int8)
    for c0 in range(0, len(tiles), chunk):
        part = tiles[c0 : c0 + chunk]
        rows = part[:, 0][:, None] * tile_m + np.arange(tile_m)[None, :]
        keys = part[:, 1][:, None] * tile_n + np.arange(tile_n)[None, :]
        valid = (rows < n_q)[:, :, None] & (keys < n_kv)[:, None, :]
        rows, keys = np.minimum(rows, n_q - 1), np.minimum(keys, n_kv - 1)

        def put(a, shape):
            return xp.asarray(np.reshape(a, shape), device=device)

        n = len(part)
        grid = Grid(
            {
                "b": xp.asarray(b, dtype=xp.int64, device=device),
                "h": put(np.arange(heads, dtype=np.int64), (heads, 1, 1, 1)),
                "q_row": put(rows, (1, n, tile_m, 1)),
                "q_idx": put(rows + position, (1, n, tile_m, 1)),
                "kv_idx": put(keys, (1, n, 1, tile_n)),
            },
            rank=4,
        )
        kept = xp.broadcast_to(bound.run(grid)[mask.graph.output], (heads, n, tile_m, tile_n))
        valid_x = put(valid, (1, n, tile_m, tile_n))
        some = _to_host(xp.any(xp.logical_and(kept, valid_x), axis=(2, 3)))
        every = _to_host(xp.all(xp.logical_or(kept, xp.logical_not(valid_x)), axis=(2, 3)))
        out[:, c0 : c0 + n] = np.where(every, FULL, np.where(some, PARTIAL, SKIP))
    return out
