"""Validation helpers shared by the front files.

Every check raises ValueError or TypeError whose message names the function,
the argument, what was expected and what it got. The front files run all
their checks before dispatching, so nothing is written when one fails.

Capture safety (DESIGN section 6): no check here reads a device value on the
host. Values of integer arrays (lengths, positions) are checked only when
the array lives on the host (NumPy, array_api_strict) or in debug mode
(:func:`xpkernels.debug`); the kernels clamp and mask device values so that
none reads out of bounds.
"""

from __future__ import annotations

import math
import sys

import array_api_compat
import numpy as np

from ._debug import debug_enabled
from ._memory import identical, layout, self_overlapping
from .buffers import Duplicated, namespace  # namespace: buffers uses it too, so it lives there
from .registry import FLOAT_DTYPES, dtype_name, namespace_name

#: Largest magnitude of a position or length: the kernels index sequences in int32.
INDEX_MAX = 2**31 - 1


def duplicated(fn: str, name: str, d) -> Duplicated:
    """``d`` itself; TypeError unless it is a Duplicated whose primal and shadow are arrays
    (``name.primal``, ``name.shadow`` in the message)."""
    if not isinstance(d, Duplicated):
        raise TypeError(
            f"{fn}: {name} must be a Duplicated(primal, shadow) so its gradient has somewhere "
            f"to go, got {type(d).__name__}"
        )
    namespace(fn, f"{name}.primal", d.primal)
    namespace(fn, f"{name}.shadow", d.shadow)
    return d


def array(fn: str, name: str, a) -> None:
    """TypeError unless ``a`` looks like an array (has a shape and a dtype): the guard every
    check below runs first, so that a ``None`` or a list never leaks an AttributeError."""
    if not (hasattr(a, "shape") and hasattr(a, "dtype")) or isinstance(a, Duplicated):
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")


def floating(fn: str, name: str, xp, a, allowed=FLOAT_DTYPES) -> str:
    """The dtype name of ``a``; TypeError unless it is one of ``allowed``."""
    array(fn, name, a)
    dt = dtype_name(xp, a.dtype)
    if dt not in allowed:
        raise TypeError(f"{fn}: {name} must have dtype in {{{', '.join(allowed)}}}, got {a.dtype}")
    return dt


def _in_namespace(fn: str, name: str, xp, a) -> None:
    got = namespace_name(namespace(fn, name, a))
    if got != namespace_name(xp):
        raise TypeError(
            f"{fn}: {name} is a {got} array but the call's arrays are {namespace_name(xp)} "
            "arrays; all arrays of a call must come from one namespace"
        )


def float32(fn: str, name: str, xp, a) -> None:
    """TypeError unless ``a`` is a float32 array of namespace ``xp`` (checkpoints and scratch)."""
    _in_namespace(fn, name, xp, a)
    if a.dtype != xp.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {a.dtype}")


def accumulator(fn: str, name: str, xp, a, input_dtype) -> None:
    """TypeError unless ``a`` has the accumulation dtype for ``input_dtype`` (float64 or float32)."""
    _in_namespace(fn, name, xp, a)
    expected = xp.float64 if input_dtype == xp.float64 else xp.float32
    if a.dtype != expected:
        raise TypeError(f"{fn}: {name} must be {expected} for {input_dtype} inputs, got {a.dtype}")


def shape(fn: str, name: str, a, expected: tuple) -> None:
    """ValueError unless ``a.shape == expected``."""
    array(fn, name, a)
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{fn}: {name} must have shape {tuple(expected)}, got {tuple(a.shape)}")


def min_rank(fn: str, name: str, a, rank: int, layout: str) -> None:
    """ValueError unless ``a.ndim >= rank``."""
    array(fn, name, a)
    if a.ndim < rank:
        raise ValueError(
            f"{fn}: {name} must have shape {layout} (rank >= {rank}), got rank {a.ndim} {tuple(a.shape)}"
        )


def rank(fn: str, name: str, a, rank: int, layout: str) -> None:
    """ValueError unless ``a.ndim == rank``."""
    array(fn, name, a)
    if a.ndim != rank:
        raise ValueError(
            f"{fn}: {name} must have shape {layout} (rank {rank}), got rank {a.ndim} {tuple(a.shape)}"
        )


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
    array(fn, name, a)
    st = strides(a)
    if st and a.shape[-1] > 1 and st[-1] != 1 and math.prod(a.shape) > 0:
        raise ValueError(
            f"{fn}: {name} must be contiguous along its last axis (stride 1), got strides {st}; "
            "other axes may have any stride"
        )


def _type_name(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def boolean(fn: str, name: str, value) -> bool:
    """``value`` itself; TypeError unless it is a Python bool (``"no"``, 0 and
    ``numpy.True_`` are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {_type_name(value)} {value!r}")
    return value


def _real(fn: str, name: str, value) -> float:
    """``value`` as a float; TypeError unless it is a real number (a string or a bool is not)."""
    if not isinstance(value, (str, bytes, bool, np.bool_)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{fn}: {name} must be a real number, got {_type_name(value)} {value!r}")


def positive_finite(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it is finite and > 0."""
    v = _real(fn, name, value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{fn}: {name} must be finite and > 0, got {value!r}")
    return v


def one_of(fn: str, name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` itself; ValueError unless it is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{fn}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


def finite(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it is finite."""
    v = _real(fn, name, value)
    if not math.isfinite(v):
        raise ValueError(f"{fn}: {name} must be finite, got {value!r}")
    return v


def unit_interval(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it lies in ``[0, 1]``."""
    v = finite(fn, name, value)
    if not 0 <= v <= 1:
        raise ValueError(f"{fn}: {name} must lie in [0, 1], got {value!r}")
    return v


def non_negative(fn: str, name: str, value) -> float:
    """``value`` as a float; ValueError unless it is finite and >= 0."""
    v = finite(fn, name, value)
    if v < 0:
        raise ValueError(f"{fn}: {name} must be >= 0, got {value!r}")
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


def namespaces(fn: str, arrays, lead: str):
    """The namespace of ``arrays`` (name -> array): TypeError unless each is an array (all
    checked first) and all share the namespace of ``arrays[lead]``."""
    for name, a in arrays.items():
        namespace(fn, name, a)
    xp = namespace(fn, lead, arrays[lead])
    same_namespace(fn, xp, arrays, reference=lead)
    return xp


def is_host_array(a) -> bool:
    """True for arrays whose values can be read without a device sync (NumPy, array_api_strict)."""
    return array_api_compat.is_numpy_array(a) or array_api_compat.is_array_api_strict_namespace(
        array_api_compat.array_namespace(a)
    )


def index_int(fn: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int; TypeError unless it is an integer (not a bool), ValueError unless it
    lies in ``[low, high]`` (None: unbounded on that side) and within the kernels' ``INDEX_MAX``.
    """
    if isinstance(value, bool) or hasattr(value, "shape") and not isinstance(value, np.generic):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    try:
        v = int(value.__index__())
    except (AttributeError, TypeError):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}") from None
    _in_range(fn, name, v, v, low, high, "")
    return v


def _in_range(fn, name, lo, hi, low, high, layout) -> None:
    low_ = -INDEX_MAX if low is None else max(low, -INDEX_MAX)
    high_ = INDEX_MAX if high is None else min(high, INDEX_MAX)
    if lo < low_ or hi > high_:
        where = f" ({layout})" if layout and high is not None else ""
        got = f"{lo}" if lo == hi else f"values in [{lo}, {hi}]"
        raise ValueError(f"{fn}: {name} must lie in [{low_}, {high_}]{where}, got {got}")


def batch_integers(fn, name, xp, a, batch, low, high, layout) -> None:
    """Check a ``(B,)`` integer array whose values must lie in ``[low, high]`` (None: unbounded).

    Raises TypeError for a dtype other than int32/int64 and ValueError for a
    wrong shape or an out-of-range value, naming ``name`` and ``layout``
    (what ``high`` is). Values are checked only on host arrays or in debug
    mode: reading a device array's values would sync it.
    """
    array(fn, name, a)
    if a.dtype not in (xp.int32, xp.int64):
        raise TypeError(f"{fn}: {name} must have dtype int32 or int64, got {a.dtype}")
    shape(fn, name, a, (batch,))
    if batch == 0 or not (is_host_array(a) or debug_enabled()):
        return
    _in_range(fn, name, int(xp.min(a)), int(xp.max(a)), low, high, layout)


def writable(fn: str, arrays) -> None:
    """Refuse outputs the call could not write in full, or not element by element: read-only
    NumPy arrays, torch tensors that require grad while grad mode is on (autograd cannot record
    xpkernels' in-place writes), and arrays two of whose elements share memory
    (:func:`self_overlap`).

    ``arrays`` maps argument names to arrays or None.
    """
    for name, a in arrays.items():
        if a is None:
            continue
        self_overlap(fn, name, a)
        raw = getattr(a, "_array", a)  # array_api_strict wraps a NumPy array
        if isinstance(raw, np.ndarray) and not raw.flags.writeable:
            raise ValueError(
                f"{fn}: {name} is read-only (flags.writeable is False); pass a writable array"
            )
        if getattr(a, "requires_grad", False) and _torch_grad_enabled():
            raise ValueError(
                f"{fn}: {name} requires grad, and autograd cannot record xpkernels' in-place "
                "writes into it; pass a buffer that does not require grad, call under "
                "torch.no_grad(), or use the allocating form"
            )


def self_overlap(fn: str, name: str, a) -> None:
    """ValueError when two elements of the output ``a`` share memory: a broadcast (stride-0)
    view, or strides that bring elements together. Each element of an output is written on its
    own, so such an output would end up holding one of several results."""
    if self_overlapping(a):
        raise ValueError(
            f"{fn}: {name} has elements that share memory (shape {tuple(a.shape)}, strides "
            f"{strides(a)}), so writing one overwrites another; pass an output whose elements "
            "are distinct (not a broadcast view)"
        )


def no_gradient(fn: str, name: str, a, what: str) -> None:
    """ValueError when ``a`` is a torch tensor that requires grad in grad mode, for an argument
    that gets no gradient (``what`` says which): autograd would silently give it none."""
    if getattr(a, "requires_grad", False) and _torch_grad_enabled():
        raise ValueError(
            f"{fn}: {name} requires grad, but {what} gets no gradient; pass {name}.detach() "
            "(or compute it under torch.no_grad())"
        )


def _torch_grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def no_overlap(fn: str, outputs, inputs, may_alias=()) -> None:
    """ValueError when an output shares memory with an input or with another output.

    Parameters
    ----------
    fn : str
        The function, for the message.
    outputs, inputs : mapping of str to array or None
        What the call writes and what it reads, by argument name.
    may_alias : iterable of (str, str)
        (output, input) pairs allowed to be the very same array (``y is x``
        for the norms); any other sharing, partial overlap included, is refused.
    """
    allowed = set(may_alias)
    outs = [(n, layout(a)) for n, a in outputs.items() if a is not None]
    outs = [(n, u) for n, u in outs if u is not None]
    ins = [(n, layout(a)) for n, a in inputs.items() if a is not None]
    ins = [(n, v) for n, v in ins if v is not None]
    pairs = [(o, u, i, v) for o, u in outs for i, v in ins]
    pairs += [(o, u, p, w) for k, (o, u) in enumerate(outs) for p, w in outs[k + 1 :]]
    written = {n for n, _ in outs}
    for out_name, u, in_name, v in pairs:
        if (out_name, in_name) in allowed and identical(u, v):
            continue
        try:
            shared = np.shares_memory(u, v, max_work=100_000)  # type: ignore[arg-type]  # stubs list only -1, 0
        except np.exceptions.TooHardError:
            shared = True
        if shared:
            hint = (
                f" (it may be the very same array as {in_name}, but not overlap it partly)"
                if (out_name, in_name) in allowed
                else ""
            )
            what = f"both {out_name} and {in_name}" if in_name in written else out_name
            if in_name not in written:
                what += f" while it reads {in_name}"
            raise ValueError(
                f"{fn}: {out_name} shares memory with {in_name}; xpkernels writes {what}, "
                f"so they must not overlap{hint}"
            )
