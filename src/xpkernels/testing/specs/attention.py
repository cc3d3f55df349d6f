"""Attention conformance declaration.

The float64 reference materialises the full ``(B, H, Sq, Sk)`` score matrix
with its mask (no tiling); the PyTorch oracle is
``F.scaled_dot_product_attention`` (``enable_gqa``; ``is_causal`` or an
explicit boolean mask), whose NaN rows for fully masked queries count as 0,
with gradients from float64 autograd over a naive materialised version.
"""

from __future__ import annotations

import math

import numpy as np

import xpkernels as xk
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, ErrorCase, OpSpec

from ._shared import (
    add_positions,
    attention_backward_calls,
    attention_calls,
    bshd,
    checked_case,
    host_ints,
)
from ._shared import scale_of as _scale

_BASE = {
    "B": 1,
    "H": 2,
    "Hkv": 2,
    "Sq": 16,
    "Sk": 16,
    "D": 16,
    "Dv": None,
    "causal": False,
    "scale": None,
    "input_pos": 0,
    "q_lengths": None,
    "k_lengths": None,
    "layout": "bhsd",
    "score": None,
}


def _case(ident, interpreter=False, quick=False, **params):
    return checked_case("attention", ident, _BASE, params, interpreter, quick)


CASES = [
    _case("b2-mha-s40-d16", True, B=2, Sq=40, Sk=40),
    _case("causal-s70-d40", True, Sq=70, Sk=70, D=40, causal=True),
    _case("gqa2-causal-b2-s80-d64", True, True, B=2, H=4, Hkv=2, Sq=80, Sk=80, D=64, causal=True),
    _case("mqa4-sq-lt-sk-pos57", True, H=4, Hkv=1, Sq=20, Sk=77, causal=True, input_pos=57),
    _case(
        "lengths-per-batch", True, B=2, Hkv=1, Sq=67, Sk=72, q_lengths=[67, 30], k_lengths=[72, 41]
    ),
    _case(
        "fully-masked-rows",
        True,
        B=3,
        Sq=9,
        Sk=66,
        causal=True,
        input_pos=[0, 5, 3],
        q_lengths=[9, 4, 9],
        k_lengths=[66, 66, 0],
    ),
    # Scores near 262: exponentiating them unshifted overflows float32 (exp(89) = inf),
    # so the kernels' shift by the running max must engage (DESIGN section 7).
    _case("scores-near-262", True, B=2, Sq=24, Sk=40, causal=True, input_pos=16, score=262.0),
    _case(
        "pos-array-causal-gqa2-d40",
        True,
        B=2,
        Hkv=1,
        Sq=33,
        Sk=80,
        D=40,
        causal=True,
        input_pos=[47, 10],
    ),
    _case("sq1-h4-d64", True, B=2, H=4, Hkv=4, Sq=1, Sk=50, D=64),
    _case("sq-gt-sk-causal", True, Hkv=1, Sq=75, Sk=20, causal=True),
    _case("dv-ne-d", True, Hkv=1, Sq=24, Sk=40, D=40, Dv=16),
    _case(
        "bshd-gqa2-causal", True, B=2, H=4, Hkv=2, Sq=48, Sk=48, D=64, causal=True, layout="bshd"
    ),
    _case("scale-0.3-d64", Sq=50, Sk=50, D=64, scale=0.3),
    _case("d128-causal-sq-lt-sk", Sq=100, Sk=130, D=128, causal=True),
    _case(
        "gqa4-d40-lengths-causal",
        B=2,
        H=8,
        Hkv=2,
        Sq=96,
        Sk=96,
        D=40,
        causal=True,
        q_lengths=[96, 50],
        k_lengths=[70, 96],
    ),
    _case("long-keys-pos1000", Hkv=1, Sq=100, Sk=1100, causal=True, input_pos=1000),
]


def _dims(p):
    return p["B"], p["H"], p["Hkv"], p["Sq"], p["Sk"], p["D"], p["Dv"] or p["D"]


def _keep(p) -> np.ndarray:
    """``(B, Sq, Sk)`` boolean: which keys each query sees."""
    batch, _, _, sq, sk, _, _ = _dims(p)
    return ref.attention_keep(
        batch,
        sq,
        sk,
        causal=p["causal"],
        input_pos=p["input_pos"],
        q_lengths=p["q_lengths"],
        k_lengths=p["k_lengths"],
    )


def _aligned_scores(rng, q_shape, k_shape, score, scale):
    """``(q, k)`` whose scaled scores all lie near ``score`` (within a few percent).

    Every component of ``k`` is near 1 and every component of ``q`` near
    ``score / (scale * D)``, so ``scale * q . k`` is near ``score`` for every pair.
    """
    d = q_shape[-1]
    q = score / (scale * d) * (1 + 0.1 * rng.standard_normal(q_shape))
    return q, 1 + 0.1 * rng.standard_normal(k_shape)


def arrange_qkv(case, arrays, target):
    """Attention-shaped specs' ``arrange``: BSHD views of q/k/v when the case asks."""
    if case.params["layout"] != "bshd":
        return arrays
    return {**arrays, **{name: bshd(target, arrays[name]) for name in ("q", "k", "v")}}


def cotangent_o(case, rng):
    """Attention-shaped specs' cotangents: ``do`` of the output ``o``."""
    batch, heads, _, sq, _, _, dv = _dims(case.params)
    return {"o": rng.standard_normal((batch, heads, sq, dv))}


def qkv(p, rng) -> dict:
    """Standard normal ``q (B, H, Sq, D)``, ``k (B, Hkv, Sk, D)`` and ``v (B, Hkv, Sk, Dv)``."""
    batch, heads, kv_heads, sq, sk, d, dv = _dims(p)
    return {
        "q": rng.standard_normal((batch, heads, sq, d)),
        "k": rng.standard_normal((batch, kv_heads, sk, d)),
        "v": rng.standard_normal((batch, kv_heads, sk, dv)),
    }


def _inputs(case, rng):
    p = case.params
    arrays = qkv(p, rng)
    if p["score"] is not None:
        arrays["q"], arrays["k"] = _aligned_scores(
            rng, arrays["q"].shape, arrays["k"].shape, p["score"], _scale(p)
        )
    for name in ("q_lengths", "k_lengths"):
        if p[name] is not None:
            arrays[name] = np.asarray(p[name], dtype=np.int64)
    return add_positions(p, arrays)


def _reference(case, inputs):
    p = case.params
    o, m, l_sum, _ = ref.attention(
        inputs["q"], inputs["k"], inputs["v"], scale=_scale(p), keep=_keep(p)
    )
    return {"o": o}, {"m": m, "l": l_sum}


def _reference_backward(case, inputs, cotangents):
    p = case.params
    dq, dk, dv = ref.attention_backward(
        inputs["q"], inputs["k"], inputs["v"], cotangents["o"], scale=_scale(p), keep=_keep(p)
    )
    return {"q": dq, "k": dk, "v": dv}


def _torch_reference(case, inputs, cotangents):
    import torch
    import torch.nn.functional as F

    p = case.params
    q, k, v = (torch.tensor(inputs[n], requires_grad=True) for n in ("q", "k", "v"))
    keep = torch.tensor(_keep(p))[:, None]
    valid = keep.any(dim=-1, keepdim=True)
    plain_causal = (
        p["causal"] and p["input_pos"] == 0 and p["q_lengths"] is None and p["k_lengths"] is None
    )
    with torch.no_grad():
        if plain_causal:
            sdpa = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=_scale(p), enable_gqa=True
            )
        else:
            sdpa = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, scale=_scale(p), enable_gqa=True
            )
        sdpa = torch.where(valid, sdpa, 0.0)
    group = p["H"] // p["Hkv"]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.where(keep & valid, q @ k_rep.transpose(-1, -2) * _scale(p), 0.0)
    s = s.masked_fill(~keep & valid, -math.inf)
    naive = (torch.softmax(s, dim=-1) * valid) @ v_rep
    naive.backward(torch.tensor(cotangents["o"]))
    grads = {"q": q.grad.numpy(), "k": k.grad.numpy(), "v": v.grad.numpy()}
    return {"o": sdpa.numpy()}, grads


def _allocate_outputs(case, arrays, target, dtype):
    batch, heads, _, sq, _, _, dv = _dims(case.params)
    o = target.full((batch, heads, sq, dv), np.nan, dtype)
    return {"o": bshd(target, o) if case.params["layout"] == "bshd" else o}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.attention_, arrays["q"], arrays["k"], arrays["v"])


def _options(case, arrays):
    p = case.params
    return {
        "causal": p["causal"],
        "scale": p["scale"],
        "input_pos": arrays.get("input_pos", p["input_pos"]),
        "q_lengths": arrays.get("q_lengths"),
        "k_lengths": arrays.get("k_lengths"),
    }


_forward_, _forward = attention_calls(xk.attention_, xk.attention, _options)
_backward_, _backward = attention_backward_calls(
    xk.attention_backward_, xk.attention_backward, _options
)


def _other_namespace_array(target, a: np.ndarray):
    """``a`` in a namespace other than ``target``'s (for mixed-namespace errors)."""
    import pytest

    if target.namespace != "numpy":
        return np.asarray(a, dtype=np.float32)
    strict = pytest.importorskip(
        "array_api_strict", reason="array_api_strict provides the second namespace"
    )
    return strict.asarray(a.astype(np.float32))


def _error_cases():
    """What the declaration cannot say: GQA head counts, dtypes that must agree, option values,
    the checkpoints' type (the generic cases come from :func:`declared_errors`)."""
    shape_q, shape_kv = (2, 4, 8, 16), (2, 2, 8, 16)

    def make(t):
        q = t.full(shape_q, 0.5, "float32")
        k = t.full(shape_kv, 0.5, "float32")
        v = t.full(shape_kv, 0.5, "float32")
        return q, k, v, t.full(shape_q, 0.0, "float32")

    def forward(**options):
        def call(t):
            q, k, v, o = make(t)
            xk.attention_(o, q, k, v, **{n: f(t) if callable(f) else f for n, f in options.items()})

        return call

    def arrays(**replace):
        def call(t):
            q, k, v, o = make(t)
            named = {"q": q, "k": k, "v": v, "o": o}
            named.update({n: f(t) for n, f in replace.items()})
            xk.attention_(named["o"], named["q"], named["k"], named["v"])

        return call

    return [
        *declared_errors("attention"),
        ErrorCase(
            "H-not-multiple-of-Hkv",
            arrays(
                k=lambda t: t.full((2, 3, 8, 16), 0.5, "float32"),
                v=lambda t: t.full((2, 3, 8, 16), 0.5, "float32"),
            ),
            ValueError,
            r"H=4 query heads of q must be a multiple of the Hkv=3",
        ),
        ErrorCase(
            "k-dtype-differs",
            arrays(k=lambda t: t.full(shape_kv, 0.5, "float64")),
            TypeError,
            r"k must have q's dtype",
        ),
        ErrorCase("scale-zero", forward(scale=0.0), ValueError, r"scale must be finite and > 0"),
        ErrorCase(
            "scale-nan", forward(scale=float("nan")), ValueError, r"scale must be finite and > 0"
        ),
        ErrorCase(
            "input-pos-past-index-range",
            forward(input_pos=2**31),
            ValueError,
            r"input_pos must lie in \[-2147483647, 2147483647\], got 2147483648",
        ),
        ErrorCase(
            "input-pos-shape",
            forward(input_pos=host_ints([0, 1, 2])),
            ValueError,
            r"input_pos must have shape \(2,\)",
        ),
        ErrorCase(
            "input-pos-float",
            forward(input_pos=1.5),
            TypeError,
            r"input_pos must be an int or a \(2,\) integer array, got float",
        ),
        ErrorCase(
            "q-lengths-above-Sq",
            forward(q_lengths=host_ints([8, 9])),
            ValueError,
            r"q_lengths must lie in \[0, 8\] \(Sq\), got values in \[8, 9\]",
            values=True,
        ),
        ErrorCase(
            "k-lengths-negative",
            forward(k_lengths=host_ints([-1, 3])),
            ValueError,
            r"k_lengths must lie in \[0, 8\] \(Sk\)",
            values=True,
        ),
        ErrorCase(
            "k-lengths-float",
            forward(k_lengths=lambda t: t.full((2,), 3.0, "float32")),
            TypeError,
            r"k_lengths must have dtype int32 or int64",
        ),
        ErrorCase(
            "k-lengths-shape",
            forward(k_lengths=host_ints([3, 3, 3])),
            ValueError,
            r"k_lengths must have shape \(2,\)",
        ),
        ErrorCase(
            "checkpoint-type",
            forward(checkpoints=lambda t: (t.full((2, 4, 8), 0.0, "float32"),) * 2),
            TypeError,
            r"checkpoints must be the AttentionCheckpoints",
        ),
    ]


SPEC = OpSpec(
    name="attention",
    outputs=("o",),
    cases=tuple(CASES),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_error_cases,
    checkpoint_names=("m", "l"),
    allocate_checkpoints=_allocate_checkpoints,
    arrange=arrange_qkv,
    backward=Backward(
        grad_names=("q", "k", "v"),
        cotangents=cotangent_o,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
