"""The tolerance rule (DESIGN sections 5 and 7), applied mechanically, and its one table of floors.

Errors are ``max|actual - reference| / max(max|reference|, 1)``
(:func:`xpkernels.testing.harness.max_error`) against the float64 reference
computed from the same, already rounded, inputs. For each (case, pass,
dtype) the allowed error of a result is

    max(floor(primitive, pass, dtype), 2 x error of the straightforward formula)

where the straightforward formula is the spec's own reference run with its
float inputs (and cotangents) cast to the target dtype: NumPy then evaluates
every operation of the naive formula in that dtype. NumPy has no bfloat16:
for it the formula runs in float32 on the bfloat16 inputs and each result is
rounded to bfloat16 once, which underestimates that implementation's error
(the bfloat16 floors, a few units in its last place, dominate anyway).

Passes: ``"forward"`` (outputs), ``"checkpoints"`` (saved row statistics,
always float32) and ``"backward"`` (input gradients).
"""

from __future__ import annotations

import math

import numpy as np

from xpkernels.backends.protocol import PRIMITIVES

from .harness import Case, OpSpec, max_error

#: A few units in the last place of each dtype (float32 ulp/2 = 6e-8, float16 5e-4,
#: bfloat16 4e-3), scaled for reductions over rows of thousands of elements.
_FLOOR = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
#: Float64 backward passes read float32 checkpoints (the contract's: rstd, mean,
#: m, l are float32 whatever the input dtype), so their error is a float32
#: rounding of the statistic carried through the gradient: ~1e-6, not 1e-10.
#: The straightforward float64 formula recomputes its statistics in float64,
#: so the rule's "2 x its error" cannot see this: the floor carries it.
_FLOAT64_FROM_F32_CHECKPOINTS = 2e-6

FLOORS: dict[tuple[str, str, str], float] = {}
for _op in PRIMITIVES:  # every declared primitive
    for _dtype, _floor in _FLOOR.items():
        FLOORS[(_op, "forward", _dtype)] = _floor
        FLOORS[(_op, "backward", _dtype)] = 2 * _floor
        # Checkpoints are float32 whatever the input dtype: never below float32's rounding.
        FLOORS[(_op, "checkpoints", _dtype)] = max(_floor, 2e-6)
    FLOORS[(_op, "backward", "float64")] = _FLOAT64_FROM_F32_CHECKPOINTS
# Attention sums products over D and over up to thousands of keys per row, twice in the
# backward (dS = P * (dO V^T - delta), then dS K and dS^T Q): float32 floors 2.5x the rows'.
for _op in ("attention", "decode_attention", "flex_attention", "flex_attention_varlen"):
    FLOORS[(_op, "forward", "float32")] = 5e-5
    FLOORS[(_op, "backward", "float32")] = 1e-4
    # The float32 m and l checkpoints enter every probability exp(s - m) / l of the
    # float64 backward, then sums over the keys: 5x the rows' floor.
    FLOORS[(_op, "backward", "float64")] = 5 * _FLOAT64_FROM_F32_CHECKPOINTS
del _op, _dtype, _floor


def floor(op: str, pass_: str, dtype: str) -> float:
    """The floor of ``op``'s ``pass_`` ("forward", "checkpoints", "backward") in ``dtype``."""
    return FLOORS[(op, pass_, dtype)]


def _round_bfloat16(a: np.ndarray) -> np.ndarray:
    """``a`` (float32) rounded to the nearest bfloat16 (ties to even), as float32."""
    shape = np.shape(a)
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(shape)  # 0-d stays 0-d
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isfinite(a), out, a)


def _in_dtype(values: dict, dtype: str) -> dict:
    """Float arrays of ``values`` cast to ``dtype`` (float32 for bfloat16); other arrays unchanged."""
    compute = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    return {n: a.astype(compute) if a.dtype.kind == "f" else a for n, a in values.items()}


def _as_result(a, dtype: str) -> np.ndarray:
    a = np.asarray(a)
    if dtype == "bfloat16" and a.dtype.kind == "f":
        a = _round_bfloat16(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def references(spec: OpSpec, case: Case, inputs: dict, cotangents: dict) -> dict:
    """``{(pass, name): float64 array}``: the float64 references of every result."""
    outs, ck = spec.reference(case, inputs)
    results = {("forward", n): outs[n] for n in spec.outputs}
    results.update({("checkpoints", n): ck[n] for n in spec.checkpoint_names})
    if spec.backward is not None:
        grads = spec.backward.reference(case, inputs, cotangents)
        results.update({("backward", n): grads[n] for n in grads})
    return results


def straightforward(spec: OpSpec, case: Case, inputs: dict, cotangents: dict, dtype: str) -> dict:
    """``{(pass, name): float64 array}``: the spec's naive formula evaluated in ``dtype``."""
    with np.errstate(all="ignore"):  # an overflow shows up as an infinite error in allowed()
        low = references(spec, case, _in_dtype(inputs, dtype), _in_dtype(cotangents, dtype))
        return {key: _as_result(a, dtype) for key, a in low.items()}


def allowed(spec: OpSpec, case: Case, inputs: dict, cotangents: dict, dtype: str) -> dict:
    """``{(pass, name): largest allowed error}`` of every result of ``case`` run in ``dtype``.

    ``inputs`` and ``cotangents`` are the float64 values of the rounded
    inputs. A straightforward formula that overflows or turns NaN in ``dtype``
    means the rule cannot judge the case there: a ValueError says so (declare
    the case's ``dtypes`` instead).
    """
    exact = references(spec, case, inputs, cotangents)
    naive = straightforward(spec, case, inputs, cotangents, dtype)
    tolerances = {}
    for key, want in exact.items():
        err = max_error(naive[key], want)
        if not math.isfinite(err):
            raise ValueError(
                f"{spec.name} case {case.id}: the straightforward {dtype} formula is not finite for "
                f"{key[0]} {key[1]}; restrict the case's dtypes"
            )
        tolerances[key] = max(floor(spec.name, key[0], dtype), 2 * err)
    return tolerances
