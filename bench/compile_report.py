"""Offline sm_90 compile report of every Triton kernel (DESIGN section 8).

Runs each launcher of ``backends/triton/`` on storage-less placeholders at the
shapes of the GPU benchmarks, compiles every kernel it would launch for sm_90
with the JIT's own specialisation (see ``bench/_triton_specialize.py``), reads
what the compiler emitted and checks the offline targets of DESIGN section 8:

- ``wgmma``: every ``tl.dot`` of an attention kernel lowers to wgmma;
- ``no_spills``: no local memory, no ``STL``/``LDL`` in the SASS;
- ``tile_loads_16B``: every load of 16-bit tiles of an attention kernel (K, V,
  Q, dO, O) is 128 bits wide in the PTX, and asynchronous (cp.async or TMA)
  when it sits inside a loop;
- ``row_128bit``: every load and store of 16-bit data in a row kernel (norms,
  softmax and their reductions, cross-entropy) is 128 bits wide; a scalar access
  (cross-entropy's target logit) is one element and is left out.

A 16-bit tile access is a TTGIR ``tt.load``/``tt.store`` (or its asynchronous
form) of bfloat16/float16 elements; its PTX instructions are those carrying
the same source position (line, and the lines of the calls it was inlined
through). Each target is ``PASS``, ``FAIL`` or ``-`` (does not
apply). The default tile of each launch table is compiled (the tile a launch
uses when it does not autotune); ``--candidates`` also compiles every tile the
bounded autotuning may pick.

Usage::

    python bench/compile_report.py [--only SUBSTR ...] [--json PATH] [--candidates]
        [--baseline PATH] [--tutorial PATH]

With ``--baseline`` the run exits with status 1 when a kernel in both the run
and the baseline fails a target the baseline passes, or spills more than it
did; targets the baseline lists as failing are printed as known failures.

The reference rows (``tutorial06.*``) compile the fused-attention kernels of
Triton's tutorial 06 (``python/tutorials/06-fused-attention.py`` of
triton-lang/triton) the same way, through the tutorial's own launcher. The
file is not part of this repository or of the Triton wheel: pass its path with
``--tutorial`` (default ``bench/out/06-fused-attention.py`` when present);
without it the reference rows are left out and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import sys
import time
import types

import torch
import triton

# Appended, not prepended: the helper next to this file never shadows an installed module.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import _triton_specialize as spec  # noqa: E402

TARGETS = ("wgmma", "no_spills", "tile_loads_16B", "row_128bit")
BF16, F32 = torch.bfloat16, torch.float32
DEFAULT_TUTORIAL = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "out", "06-fused-attention.py"
)
TUTORIAL_ORIGIN = (
    "excerpt of triton-lang/triton python/tutorials/06-fused-attention.py at commit "
    "003da478d84f5bb0f51b3988cf0ea0bbe60282b7: the block-pointer forward "
    "(_attn_fwd), the backward (_attn_bwd_preprocess, _attn_bwd) and the "
    "_attention launcher; the TMA forward, tests and benchmarks left out"
)
#: The tutorial forward is autotuned; offline there is no timing, so its
#: candidate with the default tile of this project's forward at D=128 is compiled.
TUTORIAL_FORWARD_TILE = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


# ----------------------------------------------------------------------------- launchers


def _attention_forward(D, causal, B=4, H=32, S=4096):
    from xpkernels.backends.triton import attention

    t = spec.tensor
    q, k, v, o = (t((B, H, S, D)) for _ in range(4))
    m, l = t((B, H, S), F32), t((B, H, S), F32)
    attention.forward(
        o, q, k, v, m, l, scale=D**-0.5, causal=causal, input_pos=0, q_lengths=None, k_lengths=None
    )


def _attention_backward(D, causal, B=4, H=32, S=4096):
    from xpkernels.backends.triton import attention

    t = spec.tensor
    do, q, k, v, o, dq, dk, dv = (t((B, H, S, D)) for _ in range(8))
    m, l, delta = (t((B, H, S), F32) for _ in range(3))
    dq_accum = t((B, H, S, D), F32)
    attention.backward(
        do,
        q,
        k,
        v,
        o,
        m,
        l,
        dq,
        dk,
        dv,
        delta,
        dq_accum,
        scale=D**-0.5,
        causal=causal,
        input_pos=0,
        q_lengths=None,
        k_lengths=None,
    )


def _decode(D, B=16, H=32, Hkv=8, S=32768):
    from xpkernels.backends.triton import decode_attention

    t = spec.tensor
    k, v = t((B, Hkv, S, D)), t((B, Hkv, S, D))
    splits = decode_attention.default_splits(B, Hkv, S, k)
    o_partial = t((B, H, splits, D), F32)
    m_partial, l_partial = t((B, H, splits), F32), t((B, H, splits), F32)
    decode_attention.forward(
        t((B, H, D)),
        t((B, H, D)),
        k,
        v,
        t((B,), torch.int32),
        o_partial,
        m_partial,
        l_partial,
        scale=D**-0.5,
    )


def _attention_varlen(pass_, D=128, H=32, lengths=(8192, 4096, 2048, 2048)):
    """Packed causal sequences of uneven lengths (``T = 16384`` tokens) through the varlen kernels."""
    from xpkernels.backends.triton import attention_varlen

    t = spec.tensor
    T = sum(lengths)
    cu_seqlens = t((len(lengths) + 1,), torch.int32)
    q, k, v, o = (t((T, H, D)) for _ in range(4))
    m, l = t((H, T), F32), t((H, T), F32)
    options = {
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_k": cu_seqlens,
        "max_seqlen_q": max(lengths),
        "max_seqlen_k": max(lengths),
        "scale": D**-0.5,
        "causal": True,
        "input_pos": 0,
    }
    if pass_ == "fwd":
        attention_varlen.forward(o, q, k, v, m, l, **options)
        return
    do, dq, dk, dv = (t((T, H, D)) for _ in range(4))
    attention_varlen.backward(do, q, k, v, o, m, l, dq, dk, dv, t((H, T), F32), None, **options)


def _merge(pass_, B=4, H=32, S=4096, D=128):
    from xpkernels.backends.triton import merge_attention_states

    t = spec.tensor

    def state():
        return t((B, H, S, D)), t((B, H, S), F32), t((B, H, S), F32)

    merged, a, b = state(), state(), state()
    if pass_ == "fwd":
        merge_attention_states.forward(*merged, *a, *b)
        return
    do, dlse = t((B, H, S, D)), t((B, H, S), F32)
    grads = (t((B, H, S, D)), t((B, H, S), F32), t((B, H, S, D)), t((B, H, S), F32))
    merge_attention_states.backward(do, dlse, *merged, *a, *b, *grads)


def _swiglu(pass_, R, M):
    from xpkernels.backends.triton import swiglu

    t = spec.tensor
    if pass_ == "fwd":
        swiglu.forward(t((R, M)), t((R, M)), t((R, M)))
    else:
        swiglu.backward(t((R, M)), t((R, M)), t((R, M)), t((R, M)), t((R, M)))


def _geglu(pass_, R, M, approximate):
    from xpkernels.backends.triton import geglu

    t = spec.tensor
    if pass_ == "fwd":
        geglu.forward(t((R, M)), t((R, M)), t((R, M)), approximate=approximate)
    else:
        tensors = (t((R, M)) for _ in range(5))
        geglu.backward(*tensors, approximate=approximate)


def _rope(pass_, interleaved, B=4, H=32, S=4096, D=128, R2=64):
    """One rotation of ``(B, H, S, D)`` by a ``(1, S, R2)`` table broadcast over the batch."""
    from xpkernels.backends.triton import rope

    t = spec.tensor
    cos, sin = (t((1, S, R2)).expand(B, S, R2) for _ in range(2))
    launch = rope.forward if pass_ == "fwd" else rope.backward
    launch(t((B, H, S, D)), t((B, H, S, D)), cos, sin, None, interleaved=interleaved)


def _cross_entropy(pass_, dtype, N=8192, V=128256, softcap=None, label_smoothing=0.0, z_loss=0.0):
    """Per-row losses of ``(N, V)`` logits (a Llama 3 vocabulary by default); the backward
    writes the gradient over the logits in place, as the fused linear-cross-entropy does."""
    from xpkernels.backends.triton import cross_entropy

    t = spec.tensor
    logits, targets = t((N, V), dtype), t((N,), torch.int64)
    options = {
        "ignore_index": -100,
        "label_smoothing": label_smoothing,
        "softcap": softcap,
        "z_loss": z_loss,
    }
    if pass_ == "fwd":
        cross_entropy.forward(t((N,), F32), t((N,), F32), logits, targets, **options)
    else:
        grad = t((1,), F32).expand(N)
        cross_entropy.backward(logits, logits, targets, t((N,), F32), grad, **options)


def _rms_norm(pass_, R, M):
    from xpkernels.backends.triton import rms_norm

    t = spec.tensor
    x, w, rstd = t((R, M)), t((M,)), t((R,), F32)
    if pass_ == "fwd":
        rms_norm.forward(t((R, M)), x, w, rstd, eps=1e-6, offset=0.0)
        return
    partial = t((rms_norm.partials(R, M, x), M), F32)
    rms_norm.backward(t((R, M)), x, w, rstd, t((R, M)), partial, offset=0.0, accumulate=False)
    rms_norm.reduce_partials(partial, t((M,)))


def _layer_norm(pass_, R, M):
    from xpkernels.backends.triton import layer_norm

    t = spec.tensor
    x, w, b, mean, rstd = t((R, M)), t((M,)), t((M,)), t((R,), F32), t((R,), F32)
    if pass_ == "fwd":
        layer_norm.forward(t((R, M)), x, w, b, mean, rstd, eps=1e-5)
        return
    rows = layer_norm.partials(R, M, x)
    dw_partial, db_partial = t((rows, M), F32), t((rows, M), F32)
    layer_norm.backward(
        t((R, M)), x, w, mean, rstd, t((R, M)), dw_partial, db_partial, accumulate=False
    )
    layer_norm.reduce_partials(dw_partial, t((M,)))


def _softmax(pass_, R, M):
    from xpkernels.backends.triton import softmax

    t = spec.tensor
    if pass_ == "fwd":
        softmax.forward(t((R, M)), t((R, M)))
    else:
        softmax.backward(t((R, M)), t((R, M)), t((R, M)))


def _flex_mods(name, B, H, S):
    """``(score_mod, mask_mod)`` of a flex report case, over placeholder arrays."""
    from xpkernels import mods as xm

    t = spec.tensor

    def relative(score, b, h, q_idx, kv_idx, *, table):
        return score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -128), 128) + 128]

    return {
        "nomod": lambda: (None, None),
        "causal": lambda: (None, xm.CausalMask()),
        "sliding256-document": lambda: (
            None,
            xm.SlidingWindowMask(256) & xm.DocumentMask(t((S,), torch.int32)),
        ),
        "alibi-causal": lambda: (xm.AliBiScore(t((H,), F32)), xm.CausalMask()),
        "bias": lambda: (xm.BiasScore(t((1, H, S, S), BF16)), None),
        "user-relpos-causal": lambda: (
            xm.ScoreMod(relative, table=t((H, 257), F32)),
            xm.CausalMask(),
        ),
    }[name]()


@contextlib.contextmanager
def _placeholder_uploads():
    """The flex launchers' host-to-device copies (tile lists, positions) give placeholders."""
    from xpkernels.backends.triton import _flex_host

    saved = _flex_host.upload
    _flex_host.upload = lambda a, device: spec.tensor(
        a.shape, {1: torch.int8, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    )
    _flex_host._LISTS.clear()
    try:
        yield
    finally:
        _flex_host.upload = saved
        _flex_host._LISTS.clear()


def _flex(pass_, D, mods, B=4, H=16, S=4096, deterministic=True):
    """A flex launch at the GPU benchmarks' shape; ``mods`` names :func:`_flex_mods`' pair.

    The backward computes the score mod's array gradients (deterministic by default).
    """
    from xpkernels.backends.triton import flex_attention

    from xpkernels import mods as xm

    t = spec.tensor
    score, mask = _flex_mods(mods, B, H, S)
    score_graph = None if score is None else score.graph
    mask_graph = None if mask is None else mask.graph
    tile = flex_attention.PLAN_TILE
    plan = xm.plan_tiles(
        mask, None, block_sparse=True, n_q=S, n_kv=S, positions=(0,), tile_m=tile, tile_n=tile
    )
    q, k, v, o = (t((B, H, S, D)) for _ in range(4))
    m, l = t((B, H, S), F32), t((B, H, S), F32)
    options = {
        "scale": D**-0.5,
        "input_pos": (0,),
        "score_mod": score_graph,
        "mask_mod": mask_graph,
        "plan": plan,
    }
    with _placeholder_uploads():
        if pass_ == "fwd":
            flex_attention.forward(o, q, k, v, m, l, **options)
            return
        grads = None
        if score_graph is not None:
            grads = [t(tuple(s.array.shape), F32) for s in score_graph.slots]
        dq, dk, dv, do = (t((B, H, S, D)) for _ in range(4))
        workspace = None
        if grads:  # the score-mod gradients' partial rows, in the caller's scratch
            size = flex_attention.score_mod_workspace(
                q, k, v, score_graph, plan, grads, deterministic
            )
            workspace = t((size,), F32)
        flex_attention.backward(
            do,
            q,
            k,
            v,
            o,
            m,
            l,
            dq,
            dk,
            dv,
            t((B, H, S), F32),
            None,
            **options,
            score_mod_grads=grads,
            deterministic=deterministic,
            score_mod_workspace=workspace,
        )


def cases():
    """``{case name: (family, launcher)}`` of every report case, in report order."""
    out = {}
    for D in (128, 64, 256):
        for causal in (False, True):
            tag = f"D{D}.{'causal' if causal else 'full'}"
            out[f"attention.fwd.{tag}"] = (
                "attention",
                lambda D=D, c=causal: _attention_forward(D, c),
            )
            out[f"attention.bwd.{tag}"] = (
                "attention",
                lambda D=D, c=causal: _attention_backward(D, c),
            )
    for pass_ in ("fwd", "bwd"):
        out[f"attention_varlen.{pass_}.D128.causal"] = (
            "attention",
            lambda p=pass_: _attention_varlen(p),
        )
    for D in (128, 64):
        out[f"decode.D{D}"] = ("attention", lambda D=D: _decode(D))
    for mods in (
        "nomod",
        "causal",
        "sliding256-document",
        "alibi-causal",
        "bias",
        "user-relpos-causal",
    ):
        for pass_ in ("fwd", "bwd"):
            for D in (128, 64):
                out[f"flex.{pass_}.D{D}.{mods}"] = (
                    "attention",
                    lambda p=pass_, D=D, m=mods: _flex(p, D, m),
                )
        if mods in ("alibi-causal", "bias", "user-relpos-causal"):  # score-mod gradients
            for D in (128, 64):
                out[f"flex.bwd.D{D}.{mods}.atomics"] = (
                    "attention",
                    lambda D=D, m=mods: _flex("bwd", D, m, deterministic=False),
                )
    for pass_ in ("fwd", "bwd"):
        out[f"merge_attention_states.{pass_}.D128"] = ("rows", lambda p=pass_: _merge(p))
    for pass_ in ("fwd", "bwd"):
        for interleaved in (False, True):
            layout = "interleaved" if interleaved else "half"
            out[f"rope.{pass_}.D128.{layout}"] = (
                "rows",
                lambda p=pass_, i=interleaved: _rope(p, i),
            )
    for pass_ in ("fwd", "bwd"):
        for dtype, tag in ((BF16, "bf16"), (F32, "f32")):
            out[f"cross_entropy.{pass_}.8192x128256.{tag}"] = (
                "rows",
                lambda p=pass_, d=dtype: _cross_entropy(p, d),
            )
        # Gemma's vocabulary and logit softcap, with label smoothing and the z-loss: every term
        out[f"cross_entropy.{pass_}.8192x262144.bf16.softcap-smoothing-zloss"] = (
            "rows",
            lambda p=pass_: _cross_entropy(
                p, BF16, V=262144, softcap=30.0, label_smoothing=0.1, z_loss=1e-4
            ),
        )
    for name, fn in (
        ("rms_norm", _rms_norm),
        ("layer_norm", _layer_norm),
        ("softmax", _softmax),
        ("swiglu", _swiglu),
        ("geglu.tanh", functools.partial(_geglu, approximate="tanh")),
        ("geglu.none", functools.partial(_geglu, approximate="none")),
    ):
        for pass_ in ("fwd", "bwd"):
            for R, M in ((32768, 4096), (4096, 65536)):
                out[f"{name}.{pass_}.{R}x{M}"] = (
                    "rows",
                    lambda f=fn, p=pass_, R=R, M=M: f(p, R, M),
                )
    return out


# ----------------------------------------------------------------------------- tutorial 06


def _load_tutorial(path):
    """The tutorial module, imported with the offline driver active (its top level asks for a device)."""
    spec_ = importlib.util.spec_from_file_location("triton_tutorial_06", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


def tutorial_cases(path):
    """Reference cases compiling tutorial 06 through its own launcher (float16, as the tutorial)."""

    def run(mode, causal, D=128, B=4, H=32, S=4096):
        module = _load_tutorial(path)

        def t(*shape, dtype=torch.float16):
            return torch.empty(shape, dtype=dtype, device="meta")

        q, k, v = t(B, H, S, D), t(B, H, S, D), t(B, H, S, D)
        if mode == "fwd":
            ctx = types.SimpleNamespace(save_for_backward=lambda *saved: None)
            module._attention.forward(ctx, q, k, v, causal, 0.5, USE_TMA=False)
            return
        ctx = types.SimpleNamespace(
            saved_tensors=(q, k, v, t(B, H, S, D), t(B, H, S, dtype=F32)),
            sm_scale=0.5,
            HEAD_DIM=D,
            causal=causal,
        )
        module._attention.backward(ctx, t(B, H, S, D))

    return {
        "tutorial06.fwd.D64.full": ("reference", lambda: run("fwd", False, D=64)),
        "tutorial06.fwd.D128.full": ("reference", lambda: run("fwd", False)),
        "tutorial06.bwd.D64.causal": ("reference", lambda: run("bwd", True, D=64)),
        "tutorial06.bwd.D128.causal": ("reference", lambda: run("bwd", True)),
    }


# ----------------------------------------------------------------------------- targets


def evaluate(family: str, facts: dict) -> dict:
    """``{target: "PASS" | "FAIL" | "-"}`` of one compiled kernel of ``family``.

    Parameters
    ----------
    family : {"attention", "rows", "reference"}
        Reference kernels are judged like attention kernels.
    facts : dict
        :func:`_triton_specialize.analyse` of the kernel.
    """

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    attention = family in ("attention", "reference")
    spills = (
        (facts["local_bytes"] or 0) + (facts["spill_stores"] or 0) + (facts["spill_loads"] or 0)
    )
    loads = [op for op in facts["tile_ops"] if op["kind"] == "load"]
    out = {
        "wgmma": verdict(facts["mma"] == "wgmma") if attention and facts["dots"] else "-",
        "no_spills": verdict(spills == 0 and facts["regs"] is not None),
        "tile_loads_16B": "-",
        "row_128bit": "-",
    }
    if attention and loads:
        out["tile_loads_16B"] = verdict(
            all(op["all_128bit"] and (op["async"] or not op["in_loop"]) for op in loads)
        )
    # A scalar (rank-0) access, such as cross-entropy's load of the target's logit, is one
    # element: no vector to widen.
    row_ops = [op for op in facts["tile_ops"] if op.get("rank", 1) != 0]
    if family == "rows" and row_ops:
        out["row_128bit"] = verdict(all(op["all_128bit"] for op in row_ops))
    return out


def spill_bytes(facts: dict) -> int:
    """Local memory bytes per thread (spills), or the count of spill instructions if larger."""
    return max(
        facts["local_bytes"] or 0, (facts["spill_stores"] or 0) + (facts["spill_loads"] or 0)
    )


def compare(rows: list[dict], baseline: dict) -> tuple[list[str], list[str]]:
    """Regressions of ``rows`` against ``baseline`` and the baseline's known failures.

    Parameters
    ----------
    rows : list of dict
        The ``kernels`` of a report.
    baseline : dict
        A report's ``kernels`` keyed by ``id`` (``{"kernels": {id: {"targets", "spill_bytes"}}}``).

    Returns
    -------
    regressions, known : list of str
        A regression is a kernel present in both that fails a target the
        baseline passes or spills more bytes; known lists the baseline's
        failing targets of the kernels in ``rows``.
    """
    regressions, known = [], []
    base = baseline["kernels"]
    for row in rows:
        ref = base.get(row["id"])
        if ref is None:
            continue
        for target, was in ref["targets"].items():
            now = row["targets"].get(target, "-")
            if was == "PASS" and now != "PASS":
                regressions.append(f"{row['id']}: {target} was PASS, now {now}")
            elif was == "FAIL":
                known.append(f"{row['id']}: {target} FAIL (known)")
        if row["spill_bytes"] > ref["spill_bytes"]:
            regressions.append(
                f"{row['id']}: spills {ref['spill_bytes']} -> {row['spill_bytes']} bytes"
            )
    return regressions, known


def baseline_of(report: dict) -> dict:
    """The baseline :func:`compare` reads: targets and spills of each own (non-reference) kernel."""
    return {
        "about": (
            "Offline sm_90 compile targets held by tests/test_compile_report.py: a kernel "
            "that passes a target here must keep passing it and must not spill more. "
            "FAIL entries are known failures (DESIGN section 8 targets not met yet)."
        ),
        "environment": report["environment"],
        "kernels": {
            r["id"]: {"targets": r["targets"], "spill_bytes": r["spill_bytes"]}
            for r in report["kernels"]
            if r["family"] != "reference"
        },
    }


# ----------------------------------------------------------------------------- report


def _loads_summary(facts: dict, kind: str) -> str:
    loop, rest = {}, {}
    for op in facts["tile_ops"]:
        if op["kind"] != kind:
            continue
        into = loop if op["in_loop"] else rest
        for key, n in op["ptx"].items():
            into[key] = into.get(key, 0) + n
        if not op["ptx"]:
            into["?"] = into.get("?", 0) + 1

    def fmt(d):
        short = {
            k.replace("ld.global.", "ld").replace("st.global.", "st").replace("cp.async.", "cp"): n
            for k, n in sorted(d.items())
        }
        return " ".join(f"{k}x{n}" for k, n in short.items()) or "-"

    if kind == "load" and loop:
        return f"loop[{fmt(loop)}] {fmt(rest)}"
    return fmt({**rest, **{k: loop.get(k, 0) + rest.get(k, 0) for k in loop}})


def run_report(selected: dict, candidates: bool, progress=print) -> list[dict]:
    """Compile and analyse every launch of the ``selected`` cases; one row per kernel."""
    rows, cache = [], {}
    for case, (family, launcher) in selected.items():
        with spec.offline_cuda(), _tuning(candidates), spec.capture() as launches:
            launcher()
        for launch in launches:
            configs = [None]
            if launch.candidates is not None:
                configs = launch.candidates if candidates else [_pick(family, launch.candidates)]
            for extra in configs:
                tile = (
                    "default"
                    if launch.candidates is None
                    else "candidate " + ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
                )
                row_id = f"{case}/{launch.name}" + (
                    "" if launch.candidates is None else f"[{tile.split(' ', 1)[1]}]"
                )
                meta = {
                    k: v
                    for k, v in {**launch.kwargs, **(extra or {})}.items()
                    if k.isupper() and isinstance(v, (bool, int, float, str))
                }
                row = {
                    "id": row_id,
                    "case": case,
                    "family": family,
                    "kernel": launch.name,
                    "tile": tile,
                    "grid": list(launch.grid),
                    "constexprs": meta,
                }
                start = time.perf_counter()
                try:
                    with spec.offline_cuda():
                        kernel = spec.compile_launch(launch, extra)
                except Exception as exc:  # a kernel that does not compile is a row, not a crash
                    error = str(exc).strip().splitlines()
                    row.update(
                        facts=None,
                        error=f"{type(exc).__name__}: {error[-1] if error else ''}",
                        targets=dict.fromkeys(TARGETS, "ERROR"),
                        spill_bytes=0,
                    )
                else:
                    if kernel.hash not in cache:
                        cache[kernel.hash] = spec.analyse(kernel)
                    facts = cache[kernel.hash]
                    row.update(
                        facts=facts, targets=evaluate(family, facts), spill_bytes=spill_bytes(facts)
                    )
                seconds = time.perf_counter() - start
                row["compile_s"] = round(seconds, 2)
                rows.append(row)
                progress(
                    f"  {'FAILED to compile' if row.get('error') else 'compiled'} "
                    f"{row_id} in {seconds:.1f} s"
                )
    return rows


def _pick(family: str, candidates: list[dict]) -> dict:
    """The candidate compiled for an autotuned launch when not all are: the tutorial's fixed tile."""
    if family == "reference":
        for c in candidates:
            if all(c.get(k) == v for k, v in TUTORIAL_FORWARD_TILE.items()):
                return c
    return candidates[0]


@contextlib.contextmanager
def _tuning(candidates: bool):
    """Without ``candidates``, launches take their table's default tile (the untuned path)."""
    from xpkernels.backends.triton import _attn_common

    if candidates or not hasattr(_attn_common, "use_autotune"):
        yield
        return
    saved = _attn_common.use_autotune
    _attn_common.use_autotune = lambda work, like: False
    try:
        yield
    finally:
        _attn_common.use_autotune = saved


def format_table(rows: list[dict]) -> str:
    """The report as a fixed-width text table, one line per kernel."""
    head = (
        "kernel",
        "tl.dot ->",
        "regs",
        "spill",
        "smem KiB",
        "w/st",
        "CTA/SM",
        "SASS",
        "16-bit loads",
        "16-bit stores",
        "wgmma",
        "spills",
        "ld16B",
        "row128",
    )
    lines = []
    errors = []
    for r in rows:
        f = r["facts"]
        if f is None:
            errors.append(f"{r['id']}: does not compile: {r['error']}")
            lines.append((r["id"], "ERROR", *("-",) * 8, *(r["targets"][t] for t in TARGETS)))
            continue
        dots = "+".join(f"{k}x{n}" for k, n in sorted(f["dots"].items())) or "none"
        lines.append(
            (
                r["id"],
                dots,
                str(f["regs"]),
                str(r["spill_bytes"]),
                f"{f['shared'] / 1024:.1f}",
                f"{f['num_warps']}/{f['num_stages']}",
                str(f["ctas_per_sm"]),
                str(f["sass_instructions"]),
                _loads_summary(f, "load"),
                _loads_summary(f, "store"),
                *(r["targets"][t] for t in TARGETS),
            )
        )
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
        for i, h in enumerate(head)
    ]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out + errors)


def _environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "target": "cuda sm_90 (warp size 32)",
        "sm_count_assumed": spec.H200_SMS,
        "tools": {name: spec._tool(name) for name in ("cuobjdump", "nvdisasm")},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="keep the cases whose name contains one of these substrings",
    )
    parser.add_argument("--json", help="write the report as JSON to this path")
    parser.add_argument(
        "--candidates", action="store_true", help="also compile every autotune candidate tile"
    )
    parser.add_argument("--baseline", help="exit 1 on a regression against this report JSON")
    parser.add_argument(
        "--write-baseline",
        metavar="PATH",
        help="write this run's targets and spills (own kernels only) as a baseline",
    )
    parser.add_argument(
        "--tutorial",
        default=None,
        help="path of Triton's tutorial 06-fused-attention.py (reference rows)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error(
            "TRITON_INTERPRET=1 is set: the report needs the compiler, not the interpreter"
        )

    selected = cases()
    tutorial = args.tutorial or (DEFAULT_TUTORIAL if os.path.exists(DEFAULT_TUTORIAL) else None)
    notes = []
    if tutorial:
        selected.update(tutorial_cases(tutorial))
    else:
        notes.append(
            "reference rows (tutorial 06) left out: no --tutorial file "
            f"(looked for {DEFAULT_TUTORIAL})"
        )
    if args.only is not None:
        selected = {k: v for k, v in selected.items() if any(s in k for s in args.only)}
    if not any(family == "reference" for family, _ in selected.values()):
        tutorial = None
    start = time.perf_counter()
    rows = run_report(selected, args.candidates, progress=lambda s: print(s, file=sys.stderr))
    elapsed = time.perf_counter() - start
    print(format_table(rows))
    for note in notes:
        print("note:", note)
    failing = [
        f"{r['id']}: {t}" for r in rows for t in TARGETS if r["targets"][t] in ("FAIL", "ERROR")
    ]
    print(f"\n{len(rows)} kernels, {len(failing)} failing targets, compiled in {elapsed:.0f} s")
    report = {
        "environment": _environment(),
        "targets": list(TARGETS),
        "notes": notes,
        "seconds": round(elapsed, 1),
        "kernels": rows,
    }
    if tutorial:
        with open(tutorial, "rb") as f:
            report["tutorial"] = {
                "path": tutorial,
                "origin": TUTORIAL_ORIGIN,
                "sha256": hashlib.sha256(f.read()).hexdigest(),
                "forward_tile": TUTORIAL_FORWARD_TILE,
            }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=False)
    if args.write_baseline:
        with open(args.write_baseline, "w") as f:
            json.dump(baseline_of(report), f, indent=1)
            f.write("\n")
    status = 0
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)
        regressions, known = compare(rows, baseline)
        for line in known:
            print("known:", line)
        for line in regressions:
            print("REGRESSION:", line)
        status = 1 if regressions else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
