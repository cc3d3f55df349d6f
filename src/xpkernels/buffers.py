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

Checkpoints remember their forward: every checkpoints NamedTuple derives
from :class:`Checkpoints`, on which the forward that writes it records
(host-side, no device work) the options that shaped it. A backward given
other options, or checkpoints no forward wrote, raises a ValueError naming
the option instead of returning silently wrong gradients.

In debug mode (:func:`xpkernels.debug`) every buffer allocated here is filled
with NaN, so a kernel that leaves part of one unwritten shows it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import array_api_compat

from ._debug import debug_enabled
from ._memory import same_memory

__all__ = [
    "Duplicated",
    "primal",
    "shadow",
    "allocate_checkpoints",
    "allocate_scratchspace",
    "grad_shadow",
    "Checkpoints",
    "empty",
    "empty_float32",
    "empty_accumulator",
    "with_new_shadows",
    "record_forward",
    "forget_forward",
    "check_forward",
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

    Only what construction needs is checked here (the shapes, when both are
    arrays). Anything else -- a ``None`` or a list in either field (a
    ``shadow=None`` beside a non-array primal stays None) -- is refused by the
    function it is passed to, with a TypeError naming that function and the
    field (``rms_norm_backward_: X.primal must be an array, got NoneType``).
    """

    primal: Any
    shadow: Any = None

    def __post_init__(self):
        if isinstance(self.primal, Duplicated):
            raise TypeError("Duplicated: primal is already a Duplicated; pass its .primal")
        p, s = self.primal, self.shadow
        if not _is_array(p):
            return
        if s is None:
            object.__setattr__(self, "shadow", empty(p, tuple(p.shape), p.dtype))
        elif _is_array(s) and tuple(s.shape) != tuple(p.shape):
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


def namespace(fn: str, name: str, a):
    """The array namespace of ``a``; TypeError when ``a`` is not an array (or is a Duplicated).

    The check every front runs on a bare array argument (re-exported as
    ``xpkernels._checks.namespace``); it lives here, beside :class:`Duplicated`,
    so that this module needs nothing from :mod:`xpkernels._checks`, which
    builds on it.
    """
    if isinstance(a, Duplicated):
        raise TypeError(f"{fn}: {name} must be an array here, not a Duplicated")
    try:
        return array_api_compat.array_namespace(a)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}") from None


_CHECKPOINT_ALLOCATORS: dict[Callable, Callable] = {}
_SCRATCH_ALLOCATORS: dict[Callable, Callable] = {}


def _registrar(allocators: dict, function: Callable):
    """A decorator that stores an allocator in ``allocators`` under ``function``."""

    def register(allocator):
        allocators[function] = allocator
        return allocator

    return register


def checkpoints_for(forward: Callable):
    """Decorator registering an allocator as ``allocate_checkpoints(forward, ...)``."""
    return _registrar(_CHECKPOINT_ALLOCATORS, forward)


def scratchspace_for(function: Callable):
    """Decorator registering an allocator as ``allocate_scratchspace(function, ...)``."""
    return _registrar(_SCRATCH_ALLOCATORS, function)


def _allocator(what: str, allocators: dict, f, why: str):
    """The allocator registered for ``f``; TypeError ``"{what}: {f} {why}"`` when there is none."""
    try:
        return allocators[f]
    except (KeyError, TypeError):
        name = getattr(f, "__qualname__", None) or repr(f)
        raise TypeError(f"{what}: {name} {why}") from None


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
    why = "saves no checkpoints (only in-place forwards such as rms_norm_ or attention_ do)"
    allocator = _allocator("allocate_checkpoints", _CHECKPOINT_ALLOCATORS, f, why)
    _check_call("allocate_checkpoints", f, allocator, args, kwargs)
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
    why = "uses no scratch space (passes that do include rms_norm_backward_ and decode_attention_)"
    allocator = _allocator("allocate_scratchspace", _SCRATCH_ALLOCATORS, f, why)
    _check_call("allocate_scratchspace", f, allocator, args, kwargs)
    return allocator(*args, **kwargs)


def _check_call(what: str, f: Callable, allocator: Callable, args: tuple, kwargs: dict) -> None:
    """TypeError for a call given no array, or a keyword neither ``f`` nor its allocator takes
    (a misspelt ``memory=`` or ``backend=`` would be dropped, and the buffers sized without it)."""
    fn = f"{what}({f.__name__})"
    if not args and not kwargs:
        raise TypeError(f"{fn}: pass the arrays (and options) {f.__name__} will be called with")
    takes = set(inspect.signature(f).parameters)
    own = [
        p.name
        for p in inspect.signature(allocator).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in takes
    ]
    unknown = sorted(set(kwargs) - takes - set(own))
    if unknown:
        also = f", and {', '.join(own)}" if own else ""
        raise TypeError(
            f"{fn} got an unexpected keyword argument {unknown[0]!r} (it takes "
            f"{f.__name__}'s arguments{also})"
        )


def empty(like, shape, dtype):
    """A new C-contiguous array of ``shape`` and ``dtype`` in ``like``'s namespace and on its device.

    Uninitialised, except in debug mode, where it is filled with NaN (float
    dtypes). Its strides never copy ``like``'s (a broadcast view's zero
    strides included).
    """
    xp = array_api_compat.array_namespace(like)
    device = array_api_compat.device(like)
    if debug_enabled() and xp.isdtype(dtype, "real floating"):
        return xp.full(tuple(shape), math.nan, dtype=dtype, device=device)
    return xp.empty(tuple(shape), dtype=dtype, device=device)


def with_new_shadows(fn: str, arrays: Mapping[str, Any]) -> dict:
    """``name -> Duplicated(primal, new shadow)`` for the allocating backward fronts.

    Each shadow is :func:`empty` of its primal's shape and dtype: C-contiguous,
    never ``empty_like`` (a broadcast view has zero strides). ``arrays`` maps
    argument names to arrays or Duplicated (their primals are taken); a
    non-array raises TypeError naming the argument.
    """
    out = {}
    for name, a in arrays.items():
        a = primal(a)
        namespace(fn, name, a)
        out[name] = Duplicated(a, empty(a, tuple(a.shape), a.dtype))
    return out


def empty_float32(like, shape):
    """A new float32 array of ``shape`` in ``like``'s namespace and on its device (see :func:`empty`)."""
    return empty(like, shape, array_api_compat.array_namespace(like).float32)


def empty_accumulator(like, shape):
    """A new accumulation array: float64 when ``like`` is float64, else float32 (see :func:`empty`)."""
    xp = array_api_compat.array_namespace(like)
    return empty(like, shape, xp.float64 if like.dtype == xp.float64 else xp.float32)


class Checkpoints:
    """Base of every checkpoints NamedTuple: remembers the forward that last wrote it.

    The record is host-side state (the forward's name and its options), kept
    on the tuple object; it is not part of the tuple's fields, so
    ``_replace``, unpacking and pickling see the arrays only. A tuple built
    by hand, or returned by ``_replace``, carries no record: a backward
    refuses it until a forward has written it.
    """


def forget_forward(checkpoints) -> None:
    """Drop the record of ``checkpoints`` (a forward is about to overwrite them)."""
    checkpoints.__dict__.pop("_xpkernels_forward", None)


def record_forward(
    checkpoints, forward: str, options: Mapping[str, Any], shapes: Mapping[str, tuple] = {}
) -> None:
    """Record that ``forward`` (a name such as ``"rms_norm_"``) wrote ``checkpoints`` with
    ``options``, from inputs of ``shapes`` (what a backward must repeat: see
    :func:`check_forward`).

    NumPy arrays among the option values are copied and compare by value (a
    lengths buffer the caller refills before the backward is caught); other
    arrays are kept by reference and match views of the same memory (their
    values would need a device read); everything else compares by value.
    """
    kept = {name: _kept(value) for name, value in options.items()}
    checkpoints.__dict__["_xpkernels_forward"] = (forward, kept, dict(shapes))


def _kept(value):
    if array_api_compat.is_numpy_array(value):
        return value.copy()
    if isinstance(value, tuple):
        return tuple(map(_kept, value))
    return value


def check_forward(
    fn: str, checkpoints, forward: str, options: Mapping[str, Any], shapes: Mapping[str, tuple] = {}
) -> None:
    """ValueError unless ``checkpoints`` were written by ``forward`` with these ``options``
    and inputs of these ``shapes`` (a backward over other inputs whose checkpoints happen to
    fit, another row length or key length, would be silently wrong).

    Parameters
    ----------
    fn : str
        The backward being called, for the message.
    checkpoints : Checkpoints
        The checkpoints given to it.
    forward : str
        The forward that must have written them.
    options : mapping
        The backward's values of the options ``forward`` recorded.
    shapes : mapping
        The backward's input shapes, by what the forward recorded (``"q"``,
        ``"x (rows, M)"``...).
    """
    record = checkpoints.__dict__.get("_xpkernels_forward")
    if record is None:
        raise ValueError(
            f"{fn}: checkpoints were never written by a forward: run {forward}(..., "
            "checkpoints=checkpoints) first (a forward with checkpoints=None saves nothing)"
        )
    written_by, recorded, written_shapes = record
    if written_by != forward:
        raise ValueError(f"{fn}: checkpoints were written by {written_by}, not by {forward}")
    for name, shape in shapes.items():
        if name in written_shapes and tuple(shape) != written_shapes[name]:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(shape)}, but the forward that wrote these checkpoints "
                f"({forward}) had {written_shapes[name]}; pass the forward's inputs"
            )
    for name, value in options.items():
        if name in recorded and not _same(recorded[name], value):
            raise ValueError(
                f"{fn}: {name}={_show(value)} differs from the forward that wrote these "
                f"checkpoints ({forward} had {name}={_show(recorded[name])}); pass the "
                f"forward's {name}"
            )


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _same(recorded, value) -> bool:
    if _is_array(recorded) or _is_array(value):
        if array_api_compat.is_numpy_array(recorded) and array_api_compat.is_numpy_array(value):
            same_values = recorded.shape == value.shape and bool((recorded == value).all())
            return recorded.dtype == value.dtype and same_values
        return _is_array(recorded) and _is_array(value) and same_memory(recorded, value)
    if isinstance(recorded, tuple) and isinstance(value, tuple):
        return len(recorded) == len(value) and all(map(_same, recorded, value))
    if isinstance(recorded, (bool, int, float, str)) and isinstance(value, (bool, int, float, str)):
        return recorded == value
    same_as = getattr(recorded, "same_as", None)
    if same_as is not None:  # a key that knows its own equality (a traced mod's graph)
        return bool(same_as(value))
    return recorded is value  # None, block masks: the same object


def _show(value) -> str:
    if array_api_compat.is_numpy_array(value) and value.size <= 16:
        return f"{value.tolist()} ({value.dtype})"
    if _is_array(value):
        return f"<{type(value).__name__} of shape {tuple(value.shape)} at {id(value):#x}>"
    return repr(value)


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
