"""``bench/device.sh --dry-run`` runs end to end on CPU: the GPU script's own bugs show up here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None
    or importlib.util.find_spec("torch") is None
    or importlib.util.find_spec("triton") is None,
    reason="bench/device.sh needs bash, torch and triton",
)


def test_device_script_dry_run_writes_every_entry(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "device.sh"), str(tmp_path), "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for name in ("device.log", "environment.txt", "conformance.xml", "gpu.json"):
        assert (tmp_path / name).is_file(), name
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["environment"]["dry_run"] is True
    assert set(report["ceilings"]) == {"copy", "matmul"}
    assert report["failed"] == [] and report["sections_skipped"] == {}
    seen = {(e["op"], e["pass_"], e["dtype"]) for e in report["entries"]}
    for op in ("rms_norm", "layer_norm", "softmax"):
        for pass_ in ("forward", "backward"):
            for dtype in ("bfloat16", "float32"):
                assert (op, pass_, dtype) in seen
    for op in ("attention", "attention-causal"):
        for pass_ in ("forward", "backward"):
            assert (op, pass_, "bfloat16") in seen
    assert ("decode_attention", "forward", "bfloat16") in seen
    assert ("decode_attention-paged16", "forward", "bfloat16") in seen
    for op in ("rms_norm", "layer_norm", "softmax", "attention", "attention-causal", "flex-causal"):
        for pass_ in ("forward", "backward"):
            assert (f"cupy {op}", pass_, "float16") in seen
    assert ("cupy decode_attention", "forward", "float16") in seen
    assert ("llama-layer", "fwd+bwd", "bfloat16") in seen
    for pass_ in ("forward", "backward", "fwd+bwd"):
        assert ("cross_entropy", pass_, "bfloat16") in seen
    for pass_ in ("fwd+bwd", "fused", "peak memory"):
        assert ("linear_cross_entropy", pass_, "bfloat16") in seen
    for e in report["entries"]:
        if e["pass_"] == "peak memory":  # CUDA's allocator only: no figure in a dry run
            assert e["ms"] is None and e["rate"] is None and e["formula"], e["op"]
            continue
        assert e["ms"] > 0 and e["rate"] > 0 and e["formula"], e["op"]
    assert len(report["summary"]) == len(report["entries"])
    assert {r["verdict"] for r in report["summary"]} <= {"dry", "-"}
    tail = run.stdout.strip().splitlines()[-(len(report["entries"]) + 3) :]
    assert tail[0].startswith("summary of ") and "(dry run: nothing judged)" in tail[-1]


def test_device_script_rejects_bad_arguments(tmp_path):
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "device.sh"), str(tmp_path), "--fast"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert "usage: bash bench/device.sh OUT_DIR [--dry-run]" in run.stderr


def _gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_summary_judges_each_entry_against_its_target():
    gpu = _gpu_module()

    def entry(section, op, pass_, shape, unit, rate, pct, baselines):
        e = gpu.Entry(section, op, pass_, "bfloat16", shape, unit, "f", 1.0, "copy")
        e.rate, e.pct_of_ceiling, e.baselines = rate, pct, baselines
        return e

    entries = [
        entry(
            "rows",
            "rms_norm",
            "forward",
            (8, 4096),
            "GB/s",
            4000.0,
            91.0,
            {"F.rms_norm": {"rate": 2000.0}, "torch.compile": {"rate": 3200.0}},
        ),
        entry("rows", "rms_norm", "backward", (8, 4096), "GB/s", 3000.0, 79.0, {}),
        entry(
            "attention",
            "attention",
            "forward",
            (4, 32, 4096, 128),
            "TFLOP/s",
            510.0,
            60.0,
            {"F.sdpa": {"rate": 600.0}},
        ),
        entry("attention", "attention", "backward", (4, 32, 4096, 128), "TFLOP/s", 250.0, 30.0, {}),
        entry(
            "attention",
            "attention-causal",
            "forward",
            (4, 32, 4096, 128),
            "TFLOP/s",
            100.0,
            10.0,
            {},
        ),
        entry("attention", "attention", "forward", (4, 32, 4096, 64), "TFLOP/s", 100.0, 10.0, {}),
        entry(
            "decode",
            "decode_attention",
            "forward",
            (16, 32, 8, 32768, 128),
            "GB/s",
            4100.0,
            86.0,
            {"F.sdpa(enable_gqa)": {"error": "boom"}},
        ),
        # paged decode: its own 80% target, below the contiguous decode's 85%
        entry(
            "paged",
            "decode_attention-paged16",
            "forward",
            (16, 32, 8, 32768, 128),
            "GB/s",
            3900.0,
            82.0,
            {"gather+F.sdpa": {"rate": 1950.0}},
        ),
        entry(
            "paged",
            "decode_attention-paged16",
            "forward",
            (16, 32, 8, 32768, 128),
            "GB/s",
            3700.0,
            79.0,
            {},
        ),
    ]
    rows = gpu.summary_rows(entries, dry=False)
    assert [r["verdict"] for r in rows] == [
        "PASS",
        "FAIL",
        "PASS",
        "FAIL",
        "-",
        "-",
        "PASS",
        "PASS",
        "FAIL",
    ]
    assert rows[7]["target"] == ">= 80 %copy" and rows[7]["vs_torch"] == "2.00x"
    assert (rows[0]["vs_torch"], rows[0]["vs_compile"]) == ("2.00x", "1.25x")
    assert rows[2]["vs_torch"] == "0.85x" and rows[6]["vs_torch"] == "-"
    assert rows[0]["target"] == ">= 90 %copy" and rows[3]["target"] == ">= 300 TFLOP/s"
    text = gpu.format_summary(rows)
    assert len(text.splitlines()) == len(entries) + 2
    assert "targets: 4 PASS, 3 FAIL" in text
    assert {r["verdict"] for r in gpu.summary_rows(entries, dry=True)} == {"dry", "-"}


def test_cupy_entries_are_judged_against_the_triton_backend():
    gpu = _gpu_module()

    def entry(rate, baselines):
        e = gpu.Entry(
            "cupy", "cupy rms_norm", "forward", "float16", (8, 4096), "GB/s", "f", 1.0, "copy"
        )
        e.rate, e.pct_of_ceiling, e.baselines = rate, 50.0, baselines
        return e

    torch_op = {"torch rms_norm": {"rate": 1000.0}}
    rows = gpu.summary_rows(
        [
            entry(2000.0, {"xk triton": {"rate": 2400.0}, **torch_op}),  # 1.2x slower: within 1.25x
            entry(1800.0, {"xk triton": {"rate": 2400.0}, **torch_op}),  # 1.33x slower
            entry(1800.0, {"xk triton": {"error": "boom"}}),
        ],
        dry=False,
    )
    assert [r["verdict"] for r in rows] == ["PASS", "FAIL", "no baseline"]
    assert rows[0]["target"] == ">= 0.8 x xk triton"
    assert (rows[0]["vs_torch"], rows[0]["vs_xk"]) == ("2.00x", "0.83x triton")
    assert rows[2]["vs_torch"] == "-"


def test_linear_cross_entropy_is_judged_on_the_products_and_on_peak_memory():
    """Its forward+backward, unfused or fused, against 1.1x the three products' time; its peak
    memory against 1/10 of the composition's (a maximum: the lower, the better)."""
    gpu = _gpu_module()
    section, shape = "linear_cross_entropy", (8192, 4096, 128256)

    def step(rate, products, pass_="fwd+bwd"):
        e = gpu.Entry(section, section, pass_, "bfloat16", shape, "TFLOP/s", "f", 1.0, "matmul")
        e.rate, e.pct_of_ceiling = rate, 50.0
        e.baselines = {"F.cross_entropy(x@W.T)": {"rate": 300.0}, "3 products": {"rate": products}}
        return e

    def memory(ours, notes):
        e = gpu.Entry(section, section, "peak memory", "bfloat16", shape, "MiB", "f", 1.0, "-")
        e.rate, e.notes = ours, notes
        return e

    torch_peak = "F.cross_entropy(x@W.T) peak MiB"
    rows = gpu.summary_rows(
        [
            step(460.0, 500.0),  # 1.087x the products' time: within 1.1x
            step(375.0, 500.0),  # 1.33x: the four products' floor
            step(480.0, 500.0, "fused"),  # three products and the rows: 1.04x
            memory(70.0, {torch_peak: 8000.0, "liger peak MiB": 900.0}),
            memory(900.0, {torch_peak: 8000.0}),
            memory(70.0, {}),
        ],
        dry=False,
    )
    verdicts = ["PASS", "FAIL", "PASS", "PASS", "FAIL", "no baseline"]
    assert [r["verdict"] for r in rows] == verdicts
    assert rows[0]["target"] == rows[2]["target"] == ">= 0.909 x 3 products"
    assert rows[0]["vs_torch"] == "1.53x"
    assert rows[3]["target"] == "peak <= 0.1 x F.cross_entropy(x@W.T)"
    assert (rows[3]["rate"], rows[3]["vs_torch"], rows[3]["ceiling"]) == ("70.0 MiB", "-", "-")
