"""Condense raw benchmark outputs into the summaries committed under ``bench/results/``.

Raw outputs (``python -m xpkernels bench --json``, ``bench/cpu_attention_floor.py --json``,
``bench/compile_report.py --json``, ``bench/cuda_compile_report.py``, the ``gpu.json`` of
``bench/device.sh``) stay out of the tree;
what is committed is one Markdown summary per machine kind, written by this script::

    python bench/summarize_results.py cpu RUN.json [RUN.json ...] [--floor FLOOR.json ...]
        [--note FILE=TEXT ...] [--out bench/results/cpu.md]
    python bench/summarize_results.py sm90 REPORT.json [REPORT.json ...] [--cuda CUDA.json]
        [--note FILE=TEXT ...] [--out bench/results/sm90-compile.md]
    python bench/summarize_results.py gpu OUT_DIR/gpu.json [...] [--note FILE=TEXT ...]
        [--out bench/results/h200.md]

Give the inputs oldest first: a later run's row (primitive, pass, implementation and
array library) replaces an earlier one's, a later report's kernel (its id) an earlier
one's, so the summary holds the latest figure of each and names the file it came from
(each ``gpu.json`` gets its own table, newest first).
A ratio's two sides always come from the same run. Standard library only: it runs
anywhere the raw files are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

#: A date in a raw output's file name (``cpu-2026-12-03h.json``: 2026-12-03).
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
#: The compile report's targets, in its column order, and their short column names.
TARGETS = (
    ("wgmma", "wgmma"),
    ("no_spills", "spills"),
    ("tile_loads_16B", "ld16B"),
    ("row_128bit", "row128"),
)


def _name(path: str) -> str:
    """A raw file's name without its extension; a ``gpu.json`` is named by its folder (the
    ``OUT_DIR`` of ``bench/device.sh``)."""
    base = os.path.basename(path)
    if base == "gpu.json":
        return os.path.basename(os.path.dirname(os.path.abspath(path)))
    return os.path.splitext(base)[0]


def _date(path: str, data: dict) -> str:
    env = data.get("environment", {})
    if env.get("date"):
        return str(env["date"])[:10]
    found = _DATE.search(_name(path))
    return found.group(1) if found else "-"


def _recorded_in(path: str) -> str:
    """The last commit that changed ``path`` (abbreviated): the one whose ``git show`` gives
    this content back; ``-`` for a file git does not hold (or outside a checkout)."""
    try:
        done = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", os.path.basename(path)],
            cwd=os.path.dirname(os.path.abspath(path)),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "-"
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else "-"


def _notes(pairs: list[str]) -> dict[str, str]:
    notes = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--note wants FILE=TEXT, got {pair!r}")
        notes[_name(name)] = text
    return notes


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _table(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + [
        "| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines
    ]


# ----------------------------------------------------------------------------- CPU


def _ms(row: dict) -> str:
    if row.get("error"):
        return "error: " + row["error"].splitlines()[0][:60]
    low, mid, high = (1e3 * row[k] for k in ("min_s", "median_s", "max_s"))
    mark = " (noisy)" if row.get("flagged") else ""
    return f"{mid:.2f} ({low:.2f}-{high:.2f}){mark}"


def _rate(row: dict) -> str:
    return "-" if row.get("rate") is None else f"{row['rate']:.3g} {row['unit']}"


def _key(row: dict) -> str:
    return f"{row['op']}/{row['pass']}/{row['impl']}"


def cpu_lines(runs: list[tuple[str, dict]]) -> dict[str, list[tuple[dict, dict | None, str]]]:
    """Per array library, the latest (row, its baseline row or None, run name) of every row
    that is not only another row's baseline: in the order of the run with the most rows (a
    full run), rows it lacks after it in the order of their runs."""
    latest: dict[str, dict[str, tuple[dict, dict | None, str]]] = {}
    order: dict[str, list[str]] = {}
    for name, data in runs:
        rows = {_key(r): r for r in data["rows"]}
        baselines = {r["baseline"] for r in data["rows"] if r.get("baseline")}
        array = data["environment"].get("array", "numpy")
        into = latest.setdefault(array, {})
        if len(rows) >= len(order.get(array, ())):
            order[array] = list(rows)
        for key, row in rows.items():
            if key in baselines and not row.get("baseline"):
                continue
            into.pop(key, None)  # re-inserted: a newer run's rows keep its order
            into[key] = (row, rows.get(row.get("baseline") or ""), name)
    out = {}
    for array, lines in latest.items():
        rank = {key: i for i, key in enumerate(order[array])}
        keys = sorted(lines, key=lambda k: rank.get(k, len(rank)))  # stable: the rest in order
        out[array] = [lines[k] for k in keys]
    return out


def _machine(env: dict) -> str:
    """The platform, cores and versions of a run's environment, in one line."""
    machine = env.get("platform", "unknown platform")
    if env.get("cpu"):
        machine += f" ({env['cpu']})"
    versions = [f"{k} {env[k]}" for k in ("python", "numpy", "torch", "xpkernels") if k in env]
    return "; ".join([machine, *versions])


def cpu_markdown(runs, floors, notes, command: str) -> str:
    out = [
        "# CPU benchmarks: the latest figure of each row",
        "",
        f"Written by `{command}` (the full command: `bench/results/README.md`)",
        "from the raw runs under *Sources*, which are not in the tree (`git show",
        "COMMIT:bench/results/FILE` brings one back, COMMIT its *recorded in*). Each line is",
        "the newest run that timed that row; its ratio's two sides come from that same run.",
        "ms: median (min-max) of the timed runs after one warm-up; *noisy*: spread",
        "(max - min) / median still above the bench's limit after one interleaved re-timing.",
        "ratio = our median / the baseline's median (below 1: faster than it).",
        "",
    ]
    titles = {
        "numpy": "`python -m xpkernels bench` on NumPy arrays (float32)",
        "torch": "`python -m xpkernels bench --array torch` (PyTorch CPU tensors, float32)",
    }
    by_array = cpu_lines(runs)
    for array in sorted(by_array, key=lambda a: (a != "numpy", a)):
        out += [f"## {titles.get(array, array)}", ""]
        lines = []
        for row, base, name in by_array[array]:
            vs = "-"
            if row.get("baseline"):
                base_op, _, base_impl = row["baseline"].split("/")
                vs = base_impl if base_op == row["op"] else f"{base_op} ({base_impl})"
            ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.2f}"
            lines.append(
                [
                    row["op"],
                    row["pass"],
                    row["shape"],
                    row["impl"],
                    _ms(row),
                    _rate(row),
                    vs,
                    "-" if base is None else _ms(base),
                    ratio,
                    name,
                ]
            )
        head = ["primitive", "pass", "shape", "impl", "ms", "rate", "vs", "vs ms", "ratio", "run"]
        out += _table(head, lines) + [""]
    if floors:
        out += [
            "## The NumPy attention forward's floor (`bench/cpu_attention_floor.py`)",
            "",
            "One core, float32, no mask, the four rows interleaved in each repeat; vs SDPA is",
            "the median over the repeats of (row time / SDPA's time in the same repeat).",
            "",
        ]
        lines = []
        for name, data in floors:
            for row, f in data["rows"].items():
                lines.append(
                    [
                        data["shape"],
                        row,
                        f"{f['median_ms']:.1f} ({f['min_ms']:.1f}-{f['max_ms']:.1f})",
                        f"{f['ratio_to_sdpa']:.3f}",
                        str(data["repeats"]),
                        name,
                    ]
                )
        out += _table(["shape", "row", "ms", "vs SDPA", "repeats", "run"], lines) + [""]
    out += ["## Sources", ""]
    used = {name for lines in by_array.values() for *_, name in lines}
    sources = [(n, d, p) for n, d, p in _SOURCES if n in used or n in dict(floors)]
    machines = sorted({_machine(d["environment"]) for _, d, _ in sources})
    if len(machines) == 1:
        out += [f"Machine and versions (every source): {machines[0]}.", ""]
    lines = []
    for name, data, path in sources:
        line = [name, _date(path, data), _recorded_in(path)]
        env = data["environment"]
        if name in dict(floors):
            line += ["-", "1, pinned (BLAS and torch 1 thread)"]
        else:
            line.append(env.get("array", "numpy"))
            threads = f", torch {env['torch_threads']} threads" if "torch_threads" in env else ""
            line.append(f"{env.get('cpu_count', '?')}{threads}")
        if len(machines) > 1:
            line.append(_machine(data["environment"]))
        lines.append(line + [notes.get(name, "")])
    head = ["run", "date", "recorded in", "array", "cores"]
    head += ["machine"] if len(machines) > 1 else []
    out += _table(head + ["note"], lines)
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- sm_90


def loads(facts: dict, kind: str) -> str:
    """16-bit global accesses of ``kind`` (``load``/``store``) in the compile report's notation:
    ``ld128`` 128-bit, ``ld16`` 2-byte, ``cp16B`` 16-byte ``cp.async``; ``loop[...]`` inside a loop."""
    loop: dict[str, int] = {}
    rest: dict[str, int] = {}
    for op in facts["tile_ops"]:
        if op["kind"] != kind:
            continue
        into = loop if op["in_loop"] else rest
        for key, n in op["ptx"].items():
            into[key] = into.get(key, 0) + n
        if not op["ptx"]:
            into["?"] = into.get("?", 0) + 1

    def fmt(d):
        short = {
            k.replace("ld.global.", "ld").replace("st.global.", "st").replace("cp.async.", "cp"): n
            for k, n in sorted(d.items())
        }
        return " ".join(f"{k}x{n}" for k, n in short.items()) or "-"

    if kind == "load" and loop:
        return f"loop[{fmt(loop)}] {fmt(rest)}"
    return fmt({**rest, **{k: loop.get(k, 0) + rest.get(k, 0) for k in loop}})


def sm90_rows(reports: list[tuple[str, dict]]) -> dict[str, list[dict]]:
    """Per report name, newest report first, the kernels whose latest compile it holds, in the
    report's order (a kernel launched twice with other constexprs has two rows)."""
    newest = {row["id"]: name for name, data in reports for row in data["kernels"]}
    out = {}
    for name, data in reversed(reports):
        rows = [row for row in data["kernels"] if newest[row["id"]] == name]
        if rows:
            out[name] = rows
    return out


def _cuda_lines(cuda: dict) -> list[list[str]]:
    lines = []
    for entry in cuda["entries"]:
        kernels = entry["kernels"].values()
        regs = [k.get("registers", 0) for k in kernels]
        spills = sum(k.get("spill_store_bytes", 0) + k.get("spill_load_bytes", 0) for k in kernels)
        smem = max((k.get("static_smem_bytes", 0) for k in kernels), default=0)
        stack = max((k.get("stack_bytes", 0) for k in kernels), default=0)
        widths = sorted({k.get("global_load_bits", 0) for k in kernels})
        stores = sorted({k.get("global_store_bits", 0) for k in kernels})
        cores = sorted({k.get("tensor_core", "none") for k in kernels})
        lines.append(
            [
                entry["source"],
                entry["arch"],
                "ok" if entry["ok"] else "FAILED",
                str(len(entry["kernels"])),
                f"{min(regs, default=0)}-{max(regs, default=0)}",
                str(spills),
                str(stack),
                f"{smem / 1024:.1f}",
                "/".join(map(str, widths)),
                "/".join(map(str, stores)),
                "/".join(cores),
                str(len(entry["warnings"])),
            ]
        )
    return lines


def sm90_markdown(reports, cuda, notes, command: str) -> str:
    out = [
        "# sm_90 offline compile report: the latest compile of each kernel",
        "",
        f"Written by `{command}` (the full command: `bench/results/README.md`)",
        "from the raw reports named by each heading, which are not in the tree (`git show",
        "COMMIT:bench/results/FILE.json` brings one back, COMMIT its *recorded in*). No GPU:",
        "every Triton kernel compiled for sm_90 at the benchmark",
        "shapes (`bench/compile_report.py`, see `bench/README.md` for what each figure is).",
        "Columns: what each `tl.dot` lowers to (MMA kind x count), registers per thread,",
        "spilled bytes, shared memory, warps / pipeline stages, CTAs per SM (occupancy from",
        "registers and shared memory), the 16-bit global loads and stores (`ld128` 128-bit,",
        "`ld16` scalar 2-byte, `cp16B` 16-byte `cp.async` -- asynchronous, pipelined when",
        "inside `loop[...]`), and the four targets (PASS / FAIL / - where one does not apply).",
        "The targets CI holds are `compile-baseline-sm90.json` (`tests/test_compile_report.py`).",
        "",
    ]
    head = [
        "kernel",
        "tl.dot ->",
        "regs",
        "spill B",
        "smem KiB",
        "warps/stages",
        "CTA/SM",
        "16-bit loads",
        "16-bit stores",
        *(short for _, short in TARGETS),
    ]
    data_of = dict(reports)
    path_of = {n: p for n, _, p in _SOURCES}
    for name, rows in sm90_rows(reports).items():
        env = data_of[name]["environment"]
        out += [
            f"## {name}",
            "",
            f"{env.get('date', _date(path_of[name], data_of[name]))}, triton {env.get('triton')}, "
            f"torch {env.get('torch')}, python {env.get('python')}, {env.get('target')}, "
            f"{env.get('sm_count_assumed')} SMs assumed; recorded in "
            f"{_recorded_in(path_of[name])}; {len(rows)} kernels"
            + (f". {notes[name]}" if name in notes else ""),
            "",
        ]
        lines, errors = [], []
        for r in rows:
            f = r["facts"]
            targets = [r["targets"].get(t, "-") for t, _ in TARGETS]
            if f is None:
                lines.append([r["id"], "ERROR", *("-",) * 7, *targets])
                errors.append(f"- `{r['id']}` does not compile: {r['error'].splitlines()[-1]}")
                continue
            dots = "+".join(f"{k}x{n}" for k, n in sorted(f["dots"].items())) or "none"
            lines.append(
                [
                    r["id"],
                    dots,
                    str(f["regs"]),
                    str(r["spill_bytes"]),
                    f"{f['shared'] / 1024:.1f}",
                    f"{f['num_warps']}/{f['num_stages']}",
                    str(f["ctas_per_sm"]),
                    loads(f, "load"),
                    loads(f, "store"),
                    *targets,
                ]
            )
        out += _table(head, lines) + [""]
        if errors:
            out += errors + [""]
    if cuda is not None:
        name, data = cuda
        out += [
            f"## {name}: the cupy backend's CUDA C (`bench/cuda_compile_report.py`)",
            "",
            f"NVRTC {data.get('nvrtc')}, python {data.get('python')}; recorded in "
            f"{_recorded_in(path_of[name])}; every template instantiation of each `.cu` compiled "
            "offline with `ptxas -v`; per source and architecture: instantiations, registers "
            "(min-max), spilled bytes (all instantiations), largest stack frame and static shared "
            "memory, the widths of the global loads and stores (bits), tensor-core instructions, "
            f"warnings. Total spill bytes: {data.get('total_spill_bytes')}"
            + (f". {notes[name]}" if name in notes else ""),
            "",
        ]
        head = [
            "source",
            "arch",
            "compiled",
            "kernels",
            "regs",
            "spill B",
            "stack B",
            "smem KiB",
            "load bits",
            "store bits",
            "tensor cores",
            "warnings",
        ]
        out += _table(head, _cuda_lines(data))
    return "\n".join(out).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------- GPU


def gpu_markdown(runs, notes, command: str) -> str:
    """The summary table ``bench/gpu.py`` prints, of each ``gpu.json`` (newest last)."""
    out = [
        "# GPU benchmarks (`bench/gpu.py`, run by `bench/device.sh`)",
        "",
        f"Written by `{command}` (the full command: `bench/results/README.md`)",
        "from the `gpu.json` of each run below, which is not in the tree. What each figure",
        "is, its ceiling and its target: `bench/README.md`; speed-ups above 1 are faster",
        "than the baseline.",
        "",
    ]
    path_of = {n: p for n, _, p in _SOURCES}
    columns = [
        ("op", "op"),
        ("pass", "pass"),
        ("dtype", "dtype"),
        ("shape", "shape"),
        ("rate", "rate"),
        ("ceiling", "of ceiling"),
        ("vs_torch", "vs torch op"),
        ("torch_op", "torch op"),
        ("vs_compile", "vs compile"),
        ("vs_xk", "vs our other kernel"),
        ("target", "target"),
        ("verdict", "verdict"),
    ]
    for name, data in reversed(runs):
        env = data["environment"]
        ceilings = data.get("ceilings", {})
        out += [
            f"## {name}",
            "",
            f"{_date(path_of[name], data)}; {env.get('device')}"
            + (
                f" ({env['sm_count']} SMs, {env.get('memory_gib')} GiB)"
                if "sm_count" in env
                else ""
            )
            + f"; torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}"
            + ("; DRY RUN, figures mean nothing" if env.get("dry_run") else "")
            + f"; ceilings: copy {ceilings.get('copy', 0):.1f} GB/s, bf16 matmul "
            f"{ceilings.get('matmul', 0):.1f} TFLOP/s; failed: {len(data.get('failed', []))}"
            + (f". {notes[name]}" if name in notes else ""),
            "",
        ]
        lines = [[str(r.get(key, "-")) for key, _ in columns] for r in data["summary"]]
        out += _table([title for _, title in columns], lines) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------- command line

#: Every input of this run: (name, data, path).
_SOURCES: list[tuple[str, dict, str]] = []


def _read(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for path in paths:
        data = _load(path)
        _SOURCES.append((_name(path), data, path))
        out.append((_name(path), data))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    cpu = sub.add_parser("cpu", help="python -m xpkernels bench --json runs (and the floor)")
    cpu.add_argument("runs", nargs="+", help="bench --json files, oldest first")
    cpu.add_argument("--floor", nargs="*", default=[], help="cpu_attention_floor.py --json files")
    sm90 = sub.add_parser("sm90", help="bench/compile_report.py --json reports")
    sm90.add_argument("reports", nargs="+", help="compile report JSON files, oldest first")
    sm90.add_argument("--cuda", help="a bench/cuda_compile_report.py JSON file")
    gpu = sub.add_parser("gpu", help="bench/gpu.py gpu.json files (bench/device.sh)")
    gpu.add_argument("runs", nargs="+", help="gpu.json files, oldest first")
    for p in (cpu, sm90, gpu):
        p.add_argument("--note", action="append", default=[], help="FILE=TEXT: a source's note")
        p.add_argument("--out", help="write the Markdown here (default: print it)")
    args = parser.parse_args(argv)
    _SOURCES.clear()
    notes = _notes(args.note)
    command = "python bench/summarize_results.py " + args.kind
    if args.kind == "cpu":
        text = cpu_markdown(_read(args.runs), _read(args.floor), notes, command)
    elif args.kind == "gpu":
        text = gpu_markdown(_read(args.runs), notes, command)
    else:
        reports = _read(args.reports)
        cuda = _read([args.cuda])[0] if args.cuda else None
        text = sm90_markdown(reports, cuda, notes, command)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
