"""Calls mixing float dtypes on the cupy backend, through the CPU harness.

The fronts take arrays of any float dtypes (a float32 output of float16
inputs, a float16 gate with a float32 up projection); routing sends CuPy
arrays to the cupy backend by each dtype alone, so its launchers must serve
every mix, not only the one-dtype calls their kernels are compiled for. Each
call here must give what the array_api backend gives for the same arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.buffers import Duplicated, allocate_checkpoints
from xpkernels.testing import cudacpu

F32, F16 = np.float32, np.float16


@pytest.fixture(scope="module")
def harness():
    with cudacpu.emulate():
        yield


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _tol(*dtypes) -> float:
    """Two results that each round a float32 computation into the widest-eps dtype of
    ``dtypes``, relative to the largest value: twice a few units of it."""
    eps = max(float(np.finfo(d).eps) for d in dtypes)
    return 8 * eps + 64 * float(np.finfo(np.float32).eps)


def _close(got, want, *dtypes) -> None:
    got, want = (np.asarray(a, dtype=np.float64) for a in (got, want))
    scale = max(float(np.max(np.abs(want))), 1.0)
    assert np.max(np.abs(got - want)) <= _tol(*dtypes) * scale


def _both(call):
    """``call(backend)``'s results on cupy and on array_api."""
    return call("cupy"), call("array_api")


#: (output or first input, other input) dtypes: NumPy has no bfloat16 the fronts take.
MIXES = [(F32, F16), (F16, F32)]


@pytest.mark.parametrize("out, x", MIXES)
def test_row_primitives_write_an_output_of_another_dtype(harness, out, x):
    rng = np.random.default_rng(0)
    xs, w, b = _random(rng, (5, 96), x), _random(rng, (96,), x), _random(rng, (96,), x)
    calls = {
        "rms_norm": lambda y, be: xk.rms_norm_(y, xs, w, backend=be),
        "layer_norm": lambda y, be: xk.layer_norm_(y, xs, w, b, backend=be),
        "softmax": lambda y, be: xk.softmax_(y, xs, backend=be),
        "swiglu": lambda y, be: xk.swiglu_(y, xs, xs[::-1], backend=be),
        "geglu": lambda y, be: xk.geglu_(y, xs, xs[::-1], backend=be),
    }
    for name, call in calls.items():
        ys = [np.full((5, 96), np.nan, out) for _ in range(2)]
        call(ys[0], "cupy")
        call(ys[1], "array_api")
        assert ys[0].dtype == out, name
        _close(ys[0], ys[1], out, x)


@pytest.mark.parametrize("a, b", MIXES)
def test_gated_inputs_of_two_dtypes_forward_and_backward(harness, a, b):
    rng = np.random.default_rng(1)
    ga, up, dy = _random(rng, (4, 80), a), _random(rng, (4, 80), b), _random(rng, (4, 80), a)
    for fn, backward in ((xk.swiglu, xk.swiglu_backward), (xk.geglu, xk.geglu_backward)):
        y_cupy, y_ref = _both(lambda be, fn=fn: fn(ga, up, backend=be))
        _close(y_cupy, y_ref, a, b)
        grads = _both(lambda be, backward=backward: backward(dy, ga, up, backend=be))
        for got, want in zip(*grads):
            _close(got, want, a, b)


@pytest.mark.parametrize("out, x", MIXES)
def test_norm_and_softmax_backwards_with_gradients_of_another_dtype(harness, out, x):
    rng = np.random.default_rng(2)
    xs, w, dy = _random(rng, (6, 64), x), _random(rng, (64,), F32), _random(rng, (6, 64), x)
    for fn in (xk.rms_norm_, xk.layer_norm_):
        results = []
        for be in ("cupy", "array_api"):
            ck = allocate_checkpoints(fn, xs, w)
            y = np.empty((6, 64), x)
            fn(y, xs, w, checkpoints=ck, backend=be)
            dx, dw = np.full((6, 64), np.nan, out), np.zeros(64, F32)
            backward = xk.rms_norm_backward_ if fn is xk.rms_norm_ else xk.layer_norm_backward_
            Y, X, W = Duplicated(y, dy), Duplicated(xs, dx), Duplicated(w, dw)
            backward(Y, X, W, checkpoints=ck, backend=be)
            results.append((dx, dw))
        for got, want in zip(*results):
            _close(got, want, out, x)
    y = xk.softmax(xs, backend="array_api")
    dxs = [np.full((6, 64), np.nan, out) for _ in range(2)]
    for dx, be in zip(dxs, ("cupy", "array_api")):
        xk.softmax_backward_(Duplicated(y, dy), Duplicated(xs, dx), backend=be)
    _close(dxs[0], dxs[1], out, x)


@pytest.mark.parametrize("out, x", MIXES)
def test_decode_attention_writes_an_output_of_another_dtype(harness, out, x):
    rng = np.random.default_rng(4)
    q, k, v = _random(rng, (2, 4, 32), x), *(_random(rng, (2, 2, 40, 32), x) for _ in "kv")
    lengths = np.array([40, 17])
    os_ = [np.full((2, 4, 32), np.nan, out) for _ in range(2)]
    for o, be in zip(os_, ("cupy", "array_api")):
        xk.decode_attention_(o, q, k, v, lengths, backend=be)
    _close(os_[0], os_[1], out, x)
