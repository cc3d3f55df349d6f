r"""Cross-entropy of logit rows against integer targets in Triton: one read per pass.

Row :math:`r` of the ``(N, V)`` logits :math:`x`, with target :math:`t` and
:math:`\epsilon` the label smoothing, sees the logits :math:`z = c \tanh(x / c)`
(:math:`z = x` without a softcap :math:`c`) and loses

.. math::

    \ell = (1 - \epsilon)\,(L - z_t) + \epsilon\,\big(L - \tfrac1V \textstyle\sum_j z_j\big)
           + \lambda\,L^2,
    \qquad L = \log \textstyle\sum_j e^{z_j},

with the z-loss weight :math:`\lambda`; the backward, given :math:`L` and the
row's weight :math:`g_r` (``grad``), writes

.. math::

    \frac{\partial (g_r \ell)}{\partial x_j}
    = g_r\,\Big(p_j\,(1 + 2\lambda L) - (1 - \epsilon)\,[j = t] - \frac{\epsilon}{V}\Big)
      \frac{dz_j}{dx_j},
    \qquad p_j = e^{z_j - L},\quad \frac{dz}{dx} = 1 - \tanh^2(x / c).

The smoothing and z-loss terms are compiled in only when :math:`\epsilon > 0` and
:math:`\lambda > 0` (``SMOOTHING``, ``Z_LOSS``): a :math:`-\infty` logit (a
masked vocabulary entry) makes :math:`\sum_j z_j = -\infty`, which a zero weight
would turn into NaN. A row whose target is ``ignore_index`` loses 0 (its
:math:`L` is still written) and gets a gradient of exact zeros, whatever its
logits hold: the backward does not even read them. A target outside
:math:`[0, V)` that is not ``ignore_index`` is never read: that row's loss and
gradient are NaN.

Numerics: float32 throughout, in base 2 -- the logits are scaled by
:math:`\log_2 e` once (folded into the softcap's :math:`c`), so each element
costs one ``exp2``. The softcap's :math:`\tanh` comes from :math:`e =
2^{-2|u| \log_2 e}` (:math:`\tanh |u| = (1 - e)/(1 + e)`, no overflow, and
:math:`1 - \tanh^2 = 4e/(1 + e)^2` without cancellation where the cap
saturates), plain ``exp2`` that every Triton version and its interpreter have.
The forward's :math:`L` is an online logsumexp: a running row maximum
:math:`m` (a scalar, one block reduction per chunk) and per-lane partial sums
:math:`s_i` rescaled by :math:`2^{m_{old} - m}` as :math:`m` grows, summed once
at the end; while the row is all :math:`-\infty` so far the shift is 0, never
:math:`-\infty - (-\infty)`. Outputs are written in their buffer's dtype
(``loss`` and ``lse`` float32; ``dlogits`` any float dtype).

Tiles and accesses: one program per row (a 1-D grid of ``N``; row offsets in
int64 from the row strides, which may be anything). A row is walked in chunks of
``BLOCK_V`` columns, :data:`CHUNK_BYTES` of the logits (4096 bfloat16 or 2048
float32 columns), one 16-byte vector per thread (16 warps). The ``V // BLOCK_V``
full chunks are loaded without a mask, the remainder once with one, so the
accesses are 128-bit wherever the row strides and addresses allow, whatever
``V`` is (Triton specialises 16-divisible integers). The loop over the full
chunks is software-pipelined (:data:`STAGES`): the next chunks stream into
shared memory (``cp.async``, 16 KiB a program) while one is reduced, so a
program keeps loads in flight across the forward's block reductions. Compiled
for sm_90 (``bench/compile_report.py``, V = 128256 and 262144) the kernels use
30 to 40 registers (60 for the backward with every term), none spills, and
three or four programs share an SM (two for that backward). The chunk counts
are ``constexpr`` (one compilation per vocabulary and dtype; the Triton 3.6
interpreter cannot loop to a run-time bound under NumPy >= 2.4, see
:mod:`._common`). The forward reads the row once and fetches the target's logit
with one scalar load; the backward reads each chunk, then writes it (an ignored
row only writes zeros). Every element is read before the program writes it and
no two programs share a row -- the chunks still in flight lie past the one
being written -- so ``dlogits`` may be the very same tensor as ``logits`` (the
gradient replaces the logits, as Liger's kernel does).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ._common import MAX_WARPS, VECTOR_BYTES, launch

__all__ = ["CHUNK_BYTES", "STAGES", "VECTORS_PER_THREAD", "backward", "forward", "tile_config"]

#: Bytes of the logits one chunk of a row spans, at most.
CHUNK_BYTES = 8192
#: 16-byte vectors of the logits a thread holds per chunk: sets ``num_warps``.
VECTORS_PER_THREAD = 1
#: Software-pipeline stages of the loop over the full chunks: the chunks after the one
#: being computed are already on their way into shared memory (``cp.async``).
STAGES = tl.constexpr(3)

_LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))


def tile_config(v: int, itemsize: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of a pass over rows of ``v`` logits.

    Parameters
    ----------
    v : int
        Vocabulary size ``V`` (row length).
    itemsize : int
        Bytes per element of the logits.

    Returns
    -------
    tuple of int
        Powers of two: ``BLOCK_V`` spans at least one 16-byte vector and at
        most :data:`CHUNK_BYTES` (or the padded row, when shorter).
    """
    vector = max(1, VECTOR_BYTES // itemsize)
    block_v = min(max(triton.next_power_of_2(v), vector), max(vector, CHUNK_BYTES // itemsize))
    warps = block_v // (32 * vector * VECTORS_PER_THREAD)
    return block_v, max(1, min(MAX_WARPS, warps))


@triton.jit
def _tanh(u):
    """``(tanh(u), 1 - tanh(u)**2)`` of a float32 tile from ``e = exp(-2|u|)`` (no overflow)."""
    e = tl.exp2(tl.abs(u) * (-2.0 * _LOG2E))
    inv = 1.0 / (1.0 + e)
    r = (1.0 - e) * inv
    return tl.where(u < 0.0, -r, r), 4.0 * e * inv * inv


@triton.jit
def _logits2(x, inv_cap, cap2, SOFTCAP: tl.constexpr):
    """``(z log2 e, dz/dx)`` of float32 logits ``x`` (``dz/dx`` is 1.0 without a softcap)."""
    if SOFTCAP:
        th, dz = _tanh(x * inv_cap)
        return cap2 * th, dz
    else:
        return x * _LOG2E, 1.0


@triton.jit
def _lse_chunk(
    row_ptr, cols, v,  # the row's logits, this chunk's columns, V
    m2, s, zsum,  # running max (log2 units), per-lane sums of 2^(z2 - m2), of z2
    inv_cap, cap2,  # 1 / softcap and softcap * log2(e)
    MASKED: tl.constexpr,  # the chunk reaches past V
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
):  # fmt: skip
    """One chunk of the online logsumexp: the updated ``(m2, s, zsum)``."""
    if MASKED:
        col_ok = cols < v
        x = tl.load(row_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        z2, _ = _logits2(x, inv_cap, cap2, SOFTCAP)
        z2 = tl.where(col_ok, z2, float("-inf"))
    else:
        x = tl.load(row_ptr + cols).to(tl.float32)
        z2, _ = _logits2(x, inv_cap, cap2, SOFTCAP)
    new = tl.maximum(m2, tl.max(z2, axis=0))
    # While the row is all -inf so far, shift by 0: exp2 sees -inf - 0, never -inf - -inf.
    shift = tl.where(new == float("-inf"), 0.0, new)
    s = s * tl.exp2(m2 - shift) + tl.exp2(z2 - shift)
    if SMOOTHING:
        if MASKED:
            zsum += tl.where(col_ok, z2, 0.0)
        else:
            zsum += z2
    return new, s, zsum


@triton.jit
def _forward_kernel(
    loss_ptr, lse_ptr,  # (N,) float32 outputs
    logits_ptr,  # (N, V) logits, last axis contiguous
    targets_ptr,  # (N,) int32 or int64 targets
    v,  # vocabulary size V
    stride_logits, stride_targets,  # elements between rows of logits, between targets
    ignore_index,  # targets equal to it lose 0
    label_smoothing, softcap, z_loss,  # eps, c (unused without SOFTCAP), lambda
    BLOCK_V: tl.constexpr,  # columns per chunk
    FULL_CHUNKS: tl.constexpr,  # V // BLOCK_V, loaded without a mask
    TAIL: tl.constexpr,  # V % BLOCK_V > 0: one masked chunk more
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + r * stride_logits
    offs = tl.arange(0, BLOCK_V)
    inv_cap = 1.0 / softcap
    cap2 = softcap * _LOG2E
    m2 = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for k in tl.range(FULL_CHUNKS, num_stages=STAGES):
        m2, s, zsum = _lse_chunk(
            row_ptr, k * BLOCK_V + offs, v, m2, s, zsum, inv_cap, cap2, False, SOFTCAP, SMOOTHING
        )
    if TAIL:
        m2, s, zsum = _lse_chunk(
            row_ptr, FULL_CHUNKS * BLOCK_V + offs, v, m2, s, zsum, inv_cap, cap2, True, SOFTCAP,
            SMOOTHING,
        )  # fmt: skip
    shift = tl.where(m2 == float("-inf"), 0.0, m2)
    lse = (shift + tl.log2(tl.sum(s, axis=0))) * _LN2

    t = tl.load(targets_ptr + r * stride_targets).to(tl.int64)
    t_ok = (t >= 0) & (t < v)
    x_t = tl.load(row_ptr + tl.where(t_ok, t, 0), mask=t_ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = softcap * _tanh(x_t * inv_cap)[0]
    else:
        z_t = x_t
    if SMOOTHING:
        mean = tl.sum(zsum, axis=0) * _LN2 / v
        loss = (1.0 - label_smoothing) * (lse - z_t) + label_smoothing * (lse - mean)
    else:
        loss = lse - z_t
    if Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(t_ok, loss, float("nan"))
    loss = tl.where(t == ignore_index, 0.0, loss)
    tl.store(loss_ptr + r, loss.to(loss_ptr.dtype.element_ty))
    tl.store(lse_ptr + r, lse.to(lse_ptr.dtype.element_ty))


@triton.jit
def _grad_chunk(
    drow_ptr, row_ptr, cols, v,  # the row's gradient and logits, this chunk's columns, V
    lse2, t32,  # L log2(e); the target's column (-1 when out of range)
    p_scale, hit, floor,  # g (1 + 2 lambda L), g (1 - eps), g eps / V
    inv_cap, cap2,  # 1 / softcap and softcap * log2(e)
    MASKED: tl.constexpr,  # the chunk reaches past V
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
):  # fmt: skip
    """Read one chunk of a kept row's logits, then write its gradient."""
    if MASKED:
        col_ok = cols < v
        x = tl.load(row_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(row_ptr + cols).to(tl.float32)
    z2, dz = _logits2(x, inv_cap, cap2, SOFTCAP)
    d = tl.exp2(z2 - lse2) * p_scale - tl.where(cols == t32, hit, 0.0)
    if SMOOTHING:
        d -= floor
    if SOFTCAP:
        d *= dz
    d = d.to(drow_ptr.dtype.element_ty)
    if MASKED:
        tl.store(drow_ptr + cols, d, mask=col_ok)
    else:
        tl.store(drow_ptr + cols, d)


@triton.jit
def _backward_kernel(
    dlogits_ptr,  # (N, V) gradient, overwritten; may be logits_ptr
    logits_ptr,  # (N, V) logits
    targets_ptr,  # (N,) int32 or int64 targets
    lse_ptr,  # (N,) float32 logsumexp of the forward
    grad_ptr,  # (N,) float32 row weights, any stride (0: one for all rows)
    v,  # vocabulary size V
    stride_dlogits, stride_logits,  # elements between rows of dlogits, of logits
    stride_targets, stride_grad,  # elements between targets, between weights
    ignore_index,  # targets equal to it get a zero gradient
    label_smoothing, softcap, z_loss,  # eps, c (unused without SOFTCAP), lambda
    BLOCK_V: tl.constexpr,  # columns per chunk
    FULL_CHUNKS: tl.constexpr,  # V // BLOCK_V, accessed without a mask
    TAIL: tl.constexpr,  # V % BLOCK_V > 0: one masked chunk more
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + r * stride_logits
    drow_ptr = dlogits_ptr + r * stride_dlogits
    offs = tl.arange(0, BLOCK_V)
    t = tl.load(targets_ptr + r * stride_targets).to(tl.int64)
    t_ok = (t >= 0) & (t < v)
    t32 = tl.where(t_ok, t, -1).to(tl.int32)
    lse = tl.load(lse_ptr + r).to(tl.float32)
    g = tl.load(grad_ptr + r * stride_grad).to(tl.float32)
    g = tl.where(t_ok, g, float("nan"))
    p_scale = g
    if Z_LOSS:
        p_scale = g * (1.0 + 2.0 * z_loss * lse)
    hit = g
    floor = 0.0
    if SMOOTHING:
        hit = g * (1.0 - label_smoothing)
        floor = g * label_smoothing / v
    lse2 = lse * _LOG2E
    inv_cap = 1.0 / softcap
    cap2 = softcap * _LOG2E
    if t != ignore_index:
        for k in tl.range(FULL_CHUNKS, num_stages=STAGES):
            _grad_chunk(
                drow_ptr, row_ptr, k * BLOCK_V + offs, v, lse2, t32, p_scale, hit, floor,
                inv_cap, cap2, False, SOFTCAP, SMOOTHING,
            )  # fmt: skip
        if TAIL:
            _grad_chunk(
                drow_ptr, row_ptr, FULL_CHUNKS * BLOCK_V + offs, v, lse2, t32, p_scale, hit,
                floor, inv_cap, cap2, True, SOFTCAP, SMOOTHING,
            )  # fmt: skip
    else:  # an ignored row: zeros, its logits not even read
        zeros = tl.zeros([BLOCK_V], dtype=dlogits_ptr.dtype.element_ty)
        for k in range(FULL_CHUNKS):
            tl.store(drow_ptr + k * BLOCK_V + offs, zeros)
        if TAIL:
            tail = FULL_CHUNKS * BLOCK_V + offs
            tl.store(drow_ptr + tail, zeros, mask=tail < v)


def _launch(kernel, logits, args, ignore_index, label_smoothing, softcap, z_loss) -> None:
    """Launch either kernel on ``args`` then the options, one program per row of ``logits``."""
    n, v = logits.shape
    block_v, warps = tile_config(v, logits.element_size())
    meta = {
        "BLOCK_V": block_v,
        "FULL_CHUNKS": v // block_v,
        "TAIL": v % block_v > 0,
        "SOFTCAP": softcap is not None,
        "SMOOTHING": label_smoothing > 0,
        "Z_LOSS": z_loss > 0,
        "num_warps": warps,
    }
    scalars = (ignore_index, float(label_smoothing), 1.0 if softcap is None else float(softcap))
    launch(kernel, logits, (n,), *args, *scalars, float(z_loss), **meta)


def forward(loss, lse, logits, targets, *, ignore_index, label_smoothing, softcap, z_loss) -> None:
    """Each row's loss and logsumexp: ``loss[r] = (1 - eps)(lse - z[t]) + eps (lse - mean z)
    + z_loss lse**2``, ``lse[r] = log(sum(exp(z)))``.

    A target outside ``[0, V)`` reads nothing outside the row; the smoothing and z-loss
    terms are computed only when positive. The contract of
    :class:`xpkernels.backends.protocol.CrossEntropyModule`.
    """
    if logits.shape[0] == 0:
        return
    args = (loss, lse, logits, targets, logits.shape[1], logits.stride(0), targets.stride(0))
    _launch(_forward_kernel, logits, args, ignore_index, label_smoothing, softcap, z_loss)


def backward(
    dlogits, logits, targets, lse, grad, *, ignore_index, label_smoothing, softcap, z_loss
) -> None:
    """``dlogits[r] = grad[r] (p (1 + 2 z_loss lse) - (1 - eps) onehot(t) - eps / V) dz/dx``,
    ``p = exp(z - lse)``; exact zeros on ignored rows.

    ``dlogits`` may be of any of the three float dtypes. The contract of
    :class:`xpkernels.backends.protocol.CrossEntropyModule`.
    """
    if logits.shape[0] == 0:
        return
    strides = (dlogits.stride(0), logits.stride(0), targets.stride(0), grad.stride(0))
    args = (dlogits, logits, targets, lse, grad, logits.shape[1], *strides)
    _launch(_backward_kernel, logits, args, ignore_index, label_smoothing, softcap, z_loss)
