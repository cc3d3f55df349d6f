"""The cupy backend's FlexAttention (``flex_attention.cuh`` and generated mod units), run unchanged
through the CPU harness.

What the conformance suite's cupy-cpu targets do not reach: bfloat16 (NumPy
has none), the largest padded head dim, positions differing per batch read
on the device, a BlockMask whose tiles the kernels' do not divide (pairs read
their plan state; one whose states overrule the mask), checkpoints feeding the array_api backward and back, the
determinism routing rule (atomic score-mod gradients), planted kernel bugs
the tests must catch, runs under AddressSanitizer and ThreadSanitizer, and
the NVRTC build of a generated unit for
sm_80/sm_90 (no warnings, no spills, tensor cores for 16-bit inputs).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report
from xpkernels.backends.cupy import flex_attention as F

from xpkernels import mods as xm
from xpkernels import registry
from xpkernels.buffers import Duplicated, allocate_checkpoints, allocate_scratchspace, grad_shadow
from xpkernels.flex_attention import flex_attention_, flex_attention_backward_
from xpkernels.registry import BackendError
from xpkernels.testing import cudacpu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ROOT = Path(__file__).resolve().parents[1]
EPS32 = float(np.finfo(np.float32).eps)


def _eps(t) -> float:
    return float(ml_dtypes.finfo(t).eps if t is ml_dtypes.bfloat16 else np.finfo(t).eps)


def _late(b, h, q_idx, kv_idx):
    """Keys at least 30 positions back: the first 30 queries keep nothing."""
    return kv_idx + 30 <= q_idx


def _config(name, rng):
    """``(shape, score, mask, block_mask, input_pos)`` of a named configuration."""
    if name == "gqa-causal-alibi-positions-per-batch":
        # GQA, D != Dv (both padded), tiles crossing Sq and Sk, positions read on the device
        shape = (2, 4, 2, 70, 90, 40, 24)
        slopes = (rng.random(4) * 0.2).astype(np.float32)
        return shape, xm.AliBiScore(slopes), xm.CausalMask(), None, [20, 5]
    if name == "block-12x20-sliding-bias":
        # BlockMask tiles the kernels' tiles do not divide: straddling pairs read their state
        shape = (1, 2, 2, 50, 60, 16, 16)
        bias = (rng.standard_normal((1, 2, 50, 60)) * 0.5).astype(np.float32)
        mask = xm.SlidingWindowMask(10)
        block = xm.build_block_mask(mask, 50, 60, tile_m=12, tile_n=20)
        return shape, xm.BiasScore(bias), mask, block, 0
    if name == "edited-block-12x20-sliding-bias":
        # the BlockMask rules over the mask: a tile the mask keeps pairs of declared SKIP, a
        # PARTIAL one declared FULL (array_api honours both; straddling pairs must read them)
        shape, score, mask, block, input_pos = _config("block-12x20-sliding-bias", rng)
        states = block.states.copy()
        partial = np.argwhere(states[0, 0] == xm.PARTIAL)
        states[0, 0][tuple(partial[0])] = xm.SKIP
        states[0, 0][tuple(partial[3])] = xm.FULL
        return shape, score, mask, dataclasses.replace(block, states=states), input_pos
    if name == "late-rows-fully-masked":
        shape = (1, 2, 1, 70, 70, 32, 32)
        slopes = (rng.random(2) * 0.2).astype(np.float32)
        return shape, xm.AliBiScore(slopes), xm.MaskMod(_late), None, 0
    if name == "d128-dv100-softcap":
        # the largest padded head dim, Dv not a multiple of a 16-byte vector, no mask
        shape = (1, 1, 1, 17, 129, 128, 100)
        return shape, xm.SoftCapScore(1.5), None, None, 0
    raise KeyError(name)


CONFIGS = (
    "gqa-causal-alibi-positions-per-batch",
    "block-12x20-sliding-bias",
    "edited-block-12x20-sliding-bias",
    "late-rows-fully-masked",
    "d128-dv100-softcap",
)


def _inputs(rng, t, shape):
    batch, heads, kv_heads, sq, sk, d, dv = shape
    q, k, v, do = (
        rng.standard_normal(s).astype(t)
        for s in ((batch, heads, sq, d), (batch, kv_heads, sk, d), (batch, kv_heads, sk, dv),
                  (batch, heads, sq, dv))
    )  # fmt: skip
    return q, k, v, do


def _slots(score):
    return () if score is None else score.graph.slots


def _cupy(q, k, v, do, score, mask, block, input_pos, *, schedule="default", checkpoints=None):
    """Forward and backward through the cupy launchers (CPU harness), into NaN-filled outputs.

    ``checkpoints`` ``(o, m, l)``: skip the forward and run the backward from them.
    Returns float64 ``o, m, l, dq, dk, dv`` and the score-mod gradients (float32).
    """
    batch, heads, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    positions = tuple(input_pos) if isinstance(input_pos, list) else (input_pos,)
    plan = xm.plan_tiles(
        mask,
        block,
        block_sparse=True,
        n_q=sq,
        n_kv=sk,
        positions=positions,
        tile_m=F.PLAN_TILE,
        tile_n=F.PLAN_TILE,
    )
    options = dict(
        scale=1 / math.sqrt(d),
        input_pos=positions,
        score_mod=None if score is None else score.graph,
        mask_mod=None if mask is None else mask.graph,
        plan=plan,
    )
    with cudacpu.emulate(schedule=schedule):
        if checkpoints is None:
            o = np.full((batch, heads, sq, dv), np.nan, q.dtype)
            m, l_sum = (np.full((batch, heads, sq), np.nan, np.float32) for _ in range(2))
            F.forward(o, q, k, v, m, l_sum, **options)
        else:
            o, m, l_sum = checkpoints
        grads = [np.full(a.shape, np.nan, a.dtype) for a in (q, k, v)]
        mod_grads = tuple(np.zeros(s.array.shape, np.float32) for s in _slots(score))
        F.backward(
            do,
            q,
            k,
            v,
            o,
            m,
            l_sum,
            *grads,
            np.full((batch, heads, sq), np.nan, np.float32),
            None,
            score_mod_grads=mod_grads,
            deterministic=False,
            score_mod_workspace=None,
            **options,
        )
    return [np.asarray(a, np.float64) for a in (o, m, l_sum, *grads)], mod_grads


def _array_api(q, k, v, do, score, mask, block, input_pos):
    """The array_api backend's forward and backward in float64 (the reference)."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = np.full(do.shape, np.nan)
    options = dict(score_mod=score, mask_mod=mask, block_mask=block, input_pos=input_pos)
    flex_attention_(o, q, k, v, checkpoints=ck, backend="array_api", **options)
    grads = [np.full_like(a, np.nan) for a in (q, k, v)]
    mod_grad = None if score is None or not _slots(score) else grad_shadow(score)
    flex_attention_backward_(
        Duplicated(o, do),
        *(Duplicated(a, g) for a, g in zip((q, k, v), grads)),
        checkpoints=ck,
        score_mod_grad=mod_grad,
        backend="array_api",
        **options,
    )
    mods = (
        () if mod_grad is None else tuple(mod_grad.lookup(s.path, s.field) for s in _slots(score))
    )
    return [o, np.asarray(ck.m, np.float64), np.asarray(ck.l, np.float64), *grads], mods


def _o_tolerance(t, v) -> float:
    """Probabilities rounded to ``t`` before P V and o rounded to ``t`` (as attention)."""
    return 4 * _eps(t) * max(1.0, float(np.abs(np.asarray(v, np.float64)).max()))


def _grad_tolerance(t, want) -> float:
    """P and dS rounded to ``t`` before their products, the gradient rounded to ``t``; float32:
    exp2/log2 and the sums in float32. Relative to the largest gradient."""
    return 2 * max(8 * _eps(t), 64 * EPS32) * max(1.0, float(np.abs(want).max()))


def _assert_forward(got, want, t, v, d):
    o, m, l_sum = got[:3]
    o_ref, m_ref, l_ref = want[:3]
    np.testing.assert_allclose(o, o_ref, atol=_o_tolerance(t, v), rtol=0, err_msg="o")
    masked = np.isinf(m_ref)
    assert (m[masked] == -np.inf).all() and (l_sum[masked] == 0).all() and (o[masked] == 0).all()
    # scores are float32 dot products of D terms through the score mod
    tol = 8 * d * EPS32 * max(1.0, float(np.abs(m_ref[~masked]).max(initial=0.0)))
    np.testing.assert_allclose(m[~masked], m_ref[~masked], rtol=tol, atol=tol, err_msg="m")
    np.testing.assert_allclose(l_sum[~masked], l_ref[~masked], rtol=16 * d * EPS32, err_msg="l")


def _assert_backward(got, want, mods, mods_want, t):
    for name, g, w in zip(("dq", "dk", "dv"), got[3:], want[3:]):
        np.testing.assert_allclose(g, w, atol=_grad_tolerance(t, w), rtol=0, err_msg=name)
    for g, w in zip(mods, mods_want):
        # sums over every pair of products of the rounded probabilities
        tol = _grad_tolerance(t, w) * math.sqrt(max(1, g.size))
        np.testing.assert_allclose(g, w, atol=tol, rtol=0, err_msg="score-mod gradient")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("config", CONFIGS)
def test_forward_and_backward_match_the_float64_array_api(config, dtype):
    t = DTYPES[dtype]
    rng = np.random.default_rng(CONFIGS.index(config) + 3)
    shape, score, mask, block, input_pos = _config(config, rng)
    q, k, v, do = _inputs(rng, t, shape)
    want, mods_want = _array_api(q, k, v, do, score, mask, block, input_pos)
    got, mods = _cupy(q, k, v, do, score, mask, block, input_pos)
    _assert_forward(got, want, t, v, shape[5])
    _assert_backward(got, want, mods, mods_want, t)
    if config == "late-rows-fully-masked":  # rows keeping no key: exact zeros
        assert (got[3][:, :, :30] == 0).all() and np.isinf(got[1][:, :, :30]).all()


def test_shuffled_schedule_gives_the_same_results():
    rng = np.random.default_rng(5)
    shape, score, mask, block, input_pos = _config("gqa-causal-alibi-positions-per-batch", rng)
    q, k, v, do = _inputs(rng, np.float16, shape)
    default, _ = _cupy(q, k, v, do, score, mask, block, input_pos)
    shuffled, _ = _cupy(q, k, v, do, score, mask, block, input_pos, schedule="shuffled")
    for a, b in zip(default, shuffled):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_checkpoints_interchange_with_array_api(dtype):
    """cupy forward -> array_api backward, and array_api forward -> cupy backward."""
    t = DTYPES[dtype]
    rng = np.random.default_rng(17)
    shape, score, mask, block, input_pos = _config("gqa-causal-alibi-positions-per-batch", rng)
    q, k, v, do = _inputs(rng, t, shape)
    want, mods_want = _array_api(q, k, v, do, score, mask, block, input_pos)
    options = dict(score_mod=score, mask_mod=mask, input_pos=input_pos)
    # cupy's checkpoints feed array_api's backward (same-dtype arrays, through the fronts)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = np.full(do.shape, np.nan, t)
    with cudacpu.emulate():
        flex_attention_(o, q, k, v, checkpoints=ck, backend="cupy", **options)
    grads = [np.full_like(a, np.nan) for a in (q, k, v)]
    flex_attention_backward_(
        Duplicated(o, do),
        *(Duplicated(a, g) for a, g in zip((q, k, v), grads)),
        checkpoints=ck,
        backend="array_api",
        **options,
    )
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[3:]):
        g = np.asarray(g, np.float64)
        np.testing.assert_allclose(g, w, atol=_grad_tolerance(t, w), rtol=0, err_msg=name)
    # array_api's checkpoints feed cupy's backward
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    o = np.full(do.shape, np.nan, t)
    flex_attention_(o, q, k, v, checkpoints=ck, backend="array_api", **options)
    got, mods = _cupy(q, k, v, do, score, mask, block, input_pos, checkpoints=(o, ck.m, ck.l))
    _assert_backward(got, want, mods, mods_want, t)


def test_deterministic_score_mod_gradients_are_not_routed_to_cupy(monkeypatch):
    """Atomic score-mod gradients: deterministic=True with score_mod_grad falls back to array_api
    (warned once) on the automatic route and raises BackendError for backend="cupy"."""
    rng = np.random.default_rng(2)
    q, k, v, do = _inputs(rng, np.float32, (1, 2, 2, 20, 20, 16, 16))
    score = xm.AliBiScore(np.full(2, 0.1, np.float32))
    o = np.empty_like(do)
    with cudacpu.emulate():
        ck = allocate_checkpoints(flex_attention_, q, k, v)
        flex_attention_(o, q, k, v, checkpoints=ck, score_mod=score, backend="cupy")

        def backward(backend, deterministic, with_grad=True):
            mod_grad = grad_shadow(score) if with_grad else None
            scratch = allocate_scratchspace(
                flex_attention_backward_,
                Duplicated(o, do),
                q,
                k,
                v,
                score_mod=score,
                score_mod_grad=mod_grad,
                deterministic=deterministic,
                backend=backend,
            )
            flex_attention_backward_(
                Duplicated(o, do),
                *(Duplicated(a, np.empty_like(a)) for a in (q, k, v)),
                checkpoints=ck,
                score_mod=score,
                score_mod_grad=mod_grad,
                deterministic=deterministic,
                scratch=scratch,
                backend=backend,
            )
            return scratch

        with pytest.raises(BackendError, match="cannot give bit-identical score-mod gradients"):
            backward("cupy", True)
        assert backward("cupy", False).dq_accum is None  # served by cupy (no dq_accum)
        assert backward("cupy", True, with_grad=False).dq_accum is None
        # the automatic route, were cupy preferred for these arrays: array_api, warned once
        monkeypatch.setitem(registry.PREFERRED, ("numpy", "cpu"), "cupy")
        monkeypatch.setattr(registry, "_WARNED", set())
        with pytest.warns(RuntimeWarning, match="falls back to the array_api backend"):
            assert backward(None, True).dq_accum is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert backward(None, True).dq_accum is not None
            assert backward(None, False).dq_accum is None


def _planted(tmp_path, monkeypatch, old: str, new: str):
    """Generated units include a copy of flex_attention.cuh with ``old`` replaced by ``new``."""
    source = (Path(F.__file__).with_name("flex_attention.cuh")).read_text()
    assert source.count(old) == 1, old
    (tmp_path / "flex_attention.cuh").write_text(source.replace(old, new))
    monkeypatch.setattr(F, "_directory", lambda: tmp_path)
    monkeypatch.setattr(F, "_UNITS", {})


def _planted_case(schedule, config="gqa-causal-alibi-positions-per-batch"):
    """float16: the largest relative error of o, dq, dk, dv and the score-mod gradients (or
    the harness's error)."""
    rng = np.random.default_rng(23)
    shape, score, mask, block, input_pos = _config(config, rng)
    q, k, v, do = _inputs(rng, np.float16, shape)
    want, mods_want = _array_api(q, k, v, do, score, mask, block, input_pos)
    try:
        got, mods = _cupy(q, k, v, do, score, mask, block, input_pos, schedule=schedule)
    except cudacpu.LaunchError as exc:
        return str(exc)
    pairs = [(got[0], want[0]), *zip(got[3:], want[3:]), *zip(mods, mods_want)]
    errors = [np.abs(g - w) / max(1.0, float(np.abs(w).max())) for g, w in pairs]
    return max(float(np.max(np.where(np.isnan(e), np.inf, e))) for e in errors)


@pytest.mark.parametrize(
    ("old", "new", "schedule", "config"),
    [
        (
            "return flex_mask(b, h, pos + row, key, row, mask_args);",
            "return true;",
            "default",
            "gqa-causal-alibi-positions-per-batch",
        ),
        (
            "ds = flex_vjp(",
            "ds = flex_dscore(",
            "default",
            "gqa-causal-alibi-positions-per-batch",
        ),
        (
            "            __syncthreads();  // the previous tile's Q, dO and row values",
            "            // the previous tile's Q, dO and row values",
            "shuffled",
            "gqa-causal-alibi-positions-per-batch",
        ),
        ("if (!plan.exact) {", "if (false) {", "default", "edited-block-12x20-sliding-bias"),
    ],
    ids=[
        "mask-skipped",
        "score-mod-gradients-dropped",
        "dkdv-missing-syncthreads",
        "plan-states-of-straddling-pairs-ignored",
    ],
)
def test_planted_kernel_bugs_are_caught(tmp_path, monkeypatch, old, new, schedule, config):
    tol = 32 * _eps(np.float16)
    intact = _planted_case(schedule, config)
    assert isinstance(intact, float) and intact <= tol, intact
    _planted(tmp_path, monkeypatch, old, new)
    broken = _planted_case(schedule, config)
    assert isinstance(broken, str) or broken > 10 * tol, broken


SANITIZED_RUN = """
import math, os, numpy as np
from xpkernels import mods as xm
from xpkernels.backends.cupy import flex_attention as F
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
sanitizer = os.environ["XPKERNELS_CUDACPU_SANITIZE"]
slopes = np.full(2, 0.1, np.float32)
score, mask = xm.AliBiScore(slopes), xm.SlidingWindowMask(20) & xm.CausalMask()
# float16 (the wmma path) under both sanitizers, float32 (SIMT, in-place P and dS) under ASan
for t in (np.float16,) if sanitizer == "thread" else (np.float16, np.float32):
    plan = xm.plan_tiles(mask, xm.build_block_mask(mask, 70, 70, tile_m=24, tile_n=40),
                         block_sparse=True, n_q=70, n_kv=70, positions=(0,), tile_m=64,
                         tile_n=64)
    options = dict(scale=0.25, input_pos=(0,), score_mod=score.graph, mask_mod=mask.graph,
                   plan=plan)
    with cudacpu.emulate():
        q, do = (cudacpu.empty((1, 2, 70, 16), t) for _ in range(2))
        k, v = (cudacpu.empty((1, 1, 70, 16), t) for _ in range(2))
        o, dq, dk, dv = (cudacpu.empty(a.shape, t) for a in (q, q, k, v))
        m, l, delta = (cudacpu.empty((1, 2, 70), np.float32) for _ in range(3))
        for a in (q, k, v, do):
            a[...] = rng.standard_normal(a.shape)
        F.forward(o, q, k, v, m, l, **options)
        grad = np.zeros(2, np.float32)
        F.backward(do, q, k, v, o, m, l, dq, dk, dv, delta, None, score_mod_grads=(grad,),
                   deterministic=False, score_mod_workspace=None, **options)
        assert all(np.isfinite(a.astype(np.float32)).all() for a in (o, dq, dk, dv, grad))
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_kernels_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_builds_a_generated_unit_on_tensor_cores_without_spills(arch, tmp_path):
    """Pair features with their gradients (float gathers, atomics) under sliding & document
    (integer gathers): every instantiation, no warning, no spill."""
    report = nvrtc_report()
    unit = report.flex_unit(tmp_path)
    entry = report.compile_source(unit, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(F.name_expressions())
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        sixteen_bit = re.match(r"flex_\w+<(__half|__nv_bfloat16),", name) is not None
        assert k["tensor_core"] == ("wmma" if sixteen_bit else "none"), (name, k)
        assert k["global_load_bits"] == 128, (name, k)
