"""Attention tiles on NumPy arrays: bounded scores through ``exp2``, every temporary reused.

Where the inputs allow it -- every value finite (``v`` in the forward, ``v``
and ``do`` in the backward) and every score bounded through the largest
query and key norms (Cauchy-Schwarz) -- :mod:`.attention` runs these tiles
instead of its Array API ones; each returns False, having written nothing,
when the inputs do not allow it. Every temporary lives in a per-worker
workspace. Exponentials are ``exp2`` of base-2 scores (``log2(e)`` folded
into the query scale), twice as fast as ``exp`` in NumPy's float32 loops
(57 against 120 us on a 512 x 512 tile) and, under the bound, never in the
ranges where ``exp2`` leaves its vector loop (``-inf``: 282 against 30 us at
256 x 256 half masked; results below 2**-126: 2.2 ms against 30 us), which
is why the Array API tiles keep ``exp``: hidden pairs are zeroed after
``exp2`` instead (the forward's causal diagonal took 0.90x the time of
``-inf`` and ``exp`` there, 44.0 against 48.7 ms at 1x8x2048x64 on 2 cores,
medians of 15 interleaved). Rows are stacked query-major, so the causal
diagonal is taken in key chunks against only the queries that see them
(3/4 of the diagonal tile's products at two chunks, 5/8 at four). At
1x8x2048x64 float32 on 2 cores, against the Array API tiles (with the
256-query causal tiles they had before), interleaved in one process
(medians of 7-11): forward 0.80x the time causal and 0.90x without a mask;
backward 0.74x causal and the same without a mask.

What is left is NumPy's floor: the forward is its two products per tile
plus three passes over each score tile (``exp2``, the checkpoints' column
max, the row sums' product) that PyTorch's SDPA fuses into its own loops.
``bench/cpu_attention_floor.py`` times that floor on one core against SDPA
(medians of per-repeat ratios; three runs at 1x8x2048x64, two at
1x8x4096x128, the last summarised in ``bench/results/cpu.md``): at
1x8x2048x64 the products alone took 0.83-0.92x SDPA's time, the products
with those passes (a complete forward without bookkeeping) 1.00-1.08x,
these tiles 1.03-1.08x; at 1x8x4096x128 0.87-0.91x, 0.96-0.97x and
0.97-1.00x.
"""

from __future__ import annotations

import math

import numpy

from ._blocks import LOG2E, SAFE_EXPONENT, max_row_norm, spans, to

__all__ = ["BackwardWorkspace", "Workspace", "backward_item", "forward_tile"]

#: Keys per chunk of the causal diagonal in the backward tiles (128 beat 64 and
#: 256 at 1x8x2048x64 causal, measured).
MASKED_KEY_CHUNK = 128

#: Keys per chunk of the causal diagonal in the forward tiles: with hidden
#: pairs zeroed after ``exp2`` and 1024-key tiles, 256 took 37.2 ms against
#: 42.5 for 128 and 41.7 for the whole 512-key diagonal at 1x8x2048x64 causal
#: on 2 cores (medians of 15, interleaved).
FORWARD_KEY_CHUNK = 256

#: Key rows folded into one before a score tile's column max (:func:`_column_max`):
#: NumPy reduces a ``(keys, rows)`` tile over its keys one short row at a time;
#: folded 8 to a row it took 24 us against 38 on a 512 x 512 tile (measured).
MAX_FOLD = 8

#: Base-2 exponents above which NumPy's ``exp2`` keeps its vector loop (its
#: results stay normal floats; below -126 they turn subnormal, tenfold slower).
MIN_EXP2 = -125.0


class Workspace:
    """One worker's NumPy buffers for the forward tiles of a call: nothing is allocated per tile.

    ``rows`` (query rows of a tile, the group's heads stacked), ``keys``
    (keys per tile), ``d``/``dv`` head dims, ``dtype`` the accumulation dtype.
    Apart from the score tile, every buffer holds a few rows of ``d`` or
    ``dv`` values per query row.
    """

    def __init__(self, rows: int, keys: int, d: int, dv: int, dtype):
        self.scores = numpy.empty((rows * keys,), dtype=dtype)
        self.q = numpy.empty((rows, d), dtype=dtype)  # scaled queries, log2 units
        # largest p so far, running sum, one block's largest p, one block's sum
        self.rows = numpy.empty((4, rows), dtype=dtype)
        self.o = numpy.empty((2, rows, dv), dtype=dtype)  # running output, one tile's p @ v
        self.ones = numpy.ones((keys,), dtype=dtype)
        self.maxes = numpy.empty((MAX_FOLD * rows,), dtype=dtype)  # see _column_max
        chunk = numpy.arange(min(FORWARD_KEY_CHUNK, keys))
        # 1 where key c of a chunk is seen by its row r (c <= r), 0 where it is hidden
        self.seen = (chunk[:, None] <= chunk[None, :]).astype(dtype)


def forward_tile(
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
    *,
    k_end,
    mask_start,
    key_tile,
    scale,
    k_norm,
) -> bool:
    """:func:`.attention._forward_tile` on NumPy arrays, for a kv head whose values are all
    finite and a tile whose scores are bounded; False (nothing written) when they are not.

    Bounded: ``|q_i| |k_j| <= SAFE_EXPONENT`` for every query of the tile and
    key of the group (Cauchy-Schwarz on the largest norms), so scores are
    exponentiated unshifted, in base-2 units (``log2(e)`` folded into the
    query scale) through ``exp2``, twice as fast as ``exp`` in NumPy's float32
    loops; the bound keeps every base-2 score within ``+-SAFE_EXPONENT *
    log2(e)``, far from the -126 where ``exp2``'s results turn subnormal and
    its loop slows tenfold. Hidden pairs are never ``-inf`` (which ``exp2``
    also takes slowly): their ``p`` is multiplied by 0 after ``exp2``, and with
    finite values they contribute exactly nothing. Checkpoints take the
    largest ``p`` of each row (a column max, :func:`_column_max`) and give
    ``m = log(p_max)``, ``l = sum(p) / p_max``.

    Rows are stacked query-major (``n_q x group``), so the queries from one
    on are a contiguous block of rows: the causally masked keys (from the
    tile's first query's own on) are taken in chunks of ``FORWARD_KEY_CHUNK``
    (at most a key tile), each against only the queries that see any of it:
    3/4 of the masked square's products at two chunks. The first chunk, which
    every query of the tile meets, joins the key tiles before it (the last of
    them takes it where it has room: one block fewer). Every step writes
    into ``space`` (a :class:`Workspace`).
    """
    acc = space.scores.dtype
    group, n_q = heads_g.stop - heads_g.start, i1 - i0
    rows, d, dv = group * n_q, q.shape[3], v.shape[3]
    q_two = space.q[:rows]
    q_in = q[b, heads_g, i0:i1, :].transpose(1, 0, 2)
    numpy.multiply(q_in, scale, out=q_two.reshape(n_q, group, d), dtype=acc)
    q_norm = math.sqrt(float(numpy.max(numpy.vecdot(q_two, q_two))))
    if not k_norm * q_norm <= SAFE_EXPONENT:  # also False for a non-finite norm
        return False
    q_two *= LOG2E
    p_max, l_run, tile_max, tile_sum = (a[:rows] for a in space.rows)
    o_acc, pv = space.o[0, :rows], space.o[1, :rows]
    checkpoints = m is not None
    if k_end > mask_start:  # the masked keys start at the first query's own
        mask_start -= 1
    # (first key, end key, first query row) of each block: the keys before the first chunk
    # of masked keys in key tiles, the last of them holding that chunk, then the other chunks
    chunk = min(FORWARD_KEY_CHUNK, key_tile)
    first = min(chunk, k_end - mask_start)
    blocks = [(j0, j1, 0) for j0, j1 in spans(0, mask_start + first, key_tile)]
    for c0, c1 in spans(first, k_end - mask_start, chunk):
        blocks.append((mask_start + c0, mask_start + c1, c0))  # queries before c0 see none of it
    for n, (j0, j1, r0) in enumerate(blocks):
        cols = j1 - j0
        sub = slice(r0 * group, rows)
        p = space.scores[: cols * (rows - sub.start)].reshape(cols, rows - sub.start)
        k_tile, v_tile = to(numpy, k[b, g, j0:j1, :], acc), to(numpy, v[b, g, j0:j1, :], acc)
        numpy.matmul(k_tile, q_two[sub].T, out=p)
        numpy.exp2(p, out=p)
        if j1 > mask_start:  # keys kc.. are h0..h1 of a chunk from row r0's own key on
            kc = max(j0, mask_start + r0)
            h0, h1 = kc - mask_start - r0, j1 - mask_start - r0
            seen = min(n_q - r0, h1)  # rows from r0 + h1 on see them all
            corner = p[kc - j0 :, : seen * group].reshape(h1 - h0, seen, group)
            numpy.multiply(corner, space.seen[h0:h1, :seen, None], out=corner)
        if checkpoints:
            _column_max(space, p, tile_max[sub])
        if n == 0:  # the first block holds every row (queries see key 0 first)
            numpy.matmul(p.T, v_tile, out=o_acc)
            numpy.matmul(space.ones[:cols], p, out=l_run)
            if checkpoints:
                p_max[...] = tile_max
            continue
        o_acc[sub] += numpy.matmul(p.T, v_tile, out=pv[sub])
        l_run[sub] += numpy.matmul(space.ones[:cols], p, out=tile_sum[sub])
        if checkpoints:
            numpy.maximum(p_max[sub], tile_max[sub], out=p_max[sub])
    out = o[b, heads_g, i0:i1, :].transpose(1, 0, 2)
    numpy.divide(o_acc.reshape(n_q, group, dv), l_run.reshape(n_q, group, 1), out=out)
    if checkpoints:  # m = log of the largest p (positive: every row sees a key)
        numpy.divide(l_run, p_max, out=tile_sum)
        l[b, heads_g, i0:i1] = tile_sum.reshape(n_q, group).T
        numpy.log(p_max, out=p_max)
        m[b, heads_g, i0:i1] = p_max.reshape(n_q, group).T
    return True


def _column_max(space, p, out) -> None:
    """``out = p.max(axis=0)`` for a C-contiguous ``(keys, rows)`` tile, its key rows
    folded ``MAX_FOLD`` to a row first (see ``MAX_FOLD``)."""
    keys, rows = p.shape
    if keys % MAX_FOLD:
        numpy.maximum.reduce(p, axis=0, out=out)
        return
    folded = space.maxes[: MAX_FOLD * rows]
    numpy.maximum.reduce(p.reshape(keys // MAX_FOLD, MAX_FOLD * rows), axis=0, out=folded)
    numpy.maximum.reduce(folded.reshape(MAX_FOLD, rows), axis=0, out=out)


class BackwardWorkspace:
    """One worker's NumPy buffers for the backward tiles of a call: nothing is allocated per tile.

    Sizes as :class:`Workspace`. ``scores`` and ``ds`` are the two score-sized
    tiles; the rest hold a few rows of ``d`` or ``dv`` values per query row or key.
    """

    def __init__(self, rows: int, keys: int, d: int, dv: int, dtype):
        self.scores = numpy.empty((rows * keys,), dtype=dtype)
        self.ds = numpy.empty((rows * keys,), dtype=dtype)
        self.q = numpy.empty((rows, d + 1), dtype=dtype)  # [q * scale | -lse], base-2 units
        self.do = numpy.empty((rows, dv + 1), dtype=dtype)  # [do | -delta]
        self.k = numpy.empty((keys, d + 1), dtype=dtype)  # [k | 1]
        self.v = numpy.empty((keys, dv + 1), dtype=dtype)  # [v | 1]
        self.dq = numpy.empty((rows, d), dtype=dtype)  # one block's share of dq
        self.dk = numpy.empty((2, keys, d), dtype=dtype)  # a key tile's dk, one block's share
        self.dv = numpy.empty((2, keys, dv), dtype=dtype)
        chunk = numpy.arange(min(MASKED_KEY_CHUNK, keys))
        self.triangle = chunk[None, :] > chunk[:, None]  # row r, key c of a chunk: c hidden from r


def backward_item(
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
    *,
    nk,
    nq,
    pos,
    causal,
    key_tile,
    query_tile,
    scale,
) -> bool:
    """The backward of batch ``b``, kv head ``g`` on NumPy arrays (every key tile, as
    :func:`.attention._backward_key_tile`); False (nothing written) unless ``do`` and ``v``
    are finite and every ``s - lse`` is provably above ``MIN_EXP2`` in base-2 units.

    The bound: with ``B = scale |q|max |k|max`` (Cauchy-Schwarz), every score
    lies in ``[-B, B]`` and every ``lse`` of the forward's checkpoints in
    ``[-B, B + log(nk)]``, so ``s - lse >= -2B - log(nk)``. Probabilities are
    then ``exp2`` of base-2 products (``log2(e)`` folded into ``q`` and
    ``lse``; ``dk`` is rescaled by ``ln 2`` at the end), the base-2 analogue
    of the forward's. Rows are stacked query-major, as in
    :func:`forward_tile`: a tile on the causal diagonal takes the keys
    every query sees as one block and the rest in chunks of
    ``MASKED_KEY_CHUNK``, each against the queries that see any of it, with
    ``p = 0`` selected on its hidden pairs (all inputs finite: ``ds = 0``
    there too, and every product is exact).
    """
    if nq == 0:  # no query sees the keys
        dk[b, g, :nk, :] = 0.0
        dv[b, g, :nk, :] = 0.0
        return True
    acc = space.scores.dtype
    group = q.shape[1] // k.shape[1]
    heads_g = slice(g * group, (g + 1) * group)
    d, d_v = q.shape[3], v.shape[3]
    heads = range(heads_g.start, heads_g.stop)
    q_norms = [max_row_norm(numpy, q[b, h, :nq, :]) for h in heads]
    other = [max_row_norm(numpy, a) for a in (k[b, g, :nk, :], v[b, g, :nk, :])]
    other += [max_row_norm(numpy, do[b, h, :nq, :]) for h in heads]
    if not all(math.isfinite(norm) for norm in (*q_norms, *other)):
        return False
    bound = scale * max(q_norms) * other[0]
    if not (2.0 * bound + math.log(nk)) * LOG2E <= -MIN_EXP2:
        return False
    chunk = min(MASKED_KEY_CHUNK, key_tile)
    for j0, j1 in spans(0, nk, key_tile):
        n = j1 - j0
        k_aug, v_aug = space.k[:n], space.v[:n]
        k_aug[:, :d], k_aug[:, d] = k[b, g, j0:j1, :], 1.0
        v_aug[:, :d_v], v_aug[:, d_v] = v[b, g, j0:j1, :], 1.0
        dk_acc, dv_acc = space.dk[0, :n], space.dv[0, :n]
        dk_acc[...] = 0.0
        dv_acc[...] = 0.0
        for i0, i1 in spans(max(0, j0 - pos) if causal else 0, nq, query_tile):
            n_q = i1 - i0
            rows = group * n_q
            q_aug, do_aug = space.q[:rows], space.do[:rows]
            q3 = q_aug.reshape(n_q, group, d + 1)
            numpy.multiply(
                q[b, heads_g, i0:i1, :].transpose(1, 0, 2),
                scale * LOG2E,
                out=q3[:, :, :d],
                dtype=acc,
            )
            numpy.log(l[b, heads_g, i0:i1].T, out=q3[:, :, d], dtype=acc)
            q3[:, :, d] += m[b, heads_g, i0:i1].T
            q3[:, :, d] *= -LOG2E
            do3 = do_aug.reshape(n_q, group, d_v + 1)
            do3[:, :, :d_v] = do[b, heads_g, i0:i1, :].transpose(1, 0, 2)
            numpy.negative(delta[b, heads_g, i0:i1].T, out=do3[:, :, d_v])
            # (first key, end key, first query row) of each block, relative to j0 and i0:
            # the keys every query sees, then the chunks of the rest from each query's own key
            end, every = n, n
            if causal:
                end = min(n, pos + i1 - j0)
                every = min(end, pos + i0 - j0)
            blocks = [(0, every, 0)] if every > 0 else []
            blocks += [(every + c0, every + c1, c0) for c0, c1 in spans(0, end - every, chunk)]
            for c0, c1, r0 in blocks:
                cols, sub = c1 - c0, slice(r0 * group, rows)
                p = space.scores[: (rows - sub.start) * cols].reshape(rows - sub.start, cols)
                numpy.matmul(q_aug[sub], k_aug[c0:c1].T, out=p)
                numpy.exp2(p, out=p)
                if c0 >= every:  # rows from r0 + cols on see the whole chunk
                    seen = min(n_q - r0, cols)
                    hidden = space.triangle[:seen, None, :cols]
                    numpy.copyto(p[: seen * group].reshape(seen, group, cols), 0.0, where=hidden)
                dv_acc[c0:c1] += numpy.matmul(p.T, do_aug[sub, :d_v], out=space.dv[1, :cols])
                ds = space.ds[: p.size].reshape(p.shape)
                numpy.matmul(do_aug[sub], v_aug[c0:c1].T, out=ds)
                ds *= p
                dq_rows = numpy.matmul(ds, k_aug[c0:c1, :d], out=space.dq[sub])
                dq_rows = dq_rows.reshape(n_q - r0, group, d).transpose(1, 0, 2)
                dq_accum[b, heads_g, i0 + r0 : i1, :] += dq_rows
                dk_acc[c0:c1] += numpy.matmul(ds.T, q_aug[sub, :d], out=space.dk[1, :cols])
        numpy.multiply(dk_acc, 1.0 / LOG2E, out=dk[b, g, j0:j1, :])  # base-2 q back to natural
        dv[b, g, j0:j1, :] = dv_acc
    return True
