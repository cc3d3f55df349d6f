"""The row primitives' fronts, driven by their declared :class:`~xpkernels.backends.protocol.Signature`.

A row primitive (RMSNorm, LayerNorm, softmax, SwiGLU) declares its arrays,
their shape patterns, what may alias what, its checkpoints, scratch and
options once, in ``backends/signatures.py``. :class:`RowPrimitive` turns that
record into everything its front file would otherwise write out: the
validation of both passes (every check before the first write, messages
naming the function and the argument), the labelled arrays routing sees,
the checkpoints and scratch NamedTuples and their allocators, the
allocating forms and the loop over row views that calls the backend module.
A front file keeps only what a reader needs: the math, and the public
functions with their docstrings, each a call into its :class:`RowPrimitive`.

The backward's Duplicated arguments are named after the forward's arrays in
upper case (``Y`` for ``y``); their parts are labelled ``Y.shadow``,
``X.primal``... An optional input passed as a bare array (not a Duplicated)
gets no gradient.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from xpkernels.backends.protocol import GELU_APPROXIMATIONS, PRIMITIVES, ROWS, Arg, Option

from . import _autograd
from . import _checks as check
from ._rows import n_rows, row_groups
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_accumulator,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
)
from .registry import resolve

__all__ = ["RowPrimitive"]

#: The layout the row primitives' messages quote for a ``... M`` array.
_LAYOUT = "(..., M)"

_RULES = {
    "positive_finite": check.positive_finite,
    "finite": check.finite,
    "gelu_approximate": lambda fn, name, v: check.one_of(fn, name, v, GELU_APPROXIMATIONS),
}


def _upper(name: str) -> str:
    return name.upper()


def _named_tuple(name: str, fields: tuple[str, ...], doc: str, base: type | None, module: str):
    """A NamedTuple class ``module.name`` of ``fields`` (a subclass of ``base`` too, when given)."""
    arrays = namedtuple(f"_{name}Arrays", fields, module=module)  # type: ignore[misc]
    bases = (arrays,) if base is None else (arrays, base)
    namespace: dict[str, Any] = {"__doc__": doc, "__module__": module}
    if base is None:
        namespace["__slots__"] = ()
    return type(name, bases, namespace)


class RowPrimitive:
    """The fronts of one declared row primitive.

    Parameters
    ----------
    name : str
        The primitive (a key of ``protocol.PRIMITIVES`` of kind ``"rows"``).
    module : str
        The front module that exports the generated classes (their ``__module__``,
        so that they pickle).

    Attributes
    ----------
    Checkpoints : type or None
        ``<Title>Checkpoints``: the NamedTuple of the forward's checkpoints
        (a :class:`~xpkernels.buffers.Checkpoints`, which records the forward
        that wrote it), or None when the primitive saves none.
    Scratch : type or None
        ``<Title>BackwardScratch``: the NamedTuple of the backward's scratch, or None.
    """

    Checkpoints: Any
    Scratch: Any

    def __init__(self, name: str, module: str):
        signature = PRIMITIVES[name].signature
        if signature.kind != "rows":
            raise ValueError(f"{name} is not a row primitive")
        self.name = name
        self.signature = signature
        self.forward_name = f"{name}_"
        self.backward_name = f"{name}_backward_"
        self.lead = signature.inputs[0]
        self.args = {a.name: a for a in (*signature.inputs, *signature.outputs)}
        title = signature.title
        self.Checkpoints = None
        if signature.checkpoints:
            fields = tuple(c.name for c in signature.checkpoints)
            self.Checkpoints = _named_tuple(
                f"{title}Checkpoints",
                fields,
                f"What ``{self.forward_name}`` saves for its backward: "
                f"{', '.join(f'``{f}`` (rows,) float32' for f in fields)}.",
                Checkpoints,
                module,
            )
        self.Scratch = None
        if signature.scratch:
            self.Scratch = _named_tuple(
                f"{title}BackwardScratch",
                tuple(s.name for s in signature.scratch),
                f"Transient workspace of ``{self.backward_name}``: partial sums ``(P, M)`` in "
                "float32 (float64 for float64 inputs).",
                None,
                module,
            )

    # -- labels and options ------------------------------------------------------------------

    def _forward_call(self) -> str:
        return f"{self.forward_name}, {', '.join(a.name for a in self.signature.inputs)}"

    def _backward_call(self) -> str:
        names = (*self.signature.outputs, *self.signature.inputs)
        return f"{self.backward_name}, {', '.join(_upper(a.name) for a in names)}"

    def _options(self, fn: str, options: dict, present: dict, backward: bool) -> dict:
        """The declared options, checked; ``present`` maps input names to their array labels."""
        out = {}
        for opt in self.signature.options:
            if not (opt.backward if backward else opt.forward):
                continue
            out[opt.name] = self._option(fn, opt, options[opt.name], present)
        return out

    def _option(self, fn: str, opt: Option, value, present: dict):
        value = _RULES[opt.rule](fn, opt.name, value)
        target = opt.applies_to
        if target is not None and present[target][1] is None and value != opt.default:
            what = self.args[target].recorded or target
            raise ValueError(
                f"{fn}: {opt.name}={value!r} applies to the {what}, but {present[target][0]} is None"
            )
        return value

    def _shapes(self, lead) -> dict:
        """What checkpoints record of the inputs' shapes: rows and row length (the leading
        axes are free: a backward may take the rows as another view)."""
        return {f"{self.lead.name} (rows, M)": (n_rows(lead.shape), lead.shape[-1])}

    def _recorded(self, options: dict, inputs: dict) -> dict:
        """What the checkpoints record of the forward: backward options, given optional inputs."""
        record: dict[str, Any] = {
            o.name: options[o.name] for o in self.signature.options if o.backward and o.recorded
        }
        for arg in self.signature.inputs:
            if arg.recorded is not None:
                record[arg.recorded] = "none" if inputs[arg.name] is None else "given"
        return record

    # -- shapes ------------------------------------------------------------------------------

    def _arrays_like(self, fn, xp, lead_label, lead, arrays: dict, pattern: dict) -> None:
        """Check ``arrays`` (label -> array or None) against the lead's shape by their patterns."""
        check.min_rank(fn, lead_label, lead, 1, _LAYOUT)
        check.floating(fn, lead_label, xp, lead)
        m = lead.shape[-1]
        for label, a in arrays.items():
            if a is None or a is lead and label == lead_label:
                continue
            check.floating(fn, label, xp, a)
            check.shape(fn, label, a, tuple(lead.shape) if pattern[label] == ROWS else (m,))
            check.last_axis_contiguous(fn, label, a)
        check.last_axis_contiguous(fn, lead_label, lead)

    def _checkpoint_arrays(self, fn, xp, checkpoints, lead) -> dict:
        if not isinstance(checkpoints, self.Checkpoints):
            raise TypeError(
                f"{fn}: checkpoints must be the {self.signature.title}Checkpoints from "
                f"allocate_checkpoints({self._forward_call()}), got {type(checkpoints).__name__}"
            )
        rows = n_rows(lead.shape)
        arrays = {}
        for c in self.signature.checkpoints:
            a = getattr(checkpoints, c.name)
            check.float32(fn, f"checkpoints.{c.name}", xp, a)
            check.shape(fn, f"checkpoints.{c.name}", a, (rows,))
            arrays[f"checkpoints.{c.name}"] = a
        return arrays

    @staticmethod
    def _arrays(fn: str, arrays: dict, optional: set) -> None:
        """TypeError for anything but an array among ``arrays`` (None only where ``optional``)."""
        for label, a in arrays.items():
            if a is None and label in optional:
                continue
            check.namespace(fn, label, a)

    # -- forward -----------------------------------------------------------------------------

    def forward_(self, outputs: dict, inputs: dict, options: dict, checkpoints, backend) -> None:
        """The in-place forward: validate everything, then write ``outputs`` (and checkpoints)."""
        sig, fn = self.signature, self.forward_name
        _autograd.check_inplace(fn, {**inputs, **outputs})
        inputs = {name: primal(a) for name, a in inputs.items()}
        lead = inputs[self.lead.name]
        xp = check.namespace(fn, self.lead.name, lead)
        optional = {a.name for a in sig.inputs if a.optional}
        self._arrays(fn, {**outputs, **inputs}, optional)
        check.same_namespace(fn, xp, {**inputs, **outputs}, self.lead.name)
        pattern = {a.name: a.shape for a in (*sig.inputs, *sig.outputs)}
        self._arrays_like(fn, xp, self.lead.name, lead, {**inputs, **outputs}, pattern)
        present = {a.name: (a.name, inputs[a.name]) for a in sig.inputs}
        opts = self._options(fn, options, present, backward=False)
        ck = {}
        if checkpoints is not None:
            ck = self._checkpoint_arrays(fn, xp, checkpoints, lead)
        written = {**outputs, **ck}
        check.writable(fn, written)
        aliases = [(o.name, i) for o in sig.outputs for i in o.aliases]
        check.no_overlap(fn, written, inputs, may_alias=aliases)
        route = resolve(self.name, {**inputs, **outputs, **ck}, backend=backend)
        if checkpoints is not None:
            forget_forward(checkpoints)
        cks = [ck.get(f"checkpoints.{c.name}") for c in sig.checkpoints]
        if n_rows(lead.shape) > 0:  # no rows: every output and checkpoint is empty
            self._run_forward(route, outputs, inputs, cks, opts)
        if checkpoints is not None:
            record_forward(checkpoints, fn, self._recorded(opts, inputs), self._shapes(lead))

    def _run_forward(self, route, outputs: dict, inputs: dict, ck: list, opts: dict) -> None:
        sig = self.signature
        rows_arrays = [outputs[a.name] for a in sig.outputs]
        rows_arrays += [inputs[a.name] for a in sig.inputs if a.shape == ROWS]
        lead = inputs[self.lead.name]
        for first, views in row_groups(rows_arrays, lead.shape[-1]):
            view = iter(views)
            outs = [next(view) for _ in sig.outputs]
            ins = [next(view) if a.shape == ROWS else inputs[a.name] for a in sig.inputs]
            n = outs[0].shape[0]
            cks = [None if c is None else c[first : first + n] for c in ck]
            route.impl.forward(*outs, *ins, *cks, **opts)

    def forward(self, inputs: dict, options: dict, checkpoints, backend):
        """The allocating forward: new outputs of the lead's shape and dtype (autograd on torch)."""
        recorded_options = {**options, "checkpoints": checkpoints, "backend": backend}
        result = _autograd.record(self.name, inputs, recorded_options)
        if result is not _autograd.NOT_RECORDED:
            return result
        lead = primal(inputs[self.lead.name])
        check.namespace(self.name, self.lead.name, lead)
        outputs = {a.name: empty(lead, lead.shape, lead.dtype) for a in self.signature.outputs}
        self.forward_(outputs, inputs, options, checkpoints, backend)
        values = tuple(outputs.values())
        return values[0] if len(values) == 1 else values

    def allocate_checkpoints(self, *args, **options):
        """``allocate_checkpoints(<name>_, ...)``: each checkpoint ``(rows,)`` float32."""
        fn = f"allocate_checkpoints({self.forward_name})"
        lead = primal(args[0] if args else options.get(self.lead.name))
        check.namespace(fn, self.lead.name, lead)
        check.min_rank(fn, self.lead.name, lead, 1, _LAYOUT)
        rows = (n_rows(lead.shape),)
        assert self.Checkpoints is not None
        return self.Checkpoints(
            **{c.name: empty_float32(lead, rows) for c in self.signature.checkpoints}
        )

    # -- backward ----------------------------------------------------------------------------

    def _backward_parts(self, fn: str, duplicated: dict):
        """``(reads, cotangents, gradients, labels, unread)``: the backward's Duplicated parts.

        ``labels`` maps each input name to ``(label, primal)``: how its primal
        is named in messages (``X.primal``, or ``W`` for a bare array) and its
        value. ``unread`` holds the primals the backward does not read, by
        label: they are checked for being arrays of the call's namespace only.
        """
        sig = self.signature
        reads: dict[str, Any] = {}
        unread: dict[str, Any] = {}
        cotangents, grads, labels = {}, {}, {}
        for out in sig.outputs:
            d = check.duplicated(fn, _upper(out.name), duplicated[_upper(out.name)])
            where = reads if out.name in sig.reads else unread
            where[f"{_upper(out.name)}.primal"] = d.primal
            cotangents[f"{_upper(out.name)}.shadow"] = d.shadow
        for arg in sig.inputs:
            name = _upper(arg.name)
            d = duplicated[name]
            if arg.optional and not isinstance(d, Duplicated):
                labels[arg.name] = (name, d)
            else:
                d = check.duplicated(fn, name, d)
                labels[arg.name] = (f"{name}.primal", d.primal)
                grads[f"{name}.shadow"] = d.shadow
            label, value = labels[arg.name]
            if arg.name in sig.reads:
                reads[label] = value
            elif isinstance(d, Duplicated):
                unread[label] = value
        return reads, cotangents, grads, labels, unread

    def _pattern_of(self, label: str) -> str:
        name = label.split(".")[0].lower()
        return self.args[name].shape

    def backward_(self, duplicated: dict, options: dict, checkpoints, scratch, backend) -> None:
        """The in-place backward: validate everything, then overwrite the inputs' shadows."""
        sig, fn = self.signature, self.backward_name
        _autograd.check_inplace(fn, duplicated)
        reads, cotangents, grads, labels, unread = self._backward_parts(fn, duplicated)
        rows_reads = [label for label in reads if self._pattern_of(label) == ROWS]
        lead_label = rows_reads[0]
        lead = reads[lead_label]
        xp = check.namespace(fn, lead_label, lead)
        optional = {label for label, _ in labels.values() if "." not in label}
        given = {labels[a.name][0]: labels[a.name][1] for a in sig.inputs if a.optional}
        arrays = {**reads, **cotangents, **grads, **given}
        self._arrays(fn, arrays, optional)
        check.same_namespace(fn, xp, {**arrays, **unread}, lead_label)
        pattern = {label: self._pattern_of(label) for label in arrays}
        self._arrays_like(fn, xp, lead_label, lead, arrays, pattern)
        opts = self._options(fn, options, labels, backward=True)
        ck = {}
        if self.Checkpoints is not None:
            if checkpoints is None:
                raise ValueError(
                    f"{fn}: checkpoints are required: pass the {sig.title}Checkpoints that "
                    f"{self.forward_name} filled in the forward "
                    f"(allocate_checkpoints({self._forward_call()}))"
                )
            ck = self._checkpoint_arrays(fn, xp, checkpoints, lead)
        partials = self._partials(fn, xp, scratch, grads, lead)
        written = {**grads, **{f"scratch.{k}": v for k, v in partials.items()}}
        check.writable(fn, written)
        aliases = [
            (f"{_upper(a.name)}.shadow", f"{_upper(o)}.shadow")
            for a in sig.inputs
            for o in a.aliases
        ]
        check.no_overlap(fn, written, {**reads, **cotangents, **ck}, may_alias=aliases)
        if self.Checkpoints is not None:
            inputs = {name: value for name, (_, value) in labels.items()}
            recorded = self._recorded(opts, inputs)
            check_forward(fn, checkpoints, self.forward_name, recorded, self._shapes(lead))
        route = resolve(self.name, {**arrays, **ck}, backend=backend)
        if n_rows(lead.shape) == 0:
            self._no_rows_backward(grads)
            return
        for s in sig.scratch:
            if f"{_upper(s.of)}.shadow" in grads and partials.get(s.name) is None:
                partials[s.name] = self._alloc_partial(route, lead)
        self._run_backward(route, reads, cotangents, grads, list(ck.values()), partials, opts)

    def _no_rows_backward(self, grads: dict) -> None:
        """The backward over no rows: the row gradients are empty, those of ``(M,)`` inputs 0."""
        for a in self.signature.inputs:
            g = grads.get(f"{_upper(a.name)}.shadow")
            if a.shape != ROWS and g is not None:
                g[...] = 0

    def _partials(self, fn, xp, scratch, grads: dict, lead) -> dict:
        """The caller's scratch arrays for the gradients this call computes, checked."""
        sig = self.signature
        wanted = [s for s in sig.scratch if f"{_upper(s.of)}.shadow" in grads]
        if not wanted or scratch is None:
            return {}
        if not isinstance(scratch, self.Scratch):
            raise TypeError(
                f"{fn}: scratch must be the {sig.title}BackwardScratch from "
                f"allocate_scratchspace({self._backward_call()}), got {type(scratch).__name__}"
            )
        m = lead.shape[-1]
        out: dict[str, Any] = {}
        for s in wanted:
            label, a = f"scratch.{s.name}", getattr(scratch, s.name)
            check.namespace(fn, label, a)
            check.accumulator(fn, label, xp, a, lead.dtype)
            if a.ndim != 2 or a.shape[1] != m or a.shape[0] < 1:
                raise ValueError(
                    f"{fn}: {label} must have shape (P, {m}) with P >= 1, got {tuple(a.shape)}"
                )
            check.last_axis_contiguous(fn, label, a)
            first = next(iter(out.values()), a)
            if a.shape != first.shape:
                raise ValueError(
                    f"{fn}: {label} must have the shape of scratch.{wanted[0].name} "
                    f"{tuple(first.shape)}, got {tuple(a.shape)}"
                )
            out[s.name] = a
        return out

    @staticmethod
    def _alloc_partial(route, lead):
        m = lead.shape[-1]
        return empty_accumulator(lead, (route.hook("partials")(n_rows(lead.shape), m, lead), m))

    def _run_backward(self, route, reads, cotangents, grads, ck, partials, opts) -> None:
        sig = self.signature
        read_outputs = [
            reads[f"{_upper(o.name)}.primal"] for o in sig.outputs if o.name in sig.reads
        ]
        read_inputs = [
            (a, reads[label])
            for a in sig.inputs
            for label in (f"{_upper(a.name)}.primal", _upper(a.name))
            if a.name in sig.reads and label in reads
        ]
        input_grads = [(a, grads.get(f"{_upper(a.name)}.shadow")) for a in sig.inputs]
        rows_arrays = [*read_outputs, *cotangents.values()]
        rows_arrays += [v for a, v in read_inputs if a.shape == ROWS]
        rows_arrays += [g for a, g in input_grads if a.shape == ROWS]
        lead = rows_arrays[0]
        by_input = {s.of: partials.get(s.name) for s in sig.scratch}
        for k, (first, views) in enumerate(row_groups(rows_arrays, lead.shape[-1])):
            view = iter(views)
            args = [next(view) for _ in range(len(read_outputs) + len(cotangents))]
            args += [next(view) if a.shape == ROWS else v for a, v in read_inputs]
            n = args[0].shape[0]
            args += [c[first : first + n] for c in ck]
            args += [
                next(view) if a.shape == ROWS else by_input.get(a.name) for a, _ in input_grads
            ]
            extra = {"accumulate": k > 0} if sig.scratch else {}
            route.impl.backward(*args, **opts, **extra)
        for a, g in input_grads:
            if a.shape != ROWS and g is not None:
                route.hook("reduce_partials")(by_input[a.name], g)

    def backward(self, arrays: dict, options: dict, checkpoints, backend):
        """The allocating backward over ``arrays`` (cotangents ``dy``, the reads, and the
        optional inputs the backward does not read): the inputs' gradients in new arrays
        (one array, or a tuple in the inputs' order; None for an absent optional input)."""
        sig, fn = self.signature, f"{self.name}_backward"
        given = {name: primal(a) for name, a in arrays.items()}
        for name, a in given.items():
            if a is not None or not self.args.get(name, Arg(name, ROWS)).optional:
                check.namespace(fn, name, a)
        stand_in = next(given[r] for r in sig.reads if self.args[r].shape == ROWS)
        duplicated: dict[str, Any] = {}
        for out in sig.outputs:
            dy = given[f"d{out.name}"]
            if out.name in given:
                check.shape(fn, f"d{out.name}", dy, tuple(given[out.name].shape))
            duplicated[_upper(out.name)] = Duplicated(given.get(out.name, dy), dy)
        for arg in sig.inputs:
            value = given.get(arg.name, stand_in)
            if value is None:
                duplicated[_upper(arg.name)] = None
                continue
            duplicated[_upper(arg.name)] = Duplicated(value, empty(value, value.shape, value.dtype))
        self.backward_(duplicated, options, checkpoints, None, backend)
        grads = tuple(
            None if d is None else d.shadow
            for d in (duplicated[_upper(a.name)] for a in sig.inputs)
        )
        return grads[0] if len(grads) == 1 else grads

    def allocate_scratch(self, *duplicated, backend=None, **options):
        """``allocate_scratchspace(<name>_backward_, ...)``: each partial ``(P, M)``, P the backend's."""
        fn = f"allocate_scratchspace({self.backward_name})"
        sig = self.signature
        names = [_upper(a.name) for a in (*sig.outputs, *sig.inputs)]
        given = dict(zip(names, duplicated))
        given.update({k: v for k, v in options.items() if k in names})
        lead_name = _upper(self.lead.name)
        lead = primal(given.get(lead_name))
        check.namespace(fn, lead_name, lead)
        check.min_rank(fn, lead_name, lead, 1, _LAYOUT)
        arrays = {_upper(a.name): primal(given.get(_upper(a.name))) for a in sig.inputs}
        route = resolve(self.name, arrays, backend=backend)
        assert self.Scratch is not None
        return self.Scratch(**{s.name: self._alloc_partial(route, lead) for s in sig.scratch})

    def register(self, forward_, backward_) -> None:
        """File the allocators under the public in-place functions."""
        if self.Checkpoints is not None:
            checkpoints_for(forward_)(self.allocate_checkpoints)
        if self.Scratch is not None:
            scratchspace_for(backward_)(self.allocate_scratch)
