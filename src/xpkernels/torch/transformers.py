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
  or exact), rotates each attention module's queries and keys on
  :func:`xpkernels.rope` (``rope=True``), and reports what it replaced.

How the attention maps each call to xpkernels: :mod:`._hf_attention`; how
RoPE is swapped in: :mod:`._hf_rope`.

Importing this module does not import transformers; :func:`register` and
:func:`apply_xpkernels` do (``pip install 'xpkernels[transformers]'``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..geglu import geglu
from ..rms_norm import rms_norm
from ..swiglu import swiglu
from . import nn as xnn
from ._hf_attention import (
    NAME,
    KeyLayout,
    attention_forward,
    constant_mods,
    mask_function,
    register,
)
from ._hf_loss import swap_loss
from ._hf_rope import attention_like, rope_attention

__all__ = [
    "NAME",
    "KeyLayout",
    "Report",
    "apply_xpkernels",
    "attention_forward",
    "mask_function",
    "register",
]

_LOG = logging.getLogger("xpkernels")


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
    rope : list of str
        Attention modules whose forward now rotates queries and keys on
        :func:`xpkernels.rope` (their ``apply_rotary_pos_emb`` calls).
    loss : str or None
        ``"cross_entropy"`` (the model's ``loss_function`` on
        :func:`xpkernels.cross_entropy`), ``"linear_cross_entropy"`` (also
        its forward: the loss from the hidden states, no logits), or None.
    skipped : list of (str, str)
        Norm-like, gated-MLP-like and attention modules (class name ending in
        ``Attention``) left alone, with the reason.
    attention : str or None
        The attention implementation set (``"xpkernels"``), or None.
    """

    rms_norm: list[str] = field(default_factory=list)
    layer_norm: list[str] = field(default_factory=list)
    mlp: list[str] = field(default_factory=list)
    rope: list[str] = field(default_factory=list)
    loss: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    attention: str | None = None

    def __str__(self) -> str:
        lines = [
            f"xpkernels: {len(self.rms_norm)} RMSNorm, {len(self.layer_norm)} LayerNorm replaced; "
            f"{len(self.mlp)} gated MLP fused; RoPE on xpkernels in {len(self.rope)} attention "
            f"modules; loss: {self.loss or 'unchanged'}; attention: "
            f"{self.attention or 'unchanged'}"
        ]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)

    def _add(self, done: list[str], name: str, why: str) -> None:
        """``name`` to ``done``, or with ``why`` to ``skipped`` when there is a reason."""
        if why:
            self.skipped.append((name, why))
        else:
            done.append(name)


def _rms_norm_like(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, xnn.RMSNorm)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
    )


def _probed(module: Any) -> Any:
    """``module`` to run probes on; where a parameter or buffer of it is on the meta device (a
    model built there, loaded later), a copy on the CPU holding seeded random values in the
    same dtypes: no kernel runs on a meta tensor. The copy's linear layers are narrowed, each
    extent mapped to a small one (equal extents stay equal), so that probing a large model's
    MLP allocates kilobytes, not its weights."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    if not any(t.is_meta for t in tensors):
        return module
    probed = copy.deepcopy(module)
    linears = [(n, m) for n, m in probed.named_modules() if isinstance(m, nn.Linear) and n]
    extents = sorted({e for _, m in linears for e in (m.in_features, m.out_features)})
    small = {extent: 8 * (k + 1) for k, extent in enumerate(extents)}
    for name, linear in linears:
        parent, _, leaf = name.rpartition(".")
        narrow = nn.Linear(
            small[linear.in_features],
            small[linear.out_features],
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        setattr(probed.get_submodule(parent), leaf, narrow)
    probed = probed.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in itertools.chain(probed.parameters(), probed.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=generator))
            else:
                t.zero_()
    return probed


def _rms_norm_for(module: Any) -> tuple[nn.Module | None, str]:
    """The xpkernels RMSNorm computing what ``module`` computes (probed on its own weight, or on
    random ones where it is on the meta device), or why not."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        return None, "no float eps or variance_epsilon attribute"
    weight = module.weight
    probed = _probed(module)
    probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=probed.weight.device, dtype=weight.dtype)
    tolerance = 8 * torch.finfo(weight.dtype).eps
    with torch.no_grad():
        want = probed(probe).float()
        for offset in (0.0, 1.0):
            got = rms_norm(probe, probed.weight, eps=eps, offset=offset).float()
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
    return getattr(vars(module).get("forward"), "func", None) is _gated_mlp_forward


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
    fuses, its ``act_fn`` computes it on a probe, its forward is the gated product, checked on a
    CPU copy where it is on the meta device); else why not."""
    activation = _config_activation(module, model)
    if activation is None:
        return "no hidden_activation or hidden_act in its config or the model's"
    fused = _GATED_ACTIVATIONS.get(activation)
    if fused is None:
        known = ", ".join(_GATED_ACTIVATIONS)
        return f"activation {activation!r} has no fused xpkernels kernel (fused: {known})"
    if "forward" in vars(module):
        return "its forward is already replaced on the instance (by a hook?)"
    probed = _probed(module)
    why = _gated_structure(probed)
    if why:
        return why
    device = probed.gate_proj.weight.device
    gate = torch.linspace(-6.0, 6.0, 193, device=device)
    up = torch.linspace(2.0, 0.5, 193, device=device)
    with torch.no_grad():
        want = probed.act_fn(gate).float() * up
        got = _glu(fused, gate, up)
    tolerance = 64 * torch.finfo(torch.float32).eps
    if not bool(((got - want).abs() <= tolerance * (1 + want.abs())).all()):
        return f"its act_fn does not compute the config's {activation!r} on a probe"
    module.xpkernels_activation = fused
    module.forward = functools.partial(_gated_mlp_forward, module)
    return ""


def apply_xpkernels(
    model: Any,
    *,
    rms_norm: bool = True,
    layer_norm: bool = True,
    mlp: bool = True,
    attention: bool = True,
    rope: bool = True,
    loss: bool = True,
    logits: bool = True,
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
    rope : bool
        Rotate each attention module's queries and keys on
        :func:`xpkernels.rope`. The attention forwards of transformers' RoPE
        families (Llama, Qwen2/3, Mistral, Gemma 2/3, ...) call their modeling
        module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` by
        its global name. Per instance, like ``mlp``: each module whose class
        name ends in ``Attention`` and whose class ``forward`` loads that
        global gets, as its own ``forward``, a copy of the class's function
        (same bytecode, closure, defaults and live module globals) reading
        the name ``_xpkernels_apply_rotary_pos_emb`` instead; that replacement
        is added to the modeling module beside the original (once per module,
        idempotently), and nothing of transformers is rebound: models not
        passed here, in the same process, keep transformers' own function
        (unlike Liger-Kernel's process-wide ``apply_rotary_pos_emb``
        replacement). The replacement calls ``xpkernels.rope(q, k, cos[...,
        :R // 2], sin[..., :R // 2])`` (views) on transformers' ``(B, S, R)``
        tables, assuming what transformers' rotary embeddings build: the
        frequencies repeated over both halves (``cat((freqs, freqs))``), so the
        first half holds each pair's angle. Any call it cannot express exactly
        runs the original function: ``unsqueeze_dim != 1`` (``(B, S, H, D)``
        layouts), q/k not 4-D or tables not ``(B or 1, S, R)`` with ``R`` even
        and ``R == D``, mixed dtypes or devices, a last axis not contiguous,
        tensor subclasses, tables requiring grad, and ``R < D`` unless the
        original rotates just the first ``R`` features. Only shapes, dtypes
        and strides are read (no device value), so ``torch.compile`` traces it
        without a graph break; xpkernels' backward rotates the gradients back
        (the tables get none). The original must first match xpkernels on
        float64 probes (the half rotation ``q * cos + rotate_half(q) * sin``);
        a family whose ``apply_rotary_pos_emb`` differs (interleaved pairs,
        another signature), an attention forward calling no such global (no
        RoPE, or RoPE under another name) or one already replaced on the
        instance is left alone and reported under ``skipped``.
    loss : bool
        A model whose loss is transformers' ``ForCausalLMLoss`` (the causal-LM
        families) computes it on :func:`xpkernels.cross_entropy`
        (``model.loss_function``, this instance only): same label shift,
        ``ignore_index``, ``num_items_in_batch`` and ``shift_labels``, a
        float32 loss, without transformers' float32 copy of the logits.
    logits : bool
        With ``loss``, False makes training logits-free: a forward given
        ``labels`` computes the loss from the last hidden states and the LM
        head on :func:`xpkernels.linear_cross_entropy`, chunk by chunk, so
        the ``N x V`` logits never exist in the forward or the backward, and
        returns ``logits=None``. What the class's forward does to the LM
        head's output is read from its source and kept exactly: a scale
        (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
        ``lm_head_multiplier``) scales the hidden states and the head's bias
        instead, a final softcap (Gemma 2/3's ``final_logit_softcapping``) is
        ``linear_cross_entropy``'s ``softcap``. Calls without labels
        (``generate``, evaluation) return logits as before. The instance's
        ``forward`` is replaced; a model whose forward does not call
        ``self.model``, ``self.lm_head`` and ``self.loss_function``, or runs
        any other statement between its base model and its loss (MiniCPM3's
        scaled hidden states, Chameleon's masked image tokens, ...), keeps
        its forward (reported).

    Returns
    -------
    torch.nn.Module
        ``model`` itself; ``model.xpkernels_report`` holds the :class:`Report`
        (also logged at INFO on the ``"xpkernels"`` logger).

    Notes
    -----
    A model built on the meta device (to be loaded later) is swapped alike:
    the probes run on CPU copies of its modules holding random values, no
    kernel on a meta tensor, and the swapped modules keep its parameters for
    ``to_empty`` and ``load_state_dict`` (``assign=True`` too). The replaced
    forwards are ``functools.partial`` objects of importable functions, so a
    swapped model pickles (``torch.save(model)``, ``copy.deepcopy``) and
    loads running xpkernels' code, in a new process too.
    """
    report = Report()
    for name, module in list(model.named_modules()):
        if mlp and _gated_mlp_like(module):
            report._add(report.mlp, name, _fuse_gated_mlp(module, model))
            continue
        if rms_norm and _rms_norm_like(module):
            new, why = _rms_norm_for(module)
            done = report.rms_norm
        elif layer_norm and type(module) is nn.LayerNorm:
            new, why, done = _layer_norm_for(module), "", report.layer_norm
        else:
            continue
        if new is not None:
            new.train(module.training)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        report._add(done, name, why)
    if rope:
        refused: dict[int, str] = {}
        for name, module in model.named_modules():
            if attention_like(module):
                report._add(report.rope, name, rope_attention(module, refused))
    if loss:
        report.loss, why = swap_loss(model, linear=not logits)
        if why:
            report.skipped.append(("loss", why))
    if attention:
        register()
        constant_mods(model.config.get_text_config())
        set_implementation = getattr(model, "set_attn_implementation", None)
        if set_implementation is not None:
            set_implementation(NAME)
        else:
            model.config._attn_implementation = NAME
        report.attention = NAME
    model.xpkernels_report = report
    _LOG.info("%s", report)
    return model
