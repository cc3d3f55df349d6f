"""Checks shared by the tests of the CUDA C sources: a script run under a sanitizer of the CPU
harness, and the offline NVRTC compile of ``bench/cuda_compile_report.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpkernels.testing import cudacpu

ROOT = Path(__file__).resolve().parents[1]


def assert_clean_under_sanitizer(script: str, kind: str, timeout: int = 600) -> None:
    """Run ``script`` (Python source that prints ``clean`` when done) in a fresh process under
    the ``kind`` sanitizer ("address" or "thread"); fail on any report or error."""
    env = {**os.environ, **cudacpu.sanitizer_env(kind)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-4000:]
    assert "Sanitizer" not in proc.stderr, proc.stderr[-4000:]


def nvrtc_report():
    """The ``bench/cuda_compile_report.py`` module; skips the test when NVRTC is not installed."""
    spec = importlib.util.spec_from_file_location(
        "cuda_compile_report", ROOT / "bench" / "cuda_compile_report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    try:
        report._nvrtc()
    except report.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC check needs nvidia-cuda-nvrtc/-runtime/-crt, cuda-bindings: {exc}")
    return report
