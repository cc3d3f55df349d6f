"""Compiling a ``.cu`` source with the system C++ compiler into a loadable shared object.

The pipeline, per (source, options, name expressions, sanitizer):

1. preprocess the source with ``cudacpu.h`` force-included (``-include``), so
   ``#include <cuda_fp16.h>`` and friends resolve to the harness's headers;
2. rewrite the one form of dynamic shared memory the backend uses,
   ``extern __shared__ [__align__(n)] T name[];``, into a pointer to the
   launch's dynamic shared memory, and every other ``__shared__`` into
   ``static`` (collected by a linker script into a region refilled with
   garbage before every block);
3. append one launch entry and one parameter signature per kernel;
4. compile and link against the runtime (``cudacpu_runtime.cpp``, built once
   per flag set), cached on disk by a hash of everything above.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["CompileError", "cache_dir", "compile_module", "include_dir", "kernel_names"]

_CACHE_ENV = "XPKERNELS_CUDACPU_CACHE"
_CXX_ENV = "XPKERNELS_CUDACPU_CXX"
_COMPILE_TIMEOUT_S = 600

# NVRTC options that change code generation on the GPU only; the harness accepts and ignores them.
_GPU_ONLY_OPTIONS = re.compile(
    r"^(--use_fast_math|-use_fast_math|-lineinfo|--generate-line-info|--extra-device-vectorization"
    r"|-arch=.*|--gpu-architecture=.*|-default-device|--device-as-default-execution-space"
    r"|--fmad=.*|-ftz=.*|-prec-div=.*|-prec-sqrt=.*|--ptxas-options=.*|-Xptxas.*|-dopt=.*|-G)$"
)

_SANITIZE_FLAGS = {
    None: [],
    "address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
    "thread": ["-fsanitize=thread", "-g"],
}

_DYNAMIC_SHARED = re.compile(
    r"extern\s+__cudacpu_shared__\s+((?:[\w:<>,\s*]|alignas\s*\(\s*\d+\s*\))+?)\s*(\w+)\s*\[\s*\]\s*;"
)
_EXTERN_C_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\("
)


class CompileError(RuntimeError):
    """A ``.cu`` source did not compile with the harness; the message holds the compiler's log."""


def include_dir() -> Path:
    """The directory holding ``cudacpu.h``, its runtime and the CUDA header stand-ins."""
    return Path(str(resources.files("xpkernels.testing.cudacpu") / "include"))


def cache_dir() -> Path:
    """Where compiled modules are cached: ``$XPKERNELS_CUDACPU_CACHE`` or ``~/.cache/xpkernels/cudacpu``."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xpkernels" / "cudacpu"


def _cxx() -> str:
    cxx = os.environ.get(_CXX_ENV) or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CompileError(
            "cudacpu: no C++ compiler found (install g++ or set XPKERNELS_CUDACPU_CXX)"
        )
    return cxx


def kernel_names(source: str) -> list[str]:
    """The ``extern "C" __global__`` kernels of ``source``, in order of appearance."""
    return list(dict.fromkeys(_EXTERN_C_KERNEL.findall(source)))


def _split_options(options, where: str) -> tuple[list[str], str]:
    flags, std = [], "-std=c++17"
    items = list(options)
    i = 0
    while i < len(items):
        opt = str(items[i])
        if opt in ("-I", "-D", "--include-path", "--define-macro") and i + 1 < len(items):
            flags.append(("-I" if opt in ("-I", "--include-path") else "-D") + str(items[i + 1]))
            i += 2
            continue
        if opt.startswith(("-I", "-D")):
            flags.append(opt)
        elif opt.startswith(("--include-path=", "--define-macro=")):
            flags.append(
                ("-I" if opt.startswith("--include-path") else "-D") + opt.split("=", 1)[1]
            )
        elif opt.startswith(("-std=", "--std=")):
            std = "-std=" + opt.split("=", 1)[1]
        elif not _GPU_ONLY_OPTIONS.match(opt):
            raise ValueError(
                f"cudacpu: {where}: option {opt!r} is not understood by the CPU harness"
            )
        i += 1
    return flags, std


def _run(cmd, what: str, where: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise CompileError(
            f"cudacpu: {what} of {where} timed out after {_COMPILE_TIMEOUT_S} s"
        ) from exc
    if proc.returncode != 0:
        log = (proc.stderr + proc.stdout).strip()
        raise CompileError(f"cudacpu: {what} of {where} failed:\n{log}\n(command: {' '.join(cmd)})")


def _compile_object(cxx: str, flags: list[str], source: Path, obj: Path, where: str) -> None:
    _run([cxx, *flags, "-c", str(source), "-o", str(obj)], "compilation", where)


def _rewrite_shared(text: str) -> str:
    def dynamic(m):
        spec = re.sub(r"alignas\s*\(\s*\d+\s*\)", " ", m.group(1)).strip()
        return (
            f"{spec}* const {m.group(2)} = reinterpret_cast<{spec}*>(::cudacpu::dynamic_shared());"
        )

    text = _DYNAMIC_SHARED.sub(dynamic, text)
    return re.sub(r"\b__cudacpu_shared__\b", "static", text)


def _wrappers(expressions: list[str]) -> str:
    out = ["\n// ---- generated by xpkernels.testing.cudacpu"]
    for i, expr in enumerate(expressions):
        out.append(
            f"static void cudacpu_entry_{i}(void** a) {{ ::cudacpu::invoke(&{expr}, a); }}\n"
            f'extern "C" int cudacpu_kernel_{i}(void** a, const ::cudacpu::Launch* L, char* e, '
            f"unsigned long n) {{ return cudacpu_launch(&cudacpu_entry_{i}, a, L, e, n); }}\n"
            f'extern "C" void cudacpu_signature_{i}(const char** out) '
            f"{{ ::cudacpu::signature(&{expr}, out); }}"
        )
    return "\n".join(out) + "\n"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode() if not isinstance(p, (bytes, str)) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _harness_text() -> str:
    inc = include_dir()
    return "".join((inc / f).read_text() for f in sorted(os.listdir(inc)))


def _runtime_object(cxx: str, base_flags: list[str], directory: Path) -> Path:
    key = _digest(cxx, base_flags, _harness_text())
    obj = directory / f"runtime_{key}.o"
    if not obj.exists():
        inc = include_dir()
        tmp = directory / f"runtime_{key}.{os.getpid()}.o"
        flags = [*base_flags, "-I", str(inc)]
        _compile_object(cxx, flags, inc / "cudacpu_runtime.cpp", tmp, "the cudacpu runtime")
        os.replace(tmp, obj)
    return obj


def compile_module(
    source: str, path: str | None, options, expressions: list[str], sanitize
) -> Path:
    """Compile ``source`` (read from ``path`` if given) and return the shared object's path.

    Raises
    ------
    CompileError
        With the compiler's log, naming the source.
    """
    where = path or "<RawModule code>"
    flags, std = _split_options(options, where)
    if sanitize not in _SANITIZE_FLAGS:
        raise ValueError(f"cudacpu: sanitize must be None, 'address' or 'thread', got {sanitize!r}")
    cxx = _cxx()
    base = [std, "-O1", "-fPIC", "-pthread", *_SANITIZE_FLAGS[sanitize]]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    inc = include_dir()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src = Path(path) if path else directory / f"code_{_digest(source)}.cu"
        if not path and not src.exists():
            staged = Path(tmp) / src.name
            staged.write_text(source)
            os.replace(staged, src)
        pre = [
            cxx,
            "-E",
            "-x",
            "c++",
            std,
            "-D__CUDACC__",
            "-D__CUDACC_RTC__",
            "-I",
            str(inc),
            "-include",
            "cudacpu.h",
            *flags,
            str(src),
        ]
        try:
            proc = subprocess.run(pre, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise CompileError(f"cudacpu: preprocessing of {where} timed out") from exc
        if proc.returncode != 0:
            raise CompileError(f"cudacpu: preprocessing of {where} failed:\n{proc.stderr.strip()}")
        text = _rewrite_shared(proc.stdout) + _wrappers(expressions)
        key = _digest(cxx, base, text, _harness_text())
        so = directory / f"module_{key}.so"
        if so.exists():
            return so
        tu = Path(tmp) / f"cudacpu_kernel_{key}.ii"
        tu.write_text(text)
        obj = Path(tmp) / f"cudacpu_kernel_{key}.o"
        flags = [*base, "-x", "c++", "-fdata-sections", "-fno-gnu-unique", "-w"]
        _compile_object(cxx, flags, tu, obj, where)
        runtime = _runtime_object(cxx, base, directory)
        out = Path(tmp) / "module.so"
        _run(
            [
                cxx,
                *base,
                "-shared",
                "-Wl,-Bsymbolic",
                str(obj),
                str(runtime),
                f"-Wl,-T,{inc / 'cudacpu_shared.ld'}",
                "-o",
                str(out),
            ],
            "linking",
            where,
        )
        os.replace(out, so)
    return so
