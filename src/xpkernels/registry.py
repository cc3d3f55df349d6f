"""Backends and routing.

Each call is routed by the namespace and device of its arrays:

==================  ======  ============  =========================================
namespace           device  backend       if that backend cannot serve the call
==================  ======  ============  =========================================
numpy               cpu     ``array_api``  -- (``cupy`` only when asked for, inside
                                          ``xpkernels.testing.cudacpu.emulate()``)
torch               cuda    ``triton``    ``array_api`` on torch ops, warned once
torch               cpu     ``array_api``  -- (``triton`` only when asked for)
cupy                cuda    ``cupy``      ``array_api`` on cupy ops, warned once
                                          (calls its capabilities do not cover,
                                          e.g. float64 or a per-call feature it
                                          lacks: see ``xk.backends()``)
any other           any     ``array_api``  --
==================  ======  ============  =========================================

An explicit choice -- the ``backend=`` keyword > ``with use_backend(name):`` >
the environment variable ``XPKERNELS_BACKEND`` -- never falls back: when that
backend cannot serve the arrays, :class:`BackendError` says why.

Each backend package declares itself (``BACKEND``, a
``xpkernels.backends.protocol.Backend``: name, namespaces, devices, module,
requirements, per-op capabilities, hooks and scratch, its device check);
:data:`BACKEND_PACKAGES` lists the packages and :data:`BACKENDS` their
declarations. Routing only asks a declaration ``supports(op, call)``; it never
names a backend in its logic, never imports a library the caller did not use,
and nothing is swapped at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import array_api_compat

from xpkernels.backends.protocol import (
    FLOAT_DTYPES,
    OPS,
    PRIMITIVES,
    Backend,
    Call,
    Capability,
    Support,
)

__all__ = [
    "BackendError",
    "Capability",
    "Backend",
    "BackendInfo",
    "Route",
    "Support",
    "BACKENDS",
    "BACKEND_PACKAGES",
    "FLOAT_DTYPES",
    "OPS",
    "backends",
    "use_backend",
    "resolve",
    "namespace_name",
    "device_kind",
    "dtype_name",
]

ENV_VAR = "XPKERNELS_BACKEND"


class BackendError(RuntimeError):
    """An explicitly chosen backend cannot serve the call; the message says why."""


#: The backend packages, in listing order; each declares ``BACKEND`` (a
#: ``protocol.Backend``) in its ``__init__`` and imports nothing heavy there.
BACKEND_PACKAGES = (
    "xpkernels.backends.array_api",
    "xpkernels.backends.triton",
    "xpkernels.backends.cupy",
)
#: The backend every automatic route ends at when no preferred one can serve it.
FALLBACK = "array_api"

BACKENDS: tuple[Backend, ...] = tuple(importlib.import_module(p).BACKEND for p in BACKEND_PACKAGES)

# (namespace, device kind) -> the backend the automatic route prefers there.
PREFERRED: dict[tuple[str, str], str] = {("torch", "cuda"): "triton", ("cupy", "cuda"): "cupy"}

_BY_NAME = {b.name: b for b in BACKENDS}
#: The innermost use_backend's name: a backend, "" for use_backend(None) (automatic routing,
#: over the environment variable too), None outside every use_backend block.
_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "xpkernels_backend", default=None
)
_WARNED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`backends`: a backend, whether it can run here, and why not."""

    name: str
    available: bool
    reason: str
    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    ops: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """Where a call goes: the backend's name, its op module, the array namespace and the declaration.

    The fronts call ``impl.forward`` / ``impl.backward`` and reach the optional
    hooks and the scratch declaration through the route, never by probing
    the module.
    """

    backend: str
    impl: ModuleType
    xp: Any
    op: str
    capability: Capability

    def hook(self, name: str) -> Callable[..., Any]:
        """The backend's hook ``name`` (``partials``...), or the protocol's default when undeclared."""
        return self.capability.hook(self.impl, self.op, name)

    def needs(self, field_name: str) -> bool:
        """Whether the backend's passes use scratch field ``field_name``."""
        return field_name in self.capability.scratch_fields(self.op)

    def require_scratch(self, fn: str, scratch) -> None:
        """ValueError naming the first field the backend needs that ``scratch`` holds as None."""
        for name in self.capability.scratch_fields(self.op):
            if getattr(scratch, name) is None:
                raise ValueError(
                    f"{fn}: scratch.{name} is None but backend {self.backend!r} needs it; allocate "
                    f"the scratch with allocate_scratchspace(..., backend={self.backend!r})"
                )


def namespace_name(xp) -> str:
    """Short name of an array namespace: numpy, torch, cupy, array_api_strict, or its module name."""
    for name, test in (
        ("numpy", array_api_compat.is_numpy_namespace),
        ("torch", array_api_compat.is_torch_namespace),
        ("cupy", array_api_compat.is_cupy_namespace),
        ("array_api_strict", array_api_compat.is_array_api_strict_namespace),
    ):
        if test(xp):
            return name
    return getattr(xp, "__name__", repr(xp))


def device_kind(x) -> str:
    """The kind of device an array lives on: ``cpu``, ``cuda``, or the device's name."""
    if array_api_compat.is_torch_array(x):
        return x.device.type
    if array_api_compat.is_cupy_array(x):
        return "cuda"
    if array_api_compat.is_numpy_array(x):
        return "cpu"
    dev = array_api_compat.device(x)
    text = str(dev).lower()
    return "cpu" if "cpu" in text else text


def dtype_name(xp, dtype) -> str:
    """Name of a floating dtype in ``FLOAT_DTYPES``, else ``str(dtype)``."""
    for name in FLOAT_DTYPES:
        candidate = getattr(xp, name, None)
        if candidate is not None and candidate == dtype:
            return name
    return str(dtype)


def backends() -> list[BackendInfo]:
    """Every declared backend, whether it is available on this machine, and why not.

    Returns
    -------
    list of BackendInfo
    """
    rows = []
    for b in BACKENDS:
        support = b.availability()
        rows.append(
            BackendInfo(b.name, support.ok, support.reason, b.namespaces, b.devices, tuple(b.ops))
        )
    return rows


@contextlib.contextmanager
def use_backend(name: str | None):
    """Route every call inside the block to backend ``name`` (``None`` restores automatic
    routing, over the ``XPKERNELS_BACKEND`` environment variable too).

    An explicit choice never falls back: calls it cannot serve raise BackendError.
    """
    if name is not None and name not in _BY_NAME:
        raise BackendError(f"use_backend: unknown backend {name!r}; known: {', '.join(_BY_NAME)}")
    token = _CHOICE.set("" if name is None else name)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def _explicit_choice(backend: str | None) -> tuple[str | None, str]:
    if backend is not None:
        return backend, "backend="
    chosen = _CHOICE.get()
    if chosen == "":
        return None, ""
    if chosen is not None:
        return chosen, "use_backend()"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, ENV_VAR
    return None, ""


def resolve(
    op: str,
    arrays: Mapping[str, Any],
    *,
    backend: str | None = None,
    head_dim: int | None = None,
    features: tuple[str, ...] = (),
) -> Route:
    """Choose the backend for one call.

    Parameters
    ----------
    op : str
        The primitive (``"rms_norm"``...).
    arrays : mapping of str to array or None
        The call's arrays by argument name (None entries are ignored). Their
        namespaces and devices must agree.
    backend : str, optional
        Explicit choice; overrides ``use_backend`` and ``XPKERNELS_BACKEND``.
    head_dim : int, optional
        Largest head dim of an attention call, checked against capabilities.
    features : tuple of str
        Per-call features the call asks for (``protocol.FEATURES``), checked
        against what each capability ``lacks``.

    Returns
    -------
    Route

    Raises
    ------
    TypeError
        Arrays from different namespaces or devices (names them).
    BackendError
        An explicit choice that is unknown or cannot serve the call.
    """
    kernels = PRIMITIVES[op].rows_of or op  # the op whose backend modules run the call
    named = [(k, v) for k, v in arrays.items() if v is not None]
    first_name, first = named[0]
    xp = array_api_compat.array_namespace(first)
    ns = namespace_name(xp)
    dev = array_api_compat.device(first)
    for name, a in named[1:]:
        try:
            other = array_api_compat.array_namespace(a)
        except TypeError:
            raise TypeError(f"{op}: {name} is not an array (got {type(a).__name__})") from None
        if namespace_name(other) != ns:
            raise TypeError(
                f"{op}: {name} is a {namespace_name(other)} array but {first_name} is a {ns} array; "
                "all arrays of a call must come from one namespace"
            )
        if array_api_compat.device(a) != dev:
            raise TypeError(
                f"{op}: {name} is on device {array_api_compat.device(a)} but {first_name} is on "
                f"{dev}; all arrays of a call must be on one device"
            )
    # by name: NumPy cannot classify ml_dtypes' bfloat16, and integer arrays do not count
    dtypes = {dtype_name(xp, a.dtype) for _, a in named} & set(FLOAT_DTYPES)
    kind = device_kind(first)
    call = Call(ns, kind, tuple(sorted(dtypes)), head_dim, tuple(features))

    chosen, source = _explicit_choice(backend)
    if chosen is not None:
        spec = _BY_NAME.get(chosen)
        if spec is None:
            raise BackendError(
                f"{op}: unknown backend {chosen!r} (from {source}); known: {', '.join(_BY_NAME)}"
            )
        support = spec.supports(kernels, call)
        if not support:
            raise BackendError(
                f"{op}: backend {chosen!r} (from {source}) cannot serve {ns} arrays on {kind}: {support.reason}"
            )
        return _route(spec, kernels, xp)

    preferred = PREFERRED.get((ns, kind))
    if preferred is not None:
        spec = _BY_NAME[preferred]
        support = spec.supports(kernels, call)
        if support:
            return _route(spec, kernels, xp)
        key = (preferred, op, support.reason)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(
                f"xpkernels: {op} on {ns} {kind} arrays falls back to the array_api backend "
                f"because backend {preferred!r} cannot serve it: {support.reason}",
                RuntimeWarning,
                stacklevel=3,
            )
    return _route(_BY_NAME[FALLBACK], kernels, xp)


def _route(spec: Backend, op: str, xp) -> Route:
    return Route(spec.name, importlib.import_module(f"{spec.module}.{op}"), xp, op, spec.ops[op])
