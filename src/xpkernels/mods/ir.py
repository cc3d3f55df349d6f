"""The mod expression graph: its nodes, the op tables and interval analysis.

:class:`Node`, :class:`Slot` and :class:`Graph`; the op tables (operator symbols,
result kinds, evaluation on an Array API namespace); the interval analysis that
bounds captured-array indices in int64; and the host-array helpers it reads bounds with.
"""

from __future__ import annotations

import builtins
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import array_api_compat
import numpy as np

if TYPE_CHECKING:
    from .interpret import BoundGraph


BOOL, INT, FLOAT = "bool", "int", "float"

#: Inputs of a traced graph: the score (score mods only) and the index inputs.
INPUTS = ("score", "b", "h", "q_idx", "kv_idx", "q_row")

#: Integers in graphs are computed in int64 by every kernel; results outside wrap around.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Node:
    """One node of a :class:`Graph`.

    ``op`` is ``"input"`` (``value`` = its name), ``"const"`` (``value`` = a
    Python bool, int or float), ``"gather"`` (``value`` = slot index, ``args``
    = one index node per axis) or an operation applied to ``args``.
    """

    op: str
    args: tuple[int, ...]
    value: Any
    kind: str


@dataclass(frozen=True, eq=False)
class Slot:
    """A captured array read by a graph: which mod field it is and the array itself."""

    path: tuple[int, ...]  #: position of the owning mod inside a composition
    field: str  #: its keyword name
    label: str  #: ``Owner.field``, for messages
    array: Any
    kind: str
    #: ``(min, max)`` of an integer NumPy array's values, read when the mod was built; None
    #: for other arrays (device integer arrays are never read on the host: indices they
    #: produce are clamped by the evaluation instead)
    bounds: tuple[int, int] | None = None


_SYMBOLS = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "floordiv": "//",
    "mod": "%",
    "pow": "**",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
    "and": "logical_and (&)",
    "or": "logical_or (|)",
    "not": "logical_not (~)",
}

_ARITHMETIC = ("add", "sub", "mul", "floordiv", "mod")

_ORDER = ("lt", "le", "gt", "ge")

_FLOAT_UNARY = ("exp", "exp2", "log", "tanh", "sqrt", "sin", "cos", "tan", "sigmoid")


class Graph:
    """A traced mod: nodes in topological order, the output node and the captured-array slots.

    Attributes
    ----------
    nodes : tuple of Node
    output : int
        Index of the result node (a condition for masks, a float for scores).
    slots : tuple of Slot
        The captured arrays the graph reads, in order of first use.
    inputs : frozenset of str
        The inputs it reads (from :data:`INPUTS`).
    """

    def __init__(self, nodes, output, slots):
        self.nodes = tuple(nodes)
        self.output = output
        self.slots = tuple(slots)
        self.inputs = frozenset(n.value for n in self.nodes if n.op == "input")
        #: ``(gather node, axis)`` pairs whose index the evaluation clamps into the array
        self.clamped: frozenset[tuple[int, int]] = frozenset()
        self.forms = {
            i: tuple(self._form(a) for a in node.args)
            for i, node in enumerate(self.nodes)
            if node.op == "gather"
        }

    def _form(self, i):
        """``("const", c)`` or ``("input", name, c)`` when node ``i`` is that simple, else None."""
        node = self.nodes[i]
        if node.op == "const":
            return ("const", node.value)
        if node.op == "input":
            return ("input", node.value, 0)
        if node.op in ("add", "sub") and node.kind == INT:
            a, c = (self.nodes[j] for j in node.args)
            if node.op == "add" and a.op == "const":
                a, c = c, a
            if a.op == "input" and c.op == "const":
                return ("input", a.value, c.value if node.op == "add" else -c.value)
        return None

    def uses(self, name: str) -> bool:
        """True when the graph reads input ``name``."""
        return name in self.inputs

    def clamping(self, clamped) -> Graph:
        """This graph with the indices ``clamped`` (from :meth:`check_indices`) clamped when run."""
        clamped = frozenset(clamped)
        if clamped == self.clamped:
            return self
        out = copy.copy(self)
        out.clamped = clamped
        return out

    def __str__(self):
        lines = []
        for i, n in enumerate(self.nodes):
            if n.op == "input":
                what = n.value
            elif n.op == "const":
                what = repr(n.value)
            elif n.op == "gather":
                what = f"{self.slots[n.value].label}[{', '.join(f'%{a}' for a in n.args)}]"
            else:
                what = f"{n.op}({', '.join(f'%{a}' for a in n.args)})"
            lines.append(f"%{i} = {what} : {n.kind}")
        lines.append(f"return %{self.output}")
        return "\n".join(lines)

    def bind(self, xp, float_dtype, device, arrays=None) -> BoundGraph:
        """The graph ready to run on namespace ``xp`` computing floats in ``float_dtype``.

        ``arrays`` replaces the slots' arrays (same order), e.g. host copies.
        """
        from .interpret import BoundGraph  # interpret builds on this module

        return BoundGraph(self, xp, float_dtype, device, arrays)

    def check_indices(
        self, fn: str, ranges: dict, context: str, read_device: bool = False
    ) -> frozenset:
        """ValueError unless every captured-array index stays inside its array.

        ``ranges`` maps each index input to its inclusive ``(low, high)``
        over the call, or to None when it comes from device values (an
        ``input_pos`` array on the device). Intervals are propagated through
        the graph in int64, as kernels compute: a result that leaves int64
        wraps, so its interval becomes int64's. Integer NumPy arrays used
        inside indices contribute the min and max of their values (read when
        the mod was built); integer arrays of other namespaces are device
        values, never read on the host unless ``read_device`` (debug mode:
        their indices are then checked like host ones, not clamped).

        Returns
        -------
        frozenset of (int, int)
            ``(gather node, axis)`` whose index depends on device values and
            is not proven inside the array: the evaluation clamps it there
            (pass it to :meth:`clamping`).
        """
        if any(r is not None and r[0] > r[1] for r in ranges.values()):
            return frozenset()
        memo: dict[int, tuple] = {}
        clamped = set()
        for i, node in enumerate(self.nodes):
            if node.op != "gather":
                continue
            slot = self.slots[node.value]
            shape = tuple(slot.array.shape)
            for axis, arg in enumerate(node.args):
                lo, hi, device, wrapped = _interval(self, arg, ranges, memo, read_device)
                if 0 <= lo and hi <= shape[axis] - 1:
                    continue
                if device:
                    clamped.add((i, axis))
                    continue
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    raise ValueError(
                        f"{fn}: {slot.label} is indexed on axis {axis} by an expression "
                        f"whose range cannot be bounded for this call ({context}); clamp it "
                        "with minimum/maximum"
                    )
                note = (
                    " (an intermediate result leaves int64, in which kernels compute, and wraps "
                    "around)"
                    if wrapped
                    else ""
                )
                raise ValueError(
                    f"{fn}: {slot.label} (shape {shape}) is indexed on axis {axis} by "
                    f"values in [{int(lo)}, {int(hi)}] for this call ({context}){note}, outside "
                    f"[0, {shape[axis] - 1}]; "
                    "every index must stay inside the array (clamp it with minimum/maximum)"
                )
        return frozenset(clamped)


def _interval(graph, i, ranges, memo, read_device=False):
    """``(low, high, device, wrapped)`` of integer node ``i`` over the call, in int64.

    ``device``: the value depends on device values (bounded by their dtype
    only); ``wrapped``: some int64 result on the way may wrap around. Floats
    are unbounded.
    """
    if i in memo:
        return memo[i]
    node = graph.nodes[i]
    op = node.op
    inf = math.inf
    device = wrapped = False
    if node.kind == BOOL:
        lo, hi = 0, 1
    elif op == "const":
        lo, hi = node.value, node.value
    elif op == "input":
        bound = ranges.get(node.value, (-inf, inf))
        device = bound is None
        lo, hi = (INT64_MIN, INT64_MAX) if device else bound
    elif op == "gather":
        lo, hi = -inf, inf
        if node.kind == INT:
            slot = graph.slots[node.value]
            bounds = slot.bounds
            if bounds is None and read_device:
                bounds = _host_bounds(_to_host(slot.array))
            device = bounds is None
            lo, hi = bounds if not device else _dtype_range(slot.array)
    elif node.kind == FLOAT:
        lo, hi = -inf, inf
    else:
        args = [_interval(graph, a, ranges, memo, read_device) for a in node.args]
        if op == "where":
            args = args[1:]
        device = builtins.any(a[2] for a in args)
        wrapped = builtins.any(a[3] for a in args)
        bounds = [a[:2] for a in args]
        if op == "where":
            bounds = [(0, 1)] + bounds
        lo, hi = _interval_rule(op, bounds, graph, node)
        if (math.isfinite(lo) and lo < INT64_MIN) or (math.isfinite(hi) and hi > INT64_MAX):
            lo, hi, wrapped = INT64_MIN, INT64_MAX, True
    memo[i] = (lo, hi, device, wrapped)
    return memo[i]


def _dtype_range(a) -> tuple[int, int]:
    """Smallest and largest value of an integer array's dtype."""
    info = array_api_compat.array_namespace(a).iinfo(a.dtype)
    return int(info.min), int(info.max)


def _mul_bound(x, y):
    return 0 if x == 0 or y == 0 else x * y


def _interval_rule(op, bounds, graph, node):
    inf = math.inf
    (a0, a1) = bounds[0]
    if op == "add":
        return a0 + bounds[1][0], a1 + bounds[1][1]
    if op == "sub":
        return a0 - bounds[1][1], a1 - bounds[1][0]
    if op == "neg":
        return -a1, -a0
    if op == "mul":
        corners = [_mul_bound(x, y) for x in (a0, a1) for y in bounds[1]]
        return builtins.min(corners), builtins.max(corners)
    if op == "abs":
        if a0 >= 0:
            return a0, a1
        if a1 <= 0:
            return -a1, -a0
        return 0, builtins.max(-a0, a1)
    if op == "minimum":
        return builtins.min(a0, bounds[1][0]), builtins.min(a1, bounds[1][1])
    if op == "maximum":
        return builtins.max(a0, bounds[1][0]), builtins.max(a1, bounds[1][1])
    if op == "where":
        (b0, b1), (c0, c1) = bounds[1], bounds[2]
        return builtins.min(b0, c0), builtins.max(b1, c1)
    divisor = graph.nodes[node.args[1]] if len(node.args) > 1 else None
    if op in ("floordiv", "mod") and divisor.op == "const" and divisor.value > 0:
        c = divisor.value
        if op == "mod":
            if math.isfinite(a0) and math.isfinite(a1) and a0 // c == a1 // c:
                return a0 % c, a1 % c
            return 0, c - 1
        return (a0 // c if math.isfinite(a0) else a0), (a1 // c if math.isfinite(a1) else a1)
    if op == "pow" and divisor.op == "const" and a0 >= 0:
        c = divisor.value

        def power(x):  # past 2**64 the result wraps anyway; don't compute huge powers
            return x**c if x <= 1 or c <= 64 else INT64_MAX + 1

        return power(a0), power(a1)
    return -inf, inf


def _floor_high(xp, dtype) -> float:
    """The largest value of float ``dtype`` below 2**63: ``2**63 (1 - eps / 2)``.

    Floats past int64 saturate there when :func:`floor` turns them into
    integers (float64: 2**63 - 1024, float32: 2**63 - 2**39).
    """
    return 2.0**63 * (1.0 - float(xp.finfo(dtype).eps) / 2.0)


def _floor_int(xp, x):
    """``floor(x)`` as int64 on namespace ``xp``: NaN gives 0, values past int64 saturate."""
    if xp.isdtype(x.dtype, "integral"):
        return x
    x = xp.floor(x)
    x = xp.where(xp.isnan(x), xp.zeros_like(x), x)
    x = xp.clip(x, float(INT64_MIN), _floor_high(xp, x.dtype))
    return xp.astype(x, xp.int64)


_EVAL: dict[str, Callable[..., Any]] = {
    "add": lambda xp, a, b: xp.add(a, b),
    "sub": lambda xp, a, b: xp.subtract(a, b),
    "mul": lambda xp, a, b: xp.multiply(a, b),
    "div": lambda xp, a, b: xp.divide(a, b),
    "floordiv": lambda xp, a, b: xp.floor_divide(a, b),
    "mod": lambda xp, a, b: xp.remainder(a, b),
    "pow": lambda xp, a, b: xp.pow(a, b),
    "lt": lambda xp, a, b: xp.less(a, b),
    "le": lambda xp, a, b: xp.less_equal(a, b),
    "gt": lambda xp, a, b: xp.greater(a, b),
    "ge": lambda xp, a, b: xp.greater_equal(a, b),
    "eq": lambda xp, a, b: xp.equal(a, b),
    "ne": lambda xp, a, b: xp.not_equal(a, b),
    "and": lambda xp, a, b: xp.logical_and(a, b),
    "or": lambda xp, a, b: xp.logical_or(a, b),
    "not": lambda xp, a: xp.logical_not(a),
    "neg": lambda xp, a: xp.negative(a),
    "abs": lambda xp, a: xp.abs(a),
    "exp": lambda xp, a: xp.exp(a),
    "exp2": lambda xp, a: xp.pow(
        xp.asarray(2.0, dtype=a.dtype, device=array_api_compat.device(a)), a
    ),
    "log": lambda xp, a: xp.log(a),
    "tanh": lambda xp, a: xp.tanh(a),
    "sqrt": lambda xp, a: xp.sqrt(a),
    "sin": lambda xp, a: xp.sin(a),
    "cos": lambda xp, a: xp.cos(a),
    "tan": lambda xp, a: xp.tan(a),
    "sigmoid": lambda xp, a: 1.0 / (1.0 + xp.exp(-a)),
    "floor": _floor_int,
    "minimum": lambda xp, a, b: xp.minimum(a, b),
    "maximum": lambda xp, a, b: xp.maximum(a, b),
    "where": lambda xp, c, a, b: xp.where(c, a, b),
    "float": lambda xp, a: a,
}


def _to_host(a) -> np.ndarray:
    """A NumPy copy (or view) of array ``a`` from any namespace or device."""
    if isinstance(a, np.ndarray):
        return a
    if array_api_compat.is_torch_array(a):
        return a.detach().cpu().numpy()
    if array_api_compat.is_cupy_array(a):
        return a.get()
    return np.from_dlpack(a)


def is_host_array(a) -> bool:
    """True for arrays whose values are read without a device sync: NumPy and array_api_strict."""
    return isinstance(a, np.ndarray) or array_api_compat.is_array_api_strict_namespace(
        array_api_compat.array_namespace(a)
    )


def _host_bounds(a) -> tuple[int, int] | None:
    """``(min, max)`` of a host integer array (``(0, 0)`` when empty); None for device arrays."""
    if not is_host_array(a):
        return None
    a = _to_host(a)
    return (int(a.min()), int(a.max())) if a.size else (0, 0)
