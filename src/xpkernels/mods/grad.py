"""Reverse mode as a graph: a traced graph's gradient graph, built from the op table's VJPs.

:func:`gradient` extends a graph with the nodes of its reverse mode. Every
backend evaluates or generates code from that one graph (the Array API
interpreter, the Triton and CUDA C targets), so each operation's derivative
is written once, in :data:`~xpkernels.mods.ir.OPS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import FLOAT, OPS, Graph, Node, reachable

__all__ = ["COTANGENT", "Gradient", "gradient"]

#: The input of a gradient graph holding d loss / d output (broadcastable to the output).
COTANGENT = "cotangent"


@dataclass(frozen=True)
class Gradient:
    """A graph's reverse mode for a set of differentiated slots.

    Attributes
    ----------
    graph : Graph
        The forward nodes (same indices) followed by the reverse nodes, which
        read input :data:`COTANGENT`; its ``clamped`` is the forward graph's.
    start : int
        Index of the first reverse node.
    d_score : int or None
        Node of d loss / d score; None when the output does not depend on the score.
    scatters : tuple of (int, int)
        ``(gather node, cotangent node)``: the cotangent of each differentiated
        gather, to be added into its slot's accumulator at the gather's index.
    """

    graph: Graph
    start: int
    d_score: int | None
    scatters: tuple[tuple[int, int], ...]


class _Builder:
    """Appends reverse nodes to a graph's nodes; ``d(op, *args)`` is one node."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def __call__(self, op: str, *args: int) -> int:
        arg_nodes = [self.nodes[a] for a in args]
        kind = OPS[op].kind([n.kind for n in arg_nodes], arg_nodes)
        return self._add(Node(op, tuple(args), None, kind))

    def literal(self, value: float) -> int:
        """A float that is part of the derivative's formula (spelled in the code, not an argument)."""
        return self._add(Node("literal", (), float(value), FLOAT))

    def input(self, name: str) -> int:
        return self._add(Node("input", (), name, FLOAT))

    def _add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1


def active(graph: Graph, slots: frozenset) -> frozenset:
    """Nodes whose value depends on the score or on a gather of a differentiated slot."""
    hit: set[int] = set()
    for i, node in enumerate(graph.nodes):
        if node.op == "input":
            on = node.value == "score"
        elif node.op == "gather":
            on = node.value in slots
        else:
            on = node.kind == FLOAT and any(a in hit for a in node.args)
        if on:
            hit.add(i)
    return frozenset(hit)


def gradient(graph: Graph, slots) -> Gradient:
    """The reverse mode of ``graph`` w.r.t. the score and the float slots ``slots``.

    Cotangents flow from the output in reverse node order; each active node's
    contributions (its op's ``vjp``) are summed to its argument's shape
    (``sum_to``, an identity in kernels, whose tiles broadcast) and added up
    per argument in that order. Cached on ``graph``.
    """
    slots = frozenset(slots)
    key = (slots, graph.clamped)
    cache = graph.__dict__.setdefault("_gradients", {})
    if key not in cache:
        cache[key] = _build(graph, slots)
    return cache[key]


def _build(graph: Graph, slots: frozenset) -> Gradient:
    nodes = graph.nodes
    live = active(graph, slots)
    d = _Builder(nodes)
    start = len(nodes)
    out = graph.output
    cots: dict[int, int] = {}
    if out in live:
        cots[out] = d("sum_to", d.input(COTANGENT), out)
    d_score = None
    scatters = []
    for i in range(out, -1, -1):
        g = cots.pop(i, None)
        if g is None:
            continue
        node = nodes[i]
        if node.op == "input":
            d_score = g
            continue
        if node.op == "gather":
            scatters.append((i, g))
            continue
        rule = OPS[node.op].vjp
        if rule is None:
            continue
        for a, contribution in zip(node.args, rule(d, node.args, i, g)):
            if contribution is None or a not in live:
                continue
            contribution = d("sum_to", contribution, a)
            cots[a] = d("add", cots[a], contribution) if a in cots else contribution
    outputs = [d_score] if d_score is not None else []
    outputs += [g for _, g in scatters]
    kept, renumber = _prune(d.nodes, start, outputs)
    full = Graph(kept, renumber.get(d_score, out), graph.slots).clamping(graph.clamped)
    return Gradient(
        full,
        start,
        None if d_score is None else renumber[d_score],
        tuple((gi, renumber[g]) for gi, g in scatters),
    )


def _prune(nodes, start, outputs):
    """The forward nodes and the reverse nodes ``outputs`` need, and old -> new indices."""
    renumber = {i: i for i in range(start)}
    kept = list(nodes[:start])
    for i in reachable(nodes, outputs, start):
        renumber[i] = len(kept)
        n = nodes[i]
        kept.append(Node(n.op, tuple(renumber[a] for a in n.args), n.value, n.kind))
    return kept, renumber
