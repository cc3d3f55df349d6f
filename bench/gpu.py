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
   ``(H, 257)`` (causal): TFLOP/s counted as attention's (halved for causal,
   ALiBi and the table, the kept fraction for window and documents), next to
   PyTorch's ``flex_attention`` compiled with its ``create_block_mask`` (while
   the compile budget lasts) and to xpkernels' attention kernel; the
   backwards with score-mod gradients (ALiBi, the table: deterministic, the
   default) also next to the same call with ``deterministic=False`` (float32
   atomics) and to the same call computing no score-mod gradients;
6. the cupy backend (CUDA C through ``cupy.RawModule``) on CuPy views of the same
   CUDA tensors, float16: the norms and softmax at ``(32768, 4096)``, attention
   at ``D=128`` causal and not, FlexAttention with a causal mask mod at the same
   shape, decode attention, next to the same call on the
   triton backend (target: at most 1.25x slower) and to PyTorch's op. In a dry
   run these calls run the same ``.cu`` on NumPy views through
   ``xpkernels.testing.cudacpu``.

Every xpkernels call is made through the public in-place functions with
``backend="triton"`` (``"cupy"`` in section 6) and preallocated buffers (checkpoints, scratch), so a
timing is the kernels alone. Writes ``gpu.json`` into ``--out`` and prints a
table. An entry that raises is recorded with its traceback and the run goes
on; the exit status is 1 if any entry failed or was skipped for time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field


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


def norm_sections(bench: Bench, compiler: CompileBudget) -> None:
    shapes = [(64, 256), (8, 2048)] if bench.dry else [(32768, 4096), (4096, 65536)]
    for rows, m in shapes:
        for dtype_name in ("bfloat16", "float32"):
            rows_case(bench, compiler, rows, m, dtype_name)
            bench.free()


def rows_case(bench: Bench, compiler: CompileBudget, rows: int, m: int, dtype_name: str) -> None:
    """RMSNorm, LayerNorm and softmax, forward and backward, on ``(rows, m)`` inputs."""
    import torch.nn.functional as F

    import xpkernels as xk
    from xpkernels import Duplicated

    torch = bench.torch
    eps = 1e-6
    dtype = getattr(torch, dtype_name)
    s = torch.finfo(dtype).bits // 8
    x = torch.randn(rows, m, dtype=dtype, device=bench.device)
    w = torch.randn(m, dtype=dtype, device=bench.device)
    bias = torch.randn(m, dtype=dtype, device=bench.device)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    X, W, B = (Duplicated(t, torch.empty_like(t)) for t in (x, w, bias))
    Y = Duplicated(y, dy)
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, bias))
    rmm = rows * m * s

    def entry(op, pass_, formula, amount):
        return Entry("rows", op, pass_, dtype_name, (rows, m), "GB/s", formula, amount, "copy")

    def grad(out, inputs):
        if out is None:
            return None
        return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)

    def call(fn, *args):
        return None if fn is None else (lambda: fn(*args))

    def torch_rms(a, b):
        return F.rms_norm(a, (m,), b, eps=eps)

    ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
    compiled = compiler.compiled(torch_rms, xr, wr)
    bench.run(
        entry(
            "rms_norm",
            "forward",
            "2*R*M*s (x read, y written) + M*s (w) + 4*R (rstd)",
            2 * rmm + m * s + 4 * rows,
        ),
        lambda: xk.rms_norm_(y, x, w, eps=eps, checkpoints=ck, backend="triton"),
        {"F.rms_norm": call(torch_rms, x, w), "torch.compile": call(compiled, x, w)},
    )
    scratch = xk.allocate_scratchspace(xk.rms_norm_backward_, Y, X, W, backend="triton")
    bench.run(
        entry(
            "rms_norm",
            "backward",
            "3*R*M*s (x, dy read, dx written) + 2*M*s (w read, dw written) + 4*R (rstd)",
            3 * rmm + 2 * m * s + 4 * rows,
        ),
        lambda: xk.rms_norm_backward_(Y, X, W, checkpoints=ck, scratch=scratch, backend="triton"),
        {
            "F.rms_norm": grad(torch_rms(xr, wr), (xr, wr)),
            "torch.compile": grad(None if compiled is None else compiled(xr, wr), (xr, wr)),
        },
    )

    def torch_ln(a, b, c):
        return F.layer_norm(a, (m,), b, c, eps=eps)

    ck = xk.allocate_checkpoints(xk.layer_norm_, x, w, bias)
    compiled = compiler.compiled(torch_ln, xr, wr, br)
    bench.run(
        entry(
            "layer_norm",
            "forward",
            "2*R*M*s (x read, y written) + 2*M*s (w, b) + 8*R (mean, rstd)",
            2 * rmm + 2 * m * s + 8 * rows,
        ),
        lambda: xk.layer_norm_(y, x, w, bias, eps=eps, checkpoints=ck, backend="triton"),
        {"F.layer_norm": call(torch_ln, x, w, bias), "torch.compile": call(compiled, x, w, bias)},
    )
    scratch = xk.allocate_scratchspace(xk.layer_norm_backward_, Y, X, W, B, backend="triton")
    bench.run(
        entry(
            "layer_norm",
            "backward",
            "3*R*M*s (x, dy read, dx written) + 3*M*s (w read, dw, db written) + 8*R (mean, rstd)",
            3 * rmm + 3 * m * s + 8 * rows,
        ),
        lambda: xk.layer_norm_backward_(
            Y, X, W, B, checkpoints=ck, scratch=scratch, backend="triton"
        ),
        {
            "F.layer_norm": grad(torch_ln(xr, wr, br), (xr, wr, br)),
            "torch.compile": grad(None if compiled is None else compiled(xr, wr, br), (xr, wr, br)),
        },
    )

    bench.run(
        entry("softmax", "forward", "2*R*M*s (x read, y written)", 2 * rmm),
        lambda: xk.softmax_(y, x, backend="triton"),
        {"torch.softmax": call(torch.softmax, x, -1)},
    )
    xk.softmax_(y, x, backend="triton")
    bench.run(
        entry("softmax", "backward", "3*R*M*s (y, dy read, dx written)", 3 * rmm),
        lambda: xk.softmax_backward_(Y, X, backend="triton"),
        {"torch.softmax": grad(torch.softmax(xr, -1), (xr,))},
    )


def attention_section(bench: Bench) -> None:
    B, H, S = (1, 2, 48) if bench.dry else (4, 32, 4096)
    for D in (16, 32) if bench.dry else (64, 128):
        for causal in (False, True):
            attention_case(bench, B, H, S, D, causal)
        bench.free()


def attention_case(bench: Bench, B: int, H: int, S: int, D: int, causal: bool) -> None:
    """Attention forward and backward, bfloat16, ``(B, H, S, D)``."""
    import torch.nn.functional as F

    import xpkernels as xk
    from xpkernels import Duplicated

    torch = bench.torch
    q, k, v, do = (
        torch.randn(B, H, S, D, dtype=torch.bfloat16, device=bench.device) for _ in range(4)
    )
    o = torch.empty_like(q)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    name = "attention-causal" if causal else "attention"
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    bench.run(
        Entry(
            "attention",
            name,
            "forward",
            "bfloat16",
            (B, H, S, D),
            "TFLOP/s",
            "4*B*H*S*S*D (q k^T and p v), halved when causal",
            flops,
            "matmul",
        ),
        lambda: xk.attention_(o, q, k, v, causal=causal, checkpoints=ck, backend="triton"),
        {"F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)},
    )
    xk.attention_(o, q, k, v, causal=causal, checkpoints=ck, backend="triton")
    O = Duplicated(o, do)
    Q, K, V = (Duplicated(t, torch.empty_like(t)) for t in (q, k, v))
    scratch = xk.allocate_scratchspace(xk.attention_backward_, O, Q, K, V)
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    bench.run(
        Entry(
            "attention",
            name,
            "backward",
            "bfloat16",
            (B, H, S, D),
            "TFLOP/s",
            "2.5 x forward FLOPs (5 matmuls against the forward's 2)",
            2.5 * flops,
            "matmul",
        ),
        lambda: xk.attention_backward_(
            O, Q, K, V, checkpoints=ck, scratch=scratch, causal=causal, backend="triton"
        ),
        {"F.sdpa": lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)},
    )


def flex_section(bench: Bench, compiler: CompileBudget) -> None:
    B, H, S = (1, 2, 48) if bench.dry else (4, 16, 4096)
    for D in (16,) if bench.dry else (64, 128):
        for mods in FLEX_MODS:
            flex_case(bench, compiler, B, H, S, D, mods)
        bench.free()


#: The flex rows' mods (built by :func:`_flex_mods`).
FLEX_MODS = ("nomod", "causal", "sliding256", "document", "alibi", "relpos")


def _flex_mods(name, torch, H, S, device):
    """``(xk score, xk mask, torch score, torch mask, kept fraction, attention causal or None)``."""
    from xpkernels import mods as xm

    window = min(256, S)
    docs = torch.arange(S, device=device) * 4 // S  # four documents of S/4 tokens
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
    if name == "nomod":
        return None, None, None, None, 1.0, False
    if name == "causal":
        return None, xm.CausalMask(), None, (lambda b, h, q, k: k <= q), 0.5, True
    if name == "sliding256":
        kept = min(1.0, (window + 1) / S)
        return (
            None,
            xm.SlidingWindowMask(window),
            None,
            (lambda b, h, q, k: (k <= q) & (q - k <= window)),
            kept,
            None,
        )
    if name == "document":
        return (
            None,
            xm.DocumentMask(docs),
            None,
            (lambda b, h, q, k: docs[q] == docs[k]),
            0.25,
            None,
        )
    if name == "relpos":  # a learned relative-position table: indices repeat inside every tile
        table = torch.linspace(-1.0, 1.0, H * 257, device=device).reshape(H, 257)

        def relative(score, b, h, q_idx, kv_idx, *, table):
            return score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -128), 128) + 128]

        return (
            xm.ScoreMod(relative, table=table),
            xm.CausalMask(),
            (lambda s, b, h, q, k: s + table[h, (q - k).clamp(-128, 128) + 128]),
            (lambda b, h, q, k: k <= q),
            0.5,
            None,
        )
    return (
        xm.AliBiScore(slopes),
        xm.CausalMask(),
        (lambda s, b, h, q, k: s + slopes[h] * (k - q)),
        (lambda b, h, q, k: k <= q),
        0.5,
        None,
    )


def flex_case(bench: Bench, compiler: CompileBudget, B, H, S, D, mods) -> None:
    """FlexAttention forward and backward with ``mods``, bfloat16, ``(B, H, S, D)``."""
    import xpkernels as xk
    from xpkernels import Duplicated

    torch = bench.torch
    score, mask, t_score, t_mask, kept, causal = _flex_mods(mods, torch, H, S, bench.device)
    q, k, v, do = (
        torch.randn(B, H, S, D, dtype=torch.bfloat16, device=bench.device) for _ in range(4)
    )
    o = torch.empty_like(q)
    ck = xk.allocate_checkpoints(xk.flex_attention_, q, k, v)
    options = {"score_mod": score, "mask_mod": mask, "backend": "triton"}
    flops = 4 * B * H * S * S * D * kept
    baseline = _torch_flex(bench, compiler, q, k, v, do, t_score, t_mask)
    ours = {}
    if causal is not None:
        ours = _our_attention(xk, q, k, v, do, causal)
    name = f"flex-{mods}"
    entry = Entry(
        "flex",
        name,
        "forward",
        "bfloat16",
        (B, H, S, D),
        "TFLOP/s",
        "4*B*H*S*S*D x the kept fraction of the score matrix",
        flops,
        "matmul",
    )
    bench.run(
        entry,
        lambda: xk.flex_attention_(o, q, k, v, checkpoints=ck, **options),
        {"torch flex (compiled)": baseline.get("forward"), "xk attention": ours.get("forward")},
    )
    xk.flex_attention_(o, q, k, v, checkpoints=ck, **options)
    O = Duplicated(o, do)
    Q, K, V = (Duplicated(t, torch.empty_like(t)) for t in (q, k, v))
    grads = xk.grad_shadow(score) if score is not None else None
    # sized for the deterministic score-mod gradients (their partial rows), which need the most
    scratch = xk.allocate_scratchspace(
        xk.flex_attention_backward_, O, Q, K, V, score_mod_grad=grads, **options
    )
    # score-mod gradients: the default (deterministic partial rows), against float32 atomics
    # and against the same backward computing no score-mod gradients
    others = {}
    if grads is not None:
        others = {
            "xk atomics": lambda: xk.flex_attention_backward_(
                O,
                Q,
                K,
                V,
                checkpoints=ck,
                scratch=scratch,
                score_mod_grad=grads,
                deterministic=False,
                **options,
            ),
            "xk no score grads": lambda: xk.flex_attention_backward_(
                O, Q, K, V, checkpoints=ck, scratch=scratch, **options
            ),
        }
    bench.run(
        Entry(
            "flex",
            name,
            "backward",
            "bfloat16",
            (B, H, S, D),
            "TFLOP/s",
            "2.5 x forward FLOPs",
            2.5 * flops,
            "matmul",
        ),
        lambda: xk.flex_attention_backward_(
            O, Q, K, V, checkpoints=ck, scratch=scratch, score_mod_grad=grads, **options
        ),
        {
            "torch flex (compiled)": baseline.get("backward"),
            "xk attention": ours.get("backward"),
            **others,
        },
    )


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


def _our_attention(xk, q, k, v, do, causal) -> dict:
    """xpkernels' attention kernel on the same inputs (flex without mods, or causal, against it)."""
    import torch

    from xpkernels import Duplicated

    o = torch.empty_like(q)
    ck = xk.allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, causal=causal, checkpoints=ck, backend="triton")
    O = Duplicated(o, do)
    Q, K, V = (Duplicated(t, torch.empty_like(t)) for t in (q, k, v))
    scratch = xk.allocate_scratchspace(xk.attention_backward_, O, Q, K, V)
    return {
        "forward": lambda: xk.attention_(
            o, q, k, v, causal=causal, checkpoints=ck, backend="triton"
        ),
        "backward": lambda: xk.attention_backward_(
            O, Q, K, V, checkpoints=ck, scratch=scratch, causal=causal, backend="triton"
        ),
    }


def decode_section(bench: Bench) -> None:
    """Decode attention, bfloat16, every cache full."""
    import torch.nn.functional as F

    import xpkernels as xk

    torch = bench.torch
    B, H, Hkv, S, D = (2, 8, 2, 96, 32) if bench.dry else (16, 32, 8, 32768, 128)
    k_cache = torch.randn(B, Hkv, S, D, dtype=torch.bfloat16, device=bench.device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device=bench.device)
    o = torch.empty_like(q)
    lengths = torch.full((B,), S, dtype=torch.int32, device=bench.device)
    scratch = xk.allocate_scratchspace(
        xk.decode_attention_, o, q, k_cache, v_cache, lengths, backend="triton"
    )
    amount = 2 * B * Hkv * S * D * 2 + 2 * B * H * D * 2
    bench.run(
        Entry(
            "decode",
            "decode_attention",
            "forward",
            "bfloat16",
            (B, H, Hkv, S, D),
            "GB/s",
            "2*B*Hkv*S*D*2 (K and V caches read, bf16) + 2*B*H*D*2 (q read, o written)",
            amount,
            "copy",
        ),
        lambda: xk.decode_attention_(
            o, q, k_cache, v_cache, lengths, scratch=scratch, backend="triton"
        ),
        {
            "F.sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(
                q[:, :, None, :], k_cache, v_cache, enable_gqa=True
            )
        },
    )
    print(f"  decode n_splits = {scratch.o_partial.shape[2]}", flush=True)
    paged_decode_case(bench, q, k_cache, v_cache, lengths, scratch)


#: Keys per page of the paged-decode entry (DESIGN section 8: >= 80% of copy at 16).
PAGE_SIZE = 16


def paged_decode_case(bench: Bench, q, k_cache, v_cache, lengths, contiguous_scratch) -> None:
    """The decode cache in shuffled ``PAGE_SIZE``-key pages, read through a block table."""
    import torch.nn.functional as F

    import xpkernels as xk

    torch = bench.torch
    B, Hkv, S, D = k_cache.shape
    pages_per_seq = S // PAGE_SIZE
    table = torch.randperm(B * pages_per_seq, device=bench.device)
    table = table.to(torch.int32).reshape(B, pages_per_seq)
    k_pages, v_pages = (
        torch.empty(B * pages_per_seq, Hkv, PAGE_SIZE, D, dtype=c.dtype, device=bench.device)
        for c in (k_cache, v_cache)
    )
    for pages, cache in ((k_pages, k_cache), (v_pages, v_cache)):
        # page table[b, j] holds keys j * PAGE_SIZE ... of batch b
        pages[table.long()] = cache.reshape(B, Hkv, pages_per_seq, PAGE_SIZE, D).transpose(1, 2)
    o = torch.empty_like(q)
    scratch = xk.allocate_scratchspace(
        xk.decode_attention_, o, q, k_pages, v_pages, lengths, block_table=table, backend="triton"
    )
    H = q.shape[1]
    amount = 2 * B * Hkv * S * D * 2 + 2 * B * H * D * 2 + B * pages_per_seq * 4

    def gathered_sdpa():
        k, v = (
            pages[table.long()].transpose(1, 2).reshape(B, Hkv, S, D)
            for pages in (k_pages, v_pages)
        )
        return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

    o_contiguous = torch.empty_like(q)
    bench.run(
        Entry(
            "paged",
            "decode_attention-paged16",
            "forward",
            "bfloat16",
            (B, H, Hkv, S, D),
            "GB/s",
            "2*B*Hkv*S*D*2 (K and V pages read, bf16) + 2*B*H*D*2 (q read, o written) "
            f"+ B*(S/{PAGE_SIZE})*4 (int32 block table); pages of {PAGE_SIZE} keys, "
            "table shuffled",
            amount,
            "copy",
        ),
        lambda: xk.decode_attention_(
            o, q, k_pages, v_pages, lengths, block_table=table, scratch=scratch, backend="triton"
        ),
        {
            "gather+F.sdpa": gathered_sdpa,
            "xpkernels contiguous": lambda: xk.decode_attention_(
                o_contiguous,
                q,
                k_cache,
                v_cache,
                lengths,
                scratch=contiguous_scratch,
                backend="triton",
            ),
        },
    )
    print(f"  paged decode n_splits = {scratch.o_partial.shape[2]}", flush=True)


class CupyViews:
    """The cupy backend's arrays over torch tensors, and the context its calls run in.

    On a GPU: zero-copy CuPy views (``cupy.from_dlpack``) of the CUDA tensors. In a dry run:
    NumPy views of the CPU tensors, served by the same launchers and ``.cu`` files through
    :mod:`xpkernels.testing.cudacpu` (every call runs inside ``cudacpu.emulate()``).
    """

    def __init__(self, bench: Bench):
        self.dry = bench.dry
        if self.dry:
            from xpkernels.testing import cudacpu

            self.context = cudacpu.emulate
        else:
            import contextlib

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
    to the same call on the triton backend and PyTorch's op: the shapes of the sections above."""
    try:
        views = CupyViews(bench)
    except ImportError as exc:
        bench.sections_skipped["cupy"] = f"{type(exc).__name__}: {exc}"
        print(f"  skipped: {exc}", flush=True)
        return
    rows, m = (64, 256) if bench.dry else (32768, 4096)
    cupy_rows_case(bench, views, rows, m)
    bench.free()
    B, H, S = (1, 2, 48) if bench.dry else (4, 32, 4096)
    D = 32 if bench.dry else 128
    for causal in (False, True):
        cupy_attention_case(bench, views, B, H, S, D, causal)
    cupy_attention_case(bench, views, B, H, S, D, True, flex=True)
    bench.free()
    B, H, Hkv, S, D = (2, 8, 2, 96, 32) if bench.dry else (16, 32, 8, 32768, 128)
    cupy_decode_case(bench, views, B, H, Hkv, S, D)
    bench.free()


def _cupy_entry(op, pass_, shape, unit, formula, amount, ceiling) -> Entry:
    return Entry("cupy", f"cupy {op}", pass_, "float16", shape, unit, formula, amount, ceiling)


def _both_backends(views: CupyViews, make):
    """``make(wrap, backend)`` -- the calls (one, or a tuple per pass) on the arrays ``wrap(t)``
    -- set up for cupy (run in its context) and for triton (on the torch tensors)."""
    with views.context():
        ours = make(views, "cupy")
    theirs = make(lambda t: t, "triton")
    if isinstance(ours, tuple):
        return tuple(views.call(f) for f in ours), theirs
    return views.call(ours), theirs


def cupy_rows_case(bench: Bench, views: CupyViews, rows: int, m: int) -> None:
    """RMSNorm, LayerNorm and softmax on ``(rows, m)`` float16, forward and backward."""
    import torch.nn.functional as F

    import xpkernels as xk
    from xpkernels import Duplicated

    torch = bench.torch
    eps = 1e-6
    x, dy, y, dx = (
        torch.randn(rows, m, dtype=torch.float16, device=bench.device) for _ in range(4)
    )
    w, b, dw, db = (torch.randn(m, dtype=torch.float16, device=bench.device) for _ in range(4))
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    rmm = rows * m * 2

    def norm(op, weights):
        forward, backward = getattr(xk, f"{op}_"), getattr(xk, f"{op}_backward_")

        def make(wrap, backend):
            xs, ys, ws = wrap(x), wrap(y), [wrap(t) for t in weights]
            ck = xk.allocate_checkpoints(forward, xs, *ws)
            forward(ys, xs, *ws, eps=eps, checkpoints=ck, backend=backend)
            Y, X = Duplicated(ys, wrap(dy)), Duplicated(xs, wrap(dx))
            W = [Duplicated(t, wrap(g)) for t, g in zip(ws, (dw, db))]
            scratch = xk.allocate_scratchspace(backward, Y, X, *W, backend=backend)
            return (
                lambda: forward(ys, xs, *ws, eps=eps, checkpoints=ck, backend=backend),
                lambda: backward(Y, X, *W, checkpoints=ck, scratch=scratch, backend=backend),
            )

        return make

    def make_softmax(wrap, backend):
        xs, ys = wrap(x), wrap(y)
        xk.softmax_(ys, xs, backend=backend)
        Y, X = Duplicated(ys, wrap(dy)), Duplicated(xs, wrap(dx))
        return (
            lambda: xk.softmax_(ys, xs, backend=backend),
            lambda: xk.softmax_backward_(Y, X, backend=backend),
        )

    def grad(out, inputs):
        return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)

    rms = F.rms_norm(xr, (m,), wr, eps=eps)
    ln = F.layer_norm(xr, (m,), wr, br, eps=eps)
    cases = [
        (
            "rms_norm",
            norm("rms_norm", (w,)),
            ("2*R*M*s (x read, y written) + M*s (w) + 4*R (rstd)", 2 * rmm + m * 2 + 4 * rows),
            ("3*R*M*s + 2*M*s (w read, dw written) + 4*R", 3 * rmm + 2 * m * 2 + 4 * rows),
            lambda: F.rms_norm(x, (m,), w, eps=eps),
            grad(rms, (xr, wr)),
        ),
        (
            "layer_norm",
            norm("layer_norm", (w, b)),
            ("2*R*M*s + 2*M*s (w, b) + 8*R (mean, rstd)", 2 * rmm + 2 * m * 2 + 8 * rows),
            ("3*R*M*s + 3*M*s (w read, dw, db written) + 8*R", 3 * rmm + 3 * m * 2 + 8 * rows),
            lambda: F.layer_norm(x, (m,), w, b, eps=eps),
            grad(ln, (xr, wr, br)),
        ),
        (
            "softmax",
            make_softmax,
            ("2*R*M*s (x read, y written)", 2 * rmm),
            ("3*R*M*s (y, dy read, dx written)", 3 * rmm),
            lambda: torch.softmax(x, -1),
            grad(torch.softmax(xr, -1), (xr,)),
        ),
    ]
    for op, make, fwd_bytes, bwd_bytes, torch_fwd, torch_bwd in cases:
        ours, triton_calls = _both_backends(views, make)
        for i, (pass_, (formula, amount), torch_call) in enumerate(
            (("forward", fwd_bytes, torch_fwd), ("backward", bwd_bytes, torch_bwd))
        ):
            bench.run(
                _cupy_entry(op, pass_, (rows, m), "GB/s", f"s = 2; {formula}", amount, "copy"),
                ours[i],
                {"xk triton": triton_calls[i], f"torch {op}": torch_call},
            )


def cupy_attention_case(
    bench: Bench, views: CupyViews, B, H, S, D, causal: bool, flex: bool = False
) -> None:
    """Attention forward and backward, float16, ``(B, H, S, D)``; with ``flex``, FlexAttention
    with ``CausalMask`` as its mask mod (``causal`` must be True)."""
    import torch.nn.functional as F

    import xpkernels as xk
    from xpkernels import Duplicated
    from xpkernels.mods import CausalMask

    forward, backward = xk.attention_, xk.attention_backward_
    if flex:
        forward, backward = xk.flex_attention_, xk.flex_attention_backward_

    torch = bench.torch
    q, k, v, do, o, dq, dk, dv = (
        torch.randn(B, H, S, D, dtype=torch.float16, device=bench.device) for _ in range(8)
    )
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))

    def make(wrap, backend):
        qs, ks, vs, os_ = wrap(q), wrap(k), wrap(v), wrap(o)
        ck = xk.allocate_checkpoints(forward, qs, ks, vs)
        mods = {"mask_mod": CausalMask()} if flex else {"causal": causal}
        options = {**mods, "checkpoints": ck, "backend": backend}
        forward(os_, qs, ks, vs, **options)
        O = Duplicated(os_, wrap(do))
        Q, K, V = (Duplicated(wrap(t), wrap(g)) for t, g in ((q, dq), (k, dk), (v, dv)))
        scratch = xk.allocate_scratchspace(backward, O, Q, K, V, **mods, backend=backend)
        return (
            lambda: forward(os_, qs, ks, vs, **options),
            lambda: backward(O, Q, K, V, scratch=scratch, **options),
        )

    ours, triton_calls = _both_backends(views, make)
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    name = "flex-causal" if flex else "attention-causal" if causal else "attention"
    passes = (
        ("forward", "4*B*H*S*S*D, halved when causal", flops),
        ("backward", "2.5 x forward FLOPs", 2.5 * flops),
    )
    torch_calls = (
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True),
    )
    for i, (pass_, formula, amount) in enumerate(passes):
        bench.run(
            _cupy_entry(name, pass_, (B, H, S, D), "TFLOP/s", formula, amount, "matmul"),
            ours[i],
            {"xk triton": triton_calls[i], "F.sdpa": torch_calls[i]},
        )


def cupy_decode_case(bench: Bench, views: CupyViews, B, H, Hkv, S, D) -> None:
    """Decode attention, float16, every cache full."""
    import torch.nn.functional as F

    import xpkernels as xk

    torch = bench.torch
    k_cache, v_cache = (
        torch.randn(B, Hkv, S, D, dtype=torch.float16, device=bench.device) for _ in range(2)
    )
    q, o = (torch.randn(B, H, D, dtype=torch.float16, device=bench.device) for _ in range(2))
    lengths = torch.full((B,), S, dtype=torch.int32, device=bench.device)

    def make(wrap, backend):
        arrays = [wrap(t) for t in (o, q, k_cache, v_cache, lengths)]
        scratch = xk.allocate_scratchspace(xk.decode_attention_, *arrays, backend=backend)
        return lambda: xk.decode_attention_(*arrays, scratch=scratch, backend=backend)

    ours, triton_call = _both_backends(views, make)
    bench.run(
        _cupy_entry(
            "decode_attention",
            "forward",
            (B, H, Hkv, S, D),
            "GB/s",
            "2*B*Hkv*S*D*2 (K and V caches read) + 2*B*H*D*2 (q read, o written)",
            2 * B * Hkv * S * D * 2 + 2 * B * H * D * 2,
            "copy",
        ),
        ours,
        {
            "xk triton": triton_call,
            "F.sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(
                q[:, :, None, :], k_cache, v_cache, enable_gqa=True
            ),
        },
    )


#: DESIGN section 8 targets: (section, pass) -> minimum share of the copy bandwidth (%).
BANDWIDTH_TARGETS = {
    ("rows", "forward"): 90.0,
    ("rows", "backward"): 80.0,
    ("decode", "forward"): 85.0,
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


def target_of(e: Entry) -> tuple[str, float] | None:
    """``("%copy", "TFLOP/s" or "x <baseline>", minimum)`` set for ``e``, or None."""
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
                "target": "-" if target is None else f">= {target[1]:.3g} {target[0]}",
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
    print("cupy backend (CUDA C; baselines: the triton backend and PyTorch's op):", flush=True)
    cupy_section(bench)
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
