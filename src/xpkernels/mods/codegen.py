"""Triton source for a traced mod graph: the forward function and its reverse mode.

:func:`triton_source` turns a :class:`~xpkernels.mods.Graph` into the text of
a module of ``@triton.jit`` functions that flex kernels call on each tile:

- a mask: ``fn(b, h, q_idx, kv_idx, q_row, arrs, consts) -> keep``;
- a score: ``fn(score, b, h, q_idx, kv_idx, q_row, arrs, consts) -> score``
  (a ``(BLOCK_M, BLOCK_N)`` float32 tile);
- a score's reverse mode: ``vjp(score, b, h, q_idx, kv_idx, q_row, g, valid,
  arrs, consts, grads) -> d_score``, which also adds the gradients of the
  captured arrays listed in ``grads`` into their float32 accumulators with
  atomic adds (summed over the tile first where the array's index does not
  vary along an axis), on the pairs ``valid`` holds only. Its tiles may also
  be ``(keys, queries)`` (``transposed``).

The index inputs arrive as int64: ``b`` and ``h`` scalars, ``q_idx`` and
``q_row`` ``(BLOCK_M, 1)``, ``kv_idx`` ``(1, BLOCK_N)``. Integers are computed
in int64 with Python's floor semantics (as every backend), floats in float32.
Constants are not part of the source: they travel in the ``consts`` tuple
(:func:`constants`), so graphs differing only in their constants share one
compiled kernel. Each captured array travels in ``arrs`` as its pointer,
its extents and its strides (in elements). Indices the call could not prove
in range (:attr:`Graph.clamped`) are clamped into the array, as on every
backend; the others are in range on every pair of the call
(:meth:`Graph.check_indices`), and the reads of a tile's padding rows and
keys outside the array are masked off. An integer division or remainder by
0 gives 0 and ``pow`` follows C's special cases, as on the other targets. An
accumulator in ``grads`` travels as its pointer and strides.

Each operation is spelled from its record in :data:`~xpkernels.mods.ir.OPS`;
a vjp is the code of the graph's gradient graph
(:func:`~xpkernels.mods.grad.gradient`), the one the interpreter evaluates.
"""

from __future__ import annotations

from .grad import COTANGENT, gradient
from .ir import BOOL, FLOAT, INT, OPS, Graph, computes_in_floats

__all__ = ["constants", "triton_source"]

#: Inputs of the generated functions, in order (``score`` only for scores).
_INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx", "q_row")

#: Axes of a tile each input varies along: rows (M), keys (N).
_INPUT_AXES = {
    "score": "MN",
    COTANGENT: "MN",
    "b": "",
    "h": "",
    "q_idx": "M",
    "q_row": "M",
    "kv_idx": "N",
}

#: Helper functions a generated module may call, by name.
_HELPERS = {
    "_floordiv": '''
@triton.jit
def _floordiv(a, b):
    """Python's integer floor division; a zero divisor gives 0 (as NumPy), -1 negates (wrapping)."""
    d = tl.where(b == 0, 1, tl.where(b == -1, 1, b))  # INT64_MIN // -1 traps hardware division
    q = a // d
    q = tl.where(((a % d) != 0) & ((a < 0) != (d < 0)), q - 1, q)
    return tl.where(b == 0, 0, tl.where(b == -1, -a, q))
''',
    "_mod": '''
@triton.jit
def _mod(a, b):
    """Integer remainder with the divisor's sign (Python's); a zero divisor gives 0 (as NumPy)."""
    d = tl.where(b == 0, 1, tl.where(b == -1, 1, b))
    r = a % d
    return tl.where((r != 0) & ((r < 0) != (d < 0)), r + d, r)
''',
    "_floor_int": '''
@triton.jit
def _floor_int(x):
    """floor(x) as int64: NaN gives 0, values past int64 saturate (at float32's 2**63 - 2**39)."""
    x = tl.floor(x)
    x = tl.where(x != x, 0.0, x)
    x = tl.minimum(tl.maximum(x, -9.223372036854775808e18), 9.223371487098961920e18)
    return x.to(tl.int64)
''',
    "_pow": '''
@triton.jit
def _pow(a, b):
    """a ** b in float32 with C's (and NumPy's) special cases.

    A finite negative base needs an integer exponent (else NaN); a base with
    its sign bit set (-0 and -inf included) gives a negative result for an
    odd integer exponent; 1 ** b, a ** 0 and (-1) ** +-inf are 1.
    """
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = tl.where(whole, tl.abs(b - 2.0 * tl.floor(b * 0.5)) == 1.0, False)
    r = tl.where(a.to(tl.int32, bitcast=True) < 0, tl.where(odd, r * -1.0, r), r)  # -0 too
    finite_negative = tl.where(a < 0.0, a > float("-inf"), False)
    r = tl.where(finite_negative, tl.where(whole, r, float("nan")), r)
    r = tl.where(a == -1.0, tl.where(tl.abs(b) == float("inf"), 1.0, r), r)
    return tl.where(a == 1.0, 1.0, tl.where(b == 0.0, 1.0, r))
''',
    "_tanh": '''
@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both infinities."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
''',
}


def constants(graph: Graph) -> tuple:
    """The ``consts`` argument of :func:`triton_source`'s functions: bools excluded, in node order."""
    return tuple(n.value for n in graph.nodes if n.op == "const" and not isinstance(n.value, bool))


class _Writer:
    """Expressions of one graph's nodes, as Triton source lines."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.lines: list[str] = []
        self.helpers: set[str] = set()
        self.axes: list[str] = []
        self.const_index: dict[int, int] = {}
        self.slot_base: list[int] = []
        base = 0
        for slot in graph.slots:
            self.slot_base.append(base)
            base += 1 + 2 * slot.array.ndim
        for i, n in enumerate(graph.nodes):
            if n.op == "const" and not isinstance(n.value, bool):
                self.const_index[i] = len(self.const_index)
        for n in graph.nodes:
            if n.op == "input":
                axes = _INPUT_AXES[n.value]
            elif n.op == "const":
                axes = ""
            else:
                axes = "".join(a for a in "MN" if any(a in self.axes[j] for j in n.args))
            self.axes.append(axes)

    def float_of(self, i: int) -> str:
        """Node ``i``'s value as float32."""
        kind = self.graph.nodes[i].kind
        return f"v{i}" if kind == FLOAT else f"v{i}.to(tl.float32)"

    def emit(self, i: int) -> None:
        """The line computing ``v{i}``."""
        node, nodes = self.graph.nodes[i], self.graph.nodes
        op, args = node.op, node.args
        if op == "input":
            self.lines.append(f"v{i} = {'g' if node.value == COTANGENT else node.value}")
            return
        if op == "literal":
            self.lines.append(f"v{i} = {node.value!r}")
            return
        if op == "const":
            if isinstance(node.value, bool):
                expr = f"tl.full((), {node.value}, tl.int1)"
            else:
                dtype = "tl.float32" if node.kind == FLOAT else "tl.int64"
                expr = f"tl.cast(consts[{self.const_index[i]}], {dtype})"
            self.lines.append(f"v{i} = {expr}")
            return
        if op == "gather":
            off, inside = self.offset(i)
            mask = "" if inside is None else f", mask={inside}, other=0"
            value = f"tl.load(arrs[{self.slot_base[node.value]}] + {off}{mask})"
            if node.kind == FLOAT:
                value += ".to(tl.float32)"
            elif node.kind == INT:
                value += ".to(tl.int64)"
            else:
                value = f"({value} != 0)"
            self.lines.append(f"v{i} = {value}")
            return
        floats = computes_in_floats(node, nodes)
        spelled = [self.float_of(a) if floats and nodes[a].kind == INT else f"v{a}" for a in args]
        constants = [nodes[a].value if nodes[a].op == "const" else None for a in args]
        try:
            expr = OPS[op].spelling("triton", floats, spelled, constants)
        except NotImplementedError:
            raise NotImplementedError(
                f"no Triton spelling for mod operation {op!r} on {node.kind}"
            ) from None
        self.helpers.update(h for h in _HELPERS if f"{h}(" in expr)
        self.lines.append(f"v{i} = {expr}")

    def offset(self, i: int) -> tuple[str, str | None]:
        """``(offset, inside)``: gather ``i``'s element offset and the pairs it may read.

        An index the call could not prove in range (it depends on device
        values: :attr:`Graph.clamped`) is clamped into the array, as every
        backend does. The others are in range on every pair of the call, so
        only a tile's padding rows or keys can leave the array: those reads
        are masked off instead (``inside``, None when nothing is masked),
        which keeps contiguous indices contiguous for vector loads.
        """
        node = self.graph.nodes[i]
        base = self.slot_base[node.value]
        rank = len(node.args)
        terms, checks = [], []
        for axis, j in enumerate(node.args):
            extent = f"arrs[{base + 1 + axis}]"
            stride = f"arrs[{base + 1 + rank + axis}]"
            if (i, axis) in self.graph.clamped:
                terms.append(f"tl.minimum(tl.maximum(v{j}, 0), {extent} - 1) * {stride}")
                continue
            terms.append(f"v{j} * {stride}")
            if self.axes[j]:  # an index of b and h alone is a real pair's: in range
                checks.append(f"((v{j} >= 0) & (v{j} < {extent}))")
        offset = " + ".join(terms) if terms else "0"
        return offset, " & ".join(checks) if checks else None


def _reverse(graph: Graph, grads: tuple[int, ...], transposed: bool) -> tuple[_Writer, list[str]]:
    """The writer of ``graph``'s gradient graph and the lines after its nodes (scatters, d_score)."""
    rev = gradient(graph, grads)
    w = _Writer(rev.graph)
    for i in range(len(rev.graph.nodes)):
        w.emit(i)
    grad_base, base = {}, 0
    for s in grads:
        grad_base[s] = base
        base += 1 + graph.slots[s].array.ndim
    lines: list[str] = []
    for i, g in rev.scatters:
        lines.extend(_scatter(w, i, f"v{g}", grad_base[graph.nodes[i].value], transposed))
    d_score = "tl.zeros_like(score)" if rev.d_score is None else f"v{rev.d_score}"
    return w, lines + [f"return {d_score}"]


def _scatter(w: _Writer, i: int, g: str, base: int, transposed: bool) -> list[str]:
    """Atomic adds of cotangent ``g`` (a full tile) into gather ``i``'s accumulator.

    ``g`` is summed over the tile axes the gather's index does not vary along
    (rows are axis 0, keys axis 1; the other way round when ``transposed``).
    """
    node = w.graph.nodes[i]
    axes = w.axes[i]
    c = f"c{i}"
    lines = [f"{c} = tl.where(valid, {g}, 0.0)"]
    row_axis = 1 if transposed else 0
    if axes == "":
        lines.append(f"{c} = tl.sum(tl.sum({c}, 1), 0)")
    elif axes in ("M", "N"):
        kept = row_axis if axes == "M" else 1 - row_axis
        index = "[:, None]" if kept == 0 else "[None, :]"
        lines.append(f"{c} = tl.sum({c}, {1 - kept}){index}")
    slot = w.slot_base[node.value]
    rank = len(node.args)
    terms, checks = [], []
    for axis, j in enumerate(node.args):
        stride = f"grads[{base + 1 + axis}]"
        extent = f"arrs[{slot + 1 + axis}]"
        if (i, axis) in w.graph.clamped:
            terms.append(f"tl.minimum(tl.maximum(v{j}, 0), {extent} - 1) * {stride}")
            continue
        terms.append(f"v{j} * {stride}")
        if w.axes[j]:
            checks.append(f"((v{j} >= 0) & (v{j} < {extent}))")
    offset = " + ".join(terms) if rank else "0"
    mask = f", mask={' & '.join(checks)}" if checks else ""
    lines.append(f"tl.atomic_add(grads[{base}] + {offset}, {c}{mask})")
    return lines


def triton_source(
    graph: Graph, role: str, name: str, grads: tuple[int, ...] = (), transposed: bool = False
) -> str:
    """The source of a module defining ``@triton.jit`` function ``name`` for ``graph``.

    Parameters
    ----------
    graph : Graph
    role : {"mask", "score", "vjp"}
        The function's form (see the module docstring).
    name : str
        The function's name.
    grads : tuple of int
        ``vjp`` only: the slots whose gradients it adds, in the order of the ``grads`` tuple.
    transposed : bool
        ``vjp`` only: tiles are ``(keys, queries)`` (``q_idx`` ``(1, BLOCK_M)``, ``kv_idx``
        ``(BLOCK_N, 1)``), as the dK/dV pass computes them.

    Returns
    -------
    str
        Python source importing ``triton`` and ``triton.language as tl``.
    """
    inputs = list(_INDEX_INPUTS)
    if role != "mask":
        inputs.insert(0, "score")
    if role == "vjp":
        inputs += ["g", "valid"]
    inputs += ["arrs", "consts"]
    if role == "vjp":
        inputs.append("grads")
    out = graph.output
    if role == "vjp":
        w, tail = _reverse(graph, grads, transposed)
        body = w.lines + tail
    else:
        w = _Writer(graph)
        for i in range(len(graph.nodes)):
            w.emit(i)
        result = f"v{out}" if role == "mask" else f"tl.broadcast_to({w.float_of(out)}, score.shape)"
        body = w.lines + [f"return {result}"]
    kind = graph.nodes[out].kind
    if role == "mask" and kind != BOOL:
        raise ValueError(f"a mask graph returns a condition, got {kind}")
    header = ["import triton", "import triton.language as tl", ""]
    helpers = [_HELPERS[h].strip("\n") + "\n\n" for h in sorted(w.helpers)]
    signature = f"@triton.jit\ndef {name}({', '.join(inputs)}):\n"
    text = "\n".join(header) + "\n" + "\n".join(helpers) + "\n" + signature
    return text + "".join(f"    {line}\n" for line in body)
