r"""Attention over packed variable-length sequences (flash-attn's ``varlen`` layout).

A batch of ``B`` sequences of different lengths is packed without padding:
queries ``q (Tq, H, D)``, keys ``k (Tk, Hkv, D)`` and values ``v (Tk, Hkv,
Dv)`` hold the tokens of every sequence one after the other, and the
``(B + 1,)`` int32 prefix sums ``cu_seqlens_q`` / ``cu_seqlens_k`` say where
each starts: sequence ``b`` owns queries ``cu_seqlens_q[b] <= t <
cu_seqlens_q[b + 1]`` and keys ``cu_seqlens_k[b] <= t < cu_seqlens_k[b + 1]``.
Sequence ``b`` is exactly :mod:`xpkernels.attention` of its own queries over
its own keys -- no query sees another sequence's keys:

.. math::

    s_{ij} = \mathrm{scale}\; q_i \cdot k_j, \qquad
    m_i = \max_j s_{ij}, \qquad
    l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

with ``i`` and ``j`` counted from the start of the sequence. Positions are
per sequence: query ``i`` of sequence ``b`` sits at ``input_pos[b] + i`` (an
int ``input_pos`` is the same for every sequence) and key ``j`` at ``j``; with
``causal`` it sees keys ``j <= input_pos[b] + i``. The default
``input_pos = 0`` aligns the STARTS of each sequence's queries and keys
(top-left, as :func:`xpkernels.attention`); flash-attn's bottom-right
alignment (the last query sees the last key) is ``input_pos[b] = Sk_b - Sq_b``,
a ``(B,)`` array. Grouped-query heads as attention: query head ``h`` reads kv
head ``h // (H // Hkv)``. A row that sees no key (an empty key sequence, a
causal row before key 0) has ``o = 0``, ``m = -inf``, ``l = 0`` and zero
gradients; keys of a sequence without queries get zero ``dk``, ``dv``.

The checkpoints ``(m, l)`` are ``(H, Tq)`` float32, natural-log units, the
same backend-neutral contract as attention's: a forward on one backend feeds
a backward on another, and they equal attention's checkpoints of each
sequence run alone.

Values of ``cu_seqlens`` (starting at 0, non-decreasing, ending at the packed
length) and of ``max_seqlen_q``/``max_seqlen_k`` (at least the longest
sequence) are checked in the front on host arrays (NumPy) and, for device
arrays, only in debug mode (:func:`xpkernels.debug`): reading a device array
would sync it. The kernels never read or write out of bounds whatever the
values: starts and ends are clamped into ``[0, T]``. Unchecked bad values
give unspecified results: on Triton, rows of a sequence past ``max_seqlen``
and tokens no sequence covers are left unwritten.

``max_seqlen_q`` / ``max_seqlen_k`` size the Triton launch grid (one program
per query tile of the longest sequence, per sequence, per head), as in
flash-attn; when None they are derived from the prefix sums on the host
(one device sync for device arrays). Pass them for a capture-safe call.
The array_api backend reads the prefix sums on the host to slice each
sequence (it reads attention's lengths in the same way) and does not use
``max_seqlen``.

Backward as :mod:`xpkernels.attention`, per sequence; ``dk`` and ``dv`` are
summed over the query heads of each kv group.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from . import _autograd
from . import _checks as check
from ._debug import debug_enabled
from .attention import _causal, _input_pos, _position_array
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
    "attention_varlen_",
    "attention_varlen",
    "attention_varlen_backward_",
    "attention_varlen_backward",
    "AttentionVarlenCheckpoints",
    "AttentionVarlenBackwardScratch",
]


class _AttentionVarlenCheckpointArrays(NamedTuple):
    m: object  #: ``(H, Tq)`` float32, row max of the scaled masked scores (-inf: fully masked row)
    l: object  #: ``(H, Tq)`` float32, ``sum_j exp(s_ij - m_i)`` (0: fully masked row)


class AttentionVarlenCheckpoints(_AttentionVarlenCheckpointArrays, Checkpoints):
    """What ``attention_varlen_`` saves for its backward: ``m`` and ``l``; it records the
    forward's ``causal``, ``scale``, ``input_pos``, ``cu_seqlens_q`` and ``cu_seqlens_k``."""


class AttentionVarlenBackwardScratch(NamedTuple):
    """Transient workspace of ``attention_varlen_backward_`` (float32; float64 for float64 inputs).

    A field the routed backend does not use is None (Triton has no ``dq_accum``).
    """

    delta: object  #: ``(H, Tq)``, ``rowsum(do * o)``
    dq_accum: object  #: ``(Tq, H, D)``, ``dq / scale`` summed over key tiles, or None


def _cu_seqlens(fn, name, xp, cu, total, side):
    """Check the prefix sums ``cu`` of ``total`` packed tokens; returns the batch ``B``.

    Dtype and rank always; values (0 first, non-decreasing, ``total`` last)
    on host arrays or in debug mode only.
    """
    if cu.dtype != xp.int32:
        raise TypeError(f"{fn}: {name} must have dtype int32 (prefix sums), got {cu.dtype}")
    if len(cu.shape) != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"{fn}: {name} must be a (B + 1,) array of prefix sums, got shape {tuple(cu.shape)}"
        )
    batch = cu.shape[0] - 1
    if not (check.is_host_array(cu) or debug_enabled()):
        return batch
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {name}[0] = {first}")
    if batch > 0:
        steps = cu[1:] - cu[:-1]
        if int(xp.min(steps)) < 0:
            b = int(xp.argmax(xp.astype(steps < 0, xp.int32)))
            raise ValueError(
                f"{fn}: {name} must be non-decreasing, got {name}[{b + 1}] = {int(cu[b + 1])} "
                f"< {name}[{b}] = {int(cu[b])}"
            )
    if last != total:
        raise ValueError(
            f"{fn}: {name} must end at the packed length {side} = {total} of the "
            f"{'queries' if side == 'Tq' else 'keys'}, got {name}[-1] = {last}"
        )
    return batch


def _longest(xp, cu, total) -> int:
    """The longest sequence of the prefix sums ``cu`` (a host read), clamped to ``[0, total]``."""
    if cu.shape[0] < 2:
        return 0
    return min(total, max(0, int(xp.max(cu[1:] - cu[:-1]))))


def _max_seqlen(fn, name, xp, value, cu, total):
    """``value`` (an int in ``[0, total]`` at least the longest sequence), or derived from ``cu``."""
    if value is None:
        return _longest(xp, cu, total)
    value = check.index_int(fn, name, value, 0, total)
    if check.is_host_array(cu) or debug_enabled():
        longest = _longest(xp, cu, total)
        if value < longest:
            raise ValueError(
                f"{fn}: {name} must be at least the longest sequence ({longest}), got {value}"
            )
    return value


def _validate_qkv(fn, q, k, v, names=("q", "k", "v")):
    """Ranks, shapes, head grouping, dtypes and layout of packed q, k, v; returns ``xp``."""
    nq, nk, nv = names
    xp = check.namespace(fn, nq, q)
    check.rank(fn, nq, q, 3, "(Tq, H, D)")
    check.namespace(fn, nk, k)
    check.rank(fn, nk, k, 3, "(Tk, Hkv, D)")
    check.namespace(fn, nv, v)
    check.rank(fn, nv, v, 3, "(Tk, Hkv, Dv)")
    _, heads, d = q.shape
    tk, kv_heads = k.shape[0], k.shape[1]
    if d < 1:
        raise ValueError(f"{fn}: {nq} must have head dim D >= 1, got shape {tuple(q.shape)}")
    check.shape(fn, nk, k, (tk, kv_heads, d))
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"{fn}: the H={heads} query heads of {nq} must be a multiple of the Hkv={kv_heads} "
            f"kv heads of {nk} (grouped-query attention), got {nq} {tuple(q.shape)} and "
            f"{nk} {tuple(k.shape)}"
        )
    if v.shape[2] < 1:
        raise ValueError(f"{fn}: {nv} must have head dim Dv >= 1, got shape {tuple(v.shape)}")
    check.shape(fn, nv, v, (tk, kv_heads, v.shape[2]))
    check.floating(fn, nq, xp, q)
    for name, a in ((nk, k), (nv, v)):
        if a.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have {nq}'s dtype {q.dtype}, got {a.dtype}")
    for name, a in ((nq, q), (nk, k), (nv, v)):
        check.last_axis_contiguous(fn, name, a)
    return xp


class _Options(NamedTuple):
    scale: float
    input_pos: object
    max_seqlen_q: int
    max_seqlen_k: int


def _packing(fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """``(B, max_seqlen_q, max_seqlen_k)`` of checked prefix sums and longest-sequence bounds."""
    tq, tk = q.shape[0], k.shape[0]
    batch = _cu_seqlens(fn, "cu_seqlens_q", xp, cu_seqlens_q, tq, "Tq")
    batch_k = _cu_seqlens(fn, "cu_seqlens_k", xp, cu_seqlens_k, tk, "Tk")
    if batch_k != batch:
        raise ValueError(
            f"{fn}: cu_seqlens_k must have the B + 1 = {batch + 1} entries of cu_seqlens_q "
            f"(one sequence of keys per sequence of queries), got {batch_k + 1}"
        )
    return (
        batch,
        _max_seqlen(fn, "max_seqlen_q", xp, max_seqlen_q, cu_seqlens_q, tq),
        _max_seqlen(fn, "max_seqlen_k", xp, max_seqlen_k, cu_seqlens_k, tk),
    )


def _validate_options(
    fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, input_pos
):
    batch, max_q, max_k = _packing(
        fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else check.positive_finite(fn, "scale", scale)
    return _Options(scale, _input_pos(fn, xp, input_pos, batch), max_q, max_k)


def _checkpoint_arrays(fn, xp, checkpoints, q, reference="q", forward="attention_varlen_"):
    if not isinstance(checkpoints, AttentionVarlenCheckpoints):
        raise TypeError(
            f"{fn}: checkpoints must be the AttentionVarlenCheckpoints from "
            f"allocate_checkpoints({forward}, q, k, v), got {type(checkpoints).__name__}"
        )
    rows = (q.shape[1], q.shape[0])
    check.same_namespace(
        fn, xp, {f"checkpoints.{n}": a for n, a in checkpoints._asdict().items()}, reference
    )
    for name in AttentionVarlenCheckpoints._fields:
        a = getattr(checkpoints, name)
        check.shape(fn, f"checkpoints.{name}", a, rows)
        check.float32(fn, f"checkpoints.{name}", xp, a)
    return checkpoints.m, checkpoints.l


def _read(q, k, v, input_pos, cu_seqlens_q, cu_seqlens_k, names=("q", "k", "v")) -> dict:
    """The inputs a pass reads besides its own buffers, by argument name (for the overlap check)."""
    return {
        **dict(zip(names, (q, k, v))),
        "input_pos": _position_array(input_pos),
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
    }


def _recorded(causal, scale, input_pos, cu_seqlens_q, cu_seqlens_k) -> dict:
    """The options of the forward that its backward must repeat."""
    return {
        "causal": causal,
        "scale": scale,
        "input_pos": input_pos,
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
    }


def _namespace_check(fn, xp, arrays, input_pos, cu_seqlens_q, cu_seqlens_k):
    check.same_namespace(
        fn,
        xp,
        {
            **arrays,
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k,
            "input_pos": _position_array(input_pos),
        },
    )


def _head_dim(q, v) -> int:
    return max(q.shape[2], v.shape[2])


def attention_varlen_(
    o,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """Packed variable-length attention forward, in place; see the module docstring.

    Parameters
    ----------
    o : array
        Output, written in full (zeros on fully masked rows); any float dtype.
    q, k, v : array or Duplicated
        Packed queries, keys and values, one float dtype.
    cu_seqlens_q, cu_seqlens_k : array
        ``(B + 1,)`` int32 prefix sums: 0 first, non-decreasing, the packed
        lengths ``Tq`` / ``Tk`` last. Sequence ``b`` holds queries
        ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and keys
        ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])``; either may be empty.
    max_seqlen_q, max_seqlen_k : int, optional
        At least the longest query / key sequence (they size the Triton
        grid); None derives them from the prefix sums on the host (a device
        sync for device arrays). A smaller value is refused on host arrays
        and in debug mode; otherwise the kernels clamp each sequence to it.
    causal : bool
        Keep key ``j`` for query ``i`` of a sequence only when ``j <= input_pos + i``.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    input_pos : int or array
        Position of each sequence's first query: an int for every sequence
        or a ``(B,)`` integer array, negative allowed. 0 aligns the starts of
        queries and keys (top-left); ``Sk_b - Sq_b`` aligns their ends
        (flash-attn's bottom-right).
    checkpoints : AttentionVarlenCheckpoints, optional
        From ``allocate_checkpoints(attention_varlen_, q, k, v)``; receives
        ``m`` and ``l`` and records ``causal``, ``scale``, ``input_pos``,
        ``cu_seqlens_q`` and ``cu_seqlens_k``, which the backward must
        repeat. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message): prefix sums of
        another dtype, not starting at 0, decreasing, not ending at the
        packed length, or with another ``B`` for the keys than for the
        queries; a read-only ``o`` or checkpoint; an output sharing memory
        with an input. Nothing is written when a check fails.

    Shapes
    ------
    q : ``(Tq, H, D)``; k : ``(Tk, Hkv, D)``; v : ``(Tk, Hkv, Dv)``; o :
    ``(Tq, H, Dv)``; cu_seqlens_q, cu_seqlens_k : ``(B + 1,)``, with
    ``H % Hkv == 0``. The last axis must be contiguous; other strides are free.

    Checkpoints
    -----------
    m, l : ``(H, Tq)`` float32 (``-inf`` and 0 on fully masked rows).
    """
    fn = "attention_varlen_"
    _autograd.check_inplace(fn, {"q": q, "k": k, "v": v, "o": o})
    q, k, v = primal(q), primal(k), primal(v)
    _causal(fn, causal)
    xp = check.namespace(fn, "q", q)
    _namespace_check(
        fn, xp, {"q": q, "k": k, "v": v, "o": o}, input_pos, cu_seqlens_q, cu_seqlens_k
    )
    _validate_qkv(fn, q, k, v)
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (q.shape[0], q.shape[1], v.shape[2]))
    check.last_axis_contiguous(fn, "o", o)
    opts = _validate_options(
        fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, input_pos
    )
    m = lse_sum = None
    if checkpoints is not None:
        m, lse_sum = _checkpoint_arrays(fn, xp, checkpoints, q)
    outputs = {"o": o, "checkpoints.m": m, "checkpoints.l": lse_sum}
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, _read(q, k, v, opts.input_pos, cu_seqlens_q, cu_seqlens_k))
    arrays = {"o": o, "q": q, "k": k, "v": v, "checkpoints.m": m, "checkpoints.l": lse_sum}
    route = resolve("attention_varlen", arrays, backend=backend, head_dim=_head_dim(q, v))
    if checkpoints is not None:
        forget_forward(checkpoints)
    route.impl.forward(
        o,
        q,
        k,
        v,
        m,
        lse_sum,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=opts.max_seqlen_q,
        max_seqlen_k=opts.max_seqlen_k,
        scale=opts.scale,
        causal=causal,
        input_pos=opts.input_pos,
    )
    if checkpoints is not None:
        record_forward(
            checkpoints,
            fn,
            _recorded(causal, opts.scale, opts.input_pos, cu_seqlens_q, cu_seqlens_k),
        )


@checkpoints_for(attention_varlen_)
def allocate_attention_varlen_checkpoints(
    q, k=None, v=None, *args, **options
) -> AttentionVarlenCheckpoints:
    """Allocate ``attention_varlen_``'s checkpoints for packed ``q`` ``(Tq, H, D)``: ``m, l (H, Tq)`` float32."""
    q = primal(q)
    fn = "allocate_checkpoints(attention_varlen_)"
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(Tq, H, D)")
    rows = (q.shape[1], q.shape[0])
    return AttentionVarlenCheckpoints(m=empty_float32(q, rows), l=empty_float32(q, rows))


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """Packed varlen attention forward into a new ``(Tq, H, Dv)`` array; see :func:`attention_varlen_`.

    Returns
    -------
    o : array
        Of ``q``'s dtype. On torch tensors that require grad (grad mode on),
        autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    fn = "attention_varlen"
    options = {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "causal": causal,
        "scale": scale,
        "input_pos": input_pos,
        "checkpoints": checkpoints,
        "backend": backend,
    }
    if (o := _autograd.record(fn, {"q": q, "k": k, "v": v}, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v = primal(q), primal(v)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(Tq, H, D)")
    check.namespace(fn, "v", v)
    check.rank(fn, "v", v, 3, "(Tk, Hkv, Dv)")
    o = empty(q, (q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    attention_varlen_(
        o,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        scale=scale,
        input_pos=input_pos,
        checkpoints=checkpoints,
        backend=backend,
    )
    return o


def _scratch_arrays(fn, xp, scratch, q, backward="attention_varlen_backward_"):
    if not isinstance(scratch, AttentionVarlenBackwardScratch):
        raise TypeError(
            f"{fn}: scratch must be the AttentionVarlenBackwardScratch from "
            f"allocate_scratchspace({backward}, O, Q, K, V), "
            f"got {type(scratch).__name__}"
        )
    check.same_namespace(
        fn, xp, {f"scratch.{n}": a for n, a in scratch._asdict().items()}, reference="Q.primal"
    )
    for name, shape in (("delta", (q.shape[1], q.shape[0])), ("dq_accum", tuple(q.shape))):
        a = getattr(scratch, name)
        if a is None:  # a field the backend does not use; the route checks those it needs
            continue
        check.shape(fn, f"scratch.{name}", a, shape)
        check.accumulator(fn, f"scratch.{name}", xp, a, q.dtype)
    return scratch.delta, scratch.dq_accum


def attention_varlen_backward_(
    O,
    Q,
    K,
    V,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    scratch=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    backend=None,
) -> None:
    """Packed varlen attention backward, in place: overwrites the shadows of Q, K and V.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs (primals, read); their shadows receive ``dq``,
        ``dk`` and ``dv`` in full (zeros for fully masked queries and unseen
        keys), ``dk`` and ``dv`` summed over each kv head's query heads.
    cu_seqlens_q, cu_seqlens_k : array
        The forward's prefix sums.
    checkpoints : AttentionVarlenCheckpoints
        Filled by the forward ``attention_varlen_`` (on any backend) with the
        same ``causal``, ``scale``, ``input_pos``, ``cu_seqlens_q`` and
        ``cu_seqlens_k``; other options, or checkpoints no forward wrote,
        raise a ValueError naming the option.
    scratch : AttentionVarlenBackwardScratch, optional
        From ``allocate_scratchspace(attention_varlen_backward_, O, Q, K, V)``
        (with the same ``backend``); None allocates it for this call.
    max_seqlen_q, max_seqlen_k, causal, scale, input_pos, backend
        As in the forward :func:`attention_varlen_`.

    Raises
    ------
    TypeError, ValueError
        As the forward, for read-only shadows or scratch, outputs sharing
        memory with an input or each other, and options differing from the
        forward's. Nothing is written when a check fails.

    Shapes
    ------
    As :func:`attention_varlen_`; shadows share their primal's shape and may
    have any float dtype. Last axes contiguous.

    Scratch
    -------
    delta : ``(H, Tq)``, ``rowsum(do * o)``; dq_accum : ``(Tq, H, D)`` (array_api
    only; None for triton). Float32 (float64 for float64 inputs).
    """
    fn = "attention_varlen_backward_"
    _autograd.check_inplace(fn, {"O": O, "Q": Q, "K": K, "V": V})
    _causal(fn, causal)
    Ds = {
        name: check.duplicated(fn, name, d) for name, d in (("O", O), ("Q", Q), ("K", K), ("V", V))
    }
    q, k, v, o = Q.primal, K.primal, V.primal, O.primal
    xp = check.namespace(fn, "Q.primal", q)
    named = {
        f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
    }
    _namespace_check(fn, xp, named, input_pos, cu_seqlens_q, cu_seqlens_k)
    _validate_qkv(fn, q, k, v, names=("Q.primal", "K.primal", "V.primal"))
    for name, a in named.items():
        if name not in ("Q.primal", "K.primal", "V.primal"):
            check.floating(fn, name, xp, a)
            check.last_axis_contiguous(fn, name, a)
    check.shape(fn, "O.primal", o, (q.shape[0], q.shape[1], v.shape[2]))
    opts = _validate_options(
        fn, xp, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, input_pos
    )
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the AttentionVarlenCheckpoints that "
            "attention_varlen_ filled in the forward (allocate_checkpoints(attention_varlen_, "
            "q, k, v))"
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
        "O.primal": o,
        "O.shadow": O.shadow,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **_read(
            q,
            k,
            v,
            opts.input_pos,
            cu_seqlens_q,
            cu_seqlens_k,
            names=("Q.primal", "K.primal", "V.primal"),
        ),
    }
    check.no_overlap(fn, outputs, inputs)
    check_forward(
        fn,
        checkpoints,
        "attention_varlen_",
        _recorded(causal, opts.scale, opts.input_pos, cu_seqlens_q, cu_seqlens_k),
    )
    arrays = {**named, "checkpoints.m": m, "checkpoints.l": lse_sum}
    arrays.update({"scratch.delta": delta, "scratch.dq_accum": dq_accum})
    route = resolve("attention_varlen", arrays, backend=backend, head_dim=_head_dim(q, v))
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
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=opts.max_seqlen_q,
        max_seqlen_k=opts.max_seqlen_k,
        scale=opts.scale,
        causal=causal,
        input_pos=opts.input_pos,
    )


def _allocate_scratch(route, q) -> AttentionVarlenBackwardScratch:
    """The scratch fields ``route``'s backend uses, allocated for ``q``; None for the others."""
    rows = (q.shape[1], q.shape[0])
    return AttentionVarlenBackwardScratch(
        delta=empty_accumulator(q, rows) if route.needs("delta") else None,
        dq_accum=empty_accumulator(q, q.shape) if route.needs("dq_accum") else None,
    )


@scratchspace_for(attention_varlen_backward_)
def allocate_attention_varlen_backward_scratch(
    O, Q, K=None, V=None, *args, backend=None, **options
) -> AttentionVarlenBackwardScratch:
    """Allocate ``attention_varlen_backward_``'s scratch from packed ``Q`` ``(Tq, H, D)``.

    Returns ``delta (H, Tq)`` and ``dq_accum (Tq, H, D)``, float32 (float64
    when ``Q`` is float64), for the backend the call routes to (``backend``
    as in the backward); a field that backend does not use is None
    (triton: ``dq_accum``).
    """
    fn = "allocate_scratchspace(attention_varlen_backward_)"
    q = primal(Q)
    xp = check.namespace(fn, "Q", q)
    check.rank(fn, "Q", q, 3, "(Tq, H, D)")
    check.floating(fn, "Q", xp, q)
    arrays = {"Q": q, "O": primal(O), "K": primal(K), "V": primal(V)}
    head_dim = max(a.shape[-1] for a in arrays.values() if a is not None)
    route = resolve("attention_varlen", arrays, backend=backend, head_dim=head_dim)
    return _allocate_scratch(route, q)


def attention_varlen_backward(
    do,
    q,
    k,
    v,
    o,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    checkpoints,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    scale=None,
    input_pos=0,
    backend=None,
):
    """Packed varlen attention backward into new arrays; see :func:`attention_varlen_backward_`.

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
    fn = "attention_varlen_backward"
    arrays = with_new_shadows(fn, {"q": q, "k": k, "v": v})
    o = primal(o)
    attention_varlen_backward_(
        Duplicated(o, do),
        arrays["q"],
        arrays["k"],
        arrays["v"],
        cu_seqlens_q,
        cu_seqlens_k,
        checkpoints=checkpoints,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        scale=scale,
        input_pos=input_pos,
        backend=backend,
    )
    return arrays["q"].shadow, arrays["k"].shadow, arrays["v"].shadow
