"""The allocating fronts on torch tensors that need gradients: calls of the ``xpkernels`` ops.

:func:`xpkernels._autograd.record` hands a call here when autograd must see
it (or ``torch.compile`` traces it). Each function checks the options a
schema cannot check for itself, fixes the backend choice now (so the
backward, which autograd may run on another thread, uses the forward's
backend) and calls the functional op; the op's implementation runs the
front's full validation before it writes anything.

Importing this module files :data:`FRONTS` in :data:`xpkernels._autograd.RECORDERS`
(the core looks its recorders up there and never imports the torch layer);
the option checks the fronts share live in :mod:`~xpkernels.torch._front_args`.
"""

from __future__ import annotations

import operator

import torch

from .. import _autograd
from ..buffers import primal
from . import _declared
from ._declared import backend_choice
from ._flex_varlen import front as _flex_attention_varlen
from ._front_args import _flex_key, _no_checkpoints, _positions, _scale
from ._varlen import front as _attention_varlen

__all__ = ["FRONTS"]

ops = torch.ops.xpkernels


def _attention(fn, arrays, options):
    _no_checkpoints(fn, options)
    q, k, v = (primal(arrays[n]) for n in ("q", "k", "v"))
    input_pos, input_pos_array = _positions(fn, options["input_pos"])
    o, _, _ = ops.attention(
        q,
        k,
        v,
        bool(options["causal"]),
        _scale(fn, options["scale"]),
        input_pos,
        input_pos_array,
        options["q_lengths"],
        options["k_lengths"],
        backend_choice(options),
    )
    return o


def _decode_attention(fn, arrays, options):
    if options.get("scratch") is not None:
        raise ValueError(
            f"{fn}: scratch= is for the in-place decode_attention_; with autograd recording "
            "this call (an input requires grad) run it under torch.no_grad() to pass scratch"
        )
    q, k_cache, v_cache = (primal(arrays[n]) for n in ("q", "k_cache", "v_cache"))
    n_splits = options["n_splits"]
    softcap, window = options["softcap"], options["window"]
    return ops.decode_attention(
        q,
        k_cache,
        v_cache,
        arrays["lengths"],
        arrays.get("block_table"),
        _scale(fn, options["scale"]),
        None if softcap is None else float(softcap),
        None if window is None else operator.index(window),
        None if n_splits is None else operator.index(n_splits),
        backend_choice(options),
    )


def _flex_attention(fn, arrays, options):
    _no_checkpoints(fn, options)
    q, k, v = (primal(arrays[n]) for n in ("q", "k", "v"))
    key, score_arrays, mods = _flex_key(fn, options, options["block_mask"])
    input_pos, input_pos_array = _positions(fn, options["input_pos"])
    o, _, _ = ops.flex_attention(
        q,
        k,
        v,
        score_arrays,
        key,
        _scale(fn, options["scale"]),
        input_pos,
        input_pos_array,
        backend_choice(options),
    )
    del mods  # held until the op ran
    return o


def _merge_attention_states(fn, arrays, options):
    states = (primal(arrays[n]) for n in ("o_a", "m_a", "l_a", "o_b", "m_b", "l_b"))
    return ops.merge_attention_states(*states, backend_choice(options))


#: Primitive -> its autograd front ``(fn, arrays, options) -> result``.
FRONTS = {
    **_declared.FRONTS,
    "attention": _attention,
    "attention_varlen": _attention_varlen,
    "decode_attention": _decode_attention,
    "flex_attention": _flex_attention,
    "flex_attention_varlen": _flex_attention_varlen,
    "merge_attention_states": _merge_attention_states,
}

# The core's autograd hook (xpkernels._autograd.record) finds the fronts here: it never imports
# this layer itself; xpkernels._torch_plugin loads this module by name on the first recorded call.
_autograd.register_recorders(FRONTS)
