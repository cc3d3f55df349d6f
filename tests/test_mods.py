"""Mods: tracing, evaluation on every namespace, reverse mode, bands, block masks, host helpers."""

from __future__ import annotations

import math

import array_api_compat
import numpy as np
import pytest

from xpkernels import mods as xm
from xpkernels.buffers import grad_shadow

strict = pytest.importorskip(
    "array_api_strict", reason="array_api_strict is the portability check namespace"
)

NAMESPACES = ["numpy", "array_api_strict"]
try:
    import torch

    NAMESPACES.append("torch")
except ImportError:
    torch = None


def to_namespace(a, name):
    a = np.asarray(a)
    if name == "torch":
        return torch.from_numpy(np.ascontiguousarray(a))
    if name == "array_api_strict":
        return strict.asarray(a)
    return a


def host(a):
    return (
        a.numpy()
        if torch is not None and isinstance(a, torch.Tensor)
        else np.from_dlpack(a)
        if not isinstance(a, np.ndarray)
        else a
    )


def grids(batch=2, heads=3, n_q=7, n_kv=9, pos=0):
    """Broadcastable host index grids b, h, q_row, q_idx, kv_idx (rank 4)."""
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    row = np.arange(n_q)[None, None, :, None]
    return b, h, row, row + pos, np.arange(n_kv)[None, None, None, :]


def relative_bias(score, b, h, q_idx, kv_idx, *, table):
    return score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -4), 4) + 4]


def log_bucket_bias(score, b, h, q_idx, kv_idx, *, table):
    """T5-style buckets: exact below 2, logarithmic up to 16, written with floor."""
    rel = abs(q_idx - kv_idx)
    far = xm.maximum(xm.floor(2 + xm.log(xm.maximum(rel, 1) / 2) / math.log(8) * 6), 2)
    return score + table[h, xm.minimum(xm.where(rel < 2, rel, far), 7)]


def trigonometric(score, b, h, q_idx, kv_idx):
    return xm.sin(score) + xm.cos(0.5 * score) * xm.tan(0.3 * score) + np.sin(q_idx - kv_idx)


def gated_power(score, b, h, q_idx, kv_idx, *, e, w):
    """Traced exponents (a captured array, the score) and the sigmoid and exp2 helpers."""
    return (1.5 + xm.sigmoid(score)) ** e[h] + 2.0 ** (w[h] * score) - xm.exp2(-score)


# --------------------------------------------------------------------------- tracing


def test_mod_is_traced_once_into_a_shared_graph():
    calls = []

    def mask(b, h, q_idx, kv_idx):
        calls.append(1)
        return xm.logical_and(kv_idx <= q_idx, kv_idx <= q_idx)

    mod = xm.MaskMod(mask)
    for _ in range(3):
        xm.mask_value(mod, np.arange(4)[:, None], np.arange(4)[None, :])
    assert len(calls) == 1
    ops = [n.op for n in mod.graph.nodes]
    assert ops.count("le") == 1, "identical sub-expressions are shared"
    assert mod.graph.inputs == {"q_idx", "kv_idx"}
    assert "le(" in str(mod.graph)


@pytest.mark.parametrize(
    "fn, arrays, message",
    [
        (lambda s, b, h, q, kv: s if q > kv else 0.0, {}, r"as a Python bool"),
        (lambda s, b, h, q, kv: math.exp(s), {}, r"float\(\) or a math\.\* function"),
        (lambda s, b, h, q, kv: np.arctan2(s, s), {}, r"numpy\.arctan2 is not supported"),
        (lambda s, b, h, q, kv: np.clip(s, 0, 1), {}, r"clamp with minimum\(maximum\(x, low\)"),
        (lambda s, b, h, q, kv: xm.floor(s > 0), {}, r"floor of a condition"),
        (
            lambda s, b, h, q, kv: s + np.ones((4, 4))[q, kv],
            {},
            r"indexing a plain array with a traced value",
        ),
        (
            lambda s, b, h, q, kv, *, t: s + t[s > 0],
            {"t": np.ones(3)},
            r"index on axis 0 must be an integer",
        ),
        (
            lambda s, b, h, q, kv, *, t: s + t[q, :],
            {"t": np.ones((3, 3))},
            r"slices, \.\.\. and None are not supported",
        ),
        (
            lambda s, b, h, q, kv, *, t: s + t[q],
            {"t": np.ones((3, 3))},
            r"it has 2 axes, got 1 indices",
        ),
        (lambda s, b, h, q, kv, *, t: s + t, {"t": np.ones(3)}, r"captured array .* is used whole"),
        (
            lambda s, b, h, q, kv: s + (q & kv),
            {},
            r"bitwise operations on integers are not supported",
        ),
        (lambda s, b, h, q, kv: s @ s, {}, r"the @ operator is not supported"),
        (lambda s, b, h, q, kv: q > kv, {}, r"a score mod must return a number"),
        (lambda s, b, h, q, kv: s + [1.0], {}, r"a list cannot be used in a mod"),
        (lambda s, b, h, q, kv: s.clip(0), {}, r"attribute or method \.clip"),
    ],
)
def test_unsupported_operations_fail_at_trace_time_naming_them(fn, arrays, message):
    with pytest.raises(xm.TraceError, match=message):
        xm.ScoreMod(fn, **arrays)


def test_mask_must_return_a_condition():
    with pytest.raises(xm.TraceError, match="a mask mod must return a condition"):
        xm.MaskMod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx)


def test_numpy_ufuncs_on_traced_values_are_recorded():
    mod = xm.ScoreMod(
        lambda s, b, h, q, kv: np.maximum(np.exp(s), 1.0) + np.where(q > kv, 1.0, 0.0)
    )
    score = np.linspace(-2, 2, 5)
    expected = np.maximum(np.exp(score), 1.0) + (np.arange(5) > 1)
    np.testing.assert_allclose(xm.score_value(mod, score, np.arange(5), 1), expected)


def test_int_score_mod_result_becomes_float():
    mod = xm.ScoreMod(lambda s, b, h, q_idx, kv_idx: q_idx - kv_idx)
    assert mod.graph.nodes[mod.graph.output].kind == "float"
    np.testing.assert_array_equal(xm.score_value(mod, 0.0, 5, np.arange(3)), [5.0, 4.0, 3.0])


# ------------------------------------------------------------- built-ins and host evaluation

MASKS = {
    "full": lambda: xm.FullMask(),
    "causal": lambda: xm.CausalMask(),
    "sliding3": lambda: xm.SlidingWindowMask(3),
    "prefix4": lambda: xm.PrefixMask(4),
    "prefix_lm4": lambda: xm.prefix_lm(4),
    "document": lambda: xm.DocumentMask(
        np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    ),
    "document-rows": lambda: xm.DocumentMask(np.arange(7) % 3, np.arange(9) % 2),
    "sliding&document": lambda: xm.SlidingWindowMask(2) & xm.DocumentMask(np.arange(9) // 4),
    "causal|prefix&sliding": lambda: xm.CausalMask() | (xm.PrefixMask(2) & xm.SlidingWindowMask(5)),
    "user": lambda: xm.MaskMod(
        lambda b, h, q, kv: xm.logical_or(kv == 0, (q + kv + h + b) % 3 == 0)
    ),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_traced_mask_equals_the_function_itself(name):
    mask = MASKS[name]()
    b, h, row, q_idx, kv_idx = grids(pos=2 if name not in ("document", "sliding&document") else 0)
    direct = np.broadcast_to(mask(b, h, q_idx, kv_idx, q_row=row), (2, 3, 7, 9))
    traced = xm.mask_value(mask, q_idx, kv_idx, b, h, input_pos=q_idx - row)
    np.testing.assert_array_equal(traced, direct)


def test_builtin_masks_mean_what_they_say():
    q, kv = np.arange(8)[:, None], np.arange(8)[None, :]
    np.testing.assert_array_equal(xm.mask_value(xm.CausalMask(), q, kv), kv <= q)
    np.testing.assert_array_equal(
        xm.mask_value(xm.SlidingWindowMask(2), q, kv), (q - 2 <= kv) & (kv <= q)
    )
    np.testing.assert_array_equal(
        xm.mask_value(xm.PrefixMask(3), q, kv), np.broadcast_to(kv < 3, (8, 8))
    )
    np.testing.assert_array_equal(xm.mask_value(xm.prefix_lm(3), q, kv), (kv <= q) | (kv < 3))
    assert xm.mask_value(xm.FullMask(), q, kv).all()


SCORES = {
    "noop": lambda: xm.NoOpScore(),
    "softcap": lambda: xm.SoftCapScore(2.0),
    "alibi": lambda: xm.AliBiScore(np.array([0.5, -0.25, 0.125])),
    "bias": lambda: xm.BiasScore(np.random.default_rng(1).standard_normal((1, 3, 7, 9))),
    "bias-batch": lambda: xm.BiasScore(np.random.default_rng(2).standard_normal((2, 1, 7, 9))),
    "alibi>>softcap": lambda: xm.AliBiScore(np.array([0.5, -0.25, 0.125])) >> xm.SoftCapScore(1.5),
    "relpos": lambda: xm.ScoreMod(
        relative_bias, table=np.random.default_rng(3).standard_normal((3, 9))
    ),
    "log-bucket": lambda: xm.ScoreMod(
        log_bucket_bias, table=np.random.default_rng(8).standard_normal((3, 8))
    ),
    "trig": lambda: xm.ScoreMod(trigonometric),
    "power": lambda: xm.ScoreMod(
        gated_power,
        e=np.random.default_rng(9).uniform(0.5, 2.0, 3),
        w=np.random.default_rng(10).uniform(-0.5, 0.5, 3),
    ),
    "pair": lambda: xm.PairFeatureScore(
        lambda qv, kv: [qv[0] * kv[1], xm.sqrt(qv[1] * qv[1] + kv[0] * kv[0] + 1.0)],
        *(np.random.default_rng(4).standard_normal(s) for s in ((2, 7, 2), (2, 9, 2), (3, 2))),
    ),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_traced_score_equals_the_function_itself(name):
    mod = SCORES[name]()
    b, h, row, q_idx, kv_idx = grids(pos=3)
    score = np.random.default_rng(5).standard_normal((2, 3, 7, 9))
    direct = mod(score, b, h, q_idx, kv_idx, q_row=row)
    np.testing.assert_allclose(
        xm.score_value(mod, score, q_idx, kv_idx, b, h, input_pos=3), direct, rtol=1e-14
    )


@pytest.mark.parametrize("name", sorted(SCORES))
def test_reverse_mode_matches_finite_differences(name):
    """d(score out)/d(score in) and every captured float array's gradient vs central differences."""
    mod = SCORES[name]()
    b, h, row, q_idx, kv_idx = grids(pos=3)
    rng = np.random.default_rng(6)
    score = rng.standard_normal((2, 3, 7, 9))
    cot = rng.standard_normal((2, 3, 7, 9))
    d_score, grads = xm.score_grad(
        mod, score, cot, q_idx, kv_idx, b, h, input_pos=3, feature_grads=True
    )
    eps = 1e-6

    def loss(score_in):
        return float(np.sum(cot * mod(score_in, b, h, q_idx, kv_idx, q_row=row)))

    np.testing.assert_allclose(
        d_score,
        cot
        * (
            mod(score + eps, b, h, q_idx, kv_idx, q_row=row)
            - mod(score - eps, b, h, q_idx, kv_idx, q_row=row)
        )
        / (2 * eps),
        atol=1e-7,
    )
    for field, grad in grads.items():
        owner = mod.parts[int(field.split(".")[0])] if "." in field else mod
        array = owner.arrays[field.split(".")[-1]]
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            saved = array[index]
            array[index] = saved + eps
            up = loss(score)
            array[index] = saved - eps
            down = loss(score)
            array[index] = saved
            numeric[index] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, atol=1e-6, err_msg=field)


#: One score mod per differentiable operation of the op table: ``f(score, w[h])`` with
#: score and w in [0.5, 1.5] (inside every operation's domain).
OP_MODS = {
    "add": lambda s, w: s + w,
    "sub": lambda s, w: s - w,
    "mul": lambda s, w: s * w,
    "div": lambda s, w: s / w,
    "mod": lambda s, w: (3.0 * s) % w,
    "pow": lambda s, w: s**w,
    "neg": lambda s, w: -(s * w),
    "abs": lambda s, w: abs(s - w),
    "exp": lambda s, w: xm.exp(s * w),
    "exp2": lambda s, w: xm.exp2(s * w),
    "log": lambda s, w: xm.log(s * w),
    "tanh": lambda s, w: xm.tanh(s * w),
    "sqrt": lambda s, w: xm.sqrt(s * w),
    "sin": lambda s, w: xm.sin(s * w),
    "cos": lambda s, w: xm.cos(s * w),
    "tan": lambda s, w: xm.tan(s * w),
    "sigmoid": lambda s, w: xm.sigmoid(s * w),
    "minimum": lambda s, w: xm.minimum(s, w),
    "maximum": lambda s, w: xm.maximum(s, w),
    "where": lambda s, w: xm.where(s > w, 2.0 * s, 3.0 * w),
}


def test_pow_at_a_zero_base_takes_pytorchs_gradients():
    """``x ** y`` where it is not differentiable, as torch.pow's backward: d/dx = 0 where
    y = 0, d/dy = 0 where x = 0 and y >= 0 -- no NaN from 0 * inf or log 0, so a learnable
    exponent starting at 0 over a distance of 0 (the diagonal) trains."""
    torch = pytest.importorskip("torch")
    x = np.array([0.0, 0.0, 2.0, 0.0])
    y = np.array([0.0, 2.0, 0.0, 1.0])
    mod = xm.ScoreMod(lambda score, b, h, q, kv, *, y: score ** y[kv], y=y)
    kv = np.arange(4)[None, :]
    d_score, grads = xm.score_grad(mod, x[None, :], np.ones((1, 4)), np.zeros((1, 4), int), kv)
    tx, ty = (torch.tensor(a, requires_grad=True) for a in (x, y))
    (tx**ty).sum().backward()
    np.testing.assert_array_equal(d_score[0], tx.grad.numpy())
    np.testing.assert_array_equal(grads.y, ty.grad.numpy())


def test_every_differentiable_operation_has_a_finite_difference_case():
    from xpkernels.mods.ir import OPS

    assert {name for name, op in OPS.items() if op.vjp is not None} == set(OP_MODS)


@pytest.mark.parametrize("name", sorted(OP_MODS))
def test_each_operation_vjp_matches_finite_differences(name):
    """The op table's reverse mode of ``name`` (score and a captured array) vs central differences."""
    b, h, row, q_idx, kv_idx = grids(pos=1)
    rng = np.random.default_rng(11)
    w = rng.uniform(0.5, 1.5, 3)
    mod = xm.ScoreMod(lambda score, b, h, q, kv, *, w: OP_MODS[name](score, w[h]), w=w)
    assert name in {n.op for n in mod.graph.nodes}
    score = rng.uniform(0.5, 1.5, (2, 3, 7, 9))
    cot = rng.standard_normal((2, 3, 7, 9))
    d_score, grads = xm.score_grad(mod, score, cot, q_idx, kv_idx, b, h, input_pos=1)
    eps = 1e-6

    def out(score_in, w_in):
        return OP_MODS[name](score_in, w_in[h])

    numeric = cot * (out(score + eps, w) - out(score - eps, w)) / (2 * eps)
    np.testing.assert_allclose(d_score, np.broadcast_to(numeric, d_score.shape), atol=1e-6)
    numeric_w = np.zeros(3)
    for i in range(3):
        up, down = w.copy(), w.copy()
        up[i] += eps
        down[i] -= eps
        numeric_w[i] = np.sum(cot * (out(score, up) - out(score, down))) / (2 * eps)
    np.testing.assert_allclose(grads.w, numeric_w, rtol=1e-6, atol=1e-6)


def test_integer_division_by_zero_gives_zero_on_every_namespace():
    """NumPy gives 0 for an integer // 0 or % 0; torch raises: the evaluation gives 0 on both."""
    torch = pytest.importorskip("torch")
    from xpkernels.mods.interpret import Grid

    mod = xm.ScoreMod(lambda s, b, h, q, kv: s + (q // kv) + 0.5 * (q % kv))
    q = np.array([-7, 5, 0, -(2**63), 9])
    kv = np.array([0, 0, 3, -1, -2])
    with np.errstate(all="ignore"):
        want = 1.0 + np.floor_divide(q, kv) + 0.5 * np.remainder(q, kv)
    assert want[0] == 1.0 and want[1] == 1.0
    torch_xp = array_api_compat.array_namespace(torch.zeros(1))
    for xp, wrap in ((np, np.asarray), (torch_xp, torch.as_tensor)):
        bound = mod.graph.bind(xp, xp.float64, "cpu")
        grid = Grid({"q_idx": wrap(q), "kv_idx": wrap(kv)}, rank=1)
        with np.errstate(all="ignore"):
            got = bound.run(grid, wrap(np.ones(5)))[mod.graph.output]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_offset_batch_reads_b_shifted_and_keeps_clamps():
    temp = np.array([1.0, 2.0, 3.0, 4.0])
    mod = xm.ScoreMod(lambda s, b, h, q, kv, *, temp: s * temp[b] + b, temp=temp)
    graph = mod.graph.clamping({(i, 0) for i, n in enumerate(mod.graph.nodes) if n.op == "gather"})
    shifted = graph.offset_batch(2)
    gathers = [i for i, n in enumerate(shifted.nodes) if n.op == "gather"]
    assert shifted.clamped == {(gathers[0], 0)}
    from xpkernels.mods.interpret import Grid

    grid = Grid({"b": np.asarray(1)}, rank=0)
    got = shifted.bind(np, np.float64, "cpu").run(grid, np.asarray(1.5))[shifted.output]
    assert float(got) == 1.5 * temp[3] + 3
    plain = xm.MaskMod(lambda b, h, q, kv: q >= kv).graph
    assert plain.offset_batch(5) is plain


def test_gradient_graph_extends_the_forward_graph():
    """The reverse mode is a graph: forward nodes kept as they are, then nodes of OPS only."""
    from xpkernels.mods.grad import COTANGENT, gradient
    from xpkernels.mods.ir import OPS

    mod = SCORES["relpos"]()
    graph = mod.graph
    rev = gradient(graph, (0,))
    assert rev.graph.nodes[: rev.start] == graph.nodes
    reverse = rev.graph.nodes[rev.start :]
    assert all(n.op in OPS or n.op == "literal" or n.value == COTANGENT for n in reverse)
    assert [graph.nodes[i].op for i, _ in rev.scatters] == ["gather"]
    assert rev.d_score is not None and gradient(graph, (0,)) is rev
    assert gradient(graph, ()).scatters == ()
    assert gradient(xm.SoftCapScore(2.0).graph, ()).d_score is not None


def test_soft_cap_and_masks_have_no_gradients():
    assert grad_shadow(xm.SoftCapScore(3.0)).items() == []
    with pytest.raises(TypeError, match="expected an array or a score mod"):
        grad_shadow(xm.CausalMask())


def test_grad_shadow_is_zeroed_float32_or_float64_and_addressable():
    mod = xm.AliBiScore(np.ones(4, np.float16)) >> xm.BiasScore(np.ones((1, 1, 3, 5), np.float64))
    g = grad_shadow(mod)
    assert g.slopes.dtype == np.float32 and g.bias.dtype == np.float64
    assert g[0].slopes is g.slopes and [n for n, _ in g.items()] == ["0.slopes", "1.bias"]
    assert not g.slopes.any() and not g.bias.any()
    g.slopes[...] = 1.0
    g.zero_()
    assert not g.slopes.any()
    pair = xm.PairFeatureScore(
        lambda qv, kv: qv[0] * kv[0], np.ones((1, 3, 1)), np.ones((1, 5, 1)), np.ones((2, 1))
    )
    assert [n for n, _ in grad_shadow(pair).items()] == ["pair_proj"]
    assert [n for n, _ in grad_shadow(pair, feature_grads=True).items()] == [
        "q_features",
        "k_features",
        "pair_proj",
    ]


# ------------------------------------------------------------- evaluation on every namespace


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_tile_evaluation_and_gradients_agree_with_the_host_on_every_namespace(namespace):
    """Kernel tile grids (slice reads, slice/scatter gradient adds) equal the host's gathers."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((4, 9))
    bias = rng.standard_normal((2, 4, 6, 11))
    mod_host = xm.ScoreMod(relative_bias, table=table) >> xm.BiasScore(bias)
    mod = xm.ScoreMod(relative_bias, table=to_namespace(table, namespace)) >> xm.BiasScore(
        to_namespace(bias, namespace)
    )
    score = rng.standard_normal((2, 4, 6, 11))
    cot = rng.standard_normal((2, 4, 6, 11))
    b, h, _, q_idx, kv_idx = grids(2, 4, 6, 11, pos=5)
    expected_out = xm.score_value(mod_host, score, q_idx, kv_idx, b, h, input_pos=5)
    expected_ds, expected_grads = xm.score_grad(
        mod_host, score, cot, q_idx, kv_idx, b, h, input_pos=5
    )

    like = to_namespace(score, namespace)
    xp, device = array_api_compat.array_namespace(like), array_api_compat.device(like)
    bound = mod.graph.bind(xp, xp.float64, device)
    grads = grad_shadow(mod)
    accumulators = [grads.lookup(s.path, s.field) for s in mod.graph.slots]
    for bi in range(2):
        for h0, n_h in ((0, 2), (2, 2)):
            for r0, r1, k0, k1 in ((0, 4, 0, 7), (0, 4, 7, 11), (4, 6, 0, 11)):
                grid = xm.tile_grid(
                    xp,
                    device,
                    mod.graph.inputs,
                    b=bi,
                    h0=h0,
                    n_h=n_h,
                    q_pos0=5 + r0,
                    q_row0=r0,
                    n_q=r1 - r0,
                    kv0=k0,
                    n_kv=k1 - k0,
                )
                tile = to_namespace(score[bi, h0 : h0 + n_h, r0:r1, k0:k1], namespace)
                values = bound.run(grid, tile)
                np.testing.assert_allclose(
                    host(values[mod.graph.output]), expected_out[bi, h0 : h0 + n_h, r0:r1, k0:k1]
                )
                ds = bound.backprop(
                    values,
                    grid,
                    to_namespace(cot[bi, h0 : h0 + n_h, r0:r1, k0:k1], namespace),
                    accumulators,
                )
                np.testing.assert_allclose(host(ds), expected_ds[bi, h0 : h0 + n_h, r0:r1, k0:k1])
    for name, expected in expected_grads.items():
        np.testing.assert_allclose(
            host(dict(grads.items())[name]), expected, rtol=1e-12, atol=1e-12, err_msg=name
        )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_scatter_add_sums_repeated_indices(namespace):
    rng = np.random.default_rng(8)
    index = rng.integers(3, 40, size=(6, 50))
    values = rng.standard_normal((6, 50)).astype(np.float32)
    expected = np.zeros((5, 10), np.float32)
    np.add.at(expected.reshape(-1), index.reshape(-1), values.reshape(-1))
    target = to_namespace(np.zeros((5, 10), np.float32), namespace)
    xp = array_api_compat.array_namespace(target)
    xm.scatter_add(xp, target, to_namespace(index, namespace), to_namespace(values, namespace))
    np.testing.assert_allclose(host(target), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_scatter_add_keeps_non_finite_values_at_their_index(namespace):
    """An inf or NaN reaches its own index only; +inf with -inf (or any NaN) gives NaN."""
    index = np.array([0, 1, 1, 2, 3, 3, 4, 4, 5])
    values = np.array([1.0, np.inf, 2.0, 3.0, np.inf, -np.inf, np.nan, 1.0, -np.inf], np.float32)
    target = to_namespace(np.zeros(7, np.float32), namespace)
    xp = array_api_compat.array_namespace(target)
    xm.scatter_add(xp, target, to_namespace(index, namespace), to_namespace(values, namespace))
    expected = np.array([1.0, np.inf, 3.0, np.nan, np.nan, -np.inf, 0.0], np.float32)
    np.testing.assert_array_equal(host(target), expected)


# --------------------------------------------------------------------------- index bounds


def test_indices_are_checked_against_every_pair_of_the_call():
    mod = xm.ScoreMod(relative_bias, table=np.zeros((2, 9)))
    mod.validate("f", xm.CallShape(batch=1, heads=2, n_q=100, n_kv=300, positions=(50,)))
    with pytest.raises(
        ValueError, match=r"table \(shape \(2, 9\)\) is indexed on axis 0 by values in \[0, 2\]"
    ):
        mod.validate("f", xm.CallShape(batch=1, heads=3, n_q=10, n_kv=10, positions=(0,)))
    unclamped = xm.ScoreMod(lambda s, b, h, q, kv, *, t: s + t[q - kv + 3], t=np.zeros(7))
    unclamped.validate("f", xm.CallShape(1, 1, 4, 4, (0,)))
    with pytest.raises(ValueError, match=r"values in \[-1, 6\]"):
        unclamped.validate("f", xm.CallShape(1, 1, 4, 5, (0,)))
    guarded = xm.ScoreMod(lambda s, b, h, q, kv, *, t: s + t[(q - kv) % 7], t=np.zeros(7))
    guarded.validate("f", xm.CallShape(1, 1, 400, 500, (9,)))


def test_integer_tables_used_as_indices_are_bounded_by_their_values():
    bucket = np.array([0, 1, 2, 2, 3, 3, 3, 3])
    mod = xm.ScoreMod(
        lambda s, b, h, q, kv, *, bucket, w: s + w[bucket[xm.minimum(q - kv, 7) * 0 + kv % 8]],
        bucket=bucket,
        w=np.zeros(4),
    )
    mod.validate("f", xm.CallShape(1, 1, 16, 16, (0,)))
    with pytest.raises(
        ValueError, match=r"w \(shape \(3,\)\) is indexed on axis 0 by values in \[0, 3\]"
    ):
        xm.ScoreMod(mod.fn, bucket=bucket, w=np.zeros(3)).validate(
            "f", xm.CallShape(1, 1, 16, 16, (0,))
        )


def test_index_intervals_model_int64_wraparound():
    """``kv * 2**62`` wraps in int64 for kv >= 2: the analysis sees the wrapped range, as kernels do."""
    mod = xm.ScoreMod(
        lambda s, b, h, q, kv, *, t: s + t[h, (kv * 2**62) // 2**62], t=np.zeros((2, 8))
    )
    mod.validate("f", xm.CallShape(1, 2, 2, 2, (0,)))
    with pytest.raises(ValueError, match=r"indexed on axis 1 by values in \[-2, 1\].*int64"):
        mod.validate("f", xm.CallShape(1, 2, 8, 8, (0,)))
    clamped = xm.ScoreMod(
        lambda s, b, h, q, kv, *, t: s + t[h, xm.minimum(xm.maximum(kv * 2**62, 0), 7)],
        t=np.zeros((2, 8)),
    )
    clamped.validate("f", xm.CallShape(1, 2, 8, 8, (0,)))
    got = xm.score_value(clamped, np.zeros((1, 4)), np.zeros((1, 1), np.int64), np.arange(4)[None])
    np.testing.assert_array_equal(got, 0.0)
    large_positions = xm.ScoreMod(lambda s, b, h, q, kv, *, t: s + t[h, q - kv], t=np.zeros((2, 8)))
    with pytest.raises(
        ValueError, match=r"values in \[-9223372036854775808, 9223372036854775807\]"
    ):
        large_positions.validate("f", xm.CallShape(1, 2, 2, 2, (2**63 - 1,)))


def test_integer_constants_must_fit_int64():
    with pytest.raises(
        xm.TraceError, match=r"integer constant 18446744073709551616 does not fit int64"
    ):
        xm.MaskMod(lambda b, h, q, kv: kv < 2**64)


def test_device_index_arrays_are_clamped_not_read_on_the_host():
    """A device (torch) integer table is never copied to the host: its indices are clamped."""
    if torch is None:
        pytest.skip("torch provides the device arrays")
    bucket = torch.tensor([0, 1, 9, 2])
    mod = xm.ScoreMod(
        lambda s, b, h, q, kv, *, bucket, w: s + w[bucket[kv % 4]],
        bucket=bucket,
        w=torch.arange(4.0, dtype=torch.float64),
    )
    clamps = mod.validate("f", xm.CallShape(1, 1, 4, 4, (0,)))
    graph = mod.graph.clamping(clamps)
    bound = graph.bind(torch, torch.float64, "cpu")
    grid = xm.tile_grid(
        torch, "cpu", graph.inputs, b=0, h0=0, n_h=1, q_pos0=0, q_row0=0, n_q=1, kv0=0, n_kv=4
    )
    out = bound.run(grid, torch.zeros((1, 1, 4), dtype=torch.float64))[graph.output]
    np.testing.assert_array_equal(out.numpy().reshape(-1), [0.0, 1.0, 3.0, 2.0])
    message = r"w \(shape \(4,\)\) is indexed on axis 0 by values in \[0, 9\]"
    with pytest.raises(ValueError, match=message):
        mod.validate("f", xm.CallShape(1, 1, 4, 4, (0,)), read_device=True)
    for host_bucket in (np.array([0, 1, 9, 2]), strict.asarray(np.array([0, 1, 9, 2]))):
        with pytest.raises(ValueError, match=message):
            xm.ScoreMod(mod.fn, bucket=host_bucket, w=np.arange(4.0)).validate(
                "f", xm.CallShape(1, 1, 4, 4, (0,))
            )


@pytest.mark.parametrize("bad", [3, xm.SoftCapScore(2.0)])
def test_mod_type_errors_name_the_function_and_argument(bad):
    with pytest.raises(TypeError, match=r"build_block_mask: keep must be a MaskMod or a function"):
        xm.build_block_mask(bad, 8, 8, tile_m=4, tile_n=4)
    with pytest.raises(TypeError, match=r"MaskMod &: the other operand must be a MaskMod"):
        xm.CausalMask() & 3


def test_score_mod_grad_knows_its_mod():
    slopes = np.ones(2)
    mod = xm.AliBiScore(slopes) >> xm.SoftCapScore(2.0)
    assert grad_shadow(mod).made_for(mod)
    assert grad_shadow(xm.AliBiScore(slopes) >> xm.SoftCapScore(2.0)).made_for(mod)
    assert not grad_shadow(xm.AliBiScore(np.ones(2)) >> xm.SoftCapScore(2.0)).made_for(mod)
    assert not grad_shadow(xm.AliBiScore(slopes)).made_for(mod)
    assert not grad_shadow(xm.BiasScore(np.ones((1, 1, 2, 2)))).made_for(xm.AliBiScore(slopes))


# --------------------------------------------------------------------------- bands and block masks


def dense_states(mask, n_q, n_kv, tile_m, tile_n, pos=0, b=0, h=0):
    """Exact tile states by evaluating every pair (the test's oracle)."""
    keep = xm.mask_value(
        mask, np.arange(n_q)[:, None] + pos, np.arange(n_kv)[None, :], b, h, input_pos=pos
    )
    out = np.zeros((-(-n_q // tile_m), -(-n_kv // tile_n)), np.int8)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = keep[i * tile_m : (i + 1) * tile_m, j * tile_n : (j + 1) * tile_n]
            out[i, j] = xm.FULL if block.all() else xm.PARTIAL if block.any() else xm.SKIP
    return out


BANDS = {
    "full": lambda: xm.FullMask(),
    "causal": lambda: xm.CausalMask(),
    "sliding": lambda: xm.SlidingWindowMask(13),
    "prefix": lambda: xm.PrefixMask(9),
    "empty-prefix": lambda: xm.PrefixMask(0),
    "prefix_lm": lambda: xm.prefix_lm(21),
    "sliding|prefix": lambda: xm.SlidingWindowMask(5) | xm.PrefixMask(7),
    "(sliding|prefix)&causal": lambda: (
        (xm.SlidingWindowMask(5) | xm.PrefixMask(30)) & xm.CausalMask()
    ),
    "sliding&prefix|causal": lambda: (
        (xm.SlidingWindowMask(40) & xm.PrefixMask(30)) | xm.SlidingWindowMask(3)
    ),
    "sliding&document": lambda: xm.SlidingWindowMask(11) & xm.DocumentMask(np.arange(90) // 17),
}


@pytest.mark.parametrize("pos", [0, 7])
@pytest.mark.parametrize("name", sorted(BANDS))
def test_band_tile_states_are_sound(name, pos):
    """A skipped tile holds no kept pair; a tile marked full holds no dropped pair."""
    mask = BANDS[name]()
    n_q = 90 - pos
    for tile_m, tile_n in ((8, 8), (16, 4), (7, 13)):
        states = xm.band_states(mask, pos, n_q, 90, tile_m, tile_n)
        exact = dense_states(mask, n_q, 90, tile_m, tile_n, pos)
        assert not np.any((states == xm.SKIP) & (exact != xm.SKIP)), (
            "skipped a tile with kept pairs"
        )
        assert not np.any((states == xm.FULL) & (exact != xm.FULL)), (
            "called a tile full that drops pairs"
        )


def test_simple_bands_classify_tiles_exactly():
    for mask in (xm.CausalMask(), xm.SlidingWindowMask(16), xm.PrefixMask(24), xm.prefix_lm(8)):
        np.testing.assert_array_equal(
            xm.band_states(mask, 0, 64, 64, 8, 8), dense_states(mask, 64, 64, 8, 8)
        )


@pytest.mark.parametrize("name", ["sliding&document", "sliding|prefix", "user"])
def test_build_block_mask_equals_dense_classification(name):
    mask = BANDS[name]() if name in BANDS else xm.MaskMod(lambda b, h, q, kv: (q + kv) % 23 < 11)
    bm = xm.build_block_mask(mask, 85, 90, tile_m=16, tile_n=8, input_pos=5)
    assert bm.states.shape == (1, 1, 6, 12)
    np.testing.assert_array_equal(bm.states[0, 0], dense_states(mask, 85, 90, 16, 8, pos=5))


def test_build_block_mask_per_batch_and_head_and_vectorised(monkeypatch):
    mask = xm.MaskMod(lambda b, h, q, kv: xm.logical_and(kv <= q, kv >= h * 10 + b * 3))
    runs = []
    original = xm.BoundGraph.run

    def counting(self, grid, score=None):
        runs.append(1)
        return original(self, grid, score)

    monkeypatch.setattr(xm.BoundGraph, "run", counting)
    bm = xm.build_block_mask(
        mask, 64, 64, tile_m=8, tile_n=8, input_pos=np.array([0, 4]), n_batch=2, n_heads=3
    )
    assert bm.states.shape == (2, 3, 8, 8)
    assert len(runs) == 2, "one dense evaluation per batch, not one per tile or pair"
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(
                bm.states[b, h], dense_states(mask, 64, 64, 8, 8, pos=(0, 4)[b], b=b, h=h)
            )
    assert bm.kv_tiles(b=0, h=2, q_tile=0) == []
    assert 0 < bm.density < 1


def test_build_block_mask_needs_the_extent_of_axes_the_mask_reads():
    with pytest.raises(ValueError, match="the mask reads h; pass n_heads"):
        xm.build_block_mask(lambda b, h, q, kv: kv <= q + h, 8, 8, tile_m=4, tile_n=4)
    with pytest.raises(ValueError, match="tile_m must be >= 1"):
        xm.build_block_mask(xm.CausalMask(), 8, 8, tile_m=0, tile_n=4)


def test_tile_plan_combines_heads_of_a_group():
    states = np.array([[[[0, 1, 2]], [[2, 0, 2]]]], dtype=np.int8)
    plan = xm.TilePlan(4, 4, states)
    np.testing.assert_array_equal(plan.group(0, 0, 2), [[xm.PARTIAL, xm.PARTIAL, xm.FULL]])
    np.testing.assert_array_equal(plan.group(0, 1, 2), [[xm.FULL, xm.SKIP, xm.FULL]])


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_added_operations_agree_with_the_host_on_every_namespace(namespace):
    """floor, sin/cos/tan, sigmoid, exp2 and traced exponents on kernel tile grids."""
    rng = np.random.default_rng(11)
    score = rng.standard_normal((2, 3, 7, 9))
    cot = rng.standard_normal((2, 3, 7, 9))
    b, h, _, q_idx, kv_idx = grids(pos=3)
    like = to_namespace(score, namespace)
    xp, device = array_api_compat.array_namespace(like), array_api_compat.device(like)
    for name in ("log-bucket", "trig", "power"):
        mod = SCORES[name]()
        expected = xm.score_value(mod, score, q_idx, kv_idx, b, h, input_pos=3)
        expected_ds, expected_grads = xm.score_grad(
            mod, score, cot, q_idx, kv_idx, b, h, input_pos=3
        )
        arrays = [to_namespace(s.array, namespace) for s in mod.graph.slots]
        bound = mod.graph.bind(xp, xp.float64, device, arrays)
        accumulators = [xp.zeros_like(a) for a in arrays]
        for bi in range(2):
            grid = xm.tile_grid(
                xp,
                device,
                mod.graph.inputs,
                b=bi,
                h0=0,
                n_h=3,
                q_pos0=3,
                q_row0=0,
                n_q=7,
                kv0=0,
                n_kv=9,
            )
            values = bound.run(grid, to_namespace(score[bi], namespace))
            np.testing.assert_allclose(host(values[mod.graph.output]), expected[bi], rtol=1e-12)
            ds = bound.backprop(values, grid, to_namespace(cot[bi], namespace), accumulators)
            np.testing.assert_allclose(host(ds), expected_ds[bi], rtol=1e-12, atol=1e-12)
        for slot, acc in zip(mod.graph.slots, accumulators):
            np.testing.assert_allclose(
                host(acc),
                dict(expected_grads.items())[slot.field],
                rtol=1e-12,
                atol=1e-12,
                err_msg=name,
            )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_floor_gives_integers_nan_zero_and_saturates_past_int64(namespace):
    values = np.array([1.5, -1.5, 2.0, np.nan, 1e300, -np.inf, np.inf])
    top = 2**63 - 1024  # the float64 nearest below 2**63
    expected = [1, -2, 2, 0, top, -(2**63), top]
    floored = host(xm.floor(to_namespace(values, namespace)))
    assert floored.dtype == np.int64
    np.testing.assert_array_equal(floored, expected)
    # float32: its nearest below 2**63 is 2**63 - 2**39 (2**63 itself would wrap to int64's min)
    values32 = np.array([1e30, np.inf, -np.inf, 2.0**63], np.float32)
    top32 = 2**63 - 2**39
    floored = host(xm.floor(to_namespace(values32, namespace)))
    np.testing.assert_array_equal(floored, [top32, top32, -(2**63), top32])
    mod = xm.ScoreMod(lambda s, b, h, q, kv: math.floor(s) + 0.5)
    assert [n.op for n in mod.graph.nodes].count("floor") == 1
    like = to_namespace(values, namespace)
    xp = array_api_compat.array_namespace(like)
    bound = mod.graph.bind(xp, xp.float64, array_api_compat.device(like))
    grid = xm.tile_grid(
        xp,
        array_api_compat.device(like),
        mod.graph.inputs,
        b=0,
        h0=0,
        n_h=1,
        q_pos0=0,
        q_row0=0,
        n_q=1,
        kv0=0,
        n_kv=1,
    )
    out = host(bound.run(grid, like)[mod.graph.output])
    np.testing.assert_array_equal(out, np.array(expected, dtype=np.float64) + 0.5)
    assert [xm.floor(v) for v in (2.7, -0.5, float("nan"), 7)] == [2, -1, 0, 7]


def test_floor_of_a_float_must_be_bounded_before_it_indexes():
    from xpkernels.flex_attention import flex_attention

    q = np.random.default_rng(12).standard_normal((1, 1, 6, 8))
    mod = xm.ScoreMod(lambda s, b, h, q, kv, *, t: s + t[xm.floor(q * 0.5)], t=np.ones(8))
    with pytest.raises(ValueError, match="cannot be bounded.*clamp it with minimum/maximum"):
        flex_attention(q, q, q, score_mod=mod)
    bounded = xm.ScoreMod(
        lambda s, b, h, q, kv, *, t: s + t[xm.minimum(xm.maximum(xm.floor(q * 0.5), 0), 7)],
        t=np.arange(8.0),
    )
    np.testing.assert_array_equal(
        xm.score_value(bounded, 0.0, np.arange(6), 0), [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    )
    assert np.isfinite(flex_attention(q, q, q, score_mod=bounded)).all()
