"""The README's code runs as written (its quick starts are a user's first contact)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


def _cuda_cupy() -> bool:
    """True when CuPy is installed and sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CuPy raises its own error types when CUDA is unusable
        return False


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    if "import torch" in BLOCKS[index]:
        pytest.importorskip("torch", reason="this example needs torch")
    if "import cupy" in BLOCKS[index] and not _cuda_cupy():
        pytest.skip("this example needs CuPy and a CUDA device")
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
