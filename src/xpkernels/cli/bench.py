"""``python -m xpkernels bench``: CPU timings of every primitive, next to PyTorch's own ops.

Each row times one pass of one implementation: xpkernels' in-place
function over buffers allocated once beforehand (the way a training step
calls it), or PyTorch's own CPU op (``F.rms_norm``, ``F.layer_norm``,
``torch.softmax``, ``F.scaled_dot_product_attention``; backward rows time
``torch.autograd.grad`` of that op). A row reports the min / median / max of
its timed runs (after one warm-up run), the rate its median implies -- GB/s
for the memory-bound primitives, TFLOP/s for attention -- with the byte or
FLOP formula printed under the table, and the ratio of its median to that of
a baseline row measured in the same run (PyTorch's op; for FlexAttention
forward ``torch.compile(flex_attention)`` with its block mask, except under
``--quick``, where compiling would dominate; for FlexAttention backward, which
PyTorch lacks on CPU, our dense path; for flex without mods, xpkernels'
attention; for packed variable-length attention, xpkernels' attention over
the same sequences padded to the longest, the padding masked by
``q_lengths`` / ``k_lengths``; for paged decode, the contiguous decode).

A row whose spread ``(max - min) / median`` exceeds :data:`SPREAD_LIMIT` is
flagged and re-timed once together with the other side(s) of its ratio, the
calls interleaved (ours, theirs, ours, theirs, ...) so that machine noise hits
both sides; the output names the re-timed rows and whether the flag cleared.
Comparison libraries that are missing are named in the output, with the rows
skipped for want of them. The progress bar draws only when stderr is a
terminal.

Default shapes are those of the performance targets: norms and softmax
``(8192, 4096)`` float32, attention and FlexAttention ``B=1, H=8, S=2048,
D=64`` float32 (flex with a causal, a 256-key sliding-window and a 4-document
mask; the document mask over host ids, NumPy or PyTorch CPU, declares each
query's key range, so it needs no BlockMask),
each again at the larger ``S=4096, D=128`` (its rows named
``... S=4096 D=128``), varlen ``H=8, D=64`` over four sequences of 1900, 1100, 700 and 300
tokens, decode ``B=8, H=32, Hkv=8, S=4096, D=64`` (also in shuffled 16-key
pages); ``--quick`` shrinks everything to seconds.

The rows -- shapes, inputs, each side's setup -- are declared in
:mod:`.bench_cases`; this module times them, re-times the noisy ones and
prints the table.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np

from .bench_cases import benches as _benches
from .bench_cases import torch_missing
from .bench_rows import Bench, Row

#: Spread ``(max - min) / median`` of a row's timed runs above which it is flagged and re-timed.
SPREAD_LIMIT = 0.25

#: The clock rows are timed with (a module attribute so tests can plant a fake one).
_now = time.perf_counter


class _Progress:
    """A progress bar on stderr, drawn only when stderr is a terminal: tqdm when installed,
    else a one-line bar redrawn with ``\\r``. Redirected, it writes nothing."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.bar = None
        self.draw = sys.stderr.isatty()
        if self.draw and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            # mininterval=0: draw every row (a bench has tens of rows, each seconds long)
            self.bar = tqdm(total=total, file=sys.stderr, unit="row", leave=False, mininterval=0)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)
            return
        if not self.draw:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<48}"
        )
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.draw:
            sys.stderr.write(f"\r[{'#' * 30}] {self.done}/{self.total} done{' ' * 44}\n")
            sys.stderr.flush()


def _time(calls: list[Callable[[], object]], repeats: int) -> list[list[float]]:
    """One warm-up run of each call, then ``repeats`` rounds timing each call in turn."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, timed in zip(calls, times):
            start = _now()
            call()
            timed.append(_now() - start)
    return times


def _set_times(row: Row, times: list[float]) -> None:
    """The row's statistics and rate from its timed runs."""
    row.times_s = list(times)
    row.repeats = len(times)
    row.min_s, row.median_s, row.max_s = min(times), statistics.median(times), max(times)
    row.spread = (row.max_s - row.min_s) / row.median_s if row.median_s > 0 else 0.0
    row.flagged = row.spread > SPREAD_LIMIT
    scale = 1e9 if row.unit == "GB/s" else 1e12
    row.rate = row.work / row.median_s / scale if row.median_s > 0 else float("inf")


def measure(bench: Bench) -> Row:
    """Time ``bench``: one warm-up run, then ``repeats`` timed runs; fills the row's figures."""
    row = bench.row
    try:
        (times,) = _time([bench.setup()], bench.repeats)
    except Exception as exc:  # noqa: BLE001 - a failing row is reported, the others still run
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    _set_times(row, times)
    return row


def _noisy_groups(benches: list[Bench]) -> list[list[Bench]]:
    """Each flagged row with the other sides of its ratios (its baseline, the rows it is the
    baseline of); groups that share a row are merged, so a row is re-timed at most once."""
    timed = {b.row.key: b for b in benches if b.row.error is None}
    groups: list[set] = []
    for bench in timed.values():
        if not bench.row.flagged:
            continue
        group = {bench.row.key}
        if bench.row.baseline in timed:
            group.add(bench.row.baseline)
        group |= {key for key, b in timed.items() if b.row.baseline == bench.row.key}
        for other in [g for g in groups if g & group]:
            groups.remove(other)
            group |= other
        groups.append(group)
    return [[b for key, b in timed.items() if key in group] for group in groups]


def retime_noisy(benches: list[Bench]) -> list[list[Row]]:
    """Re-time once every flagged row with the other sides of its ratios, interleaved.

    Returns
    -------
    list of list of Row
        The groups re-timed together (each row's ``first_spread`` keeps its first spread).
    """
    groups = _noisy_groups(benches)
    for group in groups:
        repeats = max(b.repeats for b in group)
        try:
            times = _time([b.setup() for b in group], repeats)
        except Exception as exc:  # noqa: BLE001 - reported as the group's error
            for b in group:
                b.row.error = f"re-timing: {type(exc).__name__}: {exc}"
            continue
        for b, timed in zip(group, times):
            b.row.first_spread, b.row.retimed = b.row.spread, True
            _set_times(b.row, timed)
    return [[b.row for b in group] for group in groups]


def _link_baselines(rows: list[Row]) -> None:
    by_key = {row.key: row for row in rows}
    for row in rows:
        base = by_key.get(row.baseline) if row.baseline else None
        if row.median_s is not None and base is not None and base.median_s:
            row.ratio = row.median_s / base.median_s


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _print_table(
    rows: list[Row], library: str, groups: list[list[Row]], skipped: list[str]
) -> None:
    header = (
        "primitive",
        "pass",
        "impl",
        "shape",
        "min ms",
        "median ms",
        "max ms",
        "spread",
        "rate",
        "vs",
        "ratio",
    )
    table: list[tuple[str, ...]] = [header]
    for row in rows:
        if row.error:
            table.append((row.op, row.pass_, row.impl, row.shape, "error") + ("",) * 6)
            continue
        low, median, high, spread = row.measured()
        base = ""
        if row.baseline is not None:
            base_op, _, base_impl = row.baseline.split("/")
            base = base_impl if base_op == row.op else f"{base_op} ({base_impl})"
        mark = " NOISY" if row.flagged else " re-timed" if row.retimed else ""
        table.append(
            (
                row.op,
                row.pass_,
                row.impl,
                row.shape,
                f"{low * 1e3:.2f}",
                f"{median * 1e3:.2f}",
                f"{high * 1e3:.2f}",
                _percent(spread) + mark,
                f"{row.rate:.3g} {row.unit}",
                base,
                "-" if row.ratio is None else f"{row.ratio:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(
        f"xpkernels on {library} CPU arrays, float32; min / median / max of the timed runs "
        "after one warm-up"
    )
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    print("ratio = median time / median time of the 'vs' row (below 1: faster than it)")
    print(
        f"spread = (max - min) / median; above {_percent(SPREAD_LIMIT)} a row is flagged and "
        "re-timed once with the other side of its ratio, the calls interleaved"
    )
    if groups:
        print("\nre-timed (first spread -> spread of the re-timing):")
        for group in groups:
            for row in group:
                if row.error:
                    verdict = "failed"
                elif row.flagged:
                    verdict = "still flagged: treat its ratio with caution"
                elif row.first_spread is not None and row.first_spread > SPREAD_LIMIT:
                    verdict = "flag cleared"
                else:
                    verdict = "was not flagged; re-timed as the other side of a ratio"
                first_spread = row.first_spread if row.retimed else row.spread
                first = "-" if first_spread is None else _percent(first_spread)
                now = "-" if row.error or row.spread is None else _percent(row.spread)
                print(f"  {row.key}: {first} -> {now} ({verdict})")
    else:
        print(f"\nno row's spread exceeded {_percent(SPREAD_LIMIT)}: none re-timed")
    if skipped:
        print("\nskipped:")
        for reason in skipped:
            print(f"  {reason}")
    print("\nformulas:")
    seen = set()
    for row in rows:
        if (row.op, row.pass_) not in seen:
            seen.add((row.op, row.pass_))
            print(f"  {row.op} {row.pass_}: {row.formula}")
    for row in rows:
        if row.error:
            first, *rest = row.error.splitlines() or [""]
            more = f" ({len(rest)} more lines in the --json record)" if rest else ""
            print(f"\n{row.key} failed: {first}{more}")


def _environment(library: str, quick: bool) -> dict:
    from .. import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "xpkernels": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "array": library,
        "quick": quick,
    }
    if torch_missing() is None:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
    return env


def _row_record(row: Row) -> dict:
    record = asdict(row)
    record["pass"] = record.pop("pass_")
    return record


def run(quick=False, json_path=None, ops=None, array="numpy", repeats=None) -> int:
    """Measure, print the table and formulas, optionally write JSON; 1 if any row failed."""
    benches, skipped = _benches(quick, ops, array, repeats)
    progress = _Progress(len(benches))
    rows = []
    for bench in benches:
        progress.start(f"{bench.row.op} {bench.row.pass_} {bench.row.impl}")
        rows.append(measure(bench))
        progress.advance()
    progress.close()
    groups = retime_noisy(benches)
    _link_baselines(rows)
    _print_table(rows, array, groups, skipped)
    if json_path:
        record = {
            "environment": _environment(array, quick),
            "spread_limit": SPREAD_LIMIT,
            "skipped": skipped,
            "retimed_together": [[row.key for row in group] for group in groups],
            "rows": [_row_record(row) for row in rows],
        }
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        print(f"\nwrote {json_path}")
    return 1 if any(row.error for row in rows) else 0
