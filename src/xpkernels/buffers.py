"""Caller-owned buffers: shadows, checkpoints and scratch.

Every primitive in xpkernels runs in place over buffers the caller owns, so a
training step can be planned once, reused every step and captured (CUDA
graphs) without hidden allocations.

- ``Duplicated(primal, shadow)`` pairs an array with its gradient shadow. The
  in-place backward kernels read each argument's primal and/or shadow and
  OVERWRITE the shadows of the inputs they differentiate (every element,
  padding and masked positions included). Accumulating across calls is the AD
  framework's job.
- ``allocate_checkpoints(f, ...)`` allocates what a forward ``f`` saves for
  its backward (float32), keyed on the in-place forward (``rms_norm_``).
- ``allocate_scratchspace(f, ...)`` allocates one pass's transient workspace,
  keyed on the in-place function that uses it (``rms_norm_backward_``).
- ``grad_shadow(x)`` is the zeroed ACCUMULATE counterpart, used for score-mod
  parameter gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import array_api_compat

__all__ = [
    "Duplicated",
    "primal",
    "shadow",
    "allocate_checkpoints",
    "allocate_scratchspace",
    "grad_shadow",
    "empty_float32",
    "empty_accumulator",
    "checkpoints_for",
    "scratchspace_for",
]


@dataclass(frozen=True, slots=True)
class Duplicated:
    """An array paired with its gradient shadow.

    Parameters
    ----------
    primal : array
        The value.
    shadow : array, optional
        Its gradient buffer, same shape as ``primal``. ``None`` allocates a
        fresh, UNINITIALISED ``empty_like(primal)`` (not zeroed): the backward
        kernels overwrite every element, so zeroing would be wasted work.

    Shapes
    ------
    ``shadow.shape == primal.shape``; dtypes may differ (a float32 shadow for
    a bfloat16 primal is allowed where the primitive accepts it).
    """

    primal: Any
    shadow: Any = None

    def __post_init__(self):
        if isinstance(self.primal, Duplicated):
            raise TypeError("Duplicated: primal is already a Duplicated; pass its .primal")
        if self.shadow is None:
            xp = array_api_compat.array_namespace(self.primal)
            object.__setattr__(self, "shadow", xp.empty_like(self.primal))
        elif tuple(self.shadow.shape) != tuple(self.primal.shape):
            raise ValueError(
                f"Duplicated: shadow must have the primal's shape {tuple(self.primal.shape)}, "
                f"got {tuple(self.shadow.shape)}"
            )


def primal(x):
    """The primal of ``x``: ``x.primal`` for a Duplicated, else ``x`` itself."""
    return x.primal if isinstance(x, Duplicated) else x


def shadow(d):
    """The gradient shadow of a Duplicated; TypeError for anything else."""
    if not isinstance(d, Duplicated):
        raise TypeError(f"shadow: expected a Duplicated, got {type(d).__name__}")
    return d.shadow


_CHECKPOINT_ALLOCATORS: dict[Callable, Callable] = {}
_SCRATCH_ALLOCATORS: dict[Callable, Callable] = {}


def checkpoints_for(forward: Callable):
    """Decorator registering an allocator as ``allocate_checkpoints(forward, ...)``."""

    def register(allocator):
        _CHECKPOINT_ALLOCATORS[forward] = allocator
        return allocator

    return register


def scratchspace_for(function: Callable):
    """Decorator registering an allocator as ``allocate_scratchspace(function, ...)``."""

    def register(allocator):
        _SCRATCH_ALLOCATORS[function] = allocator
        return allocator

    return register


def _name(f) -> str:
    return getattr(f, "__qualname__", None) or repr(f)


def allocate_checkpoints(f: Callable, *args, **kwargs):
    """Allocate the checkpoints that the in-place forward ``f`` saves.

    Parameters
    ----------
    f : callable
        An in-place forward such as ``rms_norm_``.
    *args, **kwargs
        The arrays (bare or Duplicated) and options ``f`` will be called with.

    Returns
    -------
    NamedTuple
        Float32 arrays on the inputs' device, in their namespace; pass it as
        ``checkpoints=`` to the forward, then to the backward.
    """
    try:
        allocator = _CHECKPOINT_ALLOCATORS[f]
    except (KeyError, TypeError):
        raise TypeError(
            f"allocate_checkpoints: {_name(f)} saves no checkpoints "
            "(only in-place forwards such as rms_norm_ or attention_ do)"
        ) from None
    return allocator(*args, **kwargs)


def allocate_scratchspace(f: Callable, *args, **kwargs):
    """Allocate the transient workspace of one pass of ``f``.

    Parameters
    ----------
    f : callable
        An in-place pass that uses scratch, such as ``rms_norm_backward_`` or
        ``decode_attention_``.
    *args, **kwargs
        The arrays (bare or Duplicated) and options ``f`` will be called with.

    Returns
    -------
    NamedTuple
        Pass it as ``scratch=``. Its contents are meaningless between calls;
        forward and backward scratch lifetimes are disjoint.
    """
    try:
        allocator = _SCRATCH_ALLOCATORS[f]
    except (KeyError, TypeError):
        raise TypeError(
            f"allocate_scratchspace: {_name(f)} uses no scratch space "
            "(passes that do include rms_norm_backward_ and decode_attention_)"
        ) from None
    return allocator(*args, **kwargs)


def empty_float32(like, shape):
    """An uninitialised float32 array of ``shape`` in ``like``'s namespace and on its device."""
    xp = array_api_compat.array_namespace(like)
    return xp.empty(tuple(shape), dtype=xp.float32, device=array_api_compat.device(like))


def empty_accumulator(like, shape):
    """An uninitialised accumulation array: float64 when ``like`` is float64, else float32."""
    xp = array_api_compat.array_namespace(like)
    dtype = xp.float64 if like.dtype == xp.float64 else xp.float32
    return xp.empty(tuple(shape), dtype=dtype, device=array_api_compat.device(like))


def grad_shadow(x, **kwargs):
    """A zeroed gradient accumulator for ``x``.

    For an array: ``zeros_like(x)``. For an object defining
    ``__grad_shadow__(**kwargs)`` (score mods), whatever it returns: one
    zeroed accumulator per differentiable field. Unlike a Duplicated's
    shadow, kernels ADD into these.
    """
    hook = getattr(type(x), "__grad_shadow__", None)
    if hook is not None:
        return hook(x, **kwargs)
    if kwargs:
        raise TypeError(f"grad_shadow: unexpected options {sorted(kwargs)} for an array")
    if isinstance(x, Duplicated):
        raise TypeError("grad_shadow: pass an array, not a Duplicated")
    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError:
        raise TypeError(
            f"grad_shadow: expected an array or a score mod, got {type(x).__name__}"
        ) from None
    return xp.zeros_like(x)
