"""Packed variable-length FlexAttention on the Array API: flex's tiles, one sequence at a time.

As :mod:`.attention_varlen` for attention: each sequence is a ``(1, H, S, D)``
view of the packed arrays, and :mod:`.flex_attention`'s forward and backward
run on those views with the sequence's own tile plan (from the front's
``planner``), its own ``input_pos`` and ``first_batch = b``, so the mods see
the sequence index as ``b`` and positions counted from the sequence's
start. The prefix sums are read on the host and clamped (ordered, disjoint,
within the packed lengths); rows no sequence covers are fully masked (``o =
0``, ``m = -inf``, ``l = 0``, zero gradients). The score mod's array
gradients are added sequence after sequence. ``max_seqlen_q`` and
``max_seqlen_k`` are not used.

The GPU backends run their flex kernels on the same views through
:func:`offset_walk`: instead of ``first_batch``, each graph reading
``b`` is offset by the sequence's index
(:meth:`~xpkernels.mods.Graph.offset_batch`, a run-time constant, so every
sequence shares one compiled kernel).
"""

from __future__ import annotations

import array_api_compat

from . import flex_attention
from .attention_varlen import forward_views, visits, walk
from .flex_attention import default_tiles

__all__ = ["forward", "backward", "default_tiles", "offset_walk"]


def _position(input_pos, b: int):
    """Sequence ``b``'s ``input_pos`` as flex takes it: a 1-tuple of int, or a ``(1,)`` array view."""
    if isinstance(input_pos, tuple):
        return (input_pos[b if len(input_pos) > 1 else 0],)
    return input_pos[b : b + 1]


def _walk(run, arrays, packing, at_sequence, backward=False) -> None:
    """:func:`.attention_varlen.walk` of ``run``, a flex backend's forward (or with ``backward``
    its backward): each sequence ``b`` with its own ``input_pos``, tile plan and the keywords
    ``at_sequence(b)``. ``packing``: ``(cu_seqlens_q, cu_seqlens_k, input_pos, planner)``."""
    cu_seqlens_q, cu_seqlens_k, input_pos, planner = packing

    def keywords(b: int, q_span, k_span) -> dict:
        plan = planner(b, q_span[1] - q_span[0], k_span[1] - k_span[0])
        return dict(input_pos=_position(input_pos, b), plan=plan, **at_sequence(b))

    walk(run, arrays, cu_seqlens_q, cu_seqlens_k, keywords, backward)


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
    input_pos,
    score_mod,
    mask_mod,
    planner,
) -> None:
    """Write ``o`` and the checkpoints, sequence by sequence (:func:`.flex_attention.forward`,
    ``input_pos`` as it takes it). Parameters: the ``flex_attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`)."""

    def at_sequence(b: int) -> dict:
        return dict(scale=scale, score_mod=score_mod, mask_mod=mask_mod, first_batch=b)

    arrays = (o, q, k, v, m, l)
    packing = (cu_seqlens_q, cu_seqlens_k, input_pos, planner)
    _walk(flex_attention.forward, arrays, packing, at_sequence)


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
    input_pos,
    score_mod,
    mask_mod,
    planner,
    score_mod_grads,
    deterministic=True,
    score_mod_workspace=None,
) -> None:
    """Overwrite ``dq``, ``dk``, ``dv`` and ADD the score mod's array gradients.

    Sequence by sequence through :func:`.flex_attention.backward` (``delta`` and ``dq_accum``
    viewed per sequence; ``deterministic`` ignored, ``score_mod_workspace`` always None).
    Parameters: the ``flex_attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """

    def at_sequence(b: int) -> dict:
        return dict(
            scale=scale,
            score_mod=score_mod,
            mask_mod=mask_mod,
            score_mod_grads=score_mod_grads,
            first_batch=b,
        )

    arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum)
    packing = (cu_seqlens_q, cu_seqlens_k, input_pos, planner)
    _walk(flex_attention.backward, arrays, packing, at_sequence, backward=True)


def _offset(graph, b: int):
    return None if graph is None else graph.offset_batch(b)


def offset_walk(module):
    """``(forward, backward, score_mod_workspace)`` of a GPU backend's ``flex_attention_varlen``:
    flex backend module ``module`` on each sequence's views, each graph reading ``b`` offset
    by the sequence's index (the score-mod workspace, sized for the largest sequence's pass,
    serves every pass in turn)."""

    def forward(
        o, q, k, v, m, l, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        input_pos, score_mod, mask_mod, planner,
    ) -> None:  # fmt: skip
        """Write ``o`` and the checkpoints, sequence by sequence: ``input_pos`` a tuple of ints
        (one per sequence, or one shared) or a ``(B,)`` device array, mods traced graphs or
        None. Parameters: the ``flex_attention_varlen`` Signature's
        (:func:`xpkernels.backends.protocol.module_functions`)."""

        def at_sequence(b: int) -> dict:
            return dict(scale=scale, score_mod=_offset(score_mod, b), mask_mod=_offset(mask_mod, b))

        arrays = (o, q, k, v, m, l)
        packing = (cu_seqlens_q, cu_seqlens_k, input_pos, planner)
        _walk(module.forward, arrays, packing, at_sequence)

    def backward(
        do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum, *, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, scale, input_pos, score_mod, mask_mod, planner,
        score_mod_grads, deterministic=True, score_mod_workspace=None,
    ) -> None:  # fmt: skip
        """Overwrite ``dq``, ``dk``, ``dv`` and ADD the score mod's array gradients, sequence by
        sequence; ``dq_accum`` is not used (flex's dQ is its own pass). Parameters: the
        ``flex_attention_varlen`` Signature's
        (:func:`xpkernels.backends.protocol.module_functions`)."""

        def at_sequence(b: int) -> dict:
            return dict(
                scale=scale,
                score_mod=_offset(score_mod, b),
                mask_mod=_offset(mask_mod, b),
                score_mod_grads=score_mod_grads,
                deterministic=deterministic,
                score_mod_workspace=score_mod_workspace,
            )

        arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, None)
        packing = (cu_seqlens_q, cu_seqlens_k, input_pos, planner)
        _walk(module.backward, arrays, packing, at_sequence, backward=True)

    def score_mod_workspace(
        q, k, v, score_mod, planner, cu_seqlens_q, cu_seqlens_k, input_pos, score_mod_grads,
        deterministic,
    ) -> int:  # fmt: skip
        """Float32 elements of the workspace the backward needs: the most any sequence's pass
        needs (``module.score_mod_workspace`` on its views; its ValueError passes through)."""
        if score_mod is None or all(g is None for g in score_mod_grads):
            return 0
        xp = array_api_compat.array_namespace(q, k, v)
        seqs, _, _ = visits(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], backward=True)
        need = 0
        for b, q_span, k_span in seqs:
            plan = planner(b, q_span[1] - q_span[0], k_span[1] - k_span[0])
            _, q_b, k_b, v_b, _, _ = forward_views(xp, (q, q, k, v, None, None), q_span, k_span)
            need = max(
                need,
                module.score_mod_workspace(
                    q_b, k_b, v_b, _offset(score_mod, b), plan, score_mod_grads, deterministic
                ),
            )
        return need

    return forward, backward, score_mod_workspace
