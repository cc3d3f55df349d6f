"""Decode attention conformance declaration (forward only).

The float64 reference attends naively to the first ``lengths[b]`` cache
entries; the PyTorch oracle is ``F.scaled_dot_product_attention`` of one query
with a boolean key mask (``enable_gqa``), whose NaN rows for ``lengths[b] == 0``
count as 0.
"""

from __future__ import annotations

import math

import numpy as np

import xpkernels as xk
from xpkernels.decode_attention import DecodeAttentionScratch
from xpkernels.testing import references as ref
from xpkernels.testing.harness import Case, ErrorCase, OpSpec
from xpkernels.testing.specs.attention import _aligned_scores, _bshd, _other_namespace_array


def _case(ident, interpreter=False, quick=False, **params):
    base = {
        "B": 2,
        "H": 2,
        "Hkv": 2,
        "Smax": 32,
        "D": 16,
        "Dv": None,
        "lengths": None,
        "scale": None,
        "n_splits": None,
        "layout": "bhsd",
        "score": None,
    }
    unknown = set(params) - set(base)
    if unknown:
        raise TypeError(f"decode_attention case {ident}: unknown parameters {sorted(unknown)}")
    return Case(ident, {**base, **params}, interpreter=interpreter, quick=quick)


CASES = [
    _case("full-cache-d16", True, lengths=[32, 32]),
    _case("lengths-with-zero", True, True, B=3, Smax=70, lengths=[70, 0, 33]),
    _case("gqa2-d40-odd-lengths", True, H=4, Hkv=2, Smax=80, D=40, lengths=[1, 65]),
    _case("mqa4-d64-splits3", True, H=4, Hkv=1, Smax=80, D=64, lengths=[80, 47], n_splits=3),
    _case("splits-beyond-length", True, Smax=20, lengths=[3, 20], n_splits=7),
    # Every score near -400 and more splits than keys: the empty splits' (m = -inf, l = 0)
    # must drop out of the combine (with m = 0 there, exp(-400) underflows and o = 0 / 0).
    _case(
        "empty-splits-scores-minus-400", True, Smax=16, lengths=[3, 16], n_splits=8, score=-400.0
    ),
    _case("dv-ne-d-splits2", True, Smax=64, D=40, Dv=16, lengths=[64, 40], n_splits=2),
    _case("bshd-cache-gqa2", True, H=4, Hkv=2, Smax=72, D=64, lengths=[72, 9], layout="bshd"),
    _case("d128-scale", Smax=200, D=128, lengths=[200, 131], scale=0.05),
    _case(
        "gqa4-long-cache-splits5",
        B=3,
        H=8,
        Hkv=2,
        Smax=3000,
        D=64,
        lengths=[3000, 2049, 1],
        n_splits=5,
    ),
]


def _dims(p):
    return p["B"], p["H"], p["Hkv"], p["Smax"], p["D"], p["Dv"] or p["D"]


def _scale(p):
    return p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(p["D"])


def _inputs(case, rng):
    p = case.params
    batch, heads, kv_heads, smax, d, dv = _dims(p)
    q = rng.standard_normal((batch, heads, d))
    k = rng.standard_normal((batch, kv_heads, smax, d))
    if p["score"] is not None:
        q, k = _aligned_scores(rng, q.shape, k.shape, p["score"], _scale(p))
    return {
        "q": q,
        "k_cache": k,
        "v_cache": rng.standard_normal((batch, kv_heads, smax, dv)),
        "lengths": np.asarray(p["lengths"], dtype=np.int64),
    }


def _arrange(case, arrays, target):
    if case.params["layout"] != "bshd":
        return arrays
    return {**arrays, **{name: _bshd(target, arrays[name]) for name in ("k_cache", "v_cache")}}


def _reference(case, inputs):
    o = ref.decode_attention(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["lengths"],
        scale=_scale(case.params),
    )
    return {"o": o}, {}


def _torch_reference(case, inputs, cotangents):
    import torch
    import torch.nn.functional as F

    p = case.params
    q = torch.tensor(inputs["q"])[:, :, None, :]
    lengths = torch.tensor(inputs["lengths"])
    keep = torch.arange(p["Smax"])[None, :] < lengths[:, None]
    o = F.scaled_dot_product_attention(
        q,
        torch.tensor(inputs["k_cache"]),
        torch.tensor(inputs["v_cache"]),
        attn_mask=keep[:, None, None, :],
        scale=_scale(p),
        enable_gqa=True,
    )[:, :, 0, :]
    return {"o": torch.where((lengths > 0)[:, None, None], o, 0.0).numpy()}, {}


def _allocate_outputs(case, arrays, target, dtype):
    batch, heads, _, _, _, dv = _dims(case.params)
    return {"o": target.full((batch, heads, dv), np.nan, dtype)}


def _forward_(case, arrays, outs, checkpoints, backend):
    p = case.params
    scratch = xk.allocate_scratchspace(
        xk.decode_attention_,
        outs["o"],
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["lengths"],
        n_splits=p["n_splits"],
        backend=backend,
    )
    xk.decode_attention_(
        outs["o"],
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["lengths"],
        scale=p["scale"],
        scratch=scratch,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    p = case.params
    o = xk.decode_attention(
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["lengths"],
        scale=p["scale"],
        n_splits=p["n_splits"],
        backend=backend,
    )
    return {"o": o}


def _errors():
    return _error_cases()


def _error_cases():
    shape_q, shape_cache = (2, 4, 16), (2, 2, 10, 16)

    def make(t, dtype="float32"):
        return {
            "o": t.full(shape_q, 0.0, dtype),
            "q": t.full(shape_q, 0.5, dtype),
            "k_cache": t.full(shape_cache, 0.5, dtype),
            "v_cache": t.full(shape_cache, 0.5, dtype),
            "lengths": t.asarray(np.asarray([10, 3], dtype=np.int64)),
        }

    def call(**replace):
        options = {n: replace.pop(n) for n in ("scale", "n_splits", "scratch") if n in replace}

        def run(t):
            a = make(t)
            a.update({n: f(t) for n, f in replace.items()})
            kw = {n: f(t) if callable(f) else f for n, f in options.items()}
            xk.decode_attention_(a["o"], a["q"], a["k_cache"], a["v_cache"], a["lengths"], **kw)

        return run

    def ints(values):
        return lambda t: t.asarray(np.asarray(values, dtype=np.int64))

    def scratch(splits=2, dv=16, dtype="float32", m_splits=None):
        def build(t):
            return DecodeAttentionScratch(
                t.full((2, 4, splits, dv), 0.0, dtype),
                t.full((2, 4, m_splits or splits), 0.0, dtype),
                t.full((2, 4, splits), 0.0, dtype),
            )

        return build

    def allocate_without_cache(t):
        a = make(t)
        xk.allocate_scratchspace(xk.decode_attention_, a["o"], a["q"])

    return [
        ErrorCase(
            "q-rank4",
            call(q=lambda t: t.full((2, 4, 1, 16), 0.5, "float32")),
            ValueError,
            r"q must have shape \(B, H, D\) \(rank 3\)",
        ),
        ErrorCase(
            "k-cache-rank3",
            call(k_cache=lambda t: t.full((2, 10, 16), 0.5, "float32")),
            ValueError,
            r"k_cache must have shape \(B, Hkv, Smax, D\) \(rank 4\)",
        ),
        ErrorCase(
            "k-cache-head-dim",
            call(k_cache=lambda t: t.full((2, 2, 10, 8), 0.5, "float32")),
            ValueError,
            r"k_cache must have shape \(2, 2, 10, 16\)",
        ),
        ErrorCase(
            "H-not-multiple-of-Hkv",
            call(
                k_cache=lambda t: t.full((2, 3, 10, 16), 0.5, "float32"),
                v_cache=lambda t: t.full((2, 3, 10, 16), 0.5, "float32"),
            ),
            ValueError,
            r"H=4 query heads of q must be a multiple of the Hkv=3",
        ),
        ErrorCase(
            "v-cache-length",
            call(v_cache=lambda t: t.full((2, 2, 11, 16), 0.5, "float32")),
            ValueError,
            r"v_cache must have shape \(2, 2, 10, 16\)",
        ),
        ErrorCase(
            "o-shape",
            call(o=lambda t: t.full((2, 4, 8), 0.0, "float32")),
            ValueError,
            r"o must have shape \(2, 4, 16\)",
        ),
        ErrorCase(
            "int-q",
            call(q=lambda t: t.asarray(np.ones(shape_q, dtype=np.int32))),
            TypeError,
            r"q must have dtype in",
        ),
        ErrorCase(
            "v-cache-dtype",
            call(v_cache=lambda t: t.full(shape_cache, 0.5, "float64")),
            TypeError,
            r"v_cache must have q's dtype",
        ),
        ErrorCase(
            "mixed-namespaces",
            call(k_cache=lambda t: _other_namespace_array(t, np.full(shape_cache, 0.5))),
            TypeError,
            r"all arrays of a call must come from one namespace",
        ),
        ErrorCase(
            "lengths-above-Smax",
            call(lengths=ints([11, 3])),
            ValueError,
            r"lengths must lie in \[0, 10\] \(Smax\), got values in \[3, 11\]",
            values=True,
        ),
        ErrorCase(
            "lengths-negative",
            call(lengths=ints([-1, 3])),
            ValueError,
            r"lengths must lie in \[0, 10\]",
            values=True,
        ),
        ErrorCase(
            "lengths-float",
            call(lengths=lambda t: t.full((2,), 3.0, "float32")),
            TypeError,
            r"lengths must have dtype int32 or int64",
        ),
        ErrorCase(
            "lengths-shape", call(lengths=ints([3])), ValueError, r"lengths must have shape \(2,\)"
        ),
        ErrorCase(
            "scale-inf", call(scale=float("inf")), ValueError, r"scale must be finite and > 0"
        ),
        ErrorCase("n-splits-zero", call(n_splits=0), ValueError, r"n_splits must be >= 1"),
        ErrorCase("n-splits-float", call(n_splits=2.5), TypeError, r"n_splits must be an int >= 1"),
        ErrorCase(
            "n-splits-disagrees",
            call(n_splits=3, scratch=scratch(splits=2)),
            ValueError,
            r"n_splits=3 disagrees with scratch.o_partial, allocated for 2 splits",
        ),
        ErrorCase(
            "scratch-dv",
            call(scratch=scratch(dv=8)),
            ValueError,
            r"scratch.o_partial must have shape \(2, 4, 2, 16\)",
        ),
        ErrorCase(
            "scratch-m-splits",
            call(scratch=scratch(m_splits=3)),
            ValueError,
            r"scratch.m_partial must have shape \(2, 4, 2\)",
        ),
        ErrorCase(
            "scratch-dtype",
            call(scratch=scratch(dtype="float64")),
            TypeError,
            r"scratch.o_partial must be .*float32",
        ),
        ErrorCase(
            "scratch-namespace",
            call(
                scratch=lambda t: DecodeAttentionScratch(
                    _other_namespace_array(t, np.zeros((2, 4, 2, 16))),
                    *(_other_namespace_array(t, np.zeros((2, 4, 2))) for _ in range(2)),
                )
            ),
            TypeError,
            r"scratch.o_partial is a .* array but q is a .* array",
        ),
        ErrorCase(
            "allocate-without-cache-or-splits",
            allocate_without_cache,
            TypeError,
            r"pass n_splits=, or k_cache",
        ),
    ]


SPEC = OpSpec(
    name="decode_attention",
    outputs=("o",),
    cases=tuple(CASES),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=_arrange,
    torch_reference=_torch_reference,
)
