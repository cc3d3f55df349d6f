"""The mod functions and helpers the FlexAttention specs share (no spec of its own)."""

from __future__ import annotations

import math

from xpkernels import mods as xm

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
