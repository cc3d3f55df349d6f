"""The functional ops on CUDA, visible to ``torch.compile``: ``torch.library.triton_op`` twins.

A ``torch.library.custom_op`` is opaque to ``torch.compile``: Inductor calls
it as a black box. Each functional op of :mod:`xpkernels.torch._declared` that the
Triton backend serves (forward and backward) is therefore defined twice from
one implementation:

- ``xpkernels::p`` -- the custom op users and autograd call, on every
  backend and device;
- ``xpkernels::p_triton`` -- a ``torch.library.triton_op`` over the same
  implementation with ``backend="triton"`` (defined when a trace first
  needs it), whose launches go through
  ``torch.library.wrap_triton`` while torch traces (see
  ``xpkernels.backends.triton._common.traced``).

When AOTAutograd functionalizes a graph (``torch.compile``, ``torch.export``
with custom-triton-op decomposition), ``xpkernels::p`` on CUDA tensors that
route to the Triton backend is replaced by its twin, whose implementation is
traced with fake tensors: the graph Inductor compiles holds the Triton
kernels themselves (``triton_kernel_wrapper_functional`` nodes), their grids
and arguments. Every other call (CPU, the cupy or array_api backend, a
Triton backend that cannot serve the call) stays the opaque custom op.
Tracing reads shapes, strides and dtypes only: no ``.item()``, no NumPy, no
device query inside the graph.
"""

from __future__ import annotations

import importlib.util
import os
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from xpkernels.backends.protocol import PRIMITIVES

from ..registry import BackendError, resolve

__all__ = ["TWINS", "functional_op"]

#: Functional op name -> its ``triton_op`` twin, once a trace has needed it.
TWINS: dict[str, object] = {}
_LOCK = threading.Lock()

_TRACED_TYPES = (torch.Tensor, FakeTensor, FunctionalTensor)


def _routes_to_triton(primitive: str, args) -> bool:
    """Whether a call with these (fake) arguments runs compiled Triton kernels.

    That is CUDA tensors in practice: kernels run by the Triton interpreter
    (``TRITON_INTERPRET=1``, CPU tensors) execute eagerly and cannot be traced.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    head_dim = None
    if PRIMITIVES[primitive].signature.kind in ("attention", "decode"):
        head_dim = max(t.shape[-1] for t in tensors if t.dtype.is_floating_point)
    arrays = {f"arg{i}": t for i, t in enumerate(tensors)}
    try:
        route = resolve(primitive, arrays, backend=args[-1], head_dim=head_dim)
    except (BackendError, TypeError):
        return False
    return route.backend == "triton"


def _twin(name: str, fn):
    """The ``triton_op`` twin of ``xpkernels::name``, defined on first use.

    Defining one imports triton (and ``torch._inductor``), which importing
    ``xpkernels.torch`` must not: ``TRITON_INTERPRET`` may still be set after
    it, before triton is first imported.
    """
    with _LOCK:
        twin = TWINS.get(name)
        if twin is None:
            twin = torch.library.triton_op(f"xpkernels::{name}_triton", fn, mutates_args=())
            TWINS[name] = twin
        return twin


def _decompose_on_triton(name: str, fn):
    """A FunctionalTensorMode rule: trace the twin when the call routes to compiled Triton kernels."""
    primitive = name.removesuffix("_backward")

    def rule(mode, op, types, args, kwargs):
        plain = all(issubclass(t, _TRACED_TYPES) for t in types)
        if kwargs or not plain or not _routes_to_triton(primitive, args):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        twin = _twin(name, fn)
        with mode:
            return twin(*args[:-1], "triton")

    return rule


def functional_op(name: str):
    """Decorator: the functional custom op ``xpkernels::name``, traced into Triton on CUDA.

    ``name`` is the op's name in the ``xpkernels`` namespace; the
    implementation's last parameter must be ``backend: str | None``.
    """

    def define(fn):
        op = torch.library.custom_op(f"xpkernels::{name}", fn, mutates_args=())
        if importlib.util.find_spec("triton") is not None:
            op.register_torch_dispatch(FunctionalTensorMode, _decompose_on_triton(name, fn))
        return op

    return define
