r"""FlexAttention forward and backward in CUDA C (``flex_attention.cuh``), with generated mod code.

The score and mask mods arrive as traced graphs. For each mod structure the
launcher writes one translation unit into a private directory, named by the
hash of its text: the mods' device functions from
:func:`xpkernels.mods.codegen_cuda.cuda_source` (``flex_mask``,
``flex_score``, ``flex_dscore`` and ``flex_vjp``; an absent mod is the
generator's own identity, :class:`~xpkernels.mods.NoOpScore` or
:class:`~xpkernels.mods.FullMask`), then ``#include "flex_attention.cuh"``.
Captured arrays, their extents and strides and the graphs' constants travel
at run time (:func:`~xpkernels.mods.codegen_cuda.pack_arguments`), so a new
table or constant never recompiles. Both loaders key their modules on the
unit's path.

The kernels are the attention kernels' (``attention_tiles.cuh``: wmma for
float16/bfloat16, SIMT for float32) walking tile lists instead of causal
ranges: the call's :class:`~xpkernels.mods.TilePlan` becomes, per (batch,
head, query tile), the key tiles to visit and per (batch, head, key tile)
the query tiles (:func:`xpkernels.mods.bands.kernel_states`,
:func:`~xpkernels.mods.bands.tile_lists_of`); the mask runs only on PARTIAL
tiles. Default plan tiles are :data:`PLAN_TILE` square, which every kernel
tile divides; a BlockMask's own tiles may not, and pairs of a kernel tile
straddling plan tiles then read their plan state.

Forward, one block per (query tile, batch, query head): ``s = scale q.k``
goes through the score mod, masked pairs are ``-inf``, the online softmax
runs in base 2, and the checkpoints leave in attention's natural-log ``(m,
l)`` contract (a row keeping no key: ``o = 0``, ``m = -inf``, ``l = 0``), so
either pass interchanges with another backend's. Backward: attention's delta
kernel, one dK/dV block per (batch, kv head, key tile) summing over the GQA
group (the score mod's array gradients are added there with float32
``atomicAdd``, into the caller's float32 accumulators or float32
temporaries in ``scratch.score_mod_workspace`` for other dtypes), and one dQ
block per query tile. Atomic sums are not bit-identical run to run, so this
backend declares that it lacks ``deterministic_score_mod_grad``: routing
sends such calls to array_api (or raises for ``backend="cupy"``).
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import array_api_compat
import numpy as np

from xpkernels.mods import FullMask, NoOpScore
from xpkernels.mods.bands import kernel_states, tile_lists_of
from xpkernels.mods.codegen_cuda import cuda_source, pack_arguments

from . import attention as _attention
from ._loader import OPTIONS, loader_for
from ._rows import CTYPES, NULL, ptr

__all__ = ["backward", "default_tiles", "forward", "name_expressions", "score_mod_workspace"]

#: Plan tiles (queries x keys) when no BlockMask fixes them: every kernel tile divides them.
PLAN_TILE = 64
BLOCK_M = _attention.BLOCK_M
BLOCK_N = _attention.BLOCK_N
BLOCK_Q = _attention.BLOCK_Q
HEAD_DIMS = _attention.HEAD_DIMS
#: Workspace carves start at multiples of this many float32 elements (64 bytes).
_ALIGN = 16

_DIRECTORY: list[Path] = []
_UNITS: dict[str, Path] = {}
_LISTS: OrderedDict = OrderedDict()
_LISTS_KEPT = 64


def default_tiles(n_q: int, n_kv: int, group: int, masked: bool) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of a plan: :data:`PLAN_TILE` square."""
    return PLAN_TILE, PLAN_TILE


def _names(t: str, dmax: int) -> tuple[str, str, str]:
    """The forward, dK/dV and dQ kernels for input type ``t`` and padded head dim ``dmax``."""
    return (
        f"flex_forward<{t},{BLOCK_N[t]},{dmax}>",
        f"flex_backward_dkdv<{t},{BLOCK_Q[t]},{dmax}>",
        f"flex_backward_dq<{t},{BLOCK_N[t]},{dmax}>",
    )


def name_expressions() -> list[str]:
    """Every template instantiation of a unit (for offline compile reports)."""
    return [n for t in CTYPES.values() for dmax in HEAD_DIMS for n in _names(t, dmax)]


def _directory() -> Path:
    if not _DIRECTORY:
        path = tempfile.mkdtemp(prefix="xpkernels-cupy-flex-")
        atexit.register(shutil.rmtree, path, True)
        _DIRECTORY.append(Path(path))
    return _DIRECTORY[0]


def unit_source(score, mask, grads: tuple[int, ...] = ()) -> str:
    """The translation unit of mod graphs ``score`` and ``mask`` (None: absent); the dK/dV
    pass's ``flex_vjp`` adds the gradients of score slots ``grads``."""
    score_graph = NoOpScore().graph if score is None else score
    mask_graph = FullMask().graph if mask is None else mask
    parts = [
        cuda_source(mask_graph, "mask", "flex_mask"),
        cuda_source(score_graph, "score", "flex_score"),
        cuda_source(score_graph, "vjp", "flex_dscore"),
        cuda_source(score_graph, "vjp", "flex_vjp", grads),
    ]
    return "\n".join(parts) + '\n#include "flex_attention.cuh"\n'


def unit(score, mask, grads: tuple[int, ...] = ()) -> Path:
    """The unit's file (written once per process, named by its hash)."""
    source = unit_source(score, mask, grads)
    path = _UNITS.get(source)
    if path is None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:24]
        path = _directory() / f"flex_{digest}.cu"
        path.write_text(source, encoding="utf-8")
        _UNITS[source] = path
    return path


def _on_device(host: np.ndarray, like):
    """Host array ``host`` in ``like``'s namespace (a copy to the GPU for CuPy)."""
    if isinstance(like, np.ndarray):
        return np.ascontiguousarray(host)
    return array_api_compat.array_namespace(like).asarray(np.ascontiguousarray(host))


def _device_key(like) -> str:
    return "cpu" if isinstance(like, np.ndarray) else f"cuda:{like.device.id}"


def _broadcast_strides(a) -> list:
    """Element strides of ``a`` (int64), 0 along the batch and head axes it broadcasts over."""
    return [
        np.int64(0 if axis < 2 and a.shape[axis] == 1 else a.strides[axis] // a.itemsize)
        for axis in range(a.ndim)
    ]


def _lists(plan, n_q, n_kv, block_m, block_n, axis, like) -> tuple:
    """Kernel arguments of ``plan``'s tile lists at kernel tiles ``block_m`` x ``block_n``
    along ``axis`` (2: per query tile, 3: per key tile), cached by content on the device."""
    states = np.ascontiguousarray(plan.states, dtype=np.int8)
    key = (
        _device_key(like),
        states.shape,
        states.tobytes(),
        plan.tile_m,
        plan.tile_n,
        n_q,
        n_kv,
        block_m,
        block_n,
        axis,
    )
    hit = _LISTS.get(key)
    if hit is None:
        kernel, exact = kernel_states(states, plan.tile_m, plan.tile_n, block_m, block_n, n_q, n_kv)
        count, entries = tile_lists_of(kernel, axis)
        count, entries, states_d = (_on_device(a, like) for a in (count, entries, states))
        hit = (
            count,
            entries,
            *_broadcast_strides(count)[:2],
            *_broadcast_strides(entries)[:3],
            states_d,
            *_broadcast_strides(states_d)[:3],
            np.int32(plan.tile_m),
            np.int32(plan.tile_n),
            np.int32(1 if exact else 0),
        )
        _LISTS[key] = hit
        if len(_LISTS) > _LISTS_KEPT:
            _LISTS.popitem(last=False)
    else:
        _LISTS.move_to_end(key)
    return hit


def _mod_arguments(graph, like, grads=(), accumulators=()) -> tuple:
    """``(ptrs, ints, floats)`` of a graph's ModArgs on ``like``'s device (nulls without one).

    The device copies are returned to be kept alive while the kernels run.
    """
    if graph is None:
        return NULL, NULL, NULL
    packed = pack_arguments(graph, None, grads, accumulators)
    return tuple(_on_device(a, like) for a in packed)


def _positions(input_pos, batch, like) -> tuple:
    """``(pointer, stride, width, value)`` of ``input_pos`` for the kernels."""
    if isinstance(input_pos, tuple):
        if len(input_pos) == 1 or len(set(input_pos)) == 1:
            return NULL, np.int64(0), np.int32(0), np.int64(input_pos[0])
        values = _on_device(np.asarray(input_pos, dtype=np.int64), like)
        return values, np.int64(1), np.int32(8), np.int64(0)
    return (*_attention.index("input_pos", input_pos, batch), np.int64(0))


def forward(o, q, k, v, m, l, *, scale, input_pos, score_mod, mask_mod, plan) -> None:
    """Write ``o`` (and the checkpoints ``m``, ``l`` unless None) by ``flex_forward``.

    ``input_pos`` is a tuple of ints (one, or one per batch) or a (B,)
    integer array; ``score_mod``, ``mask_mod`` are graphs or None.
    Parameters: the ``flex_attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    t = _attention.input_type("flex_attention", q, k, v)
    o_kind = _attention.float_kind("flex_attention", "o", o)
    dmax = _attention.padded_head_dim("flex_attention", q, v)
    _attention.check_backward_sizes("flex_attention", q, k)
    (batch, heads, sq, _), sk = q.shape, k.shape[2]
    if batch * heads * sq == 0:
        return
    if sk == 0:
        o[...] = 0
        if m is not None:
            m[...] = -np.inf
            l[...] = 0
        return
    name = _names(t, dmax)[0]
    q_tiles = -(-sq // BLOCK_M)
    shared = _attention.shared_bytes(t, dmax)
    _attention.launch(
        loader_for(q).module(unit(score_mod, mask_mod), [name], OPTIONS),
        name,
        batch * heads * q_tiles,
        shared,
        (
            o,
            o_kind,
            ptr(m),
            ptr(l),
            q,
            k,
            v,
            *_positions(input_pos, batch, q),
            *_lists(plan, sq, sk, BLOCK_M, BLOCK_N[t], 2, q),
            *_mod_arguments(score_mod, q),
            *_mod_arguments(mask_mod, q),
            np.int32(heads),
            *_attention.sizes(q, k, v),
            np.int32(q_tiles),
            np.float32(scale),
            *_attention.vector_flags(q, k, v),
            np.uint64(shared),
            *_attention.strides(q, k, v, o, m, l),
        ),
    )


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def score_mod_workspace(q, k, v, score_mod, plan, score_mod_grads, deterministic) -> int:
    """Float32 elements :func:`backward` needs: a float32 temporary per score-mod gradient
    whose accumulator is not float32 (the kernels add with float32 ``atomicAdd``)."""
    if score_mod is None:
        return 0
    return sum(
        _aligned(int(np.prod(g.shape)))
        for g in score_mod_grads
        if g is not None and str(g.dtype) != "float32"
    )


def backward(
    do,
    q,
    k,
    v,
    o,
    m,
    l,
    dq,
    dk,
    dv,
    delta,
    dq_accum,
    *,
    scale,
    input_pos,
    score_mod,
    mask_mod,
    plan,
    score_mod_grads,
    deterministic,
    score_mod_workspace=None,
) -> None:
    """Overwrite ``dq``, ``dk``, ``dv`` and ADD the score mod's array gradients.

    Recomputes the probabilities from the checkpoints ``m``, ``l`` (from a
    forward on any backend); ``delta`` receives ``rowsum(do * o)``;
    ``dq_accum`` is not used (None). ``score_mod_grads`` are summed with
    float32 atomics, so ``deterministic`` must be False when any is given
    (routing never sends such a call here). Parameters: the
    ``flex_attention`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    what = "flex_attention backward"
    t = _attention.input_type(what, q, k, v)
    kinds = _attention.backward_kinds(what, do, o, dq, dk, dv, m, l, delta)
    dmax = _attention.padded_head_dim(what, q, v)
    _attention.check_backward_sizes(what, q, k)
    wanted = tuple(
        i for i, g in enumerate(score_mod_grads or ()) if g is not None and score_mod is not None
    )
    if wanted and deterministic:
        raise ValueError(
            "cupy flex_attention backward: score-mod gradients are summed with float32 atomics; "
            "deterministic=True cannot be honoured (route it to another backend)"
        )
    (batch, heads, sq, _), (_, kv_heads, sk, _) = q.shape, k.shape
    if batch == 0 or heads == 0:
        return
    if sk == 0 or sq == 0:
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
        return
    accumulators, pending, offset = [], [], 0
    for i in wanted:
        target = score_mod_grads[i]
        if str(target.dtype) == "float32":
            accumulators.append(target)
            continue
        n = int(np.prod(target.shape))
        acc = score_mod_workspace[offset : offset + n].reshape(tuple(target.shape))
        acc[...] = 0
        offset += _aligned(n)
        accumulators.append(acc)
        pending.append((target, acc))
    _, dkdv_name, dq_name = _names(t, dmax)
    module = loader_for(q).module(unit(score_mod, mask_mod, wanted), [dkdv_name, dq_name], OPTIONS)
    delta_module = loader_for(q).module(_attention.SOURCE, [_attention.DELTA_KERNEL], OPTIONS)
    no_lengths = _attention.index("q_lengths", None, batch)
    _attention.launch_delta(delta_module, delta, do, o, kinds, no_lengths)
    common = (q, k, v, do, kinds["do"], m, l, delta, *_positions(input_pos, batch, q))
    mask_args = _mod_arguments(mask_mod, q)
    dims = _attention.sizes(q, k, v)
    flags = (np.float32(scale), *_attention.vector_flags(q, k, v))

    kv_tiles, shared = -(-sk // BLOCK_M), _attention.backward_shared_bytes(t, dmax, "dkdv")
    lists = _lists(plan, sq, sk, BLOCK_Q[t], BLOCK_M, 3, q)
    args = (dk, kinds["dk"], dv, kinds["dv"], *common, *lists)
    args += (*_mod_arguments(score_mod, q, wanted, accumulators), *mask_args, np.int32(kv_heads))
    args += (*dims, np.int32(kv_tiles), *flags, np.uint64(shared))
    args += (*_attention.strides(q, k, v, do, m, l, delta, dk, dv),)
    _attention.launch(module, dkdv_name, batch * kv_heads * kv_tiles, shared, args)

    q_tiles, shared = -(-sq // BLOCK_M), _attention.backward_shared_bytes(t, dmax, "dq")
    args = (dq, kinds["dq"], *common, *_lists(plan, sq, sk, BLOCK_M, BLOCK_N[t], 2, q))
    args += (*_mod_arguments(score_mod, q), *mask_args, np.int32(heads), *dims)
    args += (np.int32(q_tiles), *flags, np.uint64(shared))
    args += (*_attention.strides(q, k, v, do, m, l, delta, dq),)
    _attention.launch(module, dq_name, batch * heads * q_tiles, shared, args)
    for target, acc in pending:
        target += acc.astype(target.dtype)
