r"""FlexAttention: attention whose scores and mask are Python functions, with their gradients.

For batch ``b``, query head ``h`` (reading kv head ``h // (H // Hkv)``), query
row ``i`` at position ``p_i = input_pos[b] + i`` and key ``j``:

.. math::

    s_{ij} = \begin{cases}
        \mathrm{score\_mod}(\mathrm{scale}\; q_i \cdot k_j,\ b, h, p_i, j)
            & \text{if } \mathrm{mask\_mod}(b, h, p_i, j) \\
        -\infty & \text{otherwise}
    \end{cases}

    m_i = \max_j s_{ij}, \qquad l_i = \textstyle\sum_j e^{s_{ij} - m_i}, \qquad
    o_i = \tfrac{1}{l_i} \textstyle\sum_j e^{s_{ij} - m_i}\, v_j

Backward, with :math:`p_{ij} = e^{s_{ij} - m_i} / l_i`,
:math:`\delta_i = do_i \cdot o_i` and :math:`g_{ij} = p_{ij} (do_i \cdot v_j - \delta_i)`
(the gradient of the modified score):

.. math::

    ds_{ij} = g_{ij}\, \frac{\partial\, \mathrm{score\_mod}}{\partial s}, \qquad
    dq_i = \mathrm{scale} \textstyle\sum_j ds_{ij}\, k_j, \qquad
    dk_j = \mathrm{scale} \textstyle\sum_i ds_{ij}\, q_i, \qquad
    dv_j = \textstyle\sum_i p_{ij}\, do_i, \qquad
    d\theta \mathrel{+}=
        \textstyle\sum_{ij} g_{ij}\, \frac{\partial\, \mathrm{score\_mod}}{\partial \theta}

for every float array :math:`\theta` the score mod captures (ALiBi slopes, a
bias table, a learnable relative-position table...). The mods are traced once
into expression graphs (:mod:`xpkernels.mods`); the derivatives come from the
graph's reverse mode, so a mod is written once, with no backward.

Shapes, grouped-query heads, ``scale``, ``input_pos`` and the checkpoints
``(m, l)`` follow :mod:`xpkernels.attention` exactly (its
``AttentionCheckpoints`` are used here; :class:`FlexAttentionBackwardScratch`
adds a score-mod workspace to attention's scratch), so flex with no mods equals
attention. A row that keeps no key has ``o = 0``,
``m = -inf``, ``l = 0`` and zero gradients. Band masks and
:class:`~xpkernels.mods.BlockMask` skip whole tiles in the forward AND the
backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from . import _autograd
from . import _checks as check
from . import mods as _mods
from ._debug import debug_enabled
from ._memory import same_memory
from .attention import (
    AttentionCheckpoints,
    _allocate_scratch,
    _scratch_route,
    _validate_qkv,
)
from .buffers import (
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .registry import resolve

__all__ = [
    "FlexAttentionBackwardScratch",
    "flex_attention_",
    "flex_attention",
    "flex_attention_backward_",
    "flex_attention_backward",
]


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
        return cls(
            kind,
            graph.nodes,
            graph.output,
            tuple(s.array for s in slots),
            tuple(s.label for s in slots),
        )

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


class _Call:
    """A validated flex call: mods as graphs, the tile plan and everything the backend receives."""

    def __init__(
        self, fn, xp, dims, *, score_mod, mask_mod, block_mask, block_sparse, scale, input_pos
    ):
        batch, heads, kv_heads, n_q, n_kv, d = dims
        self.scale = (
            1.0 / math.sqrt(d) if scale is None else check.positive_finite(fn, "scale", scale)
        )
        if not isinstance(block_sparse, bool):
            raise TypeError(f"{fn}: block_sparse must be a bool, got {block_sparse!r}")
        self.block_sparse = block_sparse
        self.positions = _positions(fn, xp, input_pos, batch, n_q)
        host = self.positions if isinstance(self.positions, tuple) else None
        self.host_positions = host
        call = _mods.CallShape(batch, heads, n_q, n_kv, host)
        self.score = (
            None if score_mod is None else _mods.as_score_mod(score_mod, f"{fn}: score_mod")
        )
        self.mask = _mask(fn, mask_mod, block_mask)
        self.block_mask = block_mask
        clamps = {}
        for mod in (self.score, self.mask):
            if mod is not None:
                clamps[id(mod)] = mod.validate(fn, call, debug_enabled())
        if block_mask is not None:
            if host is None:
                raise TypeError(
                    f"{fn}: with a block_mask, input_pos must be an int, a list of ints or a "
                    "host (NumPy, array_api_strict) array, checked against the positions the "
                    f"block mask was built for; got a {type(input_pos).__name__} device array"
                )
            _check_block_mask(fn, block_mask, call)
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
        self.group = heads // kv_heads

    def recorded(self) -> dict:
        """The options of the forward that its backward must repeat (recorded in checkpoints)."""
        return {
            "scale": self.scale,
            "input_pos": self.positions,
            "score_mod": _ModKey.of("score mod", self.score_graph),
            "mask_mod": _ModKey.of("mask mod", self.mask_graph),
            "block_mask": _BlockMaskKey.of(self.block_mask),
        }

    def captured(self) -> dict:
        """The arrays the mods read, by label, for namespace and device checks."""
        out = {}
        for graph in (self.score_graph, self.mask_graph):
            if graph is not None:
                out.update({f"captured {s.label}": s.array for s in graph.slots})
        return out

    def read(self) -> dict:
        """Every array of the call's options that kernels read: captured arrays, input_pos."""
        out = self.captured()
        if self.host_positions is None:
            out["input_pos"] = self.positions
        return out

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

    def planner(self, route):
        """``plan(b, n_q, n_kv)``: the tile plan of sequence ``b`` alone, for packed calls."""
        return lambda b, n_q, n_kv: self.plan(route, n_q, n_kv, batch=b)

    def options(self, route, n_q, n_kv) -> dict:
        """Keyword options of the backend's forward/backward."""
        return {
            "scale": self.scale,
            "input_pos": self.positions,
            "score_mod": self.score_graph,
            "mask_mod": self.mask_graph,
            "plan": self.plan(route, n_q, n_kv),
        }


def _dims(q, k) -> tuple:
    """``(B, H, Hkv, Sq, Sk, D)`` of a flex call."""
    batch, heads, n_q, d = q.shape
    return batch, heads, k.shape[1], n_q, k.shape[2], d


def _is_input(graph, name) -> bool:
    node = graph.nodes[graph.output]
    return node.op == "input" and node.value == name


def _is_true(graph) -> bool:
    node = graph.nodes[graph.output]
    return node.op == "const" and node.value is True


def _positions(fn, xp, input_pos, batch, n_q):
    """``input_pos`` as Python ints (an int, a list, a host array) or the ``(B,)`` device array.

    Host values are checked here (any sign, within the kernels' index range);
    a device array is checked for dtype and shape only, its values never
    read on the host outside debug mode (:func:`xpkernels.debug`).
    """
    if hasattr(input_pos, "shape") and _mods._scalar(input_pos) is None:
        check.same_namespace(fn, xp, {"q": None, "input_pos": input_pos})
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


def _checkpoints(fn, xp, checkpoints, q):
    if not isinstance(checkpoints, AttentionCheckpoints):
        raise TypeError(
            f"{fn}: checkpoints must be the AttentionCheckpoints from "
            f"allocate_checkpoints(flex_attention_, q, k, v), got {type(checkpoints).__name__}"
        )
    for name in AttentionCheckpoints._fields:
        a = getattr(checkpoints, name)
        check.namespace(fn, f"checkpoints.{name}", a)
        check.shape(fn, f"checkpoints.{name}", a, tuple(q.shape[:3]))
        check.float32(fn, f"checkpoints.{name}", xp, a)
    return checkpoints.m, checkpoints.l


def flex_attention_(
    o,
    q,
    k,
    v,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
) -> None:
    """FlexAttention forward, in place: writes ``o`` (and the checkpoints).

    Parameters
    ----------
    o : array
        Output, written in full.
    q, k, v : array or Duplicated
        Queries, keys and values.
    score_mod : ScoreMod or callable, optional
        ``(score, b, h, q_idx, kv_idx) -> score`` applied to every scaled
        score (see :mod:`xpkernels.mods`). None: scores unchanged.
    mask_mod : MaskMod or callable, optional
        ``(b, h, q_idx, kv_idx) -> keep``. None: every key (unless
        ``block_mask`` carries a mask).
    block_mask : BlockMask, optional
        From :func:`~xpkernels.mods.build_block_mask` for this call's
        lengths, ``input_pos``, batch and heads; its mask is the call's mask
        and its tiles are the kernel's tiles.
    block_sparse : bool
        True skips tiles that the band of the mask or the BlockMask proves
        empty, and skips evaluating the mask on tiles proven full. False
        visits every tile and evaluates the mask everywhere (the dense path;
        same results).
    scale : float, optional
        Score scale, finite and > 0; None gives ``1/sqrt(D)``.
    input_pos : int, list of B ints or (B,) integer array
        Position of query row 0 (per batch); mods see ``q_idx = input_pos + row``.
        May be negative: queries before the first key keep nothing under a
        causal mask (``input_pos = Sk - Sq`` is flash-attn's bottom-right
        alignment); ``|input_pos| < 2**31``. Host values (ints, lists,
        NumPy or array_api_strict arrays) are checked and drive band
        skipping; a device array is never read on the host outside debug
        mode (the call stays capture-safe; masks reading ``q_idx`` are then
        evaluated on every tile, and ``block_mask`` needs host positions).
    checkpoints : AttentionCheckpoints, optional
        From ``allocate_checkpoints(flex_attention_, q, k, v)``; receives
        ``(m, l)``. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays, mods or options (named in the message), a read-only
        output, an output sharing memory with an input or another output.
        Nothing is written when a check fails.

    Shapes
    ------
    q ``(B, H, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``, o
    ``(B, H, Sq, Dv)`` with ``H % Hkv == 0``. Last axes contiguous, other
    strides free. Arrays captured by the mods live with q.

    Checkpoints
    -----------
    m : ``(B, H, Sq)`` float32, row max of the modified, masked, scaled scores
    (-inf for a row that keeps no key); l : ``(B, H, Sq)`` float32,
    ``sum_j exp(s_ij - m_i)`` (0 for such a row).
    """
    fn = "flex_attention_"
    _autograd.check_inplace(fn, {"q": q, "k": k, "v": v, "o": o}, score_mod)
    q, k, v = primal(q), primal(k), primal(v)
    xp = check.namespace(fn, "q", q)
    check.same_namespace(fn, xp, {"q": q, "k": k, "v": v, "o": o})
    _validate_qkv(fn, q, k, v)
    batch, heads, n_q, _ = q.shape
    check.floating(fn, "o", xp, o)
    check.shape(fn, "o", o, (batch, heads, n_q, v.shape[3]))
    check.last_axis_contiguous(fn, "o", o)
    call = _Call(
        fn,
        xp,
        _dims(q, k),
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
    )
    m = lse_sum = None
    if checkpoints is not None:
        m, lse_sum = _checkpoints(fn, xp, checkpoints, q)
    outputs = {"o": o, "checkpoints.m": m, "checkpoints.l": lse_sum}
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, {"q": q, "k": k, "v": v, **call.read()})
    arrays = {
        "o": o,
        "q": q,
        "k": k,
        "v": v,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **call.captured(),
    }
    route = resolve("flex_attention", arrays, backend=backend, head_dim=max(q.shape[3], v.shape[3]))
    if checkpoints is not None:
        forget_forward(checkpoints)
    route.impl.forward(o, q, k, v, m, lse_sum, **call.options(route, n_q, k.shape[2]))
    if checkpoints is not None:
        record_forward(checkpoints, fn, call.recorded())


@checkpoints_for(flex_attention_)
def allocate_flex_attention_checkpoints(q, k=None, v=None, **options) -> AttentionCheckpoints:
    """Allocate ``flex_attention_``'s checkpoints for q ``(B, H, Sq, D)``: m, l ``(B, H, Sq)``."""
    fn = "allocate_checkpoints(flex_attention_)"
    q = primal(q)
    check.namespace(fn, "q", q)
    check.rank(fn, "q", q, 4, "(B, H, Sq, D)")
    rows = tuple(q.shape[:3])
    return AttentionCheckpoints(m=empty_float32(q, rows), l=empty_float32(q, rows))


def flex_attention(
    q,
    k,
    v,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    checkpoints=None,
    backend=None,
):
    """FlexAttention forward into a new array; see :func:`flex_attention_`.

    Returns
    -------
    o : array ``(B, H, Sq, Dv)`` with q's dtype. On torch tensors, when q, k, v or an array
    the score mod captures requires grad (grad mode on), autograd records xpkernels'
    backward, score-mod gradients included (:mod:`xpkernels.torch`).
    """
    fn = "flex_attention"
    options = {
        "score_mod": score_mod,
        "mask_mod": mask_mod,
        "block_mask": block_mask,
        "block_sparse": block_sparse,
        "scale": scale,
        "input_pos": input_pos,
        "checkpoints": checkpoints,
        "backend": backend,
    }
    if (o := _autograd.record(fn, {"q": q, "k": k, "v": v}, options)) is not _autograd.NOT_RECORDED:
        return o
    q, v = primal(q), primal(v)
    check.namespace(fn, "q", q)
    check.namespace(fn, "v", v)
    check.rank(fn, "q", q, 4, "(B, H, Sq, D)")
    check.rank(fn, "v", v, 4, "(B, Hkv, Sk, Dv)")
    o = empty(q, (*q.shape[:3], v.shape[3]), q.dtype)
    flex_attention_(
        o,
        q,
        k,
        v,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
        checkpoints=checkpoints,
        backend=backend,
    )
    return o


class FlexAttentionBackwardScratch(NamedTuple):
    """Transient workspace of ``flex_attention_backward_``: attention's, and the score mod's.

    A field the routed backend does not use is None.
    """

    delta: object  #: ``(B, H, Sq)``, ``rowsum(do * o)`` (float32; float64 for float64 inputs)
    dq_accum: object  #: ``(B, H, Sq, D)``, ``dq / scale`` summed over key tiles, or None
    #: ``(N,)`` float32, the score-mod gradients' partial sums (triton: per-program
    #: partial rows, float32 stand-ins for float64 accumulators), or None when the
    #: call's gradients need none
    score_mod_workspace: object = None


def _scratch(fn, xp, scratch, q, shapes, kind, allocator):
    """``(delta, dq_accum, score_mod_workspace)`` of a caller's flex scratch, checked.

    ``shapes`` gives ``delta``'s and ``dq_accum``'s; a scratch not of type
    ``kind`` is a TypeError naming ``allocator``.
    """
    if not isinstance(scratch, kind):
        raise TypeError(
            f"{fn}: scratch must be the {kind.__name__} from {allocator}, "
            f"got {type(scratch).__name__}"
        )
    check.same_namespace(
        fn,
        xp,
        {f"scratch.{n}": a for n, a in scratch._asdict().items()},
        reference="Q.primal",
    )
    for name, shape in zip(("delta", "dq_accum"), shapes):
        a = getattr(scratch, name)
        if a is None:  # a field the backend does not use; the route checks those it needs
            continue
        check.shape(fn, f"scratch.{name}", a, shape)
        check.accumulator(fn, f"scratch.{name}", xp, a, q.dtype)
    workspace = scratch.score_mod_workspace
    if workspace is not None:
        name = "scratch.score_mod_workspace"
        check.rank(fn, name, workspace, 1, "(N,)")
        check.float32(fn, name, xp, workspace)
        check.last_axis_contiguous(fn, name, workspace)
    return scratch.delta, scratch.dq_accum, workspace


def _score_mod_workspace(fn, route, need, scratch, workspace, like, allocator):
    """The score-mod workspace a backward passes its backend: None when ``need`` (the
    backend hook's float32 elements) is 0, a new array when the caller gave no scratch,
    else the caller's, which must hold ``need`` elements (ValueError naming ``allocator``)."""
    if need == 0:
        return None
    if scratch is None:
        return empty_float32(like, (need,))
    held = 0 if workspace is None else workspace.shape[0]
    if held < need:
        raise ValueError(
            f"{fn}: scratch.score_mod_workspace holds {held} float32 elements but this call's "
            f"score-mod gradients need {need} on backend {route.backend!r}; allocate the scratch "
            f"with {allocator} passing the call's score_mod, score_mod_grad, mask and tile "
            "options and deterministic"
        )
    return workspace


def _slots(call) -> tuple:
    """The captured-array slots of the call's score graph."""
    return call.score_graph.slots if call.score_graph is not None else ()


def _mod_grads(fn, xp, call, score_mod_grad) -> tuple:
    """One accumulator (or None) per captured array of the score graph, checked against it."""
    slots = _slots(call)
    if score_mod_grad is None:
        return (None,) * len(slots)
    if not isinstance(score_mod_grad, _mods.ScoreModGrad) or call.score is None:
        raise TypeError(
            f"{fn}: score_mod_grad must be the ScoreModGrad from grad_shadow(score_mod) of the "
            f"call's score mod, got {type(score_mod_grad).__name__}"
            + ("" if call.score is not None else " (and the call has no score_mod)")
        )
    if not score_mod_grad.made_for(call.score):
        raise TypeError(
            f"{fn}: score_mod_grad does not match score_mod {call.score.label}: it was made by "
            f"grad_shadow of another score mod ({score_mod_grad._label}, or one capturing other "
            "arrays); make it with grad_shadow(score_mod)"
        )
    grads = []
    for slot in slots:
        acc = score_mod_grad.lookup(slot.path, slot.field)
        if acc is not None:
            name = f"score_mod_grad for {slot.label}"
            check.namespace(fn, name, acc)
            check.shape(fn, name, acc, tuple(slot.array.shape))
            check.accumulator(fn, name, xp, acc, slot.array.dtype)
        grads.append(acc)
    return tuple(grads)


def flex_attention_backward_(
    O,
    Q,
    K,
    V,
    *,
    checkpoints,
    scratch=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
) -> None:
    """FlexAttention backward, in place: overwrites Q, K, V's shadows; ADDS the mod's gradients.

    Parameters
    ----------
    O : Duplicated
        The forward's output (primal, read) and its cotangent ``do`` (shadow, read).
    Q, K, V : Duplicated
        The forward's inputs; their shadows receive ``dq``, ``dk``, ``dv`` in
        full (zeros where nothing is kept); ``dk``, ``dv`` are summed over
        each kv head's group of query heads.
    checkpoints : AttentionCheckpoints
        Filled by the forward with the same mods and options (or by any
        backend following the contract).
    scratch : FlexAttentionBackwardScratch, optional
        From ``allocate_scratchspace(flex_attention_backward_, O, Q, K, V,
        **options)`` with this call's options (``backend``, and with
        ``score_mod_grad`` the mods, tile options and ``deterministic`` that
        size its ``score_mod_workspace``); None allocates it for this call.
        Every field the routed backend uses must be present; the others may be
        None.
    score_mod_grad : ScoreModGrad, optional
        From ``grad_shadow(score_mod)`` (``feature_grads=True`` for
        PairFeatureScore features): the gradients of the score mod's captured
        float arrays are ADDED into it. None computes none.
    deterministic : bool, default True
        The ``score_mod_grad`` sums are bit-identical run to run (on the
        triton backend: per-program partial rows and a reduction in a fixed
        order); False lets a backend add them with float32 atomics (faster,
        the last bits may vary). Q, K, V's shadows are deterministic either way.
    score_mod, mask_mod, block_mask, block_sparse, scale, input_pos, backend
        As in the forward :func:`flex_attention_`.

    Shapes
    ------
    As :func:`flex_attention_`; shadows share their primal's shape.
    ``score_mod_grad`` fields share their array's shape; float32 (float64
    for float64 arrays).

    Scratch
    -------
    delta : ``(B, H, Sq)``, ``rowsum(do * o)``; dq_accum : ``(B, H, Sq, D)``,
    dq accumulated over key tiles. Float32 (float64 for float64 inputs).
    score_mod_workspace : ``(N,)`` float32, the partial sums of the score-mod
    gradients, ``N`` from the backend (0, None, without ``score_mod_grad``).

    Raises
    ------
    ValueError
        Among the usual argument errors: a ``scratch.score_mod_workspace``
        smaller than the call needs, or (triton, deterministic) partial rows
        too large: over both 1 GiB and 4x the gradients they sum.
    """
    fn = "flex_attention_backward_"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{fn}: deterministic must be a bool, got {deterministic!r}")
    _autograd.check_inplace(fn, {"O": O, "Q": Q, "K": K, "V": V}, score_mod)
    Ds = {
        name: check.duplicated(fn, name, d) for name, d in (("O", O), ("Q", Q), ("K", K), ("V", V))
    }
    q, k, v, o = Q.primal, K.primal, V.primal, O.primal
    xp = check.namespace(fn, "Q.primal", q)
    named = {
        f"{n}.{part}": getattr(d, part) for n, d in Ds.items() for part in ("primal", "shadow")
    }
    check.same_namespace(fn, xp, named)
    _validate_qkv(fn, q, k, v, names=("Q.primal", "K.primal", "V.primal"))
    for name, a in named.items():
        check.floating(fn, name, xp, a)
        check.last_axis_contiguous(fn, name, a)
    check.shape(fn, "O.primal", o, (*q.shape[:3], v.shape[3]))
    check.shape(fn, "O.shadow", O.shadow, (*q.shape[:3], v.shape[3]))
    call = _Call(
        fn,
        xp,
        _dims(q, k),
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
    )
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the AttentionCheckpoints that flex_attention_ "
            "filled in the forward (allocate_checkpoints(flex_attention_, q, k, v))"
        )
    m, lse_sum = _checkpoints(fn, xp, checkpoints, q)
    delta = dq_accum = workspace = None
    if scratch is not None:
        delta, dq_accum, workspace = _scratch(
            fn,
            xp,
            scratch,
            q,
            (tuple(q.shape[:3]), tuple(q.shape)),
            FlexAttentionBackwardScratch,
            _ALLOCATOR,
        )
    grads = _mod_grads(fn, xp, call, score_mod_grad)
    outputs = {
        "Q.shadow": Q.shadow,
        "K.shadow": K.shadow,
        "V.shadow": V.shadow,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
        "scratch.score_mod_workspace": workspace,
        **{f"score_mod_grad for {s.label}": g for s, g in zip(_slots(call), grads)},
    }
    check.writable(fn, outputs)
    inputs = {
        "Q.primal": q,
        "K.primal": k,
        "V.primal": v,
        "O.primal": o,
        "O.shadow": O.shadow,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        **call.read(),
    }
    check.no_overlap(fn, outputs, inputs)
    check_forward(fn, checkpoints, "flex_attention_", call.recorded())
    arrays = {
        **named,
        "checkpoints.m": m,
        "checkpoints.l": lse_sum,
        "scratch.delta": delta,
        "scratch.dq_accum": dq_accum,
        "scratch.score_mod_workspace": workspace,
        **call.captured(),
        **{f"score_mod_grad {i}": g for i, g in enumerate(grads)},
    }
    route = resolve(
        "flex_attention",
        arrays,
        backend=backend,
        head_dim=max(q.shape[3], v.shape[3]),
        features=_features(deterministic, any(g is not None for g in grads)),
    )
    options = call.options(route, q.shape[2], k.shape[2])
    need = _workspace_need(fn, route, q, k, v, options, grads, deterministic)
    if scratch is None:
        delta, dq_accum = _allocate_scratch(route, q)
    else:
        route.require_scratch(fn, scratch)
    workspace = _score_mod_workspace(fn, route, need, scratch, workspace, q, _ALLOCATOR)
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
        score_mod_grads=grads,
        deterministic=deterministic,
        score_mod_workspace=workspace,
        **options,
    )


_ALLOCATOR = "allocate_scratchspace(flex_attention_backward_, O, Q, K, V, **options)"


def _features(deterministic: bool, mod_grads: bool) -> tuple[str, ...]:
    """The per-call routing features of a backward (``protocol.FEATURES``)."""
    return ("deterministic_score_mod_grad",) if deterministic and mod_grads else ()


def _workspace_need(fn, route, q, k, v, options, grads, deterministic) -> int:
    """Float32 elements of the score-mod workspace (the backend's hook; 0 without gradients)."""
    if all(g is None for g in grads):
        return 0
    hook = route.hook("score_mod_workspace")
    try:
        return hook(q, k, v, options["score_mod"], options["plan"], grads, deterministic)
    except ValueError as error:
        raise ValueError(f"{fn}: {error}") from None


@scratchspace_for(flex_attention_backward_)
def allocate_flex_attention_backward_scratch(
    O,
    Q,
    K=None,
    V=None,
    *,
    backend=None,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    **options,
) -> FlexAttentionBackwardScratch:
    """Allocate ``flex_attention_backward_``'s scratch from ``Q`` ``(B, H, Sq, D)``.

    Returns ``delta (B, H, Sq)`` and ``dq_accum (B, H, Sq, D)``, float32
    (float64 when ``Q`` is float64), for the backend the call routes to; a
    field that backend does not use is None. With ``score_mod_grad`` (and
    ``K``, ``V``), also the ``score_mod_workspace`` that the backward with
    these options needs (None when it needs none); the other options are
    the backward's, ignored here.

    Raises
    ------
    ValueError
        As the backward, for deterministic score-mod partial rows too large.
    """
    fn = "allocate_scratchspace(flex_attention_backward_)"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{fn}: deterministic must be a bool, got {deterministic!r}")
    features = _features(deterministic, score_mod_grad is not None)
    route, q = _scratch_route("flex_attention", fn, O, Q, K, V, backend, features)
    delta, dq_accum = _allocate_scratch(route, q)
    workspace = None
    if score_mod_grad is not None:
        if K is None or V is None:
            raise TypeError(f"{fn}: K and V are needed to size the workspace of score_mod_grad")
        k, v = primal(K), primal(V)
        xp = check.namespace(fn, "Q", q)
        _validate_qkv(fn, q, k, v, names=("Q", "K", "V"))
        call = _Call(
            fn,
            xp,
            _dims(q, k),
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=block_mask,
            block_sparse=block_sparse,
            scale=scale,
            input_pos=input_pos,
        )
        grads = _mod_grads(fn, xp, call, score_mod_grad)
        call_options = call.options(route, q.shape[2], k.shape[2])
        need = _workspace_need(fn, route, q, k, v, call_options, grads, deterministic)
        workspace = empty_float32(q, (need,)) if need else None
    return FlexAttentionBackwardScratch(delta, dq_accum, workspace)


def flex_attention_backward(
    do,
    q,
    k,
    v,
    o,
    *,
    checkpoints,
    score_mod=None,
    score_mod_grad=None,
    mask_mod=None,
    block_mask=None,
    block_sparse=True,
    scale=None,
    input_pos=0,
    deterministic=True,
    backend=None,
):
    """FlexAttention backward into new arrays; see :func:`flex_attention_backward_`.

    Parameters
    ----------
    do : array
        Cotangent of the forward's output ``o``.
    q, k, v, o : array or Duplicated
        The forward's inputs and output.
    score_mod_grad : ScoreModGrad, optional
        Receives (ADDS) the score mod's array gradients.
    deterministic : bool, default True
        As in :func:`flex_attention_backward_`.

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like ``q``, ``k``, ``v``.
    """
    fn = "flex_attention_backward"
    shadows = with_new_shadows(fn, {"q": q, "k": k, "v": v})
    o = primal(o)
    flex_attention_backward_(
        Duplicated(o, do),
        shadows["q"],
        shadows["k"],
        shadows["v"],
        checkpoints=checkpoints,
        score_mod=score_mod,
        score_mod_grad=score_mod_grad,
        mask_mod=mask_mod,
        block_mask=block_mask,
        block_sparse=block_sparse,
        scale=scale,
        input_pos=input_pos,
        deterministic=deterministic,
        backend=backend,
    )
    return shadows["q"].shadow, shadows["k"].shadow, shadows["v"].shadow
