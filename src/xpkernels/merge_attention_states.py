r"""Merging two partial attention states: the exact combine over disjoint key sets.

A state is what :func:`xpkernels.attention_` leaves for one set of keys: the
output ``o`` and the checkpoints ``(m, l)``, with ``m`` the row max of the
scaled masked scores and ``l = sum_j exp(s_j - m)`` (natural log units; a row
that sees no key has ``o = 0``, ``m = -inf``, ``l = 0``). Write
``lse = m + log l`` (``-inf`` for an empty row). For attention over key set
``A`` and over a disjoint key set ``B``, attention over ``A`` union ``B`` is,
per row,

.. math::

    m = \max(m_a, m_b), \qquad
    l = l_a e^{m_a - m} + l_b e^{m_b - m}, \qquad
    o = w_a\, o_a + w_b\, o_b, \qquad
    w_a = e^{\mathrm{lse}_a - \mathrm{lse}} = \frac{l_a e^{m_a - m}}{l}

(``w_b`` likewise), exactly: ``m`` and ``l`` are attention's own checkpoints
over ``A`` union ``B``. An empty side has ``w = 0`` and contributes nothing,
whatever its ``o`` holds; two empty sides merge into the empty state
(``o = 0``, ``m = -inf``, ``l = 0``). No step evaluates ``-inf - -inf`` or
``0 / 0``, so no NaN arises from empty states.

NaN reaches exactly the rows that see it, as in attention: a NaN in ``m_a``,
``l_a``, ``m_b`` or ``l_b`` makes that row's ``o`` and ``l`` NaN (and ``m``
where it is in ``m_a`` or ``m_b``), and, in the backward, that row's
``do_a``, ``do_b``, ``dlse_a`` and ``dlse_b``; every other row is untouched
by it. So does a state no attention produces, whose ``lse`` is not a number
or ``+inf``: ``m = +inf``, or ``l`` negative or ``+inf``. Debug mode
(:func:`xpkernels.debug`) refuses those instead, with a ValueError naming
the argument (it reads the values, which syncs a device). A NaN in an ``o``
reaches the merged row where its side's weight is not 0; a side of weight 0
(an empty side) is never read.

Backward. The merge depends on each side's ``(m, l)`` only through its
``lse``, and ``lse = log(e^{lse_a} + e^{lse_b})``, so
:math:`\partial \mathrm{lse} / \partial \mathrm{lse}_a = w_a` and
:math:`\partial o / \partial \mathrm{lse}_a = w_a o_a - w_a (w_a o_a + w_b o_b)
= w_a (o_a - o)`. Given the cotangent ``do`` of ``o`` and ``dlse`` of the
merged ``lse`` (zero when the merged lse is not used further; nonzero when
merges chain):

.. math::

    do_a = w_a\, do, \qquad
    d\mathrm{lse}_a = w_a \big(\textstyle\sum_c do_c\, (o_{a,c} - o_c) + d\mathrm{lse}\big)

and the same for ``b``; both are 0 on an empty side. With respect to the
checkpoints themselves, :math:`\partial \mathrm{lse}_a / \partial m_a = 1`
and :math:`\partial \mathrm{lse}_a / \partial l_a = 1 / l_a`: ``dm_a =
dlse_a`` and ``dl_a = dlse_a / l_a`` (0 where ``l_a = 0``). The torch op's
autograd (:mod:`xpkernels.torch`) receives cotangents ``(dm, dl)`` of the
merged ``(m, l)`` rather than ``dlse``; since ``l = e^{lse - m}``, ``dm
dm_merged + dl dl_merged = (dm - l dl)\, d(\max(m_a, m_b)) + l dl\,
d\mathrm{lse}``: it passes ``dlse = l dl`` to the backward and adds ``dm -
l dl`` to ``dm`` of the side holding the max (side ``a`` on a tie). That term
is 0 when the merged state is itself used only through its lse (a further
merge), where ``dm = dlse`` and ``dl = dlse / l``.

Ring attention over ``A`` and ``B`` needs no merge backward: running
:func:`xpkernels.attention_backward_` on each part with the MERGED ``o``, the
merged ``(m, l)`` as checkpoints and the full ``do`` gives ``dq`` (summed over
the parts) and each part's ``dk``, ``dv`` of attention over ``A`` union ``B``,
because each part's probabilities ``exp(s - m) / l`` and ``delta =
rowsum(do * o)`` are then those of the union. Pass ``checkpoints=`` to
:func:`merge_attention_states_` to get merged checkpoints that backward
accepts.

Accumulation is in float32 (float64 for float64 outputs ``o_a``).
"""

from __future__ import annotations

import math

from . import _autograd
from . import _checks as check
from ._debug import debug_enabled
from .attention import AttentionCheckpoints
from .buffers import Duplicated, empty, forget_forward, primal, record_forward
from .registry import resolve

__all__ = [
    "merge_attention_states_",
    "merge_attention_states",
    "merge_attention_states_backward_",
    "merge_attention_states_backward",
]

#: The output/state aliasing the in-place forward allows: each output may BE the same
#: side's input (merge into side a's buffers, or into side b's).
_FORWARD_ALIASES = (
    ("o", "o_a"),
    ("m", "m_a"),
    ("l", "l_a"),
    ("o", "o_b"),
    ("m", "m_b"),
    ("l", "l_b"),
)
#: The backward's: ``do_a`` or ``do_b`` may be ``do`` itself, ``dlse_a`` or ``dlse_b`` ``dlse``.
_BACKWARD_ALIASES = (
    ("O_a.shadow", "O.shadow"),
    ("O_b.shadow", "O.shadow"),
    ("dlse_a", "dlse"),
    ("dlse_b", "dlse"),
)


def _statistic(fn, name, xp, a, rows, o_dtype) -> None:
    """``a`` is a ``rows``-shaped float32 array (float64 also accepted for float64 ``o``)."""
    check.shape(fn, name, a, rows)
    if a.dtype != xp.float32 and not (o_dtype == xp.float64 and a.dtype == xp.float64):
        extra = " (or float64 with float64 o)" if o_dtype == xp.float64 else ""
        raise TypeError(f"{fn}: {name} must be float32{extra}, got {a.dtype}")


def _validate_states(fn, xp, sides, tiles, stats):
    """Check the two input states and the other arrays; returns the rows shape ``(B, H, S)``.

    ``sides`` is ``[(o name, o), (m name, m), (l name, l)]`` for side a then
    side b; ``tiles`` and ``stats`` are ``(name, array or None)`` pairs of the
    other arrays shaped like ``o`` and like ``m``.
    """
    (oa_name, o_a), *_ = sides[0]
    check.rank(fn, oa_name, o_a, 4, "(B, H, S, Dv)")
    check.floating(fn, oa_name, xp, o_a)
    rows = tuple(o_a.shape[:3])
    for (o_name, o), (m_name, m), (l_name, lse_sum) in sides:
        check.shape(fn, o_name, o, tuple(o_a.shape))
        check.floating(fn, o_name, xp, o)
        if o.dtype != o_a.dtype:
            raise TypeError(
                f"{fn}: {o_name} must have {oa_name}'s dtype {o_a.dtype}, got {o.dtype}"
            )
        check.last_axis_contiguous(fn, o_name, o)
        for name, a in ((m_name, m), (l_name, lse_sum)):
            check.rank(fn, name, a, 3, "(B, H, S)")
            _statistic(fn, name, xp, a, rows, o_a.dtype)
    for name, a in tiles:
        check.shape(fn, name, a, tuple(o_a.shape))
        check.floating(fn, name, xp, a)
        check.last_axis_contiguous(fn, name, a)
    for name, a in stats:
        if a is not None:
            check.rank(fn, name, a, 3, "(B, H, S)")
            _statistic(fn, name, xp, a, rows, o_a.dtype)
    return rows


def _debug_states(fn, xp, arrays) -> None:
    """In debug mode, ValueError for a state no attention produces: ``m = +inf``, or ``l``
    negative or ``+inf`` (``arrays``: the call's arrays by name; its ``m*``/``l*`` are read).

    Outside debug mode such a row merges into NaN (module docstring): reading the values
    would sync the device (capture safety).
    """
    if not debug_enabled():
        return
    for name, a in arrays.items():
        if name[0] == "m" and bool(xp.any(a == math.inf)):
            raise ValueError(
                f"{fn}: {name} holds +inf, which no attention state has (a row max of "
                "scores is finite, or -inf for a row that sees no key)"
            )
        if name[0] == "l" and bool(xp.any((a < 0) | (a == math.inf))):
            raise ValueError(
                f"{fn}: {name} holds a negative or infinite value, which no attention state "
                "has (a sum of exponentials is finite and >= 0)"
            )


def _route(arrays, backend, o_a):
    return resolve("merge_attention_states", arrays, backend=backend, head_dim=o_a.shape[3])


def merge_attention_states_(
    o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, *, checkpoints=None, backend=None
) -> None:
    """Merge two attention states over disjoint key sets, in place into ``o``, ``m``, ``l``.

    Parameters
    ----------
    o : array
        Merged output, written in full; any float dtype. May be ``o_a`` or
        ``o_b`` itself (merging into a side's buffers), but not overlap
        either partly.
    m, l : array
        Merged checkpoints, written in full: attention's ``m`` and ``l`` over
        both key sets. ``m`` may be ``m_a`` or ``m_b``, ``l`` may be ``l_a`` or
        ``l_b`` (the same array, never a partial overlap). No other output
        may share memory with an input or another output.
    o_a, m_a, l_a : array or Duplicated
        Side a: attention's output and checkpoints over key set A (an empty
        row: ``m = -inf``, ``l = 0``; its ``o`` is not read).
    o_b, m_b, l_b : array or Duplicated
        Side b, over a key set disjoint from A; ``o_b`` has ``o_a``'s dtype.
    checkpoints : AttentionCheckpoints, optional
        The tuple whose fields ARE ``m`` and ``l`` (``checkpoints.m is m``);
        when given, the merge records it as written by ``attention_`` with no
        options, so :func:`xpkernels.attention_backward_` accepts it for the
        backward of each part with that part's own options (which the record
        of a merged state cannot check: each part's backward must repeat its
        own forward's).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError
        Non-arrays, wrong dtypes (checkpoints not float32, ``o_b`` not of
        ``o_a``'s dtype), arrays from different namespaces or devices.
    ValueError
        Wrong ranks or shapes (states of different shapes), a last axis of an
        ``o`` that is not contiguous, read-only outputs, outputs whose own
        elements share memory (broadcast views), overlaps other than those
        allowed above, ``checkpoints`` whose fields are not ``m`` and ``l``;
        in debug mode, ``m_a``/``m_b`` holding ``+inf`` or ``l_a``/``l_b``
        negative or ``+inf`` values. Nothing is written when a check fails.

    Shapes
    ------
    o, o_a, o_b : ``(B, H, S, Dv)``, last axis contiguous; m, l, m_a, l_a,
    m_b, l_b : ``(B, H, S)`` float32 (float64 is also accepted when ``o_a`` is
    float64, for float64 gradient checks). Other strides are free.
    """
    fn = "merge_attention_states_"
    inputs = {"o_a": o_a, "m_a": m_a, "l_a": l_a, "o_b": o_b, "m_b": m_b, "l_b": l_b}
    _autograd.check_inplace(fn, {"o": o, "m": m, "l": l, **inputs})
    inputs = {name: primal(a) for name, a in inputs.items()}
    outputs = {"o": o, "m": m, "l": l}
    xp = check.namespaces(fn, {**inputs, **outputs}, "o_a")
    sides = [[(f"{p}_{s}", inputs[f"{p}_{s}"]) for p in "oml"] for s in "ab"]
    _validate_states(fn, xp, sides, [("o", o)], [("m", m), ("l", l)])
    if checkpoints is not None:
        if not isinstance(checkpoints, AttentionCheckpoints):
            raise TypeError(
                f"{fn}: checkpoints must be an AttentionCheckpoints whose fields are m and l, "
                f"got {type(checkpoints).__name__}"
            )
        if checkpoints.m is not m or checkpoints.l is not l:
            raise ValueError(
                f"{fn}: checkpoints.m and checkpoints.l must be the very arrays passed as m and "
                "l (the merge writes them)"
            )
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, inputs, may_alias=_FORWARD_ALIASES)
    _debug_states(fn, xp, inputs)
    route = _route({**outputs, **inputs}, backend, inputs["o_a"])
    if checkpoints is not None:
        forget_forward(checkpoints)
    route.impl.forward(o, m, l, *inputs.values())
    if checkpoints is not None:
        record_forward(checkpoints, "attention_", {})


def merge_attention_states(o_a, m_a, l_a, o_b, m_b, l_b, *, backend=None):
    """Merge two attention states into new arrays; see :func:`merge_attention_states_`.

    Returns
    -------
    o : array
        ``(B, H, S, Dv)``, ``o_a``'s dtype.
    m, l : array
        ``(B, H, S)``, ``m_a``'s dtype (float32). On torch tensors that require
        grad (grad mode on), autograd records xpkernels' backward
        (:mod:`xpkernels.torch`) for all three outputs.
    """
    fn = "merge_attention_states"
    arrays = {"o_a": o_a, "m_a": m_a, "l_a": l_a, "o_b": o_b, "m_b": m_b, "l_b": l_b}
    options = {"backend": backend}
    if (out := _autograd.record(fn, arrays, options)) is not _autograd.NOT_RECORDED:
        return out
    o_a, m_a = primal(o_a), primal(m_a)
    check.namespace(fn, "o_a", o_a)
    check.rank(fn, "o_a", o_a, 4, "(B, H, S, Dv)")
    check.namespace(fn, "m_a", m_a)
    check.rank(fn, "m_a", m_a, 3, "(B, H, S)")
    o = empty(o_a, o_a.shape, o_a.dtype)
    m = empty(m_a, m_a.shape, m_a.dtype)
    lse_sum = empty(m_a, m_a.shape, m_a.dtype)
    merge_attention_states_(o, m, lse_sum, o_a, m_a, l_a, o_b, m_b, l_b, backend=backend)
    return o, m, lse_sum


def merge_attention_states_backward_(
    O, m, l, O_a, m_a, l_a, O_b, m_b, l_b, *, dlse_a, dlse_b, dlse=None, backend=None
) -> None:
    """Merge backward, in place: ``do_a``, ``do_b`` into the shadows of O_a, O_b; ``dlse_a``, ``dlse_b``.

    Parameters
    ----------
    O : Duplicated
        The merged output ``o`` (primal, read) and its cotangent ``do``
        (shadow, read).
    m, l : array
        The merged checkpoints the forward wrote (read).
    O_a, O_b : Duplicated
        Each side's output (primal, read); their shadows receive ``do_a =
        w_a do`` and ``do_b = w_b do`` in full (0 on an empty side). Either
        shadow may be ``O.shadow`` itself (not both).
    m_a, l_a, m_b, l_b : array
        Each side's checkpoints (read).
    dlse_a, dlse_b : array
        Required. Receive the gradients of each side's ``lse = m + log l`` in
        full (0 on an empty side): ``w_a (rowsum(do * (o_a - o)) + dlse)``;
        they are also the gradients of ``m_a``, ``m_b``, and ``dlse_a / l_a``
        is that of ``l_a`` (module docstring). Either may be ``dlse`` itself
        (not both).
    dlse : array, optional
        Cotangent of the merged state's lse (a later merge's ``dlse_a``);
        None means zero.
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As the forward (the debug checks cover ``m`` and ``l`` too), when O,
        O_a or O_b is not a Duplicated of arrays, and when ``dlse_a`` or
        ``dlse_b`` is not an array. Nothing is written when a check fails.

    Shapes
    ------
    O, O_a, O_b (primals and shadows): ``(B, H, S, Dv)``, shadows of any float
    dtype; m, l, m_a, l_a, m_b, l_b, dlse, dlse_a, dlse_b: ``(B, H, S)``,
    float32 (or float64 with float64 ``o_a``).
    """
    fn = "merge_attention_states_backward_"
    _autograd.check_inplace(
        fn,
        {
            "O": O,
            "m": m,
            "l": l,
            "O_a": O_a,
            "m_a": m_a,
            "l_a": l_a,
            "O_b": O_b,
            "m_b": m_b,
            "l_b": l_b,
            "dlse": dlse,
            "dlse_a": dlse_a,
            "dlse_b": dlse_b,
        },
    )
    Ds = {name: check.duplicated(fn, name, d) for name, d in (("O", O), ("O_a", O_a), ("O_b", O_b))}
    stats = {"m": m, "l": l, "m_a": m_a, "l_a": l_a, "m_b": m_b, "l_b": l_b}
    named = {
        f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
    }
    arrays = {**named, **stats, "dlse_a": dlse_a, "dlse_b": dlse_b}
    if dlse is not None:
        arrays["dlse"] = dlse
    xp = check.namespaces(fn, arrays, "O_a.primal")
    sides = [
        [("O_a.primal", O_a.primal), ("m_a", m_a), ("l_a", l_a)],
        [("O_b.primal", O_b.primal), ("m_b", m_b), ("l_b", l_b)],
    ]
    tiles = [(name, named[name]) for name in ("O.primal", "O.shadow", "O_a.shadow", "O_b.shadow")]
    rows = [("m", m), ("l", l), ("dlse", dlse), ("dlse_a", dlse_a), ("dlse_b", dlse_b)]
    _validate_states(fn, xp, sides, tiles, rows)
    outputs = {
        "O_a.shadow": O_a.shadow,
        "O_b.shadow": O_b.shadow,
        "dlse_a": dlse_a,
        "dlse_b": dlse_b,
    }
    check.writable(fn, outputs)
    read = {
        "O.primal": O.primal,
        "O.shadow": O.shadow,
        "O_a.primal": O_a.primal,
        "O_b.primal": O_b.primal,
        **stats,
        "dlse": dlse,
    }
    check.no_overlap(fn, outputs, read, may_alias=_BACKWARD_ALIASES)
    _debug_states(fn, xp, stats)
    route = _route({**read, **outputs}, backend, O_a.primal)
    route.impl.backward(
        O.shadow,
        dlse,
        O.primal,
        m,
        l,
        O_a.primal,
        m_a,
        l_a,
        O_b.primal,
        m_b,
        l_b,
        O_a.shadow,
        dlse_a,
        O_b.shadow,
        dlse_b,
    )


def merge_attention_states_backward(
    do, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, *, dlse=None, backend=None
):
    """Merge backward into new arrays; see :func:`merge_attention_states_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the merged output ``o``.
    o, m, l : array or Duplicated
        The merged state (the forward's outputs).
    o_a, m_a, l_a, o_b, m_b, l_b : array or Duplicated
        The two states the forward merged.
    dlse : array, optional
        Cotangent of the merged lse; None means zero.
    backend : str, optional
        Explicit backend.

    Returns
    -------
    do_a, do_b, dlse_a, dlse_b : arrays
        ``do_a``, ``do_b`` shaped and typed like ``o_a``; ``dlse_a``,
        ``dlse_b`` shaped and typed like ``m_a``.
    """
    fn = "merge_attention_states_backward"
    o, o_a, o_b, m_a = primal(o), primal(o_a), primal(o_b), primal(m_a)
    for name, a in (("o_a", o_a), ("o_b", o_b), ("m_a", m_a), ("o", o), ("do", do)):
        check.namespace(fn, name, a)
    for name, a in (("o_b", o_b), ("o", o), ("do", do)):
        check.shape(fn, name, a, tuple(o_a.shape))
    O_a = Duplicated(o_a, empty(o_a, o_a.shape, o_a.dtype))
    O_b = Duplicated(o_b, empty(o_b, o_b.shape, o_b.dtype))
    dlse_a = empty(m_a, m_a.shape, m_a.dtype)
    dlse_b = empty(m_a, m_a.shape, m_a.dtype)
    merge_attention_states_backward_(
        Duplicated(o, do),
        primal(m),
        primal(l),
        O_a,
        m_a,
        primal(l_a),
        O_b,
        primal(m_b),
        primal(l_b),
        dlse_a=dlse_a,
        dlse_b=dlse_b,
        dlse=dlse,
        backend=backend,
    )
    return O_a.shadow, O_b.shadow, dlse_a, dlse_b
