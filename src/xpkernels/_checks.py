"""Validation helpers shared by the front files.

Every check raises ValueError or TypeError whose message names the function,
the argument, what was expected and what it got. The front files run all
their checks before dispatching, so nothing is written when one fails.
"""

from __future__ import annotations

import math

import array_api_compat

from .buffers import Duplicated
from .registry import FLOAT_DTYPES, dtype_name, namespace_name


def namespace(fn: str, name: str, a):
    """The array namespace of ``a``; TypeError when ``a`` is not an array."""
    if isinstance(a, Duplicated):
        raise TypeError(f"{fn}: {name} must be an array here, not a Duplicated")
    try:
        return array_api_compat.array_namespace(a)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}") from None


def duplicated(fn: str, name: str, d) -> Duplicated:
    """``d`` itself; TypeError unless it is a Duplicated."""
    if not isinstance(d, Duplicated):
        raise TypeError(
            f"{fn}: {name} must be a Duplicated(primal, shadow) so its gradient has somewhere "
            f"to go, got {type(d).__name__}"
        )
    return d


def floating(fn: str, name: str, xp, a, allowed=FLOAT_DTYPES) -> str:
    """The dtype name of ``a``; TypeError unless it is one of ``allowed``."""
    dt = dtype_name(xp, a.dtype)
    if dt not in allowed:
        raise TypeError(f"{fn}: {name} must have dtype in {{{', '.join(allowed)}}}, got {a.dtype}")
    return dt


def float32(fn: str, name: str, xp, a) -> None:
    """TypeError unless ``a`` is float32 (checkpoints and scratch)."""
    if a.dtype != xp.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {a.dtype}")


def accumulator(fn: str, name: str, xp, a, input_dtype) -> None:
    """TypeError unless ``a`` has the accumulation dtype for ``input_dtype`` (float64 or float32)."""
    expected = xp.float64 if input_dtype == xp.float64 else xp.float32
    if a.dtype != expected:
        raise TypeError(f"{fn}: {name} must be {expected} for {input_dtype} inputs, got {a.dtype}")


def shape(fn: str, name: str, a, expected: tuple) -> None:
    """ValueError unless ``a.shape == expected``."""
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{fn}: {name} must have shape {tuple(expected)}, got {tuple(a.shape)}")


def min_rank(fn: str, name: str, a, rank: int, layout: str) -> None:
    """ValueError unless ``a.ndim >= rank``."""
    if a.ndim < rank:
        raise ValueError(f"{fn}: {name} must have shape {layout} (rank >= {rank}), got rank {a.ndim} {tuple(a.shape)}")


def rank(fn: str, name: str, a, rank: int, layout: str) -> None:
    """ValueError unless ``a.ndim == rank``."""
    if a.ndim != rank:
        raise ValueError(f"{fn}: {name} must have shape {layout} (rank {rank}), got rank {a.ndim} {tuple(a.shape)}")


def strides(a) -> tuple[int, ...] | None:
    """Element strides of ``a`` where the namespace exposes them, else None."""
    if array_api_compat.is_torch_array(a):
        return tuple(a.stride())
    raw = getattr(a, "_array", a)  # array_api_strict wraps a NumPy array
    byte_strides = getattr(raw, "strides", None)
    itemsize = getattr(getattr(raw, "dtype", None), "itemsize", None)
    if byte_strides is None or not itemsize:
        return None
    return tuple(s // itemsize for s in byte_strides)


def last_axis_contiguous(fn: str, name: str, a) -> None:
    """ValueError unless the last axis of ``a`` has stride 1 (or length 1)."""
    st = strides(a)
    if st and a.shape[-1] > 1 and st[-1] != 1 and math.prod(a.shape) > 0:
        raise ValueError(
            f"{fn}: {name} must be contiguous along its last axis (stride 1), got strides {st}; "
            "other axes may have any stride"
        )


def positive_finite(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it is finite and > 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a real number, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{fn}: {name} must be finite and > 0, got {value!r}")
    return v


def finite(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it is finite."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a real number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{fn}: {name} must be finite, got {value!r}")
    return v


def same_namespace(fn, xp, arrays, reference=None) -> None:
    """TypeError unless every array of ``arrays`` (name -> array or None) is in namespace ``xp``.

    ``reference`` names the argument ``xp`` came from (default: the first name).
    """
    expected = namespace_name(xp)
    first = reference or next(iter(arrays))
    for name, a in arrays.items():
        if a is None:
            continue
        got = namespace_name(namespace(fn, name, a))
        if got != expected:
            raise TypeError(
                f"{fn}: {name} is a {got} array but {first} is a {expected} array; "
                "all arrays of a call must come from one namespace"
            )


def batch_integers(fn, name, xp, a, batch, low, high, layout) -> None:
    """Check a ``(B,)`` integer array whose values must lie in ``[low, high]`` (``high`` None: no upper bound).

    Raises TypeError for a non-integer dtype and ValueError for a wrong shape
    or an out-of-range value, naming ``name`` and ``layout`` (what ``high`` is).
    """
    if not xp.isdtype(a.dtype, "integral"):
        raise TypeError(f"{fn}: {name} must have an integer dtype, got {a.dtype}")
    shape(fn, name, a, (batch,))
    if batch == 0:
        return
    lo, hi = int(xp.min(a)), int(xp.max(a))
    if lo < low or (high is not None and hi > high):
        bound = f"lie in [{low}, {high}] ({layout})" if high is not None else f"be >= {low}"
        raise ValueError(f"{fn}: {name} must {bound}, got values in [{lo}, {hi}]")
