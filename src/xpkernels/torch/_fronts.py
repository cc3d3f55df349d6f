"""The allocating fronts on torch tensors that need gradients: calls of the ``xpkernels`` ops.

:func:`xpkernels._autograd.record` hands a call here when autograd must see
it (or ``torch.compile`` traces it). Each function checks the options a
schema cannot check for itself, fixes the backend choice now (so the
backward, which autograd may run on another thread, uses the forward's
backend) and calls the functional op; the op's implementation runs the
front's full validation before it writes anything.
"""

from __future__ import annotations

import operator

import torch

from .. import _checks as check
from ..buffers import primal
from ..registry import _explicit_choice
from . import _flex
from ._flex_varlen import front as _flex_attention_varlen
from ._varlen import front as _attention_varlen

__all__ = ["FRONTS"]

ops = torch.ops.xpkernels


@torch._dynamo.assume_constant_result
def _traced_choice(backend: str | None) -> str | None:
    return _explicit_choice(backend)[0]


def _backend(options) -> str | None:
    """The explicit backend choice in force for this call (keyword, use_backend, env), or None.

    Under ``torch.compile`` the choice in force when the graph is traced is
    baked into it (a context variable cannot be read inside a graph).
    """
    if torch.compiler.is_compiling():
        return _traced_choice(options["backend"])
    return _explicit_choice(options["backend"])[0]


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


def _rms_norm(fn, arrays, options):
    _no_checkpoints(fn, options)
    eps = check.positive_finite(fn, "eps", options["eps"])
    offset = check.finite(fn, "offset", options["offset"])
    y, _ = ops.rms_norm(primal(arrays["x"]), primal(arrays["w"]), eps, offset, _backend(options))
    return y


def _layer_norm(fn, arrays, options):
    _no_checkpoints(fn, options)
    eps = check.positive_finite(fn, "eps", options["eps"])
    x, w, b = (primal(arrays[n]) for n in ("x", "w", "b"))
    y, _, _ = ops.layer_norm(x, w, b, eps, _backend(options))
    return y


def _softmax(fn, arrays, options):
    return ops.softmax(primal(arrays["x"]), _backend(options))


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
        _backend(options),
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
        _backend(options),
    )


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
        _backend(options),
    )
    del mods  # held until the op ran
    return o


def _merge_attention_states(fn, arrays, options):
    states = (primal(arrays[n]) for n in ("o_a", "m_a", "l_a", "o_b", "m_b", "l_b"))
    return ops.merge_attention_states(*states, _backend(options))


#: Primitive -> its autograd front ``(fn, arrays, options) -> result``.
FRONTS = {
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "softmax": _softmax,
    "attention": _attention,
    "attention_varlen": _attention_varlen,
    "decode_attention": _decode_attention,
    "flex_attention": _flex_attention,
    "flex_attention_varlen": _flex_attention_varlen,
    "merge_attention_states": _merge_attention_states,
}
