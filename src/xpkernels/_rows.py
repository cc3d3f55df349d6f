"""Row views for the ``(..., M)`` primitives (norms and softmax).

Backends see 2-D ``(rows, M)`` views with a contiguous last axis. Leading
axes that collapse without a copy give one view; leading axes with strides
that do not collapse give one view per index of all but the row axis, so an
output is never written through a temporary copy.
"""

from __future__ import annotations

import itertools
import math

import array_api_compat


def _collapse(xp, a, m: int):
    if a.ndim == 2:
        return a
    try:
        return xp.reshape(a, (-1, m), copy=False)
    except (ValueError, AttributeError, RuntimeError, TypeError):
        return None


def row_groups(arrays, m: int):
    """Split same-shaped ``(..., M)`` arrays into aligned 2-D views.

    Parameters
    ----------
    arrays : sequence of array or None
        Arrays of one leading shape (None passes through as None).
    m : int
        Length of the last axis.

    Returns
    -------
    list of (int, tuple)
        ``(first_row, views)`` per group, where ``first_row`` is the flat
        index of the group's first row (to slice per-row checkpoints).
    """
    present = [a for a in arrays if a is not None]
    xp = array_api_compat.array_namespace(*present)
    lead = tuple(present[0].shape[:-1])
    if len(lead) == 0:
        return [(0, tuple(None if a is None else xp.reshape(a, (1, m)) for a in arrays))]
    views = [None if a is None else _collapse(xp, a, m) for a in arrays]
    if all(v is not None for v, a in zip(views, arrays) if a is not None):
        return [(0, tuple(views))]
    rows_per_group = lead[-1]
    groups = []
    for k, index in enumerate(itertools.product(*(range(n) for n in lead[:-1]))):
        groups.append((k * rows_per_group, tuple(None if a is None else a[index] for a in arrays)))
    return groups


def n_rows(shape) -> int:
    """Number of rows of a ``(..., M)`` shape."""
    return math.prod(tuple(shape)[:-1])
