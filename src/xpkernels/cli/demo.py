r"""Train a tiny causal transformer language model with xpkernels: ``python -m xpkernels demo``.

The model reads characters of ``xpkernels/data/tiny.txt`` and predicts the next
one. Pre-norm blocks, written with the in-place primitives for the fused parts
and plain Array API operations (matmul, tanh) for the rest:

.. math::

    h_0 &= E_{\text{tok}}[x] + E_{\text{pos}} \\
    a_l &= h_l + \operatorname{attention}(\operatorname{rms\_norm}(h_l)\,W^{qkv}_l,\ \text{causal})\,W^{o}_l \\
    h_{l+1} &= a_l + \operatorname{gelu}(\operatorname{rms\_norm}(a_l)\,W^{up}_l)\,W^{down}_l \\
    p &= \operatorname{softmax}(\operatorname{rms\_norm}(h_L)\,W^{head}), \qquad
    \text{loss} = -\tfrac{1}{N}\textstyle\sum_n \log p_{n, y_n}

The backward is written by hand with the in-place backward primitives and
:class:`~xpkernels.Duplicated`: the cross-entropy's cotangent ``-1/(N p)`` at
the targets goes through ``softmax_backward_`` (``dx = p * (dy - sum(p * dy))``
gives the familiar ``p - onehot``), the attention's ``dq, dk, dv`` land in
strided views of one ``(B, T, 3, H, D)`` buffer so one matmul gives ``dW_qkv``.

Every kernel buffer -- outputs, shadows, checkpoints and scratch -- is
allocated once, before the loop, and reused each step. Step 0 checks the whole
model gradient against central finite differences in float64. After training,
the model writes a sample one character at a time through ``decode_attention_``
over a key/value cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import array_api_compat
import numpy as np

from ..attention import attention_, attention_backward_
from ..buffers import Duplicated, allocate_checkpoints, allocate_scratchspace
from ..decode_attention import decode_attention_
from ..registry import BACKENDS, resolve
from ..rms_norm import rms_norm_, rms_norm_backward_
from ..softmax import softmax_, softmax_backward_

__all__ = [
    "ArrayLibrary",
    "Config",
    "Sampler",
    "TinyLM",
    "gradient_check",
    "init_params",
    "load_text",
    "run",
    "train",
]

#: Largest relative error the finite-difference check accepts. Float64 inputs
#: meet float32 checkpoints (DESIGN section 2), which bound the agreement near 1e-7.
GRADIENT_TOLERANCE = 1e-4
_EPS = 1e-6  # RMSNorm epsilon
_GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class Config:
    """Model and training sizes."""

    context: int = 64  #: T, characters per training sequence
    batch: int = 16  #: B, sequences per step
    dim: int = 64  #: C, model width
    heads: int = 4  #: H, attention heads (head dim C / H)
    layers: int = 2  #: L, transformer blocks
    hidden: int = 256  #: F, MLP width
    lr: float = 1e-2  #: Adam's peak learning rate (cosine decay to a tenth)


def load_text() -> str:
    """The training text shipped with the package."""
    return resources.files("xpkernels").joinpath("data/tiny.txt").read_text(encoding="utf-8")


def _start(cfg: Config, seed: int):
    """The text, its characters ``vocab``, the text as their indices, the rng, the parameters."""
    text = load_text()
    vocab = sorted(set(text))
    data = np.array([vocab.index(ch) for ch in text], dtype=np.int64)
    rng = np.random.default_rng(seed)
    return text, vocab, data, rng, init_params(cfg, len(vocab), rng)


class ArrayLibrary:
    """The array library the model runs on: its namespace, a device, conversions from NumPy."""

    def __init__(self, name: str = "numpy", device: str = "cpu"):
        self.name = name
        self.device = None
        if name == "torch":
            import torch

            self.device = torch.device(device)
        elif device != "cpu":
            raise ValueError(
                f"ArrayLibrary: device {device!r} needs torch ({name} runs on the CPU)"
            )
        module = {"numpy": "numpy", "torch": "torch", "array_api_strict": "array_api_strict"}[name]
        self.xp = array_api_compat.array_namespace(__import__(module).asarray([0.0]))

    def asarray(self, a, dtype):
        """A copy of ``a`` (NumPy) as an array of this library, in ``dtype`` ("float32", "float64", "int64")."""
        return self.xp.asarray(
            np.asarray(a), dtype=getattr(self.xp, dtype), device=self.device, copy=True
        )

    def empty(self, shape, dtype):
        return self.xp.empty(tuple(shape), dtype=getattr(self.xp, dtype), device=self.device)

    def to_numpy(self, a) -> np.ndarray:
        if array_api_compat.is_torch_array(a):
            return a.detach().cpu().numpy()
        return np.from_dlpack(a)


def param_shapes(cfg: Config, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, by name."""
    c, f = cfg.dim, cfg.hidden
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (vocab, c), "pos_emb": (cfg.context, c)}
    for l in range(cfg.layers):
        shapes |= {
            f"{l}.norm1": (c,),
            f"{l}.qkv": (c, 3 * c),
            f"{l}.proj": (c, c),
            f"{l}.norm2": (c,),
            f"{l}.up": (c, f),
            f"{l}.down": (f, c),
        }
    return shapes | {"norm_f": (c,), "head": (c, vocab)}


def init_params(cfg: Config, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float64 initial parameters: unit norm weights, fan-in scaled matrices, residual outputs shrunk."""
    residual = 1.0 / math.sqrt(2 * cfg.layers)
    params = {}
    for name, shape in param_shapes(cfg, vocab).items():
        kind = name.split(".")[-1]
        if kind.startswith("norm"):
            params[name] = np.ones(shape)
            continue
        std = {"tok_emb": 1.0, "pos_emb": 0.3}.get(kind, 1.0 / math.sqrt(shape[0]))
        if kind in ("proj", "down"):
            std *= residual
        if kind == "head":
            std *= 0.5
        params[name] = rng.standard_normal(shape) * std
    return params


def _gelu(xp, u):
    return 0.5 * u * (1.0 + xp.tanh(_GELU_C * (u + 0.044715 * u * u * u)))


def _gelu_grad(xp, u):
    t = xp.tanh(_GELU_C * (u + 0.044715 * u * u * u))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * u * u)


class TinyLM:
    """The model with every buffer of one training step planned up front.

    Parameters
    ----------
    params : dict of str to array
        The parameters (updated in place by the optimiser; the Duplicated
        pairs built here keep referring to them).
    cfg : Config
    lib : ArrayLibrary
    dtype : str
        "float32" or "float64" (the gradient check).
    backend : str or None
        Explicit xpkernels backend, or None for automatic routing.

    Shapes
    ------
    Activations are kept flat as ``(N, C)`` with ``N = B * T``; the attention
    sees ``(B, H, T, D)`` views of ``(B, T, 3, H, D)`` / ``(B, T, H, D)`` buffers
    (BSHD layout, no copies).
    """

    def __init__(
        self, params: dict, cfg: Config, lib: ArrayLibrary, dtype: str, backend: str | None
    ):
        self.params, self.cfg, self.lib, self.backend, self.dtype = params, cfg, lib, backend, dtype
        xp = self.xp = lib.xp
        self.tiny = float(np.finfo(dtype).tiny)  # keeps log(p) and 1/p finite
        b, t, c, h, f, L = cfg.batch, cfg.context, cfg.dim, cfg.heads, cfg.hidden, cfg.layers
        d, n = c // h, cfg.batch * cfg.context
        vocab = params["tok_emb"].shape[0]
        self.shape = {"B": b, "T": t, "C": c, "H": h, "D": d, "N": n, "F": f, "V": vocab}
        self.planned: list = []

        def new(*shape):
            a = lib.empty(shape, dtype)
            self.planned.append(a)
            return a

        def heads(a):  # (B, T, H, D) -> (B, H, T, D) view
            return xp.permute_dims(a, (0, 2, 1, 3))

        self.grads = {name: new(*p.shape) for name, p in params.items()}
        self.onehot_in, self.onehot_out = new(n, vocab), new(n, vocab)
        # forward activations, kept for the backward
        self.h = [new(n, c) for _ in range(L + 1)]  # residual stream entering each block
        self.n1, self.mid, self.n2 = ([new(n, c) for _ in range(L)] for _ in range(3))
        self.qkv = [new(b, t, 3, h, d) for _ in range(L)]
        self.o = [new(b, t, h, d) for _ in range(L)]
        self.u, self.g = ([new(n, f) for _ in range(L)] for _ in range(2))
        self.nf, self.logits, self.probs = new(n, c), new(n, vocab), new(n, vocab)
        # shadows, shared by the layers: the backward visits one layer at a time
        self.dres = new(n, c)  # d loss / d residual stream
        self.dnorm_out, self.dnorm_in = new(n, c), new(n, c)
        self.dqkv, self.do = new(b, t, 3, h, d), new(b, t, h, d)
        self.dprobs, self.dlogits = new(n, vocab), new(n, vocab)

        def norm(out, x, weight, dx):  # the (out, x, weight) pairs of one rms_norm
            return (
                Duplicated(out, self.dnorm_out),
                Duplicated(x, dx),
                Duplicated(params[weight], self.grads[weight]),
            )

        self.norm1 = [norm(self.n1[l], self.h[l], f"{l}.norm1", self.dnorm_in) for l in range(L)]
        self.norm2 = [norm(self.n2[l], self.mid[l], f"{l}.norm2", self.dnorm_in) for l in range(L)]
        self.norm_f = norm(self.nf, self.h[L], "norm_f", self.dres)
        self.attn = [
            (
                Duplicated(heads(self.o[l]), heads(self.do)),
                *(
                    Duplicated(heads(self.qkv[l][:, :, i, ...]), heads(self.dqkv[:, :, i, ...]))
                    for i in range(3)
                ),
            )
            for l in range(L)
        ]
        self.head_out = (Duplicated(self.probs, self.dprobs), Duplicated(self.logits, self.dlogits))

        def checkpoints(function, pairs):  # those of ``function(out, *inputs)``, planned
            ck = allocate_checkpoints(function, *(a.primal for a in pairs[1:]))
            self.planned.extend(ck)
            return ck

        self.ck_n1 = [checkpoints(rms_norm_, norm) for norm in self.norm1]
        self.ck_n2 = [checkpoints(rms_norm_, norm) for norm in self.norm2]
        self.ck_nf = checkpoints(rms_norm_, self.norm_f)
        self.ck_attn = [checkpoints(attention_, attn) for attn in self.attn]
        self.norm_scratch = allocate_scratchspace(rms_norm_backward_, *self.norm_f, backend=backend)
        self.attn_scratch = allocate_scratchspace(attention_backward_, *self.attn[0])
        self.planned.extend([*self.norm_scratch, *self.attn_scratch])

    @property
    def planned_bytes(self) -> int:
        """Bytes of every buffer allocated up front (activations, shadows, checkpoints, scratch, grads)."""
        return sum(math.prod(a.shape) * self.xp.finfo(a.dtype).bits // 8 for a in self.planned)

    def set_batch(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """Load one batch of ``(B, T)`` character ids (NumPy) into the planned one-hot buffers."""
        eye = np.eye(self.shape["V"])
        self.onehot_in[...] = self.lib.asarray(eye[inputs.reshape(-1)], self.dtype)
        self.onehot_out[...] = self.lib.asarray(eye[targets.reshape(-1)], self.dtype)

    def _norm(self, norm: tuple, checkpoints) -> None:
        """``rms_norm_`` over the primals of ``norm`` (one of :attr:`norm1`, ...)."""
        rms_norm_(
            *(a.primal for a in norm), eps=_EPS, checkpoints=checkpoints, backend=self.backend
        )

    def forward(self) -> float:
        """The mean cross-entropy of the loaded batch; fills activations and checkpoints."""
        xp, p, s, opts = self.xp, self.params, self.shape, {"backend": self.backend}
        b, t, c = s["B"], s["T"], s["C"]
        tokens = xp.reshape(self.onehot_in @ p["tok_emb"], (b, t, c))
        self.h[0][...] = xp.reshape(tokens + p["pos_emb"], (b * t, c))
        for l in range(self.cfg.layers):
            self._norm(self.norm1[l], self.ck_n1[l])
            self.qkv[l][...] = xp.reshape(self.n1[l] @ p[f"{l}.qkv"], self.qkv[l].shape)
            o, q, k, v = (a.primal for a in self.attn[l])
            attention_(o, q, k, v, causal=True, checkpoints=self.ck_attn[l], **opts)
            self.mid[l][...] = self.h[l] + xp.reshape(self.o[l], (b * t, c)) @ p[f"{l}.proj"]
            self._norm(self.norm2[l], self.ck_n2[l])
            self.u[l][...] = self.n2[l] @ p[f"{l}.up"]
            self.g[l][...] = _gelu(xp, self.u[l])
            self.h[l + 1][...] = self.mid[l] + self.g[l] @ p[f"{l}.down"]
        self._norm(self.norm_f, self.ck_nf)
        self.logits[...] = self.nf @ p["head"]
        softmax_(self.probs, self.logits, **opts)
        picked = xp.sum(self.onehot_out * self.probs, axis=-1)
        return -float(xp.mean(xp.log(xp.maximum(picked, self.tiny))))

    def backward(self) -> None:
        """Overwrite ``self.grads`` with d loss / d params of the last :meth:`forward`."""
        xp, p, g, s, opts = self.xp, self.params, self.grads, self.shape, {"backend": self.backend}
        n, c = s["N"], s["C"]
        self.dprobs[...] = self.onehot_out * (-1.0 / n) / xp.maximum(self.probs, self.tiny)
        softmax_backward_(*self.head_out, **opts)
        g["head"][...] = self.nf.T @ self.dlogits
        self.dnorm_out[...] = self.dlogits @ p["head"].T
        rms_norm_backward_(*self.norm_f, checkpoints=self.ck_nf, scratch=self.norm_scratch, **opts)
        for l in reversed(range(self.cfg.layers)):
            g[f"{l}.down"][...] = self.g[l].T @ self.dres
            du = (self.dres @ p[f"{l}.down"].T) * _gelu_grad(xp, self.u[l])
            g[f"{l}.up"][...] = self.n2[l].T @ du
            self.dnorm_out[...] = du @ p[f"{l}.up"].T
            rms_norm_backward_(
                *self.norm2[l], checkpoints=self.ck_n2[l], scratch=self.norm_scratch, **opts
            )
            self.dres += self.dnorm_in
            g[f"{l}.proj"][...] = xp.reshape(self.o[l], (n, c)).T @ self.dres
            self.do[...] = xp.reshape(self.dres @ p[f"{l}.proj"].T, self.do.shape)
            attention_backward_(
                *self.attn[l],
                checkpoints=self.ck_attn[l],
                scratch=self.attn_scratch,
                causal=True,
                **opts,
            )
            dqkv = xp.reshape(self.dqkv, (n, 3 * c))
            g[f"{l}.qkv"][...] = self.n1[l].T @ dqkv
            self.dnorm_out[...] = dqkv @ p[f"{l}.qkv"].T
            rms_norm_backward_(
                *self.norm1[l], checkpoints=self.ck_n1[l], scratch=self.norm_scratch, **opts
            )
            self.dres += self.dnorm_in
        g["pos_emb"][...] = xp.sum(xp.reshape(self.dres, (s["B"], s["T"], c)), axis=0)
        g["tok_emb"][...] = self.onehot_in.T @ self.dres


class Adam:
    """Adam with bias correction, updating the parameters in place."""

    def __init__(self, params: dict, betas=(0.9, 0.99), eps=1e-8):
        xp = array_api_compat.array_namespace(*params.values())
        self.params, self.betas, self.eps, self.t = params, betas, eps, 0
        self.m = {name: xp.zeros_like(a) for name, a in params.items()}
        self.v = {name: xp.zeros_like(a) for name, a in params.items()}
        self.xp = xp

    def step(self, grads: dict, lr: float) -> None:
        b1, b2 = self.betas
        self.t += 1
        step = lr / (1 - b1**self.t)
        v_scale = 1.0 / (1 - b2**self.t)
        for name, param in self.params.items():
            grad, m, v = grads[name], self.m[name], self.v[name]
            m *= b1
            m += (1 - b1) * grad
            v *= b2
            v += (1 - b2) * grad * grad
            param -= step * m / (self.xp.sqrt(v * v_scale) + self.eps)


def _batch(
    data: np.ndarray, cfg: Config, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    starts = rng.integers(0, len(data) - cfg.context - 1, size=cfg.batch)
    windows = np.stack([data[s : s + cfg.context + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def _train_steps(step, steps: int, cfg: Config, data, rng, batch, log) -> list[float]:
    """The losses of ``steps`` optimiser steps ``step(batch, lr)``, the lr on a cosine decay."""
    losses = []
    start = time.perf_counter()
    every = max(1, steps // 10)
    for i in range(steps):
        lr = cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * i / max(steps, 1))))
        losses.append(step(batch, lr))
        if i % every == 0 or i == steps - 1:
            log(f"step {i:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.1f} s)")
        batch = _batch(data, cfg, rng)
    return losses


def _log_gradient_check(log, against: str, error: float, where: str) -> None:
    verdict = (
        "OK" if error <= GRADIENT_TOLERANCE else f"FAILED (tolerance {GRADIENT_TOLERANCE:.0e})"
    )
    log(
        f"step 0 gradient check ({against}): largest relative error {error:.1e} ({where}) {verdict}"
    )


def _sample_token(probs: np.ndarray, rng: np.random.Generator, temperature: float) -> int:
    """A character drawn from ``probs`` sharpened by ``temperature``."""
    logits = np.log(np.maximum(probs, 1e-30)) / temperature
    weights = np.exp(logits - logits.max())
    return int(rng.choice(len(weights), p=weights / weights.sum()))


def gradient_check(params64: dict, cfg: Config, lib: ArrayLibrary, backend, batch, seed: int = 0):
    """Compare the hand-written backward with central differences, in float64.

    For every parameter, and once for all of them together, the directional
    derivative along a random direction ``u`` -- ``sum(grad * u)`` from the
    backward -- against ``(loss(p + e u) - loss(p - e u)) / 2e``.

    Returns
    -------
    (float, str)
        The largest relative error and the parameter it was measured on.
    """
    xp = lib.xp
    params = {name: lib.asarray(a, "float64") for name, a in params64.items()}
    model = TinyLM(params, cfg, lib, "float64", backend)
    model.set_batch(*batch)
    model.forward()
    model.backward()
    rng = np.random.default_rng(seed)
    directions = {name: rng.standard_normal(a.shape) for name, a in params64.items()}
    trials = [(name, {name: directions[name]}) for name in params64] + [
        ("all parameters", directions)
    ]
    step = 1e-5
    worst = (0.0, "")
    for label, direction in trials:
        u = {name: lib.asarray(d, "float64") for name, d in direction.items()}
        analytic = sum(float(xp.sum(model.grads[name] * u[name])) for name in u)
        losses = []
        for sign in (1.0, -1.0):
            for name, direction_array in u.items():
                params[name][...] = (
                    lib.asarray(params64[name], "float64") + sign * step * direction_array
                )
            losses.append(model.forward())
        for name in u:
            params[name][...] = lib.asarray(params64[name], "float64")
        numeric = (losses[0] - losses[1]) / (2 * step)
        error = abs(numeric - analytic) / max(abs(numeric), abs(analytic), 1e-30)
        worst = max(worst, (error, label))
    return worst


class Sampler:
    """Generates text one character at a time: ``decode_attention_`` over per-layer key/value caches.

    Every buffer (caches, the one-row activations, decode scratch) is
    allocated here once. When the cache is full the last half of the text is
    fed again from position 0 (the model knows ``T`` positions).
    """

    def __init__(self, params: dict, cfg: Config, lib: ArrayLibrary, backend: str | None):
        self.params, self.cfg, self.lib, self.backend = params, cfg, lib, backend
        h, c, t = cfg.heads, cfg.dim, cfg.context
        d = c // h
        self.k_cache = [lib.empty((1, h, t, d), "float32") for _ in range(cfg.layers)]
        self.v_cache = [lib.empty((1, h, t, d), "float32") for _ in range(cfg.layers)]
        self.q, self.o = lib.empty((1, h, d), "float32"), lib.empty((1, h, d), "float32")
        self.x, self.n = lib.empty((1, c), "float32"), lib.empty((1, c), "float32")
        self.probs = lib.empty((1, params["head"].shape[1]), "float32")
        self.lengths = lib.asarray([0], "int64")
        self.scratch = allocate_scratchspace(
            decode_attention_,
            self.o,
            self.q,
            self.k_cache[0],
            self.v_cache[0],
            self.lengths,
            backend=backend,
        )

    def next_probs(self, token: int, pos: int) -> np.ndarray:
        """Feed ``token`` at position ``pos``; the next character's probabilities."""
        xp, p, opts = self.lib.xp, self.params, {"backend": self.backend}
        h, c = self.cfg.heads, self.cfg.dim
        self.x[...] = p["tok_emb"][token : token + 1, :] + p["pos_emb"][pos : pos + 1, :]
        self.lengths[...] = pos + 1
        for l in range(self.cfg.layers):
            rms_norm_(self.n, self.x, p[f"{l}.norm1"], eps=_EPS, **opts)
            qkv = xp.reshape(self.n @ p[f"{l}.qkv"], (3, h, c // h))
            self.q[...] = qkv[0:1, :, :]
            self.k_cache[l][0, :, pos, :] = qkv[1, :, :]
            self.v_cache[l][0, :, pos, :] = qkv[2, :, :]
            decode_attention_(
                self.o,
                self.q,
                self.k_cache[l],
                self.v_cache[l],
                self.lengths,
                scratch=self.scratch,
                **opts,
            )
            self.x += xp.reshape(self.o, (1, c)) @ p[f"{l}.proj"]
            rms_norm_(self.n, self.x, p[f"{l}.norm2"], eps=_EPS, **opts)
            self.x += _gelu(xp, self.n @ p[f"{l}.up"]) @ p[f"{l}.down"]
        rms_norm_(self.n, self.x, p["norm_f"], eps=_EPS, **opts)
        softmax_(self.probs, self.n @ p["head"], **opts)
        return self.lib.to_numpy(self.probs)[0].astype(np.float64)

    def generate(
        self, prompt: list[int], count: int, rng: np.random.Generator, temperature=0.8
    ) -> list[int]:
        """``prompt`` followed by ``count`` sampled characters."""
        tokens = list(prompt)
        window: list = []
        probs: Any = None
        for token in tokens:
            probs, window = self._feed(token, window)
        for _ in range(count):
            tokens.append(_sample_token(probs, rng, temperature))
            probs, window = self._feed(tokens[-1], window)
        return tokens

    def _feed(self, token: int, window: list[int]):
        if len(window) == self.cfg.context:
            window = window[len(window) // 2 :]
            for pos, earlier in enumerate(window):
                self.next_probs(earlier, pos)
        probs = self.next_probs(token, len(window))
        return probs, window + [token]


def _float64_backend(backend: str | None) -> str | None:
    """``backend`` when it computes every op of the model in float64, else ``"array_api"``."""
    spec = next((b for b in BACKENDS if b.name == backend), None)
    if spec is None:
        return backend
    ops = ("rms_norm", "attention", "softmax")
    return backend if all("float64" in spec.ops[op].dtypes for op in ops) else "array_api"


def train(
    steps: int = 300,
    array: str = "numpy",
    device: str = "cpu",
    backend=None,
    seed: int = 0,
    cfg: Config = Config(),
    log=print,
):
    """Train the model; returns ``(losses, gradient_error, params, lib, vocab)``.

    ``log`` receives the progress lines (``print`` by default).
    """
    lib = ArrayLibrary(array, device)
    text, vocab, data, rng, params64 = _start(cfg, seed)
    params = {name: lib.asarray(a, "float32") for name, a in params64.items()}
    model = TinyLM(params, cfg, lib, "float32", backend)
    route = resolve("attention", {"q": model.h[0]}, backend=backend).backend
    n_params = sum(a.size for a in params64.values())
    log(
        f"tiny causal transformer LM: {cfg.layers} layers, width {cfg.dim}, {cfg.heads} heads, "
        f"context {cfg.context}, {n_params:,} parameters"
    )
    log(f"data: xpkernels/data/tiny.txt, {len(text):,} characters, {len(vocab)} distinct")
    log(f"arrays: {array} on {device}; backend: {backend or f'automatic ({route})'}")
    log(
        f"planned once before the loop: {len(model.planned)} buffers (activations, shadows, "
        f"checkpoints, scratch, gradients), {model.planned_bytes / 2**20:.1f} MiB"
    )

    batch = _batch(data, cfg, rng)
    check_backend = _float64_backend(backend)
    if check_backend != backend:
        log(f"{backend} computes no float64: the gradient check runs on {check_backend}")
    error, where = gradient_check(params64, cfg, lib, check_backend, batch, seed)
    against = "float64 central differences, a random direction per parameter and one over all"
    _log_gradient_check(log, against, error, where)

    optimiser = Adam(params)

    def step(batch, lr: float) -> float:
        model.set_batch(*batch)
        loss = model.forward()
        model.backward()
        optimiser.step(model.grads, lr)
        return loss

    losses = _train_steps(step, steps, cfg, data, rng, batch, log)
    return losses, error, params, lib, vocab


def _train_report(train, steps: int, *args):
    """``train(steps, *args)``, its losses summed up in a printed line; returns its result."""
    start = time.perf_counter()
    result = train(steps, *args)
    elapsed = time.perf_counter() - start
    losses, vocab = result[0], result[-1]
    last = losses[-10:]
    print(
        f"loss {losses[0]:.3f} at step 0 -> {sum(last) / len(last):.3f} (mean of the last "
        f"{len(last)} steps) in {elapsed:.1f} s; guessing uniformly scores {math.log(len(vocab)):.3f}"
    )
    return result


def run(steps=300, array="numpy", device="cpu", backend=None, seed=0, sample=120) -> int:
    """The ``demo`` command: train, report, sample; 1 when the gradient check fails."""
    cfg = Config()
    _, error, params, lib, vocab = _train_report(train, steps, array, device, backend, seed, cfg)
    if sample > 0:
        sampler = Sampler(params, cfg, lib, backend)
        prompt = [vocab.index(ch) for ch in "The lamp"]
        tokens = sampler.generate(prompt, sample, np.random.default_rng(seed))
        print("sample (decode_attention over a key/value cache):")
        print("".join(vocab[i] for i in tokens))
    return 0 if error <= GRADIENT_TOLERANCE else 1
