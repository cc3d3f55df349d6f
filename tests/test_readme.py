"""The README's code runs as written (its quick starts are a user's first contact)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    if "import torch" in BLOCKS[index]:
        pytest.importorskip("torch", reason="this example needs torch")
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
