"""Property tests: the row primitives on NumPy agree with naive float64 references on random inputs.

Hypothesis draws the shape (leading dims, row count and length, from one
element to several row blocks spread over worker threads), the value
distribution (scale and offset of the rows, constant rows) and the dtype.
Forward and backward are compared with the float64 references of
:mod:`xpkernels.testing.references` on the same (rounded) inputs, under the
DESIGN section 5 policy: the error may be at most
max(dtype floor, 2 x the error of a straightforward same-dtype
implementation), the latter measured on the very same inputs. Like the
kernels, that implementation's backward reads float32 checkpoints (the
contract's), so float64 runs are held to what float32 checkpoints allow;
and as its row statistics (mean, rstd) could round either way, its error is
the worst over those statistics moved one unit in the last place each side
(a single rounding outcome can be lucky on near-constant rows, where a
rounded mean is amplified by a large rstd).

``XPKERNELS_PROPERTY_EXAMPLES`` (default 20) sets the examples per test for
a deeper run.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.harness import max_error
from xpkernels.testing.tolerances import floor

RMS_EPS, LN_EPS = 1e-6, 1e-5
# A straightforward implementation may round its row statistics either way:
# its error is taken as the worst over one unit in the last place each side.
ULPS = (-1, 0, 1)
SETTINGS = settings(
    max_examples=int(os.environ.get("XPKERNELS_PROPERTY_EXAMPLES", "20")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def row_inputs(draw):
    """``(x, dy, w, b)`` as float64 arrays of one ``(..., M)`` shape, plus the dtype to run in."""
    m = draw(st.one_of(st.integers(1, 40), st.integers(41, 5000)))
    rows_cap = max(1, 80_000 // m)
    lead = draw(
        st.one_of(
            st.tuples(st.integers(1, rows_cap)),
            st.tuples(st.integers(1, 4), st.integers(1, max(1, rows_cap // 4))),
            st.just(()),
        )
    )
    shape = (*lead, m)
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -50.0]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * scale + offset
    if draw(st.booleans()) and x.ndim > 1:
        x[..., 0, :] = offset  # a constant row: zero variance
    dy = rng.standard_normal(shape)
    w = rng.standard_normal(m)
    b = rng.standard_normal(m)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return tuple(a.astype(dtype) for a in (x, dy, w, b)), dtype


def _nudged(a, dtype, ulps):
    """``a`` in ``dtype``, moved ``ulps`` (-1, 0 or 1) units in the last place."""
    a = a.astype(dtype)
    return a if ulps == 0 else np.nextafter(a, dtype(np.inf) * ulps)


def _rms_norm(x, dy, w, acc, checkpoint, ulps=0):
    """The reference RMSNorm forward and backward evaluated in dtype ``acc``.

    The backward reads ``rstd`` rounded to dtype ``checkpoint``; ``ulps``
    moves the row statistic one rounding either way, in both passes.
    """
    x, dy, w = (a.astype(acc) for a in (x, dy, w))
    exact = ref.rms_norm_rstd(x, RMS_EPS)
    y, _ = ref.rms_norm(x, w, eps=RMS_EPS, rstd=_nudged(exact, acc, ulps))
    rstd = _nudged(exact, checkpoint, ulps).astype(acc)
    dx, dw = ref.rms_norm_backward(x, w, dy, eps=RMS_EPS, rstd=rstd)
    return {"y": y, "dx": dx, "dw": dw}


def _layer_norm(x, dy, w, b, acc, checkpoint, ulps=0):
    """The reference LayerNorm forward and backward evaluated in dtype ``acc``.

    The backward reads ``mean`` and ``rstd`` rounded to dtype ``checkpoint``;
    ``ulps`` moves the row statistics one rounding either way, in both passes.
    """
    x, dy, w, b = (a.astype(acc) for a in (x, dy, w, b))
    mean, rstd = ref.layer_norm_stats(x, LN_EPS)
    y, _, _ = ref.layer_norm(
        x, w, b, eps=LN_EPS, mean=_nudged(mean, acc, ulps), rstd=_nudged(rstd, acc, ulps)
    )
    mean, rstd = (_nudged(a, checkpoint, ulps).astype(acc) for a in (mean, rstd))
    dx, dw, db = ref.layer_norm_backward(x, w, dy, eps=LN_EPS, mean=mean, rstd=rstd)
    return {"y": y, "dx": dx, "dw": dw, "db": db}


def _softmax(x, dy, acc):
    """The reference softmax forward and backward evaluated in dtype ``acc``."""
    y = ref.softmax(x.astype(acc))
    return {"y": y, "dx": ref.softmax_backward(y, dy.astype(acc))}


def _naive_errors(naive, reference, ulps=(0,)):
    """Per result, the largest error of ``naive(u)`` against ``reference`` over ``u`` in ``ulps``."""
    runs = [naive(u) for u in ulps]
    return {
        name: max(max_error(run[name], exact) for run in runs) for name, exact in reference.items()
    }


def _check(op, dtype, got, naive_errors, reference):
    """Each result in ``got`` within max(floor, 2 x the naive same-dtype error) of the float64 reference."""
    kind = np.dtype(dtype).name
    for name, actual in got.items():
        pass_ = "forward" if name == "y" else "backward"
        tol = max(floor(op, pass_, kind), 2 * naive_errors[name])
        err = max_error(actual, reference[name])
        assert err <= tol, (
            f"{op} {name} ({kind}, shape {np.shape(actual)}): error {err:.3g} > {tol:.3g}"
        )


@SETTINGS
@given(row_inputs())
def test_rms_norm_matches_float64_reference(drawn):
    (x, dy, w, _), dtype = drawn
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    y = xk.rms_norm(x, w, eps=RMS_EPS, checkpoints=ck)
    dx, dw = xk.rms_norm_backward(dy, x, w, checkpoints=ck)
    got = {"y": y, "dx": dx, "dw": dw}
    reference = _rms_norm(x, dy, w, np.float64, np.float64)
    naive = _naive_errors(lambda u: _rms_norm(x, dy, w, dtype, np.float32, u), reference, ULPS)
    _check("rms_norm", dtype, got, naive, reference)


@SETTINGS
@given(row_inputs(), st.sampled_from(["wb", "w", "b", ""]))
def test_layer_norm_matches_float64_reference(drawn, affine):
    (x, dy, w, b), dtype = drawn
    w_arg = w if "w" in affine else None
    b_arg = b if "b" in affine else None
    ck = xk.allocate_checkpoints(xk.layer_norm_, x, w_arg, b_arg)
    y = xk.layer_norm(x, w_arg, b_arg, eps=LN_EPS, checkpoints=ck)
    dx, dw, db = xk.layer_norm_backward(dy, x, w_arg, b_arg, checkpoints=ck)
    assert (dw is None) == (w_arg is None) and (db is None) == (b_arg is None)
    # Without a scale / shift the function is the one with w = 1 / b = 0.
    w_eff = w if w_arg is not None else np.ones_like(w)
    b_eff = b if b_arg is not None else np.zeros_like(b)
    got = {"y": y, "dx": dx, "dw": dw, "db": db}
    got = {name: a for name, a in got.items() if a is not None}
    reference = _layer_norm(x, dy, w_eff, b_eff, np.float64, np.float64)
    naive = _naive_errors(
        lambda u: _layer_norm(x, dy, w_eff, b_eff, dtype, np.float32, u), reference, ULPS
    )
    _check("layer_norm", dtype, got, naive, reference)


@SETTINGS
@given(row_inputs())
def test_softmax_matches_float64_reference(drawn):
    (x, dy, _, _), dtype = drawn
    y = xk.softmax(x)
    dx = np.empty_like(x)
    xk.softmax_backward_(Duplicated(y, dy), Duplicated(x, dx))
    got = {"y": y, "dx": dx}
    reference = _softmax(x, dy, np.float64)
    _check(
        "softmax", dtype, got, _naive_errors(lambda u: _softmax(x, dy, dtype), reference), reference
    )
