"""Shipped test support: naive float64 references, case declarations, the tolerance rule.

- :mod:`xpkernels.testing.references`: each primitive's naive formula, once
  (NumPy; materialised matrices; no code shared with ``backends/``);
- :mod:`xpkernels.testing.specs`: one :class:`~xpkernels.testing.harness.OpSpec`
  per primitive (sample and larger cases, error inputs, options);
- :mod:`xpkernels.testing.tolerances`: the floors and the rule
  max(floor, 2 x the straightforward same-dtype error);
- :mod:`xpkernels.testing.harness`: targets (backend x namespace x device)
  and the comparison.
- :mod:`xpkernels.testing.host_reads`: a torch tensor guard that raises when
  a device value is read on the host (capture safety).

Used by ``conformance/`` (pytest), ``tests/`` and ``python -m xpkernels check``.
Importing it needs NumPy only: torch, triton and pytest are imported inside
the functions that use them.
"""

from __future__ import annotations

from . import references, tolerances
from .harness import (
    TARGETS,
    Backward,
    Case,
    ErrorCase,
    OpSpec,
    Target,
    assert_close,
    load_specs,
    max_error,
)

__all__ = [
    "references",
    "tolerances",
    "TARGETS",
    "Backward",
    "Case",
    "ErrorCase",
    "OpSpec",
    "Target",
    "assert_close",
    "load_specs",
    "max_error",
]
