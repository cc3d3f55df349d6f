"""Decode attention conformance declaration (forward only).

The float64 reference attends naively to the first ``lengths[b]`` cache
entries (the last ``window`` of them under a window, scores capped under a
softcap); a paged case's reference runs on the contiguous cache gathered
from its pages (:func:`xpkernels.testing.references.gather_pages`), and its
block table is a shuffled permutation of the pages (one spare page is never
referenced). The PyTorch oracle is ``F.scaled_dot_product_attention`` of one
query with a boolean key mask (``enable_gqa``), whose NaN rows for
``lengths[b] == 0`` count as 0, over pages gathered by torch indexing; with a
softcap (which SDPA lacks) it is a naive softmax written in torch.
"""

from __future__ import annotations

import functools

import numpy as np

import xpkernels as xk
from xpkernels.decode_attention import DecodeAttentionScratch
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import ErrorCase, OpSpec
from xpkernels.testing.specs._shared import bshd, checked_case, host_ints
from xpkernels.testing.specs._shared import scale_of as _scale
from xpkernels.testing.specs.attention import _aligned_scores, _other_namespace_array

_BASE = {
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
    "page_size": None,
    "softcap": None,
    "window": None,
}


def _case(ident, interpreter=False, quick=False, **params):
    return checked_case("decode_attention", ident, _BASE, params, interpreter, quick)


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
    _case("softcap-contiguous", True, H=4, Hkv=2, Smax=40, lengths=[40, 17], softcap=1.5),
    # Window 9 of lengths 40 and 23: the window's first key sits mid-tile, and 5 splits cut it.
    _case("window-contiguous-splits5", True, Smax=40, lengths=[40, 23], window=9, n_splits=5),
    _case("window-wider-than-length", True, Smax=24, lengths=[5, 24], window=30),
    # Paged caches: Smax is max_pages * page_size; lengths ragged, 0, and page multiples.
    _case(
        "paged-page1-gqa2",
        True,
        True,
        B=3,
        H=4,
        Hkv=2,
        Smax=40,
        lengths=[0, 37, 40],
        page_size=1,
        n_splits=3,
    ),
    _case("paged-page8-mqa4", True, B=3, H=4, Hkv=1, Smax=48, lengths=[48, 8, 21], page_size=8),
    _case(
        "paged-page16-ragged-splits3",
        True,
        B=4,
        H=4,
        Hkv=2,
        Smax=64,
        lengths=[0, 16, 33, 64],
        page_size=16,
        n_splits=3,
    ),
    _case("paged-page64", True, Smax=128, D=40, Dv=16, lengths=[64, 100], page_size=64),
    _case("paged-page128-splits2", True, Smax=256, lengths=[256, 70], page_size=128, n_splits=2),
    _case(
        "paged-page16-softcap",
        True,
        H=4,
        Hkv=2,
        Smax=48,
        lengths=[48, 20],
        page_size=16,
        softcap=2.0,
    ),
    _case(
        "paged-page16-window-splits2",
        True,
        B=3,
        Smax=64,
        lengths=[64, 7, 0],
        page_size=16,
        window=20,
        n_splits=2,
    ),
    _case(
        "paged-page1-window-softcap",
        True,
        Smax=30,
        lengths=[30, 12],
        page_size=1,
        window=9,
        softcap=1.0,
    ),
    # Pages laid out (num_pages, page_size, Hkv, D), as vLLM stores them, viewed as
    # (num_pages, Hkv, page_size, D).
    _case(
        "paged-page16-bshd-pages-gqa2",
        True,
        H=4,
        Hkv=2,
        Smax=64,
        D=64,
        lengths=[50, 64],
        page_size=16,
        layout="bshd",
    ),
    _case(
        "paged-page16-long-window-splits5",
        B=3,
        H=8,
        Hkv=2,
        Smax=3008,
        D=64,
        lengths=[3000, 2049, 1],
        page_size=16,
        window=1000,
        softcap=30.0,
        n_splits=5,
    ),
]


def _dims(p):
    return p["B"], p["H"], p["Hkv"], p["Smax"], p["D"], p["Dv"] or p["D"]


def _inputs(case, rng):
    p = case.params
    batch, heads, kv_heads, smax, d, dv = _dims(p)
    q = rng.standard_normal((batch, heads, d))
    lengths = np.asarray(p["lengths"], dtype=np.int64)
    page_size = p["page_size"]
    if page_size is not None:
        max_pages = smax // page_size
        num_pages = batch * max_pages + 1  # one spare page no table entry names
        table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
        return {
            "q": q,
            "k_cache": rng.standard_normal((num_pages, kv_heads, page_size, d)),
            "v_cache": rng.standard_normal((num_pages, kv_heads, page_size, dv)),
            "lengths": lengths,
            "block_table": table.astype(np.int32),
        }
    k = rng.standard_normal((batch, kv_heads, smax, d))
    if p["score"] is not None:
        q, k = _aligned_scores(rng, q.shape, k.shape, p["score"], _scale(p))
    return {
        "q": q,
        "k_cache": k,
        "v_cache": rng.standard_normal((batch, kv_heads, smax, dv)),
        "lengths": lengths,
    }


def _arrange(case, arrays, target):
    if case.params["layout"] != "bshd":
        return arrays
    return {**arrays, **{name: bshd(target, arrays[name]) for name in ("k_cache", "v_cache")}}


def _contiguous(inputs):
    """The inputs' ``(k_cache, v_cache)``; a paged case's gathered from its pages."""
    k, v = inputs["k_cache"], inputs["v_cache"]
    if "block_table" not in inputs:
        return k, v
    table = inputs["block_table"]
    return ref.gather_pages(k, table), ref.gather_pages(v, table)


def _reference(case, inputs):
    p = case.params
    k, v = _contiguous(inputs)
    o = ref.decode_attention(
        inputs["q"],
        k,
        v,
        inputs["lengths"],
        scale=_scale(p),
        softcap=p["softcap"],
        window=p["window"],
    )
    return {"o": o}, {}


def _torch_reference(case, inputs, cotangents):
    import torch
    import torch.nn.functional as F

    p = case.params
    q = torch.tensor(inputs["q"])[:, :, None, :]
    k, v = torch.tensor(inputs["k_cache"]), torch.tensor(inputs["v_cache"])
    if "block_table" in inputs:
        table = torch.tensor(inputs["block_table"]).long()
        k, v = (
            torch.flatten(torch.movedim(a[table], 1, 2), 2, 3)  # (B, Hkv, max_pages * page_size, D)
            for a in (k, v)
        )
    lengths = torch.tensor(inputs["lengths"])
    keys = torch.arange(p["Smax"])[None, :]
    keep = keys < lengths[:, None]
    if p["window"] is not None:
        keep &= keys > lengths[:, None] - 1 - p["window"]
    if p["softcap"] is None:
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep[:, None, None, :], scale=_scale(p), enable_gqa=True
        )[:, :, 0, :]
    else:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = (q @ k.transpose(-1, -2))[:, :, 0, :] * _scale(p)
        s = p["softcap"] * torch.tanh(s / p["softcap"])
        probs = torch.softmax(s.masked_fill(~keep[:, None, :], float("-inf")), dim=-1)
        o = (probs[:, :, None, :] @ v)[:, :, 0, :]
    return {"o": torch.where((lengths > 0)[:, None, None], o, 0.0).numpy()}, {}


def _allocate_outputs(case, arrays, target, dtype):
    batch, heads, _, _, _, dv = _dims(case.params)
    return {"o": target.full((batch, heads, dv), np.nan, dtype)}


def _forward_(case, arrays, outs, checkpoints, backend):
    p = case.params
    block_table = arrays.get("block_table")
    scratch = xk.allocate_scratchspace(
        xk.decode_attention_,
        outs["o"],
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["lengths"],
        block_table=block_table,
        window=p["window"],
        n_splits=p["n_splits"],
        backend=backend,
    )
    xk.decode_attention_(
        outs["o"],
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["lengths"],
        block_table=block_table,
        scale=p["scale"],
        softcap=p["softcap"],
        window=p["window"],
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
        block_table=arrays.get("block_table"),
        scale=p["scale"],
        softcap=p["softcap"],
        window=p["window"],
        n_splits=p["n_splits"],
        backend=backend,
    )
    return {"o": o}


def _error_arrays(t, cache_shape, lengths, block_table=None):
    """``o`` and ``q`` of 2 x 4 heads of ``D = 16``, caches (or pages) of ``cache_shape``,
    ``lengths`` and, for a paged call, its ``block_table``."""
    arrays = {
        "o": t.full((2, 4, 16), 0.0, "float32"),
        "q": t.full((2, 4, 16), 0.5, "float32"),
        "k_cache": t.full(cache_shape, 0.5, "float32"),
        "v_cache": t.full(cache_shape, 0.5, "float32"),
        "lengths": t.asarray(np.asarray(lengths, dtype=np.int64)),
    }
    if block_table is not None:
        arrays["block_table"] = t.asarray(np.asarray(block_table, dtype=np.int32))
    return arrays


def _bad_call(make, **replace):
    """``decode_attention_`` on ``make(t)``'s arrays, those ``replace`` names replaced by
    functions of the target; the options among ``replace`` are passed as keywords (called on
    the target where callable)."""
    names = ("scale", "n_splits", "scratch", "window", "softcap")
    options = {n: replace.pop(n) for n in names if n in replace}

    def run(t):
        a = make(t)
        a.update({n: f(t) for n, f in replace.items()})
        kw = {n: f(t) if callable(f) else f for n, f in options.items()}
        if "block_table" in a:
            kw["block_table"] = a["block_table"]
        xk.decode_attention_(a["o"], a["q"], a["k_cache"], a["v_cache"], a["lengths"], **kw)

    return run


def _error_cases():
    shape_cache = (2, 2, 10, 16)

    def make(t):
        return _error_arrays(t, shape_cache, [10, 3])

    call = functools.partial(_bad_call, make)

    def scratch(splits=2, m_splits=None):
        def build(t):
            return DecodeAttentionScratch(
                t.full((2, 4, splits, 16), 0.0, "float32"),
                t.full((2, 4, m_splits or splits), 0.0, "float32"),
                t.full((2, 4, splits), 0.0, "float32"),
            )

        return build

    def allocate_without_cache(t):
        a = make(t)
        xk.allocate_scratchspace(xk.decode_attention_, a["o"], a["q"])

    return [
        *declared_errors("decode_attention"),
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
            "v-cache-dtype",
            call(v_cache=lambda t: t.full(shape_cache, 0.5, "float64")),
            TypeError,
            r"v_cache must have q's dtype",
        ),
        ErrorCase(
            "lengths-above-Smax",
            call(lengths=host_ints([11, 3])),
            ValueError,
            r"lengths must lie in \[0, 10\] \(Smax\), got values in \[3, 11\]",
            values=True,
        ),
        ErrorCase(
            "lengths-negative",
            call(lengths=host_ints([-1, 3])),
            ValueError,
            r"lengths must lie in \[0, 10\]",
            values=True,
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
            "scratch-m-splits",
            call(scratch=scratch(m_splits=3)),
            ValueError,
            r"scratch.m_partial must have shape \(2, 4, 2\)",
        ),
        ErrorCase(
            "allocate-without-cache-or-splits",
            allocate_without_cache,
            TypeError,
            r"pass n_splits=, or k_cache",
        ),
        ErrorCase("window-zero", call(window=0), ValueError, r"window must lie in \[1, "),
        ErrorCase("window-float", call(window=2.0), TypeError, r"window must be an int"),
        ErrorCase("softcap-zero", call(softcap=0.0), ValueError, r"softcap must be finite and > 0"),
        ErrorCase(
            "softcap-nan", call(softcap=float("nan")), ValueError, r"softcap must be finite and > 0"
        ),
        *_paged_error_cases(),
    ]


def _paged_error_cases():
    """Bad paged calls: 5 pages of 4 keys, a (2, 3) block table (Smax = 12)."""

    def make(t):
        return _error_arrays(t, (5, 2, 4, 16), [12, 5], [[4, 0, 2], [1, 3, 0]])

    call = functools.partial(_bad_call, make)

    def table(values, dtype=np.int32):
        return host_ints(values, dtype)

    def pages(shape):
        return lambda t: t.full(shape, 0.5, "float32")

    return [
        ErrorCase(
            "paged-block-table-int64",
            call(block_table=table([[4, 0, 2], [1, 3, 0]], np.int64)),
            TypeError,
            r"block_table must have dtype int32",
        ),
        ErrorCase(
            "paged-block-table-float",
            call(block_table=lambda t: t.full((2, 3), 1.0, "float32")),
            TypeError,
            r"block_table must have dtype int32",
        ),
        ErrorCase(
            "paged-block-table-rank1",
            call(block_table=table([4, 0, 2])),
            ValueError,
            r"block_table must have shape \(B, max_pages\) \(rank 2\)",
        ),
        ErrorCase(
            "paged-block-table-batch",
            call(block_table=table([[4, 0, 2]])),
            ValueError,
            r"block_table must have shape \(2, 3\)",
        ),
        ErrorCase(
            "paged-block-table-namespace",
            call(block_table=lambda t: _other_namespace_array(t, np.zeros((2, 3)))),
            TypeError,
            r"block_table is a .* array but q is a .* array",
        ),
        ErrorCase(
            "paged-k-pages-rank3",
            call(k_cache=pages((5, 2, 64))),
            ValueError,
            r"k_pages must have shape \(num_pages, Hkv, page_size, D\) \(rank 4\)",
        ),
        ErrorCase(
            "paged-no-pages",
            call(k_cache=pages((0, 2, 4, 16)), v_cache=pages((0, 2, 4, 16))),
            ValueError,
            r"k_pages must hold num_pages >= 1 pages of page_size >= 1 keys",
        ),
        ErrorCase(
            "paged-v-pages-num-pages",
            call(v_cache=pages((6, 2, 4, 16))),
            ValueError,
            r"v_pages must have shape \(5, 2, 4, 16\)",
        ),
        ErrorCase(
            "paged-v-pages-page-size",
            call(v_cache=pages((5, 2, 8, 16))),
            ValueError,
            r"v_pages must have shape \(5, 2, 4, 16\)",
        ),
        ErrorCase(
            "paged-v-pages-kv-heads",
            call(v_cache=pages((5, 1, 4, 16))),
            ValueError,
            r"v_pages must have shape \(5, 2, 4, 16\)",
        ),
        ErrorCase(
            "paged-lengths-above-max-pages-times-page-size",
            call(lengths=table([13, 5], np.int64)),
            ValueError,
            r"lengths must lie in \[0, 12\] \(max_pages \* page_size\), got values in \[5, 13\]",
            values=True,
        ),
        ErrorCase(
            "paged-block-table-entry-past-num-pages",
            call(block_table=table([[4, 0, 5], [1, 3, 0]])),
            ValueError,
            r"block_table entries of the pages read .* must lie in \[0, 4\] \(num_pages=5\), "
            r"got values in \[5, 5\]",
            values=True,
        ),
        ErrorCase(
            "paged-block-table-entry-negative",
            call(block_table=table([[4, 0, 2], [-1, 3, 0]])),
            ValueError,
            r"block_table entries of the pages read .* must lie in \[0, 4\]",
            values=True,
        ),
        ErrorCase("paged-window-zero", call(window=0), ValueError, r"window must lie in \[1, "),
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
    errors=_error_cases,
    arrange=_arrange,
    torch_reference=_torch_reference,
)
