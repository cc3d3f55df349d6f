"""The cupy backend's attention forward and backward (``attention.cu``), run unchanged through the CPU harness.

What the conformance suite's cupy-cpu targets do not reach: bfloat16 (NumPy
has none), int32 lengths and positions, every padded head dim, output and
gradient dtypes other than the inputs', NaN reaching exactly the rows (and
keys) that see it, device values past their range (clamped in the kernel),
the checkpoints feeding the array_api and triton backwards, gradients
against torch float64 autograd, planted kernel bugs the tests must catch,
and the NVRTC build for sm_80/sm_90 (no warnings, no spills, tensor cores
for 16-bit inputs).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report
from xpkernels.backends.cupy import attention as A

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.registry import BackendError
from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["default", "shuffled"])
def harness(request):
    with cudacpu.emulate(schedule=request.param):
        yield request.param


def _eps(t) -> float:
    return float(ml_dtypes.finfo(t).eps if t is ml_dtypes.bfloat16 else np.finfo(t).eps)


def _inputs(rng, t, batch, heads, kv_heads, sq, sk, d, dv, layout="bhsd"):
    """q, k, v in dtype ``t``; BSHD layout: views of (B, S, H, D) buffers."""

    def make(shape):
        a = rng.standard_normal(shape).astype(t)
        if layout == "bhsd":
            return a
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    return (
        make((batch, heads, sq, d)),
        make((batch, kv_heads, sk, d)),
        make((batch, kv_heads, sk, dv)),
    )


def _run(q, k, v, *, o_dtype=None, scale=None, causal=False, input_pos=0, q_lengths=None,
         k_lengths=None):  # fmt: skip
    """The launcher into NaN-filled o, m, l; returns them as float64."""
    batch, heads, sq, d = q.shape
    o = np.full((batch, heads, sq, v.shape[3]), np.nan, o_dtype or q.dtype)
    m = np.full((batch, heads, sq), np.nan, np.float32)
    l_sum = np.full((batch, heads, sq), np.nan, np.float32)
    A.forward(
        o,
        q,
        k,
        v,
        m,
        l_sum,
        scale=1 / math.sqrt(d) if scale is None else scale,
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )
    return o.astype(np.float64), m.astype(np.float64), l_sum.astype(np.float64)


def _reference(q, k, v, *, causal=False, input_pos=0, q_lengths=None, k_lengths=None):
    batch, _, sq, d = q.shape
    keep = ref.attention_keep(
        batch,
        sq,
        k.shape[2],
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )
    o, m, l_sum, _ = ref.attention(
        *(np.asarray(a, np.float64) for a in (q, k, v)), scale=1 / math.sqrt(d), keep=keep
    )
    return o, m, l_sum


def _o_tolerance(t, v) -> float:
    """Probabilities rounded to ``t`` before P V (relative eps / 2 each) and o rounded to ``t``."""
    return 4 * _eps(t) * max(1.0, float(np.abs(np.asarray(v, np.float64)).max()))


def _assert_matches(got, want, t, v, d):
    o, m, l_sum = got
    o_ref, m_ref, l_ref = want
    np.testing.assert_allclose(o, o_ref, atol=_o_tolerance(t, v), rtol=0)
    masked = np.isinf(m_ref)
    assert (m[masked] == -np.inf).all() and (l_sum[masked] == 0).all()
    # Scores are float32 dot products of D terms: errors of order D * eps32 of |s|.
    eps32 = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(m[~masked], m_ref[~masked], rtol=4 * d * eps32, atol=4 * d * eps32)
    np.testing.assert_allclose(l_sum[~masked], l_ref[~masked], rtol=8 * d * eps32)


CONFIGS = {
    # tiles crossing Sq and Sk, GQA, Dv != D, causal with a positive position
    "gqa2-causal-d40-dv24": dict(shape=(2, 4, 2, 70, 90, 40, 24), causal=True, input_pos=20),
    # int32 positions (one negative) and lengths, an empty batch of queries, one of few keys
    "int32-lengths-positions": dict(
        shape=(3, 2, 1, 65, 67, 16, 16),
        causal=True,
        input_pos=np.array([-3, 10, 2], np.int32),
        q_lengths=np.array([65, 30, 0], np.int32),
        k_lengths=np.array([67, 12, 67], np.int32),
    ),
    # the largest padded head dim, Dv not a multiple of a 16-byte vector
    "d128-dv100": dict(shape=(1, 1, 1, 17, 129, 128, 100)),
    # strided BSHD views, vector loads
    "bshd-d64": dict(shape=(2, 2, 2, 33, 40, 64, 64), layout="bshd", causal=True),
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_forward_matches_float64(harness, dtype, config):
    options = dict(CONFIGS[config])
    shape, layout = options.pop("shape"), options.pop("layout", "bhsd")
    t = DTYPES[dtype]
    rng = np.random.default_rng(sum(shape))
    q, k, v = _inputs(rng, t, *shape, layout=layout)
    _assert_matches(_run(q, k, v, **options), _reference(q, k, v, **options), t, v, shape[5])


def test_no_keys_and_tiny_head_dims(harness):
    rng = np.random.default_rng(1)
    o, m, l_sum = _run(*_inputs(rng, np.float16, 2, 2, 1, 3, 0, 8, 8))  # Sk = 0
    assert (o == 0).all() and (m == -np.inf).all() and (l_sum == 0).all()
    q, k, v = _inputs(rng, np.float32, 1, 3, 3, 1, 5, 1, 2)  # Sq = 1, D = 1, Dv = 2
    got = _run(q, k, v, causal=True, input_pos=2)
    _assert_matches(got, _reference(q, k, v, causal=True, input_pos=2), np.float32, v, 1)


def test_vector_and_scalar_loads_are_both_exercised():
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, np.float16, 1, 1, 1, 4, 4, 128, 100)
    assert A._vector_ok(q, 128) == 1 and A._vector_ok(v, 100) == 0
    bshd = _inputs(rng, np.float32, 2, 2, 2, 3, 3, 64, 64, layout="bshd")[0]
    assert A._vector_ok(bshd, 64) == 1 and A._vector_ok(bshd[:, :, :, 1:], 63) == 0


@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"), [("float16", "float32"), ("float32", "bfloat16")]
)
def test_output_dtype_may_differ_from_the_inputs(harness, in_dtype, out_dtype):
    t, to = DTYPES[in_dtype], DTYPES[out_dtype]
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, t, 1, 2, 1, 20, 70, 32, 32)
    got = _run(q, k, v, o_dtype=to, causal=True, input_pos=50)
    want = _reference(q, k, v, causal=True, input_pos=50)
    tol = _o_tolerance(t, v) + _o_tolerance(to, v)
    np.testing.assert_allclose(got[0], want[0], atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_checkpoints_feed_the_array_api_backward(dtype):
    """Forward on cupy (CPU harness), backward on array_api: the checkpoint contract holds."""
    t = DTYPES[dtype]
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, t, 2, 4, 2, 40, 72, 16, 16)
    do = rng.standard_normal((2, 4, 40, 16)).astype(t)
    options = dict(causal=True, input_pos=np.array([30, 5]), k_lengths=np.array([72, 50]))
    results = {}
    for forward in ("cupy", "array_api"):
        with cudacpu.emulate():
            ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
            o = np.full((2, 4, 40, 16), np.nan, t)
            xk.attention_(o, q, k, v, checkpoints=ck, backend=forward, **options)
        grads = [np.full_like(a, np.nan) for a in (q, k, v)]
        xk.attention_backward_(
            Duplicated(o, do),
            *(Duplicated(a, g) for a, g in zip((q, k, v), grads)),
            checkpoints=ck,
            backend="array_api",
            **options,
        )
        results[forward] = (o, ck.m, ck.l, *grads)
    keep = ref.attention_keep(2, 40, 72, causal=True, input_pos=[30, 5], k_lengths=[72, 50])
    want = ref.attention_backward(
        *(a.astype(np.float64) for a in (q, k, v, do)), scale=0.25, keep=keep
    )
    eps32 = float(np.finfo(np.float32).eps)
    for name, a, b in zip(("o", "m", "l"), results["cupy"][:3], results["array_api"][:3]):
        tol = _o_tolerance(t, v) if name == "o" else 64 * eps32
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=name)
    for name, got, ours in zip(("dq", "dk", "dv"), results["cupy"][3:], want):
        scale = max(1.0, float(np.abs(ours).max()))
        np.testing.assert_allclose(got, ours, atol=32 * _eps(t) * scale, rtol=0, err_msg=name)


TRITON_INTERCHANGE = """
import math, numpy as np, torch
from xpkernels.backends.cupy import attention as A
from xpkernels.backends.triton import attention as T
from xpkernels.testing import cudacpu, references as ref
rng = np.random.default_rng(13)
b, h, hkv, sq, sk, d = 1, 2, 1, 24, 70, 16
q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in
               ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, h, sq, d)))
o, m, l = np.empty_like(q), np.empty((b, h, sq), np.float32), np.empty((b, h, sq), np.float32)
options = dict(scale=0.25, causal=True, input_pos=50, q_lengths=None, k_lengths=None)
with cudacpu.emulate():
    A.forward(o, q, k, v, m, l, **options)
t = {n: torch.from_numpy(a) for n, a in dict(q=q, k=k, v=v, do=do, o=o, m=m, l=l).items()}
grads = [torch.full_like(t[n], float("nan")) for n in ("q", "k", "v")]
T.backward(t["do"], t["q"], t["k"], t["v"], t["o"], t["m"], t["l"], *grads,
           torch.empty((b, h, sq)), None, **options)
keep = ref.attention_keep(b, sq, sk, causal=True, input_pos=50)
want = ref.attention_backward(*(a.astype(np.float64) for a in (q, k, v, do)), scale=0.25,
                              keep=keep)
eps = float(np.finfo(np.float32).eps)
errors = [float(np.abs(g.double().numpy() - w).max()) / (eps * max(1.0, float(np.abs(w).max())))
          for g, w in zip(grads, want)]
# and back: forward on triton, backward on cupy
t_o, t_m, t_l = torch.empty_like(t["q"]), torch.empty((b, h, sq)), torch.empty((b, h, sq))
T.forward(t_o, t["q"], t["k"], t["v"], t_m, t_l, **options)
grads = [np.full_like(a, np.nan) for a in (q, k, v)]
with cudacpu.emulate():
    A.backward(do, q, k, v, t_o.numpy(), t_m.numpy(), t_l.numpy(), *grads,
               np.empty((b, h, sq), np.float32), None, **options)
errors += [float(np.abs(g - w).max()) / (eps * max(1.0, float(np.abs(w).max())))
           for g, w in zip(grads, want)]
print(max(errors))
"""


def test_checkpoints_interchange_with_triton():
    """Forward on cupy (CPU harness), backward on triton (its interpreter) and the other way
    round, in a fresh process."""
    pytest.importorskip("torch", reason="the triton backend needs torch")
    pytest.importorskip("triton", reason="the triton backend needs triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_INTERCHANGE],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # float32 throughout: the error in units of eps32 times the largest gradient
    assert float(proc.stdout) < 64, proc.stdout


# ---------------------------------------------------------------------------- backward


def _backward(q, k, v, do, *, grad_dtypes=None, scale=None, **options):
    """Forward then backward through the launchers into NaN-filled gradients (float64 copies)."""
    batch, heads, sq, d = q.shape
    o = np.full((batch, heads, sq, v.shape[3]), np.nan, q.dtype)
    m = np.full((batch, heads, sq), np.nan, np.float32)
    l_sum = np.full((batch, heads, sq), np.nan, np.float32)
    delta = np.full((batch, heads, sq), np.nan, np.float32)
    scale = 1 / math.sqrt(d) if scale is None else scale
    A.forward(o, q, k, v, m, l_sum, scale=scale, **options)
    grads = [
        np.full(a.shape, np.nan, t or a.dtype)
        for a, t in zip((q, k, v), grad_dtypes or (None,) * 3)
    ]
    A.backward(do, q, k, v, o, m, l_sum, *grads, delta, None, scale=scale, **options)
    return [g.astype(np.float64) for g in grads]


def _reference_backward(q, k, v, do, *, causal=False, input_pos=0, q_lengths=None,
                        k_lengths=None):  # fmt: skip
    keep = ref.attention_keep(
        q.shape[0],
        q.shape[2],
        k.shape[2],
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )
    f64 = (np.asarray(a, np.float64) for a in (q, k, v, do))
    return ref.attention_backward(*f64, scale=1 / math.sqrt(q.shape[3]), keep=keep)


def _grad_tolerance(t, want) -> float:
    """P and dS rounded to ``t`` before their products, the gradient rounded to ``t``; float32:
    exp2/log2 and sums over the tiles in float32. Relative to the largest gradient."""
    eps32 = float(np.finfo(np.float32).eps)
    return max(8 * _eps(t), 64 * eps32) * max(1.0, float(np.abs(want).max()))


def _assert_grads(got, want, t, grad_dtypes=None):
    for name, g, w, gt in zip(("dq", "dk", "dv"), got, want, grad_dtypes or (t,) * 3):
        tol = _grad_tolerance(t, w) + _grad_tolerance(gt, w)
        np.testing.assert_allclose(g, w, atol=tol, rtol=0, err_msg=name)


BACKWARD_CONFIGS = {
    **CONFIGS,
    # causal rows before the first key, a batch without queries, one without keys
    "fully-masked-rows": dict(
        shape=(3, 2, 2, 40, 70, 24, 24),
        causal=True,
        input_pos=np.array([-10, 0, 5], np.int64),
        q_lengths=np.array([40, 0, 33], np.int64),
        k_lengths=np.array([70, 70, 0], np.int64),
    ),
}


def _backward_case(config, dtype):
    options = dict(BACKWARD_CONFIGS[config])
    shape, layout = options.pop("shape"), options.pop("layout", "bhsd")
    t = DTYPES[dtype]
    rng = np.random.default_rng(sum(shape) + 1)
    q, k, v = _inputs(rng, t, *shape, layout=layout)
    do = rng.standard_normal((*q.shape[:3], v.shape[3])).astype(t)
    return t, (q, k, v, do), {"causal": False, "input_pos": 0, "q_lengths": None,
                              "k_lengths": None, **options}  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("config", sorted(BACKWARD_CONFIGS))
def test_backward_matches_float64(dtype, config):
    """Tiles crossing Sq and Sk, GQA, causal with positions, lengths, masked rows, D/Dv buckets."""
    t, arrays, options = _backward_case(config, dtype)
    schedule = "shuffled" if config in ("gqa2-causal-d40-dv24", "fully-masked-rows") else "default"
    with cudacpu.emulate(schedule=schedule):
        got = _backward(*arrays, **options)
    _assert_grads(got, _reference_backward(*arrays, **options), t)


def test_fully_masked_rows_and_keys_get_exact_zero_gradients():
    t, (q, k, v, do), options = _backward_case("fully-masked-rows", "float16")
    q[0, :, :10] = k[0, :, 70 - 1] = np.inf  # rows that see nothing; a key past no length
    k[1] = v[1] = np.nan  # batch 1 has no queries: its keys are seen by none
    q[2] = np.nan  # batch 2 has no keys: its queries see none
    with cudacpu.emulate():
        dq, dk, dv = _backward(q, k, v, do, **options)
    assert (dq[0, :, :10] == 0).all() and (dq[1] == 0).all() and (dq[2] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all() and (dk[2] == 0).all() and (dv[2] == 0).all()
    assert (dq[2, :, 33:] == 0).all()
    assert np.isfinite(dq).all() and np.isfinite(dv).all()


def test_backward_without_keys_or_queries_and_tiny_head_dims():
    rng = np.random.default_rng(2)
    options = dict(causal=False, input_pos=0, q_lengths=None, k_lengths=None)
    with cudacpu.emulate():
        q, k, v = _inputs(rng, np.float16, 2, 2, 1, 3, 0, 8, 8)  # Sk = 0
        dq, dk, dv = _backward(q, k, v, np.ones_like(q), **options)
        assert (dq == 0).all() and dk.size == dv.size == 0
        q, k, v = _inputs(rng, np.float32, 1, 2, 1, 0, 5, 8, 8)  # Sq = 0
        dq, dk, dv = _backward(q, k, v, np.ones_like(q), **options)
        assert dq.size == 0 and (dk == 0).all() and (dv == 0).all()
        q, k, v = _inputs(rng, np.float32, 1, 3, 3, 1, 5, 1, 2)  # Sq = 1, D = 1, Dv = 2
        do = rng.standard_normal((1, 3, 1, 2)).astype(np.float32)
        causal = dict(options, causal=True, input_pos=2)
        got = _backward(q, k, v, do, **causal)
    _assert_grads(got, _reference_backward(q, k, v, do, **causal), np.float32)


@pytest.mark.parametrize(
    ("in_dtype", "grad_dtypes", "do_dtype"),
    [
        ("float16", ("float32", "bfloat16", "float32"), "float32"),
        ("float32", ("float16", "float32", "bfloat16"), "bfloat16"),
    ],
)
def test_gradient_and_cotangent_dtypes_may_differ_from_the_inputs(in_dtype, grad_dtypes, do_dtype):
    t = DTYPES[in_dtype]
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, t, 1, 2, 1, 20, 70, 32, 32)
    do = rng.standard_normal((1, 2, 20, 32)).astype(DTYPES[do_dtype])
    options = dict(causal=True, input_pos=50, q_lengths=None, k_lengths=None)
    grad_types = [DTYPES[n] for n in grad_dtypes]
    with cudacpu.emulate():
        got = _backward(q, k, v, do, grad_dtypes=grad_types, **options)
    want = _reference_backward(q, k, v, do, **options)
    # do is rounded to the inputs' dtype for the products
    coarser = max(t, DTYPES[do_dtype], key=_eps)
    _assert_grads(got, want, coarser, grad_types)


def test_backward_matches_torch_float64_autograd():
    """Gradients of a naive float64 attention through torch.autograd (GQA, causal, lengths)."""
    torch = pytest.importorskip("torch", reason="the autograd reference needs torch")
    t, (q, k, v, do), options = _backward_case("int32-lengths-positions", "float32")
    with cudacpu.emulate():
        got = _backward(q, k, v, do, **options)
    keep = torch.from_numpy(ref.attention_keep(q.shape[0], q.shape[2], k.shape[2], **options))[
        :, None
    ]
    leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.repeat_interleave(group, dim=1) for x in leaves[1:])
    s = leaves[0] @ kr.transpose(-1, -2) / math.sqrt(q.shape[3])
    p = torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1).nan_to_num(0.0)
    (p @ vr).backward(torch.from_numpy(do.astype(np.float64)))
    _assert_grads(got, [x.grad.numpy() for x in leaves], t)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backward_routed_to_cupy_runs_the_cuda_kernels(dtype):
    """xk.attention_backward_ with backend="cupy": no dq_accum scratch, the array_api result."""
    t = DTYPES[dtype]
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, t, 2, 4, 2, 20, 30, 16, 16)
    do = rng.standard_normal((2, 4, 20, 16)).astype(t)
    options = dict(causal=True, input_pos=np.array([10, 2]), k_lengths=np.array([30, 25]))
    with cudacpu.emulate():
        ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
        o = xk.attention(q, k, v, checkpoints=ck, backend="cupy", **options)
        O = Duplicated(o, do)
        scratch = xk.allocate_scratchspace(xk.attention_backward_, O, q, k, v, backend="cupy")
        assert scratch.dq_accum is None and scratch.delta.shape == (2, 4, 20)
        grads = [np.full_like(a, np.nan) for a in (q, k, v)]
        xk.attention_backward_(
            O,
            *(Duplicated(a, g) for a, g in zip((q, k, v), grads)),
            checkpoints=ck,
            scratch=scratch,
            backend="cupy",
            **options,
        )
    products = do.astype(np.float64) * o.astype(np.float64)
    eps32 = float(np.finfo(np.float32).eps)
    tol = 16 * eps32 * float(np.abs(products).sum(-1).max())
    np.testing.assert_allclose(scratch.delta, products.sum(-1), atol=tol, rtol=0)
    want = xk.attention_backward(do, q, k, v, o, checkpoints=ck, backend="array_api", **options)
    _assert_grads(
        [g.astype(np.float64) for g in grads], [np.asarray(w, np.float64) for w in want], t
    )


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_backward_nan_reaches_only_the_rows_and_keys_that_see_it(where):
    """Causal, a NaN at position 40: rows before it (k, v) or keys after it (q) stay exact."""
    rng = np.random.default_rng(24)
    q, k, v = _inputs(rng, np.float16, 1, 2, 1, 80, 80, 16, 16)
    do = rng.standard_normal((1, 2, 80, 16)).astype(np.float16)
    options = dict(causal=True, input_pos=0, q_lengths=None, k_lengths=None)
    want = _reference_backward(q, k, v, do, **options)
    {"q": q, "k": k, "v": v}[where][0, 0, 40, 3] = np.nan
    with cudacpu.emulate():
        dq, dk, dv = _backward(q, k, v, do, **options)
    tol = 2 * _grad_tolerance(np.float16, want[0])
    if where == "q":  # row 40 of head 0 sees keys 0..40: keys 41.. and the other rows are exact
        assert np.isnan(dq[0, 0, 40]).all()
        dq[0, 0, 40] = want[0][0, 0, 40]
        np.testing.assert_allclose(dq, want[0], atol=tol, rtol=0)
        np.testing.assert_allclose(dk[:, :, 41:], want[1][:, :, 41:], atol=tol, rtol=0)
        np.testing.assert_allclose(dv[:, :, 41:], want[2][:, :, 41:], atol=tol, rtol=0)
        assert np.isnan(dk[:, :, :41]).any(axis=-1).all()
    else:  # key 40 is seen by rows 40..: rows before it are exact
        np.testing.assert_allclose(dq[:, :, :40], want[0][:, :, :40], atol=tol, rtol=0)
        assert np.isnan(dq[:, :, 40:]).any(axis=-1).all()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nan_key_or_value_reaches_only_the_rows_that_see_it(harness, where, dtype):
    """Causal: rows before key 40 stay finite and exact; rows at or after it are NaN."""
    t = DTYPES[dtype]
    rng = np.random.default_rng(21)
    q, k, v = _inputs(rng, t, 1, 2, 1, 80, 80, 16, 16)
    clean = _reference(q, k, v, causal=True)
    {"k": k, "v": v}[where][0, 0, 40, 3] = np.nan
    o, m, l_sum = _run(q, k, v, causal=True)
    np.testing.assert_allclose(o[:, :, :40], clean[0][:, :, :40], atol=_o_tolerance(t, v), rtol=0)
    assert np.isfinite(m[:, :, :40]).all() and np.isfinite(l_sum[:, :, :40]).all()
    assert np.isnan(o[:, :, 40:]).any(axis=-1).all()
    if where == "k":
        assert np.isnan(m[:, :, 40:]).all() and np.isnan(l_sum[:, :, 40:]).all()


def test_nan_beyond_lengths_and_in_one_query_row(harness):
    rng = np.random.default_rng(22)
    q, k, v = _inputs(rng, np.float16, 2, 2, 2, 30, 70, 16, 16)
    lengths = dict(q_lengths=np.array([30, 20]), k_lengths=np.array([66, 70]))
    clean = _reference(q, k, v, causal=True, input_pos=40, **lengths)
    k[0, :, 66:] = v[0, :, 66:] = np.nan  # past k_lengths[0]
    q[1, :, 20:] = np.inf  # past q_lengths[1]
    q[1, 1, 7, 0] = np.nan  # one row that sees keys
    o, m, l_sum = _run(q, k, v, causal=True, input_pos=40, **lengths)
    assert np.isnan(o[1, 1, 7]).all() and np.isnan(m[1, 1, 7]) and np.isnan(l_sum[1, 1, 7])
    o[1, 1, 7], clean[0][1, 1, 7] = 0.0, 0.0
    np.testing.assert_allclose(o, clean[0], atol=_o_tolerance(np.float16, v), rtol=0)
    assert (o[1, :, 20:] == 0).all() and (m[1, :, 20:] == -np.inf).all()


def test_device_lengths_and_positions_out_of_range_are_clamped(harness):
    rng = np.random.default_rng(23)
    q, k, v = _inputs(rng, np.float32, 3, 1, 1, 20, 40, 16, 16)
    wide = dict(
        causal=True,
        input_pos=np.array([10**12, -(10**12), 5], np.int64),
        q_lengths=np.array([99, -4, 20], np.int64),
        k_lengths=np.array([40, 40, 1000], np.int64),
    )
    clamped = dict(
        causal=True,
        input_pos=np.array([40, -20, 5], np.int64),
        q_lengths=np.array([20, 0, 20], np.int64),
        k_lengths=np.array([40, 40, 40], np.int64),
    )
    got, want = _run(q, k, v, **wide), _run(q, k, v, **clamped)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert (got[0][1] == 0).all()
    huge = _run(q, k, v, causal=True, input_pos=2**62)
    np.testing.assert_array_equal(huge[0], _run(q, k, v, causal=False)[0])


def _planted(tmp_path, monkeypatch, old: str, new: str, where: str = "attention.cu"):
    """Point the launcher at a copy of attention.cu, beside a copy of ``where`` (it or the
    header it includes) with ``old`` replaced by ``new`` (once)."""
    for name in {A.SOURCE.name, where}:
        source = A.SOURCE.with_name(name).read_text()
        if name == where:
            assert source.count(old) == 1, old
            source = source.replace(old, new)
        (tmp_path / name).write_text(source)
    monkeypatch.setattr(A, "SOURCE", tmp_path / A.SOURCE.name)


_BARRIER = """        __syncthreads();
        // A warp none of whose rows sees a key of this tile skips it (warp-uniform).
"""
_RESCALE = "t.o[r * L::LD_O + c] *= alpha;"


def _planted_case(schedule):
    """float16, three key tiles whose scores grow from tile to tile (the max moves twice)."""
    rng = np.random.default_rng(31)
    q, k, v = _inputs(rng, np.float16, 1, 4, 1, 64, 150, 32, 32)
    k = (k * np.linspace(0.5, 2.0, 150)[None, None, :, None]).astype(np.float16)
    want = _reference(q, k, v)
    with cudacpu.emulate(schedule=schedule):
        try:
            got = _run(q, k, v)
        except cudacpu.LaunchError as exc:
            return str(exc)
    error = np.abs(got[0] - want[0])
    return float(np.max(np.where(np.isnan(error), np.inf, error)))


@pytest.mark.parametrize(
    ("old", "new", "schedule", "where"),
    [
        (_BARRIER, _BARRIER.replace("__syncthreads();", ""), "shuffled", "attention.cu"),
        (_RESCALE, "", "default", "attention_tiles.cuh"),
    ],
    ids=["missing-syncthreads", "missing-rescale"],
)
def test_planted_kernel_bugs_are_caught(tmp_path, monkeypatch, old, new, schedule, where):
    tol = _o_tolerance(np.float16, 4.0)
    intact = _planted_case(schedule)
    assert isinstance(intact, float) and intact <= tol, intact
    _planted(tmp_path, monkeypatch, old, new, where)
    broken = _planted_case(schedule)
    assert isinstance(broken, str) or broken > 10 * tol, broken


_DKDV_BARRIER = """                dl[c] = di;
            }
            __syncthreads();
"""
_DQ_BARRIER = """        __syncthreads();
        if (warp_first >= nq || (causal && j0 > warp_last_pos)) continue;  // warp-uniform
"""
_GROUP_LOOP = "for (int hh = 0; hh < group; ++hh)"
_CLEAN_Q = "stride_qs, rows, d, vec_q != 0, diagonal, nullptr, 0);"
_CLEAN_K = "stride_ks, keys, d, vec_k != 0, diagonal, nullptr, 0);"


def _planted_backward_case(schedule, nan_in=None):
    """float16, GQA 4:2, causal: the largest gradient error outside what a NaN reaches.

    ``nan_in`` "q": a NaN in row 40 of head 0 (keys after 40 must stay exact);
    "k": in key 40 (rows before 40 must stay exact).
    """
    rng = np.random.default_rng(32)
    q, k, v = _inputs(rng, np.float16, 1, 4, 2, 80, 80, 16, 16)
    do = rng.standard_normal((1, 4, 80, 16)).astype(np.float16)
    options = dict(causal=True, input_pos=0, q_lengths=None, k_lengths=None)
    want = _reference_backward(q, k, v, do, **options)
    if nan_in is not None:
        {"q": q, "k": k}[nan_in][0, 0, 40, 3] = np.nan
    with cudacpu.emulate(schedule=schedule):
        try:
            got = _backward(q, k, v, do, **options)
        except cudacpu.LaunchError as exc:
            return str(exc)
    if nan_in == "q":
        got, want = [g[:, :, 41:] for g in got[1:]], [w[:, :, 41:] for w in want[1:]]
    elif nan_in == "k":
        got, want = [got[0][:, :2, :40]], [want[0][:, :2, :40]]
    errors = [np.abs(g - w) / max(1.0, float(np.abs(w).max())) for g, w in zip(got, want)]
    return max(float(np.max(np.where(np.isnan(e), np.inf, e))) for e in errors)


@pytest.mark.parametrize(
    ("old", "new", "schedule", "nan_in"),
    [
        (_DKDV_BARRIER, _DKDV_BARRIER.replace("__syncthreads();", ""), "shuffled", None),
        (_DQ_BARRIER, _DQ_BARRIER.replace("__syncthreads();", ""), "shuffled", None),
        (_GROUP_LOOP, _GROUP_LOOP.replace("group", "1"), "default", None),
        (_CLEAN_Q, _CLEAN_Q.replace("diagonal", "false"), "default", "q"),
        (_CLEAN_K, _CLEAN_K.replace("diagonal", "false"), "default", "k"),
    ],
    ids=[
        "dkdv-missing-syncthreads",
        "dq-missing-syncthreads",
        "dkdv-one-head-of-the-group",
        "dkdv-nan-query-not-cleaned",
        "dq-nan-key-not-cleaned",
    ],
)
def test_planted_backward_bugs_are_caught(tmp_path, monkeypatch, old, new, schedule, nan_in):
    tol = 16 * _eps(np.float16)
    intact = _planted_backward_case(schedule, nan_in)
    assert isinstance(intact, float) and intact <= tol, intact
    _planted(tmp_path, monkeypatch, old, new)
    broken = _planted_backward_case(schedule, nan_in)
    assert isinstance(broken, str) or broken > 10 * tol, broken


def test_launcher_and_kernel_agree_on_the_shared_memory_layout(monkeypatch):
    for t in ("float", "__half", "__nv_bfloat16"):
        for dmax in A.HEAD_DIMS:
            assert A.shared_bytes(t, dmax) <= 227 * 1024  # sm_90's opt-in limit per block
            for kernel in ("dkdv", "dq"):  # every backward block fits sm_80's (163 KiB)
                assert A.backward_shared_bytes(t, dmax, kernel) <= 163 * 1024, (t, dmax, kernel)
    assert A.shared_bytes("__half", 128) <= 163 * 1024  # sm_80's
    real = A.shared_bytes
    monkeypatch.setattr(A, "shared_bytes", lambda t, dmax: real(t, dmax) - 32)
    rng = np.random.default_rng(5)
    with cudacpu.emulate(), pytest.raises(cudacpu.LaunchError, match="__trap"):
        _run(*_inputs(rng, np.float32, 1, 1, 1, 4, 4, 16, 16))


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_backward_launcher_and_kernels_agree_on_the_shared_memory_layout(monkeypatch, kernel):
    real = A.backward_shared_bytes
    monkeypatch.setattr(
        A,
        "backward_shared_bytes",
        lambda t, dmax, which: real(t, dmax, which) - (32 if which == kernel else 0),
    )
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, np.float16, 1, 1, 1, 4, 4, 16, 16)
    options = dict(causal=False, input_pos=0, q_lengths=None, k_lengths=None)
    with cudacpu.emulate(), pytest.raises(cudacpu.LaunchError, match="__trap"):
        _backward(q, k, v, q, **options)


def test_routing_declares_what_the_kernel_serves():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, np.float32, 1, 1, 1, 4, 4, 160, 160)
    small = _inputs(rng, np.float32, 1, 1, 1, 4, 4, 16, 16)
    with cudacpu.emulate():
        with pytest.raises(BackendError, match="head dims up to 128, not 160"):
            xk.attention(q, k, v, backend="cupy")
        with pytest.raises(BackendError, match="not float64"):
            xk.attention(*(a.astype(np.float64) for a in small), backend="cupy")
        assert xk.attention(*small).shape == (1, 1, 4, 16)  # NumPy's automatic route: array_api


def test_launcher_needs_neither_torch_nor_triton_and_cpu_runs_import_no_cupy():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import numpy as np\n"
        "from xpkernels.backends.cupy import attention\n"
        "from xpkernels.testing import cudacpu\n"
        "q = np.ones((1, 1, 3, 16), np.float16); o = np.empty_like(q)\n"
        "with cudacpu.emulate():\n"
        "    attention.forward(o, q, q, q, None, None, scale=0.25, causal=True, input_pos=0,\n"
        "                      q_lengths=None, k_lengths=None)\n"
        "assert 'cupy' not in sys.modules, 'the CPU path imported cupy'\n"
        "print(float(o.astype(np.float32).sum()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == 48.0


SANITIZED_RUN = """
import math, os, numpy as np, ml_dtypes
from xpkernels.backends.cupy import attention as A
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
sanitizer = os.environ["XPKERNELS_CUDACPU_SANITIZE"]
with cudacpu.emulate():
    for t, d in ((np.float16, 64), (ml_dtypes.bfloat16, 40), (np.float32, 128)):
        shapes = ((1, 2, 70, d), (1, 1, 70, d), (1, 1, 70, d), (1, 2, 70, d), (1, 2, 70))
        q, k, v, o, m, l = (cudacpu.empty(s, t if len(s) == 4 else np.float32) for s in
                            (*shapes[:4], shapes[4], shapes[4]))
        for a in (q, k, v):
            a[...] = rng.standard_normal(a.shape)
        options = dict(scale=1 / math.sqrt(d), causal=True, input_pos=0, q_lengths=None,
                       k_lengths=np.array([66], np.int32))
        A.forward(o, q, k, v, m, l, **options)
        assert np.isfinite(o.astype(np.float32)).all()
        # The backward: float16 (bfloat16's wmma path is the same) under both sanitizers, the
        # SIMT float32 path (its in-place P and dS, the largest layout) under ASan only (TSan's
        # threads make it ~30 s).
        if t is ml_dtypes.bfloat16 or (t is np.float32 and sanitizer == "thread"):
            continue
        do, dq, dk, dv = (cudacpu.empty(a.shape, t) for a in (o, q, k, v))
        do[...] = rng.standard_normal(do.shape)
        delta = cudacpu.empty(shapes[4], np.float32)
        A.backward(do, q, k, v, o, m, l, dq, dk, dv, delta, None, **options)
        assert all(np.isfinite(g.astype(np.float32)).all() for g in (dq, dk, dv))
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_kernel_runs_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_builds_every_instantiation_on_tensor_cores_without_spills(arch):
    report = nvrtc_report()
    entry = report.compile_source(A.SOURCE, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(A.name_expressions())
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        if name == A.DELTA_KERNEL:  # rowsum(do * o): scalar loads of any float dtype, no products
            assert k["tensor_core"] == "none", (name, k)
            continue
        sixteen_bit = re.match(r"attention_\w+<(__half|__nv_bfloat16),", name) is not None
        assert k["tensor_core"] == ("wmma" if sixteen_bit else "none"), (name, k)
        assert k["global_load_bits"] == 128, (name, k)  # 16-byte staging loads of Q, K, V
