"""``python -m xpkernels bench`` reports its own noise: min / median / max, flagged rows re-timed.

Timings come from a planted clock (``bench._now``) advanced by planted
callables, so every statistic is known exactly and the tests take no time;
the real rows are built only at ``--quick`` shapes with one repeat.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from xpkernels.cli import bench, bench_cases, bench_loss, bench_work
from xpkernels.mods.bands import SKIP


class Clock:
    """A fake ``perf_counter``; planted calls advance it and log their names."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self):
        return self.now

    def planted(self, name, durations, then=1.0):
        """A bench setup whose call takes ``durations`` in turn (warm-ups included), then ``then``."""
        durations = iter(durations)

        def setup():
            def call():
                self.calls.append(name)
                self.now += next(durations, then)

            return call

        return setup


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench, "_now", clock)
    return clock


def pair(clock, ours, theirs, repeats=3):
    """One comparison: ``ours`` and ``theirs`` are (durations, then) of the planted calls."""
    return bench_cases.compare(
        "op",
        "forward",
        "4x4",
        "GB/s",
        (1e9, "bytes = 1e9"),
        repeats,
        ("xpkernels", clock.planted("ours", *ours)),
        ("torch", clock.planted("theirs", *theirs)),
    )


def run_planted(monkeypatch, capsys, tmp_path, benches, skipped=()):
    monkeypatch.setattr(bench, "_benches", lambda *args: (benches, list(skipped)))
    path = tmp_path / "bench.json"
    rc = bench.run(json_path=str(path))
    out, err = capsys.readouterr()
    record = json.loads(path.read_text())
    return rc, out, err, {(r["op"], r["pass"], r["impl"]): r for r in record["rows"]}, record


def test_quiet_rows_report_min_median_max_and_are_not_retimed(monkeypatch, capsys, tmp_path, clock):
    # Warm-up 1, then 1.0, 1.1, 1.25: spread (1.25 - 1.0) / 1.1 < 25%.
    benches = pair(clock, ([1, 1.0, 1.1, 1.25], 1.0), ([], 2.0))
    rc, out, err, rows, record = run_planted(monkeypatch, capsys, tmp_path, benches)
    assert rc == 0
    ours, theirs = rows[("op", "forward", "xpkernels")], rows[("op", "forward", "torch")]
    assert (ours["min_s"], ours["median_s"], ours["max_s"]) == pytest.approx((1.0, 1.1, 1.25))
    assert ours["repeats"] == 3 and ours["times_s"] == pytest.approx([1.0, 1.1, 1.25])
    assert ours["spread"] == pytest.approx(0.25 / 1.1)
    assert not ours["flagged"] and not ours["retimed"] and ours["first_spread"] is None
    assert ours["ratio"] == pytest.approx(1.1 / 2.0)
    assert theirs["spread"] == 0 and not theirs["flagged"]
    assert clock.calls == ["ours"] * 4 + ["theirs"] * 4  # nothing re-timed
    assert record["retimed_together"] == [] and record["skipped"] == []
    line = next(x for x in out.splitlines() if x.startswith("op") and "xpkernels" in x)
    assert "1000.00" in line and "1100.00" in line and "1250.00" in line and "23%" in line
    assert "0.55" in line and "NOISY" not in line
    assert "none re-timed" in out


def test_spread_at_the_limit_is_not_flagged(clock):
    # (1.25 - 1.0) / 1.0 = 25% exactly: not above the limit.
    (row_bench, _) = pair(clock, ([1, 1.0, 1.0, 1.25], 1.0), ([], 1.0))
    row = bench.measure(row_bench)
    assert row.spread == pytest.approx(bench.SPREAD_LIMIT) and not row.flagged


def test_noisy_row_is_flagged_and_retimed_interleaved(monkeypatch, capsys, tmp_path, clock):
    # First timing 1, 1, 3 (spread 200%); the re-timing (warm-up, then 1.5 x 3) is quiet.
    benches = pair(clock, ([1, 1, 1, 3, 1], 1.5), ([], 2.0))
    rc, out, err, rows, record = run_planted(monkeypatch, capsys, tmp_path, benches)
    assert rc == 0
    ours, theirs = rows[("op", "forward", "xpkernels")], rows[("op", "forward", "torch")]
    assert ours["retimed"] and theirs["retimed"]
    assert ours["first_spread"] == pytest.approx(2.0) and theirs["first_spread"] == 0
    assert not ours["flagged"] and ours["spread"] == 0 and ours["times_s"] == [1.5] * 3
    assert ours["median_s"] == 1.5 and ours["ratio"] == pytest.approx(0.75)  # of the re-timing
    # First timing each side alone, then warm-ups and the timed runs alternating.
    assert clock.calls[8:] == ["ours", "theirs"] * 4
    assert record["retimed_together"] == [["op/forward/xpkernels", "op/forward/torch"]]
    assert "op/forward/xpkernels: 200% -> 0% (flag cleared)" in out
    assert "op/forward/torch: 0% -> 0% (was not flagged" in out


def test_row_still_noisy_after_retiming_stays_flagged(monkeypatch, capsys, tmp_path, clock):
    benches = pair(clock, ([1, 1, 1, 3, 1, 1, 1, 4], 1.0), ([], 2.0))
    rc, out, err, rows, record = run_planted(monkeypatch, capsys, tmp_path, benches)
    ours = rows[("op", "forward", "xpkernels")]
    assert ours["retimed"] and ours["flagged"] and ours["spread"] == pytest.approx(3.0)
    assert ours["first_spread"] == pytest.approx(2.0)
    line = next(x for x in out.splitlines() if x.startswith("op") and "xpkernels" in x)
    assert "NOISY" in line
    assert "op/forward/xpkernels: 200% -> 300% (still flagged" in out


def test_noisy_baseline_is_retimed_with_every_row_compared_to_it(clock):
    # "theirs" is the baseline of "ours" and of a third row: one group, each timed once.
    benches = pair(clock, ([], 1.0), ([1, 1, 1, 3], 2.0))
    other = bench_cases.Bench(
        bench_cases.Row(
            "other", "forward", "xpkernels", "4x4", "GB/s", 1e9, "f", "op/forward/torch"
        ),
        clock.planted("other", []),
        3,
    )
    benches.append(other)
    for b in benches:
        bench.measure(b)
    clock.calls.clear()
    groups = bench.retime_noisy(benches)
    assert [[row.key for row in group] for group in groups] == [
        ["op/forward/xpkernels", "op/forward/torch", "other/forward/xpkernels"]
    ]
    assert clock.calls == ["ours", "theirs", "other"] * 4
    assert all(b.row.retimed and not b.row.flagged for b in benches)


def test_missing_torch_is_named_and_its_rows_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # ``import torch`` now fails
    benches, skipped = bench_cases.benches(True, ["rms_norm", "attention"], "numpy", 1)
    assert benches and all(b.row.impl == "xpkernels" and b.row.baseline is None for b in benches)
    assert skipped == [
        "torch is not installed: the comparison rows against F.rms_norm, "
        "F.scaled_dot_product_attention are skipped"
    ]


def test_a_primitive_without_rows_is_named():
    benches, skipped = bench_cases.benches(True, ["merge_attention_states"], "numpy", 1)
    assert benches == []
    assert skipped == ["merge_attention_states: bench has no rows for this primitive"]


#: Runs ``bench`` in a fresh interpreter where ``import torch`` fails as if torch were not installed.
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from xpkernels.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_missing_torch_is_named_in_the_output(tmp_path):
    path = tmp_path / "bench.json"
    args = ["bench", "--quick", "--op", "rms_norm", "--repeats", "1", "--json", str(path)]
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "torch is not installed: the comparison rows against F.rms_norm are skipped"
    assert expected in done.stdout
    record = json.loads(path.read_text())
    assert record["skipped"] == [expected] and "torch" not in record["environment"]
    assert {r["impl"] for r in record["rows"]} == {"xpkernels"}
    assert all(r["error"] is None for r in record["rows"])


def test_no_skipped_line_when_torch_imports(monkeypatch):
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["softmax"], "numpy", 1)
    assert skipped == [] and {b.row.impl for b in benches} == {"xpkernels", "torch"}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_only_on_a_terminal(monkeypatch):
    for stream, draws in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        progress = bench._Progress(1)
        progress.start("a row")
        progress.advance()
        progress.close()
        assert ("\r" in stream.getvalue()) is draws
        assert ("1/1" in stream.getvalue()) is draws  # the bar reached the end
        assert bool(stream.getvalue()) is draws


def test_redirected_run_writes_no_carriage_return(monkeypatch, capsys, tmp_path, clock):
    rc, out, err, rows, record = run_planted(
        monkeypatch, capsys, tmp_path, pair(clock, ([], 1.0), ([], 1.0))
    )
    assert "\r" not in err and "\r" not in out


def test_a_retiming_that_fails_is_reported_as_the_rows_error(monkeypatch, capsys, tmp_path, clock):
    benches = pair(clock, ([1, 1, 1, 3], 1.0), ([], 2.0))
    first_setup = benches[0].setup
    setups = iter([first_setup])

    def setup():
        made = next(setups, None)
        if made is None:
            raise MemoryError("no room the second time")
        return made()

    benches[0].setup = setup
    rc, out, err, rows, record = run_planted(monkeypatch, capsys, tmp_path, benches)
    assert rc == 1
    for impl in ("xpkernels", "torch"):
        assert rows[("op", "forward", impl)]["error"] == (
            "re-timing: MemoryError: no room the second time"
        )
    assert "op/forward/xpkernels: 200% -> - (failed)" in out


def test_kept_pairs_of_each_flex_mask():
    assert bench_work.kept_pairs(4, "causal") == 10
    assert bench_work.kept_pairs(5, 1) == 1 + 2 + 2 + 2 + 2  # each query and the key before it
    docs = bench_work.document_ids(100, 4)
    assert docs.shape == (100,) and list(np.unique(docs)) == [0, 1, 2, 3]
    assert (np.diff(docs) >= 0).all()
    assert bench_work.kept_pairs(100, docs) == sum(int(n) ** 2 for n in np.bincount(docs))


def test_varlen_pairs_count_each_sequence_alone():
    assert bench_cases._varlen_pairs((3, 0, 2), causal=False) == 9 + 0 + 4
    assert bench_cases._varlen_pairs((3, 0, 2), causal=True) == 6 + 0 + 3


def test_padded_batch_holds_the_packed_sequences_and_attends_alike():
    import xpkernels as xk

    lengths = (5, 0, 9, 1)
    rng = np.random.default_rng(0)
    packed = [rng.standard_normal((sum(lengths), 2, 8)) for _ in range(4)]
    padded = bench_cases._padded(packed[0], lengths)
    assert padded.shape == (4, 9, 2, 8)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(padded[b, :n], packed[0][starts[b] : starts[b] + n])
        assert not padded[b, n:].any()
    cu = starts.astype(np.int32)
    for causal in (False, True):
        (q, k, v, _), opts = bench_cases._padded_inputs(
            bench_work.Arrays("numpy"), packed, lengths, causal
        )
        assert q.shape == (4, 2, 9, 8)
        want = xk.attention_varlen(*packed[:3], cu, cu, causal=causal)
        got = xk.attention(q, k, v, **opts)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(
                np.moveaxis(got[b, :, :n], 0, 1), want[starts[b] : starts[b] + n], atol=1e-12
            )
            assert not got[b, :, n:].any()  # the padded queries are masked, not computed


def test_varlen_rows_compare_packed_with_padded_at_the_same_work():
    benches, _ = bench_cases.benches(True, ["attention_varlen"], "numpy", 1)
    rows = {b.row.key: b.row for b in benches}
    lengths = bench_cases.SHAPES[True]["varlen"]["lengths"]
    h, d = bench_cases.SHAPES[True]["varlen"]["H"], bench_cases.SHAPES[True]["varlen"]["D"]
    for op, causal in (("attention_varlen", False), ("attention_varlen (causal)", True)):
        for pass_, factor in (("forward", 1.0), ("backward", 2.5)):
            ours, padded = rows[f"{op}/{pass_}/xpkernels"], rows[f"{op}/{pass_}/xpkernels padded"]
            assert ours.baseline == padded.key and padded.baseline is None
            assert (
                ours.work
                == padded.work
                == factor * 4 * h * d * bench_cases._varlen_pairs(lengths, causal)
            )
    assert len(rows) == 8
    for b in benches:
        assert bench.measure(b).error is None, b.row.key


def test_a_full_run_times_attention_and_flex_at_both_shapes(monkeypatch):
    """The issue's targets sit at 1x8x2048x64 and 1x8x4096x128: a full run has rows at each,
    the larger ones named apart so that every ratio keeps its own baseline."""
    monkeypatch.setitem(sys.modules, "torch", None)  # no compile; only the rows are listed
    benches, _ = bench_cases.benches(False, ["attention", "flex_attention"], "numpy", 1)
    keys = [b.row.key for b in benches]
    assert len(keys) == len(set(keys))
    shapes = {b.row.op: b.row.shape for b in benches if b.row.pass_ == "forward"}
    for op in ("attention", "attention (causal)", "flex causal mask", "flex window 256"):
        assert shapes[op] == "1x8x2048x64"
        assert shapes[f"{op} S=4096 D=128"] == "1x8x4096x128"
    by_key = {b.row.key: b.row for b in benches}
    for row in by_key.values():
        if row.baseline is not None:
            assert by_key[row.baseline].shape == row.shape, row.key


def test_a_long_error_prints_its_first_line_and_keeps_the_rest_in_json(
    monkeypatch, capsys, tmp_path, clock
):
    """A compiler's failure runs to thousands of lines: the table's note gives the first one."""
    benches = pair(clock, ([1, 1, 1, 1], 1.0), ([1, 1, 1, 1], 2.0))

    def setup():
        raise RuntimeError("C++ compile error\n" + "g++ ...\n" * 500)

    benches[1].setup = setup
    rc, out, err, rows, record = run_planted(monkeypatch, capsys, tmp_path, benches)
    assert rc == 1
    assert "op/forward/torch failed: RuntimeError: C++ compile error (500 more lines" in out
    assert "g++" not in out
    assert rows[("op", "forward", "torch")]["error"].count("g++") == 500


def test_torch_document_mask_keeps_the_pairs_of_each_document():
    torch = pytest.importorskip("torch")
    docs = bench_work.document_ids(100, 4)
    keep = bench_work.torch_document_mask(docs)(0, 0, torch.arange(100)[:, None], torch.arange(100))
    np.testing.assert_array_equal(keep.numpy(), docs[:, None] == docs[None, :])


def test_block_sparse_document_rows_visit_only_the_tiles_of_each_document(monkeypatch):
    """torch's side gets create_block_mask; ours skips the cross-document tiles too: through
    the document mask's own key ranges over host ids (NumPy, PyTorch CPU tensors), through a
    BlockMask built in the setup over ids that declare none. The dense side skips nothing."""
    pytest.importorskip("torch", reason="torch is not installed")
    import xpkernels.mods as xm
    import xpkernels.mods.bands as bands

    built, plans = [], []
    build, plan = xm.build_block_mask, xm.plan_tiles
    monkeypatch.setattr(
        xm, "build_block_mask", lambda *a, **kw: built.append(build(*a, **kw)) or built[-1]
    )
    monkeypatch.setattr(
        xm, "plan_tiles", lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1]
    )
    s = 1024
    ids = bench_work.document_ids(s, 4)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 1, s, 8), dtype=np.float32) for _ in range(4)]

    def run(library, sparse):
        call = bench_cases._xpk_flex_setup(
            bench_work.Arrays(library), inputs, "forward", ids, sparse
        )()
        plans.clear()
        call()
        return library, sparse, len(built), any(bool(np.any(p.states == SKIP)) for p in plans)

    outputs = [run("numpy", True), run("numpy", False), run("torch", True)]
    monkeypatch.setattr(bands, "exact_band", lambda *a, **kw: None)  # ids without a band
    outputs.append(run("numpy", True))
    assert outputs == [
        ("numpy", True, 0, True),
        ("numpy", False, 0, False),
        ("torch", True, 0, True),
        ("numpy", True, 1, True),
    ]


def _floor_script():
    """``bench/cpu_attention_floor.py`` as a module (``bench/`` is not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "cpu_attention_floor.py"
    spec = importlib.util.spec_from_file_location("cpu_attention_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("heads, seq, dim", [(2, 300, 32), (1, 1100, 16)])
def test_floor_loop_with_passes_computes_attention(heads, seq, dim):
    """The floor's bare NumPy loop is a real attention forward (one key tile whose length
    does not fold by 8; two key tiles and three query tiles), so it is no strawman."""
    from xpkernels.testing import references as ref
    from xpkernels.testing.harness import max_error
    from xpkernels.testing.tolerances import floor

    (q, k, v, o), _, passes = _floor_script().tiles(heads, seq, dim)
    passes()
    keep = ref.attention_keep(1, seq, seq)
    expected, *_ = ref.attention(
        *(a[None].astype(np.float64) for a in (q, k, v)), scale=dim**-0.5, keep=keep
    )
    assert max_error(o[None], expected) <= floor("attention", "forward", "float32")


def test_floor_script_prints_and_records_every_row(tmp_path):
    path = tmp_path / "floor.json"
    args = ["--heads", "1", "--seq", "64", "--dim", "16", "--repeats", "2", "--json", str(path)]
    script = _floor_script().__file__
    done = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(path.read_text())["rows"]
    assert list(rows) == ["products only", "products + passes", "xpkernels", "sdpa"]
    assert rows["sdpa"]["ratio_to_sdpa"] == 1.0
    for name, figures in rows.items():
        assert figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
        assert name in done.stdout


def test_torch_arrays_add_the_autograd_rows_and_each_measures(monkeypatch):
    """``--array torch`` times xpkernels on PyTorch CPU tensors and adds the autograd rows
    (``loss.backward()`` through xpkernels' ops against the in-place calls and torch's op)."""
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["rms_norm"], "torch", 1)
    autograd = [b for b in benches if b.row.op == "rms_norm [torch autograd]"]
    assert skipped == []
    assert {b.row.impl for b in autograd} == {"autograd", "in-place", "torch"}
    for b in benches:
        assert bench.measure(b).error is None, b.row.key


def _summarize_script():
    """``bench/summarize_results.py`` as a module (``bench/`` is not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "summarize_results.py"
    spec = importlib.util.spec_from_file_location("summarize_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_summary_keeps_each_rows_latest_run_with_its_baseline(
    monkeypatch, capsys, tmp_path, clock
):
    """Two ``bench --json`` runs: the newer one's rows replace the older one's, the rows it
    lacks stay from the older run, and a ratio's two sides come from one run."""
    runs = []
    for name, ours in (("cpu-2026-12-01", 1.0), ("cpu-2026-12-02", 0.5)):
        benches = pair(clock, ([], ours), ([], 2.0))
        if name == "cpu-2026-12-01":  # a second comparison only the older run has
            other = pair(clock, ([], 3.0), ([], 1.5))
            for b in other:
                b.row.op = "other"
                b.row.baseline = b.row.baseline and "other/forward/torch"
            benches += other
        monkeypatch.setattr(bench, "_benches", lambda *a, benches=benches: (benches, []))
        path = tmp_path / f"{name}.json"
        assert bench.run(json_path=str(path)) == 0
        runs.append(str(path))
    capsys.readouterr()
    out = tmp_path / "cpu.md"
    summarize = _summarize_script()
    assert summarize.main(["cpu", *runs, "--note", "cpu-2026-12-02=quiet", "--out", str(out)]) == 0
    text = out.read_text()
    lines = [line for line in text.splitlines() if line.startswith("| op") or "| other" in line]
    assert len(lines) == 2  # one line per comparison: the baselines are its "vs" columns
    op, other = (line.split(" | ") for line in lines)
    assert op[4].startswith("500.00 (500.00-500.00)") and op[8] == "0.25"
    assert op[7].startswith("2000.00") and op[9].startswith("cpu-2026-12-02")
    assert other[8] == "2.00" and other[9].startswith("cpu-2026-12-01")
    sources = text.split("## Sources")[1]
    assert "| cpu-2026-12-02 | " in sources and "quiet |" in sources  # dated by the run itself


def test_sm90_summary_keeps_each_kernels_latest_compile():
    summarize = _summarize_script()

    def row(row_id, regs, error=None):
        facts = None
        if error is None:
            load = {"kind": "load", "in_loop": True, "ptx": {"cp.async.16B": 8}}
            store = {"kind": "store", "in_loop": False, "ptx": {"st.global.128": 4}}
            facts = {
                "dots": {"wgmma": 2},
                "regs": regs,
                "shared": 2048,
                "num_warps": 8,
                "num_stages": 2,
                "ctas_per_sm": 1,
                "tile_ops": [load, store],
            }
        targets = {"wgmma": "PASS", "no_spills": "PASS", "tile_loads_16B": "PASS"}
        return {"id": row_id, "facts": facts, "targets": targets, "spill_bytes": 0, "error": error}

    env = {"date": "2026-12-01T00:00:00+00:00", "triton": "3.6.0"}
    old = {"environment": env, "kernels": [row("a/k", 100), row("b/k", 90, "boom\nPassManager")]}
    new = {"environment": env, "kernels": [row("a/k", 80), row("a/k", 81)]}  # two launches
    summarize._SOURCES[:] = [("old", old, "old.json"), ("new", new, "new.json")]
    assert list(summarize.sm90_rows([("old", old), ("new", new)])) == ["new", "old"]
    text = summarize.sm90_markdown([("old", old), ("new", new)], None, {}, "cmd")
    assert text.index("## new") < text.index("## old")
    assert "| a/k | wgmmax2 | 80 | 0 | 2.0 | 8/2 | 1 | loop[cp16Bx8] - | st128x4 |" in text
    assert "| a/k | wgmmax2 | 81 |" in text and "| a/k | wgmmax2 | 100 |" not in text
    assert "| b/k | ERROR |" in text and "`b/k` does not compile: PassManager" in text


def test_row_work_is_what_its_formula_says():
    """The bytes of each row pass evaluate from its printed formula (LayerNorm's backward
    moves w, dw and db: 3 vectors of M)."""
    for op in (*bench_work.ROW_OPS, *bench_work.GATED_OPS):
        for pass_ in ("forward", "backward"):
            work, formula = bench_work.row_work(op, pass_, 96, 40, 2)
            expression = formula.removeprefix("bytes = ").split(" (")[0]
            assert eval(expression, {"R": 96, "M": 40, "s": 2}) == work, (op, pass_, formula)
    assert bench_work.row_work("layer_norm", "backward", 1, 1, 1)[0] == 3 + 3 + 8
    assert bench_work.row_work("swiglu", "backward", 3, 5, 2)[0] == 5 * 3 * 5 * 2


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_gated_rows_time_each_case_against_the_torch_composition(library):
    """SwiGLU and GeGLU (the tanh form under its own name, the exact one beside it), forward
    and backward, each against the PyTorch composition it replaces at the same bytes: read
    a and b, write y (3 arrays); read a, b and dy, write da and db (5)."""
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["swiglu", "geglu"], library, 1)
    rows = {b.row.key: b.row for b in benches}
    r, m = bench_cases.SHAPES[True]["rows"]
    names = ("swiglu", "geglu", "geglu (approximate=none)")
    assert [b.row.op for b in benches] == [name for name in names for _ in range(4)]
    for name in names:
        for pass_, arrays in (("forward", 3), ("backward", 5)):
            ours, theirs = rows[f"{name}/{pass_}/xpkernels"], rows[f"{name}/{pass_}/torch"]
            assert ours.baseline == theirs.key and theirs.baseline is None
            assert ours.work == theirs.work == arrays * r * m * 4 and ours.shape == f"{r}x{m}"
    assert skipped == [] and len(rows) == 12
    for b in benches:
        assert bench.measure(b).error is None, b.row.key


def test_gated_cases_compute_what_their_torch_composition_computes():
    """Each gated case's xpkernels forward is the PyTorch composition it is timed against
    (GeGLU's form passed alike to both sides)."""
    torch = pytest.importorskip("torch")

    class Kept(bench_work.Arrays):
        def empty_like(self, a):
            self.made = super().empty_like(a)
            return self.made

    inputs = bench_work.gated_inputs(8, 64, bench_work.numpy_random(0))
    a, b = (torch.from_numpy(inputs[n]) for n in ("a", "b"))
    for op in bench_work.GATED_OPS:
        for name, options in bench_work.GATED_CASES[op]:
            arrays = Kept("numpy")
            bench_work.gated_calls(op, arrays, inputs, options).forward()
            want = bench_work.torch_gated_op(op, options)(a, b).numpy()
            np.testing.assert_allclose(arrays.made, want, rtol=1e-5, atol=1e-6, err_msg=name)
    geglu = dict(bench_work.GATED_CASES["geglu"])
    assert geglu["geglu"] == {"approximate": "tanh"}  # Gemma's gelu_pytorch_tanh, the default


#: Runs ``bench/gpu.py``'s SwiGLU and GeGLU entries as its dry run does (CPU tensors, the
#: Triton interpreter; the cupy backend's CUDA C through cudacpu) at one small shape, with a
#: planted Liger-Kernel whose backward writes da and db over the a and b it saved, as
#: Liger's does. Prints the entries, and whether the inputs every side shares came through
#: unchanged, as JSON on its last line.


def _gpu_dry_run(script: str, tmp_path) -> dict:
    """The JSON report ``script`` prints last after driving bench/gpu.py's entries under the
    Triton interpreter (skipped without torch and triton)."""
    import importlib.util
    import os
    import pathlib

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("bench/gpu.py's dry run needs torch and triton")
    repo = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script, str(repo / "bench" / "gpu.py"), str(tmp_path)],
        cwd=repo,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


GPU_GATED = """
import dataclasses, importlib.machinery, importlib.util, json, sys, types
import torch


class Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da, db = dc * b, dc * a
        a.data.copy_(da)
        b.data.copy_(db)
        return a, b


for name in ("", ".ops", ".ops.swiglu", ".ops.geglu"):
    name = "liger_kernel" + name
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.LigerSiLUMulFunction = module.LigerGELUMulFunction = Fused
    sys.modules[name] = module
spec = importlib.util.spec_from_file_location("gpu_bench", sys.argv[1])
gpu = importlib.util.module_from_spec(spec)
sys.modules["gpu_bench"] = gpu
spec.loader.exec_module(gpu)
bench = gpu.Bench(gpu.parse_args(["--out", sys.argv[2], "--dry-run"]))
gpu.measure_ceilings(bench)
unchanged = {}
for dtype, views in (("bfloat16", None), ("float16", gpu.CupyViews(bench))):
    inputs = gpu.cases.gated_inputs(64, 256, bench.random(getattr(torch, dtype)))
    kept = {n: t.clone() for n, t in inputs.items()}
    for op in gpu.cases.GATED_OPS:
        for name, options in gpu.cases.GATED_CASES[op]:
            if views is None:
                gpu.gated_case(bench, op, name, options, inputs, dtype)
            else:
                gpu.cupy_gated_case(bench, views, op, name, options, inputs)
    unchanged[dtype] = all(torch.equal(inputs[n], kept[n]) for n in kept)
entries = [dataclasses.asdict(e) for e in bench.entries]
print(json.dumps({"entries": entries, "unchanged": unchanged}))
"""


def test_gpu_dry_run_times_the_gated_entries_against_torch_and_liger(tmp_path):
    """bench/gpu.py's SwiGLU and GeGLU entries run on the triton and cupy backends, each
    against the PyTorch composition (and the triton call, on cupy), Liger-Kernel's fused
    function where it has one (not the exact GeGLU), without writing over their inputs."""
    report = _gpu_dry_run(GPU_GATED, tmp_path)
    assert report["unchanged"] == {"bfloat16": True, "float16": True}
    entries = {(e["section"], e["op"], e["pass_"]): e for e in report["entries"]}
    names = ("swiglu", "geglu", "geglu (approximate=none)")
    assert len(entries) == len(report["entries"]) == 2 * 2 * len(names)
    for name in names:
        for pass_ in ("forward", "backward"):
            triton, cupy = entries[("gated", name, pass_)], entries[("cupy", f"cupy {name}", pass_)]
            for e in (triton, cupy):
                assert e["error"] is None and e["ms"] > 0 and e["ceiling"] == "copy", e["op"]
                assert all("error" not in b for b in e["baselines"].values()), e["baselines"]
            torch_op = "F.silu(a)*b" if name == "swiglu" else "F.gelu(a)*b"
            liger = ["liger"] if name != "geglu (approximate=none)" else []
            assert list(triton["baselines"]) == [torch_op, *liger]
            assert list(cupy["baselines"]) == ["xk triton", f"torch {name}"]


def test_rope_work_is_what_its_formula_says():
    """RoPE's bytes evaluate from its printed formula: q and k read and written, the two tables
    (S, D/2) read once."""
    for pass_ in ("forward", "backward"):
        work, formula = bench_work.rope_work(pass_, 2, 4, 2, 6, 8, 2, 4)
        expression = formula.removeprefix("bytes = ").split(" (")[0]
        names = {"B": 2, "H": 4, "Hkv": 2, "S": 6, "D": 8, "R2": 4, "s": 2, "t": 4}
        assert eval(expression, names) == work == 2 * 6 * 2 * 6 * 8 * 2 + 2 * 6 * 4 * 4, formula
        assert "plus the tables" in formula


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_rope_rows_time_both_passes_against_the_hf_composition(library):
    """RoPE forward and backward, each against Hugging Face's apply_rotary_pos_emb composition
    at the same bytes."""
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["rope"], library, 1)
    shape = bench_cases.SHAPES[True]["rope"]
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    rows = {x.row.key: x.row for x in benches}
    assert skipped == [] and len(rows) == len(benches) == 4
    for pass_ in ("forward", "backward"):
        ours, theirs = rows[f"rope/{pass_}/xpkernels"], rows[f"rope/{pass_}/torch"]
        assert ours.baseline == theirs.key and theirs.baseline is None
        assert ours.work == theirs.work == 2 * (h + hkv) * b * s * d * 4 + s * d * 4
        assert ours.shape == f"{b}x{h}/{hkv}x{s}x{d}" and ours.unit == "GB/s"
    for x in benches:
        assert bench.measure(x).error is None, x.row.key


def test_rope_calls_compute_what_the_hf_composition_computes():
    """The timed rope_ and rope_backward_ give Hugging Face's composition's outputs and its
    autograd gradients, on (B, H, S, D) views of (B, S, H, D) buffers as both sides get them."""
    torch = pytest.importorskip("torch")

    class Kept(bench_work.Arrays):
        made: list

        def empty_like(self, a):
            self.made.append(super().empty_like(a))
            return self.made[-1]

    inputs = bench_work.rope_inputs(2, 4, 2, 12, 16, bench_work.numpy_random(0))
    arrays = Kept("numpy")
    arrays.made = []
    calls = bench_work.rope_calls(arrays, inputs)
    calls.forward()
    calls.backward()
    q_out, k_out, dq, dk = arrays.made
    assert q_out.shape == (2, 4, 12, 16) and q_out.strides == bench_work.bhsd(inputs["q"]).strides
    cos, sin = bench_work.hf_rope_tables(
        torch.from_numpy(inputs["cos"]), torch.from_numpy(inputs["sin"]), 2
    )
    q, k = (torch.from_numpy(inputs[n]).requires_grad_() for n in ("q", "k"))
    outs = bench_work.torch_rope(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), cos, sin)
    douts = tuple(torch.from_numpy(inputs[n]).permute(0, 2, 1, 3) for n in ("dq_out", "dk_out"))
    grads = torch.autograd.grad(outs, (q, k), douts)
    for ours, want in zip((q_out, k_out), outs):
        np.testing.assert_allclose(ours, want.detach().numpy(), rtol=1e-5, atol=1e-5)
    for ours, want in zip((dq, dk), grads):
        np.testing.assert_allclose(ours, want.permute(0, 2, 1, 3).numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(q_out, bench_work.bhsd(inputs["q"]))  # the rows rotate


#: Runs ``bench/gpu.py``'s RoPE entries as its dry run does (CPU tensors, the Triton
#: interpreter; the cupy backend's CUDA C through cudacpu) at the dry run's shape, with a
#: planted Liger-Kernel that, as Liger's does, rotates the storage of q and k in place in its
#: forward (returning views of it and of cos, sin, as its newer releases do) and the
#: cotangents' in its backward. Prints the entries, and whether the inputs every side shares came through
#: unchanged, as JSON on its last line.
GPU_ROPE = """
import dataclasses, importlib.machinery, importlib.util, json, sys, types
import torch


def turn(x, cos, sin, sign):
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sign * sin[..., :half]
    x1, x2 = x[..., :half].clone(), x[..., half:].clone()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s
    return x


def turned(x, cos, sin, sign):
    x = x.transpose(1, 2).contiguous()  # no copy over (B, S, H, D) storage
    return turn(x, cos[:, :, None], sin[:, :, None], sign).transpose(1, 2)


class Rope(torch.autograd.Function):
    @staticmethod
    def forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return turned(q, cos, sin, 1), turned(k, cos, sin, 1), cos.view_as(cos), sin.view_as(sin)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[2], output[3])

    @staticmethod
    def backward(ctx, dq, dk, dcos, dsin):
        cos, sin = ctx.saved_tensors
        return turned(dq, cos, sin, -1), turned(dk, cos, sin, -1), None, None, None, None


for name in ("", ".ops", ".ops.rope"):
    name = "liger_kernel" + name
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.LigerRopeFunction = Rope
    sys.modules[name] = module
spec = importlib.util.spec_from_file_location("gpu_bench", sys.argv[1])
gpu = importlib.util.module_from_spec(spec)
sys.modules["gpu_bench"] = gpu
spec.loader.exec_module(gpu)
bench = gpu.Bench(gpu.parse_args(["--out", sys.argv[2], "--dry-run"]))
gpu.measure_ceilings(bench)
shape = gpu.cases.GPU_SHAPES[True]["rope"]
unchanged = {}
for dtype, views in (("bfloat16", None), ("float16", gpu.CupyViews(bench))):
    made = gpu.rope_tensors
    kept = {}

    def keep(*args, made=made, kept=kept):
        inputs = made(*args)
        kept.update(inputs=inputs, copies={n: t.clone() for n, t in inputs.items()})
        return inputs

    gpu.rope_tensors = keep
    if views is None:
        gpu.rope_case(bench, shape, dtype)
    else:
        gpu.cupy_rope_case(bench, views, shape)
    gpu.rope_tensors = made
    unchanged[dtype] = all(torch.equal(kept["inputs"][n], t) for n, t in kept["copies"].items())
entries = [dataclasses.asdict(e) for e in bench.entries]
print(json.dumps({"entries": entries, "unchanged": unchanged}))
"""


def test_gpu_dry_run_times_rope_against_the_composition_and_liger(tmp_path):
    """bench/gpu.py's RoPE entries run on the triton and cupy backends against the eager
    composition (and the triton call, on cupy) and Liger-Kernel's LigerRopeFunction, which
    rotates its arguments in place, without writing over the inputs the sides share."""
    report = _gpu_dry_run(GPU_ROPE, tmp_path)
    assert report["unchanged"] == {"bfloat16": True, "float16": True}
    entries = {(e["section"], e["op"], e["pass_"]): e for e in report["entries"]}
    assert len(entries) == len(report["entries"]) == 4
    shape = bench_work.GPU_SHAPES[True]["rope"]
    for pass_ in ("forward", "backward"):
        triton, cupy = entries[("rope", "rope", pass_)], entries[("cupy", "cupy rope", pass_)]
        for e in (triton, cupy):
            assert e["error"] is None and e["ms"] > 0 and e["ceiling"] == "copy", e["op"]
            assert all("error" not in b for b in e["baselines"].values()), e["baselines"]
            assert e["shape"] == [shape[n] for n in ("B", "H", "Hkv", "S", "D")]
        assert list(triton["baselines"]) == ["q*cos+rotate_half(q)*sin", "liger"]
        assert list(cupy["baselines"]) == ["xk triton", "torch rope"]
        assert triton["dtype"] == "bfloat16" and cupy["dtype"] == "float16"


def test_paged_cache_puts_each_page_where_its_table_says():
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 3, 8, 4), dtype=np.float32) for _ in range(2))
    order = rng.permutation(2 * 8 // 2)
    libraries = [lambda a: a]
    if bench_cases.torch_missing() is None:
        import torch

        libraries.append(torch.from_numpy)
    for convert in libraries:
        table, k_pages, v_pages = bench_work.paged_cache(convert(k), convert(v), convert(order), 2)
        table, k_pages, v_pages = (np.asarray(a) for a in (table, k_pages, v_pages))
        assert table.dtype == np.int32 and table.shape == (2, 4)
        for b in range(2):
            for j in range(4):
                for cache, pages in ((k, k_pages), (v, v_pages)):
                    np.testing.assert_array_equal(
                        pages[table[b, j]], cache[b, :, 2 * j : 2 * j + 2]
                    )


def test_flex_mods_declare_the_same_attention_for_xpkernels_and_torch():
    """Each flex case of bench/gpu.py (and the CPU rows' masks) means the same scores on both
    sides: xpkernels' mods against PyTorch's own (eager) ``flex_attention`` with its mods."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    import xpkernels as xk

    b, h, s, d = 1, 2, 48, 16
    inputs = bench_work.attention_inputs(b, h, s, d, bench_work.numpy_random(0))
    q, k, v = (torch.from_numpy(a) for a in inputs[:3])
    for name in bench_work.FLEX_MODS:
        mods = bench_work.flex_mods(name, s, 4)
        ours = xk.flex_attention(
            *inputs[:3], **bench_work.xpk_mods(mods, bench_work.Arrays("numpy"), h)
        )
        score, mask = bench_work.torch_mods(mods, h)
        block = None if mask is None else flex.create_block_mask(mask, None, None, s, s, "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex_attention warns that it is not compiled
            theirs = flex.flex_attention(q, k, v, score_mod=score, block_mask=block)
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5, err_msg=name)
        assert bench_work.flex_work(b, h, s, d, mods.mask, "forward")[0] > 0


def test_torch_attention_rows_add_the_transformers_training_step():
    """``--array torch --op attention`` adds a tiny transformers Llama's training step with
    ``apply_xpkernels`` against the same model on SDPA, and both sides measure."""
    pytest.importorskip("transformers", reason="the Llama rows need transformers")
    benches, skipped = bench_cases.benches(True, ["attention"], "torch", 1)
    llama = [b for b in benches if b.row.op == "llama train step [transformers]"]
    assert skipped == [] and {b.row.impl for b in llama} == {"xpkernels", "sdpa"}
    for b in llama:
        assert bench.measure(b).error is None, b.row.key


def test_loss_work_is_what_its_formula_says():
    """Cross-entropy's bytes (the logits read, and the gradient written backward, plus the
    int64 targets and float32 lse of each row) and linear cross-entropy's FLOPs (the
    composition's products) evaluate from their printed formulas."""
    names = {"N": 6, "V": 10, "H": 4, "s": 2}
    for pass_, logits, per_row in (("forward", 1, 12), ("backward", 2, 12), ("fwd+bwd", 3, 24)):
        work, formula = bench_work.cross_entropy_work(pass_, 6, 10, 2)
        expression = formula.removeprefix("bytes = ").split(" (")[0]
        assert eval(expression, names) == work == logits * 6 * 10 * 2 + per_row * 6, formula
    for pass_, products, done in (
        ("forward", 1, None),
        ("backward", 2, "forms the logits again: 3 products done"),
        ("fwd+bwd", 3, "4 products done, fused: 3"),
    ):
        work, formula = bench_work.linear_cross_entropy_work(pass_, 6, 4, 10)
        expression = formula.removeprefix("FLOPs = ").split(" (")[0]
        assert eval(expression, names) == work == 2 * products * 6 * 4 * 10, formula
        assert ("products done" in formula) is (done is not None) and (done or "") in formula


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_cross_entropy_rows_time_both_passes_against_f_cross_entropy(library):
    """Cross-entropy forward and backward, each against F.cross_entropy at the same bytes."""
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["cross_entropy"], library, 1)
    n, v = (bench_cases.SHAPES[True]["cross_entropy"][k] for k in ("N", "V"))
    rows = {x.row.key: x.row for x in benches}
    assert skipped == [] and len(rows) == len(benches) == 4
    for pass_, logits in (("forward", 1), ("backward", 2)):
        ours, theirs = (
            rows[f"cross_entropy/{pass_}/xpkernels"],
            rows[f"cross_entropy/{pass_}/torch"],
        )
        assert ours.baseline == theirs.key and theirs.baseline is None
        assert ours.work == theirs.work == logits * n * v * 4 + 12 * n
        assert ours.shape == f"{n}x{v}" and ours.unit == "GB/s"
    for x in benches:
        assert bench.measure(x).error is None, x.row.key


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_linear_cross_entropy_rows_time_both_passes_and_numpy_memory(library):
    """Linear cross-entropy forward and backward against F.cross_entropy(x @ W.T, t); a training
    step by autograd on PyTorch tensors; on NumPy arrays forward+backward, unfused and fused,
    against the NumPy composition, every side's peak memory written into the rows' formula
    when they are measured."""
    pytest.importorskip("torch", reason="needs torch to be importable")
    benches, skipped = bench_cases.benches(True, ["linear_cross_entropy"], library, 1)
    n, h, v = (bench_cases.SHAPES[True]["linear_cross_entropy"][k] for k in ("N", "H", "V"))
    rows = {x.row.key: x.row for x in benches}
    assert skipped == []
    for pass_, products in (("forward", 1), ("backward", 2)):
        ours = rows[f"linear_cross_entropy/{pass_}/xpkernels"]
        theirs = rows[f"linear_cross_entropy/{pass_}/torch"]
        assert ours.baseline == theirs.key and theirs.baseline is None
        assert ours.work == theirs.work == 2 * products * n * h * v
        assert ours.shape == f"{n}x{h}x{v}" and ours.unit == "TFLOP/s"
    step = [x for x in benches if x.row.pass_ == "fwd+bwd"]
    if library == "torch":  # a training step by autograd; tracemalloc does not see PyTorch's
        ours, theirs = (x.row for x in step)
        assert (ours.impl, theirs.impl) == ("xpkernels autograd", "torch")
        assert ours.baseline == theirs.key and ours.work == theirs.work == 6 * n * h * v
        assert len(rows) == 6
    else:
        ours, theirs, fused = (x.row for x in step)
        assert (ours.impl, theirs.impl, fused.impl) == (
            "xpkernels",
            "numpy logits",
            "xpkernels fused",
        )
        assert ours.baseline == fused.baseline == theirs.key and theirs.baseline is None
        assert ours.work == theirs.work == fused.work == 6 * n * h * v
        assert "peak extra memory" not in ours.formula  # measured by the first setup
        assert len(rows) == 7
    for x in benches:
        assert bench.measure(x).error is None, x.row.key
    for x in step if library == "numpy" else ():
        assert "peak extra memory" in x.row.formula and "chunks of" in x.row.formula
        assert x.row.formula.count("peak extra memory") == 1


def test_loss_calls_compute_what_the_torch_compositions_compute():
    """The timed cross_entropy_ / linear_cross_entropy_ calls and their backwards (and the fused
    linear forward) give the PyTorch compositions' autograd gradients, and so does the NumPy
    composition of the memory rows, with the loss."""
    torch = pytest.importorskip("torch")

    class Kept(bench_work.Arrays):
        made: list

        def empty_like(self, a):
            self.made.append(super().empty_like(a))
            return self.made[-1]

    inputs = bench_work.cross_entropy_inputs(12, 50, bench_work.numpy_random(0))
    arrays = Kept("numpy")
    arrays.made = []
    calls = bench_work.cross_entropy_calls(arrays, inputs)
    calls.forward()
    calls.backward()
    (dlogits,) = arrays.made
    logits = torch.from_numpy(inputs["logits"]).requires_grad_()
    targets = torch.from_numpy(inputs["targets"])
    (want,) = torch.autograd.grad(bench_work.torch_cross_entropy(logits, targets), logits)
    np.testing.assert_allclose(dlogits, want.numpy(), rtol=1e-5, atol=1e-7)
    assert (inputs["targets"] < 50).all() and inputs["targets"].dtype == np.int64

    inputs = bench_work.linear_cross_entropy_inputs(12, 8, 50, bench_work.numpy_random(0))
    arrays.made = []
    calls = bench_work.linear_cross_entropy_calls(arrays, inputs)
    calls.backward()
    dx, dweight = arrays.made
    x, weight = (torch.from_numpy(inputs[n]).requires_grad_() for n in ("x", "weight"))
    targets = torch.from_numpy(inputs["targets"])
    loss = bench_work.torch_linear_cross_entropy(x, weight, targets)
    want_dx, want_dweight = torch.autograd.grad(loss, (x, weight))
    np.testing.assert_allclose(dx, want_dx.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dweight, want_dweight.numpy(), rtol=1e-5, atol=1e-7)
    fused_dx, fused_dweight = np.empty_like(dx), np.empty_like(dweight)
    bench_work.linear_cross_entropy_fused(arrays, inputs, fused_dx, fused_dweight)()
    np.testing.assert_allclose(fused_dx, want_dx.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(fused_dweight, want_dweight.numpy(), rtol=1e-5, atol=1e-7)
    theirs_dx, theirs_dweight = np.empty_like(dx), np.empty_like(dweight)
    value = bench_loss.numpy_linear_cross_entropy(
        inputs["x"], inputs["weight"], inputs["targets"], theirs_dx, theirs_dweight
    )
    assert value == pytest.approx(float(loss.detach()), rel=1e-5)
    np.testing.assert_allclose(theirs_dx, want_dx.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(theirs_dweight, want_dweight.numpy(), rtol=1e-5, atol=1e-7)


def test_peak_bytes_counts_what_a_call_holds_at_once():
    """tracemalloc's peak of NumPy arrays: two 1 MB arrays alive together, then freed, count
    2 MB whatever was allocated before; tracing someone else started is left on."""
    import tracemalloc

    held = np.ones(1 << 20, dtype=np.uint8)

    def run():
        a = np.ones(1 << 20, dtype=np.uint8)
        b = np.ones(1 << 20, dtype=np.uint8)
        return a.nbytes + b.nbytes

    for tracing in (False, True):
        if tracing:
            tracemalloc.start()
        try:
            assert 2 << 20 <= bench_loss.peak_bytes(run) < (2 << 20) + (64 << 10)
            assert tracemalloc.is_tracing() is tracing
        finally:
            tracemalloc.stop()
    assert held.nbytes == 1 << 20


def test_linear_memory_holds_chunks_where_the_composition_holds_the_logits():
    """xpkernels' forward+backward, unfused or fused, holds a chunk of logits (not N x V); the
    NumPy composition holds the N x V logits; the note gives each in MiB, chunks or N x V."""
    inputs = bench_work.linear_cross_entropy_inputs(4096, 64, 4000, bench_work.numpy_random(0))
    memory = bench_loss.linear_memory(inputs)
    assert memory["rows"] == 1024 and memory["logits"] == 4096 * 4000 * 4  # the default chunk
    assert memory["chunk"] == memory["rows"] * 4000 * 4
    for side in ("xpkernels", "fused"):
        assert memory["chunk"] <= memory[side] < memory["logits"] / 2, side
    assert memory["logits"] <= memory["composition"] < 1.1 * memory["logits"]
    note = bench_loss.memory_note(memory)
    assert f"chunks of {memory['rows']} x V rows" in note and "x the N x V logits" in note
    assert "fused" in note


#: Runs ``bench/gpu.py``'s loss entries as its dry run does (CPU tensors, the Triton
#: interpreter) at the dry run's shapes, with a planted Liger-Kernel whose cross-entropy, as
#: Liger's does, computes the gradient in its forward and writes it over the logits, returning
#: ``(loss, z_loss)`` as newer releases do, and whose fused linear cross-entropy returns the
#: loss alone, as older ones do. Prints the entries, how often each planted function ran, and
#: whether the inputs every side shares came through unchanged, as JSON on its last line.
GPU_LOSS = """
import dataclasses, importlib.machinery, importlib.util, json, sys, types
import torch
import torch.nn.functional as F

calls = {"cross_entropy": 0, "linear": 0}


class CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-100, label_smoothing=0.0):
        calls["cross_entropy"] += 1
        with torch.enable_grad():
            z = logits.detach().float().requires_grad_()
            loss = F.cross_entropy(z, targets)
            (grad,) = torch.autograd.grad(loss, z)
        logits.copy_(grad)
        ctx.save_for_backward(logits.detach())
        return loss.detach(), None

    @staticmethod
    def backward(ctx, dloss, dz_loss):
        (grad,) = ctx.saved_tensors
        return grad, None, None, None


class Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, bias=None):
        calls["linear"] += 1
        with torch.enable_grad():
            xs, ws = (t.detach().requires_grad_() for t in (x, weight))
            loss = F.cross_entropy(xs @ ws.T, targets)
            dx, dw = torch.autograd.grad(loss, (xs, ws))
        ctx.save_for_backward(dx, dw)
        return loss.detach()

    @staticmethod
    def backward(ctx, dloss):
        dx, dw = ctx.saved_tensors
        return dx * dloss, dw * dloss, None, None


for name in ("", ".ops", ".ops.cross_entropy", ".ops.fused_linear_cross_entropy"):
    name = "liger_kernel" + name
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.LigerCrossEntropyFunction = CrossEntropy
    module.LigerFusedLinearCrossEntropyFunction = Linear
    sys.modules[name] = module
spec = importlib.util.spec_from_file_location("gpu_bench", sys.argv[1])
gpu = importlib.util.module_from_spec(spec)
sys.modules["gpu_bench"] = gpu
spec.loader.exec_module(gpu)
bench = gpu.Bench(gpu.parse_args(["--out", sys.argv[2], "--dry-run"]))
gpu.measure_ceilings(bench)
kept = []
for name in ("cross_entropy_inputs", "linear_cross_entropy_inputs"):
    made = getattr(gpu.cases, name)

    def keep(*args, made=made):
        inputs = made(*args)
        kept.append((inputs, {n: t.clone() for n, t in inputs.items()}))
        return inputs

    setattr(gpu.cases, name, keep)
gpu.loss_section(bench)
unchanged = all(torch.equal(i[n], t) for i, copies in kept for n, t in copies.items())
entries = [dataclasses.asdict(e) for e in bench.entries]
summary = gpu.summary_rows(bench.entries, True)
print(json.dumps({"entries": entries, "unchanged": unchanged, "calls": calls, "summary": summary}))
"""


def test_gpu_dry_run_times_the_losses_against_torch_the_products_and_liger(tmp_path):
    """bench/gpu.py's cross-entropy entries (forward, backward, both) run against
    F.cross_entropy and, forward+backward, Liger's cross-entropy, which writes over its own
    copy of the logits; linear cross-entropy's forward+backward against the composition, the
    three products and Liger's fused function, its fused forward against the composition, the
    products and our forward+backward, then its peak-memory entry (no figures in a dry run),
    each judged against its target."""
    report = _gpu_dry_run(GPU_LOSS, tmp_path)
    assert report["unchanged"] is True
    assert report["calls"]["cross_entropy"] >= 2 and report["calls"]["linear"] >= 3
    entries = {(e["section"], e["pass_"]): e for e in report["entries"]}
    assert len(entries) == len(report["entries"]) == 6
    shapes = bench_work.GPU_SHAPES[True]
    for pass_, names in (
        ("forward", ["F.cross_entropy"]),
        ("backward", ["F.cross_entropy"]),
        ("fwd+bwd", ["F.cross_entropy", "liger"]),
    ):
        e = entries[("cross_entropy", pass_)]
        assert e["error"] is None and e["ms"] > 0 and e["ceiling"] == "copy", pass_
        assert list(e["baselines"]) == names and e["dtype"] == "bfloat16"
        assert all("error" not in b for b in e["baselines"].values()), e["baselines"]
        assert e["shape"] == [shapes["cross_entropy"][k] for k in ("N", "V")]
    for pass_, ours in (("fwd+bwd", "liger"), ("fused", "xk fwd+bwd")):
        e = entries[("linear_cross_entropy", pass_)]
        assert e["error"] is None and e["ms"] > 0 and e["ceiling"] == "matmul", pass_
        assert list(e["baselines"]) == ["F.cross_entropy(x@W.T)", "3 products", ours]
        assert all("error" not in b for b in e["baselines"].values()), e["baselines"]
        assert e["shape"] == [shapes["linear_cross_entropy"][k] for k in ("N", "H", "V")]
    memory = entries[("linear_cross_entropy", "peak memory")]
    assert memory["error"] is None and memory["unit"] == "MiB" and memory["baselines"] == {}
    assert memory["rate"] is None and memory["notes"] == {}  # CUDA's allocator only
    targets = {(r["op"], r["pass"]): (r["target"], r["verdict"]) for r in report["summary"]}
    assert targets[("linear_cross_entropy", "fwd+bwd")] == (">= 0.909 x 3 products", "dry")
    assert targets[("linear_cross_entropy", "fused")] == (">= 0.909 x 3 products", "dry")
    assert targets[("linear_cross_entropy", "peak memory")] == (
        "peak <= 0.1 x F.cross_entropy(x@W.T)",
        "dry",
    )
    assert targets[("cross_entropy", "forward")] == ("-", "-")
