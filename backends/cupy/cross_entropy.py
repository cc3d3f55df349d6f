r"""Cross-entropy of logit rows in CUDA C (``cross_entropy.cu``).

Row :math:`r` of the ``(N, V)`` logits :math:`x`, with target :math:`t`,
label smoothing :math:`\varepsilon`, z-loss weight :math:`\zeta`, sees
:math:`z = c \tanh(x / c)` under a softcap :math:`c` (else :math:`z = x`) and

.. math::

    \mathrm{lse} = \log \textstyle\sum_j e^{z_j},\qquad
    \ell = (1 - \varepsilon)(\mathrm{lse} - z_t)
         + \varepsilon\,(\mathrm{lse} - \bar z) + \zeta\,\mathrm{lse}^2,

    \frac{\partial \ell}{\partial x_j} = \Big(p_j (1 + 2 \zeta\,\mathrm{lse})
        - (1 - \varepsilon)[j = t] - \frac{\varepsilon}{V}\Big)
        \big(1 - \tanh^2(x_j / c)\big),\qquad p_j = e^{z_j - \mathrm{lse}},

the smoothing term only when :math:`\varepsilon > 0`, the z-loss only when
:math:`\zeta > 0` and the last factor only under a softcap (a ``-inf``
logit makes :math:`\bar z = -\infty`, and :math:`0 \cdot \infty` is NaN).
A row whose target is ``ignore_index`` loses 0 (its ``lse`` is written all
the same) and gets exact zeros; a target outside ``[0, V)`` that is not
``ignore_index`` gives that row a NaN loss and a NaN gradient and is never
used as an index. The backward scales row ``r`` by ``grad[r]``.

Geometry: one block per row, ``blockDim.x`` the fewest multiple of 32
threads that covers the row in one vector each, at most :data:`MAX_THREADS`;
at most :data:`MAX_BLOCKS` blocks, which stride over the rows beyond them.
The threads stride over their row. The forward folds each vector into a
per-thread running max and rescaled sum of exponentials (and a sum of
``z`` for the smoothing term), merges them over the block (a max, then both
sums rescaled to the row max), and thread 0 reads ``z[t]`` with one scalar
load; the row is read once. The backward is elementwise given the forward's
``lse`` (no shared memory, no barriers): the row is read once and written
once.

Accesses: 128-bit vectors where every row start is 16-byte aligned and the
vector width divides ``V`` (:func:`_vector`), else scalar. The forward's
width is 16 bytes of logits; the backward's is 16 bytes of the narrower of
logits and dlogits, the wider moved in two 128-bit pieces (float32 dlogits
of bfloat16 logits). Offsets are int64 from each array's own strides:
logits, dlogits, targets, loss, lse and grad (stride 0 for one weight for
every row) may be views.

In place: ``dlogits`` may be the very same array as ``logits`` -- each
element is loaded, then stored, by the same thread, and no thread reads an
element another writes. Computation in float32; ``loss``, ``lse`` and
``grad`` are float32.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, address, loader_for

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("cross_entropy.cu")
MAX_THREADS = 1024  #: threads per block (the kernels' __launch_bounds__)
MAX_BLOCKS = 2**31 - 1  #: most blocks (CUDA's grid x limit); they stride over further rows
#: Longest row: the kernels' int32 vector indices stay below 2**31 as a thread steps past its end.
MAX_VOCAB = 2**31 - 1 - 16 * MAX_THREADS


def _expressions(t: str) -> list[str]:
    """The instantiations for logits of C type ``t``: the forward's, and the backward's for
    dlogits of every dtype."""
    forward = [f"cross_entropy_forward<{t},{v}>" for v in _rows.vectors(t)]
    backward = [
        f"cross_entropy_backward<{t},{g},{v}>"
        for g in _rows.CTYPES.values()
        for v in _rows.vectors(t, g)
    ]
    return forward + backward


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return [e for t in _rows.CTYPES.values() for e in _expressions(t)]


def _vector(arrays) -> int:
    """Elements per access of the ``(N, V)`` ``arrays``: 16 bytes of the narrowest when every
    row start is 16-byte aligned and that many elements divide ``V``, else 1."""
    v = 16 // min(a.itemsize for a in arrays)
    rows, vocab = arrays[0].shape
    ok = vocab % v == 0 and all(
        address(a) % 16 == 0 and (rows <= 1 or _rows.stride(a) * a.itemsize % 16 == 0)
        for a in arrays
    )
    return v if ok else 1


def _threads(vocab: int, v: int) -> int:
    """Threads per block: one vector each over the row, a multiple of 32 in [32, MAX_THREADS]."""
    vectors = -(-vocab // v)
    return max(32, min(MAX_THREADS, -(-vectors // 32) * 32))


def _options(ignore_index, label_smoothing, softcap, z_loss) -> tuple:
    """The kernels' trailing scalars: ignore_index, eps, softcap (0 for none), z_loss."""
    return (
        np.int64(ignore_index),
        np.float32(label_smoothing),
        np.float32(0.0 if softcap is None else softcap),
        np.float32(z_loss),
    )


def _geometry(rows: int, vocab: int, v: int) -> tuple[tuple[int], tuple[int]]:
    """``(grid, block)`` over ``rows`` rows of ``vocab`` logits read ``v`` at a time."""
    if vocab > MAX_VOCAB:
        raise ValueError(f"cupy cross_entropy: rows of {vocab} logits; at most {MAX_VOCAB}")
    return (min(rows, MAX_BLOCKS),), (_threads(vocab, v),)


def forward(loss, lse, logits, targets, *, ignore_index, label_smoothing, softcap, z_loss) -> None:
    """Each row's loss and logsumexp, a block per row (see the module docstring).

    The contract of :class:`xpkernels.backends.protocol.CrossEntropyModule`.
    """
    t = _rows.ctype("cross_entropy", "logits", logits)
    _rows.float32s("cross_entropy", loss=loss, lse=lse)
    target_bytes = _rows.index_bytes("cross_entropy", "targets", targets)
    rows, vocab = logits.shape
    if rows == 0:
        return
    v = _vector((logits,))
    grid, block = _geometry(rows, vocab, v)
    module = loader_for(logits).module(SOURCE, _expressions(t), OPTIONS)
    kernel = module.get_function(f"cross_entropy_forward<{t},{v}>")
    args = (
        loss,
        lse,
        logits,
        targets,
        target_bytes,
        np.int64(rows),
        np.int32(vocab),
        np.int64(_rows.stride(loss)),
        np.int64(_rows.stride(lse)),
        np.int64(_rows.stride(logits)),
        np.int64(_rows.stride(targets)),
        *_options(ignore_index, label_smoothing, softcap, z_loss),
    )
    kernel(grid, block, args)


def backward(
    dlogits, logits, targets, lse, grad, *, ignore_index, label_smoothing, softcap, z_loss
) -> None:
    """``dlogits[r] = grad[r] * d loss[r] / d logits[r]`` from the forward's ``lse``, elementwise.

    ``dlogits`` float32, float16 or bfloat16, not necessarily the logits'
    dtype. The contract of :class:`xpkernels.backends.protocol.CrossEntropyModule`.
    """
    t = _rows.ctype("cross_entropy", "logits", logits)
    g = _rows.ctype("cross_entropy", "dlogits", dlogits)
    _rows.float32s("cross_entropy", lse=lse, grad=grad)
    target_bytes = _rows.index_bytes("cross_entropy", "targets", targets)
    rows, vocab = logits.shape
    if rows == 0:
        return
    v = _vector((logits, dlogits))
    grid, block = _geometry(rows, vocab, v)
    module = loader_for(logits).module(SOURCE, _expressions(t), OPTIONS)
    kernel = module.get_function(f"cross_entropy_backward<{t},{g},{v}>")
    args = (
        dlogits,
        logits,
        targets,
        target_bytes,
        lse,
        grad,
        np.int64(rows),
        np.int32(vocab),
        np.int64(_rows.stride(dlogits)),
        np.int64(_rows.stride(logits)),
        np.int64(_rows.stride(targets)),
        np.int64(_rows.stride(lse)),
        np.int64(_rows.stride(grad)),
        *_options(ignore_index, label_smoothing, softcap, z_loss),
    )
    kernel(grid, block, args)
