"""The NumPy attention forward's floor against ``F.scaled_dot_product_attention``, on one core.

The NumPy attention forward (``backends/array_api/_attention_numpy.py``) is
a sequence of NumPy calls per score tile: two matrix products through the
BLAS and, between them, the passes the contract's checkpoints and the
softmax need (``exp2``, the rows' largest value, the rows' sums). NumPy
cannot fuse those passes into one loop, as PyTorch's CPU SDPA does. This
script times, on one core, interleaved in one process (float32, no mask,
``B=1``):

- ``products only``: the two products of every tile, nothing else -- what
  any NumPy implementation with these tiles pays;
- ``products + passes``: the same tiles with the fewest NumPy passes the
  forward needs (``exp2`` in place, the forward's own column max, the row
  sums as a matrix-vector product, the running sums, the final divide) and
  no Python bookkeeping;
- ``xpkernels``: ``attention_`` with checkpoints (as ``python -m xpkernels
  bench`` times it);
- ``sdpa``: ``F.scaled_dot_product_attention`` under ``torch.no_grad``.

Every row prints min / median / max over the repeats and the median of its
per-repeat ratios to SDPA (each repeat times all four back to back, so a
ratio compares calls made under the same load). The tiles and buffers are
the forward's own (``_tile_sizes`` on NumPy, a ``Workspace``). One core: the process is pinned to its first allowed CPU, and
NumPy's BLAS and torch run one thread each, so the figures do not depend
on how the two libraries share cores.

    python bench/cpu_attention_floor.py [--heads 8] [--seq 2048] [--dim 64]
                                        [--repeats 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from xpkernels.backends.array_api._attention_numpy import Workspace, _column_max
from xpkernels.backends.array_api._blocks import blas_threads, spans
from xpkernels.backends.array_api.attention import _tile_sizes

import xpkernels as xk
from xpkernels.buffers import allocate_checkpoints


def tiles(heads: int, seq: int, dim: int):
    """``(q, k, v, o), products, passes``: random ``(heads, seq, dim)`` float32 inputs and
    the two NumPy-only loops over the forward's tiles; ``passes`` writes the attention
    output (scale ``1/sqrt(dim)``, no mask) into ``o``."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((heads, seq, dim), dtype=np.float32) for _ in range(3))
    o = np.empty_like(q)
    keys, rows = _tile_sizes(seq, 1, dim, dim, False, numpy=True)
    rows = min(rows, seq)
    scale = float(np.log2(np.e) / np.sqrt(dim))
    space = Workspace(rows, keys, dim, dim, np.float32)  # the forward's own buffers
    ones, q_tile = space.ones, space.q

    def tile(j0, j1, n):  # a contiguous (keys, rows) score tile, as the forward takes it
        return space.scores[: (j1 - j0) * n].reshape(j1 - j0, n)

    sums, tile_sums, row_max = space.rows[0], space.rows[1], space.rows[2]
    acc, pv = space.o[0], space.o[1]

    def products():
        for h in range(heads):
            for i0, i1 in spans(0, seq, rows):
                qt = np.multiply(q[h, i0:i1], scale, out=q_tile[: i1 - i0])
                for j0, j1 in spans(0, seq, keys):
                    s = np.matmul(k[h, j0:j1], qt.T, out=tile(j0, j1, i1 - i0))
                    np.matmul(s.T, v[h, j0:j1], out=pv[: i1 - i0])

    def passes():
        for h in range(heads):
            for i0, i1 in spans(0, seq, rows):
                n = i1 - i0
                qt = np.multiply(q[h, i0:i1], scale, out=q_tile[:n])
                for t, (j0, j1) in enumerate(spans(0, seq, keys)):
                    s = np.matmul(k[h, j0:j1], qt.T, out=tile(j0, j1, n))
                    np.exp2(s, out=s)
                    _column_max(space, s, row_max[:n])
                    if t == 0:
                        np.matmul(ones[: j1 - j0], s, out=sums[:n])
                        np.matmul(s.T, v[h, j0:j1], out=acc[:n])
                    else:
                        sums[:n] += np.matmul(ones[: j1 - j0], s, out=tile_sums[:n])
                        acc[:n] += np.matmul(s.T, v[h, j0:j1], out=pv[:n])
                np.divide(acc[:n], sums[:n, None], out=o[h, i0:i1])

    return (q, k, v, o), products, passes


def measure(heads: int, seq: int, dim: int, repeats: int) -> dict:
    """Time the four rows ``repeats`` times each, interleaved; returns the figures in ms."""
    (q, k, v, _), products, passes = tiles(heads, seq, dim)
    q4, k4, v4 = (a[None] for a in (q, k, v))
    o4 = np.empty_like(q4)
    checkpoints = allocate_checkpoints(xk.attention_, q4, k4, v4)
    tq, tk, tv = (torch.from_numpy(a) for a in (q4, k4, v4))

    def ours():
        xk.attention_(o4, q4, k4, v4, checkpoints=checkpoints)

    def sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv)

    rows = {
        "products only": products,
        "products + passes": passes,
        "xpkernels": ours,
        "sdpa": sdpa,
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for name, call in rows.items():  # warm-up
        call()
    for _ in range(repeats):
        for name, call in rows.items():
            start = time.perf_counter()
            call()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {
        name: {
            "min_ms": min(ts),
            "median_ms": statistics.median(ts),
            "max_ms": max(ts),
            "ratio_to_sdpa": statistics.median(a / b for a, b in zip(ts, times["sdpa"])),
        }
        for name, ts in times.items()
    }


def _environment() -> dict:
    """Versions, platform and CPU of this run."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "xpkernels": xk.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):  # one core: xpkernels then runs one worker
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    with blas_threads(1):
        figures = measure(args.heads, args.seq, args.dim, args.repeats)
    shape = f"1x{args.heads}x{args.seq}x{args.dim}"
    print(f"attention forward, float32, {shape}, one core, {args.repeats} interleaved repeats")
    print(f"{'row':18s} {'min ms':>8s} {'median ms':>10s} {'max ms':>8s} {'vs sdpa':>8s}")
    for name, f in figures.items():
        print(
            f"{name:18s} {f['min_ms']:8.1f} {f['median_ms']:10.1f} {f['max_ms']:8.1f} "
            f"{f['ratio_to_sdpa']:8.3f}"
        )
    print("vs sdpa: median over the repeats of (row time / SDPA time in the same repeat)")
    if args.json:
        record = {
            "shape": shape,
            "repeats": args.repeats,
            "environment": _environment(),
            "rows": figures,
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
