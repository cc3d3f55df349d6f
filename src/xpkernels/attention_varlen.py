r"""Attention over packed variable-length sequences (flash-attn's ``varlen`` layout).

A batch of ``B`` sequences of different lengths is packed without padding:
queries ``q (Tq, H, D)``, keys ``k (Tk, Hkv, D)`` and values ``v (Tk, Hkv,
Dv)`` hold the tokens of every sequence one after the other, and the
``(B + 1,)`` int32 prefix sums ``cu_seqlens_q`` / ``cu_seqlens_k`` say where
each starts: sequence ``b`` owns queries ``cu_seqlens_q[b] <= t <
cu_seqlens_q[b + 1]`` and keys ``cu_seqlens_k[b] <= t < cu_seqlens_k[b + 1]``.
Sequence ``b`` is exactly :mod:`xpkernels.attention` of its own queries over
its own keys -- no query sees another sequence's keys:

.. math::

    s_{ij} = \mathrm{scale}\; q_i \cdot k_j, \qquad
    m_i = \max_j s_{ij}, \qquad
    l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

with ``i`` and ``j`` counted from the start of the sequence. Positions are
per sequence: query ``i`` of sequence ``b`` sits at ``input_pos[b] + i`` (an
int ``input_pos`` is the same for every sequence) and key ``j`` at ``j``; with
``causal`` it sees keys ``j <= input_pos[b] + i``. The default
``input_pos = 0`` aligns the STARTS of each sequence's queries and keys
(top-left, as :func:`xpkernels.attention`); flash-attn's bottom-right
alignment (the last query sees the last key) is ``input_pos[b] = Sk_b - Sq_b``,
a ``(B,)`` array. Grouped-query heads as attention: query head ``h`` reads kv
head ``h // (H // Hkv)``. A row that sees no key (an empty key sequence, a
causal row before key 0) has ``o = 0``, ``m = -inf``, ``l = 0`` and zero
gradients; keys of a sequence without queries get zero ``dk``, ``dv``.

The checkpoints ``(m, l)`` are ``(H, Tq)`` float32, natural-log units, the
same backend-neutral contract as attention's: a forward on one backend feeds
a backward on another, and they equal attention's checkpoints of each
sequence run alone.

Values of ``cu_seqlens`` (starting at 0, non-decreasing, ending at the packed
length) and of ``max_seqlen_q``/``max_seqlen_k`` (at least the longest
sequence) are checked in the front on host arrays (NumPy) and, for device
arrays, only in debug mode (:func:`xpkernels.debug`): reading a device array
would sync it. The kernels never read or write out of bounds whatever the
values: starts and ends are clamped into ``[0, T]``. Unchecked bad values
give unspecified results: on Triton, rows of a sequence past ``max_seqlen``
and tokens no sequence covers are left unwritten.

``max_seqlen_q`` / ``max_seqlen_k`` size the Triton launch grid (one program
per query tile of the longest sequence, per sequence, per head), as in
flash-attn; when None they are derived from the prefix sums on the host
(one device sync for device arrays). Pass them for a capture-safe call.
The array_api backend reads the prefix sums on the host to slice each
sequence (it reads attention's lengths in the same way) and does not use
``max_seqlen``.

Backward as :mod:`xpkernels.attention`, per sequence; ``dk`` and ``dv`` are
summed over the query heads of each kv group.
"""

from __future__ import annotations

from ._attention_front import AttentionFront

__all__ = [
    "attention_varlen_",
    "attention_varlen",
    "attention_varlen_backward_",
    "attention_varlen_backward",
    "AttentionVarlenCheckpoints",
    "AttentionVarlenBackwardScratch",
]

_FRONT = AttentionFront("attention_varlen", __name__)
AttentionVarlenCheckpoints = _FRONT.Checkpoints
AttentionVarlenBackwardScratch = _FRONT.Scratch


def attention_varlen_(
    o,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """Packed variable-length attention forward, in place; see the module docstring.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on fully masked rows); any float dtype.
    q, k, v : array or Duplicated
        Packed queries, keys and values, one float dtype.
    cu_seqlens_q, cu_seqlens_k : array
        ``(B + 1,)`` int32 prefix sums: 0 first, non-decreasing, the packed
        lengths ``Tq`` / ``Tk`` last. Sequence ``b`` holds queries
        ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and keys
        ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])``; either may be empty.
    max_seqlen_q, max_seqlen_k : int, optional
        At least the longest query / key sequence (they size the Triton
        grid; a larger one, such as a fixed bucket, counts as at most
        ``Tq`` / ``Tk``); None derives them from the prefix sums on the host
        (a device sync for device arrays). A smaller value is refused on
        host arrays and in debug mode; otherwise the kernels clamp each
        sequence to it.
    causal : bool
        Keep key ``j`` for query ``i`` of a sequence only when ``j <= input_pos + i``.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    input_pos : int or array
        Position of each sequence's first query: an int for every sequence
        or a ``(B,)`` integer array, negative allowed. 0 aligns the starts of
        queries and keys (top-left); ``Sk_b - Sq_b`` aligns their ends
        (flash-attn's bottom-right).
    checkpoints : AttentionVarlenCheckpoints, optional
        From ``allocate_checkpoints(attention_varlen_, q, k, v)``; receives
        ``m`` and ``l`` and records ``causal``, ``scale``, ``input_pos``,
        ``cu_seqlens_q`` and ``cu_seqlens_k``, which the backward must
        repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message): prefix sums of
        another dtype, not starting at 0, decreasing, not ending at the
        packed length, or with another ``B`` for the keys than for the
        queries; a read-only ``o`` or checkpoint; an output sharing memory
        with an input. Nothing is written when a check fails.

    Shapes
    ------
    q : ``(Tq, H, D)``; k : ``(Tk, Hkv, D)``; v : ``(Tk, Hkv, Dv)``; o :
    ``(Tq, H, Dv)``; cu_seqlens_q, cu_seqlens_k : ``(B + 1,)``, with
    ``H % Hkv == 0``. The last axis must be contiguous; other strides are free.

    Checkpoints
    -----------
    m, l : ``(H, Tq)`` float32 (``-inf`` and 0 on fully masked rows).
    """
    _FRONT.forward_(locals())


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """Packed varlen attention forward into a new ``(Tq, H, Dv)`` array; see :func:`attention_varlen_`.

    Returns
    -------
    o : array
        Of ``q``'s dtype. On torch tensors that require grad (grad mode on),
        autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _FRONT.forward(locals())


def attention_varlen_backward_(
    O,
    Q,
    K,
    V,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    scratch=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    backend=None,
) -> None:
    """Packed varlen attention backward, in place: overwrites the shadows of Q, K and V.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs (primals, read); their shadows receive ``dq``,
        ``dk`` and ``dv`` in full (zeros for fully masked queries and unseen
        keys), ``dk`` and ``dv`` summed over each kv head's query heads.
    cu_seqlens_q, cu_seqlens_k : array
        The forward's prefix sums.
    checkpoints : AttentionVarlenCheckpoints
        Filled by the forward ``attention_varlen_`` (on any backend) with the
        same ``causal``, ``scale``, ``input_pos``, ``cu_seqlens_q`` and
        ``cu_seqlens_k``; other options, or checkpoints no forward wrote,
        raise a ValueError naming the option.
    scratch : AttentionVarlenBackwardScratch, optional
        From ``allocate_scratchspace(attention_varlen_backward_, O, Q, K, V)``
        (with the same ``backend``); None allocates it for this call.
    max_seqlen_q, max_seqlen_k, causal, scale, input_pos, backend
        As in the forward :func:`attention_varlen_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`attention_varlen_`; shadows share their primal's shape and may
    have any float dtype. Last axes contiguous.

    Scratch
    -------
    delta : ``(H, Tq)``, ``rowsum(do * o)``; dq_accum : ``(Tq, H, D)`` (array_api
    only; None for triton). Float32 (float64 for float64 inputs).
    """
    _FRONT.backward_(locals())


def attention_varlen_backward(
    do,
    q,
    k,
    v,
    o,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    backend=None,
):
    """Packed varlen attention backward into new arrays; see :func:`attention_varlen_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    return _FRONT.backward(locals())


_FRONT.register(attention_varlen_, attention_varlen_backward_)
