"""Packed variable-length FlexAttention on Triton: the flex kernels, one sequence at a time.

Each sequence is a ``(1, H, S, D)`` view of the packed tensors (strides, no
copy) run through :mod:`.flex_attention`'s forward and backward with its own
tile plan (from the front's ``planner``) and its own ``input_pos``. The mods
see the sequence index as ``b``: each graph reading ``b`` is offset by the
sequence's index (:meth:`~xpkernels.mods.Graph.offset_batch`, a run-time
constant, so all sequences share one compiled kernel). The prefix sums are
read on the host (one device sync per call, so a call cannot be captured in a
CUDA graph) and clamped as on the array_api backend (ordered, disjoint,
within the packed lengths); rows no sequence covers are fully masked (``o =
0``, ``m = -inf``, ``l = 0``, zero gradients). The score mod's array
gradients are added sequence after sequence, each sequence's pass reusing
the one score-mod workspace (sized for the largest, :func:`score_mod_workspace`).
``max_seqlen_q`` and ``max_seqlen_k`` are not used.
"""

from __future__ import annotations

import array_api_compat
from xpkernels.backends.array_api.attention_varlen import (
    backward_views,
    clear_backward_gaps,
    clear_forward_gaps,
    forward_views,
)
from xpkernels.backends.array_api.flex_attention_varlen import sequences

from . import flex_attention
from .flex_attention import default_tiles

__all__ = ["backward", "default_tiles", "forward", "score_mod_workspace"]


def _offset(graph, b: int):
    return None if graph is None else graph.offset_batch(b)


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
    """Write ``o`` (and ``m``, ``l`` unless None) for validated packed inputs, sequence by sequence.

    ``o``: (Tq, H, Dv); ``q``: (Tq, H, D); ``k``: (Tk, Hkv, D); ``v``: (Tk,
    Hkv, Dv); ``m``, ``l``: (H, Tq) float32 or None; ``input_pos``: a tuple
    of ints (one per sequence, or one shared) or a (B,) integer tensor;
    ``score_mod``, ``mask_mod``: traced graphs or None.
    """
    xp = array_api_compat.array_namespace(o, q, k, v)
    visits, q_spans, _ = sequences(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], input_pos, planner
    )
    for b, q_span, k_span, position, plan in visits:
        flex_attention.forward(
            *forward_views(xp, (o, q, k, v, m, l), q_span, k_span),
            scale=scale,
            input_pos=position,
            score_mod=_offset(score_mod, b),
            mask_mod=_offset(mask_mod, b),
            plan=plan,
        )
    clear_forward_gaps(o, m, l, q_spans)


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
    """Overwrite ``dq``, ``dk``, ``dv`` in full and ADD the score mod's array gradients.

    ``delta`` (H, Tq) float32 is flex's scratch, viewed per sequence;
    ``dq_accum`` is not used (flex's dQ is its own pass). ``deterministic``
    and ``score_mod_workspace`` as flex's backward, the workspace serving every
    sequence's pass in turn. Other arguments as :func:`forward`.
    """
    xp = array_api_compat.array_namespace(do, q, k, v, o)
    visits, q_spans, k_spans = sequences(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], input_pos, planner, backward=True
    )
    arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, None)  # dq_accum is not used
    for b, q_span, k_span, position, plan in visits:
        flex_attention.backward(
            *backward_views(xp, arrays, q_span, k_span),
            scale=scale,
            input_pos=position,
            score_mod=_offset(score_mod, b),
            mask_mod=_offset(mask_mod, b),
            plan=plan,
            score_mod_grads=score_mod_grads,
            deterministic=deterministic,
            score_mod_workspace=score_mod_workspace,
        )
    clear_backward_gaps(dq, dk, dv, q_spans, k_spans)


def score_mod_workspace(
    q,
    k,
    v,
    score_mod,
    planner,
    cu_seqlens_q,
    cu_seqlens_k,
    input_pos,
    score_mod_grads,
    deterministic,
) -> int:
    """Float32 elements of the workspace :func:`backward` needs: the most any sequence's pass
    needs (:func:`.flex_attention.score_mod_workspace` on its views).

    Raises
    ------
    ValueError
        Deterministic partial rows too large for some sequence.
    """
    if score_mod is None or all(g is None for g in score_mod_grads):
        return 0
    xp = array_api_compat.array_namespace(q, k, v)
    visits, _, _ = sequences(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], input_pos, planner, backward=True
    )
    need = 0
    for b, q_span, k_span, _, plan in visits:
        _, q_b, k_b, v_b, _, _ = forward_views(xp, (q, q, k, v, None, None), q_span, k_span)
        need = max(
            need,
            flex_attention.score_mod_workspace(
                q_b, k_b, v_b, _offset(score_mod, b), plan, score_mod_grads, deterministic
            ),
        )
    return need
