"""Running a graph on any Array API namespace, forward and in reverse mode.

:class:`Grid` and :func:`tile_grid` (the index inputs of one evaluation),
:class:`BoundGraph` (evaluation and reverse mode) and :func:`scatter_add`.
Loading this module files :class:`BoundGraph` as the evaluator
:meth:`~xpkernels.mods.ir.Graph.bind` builds (``ir`` sits below this module
and does not import it).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from .grad import COTANGENT, gradient
from .ir import BOOL, FLOAT, INT, OPS, computes_in_floats, is_host_array, register_interpreter


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
    on the host; they lie inside ``target``). Non-finite values are counted
    apart (running sums of +inf, -inf and NaN indicators, exact in int64), so
    one of them reaches its own index only: +inf and -inf together, or a NaN,
    give NaN there, as summing does. ``target`` must be C-contiguous (its
    reshape to 1-D is a view).
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
    wide = xp.astype(xp.take(values, order), xp.float64)
    finite = xp.isfinite(wide)
    positions = xp.arange(
        lo, hi + 1, dtype=sorted_index.dtype, device=array_api_compat.device(index)
    )
    last = xp.searchsorted(sorted_index, positions, side="right")
    first = xp.searchsorted(sorted_index, positions, side="left")

    def runs(x):
        sums = xp.cumulative_sum(x, include_initial=True)
        return xp.take(sums, last) - xp.take(sums, first)

    run = runs(xp.where(finite, wide, xp.zeros_like(wide)))
    if not bool(xp.all(finite)):
        counts = [
            runs(xp.astype(flag, xp.int64))
            for flag in (wide == math.inf, wide == -math.inf, xp.isnan(wide))
        ]
        up, down, nan = (c > 0 for c in counts)
        run = xp.where(up, math.inf, run)
        run = xp.where(down, -math.inf, run)
        run = xp.where(xp.logical_or(nan, xp.logical_and(up, down)), math.nan, run)
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
        self._literals: dict[float, Any] = {}

    def _float(self, value, kind):
        return value if kind == FLOAT else self.xp.astype(value, self.float_dtype)

    def run(self, grid: Grid, score=None) -> list:
        """Values of every node (output: ``values[graph.output]``); ``score`` feeds the score."""
        values: list = [None] * len(self.graph.nodes)
        self._evaluate(self.graph, values, 0, grid, {"score": score})
        return values

    def _evaluate(self, graph, values, start, grid, inputs) -> None:
        """Fill ``values[start:]`` with the values of ``graph``'s nodes from ``start`` on."""
        xp, nodes = self.xp, graph.nodes
        for i in range(start, len(nodes)):
            node = nodes[i]
            op = node.op
            if op == "input":
                values[i] = inputs[node.value] if node.value in inputs else grid.values[node.value]
            elif op == "const":
                values[i] = self._consts[i]
            elif op == "literal":
                if node.value not in self._literals:
                    self._literals[node.value] = xp.asarray(
                        node.value, dtype=self.float_dtype, device=self.device
                    )
                values[i] = self._literals[node.value]
            elif op == "gather":
                values[i] = self._gather(i, node, values, grid)
            else:
                args = [values[a] for a in node.args]
                if computes_in_floats(node, nodes):
                    args = [
                        self._float(v, nodes[a].kind) if nodes[a].kind == INT else v
                        for v, a in zip(args, node.args)
                    ]
                values[i] = OPS[op].evaluate(xp, *args)

    def _slices(self, i, grid):
        """``(slices, kept, order)`` reading gather ``i`` as a plain slice, or None.

        ``kept``: ``(grid axis, length)`` of each array axis the grid varies along (the
        others have a constant index); ``order``: their positions sorted by grid axis.
        """
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
        kept = [(a, s.stop - s.start) for a, s in zip(axes, slices) if a is not None]
        if len({a for a, _ in kept}) != len(kept):
            return None
        return tuple(slices), kept, sorted(range(len(kept)), key=lambda k: kept[k][0])

    def _gather(self, i, node, values, grid):
        xp = self.xp
        array = self.arrays[node.value]
        plan = self._slices(i, grid)
        if plan is not None:
            slices, kept, order = plan
            block = xp.reshape(array[slices], tuple(n for _, n in kept))
            if order != list(range(len(kept))):
                block = xp.permute_dims(block, tuple(order))
            shape = [1] * grid.rank
            for axis, n in kept:
                shape[axis] = n
            out = xp.reshape(block, tuple(shape))
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

    def backprop(self, values, grid, cotangent, grads):
        """Reverse mode from ``cotangent`` (d loss / d output) through the values of :meth:`run`.

        Evaluates the graph's gradient graph (:func:`~xpkernels.mods.grad.gradient`).

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
        rev = gradient(self.graph, (s for s, acc in enumerate(grads) if acc is not None))
        nodes = rev.graph.nodes
        full = list(values) + [None] * (len(nodes) - len(values))
        self._evaluate(rev.graph, full, rev.start, grid, {COTANGENT: cotangent})
        for i, g in rev.scatters:
            self._scatter(i, nodes[i], full, grid, full[g], grads[nodes[i].value])
        return None if rev.d_score is None else full[rev.d_score]

    def _scatter(self, i, node, values, grid, g, acc):
        if acc is None:
            return
        xp = self.xp
        plan = self._slices(i, grid)
        if plan is None:
            scatter_add(xp, acc, self._flat_index(i, node, values), g)
            return
        slices, kept, by_axis = plan
        block = xp.reshape(g, tuple(kept[k][1] for k in by_axis))
        back = sorted(range(len(kept)), key=lambda k: by_axis[k])
        if back != list(range(len(kept))):
            block = xp.permute_dims(block, tuple(back))
        lengths = tuple(s.stop - s.start for s in slices)
        acc[slices] += xp.astype(xp.reshape(block, lengths), acc.dtype)


# Graph.bind (in .ir, below this module) builds a BoundGraph.
register_interpreter(BoundGraph)
