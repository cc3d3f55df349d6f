r"""Split-KV decode attention (flash-decoding) over a key/value cache.

One new query per batch and head attends to the first ``lengths[b]`` entries
of the cache. With kv head ``g = h // (H // Hkv)``:

.. math::

    s_j = \mathrm{scale}\; q \cdot k_j \quad (j < \mathrm{lengths}[b]), \qquad
    o = \frac{\sum_j e^{s_j - m}\, v_j}{\sum_j e^{s_j - m}}, \qquad m = \max_j s_j

which equals :func:`xpkernels.attention` of one query at position
``lengths[b] - 1`` with causal masking. The cache is cut into ``n_splits``
slices, each producing a partial output ``o_s``, max ``m_s`` and sum ``l_s``,
merged by a log-sum-exp combine:

.. math::

    M = \max_s m_s, \qquad
    o = \frac{\sum_s e^{m_s - M}\, o_s}{\sum_s e^{m_s - M}\, l_s}

``lengths[b] == 0`` gives ``o = 0``. Forward only: there are no checkpoints.
Accumulation is in float32 (float64 for float64 inputs).

``n_splits`` lies in ``[1, max(1, Smax)]``: a split holds whole keys, so more
splits than cache entries could only add splits that never hold one (and cost
their launch and combine for nothing); larger values are refused. The kernels
clamp ``lengths`` to ``[0, Smax]`` at int64 width without reading device
values on the host, so no value of a device ``lengths`` array can make them
read outside the cache.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

from . import _autograd
from . import _checks as check
from .buffers import empty, empty_accumulator, primal, scratchspace_for
from .registry import resolve

__all__ = ["decode_attention_", "decode_attention", "DecodeAttentionScratch"]


class DecodeAttentionScratch(NamedTuple):
    """Transient workspace of ``decode_attention_`` (float32; float64 for float64 inputs)."""

    o_partial: Any  #: ``(B, H, n_splits, Dv)``, each split's unnormalised output
    m_partial: Any  #: ``(B, H, n_splits)``, each split's score max (-inf: empty split)
    l_partial: Any  #: ``(B, H, n_splits)``, each split's ``sum exp(s - m)`` (0: empty split)


def max_splits(smax: int) -> int:
    """Most splits a cache of ``smax`` entries takes: one per entry (at least 1)."""
    return max(1, smax)


def _bound_splits(fn, name, splits, smax) -> None:
    """ValueError unless ``splits`` (from ``name``) is at most :func:`max_splits` of ``smax``."""
    if splits > max_splits(smax):
        raise ValueError(
            f"{fn}: {name} must be <= {max_splits(smax)} (one split per cache entry at most, "
            f"Smax={smax}), got {splits}"
        )


def _n_splits(fn, n_splits) -> int:
    if isinstance(n_splits, bool):
        raise TypeError(f"{fn}: n_splits must be an int >= 1, got a bool")
    try:
        value = operator.index(n_splits)
    except TypeError:
        raise TypeError(
            f"{fn}: n_splits must be an int >= 1, got {type(n_splits).__name__}"
        ) from None
    if value < 1:
        raise ValueError(f"{fn}: n_splits must be >= 1, got {value}")
    return value


def _validate(fn, o, q, k_cache, v_cache, lengths, scale, scratch, n_splits):
    xp = check.namespace(fn, "q", q)
    check.same_namespace(
        fn, xp, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "o": o, "lengths": lengths}
    )
    check.rank(fn, "q", q, 3, "(B, H, D)")
    check.rank(fn, "k_cache", k_cache, 4, "(B, Hkv, Smax, D)")
    check.rank(fn, "v_cache", v_cache, 4, "(B, Hkv, Smax, Dv)")
    batch, heads, d = q.shape
    kv_heads, smax, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if d < 1:
        raise ValueError(f"{fn}: q must have head dim D >= 1, got shape {tuple(q.shape)}")
    check.shape(fn, "k_cache", k_cache, (batch, kv_heads, smax, d))
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"{fn}: the H={heads} query heads of q must be a multiple of the Hkv={kv_heads} kv "
            f"heads of k_cache (grouped-query attention), got q {tuple(q.shape)} and "
            f"k_cache {tuple(k_cache.shape)}"
        )
    if dv < 1:
        raise ValueError(
            f"{fn}: v_cache must have head dim Dv >= 1, got shape {tuple(v_cache.shape)}"
        )
    check.shape(fn, "v_cache", v_cache, (batch, kv_heads, smax, dv))
    check.floating(fn, "q", xp, q)
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {a.dtype}")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check.last_axis_contiguous(fn, name, a)
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (batch, heads, dv))
    check.last_axis_contiguous(fn, "o", o)
    if lengths is None or not hasattr(lengths, "shape"):
        raise TypeError(
            f"{fn}: lengths must be a ({batch},) integer array, got {type(lengths).__name__}"
        )
    check.batch_integers(fn, "lengths", xp, lengths, batch, 0, smax, "Smax")
    scale = 1.0 / math.sqrt(d) if scale is None else check.positive_finite(fn, "scale", scale)
    if n_splits is not None:
        n_splits = _n_splits(fn, n_splits)
        _bound_splits(fn, "n_splits", n_splits, smax)
    outputs = {"o": o}
    if scratch is not None:
        _check_scratch(fn, xp, scratch, q, dv, n_splits)
        _bound_splits(
            fn, "scratch.o_partial.shape[2] (its n_splits)", scratch.o_partial.shape[2], smax
        )
        outputs.update({f"scratch.{name}": a for name, a in scratch._asdict().items()})
    check.writable(fn, outputs)
    check.no_overlap(
        fn, outputs, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "lengths": lengths}
    )
    return scale, n_splits


def _check_scratch(fn, xp, scratch, q, dv, n_splits) -> None:
    if not isinstance(scratch, DecodeAttentionScratch):
        raise TypeError(
            f"{fn}: scratch must be the DecodeAttentionScratch from "
            f"allocate_scratchspace(decode_attention_, o, q, ...), got {type(scratch).__name__}"
        )
    batch, heads, _ = q.shape
    check.same_namespace(
        fn, xp, {f"scratch.{n}": a for n, a in scratch._asdict().items()}, reference="q"
    )
    o_partial = scratch.o_partial
    check.rank(fn, "scratch.o_partial", o_partial, 4, "(B, H, n_splits, Dv)")
    splits = o_partial.shape[2]
    if n_splits is not None and n_splits != splits:
        raise ValueError(
            f"{fn}: n_splits={n_splits} disagrees with scratch.o_partial, allocated for "
            f"{splits} splits; pass one or the other"
        )
    if splits < 1:
        raise ValueError(
            f"{fn}: scratch.o_partial must have n_splits >= 1, got shape {tuple(o_partial.shape)}"
        )
    check.shape(fn, "scratch.o_partial", o_partial, (batch, heads, splits, dv))
    for name in ("m_partial", "l_partial"):
        check.shape(fn, f"scratch.{name}", getattr(scratch, name), (batch, heads, splits))
    for name in DecodeAttentionScratch._fields:
        check.accumulator(fn, f"scratch.{name}", xp, getattr(scratch, name), q.dtype)


def decode_attention_(
    o, q, k_cache, v_cache, lengths, *, scale=None, scratch=None, n_splits=None, backend=None
) -> None:
    """Decode attention, in place: ``o[b, h]`` attends to ``k_cache/v_cache[b, g, :lengths[b]]``.

    Parameters
    ----------
    o : array
        Output, written in full (zeros where ``lengths[b] == 0``); any float dtype.
    q : array or Duplicated
        The new queries, one per batch and head.
    k_cache, v_cache : array or Duplicated
        The caches; entries at or past ``lengths[b]`` are ignored. One float
        dtype with ``q``.
    lengths : array
        ``(B,)`` int32/int64 in ``[0, Smax]``: valid cache entries per batch.
        Host values are checked; a device array's values only in debug mode
        (the kernels clamp them to ``[0, Smax]``).
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    scratch : DecodeAttentionScratch, optional
        From ``allocate_scratchspace(decode_attention_, o, q, k_cache, ...)``;
        its ``o_partial.shape[2]`` is the number of splits. None allocates it
        for this call.
    n_splits : int, optional
        Slices of the cache, in ``[1, max(1, Smax)]`` (more than ``lengths[b]``
        is fine: the extra splits are empty). None: the scratch's, else the
        backend's default for this cache.
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message), a read-only ``o`` or
        scratch, an output sharing memory with an input or another output.
        Nothing is written when a check fails.

    Shapes
    ------
    q : ``(B, H, D)``; k_cache : ``(B, Hkv, Smax, D)``; v_cache :
    ``(B, Hkv, Smax, Dv)``; o : ``(B, H, Dv)``; lengths : ``(B,)``; with
    ``H % Hkv == 0``. Last axes contiguous; other axes may have any stride
    (a ``(B, Smax, Hkv, D)`` cache viewed as BHSD works without copies).

    Scratch
    -------
    o_partial : ``(B, H, n_splits, Dv)``; m_partial, l_partial :
    ``(B, H, n_splits)``. Float32 (float64 for float64 inputs).
    """
    fn = "decode_attention_"
    _autograd.check_inplace(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "o": o})
    q, k_cache, v_cache = primal(q), primal(k_cache), primal(v_cache)
    scale, n_splits = _validate(fn, o, q, k_cache, v_cache, lengths, scale, scratch, n_splits)
    arrays = {"o": o, "q": q, "k_cache": k_cache, "v_cache": v_cache, "lengths": lengths}
    if scratch is not None:
        arrays.update({f"scratch.{name}": a for name, a in zip(scratch._fields, scratch)})
    route = resolve(
        "decode_attention", arrays, backend=backend, head_dim=max(q.shape[2], v_cache.shape[3])
    )
    if scratch is None:
        if n_splits is None:
            n_splits = route.hook("default_splits")(
                q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache
            )
        scratch = _allocate(q, v_cache.shape[3], n_splits)
    route.impl.forward(o, q, k_cache, v_cache, lengths, *scratch, scale=scale)


def _allocate(q, dv, n_splits) -> DecodeAttentionScratch:
    batch, heads, _ = q.shape
    return DecodeAttentionScratch(
        o_partial=empty_accumulator(q, (batch, heads, n_splits, dv)),
        m_partial=empty_accumulator(q, (batch, heads, n_splits)),
        l_partial=empty_accumulator(q, (batch, heads, n_splits)),
    )


@scratchspace_for(decode_attention_)
def allocate_decode_attention_scratch(
    o, q, k_cache=None, v_cache=None, lengths=None, *, n_splits=None, backend=None, **options
) -> DecodeAttentionScratch:
    """Allocate ``decode_attention_``'s scratch for output ``o`` ``(B, H, Dv)`` and queries ``q`` ``(B, H, D)``.

    ``n_splits`` None asks the backend for its default, which needs ``k_cache``;
    with ``k_cache`` given, ``n_splits`` must be at most ``max(1, Smax)``.
    Float32, or float64 when ``q`` is float64.
    """
    fn = "allocate_scratchspace(decode_attention_)"
    q = primal(q)
    xp = check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(B, H, D)")
    check.floating(fn, "q", xp, q)
    check.namespace(fn, "o", o)
    check.rank(fn, "o", o, 3, "(B, H, Dv)")
    check.shape(fn, "o", o, (*q.shape[:2], o.shape[2]))
    if n_splits is not None:
        n_splits = _n_splits(fn, n_splits)
        if k_cache is not None:
            k_cache = primal(k_cache)
            check.namespace(fn, "k_cache", k_cache)
            check.rank(fn, "k_cache", k_cache, 4, "(B, Hkv, Smax, D)")
            _bound_splits(fn, "n_splits", n_splits, k_cache.shape[2])
    else:
        if k_cache is None:
            raise TypeError(
                f"{fn}: pass n_splits=, or k_cache so the backend can choose the number of splits"
            )
        k_cache = primal(k_cache)
        check.namespace(fn, "k_cache", k_cache)
        check.rank(fn, "k_cache", k_cache, 4, "(B, Hkv, Smax, D)")
        route = resolve("decode_attention", {"q": q, "k_cache": k_cache}, backend=backend)
        n_splits = route.hook("default_splits")(
            q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache
        )
    return _allocate(q, o.shape[2], n_splits)


def decode_attention(
    q, k_cache, v_cache, lengths, *, scale=None, scratch=None, n_splits=None, backend=None
):
    """Decode attention into a new ``(B, H, Dv)`` array of ``q``'s dtype; see :func:`decode_attention_`.

    Returns
    -------
    o : array
        On torch tensors that require grad (grad mode on), the call goes through the
        ``xpkernels::decode_attention`` op, whose backward raises: it is forward only.
    """
    fn = "decode_attention"
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "lengths": lengths}
    options = {"scale": scale, "scratch": scratch, "n_splits": n_splits, "backend": backend}
    if (o := _autograd.record(fn, arrays, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v_cache = primal(q), primal(v_cache)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(B, H, D)")
    check.namespace(fn, "v_cache", v_cache)
    check.rank(fn, "v_cache", v_cache, 4, "(B, Hkv, Smax, Dv)")
    o = empty(q, (*q.shape[:2], v_cache.shape[3]), q.dtype)
    decode_attention_(
        o,
        q,
        k_cache,
        v_cache,
        lengths,
        scale=scale,
        scratch=scratch,
        n_splits=n_splits,
        backend=backend,
    )
    return o
