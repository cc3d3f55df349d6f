"""Train a tiny Llama from transformers on xpkernels' kernels, next to the same model in eager mode.

Both models start from the same random weights (built from a config: nothing
is downloaded) and see the same batches of random tokens, left-padded; one
line, ``apply_xpkernels(model)``, puts the other on xpkernels' attention,
RMSNorm and SwiGLU. The two loss curves are printed side by side; they agree to float32
rounding.

Run: ``python examples/hf_train.py [--steps N]`` (needs ``pip install
'xpkernels[transformers]'``).
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xpkernels.torch.transformers import apply_xpkernels


def batches(steps: int, batch: int = 4, seq: int = 32, vocab: int = 256, seed: int = 0):
    """``steps`` (input_ids, attention_mask, labels) of random tokens, each row left-padded."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        pad = torch.randint(0, seq // 4, (batch,), generator=g)
        mask = (torch.arange(seq)[None, :] >= pad[:, None]).long()
        first = torch.nn.functional.pad(mask[:, :-1], (1, 0)) == 0  # nothing predicts it
        yield ids, mask, ids.masked_fill((mask == 0) | first, -100)


def train(model, steps: int) -> list[float]:
    """AdamW on :func:`batches`; the loss of every step."""
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids, mask, labels in batches(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def main(steps: int = 40) -> tuple[list[float], list[float]]:
    """Train both models; returns (eager losses, xpkernels losses)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    eager = LlamaForCausalLM(config)
    model = apply_xpkernels(copy.deepcopy(eager))  # the one line a user adds
    print(model.xpkernels_report)
    curves = train(eager, steps), train(model, steps)
    print(f"{'step':>4}  {'eager':>10}  {'xpkernels':>10}")
    for step, (a, b) in enumerate(zip(*curves)):
        print(f"{step:>4}  {a:>10.6f}  {b:>10.6f}")
    return curves


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    main(parser.parse_args().steps)
