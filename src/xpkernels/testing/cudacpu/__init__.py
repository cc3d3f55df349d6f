"""CUDA C on the CPU: run the cupy backend's unchanged ``.cu`` files over NumPy arrays.

:class:`RawModule` and :class:`RawKernel` mirror ``cupy.RawModule`` /
``cupy.RawKernel`` (``module.get_function(name)``, ``kernel(grid, block,
args, shared_mem=...)``, ``name_expressions`` for template instantiations),
but compile the source with the system C++ compiler against ``cudacpu.h``, a
portability header implementing CUDA's execution model on the CPU:

- blocks run one after another; the threads of a block are fibers (default)
  or OS threads (``mode="threads"``, for ThreadSanitizer);
- ``__syncthreads`` and the warp collectives (``__shfl*_sync``,
  ``__ballot_sync``, ``__all_sync``, ``__any_sync``, ``__syncwarp``, wmma)
  go through one state machine: a divergent barrier, a collective whose mask
  names a lane that returned, a partial warp or lanes that disagree raise
  :class:`LaunchError` naming the source line -- never a hang;
- static and dynamic ``__shared__`` memory is refilled with garbage before
  every block, so a kernel that reads shared memory it did not write fails;
- ``nvcuda::wmma`` fragments (16x16x16, half/bfloat16 inputs, float
  accumulators) use a deliberately scrambled element layout;
- the ``"shuffled"`` schedule runs the ready threads of a block (and the
  blocks) in a seeded random order between barriers, exposing missing
  ``__syncthreads``;
- ``sanitize="address"`` / ``"thread"`` build with AddressSanitizer /
  ThreadSanitizer (in a process started with :func:`sanitizer_env`).

Scalars must be NumPy scalars of the kernel parameter's exact type
(``np.int32``, ``np.float32``...), pointers NumPy arrays -- the rules that
keep a CuPy launch correct, checked here before the kernel runs. Use
:func:`empty` for arrays that wmma loads from (32-byte alignment).

Environment: ``XPKERNELS_CUDACPU_SCHEDULE`` (``default``, ``shuffled`` or
``shuffled:SEED``), ``XPKERNELS_CUDACPU_SANITIZE`` (``address``, ``thread``),
``XPKERNELS_CUDACPU_MODE`` (``fibers``, ``threads``), ``XPKERNELS_CUDACPU_CACHE``
(the cache directory), ``XPKERNELS_CUDACPU_CXX`` (the compiler).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import subprocess
import threading
import zlib
from pathlib import Path

import numpy as np

from ._compile import CompileError, cache_dir, compile_module, include_dir, kernel_names

__all__ = [
    "CompileError",
    "CpuLoader",
    "LaunchError",
    "RawKernel",
    "RawModule",
    "cache_dir",
    "emulate",
    "empty",
    "include_dir",
    "sanitizer_env",
    "zeros",
]

ALIGNMENT = 256  #: bytes; :func:`empty` aligns every array to this (wmma needs 32)
DEFAULT_SHARED_LIMIT = 48 * 1024  #: dynamic shared memory a kernel may use without opting in
SM_COUNT = 4  #: multiprocessors the emulated device reports to launchers


class LaunchError(RuntimeError):
    """A kernel launch failed: a divergent barrier, a bad collective, a bad argument or a trap."""


class _Launch(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_ulonglong),
        ("mode", ctypes.c_int),
        ("shuffle_seed", ctypes.c_ulonglong),
        ("fill_seed", ctypes.c_ulonglong),
    ]


_MODES = {"fibers": 0, "threads": 1}
#: The runtime library of each sanitizer.
_SANITIZER_LIBS = {"address": "libasan", "thread": "libtsan"}
_modules: dict = {}
_modules_lock = threading.Lock()


def _env_schedule() -> str:
    return os.environ.get("XPKERNELS_CUDACPU_SCHEDULE", "default")


def _parse_schedule(schedule) -> int:
    """The shuffle seed of a schedule name: 0 for ``default``."""
    schedule = _env_schedule() if schedule is None else schedule
    if schedule == "default":
        return 0
    if schedule == "shuffled":
        return 0x5EED
    if isinstance(schedule, str) and schedule.startswith("shuffled:"):
        seed = int(schedule.split(":", 1)[1])
        if seed <= 0:
            raise ValueError(f"cudacpu: the shuffle seed must be > 0, got {seed}")
        return seed
    raise ValueError(
        f"cudacpu: schedule must be 'default', 'shuffled' or 'shuffled:SEED', got {schedule!r}"
    )


def _sanitizer_loaded(kind: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(_SANITIZER_LIBS[kind] in line for line in maps)


def _runtime_library(kind: str) -> str:
    lib = f"{_SANITIZER_LIBS[kind]}.so"
    cxx = os.environ.get("XPKERNELS_CUDACPU_CXX", "g++")
    out = subprocess.run(
        [cxx, f"-print-file-name={lib}"], capture_output=True, text=True, check=True
    )
    return os.path.realpath(out.stdout.strip())


def sanitizer_env(kind: str) -> dict:
    """Environment variables for a child process that may launch ``sanitize=kind`` modules.

    A sanitized shared object can only be loaded into a process whose
    sanitizer runtime was loaded first (``LD_PRELOAD``). Start the child with
    ``env={**os.environ, **sanitizer_env("thread")}``.

    Parameters
    ----------
    kind : {"address", "thread"}

    Returns
    -------
    dict
        ``LD_PRELOAD``, ``ASAN_OPTIONS``/``TSAN_OPTIONS`` and ``XPKERNELS_CUDACPU_SANITIZE``.
    """
    if kind not in _SANITIZER_LIBS:
        raise ValueError(f"cudacpu: kind must be 'address' or 'thread', got {kind!r}")
    env = {"LD_PRELOAD": _runtime_library(kind), "XPKERNELS_CUDACPU_SANITIZE": kind}
    if kind == "address":
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    else:
        env["TSAN_OPTIONS"] = "halt_on_error=1:report_signal_unsafe=0"
    return env


class RawModule:
    """Stand-in for ``cupy.RawModule``: compiles CUDA C with the system C++ compiler.

    Parameters
    ----------
    code : str, optional
        CUDA C source; or give ``path``.
    path : str or Path, optional
        A ``.cu`` file (its own ``#include "..."`` resolve next to it).
    options : tuple of str
        NVRTC-style options: ``-I``/``-D``/``-std`` are honoured, GPU-only
        code-generation options (``--use_fast_math``, ``-arch=``...) ignored,
        anything else refused.
    name_expressions : sequence of str, optional
        Template instantiations to compile (``"rms_norm_forward<float>"``);
        without them, the source's ``extern "C" __global__`` kernels.
    schedule : {"default", "shuffled", "shuffled:SEED"}, optional
        Thread order within blocks (and block order); default from
        ``XPKERNELS_CUDACPU_SCHEDULE``.
    sanitize : {None, "address", "thread"}, optional
        Sanitizer build; default from ``XPKERNELS_CUDACPU_SANITIZE``.
    mode : {"fibers", "threads"}, optional
        Fibers (fast) or one OS thread per CUDA thread; ``"threads"`` when
        sanitizing, else fibers (``XPKERNELS_CUDACPU_MODE`` overrides).
    """

    def __init__(
        self,
        code=None,
        path=None,
        options=(),
        name_expressions=None,
        *,
        schedule=None,
        sanitize=None,
        mode=None,
    ):
        if (code is None) == (path is None):
            raise TypeError("cudacpu.RawModule: give exactly one of code= and path=")
        source = code if code is not None else Path(path).read_text()
        self._where = str(path) if path is not None else "<RawModule code>"
        self._expressions = list(name_expressions) if name_expressions else kernel_names(source)
        if not self._expressions:
            raise CompileError(
                f'cudacpu: {self._where} has no extern "C" __global__ kernel and no '
                "name_expressions were given"
            )
        if sanitize is None:
            sanitize = os.environ.get("XPKERNELS_CUDACPU_SANITIZE") or None
        if sanitize is not None and sanitize not in _SANITIZER_LIBS:
            raise ValueError(
                f"cudacpu: sanitize must be None, 'address' or 'thread', got {sanitize!r}"
            )
        if sanitize is not None and not _sanitizer_loaded(sanitize):
            raise RuntimeError(
                f"cudacpu: sanitize={sanitize!r} needs the sanitizer runtime loaded first; run in a process "
                f"started with env=xpkernels.testing.cudacpu.sanitizer_env({sanitize!r})"
            )
        mode = (
            mode
            or os.environ.get("XPKERNELS_CUDACPU_MODE")
            or ("threads" if sanitize else "fibers")
        )
        if mode not in _MODES:
            raise ValueError(f"cudacpu: mode must be 'fibers' or 'threads', got {mode!r}")
        if sanitize == "thread" and mode != "threads":
            raise ValueError(
                "cudacpu: ThreadSanitizer needs mode='threads' (one OS thread per CUDA thread)"
            )
        self._mode = _MODES[mode]
        self._shuffle_seed = _parse_schedule(schedule)
        key = (source, self._where, tuple(options), tuple(self._expressions), sanitize)
        with _modules_lock:
            lib = _modules.get(key)
            if lib is None:
                so = compile_module(
                    source,
                    str(path) if path is not None else None,
                    options,
                    self._expressions,
                    sanitize,
                )
                lib = ctypes.CDLL(str(so), mode=os.RTLD_LOCAL)
                _modules[key] = lib
        self._lib = lib
        self._kernels: dict = {}

    def get_function(self, name: str) -> RawKernel:
        """The kernel ``name``: an ``extern "C"`` name or one of the ``name_expressions``."""
        if name not in self._expressions:
            raise KeyError(
                f"cudacpu: {self._where} has no kernel {name!r}; it has {self._expressions}"
            )
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = RawKernel(self, name, self._expressions.index(name))
            self._kernels[name] = kernel
        return kernel


def _dims(value, what: str, name: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise TypeError(
            f"cudacpu: {name}: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}"
        )
    x, y, z = (*(int(d) for d in dims), 1, 1)[:3]
    if min(x, y, z) < 1:
        raise LaunchError(f"cudacpu: {name}: {what} {(x, y, z)} has a dimension < 1")
    return x, y, z


class RawKernel:
    """One kernel of a :class:`RawModule`, launched as ``kernel(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: RawModule, name: str, index: int):
        self._module = module
        self.name = name
        self._fn = getattr(module._lib, f"cudacpu_kernel_{index}")
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(_Launch),
            ctypes.c_char_p,
            ctypes.c_ulong,
        ]
        sig = getattr(module._lib, f"cudacpu_signature_{index}")
        codes = (ctypes.c_char_p * 257)()
        sig.argtypes = [ctypes.c_void_p]
        sig(ctypes.cast(codes, ctypes.c_void_p))
        self.signature = [c.decode() for c in itertools.takewhile(lambda c: c is not None, codes)]
        #: like CuPy's attribute: dynamic shared memory above 48 KiB needs this set first
        self.max_dynamic_shared_size_bytes = 0
        self._launches = 0

    def _argument(self, i: int, code: str, arg):
        where = f"cudacpu: {self.name}: argument {i}"
        if code == "p":
            if isinstance(arg, np.ndarray):
                return ctypes.c_void_p(arg.__array_interface__["data"][0])
            if isinstance(arg, (np.uint64, np.int64)) and int(arg) == 0:
                return ctypes.c_void_p(0)
            if arg is None:
                raise TypeError(
                    f"{where}: None for a pointer (CuPy passes None as 0xffffffff, not NULL); "
                    "pass np.uint64(0) for a null pointer"
                )
            raise TypeError(
                f"{where}: expected an array for a pointer parameter, got {type(arg).__name__}"
            )
        if code == "s":
            raise TypeError(f"{where}: struct parameters are not supported by the harness")
        if not isinstance(arg, np.generic):
            raise TypeError(
                f"{where}: scalars must be NumPy scalars of the parameter's type "
                f"({_numpy_name(code)}), got {type(arg).__name__} {arg!r}"
            )
        kind, size = code[0], int(code[1:])
        if arg.dtype.kind != kind or arg.dtype.itemsize != size:
            raise TypeError(
                f"{where}: the kernel takes {_numpy_name(code)}, got np.{arg.dtype.name}"
            )
        return (ctypes.c_char * size).from_buffer_copy(arg.tobytes())

    def __call__(self, grid, block, args, *, shared_mem=0):
        """Launch over ``grid`` x ``block`` threads; returns when the kernel has finished.

        Raises
        ------
        TypeError
            An argument of the wrong kind or type.
        LaunchError
            A bad launch configuration or a failure inside the kernel (the
            message names the block, thread and source line).
        """
        args = tuple(args)
        if len(args) != len(self.signature):
            raise TypeError(
                f"cudacpu: {self.name} takes {len(self.signature)} arguments, got {len(args)}"
            )
        storage = [self._argument(i, c, a) for i, (c, a) in enumerate(zip(self.signature, args))]
        pointers = (ctypes.c_void_p * max(1, len(storage)))(
            *[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in storage]
        )
        shared_mem = int(shared_mem)
        limit = max(DEFAULT_SHARED_LIMIT, int(self.max_dynamic_shared_size_bytes))
        if shared_mem > limit:
            raise LaunchError(
                f"cudacpu: {self.name}: shared_mem={shared_mem} exceeds {limit} bytes; set "
                "max_dynamic_shared_size_bytes first (as on a GPU)"
            )
        launch = _Launch()
        launch.grid[:] = _dims(grid, "grid", self.name)
        launch.block[:] = _dims(block, "block", self.name)
        launch.shared_bytes = shared_mem
        launch.mode = self._module._mode
        launch.shuffle_seed = self._module._shuffle_seed
        self._launches += 1
        launch.fill_seed = zlib.crc32(self.name.encode()) * 1000003 + self._launches
        error = ctypes.create_string_buffer(16384)
        rc = self._fn(pointers, ctypes.byref(launch), error, len(error))
        if rc != 0:
            raise LaunchError(
                f"cudacpu: kernel {self.name} ({self._module._where}): {error.value.decode()}"
            )


def _numpy_name(code: str) -> str:
    kind, size = code[0], int(code[1:])
    return "np." + {"i": "int", "u": "uint", "f": "float"}[kind] + str(8 * size)


class _AlignedBuffer:
    """Owns ``nbytes`` of ``ALIGNMENT``-aligned memory from ``posix_memalign``; exposes it to NumPy."""

    _libc = ctypes.CDLL(None)
    _libc.posix_memalign.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    _libc.free.argtypes = [ctypes.c_void_p]

    def __init__(self, nbytes: int):
        ptr = ctypes.c_void_p()
        if self._libc.posix_memalign(ctypes.byref(ptr), ALIGNMENT, max(1, nbytes)) != 0:
            raise MemoryError(f"cudacpu: could not allocate {nbytes} aligned bytes")
        self._ptr = ptr.value
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self._ptr, False),
            "version": 3,
        }

    def __del__(self):
        self._libc.free(self._ptr)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is ``ALIGNMENT``-byte aligned.

    NumPy's own allocations are only 16-byte aligned; wmma loads need 32.
    The allocation ends where the array ends, so AddressSanitizer sees a
    write one element past the end.
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.asarray(_AlignedBuffer(nbytes))[:nbytes]
    return raw.view(dtype).reshape(shape)


def zeros(shape, dtype=np.float32) -> np.ndarray:
    """Like :func:`empty`, filled with zeros."""
    a = empty(shape, dtype)
    a[...] = 0
    return a


class CpuLoader:
    """The module-loader of the cupy backend's launchers, served by this harness (see ``emulate``)."""

    def __init__(self, *, schedule=None, sanitize=None, mode=None):
        self._options = {"schedule": schedule, "sanitize": sanitize, "mode": mode}
        self._cache: dict = {}

    name = "cudacpu"

    def module(self, path, name_expressions, options=()):
        """The compiled module of the ``.cu`` at ``path`` (cached per loader)."""
        key = (str(path), tuple(name_expressions), tuple(options))
        mod = self._cache.get(key)
        if mod is None:
            mod = RawModule(
                path=path, options=options, name_expressions=name_expressions, **self._options
            )
            self._cache[key] = mod
        return mod

    def sm_count(self, like) -> int:
        """The emulated device's multiprocessor count."""
        return SM_COUNT

    def empty(self, shape, dtype, like):
        """Scratch for a launcher: an aligned NumPy array."""
        return empty(shape, dtype)


@contextlib.contextmanager
def emulate(*, schedule=None, sanitize=None, mode=None):
    """Run the cupy backend's launchers on NumPy arrays through this harness, inside the block.

    Parameters are those of :class:`RawModule`.

    How it enters routing: it installs a :class:`CpuLoader` in a context
    variable of the cupy backend's loader module; the backend's declaration
    (its ``device_problem``) accepts NumPy arrays on the CPU only while one is
    installed, so ``backend="cupy"`` then serves them. Routing itself names
    no backend and is unchanged: automatic routing still sends NumPy arrays
    to ``array_api``, and CuPy arrays are refused by ``backend="cupy"`` inside
    the block.
    """
    from xpkernels.backends.cupy import _loader

    token = _loader.install(CpuLoader(schedule=schedule, sanitize=sanitize, mode=mode))
    try:
        yield
    finally:
        _loader.uninstall(token)
