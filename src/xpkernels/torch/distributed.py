r"""Ring attention: one long sequence split over the ranks of a ``torch.distributed`` group.

Each of the ``W`` ranks of a process group holds a shard of the sequence
axis of ``q``, ``k`` and ``v`` (xpkernels' attention layout, ``(B, H, S,
D)``). :func:`ring_attention` computes, on every rank, the rows of attention
over the WHOLE sequence that belong to its query shard, without ever
holding more than two key/value shards:

- **Forward.** The key/value shards travel around the ring (rank ``r``
  sends to ``r + 1`` and receives from ``r - 1``, through
  ``torch.distributed.P2POp`` and ``batch_isend_irecv``): at step ``t``
  rank ``r`` holds the shard of rank ``(r - t) mod W``. While the next
  shard is in flight, the rank runs :func:`xpkernels.attention_` over the
  one it holds and merges the partial state into its running ``(o, m, l)``
  with :func:`xpkernels.merge_attention_states_` -- the exact combine over
  disjoint key sets, so after ``W`` steps ``o`` and ``(m, l)`` are those of
  attention over the whole sequence.
- **Backward.** The same ring once more: each rank runs
  :func:`xpkernels.attention_backward_` for its query shard against the
  visiting key/value shard, with the MERGED output and checkpoints and the
  full ``do`` (``exp(s - m) / l`` and ``rowsum(do * o)`` are then the
  whole sequence's, so the parts' gradients add up to the union's; see
  :mod:`xpkernels.merge_attention_states`). ``dq`` accumulates locally;
  the ``dk``/``dv`` contributions travel with their key/value shard,
  each rank adding its own, and one last hop brings every shard's total
  home, so each rank ends with ``dk``/``dv`` for its own shard. The
  transfer of the finished contributions overlaps the next block's
  compute as the key/value transfer does.

Sharding. Without ``causal`` attention does not depend on where a key
sits, so any split of the sequence into ``W`` disjoint shards of one length
works (the natural one: rank ``r`` holds the ``r``-th contiguous piece).
With ``causal`` the layout is load balanced: the global sequence of length
``S`` is cut into ``2W`` chunks of ``c = S / (2W)`` positions, and rank
``r`` holds chunk ``r`` followed by chunk ``2W - 1 - r`` (a local shard of
``2c`` rows; with ``W = 2``: rank 0 holds chunks 0 and 3, rank 1 chunks 1
and 2). :func:`shard_sequence` cuts a global tensor into this layout and
:func:`unshard_sequence` gathers it back. Every key/value shard a rank
visits is then, for its query shard,

- its own (``s = r``): causal over the local shard with ``input_pos = 0``
  -- both chunks sit in position order, so "key position <= query
  position" is "local key index <= local query index";
- from a lower rank (``s < r``): its front chunk is fully visible to both
  local query chunks and its back chunk fully masked (skipped, no
  compute): attention of the whole query shard over the front chunk;
- from a higher rank (``s > r``): both its chunks are fully visible to the
  back query chunk and fully masked for the front one: attention of the
  back query chunk over the whole shard;

so every rank computes the same ``2 c^2`` score entries at every step (with
contiguous shards, rank 0 would idle after its first step while the last
rank computed full blocks).

Partial outputs, the merged output and ``dq``/``dk``/``dv`` accumulate (and
``dk``/``dv`` travel) in float32 (float64 for float64 inputs); the
checkpoints ``(m, l)`` are float32, as everywhere in xpkernels.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as check
from .._attention_front import FRONTS
from ..attention import AttentionCheckpoints, attention_, attention_backward_
from ..buffers import Duplicated, record_forward
from ..merge_attention_states import merge_attention_states_
from ..registry import _explicit_choice
from ._ops import _no_double_backward

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]


def _group(fn: str, group):
    """``(group, rank, size)`` of ``group`` (None: the default group); ValueError when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{fn}: group: no torch.distributed process group is initialized; call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    if group is None:
        group = dist.group.WORLD
    elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise ValueError(
            f"{fn}: group: this process is not a member of the process group (new_group "
            "returned it a placeholder); call with the group of ranks this process belongs to"
        )
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{fn}: group must be a torch.distributed ProcessGroup or None, got {group!r}"
        )
    return group, dist.get_rank(group), dist.get_world_size(group)


def _device_types(group) -> tuple[str, ...] | None:
    """The device types ``group``'s backend communicates, or None for a backend torch does not list."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return tuple(pair.split(":")[0] for pair in backend.split(","))
    return tuple(dist.Backend.backend_capability.get(backend, ())) or None


def _check_device(fn: str, group, tensors: dict) -> None:
    """TypeError unless every tensor of ``tensors`` sits on one device that ``group`` can send from."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != first.device:
            raise TypeError(
                f"{fn}: {name} is on {t.device} but {first_name} is on {first.device}; "
                "pass every tensor on this rank's one device"
            )
    types = _device_types(group)
    if types is not None and first.device.type not in types:
        raise TypeError(
            f"{fn}: {first_name} is on device type {first.device.type!r}, but the process "
            f"group's backend {dist.get_backend(group)!r} communicates {', '.join(types)} tensors"
        )


def _dim(fn: str, x: Tensor, dim) -> int:
    """``dim`` as an axis of ``x`` in ``[0, x.ndim)``; TypeError or ValueError naming ``dim``."""
    if isinstance(dim, bool):
        raise TypeError(f"{fn}: dim must be an int, got a bool")
    try:
        axis = operator.index(dim)
    except TypeError:
        raise TypeError(f"{fn}: dim must be an int, got {type(dim).__name__}") from None
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"{fn}: dim must be in [-{x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}, got {dim}"
        )
    return axis % x.ndim


def _tensor(fn: str, name: str, x) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _sequence(fn: str, x, dim, causal, group):
    """``(x, axis, causal, group, rank, size)``: the checked arguments of the sequence helpers."""
    x = _tensor(fn, "x", x)
    return (x, _dim(fn, x, dim), check.boolean(fn, "causal", causal), *_group(fn, group))


# --------------------------------------------------------------------------- sharding


def _chunks(rank: int, size: int, causal: bool) -> tuple[int, ...]:
    """The indices of the global chunks rank ``rank`` holds, in order (``size`` or ``2 size`` chunks)."""
    return (rank, 2 * size - 1 - rank) if causal else (rank,)


def _local_shard(x: Tensor, axis: int, rank: int, size: int, causal: bool) -> Tensor:
    chunk = x.shape[axis] // (2 * size if causal else size)
    parts = [x.narrow(axis, i * chunk, chunk) for i in _chunks(rank, size, causal)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)


def shard_sequence(x, *, group=None, dim=2, causal=False) -> Tensor:
    """This rank's shard of the global sequence ``x``, in :func:`ring_attention`'s layout.

    Parameters
    ----------
    x : torch.Tensor
        The whole sequence, the same on every rank of ``group`` (``q``, ``k``,
        ``v`` in ``(B, H, S, D)``, a ``(B, S, ...)`` token tensor...).
    group : torch.distributed.ProcessGroup, optional
        The ring's process group; None means the default group.
    dim : int
        The sequence axis of ``x`` (2 for xpkernels' attention layout).
    causal : bool
        False: rank ``r`` gets the ``r``-th of ``W`` contiguous pieces (a
        view of ``x``). True: the load-balanced layout causal ring attention
        needs -- ``x`` cut into ``2W`` chunks, rank ``r`` gets chunk ``r``
        followed by chunk ``2W - 1 - r`` (a new tensor).

    Returns
    -------
    torch.Tensor
        ``x``'s shape with ``S / W`` along ``dim``; differentiable (autograd
        sees a slice or a concatenation).

    Raises
    ------
    ValueError
        No initialized process group, or ``group`` not one of this
        process; ``S`` not a multiple of ``W`` (``2W`` when causal); ``dim``
        out of range.
    TypeError
        ``x`` not a tensor, ``dim`` not an int, ``causal`` not a bool.

    Shapes
    ------
    x : ``(..., S, ...)`` with ``S`` at ``dim``; result ``(..., S / W, ...)``.
    """
    fn = "shard_sequence"
    x, axis, causal, group, rank, size = _sequence(fn, x, dim, causal, group)
    pieces = 2 * size if causal else size
    if x.shape[axis] % pieces:
        raise ValueError(
            f"{fn}: x has {x.shape[axis]} positions along dim {dim}, not a multiple of "
            f"{pieces} ({'2 x ' if causal else ''}the group's {size} ranks)"
        )
    return _local_shard(x, axis, rank, size, causal)


class _Unshard(torch.autograd.Function):
    """All-gather of the shards; its backward sums the replicas' gradients and keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, size: int, axis: int, causal: bool) -> Tensor:
        ctx.layout = (group, rank, size, axis, causal)
        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(shards, x, group=group)
        chunk = x.shape[axis] // (2 if causal else 1)
        pieces: dict[int, Tensor] = {}  # global chunk index -> its positions
        for r, shard in enumerate(shards):
            for j, i in enumerate(_chunks(r, size, causal)):
                pieces[i] = shard.narrow(axis, j * chunk, chunk)
        return torch.cat([pieces[i] for i in sorted(pieces)], dim=axis)

    @staticmethod
    def backward(ctx, dy: Tensor):
        group, rank, size, axis, causal = ctx.layout
        with torch.no_grad():
            total = dy.contiguous()
            dist.all_reduce(total, group=group)
            dx = _local_shard(total, axis, rank, size, causal)
        (dx,) = _no_double_backward("unshard_sequence", (dy,), (dx,))
        return dx, None, None, None, None, None


def unshard_sequence(x, *, group=None, dim=2, causal=False) -> Tensor:
    """The global sequence, on every rank, from the shards :func:`shard_sequence` gave each rank.

    Parameters
    ----------
    x : torch.Tensor
        This rank's shard (every rank of ``group`` calls this collective with
        a shard of one shape, dtype and layout).
    group : torch.distributed.ProcessGroup, optional
        The ring's process group; None means the default group.
    dim : int
        The sequence axis (2 for xpkernels' attention layout).
    causal : bool
        Whether the shards are in the load-balanced causal layout (see
        :func:`shard_sequence`); must be what they were cut with.

    Returns
    -------
    torch.Tensor
        ``x``'s shape with ``W`` times the length along ``dim``, the same on
        every rank. Differentiable: the gradient of this rank's shard is the
        sum over the ranks of the gradients of their copies (each rank's loss
        counts), as ``torch.distributed.nn.functional.all_gather`` does.

    Raises
    ------
    ValueError
        No initialized process group, or ``group`` not one of this
        process; a causal shard of odd length; ``dim`` out of range.
    TypeError
        ``x`` not a tensor or not on a device the group's backend
        communicates, ``dim`` not an int, ``causal`` not a bool.

    Shapes
    ------
    x : ``(..., S / W, ...)`` with the shard length at ``dim``; result
    ``(..., S, ...)``.
    """
    fn = "unshard_sequence"
    x, axis, causal, group, rank, size = _sequence(fn, x, dim, causal, group)
    _check_device(fn, group, {"x": x})
    if causal and x.shape[axis] % 2:
        raise ValueError(
            f"{fn}: x has {x.shape[axis]} positions along dim {dim}; a causal shard holds two "
            "chunks of one length, so its length must be even"
        )
    return _Unshard.apply(x, group, rank, size, axis, causal)


# --------------------------------------------------------------------------- the ring


class _Ring:
    """The ring over ``group``: this rank, its successor (sends) and predecessor (receives)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def shift(self, tensors: list[Tensor]):
        """Start sending ``tensors`` to the successor and receiving as many from the predecessor.

        Returns the requests to wait on and the buffers the predecessor's
        tensors arrive in. Each tensor has its own tag, so a transfer
        matches the right buffer whatever the order the backend delivers in.
        """
        received = [torch.empty_like(t) for t in tensors]
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, tag=i) for i, t in enumerate(tensors)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.prev, self.group, tag=i) for i, t in enumerate(received)
        ]
        return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _block(ring: _Ring, step: int, causal: bool, chunk: int):
    """``(query rows, keys, causal)`` of the one attention call this rank runs at ``step``, on
    the shard of rank ``(rank - step) mod W``.

    See the module docstring: without ``causal`` every query sees every key;
    with it, the own shard is causal at ``input_pos = 0``, a lower rank's
    shard is seen through its front chunk, a higher rank's by the back query
    chunk; the chunk pairs left out are fully masked.
    """
    every = slice(None)
    if not causal:
        return every, every, False
    rank, source = ring.rank, (ring.rank - step) % ring.size
    if source == rank:
        return every, every, True
    if source < rank:
        return every, slice(0, chunk), False
    return slice(chunk, 2 * chunk), every, False


def _rows(a: Tensor, rows: slice) -> Tensor:
    """``a``'s sequence rows ``rows`` (axis 2), a view."""
    return a[:, :, rows]


def _merged_checkpoints(m: Tensor, l: Tensor) -> AttentionCheckpoints:
    """The merged ``(m, l)`` as backward checkpoints, recorded as
    :func:`xpkernels.merge_attention_states_` records them: written by
    ``attention_`` with no options, so each block's backward passes its own."""
    checkpoints = AttentionCheckpoints(m=m, l=l)
    record_forward(checkpoints, "attention_", {})
    return checkpoints


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(ring: _Ring, q, k, v, causal, scale, backend):
    """The merged ``(o, m, l)`` of this rank's queries over every rank's keys; ``o`` in ``q``'s dtype."""
    batch, heads, sq, _ = q.shape
    acc = _accumulator_dtype(q.dtype)
    chunk = sq // 2
    o = q.new_empty((batch, heads, sq, v.shape[3]), dtype=acc)
    m, l = (q.new_empty((batch, heads, sq), dtype=torch.float32) for _ in range(2))
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(ring.size):
        last = step == ring.size - 1
        requests, received = ([], []) if last else ring.shift([k_cur, v_cur])
        rows, keys, block_causal = _block(ring, step, causal, chunk)
        q_rows, k_keys, v_keys = _rows(q, rows), _rows(k_cur, keys), _rows(v_cur, keys)
        if step == 0:  # the own shard: every row, so it starts the running state
            o_block, part = o, AttentionCheckpoints(m=m, l=l)
        else:
            o_block = o.new_empty((batch, heads, q_rows.shape[2], v.shape[3]))
            part = AttentionCheckpoints(*(torch.empty_like(_rows(m, rows)) for _ in range(2)))
        attention_(
            o_block,
            q_rows,
            k_keys,
            v_keys,
            causal=block_causal,
            scale=scale,
            checkpoints=part,
            backend=backend,
        )
        if step > 0:
            o_run, m_run, l_run = _rows(o, rows), _rows(m, rows), _rows(l, rows)
            merge_attention_states_(
                o_run, m_run, l_run, o_run, m_run, l_run, o_block, part.m, part.l, backend=backend
            )
        _wait(requests)
        if not last:
            k_cur, v_cur = received
    return o.to(q.dtype), m, l


def _backward(ring: _Ring, do, q, k, v, o, m, l, causal, scale, backend):
    """``(dq, dk, dv)`` of this rank's shard; the ring of the forward once more, gradients in tow."""
    acc = _accumulator_dtype(q.dtype)
    chunk = q.shape[2] // 2
    do = do.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    finished: list[Tensor] = []  # the total dk, dv so far of the shard held at the previous step
    for step in range(ring.size):
        sending = []
        if step < ring.size - 1:
            sending += [k_cur, v_cur]
        if step > 0:  # the previous shard's finished dk/dv go on; this shard's arrive
            sending += finished
        requests, received = ring.shift(sending) if sending else ([], [])
        rows, keys, block_causal = _block(ring, step, causal, chunk)
        dk_local, dv_local = (t.new_zeros(t.shape, dtype=acc) for t in (k_cur, v_cur))
        q_rows = _rows(q, rows)
        Q = Duplicated(q_rows, torch.empty(q_rows.shape, dtype=acc, device=q.device))
        attention_backward_(
            Duplicated(_rows(o, rows), _rows(do, rows)),
            Q,
            Duplicated(_rows(k_cur, keys), _rows(dk_local, keys)),
            Duplicated(_rows(v_cur, keys), _rows(dv_local, keys)),
            checkpoints=_merged_checkpoints(_rows(m, rows), _rows(l, rows)),
            causal=block_causal,
            scale=scale,
            backend=backend,
        )
        _rows(dq, rows).add_(Q.shadow)
        _wait(requests)
        if step < ring.size - 1:
            k_cur, v_cur = received[:2]
        if step > 0:
            dk_local.add_(received[-2])
            dv_local.add_(received[-1])
        finished = [dk_local, dv_local]
    if ring.size > 1:  # the last shard's totals go home: the successor owns it
        requests, finished = ring.shift(finished)
        _wait(requests)
    dk, dv = finished
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, causal, scale, backend):
        o, m, l = _forward(ring, q, k, v, causal, scale, backend)
        ctx.save_for_backward(q, k, v, o, m, l)
        ctx.options = (ring, causal, scale, backend)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, m, l = ctx.saved_tensors
        ring, causal, scale, backend = ctx.options
        with torch.no_grad():  # the fronts refuse inputs that require grad in grad mode
            grads = _backward(ring, do, q, k, v, o, m, l, causal, scale, backend)
        dq, dk, dv = _no_double_backward("ring_attention", (do, q, k, v), grads)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, backend=None) -> Tensor:
    """Attention over the whole sequence, each rank of ``group`` holding a shard of it.

    Every rank of ``group`` calls this collective with its own shard; each
    gets the output rows of its query shard, and ``loss.backward()`` gives
    each the gradients of its own ``q``, ``k`` and ``v`` shards (computed with
    xpkernels' backward; see the module docstring for the ring, the causal
    layout and the arithmetic).

    Parameters
    ----------
    q, k, v : torch.Tensor
        This rank's shards of the queries, keys and values, one float dtype,
        one device that the group's backend communicates (cpu for gloo, cuda
        for nccl). Grouped-query heads as in :func:`xpkernels.attention`.
        Every rank's shards have the same shapes (not checked across ranks:
        a mismatch fails in the transfer).
    group : torch.distributed.ProcessGroup, optional
        The ring; None means the default process group.
    causal : bool
        Causal attention over global positions, which requires the
        load-balanced layout of :func:`shard_sequence` with ``causal=True``:
        rank ``r`` holds global chunks ``r`` and ``2W - 1 - r`` of ``S /
        (2W)`` positions each, so ``q`` and ``k`` have one, even, shard
        length. Without it, any split into disjoint shards works.
    scale : float, optional
        Score scale, finite and > 0; None means ``1 / sqrt(D)``.
    backend : str, optional
        Explicit backend for every kernel of the forward and the backward;
        see :mod:`xpkernels.registry`. The choice in force at the call
        (``use_backend``, environment) is fixed for the backward too.

    Returns
    -------
    o : torch.Tensor
        ``(B, H, Sq, Dv)`` in ``q``'s dtype: this rank's rows of attention
        over the whole sequence, in the shard layout of ``q``. Autograd
        records the ring backward when an input requires grad (double
        backward is not supported).

    Raises
    ------
    ValueError
        No initialized process group, or ``group`` not one of this
        process; wrong ranks or shapes of ``q``, ``k``, ``v`` (as
        :func:`xpkernels.attention_`); causal shards of different or odd
        lengths.
    TypeError
        Non-tensors; mismatched dtypes; tensors on different devices or on
        a device type the group's backend does not communicate; ``causal``
        not a bool; ``group`` not a process group.

    Shapes
    ------
    q : ``(B, H, Sq, D)``; k : ``(B, Hkv, Sk, D)``; v : ``(B, Hkv, Sk, Dv)``,
    ``H % Hkv == 0``, last axes contiguous; the global sequence has ``W Sq``
    queries and ``W Sk`` keys (``Sq = Sk`` when causal).
    """
    fn = "ring_attention"
    tensors = {name: _tensor(fn, name, a) for name, a in (("q", q), ("k", k), ("v", v))}
    FRONTS["attention"].validate_qkv(fn, q, k, v)
    causal = check.boolean(fn, "causal", causal)
    if scale is not None:
        scale = check.positive_finite(fn, "scale", scale)
    if causal:
        if k.shape[2] != q.shape[2]:
            raise ValueError(
                f"{fn}: k must hold as many positions as q with causal=True (both are shards of "
                f"one sequence in the load-balanced layout), got q {tuple(q.shape)} and k "
                f"{tuple(k.shape)}"
            )
        if q.shape[2] % 2:
            raise ValueError(
                f"{fn}: q must have an even shard length with causal=True (two chunks of one "
                f"length, see shard_sequence), got shape {tuple(q.shape)}"
            )
    group, rank, size = _group(fn, group)
    _check_device(fn, group, tensors)
    ring = _Ring(group, rank, size)
    return _RingAttention.apply(q, k, v, ring, causal, scale, _explicit_choice(backend)[0])
