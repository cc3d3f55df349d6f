"""The mod functions and helpers the FlexAttention specs share (no spec of its own)."""

from __future__ import annotations

import math

import numpy as np

from xpkernels import mods as xm
from xpkernels.buffers import Duplicated, allocate_scratchspace
from xpkernels.registry import BACKENDS
from xpkernels.testing import references as ref

from ._shared import no_arrays, scale_of

RELATIVE = 24


def relative_bias(score, b, h, q_idx, kv_idx, *, table):
    """A user score mod: a learnable bias per head and clamped relative position."""
    return score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -RELATIVE), RELATIVE) + RELATIVE]


def user_mask(b, h, q_idx, kv_idx):
    """A user mask mod: causal, dropping every fourth diagonal."""
    return xm.logical_and(kv_idx <= q_idx, (q_idx - kv_idx) % 4 != 3)


def late(b, h, q_idx, kv_idx):
    """Keys at least 30 positions back: the first 30 queries keep nothing."""
    return kv_idx + 30 <= q_idx


def pair_op(qv, kv):
    return [qv[0] * kv[0], xm.tanh(qv[1] - kv[1]), xm.abs(qv[0] - kv[1])]


def namespace(a):
    import array_api_compat

    return array_api_compat.array_namespace(a)


def reshape(a, shape):
    return namespace(a).reshape(a, shape)


def _field(name):
    """The learnable array's own name: a composed mod's fields are dotted (``0.slopes``)."""
    return name.split(".")[-1]


def draw_params(layout, rng):
    """The flat ``params`` input of ``layout``: slopes and relative tables at a small scale."""
    scales = {"slopes": 0.05, "table": 0.5}
    pieces = [
        rng.standard_normal(math.prod(shape)) * scales.get(_field(name), 1.0)
        for name, shape in layout
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0)


def unpack_params(layout, params) -> dict:
    """The learnable arrays of ``layout`` by name, as views of the flat ``params`` (any namespace)."""
    pieces, offset = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        pieces[_field(name)] = reshape(params[offset : offset + size], shape)
        offset += size
    return pieces


def positions(p, batch):
    """``input_pos`` as a ``(batch,)`` NumPy integer array."""
    return np.broadcast_to(np.asarray(p["input_pos"], dtype=np.int64), (batch,))


def index_grids(p, batch, sq, sk):
    """Broadcastable ``b, h, q_row, q_idx, kv_idx`` NumPy index grids of rank 4 over ``batch``
    sequences of ``sq`` queries and ``sk`` keys (``q_idx = input_pos[b] + q_row``)."""
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(p["H"])[None, :, None, None]
    row = np.arange(sq)[None, None, :, None]
    q_idx = row + positions(p, batch)[:, None, None, None]
    return b, h, row, q_idx, np.arange(sk)[None, None, None, :]


def naive(p, q, k, v, mods, grids, keep=np.True_):
    """Full float64 matrices of ``(B, H, S, D)`` inputs: raw scores, probabilities, repeated
    K/V, output, m, l and the score mod of ``mods = (score_mod, mask_mod)``, the mods called
    directly on the index ``grids``; ``keep`` (broadcastable) masks pairs before ``mask_mod``."""
    score_mod, mask_mod = mods
    group = p["H"] // p["Hkv"]
    k_rep, v_rep = ref.repeat_kv(k, group), ref.repeat_kv(v, group)
    raw = np.einsum("bhid,bhjd->bhij", q, k_rep) * scale_of(p)
    b, h, row, q_idx, kv_idx = grids
    s = raw
    if score_mod is not None:
        modified = score_mod(raw, b, h, q_idx, kv_idx, q_row=row)
        # Integer positions promote the mods' arithmetic to float64: back to the scores' dtype.
        s = np.broadcast_to(modified, raw.shape).astype(raw.dtype)
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


def score_gradients(score_mod, raw, g, grids, positions, feature_grads=False):
    """``(ds, fields)`` of the float64 reference: the gradient reaching the raw scores and the
    mod's parameter gradients by ``grad_shadow`` field (``g`` and none without a score mod).

    ``grids`` are the reference's ``b, h, q_row, q_idx, kv_idx`` index grids.
    """
    if score_mod is None:
        return g, {}
    b, h, _, q_idx, kv_idx = grids
    ds, tree = xm.score_grad(
        score_mod,
        raw,
        g,
        q_idx,
        kv_idx,
        b,
        h,
        input_pos=positions[:, None, None, None],
        feature_grads=feature_grads,
    )
    return ds, dict(tree.items())


def flat_params(layout, fields):
    """The parameter gradients ``fields`` concatenated in ``params`` order."""
    flat = [fields[name].reshape(-1) for name, _ in layout]
    return np.concatenate(flat) if flat else np.zeros(0)


def deterministic_for(backend, op="flex_attention") -> bool:
    """``deterministic`` of the backward calls: True (the default) unless ``backend`` cannot
    honour it with score-mod gradients (cupy sums them with float32 atomics), so that every
    backend runs the cases."""
    capability = next((b.ops.get(op) for b in BACKENDS if b.name == backend), None)
    return capability is None or "deterministic_score_mod_grad" not in capability.lacks


def backward_calls(op, inplace, allocating, options, mod_grad, layout, positional=no_arrays):
    """``(backward_, backward)`` of a FlexAttention spec: ``options(case, arrays)`` plus
    ``deterministic`` as keywords, ``positional(arrays)`` after ``v`` (and ``o``), the score
    mod's gradients from ``mod_grad(case, options)`` written into ``params`` by ``layout(p)``."""

    def backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
        kw = {**options(case, arrays), "deterministic": deterministic_for(backend, op)}
        O = Duplicated(outs["o"], cotangents["o"])
        Q, K, V = (Duplicated(arrays[n], grads[n]) for n in ("q", "k", "v"))
        shadow = mod_grad(case, kw)
        scratch = allocate_scratchspace(
            inplace, O, Q, K, V, *positional(arrays), score_mod_grad=shadow, **kw, backend=backend
        )
        inplace(
            O,
            Q,
            K,
            V,
            *positional(arrays),
            checkpoints=checkpoints,
            scratch=scratch,
            score_mod_grad=shadow,
            **kw,
            backend=backend,
        )
        write_params(layout(case.params), shadow, grads["params"])

    def backward(case, arrays, outs, cotangents, checkpoints, backend):
        kw = {**options(case, arrays), "deterministic": deterministic_for(backend, op)}
        shadow = mod_grad(case, kw)
        dq, dk, dv = allocating(
            cotangents["o"],
            *(arrays[n] for n in ("q", "k", "v")),
            outs["o"],
            *positional(arrays),
            checkpoints=checkpoints,
            score_mod_grad=shadow,
            **kw,
            backend=backend,
        )
        params = namespace(arrays["params"]).empty_like(arrays["params"])
        write_params(layout(case.params), shadow, params)
        return {"q": dq, "k": dk, "v": dv, "params": params}

    return backward_, backward


def write_params(layout, mod_grad, out) -> None:
    """Copy the mod's gradient accumulators into the flat ``params`` gradient ``out``.

    ``layout`` lists ``(grad_shadow field, shape)`` in ``params`` order.
    """
    if mod_grad is None:
        return
    xp = namespace(out)
    fields = dict(mod_grad.items())
    offset = 0
    for name, shape in layout:
        size = math.prod(shape)
        out[offset : offset + size] = xp.astype(xp.reshape(fields[name], (size,)), out.dtype)
        offset += size
