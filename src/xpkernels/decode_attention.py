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

Two options shape the scores: ``softcap`` replaces each scaled score by
``softcap * tanh(s_j / softcap)`` (as flash-attention and FlashInfer define
it), and a sliding ``window`` keeps only the last ``window`` keys,
``j > lengths[b] - 1 - window``.

**Paged cache.** Given ``block_table``, the caches are pages:
``k_pages (num_pages, Hkv, page_size, D)`` and ``v_pages (num_pages, Hkv,
page_size, Dv)``, and key ``j`` of batch ``b`` lives in page
``block_table[b, j // page_size]``, slot ``j % page_size``; the logical cache
holds ``max_pages * page_size`` keys. The result equals decode attention
over the contiguous cache gathered from the pages. Splits cut the logical
key range the query sees.

``lengths[b] == 0`` gives ``o = 0``. Forward only: there are no checkpoints.
Accumulation is in float32 (float64 for float64 inputs).

``n_splits`` lies in ``[1, max(1, Smax)]`` (``Smax = max_pages * page_size``
for pages): a split holds whole keys, so more splits than cache entries could
only add splits that never hold one (and cost their launch and combine for
nothing); larger values are refused. The kernels clamp ``lengths`` to
``[0, Smax]`` at int64 width and block-table entries to ``[0, num_pages)``
without reading device values on the host, so no value of a device
``lengths`` or ``block_table`` array can make them read outside the cache
(host values, and device values in debug mode, are checked instead).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

from array_api_compat import device

from . import _autograd
from . import _checks as check
from ._debug import debug_enabled
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


def _names(block_table) -> tuple[str, str]:
    """What the second and third arrays are called in messages: the caches, or the pages."""
    return ("k_cache", "v_cache") if block_table is None else ("k_pages", "v_pages")


def _layouts(block_table) -> tuple[str, str]:
    """The layouts messages quote for the caches, or the pages."""
    lead = "(B, Hkv, Smax" if block_table is None else "(num_pages, Hkv, page_size"
    return f"{lead}, D)", f"{lead}, Dv)"


def _cache_shapes(fn, q, k_cache, v_cache, block_table):
    """``(kv_heads, smax, dv)`` of validated caches (``smax``: the logical keys of a paged cache)."""
    k_name, v_name = _names(block_table)
    k_layout, v_layout = _layouts(block_table)
    batch, heads, d = q.shape
    check.rank(fn, k_name, k_cache, 4, k_layout)
    check.rank(fn, v_name, v_cache, 4, v_layout)
    if block_table is None:
        lead = (batch, k_cache.shape[1], k_cache.shape[2])
    else:
        lead = tuple(k_cache.shape[:3])
        num_pages, _, page_size = lead
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"{fn}: k_pages must hold num_pages >= 1 pages of page_size >= 1 keys, got "
                f"shape {tuple(k_cache.shape)}"
            )
    kv_heads, dv = k_cache.shape[1], v_cache.shape[3]
    if d < 1:
        raise ValueError(f"{fn}: q must have head dim D >= 1, got shape {tuple(q.shape)}")
    check.shape(fn, k_name, k_cache, (*lead, d))
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"{fn}: the H={heads} query heads of q must be a multiple of the Hkv={kv_heads} kv "
            f"heads of {k_name}, got q {tuple(q.shape)} and {k_name} {tuple(k_cache.shape)}"
        )
    if dv < 1:
        raise ValueError(
            f"{fn}: {v_name} must have head dim Dv >= 1, got shape {tuple(v_cache.shape)}"
        )
    check.shape(fn, v_name, v_cache, (*lead, dv))
    smax = lead[2] if block_table is None else block_table.shape[1] * lead[2]
    return kv_heads, smax, dv


def _check_block_table(fn, xp, block_table, batch) -> None:
    """TypeError/ValueError unless ``block_table`` is a ``(B, max_pages)`` int32 array."""
    if not hasattr(block_table, "shape"):
        raise TypeError(
            f"{fn}: block_table must be a ({batch}, max_pages) int32 array, got "
            f"{type(block_table).__name__}"
        )
    if block_table.dtype != xp.int32:
        raise TypeError(f"{fn}: block_table must have dtype int32, got {block_table.dtype}")
    check.rank(fn, "block_table", block_table, 2, "(B, max_pages)")
    check.shape(fn, "block_table", block_table, (batch, block_table.shape[1]))


def _check_pages_used(fn, xp, block_table, lengths, window, num_pages, page_size) -> None:
    """ValueError when a page the query reads lies outside ``[0, num_pages)``.

    The pages read hold the keys the query sees (``j < lengths[b]``, and
    ``j >= lengths[b] - window`` under a window); the other entries may hold
    anything. Values are read only on host arrays or in
    debug mode (capture safety).
    """
    batch, max_pages = block_table.shape
    if batch * max_pages == 0 or not (check.is_host_array(block_table) or debug_enabled()):
        return
    first_keys = xp.arange(max_pages, dtype=xp.int64, device=device(block_table)) * page_size
    stop = xp.astype(lengths, xp.int64)[:, None]
    used = first_keys[None, :] < stop
    if window is not None:
        used = used & (first_keys[None, :] + page_size > stop - window)
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(xp.any(bad)):
        entries = block_table[bad]
        raise ValueError(
            f"{fn}: block_table entries of the pages read (key j of batch b in page "
            f"block_table[b, j // page_size] for the keys the query sees) must lie in "
            f"[0, {num_pages - 1}] (num_pages={num_pages}), got values in "
            f"[{int(xp.min(entries))}, {int(xp.max(entries))}]"
        )


def _validate(
    fn, o, q, k_cache, v_cache, lengths, scale, softcap, window, block_table, scratch, n_splits
):
    k_name, v_name = _names(block_table)
    xp = check.namespace(fn, "q", q)
    for name, a in (("o", o), (k_name, k_cache), (v_name, v_cache)):
        check.namespace(fn, name, a)
    check.same_namespace(
        fn,
        xp,
        {
            "q": q,
            k_name: k_cache,
            v_name: v_cache,
            "o": o,
            "lengths": lengths,
            "block_table": block_table,
        },
    )
    check.rank(fn, "q", q, 3, "(B, H, D)")
    batch, heads, d = q.shape
    if block_table is not None:
        _check_block_table(fn, xp, block_table, batch)
    kv_heads, smax, dv = _cache_shapes(fn, q, k_cache, v_cache, block_table)
    check.floating(fn, "q", xp, q)
    for name, a in ((k_name, k_cache), (v_name, v_cache)):
        if a.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {a.dtype}")
    for name, a in (("q", q), (k_name, k_cache), (v_name, v_cache)):
        check.last_axis_contiguous(fn, name, a)
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (batch, heads, dv))
    check.last_axis_contiguous(fn, "o", o)
    if lengths is None or not hasattr(lengths, "shape"):
        raise TypeError(
            f"{fn}: lengths must be a ({batch},) integer array, got {type(lengths).__name__}"
        )
    bound = "Smax" if block_table is None else "max_pages * page_size"
    check.batch_integers(fn, "lengths", xp, lengths, batch, 0, smax, bound)
    scale = 1.0 / math.sqrt(d) if scale is None else check.positive_finite(fn, "scale", scale)
    if softcap is not None:
        softcap = check.positive_finite(fn, "softcap", softcap)
    if window is not None:
        window = check.index_int(fn, "window", window, 1)
    if block_table is not None:
        _check_pages_used(fn, xp, block_table, lengths, window, k_cache.shape[0], k_cache.shape[2])
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
        fn,
        outputs,
        {
            "q": q,
            k_name: k_cache,
            v_name: v_cache,
            "lengths": lengths,
            "block_table": block_table,
        },
    )
    return scale, softcap, window, n_splits, smax


def _check_scratch(fn, xp, scratch, q, dv, n_splits) -> None:
    if not isinstance(scratch, DecodeAttentionScratch):
        raise TypeError(
            f"{fn}: scratch must be the DecodeAttentionScratch from "
            f"allocate_scratchspace(decode_attention_, o, q, ...), got {type(scratch).__name__}"
        )
    batch, heads, _ = q.shape
    fields = {f"scratch.{n}": a for n, a in scratch._asdict().items()}
    for name, a in fields.items():
        check.namespace(fn, name, a)
    check.same_namespace(fn, xp, fields, reference="q")
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
    check.last_axis_contiguous(fn, "scratch.o_partial", o_partial)
    for name in ("m_partial", "l_partial"):
        check.shape(fn, f"scratch.{name}", getattr(scratch, name), (batch, heads, splits))
    for name in DecodeAttentionScratch._fields:
        check.accumulator(fn, f"scratch.{name}", xp, getattr(scratch, name), q.dtype)


def decode_attention_(
    o,
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    block_table=None,
    scale=None,
    softcap=None,
    window=None,
    scratch=None,
    n_splits=None,
    backend=None,
) -> None:
    """Decode attention, in place: ``o[b, h]`` attends to the first ``lengths[b]`` keys of batch ``b``.

    Parameters
    ----------
    o : array
        Output, written in full (zeros where ``lengths[b] == 0``); any float dtype.
    q : array or Duplicated
        The new queries, one per batch and head, at position ``lengths[b] - 1``.
    k_cache, v_cache : array or Duplicated
        The caches, or with ``block_table`` the pages ``k_pages`` and
        ``v_pages``; keys at or past ``lengths[b]`` are ignored. One float
        dtype with ``q``.
    lengths : array
        ``(B,)`` int32/int64 in ``[0, Smax]`` (``Smax = max_pages * page_size``
        for pages): valid keys per batch. Host values are checked; a device
        array's values only in debug mode (the kernels clamp them to
        ``[0, Smax]``).
    block_table : array, optional
        ``(B, max_pages)`` int32: key ``j`` of batch ``b`` is slot
        ``j % page_size`` of page ``block_table[b, j // page_size]``. The
        entries of the pages read (those holding keys the query sees) must
        lie in ``[0, num_pages)``: checked on host arrays and in debug mode,
        clamped by the kernels otherwise; the other entries may hold
        anything. None: the caches are contiguous.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    softcap : float, optional
        Finite and > 0: each scaled score ``s`` becomes
        ``softcap * tanh(s / softcap)``. None: no capping.
    window : int, optional
        >= 1: the query sees only the last ``window`` keys,
        ``j > lengths[b] - 1 - window``. None: every key before ``lengths[b]``.
    scratch : DecodeAttentionScratch, optional
        From ``allocate_scratchspace(decode_attention_, o, q, k_cache, ...)``;
        its ``o_partial.shape[2]`` is the number of splits. None allocates it
        for this call.
    n_splits : int, optional
        Slices of the keys the query sees, in ``[1, max(1, Smax)]`` (more
        than it sees is fine: the extra splits are empty). None: the
        scratch's, else the backend's default for this cache.
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
    ``H % Hkv == 0``. Paged: k_pages ``(num_pages, Hkv, page_size, D)``,
    v_pages ``(num_pages, Hkv, page_size, Dv)``, block_table
    ``(B, max_pages)``. Last axes contiguous; other axes may have any stride
    (a ``(B, Smax, Hkv, D)`` cache viewed as BHSD works without copies).

    Scratch
    -------
    o_partial : ``(B, H, n_splits, Dv)``; m_partial, l_partial :
    ``(B, H, n_splits)``. Float32 (float64 for float64 inputs).
    """
    fn = "decode_attention_"
    k_name, v_name = _names(block_table)
    _autograd.check_inplace(fn, {"q": q, k_name: k_cache, v_name: v_cache, "o": o})
    q, k_cache, v_cache = primal(q), primal(k_cache), primal(v_cache)
    scale, softcap, window, n_splits, smax = _validate(
        fn, o, q, k_cache, v_cache, lengths, scale, softcap, window, block_table, scratch, n_splits
    )
    arrays = {"o": o, "q": q, k_name: k_cache, v_name: v_cache, "lengths": lengths}
    if block_table is not None:
        arrays["block_table"] = block_table
    if scratch is not None:
        arrays.update({f"scratch.{name}": a for name, a in zip(scratch._fields, scratch)})
    route = resolve(
        "decode_attention", arrays, backend=backend, head_dim=max(q.shape[2], v_cache.shape[3])
    )
    if scratch is None:
        if n_splits is None:
            n_splits = route.hook("default_splits")(
                q.shape[0], k_cache.shape[1], _seen_keys(smax, window), k_cache
            )
        scratch = _allocate(q, v_cache.shape[3], n_splits)
    route.impl.forward(
        o,
        q,
        k_cache,
        v_cache,
        lengths,
        *scratch,
        scale=scale,
        softcap=softcap,
        window=window,
        block_table=block_table,
    )


def _seen_keys(smax: int, window: int | None) -> int:
    """Most keys one query sees: the cache's ``smax``, or fewer under a ``window``."""
    return smax if window is None else min(smax, window)


def _allocate(q, dv, n_splits) -> DecodeAttentionScratch:
    batch, heads, _ = q.shape
    return DecodeAttentionScratch(
        o_partial=empty_accumulator(q, (batch, heads, n_splits, dv)),
        m_partial=empty_accumulator(q, (batch, heads, n_splits)),
        l_partial=empty_accumulator(q, (batch, heads, n_splits)),
    )


@scratchspace_for(decode_attention_)
def allocate_decode_attention_scratch(
    o,
    q,
    k_cache=None,
    v_cache=None,
    lengths=None,
    *,
    block_table=None,
    window=None,
    n_splits=None,
    backend=None,
    **options,
) -> DecodeAttentionScratch:
    """Allocate ``decode_attention_``'s scratch for output ``o`` ``(B, H, Dv)`` and queries ``q`` ``(B, H, D)``.

    ``n_splits`` None asks the backend for its default, which needs ``k_cache``
    (with ``block_table`` for pages, and the call's ``window``); with
    ``k_cache`` given, ``n_splits`` must be at most ``max(1, Smax)``.
    Float32, or float64 when ``q`` is float64.
    """
    fn = "allocate_scratchspace(decode_attention_)"
    k_name = _names(block_table)[0]
    layout = _layouts(block_table)[0]
    q = primal(q)
    xp = check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(B, H, D)")
    check.floating(fn, "q", xp, q)
    check.namespace(fn, "o", o)
    check.rank(fn, "o", o, 3, "(B, H, Dv)")
    check.shape(fn, "o", o, (*q.shape[:2], o.shape[2]))
    if k_cache is None:
        if n_splits is None:
            raise TypeError(
                f"{fn}: pass n_splits=, or {k_name} so the backend can choose the number of splits"
            )
        return _allocate(q, o.shape[2], _n_splits(fn, n_splits))
    k_cache = primal(k_cache)
    check.namespace(fn, k_name, k_cache)
    check.rank(fn, k_name, k_cache, 4, layout)
    if block_table is None:
        smax = k_cache.shape[2]
    else:
        _check_block_table(fn, xp, block_table, q.shape[0])
        smax = block_table.shape[1] * k_cache.shape[2]
    if n_splits is not None:
        n_splits = _n_splits(fn, n_splits)
        _bound_splits(fn, "n_splits", n_splits, smax)
    else:
        if window is not None:
            window = check.index_int(fn, "window", window, 1)
        route = resolve("decode_attention", {"q": q, k_name: k_cache}, backend=backend)
        n_splits = route.hook("default_splits")(
            q.shape[0], k_cache.shape[1], _seen_keys(smax, window), k_cache
        )
    return _allocate(q, o.shape[2], n_splits)


def decode_attention(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    block_table=None,
    scale=None,
    softcap=None,
    window=None,
    scratch=None,
    n_splits=None,
    backend=None,
):
    """Decode attention into a new ``(B, H, Dv)`` array of ``q``'s dtype; see :func:`decode_attention_`.

    Returns
    -------
    o : array
        On torch tensors that require grad (grad mode on), the call goes through the
        ``xpkernels::decode_attention`` op, whose backward raises: it is forward only.
    """
    fn = "decode_attention"
    k_name, v_name = _names(block_table)
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "lengths": lengths}
    if block_table is not None:
        arrays["block_table"] = block_table
    options = {"scale": scale, "softcap": softcap, "window": window, "scratch": scratch}
    options.update(n_splits=n_splits, backend=backend)
    if (o := _autograd.record(fn, arrays, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v_cache = primal(q), primal(v_cache)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 3, "(B, H, D)")
    check.namespace(fn, v_name, v_cache)
    check.rank(fn, v_name, v_cache, 4, _layouts(block_table)[1])
    o = empty(q, (*q.shape[:2], v_cache.shape[3]), q.dtype)
    decode_attention_(o, q, k_cache, v_cache, lengths, block_table=block_table, **options)
    return o
