"""The Python objects of the flex ops: mods filed under integer keys, and the score mod's arrays.

An op schema carries tensors and scalars, not Python objects. A score mod,
mask mod or block mask travels to the ``xpkernels`` flex ops as the integer
key :func:`file` gives it in a registry, and the op looks it up again
(:func:`filed`). The score mod's captured float arrays travel beside its key
as the tensor list ``score_arrays`` (:func:`score_arrays`), which the op
binds into the mod (:func:`bound`): so those arrays -- ``nn.Parameter``
tables, slopes, projections -- are op inputs, and autograd gives them the
gradients the flex backward accumulates (:func:`score_grads`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
import weakref

from ..buffers import grad_shadow
from ..mods import FLOAT, Graph, as_score_mod

__all__ = ["bound", "file", "filed", "score_arrays", "score_grads"]

_FILED: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_KEEP: dict[int, object] = {}
_KEYS = itertools.count()
_LOCK = threading.Lock()


def file(obj, *, keep: bool = False) -> int:
    """File ``obj`` (a mod or block mask) under a new integer key for the flex ops.

    The entry lives as long as ``obj`` does (the autograd graph of a call
    holds it), or for the life of the process with ``keep=True`` (a
    compiled graph bakes the key in).
    """
    with _LOCK:
        key = next(_KEYS)
        _FILED[key] = obj
        if keep:
            _KEEP[key] = obj
    return key


def filed(key: int):
    """The object filed under ``key``; RuntimeError once it is gone."""
    obj = _FILED.get(key)
    if obj is None:
        raise RuntimeError(
            f"xpkernels flex ops: nothing is filed under key {key} (the call that filed its "
            "mods has been released); call xpkernels.flex_attention again"
        )
    return obj


def score_arrays(score_mod) -> list:
    """The float arrays a score mod (or None) captures, in slot order: the flex ops' ``score_arrays``."""
    if score_mod is None:
        return []
    return [s.array for s in as_score_mod(score_mod).graph.slots if s.kind == FLOAT]


def bound(score_mod, arrays):
    """``score_mod`` (or None) reading ``arrays`` in place of its captured float arrays."""
    if score_mod is None:
        return None
    graph = score_mod.graph
    slots = list(graph.slots)
    floats = [i for i, s in enumerate(slots) if s.kind == FLOAT]
    for i, a in zip(floats, arrays):
        slots[i] = dataclasses.replace(slots[i], array=a)
    mod = copy.copy(score_mod)
    mod.graph = Graph(graph.nodes, graph.output, slots)
    return mod


def score_grads(score_mod) -> tuple:
    """Zeroed gradient accumulators of a bound score mod: ``(ScoreModGrad, one per float array)``."""
    tree = grad_shadow(score_mod, feature_grads=True)
    slots = [s for s in score_mod.graph.slots if s.kind == FLOAT]
    return tree, [tree.lookup(s.path, s.field) for s in slots]
