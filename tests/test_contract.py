"""The call contract of DESIGN section 6: nothing written on failure, outputs that may be written,
no overlap between outputs and inputs, checkpoints that remember their forward, capture-safe
integer checks and the debug switch -- shown on the row primitives (RMSNorm, LayerNorm, softmax).
"""

from __future__ import annotations

import numpy as np
import pytest

import xpkernels as xk
from xpkernels import Duplicated
from xpkernels._checks import INDEX_MAX, batch_integers, index_int
from xpkernels.rms_norm import RMSNormCheckpoints
from xpkernels.testing.host_reads import HostRead, no_host_reads

rng = np.random.default_rng(7)


def _x(rows=4, m=16):
    return rng.standard_normal((rows, m)).astype(np.float32)


def _rms_forward(x, w=None, **options):
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    y = np.empty_like(x)
    xk.rms_norm_(y, x, w, checkpoints=ck, **options)
    return y, ck


# ---- outputs the call may write -------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
def test_read_only_output_is_refused_before_anything_is_written(op):
    x = _x()
    y = np.full_like(x, 7.0)
    y.flags.writeable = False
    forward = {"rms_norm": xk.rms_norm_, "layer_norm": xk.layer_norm_, "softmax": xk.softmax_}[op]
    with pytest.raises(ValueError, match=f"{op}_: y is read-only"):
        forward(y, x)
    assert (y == 7.0).all()


def test_read_only_weight_shadow_is_refused_before_x_shadow_is_written():
    x, w = _x(), np.ones(16, np.float32)
    _, ck = _rms_forward(x, w)
    dx = np.full_like(x, 7.0)
    dw = np.zeros_like(w)
    dw.flags.writeable = False
    with pytest.raises(ValueError, match="rms_norm_backward_: W.shadow is read-only"):
        xk.rms_norm_backward_(
            Duplicated(x, np.ones_like(x)), Duplicated(x, dx), Duplicated(w, dw), checkpoints=ck
        )
    assert (dx == 7.0).all()


def test_output_tensor_requiring_grad_is_refused_in_grad_mode_and_written_under_no_grad():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    x = torch.randn(3, 8)
    y = torch.zeros(3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="rms_norm_: y requires grad"):
        xk.rms_norm_(y, x)
    assert (y == 0).all()
    with torch.no_grad():
        xk.rms_norm_(y, x)
    torch.testing.assert_close(y.detach(), xk.rms_norm(x))


# ---- overlap --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
def test_y_overlapping_x_partly_is_refused_but_y_is_x_allowed(op):
    forward = {"rms_norm": xk.rms_norm_, "layer_norm": xk.layer_norm_, "softmax": xk.softmax_}[op]
    buffer = _x(rows=5)
    before = buffer.copy()
    with pytest.raises(ValueError, match=f"{op}_: y shares memory with x"):
        forward(buffer[1:], buffer[:4])
    np.testing.assert_array_equal(buffer, before)
    expected = {"rms_norm": xk.rms_norm, "layer_norm": xk.layer_norm, "softmax": xk.softmax}[op](
        buffer
    )
    forward(buffer, buffer)
    np.testing.assert_allclose(buffer, expected, rtol=1e-6)


def test_checkpoint_overlapping_the_input_is_refused():
    x = _x()
    ck = RMSNormCheckpoints(rstd=x[:, 0].copy())
    inside = RMSNormCheckpoints(rstd=x.reshape(-1)[:4])
    y = np.empty_like(x)
    xk.rms_norm_(y, x, checkpoints=ck)
    with pytest.raises(ValueError, match="checkpoints.rstd shares memory with x"):
        xk.rms_norm_(y, x, checkpoints=inside)


def test_interleaved_outputs_that_do_not_overlap_are_accepted():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    packed = torch.randn(4, 2, 8)  # two row sets interleaved in one buffer
    out = torch.empty(4, 2, 8)
    xk.softmax_(out[:, 0], packed[:, 0])
    xk.softmax_(out[:, 1], packed[:, 1])
    torch.testing.assert_close(out, torch.softmax(packed, -1))


# ---- checkpoints remember their forward -----------------------------------------------------


def test_backward_refuses_checkpoints_no_forward_wrote():
    x, w = _x(), np.ones(16, np.float32)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    ck.rstd[...] = 1.0
    with pytest.raises(ValueError, match="checkpoints were never written by a forward"):
        xk.rms_norm_backward(np.ones_like(x), x, w, checkpoints=ck)


def test_forward_without_checkpoints_leaves_them_unwritten():
    x, w = _x(), np.ones(16, np.float32)
    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    xk.rms_norm(x, w)
    with pytest.raises(ValueError, match="never written"):
        xk.rms_norm_backward(np.ones_like(x), x, w, checkpoints=ck)


def test_backward_with_another_offset_names_the_option():
    x, w = _x(), rng.standard_normal(16).astype(np.float32)
    _, ck = _rms_forward(x, w, offset=1.0)
    with pytest.raises(ValueError, match=r"offset=0.0 differs from the forward .* offset=1.0"):
        xk.rms_norm_backward(np.ones_like(x), x, w, checkpoints=ck)
    xk.rms_norm_backward(np.ones_like(x), x, w, checkpoints=ck, offset=1.0)


def test_backward_with_a_weight_the_forward_did_not_have_is_refused():
    x = _x()
    _, ck = _rms_forward(x)
    with pytest.raises(ValueError, match="weight='given' differs .* weight='none'"):
        xk.rms_norm_backward(np.ones_like(x), x, np.ones(16, np.float32), checkpoints=ck)
    lck = xk.allocate_checkpoints(xk.layer_norm_, x)
    xk.layer_norm(x, checkpoints=lck)
    with pytest.raises(ValueError, match="layer_norm_backward_: weight='given' differs"):
        xk.layer_norm_backward(np.ones_like(x), x, np.ones(16, np.float32), checkpoints=lck)


def test_hand_built_checkpoints_are_refused_until_a_forward_writes_them():
    x = _x()
    _, ck = _rms_forward(x)
    copied = ck._replace(rstd=ck.rstd.copy())
    with pytest.raises(ValueError, match="never written"):
        xk.rms_norm_backward(np.ones_like(x), x, checkpoints=copied)
    xk.rms_norm(x, checkpoints=copied)
    xk.rms_norm_backward(np.ones_like(x), x, checkpoints=copied)


def test_checkpoint_in_another_namespace_names_both_namespaces():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    x = _x()
    ck = xk.allocate_checkpoints(xk.rms_norm_, torch.from_numpy(x))
    with pytest.raises(
        TypeError, match="checkpoints.rstd is a torch array but the call's arrays are numpy"
    ):
        xk.rms_norm_(np.empty_like(x), x, checkpoints=ck)


# ---- RMSNorm without a weight; weights must be contiguous -----------------------------------


def test_rms_norm_without_weight_equals_unit_weight():
    x = _x()
    y, ck = _rms_forward(x)
    y1, ck1 = _rms_forward(x, np.ones(16, np.float32))
    np.testing.assert_array_equal(y, y1)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx, dw = xk.rms_norm_backward(dy, x, checkpoints=ck)
    dx1, _ = xk.rms_norm_backward(dy, x, np.ones(16, np.float32), checkpoints=ck1)
    assert dw is None
    np.testing.assert_allclose(dx, dx1, rtol=1e-6, atol=1e-7)


def test_rms_norm_offset_without_weight_is_refused():
    with pytest.raises(ValueError, match="offset=1.0 applies to the weight, but w is None"):
        xk.rms_norm(_x(), offset=1.0)


def test_rms_norm_backward_refuses_a_strided_weight():
    x = _x()
    w2 = np.ones(32, np.float32)
    _, ck = _rms_forward(x, w2[::2].copy())
    dx = np.full_like(x, 7.0)
    with pytest.raises(ValueError, match="W must be contiguous"):
        xk.rms_norm_backward_(
            Duplicated(x, np.ones_like(x)), Duplicated(x, dx), w2[::2], checkpoints=ck
        )
    assert (dx == 7.0).all()


# ---- capture-safe integer checks and the debug switch ---------------------------------------


def test_device_lengths_are_not_read_on_the_host_outside_debug_mode():
    torch = pytest.importorskip("torch", reason="the host-read guard is a torch tensor subclass")
    lengths = no_host_reads(torch.tensor([3, 99], dtype=torch.int32))
    batch_integers("f", "k_lengths", torch, lengths, 2, 0, 8, "Sk")
    with xk.debug():
        with pytest.raises(HostRead, match="host read"):
            batch_integers("f", "k_lengths", torch, lengths, 2, 0, 8, "Sk")


def test_debug_mode_checks_device_values():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    lengths = torch.tensor([3, 99], dtype=torch.int64)
    batch_integers("f", "k_lengths", torch, lengths, 2, 0, 8, "Sk")
    with (
        xk.debug(),
        pytest.raises(
            ValueError, match=r"k_lengths must lie in \[0, 8\] \(Sk\), got values in \[3, 99\]"
        ),
    ):
        batch_integers("f", "k_lengths", torch, lengths, 2, 0, 8, "Sk")


def test_host_values_are_always_checked_and_must_fit_the_index_type():
    with pytest.raises(ValueError, match=r"k_lengths must lie in \[0, 8\]"):
        batch_integers("f", "k_lengths", np, np.array([3, 9]), 2, 0, 8, "Sk")
    with pytest.raises(ValueError, match="input_pos must lie in"):
        batch_integers("f", "input_pos", np, np.array([0, INDEX_MAX + 1]), 2, None, None, "")
    with pytest.raises(TypeError, match="must have dtype int32 or int64, got uint8"):
        batch_integers("f", "k_lengths", np, np.array([3, 4], np.uint8), 2, 0, 8, "Sk")
    assert index_int("f", "input_pos", np.int64(-5)) == -5
    with pytest.raises(ValueError, match="input_pos must lie in"):
        index_int("f", "input_pos", 2**40)
    with pytest.raises(TypeError, match="input_pos must be an int, got bool"):
        index_int("f", "input_pos", True)


def test_debug_mode_fills_fresh_buffers_with_nan(monkeypatch):
    x = _x()
    with xk.debug():
        assert np.isnan(Duplicated(x).shadow).all()
        assert np.isnan(xk.allocate_checkpoints(xk.rms_norm_, x).rstd).all()
    monkeypatch.setenv("XPKERNELS_DEBUG", "1")
    assert np.isnan(xk.allocate_checkpoints(xk.layer_norm_, x).mean).all()
    with xk.debug(False):
        assert not xk.debug_enabled()


def test_rms_norm_without_weight_on_triton_matches_array_api():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.from_numpy(_x(rows=5, m=40)).to(device)
    dy = torch.randn(5, 40, device=device)
    results = []
    for backend in ("array_api", "triton"):
        ck = xk.allocate_checkpoints(xk.rms_norm_, x)
        y = xk.rms_norm(x, checkpoints=ck, backend=backend)
        dx, dw = xk.rms_norm_backward(dy, x, checkpoints=ck, backend=backend)
        assert dw is None
        results.append((y, dx))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
