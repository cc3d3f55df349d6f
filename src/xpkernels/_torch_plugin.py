"""Loads the torch integration, by module name, for :func:`xpkernels._autograd.record`.

The core never imports :mod:`xpkernels.torch`: the torch layer builds on the
core (its ops call the fronts), and importing :mod:`xpkernels` must not import
torch. ``record`` needs the torch layer's recorders once torch tensors need
autograd; the torch layer files them in :data:`xpkernels._autograd.RECORDERS`
when :data:`PLUGIN` loads. This module is that plug-in load, the only
``importlib`` load of the torch layer in the core.

It is a module, imported by an ``import`` statement in ``record``, rather
than an ``importlib`` call there, because ``torch.compile`` executes import
statements while it traces (a first recorded call may sit inside a compiled
function) but cannot trace ``importlib.import_module``.
"""

from __future__ import annotations

import importlib

#: The module that registers the torch layer's ops and files its recorders when imported.
PLUGIN = "xpkernels.torch._fronts"

importlib.import_module(PLUGIN)
