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

import math

import numpy as np

from xpkernels import mods as xm
from xpkernels.attention_varlen import attention_varlen_
from xpkernels.buffers import Duplicated, allocate_checkpoints, allocate_scratchspace, grad_shadow
from xpkernels.flex_attention_varlen import (
    flex_attention_varlen,
    flex_attention_varlen_,
    flex_attention_varlen_backward,
    flex_attention_varlen_backward_,
)
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec
from xpkernels.testing.specs._flex_mods import namespace, write_params
from xpkernels.testing.specs.attention_varlen import PREFIX_SUMS, _cu, _packed, _padded
from xpkernels.testing.specs.flex_attention import _reshape, deterministic_for

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


def _case(ident, q_lens, k_lens, interpreter=True, quick=False, **params):
    unknown = set(params) - set(_BASE)
    if unknown:
        raise TypeError(f"flex_attention_varlen case {ident}: unknown parameters {sorted(unknown)}")
    p = {**_BASE, **params, "q_lens": tuple(q_lens), "k_lens": tuple(k_lens)}
    if p["input_pos"] == "bottom_right":  # the last query of each sequence sees its last key
        p["input_pos"] = [sk - sq for sq, sk in zip(q_lens, k_lens)]
    return Case(ident, p, interpreter=interpreter, quick=quick)


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
    params = arrays["params"]
    pieces, offset = {}, 0
    for name, shape in _param_layout(p):
        size = math.prod(shape)
        pieces[name] = _reshape(params[offset : offset + size], shape)
        offset += size
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


def _dims(p):
    return p["H"], p["Hkv"], p["D"], p["Dv"] or p["D"]


def _scale(p):
    return p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(p["D"])


def _positions(p):
    """``input_pos`` as a ``(B,)`` NumPy integer array."""
    return np.broadcast_to(np.asarray(p["input_pos"], dtype=np.int64), (len(p["q_lens"]),))


def _grids(p):
    """Broadcastable ``b, h, q_row, q_idx, kv_idx`` index grids of the padded batch."""
    heads = p["H"]
    sq, sk = max(max(p["q_lens"]), 1), max(max(p["k_lens"]), 1)
    b = np.arange(len(p["q_lens"]))[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    row = np.arange(sq)[None, None, :, None]
    return b, h, row, row + _positions(p)[:, None, None, None], np.arange(sk)[None, None, None, :]


def _naive(p, inputs):
    """Full float64 matrices of the padded batch: raw scores, probabilities, repeated K/V, output."""
    score_mod, mask_mod = _mods(p, inputs)
    q = _padded(inputs["q"], p["q_lens"])
    k, v = (_padded(inputs[n], p["k_lens"]) for n in ("k", "v"))
    group = p["H"] // p["Hkv"]
    k_rep, v_rep = ref.repeat_kv(k, group), ref.repeat_kv(v, group)
    raw = np.einsum("bhid,bhjd->bhij", q, k_rep) * _scale(p)
    b, h, row, q_idx, kv_idx = _grids(p)
    s = raw
    if score_mod is not None:
        modified = score_mod(raw, b, h, q_idx, kv_idx, q_row=row)
        s = np.broadcast_to(modified, raw.shape).astype(raw.dtype)
    lens_q = np.asarray(p["q_lens"])[:, None, None, None]
    lens_k = np.asarray(p["k_lens"])[:, None, None, None]
    keep = (row < lens_q) & (kv_idx < lens_k)
    if mask_mod is not None:
        keep = keep & mask_mod(b, h, q_idx, kv_idx, q_row=row)
    probs, m, l_sum = ref.masked_softmax(s, np.broadcast_to(keep, raw.shape))
    return {
        "q": q,
        "raw": raw,
        "probs": probs,
        "k_rep": k_rep,
        "v_rep": v_rep,
        "o": probs @ v_rep,
        "m": m,
        "l": l_sum,
        "score_mod": score_mod,
    }


def _inputs(case, rng):
    p = case.params
    heads, kv_heads, d, dv = _dims(p)
    tq, tk = sum(p["q_lens"]), sum(p["k_lens"])
    arrays = {
        "q": rng.standard_normal((tq, heads, d)),
        "k": rng.standard_normal((tk, kv_heads, d)),
        "v": rng.standard_normal((tk, kv_heads, dv)),
        "cu_seqlens_q": _cu(p["q_lens"]),
        "cu_seqlens_k": _cu(p["k_lens"]),
    }
    scales = {"slopes": 0.05, "table": 0.5}
    pieces = [
        rng.standard_normal(math.prod(shape)) * scales.get(name, 1.0)
        for name, shape in _param_layout(p)
    ]
    arrays["params"] = np.concatenate(pieces) if pieces else np.zeros(0)
    if not isinstance(p["input_pos"], int):
        arrays["input_pos"] = np.asarray(p["input_pos"], dtype=np.int64)
    return arrays


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
    ds, fields = g, {}
    if st["score_mod"] is not None:
        b, h, _, q_idx, kv_idx = _grids(p)
        ds, tree = xm.score_grad(
            st["score_mod"],
            st["raw"],
            g,
            q_idx,
            kv_idx,
            b,
            h,
            input_pos=_positions(p)[:, None, None, None],
        )
        fields = dict(tree.items())
    flat = [fields[name].reshape(-1) for name, _ in _param_layout(p)]
    dq = ds @ st["k_rep"] * _scale(p)
    dk = ref.group_sum(np.swapaxes(ds, -1, -2) @ st["q"] * _scale(p), p["Hkv"])
    return {
        "q": _packed(dq, p["q_lens"]),
        "k": _packed(dk, p["k_lens"]),
        "v": _packed(ref.group_sum(dv_rep, p["Hkv"]), p["k_lens"]),
        "params": np.concatenate(flat) if flat else np.zeros(0),
    }


def _cotangents(case, rng):
    p = case.params
    heads, _, _, dv = _dims(p)
    return {"o": rng.standard_normal((sum(p["q_lens"]), heads, dv))}


def _allocate_outputs(case, arrays, target, dtype):
    p = case.params
    heads, _, _, dv = _dims(p)
    return {"o": target.full((sum(p["q_lens"]), heads, dv), np.nan, dtype)}


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


def _prefix_sums(arrays):
    return arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]


def _mod_grad(case, options):
    return grad_shadow(options["score_mod"]) if _param_layout(case.params) else None


def _forward_(case, arrays, outs, checkpoints, backend):
    flex_attention_varlen_(
        outs["o"],
        arrays["q"],
        arrays["k"],
        arrays["v"],
        *_prefix_sums(arrays),
        **_options(case, arrays),
        checkpoints=checkpoints,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    o = flex_attention_varlen(
        arrays["q"],
        arrays["k"],
        arrays["v"],
        *_prefix_sums(arrays),
        **_options(case, arrays),
        checkpoints=checkpoints,
        backend=backend,
    )
    return {"o": o}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    options = {
        **_options(case, arrays),
        "deterministic": deterministic_for(backend, "flex_attention_varlen"),
    }
    O = Duplicated(outs["o"], cotangents["o"])
    Q, K, V = (Duplicated(arrays[n], grads[n]) for n in ("q", "k", "v"))
    mod_grad = _mod_grad(case, options)
    scratch = allocate_scratchspace(
        flex_attention_varlen_backward_,
        O,
        Q,
        K,
        V,
        *_prefix_sums(arrays),
        score_mod_grad=mod_grad,
        **options,
        backend=backend,
    )
    flex_attention_varlen_backward_(
        O,
        Q,
        K,
        V,
        *_prefix_sums(arrays),
        checkpoints=checkpoints,
        scratch=scratch,
        score_mod_grad=mod_grad,
        **options,
        backend=backend,
    )
    write_params(_param_layout(case.params), mod_grad, grads["params"])


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    options = {
        **_options(case, arrays),
        "deterministic": deterministic_for(backend, "flex_attention_varlen"),
    }
    mod_grad = _mod_grad(case, options)
    dq, dk, dv = flex_attention_varlen_backward(
        cotangents["o"],
        arrays["q"],
        arrays["k"],
        arrays["v"],
        outs["o"],
        *_prefix_sums(arrays),
        checkpoints=checkpoints,
        score_mod_grad=mod_grad,
        **options,
        backend=backend,
    )
    xp = namespace(arrays["params"])
    params = xp.empty_like(arrays["params"])
    write_params(_param_layout(case.params), mod_grad, params)
    return {"q": dq, "k": dk, "v": dv, "params": params}


def _errors():
    q_lens, k_lens = (3, 0, 5), (4, 2, 2)
    tq, tk = sum(q_lens), sum(k_lens)

    def ints(values, dtype="int32"):
        return lambda t: t.asarray(np.asarray(values, dtype=dtype))

    def make(t):
        q = t.full((tq, 4, 16), 0.5, "float32")
        k = t.full((tk, 2, 16), 0.5, "float32")
        v = t.full((tk, 2, 8), 0.5, "float32")
        return q, k, v, t.full((tq, 4, 8), 0.0, "float32")

    def temperature(t, n):
        return xm.ScoreMod(_temperature, temp=t.full((n,), 1.0, "float32"))

    def forward(cu_q=ints(_cu(q_lens)), cu_k=ints(_cu(k_lens)), **options):
        def call(t):
            q, k, v, o = make(t)
            resolved = {n: f(t) if callable(f) else f for n, f in options.items()}
            flex_attention_varlen_(o, q, k, v, cu_q(t), cu_k(t), **resolved)

        return call

    def backward(forward_fn, **options):
        def call(t):
            q, k, v, o = make(t)
            resolved = {n: f(t) if callable(f) else f for n, f in options.items()}
            ck = allocate_checkpoints(forward_fn, q, k, v)
            cu_q, cu_k = ints(_cu(q_lens))(t), ints(_cu(k_lens))(t)
            forward_fn(o, q, k, v, cu_q, cu_k, checkpoints=ck)
            O = Duplicated(o, t.full(o.shape, 1.0, "float32"))
            Q, K, V = (Duplicated(a, t.full(a.shape, 0.0, "float32")) for a in (q, k, v))
            flex_attention_varlen_backward_(O, Q, K, V, cu_q, cu_k, checkpoints=ck, **resolved)

        return call

    return [
        *declared_errors("flex_attention_varlen", values=PREFIX_SUMS),
        ErrorCase(
            "cu-q-decreasing",
            forward(cu_q=ints([0, 3, 2, 8])),
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
