"""Error cases generated from the :class:`~xpkernels.backends.protocol.Signature` of a primitive.

Every primitive declares its arrays once (``backends/signatures.py``): shape
patterns over shared axis symbols, dtype rules, what each pass reads and
writes, what may alias what. :func:`declared_errors` turns that record, and
the parameter lists of the primitive's public functions, into the generic
bad calls the conformance suite runs on every target, so no spec writes them
by hand:

- for each array argument of each public function: ``None`` (where it is
  not optional), a Python list, a wrong rank; for the in-place functions
  also a wrong extent per axis symbol, an integer dtype for a float array, a
  float dtype for an integer one, float64 for a float32-only one
  (checkpoints, scratch), an array of another namespace, a last axis that is
  not contiguous (the ``M``, ``D``, ``Dv`` axes);
- for each Duplicated argument: ``None``, a list or a bare array in its
  place, a wrong rank or extent of both its arrays, and the cases above on
  its primal and its shadow; for required checkpoints, ``None``;
- for each array an in-place function writes (outputs, shadows,
  checkpoints, scratch): a view whose elements share memory (stride 0), a
  read-only array, the very memory of an input it may not alias, and a
  partial overlap with each input it may be the very same array as.

Each case expects the error class and a message naming the function and the
argument (``rms_norm_backward_: X.primal ...``); where a mismatch between
two arguments may be reported on either (the lead array, the first read one,
that fixes an extent, a dtype or the namespace), any of them is accepted.
Every case also checks that the refused call wrote nothing: each array it
could write is compared with its value before the call. The non-array and
overlap cases (with that check, the first three kinds of bad input of issue
34) run on every backend target, passing ``backend=target.backend``; the
others on the array_api targets.

A spec adds ``declared_errors(name, ...)`` to its hand-written cases, which
keep what a declaration cannot express: values, options, mods, records. The
public functions' parameters come from :mod:`.declared_fronts`.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from xpkernels import buffers
from xpkernels.backends.protocol import PRIMITIVES, ROWS

from .declared_fronts import (
    CONTIGUOUS,
    EXTENTS,
    FREE,
    Extra,
    Front,
    Param,
    Slot,
    axes,
    capital,
    fronts,
    public,
)
from .harness import ErrorCase, Target

__all__ = [
    "SENTINEL",
    "declared_errors",
    "fronts",
    "other_device",
    "prefix_sums",
    "valid_call",
]

#: What the arrays a call reads are filled with.
FILL = 0.5

#: What a written array is filled with before a call: a refused call must leave it so.
SENTINEL = 7.0


def _values(slot: Slot, extents, values) -> np.ndarray:
    """The valid host value of ``slot``: floats filled, integers from ``values`` (else ones)."""
    shape = slot.shape(extents)
    if slot.floating:
        return np.full(shape, SENTINEL if slot.written else FILL)
    make = values.get(slot.label)
    data = np.ones(shape) if make is None else make(extents)
    return np.asarray(data, dtype=np.int32 if slot.dtype == "int32" else np.int64)


def _on(target: Target, slot: Slot, host: np.ndarray):
    return target.asarray(host, "float32" if slot.floating else None)


@dataclass
class Call:
    """A call of a :class:`Front` being built: its arrays by label, then its arguments.

    ``arrays`` maps each slot's label to its value (replaced one at a time by
    the cases); ``whole`` replaces a whole Duplicated or NamedTuple parameter;
    ``extents`` are the call's (:data:`EXTENTS`, with the free ones, such as
    the splits of a decode scratch, as allocated).
    """

    front: Front
    target: Target
    arrays: dict[str, Any]
    tuples: dict[str, Any]
    whole: dict[str, Any]
    extents: dict[str, int]

    def arguments(self):
        """``(args, kwargs)`` of the call."""
        args, kwargs = [], {"backend": self.target.backend}
        for p in self.front.params:
            if p.name in self.whole:
                value = self.whole[p.name]
            elif p.kind == "duplicated":
                primal, shadow = (self.arrays[s.label] for s in p.slots)
                value = buffers.Duplicated(primal, shadow)
            elif p.kind in ("checkpoints", "scratch"):
                value = _replaced(self.tuples[p.name], p, self.arrays)
            else:
                value = self.arrays[p.slots[0].label]
            if p.keyword:
                kwargs[p.name] = value
            else:
                args.append(value)
        return args, kwargs

    def run(self) -> None:
        """Make the call; when it raises, first check that it wrote nothing."""
        args, kwargs = self.arguments()
        before = {label: _host(a) for label, a in self._written().items()}
        try:
            public(self.front.fn)(*args, **kwargs)
        except Exception:
            for label, a in self._written().items():
                after = _host(a)
                assert np.array_equal(after, before[label], equal_nan=True), (
                    f"{self.front.fn} raised but wrote {label} first"
                )
            raise

    def _written(self) -> dict:
        return {
            s.label: self.arrays[s.label]
            for s in self.front.slots
            if s.written and _is_array(self.arrays.get(s.label))
        }


def _host(a) -> np.ndarray:
    """A NumPy copy of the array ``a``, whatever its namespace."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy().copy()
    if hasattr(a, "get"):
        return a.get()
    return np.array(getattr(a, "_array", a))


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, np.generic)


def _replaced(tup, p: Param, arrays):
    """The NamedTuple ``tup`` with its fields from ``arrays`` (keeping its forward's record)."""
    fields = {s.label.split(".", 1)[1]: arrays[s.label] for s in p.slots}
    new = tup._replace(**fields)
    if hasattr(tup, "__dict__"):
        new.__dict__.update(tup.__dict__)
    return new


def _forward_inputs(primitive, target, arrays, extents, values) -> list:
    """The forward's inputs: the call's own arrays where it has them (a checkpoints record
    may keep integer arrays by identity), else new ones."""
    sig = PRIMITIVES[primitive].signature
    found = []
    for a in sig.inputs:
        given = arrays.get(a.name, arrays.get(f"{capital(a.name)}.primal"))
        slot = Slot(a.name, axes(a.shape), "input", a.dtype)
        found.append(
            given if _is_array(given) else _on(target, slot, _values(slot, extents, values))
        )
    return found


def _tuple(front: Front, p: Param, target: Target, arrays, tuples, extents, values):
    """A valid checkpoints or scratch NamedTuple for ``p`` (checkpoints of a backward written
    by a forward on the array_api backend: they are backend-neutral)."""
    primitive = front.primitive
    if p.kind == "checkpoints":
        forward_ = public(f"{primitive}_")
        inputs = _forward_inputs(primitive, target, arrays, extents, values)
        ck = buffers.allocate_checkpoints(forward_, *inputs)
        if front.inplace and not front.fn.endswith("backward_"):
            return ck
        sig = PRIMITIVES[primitive].signature
        outs = [
            _on(target, s, _values(s, extents, values))
            for s in (Slot(a.name, axes(a.shape), "written") for a in sig.outputs)
        ]
        forward_(*outs, *inputs, checkpoints=ck, backend="array_api")
        return ck
    args, kwargs = Call(front, target, arrays, tuples, {"scratch": None}, {}).arguments()
    kwargs.pop("scratch", None)
    return buffers.allocate_scratchspace(public(front.fn), *args, **kwargs)


def valid_call(front: Front, target: Target, values=None, extents=None) -> Call:
    """A call of ``front`` on ``target`` that succeeds: the base every case changes one thing of.

    ``values`` maps integer arrays to ``extents -> host values`` (default: ones).
    """
    values = values or {}
    extents = dict(extents or EXTENTS)
    arrays: dict[str, Any] = {
        s.label: _on(target, s, _values(s, extents, values))
        for p in front.params
        if p.kind not in ("checkpoints", "scratch")
        for s in p.slots
    }
    tuples: dict[str, Any] = {}
    for p in (p for p in front.params if p.kind in ("checkpoints", "scratch")):
        tup = _tuple(front, p, target, arrays, tuples, extents, values)
        tuples[p.name] = tup
        for s in p.slots:
            field = getattr(tup, s.label.split(".", 1)[1])
            if field is not None and s.written:
                field[...] = SENTINEL
            arrays[s.label] = field
            for axis, n in zip(s.axes, getattr(field, "shape", ())):
                if axis in FREE:
                    extents[axis] = n
    return Call(front, target, arrays, tuples, {}, extents)


# -- the cases ---------------------------------------------------------------------------------


def _names_regex(names) -> str:
    """Any of ``names`` as a whole label (``m`` does not match ``checkpoints.m`` or ``m_a``)."""
    alternatives = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    return rf"(?<![\w.])(?:{alternatives})(?!\w|\.\w)"


def _match(front: Front, names) -> str:
    return rf"{front.message_fn}: .*?{_names_regex(names)}"


def _other_namespace(target: Target, host: np.ndarray, dtype: str | None):
    """``host`` as an array of a namespace other than ``target``'s."""
    cast = host if dtype is None else host.astype(dtype)
    if target.namespace == "numpy" and importlib.util.find_spec("torch") is not None:
        import torch

        return torch.from_numpy(np.ascontiguousarray(cast).reshape(cast.shape))  # 0-d stays
    if target.namespace == "numpy":
        import array_api_strict

        return array_api_strict.asarray(cast)
    return np.array(cast)


def prefix_sums(symbol: str) -> Callable[[Mapping[str, int]], np.ndarray]:
    """Valid values of a ``B+1`` prefix-sum array: the ``symbol`` packed tokens split as evenly
    as they go into the ``B`` sequences (for ``declared_errors(values=...)``)."""

    def make(extents: Mapping[str, int]) -> np.ndarray:
        return np.linspace(0, extents[symbol], extents["B"] + 1).astype(np.int64)

    return make


def other_device(target: Target, shape: tuple[int, ...]):
    """A float32 array of ones on a device other than ``target``'s (torch: meta;
    array_api_strict: its second device); skips where the namespace has one device here."""
    if target.namespace == "torch":
        import torch

        return torch.ones(shape, device="meta")
    if target.namespace == "array_api_strict":
        import array_api_strict

        device = array_api_strict.Device("device1")
        return array_api_strict.ones(shape, dtype=array_api_strict.float32, device=device)
    import pytest

    pytest.skip(f"{target.namespace} has a single device here")


def _self_overlapping(target: Target, slot: Slot, extents):
    """A writable ``slot``-shaped array whose first axis longer than 1 has stride 0."""
    shape = slot.shape(extents)
    axis = next(i for i, n in enumerate(shape) if n > 1)
    base = target.full(shape[:axis] + (1,) + shape[axis + 1 :], SENTINEL, "float32")
    raw = getattr(base, "_array", base)
    strides = list(base.stride() if target.namespace == "torch" else raw.strides)
    strides[axis] = 0
    if target.namespace == "torch":
        return base.as_strided(shape, strides)
    if target.namespace == "cupy":
        import cupy

        return cupy.lib.stride_tricks.as_strided(base, shape, strides)
    view = np.lib.stride_tricks.as_strided(raw, shape, strides)
    return type(base)._new(view, device=base.device) if raw is not base else view


def _read_only(target: Target, slot: Slot, extents):
    if target.namespace not in ("numpy", "array_api_strict"):
        import pytest

        pytest.skip(f"{target.namespace} arrays cannot be read-only")
    a = target.full(slot.shape(extents), SENTINEL, "float32")
    getattr(a, "_array", a).flags.writeable = False
    return a


def _sharing(target: Target, shapes, offsets, fills):
    """Arrays of ``shapes`` over one float32 buffer, starting ``offsets`` elements into it."""
    sizes = [math.prod(s) for s in shapes]
    end = max(o + n for o, n in zip(offsets, sizes))
    buffer = target.full((end,), FILL, "float32")
    xp = target.xp
    views = [xp.reshape(buffer[o : o + n], s) for s, o, n in zip(shapes, offsets, sizes)]
    for view, fill in zip(views, fills):
        view[...] = fill
    return views


@dataclass(frozen=True)
class _Change:
    """One change to a valid call, and the error it must raise: its class, the labels the
    message may name, whether it runs on every backend target, and the slot it changes ("":
    a whole parameter, or a Duplicated's two arrays together)."""

    what: str
    apply: Callable[[Call, Target, Mapping[str, int], Mapping], None]
    error: type
    names: tuple[str, ...]
    every_backend: bool
    label: str = ""


def _setting(slot: Slot, what: str, make, error=TypeError, names=None, every_backend=False):
    """A change that replaces ``slot``'s array by ``make(call, target, extents, values)``; the
    message may name ``names`` (default: the slot's own names)."""

    def apply(call, target, extents, values):
        call.arrays[slot.label] = make(call, target, extents, values)

    return _Change(what, apply, error, names or slot.names or (slot.label,), every_backend)


_ROLES = ("input", "output", "cotangent", "state", "written")


def _checked(front: Front) -> list[Slot]:
    """The slots a front checks against each other, leads first (see :attr:`Slot.role`)."""
    slots = [s for s in front.slots if s.role in _ROLES]
    return sorted(slots, key=lambda s: _ROLES.index(s.role))


def _slot_changes(front: Front, slot: Slot, dup: bool) -> list[_Change]:
    """The changes of one array slot (``dup``: a field of a Duplicated)."""
    slots = _checked(front)
    changes = []

    def as_list(call, target, extents, values):
        return target.to_numpy(call.arrays[slot.label]).tolist()

    if not slot.optional and not (dup and slot.label.endswith(".shadow")):
        changes.append(_setting(slot, "none", lambda *_: None, every_backend=True))
    changes.append(_setting(slot, "list", as_list, every_backend=True))
    if not dup:
        changes.append(_rank_change(slot, (slot,), slots))
    if not front.inplace:
        return [replace(c, label=slot.label) for c in changes]
    if not dup:
        changes += _extent_changes(slot, (slot,), slots)
    if not slot.read and not slot.written:
        changes.append(_namespace_change(slot, slots))
        return [replace(c, label=slot.label) for c in changes]

    def filled(what, value, dtype, names=None) -> _Change:
        return _setting(
            slot, what, lambda c, t, e, v: t.full(slot.shape(e), value, dtype), names=names
        )

    if slot.floating:
        leads = _lead_names(slot, slots, lambda s: s.floating)
        changes.append(filled("integer-dtype", 1, "int32", leads))
    else:
        changes.append(filled("float-dtype", 1.0, "float32"))
    if slot.dtype == "int32":
        wide = _setting(
            slot, "int64", lambda c, t, e, v: t.asarray(_values(slot, e, v).astype(np.int64))
        )
        changes.append(wide)
    if slot.dtype == "float32":
        changes.append(filled("float64", FILL, "float64"))
    changes.append(_namespace_change(slot, slots))
    if slot.axes and slot.axes[-1] in CONTIGUOUS:

        def strided(call, target, extents, values):
            shape = slot.shape(extents)
            fill = SENTINEL if slot.written else FILL
            return target.full((*shape[:-1], 2 * shape[-1]), fill, "float32")[..., ::2]

        changes.append(_setting(slot, "last-axis-strided", strided, ValueError))
    if slot.written:
        changes += _written_changes(slot, slots)
    return [replace(c, label=slot.label) for c in changes]


def _lead_names(slot: Slot, slots, related) -> tuple[str, ...]:
    """``slot``'s names, and those of every ``related`` slot when ``slot`` comes first among
    them (the lead whose dtype or namespace the front compares the others with)."""
    names = slot.names or (slot.label,)
    peers = [s for s in slots if related(s)]
    if peers and peers[0] is slot:
        names += _names(peers)
    return names


def _namespace_change(slot: Slot, slots) -> _Change:
    def other(call, target, extents, values):
        host = _values(slot, extents, values)
        return _other_namespace(target, host, "float32" if slot.floating else None)

    return _setting(slot, "other-namespace", other, names=_lead_names(slot, slots, lambda s: True))


def _carriers(slots, symbol) -> list[Slot]:
    """The slots an extent of ``symbol`` shows in: its axes, or the values of integer arrays."""
    return [
        s
        for s in slots
        if symbol in s.axes or (symbol == "B" and "B+1" in s.axes) or not s.floating
    ]


def _names(slots) -> tuple[str, ...]:
    return tuple(n for s in slots for n in (s.names or (s.label,)))


def _group_names(group, slots, symbols) -> tuple[str, ...]:
    """The names of ``group``, and of every slot an extent of one of ``symbols`` shows in when
    an array of ``group`` is the first of them (the lead the front compares the others with)."""
    names = _names(group)
    for sym in symbols:
        carriers = _carriers(slots, "B" if sym == "B+1" else sym)
        if carriers and carriers[0] in group:
            names += _names(carriers)
    return names


def _extent_changes(slot: Slot, group, slots) -> list[_Change]:
    """A wrong extent of each axis symbol of ``slot`` (applied to every array of ``group``;
    integer arrays get values for it: prefix sums of ``B + 1`` sequences)."""
    changes = []
    symbols = dict.fromkeys("B" if a == "B+1" else a for a in slot.axes if a not in FREE)
    for sym in symbols:

        def apply(call, target, extents, values, sym=sym):
            wrong = {**extents, sym: extents[sym] + 1}
            for s in group:
                call.arrays[s.label] = _on(target, s, _values(s, wrong, values))

        names = _group_names(group, slots, (sym,))
        changes.append(_Change(f"extent-{sym}", apply, ValueError, names, False))
    return changes


def _rank_change(slot: Slot, group, slots) -> _Change:
    """``slot`` (every array of ``group``) without its first axis; a ``... M`` one (any rank
    >= 1 is valid) as rank 0."""

    def apply(call, target, extents, values):
        for s in group:
            host = _values(s, extents, values)
            rows = s.axes == axes(ROWS)
            if rows:
                host = host.reshape(-1)[0, ...]
            else:
                host = host[0] if host.ndim else host[None]  # a scalar gets an axis
            call.arrays[s.label] = _on(target, s, host)

    return _Change("rank", apply, ValueError, _group_names(group, slots, slot.axes), False)


def _written_changes(slot: Slot, slots) -> list[_Change]:
    def refused(what, make) -> _Change:
        return _setting(slot, what, make, ValueError, (slot.label,), every_backend=True)

    overlapping = refused("self-overlapping", lambda c, t, e, v: _self_overlapping(t, slot, e))
    changes = [overlapping] if slot.axes else []  # a scalar has one element
    changes.append(refused("read-only", lambda c, t, e, v: _read_only(t, slot, e)))
    reads = [s for s in slots if s.read and s.floating]
    others = [s for s in reads if s.label not in slot.partners]
    if others:
        elsewhere = {p for s in slots if s.written for p in s.partners}
        partner = sorted(others, key=lambda s: (s.label not in elsewhere, s.axes != slot.axes))[0]
        changes.append(_overlap(slot, partner, offset=0, what=f"is-{partner.label}"))
    for label in slot.partners:
        partner = next(s for s in slots if s.label == label)
        changes.append(_overlap(slot, partner, offset=1, what=f"overlaps-{label}-partly"))
    return changes


def _overlap(slot: Slot, partner: Slot, offset: int, what: str) -> _Change:
    """``slot`` over the memory of ``partner`` (the very same elements when ``offset`` is 0
    and the shapes agree; else starting ``offset`` elements before them)."""

    def apply(call, target, extents, values):
        written, read = _sharing(
            target,
            [slot.shape(extents), partner.shape(extents)],
            [0, offset],
            [SENTINEL, FILL],
        )
        if offset == 0 and slot.axes == partner.axes:
            written = read
        call.arrays[slot.label], call.arrays[partner.label] = written, read

    return _Change(what, apply, ValueError, (slot.label,), True)


def _param_changes(front: Front, p: Param) -> list[_Change]:
    def whole(what, value, error=TypeError) -> _Change:
        """A change that passes ``value(call)`` for the whole parameter."""

        def apply(call, target, extents, values):
            call.whole[p.name] = value(call)

        return _Change(what, apply, error, (p.name,), True)

    if p.kind == "array":
        return _slot_changes(front, p.slots[0], dup=False)
    if p.kind in ("checkpoints", "scratch"):
        changes = [c for s in p.slots for c in _slot_changes(front, s, dup=False)]
        if not p.optional:
            changes.append(whole("none", lambda c: None, ValueError))
        return changes
    first, slots = p.slots[0], _checked(front)
    changes = []
    if not p.optional:
        changes.append(whole("none", lambda c: None))
        changes.append(whole("bare-array", lambda c: c.arrays[first.label]))
    changes.append(whole("list", lambda c: c.target.to_numpy(c.arrays[first.label]).tolist()))
    changes.append(_rank_change(first, p.slots, slots))
    changes += _extent_changes(first, p.slots, slots)
    for s in p.slots:
        changes += _slot_changes(front, s, dup=True)
    return changes


def declared_errors(
    primitive: str,
    *,
    extra: Mapping[str, Extra] | None = None,
    values: Mapping[str, Callable[[Mapping[str, int]], Any]] | None = None,
) -> list[ErrorCase]:
    """The generic error cases of ``primitive``'s public functions (module docstring).

    Parameters
    ----------
    primitive : str
        A key of ``protocol.PRIMITIVES``.
    extra : mapping of str to Extra, optional
        Array parameters its Signature does not declare.
    values : mapping of str to callable, optional
        Valid host values of integer arrays, by argument name, from the
        extents (``cu_seqlens_q``: prefix sums ending at ``Tq``); default ones.

    Returns
    -------
    list of ErrorCase
        Ids ``<function>-<label>-<change>``; ``every_backend`` set on the
        non-array and overlap cases (module docstring).
    """
    values = dict(values or {})
    cases = []
    for front in fronts(primitive, extra):
        for p in front.params:
            for change in _param_changes(front, p):
                cases.append(
                    ErrorCase(
                        f"{front.fn}-{change.label or p.name}-{change.what}",
                        _caller(front, change, values),
                        change.error,
                        _match(front, change.names),
                        every_backend=change.every_backend,
                    )
                )
    return cases


def _caller(front: Front, change: _Change, values) -> Callable[[Target], None]:
    def call(target: Target) -> None:
        built = valid_call(front, target, values)
        if change.label and built.arrays[change.label] is None:
            import pytest

            pytest.skip(f"{front.fn} on {target.backend} uses no {change.label}")
        change.apply(built, target, built.extents, values)
        built.run()

    return call
