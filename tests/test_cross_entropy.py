"""Cross-entropy and linear cross-entropy beyond the conformance suite: the gradient over the
logits in place, the chunk loop's memory and results, the scratch's budget.

The conformance spec (``xpkernels.testing.specs.cross_entropy`` and
``linear_cross_entropy``) holds every backend to the float64 reference; here
NumPy runs the array_api backend.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.testing import references as ref

OPTIONS = {"label_smoothing": 0.1, "softcap": 4.0, "z_loss": 1e-3}


def _logits(n=6, v=50, seed=0):
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, v, n)
    targets[1] = -100
    return 3 * rng.standard_normal((n, v)).astype(np.float32), targets


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_over_the_logits_in_place(reduction):
    """``Duplicated(logits, logits)``: the gradient replaces the logits, equal to the one
    written into a separate buffer (same kernel, same order: bit for bit)."""
    logits, targets = _logits()
    ck = xk.allocate_checkpoints(xk.cross_entropy_, logits, targets)
    loss = np.empty((6,) if reduction == "none" else (), np.float32)
    xk.cross_entropy_(loss, logits, targets, reduction=reduction, checkpoints=ck, **OPTIONS)
    dloss = np.ones_like(loss)
    apart = xk.Duplicated(logits, np.empty_like(logits))
    kw = {"reduction": reduction, "checkpoints": ck, **OPTIONS}
    xk.cross_entropy_backward_(xk.Duplicated(loss, dloss), apart, targets, **kw)
    inplace = logits.copy()
    xk.cross_entropy_backward_(
        xk.Duplicated(loss, dloss), xk.Duplicated(inplace, inplace), targets, **kw
    )
    np.testing.assert_array_equal(inplace, apart.shadow)
    want = ref.cross_entropy_backward(
        logits.astype(np.float64), targets, dloss.astype(np.float64), reduction=reduction, **OPTIONS
    )
    assert np.max(np.abs(inplace - want)) <= 64 * np.finfo(np.float32).eps


def test_all_rows_ignored_give_zero_loss_and_gradient():
    logits, _ = _logits()
    targets = np.full(6, -100)
    assert xk.cross_entropy(logits, targets) == 0
    grad = xk.cross_entropy_backward(np.float32(1.0), logits, targets)
    assert np.all(grad == 0)
    x, w = logits[:, :8], _logits(n=50, v=8, seed=1)[0]
    assert xk.linear_cross_entropy(x, w, targets) == 0
    dx, dw, _ = xk.linear_cross_entropy_backward(np.float32(1.0), x, w, targets)
    assert np.all(dx == 0) and np.all(dw == 0)


def test_masked_vocabulary_entries_give_finite_losses():
    """-inf logits (a masked vocabulary) without label smoothing: finite loss, zero gradient
    there (with smoothing the loss is inf, as PyTorch's)."""
    logits, targets = _logits()
    logits[:, ::3] = -np.inf
    targets[targets % 3 == 0] += 1
    loss = xk.cross_entropy(logits, targets, reduction="none")
    assert np.all(np.isfinite(loss))
    grad = xk.cross_entropy_backward(np.ones_like(loss), logits, targets, reduction="none")
    assert np.all(grad[:, ::3] == 0) and np.all(np.isfinite(grad))


def test_an_infinite_or_nan_logit_makes_its_row_nan_as_in_pytorch():
    """A row holding +inf or NaN has a NaN loss and an all-NaN gradient row (PyTorch's
    result; an inf loss or a single NaN entry would hide the fault); other rows stay
    exact."""
    logits, targets = _logits()
    targets[:] = 3
    logits[0, 5], logits[2, 3], logits[4, 7] = np.inf, np.inf, np.nan
    clean = [1, 3, 5]
    for smoothing in (0.0, 0.2):
        kw = {"reduction": "none", "label_smoothing": smoothing}
        loss = xk.cross_entropy(logits, targets, **kw)
        grad = xk.cross_entropy_backward(np.ones_like(loss), logits, targets, **kw)
        assert np.all(np.isnan(loss[[0, 2, 4]])) and np.all(np.isnan(grad[[0, 2, 4]]))
        want = xk.cross_entropy(logits[clean], targets[clean], **kw)
        np.testing.assert_array_equal(loss[clean], want)
        assert np.all(np.isfinite(grad[clean]))
        assert np.isnan(xk.cross_entropy(logits, targets, label_smoothing=smoothing))


def test_a_backward_with_another_ignore_index_names_it():
    """Targets holding the forward's ignore_index: the backward given another one is told
    that the option differs, not that the targets are out of range."""
    logits, targets = _logits()
    ck = xk.allocate_checkpoints(xk.cross_entropy_, logits, targets)
    loss = xk.cross_entropy(logits, targets, checkpoints=ck)
    with pytest.raises(ValueError, match=r"ignore_index=-1 differs from the forward"):
        xk.cross_entropy_backward(
            np.ones_like(loss), logits, targets, ignore_index=-1, checkpoints=ck
        )


def test_scratch_of_another_namespace_is_a_type_error_naming_it():
    torch = pytest.importorskip("torch")
    logits, targets = _logits()
    x, w = logits[:, :8], _logits(n=50, v=8, seed=1)[0]
    scratch = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, targets)
    tx, tw, tt = (torch.from_numpy(a) for a in (x, w, targets))
    with pytest.raises(TypeError, match="scratch.logits is a numpy array but x is a torch"):
        xk.linear_cross_entropy_(torch.zeros(()), tx, tw, tt, scratch=scratch)


def _linear(n, h, v, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(dtype)
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(dtype)
    targets = rng.integers(0, v, n)
    targets[::7] = -100
    return x, w, rng.standard_normal(v).astype(dtype), targets


@pytest.mark.parametrize("bias", [False, True])
def test_chunks_of_any_size_give_the_same_results(bias):
    """One row a chunk, a few, all: the same loss and gradients, to float32 rounding of the
    dW sums (one rounding per chunk)."""
    x, w, b, targets = _linear(37, 16, 101)
    b = b if bias else None
    losses, grads = [], []
    for rows in (1, 5, 37):
        memory = rows * 101 * 4
        scratch = xk.allocate_scratchspace(
            xk.linear_cross_entropy_, x, w, targets, b, memory=memory
        )
        assert scratch.logits.shape == (rows, 101)
        ck = xk.allocate_checkpoints(xk.linear_cross_entropy_, x, w, targets)
        loss = np.empty((), np.float32)
        xk.linear_cross_entropy_(loss, x, w, targets, b, checkpoints=ck, scratch=scratch, **OPTIONS)
        X, W = xk.Duplicated(x), xk.Duplicated(w)
        B = None if b is None else xk.Duplicated(b)
        xk.linear_cross_entropy_backward_(
            xk.Duplicated(loss, np.float32(1.0)),
            X,
            W,
            targets,
            B,
            checkpoints=ck,
            scratch=scratch,
            **OPTIONS,
        )
        losses.append(float(loss))
        grads.append([X.shadow, W.shadow] + ([] if B is None else [B.shadow]))
    exact = ref.linear_cross_entropy(
        *(a.astype(np.float64) for a in (x, w)), targets, None if b is None else b.astype(float),
        **OPTIONS,
    )  # fmt: skip
    eps = np.finfo(np.float32).eps
    assert max(abs(got - exact) for got in losses) <= 64 * eps * abs(exact)
    for got in grads[:-1]:
        for a, want in zip(got, grads[-1]):
            assert np.max(np.abs(a - want)) <= 64 * eps * max(np.max(np.abs(want)), 1)


def test_scratch_budget():
    x, w, _, targets = _linear(10, 4, 30)
    one_row = 30 * 4
    assert xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, memory=1).logits.shape[0] == 1
    assert (
        xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, memory=3 * one_row).logits.shape[0]
        == 3
    )
    default = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w).logits.shape[0]
    assert default == 10  # at least 1024 rows (here all of them)
    x, w, _, targets = _linear(3000, 8, 30)
    default = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w).logits.shape[0]
    assert default == 1024
    x, w, _, targets = _linear(4096, 64, 128)
    default = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w).logits.shape[0]
    assert default == 4096 * 64 // 128  # as many elements as x
    with pytest.raises(ValueError, match=r"memory must lie in \[1,"):
        xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, memory=0)


def test_peak_memory_is_at_most_two_chunks():
    """NumPy's traced allocations through a forward and a backward (scratch included) stay
    within two chunks of logits; the composition holds all N x V logits (8 chunks here). The
    scratch is 1.25 chunks; the rest is the row kernels' block temporaries, a few blocks of
    ``ROW_BLOCK_ELEMENTS`` (2 MiB at float32) whatever the chunk, so the bound holds for
    chunks of 8 MiB and up (the default chunk holds as many elements as x: 128 MiB for 8192
    tokens of 4096 float32 features)."""
    n, h, v = 2048, 256, 8192
    x, w, _, targets = _linear(n, h, v)
    chunk = 256 * v * 4
    ck = xk.allocate_checkpoints(xk.linear_cross_entropy_, x, w, targets)
    loss = np.empty((), np.float32)
    X, W = xk.Duplicated(x), xk.Duplicated(w)
    tracemalloc.start()
    try:
        scratch = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, targets, memory=chunk)
        xk.linear_cross_entropy_(loss, x, w, targets, checkpoints=ck, scratch=scratch)
        xk.linear_cross_entropy_backward_(
            xk.Duplicated(loss, np.float32(1.0)), X, W, targets, checkpoints=ck, scratch=scratch
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * chunk, (peak / chunk, n * v * 4 / chunk)
    exact = ref.linear_cross_entropy(x.astype(float), w.astype(float), targets)
    assert abs(float(loss) - exact) <= 1e-4 * exact


def test_bias_needs_its_forward():
    """A backward given a bias its forward did not have (or the reverse) is refused."""
    x, w, b, targets = _linear(5, 4, 9)
    ck = xk.allocate_checkpoints(xk.linear_cross_entropy_, x, w, targets)
    loss = np.empty((), np.float32)
    xk.linear_cross_entropy_(loss, x, w, targets, checkpoints=ck)
    with pytest.raises(ValueError, match=r"bias='given' differs from the forward"):
        xk.linear_cross_entropy_backward_(
            xk.Duplicated(loss, np.float32(1)),
            xk.Duplicated(x),
            xk.Duplicated(w),
            targets,
            xk.Duplicated(b),
            checkpoints=ck,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_in_the_forward_equal_the_backwards(reduction):
    """Duplicated inputs to the forward get the gradients of a unit cotangent in the same chunk
    loop (three products in all): bit for bit the backward's with dloss = 1."""
    x, w, b, targets = _linear(23, 8, 61)
    memory = 4 * 61 * 4
    loss = np.empty((), np.float32)
    X, W, B = xk.Duplicated(x), xk.Duplicated(w), xk.Duplicated(b)
    scratch = xk.allocate_scratchspace(xk.linear_cross_entropy_, X, W, targets, B, memory=memory)
    ck = xk.allocate_checkpoints(xk.linear_cross_entropy_, x, w, targets)
    kw = {"reduction": reduction, "scratch": scratch, "checkpoints": ck, **OPTIONS}
    xk.linear_cross_entropy_(loss, X, W, targets, B, **kw)
    grads = [a.shadow.copy() for a in (X, W, B)]
    xk.linear_cross_entropy_backward_(xk.Duplicated(loss, np.float32(1.0)), X, W, targets, B, **kw)
    for got, want in zip(grads, (X.shadow, W.shadow, B.shadow)):
        np.testing.assert_array_equal(got, want)
    only_x = xk.Duplicated(x)
    xk.linear_cross_entropy_(
        np.empty((), np.float32), only_x, w, targets, b, reduction=reduction, **OPTIONS
    )
    np.testing.assert_array_equal(only_x.shadow, grads[0])


def test_gradients_in_the_forward_need_a_reduced_loss():
    x, w, _, targets = _linear(5, 4, 9)
    loss = np.full(5, 7.0, np.float32)
    X = xk.Duplicated(x, np.full_like(x, 7.0))
    with pytest.raises(ValueError, match=r"need a reduced loss: with reduction='none'"):
        xk.linear_cross_entropy_(loss, X, w, targets, reduction="none")
    assert np.all(loss == 7.0) and np.all(X.shadow == 7.0)
    scratch = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, targets)
    with pytest.raises(ValueError, match=r"scratch.bias_sum is None but the bias gets"):
        xk.linear_cross_entropy_(
            np.empty((), np.float32), x, w, targets, xk.Duplicated(w[:, 0].copy()), scratch=scratch
        )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", ["array_api", "cupy"])
def test_unreduced_loss_of_any_float_dtype(backend, dtype):
    """The per-row losses land in a loss of any float dtype: written straight through when it
    is the accumulation dtype, through a row buffer otherwise (the kernels write float32
    rows; a float64 loss for float32 logits is filled from one). The cupy backend runs on the
    CPU harness."""
    logits, targets = _logits(n=7, v=40)
    loss = np.full(7, np.nan, dtype)
    if backend == "cupy":
        from xpkernels.testing import cudacpu

        with cudacpu.emulate():
            xk.cross_entropy_(loss, logits, targets, reduction="none", backend=backend)
    else:
        xk.cross_entropy_(loss, logits, targets, reduction="none", backend=backend)
    want = ref.cross_entropy(logits.astype(np.float64), targets, reduction="none")
    assert np.max(np.abs(loss - want)) <= 64 * np.finfo(np.float32).eps * np.max(np.abs(want))
