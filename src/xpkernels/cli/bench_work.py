"""What xpkernels' two benchmarks share: shapes, work formulas, inputs and xpkernels' calls.

``python -m xpkernels bench`` (CPU, rows in :mod:`.bench_cases`) and
``bench/gpu.py`` (a CUDA device, run by ``bench/device.sh``) both take from
here the bytes and FLOPs of each entry (:func:`row_work`, :func:`rope_work`,
:func:`cross_entropy_work`, :func:`linear_cross_entropy_work`,
:func:`attention_work`, :func:`decode_work`, :func:`flex_work`,
:func:`hf_llama_work`), its inputs (:func:`row_inputs`, :func:`gated_inputs`,
:func:`rope_inputs`, :func:`cross_entropy_inputs`,
:func:`linear_cross_entropy_inputs`, :func:`attention_inputs`,
:func:`decode_inputs`, :func:`paged_cache`, :func:`flex_mods`), the xpkernels
calls they time (:func:`row_calls`, :func:`gated_calls`, :func:`rope_calls`,
:func:`cross_entropy_calls`, :func:`linear_cross_entropy_calls`,
:func:`linear_cross_entropy_step`, :func:`linear_cross_entropy_fused`,
:func:`attention_calls`, :func:`decode_call`, :func:`flex_calls`, on an
:class:`Arrays` that says where the arrays live and which backend runs) and
the PyTorch ops the row, gated, RoPE and loss primitives are compared with
(:func:`torch_row_op`, :func:`torch_gated_op`, :func:`torch_rope`,
:func:`torch_cross_entropy`, :func:`torch_linear_cross_entropy`);
``bench/gpu.py`` also its shapes (:data:`GPU_SHAPES`) and primitives
(:data:`GPU_OPS`, :data:`GATED_CASES`, :data:`FLEX_MODS`), and keeps its own
timing, ceilings and targets.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffers import Duplicated, allocate_checkpoints, allocate_scratchspace

#: The primitives whose inputs are ``(rows, M)`` arrays (:func:`row_inputs`).
ROW_OPS = ("rms_norm", "layer_norm", "softmax")
#: The gated activations ``y = act(a) * b``: elementwise over ``(rows, M)`` gates ``a`` and
#: values ``b`` (:func:`gated_inputs`), each at the cases of :data:`GATED_CASES`.
GATED_OPS = ("swiglu", "geglu")
#: The cases of each gated activation: (row name, keyword options of every side's call).
#: GeGLU runs at both GELU forms, the tanh one (Gemma's ``gelu_pytorch_tanh``, the default)
#: under the primitive's own name.
GATED_CASES: dict[str, tuple[tuple[str, dict[str, str]], ...]] = {
    "swiglu": (("swiglu", {}),),
    "geglu": (
        ("geglu", {"approximate": "tanh"}),
        ("geglu (approximate=none)", {"approximate": "none"}),
    ),
}
#: The losses: cross-entropy over given ``(N, V)`` logits (:func:`cross_entropy_inputs`), and
#: fused with the linear layer that makes them, ``x @ W.T`` (:func:`linear_cross_entropy_inputs`).
LOSS_OPS = ("cross_entropy", "linear_cross_entropy")
#: The primitives ``bench/gpu.py`` times on the triton backend, in its order (then most of
#: them again on the cupy backend).
GPU_OPS = (
    *ROW_OPS,
    "attention",
    "decode_attention",
    "flex_attention",
    *GATED_OPS,
    "rope",
    *LOSS_OPS,
)
#: Shapes of ``bench/gpu.py``: on a CUDA device (False) and in its dry run (True: CPU tensors,
#: the Triton interpreter, tiny shapes). ``D`` lists the head dims each shape runs at; the
#: cupy backend's entries run at ``cupy``'s rows and attention shape, at ``rope`` and at
#: ``decode``.
GPU_SHAPES: dict[bool, dict[str, Any]] = {
    False: {
        "rows": ((32768, 4096), (4096, 65536)),
        "row_dtypes": ("bfloat16", "float32"),
        "attention": {"B": 4, "H": 32, "S": 4096, "D": (64, 128)},
        "decode": {"B": 16, "H": 32, "Hkv": 8, "S": 32768, "D": 128},
        "flex": {"B": 4, "H": 16, "S": 4096, "D": (64, 128), "documents": 4},
        "rope": {"B": 4, "H": 32, "Hkv": 8, "S": 4096, "D": 128},
        # Llama 3's vocabulary; linear cross-entropy at Llama 3 8B's hidden size.
        "cross_entropy": {"N": 8192, "V": 128256},
        "linear_cross_entropy": {"N": 8192, "H": 4096, "V": 128256},
        "cupy": {"rows": (32768, 4096), "attention": {"B": 4, "H": 32, "S": 4096, "D": 128}},
        # One decoder layer of a 1B-parameter Llama (Llama 3.2 1B's widths), small vocabulary.
        "hf_llama": {"B": 1, "S": 4096, "hidden": 2048, "layers": 1, "heads": 32, "kv_heads": 8},
    },
    True: {
        "rows": ((64, 256), (8, 2048)),
        "row_dtypes": ("bfloat16", "float32"),
        "attention": {"B": 1, "H": 2, "S": 48, "D": (16, 32)},
        "decode": {"B": 2, "H": 8, "Hkv": 2, "S": 96, "D": 32},
        "flex": {"B": 1, "H": 2, "S": 48, "D": (16,), "documents": 4},
        "rope": {"B": 1, "H": 4, "Hkv": 2, "S": 16, "D": 32},
        "cross_entropy": {"N": 16, "V": 300},
        "linear_cross_entropy": {"N": 16, "H": 32, "V": 300},
        "cupy": {"rows": (64, 256), "attention": {"B": 1, "H": 2, "S": 48, "D": 32}},
        "hf_llama": {"B": 1, "S": 32, "hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2},
    },
}


# --------------------------------------------------------------------------- arrays


class Arrays:
    """Where a case's inputs go: the array library xpkernels is called on, and how.

    ``convert`` takes one of a case's inputs (NumPy arrays here) to that library; ``host``
    takes a small NumPy array (document ids, score-mod tables, a block table) there;
    ``options`` are the keyword arguments of every xpkernels call (none here: the default
    backend). ``bench/gpu.py`` subclasses it for CUDA tensors (``backend="triton"``) and
    CuPy views of them (``backend="cupy"``).
    """

    options: dict[str, Any] = {}

    def __init__(self, library: str):
        self.library = library

    def convert(self, a):
        if self.library == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a))
        return np.ascontiguousarray(a)

    def host(self, a: np.ndarray):
        return self.convert(a)

    def empty_like(self, a):
        import array_api_compat

        return array_api_compat.array_namespace(a).empty_like(a)

    def integers(self, values):
        return self.host(np.asarray(values, dtype=np.int64))


def torch_tensor(a: np.ndarray, grad: bool = False):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).requires_grad_(grad)


#: Draws a random input of a shape: ``random(shape) -> array`` (NumPy float32 here, CUDA
#: tensors of the entry's dtype in ``bench/gpu.py``).
Random = Callable[[tuple[int, ...]], Any]


def numpy_random(seed: int) -> Random:
    """Standard normal float32 NumPy arrays from one seeded generator."""
    rng = np.random.default_rng(seed)
    return lambda shape: rng.standard_normal(shape, dtype=np.float32)


# --------------------------------------------------------------------------- work

#: What one pass of a row primitive must move: (arrays of R x M elements, arrays of M
#: elements, float32 statistics per row) and which they are.
_ROW_TRAFFIC = {
    ("rms_norm", "forward"): (2, 1, 1, "read x, w; write y, rstd"),
    ("rms_norm", "backward"): (3, 2, 1, "read x, dy, w, rstd; write dx, dw"),
    ("layer_norm", "forward"): (2, 2, 2, "read x, w, b; write y, mean, rstd"),
    ("layer_norm", "backward"): (3, 3, 2, "read x, dy, w, mean, rstd; write dx, dw, db"),
    ("softmax", "forward"): (2, 0, 0, "read x; write y"),
    ("softmax", "backward"): (3, 0, 0, "read y, dy; write dx"),
    ("swiglu", "forward"): (3, 0, 0, "read a, b; write y"),
    ("swiglu", "backward"): (5, 0, 0, "read a, b, dy; write da, db"),
    ("geglu", "forward"): (3, 0, 0, "read a, b; write y"),
    ("geglu", "backward"): (5, 0, 0, "read a, b, dy; write da, db"),
}


def row_work(op: str, pass_: str, rows: int, m: int, itemsize: int) -> tuple[int, str]:
    """Bytes one ``pass_`` of row or gated primitive ``op`` must move at ``(rows, m)`` with
    ``itemsize``-byte elements (the least any implementation moves), and its formula."""
    full, vectors, stats, what = _ROW_TRAFFIC[(op, pass_)]
    work = (full * rows * m + vectors * m) * itemsize + 4 * stats * rows
    if vectors:
        formula = f"({full}*R*M + {'' if vectors == 1 else f'{vectors}*'}M)*s"
    else:
        formula = f"{full}*R*M*s"
    if stats:
        formula += f" + {4 * stats}*R"
    return work, f"bytes = {formula} ({what}; R={rows}, M={m}, s={itemsize})"


def rope_work(
    pass_: str, b: int, h: int, hkv: int, s: int, d: int, itemsize: int, table_itemsize: int
) -> tuple[int, str]:
    """Bytes one ``pass_`` of RoPE must move over q ``(b, h, s, d)`` and k ``(b, hkv, s, d)``
    (full rotary, tables ``(s, d / 2)`` of ``table_itemsize``-byte elements): q and k read and
    their rotations written, each table read once; and the formula."""
    r2 = d // 2
    work = 2 * (h + hkv) * b * s * d * itemsize + 2 * s * r2 * table_itemsize
    what = (
        "read q, k; write q_out, k_out"
        if pass_ == "forward"
        else "read dq_out, dk_out; write dq, dk"
    )
    where = f"B={b}, H={h}, Hkv={hkv}, S={s}, D={d}, R2={r2}, s={itemsize}, t={table_itemsize}"
    return work, (
        f"bytes = 2*(H+Hkv)*B*S*D*s + 2*S*R2*t ({what}; plus the tables cos, sin (S, R2) "
        f"read once; {where})"
    )


#: What one pass of cross-entropy must move: (reads and writes of the ``(N, V)`` logits, bytes
#: per row -- the int64 target and the float32 ``lse``, each read or written), and which.
_CROSS_ENTROPY_TRAFFIC = {
    "forward": (1, 12, "read logits, int64 targets; write the float32 lse"),
    "backward": (2, 12, "read logits, targets, lse; write dlogits"),
    "fwd+bwd": (3, 24, "the forward, then the backward"),
}


def cross_entropy_work(pass_: str, n: int, v: int, itemsize: int) -> tuple[int, str]:
    """Bytes one ``pass_`` (``forward``, ``backward`` or ``fwd+bwd``) of cross-entropy must move
    over ``(n, v)`` logits of ``itemsize``-byte elements and int64 targets, and the formula.
    The rows' losses and the reduction are not counted (``N`` floats)."""
    logits, per_row, what = _CROSS_ENTROPY_TRAFFIC[pass_]
    work = logits * n * v * itemsize + per_row * n
    times = "" if logits == 1 else f"{logits}*"
    return work, f"bytes = {times}N*V*s + {per_row}*N ({what}; N={n}, V={v}, s={itemsize})"


#: The products of linear cross-entropy each pass needs, as the composition computes them.
_LINEAR_PRODUCTS = {
    "forward": ("Z = x @ W.T",),
    "backward": ("dx = dZ @ W", "dW = dZ^T @ x"),
    "fwd+bwd": ("Z = x @ W.T", "dx = dZ @ W", "dW = dZ^T @ x"),
}


def linear_cross_entropy_work(pass_: str, n: int, h: int, v: int) -> tuple[int, str]:
    """FLOPs of the products one ``pass_`` (``forward``, ``backward`` or ``fwd+bwd``) of linear
    cross-entropy needs over ``x`` ``(n, h)`` and a weight ``(v, h)``, 2 a multiply-add, as
    the composition computes them (its backward reuses the logits it kept; xpkernels'
    backward forms them again, one product more; its fused forward, given Duplicated ``x`` and
    ``weight``, does both passes in three), and the formula. The softmax is not counted."""
    products = _LINEAR_PRODUCTS[pass_]
    work = 2 * len(products) * n * h * v
    done = {
        "forward": "",
        "backward": "; xpkernels' backward forms the logits again: 3 products done",
        "fwd+bwd": "; xpkernels' forward then backward: 4 products done, fused: 3",
    }[pass_]
    return work, (
        f"FLOPs = {2 * len(products)}*N*H*V ({', '.join(products)}; N={n}, H={h}, V={v}{done})"
    )


def _attention_flops(b, h, sq, sk, d, causal, pass_):
    return (
        4 * b * h * sq * sk * d * (0.5 if causal else 1.0) * (2.5 if pass_ == "backward" else 1.0)
    )


def _attention_formula(pass_, causal, where):
    fwd = "4*B*H*Sq*Sk*D" + (" / 2 (causal)" if causal else "")
    text = fwd if pass_ == "forward" else f"2.5 * {fwd}"
    return f"FLOPs = {text} ({where})"


def attention_work(b: int, h: int, s: int, d: int, causal: bool, pass_: str) -> tuple[float, str]:
    """FLOPs of one ``pass_`` of attention at Sq = Sk = ``s`` (the two products forward, five
    backward: 2.5 times the forward -- the FlashAttention papers' convention), and the formula."""
    where = f"B={b}, H={h}, Sq=Sk={s}, D={d}"
    return _attention_flops(b, h, s, s, d, causal, pass_), _attention_formula(pass_, causal, where)


def decode_work(
    b: int, h: int, hkv: int, s: int, d: int, itemsize: int, page_size: int | None = None
) -> tuple[int, str]:
    """Bytes of one decode step over full caches of ``s`` keys (K and V read once, q read,
    o written; paged: the int32 block table too), and the formula."""
    work = (2 * b * hkv * s * d + 2 * b * h * d) * itemsize
    where = f"B={b}, H={h}, Hkv={hkv}, L={s} valid of Smax={s}, D={d}, s={itemsize}"
    if page_size is None:
        text = f"(2*B*Hkv*L*D + 2*B*H*D)*s (read the valid K and V cache, read q, write o; {where})"
        return work, f"bytes = {text}"
    work += b * (s // page_size) * 4
    text = (
        "(2*B*Hkv*L*D + 2*B*H*D)*s + 4*B*L/P (read the valid K and V pages, read q, write o, "
        f"read the int32 block table; {where}, pages of P={page_size} keys, table shuffled)"
    )
    return work, f"bytes = {text}"


def flex_work(b: int, h: int, s: int, d: int, mask, pass_: str) -> tuple[float, str]:
    """FLOPs of one ``pass_`` of FlexAttention with ``mask`` (as in :func:`_kept_pairs`; None:
    every pair, attention's count): the pairs the mask keeps, whatever tiles a path visits."""
    if mask is None:
        return attention_work(b, h, s, d, False, pass_)
    pairs = kept_pairs(s, mask)
    work = 4 * b * h * d * pairs * (2.5 if pass_ == "backward" else 1.0)
    formula = (
        f"FLOPs = {'2.5 * ' if pass_ == 'backward' else ''}4*B*H*D*pairs, pairs = the "
        f"(query, key) pairs the mask keeps = {pairs:,} (B={b}, H={h}, Sq=Sk={s}, D={d}; "
        "the same for every path)"
    )
    return work, formula


# --------------------------------------------------------------------------- inputs


def row_inputs(rows: int, m: int, random: Random) -> dict[str, Any]:
    """``x`` and ``dy`` of ``(rows, m)``, the weight ``w`` and bias ``b`` of ``(m,)``."""
    x, dy = random((rows, m)), random((rows, m))
    return {"x": x, "dy": dy, "w": random((m,)), "b": random((m,))}


def gated_inputs(rows: int, m: int, random: Random) -> dict[str, Any]:
    """The gate ``a``, the values ``b`` and ``dy``, each of ``(rows, m)``."""
    return {name: random((rows, m)) for name in ("a", "b", "dy")}


def rope_inputs(
    b: int, h: int, hkv: int, s: int, d: int, random: Random, table: Callable = np.asarray
) -> dict[str, Any]:
    """RoPE's inputs at ``(b, h / hkv, s, d)``, full rotary: ``q``, ``dq_out`` ``(b, s, h, d)``
    and ``k``, ``dk_out`` ``(b, s, hkv, d)`` -- the layout of the projections, which attention
    hands over as ``(B, H, S, D)`` views (:func:`bhsd`) -- and the tables ``cos``, ``sin``
    ``(s, d / 2)`` of the angles ``p * 10000^(-2i / d)`` (float32, through ``table``)."""
    theta = 10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(s, dtype=np.float64)[:, None] * theta
    out = {"q": random((b, s, h, d)), "k": random((b, s, hkv, d))}
    out |= {"dq_out": random((b, s, h, d)), "dk_out": random((b, s, hkv, d))}
    out |= {
        name: table(f(angles).astype(np.float32)) for name, f in (("cos", np.cos), ("sin", np.sin))
    }
    return out


def loss_targets(n: int, v: int, integers: Callable = np.asarray):
    """``n`` int64 targets in ``[0, v)``, drawn by a seeded NumPy generator, through
    ``integers`` (to the array library and device of a case)."""
    return integers(np.random.default_rng(10).integers(0, v, n, dtype=np.int64))


def cross_entropy_inputs(
    n: int, v: int, random: Random, integers: Callable = np.asarray
) -> dict[str, Any]:
    """Cross-entropy's ``logits`` ``(n, v)`` and ``targets`` ``(n,)`` (:func:`loss_targets`)."""
    return {"logits": random((n, v)), "targets": loss_targets(n, v, integers)}


def linear_cross_entropy_inputs(
    n: int, h: int, v: int, random: Random, integers: Callable = np.asarray
) -> dict[str, Any]:
    """Linear cross-entropy's hidden states ``x`` ``(n, h)``, LM head ``weight`` ``(v, h)``
    scaled by ``h**-0.5`` (logits of unit scale) and ``targets`` ``(n,)``
    (:func:`loss_targets`)."""
    x, weight = random((n, h)), random((v, h)) * h**-0.5
    return {"x": x, "weight": weight, "targets": loss_targets(n, v, integers)}


def bhsd(a):
    """A ``(B, S, H, D)`` array as the ``(B, H, S, D)`` view RoPE and attention take."""
    import array_api_compat

    return array_api_compat.array_namespace(a).permute_dims(a, (0, 2, 1, 3))


def attention_inputs(b: int, h: int, s: int, d: int, random: Random) -> tuple:
    """``q, k, v, do`` of ``(b, h, s, d)``."""
    return tuple(random((b, h, s, d)) for _ in range(4))


def decode_inputs(b: int, h: int, hkv: int, s: int, d: int, random: Random) -> tuple:
    """``q`` of ``(b, h, d)`` and full K and V caches of ``(b, hkv, s, d)``."""
    q = random((b, h, d))
    return q, random((b, hkv, s, d)), random((b, hkv, s, d))


def paged_cache(k, v, order, page_size: int) -> tuple:
    """The caches ``k``, ``v`` ``(B, Hkv, S, D)`` in ``page_size``-key pages: ``(table, k_pages,
    v_pages)``, page ``table[b, j]`` holding keys ``j * page_size ...`` of batch ``b``, the
    pages placed in the shuffled ``order`` (a permutation of ``B * S / page_size``, in the
    caches' library, as the table: int32)."""
    import array_api_compat

    xp = array_api_compat.array_namespace(k)
    b, hkv, s, d = k.shape
    table = xp.astype(xp.reshape(order, (b, s // page_size)), xp.int32)
    where = xp.astype(table, xp.int64)
    pages = []
    for cache in (k, v):
        shape = (b * s // page_size, hkv, page_size, d)
        into = xp.empty(shape, dtype=cache.dtype, device=array_api_compat.device(cache))
        into[where] = xp.permute_dims(
            xp.reshape(cache, (b, hkv, s // page_size, page_size, d)), (0, 2, 1, 3, 4)
        )
        pages.append(into)
    return table, *pages


#: The FlexAttention mods of ``bench/gpu.py``'s entries (see :func:`flex_mods`).
FLEX_MODS = ("nomod", "causal", "sliding256", "document", "alibi", "relpos")


@dataclass(frozen=True)
class FlexMods:
    """One FlexAttention case's mods, declared once for xpkernels and for PyTorch.

    ``mask``: None, "causal", a window length or sorted document ids (as in
    :func:`_kept_pairs`); ``score``: None, "alibi" (its slopes) or "relpos" (a learned
    relative-position table ``(H, 257)``), both causal; ``attention``: whether xpkernels'
    attention is a baseline of the case, and causal (None: it is not).
    """

    name: str
    mask: Any = None
    score: str | None = None
    attention: bool | None = None


def flex_mods(name: str, s: int, documents: int = 4) -> FlexMods:
    """The mods :data:`FLEX_MODS` names, at ``s`` keys: ``sliding<W>`` a window of ``W`` keys,
    ``document`` ``documents`` documents of uneven lengths (:func:`_document_ids`)."""
    if name.startswith("sliding"):
        return FlexMods(name, int(name[len("sliding") :]))
    return {
        "nomod": FlexMods(name, None, None, False),
        "causal": FlexMods(name, "causal", None, True),
        "document": FlexMods(name, document_ids(s, documents)),
        "alibi": FlexMods(name, "causal", "alibi"),
        "relpos": FlexMods(name, "causal", "relpos"),
    }[name]


def score_tables(h: int) -> dict[str, np.ndarray]:
    """The score mods' arrays: ALiBi's slopes ``2^(-8 i / H)`` and a relative-position table
    ``(H, 257)`` (float32)."""
    return {
        "alibi": np.exp2(-8.0 * np.arange(1, h + 1) / h).astype(np.float32),
        "relpos": np.linspace(-1.0, 1.0, h * 257, dtype=np.float32).reshape(h, 257),
    }


def xpk_mods(mods: FlexMods, arrays: Arrays, h: int) -> dict[str, Any]:
    """``score_mod`` and ``mask_mod`` of ``mods`` for xpkernels, their arrays on ``arrays``."""
    from xpkernels import mods as xm

    mask = mods.mask
    mask_mod = (
        None
        if mask is None
        else xm.DocumentMask(arrays.host(mask))
        if isinstance(mask, np.ndarray)
        else xm.CausalMask()
        if mask == "causal"
        else xm.SlidingWindowMask(mask)
    )
    score_mod: Any = None
    if mods.score == "alibi":
        score_mod = xm.AliBiScore(arrays.host(score_tables(h)["alibi"]))
    elif mods.score == "relpos":  # indices repeat inside every tile

        def relative(score, b, h, q_idx, kv_idx, *, table):
            return score + table[h, xm.minimum(xm.maximum(q_idx - kv_idx, -128), 128) + 128]

        score_mod = xm.ScoreMod(relative, table=arrays.host(score_tables(h)["relpos"]))
    return {"score_mod": score_mod, "mask_mod": mask_mod}


def torch_mods(mods: FlexMods, h: int, device="cpu") -> tuple:
    """``(score_mod, mask_mod)`` of ``mods`` for PyTorch's ``flex_attention`` on ``device``."""
    import torch

    mask = mods.mask
    mask_mod = None
    if isinstance(mask, np.ndarray):
        mask_mod = torch_document_mask(mask)
    elif mask == "causal":

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    elif mask is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= mask)

    score_mod = None
    tables = score_tables(h)
    if mods.score == "alibi":
        slopes = torch.from_numpy(tables["alibi"]).to(device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
    elif mods.score == "relpos":
        table = torch.from_numpy(tables["relpos"]).to(device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, (q_idx - kv_idx).clamp(-128, 128) + 128]

    return score_mod, mask_mod


# --------------------------------------------------------------------------- xpkernels' calls


@dataclass
class Calls:
    """The timed calls of one case, every buffer allocated once beforehand: ``forward``, the
    ``backward`` (None for a forward-only primitive; the forward has run once, so it has its
    checkpoints), the ``scratch`` they use, and ``backward_with(**options)``: the backward
    with options changed (flex: atomics, no score-mod gradients)."""

    forward: Callable[[], object]
    backward: Callable[[], object] | None = None
    scratch: Any = None
    backward_with: Callable[..., Callable[[], object]] | None = None


#: The parameters each row primitive takes after ``x`` (keys of :func:`row_inputs`).
ROW_PARAMS = {"rms_norm": ("w",), "layer_norm": ("w", "b"), "softmax": ()}
#: ``eps`` of each norm, on every side (xpkernels' defaults).
ROW_EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}


def row_calls(op: str, arrays: Arrays, inputs: dict[str, Any]) -> Calls:
    """``op_`` and ``op_backward_`` over ``arrays``' copies of ``inputs`` (:func:`row_inputs`)."""
    module = importlib.import_module(f"xpkernels.{op}")
    forward_, backward_ = getattr(module, f"{op}_"), getattr(module, f"{op}_backward_")
    x, dy = arrays.convert(inputs["x"]), arrays.convert(inputs["dy"])
    params = tuple(arrays.convert(inputs[name]) for name in ROW_PARAMS[op])
    options = arrays.options
    eps = {"eps": ROW_EPS[op]} if op in ROW_EPS else {}
    y = arrays.empty_like(x)
    saved = {} if op == "softmax" else {"checkpoints": allocate_checkpoints(forward_, x, *params)}
    forward_(y, x, *params, **saved, **eps, **options)
    Y, X = Duplicated(y, dy), Duplicated(x)
    P = tuple(Duplicated(p) for p in params)
    scratch = None if op == "softmax" else allocate_scratchspace(backward_, Y, X, *P, **options)
    held = {**saved, **({} if scratch is None else {"scratch": scratch})}
    return Calls(
        lambda: forward_(y, x, *params, **saved, **eps, **options),
        lambda: backward_(Y, X, *P, **held, **options),
        scratch,
    )


def gated_calls(op: str, arrays: Arrays, inputs: dict[str, Any], options: dict[str, Any]) -> Calls:
    """``op_`` and ``op_backward_`` over ``arrays``' copies of ``inputs`` (:func:`gated_inputs`)
    with ``options`` (GeGLU's ``approximate``); nothing is checkpointed, no scratch."""
    module = importlib.import_module(f"xpkernels.{op}")
    forward_, backward_ = getattr(module, f"{op}_"), getattr(module, f"{op}_backward_")
    a, b, dy = (arrays.convert(inputs[name]) for name in ("a", "b", "dy"))
    keywords = {**options, **arrays.options}
    y = arrays.empty_like(a)
    Y, A, B = Duplicated(y, dy), Duplicated(a), Duplicated(b)
    return Calls(lambda: forward_(y, a, b, **keywords), lambda: backward_(Y, A, B, **keywords))


#: The arrays of :func:`rope_inputs` that RoPE rotates (then their cotangents).
ROPE_ROTATED = ("q", "k", "dq_out", "dk_out")


def rope_calls(arrays: Arrays, inputs: dict[str, Any]) -> Calls:
    """``rope_`` and ``rope_backward_`` (half rotation, rows ``0 .. S-1``) over ``arrays``'
    copies of ``inputs`` (:func:`rope_inputs`), q, k and the cotangents as ``(B, H, S, D)``
    views of their ``(B, S, H, D)`` buffers, each output laid out as its input."""
    import xpkernels as xk

    q, k, dq_out, dk_out = (bhsd(arrays.convert(inputs[name])) for name in ROPE_ROTATED)
    cos, sin = arrays.convert(inputs["cos"]), arrays.convert(inputs["sin"])
    q_out, k_out, dq, dk = (arrays.empty_like(a) for a in (q, k, q, k))
    options = arrays.options
    Q_out, K_out = Duplicated(q_out, dq_out), Duplicated(k_out, dk_out)
    Q, K = Duplicated(q, dq), Duplicated(k, dk)
    return Calls(
        lambda: xk.rope_(q_out, k_out, q, k, cos, sin, **options),
        lambda: xk.rope_backward_(Q_out, K_out, Q, K, cos, sin, **options),
    )


def scalar_loss(like) -> tuple:
    """A float32 scalar ``loss`` in ``like``'s library and on its device, and its cotangent 1."""
    import array_api_compat

    xp = array_api_compat.array_namespace(like)
    device = array_api_compat.device(like)
    loss = xp.empty((), dtype=xp.float32, device=device)
    return loss, xp.ones((), dtype=xp.float32, device=device)


def cross_entropy_calls(arrays: Arrays, inputs: dict[str, Any]) -> Calls:
    """``cross_entropy_`` (the mean over the rows, each row's ``lse`` checkpointed) and
    ``cross_entropy_backward_`` (``dloss = 1``) over ``arrays``' copies of ``inputs``
    (:func:`cross_entropy_inputs`). The backward writes the gradient into a buffer of its own
    (``Duplicated(logits, dlogits)``), so every call reads the same logits."""
    import xpkernels as xk

    logits, targets = (arrays.convert(inputs[name]) for name in ("logits", "targets"))
    loss, dloss = scalar_loss(logits)
    options = arrays.options
    ck = allocate_checkpoints(xk.cross_entropy_, logits, targets)
    scratch = allocate_scratchspace(xk.cross_entropy_, logits, targets)
    xk.cross_entropy_(loss, logits, targets, checkpoints=ck, scratch=scratch, **options)
    Loss, Logits = Duplicated(loss, dloss), Duplicated(logits, arrays.empty_like(logits))
    return Calls(
        lambda: xk.cross_entropy_(
            loss, logits, targets, checkpoints=ck, scratch=scratch, **options
        ),
        lambda: xk.cross_entropy_backward_(Loss, Logits, targets, checkpoints=ck, **options),
        scratch,
    )


def linear_cross_entropy_calls(
    arrays: Arrays, inputs: dict[str, Any], dx=None, dweight=None
) -> Calls:
    """``linear_cross_entropy_`` (the mean over the rows, each row's ``lse`` checkpointed, the
    default chunk) and ``linear_cross_entropy_backward_`` (``dloss = 1``) over ``arrays``'
    copies of ``inputs`` (:func:`linear_cross_entropy_inputs`), the backward writing into
    ``dx`` and ``dweight`` (None: new arrays); the checkpoints, scratch and loss are
    allocated here, and the forward run once."""
    import xpkernels as xk

    x, weight, targets = (arrays.convert(inputs[name]) for name in ("x", "weight", "targets"))
    loss, dloss = scalar_loss(x)
    options = arrays.options
    ck = allocate_checkpoints(xk.linear_cross_entropy_, x, weight, targets)
    scratch = allocate_scratchspace(xk.linear_cross_entropy_, x, weight, targets)

    def forward():
        xk.linear_cross_entropy_(
            loss, x, weight, targets, checkpoints=ck, scratch=scratch, **options
        )

    forward()
    dx = arrays.empty_like(x) if dx is None else dx
    dweight = arrays.empty_like(weight) if dweight is None else dweight
    Loss, X, W = Duplicated(loss, dloss), Duplicated(x, dx), Duplicated(weight, dweight)
    return Calls(
        forward,
        lambda: xk.linear_cross_entropy_backward_(
            Loss, X, W, targets, checkpoints=ck, scratch=scratch, **options
        ),
        scratch,
    )


def linear_cross_entropy_step(arrays: Arrays, inputs: dict[str, Any], dx, dweight) -> None:
    """One training step's loss as the peak-memory figures measure it: the checkpoints,
    scratch (default chunk) and loss allocated, the forward, then the backward into ``dx`` and
    ``dweight`` (given: they are the step's results, not its working memory); see
    :func:`linear_cross_entropy_calls`."""
    backward = linear_cross_entropy_calls(arrays, inputs, dx, dweight).backward
    assert backward is not None
    backward()


def linear_cross_entropy_fused(
    arrays: Arrays, inputs: dict[str, Any], dx=None, dweight=None
) -> Callable[[], object]:
    """``linear_cross_entropy_`` over ``arrays``' copies of ``inputs`` with ``x`` and ``weight``
    Duplicated: the loss (the mean over the rows) and, in the same chunk loop, its gradients
    for a unit cotangent into ``dx`` and ``dweight`` (None: new arrays) -- three products
    where the forward then the backward take four (autograd's path). The scratch (default
    chunk) and loss are allocated here; returns the call."""
    import xpkernels as xk

    x, weight, targets = (arrays.convert(inputs[name]) for name in ("x", "weight", "targets"))
    loss, _ = scalar_loss(x)
    scratch = allocate_scratchspace(xk.linear_cross_entropy_, x, weight, targets)
    dx = arrays.empty_like(x) if dx is None else dx
    dweight = arrays.empty_like(weight) if dweight is None else dweight
    X, W = Duplicated(x, dx), Duplicated(weight, dweight)
    return lambda: xk.linear_cross_entropy_(loss, X, W, targets, scratch=scratch, **arrays.options)


def attention_calls(arrays: Arrays, inputs, causal: bool) -> Calls:
    """``attention_`` and ``attention_backward_`` over ``arrays``' copies of ``q, k, v, do``."""
    import xpkernels as xk

    q, k, v, do = (arrays.convert(a) for a in inputs)
    o = arrays.empty_like(q)
    options = {"causal": causal, **arrays.options}
    ck = allocate_checkpoints(xk.attention_, q, k, v)
    xk.attention_(o, q, k, v, checkpoints=ck, **options)
    O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
    scratch = allocate_scratchspace(xk.attention_backward_, O, Q, K, V, **options)
    return Calls(
        lambda: xk.attention_(o, q, k, v, checkpoints=ck, **options),
        lambda: xk.attention_backward_(O, Q, K, V, checkpoints=ck, scratch=scratch, **options),
        scratch,
    )


def decode_call(arrays: Arrays, q, k, v, length: int, block_table=None) -> Calls:
    """``decode_attention_`` of ``q`` over the caches ``k``, ``v`` (or their pages, read
    through ``block_table``), every sequence ``length`` keys long."""
    import xpkernels as xk

    q, k, v = (arrays.convert(a) for a in (q, k, v))
    paged = {} if block_table is None else {"block_table": arrays.convert(block_table)}
    lengths = arrays.integers([length] * q.shape[0])
    o = arrays.empty_like(q)
    options = {**paged, **arrays.options}
    scratch = allocate_scratchspace(xk.decode_attention_, o, q, k, v, lengths, **options)
    return Calls(
        lambda: xk.decode_attention_(o, q, k, v, lengths, scratch=scratch, **options),
        scratch=scratch,
    )


def flex_calls(arrays: Arrays, inputs, mods: dict[str, Any], **options) -> Calls:
    """``flex_attention_`` and its backward over ``arrays``' copies of ``q, k, v, do`` with
    ``mods`` (:func:`xpk_mods`: ``score_mod``, ``mask_mod``, or a ``block_mask``) and
    ``options`` (``block_sparse``); with a score mod the backward computes its gradients
    (deterministic, the default), the scratch sized for them."""
    import xpkernels as xk
    from xpkernels.flex_attention import flex_attention_, flex_attention_backward_

    q, k, v, do = (arrays.convert(a) for a in inputs)
    o = arrays.empty_like(q)
    options = {**mods, **options, **arrays.options}
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    flex_attention_(o, q, k, v, checkpoints=ck, **options)
    O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
    score = options.get("score_mod")
    grads = {} if score is None else {"score_mod_grad": xk.grad_shadow(score)}
    scratch = allocate_scratchspace(flex_attention_backward_, O, Q, K, V, **grads, **options)

    def backward_with(**changed):
        final = {**options, **grads, **changed}
        return lambda: flex_attention_backward_(
            O, Q, K, V, checkpoints=ck, scratch=scratch, **final
        )

    return Calls(
        lambda: flex_attention_(o, q, k, v, checkpoints=ck, **options),
        backward_with(),
        scratch,
        backward_with,
    )


def torch_row_op(op: str, m: int) -> Callable:
    """PyTorch's own ``op`` over rows of ``m``, as ``f(x, w, b)`` (parameters it lacks ignored)."""
    import torch
    import torch.nn.functional as F

    if op == "rms_norm":
        return lambda x, w, b: F.rms_norm(x, (m,), w, eps=ROW_EPS[op])
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, (m,), w, b, eps=ROW_EPS[op])
    return lambda x, w, b: torch.softmax(x, dim=-1)


def torch_gated_op(op: str, options: dict[str, Any]) -> Callable:
    """The PyTorch composition gated activation ``op`` replaces, as ``f(a, b)``:
    ``F.silu(a) * b`` (SwiGLU), ``F.gelu(a, approximate=...) * b`` (GeGLU, ``options``' form)."""
    import torch.nn.functional as F

    if op == "swiglu":
        return lambda a, b: F.silu(a) * b
    approximate = options["approximate"]
    return lambda a, b: F.gelu(a, approximate=approximate) * b


def hf_rope_tables(cos, sin, batch: int) -> tuple:
    """Hugging Face's ``cos``, ``sin`` ``(B, S, D)`` (torch) from the tables ``(S, D / 2)``: the
    frequencies repeated over both halves, one materialized copy per batch, as Llama's rotary
    embedding computes them."""
    import torch

    return tuple(torch.cat([t, t], -1)[None].expand(batch, -1, -1).contiguous() for t in (cos, sin))


def torch_rope(q, k, cos, sin) -> tuple:
    """The PyTorch composition RoPE replaces: Hugging Face's ``apply_rotary_pos_emb`` (half
    rotation, ``unsqueeze_dim=1``) of q, k ``(B, H, S, D)`` by ``cos``, ``sin`` ``(B, S, D)``
    (:func:`hf_rope_tables`)."""
    import torch

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_cross_entropy(logits, targets):
    """The PyTorch op cross-entropy is compared with: ``F.cross_entropy`` (the mean over the
    rows)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, targets)


def torch_linear_cross_entropy(x, weight, targets):
    """The PyTorch composition linear cross-entropy replaces: the full ``(N, V)`` logits
    ``x @ weight.T``, then ``F.cross_entropy`` (the mean over the rows)."""
    import torch.nn.functional as F

    return F.cross_entropy(x @ weight.T, targets)


# --------------------------------------------------------------------------- decode pages


#: Keys per page of the paged decode rows (DESIGN section 8's paged target is at 16).
PAGE_SIZE = 16


# --------------------------------------------------------------------------- transformers


def hf_llama_config(shape: dict[str, int], attn_implementation: str = "sdpa"):
    """A transformers ``LlamaConfig`` of ``shape`` (hidden, layers, heads, kv_heads; S as
    the longest position; the MLP 4x wide)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=shape["hidden"],
        intermediate_size=4 * shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["S"],
        use_cache=False,
    )
    config._attn_implementation = attn_implementation
    return config


def hf_llama_work(shape: dict[str, int], parameters: int) -> tuple[float, str]:
    """FLOPs of one forward+backward step of a Llama: ``6 * parameters * tokens`` plus the
    causal attention's ``6 * B * S^2 * hidden`` per layer (half of ``12 B S^2 hidden``)."""
    b, s, hidden, layers = shape["B"], shape["S"], shape["hidden"], shape["layers"]
    work = 6 * parameters * b * s + 6 * b * s * s * hidden * layers
    return float(work), "6*params*B*S + 6*B*S^2*hidden*layers"


def document_ids(s: int, documents: int) -> np.ndarray:
    """Document id of each of ``s`` positions: ``documents`` documents of uneven lengths."""
    cuts = np.sort(np.random.default_rng(5).choice(np.arange(1, s), documents - 1, replace=False))
    return np.searchsorted(cuts, np.arange(s), side="right").astype(np.int64)


def kept_pairs(s: int, mask) -> int:
    """(query, key) pairs ``mask`` keeps at Sq = Sk = s: "causal", a window length, or the
    document ids of a document mask."""
    if isinstance(mask, np.ndarray):
        return int(np.sum(np.bincount(mask) ** 2))
    if mask == "causal":
        return s * (s + 1) // 2
    full = min(s, mask + 1)
    return full * (full + 1) // 2 + (s - full) * (mask + 1)


def torch_document_mask(documents: np.ndarray):
    """The ``mask_mod`` of contiguous ``documents`` (sorted ids) for ``flex_attention``: a query
    and a key share a document when no document starts between them.

    Written with the starts as Python ints rather than as a gather from a captured tensor of
    ids: torch 2.13's CPU inductor fails to compile that gather in flex (a C++ compile error).
    """
    starts = [int(i) for i in np.flatnonzero(np.diff(documents)) + 1]

    def mask_mod(b, h, q_idx, kv_idx):
        same = kv_idx >= 0
        for start in starts:
            same = same & ((q_idx >= start) == (kv_idx >= start))
        return same

    return mask_mod
