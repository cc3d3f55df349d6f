"""The Triton attention and decode-attention kernels against naive float64 references.

Without a CUDA device the kernels run on CPU tensors through the Triton
interpreter (``TRITON_INTERPRET=1`` is set before any kernel is defined), so
shapes stay tiny; they still cross the 16-wide interpreter tiles, with odd
sizes, GQA, causal masks, per-batch lengths and positions, fully masked rows,
BSHD views and NaN-filled outputs that must be overwritten. With a CUDA
device the same tests run on it.

These call the backend modules directly (validated bare tensors, as the
front files pass them); the generic conformance suite covers the front.
"""

from __future__ import annotations

import importlib.util
import os
import zlib

import numpy as np
import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("the triton backend needs torch and triton", allow_module_level=True)

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip(
            "CPU tensors need TRITON_INTERPRET=1 for Triton kernels", allow_module_level=True
        )

from xpkernels.backends.triton import attention as tri_attention
from xpkernels.backends.triton import decode_attention as tri_decode

from xpkernels.testing import references as ref
from xpkernels.testing.host_reads import no_host_reads
from xpkernels.testing.tolerances import floor

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TOL = {t: floor("attention", "forward", name) for t, name in _DTYPE_NAMES.items()}
BACKWARD_TOL = {t: floor("attention", "backward", name) for t, name in _DTYPE_NAMES.items()}


def _err(actual, expected):
    """``max|a - e| / max(max|e|, 1)`` over finite references; inf on any NaN."""
    a = actual.detach().cpu().double().numpy()
    e = np.asarray(expected, dtype=np.float64)
    both_inf = np.isinf(e) & (a == e)
    diff = np.abs(np.where(both_inf, 0.0, a) - np.where(both_inf, 0.0, e))
    if np.isnan(diff).any():
        return float("inf")
    scale = max(float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)), 1.0)
    return float(np.max(diff, initial=0.0)) / scale


def reference_attention(q, k, v, do, *, scale, causal, input_pos, q_lengths, k_lengths):
    """Float64 ``o, m, l`` and ``dq, dk, dv`` from the full score matrix (xpkernels.testing.references)."""
    q, k, v, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, do))
    keep = ref.attention_keep(
        q.shape[0],
        q.shape[2],
        k.shape[2],
        causal=causal,
        input_pos=input_pos,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
    )
    o, m, l, _ = ref.attention(q, k, v, scale=scale, keep=keep)
    dq, dk, dv = ref.attention_backward(q, k, v, do, scale=scale, keep=keep)
    return {"o": o, "m": m, "l": l}, {"q": dq, "k": dk, "v": dv}


def _tensor(a, dtype, bshd=False):
    """``a`` (B, H, S, D) on DEVICE; with ``bshd`` a view of a (B, S, H, D) buffer."""
    t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    if bshd:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(DEVICE)


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _int(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


ATTN_CASES = [
    # id, B, H, Hkv, Sq, Sk, D, Dv, causal, input_pos, q_lengths, k_lengths, bshd
    ("plain-odd", 1, 2, 2, 19, 23, 16, 16, False, 0, None, None, False),
    ("causal-gqa", 2, 4, 2, 33, 33, 16, 16, True, 0, None, None, False),
    ("causal-pos-chunk", 1, 2, 1, 17, 40, 32, 16, True, 21, None, None, False),
    ("lengths-posarray", 2, 2, 1, 20, 35, 16, 24, True, [3, 15], [20, 9], [35, 18], False),
    ("fully-masked", 2, 2, 2, 18, 17, 8, 8, False, 0, [18, 5], [0, 17], False),
    ("bshd-views", 2, 3, 1, 21, 26, 16, 16, True, [5, 0], None, [26, 7], True),
]


def _attn_inputs(case, dtype, rng):
    _, B, H, Hkv, Sq, Sk, D, Dv, causal, pos, ql, kl, bshd = case
    raw = {
        "q": rng.standard_normal((B, H, Sq, D)),
        "k": rng.standard_normal((B, Hkv, Sk, D)),
        "v": rng.standard_normal((B, Hkv, Sk, Dv)),
        "do": rng.standard_normal((B, H, Sq, Dv)),
    }
    tensors = {name: _tensor(a, dtype, bshd) for name, a in raw.items()}
    exact = {name: t.double().cpu().numpy() for name, t in tensors.items()}
    opts = {
        "scale": 1.0 / np.sqrt(D),
        "causal": causal,
        "input_pos": pos if isinstance(pos, int) else _int(pos),
        "q_lengths": None if ql is None else _int(ql),
        "k_lengths": None if kl is None else _int(kl),
    }
    ref_opts = {**opts, "input_pos": pos, "q_lengths": ql, "k_lengths": kl}
    return tensors, exact, opts, ref_opts


def _run_forward(tensors, opts, with_stats=True):
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    B, H, Sq, _ = q.shape
    o = _nan_like(torch.empty(B, H, Sq, v.shape[-1], dtype=q.dtype, device=DEVICE))
    m = l = None
    if with_stats:
        m = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=DEVICE)
        l = torch.full_like(m, float("nan"))
    tri_attention.forward(o, q, k, v, m, l, **opts)
    return o, m, l


def _run_backward(tensors, o, m, l, opts):
    q, k, v, do = tensors["q"], tensors["k"], tensors["v"], tensors["do"]
    grads = {"q": _nan_like(q), "k": _nan_like(k), "v": _nan_like(v)}
    delta = torch.full(m.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    dq_accum = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    tri_attention.backward(
        do, q, k, v, o, m, l, grads["q"], grads["k"], grads["v"], delta, dq_accum, **opts
    )
    return grads


ATTN_PARAMS = [
    pytest.param(case, dtype, id=f"{case[0]}-{name}")
    for case in ATTN_CASES
    for dtype, name in ((torch.float32, "float32"), (torch.float16, "float16"))
] + [pytest.param(ATTN_CASES[3], torch.bfloat16, id=f"{ATTN_CASES[3][0]}-bfloat16")]


@pytest.mark.parametrize("case,dtype", ATTN_PARAMS)
def test_attention_forward_and_backward_match_reference(case, dtype):
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    tensors, exact, opts, ref_opts = _attn_inputs(case, dtype, rng)
    ref_out, ref_grad = reference_attention(
        exact["q"], exact["k"], exact["v"], exact["do"], **ref_opts
    )

    o, m, l = _run_forward(tensors, opts)
    assert _err(o, ref_out["o"]) <= TOL[dtype], "o"
    assert _err(m, ref_out["m"]) <= 2e-5, "checkpoint m"
    assert _err(l, ref_out["l"]) <= max(2e-5, TOL[dtype]), "checkpoint l"

    o_inference, _, _ = _run_forward(tensors, opts, with_stats=False)
    assert torch.equal(o_inference, o), "forward without checkpoints gives the same output"

    # The backward from the reference's own state isolates it from the forward.
    ref_state = {
        "o": _tensor(ref_out["o"], dtype, case[-1]),
        "m": torch.from_numpy(ref_out["m"]).float().to(DEVICE),
        "l": torch.from_numpy(ref_out["l"]).float().to(DEVICE),
    }
    grads = _run_backward(tensors, ref_state["o"], ref_state["m"], ref_state["l"], opts)
    for name in ("q", "k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[dtype], f"d{name}"

    own = _run_backward(tensors, o, m, l, opts)
    for name in ("q", "k", "v"):
        assert _err(own[name], ref_grad[name]) <= BACKWARD_TOL[dtype], f"d{name}, own checkpoints"


def test_fully_masked_rows_are_zero_with_infinite_max():
    case = ATTN_CASES[4]
    rng = np.random.default_rng(7)
    tensors, _, opts, _ = _attn_inputs(case, torch.float32, rng)
    o, m, l = _run_forward(tensors, opts)
    # batch 0 has no keys: every row is fully masked; batch 1 has 5 valid queries.
    assert torch.all(o[0] == 0) and torch.all(torch.isneginf(m[0])) and torch.all(l[0] == 0)
    assert torch.all(o[1, :, 5:] == 0) and torch.all(l[1, :, 5:] == 0)
    assert torch.all(torch.isneginf(m[1, :, 5:]))
    assert torch.all(torch.isfinite(m[1, :, :5])) and torch.all(l[1, :, :5] > 0)
    grads = _run_backward(tensors, o, m, l, opts)
    assert all(torch.all(grads[name][0] == 0) for name in ("q", "k", "v"))
    assert torch.all(grads["q"][1, :, 5:] == 0)
    assert not any(torch.isnan(g).any() for g in grads.values())


def test_backward_is_deterministic():
    case = ATTN_CASES[1]
    rng = np.random.default_rng(3)
    tensors, _, opts, _ = _attn_inputs(case, torch.float16, rng)
    o, m, l = _run_forward(tensors, opts)
    first = _run_backward(tensors, o, m, l, opts)
    second = _run_backward(tensors, o, m, l, opts)
    for name in ("q", "k", "v"):
        assert torch.equal(first[name], second[name]), name


def reference_decode(q, k, v, lengths, scale):
    """Float64 decode attention: one query per (b, h) over keys ``< lengths[b]``."""
    return ref.decode_attention(q, k, v, np.asarray(lengths), scale=scale)


DECODE_CASES = [
    # id, B, H, Hkv, Smax, D, Dv, lengths, n_splits
    ("one-split", 2, 2, 2, 37, 16, 16, [37, 20], 1),
    ("splits-gqa", 2, 8, 2, 70, 16, 24, [70, 33], 3),
    ("more-splits-than-tiles", 3, 4, 1, 40, 8, 8, [1, 0, 40], 5),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"]
)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_matches_reference(case, dtype):
    _, B, H, Hkv, Smax, D, Dv, lengths, n_splits = case
    rng = np.random.default_rng(11)
    q = torch.from_numpy(rng.standard_normal((B, H, D))).to(dtype).to(DEVICE)
    k = _tensor(rng.standard_normal((B, Hkv, Smax, D)), dtype)
    v = _tensor(rng.standard_normal((B, Hkv, Smax, Dv)), dtype)
    lens = _int(lengths)
    o = torch.full((B, H, Dv), float("nan"), dtype=dtype, device=DEVICE)
    o_partial = torch.full((B, H, n_splits, Dv), float("nan"), dtype=torch.float32, device=DEVICE)
    m_partial = torch.full((B, H, n_splits), float("nan"), dtype=torch.float32, device=DEVICE)
    l_partial = torch.full_like(m_partial, float("nan"))
    scale = 1.0 / np.sqrt(D)
    tri_decode.forward(o, q, k, v, lens, o_partial, m_partial, l_partial, scale=scale)
    ref = reference_decode(*(t.double().cpu().numpy() for t in (q, k, v)), lengths, scale)
    assert _err(o, ref) <= TOL[dtype]
    assert torch.all(o[np.array(lengths) == 0] == 0)


def test_decode_equals_causal_attention_of_last_query():
    rng = np.random.default_rng(5)
    B, H, Hkv, Smax, D = 2, 4, 2, 45, 16
    k = _tensor(rng.standard_normal((B, Hkv, Smax, D)), torch.float32)
    v = _tensor(rng.standard_normal((B, Hkv, Smax, D)), torch.float32)
    q = torch.from_numpy(rng.standard_normal((B, H, D))).float().to(DEVICE)
    lengths = [45, 30]
    n_splits = tri_decode.default_splits(B, Hkv, Smax, k)
    o = torch.empty(B, H, D, device=DEVICE)
    partial = torch.empty(B, H, n_splits, D, device=DEVICE)
    m_partial = torch.empty(B, H, n_splits, device=DEVICE)
    l_partial = torch.empty(B, H, n_splits, device=DEVICE)
    tri_decode.forward(o, q, k, v, _int(lengths), partial, m_partial, l_partial, scale=0.25)
    o_attn = torch.empty(B, H, 1, D, device=DEVICE)
    tri_attention.forward(
        o_attn,
        q[:, :, None, :],
        k,
        v,
        None,
        None,
        scale=0.25,
        causal=True,
        input_pos=_int([n - 1 for n in lengths]),
        q_lengths=None,
        k_lengths=_int(lengths),
    )
    assert _err(o, o_attn[:, :, 0].double().cpu().numpy()) <= 1e-5


def test_default_splits_is_bounded_by_keys_and_fills_the_device():
    k = torch.empty(1, 1, 1, 16, device=DEVICE)
    assert tri_decode.default_splits(16, 8, 1, k) == 1
    assert tri_decode.default_splits(1, 1, 0, k) == 1
    many = tri_decode.default_splits(1, 1, 1 << 20, k)
    few = tri_decode.default_splits(64, 8, 1 << 20, k)
    assert 1 <= few <= many


# Compiles every kernel for sm_90 (Hopper) in a fresh process without the
# interpreter: catches what only the compiler checks (constexpr globals, loop
# types, shared memory) on a machine with no GPU. Triton's wheel ships ptxas.
_SM90_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from xpkernels.backends.triton import attention as A, decode_attention as DA

LIMIT = 227 * 1024
common = dict(HAS_QLEN=True, HAS_KLEN=True, POS_ARRAY=True, PRECISION="tf32",
              DOT_TYPE=triton.language.bfloat16, BLOCK_D=128, BLOCK_DV=128, CAUSAL=True,
              STORE_STATS=True, EVEN_D=False, EVEN_DV=True, BLOCK_G=16, BLOCK_S=16,
              PAGED=True, PAGE_SIZE=16, HAS_WINDOW=True, HAS_SOFTCAP=True, SPLIT=False,
              VARLEN=False)
kernels = [
    (A._forward_kernel, A._FORWARD_TILES.default[128]),
    (A._dkdv_kernel, A._DKDV_TILES.default[128]),
    (A._dq_kernel, A._DQ_TILES.default[128]),
    (A._delta_kernel, A._FORWARD_TILES.default[128]),
    (DA._split_kernel, DA._SPLIT_TILES.default[128]),
    (DA._combine_kernel, DA._SPLIT_TILES.default[128]),
]
for fn, tile in kernels:
    meta = {**common, **tile.blocks(), "BLOCK_M": tile.block_m or 64}
    constexprs = {name: meta[name] for name in fn.arg_names if name in meta}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("m_ptr", "l_ptr", "delta_ptr", "o_part_ptr", "m_part_ptr", "l_part_ptr"):
            signature[name] = "*fp32"
        elif name in ("q_len_ptr", "k_len_ptr", "pos_ptr", "lengths_ptr", "bt_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        elif name in ("scale", "qk_scale", "softcap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
    )
    shared = compiled.metadata.shared
    print(fn.__name__, "shared", shared)
    if shared > LIMIT:
        sys.exit(f"{fn.__name__}: {shared} bytes of shared memory > {LIMIT}")
"""


def test_kernels_compile_for_hopper():
    import subprocess
    import sys

    pytest.importorskip(
        "triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend"
    )

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in (
        "_forward_kernel",
        "_dkdv_kernel",
        "_dq_kernel",
        "_delta_kernel",
        "_split_kernel",
        "_combine_kernel",
    ):
        assert f"{name} shared" in run.stdout


@pytest.mark.parametrize("block_d,cls", [(16, 64), (64, 64), (128, 128), (256, 256)])
def test_tile_search_tries_only_its_head_dim_class(block_d, cls):
    for tuned, table in (
        (tri_attention._forward_tuned, tri_attention._FORWARD_TILES),
        (tri_attention._dkdv_tuned, tri_attention._DKDV_TILES),
        (tri_attention._dq_tuned, tri_attention._DQ_TILES),
        (tri_decode._split_tuned, tri_decode._SPLIT_TILES),
    ):
        tried = tuned.early_config_prune(tuned.configs, {}, BLOCK_D=block_d)
        expected = [tile.config().all_kwargs() for tile in table.candidates[cls]]
        assert [c.all_kwargs() for c in tried] == expected


def _rows_match(actual, expected, tol, what):
    """Finite where the reference is finite, NaN where it is NaN, within ``tol`` elsewhere."""
    a = actual.detach().cpu().double().numpy()
    e = np.asarray(expected, dtype=np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(e)), f"{what}: NaN pattern differs"
    keep = ~np.isnan(e)
    assert _err(torch.from_numpy(np.where(keep, a, 0.0)), np.where(keep, e, 0.0)) <= tol, what


def _forward_backward(q, k, v, do, **opts):
    """Forward with checkpoints, then the backward from them; the tensors are float32 on DEVICE."""
    tensors = {"q": q, "k": k, "v": v, "do": do}
    o, m, l = _run_forward(tensors, opts)
    return (o, m, l), _run_backward(tensors, o, m, l, opts)


def _small(rng, B, H, Hkv, Sq, Sk, D=16):
    arrays = (
        rng.standard_normal((B, H, Sq, D)),
        rng.standard_normal((B, Hkv, Sk, D)),
        rng.standard_normal((B, Hkv, Sk, D)),
        rng.standard_normal((B, H, Sq, D)),
    )
    return [np.asarray(a) for a in arrays]


def _check_against(raw, ref_opts, opts, nan_rows=None):
    """Triton (float32) vs the float64 reference on ``raw`` with non-finite inputs zeroed.

    ``nan_rows`` (B, H, Sq) bool: the query rows whose o, m, l and dq must be NaN;
    every other query row must match the clean reference.
    """
    q, k, v, do = (_tensor(a, torch.float32) for a in raw)
    (o, m, l), grads = _forward_backward(q, k, v, do, **opts)
    clean = [np.where(np.isfinite(a), a, 0.0) for a in raw]
    ref_out, ref_grad = reference_attention(*clean, scale=opts["scale"], **ref_opts)
    nan_rows = np.zeros(o.shape[:3], dtype=bool) if nan_rows is None else nan_rows
    for name, got, want in (("o", o, ref_out["o"]), ("dq", grads["q"], ref_grad["q"])):
        assert torch.isnan(got).any(-1).numpy().tolist() == nan_rows.tolist(), f"{name}: NaN rows"
        _rows_match(
            got[torch.from_numpy(~nan_rows)], want[~nan_rows], BACKWARD_TOL[torch.float32], name
        )
    for name, got, want in (("m", m, ref_out["m"]), ("l", l, ref_out["l"])):
        assert torch.isnan(got).numpy().tolist() == nan_rows.tolist(), f"{name}: NaN rows"
        _rows_match(got[torch.from_numpy(~nan_rows)], want[~nan_rows], 2e-5, name)
    return grads, ref_grad


@pytest.mark.parametrize(
    "pos",
    [-17, [-3, -40], [-(2**40), 2**40], -(2**40), 2**40],
    ids=["int", "array", "huge-array", "huge-int-negative", "huge-int"],
)
def test_negative_and_huge_input_pos(pos):
    """Bottom-right alignment ``input_pos = Sk - Sq`` (< 0): queries before key 0 see nothing.

    Positions of any int64 size (Python ints, int64 tensors) equal the clamped ones.
    """
    rng = np.random.default_rng(101)
    raw = _small(rng, 2, 2, 1, 40, 23)
    pos_t = torch.tensor(pos, dtype=torch.int64, device=DEVICE) if isinstance(pos, list) else pos
    opts = {"scale": 0.25, "causal": True, "input_pos": pos_t, "q_lengths": None, "k_lengths": None}
    ref_pos = np.clip(np.broadcast_to(np.asarray(pos, dtype=np.int64), (2,)), -40, 23)
    grads, ref_grad = _check_against(
        raw, {"causal": True, "input_pos": ref_pos, "q_lengths": None, "k_lengths": None}, opts
    )
    for name in ("k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[torch.float32], f"d{name}"


def test_out_of_range_device_lengths_are_clamped_in_the_kernels():
    """int64 lengths past int32 or below 0 (front checks bypassed): clamped to [0, S], never wrapped."""
    rng = np.random.default_rng(103)
    raw = _small(rng, 4, 2, 2, 18, 20)
    big = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    opts = {
        "scale": 0.25,
        "causal": True,
        "input_pos": big([2, 2**33 + 1, -(2**33), 0]),
        "q_lengths": big([2**32 + 3, 18, 18, -(2**32) + 7]),
        "k_lengths": big([2**32 + 5, 20, 20, -(2**32) + 9]),
    }
    ref = {
        "causal": True,
        "input_pos": [2, 20, -18, 0],
        "q_lengths": [18, 18, 18, 0],
        "k_lengths": [20, 20, 20, 0],
    }
    grads, ref_grad = _check_against(raw, ref, opts)
    for name in ("k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[torch.float32], f"d{name}"


@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_key_or_value_reaches_only_the_rows_that_see_it(where):
    """Causal: rows before a NaN key/value (inside a masked diagonal tile) stay finite and exact."""
    rng = np.random.default_rng(107)
    raw = _small(rng, 1, 2, 1, 20, 20)
    raw[1 if where == "k" else 2][0, 0, 9, 5] = np.nan
    nan_rows = np.zeros((1, 2, 20), dtype=bool)
    nan_rows[:, :, 9:] = True
    opts = {"scale": 0.25, "causal": True, "input_pos": 0, "q_lengths": None, "k_lengths": None}
    ref = {"causal": True, "input_pos": 0, "q_lengths": None, "k_lengths": None}
    if where == "v":  # a NaN value leaves the scores, so m and l, finite
        q, k, v, do = (_tensor(a, torch.float32) for a in raw)
        (o, m, l), grads = _forward_backward(q, k, v, do, **opts)
        assert torch.isnan(o).any(-1).numpy().tolist() == nan_rows.tolist()
        assert torch.isfinite(m).all() and torch.isfinite(l).all()
        assert torch.isnan(grads["q"]).any(-1).numpy().tolist() == nan_rows.tolist()
        ref_out, ref_grad = reference_attention(
            *(np.nan_to_num(a, nan=0.0) for a in raw), scale=0.25, **ref
        )
        _rows_match(o[:, :, :9], ref_out["o"][:, :, :9], TOL[torch.float32], "o")
        _rows_match(
            grads["q"][:, :, :9], ref_grad["q"][:, :, :9], BACKWARD_TOL[torch.float32], "dq"
        )
        return
    _check_against(raw, ref, opts, nan_rows)


def test_nan_past_the_lengths_is_never_seen():
    rng = np.random.default_rng(109)
    raw = _small(rng, 2, 2, 1, 17, 21)
    raw[1][0, :, 12:] = np.nan
    raw[2][1, :, 5:] = np.inf
    raw[0][1, :, 9:] = np.nan
    opts = {
        "scale": 0.25,
        "causal": True,
        "input_pos": _int([4, -2]),
        "q_lengths": _int([17, 9]),
        "k_lengths": _int([12, 5]),
    }
    ref = {"causal": True, "input_pos": [4, -2], "q_lengths": [17, 9], "k_lengths": [12, 5]}
    grads, ref_grad = _check_against(raw, ref, opts)
    for name in ("k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[torch.float32], f"d{name}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [16, 256], ids=["d16", "d256-split"])
def test_nan_in_one_query_row_affects_only_that_row(causal, D):
    """NaN in q[0, 1, 3]: that row's o, m, l, dq are NaN, dk/dv of the keys it sees; nothing else.

    At D=256 dK and dV come from separate programs, causal ones masking every query tile."""
    rng = np.random.default_rng(113)
    raw = _small(rng, 1, 2, 1, 20, 20, D)
    raw[0][0, 1, 3, 2] = np.nan
    nan_rows = np.zeros((1, 2, 20), dtype=bool)
    nan_rows[0, 1, 3] = True
    opts = {"scale": 0.25, "causal": causal, "input_pos": 0, "q_lengths": None, "k_lengths": None}
    ref = {"causal": causal, "input_pos": 0, "q_lengths": None, "k_lengths": None}
    grads, ref_grad = _check_against(raw, ref, opts, nan_rows)
    seen = np.arange(20) <= 3 if causal else np.ones(20, dtype=bool)
    for name in ("k", "v"):
        got = grads[name][0, 0]
        assert torch.isnan(got).any(-1).numpy().tolist() == seen.tolist(), f"d{name}: NaN keys"
        if causal:
            _rows_match(got[4:], ref_grad[name][0, 0, 4:], BACKWARD_TOL[torch.float32], f"d{name}")


def test_decode_clamps_out_of_range_device_lengths():
    rng = np.random.default_rng(127)
    B, H, Smax, D, n_splits = 3, 2, 21, 16, 3
    q = torch.from_numpy(rng.standard_normal((B, H, D))).float().to(DEVICE)
    k = _tensor(rng.standard_normal((B, 1, Smax, D)), torch.float32)
    v = _tensor(rng.standard_normal((B, 1, Smax, D)), torch.float32)
    lengths = torch.tensor([2**32 + 3, -(2**33), 9], dtype=torch.int64, device=DEVICE)
    o = torch.full((B, H, D), float("nan"), device=DEVICE)
    scratch = [
        torch.full(shape, float("nan"), device=DEVICE)
        for shape in ((B, H, n_splits, D), (B, H, n_splits), (B, H, n_splits))
    ]
    tri_decode.forward(o, q, k, v, lengths, *scratch, scale=0.25)
    ref = reference_decode(*(t.double().cpu().numpy() for t in (q, k, v)), [Smax, 0, 9], 0.25)
    assert _err(o, ref) <= TOL[torch.float32]


def test_front_bottom_right_alignment_on_triton_equals_array_api():
    """Through the front (``backend="triton"``): ``input_pos = Sk - Sq`` < 0, as the array_api backend computes it."""
    import xpkernels as xk

    rng = np.random.default_rng(131)
    q, k, v, do = (torch.from_numpy(a).float().to(DEVICE) for a in _small(rng, 1, 2, 1, 24, 9))
    results = {}
    for backend in ("triton", "array_api"):
        if backend == "array_api" and DEVICE != "cpu":
            q, k, v, do = (t.cpu() for t in (q, k, v, do))
        ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
        o = xk.attention(q, k, v, causal=True, input_pos=9 - 24, checkpoints=ck, backend=backend)
        grads = xk.attention_backward(
            do, q, k, v, o, checkpoints=ck, causal=True, input_pos=9 - 24, backend=backend
        )
        results[backend] = [t.cpu() for t in (o, ck.m, ck.l, *grads)]
    for name, a, b in zip(("o", "m", "l", "dq", "dk", "dv"), *results.values(), strict=True):
        assert _err(a, b.double().numpy()) <= BACKWARD_TOL[torch.float32], name
    assert torch.all(results["triton"][0][:, :, :15] == 0) and torch.all(
        results["triton"][3][:, :, :15] == 0
    )


def _record_launches(monkeypatch):
    """On CPU (the interpreter copies every argument to the host) record launches instead of running them."""
    launched = []
    if DEVICE == "cuda":
        return launched

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append(args)

    def launch(kernel, tuned, table, grid, args, meta, work, like):
        launched.append(args)

    for module, direct in ((tri_attention, "_delta_kernel"), (tri_decode, "_combine_kernel")):
        monkeypatch.setattr(module, "launch", launch)
        monkeypatch.setattr(module, direct, Kernel())
    return launched


def test_in_place_calls_read_no_device_integer_on_the_host(monkeypatch):
    """Capture safety: with every buffer supplied, lengths and input_pos reach the kernels unread."""
    import xpkernels as xk
    from xpkernels.buffers import Duplicated

    launched = _record_launches(monkeypatch)
    rng = np.random.default_rng(137)
    q, k, v, do = (torch.from_numpy(a).float().to(DEVICE) for a in _small(rng, 2, 2, 1, 9, 11))
    guarded = {
        name: no_host_reads(torch.tensor(values, device=DEVICE))
        for name, values in (
            ("input_pos", [3, -2]),
            ("q_lengths", [9, 99]),
            ("k_lengths", [-1, 2**40]),
        )
    }
    o = torch.empty_like(q)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, causal=True, checkpoints=ck, backend="triton", **guarded)
    shadows = [torch.empty_like(a) for a in (q, k, v)]
    args = (Duplicated(o, do), *map(Duplicated, (q, k, v), shadows))
    scratch = xk.allocate_scratchspace(xk.attention_backward_, *args)
    xk.attention_backward_(
        *args, checkpoints=ck, scratch=scratch, causal=True, backend="triton", **guarded
    )
    lengths = no_host_reads(torch.tensor([11, 2**33], device=DEVICE))
    o_dec = torch.empty(2, 2, 16, device=DEVICE)
    dec_scratch = xk.allocate_scratchspace(xk.decode_attention_, o_dec, q[:, :, 0], k, n_splits=2)
    xk.decode_attention_(o_dec, q[:, :, 0], k, v, lengths, scratch=dec_scratch, backend="triton")
    if DEVICE == "cpu":
        passed = {id(a) for args in launched for a in args if isinstance(a, torch.Tensor)}
        assert len(launched) == 6 and {id(t) for t in (*guarded.values(), lengths)} <= passed


ODD_HEAD_CASES = [
    # id, B, H, Hkv, Sq, Sk, D, Dv, causal, input_pos, q_lengths, k_lengths, bshd
    ("d40-dv80-causal-gqa", 1, 2, 1, 18, 20, 40, 80, True, [2], [17], [19], False),
    ("d96-dv111-full", 1, 1, 1, 17, 19, 96, 111, False, 0, None, [13], False),
    ("d111-dv40-causal", 1, 2, 2, 17, 18, 111, 40, True, 1, None, None, True),
    ("d80-dv96-causal", 1, 1, 1, 19, 17, 80, 96, True, 0, [15], None, False),
    # head-dim class 256: dK/dV split over a dV and a dK program per key tile
    ("d200-dv256-full-gqa", 2, 2, 1, 19, 37, 200, 256, False, 0, [19, 6], [37, 21], False),
]


@pytest.mark.parametrize(
    "case,dtype",
    [
        pytest.param(c, torch.float16 if i % 2 else torch.float32, id=c[0])
        for i, c in enumerate(ODD_HEAD_CASES)
    ],
)
def test_odd_head_dims_use_the_masked_head_dim_variant(case, dtype):
    """Head dims 40/80/96/111/200 pad to a power-of-two tile (EVEN_D/EVEN_DV false): the
    padded columns must stay out of every product and every store of the backward."""
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    tensors, exact, opts, ref_opts = _attn_inputs(case, dtype, rng)
    ref_out, ref_grad = reference_attention(
        exact["q"], exact["k"], exact["v"], exact["do"], **ref_opts
    )
    o, m, l = _run_forward(tensors, opts)
    assert _err(o, ref_out["o"]) <= TOL[dtype], "o"
    grads = _run_backward(tensors, o, m, l, opts)
    for name in ("q", "k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[dtype], f"d{name}"


# The transposed split kernel (s^T = K q^T, o^T += V^T p^T): GQA groups of 1, 4 and 8
# query heads (padded to the 16 columns of both dots), even and odd head dims (the
# q tile masked on D only when odd), several splits with a partial last tile.
TRANSPOSED_DECODE_CASES = [
    # id, H, Hkv, D, Dv
    ("group1-odd-d", 3, 3, 20, 12),
    ("group4-even-d", 8, 2, 32, 32),
    ("group8-odd-d", 16, 2, 24, 40),
    ("group8-even-d", 8, 1, 16, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "case", TRANSPOSED_DECODE_CASES, ids=[c[0] for c in TRANSPOSED_DECODE_CASES]
)
def test_decode_groups_and_head_dims_match_reference(case, dtype):
    _, H, Hkv, D, Dv = case
    B, Smax, n_splits, lengths = 2, 53, 3, [53, 18]
    rng = np.random.default_rng(17)
    q = torch.from_numpy(rng.standard_normal((B, H, D))).to(dtype).to(DEVICE)
    k = _tensor(rng.standard_normal((B, Hkv, Smax, D)), dtype)
    v = _tensor(rng.standard_normal((B, Hkv, Smax, Dv)), dtype)
    o = torch.full((B, H, Dv), float("nan"), dtype=dtype, device=DEVICE)
    o_partial = torch.full((B, H, n_splits, Dv), float("nan"), dtype=torch.float32, device=DEVICE)
    m_partial = torch.full((B, H, n_splits), float("nan"), dtype=torch.float32, device=DEVICE)
    l_partial = torch.full_like(m_partial, float("nan"))
    scale = 1.0 / np.sqrt(D)
    tri_decode.forward(o, q, k, v, _int(lengths), o_partial, m_partial, l_partial, scale=scale)
    ref = reference_decode(*(t.double().cpu().numpy() for t in (q, k, v)), lengths, scale)
    assert _err(o, ref) <= TOL[dtype]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_backward_with_the_compiled_default_tiles(monkeypatch, causal):
    """The 2-byte D=256 backward at its sm_90 default tiles (dQ: 64 query rows, 16-key
    steps; dK/dV: 64 keys, split over a dV and a dK program), not the
    interpreter's 16 x 16 ones: query tiles past the rows and, causal, 64-row tiles
    crossing the diagonal in 16-key steps."""
    from xpkernels.backends.triton import _attn_common

    monkeypatch.setattr(_attn_common, "interpreted", lambda: False)
    assert tri_attention._DQ_TILES.choose(256, 2).block_m == 64
    assert tri_attention.dkdv_split(256)
    assert tri_attention._DKDV_SPLIT_TILES.choose(256, 2).block_n == 64
    case = ("d256", 1, 2, 1, 80, 80, 256, 256, causal, 0, None, None, False)
    rng = np.random.default_rng(256 + causal)
    tensors, exact, opts, ref_opts = _attn_inputs(case, torch.float16, rng)
    ref_out, ref_grad = reference_attention(
        exact["q"], exact["k"], exact["v"], exact["do"], **ref_opts
    )
    state = [
        _tensor(ref_out["o"], torch.float16),
        *(torch.from_numpy(ref_out[s]).float().to(DEVICE) for s in ("m", "l")),
    ]
    grads = _run_backward(tensors, *state, opts)
    for name in ("q", "k", "v"):
        assert _err(grads[name], ref_grad[name]) <= BACKWARD_TOL[torch.float16], f"d{name}"
