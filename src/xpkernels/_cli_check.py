"""``python -m xpkernels check``: every primitive on every available backend vs float64.

For each primitive x available target (backend x array namespace x device)
the check runs one small float32 case through the in-place forward (with
checkpoints) and the in-place backward (into NaN-filled shadows, so a shadow
element left unwritten shows up as an infinite error), and compares outputs,
checkpoints and gradients with the naive float64 references below, computed
from the same float32-rounded inputs. Errors are
``max|actual - reference| / max(max|reference|, 1)``.

The references are deliberately naive (whole matrices, no tiling) and share
no code with ``backends/``. The full cross-backend suite, with every dtype and
edge case, is ``pytest conformance``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .buffers import Duplicated, allocate_checkpoints, allocate_scratchspace
from .registry import BACKENDS, OPS, BackendError, resolve

#: Largest allowed error of the float32 case, per primitive: (forward, backward).
TOLERANCES = {
    "rms_norm": (2e-5, 4e-5),
    "layer_norm": (2e-5, 4e-5),
    "softmax": (2e-5, 4e-5),
    "attention": (5e-5, 1e-4),
    "decode_attention": (5e-5, None),
    "flex_attention": (5e-5, 1e-4),
}


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A backend running on one array namespace's arrays on one device."""

    backend: str
    namespace: str
    device: str

    @property
    def label(self) -> str:
        return f"{self.namespace} {self.device}"

    def asarray(self, a: np.ndarray, float32: bool = True):
        """``a`` on this target: floats as float32, integers as int64."""
        a = np.ascontiguousarray(a, dtype=np.float32 if float32 else np.int64)
        if self.namespace == "torch":
            import torch

            return torch.from_numpy(a).to(self.device)
        if self.namespace == "cupy":
            import cupy

            return cupy.asarray(a)
        if self.namespace == "array_api_strict":
            import array_api_strict

            return array_api_strict.asarray(a)
        return a

    def nan_like(self, a):
        """A NaN-filled array like ``a``: a buffer whose every element must be overwritten."""
        import array_api_compat

        return array_api_compat.array_namespace(a).full_like(a, float("nan"))

    def to_numpy(self, a) -> np.ndarray:
        """``a`` as NumPy float64."""
        if self.namespace == "torch":
            a = a.detach().cpu().numpy()
        elif self.namespace == "cupy":
            a = a.get()
        else:
            a = np.from_dlpack(a)
        return np.asarray(a, dtype=np.float64)


def _candidates() -> list[Target]:
    targets = [
        Target("array_api", "numpy", "cpu"),
        Target("array_api", "torch", "cpu"),
        Target("array_api", "array_api_strict", "cpu"),
        Target("array_api", "torch", "cuda"),
        Target("array_api", "cupy", "cuda"),
    ]
    for backend in BACKENDS:
        if backend.name != "array_api":
            targets += [
                Target(backend.name, ns, dev)
                for ns in backend.namespaces
                for dev in backend.devices
            ]
    return targets


def _unavailable(target: Target) -> str | None:
    """Why ``target`` cannot run any primitive here, or None."""
    if importlib.util.find_spec(target.namespace) is None:
        return f"{target.namespace} is not installed"
    if target.device == "cuda":
        if target.namespace == "torch":
            import torch

            if not torch.cuda.is_available():
                return "torch reports no CUDA device"
        if target.namespace == "cupy":
            import cupy

            try:
                cupy.cuda.runtime.getDeviceCount()
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                return f"no CUDA device ({exc})"
    if (
        target.backend == "triton"
        and target.device == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        return "runs only through the Triton interpreter: set TRITON_INTERPRET=1 to include it"
    return None


# --------------------------------------------------------------------------- float64 references


def _ref_rms_norm(x, w, eps):
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * w, rstd[..., 0]


def _ref_rms_norm_grads(x, w, dy, eps):
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    x_hat = x * rstd
    g = dy * w
    dx = rstd * (g - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))
    return dx, np.sum(dy * x_hat, axis=tuple(range(x.ndim - 1)))


def _ref_layer_norm(x, w, b, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean((x - mean) ** 2, axis=-1, keepdims=True) + eps)
    return (x - mean) * rstd * w + b, mean[..., 0], rstd[..., 0]


def _ref_layer_norm_grads(x, w, dy, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean((x - mean) ** 2, axis=-1, keepdims=True) + eps)
    x_hat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (
        g - np.mean(g, axis=-1, keepdims=True) - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True)
    )
    lead = tuple(range(x.ndim - 1))
    return dx, np.sum(dy * x_hat, axis=lead), np.sum(dy, axis=lead)


def _ref_softmax(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _attention_mask(b, sq, sk, causal, input_pos, q_lengths, k_lengths):
    """``(B, 1, Sq, Sk)`` booleans: True where query i may attend key j."""
    i = np.arange(sq)[None, :, None]
    j = np.arange(sk)[None, None, :]
    keep = np.ones((b, sq, sk), dtype=bool)
    if causal:
        keep &= j <= np.broadcast_to(np.asarray(input_pos), (b,))[:, None, None] + i
    if q_lengths is not None:
        keep &= i < q_lengths[:, None, None]
    if k_lengths is not None:
        keep &= j < k_lengths[:, None, None]
    return keep[:, None]


def _ref_attention_probs(q, k, scale, keep):
    """Probabilities ``(B, H, Sq, Sk)`` (0 on masked pairs and fully masked rows), ``m`` and ``l``."""
    group = q.shape[1] // k.shape[1]
    s = np.where(keep, scale * q @ np.repeat(k, group, axis=1).swapaxes(-1, -2), -np.inf)
    m = np.max(s, axis=-1)
    finite_m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(keep, np.exp(s - finite_m[..., None]), 0.0)
    l = np.sum(e, axis=-1)
    p = e / np.where(l > 0, l, 1.0)[..., None]
    return p, m, l


def _ref_attention(q, k, v, scale, keep):
    p, m, l = _ref_attention_probs(q, k, scale, keep)
    group = q.shape[1] // k.shape[1]
    return p @ np.repeat(v, group, axis=1), m, l


def _ref_attention_grads(q, k, v, do, scale, keep):
    p, _, _ = _ref_attention_probs(q, k, scale, keep)
    batch, kv_heads, sk, _ = k.shape
    group = q.shape[1] // kv_heads
    v_rep = np.repeat(v, group, axis=1)
    dp = do @ v_rep.swapaxes(-1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = scale * ds @ np.repeat(k, group, axis=1)
    dk = scale * ds.swapaxes(-1, -2) @ q
    dv = p.swapaxes(-1, -2) @ do

    def group_sum(a):
        return a.reshape(batch, kv_heads, group, sk, a.shape[-1]).sum(axis=2)

    return dq, group_sum(dk), group_sum(dv)


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class OpCheck:
    """One primitive's quick check.

    ``inputs(rng)`` gives float64 inputs and integer options as NumPy arrays;
    ``reference(inputs)`` the float64 forward results by name;
    ``forward(target, arrays, backend)`` the same names as target arrays plus
    the state its backward needs; ``backward(target, arrays, state,
    cotangents, backend)`` and ``reference_grads(inputs, cotangents)`` the
    gradients by name (None for forward-only primitives).
    """

    op: str
    inputs: Callable
    reference: Callable
    forward: Callable
    cotangents: Callable | None = None
    reference_grads: Callable | None = None
    backward: Callable | None = None


_EPS = 1e-5
_ROWS = (3, 5, 40)


def _norm_inputs(rng):
    return {
        "x": rng.standard_normal(_ROWS) * 2.0 + 0.5,
        "w": rng.standard_normal(_ROWS[-1:]),
        "b": rng.standard_normal(_ROWS[-1:]),
    }


def _rows_cotangent(rng):
    return {"y": rng.standard_normal(_ROWS)}


def _rms_norm_reference(a):
    y, rstd = _ref_rms_norm(a["x"], a["w"], _EPS)
    return {"y": y, "rstd": rstd.reshape(-1)}


def _rms_norm_forward(t, a, backend):
    from .rms_norm import rms_norm_

    y = t.nan_like(a["x"])
    ck = allocate_checkpoints(rms_norm_, a["x"], a["w"])
    rms_norm_(y, a["x"], a["w"], eps=_EPS, checkpoints=ck, backend=backend)
    return {"y": y, "rstd": ck.rstd}, ck


def _rms_norm_grads(a, ct):
    dx, dw = _ref_rms_norm_grads(a["x"], a["w"], ct["y"], _EPS)
    return {"dx": dx, "dw": dw}


def _rms_norm_backward(t, a, outs, ck, ct, backend):
    from .rms_norm import rms_norm_backward_

    Y = Duplicated(outs["y"], ct["y"])
    X = Duplicated(a["x"], t.nan_like(a["x"]))
    W = Duplicated(a["w"], t.nan_like(a["w"]))
    scratch = allocate_scratchspace(rms_norm_backward_, Y, X, W, backend=backend)
    rms_norm_backward_(Y, X, W, checkpoints=ck, scratch=scratch, backend=backend)
    return {"dx": X.shadow, "dw": W.shadow}


def _layer_norm_reference(a):
    y, mean, rstd = _ref_layer_norm(a["x"], a["w"], a["b"], _EPS)
    return {"y": y, "mean": mean.reshape(-1), "rstd": rstd.reshape(-1)}


def _layer_norm_forward(t, a, backend):
    from .layer_norm import layer_norm_

    y = t.nan_like(a["x"])
    ck = allocate_checkpoints(layer_norm_, a["x"], a["w"], a["b"])
    layer_norm_(y, a["x"], a["w"], a["b"], eps=_EPS, checkpoints=ck, backend=backend)
    return {"y": y, "mean": ck.mean, "rstd": ck.rstd}, ck


def _layer_norm_grads(a, ct):
    dx, dw, db = _ref_layer_norm_grads(a["x"], a["w"], ct["y"], _EPS)
    return {"dx": dx, "dw": dw, "db": db}


def _layer_norm_backward(t, a, outs, ck, ct, backend):
    from .layer_norm import layer_norm_backward_

    Y = Duplicated(outs["y"], ct["y"])
    X = Duplicated(a["x"], t.nan_like(a["x"]))
    W = Duplicated(a["w"], t.nan_like(a["w"]))
    B = Duplicated(a["b"], t.nan_like(a["b"]))
    scratch = allocate_scratchspace(layer_norm_backward_, Y, X, W, B, backend=backend)
    layer_norm_backward_(Y, X, W, B, checkpoints=ck, scratch=scratch, backend=backend)
    return {"dx": X.shadow, "dw": W.shadow, "db": B.shadow}


def _softmax_inputs(rng):
    return {"x": rng.standard_normal(_ROWS) * 3.0}


def _softmax_forward(t, a, backend):
    from .softmax import softmax_

    y = t.nan_like(a["x"])
    softmax_(y, a["x"], backend=backend)
    return {"y": y}, None


def _softmax_grads(a, ct):
    y = _ref_softmax(a["x"])
    return {"dx": y * (ct["y"] - np.sum(y * ct["y"], axis=-1, keepdims=True))}


def _softmax_backward(t, a, outs, _, ct, backend):
    from .softmax import softmax_backward_

    X = Duplicated(a["x"], t.nan_like(a["x"]))
    softmax_backward_(Duplicated(outs["y"], ct["y"]), X, backend=backend)
    return {"dx": X.shadow}


# Attention: GQA 4/2, causal with the queries at positions 32..51, per-batch key lengths.
_ATTN = {"B": 2, "H": 4, "Hkv": 2, "Sq": 20, "Sk": 52, "D": 32, "input_pos": 32}
_ATTN_K_LENGTHS = (52, 40)


def _attention_inputs(rng):
    b, h, hkv, sq, sk, d = (_ATTN[n] for n in ("B", "H", "Hkv", "Sq", "Sk", "D"))
    return {
        "q": rng.standard_normal((b, h, sq, d)),
        "k": rng.standard_normal((b, hkv, sk, d)),
        "v": rng.standard_normal((b, hkv, sk, d)),
        "k_lengths": np.array(_ATTN_K_LENGTHS),
    }


def _attention_keep(a):
    b, sq, sk = a["q"].shape[0], a["q"].shape[2], a["k"].shape[2]
    return _attention_mask(b, sq, sk, True, _ATTN["input_pos"], None, a["k_lengths"])


def _attention_reference(a):
    scale = 1.0 / math.sqrt(a["q"].shape[-1])
    o, m, l = _ref_attention(a["q"], a["k"], a["v"], scale, _attention_keep(a))
    return {"o": o, "m": m, "l": l}


def _attention_options(a):
    return {"causal": True, "input_pos": _ATTN["input_pos"], "k_lengths": a["k_lengths"]}


def _attention_forward(t, a, backend):
    from .attention import attention_

    o = t.nan_like(a["q"])
    ck = allocate_checkpoints(attention_, a["q"], a["k"], a["v"])
    attention_(o, a["q"], a["k"], a["v"], checkpoints=ck, backend=backend, **_attention_options(a))
    return {"o": o, "m": ck.m, "l": ck.l}, ck


def _attention_cotangent(rng):
    return {"o": rng.standard_normal((_ATTN["B"], _ATTN["H"], _ATTN["Sq"], _ATTN["D"]))}


def _attention_grads(a, ct):
    scale = 1.0 / math.sqrt(a["q"].shape[-1])
    dq, dk, dv = _ref_attention_grads(a["q"], a["k"], a["v"], ct["o"], scale, _attention_keep(a))
    return {"dq": dq, "dk": dk, "dv": dv}


def _attention_backward(t, a, outs, ck, ct, backend):
    from .attention import attention_backward_

    O = Duplicated(outs["o"], ct["o"])
    Q, K, V = (Duplicated(a[n], t.nan_like(a[n])) for n in ("q", "k", "v"))
    scratch = allocate_scratchspace(attention_backward_, O, Q, K, V, backend=backend)
    attention_backward_(
        O, Q, K, V, checkpoints=ck, scratch=scratch, backend=backend, **_attention_options(a)
    )
    return {"dq": Q.shadow, "dk": K.shadow, "dv": V.shadow}


# Decode: GQA 4/2 over a 64-slot cache, one batch row empty, three splits.
_DECODE = {"B": 3, "H": 4, "Hkv": 2, "Smax": 64, "D": 32, "n_splits": 3}
_DECODE_LENGTHS = (64, 17, 0)


def _decode_inputs(rng):
    b, h, hkv, smax, d = (_DECODE[n] for n in ("B", "H", "Hkv", "Smax", "D"))
    return {
        "q": rng.standard_normal((b, h, d)),
        "k_cache": rng.standard_normal((b, hkv, smax, d)),
        "v_cache": rng.standard_normal((b, hkv, smax, d)),
        "lengths": np.array(_DECODE_LENGTHS),
    }


def _decode_reference(a):
    q, lengths = a["q"][:, :, None, :], a["lengths"]
    keep = _attention_mask(q.shape[0], 1, a["k_cache"].shape[2], False, 0, None, lengths)
    o, _, _ = _ref_attention(q, a["k_cache"], a["v_cache"], 1.0 / math.sqrt(q.shape[-1]), keep)
    return {"o": o[:, :, 0, :]}


def _decode_forward(t, a, backend):
    from .decode_attention import decode_attention_

    o = t.nan_like(a["q"])
    scratch = allocate_scratchspace(
        decode_attention_,
        o,
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["lengths"],
        n_splits=_DECODE["n_splits"],
        backend=backend,
    )
    decode_attention_(
        o, a["q"], a["k_cache"], a["v_cache"], a["lengths"], scratch=scratch, backend=backend
    )
    return {"o": o}, None


# Flex: GQA 4/2, sliding window 10 behind queries at positions 8..27, ALiBi then a soft cap.
_FLEX = {
    "B": 2,
    "H": 4,
    "Hkv": 2,
    "Sq": 20,
    "Sk": 36,
    "D": 32,
    "input_pos": 8,
    "window": 10,
    "cap": 4.0,
}


def _flex_inputs(rng):
    b, h, hkv, sq, sk, d = (_FLEX[n] for n in ("B", "H", "Hkv", "Sq", "Sk", "D"))
    return {
        "q": rng.standard_normal((b, h, sq, d)),
        "k": rng.standard_normal((b, hkv, sk, d)),
        "v": rng.standard_normal((b, hkv, sk, d)),
        "slopes": rng.uniform(0.05, 0.5, size=h),
    }


def _flex_scores(a):
    """Scaled scores before the mods, the ALiBi-shifted ones, the soft-capped ones and the mask."""
    q, k, slopes = a["q"], a["k"], a["slopes"]
    group = q.shape[1] // k.shape[1]
    q_pos = _FLEX["input_pos"] + np.arange(q.shape[2])[:, None]
    kv_pos = np.arange(k.shape[2])[None, :]
    raw = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    shifted = raw + slopes[None, :, None, None] * (kv_pos - q_pos)
    capped = _FLEX["cap"] * np.tanh(shifted / _FLEX["cap"])
    keep = (q_pos - _FLEX["window"] <= kv_pos) & (kv_pos <= q_pos)
    return shifted, capped, np.broadcast_to(keep, capped.shape), kv_pos - q_pos


def _flex_probs(a):
    _, capped, keep, _ = _flex_scores(a)
    s = np.where(keep, capped, -np.inf)
    m = np.max(s, axis=-1)
    e = np.where(keep, np.exp(s - m[..., None]), 0.0)
    l = np.sum(e, axis=-1)
    return e / l[..., None], m, l


def _flex_reference(a):
    p, m, l = _flex_probs(a)
    group = a["q"].shape[1] // a["k"].shape[1]
    return {"o": p @ np.repeat(a["v"], group, axis=1), "m": m, "l": l}


def _flex_mods(a):
    from .mods import AliBiScore, SlidingWindowMask, SoftCapScore

    return {
        "score_mod": AliBiScore(a["slopes"]) >> SoftCapScore(_FLEX["cap"]),
        "mask_mod": SlidingWindowMask(_FLEX["window"]),
        "input_pos": _FLEX["input_pos"],
    }


def _flex_forward(t, a, backend):
    from .flex_attention import flex_attention_

    o = t.nan_like(a["q"])
    ck = allocate_checkpoints(flex_attention_, a["q"], a["k"], a["v"])
    flex_attention_(o, a["q"], a["k"], a["v"], checkpoints=ck, backend=backend, **_flex_mods(a))
    return {"o": o, "m": ck.m, "l": ck.l}, ck


def _flex_cotangent(rng):
    return {"o": rng.standard_normal((_FLEX["B"], _FLEX["H"], _FLEX["Sq"], _FLEX["D"]))}


def _flex_grads(a, ct):
    p, _, _ = _flex_probs(a)
    shifted, _, _, distance = _flex_scores(a)
    batch, kv_heads, sk, _ = a["k"].shape
    group = a["q"].shape[1] // kv_heads
    scale = 1.0 / math.sqrt(a["q"].shape[-1])
    dp = ct["o"] @ np.repeat(a["v"], group, axis=1).swapaxes(-1, -2)
    d_capped = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    d_shifted = d_capped * (1.0 - np.tanh(shifted / _FLEX["cap"]) ** 2)
    dq = scale * d_shifted @ np.repeat(a["k"], group, axis=1)
    dk = scale * d_shifted.swapaxes(-1, -2) @ a["q"]
    dv = p.swapaxes(-1, -2) @ ct["o"]

    def group_sum(x):
        return x.reshape(batch, kv_heads, group, sk, x.shape[-1]).sum(axis=2)

    d_slopes = np.sum(d_shifted * distance, axis=(0, 2, 3))
    return {"dq": dq, "dk": group_sum(dk), "dv": group_sum(dv), "d_slopes": d_slopes}


def _flex_backward(t, a, outs, ck, ct, backend):
    from .buffers import grad_shadow
    from .flex_attention import flex_attention_backward_

    O = Duplicated(outs["o"], ct["o"])
    Q, K, V = (Duplicated(a[n], t.nan_like(a[n])) for n in ("q", "k", "v"))
    mods = _flex_mods(a)
    score_mod_grad = grad_shadow(mods["score_mod"])
    scratch = allocate_scratchspace(flex_attention_backward_, O, Q, K, V)
    flex_attention_backward_(
        O,
        Q,
        K,
        V,
        checkpoints=ck,
        scratch=scratch,
        score_mod_grad=score_mod_grad,
        backend=backend,
        **mods,
    )
    return {"dq": Q.shadow, "dk": K.shadow, "dv": V.shadow, "d_slopes": score_mod_grad.slopes}


CHECKS: dict[str, OpCheck] = {
    "rms_norm": OpCheck(
        "rms_norm",
        _norm_inputs,
        _rms_norm_reference,
        _rms_norm_forward,
        _rows_cotangent,
        _rms_norm_grads,
        _rms_norm_backward,
    ),
    "layer_norm": OpCheck(
        "layer_norm",
        _norm_inputs,
        _layer_norm_reference,
        _layer_norm_forward,
        _rows_cotangent,
        _layer_norm_grads,
        _layer_norm_backward,
    ),
    "softmax": OpCheck(
        "softmax",
        _softmax_inputs,
        lambda a: {"y": _ref_softmax(a["x"])},
        _softmax_forward,
        _rows_cotangent,
        _softmax_grads,
        _softmax_backward,
    ),
    "attention": OpCheck(
        "attention",
        _attention_inputs,
        _attention_reference,
        _attention_forward,
        _attention_cotangent,
        _attention_grads,
        _attention_backward,
    ),
    "decode_attention": OpCheck(
        "decode_attention", _decode_inputs, _decode_reference, _decode_forward
    ),
    "flex_attention": OpCheck(
        "flex_attention",
        _flex_inputs,
        _flex_reference,
        _flex_forward,
        _flex_cotangent,
        _flex_grads,
        _flex_backward,
    ),
}


# --------------------------------------------------------------------------- running


def max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max|actual - expected| / max(max|expected|, 1)``; inf on NaN or a shape mismatch.

    Matching infinities (a fully masked row's ``m = -inf``) count as equal.
    """
    if actual.shape != expected.shape:
        return math.inf
    if actual.size == 0:
        return 0.0
    same_inf = np.isinf(expected) & (actual == expected)
    diff = np.abs(np.where(same_inf, 0.0, actual) - np.where(same_inf, 0.0, expected))
    if not np.all(np.isfinite(diff)):
        return math.inf
    scale = max(float(np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)), 1.0)
    return float(np.max(diff)) / scale


@dataclass
class Row:
    """One line of the table: the errors of a primitive on a target, or what went wrong."""

    op: str
    target: Target
    forward: float | None = None
    backward: float | None = None
    error: str | None = None
    details: str | None = None
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        fwd_tol, bwd_tol = TOLERANCES[self.op]
        if self.error is not None or self.forward is None or self.forward > fwd_tol:
            return False
        return self.backward is None or self.backward <= bwd_tol


def _exact(t: Target, inputs: dict) -> tuple[dict, dict]:
    """Target arrays of ``inputs`` and their float64 values after rounding to float32."""
    arrays = {n: t.asarray(v, float32=v.dtype.kind == "f") for n, v in inputs.items()}
    return arrays, {
        n: t.to_numpy(arrays[n]) if inputs[n].dtype.kind == "f" else inputs[n] for n in inputs
    }


def _errors(t: Target, got: dict, want: dict) -> float:
    return max(
        max_error(t.to_numpy(got[name]), np.asarray(want[name], dtype=np.float64)) for name in want
    )


def check_one(check: OpCheck, t: Target) -> Row:
    """Run ``check`` on ``t``; any exception becomes the row's error."""
    row = Row(check.op, t)
    rng = np.random.default_rng(sum(map(ord, check.op)))
    try:
        arrays, exact = _exact(t, check.inputs(rng))
        try:
            resolve(check.op, arrays, backend=t.backend)
        except BackendError as exc:
            row.skipped = str(exc).split(": ", 2)[-1]
            return row
        outs, state = check.forward(t, arrays, t.backend)
        row.forward = _errors(t, outs, check.reference(exact))
        if check.backward is not None:
            cot_arrays, cot_exact = _exact(t, check.cotangents(rng))
            grads = check.backward(t, arrays, outs, state, cot_arrays, t.backend)
            row.backward = _errors(t, grads, check.reference_grads(exact, cot_exact))
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the table
        row.error = f"{type(exc).__name__}: {exc}"
        row.details = traceback.format_exc()
    return row


def _fmt(err: float | None) -> str:
    return "-" if err is None else f"{err:.1e}"


def run(ops=None, verbose=False) -> int:
    """Print the PASS/FAIL table for ``ops`` (default: all); returns 1 on any FAIL, else 0."""
    chosen = [op for op in OPS if op in CHECKS and (not ops or op in ops)]
    skipped, rows = [], []
    for target in _candidates():
        reason = _unavailable(target)
        if reason:
            skipped.append(f"{target.backend} on {target.label}: {reason}")
            continue
        for op in chosen:
            row = check_one(CHECKS[op], target)
            if row.skipped:
                skipped.append(f"{target.backend} on {target.label}, {op}: {row.skipped}")
            else:
                rows.append(row)

    header = ("primitive", "backend", "arrays", "forward", "backward", "tolerance", "result")
    table = [header]
    for row in rows:
        fwd_tol, bwd_tol = TOLERANCES[row.op]
        tol = f"{fwd_tol:.0e}" + ("" if bwd_tol is None else f" / {bwd_tol:.0e}")
        table.append(
            (
                row.op,
                row.target.backend,
                row.target.label,
                _fmt(row.forward),
                _fmt(row.backward),
                tol,
                "PASS" if row.passed else "FAIL",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print("float32 inputs; error = max|got - float64 reference| / max(max|reference|, 1)")
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    for row in rows:
        if row.error:
            print(f"\n{row.op} on {row.target.backend} / {row.target.label} raised {row.error}")
            if verbose:
                print(row.details)
    if skipped:
        print("\nnot checked here:")
        for line in skipped:
            print(f"  {line}")
    failed = sum(not row.passed for row in rows)
    print(f"\n{len(rows) - failed} PASS, {failed} FAIL")
    return 1 if failed else 0
