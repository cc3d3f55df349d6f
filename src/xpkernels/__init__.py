"""xpkernels: differentiable fused transformer kernels over caller-owned buffers.

RMSNorm, LayerNorm, softmax, SwiGLU, GeGLU, RoPE, fused attention, split-KV decode
attention, FlexAttention, the merge of partial attention states, cross-entropy and
linear cross-entropy, each with an
in-place forward and an in-place backward, on NumPy, CuPy and PyTorch arrays
(any Array API namespace). Importing this package imports no torch, cupy or
triton: every name below is loaded lazily.
"""

from __future__ import annotations

import importlib
import sys
import types

from xpkernels.backends.protocol import PRIMITIVES  # the declarations: imports no array library

__version__ = "0.1.0"

_EXPORTS = {
    "buffers": (
        "Duplicated",
        "primal",
        "shadow",
        "allocate_checkpoints",
        "allocate_scratchspace",
        "grad_shadow",
    ),
    "registry": ("BackendError", "use_backend"),
    "_debug": ("debug", "debug_enabled"),
}
for _name, _primitive in PRIMITIVES.items():  # each declared primitive, from its own module
    _backward = (
        (f"{_name}_backward", f"{_name}_backward_") if "backward" in _primitive.functions() else ()
    )
    _EXPORTS[_name] = (_name, f"{_name}_", *_backward)
del _name, _primitive, _backward
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*sorted(_WHERE), "backends", "__version__"]


def __getattr__(name):
    if name == "backends":  # the subpackage, callable as registry.backends()
        return importlib.import_module(f"{__name__}.backends")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'xpkernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return __all__


class _Package(types.ModuleType):
    """Keeps ``xpkernels.rms_norm`` the function when the module ``xpkernels/rms_norm.py`` loads.

    Importing a submodule sets it as an attribute of its package; for the
    primitives whose function shares its file's name, store the function
    instead (the module stays reachable through ``sys.modules`` and
    ``from xpkernels.rms_norm import ...``).
    """

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _WHERE.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
