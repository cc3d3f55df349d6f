"""The command line: ``python -m xpkernels info | check | bench | demo``.

Commands run as a user runs them (a subprocess with ``-m``) where their
output and exit status are the contract; the demo's pieces are also tested
in process on a small configuration. Performance figures are never asserted.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import xpkernels
from xpkernels.cli import check as cli_check
from xpkernels.cli import demo, main
from xpkernels.testing import harness

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRITON = HAS_TORCH and importlib.util.find_spec("triton") is not None
NAMESPACES = ["numpy", "array_api_strict"] + (["torch"] if HAS_TORCH else [])


def run_cli(*args, timeout=300, **env):
    """``python -m xpkernels ARGS`` with TRITON_INTERPRET unset unless given; (rc, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "xpkernels", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


# --------------------------------------------------------------------------- info


def test_info_lists_versions_and_every_backend_with_its_state():
    rc, out, err = run_cli("info")
    assert rc == 0, err
    assert re.search(rf"^\s+xpkernels\s+{re.escape(xpkernels.__version__)}$", out, re.MULTILINE)
    assert re.search(r"^\s+numpy\s+\d+\.\d+", out, re.MULTILINE)
    assert re.search(r"^\s+cupy\s+(not installed|\d)", out, re.MULTILINE)
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    expected = subprocess.run(
        [
            sys.executable,
            "-c",
            "import xpkernels as xk\nfor b in xk.backends(): print(repr((b.name, b.available, b.reason)))",
        ],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    ).stdout.splitlines()
    assert len(expected) == len(xpkernels.backends())
    for name, available, reason in map(ast.literal_eval, expected):
        state = "available" if available else f"unavailable: {reason}"
        assert re.search(rf"^\s+{name}\s+{re.escape(state)}$", out, re.MULTILINE), out


def test_no_command_is_a_usage_error():
    rc, _, err = run_cli()
    assert rc == 2
    assert "info" in err and "demo" in err


def test_an_explicit_backend_that_cannot_serve_is_a_one_line_error():
    rc, _, err = run_cli("demo", "--backend", "triton", "--steps", "1", "--sample", "0")
    assert rc == 1
    assert "backend 'triton'" in err and "cannot serve numpy arrays" in err
    assert "Traceback" not in err


USAGE_ERRORS = [
    (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--steps", "x"], "argument --steps: not an integer: 'x'"),
    (["demo", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["demo", "--sample", "-1"], "argument --sample: must be >= 0, got -1"),
    (["bench", "--quick", "--op", "softmax", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
]


@pytest.mark.parametrize(("args", "message"), USAGE_ERRORS)
def test_a_bad_count_or_seed_is_a_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""


def test_bench_checks_its_json_path_before_running_anything(tmp_path, capsys):
    for path, message in [
        (tmp_path / "missing" / "bench.json", f"directory {tmp_path / 'missing'} does not exist"),
        (tmp_path, f"{tmp_path} is a directory"),
    ]:
        with pytest.raises(SystemExit) as stop:
            main(["bench", "--quick", "--op", "softmax", "--json", str(path)])
        assert stop.value.code == 2
        out, err = capsys.readouterr()
        assert f"argument --json: {message}" in err and out == ""


TORCH_FLAGS = [["--torch"], ["--array", "torch"]]


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("flag", TORCH_FLAGS)
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("bogus", "--device bogus is not a torch device"),
        ("meta", "--device meta holds no data"),
    ],
)
def test_a_device_torch_cannot_use_is_a_usage_error(flag, device, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", *flag, "--device", device, "--steps", "1", "--sample", "0"])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert f"demo: {message}" in err and out == ""


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("flag", TORCH_FLAGS)
def test_cuda_without_a_cuda_device_is_a_usage_error(flag, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    with pytest.raises(SystemExit) as stop:
        main(["demo", *flag, "--device", "cuda", "--steps", "1", "--sample", "0"])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert "demo: --device cuda: torch here has no cuda device" in err and out == ""


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--torch", "--steps", "1"],
        ["demo", "--array", "torch", "--steps", "1"],
        ["bench", "--quick", "--op", "softmax", "--array", "torch", "--repeats", "1"],
    ],
)
def test_a_torch_path_without_torch_says_how_to_install_it(args):
    """Torch hidden from the import system: one usage error, no traceback, nothing run."""
    code = (
        "import sys; sys.modules['torch'] = None; from xpkernels.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    flag = "--torch" if "--torch" in args else "--array torch"
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{args[0]}: {flag} needs torch, but torch is not installed" in done.stderr
    assert "pip install '.[torch]'" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


# --------------------------------------------------------------------------- check


ROW = r"^{op}\s+(\S+)\s+(array_api|triton)\s+{ns} cpu\s+(\S+)\s+(\S+)\s+.*\b(PASS|FAIL)$"


def test_check_passes_every_primitive_on_every_cpu_namespace():
    rc, out, err = run_cli("check")
    assert rc == 0, out + err
    rows = re.findall(ROW.format(op=r"(\w+)", ns=r"(\w+)"), out, re.MULTILINE)
    seen = {(op, ns) for op, _, _, ns, *_ in rows}
    for spec in harness.load_specs():
        for ns in NAMESPACES:
            assert (spec.name, ns) in seen, f"no {spec.name} row for {ns}:\n{out}"
    assert all(status == "PASS" for *_, status in rows)
    assert all(float(fwd) < 1e-4 for *_, fwd, _, _ in rows)
    if HAS_TRITON:
        assert "triton on torch cpu: runs only through the Triton interpreter" in out
    else:
        assert re.search(
            r"^  triton on torch cpu: (torch|triton) is not installed$", out, re.MULTILINE
        ), out
    total = re.search(r"^(\d+) PASS, 0 FAIL$", out, re.MULTILINE)
    assert total and int(total.group(1)) >= len(rows), out  # emulated targets add rows of their own


def test_check_runs_the_declared_quick_cases():
    """``check`` runs the conformance suite's own cases, not a copy of them."""
    rc, out, err = run_cli("check", "--op", "layer_norm")
    assert rc == 0, out + err
    quick = [
        case.id
        for spec in harness.load_specs()
        if spec.name == "layer_norm"
        for case in spec.cases
        if case.quick
    ]
    cases = re.findall(ROW.format(op="layer_norm", ns="numpy"), out, re.MULTILINE)
    assert [case for case, *_ in cases] == quick


def _patched_check(monkeypatch, op, **changes):
    """``check`` sees the spec of ``op`` with ``changes`` applied."""
    specs = [dataclasses.replace(s, **changes) if s.name == op else s for s in harness.load_specs()]
    monkeypatch.setattr(harness, "load_specs", lambda: specs)


def test_check_fails_with_exit_1_on_a_wrong_result(monkeypatch, capsys):
    good = next(s for s in harness.load_specs() if s.name == "softmax").reference

    def off_by_a_little(case, inputs):
        outs, ck = good(case, inputs)
        return {"y": outs["y"] * 1.001}, ck

    _patched_check(monkeypatch, "softmax", reference=off_by_a_little)
    assert main(["check", "--op", "softmax"]) == 1
    out = capsys.readouterr().out
    assert re.search(
        ROW.format(op="softmax", ns="numpy").replace("(PASS|FAIL)", "FAIL"), out, re.MULTILINE
    )
    assert "beyond tolerance: forward y" in out
    assert re.search(r"^0 PASS, \d+ FAIL$", out, re.MULTILINE)


def test_check_counts_an_unwritten_output_as_an_infinite_error(monkeypatch, capsys):
    def forward_that_writes_nothing(case, arrays, outs, checkpoints, backend):
        return None

    _patched_check(monkeypatch, "softmax", forward_=forward_that_writes_nothing)
    assert main(["check", "--op", "softmax"]) == 1
    assert re.search(
        r"^softmax\s+\S+\s+array_api\s+numpy cpu\s+inf\s", capsys.readouterr().out, re.MULTILINE
    )


def test_check_reports_an_exception_as_a_failure_and_keeps_going(monkeypatch, capsys):
    def broken(case, arrays, outs, checkpoints, backend):
        raise RuntimeError("kernel exploded")

    _patched_check(monkeypatch, "rms_norm", forward_=broken)
    assert main(["check", "--op", "rms_norm", "--op", "softmax"]) == 1
    out = capsys.readouterr().out
    assert "rms_norm on array_api / numpy cpu raised RuntimeError: kernel exploded" in out
    assert re.search(
        ROW.format(op="softmax", ns="numpy").replace("(PASS|FAIL)", "PASS"), out, re.MULTILINE
    )


def test_check_error_measure():
    ref = np.array([[1.0, -np.inf], [4.0, 0.0]])
    assert cli_check.max_error(ref + np.array([[0.0, 0.0], [0.4, 0.0]]), ref) == pytest.approx(0.1)
    assert cli_check.max_error(np.array([[1.0, np.nan], [4.0, 0.0]]), ref) == math.inf
    with pytest.raises(AssertionError, match="shape"):
        cli_check.max_error(np.zeros(3), np.zeros(4))


# --------------------------------------------------------------------------- bench


def test_bench_quick_writes_every_row_as_json(tmp_path):
    path = tmp_path / "bench.json"
    rc, out, err = run_cli("bench", "--quick", "--repeats", "2", "--json", str(path))
    assert rc == 0, out + err
    record = json.loads(path.read_text())
    assert record["environment"]["quick"] is True
    rows = record["rows"]
    ours = [r for r in rows if r["impl"] == "xpkernels"]
    assert {r["op"] for r in ours} >= {
        "rms_norm",
        "layer_norm",
        "softmax",
        "attention",
        "attention (causal)",
        "decode_attention",
        "flex causal mask",
        "flex window 32",
        "flex 3 documents",
        "flex no mods",
    }
    assert "\r" not in err  # no progress bar when stderr is not a terminal
    assert "min ms" in out and "median ms" in out and "max ms" in out and "spread" in out
    for row in rows:
        assert row["error"] is None, row
        assert len(row["times_s"]) == 2 and row["median_s"] > 0 and row["rate"] > 0
        assert row["repeats"] == 2
        assert row["min_s"] == min(row["times_s"]) and row["max_s"] == max(row["times_s"])
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["spread"] == pytest.approx((row["max_s"] - row["min_s"]) / row["median_s"])
        assert row["flagged"] == (row["spread"] > record["spread_limit"])
        assert isinstance(row["retimed"], bool)
        assert (row["first_spread"] is not None) == row["retimed"]
        assert row["unit"] in ("GB/s", "TFLOP/s")
        assert row["formula"].startswith("bytes = " if row["unit"] == "GB/s" else "FLOPs = ")
        expected_rate = row["work"] / row["median_s"] / (1e9 if row["unit"] == "GB/s" else 1e12)
        assert row["rate"] == pytest.approx(expected_rate)
    by_key = {(r["op"], r["pass"], r["impl"]): r for r in rows}
    if HAS_TORCH:
        assert "--quick: the torch.compile(flex_attention) rows are skipped" in out
    for pass_ in ("forward", "backward"):
        sparse = by_key[("flex window 32", pass_, "xpkernels")]
        dense = by_key[("flex window 32", pass_, "xpkernels dense")]
        assert sparse["ratio"] == pytest.approx(sparse["median_s"] / dense["median_s"])
        no_mods = by_key[("flex no mods", pass_, "xpkernels")]
        attention = by_key[("attention", pass_, "xpkernels")]
        assert no_mods["ratio"] == pytest.approx(no_mods["median_s"] / attention["median_s"])
    if HAS_TORCH:
        for op in ("rms_norm", "layer_norm", "softmax"):
            for pass_ in ("forward", "backward"):
                ours, theirs = by_key[(op, pass_, "xpkernels")], by_key[(op, pass_, "torch")]
                assert ours["ratio"] == pytest.approx(ours["median_s"] / theirs["median_s"])
    assert "formulas:" in out and "bytes = (2*R*M + M)*s + 4*R" in out
    assert "FLOPs = 4*B*H*Sq*Sk*D / 2 (causal)" in out
    assert f"{len(rows)}/{len(rows)}" not in err  # stderr is a pipe here: no progress bar


# --------------------------------------------------------------------------- demo


def test_demo_runs_checks_its_gradient_and_samples():
    rc, out, err = run_cli("demo", "--steps", "3", "--sample", "12")
    assert rc == 0, out + err
    error = float(
        re.search(r"gradient check .* largest relative error (\S+) \(.*\) OK", out).group(1)
    )
    assert error < demo.GRADIENT_TOLERANCE
    assert len(re.findall(r"^step\s+\d+\s+loss \d+\.\d+", out, re.MULTILINE)) == 3
    assert re.search(r"planned once before the loop: \d+ buffers", out)
    lines = out.rstrip("\n").split("\n")
    assert lines[-2].startswith("sample") and lines[-1].startswith("The lamp")


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_demo_runs_on_torch_tensors():
    rc, out, err = run_cli("demo", "--array", "torch", "--steps", "2", "--sample", "4")
    assert rc == 0, out + err
    assert "arrays: torch on cpu" in out and ") OK" in out


SMALL = demo.Config(batch=4, context=16, dim=32, heads=2, layers=1, hidden=64)


def _small_model(array="numpy", dtype="float32", cfg=SMALL, seed=0):
    lib = demo.ArrayLibrary(array)
    text = demo.load_text()
    vocab = sorted(set(text))
    data = np.array([vocab.index(ch) for ch in text])
    rng = np.random.default_rng(seed)
    params64 = demo.init_params(cfg, len(vocab), rng)
    params = {name: lib.asarray(a, dtype) for name, a in params64.items()}
    return lib, params64, params, demo._batch(data, cfg, rng)


def test_demo_loss_falls():
    losses, error, *_ = demo.train(steps=40, cfg=SMALL, log=lambda line: None)
    assert error < demo.GRADIENT_TOLERANCE
    assert np.mean(losses[-5:]) < losses[0] - 0.8


@pytest.mark.parametrize("array", NAMESPACES)
def test_demo_gradient_matches_finite_differences(array):
    lib, params64, _, batch = _small_model(array)
    error, _ = demo.gradient_check(params64, SMALL, lib, None, batch)
    assert error < 1e-5


def test_gradient_check_catches_a_wrong_backward(monkeypatch):
    lib, params64, _, batch = _small_model()
    backward = demo.TinyLM.backward

    def off_by_a_little(model):
        backward(model)
        model.grads["0.norm2"][...] *= 1.01

    monkeypatch.setattr(demo.TinyLM, "backward", off_by_a_little)
    error, where = demo.gradient_check(params64, SMALL, lib, None, batch)
    assert error > 1e-3 and where in ("0.norm2", "all parameters")


def test_demo_step_overwrites_every_planned_buffer():
    """NaN in every planned buffer before the first step: nothing may leak into the loss or gradients."""
    lib, _, params, batch = _small_model()
    model = demo.TinyLM(params, SMALL, lib, "float32", None)
    for buffer in model.planned:
        buffer[...] = np.nan
    model.set_batch(*batch)
    assert math.isfinite(model.forward())
    model.backward()
    for name, grad in model.grads.items():
        assert np.all(np.isfinite(grad)), name


def test_sampling_through_decode_attention_matches_the_training_forward():
    lib, _, params, (inputs, _) = _small_model()
    model = demo.TinyLM(params, SMALL, lib, "float32", None)
    model.set_batch(inputs, inputs)
    model.forward()
    sampler = demo.Sampler(params, SMALL, lib, None)
    for pos, token in enumerate(inputs[0]):
        probs = sampler.next_probs(int(token), pos)
        np.testing.assert_allclose(probs, model.probs[pos], rtol=1e-4, atol=1e-6)


def test_generate_keeps_going_past_the_context():
    lib, _, params, _ = _small_model()
    sampler = demo.Sampler(params, SMALL, lib, None)
    tokens = sampler.generate([0, 1, 2], 2 * SMALL.context, np.random.default_rng(0))
    assert len(tokens) == 3 + 2 * SMALL.context and tokens[:3] == [0, 1, 2]
