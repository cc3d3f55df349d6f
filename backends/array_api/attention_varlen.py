"""Packed variable-length attention on the Array API: attention's tiles over sequence views.

Each sequence is a slice of the packed arrays; permuted to ``(1, H, S, D)``
it is a view (no copy), and :mod:`.attention`'s forward and backward run on
those views, writing the output, checkpoints and shadows in place: the
forward takes every sequence's query tiles in one split over the workers
(:func:`.attention.forward_calls`; a packed batch's forward was 7-16% slower
than the padded one's, which splits its batches that way, and is now as
fast), the backward every sequence's (kv head) items likewise
(:func:`.attention.backward_calls`; 1.12x / 1.20x the padded backward, plain
/ causal, one sequence after another, about 1.0x pooled). The
prefix sums are read on the host (as attention's lengths are), clamped so
that the sequences are ordered, disjoint and within the packed lengths --
whatever their values, nothing is read or written out of bounds -- and any
query or key row that no sequence covers (only possible for unchecked
device prefix sums) is written as fully masked: ``o = 0``, ``m = -inf``,
``l = 0``, zero gradients. ``max_seqlen_q``/``max_seqlen_k`` are not used.
"""

from __future__ import annotations

import math

import array_api_compat

from . import attention

__all__ = ["forward", "backward", "forward_per_sequence", "backward_per_sequence", "walk"]


def _spans(cu, total: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` per sequence from prefix sums ``cu``, clamped ordered and within ``[0, total]``."""
    spans, end = [], 0
    for b in range(cu.shape[0] - 1):
        start = min(total, max(end, int(cu[b])))
        end = min(total, max(start, int(cu[b + 1])))
        spans.append((start, end))
    return spans


def _gaps(spans, total: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, total)`` that no span covers."""
    gaps, end = [], 0
    for start, stop in (*spans, (total, total)):
        if start > end:
            gaps.append((end, start))
        end = max(end, stop)
    return gaps


def _heads_first(xp, a, start: int, end: int):
    """Tokens ``[start, end)`` of a packed ``(T, H, D)`` array as a ``(1, H, S, D)`` view."""
    return xp.expand_dims(xp.permute_dims(a[start:end, ...], (1, 0, 2)), axis=0)


def _rows(xp, a, start: int, end: int):
    """Columns ``[start, end)`` of an ``(H, T)`` array as a ``(1, H, S)`` view."""
    return xp.expand_dims(a[:, start:end], axis=0)


def _position(input_pos, b: int):
    return input_pos if isinstance(input_pos, int) else int(input_pos[b])


def forward(
    o,
    q,
    k,
    v,
    m,
    l,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    input_pos,
) -> None:
    """Write ``o`` and the checkpoints: every sequence's query tiles in one split.

    Parameters: the ``attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    xp = array_api_compat.array_namespace(o, q, k, v)
    seqs, q_spans, _ = visits(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    calls = [
        (*forward_views(xp, (o, q, k, v, m, l), qs, ks), _position(input_pos, b), None, None)
        for b, qs, ks in seqs
    ]
    attention.forward_calls(calls, scale=scale, causal=causal)  # all sequences' tiles at once
    clear_forward_gaps(o, m, l, q_spans)


def forward_per_sequence(
    impl, o, q, k, v, m, l, cu_seqlens_q, cu_seqlens_k, scale, causal, input_pos
) -> None:
    """:func:`forward` through ``impl``, any backend's attention module (its ``forward`` on
    each sequence's ``(1, H, S, D)`` views, without lengths)."""
    keywords = _keywords(scale, causal, input_pos)
    walk(impl.forward, (o, q, k, v, m, l), cu_seqlens_q, cu_seqlens_k, keywords)


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
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    input_pos,
) -> None:
    """Overwrite ``dq``, ``dk``, ``dv``: every sequence's (kv head) items in one split.

    ``delta`` and ``dq_accum`` are attention's scratch, viewed per sequence. Parameters: the
    ``attention_varlen`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum)
    xp = array_api_compat.array_namespace(do, q, k, v, o)
    seqs, q_spans, k_spans = visits(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], True)
    calls = [
        (*backward_views(xp, arrays, qs, ks), _position(input_pos, b), None, None)
        for b, qs, ks in seqs
    ]
    attention.backward_calls(calls, scale=scale, causal=causal)  # all sequences' items at once
    clear_backward_gaps(dq, dk, dv, q_spans, k_spans)


def backward_per_sequence(impl, arrays, cu_seqlens_q, cu_seqlens_k, scale, causal, input_pos):
    """:func:`backward` through ``impl``, any backend's attention module, over ``arrays``: its
    ``backward``'s positional arguments (:func:`xpkernels.backends.protocol.module_functions`)."""
    keywords = _keywords(scale, causal, input_pos)
    walk(impl.backward, arrays, cu_seqlens_q, cu_seqlens_k, keywords, backward=True)


def visits(cu_seqlens_q, cu_seqlens_k, n_q: int, n_kv: int, backward=False):
    """``(b, q_span, k_span)`` of each sequence a pass visits, and the spans.

    Returns ``(visits, q_spans, k_spans)``: the forward skips sequences without
    queries; the backward (``backward=True``) only those without queries and keys.
    """
    q_spans, k_spans = _spans(cu_seqlens_q, n_q), _spans(cu_seqlens_k, n_kv)
    seqs = [
        (b, qs, ks)
        for b, (qs, ks) in enumerate(zip(q_spans, k_spans))
        if qs[1] > qs[0] or (backward and ks[1] > ks[0])
    ]
    return seqs, q_spans, k_spans


def walk(run, arrays, cu_seqlens_q, cu_seqlens_k, keywords, backward=False) -> None:
    """``run`` on each sequence a pass visits, then the rows no sequence covers cleared.

    ``run(*views, **keywords(b, q_span, k_span))`` on sequence ``b``'s views of
    ``arrays``: the forward's ``(o, q, k, v, m, l)`` (:func:`forward_views`), or
    with ``backward`` the backward's (:func:`backward_views`). ``keywords`` is
    called for every sequence before the first ``run``.
    """
    xp = array_api_compat.array_namespace(*arrays[: 5 if backward else 4])
    n_q, n_kv = arrays[1].shape[0], arrays[2].shape[0]
    seqs, q_spans, k_spans = visits(cu_seqlens_q, cu_seqlens_k, n_q, n_kv, backward)
    views = backward_views if backward else forward_views
    calls = [(views(xp, arrays, qs, ks), keywords(b, qs, ks)) for b, qs, ks in seqs]
    for sequence_views, sequence_keywords in calls:
        run(*sequence_views, **sequence_keywords)
    if backward:
        dq, dk, dv = arrays[7:10]
        clear_backward_gaps(dq, dk, dv, q_spans, k_spans)
    else:
        o, m, l = arrays[0], arrays[4], arrays[5]
        clear_forward_gaps(o, m, l, q_spans)


def _keywords(scale, causal, input_pos):
    """:func:`walk`'s ``keywords`` for attention's forward or backward on one sequence."""

    def keywords(b: int, q_span, k_span) -> dict:
        position = _position(input_pos, b)
        return dict(scale=scale, causal=causal, input_pos=position, q_lengths=None, k_lengths=None)

    return keywords


def forward_views(xp, arrays, q_span, k_span) -> tuple:
    """Sequence views of the forward's ``(o, q, k, v, m, l)``: ``(1, H, S, X)`` and ``(1, H, S)``.

    ``m``, ``l`` may be None (inference).
    """
    o, q, k, v, m, l = arrays
    (q0, q1), (k0, k1) = q_span, k_span
    return (
        _heads_first(xp, o, q0, q1),
        _heads_first(xp, q, q0, q1),
        _heads_first(xp, k, k0, k1),
        _heads_first(xp, v, k0, k1),
        None if m is None else _rows(xp, m, q0, q1),
        None if l is None else _rows(xp, l, q0, q1),
    )


def backward_views(xp, arrays, q_span, k_span) -> tuple:
    """Sequence views of the backward's ``(do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum)``
    (``dq_accum`` may be None: its view is None)."""
    do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum = arrays
    (q0, q1), (k0, k1) = q_span, k_span
    return (
        _heads_first(xp, do, q0, q1),
        _heads_first(xp, q, q0, q1),
        _heads_first(xp, k, k0, k1),
        _heads_first(xp, v, k0, k1),
        _heads_first(xp, o, q0, q1),
        _rows(xp, m, q0, q1),
        _rows(xp, l, q0, q1),
        _heads_first(xp, dq, q0, q1),
        _heads_first(xp, dk, k0, k1),
        _heads_first(xp, dv, k0, k1),
        _rows(xp, delta, q0, q1),
        None if dq_accum is None else _heads_first(xp, dq_accum, q0, q1),
    )


def clear_forward_gaps(o, m, l, q_spans) -> None:
    """Query rows no sequence covers are fully masked: ``o = 0``, ``m = -inf``, ``l = 0``."""
    for g0, g1 in _gaps(q_spans, o.shape[0]):
        o[g0:g1, ...] = 0.0
        if m is not None:
            m[:, g0:g1] = -math.inf
            l[:, g0:g1] = 0.0


def clear_backward_gaps(dq, dk, dv, q_spans, k_spans) -> None:
    """Rows no sequence covers get zero gradients."""
    for g0, g1 in _gaps(q_spans, dq.shape[0]):
        dq[g0:g1, ...] = 0.0
    for g0, g1 in _gaps(k_spans, dk.shape[0]):
        dk[g0:g1, ...] = 0.0
        dv[g0:g1, ...] = 0.0
