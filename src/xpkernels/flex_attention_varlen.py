r"""FlexAttention over packed variable-length sequences.

The packing of :mod:`xpkernels.attention_varlen` (``q (Tq, H, D)``, ``k (Tk,
Hkv, D)``, ``v (Tk, Hkv, Dv)``, int32 prefix sums ``cu_seqlens_q`` /
``cu_seqlens_k``) with the mods of :mod:`xpkernels.flex_attention`: sequence
``b`` is exactly ``flex_attention`` of its own queries over its own keys, the
mods seeing

- ``b``: the sequence index (``0 <= b < B``);
- ``q_idx = input_pos[b] + i`` for its query ``i`` (counted from the
  sequence's first query) and ``q_row = i``;
- ``kv_idx = j`` for its key ``j`` (counted from the sequence's first key);
- ``h``: the query head.

So ``CausalMask()`` with the default ``input_pos = 0`` aligns the STARTS of
each sequence's queries and keys (top-left), and ``input_pos[b] = Sk_b -
Sq_b`` (a ``(B,)`` array) aligns their ends (flash-attn's bottom-right), as
``attention_varlen(causal=True)``. No query sees another sequence's keys:
there is no document mask to write.

Mods are checked against ``B`` batches (sequences), ``H`` heads,
``max_seqlen_q`` queries and ``max_seqlen_k`` keys: an array a mod indexes
by ``b`` has ``B`` entries, one indexed by ``kv_idx`` at least
``max_seqlen_k``. Band masks (causal, sliding windows, prefixes) skip whole
tiles per sequence, at the sequence's own length and position. There is no
``block_mask``: a :class:`~xpkernels.mods.BlockMask` is built for one pair of
lengths, which packed sequences do not share.

The checkpoints ``(m, l)`` are ``(H, Tq)`` float32 in natural-log units
(:class:`~xpkernels.attention_varlen.AttentionVarlenCheckpoints`), equal to
flex's checkpoints of each sequence run alone. A row that keeps no key has
``o = 0``, ``m = -inf``, ``l = 0`` and zero gradients; keys of a sequence
without queries get zero ``dk``, ``dv``. Prefix sums, ``max_seqlen`` and
``input_pos`` follow :mod:`xpkernels.attention_varlen` (values checked on
host arrays and in debug mode). The backward ADDS the score mod's array
gradients, summed over every sequence, into ``score_mod_grad``.
"""

from __future__ import annotations

from ._attention_front import AttentionFront

__all__ = [
    "FlexAttentionVarlenBackwardScratch",
    "flex_attention_varlen_",
    "flex_attention_varlen",
    "flex_attention_varlen_backward_",
    "flex_attention_varlen_backward",
]

_FRONT = AttentionFront("flex_attention_varlen", __name__)
FlexAttentionVarlenBackwardScratch = _FRONT.Scratch


def flex_attention_varlen_(
    o,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """Packed variable-length FlexAttention forward, in place; see the module docstring.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on rows that keep no key).
    q, k, v : array or Duplicated
        Packed queries, keys and values, one float dtype.
    cu_seqlens_q, cu_seqlens_k : array
        ``(B + 1,)`` int32 prefix sums, as :func:`~xpkernels.attention_varlen_`.
    max_seqlen_q, max_seqlen_k : int, optional
        At least the longest query / key sequence (a larger one counts as
        at most ``Tq`` / ``Tk``); None derives them from the prefix sums on
        the host. The mods are checked against them.
    score_mod : ScoreMod or callable, optional
        ``(score, b, h, q_idx, kv_idx) -> score``, ``b`` the sequence index.
    mask_mod : MaskMod or callable, optional
        ``(b, h, q_idx, kv_idx) -> keep``.
    block_sparse : bool
        True skips the tiles a band mask proves empty, per sequence; False
        visits every tile (same results).
    scale : float, optional
        Score scale, finite and > 0; None gives ``1/sqrt(D)``.
    input_pos : int, list of B ints or (B,) integer array
        Position of each sequence's first query (``q_idx = input_pos[b] +
        i``); negative allowed. Host values drive band skipping; a device
        array is not read on the host outside debug mode.
    checkpoints : AttentionVarlenCheckpoints, optional
        From ``allocate_checkpoints(flex_attention_varlen_, q, k, v)``;
        receives ``(m, l)`` and records the mods and options the backward
        must repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays, prefix sums, mods or options (named in the message), a
        read-only output, an output sharing memory with an input. Nothing
        is written when a check fails.

    Shapes
    ------
    q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)``, o ``(Tq, H,
    Dv)``, cu_seqlens ``(B + 1,)``, with ``H % Hkv == 0``. Last axes
    contiguous, other strides free. Arrays captured by the mods live with q.

    Checkpoints
    -----------
    m, l : ``(H, Tq)`` float32, the row max of the modified, masked, scaled
    scores and ``sum_j exp(s_ij - m_i)`` (``-inf`` and 0 for a row that keeps
    no key).
    """
    _FRONT.forward_(locals())


def flex_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """Packed FlexAttention forward into a new ``(Tq, H, Dv)`` array; see :func:`flex_attention_varlen_`.

    Returns
    -------
    o : array
        Of ``q``'s dtype. On torch tensors, when q, k, v or an array the
        score mod captures requires grad (grad mode on), autograd records
        xpkernels' backward, score-mod gradients included (:mod:`xpkernels.torch`).
    """
    return _FRONT.forward(locals())


def flex_attention_varlen_backward_(
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
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
) -> None:
    """Packed FlexAttention backward, in place: overwrites the shadows; ADDS the mod's gradients.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs; their shadows receive ``dq``, ``dk``, ``dv`` in
        full (zeros where nothing is kept), ``dk``, ``dv`` summed over each
        kv head's query heads.
    cu_seqlens_q, cu_seqlens_k : array
        The forward's prefix sums.
    checkpoints : AttentionVarlenCheckpoints
        Filled by ``flex_attention_varlen_`` with the same mods, prefix sums
        and options; others raise a ValueError naming the option.
    scratch : FlexAttentionVarlenBackwardScratch, optional
        From ``allocate_scratchspace(flex_attention_varlen_backward_, O, Q,
        K, V, cu_seqlens_q, cu_seqlens_k, **options)`` with this call's
        options (``backend``; with ``score_mod_grad``, the mods, ``input_pos``
        and ``deterministic`` that size its ``score_mod_workspace``); None
        allocates it for this call.
    score_mod_grad : ScoreModGrad, optional
        From ``grad_shadow(score_mod)``: the gradients of the score mod's
        captured float arrays, summed over the sequences, are ADDED into it.
    deterministic : bool, default True
        As in :func:`~xpkernels.flex_attention.flex_attention_backward_`.
    max_seqlen_q, max_seqlen_k, score_mod, mask_mod, block_sparse, scale, input_pos, backend
        As in the forward :func:`flex_attention_varlen_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`flex_attention_varlen_`; shadows share their primal's shape.

    Scratch
    -------
    delta : ``(H, Tq)``, ``rowsum(do * o)``; dq_accum : ``(Tq, H, D)``.
    Float32 (float64 for float64 inputs). score_mod_workspace : ``(N,)``
    float32, as flex's, serving each sequence's pass in turn.
    """
    _FRONT.backward_(locals())


def flex_attention_varlen_backward(
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
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
):
    """Packed FlexAttention backward into new arrays; see :func:`flex_attention_varlen_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.
    score_mod_grad : ScoreModGrad, optional
        Receives (ADDS) the score mod's array gradients.
    deterministic : bool, default True
        As in :func:`flex_attention_varlen_backward_`.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    return _FRONT.backward(locals())


_FRONT.register(flex_attention_varlen_, flex_attention_varlen_backward_)
