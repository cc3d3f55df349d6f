"""The one tolerance table: (primitive, pass, dtype) -> largest allowed ``max_error``.

``max_error`` is ``max|actual - reference| / max(max|reference|, 1)`` against a
float64 reference computed from the same (already rounded) inputs. The policy
(DESIGN section 5) is max(dtype floor, 2 x the error of a straightforward
same-dtype implementation); the floors below are a few units in the last place
of the output dtype, scaled for reductions over long rows. Float64 backward
passes read float32 checkpoints, hence ~1e-6 there.
"""

from __future__ import annotations

_FLOOR = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
_FLOAT64_FROM_F32_CHECKPOINTS = 2e-6

TOLERANCES: dict[tuple[str, str, str], float] = {}
for _op in ("rms_norm", "layer_norm", "softmax", "attention", "decode_attention", "flex_attention"):
    for _dtype, _floor in _FLOOR.items():
        TOLERANCES[(_op, "forward", _dtype)] = _floor
        TOLERANCES[(_op, "backward", _dtype)] = 2 * _floor
        TOLERANCES[(_op, "checkpoints", _dtype)] = max(_floor, 2e-6)
    TOLERANCES[(_op, "backward", "float64")] = _FLOAT64_FROM_F32_CHECKPOINTS
for _op in ("attention", "decode_attention", "flex_attention"):
    TOLERANCES[(_op, "forward", "float32")] = 5e-5
    TOLERANCES[(_op, "backward", "float32")] = 1e-4
    TOLERANCES[(_op, "backward", "float64")] = 1e-5


def tolerance(op: str, pass_: str, dtype: str) -> float:
    """Largest allowed ``max_error`` for ``op``'s ``pass_`` ("forward", "backward", "checkpoints") in ``dtype``."""
    return TOLERANCES[(op, pass_, dtype)]
