"""CUDA-graph capture and replay of one training step of the torch demo model (``bench/device.sh``).

One step -- forward through ``xpkernels.torch.nn`` modules, ``loss.backward()``
(xpkernels' backward kernels) and ``torch.optim.Adam(capturable=True)`` --
is captured once with ``torch.cuda.graph`` over static input buffers and
replayed ``--steps`` times on fresh batches; a second copy of the model,
started from the same parameters, takes the same steps eagerly. The two
loss trajectories must agree (``--rtol``): replay computes what eager
execution computes, with no host reads or allocations outside the graph.

Writes ``OUT/torch_cuda_graph.json`` (both trajectories, the largest
relative difference, whether the graph was captured) and exits 1 when they
disagree. ``--dry-run`` (no GPU) trains a few eager steps on CPU with a
tiny model and captures nothing: it checks this script, measures nothing.

    python bench/torch_cuda_graph.py --out OUT_DIR [--steps 10] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np
import torch

from xpkernels.cli import demo
from xpkernels.cli.demo_torch import TorchLM, load_params


def _models(cfg, vocab, params64, device, backend):
    models = []
    for _ in range(2):
        model = TorchLM(cfg, vocab, backend=backend, dtype=torch.float32, device=device)
        load_params(model, params64, cfg)
        optimiser = torch.optim.Adam(
            model.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.99),
            eps=1e-8,
            capturable=device.type == "cuda",
        )
        models.append((model, optimiser))
    return models


def _eager_step(model, optimiser, tokens, targets):
    optimiser.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    optimiser.step()
    return loss


def run(out: pathlib.Path, steps: int, warmup: int, rtol: float, dry_run: bool) -> int:
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda" if cuda else "cpu")
    cfg = demo.Config()
    if not cuda:
        cfg = demo.Config(context=16, batch=2, dim=32, heads=2, layers=1, hidden=64)
    text = demo.load_text()
    vocab = sorted(set(text))
    data = np.array([vocab.index(ch) for ch in text], dtype=np.int64)
    rng = np.random.default_rng(0)
    params64 = demo.init_params(cfg, len(vocab), rng)
    batches = [
        tuple(torch.as_tensor(a, device=device) for a in demo._batch(data, cfg, rng))
        for _ in range(warmup + steps)
    ]
    (graphed, graphed_opt), (eager, eager_opt) = _models(cfg, len(vocab), params64, device, None)
    static_tokens, static_targets = (t.clone() for t in batches[0])
    eager_losses, graph_losses = [], []

    # Warm-up, identical on both copies; on CUDA on a side stream, as capture requires.
    stream = torch.cuda.Stream() if cuda else None
    for tokens, targets in batches[:warmup]:
        static_tokens.copy_(tokens)
        static_targets.copy_(targets)
        if cuda:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _eager_step(graphed, graphed_opt, static_tokens, static_targets)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            _eager_step(graphed, graphed_opt, static_tokens, static_targets)
        _eager_step(eager, eager_opt, tokens, targets)

    graph = None
    start = time.perf_counter()
    if cuda:
        graph = torch.cuda.CUDAGraph()
        graphed_opt.zero_grad(set_to_none=True)  # the graph's backward allocates and writes .grad
        with torch.cuda.graph(graph):
            static_loss = graphed(static_tokens, static_targets)
            static_loss.backward()
            graphed_opt.step()
    captured_s = time.perf_counter() - start

    for tokens, targets in batches[warmup:]:
        static_tokens.copy_(tokens)
        static_targets.copy_(targets)
        if graph is not None:
            graph.replay()
            graph_losses.append(static_loss.item())
        else:
            graph_losses.append(
                _eager_step(graphed, graphed_opt, static_tokens, static_targets).item()
            )
        eager_losses.append(_eager_step(eager, eager_opt, tokens, targets).item())

    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(graph_losses, eager_losses))
    ok = math.isfinite(worst) and worst <= rtol
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "captured": graph is not None,
        "why_not_captured": None if cuda else "no CUDA device (or --dry-run): eager steps only",
        "capture_s": captured_s,
        "warmup_steps": warmup,
        "eager_losses": eager_losses,
        "graph_losses": graph_losses,
        "max_relative_difference": worst,
        "rtol": rtol,
        "ok": ok,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_cuda_graph.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="folder for the JSON report"
    )
    parser.add_argument("--steps", type=int, default=10, help="replayed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="eager steps before capture")
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="largest relative loss difference between replay and eager (default 1e-4)",
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no capture")
    args = parser.parse_args(argv)
    return run(args.out, args.steps, args.warmup, args.rtol, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
