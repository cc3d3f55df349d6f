"""Compile Triton kernels for sm_90 offline, at the specialisation their launchers would use.

No GPU is needed. The launcher code of a kernel (``backends/triton/*.forward``
and friends) runs unchanged on :func:`tensor` placeholders: meta tensors (no
storage) that say they live on ``cuda:0``, so every device-dependent decision
of the launcher (tile tables, SM count, partial-sum programs, decode splits)
takes its CUDA branch. :func:`capture` intercepts each ``kernel[grid](...)``
launch instead of running it and records the grid, arguments and keywords.
:func:`compile_launch` then hands those very arguments to Triton's own
``JITFunction.run(..., warmup=True)`` -- the JIT's binder computes the
signature, the constexprs, the ints specialised to 1 and the divisibility-by-16
attributes, exactly as a real launch would, and compiles without launching --
against a stand-in driver that names an sm_90 target. Tensors reach the binder
as :class:`_Pointer` objects whose addresses are 256-byte aligned plus the view's
offset, as the CUDA caching allocator's blocks are.

:func:`analyse` reads the artefacts of a compiled kernel (TTGIR, PTX, cubin):
the tensor-core instructions of each ``tl.dot``, registers and local memory
(``cuobjdump``), spill instructions and instruction count (``nvdisasm``), and
each global access joined to its source position -- its line and the lines of
the calls it was inlined through -- so that the width of every 16-bit tile
load and store and whether a loop's loads are asynchronous can be read per
access, also in a helper that several call sites inline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import types
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

__all__ = [
    "SM90",
    "Launch",
    "analyse",
    "capture",
    "compile_launch",
    "offline_cuda",
    "tensor",
]

#: The target every kernel is compiled for: Hopper, 32-thread warps.
SM90 = GPUTarget("cuda", 90, 32)
#: SMs of an H200 SXM: what the launchers read through ``torch.cuda``.
H200_SMS = 132
#: Per-SM limits of sm_90 used for the occupancy estimate.
SM90_REGS = 65536
SM90_SMEM = 228 * 1024
SM90_SMEM_PER_CTA_RESERVED = 1024
SM90_MAX_WARPS = 64
SM90_MAX_CTAS = 32
_BASE_ADDRESS = 1 << 40


class _CudaMeta(torch.Tensor):
    """A meta tensor that reports ``cuda:0`` as its device."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


def tensor(shape, dtype=torch.bfloat16):
    """A storage-less placeholder of ``shape`` and ``dtype`` that claims to be on ``cuda:0``.

    Parameters
    ----------
    shape : tuple of int
    dtype : torch.dtype

    Returns
    -------
    torch.Tensor
        A meta tensor: shape, strides, dtype and element size are real, data is not.
    """
    return torch.empty(shape, dtype=dtype, device="meta").as_subclass(_CudaMeta)


class _Pointer:
    """What the JIT binder sees for a tensor: a dtype and a 256-byte aligned address."""

    def __init__(self, t):
        self.dtype = t.dtype
        self._address = _BASE_ADDRESS + t.storage_offset() * t.element_size()

    def data_ptr(self):
        return self._address


class _Driver:
    """Stand-in for Triton's active driver: one sm_90 device, no streams."""

    def get_current_target(self):
        return SM90

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")


@dataclasses.dataclass
class Launch:
    """One intercepted ``kernel[grid](*args, **kwargs)``.

    ``candidates`` holds the tile configurations an autotuned launch would
    time (each a dict of keywords to add), and is None for a plain launch.
    """

    fn: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    candidates: list | None = None

    @property
    def name(self) -> str:
        return self.fn.__name__


def _grid(grid, fn, args, kwargs):
    if not callable(grid):
        return tuple(grid)
    named = dict(zip(fn.arg_names, args))
    named.update(kwargs)
    return tuple(grid(named))


@contextlib.contextmanager
def offline_cuda(sm_count: int = H200_SMS):
    """Run launchers as if on one sm_90 GPU with ``sm_count`` SMs; nothing is launched.

    Replaces, for the duration of the block, Triton's active driver by a
    stand-in and ``torch.cuda.device``, ``current_device`` and
    ``get_device_properties`` by versions that need no CUDA.
    """
    saved = (torch.cuda.device, torch.cuda.current_device, torch.cuda.get_device_properties)
    props = types.SimpleNamespace(
        multi_processor_count=sm_count, name="sm_90 (offline)", major=9, minor=0
    )
    config = triton.runtime.driver
    previous = config._active
    config.set_active(_Driver())
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda index=None: props
    try:
        yield
    finally:
        torch.cuda.device, torch.cuda.current_device, torch.cuda.get_device_properties = saved
        config._active = previous


@contextlib.contextmanager
def capture():
    """Record every Triton launch made in the block (and launch nothing).

    Yields
    ------
    list of Launch
        Filled as launches happen. An autotuned launch is recorded with the
        candidate configurations its pruning keeps for these arguments.
    """
    launches: list[Launch] = []
    jit_run, tuned_run = JITFunction.run, Autotuner.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, _grid(grid, self, args, kwargs), args, kwargs))

    def record_tuned(self, *args, **kwargs):
        grid = kwargs.pop("grid")
        kwargs.pop("warmup", None)
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs)
        self.nargs = None
        candidates = [{**c.all_kwargs()} for c in configs]
        fn = self.fn
        while not isinstance(fn, JITFunction):
            fn = fn.fn
        first = {**kwargs, **candidates[0]}
        launches.append(Launch(fn, _grid(grid, fn, args, first), args, kwargs, candidates))

    JITFunction.run, Autotuner.run = record, record_tuned
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuned_run


def compile_launch(launch: Launch, extra: dict | None = None):
    """Compile one recorded launch for sm_90 through the JIT's own binder.

    Must run inside :func:`offline_cuda`.

    Parameters
    ----------
    launch : Launch
    extra : dict, optional
        Keywords added to the launch's (an autotune candidate's tile).

    Returns
    -------
    triton.compiler.CompiledKernel
    """

    def bind(a):
        if isinstance(a, tuple):
            return tuple(bind(x) for x in a)
        return _Pointer(a) if isinstance(a, torch.Tensor) else a

    args = [bind(a) for a in launch.args]
    kwargs = {**launch.kwargs, **(extra or {})}
    return JITFunction.run(launch.fn, *args, grid=launch.grid, warmup=True, **kwargs)


# ----------------------------------------------------------------------------- tools


def _tool(name: str) -> str | None:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(bundled):
        return bundled
    return shutil.which(name)


def _cubin_facts(cubin: bytes) -> dict:
    """Registers, local memory and SASS statistics of a cubin (``cuobjdump``, ``nvdisasm``)."""
    facts = {
        "regs": None,
        "local_bytes": None,
        "stack_bytes": None,
        "sass_instructions": None,
        "spill_stores": None,
        "spill_loads": None,
        "sass_mma": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        cuobjdump = _tool("cuobjdump")
        if cuobjdump:
            out = subprocess.run(
                [cuobjdump, "--dump-resource-usage", path],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            if m := re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", out):
                facts["regs"], facts["stack_bytes"] = int(m[1]), int(m[2])
                facts["local_bytes"] = int(m[4])
        nvdisasm = _tool("nvdisasm")
        if nvdisasm:
            sass = subprocess.run(
                [nvdisasm, "-c", path], capture_output=True, text=True, check=True
            ).stdout
            ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s;]", sass)
            count = Counter(ops)
            facts["sass_instructions"] = len(ops)
            facts["spill_stores"] = count["STL"]
            facts["spill_loads"] = count["LDL"]
            facts["sass_mma"] = {op: n for op, n in count.items() if op in ("HGMMA", "HMMA")}
    return facts


# ----------------------------------------------------------------------------- TTGIR

_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_LOC_FILE = re.compile(r'^"([^"]+)":(\d+):(\d+)')
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_ELEM_BITS = {
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "i1": 8,
    "i8": 8,
    "i16": 16,
    "i32": 32,
    "i64": 64,
    "f8E5M2": 8,
    "f8E4M3FN": 8,
}


def _resolve_locs(ttgir: str) -> dict:
    """``{#loc name: source position}`` of a TTGIR listing; a position is the tuple of
    ``(file, line)`` frames from the operation's own line out through the calls inlined
    into it, so that an access in a helper called from several places stays apart."""
    raw = {}
    for line in ttgir.splitlines():
        if m := _LOC_DEF.match(line):
            raw[m[1]] = m[2]

    def resolve(body: str, depth: int = 0):
        if depth > 50:
            return None
        if m := _LOC_FILE.match(body):
            return ((os.path.basename(m[1]), int(m[2])),)
        if m := re.match(r"^callsite\((#loc\d*) at (#loc\d*)\)", body):
            callee = resolve(raw.get(m[1], ""), depth + 1)
            caller = resolve(raw.get(m[2], ""), depth + 1)
            return callee + caller if callee and caller else callee or caller
        if m := re.match(r'^"[^"]*"\((#loc\d*)\)', body):
            return resolve(raw.get(m[1], ""), depth + 1)
        if m := re.match(r"^fused\[(#loc\d*)", body):
            return resolve(raw.get(m[1], ""), depth + 1)
        if m := re.match(r"^(#loc\d*)", body):
            return resolve(raw.get(m[1], ""), depth + 1)
        return None

    return {name: resolve(body) for name, body in raw.items()}


def _tensor_type(text: str):
    """``(rank, element type)`` of the first ``tensor<...x!tt.ptr<T>...>`` or ``tensor<...xT,``."""
    m = re.search(r"tensor<((?:\d+x)+)(!tt\.ptr<(\w+)>|(\w+))", text)
    if not m:
        m1 = re.search(r"!tt\.ptr<(\w+)>", text)
        return (0, m1[1]) if m1 else (0, None)
    return m[1].count("x"), m[3] or m[4]


def _ttgir_facts(ttgir: str) -> dict:
    locs = _resolve_locs(ttgir)
    mma_versions = {
        m[1]: int(m[2])
        for m in re.finditer(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir, re.M)
    }
    stack: list[bool] = []
    dots = Counter()
    memops = []
    loops = 0
    for line in ttgir.splitlines():
        stripped = line.strip()
        if stripped.startswith("}"):
            if stack:
                stack.pop()
        in_loop = any(stack)
        ref = _LOC_REF.search(stripped)
        where = locs.get(ref[1]) if ref else None
        if "ttng.warp_group_dot " in stripped:
            dots["wgmma"] += 1
        elif re.search(r"= tt\.dot ", stripped):
            enc = re.search(r"->\s*tensor<[^,]+,\s*(#\w+)", stripped)
            version = mma_versions.get(enc[1]) if enc else None
            dots["mma.sync" if version == 2 else "wgmma" if version == 3 else "fma"] += 1
        for op, kind, sync in (
            ("tt.load ", "load", True),
            ("tt.store ", "store", True),
            ("ttg.async_copy_global_to_local ", "load", False),
            ("tt.descriptor_load ", "load", False),
            ("ttng.async_tma_copy_global_to_local ", "load", False),
            ("tt.descriptor_store ", "store", False),
            ("ttng.async_tma_copy_local_to_global ", "store", False),
        ):
            if op in stripped:
                rank, elem = _tensor_type(stripped.split(" : ", 1)[-1])
                memops.append(
                    {
                        "kind": kind,
                        "sync": sync,
                        "tma": "tma" in op or "descriptor" in op,
                        "rank": rank,
                        "elem": elem,
                        "in_loop": in_loop,
                        "where": where,
                    }
                )
                break
        if stripped.endswith("{"):
            is_loop = (
                "scf.for " in stripped or "scf.while " in stripped or stripped.startswith("} do {")
            )
            stack.append(is_loop)
            loops += "scf.for " in stripped or "scf.while " in stripped
    return {"dots": dict(dots), "memops": memops, "loops": loops}


# ----------------------------------------------------------------------------- PTX

_PTX_ACCESS = re.compile(
    r"^\s*(?:@!?%\w+\s+)?(ld\.global|st\.global|cp\.async\.bulk\.tensor|cp\.async\.c[ag])([.\w:]*)"
    r"\s+(.*);"
)
_PTX_TYPE_BITS = {
    "b8": 8,
    "u8": 8,
    "s8": 8,
    "b16": 16,
    "u16": 16,
    "s16": 16,
    "f16": 16,
    "bf16": 16,
    "b32": 32,
    "u32": 32,
    "s32": 32,
    "f32": 32,
    "b64": 64,
    "u64": 64,
    "s64": 64,
    "f64": 64,
    "b128": 128,
}


def _ptx_facts(ptx: str) -> dict:
    files = {
        int(m[1]): os.path.basename(m[2])
        for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)
    }
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        if m := re.match(r"^\s*(\$L__\w+):", line):
            labels[m[1]] = i
    loop_ranges = []
    for i, line in enumerate(lines):
        if m := re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line):
            target = labels.get(m[1])
            if target is not None and target < i:
                loop_ranges.append((target, i))

    def in_loop(i):
        return any(lo <= i <= hi for lo, hi in loop_ranges)

    where = None
    accesses = []
    mma = Counter()
    for i, line in enumerate(lines):
        if m := re.match(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+", line):
            # The comment names the inlining chain: "f.py:12:3 @[ g.py:40:7 @[ ... ] ]".
            frames = re.findall(r"([\w.\-]+):(\d+):\d+", line.split("//", 1)[-1])
            where = tuple((f, int(n)) for f, n in frames) or (
                (files.get(int(m[1]), m[1]), int(m[2])),
            )
            continue
        if "wgmma.mma_async" in line:
            mma["wgmma"] += 1
        elif "mma.sync" in line:
            mma["mma.sync"] += 1
        m = _PTX_ACCESS.match(line)
        if not m:
            continue
        op, mods = m[1], m[2]
        if op.startswith("cp.async.c"):
            size = re.search(r"\],\s*(0x[0-9a-fA-F]+|\d+)", m[3])
            bits = 8 * int(size[1], 0) if size else None
            kind, sync = "load", False
        elif op == "cp.async.bulk.tensor":
            bits, kind, sync = None, "load" if ".shared::cluster.global" in mods else "store", False
        else:
            vec = re.search(r"\.v(\d)", mods)
            typ = re.findall(
                r"\.(b8|u8|s8|b16|u16|s16|f16|bf16|b32|u32|s32|f32|b64|u64|s64|f64|b128)\b", mods
            )
            bits = (int(vec[1]) if vec else 1) * (_PTX_TYPE_BITS[typ[-1]] if typ else 0)
            kind, sync = ("load" if op == "ld.global" else "store"), True
        accesses.append(
            {
                "op": op,
                "kind": kind,
                "sync": sync,
                "bits": bits,
                "tma": op == "cp.async.bulk.tensor",
                "in_loop": in_loop(i),
                "where": where,
            }
        )
    return {"accesses": accesses, "mma": dict(mma), "loops": len(loop_ranges)}


def _width_summary(accesses) -> dict:
    """``{"ld.global.128": n, "cp.async.16B": n, "tma": n, ...}`` over ``accesses``."""
    out = Counter()
    for a in accesses:
        if a["tma"]:
            out[f"tma.{a['kind']}"] += 1
        elif a["op"].startswith("cp.async"):
            out[f"cp.async.{(a['bits'] or 0) // 8}B"] += 1
        else:
            out[f"{a['op']}.{a['bits']}"] += 1
    return dict(sorted(out.items()))


def _occupancy(regs, shared, num_warps) -> int | None:
    if regs is None:
        return None
    threads = 32 * num_warps
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = SM90_REGS // (per_warp * num_warps)
    by_smem = SM90_SMEM // (shared + SM90_SMEM_PER_CTA_RESERVED) if shared else SM90_MAX_CTAS
    by_warps = SM90_MAX_WARPS // num_warps
    return max(0, min(by_regs, by_smem, by_warps, SM90_MAX_CTAS, 2048 // threads))


def analyse(compiled) -> dict:
    """What the compiler emitted for one kernel.

    Parameters
    ----------
    compiled : triton.compiler.CompiledKernel

    Returns
    -------
    dict
        ``mma`` (``"wgmma"``, ``"mma.sync"``, ``"fma"``, ``"mixed"`` or ``"none"``),
        ``dots`` (count per kind), ``regs``, ``local_bytes``, ``spill_stores``,
        ``spill_loads``, ``shared``, ``num_warps``, ``num_stages``,
        ``ctas_per_sm`` (estimate from registers and shared memory),
        ``sass_instructions``, ``loops``, ``accesses`` (global access width
        counts, all and inside loops), ``tile_ops`` (each TTGIR load/store of
        16-bit elements with its source position, whether it is in a loop and
        asynchronous, and the PTX access widths at that position), ``divisible16``
        (arguments carrying ``tt.divisibility = 16``).
    """
    asm = compiled.asm
    meta = compiled.metadata
    ttgir = _ttgir_facts(asm["ttgir"])
    ptx = _ptx_facts(asm["ptx"])
    cubin = _cubin_facts(asm["cubin"])
    dots = ttgir["dots"]
    kinds = [k for k, n in dots.items() if n]
    mma = "none" if not kinds else kinds[0] if len(kinds) == 1 else "mixed"
    by_line: dict = {}
    for a in ptx["accesses"]:
        by_line.setdefault((a["where"], a["kind"]), []).append(a)
    claimed = {(op["where"], op["kind"]) for op in ttgir["memops"]}
    tile_ops = []
    for op in ttgir["memops"]:
        if _ELEM_BITS.get(op["elem"]) != 16:
            continue
        where = op["where"]
        ptx_here = by_line.get((where, op["kind"]), [])
        if not ptx_here and where:
            # LLVM may put a load's instructions on the next line (the conversion it fused with):
            # take accesses of that kind from the next two lines that no TTGIR access claims.
            for step in (1, 2):
                key = (((where[0][0], where[0][1] + step), *where[1:]), op["kind"])
                if key in by_line and key not in claimed:
                    ptx_here = by_line[key]
                    break
        tile_ops.append(
            {
                "where": " @ ".join(f"{f}:{n}" for f, n in where) if where else None,
                "kind": op["kind"],
                "rank": op["rank"],
                "in_loop": op["in_loop"],
                "async": not op["sync"],
                "tma": op["tma"],
                "ptx": _width_summary(ptx_here),
                "all_128bit": bool(ptx_here)
                and all(a["tma"] or a["bits"] == 128 for a in ptx_here),
            }
        )
    func = re.search(r"tt\.func public @\w+\((.*?)\)\s*attributes", asm["ttgir"], re.S)
    divisible = re.findall(r"%(\w+): [^%]*?tt\.divisibility = 16", func[1]) if func else []
    shared = int(getattr(meta, "shared", 0))
    num_warps = int(meta.num_warps)
    return {
        "mma": mma,
        "dots": dict(dots),
        "ptx_mma": ptx["mma"],
        "sass_mma": cubin["sass_mma"],
        "regs": cubin["regs"],
        "local_bytes": cubin["local_bytes"],
        "stack_bytes": cubin["stack_bytes"],
        "spill_stores": cubin["spill_stores"],
        "spill_loads": cubin["spill_loads"],
        "shared": shared,
        "num_warps": num_warps,
        "num_stages": int(meta.num_stages),
        "ctas_per_sm": _occupancy(cubin["regs"], shared, num_warps),
        "sass_instructions": cubin["sass_instructions"],
        "loops": ttgir["loops"],
        "accesses": {
            "all": _width_summary(ptx["accesses"]),
            "in_loop": _width_summary([a for a in ptx["accesses"] if a["in_loop"]]),
        },
        "tile_ops": tile_ops,
        "divisible16": divisible,
        "hash": compiled.hash,
    }
