"""The module-loader interface the cupy backend's launchers are written against.

A loader provides

- ``module(path, name_expressions, options)``: the compiled ``.cu`` at
  ``path`` with those template instantiations, an object with
  ``get_function(name)`` returning a kernel callable as
  ``kernel(grid, block, args, shared_mem=0)`` (CuPy's call style);
- ``sm_count(like)``: multiprocessors of the device holding array ``like``.

:class:`CupyLoader` serves CuPy arrays through ``cupy.RawModule`` (NVRTC);
``xpkernels.testing.cudacpu.emulate()`` installs the CPU harness's loader
for NumPy arrays. Nothing here imports CuPy until a CuPy array is launched on.
"""

from __future__ import annotations

import contextvars
from pathlib import Path

__all__ = ["CupyLoader", "address", "install", "loader_for", "uninstall"]

_installed: contextvars.ContextVar = contextvars.ContextVar("xpkernels_cupy_loader", default=None)

#: NVRTC options of every module: C++17, and the backend's directory for ``#include "common.cuh"``.
OPTIONS = ("-std=c++17", f"-I{Path(__file__).resolve().parent}")


def install(loader):
    """Make ``loader`` serve launches in this context; returns the token for :func:`uninstall`."""
    return _installed.set(loader)


def uninstall(token) -> None:
    """Undo the :func:`install` that returned ``token``."""
    _installed.reset(token)


class CupyLoader:
    """Compiles through ``cupy.RawModule`` once per (source, expressions, options, device)."""

    name = "cupy"

    def __init__(self):
        self._modules: dict = {}

    def module(self, path, name_expressions, options=()):
        import cupy

        device = cupy.cuda.Device().id
        key = (str(path), tuple(name_expressions), tuple(options), device)
        mod = self._modules.get(key)
        if mod is None:
            mod = cupy.RawModule(
                code=Path(path).read_text(),
                options=tuple(options),
                name_expressions=list(name_expressions),
            )
            self._modules[key] = mod
        return mod

    def sm_count(self, like) -> int:
        import cupy

        return int(cupy.cuda.Device(like.device.id).attributes["MultiProcessorCount"])


_cupy_loader = CupyLoader()


def loader_for(array):
    """The loader that serves launches on ``array``: the installed one, else CuPy's."""
    loader = _installed.get()
    return loader if loader is not None else _cupy_loader


def address(array) -> int:
    """The device (or host) address of ``array``'s first element."""
    iface = getattr(array, "__cuda_array_interface__", None)
    if iface is None:
        iface = array.__array_interface__
    return iface["data"][0]
