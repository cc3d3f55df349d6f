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

from xpkernels.backends.array_api.flex_attention_varlen import offset_walk

from . import flex_attention
from .flex_attention import default_tiles

__all__ = ["backward", "default_tiles", "forward", "score_mod_workspace"]

forward, backward, score_mod_workspace = offset_walk(flex_attention)
