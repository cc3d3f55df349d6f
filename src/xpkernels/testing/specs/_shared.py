"""Pieces several conformance declarations share (no spec of its own).

Row-wise specs (softmax, norms, gated activations) share their shape cases and
``y``-shaped outputs; attention-shaped specs share their case builders, the
default scale, the BSHD layout and the way they call their four functions.
"""

from __future__ import annotations

import math

import numpy as np

from xpkernels.buffers import Duplicated, allocate_scratchspace
from xpkernels.testing.harness import Case

# --------------------------------------------------------------------------- row-wise specs


def row_cases(*special: Case) -> list[Case]:
    """The row-wise specs' shape cases, ``special`` ones between the small and large shapes:
    one row of one element, single columns, a vector, odd extents, transposed leading axes,
    a row past 4096, a wide row and many short rows."""
    return [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True, quick=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        *special,
        Case(
            "transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True
        ),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]


def arrange_x(case, arrays, target):
    """``x`` with its leading axes transposed in memory when the case asks."""
    if not case.params.get("permute_leading"):
        return arrays
    return {**arrays, "x": target.leading_transposed(arrays["x"])}


def cotangent_y(case, rng):
    """``dy`` of the case's shape."""
    return {"y": rng.standard_normal(case.params["shape"])}


def allocate_y(case, arrays, target, dtype):
    """``y`` of the case's shape, NaN-filled."""
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


# --------------------------------------------------------------------------- attention-shaped specs


def checked_case(op, ident, base, params, interpreter, quick) -> Case:
    """``Case(ident)`` with ``params`` over the defaults ``base``, refusing unknown names."""
    unknown = set(params) - set(base)
    if unknown:
        raise TypeError(f"{op} case {ident}: unknown parameters {sorted(unknown)}")
    return Case(ident, {**base, **params}, interpreter=interpreter, quick=quick)


def varlen_case(op, base, ident, q_lens, k_lens, interpreter=True, quick=False, **params) -> Case:
    """A packed case of sequences ``q_lens`` and ``k_lens``; ``input_pos="bottom_right"``
    aligns the last query of each sequence with its last key."""
    case = checked_case(op, ident, base, params, interpreter, quick)
    p = {**case.params, "q_lens": tuple(q_lens), "k_lens": tuple(k_lens)}
    if p["input_pos"] == "bottom_right":
        p["input_pos"] = [sk - sq for sq, sk in zip(q_lens, k_lens)]
    return Case(ident, p, interpreter=interpreter, quick=quick)


def scale_of(p) -> float:
    """The case's softmax scale: its own, or ``1 / sqrt(D)``."""
    return p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(p["D"])


def add_positions(p, arrays) -> dict:
    """``arrays`` with the case's per-batch ``input_pos`` (when not an int) as an input."""
    if not isinstance(p["input_pos"], int):
        arrays["input_pos"] = np.asarray(p["input_pos"], dtype=np.int64)
    return arrays


def bshd(target, a):
    """``a`` (rank 3 or 4) as a view of a buffer whose axes 1 and 2 are swapped in memory: for
    ``(B, H, S, D)``, the BSHD layout with the last axis contiguous."""
    xp = target.xp
    axes = (0, 2, 1, 3) if a.ndim == 4 else (0, 2, 1)
    return xp.permute_dims(xp.asarray(xp.permute_dims(a, axes), copy=True), axes)


def host_ints(values, dtype="int64"):
    """``target -> values`` as an integer array on the target (for error cases)."""
    return lambda t: t.asarray(np.asarray(values, dtype=dtype))


def no_arrays(arrays) -> tuple:
    """No positional arguments after ``q, k, v``."""
    return ()


def attention_calls(inplace, allocating, options, positional=no_arrays):
    """``(forward_, forward)`` of an attention-shaped spec: ``inplace(o, q, k, v, ...)`` and
    ``allocating(q, k, v, ...)``, with ``positional(arrays)`` after ``v`` and
    ``options(case, arrays)`` as keywords."""

    def forward_(case, arrays, outs, checkpoints, backend):
        inplace(
            outs["o"],
            *(arrays[n] for n in ("q", "k", "v")),
            *positional(arrays),
            **options(case, arrays),
            checkpoints=checkpoints,
            backend=backend,
        )

    def forward(case, arrays, checkpoints, backend):
        o = allocating(
            *(arrays[n] for n in ("q", "k", "v")),
            *positional(arrays),
            **options(case, arrays),
            checkpoints=checkpoints,
            backend=backend,
        )
        return {"o": o}

    return forward_, forward


def attention_backward_calls(inplace, allocating, options, positional=no_arrays):
    """``(backward_, backward)`` of attention and packed attention: their scratch allocated
    from ``O, Q, K, V`` alone, the rest as in :func:`attention_calls` (``allocating`` also
    takes ``o`` after ``v``)."""

    def backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
        O = Duplicated(outs["o"], cotangents["o"])
        Q, K, V = (Duplicated(arrays[n], grads[n]) for n in ("q", "k", "v"))
        scratch = allocate_scratchspace(inplace, O, Q, K, V, backend=backend)
        inplace(
            O,
            Q,
            K,
            V,
            *positional(arrays),
            checkpoints=checkpoints,
            scratch=scratch,
            **options(case, arrays),
            backend=backend,
        )

    def backward(case, arrays, outs, cotangents, checkpoints, backend):
        dq, dk, dv = allocating(
            cotangents["o"],
            *(arrays[n] for n in ("q", "k", "v")),
            outs["o"],
            *positional(arrays),
            checkpoints=checkpoints,
            **options(case, arrays),
            backend=backend,
        )
        return {"q": dq, "k": dk, "v": dv}

    return backward_, backward
