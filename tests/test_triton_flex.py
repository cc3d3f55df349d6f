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
from xpkernels.flex_attention import FlexAttentionBackwardScratch  # noqa: E402
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


def _t5_bucket(q, k):
    """A T5-style log bucket of ``q - k``: 8 buckets, signed (ints)."""
    d = q - k
    magnitude = xm.minimum(xm.maximum(xm.floor(xm.log(xm.abs(d) + 1.0) * 1.5), 0), 3)
    return xm.where(d >= 0, magnitude, magnitude + 4)


#: name -> score mod factory over (B=2, H=2, Sq=19, Sk=35) whose array gradients repeat indices
#: inside one tile (or, for the bias, collide across batches only).
DUPLICATE_MODS = {
    "relative-position": lambda: xm.ScoreMod(
        lambda s, b, h, q, k, *, rel: s + rel[q - k + 34],
        rel=torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12 + 19 + 34)),
    ),
    "relative-position-large": lambda: xm.ScoreMod(  # 2**16 elements and more: int64 sort keys
        lambda s, b, h, q, k, *, rel: s + rel[q - k + 34],
        rel=torch.nn.Parameter(torch.linspace(-1.0, 1.0, 2**16 + 5)),
    ),
    "t5-bucket": lambda: xm.ScoreMod(
        lambda s, b, h, q, k, *, table: s + table[h, _t5_bucket(q, k)],
        table=torch.nn.Parameter(torch.linspace(-1.0, 1.0, 2 * 8).reshape(2, 8)),
    ),
    "alibi": lambda: xm.AliBiScore(torch.nn.Parameter(torch.linspace(0.1, 0.4, 2))),
    "head-bias": lambda: xm.BiasScore(
        torch.nn.Parameter(torch.linspace(-1.0, 1.0, 2 * 19 * 35).reshape(1, 2, 19, 35))
    ),
    "paired-rows": lambda: xm.ScoreMod(
        lambda s, b, h, q, k, *, q_row, f: s * f[q_row // 2],
        f=torch.nn.Parameter(torch.linspace(0.5, 1.5, 10)),
    ),
}


def _mod_grads(backend, make_score, deterministic, dtype=torch.float32):
    """The score mod's array gradients of one backward (GQA: 2 query heads over 1 kv head)."""
    torch.manual_seed(1)
    q = torch.randn(2, 2, 19, 16).to(dtype)
    k, v = (torch.randn(2, 1, 35, 16).to(dtype) for _ in range(2))
    mod = make_score()
    if dtype != torch.float32:
        mod = type(mod)(**{n: a.detach().to(dtype) for n, a in mod.arrays.items()})
        if not isinstance(mod, (xm.AliBiScore, xm.BiasScore)):
            raise AssertionError("float64 copies cover the library mods only")
    options = {"score_mod": mod, "mask_mod": xm.CausalMask(), "input_pos": 12}
    ckpt = xk.allocate_checkpoints(xk.flex_attention_, q, k, v)
    o = torch.empty_like(q)
    with torch.no_grad():
        xk.flex_attention_(o, q, k, v, checkpoints=ckpt, backend=backend, **options)
        g = grad_shadow(mod)
        xk.flex_attention_backward_(
            xk.Duplicated(o, torch.cos(o * 7.0 + 1.0)),
            xk.Duplicated(q, torch.empty_like(q)),
            xk.Duplicated(k, torch.empty_like(k)),
            xk.Duplicated(v, torch.empty_like(v)),
            checkpoints=ckpt,
            score_mod_grad=g,
            deterministic=deterministic,
            backend=backend,
            **options,
        )
    return [g.lookup(s.path, s.field) for s in mod.graph.slots]


@pytest.mark.parametrize("name", list(DUPLICATE_MODS))
def test_deterministic_score_mod_gradients_repeat_bitwise_and_match(name):
    """Deterministic sums are bit-identical run to run; both modes match array_api."""
    make = DUPLICATE_MODS[name]
    want = _mod_grads("array_api", make, True)
    first = _mod_grads("triton", make, True)
    again = _mod_grads("triton", make, True)
    atomics = _mod_grads("triton", make, False)
    for w, a, b, c in zip(want, first, again, atomics):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, atol=_EPS, rtol=_EPS)
        torch.testing.assert_close(c, w, atol=_EPS, rtol=_EPS)
        assert w.abs().max() > 0.1  # the case computes a gradient worth comparing


@pytest.mark.parametrize("name", ["alibi", "head-bias"])
def test_deterministic_score_mod_gradients_match_float64(name):
    """Against the array_api backend in float64 (the float64 reference of section 7)."""
    want = _mod_grads("array_api", DUPLICATE_MODS[name], True, torch.float64)
    got = _mod_grads("triton", DUPLICATE_MODS[name], True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.double(), w, atol=_EPS, rtol=_EPS)


def test_generated_scatter_combines_repeated_indices_only_where_needed():
    """Deterministic: no atomics; a sort where one tile may repeat an index, none elsewhere."""
    sources = {
        name: triton_source(make().graph, "vjp", "v", (0,), transposed=True, deterministic=True)
        for name, make in DUPLICATE_MODS.items()
    }
    sorted_ = ("relative-position", "relative-position-large", "t5-bucket", "paired-rows")
    for name, source in sources.items():
        assert "atomic" not in source, name
        assert ("tl.sort" in source) == (name in sorted_), name
    assert ").to(tl.int32), (c" in sources["relative-position"]
    assert ").to(tl.int64), (c" in sources["relative-position-large"]
    graph = DUPLICATE_MODS["alibi"]().graph
    assert "tl.atomic_add" in triton_source(graph, "vjp", "v", (0,), transposed=True)


def test_program_separation_from_the_index_forms():
    """Programs of different key tiles / batches / kv heads share partial rows only if they may collide."""
    from xpkernels.backends.triton._flex_host import program_separation

    def separation(name):
        return program_separation(DUPLICATE_MODS[name]().graph, 0)

    assert separation("relative-position") == (False, False, False)
    assert separation("t5-bucket") == (False, False, True)
    assert separation("alibi") == (False, False, True)
    assert separation("head-bias") == (True, False, True)  # bias (1, H, Sq, Sk): batches collide
    twice = xm.ScoreMod(lambda s, b, h, q, k, *, f: s + f[k] + f[q], f=torch.zeros(64))
    assert program_separation(twice.graph, 0) == (False, False, False)


def test_deterministic_partials_too_large_raise_before_any_write(monkeypatch):
    """Past the partial-memory limit: a ValueError naming the way out, shadows untouched."""
    from xpkernels.backends.triton import _flex_host

    monkeypatch.setattr(_flex_host, "PARTIAL_LIMIT_BYTES", 0)
    mod = DUPLICATE_MODS["relative-position"]()
    q = torch.randn(1, 2, 19, 16)
    k, v = (torch.randn(1, 2, 35, 16) for _ in range(2))  # 6 partial rows: 3 key tiles x 2 heads
    ckpt = xk.allocate_checkpoints(xk.flex_attention_, q, k, v)
    o = torch.empty_like(q)
    with torch.no_grad():
        xk.flex_attention_(o, q, k, v, score_mod=mod, checkpoints=ckpt, backend="triton")
    shadows = [torch.full_like(x, 7.0) for x in (q, k, v)]
    g = grad_shadow(mod)
    with pytest.raises(ValueError, match="deterministic=False"), torch.no_grad():
        xk.flex_attention_backward_(
            xk.Duplicated(o, torch.ones_like(o)),
            *(xk.Duplicated(x, s) for x, s in zip((q, k, v), shadows)),
            checkpoints=ckpt,
            score_mod=mod,
            score_mod_grad=g,
            backend="triton",
        )
    assert all(bool((s == 7.0).all()) for s in shadows)
    assert not g.rel.any()


def test_deterministic_must_be_a_bool():
    q = torch.randn(1, 1, 4, 8)
    ckpt = xk.allocate_checkpoints(xk.flex_attention_, q, q, q)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        xk.flex_attention_backward_(
            *(xk.Duplicated(q, torch.empty_like(q)) for _ in range(4)),
            checkpoints=ckpt,
            deterministic=1,
        )


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
def test_partial_rows_sum_in_a_fixed_tree(rows):
    """The reduction of partial rows: every row counted once (one pass or several), repeatably."""
    from xpkernels.backends.triton import _flex_host

    torch.manual_seed(rows)
    partial = torch.randn(rows, 3, 7)
    start = torch.randn(3, 7)
    want = start.double() + partial.double().sum(0)
    sums = []
    for _ in range(2):
        acc, work = start.clone(), partial.clone()
        _flex_host.sum_rows(work, acc)
        sums.append(acc)
    assert torch.equal(sums[0], sums[1])
    # float32 sums of `rows` O(1) terms of random signs: the error grows as sqrt(rows)
    torch.testing.assert_close(sums[0].double(), want, atol=_EPS * rows**0.5, rtol=_EPS)


def _relative_position_call():
    """A relative-position score mod's forward on 3 key tiles x 2 kv heads (6 partial rows)."""
    mod = DUPLICATE_MODS["relative-position"]()
    torch.manual_seed(3)
    q = torch.randn(1, 2, 19, 16)
    k, v = (torch.randn(1, 2, 35, 16) for _ in range(2))
    ckpt = xk.allocate_checkpoints(xk.flex_attention_, q, k, v)
    o = torch.empty_like(q)
    with torch.no_grad():
        xk.flex_attention_(o, q, k, v, score_mod=mod, checkpoints=ckpt, backend="triton")
    return mod, (q, k, v), xk.Duplicated(o, torch.cos(o * 5.0)), ckpt


def _flex_backward(mod, qkv, O, ckpt, fill=None, **options):
    """``(dq, dk, dv, rel gradient)`` of one triton backward; shadows start as ``fill``."""
    shadows = [torch.empty_like(x) if fill is None else torch.full_like(x, fill) for x in qkv]
    g = grad_shadow(mod)
    with torch.no_grad():
        xk.flex_attention_backward_(
            O,
            *(xk.Duplicated(x, s) for x, s in zip(qkv, shadows)),
            checkpoints=ckpt,
            score_mod=mod,
            score_mod_grad=g,
            backend="triton",
            **options,
        )
    return (*shadows, g.rel)


def test_score_mod_workspace_is_the_callers_scratch():
    """The allocator sizes ``score_mod_workspace`` from the mod and tiles; the backward uses it
    (garbage left in it does not leak into the sums) and equals a call that allocates its own."""
    mod, qkv, O, ckpt = _relative_position_call()
    options = {"score_mod": mod, "score_mod_grad": grad_shadow(mod), "backend": "triton"}
    scratch = xk.allocate_scratchspace(xk.flex_attention_backward_, O, *qkv, **options)
    assert isinstance(scratch, FlexAttentionBackwardScratch)
    # 6 partial rows of the 65-element table, rounded up to 64-byte carves
    assert tuple(scratch.score_mod_workspace.shape) == (400,)
    assert scratch.score_mod_workspace.dtype == torch.float32
    scratch.score_mod_workspace.fill_(float("nan"))
    got = _flex_backward(mod, qkv, O, ckpt, scratch=scratch)
    want = _flex_backward(mod, qkv, O, ckpt)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    used = scratch.score_mod_workspace[:390]  # the rows; the padding after them is not touched
    assert not torch.isnan(used).any()
    atomics = xk.allocate_scratchspace(
        xk.flex_attention_backward_, O, *qkv, **options, deterministic=False
    )
    assert atomics.score_mod_workspace is None  # float32 accumulators: atomics add in place
    plain = xk.allocate_scratchspace(xk.flex_attention_backward_, O, *qkv, backend="triton")
    assert plain.score_mod_workspace is None


def test_score_mod_workspace_too_small_or_missing_raises_before_any_write():
    mod, qkv, O, ckpt = _relative_position_call()
    plain = xk.allocate_scratchspace(xk.flex_attention_backward_, O, *qkv, backend="triton")
    short = plain._replace(score_mod_workspace=torch.zeros(399))
    for scratch, held in ((plain, 0), (short, 399)):
        with pytest.raises(ValueError, match=f"score_mod_workspace holds {held} float32 .* 400"):
            got = _flex_backward(mod, qkv, O, ckpt, fill=7.0, scratch=scratch)
    got = [torch.full_like(x, 7.0) for x in qkv]
    g = grad_shadow(mod)
    with pytest.raises(ValueError), torch.no_grad():
        xk.flex_attention_backward_(
            O,
            *(xk.Duplicated(x, s) for x, s in zip(qkv, got)),
            checkpoints=ckpt,
            scratch=short,
            score_mod=mod,
            score_mod_grad=g,
            backend="triton",
        )
    assert all(bool((s == 7.0).all()) for s in got) and not g.rel.any()
    assert not short.score_mod_workspace.any()
    attention_scratch = xk.allocate_scratchspace(xk.attention_backward_, O, *qkv, backend="triton")
    with pytest.raises(TypeError, match="FlexAttentionBackwardScratch"):
        _flex_backward(mod, qkv, O, ckpt, scratch=attention_scratch)


def test_varlen_score_mod_workspace_serves_every_sequence_and_atomics_option():
    """Packed: the workspace is sized for the sequence needing most (the longest here) and reused
    by each; ``deterministic=False`` (atomics) agrees; ``deterministic`` must be a bool."""
    torch.manual_seed(4)
    k_lens = [7, 35, 19]
    cu_q = torch.tensor([0, 7, 26, 38], dtype=torch.int32)  # 7, 19 and 12 queries
    cu_k = torch.tensor([0, 7, 42, 61], dtype=torch.int32)
    q = torch.randn(38, 2, 16)
    k, v = (torch.randn(61, 2, 16) for _ in range(2))
    mod = DUPLICATE_MODS["relative-position"]()
    ckpt = xk.allocate_checkpoints(xk.flex_attention_varlen_, q, k, v)
    o = torch.empty_like(q)
    with torch.no_grad():
        xk.flex_attention_varlen_(
            o, q, k, v, cu_q, cu_k, score_mod=mod, checkpoints=ckpt, backend="triton"
        )
    O = xk.Duplicated(o, torch.cos(o * 5.0))

    def run(**options):
        shadows = [torch.empty_like(x) for x in (q, k, v)]
        g = grad_shadow(mod)
        with torch.no_grad():
            xk.flex_attention_varlen_backward_(
                O,
                *(xk.Duplicated(x, s) for x, s in zip((q, k, v), shadows)),
                cu_q,
                cu_k,
                checkpoints=ckpt,
                score_mod=mod,
                score_mod_grad=g,
                backend="triton",
                **options,
            )
        return (*shadows, g.rel)

    scratch = xk.allocate_scratchspace(
        xk.flex_attention_varlen_backward_,
        O,
        q,
        k,
        v,
        cu_q,
        cu_k,
        score_mod=mod,
        score_mod_grad=grad_shadow(mod),
        backend="triton",
    )
    # the 35-key sequence: 3 key tiles x 2 kv heads of the 65-element table
    assert tuple(scratch.score_mod_workspace.shape) == (400,) and max(k_lens) == 35
    scratch.score_mod_workspace.fill_(float("nan"))
    want = run()
    for a, b in zip(run(scratch=scratch), want):
        assert torch.equal(a, b)
    for a, b in zip(run(deterministic=False), want):
        torch.testing.assert_close(a, b, atol=_EPS, rtol=_EPS)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        run(deterministic="yes")
