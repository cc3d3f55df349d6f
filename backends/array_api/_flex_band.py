"""FlexAttention's forward on NumPy for masks that keep one interval of keys per query row.

When the tile plan carries exact bands (:attr:`xpkernels.mods.TilePlan.bands`:
sliding-window, causal and prefix masks, document masks over contiguous host
ids, and their ``&`` / ``|`` where the band stays exact) and no score mod
runs, every row's kept keys are known without evaluating the mask. Queries
then go in chunks of ``BAND_ROWS`` rows, each against the one span of keys
its rows keep -- ``BAND_ROWS + w`` keys under a ``w``-key window, where the
plan's 256 x 256 tiles take 512 per 256 rows -- and consecutive chunks whose
spans start a constant ``step`` keys apart are taken together: their keys
and values are strided views of the head's (chunk ``c``'s span starts ``c *
step`` keys after chunk 0's), so one batched product serves them all and
NumPy's per-call cost is paid once per batch, not per chunk.

Scores are base-2 (``log2(e)`` folded into the query scale) and
exponentiated by ``exp2``, which never leaves its vector loop on them
(bounded and finite: see :mod:`._attention_numpy`); the mask then multiplies
the exponentials by 0/1, only in the span's columns that hold hidden pairs
(a window's first and last 32), from a cache per batch pattern built from
the intervals (the interior batches of a window share one). A batch whose
rows all keep their chunk's whole span (inside one document) is not masked.
The checkpoints' row max is the log of the largest kept exponential. Against
an additive 0/``-inf`` bias over the whole span and ``exp`` (which ``-inf``
does not slow): 0.91x the time on one thread (window 256 without
checkpoints 26.6 against 29.1 ms, 4 documents 90.9 against 97.6; medians of
9, interleaved).

Only a kv head whose values are all finite and whose scores are all within
``SAFE_EXPONENT`` (Cauchy-Schwarz on the largest query and key norms) takes
this path; its scores are then exponentiated unshifted, and every row keeps
at least one key (the plan's bands promise it), so no row is empty.
:func:`band_batches` says whether a call's band is narrow enough to pay.

Measured at 1x8x2048x64 float32, 256-key window, 1 thread (line profile):
the keys' span is copied transposed, ``(d, keys)`` rows, before the score
product (6.9 + 1.7 ms of copying against 12.5 ms for the product with the
strided keys as its transposed operand); 32-row chunks beat 64 and 128 and
batches of 2**18 scores beat 2**16 and 2**17 (fewer NumPy calls). Scores
laid out ``(keys, rows)`` made the product cheaper still but the row max
3.3x slower (272 against 82 us a batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
from numpy.lib.stride_tricks import as_strided

from ._blocks import LOG2E, to

__all__ = [
    "BAND_ELEMENTS",
    "BAND_ROWS",
    "Batch",
    "BandWorkspace",
    "band_batches",
    "forward_batch",
    "tile_elements",
]

#: Query rows per chunk: its span is ``BAND_ROWS`` keys wider than a row's band.
BAND_ROWS = 32

#: Scores a run of chunks may compute beyond those of the chunks' own spans (about what a
#: batch's NumPy calls cost: a 256-key window's first 8 chunks make one batch).
BAND_WASTE = 1 << 15

#: The band runs where it computes at most this fraction of the tiles' scores: at equal
#: scores the two ran level (causal, 1900 rows: 49.7 against 49.9 ms), at 0.86 of them the
#: band took 0.89 of the time (4 documents, 1x8x4096x128: 273 against 305 ms).
BAND_GAIN = 0.9

#: Score elements of one batch of chunks (float32: 1 MiB), as the tiles' ``TILE_ELEMENTS``.
BAND_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class Batch:
    """``count`` chunks of ``rows`` query rows from row ``r0``; chunk ``c`` takes keys
    ``[key0 + c * step, key0 + c * step + keys)``."""

    r0: int
    count: int
    rows: int
    key0: int
    step: int
    keys: int


def band_batches(lo, hi, n_kv: int, group: int, tile_elements: int) -> list[Batch] | None:
    """The batches covering every query row of one band, or None when the plan's tiles do less.

    ``lo``, ``hi``: the band (``(n_q,)`` int64, every row keeping keys
    ``lo <= kv <= hi``); ``group`` query heads share each kv head;
    ``tile_elements``: the score elements the plan's tiles would compute.
    A chunk's own span runs from its rows' first kept key to their last; a
    run of consecutive chunks whose spans start a constant step apart takes
    its longest span for every chunk while that computes at most
    ``BAND_WASTE`` more scores than their own spans (a window's first
    chunks, each a little longer than the one before, make one batch, not
    one each). The band pays when its batches compute at most ``BAND_GAIN`` of
    the tiles' scores, and no chunk's span is too wide for ``BAND_ELEMENTS``.
    """
    n_q = lo.shape[0]
    starts = numpy.arange(0, n_q, BAND_ROWS)
    lowest = numpy.minimum.reduceat(lo, starts)
    lengths = (numpy.maximum.reduceat(hi, starts) + 1 - lowest).tolist()
    first = lowest.tolist()
    sizes = (numpy.minimum(starts + BAND_ROWS, n_q) - starts).tolist()
    if group * BAND_ROWS * max(lengths) > BAND_ELEMENTS:
        return None
    runs, c = [], 0
    while c < len(first):  # (first chunk, chunks, step, keys)
        count, step, keys, own = 1, 0, lengths[c], lengths[c]
        while c + count < len(first) and sizes[c + count] == sizes[c]:
            d = c + count
            gap, wider = first[d] - first[d - 1], max(keys, lengths[d])
            if gap < 0 or (count > 1 and gap != step) or first[d] + wider > n_kv:
                break
            if sizes[c] * ((count + 1) * wider - own - lengths[d]) > BAND_WASTE:
                break
            count, step, keys, own = count + 1, gap, wider, own + lengths[d]
        runs.append((c, count, step, keys))
        c += count
    if (
        group * sum(count * sizes[c] * keys for c, count, _, keys in runs)
        > BAND_GAIN * tile_elements
    ):
        return None
    batches = []
    for c, count, step, keys in runs:  # each run in batches of even size
        pieces = -(-count // (BAND_ELEMENTS // (group * sizes[c] * keys)))
        for piece in range(pieces):
            a, z = c + count * piece // pieces, c + count * (piece + 1) // pieces
            batches.append(Batch(int(starts[a]), z - a, sizes[a], first[a], step, keys))
    return batches


def tile_elements(states, tile_m: int, tile_n: int, n_q: int, n_kv: int, group: int) -> int:
    """Score elements the plan's visited tiles ``states`` (``(NQ, NK)``) hold for one kv head."""
    rows = numpy.minimum(tile_m, n_q - numpy.arange(states.shape[0]) * tile_m)
    keys = numpy.minimum(tile_n, n_kv - numpy.arange(states.shape[1]) * tile_n)
    return group * int(rows @ (states != 0).astype(numpy.int64) @ keys)


class BandWorkspace:
    """One worker's score buffer and its cache of masks per batch pattern (at most
    ``BAND_ELEMENTS`` cached elements)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.scores = numpy.empty((BAND_ELEMENTS,), dtype=dtype)
        self.masks: dict = {}
        self.cached = 0

    def batch_mask(self, lo, hi, batch: Batch):
        """``(mask, a, z)``: 1 where key ``j`` of chunk ``c``'s span lies in ``[lo[c, r],
        hi[c, r]]``, else 0, broadcastable to ``(count, group, rows, keys)``, every key of span
        columns ``[a, z)`` kept; or None when every row keeps its chunk's whole span (a
        document's inner chunks). ``lo``, ``hi``: the band's rows of the batch, ``(count,
        rows)`` span-relative."""
        key = (lo.tobytes(), hi.tobytes(), lo.shape, batch.keys)
        if key in self.masks:
            return self.masks[key]
        a, z = int(numpy.max(lo)), int(numpy.min(hi)) + 1
        masked = None
        if a > 0 or z < batch.keys:
            if bool(numpy.all(lo == lo[0])) and bool(numpy.all(hi == hi[0])):
                lo, hi = lo[:1], hi[:1]  # one mask for every chunk
            columns = numpy.arange(batch.keys)
            kept = (columns >= lo[:, :, None]) & (columns <= hi[:, :, None])
            mask = kept.astype(self.dtype)[:, None]
            masked = (mask, a, z) if a < z else (mask, batch.keys, batch.keys)
            if self.cached + mask.size > BAND_ELEMENTS:
                self.masks, self.cached = {}, 0
            self.cached += mask.size
        self.masks[key] = masked
        return masked


def _strided(a, batch: Batch, axis: int):
    """Chunk ``c``'s span of the keys of ``a`` (a view, not a copy): ``(count, keys, d)`` for
    keys along ``axis`` 0 of ``a``, ``(count, d, keys)`` along ``axis`` 1."""
    strides = (batch.step * a.strides[axis],) + a.strides
    shape = (batch.count,) + tuple(batch.keys if i == axis else n for i, n in enumerate(a.shape))
    return as_strided(a, shape, strides, writeable=False)


def _rows_of(a, group: int, batch: Batch):
    """``(count, group, rows, ...)`` chunk-major as ``(group, count * rows, ...)`` head-major."""
    tail = a.shape[3:]
    return a.swapaxes(0, 1).reshape((group, batch.count * batch.rows) + tail)


def forward_batch(t, o, q, k, v, m, l, b, g, heads, batch: Batch, band, workspace) -> None:
    """Rows of ``batch`` for the query heads of kv head ``g`` of batch ``b``: ``o`` and, unless
    ``m`` is None, the checkpoints. ``band``: the call's ``(lo, hi)`` for batch ``b``; the caller
    checked that the head's values are finite and its scores bounded."""
    acc, group, d = t.acc, t.group, t.d
    count, rows, keys = batch.count, batch.rows, batch.keys
    r0, r1 = batch.r0, batch.r0 + count * rows
    first = batch.key0 + batch.step * numpy.arange(count)[:, None]
    lo, hi = (x[r0:r1].reshape(count, rows) - first for x in band)
    masked = workspace.batch_mask(lo, hi, batch)
    queries = numpy.empty((count, group, rows, d), dtype=acc)
    mine = q[b, heads, r0:r1, :].reshape(group, count, rows, d).swapaxes(0, 1)
    numpy.multiply(mine, t.scale * LOG2E, out=queries, dtype=acc)  # base-2 scores
    end = batch.key0 + (count - 1) * batch.step + keys
    keys_t = numpy.empty((d, end - batch.key0), dtype=acc)  # rows of dimensions: module notes
    numpy.copyto(keys_t, k[b, g, batch.key0 : end, :].T)
    values = to(numpy, v[b, g, batch.key0 : end, :], acc)
    s = workspace.scores[: count * group * rows * keys].reshape(count, group * rows, keys)
    if batch.step == 0:  # one span for every chunk: one product over all their rows
        numpy.matmul(queries.reshape(-1, d), keys_t, out=s.reshape(-1, keys))
    else:
        numpy.matmul(queries.reshape(count, group * rows, d), _strided(keys_t, batch, 1), out=s)
    numpy.exp2(s, out=s)
    if masked is not None:  # hidden pairs to 0, in the columns that hold some
        mask, a, z = masked
        p = s.reshape(count, group, rows, keys)
        for columns in (slice(0, a), slice(z, keys)):
            if columns.start < columns.stop:
                numpy.multiply(p[..., columns], mask[..., columns], out=p[..., columns])
    sums = numpy.matmul(s, t.ones[:keys])
    top = None if m is None else numpy.max(s, axis=2)
    if batch.step == 0:
        out = numpy.matmul(s.reshape(-1, keys), values).reshape(count, group * rows, -1)
    else:
        out = numpy.matmul(s, _strided(values, batch, 0))
    out /= sums[:, :, None]
    shape = (count, group, rows)
    o[b, heads, r0:r1, :] = to(numpy, _rows_of(out.reshape(shape + (t.dv,)), group, batch), o.dtype)
    if top is not None:  # the largest kept 2**s = e**s: the row max is its natural log
        sums /= top
        numpy.log(top, out=top)
        m[b, heads, r0:r1] = to(numpy, _rows_of(top.reshape(shape), group, batch), m.dtype)
        l[b, heads, r0:r1] = to(numpy, _rows_of(sums.reshape(shape), group, batch), l.dtype)
