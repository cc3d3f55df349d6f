"""The CUDA C target of the mod code generator: NVRTC-clean, and equal to BoundGraph on the CPU.

Every built-in mod and the user mods of the test suite are wrapped in a small
``__global__`` kernel that evaluates the generated functions over a list of
(b, h, q_idx, kv_idx, q_row) pairs. NVRTC compiles it for sm_80 and sm_90
with no warning; the CPU harness (:mod:`xpkernels.testing.cudacpu`) runs it on
NumPy arrays, and the mask, the score, d score and the captured arrays'
gradients equal :class:`~xpkernels.mods.interpret.BoundGraph` on float32 NumPy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from _cuda_checks import nvrtc_report

from xpkernels import mods as xm
from xpkernels.mods.codegen_cuda import cuda_source, layout, pack_arguments
from xpkernels.mods.interpret import Grid
from xpkernels.mods.ir import FLOAT
from xpkernels.testing import cudacpu
from xpkernels.testing.specs import _flex_mods as flex_mods
from xpkernels.testing.specs import flex_attention as specs

ROOT = Path(__file__).resolve().parents[1]
EPS = float(np.finfo(np.float32).eps)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _triton_flex_mods() -> dict:
    """``tests/test_triton_flex.py``'s MODS (their tables are torch tensors), or {} without torch."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return {}
    module = _load("_triton_flex_mods", ROOT / "tests" / "test_triton_flex.py")
    out = {}
    for name, (make_score, mask) in module.MODS.items():
        if make_score is not None:
            score = make_score()
            out[f"triton-{name}-score"] = (
                score if isinstance(score, xm.ScoreMod) else xm.ScoreMod(score)
            )
        if mask is not None:
            out[f"triton-{name}-mask"] = mask if isinstance(mask, xm.MaskMod) else xm.MaskMod(mask)
    return out


def _mods() -> dict:
    """name -> mod: every built-in, compositions, and the test suite's user mods."""
    rng = np.random.default_rng(7)
    doc = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4], np.int32)
    doc_q = np.repeat(np.arange(4, dtype=np.int64), 3)
    doc_kv = np.repeat(np.arange(5, dtype=np.int64), 3)
    slopes = np.array([0.5, 0.25, 0.125], np.float32)
    bias16 = rng.standard_normal((2, 3, 12, 14)).astype(np.float16)
    table = rng.standard_normal((3, 2 * flex_mods.RELATIVE + 1)).astype(np.float32)
    qf = rng.standard_normal((2, 12, 2)).astype(np.float32)
    kf = rng.standard_normal((2, 14, 2)).astype(np.float32)
    proj = rng.standard_normal((3, 3)).astype(np.float32)
    keep = rng.random((3, 14)) < 0.6
    weights = rng.standard_normal((14,)).astype(np.float64)
    wide = rng.standard_normal((28, 7)).astype(np.float32)
    mods = {
        "full": xm.FullMask(),
        "causal": xm.CausalMask(),
        "sliding": xm.SlidingWindowMask(3),
        "prefix": xm.PrefixMask(4),
        "prefix_lm": xm.prefix_lm(2),
        "document": xm.DocumentMask(doc),
        "document-rows": xm.DocumentMask(doc_q, doc_kv),
        "document-int16-uint8": xm.DocumentMask(doc_q.astype(np.int16), doc_kv.astype(np.uint8)),
        "document-int8": xm.DocumentMask(doc.astype(np.int8)),
        "sliding&document": xm.SlidingWindowMask(5) & xm.DocumentMask(doc),
        "causal|prefix": xm.CausalMask() | xm.PrefixMask(2),
        "spec-user-mask": xm.MaskMod(flex_mods.user_mask),
        "spec-late-mask": xm.MaskMod(flex_mods.late),
        "bool-table-mask": xm.MaskMod(lambda b, h, q, k, *, keep: keep[h, k], keep=keep),
        "int-edges-mask": xm.MaskMod(
            lambda b, h, q, k: xm.logical_or(
                (k * 2**62) // 2**62 == k, (q - k) // (h - 1) == (k - q) % (h - 2)
            )
        ),
        "noop": xm.NoOpScore(),
        "softcap": xm.SoftCapScore(1.5),
        "alibi": xm.AliBiScore(slopes),
        "bias-float16": xm.BiasScore(bias16),
        "pair": xm.PairFeatureScore(flex_mods.pair_op, qf, kf, proj),
        "alibi>>softcap": xm.AliBiScore(slopes) >> xm.SoftCapScore(2.0),
        "alibi>>bias>>noop": xm.AliBiScore(slopes) >> xm.BiasScore(bias16) >> xm.NoOpScore(),
        "spec-relpos": xm.ScoreMod(flex_mods.relative_bias, table=table),
        "int-edges-score": xm.ScoreMod(
            lambda s, b, h, q, k: (
                s
                + 0.1 * ((q - k) // (h - 1))
                + 0.1 * ((q * 5 - k) // (h - 3))
                + 0.01 * ((k * 7) % (q - 2))
                + 0.001 * xm.abs(q - k) ** 3
                + 0.1 * xm.maximum(xm.minimum(q - k, 2), -1)
            )
        ),
        "float64-table-score": xm.ScoreMod(
            lambda s, b, h, q, k, *, w: s * w[k] - xm.where(q > k, w[k] ** 2.0, 0.5) / 3.0,
            w=weights,
        ),
        # integer and half-integer exponents of negative bases (NaN), 0 ** -1 (inf), x ** 0
        "pow-rules-score": xm.ScoreMod(
            lambda s, b, h, q, k: (
                xm.minimum(xm.maximum(s, -50.0), 50.0) ** (h - 1.0)
                + 0.1 * (xm.minimum(xm.maximum(s, -50.0), 50.0) - 3.0) ** (0.5 * (k % 3))
            )
        ),
        # every pairing of special bases and exponents (C's pow, as NumPy on arrays), with the
        # gradients of both tables there
        "pow-special-score": xm.ScoreMod(
            lambda s, b, h, q, k, *, u, t: u[q + 3] ** t[k + 2],
            u=np.array(
                [-np.inf, -2.5, -1, -0.5, -0.0, 0, 0.5, 1, 2, np.inf, np.nan, 3], np.float32
            ),
            t=np.array(
                [-np.inf, -3, -1.5, -1, -0.5, -0.0, 0, 0.5, 1, 2, 3, 2.5, np.inf, np.nan],
                np.float32,
            ),
        ),
        # integer division and remainder by 0 (0, as NumPy) and -1, of int64's extremes
        "int-division-extremes-score": xm.ScoreMod(
            lambda s, b, h, q, k, *, n, d: s + (n[q + 3] // d[k + 2]) + 0.5 * (n[q + 3] % d[k + 2]),
            n=np.array([-(2**63), 1 - 2**63, -7, -1, 0, 1, 5, 7, 2**63 - 1, -9, 2, 100], np.int64),
            d=np.array([0, -1, 1, 2, -2, 3, -3, 7, -7, 2**63 - 1, -(2**63), 5, -5, 10], np.int64),
        ),
        # a strided view: the slot's strides are not its accumulator's (contiguous)
        "strided-table-score": xm.ScoreMod(
            lambda s, b, h, q, k, *, t: s * t[k, h] + t[q, 2 - h], t=wide[::2, 1::2]
        ),
        **{f"spec-{n}": xm.ScoreMod(f) for n, f in specs._NONLINEAR_SCORES.items()},
    }
    if importlib.util.find_spec("torch") is not None:
        import torch

        bias_bf16 = torch.from_numpy(rng.standard_normal((1, 3, 1, 14))).to(torch.bfloat16)
        mods["bias-bfloat16"] = xm.BiasScore(bias_bf16)
    mods.update(_triton_flex_mods())
    return mods


MODS = _mods()


def _c_name(name: str) -> str:
    return "m_" + "".join(c if c.isalnum() else "_" for c in name)


def _kernel_source(name: str, mod) -> str:
    """The generated functions of ``mod`` and a grid kernel calling them, one thread per pair."""
    f = _c_name(name)
    graph = mod.graph
    pointers = "const unsigned long long* ptrs, const long long* ints, const float* floats, int n"
    head = "const int t = blockIdx.x * blockDim.x + threadIdx.x;\n    if (t >= n) return;\n"
    head += "    const ModArgs a{ptrs, ints, floats};\n    const long long* p = idx + 5 * t;\n"
    if isinstance(mod, xm.MaskMod):
        return cuda_source(graph, "mask", f"{f}_mask") + (
            f'extern "C" __global__ void {f}(const long long* idx, float* keep, {pointers}) {{\n'
            f"    {head}"
            f"    keep[t] = {f}_mask(p[0], p[1], p[2], p[3], p[4], a) ? 1.0f : 0.0f;\n}}\n"
        )
    grads = _float_slots(graph)
    return (
        cuda_source(graph, "score", f"{f}_score")
        + cuda_source(graph, "vjp", f"{f}_vjp", grads)
        + f'extern "C" __global__ void {f}(const long long* idx, const float* score, '
        f"const float* cot, float* out, float* d_score, {pointers}) {{\n"
        f"    {head}"
        f"    out[t] = {f}_score(score[t], p[0], p[1], p[2], p[3], p[4], a);\n"
        f"    d_score[t] = {f}_vjp(score[t], p[0], p[1], p[2], p[3], p[4], cot[t], a);\n}}\n"
    )


def _float_slots(graph) -> tuple[int, ...]:
    return tuple(s for s, slot in enumerate(graph.slots) if slot.kind == FLOAT)


# ---------------------------------------------------------------- NVRTC


def test_every_mod_compiles_with_nvrtc_without_warnings(tmp_path):
    report = nvrtc_report()
    cu = tmp_path / "mod_grid.cu"
    cu.write_text("".join(_kernel_source(name, mod) for name, mod in MODS.items()))
    for arch in report.ARCHES:
        entry = report.compile_source(cu, arch)
        assert entry["ok"], f"{arch}:\n{entry['log']}"
        assert not entry["warnings"], f"{arch}: NVRTC warnings:\n{entry['log']}"
        assert {_c_name(n) for n in MODS} <= set(entry["kernels"]), f"{arch}: kernels missing"


# ---------------------------------------------------------------- CPU harness numerics

needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="cudacpu needs Linux (ucontext, GNU ld)"
)


@pytest.fixture(scope="module")
def module():
    code = "".join(_kernel_source(name, mod) for name, mod in MODS.items())
    return cudacpu.RawModule(code=code)


def _pairs():
    """Every (b, h, q_idx, kv_idx, q_row) of a grid with negative and positive q_idx - kv_idx."""
    b, h, q, k = np.meshgrid(
        np.arange(2), np.arange(3), np.arange(-3, 9), np.arange(-2, 12), indexing="ij"
    )
    idx = np.stack([b, h, q, k, q + 3], axis=-1).reshape(-1, 5).astype(np.int64)
    return np.ascontiguousarray(idx)


def _host(a) -> np.ndarray:
    """A NumPy copy of a slot's array for the reference (bfloat16 widened to float32, exactly)."""
    if hasattr(a, "detach"):
        a = a.detach()
        return (a.float() if str(a.dtype) == "torch.bfloat16" else a).numpy()
    return np.asarray(a)


def _reference(mod, arrays, idx):
    """BoundGraph on float32 NumPy over the pairs, every captured index clamped as the kernel does."""
    graph = mod.graph
    clamped = [
        (i, axis)
        for i, n in enumerate(graph.nodes)
        if n.op == "gather"
        for axis in range(len(n.args))
    ]
    bound = graph.clamping(clamped).bind(np, np.float32, "cpu", arrays)
    names = ("b", "h", "q_idx", "kv_idx", "q_row")
    grid = Grid({n: idx[:, k].copy() for k, n in enumerate(names)}, rank=1)
    return bound, grid


def _close(got, want, what, scale=64):
    """Equal within ``scale`` float32 eps, relative, or absolute below 1 (NaN where NaN)."""
    want = np.broadcast_to(np.asarray(want, np.float32), got.shape)
    tol = scale * EPS * np.maximum(1.0, np.abs(np.where(np.isfinite(want), want, 0.0)))
    same = (got == want) | (np.isnan(got) & np.isnan(want)) | (np.abs(got - want) <= tol)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (
        f"{what}: {bad.size} differ, first at {bad[:5]}: {got.flat[bad[:5]]} vs {want.flat[bad[:5]]}"
    )


def _scores(n, special: bool):
    rng = np.random.default_rng(3)
    s = (rng.standard_normal(n) * 2.0).astype(np.float32)
    if special:
        s[::17] = np.nan
        s[5::23] = np.inf
        s[11::29] = -np.inf
        s[3::31] = 0.0
    return s


@needs_linux
@pytest.mark.parametrize("name", [n for n, m in MODS.items() if isinstance(m, xm.MaskMod)])
def test_mask_matches_bound_graph(module, name):
    mod = MODS[name]
    idx = _pairs()
    arrays = [_host(s.array) for s in mod.graph.slots]
    ptrs, ints, floats = pack_arguments(mod.graph)
    keep = np.zeros(idx.shape[0], np.float32)
    n = np.int32(idx.shape[0])
    module.get_function(_c_name(name))((n // 128 + 1,), (128,), (idx, keep, ptrs, ints, floats, n))
    bound, grid = _reference(mod, arrays, idx)
    want = np.broadcast_to(bound.run(grid)[mod.graph.output], keep.shape)
    np.testing.assert_array_equal(keep, want.astype(np.float32))


@needs_linux
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("name", [n for n, m in MODS.items() if isinstance(m, xm.ScoreMod)])
def test_score_and_vjp_match_bound_graph(module, name, special):
    mod = MODS[name]
    graph = mod.graph
    idx = _pairs()
    n = idx.shape[0]
    arrays = [_host(s.array) for s in graph.slots]
    grads = _float_slots(graph)
    accumulators = [np.zeros(arrays[s].shape, np.float32) for s in grads]
    ptrs, ints, floats = pack_arguments(graph, None, grads, accumulators)
    score = _scores(n, special)
    cot = np.cos(np.arange(n, dtype=np.float32) * 0.7).astype(np.float32)
    out, d_score = np.zeros(n, np.float32), np.zeros(n, np.float32)
    args = (idx, score, cot, out, d_score, ptrs, ints, floats, np.int32(n))
    module.get_function(_c_name(name))((n // 128 + 1,), (128,), args)

    bound, grid = _reference(mod, arrays, idx)
    values = bound.run(grid, score)
    want_grads = [None] * len(graph.slots)
    for s in grads:
        want_grads[s] = np.zeros(arrays[s].shape, np.float32)
    want_d = bound.backprop(values, grid, cot, want_grads)
    _close(out, values[graph.output], "score")
    _close(d_score, 0.0 if want_d is None else want_d, "d score")
    # sums of up to n float32 terms, accumulated in another order: the error grows with the count
    for s, acc in zip(grads, accumulators):
        _close(acc, want_grads[s], f"gradient of {graph.slots[s].label}", scale=4 * np.sqrt(n))


@needs_linux
def test_floor_saturates_and_maps_nan_to_zero():
    """floor to int64: NaN -> 0 and saturation past int64 (the documented semantics)."""
    mod = xm.ScoreMod(lambda s, b, h, q, k: xm.floor(s * 1.0e30) * 1.0e-18)
    code = _kernel_source("floor", mod)
    m = cudacpu.RawModule(code=code)
    s = np.array([np.nan, np.inf, -np.inf, 1.0, -1.0, 0.0, 1e-31, -1e-31], np.float32)
    n = s.size
    idx = np.zeros((n, 5), np.int64)
    out, d = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ptrs, ints, floats = pack_arguments(mod.graph)
    m.get_function(_c_name("floor"))(
        (1,), (32,), (idx, s, np.ones(n, np.float32), out, d, ptrs, ints, floats, np.int32(n))
    )
    top = np.float32(float(2**63 - 2**39) * 1e-18)
    want = np.array([0.0, top, -top, top, -top, 0.0, 0.0, -1e-18], np.float32)
    np.testing.assert_allclose(out, want, rtol=4 * EPS, atol=0.0)


def test_constants_and_extents_are_arguments_not_source():
    """Windows and table shapes differ only in the packed arguments, not in the source."""
    a, b = xm.SlidingWindowMask(8).graph, xm.SlidingWindowMask(64).graph
    assert cuda_source(a, "mask", "m") == cuda_source(b, "mask", "m")
    assert not np.array_equal(pack_arguments(a)[1], pack_arguments(b)[1])
    s1 = xm.AliBiScore(np.ones(3, np.float32)).graph
    s2 = xm.AliBiScore(np.ones(8, np.float32)).graph
    assert cuda_source(s1, "vjp", "v", (0,)) == cuda_source(s2, "vjp", "v", (0,))


def test_vjp_arguments_extend_the_score_arguments():
    """One packing serves the score and its vjp: the vjp's layout starts with the score's."""
    graph = MODS["alibi>>bias>>noop"].graph
    grads = _float_slots(graph)
    score, vjp = layout(graph), layout(graph, grads)
    assert (score.slot_ints, score.int_consts, score.float_consts) == (
        vjp.slot_ints,
        vjp.int_consts,
        vjp.float_consts,
    )
    assert min(vjp.grad_ints) >= score.n_ints


def test_bad_arguments_are_refused():
    graph = MODS["alibi"].graph
    with pytest.raises(ValueError, match="role"):
        cuda_source(graph, "forward", "f")
    with pytest.raises(ValueError, match="name"):
        cuda_source(graph, "score", "not an identifier")
    with pytest.raises(ValueError, match="grads"):
        cuda_source(graph, "vjp", "f", (3,))
    with pytest.raises(ValueError, match="grads"):
        cuda_source(MODS["document"].graph, "vjp", "f", (0,))
    with pytest.raises(ValueError, match="condition"):
        cuda_source(graph, "mask", "f")
    with pytest.raises(TypeError, match="uint16"):
        cuda_source(xm.DocumentMask(np.zeros(4, np.uint16)).graph, "mask", "f")
    with pytest.raises(TypeError, match="arrays\\[0\\]"):
        pack_arguments(graph, [np.ones(3, np.float64)])
    with pytest.raises(TypeError, match="accumulators\\[0\\]"):
        pack_arguments(graph, None, (0,), [np.ones(4, np.float32)])
