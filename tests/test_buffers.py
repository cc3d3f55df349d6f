"""Buffers: Duplicated, primal/shadow, allocator dispatch, grad_shadow (DESIGN section 2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import xpkernels as xk
from xpkernels.buffers import Duplicated, empty_accumulator, empty_float32, primal, shadow
from xpkernels.rms_norm import RMSNormBackwardScratch, RMSNormCheckpoints


def test_duplicated_fresh_shadow_is_a_new_uninitialised_array():
    x = np.ones((3, 4), dtype=np.float16)
    d = Duplicated(x)
    assert d.shadow.shape == x.shape and d.shadow.dtype == x.dtype
    assert not np.shares_memory(d.shadow, x)


def test_duplicated_keeps_the_given_shadow():
    x, g = np.ones(5), np.zeros(5)
    d = Duplicated(x, g)
    assert d.primal is x and d.shadow is g
    assert primal(d) is x and shadow(d) is g


def test_duplicated_is_frozen_and_slotted():
    d = Duplicated(np.ones(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.primal = np.zeros(2)
    assert not hasattr(d, "__dict__")


def test_duplicated_rejects_a_shadow_of_another_shape():
    with pytest.raises(
        ValueError, match=r"shadow must have the primal's shape \(2, 3\), got \(3, 2\)"
    ):
        Duplicated(np.ones((2, 3)), np.ones((3, 2)))


def test_duplicated_rejects_nesting():
    with pytest.raises(TypeError, match="already a Duplicated"):
        Duplicated(Duplicated(np.ones(2)))


def test_primal_of_a_bare_array_is_itself_and_shadow_needs_a_duplicated():
    x = np.ones(3)
    assert primal(x) is x
    with pytest.raises(TypeError, match="expected a Duplicated, got ndarray"):
        shadow(x)


@pytest.mark.parametrize("namespace", ["numpy", "torch", "array_api_strict"])
def test_checkpoints_are_float32_in_the_input_namespace(namespace):
    mod = pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    x = mod.asarray(np.ones((2, 3, 8), dtype=np.float64))
    w = mod.asarray(np.ones(8, dtype=np.float64))
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    assert isinstance(ck, RMSNormCheckpoints)
    assert ck.rstd.shape == (6,) and ck.rstd.dtype == mod.float32
    assert type(ck.rstd) is type(x)


def test_allocators_are_keyed_on_the_function_that_uses_them():
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    sc = xk.allocate_scratchspace(
        xk.rms_norm_backward_, Duplicated(x), Duplicated(x), Duplicated(w)
    )
    assert isinstance(sc, RMSNormBackwardScratch)
    assert sc.dw_partial.shape[1] == 8 and sc.dw_partial.dtype == np.float32
    with pytest.raises(TypeError, match="rms_norm_backward_ saves no checkpoints"):
        xk.allocate_checkpoints(xk.rms_norm_backward_, x, w)
    with pytest.raises(TypeError, match="rms_norm_ uses no scratch space"):
        xk.allocate_scratchspace(xk.rms_norm_, x, w)
    with pytest.raises(TypeError, match="saves no checkpoints"):
        xk.allocate_checkpoints(len, x)


def test_allocators_refuse_keywords_neither_they_nor_the_function_take():
    """A misspelt ``memory=`` or ``backend=`` would size the buffers without it: refused,
    naming the allocator, the function and the keyword; so is a call given no array."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((64, 4), dtype=np.float32), rng.standard_normal((8, 4))
    targets = rng.integers(0, 8, 64)
    cases = [
        (xk.allocate_scratchspace, xk.linear_cross_entropy_, (x, w, targets), "memroy"),
        (xk.allocate_scratchspace, xk.rms_norm_backward_, (x, x, x[0]), "bakend"),
        (xk.allocate_checkpoints, xk.attention_, (x[None, None],) * 3, "casual"),
        (xk.allocate_checkpoints, xk.cross_entropy_, (x, targets), "ignore_idx"),
    ]
    for allocate, f, args, typo in cases:
        what = f"{allocate.__name__}\\({f.__name__}\\)"
        with pytest.raises(TypeError, match=rf"{what} got an unexpected keyword argument '{typo}'"):
            allocate(f, *args, **{typo: 1})
        with pytest.raises(TypeError, match=rf"{what}: pass the arrays"):
            allocate(f)
    small = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, w, targets, memory=64)
    assert small.logits.shape == (2, 8)  # the allocator's own keyword


def test_checkpoints_refuse_a_backward_over_inputs_of_other_shapes():
    """Checkpoints that still fit a backward over other inputs (another row length, another
    key length) would give silently wrong gradients: the forward's input shapes are recorded."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x)
    y = xk.rms_norm(x, None, checkpoints=ck)
    wide = np.ones((4, 16), np.float32)
    with pytest.raises(ValueError, match=r"x \(rows, M\) has shape \(4, 16\), but .* had \(4, 8\)"):
        xk.rms_norm_backward(wide, wide, None, checkpoints=ck)
    xk.rms_norm_backward(np.ones_like(y), x, None, checkpoints=ck)
    q = rng.standard_normal((1, 2, 4, 8), dtype=np.float32)
    k = rng.standard_normal((1, 2, 6, 8), dtype=np.float32)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, k)
    o = xk.attention(q, k, k, checkpoints=ck)
    longer = np.concatenate([k, k], axis=2)
    with pytest.raises(ValueError, match=r"k has shape \(1, 2, 12, 8\), but the forward"):
        xk.attention_backward(o, q, longer, longer, o, checkpoints=ck)


def test_accumulators_are_float64_only_for_float64():
    assert empty_accumulator(np.ones(2, np.float64), (3,)).dtype == np.float64
    assert empty_accumulator(np.ones(2, np.float16), (3,)).dtype == np.float32
    assert empty_float32(np.ones(2, np.float64), (3,)).dtype == np.float32


def test_grad_shadow_is_a_zeroed_accumulator():
    x = np.full((2, 2), 7.0)
    g = xk.grad_shadow(x)
    assert g.shape == x.shape and not g.any() and g is not x
    with pytest.raises(TypeError, match="not a Duplicated"):
        xk.grad_shadow(Duplicated(x))
    with pytest.raises(TypeError, match="expected an array or a score mod"):
        xk.grad_shadow(3.0)


def test_grad_shadow_dispatches_to_the_objects_hook():
    class Learnable:
        def __grad_shadow__(self, **kw):
            return ("fields", kw)

    assert xk.grad_shadow(Learnable(), feature_grads=True) == ("fields", {"feature_grads": True})


def test_forward_without_checkpoints_matches_forward_with_them():
    rng = np.random.default_rng(0)
    x, w = (
        rng.standard_normal((5, 16)).astype(np.float32),
        rng.standard_normal(16).astype(np.float32),
    )
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    np.testing.assert_array_equal(xk.rms_norm(x, w), xk.rms_norm(x, w, checkpoints=ck))


def test_backward_scratch_none_equals_supplied_scratch():
    rng = np.random.default_rng(1)
    x, w = (
        rng.standard_normal((6, 16)).astype(np.float32),
        rng.standard_normal(16).astype(np.float32),
    )
    dy = rng.standard_normal((6, 16)).astype(np.float32)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    y = xk.rms_norm(x, w, checkpoints=ck)
    grads = []
    for with_scratch in (False, True):
        Y, X, W = Duplicated(y, dy), Duplicated(x), Duplicated(w)
        sc = xk.allocate_scratchspace(xk.rms_norm_backward_, Y, X, W) if with_scratch else None
        if sc is not None:
            sc.dw_partial[...] = np.nan
        xk.rms_norm_backward_(Y, X, W, checkpoints=ck, scratch=sc)
        grads.append((X.shadow, W.shadow))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])
    np.testing.assert_array_equal(grads[0][1], grads[1][1])


def test_backward_without_weight_gradient_leaves_nothing_for_w():
    x, w = np.ones((2, 4), np.float32), np.ones(4, np.float32)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    y = xk.rms_norm(x, w, checkpoints=ck)
    X = Duplicated(x)
    xk.rms_norm_backward_(Duplicated(y, np.ones_like(y)), X, w, checkpoints=ck)
    assert np.isfinite(X.shadow).all()
