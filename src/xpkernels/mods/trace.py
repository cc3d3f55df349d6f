"""Tracing a mod into a graph: symbolic values, captured arrays and the traced helpers.

:class:`Sym`, the tracer, :class:`CapturedArray`, the helpers that trace inside a mod
and run elementwise outside it (:func:`exp`, :func:`minimum`, :func:`where`,
:func:`floor`, ...) and the NumPy ufunc / array-function hooks.
"""

from __future__ import annotations

import builtins
import math
import sys

import array_api_compat
import numpy as np

from .ir import (
    BOOL,
    FLOAT,
    INT,
    INT64_MAX,
    INT64_MIN,
    OPS,
    Graph,
    Node,
    Slot,
    _floor_int,
    reachable,
)


class TraceError(TypeError):
    """A mod used an operation that cannot be traced into a graph; the message names it."""


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
    order = reachable(nodes, [output])
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
    what = f"operator {OPS[op].symbol}"
    a, b = t.lift(x, what), t.lift(y, what)
    ka, kb = a.kind, b.kind
    if op in ("and", "or"):
        if ka != BOOL or kb != BOOL:
            raise TraceError(
                f"{what} needs two conditions, got {ka} and {kb} (bitwise operations on integers "
                "are not supported)"
            )
        return _apply(t, op, a, b)
    if op in ("eq", "ne"):
        if (ka == BOOL) != (kb == BOOL):
            raise TraceError(f"{what} compares a condition with a number ({ka} and {kb})")
        return _apply(t, op, a, b)
    if BOOL in (ka, kb):
        raise TraceError(f"{what} on a condition: turn it into a number with where(cond, 1, 0)")
    return _apply(t, op, a, b)


def _apply(t, op, *args):
    """The node of operation ``op`` on traced ``args``, of the kind the op table gives."""
    kind = OPS[op].kind([a.kind for a in args], [t.nodes[a._id] for a in args])
    return t.node(op, tuple(a._id for a in args), None, kind)


def _unary(op, x):
    t = x._tracer
    kind = x.kind
    if op == "not":
        if kind != BOOL:
            raise TraceError(
                f"logical_not (~) needs a condition, got {kind} (bitwise not is not supported)"
            )
        return _apply(t, op, x)
    if kind == BOOL:
        raise TraceError(f"{op} of a condition: turn it into a number with where(cond, 1, 0)")
    if op == "floor" and kind == INT:
        return x
    return _apply(t, op, x)


def _select(c, x, y):
    t = next(v for v in (c, x, y) if isinstance(v, Sym))._tracer
    c, a, b = (t.lift(v, "where") for v in (c, x, y))
    if c.kind != BOOL:
        raise TraceError(f"where needs a condition as its first argument, got {c.kind}")
    if (a.kind == BOOL) != (b.kind == BOOL):
        raise TraceError(f"where mixes a condition and a number ({a.kind} and {b.kind})")
    return _apply(t, "where", c, a, b)


def _extreme(op, x, y):
    t = (x if isinstance(x, Sym) else y)._tracer
    a, b = t.lift(x, op), t.lift(y, op)
    if BOOL in (a.kind, b.kind):
        raise TraceError(f"{op} of a condition: turn it into a number with where(cond, 1, 0)")
    return _apply(t, op, a, b)


def _operator(op: str, reflected: bool = False):
    """The :class:`Sym` method of binary ``op``: ``self op other`` (``other op self`` when
    ``reflected``)."""

    def method(self, other):
        return _binary(op, other, self) if reflected else _binary(op, self, other)

    return method


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

    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __truediv__ = _operator("div")
    __rtruediv__ = _operator("div", reflected=True)
    __floordiv__ = _operator("floordiv")
    __rfloordiv__ = _operator("floordiv", reflected=True)
    __mod__ = _operator("mod")
    __rmod__ = _operator("mod", reflected=True)
    __pow__ = _operator("pow")
    __rpow__ = _operator("pow", reflected=True)
    __lt__ = _operator("lt")
    __le__ = _operator("le")
    __gt__ = _operator("gt")
    __ge__ = _operator("ge")
    __eq__ = _operator("eq")
    __ne__ = _operator("ne")
    __and__ = _operator("and")
    __rand__ = _operator("and", reflected=True)
    __or__ = _operator("or")
    __ror__ = _operator("or", reflected=True)

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
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __neg__ __lt__ "
    "__le__ __gt__ __ge__ __bool__ __float__ __index__ __array__ __iter__ __len__"
).split():
    setattr(
        CapturedArray,
        _name,
        _unsupported(
            "using a captured array whole (index it with one integer expression per axis)"
        ),
    )


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


def _elementwise(op, python, what: str):
    """The helper applying unary ``op``: traced on a :class:`Sym`, else :func:`_concrete`."""

    def helper(x):
        if isinstance(x, Sym):
            return _unary(op, x)
        return _concrete(op, python, x)

    helper.__doc__ = f"{what} (traced inside a mod, elementwise outside)."
    return helper


exp = _elementwise("exp", math.exp, "``e ** x``")
log = _elementwise("log", math.log, "Natural logarithm")
tanh = _elementwise("tanh", math.tanh, "Hyperbolic tangent")
sqrt = _elementwise("sqrt", math.sqrt, "Square root")
abs = _elementwise("abs", builtins.abs, "Absolute value")
exp2 = _elementwise("exp2", lambda x: 2.0**x, "``2 ** x``")
sin = _elementwise("sin", math.sin, "Sine")
cos = _elementwise("cos", math.cos, "Cosine")
tan = _elementwise("tan", math.tan, "Tangent")


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


def floor(x):
    """The largest integer ``<= x``, as an integer (traced inside a mod, elementwise outside).

    The one conversion from a float to an integer in a mod, so its result can
    index a captured array (bound it with :func:`minimum` / :func:`maximum`
    first: a float's range is not known). NaN gives 0 and values past int64
    saturate, on every backend.
    """
    if isinstance(x, Sym):
        return _unary("floor", x)
    if array_api_compat.is_array_api_obj(x):  # torch tensors included
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
