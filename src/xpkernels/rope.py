r"""Rotary position embeddings (RoPE) of queries and keys, forward and backward in place.

Each query and key row at position :math:`p` has its first :math:`R = 2 R_2`
features rotated pair by pair, pair :math:`i` by the angle :math:`p\,\theta_i`:

.. math::

    \begin{pmatrix} y_1 \\ y_2 \end{pmatrix}
    = \begin{pmatrix} c & -s \\ s & c \end{pmatrix}
      \begin{pmatrix} x_1 \\ x_2 \end{pmatrix},
    \qquad c = \cos(p\,\theta_i),\; s = \sin(p\,\theta_i),

from the caller's tables ``cos``, ``sin`` (``(Pmax, R2)``: row :math:`p`
holds :math:`\cos(p\,\theta_i)`, :math:`\sin(p\,\theta_i)`; or ``(B, Pmax,
R2)``, one table per batch). The pair :math:`(x_1, x_2)` is ``(x[i], x[i +
R2])`` in the half-rotation layout of Hugging Face models (the default) and
``(x[2i], x[2i + 1])`` with ``interleaved=True`` (GPT-J, GPT-NeoX's
interleaved variant). Features past :math:`R` (partial rotary,
``R < D``) are copied unchanged. The row at query ``s`` of batch ``b`` is
``position_ids[b, s]``, or ``s`` when ``position_ids`` is None.

A rotation is orthogonal, so the backward is the inverse rotation of the
output's gradient (the transposed matrix, :math:`s \to -s`), whatever the
tables hold:

.. math::

    dx_1 = c\,dy_1 + s\,dy_2, \qquad dx_2 = c\,dy_2 - s\,dy_1.

Nothing is checkpointed, and the tables receive no gradient. Computation
is in float32 (float64 for float64 inputs).

For Hugging Face's ``cos``, ``sin`` of shape ``(B, S, R)`` (the frequencies
repeated over both halves), pass ``cos[..., :R // 2]`` and ``sin[..., :R //
2]``: views, no copy.
"""

from __future__ import annotations

from . import _autograd
from . import _checks as check
from ._debug import debug_enabled
from .buffers import Duplicated, empty, primal
from .registry import resolve

__all__ = ["rope", "rope_", "rope_backward", "rope_backward_"]

#: Shape patterns of the arrays by role (a table's is its rank's).
_PATTERNS = {"x_q": "B H S D", "x_k": "B Hkv S D", "position_ids": "B S"}
_TABLE = {2: "Pmax R2", 3: "B Pmax R2"}


def _validate(fn: str, labels: dict, arrays: dict, position_ids, interleaved) -> tuple:
    """Check one pass's arrays; return ``(xp, cos, sin)`` with the tables as ``(B, Pmax, R2)``.

    ``labels`` maps the roles ``x_q``, ``x_k`` (the arrays rotated), ``y_q``, ``y_k`` (the
    arrays written), ``cos``, ``sin`` to the names messages give them, in the order the
    arrays are compared (the first array showing an axis sets its extent); ``arrays`` maps
    names to arrays.
    """
    q, k, cos, sin = (arrays[labels[r]] for r in ("x_q", "x_k", "cos", "sin"))
    outs = {labels[r]: arrays[labels[r]] for r in ("y_q", "y_k")}
    given = dict(arrays)
    if position_ids is not None:
        given["position_ids"] = position_ids
    xp = check.namespaces(fn, given, next(iter(labels.values())))
    patterns = {}
    for role, name in labels.items():
        a = arrays[name]
        if role in ("cos", "sin"):
            if a.ndim not in _TABLE:
                raise ValueError(
                    f"{fn}: {name} must have shape (Pmax, R2) or (B, Pmax, R2), got "
                    f"{tuple(a.shape)}"
                )
            patterns[name] = _TABLE[a.ndim]
        else:
            pattern = _PATTERNS[role.replace("y_", "x_")]
            check.rank(fn, name, a, 4, f"({', '.join(pattern.split())})")
            patterns[name] = pattern
        if role == "cos" and position_ids is not None:
            patterns["position_ids"] = _PATTERNS["position_ids"]
    dtype = check.floating(fn, labels["x_q"], xp, q)
    for name in (labels["x_k"], *outs):
        if check.floating(fn, name, xp, arrays[name]) != dtype:
            raise TypeError(
                f"{fn}: {name} must have {labels['x_q']}'s dtype {q.dtype}, got "
                f"{arrays[name].dtype}"
            )
    if check.floating(fn, "sin", xp, sin) != check.floating(fn, "cos", xp, cos):
        raise TypeError(f"{fn}: sin must have cos's dtype {cos.dtype}, got {sin.dtype}")
    if position_ids is not None:
        check.array(fn, "position_ids", position_ids)
        if position_ids.dtype not in (xp.int32, xp.int64):
            raise TypeError(
                f"{fn}: position_ids must have dtype int32 or int64, got {position_ids.dtype}"
            )
    dims = _extents(fn, {**arrays, "position_ids": position_ids}, patterns)
    if not 1 <= 2 * dims["R2"][0] <= dims["D"][0]:
        raise ValueError(
            f"{fn}: cos and sin must hold R2 pairs with 1 <= R2 <= D/2 = {dims['D'][0] // 2} "
            f"(the rotary dim R = 2 R2 at most {dims['D'][1]}'s D), got R2 = {dims['R2'][0]}"
        )
    for name, a in arrays.items():
        check.last_axis_contiguous(fn, name, a)
    rows, seq = dims["Pmax"][0], dims["S"][0]
    if position_ids is None and rows < seq:
        raise ValueError(
            f"{fn}: cos and sin must have a row per position, Pmax >= S = {seq} without "
            f"position_ids, got Pmax = {rows}"
        )
    if position_ids is not None:
        _position_values(fn, xp, position_ids, rows)
    check.writable(fn, outs)
    reads = {n: a for n, a in arrays.items() if n not in outs}
    check.no_overlap(
        fn,
        outs,
        reads,
        may_alias=[(labels["y_q"], labels["x_q"]), (labels["y_k"], labels["x_k"])],
    )
    check.boolean(fn, "interleaved", interleaved)
    if cos.ndim == 2:
        batch = dims["B"][0]
        cos, sin = (xp.broadcast_to(t[None, ...], (batch, *t.shape)) for t in (cos, sin))
    return xp, cos, sin


def _extents(fn: str, arrays: dict, patterns: dict) -> dict:
    """Each axis symbol -> ``(extent, name of the array that set it)``; ValueError naming both
    arrays when a later one disagrees."""
    dims: dict = {}
    for name, pattern in patterns.items():
        a = arrays[name]
        for symbol, n in zip(pattern.split(), a.shape):
            extent, first = dims.setdefault(symbol, (n, name))
            if extent != n:
                raise ValueError(
                    f"{fn}: {name} must have {symbol} = {extent} as {first} has, got shape "
                    f"{tuple(a.shape)} ({', '.join(pattern.split())})"
                )
    return dims


def _position_values(fn, xp, position_ids, rows) -> None:
    """ValueError unless ``position_ids`` lie in ``[0, Pmax)``, checked on host arrays or in
    debug mode only (reading a device array's values would sync it)."""
    if 0 in tuple(position_ids.shape):
        return
    if not (check.is_host_array(position_ids) or debug_enabled()):
        return
    low, high = int(xp.min(position_ids)), int(xp.max(position_ids))
    if low < 0 or high >= rows:
        raise ValueError(
            f"{fn}: position_ids must lie in [0, {rows - 1}] (the rows of cos and sin), "
            f"got values in [{low}, {high}]"
        )


def _run(route, pass_: str, pairs, cos, sin, position_ids, interleaved) -> None:
    """Rotate each ``(written, read)`` pair that has elements."""
    run = getattr(route.impl, pass_)
    for out, x in pairs:
        if 0 not in tuple(x.shape):
            run(out, x, cos, sin, position_ids, interleaved=interleaved)


def rope_(q_out, k_out, q, k, cos, sin, position_ids=None, *, interleaved=False, backend=None):
    """RoPE forward, in place: ``q_out``, ``k_out`` = ``q``, ``k`` rotated by their positions.

    Parameters
    ----------
    q_out, k_out : array
        Outputs, written in full; each may be the very same array as ``q``
        (``k``): rotation in place.
    q : array or Duplicated
        Queries.
    k : array or Duplicated
        Keys (any number of heads: GQA).
    cos, sin : array
        The tables: ``cos[p, i]``, ``sin[p, i]`` of the angle of pair ``i`` at
        position ``p``; one for all batches, or one per batch.
    position_ids : array, optional
        The table row of each query and key; None means row ``s`` for query ``s``.
    interleaved : bool
        Pairs ``(x[2i], x[2i + 1])`` (GPT-J) instead of ``(x[i], x[i + R2])``.
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Non-arrays, mixed namespaces, dtypes (q, k and the outputs must share
        one float dtype; cos and sin another, or the same), shapes, a rotary
        dim ``2 R2`` over ``D``, fewer table rows than positions, position ids
        out of range (checked where their values are on the host, or in debug
        mode), a last axis that is not contiguous, read-only or
        self-overlapping outputs, outputs overlapping an input other than
        being it. Nothing is written when a check fails.

    Shapes
    ------
    q, q_out : ``(B, H, S, D)``; k, k_out : ``(B, Hkv, S, D)``; cos, sin :
    ``(Pmax, R2)`` or ``(B, Pmax, R2)``, ``2 R2 <= D``; position_ids : ``(B,
    S)`` int32 or int64 in ``[0, Pmax)``, or None (then ``Pmax >= S``). The
    last axis of every float array must be contiguous; other strides are
    free (``(B, S, H, D)`` buffers as transposed views).
    """
    fn = "rope_"
    _autograd.check_inplace(fn, {"q": q, "k": k, "q_out": q_out, "k_out": k_out})
    arrays = {
        "q_out": q_out,
        "k_out": k_out,
        "q": primal(q),
        "k": primal(k),
        "cos": cos,
        "sin": sin,
    }
    labels = {"x_q": "q", "x_k": "k", "cos": "cos", "sin": "sin", "y_q": "q_out", "y_k": "k_out"}
    _, cos3, sin3 = _validate(fn, labels, arrays, position_ids, interleaved)
    routed = {name: arrays[name] for name in labels.values()}
    route = resolve("rope", {**routed, "position_ids": position_ids}, backend=backend)
    pairs = ((q_out, arrays["q"]), (k_out, arrays["k"]))
    _run(route, "forward", pairs, cos3, sin3, position_ids, interleaved)


def rope(q, k, cos, sin, position_ids=None, *, interleaved=False, backend=None):
    """RoPE forward into new arrays; see :func:`rope_`.

    Returns
    -------
    q_out, k_out : arrays of ``q``'s and ``k``'s shapes and dtypes. On torch tensors that
    require grad (grad mode on), autograd records xpkernels' backward (:mod:`xpkernels.torch`).

    Raises
    ------
    TypeError, ValueError
        As :func:`rope_`, and when ``cos`` or ``sin`` requires grad (grad mode
        on): the tables get no gradient.
    """
    for name, table in (("cos", cos), ("sin", sin)):
        check.no_gradient("rope", name, table, "a RoPE table")
    arrays = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": position_ids}
    options = {"interleaved": interleaved, "backend": backend}
    if (out := _autograd.record("rope", arrays, options)) is not _autograd.NOT_RECORDED:
        return out
    fn = "rope"
    q, k = primal(q), primal(k)
    for name, a in (("q", q), ("k", k)):
        check.namespace(fn, name, a)
    q_out, k_out = empty(q, q.shape, q.dtype), empty(k, k.shape, k.dtype)
    rope_(q_out, k_out, q, k, cos, sin, position_ids, interleaved=interleaved, backend=backend)
    return q_out, k_out


def rope_backward_(
    Q_out, K_out, Q, K, cos, sin, position_ids=None, *, interleaved=False, backend=None
) -> None:
    """RoPE backward, in place: the shadows of ``Q``, ``K`` get the inverse rotation of those of
    ``Q_out``, ``K_out``.

    Parameters
    ----------
    Q_out, K_out : Duplicated
        The forward's outputs; their shadows hold the cotangents ``dq_out``,
        ``dk_out`` (their primals are not read).
    Q, K : Duplicated
        The forward's inputs; their shadows receive ``dq``, ``dk`` (their
        primals are not read) and may be the very same arrays as the shadows
        of ``Q_out``, ``K_out``.
    cos, sin, position_ids, interleaved
        As the forward's.
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`rope_`, and when Q_out, K_out, Q or K is not a Duplicated.
        Nothing is written when a check fails.

    Shapes
    ------
    As :func:`rope_`, the shadows shaped like their primals.
    """
    fn = "rope_backward_"
    duplicated = {"Q_out": Q_out, "K_out": K_out, "Q": Q, "K": K}
    _autograd.check_inplace(fn, duplicated)
    for name, d in duplicated.items():
        check.duplicated(fn, name, d)
    arrays = {
        "Q_out.shadow": Q_out.shadow,
        "K_out.shadow": K_out.shadow,
        "Q.shadow": Q.shadow,
        "K.shadow": K.shadow,
        "cos": cos,
        "sin": sin,
    }
    labels = {
        "cos": "cos",
        "sin": "sin",
        "x_q": "Q_out.shadow",
        "x_k": "K_out.shadow",
        "y_q": "Q.shadow",
        "y_k": "K.shadow",
    }
    unread = {f"{n}.primal": d.primal for n, d in duplicated.items()}
    xp, cos3, sin3 = _validate(fn, labels, arrays, position_ids, interleaved)
    check.same_namespace(fn, xp, unread, reference="Q_out.shadow")
    route = resolve("rope", {**arrays, "position_ids": position_ids}, backend=backend)
    pairs = ((Q.shadow, Q_out.shadow), (K.shadow, K_out.shadow))
    _run(route, "backward", pairs, cos3, sin3, position_ids, interleaved)


def rope_backward(dq_out, dk_out, cos, sin, position_ids=None, *, interleaved=False, backend=None):
    """RoPE backward into new arrays; see :func:`rope_backward_`.

    Returns
    -------
    dq, dk : arrays of ``dq_out``'s and ``dk_out``'s shapes and dtypes.
    """
    fn = "rope_backward"
    for name, a in (("dq_out", dq_out), ("dk_out", dk_out)):
        check.namespace(fn, name, a)
    Q = Duplicated(dq_out, empty(dq_out, dq_out.shape, dq_out.dtype))
    K = Duplicated(dk_out, empty(dk_out, dk_out.shape, dk_out.dtype))
    rope_backward_(
        Duplicated(dq_out, dq_out),
        Duplicated(dk_out, dk_out),
        Q,
        K,
        cos,
        sin,
        position_ids,
        interleaved=interleaved,
        backend=backend,
    )
    return Q.shadow, K.shadow
