"""Hugging Face ``transformers`` models on xpkernels' kernels.

Two entry points, neither needing adapter code in the model:

- :func:`register` files an attention function and a mask function under the
  name ``"xpkernels"`` with transformers' ``AttentionInterface`` and
  ``AttentionMaskInterface``, so ``from_pretrained(...,
  attn_implementation="xpkernels")``, ``model.set_attn_implementation("xpkernels")``
  or ``config._attn_implementation = "xpkernels"`` run xpkernels' attention.
- :func:`apply_xpkernels` also swaps the model's RMSNorm and LayerNorm modules
  for :mod:`xpkernels.torch.nn` ones that share their parameters (Gemma's
  ``1 + weight`` scale included), runs each gated MLP's ``act_fn(gate) * up``
  on :func:`xpkernels.swiglu` or :func:`xpkernels.geglu` (SiLU; GELU, tanh
  or exact), and reports what it replaced.

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

Importing this module does not import transformers; :func:`register` and
:func:`apply_xpkernels` do (``pip install 'xpkernels[transformers]'``).
"""

from __future__ import annotations

import logging
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from .. import mods as xm
from ..attention import attention
from ..attention_varlen import attention_varlen
from ..decode_attention import decode_attention
from ..flex_attention import flex_attention
from ..flex_attention_varlen import flex_attention_varlen
from ..geglu import geglu
from ..rms_norm import rms_norm
from ..swiglu import swiglu
from . import nn as xnn

__all__ = ["NAME", "KeyLayout", "Report", "apply_xpkernels", "attention_forward", "register"]

#: The name xpkernels is registered under in transformers' attention and mask interfaces.
NAME = "xpkernels"

_LOG = logging.getLogger("xpkernels")
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
    if kwargs.get("cu_seq_lens_q") is not None and layout.valid is None:
        cu = kwargs["cu_seq_lens_q"].to(torch.int32)
        longest = int(kwargs.get("max_length_q") or query.shape[2])
        return _packed_attention(
            query, key, value, layout.window, cu, longest, scaling, score
        ), None
    if layout.packed and kwargs.get("position_ids") is not None:
        cu, longest = _packed(kwargs["position_ids"], query.shape[0])
        return _packed_attention(
            query, key, value, layout.window, cu, longest, scaling, score
        ), None
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
        if layout.left_aligned:
            return attention(
                query, key, value, causal=layout.causal, scale=scale,
                q_lengths=lengths, k_lengths=lengths,
            )  # fmt: skip
        order = torch.argsort((~layout.valid).to(torch.uint8), dim=1, stable=True)
        q, k, v = (_compacted(x, order) for x in (query, key, value))
        o = attention(
            q, k, v, causal=layout.causal, scale=scale, q_lengths=lengths, k_lengths=lengths
        )
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


@dataclass
class Report:
    """What :func:`apply_xpkernels` replaced, by module name.

    Attributes
    ----------
    rms_norm, layer_norm : list of str
        Modules now :class:`xpkernels.torch.nn.RMSNorm` (with ``offset=1`` for
        Gemma's) and :class:`xpkernels.torch.nn.LayerNorm`.
    mlp : list of str
        Gated MLP modules whose forward now runs ``act_fn(gate) * up`` on
        :func:`xpkernels.swiglu` or :func:`xpkernels.geglu` (the module's
        ``xpkernels_activation`` says which: ``"silu"``, or geglu's
        ``approximate``, ``"tanh"`` or ``"none"``).
    skipped : list of (str, str)
        Norm-like and gated-MLP-like modules left alone, with the reason.
    attention : str or None
        The attention implementation set (``"xpkernels"``), or None.
    """

    rms_norm: list[str] = field(default_factory=list)
    layer_norm: list[str] = field(default_factory=list)
    mlp: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    attention: str | None = None

    def __str__(self) -> str:
        lines = [
            f"xpkernels: {len(self.rms_norm)} RMSNorm, {len(self.layer_norm)} LayerNorm replaced; "
            f"{len(self.mlp)} gated MLP fused; attention: {self.attention or 'unchanged'}"
        ]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _rms_norm_like(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, xnn.RMSNorm)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
    )


def _rms_norm_for(module: Any) -> tuple[nn.Module | None, str]:
    """The xpkernels RMSNorm computing what ``module`` computes (probed on its own weight), or why not."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        return None, "no float eps or variance_epsilon attribute"
    weight = module.weight
    probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    tolerance = 8 * torch.finfo(weight.dtype).eps
    with torch.no_grad():
        want = module(probe).float()
        for offset in (0.0, 1.0):
            got = rms_norm(probe, weight, eps=eps, offset=offset).float()
            if bool(((got - want).abs() <= tolerance * (1 + want.abs())).all()):
                factory = {"eps": eps, "device": weight.device, "dtype": weight.dtype}
                new = xnn.RMSNorm(weight.shape[0], **factory, offset=offset)
                new.weight = weight
                return new, ""
    return None, "its output is not x / rms(x) * (weight + offset) for offset 0 or 1"


def _layer_norm_for(module: nn.LayerNorm) -> nn.Module:
    new = xnn.LayerNorm(
        module.normalized_shape,
        eps=module.eps,
        elementwise_affine=module.elementwise_affine,
        bias=module.bias is not None,
    )
    new.weight, new.bias = module.weight, module.bias
    return new


#: The config activations a gated MLP runs fused, by xpkernels' form: ``"silu"``
#: (:func:`xpkernels.swiglu`; transformers' ``"swish"`` is the same function) or
#: :func:`xpkernels.geglu`'s ``approximate``.
_GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_GATED_PARTS = ("gate_proj", "up_proj", "down_proj")


def _glu(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` on one xpkernels kernel: SwiGLU for ``"silu"``, else GeGLU with
    ``approximate=activation``."""
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate=activation)


def _gated_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The forward :func:`apply_xpkernels` binds to a gated MLP:
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the product on :func:`_glu`."""
    return self.down_proj(_glu(self.xpkernels_activation, self.gate_proj(x), self.up_proj(x)))


def _fused(module: nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _gated_mlp_forward


def _gated_mlp_like(module: nn.Module) -> bool:
    return (
        all(isinstance(getattr(module, part, None), nn.Module) for part in _GATED_PARTS)
        and callable(getattr(module, "act_fn", None))
        and not _fused(module)
    )


def _config_activation(module: nn.Module, model: Any) -> str | None:
    """The activation string of the module's own ``config``, else of the model's text config:
    ``hidden_activation`` (Gemma 2 and later), else ``hidden_act``."""
    model_config = getattr(model, "config", None)
    text_config = getattr(model_config, "get_text_config", None)
    configs = (
        getattr(module, "config", None),
        model_config if text_config is None else text_config(),
    )
    for config in configs:
        for attribute in ("hidden_activation", "hidden_act"):
            value = getattr(config, attribute, None)
            if isinstance(value, str):
                return value
    return None


def _gated_structure(module: Any) -> str:
    """Why one call of ``module`` on a probe is not ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))``, compared exactly (each part called once, in train mode so dropout shows);
    "" when it is."""
    weight = getattr(module.gate_proj, "weight", None)
    width = getattr(module.gate_proj, "in_features", None)
    if (
        not isinstance(weight, torch.Tensor)
        or not weight.is_floating_point()
        or not isinstance(width, int)
    ):
        return "gate_proj has no in_features or no floating-point weight"
    probe = torch.randn(2, width, generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    calls: dict[str, list] = {part: [] for part in _GATED_PARTS}
    hooks = [
        getattr(module, part).register_forward_hook(
            lambda _, args, out, seen=calls[part]: seen.append((args, out))
        )
        for part in _GATED_PARTS
    ]
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.train()
        with torch.no_grad():
            out = module(probe)
            if any(len(seen) != 1 for seen in calls.values()):
                return "its forward does not call gate_proj, up_proj and down_proj once each"
            (gate_in, gate), (up_in, up), (down_in, down) = (seen[0] for seen in calls.values())
            exact = (
                all(len(args) == 1 and torch.equal(args[0], probe) for args in (gate_in, up_in))
                and len(down_in) == 1
                and torch.equal(down_in[0], module.act_fn(gate) * up)
                and isinstance(out, torch.Tensor)
                and torch.equal(out, down)
            )
    except Exception as error:  # another signature or return type: reported, not raised
        return f"a probe call failed ({type(error).__name__}: {error})"
    finally:
        for hook in hooks:
            hook.remove()
        for m, mode in modes:
            m.training = mode
    return "" if exact else "its output is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"


def _fuse_gated_mlp(module: Any, model: Any) -> str:
    """Bind :func:`_gated_mlp_forward` to ``module`` (its config names an activation xpkernels
    fuses, its ``act_fn`` computes it on a probe, its forward is the gated product); else why not."""
    activation = _config_activation(module, model)
    if activation is None:
        return "no hidden_activation or hidden_act in its config or the model's"
    fused = _GATED_ACTIVATIONS.get(activation)
    if fused is None:
        known = ", ".join(_GATED_ACTIVATIONS)
        return f"activation {activation!r} has no fused xpkernels kernel (fused: {known})"
    if "forward" in vars(module):
        return "its forward is already replaced on the instance (by a hook?)"
    why = _gated_structure(module)
    if why:
        return why
    device = module.gate_proj.weight.device
    gate = torch.linspace(-6.0, 6.0, 193, device=device)
    up = torch.linspace(2.0, 0.5, 193, device=device)
    with torch.no_grad():
        want = module.act_fn(gate).float() * up
        got = _glu(fused, gate, up)
    tolerance = 64 * torch.finfo(torch.float32).eps
    if not bool(((got - want).abs() <= tolerance * (1 + want.abs())).all()):
        return f"its act_fn does not compute the config's {activation!r} on a probe"
    module.xpkernels_activation = fused
    module.forward = types.MethodType(_gated_mlp_forward, module)
    return ""


def apply_xpkernels(
    model: Any,
    *,
    rms_norm: bool = True,
    layer_norm: bool = True,
    mlp: bool = True,
    attention: bool = True,
) -> Any:
    """Run a transformers model on xpkernels' kernels, in place.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model (``PreTrainedModel``); any module for the norms and MLPs.
    rms_norm : bool
        Replace every module whose class name ends in ``RMSNorm`` (one 1-D
        ``weight``, an ``eps`` or ``variance_epsilon``) by an xpkernels
        RMSNorm sharing that weight. The scale, ``weight`` or ``1 + weight``
        (Gemma), is found by running the module once on a probe; a module
        that is neither is left alone and reported.
    layer_norm : bool
        Replace every ``torch.nn.LayerNorm`` by
        :class:`xpkernels.torch.nn.LayerNorm` sharing its parameters.
    mlp : bool
        Run each gated MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` on one
        xpkernels kernel: :func:`xpkernels.swiglu` for ``"silu"`` (or its
        alias ``"swish"``: Llama, Qwen2/3, Mistral), :func:`xpkernels.geglu`
        with ``approximate="tanh"`` for ``"gelu_pytorch_tanh"`` (Gemma) and
        ``approximate="none"`` for ``"gelu"``. A gated MLP is any module with
        ``gate_proj``, ``up_proj`` and ``down_proj`` submodules and an
        ``act_fn``, whatever its class; its activation is the string its own
        ``config`` (else the model's text config) names in
        ``hidden_activation``, else ``hidden_act``. Two probes confirm it
        first: one call of the module (train mode, no grad) is exactly
        ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, and ``act_fn``
        computes that activation (to 64 float32 eps). Only the instance's
        ``forward`` is then replaced (its ``xpkernels_activation`` names the
        form): class, submodules, weights and ``state_dict`` keys stay, and
        ``torch.compile`` traces the kernel as one op. Another activation or
        structure, or a ``forward`` already replaced on the instance (a
        hook), leaves the module as it is, reported.
    attention : bool
        :func:`register` and set the model's attention implementation to
        ``"xpkernels"``.

    Returns
    -------
    torch.nn.Module
        ``model`` itself; ``model.xpkernels_report`` holds the :class:`Report`
        (also logged at INFO on the ``"xpkernels"`` logger).
    """
    report = Report()
    for name, module in list(model.named_modules()):
        if mlp and _gated_mlp_like(module):
            why = _fuse_gated_mlp(module, model)
            if why:
                report.skipped.append((name, why))
            else:
                report.mlp.append(name)
            continue
        if rms_norm and _rms_norm_like(module):
            new, why = _rms_norm_for(module)
        elif layer_norm and type(module) is nn.LayerNorm:
            new, why = _layer_norm_for(module), ""
        else:
            continue
        if new is None:
            report.skipped.append((name, why))
            continue
        new.train(module.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        (report.layer_norm if isinstance(new, xnn.LayerNorm) else report.rms_norm).append(name)
    if attention:
        register()
        _constant_mod("causal")
        config = model.config.get_text_config()
        window, cap = (
            getattr(config, a, None) for a in ("sliding_window", "attn_logit_softcapping")
        )
        if isinstance(window, int) and window > 0:
            _constant_mod("window", window)
        if cap:
            _constant_mod("softcap", float(cap))
        set_implementation = getattr(model, "set_attn_implementation", None)
        if set_implementation is not None:
            set_implementation(NAME)
        else:
            model.config._attn_implementation = NAME
        report.attention = NAME
    model.xpkernels_report = report
    _LOG.info("%s", report)
    return model
