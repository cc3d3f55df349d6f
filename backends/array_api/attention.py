"""Attention on the Array API: flash-style tiles, online softmax, float32/float64 accumulation.

Work runs per (batch, kv head): the query heads of that kv head's group are
stacked as the rows of one matrix, so K and V are read once per group and never
repeated. A query tile (its rows for every head of the group) meets the key
tiles it can see; the scores of one query tile x key tile pair are the largest
temporaries, ``rows * keys <= TILE_ELEMENTS``, so extra memory is bounded by
that budget whatever Sq and Sk are. Products of tiles go through ``matmul``
(BLAS on NumPy and PyTorch). float16/bfloat16 tiles are converted to float32.

Element-wise passes over a score tile are what NumPy pays for, so there are
few: the forward takes the row max and the exponential, and gets row sums from
a matrix-vector product. It exponentiates unshifted scores while every running
row max lies within ``+-SAFE_EXPONENT`` (no overflow or underflow is possible
there) and shifts by the running max otherwise; the checkpoint ``l`` is
rescaled to the true max at the end. Without checkpoints (inference) the row
max is skipped altogether when ``|q_i| |k_j| <= SAFE_EXPONENT`` bounds every
score of a query tile (Cauchy-Schwarz on the largest query and key norms). The backward folds ``-lse`` into the
score product and ``-delta`` into the ``do @ v^T`` product by appending one
column to each operand, leaving the exponential and one product as its passes.

On NumPy arrays, NumPy-only measures apply, each measured (the code stays
Array API for other namespaces): the work items -- (batch, kv head, query
tile) in the forward, (batch, kv head) in the backward, whose dq sums then
never meet -- are shared among the worker threads of :mod:`._blocks` while
NumPy's OpenBLAS runs one thread per product (:func:`._blocks.blas_threads`);
score tiles are written by ``matmul(out=)`` into per-worker buffers and
exponentiated in place, so no tile is allocated per step; and the forward
holds its scores transposed, ``(keys, rows)``, for a row max along the
leading axis. On 2 busy cores, BLAS's own two threads made one forward take
anywhere from 0.4 s to 5 s (waiting on each other whenever another process
held a core); one BLAS thread per worker keeps a preempted worker's delay to
its own share.

Where every value is finite and every score provably bounded, NumPy arrays
take the tiles of :mod:`._attention_numpy` instead (``exp2`` of base-2
scores, per-worker workspaces, a chunked causal diagonal; measured there).

PyTorch CPU tensors (float32/float64, none recording autograd: the
:mod:`xpkernels.torch` ops call the kernels below autograd) run the NumPy
path through zero-copy views (:func:`._blocks.numpy_views`).

Masking never materialises a full mask: key lengths and causal limits shrink
the range of key tiles, query lengths shrink the range of query tiles, and only
the keys past a query tile's first position are masked, with a tile-sized
visibility mask selecting ``-inf`` (never added: a NaN score must not reach a
row that cannot see it). Queries past ``q_lengths[b]``, causal queries before
the first key (``input_pos + i < 0``) and every query of a batch with
``k_lengths[b] == 0`` are fully masked: they are written directly (o = 0,
m = -inf, l = 0, dq = 0). Every other row sees key 0, so its running max is
finite (or NaN) from the first key tile on and no -inf - -inf ever occurs.

Non-finite inputs reach exactly the rows that see them. In masked tiles the
products whose left operand is zero on masked pairs (``p @ v``, ``ds @ k``,
``p^T @ do``, ``ds^T @ q``) would turn a non-finite right operand into NaN for
rows that cannot see it (``0 * NaN``); when a masked tile's right operand holds
one, it is multiplied with its non-finite entries zeroed and the results that
see such an entry are set to NaN (:func:`_visible_product`). Lengths and
positions are read per batch as Python ints and clamped to the range where
they change the result (lengths to ``[0, S]``, positions to ``[-Sq, Sk]``).
"""

from __future__ import annotations

import math

import array_api_compat

from . import _attention_numpy as numpy_tiles
from ._blocks import (
    SAFE_EXPONENT,
    acc_dtype,
    for_each_item,
    max_row_norm,
    path_arrays,
    row_blocks,
    spans,
    tile_workers,
    to,
)

__all__ = ["SAFE_EXPONENT", "backward", "backward_calls", "forward", "forward_calls"]

#: Score elements of one query tile x key tile pair (float32: 1 MiB), but for
#: the forward on NumPy arrays (``NUMPY_TILE_ELEMENTS``). Each call holds a
#: handful of temporaries this size per worker, whatever Sq and Sk are
#: (2**18 was faster than 2**17 and 2**19 at 1x8x2048x64 float32, measured).
TILE_ELEMENTS = 1 << 18

#: Keys per tile; a query tile holds ``TILE_ELEMENTS // KEY_TILE`` rows.
KEY_TILE = 512

#: The forward's tile budget and keys per tile on NumPy arrays (float32: 2 MiB
#: per worker). Its tiles (:mod:`._attention_numpy`) cost a few NumPy calls
#: per key tile, each a point where two workers meet at the GIL: at
#: 1x8x2048x64 float32 on 2 cores, 1024 keys x 512 rows took 0.88x the time
#: of 512 x 512 (58.6 against 66.4 ms, causal 42.7 against 48.2, medians of 17
#: interleaved; 1x8x4096x128 0.97x), where 512 keys x 1024 rows and 1024 x
#: 256 gained nothing.
NUMPY_TILE_ELEMENTS = 1 << 19
NUMPY_KEY_TILE = 1024

#: Most queries of one causal query tile (see :func:`_tile_sizes`; with the
#: NumPy tiles' chunked diagonal 512 was 4-7% faster than 256, measured).
CAUSAL_QUERY_TILE = 512


def per_batch(value, batch: int, default: int, low: int, high: int) -> list[int]:
    """``value`` (None, an int or a ``(batch,)`` integer array) as one Python int per batch, clamped to ``[low, high]``."""
    if value is None:
        return [default] * batch
    if isinstance(value, int):
        return [min(high, max(low, value))] * batch
    return [min(high, max(low, int(value[b]))) for b in range(batch)]


def _tile_sizes(
    keys: int, group: int, d: int, dv: int, causal: bool, numpy: bool = False
) -> tuple[int, int]:
    """(key tile, query tile) sizes keeping every temporary within the tile budget
    (``NUMPY_TILE_ELEMENTS`` and ``NUMPY_KEY_TILE`` for the forward on NumPy arrays).

    Causal query tiles hold at most ``CAUSAL_QUERY_TILE`` queries: the keys
    a tile's first query cannot see are computed and masked, about half a
    query tile squared per tile.
    """
    elements, most_keys = (
        (NUMPY_TILE_ELEMENTS, NUMPY_KEY_TILE) if numpy else (TILE_ELEMENTS, KEY_TILE)
    )
    key_tile = max(1, min(most_keys, keys))
    rows = max(1, elements // max(key_tile, d + 1, dv + 1) // group)
    return key_tile, min(rows, CAUSAL_QUERY_TILE) if causal else rows


def _causal_visible(xp, q_first: int, q_end: int, k_first: int, k_end: int, device):
    """``(queries, keys)`` bool: key ``k_first + c`` is visible to the query at position ``q_first + r``."""
    q_pos = xp.arange(q_first, q_end, device=device)[:, None]
    k_pos = xp.arange(k_first, k_end, device=device)[None, :]
    return k_pos <= q_pos


def _where_visible(xp, s, visible, fill):
    """``s`` (group x queries, keys) with every pair not ``visible`` (queries, keys) set to ``fill``."""
    group = s.shape[0] // visible.shape[0]
    stacked = xp.reshape(s, (group, *visible.shape))
    return xp.reshape(xp.where(visible, stacked, fill), tuple(s.shape))


def _visible_product(xp, a, b, visible, *, key_side: bool):
    """``a @ b`` for a masked tile, where ``a`` is zero on the pairs that are not ``visible``.

    ``visible`` is the tile's ``(queries, keys)`` mask; the group's query
    heads are stacked as ``group x queries`` rows. Query side: ``a`` is
    ``(group x queries, keys)`` and ``b`` ``(keys, c)`` (``p @ v``,
    ``ds @ k``); key side: ``a`` is ``(keys, group x queries)`` and ``b``
    ``(group x queries, c)`` (``p^T @ do``, ``ds^T @ q``). A non-finite entry
    of ``b`` would reach every result through ``0 * inf`` or ``0 * NaN``; it
    is zeroed in the product instead, and the results that see it are NaN.
    """
    finite = xp.isfinite(b)
    if bool(xp.all(finite)):
        return a @ b
    product = a @ xp.where(finite, b, xp.zeros_like(b))
    bad = to(xp, ~finite, b.dtype)
    seen = to(xp, visible, b.dtype)
    n_q = visible.shape[0]
    if key_side:
        bad_rows = xp.sum(xp.reshape(bad, (-1, n_q, b.shape[1])), axis=0)
        return xp.where(seen.mT @ bad_rows > 0, math.nan, product)
    counts = seen @ bad
    stacked = xp.reshape(product, (-1, n_q, b.shape[1]))
    return xp.reshape(xp.where(counts > 0, math.nan, stacked), tuple(product.shape))


def _with_column(xp, a, column, acc):
    """``[a | column]``: ``a`` (rows, n) in ``acc`` with one more column (a (rows,) array or a float)."""
    rows, n = a.shape
    out = xp.empty((rows, n + 1), dtype=acc, device=array_api_compat.device(a))
    out[:, :n] = to(xp, a, acc)
    out[:, n] = column
    return out


def forward(o, q, k, v, m, l, *, scale, causal, input_pos, q_lengths, k_lengths) -> None:
    """Write ``o`` and the checkpoints by :func:`forward_calls` of this one call.

    ``scale`` is a float. Parameters: the ``attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    forward_calls([(o, q, k, v, m, l, input_pos, q_lengths, k_lengths)], scale=scale, causal=causal)


def forward_calls(calls, *, scale, causal) -> None:
    """:func:`forward` of independent calls ``(o, q, k, v, m, l, input_pos, q_lengths,
    k_lengths)`` at once (one dtype, head count and head sizes): their query tiles share one
    split over the workers, so a packed batch's sequences balance as one call's batches do."""
    items: list = []
    rows_max = key_max = 1
    for call in calls:
        o, q, k, v, m, l, input_pos, q_lengths, k_lengths = path_arrays(*call)
        rows, keys = _forward_items(
            items, (o, q, k, v, m, l), input_pos, q_lengths, k_lengths, causal=causal
        )
        rows_max, key_max = max(rows_max, rows), max(key_max, keys)
    if not items:
        return
    xp = array_api_compat.array_namespace(o, q, k, v)
    fast = array_api_compat.is_numpy_namespace(xp)
    group, d, dv = q.shape[1] // k.shape[1], q.shape[3], v.shape[3]
    n_workers = tile_workers(xp, len(items))
    acc = acc_dtype(xp, q.dtype)
    spaces = [
        numpy_tiles.Workspace(rows_max, key_max, d, dv, acc) if fast else None
        for _ in range(n_workers)
    ]

    def work(worker, item):
        (o, q, k, v, m, l), b, g, i0, i1, tile, v_finite = item
        heads_g = slice(g * group, (g + 1) * group)
        space = spaces[worker]
        if v_finite and numpy_tiles.forward_tile(
            space,
            o,
            q,
            k,
            v,
            m,
            l,
            b,
            g,
            heads_g,
            i0,
            i1,
            k_end=tile["k_end"],
            mask_start=tile["mask_start"],
            key_tile=tile["key_tile"],
            scale=scale,
            k_norm=tile["k_norm"],
        ):
            return
        buffer = None if space is None else space.scores
        _forward_tile(
            xp, o, q, k, v, m, l, b, g, heads_g, i0, i1, scale=scale, buffer=buffer, **tile
        )

    # a query tile's cost: its queries times the keys it meets (causal tiles differ up to Sk-fold)
    costs = [(i1 - i0) * tile["k_end"] for _, _, _, i0, i1, tile, _ in items]
    for_each_item(xp, work, items, n_workers, costs)


def _forward_items(items, arrays, input_pos, q_lengths, k_lengths, *, causal) -> tuple[int, int]:
    """Append one call's work items ``(arrays, b, g, i0, i1, tile, v_finite)`` to ``items``,
    writing its fully masked rows now; returns the largest (rows, keys) of its tiles."""
    o, q, k, v, m, l = arrays
    xp = array_api_compat.array_namespace(o, q, k, v)
    batch, heads, sq, d = q.shape
    kv_heads, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    q_device = array_api_compat.device(q)
    positions = per_batch(input_pos, batch, 0, -sq, sk)
    q_valid = per_batch(q_lengths, batch, sq, 0, sq)
    k_valid = per_batch(k_lengths, batch, sk, 0, sk)
    fast = array_api_compat.is_numpy_namespace(xp)
    rows_max = key_max = 1
    for b in range(batch):
        nk, pos = k_valid[b], positions[b]
        nq = q_valid[b] if nk > 0 else 0
        first = min(nq, max(0, -pos)) if causal else 0  # queries before key 0 see nothing
        for rows in (slice(0, first), slice(nq, sq)):
            o[b, :, rows, :] = 0.0
            if m is not None:
                m[b, :, rows] = -math.inf
                l[b, :, rows] = 0.0
        key_tile, query_tile = _tile_sizes(nk, group, d, dv, causal, numpy=fast)
        rows_max, key_max = max(rows_max, group * query_tile), max(key_max, key_tile)
        visible = None
        if causal and nq > first:
            # Row r: the query at position p + r; column c: the key at p + 1 + c.
            visible = _causal_visible(xp, 0, query_tile, 1, 1 + min(query_tile - 1, nk), q_device)
        for g in range(kv_heads):
            k_norm = (
                max_row_norm(xp, k[b, g, :nk, :]) if (m is None or fast) and nq > first else None
            )
            v_finite = fast and nq > first and math.isfinite(max_row_norm(xp, v[b, g, :nk, :]))
            for i0, i1 in spans(first, nq, query_tile):
                k_end = min(nk, pos + i1) if causal else nk
                tile = {
                    "k_end": k_end,
                    "mask_start": min(k_end, pos + i0 + 1) if causal else k_end,
                    "key_tile": key_tile,
                    "k_norm": k_norm,
                    "visible": visible,
                }
                items.append((arrays, b, g, i0, i1, tile, v_finite))
    return rows_max, key_max


def _forward_tile(
    xp,
    o,
    q,
    k,
    v,
    m,
    l,
    b,
    g,
    heads_g,
    i0,
    i1,
    *,
    k_end,
    mask_start,
    key_tile,
    scale,
    k_norm,
    visible,
    buffer,
):
    """One query tile of batch ``b``, kv group ``g`` against keys ``[0, k_end)``.

    Every query of the tile sees keys ``[0, mask_start)``; keys
    ``[mask_start, k_end)`` (fewer than the tile's queries) are causally
    masked with the matching block of ``visible`` (row ``r``, column ``c``:
    the query at ``mask_start - 1 + r`` sees the key at ``mask_start + c``),
    in tiles of their own. Scores are held transposed, ``(keys, rows)``:
    the row max is then a reduction over the leading axis, which NumPy runs
    about 3x faster than one along the contiguous axis (measured at 512 x
    1024 float32). ``o_acc`` and ``l_run`` hold sums of ``exp(s - shift)``,
    where ``shift`` is 0 (None) or the running max. ``k_norm`` is the largest
    key norm, or None when the checkpoints need the max. ``buffer`` (NumPy
    only, else None) holds the score tile: products and exponentials are
    written into it rather than into new arrays.
    """
    acc = acc_dtype(xp, q.dtype)
    group, n_q = heads_g.stop - heads_g.start, i1 - i0
    rows, dv = group * n_q, v.shape[3]
    q_scaled = xp.reshape(to(xp, q[b, heads_g, i0:i1, :], acc) * scale, (rows, q.shape[3]))
    ones = xp.ones((key_tile,), dtype=acc, device=array_api_compat.device(q_scaled))
    bounded = (
        m is None and k_norm is not None and k_norm * max_row_norm(xp, q_scaled) <= SAFE_EXPONENT
    )
    m_run = l_run = o_acc = shift = new_shift = None
    for j0, j1 in (*spans(0, mask_start, key_tile), *spans(mask_start, k_end, key_tile)):
        s = _matmul(
            xp, to(xp, k[b, g, j0:j1, :], acc), q_scaled.mT, _into(xp, buffer, (j1 - j0, rows))
        )
        tile_visible = None
        if j0 >= mask_start:
            tile_visible = visible[:n_q, j0 - mask_start : j1 - mask_start]
            s = _hide(xp, s, tile_visible.mT, -math.inf, in_place=buffer is not None)
        if not bounded:
            row_max = xp.max(s, axis=0)
            m_run = row_max if m_run is None else xp.maximum(m_run, row_max)
            new_shift = None if float(xp.max(xp.abs(m_run))) <= SAFE_EXPONENT else m_run
        if new_shift is not None:
            s -= new_shift[None, :]
        p = _exp(xp, s, in_place=buffer is not None)
        v_tile = to(xp, v[b, g, j0:j1, :], acc)
        pv = (
            p.mT @ v_tile
            if tile_visible is None
            else _visible_product(xp, p.mT, v_tile, tile_visible, key_side=False)
        )
        row_sum = ones[: j1 - j0] @ p
        if o_acc is None:
            l_run, o_acc = row_sum, pv
        else:
            if shift is not None or new_shift is not None:
                alpha = xp.exp(
                    (0.0 if shift is None else shift) - (0.0 if new_shift is None else new_shift)
                )
                l_run = l_run * alpha
                o_acc *= alpha[:, None]
            l_run = l_run + row_sum
            o_acc += pv
        shift = new_shift
    o_acc /= l_run[:, None]
    o[b, heads_g, i0:i1, :] = to(xp, xp.reshape(o_acc, (group, n_q, dv)), o.dtype)
    if m is not None:
        if shift is None:
            l_run = l_run * xp.exp(-m_run)
        m[b, heads_g, i0:i1] = to(xp, xp.reshape(m_run, (group, n_q)), m.dtype)
        l[b, heads_g, i0:i1] = to(xp, xp.reshape(l_run, (group, n_q)), l.dtype)


def _hide(xp, s, visible, fill, *, in_place: bool):
    """``s`` (keys, group x queries) with every pair not ``visible`` (keys, queries) set to ``fill``.

    ``in_place`` (NumPy): written into ``s`` by selection (never added: a
    NaN score must not reach a row that cannot see it).
    """
    group = s.shape[1] // visible.shape[1]
    stacked = xp.reshape(s, (s.shape[0], group, visible.shape[1]))
    if in_place:
        import numpy

        numpy.copyto(stacked, fill, where=~visible[:, None, :])
        return s
    return xp.reshape(xp.where(visible[:, None, :], stacked, fill), tuple(s.shape))


def _into(xp, buffer, shape):
    """A C-contiguous ``shape`` view of the start of the flat NumPy ``buffer``; None without one."""
    if buffer is None:
        return None
    return xp.reshape(buffer[: math.prod(shape)], shape)


def _matmul(xp, a, b, out):
    """``a @ b``, written into ``out`` (a NumPy view) unless it is None."""
    if out is None:
        return a @ b
    import numpy

    return numpy.matmul(a, b, out=out)


def _exp(xp, s, *, in_place: bool):
    """``exp(s)``, in place on NumPy's tile buffer (``in_place``), else a new array."""
    if not in_place:
        return xp.exp(s)
    import numpy

    return numpy.exp(s, out=s)


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
    """Overwrite ``dq``, ``dk``, ``dv`` by :func:`backward_calls` of this one call.

    Recomputes each tile's probabilities from the checkpoints ``m``, ``l``;
    ``delta`` receives ``rowsum(do * o)`` and ``dq_accum`` the sums ``dq /
    scale`` over key tiles. Parameters: the ``attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    call = (do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum, input_pos, q_lengths, k_lengths)
    backward_calls([call], scale=scale, causal=causal)


def backward_calls(calls, *, scale, causal) -> None:
    """:func:`backward` of independent calls ``(do, q, k, v, o, m, l, dq, dk, dv, delta,
    dq_accum, input_pos, q_lengths, k_lengths)`` at once (one dtype, head count and head sizes):
    their (batch, kv head) items share one split over the workers, dealt costliest first by the
    pairs each sees, so a packed batch's sequences balance as :func:`forward_calls` does."""
    items: list = []
    costs: list = []
    dq_rows: list = []
    rows_max = key_max = 1
    for call in calls:
        arrays = path_arrays(*call)
        rows, keys = _backward_items(items, costs, dq_rows, arrays, causal=causal)
        rows_max, key_max = max(rows_max, rows), max(key_max, keys)
    if not items:
        return
    do, q, k, v = arrays[:4]
    xp = array_api_compat.array_namespace(do, q, k, v)
    d, d_v = q.shape[3], v.shape[3]
    # A kv head's key tiles add into the dq_accum rows of its own query heads only,
    # so (batch, kv head) items never write the same element.
    n_workers = tile_workers(xp, len(items))
    acc = acc_dtype(xp, q.dtype)
    fast = array_api_compat.is_numpy_namespace(xp)
    spaces = [
        numpy_tiles.BackwardWorkspace(rows_max, key_max, d, d_v, acc) if fast else None
        for _ in range(n_workers)
    ]

    def work(worker, item):
        (do, q, k, v, m, l, dk, dv, delta, dq_accum), b, g, nk, nq, pos, key_tile, query_tile = item
        space = spaces[worker]
        if space is not None and numpy_tiles.backward_item(
            space,
            do,
            q,
            k,
            v,
            m,
            l,
            dk,
            dv,
            delta,
            dq_accum,
            b,
            g,
            nk=nk,
            nq=nq,
            pos=pos,
            causal=causal,
            key_tile=key_tile,
            query_tile=query_tile,
            scale=scale,
        ):
            return
        buffers = [None, None] if space is None else [space.scores, space.ds]
        for j0, j1 in spans(0, nk, key_tile):
            _backward_key_tile(
                xp,
                do,
                q,
                k,
                v,
                m,
                l,
                dk,
                dv,
                delta,
                dq_accum,
                b,
                g,
                j0,
                j1,
                q_first=max(0, j0 - pos) if causal else 0,
                q_end=nq,
                causal=causal,
                pos=pos,
                query_tile=query_tile,
                scale=scale,
                buffers=buffers,
            )

    for_each_item(xp, work, items, n_workers, costs)
    spaces.clear()  # freed before the dq pass's temporaries: a lower peak
    for dq, dq_accum, b, nq in dq_rows:  # dq = dq_accum * scale over the rows the items summed
        for h in range(dq.shape[1]):
            for r0, r1 in row_blocks(nq, dq.shape[3]):
                dq[b, h, r0:r1, :] = to(xp, dq_accum[b, h, r0:r1, :] * scale, dq.dtype)


def _backward_items(items, costs, dq_rows, arrays, *, causal) -> tuple[int, int]:
    """Append one call's ``(arrays, b, g, nk, nq, pos, key_tile, query_tile)`` items (and their
    costs: the query-key pairs they see) to ``items``, ``costs``, and its ``(dq, dq_accum, b,
    nq)`` to ``dq_rows``, after zeroing the gradient rows no item writes and filling ``delta``;
    returns the largest (rows, keys) of its tiles."""
    do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum, input_pos, q_lengths, k_lengths = arrays
    xp = array_api_compat.array_namespace(do, q, k, v, o)
    batch, heads, sq, d = q.shape
    kv_heads, sk, d_v = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    positions = per_batch(input_pos, batch, 0, -sq, sk)
    q_valid = per_batch(q_lengths, batch, sq, 0, sq)
    k_valid = per_batch(k_lengths, batch, sk, 0, sk)
    tile_arrays = (do, q, k, v, m, l, dk, dv, delta, dq_accum)
    rows_max = key_max = 1
    for b in range(batch):
        nk, pos = k_valid[b], positions[b]
        nq = q_valid[b] if nk > 0 else 0
        dq[b, :, nq:, :] = 0.0
        dk[b, :, nk:, :] = 0.0
        dv[b, :, nk:, :] = 0.0
        _row_dots(xp, do, o, delta, b, nq)
        dq_accum[b, :, :nq, :] = 0.0
        dq_rows.append((dq, dq_accum, b, nq))
        key_tile, query_tile = _tile_sizes(nk, group, d, d_v, False)
        rows_max, key_max = max(rows_max, group * query_tile), max(key_max, key_tile)
        pairs = nq * nk
        if causal:  # query i sees keys [0, pos + i] of the nk: a trapezoid's area
            first, last = (min(nk, max(0, pos + i + 1)) for i in (0, nq - 1))
            pairs = (first + last) * nq // 2
        for g in range(kv_heads):
            items.append((tile_arrays, b, g, nk, nq, pos, key_tile, query_tile))
            costs.append(pairs + nk)  # + nk: an item with no pairs still zeroes its keys
    return rows_max, key_max


def _row_dots(xp, do, o, delta, b, nq) -> None:
    """``delta[b, :, :nq] = rowsum(do * o)`` in row blocks."""
    acc = acc_dtype(xp, o.dtype)
    for h in range(o.shape[1]):
        for r0, r1 in row_blocks(nq, o.shape[3]):
            dots = xp.vecdot(to(xp, do[b, h, r0:r1, :], acc), to(xp, o[b, h, r0:r1, :], acc))
            delta[b, h, r0:r1] = to(xp, dots, delta.dtype)


def _backward_key_tile(
    xp,
    do,
    q,
    k,
    v,
    m,
    l,
    dk,
    dv,
    delta,
    dq_accum,
    b,
    g,
    j0,
    j1,
    *,
    q_first,
    q_end,
    causal,
    pos,
    query_tile,
    scale,
    buffers,
) -> None:
    """dk, dv of keys ``[j0, j1)`` of kv head ``g``, and their share of dq, from queries ``[q_first, q_end)``.

    ``buffers`` (NumPy: two flat tile buffers, else None) receive the score
    and ``ds`` tiles of tiles off the causal diagonal, computed in place. With ``q_aug = [q * scale | -lse]`` and ``k_aug = [k | 1]``,
    ``q_aug @ k_aug^T = s - lse``; with ``do_aug = [do | -delta]`` and
    ``v_aug = [v | 1]``, ``do_aug @ v_aug^T = do v^T - delta``.
    """
    acc = acc_dtype(xp, q.dtype)
    group = q.shape[1] // k.shape[1]
    heads_g = slice(g * group, (g + 1) * group)
    d, d_v = q.shape[3], v.shape[3]
    k_aug = _with_column(xp, k[b, g, j0:j1, :], 1.0, acc)
    v_aug = _with_column(xp, v[b, g, j0:j1, :], 1.0, acc)
    dev = array_api_compat.device(k_aug)
    dk_tile = xp.zeros((j1 - j0, d), dtype=acc, device=dev)
    dv_tile = xp.zeros((j1 - j0, d_v), dtype=acc, device=dev)
    for i0, i1 in spans(q_first, q_end, query_tile):
        n_q = i1 - i0
        rows = group * n_q
        width = min(j1, pos + i1) - j0 if causal else j1 - j0  # keys the tile's last query sees
        lse = to(xp, m[b, heads_g, i0:i1], acc) + xp.log(to(xp, l[b, heads_g, i0:i1], acc))
        q_aug = _with_column(
            xp, xp.reshape(q[b, heads_g, i0:i1, :], (rows, d)), -xp.reshape(lse, (rows,)), acc
        )
        q_aug[:, :d] *= scale
        do_aug = _with_column(
            xp,
            xp.reshape(do[b, heads_g, i0:i1, :], (rows, d_v)),
            -xp.reshape(to(xp, delta[b, heads_g, i0:i1], acc), (rows,)),
            acc,
        )
        diagonal = causal and j0 + width - 1 > pos + i0
        in_place = buffers[0] is not None and not diagonal
        s_out = ds_out = None
        if in_place:
            s_out, ds_out = (_into(xp, buffer, (rows, width)) for buffer in buffers)
        s = _matmul(xp, q_aug, k_aug[:width, :].mT, s_out)
        if not diagonal:
            p = _exp(xp, s, in_place=in_place)
            dv_tile[:width, :] += p.mT @ do_aug[:, :d_v]
            ds = _matmul(xp, do_aug, v_aug[:width, :].mT, ds_out)
            ds *= p
            dq_accum[b, heads_g, i0:i1, :] += xp.reshape(ds @ k_aug[:width, :d], (group, n_q, d))
            dk_tile[:width, :] += ds.mT @ q_aug[:, :d]
            continue
        # A tile crossing the causal diagonal: masked pairs get p = ds = 0 by
        # selection, and the products keep non-finite inputs to the pairs that see them.
        visible = _causal_visible(xp, pos + i0, pos + i1, j0, j0 + width, dev)
        p = xp.exp(_where_visible(xp, s, visible, -math.inf))
        dv_tile[:width, :] += _visible_product(xp, p.mT, do_aug[:, :d_v], visible, key_side=True)
        ds = do_aug @ v_aug[:width, :].mT
        ds = _where_visible(xp, ds * p, visible, 0.0)
        dq_rows = _visible_product(xp, ds, k_aug[:width, :d], visible, key_side=False)
        dq_accum[b, heads_g, i0:i1, :] += xp.reshape(dq_rows, (group, n_q, d))
        dk_tile[:width, :] += _visible_product(xp, ds.mT, q_aug[:, :d], visible, key_side=True)
    dk[b, g, j0:j1, :] = to(xp, dk_tile, dk.dtype)
    dv[b, g, j0:j1, :] = to(xp, dv_tile, dv.dtype)
