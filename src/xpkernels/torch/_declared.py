"""The ``xpkernels`` torch.library ops of every primitive, generated from its declared signature.

For each primitive ``p`` of ``protocol.PRIMITIVES``, four ops are defined
from ``PRIMITIVES[p].signature`` alone:

- ``xpkernels::p_`` -- the out variant: writes the outputs and, when given,
  the checkpoints (exactly what ``mutates_args`` names), returns nothing;
- ``xpkernels::p`` -- the functional forward: returns the outputs AND the
  checkpoints, so autograd saves them for the backward instead of
  recomputing anything; its autograd formula calls
- ``xpkernels::p_backward`` -- the functional backward: returns the
  gradients of the inputs that take one (and of the score mod's captured
  arrays), and
- ``xpkernels::p_backward_`` -- its out variant, overwriting gradient
  buffers (and scratch) the caller passes.

Every op's parameters come in one order: its tensors -- cotangents
(``d<output>``), the arrays (outputs and inputs; in a backward, the primals
it reads, then the inputs it does not read but needs: optional ones, integer
ones), the tensors of the options, checkpoints, gradients, scratch -- then
its scalars: the options in their declared order, one ``need_d<input>`` flag
per optional input of a functional backward (an unwanted gradient is
returned empty), and last ``backend``. Each option rule maps once, in
:data:`RULES`, to its parameters, the check of a front's value and the
keyword the in-place front takes back (``input_pos`` travels as
``input_pos: int`` and ``input_pos_array: Tensor | None``; a mod as the
integer key it is filed under, the score mod's captured float arrays beside
it as ``score_arrays``, which receive gradients).

Each op's schema is inferred by ``torch.library`` from a generated Python
signature; each has a fake (shapes and dtypes only, from the declared shape
patterns). Implementations call the in-place fronts (``p_``,
``p_backward_``) under ``torch.no_grad()`` with autocast off, so all their
validation applies, no backend records autograd through its own arithmetic
and none has it rounded by autocast. The
functional forward's autograd formula saves what the backward reads and
the checkpoints (marked non-differentiable) and calls ``p_backward`` on the
forward's backend; a backward run with ``create_graph=True`` returns
gradients whose own backward raises "double backward is not supported".
The functional ops have ``torch.library.triton_op`` twins
(:func:`xpkernels.torch._triton.functional_op`) unless a mod option makes
them opaque. A forward-only primitive (one whose backward reads nothing:
decode attention) gets ``p``, ``p_`` and a ``p_backward`` that raises; the
merge of attention states runs its backward through
:func:`xpkernels.torch._ops.merge_backward_`.

:data:`FRONTS` holds the autograd fronts :func:`xpkernels._autograd.record`
hands allocating calls on tensors that need gradients to.
"""

from __future__ import annotations

import importlib
import inspect
import math
import operator
from typing import Any

import torch
from torch import Tensor

from xpkernels.backends.protocol import GELU_APPROXIMATIONS, PRIMITIVES, REDUCTIONS, Arg, Option

from .. import _checks as check
from .._autograd import NO_BACKWARD, needs_grad
from ..buffers import Duplicated, allocate_checkpoints, primal
from ..mods import as_mask_mod, as_score_mod
from ..registry import _explicit_choice
from . import _flex
from ._ops import (
    _last_axis_contiguous,
    _name,
    _no_double_backward,
    _written,
    merge_backward_,
    merge_setup,
)
from ._triton import functional_op

__all__ = ["FRONTS", "OPS", "RULES", "Rule"]

_Param = inspect.Parameter

#: The score mod's captured float arrays: a tensor-list parameter of the flex ops.
SCORE_ARRAYS = "score_arrays"


def backend_choice(options) -> str | None:
    """The explicit backend choice in force for this call (keyword, use_backend, env), or None.

    Under ``torch.compile`` the choice in force when the graph is traced is
    baked into it (a context variable cannot be read inside a graph).
    """
    if torch.compiler.is_compiling():
        from . import _front_args

        return _front_args.backend_choice(options["backend"])
    return _explicit_choice(options["backend"])[0]


# -- option rules ---------------------------------------------------------------------------


def _traced_float(value) -> bool:
    """A float (maybe symbolic) of a call ``torch.compile`` is tracing."""
    return isinstance(value, (float, torch.SymFloat)) and torch.compiler.is_compiling()


class Rule:
    """How the options of one declared rule travel through the ops.

    Parameters
    ----------
    annotation : type
        The schema type of its one parameter, named after the option.
    validate : callable, optional
        ``(fn, name, value) -> value``: a front's value checked and made of
        the schema's type (a schema types its arguments but cannot name the
        call's argument that was wrong). None passes the value on.

    Attributes
    ----------
    twin : bool
        Ops taking it may have a ``triton_op`` twin.
    grad_of : str or None
        A backward-only rule that yields the gradients of this tensor-list
        parameter (the ops return them, the out variant overwrites them).
    """

    twin = True
    grad_of: str | None = None

    def __init__(self, annotation: Any = None, validate=None):
        self.annotation = annotation
        self.validate = validate

    def params(self, name: str) -> list:
        """The schema parameters ``(name, annotation)`` the option ``name`` takes."""
        return [(name, self.annotation)]

    def encode(self, fn: str, name: str, value, held: list) -> tuple:
        """A front's value as the values of :meth:`params`; ``held`` gets what the call must keep alive.

        While ``torch.compile`` traces, a float may be symbolic (``dynamic=True``, or a float
        argument that changed between calls; Dynamo may make it so only when a check reads it),
        with no value to check yet: it goes to the op as it is, and the op's implementation,
        which calls the in-place front, checks its value at run time.
        """
        if self.validate is None or _traced_float(value):
            return (value,)
        return (self.validate(fn, name, value),)

    def decode(self, name: str, values: dict, kwargs: dict):
        """Set the in-place front's keyword ``name`` in ``kwargs`` from the op's ``values``.

        Returns the gradients it yields (see :attr:`grad_of`), or None.
        """
        kwargs[name] = values[name]

    def held(self, name: str, values: dict) -> list:
        """What the autograd graph of a call keeps alive for the option (its filed mods)."""
        return []


class _Position(Rule):
    """An int, or a ``(B,)`` integer array: ``name: int`` and ``name_array: Tensor | None``."""

    def params(self, name):
        return [(name, int), (f"{name}_array", Tensor | None)]

    def encode(self, fn, name, value, held):
        if isinstance(value, Tensor):
            return 0, value
        what = f"{fn}: {name} must be an int or a (B,) integer array, got"
        if isinstance(value, bool):
            raise TypeError(f"{what} a bool")
        if isinstance(value, (int, torch.SymInt)):
            # As it is: under torch.compile, operator.index would specialise a symbolic
            # position into a constant of the graph, one recompile per value.
            return value, None
        try:
            return operator.index(value), None
        except TypeError:
            raise TypeError(f"{what} {type(value).__name__}") from None

    def decode(self, name, values, kwargs):
        array = values[f"{name}_array"]
        kwargs[name] = values[name] if array is None else array


class _Mod(Rule):
    """A mod or block mask: the integer key it is filed under (:mod:`xpkernels.torch._flex`)."""

    twin = False

    def __init__(self, convert):
        super().__init__(int | None)
        self.convert = convert

    def _key(self, value, held):
        if torch.compiler.is_compiling():
            from . import _front_args

            return _front_args.file_key(self.convert, value), None
        obj = self.convert(value)
        held.append(obj)
        return _flex.file(obj), obj

    def encode(self, fn, name, value, held):
        return (None if value is None else self._key(value, held)[0],)

    def decode(self, name, values, kwargs):
        key = values[name]
        kwargs[name] = None if key is None else _flex.filed(key)

    def held(self, name, values):
        key = values[name]
        return [] if key is None else [_flex.filed(key)]


class _ScoreMod(_Mod):
    """A score mod: its key, and its captured float arrays as ``score_arrays``."""

    def params(self, name):
        return [(name, int | None), (SCORE_ARRAYS, list[Tensor])]

    def encode(self, fn, name, value, held):
        if value is None:
            return None, []
        key, obj = self._key(value, held)
        return key, _flex.score_arrays(value if obj is None else obj)

    def decode(self, name, values, kwargs):
        key = values[name]
        kwargs[name] = None if key is None else _flex.bound(_flex.filed(key), values[SCORE_ARRAYS])


class _ScoreModGrad(Rule):
    """``<mod>_grad``: the gradients of ``<mod>``'s captured arrays, accumulated by the backward."""

    grad_of = SCORE_ARRAYS

    def params(self, name):
        return []

    def encode(self, fn, name, value, held):
        return ()

    def decode(self, name, values, kwargs):
        mod = kwargs[name.removesuffix("_grad")]
        if mod is None or not values[SCORE_ARRAYS]:
            kwargs[name] = None
            return []
        kwargs[name], grads = _flex.score_grads(mod)
        return grads


def _or_none(rule):
    def checked(fn, name, value):
        return None if value is None else rule(fn, name, value)

    return checked


def _itself(value):
    return value


#: Option rule (``protocol.Option.rule``) -> how its options travel through the ops.
RULES: dict[str, Rule] = {
    "positive_finite": Rule(float, check.positive_finite),
    "finite": Rule(float, check.finite),
    "gelu_approximate": Rule(
        str, lambda fn, name, v: check.one_of(fn, name, v, GELU_APPROXIMATIONS)
    ),
    "bool": Rule(bool, check.boolean),
    "int": Rule(int, check.index_int),
    "probability": Rule(float, check.unit_interval),
    "non_negative": Rule(float, check.non_negative),
    "positive_or_none": Rule(float | None, _or_none(check.positive_finite)),
    "reduction": Rule(str, lambda fn, name, v: check.one_of(fn, name, v, REDUCTIONS)),
    "scale": Rule(float | None, _or_none(check.positive_finite)),
    "position": _Position(),
    "lengths": Rule(Tensor | None),
    "int_or_none": Rule(int | None, _or_none(check.index_int)),
    "float_or_none": Rule(float | None, _or_none(check.finite)),
    "page_table": Rule(Tensor | None),
    "score_mod": _ScoreMod(as_score_mod),
    "mask_mod": _Mod(as_mask_mod),
    "block_mask": _Mod(_itself),
    "score_mod_grad": _ScoreModGrad(),
}


# -- shapes ---------------------------------------------------------------------------------


def _is_tensor(annotation) -> bool:
    return annotation in (Tensor, Tensor | None, list[Tensor])


def _bind(dims: dict, pattern: str, shape) -> None:
    """Bind the symbols of a shape pattern to ``shape``'s extents (the first binding wins)."""
    symbols = pattern.split()
    if symbols[0] == "...":
        lead = tuple(shape[: len(shape) - len(symbols) + 1])
        dims.setdefault("...", lead)
        dims.setdefault("rows", math.prod(lead))
        symbols, shape = symbols[1:], shape[len(lead) :]
    for symbol, n in zip(symbols, shape):
        if symbol.endswith("+1"):
            dims.setdefault(symbol[:-2], n - 1)
        else:
            dims.setdefault(symbol, n)


def _shape(dims: dict, pattern: str) -> tuple:
    shape: list = []
    for symbol in pattern.split():
        shape.extend(dims["..."] if symbol == "..." else (dims[symbol],))
    return tuple(shape)


def _probe(pattern: str) -> Tensor:
    """A meta tensor with every extent of ``pattern`` 1 (no data)."""
    return torch.empty(tuple(1 for s in pattern.split() if s != "..."), device="meta")


def _signed(fn, params: list, returns):
    """``fn`` (which takes ``*args``) under the signature torch.library infers a schema from."""

    def call(*args):
        return fn(*args)

    call.__doc__ = fn.__doc__
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [_Param(n, _Param.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in params],
        return_annotation=returns,
    )
    return call


def _returns(annotations: list):
    return annotations[0] if len(annotations) == 1 else tuple[tuple(annotations)]  # type: ignore[misc]


def _one(results: list):
    return results[0] if len(results) == 1 else tuple(results)


def _flatten(values: list) -> tuple[list, list]:
    """Tensors (and None) in one list, lists spliced in; the layout :func:`_unflatten` undoes."""
    flat: list = []
    layout: list[int | None] = []
    for v in values:
        if isinstance(v, list):
            flat.extend(v)
            layout.append(len(v))
        else:
            flat.append(v)
            layout.append(None)
    return flat, layout


def _unflatten(flat, layout: list) -> list:
    out, k = [], 0
    for n in layout:
        if n is None:
            out.append(flat[k])
            k += 1
        else:
            out.append(list(flat[k : k + n]))
            k += n
    return out


def _nothing(*args) -> None:
    """The fake of an out-variant op: it returns nothing."""


def _names(params: list) -> list[str]:
    return [n for n, _ in params]


_BACKEND = ("backend", str | None)


# -- the ops of one primitive ----------------------------------------------------------------


class _Ops:
    """The ops of one declared primitive, their autograd formula and its autograd front.

    Parameters
    ----------
    name : str
        The primitive (a key of ``protocol.PRIMITIVES``).
    module : module
        Its front module ``xpkernels.<name>``: the in-place functions the ops
        call, and its scratch NamedTuple ``<Title>BackwardScratch``
        (``<Title>Scratch`` for a forward-only primitive). Its checkpoints
        NamedTuple is the type ``allocate_checkpoints(<name>_, ...)`` returns.

    Attributes
    ----------
    ops : list
        The ops defined, as ``torch.library`` custom ops.
    functional, backward
        The functional forward and backward ops.
    Checkpoints, Scratch : type or None
        The front's checkpoints and scratch NamedTuples (None without them).
    """

    Checkpoints: Any
    Scratch: Any
    backward_: Any

    def __init__(self, name: str, module):
        self.name = name
        self.sig = sig = PRIMITIVES[name].signature
        self.forward_only = not sig.reads
        self.forward_name = f"{name}_"
        self.forward_ = getattr(module, self.forward_name)
        self.backward_ = getattr(module, f"{name}_backward_", None)
        self.lead: Arg = sig.inputs[0]
        self.inputs = [a.name for a in sig.inputs]
        self.outputs = [a.name for a in sig.outputs]
        self.checkpoints = [c.name for c in sig.checkpoints]
        self.scratch = [s.name for s in sig.scratch]
        self.optional = {a.name for a in sig.inputs if a.optional}
        self.graded = [a.name for a in sig.inputs if a.grad]
        self.flagged = [n for n in self.graded if n in self.optional]
        self.cotangents = [f"d{o}" for o in self.outputs]
        self.reads = list(sig.reads)
        self.unread = [
            a.name
            for a in sig.inputs
            if a.name not in sig.reads and (a.optional or not a.grad) and not self.forward_only
        ]
        self.forward_options = [o for o in sig.options if o.forward]
        self.backward_options = [o for o in sig.options if o.backward]
        self.grad_lists = [
            RULES[o.rule].grad_of for o in self.backward_options if RULES[o.rule].grad_of
        ]
        self.backward_defaults: dict[str, Any] = {}
        for o in self.backward_options:
            if not o.forward:
                rule = RULES[o.rule]
                encoded = rule.encode(name, o.name, o.default, [])
                self.backward_defaults.update(zip(_names(rule.params(o.name)), encoded))
        self.pattern = {a.name: a.shape for a in (*sig.inputs, *sig.outputs)}
        self.pattern.update({f"d{a.name}": a.shape for a in sig.outputs})
        self.Checkpoints = None
        if sig.checkpoints:
            probe = allocate_checkpoints(self.forward_, _probe(self.lead.shape))
            self.Checkpoints = type(probe)
        self.Scratch = None
        if sig.scratch:
            stage = "" if self.forward_only else "Backward"
            self.Scratch = getattr(module, f"{sig.title}{stage}Scratch")
        self._define()

    # -- definitions --------------------------------------------------------------------------

    def _arrays(self, names, given: bool = False) -> list:
        """``(name, annotation)`` of arrays: optional inputs (or, ``given``, all) may be None."""
        optional = self.optional | {f"d{n}" for n in self.optional}
        return [(n, Tensor | None if given or n in optional else Tensor) for n in names]

    @staticmethod
    def _options(options: list[Option]) -> tuple[list, list]:
        """The parameters of ``options``: ``(tensors, scalars)``."""
        params = [p for o in options for p in RULES[o.rule].params(o.name)]
        return [p for p in params if _is_tensor(p[1])], [p for p in params if not _is_tensor(p[1])]

    @staticmethod
    def _op(name: str, fn, params: list, returns, mutates=(), fake=_nothing, twin=False):
        signed = _signed(fn, params, returns)
        if twin:
            op = functional_op(name)(signed)
        else:
            op = torch.library.custom_op(_name(name), signed, mutates_args=tuple(mutates))
        op.register_fake(fake)
        return op

    def _define(self) -> None:
        twin = all(RULES[o.rule].twin for o in self.sig.options)
        tensors, scalars = self._options(self.forward_options)
        inputs = self._arrays(self.inputs)
        buffers = self._arrays(self.scratch if self.forward_only else self.checkpoints, given=True)
        out_params = [*self._arrays(self.outputs), *inputs, *tensors, *buffers, *scalars, _BACKEND]
        forward_params = [*inputs, *tensors, *scalars, _BACKEND]
        self.out_names, self.forward_names = _names(out_params), _names(forward_params)
        results = [Tensor] * (len(self.outputs) + len(self.checkpoints))
        out_op = self._op(
            self.forward_name,
            self._forward_out,
            out_params,
            None,
            mutates=[*self.outputs, *_names(buffers)],
        )
        self.functional = self._op(
            self.name,
            self._forward,
            forward_params,
            _returns(results),
            fake=self._forward_fake,
            twin=twin,
        )
        self.ops = [out_op, self.functional]
        if self.forward_only:
            self._define_no_backward()
        else:
            self._define_backward(twin)
        self.functional.register_autograd(self._grad, setup_context=self._setup)

    def _define_no_backward(self) -> None:
        params = [*self._arrays(self.cotangents), *self._arrays(self.graded)]
        self.saved = list(self.graded)
        self.backward_scalars: list[str] = []
        self.backward = self._op(
            f"{self.name}_backward",
            self._no_backward,
            params,
            _returns([Tensor] * len(self.graded)),
            fake=self._no_backward_fake,
        )
        self.ops.append(self.backward)

    def _define_backward(self, twin: bool) -> None:
        tensors, scalars = self._options(self.backward_options)
        head = [
            *self._arrays(self.cotangents),
            *self._arrays([*self.reads, *self.unread]),
            *tensors,
            *self._arrays(self.checkpoints),
        ]
        self.saved = _names(head)[len(self.cotangents) :]
        self.backward_scalars = _names(scalars)
        grads = self._arrays(f"d{n}" for n in self.graded)
        grad_lists = [(f"d{n}", list[Tensor]) for n in self.grad_lists]
        scratch = self._arrays(self.scratch, given=True)
        out_params = [*head, *grads, *grad_lists, *scratch, *scalars, _BACKEND]
        flags = [(f"need_d{n}", bool) for n in self.flagged]
        params = [*head, *scalars, *flags, _BACKEND]
        self.backward_out_names, self.backward_names = _names(out_params), _names(params)
        returns = _returns([Tensor] * len(grads) + [list[Tensor]] * len(grad_lists))
        out_op = self._op(
            f"{self.name}_backward_",
            self._backward_out,
            out_params,
            None,
            mutates=_names([*grads, *grad_lists, *scratch]),
        )
        self.backward = self._op(
            f"{self.name}_backward",
            self._backward,
            params,
            returns,
            fake=self._backward_fake,
            twin=twin,
        )
        self.ops += [out_op, self.backward]

    # -- forward ------------------------------------------------------------------------------

    def _dims(self, a: dict) -> dict:
        """Each symbol of the inputs' shape patterns -> its extent."""
        dims: dict = {}
        for arg in self.sig.inputs:
            if isinstance(a.get(arg.name), Tensor):
                _bind(dims, arg.shape, a[arg.name].shape)
        return dims

    def _new(self, arg: Arg, a: dict, dims: dict) -> Tensor:
        """A new contiguous output of the first same-pattern input's dtype, else the lead's.

        Contiguous, not with the input's strides, so that an input the kernels cannot read (a
        transposed one) is named in the front's error, not the output the caller never passed.
        """
        for other in self.sig.inputs:
            like = a.get(other.name)
            if other.shape == arg.shape and isinstance(like, Tensor):
                return torch.empty(like.shape, dtype=like.dtype, device=like.device)
        lead = a[self.lead.name]
        if self.sig.kind == "cross_entropy":  # the loss: a scalar or one per row, float32
            shape = (dims["T"],) if a["reduction"] == "none" else ()
            return lead.new_empty(shape, dtype=self._checkpoint_dtype(lead))
        return lead.new_empty(_shape(dims, arg.shape))

    def _checkpoint_dtype(self, lead: Tensor):
        """Float32, or float64 for a cross-entropy's float64 inputs (its ``lse`` and loss)."""
        wide = self.sig.kind == "cross_entropy" and lead.dtype == torch.float64
        return torch.float64 if wide else torch.float32

    def _given(self, cls, names: list, a: dict):
        """``cls`` of the buffers ``names`` the caller gave, or None when it gave none."""
        if cls is None or all(a.get(n) is None for n in names):
            return None
        return cls(**{n: a.get(n) for n in names})

    def _decoded(self, options: list[Option], a: dict) -> tuple[dict, list]:
        """The in-place front's keywords for ``options``, and the gradient lists they yield."""
        kwargs: dict = {}
        lists = []
        for o in options:
            got = RULES[o.rule].decode(o.name, a, kwargs)
            if got is not None:
                lists.append(got)
        return kwargs, lists

    def _run_forward(self, a: dict, outputs: list, checkpoints, scratch) -> None:
        # Autocast would round the backend's own torch arithmetic (DESIGN section 5: float32
        # accumulation); the call gives what it gives outside autocast.
        device = a[self.lead.name].device.type
        with torch.no_grad(), torch.autocast(device, enabled=False):
            kwargs, _ = self._decoded(self.forward_options, a)
            if self.checkpoints:
                kwargs["checkpoints"] = checkpoints
            if self.forward_only and self.scratch:
                kwargs["scratch"] = scratch
            self.forward_(*outputs, *(a[n] for n in self.inputs), **kwargs, backend=a["backend"])

    def _forward_out(self, *args) -> None:
        a = dict(zip(self.out_names, args))
        checkpoints = self._given(self.Checkpoints, self.checkpoints, a)
        scratch = self._given(self.Scratch, self.scratch, a) if self.forward_only else None
        self._run_forward(a, [a[n] for n in self.outputs], checkpoints, scratch)

    def _forward(self, *args):
        a = dict(zip(self.forward_names, args))
        with torch.no_grad():
            dims = self._dims(a)
            outputs = [self._new(arg, a, dims) for arg in self.sig.outputs]
            checkpoints = None
            if self.checkpoints:
                checkpoints = allocate_checkpoints(self.forward_, a[self.lead.name])
        self._run_forward(a, outputs, checkpoints, None)
        return _one([*outputs, *(checkpoints or ())])

    def _forward_fake(self, *args):
        a = dict(zip(self.forward_names, args))
        dims = self._dims(a)
        lead = a[self.lead.name]
        outputs = [self._new(arg, a, dims) for arg in self.sig.outputs]
        shapes = [_shape(dims, c.shape) for c in self.sig.checkpoints]
        dtype = self._checkpoint_dtype(lead)
        return _one([*outputs, *(lead.new_empty(s, dtype=dtype) for s in shapes)])

    # -- backward -----------------------------------------------------------------------------

    def _primal(self, name: str, a: dict):
        """``a[name]``; for an array the op does not take, a tensor of its shape pattern.

        The in-place backward takes every array of the forward; one it does
        not read is given a stand-in of its shape (a cotangent first).
        """
        if name in a:
            return a[name]
        return next(
            a[n]
            for n in (*self.cotangents, *self.reads)
            if self.pattern[n] == self.pattern[name] and isinstance(a.get(n), Tensor)
        )

    def _run_backward(self, a: dict) -> list:
        """The in-place backward over the op's tensors ``a``, gradients under ``d<input>``.

        Returns the gradient lists it yields (the score arrays').
        """
        device = self._primal(self.lead.name, a).device.type
        with torch.no_grad(), torch.autocast(device, enabled=False):  # as in _run_forward
            if self.sig.kind == "merge":
                merge_backward_(a, a["backend"])
                return []
            kwargs, lists = self._decoded(self.backward_options, a)
            args = [Duplicated(self._primal(o, a), a[f"d{o}"]) for o in self.outputs]
            for n in self.inputs:
                value, grad = self._primal(n, a), a.get(f"d{n}")
                args.append(value if grad is None else Duplicated(value, grad))
            if self.checkpoints:
                written = self.Checkpoints(**{c: a[c] for c in self.checkpoints})
                kwargs["checkpoints"] = _written(written, self.forward_name)
            if self.scratch:
                kwargs["scratch"] = self._given(self.Scratch, self.scratch, a)
            self.backward_(*args, **kwargs, backend=a["backend"])
        return lists

    def _backward_out(self, *args) -> None:
        a = dict(zip(self.backward_out_names, args))
        lists = self._run_backward(a)
        with torch.no_grad():
            for target, got in zip(self.grad_lists, lists):
                for out, g in zip(a[f"d{target}"], got):
                    out.copy_(g)

    def _gradients(self, a: dict) -> dict:
        """New buffers ``d<input>`` for the wanted gradients (None for an unwanted optional one)."""
        out = {}
        for n in self.graded:
            wanted = n not in self.optional or (a[f"need_d{n}"] and a.get(n) is not None)
            out[f"d{n}"] = torch.empty_like(self._primal(n, a)) if wanted else None
        return out

    def _results(self, a: dict, grads: dict, lists: list):
        """The functional backward's results: gradients (empty when unwanted), then lists."""
        lead = self._primal(self.lead.name, a)
        out = [lead.new_empty((0,)) if g is None else g for g in grads.values()]
        return _one([*out, *lists])

    def _backward(self, *args):
        a = dict(zip(self.backward_names, args))
        grads = self._gradients(a)
        lists = self._run_backward({**a, **grads})
        with torch.no_grad():
            lists = [
                [g.to(t.dtype) for g, t in zip(got, a[target])]
                for target, got in zip(self.grad_lists, lists)
            ]
        return self._results(a, grads, lists)

    def _backward_fake(self, *args):
        a = dict(zip(self.backward_names, args))
        lists = [[torch.empty_like(t) for t in a[target]] for target in self.grad_lists]
        return self._results(a, self._gradients(a), lists)

    def _no_backward(self, *args):
        reason = NO_BACKWARD.get(self.name, "it is forward only: run it under torch.no_grad()")
        raise RuntimeError(f"xpkernels.{self.name} has no backward ({reason})")

    def _no_backward_fake(self, *args):
        return _one([torch.empty_like(t) for t in args[len(self.cotangents) :]])

    # -- autograd -----------------------------------------------------------------------------

    def _setup(self, ctx, inputs, output) -> None:
        a = dict(zip(self.forward_names, inputs))
        results = output if isinstance(output, tuple) else (output,)
        a.update(zip([*self.outputs, *self.checkpoints], results))
        if self.sig.kind == "merge":
            merge_setup(a)
        a.update(self.backward_defaults)
        flat, ctx.layout = _flatten([a[n] for n in self.saved])
        ctx.save_for_backward(*flat)
        ctx.scalars = [a[n] for n in self.backward_scalars]
        ctx.held = [obj for o in self.backward_options for obj in RULES[o.rule].held(o.name, a)]
        ctx.backend = a["backend"]
        if self.checkpoints:
            ctx.mark_non_differentiable(*(a[c] for c in self.checkpoints))

    def _grad(self, ctx, *cotangents):
        # Read once: a saved_tensors_hooks pair (non-reentrant torch.utils.checkpoint) may
        # allow each saved tensor one unpack.
        tensors = ctx.saved_tensors
        saved = _unflatten(tensors, ctx.layout)
        a = dict(zip(self.saved, saved))
        cots = [_last_axis_contiguous(c) for c in cotangents[: len(self.outputs)]]
        needs = [
            a[n] is not None and ctx.needs_input_grad[self.forward_names.index(n)]
            for n in self.flagged
        ]
        tail = [] if self.forward_only else [*ctx.scalars, *needs, ctx.backend]
        results = self.backward(*cots, *saved, *tail)
        results = results if isinstance(results, tuple) else (results,)
        wanted = dict(zip(self.flagged, needs))
        grads = [g if wanted.get(n, True) else None for n, g in zip(self.graded, results)]
        flat, layout = _flatten([*grads, *results[len(grads) :]])
        flat = _no_double_backward(self.name, (*cots, *tensors), flat)
        got = dict(zip([*self.graded, *self.grad_lists], _unflatten(flat, layout)))
        return tuple(got.get(n) for n in self.forward_names)

    # -- the autograd front -------------------------------------------------------------------

    def record(self, fn: str, arrays: dict, options: dict):
        """Run an allocating front call through the functional op (autograd records it).

        Checks what a schema cannot (each option's value, by its rule, named
        in the message), fixes the backend choice now (so the backward, which
        autograd may run on another thread, uses the forward's backend) and
        calls the functional op, whose implementation runs the front's full
        validation before it writes anything.
        """
        values = {**options, **arrays}
        for buffer, message in _BUFFER_ERROR.items():
            if values.get(buffer) is not None:
                # nothing requires grad: the call is here only because torch.compile traces
                if not needs_grad(arrays, options.get("score_mod")):
                    message = _COMPILED_BUFFER_ERROR
                raise ValueError(message.format(fn=fn, buffer=buffer))
        held: list = []
        a = {n: primal(values.get(n)) for n in self.inputs}
        for o in self.forward_options:
            rule = RULES[o.rule]
            encoded = rule.encode(fn, o.name, values.get(o.name, o.default), held)
            a.update(zip(_names(rule.params(o.name)), encoded))
        a["backend"] = backend_choice(options)
        results = self.functional(*(a[n] for n in self.forward_names))
        results = results if isinstance(results, tuple) else (results,)
        return _one(list(results[: len(self.outputs)]))


#: What a recorded call may not be given: autograd handles these buffers itself.
_BUFFER_ERROR = {
    "checkpoints": (
        "{fn}: checkpoints= feeds the explicit backward ({fn}_backward); with autograd "
        "recording this call (an input requires grad), autograd saves the checkpoints "
        "itself. Drop checkpoints=, or call {fn} under torch.no_grad() to keep them"
    ),
    "scratch": (
        "{fn}: scratch= is for the in-place {fn}_; with autograd recording this call (an "
        "input requires grad) run it under torch.no_grad() to pass scratch"
    ),
}


#: The same under ``torch.compile`` when nothing requires grad (eager, such a call runs the
#: front itself, which fills the caller's buffers; a traced call runs the op, which cannot).
_COMPILED_BUFFER_ERROR = (
    "{fn}: {buffer}= is not supported inside torch.compile: a compiled {fn} call runs through "
    "the xpkernels op, which keeps its own {buffer} and cannot fill the ones passed. Call {fn} "
    "with {buffer}= outside the compiled function, or drop {buffer}="
)


def _declared_ops(name: str) -> _Ops:
    """The ops of the declared primitive ``name``, over its front module ``xpkernels.<name>``.

    The front module is loaded by name (the torch layer builds on the fronts).
    """
    return _Ops(name, importlib.import_module(f"xpkernels.{name}"))


_DECLARED = [_declared_ops(name) for name in PRIMITIVES]

#: Primitive -> its autograd front ``(fn, arrays, options) -> result``.
FRONTS = {ops.name: ops.record for ops in _DECLARED}

#: Every op registered here, by its name in the ``xpkernels`` namespace.
OPS = tuple(sorted(op._qualname.split("::", 1)[1] for ops in _DECLARED for op in ops.ops))
