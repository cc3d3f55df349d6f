"""The mod expression graph, its tracer, evaluation, the built-in mods and tile planning."""

from __future__ import annotations

import builtins
import copy
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from .._memory import same_memory

BOOL, INT, FLOAT = "bool", "int", "float"
#: Inputs of a traced graph: the score (score mods only) and the index inputs.
INPUTS = ("score", "b", "h", "q_idx", "kv_idx", "q_row")

#: Elements of one dense mask evaluation in :func:`build_block_mask`.
_EVAL_ELEMENTS = 1 << 20

#: Tile states of a :class:`BlockMask` / tile plan.
SKIP, PARTIAL, FULL = 0, 1, 2

#: Integers in graphs are computed in int64 by every kernel; results outside wrap around.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class TraceError(TypeError):
    """A mod used an operation that cannot be traced into a graph; the message names it."""


# --------------------------------------------------------------------------- graph


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


# --------------------------------------------------------------------------- tracing


def _const_key(value):
    return (type(value).__name__, repr(value))


def _scalar(x):
    """``x`` as a Python bool/int/float when it is a Python or NumPy scalar, else None."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return None


class _Tracer:
    """Records the nodes of one trace, sharing identical nodes."""

    def __init__(self):
        self.nodes: list[Node] = []
        self._memo: dict = {}
        self.slots: list[Slot] = []
        self._slot_index: dict = {}

    def node(self, op, args=(), value=None, kind=FLOAT) -> Sym:
        key = (op, args, _const_key(value) if op == "const" else value, kind)
        i = self._memo.get(key)
        if i is None:
            i = len(self.nodes)
            self.nodes.append(Node(op, tuple(args), value, kind))
            self._memo[key] = i
        return Sym(self, i)

    def lift(self, x, what: str) -> Sym:
        """``x`` as a node of this trace: a Sym of this trace or a Python/NumPy scalar."""
        if isinstance(x, Sym):
            if x._tracer is not self:
                raise TraceError(f"{what}: a traced value from another mod's trace was used here")
            return x
        if isinstance(x, CapturedArray):
            raise TraceError(
                f"{what}: captured array {x._label!r} is used whole; index it with one integer "
                "expression per axis first"
            )
        value = _scalar(x)
        if value is None:
            raise TraceError(
                f"{what}: a {type(x).__name__} cannot be used in a mod; arrays must be passed "
                "to the mod by keyword (ScoreMod(fn, name=array)) and indexed there, other "
                "values must be Python numbers"
            )
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise TraceError(
                f"{what}: integer constant {value} does not fit int64, in which kernels compute"
            )
        return self.node(
            "const",
            (),
            value,
            BOOL if isinstance(value, bool) else INT if isinstance(value, int) else FLOAT,
        )

    def slot(self, path, field, label, array, kind, bounds=None) -> int:
        key = (path, field)
        if key not in self._slot_index:
            self._slot_index[key] = len(self.slots)
            self.slots.append(Slot(path, field, label, array, kind, bounds))
        return self._slot_index[key]

    def graph(self, out, returns: str) -> Graph:
        out = self.lift(out, "the mod's result")
        kind = out.kind
        if returns == BOOL and kind != BOOL:
            raise TraceError(
                "a mask mod must return a condition (a comparison, logical_and, ...), "
                f"got a {kind} value"
            )
        if returns == FLOAT and kind == BOOL:
            raise TraceError(
                "a score mod must return a number, got a condition (use where(cond, a, b))"
            )
        if returns == FLOAT and kind == INT:
            out = self.node("float", (out._id,), None, FLOAT)
        return _prune(self.nodes, out._id, self.slots)


def _prune(nodes, output, slots) -> Graph:
    """The graph of the nodes ``output`` depends on, renumbered, with the slots it reads."""
    keep = set()
    stack = [output]
    while stack:
        i = stack.pop()
        if i not in keep:
            keep.add(i)
            stack.extend(nodes[i].args)
    order = sorted(keep)
    new_id = {old: new for new, old in enumerate(order)}
    slot_id: dict[int, int] = {}
    new_nodes = []
    for old in order:
        n = nodes[old]
        value = n.value
        if n.op == "gather":
            value = slot_id.setdefault(n.value, len(slot_id))
        new_nodes.append(Node(n.op, tuple(new_id[a] for a in n.args), value, n.kind))
    used = sorted(slot_id, key=slot_id.__getitem__)
    return Graph(new_nodes, new_id[output], [slots[s] for s in used])


def _binary(op, x, y):
    t = (x if isinstance(x, Sym) else y)._tracer
    what = f"operator {_SYMBOLS.get(op, op)}"
    a, b = t.lift(x, what), t.lift(y, what)
    ka, kb = a.kind, b.kind
    if op in ("and", "or"):
        if ka != BOOL or kb != BOOL:
            raise TraceError(
                f"{what} needs two conditions, got {ka} and {kb} (bitwise operations on integers "
                "are not supported)"
            )
        return t.node(op, (a._id, b._id), None, BOOL)
    if op in ("eq", "ne"):
        if (ka == BOOL) != (kb == BOOL):
            raise TraceError(f"{what} compares a condition with a number ({ka} and {kb})")
        return t.node(op, (a._id, b._id), None, BOOL)
    if BOOL in (ka, kb):
        raise TraceError(f"{what} on a condition: turn it into a number with where(cond, 1, 0)")
    if op in _ORDER:
        return t.node(op, (a._id, b._id), None, BOOL)
    if op == "pow":
        exponent = t.nodes[b._id]
        int_result = ka == INT and kb == INT and exponent.op == "const" and exponent.value >= 0
        return t.node(op, (a._id, b._id), None, INT if int_result else FLOAT)
    kind = FLOAT if op == "div" or FLOAT in (ka, kb) else INT
    return t.node(op, (a._id, b._id), None, kind)


def _unary(op, x):
    t = x._tracer
    kind = x.kind
    if op == "not":
        if kind != BOOL:
            raise TraceError(
                f"logical_not (~) needs a condition, got {kind} (bitwise not is not supported)"
            )
        return t.node(op, (x._id,), None, BOOL)
    if kind == BOOL:
        raise TraceError(f"{op} of a condition: turn it into a number with where(cond, 1, 0)")
    if op == "floor":
        return x if kind == INT else t.node(op, (x._id,), None, INT)
    return t.node(op, (x._id,), None, FLOAT if op in _FLOAT_UNARY else kind)


def _select(c, x, y):
    t = next(v for v in (c, x, y) if isinstance(v, Sym))._tracer
    c, a, b = (t.lift(v, "where") for v in (c, x, y))
    if c.kind != BOOL:
        raise TraceError(f"where needs a condition as its first argument, got {c.kind}")
    if (a.kind == BOOL) != (b.kind == BOOL):
        raise TraceError(f"where mixes a condition and a number ({a.kind} and {b.kind})")
    kind = BOOL if a.kind == BOOL else FLOAT if FLOAT in (a.kind, b.kind) else INT
    return t.node("where", (c._id, a._id, b._id), None, kind)


def _extreme(op, x, y):
    t = (x if isinstance(x, Sym) else y)._tracer
    a, b = t.lift(x, op), t.lift(y, op)
    if BOOL in (a.kind, b.kind):
        raise TraceError(f"{op} of a condition: turn it into a number with where(cond, 1, 0)")
    return t.node(op, (a._id, b._id), None, FLOAT if FLOAT in (a.kind, b.kind) else INT)


def _unsupported(what: str):
    def method(self, *args, **kwargs):
        raise TraceError(f"{what} is not supported in a mod")

    return method


class Sym:
    """A traced value inside a mod (a score, an index, or an expression of them)."""

    __slots__ = ("_tracer", "_id")

    def __init__(self, tracer, index):
        self._tracer = tracer
        self._id = index

    @property
    def kind(self) -> str:
        """``"bool"``, ``"int"`` or ``"float"``."""
        return self._tracer.nodes[self._id].kind

    def __repr__(self):
        return f"<traced {self.kind} %{self._id}>"

    def __add__(self, o):
        return _binary("add", self, o)

    def __radd__(self, o):
        return _binary("add", o, self)

    def __sub__(self, o):
        return _binary("sub", self, o)

    def __rsub__(self, o):
        return _binary("sub", o, self)

    def __mul__(self, o):
        return _binary("mul", self, o)

    def __rmul__(self, o):
        return _binary("mul", o, self)

    def __truediv__(self, o):
        return _binary("div", self, o)

    def __rtruediv__(self, o):
        return _binary("div", o, self)

    def __floordiv__(self, o):
        return _binary("floordiv", self, o)

    def __rfloordiv__(self, o):
        return _binary("floordiv", o, self)

    def __mod__(self, o):
        return _binary("mod", self, o)

    def __rmod__(self, o):
        return _binary("mod", o, self)

    def __pow__(self, o):
        return _binary("pow", self, o)

    def __rpow__(self, o):
        return _binary("pow", o, self)

    def __lt__(self, o):
        return _binary("lt", self, o)

    def __le__(self, o):
        return _binary("le", self, o)

    def __gt__(self, o):
        return _binary("gt", self, o)

    def __ge__(self, o):
        return _binary("ge", self, o)

    def __eq__(self, o):
        return _binary("eq", self, o)

    def __ne__(self, o):
        return _binary("ne", self, o)

    def __and__(self, o):
        return _binary("and", self, o)

    def __rand__(self, o):
        return _binary("and", o, self)

    def __or__(self, o):
        return _binary("or", self, o)

    def __ror__(self, o):
        return _binary("or", o, self)

    def __neg__(self):
        return _unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _unary("abs", self)

    def __invert__(self):
        return _unary("not", self)

    def __floor__(self):
        return _unary("floor", self)

    __hash__ = None  # type: ignore[assignment]

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        rule = _UFUNCS.get(ufunc.__name__)
        if method != "__call__" or kwargs or rule is None:
            raise TraceError(
                f"numpy.{ufunc.__name__} is not supported in a mod; use the helpers of "
                "xpkernels.mods (exp, exp2, log, sqrt, sin, cos, tan, tanh, sigmoid, abs, floor, "
                "minimum, maximum, where, logical_and/or/not)"
            )
        return rule(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ == "where" and not kwargs and len(args) == 3:
            return where(*args)
        if func.__name__ == "clip":
            raise TraceError(
                "numpy.clip is not supported in a mod; clamp with minimum(maximum(x, low), high)"
            )
        raise TraceError(f"numpy.{func.__name__} is not supported in a mod")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TraceError(f"attribute or method .{name} of a traced value is not supported in a mod")


_UNSUPPORTED = {
    "__bool__": (
        "using a traced value as a Python bool (if/while, and/or/not, chained comparisons such as "
        "a < b < c; use where, logical_and, logical_or, logical_not)"
    ),
    "__float__": (
        "converting a traced value with float() or a math.* function "
        "(use the xpkernels.mods helpers)"
    ),
    "__int__": "converting a traced value with int()",
    "__complex__": "converting a traced value with complex()",
    "__index__": (
        "indexing a plain array with a traced value (pass the array to the mod by keyword, "
        "ScoreMod(fn, name=array), and index that)"
    ),
    "__array__": (
        "indexing a plain array with a traced value or converting it to an array (pass the array "
        "to the mod by keyword, ScoreMod(fn, name=array), and index that)"
    ),
    "__len__": "len() of a traced value",
    "__iter__": "iterating over a traced value",
    "__getitem__": "indexing a traced value (only captured arrays can be indexed)",
    "__matmul__": "the @ operator",
    "__rmatmul__": "the @ operator",
    "__lshift__": "the << operator",
    "__rlshift__": "the << operator",
    "__rshift__": "the >> operator",
    "__rrshift__": "the >> operator",
    "__xor__": "the ^ operator",
    "__rxor__": "the ^ operator",
    "__divmod__": "divmod()",
    "__rdivmod__": "divmod()",
    "__round__": "round()",
    "__trunc__": "math.trunc()",
    "__ceil__": "math.ceil()",
}
for _name, _description in _UNSUPPORTED.items():
    setattr(Sym, _name, _unsupported(_description))


class CapturedArray:
    """An array a mod received by keyword, seen while tracing: index it once per axis."""

    __slots__ = (
        "_tracer",
        "_path",
        "_field",
        "_label",
        "_array",
        "_kind",
        "_bounds",
        "shape",
        "ndim",
        "dtype",
    )

    def __init__(self, tracer, path, field, label, array, kind, bounds=None):
        self._tracer, self._path, self._field, self._label = tracer, path, field, label
        self._array, self._kind, self._bounds = array, kind, bounds
        self.shape = tuple(array.shape)
        self.ndim = len(self.shape)
        self.dtype = array.dtype

    def __repr__(self):
        return f"<captured {self._label} {self.shape}>"

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        what = f"indexing captured array {self._label!r}"
        if any(i is None or i is Ellipsis or isinstance(i, slice) for i in index):
            raise TraceError(
                f"{what}: slices, ... and None are not supported; give one integer "
                "expression per axis"
            )
        if len(index) != self.ndim:
            raise TraceError(f"{what}: it has {self.ndim} axes, got {len(index)} indices")
        t = self._tracer
        args = []
        for axis, i in enumerate(index):
            node = t.lift(i, what)
            if node.kind != INT:
                raise TraceError(
                    f"{what}: the index on axis {axis} must be an integer expression, "
                    f"got {node.kind}"
                )
            args.append(node._id)
        slot = t.slot(self._path, self._field, self._label, self._array, self._kind, self._bounds)
        return t.node("gather", tuple(args), slot, self._kind)


for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__neg__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__float__",
    "__index__",
    "__array__",
    "__iter__",
    "__len__",
):
    setattr(
        CapturedArray,
        _name,
        _unsupported(
            "using a captured array whole (index it with one integer expression per axis)"
        ),
    )


# --------------------------------------------------------------------------- helpers


def _traced(*xs) -> bool:
    return builtins.any(isinstance(x, Sym) for x in xs)


def _concrete(op: str, python, *args):
    """``op`` on concrete values: the arrays' own library for arrays, ``python`` for plain numbers.

    Torch tensors use ``torch.<op>`` directly, Python numbers becoming 0-d
    tensors, so mods also run inside ``torch.compile`` / vmap (PyTorch's
    flex_attention traces score mods that way).
    """
    torch = sys.modules.get("torch")
    tensor = None if torch is None else next((a for a in args if isinstance(a, torch.Tensor)), None)
    if torch is not None and tensor is not None:
        return getattr(torch, op)(
            *(
                a if isinstance(a, torch.Tensor) else torch.as_tensor(a, device=tensor.device)
                for a in args
            )
        )
    arrays = [a for a in args if array_api_compat.is_array_api_obj(a)]
    if not arrays:
        return python(*args)
    return getattr(array_api_compat.array_namespace(*arrays), op)(*args)


def _elementwise(op, python):
    def helper(x):
        if isinstance(x, Sym):
            return _unary(op, x)
        return _concrete(op, python, x)

    return helper


exp = _elementwise("exp", math.exp)
exp.__doc__ = "``e ** x`` (traced inside a mod, elementwise on arrays and numbers outside)."
log = _elementwise("log", math.log)
log.__doc__ = "Natural logarithm (traced inside a mod, elementwise outside)."
tanh = _elementwise("tanh", math.tanh)
tanh.__doc__ = "Hyperbolic tangent (traced inside a mod, elementwise outside)."
sqrt = _elementwise("sqrt", math.sqrt)
sqrt.__doc__ = "Square root (traced inside a mod, elementwise outside)."
abs = _elementwise("abs", builtins.abs)
abs.__doc__ = "Absolute value (traced inside a mod, elementwise outside)."
exp2 = _elementwise("exp2", lambda x: 2.0**x)
exp2.__doc__ = "``2 ** x`` (traced inside a mod, elementwise outside)."
sin = _elementwise("sin", math.sin)
sin.__doc__ = "Sine (traced inside a mod, elementwise outside)."
cos = _elementwise("cos", math.cos)
cos.__doc__ = "Cosine (traced inside a mod, elementwise outside)."
tan = _elementwise("tan", math.tan)
tan.__doc__ = "Tangent (traced inside a mod, elementwise outside)."


def _sigmoid(x):
    """``1 / (1 + e ** -x)`` on a concrete number or array (0 and 1 at the infinities)."""
    if isinstance(x, (bool, int, float, np.number)):
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return 1.0 / (1.0 + _concrete("exp", math.exp, -x))


def sigmoid(x):
    """The logistic function ``1 / (1 + e ** -x)`` (traced inside a mod, elementwise outside)."""
    if isinstance(x, Sym):
        return _unary("sigmoid", x)
    return _sigmoid(x)


#: Floats past int64 saturate when :func:`floor` turns them into integers: the float64
#: nearest below 2**63 is 2**63 - 1024.
_FLOOR_HIGH = float(2**63 - 1024)


def _floor_int(xp, x):
    """``floor(x)`` as int64 on namespace ``xp``: NaN gives 0, values past int64 saturate."""
    if xp.isdtype(x.dtype, "integral"):
        return x
    x = xp.floor(x)
    x = xp.where(xp.isnan(x), xp.zeros_like(x), x)
    x = xp.clip(x, float(INT64_MIN), _FLOOR_HIGH)
    return xp.astype(x, xp.int64)


def floor(x):
    """The largest integer ``<= x``, as an integer (traced inside a mod, elementwise outside).

    The one conversion from a float to an integer in a mod, so its result can
    index a captured array (bound it with :func:`minimum` / :func:`maximum`
    first: a float's range is not known). NaN gives 0 and values past int64
    saturate, on every backend.
    """
    if isinstance(x, Sym):
        return _unary("floor", x)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _floor_int(array_api_compat.array_namespace(x), x)
    if array_api_compat.is_array_api_obj(x):
        return _floor_int(array_api_compat.array_namespace(x), x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    return (
        int(math.floor(x))
        if math.isfinite(x)
        else 0
        if x != x
        else (INT64_MAX if x > 0 else INT64_MIN)
    )


def minimum(x, y):
    """Elementwise minimum (traced inside a mod; on arrays and numbers outside)."""
    if _traced(x, y):
        return _extreme("minimum", x, y)
    return _concrete("minimum", builtins.min, x, y)


def maximum(x, y):
    """Elementwise maximum (traced inside a mod; on arrays and numbers outside)."""
    if _traced(x, y):
        return _extreme("maximum", x, y)
    return _concrete("maximum", builtins.max, x, y)


def where(condition, x, y):
    """``x`` where ``condition`` holds, else ``y`` (traced inside a mod; elementwise outside)."""
    if _traced(condition, x, y):
        return _select(condition, x, y)
    return _concrete("where", lambda c, a, b: a if c else b, condition, x, y)


def logical_and(x, y):
    """Both conditions (traced inside a mod; elementwise outside). ``x & y`` does the same."""
    if _traced(x, y):
        return _binary("and", x, y)
    return _concrete("logical_and", lambda a, b: bool(a) and bool(b), x, y)


def logical_or(x, y):
    """Either condition (traced inside a mod; elementwise outside). ``x | y`` does the same."""
    if _traced(x, y):
        return _binary("or", x, y)
    return _concrete("logical_or", lambda a, b: bool(a) or bool(b), x, y)


def logical_not(x):
    """The negated condition (traced inside a mod; elementwise outside). ``~x`` does the same."""
    if isinstance(x, Sym):
        return _unary("not", x)
    return _concrete("logical_not", lambda a: not a, x)


_UFUNCS = {
    "add": lambda a, b: _binary("add", a, b),
    "subtract": lambda a, b: _binary("sub", a, b),
    "multiply": lambda a, b: _binary("mul", a, b),
    "true_divide": lambda a, b: _binary("div", a, b),
    "divide": lambda a, b: _binary("div", a, b),
    "floor_divide": lambda a, b: _binary("floordiv", a, b),
    "remainder": lambda a, b: _binary("mod", a, b),
    "power": lambda a, b: _binary("pow", a, b),
    "less": lambda a, b: _binary("lt", a, b),
    "less_equal": lambda a, b: _binary("le", a, b),
    "greater": lambda a, b: _binary("gt", a, b),
    "greater_equal": lambda a, b: _binary("ge", a, b),
    "equal": lambda a, b: _binary("eq", a, b),
    "not_equal": lambda a, b: _binary("ne", a, b),
    "logical_and": logical_and,
    "logical_or": logical_or,
    "logical_not": logical_not,
    "negative": lambda a: _unary("neg", a),
    "absolute": lambda a: _unary("abs", a),
    "exp": exp,
    "exp2": exp2,
    "log": log,
    "tanh": tanh,
    "sqrt": sqrt,
    "sin": sin,
    "cos": cos,
    "tan": tan,
    "floor": floor,
    "minimum": minimum,
    "maximum": maximum,
}


# --------------------------------------------------------------------------- evaluation


class Grid:
    """The index inputs of one evaluation: arrays broadcastable to one shape.

    ``ranges[name] = (axis, start, length)`` says that input ``name`` is
    ``start + arange(length)`` along grid axis ``axis`` (``axis`` None: the
    single value ``start``). Captured arrays indexed by such inputs are read
    and differentiated through plain slices instead of gathers and scatters.
    """

    def __init__(self, values: dict, ranges: dict | None = None, rank: int = 0):
        self.values = values
        self.ranges = ranges or {}
        self.rank = rank


def tile_grid(xp, device, names, *, b, h0, n_h, q_pos0, q_row0, n_q, kv0, n_kv) -> Grid:
    """The rank-3 ``(heads, queries, keys)`` grid of one kernel tile, for the inputs in ``names``.

    Parameters
    ----------
    xp, device
        Namespace and device of the kernel's arrays.
    names : collection of str
        Index inputs the graphs read.
    b : int
        Batch index. ``h0``, ``n_h``: first query head and count.
    q_pos0 : int or 0-d int64 array
        Position of the tile's first query (an array: a device value, not read on the host).
    q_row0, n_q : int
        Row of the tile's first query, and its query count.
    kv0, n_kv : int
        First key position and key count.
    """
    spans = {
        "b": (None, b, 1),
        "h": (0, h0, n_h),
        "q_idx": (1, q_pos0, n_q),
        "q_row": (1, q_row0, n_q),
        "kv_idx": (2, kv0, n_kv),
    }
    values, ranges = {}, {}
    for name in names:
        if name == "score":
            continue
        axis, start, length = spans[name]
        if axis is None:
            values[name] = xp.asarray(start, dtype=xp.int64, device=device)
            ranges[name] = spans[name]
            continue
        shape = [1, 1, 1]
        shape[axis] = length
        if isinstance(start, int):
            ranges[name] = spans[name]
            row = xp.arange(start, start + length, dtype=xp.int64, device=device)
        else:
            row = start + xp.arange(length, dtype=xp.int64, device=device)
        values[name] = xp.reshape(row, tuple(shape))
    return Grid(values, ranges, 3)


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


def _unbroadcast(xp, g, shape):
    """Sum ``g`` down to ``shape`` (undo broadcasting)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    extra = g.ndim - len(shape)
    if extra > 0:
        g = xp.sum(g, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return g


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def scatter_add(xp, target, index, values) -> None:
    """``target.flat[index] += values`` with repeated indices summed, in pure Array API operations.

    Sorts the indices once, takes differences of a float64 running sum at
    each index's first and last occurrence, and adds the resulting dense run
    to the contiguous slice of ``target`` the indices span (host indices:
    read on the host) or to all of ``target`` (device indices are never read
    on the host; they lie inside ``target``). ``target`` must be
    C-contiguous (its reshape to 1-D is a view).
    """
    index = xp.reshape(index, (-1,))
    values = xp.reshape(values, (-1,))
    if index.shape[0] == 0:
        return
    if is_host_array(index):
        lo, hi = int(xp.min(index)), int(xp.max(index))
    else:
        lo, hi = 0, math.prod(target.shape) - 1
    order = xp.argsort(index)
    sorted_index = xp.take(index, order)
    sums = xp.cumulative_sum(xp.astype(xp.take(values, order), xp.float64), include_initial=True)
    positions = xp.arange(
        lo, hi + 1, dtype=sorted_index.dtype, device=array_api_compat.device(index)
    )
    last = xp.searchsorted(sorted_index, positions, side="right")
    first = xp.searchsorted(sorted_index, positions, side="left")
    run = xp.take(sums, last) - xp.take(sums, first)
    flat = xp.reshape(target, (-1,))
    flat[lo : hi + 1] += xp.astype(run, target.dtype)


class BoundGraph:
    """A :class:`Graph` bound to a namespace, a float dtype and its captured arrays.

    :meth:`run` evaluates every node over a :class:`Grid`; :meth:`backprop`
    runs the reverse mode from a cotangent of the output, returning the
    score's cotangent and adding the captured arrays' gradients into their
    accumulators.
    """

    def __init__(self, graph, xp, float_dtype, device, arrays=None):
        self.graph, self.xp, self.float_dtype, self.device = graph, xp, float_dtype, device
        self.arrays = [s.array for s in graph.slots] if arrays is None else list(arrays)
        self._flat: dict[int, Any] = {}
        dtypes = {BOOL: xp.bool, INT: xp.int64, FLOAT: float_dtype}
        self._consts = {
            i: xp.asarray(n.value, dtype=dtypes[n.kind], device=device)
            for i, n in enumerate(graph.nodes)
            if n.op == "const"
        }
        self._zero = xp.asarray(0.0, dtype=float_dtype, device=device)
        self._active: dict[tuple, frozenset] = {}

    def _float(self, value, kind):
        return value if kind == FLOAT else self.xp.astype(value, self.float_dtype)

    def run(self, grid: Grid, score=None) -> list:
        """Values of every node (output: ``values[graph.output]``); ``score`` feeds the score."""
        xp, nodes = self.xp, self.graph.nodes
        values: list = [None] * len(nodes)
        for i, node in enumerate(nodes):
            op = node.op
            if op == "input":
                values[i] = score if node.value == "score" else grid.values[node.value]
            elif op == "const":
                values[i] = self._consts[i]
            elif op == "gather":
                values[i] = self._gather(i, node, values, grid)
            else:
                args = [values[a] for a in node.args]
                kinds = [nodes[a].kind for a in node.args]
                if node.kind == FLOAT or (op in _ORDER + ("eq", "ne") and FLOAT in kinds):
                    start = 1 if op == "where" else 0
                    args[start:] = [self._float(v, k) for v, k in zip(args[start:], kinds[start:])]
                values[i] = _EVAL[op](xp, *args)
        return values

    def _slices(self, i, grid):
        """``(slices, grid axis per array axis)`` reading gather ``i`` as a plain slice, or None."""
        slices, axes = [], []
        for form in self.graph.forms[i]:
            if form is None:
                return None
            if form[0] == "const":
                slices.append(slice(form[1], form[1] + 1))
                axes.append(None)
                continue
            span = grid.ranges.get(form[1])
            if span is None:
                return None
            axis, start, length = span
            slices.append(slice(start + form[2], start + form[2] + length))
            axes.append(axis)
        used = [a for a in axes if a is not None]
        if len(set(used)) != len(used):
            return None
        return tuple(slices), axes

    def _grid_shape(self, axes, lengths, rank):
        shape = [1] * rank
        for axis, n in zip(axes, lengths):
            if axis is not None:
                shape[axis] = n
        return tuple(shape)

    def _gather(self, i, node, values, grid):
        xp = self.xp
        array = self.arrays[node.value]
        plan = self._slices(i, grid)
        if plan is not None:
            slices, axes = plan
            block = array[slices]
            lengths = [s.stop - s.start for s in slices]
            kept = [(a, n) for a, n in zip(axes, lengths) if a is not None]
            block = xp.reshape(block, tuple(n for _, n in kept))
            order = sorted(range(len(kept)), key=lambda k: kept[k][0])
            if order != list(range(len(kept))):
                block = xp.permute_dims(block, tuple(order))
            out = xp.reshape(block, self._grid_shape(axes, lengths, grid.rank))
        else:
            flat_index = self._flat_index(i, node, values)
            out = xp.reshape(
                xp.take(self._flat_array(node.value), xp.reshape(flat_index, (-1,))),
                tuple(flat_index.shape),
            )
        return self._float(out, node.kind) if node.kind == FLOAT else out

    def _flat_array(self, slot):
        if slot not in self._flat:
            self._flat[slot] = self.xp.reshape(self.arrays[slot], (-1,))
        return self._flat[slot]

    def _flat_index(self, i, node, values):
        shape = tuple(self.arrays[node.value].shape)
        flat = None
        for axis, (a, stride) in enumerate(zip(node.args, _contiguous_strides(shape))):
            index = values[a]
            if (i, axis) in self.graph.clamped:
                index = self.xp.clip(index, 0, shape[axis] - 1)
            term = index * stride
            flat = term if flat is None else flat + term
        return flat

    def _active_nodes(self, grads) -> frozenset:
        key = tuple(g is not None for g in grads)
        if key not in self._active:
            active = set()
            for i, node in enumerate(self.graph.nodes):
                if node.op == "input":
                    hit = node.value == "score"
                elif node.op == "gather":
                    hit = grads[node.value] is not None
                else:
                    hit = node.kind == FLOAT and builtins.any(a in active for a in node.args)
                if hit:
                    active.add(i)
            self._active[key] = frozenset(active)
        return self._active[key]

    def backprop(self, values, grid, cotangent, grads):
        """Reverse mode from ``cotangent`` (d loss / d output) through the values of :meth:`run`.

        Parameters
        ----------
        values : list
            From :meth:`run` on the same grid.
        grid : Grid
        cotangent : array
            Broadcastable to the output's shape.
        grads : sequence of array or None
            One per slot: an accumulator shaped like the captured array
            (gradients are ADDED), or None for no gradient.

        Returns
        -------
        array or None
            d loss / d score (None when the output does not depend on the score).
        """
        xp, nodes = self.xp, self.graph.nodes
        active = self._active_nodes(grads)
        out = self.graph.output
        if out not in active:
            return None
        cots = {out: _unbroadcast(xp, cotangent, values[out].shape)}
        d_score = None
        for i in range(out, -1, -1):
            g = cots.pop(i, None)
            if g is None:
                continue
            node = nodes[i]
            if node.op == "input":
                d_score = g
            elif node.op == "gather":
                self._scatter(i, node, values, grid, g, grads[node.value])
            else:
                for a, contribution in self._local(i, node, values, g, active):
                    contribution = _unbroadcast(xp, contribution, values[a].shape)
                    cots[a] = cots[a] + contribution if a in cots else contribution
        return d_score

    def _local(self, i, node, values, g, active):
        """``(arg, d loss / d arg)`` for the active args of node ``i`` given its cotangent ``g``."""
        xp, nodes = self.xp, self.graph.nodes
        op, args = node.op, node.args

        def arg(k):
            return self._float(values[args[k]], nodes[args[k]].kind)

        want = [a in active for a in args]
        if op == "add":
            return [(a, g) for a, w in zip(args, want) if w]
        if op == "sub":
            return [(a, g if k == 0 else -g) for k, (a, w) in enumerate(zip(args, want)) if w]
        if op == "mul":
            return [(args[k], g * arg(1 - k)) for k in (0, 1) if want[k]]
        if op == "div":
            out = [(args[0], g / arg(1))] if want[0] else []
            if want[1]:
                out.append((args[1], -g * values[i] / arg(1)))
            return out
        if op == "mod":
            out = [(args[0], g)] if want[0] else []
            if want[1]:
                out.append((args[1], -g * xp.floor_divide(arg(0), arg(1))))
            return out
        if op == "pow":
            out = [(args[0], g * (arg(1) * xp.pow(arg(0), arg(1) - 1.0)))] if want[0] else []
            if want[1]:
                # d/dy x**y = x**y log x; 0 where x**y is 0 (x = 0, y > 0), not 0 * -inf
                power = values[i]
                safe = xp.where(power == 0.0, xp.ones_like(power), arg(0))
                out.append((args[1], xp.where(power == 0.0, self._zero, g * power * xp.log(safe))))
            return out
        if op == "neg":
            return [(args[0], -g)]
        if op == "abs":
            return [(args[0], g * xp.sign(arg(0)))]
        if op == "exp":
            return [(args[0], g * values[i])]
        if op == "log":
            return [(args[0], g / arg(0))]
        if op == "tanh":
            return [(args[0], g * (1.0 - values[i] * values[i]))]
        if op == "sqrt":
            return [(args[0], g * 0.5 / values[i])]
        if op == "exp2":
            return [(args[0], g * (math.log(2.0) * values[i]))]
        if op == "sin":
            return [(args[0], g * xp.cos(arg(0)))]
        if op == "cos":
            return [(args[0], -g * xp.sin(arg(0)))]
        if op == "tan":
            return [(args[0], g * (1.0 + values[i] * values[i]))]
        if op == "sigmoid":
            return [(args[0], g * (values[i] * (1.0 - values[i])))]
        if op in ("minimum", "maximum"):
            first = (
                xp.less_equal(arg(0), arg(1))
                if op == "minimum"
                else xp.greater_equal(arg(0), arg(1))
            )
            out = [(args[0], xp.where(first, g, self._zero))] if want[0] else []
            if want[1]:
                out.append((args[1], xp.where(first, self._zero, g)))
            return out
        if op == "where":
            cond = values[args[0]]
            out = [(args[1], xp.where(cond, g, self._zero))] if want[1] else []
            if want[2]:
                out.append((args[2], xp.where(cond, self._zero, g)))
            return out
        return []

    def _scatter(self, i, node, values, grid, g, acc):
        if acc is None:
            return
        xp = self.xp
        plan = self._slices(i, grid)
        if plan is None:
            scatter_add(xp, acc, self._flat_index(i, node, values), g)
            return
        slices, axes = plan
        lengths = [s.stop - s.start for s in slices]
        kept = [(a, n) for a, n in zip(axes, lengths) if a is not None]
        by_axis = sorted(range(len(kept)), key=lambda k: kept[k][0])
        block = xp.reshape(g, tuple(kept[k][1] for k in by_axis))
        back = sorted(range(len(kept)), key=lambda k: by_axis[k])
        if back != list(range(len(kept))):
            block = xp.permute_dims(block, tuple(back))
        acc[slices] += xp.astype(xp.reshape(block, tuple(lengths)), acc.dtype)


# --------------------------------------------------------------------------- mods


def _to_host(a) -> np.ndarray:
    """A NumPy copy (or view) of array ``a`` from any namespace or device."""
    if isinstance(a, np.ndarray):
        return a
    if array_api_compat.is_torch_array(a):
        return a.detach().cpu().numpy()
    if array_api_compat.is_cupy_array(a):
        return a.get()
    return np.from_dlpack(a)


def _array_kind(owner: str, name: str, a) -> str:
    try:
        xp = array_api_compat.array_namespace(a)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be an array, got {type(a).__name__}") from None
    if a.dtype == xp.bool:
        return BOOL
    if xp.isdtype(a.dtype, "integral"):
        return INT
    if xp.isdtype(a.dtype, "real floating"):
        return FLOAT
    raise TypeError(f"{owner}: {name} must have a bool, integer or real float dtype, got {a.dtype}")


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


def _takes_q_row(fn) -> bool:
    try:
        return "q_row" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class CallShape:
    """What a mod is checked against: batch, query heads, query/key counts and query positions."""

    batch: int
    heads: int
    n_q: int
    n_kv: int
    #: ``input_pos`` per batch (length 1 when shared); None when it is a device array,
    #: whose values are not read on the host
    positions: tuple[int, ...] | None

    def ranges(self) -> dict:
        """Inclusive range of every index input over the call (None: device values)."""
        q_idx = None
        if self.positions is not None:
            first = builtins.min(self.positions)
            q_idx = (first, builtins.max(self.positions) + self.n_q - 1)
        return {
            "b": (0, self.batch - 1),
            "h": (0, self.heads - 1),
            "q_idx": q_idx,
            "q_row": (0, self.n_q - 1),
            "kv_idx": (0, self.n_kv - 1),
        }

    def describe(self) -> str:
        q_idx = self.ranges()["q_idx"]
        where = "from input_pos on the device" if q_idx is None else f"in [{q_idx[0]}, {q_idx[1]}]"
        return f"b < {self.batch}, h < {self.heads}, q_idx {where}, kv_idx < {self.n_kv}"


class _Mod:
    """What mask and score mods share: a function, its captured arrays and its traced graph."""

    _returns = BOOL

    def __init__(self, fn, /, **arrays):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        label = self.label
        self._kinds = {name: _array_kind(label, name, a) for name, a in arrays.items()}
        self.arrays = dict(arrays)
        self._bounds = {
            name: _host_bounds(a) for name, a in arrays.items() if self._kinds[name] == INT
        }
        self._q_row = _takes_q_row(fn)
        self.graph = self._trace()

    @property
    def label(self) -> str:
        """Name used in messages: the class, or ``MaskMod(fn)`` / ``ScoreMod(fn)``."""
        if type(self) in (MaskMod, ScoreMod):
            return f"{type(self).__name__}({getattr(self.fn, '__name__', 'fn')})"
        return type(self).__name__

    def _trace(self) -> Graph:
        tracer = _Tracer()
        inputs = {
            name: tracer.node("input", (), name, FLOAT if name == "score" else INT)
            for name in INPUTS
        }
        return tracer.graph(self._emit(tracer, inputs, ()), self._returns)

    def _emit(self, tracer, inputs, path):
        """Trace this mod's function with the symbolic ``inputs``; returns its result."""
        captured = {
            name: CapturedArray(
                tracer,
                path,
                name,
                f"{self.label}.{name}",
                a,
                self._kinds[name],
                self._bounds.get(name),
            )
            for name, a in self.arrays.items()
        }
        if self._q_row:
            captured["q_row"] = inputs["q_row"]
        head = (inputs["score"],) if self._returns == FLOAT else ()
        return self.fn(
            *head, inputs["b"], inputs["h"], inputs["q_idx"], inputs["kv_idx"], **captured
        )

    def _apply(self, head, b, h, q_idx, kv_idx, q_row):
        """The function on concrete values (arrays or numbers)."""
        extra = dict(self.arrays)
        if self._q_row:
            extra["q_row"] = q_idx if q_row is None else q_row
        return self.fn(*head, b, h, q_idx, kv_idx, **extra)

    def _check(self, fn: str, call: CallShape) -> None:
        """Raise ValueError when this mod's arrays do not fit ``call`` (built-ins override)."""

    def validate(self, fn: str, call: CallShape, read_device: bool = False) -> frozenset:
        """ValueError unless the mod fits the call: its own checks, then every index in bounds.

        Returns the indices to clamp (see :meth:`Graph.check_indices`, which
        ``read_device`` is passed to).
        """
        self._check(fn, call)
        return self.graph.check_indices(fn, call.ranges(), call.describe(), read_device)

    def __repr__(self):
        return self.label


class MaskMod(_Mod):
    """A mask mod: ``fn(b, h, q_idx, kv_idx, **arrays) -> condition``, traced once.

    Parameters
    ----------
    fn : callable
        ``fn(b, h, q_idx, kv_idx, *, q_row=..., **arrays)``; returns True where
        the query may attend to the key. Written with Python operators and
        this module's helpers (see the module docstring).
    **arrays : array
        Arrays ``fn`` reads, passed to it by keyword (integer or bool arrays
        such as document ids).

    Notes
    -----
    Combine masks with ``a & b`` and ``a | b``. Calling a mask on concrete
    values (``mask(b, h, q_idx, kv_idx)``) runs ``fn`` directly on them.
    """

    _returns = BOOL

    def __call__(self, b, h, q_idx, kv_idx, *, q_row=None):
        return self._apply((), b, h, q_idx, kv_idx, q_row)

    def __and__(self, other):
        return AndMask(self, as_mask_mod(other, "MaskMod &: the other operand"))

    def __rand__(self, other):
        return AndMask(as_mask_mod(other, "MaskMod &: the other operand"), self)

    def __or__(self, other):
        return OrMask(self, as_mask_mod(other, "MaskMod |: the other operand"))

    def __ror__(self, other):
        return OrMask(as_mask_mod(other, "MaskMod |: the other operand"), self)

    def _band(self, positions, n_kv):
        """``(lo, hi, full_lo, full_hi)`` per query position.

        Every kept key lies in ``[lo, hi]``; every key in ``[full_lo, full_hi]``
        is kept. Non-band masks: every key possible, none sure.
        """
        zero = np.zeros_like(positions)
        return zero, zero + (n_kv - 1), zero + n_kv, zero - 1


class _CompositeMask(MaskMod):
    _combine = staticmethod(logical_and)
    _symbol = "&"

    def __init__(self, *parts):
        flat = []
        for part in parts:
            flat.extend(part.parts if type(part) is type(self) else (part,))
        self.parts = tuple(flat)
        self.fn = None
        self.arrays = {}
        self._bounds = {}
        self._q_row = False
        self.graph = self._trace()

    @property
    def label(self) -> str:
        return f" {self._symbol} ".join(
            f"({p.label})" if isinstance(p, _CompositeMask) else p.label for p in self.parts
        )

    def _emit(self, tracer, inputs, path):
        result = None
        for k, part in enumerate(self.parts):
            value = part._emit(tracer, inputs, path + (k,))
            result = value if result is None else self._combine(result, value)
        return result

    def __call__(self, b, h, q_idx, kv_idx, *, q_row=None):
        result = None
        for part in self.parts:
            value = part(b, h, q_idx, kv_idx, q_row=q_row)
            result = value if result is None else self._combine(result, value)
        return result

    def _check(self, fn, call):
        for part in self.parts:
            part._check(fn, call)


class AndMask(_CompositeMask):
    """``a & b``: keys every part keeps. Its band is the intersection of the parts' bands."""

    def _band(self, positions, n_kv):
        bands = [p._band(positions, n_kv) for p in self.parts]
        lo, hi, flo, fhi = bands[0]
        for lo2, hi2, flo2, fhi2 in bands[1:]:
            lo, hi = np.maximum(lo, lo2), np.minimum(hi, hi2)
            flo, fhi = np.maximum(flo, flo2), np.minimum(fhi, fhi2)
        return lo, hi, flo, fhi


class OrMask(_CompositeMask):
    """``a | b``: keys any part keeps. Its band is the hull of the parts' possible keys and
    the union of their sure keys where that union is one interval (else the longer one)."""

    _combine = staticmethod(logical_or)
    _symbol = "|"

    def _band(self, positions, n_kv):
        bands = [p._band(positions, n_kv) for p in self.parts]
        lo, hi, flo, fhi = bands[0]
        for lo2, hi2, flo2, fhi2 in bands[1:]:
            lo, hi = np.minimum(lo, lo2), np.maximum(hi, hi2)
            empty1, empty2 = flo > fhi, flo2 > fhi2
            joined = ~empty1 & ~empty2 & (flo2 <= fhi + 1) & (flo <= fhi2 + 1)
            first_longer = (fhi - flo) >= (fhi2 - flo2)
            take_first = empty2 | (~empty1 & first_longer)
            flo = np.where(joined, np.minimum(flo, flo2), np.where(take_first, flo, flo2))
            fhi = np.where(joined, np.maximum(fhi, fhi2), np.where(take_first, fhi, fhi2))
        return lo, hi, flo, fhi


def _non_negative_int(owner, name, value) -> int:
    if isinstance(value, bool) or _scalar(value) is None or not isinstance(_scalar(value), int):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
    return int(value)


class FullMask(MaskMod):
    """Every key: ``True``."""

    def __init__(self):
        super().__init__(self._keep)

    @staticmethod
    def _keep(b, h, q_idx, kv_idx):
        return True

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, zero + (n_kv - 1), zero, zero + (n_kv - 1)


class CausalMask(MaskMod):
    """Keys at or before the query's position: ``kv_idx <= q_idx``."""

    def __init__(self):
        super().__init__(self._keep)

    @staticmethod
    def _keep(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, positions, zero, positions


class SlidingWindowMask(MaskMod):
    """The ``w`` keys before the query and the query itself: ``q_idx - w <= kv_idx <= q_idx``.

    Parameters
    ----------
    w : int
        Window length behind the query (``w = 0``: the query's own position only).
    """

    def __init__(self, w: int):
        self.w = _non_negative_int("SlidingWindowMask", "w", w)
        super().__init__(self._keep)

    def _keep(self, b, h, q_idx, kv_idx):
        return logical_and(q_idx - self.w <= kv_idx, kv_idx <= q_idx)

    def _band(self, positions, n_kv):
        return positions - self.w, positions, positions - self.w, positions

    @property
    def label(self):
        return f"SlidingWindowMask({self.w})"


class PrefixMask(MaskMod):
    """The first ``n`` keys, for every query: ``kv_idx < n``."""

    def __init__(self, n: int):
        self.n = _non_negative_int("PrefixMask", "n", n)
        super().__init__(self._keep)

    def _keep(self, b, h, q_idx, kv_idx):
        return kv_idx < self.n

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, zero + (self.n - 1), zero, zero + (self.n - 1)

    @property
    def label(self):
        return f"PrefixMask({self.n})"


def prefix_lm(n: int) -> MaskMod:
    """Prefix-LM mask: the first ``n`` keys are visible to every query, the rest causally.

    ``CausalMask() | PrefixMask(n)``.
    """
    return CausalMask() | PrefixMask(n)


class DocumentMask(MaskMod):
    """Queries attend only to keys of the same document: ``doc_q[q] == doc_kv[kv]``.

    Parameters
    ----------
    doc_q : integer array, ``(S,)`` or ``(B, S)``
        With ``doc_kv`` None: the document id of every POSITION, read at both
        ``q_idx`` and ``kv_idx`` (``S`` = Sk, and query positions must be < Sk).
        With ``doc_kv``: the document id of every query ROW of the call
        (``S`` = Sq).
    doc_kv : integer array, ``(Sk,)`` or ``(B, Sk)``, optional
        Document id of every key.

    ``(B, S)`` ids differ per batch; ``(S,)`` ids are shared.
    """

    def __init__(self, doc_q, doc_kv=None):
        arrays = {"doc_q": doc_q} if doc_kv is None else {"doc_q": doc_q, "doc_kv": doc_kv}
        for name, a in arrays.items():
            if _array_kind("DocumentMask", name, a) != INT or a.ndim not in (1, 2):
                raise TypeError(
                    f"DocumentMask: {name} must be an integer array of shape (S,) or (B, S), "
                    f"got dtype {a.dtype} shape {tuple(a.shape)}"
                )
        super().__init__(self._keep, **arrays)

    def _keep(self, b, h, q_idx, kv_idx, *, q_row, doc_q, doc_kv=None):
        def read(ids, i):
            return ids[b, i] if ids.ndim == 2 else ids[i]

        if doc_kv is None:
            return read(doc_q, q_idx) == read(doc_q, kv_idx)
        return read(doc_q, q_row) == read(doc_kv, kv_idx)

    def _check(self, fn, call):
        own = self.arrays.get("doc_kv") is None
        wanted = {"doc_q": call.n_kv if own else call.n_q, "doc_kv": call.n_kv}
        for name, a in self.arrays.items():
            shape = tuple(a.shape)
            if shape[-1] != wanted[name] or (len(shape) == 2 and shape[0] != call.batch):
                layout = f"({wanted[name]},) or ({call.batch}, {wanted[name]})"
                role = (
                    "one id per key position (doc_kv is None)"
                    if own
                    else ("one id per query row" if name == "doc_q" else "one id per key")
                )
                raise ValueError(
                    f"{fn}: DocumentMask.{name} must have shape {layout}, {role}; got {shape}"
                )
        q_idx = call.ranges()["q_idx"]
        if own and q_idx is not None and q_idx[1] >= call.n_kv:
            raise ValueError(
                f"{fn}: DocumentMask.doc_q holds ids for positions < {call.n_kv} but query "
                f"positions reach {q_idx[1]}; pass doc_kv (and per-row doc_q) for queries past "
                "the keys"
            )


class ScoreMod(_Mod):
    """A score mod: ``fn(score, b, h, q_idx, kv_idx, **arrays) -> number``, traced once.

    Parameters
    ----------
    fn : callable
        ``fn(score, b, h, q_idx, kv_idx, *, q_row=..., **arrays)``; returns
        the new score. Written with Python operators and this module's
        helpers.
    **arrays : array
        Arrays ``fn`` reads, passed to it by keyword. Every float array gets
        a gradient: ``grad_shadow(mod)`` allocates zeroed accumulators and
        the flex backward ADDS into them.

    Notes
    -----
    ``a >> b`` applies ``a`` then ``b``. Calling a score mod on concrete
    values runs ``fn`` directly on them.
    """

    _returns = FLOAT

    def __call__(self, score, b, h, q_idx, kv_idx, *, q_row=None):
        return self._apply((score,), b, h, q_idx, kv_idx, q_row)

    def __rshift__(self, other):
        return ScoreChain(self, as_score_mod(other, "ScoreMod >>: the other operand"))

    def __rrshift__(self, other):
        return ScoreChain(as_score_mod(other, "ScoreMod >>: the other operand"), self)

    def _grad_fields(self, feature_grads: bool) -> tuple[str, ...]:
        """Fields that receive gradients."""
        return tuple(name for name, kind in self._kinds.items() if kind == FLOAT)

    def _grad_tree(self, zeros, feature_grads) -> ScoreModGrad:
        names = self._grad_fields(feature_grads)
        return ScoreModGrad(
            self.label,
            {name: zeros(self.arrays[name]) for name in names},
            sources={name: self.arrays[name] for name in names},
        )

    def __grad_shadow__(self, *, feature_grads: bool = False) -> ScoreModGrad:
        """Zeroed accumulators for the mod's learnable arrays: float32 (float64 for float64).

        ``feature_grads=True`` also gives PairFeatureScore's q/k features gradients.
        """
        return self._grad_tree(_zeros_accumulator, bool(feature_grads))


def _zeros_accumulator(a):
    xp = array_api_compat.array_namespace(a)
    dtype = xp.float64 if a.dtype == xp.float64 else xp.float32
    return xp.zeros(tuple(a.shape), dtype=dtype, device=array_api_compat.device(a))


def _zeros_host(a):
    return np.zeros(tuple(a.shape), dtype=np.float64)


class ScoreChain(ScoreMod):
    """``a >> b >> ...``: each score mod applied to the previous one's result."""

    def __init__(self, *parts):
        flat = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, ScoreChain) else (part,))
        self.parts = tuple(flat)
        self.fn = None
        self.arrays = {}
        self._kinds = {}
        self._bounds = {}
        self._q_row = False
        self.graph = self._trace()

    @property
    def label(self):
        return " >> ".join(p.label for p in self.parts)

    def _emit(self, tracer, inputs, path):
        score = inputs["score"]
        for k, part in enumerate(self.parts):
            score = part._emit(
                tracer, {**inputs, "score": tracer.lift(score, "a score mod's result")}, path + (k,)
            )
        return score

    def __call__(self, score, b, h, q_idx, kv_idx, *, q_row=None):
        for part in self.parts:
            score = part(score, b, h, q_idx, kv_idx, q_row=q_row)
        return score

    def _check(self, fn, call):
        for part in self.parts:
            part._check(fn, call)

    def _grad_tree(self, zeros, feature_grads):
        return ScoreModGrad(
            self.label, parts=tuple(p._grad_tree(zeros, feature_grads) for p in self.parts)
        )


class ScoreModGrad:
    """Gradient accumulators of a score mod's captured arrays: ``grad_shadow(score_mod)``.

    Fields are reached by name (``g.slopes``, ``g.table``); the parts of a
    ``>>`` composition by position (``g[0].slopes``), or by name when only one
    part has it. The flex backward ADDS into every accumulator, so one
    ``grad_shadow`` holds one backward's gradients; :meth:`zero_` resets it
    for reuse.
    """

    def __init__(
        self, label: str, fields: dict | None = None, parts: tuple = (), sources: dict | None = None
    ):
        self._label = label
        self._fields = dict(fields or {})
        self._parts = tuple(parts)
        self._sources = dict(sources or {})

    def made_for(self, mod) -> bool:
        """True when these accumulators are ``grad_shadow`` of ``mod``: same mods, same arrays.

        A mod rebuilt over the same arrays (or fresh views of the same memory)
        matches; a mod with other arrays or of another kind does not.
        """
        if not isinstance(mod, ScoreMod) or self._label != mod.label:
            return False
        parts = mod.parts if isinstance(mod, ScoreChain) else ()
        if len(parts) != len(self._parts):
            return False
        if any(
            mod.arrays.get(name) is None or not same_memory(mod.arrays[name], a)
            for name, a in self._sources.items()
        ):
            return False
        return all(g.made_for(p) for g, p in zip(self._parts, parts))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._fields:
            return self._fields[name]
        found = [p for p in self._parts if name in dict(p.items())]
        if len(found) == 1:
            return getattr(found[0], name)
        if found:
            raise AttributeError(
                f"{self._label}: several parts have a gradient {name!r}; pick one with g[i].{name}"
            )
        raise AttributeError(
            f"{self._label} has no gradient {name!r} (it has {[n for n, _ in self.items()]})"
        )

    def __getitem__(self, i):
        return self._parts[i]

    def __len__(self):
        return len(self._parts)

    def items(self):
        """``(name, accumulator)`` for every field (``"i.name"`` inside compositions)."""
        out = list(self._fields.items())
        for k, part in enumerate(self._parts):
            out.extend((f"{k}.{name}", a) for name, a in part.items())
        return out

    def zero_(self) -> None:
        """Set every accumulator to zero (to reuse it for another backward)."""
        for _, a in self.items():
            a[...] = 0

    def lookup(self, path: tuple, field: str):
        """The accumulator of ``field`` of the part at ``path`` (None: no gradient)."""
        node = self
        for k in path:
            node = node._parts[k]
        return node._fields.get(field)

    def __repr__(self):
        fields = ", ".join(f"{n}{tuple(a.shape)}" for n, a in self.items())
        return f"ScoreModGrad({self._label}: {fields})"


class NoOpScore(ScoreMod):
    """The score unchanged."""

    def __init__(self):
        super().__init__(self._score)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx):
        return score


class SoftCapScore(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2 soft-capping); ``cap`` is a constant: no gradient."""

    def __init__(self, cap: float):
        value = _scalar(cap)
        if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"SoftCapScore: cap must be a finite number > 0, got {cap!r}")
        self.cap = float(value)
        super().__init__(self._score)

    def _score(self, score, b, h, q_idx, kv_idx):
        return self.cap * tanh(score / self.cap)

    @property
    def label(self):
        return f"SoftCapScore({self.cap:g})"


class AliBiScore(ScoreMod):
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``.

    Parameters
    ----------
    slopes : float array ``(H,)``
        One slope per query head; learnable (gradient in ``grad_shadow(mod).slopes``).
    """

    def __init__(self, slopes):
        if _array_kind("AliBiScore", "slopes", slopes) != FLOAT or slopes.ndim != 1:
            raise TypeError(
                "AliBiScore: slopes must be a float array of shape (H,), "
                f"got {tuple(slopes.shape)} {slopes.dtype}"
            )
        super().__init__(self._score, slopes=slopes)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx, *, slopes):
        return score + slopes[h] * (kv_idx - q_idx)

    def _check(self, fn, call):
        shape = tuple(self.arrays["slopes"].shape)
        if shape != (call.heads,):
            raise ValueError(
                f"{fn}: AliBiScore.slopes must have shape ({call.heads},), one per query head; "
                f"got {shape}"
            )


class BiasScore(ScoreMod):
    """``score + bias[b, h, q_row, kv_idx]``, broadcast over a batch or head axis of length 1.

    Parameters
    ----------
    bias : float array ``(Bb, Hb, Sq, Sk)``
        ``Bb`` is 1 or B, ``Hb`` is 1 or H; row ``i`` is the call's query row
        (position ``input_pos + i``). Learnable (gradient in ``grad_shadow(mod).bias``).
    """

    def __init__(self, bias):
        if _array_kind("BiasScore", "bias", bias) != FLOAT or bias.ndim != 4:
            raise TypeError(
                "BiasScore: bias must be a float array of shape (Bb, Hb, Sq, Sk), "
                f"got {tuple(bias.shape)} {bias.dtype}"
            )
        super().__init__(self._score, bias=bias)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx, *, q_row, bias):
        return (
            score
            + bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0, q_row, kv_idx]
        )

    def _check(self, fn, call):
        shape = tuple(self.arrays["bias"].shape)
        if (
            shape[0] not in (1, call.batch)
            or shape[1] not in (1, call.heads)
            or shape[2:] != (call.n_q, call.n_kv)
        ):
            raise ValueError(
                f"{fn}: BiasScore.bias must have shape (Bb, Hb, {call.n_q}, {call.n_kv}) "
                f"with Bb in {{1, {call.batch}}} and Hb in {{1, {call.heads}}}; got {shape}"
            )


class PairFeatureScore(ScoreMod):
    """``score + sum_p pair_proj[h, p] * op(qv, kv)[p]`` from per-token features.

    The ``(Sq, Sk)`` bias is never materialised.

    Parameters
    ----------
    op : callable
        ``op(qv, kv) -> sequence of P values``, where ``qv`` is the tuple of
        the F features of the query row and ``kv`` those of the key; traced
        like any mod (e.g. ``lambda qv, kv: [abs(qv[0] - kv[0]), qv[1] * kv[1]]``).
    q_features : float array ``(B, Sq, F)``
    k_features : float array ``(B, Sk, F)``
    pair_proj : float array ``(H, P)``
        Per-head weights of the P pair features; learnable.

    ``grad_shadow(mod)`` holds ``pair_proj``'s gradient;
    ``grad_shadow(mod, feature_grads=True)`` adds the features' gradients.
    """

    def __init__(self, op, q_features, k_features, pair_proj):
        if not callable(op):
            raise TypeError(f"PairFeatureScore: op must be callable, got {type(op).__name__}")
        self.op = op
        for name, a, rank in (
            ("q_features", q_features, 3),
            ("k_features", k_features, 3),
            ("pair_proj", pair_proj, 2),
        ):
            if _array_kind("PairFeatureScore", name, a) != FLOAT or a.ndim != rank:
                raise TypeError(
                    f"PairFeatureScore: {name} must be a rank-{rank} float array, "
                    f"got {tuple(a.shape)} {a.dtype}"
                )
        if q_features.shape[2] != k_features.shape[2]:
            raise ValueError(
                f"PairFeatureScore: q_features and k_features must have the same feature count F, "
                f"got {q_features.shape[2]} and {k_features.shape[2]}"
            )
        super().__init__(
            self._score, q_features=q_features, k_features=k_features, pair_proj=pair_proj
        )

    def _score(self, score, b, h, q_idx, kv_idx, *, q_row, q_features, k_features, pair_proj):
        n_features = q_features.shape[2]
        qv = tuple(q_features[b, q_row, f] for f in range(n_features))
        kv = tuple(k_features[b, kv_idx, f] for f in range(n_features))
        pairs = self.op(qv, kv)
        pairs = tuple(pairs) if isinstance(pairs, (tuple, list)) else (pairs,)
        if len(pairs) != pair_proj.shape[1]:
            raise ValueError(
                f"PairFeatureScore: op returned {len(pairs)} pair features but pair_proj has "
                f"P = {pair_proj.shape[1]} columns"
            )
        for p, value in enumerate(pairs):
            score = score + pair_proj[h, p] * value
        return score

    def _grad_fields(self, feature_grads):
        return ("q_features", "k_features", "pair_proj") if feature_grads else ("pair_proj",)

    def _check(self, fn, call):
        n_features = self.arrays["q_features"].shape[2]
        n_pairs = self.arrays["pair_proj"].shape[1]
        for name, shape in (
            ("q_features", (call.batch, call.n_q, n_features)),
            ("k_features", (call.batch, call.n_kv, n_features)),
            ("pair_proj", (call.heads, n_pairs)),
        ):
            got = tuple(self.arrays[name].shape)
            if got != shape:
                raise ValueError(
                    f"{fn}: PairFeatureScore.{name} must have shape {shape}, got {got}"
                )


def _what(x) -> str:
    """``x`` described for a type error: a mod by its label and role, anything else by its type."""
    if isinstance(x, ScoreMod):
        return f"{x.label}, a score mod"
    if isinstance(x, MaskMod):
        return f"{x.label}, a mask mod"
    return type(x).__name__


def as_mask_mod(mask, where: str = "as_mask_mod: mask") -> MaskMod:
    """``mask`` itself, or a plain function ``(b, h, q_idx, kv_idx)`` traced into a MaskMod.

    A plain function is traced on every call that receives it; build the
    MaskMod once to trace once. ``where`` (``"function: argument"``) starts
    the TypeError raised for anything else.
    """
    if isinstance(mask, MaskMod):
        return mask
    if isinstance(mask, ScoreMod) or not callable(mask):
        raise TypeError(
            f"{where} must be a MaskMod or a function (b, h, q_idx, kv_idx) -> condition, "
            f"got {_what(mask)}"
        )
    return MaskMod(mask)


def as_score_mod(score, where: str = "as_score_mod: score") -> ScoreMod:
    """``score`` itself, or a function ``(score, b, h, q_idx, kv_idx)`` traced into a ScoreMod.

    ``where`` (``"function: argument"``) starts the TypeError raised for anything else.
    """
    if isinstance(score, ScoreMod):
        return score
    if isinstance(score, MaskMod) or not callable(score):
        raise TypeError(
            f"{where} must be a ScoreMod or a function (score, b, h, q_idx, kv_idx) -> number, "
            f"got {_what(score)}"
        )
    return ScoreMod(score)


# --------------------------------------------------------------------------- tiles and block masks


def _n_tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def band_states(
    mask: MaskMod, position: int, n_q: int, n_kv: int, tile_m: int, tile_n: int
) -> np.ndarray:
    """``(NQ, NK)`` int8 tile states of ``mask`` from its band (queries at ``position + row``).

    SKIP: no key of the tile can be kept by any query of the tile; FULL:
    every pair is surely kept; PARTIAL otherwise. Sound for any mask (non-band
    masks give PARTIAL everywhere).
    """
    nq_tiles, nk_tiles = _n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n)
    rows = np.minimum(np.arange(nq_tiles * tile_m), n_q - 1) + position
    lo, hi, flo, fhi = (np.reshape(x, (nq_tiles, tile_m)) for x in mask._band(rows, n_kv))
    k_first = np.arange(nk_tiles) * tile_n
    k_last = np.minimum(k_first + tile_n, n_kv) - 1
    lo, hi = lo.min(axis=1)[:, None], hi.max(axis=1)[:, None]
    flo, fhi = flo.max(axis=1)[:, None], fhi.min(axis=1)[:, None]
    some = (lo <= k_last[None, :]) & (hi >= k_first[None, :]) & (lo <= hi)
    full = (flo <= k_first[None, :]) & (fhi >= k_last[None, :])
    return np.where(full, FULL, np.where(some, PARTIAL, SKIP)).astype(np.int8)


@dataclass(frozen=True)
class TilePlan:
    """Which (query tile, key tile) pairs a kernel visits, and where it must evaluate the mask.

    ``states`` is ``(Bp, Hp, NQ, NK)`` int8 with ``Bp`` in {1, B} and ``Hp``
    in {1, H}: SKIP (0), PARTIAL (1, evaluate the mask), FULL (2, every pair
    kept).
    """

    tile_m: int
    tile_n: int
    states: np.ndarray

    def group(self, b: int, h0: int, h1: int) -> np.ndarray:
        """``(NQ, NK)`` states for query heads ``[h0, h1)`` of batch ``b``.

        Visited if any head visits; FULL only if FULL for every head.
        """
        s = self.states[b if self.states.shape[0] > 1 else 0]
        s = s[h0:h1] if s.shape[0] > 1 else s
        visited = np.any(s != SKIP, axis=0)
        full = np.all(s == FULL, axis=0)
        return np.where(full, FULL, np.where(visited, PARTIAL, SKIP)).astype(np.int8)


def plan_tiles(mask, block_mask, *, block_sparse, n_q, n_kv, positions, tile_m, tile_n) -> TilePlan:
    """The tile plan of a flex call.

    Parameters
    ----------
    mask : MaskMod or None
        The call's mask (None: every key).
    block_mask : BlockMask or None
        Precomputed tile states (its tiles are used); None derives them
        from ``mask``'s band with tiles ``tile_m`` x ``tile_n``.
    block_sparse : bool
        False visits every tile and evaluates the mask everywhere (the dense path).
    positions : tuple of int
        ``input_pos`` per batch.
    """
    if block_mask is not None:
        tile_m, tile_n = block_mask.tile_m, block_mask.tile_n
    shape = (_n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n))
    if mask is None:
        return TilePlan(tile_m, tile_n, np.full((1, 1) + shape, FULL, dtype=np.int8))
    if not block_sparse:
        return TilePlan(tile_m, tile_n, np.full((1, 1) + shape, PARTIAL, dtype=np.int8))
    if block_mask is not None:
        return TilePlan(tile_m, tile_n, block_mask.states)
    distinct = {p: band_states(mask, p, n_q, n_kv, tile_m, tile_n) for p in set(positions)}
    states = np.stack([distinct[p] for p in positions])[:, None]
    return TilePlan(tile_m, tile_n, states)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Tile states of a mask for fixed lengths, tiles and positions; see :func:`build_block_mask`.

    Attributes
    ----------
    mask_mod : MaskMod
        Evaluated on PARTIAL tiles.
    states : numpy.ndarray
        ``(Bm, Hm, NQ, NK)`` int8 (host memory): SKIP 0, PARTIAL 1, FULL 2;
        ``Bm``/``Hm`` are 1 when the mask does not depend on ``b``/``h``.
    n_q, n_kv : int
        Query and key counts it was built for.
    tile_m, tile_n : int
        Queries and keys per tile; flex attention computes in these tiles.
    input_pos : tuple of int
        Query position offset per batch (one entry when shared).
    """

    mask_mod: MaskMod
    states: np.ndarray
    n_q: int
    n_kv: int
    tile_m: int
    tile_n: int
    input_pos: tuple[int, ...]

    def kv_tiles(self, b: int = 0, h: int = 0, q_tile: int = 0) -> list[int]:
        """Key tiles visited by query tile ``q_tile`` of batch ``b``, head ``h``."""
        s = self.states[
            b if self.states.shape[0] > 1 else 0, h if self.states.shape[1] > 1 else 0, q_tile
        ]
        return [int(j) for j in np.nonzero(s != SKIP)[0]]

    @property
    def density(self) -> float:
        """Fraction of tiles visited."""
        return float(np.mean(self.states != SKIP)) if self.states.size else 0.0

    def __repr__(self):
        return (
            f"BlockMask({self.mask_mod.label}, n_q={self.n_q}, n_kv={self.n_kv}, "
            f"tiles={self.tile_m}x{self.tile_n}, "
            f"states={tuple(self.states.shape)}, density={self.density:.3f})"
        )


def positions_of(fn: str, input_pos, n_q: int = 1) -> tuple[int, ...]:
    """``input_pos`` (an int, or a 1-D integer array / sequence) as a tuple of Python ints.

    Arrays of any namespace are copied to the host (a planning step, such as
    :func:`build_block_mask`; flex attention itself never reads device
    positions). Positions may be negative (queries before the first key);
    ``q_idx = input_pos + row`` for rows below ``n_q`` must fit int64.
    """
    kinds = "an int or a (B,) integer array"
    values: tuple[int, ...]
    if isinstance(input_pos, bool):
        raise TypeError(f"{fn}: input_pos must be {kinds}, got a bool")
    single = _scalar(input_pos)
    if isinstance(single, int):
        values = (single,)
    elif single is not None:
        raise TypeError(f"{fn}: input_pos must be {kinds}, got {input_pos!r}")
    elif isinstance(input_pos, (list, tuple)):
        if not all(isinstance(_scalar(x), int) and not isinstance(x, bool) for x in input_pos):
            raise TypeError(
                f"{fn}: input_pos must be {kinds}, got a {type(input_pos).__name__} "
                "holding other values than ints"
            )
        values = tuple(int(x) for x in input_pos)
    else:
        if not array_api_compat.is_array_api_obj(input_pos):
            raise TypeError(f"{fn}: input_pos must be {kinds}, got {type(input_pos).__name__}")
        host = _to_host(input_pos)
        if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"{fn}: input_pos must be {kinds}, got {host.dtype} {host.shape}")
        values = tuple(int(x) for x in host)
    last = builtins.max(values) + builtins.max(n_q, 1) - 1 if values else 0
    if values and (builtins.min(values) < INT64_MIN or last > INT64_MAX):
        raise ValueError(
            f"{fn}: input_pos must keep every query position input_pos + row within int64 "
            f"[{INT64_MIN}, {INT64_MAX}], got values in [{builtins.min(values)}, "
            f"{builtins.max(values)}] for {n_q} query rows"
        )
    return values


def build_block_mask(
    keep, n_q: int, n_kv: int, *, tile_m: int, tile_n: int, input_pos=0, n_batch=None, n_heads=None
) -> BlockMask:
    """Classify every (query tile, key tile) of a mask as skipped, partial or full, vectorised.

    Band masks are classified from their declared key ranges; tiles the band
    leaves undecided are evaluated densely, many tiles per array operation
    (no per-element Python loop), in the namespace of the arrays the mask
    captures (NumPy when it captures none).

    Parameters
    ----------
    keep : MaskMod or callable
        The mask mod, or a predicate ``(b, h, q_idx, kv_idx)`` traced like one.
    n_q, n_kv : int
        Query and key counts of the calls it will serve.
    tile_m, tile_n : int
        Queries and keys per tile (>= 1); the flex kernel computes in these tiles.
    input_pos : int or (B,) integer array
        Position of query row 0 (per batch), as given to flex attention.
    n_batch, n_heads : int, optional
        Batch size and query heads; required when the mask reads ``b`` /
        ``h`` (the states are then per batch / head).

    Returns
    -------
    BlockMask
    """
    fn = "build_block_mask"
    mask = as_mask_mod(keep, f"{fn}: keep")
    n_q, n_kv = _non_negative_int(fn, "n_q", n_q), _non_negative_int(fn, "n_kv", n_kv)
    for name, tile in (("tile_m", tile_m), ("tile_n", tile_n)):
        if _non_negative_int(fn, name, tile) < 1:
            raise ValueError(f"{fn}: {name} must be >= 1, got {tile}")
    positions = positions_of(fn, input_pos, n_q)
    batch = _extent(
        fn, "n_batch", n_batch, "b", mask, len(positions) if len(positions) > 1 else None
    )
    heads = _extent(fn, "n_heads", n_heads, "h", mask, None)
    if len(positions) > 1 and len(positions) != batch:
        raise ValueError(f"{fn}: input_pos has {len(positions)} entries but n_batch is {batch}")
    mask.validate(fn, CallShape(batch, heads, n_q, n_kv, positions))
    per_batch = mask.graph.uses("b") or len(positions) > 1
    per_head = mask.graph.uses("h")
    bm, hm = (batch if per_batch else 1), (heads if per_head else 1)
    states = np.empty((bm, hm, _n_tiles(n_q, tile_m), _n_tiles(n_kv, tile_n)), dtype=np.int8)
    for b in range(bm):
        position = positions[b] if len(positions) > 1 else positions[0]
        band = band_states(mask, position, n_q, n_kv, tile_m, tile_n)
        states[b] = band[None]
        undecided = np.argwhere(band == PARTIAL)
        if len(undecided):
            refined = _dense_states(mask, b, position, hm, undecided, n_q, n_kv, tile_m, tile_n)
            states[b, :, undecided[:, 0], undecided[:, 1]] = refined.T
    stored = positions if len(positions) > 1 else positions[:1]
    return BlockMask(mask, states, n_q, n_kv, tile_m, tile_n, stored)


def _extent(fn, name, value, axis_name, mask, default):
    if value is None:
        if mask.graph.uses(axis_name) and default is None:
            raise ValueError(
                f"{fn}: the mask reads {axis_name}; pass {name} (the number of {axis_name} values)"
            )
        return default or 1
    value = _non_negative_int(fn, name, value)
    if value < 1:
        raise ValueError(f"{fn}: {name} must be >= 1, got {value}")
    return value


def _dense_states(mask, b, position, heads, tiles, n_q, n_kv, tile_m, tile_n) -> np.ndarray:
    """``(heads, len(tiles))`` states of the listed tiles, evaluating the mask on every pair."""
    slots = mask.graph.slots
    xp = array_api_compat.array_namespace(*(s.array for s in slots)) if slots else np
    device = array_api_compat.device(slots[0].array) if slots else "cpu"
    bound = mask.graph.bind(xp, xp.float64, device)
    chunk = builtins.max(1, _EVAL_ELEMENTS // (heads * tile_m * tile_n))
    out = np.empty((heads, len(tiles)), dtype=np.int8)
    for c0 in range(0, len(tiles), chunk):
        part = tiles[c0 : c0 + chunk]
        rows = part[:, 0][:, None] * tile_m + np.arange(tile_m)[None, :]
        keys = part[:, 1][:, None] * tile_n + np.arange(tile_n)[None, :]
        valid = (rows < n_q)[:, :, None] & (keys < n_kv)[:, None, :]
        rows, keys = np.minimum(rows, n_q - 1), np.minimum(keys, n_kv - 1)

        def put(a, shape):
            return xp.asarray(np.reshape(a, shape), device=device)

        n = len(part)
        grid = Grid(
            {
                "b": xp.asarray(b, dtype=xp.int64, device=device),
                "h": put(np.arange(heads, dtype=np.int64), (heads, 1, 1, 1)),
                "q_row": put(rows, (1, n, tile_m, 1)),
                "q_idx": put(rows + position, (1, n, tile_m, 1)),
                "kv_idx": put(keys, (1, n, 1, tile_n)),
            },
            rank=4,
        )
        kept = xp.broadcast_to(bound.run(grid)[mask.graph.output], (heads, n, tile_m, tile_n))
        valid_x = put(valid, (1, n, tile_m, tile_n))
        some = _to_host(xp.any(xp.logical_and(kept, valid_x), axis=(2, 3)))
        every = _to_host(xp.all(xp.logical_or(kept, xp.logical_not(valid_x)), axis=(2, 3)))
        out[:, c0 : c0 + n] = np.where(every, FULL, np.where(some, PARTIAL, SKIP))
    return out


# --------------------------------------------------------------------------- host evaluation


def _host_grid(b, h, q_idx, kv_idx, input_pos):
    values = {
        "b": np.asarray(b, dtype=np.int64),
        "h": np.asarray(h, dtype=np.int64),
        "q_idx": np.asarray(q_idx, dtype=np.int64),
        "kv_idx": np.asarray(kv_idx, dtype=np.int64),
    }
    values["q_row"] = values["q_idx"] - np.asarray(input_pos, dtype=np.int64)
    return Grid(values)


def _host_bound(mod):
    return mod.graph.bind(np, np.float64, "cpu", [_to_host(s.array) for s in mod.graph.slots])


def mask_value(mask_mod, q_idx, kv_idx, b=0, h=0, *, input_pos=0) -> np.ndarray:
    """Evaluate a mask mod's traced graph on the host (NumPy) for the given indices.

    Arguments broadcast against each other; ``q_idx`` is the query position
    (its row is ``q_idx - input_pos``). Returns a bool NumPy array.
    """
    mod = as_mask_mod(mask_mod, "mask_value: mask_mod")
    grid = _host_grid(b, h, q_idx, kv_idx, input_pos)
    out = _host_bound(mod).run(grid)[mod.graph.output]
    return np.broadcast_to(
        out, np.broadcast_shapes(*(v.shape for v in grid.values.values()))
    ).copy()


def score_value(score_mod, score, q_idx, kv_idx, b=0, h=0, *, input_pos=0) -> np.ndarray:
    """Evaluate a score mod's traced graph on the host, in float64, for the given scores."""
    mod = as_score_mod(score_mod, "score_value: score_mod")
    grid = _host_grid(b, h, q_idx, kv_idx, input_pos)
    score = np.asarray(score, dtype=np.float64)
    out = _host_bound(mod).run(grid, score)[mod.graph.output]
    shapes = [v.shape for v in grid.values.values()] + [score.shape]
    return np.broadcast_to(out, np.broadcast_shapes(*shapes)).copy()


def score_grad(
    score_mod, score, cotangent, q_idx, kv_idx, b=0, h=0, *, input_pos=0, feature_grads=False
):
    """The reverse mode of a score mod on the host, in float64 (what the backward uses).

    Returns
    -------
    d_score : numpy.ndarray
        ``cotangent * d(score out)/d(score in)``, broadcast to the inputs' shape.
    grads : ScoreModGrad
        Float64 NumPy gradients of the mod's captured arrays, summed over all
        given pairs.
    """
    mod = as_score_mod(score_mod, "score_grad: score_mod")
    grid = _host_grid(b, h, q_idx, kv_idx, input_pos)
    score = np.asarray(score, dtype=np.float64)
    shape = np.broadcast_shapes(*([v.shape for v in grid.values.values()] + [score.shape]))
    score = np.broadcast_to(score, shape)
    bound = _host_bound(mod)
    values = bound.run(grid, score)
    tree = mod._grad_tree(_zeros_host, bool(feature_grads))
    accumulators = [tree.lookup(s.path, s.field) for s in mod.graph.slots]
    cotangent = np.broadcast_to(np.asarray(cotangent, dtype=np.float64), shape)
    d_score = bound.backprop(values, grid, cotangent, accumulators)
    d_score = np.zeros(shape) if d_score is None else np.broadcast_to(d_score, shape).copy()
    return d_score, tree
