"""The options of one attention-family call, validated: what its kernels read and its checkpoints record.

:class:`AttentionCall` is the one description of a call of
:mod:`~xpkernels.attention`, :mod:`~xpkernels.attention_varlen`,
:mod:`~xpkernels.flex_attention` or :mod:`~xpkernels.flex_attention_varlen`:
the four differ only in two declared variants (their ``Signature`` in
``backends/signatures.py``), which this class composes:

- **packing**: padded ``(B, H, S, D)`` arrays with optional ``q_lengths`` /
  ``k_lengths``, or packed ``(T, H, D)`` arrays with the ``(B + 1,)`` prefix
  sums ``cu_seqlens_q`` / ``cu_seqlens_k`` and ``max_seqlen_q`` /
  ``max_seqlen_k``;
- **mods**: ``causal`` alone, or a score mod, a mask mod and a block mask
  traced into graphs, with their tile plan.

Both take ``scale`` and ``input_pos``. Host values (ints, NumPy arrays) are
checked here; a device array's values only in debug mode
(:func:`xpkernels.debug`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from . import _checks as check
from . import mods as _mods
from ._debug import debug_enabled
from ._memory import same_memory

__all__ = ["AttentionCall", "position_array"]


def position_array(input_pos):
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
    if position_array(input_pos) is not None:
        check.batch_integers(fn, "input_pos", xp, input_pos, batch, None, None, "")
        return input_pos
    if not isinstance(input_pos, numbers.Integral):
        raise TypeError(f"{fn}: input_pos must be {expected}, got {type(input_pos).__name__}")
    return check.index_int(fn, "input_pos", input_pos)


def _flex_positions(fn, xp, input_pos, batch, n_q, reference):
    """``input_pos`` as Python ints (an int, a list, a host array) or the ``(B,)`` device array.

    Host values are checked here (any sign, within the kernels' index range);
    a device array is checked for dtype and shape only, its values never
    read on the host outside debug mode (:func:`xpkernels.debug`).
    """
    if hasattr(input_pos, "shape") and _mods._scalar(input_pos) is None:
        check.same_namespace(fn, xp, {reference: None, "input_pos": input_pos})
        check.batch_integers(fn, "input_pos", xp, input_pos, batch, None, None, "")
        if not (check.is_host_array(input_pos) or debug_enabled()):
            return input_pos
        return _mods.positions_of(fn, input_pos, n_q)
    if isinstance(input_pos, (list, tuple)):
        if len(input_pos) != batch:
            raise ValueError(
                f"{fn}: input_pos must have {batch} entries (one per batch), got {len(input_pos)}"
            )
        values = tuple(check.index_int(fn, f"input_pos[{i}]", p) for i, p in enumerate(input_pos))
    else:
        values = (check.index_int(fn, "input_pos", input_pos),)
    return _mods.positions_of(fn, values, n_q)


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
    """``value`` (an int at least the longest sequence; past the packed ``total`` it is taken
    as ``total``, as a fixed bucket size may be), or derived from ``cu``."""
    if value is None:
        return _longest(xp, cu, total)
    value = min(check.index_int(fn, name, value, 0), total)
    if check.is_host_array(cu) or debug_enabled():
        longest = _longest(xp, cu, total)
        if value < longest:
            raise ValueError(
                f"{fn}: {name} must be at least the longest sequence ({longest}), got {value}"
            )
    return value


@dataclass(frozen=True, eq=False)
class _ModKey:
    """What a checkpoint records of a mod: its traced graph and the arrays it captures.

    Two calls agree when they trace to the same graph over the same arrays
    (the same memory: a fresh view of a parameter buffer matches), so a mod
    rebuilt between forward and backward (a lambda, a new ``CausalMask()``)
    matches, while a mod of another structure or over other arrays does not.
    """

    kind: str  #: "score mod" or "mask mod"
    nodes: tuple
    output: int
    arrays: tuple
    labels: tuple

    @classmethod
    def of(cls, kind, graph):
        if graph is None:
            return None
        slots = graph.slots
        arrays = tuple(s.array for s in slots)
        return cls(kind, graph.nodes, graph.output, arrays, tuple(s.label for s in slots))

    def same_as(self, other) -> bool:
        return (
            isinstance(other, _ModKey)
            and (self.nodes, self.output) == (other.nodes, other.output)
            and len(self.arrays) == len(other.arrays)
            and all(same_memory(a, b) for a, b in zip(self.arrays, other.arrays))
        )

    def __repr__(self) -> str:
        reading = f" reading {', '.join(self.labels)}" if self.labels else ""
        return f"<a {self.kind} of {len(self.nodes)} graph nodes{reading}>"


@dataclass(frozen=True, eq=False)
class _BlockMaskKey:
    """What a checkpoint records of a BlockMask: its tiles, positions and tile states (by value),
    so a block mask rebuilt the same way between forward and backward matches."""

    block_mask: _mods.BlockMask

    @classmethod
    def of(cls, block_mask):
        return None if block_mask is None else cls(block_mask)

    def same_as(self, other) -> bool:
        if not isinstance(other, _BlockMaskKey):
            return False
        a, b = self.block_mask, other.block_mask
        if a is b:
            return True
        fields = ("n_q", "n_kv", "tile_m", "tile_n", "input_pos")
        return all(getattr(a, f) == getattr(b, f) for f in fields) and (
            a.states.shape == b.states.shape and bool((a.states == b.states).all())
        )

    def __repr__(self) -> str:
        return repr(self.block_mask)


def _is_input(graph, name) -> bool:
    node = graph.nodes[graph.output]
    return node.op == "input" and node.value == name


def _is_true(graph) -> bool:
    node = graph.nodes[graph.output]
    return node.op == "const" and node.value is True


def _mask(fn, mask_mod, block_mask):
    if block_mask is None:
        return None if mask_mod is None else _mods.as_mask_mod(mask_mod, f"{fn}: mask_mod")
    if not isinstance(block_mask, _mods.BlockMask):
        raise TypeError(
            f"{fn}: block_mask must be a BlockMask from build_block_mask, "
            f"got {type(block_mask).__name__}"
        )
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(
            f"{fn}: mask_mod and block_mask.mask_mod differ; pass only block_mask (it carries "
            "its mask) or the same mask object"
        )
    return block_mask.mask_mod


def _check_block_mask(fn, block_mask, call) -> None:
    """ValueError unless ``block_mask`` fits this call: lengths, positions, batch, heads, tiles."""
    bm = block_mask
    if (bm.n_q, bm.n_kv) != (call.n_q, call.n_kv):
        raise ValueError(
            f"{fn}: block_mask was built for n_q={bm.n_q}, n_kv={bm.n_kv} but the call has "
            f"Sq={call.n_q}, Sk={call.n_kv}; build it for these lengths"
        )
    built = bm.input_pos * call.batch if len(bm.input_pos) == 1 else bm.input_pos
    wanted = call.positions * call.batch if len(call.positions) == 1 else call.positions
    if built != wanted:
        raise ValueError(
            f"{fn}: block_mask was built for input_pos={list(bm.input_pos)}, "
            f"the call has {list(call.positions)}"
        )
    tiles = (-(-call.n_q // bm.tile_m), -(-call.n_kv // bm.tile_n))
    if bm.states.ndim != 4 or tuple(bm.states.shape[2:]) != tiles:
        raise ValueError(
            f"{fn}: block_mask.states has shape {tuple(bm.states.shape)} but tiles of "
            f"{bm.tile_m}x{bm.tile_n} over Sq={call.n_q}, Sk={call.n_kv} need "
            f"(Bm, Hm, {tiles[0]}, {tiles[1]}); "
            "it was built for other tile sizes or lengths"
        )
    uses = bm.mask_mod.graph.uses
    for axis, extent, name, varies in (
        (0, call.batch, "batch", uses("b") or len(set(wanted)) > 1),
        (1, call.heads, "head", uses("h")),
    ):
        allowed = (extent,) if varies else (1, extent)
        if bm.states.shape[axis] not in allowed:
            raise ValueError(
                f"{fn}: block_mask.states has {bm.states.shape[axis]} {name} entries but the "
                f"call has {extent} (and the mask {'reads' if varies else 'does not read'} it); "
                f"build it with n_{name if name == 'batch' else 'heads'}={extent}"
            )


class AttentionCall:
    """A validated attention-family call: its options as the kernels take them.

    Parameters
    ----------
    fn : str
        The function, for messages.
    xp : namespace
        The arrays' namespace.
    q, k : array
        The validated queries and keys (padded or packed as ``packed`` says).
    options : dict
        The call's options by name (those its Signature declares), and for a
        packed call its prefix sums.
    packed, flex : bool
        The call's variants.
    reference : str
        How the pass names ``q`` (``"q"``, ``"Q.primal"``), for namespace messages.

    Attributes
    ----------
    scale : float
        The score scale (``1/sqrt(D)`` when None was given).
    batch, heads, group : int
        Batches (sequences), query heads, query heads per kv head.
    n_q, n_kv : int
        Queries and keys per batch (the longest sequence's, packed).
    """

    def __init__(self, fn, xp, q, k, options, *, packed: bool, flex: bool, reference: str):
        self.packed, self.flex, self.reference = packed, flex, reference
        arrays = {reference: q}
        if packed:
            for name in ("cu_seqlens_q", "cu_seqlens_k"):
                arrays[name] = options[name]
                check.namespace(fn, name, arrays[name])
        if not flex:
            arrays["input_pos"] = position_array(options["input_pos"])
            if not packed:
                arrays.update(q_lengths=options["q_lengths"], k_lengths=options["k_lengths"])
        check.same_namespace(fn, xp, arrays)
        self.heads = q.shape[1]
        self.group = self.heads // k.shape[1]
        d = q.shape[-1]
        self.scale = (
            1.0 / math.sqrt(d)
            if options["scale"] is None
            else check.positive_finite(fn, "scale", options["scale"])
        )
        self._kernel: dict = {}
        self._read: dict = {}
        if packed:
            self._pack(fn, xp, q, k, options)
        else:
            self.batch, self.n_q, self.n_kv = q.shape[0], q.shape[2], k.shape[2]
        if flex:
            self._mods(fn, xp, options)
            return
        self.causal = causal = check.boolean(fn, "causal", options["causal"])
        self.positions = _input_pos(fn, xp, options["input_pos"], self.batch)
        self._read["input_pos"] = position_array(self.positions)
        self._kernel.update(causal=causal, input_pos=self.positions)
        if not packed:
            for name, n, axis in (("q_lengths", self.n_q, "Sq"), ("k_lengths", self.n_kv, "Sk")):
                lengths = options[name]
                if lengths is not None:
                    check.batch_integers(fn, name, xp, lengths, self.batch, 0, n, axis)
                self._read[name] = self._kernel[name] = lengths

    def _pack(self, fn, xp, q, k, options) -> None:
        """The prefix sums and longest sequences of a packed call."""
        cu_q, cu_k = options["cu_seqlens_q"], options["cu_seqlens_k"]
        tq, tk = q.shape[0], k.shape[0]
        self.batch = _cu_seqlens(fn, "cu_seqlens_q", xp, cu_q, tq, "Tq")
        batch_k = _cu_seqlens(fn, "cu_seqlens_k", xp, cu_k, tk, "Tk")
        if batch_k != self.batch:
            raise ValueError(
                f"{fn}: cu_seqlens_k must have the B + 1 = {self.batch + 1} entries of "
                f"cu_seqlens_q (one sequence of keys per sequence of queries), got {batch_k + 1}"
            )
        self.n_q = _max_seqlen(fn, "max_seqlen_q", xp, options["max_seqlen_q"], cu_q, tq)
        self.n_kv = _max_seqlen(fn, "max_seqlen_k", xp, options["max_seqlen_k"], cu_k, tk)
        self._read.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        self._kernel.update(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=self.n_q, max_seqlen_k=self.n_kv
        )

    def _mods(self, fn, xp, options) -> None:
        """The mods as graphs (clamped to this call's index ranges), positions and block mask."""
        block_mask, block_sparse = options.get("block_mask"), options["block_sparse"]
        check.boolean(fn, "block_sparse", block_sparse)
        self.block_sparse, self.block_mask = block_sparse, block_mask
        self.positions = _flex_positions(
            fn, xp, options["input_pos"], self.batch, self.n_q, self.reference
        )
        host = self.positions if isinstance(self.positions, tuple) else None
        self.host_positions = host
        shape = _mods.CallShape(self.batch, self.heads, self.n_q, self.n_kv, host)
        score_mod = options["score_mod"]
        self.score = (
            None if score_mod is None else _mods.as_score_mod(score_mod, f"{fn}: score_mod")
        )
        self.mask = _mask(fn, options["mask_mod"], block_mask)
        clamps = {}
        for mod in (self.score, self.mask):
            if mod is not None:
                clamps[id(mod)] = mod.validate(fn, shape, debug_enabled())
        if block_mask is not None:
            if host is None:
                raise TypeError(
                    f"{fn}: with a block_mask, input_pos must be an int, a list of ints or a "
                    "host (NumPy, array_api_strict) array, checked against the positions the "
                    f"block mask was built for; got a {type(options['input_pos']).__name__} "
                    "device array"
                )
            _check_block_mask(fn, block_mask, shape)
        self.score_graph = (
            None
            if self.score is None or _is_input(self.score.graph, "score")
            else self.score.graph.clamping(clamps[id(self.score)])
        )
        self.mask_graph = (
            None
            if self.mask is None or _is_true(self.mask.graph)
            else self.mask.graph.clamping(clamps[id(self.mask)])
        )
        if host is None:
            self._read["input_pos"] = self.positions
        self._read.update(self.captured())
        self._kernel.update(
            input_pos=self.positions, score_mod=self.score_graph, mask_mod=self.mask_graph
        )

    def recorded(self) -> dict:
        """The options of the forward that its backward must repeat (recorded in checkpoints)."""
        record = {"scale": self.scale, "input_pos": self.positions}
        if self.packed:
            record.update(cu_seqlens_q=self._read["cu_seqlens_q"])
            record.update(cu_seqlens_k=self._read["cu_seqlens_k"])
        if self.flex:
            record["score_mod"] = _ModKey.of("score mod", self.score_graph)
            record["mask_mod"] = _ModKey.of("mask mod", self.mask_graph)
            if not self.packed:
                record["block_mask"] = _BlockMaskKey.of(self.block_mask)
            return record
        record["causal"] = self.causal
        if not self.packed:
            record.update(q_lengths=self._read["q_lengths"], k_lengths=self._read["k_lengths"])
        return record

    def captured(self) -> dict:
        """The arrays the mods read, by label (none without mods)."""
        out = {}
        for graph in (self.score_graph, self.mask_graph) if self.flex else ():
            if graph is not None:
                out.update({f"captured {s.label}": s.array for s in graph.slots})
        return out

    def read(self) -> dict:
        """Every array of the call's options that kernels read, by argument name or label."""
        return dict(self._read)

    @property
    def slots(self) -> tuple:
        """The captured-array slots of the call's score graph."""
        return self.score_graph.slots if self.flex and self.score_graph is not None else ()

    def plan(self, route, n_q, n_kv, batch=None):
        """The tile plan: the BlockMask's tiles, else the backend's default tiles.

        ``batch`` plans batch (sequence) ``batch`` alone, at its own position;
        None plans every batch. Device positions are not read: a mask reading
        ``q_idx`` is then evaluated on every tile (no band skipping).
        """
        masked = self.mask_graph is not None
        tile_m, tile_n = route.hook("default_tiles")(n_q, n_kv, self.group, masked)
        positions, sparse = self.host_positions, self.block_sparse
        if positions is not None and batch is not None:
            positions = (positions[batch if len(positions) > 1 else 0],)
        if positions is None:
            positions = (0,)
            sparse = sparse and not (masked and self.mask_graph.uses("q_idx"))
        return _mods.plan_tiles(
            self.mask if masked else None,
            self.block_mask if masked else None,
            block_sparse=sparse,
            n_q=n_q,
            n_kv=n_kv,
            positions=positions,
            tile_m=tile_m,
            tile_n=tile_n,
        )

    def kernel_options(self, route) -> dict:
        """Keyword options of the backend's forward and backward (its module protocol's)."""
        options = {"scale": self.scale, **self._kernel}
        if self.flex and self.packed:
            options["planner"] = lambda b, n_q, n_kv: self.plan(route, n_q, n_kv, batch=b)
        elif self.flex:
            options["plan"] = self.plan(route, self.n_q, self.n_kv)
        return options
