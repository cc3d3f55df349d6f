"""Mask and score mods: the base classes, the built-ins and their compositions.

:class:`MaskMod` / :class:`ScoreMod`, every built-in mod (:class:`CausalMask` ...
:class:`PairFeatureScore`), ``&`` / ``|`` / ``>>`` compositions, :class:`ScoreModGrad`,
:func:`as_mask_mod` and :func:`as_score_mod`.
"""

from __future__ import annotations

import builtins
import copy
import inspect
import math
from dataclasses import dataclass
from functools import reduce

import array_api_compat
import numpy as np

from .._memory import same_memory, torch_numpy_view
from .ir import BOOL, FLOAT, INPUTS, INT, Graph, _host_bounds, _to_host, is_host_array
from .trace import CapturedArray, _scalar, _Tracer, logical_and, logical_or, tanh


def _array_kind(owner: str, name: str, a) -> str:
    try:
        xp = array_api_compat.array_namespace(a)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be an array, got {type(a).__name__}") from None
    if a.dtype == xp.bool:
        return BOOL
    if xp.isdtype(a.dtype, "integral"):
        return INT
    if xp.isdtype(a.dtype, "real floating"):
        return FLOAT
    raise TypeError(f"{owner}: {name} must have a bool, integer or real float dtype, got {a.dtype}")


def _check_float_array(owner: str, name: str, a, rank: int, shape: str | None = None) -> None:
    """TypeError unless ``a`` is a rank-``rank`` float array (``shape``: its shape, as named)."""
    if _array_kind(owner, name, a) != FLOAT or a.ndim != rank:
        form = f"a rank-{rank} float array" if shape is None else f"a float array of shape {shape}"
        raise TypeError(f"{owner}: {name} must be {form}, got {tuple(a.shape)} {a.dtype}")


def _takes_q_row(fn) -> bool:
    """Whether ``fn`` has a parameter ``q_row``: read off its code object where it has one
    (``torch.compile`` cannot trace ``inspect.signature``, so mods built inside a compiled
    function need this path), else from its signature."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None:
        return "q_row" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    try:
        return "q_row" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class CallShape:
    """What a mod is checked against: batch, query heads, query/key counts and query positions."""

    batch: int
    heads: int
    n_q: int
    n_kv: int
    #: ``input_pos`` per batch (length 1 when shared); None when it is a device array,
    #: whose values are not read on the host
    positions: tuple[int, ...] | None

    def ranges(self) -> dict:
        """Inclusive range of every index input over the call (None: device values)."""
        q_idx = None
        if self.positions is not None:
            first = builtins.min(self.positions)
            q_idx = (first, builtins.max(self.positions) + self.n_q - 1)
        return {
            "b": (0, self.batch - 1),
            "h": (0, self.heads - 1),
            "q_idx": q_idx,
            "q_row": (0, self.n_q - 1),
            "kv_idx": (0, self.n_kv - 1),
        }

    def describe(self) -> str:
        q_idx = self.ranges()["q_idx"]
        where = "from input_pos on the device" if q_idx is None else f"in [{q_idx[0]}, {q_idx[1]}]"
        return f"b < {self.batch}, h < {self.heads}, q_idx {where}, kv_idx < {self.n_kv}"


class _Mod:
    """What mask and score mods share: a function, its captured arrays and its traced graph."""

    _returns = BOOL

    def __init__(self, fn, /, **arrays):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        label = self.label
        self._kinds = {name: _array_kind(label, name, a) for name, a in arrays.items()}
        self.arrays = dict(arrays)
        self._bounds = {
            name: _host_bounds(a) for name, a in arrays.items() if self._kinds[name] == INT
        }
        self._q_row = _takes_q_row(fn)
        self.graph = self._trace()

    @property
    def label(self) -> str:
        """Name used in messages: the class, or ``MaskMod(fn)`` / ``ScoreMod(fn)``."""
        if type(self) in (MaskMod, ScoreMod):
            return f"{type(self).__name__}({getattr(self.fn, '__name__', 'fn')})"
        return type(self).__name__

    def _trace(self) -> Graph:
        tracer = _Tracer()
        inputs = {
            name: tracer.node("input", (), name, FLOAT if name == "score" else INT)
            for name in INPUTS
        }
        return tracer.graph(self._emit(tracer, inputs, ()), self._returns)

    def _emit(self, tracer, inputs, path):
        """Trace this mod's function with the symbolic ``inputs``; returns its result."""
        captured = {
            name: CapturedArray(
                tracer,
                path,
                name,
                f"{self.label}.{name}",
                a,
                self._kinds[name],
                self._bounds.get(name),
            )
            for name, a in self.arrays.items()
        }
        if self._q_row:
            captured["q_row"] = inputs["q_row"]
        head = (inputs["score"],) if self._returns == FLOAT else ()
        return self.fn(
            *head, inputs["b"], inputs["h"], inputs["q_idx"], inputs["kv_idx"], **captured
        )

    def _with_array(self, path: tuple[int, ...], field: str, value):
        """A copy of this mod in which the part at ``path`` (a slot's, :class:`Slot`) captures
        ``value`` as ``field``, retraced (the nn modules rebind a parameter loading replaced)."""
        new = copy.copy(self)
        new.arrays = {**new.arrays, field: value}
        new.graph = new._trace()
        return new

    def _apply(self, head, b, h, q_idx, kv_idx, q_row):
        """The function on concrete values (arrays or numbers)."""
        extra = dict(self.arrays)
        if self._q_row:
            extra["q_row"] = q_idx if q_row is None else q_row
        return self.fn(*head, b, h, q_idx, kv_idx, **extra)

    def _check(self, fn: str, call: CallShape) -> None:
        """Raise ValueError when this mod's arrays do not fit ``call`` (built-ins override)."""

    def validate(self, fn: str, call: CallShape, read_device: bool = False) -> frozenset:
        """ValueError unless the mod fits the call: its own checks, then every index in bounds.

        Returns the indices to clamp (see :meth:`Graph.check_indices`, which
        ``read_device`` is passed to).
        """
        self._check(fn, call)
        return self.graph.check_indices(fn, call.ranges(), call.describe(), read_device)

    def __repr__(self):
        return self.label


class MaskMod(_Mod):
    """A mask mod: ``fn(b, h, q_idx, kv_idx, **arrays) -> condition``, traced once.

    Parameters
    ----------
    fn : callable
        ``fn(b, h, q_idx, kv_idx, *, q_row=..., **arrays)``; returns True where
        the query may attend to the key. Written with Python operators and
        this module's helpers (see the module docstring).
    **arrays : array
        Arrays ``fn`` reads, passed to it by keyword (integer or bool arrays
        such as document ids).

    Notes
    -----
    Combine masks with ``a & b`` and ``a | b``. Calling a mask on concrete
    values (``mask(b, h, q_idx, kv_idx)``) runs ``fn`` directly on them.
    """

    _returns = BOOL

    def __call__(self, b, h, q_idx, kv_idx, *, q_row=None):
        return self._apply((), b, h, q_idx, kv_idx, q_row)

    def __and__(self, other):
        return AndMask(self, as_mask_mod(other, "MaskMod &: the other operand"))

    def __rand__(self, other):
        return AndMask(as_mask_mod(other, "MaskMod &: the other operand"), self)

    def __or__(self, other):
        return OrMask(self, as_mask_mod(other, "MaskMod |: the other operand"))

    def __ror__(self, other):
        return OrMask(as_mask_mod(other, "MaskMod |: the other operand"), self)

    def _band(self, positions, n_kv):
        """``(lo, hi, full_lo, full_hi)`` per query position.

        Every kept key lies in ``[lo, hi]``; every key in ``[full_lo, full_hi]``
        is kept. Non-band masks: every key possible, none sure.
        """
        zero = np.zeros_like(positions)
        return zero, zero + (n_kv - 1), zero + n_kv, zero - 1


class _Composition:
    """What ``&``, ``|`` and ``>>`` compositions share: their parts (nested compositions of the
    same kind flattened), no function or arrays of their own, and the parts' checks."""

    def __init__(self, *parts):
        flat = []
        for part in parts:
            flat.extend(part.parts if self._flattens(part) else (part,))
        self.parts = tuple(flat)
        self.fn = None
        self.arrays, self._kinds, self._bounds, self._q_row = {}, {}, {}, False
        self.graph = self._trace()

    def _flattens(self, part) -> bool:
        """Whether ``part`` is a composition whose parts join this one's."""
        return type(part) is type(self)

    def _with_array(self, path, field, value):
        """As :meth:`_Mod._with_array`, through the part ``path`` starts with."""
        new = copy.copy(self)
        parts = list(new.parts)
        parts[path[0]] = parts[path[0]]._with_array(path[1:], field, value)
        new.parts = tuple(parts)
        new.graph = new._trace()
        return new

    def _check(self, fn, call):
        for part in self.parts:
            part._check(fn, call)


class _CompositeMask(_Composition, MaskMod):
    _combine = staticmethod(logical_and)
    _symbol = "&"

    @property
    def label(self) -> str:
        return f" {self._symbol} ".join(
            f"({p.label})" if isinstance(p, _CompositeMask) else p.label for p in self.parts
        )

    def _emit(self, tracer, inputs, path):
        parts = (part._emit(tracer, inputs, path + (k,)) for k, part in enumerate(self.parts))
        return reduce(self._combine, parts)

    def __call__(self, b, h, q_idx, kv_idx, *, q_row=None):
        return reduce(
            self._combine, (part(b, h, q_idx, kv_idx, q_row=q_row) for part in self.parts)
        )

    def _band(self, positions, n_kv):
        return reduce(self._join, (p._band(positions, n_kv) for p in self.parts))


class AndMask(_CompositeMask):
    """``a & b``: keys every part keeps. Its band is the intersection of the parts' bands."""

    @staticmethod
    def _join(first, second):
        (lo, hi, flo, fhi), (lo2, hi2, flo2, fhi2) = first, second
        lo, hi = np.maximum(lo, lo2), np.minimum(hi, hi2)
        return lo, hi, np.maximum(flo, flo2), np.minimum(fhi, fhi2)


class OrMask(_CompositeMask):
    """``a | b``: keys any part keeps. Its band is the hull of the parts' possible keys and
    the union of their sure keys where that union is one interval (else the longer one)."""

    _combine = staticmethod(logical_or)
    _symbol = "|"

    @staticmethod
    def _join(first, second):
        (lo, hi, flo, fhi), (lo2, hi2, flo2, fhi2) = first, second
        empty1, empty2 = flo > fhi, flo2 > fhi2
        joined = ~empty1 & ~empty2 & (flo2 <= fhi + 1) & (flo <= fhi2 + 1)
        first_longer = (fhi - flo) >= (fhi2 - flo2)
        take_first = empty2 | (~empty1 & first_longer)
        flo = np.where(joined, np.minimum(flo, flo2), np.where(take_first, flo, flo2))
        fhi = np.where(joined, np.maximum(fhi, fhi2), np.where(take_first, fhi, fhi2))
        return np.minimum(lo, lo2), np.maximum(hi, hi2), flo, fhi


def _non_negative_int(owner, name, value) -> int:
    if isinstance(value, bool) or _scalar(value) is None or not isinstance(_scalar(value), int):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{owner}: {name} must be >= 0, got {value}")
    return int(value)


class FullMask(MaskMod):
    """Every key: ``True``."""

    def __init__(self):
        super().__init__(self._keep)

    @staticmethod
    def _keep(b, h, q_idx, kv_idx):
        return True

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, zero + (n_kv - 1), zero, zero + (n_kv - 1)


class CausalMask(MaskMod):
    """Keys at or before the query's position: ``kv_idx <= q_idx``."""

    def __init__(self):
        super().__init__(self._keep)

    @staticmethod
    def _keep(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, positions, zero, positions


class SlidingWindowMask(MaskMod):
    """The ``w`` keys before the query and the query itself: ``q_idx - w <= kv_idx <= q_idx``.

    Parameters
    ----------
    w : int
        Window length behind the query (``w = 0``: the query's own position only).
    """

    def __init__(self, w: int):
        self.w = _non_negative_int("SlidingWindowMask", "w", w)
        super().__init__(self._keep)

    def _keep(self, b, h, q_idx, kv_idx):
        return logical_and(q_idx - self.w <= kv_idx, kv_idx <= q_idx)

    def _band(self, positions, n_kv):
        return positions - self.w, positions, positions - self.w, positions

    @property
    def label(self):
        return f"SlidingWindowMask({self.w})"


class PrefixMask(MaskMod):
    """The first ``n`` keys, for every query: ``kv_idx < n``."""

    def __init__(self, n: int):
        self.n = _non_negative_int("PrefixMask", "n", n)
        super().__init__(self._keep)

    def _keep(self, b, h, q_idx, kv_idx):
        return kv_idx < self.n

    def _band(self, positions, n_kv):
        zero = np.zeros_like(positions)
        return zero, zero + (self.n - 1), zero, zero + (self.n - 1)

    @property
    def label(self):
        return f"PrefixMask({self.n})"


def prefix_lm(n: int) -> MaskMod:
    """Prefix-LM mask: the first ``n`` keys are visible to every query, the rest causally.

    ``CausalMask() | PrefixMask(n)``.
    """
    return CausalMask() | PrefixMask(n)


def _host_ids(a):
    """``a`` as a NumPy array when its values are on the host: a host array (NumPy,
    array_api_strict) or a plain PyTorch CPU tensor (:func:`~xpkernels._memory.torch_numpy_view`:
    subclasses -- fake or guarded tensors under tracing -- are not read); else None."""
    return np.asarray(_to_host(a)) if is_host_array(a) else torch_numpy_view(a)


class DocumentMask(MaskMod):
    """Queries attend only to keys of the same document: ``doc_q[q] == doc_kv[kv]``.

    Parameters
    ----------
    doc_q : integer array, ``(S,)`` or ``(B, S)``
        With ``doc_kv`` None: the document id of every POSITION, read at both
        ``q_idx`` and ``kv_idx`` (``S`` = Sk, and query positions must be < Sk).
        With ``doc_kv``: the document id of every query ROW of the call
        (``S`` = Sq).
    doc_kv : integer array, ``(Sk,)`` or ``(B, Sk)``, optional
        Document id of every key.

    ``(B, S)`` ids differ per batch; ``(S,)`` ids are shared. Over ``(S,)`` ids on
    the host (NumPy, or a PyTorch CPU tensor) without ``doc_kv`` the mask
    declares each query's key range (its document's positions), so tiles skip
    by it without a BlockMask.
    """

    def __init__(self, doc_q, doc_kv=None):
        arrays = {"doc_q": doc_q} if doc_kv is None else {"doc_q": doc_q, "doc_kv": doc_kv}
        for name, a in arrays.items():
            if _array_kind("DocumentMask", name, a) != INT or a.ndim not in (1, 2):
                raise TypeError(
                    f"DocumentMask: {name} must be an integer array of shape (S,) or (B, S), "
                    f"got dtype {a.dtype} shape {tuple(a.shape)}"
                )
        super().__init__(self._keep, **arrays)

    def _keep(self, b, h, q_idx, kv_idx, *, q_row, doc_q, doc_kv=None):
        def read(ids, i):
            return ids[b, i] if ids.ndim == 2 else ids[i]

        if doc_kv is None:
            return read(doc_q, q_idx) == read(doc_q, kv_idx)
        return read(doc_q, q_row) == read(doc_kv, kv_idx)

    def _band(self, positions, n_kv):
        """With one host id per position (``doc_kv`` None, ``(S,)`` ids that :func:`_host_ids`
        reads): every key from the first to the last position of the query's id, surely those
        of the query's own run of equal ids -- exact where each document's positions are
        contiguous. Otherwise (device or per-batch ids, ``doc_kv``, a position outside the
        ids) no band."""
        ids = _host_ids(self.arrays["doc_q"])
        unknown = super()._band(positions, n_kv)
        if "doc_kv" in self.arrays or ids is None or ids.ndim != 1 or n_kv == 0:
            return unknown
        n = ids.shape[0]
        new_run = np.concatenate(([True], ids[1:] != ids[:-1]))
        starts, run = np.flatnonzero(new_run), np.cumsum(new_run) - 1  # run of each position
        ends = np.concatenate((starts[1:], [n])) - 1
        _, which = np.unique(ids, return_inverse=True)
        first, last = np.full(n, n), np.full(n, -1)
        np.minimum.at(first, which, np.arange(n))
        np.maximum.at(last, which, np.arange(n))
        inside = (positions >= 0) & (positions < n)
        at = np.clip(positions, 0, n - 1)
        band = (first[which[at]], last[which[at]], starts[run[at]], ends[run[at]])
        return tuple(np.where(inside, x, u) for x, u in zip(band, unknown))

    def _check(self, fn, call):
        own = self.arrays.get("doc_kv") is None
        wanted = {"doc_q": call.n_kv if own else call.n_q, "doc_kv": call.n_kv}
        for name, a in self.arrays.items():
            shape = tuple(a.shape)
            if shape[-1] != wanted[name] or (len(shape) == 2 and shape[0] != call.batch):
                layout = f"({wanted[name]},) or ({call.batch}, {wanted[name]})"
                role = (
                    "one id per key position (doc_kv is None)"
                    if own
                    else ("one id per query row" if name == "doc_q" else "one id per key")
                )
                raise ValueError(
                    f"{fn}: DocumentMask.{name} must have shape {layout}, {role}; got {shape}"
                )
        q_idx = call.ranges()["q_idx"]
        if own and q_idx is not None and q_idx[1] >= call.n_kv:
            raise ValueError(
                f"{fn}: DocumentMask.doc_q holds ids for positions < {call.n_kv} but query "
                f"positions reach {q_idx[1]}; pass doc_kv (and per-row doc_q) for queries past "
                "the keys"
            )


class ScoreMod(_Mod):
    """A score mod: ``fn(score, b, h, q_idx, kv_idx, **arrays) -> number``, traced once.

    Parameters
    ----------
    fn : callable
        ``fn(score, b, h, q_idx, kv_idx, *, q_row=..., **arrays)``; returns
        the new score. Written with Python operators and this module's
        helpers.
    **arrays : array
        Arrays ``fn`` reads, passed to it by keyword. Every float array gets
        a gradient: ``grad_shadow(mod)`` allocates zeroed accumulators and
        the flex backward ADDS into them.

    Notes
    -----
    ``a >> b`` applies ``a`` then ``b``. Calling a score mod on concrete
    values runs ``fn`` directly on them.
    """

    _returns = FLOAT

    def __call__(self, score, b, h, q_idx, kv_idx, *, q_row=None):
        return self._apply((score,), b, h, q_idx, kv_idx, q_row)

    def __rshift__(self, other):
        return ScoreChain(self, as_score_mod(other, "ScoreMod >>: the other operand"))

    def __rrshift__(self, other):
        return ScoreChain(as_score_mod(other, "ScoreMod >>: the other operand"), self)

    def _grad_fields(self, feature_grads: bool) -> tuple[str, ...]:
        """Fields that receive gradients."""
        return tuple(name for name, kind in self._kinds.items() if kind == FLOAT)

    def _grad_tree(self, zeros, feature_grads) -> ScoreModGrad:
        names = self._grad_fields(feature_grads)
        return ScoreModGrad(
            self.label,
            {name: zeros(self.arrays[name]) for name in names},
            sources={name: self.arrays[name] for name in names},
        )

    def __grad_shadow__(self, *, feature_grads: bool = False) -> ScoreModGrad:
        """Zeroed accumulators for the mod's learnable arrays: float32 (float64 for float64).

        ``feature_grads=True`` also gives PairFeatureScore's q/k features gradients.
        """
        return self._grad_tree(_zeros_accumulator, bool(feature_grads))


def _zeros_accumulator(a):
    xp = array_api_compat.array_namespace(a)
    dtype = xp.float64 if a.dtype == xp.float64 else xp.float32
    return xp.zeros(tuple(a.shape), dtype=dtype, device=array_api_compat.device(a))


class ScoreChain(_Composition, ScoreMod):
    """``a >> b >> ...``: each score mod applied to the previous one's result."""

    def _flattens(self, part) -> bool:
        return isinstance(part, ScoreChain)

    @property
    def label(self):
        return " >> ".join(p.label for p in self.parts)

    def _emit(self, tracer, inputs, path):
        score = inputs["score"]
        for k, part in enumerate(self.parts):
            score = part._emit(
                tracer, {**inputs, "score": tracer.lift(score, "a score mod's result")}, path + (k,)
            )
        return score

    def __call__(self, score, b, h, q_idx, kv_idx, *, q_row=None):
        for part in self.parts:
            score = part(score, b, h, q_idx, kv_idx, q_row=q_row)
        return score

    def _grad_tree(self, zeros, feature_grads):
        return ScoreModGrad(
            self.label, parts=tuple(p._grad_tree(zeros, feature_grads) for p in self.parts)
        )


class ScoreModGrad:
    """Gradient accumulators of a score mod's captured arrays: ``grad_shadow(score_mod)``.

    Fields are reached by name (``g.slopes``, ``g.table``); the parts of a
    ``>>`` composition by position (``g[0].slopes``), or by name when only one
    part has it. The flex backward ADDS into every accumulator, so one
    ``grad_shadow`` holds one backward's gradients; :meth:`zero_` resets it
    for reuse.
    """

    def __init__(
        self, label: str, fields: dict | None = None, parts: tuple = (), sources: dict | None = None
    ):
        self._label = label
        self._fields = dict(fields or {})
        self._parts = tuple(parts)
        self._sources = dict(sources or {})

    def made_for(self, mod) -> bool:
        """True when these accumulators are ``grad_shadow`` of ``mod``: same mods, same arrays.

        A mod rebuilt over the same arrays (or fresh views of the same memory)
        matches; a mod with other arrays or of another kind does not.
        """
        if not isinstance(mod, ScoreMod) or self._label != mod.label:
            return False
        parts = mod.parts if isinstance(mod, ScoreChain) else ()
        if len(parts) != len(self._parts):
            return False
        if any(
            mod.arrays.get(name) is None or not same_memory(mod.arrays[name], a)
            for name, a in self._sources.items()
        ):
            return False
        return all(g.made_for(p) for g, p in zip(self._parts, parts))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._fields:
            return self._fields[name]
        found = [p for p in self._parts if name in dict(p.items())]
        if len(found) == 1:
            return getattr(found[0], name)
        if found:
            raise AttributeError(
                f"{self._label}: several parts have a gradient {name!r}; pick one with g[i].{name}"
            )
        raise AttributeError(
            f"{self._label} has no gradient {name!r} (it has {[n for n, _ in self.items()]})"
        )

    def __getitem__(self, i):
        return self._parts[i]

    def __len__(self):
        return len(self._parts)

    def items(self):
        """``(name, accumulator)`` for every field (``"i.name"`` inside compositions)."""
        out = list(self._fields.items())
        for k, part in enumerate(self._parts):
            out.extend((f"{k}.{name}", a) for name, a in part.items())
        return out

    def zero_(self) -> None:
        """Set every accumulator to zero (to reuse it for another backward)."""
        for _, a in self.items():
            a[...] = 0

    def lookup(self, path: tuple, field: str):
        """The accumulator of ``field`` of the part at ``path`` (None: no gradient)."""
        node = self
        for k in path:
            node = node._parts[k]
        return node._fields.get(field)

    def __repr__(self):
        fields = ", ".join(f"{n}{tuple(a.shape)}" for n, a in self.items())
        return f"ScoreModGrad({self._label}: {fields})"


class NoOpScore(ScoreMod):
    """The score unchanged."""

    def __init__(self):
        super().__init__(self._score)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx):
        return score


class SoftCapScore(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2 soft-capping); ``cap`` is a constant: no gradient."""

    def __init__(self, cap: float):
        value = _scalar(cap)
        if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"SoftCapScore: cap must be a finite number > 0, got {cap!r}")
        self.cap = float(value)
        super().__init__(self._score)

    def _score(self, score, b, h, q_idx, kv_idx):
        return self.cap * tanh(score / self.cap)

    @property
    def label(self):
        return f"SoftCapScore({self.cap:g})"


class AliBiScore(ScoreMod):
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``.

    Parameters
    ----------
    slopes : float array ``(H,)``
        One slope per query head; learnable (gradient in ``grad_shadow(mod).slopes``).
    """

    def __init__(self, slopes):
        _check_float_array("AliBiScore", "slopes", slopes, 1, "(H,)")
        super().__init__(self._score, slopes=slopes)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx, *, slopes):
        return score + slopes[h] * (kv_idx - q_idx)

    def _check(self, fn, call):
        shape = tuple(self.arrays["slopes"].shape)
        if shape != (call.heads,):
            raise ValueError(
                f"{fn}: AliBiScore.slopes must have shape ({call.heads},), one per query head; "
                f"got {shape}"
            )


class BiasScore(ScoreMod):
    """``score + bias[b, h, q_row, kv_idx]``, broadcast over a batch or head axis of length 1.

    Parameters
    ----------
    bias : float array ``(Bb, Hb, Sq, Sk)``
        ``Bb`` is 1 or B, ``Hb`` is 1 or H; row ``i`` is the call's query row
        (position ``input_pos + i``). Learnable (gradient in ``grad_shadow(mod).bias``).
    """

    def __init__(self, bias):
        _check_float_array("BiasScore", "bias", bias, 4, "(Bb, Hb, Sq, Sk)")
        super().__init__(self._score, bias=bias)

    @staticmethod
    def _score(score, b, h, q_idx, kv_idx, *, q_row, bias):
        return (
            score
            + bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0, q_row, kv_idx]
        )

    def _check(self, fn, call):
        shape = tuple(self.arrays["bias"].shape)
        if (
            shape[0] not in (1, call.batch)
            or shape[1] not in (1, call.heads)
            or shape[2:] != (call.n_q, call.n_kv)
        ):
            raise ValueError(
                f"{fn}: BiasScore.bias must have shape (Bb, Hb, {call.n_q}, {call.n_kv}) "
                f"with Bb in {{1, {call.batch}}} and Hb in {{1, {call.heads}}}; got {shape}"
            )


class PairFeatureScore(ScoreMod):
    """``score + sum_p pair_proj[h, p] * op(qv, kv)[p]`` from per-token features.

    The ``(Sq, Sk)`` bias is never materialised.

    Parameters
    ----------
    op : callable
        ``op(qv, kv) -> sequence of P values``, where ``qv`` is the tuple of
        the F features of the query row and ``kv`` those of the key; traced
        like any mod (e.g. ``lambda qv, kv: [abs(qv[0] - kv[0]), qv[1] * kv[1]]``).
    q_features : float array ``(B, Sq, F)``
    k_features : float array ``(B, Sk, F)``
    pair_proj : float array ``(H, P)``
        Per-head weights of the P pair features; learnable.

    ``grad_shadow(mod)`` holds ``pair_proj``'s gradient;
    ``grad_shadow(mod, feature_grads=True)`` adds the features' gradients.
    """

    def __init__(self, op, q_features, k_features, pair_proj):
        if not callable(op):
            raise TypeError(f"PairFeatureScore: op must be callable, got {type(op).__name__}")
        self.op = op
        _check_float_array("PairFeatureScore", "q_features", q_features, 3)
        _check_float_array("PairFeatureScore", "k_features", k_features, 3)
        _check_float_array("PairFeatureScore", "pair_proj", pair_proj, 2)
        if q_features.shape[2] != k_features.shape[2]:
            raise ValueError(
                f"PairFeatureScore: q_features and k_features must have the same feature count F, "
                f"got {q_features.shape[2]} and {k_features.shape[2]}"
            )
        super().__init__(
            self._score, q_features=q_features, k_features=k_features, pair_proj=pair_proj
        )

    def _score(self, score, b, h, q_idx, kv_idx, *, q_row, q_features, k_features, pair_proj):
        n_features = q_features.shape[2]
        qv = tuple(q_features[b, q_row, f] for f in range(n_features))
        kv = tuple(k_features[b, kv_idx, f] for f in range(n_features))
        pairs = self.op(qv, kv)
        pairs = tuple(pairs) if isinstance(pairs, (tuple, list)) else (pairs,)
        if len(pairs) != pair_proj.shape[1]:
            raise ValueError(
                f"PairFeatureScore: op returned {len(pairs)} pair features but pair_proj has "
                f"P = {pair_proj.shape[1]} columns"
            )
        for p, value in enumerate(pairs):
            score = score + pair_proj[h, p] * value
        return score

    def _grad_fields(self, feature_grads):
        return ("q_features", "k_features", "pair_proj") if feature_grads else ("pair_proj",)

    def _check(self, fn, call):
        n_features = self.arrays["q_features"].shape[2]
        n_pairs = self.arrays["pair_proj"].shape[1]
        for name, shape in (
            ("q_features", (call.batch, call.n_q, n_features)),
            ("k_features", (call.batch, call.n_kv, n_features)),
            ("pair_proj", (call.heads, n_pairs)),
        ):
            got = tuple(self.arrays[name].shape)
            if got != shape:
                raise ValueError(
                    f"{fn}: PairFeatureScore.{name} must have shape {shape}, got {got}"
                )


def _what(x) -> str:
    """``x`` described for a type error: a mod by its label and role, anything else by its type."""
    if isinstance(x, ScoreMod):
        return f"{x.label}, a score mod"
    if isinstance(x, MaskMod):
        return f"{x.label}, a mask mod"
    return type(x).__name__


def _as_mod(mod, cls, where: str, signature: str):
    """``mod`` itself when a ``cls``, a plain function traced into one, else TypeError."""
    if isinstance(mod, cls):
        return mod
    if isinstance(mod, _Mod) or not callable(mod):
        raise TypeError(
            f"{where} must be a {cls.__name__} or a function {signature}, got {_what(mod)}"
        )
    return cls(mod)


def as_mask_mod(mask, where: str = "as_mask_mod: mask") -> MaskMod:
    """``mask`` itself, or a plain function ``(b, h, q_idx, kv_idx)`` traced into a MaskMod.

    A plain function is traced on every call that receives it; build the
    MaskMod once to trace once. ``where`` (``"function: argument"``) starts
    the TypeError raised for anything else.
    """
    return _as_mod(mask, MaskMod, where, "(b, h, q_idx, kv_idx) -> condition")


def as_score_mod(score, where: str = "as_score_mod: score") -> ScoreMod:
    """``score`` itself, or a function ``(score, b, h, q_idx, kv_idx)`` traced into a ScoreMod.

    ``where`` (``"function: argument"``) starts the TypeError raised for anything else.
    """
    return _as_mod(score, ScoreMod, where, "(score, b, h, q_idx, kv_idx) -> number")
