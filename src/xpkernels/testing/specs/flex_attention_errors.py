"""FlexAttention's hand-written error cases: what the declared ones cannot express.

Input positions, mod types, gradients of another mod, block masks that do not
fit, int64 index arithmetic; the generic cases (ranks, shapes, dtypes,
namespaces, overlaps, non-arrays) come from the declaration
(:mod:`xpkernels.testing.declared_errors`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from xpkernels import mods as xm
from xpkernels.buffers import Duplicated, allocate_checkpoints, grad_shadow
from xpkernels.flex_attention import flex_attention_, flex_attention_backward_
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import ErrorCase
from xpkernels.testing.specs._flex_mods import relative_bias


def _make(t):
    """``(q, k, v, o)`` of the error cases: 4 query heads over 2 kv heads, 8 keys, ``D = 16``."""
    shape_q, shape_kv = (2, 4, 8, 16), (2, 2, 8, 16)
    q = t.full(shape_q, 0.5, "float32")
    k = t.full(shape_kv, 0.25, "float32")
    v = t.full(shape_kv, 0.5, "float32")
    return q, k, v, t.full(shape_q, 0.0, "float32")


def _forward(**options):
    """``flex_attention_`` on :func:`_make`'s arrays; an option that is a function of the target
    is called there (but a ``mask_mod``, itself callable, is passed as it is)."""

    def call(t):
        q, k, v, o = _make(t)
        flex_attention_(
            o,
            q,
            k,
            v,
            **{n: f(t) if callable(f) and n != "mask_mod" else f for n, f in options.items()},
        )

    return call


def _more_error_cases():
    """Input positions, mod types, gradients of another mod, int64 index arithmetic."""

    def slopes(t):
        return xm.AliBiScore(t.full((4,), 0.1, "float32"))

    def grad_of_other_arrays(t):
        q, k, v, o = _make(t)
        mod = slopes(t)
        ck = allocate_checkpoints(flex_attention_, q, k, v)
        flex_attention_(o, q, k, v, score_mod=mod, checkpoints=ck)
        flex_attention_backward_(
            Duplicated(o),
            Duplicated(q),
            Duplicated(k),
            Duplicated(v),
            checkpoints=ck,
            score_mod=mod,
            score_mod_grad=grad_shadow(slopes(t)),
        )

    def wrapping_index(t):
        return xm.ScoreMod(
            lambda s, b, h, q_idx, kv_idx, *, w: s + w[h, (kv_idx * 2**62) // 2**62],
            w=t.full((4, 8), 0.0, "float32"),
        )

    return [
        ErrorCase(
            "input-pos-list-too-long",
            _forward(input_pos=[0, 1, 2]),
            ValueError,
            r"flex_attention_: input_pos must have 2 entries \(one per batch\), got 3",
        ),
        ErrorCase(
            "input-pos-list-too-short",
            _forward(input_pos=[4]),
            ValueError,
            r"flex_attention_: input_pos must have 2 entries \(one per batch\), got 1",
        ),
        ErrorCase(
            "input-pos-past-index-range",
            _forward(input_pos=2**31),
            ValueError,
            r"flex_attention_: input_pos must lie in \[-2147483647, 2147483647\], got 2147483648",
        ),
        ErrorCase(
            "mask-mod-an-int",
            _forward(mask_mod=3),
            TypeError,
            r"flex_attention_: mask_mod must be a MaskMod or a function .* got int",
        ),
        ErrorCase(
            "mask-mod-a-score-mod",
            _forward(mask_mod=xm.SoftCapScore(2.0)),
            TypeError,
            r"flex_attention_: mask_mod must be a MaskMod .* got SoftCapScore\(2\), a score mod",
        ),
        ErrorCase(
            "score-mod-grad-other-arrays",
            grad_of_other_arrays,
            TypeError,
            r"score_mod_grad does not match score_mod AliBiScore: it was made by grad_shadow of "
            r"another score mod",
        ),
        ErrorCase(
            "index-wraps-in-int64",
            _forward(score_mod=wrapping_index),
            ValueError,
            r"indexed on axis 1 by values in \[-2, 1\] .*leaves int64",
        ),
    ]


def _error_cases():
    def trained(t, **options):
        q, k, v, o = _make(t)
        ck = allocate_checkpoints(flex_attention_, q, k, v)
        flex_attention_(o, q, k, v, checkpoints=ck, **options)
        return (Duplicated(o), Duplicated(q), Duplicated(k), Duplicated(v)), ck

    def ints(t, values):
        return t.asarray(np.asarray(values, dtype=np.int64))

    def bias(shape):
        return lambda t: xm.BiasScore(t.full(shape, 0.1, "float32"))

    def slopes(shape):
        return lambda t: xm.AliBiScore(t.full(shape, 0.1, "float32"))

    def documents(length):
        return lambda t: xm.DocumentMask(ints(t, np.arange(length) // 3))

    def small_table(t):
        return xm.ScoreMod(relative_bias, table=t.full((4, 20), 0.0, "float32"))

    def with_mask(mask):
        def call(t):
            q, k, v, o = _make(t)
            flex_attention_(o, q, k, v, mask_mod=mask(t))

        return call

    def sin_score(t):
        return xm.ScoreMod(lambda s, b, h, q_idx, kv_idx: math.sin(s))

    def branching_mask(t):
        return xm.MaskMod(lambda b, h, q_idx, kv_idx: True if q_idx > kv_idx else kv_idx == 0)

    def numeric_mask(t):
        return xm.MaskMod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx)

    def block_for(n_q, n_kv, tile_m=4, tile_n=4, **extra):
        return lambda t: xm.build_block_mask(
            xm.CausalMask(), n_q, n_kv, tile_m=tile_m, tile_n=tile_n, **extra
        )

    def retiled(t):
        built = xm.build_block_mask(xm.CausalMask(), 8, 8, tile_m=4, tile_n=4)
        return dataclasses.replace(built, tile_m=2)

    def other_mask_and_block(t):
        q, k, v, o = _make(t)
        flex_attention_(o, q, k, v, mask_mod=xm.CausalMask(), block_mask=block_for(8, 8)(t))

    def per_head_block(t):
        return xm.build_block_mask(
            lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + h, 8, 8, tile_m=4, tile_n=4, n_heads=2
        )

    def grad_of_other_mod(t):
        args, ck = trained(t, score_mod=slopes((4,))(t))
        mod = slopes((4,))(t) >> xm.SoftCapScore(3.0)
        flex_attention_backward_(
            *args,
            checkpoints=ck,
            score_mod=mod,
            score_mod_grad=grad_shadow(xm.BiasScore(t.full((1, 1, 8, 8), 0.0, "float32"))),
        )

    def grad_without_score_mod(t):
        args, ck = trained(t)
        flex_attention_backward_(*args, checkpoints=ck, score_mod_grad=grad_shadow(slopes((4,))(t)))

    def h_not_multiple(t):
        q, _, _, o = _make(t)
        kv = t.full((2, 3, 8, 16), 0.5, "float32")
        flex_attention_(o, q, kv, kv)

    return [
        *declared_errors("flex_attention"),
        ErrorCase(
            "bias-wrong-shape",
            _forward(score_mod=bias((1, 4, 9, 8))),
            ValueError,
            r"BiasScore.bias must have shape \(Bb, Hb, 8, 8\) with Bb in \{1, 2\} "
            r"and Hb in \{1, 4\}",
        ),
        ErrorCase(
            "bias-batch-3",
            _forward(score_mod=bias((3, 1, 8, 8))),
            ValueError,
            r"BiasScore.bias must have shape",
        ),
        ErrorCase(
            "bias-rank3",
            _forward(score_mod=bias((4, 8, 8))),
            TypeError,
            r"BiasScore: bias must be a float array of shape \(Bb, Hb, Sq, Sk\)",
        ),
        ErrorCase(
            "slopes-not-H",
            _forward(score_mod=slopes((2,))),
            ValueError,
            r"AliBiScore.slopes must have shape \(4,\), one per query head; got \(2,\)",
        ),
        ErrorCase(
            "slopes-rank2",
            _forward(score_mod=slopes((4, 1))),
            TypeError,
            r"AliBiScore: slopes must be a float array of shape \(H,\)",
        ),
        ErrorCase(
            "doc-ids-wrong-length",
            with_mask(documents(9)),
            ValueError,
            r"DocumentMask.doc_q must have shape \(8,\) or \(2, 8\)",
        ),
        ErrorCase(
            "doc-ids-float",
            with_mask(lambda t: xm.DocumentMask(t.full((8,), 0.0, "float32"))),
            TypeError,
            r"DocumentMask: doc_q must be an integer array",
        ),
        ErrorCase(
            "user-index-out-of-range",
            _forward(score_mod=small_table),
            ValueError,
            r"table \(shape \(4, 20\)\) is indexed on axis 1 by values in \[17, 31\] "
            r"for this call .*outside \[0, 19\]",
        ),
        ErrorCase(
            "unsupported-math-sin",
            _forward(score_mod=sin_score),
            xm.TraceError,
            r"converting a traced value with float\(\) or a math\.\* function",
        ),
        ErrorCase(
            "unsupported-python-if",
            with_mask(branching_mask),
            xm.TraceError,
            r"using a traced value as a Python bool",
        ),
        ErrorCase(
            "mask-returns-number",
            with_mask(numeric_mask),
            xm.TraceError,
            r"a mask mod must return a condition",
        ),
        ErrorCase(
            "block-mask-other-lengths",
            _forward(block_mask=block_for(16, 8)),
            ValueError,
            r"block_mask was built for n_q=16, n_kv=8 but the call has Sq=8, Sk=8",
        ),
        ErrorCase(
            "block-mask-other-tiles",
            _forward(block_mask=retiled),
            ValueError,
            r"it was built for other tile sizes or lengths",
        ),
        ErrorCase(
            "block-mask-other-input-pos",
            _forward(block_mask=block_for(8, 8, input_pos=3)),
            ValueError,
            r"block_mask was built for input_pos=\[3\], the call has \[0\]",
        ),
        ErrorCase(
            "block-mask-other-heads",
            _forward(block_mask=per_head_block),
            ValueError,
            r"block_mask.states has 2 head entries but the call has 4",
        ),
        ErrorCase(
            "mask-and-other-block-mask",
            other_mask_and_block,
            ValueError,
            r"mask_mod and block_mask.mask_mod differ",
        ),
        ErrorCase(
            "score-mod-grad-mismatch",
            grad_of_other_mod,
            TypeError,
            r"score_mod_grad does not match",
        ),
        ErrorCase(
            "score-mod-grad-without-score-mod",
            grad_without_score_mod,
            TypeError,
            r"the call has no score_mod",
        ),
        ErrorCase(
            "H-not-multiple-of-Hkv",
            h_not_multiple,
            ValueError,
            r"H=4 query heads of q must be a multiple",
        ),
        ErrorCase(
            "input-pos-shape",
            _forward(input_pos=lambda t: ints(t, [0, 1, 2])),
            ValueError,
            r"input_pos must have shape \(2,\)",
        ),
        ErrorCase(
            "block-sparse-not-bool",
            _forward(block_sparse="yes"),
            TypeError,
            r"block_sparse must be a bool",
        ),
    ]


def errors():
    """Every hand-written error case of ``flex_attention`` (see the module docstring)."""
    return _error_cases() + _more_error_cases()
