r"""Fused multi-head attention with grouped-query heads.

For batch ``b``, query head ``h`` (which reads kv head ``g = h // (H // Hkv)``),
query ``i`` and key ``j``:

.. math::

    s_{ij} = \mathrm{scale}\; q_i \cdot k_j, \qquad
    m_i = \max_j s_{ij}, \qquad
    l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

over the keys ``j`` that row ``i`` may see. Query ``i`` sits at absolute
position ``input_pos[b] + i`` and key ``j`` at position ``j``; key ``j`` is
seen when ``j < k_lengths[b]``, ``i < q_lengths[b]`` and, if ``causal``,
``j <= input_pos[b] + i``. A row that sees no key (fully masked) has
``o = 0``, ``m = -inf``, ``l = 0`` and zero gradients, never NaN.
``input_pos`` may be negative: causal queries before the first key
(``input_pos[b] + i < 0``) see nothing, and ``input_pos = Sk - Sq`` gives
flash-attn's bottom-right causal alignment for ``Sq > Sk``.

Host values of positions and lengths (Python ints, NumPy arrays) are checked
in the front: lengths within ``[0, S]``, every value within the kernels'
int32 index type (``+-(2**31 - 1)``). A device array's values are checked
only in debug mode (:func:`xpkernels.debug`), never read on the host
otherwise: the kernels load them at int64 and clamp them to the range where
they change the result (lengths to ``[0, S]``, positions to ``[-Sq, Sk]``),
so no value can make a kernel wrap or read out of bounds.

Non-finite inputs: a NaN (or infinity) in ``q``, ``k`` or ``v`` reaches
exactly the rows that can see it. A row that sees a NaN key, value or query
entry gets NaN in its output and gradients (and in ``dk``/``dv`` of the keys
it sees); rows that cannot see it -- causal rows before the key, keys at or
past ``k_lengths[b]``, queries past ``q_lengths[b]``, other query rows --
stay finite and exact. Masked scores are never combined with an input in a
way that could turn a NaN into a visible one (no ``0 * NaN``, no maximum
taken over a masked NaN).

Backward, with :math:`p_{ij} = e^{s_{ij} - m_i} / l_i` and
:math:`\delta_i = \sum_c do_{ic}\, o_{ic}`:

.. math::

    dv_j = \textstyle\sum_i p_{ij}\, do_i, \qquad
    ds_{ij} = p_{ij}\,(do_i \cdot v_j - \delta_i), \qquad
    dq_i = \mathrm{scale} \textstyle\sum_j ds_{ij}\, k_j, \qquad
    dk_j = \mathrm{scale} \textstyle\sum_i ds_{ij}\, q_i

``dk`` and ``dv`` are summed over the query heads of each kv group. The
checkpoints ``(m, l)`` are backend-neutral: a forward on one backend feeds a
backward on another. Accumulation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

from . import _autograd
from . import _checks as check
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_accumulator,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .registry import resolve

__all__ = [
    "attention_",
    "attention",
    "attention_backward_",
    "attention_backward",
    "AttentionCheckpoints",
    "AttentionBackwardScratch",
]


class _AttentionCheckpointArrays(NamedTuple):
    m: object  #: ``(B, H, Sq)`` float32, row max of the scaled masked scores (-inf: fully masked row)
    l: object  #: ``(B, H, Sq)`` float32, ``sum_j exp(s_ij - m_i)`` (0: fully masked row)


class AttentionCheckpoints(_AttentionCheckpointArrays, Checkpoints):
    """What ``attention_`` saves for its backward: ``m`` and ``l``; it records the forward's
    ``causal``, ``scale``, ``input_pos``, ``q_lengths`` and ``k_lengths``."""


class AttentionBackwardScratch(NamedTuple):
    """Transient workspace of ``attention_backward_`` (float32; float64 for float64 inputs).

    A field the routed backend does not use is None (Triton computes dQ in its
    own pass and has no ``dq_accum``); see ``xpkernels.backends.protocol``.
    """

    delta: object  #: ``(B, H, Sq)``, ``rowsum(do * o)``
    dq_accum: object  #: ``(B, H, Sq, D)``, ``dq / scale`` summed over key tiles, or None


def _position_array(input_pos):
    """``input_pos`` when it is an array (not a Python or NumPy integer scalar), else None."""
    if isinstance(input_pos, numbers.Integral) or not hasattr(input_pos, "shape"):
        return None
    return input_pos


def _input_pos(fn, xp, input_pos, batch):
    """``input_pos`` as a Python int, or the validated ``(B,)`` integer array.

    Any value is allowed, negative included, within the kernels' index type
    (``+-INDEX_MAX``) for host values; a device array's values are read only in
    debug mode (the kernels clamp them).
    """
    expected = f"an int or a ({batch},) integer array"
    if isinstance(input_pos, bool):
        raise TypeError(f"{fn}: input_pos must be {expected}, got a bool")
    if _position_array(input_pos) is not None:
        check.batch_integers(fn, "input_pos", xp, input_pos, batch, None, None, "")
        return input_pos
    if not isinstance(input_pos, numbers.Integral):
        raise TypeError(f"{fn}: input_pos must be {expected}, got {type(input_pos).__name__}")
    return check.index_int(fn, "input_pos", input_pos)


def _causal(fn, causal) -> bool:
    """``causal`` itself; TypeError unless it is a bool (``"no"`` is not False)."""
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    return causal


def _checkpoint_arrays(fn, xp, checkpoints, q, reference="q"):
    if not isinstance(checkpoints, AttentionCheckpoints):
        raise TypeError(
            f"{fn}: checkpoints must be the AttentionCheckpoints from "
            f"allocate_checkpoints(attention_, q, k, v), got {type(checkpoints).__name__}"
        )
    rows = tuple(q.shape[:3])
    check.same_namespace(
        fn, xp, {f"checkpoints.{n}": a for n, a in checkpoints._asdict().items()}, reference
    )
    for name in AttentionCheckpoints._fields:
        a = getattr(checkpoints, name)
        check.shape(fn, f"checkpoints.{name}", a, rows)
        check.float32(fn, f"checkpoints.{name}", xp, a)
    return checkpoints.m, checkpoints.l


def _validate_qkv(fn, q, k, v, names=("q", "k", "v")):
    """Ranks, shapes, head grouping, dtypes and layout of q, k, v; returns ``xp``."""
    nq, nk, nv = names
    xp = check.namespace(fn, nq, q)
    check.rank(fn, nq, q, 4, "(B, H, Sq, D)")
    check.namespace(fn, nk, k)
    check.rank(fn, nk, k, 4, "(B, Hkv, Sk, D)")
    check.namespace(fn, nv, v)
    check.rank(fn, nv, v, 4, "(B, Hkv, Sk, Dv)")
    batch, heads, _, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    if d < 1:
        raise ValueError(f"{fn}: {nq} must have head dim D >= 1, got shape {tuple(q.shape)}")
    check.shape(fn, nk, k, (batch, kv_heads, sk, d))
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"{fn}: the H={heads} query heads of {nq} must be a multiple of the Hkv={kv_heads} "
            f"kv heads of {nk} (grouped-query attention), got {nq} {tuple(q.shape)} and "
            f"{nk} {tuple(k.shape)}"
        )
    if v.shape[3] < 1:
        raise ValueError(f"{fn}: {nv} must have head dim Dv >= 1, got shape {tuple(v.shape)}")
    check.shape(fn, nv, v, (batch, kv_heads, sk, v.shape[3]))
    check.floating(fn, nq, xp, q)
    for name, a in ((nk, k), (nv, v)):
        if a.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have {nq}'s dtype {q.dtype}, got {a.dtype}")
    for name, a in ((nq, q), (nk, k), (nv, v)):
        check.last_axis_contiguous(fn, name, a)
    return xp


def _validate_options(fn, xp, q, k, scale, input_pos, q_lengths, k_lengths):
    batch, _, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else check.positive_finite(fn, "scale", scale)
    input_pos = _input_pos(fn, xp, input_pos, batch)
    if q_lengths is not None:
        check.batch_integers(fn, "q_lengths", xp, q_lengths, batch, 0, sq, "Sq")
    if k_lengths is not None:
        check.batch_integers(fn, "k_lengths", xp, k_lengths, batch, 0, sk, "Sk")
    return scale, input_pos


def _validate_forward(fn, o, q, k, v, causal, scale, input_pos, q_lengths, k_lengths, checkpoints):
    _causal(fn, causal)
    xp = check.namespace(fn, "q", q)
    check.same_namespace(
        fn,
        xp,
        {
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "q_lengths": q_lengths,
            "k_lengths": k_lengths,
            "input_pos": _position_array(input_pos),
        },
    )
    _validate_qkv(fn, q, k, v)
    batch, heads, sq, _ = q.shape
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (batch, heads, sq, v.shape[3]))
    check.last_axis_contiguous(fn, "o", o)
    scale, input_pos = _validate_options(fn, xp, q, k, scale, input_pos, q_lengths, k_lengths)
    m = lse_sum = None
    if checkpoints is not None:
        m, lse_sum = _checkpoint_arrays(fn, xp, checkpoints, q)
    outputs = {"o": o, "checkpoints.m": m, "checkpoints.l": lse_sum}
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, _read(q, k, v, input_pos, q_lengths, k_lengths))
    return scale, input_pos, m, lse_sum


def _read(q, k, v, input_pos, q_lengths, k_lengths, names=("q", "k", "v")) -> dict:
    """The inputs a pass reads besides its own buffers, by argument name (for the overlap check)."""
    return {
        **dict(zip(names, (q, k, v))),
        "input_pos": _position_array(input_pos),
        "q_lengths": q_lengths,
        "k_lengths": k_lengths,
    }


def _recorded(causal, scale, input_pos, q_lengths, k_lengths) -> dict:
    """The options of the forward that its backward must repeat."""
    return {
        "causal": causal,
        "scale": scale,
        "input_pos": input_pos,
        "q_lengths": q_lengths,
        "k_lengths": k_lengths,
    }


def attention_(
    o,
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    checkpoints=None,
    backend=None,
) -> None:
    """Attention forward, in place: ``o = softmax(scale * q k^T + mask) v``.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on fully masked rows); any float dtype.
    q, k, v : array or Duplicated
        Queries, keys and values, one float dtype.
    causal : bool
        Keep key ``j`` for query ``i`` only when ``j <= input_pos + i``.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    input_pos : int or array
        Absolute position of query 0: an int for every batch, or a ``(B,)``
        integer array; any int64 value, negative included (causal queries
        at negative positions see no key: ``o = 0``, ``m = -inf``, ``l = 0``).
        Keys sit at positions ``0 .. Sk - 1``. ``input_pos = Sk - Sq`` aligns
        the last query with the last key: flash-attn's bottom-right causal
        alignment (for ``Sq > Sk`` the first ``Sq - Sk`` queries see nothing).
    q_lengths, k_lengths : array, optional
        ``(B,)`` integer arrays in ``[0, Sq]`` / ``[0, Sk]``: queries
        ``i >= q_lengths[b]`` and keys ``j >= k_lengths[b]`` are masked out.
    checkpoints : AttentionCheckpoints, optional
        From ``allocate_checkpoints(attention_, q, k, v)``; receives ``m`` and
        ``l`` and records ``causal``, ``scale``, ``input_pos``, ``q_lengths``
        and ``k_lengths`` (arrays by identity, NumPy arrays by value), which
        the backward must repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message), a read-only ``o`` or
        checkpoint, an output sharing memory with an input or another output.
        Nothing is written when a check fails.

    Shapes
    ------
    q : ``(B, H, Sq, D)``; k : ``(B, Hkv, Sk, D)``; v : ``(B, Hkv, Sk, Dv)``;
    o : ``(B, H, Sq, Dv)``, with ``H % Hkv == 0`` (query head ``h`` reads kv
    head ``h // (H // Hkv)``). The last axis must be contiguous; other axes
    may have any stride, so ``(B, S, H, D)`` buffers viewed as BHSD work
    without copies.

    Checkpoints
    -----------
    m, l : ``(B, H, Sq)`` float32; see the module docstring (``-inf`` and 0 on
    fully masked rows).
    """
    fn = "attention_"
    _autograd.check_inplace(fn, {"q": q, "k": k, "v": v, "o": o})
    q, k, v = primal(q), primal(k), primal(v)
    scale, input_pos, m, lse_sum = _validate_forward(
        fn, o, q, k, v, causal, scale, input_pos, q_lengths, k_lengths, checkpoints
    )
    arrays = {
        "o": o,
        "q": q,
        "k": k,
        "v": v,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        "q_lengths": q_lengths,
        "k_lengths": k_lengths,
    }
    route = resolve("attention", arrays, backend=backend, head_dim=max(q.shape[3], v.shape[3]))
    if checkpoints is not None:
        forget_forward(checkpoints)
    route.impl.forward(
        o,
        q,
        k,
        v,
        m,
        lse_sum,
        scale=scale,
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )
    if checkpoints is not None:
        record_forward(checkpoints, fn, _recorded(causal, scale, input_pos, q_lengths, k_lengths))


@checkpoints_for(attention_)
def allocate_attention_checkpoints(q, k=None, v=None, **options) -> AttentionCheckpoints:
    """Allocate ``attention_``'s checkpoints for queries ``q`` ``(B, H, Sq, D)``: ``m, l (B, H, Sq)`` float32."""
    q = primal(q)
    fn = "allocate_checkpoints(attention_)"
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 4, "(B, H, Sq, D)")
    rows = tuple(q.shape[:3])
    return AttentionCheckpoints(m=empty_float32(q, rows), l=empty_float32(q, rows))


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    checkpoints=None,
    backend=None,
):
    """Attention forward into a new ``(B, H, Sq, Dv)`` array of ``q``'s dtype; see :func:`attention_`.

    Returns
    -------
    o : array
        On torch tensors that require grad (grad mode on), autograd records
        xpkernels' backward (:mod:`xpkernels.torch`).
    """
    fn = "attention"
    options = {
        "causal": causal,
        "scale": scale,
        "input_pos": input_pos,
        "q_lengths": q_lengths,
        "k_lengths": k_lengths,
        "checkpoints": checkpoints,
        "backend": backend,
    }
    if (o := _autograd.record(fn, {"q": q, "k": k, "v": v}, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v = primal(q), primal(v)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 4, "(B, H, Sq, D)")
    check.namespace(fn, "v", v)
    check.rank(fn, "v", v, 4, "(B, Hkv, Sk, Dv)")
    shape = (*q.shape[:3], v.shape[3])
    o = empty(q, shape, q.dtype)
    attention_(
        o,
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        checkpoints=checkpoints,
        backend=backend,
    )
    return o


def _scratch_arrays(fn, xp, scratch, q):
    if not isinstance(scratch, AttentionBackwardScratch):
        raise TypeError(
            f"{fn}: scratch must be the AttentionBackwardScratch from "
            f"allocate_scratchspace(attention_backward_, O, Q, K, V), got {type(scratch).__name__}"
        )
    check.same_namespace(
        fn, xp, {f"scratch.{n}": a for n, a in scratch._asdict().items()}, reference="Q.primal"
    )
    for name, shape in (("delta", tuple(q.shape[:3])), ("dq_accum", tuple(q.shape))):
        a = getattr(scratch, name)
        if a is None:  # a field the backend does not use; the route checks those it needs
            continue
        check.shape(fn, f"scratch.{name}", a, shape)
        check.accumulator(fn, f"scratch.{name}", xp, a, q.dtype)
    return scratch.delta, scratch.dq_accum


def _validate_backward(
    fn, O, Q, K, V, checkpoints, scratch, causal, scale, input_pos, q_lengths, k_lengths
):
    _causal(fn, causal)
    Ds = {
        name: check.duplicated(fn, name, d) for name, d in (("O", O), ("Q", Q), ("K", K), ("V", V))
    }
    q = Q.primal
    xp = check.namespace(fn, "Q.primal", q)
    named = {
        f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
    }
    check.same_namespace(
        fn,
        xp,
        {
            **named,
            "q_lengths": q_lengths,
            "k_lengths": k_lengths,
            "input_pos": _position_array(input_pos),
        },
    )
    _validate_qkv(fn, q, K.primal, V.primal, names=("Q.primal", "K.primal", "V.primal"))
    o_shape = (*q.shape[:3], V.primal.shape[3])
    for name, a in (
        ("O.primal", O.primal),
        ("O.shadow", O.shadow),
        ("Q.shadow", Q.shadow),
        ("K.shadow", K.shadow),
        ("V.shadow", V.shadow),
    ):
        check.floating(fn, name, xp, a)
        check.last_axis_contiguous(fn, name, a)
    check.shape(fn, "O.primal", O.primal, o_shape)
    scale, input_pos = _validate_options(
        fn, xp, q, K.primal, scale, input_pos, q_lengths, k_lengths
    )
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the AttentionCheckpoints that attention_ "
            "filled in the forward (allocate_checkpoints(attention_, q, k, v))"
        )
    m, lse_sum = _checkpoint_arrays(fn, xp, checkpoints, q, reference="Q.primal")
    delta = dq_accum = None
    if scratch is not None:
        delta, dq_accum = _scratch_arrays(fn, xp, scratch, q)
    outputs = {
        "Q.shadow": Q.shadow,
        "K.shadow": K.shadow,
        "V.shadow": V.shadow,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
    }
    check.writable(fn, outputs)
    inputs = {
        "O.primal": O.primal,
        "O.shadow": O.shadow,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **_read(
            q,
            K.primal,
            V.primal,
            input_pos,
            q_lengths,
            k_lengths,
            names=("Q.primal", "K.primal", "V.primal"),
        ),
    }
    check.no_overlap(fn, outputs, inputs)
    check_forward(
        fn, checkpoints, "attention_", _recorded(causal, scale, input_pos, q_lengths, k_lengths)
    )
    return scale, input_pos, m, lse_sum, delta, dq_accum


def attention_backward_(
    O,
    Q,
    K,
    V,
    *,
    checkpoints,
    scratch=None,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    backend=None,
) -> None:
    """Attention backward, in place: overwrites the shadows of Q, K and V with dq, dk, dv.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs (primals, read); their shadows receive ``dq``,
        ``dk`` and ``dv`` in full (zeros for masked queries and keys). ``dk``
        and ``dv`` are summed over each kv head's group of query heads.
    checkpoints : AttentionCheckpoints
        Filled by the forward ``attention_`` (on any backend) with the same
        ``causal``, ``scale``, ``input_pos``, ``q_lengths`` and ``k_lengths``;
        other options, or checkpoints no forward wrote, raise a ValueError
        naming the option.
    scratch : AttentionBackwardScratch, optional
        From ``allocate_scratchspace(attention_backward_, O, Q, K, V)`` (with
        the same ``backend``); None allocates it for this call. Every field
        the routed backend uses must be present; the others may be None.
    causal, scale, input_pos, q_lengths, k_lengths, backend
        As in the forward :func:`attention_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`attention_`: O ``(B, H, Sq, Dv)``, Q ``(B, H, Sq, D)``, K
    ``(B, Hkv, Sk, D)``, V ``(B, Hkv, Sk, Dv)``; shadows share their primal's
    shape and may have any float dtype. Last axes contiguous.

    Scratch
    -------
    delta : ``(B, H, Sq)``, ``rowsum(do * o)``; dq_accum : ``(B, H, Sq, D)``,
    dq accumulated over key tiles (array_api only; None for triton). Float32
    (float64 for float64 inputs).
    """
    fn = "attention_backward_"
    _autograd.check_inplace(fn, {"O": O, "Q": Q, "K": K, "V": V})
    scale, input_pos, m, lse_sum, delta, dq_accum = _validate_backward(
        fn, O, Q, K, V, checkpoints, scratch, causal, scale, input_pos, q_lengths, k_lengths
    )
    q, k, v, o = Q.primal, K.primal, V.primal, O.primal
    arrays = {
        "O.primal": o,
        "Q.primal": q,
        "K.primal": k,
        "V.primal": v,
        "O.shadow": O.shadow,
        "Q.shadow": Q.shadow,
        "K.shadow": K.shadow,
        "V.shadow": V.shadow,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
        "q_lengths": q_lengths,
        "k_lengths": k_lengths,
    }
    route = resolve("attention", arrays, backend=backend, head_dim=max(q.shape[3], v.shape[3]))
    if scratch is None:
        delta, dq_accum = _allocate_scratch(route, q)
    else:
        route.require_scratch(fn, scratch)
    route.impl.backward(
        O.shadow,
        q,
        k,
        v,
        o,
        m,
        lse_sum,
        Q.shadow,
        K.shadow,
        V.shadow,
        delta,
        dq_accum,
        scale=scale,
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )


def _allocate_scratch(route, q) -> AttentionBackwardScratch:
    """The scratch fields ``route``'s backend uses, allocated for ``q``; None for the others."""
    return AttentionBackwardScratch(
        delta=empty_accumulator(q, q.shape[:3]) if route.needs("delta") else None,
        dq_accum=empty_accumulator(q, q.shape) if route.needs("dq_accum") else None,
    )


def _scratch_route(op, fn, O, Q, K, V, backend, features=()):
    """The route a backward of ``op`` over these arguments (and per-call ``features``) takes
    (validates ``Q``'s rank and dtype)."""
    q = primal(Q)
    xp = check.namespace(fn, "Q", q)
    check.rank(fn, "Q", q, 4, "(B, H, Sq, D)")
    check.floating(fn, "Q", xp, q)
    arrays = {"Q": q, "O": primal(O), "K": primal(K), "V": primal(V)}
    head_dim = max(a.shape[-1] for a in arrays.values() if a is not None)
    return resolve(op, arrays, backend=backend, head_dim=head_dim, features=features), q


@scratchspace_for(attention_backward_)
def allocate_attention_backward_scratch(
    O, Q, K=None, V=None, *, backend=None, **options
) -> AttentionBackwardScratch:
    """Allocate ``attention_backward_``'s scratch from ``Q`` ``(B, H, Sq, D)``.

    Returns ``delta (B, H, Sq)`` and ``dq_accum (B, H, Sq, D)``, float32
    (float64 when ``Q`` is float64), for the backend the call routes to
    (``backend`` as in the backward); a field that backend does not use is
    None (triton: ``dq_accum``).
    """
    fn = "allocate_scratchspace(attention_backward_)"
    route, q = _scratch_route("attention", fn, O, Q, K, V, backend)
    return _allocate_scratch(route, q)


def attention_backward(
    do,
    q,
    k,
    v,
    o,
    *,
    checkpoints,
    causal=False,
    scale=None,
    input_pos=0,
    q_lengths=None,
    k_lengths=None,
    backend=None,
):
    """Attention backward into new arrays; see :func:`attention_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    fn = "attention_backward"
    arrays = with_new_shadows(fn, {"q": q, "k": k, "v": v})
    o = primal(o)
    attention_backward_(
        Duplicated(o, do),
        arrays["q"],
        arrays["k"],
        arrays["v"],
        checkpoints=checkpoints,
        causal=causal,
        scale=scale,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        backend=backend,
    )
    return arrays["q"].shadow, arrays["k"].shadow, arrays["v"].shadow
