"""The row primitives (rms_norm, layer_norm, softmax) on the array_api backend.

What a user relies on beyond the conformance templates: in-place aliasing
(``y`` is ``x``, ``dx`` is ``dy``; for SwiGLU and GeGLU ``da`` or ``db`` is
``dy``), validation that writes nothing, half
precision inputs with float32 outputs, every shadow element overwritten
(also across row groups, blocks and worker threads), extra memory bounded by
the block budget rather than the number of rows, and clear errors for mixed
namespaces and non-contiguous rows.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from xpkernels.backends.array_api import _blocks
from xpkernels.backends.array_api import layer_norm as layer_norm_backend

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.layer_norm import LayerNormBackwardScratch, LayerNormCheckpoints
from xpkernels.rms_norm import RMSNormBackwardScratch, RMSNormCheckpoints
from xpkernels.testing import references as ref
from xpkernels.testing.harness import max_error
from xpkernels.testing.tolerances import floor

OPS = ("rms_norm", "layer_norm", "softmax")

# Enough rows of width 24 for several row blocks, hence several worker threads on NumPy.
MANY_ROWS = (3 * max(_blocks.ROW_BLOCK_ELEMENTS, layer_norm_backend.ROW_BLOCK_ELEMENTS)) // 24 + 5


def _rng(seed=0):
    return np.random.default_rng(seed)


def _weights(op, m, rng, dtype=np.float32):
    """The op's parameter arrays by name (none for softmax)."""
    if op == "rms_norm":
        return {"w": rng.standard_normal(m).astype(dtype)}
    if op == "layer_norm":
        return {
            "w": rng.standard_normal(m).astype(dtype),
            "b": rng.standard_normal(m).astype(dtype),
        }
    return {}


def _checkpoints(op, x, params):
    if op == "softmax":
        return None
    forward = {"rms_norm": xk.rms_norm_, "layer_norm": xk.layer_norm_}[op]
    return xk.allocate_checkpoints(forward, x, *params.values())


def _forward(op, y, x, params, ck):
    if op == "rms_norm":
        xk.rms_norm_(y, x, params["w"], checkpoints=ck)
    elif op == "layer_norm":
        xk.layer_norm_(y, x, params["w"], params["b"], checkpoints=ck)
    else:
        xk.softmax_(y, x)


def _backward(op, y, dy, x, dx, params, grads, ck, scratch=None):
    """Run the op's in-place backward; ``grads`` holds the parameter shadows by name."""
    Y, X = Duplicated(y, dy), Duplicated(x, dx)
    if op == "rms_norm":
        xk.rms_norm_backward_(
            Y, X, Duplicated(params["w"], grads["w"]), checkpoints=ck, scratch=scratch
        )
    elif op == "layer_norm":
        W = Duplicated(params["w"], grads["w"])
        B = Duplicated(params["b"], grads["b"])
        xk.layer_norm_backward_(Y, X, W, B, checkpoints=ck, scratch=scratch)
    else:
        xk.softmax_backward_(Y, X)


def _reference(op, x, params, dy):
    """Float64 ``(y, dx, grads)`` from the shipped naive references."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    if op == "softmax":
        y = ref.softmax(x)
        return y, ref.softmax_backward(y, dy), {}
    if op == "rms_norm":
        y, _ = ref.rms_norm(x, p["w"], eps=1e-6)
        dx, dw = ref.rms_norm_backward(x, p["w"], dy, eps=1e-6)
        return y, dx, {"w": dw}
    y, _, _ = ref.layer_norm(x, p["w"], p["b"], eps=1e-5)
    dx, dw, db = ref.layer_norm_backward(x, p["w"], dy, eps=1e-5)
    return y, dx, {"w": dw, "b": db}


def _rel_err(actual, expected):
    return max_error(np.asarray(actual, dtype=np.float64), expected)


# The conformance floors of float32 results (xpkernels.testing.tolerances): these tests'
# inputs are well-conditioned rows, where the naive float32 error lies far below them.
FORWARD_TOL = floor("layer_norm", "forward", "float32")
BACKWARD_TOL = floor("layer_norm", "backward", "float32")


def _case(op, shape, seed=0, dtype=np.float32):
    rng = _rng(seed)
    x = (rng.standard_normal(shape) * 2.0).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return x, dy, _weights(op, shape[-1], rng, dtype)


@pytest.mark.parametrize("op", OPS)
def test_y_may_alias_x(op):
    x, _, params = _case(op, (MANY_ROWS, 24))
    expected = np.empty_like(x)
    ck_expected = _checkpoints(op, x, params)
    _forward(op, expected, x, params, ck_expected)
    ck = _checkpoints(op, x, params)
    buf = x.copy()
    _forward(op, buf, buf, params, ck)
    np.testing.assert_array_equal(buf, expected)
    if ck is not None:
        for got, want in zip(ck, ck_expected):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", OPS)
def test_dx_may_alias_dy(op):
    x, dy, params = _case(op, (MANY_ROWS, 24), seed=1)
    y = np.empty_like(x)
    ck = _checkpoints(op, x, params)
    _forward(op, y, x, params, ck)
    dx = np.empty_like(x)
    grads = {k: np.empty_like(v) for k, v in params.items()}
    _backward(op, y, dy, x, dx, params, grads, ck)
    buf = dy.copy()
    grads_aliased = {k: np.empty_like(v) for k, v in params.items()}
    _backward(op, y, buf, x, buf, params, grads_aliased, ck)
    np.testing.assert_array_equal(buf, dx)
    for name, g in grads.items():
        np.testing.assert_array_equal(grads_aliased[name], g)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_either_gated_gradient_may_alias_dy_but_not_both(op):
    rng = _rng(2)
    a, b, dy = (rng.standard_normal((MANY_ROWS, 24)).astype(np.float32) for _ in range(3))
    backward_ = getattr(xk, f"{op}_backward_")
    da, db = getattr(xk, f"{op}_backward")(dy, a, b)
    y = np.empty_like(a)
    for aliased, other, want, want_other in (("A", "B", da, db), ("B", "A", db, da)):
        buf, out = dy.copy(), np.empty_like(dy)
        shadows = {aliased: buf, other: out}
        backward_(Duplicated(y, buf), Duplicated(a, shadows["A"]), Duplicated(b, shadows["B"]))
        np.testing.assert_array_equal(buf, want, err_msg=f"shadow({aliased}) is dy")
        np.testing.assert_array_equal(out, want_other, err_msg=f"shadow({other}) beside it")
    buf = dy.copy()
    with pytest.raises(
        ValueError, match="A.shadow shares memory with B.shadow; xpkernels writes both"
    ):
        backward_(Duplicated(y, buf), Duplicated(a, buf), Duplicated(b, buf))
    np.testing.assert_array_equal(buf, dy)


def _bad_forward_calls(op, x, y, params):
    """Calls that fail validation only at their last checks, after every array has been seen."""
    if op == "rms_norm":
        yield lambda: xk.rms_norm_(y, x, params["w"], eps=float("nan"))
        bad = RMSNormCheckpoints(rstd=np.zeros(x.shape[0], np.float64))
        yield lambda: xk.rms_norm_(y, x, params["w"], checkpoints=bad)
    elif op == "layer_norm":
        yield lambda: xk.layer_norm_(y, x, params["w"], params["b"], eps=0.0)
        bad = LayerNormCheckpoints(
            mean=np.zeros(x.shape[0], np.float32), rstd=np.zeros(3, np.float32)
        )
        yield lambda: xk.layer_norm_(y, x, params["w"], params["b"], checkpoints=bad)
    else:
        yield lambda: xk.softmax_(y, np.ones((x.shape[0], 2 * x.shape[1]), np.float32)[:, ::2])
        yield lambda: xk.softmax_(y, x.astype(np.int32))


@pytest.mark.parametrize("op", OPS)
def test_failed_forward_validation_writes_nothing(op):
    x, _, params = _case(op, (6, 16))
    y = np.full_like(x, 7.0)
    for call in _bad_forward_calls(op, x, y, params):
        with pytest.raises((ValueError, TypeError)):
            call()
        np.testing.assert_array_equal(y, np.full_like(x, 7.0))


def _bad_backward_calls(op, x, y, dy, dx, params, grads, ck):
    if op == "rms_norm":
        bad = RMSNormBackwardScratch(dw_partial=np.zeros((1, 3), np.float32))
        yield lambda: _backward(op, y, dy, x, dx, params, grads, ck, scratch=bad)
        yield lambda: _backward(op, y, dy, x, dx, params, grads, None)
    elif op == "layer_norm":
        bad = LayerNormBackwardScratch(
            dw_partial=np.zeros((2, x.shape[1]), np.float32),
            db_partial=np.zeros((2, x.shape[1]), np.float64),
        )
        yield lambda: _backward(op, y, dy, x, dx, params, grads, ck, scratch=bad)
        yield lambda: _backward(op, y, dy, x, dx, params, grads, None)
    else:
        strided_dy = np.ones((x.shape[0], 2 * x.shape[1]), np.float32)[:, ::2]
        yield lambda: _backward(op, y, strided_dy, x, dx, params, grads, ck)
        yield lambda: _backward(op, y, dy.astype(np.int32), x, dx, params, grads, ck)


@pytest.mark.parametrize("op", OPS)
def test_failed_backward_validation_writes_nothing(op):
    x, dy, params = _case(op, (6, 16))
    y = np.empty_like(x)
    ck = _checkpoints(op, x, params)
    _forward(op, y, x, params, ck)
    saved = None if ck is None else [a.copy() for a in ck]
    dx = np.full_like(x, 7.0)
    grads = {k: np.full_like(v, 7.0) for k, v in params.items()}
    for call in _bad_backward_calls(op, x, y, dy, dx, params, grads, ck):
        with pytest.raises((ValueError, TypeError)):
            call()
        np.testing.assert_array_equal(dx, np.full_like(x, 7.0))
        for name, g in grads.items():
            np.testing.assert_array_equal(g, np.full_like(g, 7.0), err_msg=name)
        if saved is not None:
            for got, want in zip(ck, saved):
                np.testing.assert_array_equal(got, want)


def _half_inputs(namespace, op, shape):
    """``(arrays, as_numpy, float32_like)``: x, dy and the parameters in half precision on ``namespace``."""
    x, dy, params = _case(op, shape, seed=2, dtype=np.float64)
    if namespace == "numpy":
        half = {k: v.astype(np.float16) for k, v in {"x": x, "dy": dy, **params}.items()}
        return (
            half,
            lambda a: np.asarray(a, dtype=np.float64),
            lambda a: np.empty(a.shape, np.float32),
        )
    torch = pytest.importorskip("torch", reason="bfloat16 arrays come from torch")
    half = {
        k: torch.tensor(v, dtype=torch.bfloat16) for k, v in {"x": x, "dy": dy, **params}.items()
    }
    return (
        half,
        lambda a: a.detach().double().numpy(),
        lambda a: torch.empty(tuple(a.shape), dtype=torch.float32),
    )


@pytest.mark.parametrize("namespace", ["numpy-float16", "torch-bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_half_inputs_with_float32_outputs_keep_float32_precision(op, namespace):
    """Half-precision inputs written to float32 buffers are never rounded through half precision."""
    shape = (37, 130)
    half, as_numpy, f32_like = _half_inputs(namespace.split("-")[0], op, shape)
    x, dy = half["x"], half["dy"]
    params = {k: v for k, v in half.items() if k in ("w", "b")}
    y = f32_like(x)
    ck = _checkpoints(op, x, params)
    _forward(op, y, x, params, ck)
    dx = f32_like(x)
    grads = {k: f32_like(v) for k, v in params.items()}
    _backward(op, y, dy, x, dx, params, grads, ck)
    exact = {k: as_numpy(v) for k, v in half.items()}
    y_ref, dx_ref, grads_ref = _reference(
        op, exact["x"], {k: exact[k] for k in params}, exact["dy"]
    )
    # A half-precision round trip would cost ~1e-3 (float16) to ~1e-2 (bfloat16): the
    # float32 floors tell the two apart. dx of softmax is computed from the float32 y,
    # not the exact one, so its error follows y's amplified by the row sums: 2.5x the floor
    # (hand-set: the rule's straightforward formula would run in half precision here).
    assert _rel_err(as_numpy(y), y_ref) <= FORWARD_TOL
    assert _rel_err(as_numpy(dx), dx_ref) <= 2.5 * BACKWARD_TOL
    for name, g in grads.items():
        assert _rel_err(as_numpy(g), grads_ref[name]) <= 2.5 * BACKWARD_TOL, name


@pytest.mark.parametrize("layout", ["contiguous", "leading-transposed"])
@pytest.mark.parametrize("op", OPS)
def test_every_shadow_element_overwritten(op, layout):
    """NaN-filled shadows come back finite and right: every block, worker, row group and partial sum."""
    x, dy, params = _case(op, (3, MANY_ROWS // 3, 24), seed=3)
    if layout == "leading-transposed":
        x = np.swapaxes(np.swapaxes(x, 0, 1).copy(), 0, 1)
        assert x.base is not None and not x.flags.c_contiguous
    y = np.full_like(x, np.nan)
    ck = _checkpoints(op, x, params)
    if ck is not None:
        for a in ck:
            a[...] = np.nan
    _forward(op, y, x, params, ck)
    dx = np.full_like(x, np.nan)
    grads = {k: np.full_like(v, np.nan) for k, v in params.items()}
    scratch = None
    if op != "softmax":
        # More partial-sum rows than the backend uses: the unused ones must not leak NaN into dw / db.
        nan_partial = np.full((_blocks.MAX_WORKERS + 3, x.shape[-1]), np.nan, np.float32)
        if op == "rms_norm":
            scratch = RMSNormBackwardScratch(dw_partial=nan_partial)
        else:
            scratch = LayerNormBackwardScratch(
                dw_partial=nan_partial, db_partial=nan_partial.copy()
            )
    _backward(op, y, dy, x, dx, params, grads, ck, scratch=scratch)
    y_ref, dx_ref, grads_ref = _reference(op, x, params, dy)
    assert _rel_err(y, y_ref) <= FORWARD_TOL
    assert _rel_err(dx, dx_ref) <= BACKWARD_TOL
    for name, g in grads.items():
        assert _rel_err(g, grads_ref[name]) <= BACKWARD_TOL, name


@pytest.mark.parametrize("op", OPS)
def test_extra_memory_bounded_by_block_budget_not_rows(op):
    """A forward + backward over 2**20 rows allocates a few blocks per worker, not a copy of the input."""
    rows, m = 1 << 20, 8
    x, dy, params = _case(op, (rows, m), seed=4)
    y, dx = np.empty_like(x), np.empty_like(x)
    grads = {k: np.empty_like(v) for k, v in params.items()}
    ck = _checkpoints(op, x, params)
    scratch = None
    if op != "softmax":
        Y, X = Duplicated(y, dy), Duplicated(x, dx)
        P = [Duplicated(v, grads[k]) for k, v in params.items()]
        backward = {"rms_norm": xk.rms_norm_backward_, "layer_norm": xk.layer_norm_backward_}[op]
        scratch = xk.allocate_scratchspace(backward, Y, X, *P)
    tracemalloc.start()
    try:
        _forward(op, y, x, params, ck)
        _backward(op, y, dy, x, dx, params, grads, ck, scratch=scratch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each worker keeps at most six block-sized float32 temporaries alive at once.
    elements = layer_norm_backend.ROW_BLOCK_ELEMENTS if op == "layer_norm" else None
    block = elements or _blocks.ROW_BLOCK_ELEMENTS
    budget = 6 * block * 4 * _blocks.workers(np, rows, m, elements)
    assert budget < x.nbytes / 2, (
        "the bound must be well below one input for this test to mean anything"
    )
    assert peak <= budget, f"peak extra memory {peak} B exceeds the block budget {budget} B"
    y_ref, dx_ref, _ = _reference(op, x[:1000], params, dy[:1000])
    assert _rel_err(y[:1000], y_ref) <= FORWARD_TOL
    assert _rel_err(dx[:1000], dx_ref) <= BACKWARD_TOL


def _call_with_torch_parameter(op):
    torch = pytest.importorskip("torch", reason="mixing namespaces needs torch")
    x = np.ones((4, 8), np.float32)
    y = np.empty_like(x)
    if op == "rms_norm":
        xk.rms_norm_(y, x, torch.ones(8))
    elif op == "layer_norm":
        xk.layer_norm_(y, x, torch.ones(8), np.zeros(8, np.float32))
    else:
        xk.softmax_(torch.empty(4, 8), x)


@pytest.mark.parametrize("op", OPS)
def test_numpy_x_with_torch_array_names_both_namespaces(op):
    other = "y" if op == "softmax" else "w"
    with pytest.raises(TypeError, match=rf"{other} is a torch array but x is a numpy array"):
        _call_with_torch_parameter(op)


@pytest.mark.parametrize("which", ["x", "y"])
@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_last_axis_raises(op, which):
    x, _, params = _case(op, (4, 8))
    y = np.empty_like(x)
    strided = np.zeros((4, 16), np.float32)[:, ::2]
    strided[...] = x
    args = {"x": x, "y": y, which: strided}
    with pytest.raises(
        ValueError, match=rf"{which} must be contiguous along its last axis \(stride 1\)"
    ):
        _forward(op, args["y"], args["x"], params, None)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("op", OPS)
def test_rows_of_length_zero_give_empty_results_without_warnings(op):
    x = np.ones((3, 0), np.float32)
    params = _weights(op, 0, _rng())
    y = np.empty_like(x)
    ck = _checkpoints(op, x, params)
    _forward(op, y, x, params, ck)
    dx = np.empty_like(x)
    grads = {k: np.empty_like(v) for k, v in params.items()}
    _backward(op, y, x, x, dx, params, grads, ck)
    assert y.shape == dx.shape == (3, 0)
    if ck is not None:
        assert all(np.isfinite(a).all() for a in ck)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", OPS)
def test_torch_cpu_tensors_take_the_numpy_path(op, dtype, monkeypatch):
    """PyTorch CPU tensors run the NumPy path through zero-copy views: the same results, bit
    for bit, as NumPy arrays (forward, checkpoints, backward and parameter gradients, over
    several row blocks shared by two worker threads)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    monkeypatch.setattr(_blocks, "_cores", lambda: 2)
    x, dy, params = _case(op, (MANY_ROWS, 24), seed=7, dtype=dtype)

    def run(convert):
        xs, dys = convert(x), convert(dy)
        ps = {k: convert(v) for k, v in params.items()}
        y, dx = convert(np.full_like(x, np.nan)), convert(np.full_like(x, np.nan))
        grads = {k: convert(np.full_like(v, np.nan)) for k, v in params.items()}
        ck = _checkpoints(op, xs, ps)
        _forward(op, y, xs, ps, ck)
        _backward(op, y, dys, xs, dx, ps, grads, ck)
        results = [y, dx, *grads.values(), *(() if ck is None else ck)]
        return [np.asarray(a) if isinstance(a, np.ndarray) else a.numpy() for a in results]

    want = run(np.copy)
    got = run(lambda a: torch.from_numpy(a.copy()))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def _halving_columns(xp, rows: int, m: int):
    """``(x, dy)`` whose weight and bias gradients are the column sums of ``dy``, exactly.

    ``x`` alternates ``+1024, -1024`` along each row: mean 0, ``rstd = 2**-10``
    exactly in float32 (eps is far below the variance's last bit), so every
    normalised entry is exactly ``+-1`` and ``dw`` is a signed column sum of
    ``dy``. ``dy`` holds 1.0 in the first row and ``2**-24`` (half the spacing
    of float32 at 1.0) in every other: a running sum rounds each addition back
    to 1.0 and loses all ``(rows - 1) * 2**-24`` of them, while sums that add
    the small values among themselves first lose at most one chunk's.
    """
    x = np.tile(np.array([1024.0, -1024.0], dtype=np.float32), (rows, m // 2))
    dy = np.full((rows, m), 2.0**-24, dtype=np.float32)
    dy[0] = 1.0
    return xp.asarray(x), xp.asarray(dy)


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_sum_rows_without_a_running_total(op, namespace):
    """dW (and LayerNorm's dB) over 4096 rows in float32: within the error of a pairwise sum.

    The bound is the dtype's: ``eps32 * log2(rows)`` relative to the sum of the
    magnitudes (about 1.0 here), a pairwise sum's worst case. A running total
    (NumPy's ``sum(axis=0)``, einsum, ``ones @ a``) is off by ``4095 * 2**-24``,
    about 2.4e-4, 170x that bound.
    """
    xp = pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    rows, m = 4096, 128
    x, dy = _halving_columns(xp, rows, m)
    params = {
        name: xp.asarray(np.ones(m, dtype=np.float32) if name == "w" else np.zeros(m, np.float32))
        for name in _weights(op, m, _rng())
    }
    ck = _checkpoints(op, x, params)
    y = xp.empty(x.shape, dtype=xp.float32)
    _forward(op, y, x, params, ck)
    backward = {"rms_norm": xk.rms_norm_backward, "layer_norm": xk.layer_norm_backward}[op]
    _, *grads = backward(dy, x, *params.values(), checkpoints=ck)
    exact = 1.0 + (rows - 1) * 2.0**-24
    sign = np.tile(np.array([1.0, -1.0]), m // 2)
    expected = {"dw": exact * sign, "db": np.full(m, exact)}
    bound = np.finfo(np.float32).eps * np.log2(rows) * exact
    for name, grad in zip(("dw", "db"), grads):
        error = np.max(np.abs(np.asarray(grad, dtype=np.float64) - expected[name]))
        assert error <= bound, f"{op} {name}: error {error:.3g} > {bound:.3g}"
