"""``xpkernels.torch.nn`` modules and the PyTorch demo.

RMSNorm and LayerNorm are drop-ins for ``torch.nn.RMSNorm`` /
``torch.nn.LayerNorm``: same constructor arguments, same ``state_dict``
keys, loaded either way with the same outputs and gradients. Attention
matches PyTorch's SDPA over the same projections (GQA, causal), and a score
mod's ``nn.Parameter`` is a module parameter that learns. ``demo --torch``
trains the NumPy demo's model with ``loss.backward()`` and ``torch.optim``
along the NumPy demo's own loss trajectory.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no xpkernels.torch")

import torch.nn.functional as F

from xpkernels.mods import AliBiScore, SlidingWindowMask
from xpkernels.torch import nn as xnn

#: Float64 gradients read float32 checkpoints (rstd, mean; DESIGN section 2): ~1e-7 relative.
RTOL, ATOL = 1e-6, 1e-6

NORM_CASES = [
    ("RMSNorm", {"normalized_shape": 8}),
    ("RMSNorm", {"normalized_shape": (2, 4), "eps": 1e-5}),
    ("RMSNorm", {"normalized_shape": 8, "elementwise_affine": False}),
    ("LayerNorm", {"normalized_shape": 8}),
    ("LayerNorm", {"normalized_shape": (2, 4), "eps": 1e-6}),
    ("LayerNorm", {"normalized_shape": 8, "bias": False}),
    ("LayerNorm", {"normalized_shape": 8, "elementwise_affine": False}),
]


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("name, kwargs", NORM_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("direction", ["torch_to_xpkernels", "xpkernels_to_torch"])
def test_state_dict_interchange_with_torch_nn(name, kwargs, direction):
    ours = getattr(xnn, name)(**kwargs, dtype=torch.float64)
    theirs = getattr(torch.nn, name)(**kwargs, dtype=torch.float64)
    source, target = (theirs, ours) if direction == "torch_to_xpkernels" else (ours, theirs)
    _randomise(source, 1)
    _randomise(target, 2)
    assert list(source.state_dict()) == list(target.state_dict())
    target.load_state_dict(source.state_dict())
    x = torch.randn(3, 5, *ours.normalized_shape, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y_ours, y_theirs = ours(x), theirs(x2)
    torch.testing.assert_close(y_ours, y_theirs)
    cot = torch.randn(y_ours.shape, dtype=torch.float64)
    (y_ours * cot).sum().backward()
    (y_theirs * cot).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=RTOL, atol=ATOL)
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=n)


def test_norm_options_are_checked_when_the_module_is_built():
    with pytest.raises(ValueError, match=r"RMSNorm: offset=1.0 .* needs elementwise_affine=True"):
        xnn.RMSNorm(8, elementwise_affine=False, offset=1.0)
    with pytest.raises(ValueError, match=r"LayerNorm: eps must be finite and > 0, got 0"):
        xnn.LayerNorm(8, eps=0)
    with pytest.raises(TypeError, match=r"RMSNorm: offset must be a real number, got str"):
        xnn.RMSNorm(8, offset="1")


def test_norm_rejects_an_input_of_another_shape():
    with pytest.raises(
        ValueError, match=r"RMSNorm: input must end with the normalized_shape \(8,\)"
    ):
        xnn.RMSNorm(8)(torch.ones(2, 7))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attention_module_matches_sdpa_over_the_same_projections(heads, kv_heads):
    torch.manual_seed(0)
    att = xnn.Attention(16, heads, kv_heads, causal=True, bias=True, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    y = att(x)
    b, s, _ = x.shape
    d = att.head_dim
    q = att.q_proj(x).view(b, s, heads, d).transpose(1, 2)
    k = att.k_proj(x).view(b, s, kv_heads, d).transpose(1, 2)
    v = att.v_proj(x).view(b, s, kv_heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = att.o_proj(o.transpose(1, 2).reshape(b, s, heads * d))
    torch.testing.assert_close(y, want)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx)


def test_attention_module_with_a_learnable_score_mod_and_a_mask():
    torch.manual_seed(0)
    slopes = torch.nn.Parameter(torch.rand(2, dtype=torch.float64))
    att = xnn.Attention(
        8, 2, score_mod=AliBiScore(slopes), mask_mod=SlidingWindowMask(2), dtype=torch.float64
    )
    assert att.score_mod_slopes is slopes
    assert "score_mod_slopes" in att.state_dict()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    y = att(x)
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, 2, 4).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = (j <= i) & (j >= i - 2)
    scores = q @ k.transpose(-1, -2) / 2.0 + slopes[:, None, None] * (j - i)
    o = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
    want = att.o_proj(o.transpose(1, 2).reshape(b, s, 8))
    torch.testing.assert_close(y, want)
    before = slopes.detach().clone()
    optimiser = torch.optim.SGD(att.parameters(), lr=0.1)
    y.square().sum().backward()
    assert slopes.grad is not None and torch.count_nonzero(slopes.grad) > 0
    optimiser.step()
    assert not torch.equal(slopes.detach(), before)


@pytest.mark.parametrize("how", ["assign", "to_empty"])
def test_attention_module_reads_score_mod_parameters_that_loading_replaced(how):
    """``load_state_dict(assign=True)`` and ``to_empty`` put new parameter objects on the
    module (the meta-device loading path): the score mod (a chain of two mods, one parameter
    each) must read and train those, not the tensors it was built with."""
    from xpkernels.mods import ScoreMod

    def make(device=None):
        slopes = torch.nn.Parameter(torch.full((2,), 0.1, dtype=torch.float64, device=device))
        gain = torch.nn.Parameter(torch.ones(1, dtype=torch.float64, device=device))
        tilt = ScoreMod(lambda score, b, h, q_idx, kv_idx, *, gain: score * gain[0], gain=gain)
        mod = AliBiScore(slopes) >> tilt
        return xnn.Attention(8, 2, score_mod=mod, dtype=torch.float64, device=device)

    torch.manual_seed(0)
    source = make()
    with torch.no_grad():
        source.score_mod_slopes.fill_(2.0)
        source.score_mod_gain.fill_(0.5)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    if how == "assign":
        loaded = make()
        loaded.load_state_dict(source.state_dict(), assign=True)
    else:
        loaded = make("meta").to_empty(device="cpu")
        with torch.no_grad():
            loaded.load_state_dict(source.state_dict())
    assert loaded.score_mod_slopes is not source.score_mod_slopes
    torch.testing.assert_close(loaded(x), source(x), rtol=0, atol=0)
    loaded(x).sum().backward()
    source(x).sum().backward()
    for name in ("score_mod_slopes", "score_mod_gain"):
        torch.testing.assert_close(getattr(loaded, name).grad, getattr(source, name).grad)


def test_attention_module_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        xnn.Attention(16, 4, 3)


def test_torch_demo_follows_the_numpy_demo_and_learns():
    from xpkernels.cli import demo, demo_torch

    cfg = demo.Config(context=16, batch=4, dim=32, heads=2, layers=1, hidden=64, lr=2e-2)
    lines = []
    losses, error, _, _ = demo_torch.train(steps=12, cfg=cfg, log=lines.append)
    assert error <= demo.GRADIENT_TOLERANCE, lines
    numpy_losses = demo.train(steps=12, cfg=cfg, log=lambda line: None)[0]
    # Same parameters, batches and Adam: float32 runs of one trajectory.
    assert losses == pytest.approx(numpy_losses, rel=1e-3)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3


def test_demo_torch_flag_runs_the_torch_demo(monkeypatch):
    """``demo --torch`` reaches demo_torch.run with the command's options (the run itself is above)."""
    from xpkernels.__main__ import main
    from xpkernels.cli import demo_torch

    calls = []
    monkeypatch.setattr(demo_torch, "run", lambda *args: calls.append(args) or 0)
    assert main(["demo", "--torch", "--steps", "7", "--seed", "3", "--sample", "0"]) == 0
    assert calls == [(7, "cpu", None, 3, 0)]


def test_rms_norm_offset_scales_by_weight_plus_offset():
    """``offset=1`` is Gemma's ``x / rms(x) * (1 + weight)``, over a 2-D normalized_shape too."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    norm = xnn.RMSNorm((4, 5), eps=1e-6, dtype=torch.float64, offset=1.0)
    with torch.no_grad():
        norm.weight.normal_()
    want = F.rms_norm(x, (4, 5), eps=1e-6) * (1.0 + norm.weight)
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)
    assert "offset=1.0" in repr(norm)
