"""``torch.nn`` modules over xpkernels' kernels.

- :class:`RMSNorm` and :class:`LayerNorm` take the constructor arguments of
  ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` and keep the same
  parameters under the same ``state_dict`` keys, so either loads the
  other's ``state_dict``.
- :class:`Attention` is multi-head self-attention over q/k/v/o projections
  with grouped-query heads, causal masking and optional flex score and mask
  mods; ``nn.Parameter`` arrays a score mod captures are registered on the
  module, so optimisers and ``state_dict`` see them.

Every forward calls the allocating fronts, so autograd runs xpkernels' own
backward kernels (on whichever backend routing chooses).
"""

from __future__ import annotations

import numbers
import re

import torch
from torch import nn

from .. import _checks as check
from ..attention import attention
from ..flex_attention import flex_attention
from ..layer_norm import layer_norm
from ..mods import CausalMask, as_mask_mod, as_score_mod
from ..rms_norm import rms_norm

__all__ = ["RMSNorm", "LayerNorm", "Attention"]


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(n) for n in normalized_shape)


def _rows(module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(..., M)`` rows over the module's normalised trailing dims."""
    k = len(module.normalized_shape)
    if tuple(x.shape[x.dim() - k :]) != module.normalized_shape:
        raise ValueError(
            f"{type(module).__name__}: input must end with the normalized_shape "
            f"{module.normalized_shape}, got shape {tuple(x.shape)}"
        )
    return x if k == 1 else x.reshape(*x.shape[: x.dim() - k], -1)


def _flat(p):
    return None if p is None else p.reshape(-1)


class _Norm(nn.Module):
    """What RMSNorm and LayerNorm share: the trailing ``normalized_shape``, ``eps``, the
    affine parameters (``weight``, and ``bias`` unless ``bias`` is None) and the backend."""

    weight: nn.Parameter | None

    def __init__(self, normalized_shape, eps, elementwise_affine, device, dtype, backend, bias):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = None if eps is None else check.positive_finite(type(self).__name__, "eps", eps)
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        learnt = {"weight": True} if bias is None else {"weight": True, "bias": bias}
        for name, wanted in learnt.items():
            param = None
            if elementwise_affine and wanted:
                param = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            self.register_parameter(name, param)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, bias (LayerNorm's) to zeros."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        bias = getattr(self, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class RMSNorm(_Norm):
    """RMSNorm over the trailing ``normalized_shape`` dims: ``y = x / rms(x) * (weight + offset)``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing shape normalised together.
    eps : float, optional
        Added to the mean square; None (as in ``torch.nn.RMSNorm``) uses
        ``torch.finfo(x.dtype).eps``.
    elementwise_affine : bool
        Learn ``weight`` (ones at first); False: no parameter.
    device, dtype
        Of the parameter.
    offset : float
        Added to the weight (Gemma's ``1 + weight`` is ``offset=1``); it
        needs ``elementwise_affine``. Not a ``torch.nn.RMSNorm`` argument.
    backend : str, optional
        Explicit xpkernels backend (default: routing).

    Shapes
    ------
    input ``(..., *normalized_shape)``, output the same; ``weight`` has
    ``normalized_shape``.
    """

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        *,
        offset=0.0,
        backend=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, backend, None)
        self.offset = check.finite("RMSNorm", "offset", offset)
        if self.offset and not elementwise_affine:
            raise ValueError(
                f"RMSNorm: offset={offset!r} is added to the weight, so it needs "
                "elementwise_affine=True"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        weight = _flat(self.weight)
        y = rms_norm(_rows(self, x), weight, eps=eps, offset=self.offset, backend=self.backend)
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", offset={self.offset}" if self.offset else "")


class LayerNorm(_Norm):
    """LayerNorm over the trailing ``normalized_shape`` dims: ``y = (x - mean) / std * weight + bias``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing shape normalised together.
    eps : float
        Added to the variance.
    elementwise_affine : bool
        Learn ``weight`` (ones) and, with ``bias=True``, ``bias`` (zeros).
    bias : bool
        Learn a ``bias`` (only with ``elementwise_affine``).
    device, dtype
        Of the parameters.
    backend : str, optional
        Explicit xpkernels backend (default: routing).

    Shapes
    ------
    input ``(..., *normalized_shape)``, output the same; ``weight`` and
    ``bias`` have ``normalized_shape``.
    """

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
        *,
        backend=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, backend, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = layer_norm(
            _rows(self, x), _flat(self.weight), _flat(self.bias), eps=self.eps, backend=self.backend
        )
        return y.reshape(x.shape)


class Attention(nn.Module):
    """Multi-head self-attention: q/k/v projections, xpkernels attention, output projection.

    Parameters
    ----------
    embed_dim : int
        Model width ``E``.
    num_heads : int
        Query heads ``H``.
    num_kv_heads : int, optional
        Key/value heads ``Hkv`` (grouped-query attention); ``H % Hkv == 0``.
        None: ``H``.
    head_dim : int, optional
        Per-head width ``D``; None: ``E // H``.
    causal : bool
        Each position attends to itself and earlier positions only.
    bias : bool
        Biases in the four projections.
    score_mod : ScoreMod or callable, optional
        A flex score mod; float ``nn.Parameter`` arrays it captures are
        registered on the module (as ``score_mod_<field>``) and learn.
    mask_mod : MaskMod or callable, optional
        A flex mask mod, combined with ``causal`` (both must keep a key).
    device, dtype
        Of the parameters.
    backend : str, optional
        Explicit xpkernels backend.

    Shapes
    ------
    input ``(B, S, E)``, output ``(B, S, E)``. ``q_proj``: ``E -> H*D``;
    ``k_proj``, ``v_proj``: ``E -> Hkv*D``; ``o_proj``: ``H*D -> E``.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        num_kv_heads=None,
        head_dim=None,
        *,
        causal=True,
        bias=False,
        score_mod=None,
        mask_mod=None,
        device=None,
        dtype=None,
        backend=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"Attention: num_heads={num_heads} must be a multiple of num_kv_heads="
                f"{num_kv_heads} (grouped-query attention)"
            )
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(
                    f"Attention: embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                    "pass head_dim"
                )
            head_dim = embed_dim // num_heads
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.causal, self.backend = head_dim, causal, backend
        factory = {"device": device, "dtype": dtype, "bias": bias}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, **factory)
        self.score_mod = None if score_mod is None else as_score_mod(score_mod)
        self.mask_mod = None if mask_mod is None else as_mask_mod(mask_mod)
        self._flex_mask = self.mask_mod
        if causal:
            self._flex_mask = CausalMask() if mask_mod is None else CausalMask() & self.mask_mod
        #: (registered name, slot path, field) of each parameter the score mod captures
        self._mod_parameters: list[tuple[str, tuple[int, ...], str]] = []
        if self.score_mod is not None:
            for slot in self.score_mod.graph.slots:
                if isinstance(slot.array, nn.Parameter):
                    name = "score_mod_" + re.sub(r"\W", "_", slot.label.split(".")[-1])
                    while hasattr(self, name):
                        name += "_"
                    self.register_parameter(name, slot.array)
                    self._mod_parameters.append((name, slot.path, slot.field))

    def _bound_score_mod(self):
        """The score mod reading the module's parameters: loading with ``assign=True``,
        ``to_empty`` and swapping conversions replace a parameter object, and the mod is
        rebuilt around the new one (else it would read the old tensor, and train nothing)."""
        mod = self.score_mod
        for name, path, field in self._mod_parameters:
            param = getattr(self, name)
            slot = next(s for s in mod.graph.slots if s.path == path and s.field == field)
            if slot.array is not param:
                mod = mod._with_array(path, field, param)
        self.score_mod = mod
        return mod

    def _heads(self, t, n, batch, seq):
        """``(B, S, n*D)`` -> a ``(B, n, S, D)`` view (BSHD memory, no copy)."""
        return t.view(batch, seq, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, input_pos=0) -> torch.Tensor:
        """Attend over ``x`` ``(B, S, E)``; queries sit at positions ``input_pos + i``."""
        batch, seq, _ = x.shape
        q = self._heads(self.q_proj(x), self.num_heads, batch, seq)
        k = self._heads(self.k_proj(x), self.num_kv_heads, batch, seq)
        v = self._heads(self.v_proj(x), self.num_kv_heads, batch, seq)
        if self.score_mod is None and self.mask_mod is None:
            o = attention(q, k, v, causal=self.causal, input_pos=input_pos, backend=self.backend)
        else:
            o = flex_attention(
                q,
                k,
                v,
                score_mod=None if self.score_mod is None else self._bound_score_mod(),
                mask_mod=self._flex_mask,
                input_pos=input_pos,
                backend=self.backend,
            )
        return self.o_proj(o.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}"
            + (f", score_mod={self.score_mod.label}" if self.score_mod is not None else "")
            + (f", mask_mod={self.mask_mod.label}" if self.mask_mod is not None else "")
        )
