"""The front arguments a call traced by ``torch.compile`` fixes as constants of its graph.

Two values of a recorded front call cannot be traced: the explicit backend
choice (a context variable, the environment) and the integer key under
which a flex call files its mods (a registry entry). While ``torch.compile``
traces, :mod:`xpkernels.torch._declared` takes both from the functions here,
which ``torch.compiler.assume_constant_result`` marks: run once when the
graph is traced, their results are baked into it.

This module is imported only from inside traced code (an import statement
there runs for real), so its decorators run outside the traced frame;
importing it imports ``torch._dynamo`` -- and with it triton -- which
importing :mod:`xpkernels.torch` must not (``TRITON_INTERPRET`` may still be
set after it).
"""

from __future__ import annotations

import torch

from ..mods import MaskMod, ScoreMod
from ..registry import _explicit_choice
from . import _flex

__all__ = ["backend_choice", "file_key"]


@torch.compiler.assume_constant_result
def backend_choice(backend) -> str | None:
    """The explicit backend choice in force when the graph is traced."""
    return _explicit_choice(backend)[0]


@torch.compiler.assume_constant_result
def file_key(convert, value) -> int:
    """``convert(value)`` filed for the flex ops for the life of the process (the graph holds its key).

    A mod built inside the traced function reaches this call as the copy
    ``torch.compile`` rebuilds of it, without the graph its constructor
    traced: refused with a RuntimeError that says where to build it.
    """
    obj = convert(value)
    if isinstance(obj, (MaskMod, ScoreMod)) and "graph" not in vars(obj):
        raise RuntimeError(
            f"xpkernels: the {type(obj).__name__} of this torch.compile'd call was built inside "
            "the compiled function, and torch.compile hands xpkernels a copy of it without its "
            "traced graph; build mods outside the compiled function (once, e.g. as attributes "
            "of the module) and pass them in"
        )
    return _flex.file(obj, keep=True)
