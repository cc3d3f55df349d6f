"""The CuPy backend: CUDA C kernels (``<primitive>.cu``, shared device code in ``.cuh``).

Launchers (``<primitive>.py``) are written against the small module-loader
interface of :mod:`._loader`, so the same launchers and ``.cu`` files run on
a GPU through ``cupy.RawModule`` (NVRTC) and on the CPU through
:mod:`xpkernels.testing.cudacpu` (``with cudacpu.emulate(): ...``). Only CuPy
is imported on the GPU path: no torch, no triton. Every op has CUDA C
kernels: ``rms_norm``, ``layer_norm``, ``softmax``, ``swiglu``, ``geglu``,
``rope`` (forward and backward each), ``decode_attention``,
``attention`` (forward and backward; ``attention_varlen`` runs them per
sequence), ``flex_attention`` (forward and backward, the mods' CUDA C
generated per mod structure; ``flex_attention_varlen`` runs them per
sequence) and ``merge_attention_states`` (forward and backward). Routing
sends a flex backward asking for deterministic score-mod gradients to the
array_api backend (warned once; the cupy kernels add them with atomics:
``Capability.lacks``), as it does calls in dtypes the kernels lack.

Routing reads :data:`BACKEND`, which serves two kinds of calls:

- CuPy arrays on CUDA, when CuPy is installed and a device is present;
- NumPy arrays on the CPU, only while ``xpkernels.testing.cudacpu.emulate()``
  is active (it installs the CPU harness's loader, which :func:`device_problem`
  consults) and its C++ compiler is found. Outside it, ``backend="cupy"`` on
  NumPy arrays raises BackendError saying so; automatic routing never sends
  NumPy arrays here.

CuPy is therefore not a declared requirement (``requires=()``, so that the
emulated path needs no CuPy); :func:`device_problem` checks it for CUDA calls.
"""

import importlib.util
import os
import shutil
import sys

from xpkernels.backends.protocol import Backend, Capability

from . import _loader

_DTYPES = ("float32", "float16", "bfloat16")
_NORM = Capability(dtypes=_DTYPES, hooks=("partials", "reduce_partials"))
#: Largest decode head dim (``decode_attention.MAX_HEAD_DIM``; not imported, which would load NumPy).
_DECODE_HEAD_DIM = 256
#: Largest attention head dim (``attention.MAX_HEAD_DIM``, the largest padded ``DMAX`` compiled).
_ATTENTION_HEAD_DIM = 128
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
_ATTENTION = Capability(dtypes=_DTYPES, max_head_dim=_ATTENTION_HEAD_DIM, scratch=("delta",))
_FLEX = Capability(
    dtypes=_DTYPES,
    max_head_dim=_ATTENTION_HEAD_DIM,
    hooks=("default_tiles", "score_mod_workspace"),
    scratch=("delta",),
    lacks=("deterministic_score_mod_grad",),
)


def _emulating() -> bool:
    """True inside ``xpkernels.testing.cudacpu.emulate()`` (a loader is installed in this context)."""
    return _loader._installed.get() is not None


def _cuda_problem() -> str | None:
    if _emulating():
        return (
            "inside xpkernels.testing.cudacpu.emulate() the cupy backend serves NumPy arrays only"
        )
    cupy = sys.modules.get("cupy")
    if cupy is None:
        # The caller holds no CuPy arrays (e.g. xk.backends()): neither import CuPy nor start CUDA.
        if importlib.util.find_spec("cupy") is None:
            return "cupy is not installed"
        if not os.path.isdir(_NVIDIA_GPUS) or not os.listdir(_NVIDIA_GPUS):
            return f"no NVIDIA GPU found ({_NVIDIA_GPUS} is absent or empty)"
        return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CuPy raises its own error types when CUDA is unusable
        return f"cupy sees no CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "cupy sees no CUDA device"


def _cpu_problem() -> str | None:
    if not _emulating():
        return "NumPy arrays on the CPU run CUDA C only inside xpkernels.testing.cudacpu.emulate()"
    cxx = os.environ.get("XPKERNELS_CUDACPU_CXX", "g++")
    if shutil.which(cxx) is None:
        return f"cudacpu.emulate() needs the C++ compiler {cxx!r}, which is not found"
    return None


def device_problem(device: str) -> str | None:
    """Why the CUDA C kernels cannot run on arrays of this device kind here, or None.

    ``"cuda"`` (CuPy arrays): CuPy must be installed and see a device. CuPy is
    consulted only when the caller has imported it; otherwise its installation
    is found with ``find_spec`` and a GPU by the NVIDIA driver's
    ``/proc/driver/nvidia/gpus``, so CUDA is not initialised. ``"cpu"``
    (NumPy arrays): only inside ``cudacpu.emulate()``, with its compiler found.
    """
    if device == "cuda":
        return _cuda_problem()
    if device == "cpu":
        return _cpu_problem()
    return f"it serves cuda devices (cpu under cudacpu.emulate()), not {device}"


#: The declaration routing reads (``xpkernels.backends.protocol``).
BACKEND = Backend(
    name="cupy",
    namespaces=("cupy", "numpy"),
    devices=("cuda", "cpu"),
    module=__name__,
    requires=(),
    ops={
        "rms_norm": _NORM,
        "layer_norm": _NORM,
        "softmax": Capability(dtypes=_DTYPES),
        "swiglu": Capability(dtypes=_DTYPES),
        "geglu": Capability(dtypes=_DTYPES),
        # Forward and backward in one CUDA C kernel (rope.cu): 128-bit rows where the pair
        # layout allows; tables float32/float16/bfloat16/float64, shared or one per batch.
        "rope": Capability(dtypes=_DTYPES),
        # One block per logit row, looping over the vocabulary (cross_entropy.cu).
        "cross_entropy": Capability(dtypes=_DTYPES),
        # Forward and backward in CUDA C (wmma for float16/bfloat16, SIMT for float32; shared
        # memory per block: attention.shared_bytes and backward_shared_bytes, at most ~163 KiB);
        # the backward computes dQ in its own pass: no dq_accum scratch.
        "attention": _ATTENTION,
        # The attention kernels on each sequence's views (attention_varlen.py).
        "attention_varlen": _ATTENTION,
        "decode_attention": Capability(
            dtypes=_DTYPES, max_head_dim=_DECODE_HEAD_DIM, hooks=("default_splits",)
        ),
        # The attention kernels walking the tile plan's lists, with the mods' generated CUDA C
        # (flex_attention.py). Score-mod gradients are summed with float32 atomics: calls asking
        # for bit-identical ones (deterministic=True, the default) go to array_api.
        "flex_attention": _FLEX,
        # The flex kernels on each sequence's views (flex_attention_varlen.py).
        "flex_attention_varlen": _FLEX,
        # Forward and backward in CUDA C (G lanes per row, vector accesses where rows allow);
        # any head dim.
        "merge_attention_states": Capability(dtypes=_DTYPES),
    },
    device_problem=device_problem,
)
