"""SwiGLU (``y = silu(a) * b``, elementwise) conformance declaration."""

from __future__ import annotations

from xpkernels.testing.harness import Case

from ._gated import gated_spec
from ._shared import row_cases

SPEC = gated_spec(
    "swiglu",
    row_cases(
        # Gates out in both tails (exp(|a|) overflows every float type), b and dy in [-1, 1]
        # so that 1e4 * b * dy stays finite in float16.
        Case("large-gates-4x300", {"shape": (4, 300), "large": True}, interpreter=True),
    ),
    lambda F, a: F.silu(a),
)
