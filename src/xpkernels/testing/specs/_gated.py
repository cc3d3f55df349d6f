"""What the gated activations' specs (SwiGLU, GeGLU) share: inputs, cotangents, layouts."""

from __future__ import annotations

import numpy as np

__all__ = ["arrange", "cotangents", "inputs"]

#: Gate values of the large-gates cases, one of them every third element.
_LARGE = np.array([60.0, -60.0, 1e4, -1e4, 20.0, -20.0, 88.0, -88.0])


def arrange(case, arrays, target):
    """The case's arrays, with their leading axes transposed in memory when it asks."""
    if not case.params.get("permute_leading"):
        return arrays
    return {name: target.leading_transposed(a) for name, a in arrays.items()}


def inputs(case, rng):
    """The gate ``a`` and values ``b``; large-gate cases put a gate far out in a tail every
    third element, with ``b`` in [-1, 1]."""
    shape = case.params["shape"]
    if not case.params.get("large"):
        return {"a": rng.standard_normal(shape) * 3, "b": rng.standard_normal(shape)}
    a = rng.standard_normal(shape) * 30
    flat = a.reshape(-1)
    flat[::3] = np.resize(_LARGE, flat[::3].size)
    return {"a": a, "b": rng.uniform(-1, 1, shape)}


def cotangents(case, rng):
    """``dy``: in [-1, 1] for the large-gate cases (``1e4 * b * dy`` stays finite in float16)."""
    shape = case.params["shape"]
    if case.params.get("large"):
        return {"y": rng.uniform(-1, 1, shape)}
    return {"y": rng.standard_normal(shape)}
