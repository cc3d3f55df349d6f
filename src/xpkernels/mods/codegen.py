"""Triton source for a traced mod graph: the forward function and its reverse mode.

:func:`triton_source` turns a :class:`~xpkernels.mods.Graph` into the text of
a module of ``@triton.jit`` functions that flex kernels call on each tile:

- a mask: ``fn(b, h, q_idx, kv_idx, q_row, arrs, consts) -> keep``;
- a score: ``fn(score, b, h, q_idx, kv_idx, q_row, arrs, consts) -> score``
  (a ``(BLOCK_M, BLOCK_N)`` float32 tile);
- a score's reverse mode: ``vjp(score, b, h, q_idx, kv_idx, q_row, g, valid,
  arrs, consts, grads) -> d_score``, which also adds the gradients of the
  captured arrays listed in ``grads`` into their float32 accumulators (summed
  over the tile first where the array's index does not vary along an axis),
  on the pairs ``valid`` holds only: with atomic adds, or ``deterministic``ally
  into per-program partial rows. Its tiles may also be ``(keys, queries)``
  (``transposed``).

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

from itertools import accumulate

from .grad import COTANGENT, gradient
from .ir import BOOL, FLOAT, INPUTS, INT, Graph, spell

__all__ = ["constants", "triton_source"]

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
    "_segment_add": '''
@triton.jit
def _segment_add(a, key_a, b, key_b):
    """Scan step summing runs of equal keys (associative on sorted keys)."""
    return tl.where(key_a == key_b, a + b, b), key_b
''',
}


def constants(graph: Graph) -> tuple:
    """The ``consts`` argument of :func:`triton_source`'s functions: bools excluded, in node order."""
    return tuple(n.value for n in graph.nodes if n.op == "const" and not isinstance(n.value, bool))


class _Writer:
    """Expressions of one graph's nodes, as Triton source lines (written when it is built)."""

    #: deterministic vjp only: where each slot's program-row multipliers sit in ``grads``
    scatter_rows: dict[int, int] | None = None

    def __init__(self, graph: Graph):
        self.graph = graph
        self.lines: list[str] = []
        self.helpers: set[str] = set()
        self.axes: list[str] = []
        self.const_index: dict[int, int] = {}
        self.slot_base = list(accumulate((1 + 2 * s.array.ndim for s in graph.slots), initial=0))
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
        for i in range(len(graph.nodes)):
            self.emit(i)

    def float_of(self, i: int) -> str:
        """Node ``i``'s value as float32."""
        kind = self.graph.nodes[i].kind
        return f"v{i}" if kind == FLOAT else f"v{i}.to(tl.float32)"

    def emit(self, i: int) -> None:
        """The line computing ``v{i}``."""
        node = self.graph.nodes[i]
        if node.op == "input":
            expr = "g" if node.value == COTANGENT else node.value
        elif node.op == "literal":
            expr = repr(node.value)
        elif node.op == "const" and isinstance(node.value, bool):
            expr = f"tl.full((), {node.value}, tl.int1)"
        elif node.op == "const":
            dtype = "tl.float32" if node.kind == FLOAT else "tl.int64"
            expr = f"tl.cast(consts[{self.const_index[i]}], {dtype})"
        elif node.op == "gather":
            base = self.slot_base[node.value]
            off, inside = self.offset(i, "arrs", base + 1 + len(node.args))
            mask = "" if inside is None else f", mask={inside}, other=0"
            expr = f"tl.load(arrs[{base}] + {off}{mask})"
            if node.kind == FLOAT:
                expr += ".to(tl.float32)"
            elif node.kind == INT:
                expr += ".to(tl.int64)"
            else:
                expr = f"({expr} != 0)"
        else:
            expr = spell(self.graph.nodes, i, "triton", self.float_of)
            self.helpers.update(h for h in _HELPERS if f"{h}(" in expr)
        self.lines.append(f"v{i} = {expr}")

    def offset(self, i: int, array: str, strides: int) -> tuple[str, str | None]:
        """``(offset, inside)``: gather ``i``'s element offset and the pairs it may read.

        The strides are ``array[strides + axis]`` (the slot's own in ``arrs``
        for a read, its accumulator's in ``grads`` for a scatter). An index the
        call could not prove in range (it depends on device values:
        :attr:`Graph.clamped`) is clamped into the array, as every backend
        does. The others are in range on every pair of the call, so only a
        tile's padding rows or keys can leave the array: those reads are
        masked off instead (``inside``, None when nothing is masked), which
        keeps contiguous indices contiguous for vector loads.
        """
        node = self.graph.nodes[i]
        base = self.slot_base[node.value]
        terms, checks = [], []
        for axis, j in enumerate(node.args):
            extent = f"arrs[{base + 1 + axis}]"
            stride = f"{array}[{strides + axis}]"
            if (i, axis) in self.graph.clamped:
                terms.append(f"tl.minimum(tl.maximum(v{j}, 0), {extent} - 1) * {stride}")
                continue
            terms.append(f"v{j} * {stride}")
            if self.axes[j]:  # an index of b and h alone is a real pair's: in range
                checks.append(f"((v{j} >= 0) & (v{j} < {extent}))")
        offset = " + ".join(terms) if terms else "0"
        return offset, " & ".join(checks) if checks else None


def _reverse(
    graph: Graph, grads: tuple[int, ...], transposed: bool, deterministic: bool
) -> tuple[_Writer, list[str]]:
    """The writer of ``graph``'s gradient graph and the lines after its nodes (scatters, d_score)."""
    rev = gradient(graph, grads)
    w = _Writer(rev.graph)
    bases = list(accumulate((1 + graph.slots[s].array.ndim for s in grads), initial=0))
    grad_base = dict(zip(grads, bases))
    if deterministic:
        w.scatter_rows = {s: bases[-1] + 4 * k for k, s in enumerate(grads)}
    lines: list[str] = []
    for i, g in rev.scatters:
        lines.extend(_scatter(w, i, f"v{g}", grad_base[graph.nodes[i].value], transposed))
    d_score = "tl.zeros_like(score)" if rev.d_score is None else f"v{rev.d_score}"
    return w, lines + [f"return {d_score}"]


def _scatter(w: _Writer, i: int, g: str, base: int, transposed: bool) -> list[str]:
    """Lines adding cotangent ``g`` (a full tile) into gather ``i``'s accumulator.

    ``g`` is summed over the tile axes the gather's index does not vary along
    (rows are axis 0, keys axis 1; the other way round when ``transposed``),
    then added with atomic adds, or, when the writer is deterministic
    (:attr:`_Writer.scatter_rows`), into the program's own row of a partial
    buffer by load + add + store (a barrier after it when the slot is gathered
    more than once). A row lies at element
    ``program_id(0) * grads[r] + b * grads[r + 1] + (h // grads[r + 3]) *
    grads[r + 2]`` (``r`` the slot's entry of ``scatter_rows``; the host sets a
    multiplier to 0 where programs cannot collide); rows are contiguous, so
    offsets inside one are below the array's element count. Repeated indices
    of one store are combined first unless the index is injective over the
    summed tile (each axis it varies along has an index ``input + c`` of that
    axis, not clamped): the tile is flattened, packed ``offset * n +
    position`` keys are sorted (int32 for arrays under 2**16 elements), the
    values gathered in that order, runs of equal offsets summed by a
    segmented scan and stored once, at each run's end.
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
    offset, inside = w.offset(i, "grads", base + 1)
    mask = f", mask={inside}" if inside else ""
    if w.scatter_rows is None:
        lines.append(f"tl.atomic_add(grads[{base}] + {offset}, {c}{mask})")
        return lines
    rows = w.scatter_rows[node.value]
    p, r = f"p{i}", f"r{i}"
    lines.append(
        f"{r} = tl.program_id(0).to(tl.int64) * grads[{rows}] + b * grads[{rows + 1}]"
        f" + (h // grads[{rows + 3}]) * grads[{rows + 2}]"
    )
    axis_inputs = {"M": ("q_idx", "q_row"), "N": ("kv_idx",)}
    forms = w.graph.forms[i]
    injective = all(
        any(
            f is not None
            and f[0] == "input"
            and f[1] in axis_inputs[a]
            and (i, axis) not in w.graph.clamped
            for axis, f in enumerate(forms)
        )
        for a in axes
    )
    if injective:
        other = ", other=0.0" if inside else ""
        lines.append(f"{p} = grads[{base}] + {r} + ({offset})")
        lines.append(f"tl.store({p}, tl.load({p}{mask}{other}) + {c}{mask})")
    else:
        k, s, e, n = f"k{i}", f"s{i}", f"e{i}", f"{c}.numel"
        elements = 1
        for extent in w.graph.slots[node.value].array.shape:
            elements *= int(extent)
        # keys ``offset in the row * n + position`` for tiles of up to 2**14 pairs: int32 for
        # arrays under 2**16 elements, else int64; pairs outside the array sort last, under
        # an offset no element has
        key_type, no_offset = ("tl.int32", 2**16) if elements < 2**16 else ("tl.int64", 2**48)
        key = offset if inside is None else f"tl.where({inside}, {offset}, {no_offset})"
        w.helpers.add("_segment_add")
        lines += [
            f"{k} = tl.reshape(({key} + tl.zeros({c}.shape, tl.int64)).to({key_type}), ({n},))",
            f"{k} = tl.sort({k} * {n} + tl.arange(0, {n}))",
            f"{c} = tl.gather(tl.reshape({c}, ({n},)), ({k} % {n}).to(tl.int32), 0)",
            f"{s}, {k} = tl.associative_scan(({c}, {k} // {n}), 0, _segment_add)",
            f"{e} = tl.arange(0, {n})",
            f"{e} = (({k} != tl.gather({k}, tl.minimum({e} + 1, {n} - 1), 0)) | ({e} == {n} - 1))",
            f"{e} = {e} & ({k} != {no_offset})",
            f"{p} = grads[{base}] + {r} + {k}",
            f"tl.store({p}, tl.load({p}, mask={e}, other=0.0) + {s}, mask={e})",
        ]
    if sum(n.op == "gather" and n.value == node.value for n in w.graph.nodes) > 1:
        # another gather of the slot may hold this element in other threads: make the store
        # visible to them (one gather's load and store share a layout: each element is
        # stored by a thread that loaded it, and that thread sees its own stores)
        lines.append("tl.debug_barrier()")
    return lines


def triton_source(
    graph: Graph,
    role: str,
    name: str,
    grads: tuple[int, ...] = (),
    transposed: bool = False,
    deterministic: bool = False,
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
    deterministic : bool
        ``vjp`` only: add the gradients into per-program partial rows without
        atomics (:func:`_scatter`); ``grads`` then continues, after every
        slot's pointer and strides, with four integers per slot (in order):
        the multipliers of ``program_id(0)``, ``b`` and the kv head
        ``h // group`` giving a program's row offset (in elements), and ``group``.

    Returns
    -------
    str
        Python source importing ``triton`` and ``triton.language as tl``.
    """
    inputs = list(INPUTS[1:] if role == "mask" else INPUTS)
    out = graph.output
    if role == "vjp":
        inputs += ["g", "valid", "arrs", "consts", "grads"]
        w, tail = _reverse(graph, grads, transposed, deterministic)
    else:
        inputs += ["arrs", "consts"]
        w = _Writer(graph)
        result = f"v{out}" if role == "mask" else f"tl.broadcast_to({w.float_of(out)}, score.shape)"
        tail = [f"return {result}"]
    body = w.lines + tail
    kind = graph.nodes[out].kind
    if role == "mask" and kind != BOOL:
        raise ValueError(f"a mask graph returns a condition, got {kind}")
    header = ["import triton", "import triton.language as tl", ""]
    helpers = [_HELPERS[h].strip("\n") + "\n\n" for h in sorted(w.helpers)]
    signature = f"@triton.jit\ndef {name}({', '.join(inputs)}):\n"
    text = "\n".join(header) + "\n" + "\n".join(helpers) + "\n" + signature
    return text + "".join(f"    {line}\n" for line in body)
