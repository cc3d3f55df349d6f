"""Mods evaluated on the host in NumPy float64: values and reverse mode.

:func:`mask_value`, :func:`score_value` and :func:`score_grad`.
"""

from __future__ import annotations

import numpy as np

from .interpret import Grid
from .ir import _to_host
from .library import as_mask_mod, as_score_mod


def _zeros_host(a):
    return np.zeros(tuple(a.shape), dtype=np.float64)


def _host_grid(b, h, q_idx, kv_idx, input_pos, score=None):
    """``(grid, score, shape)``: the indices' grid, ``score`` in float64 (None: no score) and
    the shape they all broadcast to."""
    indices = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    values = {name: np.asarray(v, dtype=np.int64) for name, v in indices.items()}
    values["q_row"] = values["q_idx"] - np.asarray(input_pos, dtype=np.int64)
    shapes = [v.shape for v in values.values()]
    if score is not None:
        score = np.asarray(score, dtype=np.float64)
        shapes.append(score.shape)
    return Grid(values), score, np.broadcast_shapes(*shapes)


def _host_bound(mod):
    return mod.graph.bind(np, np.float64, "cpu", [_to_host(s.array) for s in mod.graph.slots])


def mask_value(mask_mod, q_idx, kv_idx, b=0, h=0, *, input_pos=0) -> np.ndarray:
    """Evaluate a mask mod's traced graph on the host (NumPy) for the given indices.

    Arguments broadcast against each other; ``q_idx`` is the query position
    (its row is ``q_idx - input_pos``). Returns a bool NumPy array.
    """
    mod = as_mask_mod(mask_mod, "mask_value: mask_mod")
    grid, _, shape = _host_grid(b, h, q_idx, kv_idx, input_pos)
    return np.broadcast_to(_host_bound(mod).run(grid)[mod.graph.output], shape).copy()


def score_value(score_mod, score, q_idx, kv_idx, b=0, h=0, *, input_pos=0) -> np.ndarray:
    """Evaluate a score mod's traced graph on the host, in float64, for the given scores."""
    mod = as_score_mod(score_mod, "score_value: score_mod")
    grid, score, shape = _host_grid(b, h, q_idx, kv_idx, input_pos, score)
    return np.broadcast_to(_host_bound(mod).run(grid, score)[mod.graph.output], shape).copy()


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
    grid, score, shape = _host_grid(b, h, q_idx, kv_idx, input_pos, score)
    score = np.broadcast_to(score, shape)
    bound = _host_bound(mod)
    values = bound.run(grid, score)
    tree = mod._grad_tree(_zeros_host, bool(feature_grads))
    accumulators = [tree.lookup(s.path, s.field) for s in mod.graph.slots]
    cotangent = np.broadcast_to(np.asarray(cotangent, dtype=np.float64), shape)
    d_score = bound.backprop(values, grid, cotangent, accumulators)
    d_score = np.zeros(shape) if d_score is None else np.broadcast_to(d_score, shape).copy()
    return d_score, tree
