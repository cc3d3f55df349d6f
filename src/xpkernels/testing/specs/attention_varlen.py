"""Packed variable-length attention: conformance declaration.

Inputs are packed ``q (Tq, H, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)``
with int32 prefix sums ``cu_seqlens_q``/``cu_seqlens_k`` (and a ``(B,)``
``input_pos`` where a case gives one). The float64 reference scatters the
sequences into a padded ``(B, H, S, D)`` batch, runs the materialised
attention reference with ``q_lengths``/``k_lengths`` masks (no tiling) and
gathers the rows back; so the contract checked is "each sequence alone".
PyTorch has no varlen attention op: no torch oracle.
"""

from __future__ import annotations

import functools

import numpy as np

import xpkernels as xk
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, prefix_sums
from xpkernels.testing.harness import Backward, ErrorCase, OpSpec

from ._shared import (
    add_positions,
    attention_backward_calls,
    attention_calls,
    host_ints,
    varlen_case,
)
from ._shared import scale_of as _scale

_BASE = {"H": 2, "Hkv": 2, "D": 16, "Dv": None, "causal": False, "scale": None, "input_pos": 0}
_case = functools.partial(varlen_case, "attention_varlen", _BASE)


CASES = [
    _case("b3-gqa2-empty-queries", (5, 0, 17), (9, 4, 20), quick=True, H=4, Hkv=2),
    _case("causal-top-left-sq-ne-sk", (7, 1, 20), (12, 1, 9), causal=True),
    _case("causal-bottom-right", (7, 3, 20), (12, 9, 30), causal=True, input_pos="bottom_right"),
    _case("empty-keys-one-token", (1, 4, 1, 2), (0, 1, 3, 0), causal=True, input_pos=[0, 0, 2, 1]),
    _case("mqa4-dv-ne-d", (10, 30), (25, 3), H=4, Hkv=1, D=24, Dv=8),
    _case("scale-0.3-b1", (33,), (18,), causal=True, scale=0.3, input_pos=-4),
    _case(
        "d64-causal-b4",
        (100, 37, 0, 250),
        (130, 37, 64, 250),
        interpreter=False,
        H=4,
        Hkv=2,
        D=64,
        causal=True,
        input_pos="bottom_right",
    ),
]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def _dims(p):
    return p["H"], p["Hkv"], p["D"], p["Dv"] or p["D"]


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
    return add_positions(p, arrays)


def _padded(a, lengths):
    """Packed ``(T, H, X)`` as a zero-padded ``(B, H, max(lengths), X)`` batch."""
    out = np.zeros((len(lengths), a.shape[1], max(max(lengths), 1), a.shape[2]), dtype=a.dtype)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :, :n] = a[start : start + n].transpose(1, 0, 2)
        start += n
    return out


def _packed(a, lengths):
    """The inverse of :func:`_padded` for ``(B, H, S, X)`` or ``(B, H, S)`` arrays: ``(T, H, X)`` / ``(H, T)``."""
    parts = [a[b, :, :n] for b, n in enumerate(lengths)]
    if a.ndim == 3:
        return np.concatenate(parts, axis=1)
    return np.concatenate([part.transpose(1, 0, 2) for part in parts], axis=0)


def padded_qkv(p, inputs):
    """The packed ``q``, ``k``, ``v`` as zero-padded ``(B, H, S, X)`` batches."""
    q = _padded(inputs["q"], p["q_lens"])
    k, v = (_padded(inputs[n], p["k_lens"]) for n in ("k", "v"))
    return q, k, v


def _keep(p):
    q_lens, k_lens = p["q_lens"], p["k_lens"]
    return ref.attention_keep(
        len(q_lens),
        max(max(q_lens), 1),
        max(max(k_lens), 1),
        causal=p["causal"],
        input_pos=p["input_pos"],
        q_lengths=q_lens,
        k_lengths=k_lens,
    )


def _reference(case, inputs):
    p = case.params
    q, k, v = padded_qkv(p, inputs)
    o, m, l_sum, _ = ref.attention(q, k, v, scale=_scale(p), keep=_keep(p))
    lens = p["q_lens"]
    return {"o": _packed(o, lens)}, {"m": _packed(m, lens), "l": _packed(l_sum, lens)}


def _cotangents(case, rng):
    p = case.params
    heads, _, _, dv = _dims(p)
    return {"o": rng.standard_normal((sum(p["q_lens"]), heads, dv))}


def _reference_backward(case, inputs, cotangents):
    p = case.params
    q, k, v = padded_qkv(p, inputs)
    do = _padded(cotangents["o"], p["q_lens"])
    dq, dk, dv = ref.attention_backward(q, k, v, do, scale=_scale(p), keep=_keep(p))
    return {
        "q": _packed(dq, p["q_lens"]),
        "k": _packed(dk, p["k_lens"]),
        "v": _packed(dv, p["k_lens"]),
    }


def _allocate_outputs(case, arrays, target, dtype):
    p = case.params
    heads, _, _, dv = _dims(p)
    return {"o": target.full((sum(p["q_lens"]), heads, dv), np.nan, dtype)}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.attention_varlen_, arrays["q"], arrays["k"], arrays["v"])


def _options(case, arrays):
    p = case.params
    return {
        "causal": p["causal"],
        "scale": p["scale"],
        "input_pos": arrays.get("input_pos", p["input_pos"]),
    }


def _prefix_sums(arrays):
    return arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]


_forward_, _forward = attention_calls(
    xk.attention_varlen_, xk.attention_varlen, _options, _prefix_sums
)
_backward_, _backward = attention_backward_calls(
    xk.attention_varlen_backward_, xk.attention_varlen_backward, _options, _prefix_sums
)


#: Valid prefix sums of the generated calls: the packed tokens split into the B sequences.
PREFIX_SUMS = {"cu_seqlens_q": prefix_sums("Tq"), "cu_seqlens_k": prefix_sums("Tk")}


#: The packed sequences of the hand-written error cases: ``Tq = 8``, ``Tk = 8``.
ERROR_Q_LENS, ERROR_K_LENS = (3, 0, 5), (4, 2, 2)
ERROR_TQ, ERROR_TK = sum(ERROR_Q_LENS), sum(ERROR_K_LENS)


def cu_ints(values):
    """``target -> values`` as int32 prefix sums on the target."""
    return host_ints(values, "int32")


def error_arrays(t):
    """``(q, k, v, o)`` of the error cases: 4 query heads over 2 kv heads, ``Dv = 8``."""
    q = t.full((ERROR_TQ, 4, 16), 0.5, "float32")
    k = t.full((ERROR_TK, 2, 16), 0.5, "float32")
    v = t.full((ERROR_TK, 2, 8), 0.5, "float32")
    return q, k, v, t.full((ERROR_TQ, 4, 8), 0.0, "float32")


def error_forward(fn, cu_q=None, cu_k=None, **options):
    """The call ``fn(o, q, k, v, cu_q, cu_k, **options)`` on the error arrays; an option that
    is a function of the target is called there."""
    cu_q = cu_q or cu_ints(_cu(ERROR_Q_LENS))
    cu_k = cu_k or cu_ints(_cu(ERROR_K_LENS))

    def call(t):
        q, k, v, o = error_arrays(t)
        resolved = {n: f(t) if callable(f) else f for n, f in options.items()}
        fn(o, q, k, v, cu_q(t), cu_k(t), **resolved)

    return call


def _errors():
    """What the declaration cannot say: values of the prefix sums and ``max_seqlen_q``, GQA head
    counts (the generic cases come from :func:`declared_errors`)."""
    forward = functools.partial(error_forward, xk.attention_varlen_)
    return [
        *declared_errors("attention_varlen", values=PREFIX_SUMS),
        ErrorCase(
            "cu-q-decreasing",
            forward(cu_q=cu_ints([0, 3, 2, 8])),
            ValueError,
            r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3",
            values=True,
        ),
        ErrorCase(
            "cu-k-not-starting-at-0",
            forward(cu_k=cu_ints([1, 4, 6, 8])),
            ValueError,
            r"cu_seqlens_k must start at 0, got cu_seqlens_k\[0\] = 1",
            values=True,
        ),
        ErrorCase(
            "cu-q-last-not-Tq",
            forward(cu_q=cu_ints([0, 3, 3, 7])),
            ValueError,
            r"cu_seqlens_q must end at the packed length Tq = 8 of the queries, got cu_seqlens_q\[-1\] = 7",
            values=True,
        ),
        ErrorCase(
            "max-seqlen-q-too-small",
            forward(max_seqlen_q=4),
            ValueError,
            r"max_seqlen_q must be at least the longest sequence \(5\), got 4",
            values=True,
        ),
        ErrorCase(
            "gqa-heads",
            lambda t: xk.attention_varlen_(
                t.full((ERROR_TQ, 3, 8), 0.0, "float32"),
                t.full((ERROR_TQ, 3, 16), 0.5, "float32"),
                t.full((ERROR_TK, 2, 16), 0.5, "float32"),
                t.full((ERROR_TK, 2, 8), 0.5, "float32"),
                cu_ints(_cu(ERROR_Q_LENS))(t),
                cu_ints(_cu(ERROR_K_LENS))(t),
            ),
            ValueError,
            r"the H=3 query heads of q must be a multiple of the Hkv=2 kv heads",
        ),
    ]


SPEC = OpSpec(
    name="attention_varlen",
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
        grad_names=("q", "k", "v"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
)
