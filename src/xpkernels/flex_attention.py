r"""FlexAttention: attention whose scores and mask are Python functions, with their gradients.

For batch ``b``, query head ``h`` (reading kv head ``h // (H // Hkv)``), query
row ``i`` at position ``p_i = input_pos[b] + i`` and key ``j``:

.. math::

    s_{ij} = \begin{cases}
        \mathrm{score\_mod}(\mathrm{scale}\; q_i \cdot k_j,\ b, h, p_i, j)
            & \text{if } \mathrm{mask\_mod}(b, h, p_i, j) \\
        -\infty & \text{otherwise}
    \end{cases}

    m_i = \max_j s_{ij}, \qquad l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

Backward, with :math:`p_{ij} = e^{s_{ij} - m_i} / l_i`,
:math:`\delta_i = do_i \cdot o_i` and :math:`g_{ij} = p_{ij} (do_i \cdot v_j - \delta_i)`
(the gradient of the modified score):

.. math::

    ds_{ij} = g_{ij}\, \frac{\partial\, \mathrm{score\_mod}}{\partial s}, \qquad
    dq_i = \mathrm{scale} \textstyle\sum_j ds_{ij}\, k_j, \qquad
    dk_j = \mathrm{scale} \textstyle\sum_i ds_{ij}\, q_i, \qquad
    dv_j = \textstyle\sum_i p_{ij}\, do_i, \qquad
    d\theta \mathrel{+}=
        \textstyle\sum_{ij} g_{ij}\, \frac{\partial\, \mathrm{score\_mod}}{\partial \theta}

for every float array :math:`\theta` the score mod captures (ALiBi slopes, a
bias table, a learnable relative-position table...). The mods are traced once
into expression graphs (:mod:`xpkernels.mods`); the derivatives come from the
graph's reverse mode, so a mod is written once, with no backward.

Shapes, grouped-query heads, ``scale``, ``input_pos`` and the checkpoints
``(m, l)`` follow :mod:`xpkernels.attention` exactly (its
``AttentionCheckpoints`` are used here; :class:`FlexAttentionBackwardScratch`
adds a score-mod workspace to attention's scratch), so flex with no mods equals
attention. A row that keeps no key has ``o = 0``,
``m = -inf``, ``l = 0`` and zero gradients. Band masks and
:class:`~xpkernels.mods.BlockMask` skip whole tiles in the forward AND the
backward.
"""

from __future__ import annotations

from ._attention_front import AttentionFront

__all__ = [
    "FlexAttentionBackwardScratch",
    "flex_attention_",
    "flex_attention",
    "flex_attention_backward_",
    "flex_attention_backward",
]

_FRONT = AttentionFront("flex_attention", __name__)
FlexAttentionBackwardScratch = _FRONT.Scratch


def flex_attention_(
    o,
    q,
    k,
    v,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """FlexAttention forward, in place: writes ``o`` (and the checkpoints).

    Parameters
    ----------
    o : array
        Output, written in full.
    q, k, v : array or Duplicated
        Queries, keys and values.
    score_mod : ScoreMod or callable, optional
        ``(score, b, h, q_idx, kv_idx) -> score`` applied to every scaled
        score (see :mod:`xpkernels.mods`). None: scores unchanged.
    mask_mod : MaskMod or callable, optional
        ``(b, h, q_idx, kv_idx) -> keep``. None: every key (unless
        ``block_mask`` carries a mask).
    block_mask : BlockMask, optional
        From :func:`~xpkernels.mods.build_block_mask` for this call's
        lengths, ``input_pos``, batch and heads; its mask is the call's mask
        and its tiles are the kernel's tiles.
    block_sparse : bool
        True skips tiles that the band of the mask or the BlockMask proves
        empty, and skips evaluating the mask on tiles proven full. False
        visits every tile and evaluates the mask everywhere (the dense path;
        same results).
    scale : float, optional
        Score scale, finite and > 0; None gives ``1/sqrt(D)``.
    input_pos : int, list of B ints or (B,) integer array
        Position of query row 0 (per batch); mods see ``q_idx = input_pos + row``.
        May be negative: queries before the first key keep nothing under a
        causal mask (``input_pos = Sk - Sq`` is flash-attn's bottom-right
        alignment); ``|input_pos| < 2**31``. Host values (ints, lists,
        NumPy or array_api_strict arrays) are checked and drive band
        skipping; a device array is never read on the host outside debug
        mode (the call stays capture-safe; masks reading ``q_idx`` are then
        evaluated on every tile, and ``block_mask`` needs host positions).
    checkpoints : AttentionCheckpoints, optional
        From ``allocate_checkpoints(flex_attention_, q, k, v)``; receives
        ``(m, l)``. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays, mods or options (named in the message), a read-only
        output, an output sharing memory with an input or another output.
        Nothing is written when a check fails.

    Shapes
    ------
    q ``(B, H, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``, o
    ``(B, H, Sq, Dv)`` with ``H % Hkv == 0``. Last axes contiguous, other
    strides free. Arrays captured by the mods live with q.

    Checkpoints
    -----------
    m : ``(B, H, Sq)`` float32, row max of the modified, masked, scaled scores
    (-inf for a row that keeps no key); l : ``(B, H, Sq)`` float32,
    ``sum_j exp(s_ij - m_i)`` (0 for such a row).
    """
    _FRONT.forward_(locals())


def flex_attention(
    q,
    k,
    v,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """FlexAttention forward into a new array; see :func:`flex_attention_`.

    Returns
    -------
    o : array ``(B, H, Sq, Dv)`` with q's dtype. On torch tensors, when q, k, v or an array
    the score mod captures requires grad (grad mode on), autograd records xpkernels'
    backward, score-mod gradients included (:mod:`xpkernels.torch`).
    """
    return _FRONT.forward(locals())


def flex_attention_backward_(
    O,
    Q,
    K,
    V,
    *,
    checkpoints,
    scratch=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
) -> None:
    """FlexAttention backward, in place: overwrites Q, K, V's shadows; ADDS the mod's gradients.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs; their shadows receive ``dq``, ``dk``, ``dv`` in
        full (zeros where nothing is kept); ``dk``, ``dv`` are summed over
        each kv head's group of query heads.
    checkpoints : AttentionCheckpoints
        Filled by the forward with the same mods and options (or by any
        backend following the contract).
    scratch : FlexAttentionBackwardScratch, optional
        From ``allocate_scratchspace(flex_attention_backward_, O, Q, K, V,
        **options)`` with this call's options (``backend``, and with
        ``score_mod_grad`` the mods, tile options and ``deterministic`` that
        size its ``score_mod_workspace``); None allocates it for this call.
        Every field the routed backend uses must be present; the others may be
        None.
    score_mod_grad : ScoreModGrad, optional
        From ``grad_shadow(score_mod)`` (``feature_grads=True`` for
        PairFeatureScore features): the gradients of the score mod's captured
        float arrays are ADDED into it. None computes none.
    deterministic : bool, default True
        The ``score_mod_grad`` sums are bit-identical run to run (on the
        triton backend: per-program partial rows and a reduction in a fixed
        order); False lets a backend add them with float32 atomics (faster,
        the last bits may vary). Q, K, V's shadows are deterministic either way.
    score_mod, mask_mod, block_mask, block_sparse, scale, input_pos, backend
        As in the forward :func:`flex_attention_`.

    Shapes
    ------
    As :func:`flex_attention_`; shadows share their primal's shape.
    ``score_mod_grad`` fields share their array's shape; float32 (float64
    for float64 arrays).

    Scratch
    -------
    delta : ``(B, H, Sq)``, ``rowsum(do * o)``; dq_accum : ``(B, H, Sq, D)``,
    dq accumulated over key tiles. Float32 (float64 for float64 inputs).
    score_mod_workspace : ``(N,)`` float32, the partial sums of the score-mod
    gradients, ``N`` from the backend (0, None, without ``score_mod_grad``).

    Raises
    ------
    ValueError
        Among the usual argument errors: a ``scratch.score_mod_workspace``
        smaller than the call needs, or (triton, deterministic) partial rows
        too large: over both 1 GiB and 4x the gradients they sum.
    """
    _FRONT.backward_(locals())


def flex_attention_backward(
    do,
    q,
    k,
    v,
    o,
    *,
    checkpoints,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
):
    """FlexAttention backward into new arrays; see :func:`flex_attention_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.
    score_mod_grad : ScoreModGrad, optional
        Receives (ADDS) the score mod's array gradients.
    deterministic : bool, default True
        As in :func:`flex_attention_backward_`.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    return _FRONT.backward(locals())


_FRONT.register(flex_attention_, flex_attention_backward_)
