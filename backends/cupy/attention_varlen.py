"""Packed variable-length attention on the CuPy backend: the CUDA C attention kernels, one
sequence at a time.

Each sequence is a ``(1, H, S, D)`` view of the packed arrays (strides, no
copy) run through :mod:`.attention`'s forward and backward, the walk shared
with the array_api backend (:func:`~xpkernels.backends.array_api.attention_varlen.forward_per_sequence`):
the prefix sums are read on the host (one device sync per call), clamped so
that the sequences are ordered, disjoint and within the packed lengths, and
rows no sequence covers are fully masked (``o = 0``, ``m = -inf``, ``l = 0``,
zero gradients). One launch per sequence and kernel: a batch of many short
sequences pays a launch each. ``max_seqlen_q``/``max_seqlen_k`` are not used.
"""

from __future__ import annotations

from xpkernels.backends.array_api.attention_varlen import (
    backward_per_sequence,
    forward_per_sequence,
)

from . import attention

__all__ = ["forward", "backward"]


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
    """Write ``o`` (and ``m``, ``l`` unless None), sequence by sequence.

    Parameters: the ``attention_varlen`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    forward_per_sequence(
        attention, o, q, k, v, m, l, cu_seqlens_q, cu_seqlens_k, scale, causal, input_pos
    )


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
    """Overwrite ``dq``, ``dk``, ``dv`` in full, sequence by sequence.

    ``delta`` is attention's scratch, viewed per sequence; ``dq_accum`` is not
    used (None: dQ is its own pass). Parameters: the ``attention_varlen``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, None)
    backward_per_sequence(attention, arrays, cu_seqlens_q, cu_seqlens_k, scale, causal, input_pos)
