"""The Triton flex kernels against the array_api backend, op by op of the generated mod code.

The conformance suite runs the flex specs on the triton backend (interpreter);
here each operation the code generator spells is exercised by a score or mask
mod that uses it on negative and positive operands, forward and backward
(score-mod array gradients included), and the generated source itself is
checked for what the kernels rely on.
"""

from __future__ import annotations

import pytest

from xpkernels.testing import harness

harness.select_triton_interpreter()

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import xpkernels as xk  # noqa: E402
from xpkernels import mods as xm  # noqa: E402
from xpkernels.buffers import grad_shadow  # noqa: E402
from xpkernels.mods.codegen import constants, triton_source  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

#: Both backends compute in float32 with the same inputs, in different summation orders (tiles
#: of 16 against whole rows) over at most 35 keys x 16 dims, and the array gradients over every
#: pair: 256 float32 ulps of O(1) values bounds both with room (DESIGN section 5).
_EPS = 256 * 1.1920928955078125e-07


def _table():
    return torch.linspace(-1.0, 1.0, 2 * 3 * 11).reshape(2, 3, 11)


#: name -> (score mod factory, mask mod): each operation of the generator on mixed signs.
MODS = {
    "floordiv-mod-negative": (
        lambda: lambda s, b, h, q, k: s + 0.1 * ((q - k) // 3) - 0.05 * ((k - q) % 4),
        lambda b, h, q, k: (q - k) // 5 != -2,
    ),
    "float-floordiv-mod": (
        lambda: lambda s, b, h, q, k: s + (s * 3.0) // 1.5 * 0.1 + (s % 0.7),
        None,
    ),
    "trig-exp2-sigmoid": (
        lambda: (
            lambda s, b, h, q, k: (
                xm.sin(s)
                + xm.cos(0.5 * s)
                + 0.1 * xm.tan(0.3 * s)
                + xm.exp2(0.2 * s)
                + xm.sigmoid(s * (h + 1.0))
            )
        ),
        None,
    ),
    "pow-abs-sqrt-log": (
        lambda: (
            lambda s, b, h, q, k: (
                (xm.abs(s) + 1.0) ** (0.5 + 0.01 * (q - k))
                + xm.sqrt(s * s + 1.0)
                + xm.log(1.0 + s * s)
                + (q - k) ** 2 * 0.001
                - xm.abs(q - k) * 0.01
            )
        ),
        lambda b, h, q, k: (q - k) ** 3 >= -27,
    ),
    "negative-base-pow": (
        lambda: lambda s, b, h, q, k: s + 0.1 * ((k - q) * 1.0) ** 3.0,
        None,
    ),
    "floor-log-bucket": (
        lambda: (
            lambda s, b, h, q, k: (
                s + 0.1 * xm.floor(xm.log(xm.abs(q - k) + 1.0) * 2.0) * xm.where(q >= k, 1.0, -1.0)
            )
        ),
        None,
    ),
    "minimum-maximum-where-compare": (
        lambda: (
            lambda s, b, h, q, k: xm.where(
                xm.logical_or(s > 0.5, xm.logical_not(q == k)),
                xm.minimum(s, 1.0) + xm.maximum(q - k, -2) * 0.1,
                -s,
            )
        ),
        lambda b, h, q, k: xm.logical_and(k <= q + 3, k != q - 2),
    ),
    "head-only-mask": (None, lambda b, h, q, k: xm.logical_and(h != 1, b == 0)),
    "tanh-div-neg": (lambda: lambda s, b, h, q, k: -xm.tanh(s / (1.0 + 0.1 * h)) * 2.0, None),
    "table-gather-grads": (
        lambda: xm.ScoreMod(
            lambda s, b, h, q, k, *, t: s * t[b, h, xm.minimum(xm.maximum(k - q + 5, 0), 10)],
            t=torch.nn.Parameter(_table()),
        ),
        None,
    ),
    "row-features-grads": (
        lambda: xm.ScoreMod(
            lambda s, b, h, q, k, *, q_row, f: s + f[b, q_row] * xm.exp(-0.1 * h),
            f=torch.nn.Parameter(torch.linspace(-1.0, 1.0, 2 * 19).reshape(2, 19)),
        ),
        None,
    ),
    "key-features-grads": (
        lambda: xm.ScoreMod(
            lambda s, b, h, q, k, *, f: s + xm.sin(f[k]) * 0.5,
            f=torch.nn.Parameter(torch.linspace(-2.0, 2.0, 35)),
        ),
        xm.CausalMask(),
    ),
}


def _run(backend, make_score, mask, block_mask=None):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 19, 16, requires_grad=True)
    k = torch.randn(2, 3, 35, 16, requires_grad=True)
    v = torch.randn(2, 3, 35, 16, requires_grad=True)
    score = make_score() if make_score else None
    o = xk.flex_attention(
        q,
        k,
        v,
        score_mod=score,
        mask_mod=mask,
        block_mask=block_mask,
        input_pos=12,
        backend=backend,
    )
    params = [a for a in getattr(score, "arrays", {}).values() if a.requires_grad]
    grads = torch.autograd.grad(o, [q, k, v, *params], torch.cos(o.detach() * 7.0 + 1.0))
    return (o.detach(), *grads)


@pytest.mark.parametrize("name", list(MODS))
def test_generated_mod_code_matches_array_api(name):
    make_score, mask = MODS[name]
    want = _run("array_api", make_score, mask)
    got = _run("triton", make_score, mask)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=_EPS, rtol=_EPS)


def test_block_mask_tiles_the_kernel_does_not_divide():
    """A 6 x 10 BlockMask: kernel tiles straddle plan tiles and read each pair's plan state."""
    mask = xm.SlidingWindowMask(7)
    block = xm.build_block_mask(mask, 19, 35, tile_m=6, tile_n=10, input_pos=12)
    # a state the mask alone would not give: this tile is skipped although the mask keeps pairs
    block.states[0, 0, 2, 1] = xm.SKIP
    want = _run("array_api", None, None, block)
    got = _run("triton", None, None, block)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=_EPS, rtol=_EPS)


def test_constants_are_arguments_not_source():
    """Two windows share one generated source; their constants differ."""
    a, b = xm.SlidingWindowMask(8).graph, xm.SlidingWindowMask(64).graph
    assert triton_source(a, "mask", "m") == triton_source(b, "mask", "m")
    assert constants(a) != constants(b)


def test_score_mod_gradients_add_into_accumulators():
    """The triton backward ADDS into grad_shadow(mod), as every backend."""
    slopes = torch.linspace(0.1, 0.4, 3)
    mod = xm.AliBiScore(slopes)
    q, k, v = (torch.randn(1, 3, 17, 16) for _ in range(3))
    ckpt = xk.allocate_checkpoints(xk.flex_attention_, q, k, v)
    o = torch.empty_like(q)
    xk.flex_attention_(o, q, k, v, score_mod=mod, checkpoints=ckpt, backend="triton")
    sums = []
    for backend in ("array_api", "triton"):
        g = grad_shadow(mod)
        g.slopes.fill_(1.0)
        xk.flex_attention_backward_(
            xk.Duplicated(o, torch.ones_like(o)),
            xk.Duplicated(q, torch.empty_like(q)),
            xk.Duplicated(k, torch.empty_like(k)),
            xk.Duplicated(v, torch.empty_like(v)),
            checkpoints=ckpt,
            score_mod=mod,
            score_mod_grad=g,
            backend=backend,
        )
        sums.append(g.slopes.clone())
    torch.testing.assert_close(sums[1], sums[0], atol=_EPS, rtol=_EPS)
    assert not torch.allclose(sums[1], torch.ones(3))
