"""The cases xpkernels' benchmarks time: shapes, work, inputs and the calls of each side.

Both benchmarks declare their cases here: ``python -m xpkernels bench`` (CPU,
:mod:`.bench` times the rows) and ``bench/gpu.py`` (a CUDA device, run by
``bench/device.sh``), which takes its shapes (:data:`GPU_SHAPES`), its
primitives (:data:`GPU_OPS`, :data:`FLEX_MODS`), the bytes and FLOPs of each
entry (:func:`row_work`, :func:`attention_work`, :func:`decode_work`,
:func:`flex_work`), its inputs (:func:`row_inputs`, :func:`attention_inputs`,
:func:`decode_inputs`, :func:`paged_cache`, :func:`flex_mods`) and the
xpkernels calls it times (:func:`row_calls`, :func:`attention_calls`,
:func:`decode_call`, :func:`flex_calls`, on an :class:`_Arrays` that says
where the arrays live and which backend runs) from here, and keeps its own
timing, ceilings and targets.

A :class:`Bench` pairs a :class:`Row` (what is timed, its work and formula,
the row its ratio compares with) with a ``setup()`` that allocates every
input, output, checkpoint and scratch buffer and returns the call to time;
:func:`compare` builds the two sides of one ratio. :func:`benches` chooses
the rows of a run (primitives, ``--quick`` shapes, the array library) and
names the comparisons skipped for a missing library; :mod:`.bench` times
them and prints the table.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..buffers import Duplicated, allocate_checkpoints, allocate_scratchspace
from ..registry import OPS

#: Shapes of a full run and of ``--quick``; ``large`` (S, D) repeats the attention and flex
#: rows at a second shape (full runs only).
SHAPES: dict[bool, dict[str, Any]] = {
    False: {
        "rows": (8192, 4096),
        "attention": {"B": 1, "H": 8, "S": 2048, "D": 64},
        "decode": {"B": 8, "H": 32, "Hkv": 8, "S": 4096, "D": 64},
        "varlen": {"H": 8, "D": 64, "lengths": (1900, 1100, 700, 300)},
        "flex": {"B": 1, "H": 8, "S": 2048, "D": 64, "window": 256, "documents": 4},
        "large": {"S": 4096, "D": 128},
        "hf_llama": {"B": 4, "S": 512, "hidden": 256, "layers": 2, "heads": 8, "kv_heads": 2},
    },
    True: {
        "rows": (256, 1024),
        "attention": {"B": 1, "H": 2, "S": 256, "D": 64},
        "decode": {"B": 2, "H": 4, "Hkv": 2, "S": 512, "D": 64},
        "varlen": {"H": 2, "D": 32, "lengths": (200, 57, 129)},
        "flex": {"B": 1, "H": 2, "S": 256, "D": 32, "window": 32, "documents": 3},
        "large": None,
        "hf_llama": {"B": 2, "S": 64, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2},
    },
}

#: The primitives whose inputs are ``(rows, M)`` arrays (:func:`row_inputs`).
ROW_OPS = ("rms_norm", "layer_norm", "softmax")
#: The primitives ``bench/gpu.py`` times on the triton backend, in its order (then each again
#: on the cupy backend).
GPU_OPS = (*ROW_OPS, "attention", "decode_attention", "flex_attention")
#: Shapes of ``bench/gpu.py``: on a CUDA device (False) and in its dry run (True: CPU tensors,
#: the Triton interpreter, tiny shapes). ``D`` lists the head dims each shape runs at; the
#: cupy backend's entries run at ``cupy``'s rows and attention shape and at ``decode``.
GPU_SHAPES: dict[bool, dict[str, Any]] = {
    False: {
        "rows": ((32768, 4096), (4096, 65536)),
        "row_dtypes": ("bfloat16", "float32"),
        "attention": {"B": 4, "H": 32, "S": 4096, "D": (64, 128)},
        "decode": {"B": 16, "H": 32, "Hkv": 8, "S": 32768, "D": 128},
        "flex": {"B": 4, "H": 16, "S": 4096, "D": (64, 128), "documents": 4},
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
        "cupy": {"rows": (64, 256), "attention": {"B": 1, "H": 2, "S": 48, "D": 32}},
        "hf_llama": {"B": 1, "S": 32, "hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2},
    },
}


@dataclass
class Row:
    """One timed (primitive, pass, implementation) and what it implies.

    ``work`` is the bytes moved (``unit`` GB/s) or the FLOPs done
    (``unit`` TFLOP/s) by one run, per ``formula``; ``baseline`` names the
    row ``ratio = median_s / baseline's median_s`` compares with.
    ``times_s`` are the timed runs the statistics come from (those of the
    re-timing when ``retimed``); ``spread = (max_s - min_s) / median_s``;
    ``flagged`` says the final timing's spread exceeds :data:`.bench.SPREAD_LIMIT`;
    ``first_spread`` is the spread of the first timing of a re-timed row.
    """

    op: str
    pass_: str
    impl: str
    shape: str
    unit: str
    work: float
    formula: str
    baseline: str | None = None
    dtype: str = "float32"
    times_s: list = field(default_factory=list)
    repeats: int = 0
    min_s: float | None = None
    median_s: float | None = None
    max_s: float | None = None
    spread: float | None = None
    flagged: bool = False
    retimed: bool = False
    first_spread: float | None = None
    rate: float | None = None
    ratio: float | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.op}/{self.pass_}/{self.impl}"

    def measured(self) -> tuple[float, float, float, float]:
        """``(min_s, median_s, max_s, spread)`` of a row that was timed (not an error row)."""
        if self.min_s is None or self.median_s is None or self.max_s is None or self.spread is None:
            raise ValueError(f"bench: {self.key} has no timings ({self.error or 'not run'})")
        return self.min_s, self.median_s, self.max_s, self.spread


@dataclass
class Bench:
    """A row to measure: ``setup()`` allocates everything and returns the callable to time."""

    row: Row
    setup: Callable[[], Callable[[], object]]
    repeats: int


Setup = Callable[[], Callable[[], object]]


def compare(
    op: str,
    pass_: str,
    shape: str,
    unit: str,
    work: float,
    formula: str,
    repeats: int,
    ours: tuple[str, Setup],
    theirs: tuple[str, Setup] | None = None,
) -> list[Bench]:
    """The benches of one comparison: ``ours`` timed against ``theirs`` in the same run.

    Parameters
    ----------
    op, pass_, shape, unit, work, formula
        What both rows measure (see :class:`Row`).
    repeats : int
        Timed runs of each side.
    ours, theirs : tuple of (str, callable)
        ``(impl, setup)`` of each side; ``setup()`` allocates everything and
        returns the callable to time. ``theirs=None`` (its library is missing):
        ``ours`` alone, without a ratio.

    Returns
    -------
    list of Bench
        ``ours`` (its ratio is its median over that of ``theirs``), then ``theirs``.
    """
    baseline = None if theirs is None else f"{op}/{pass_}/{theirs[0]}"
    benches = [
        Bench(Row(op, pass_, ours[0], shape, unit, work, formula, baseline), ours[1], repeats)
    ]
    if theirs is not None:
        benches.append(
            Bench(Row(op, pass_, theirs[0], shape, unit, work, formula), theirs[1], repeats)
        )
    return benches


# --------------------------------------------------------------------------- arrays


class _Arrays:
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


def _torch_tensor(a: np.ndarray, grad: bool = False):
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
}


def row_work(op: str, pass_: str, rows: int, m: int, itemsize: int) -> tuple[int, str]:
    """Bytes one ``pass_`` of row primitive ``op`` must move at ``(rows, m)`` with
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
    pairs = _kept_pairs(s, mask)
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
        "document": FlexMods(name, _document_ids(s, documents)),
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


def xpk_mods(mods: FlexMods, arrays: _Arrays, h: int) -> dict[str, Any]:
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
        mask_mod = _torch_document_mask(mask)
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


def row_calls(op: str, arrays: _Arrays, inputs: dict[str, Any]) -> Calls:
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


def attention_calls(arrays: _Arrays, inputs, causal: bool) -> Calls:
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


def decode_call(arrays: _Arrays, q, k, v, length: int, block_table=None) -> Calls:
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


def flex_calls(arrays: _Arrays, inputs, mods: dict[str, Any], **options) -> Calls:
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


# --------------------------------------------------------------------------- norms and softmax


def _row_benches(op: str, shape, arrays: _Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    rows, m = shape
    inputs = row_inputs(rows, m, numpy_random(1))
    shape_text = f"{rows}x{m}"
    benches = []
    for pass_ in ("forward", "backward"):
        work, formula = row_work(op, pass_, rows, m, 4)
        ours = ("xpkernels", _xpk_row_setup(op, pass_, arrays, inputs))
        theirs = ("torch", _torch_row_setup(op, pass_, inputs))
        benches += compare(
            op,
            pass_,
            shape_text,
            "GB/s",
            work,
            formula,
            repeats,
            ours,
            theirs if with_torch else None,
        )
    return benches


def _xpk_row_setup(op, pass_, arrays: _Arrays, inputs):
    def setup():
        calls = row_calls(op, arrays, inputs)
        return calls.forward if pass_ == "forward" else calls.backward

    return setup


def _torch_row_setup(op, pass_, inputs):
    def setup():
        import torch

        m = inputs["x"].shape[-1]
        grad = pass_ == "backward"
        x, w, b = (_torch_tensor(inputs[n], grad) for n in ("x", "w", "b"))
        wanted = (x, *(t for n, t in (("w", w), ("b", b)) if n in ROW_PARAMS[op]))
        call = torch_row_op(op, m)
        if not grad:

            def forward():
                with torch.no_grad():
                    return call(x, w, b)

            return forward
        y = call(x, w, b)
        dy = _torch_tensor(inputs["dy"])
        return lambda: torch.autograd.grad(y, wanted, dy, retain_graph=True)

    return setup


# --------------------------------------------------------------------------- attention


def _attention_benches(
    shape, arrays: _Arrays, repeats: int, with_torch: bool, suffix: str = ""
) -> list[Bench]:
    """Attention and causal attention, forward and backward, against SDPA; ``suffix`` ends
    the rows' primitive names (it tells the rows of a second shape apart)."""
    b, h, s, d = shape["B"], shape["H"], shape["S"], shape["D"]
    inputs = attention_inputs(b, h, s, d, numpy_random(2))
    q, k, v, do = inputs
    benches = []
    for causal in (False, True):
        op = ("attention (causal)" if causal else "attention") + suffix
        for pass_ in ("forward", "backward"):
            work, formula = attention_work(b, h, s, d, causal, pass_)
            ours = ("xpkernels", _xpk_attention_setup(arrays, inputs, causal, pass_))
            theirs = ("torch", _torch_attention_setup(q, k, v, do, causal, pass_))
            benches += compare(
                op,
                pass_,
                f"{b}x{h}x{s}x{d}",
                "TFLOP/s",
                work,
                formula,
                repeats,
                ours,
                theirs if with_torch else None,
            )
    return benches


def _xpk_attention_setup(arrays: _Arrays, inputs, causal, pass_):
    def setup():
        calls = attention_calls(arrays, inputs, causal)
        return calls.forward if pass_ == "forward" else calls.backward

    return setup


def _torch_attention_setup(q_np, k_np, v_np, do_np, causal, pass_):
    def setup():
        import torch
        import torch.nn.functional as F

        grad = pass_ == "backward"
        q, k, v = (_torch_tensor(a, grad) for a in (q_np, k_np, v_np))
        if not grad:

            def forward():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return forward
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        do = _torch_tensor(do_np)
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    return setup


# --------------------------------------------------------------------------- decode

#: Keys per page of the paged decode rows (DESIGN section 8's paged target is at 16).
PAGE_SIZE = 16


def _decode_benches(shape, arrays: _Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    rng = np.random.default_rng(3)
    q_np, k_np, v_np = decode_inputs(
        b, h, hkv, s, d, lambda shape: rng.standard_normal(shape, dtype=np.float32)
    )
    work, formula = decode_work(b, h, hkv, s, d, 4)
    shape_text = f"{b}x{h}/{hkv}x{s}x{d}"

    def xpk_setup():
        return decode_call(arrays, q_np, k_np, v_np, s).forward

    def torch_setup():
        import torch
        import torch.nn.functional as F

        q = _torch_tensor(q_np[:, :, None, :])
        k, v = _torch_tensor(k_np), _torch_tensor(v_np)

        def forward():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return forward

    def paged_setup():  # the same cache in shuffled pages, read through a block table
        order = rng.permutation(b * s // PAGE_SIZE)
        table, k_pages, v_pages = paged_cache(k_np, v_np, order, PAGE_SIZE)
        return decode_call(arrays, q_np, k_pages, v_pages, s, block_table=table).forward

    theirs = ("torch", torch_setup) if with_torch else None
    paged_work, paged_formula = decode_work(b, h, hkv, s, d, 4, PAGE_SIZE)
    paged = Row(
        "decode_attention",
        "forward",
        f"xpkernels paged{PAGE_SIZE}",
        shape_text,
        "GB/s",
        paged_work,
        paged_formula,
        "decode_attention/forward/xpkernels",
    )
    return compare(
        "decode_attention",
        "forward",
        shape_text,
        "GB/s",
        work,
        formula,
        repeats,
        ("xpkernels", xpk_setup),
        theirs,
    ) + [Bench(paged, paged_setup, repeats)]


# --------------------------------------------------------------------------- varlen


def _varlen_pairs(lengths, causal: bool) -> int:
    """(query, key) pairs attention over each sequence alone computes: ``L^2`` per sequence, or
    ``L (L + 1) / 2`` causal."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def _varlen_benches(shape, arrays: _Arrays, repeats: int) -> list[Bench]:
    """Packed sequences of mixed lengths against the same sequences padded to the longest and
    given to attention with ``q_lengths = k_lengths`` (the padding is masked, not computed):
    the same pairs, so the ratio is the cost of packing against padding. Both hold the tokens
    of a sequence with the heads inside (packed ``(T, H, D)``, padded ``(B, Smax, H, D)``
    viewed as ``(B, H, Smax, D)``), so the layout is the same too."""
    h, d, lengths = shape["H"], shape["D"], tuple(shape["lengths"])
    rng = np.random.default_rng(6)
    packed = [rng.standard_normal((sum(lengths), h, d), dtype=np.float32) for _ in range(4)]
    shape_text = f"{h}x({'+'.join(map(str, lengths))})x{d}"
    benches = []
    for causal in (False, True):
        op = "attention_varlen (causal)" if causal else "attention_varlen"
        pairs = _varlen_pairs(lengths, causal)
        for pass_ in ("forward", "backward"):
            work = 4 * h * d * pairs * (2.5 if pass_ == "backward" else 1.0)
            formula = (
                f"FLOPs = {'2.5 * ' if pass_ == 'backward' else ''}4*H*D*pairs, pairs = "
                f"sum over sequences of {'L*(L+1)/2' if causal else 'L^2'} = {pairs:,} (H={h}, "
                f"D={d}, L = {', '.join(map(str, lengths))}; padded: B={len(lengths)}, "
                f"Smax={max(lengths)}, q_lengths = k_lengths = L, the same pairs)"
            )
            benches += compare(
                op,
                pass_,
                shape_text,
                "TFLOP/s",
                work,
                formula,
                repeats,
                ("xpkernels", _xpk_varlen_setup(arrays, packed, lengths, causal, pass_)),
                ("xpkernels padded", _xpk_padded_setup(arrays, packed, lengths, causal, pass_)),
            )
    return benches


def _flex_varlen_benches(shape, arrays: _Arrays, repeats: int) -> list[Bench]:
    """``flex_attention_varlen`` with ``CausalMask()`` against ``attention_varlen(causal=True)``
    over the same packed sequences: the cost of running the mask graph (and skipping tiles from
    its band) instead of attention's built-in causal masking."""
    h, d, lengths = shape["H"], shape["D"], tuple(shape["lengths"])
    rng = np.random.default_rng(7)
    packed = [rng.standard_normal((sum(lengths), h, d), dtype=np.float32) for _ in range(4)]
    shape_text = f"{h}x({'+'.join(map(str, lengths))})x{d}"
    pairs = _varlen_pairs(lengths, True)
    benches = []
    for pass_ in ("forward", "backward"):
        work = 4 * h * d * pairs * (2.5 if pass_ == "backward" else 1.0)
        formula = (
            f"FLOPs = {'2.5 * ' if pass_ == 'backward' else ''}4*H*D*pairs, pairs = sum over "
            f"sequences of L*(L+1)/2 = {pairs:,} (H={h}, D={d}, L = "
            f"{', '.join(map(str, lengths))}); baseline: attention_varlen(causal=True)"
        )
        benches += compare(
            "flex_attention_varlen (causal)",
            pass_,
            shape_text,
            "TFLOP/s",
            work,
            formula,
            repeats,
            ("xpkernels", _xpk_varlen_setup(arrays, packed, lengths, True, pass_, flex=True)),
            ("xpkernels attention_varlen", _xpk_varlen_setup(arrays, packed, lengths, True, pass_)),
        )
    return benches


def _xpk_varlen_setup(arrays: _Arrays, packed, lengths, causal, pass_, flex=False):
    """``attention_varlen_`` (or its backward) over the packed ``(T, H, D)`` q, k, v (and do);
    ``flex``: ``flex_attention_varlen_`` with ``CausalMask()`` (``causal`` must be True)."""

    def setup():
        import xpkernels as xk
        from xpkernels.mods import CausalMask

        q, k, v, do = (arrays.convert(a) for a in packed)
        cu = arrays.convert(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        o = arrays.empty_like(q)
        if flex:
            forward, backward = xk.flex_attention_varlen_, xk.flex_attention_varlen_backward_
            options = {"mask_mod": CausalMask()}
        else:
            forward, backward = xk.attention_varlen_, xk.attention_varlen_backward_
            options = {"causal": causal}
        ck = allocate_checkpoints(forward, q, k, v)
        forward(o, q, k, v, cu, cu, checkpoints=ck, **options)
        if pass_ == "forward":
            return lambda: forward(o, q, k, v, cu, cu, checkpoints=ck, **options)
        O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
        scratch = allocate_scratchspace(backward, O, Q, K, V)
        return lambda: backward(O, Q, K, V, cu, cu, checkpoints=ck, scratch=scratch, **options)

    return setup


def _padded(packed: np.ndarray, lengths) -> np.ndarray:
    """Packed ``(T, H, D)`` tokens as ``(B, H, Smax, D)``: a view of ``(B, Smax, H, D)`` zeros
    holding sequence ``b`` in its first ``lengths[b]`` positions."""
    out = np.zeros((len(lengths), max(lengths), *packed.shape[1:]), dtype=packed.dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for b, n in enumerate(lengths):
        out[b, :n] = packed[starts[b] : starts[b] + n]
    return out


def _padded_inputs(arrays: _Arrays, packed, lengths, causal):
    """``(q, k, v, do)`` of the padded batch, ``(B, H, Smax, D)`` views, and attention's options
    for it (the padding masked by ``q_lengths = k_lengths = lengths``)."""
    import array_api_compat

    held = [arrays.convert(_padded(a, lengths)) for a in packed]
    xp = array_api_compat.array_namespace(held[0])
    n = arrays.integers(list(lengths))
    views = tuple(xp.permute_dims(a, (0, 2, 1, 3)) for a in held)
    return views, {"causal": causal, "q_lengths": n, "k_lengths": n}


def _xpk_padded_setup(arrays: _Arrays, packed, lengths, causal, pass_):
    """``attention_`` (or its backward) over the padded batch of :func:`_padded_inputs`."""

    def setup():
        import xpkernels as xk

        (q, k, v, do), opts = _padded_inputs(arrays, packed, lengths, causal)
        o = arrays.empty_like(q)
        ck = allocate_checkpoints(xk.attention_, q, k, v)
        xk.attention_(o, q, k, v, checkpoints=ck, **opts)
        if pass_ == "forward":
            return lambda: xk.attention_(o, q, k, v, checkpoints=ck, **opts)
        O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
        scratch = allocate_scratchspace(xk.attention_backward_, O, Q, K, V)
        return lambda: xk.attention_backward_(O, Q, K, V, checkpoints=ck, scratch=scratch, **opts)

    return setup


# --------------------------------------------------------------------------- flex attention


def _document_ids(s: int, documents: int) -> np.ndarray:
    """Document id of each of ``s`` positions: ``documents`` documents of uneven lengths."""
    cuts = np.sort(np.random.default_rng(5).choice(np.arange(1, s), documents - 1, replace=False))
    return np.searchsorted(cuts, np.arange(s), side="right").astype(np.int64)


def _kept_pairs(s: int, mask) -> int:
    """(query, key) pairs ``mask`` keeps at Sq = Sk = s: "causal", a window length, or the
    document ids of a document mask."""
    if isinstance(mask, np.ndarray):
        return int(np.sum(np.bincount(mask) ** 2))
    if mask == "causal":
        return s * (s + 1) // 2
    full = min(s, mask + 1)
    return full * (full + 1) // 2 + (s - full) * (mask + 1)


def _flex_benches(
    shape,
    attention_shape,
    arrays: _Arrays,
    repeats: int,
    compiled_torch: bool,
    suffix: str = "",
) -> list[Bench]:
    """Three masks at ``shape``: block-sparse against ``torch.compile(flex_attention)`` with its
    block mask (``compiled_torch``; else against our dense path), and against our dense path
    backward (PyTorch has no CPU backward); no-mod flex against attention at
    ``attention_shape`` (None: no such rows). ``suffix`` ends the rows' primitive names."""
    benches = []
    b, h, s, d, w = (shape[n] for n in ("B", "H", "S", "D", "window"))
    shape_text = f"{b}x{h}x{s}x{d}"
    inputs = attention_inputs(b, h, s, d, numpy_random(4))
    masks: tuple[tuple[str, Any], ...] = (
        ("flex causal mask" + suffix, "causal"),
        (f"flex window {w}" + suffix, w),
        (f"flex {shape['documents']} documents" + suffix, _document_ids(s, shape["documents"])),
    )
    for label, mask in masks:
        for pass_ in ("forward", "backward"):
            work, formula = flex_work(b, h, s, d, mask, pass_)
            sides = [
                (impl, _xpk_flex_setup(arrays, inputs, pass_, mask=mask, block_sparse=sparse))
                for impl, sparse in (("xpkernels", True), ("xpkernels dense", False))
            ]
            if pass_ == "forward" and compiled_torch:
                theirs = ("torch.compile", _torch_flex_setup(inputs, mask))
                for side in sides:
                    benches += compare(
                        label, pass_, shape_text, "TFLOP/s", work, formula, repeats, side
                    )
                    benches[-1].row.baseline = f"{label}/{pass_}/{theirs[0]}"
                benches += compare(
                    label, pass_, shape_text, "TFLOP/s", work, formula, repeats, theirs
                )
            else:
                benches += compare(
                    label, pass_, shape_text, "TFLOP/s", work, formula, repeats, *sides
                )
    if attention_shape is None:
        return benches
    b, h, s, d = (attention_shape[n] for n in ("B", "H", "S", "D"))
    shape_text = f"{b}x{h}x{s}x{d}"
    inputs = attention_inputs(b, h, s, d, numpy_random(2))
    for pass_ in ("forward", "backward"):
        work, formula = flex_work(b, h, s, d, None, pass_)
        baseline = f"attention/{pass_}/xpkernels"
        row = Row(
            "flex no mods", pass_, "xpkernels", shape_text, "TFLOP/s", work, formula, baseline
        )
        benches.append(Bench(row, _xpk_flex_setup(arrays, inputs, pass_), repeats))
    return benches


def _torch_document_mask(documents: np.ndarray):
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


def _torch_flex_setup(inputs, mask):
    """``torch.compile(flex_attention)`` forward with the block mask of ``mask`` (as in
    :func:`_kept_pairs`); compiling happens in the setup and the warm-up run, never timed."""

    def setup():
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = (_torch_tensor(a) for a in inputs[:3])
        s = q.shape[2]
        _, mask_mod = torch_mods(FlexMods("mask", mask), q.shape[1])
        block_mask = create_block_mask(mask_mod, None, None, s, s, device="cpu")
        compiled = torch.compile(flex_attention)

        def forward():
            with torch.no_grad():
                return compiled(q, k, v, block_mask=block_mask)

        return forward

    return setup


def _xpk_flex_setup(arrays: _Arrays, inputs, pass_, mask=None, block_sparse=True):
    """Flex over ``inputs`` (q, k, v, do) with ``mask``: None, "causal", a window length or
    document ids.

    Causal and window masks skip tiles by their declared key ranges, and so does a document
    mask over host ids (contiguous documents: one range per query). Over ids that declare
    none, block-sparse document masks get a :class:`~xpkernels.mods.BlockMask` built in the
    setup (untimed, as ``create_block_mask`` is on the torch side) at the array_api backend's
    default tiles.
    """

    def setup():
        from xpkernels.backends.array_api.flex_attention import default_tiles
        from xpkernels.mods import build_block_mask
        from xpkernels.mods.bands import exact_band

        q, k = inputs[0], inputs[1]
        mods = xpk_mods(FlexMods("mask", mask), arrays, q.shape[1])
        if isinstance(mask, np.ndarray) and block_sparse:
            if exact_band(mods["mask_mod"], 0, mask.size, mask.size) is None:
                n = q.shape[2]
                tile_m, tile_n = default_tiles(n, n, q.shape[1] // k.shape[1], True)
                mods["block_mask"] = build_block_mask(
                    mods.pop("mask_mod"), n, n, tile_m=tile_m, tile_n=tile_n
                )
        calls = flex_calls(arrays, inputs, mods, block_sparse=block_sparse)
        return calls.forward if pass_ == "forward" else calls.backward

    return setup


# --------------------------------------------------------------------------- a run's rows


#: The PyTorch op each primitive's comparison rows time.
_TORCH_OPS = {
    "rms_norm": "F.rms_norm",
    "layer_norm": "F.layer_norm",
    "softmax": "torch.softmax",
    "attention": "F.scaled_dot_product_attention",
    "decode_attention": "F.scaled_dot_product_attention (enable_gqa)",
    "flex_attention": "torch.compile(flex_attention)",
}


def torch_missing() -> str | None:
    """Why torch cannot be used here (``"torch is not installed"``, ...), or None when it can."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            return "torch is not installed"
        return f"torch cannot be imported ({type(exc).__name__}: {exc})"
    except ImportError as exc:
        return f"torch cannot be imported ({type(exc).__name__}: {exc})"
    return None


def benches(quick: bool, ops, library: str, repeats: int | None) -> tuple[list[Bench], list[str]]:
    """The benches to run and one line per comparison skipped for a missing library."""
    shapes = SHAPES[quick]
    missing = torch_missing()
    with_torch = missing is None
    arrays = _Arrays(library)
    row_repeats = repeats or (3 if quick else 5)
    attn_repeats = repeats or 3
    chosen = [op for op in OPS if not ops or op in ops]
    large = shapes["large"]
    suffix = "" if large is None else f" S={large['S']} D={large['D']}"
    skipped = []
    compared = [_TORCH_OPS[op] for op in chosen if op in _TORCH_OPS]
    if missing and compared:
        names = ", ".join(dict.fromkeys(compared))
        skipped.append(f"{missing}: the comparison rows against {names} are skipped")
    benches = []
    for op in chosen:
        if op in ROW_OPS:
            benches += _row_benches(op, shapes["rows"], arrays, row_repeats, with_torch)
        elif op == "attention":
            benches += _attention_benches(shapes["attention"], arrays, attn_repeats, with_torch)
            if large is not None:
                benches += _attention_benches(
                    {**shapes["attention"], **large}, arrays, attn_repeats, with_torch, suffix
                )
        elif op == "decode_attention":
            benches += _decode_benches(shapes["decode"], arrays, row_repeats, with_torch)
        elif op == "attention_varlen":
            benches += _varlen_benches(shapes["varlen"], arrays, attn_repeats)
        elif op == "flex_attention_varlen":
            benches += _flex_varlen_benches(shapes["varlen"], arrays, attn_repeats)
        elif op == "flex_attention":
            if "attention" not in chosen:  # the baseline of the no-mod rows
                benches += [
                    bench
                    for bench in _attention_benches(
                        shapes["attention"], arrays, attn_repeats, False
                    )
                    if bench.row.op == "attention"
                ]
            compiled_torch = with_torch and not quick
            if with_torch and quick:
                skipped.append(
                    "--quick: the torch.compile(flex_attention) rows are skipped (compiling "
                    "takes about a minute per mask); flex forward rows compare with our dense path"
                )
            benches += _flex_benches(
                shapes["flex"], shapes["attention"], arrays, attn_repeats, compiled_torch
            )
            if large is not None:
                benches += _flex_benches(
                    {**shapes["flex"], **large}, None, arrays, attn_repeats, compiled_torch, suffix
                )
        else:
            skipped.append(f"{op}: bench has no rows for this primitive")
    if with_torch and library == "torch":  # the autograd path: xpkernels.torch.bench
        from ..torch.bench import autograd_benches

        benches += autograd_benches(shapes, chosen, attn_repeats, Row, Bench)
        if not ops or "attention" in chosen:
            if importlib.util.find_spec("transformers") is None:
                skipped.append("transformers is not installed: the Llama training-step rows")
            else:
                benches += hf_llama_benches(shapes["hf_llama"], attn_repeats)
    return benches, skipped


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


def hf_llama_benches(shape: dict[str, int], repeats: int) -> list[Bench]:
    """One training step (forward, ``loss.backward()``) of a tiny transformers Llama on torch
    CPU tensors: ``apply_xpkernels`` against the same model on transformers' SDPA attention."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_llama_config(shape))
    parameters = sum(p.numel() for p in model.parameters())
    work, formula = hf_llama_work(shape, parameters)
    ids = torch.randint(0, 1024, (shape["B"], shape["S"]))
    text = f"{shape['B']}x{shape['S']} hidden={shape['hidden']} layers={shape['layers']}"

    def setup(xpkernels: bool):
        def build():
            from ..torch.transformers import apply_xpkernels

            torch.manual_seed(0)
            llama = LlamaForCausalLM(hf_llama_config(shape))
            if xpkernels:
                apply_xpkernels(llama)

            def step():
                llama.zero_grad(set_to_none=True)
                llama(ids, labels=ids).loss.backward()

            return step

        return build

    return compare(
        "llama train step [transformers]",
        "fwd+bwd",
        text,
        "TFLOP/s",
        work,
        formula,
        repeats,
        ("xpkernels", setup(True)),
        ("sdpa", setup(False)),
    )
