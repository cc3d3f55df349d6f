"""The conformance harness: targets (backend x namespace x device), op specs, comparison.

A primitive declares ONE ``OpSpec`` subclass in ``conformance/specs/<op>.py``:
its cases, float64 inputs, naive float64 references, how to call its
in-place and allocating functions, its error inputs, and (where PyTorch has
the op) a torch float64 autograd oracle. The generic templates in
``test_templates.py`` run every spec on every available target and dtype.

Arrays cross this boundary as NumPy float64 (references, oracles) or as
target arrays (kernels). Integer inputs (lengths) stay integer.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xpkernels.registry import BACKENDS, FLOAT_DTYPES

# The Triton interpreter must be chosen before any Triton kernel is defined.
_HAS_CUDA_TORCH = False
if importlib.util.find_spec("torch") is not None:
    import torch

    _HAS_CUDA_TORCH = torch.cuda.is_available()
if not _HAS_CUDA_TORCH:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_NAMESPACE_DTYPES = {
    "numpy": ("float64", "float32", "float16"),
    "torch": ("float64", "float32", "float16", "bfloat16"),
    "array_api_strict": ("float64", "float32"),
    "cupy": ("float64", "float32", "float16"),
}


@dataclass(frozen=True)
class Target:
    """One place a kernel runs: a backend on one namespace's arrays on one device."""

    backend: str
    namespace: str
    device: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.namespace}-{self.device}"

    @property
    def interpreted(self) -> bool:
        """True when kernels run through the (slow) Triton interpreter: keep shapes small."""
        return self.backend == "triton" and self.device == "cpu"

    def unavailable(self) -> str | None:
        """Why this target cannot run here, or None."""
        module = {"numpy": "numpy", "torch": "torch", "array_api_strict": "array_api_strict", "cupy": "cupy"}[
            self.namespace
        ]
        if importlib.util.find_spec(module) is None:
            return f"{self.id}: {module} is not installed"
        if self.backend == "triton" and importlib.util.find_spec("triton") is None:
            return f"{self.id}: triton is not installed"
        if self.device == "cuda":
            if self.namespace == "torch" and not _HAS_CUDA_TORCH:
                return f"{self.id}: no CUDA device"
            if self.namespace == "cupy":
                try:
                    import cupy

                    cupy.cuda.runtime.getDeviceCount()
                except Exception as exc:  # noqa: BLE001 - any failure means no usable device
                    return f"{self.id}: no CUDA device ({type(exc).__name__})"
        if self.interpreted and os.environ.get("TRITON_INTERPRET") != "1":
            return f"{self.id}: TRITON_INTERPRET=1 is not set (a CUDA device is present)"
        return None

    def dtypes(self, op: str) -> tuple[str, ...]:
        """Dtypes this target runs ``op`` in: the namespace's floats the backend declares."""
        capability = next(b for b in BACKENDS if b.name == self.backend).ops.get(op)
        if capability is None:
            return ()
        return tuple(d for d in _NAMESPACE_DTYPES[self.namespace] if d in capability.dtypes)

    @property
    def xp(self):
        import array_api_compat

        return array_api_compat.array_namespace(self.asarray(np.zeros(1), "float32"))

    def dtype(self, name: str):
        mod = importlib.import_module(self.namespace)
        return getattr(mod, name)

    def asarray(self, a: np.ndarray, dtype: str | None = None):
        """``a`` on this target, as ``dtype`` (integers keep their dtype when dtype is None)."""
        a = np.asarray(a)
        if self.namespace == "torch":
            import torch

            t = torch.from_numpy(np.ascontiguousarray(a))
            if dtype is not None:
                t = t.to(getattr(torch, dtype))
            return t.to(self.device)
        if self.namespace == "cupy":
            import cupy

            return cupy.asarray(a if dtype is None else a.astype(dtype))
        if self.namespace == "array_api_strict":
            import array_api_strict

            return array_api_strict.asarray(a if dtype is None else a.astype(dtype))
        return np.array(a if dtype is None else a.astype(dtype))

    def leading_transposed(self, a):
        """Same values as ``a`` (rank 3), in a buffer whose first two axes are swapped in memory.

        The result's leading axes do not collapse into one without a copy;
        its last axis stays contiguous.
        """
        xp = self.xp
        swapped = xp.asarray(xp.permute_dims(a, (1, 0, 2)), copy=True)
        return xp.permute_dims(swapped, (1, 0, 2))

    def full(self, shape, value: float, dtype: str):
        return self.asarray(np.full(shape, value, dtype=np.float64), dtype)

    def to_numpy(self, a) -> np.ndarray:
        """``a`` as a NumPy float64 array (integers stay integers)."""
        if self.namespace == "torch":
            t = a.detach().cpu()
            return (t.double() if t.is_floating_point() else t).numpy()
        if self.namespace == "cupy":
            a = a.get()
        if self.namespace == "array_api_strict":
            a = np.asarray(a._array)
        a = np.asarray(a)
        return a.astype(np.float64) if a.dtype.kind == "f" else a


def _candidate_targets() -> list[Target]:
    targets = [
        Target("array_api", "numpy", "cpu"),
        Target("array_api", "torch", "cpu"),
        Target("array_api", "array_api_strict", "cpu"),
        Target("array_api", "torch", "cuda"),
        Target("array_api", "cupy", "cuda"),
    ]
    for b in BACKENDS:
        if b.name == "array_api":
            continue
        for ns in b.namespaces:
            for dev in b.devices:
                targets.append(Target(b.name, ns, dev))
    return targets


TARGETS = _candidate_targets()


@dataclass(frozen=True)
class Case:
    """One declared input configuration of a primitive.

    Attributes
    ----------
    id : str
        Test id fragment.
    params : dict
        Shapes and options, interpreted by the spec.
    interpreter : bool
        Small enough for the Triton interpreter (tile boundaries still crossed).
    """

    id: str
    params: dict
    interpreter: bool = False


@dataclass(frozen=True)
class ErrorCase:
    """A bad call and the error it must raise.

    ``call(target)`` builds valid-looking arrays on ``target`` and makes the
    bad call; it must raise ``error`` with a message matching ``match``
    (a regular expression, searched).
    """

    id: str
    call: Callable[[Target], Any]
    error: type
    match: str


@dataclass
class OpSpec(abc.ABC):
    """The declaration a primitive gives the conformance templates.

    Subclasses implement every method; array arguments are dicts by name.
    ``arrays`` holds the target arrays of ``inputs(...)``; ``outs`` the forward
    outputs by name; ``cotangents`` the output shadows by output name;
    ``grads`` the input shadows by input name (which inputs get gradients is
    ``grad_names``).
    """

    name: str
    outputs: tuple[str, ...]
    grad_names: tuple[str, ...]
    checkpoint_names: tuple[str, ...] = ()
    differentiable: bool = True
    torch_oracle: bool = True
    options: dict = field(default_factory=dict)

    @abc.abstractmethod
    def cases(self) -> list[Case]:
        ...

    @abc.abstractmethod
    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ...

    @abc.abstractmethod
    def cotangents(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ...

    @abc.abstractmethod
    def reference(self, case: Case, inputs: dict) -> tuple[dict, dict]:
        """Float64 ``(outputs, checkpoints)`` computed naively from ``inputs``."""
        ...

    @abc.abstractmethod
    def reference_backward(self, case: Case, inputs: dict, cotangents: dict) -> dict:
        """Float64 gradients of every name in ``grad_names``."""
        ...

    @abc.abstractmethod
    def torch_reference(self, case: Case, inputs: dict, cotangents: dict) -> tuple[dict, dict]:
        """PyTorch's own op in float64: ``(outputs, grads)`` as NumPy arrays."""
        ...

    @abc.abstractmethod
    def allocate_outputs(self, case: Case, arrays: dict, target: Target, dtype: str) -> dict:
        ...

    @abc.abstractmethod
    def allocate_checkpoints(self, case: Case, arrays: dict):
        ...

    @abc.abstractmethod
    def forward_(self, case: Case, arrays: dict, outs: dict, checkpoints, backend: str) -> None:
        ...

    @abc.abstractmethod
    def forward(self, case: Case, arrays: dict, checkpoints, backend: str) -> dict:
        ...

    @abc.abstractmethod
    def backward_(
        self, case: Case, arrays: dict, outs: dict, cotangents: dict, grads: dict, checkpoints, backend: str
    ) -> None:
        ...

    @abc.abstractmethod
    def backward(self, case: Case, arrays: dict, outs: dict, cotangents: dict, checkpoints, backend: str) -> dict:
        ...

    @abc.abstractmethod
    def errors(self) -> list[ErrorCase]:
        ...

    def arrange(self, case: Case, arrays: dict, target: Target) -> dict:
        """Lay the input arrays out as the case asks (strided views); identity by default."""
        return arrays


def load_specs() -> list[OpSpec]:
    """Every ``SPEC`` declared in ``conformance/specs/*.py``, in module-name order."""
    from . import specs

    found = []
    for info in sorted(pkgutil.iter_modules(specs.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{specs.__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if spec is not None:
            found.append(spec)
    return found


def max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max|actual - expected| / max(max|expected|, 1)``; inf where ``actual`` is NaN and ``expected`` is not.

    Normalising by the largest reference magnitude (never below 1) keeps one
    tolerance per dtype meaningful across outputs, gradients and sums.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != reference shape {expected.shape}")
    if actual.size == 0:
        return 0.0
    both_inf = np.isinf(expected) & (actual == expected)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf (masked rows' m)
        diff = np.where(both_inf, 0.0, np.abs(actual - expected))
    if np.isnan(diff).any():
        return float("inf")
    finite = np.isfinite(expected)
    scale = max(float(np.max(np.abs(expected[finite]), initial=0.0)), 1.0)
    return float(np.max(diff)) / scale


def assert_close(actual, expected, tol: float, what: str) -> float:
    """Fail with ``what`` and the measured error unless ``max_error <= tol``; returns the error."""
    err = max_error(actual, expected)
    assert err <= tol, f"{what}: error {err:.3g} > tolerance {tol:.3g}"
    return err


def quantize(inputs: dict, dtype: str, target: Target) -> tuple[dict, dict]:
    """Cast float inputs to ``dtype`` on ``target``; return (target arrays, their exact float64 values)."""
    arrays, exact = {}, {}
    for name, a in inputs.items():
        if a.dtype.kind == "f":
            arrays[name] = target.asarray(a, dtype)
        else:
            arrays[name] = target.asarray(a)
        exact[name] = target.to_numpy(arrays[name])
    return arrays, exact


__all__ = [
    "Target",
    "TARGETS",
    "Case",
    "ErrorCase",
    "OpSpec",
    "load_specs",
    "max_error",
    "assert_close",
    "quantize",
    "FLOAT_DTYPES",
]
