"""Compile every ``.cu`` of the cupy backend (and a generated FlexAttention unit) with NVRTC,
offline (no GPU, no driver), and report.

For each source and architecture (sm_80, sm_90): NVRTC compiles all the
launcher's template instantiations (its ``name_expressions()``) to a cubin
with ``ptxas -v``; any warning in the log is a failure (NVRTC has no
``-Werror``). The ptxas figures per kernel -- registers, spill stores and
loads, static shared memory, stack frame -- are parsed from the log, the
widest global load and store (bits) from the PTX.

Run as a script to write ``bench/results/cuda_compile_report.json`` (a raw output, ignored
by git; ``bench/summarize_results.py sm90 --cuda`` condenses it into
``bench/results/sm90-compile.md``, see ``bench/results/README.md``)::

    python bench/cuda_compile_report.py [--out PATH]

Needs ``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime``, ``nvidia-cuda-crt``,
``cuda-bindings`` and ``cuda-pathfinder`` (13.0 series, requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import re
import sys
from pathlib import Path

ARCHES = ("sm_80", "sm_90")
BACKEND_DIR = Path(__file__).resolve().parents[1] / "backends" / "cupy"

_FUNCTION = re.compile(r"ptxas info\s*:\s*Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
#: Tensor-core instructions in PTX, the most specific first.
_TENSOR_CORE = (
    ("wgmma", re.compile(r"\bwgmma\.mma_async\b")),
    ("mma.sync", re.compile(r"(?<!wmma\.)\bmma\.sync\b")),
    ("wmma", re.compile(r"\bwmma\.mma\.sync\b")),
)
_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.nc)?(?:\.L\w+::\w+)*(?:\.v(\d))?\.[a-z]+(\d+)\b")


def _widths(ptx: str) -> dict:
    """Per entry function: the widest global load and store, and the tensor-core instruction.

    Widths in bits (``ld/st.global[.vN].tBITS``); ``tensor_core`` is ``wgmma``,
    ``mma.sync``, ``wmma`` or ``none``.
    """
    out = {}
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)] + [(len(ptx), None)]
    for (begin, name), (end, _) in zip(starts, starts[1:]):
        load = store = 0
        for m in _ACCESS.finditer(ptx, begin, end):
            bits = int(m.group(2) or 1) * int(m.group(3))
            if m.group(1) == "ld":
                load = max(load, bits)
            else:
                store = max(store, bits)
        body = ptx[begin:end]
        tensor_core = next((n for n, pattern in _TENSOR_CORE if pattern.search(body)), "none")
        out[name] = {
            "global_load_bits": load,
            "global_store_bits": store,
            "tensor_core": tensor_core,
        }
    return out


class NvrtcUnavailable(RuntimeError):
    """The NVRTC packages are not installed."""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError as exc:
        raise NvrtcUnavailable(f"NVRTC packages missing: {exc}") from exc
    include = find_nvidia_header_directory("cudart")
    if include is None:
        raise NvrtcUnavailable("cuda_fp16.h not found (install nvidia-cuda-runtime)")
    return nvrtc, include


def _check(nvrtc, result, what):
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def name_expressions(cu: Path) -> list[str]:
    """The instantiations the launcher beside ``cu`` compiles (none: its extern "C" kernels)."""
    try:
        module = importlib.import_module(f"xpkernels.backends.cupy.{cu.stem}")
    except ImportError:
        return []
    fn = getattr(module, "name_expressions", None)
    return list(fn()) if fn is not None else []


def compile_source(cu: Path, arch: str, keep_log: bool = False) -> dict:
    """NVRTC-compile ``cu`` for ``arch``; returns the log, warnings and per-kernel ptxas figures."""
    nvrtc, include = _nvrtc()
    prog = _check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(cu.read_bytes(), cu.name.encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    expressions = name_expressions(cu)
    for expr in expressions:
        _check(
            nvrtc,
            nvrtc.nvrtcAddNameExpression(prog, expr.encode()),
            f"nvrtcAddNameExpression {expr}",
        )
    options = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        f"-I{cu.parent}",
        f"-I{include}",
        "--ptxas-options=-v",
        "-default-device",
    ]
    result = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
    log_size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    log = b" " * log_size
    _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
    log = log.decode(errors="replace").rstrip("\0 \n")
    ok = result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    lowered, widths = {}, {}
    if ok:
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        widths = _widths(ptx.decode(errors="replace"))
        for expr in expressions:
            lowered[
                _check(
                    nvrtc,
                    nvrtc.nvrtcGetLoweredName(prog, expr.encode()),
                    f"nvrtcGetLoweredName {expr}",
                ).decode()
            ] = expr
    nvrtc.nvrtcDestroyProgram(prog)
    kernels, current = {}, None
    for line in log.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = lowered.get(m.group(1), m.group(1))
            kernels[current] = dict(widths.get(m.group(1), {}))
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            kernels[current].update(
                stack_bytes=int(m.group(1)),
                spill_store_bytes=int(m.group(2)),
                spill_load_bytes=int(m.group(3)),
            )
        m = _USED.search(line)
        if m:
            smem = _SMEM.search(line)
            kernels[current].update(
                registers=int(m.group(1)), static_smem_bytes=int(smem.group(1)) if smem else 0
            )
    warnings = [ln for ln in log.splitlines() if re.search(r"\bwarning\b", ln, re.IGNORECASE)]
    return {
        "source": cu.name,
        "arch": arch,
        "ok": ok,
        "warnings": warnings,
        "kernels": kernels,
        "log": log if keep_log or not ok or warnings else "",
    }


def sources() -> list[Path]:
    """Every ``.cu`` of the cupy backend."""
    return sorted(BACKEND_DIR.glob("*.cu"))


def flex_unit(directory: Path) -> Path:
    """A generated FlexAttention unit, written into ``directory`` as ``flex_attention.cu``
    beside copies of the backend's headers (so :func:`compile_source` compiles every
    instantiation of ``backends/cupy/flex_attention.py``): pair features with their gradients
    (float gathers, atomics) under sliding window & document (integer gathers)."""
    import numpy as np
    from xpkernels.backends.cupy import flex_attention

    from xpkernels import mods as xm

    rng = np.random.default_rng(0)
    score = xm.PairFeatureScore(
        lambda qv, kv: [qv[0] * kv[0], xm.tanh(qv[1] - kv[1])],
        rng.standard_normal((1, 8, 2)).astype(np.float32),
        rng.standard_normal((1, 8, 2)).astype(np.float32),
        rng.standard_normal((2, 2)).astype(np.float32),
    )
    mask = xm.SlidingWindowMask(4) & xm.DocumentMask(np.zeros((1, 8), np.int32))
    for header in BACKEND_DIR.glob("*.cuh"):
        (directory / header.name).write_text(header.read_text())
    unit = directory / "flex_attention.cu"
    grads = tuple(range(len(score.graph.slots)))
    unit.write_text(flex_attention.unit_source(score.graph, mask.graph, grads))
    return unit


def report(arches=ARCHES) -> dict:
    """Compile every source and a generated flex unit for every arch; the JSON-ready report."""
    import tempfile
    from importlib.metadata import version

    entries = [compile_source(cu, arch) for cu in sources() for arch in arches]
    with tempfile.TemporaryDirectory() as directory:
        unit = flex_unit(Path(directory))
        entries += [compile_source(unit, arch) for arch in arches]
    return {
        "nvrtc": version("nvidia-cuda-nvrtc"),
        "python": platform.python_version(),
        "entries": entries,
        "total_spill_bytes": sum(
            k.get("spill_store_bytes", 0) + k.get("spill_load_bytes", 0)
            for e in entries
            for k in e["kernels"].values()
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "cuda_compile_report.json",
    )
    args = parser.parse_args(argv)
    data = report()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    bad = [e for e in data["entries"] if not e["ok"] or e["warnings"]]
    for e in data["entries"]:
        regs = [k.get("registers", 0) for k in e["kernels"].values()]
        print(
            f"{e['source']} {e['arch']}: {'ok' if e['ok'] else 'FAILED'}, {len(e['kernels'])} kernels, "
            f"registers {min(regs, default=0)}..{max(regs, default=0)}, warnings {len(e['warnings'])}"
        )
    print(f"total spill bytes: {data['total_spill_bytes']}; written to {args.out}")
    return 1 if bad or data["total_spill_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
