"""The naive references of every primitive: whole matrices, no tiling, NumPy only.

These are the one copy of each primitive's formula in the project (the
conformance specs, ``tests/`` and ``python -m xpkernels check`` all call
them). They share no code with ``backends/``. Every function keeps the dtype
of its float inputs (Python scalars are weak under NumPy 2), so the same
formula gives the float64 reference and, run on inputs cast to a lower
precision, the "straightforward same-dtype implementation" whose error sets
the tolerances (:mod:`xpkernels.testing.tolerances`).

Shapes are the contract's (DESIGN section 3): rows ``(..., M)`` for the
norms and softmax, ``(B, H, S, D)`` for attention. Row statistics come back
with the leading shape (``(...,)``), not flattened.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "rms_norm_rstd",
    "rms_norm",
    "rms_norm_backward",
    "layer_norm_stats",
    "layer_norm",
    "layer_norm_backward",
    "softmax",
    "softmax_backward",
    "swiglu",
    "swiglu_backward",
    "geglu",
    "geglu_backward",
    "rope",
    "cross_entropy_rows",
    "cross_entropy_rows_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "attention_keep",
    "repeat_kv",
    "group_sum",
    "masked_softmax",
    "attention",
    "score_gradient",
    "attention_backward",
    "decode_attention",
    "gather_pages",
    "merge_attention_states",
    "merge_attention_states_backward",
]


def _sum_rows(a: np.ndarray) -> np.ndarray:
    """Sum over every axis but the last: ``(..., M) -> (M,)``."""
    return np.sum(a.reshape(-1, a.shape[-1]), axis=0)


# --------------------------------------------------------------------------- rows


def rms_norm_rstd(x: np.ndarray, eps: float) -> np.ndarray:
    """``1 / sqrt(mean(x**2) + eps)`` per row, shape ``(...,)``."""
    return 1 / np.sqrt(np.mean(x * x, axis=-1) + eps)


def rms_norm(x, w, *, eps, offset=0.0, rstd=None):
    """``(y, rstd)``: ``y = x * rstd * (w + offset)``; ``w=None`` means no scale.

    ``rstd`` (``(...,)``) replaces the computed statistic when given.
    """
    rstd = rms_norm_rstd(x, eps) if rstd is None else rstd
    y = x * rstd[..., None]
    if w is not None:
        y = y * (w + offset)
    return y, rstd


def rms_norm_backward(x, w, dy, *, eps, offset=0.0, rstd=None):
    """``(dx, dw)`` of :func:`rms_norm` (``dw`` None when ``w`` is None)."""
    rstd = (rms_norm_rstd(x, eps) if rstd is None else rstd)[..., None]
    x_hat = x * rstd
    g = dy if w is None else dy * (w + offset)
    dx = rstd * (g - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))
    return dx, None if w is None else _sum_rows(dy * x_hat)


def layer_norm_stats(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, rstd)`` per row, shapes ``(...,)``: the centred (two-pass) variance."""
    mean = np.mean(x, axis=-1)
    rstd = 1 / np.sqrt(np.mean((x - mean[..., None]) ** 2, axis=-1) + eps)
    return mean, rstd


def layer_norm(x, w, b, *, eps, mean=None, rstd=None):
    """``(y, mean, rstd)``: ``y = (x - mean) * rstd * w + b``; None ``w`` / ``b``: no scale / shift.

    ``mean`` and ``rstd`` (``(...,)``) replace the computed statistics when given.
    """
    if mean is None or rstd is None:
        mean, rstd = layer_norm_stats(x, eps)
    y = (x - mean[..., None]) * rstd[..., None]
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, mean, rstd


def layer_norm_backward(x, w, dy, *, eps, mean=None, rstd=None):
    """``(dx, dw, db)`` of :func:`layer_norm` (``dw`` None when ``w`` is None)."""
    if mean is None or rstd is None:
        mean, rstd = layer_norm_stats(x, eps)
    rstd = rstd[..., None]
    x_hat = (x - mean[..., None]) * rstd
    g = dy if w is None else dy * w
    dx = rstd * (
        g - np.mean(g, axis=-1, keepdims=True) - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True)
    )
    return dx, None if w is None else _sum_rows(dy * x_hat), _sum_rows(dy)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (shifted by the row max)."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def softmax_backward(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """``dx = y * (dy - sum(y * dy))`` per row."""
    return y * (dy - np.sum(y * dy, axis=-1, keepdims=True))


def _sigmoid(a: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-a))``, evaluated as ``exp(-|a|)`` ratios so no ``|a|`` overflows."""
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1 / (1 + e), e / (1 + e))


def swiglu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``y = silu(a) * b`` elementwise, ``silu(a) = a * sigmoid(a)``."""
    return a * _sigmoid(a) * b


def swiglu_backward(a: np.ndarray, b: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(da, db)`` of :func:`swiglu`: ``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * a * s``."""
    s = _sigmoid(a)
    return dy * b * s * (1 + a * (1 - s)), dy * a * s


_ERF = np.vectorize(math.erf, otypes=[np.float64])
#: GELU's tanh form: ``tanh(sqrt(2 / pi) * (a + 0.044715 a^3))``.
_TANH_SCALE, _TANH_CUBE = math.sqrt(2.0 / math.pi), 0.044715


def _gelu(a: np.ndarray, approximate: str) -> tuple[np.ndarray, np.ndarray]:
    """``(gelu(a), gelu'(a))``, exactly (``"none"``: ``a Phi(a)``, ``erf`` rounded to ``a``'s
    dtype) or in the tanh form."""
    if approximate == "none":
        phi = 0.5 * (1.0 + _ERF(a / math.sqrt(2.0)).astype(a.dtype))
        density = np.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
        return a * phi, phi + a * density
    t = np.tanh(_TANH_SCALE * (a + _TANH_CUBE * a**3))
    slope = 0.5 * a * (1.0 - t * t) * _TANH_SCALE * (1.0 + 3.0 * _TANH_CUBE * a * a)
    return 0.5 * a * (1.0 + t), 0.5 * (1.0 + t) + slope


def geglu(a: np.ndarray, b: np.ndarray, approximate: str) -> np.ndarray:
    """``y = gelu(a) * b`` elementwise (``approximate``: ``"none"`` or ``"tanh"``)."""
    return _gelu(a, approximate)[0] * b


def geglu_backward(
    a: np.ndarray, b: np.ndarray, dy: np.ndarray, approximate: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(da, db)`` of :func:`geglu`: ``da = dy * b * gelu'(a)``, ``db = dy * gelu(a)``."""
    value, slope = _gelu(a, approximate)
    return dy * b * slope, dy * value


# --------------------------------------------------------------------------- rotary embeddings


def rope(x, cos, sin, *, position_ids=None, interleaved=False, inverse=False):
    """Rotary embedding of ``x`` ``(B, H, S, D)`` by the tables ``cos``, ``sin``.

    The tables are ``(P, R2)`` or ``(B, P, R2)``: row ``p`` holds
    :math:`\\cos(p\\,\\theta_i)` and :math:`\\sin(p\\,\\theta_i)` of the ``R2`` rotated
    pairs (rotary dim ``R = 2 R2 <= D``). Query ``s`` of batch ``b`` takes row
    ``position_ids[b, s]`` (``(B, S)`` integers), or row ``s`` when None. Pair
    ``i`` is ``(x[i], x[i + R2])`` (the half-rotation layout of Hugging Face
    models) or ``(x[2i], x[2i + 1])`` (``interleaved``, GPT-J); it becomes
    ``(x1 c - x2 s, x2 c + x1 s)``, or with ``inverse`` (the backward, of the
    output's gradient) ``(x1 c + x2 s, x2 c - x1 s)``. Elements past ``R``
    are kept.
    """
    b, _, s, d = x.shape
    r2 = cos.shape[-1]
    if cos.ndim == 2:
        cos, sin = (np.broadcast_to(t, (b, *t.shape)) for t in (cos, sin))
    pos = np.broadcast_to(np.arange(s), (b, s)) if position_ids is None else position_ids
    rows = np.arange(b)[:, None]
    c = cos[rows, pos][:, None].astype(x.dtype)  # (B, 1, S, R2)
    sn = sin[rows, pos][:, None].astype(x.dtype)
    if inverse:
        sn = -sn
    if interleaved:
        one, two = slice(0, 2 * r2, 2), slice(1, 2 * r2, 2)
    else:
        one, two = slice(0, r2), slice(r2, 2 * r2)
    first, second = x[..., one], x[..., two]
    out = x.copy()
    out[..., one], out[..., two] = first * c - second * sn, second * c + first * sn
    return out


# --------------------------------------------------------------------------- cross-entropy


def _capped(logits, softcap):
    """The logits the loss sees, ``c tanh(x / c)`` with a softcap ``c``, and ``dz/dx``."""
    if softcap is None:
        return logits, np.ones_like(logits)
    t = np.tanh(logits / softcap)
    return softcap * t, 1 - t * t


def cross_entropy_rows(
    logits, targets, *, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0
):
    """Per-row loss and logsumexp of ``(N, V)`` logits against ``(N,)`` integer targets.

    With ``z = softcap * tanh(logits / softcap)`` (``z = logits`` without a
    softcap), ``lse = log(sum(exp(z)))`` and ``eps = label_smoothing``, row
    ``r`` of target ``t`` loses ``(1 - eps) (lse - z[t]) + eps (lse - mean(z))
    + z_loss * lse**2`` (PyTorch's label smoothing, plus the z-loss of PaLM);
    a row whose target is ``ignore_index`` loses 0. Returns ``(loss, lse)``,
    both ``(N,)``; ``lse`` is every row's, ignored or not.
    """
    z, _ = _capped(logits, softcap)
    top = np.max(z, axis=-1, keepdims=True)
    lse = (top + np.log(np.sum(np.exp(z - top), axis=-1, keepdims=True)))[:, 0]
    kept = targets != ignore_index
    safe = np.where(kept, targets, 0)
    picked = np.take_along_axis(z, safe[:, None].astype(np.int64), axis=-1)[:, 0]
    eps = label_smoothing
    loss = (1 - eps) * (lse - picked)
    if eps > 0:  # a -inf logit makes mean(z) -inf: no 0 * inf without smoothing
        loss = loss + eps * (lse - np.mean(z, axis=-1))
    if z_loss > 0:
        loss = loss + z_loss * lse * lse
    return np.where(kept, loss, 0).astype(logits.dtype), lse


def cross_entropy_rows_backward(
    logits, targets, grad, *, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0
):
    """The gradient of ``sum(grad * loss)`` over the logits, ``(N, V)``, for the per-row
    ``loss`` of :func:`cross_entropy_rows` and per-row weights ``grad`` ``(N,)``:
    ``grad[r] (p (1 + 2 z_loss lse) - (1 - eps) onehot(t) - eps / V) dz/dx``, 0 on
    ignored rows."""
    z, dz = _capped(logits, softcap)
    v = logits.shape[-1]
    _, lse = cross_entropy_rows(logits, targets, ignore_index=ignore_index, softcap=softcap)
    p = np.exp(z - lse[:, None])
    kept = targets != ignore_index
    onehot = np.zeros_like(z)
    rows = np.nonzero(kept)[0]
    onehot[rows, targets[rows]] = 1
    eps = label_smoothing
    g = p * (1 + 2 * z_loss * lse[:, None]) - (1 - eps) * onehot - eps / v
    return np.where(kept[:, None], g * dz * grad[:, None], 0).astype(logits.dtype)


def _reduction_weights(targets, ignore_index, reduction, dtype):
    """Per-row weights of the reduced loss: 1 (sum, none) or 1 / max(kept rows, 1) (mean)."""
    if reduction != "mean":
        return np.ones(targets.shape, dtype)
    kept = int(np.sum(targets != ignore_index))
    return np.full(targets.shape, 1 / max(kept, 1), dtype)


def cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, **options):
    """The loss of :func:`cross_entropy_rows` reduced: ``"none"`` (per row, ``(N,)``),
    ``"sum"``, or ``"mean"`` over the rows not ignored (0, not NaN, when all are)."""
    loss, _ = cross_entropy_rows(logits, targets, ignore_index=ignore_index, **options)
    if reduction == "none":
        return loss
    weights = _reduction_weights(targets, ignore_index, reduction, loss.dtype)
    return np.sum(loss * weights)


def cross_entropy_backward(
    logits, targets, dloss, *, reduction="mean", ignore_index=-100, **options
):
    """The logits' gradient of :func:`cross_entropy` for the cotangent ``dloss`` (a scalar,
    or ``(N,)`` for ``reduction="none"``)."""
    weights = _reduction_weights(targets, ignore_index, reduction, logits.dtype)
    grad = np.broadcast_to(np.asarray(dloss, logits.dtype), targets.shape) * weights
    return cross_entropy_rows_backward(logits, targets, grad, ignore_index=ignore_index, **options)


def linear_cross_entropy(x, weight, targets, bias=None, **options):
    """:func:`cross_entropy` of the logits ``x @ weight.T + bias``."""
    logits = x @ weight.T if bias is None else x @ weight.T + bias
    return cross_entropy(logits, targets, **options)


def linear_cross_entropy_backward(x, weight, targets, dloss, bias=None, **options):
    """``(dx, dweight, dbias)`` of :func:`linear_cross_entropy` (``dbias`` None without a bias)."""
    logits = x @ weight.T if bias is None else x @ weight.T + bias
    dz = cross_entropy_backward(logits, targets, dloss, **options)
    return dz @ weight, dz.T @ x, None if bias is None else np.sum(dz, axis=0)


# --------------------------------------------------------------------------- attention


def attention_keep(batch, sq, sk, *, causal=False, input_pos=0, q_lengths=None, k_lengths=None):
    """``(B, Sq, Sk)`` booleans: True where query ``i`` sees key ``j``.

    Query ``i`` sits at position ``input_pos[b] + i``; causal keeps keys at or
    before it; ``q_lengths`` / ``k_lengths`` (``(B,)`` or None) drop the rest.
    """
    i = np.arange(sq)[None, :, None]
    j = np.arange(sk)[None, None, :]
    keep = np.ones((batch, sq, sk), dtype=bool)
    if q_lengths is not None:
        keep &= i < np.asarray(q_lengths)[:, None, None]
    if k_lengths is not None:
        keep &= j < np.asarray(k_lengths)[:, None, None]
    if causal:
        pos = np.broadcast_to(np.asarray(input_pos), (batch,))
        keep &= j <= pos[:, None, None] + i
    return keep


def repeat_kv(a: np.ndarray, group: int) -> np.ndarray:
    """``(B, Hkv, S, D) -> (B, Hkv * group, S, D)``: each kv head serves ``group`` query heads."""
    return np.repeat(a, group, axis=1)


def group_sum(a: np.ndarray, kv_heads: int) -> np.ndarray:
    """``(B, H, S, D) -> (B, Hkv, S, D)``: the sum over each kv head's query heads."""
    batch, heads = a.shape[:2]
    return a.reshape(batch, kv_heads, heads // kv_heads, *a.shape[2:]).sum(axis=2)


def masked_softmax(s: np.ndarray, keep: np.ndarray):
    """``(probs, m, l)`` of scores ``s`` where ``keep`` (broadcast to ``s``).

    ``m`` is the row max of the kept scores, ``l = sum(exp(s - m))`` over them;
    a row that keeps nothing has ``m = -inf``, ``l = 0`` and probabilities 0.
    """
    keep = np.broadcast_to(keep, s.shape)
    valid = keep.any(axis=-1)
    m = np.where(valid, np.max(np.where(keep, s, -np.inf), axis=-1), -np.inf)
    shifted = np.where(keep, s, 0) - np.where(valid, m, 0)[..., None]
    e = np.where(keep, np.exp(shifted), 0)
    l_sum = e.sum(axis=-1)
    probs = e / np.where(valid, l_sum, 1)[..., None]
    return probs, m, l_sum


def attention(q, k, v, *, scale, keep):
    """``(o, m, l, probs)`` of ``softmax(scale q k^T, masked by keep) v`` (GQA by repetition).

    ``keep`` is ``(B, Sq, Sk)`` or broadcastable to ``(B, H, Sq, Sk)``.
    """
    group = q.shape[1] // k.shape[1]
    s = np.einsum("bhid,bhjd->bhij", q, repeat_kv(k, group)) * scale
    keep = keep[:, None] if keep.ndim == 3 else keep
    probs, m, l_sum = masked_softmax(s, keep)
    return probs @ repeat_kv(v, group), m, l_sum, probs


def score_gradient(probs, o, do, v_rep):
    """``(ds, dv_rep)``: the gradient of the softmaxed scores and of the repeated values."""
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = probs * (do @ np.swapaxes(v_rep, -1, -2) - delta)
    return ds, np.swapaxes(probs, -1, -2) @ do


def attention_backward(q, k, v, do, *, scale, keep):
    """``(dq, dk, dv)`` of :func:`attention`."""
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    o, _, _, probs = attention(q, k, v, scale=scale, keep=keep)
    ds, dv_rep = score_gradient(probs, o, do, repeat_kv(v, group))
    dq = ds @ repeat_kv(k, group) * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    return dq, group_sum(dk, kv_heads), group_sum(dv_rep, kv_heads)


def decode_attention(q, k_cache, v_cache, lengths, *, scale, softcap=None, window=None):
    """``o (B, H, Dv)``: one query per head over the first ``lengths[b]`` cache entries (0 when empty).

    ``softcap`` replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``;
    ``window`` keeps only the keys ``j > lengths[b] - 1 - window``.
    """
    batch, smax = q.shape[0], k_cache.shape[2]
    keep = attention_keep(batch, 1, smax, k_lengths=lengths)
    if window is not None:
        keep &= np.arange(smax)[None, None, :] > np.asarray(lengths)[:, None, None] - 1 - window
    if softcap is None:
        o, _, _, _ = attention(q[:, :, None, :], k_cache, v_cache, scale=scale, keep=keep)
        return o[:, :, 0, :]
    group = q.shape[1] // k_cache.shape[1]
    s = np.einsum("bhd,bhjd->bhj", q, repeat_kv(k_cache, group)) * scale
    probs, _, _ = masked_softmax(np.tanh(s / softcap) * softcap, keep)
    return np.einsum("bhj,bhjd->bhd", probs, repeat_kv(v_cache, group))


def gather_pages(pages, block_table):
    """``(B, Hkv, max_pages * page_size, ...)``: the contiguous cache of ``pages`` ``(num_pages, Hkv, page_size, ...)``.

    Key ``j`` of batch ``b`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``.
    """
    table = np.asarray(block_table)
    gathered = pages[table]  # (B, max_pages, Hkv, page_size, ...)
    batch, max_pages, kv_heads, page_size = gathered.shape[:4]
    cache = np.moveaxis(gathered, 1, 2)
    return cache.reshape(batch, kv_heads, max_pages * page_size, *gathered.shape[4:])


# --------------------------------------------------------------------------- merge_attention_states


def _merge_weights(m_a, l_a, m_b, l_b):
    """``(w_a, w_b, m, l)``: each side's ``exp(lse_side - lse)`` through ``lse = m + log l``.

    A row whose ``lse`` is ``-inf`` (both sides empty) has weights 0 and ``l = 0``; one whose
    ``lse`` is NaN or ``+inf`` (NaN, ``m = +inf``, ``l`` negative or ``+inf``) has NaN weights
    and a NaN ``l``.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # log(0), log(-1)
        lse_a, lse_b = m_a + np.log(l_a), m_b + np.log(l_b)
        lse = np.logaddexp(lse_a, lse_b)
        empty = lse == -np.inf
        shift = np.where(np.isfinite(lse), lse, np.nan)
        w_a = np.where(empty, 0, np.exp(lse_a - shift))
        w_b = np.where(empty, 0, np.exp(lse_b - shift))
        m = np.maximum(m_a, m_b)
        l_sum = np.where(empty, 0, np.exp(shift - np.where(empty, 0, m)))
    return w_a.astype(l_a.dtype), w_b.astype(l_b.dtype), m, l_sum.astype(l_a.dtype)


def merge_attention_states(o_a, m_a, l_a, o_b, m_b, l_b):
    """``(o, m, l)`` of attention over two disjoint key sets from each set's ``(o, m, l)``.

    ``o = w_a o_a + w_b o_b`` with ``w = exp(lse_side - lse)``, ``lse = m + log l``; an
    empty side (``l = 0``) has ``w = 0`` and its ``o`` is not read. NaN weights (see
    :func:`_merge_weights`) make the row's ``o`` NaN.
    """
    w_a, w_b, m, l_sum = _merge_weights(m_a, l_a, m_b, l_b)
    o = np.where(w_a[..., None] != 0, w_a[..., None] * o_a, 0)
    o = o + np.where(w_b[..., None] != 0, w_b[..., None] * o_b, 0)
    return o.astype(o_a.dtype), m, l_sum


def merge_attention_states_backward(o_a, m_a, l_a, o_b, m_b, l_b, do, dlse):
    """``(do_a, do_b, dlse_a, dlse_b)`` of :func:`merge_attention_states` given ``do`` and ``dlse``.

    ``do_a = w_a do``, ``dlse_a = w_a (rowsum(do * (o_a - o)) + dlse)``; 0 on an empty side.
    """
    w_a, w_b, _, _ = _merge_weights(m_a, l_a, m_b, l_b)
    o, _, _ = merge_attention_states(o_a, m_a, l_a, o_b, m_b, l_b)
    grads = []
    for w, o_side in ((w_a, o_a), (w_b, o_b)):
        seen = w[..., None] != 0
        dot = np.sum(np.where(seen, do * (o_side - o), 0), axis=-1)
        grads.append((w[..., None] * do, np.where(w != 0, w * (dot + dlse), 0)))
    (do_a, dlse_a), (do_b, dlse_b) = grads
    return do_a, do_b, dlse_a, dlse_b
