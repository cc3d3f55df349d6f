"""transformers' rotary embeddings on :func:`xpkernels.rope`, one attention module at a time.

:func:`rope_attention` gives an attention module of a RoPE family its own
``forward``: its class's function whose global ``apply_rotary_pos_emb`` is
renamed to a replacement added beside it in the modeling module, which runs
:func:`xpkernels.rope` on the half tables wherever that is exact and the
original function elsewhere. Other models in the process keep transformers'
code.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from ..rope import rope

__all__ = ["attention_like", "rope_attention"]

#: The module-level function a RoPE family's attention forward calls (transformers'
#: ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``), and the private name
#: :func:`apply_xpkernels` adds beside it in that module for its replacement.
_ROPE_NAME = "apply_rotary_pos_emb"
_ROPE_ALIAS = "_xpkernels_apply_rotary_pos_emb"
_ROPE_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
_ROPE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: An attention class's ``forward`` -> its copy calling :data:`_ROPE_ALIAS` (one per class).
_ROPE_FORWARDS: dict[Any, Any] = {}


def _rope_expressible(q, k, cos, sin, unsqueeze_dim, partial: bool) -> bool:
    """Whether one ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` call is exactly
    :func:`xpkernels.rope` on the half tables: ``unsqueeze_dim`` 1; plain tensors on one
    device, all of one float dtype, last axes contiguous; ``q (B, H, S, D)``, ``k (B, Hkv, S,
    D)``, ``cos``, ``sin`` ``(B or 1, S, R)`` with ``R`` even and ``R == D`` (``R < D`` too
    when the original rotates the first ``R`` features, ``partial``); tables needing no
    gradient. Shapes, dtypes and strides only: no device value is read."""
    if type(unsqueeze_dim) is not int or unsqueeze_dim != 1:
        return False
    tensors = (q, k, cos, sin)
    if not all(type(t) is torch.Tensor for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, seq, dim = q.shape
    width = cos.shape[2]
    return (
        q.dtype in _ROPE_DTYPES
        and all(t.dtype == q.dtype and t.device == q.device for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
        and k.shape[0] == batch
        and k.shape[2] == seq
        and k.shape[3] == dim
        and cos.shape[0] in (1, batch)
        and cos.shape[1] == seq
        and width % 2 == 0
        and (width == dim or (partial and 0 < width < dim))
        and not (cos.requires_grad or sin.requires_grad)
    )


def _rope_for(original: Any, partial: bool) -> Any:
    """The replacement of one modeling module's ``apply_rotary_pos_emb``: :func:`xpkernels.rope`
    on ``cos[..., :R // 2]``, ``sin[..., :R // 2]`` (views; ``(S, R // 2)`` tables when the
    batch axis is 1), ``original`` for any call :func:`_rope_expressible` refuses."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _rope_expressible(q, k, cos, sin, unsqueeze_dim, partial):
            return original(q, k, cos, sin, unsqueeze_dim)
        half = cos.shape[2] // 2
        if cos.shape[0] == q.shape[0]:
            return rope(q, k, cos[..., :half], sin[..., :half])
        return rope(q, k, cos[0, :, :half], sin[0, :, :half])

    apply_rotary_pos_emb.__doc__ = (
        f"xpkernels.rope in place of {getattr(original, '__module__', '?')}.{_ROPE_NAME} "
        "(added by xpkernels.torch.transformers.apply_xpkernels; the original for calls it "
        "cannot express)"
    )
    apply_rotary_pos_emb.xpkernels_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rope_probe(original: Any) -> tuple[str, bool]:
    """``(why not, partial)``: run ``original`` and its replacement on float64 probes with
    transformers' tables (frequencies repeated over both halves; one per batch, and one
    broadcast over the batch), to 1e-12; ``partial`` when they also agree on a rotary width
    ``R < D`` (where transformers' own function raises)."""
    try:
        names = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        names = ()
    if names != _ROPE_PARAMETERS:
        return f"its {_ROPE_NAME} does not take (q, k, cos, sin, unsqueeze_dim)", False
    replacement = _rope_for(original, partial=True)  # every probe below is expressible
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64)
    matches = {}
    for width in (8, 4):
        angles = torch.randn(2, 3, width // 2, generator=g, dtype=torch.float64)
        tables = [torch.cat([f(angles), f(angles)], dim=-1) for f in (torch.cos, torch.sin)]
        exact = True
        for cos, sin in (tables, [t[:1] for t in tables]):
            try:
                with torch.no_grad():
                    want = original(q, k, cos, sin)
                    got = replacement(q, k, cos, sin)
                exact = exact and all(
                    isinstance(w, torch.Tensor)
                    and w.shape == y.shape
                    and bool(((w - y).abs() <= 1e-12 * (1 + y.abs())).all())
                    for w, y in zip(want, got, strict=True)
                )
            except Exception:  # another convention or signature: reported, not raised
                exact = False
        matches[width] = exact
    if not matches[8]:
        half = "q * cos + rotate_half(q) * sin"
        return f"its {_ROPE_NAME} is not the half rotation {half} on a probe", False
    return "", matches[4]


def _rope_replacement(namespace: dict) -> tuple[Any, str]:
    """The replacement of ``namespace``'s (a modeling module's) ``apply_rotary_pos_emb``,
    stored there under :data:`_ROPE_ALIAS` (built once per original function); or why not."""
    original = namespace.get(_ROPE_NAME)
    if not callable(original):
        return None, f"its module has no {_ROPE_NAME}"
    current = namespace.get(_ROPE_ALIAS)
    if getattr(current, "xpkernels_original", None) is original:
        return current, ""
    why, partial = _rope_probe(original)
    if why:
        return None, why
    namespace[_ROPE_ALIAS] = _rope_for(original, partial)
    return namespace[_ROPE_ALIAS], ""


def _rope_calls(code: types.CodeType) -> str:
    """Why ``code``'s ``apply_rotary_pos_emb`` cannot be redirected; "" when it uses the name
    only to load the global (and its nested code not at all)."""
    if _ROPE_NAME not in code.co_names:
        return f"its forward calls no module-level {_ROPE_NAME}"
    for instruction in dis.get_instructions(code):
        if instruction.opcode in dis.hasname and instruction.argval == _ROPE_NAME:
            if instruction.opname != "LOAD_GLOBAL":
                return f"its forward uses the name {_ROPE_NAME} as more than a global"
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType) and _ROPE_NAME in constant.co_names:
            return f"a function nested in its forward calls {_ROPE_NAME}"
    return ""


def _rope_forward(forward: Any) -> Any:
    """``forward`` with its global ``apply_rotary_pos_emb`` read as :data:`_ROPE_ALIAS`: the
    same bytecode, globals (the modeling module's, live), defaults and closure."""
    new = _ROPE_FORWARDS.get(forward)
    if new is None:
        code = forward.__code__
        names = tuple(_ROPE_ALIAS if n == _ROPE_NAME else n for n in code.co_names)
        new = types.FunctionType(
            code.replace(co_names=names),
            forward.__globals__,
            forward.__name__,
            forward.__defaults__,
            forward.__closure__,
        )
        new.__kwdefaults__ = forward.__kwdefaults__
        new.__qualname__, new.__doc__ = forward.__qualname__, forward.__doc__
        new.__annotations__ = dict(getattr(forward, "__annotations__", {}))
        new.xpkernels_rope = forward  # type: ignore[attr-defined]
        _ROPE_FORWARDS[forward] = new
    return new


class _RopeForward:
    """An attention class's ``forward`` run as :func:`_rope_forward`'s copy; it pickles as that
    ``forward``, and unpickling adds the modeling module's replacement again (a new process has
    none).

    Attributes
    ----------
    xpkernels_rope : function
        The class's ``forward``.
    """

    def __init__(self, forward: Any) -> None:
        self.xpkernels_rope = forward
        self._copy = _rope_forward(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._copy(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _rope_restored, (self.xpkernels_rope,)


def _rope_restored(forward: Any) -> _RopeForward:
    """The unpickled :class:`_RopeForward` of ``forward``, its module's replacement added."""
    _, why = _rope_replacement(forward.__globals__)
    if why:
        raise RuntimeError(f"xpkernels cannot restore RoPE on {forward.__qualname__}: {why}")
    return _RopeForward(forward)


def _rope_applied(module: nn.Module) -> bool:
    return isinstance(getattr(vars(module).get("forward"), "func", None), _RopeForward)


def attention_like(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and not _rope_applied(module)


def rope_attention(module: nn.Module, refused: dict[int, str]) -> str:
    """Bind ``module`` a copy of its class's forward whose ``apply_rotary_pos_emb`` is
    :func:`_rope_for`'s; else why not (``refused`` caches a module namespace's reason)."""
    if "forward" in vars(module):
        return "its forward is already replaced on the instance (by a hook?)"
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if not isinstance(code, types.CodeType):
        return "its forward is not a Python function"
    why = _rope_calls(code)
    if why:
        return why
    namespace = forward.__globals__  # type: ignore[union-attr]
    if id(namespace) in refused:
        return refused[id(namespace)]
    _, why = _rope_replacement(namespace)
    if why:
        refused[id(namespace)] = why
        return why
    module.forward = functools.partial(_RopeForward(forward), module)
    return ""
