"""Backends and routing.

Each call is routed by the namespace and device of its arrays:

==================  ======  ============  =========================================
namespace           device  backend       if that backend cannot serve the call
==================  ======  ============  =========================================
numpy               cpu     ``array_api``  --
torch               cuda    ``triton``    ``array_api`` on torch ops, warned once
torch               cpu     ``array_api``  -- (``triton`` only when asked for)
any other           any     ``array_api``  --
==================  ======  ============  =========================================

An explicit choice -- the ``backend=`` keyword > ``with use_backend(name):`` >
the environment variable ``XPKERNELS_BACKEND`` -- never falls back: when that
backend cannot serve the arrays, :class:`BackendError` says why.

Backends are declared in :data:`BACKENDS` (name, namespaces, devices, module,
requirements, per-op capabilities). Routing never imports a library the caller
did not use, and nothing is swapped at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import array_api_compat

__all__ = [
    "BackendError",
    "Capability",
    "Backend",
    "BackendInfo",
    "Route",
    "BACKENDS",
    "backends",
    "use_backend",
    "resolve",
    "namespace_name",
    "device_kind",
    "dtype_name",
]

ENV_VAR = "XPKERNELS_BACKEND"
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
OPS = (
    "rms_norm",
    "layer_norm",
    "softmax",
    "attention",
    "decode_attention",
    "flex_attention",
)


class BackendError(RuntimeError):
    """An explicitly chosen backend cannot serve the call; the message says why."""


@dataclass(frozen=True)
class Capability:
    """What one backend's implementation of one op accepts.

    Attributes
    ----------
    dtypes : tuple of str
        Input dtypes it computes in (names from ``FLOAT_DTYPES``).
    max_head_dim : int or None
        Largest attention head dim (D and Dv) it supports; None for no limit.
    """

    dtypes: tuple[str, ...]
    max_head_dim: int | None = None


@dataclass(frozen=True)
class Backend:
    """A declared backend.

    Attributes
    ----------
    name : str
        Routing name (``backend="..."``).
    namespaces : tuple of str
        Array namespaces it serves (``namespace_name``); ``("*",)`` for any.
    devices : tuple of str
        Device kinds it serves (``device_kind``); ``("*",)`` for any.
    module : str
        Package holding one module per op (``<module>.<op>``).
    requires : tuple of str
        Importable modules it needs; checked with ``find_spec``, not imported.
    ops : mapping of str to Capability
        The ops it implements and what each accepts.
    """

    name: str
    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    module: str
    requires: tuple[str, ...]
    ops: Mapping[str, Capability] = field(default_factory=dict)


_ALL = ("*",)
_ARRAY_API_ALL = Capability(dtypes=FLOAT_DTYPES)
_TRITON_NORM = Capability(dtypes=("float32", "float16", "bfloat16"))
_TRITON_ATTN = Capability(dtypes=("float32", "float16", "bfloat16"), max_head_dim=256)

BACKENDS: tuple[Backend, ...] = (
    Backend(
        name="array_api",
        namespaces=_ALL,
        devices=_ALL,
        module="xpkernels.backends.array_api",
        requires=(),
        ops={op: _ARRAY_API_ALL for op in OPS},
    ),
    Backend(
        name="triton",
        namespaces=("torch",),
        devices=("cuda", "cpu"),
        module="xpkernels.backends.triton",
        requires=("torch", "triton"),
        ops={
            "rms_norm": _TRITON_NORM,
            "layer_norm": _TRITON_NORM,
            "softmax": _TRITON_NORM,
            "attention": _TRITON_ATTN,
            "decode_attention": _TRITON_ATTN,
        },
    ),
)

# (namespace, device kind) -> the backend the automatic route prefers there.
PREFERRED: dict[tuple[str, str], str] = {("torch", "cuda"): "triton"}

_BY_NAME = {b.name: b for b in BACKENDS}
_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("xpkernels_backend", default=None)
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
    """Where a call goes: the backend's name, its op module and the array namespace."""

    backend: str
    impl: ModuleType
    xp: Any


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


def _missing_requirement(backend: Backend) -> str | None:
    for module in backend.requires:
        if module not in sys.modules and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def _triton_device_problem(device: str) -> str | None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "torch CPU tensors run Triton kernels only through the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing xpkernels' triton kernels"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "torch reports no CUDA device"
    return None


def _why_not(backend: Backend, op: str, ns: str, device: str, dtypes, head_dim) -> str | None:
    """The reason ``backend`` cannot serve this call, or None when it can."""
    missing = _missing_requirement(backend)
    if missing:
        return missing
    if backend.namespaces != _ALL and ns not in backend.namespaces:
        return f"it serves {', '.join(backend.namespaces)} arrays, not {ns}"
    if backend.devices != _ALL and device not in backend.devices:
        return f"it serves {', '.join(backend.devices)} devices, not {device}"
    capability = backend.ops.get(op)
    if capability is None:
        return f"it has no {op} kernel"
    for dt in dtypes:
        if dt not in capability.dtypes:
            return f"its {op} supports {', '.join(capability.dtypes)}, not {dt}"
    if head_dim is not None and capability.max_head_dim is not None and head_dim > capability.max_head_dim:
        return f"its {op} supports head dims up to {capability.max_head_dim}, not {head_dim}"
    if backend.name == "triton":
        return _triton_device_problem(device)
    return None


def backends() -> list[BackendInfo]:
    """Every declared backend, whether it is available on this machine, and why not.

    Returns
    -------
    list of BackendInfo
    """
    rows = []
    for b in BACKENDS:
        reason = _missing_requirement(b) or ""
        if not reason and b.name == "triton":
            cpu = _triton_device_problem("cpu")
            cuda = _triton_device_problem("cuda")
            if cpu and cuda:
                reason = f"{cuda}; {cpu}"
        rows.append(
            BackendInfo(b.name, not reason, reason, b.namespaces, b.devices, tuple(b.ops))
        )
    return rows


@contextlib.contextmanager
def use_backend(name: str | None):
    """Route every call inside the block to backend ``name`` (``None`` restores automatic routing).

    An explicit choice never falls back: calls it cannot serve raise BackendError.
    """
    if name is not None and name not in _BY_NAME:
        raise BackendError(f"use_backend: unknown backend {name!r}; known: {', '.join(_BY_NAME)}")
    token = _CHOICE.set(name)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def _explicit_choice(backend: str | None) -> tuple[str | None, str]:
    if backend is not None:
        return backend, "backend="
    chosen = _CHOICE.get()
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
    kind = device_kind(first)
    dtypes = {dtype_name(xp, a.dtype) for _, a in named if xp.isdtype(a.dtype, "real floating")}

    chosen, source = _explicit_choice(backend)
    if chosen is not None:
        spec = _BY_NAME.get(chosen)
        if spec is None:
            raise BackendError(f"{op}: unknown backend {chosen!r} (from {source}); known: {', '.join(_BY_NAME)}")
        reason = _why_not(spec, op, ns, kind, sorted(dtypes), head_dim)
        if reason:
            raise BackendError(f"{op}: backend {chosen!r} (from {source}) cannot serve {ns} arrays on {kind}: {reason}")
        return _route(spec, op, xp)

    preferred = PREFERRED.get((ns, kind))
    if preferred is not None:
        spec = _BY_NAME[preferred]
        reason = _why_not(spec, op, ns, kind, sorted(dtypes), head_dim)
        if reason is None:
            return _route(spec, op, xp)
        key = (preferred, op, reason)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(
                f"xpkernels: {op} on {ns} {kind} arrays falls back to the array_api backend "
                f"because backend {preferred!r} cannot serve it: {reason}",
                RuntimeWarning,
                stacklevel=3,
            )
    return _route(_BY_NAME["array_api"], op, xp)


def _route(spec: Backend, op: str, xp) -> Route:
    return Route(spec.name, importlib.import_module(f"{spec.module}.{op}"), xp)
