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
    assert report["failed"] == []
    seen = {(e["op"], e["pass_"], e["dtype"]) for e in report["entries"]}
    for op in ("rms_norm", "layer_norm", "softmax"):
        for pass_ in ("forward", "backward"):
            for dtype in ("bfloat16", "float32"):
                assert (op, pass_, dtype) in seen
    for op in ("attention", "attention-causal"):
        for pass_ in ("forward", "backward"):
            assert (op, pass_, "bfloat16") in seen
    assert ("decode_attention", "forward", "bfloat16") in seen
    for e in report["entries"]:
        assert e["ms"] > 0 and e["rate"] > 0 and e["formula"], e["op"]


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
