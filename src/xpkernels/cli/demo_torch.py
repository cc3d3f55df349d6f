r"""The demo's tiny causal transformer LM in PyTorch: ``python -m xpkernels demo --torch``.

The same model, data, initial parameters, batches and learning-rate schedule
as the NumPy demo (:mod:`xpkernels.cli.demo`), written as ``torch.nn`` modules
over xpkernels (:class:`xpkernels.torch.nn.RMSNorm`,
:class:`xpkernels.torch.nn.Attention`, :func:`xpkernels.softmax`) and
trained with ``loss.backward()`` and ``torch.optim.Adam``: autograd runs
xpkernels' own backward kernels. Step 0 compares the model's gradient, in
float64, with the same model built from PyTorch's own ops
(``F.rms_norm``, ``F.scaled_dot_product_attention``, ``torch.softmax``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..softmax import softmax as xk_softmax
from ..torch import nn as xnn
from .demo import (
    _EPS,
    GRADIENT_TOLERANCE,
    Config,
    _batch,
    _log_gradient_check,
    _sample_token,
    _start,
    _train_report,
    _train_steps,
)

__all__ = ["TorchLM", "load_params", "gradient_check", "train", "run"]


class _TorchOps:
    """PyTorch's own ops in the places xpkernels' go: the reference of the gradient check."""

    @staticmethod
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def softmax(x):
        return torch.softmax(x, dim=-1)


def _norm(dim: int, reference: bool, backend, dtype, device) -> nn.Module:
    """An RMSNorm: PyTorch's own (``reference``) or xpkernels'."""
    if reference:
        return nn.RMSNorm(dim, eps=_EPS, dtype=dtype, device=device)
    return xnn.RMSNorm(dim, eps=_EPS, backend=backend, dtype=dtype, device=device)


class _Block(nn.Module):
    def __init__(self, cfg: Config, reference: bool, backend, dtype, device):
        super().__init__()
        c, factory = cfg.dim, {"dtype": dtype, "device": device}
        self.norm1, self.norm2 = (_norm(c, reference, backend, dtype, device) for _ in range(2))
        self.attn = xnn.Attention(c, cfg.heads, causal=True, backend=backend, **factory)
        self.reference = reference
        self.up = nn.Linear(c, cfg.hidden, bias=False, **factory)
        self.down = nn.Linear(cfg.hidden, c, bias=False, **factory)

    def _attend(self, h):
        if not self.reference:
            return self.attn(h)
        a, (b, t, _) = self.attn, h.shape
        q, k, v = (a._heads(p(h), a.num_heads, b, t) for p in (a.q_proj, a.k_proj, a.v_proj))
        o = _TorchOps.attention(q, k, v)
        return a.o_proj(o.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim))

    def forward(self, h):
        h = h + self._attend(self.norm1(h))
        return h + self.down(F.gelu(self.up(self.norm2(h)), approximate="tanh"))


class TorchLM(nn.Module):
    """Embeddings, ``cfg.layers`` pre-norm blocks, a final RMSNorm and the head, then softmax.

    Parameters
    ----------
    cfg : Config
    vocab : int
    reference : bool
        Build it from PyTorch's own norm, attention and softmax instead of
        xpkernels' (the gradient check's reference).
    backend : str, optional
        Explicit xpkernels backend.
    dtype, device
        Of the parameters.
    """

    def __init__(
        self, cfg: Config, vocab: int, *, reference=False, backend=None, dtype=None, device=None
    ):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.reference, self.backend = reference, backend
        self.tok_emb = nn.Parameter(torch.empty(vocab, cfg.dim, **factory))
        self.pos_emb = nn.Parameter(torch.empty(cfg.context, cfg.dim, **factory))
        self.blocks = nn.ModuleList(
            _Block(cfg, reference, backend, dtype, device) for _ in range(cfg.layers)
        )
        self.norm_f = _norm(cfg.dim, reference, backend, dtype, device)
        self.head = nn.Linear(cfg.dim, vocab, bias=False, **factory)

    def probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-character probabilities ``(B, T, vocab)`` for ``(B, T)`` character ids."""
        h = self.tok_emb[tokens] + self.pos_emb[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm_f(h))
        if self.reference:
            return _TorchOps.softmax(logits)
        return xk_softmax(logits, backend=self.backend)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` (as the NumPy demo computes it)."""
        p = self.probs(tokens)
        picked = torch.gather(p, -1, targets[..., None])[..., 0]
        tiny = torch.finfo(p.dtype).tiny
        return -torch.log(torch.clamp(picked, min=tiny)).mean()


def load_params(model: TorchLM, params64: dict, cfg: Config) -> None:
    """Copy the NumPy demo's parameters (``x @ W`` layout) into the modules (``x @ W.T``)."""
    c = cfg.dim

    def put(param, array):
        with torch.no_grad():
            param.copy_(torch.as_tensor(np.ascontiguousarray(array)))

    put(model.tok_emb, params64["tok_emb"])
    put(model.pos_emb, params64["pos_emb"])
    blocks: list[Any] = list(model.blocks)  # nn.ModuleList items are typed as Module
    for l, block in enumerate(blocks):
        qkv = params64[f"{l}.qkv"]
        for i, proj in enumerate((block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)):
            put(proj.weight, qkv[:, i * c : (i + 1) * c].T)
        put(block.attn.o_proj.weight, params64[f"{l}.proj"].T)
        put(block.norm1.weight, params64[f"{l}.norm1"])
        put(block.norm2.weight, params64[f"{l}.norm2"])
        put(block.up.weight, params64[f"{l}.up"].T)
        put(block.down.weight, params64[f"{l}.down"].T)
    put(model.norm_f.weight, params64["norm_f"])
    put(model.head.weight, params64["head"].T)


def _tensors(batch, device):
    return tuple(torch.as_tensor(a, device=device) for a in batch)


def gradient_check(params64, cfg, vocab, batch, backend, device) -> tuple[float, str]:
    """Largest relative gradient error (and its parameter) vs the PyTorch-ops model, in float64."""
    grads: list[dict[str, Any]] = []
    for reference in (False, True):
        model = TorchLM(
            cfg, vocab, reference=reference, backend=backend, dtype=torch.float64, device=device
        )
        load_params(model, params64, cfg)
        model(*_tensors(batch, device)).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    worst = (0.0, "")
    for name, got in grads[0].items():
        want = grads[1][name]
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
        worst = max(worst, (error, name))
    return worst


def train(steps=300, device="cpu", backend=None, seed=0, cfg: Config = Config(), log=print):
    """Train the model; returns ``(losses, gradient_error, model, vocab)``."""
    _, vocab, data, rng, params64 = _start(cfg, seed)
    model = TorchLM(cfg, len(vocab), backend=backend, dtype=torch.float32, device=device)
    load_params(model, params64, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"tiny causal transformer LM (torch.nn modules over xpkernels): {cfg.layers} layers, "
        f"width {cfg.dim}, {cfg.heads} heads, context {cfg.context}, {n_params:,} parameters"
    )
    log(f"device: {device}; backend: {backend or 'automatic'}; loss.backward() + torch.optim.Adam")
    batch = _batch(data, cfg, rng)
    check_backend = "array_api" if backend == "triton" else backend
    error, where = gradient_check(params64, cfg, len(vocab), batch, check_backend, device)
    against = "float64, vs the same model on F.rms_norm / SDPA / torch.softmax"
    _log_gradient_check(log, against, error, where)
    optimiser = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), eps=1e-8)

    def step(batch, lr: float) -> float:
        for group in optimiser.param_groups:
            group["lr"] = lr
        loss = model(*_tensors(batch, device))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        return loss.item()

    losses = _train_steps(step, steps, cfg, data, rng, batch, log)
    return losses, error, model, vocab


@torch.no_grad()
def sample(model: TorchLM, vocab, prompt: str, count: int, cfg: Config, seed=0, temperature=0.8):
    """``prompt`` and ``count`` sampled characters (each step re-reads the last ``T``)."""
    device = model.tok_emb.device
    rng = np.random.default_rng(seed)
    tokens = [vocab.index(ch) for ch in prompt]
    for _ in range(count):
        window = torch.tensor([tokens[-cfg.context :]], device=device)
        probs = model.probs(window)[0, -1].double().cpu().numpy()
        tokens.append(_sample_token(probs, rng, temperature))
    return "".join(vocab[i] for i in tokens)


def run(steps=300, device="cpu", backend=None, seed=0, sample_chars=120) -> int:
    """The ``demo --torch`` command: train, report, sample; 1 when the gradient check fails."""
    cfg = Config()
    _, error, model, vocab = _train_report(train, steps, device, backend, seed, cfg)
    if sample_chars > 0:
        print("sample:")
        print(sample(model, vocab, "The lamp", sample_chars, cfg, seed))
    return 0 if error <= GRADIENT_TOLERANCE else 1
