"""FlexAttention conformance declaration.

Every case builds its mods from the case's arrays (target arrays for the
kernels, float64 NumPy for the reference, torch tensors for the oracle), so
one declaration drives all three. The learnable arrays a score mod captures
(slopes, bias, tables, pair projections, features) are packed into one flat
input ``params``; its gradient is the concatenation of the mod's
``grad_shadow`` fields, so the generic templates check mod gradients like any
other input gradient.

- Reference (float64, naive): the full ``(B, H, Sq, Sk)`` scores with the
  mods applied per pair by calling the mod functions directly on NumPy index
  grids (no tracing, no tiles). Its backward takes ``d score_mod / d score``
  and the parameter gradients from the traced graph's reverse mode on the
  host (:func:`xpkernels.mods.score_grad`), which the oracle checks.
- PyTorch oracle: ``torch.nn.attention.flex_attention`` (CPU eager) with the
  same mods (and ``create_block_mask``) for the forward; float64 autograd over
  a naive materialised version for q, k, v and the mod parameters.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from xpkernels import mods as xm
from xpkernels.buffers import allocate_checkpoints, grad_shadow
from xpkernels.flex_attention import (
    flex_attention,
    flex_attention_,
    flex_attention_backward,
    flex_attention_backward_,
)
from xpkernels.testing import references as ref
from xpkernels.testing.harness import Backward, OpSpec
from xpkernels.testing.specs._flex_mods import (
    RELATIVE,
    backward_calls,
    draw_params,
    flat_params,
    index_grids,
    late,
    naive,
    pair_op,
    positions,
    relative_bias,
    score_gradients,
    unpack_params,
    user_mask,
)
from xpkernels.testing.specs._shared import add_positions, attention_calls, checked_case
from xpkernels.testing.specs.attention import (
    _allocate_outputs,
    _dims,
    _scale,
    arrange_qkv,
    cotangent_o,
    qkv,
)
from xpkernels.testing.specs.flex_attention_errors import errors

_BASE = {
    "B": 1,
    "H": 2,
    "Hkv": 2,
    "Sq": 16,
    "Sk": 16,
    "D": 16,
    "Dv": None,
    "scale": None,
    "input_pos": 0,
    "score": None,
    "mask": None,
    "w": 8,
    "n": 5,
    "block": None,
    "sparse": True,
    "layout": "bhsd",
}


def _case(ident, quick=False, interpreter=False, **params):
    return checked_case("flex", ident, _BASE, params, interpreter, quick)


CASES = [
    _case("nomod-gqa2-b2-dv24", B=2, H=4, Hkv=2, Sq=40, Sk=150, Dv=24),
    _case("full-noop", Sq=30, Sk=140, mask="full", score="noop"),
    _case("causal-s160", Sq=160, Sk=160, mask="causal"),
    _case("causal-pos150-mqa", H=4, Hkv=1, Sq=48, Sk=200, mask="causal", input_pos=150),
    _case("causal-pos-per-batch", B=2, Sq=40, Sk=160, mask="causal", input_pos=[0, 100]),
    _case("sliding37-s200", Sq=200, Sk=200, mask="sliding", w=37),
    _case("prefix20", Sq=60, Sk=140, mask="prefix", n=20),
    _case("prefix_lm30", Sq=160, Sk=160, mask="prefix_lm", n=30),
    _case("document-b2", B=2, Sq=150, Sk=150, mask="document"),
    _case("document-rows-empty", Sq=40, Sk=140, mask="document-rows", score="alibi"),
    _case(
        "sliding-and-document-gqa", B=2, H=4, Hkv=2, Sq=150, Sk=150, mask="sliding&document", w=50
    ),
    _case("softcap", Sq=33, Sk=140, score="softcap"),
    _case("alibi-causal", H=4, Sq=150, Sk=150, mask="causal", score="alibi"),
    _case(
        "alibi-then-softcap-sliding",
        quick=True,
        Sq=150,
        Sk=150,
        mask="sliding",
        w=40,
        score="alibi>>softcap",
    ),
    _case("bias-heads", H=3, Hkv=1, Sq=20, Sk=140, score="bias-h"),
    _case("bias-batch-pos60", B=2, Sq=20, Sk=140, score="bias-b", mask="causal", input_pos=60),
    _case("bias-full-gqa", B=2, H=4, Hkv=2, Sq=24, Sk=140, score="bias-bh"),
    _case("user-relpos-user-mask", H=2, Sq=140, Sk=140, mask="user", score="relpos"),
    _case("pair-features", B=2, Sq=30, Sk=140, score="pair", mask="causal", input_pos=110),
    _case("pair-features-grads", B=2, Sq=30, Sk=140, score="pair-grads"),
    _case("rows-fully-masked", Sq=64, Sk=140, mask="late", score="alibi"),
    _case("block-causal-16x32-gqa", B=2, H=4, Hkv=2, Sq=70, Sk=90, mask="causal", block=(16, 32)),
    _case(
        "block-sliding-document-bias",
        B=2,
        Sq=96,
        Sk=96,
        mask="sliding&document",
        w=20,
        score="bias-h",
        block=(32, 16),
    ),
    _case(
        "dense-path-sliding-document-alibi",
        B=2,
        Sq=150,
        Sk=150,
        mask="sliding&document",
        w=30,
        score="alibi",
        sparse=False,
    ),
    _case(
        "bshd-causal-alibi",
        B=2,
        H=4,
        Hkv=2,
        Sq=48,
        Sk=150,
        mask="causal",
        score="alibi",
        input_pos=102,
        layout="bshd",
    ),
    _case(
        "sq1-decode-alibi",
        B=2,
        H=4,
        Hkv=1,
        Sq=1,
        Sk=150,
        mask="causal",
        score="alibi",
        input_pos=[149, 77],
        scale=0.3,
    ),
]


# --------------------------------------------------------------------------- nonlinear mods, negative input_pos
# Score mods whose last operation is not linear in the score: their reverse mode reads the
# mod's own output (the backward must not shift it in place). Each runs on unmasked tiles,
# on tiles a block mask proves full, and on masked (PARTIAL) tiles. Negative input_pos is
# flash-attn's bottom-right causal alignment for Sq > Sk (input_pos = Sk - Sq): queries
# before the first key keep nothing.
_NONLINEAR_SCORES = {
    "silu": lambda s, b, h, q_idx, kv_idx: s / (1.0 + xm.exp(-s)),
    "tanh-cap1": lambda s, b, h, q_idx, kv_idx: xm.tanh(s),
    "exp": lambda s, b, h, q_idx, kv_idx: xm.exp(0.5 * s),
    "sqrt": lambda s, b, h, q_idx, kv_idx: xm.sqrt(s * s + 1.0),
}
CASES += [
    _case("silu-unmasked", Sq=40, Sk=150, score="silu"),
    _case("tanh-cap1-unmasked-gqa", H=4, Hkv=2, Sq=24, Sk=140, score="tanh-cap1"),
    _case("exp-unmasked", Sq=30, Sk=140, score="exp"),
    _case("sqrt-unmasked", Sq=30, Sk=140, score="sqrt"),
    _case(
        "silu-block-causal-full-tiles", Sq=64, Sk=64, mask="causal", score="silu", block=(16, 16)
    ),
    _case(
        "tanh-cap1-block-sliding",
        Sq=64,
        Sk=64,
        mask="sliding",
        w=20,
        score="tanh-cap1",
        block=(16, 16),
    ),
    _case("exp-causal-masked", Sq=48, Sk=48, mask="causal", score="exp"),
    _case("sqrt-document-b2", B=2, Sq=60, Sk=60, mask="document", score="sqrt"),
    _case("causal-bottom-right-sq-gt-sk", Sq=48, Sk=20, mask="causal", input_pos=-28),
    _case(
        "causal-bottom-right-per-batch-silu",
        B=2,
        Sq=40,
        Sk=24,
        mask="causal",
        score="silu",
        input_pos=[-16, -3],
    ),
    _case("causal-before-every-key", Sq=8, Sk=16, mask="causal", input_pos=-8),
]


# --------------------------------------------------------------------------- interpreter-sized
# Small enough for the Triton interpreter (16 x 16 tiles there), still crossing tile boundaries
# at odd lengths: every built-in mask and score, compositions, user mods, pair features with and
# without feature gradients, block masks at the kernel's tiles and at tiles it does not divide
# (each pair then reads its plan state), the dense path, BSHD and fully masked rows. They run
# in float32 and float16 only: bfloat16 flex runs in the larger cases above on array_api, and
# the triton kernels' bfloat16 path (operands widened under the interpreter) is the attention
# kernels', proven by the attention specs.
def _small(ident, **params):
    case = _case(f"small-{ident}", interpreter=True, **params)
    return dataclasses.replace(case, dtypes=("float32", "float16"))


CASES += [
    _small("nomod-gqa-dv24", H=4, Hkv=2, Sq=19, Sk=37, Dv=24),
    _small("causal-pos20", Sq=20, Sk=40, mask="causal", input_pos=20),
    _small("causal-pos-per-batch", B=2, Sq=18, Sk=35, mask="causal", input_pos=[0, 17]),
    _small("sliding-document-gqa", B=2, H=4, Hkv=2, Sq=40, Sk=40, mask="sliding&document", w=10),
    _small("prefix_lm7", Sq=33, Sk=33, mask="prefix_lm", n=7),
    _small("alibi-softcap-sliding", Sq=33, Sk=33, mask="sliding", w=9, score="alibi>>softcap"),
    _small("bias-batch-causal", B=2, Sq=17, Sk=40, score="bias-b", mask="causal", input_pos=23),
    _small("user-relpos-user-mask", Sq=36, Sk=36, mask="user", score="relpos"),
    _small("pair-features", B=2, Sq=20, Sk=34, score="pair", mask="causal", input_pos=14),
    _small("pair-features-grads", Sq=18, Sk=33, score="pair-grads"),
    _small("rows-fully-masked", Sq=40, Sk=40, mask="late", score="alibi"),
    _small("block-causal-16x32-gqa", H=4, Hkv=2, Sq=40, Sk=50, mask="causal", block=(16, 32)),
    _small(
        "block-12x20-sliding-document-bias",
        B=2,
        Sq=40,
        Sk=40,
        mask="sliding&document",
        w=10,
        score="bias-h",
        block=(12, 20),
    ),
    _small(
        "dense-path-document-alibi", B=2, Sq=33, Sk=33, mask="document", score="alibi", sparse=False
    ),
    _small("silu-causal", Sq=24, Sk=24, mask="causal", score="silu"),
    _small("sqrt-unmasked", Sq=20, Sk=30, score="sqrt"),
    _small(
        "bshd-causal-alibi",
        H=4,
        Hkv=2,
        Sq=20,
        Sk=30,
        mask="causal",
        score="alibi",
        input_pos=10,
        layout="bshd",
    ),
    _small("bottom-right-sq-gt-sk", Sq=40, Sk=18, mask="causal", input_pos=-22),
    _small(
        "sq1-decode-alibi",
        B=2,
        H=4,
        Hkv=1,
        Sq=1,
        Sk=40,
        mask="causal",
        score="alibi",
        input_pos=[39, 20],
        scale=0.3,
    ),
]


def _param_layout(p):
    """``(grad_shadow field, shape)`` of every learnable array, in ``params`` order."""
    batch, heads, _, sq, sk, _, _ = _dims(p)
    return {
        "alibi": [("slopes", (heads,))],
        "alibi>>softcap": [("0.slopes", (heads,))],
        "bias-h": [("bias", (1, heads, sq, sk))],
        "bias-b": [("bias", (batch, 1, sq, sk))],
        "bias-bh": [("bias", (batch, heads, sq, sk))],
        "relpos": [("table", (heads, 2 * RELATIVE + 1))],
        "pair": [("pair_proj", (heads, 3))],
        "pair-grads": [
            ("q_features", (batch, sq, 2)),
            ("k_features", (batch, sk, 2)),
            ("pair_proj", (heads, 3)),
        ],
    }.get(p["score"], [])


def _mods(p, arrays):
    """``(score_mod, mask_mod)`` of case ``p`` built from ``arrays`` (any namespace)."""
    pieces = unpack_params(_param_layout(p), arrays["params"])
    score = {
        None: lambda: None,
        "noop": xm.NoOpScore,
        "softcap": lambda: xm.SoftCapScore(1.5),
        "alibi": lambda: xm.AliBiScore(pieces["slopes"]),
        "alibi>>softcap": lambda: xm.AliBiScore(pieces["slopes"]) >> xm.SoftCapScore(2.0),
        "bias-h": lambda: xm.BiasScore(pieces["bias"]),
        "bias-b": lambda: xm.BiasScore(pieces["bias"]),
        "bias-bh": lambda: xm.BiasScore(pieces["bias"]),
        "relpos": lambda: xm.ScoreMod(relative_bias, table=pieces["table"]),
        "pair": lambda: xm.PairFeatureScore(
            pair_op, arrays["q_features"], arrays["k_features"], pieces["pair_proj"]
        ),
        "pair-grads": lambda: xm.PairFeatureScore(
            pair_op, pieces["q_features"], pieces["k_features"], pieces["pair_proj"]
        ),
        **{name: (lambda f=f: xm.ScoreMod(f)) for name, f in _NONLINEAR_SCORES.items()},
    }[p["score"]]()
    mask = {
        None: lambda: None,
        "full": xm.FullMask,
        "causal": xm.CausalMask,
        "sliding": lambda: xm.SlidingWindowMask(p["w"]),
        "prefix": lambda: xm.PrefixMask(p["n"]),
        "prefix_lm": lambda: xm.prefix_lm(p["n"]),
        "document": lambda: xm.DocumentMask(arrays["doc"]),
        "document-rows": lambda: xm.DocumentMask(arrays["doc_q"], arrays["doc_kv"]),
        "sliding&document": lambda: xm.SlidingWindowMask(p["w"]) & xm.DocumentMask(arrays["doc"]),
        "user": lambda: xm.MaskMod(user_mask),
        "late": lambda: xm.MaskMod(late),
    }[p["mask"]]()
    return score, mask


def _positions(p):
    return positions(p, p["B"])


def _grids(p):
    """Broadcastable ``b, h, q_row, q_idx, kv_idx`` NumPy index grids of rank 4."""
    return index_grids(p, p["B"], p["Sq"], p["Sk"])


def _naive(p, inputs):
    """Full float64 matrices: raw scores, probabilities, repeated K/V, output, m, l, the mods."""
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    return naive(p, q, k, v, _mods(p, inputs), _grids(p))


def _inputs(case, rng):
    p = case.params
    batch, _, _, sq, sk, _, _ = _dims(p)
    arrays = {**qkv(p, rng), "params": draw_params(_param_layout(p), rng)}
    if p["score"] == "pair":
        arrays["q_features"] = rng.standard_normal((batch, sq, 2))
        arrays["k_features"] = rng.standard_normal((batch, sk, 2))
    if p["mask"] in ("document", "sliding&document"):
        arrays["doc"] = np.sort(rng.integers(0, 4, size=(batch, sk)), axis=1)
    if p["mask"] == "document-rows":
        arrays["doc_q"] = rng.integers(0, 4, size=sq)
        arrays["doc_kv"] = rng.integers(0, 3, size=sk)
    return add_positions(p, arrays)


def _reference(case, inputs):
    st = _naive(case.params, inputs)
    return {"o": st["o"]}, {"m": st["m"], "l": st["l"]}


def _reference_backward(case, inputs, cotangents):
    p = case.params
    st = _naive(p, inputs)
    g, dv_rep = ref.score_gradient(st["probs"], st["o"], cotangents["o"], st["v_rep"])
    ds, fields = score_gradients(
        st["score_mod"], st["raw"], g, _grids(p), _positions(p), p["score"] == "pair-grads"
    )
    return {
        "q": ds @ st["k_rep"] * _scale(p),
        "k": ref.group_sum(np.swapaxes(ds, -1, -2) @ inputs["q"] * _scale(p), p["Hkv"]),
        "v": ref.group_sum(dv_rep, p["Hkv"]),
        "params": flat_params(_param_layout(p), fields),
    }


def _torch_reference(case, inputs, cotangents):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    p = case.params
    batch, heads, _, sq, sk, _, _ = _dims(p)
    t = {name: torch.tensor(a) for name, a in inputs.items()}
    for name in ("q", "k", "v", "params"):
        t[name].requires_grad_(True)
    pos = torch.tensor(_positions(p))
    constants = {name: a.detach() for name, a in t.items()}
    oracle_score, oracle_mask = _mods(p, constants)

    def torch_score(s, b, h, q_row, kv_idx):
        return oracle_score(s, b, h, q_row + pos[b], kv_idx, q_row=q_row)

    def torch_mask(b, h, q_row, kv_idx):
        keep = oracle_mask(b, h, q_row + pos[b], kv_idx, q_row=q_row)
        return keep if torch.is_tensor(keep) else torch.full_like(q_row, keep, dtype=torch.bool)

    block_mask = (
        None
        if oracle_mask is None
        else create_block_mask(torch_mask, batch, heads, sq, sk, device="cpu")
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        oracle = torch_flex(
            constants["q"],
            constants["k"],
            constants["v"],
            score_mod=None if oracle_score is None else torch_score,
            block_mask=block_mask,
            scale=_scale(p),
            enable_gqa=True,
        )
    score_mod, mask_mod = _mods(p, t)
    group = heads // p["Hkv"]
    k_rep, v_rep = (
        t["k"].repeat_interleave(group, dim=1),
        t["v"].repeat_interleave(group, dim=1),
    )
    s = t["q"] @ k_rep.transpose(-1, -2) * _scale(p)
    b, h, row, q_idx, kv_idx = (torch.tensor(a) for a in _grids(p))
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx, q_row=row)
    if mask_mod is not None:
        keep = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx, q_row=row))
        s = s.masked_fill(~torch.broadcast_to(keep, s.shape), -math.inf)
    valid = torch.isfinite(s).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(valid, s, 0.0), dim=-1) * valid
    (probs @ v_rep).backward(torch.tensor(cotangents["o"]))
    grads = {name: t[name].grad.numpy() for name in ("q", "k", "v")}
    grads["params"] = t["params"].grad.numpy() if t["params"].grad is not None else np.zeros(0)
    return {"o": oracle.numpy()}, grads


def _allocate_checkpoints(case, arrays):
    return allocate_checkpoints(flex_attention_, arrays["q"], arrays["k"], arrays["v"])


def _options(case, arrays):
    p = case.params
    score_mod, mask_mod = _mods(p, arrays)
    input_pos = arrays.get("input_pos", p["input_pos"])
    options = {
        "score_mod": score_mod,
        "scale": p["scale"],
        "input_pos": input_pos,
        "block_sparse": p["sparse"],
    }
    if p["block"] is None:
        options["mask_mod"] = mask_mod
    else:
        tile_m, tile_n = p["block"]
        options["block_mask"] = xm.build_block_mask(
            mask_mod,
            p["Sq"],
            p["Sk"],
            tile_m=tile_m,
            tile_n=tile_n,
            input_pos=input_pos,
            n_batch=p["B"],
            n_heads=p["H"],
        )
    return options


def _mod_grad(case, options):
    if not _param_layout(case.params):
        return None
    return grad_shadow(options["score_mod"], feature_grads=case.params["score"] == "pair-grads")


_forward_, _forward = attention_calls(flex_attention_, flex_attention, _options)
_backward_, _backward = backward_calls(
    "flex_attention",
    flex_attention_backward_,
    flex_attention_backward,
    _options,
    _mod_grad,
    _param_layout,
)


SPEC = OpSpec(
    name="flex_attention",
    outputs=("o",),
    cases=tuple(CASES),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=errors,
    checkpoint_names=("m", "l"),
    allocate_checkpoints=_allocate_checkpoints,
    arrange=arrange_qkv,
    backward=Backward(
        grad_names=("q", "k", "v", "params"),
        cotangents=cotangent_o,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
