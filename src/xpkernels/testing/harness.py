"""Targets (backend x namespace x device), the OpSpec record, and how results are compared.

A primitive declares ONE :class:`OpSpec` in ``xpkernels/testing/specs/<op>.py``:
its cases, float64 inputs, its references (built on
:mod:`xpkernels.testing.references`), how to call its in-place and allocating
functions, its error inputs, an optional :class:`Backward`, and (where
PyTorch has the op) a torch float64 autograd oracle. The generic templates in
``conformance/test_templates.py`` run every spec on every available target
and dtype; ``python -m xpkernels check`` runs each spec's ``quick`` cases.

Arrays cross this boundary as NumPy float64 (references, oracles) or as
target arrays (kernels). Integer inputs (lengths) stay integer. Nothing here
imports torch, triton or pytest at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import pkgutil
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xpkernels.backends.protocol import PRIMITIVES
from xpkernels.registry import BACKENDS, FLOAT_DTYPES


@functools.cache
def cuda_torch() -> bool:
    """True when torch is installed and sees a CUDA device (imports torch only if installed)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def select_triton_interpreter() -> None:
    """Run Triton kernels through the interpreter when no CUDA device is present.

    Must run before any Triton kernel is defined (the conformance suite calls
    it on import); the CLI leaves the choice to the caller's environment.
    """
    if not cuda_torch():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_NAMESPACE_DTYPES = {
    "numpy": ("float64", "float32", "float16"),
    "torch": ("float64", "float32", "float16", "bfloat16"),
    "array_api_strict": ("float64", "float32"),
    "cupy": ("float64", "float32", "float16"),
}


@dataclass(frozen=True)
class Target:
    """One place a kernel runs: a backend on one namespace's arrays on one device.

    ``schedule`` is set on emulated targets only (:attr:`emulated`): the
    :mod:`xpkernels.testing.cudacpu` thread schedule their kernels run in.
    """

    backend: str
    namespace: str
    device: str
    schedule: str | None = None

    @property
    def id(self) -> str:
        base = f"{self.backend}-{self.namespace}-{self.device}"
        return base if self.schedule is None else f"{base}-{self.schedule}"

    @property
    def triton_interpreter(self) -> bool:
        """True when kernels run through the Triton interpreter (Triton on CPU tensors)."""
        return self.backend == "triton" and self.device == "cpu"

    @property
    def emulated(self) -> bool:
        """True when CUDA C kernels run on NumPy arrays through the CPU harness (``cudacpu``)."""
        return self.backend == "cupy" and self.namespace == "numpy"

    @property
    def interpreted(self) -> bool:
        """True when GPU kernels run through a slow CPU stand-in (interpreter, cudacpu): keep shapes small."""
        return self.triton_interpreter or self.emulated

    @property
    def label(self) -> str:
        """``"<namespace> <device>"``, as the CLI's table prints it."""
        text = f"{self.namespace} {self.device}"
        return text if self.schedule is None else f"{text} (cudacpu, {self.schedule})"

    def context(self):
        """The context its kernels must run in: ``cudacpu.emulate(schedule=...)`` when emulated."""
        if not self.emulated:
            return contextlib.nullcontext()
        from xpkernels.testing import cudacpu

        return cudacpu.emulate(schedule=self.schedule)

    def unavailable(self) -> str | None:
        """Why this target cannot run here (without the target's id), or None."""
        module = self.namespace
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        if self.backend == "triton" and importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if self.device == "cuda":
            if self.namespace == "torch" and not cuda_torch():
                return "no CUDA device"
            if self.namespace == "cupy":
                try:
                    import cupy

                    cupy.cuda.runtime.getDeviceCount()
                except Exception as exc:  # noqa: BLE001 - any failure means no usable device
                    return f"no CUDA device ({type(exc).__name__})"
        if self.triton_interpreter and os.environ.get("TRITON_INTERPRET") != "1":
            return "runs only through the Triton interpreter: set TRITON_INTERPRET=1 to include it"
        if self.emulated:
            cxx = os.environ.get("XPKERNELS_CUDACPU_CXX", "g++")
            if shutil.which(cxx) is None:
                return (
                    f"the CUDA-C-on-CPU harness needs the C++ compiler {cxx!r}, which is not found"
                )
        return None

    def dtypes(self, op: str) -> tuple[str, ...]:
        """Dtypes this target runs ``op`` in: the namespace's floats the backend declares (for
        ``op``, or for the op whose kernels it runs: ``Primitive.rows_of``)."""
        op = PRIMITIVES[op].rows_of or op
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

            t = torch.from_numpy(np.array(a, order="C"))  # rank 0 stays rank 0
            if dtype is not None:
                t = t.to(getattr(torch, dtype))
            return t.to(self.device)
        cast = a if dtype is None else a.astype(dtype)
        if self.namespace in ("cupy", "array_api_strict"):
            return importlib.import_module(self.namespace).asarray(cast)
        return np.array(cast)

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


#: Device kinds a namespace's arrays can live on (targets outside these cannot exist).
_NAMESPACE_DEVICES = {"numpy": ("cpu",), "array_api_strict": ("cpu",), "cupy": ("cuda",)}
#: cudacpu schedules every emulated target runs in: in order, then threads shuffled between barriers.
EMULATED_SCHEDULES = ("default", "shuffled")


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
                if dev not in _NAMESPACE_DEVICES.get(ns, (dev,)):
                    continue
                target = Target(b.name, ns, dev)
                if target.emulated:
                    targets.extend(
                        Target(b.name, ns, dev, schedule) for schedule in EMULATED_SCHEDULES
                    )
                else:
                    targets.append(target)
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
    quick : bool
        One of the cases ``python -m xpkernels check`` runs (float32, every target).
    dtypes : tuple of str or None
        The only dtypes the case runs in (None: every dtype of the target); a
        case that restricts them says why next to its declaration.
    """

    id: str
    params: dict
    interpreter: bool = False
    quick: bool = False
    dtypes: tuple[str, ...] | None = None

    def runs_in(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes


@dataclass(frozen=True)
class ErrorCase:
    """A bad call and the error it must raise.

    ``call(target)`` builds valid-looking arrays on ``target`` and makes the
    bad call; it must raise ``error`` with a message matching ``match``
    (a regular expression, searched). ``values=True`` marks an error found by
    reading the values of an integer array (lengths, positions): raised always
    for host arrays, and for device arrays only in debug mode (capture safety,
    DESIGN section 6) -- outside it the kernels clamp such values instead.
    ``every_backend=True`` marks a case whose call passes ``backend=target.backend``
    and runs on every target (else on the array_api targets only).
    """

    id: str
    call: Callable[[Target], Any]
    error: type
    match: str
    values: bool = False
    every_backend: bool = False


def _same_arrays(case: Case, arrays: dict, target: Target) -> dict:
    return arrays


@dataclass(frozen=True)
class Backward:
    """The backward half of an :class:`OpSpec` (absent for forward-only primitives).

    Attributes
    ----------
    grad_names : tuple of str
        The inputs that get gradients (keys of ``grads``); an optional input a
        case does not give (a bias) has none there.
    cotangents : callable
        ``(case, rng) -> {output name: float64 array}``: the output shadows.
    reference : callable
        ``(case, inputs, cotangents) -> {grad name: float64 array}``, naive.
    inplace : callable
        ``(case, arrays, outs, cotangents, grads, checkpoints, backend)``: the
        in-place backward writing into the shadows ``grads``.
    allocating : callable
        ``(case, arrays, outs, cotangents, checkpoints, backend) -> grads``.
    """

    grad_names: tuple[str, ...]
    cotangents: Callable[..., dict]
    reference: Callable[..., dict]
    inplace: Callable[..., None]
    allocating: Callable[..., dict]


@dataclass(frozen=True)
class OpSpec:
    """The declaration a primitive gives the conformance templates and ``check``.

    Array arguments are dicts by name: ``arrays`` holds the target arrays of
    ``inputs(...)``, ``outs`` the forward outputs by name.

    Attributes
    ----------
    name : str
        The primitive (a key of :data:`xpkernels.registry.OPS`).
    outputs : tuple of str
        The forward's output names.
    cases : tuple of Case
        Every declared input configuration (samples and larger ones).
    inputs : callable
        ``(case, rng) -> {name: float64 or integer NumPy array}``.
    reference : callable
        ``(case, inputs) -> (outputs, checkpoints)``, float64, naive.
    allocate_outputs : callable
        ``(case, arrays, target, dtype) -> outs``, NaN-filled.
    forward_ : callable
        ``(case, arrays, outs, checkpoints, backend)``: the in-place forward.
    forward : callable
        ``(case, arrays, checkpoints, backend) -> outs``: the allocating one.
    errors : callable
        ``() -> list of ErrorCase``.
    checkpoint_names : tuple of str
        Fields of the checkpoints tuple (empty: the primitive saves none).
    allocate_checkpoints : callable or None
        ``(case, arrays) -> checkpoints``; None when it saves none.
    arrange : callable
        ``(case, arrays, target) -> arrays``: lays inputs out as the case asks.
    backward : Backward or None
        None for a forward-only primitive: templates skip backward checks.
    torch_reference : callable or None
        ``(case, inputs, cotangents) -> (outputs, grads)`` from PyTorch's own
        op in float64; None where PyTorch has no such op.
    """

    name: str
    outputs: tuple[str, ...]
    cases: tuple[Case, ...]
    inputs: Callable[..., dict]
    reference: Callable[..., tuple[dict, dict]]
    allocate_outputs: Callable[..., dict]
    forward_: Callable[..., None]
    forward: Callable[..., dict]
    errors: Callable[[], list[ErrorCase]]
    checkpoint_names: tuple[str, ...] = ()
    allocate_checkpoints: Callable[..., Any] | None = None
    arrange: Callable[..., dict] = _same_arrays
    backward: Backward | None = None
    torch_reference: Callable[..., tuple[dict, dict]] | None = None

    @property
    def grad_names(self) -> tuple[str, ...]:
        return () if self.backward is None else self.backward.grad_names


def load_specs() -> list[OpSpec]:
    """Every ``SPEC`` declared in ``xpkernels/testing/specs/*.py``, in module-name order."""
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
    Matching infinities (a fully masked row's ``m = -inf``) count as equal.
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
    if not np.isfinite(diff).all():
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
        arrays[name] = target.asarray(a, dtype if a.dtype.kind == "f" else None)
        exact[name] = target.to_numpy(arrays[name])
    return arrays, exact


# --------------------------------------------------------------------------- running one case


def case_rng(spec: OpSpec, case: Case) -> np.random.Generator:
    """The generator of a case's inputs, then its cotangents: the same on every target."""
    return np.random.default_rng(zlib.crc32(f"{spec.name}/{case.id}".encode()))


def setup(spec: OpSpec, case: Case, target: Target, dtype: str):
    """``(rng, arrays, exact)``: the case's inputs on ``target`` in ``dtype``, laid out, and their exact values."""
    rng = case_rng(spec, case)
    arrays, exact = quantize(spec.inputs(case, rng), dtype, target)
    return rng, spec.arrange(case, arrays, target), exact


def cotangents(spec: OpSpec, case: Case, rng, target: Target, dtype: str) -> tuple[dict, dict]:
    """``(target arrays, exact values)`` of the output shadows (call after :func:`setup`)."""
    if spec.backward is None:
        raise ValueError(f"{spec.name} has no backward: it takes no cotangents")
    return quantize(spec.backward.cotangents(case, rng), dtype, target)


def nan_checkpoints(spec: OpSpec, case: Case, arrays: dict):
    """Freshly allocated checkpoints, every element NaN (None when the spec saves none)."""
    if not spec.checkpoint_names or spec.allocate_checkpoints is None:
        return None
    ck = spec.allocate_checkpoints(case, arrays)
    for name in ck._fields:
        getattr(ck, name)[...] = float("nan")
    return ck


def nan_grads(spec: OpSpec, arrays: dict, target: Target) -> dict:
    """NaN-filled input shadows by gradient name: an element left unwritten shows as an infinite error."""
    xp = target.xp
    return {
        name: xp.full_like(arrays[name], float("nan")) for name in spec.grad_names if name in arrays
    }


__all__ = [
    "Target",
    "TARGETS",
    "Case",
    "ErrorCase",
    "Backward",
    "OpSpec",
    "load_specs",
    "max_error",
    "assert_close",
    "quantize",
    "case_rng",
    "setup",
    "cotangents",
    "nan_checkpoints",
    "nan_grads",
    "cuda_torch",
    "select_triton_interpreter",
    "FLOAT_DTYPES",
]
