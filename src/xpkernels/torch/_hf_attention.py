"""transformers' attention on xpkernels: the attention and mask functions :func:`register` files.

How each call maps to xpkernels (the mask function reads transformers' mask
recipe once per forward and hands every layer a :class:`KeyLayout`; no
``Sq x Sk`` mask is built on any of these paths):

=========================================  ==================================================
call                                       xpkernels
=========================================  ==================================================
no padding (training, prefill)             ``attention(causal=True, input_pos=Sk - Sq)``
right padding, ``Sq == Sk``                ``attention(q_lengths=n, k_lengths=n)``
left padding or any 2-D padding mask,      real tokens gathered to the front of each row (in
``Sq == Sk``                               order), ``attention(q_lengths=n, k_lengths=n)``,
                                           gathered back
decode step (one query, no padding)        ``decode_attention`` (``softcap``, ``window``)
sliding window, softcap                    ``flex_attention``: ``SlidingWindowMask(w - 1)``,
                                           ``SoftCapScore(cap)``
padding with a window or softcap, or a     ``flex_attention``, a mask mod keeping each batch's
padded decode step                         real keys (its run, or the ``(B, Sk)`` key mask)
packed sequences (``position_ids``         ``attention_varlen`` (``flex_attention_varlen``
restarts, ``cu_seq_lens_*`` kwargs)        with a window or softcap)
=========================================  ==================================================

Queries sit at the last ``Sq`` key positions (``input_pos = Sk - Sq``), as in
transformers' dynamic caches. What this cannot express falls back to
transformers' SDPA attention, with a warning once per reason: custom mask
recipes (``or_mask_function``, chunked or block masks), caches whose queries do
not sit at the end of the keys (static caches), 4-D masks passed in by the
caller, ``position_bias`` and attention sinks. Dropout is refused with a
ValueError.

Importing this module does not import transformers; :func:`register` does.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from .. import mods as xm
from ..attention import attention
from ..attention_varlen import attention_varlen
from ..decode_attention import decode_attention
from ..flex_attention import flex_attention
from ..flex_attention_varlen import flex_attention_varlen

__all__ = ["NAME", "KeyLayout", "attention_forward", "constant_mods", "mask_function", "register"]

#: The name xpkernels is registered under in transformers' attention and mask interfaces.
NAME = "xpkernels"

_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"xpkernels attention: {reason}; this call runs transformers' SDPA attention",
            stacklevel=3,
        )


class KeyLayout(NamedTuple):
    """The mask of one layer type, as the ``"xpkernels"`` mask function hands it to every layer.

    Built once per forward from transformers' mask recipe (its pattern,
    the 2-D padding mask and the cache's offsets); every field is read by
    :func:`attention_forward` without touching device values on the host.

    Attributes
    ----------
    causal : bool
        Keys at or before the query only.
    window : int or None
        transformers' ``sliding_window``: a query at ``p`` keeps keys
        ``p - window < kv <= p``. None: no window.
    valid : torch.Tensor or None
        ``(B, Sk)`` bool, True for a real (unpadded) key. None: no padding.
    start, stop : torch.Tensor or None
        ``(B,)`` int32: batch ``b``'s real keys are ``[start[b], stop[b])``,
        when every row's real keys form one run (checked on the host; None
        under tracing or with holes).
    left_aligned : bool
        Every ``start`` is 0 (right padding only).
    packed : bool
        transformers split the batch into packed sequences (runs of
        ``position_ids`` increasing by one); the layers read them from their
        ``position_ids``.
    """

    causal: bool
    window: int | None
    valid: torch.Tensor | None = None
    start: torch.Tensor | None = None
    stop: torch.Tensor | None = None
    left_aligned: bool = False
    packed: bool = False


def _recipe(
    recipe, attention_mask, local_size, use_vmap, allow_skip, config, aligned_at_zero
) -> KeyLayout | None:
    """The :class:`KeyLayout` pattern of transformers' mask recipe, or None when xpkernels
    cannot express it.

    Read from the recipe's identity and code object and from the arguments transformers'
    ``create_*_mask`` pass with it (a closure's captured values cannot be read under
    ``torch.compile``): its causal and bidirectional functions; ``and_masks`` built by its
    sliding-window recipe (``local_size`` is the config's ``sliding_window``) or by its
    packed-sequence wrapper (which turns ``allow_is_causal_skip`` off, with no padding mask,
    on a call without a cache). Added ``or``/``and`` mask functions (``use_vmap``), chunked
    (``local_size`` is not the sliding window) and block masks are None.
    """
    from transformers import masking_utils as mu

    if recipe is mu.causal_mask_function and local_size is None:
        return KeyLayout(True, None)
    if recipe is mu.bidirectional_mask_function and local_size is None:
        return KeyLayout(False, None)
    if getattr(recipe, "__code__", None) is not mu.and_masks(mu.causal_mask_function).__code__:
        return None
    if use_vmap or getattr(config, "attention_chunk_size", None) is not None:
        return None
    if local_size is not None and local_size != getattr(config, "sliding_window", None):
        return None
    packed = not allow_skip and attention_mask is None and aligned_at_zero
    if local_size is None and not packed:
        return None
    return KeyLayout(True, local_size, packed=packed)


def _tracing(t: torch.Tensor) -> bool:
    from transformers.utils.import_utils import is_tracing

    return bool(is_tracing(t))


def _packed(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """Prefix sums over the ``B * S`` tokens of the runs of ``position_ids`` increasing by one
    (transformers' packed sequences), and a bound on the longest run.

    Eagerly: one entry per sequence and the longest length (read on the host). Under tracing,
    where no value may be read: ``B * S + 1`` entries (the starts, sorted, then empty
    sequences at the end) and the row length ``S`` as the bound.
    """
    positions = position_ids.expand(batch, -1)
    seq = positions.shape[1]
    first = torch.ones_like(positions[:, :1], dtype=torch.bool)
    starts = torch.cat([first, positions[:, 1:] - positions[:, :-1] != 1], dim=1).reshape(-1)
    tokens = torch.arange(batch * seq + 1, device=positions.device)
    if _tracing(positions):
        at = torch.where(starts, tokens[:-1], batch * seq).sort().values
        return torch.cat([at, tokens[-1:]]).to(torch.int32), seq
    bounds = torch.cat([starts.nonzero().reshape(-1), tokens[-1:]])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())


def _key_runs(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(start, stop, left_aligned)`` when each row's real keys form one run, else None (host check)."""
    starts = valid & ~torch.nn.functional.pad(valid[:, :-1], (1, 0))
    if bool((starts.sum(dim=1) > 1).any()):
        return None
    start = valid.int().argmax(dim=1)
    stop = start + valid.sum(dim=1)
    return start.to(torch.int32), stop.to(torch.int32), not bool(start.any())


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> KeyLayout | torch.Tensor | None:
    """transformers' mask interface for ``"xpkernels"``: a :class:`KeyLayout`, or a 4-D mask for SDPA.

    Parameters follow transformers' ``sdpa_mask``. A recipe xpkernels cannot
    express, or a cache whose queries are not the last ``q_length`` keys,
    gets ``sdpa_mask``'s 4-D boolean mask (warned once), which
    :func:`attention_forward` hands to SDPA.
    """
    from transformers import masking_utils as mu

    recipe = mu.causal_mask_function if mask_function is None else mask_function
    tensor_offset = isinstance(q_offset, torch.Tensor)
    aligned = not tensor_offset and q_offset - kv_offset == kv_length - q_length
    layout = _recipe(
        recipe,
        attention_mask,
        kwargs.get("local_size"),
        kwargs.get("use_vmap", False),
        kwargs.get("allow_is_causal_skip", True),
        kwargs.get("config"),
        aligned and q_length == kv_length and not q_offset,
    )
    if layout is None or not aligned:
        _warn_once(
            "a mask recipe xpkernels cannot express (a custom, chunked or block mask)"
            if layout is None
            else "queries that are not the last keys of the cache (a static cache)"
        )
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return mu.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=recipe,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is None:
        return layout
    padded = cast(torch.Tensor, mu.prepare_padding_mask(attention_mask, kv_length, kv_offset))
    valid = padded[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if _tracing(valid):
        return layout._replace(valid=valid)
    if bool(valid.all()):
        return layout
    runs = _key_runs(valid)
    if runs is None:
        return layout._replace(valid=valid)
    start, stop, left_aligned = runs
    return layout._replace(valid=valid, start=start, stop=stop, left_aligned=left_aligned)


def _binds(window: int | None, n_kv: int) -> bool:
    """Whether transformers' ``sliding_window`` hides any key of ``n_kv`` from a query."""
    return window is not None and n_kv > window


_CONSTANT_MODS: dict[tuple[str, float], Any] = {}


def _constant_mod(kind: str, value: float = 0.0):
    """The shared ``"causal"`` mask, ``("window", w)`` mask (causal, transformers' window
    ``w``) or ``("softcap", cap)`` score mod, built once: under ``torch.compile`` a mod built
    before tracing is a constant of the graph (:func:`apply_xpkernels` builds the model's)."""
    mod = _CONSTANT_MODS.get((kind, value))
    return _build_constant_mod(kind, value) if mod is None else mod


@torch.compiler.disable
def _build_constant_mod(kind: str, value: float):
    mod: Any
    if kind == "causal":
        mod = xm.CausalMask()
    elif kind == "window":
        mod = xm.CausalMask() & xm.SlidingWindowMask(int(value) - 1)
    else:
        mod = xm.SoftCapScore(value)
    _CONSTANT_MODS[kind, value] = mod
    return mod


def _base_mask(layout: KeyLayout, n_kv: int):
    """The layout's pattern over ``n_kv`` keys as a mask mod; None when ``causal`` alone says it."""
    if layout.window is None or not _binds(layout.window, n_kv):
        return None
    if not layout.causal:
        raise ValueError(
            "xpkernels attention: a bidirectional sliding window is not supported; pass the "
            "mask transformers builds for attn_implementation='xpkernels'"
        )
    return _constant_mod("window", layout.window)


def _unsupported(attention_mask, kwargs) -> str | None:
    if attention_mask is not None and not isinstance(attention_mask, KeyLayout):
        return "a mask that is not xpkernels' (a 4-D mask, or a custom mask recipe)"
    if kwargs.get("position_bias") is not None:
        return "a position_bias"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if isinstance(kwargs.get("cache"), PagedAttentionCache):
        return "a paged cache (continuous batching)"
    return None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: KeyLayout | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``"xpkernels"``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (its ``is_causal`` is read when no
        :class:`KeyLayout` is given).
    query : torch.Tensor
        ``(B, H, Sq, D)``.
    key, value : torch.Tensor
        ``(B, Hkv, Sk, D)`` and ``(B, Hkv, Sk, Dv)``, ``H % Hkv == 0``; the
        queries are the last ``Sq`` positions of the keys.
    attention_mask : KeyLayout, torch.Tensor or None
        From the ``"xpkernels"`` mask function; a tensor (a 4-D mask) goes to
        SDPA. None: ``module.is_causal`` (or ``kwargs["is_causal"]``) and
        ``sliding_window`` decide.
    dropout : float
        Must be 0: attention dropout is refused with a ValueError.
    scaling : float, optional
        Score scale (None: ``1 / sqrt(D)``).
    sliding_window : int, optional
        Used without a KeyLayout: keys ``p - sliding_window < kv <= p``.
    softcap : float, optional
        Scores become ``softcap * tanh(s / softcap)`` (Gemma 2).
    **kwargs
        ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``
        (padding-free training) select packed attention; others are ignored.

    Returns
    -------
    (torch.Tensor, None)
        The output ``(B, Sq, H, Dv)`` and no attention weights.
    """
    if dropout:
        raise ValueError(
            f"xpkernels attention: attention dropout {dropout} is not supported; set the "
            "config's attention_dropout to 0.0, or use another attn_implementation to train with it"
        )
    reason = _unsupported(attention_mask, kwargs)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _warn_once(reason)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            cast(Any, attention_mask),
            dropout=dropout,
            scaling=scaling,
            softcap=softcap,
            **kwargs,
        )
    if isinstance(attention_mask, KeyLayout):
        layout = attention_mask
    else:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        layout = KeyLayout(bool(causal), sliding_window)
    score = None if softcap is None else _constant_mod("softcap", float(softcap))
    packed = None
    if kwargs.get("cu_seq_lens_q") is not None and layout.valid is None:
        cu = kwargs["cu_seq_lens_q"].to(torch.int32)
        packed = cu, int(kwargs.get("max_length_q") or query.shape[2])
    elif layout.packed and kwargs.get("position_ids") is not None:
        packed = _packed(kwargs["position_ids"], query.shape[0])
    if packed is not None:
        return _packed_attention(query, key, value, layout.window, *packed, scaling, score), None
    o = _padded_attention(query, key, value, layout, scaling, score)
    return o.transpose(1, 2), None


def _packed_attention(query, key, value, window, cu, longest, scale, score):
    """Packed sequences: ``(B, H, S, D)`` tokens flattened to ``(B * S, H, D)``, split by the
    prefix sums ``cu``, none longer than ``longest``."""
    batch, heads, seq, _ = query.shape

    def tokens(x):
        return x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3])

    q, k, v = tokens(query), tokens(key), tokens(value)
    mask = _base_mask(KeyLayout(True, window), longest)
    if score is None and mask is None:
        o = attention_varlen(
            q, k, v, cu, cu, causal=True, scale=scale, max_seqlen_q=longest, max_seqlen_k=longest
        )
    else:
        o = flex_attention_varlen(
            q,
            k,
            v,
            cu,
            cu,
            score_mod=score,
            mask_mod=_constant_mod("causal") if mask is None else mask,
            scale=scale,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
        )
    return o.reshape(batch, seq, heads, o.shape[-1])


def _compacted(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows of ``x (B, H, S, D)`` reordered per batch: row ``i`` of batch ``b`` is ``order[b, i]``."""
    batch, heads, seq, dim = x.shape
    return x.gather(2, order[:, None, :, None].expand(batch, heads, seq, dim))


def _padded_attention(query, key, value, layout: KeyLayout, scale, score):
    """``(B, H, Sq, Dv)`` attention of the last ``Sq`` positions over the ``Sk`` keys."""
    batch, _, n_q, _ = query.shape
    n_kv = key.shape[2]
    if layout.valid is not None and tuple(layout.valid.shape) != (batch, n_kv):
        raise ValueError(
            f"xpkernels attention: the mask holds {tuple(layout.valid.shape)} keys but the layer "
            f"attends over {(batch, n_kv)}; the mask and the key cache disagree"
        )
    base = _base_mask(layout, n_kv)
    plain = score is None and base is None
    if layout.valid is None:
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if n_q == 1 and layout.causal and not grads:
            lengths = torch.full((batch,), n_kv, dtype=torch.int32, device=query.device)
            o = decode_attention(
                query[:, :, 0],
                key,
                value,
                lengths,
                scale=scale,
                softcap=None if score is None else score.cap,
                window=layout.window,
            )
            return o[:, :, None]
        if plain:
            return attention(
                query, key, value, causal=layout.causal, scale=scale, input_pos=n_kv - n_q
            )
        return flex_attention(
            query,
            key,
            value,
            score_mod=score,
            mask_mod=_constant_mod("causal") if base is None and layout.causal else base,
            scale=scale,
            input_pos=n_kv - n_q,
        )
    if plain and n_q == n_kv:
        lengths = layout.valid.sum(dim=1, dtype=torch.int32)

        def padded(q, k, v):
            return attention(
                q, k, v, causal=layout.causal, scale=scale, q_lengths=lengths, k_lengths=lengths
            )

        if layout.left_aligned:
            return padded(query, key, value)
        order = torch.argsort((~layout.valid).to(torch.uint8), dim=1, stable=True)
        o = padded(*(_compacted(x, order) for x in (query, key, value)))
        return _compacted(o, torch.argsort(order, dim=1))
    return _flex_over_real_keys(query, key, value, layout, base, score, scale)


@torch.compiler.disable
def _flex_over_real_keys(query, key, value, layout: KeyLayout, base, score, scale):
    """``flex_attention`` keeping only real keys: the run ``[start[b], stop[b])`` when the mask
    function found one per batch, else ``valid[b, kv_idx]``. Its mask mod captures this call's
    arrays, so it is built here, outside any ``torch.compile`` graph."""
    if layout.start is None:
        keys = xm.MaskMod(
            lambda b, h, q_idx, kv_idx, *, valid: valid[b, kv_idx] != 0,
            valid=cast(torch.Tensor, layout.valid).to(torch.int32),
        )
    else:
        keys = xm.MaskMod(
            lambda b, h, q_idx, kv_idx, *, start, stop: xm.logical_and(
                start[b] <= kv_idx, kv_idx < stop[b]
            ),
            start=layout.start,
            stop=layout.stop,
        )
    if base is not None:
        keys = base & keys
    elif layout.causal:
        keys = xm.CausalMask() & keys
    n_kv, n_q = key.shape[2], query.shape[2]
    return flex_attention(
        query, key, value, score_mod=score, mask_mod=keys, scale=scale, input_pos=n_kv - n_q
    )


def constant_mods(config) -> None:
    """Build a model's constant mods once, before any forward (and outside any compiled
    region): the causal mask, and the sliding window and softcap its ``config`` names."""
    _constant_mod("causal")
    window, cap = (getattr(config, a, None) for a in ("sliding_window", "attn_logit_softcapping"))
    if isinstance(window, int) and window > 0:
        _constant_mod("window", window)
    if cap:
        _constant_mod("softcap", float(cap))


def register() -> None:
    """Register ``"xpkernels"`` with transformers' attention and mask interfaces.

    Afterwards ``attn_implementation="xpkernels"`` (``from_pretrained``,
    ``set_attn_implementation``, ``config._attn_implementation``) runs
    :func:`attention_forward` with masks from :func:`mask_function`.
    Idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
