"""Packed variable-length FlexAttention: conformance declaration.

Inputs are packed as in :mod:`.attention_varlen`, and the learnable arrays the
score mod captures travel as one flat input ``params``, as in
:mod:`.flex_attention`. The float64 reference scatters the sequences into a
padded ``(B, H, S, D)`` batch, applies the mods by calling their functions on
NumPy index grids (``b`` the sequence index, ``q_idx = input_pos[b] + i``,
``kv_idx = j``, both counted from the sequence's start), masks the padding
and gathers the rows back: the contract checked is "each sequence alone
through flex_attention". Parameter gradients come from the traced graph's
reverse mode on the host (:func:`xpkernels.mods.score_grad`), as flex's.
PyTorch has no packed flex op: no torch oracle.
"""

from __future__ import annotations

import functools

import numpy as np

from xpkernels import mods as xm
from xpkernels.attention_varlen import attention_varlen_
from xpkernels.buffers import Duplicated, allocate_checkpoints, grad_shadow
from xpkernels.flex_attention_varlen import (
    flex_attention_varlen,
    flex_attention_varlen_,
    flex_attention_varlen_backward,
    flex_attention_varlen_backward_,
)
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, ErrorCase, OpSpec
from xpkernels.testing.specs._flex_mods import (
    backward_calls,
    draw_params,
    flat_params,
    index_grids,
    naive,
    positions,
    score_gradients,
    unpack_params,
)
from xpkernels.testing.specs._shared import attention_calls, varlen_case
from xpkernels.testing.specs.attention_varlen import (
    ERROR_K_LENS,
    ERROR_Q_LENS,
    PREFIX_SUMS,
    _allocate_outputs,
    _cotangents,
    _cu,
    _packed,
    _padded,
    _prefix_sums,
    _scale,
    cu_ints,
    error_arrays,
    error_forward,
    padded_qkv,
)
from xpkernels.testing.specs.attention_varlen import _inputs as _packed_inputs

_BASE = {
    "H": 2,
    "Hkv": 2,
    "D": 16,
    "Dv": None,
    "scale": None,
    "input_pos": 0,
    "score": None,
    "mask": None,
    "w": 5,
    "sparse": True,
}


_case = functools.partial(varlen_case, "flex_attention_varlen", _BASE)


CASES = [
    _case("nomod-gqa2-empty-queries", (5, 0, 17), (9, 4, 20), quick=True, H=4, Hkv=2),
    _case(
        "causal-bottom-right-alibi",
        (7, 3, 20),
        (12, 9, 30),
        mask="causal",
        score="alibi",
        input_pos="bottom_right",
    ),
    _case(
        "sliding5-per-sequence-temperature", (10, 1, 25), (10, 6, 25), mask="sliding", score="temp"
    ),
    _case(
        "relpos-user-mask-dense",
        (16, 9),
        (16, 12),
        mask="user",
        score="relpos",
        sparse=False,
        input_pos=[0, 3],
    ),
    _case(
        "empty-keys-one-token-softcap",
        (1, 4, 1, 2),
        (0, 1, 3, 0),
        mask="causal",
        score="softcap",
        input_pos=[0, 0, 2, 1],
    ),
    _case(
        "mqa4-dv-ne-d-temperature-causal",
        (10, 30),
        (25, 3),
        H=4,
        Hkv=1,
        D=24,
        Dv=8,
        mask="causal",
        score="temp",
        scale=0.3,
    ),
]

#: Clamp of the relative positions the "relpos" table covers: ``(H, 2R + 1)`` entries.
_RELATIVE = 6


def _temperature(score, b, h, q_idx, kv_idx, *, temp):
    """A learnable temperature per sequence: reads ``b`` as the sequence index."""
    return score * temp[b]


def _relative_bias(score, b, h, q_idx, kv_idx, *, table):
    return (
        score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -_RELATIVE), _RELATIVE) + _RELATIVE]
    )


def _user_mask(b, h, q_idx, kv_idx):
    """Causal, dropping every third diagonal."""
    return xm.logical_and(kv_idx <= q_idx, (q_idx - kv_idx) % 3 != 2)


def _param_layout(p):
    """``(grad_shadow field, shape)`` of every learnable array, in ``params`` order."""
    return {
        "alibi": [("slopes", (p["H"],))],
        "temp": [("temp", (len(p["q_lens"]),))],
        "relpos": [("table", (p["H"], 2 * _RELATIVE + 1))],
    }.get(p["score"], [])


def _mods(p, arrays):
    """``(score_mod, mask_mod)`` of case ``p`` built from ``arrays`` (any namespace)."""
    pieces = unpack_params(_param_layout(p), arrays["params"])
    score = {
        None: lambda: None,
        "softcap": lambda: xm.SoftCapScore(1.5),
        "alibi": lambda: xm.AliBiScore(pieces["slopes"]),
        "temp": lambda: xm.ScoreMod(_temperature, temp=pieces["temp"]),
        "relpos": lambda: xm.ScoreMod(_relative_bias, table=pieces["table"]),
    }[p["score"]]()
    mask = {
        None: lambda: None,
        "causal": xm.CausalMask,
        "sliding": lambda: xm.SlidingWindowMask(p["w"]),
        "user": lambda: xm.MaskMod(_user_mask),
    }[p["mask"]]()
    return score, mask


def _positions(p):
    return positions(p, len(p["q_lens"]))


def _grids(p):
    """Broadcastable ``b, h, q_row, q_idx, kv_idx`` index grids of the padded batch."""
    sq, sk = max(max(p["q_lens"]), 1), max(max(p["k_lens"]), 1)
    return index_grids(p, len(p["q_lens"]), sq, sk)


def _naive(p, inputs):
    """Full float64 matrices of the padded batch (:func:`._flex_mods.naive`), the padding masked."""
    q, k, v = padded_qkv(p, inputs)
    grids = _grids(p)
    _, _, row, _, kv_idx = grids
    lens_q = np.asarray(p["q_lens"])[:, None, None, None]
    lens_k = np.asarray(p["k_lens"])[:, None, None, None]
    keep = (row < lens_q) & (kv_idx < lens_k)
    return naive(p, q, k, v, _mods(p, inputs), grids, keep)


def _inputs(case, rng):
    """Packed attention's inputs, then the flat ``params``."""
    return {**_packed_inputs(case, rng), "params": draw_params(_param_layout(case.params), rng)}


def _reference(case, inputs):
    p = case.params
    st = _naive(p, inputs)
    lens = p["q_lens"]
    return {"o": _packed(st["o"], lens)}, {"m": _packed(st["m"], lens), "l": _packed(st["l"], lens)}


def _reference_backward(case, inputs, cotangents):
    p = case.params
    st = _naive(p, inputs)
    do = _padded(cotangents["o"], p["q_lens"])
    g, dv_rep = ref.score_gradient(st["probs"], st["o"], do, st["v_rep"])
    ds, fields = score_gradients(st["score_mod"], st["raw"], g, _grids(p), _positions(p))
    dq = ds @ st["k_rep"] * _scale(p)
    dk = ref.group_sum(np.swapaxes(ds, -1, -2) @ st["q"] * _scale(p), p["Hkv"])
    return {
        "q": _packed(dq, p["q_lens"]),
        "k": _packed(dk, p["k_lens"]),
        "v": _packed(ref.group_sum(dv_rep, p["Hkv"]), p["k_lens"]),
        "params": flat_params(_param_layout(p), fields),
    }


def _allocate_checkpoints(case, arrays):
    return allocate_checkpoints(flex_attention_varlen_, arrays["q"], arrays["k"], arrays["v"])


def _options(case, arrays):
    p = case.params
    score_mod, mask_mod = _mods(p, arrays)
    return {
        "score_mod": score_mod,
        "mask_mod": mask_mod,
        "block_sparse": p["sparse"],
        "scale": p["scale"],
        "input_pos": arrays.get("input_pos", p["input_pos"]),
    }


def _mod_grad(case, options):
    return grad_shadow(options["score_mod"]) if _param_layout(case.params) else None


_forward_, _forward = attention_calls(
    flex_attention_varlen_, flex_attention_varlen, _options, _prefix_sums
)
_backward_, _backward = backward_calls(
    "flex_attention_varlen",
    flex_attention_varlen_backward_,
    flex_attention_varlen_backward,
    _options,
    _mod_grad,
    _param_layout,
    _prefix_sums,
)


def _errors():
    def temperature(t, n):
        return xm.ScoreMod(_temperature, temp=t.full((n,), 1.0, "float32"))

    forward = functools.partial(error_forward, flex_attention_varlen_)

    def backward(forward_fn, **options):
        def call(t):
            q, k, v, o = error_arrays(t)
            resolved = {n: f(t) if callable(f) else f for n, f in options.items()}
            ck = allocate_checkpoints(forward_fn, q, k, v)
            cu_q, cu_k = cu_ints(_cu(ERROR_Q_LENS))(t), cu_ints(_cu(ERROR_K_LENS))(t)
            forward_fn(o, q, k, v, cu_q, cu_k, checkpoints=ck)
            O = Duplicated(o, t.full(o.shape, 1.0, "float32"))
            Q, K, V = (Duplicated(a, t.full(a.shape, 0.0, "float32")) for a in (q, k, v))
            flex_attention_varlen_backward_(O, Q, K, V, cu_q, cu_k, checkpoints=ck, **resolved)

        return call

    return [
        *declared_errors("flex_attention_varlen", values=PREFIX_SUMS),
        ErrorCase(
            "cu-q-decreasing",
            forward(cu_q=cu_ints([0, 3, 2, 8])),
            ValueError,
            r"cu_seqlens_q must be non-decreasing",
            values=True,
        ),
        ErrorCase(
            "mod-table-shorter-than-the-batch",
            forward(score_mod=lambda t: temperature(t, 2)),
            ValueError,
            r"temp \(shape \(2,\)\) is indexed on axis 0 by values in \[0, 2\] .*b < 3",
        ),
        ErrorCase(
            "checkpoints-of-attention-varlen",
            backward(attention_varlen_),
            ValueError,
            r"checkpoints were written by attention_varlen_, not by flex_attention_varlen_",
        ),
        ErrorCase(
            "mask-differs-from-the-forward",
            backward(flex_attention_varlen_, mask_mod=lambda t: xm.CausalMask()),
            ValueError,
            r"mask_mod=.* differs from the forward",
        ),
    ]


SPEC = OpSpec(
    name="flex_attention_varlen",
    outputs=("o",),
    cases=tuple(CASES),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    checkpoint_names=("m", "l"),
    allocate_checkpoints=_allocate_checkpoints,
    backward=Backward(
        grad_names=("q", "k", "v", "params"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
)
