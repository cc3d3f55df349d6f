"""The offline sm_90 compile report (bench/compile_report.py) and the targets it holds in CI.

The report compiles the Triton kernels with the compiler, not the interpreter,
so it runs in a fresh process without ``TRITON_INTERPRET``. It needs Triton's
NVIDIA backend (ptxas, cuobjdump, nvdisasm ship in the wheel), not a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
BASELINE = os.path.join(BENCH, "results", "compile-baseline-sm90.json")


def _report():
    """``bench/compile_report.py`` as a module, imported when a test runs, never at collection
    (importing Triton before ``TRITON_INTERPRET`` is set would change how other tests run)."""
    pytest.importorskip(
        "torch", reason="the compile report runs the launchers on torch meta tensors"
    )
    pytest.importorskip("triton", reason="the compile report compiles Triton kernels")
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    import compile_report

    return compile_report


#: Cases compiled in CI: one of each kernel family at the benchmark shapes
#: (every attention kernel at D=128 causal, the backward at D=256 causal -- dK/dV
#: split over two programs --, the forward at D=64, decode, the fused and
#: streaming norm backwards with their dW reduction, a streaming forward, a
#: fused softmax backward, and flex's kernels with a mask and with a score mod
#: whose gradients are summed, which is what the flex launchers' placeholder
#: harness must keep up with): 28 kernels, about 2 minutes on 2 shared CPU cores.
CI_CASES = [
    "attention.fwd.D128.causal",
    "attention.bwd.D128.causal",
    "attention.bwd.D256.causal",
    "attention.fwd.D64.full",
    "decode.D128",
    "rms_norm.bwd.32768x4096",
    "rms_norm.bwd.4096x65536",
    "layer_norm.bwd.4096x65536",
    "layer_norm.fwd.4096x65536",
    "softmax.bwd.32768x4096",
    "flex.fwd.D64.causal",
    "flex.bwd.D64.causal",
    "flex.bwd.D64.alibi-causal.atomics",
]
CI_KERNELS = [
    "attention.fwd.D128.causal/_forward_kernel",
    "attention.fwd.D64.full/_forward_kernel",
    "attention.bwd.D128.causal/_delta_kernel",
    "attention.bwd.D128.causal/_dkdv_kernel",
    "attention.bwd.D128.causal/_dq_kernel",
    "attention.bwd.D256.causal/_delta_kernel",
    "attention.bwd.D256.causal/_dkdv_kernel",
    "attention.bwd.D256.causal/_dq_kernel",
    "decode.D128/_split_kernel",
    "decode.D128/_combine_kernel",
    "rms_norm.bwd.32768x4096/_backward_fused",
    "rms_norm.bwd.32768x4096/_reduce_partials_kernel",
    "rms_norm.bwd.32768x4096/_cast_row_kernel",
    "rms_norm.bwd.4096x65536/_backward_streaming",
    "rms_norm.bwd.4096x65536/_reduce_partials_kernel",
    "rms_norm.bwd.4096x65536/_cast_row_kernel",
    "layer_norm.bwd.4096x65536/_backward_streaming",
    "layer_norm.bwd.4096x65536/_reduce_partials_kernel",
    "layer_norm.bwd.4096x65536/_cast_row_kernel",
    "layer_norm.fwd.4096x65536/_forward_streaming",
    "softmax.bwd.32768x4096/_backward_fused",
    "flex.fwd.D64.causal/_forward_kernel",
    "flex.bwd.D64.causal/_delta_kernel",
    "flex.bwd.D64.causal/_dkdv_kernel",
    "flex.bwd.D64.causal/_dq_kernel",
    "flex.bwd.D64.alibi-causal.atomics/_delta_kernel",
    "flex.bwd.D64.alibi-causal.atomics/_dkdv_kernel",
    "flex.bwd.D64.alibi-causal.atomics/_dq_kernel",
]


def _row(row_id, spills=0, **targets):
    full = dict.fromkeys(_report().TARGETS, "-")
    full.update(targets)
    return {"id": row_id, "targets": full, "spill_bytes": spills}


def test_compare_flags_a_lost_target_and_new_spills_and_lists_known_failures():
    compile_report = _report()
    baseline = {
        "kernels": {
            "a/k": {"targets": {"wgmma": "PASS", "no_spills": "PASS"}, "spill_bytes": 0},
            "b/k": {"targets": {"wgmma": "FAIL", "no_spills": "PASS"}, "spill_bytes": 0},
            "c/k": {"targets": {"row_128bit": "PASS"}, "spill_bytes": 8},
        }
    }
    same = [
        _row("a/k", wgmma="PASS", no_spills="PASS"),
        _row("b/k", wgmma="FAIL", no_spills="PASS"),
    ]
    regressions, known = compile_report.compare(same, baseline)
    assert regressions == []
    assert known == ["b/k: wgmma FAIL (known)"]

    worse = [
        _row("a/k", wgmma="FAIL", no_spills="PASS"),
        _row("c/k", row_128bit="PASS", spills=16),
        _row("new/k", wgmma="FAIL"),
    ]
    regressions, _ = compile_report.compare(worse, baseline)
    assert regressions == ["a/k: wgmma was PASS, now FAIL", "c/k: spills 8 -> 16 bytes"]

    broken = [{**_row("a/k"), "targets": dict.fromkeys(compile_report.TARGETS, "ERROR")}]
    regressions, _ = compile_report.compare(broken, baseline)
    assert regressions == ["a/k: wgmma was PASS, now ERROR", "a/k: no_spills was PASS, now ERROR"]


def _facts(**kw):
    facts = {
        "mma": "wgmma",
        "dots": {"wgmma": 2},
        "regs": 128,
        "local_bytes": 0,
        "spill_stores": 0,
        "spill_loads": 0,
        "tile_ops": [],
    }
    facts.update(kw)
    return facts


def _load(in_loop, async_, wide, kind="load"):
    return {"kind": kind, "in_loop": in_loop, "async": async_, "all_128bit": wide}


def test_evaluate_reads_each_target_from_the_compiled_facts():
    compile_report = _report()
    good = _facts(tile_ops=[_load(True, True, True), _load(False, False, True)])
    assert compile_report.evaluate("attention", good) == {
        "wgmma": "PASS",
        "no_spills": "PASS",
        "tile_loads_16B": "PASS",
        "row_128bit": "-",
    }
    mixed = _facts(mma="mixed", dots={"wgmma": 2, "mma.sync": 2})
    assert compile_report.evaluate("attention", mixed)["wgmma"] == "FAIL"
    # a loop load that is 16 bytes wide but synchronous is not pipelined
    sync_loop = _facts(tile_ops=[_load(True, False, True)])
    assert compile_report.evaluate("attention", sync_loop)["tile_loads_16B"] == "FAIL"
    narrow = _facts(tile_ops=[_load(False, False, False)])
    assert compile_report.evaluate("attention", narrow)["tile_loads_16B"] == "FAIL"
    assert compile_report.evaluate("attention", _facts(local_bytes=8))["no_spills"] == "FAIL"
    rows = _facts(
        mma="none",
        dots={},
        tile_ops=[_load(False, False, True), _load(False, False, False, "store")],
    )
    assert compile_report.evaluate("rows", rows) == {
        "wgmma": "-",
        "no_spills": "PASS",
        "tile_loads_16B": "-",
        "row_128bit": "FAIL",
    }


def test_accesses_are_joined_to_their_source_through_the_inlining_chain():
    """A helper inlined at two call sites (``load_rows`` for Q and for K, say) gives two
    source positions: each TTGIR access and each PTX instruction is keyed by its line and
    the lines of the calls it was inlined through, so the two sites' widths stay apart."""
    _report()
    import _triton_specialize

    ttgir = "\n".join(
        [
            '#loc1 = loc("/src/kernel.py":10:4)',
            '#loc2 = loc("/src/kernel.py":20:8)',
            '#loc3 = loc("/src/kernel.py":30:8)',
            "#loc4 = loc(callsite(#loc1 at #loc2))",
            "#loc5 = loc(callsite(#loc1 at #loc3))",
            '#loc6 = loc("x"(#loc5))',
        ]
    )
    locs = _triton_specialize._resolve_locs(ttgir)
    assert locs["#loc4"] == (("kernel.py", 10), ("kernel.py", 20))
    assert locs["#loc6"] == (("kernel.py", 10), ("kernel.py", 30))
    ptx = "\n".join(
        [
            '\t.file\t1 "/src/kernel.py"',
            "\t.loc\t1 10 4                          // kernel.py:10:4 @[ kernel.py:30:8 ]",
            "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];",
        ]
    )
    (access,) = _triton_specialize._ptx_facts(ptx)["accesses"]
    assert access["where"] == (("kernel.py", 10), ("kernel.py", 30))
    assert access["bits"] == 128


#: Compile-report case prefixes that name a kernel family rather than the primitive: decode's
#: kernels, and flex's (the packed flex primitive runs them on each sequence's views).
_FAMILIES = {"decode": ("decode_attention",), "flex": ("flex_attention", "flex_attention_varlen")}


def test_every_primitive_the_triton_backend_serves_has_report_cases():
    """The report's cases cover the declared primitives: one the triton backend serves
    without a case in the report is a kernel CI never compiles for sm_90."""
    from xpkernels.backends.triton import BACKEND

    report = _report()
    covered = set()
    for name in report.cases():
        prefix = name.split(".")[0]
        covered.update(_FAMILIES.get(prefix, (prefix,)))
    assert set(BACKEND.ops) <= covered, sorted(set(BACKEND.ops) - covered)


def test_baseline_covers_the_ci_kernels():
    with open(BASELINE) as f:
        kernels = json.load(f)["kernels"]
    missing = [k for k in CI_KERNELS if k not in kernels]
    assert not missing, f"baseline lacks {missing}: regenerate it with --write-baseline"


def test_sm90_compile_report_holds_the_baseline(tmp_path):
    pytest.importorskip(
        "triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend"
    )
    _report()
    import _triton_specialize

    for tool in ("cuobjdump", "nvdisasm"):
        if _triton_specialize._tool(tool) is None:
            pytest.skip(f"no {tool} in the Triton wheel or on PATH")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "report.json"
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "compile_report.py"),
            "--only",
            *CI_CASES,
            "--json",
            str(out),
            "--baseline",
            BASELINE,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=ROOT,
    )
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "REGRESSION" not in run.stdout
    report = json.loads(out.read_text())
    rows = {r["id"]: r for r in report["kernels"]}
    assert sorted(rows) == sorted(CI_KERNELS), (
        "the CI cases launch other kernels than the baseline knows: update CI_KERNELS and "
        "regenerate bench/results/compile-baseline-sm90.json with --write-baseline"
    )

    from xpkernels.backends.triton import attention

    # the untuned launch compiles its table's default tile, specialised by the JIT's binder
    forward = rows["attention.fwd.D128.causal/_forward_kernel"]
    tile = attention._FORWARD_TILES.default[128]
    assert (forward["constexprs"]["BLOCK_M"], forward["constexprs"]["BLOCK_N"]) == (
        tile.block_m,
        tile.block_n,
    )
    assert forward["facts"]["num_warps"] == tile.num_warps
    assert forward["facts"]["num_stages"] == tile.num_stages
    assert {"q_ptr", "k_ptr", "stride_qm"} <= set(forward["facts"]["divisible16"])
    assert forward["targets"]["wgmma"] == "PASS"
    # the persistent norm backwards launch one whole wave: SMs x the programs an SM holds,
    # sized from BACKWARD_REGISTERS, which must cover what the compiled kernel uses
    from xpkernels.backends.triton import _common, layer_norm, rms_norm

    sms = report["environment"]["sm_count_assumed"]
    for row_id, row in rows.items():
        op, kernel = row_id.split(".")[0], row_id.split("/")[1]
        modules = {"rms_norm": rms_norm, "layer_norm": layer_norm}
        if op not in modules or kernel not in ("_backward_fused", "_backward_streaming"):
            continue
        table = modules[op].BACKWARD_REGISTERS
        registers = table[kernel == "_backward_streaming"]
        facts = row["facts"]
        assert facts["regs"] <= registers, (row_id, facts["regs"], registers)
        resident = _common.resident_programs(registers, facts["num_warps"])
        assert resident == facts["ctas_per_sm"], (row_id, resident, facts["ctas_per_sm"])
        assert row["grid"] == [sms * resident], (row_id, row["grid"])
    # decode's default splits fill whole waves of the compiled occupancy
    from xpkernels.backends.triton import decode_attention

    split = rows["decode.D128/_split_kernel"]
    per_sm = decode_attention.SPLIT_PROGRAMS_PER_SM[128]
    assert split["facts"]["ctas_per_sm"] == per_sm, split["facts"]["ctas_per_sm"]
    (grid,) = split["grid"]
    slots = sms * per_sm
    assert grid / (-(-grid // slots) * slots) >= decode_attention.WAVE_FILL, (grid, slots)
    assert grid <= 2 * slots, (grid, slots)  # the fewest splits that fill: not many waves
