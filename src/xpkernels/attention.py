r"""Fused multi-head attention with grouped-query heads.

For batch ``b``, query head ``h`` (which reads kv head ``g = h // (H // Hkv)``),
query ``i`` and key ``j``:

.. math::

    s_{ij} = \mathrm{scale}\; q_i \cdot k_j, \qquad
    m_i = \max_j s_{ij}, \qquad
    l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

over the keys ``j`` that row ``i`` may see. Query ``i`` sits at absolute
position ``input_pos[b] + i`` and key ``j`` at position ``j``; key ``j`` is
seen when ``j < k_lengths[b]``, ``i < q_lengths[b]`` and, if ``causal``,
``j <= input_pos[b] + i``. A row that sees no key (fully masked) has
``o = 0``, ``m = -inf``, ``l = 0`` and zero gradients, never NaN.
``input_pos`` may be negative: causal queries before the first key
(``input_pos[b] + i < 0``) see nothing, and ``input_pos = Sk - Sq`` gives
flash-attn's bottom-right causal alignment for ``Sq > Sk``.

Host values of positions and lengths (Python ints, NumPy arrays) are checked
in the front: lengths within ``[0, S]``, every value within the kernels'
int32 index type (``+-(2**31 - 1)``). A device array's values are checked
only in debug mode (:func:`xpkernels.debug`), never read on the host
otherwise: the kernels load them at int64 and clamp them to the range where
they change the result (lengths to ``[0, S]``, positions to ``[-Sq, Sk]``),
so no value can make a kernel wrap or read out of bounds.

Non-finite inputs: a NaN (or infinity) in ``q``, ``k`` or ``v`` reaches
exactly the rows that can see it. A row that sees a NaN key, value or query
entry gets NaN in its output and gradients (and in ``dk``/``dv`` of the keys
it sees); rows that cannot see it -- causal rows before the key, keys at or
past ``k_lengths[b]``, queries past ``q_lengths[b]``, other query rows --
stay finite and exact. Masked scores are never combined with an input in a
way that could turn a NaN into a visible one (no ``0 * NaN``, no maximum
taken over a masked NaN).

Backward, with :math:`p_{ij} = e^{s_{ij} - m_i} / l_i` and
:math:`\delta_i = \sum_c do_{ic}\, o_{ic}`:

.. math::

    dv_j = \textstyle\sum_i p_{ij}\, do_i, \qquad
    ds_{ij} = p_{ij}\,(do_i \cdot v_j - \delta_i), \qquad
    dq_i = \mathrm{scale} \textstyle\sum_j ds_{ij}\, k_j, \qquad
    dk_j = \mathrm{scale} \textstyle\sum_i ds_{ij}\, q_i

``dk`` and ``dv`` are summed over the query heads of each kv group. The
checkpoints ``(m, l)`` are backend-neutral: a forward on one backend feeds a
backward on another. Accumulation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from ._attention_front import AttentionFront

__all__ = [
    "attention_",
    "attention",
    "attention_backward_",
    "attention_backward",
    "AttentionCheckpoints",
    "AttentionBackwardScratch",
]

_FRONT = AttentionFront("attention", __name__)
AttentionCheckpoints = _FRONT.Checkpoints
AttentionBackwardScratch = _FRONT.Scratch


def attention_(
    o,
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    checkpoints=None,
    backend=None,
) -> None:
    """Attention forward, in place: ``o = softmax(scale * q k^T + mask) v``.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on fully masked rows); any float dtype.
    q, k, v : array or Duplicated
        Queries, keys and values, one float dtype.
    causal : bool
        Keep key ``j`` for query ``i`` only when ``j <= input_pos + i``.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    input_pos : int or array
        Absolute position of query 0: an int for every batch, or a ``(B,)``
        integer array; any int64 value, negative included (causal queries
        at negative positions see no key: ``o = 0``, ``m = -inf``, ``l = 0``).
        Keys sit at positions ``0 .. Sk - 1``. ``input_pos = Sk - Sq`` aligns
        the last query with the last key: flash-attn's bottom-right causal
        alignment (for ``Sq > Sk`` the first ``Sq - Sk`` queries see nothing).
    q_lengths, k_lengths : array, optional
        ``(B,)`` integer arrays in ``[0, Sq]`` / ``[0, Sk]``: queries
        ``i >= q_lengths[b]`` and keys ``j >= k_lengths[b]`` are masked out.
    checkpoints : AttentionCheckpoints, optional
        From ``allocate_checkpoints(attention_, q, k, v)``; receives ``m`` and
        ``l`` and records ``causal``, ``scale``, ``input_pos``, ``q_lengths``
        and ``k_lengths`` (arrays by identity, NumPy arrays by value), which
        the backward must repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message), a read-only ``o`` or
        checkpoint, an output sharing memory with an input or another output.
        Nothing is written when a check fails.

    Shapes
    ------
    q : ``(B, H, Sq, D)``; k : ``(B, Hkv, Sk, D)``; v : ``(B, Hkv, Sk, Dv)``;
    o : ``(B, H, Sq, Dv)``, with ``H % Hkv == 0`` (query head ``h`` reads kv
    head ``h // (H // Hkv)``). The last axis must be contiguous; other axes
    may have any stride, so ``(B, S, H, D)`` buffers viewed as BHSD work
    without copies.

    Checkpoints
    -----------
    m, l : ``(B, H, Sq)`` float32; see the module docstring (``-inf`` and 0 on
    fully masked rows).
    """
    _FRONT.forward_(locals())


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    checkpoints=None,
    backend=None,
):
    """Attention forward into a new ``(B, H, Sq, Dv)`` array of ``q``'s dtype; see :func:`attention_`.

    Returns
    -------
    o : array
        On torch tensors that require grad (grad mode on), autograd records
        xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _FRONT.forward(locals())


def attention_backward_(
    O,
    Q,
    K,
    V,
    *,
    checkpoints,
    scratch=None,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    backend=None,
) -> None:
    """Attention backward, in place: overwrites the shadows of Q, K and V with dq, dk, dv.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs (primals, read); their shadows receive ``dq``,
        ``dk`` and ``dv`` in full (zeros for masked queries and keys). ``dk``
        and ``dv`` are summed over each kv head's group of query heads.
    checkpoints : AttentionCheckpoints
        Filled by the forward ``attention_`` (on any backend) with the same
        ``causal``, ``scale``, ``input_pos``, ``q_lengths`` and ``k_lengths``;
        other options, or checkpoints no forward wrote, raise a ValueError
        naming the option.
    scratch : AttentionBackwardScratch, optional
        From ``allocate_scratchspace(attention_backward_, O, Q, K, V)`` (with
        the same ``backend``); None allocates it for this call. Every field
        the routed backend uses must be present; the others may be None.
    causal, scale, input_pos, q_lengths, k_lengths, backend
        As in the forward :func:`attention_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`attention_`: O ``(B, H, Sq, Dv)``, Q ``(B, H, Sq, D)``, K
    ``(B, Hkv, Sk, D)``, V ``(B, Hkv, Sk, Dv)``; shadows share their primal's
    shape and may have any float dtype. Last axes contiguous.

    Scratch
    -------
    delta : ``(B, H, Sq)``, ``rowsum(do * o)``; dq_accum : ``(B, H, Sq, D)``,
    dq accumulated over key tiles (array_api only; None for triton). Float32
    (float64 for float64 inputs).
    """
    _FRONT.backward_(locals())


def attention_backward(
    do,
    q,
    k,
    v,
    o,
    *,
    checkpoints,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    backend=None,
):
    """Attention backward into new arrays; see :func:`attention_backward_`.

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


_FRONT.register(attention_, attention_backward_)
