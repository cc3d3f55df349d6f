"""The cases xpkernels' benchmarks time: shapes, work, inputs and the calls of each side.

Both benchmarks declare their cases here: ``python -m xpkernels bench`` (CPU,
:mod:`.bench` times the rows) and ``bench/gpu.py`` (a CUDA device, run by
``bench/device.sh``), which takes its shapes (:data:`GPU_SHAPES`), its
primitives (:data:`GPU_OPS`, :data:`GATED_CASES`, :data:`FLEX_MODS`), the
bytes and FLOPs of each entry (:func:`row_work`, :func:`rope_work`,
:func:`attention_work`, :func:`decode_work`, :func:`flex_work`), its inputs
(:func:`row_inputs`, :func:`gated_inputs`, :func:`rope_inputs`,
:func:`attention_inputs`, :func:`decode_inputs`, :func:`paged_cache`,
:func:`flex_mods`) and the xpkernels calls it times (:func:`row_calls`,
:func:`gated_calls`, :func:`rope_calls`, :func:`attention_calls`,
:func:`decode_call`, :func:`flex_calls`, on an :class:`Arrays` that says
where the arrays live and which backend runs) from here, and keeps its own
timing, ceilings and targets.

The loss rows (cross-entropy, linear cross-entropy) live in :mod:`.bench_loss`.

Each row is a :class:`.bench_rows.Bench` (a :class:`.bench_rows.Row` and the
``setup()`` that allocates its buffers and returns the call to time), built
in pairs by :func:`.bench_rows.compare`. :func:`benches` chooses
the rows of a run (primitives, ``--quick`` shapes, the array library) and
names the comparisons skipped for a missing library; :mod:`.bench` times
them and prints the table.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np

from ..buffers import Duplicated, allocate_checkpoints, allocate_scratchspace
from ..registry import OPS
from .bench_loss import loss_benches
from .bench_rows import Bench, Row, compare, torch_setup, xpk_setup
from .bench_work import (
    GATED_CASES,
    GATED_OPS,
    LOSS_OPS,
    PAGE_SIZE,
    ROW_OPS,
    ROW_PARAMS,
    Arrays,
    FlexMods,
    attention_calls,
    attention_inputs,
    attention_work,
    decode_call,
    decode_inputs,
    decode_work,
    document_ids,
    flex_calls,
    flex_work,
    gated_calls,
    gated_inputs,
    hf_llama_config,
    hf_llama_work,
    hf_rope_tables,
    numpy_random,
    paged_cache,
    rope_calls,
    rope_inputs,
    rope_work,
    row_calls,
    row_inputs,
    row_work,
    torch_gated_op,
    torch_mods,
    torch_rope,
    torch_row_op,
    torch_tensor,
    xpk_mods,
)

#: Shapes of a full run and of ``--quick``; ``large`` (S, D) repeats the attention and flex
#: rows at a second shape (full runs only).
SHAPES: dict[bool, dict[str, Any]] = {
    False: {
        "rows": (8192, 4096),
        "rope": {"B": 4, "H": 32, "Hkv": 8, "S": 512, "D": 128},
        "cross_entropy": {"N": 4096, "V": 32000},
        "linear_cross_entropy": {"N": 2048, "H": 512, "V": 16000},
        "attention": {"B": 1, "H": 8, "S": 2048, "D": 64},
        "decode": {"B": 8, "H": 32, "Hkv": 8, "S": 4096, "D": 64},
        "varlen": {"H": 8, "D": 64, "lengths": (1900, 1100, 700, 300)},
        "flex": {"B": 1, "H": 8, "S": 2048, "D": 64, "window": 256, "documents": 4},
        "large": {"S": 4096, "D": 128},
        "hf_llama": {"B": 4, "S": 512, "hidden": 256, "layers": 2, "heads": 8, "kv_heads": 2},
    },
    True: {
        "rows": (256, 1024),
        "rope": {"B": 2, "H": 4, "Hkv": 2, "S": 64, "D": 64},
        "cross_entropy": {"N": 64, "V": 1000},
        "linear_cross_entropy": {"N": 64, "H": 32, "V": 500},
        "attention": {"B": 1, "H": 2, "S": 256, "D": 64},
        "decode": {"B": 2, "H": 4, "Hkv": 2, "S": 512, "D": 64},
        "varlen": {"H": 2, "D": 32, "lengths": (200, 57, 129)},
        "flex": {"B": 1, "H": 2, "S": 256, "D": 32, "window": 32, "documents": 3},
        "large": None,
        "hf_llama": {"B": 2, "S": 64, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2},
    },
}


# --------------------------------------------------------------------------- norms and softmax


def _row_benches(op: str, shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    rows, m = shape
    inputs = row_inputs(rows, m, numpy_random(1))
    shape_text = f"{rows}x{m}"
    benches = []
    for pass_ in ("forward", "backward"):
        ours = ("xpkernels", xpk_setup(pass_, row_calls, op, arrays, inputs))
        theirs = ("torch", _torch_row_setup(op, pass_, inputs)) if with_torch else None
        work = row_work(op, pass_, rows, m, 4)
        benches += compare(op, pass_, shape_text, "GB/s", work, repeats, ours, theirs)
    return benches


def _torch_row_setup(op, pass_, inputs):
    def make(grad):
        x, w, b = (torch_tensor(inputs[n], grad) for n in ("x", "w", "b"))
        leaves = (x, *(t for n, t in (("w", w), ("b", b)) if n in ROW_PARAMS[op]))
        call = torch_row_op(op, inputs["x"].shape[-1])
        return (lambda: call(x, w, b)), leaves, torch_tensor(inputs["dy"])

    return torch_setup(pass_, make)


# --------------------------------------------------------------------------- gated activations


def _gated_benches(op: str, shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    """Each case of gated activation ``op`` (:data:`GATED_CASES`), forward and backward, against
    the PyTorch composition it replaces (:func:`torch_gated_op`)."""
    rows, m = shape
    inputs = gated_inputs(rows, m, numpy_random(8))
    shape_text = f"{rows}x{m}"
    benches = []
    for name, options in GATED_CASES[op]:
        for pass_ in ("forward", "backward"):
            ours = ("xpkernels", xpk_setup(pass_, gated_calls, op, arrays, inputs, options))
            theirs = (
                ("torch", _torch_gated_setup(op, options, pass_, inputs)) if with_torch else None
            )
            work = row_work(op, pass_, rows, m, 4)
            benches += compare(name, pass_, shape_text, "GB/s", work, repeats, ours, theirs)
    return benches


def _torch_gated_setup(op, options, pass_, inputs):
    def make(grad):
        a, b = (torch_tensor(inputs[n], grad) for n in ("a", "b"))
        call = torch_gated_op(op, options)
        return (lambda: call(a, b)), (a, b), torch_tensor(inputs["dy"])

    return torch_setup(pass_, make)


# --------------------------------------------------------------------------- rope


def _rope_benches(shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    """RoPE (half rotation, full rotary, rows ``0 .. S-1``), forward and backward, against
    Hugging Face's ``apply_rotary_pos_emb`` composition (:func:`torch_rope`; its backward by
    autograd, to the q and k buffers); q, k and the cotangents are ``(B, H, S, D)`` views of
    ``(B, S, H, D)`` buffers on both sides."""
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    inputs = rope_inputs(b, h, hkv, s, d, numpy_random(9))
    shape_text = f"{b}x{h}/{hkv}x{s}x{d}"
    benches = []
    for pass_ in ("forward", "backward"):
        ours = ("xpkernels", xpk_setup(pass_, rope_calls, arrays, inputs))
        theirs = ("torch", _torch_rope_setup(pass_, inputs)) if with_torch else None
        work = rope_work(pass_, b, h, hkv, s, d, 4, 4)
        benches += compare("rope", pass_, shape_text, "GB/s", work, repeats, ours, theirs)
    return benches


def _torch_rope_setup(pass_, inputs):
    def make(grad):
        batch = inputs["q"].shape[0]
        cos, sin = hf_rope_tables(*(torch_tensor(inputs[n]) for n in ("cos", "sin")), batch)
        buffers = tuple(torch_tensor(inputs[n], grad) for n in ("q", "k"))
        q, k = (t.permute(0, 2, 1, 3) for t in buffers)
        douts = tuple(torch_tensor(inputs[n]).permute(0, 2, 1, 3) for n in ("dq_out", "dk_out"))
        return (lambda: torch_rope(q, k, cos, sin)), buffers, douts

    return torch_setup(pass_, make)


# --------------------------------------------------------------------------- attention


def _attention_benches(
    shape, arrays: Arrays, repeats: int, with_torch: bool, suffix: str = ""
) -> list[Bench]:
    """Attention and causal attention, forward and backward, against SDPA; ``suffix`` ends
    the rows' primitive names (it tells the rows of a second shape apart)."""
    b, h, s, d = shape["B"], shape["H"], shape["S"], shape["D"]
    inputs = attention_inputs(b, h, s, d, numpy_random(2))
    shape_text = f"{b}x{h}x{s}x{d}"
    benches = []
    for causal in (False, True):
        op = ("attention (causal)" if causal else "attention") + suffix
        for pass_ in ("forward", "backward"):
            ours = ("xpkernels", xpk_setup(pass_, attention_calls, arrays, inputs, causal))
            theirs = (
                ("torch", _torch_attention_setup(inputs, causal, pass_)) if with_torch else None
            )
            work = attention_work(b, h, s, d, causal, pass_)
            benches += compare(op, pass_, shape_text, "TFLOP/s", work, repeats, ours, theirs)
    return benches


def _torch_attention_setup(inputs, causal, pass_):
    def make(grad):
        import torch.nn.functional as F

        q, k, v = (torch_tensor(a, grad) for a in inputs[:3])
        call = F.scaled_dot_product_attention
        return (lambda: call(q, k, v, is_causal=causal)), (q, k, v), torch_tensor(inputs[3])

    return torch_setup(pass_, make)


# --------------------------------------------------------------------------- decode


def _decode_benches(shape, arrays: Arrays, repeats: int, with_torch: bool) -> list[Bench]:
    b, h, hkv, s, d = (shape[n] for n in ("B", "H", "Hkv", "S", "D"))
    rng = np.random.default_rng(3)
    q_np, k_np, v_np = decode_inputs(
        b, h, hkv, s, d, lambda shape: rng.standard_normal(shape, dtype=np.float32)
    )
    work = decode_work(b, h, hkv, s, d, 4)
    shape_text = f"{b}x{h}/{hkv}x{s}x{d}"

    def decode_setup():
        return decode_call(arrays, q_np, k_np, v_np, s).forward

    def torch_setup():
        import torch
        import torch.nn.functional as F

        q = torch_tensor(q_np[:, :, None, :])
        k, v = torch_tensor(k_np), torch_tensor(v_np)

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
    ours = ("xpkernels", decode_setup)
    pair = compare("decode_attention", "forward", shape_text, "GB/s", work, repeats, ours, theirs)
    return pair + [Bench(paged, paged_setup, repeats)]


# --------------------------------------------------------------------------- varlen


def _varlen_pairs(lengths, causal: bool) -> int:
    """(query, key) pairs attention over each sequence alone computes: ``L^2`` per sequence, or
    ``L (L + 1) / 2`` causal."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def _varlen_benches(shape, arrays: Arrays, repeats: int) -> list[Bench]:
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
            ours = ("xpkernels", _xpk_varlen_setup(arrays, packed, lengths, causal, pass_))
            theirs = ("xpkernels padded", _xpk_padded_setup(arrays, packed, lengths, causal, pass_))
            benches += compare(
                op, pass_, shape_text, "TFLOP/s", (work, formula), repeats, ours, theirs
            )
    return benches


def _flex_varlen_benches(shape, arrays: Arrays, repeats: int) -> list[Bench]:
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
        ours = ("xpkernels", _xpk_varlen_setup(arrays, packed, lengths, True, pass_, flex=True))
        theirs = (
            "xpkernels attention_varlen",
            _xpk_varlen_setup(arrays, packed, lengths, True, pass_),
        )
        label = "flex_attention_varlen (causal)"
        benches += compare(
            label, pass_, shape_text, "TFLOP/s", (work, formula), repeats, ours, theirs
        )
    return benches


def _xpk_varlen_setup(arrays: Arrays, packed, lengths, causal, pass_, flex=False):
    """``attention_varlen_`` (or its backward) over the packed ``(T, H, D)`` q, k, v (and do);
    ``flex``: ``flex_attention_varlen_`` with ``CausalMask()`` (``causal`` must be True)."""

    def setup():
        import xpkernels as xk
        from xpkernels.mods import CausalMask

        inputs = [arrays.convert(a) for a in packed]
        cu = arrays.convert(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        if flex:
            functions = (xk.flex_attention_varlen_, xk.flex_attention_varlen_backward_)
            options = {"mask_mod": CausalMask()}
        else:
            functions = (xk.attention_varlen_, xk.attention_varlen_backward_)
            options = {"causal": causal}
        return _attention_pass(arrays, pass_, *functions, inputs, options, (cu, cu))

    return setup


def _attention_pass(arrays: Arrays, pass_, forward, backward, inputs, options, args=()):
    """``forward(o, q, k, v, *args, **options)`` run once over ``inputs``, then ``pass_``'s call."""
    q, k, v, do = inputs
    o = arrays.empty_like(q)
    ck = allocate_checkpoints(forward, q, k, v)
    forward(o, q, k, v, *args, checkpoints=ck, **options)
    if pass_ == "forward":
        return lambda: forward(o, q, k, v, *args, checkpoints=ck, **options)
    O, Q, K, V = Duplicated(o, do), Duplicated(q), Duplicated(k), Duplicated(v)
    scratch = allocate_scratchspace(backward, O, Q, K, V)
    return lambda: backward(O, Q, K, V, *args, checkpoints=ck, scratch=scratch, **options)


def _padded(packed: np.ndarray, lengths) -> np.ndarray:
    """Packed ``(T, H, D)`` tokens as ``(B, H, Smax, D)``: a view of ``(B, Smax, H, D)`` zeros
    holding sequence ``b`` in its first ``lengths[b]`` positions."""
    out = np.zeros((len(lengths), max(lengths), *packed.shape[1:]), dtype=packed.dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for b, n in enumerate(lengths):
        out[b, :n] = packed[starts[b] : starts[b] + n]
    return out


def _padded_inputs(arrays: Arrays, packed, lengths, causal):
    """``(q, k, v, do)`` of the padded batch, ``(B, H, Smax, D)`` views, and attention's options
    for it (the padding masked by ``q_lengths = k_lengths = lengths``)."""
    import array_api_compat

    held = [arrays.convert(_padded(a, lengths)) for a in packed]
    xp = array_api_compat.array_namespace(held[0])
    n = arrays.integers(list(lengths))
    views = tuple(xp.permute_dims(a, (0, 2, 1, 3)) for a in held)
    return views, {"causal": causal, "q_lengths": n, "k_lengths": n}


def _xpk_padded_setup(arrays: Arrays, packed, lengths, causal, pass_):
    """``attention_`` (or its backward) over the padded batch of :func:`_padded_inputs`."""

    def setup():
        import xpkernels as xk

        inputs, opts = _padded_inputs(arrays, packed, lengths, causal)
        return _attention_pass(arrays, pass_, xk.attention_, xk.attention_backward_, inputs, opts)

    return setup


# --------------------------------------------------------------------------- flex attention


def _flex_benches(
    shape,
    attention_shape,
    arrays: Arrays,
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
        (f"flex {shape['documents']} documents" + suffix, document_ids(s, shape["documents"])),
    )
    for label, mask in masks:
        for pass_ in ("forward", "backward"):
            work = flex_work(b, h, s, d, mask, pass_)
            sides = [
                (impl, _xpk_flex_setup(arrays, inputs, pass_, mask=mask, block_sparse=sparse))
                for impl, sparse in (("xpkernels", True), ("xpkernels dense", False))
            ]
            if pass_ == "forward" and compiled_torch:
                theirs = ("torch.compile", _torch_flex_setup(inputs, mask))
                for side in sides:
                    benches += compare(label, pass_, shape_text, "TFLOP/s", work, repeats, side)
                    benches[-1].row.baseline = f"{label}/{pass_}/{theirs[0]}"
                benches += compare(label, pass_, shape_text, "TFLOP/s", work, repeats, theirs)
            else:
                benches += compare(label, pass_, shape_text, "TFLOP/s", work, repeats, *sides)
    if attention_shape is None:
        return benches
    b, h, s, d = (attention_shape[n] for n in ("B", "H", "S", "D"))
    shape_text = f"{b}x{h}x{s}x{d}"
    inputs = attention_inputs(b, h, s, d, numpy_random(2))
    for pass_ in ("forward", "backward"):
        work = flex_work(b, h, s, d, None, pass_)
        baseline = f"attention/{pass_}/xpkernels"
        row = Row("flex no mods", pass_, "xpkernels", shape_text, "TFLOP/s", *work, baseline)
        benches.append(Bench(row, _xpk_flex_setup(arrays, inputs, pass_), repeats))
    return benches


def _torch_flex_setup(inputs, mask):
    """``torch.compile(flex_attention)`` forward with the block mask of ``mask`` (as in
    :func:`_kept_pairs`); compiling happens in the setup and the warm-up run, never timed."""

    def setup():
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = (torch_tensor(a) for a in inputs[:3])
        s = q.shape[2]
        _, mask_mod = torch_mods(FlexMods("mask", mask), q.shape[1])
        block_mask = create_block_mask(mask_mod, None, None, s, s, device="cpu")
        compiled = torch.compile(flex_attention)

        def forward():
            with torch.no_grad():
                return compiled(q, k, v, block_mask=block_mask)

        return forward

    return setup


def _xpk_flex_setup(arrays: Arrays, inputs, pass_, mask=None, block_sparse=True):
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
    "swiglu": "F.silu(a) * b",
    "geglu": "F.gelu(a, approximate=...) * b",
    "rope": "q * cos + rotate_half(q) * sin",
    "cross_entropy": "F.cross_entropy",
    "linear_cross_entropy": "F.cross_entropy(x @ W.T, t)",
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
    arrays = Arrays(library)
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
        elif op in GATED_OPS:
            benches += _gated_benches(op, shapes["rows"], arrays, row_repeats, with_torch)
        elif op == "rope":
            benches += _rope_benches(shapes["rope"], arrays, row_repeats, with_torch)
        elif op in LOSS_OPS:
            benches += loss_benches(op, shapes[op], arrays, row_repeats, with_torch)
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

    label = "llama train step [transformers]"
    sides = (("xpkernels", setup(True)), ("sdpa", setup(False)))
    return compare(label, "fwd+bwd", text, "TFLOP/s", (work, formula), repeats, *sides)
