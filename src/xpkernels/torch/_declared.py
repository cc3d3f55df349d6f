"""The ``xpkernels`` torch.library ops of the declared row primitives, generated from their signatures.

For each primitive ``p`` whose ``protocol.PRIMITIVES[p].signature`` is of kind ``"rows"``
(RMSNorm, LayerNorm, softmax, SwiGLU), four ops are defined from that one
record, with the conventions of :mod:`xpkernels.torch._ops`:

- ``xpkernels::p_(outputs, inputs, checkpoints, options, backend) -> ()``, the
  out variant (mutating the outputs and, when given, the checkpoints);
- ``xpkernels::p(inputs, options, backend) -> (outputs, checkpoints)``, the
  functional forward, whose autograd formula saves the backward's reads and
  the checkpoints and calls
- ``xpkernels::p_backward(cotangents, reads, unread optional inputs,
  checkpoints, backward options, need flags, backend) -> gradients``, the
  functional backward (one ``need_d<input>`` flag per optional input: an
  unwanted gradient is returned empty), and
- ``xpkernels::p_backward_(cotangents, reads, unread optional inputs,
  checkpoints, gradients, scratch, backward options, backend) -> ()``.

Each op's schema is inferred by ``torch.library`` from a generated Python
signature; each has a fake (shapes and dtypes only). Implementations call
the in-place fronts under ``torch.no_grad()``, so their validation applies.
:data:`FRONTS` holds the autograd fronts :func:`xpkernels._autograd.record`
hands such calls to.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from xpkernels.backends.protocol import PRIMITIVES

from .. import _checks as check
from .._declared import RowPrimitive
from ..buffers import Duplicated, primal
from ..registry import _explicit_choice
from ._ops import _last_axis_contiguous, _name, _no_double_backward, _written
from ._triton import functional_op

__all__ = ["FRONTS", "OPS"]

_ROWS = "... M"
_Param = inspect.Parameter


def _param(name: str, annotation) -> inspect.Parameter:
    return _Param(name, _Param.POSITIONAL_OR_KEYWORD, annotation=annotation)


def _signed(fn: Callable, params: list, returns) -> Callable:
    """``fn`` (which takes ``*args``) under the signature torch.library infers a schema from."""

    def call(*args):
        return fn(*args)

    call.__doc__ = fn.__doc__
    call.__signature__ = inspect.Signature(params, return_annotation=returns)  # type: ignore[attr-defined]
    return call


def _rows(x: Tensor) -> int:
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return rows


class _Ops:
    """The four ops of one declared row primitive, and its autograd front."""

    def __init__(self, front: RowPrimitive):
        self.front = front
        self.sig = sig = front.signature
        self.inputs = [a.name for a in sig.inputs]
        self.optional = [a.name for a in sig.inputs if a.optional]
        self.outputs = [a.name for a in sig.outputs]
        self.checkpoints = [c.name for c in sig.checkpoints]
        self.options = [o.name for o in sig.options]
        self.backward_options = [o.name for o in sig.options if o.backward]
        self.cotangents = [f"d{o}" for o in self.outputs]
        self.reads = [n for n in (*self.outputs, *self.inputs) if n in sig.reads]
        self.unread = [n for n in self.optional if n not in sig.reads]
        self.grads = [f"d{n}" for n in self.inputs]
        self.scratch = [s.name for s in sig.scratch]
        self.shape = {a.name: a.shape for a in (*sig.inputs, *sig.outputs)}
        self._define()

    # -- signatures ---------------------------------------------------------------------------

    def _tensor(self, name: str):
        return Tensor | None if name in self.optional else Tensor

    def _backward_head(self) -> list:
        """The parameters both backward ops start with."""
        params = [_param(n, Tensor) for n in self.cotangents]
        params += [_param(n, self._tensor(n)) for n in (*self.reads, *self.unread)]
        params += [_param(n, Tensor) for n in self.checkpoints]
        return params

    def _define(self) -> None:
        name, fwd = self.front.name, self.front.forward_name
        backend = _param("backend", str | None)
        options = [_param(n, float) for n in self.options]
        backward_options = [_param(n, float) for n in self.backward_options]
        results = len(self.outputs) + len(self.checkpoints)
        returns = Tensor if results == 1 else tuple[(Tensor,) * results]  # type: ignore[misc]
        grad_returns = Tensor if len(self.grads) == 1 else tuple[(Tensor,) * len(self.grads)]  # type: ignore[misc]

        out_params = [_param(n, Tensor) for n in self.outputs]
        out_params += [_param(n, self._tensor(n)) for n in self.inputs]
        out_params += [_param(n, Tensor | None) for n in self.checkpoints]
        out_op = torch.library.custom_op(
            _name(fwd),
            _signed(self._forward_out, [*out_params, *options, backend], None),
            mutates_args=(*self.outputs, *self.checkpoints),
        )
        out_op.register_fake(lambda *args: None)

        forward_params = [_param(n, self._tensor(n)) for n in self.inputs]
        functional = functional_op(name)(
            _signed(self._forward, [*forward_params, *options, backend], returns)
        )
        functional.register_fake(self._forward_fake)

        head = self._backward_head()
        grads = [_param(n, self._tensor(n[1:])) for n in self.grads]
        scratch = [_param(n, Tensor | None) for n in self.scratch]
        backward_out = torch.library.custom_op(
            _name(f"{name}_backward_"),
            _signed(
                self._backward_out, [*head, *grads, *scratch, *backward_options, backend], None
            ),
            mutates_args=(*self.grads, *self.scratch),
        )
        backward_out.register_fake(lambda *args: None)

        needs = [_param(f"need_d{n}", bool) for n in self.optional]
        backward = functional_op(f"{name}_backward")(
            _signed(self._backward, [*head, *backward_options, *needs, backend], grad_returns)
        )
        backward.register_fake(self._backward_fake)
        functional.register_autograd(self._grad, setup_context=self._setup)
        self.functional, self.backward = functional, backward
        self.ops = (out_op, functional, backward_out, backward)

    # -- implementations ----------------------------------------------------------------------

    def _split(self, args, *groups):
        """``args`` cut into dicts, one per list of names in ``groups``."""
        out, k = [], 0
        for names in groups:
            out.append(dict(zip(names, args[k : k + len(names)])))
            k += len(names)
        return out

    def _forward_out(self, *args) -> None:
        outs, ins, cks, opts = self._split(
            args, self.outputs, self.inputs, self.checkpoints, self.options
        )
        backend = args[-1]
        given = any(v is not None for v in cks.values())
        checkpoints = self.front.Checkpoints(**cks) if given else None
        with torch.no_grad():
            self.front.forward_(outs, ins, opts, checkpoints, backend)

    def _forward(self, *args):
        ins, opts = self._split(args, self.inputs, self.options)
        backend = args[-1]
        lead = ins[self.inputs[0]]
        with torch.no_grad():
            outs = [torch.empty_like(lead) for _ in self.outputs]
            checkpoints = None
            if self.checkpoints:
                checkpoints = self.front.allocate_checkpoints(*ins.values())
            outputs = dict(zip(self.outputs, outs))
            self.front.forward_(outputs, ins, opts, checkpoints, backend)
        results = (*outs, *(checkpoints or ()))
        return results[0] if len(results) == 1 else results

    def _forward_fake(self, *args):
        lead = args[0]
        rows = (_rows(lead),)
        outs = [torch.empty_like(lead) for _ in self.outputs]
        cks = [lead.new_empty(rows, dtype=torch.float32) for _ in self.checkpoints]
        results = (*outs, *cks)
        return results[0] if len(results) == 1 else results

    def _duplicated(self, cots: dict, given: dict, grads: dict) -> dict:
        """The in-place backward's Duplicated arguments over the ops' tensors."""
        stand_in = next(given[r] for r in self.reads if self.shape[r] == _ROWS)
        out: dict[str, Any] = {}
        for o in self.outputs:
            out[o.upper()] = Duplicated(given.get(o, cots[f"d{o}"]), cots[f"d{o}"])
        for n in self.inputs:
            value, grad = given.get(n, stand_in), grads.get(f"d{n}")
            out[n.upper()] = value if grad is None else Duplicated(value, grad)
        return out

    def _run_backward(self, cots, given, cks, grads, scratch, opts, backend) -> None:
        checkpoints = None
        if self.checkpoints:
            checkpoints = _written(self.front.Checkpoints(**cks), self.front.forward_name)
        with torch.no_grad():
            duplicated = self._duplicated(cots, given, grads)
            self.front.backward_(duplicated, opts, checkpoints, scratch, backend)

    def _backward_out(self, *args) -> None:
        cots, given, cks, grads, scratch, opts = self._split(
            args,
            self.cotangents,
            [*self.reads, *self.unread],
            self.checkpoints,
            self.grads,
            self.scratch,
            self.backward_options,
        )
        held = None
        if any(v is not None for v in scratch.values()):
            held = self.front.Scratch(**scratch)
        self._run_backward(cots, given, cks, grads, held, opts, args[-1])

    def _wanted(self, given: dict, needs: dict, n: str) -> bool:
        return n not in self.optional or (needs[f"need_d{n}"] and given.get(n) is not None)

    def _backward(self, *args):
        cots, given, cks, opts, needs = self._split(
            args,
            self.cotangents,
            [*self.reads, *self.unread],
            self.checkpoints,
            self.backward_options,
            [f"need_d{n}" for n in self.optional],
        )
        stand_in = next(given[r] for r in self.reads if self.shape[r] == _ROWS)
        grads = {}
        for n in self.inputs:
            like = given.get(n, stand_in)
            grads[f"d{n}"] = torch.empty_like(like) if self._wanted(given, needs, n) else None
        self._run_backward(cots, given, cks, grads, None, opts, args[-1])
        out = tuple(stand_in.new_empty((0,)) if g is None else g for g in grads.values())
        return out[0] if len(out) == 1 else out

    def _backward_fake(self, *args):
        cots, given, _, _, needs = self._split(
            args,
            self.cotangents,
            [*self.reads, *self.unread],
            self.checkpoints,
            self.backward_options,
            [f"need_d{n}" for n in self.optional],
        )
        stand_in = next(given[r] for r in self.reads if self.shape[r] == _ROWS)
        out = tuple(
            torch.empty_like(given.get(n, stand_in))
            if self._wanted(given, needs, n)
            else stand_in.new_empty((0,))
            for n in self.inputs
        )
        return out[0] if len(out) == 1 else out

    # -- autograd -----------------------------------------------------------------------------

    def _setup(self, ctx, inputs, output) -> None:
        ins, opts = self._split(inputs, self.inputs, self.options)
        results = output if isinstance(output, tuple) else (output,)
        outs = dict(zip(self.outputs, results))
        cks = results[len(self.outputs) :]
        held = [ins[n] if n in ins else outs[n] for n in (*self.reads, *self.unread)]
        ctx.save_for_backward(*held, *cks)
        ctx.options = [opts[n] for n in self.backward_options]
        ctx.backend = inputs[-1]
        if cks:
            ctx.mark_non_differentiable(*cks)

    def _grad(self, ctx, *cotangents):
        saved = ctx.saved_tensors
        n_held = len(self.reads) + len(self.unread)
        held = dict(zip([*self.reads, *self.unread], saved[:n_held]))
        cots = [_last_axis_contiguous(d) for d in cotangents[: len(self.outputs)]]
        needs = [
            held.get(n) is not None and ctx.needs_input_grad[self.inputs.index(n)]
            for n in self.optional
        ]
        grads = self.backward(
            *cots, *held.values(), *saved[n_held:], *ctx.options, *needs, ctx.backend
        )
        grads = grads if isinstance(grads, tuple) else (grads,)
        wanted = dict(zip(self.optional, needs))
        grads = tuple(g if wanted.get(n, True) else None for n, g in zip(self.inputs, grads))
        grads = _no_double_backward(self.front.name, (*cots, *held.values()), grads)
        return (*grads, *(None for _ in self.options), None)

    # -- the autograd front -------------------------------------------------------------------

    def record(self, fn: str, arrays: dict, options: dict):
        """Run an allocating front call through the functional op (autograd records it)."""
        if options.get("checkpoints") is not None:
            raise ValueError(
                f"{fn}: checkpoints= feeds the explicit backward ({fn}_backward); with autograd "
                "recording this call (an input requires grad), autograd saves the checkpoints "
                f"itself. Drop checkpoints=, or call {fn} under torch.no_grad() to keep them"
            )
        rules = {"positive_finite": check.positive_finite, "finite": check.finite}
        values = [rules[o.rule](fn, o.name, options[o.name]) for o in self.sig.options]
        ins = [primal(arrays[n]) for n in self.inputs]
        results = self.functional(*ins, *values, backend_choice(options))
        results = results if isinstance(results, tuple) else (results,)
        outs = results[: len(self.outputs)]
        return outs[0] if len(outs) == 1 else outs


@functools.cache
def _traced_choice():
    """The explicit choice as a constant of the traced graph (defined on first trace: decorating
    at import would import ``torch._dynamo``, and with it triton)."""
    return torch._dynamo.assume_constant_result(lambda backend: _explicit_choice(backend)[0])


def backend_choice(options) -> str | None:
    """The explicit backend choice in force for this call (keyword, use_backend, env), or None.

    Under ``torch.compile`` the choice in force when the graph is traced is
    baked into it (a context variable cannot be read inside a graph).
    """
    if torch.compiler.is_compiling():
        return _traced_choice()(options["backend"])
    return _explicit_choice(options["backend"])[0]


def _declared_ops(name: str) -> _Ops:
    """The ops of the declared primitive ``name``, over its front module ``xpkernels.<name>``."""
    module = importlib.import_module(f"xpkernels.{name}")
    return _Ops(module._PRIMITIVE)


_DECLARED = [_declared_ops(name) for name, p in PRIMITIVES.items() if p.signature.kind == "rows"]

#: Primitive -> its autograd front ``(fn, arrays, options) -> result``.
FRONTS = {ops.front.name: ops.record for ops in _DECLARED}

#: Every op registered here, by its name in the ``xpkernels`` namespace.
OPS = tuple(sorted(op._qualname.split("::", 1)[1] for ops in _DECLARED for op in ops.ops))
