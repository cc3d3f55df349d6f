"""xpkernels: differentiable fused transformer kernels over caller-owned buffers.

RMSNorm, LayerNorm, softmax, fused attention, split-KV decode attention and
FlexAttention, each with an in-place forward and an in-place backward, on
NumPy, CuPy and PyTorch arrays (any Array API namespace). Importing this
package imports no torch, cupy or triton: every name below is loaded lazily.
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
    "registry": ("BackendError", "backends", "use_backend"),
    "rms_norm": ("rms_norm", "rms_norm_", "rms_norm_backward", "rms_norm_backward_"),
    "layer_norm": ("layer_norm", "layer_norm_", "layer_norm_backward", "layer_norm_backward_"),
    "softmax": ("softmax", "softmax_", "softmax_backward", "softmax_backward_"),
    "attention": ("attention", "attention_", "attention_backward", "attention_backward_"),
    "decode_attention": ("decode_attention", "decode_attention_"),
    "flex_attention": (
        "flex_attention",
        "flex_attention_",
        "flex_attention_backward",
        "flex_attention_backward_",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*sorted(_WHERE), "__version__"]


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'xpkernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return __all__


class _Package(types.ModuleType):
    """Keeps ``xpkernels.rms_norm`` and ``xpkernels.backends`` the functions when same-named modules load.

    Importing a submodule sets it as an attribute of its package. Where a
    public function shares a submodule's name (the primitives' files, and the
    ``backends`` subpackage vs ``registry.backends``), store the function
    instead; the module stays reachable through ``sys.modules``.
    """

    def __setattr__(self, name, value):
        source = _WHERE.get(name)
        if isinstance(value, types.ModuleType) and source is not None:
            value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
