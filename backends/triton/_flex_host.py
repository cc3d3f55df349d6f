"""Host side of the Triton flex kernels: generated mod functions and the kernels' tile lists.

Mod functions come from :func:`xpkernels.mods.codegen.triton_source`: each
distinct source is written once per process to a private temporary directory
and imported (Triton reads a kernel's source from its file), so a mod
structure compiles once and a new table or constant value never recompiles.

A :class:`~xpkernels.mods.TilePlan` is turned into the lists the kernels walk:
for every (batch, head, query tile) the visited key tiles, for every
(batch, head, key tile) the query tiles visiting it, each entry
``tile * 4 + state``. Kernel tiles may be smaller than the plan's (a BlockMask
fixes its own): a kernel tile inside one plan tile takes its state; one that
straddles plan tiles (tiles not divisible by the kernel's) is PARTIAL unless
all it covers agree, and the kernel then also reads each pair's plan state.
Device copies of the lists are cached per plan content, so repeated calls
with one plan upload nothing.

Score-mod array gradients (:class:`Mods`) are deterministic by default: each
dK/dV program adds into float32 partial rows of its own (programs that
provably write disjoint elements share one, :func:`program_separation`), and
:func:`sum_rows` sums the rows in a fixed order; ``deterministic=False`` adds
with float32 atomics instead.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import math
import shutil
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from xpkernels.mods import FULL, PARTIAL
from xpkernels.mods.bands import kernel_states, tile_lists_of
from xpkernels.mods.codegen import constants, triton_source

from ._common import launch

_FUNCTIONS: dict[str, Any] = {}
_DIRECTORY: list[str] = []


def _directory() -> str:
    if not _DIRECTORY:
        path = tempfile.mkdtemp(prefix="xpkernels-mods-")
        atexit.register(shutil.rmtree, path, True)
        _DIRECTORY.append(path)
    return _DIRECTORY[0]


def jit_function(source: str, name: str):
    """Function ``name`` of generated module ``source``, imported once per process."""
    key = f"{name}\n{source}"
    if key not in _FUNCTIONS:
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        module_name = f"xpkernels_mod_{digest}"
        path = f"{_directory()}/{module_name}.py"
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        _FUNCTIONS[key] = getattr(module, name)
    return _FUNCTIONS[key]


@triton.jit
def no_score(score, b, h, q_idx, kv_idx, q_row, arrs, consts):
    """The identity score mod (never called: kernels test ``HAS_SCORE`` first)."""
    return score


@triton.jit
def no_mask(b, h, q_idx, kv_idx, q_row, arrs, consts):
    """The keep-everything mask (never called: kernels test ``HAS_MASK`` first)."""
    return True


@triton.jit
def no_vjp(score, b, h, q_idx, kv_idx, q_row, g, valid, arrs, consts, grads):
    """The identity score mod's reverse mode (never called without ``HAS_SCORE``)."""
    return g


def _array_arguments(graph) -> tuple:
    """``arrs``: each slot's tensor, extents and strides."""
    out: list = []
    for slot in graph.slots:
        a = slot.array
        out += [a, *a.shape, *a.stride()]
    return tuple(out) if out else (0,)


#: Deterministic score-mod gradients: per-program partial rows are refused beyond
#: both this many bytes and :data:`PARTIAL_LIMIT_FACTOR` times the accumulators they sum into.
PARTIAL_LIMIT_BYTES = 2**30
PARTIAL_LIMIT_FACTOR = 4

#: Elements and rows per program of the partial-row reduction.
_SUM_BLOCK = 512
_SUM_CHUNK = 16


def program_separation(graph, slot: int) -> tuple[bool, bool, bool]:
    """Whether dK/dV programs of different key tiles, batches, kv heads add into disjoint
    elements of slot ``slot``'s gradient.

    True along an axis when the slot is gathered once, with an unclamped index
    ``kv_idx + c``, ``b + c`` or ``h + c`` on some axis: programs on different key
    tiles (batches, kv heads: each owns its group's heads) then read disjoint
    index ranges there. A slot gathered twice (``t[q] + t[k]``) may collide
    across programs anywhere.
    """
    gathers = [i for i, n in enumerate(graph.nodes) if n.op == "gather" and n.value == slot]
    if len(gathers) != 1:
        return False, False, False
    i = gathers[0]
    names = {
        f[1]
        for axis, f in enumerate(graph.forms[i])
        if f is not None and f[0] == "input" and (i, axis) not in graph.clamped
    }
    return "kv_idx" in names, "b" in names, "h" in names


@triton.jit
def _sum_rows_kernel(
    partial_ptr,  # (rows, n) float32 partial rows, contiguous; chunk sums are written back
    out_ptr,  # (n,) float32 accumulator, contiguous: receives the sum, ADDED (FINAL only)
    count,  # rows taking part in this pass: rows 0, step, 2 step, ...
    n,  # elements per row
    step,  # rows between the rows taking part
    FINAL: tl.constexpr,  # one chunk: add its sum into out
    CHUNK: tl.constexpr,  # rows summed per program
    BLOCK: tl.constexpr,  # elements per program
):
    """One pass of a fixed-order tree sum: chunk ``c`` of ``CHUNK`` consecutive taking-part
    rows is summed in order, into the chunk's first row (or, FINAL, into ``out``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    first = tl.program_id(1).to(tl.int64) * CHUNK
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(CHUNK):
        row = partial_ptr + (first + j) * step * n + offs
        # a row past count reads nothing (a scalar bound: the interpreter cannot mix bools)
        total += tl.load(row, mask=offs < tl.where(first + j < count, n, 0), other=0.0)
    if FINAL:
        tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=ok, other=0.0) + total, mask=ok)
    else:
        tl.store(partial_ptr + first * step * n + offs, total, mask=ok)


#: Carves of the score-mod workspace start at multiples of this many elements (64 bytes).
_ALIGN = 16


@dataclass(frozen=True)
class _Carve:
    """Where one slot's float32 buffers lie in the score-mod workspace.

    ``temp``: offset of a float32 accumulator standing in for the caller's
    (None: the kernel adds into the caller's); ``partial``: offset of its
    ``rows`` partial rows (None: one row, the accumulator itself).
    """

    slot: int
    temp: int | None
    partial: int | None
    rows: int


def workspace_layout(score, score_mod_grads, deterministic, programs) -> tuple[int, list[_Carve]]:
    """``(elements, carves)``: the float32 workspace the score-mod gradients of one backward
    need, and where each slot's buffers lie in it.

    ``programs`` ``(key tiles, B, Hkv, group)``: the dK/dV grid. A slot gets
    a float32 temporary when its accumulator is not float32 (or, deterministic,
    not contiguous), and with ``deterministic`` one partial row per dK/dV
    program that may add into an element another adds into.

    Raises
    ------
    ValueError
        Deterministic partial rows beyond :data:`PARTIAL_LIMIT_BYTES` and
        :data:`PARTIAL_LIMIT_FACTOR` times their accumulators.
    """
    wanted = [i for i, g in enumerate(score_mod_grads) if g is not None]
    counts = {i: _partial_rows(score, i, programs) if deterministic else 1 for i in wanted}
    if deterministic:
        _check_partials(score, score_mod_grads, counts)
    size, carves = 0, []
    for i in wanted:
        target, temp, partial = score_mod_grads[i], None, None
        if target.dtype != torch.float32 or (deterministic and not target.is_contiguous()):
            temp, size = size, size + _aligned(target.numel())
        if counts[i] > 1:
            partial, size = size, size + _aligned(counts[i] * target.numel())
        carves.append(_Carve(i, temp, partial, counts[i]))
    return size, carves


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class Mods:
    """The generated functions of one call's mods and their run-time arguments.

    ``vjp`` is the score's reverse mode without array gradients (dQ pass);
    ``vjp_grads`` adds them too, on ``(keys, queries)`` tiles (dK/dV pass).
    ``grads`` (for :attr:`vjp_grads`) holds float32 accumulators, one per slot
    with a gradient, laid out in the caller's workspace by
    :func:`workspace_layout`: with ``deterministic``, each slot whose dK/dV
    programs may collide (:func:`program_separation`) gets zeroed partial
    rows, one per program that may collide, and :meth:`finish` sums them in a
    fixed order; :meth:`finish` also adds the float32 sums into the caller's
    accumulators where those are not float32 (or, deterministic, not
    contiguous) tensors the kernel could add into directly.
    """

    score_fn: Any
    mask_fn: Any
    vjp: Any
    vjp_grads: Any
    score_arrs: tuple
    score_consts: tuple
    mask_arrs: tuple
    mask_consts: tuple
    grads: tuple
    pending: list
    reductions: list

    @classmethod
    def build(
        cls,
        score,
        mask,
        score_mod_grads=None,
        deterministic=True,
        programs=None,
        workspace=None,
    ) -> Mods:
        """The mods of one call.

        ``programs`` ``(key tiles, B, Hkv, group)``: the dK/dV grid, needed
        with ``score_mod_grads``; ``workspace``: a 1-D float32 tensor of at
        least :func:`workspace_layout`'s elements (None when that is 0). The
        parts of it the call uses are zeroed here.
        """
        wanted: tuple[int, ...] = ()
        grads: tuple = (0,)
        pending: list = []
        reductions: list = []
        if score is not None and score_mod_grads is not None:
            wanted = tuple(i for i, g in enumerate(score_mod_grads) if g is not None)
        if wanted:
            flat: list = []
            rows: list = []
            for carve in workspace_layout(score, score_mod_grads, deterministic, programs)[1]:
                target = score_mod_grads[carve.slot]
                n = target.numel()
                acc = target
                if carve.temp is not None:
                    acc = workspace[carve.temp : carve.temp + n].view(tuple(target.shape))
                    acc.zero_()
                    pending.append((target, acc))
                if carve.partial is not None:
                    partial = workspace[carve.partial : carve.partial + carve.rows * n]
                    partial = partial.view(carve.rows, *acc.shape)
                    partial.zero_()
                    reductions.append((partial, acc))
                    flat += [partial, *partial.stride()[1:]]
                    rows += [*_row_multipliers(score, carve.slot, programs, n), programs[3]]
                else:
                    flat += [acc, *acc.stride()]
                    rows += [0, 0, 0, 1]
            grads = tuple(flat + rows) if deterministic else tuple(flat)
        if score is None:
            score_fn, vjp, vjp_grads = no_score, no_vjp, no_vjp
        else:
            score_fn = jit_function(triton_source(score, "score", "score_mod"), "score_mod")
            vjp = jit_function(triton_source(score, "vjp", "score_vjp"), "score_vjp")
            vjp_grads = vjp
            if wanted:
                source = triton_source(
                    score, "vjp", "score_vjp", wanted, transposed=True, deterministic=deterministic
                )
                vjp_grads = jit_function(source, "score_vjp")
        mask_fn = (
            no_mask
            if mask is None
            else jit_function(triton_source(mask, "mask", "mask_mod"), "mask_mod")
        )
        return cls(
            score_fn,
            mask_fn,
            vjp,
            vjp_grads,
            (0,) if score is None else _array_arguments(score),
            (0,) if score is None else (constants(score) or (0,)),
            (0,) if mask is None else _array_arguments(mask),
            (0,) if mask is None else (constants(mask) or (0,)),
            grads,
            pending,
            reductions,
        )

    @property
    def arguments(self) -> tuple:
        """The mods' run-time kernel arguments: score arrays, score constants, mask arrays,
        mask constants."""
        return (self.score_arrs, self.score_consts, self.mask_arrs, self.mask_consts)

    def finish(self) -> None:
        """Sum the partial rows (a fixed-order tree) and add the float32 sums into accumulators
        of other dtypes."""
        for partial, acc in self.reductions:
            sum_rows(partial, acc)
        for target, acc in self.pending:
            target += acc.to(target.dtype)


def sum_rows(partial: torch.Tensor, acc: torch.Tensor) -> None:
    """``acc += partial.sum(0)`` over contiguous float32 tensors, as a tree of
    :data:`_SUM_CHUNK`-row sums in a fixed order (bit-identical run to run)."""
    n, count, step = acc.numel(), partial.shape[0], 1
    while True:
        chunks = triton.cdiv(count, _SUM_CHUNK)
        grid = (triton.cdiv(n, _SUM_BLOCK), chunks)
        meta = {"CHUNK": _SUM_CHUNK, "BLOCK": _SUM_BLOCK, "num_warps": 4}
        launch(_sum_rows_kernel, acc, grid, partial, acc, count, n, step, FINAL=chunks == 1, **meta)
        if chunks == 1:
            return
        count, step = chunks, step * _SUM_CHUNK


def _row_extents(score, slot, programs) -> tuple[int, int, int]:
    """Extents of ``slot``'s partial rows along the key tiles, batches and kv heads (1 where
    programs cannot collide)."""
    separated = program_separation(score, slot)
    key_tiles, batches, kv_heads = (1 if sep else n for sep, n in zip(separated, programs[:3]))
    return key_tiles, batches, kv_heads


def _partial_rows(score, slot, programs) -> int:
    """Partial rows of ``slot``: one per dK/dV program that may add into an element another adds into."""
    return math.prod(_row_extents(score, slot, programs))


def _row_multipliers(score, slot, programs, elements) -> tuple[int, int, int]:
    """Element offsets between the partial rows of successive key tiles, batches and kv heads."""
    key_tiles, batches, kv_heads = _row_extents(score, slot, programs)
    return (
        0 if key_tiles == 1 else batches * kv_heads * elements,
        0 if batches == 1 else kv_heads * elements,
        0 if kv_heads == 1 else elements,
    )


def _check_partials(score, score_mod_grads, counts) -> None:
    """ValueError when the deterministic partial rows of a call would be unreasonably large."""
    partial = sum(4 * c * score_mod_grads[i].numel() for i, c in counts.items() if c > 1)
    summed = sum(4 * score_mod_grads[i].numel() for i, c in counts.items() if c > 1)
    if partial > max(PARTIAL_LIMIT_BYTES, PARTIAL_LIMIT_FACTOR * summed):
        labels = ", ".join(f"{score.slots[i].label} ({c} rows)" for i, c in counts.items() if c > 1)
        raise ValueError(
            "deterministic score-mod gradients need one float32 "
            f"partial row per dK/dV program that may add into the same element: {labels}, "
            f"{partial / 2**30:.2f} GiB, over both {PARTIAL_LIMIT_BYTES / 2**30:g} GiB and "
            f"{PARTIAL_LIMIT_FACTOR}x the {summed / 2**30:.2f} GiB of gradients they sum; pass "
            "deterministic=False (float32 atomics: the last bits may vary run to run), or index "
            "the array by b, h or kv_idx (+ a constant) where it has such an axis (programs of "
            "different batches, kv heads or key tiles then share no row)"
        )


#: Device tile lists kept per plan content (most recently used last).
_LISTS: OrderedDict = OrderedDict()
_LISTS_KEPT = 64


@dataclass(frozen=True)
class Lists:
    """One plan's tile lists at kernel tiles ``block_m`` x ``block_n``, on one device.

    ``forward_count`` ``(Bp, Hp, NQ)`` and ``forward`` ``(Bp, Hp, NQ, NK)``
    (key tiles per query tile); ``backward_count`` ``(Bp, Hp, NK)`` and
    ``backward`` ``(Bp, Hp, NK, NQ)``; int32 entries ``tile * 4 + state``.
    ``states`` is the plan's own ``(Bp, Hp, NQp, NKp)`` int8 states, read
    per pair when ``exact`` is False.
    """

    forward_count: torch.Tensor
    forward: torch.Tensor
    backward_count: torch.Tensor
    backward: torch.Tensor
    states: torch.Tensor
    exact: bool


def upload(a: np.ndarray, device) -> torch.Tensor:
    """Host array ``a`` as a tensor on ``device`` (the one host-to-device copy of the kernels)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def tile_lists(plan, n_q, n_kv, block_m, block_n, device) -> Lists:
    """The kernel tile lists of ``plan`` (cached on ``device`` by content)."""
    states = np.ascontiguousarray(plan.states, dtype=np.int8)
    key = (
        str(device),
        states.shape,
        states.tobytes(),
        plan.tile_m,
        plan.tile_n,
        n_q,
        n_kv,
        block_m,
        block_n,
    )
    hit = _LISTS.get(key)
    if hit is not None:
        _LISTS.move_to_end(key)
        return hit
    kernel, exact = kernel_states(states, plan.tile_m, plan.tile_n, block_m, block_n, n_q, n_kv)
    fc, fwd = tile_lists_of(kernel, 2)
    bc, bwd = tile_lists_of(kernel, 3)
    lists = Lists(
        upload(fc, device),
        upload(fwd, device),
        upload(bc, device),
        upload(bwd, device),
        upload(states, device),
        exact,
    )
    _LISTS[key] = lists
    if len(_LISTS) > _LISTS_KEPT:
        _LISTS.popitem(last=False)
    return lists


def strides(a) -> tuple[int, ...]:
    """``a``'s strides, 0 along the batch and head axes it broadcasts over (extent 1)."""
    return tuple(0 if axis < 2 and a.shape[axis] == 1 else st for axis, st in enumerate(a.stride()))


#: Tile states as kernel compile-time values.
PARTIAL_CONST = tl.constexpr(PARTIAL)
FULL_CONST = tl.constexpr(FULL)
