"""Packaging: lazy import and a wheel that ships the backends."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_xpkernels_imports_no_torch_cupy_or_triton():
    code = (
        "import sys, xpkernels\n"
        "xpkernels.Duplicated, xpkernels.rms_norm_\n"
        "bad = [m for m in ('torch', 'cupy', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_function_names_survive_their_module_being_imported():
    code = (
        "import xpkernels.rms_norm, xpkernels\n"
        "assert callable(xpkernels.rms_norm) and xpkernels.rms_norm.__name__ == 'rms_norm'\n"
        "import xpkernels.backends.array_api.rms_norm as impl\n"
        "assert callable(impl.forward)\n"
        "assert {b.name for b in xpkernels.backends()} >= {'array_api', 'triton'}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wheel_ships_the_backends(tmp_path):
    build = pytest.importorskip("build", reason="the 'build' package is needed to build the wheel")
    # Built without isolation (no index needed), so the build backend must be installed here.
    unmet = [
        " <- ".join(chain)
        for requirement in build.ProjectBuilder(ROOT).build_system_requires
        for chain in build.check_dependency(requirement)
    ]
    if unmet:
        pytest.skip(f"the build backend's requirements are not installed: {', '.join(unmet)}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("xpkernels-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__", "_blocks", "rms_norm"):
        assert f"xpkernels/backends/array_api/{module}.py" in names
    assert "xpkernels/backends/triton/__init__.py" in names
    cu_sources = sorted(p.relative_to(ROOT / "backends") for p in (ROOT / "backends").rglob("*.cu"))
    for rel in cu_sources:
        assert f"xpkernels/backends/{rel.as_posix()}" in names
