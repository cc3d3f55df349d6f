"""The public functions of a primitive as its Signature declares them: their array parameters.

:func:`fronts` reads each primitive's :class:`~xpkernels.backends.protocol.Signature`
and the parameter lists of its public functions (``p``, ``p_``,
``p_backward``, ``p_backward_``) into :class:`Front` records: every array
parameter (a :class:`Param`, bare or Duplicated) with the arrays it holds
(:class:`Slot`: role, shape pattern, dtype rule, what it may alias). The
error generator (:mod:`.declared_errors`) builds its bad calls from them.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass

from xpkernels.backends.protocol import PRIMITIVES, ROWS, Arg

__all__ = [
    "CONTIGUOUS",
    "EXTENTS",
    "FREE",
    "Extra",
    "Front",
    "Param",
    "Slot",
    "axes",
    "capital",
    "fronts",
    "public",
]

#: The extent of each axis symbol in the generated calls (``R``: the rows of a ``... M`` array).
EXTENTS = {
    "B": 2,
    "H": 4,
    "Hkv": 2,
    "Sq": 3,
    "Sk": 5,
    "S": 3,
    "Smax": 5,
    "Tq": 5,
    "Tk": 7,
    "D": 8,
    "Dv": 6,
    "M": 8,
    "R": 3,
    "N": 2,
    "P": 1,
    "Pmax": 5,
    "R2": 2,
    "T": 3,
    "V": 5,
}
#: Symbols whose extent is free (any ``P >= 1`` partial rows, any number of splits or workspace).
FREE = ("P", "N")
#: Axes whose stride must be 1 (the row length, head dims, RoPE's pairs); other strides are free.
CONTIGUOUS = ("M", "D", "Dv", "R2")


@dataclass(frozen=True)
class Extra:
    """An array parameter of a public function that its Signature does not declare
    (merge's backward takes ``dlse_a``, ``dlse_b`` and ``dlse``).

    Attributes
    ----------
    like : str
        The declared array it is shaped like.
    written : bool
        The function writes it (else reads it).
    aliases : tuple of str
        For a written one: the parameters it may be the very same array as.
    """

    like: str
    written: bool
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Slot:
    """One array of a call, as messages label it.

    Attributes
    ----------
    label : str
        ``x``, ``X.primal``, ``checkpoints.rstd``, ``scratch.delta``...
    axes : tuple of str
        Its axis symbols (keys of :data:`EXTENTS`; ``B+1`` for prefix sums).
    role : str
        What the call does with it: reads it as an ``"input"`` of the
        primitive, an ``"output"`` (a backward reading the forward's result),
        a ``"cotangent"`` or a ``"state"`` (checkpoints); ``"written"``; or
        ``"unread"`` (a Duplicated's primal the backward does not read,
        checked for being an array of the call's namespace only). Checks that
        compare arrays take the first read one, in this order of roles, as
        the lead the others must match.
    dtype : str
        ``"float"``, ``"float32"`` (checkpoints, scratch), ``"int32"`` or ``"index"``.
    optional : bool
        None is a valid value.
    partners : tuple of str
        For a written slot: the labels it may be the very same array as.
    names : tuple of str
        The labels messages may give it (the in-place front's, for an
        allocating function's argument).
    """

    label: str
    axes: tuple[str, ...]
    role: str
    dtype: str = "float"
    optional: bool = False
    partners: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def written(self) -> bool:
        return self.role == "written"

    @property
    def read(self) -> bool:
        return self.role not in ("written", "unread")

    @property
    def floating(self) -> bool:
        return self.dtype in ("float", "float32")

    def shape(self, extents: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(extents["B"] + 1 if s == "B+1" else extents[s] for s in self.axes)


@dataclass(frozen=True)
class Param:
    """One parameter of a public function that takes arrays.

    ``kind`` is ``"array"`` (one slot), ``"duplicated"`` (its primal and
    shadow slots) or ``"checkpoints"`` / ``"scratch"`` (a NamedTuple of slots).
    """

    name: str
    kind: str
    slots: tuple[Slot, ...]
    keyword: bool
    optional: bool = False


@dataclass(frozen=True)
class Front:
    """A public function of a primitive, its array parameters in order.

    Attributes
    ----------
    primitive : str
        The primitive (a key of ``protocol.PRIMITIVES``).
    fn : str
        The function's name (``rms_norm_backward_``).
    params : tuple of Param
    inplace : bool
        An in-place function (its name ends in ``_``).
    """

    primitive: str
    fn: str
    params: tuple[Param, ...]
    inplace: bool

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(s for p in self.params for s in p.slots)

    @property
    def message_fn(self) -> str:
        """The function names its messages may start with: an allocating function's checks
        may come from its in-place form."""
        return re.escape(self.fn) if self.inplace else re.escape(self.fn) + "_?"


def axes(pattern: str) -> tuple[str, ...]:
    if pattern == ROWS:
        return ("R", "M")
    if pattern == "rows":
        return ("R",)
    return tuple(pattern.split())


def capital(name: str) -> str:
    """The Duplicated parameter of ``name``: ``x`` -> ``X``, ``o_a`` -> ``O_a``."""
    return name[0].upper() + name[1:]


def public(name: str):
    return getattr(importlib.import_module("xpkernels"), name, None)


def fronts(primitive: str, extra: Mapping[str, Extra] | None = None) -> list[Front]:
    """The public functions of ``primitive`` with their array parameters, from its Signature.

    Parameters
    ----------
    primitive : str
        A key of ``protocol.PRIMITIVES``.
    extra : mapping of str to Extra, optional
        Array parameters the Signature does not declare, by parameter name.

    Raises
    ------
    ValueError
        A required parameter that is neither declared nor in ``extra``: the
        generator must learn what it is.
    """
    extra = dict(extra or {})
    sig = PRIMITIVES[primitive].signature
    args: dict[str, Arg] = {a.name: a for a in (*sig.inputs, *sig.outputs)}
    outputs = {a.name for a in sig.outputs}
    backward_params = set()
    if (backward_ := public(f"{primitive}_backward_")) is not None:
        backward_params = set(inspect.signature(backward_).parameters)
    found = []
    for suffix in ("_", "", "_backward_", "_backward"):
        fn = f"{primitive}{suffix}"
        function = public(fn)
        if function is None:
            continue
        inplace, backward = suffix.endswith("_"), "backward" in suffix
        params = []
        for p in inspect.signature(function).parameters.values():
            param = _param(
                p, sig, args, outputs, extra, inplace, backward, backward_params, primitive
            )
            if param is not None:
                params.append(param)
        found.append(Front(primitive, fn, tuple(params), inplace))
    return found


def _param(
    p, sig, args, outputs, extra, inplace, backward, backward_params, primitive
) -> Param | None:
    """The :class:`Param` of parameter ``p`` of a public function, or None for an option."""
    keyword = p.kind is inspect.Parameter.KEYWORD_ONLY
    required = p.default is inspect.Parameter.empty
    name = p.name
    if name in ("checkpoints", "scratch"):
        declared = sig.checkpoints if name == "checkpoints" else sig.scratch
        takes = inplace and (name == "checkpoints" or backward or not sig.checkpoints)
        if not declared or not (takes or (name == "checkpoints" and required)):
            return None
        written = name == "scratch" or not backward
        slots = tuple(
            Slot(
                f"{name}.{a.name}",
                axes(a.shape),
                "written" if written and inplace else "state",
                "float32",
                optional=a.optional or a.name in PRIMITIVES[primitive].optional_scratch,
            )
            for a in declared
        )
        return Param(name, name, slots, keyword=True, optional=not required)
    if name in extra:
        e = extra[name]
        slot = Slot(
            name,
            axes(args[e.like].shape),
            "written" if e.written else "cotangent",
            optional=not required,
            partners=e.aliases,
            names=(name,),
        )
        return Param(name, "array", (slot,), keyword, optional=not required)
    dup = name[0].lower() + name[1:]
    if name[0].isupper() and dup in args:
        return _duplicated(name, args[dup], sig, outputs, keyword)
    if name in args or (name[0] == "d" and name[1:] in args):
        arg = args.get(name) or args[name[1:]]
        if name not in args:
            role = "cotangent"
        elif inplace and not backward and name in outputs:
            role = "written"
        else:
            role = "output" if name in outputs else "input"
        partners = arg.aliases if role == "written" else ()
        if inplace:
            names: tuple[str, ...] = (name,)
        elif name not in args:
            names = (name, f"{capital(arg.name)}.shadow")
        elif backward and capital(name) in backward_params:
            names = (name, f"{capital(name)}.primal", f"{capital(name)}.shadow")
        else:
            names = (name,)
        slot = Slot(
            name,
            axes(arg.shape),
            role,
            arg.dtype,
            optional=arg.optional,
            partners=partners,
            names=names,
        )
        return Param(name, "array", (slot,), keyword, optional=arg.optional)
    if required:
        raise ValueError(
            f"declared_errors: {primitive}'s parameter {name!r} is not in its Signature; "
            "describe it with an Extra"
        )
    return None


def _duplicated(name, arg: Arg, sig, outputs, keyword) -> Param:
    pattern = axes(arg.shape)
    if arg.name in outputs:
        role = "output"
        shadow = Slot(f"{name}.shadow", pattern, "cotangent")
    else:
        role = "input"
        # an input aliased to itself: its shadow may be its primal (the gradient over it)
        partners = tuple(
            f"{name}.primal" if o == arg.name else f"{capital(o)}.shadow" for o in arg.aliases
        )
        shadow = Slot(f"{name}.shadow", pattern, "written", partners=partners)
    primal = Slot(f"{name}.primal", pattern, role if arg.name in sig.reads else "unread", arg.dtype)
    return Param(name, "duplicated", (primal, shadow), keyword, optional=arg.optional)
