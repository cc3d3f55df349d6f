"""CUDA C++ source for a traced mod graph: device functions evaluated per (query, key) pair.

:func:`cuda_source` turns a :class:`~xpkernels.mods.Graph` into NVRTC-clean
CUDA C++ (``cuda_fp16.h`` and ``cuda_bf16.h`` are its only includes) defining
one ``__device__ __forceinline__`` function that one thread calls per pair:

- a mask: ``bool name(long long b, long long h, long long q_idx, long long
  kv_idx, long long q_row, const ModArgs& a)``;
- a score: ``float name(float score, long long b, ..., const ModArgs& a)``;
- a score's reverse mode: ``float name(float score, long long b, ..., float g,
  const ModArgs& a)`` returns d score for cotangent ``g`` and adds each
  ``grads`` slot's gradient into its float32 accumulator with ``atomicAdd``.
  Call it only on pairs the kernel keeps: it has no ``valid`` argument.

The semantics are those of the Triton target (:mod:`xpkernels.mods.codegen`),
operation by operation: integers in int64 with Python's floor division and
remainder (computed through unsigned arithmetic, so results wrap as the
kernels' int64 does, never undefined behaviour; a zero divisor gives 0 as
NumPy), floats in float32 (``div`` IEEE, ``tan`` as ``sin / cos``, ``tanh`` as
``1 - 2 / (exp(2x) + 1)``, ``pow`` from ``exp2(b log2|a|)`` with C's
special cases), NaN-propagating ``minimum``/``maximum``, ``floor``
to int64 with NaN -> 0 and saturation past int64, captured-array indices
clamped into the array. Both targets spell each operation from its record
in :data:`~xpkernels.mods.ir.OPS` and generate a vjp from the same gradient
graph (:func:`~xpkernels.mods.grad.gradient`) as the interpreter evaluates.
Sources from several graphs (a mask, a score and its vjp) can be
concatenated into one translation unit: the shared part is guarded.

**Arguments.** Everything that may change without changing the graph's
structure travels at run time in one :class:`ModArgs` per graph, three
read-only device arrays (:func:`pack_arguments` builds them on the host; a
kernel takes the three pointers as parameters and builds
``ModArgs a{ptrs, ints, floats}``):

- ``ptrs`` (uint64): the data address of each slot's array, in slot order,
  then of each ``grads`` accumulator (float32), in ``grads`` order;
- ``ints`` (int64): for each slot, its extents then its strides (in
  elements); then the graph's integer constants in node order; then, for
  each ``grads`` accumulator, its strides (in elements);
- ``floats`` (float32): the graph's float constants in node order.

The layout of a vjp's arguments starts with that of the score's, so one
packing serves both functions. Slot dtypes are part of the source (bool,
int8/16/32/64, uint8, float16, bfloat16, float32, float64), constants and
shapes are not: graphs differing only in their constants or array extents
share one compiled kernel (:func:`layout` gives the offsets). The three arrays
are read through ``__ldg`` (the read-only cache): they must not change while
a kernel runs. A vjp issues one ``atomicAdd`` per pair and differentiated
gather (the Triton target sums over its tile first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from .grad import COTANGENT, gradient
from .ir import BOOL, FLOAT, INPUTS, INT, Graph, spell

__all__ = ["Layout", "cuda_source", "layout", "pack_arguments"]

#: C++ element type and the expression reading element ``{0}`` of pointer ``{1}`` as
#: its kind's value type, by dtype name.
_DTYPES = {
    "bool": ("unsigned char", "({1}[{0}] != 0)"),
    "int8": ("signed char", "(long long){1}[{0}]"),
    "int16": ("short", "(long long){1}[{0}]"),
    "int32": ("int", "(long long){1}[{0}]"),
    "int64": ("long long", "{1}[{0}]"),
    "uint8": ("unsigned char", "(long long){1}[{0}]"),
    "float16": ("__half", "__half2float({1}[{0}])"),
    "bfloat16": ("__nv_bfloat16", "__bfloat162float({1}[{0}])"),
    "float32": ("float", "{1}[{0}]"),
    "float64": ("double", "(float){1}[{0}]"),
}

_CTYPE = {BOOL: "bool", INT: "long long", FLOAT: "float"}
#: Shared by every generated function: the argument struct and the helpers.
_COMMON = r"""
#ifndef XPKERNELS_MOD_COMMON
#define XPKERNELS_MOD_COMMON
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The run-time arguments of one mod graph (see xpkernels.mods.codegen_cuda).
struct ModArgs {
    const unsigned long long* ptrs;  // slot arrays, then gradient accumulators
    const long long* ints;           // slot extents and strides, int constants, grad strides
    const float* floats;             // float constants
};

#define XPK_INT64_MIN (-9223372036854775807LL - 1LL)

// int64 arithmetic that wraps (through unsigned), as the kernels' int64 does.
__device__ __forceinline__ long long xpk_add(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);
}
__device__ __forceinline__ long long xpk_sub(long long a, long long b) {
    return (long long)((unsigned long long)a - (unsigned long long)b);
}
__device__ __forceinline__ long long xpk_mul(long long a, long long b) {
    return (long long)((unsigned long long)a * (unsigned long long)b);
}
__device__ __forceinline__ long long xpk_neg(long long a) {
    return (long long)(0ULL - (unsigned long long)a);
}
__device__ __forceinline__ long long xpk_iabs(long long a) { return a < 0 ? xpk_neg(a) : a; }
__device__ __forceinline__ long long xpk_imin(long long a, long long b) { return b < a ? b : a; }
__device__ __forceinline__ long long xpk_imax(long long a, long long b) { return b > a ? b : a; }

// Python's floor division: rounds down; a zero divisor gives 0 (as NumPy).
__device__ __forceinline__ long long xpk_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    if (b == -1) return xpk_neg(a);
    const long long q = a / b, r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}

// Python's remainder: the divisor's sign; a zero divisor gives 0 (as NumPy).
__device__ __forceinline__ long long xpk_mod(long long a, long long b) {
    if (b == 0 || b == -1) return 0;
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// index clamped into [0, extent - 1]
__device__ __forceinline__ long long xpk_clamp(long long i, long long extent) {
    return i < 0 ? 0 : (i > extent - 1 ? extent - 1 : i);
}

__device__ __forceinline__ float xpk_nan() { return __int_as_float(0x7fc00000); }

// NaN-propagating float minimum and maximum.
__device__ __forceinline__ float xpk_fmin(float a, float b) {
    return a != a ? a : (b != b ? b : (b < a ? b : a));
}
__device__ __forceinline__ float xpk_fmax(float a, float b) {
    return a != a ? a : (b != b ? b : (b > a ? b : a));
}

// floor(x) as int64: NaN gives 0, values past int64 saturate (above: at float32's largest
// value below 2**63, 2**63 - 2**39, as the other backends).
__device__ __forceinline__ long long xpk_floor_int(float x) {
    x = floorf(x);
    if (x != x) return 0;
    if (x >= 9.2233720368547758e18f) return 9223371487098961920LL;
    if (x <= -9.2233720368547758e18f) return XPK_INT64_MIN;
    return (long long)x;
}

// a ** b in float32 with C's (and NumPy's) special cases: a finite negative base needs an
// integer exponent (else NaN); a base with its sign bit set (-0 and -inf included) gives a
// negative result for an odd integer exponent; 1 ** b, a ** 0 and (-1) ** +-inf are 1.
__device__ __forceinline__ float xpk_pow(float a, float b) {
    const float inf = __int_as_float(0x7f800000);
    if (b == 0.0f || a == 1.0f || (a == -1.0f && fabsf(b) == inf)) return 1.0f;
    const bool whole = floorf(b) == b;
    if (a < 0.0f && a > -inf && !whole) return xpk_nan();
    const float r = exp2f(b * log2f(fabsf(a)));
    const bool odd = whole && fabsf(b - 2.0f * floorf(b * 0.5f)) == 1.0f;
    return (__float_as_int(a) < 0 && odd) ? -r : r;
}
#endif  // XPKERNELS_MOD_COMMON
"""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_VAR = re.compile(r"\b([vg]\d+)\b")


@dataclass(frozen=True)
class Layout:
    """Where each run-time value of a graph sits in :class:`ModArgs` (see the module docstring).

    Attributes
    ----------
    slot_ints : tuple of int
        Per slot: offset in ``ints`` of its extents (its strides follow them).
    int_consts : dict
        Const node -> offset in ``ints``.
    float_consts : dict
        Const node -> offset in ``floats``.
    grad_ints : tuple of int
        Per ``grads`` entry: offset in ``ints`` of its accumulator's strides.
    n_ints, n_floats : int
        Lengths of ``ints`` and ``floats``; ``ptrs`` holds ``len(slots) + len(grads)``.
    """

    slot_ints: tuple[int, ...]
    int_consts: dict
    float_consts: dict
    grad_ints: tuple[int, ...]
    n_ints: int
    n_floats: int


def layout(graph: Graph, grads: tuple[int, ...] = ()) -> Layout:
    """The :class:`Layout` of ``graph``'s arguments with accumulators for slots ``grads``."""
    slot_ints = list(accumulate((2 * slot.array.ndim for slot in graph.slots), initial=0))
    offset = slot_ints.pop()
    int_consts: dict[int, int] = {}
    float_consts: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        if n.op != "const" or isinstance(n.value, bool):
            continue
        if n.kind == FLOAT:
            float_consts[i] = len(float_consts)
        else:
            int_consts[i] = offset
            offset += 1
    grad_ints = list(accumulate((graph.slots[s].array.ndim for s in grads), initial=offset))
    n_ints = grad_ints.pop()
    return Layout(
        tuple(slot_ints), int_consts, float_consts, tuple(grad_ints), n_ints, len(float_consts)
    )


def _dtype_name(dtype) -> str:
    """``float16``, ``bfloat16``, ``int32``... for a NumPy, CuPy or PyTorch dtype."""
    return str(dtype).removeprefix("torch.")


def _element_strides(a) -> tuple[int, ...]:
    """Strides of array ``a`` in elements (NumPy, CuPy or PyTorch)."""
    stride = getattr(a, "stride", None)
    if callable(stride):
        return tuple(int(s) for s in stride())
    return tuple(int(s) // a.dtype.itemsize for s in a.strides)


def _address(a) -> int:
    """The data address of array ``a`` (NumPy, CuPy or PyTorch)."""
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    if hasattr(a, "data_ptr"):
        return int(a.data_ptr())
    return int(a.data.ptr)


def pack_arguments(
    graph: Graph, arrays=None, grads: tuple[int, ...] = (), accumulators=()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host ``(ptrs, ints, floats)`` arrays of :class:`ModArgs` for ``graph``.

    Parameters
    ----------
    graph : Graph
    arrays : sequence of array, optional
        One per slot, replacing the slots' arrays (same dtypes and ranks), e.g. the
        device copies the kernel reads. The caller keeps them alive while it runs.
    grads : tuple of int
        The slots whose gradients the vjp adds, as passed to :func:`cuda_source`.
    accumulators : sequence of array
        One float32 array per ``grads`` entry, shaped like its slot's array.

    Returns
    -------
    ptrs : ndarray of uint64
    ints : ndarray of int64
    floats : ndarray of float32
        Copy them to the device for a GPU kernel (a few hundred bytes).
    """
    arrays = [s.array for s in graph.slots] if arrays is None else list(arrays)
    if len(arrays) != len(graph.slots):
        raise ValueError(
            f"arrays: need {len(graph.slots)} arrays (one per slot), got {len(arrays)}"
        )
    accumulators = list(accumulators)
    if len(accumulators) != len(grads):
        raise ValueError(
            f"accumulators: need {len(grads)} arrays (one per grads entry), got {len(accumulators)}"
        )
    for k, (slot, a) in enumerate(zip(graph.slots, arrays)):
        want, got = _dtype_name(slot.array.dtype), _dtype_name(a.dtype)
        if got != want or a.ndim != slot.array.ndim:
            raise TypeError(
                f"arrays[{k}]: {slot.label} was compiled for a rank-{slot.array.ndim} {want} "
                f"array, got rank {a.ndim} {got}"
            )
    for k, (s, acc) in enumerate(zip(grads, accumulators)):
        if _dtype_name(acc.dtype) != "float32" or tuple(acc.shape) != tuple(arrays[s].shape):
            raise TypeError(
                f"accumulators[{k}]: must be float32 shaped {tuple(arrays[s].shape)}, "
                f"got {tuple(acc.shape)} {acc.dtype}"
            )
    lay = layout(graph, grads)
    ints = np.zeros(lay.n_ints, np.int64)
    floats = np.zeros(lay.n_floats, np.float32)
    for base, a in zip(lay.slot_ints, arrays):
        ints[base : base + a.ndim] = tuple(a.shape)
        ints[base + a.ndim : base + 2 * a.ndim] = _element_strides(a)
    for i, at in lay.int_consts.items():
        ints[at] = graph.nodes[i].value
    for i, at in lay.float_consts.items():
        floats[at] = graph.nodes[i].value
    for base, acc in zip(lay.grad_ints, accumulators):
        ints[base : base + acc.ndim] = _element_strides(acc)
    ptrs = np.array([_address(a) for a in arrays + accumulators], np.uint64)
    return ptrs, ints, floats


class _Writer:
    """Statements of one graph's nodes (written when it is built) and their reverse mode, as
    ``(target, C++ line)``."""

    def __init__(self, graph: Graph, lay: Layout):
        self.graph, self.lay = graph, lay
        self.lines: list[tuple[str | None, str]] = []
        for i in range(len(graph.nodes)):
            self.emit(i)

    def float_of(self, i: int) -> str:
        return f"v{i}" if self.graph.nodes[i].kind == FLOAT else f"(float)v{i}"

    def index(self, i: int, strides: int) -> str:
        """Element offset of gather ``i``: clamped indices times the strides at ``ints[strides]``."""
        node = self.graph.nodes[i]
        base = self.lay.slot_ints[node.value]
        terms = [
            f"xpk_clamp(v{j}, __ldg(a.ints + {base + axis})) * __ldg(a.ints + {strides + axis})"
            for axis, j in enumerate(node.args)
        ]
        return " + ".join(terms) if terms else "0"

    def emit(self, i: int) -> None:
        node = self.graph.nodes[i]
        op = node.op
        if op == "input":
            expr = "g" if node.value == COTANGENT else node.value
        elif op == "literal":
            expr = f"{node.value!r}f"
        elif op == "const":
            if isinstance(node.value, bool):
                expr = "true" if node.value else "false"
            elif node.kind == FLOAT:
                expr = f"__ldg(a.floats + {self.lay.float_consts[i]})"
            else:
                expr = f"__ldg(a.ints + {self.lay.int_consts[i]})"
        elif op == "gather":
            slot = self.graph.slots[node.value]
            ctype, read = _DTYPES[_dtype_name(slot.array.dtype)]
            pointer = f"reinterpret_cast<const {ctype}*>(__ldg(a.ptrs + {node.value}))"
            offset = self.index(i, self.lay.slot_ints[node.value] + slot.array.ndim)
            expr = read.format(offset, pointer)
        else:
            expr = spell(self.graph.nodes, i, "cuda", self.float_of)
        self.lines.append((f"v{i}", f"const {_CTYPE[node.kind]} v{i} = {expr};"))

    def scatters(self, rev, grads: tuple[int, ...]) -> str:
        """Append the atomic adds of ``rev``'s gathered cotangents; returns d score's expression."""
        graph = self.graph
        for i, g in rev.scatters:
            k = grads.index(graph.nodes[i].value)
            acc = f"reinterpret_cast<float*>(__ldg(a.ptrs + {len(graph.slots) + k}))"
            offset = self.index(i, self.lay.grad_ints[k])
            self.lines.append((None, f"atomicAdd({acc} + {offset}, v{g});"))
        return "0.0f" if rev.d_score is None else f"v{rev.d_score}"

    def body(self, result: str) -> list[str]:
        """The live lines (no variable set but never read: NVRTC warns on those) and the return."""
        lines = list(self.lines) + [(None, f"return {result};")]
        while True:
            read: set[str] = set()
            for target, text in lines:
                read.update(v for v in _VAR.findall(text) if v != target)
            kept = [(t, s) for t, s in lines if t is None or t in read]
            if len(kept) == len(lines):
                return [s for _, s in lines]
            lines = kept


def cuda_source(graph: Graph, role: str, name: str, grads: tuple[int, ...] = ()) -> str:
    """CUDA C++ source defining ``__device__`` function ``name`` for ``graph``.

    Parameters
    ----------
    graph : Graph
    role : {"mask", "score", "vjp"}
        The function's form (see the module docstring).
    name : str
        The function's name (a C identifier).
    grads : tuple of int
        ``vjp`` only: the float slots whose gradients it adds, in the order of
        the accumulators in :class:`ModArgs`.

    Returns
    -------
    str
        Source including the shared part (guarded, so several sources concatenate).
    """
    if role not in ("mask", "score", "vjp"):
        raise ValueError(f"role must be 'mask', 'score' or 'vjp', got {role!r}")
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"name must be a C identifier, got {name!r}")
    grads = tuple(grads)
    if grads and role != "vjp":
        raise ValueError(f"grads: only a vjp adds gradients, got {grads} for role {role!r}")
    for s in grads:
        if not (isinstance(s, int) and 0 <= s < len(graph.slots)):
            raise ValueError(f"grads: {s!r} is not a slot of the graph ({len(graph.slots)} slots)")
        if graph.slots[s].kind != FLOAT:
            raise ValueError(f"grads: slot {s} ({graph.slots[s].label}) is not a float array")
    if len(set(grads)) != len(grads):
        raise ValueError(f"grads: slots repeat in {grads}")
    for s, slot in enumerate(graph.slots):
        if _dtype_name(slot.array.dtype) not in _DTYPES:
            raise TypeError(
                f"graph: slot {s} ({slot.label}) has dtype {slot.array.dtype}, which the CUDA "
                f"target does not read (supported: {', '.join(_DTYPES)})"
            )
    kind = graph.nodes[graph.output].kind
    if role == "mask" and kind != BOOL:
        raise ValueError(f"a mask graph returns a condition, got {kind}")
    rev = gradient(graph, grads) if role == "vjp" else None
    w = _Writer(graph if rev is None else rev.graph, layout(graph, grads))
    params = [f"long long {n}" for n in INPUTS[1:]]
    if role == "mask":
        result, returns = f"v{graph.output}", "bool"
    elif role == "score":
        params.insert(0, "float score")
        result, returns = w.float_of(graph.output), "float"
    else:
        params.insert(0, "float score")
        params.append("float g")
        result, returns = w.scatters(rev, grads), "float"
    params.append("const ModArgs& a")
    signature = f"__device__ __forceinline__ {returns} {name}({', '.join(params)})"
    body = "".join(f"    {s}\n" for s in w.body(result))
    return _COMMON.lstrip("\n") + "\n" + signature + " {\n" + body + "}\n"
