"""xpkernels: differentiable fused transformer kernels over caller-owned buffers.

RMSNorm, LayerNorm, softmax, SwiGLU, fused attention, split-KV decode attention,
FlexAttention and the merge of partial attention states, each with an
in-place forward and an in-place backward, on NumPy, CuPy and PyTorch arrays
(any Array API namespace). Importing this package imports no torch, cupy or
triton: every name below is loaded lazily.
"""

from __future__ import annotations

import importlib
import sys
import types

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
    "rms_norm": ("rms_norm", "rms_norm_", "rms_norm_backward", "rms_norm_backward_"),
    "layer_norm": ("layer_norm", "layer_norm_", "layer_norm_backward", "layer_norm_backward_"),
    "softmax": ("softmax", "softmax_", "softmax_backward", "softmax_backward_"),
    "swiglu": ("swiglu", "swiglu_", "swiglu_backward", "swiglu_backward_"),
    "attention": ("attention", "attention_", "attention_backward", "attention_backward_"),
    "attention_varlen": (
        "attention_varlen",
        "attention_varlen_",
        "attention_varlen_backward",
        "attention_varlen_backward_",
    ),
    "decode_attention": ("decode_attention", "decode_attention_"),
    "flex_attention": (
        "flex_attention",
        "flex_attention_",
        "flex_attention_backward",
        "flex_attention_backward_",
    ),
    "flex_attention_varlen": (
        "flex_attention_varlen",
        "flex_attention_varlen_",
        "flex_attention_varlen_backward",
        "flex_attention_varlen_backward_",
    ),
    "merge_attention_states": (
        "merge_attention_states",
        "merge_attention_states_",
        "merge_attention_states_backward",
        "merge_attention_states_backward_",
    ),
}
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
