"""The mod expression graph: its nodes, the op table and interval analysis.

:class:`Node`, :class:`Slot` and :class:`Graph`; :data:`OPS`, the one table
of operations (per op: arity, result kind, interval rule, Array API
evaluation, reverse mode as graph-building code, Triton and CUDA C
spellings), which the tracer, the interpreter, :mod:`~xpkernels.mods.grad`
and the code generators all read; the interval analysis that bounds
captured-array indices in int64; and the host-array helpers it reads bounds with.
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

#: The evaluator :meth:`Graph.bind` builds (:class:`~xpkernels.mods.interpret.BoundGraph`),
#: filed by :mod:`~xpkernels.mods.interpret` when it loads. The interpreter builds on this
#: module (and on :mod:`~xpkernels.mods.grad`, which does too), so this module never imports
#: it; importing :mod:`xpkernels.mods` (the only way to reach this module) loads it.
_INTERPRETER: list[Callable[..., BoundGraph]] = []


def register_interpreter(bound_graph: Callable[..., BoundGraph]) -> None:
    """File the class :meth:`Graph.bind` instantiates (called by :mod:`~xpkernels.mods.interpret`)."""
    _INTERPRETER[:] = [bound_graph]


@dataclass(frozen=True)
class Node:
    """One node of a :class:`Graph`.

    ``op`` is ``"input"`` (``value`` = its name), ``"const"`` (``value`` = a
    Python bool, int or float), ``"gather"`` (``value`` = slot index, ``args``
    = one index node per axis), ``"literal"`` (gradient graphs only: a float
    of a derivative's formula, spelled in the code rather than passed as an
    argument) or an operation of :data:`OPS` applied to ``args``.
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

    def offset_batch(self, first: int) -> Graph:
        """This graph reading input ``b`` as ``b + first`` (a one-sequence batch seen as sequence ``first``).

        ``first`` becomes a constant of the graph, so every offset shares one
        compiled kernel; a graph that does not read ``b`` is returned as it is.
        """
        if not self.uses("b"):
            return self
        nodes: list[Node] = []
        new: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            nodes.append(Node(n.op, tuple(new[a] for a in n.args), n.value, n.kind))
            if n.op == "input" and n.value == "b":
                nodes.append(Node("const", (), int(first), INT))
                nodes.append(Node("add", (len(nodes) - 2, len(nodes) - 1), None, INT))
            new[i] = len(nodes) - 1
        out = Graph(nodes, new[self.output], self.slots)
        return out.clamping((new[g], axis) for g, axis in self.clamped)

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
        (bound_graph,) = _INTERPRETER  # filed by the interpreter, which builds on this module
        return bound_graph(self, xp, float_dtype, device, arrays)

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


def reachable(nodes, roots, start: int = 0) -> list[int]:
    """The nodes from ``start`` on that ``roots`` (included) depend on through such nodes, in order."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i >= start and i not in seen:
            seen.add(i)
            stack.extend(nodes[i].args)
    return sorted(seen)


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
        rule = OPS[op].interval
        arg_nodes = [graph.nodes[a] for a in node.args]
        lo, hi = (-inf, inf) if rule is None else rule(bounds, arg_nodes)
        if (math.isfinite(lo) and lo < INT64_MIN) or (math.isfinite(hi) and hi > INT64_MAX):
            lo, hi, wrapped = INT64_MIN, INT64_MAX, True
    memo[i] = (lo, hi, device, wrapped)
    return memo[i]


def _dtype_range(a) -> tuple[int, int]:
    """Smallest and largest value of an integer array's dtype."""
    info = array_api_compat.array_namespace(a).iinfo(a.dtype)
    return int(info.min), int(info.max)


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


# ---------------------------------------------------------------------------------------------
# The op table: one record per operation.


@dataclass(frozen=True)
class Op:
    """One operation of the mod graph: everything a backend needs to know about it.

    Spellings are per target: a ``(integer form, float form)`` pair (the float
    form is used when the node computes in floats: a float result, or a
    comparison of floats) of format strings whose ``{0}``, ``{1}``, ``{2}``
    are the argument expressions (integer arguments already turned to float
    in the float form), or a callable ``(args, constants) -> str`` given the
    argument expressions and the arguments' constant values (None where an
    argument is not a constant). None: the operation has no such form.

    Attributes
    ----------
    arity : int
    kind : callable
        ``(argument kinds, argument nodes) -> result kind``, for arguments the tracer accepted.
    evaluate : callable
        ``(xp, *argument arrays) -> array`` on an Array API namespace.
    vjp : callable or None
        Reverse mode as graph-building code: ``(d, x, y, g) -> contributions``
        with ``d(op, *nodes)`` adding a node to the gradient graph and
        ``d.literal(v)`` a float literal, ``x`` the argument nodes, ``y`` the
        node itself and ``g`` its cotangent; one contribution (d loss / d
        argument, a node) or None per argument. None: no gradient flows through
        (a condition, an integer result, or piecewise constant).
    interval : callable or None
        ``(argument bounds, argument nodes) -> (low, high)`` of an integer
        result over the call (before int64 wrapping); None: unbounded.
    triton, cuda : tuple or callable
        The Triton and CUDA C spellings.
    symbol : str or None
        How error messages name it when it comes from a Python operator.
    """

    arity: int
    kind: Callable[[list, list], str]
    evaluate: Callable[..., Any]
    vjp: Callable[..., tuple] | None
    interval: Callable[[list, list], tuple] | None
    triton: Any
    cuda: Any
    symbol: str | None = None

    def spelling(self, target: str, floats: bool, args: list, constants: list) -> str:
        """The expression of this operation on ``target`` (``"triton"`` or ``"cuda"``)."""
        forms = getattr(self, target)
        form = forms if callable(forms) else forms[1 if floats else 0]
        if form is None:
            raise NotImplementedError(f"no {target} spelling for this operation on these kinds")
        return form(args, constants) if callable(form) else form.format(*args)


def computes_in_floats(node: Node, nodes) -> bool:
    """True when ``node``'s operation runs on floats: its integer arguments are turned to float."""
    if node.kind == FLOAT:
        return True
    return node.op in ORDERED + ("eq", "ne") and any(nodes[a].kind == FLOAT for a in node.args)


def spell(nodes, i: int, target: str, float_of: Callable[[int], str]) -> str:
    """Operation node ``i`` on ``target`` (``"triton"`` or ``"cuda"``), argument ``a`` as ``v{a}``.

    Integer arguments of a computation in floats are spelled ``float_of(a)``.
    """
    node = nodes[i]
    floats = computes_in_floats(node, nodes)
    args = [float_of(a) if floats and nodes[a].kind == INT else f"v{a}" for a in node.args]
    constants = [nodes[a].value if nodes[a].op == "const" else None for a in node.args]
    try:
        return OPS[node.op].spelling(target, floats, args, constants)
    except NotImplementedError:
        raise NotImplementedError(
            f"no {dict(triton='Triton', cuda='CUDA C')[target]} spelling for mod operation "
            f"{node.op!r} on {node.kind}"
        ) from None


def _numeric(kinds, nodes) -> str:
    return FLOAT if FLOAT in kinds else INT


def _same(kinds, nodes) -> str:
    return kinds[0]


def _always(kind):
    return lambda kinds, nodes: kind


def _pow_kind(kinds, nodes) -> str:
    exponent = nodes[1]
    whole = kinds == [INT, INT] and exponent.op == "const" and exponent.value >= 0
    return INT if whole else FLOAT


def _where_kind(kinds, nodes) -> str:
    return BOOL if kinds[1] == BOOL else _numeric(kinds[1:], nodes[1:])


def _mul_bound(x, y):
    return 0 if x == 0 or y == 0 else x * y


def _mul_interval(bounds, nodes):
    corners = [_mul_bound(x, y) for x in bounds[0] for y in bounds[1]]
    return builtins.min(corners), builtins.max(corners)


def _abs_interval(bounds, nodes):
    a0, a1 = bounds[0]
    if a0 >= 0:
        return a0, a1
    if a1 <= 0:
        return -a1, -a0
    return 0, builtins.max(-a0, a1)


def _floordiv_interval(bounds, nodes):
    (a0, a1), divisor = bounds[0], nodes[1]
    if divisor.op != "const" or divisor.value <= 0:
        return -math.inf, math.inf
    c = divisor.value
    return (a0 // c if math.isfinite(a0) else a0), (a1 // c if math.isfinite(a1) else a1)


def _mod_interval(bounds, nodes):
    (a0, a1), divisor = bounds[0], nodes[1]
    if divisor.op != "const" or divisor.value <= 0:
        return -math.inf, math.inf
    c = divisor.value
    if math.isfinite(a0) and math.isfinite(a1) and a0 // c == a1 // c:
        return a0 % c, a1 % c
    return 0, c - 1


def _pow_interval(bounds, nodes):
    (a0, a1), exponent = bounds[0], nodes[1]
    if exponent.op != "const" or a0 < 0:
        return -math.inf, math.inf
    c = exponent.value

    def power(x):  # past 2**64 the result wraps anyway; don't compute huge powers
        return x**c if x <= 1 or c <= 64 else INT64_MAX + 1

    return power(a0), power(a1)


def _int_power(mul: str, one: str):
    """The integer ``x ** c`` spelling for a constant ``c >= 0``, by squaring with ``mul``."""

    def spell(args, constants):
        e = constants[1]
        if e == 0:
            return one.format(args[0])
        factors, square = [], args[0]
        while True:
            if e & 1:
                factors.append(square)
            e >>= 1
            if not e:
                break
            square = mul.format(square, square)
        result = factors[0]
        for factor in factors[1:]:
            result = mul.format(result, factor)
        return result

    return spell


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


def _integer_division(f):
    """``f(xp, a, b)`` with an integer divisor 0 giving 0, as NumPy (torch raises instead)."""

    def evaluate(xp, a, b):
        names = array_api_compat.array_namespace(a, b)
        if not (names.isdtype(a.dtype, "integral") and names.isdtype(b.dtype, "integral")):
            return f(xp, a, b)
        zero = b == 0
        out = f(xp, a, xp.where(zero, xp.ones_like(b), b))
        return xp.where(zero, xp.zeros_like(out), out)

    return evaluate


def _exp2(xp, a):
    return xp.pow(xp.asarray(2.0, dtype=a.dtype, device=array_api_compat.device(a)), a)


def _pow_vjp(d, x, y, g):
    """PyTorch's choices where ``x ** y`` is not differentiable: d/dx is 0 where ``y == 0``,
    d/dy is 0 where ``x == 0`` and ``y >= 0`` (not ``0 * inf`` or ``log 0``: a learnable
    exponent starting at 0 over a distance of 0 trains); no infinity is formed for them."""
    flat = d("eq", x[1], d.literal(0.0))
    lowered = d("where", flat, d.literal(1.0), d("sub", x[1], d.literal(1.0)))
    d_base = d("mul", g, d("mul", x[1], d("pow", x[0], lowered)))
    at_zero = d("and", d("eq", x[0], d.literal(0.0)), d("ge", x[1], d.literal(0.0)))
    safe = d("where", at_zero, d.literal(1.0), x[0])
    d_exponent = d("mul", d("mul", g, y), d("log", safe))
    return d("where", flat, d.literal(0.0), d_base), d("where", at_zero, d.literal(0.0), d_exponent)


def _extreme(name: str, pick, order: str) -> Op:
    """``minimum`` / ``maximum`` (``pick`` = ``min`` / ``max``): NaN-propagating on floats; the
    cotangent goes to the first argument where ``first order second`` holds, else the second."""

    def vjp(d, x, y, g):
        first = d(order, x[0], x[1])
        return d("where", first, g, d.literal(0.0)), d("where", first, d.literal(0.0), g)

    tl, short = f"tl.{name}({{0}}, {{1}}", pick.__name__
    return Op(
        2,
        _numeric,
        lambda xp, a, b: getattr(xp, name)(a, b),
        vjp,
        lambda b, n: (pick(b[0][0], b[1][0]), pick(b[0][1], b[1][1])),
        (tl + ")", tl + ", propagate_nan=tl.PropagateNan.ALL)"),
        (f"xpk_i{short}({{0}}, {{1}})", f"xpk_f{short}({{0}}, {{1}})"),
    )


def _float_function(name: str, vjp, triton: str, cuda: str, evaluate=None) -> Op:
    """A float function of one argument: ``xp.<name>`` unless ``evaluate`` says otherwise."""
    evaluate = evaluate or (lambda xp, a: getattr(xp, name)(a))
    return Op(1, _always(FLOAT), evaluate, vjp, None, (None, triton), (None, cuda))


#: The order comparisons (their integer arguments become floats next to a float).
ORDERED = ("lt", "le", "gt", "ge")

#: Every operation a graph node may apply, by name (see :class:`Op`).
# fmt: off
OPS: dict[str, Op] = {
    "add": Op(
        2, _numeric, lambda xp, a, b: xp.add(a, b),
        lambda d, x, y, g: (g, g),
        lambda b, n: (b[0][0] + b[1][0], b[0][1] + b[1][1]),
        ("{0} + {1}", "{0} + {1}"), ("xpk_add({0}, {1})", "{0} + {1}"), "+",
    ),
    "sub": Op(
        2, _numeric, lambda xp, a, b: xp.subtract(a, b),
        lambda d, x, y, g: (g, d("neg", g)),
        lambda b, n: (b[0][0] - b[1][1], b[0][1] - b[1][0]),
        ("{0} - {1}", "{0} - {1}"), ("xpk_sub({0}, {1})", "{0} - {1}"), "-",
    ),
    "mul": Op(
        2, _numeric, lambda xp, a, b: xp.multiply(a, b),
        lambda d, x, y, g: (d("mul", g, x[1]), d("mul", g, x[0])),
        _mul_interval,
        ("{0} * {1}", "{0} * {1}"), ("xpk_mul({0}, {1})", "{0} * {1}"), "*",
    ),
    "div": Op(
        2, _always(FLOAT), lambda xp, a, b: xp.divide(a, b),
        lambda d, x, y, g: (d("div", g, x[1]), d("div", d("mul", d("neg", g), y), x[1])),
        None,
        (None, "{0} / {1}"), (None, "{0} / {1}"), "/",
    ),
    "floordiv": Op(
        2, _numeric, _integer_division(lambda xp, a, b: xp.floor_divide(a, b)),
        None,
        _floordiv_interval,
        ("_floordiv({0}, {1})", "tl.floor({0} / {1})"),
        ("xpk_floordiv({0}, {1})", "floorf({0} / {1})"),
        "//",
    ),
    "mod": Op(
        2, _numeric, _integer_division(lambda xp, a, b: xp.remainder(a, b)),
        lambda d, x, y, g: (g, d("neg", d("mul", g, d("floordiv", x[0], x[1])))),
        _mod_interval,
        ("_mod({0}, {1})", "{0} - {1} * tl.floor({0} / {1})"),
        ("xpk_mod({0}, {1})", "{0} - {1} * floorf({0} / {1})"),
        "%",
    ),
    "pow": Op(
        2, _pow_kind, lambda xp, a, b: xp.pow(a, b),
        _pow_vjp,
        _pow_interval,
        (_int_power("{0} * {1}", "({0} * 0 + 1)"), "_pow({0}, {1})"),
        (_int_power("xpk_mul({0}, {1})", "1LL"), "xpk_pow({0}, {1})"),
        "**",
    ),
    **{
        name: Op(
            2, _always(BOOL), evaluate, None, None,
            (f"{{0}} {sym} {{1}}",) * 2, (f"{{0}} {sym} {{1}}",) * 2, sym,
        )
        for name, sym, evaluate in (
            ("lt", "<", lambda xp, a, b: xp.less(a, b)),
            ("le", "<=", lambda xp, a, b: xp.less_equal(a, b)),
            ("gt", ">", lambda xp, a, b: xp.greater(a, b)),
            ("ge", ">=", lambda xp, a, b: xp.greater_equal(a, b)),
            ("eq", "==", lambda xp, a, b: xp.equal(a, b)),
            ("ne", "!=", lambda xp, a, b: xp.not_equal(a, b)),
        )
    },
    # selects, not & | ~ in Triton: its interpreter cannot mix ranks of bools
    "and": Op(
        2, _always(BOOL), lambda xp, a, b: xp.logical_and(a, b), None, None,
        ("tl.where({0}, {1}, False)", None), ("{0} && {1}", None), "logical_and (&)",
    ),
    "or": Op(
        2, _always(BOOL), lambda xp, a, b: xp.logical_or(a, b), None, None,
        ("tl.where({0}, True, {1})", None), ("{0} || {1}", None), "logical_or (|)",
    ),
    "not": Op(
        1, _always(BOOL), lambda xp, a: xp.logical_not(a), None, None,
        ("tl.where({0}, False, True)", None), ("!{0}", None), "logical_not (~)",
    ),
    "neg": Op(
        1, _same, lambda xp, a: xp.negative(a),
        lambda d, x, y, g: (d("neg", g),),
        lambda b, n: (-b[0][1], -b[0][0]),
        ("-({0})", "{0} * -1.0"), ("xpk_neg({0})", "-{0}"),  # Triton's -x is 0 - x: not -0
    ),
    "abs": Op(
        1, _same, lambda xp, a: xp.abs(a),
        lambda d, x, y, g: (d("mul", g, d("sign", x[0])),),
        _abs_interval,
        ("tl.abs({0})", "tl.abs({0})"), ("xpk_iabs({0})", "fabsf({0})"),
    ),
    "sign": Op(  # only in gradient graphs (of abs): NaN stays NaN, as NumPy's sign
        1, _always(FLOAT), lambda xp, a: xp.sign(a), None, None,
        (None, "tl.where({0} > 0.0, 1.0, tl.where({0} < 0.0, -1.0, {0} * 0.0))"),
        (None, "({0} > 0.0f ? 1.0f : ({0} < 0.0f ? -1.0f : {0} * 0.0f))"),
    ),
    "exp": _float_function(
        "exp", lambda d, x, y, g: (d("mul", g, y),), "tl.exp({0})", "expf({0})",
    ),
    "exp2": _float_function(
        "exp2", lambda d, x, y, g: (d("mul", g, d("mul", d.literal(math.log(2.0)), y)),),
        "tl.exp2({0})", "exp2f({0})", _exp2,
    ),
    "log": _float_function(
        "log", lambda d, x, y, g: (d("div", g, x[0]),), "tl.log({0})", "logf({0})",
    ),
    "tanh": _float_function(  # 1 - 2 / (exp(2x) + 1) in the kernels: exact at both infinities
        "tanh", lambda d, x, y, g: (d("mul", g, d("sub", d.literal(1.0), d("mul", y, y))),),
        "_tanh({0})", "(1.0f - 2.0f / (expf(2.0f * {0}) + 1.0f))",
    ),
    "sqrt": _float_function(
        "sqrt", lambda d, x, y, g: (d("div", d("mul", g, d.literal(0.5)), y),),
        "tl.sqrt({0})", "sqrtf({0})",
    ),
    "sin": _float_function(
        "sin", lambda d, x, y, g: (d("mul", g, d("cos", x[0])),), "tl.sin({0})", "sinf({0})",
    ),
    "cos": _float_function(
        "cos", lambda d, x, y, g: (d("mul", d("neg", g), d("sin", x[0])),),
        "tl.cos({0})", "cosf({0})",
    ),
    "tan": _float_function(
        "tan", lambda d, x, y, g: (d("mul", g, d("add", d.literal(1.0), d("mul", y, y))),),
        "tl.sin({0}) / tl.cos({0})", "(sinf({0}) / cosf({0}))",
    ),
    "sigmoid": _float_function(
        "sigmoid", lambda d, x, y, g: (d("mul", g, d("mul", y, d("sub", d.literal(1.0), y))),),
        "1.0 / (1.0 + tl.exp(-({0})))", "(1.0f / (1.0f + expf(-({0}))))",
        lambda xp, a: 1.0 / (1.0 + xp.exp(-a)),
    ),
    "floor": Op(  # to int64: NaN gives 0, values past int64 saturate
        1, _always(INT), lambda xp, a: _floor_int(xp, a), None, None,
        ("_floor_int({0})", None), ("xpk_floor_int({0})", None),
    ),
    "minimum": _extreme("minimum", builtins.min, "le"),
    "maximum": _extreme("maximum", builtins.max, "ge"),
    "where": Op(
        3, _where_kind, lambda xp, c, a, b: xp.where(c, a, b),
        lambda d, x, y, g: (
            None,
            d("where", x[0], g, d.literal(0.0)),
            d("where", x[0], d.literal(0.0), g),
        ),
        lambda b, n: (builtins.min(b[1][0], b[2][0]), builtins.max(b[1][1], b[2][1])),
        ("tl.where({0}, {1}, {2})",) * 2, ("{0} ? {1} : {2}",) * 2,
    ),
    "float": Op(  # an integer result of a score mod, as a float
        1, _always(FLOAT), lambda xp, a: a, None, None, (None, "{0}"), (None, "{0}"),
    ),
    "sum_to": Op(  # gradient graphs: sum x to the shape of node like (identity in kernels)
        2, _same, lambda xp, x, like: _unbroadcast(xp, x, like.shape), None, None,
        (None, "{0}"), (None, "{0}"),
    ),
}
# fmt: on
