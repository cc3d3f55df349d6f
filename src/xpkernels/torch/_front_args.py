"""Option checks shared by the autograd fronts of :mod:`xpkernels.torch`.

The fronts of :mod:`~xpkernels.torch._fronts`, :mod:`~xpkernels.torch._varlen`
and :mod:`~xpkernels.torch._flex_varlen` all read their options through
these helpers; they live here, below all three, so that ``_fronts`` (which
collects every front into ``FRONTS``) imports the others and none of them
imports ``_fronts`` back.
"""

from __future__ import annotations

import operator

import torch

from .. import _checks as check
from . import _flex
from ._declared import backend_choice

__all__ = ["_backend", "_flex_key", "_no_checkpoints", "_positions", "_scale", "backend_choice"]

#: The explicit backend choice of a call (the name the varlen fronts import).
_backend = backend_choice


def _no_checkpoints(fn, options) -> None:
    if options.get("checkpoints") is not None:
        raise ValueError(
            f"{fn}: checkpoints= feeds the explicit backward ({fn}_backward); with autograd "
            "recording this call (an input requires grad), autograd saves the checkpoints "
            f"itself. Drop checkpoints=, or call {fn} under torch.no_grad() to keep them"
        )


def _positions(fn, input_pos):
    """``(int, tensor or None)`` for an ``input_pos`` given as an int or a tensor."""
    if isinstance(input_pos, torch.Tensor):
        return 0, input_pos
    if isinstance(input_pos, bool):
        raise TypeError(f"{fn}: input_pos must be an int >= 0 or a (B,) integer array, got a bool")
    try:
        return operator.index(input_pos), None
    except TypeError:
        raise TypeError(
            f"{fn}: input_pos must be an int >= 0 or a (B,) integer array, "
            f"got {type(input_pos).__name__}"
        ) from None


def _scale(fn, scale):
    return None if scale is None else check.positive_finite(fn, "scale", scale)


@torch._dynamo.assume_constant_result
def _traced_flex_key(score_mod, mask_mod, block_mask, block_sparse) -> int:
    mods = _flex.FlexMods(score_mod, mask_mod, block_mask, block_sparse)
    return _flex.register_flex(mods, keep=True)


def _flex_key(fn, options, block_mask) -> tuple:
    """``(key, score_arrays, mods)``: the call's mods filed for the flex ops under ``key``.

    The filing holds ``mods`` weakly: the caller keeps ``mods`` alive until
    the op has run (its autograd graph then holds them).
    """
    block_sparse = options["block_sparse"]
    if not isinstance(block_sparse, bool):
        raise TypeError(f"{fn}: block_sparse must be a bool, got {block_sparse!r}")
    score_mod, mask_mod = options["score_mod"], options["mask_mod"]
    if torch.compiler.is_compiling():
        # Filed once, when the graph is traced; the graph holds the key as a constant.
        key = _traced_flex_key(score_mod, mask_mod, block_mask, block_sparse)
        return key, _flex.score_arrays(score_mod), None
    mods = _flex.FlexMods(score_mod, mask_mod, block_mask, block_sparse)
    return _flex.register_flex(mods), mods.arrays(), mods
