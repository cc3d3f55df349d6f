"""GPU benchmarks of xpkernels' Triton and CuPy backends, against ceilings measured in the same run.

Run by ``bench/device.sh`` (see ``bench/README.md``); by hand::

    python bench/gpu.py --out DIR            # CUDA device required
    python bench/gpu.py --out DIR --dry-run  # CPU, tiny shapes, Triton interpreter

Measures, in order:

1. ceilings: device-to-device copy bandwidth (``dst.copy_(src)``, bytes read
   plus bytes written) and a bf16 ``8192 x 8192 x 8192`` matrix product;
2. RMSNorm, LayerNorm and softmax at ``(32768, 4096)`` and ``(4096, 65536)``
   in bfloat16 and float32, forward and backward: GB/s by the bytes formula
   recorded with each entry, as a share of the copy bandwidth, next to
   ``F.rms_norm`` / ``F.layer_norm`` / ``torch.softmax`` and (norms)
   ``torch.compile`` of the same PyTorch function, while the compile budget
   lasts;
3. attention ``B=4, H=32, S=4096``, ``D`` 64 and 128, bfloat16, causal and
   not, forward and backward: TFLOP/s with forward ``4 B H S^2 D`` (halved
   when causal) and backward 2.5 x forward, next to
   ``F.scaled_dot_product_attention``;
4. decode attention ``B=16, H=32, Hkv=8, S=32768, D=128`` bfloat16: GB/s of
   the K and V cache read, next to ``F.scaled_dot_product_attention`` with
   ``enable_gqa``; then the same cache in shuffled 16-key pages read through
   a block table (paged decode), next to gathering the pages and
   ``F.scaled_dot_product_attention`` and to the contiguous decode;
5. FlexAttention ``B=4, H=16, S=4096``, ``D`` 64 and 128, bfloat16, forward
   and backward, with no mods, causal (as a mask mod), sliding window 256, a
   document mask, ALiBi (causal) and a learned relative-position table
   ``(H, 257)`` (causal): TFLOP/s of the (query, key) pairs each mask keeps
   (``4 B H D pairs``; every pair without a mask), next to
   PyTorch's ``flex_attention`` compiled with its ``create_block_mask`` (while
   the compile budget lasts) and to xpkernels' attention kernel; the
   backwards with score-mod gradients (ALiBi, the table: deterministic, the
   default) also next to the same call with ``deterministic=False`` (float32
   atomics) and to the same call computing no score-mod gradients;
6. SwiGLU and GeGLU (its tanh form and its exact one) at the norms' shapes and
   dtypes, forward and backward: GB/s as a share of the copy bandwidth, next
   to the PyTorch composition they replace (``F.silu(a) * b``,
   ``F.gelu(a, approximate=...) * b``) and, where ``liger_kernel`` imports,
   Liger-Kernel's ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` (the
   tanh form only);
7. RoPE (half rotation, full rotary) ``B=4, H=32, Hkv=8, S=4096, D=128``
   bfloat16, q, k and their cotangents ``(B, H, S, D)`` views of ``(B, S, H, D)``
   buffers (the projections' layout), forward and backward: GB/s of q and k
   read and written plus the tables, as a share of the copy bandwidth (target:
   85%), next to the eager composition it replaces (Hugging Face's
   ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``, same for k) and,
   where ``liger_kernel`` imports, Liger-Kernel's ``LigerRopeFunction``;
8. cross-entropy ``N=8192, V=128256`` (Llama 3's vocabulary) bfloat16, the mean over
   the rows, forward, backward (the gradient into a buffer of its own) and the two in
   turn: GB/s of the logits read (and the gradient written) as a share of the copy
   bandwidth, next to ``F.cross_entropy`` and, forward+backward only, Liger-Kernel's
   ``LigerCrossEntropyFunction`` where ``liger_kernel`` imports (its forward computes
   the gradient too, over the logits in place; its backward only scales it);
9. linear cross-entropy ``N=8192, H=4096, V=128256`` bfloat16, forward+backward:
   TFLOP/s of the composition's three products (``x @ W.T``, ``dZ @ W``, ``dZ^T @
   x``), next to that composition (``F.cross_entropy(x @ W.T, t)``), to the three
   products alone (target: at most 1.1x their time; xpkernels' forward then
   backward form the logits twice, four products against three, so about 1.33x is
   their design floor) and to Liger-Kernel's
   ``LigerFusedLinearCrossEntropyFunction``; then the fused forward (Duplicated
   ``x`` and ``W``: the gradients in the same chunk loop, three products) against
   the same target; then the peak memory each allocates beyond its inputs and
   gradients (``torch.cuda``'s allocator; target: at most 1/10 of the
   composition's);
10. the cupy backend (CUDA C through ``cupy.RawModule``) on CuPy views of the same
    CUDA tensors, float16: the norms, softmax, SwiGLU and GeGLU at ``(32768, 4096)``,
    RoPE at the shape of 7, attention at ``D=128`` causal and not, FlexAttention
    with a causal mask mod at the same shape, decode attention, next to the same call on
    the triton backend (target: at most 1.25x slower) and to PyTorch's op. In a dry
    run these calls run the same ``.cu`` on NumPy views through
    ``xpkernels.testing.cudacpu``.

The cases -- shapes (``GPU_SHAPES``: the ones above, and the dry run's), the
primitives and flex mods, the byte and FLOP counts, the inputs and the xpkernels
calls -- are declared in :mod:`xpkernels.cli.bench_work`, which ``python -m
xpkernels bench`` times on CPU; this script keeps what only a GPU run has: the
timing (``triton.testing.do_bench``), the ceilings, PyTorch's CUDA baselines,
the targets and the summary.

Every xpkernels call is made through the public in-place functions with
``backend="triton"`` (``"cupy"`` in section 10) and preallocated buffers
(checkpoints, scratch), so a timing is the kernels alone (linear
cross-entropy's: its products through PyTorch's cuBLAS too). Writes
``gpu.json`` into ``--out`` and prints a table. An entry that raises is
recorded with its traceback and the run goes on; the exit status is 1 if any
entry failed or was skipped for time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from xpkernels.cli import bench_work as cases


@dataclass
class Entry:
    """One measured kernel: the xpkernels figure and its PyTorch baselines."""

    section: str
    op: str
    pass_: str
    dtype: str
    shape: tuple
    unit: str  # "GB/s" or "TFLOP/s"
    formula: str  # how the bytes or FLOPs are counted
    amount: float  # bytes or FLOPs per call
    ceiling: str  # "copy" or "matmul"
    ms: float | None = None
    rate: float | None = None
    pct_of_ceiling: float | None = None
    baselines: dict = field(default_factory=dict)
    error: str | None = None
    notes: dict = field(default_factory=dict)  # further figures by name (tokens/s, peak GiB)


class Bench:
    """Timing and bookkeeping shared by the sections."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.deadline = time.monotonic() + args.time_budget
        self.compile_budget = 0.0 if self.dry else args.compile_budget
        self.entries: list[Entry] = []
        self.ceilings: dict[str, float] = {}
        self.ceiling_formulas: dict[str, str] = {}
        self.skipped: list[str] = []
        self.sections_skipped: dict[str, str] = {}  # a section that could not run here: why

    def time_ms(self, fn) -> float:
        """Median milliseconds of ``fn()``; one warm call and one timed call in a dry run."""
        if self.dry:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def random(self, dtype):
        """The cases' ``Random``: standard normal tensors of ``dtype`` on the run's device."""
        return lambda shape: self.torch.randn(*shape, dtype=dtype, device=self.device)

    def rate(self, entry: Entry, ms: float) -> float:
        scale = 1e9 if entry.unit == "GB/s" else 1e12
        return entry.amount / (ms * 1e-3) / scale

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def run(self, entry: Entry, kernel, baselines: dict) -> None:
        """Time ``kernel`` and each of ``baselines`` (name -> callable or None); keep ``entry``."""
        label = f"{entry.op} {entry.pass_} {entry.dtype} {entry.shape}"
        if self.out_of_time():
            self.skipped.append(label)
            entry.error = "skipped: the time budget ran out"
            self.entries.append(entry)
            return
        try:
            entry.ms = self.time_ms(kernel)
            entry.rate = self.rate(entry, entry.ms)
            ceiling = self.ceilings.get(entry.ceiling)
            if ceiling:
                entry.pct_of_ceiling = 100.0 * entry.rate / ceiling
        except Exception:  # noqa: BLE001 - recorded, reported, and fails the run at the end
            entry.error = traceback.format_exc()
        for name, fn in baselines.items():
            if fn is None:
                continue
            try:
                ms = self.time_ms(fn)
                entry.baselines[name] = {"ms": ms, "rate": self.rate(entry, ms)}
            except Exception as exc:  # noqa: BLE001 - a baseline failing is data, not our failure
                entry.baselines[name] = {"error": f"{type(exc).__name__}: {exc}"}
        self.entries.append(entry)
        print(format_entry(entry), flush=True)

    def peak_memory(self, entry: Entry, ours, baselines: dict) -> None:
        """The peak memory of ``ours`` and of each of ``baselines`` (name -> callable) beyond
        what each holds when it returns (:meth:`extra_bytes`): ``entry.rate`` ours in MiB, each
        baseline's in ``entry.notes`` (``"<name> peak MiB"``). A dry run calls each once and
        records no figure (no CUDA allocator to ask)."""
        label = f"{entry.op} {entry.pass_} {entry.dtype} {entry.shape}"
        self.entries.append(entry)
        if self.out_of_time():
            self.skipped.append(label)
            entry.error = "skipped: the time budget ran out"
            return
        try:
            ours_bytes = self.extra_bytes(ours)
        except Exception:  # noqa: BLE001 - recorded, reported, and fails the run at the end
            entry.error = traceback.format_exc()
            return
        if ours_bytes is not None:
            entry.amount, entry.rate = ours_bytes, ours_bytes / 2**20
        for name, fn in baselines.items():
            try:
                theirs = self.extra_bytes(fn)
            except Exception as exc:  # noqa: BLE001 - a baseline failing is data, not our failure
                entry.baselines[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if theirs is not None:
                entry.notes[f"{name} peak MiB"] = theirs / 2**20
        ours_text = "none (CUDA only)" if entry.rate is None else f"{entry.rate:.4g}"
        figures = [f"xpkernels peak MiB {ours_text}"]
        figures += [f"{name} {value:.4g}" for name, value in entry.notes.items()]
        print(f"  {label}: " + " | ".join(figures), flush=True)

    def extra_bytes(self, run) -> int | None:
        """The most bytes ``run()`` had allocated at once beyond what is allocated when it
        returns, its results held (``torch.cuda.max_memory_allocated()`` minus
        ``memory_allocated()``): its working memory, the results it returns not counted. None
        in a dry run, after calling ``run()`` once."""
        if self.dry:
            run()
            return None
        torch = self.torch
        self.free()
        torch.cuda.reset_peak_memory_stats()
        kept = run()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        del kept  # held until the allocator was read
        return extra

    def free(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()


def format_entry(e: Entry) -> str:
    if e.error:
        first = e.error.strip().splitlines()[-1]
        return f"  {e.op:<16} {e.pass_:<8} {e.dtype:<8} {e.shape!s:<24} ERROR {first}"
    pct = f"{e.pct_of_ceiling:5.1f}% {e.ceiling}" if e.pct_of_ceiling is not None else ""
    head = f"  {e.op:<16} {e.pass_:<8} {e.dtype:<8} {e.shape!s:<24}"
    parts = [f"{head} {e.ms:9.3f} ms {e.rate:9.1f} {e.unit} {pct}"]
    for name, b in e.baselines.items():
        if "error" in b:
            parts.append(f"{name}: {b['error'][:60]}")
        else:
            parts.append(f"{name}: {b['rate']:.1f} ({e.rate / b['rate']:.2f}x)")
    parts += [f"{name} {value:.4g}" for name, value in e.notes.items()]
    return " | ".join(parts)


def measure_ceilings(bench: Bench) -> None:
    n_bytes = (1 << 20) if bench.dry else (1 << 31)
    n = 256 if bench.dry else 8192
    bench.ceilings["copy"] = 2 * n_bytes / (copy_ms(bench, n_bytes) * 1e-3) / 1e9
    bench.ceilings["matmul"] = 2 * n**3 / (matmul_ms(bench, n) * 1e-3) / 1e12
    bench.ceiling_formulas = {
        "copy": f"GB/s of dst.copy_(src), {n_bytes} bytes read + {n_bytes} bytes written (bf16)",
        "matmul": f"TFLOP/s of a bf16 {n}x{n}x{n} torch.matmul on random data, 2*n^3 FLOPs",
    }
    bench.free()
    print(
        f"ceilings: copy {bench.ceilings['copy']:.1f} GB/s, "
        f"bf16 matmul {bench.ceilings['matmul']:.1f} TFLOP/s",
        flush=True,
    )


def copy_ms(bench: Bench, n_bytes: int) -> float:
    src = bench.torch.empty(n_bytes // 2, dtype=bench.torch.bfloat16, device=bench.device).normal_()
    dst = bench.torch.empty_like(src)
    return bench.time_ms(lambda: dst.copy_(src))


def matmul_ms(bench: Bench, n: int) -> float:
    a = bench.torch.randn(n, n, dtype=bench.torch.bfloat16, device=bench.device)
    b = bench.torch.randn(n, n, dtype=bench.torch.bfloat16, device=bench.device)
    return bench.time_ms(lambda: bench.torch.matmul(a, b))


class CompileBudget:
    """``torch.compile`` of a function, attempted while the run's compile budget lasts."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.spent = 0.0

    def compiled(self, fn, *example):
        """``fn`` compiled and called once on ``example`` (timed against the budget), or None."""
        if self.spent >= self.bench.compile_budget:
            return None
        start = time.monotonic()
        try:
            compiled = self.bench.torch.compile(fn, dynamic=False)
            compiled(*example)
        except Exception:  # noqa: BLE001 - torch.compile failing is a missing baseline
            compiled = None
        self.spent += time.monotonic() - start
        return compiled


class DeviceArrays(cases.Arrays):
    """The cases' inputs (torch tensors on the run's device) as one backend's arrays: the
    tensors themselves for ``triton``; for ``cupy``, ``wrap``'s zero-copy views of them
    (:class:`CupyViews`). Every xpkernels call gets ``backend=``."""

    def __init__(self, bench: Bench, backend: str, wrap=None):
        super().__init__("torch")
        self.torch, self.device, self.wrap = bench.torch, bench.device, wrap
        self.options = {"backend": backend}

    def convert(self, t):
        return t if self.wrap is None else self.wrap(t)

    def host(self, a):
        return self.convert(self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device))

    def integers(self, values):
        return self.host(np.asarray(values, dtype=np.int32))


def _grad(torch, out, inputs, dy):
    """The autograd backward of ``out`` (a baseline), or None without ``out``."""
    if out is None:
        return None
    return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)


#: The name of each row primitive's PyTorch baseline.
TORCH_ROW_OPS = {"rms_norm": "F.rms_norm", "layer_norm": "F.layer_norm", "softmax": "torch.softmax"}


def norm_sections(bench: Bench, compiler: CompileBudget) -> None:
    shapes = cases.GPU_SHAPES[bench.dry]
    for rows, m in shapes["rows"]:
        for dtype_name in shapes["row_dtypes"]:
            rows_case(bench, compiler, rows, m, dtype_name)
            bench.free()


def rows_case(bench: Bench, compiler: CompileBudget, rows: int, m: int, dtype_name: str) -> None:
    """RMSNorm, LayerNorm and softmax, forward and backward, on ``(rows, m)`` inputs."""
    dtype = getattr(bench.torch, dtype_name)
    inputs = cases.row_inputs(rows, m, bench.random(dtype))
    for op in cases.ROW_OPS:
        row_op_case(bench, compiler, op, inputs, dtype_name)


def row_op_case(bench: Bench, compiler: CompileBudget, op: str, inputs, dtype_name: str) -> None:
    """Row primitive ``op`` forward and backward on ``inputs`` (:func:`~xpkernels.cli.
    bench_work.row_inputs`), against PyTorch's op and (norms) ``torch.compile`` of it."""
    torch = bench.torch
    x, dy, w, b = (inputs[n] for n in ("x", "dy", "w", "b"))
    rows, m = x.shape
    s = torch.finfo(x.dtype).bits // 8
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    wanted = (xr, *(t for n, t in (("w", wr), ("b", br)) if n in cases.ROW_PARAMS[op]))
    calls = cases.row_calls(op, DeviceArrays(bench, "triton"), inputs)
    torch_op = cases.torch_row_op(op, m)
    compiled = None if op == "softmax" else compiler.compiled(torch_op, xr, wr, br)
    baselines = {
        "forward": {
            TORCH_ROW_OPS[op]: lambda: torch_op(x, w, b),
            "torch.compile": None if compiled is None else lambda: compiled(x, w, b),
        },
        "backward": {
            TORCH_ROW_OPS[op]: _grad(torch, torch_op(xr, wr, br), wanted, dy),
            "torch.compile": _grad(
                torch, None if compiled is None else compiled(xr, wr, br), wanted, dy
            ),
        },
    }
    for pass_, kernel in (("forward", calls.forward), ("backward", calls.backward)):
        amount, formula = cases.row_work(op, pass_, rows, m, s)
        entry = Entry("rows", op, pass_, dtype_name, (rows, m), "GB/s", formula, amount, "copy")
        bench.run(entry, kernel, baselines[pass_])


#: The name of each gated activation's PyTorch baseline: the composition it replaces.
TORCH_GATED_OPS = {"swiglu": "F.silu(a)*b", "geglu": "F.gelu(a)*b"}


def gated_section(bench: Bench) -> None:
    """SwiGLU and GeGLU at every ``GPU_SHAPES`` rows shape and dtype."""
    import importlib.util

    shapes = cases.GPU_SHAPES[bench.dry]
    if importlib.util.find_spec("liger_kernel") is None:
        print("  liger_kernel is not installed: no Liger-Kernel baselines", flush=True)
    for rows, m in shapes["rows"]:
        for dtype_name in shapes["row_dtypes"]:
            inputs = cases.gated_inputs(rows, m, bench.random(getattr(bench.torch, dtype_name)))
            for op in cases.GATED_OPS:
                for name, options in cases.GATED_CASES[op]:
                    gated_case(bench, op, name, options, inputs, dtype_name)
            bench.free()


def liger_gated(op: str, options: dict):
    """Liger-Kernel's fused ``op`` at ``options`` as ``f(a, b)`` (an autograd function), or None
    where ``liger_kernel`` is not installed or has none (its GeGLU is the tanh form only)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return None
    if op == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply
    if options["approximate"] == "tanh":
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    return None


def gated_case(bench: Bench, op: str, name: str, options: dict, inputs, dtype_name: str) -> None:
    """Gated activation ``op`` with ``options`` (the entries named ``name``), forward and
    backward on ``inputs`` (:func:`~xpkernels.cli.bench_work.gated_inputs`), against the
    PyTorch composition it replaces and Liger-Kernel's fused function where there is one."""
    torch = bench.torch
    a, b, dy = (inputs[n] for n in ("a", "b", "dy"))
    rows, m = a.shape
    s = torch.finfo(a.dtype).bits // 8
    calls = cases.gated_calls(op, DeviceArrays(bench, "triton"), inputs, options)
    torch_op = cases.torch_gated_op(op, options)
    ar, br = (t.detach().requires_grad_() for t in (a, b))
    eager = TORCH_GATED_OPS[op]
    baselines = {
        "forward": {eager: lambda: torch_op(a, b)},
        "backward": {eager: _grad(torch, torch_op(ar, br), (ar, br), dy)},
    }
    liger = liger_gated(op, options)
    if liger is not None:
        # Liger's backward writes da and db over the a and b it saved: copies of its own
        al, bl = (t.detach().clone().requires_grad_() for t in (a, b))
        baselines["forward"]["liger"] = lambda: liger(a, b)
        baselines["backward"]["liger"] = _grad(torch, liger(al, bl), (al, bl), dy)
    for pass_, kernel in (("forward", calls.forward), ("backward", calls.backward)):
        amount, formula = cases.row_work(op, pass_, rows, m, s)
        entry = Entry("gated", name, pass_, dtype_name, (rows, m), "GB/s", formula, amount, "copy")
        bench.run(entry, kernel, baselines[pass_])


#: The name of RoPE's PyTorch baseline: Hugging Face's ``apply_rotary_pos_emb``, eager.
TORCH_ROPE = "q*cos+rotate_half(q)*sin"


def rope_section(bench: Bench) -> None:
    """RoPE at ``GPU_SHAPES``' ``rope`` shape, bfloat16."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        print("  liger_kernel is not installed: no Liger-Kernel baseline", flush=True)
    rope_case(bench, cases.GPU_SHAPES[bench.dry]["rope"], "bfloat16")
    bench.free()


def rope_tensors(bench: Bench, shape: dict, dtype_name: str) -> dict:
    """:func:`~xpkernels.cli.bench_work.rope_inputs` at ``shape`` as tensors of ``dtype_name`` on
    the run's device (the tables too, as Llama's rotary embedding casts them to q's dtype)."""
    torch = bench.torch
    dtype = getattr(torch, dtype_name)
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    return cases.rope_inputs(
        b, h, hkv, s, d, bench.random(dtype), lambda t: torch.from_numpy(t).to(bench.device, dtype)
    )


def torch_rope_calls(bench: Bench, inputs, op=cases.torch_rope) -> dict:
    """``op(q, k, cos, sin)`` (the eager composition; or Liger's) on the ``(B, H, S, D)`` views of
    ``inputs``, forward and (autograd) backward, with Hugging Face's ``(B, S, D)`` tables. Each
    call gets copies of q, k and the cotangents of its own: Liger rotates q and k in place in
    its forward and the cotangents in its backward. The gradients are taken with respect to
    the ``(B, S, H, D)`` buffers (Liger's outputs are views of its inputs' storage, which
    autograd does not tie to the ``(B, H, S, D)`` views)."""
    torch = bench.torch
    cos, sin = cases.hf_rope_tables(inputs["cos"], inputs["sin"], inputs["q"].shape[0])
    q, k, dq_out, dk_out = (cases.bhsd(inputs[n].clone()) for n in cases.ROPE_ROTATED)
    qb, kb = (inputs[n].clone().requires_grad_() for n in ("q", "k"))
    outs = op(cases.bhsd(qb), cases.bhsd(kb), cos, sin)[:2]
    return {
        "forward": lambda: op(q, k, cos, sin),
        "backward": _grad(torch, outs, (qb, kb), (dq_out, dk_out)),
    }


def liger_rope():
    """Liger-Kernel's ``LigerRopeFunction.apply`` as ``f(q, k, cos, sin)``, or None where
    ``liger_kernel`` is not installed. Its signature is ``(q, k, cos, sin, position_ids=None,
    unsqueeze_dim=1)``, q ``(B, H, S, D)`` over ``(B, S, H, D)`` storage (else it copies), cos
    and sin ``(1 or B, S, D)``; it returns ``(q, k)`` or, in newer releases, ``(q, k, cos,
    sin)`` -- :func:`torch_rope_calls` keeps the first two."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply


def _failing(exc: Exception):
    """A baseline that raises ``exc`` when timed (one that could not be set up: recorded as its
    error)."""

    def call():
        raise exc

    return call


def rope_case(bench: Bench, shape: dict, dtype_name: str) -> None:
    """RoPE forward and backward at ``shape`` (``B, H, Hkv, S, D``), against the eager
    composition and Liger-Kernel's ``LigerRopeFunction`` where it imports."""
    torch = bench.torch
    inputs = rope_tensors(bench, shape, dtype_name)
    calls = cases.rope_calls(DeviceArrays(bench, "triton"), inputs)
    eager = torch_rope_calls(bench, inputs)
    baselines = {pass_: {TORCH_ROPE: eager[pass_]} for pass_ in ("forward", "backward")}
    try:
        liger = liger_rope()
        theirs = None if liger is None else torch_rope_calls(bench, inputs, liger)
    except Exception as exc:  # noqa: BLE001 - a Liger that will not run is a baseline's error
        theirs = {"forward": _failing(exc), "backward": _failing(exc)}
    if theirs is not None:
        for pass_ in baselines:
            baselines[pass_]["liger"] = theirs[pass_]
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    size = torch.finfo(inputs["q"].dtype).bits // 8
    for pass_, kernel in (("forward", calls.forward), ("backward", calls.backward)):
        amount, formula = cases.rope_work(pass_, b, h, hkv, s, d, size, size)
        entry = Entry(
            "rope", "rope", pass_, dtype_name, (b, h, hkv, s, d), "GB/s", formula, amount, "copy"
        )
        bench.run(entry, kernel, baselines[pass_])


#: The names of the losses' PyTorch baselines.
TORCH_CROSS_ENTROPY = "F.cross_entropy"
TORCH_LINEAR_CROSS_ENTROPY = "F.cross_entropy(x@W.T)"
#: The baseline of linear cross-entropy's time target: the products its composition needs.
PRODUCTS = "3 products"


def loss_section(bench: Bench) -> None:
    """Cross-entropy and linear cross-entropy at their ``GPU_SHAPES``, bfloat16."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        print("  liger_kernel is not installed: no Liger-Kernel baselines", flush=True)
    shapes = cases.GPU_SHAPES[bench.dry]
    cross_entropy_case(bench, shapes["cross_entropy"], "bfloat16")
    bench.free()
    linear_cross_entropy_case(bench, shapes["linear_cross_entropy"], "bfloat16")
    bench.free()


def liger_loss(op: str):
    """Liger-Kernel's ``LigerCrossEntropyFunction.apply`` (``op`` ``cross_entropy``: ``f(logits,
    targets)``) or ``LigerFusedLinearCrossEntropyFunction.apply`` (``f(x, weight, targets)``),
    or None where ``liger_kernel`` is not installed; their other arguments keep their
    defaults (mean, no smoothing), which every release has. :func:`liger_value` takes the loss
    from what they return."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return None
    if op == "cross_entropy":
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        return LigerCrossEntropyFunction.apply
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    return LigerFusedLinearCrossEntropyFunction.apply


def liger_value(out):
    """The loss a Liger loss function returns: the tensor itself, or the first of the tuple
    newer releases return (``loss, z_loss`` and more)."""
    return out[0] if isinstance(out, tuple) else out


def _liger_baseline(op: str, make) -> dict:
    """``{"liger": make(liger_loss(op))}``, ``{}`` where Liger is not installed, or a baseline
    that raises what setting it up raised (a Liger that will not run is a baseline's error)."""
    try:
        liger = liger_loss(op)
        return {} if liger is None else {"liger": make(liger)}
    except Exception as exc:  # noqa: BLE001
        return {"liger": _failing(exc)}


def _on_device(bench: Bench):
    """NumPy arrays (the cases' targets) to tensors on the run's device."""
    return lambda a: bench.torch.from_numpy(a).to(bench.device)


def cross_entropy_case(bench: Bench, shape: dict, dtype_name: str) -> None:
    """Cross-entropy forward, backward and both in turn at ``shape`` (``N, V``), against
    ``F.cross_entropy`` and (forward+backward) Liger-Kernel's fused function."""
    torch = bench.torch
    n, v = shape["N"], shape["V"]
    dtype = getattr(torch, dtype_name)
    inputs = cases.cross_entropy_inputs(n, v, bench.random(dtype), _on_device(bench))
    logits, targets = inputs["logits"], inputs["targets"]
    calls = cases.cross_entropy_calls(DeviceArrays(bench, "triton"), inputs)
    lr = logits.detach().requires_grad_()
    baselines = {
        "forward": {TORCH_CROSS_ENTROPY: lambda: cases.torch_cross_entropy(logits, targets)},
        "backward": {
            TORCH_CROSS_ENTROPY: _grad(torch, cases.torch_cross_entropy(lr, targets), lr, None)
        },
        "fwd+bwd": {
            TORCH_CROSS_ENTROPY: lambda: torch.autograd.grad(
                cases.torch_cross_entropy(lr, targets), lr
            )
        },
    }

    def liger_step(liger):
        # Liger's forward writes the gradient over its input: logits of its own
        ll = logits.detach().clone().requires_grad_()
        return lambda: torch.autograd.grad(liger_value(liger(ll, targets)), ll)

    baselines["fwd+bwd"].update(_liger_baseline("cross_entropy", liger_step))

    def step():
        calls.forward()
        calls.backward()

    s = torch.finfo(dtype).bits // 8
    for pass_, kernel in (
        ("forward", calls.forward),
        ("backward", calls.backward),
        ("fwd+bwd", step),
    ):
        amount, formula = cases.cross_entropy_work(pass_, n, v, s)
        entry = Entry(
            "cross_entropy",
            "cross_entropy",
            pass_,
            dtype_name,
            (n, v),
            "GB/s",
            formula,
            amount,
            "copy",
        )
        bench.run(entry, kernel, baselines[pass_])


def three_products(bench: Bench, x, weight):
    """The products linear cross-entropy's composition needs, as one call into buffers
    allocated once: ``Z = x @ W.T``, then ``dx = Z @ W`` and ``dW = Z^T @ x`` (``Z`` standing
    for the logits' gradient, of the same shape)."""
    torch = bench.torch
    z = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    dx, dweight = torch.empty_like(x), torch.empty_like(weight)

    def call():
        torch.matmul(x, weight.T, out=z)
        torch.matmul(z, weight, out=dx)
        torch.matmul(z.T, x, out=dweight)

    return call


def linear_cross_entropy_case(bench: Bench, shape: dict, dtype_name: str) -> None:
    """Linear cross-entropy at ``shape`` (``N, H, V``): the forward then the backward
    (``fwd+bwd``, four products) and the fused forward given Duplicated ``x`` and ``W``
    (``fused``, three), each against the composition ``F.cross_entropy(x @ W.T, t)`` and its
    three products alone (the forward+backward also against Liger-Kernel's fused function,
    the fused one against our forward+backward); then the peak memory of each (beyond its
    inputs and gradients)."""
    torch = bench.torch
    n, h, v = shape["N"], shape["H"], shape["V"]
    dtype = getattr(torch, dtype_name)
    inputs = cases.linear_cross_entropy_inputs(n, h, v, bench.random(dtype), _on_device(bench))
    x, weight, targets = (inputs[name] for name in ("x", "weight", "targets"))
    arrays = DeviceArrays(bench, "triton")
    calls = cases.linear_cross_entropy_calls(arrays, inputs)
    xr, wr = (t.detach().requires_grad_() for t in (x, weight))

    def composition():
        return torch.autograd.grad(cases.torch_linear_cross_entropy(xr, wr, targets), (xr, wr))

    def liger_step(liger):
        xl, wl = (t.detach().requires_grad_() for t in (x, weight))
        return lambda: torch.autograd.grad(liger_value(liger(xl, wl, targets)), (xl, wl))

    liger = _liger_baseline("linear_cross_entropy", liger_step)

    def step():
        calls.forward()
        calls.backward()

    amount, formula = cases.linear_cross_entropy_work("fwd+bwd", n, h, v)
    floors = {"fwd+bwd": "4/3 = 1.33x: its backward forms the logits again", "fused": "1x"}
    products = three_products(bench, x, weight)
    fused = cases.linear_cross_entropy_fused(arrays, inputs)
    for pass_, kernel, ours in (
        ("fwd+bwd", step, {}),
        ("fused", fused, {"xk fwd+bwd": step}),
    ):
        entry = Entry(
            "linear_cross_entropy",
            "linear_cross_entropy",
            pass_,
            dtype_name,
            (n, h, v),
            "TFLOP/s",
            f"{formula}; target: at most 1.1x the time of the {PRODUCTS} (the issue's); "
            f"design floor {floors[pass_]}",
            amount,
            "matmul",
        )
        theirs = {TORCH_LINEAR_CROSS_ENTROPY: composition, PRODUCTS: products}
        bench.run(entry, kernel, {**theirs, **ours, **(liger if pass_ == "fwd+bwd" else {})})
    dx, dweight = torch.empty_like(x), torch.empty_like(weight)
    memory = Entry(
        "linear_cross_entropy",
        "linear_cross_entropy",
        "peak memory",
        dtype_name,
        (n, h, v),
        "MiB",
        "peak bytes allocated beyond the inputs and the gradients dx, dW (xpkernels, forward "
        "then backward: its checkpoints, scratch at the default chunk and loss allocated in "
        "the step, dx and dW before it; xk fused likewise; the baselines: the gradients they "
        "return not counted)",
        0.0,
        "-",
    )
    bench.peak_memory(
        memory,
        lambda: cases.linear_cross_entropy_step(arrays, inputs, dx, dweight),
        {
            "xk fused": lambda: cases.linear_cross_entropy_fused(arrays, inputs, dx, dweight)(),
            TORCH_LINEAR_CROSS_ENTROPY: composition,
            **liger,
        },
    )


def attention_section(bench: Bench) -> None:
    shape = cases.GPU_SHAPES[bench.dry]["attention"]
    for D in shape["D"]:
        for causal in (False, True):
            attention_case(bench, shape["B"], shape["H"], shape["S"], D, causal)
        bench.free()


def attention_case(bench: Bench, B: int, H: int, S: int, D: int, causal: bool) -> None:
    """Attention forward and backward, bfloat16, ``(B, H, S, D)``."""
    import torch.nn.functional as F

    torch = bench.torch
    inputs = cases.attention_inputs(B, H, S, D, bench.random(torch.bfloat16))
    q, k, v, do = inputs
    calls = cases.attention_calls(DeviceArrays(bench, "triton"), inputs, causal)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    name = "attention-causal" if causal else "attention"
    for pass_, kernel, baseline in (
        (
            "forward",
            calls.forward,
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        ),
        ("backward", calls.backward, _grad(torch, out, (qr, kr, vr), do)),
    ):
        flops, formula = cases.attention_work(B, H, S, D, causal, pass_)
        entry = Entry(
            "attention", name, pass_, "bfloat16", (B, H, S, D), "TFLOP/s", formula, flops, "matmul"
        )
        bench.run(entry, kernel, {"F.sdpa": baseline})


def hf_section(bench: Bench) -> None:
    """A transformers Llama layer (``GPU_SHAPES["hf_llama"]``: 1B-shaped, seq 4096) in bfloat16,
    forward and ``loss.backward()``: ``apply_xpkernels`` against the same model on SDPA and, where
    installed, on Liger-Kernel (``apply_liger_kernel_to_llama``, applied last: it patches the
    model classes). TFLOP/s, tokens/s and peak memory of each (peak memory on CUDA only)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        bench.sections_skipped["transformers"] = (
            "transformers is not installed (carry its wheels: bench/README.md)"
        )
        return
    from transformers import LlamaForCausalLM

    from xpkernels.torch.transformers import apply_xpkernels

    torch = bench.torch
    shape = cases.GPU_SHAPES[bench.dry]["hf_llama"]
    tokens = shape["B"] * shape["S"]
    ids = torch.randint(0, 1024, (shape["B"], shape["S"]), device=bench.device)
    peaks: dict[str, float] = {}

    def step(name, prepare=None):
        if prepare is not None:
            prepare()
        torch.manual_seed(0)
        model = LlamaForCausalLM(cases.hf_llama_config(shape))
        model = model.to(device=bench.device, dtype=torch.bfloat16)
        if name == "xpkernels":
            apply_xpkernels(model)

        def run():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

        if not bench.dry:
            run()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        return run

    def liger():
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()

    parameters = sum(p.numel() for p in LlamaForCausalLM(cases.hf_llama_config(shape)).parameters())
    work, formula = cases.hf_llama_work(shape, parameters)
    size = (shape["B"], shape["S"], shape["hidden"])
    entry = Entry(
        "transformers",
        "llama-layer",
        "fwd+bwd",
        "bfloat16",
        size,
        "TFLOP/s",
        formula,
        work,
        "matmul",
    )
    baselines = {"sdpa": step("sdpa")}
    if importlib.util.find_spec("liger_kernel") is not None:
        baselines["liger"] = step("liger", liger)
    bench.run(entry, step("xpkernels"), baselines)
    if entry.ms:
        entry.notes["tokens/s"] = tokens / (entry.ms * 1e-3)
    entry.notes.update({f"{name} peak GiB": gib for name, gib in peaks.items()})
    print("    " + ", ".join(f"{name} {value:.4g}" for name, value in entry.notes.items()))
    bench.free()


def flex_section(bench: Bench, compiler: CompileBudget) -> None:
    shape = cases.GPU_SHAPES[bench.dry]["flex"]
    for D in shape["D"]:
        for mods in cases.FLEX_MODS:
            flex_case(bench, compiler, shape["B"], shape["H"], shape["S"], D, mods)
        bench.free()


def flex_case(bench: Bench, compiler: CompileBudget, B, H, S, D, name) -> None:
    """FlexAttention forward and backward with the mods ``name`` declares
    (:func:`xpkernels.cli.bench_work.flex_mods`), bfloat16, ``(B, H, S, D)``."""
    torch = bench.torch
    documents = cases.GPU_SHAPES[bench.dry]["flex"]["documents"]
    mods = cases.flex_mods(name, S, documents)
    arrays = DeviceArrays(bench, "triton")
    inputs = cases.attention_inputs(B, H, S, D, bench.random(torch.bfloat16))
    calls = cases.flex_calls(arrays, inputs, cases.xpk_mods(mods, arrays, H))
    baseline = _torch_flex(bench, compiler, *inputs, *cases.torch_mods(mods, H, bench.device))
    ours = None if mods.attention is None else cases.attention_calls(arrays, inputs, mods.attention)
    # score-mod gradients: the default (deterministic partial rows), against float32 atomics
    # and against the same backward computing no score-mod gradients
    others = {}
    if mods.score is not None and calls.backward_with is not None:
        others = {
            "xk atomics": calls.backward_with(deterministic=False),
            "xk no score grads": calls.backward_with(score_mod_grad=None),
        }
    for pass_, kernel, extra in (
        ("forward", calls.forward, {}),
        ("backward", calls.backward, others),
    ):
        flops, formula = cases.flex_work(B, H, S, D, mods.mask, pass_)
        entry = Entry(
            "flex",
            f"flex-{name}",
            pass_,
            "bfloat16",
            (B, H, S, D),
            "TFLOP/s",
            formula,
            flops,
            "matmul",
        )
        theirs = {
            "torch flex (compiled)": baseline.get(pass_),
            "xk attention": None if ours is None else getattr(ours, pass_),
            **extra,
        }
        bench.run(entry, kernel, theirs)


def _torch_flex(bench, compiler, q, k, v, do, score, mask) -> dict:
    """PyTorch's compiled ``flex_attention`` forward and backward (empty past the budget)."""
    torch = bench.torch
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return {}
    B, H, S, _ = q.shape
    block = None
    if mask is not None:
        block = create_block_mask(mask, None, None, S, S, device=bench.device)
    forward = compiler.compiled(
        lambda q, k, v: flex_attention(q, k, v, score_mod=score, block_mask=block), q, k, v
    )
    if forward is None:
        return {}
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out = forward(qr, kr, vr)
    return {
        "forward": lambda: forward(q, k, v),
        "backward": lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True),
    }


def decode_section(bench: Bench) -> None:
    """Decode attention, bfloat16, every cache full; then the same cache in pages."""
    import torch.nn.functional as F

    torch = bench.torch
    shape = cases.GPU_SHAPES[bench.dry]["decode"]
    B, H, Hkv, S, D = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    q, k_cache, v_cache = cases.decode_inputs(B, H, Hkv, S, D, bench.random(torch.bfloat16))
    calls = cases.decode_call(DeviceArrays(bench, "triton"), q, k_cache, v_cache, S)
    amount, formula = cases.decode_work(B, H, Hkv, S, D, 2)
    bench.run(
        Entry(
            "decode",
            "decode_attention",
            "forward",
            "bfloat16",
            (B, H, Hkv, S, D),
            "GB/s",
            formula,
            amount,
            "copy",
        ),
        calls.forward,
        {
            "F.sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(
                q[:, :, None, :], k_cache, v_cache, enable_gqa=True
            )
        },
    )
    print(f"  decode n_splits = {calls.scratch.o_partial.shape[2]}", flush=True)
    paged_decode_case(bench, q, k_cache, v_cache, calls)


def paged_decode_case(bench: Bench, q, k_cache, v_cache, contiguous: cases.Calls) -> None:
    """The decode cache in shuffled ``PAGE_SIZE``-key pages, read through a block table."""
    import torch.nn.functional as F

    torch = bench.torch
    page = cases.PAGE_SIZE
    B, Hkv, S, D = k_cache.shape
    order = torch.randperm(B * S // page, device=bench.device)
    table, k_pages, v_pages = cases.paged_cache(k_cache, v_cache, order, page)
    calls = cases.decode_call(
        DeviceArrays(bench, "triton"), q, k_pages, v_pages, S, block_table=table
    )
    amount, formula = cases.decode_work(B, q.shape[1], Hkv, S, D, 2, page)

    def gathered_sdpa():
        k, v = (
            pages[table.long()].transpose(1, 2).reshape(B, Hkv, S, D)
            for pages in (k_pages, v_pages)
        )
        return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

    bench.run(
        Entry(
            "paged",
            f"decode_attention-paged{page}",
            "forward",
            "bfloat16",
            (B, q.shape[1], Hkv, S, D),
            "GB/s",
            formula,
            amount,
            "copy",
        ),
        calls.forward,
        {"gather+F.sdpa": gathered_sdpa, "xpkernels contiguous": contiguous.forward},
    )
    print(f"  paged decode n_splits = {calls.scratch.o_partial.shape[2]}", flush=True)


class CupyViews:
    """The cupy backend's arrays over torch tensors, and the context its calls run in.

    On a GPU: zero-copy CuPy views (``cupy.from_dlpack``) of the CUDA tensors. In a dry run:
    NumPy views of the CPU tensors, served by the same launchers and ``.cu`` files through
    :mod:`xpkernels.testing.cudacpu` (every call runs inside ``cudacpu.emulate()``).
    """

    def __init__(self, bench: Bench):
        self.dry = bench.dry
        self.context: Callable[[], contextlib.AbstractContextManager]
        if self.dry:
            from xpkernels.testing import cudacpu

            self.context = cudacpu.emulate
        else:
            import cupy

            self.context = contextlib.nullcontext
            self.cupy = cupy

    def __call__(self, t):
        return t.numpy() if self.dry else self.cupy.from_dlpack(t)

    def call(self, fn):
        """``fn`` run in the backend's context (``cudacpu.emulate()`` in a dry run)."""

        def run():
            with self.context():
                fn()

        return run


def cupy_section(bench: Bench) -> None:
    """Every primitive on the cupy backend, float16 (the dtype CuPy arrays hold natively), next
    to the same call on the triton backend and PyTorch's op (``GPU_SHAPES``' ``cupy`` shapes
    and the decode shape)."""
    try:
        views = CupyViews(bench)
    except ImportError as exc:
        bench.sections_skipped["cupy"] = f"{type(exc).__name__}: {exc}"
        print(f"  skipped: {exc}", flush=True)
        return
    shapes = cases.GPU_SHAPES[bench.dry]
    rows, m = shapes["cupy"]["rows"]
    inputs = cases.row_inputs(rows, m, bench.random(bench.torch.float16))
    for op in cases.ROW_OPS:
        cupy_row_op_case(bench, views, op, inputs)
    bench.free()
    inputs = cases.gated_inputs(rows, m, bench.random(bench.torch.float16))
    for op in cases.GATED_OPS:
        for name, options in cases.GATED_CASES[op]:
            cupy_gated_case(bench, views, op, name, options, inputs)
    bench.free()
    cupy_rope_case(bench, views, shapes["rope"])
    bench.free()
    a = shapes["cupy"]["attention"]
    for causal in (False, True):
        cupy_attention_case(bench, views, a["B"], a["H"], a["S"], a["D"], causal)
    cupy_attention_case(bench, views, a["B"], a["H"], a["S"], a["D"], True, flex=True)
    bench.free()
    d = shapes["decode"]
    cupy_decode_case(bench, views, *(d[n] for n in ("B", "H", "Hkv", "S", "D")))
    bench.free()


def _cupy_entry(op, pass_, shape, unit, formula, amount, ceiling) -> Entry:
    return Entry("cupy", f"cupy {op}", pass_, "float16", shape, unit, formula, amount, ceiling)


def _both_backends(bench: Bench, views: CupyViews, build):
    """``build(arrays)`` -- the :class:`~xpkernels.cli.bench_work.Calls` of one case -- on the
    cupy backend's views (set up in its context, each call run in it) and on the triton
    backend's tensors."""
    with views.context():
        ours = build(DeviceArrays(bench, "cupy", views))
    theirs = build(DeviceArrays(bench, "triton"))
    passes = {"forward": (views.call(ours.forward), theirs.forward)}
    if ours.backward is not None:
        passes["backward"] = (views.call(ours.backward), theirs.backward)
    return passes


def cupy_row_op_case(bench: Bench, views: CupyViews, op: str, inputs) -> None:
    """Row primitive ``op`` on ``(rows, m)`` float16 ``inputs``, forward and backward."""
    torch = bench.torch
    x, dy, w, b = (inputs[n] for n in ("x", "dy", "w", "b"))
    rows, m = x.shape
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    wanted = (xr, *(t for n, t in (("w", wr), ("b", br)) if n in cases.ROW_PARAMS[op]))
    torch_op = cases.torch_row_op(op, m)
    torch_calls = {
        "forward": lambda: torch_op(x, w, b),
        "backward": _grad(torch, torch_op(xr, wr, br), wanted, dy),
    }
    passes = _both_backends(bench, views, lambda arrays: cases.row_calls(op, arrays, inputs))
    for pass_, (ours, triton_call) in passes.items():
        amount, formula = cases.row_work(op, pass_, rows, m, 2)
        bench.run(
            _cupy_entry(op, pass_, (rows, m), "GB/s", formula, amount, "copy"),
            ours,
            {"xk triton": triton_call, f"torch {op}": torch_calls[pass_]},
        )


def cupy_gated_case(bench: Bench, views: CupyViews, op: str, name: str, options: dict, inputs):
    """Gated activation ``op`` with ``options`` (the entries named ``name``) on ``(rows, m)``
    float16 ``inputs``, forward and backward."""
    torch = bench.torch
    a, b, dy = (inputs[n] for n in ("a", "b", "dy"))
    rows, m = a.shape
    ar, br = (t.detach().requires_grad_() for t in (a, b))
    torch_op = cases.torch_gated_op(op, options)
    torch_calls = {
        "forward": lambda: torch_op(a, b),
        "backward": _grad(torch, torch_op(ar, br), (ar, br), dy),
    }
    passes = _both_backends(
        bench, views, lambda arrays: cases.gated_calls(op, arrays, inputs, options)
    )
    for pass_, (ours, triton_call) in passes.items():
        amount, formula = cases.row_work(op, pass_, rows, m, 2)
        bench.run(
            _cupy_entry(name, pass_, (rows, m), "GB/s", formula, amount, "copy"),
            ours,
            {"xk triton": triton_call, f"torch {name}": torch_calls[pass_]},
        )


def cupy_rope_case(bench: Bench, views: CupyViews, shape: dict) -> None:
    """RoPE at ``shape``, float16, forward and backward."""
    inputs = rope_tensors(bench, shape, "float16")
    eager = torch_rope_calls(bench, inputs)
    passes = _both_backends(bench, views, lambda arrays: cases.rope_calls(arrays, inputs))
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    for pass_, (ours, triton_call) in passes.items():
        amount, formula = cases.rope_work(pass_, b, h, hkv, s, d, 2, 2)
        bench.run(
            _cupy_entry("rope", pass_, (b, h, hkv, s, d), "GB/s", formula, amount, "copy"),
            ours,
            {"xk triton": triton_call, "torch rope": eager[pass_]},
        )


def cupy_attention_case(
    bench: Bench, views: CupyViews, B, H, S, D, causal: bool, flex: bool = False
) -> None:
    """Attention forward and backward, float16, ``(B, H, S, D)``; with ``flex``, FlexAttention
    with ``CausalMask`` as its mask mod (``causal`` must be True)."""
    import torch.nn.functional as F

    torch = bench.torch
    inputs = cases.attention_inputs(B, H, S, D, bench.random(torch.float16))
    q, k, v, do = inputs

    def build(arrays):
        if flex:
            mods = cases.xpk_mods(cases.flex_mods("causal", S), arrays, H)
            return cases.flex_calls(arrays, inputs, mods)
        return cases.attention_calls(arrays, inputs, causal)

    passes = _both_backends(bench, views, build)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    name = "flex-causal" if flex else "attention-causal" if causal else "attention"
    torch_calls = {
        "forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "backward": _grad(torch, out, (qr, kr, vr), do),
    }
    for pass_, (ours, triton_call) in passes.items():
        flops, formula = cases.attention_work(B, H, S, D, causal, pass_)
        bench.run(
            _cupy_entry(name, pass_, (B, H, S, D), "TFLOP/s", formula, flops, "matmul"),
            ours,
            {"xk triton": triton_call, "F.sdpa": torch_calls[pass_]},
        )


def cupy_decode_case(bench: Bench, views: CupyViews, B, H, Hkv, S, D) -> None:
    """Decode attention, float16, every cache full."""
    import torch.nn.functional as F

    torch = bench.torch
    q, k_cache, v_cache = cases.decode_inputs(B, H, Hkv, S, D, bench.random(torch.float16))
    passes = _both_backends(
        bench, views, lambda arrays: cases.decode_call(arrays, q, k_cache, v_cache, S)
    )
    ours, triton_call = passes["forward"]
    amount, formula = cases.decode_work(B, H, Hkv, S, D, 2)
    bench.run(
        _cupy_entry(
            "decode_attention", "forward", (B, H, Hkv, S, D), "GB/s", formula, amount, "copy"
        ),
        ours,
        {
            "xk triton": triton_call,
            "F.sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(
                q[:, :, None, :], k_cache, v_cache, enable_gqa=True
            ),
        },
    )


#: DESIGN section 8 targets (RoPE's: its issue's), (section, pass) -> minimum share of the copy
#: bandwidth (%).
BANDWIDTH_TARGETS = {
    ("rows", "forward"): 90.0,
    ("rows", "backward"): 80.0,
    ("decode", "forward"): 85.0,
    ("rope", "forward"): 85.0,
    ("rope", "backward"): 85.0,
    ("paged", "forward"): 80.0,
}
#: Attention targets, bfloat16 at head dim 128 without a mask: pass -> minimum TFLOP/s.
ATTENTION_TARGETS = {"forward": 500.0, "backward": 300.0}
#: The cupy backend against the triton backend on the same call (DESIGN section 8): at most 1.25x
#: slower, every entry of the cupy section.
CUPY_TARGET = ("xk triton", 1 / 1.25)
#: Flex targets (issue 10), each pass: op -> (baseline, minimum speed relative to it).
FLEX_TARGETS = {
    "flex-nomod": ("xk attention", 1 / 1.1),
    "flex-causal": ("torch flex (compiled)", 1.0),
    "flex-sliding256": ("torch flex (compiled)", 1.0),
}
#: Linear cross-entropy's targets (its issue's), (section, pass) -> (baseline, limit): its
#: forward+backward at most 1.1x the time of the composition's three products (a minimum
#: speed of 1 / 1.1 relative to them; the forward then the backward form the logits twice,
#: four products against three, a floor near 1.33x; the fused forward does three), and its
#: peak memory at most 1/10 of the composition's (``peak memory``: the most ours may be of
#: the baseline's).
LOSS_TARGETS = {
    ("linear_cross_entropy", "fwd+bwd"): (PRODUCTS, 1 / 1.1),
    ("linear_cross_entropy", "fused"): (PRODUCTS, 1 / 1.1),
    ("linear_cross_entropy", "peak memory"): (TORCH_LINEAR_CROSS_ENTROPY, 0.1),
}


def target_of(e: Entry) -> tuple[str, float] | None:
    """``("%copy", "TFLOP/s" or "x <baseline>", minimum)`` set for ``e``, ``("peak x
    <baseline>", maximum)`` for a peak-memory entry, or None."""
    if (e.section, e.pass_) in LOSS_TARGETS:
        baseline, limit = LOSS_TARGETS[(e.section, e.pass_)]
        return f"{'peak ' if e.unit == 'MiB' else ''}x {baseline}", limit
    if e.op in FLEX_TARGETS:
        baseline, minimum = FLEX_TARGETS[e.op]
        return f"x {baseline}", minimum
    if e.section == "cupy":
        baseline, minimum = CUPY_TARGET
        return f"x {baseline}", minimum
    if (e.section, e.pass_) in BANDWIDTH_TARGETS:
        return "%copy", BANDWIDTH_TARGETS[(e.section, e.pass_)]
    if e.op == "attention" and e.dtype == "bfloat16" and e.shape[-1] == 128:
        return "TFLOP/s", ATTENTION_TARGETS[e.pass_]
    return None


def verdict(e: Entry, dry: bool) -> str:
    """PASS / FAIL against :func:`target_of`; ``-`` without a target, ``dry`` in a dry run."""
    target = target_of(e)
    if e.error:
        return "ERROR"
    if target is None:
        return "-"
    if dry:
        return "dry"
    kind, minimum = target
    if kind.startswith("peak x "):
        theirs = e.notes.get(f"{kind[len('peak x ') :]} peak MiB")
        if not theirs or e.rate is None:
            return "no baseline"
        return "PASS" if e.rate <= minimum * theirs else "FAIL"
    if kind.startswith("x "):
        base = e.baselines.get(kind[2:], {})
        if "rate" not in base or not e.rate:
            return "no baseline"
        value = e.rate / base["rate"]
    else:
        value = e.pct_of_ceiling if kind == "%copy" else e.rate
    return "PASS" if value is not None and value >= minimum else "FAIL"


def _speedup(e: Entry, name: str | None) -> str:
    """Our speed over baseline ``name`` (above 1: faster), or ``-``."""
    b = e.baselines.get(name) if name else None
    if not b or "rate" not in b or not e.rate:
        return "-"
    return f"{e.rate / b['rate']:.2f}x"


def _target_text(target: tuple[str, float]) -> str:
    """``>= 90 %copy``, ``>= 0.909 x 3 products``; a peak-memory limit ``peak <= 0.1 x
    <baseline>``."""
    kind, limit = target
    if kind.startswith("peak "):
        return f"peak <= {limit:.3g} {kind[len('peak ') :]}"
    return f">= {limit:.3g} {kind}"


def summary_rows(entries: list[Entry], dry: bool) -> list[dict]:
    """One row per entry: its figure, the share of its ceiling, speed-ups over PyTorch's op, over
    ``torch.compile`` (Liger-style fused PyTorch) and over the xpkernels kernel it is compared
    with (flex: our attention; cupy: our triton), and the verdict against its target."""
    rows = []
    for e in entries:
        eager = next((n for n in e.baselines if n != "torch.compile" and n[:3] != "xk "), None)
        ours = next((n for n in e.baselines if n[:3] == "xk "), None)
        target = target_of(e)
        rows.append(
            {
                "op": e.op,
                "pass": e.pass_,
                "dtype": e.dtype,
                "shape": "x".join(str(n) for n in e.shape),
                "rate": "-" if e.rate is None else f"{e.rate:.1f} {e.unit}",
                "ceiling": "-"
                if e.pct_of_ceiling is None
                else f"{e.pct_of_ceiling:.0f}% {e.ceiling}",
                "vs_torch": _speedup(e, eager),
                "torch_op": eager or "-",
                "vs_compile": _speedup(e, "torch.compile"),
                "vs_xk": "-" if ours is None else f"{_speedup(e, ours)} {ours[3:]}",
                "target": "-" if target is None else _target_text(target),
                "verdict": verdict(e, dry),
            }
        )
    return rows


def format_summary(rows: list[dict]) -> str:
    """The summary as one aligned table (a screen: one line per entry)."""
    columns = [
        ("op", "op"),
        ("pass", "pass"),
        ("dtype", "dtype"),
        ("shape", "shape"),
        ("rate", "rate"),
        ("ceiling", "of ceiling"),
        ("vs_torch", "vs torch op"),
        ("vs_compile", "vs compile"),
        ("vs_xk", "vs our other kernel"),
        ("target", "target"),
        ("verdict", ""),
    ]
    table = [[title for _, title in columns]] + [[r[key] for key, _ in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    verdicts = [r["verdict"] for r in rows]
    lines.append(
        f"targets: {verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL"
        + (f", {verdicts.count('ERROR')} ERROR" if "ERROR" in verdicts else "")
        + (" (dry run: nothing judged)" if "dry" in verdicts else "")
        + "; speed-ups above 1 are faster than the baseline"
    )
    return "\n".join(lines)


def environment(bench: Bench) -> dict:
    torch = bench.torch
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": bench.dry,
        "device": "cpu (dry run)" if bench.dry else torch.cuda.get_device_name(),
    }
    if not bench.dry:
        props = torch.cuda.get_device_properties(0)
        env.update(
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    return env


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu.json (required unless --summary)")
    parser.add_argument(
        "--summary",
        metavar="GPU_JSON",
        help="print the summary table of a gpu.json written by an earlier run, and exit",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU tensors, tiny shapes, Triton interpreter: checks this script "
        "and measures nothing",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=240.0,
        help="seconds after which the remaining entries are skipped (a failure)",
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=60.0,
        help="seconds of torch.compile for the norm baselines; then none",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.summary is None:
        parser.error("--out is required (or --summary GPU_JSON)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            report = json.load(f)
        print(f"summary of {args.summary} ({report['environment']['device']}):")
        print(format_summary(report["summary"]))
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device; use --dry-run to check the script on CPU",
            file=sys.stderr,
        )
        return 2
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    bench = Bench(args)
    started = time.monotonic()
    measure_ceilings(bench)
    compiler = CompileBudget(bench)
    print("norms and softmax (GB/s; baselines: their GB/s and our speed-up):", flush=True)
    norm_sections(bench, compiler)
    print("attention (TFLOP/s):", flush=True)
    attention_section(bench)
    print("decode attention (GB/s):", flush=True)
    decode_section(bench)
    bench.free()
    print("flex attention (TFLOP/s):", flush=True)
    flex_section(bench, compiler)
    bench.free()
    print("SwiGLU and GeGLU (GB/s; baselines: the PyTorch composition, Liger-Kernel):", flush=True)
    gated_section(bench)
    print("RoPE (GB/s; baselines: the eager composition, Liger-Kernel):", flush=True)
    rope_section(bench)
    print(
        "cross-entropy (GB/s) and linear cross-entropy (TFLOP/s, peak MiB; baselines: the "
        "PyTorch composition, Liger-Kernel):",
        flush=True,
    )
    loss_section(bench)
    print("cupy backend (CUDA C; baselines: the triton backend and PyTorch's op):", flush=True)
    cupy_section(bench)
    print("transformers Llama layer (TFLOP/s, tokens/s, peak memory):", flush=True)
    hf_section(bench)
    failed = [e for e in bench.entries if e.error]
    summary = summary_rows(bench.entries, bench.dry)
    print("\nsummary (DESIGN section 8 targets):")
    print(format_summary(summary), flush=True)
    for name, why in bench.sections_skipped.items():
        print(f"section {name} not run: {why}", flush=True)
    report = {
        "environment": environment(bench),
        "ceilings": bench.ceilings,
        "ceiling_formulas": bench.ceiling_formulas,
        "torch_compile_seconds": round(compiler.spent, 1),
        "seconds": round(time.monotonic() - started, 1),
        "entries": [asdict(e) for e in bench.entries],
        "failed": [f"{e.op} {e.pass_} {e.dtype} {e.shape}" for e in failed],
        "sections_skipped": bench.sections_skipped,
        "summary": summary,
    }
    path = os.path.join(args.out, "gpu.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"wrote {path} ({len(bench.entries)} entries, {len(failed)} failed, {report['seconds']} s)",
        flush=True,
    )
    for e in failed:
        print(f"FAILED {e.op} {e.pass_} {e.dtype} {e.shape}:\n{e.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
