"""The shipped test support (``xpkernels.testing``): importable with NumPy alone, and its tolerance rule."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from xpkernels.testing import load_specs, references, tolerances
from xpkernels.testing.harness import Case, case_rng, max_error

SPECS = {spec.name: spec for spec in load_specs()}

_BLOCKED = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "pytest", "hypothesis"):
            raise ImportError(f"{name} imported by xpkernels.testing")

sys.meta_path.insert(0, Blocker())
import xpkernels.testing as t
specs = t.load_specs()
print(sorted(s.name for s in specs))
"""


def test_imports_without_torch_triton_or_pytest():
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "rms_norm" in done.stdout and "flex_attention" in done.stdout


def _inputs(spec, case, dtype):
    """The float64 values of ``case``'s inputs and cotangents rounded to ``dtype`` (NumPy dtypes)."""
    rng = case_rng(spec, case)
    rounded = {
        n: a.astype(dtype).astype(np.float64) if a.dtype.kind == "f" else a
        for n, a in spec.inputs(case, rng).items()
    }
    cot = {} if spec.backward is None else spec.backward.cotangents(case, rng)
    return rounded, {n: a.astype(dtype).astype(np.float64) for n, a in cot.items()}


def _case(spec, ident):
    return next(c for c in spec.cases if c.id == ident)


def test_tolerance_is_the_floor_where_the_naive_formula_is_accurate():
    spec = SPECS["rms_norm"]
    case = _case(spec, "2x3x96")
    allowed = tolerances.allowed(spec, case, *_inputs(spec, case, "float32"), "float32")
    assert allowed[("forward", "y")] == tolerances.floor("rms_norm", "forward", "float32")
    assert allowed[("backward", "x")] == tolerances.floor("rms_norm", "backward", "float32")
    assert allowed[("checkpoints", "rstd")] == tolerances.floor(
        "rms_norm", "checkpoints", "float32"
    )


def test_tolerance_is_twice_the_naive_error_where_that_exceeds_the_floor():
    """Rows of mean 1e5: a float32 mean is off by up to half an ulp of 1e5, amplified by rstd."""
    spec = SPECS["layer_norm"]
    case = _case(spec, "mean-1e5-spread-1-4x512")
    inputs, cot = _inputs(spec, case, "float32")
    allowed = tolerances.allowed(spec, case, inputs, cot, "float32")
    naive = tolerances.straightforward(spec, case, inputs, cot, "float32")
    exact = tolerances.references(spec, case, inputs, cot)
    err = max_error(naive[("forward", "y")], exact[("forward", "y")])
    assert err > tolerances.floor("layer_norm", "forward", "float32")
    assert allowed[("forward", "y")] == pytest.approx(2 * err)


def test_a_straightforward_formula_that_overflows_is_refused():
    spec = SPECS["layer_norm"]
    case = Case("mean-1e5-float16", {"shape": (2, 64), "x_offset": 1e5, "x_scale": 1.0})
    inputs, cot = _inputs(spec, case, "float32")
    with pytest.raises(ValueError, match="not finite .* restrict the case's dtypes"):
        tolerances.allowed(spec, case, inputs, cot, "float16")


def test_float64_backward_floor_allows_float32_checkpoints():
    """A float64 backward reads float32 statistics: its floor sits at float32's rounding, not float64's."""
    rng = np.random.default_rng(0)
    x, dy, w = (
        rng.standard_normal((4, 300)),
        rng.standard_normal((4, 300)),
        rng.standard_normal(300),
    )
    dx, _ = references.rms_norm_backward(x, w, dy, eps=1e-6)
    rstd32 = references.rms_norm_rstd(x, 1e-6).astype(np.float32).astype(np.float64)
    dx32, _ = references.rms_norm_backward(x, w, dy, eps=1e-6, rstd=rstd32)
    err = max_error(dx32, dx)
    assert tolerances.floor("rms_norm", "forward", "float64") < err
    assert err <= tolerances.floor("rms_norm", "backward", "float64")


def test_bfloat16_rounding_keeps_eight_significant_bits():
    a = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 256.5, -3.0e38, np.inf], dtype=np.float32)
    got = tolerances._round_bfloat16(a)
    np.testing.assert_array_equal(got[:3], [1.0, 1.0, 1.0 + 2.0**-6])  # ties to even
    assert got[3] == 256.0 and np.isinf(got[5])
    assert abs(got[4] / a[4] - 1) <= 2.0**-8


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_the_naive_references_keep_the_input_dtype(spec):
    """The rule's "straightforward same-dtype implementation" really runs in that dtype."""
    case = next(c for c in spec.cases if c.quick)
    inputs, cot = _inputs(spec, case, "float32")
    low = {n: a.astype(np.float32) if a.dtype.kind == "f" else a for n, a in inputs.items()}
    outs, _ = spec.reference(case, low)
    for name in spec.outputs:
        assert outs[name].dtype == np.float32, name


def test_generated_error_messages_must_name_the_whole_argument():
    """A generated case's pattern names the function and the argument as a whole label: ``m``
    is not found in ``m_a`` or ``checkpoints.m``, ``X`` not in ``X.primal``."""
    import re

    from xpkernels.testing.declared_errors import declared_errors
    from xpkernels.testing.specs.merge_attention_states import EXTRA

    cases = {c.id: c for c in declared_errors("merge_attention_states", extra=EXTRA)}
    match = cases["merge_attention_states_backward_-m-none"].match
    assert re.search(match, "merge_attention_states_backward_: m must be an array, got NoneType")
    assert not re.search(match, "merge_attention_states_backward_: m_a must be an array")
    assert not re.search(match, "merge_attention_states_: m must be an array")
    match = cases["merge_attention_states_backward_-O-none"].match
    assert re.search(match, "merge_attention_states_backward_: O must be a Duplicated(...)")
    assert not re.search(match, "merge_attention_states_backward_: O.primal must be an array")
    rows = {c.id: c for c in declared_errors("rms_norm")}
    match = rows["rms_norm_backward_-checkpoints.rstd-none"].match
    assert not re.search(match, "rms_norm_backward_: checkpoints are required")
