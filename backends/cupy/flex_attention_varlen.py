"""Packed variable-length FlexAttention on CuPy: the CUDA C flex kernels (:mod:`.flex_attention`)
on each sequence's views, through the walk the Triton backend shares
(:func:`~xpkernels.backends.array_api.flex_attention_varlen.offset_walk`: each
sequence's own plan and ``input_pos``, the mods' ``b`` offset by the sequence
index at run time, the prefix sums read on the host, rows no sequence covers
fully masked, one score-mod workspace serving every sequence's pass).
"""

from __future__ import annotations

from xpkernels.backends.array_api.flex_attention_varlen import offset_walk

from . import flex_attention
from .flex_attention import default_tiles

__all__ = ["backward", "default_tiles", "forward", "score_mod_workspace"]

forward, backward, score_mod_workspace = offset_walk(flex_attention)
