"""Paged decode attention: equal to contiguous-cache decode after gathering the pages.

The conformance suite (``conformance/``, the decode spec's ``paged-*`` cases)
compares each backend with the float64 reference; here the paged call is
compared with the contiguous call over the gathered cache on the same
backend, page-table entries the query never reads are shown to be ignored,
device values that point outside the pages are shown to be clamped (and
refused in debug mode), every bad input is shown to write nothing, and the
torch op is checked with ``opcheck`` and ``torch.compile``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from xpkernels.backends.array_api import decode_attention as decode_impl

import xpkernels as xk
from xpkernels.testing import references as ref
from xpkernels.testing.harness import select_triton_interpreter

select_triton_interpreter()

#: Float32 results of two tilings of the same sums (pages gathered vs sliced).
TOL = 1e-6


def _paged(rng, batch, kv_heads, page_size, max_pages, d=16, dv=16):
    """Pages, a shuffled (B, max_pages) int32 table over them (one spare page), and the contiguous caches."""
    num_pages = batch * max_pages + 1
    k_pages = rng.standard_normal((num_pages, kv_heads, page_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, kv_heads, page_size, dv)).astype(np.float32)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    table = table.astype(np.int32)
    return (
        k_pages,
        v_pages,
        table,
        ref.gather_pages(k_pages, table),
        ref.gather_pages(v_pages, table),
    )


def _torch(*arrays):
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


# (page_size, max_pages, lengths, window, softcap, n_splits): ragged lengths with 0 and
# exact page multiples, windows whose first key sits mid-page, splits beyond the keys.
SHAPES = [
    (1, 40, [0, 37, 40], None, None, 3),
    (16, 4, [16, 0, 33, 64], 20, None, 2),
    (16, 3, [48, 20, 1], None, 2.0, None),
    (64, 2, [64, 100, 0], 70, 1.5, 4),
    (128, 2, [256, 129, 5], None, None, 2),
]


@pytest.mark.parametrize("page_size,max_pages,lengths,window,softcap,n_splits", SHAPES)
def test_array_api_paged_equals_contiguous_after_gathering(
    page_size, max_pages, lengths, window, softcap, n_splits
):
    rng = np.random.default_rng(page_size)
    batch, heads, kv_heads = len(lengths), 4, 2
    k_pages, v_pages, table, k, v = _paged(rng, batch, kv_heads, page_size, max_pages)
    q = rng.standard_normal((batch, heads, 16)).astype(np.float32)
    lengths = np.asarray(lengths, dtype=np.int64)
    options = {"window": window, "softcap": softcap, "n_splits": n_splits}
    paged = xk.decode_attention(q, k_pages, v_pages, lengths, block_table=table, **options)
    contiguous = xk.decode_attention(q, k, v, lengths, **options)
    np.testing.assert_allclose(paged, contiguous, rtol=TOL, atol=TOL)
    want = ref.decode_attention(
        q.astype(np.float64), k, v, lengths, scale=0.25, softcap=softcap, window=window
    )
    np.testing.assert_allclose(paged, want, rtol=0, atol=1e-5)


#: Key tiles of 24 keys at D = Dv = 16 (``TILE_ELEMENTS // max(group, D, Dv)``).
SMALL_TILES = 24 * 16

# (page_size, max_pages, lengths, window, softcap, n_splits) under 24-key tiles: pages of
# 1, 8 and 16 keys are gathered (24, 3 and 1 pages a tile, several tiles a split; with 8
# splits of 12 keys a tile holds the 13 pages a split can meet), pages of 64 and 128 keys
# are read in 24-key slices; lengths off the page multiples, windows starting mid-page.
TILED_SHAPES = [
    (1, 90, [0, 89, 61], None, None, 1),
    (1, 90, [90, 77, 5], None, 2.0, 8),
    (8, 12, [95, 41, 3], 30, 2.0, 2),
    (16, 8, [127, 100, 17], None, 1.5, 1),
    (64, 3, [150, 70, 0], 50, None, 2),
    (128, 2, [255, 130, 1], None, None, 3),
]

#: How the pages are held: C-contiguous NumPy pages (``take`` of their ``(num_pages * Hkv,
#: page_size * D)`` rows into a reused buffer), NumPy pages with the heads outermost in
#: memory (not C-contiguous: fresh gathers), torch tensors (``index_select`` into a reused buffer) and
#: array-api-strict arrays (``take`` of the head view).
LAYOUTS = ["numpy rows", "numpy strided", "torch", "array_api_strict"]


def _held(layout, *arrays):
    if layout == "torch":
        pytest.importorskip("torch", reason="torch is not installed")
        return _torch(*arrays)
    if layout == "array_api_strict":
        xs = pytest.importorskip("array_api_strict", reason="array-api-strict is not installed")
        return [xs.asarray(a) for a in arrays]
    return list(arrays)


def _strided(pages):
    """``pages`` (num_pages, Hkv, page_size, D) as a view of (Hkv, num_pages, page_size, D) storage."""
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(pages, 1, 0)), 0, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size,max_pages,lengths,window,softcap,n_splits", TILED_SHAPES)
def test_array_api_paged_tiles_equal_contiguous(
    monkeypatch, layout, page_size, max_pages, lengths, window, softcap, n_splits
):
    """Several gathered (or sliced) tiles a split, each layout's gather: the contiguous result."""
    monkeypatch.setattr(decode_impl, "TILE_ELEMENTS", SMALL_TILES)
    rng = np.random.default_rng(100 + page_size)
    batch, heads, kv_heads = len(lengths), 4, 2
    k_pages, v_pages, table, k, v = _paged(rng, batch, kv_heads, page_size, max_pages)
    if layout == "numpy strided":
        k_pages, v_pages = _strided(k_pages), _strided(v_pages)
    if layout.startswith("numpy"):
        by_rows = decode_impl._Gather(np, k_pages, 2).by_rows
        assert by_rows is (layout == "numpy rows")
    q = rng.standard_normal((batch, heads, 16)).astype(np.float32)
    lengths = np.asarray(lengths, dtype=np.int64)
    options = {"window": window, "softcap": softcap, "n_splits": n_splits}
    hq, hk_pages, hv_pages, htable, hk, hv, hlengths = _held(
        layout, q, k_pages, v_pages, table, k, v, lengths
    )
    paged = xk.decode_attention(hq, hk_pages, hv_pages, hlengths, block_table=htable, **options)
    contiguous = xk.decode_attention(hq, hk, hv, hlengths, **options)
    paged, contiguous = np.asarray(paged), np.asarray(contiguous)
    np.testing.assert_allclose(paged, contiguous, rtol=TOL, atol=TOL)
    want = ref.decode_attention(
        q.astype(np.float64), k, v, lengths, scale=0.25, softcap=softcap, window=window
    )
    np.testing.assert_allclose(paged, want, rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("page_size,max_pages,lengths,window,softcap,n_splits", SHAPES[:4])
def test_triton_paged_equals_contiguous_after_gathering(
    page_size, max_pages, lengths, window, softcap, n_splits
):
    pytest.importorskip("triton", reason="triton is not installed")
    rng = np.random.default_rng(page_size)
    batch, heads, kv_heads = len(lengths), 4, 2
    k_pages, v_pages, table, k, v = _paged(rng, batch, kv_heads, page_size, max_pages)
    q = rng.standard_normal((batch, heads, 16)).astype(np.float32)
    tq, tk_pages, tv_pages, ttable, tk, tv, tlengths = _torch(
        q, k_pages, v_pages, table, k, v, np.asarray(lengths, dtype=np.int64)
    )
    options = {"window": window, "softcap": softcap, "n_splits": n_splits, "backend": "triton"}
    paged = xk.decode_attention(tq, tk_pages, tv_pages, tlengths, block_table=ttable, **options)
    contiguous = xk.decode_attention(tq, tk, tv, tlengths, **options)
    np.testing.assert_allclose(paged.numpy(), contiguous.numpy(), rtol=TOL, atol=TOL)
    want = ref.decode_attention(
        q.astype(np.float64), k, v, np.asarray(lengths), scale=0.25, softcap=softcap, window=window
    )
    np.testing.assert_allclose(paged.numpy(), want, rtol=0, atol=1e-5)


def test_entries_of_pages_never_read_may_hold_anything():
    """Past a sequence's last page, and before its window's first page, the table is not read."""
    rng = np.random.default_rng(3)
    k_pages, v_pages, table, _, _ = _paged(rng, 2, 1, 4, 6)
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    lengths = np.asarray([9, 24], dtype=np.int64)  # batch 0 reads pages 0..2 (keys 0..8)
    want = xk.decode_attention(q, k_pages, v_pages, lengths, block_table=table, window=6)
    garbage = table.copy()
    garbage[0, 3:] = [-7, 10**6, 99]
    garbage[1, :4] = -1  # window 6 of 24 keys: keys 18..23, pages 4 and 5
    got = xk.decode_attention(q, k_pages, v_pages, lengths, block_table=garbage, window=6)
    np.testing.assert_array_equal(got, want)


def _backends():
    params = [pytest.param("array_api", id="array_api")]
    params.append(pytest.param("triton", id="triton", marks=pytest.mark.filterwarnings("ignore")))
    return params


@pytest.mark.parametrize("backend", _backends())
def test_device_values_outside_the_pages_are_clamped_and_refused_in_debug_mode(backend):
    """Torch tensors: out-of-range lengths and table entries never lead a read outside the pages."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    rng = np.random.default_rng(4)
    k_pages, v_pages, _, _, _ = _paged(rng, 2, 2, 16, 2)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    tq, tk, tv = _torch(q, k_pages, v_pages)
    table = torch.tensor([[2, 10**6], [-5, 1]], dtype=torch.int32)
    lengths = torch.tensor([2**40, 20], dtype=torch.int64)
    o = xk.decode_attention(tq, tk, tv, lengths, block_table=table, backend=backend)
    assert torch.isfinite(o).all()
    # Clamped: page 10**6 reads the last page (4), page -5 reads page 0; lengths to 32.
    clamped = torch.tensor([[2, 4], [0, 1]], dtype=torch.int32)
    want = xk.decode_attention(
        tq, tk, tv, torch.tensor([32, 20]), block_table=clamped, backend=backend
    )
    torch.testing.assert_close(o, want, rtol=TOL, atol=TOL)
    with xk.debug(), pytest.raises(ValueError, match=r"lengths must lie in \[0, 32\]"):
        xk.decode_attention(tq, tk, tv, lengths, block_table=table, backend=backend)
    with xk.debug(), pytest.raises(ValueError, match=r"block_table entries .* \[0, 4\]"):
        xk.decode_attention(tq, tk, tv, torch.tensor([32, 20]), block_table=table, backend=backend)


def _valid():
    rng = np.random.default_rng(5)
    k_pages, v_pages, table, _, _ = _paged(rng, 2, 2, 4, 3)
    return {
        "o": np.full((2, 4, 16), 7.0, dtype=np.float32),
        "q": rng.standard_normal((2, 4, 16)).astype(np.float32),
        "k_cache": k_pages,
        "v_cache": v_pages,
        "lengths": np.asarray([12, 5], dtype=np.int64),
        "block_table": table,
    }


# Every bad paged input: (what replaces a valid argument, error, message).
BAD = [
    ({"block_table": np.zeros((2, 3), dtype=np.int64)}, TypeError, "block_table must have dtype"),
    ({"block_table": np.zeros((2,), dtype=np.int32)}, ValueError, r"block_table must have shape"),
    ({"block_table": np.zeros((3, 3), dtype=np.int32)}, ValueError, r"block_table must have shape"),
    ({"k_cache": np.zeros((7, 2, 64), np.float32)}, ValueError, r"k_pages must have shape"),
    ({"v_cache": np.zeros((6, 2, 4, 16), np.float32)}, ValueError, r"v_pages must have shape"),
    ({"v_cache": np.zeros((7, 2, 8, 16), np.float32)}, ValueError, r"v_pages must have shape"),
    ({"v_cache": np.zeros((7, 1, 4, 16), np.float32)}, ValueError, r"v_pages must have shape"),
    ({"v_cache": np.zeros((7, 2, 4, 16), np.float16)}, TypeError, r"v_pages must have q's dtype"),
    ({"lengths": np.asarray([13, 5])}, ValueError, r"lengths must lie in \[0, 12\]"),
    ({"block_table": np.asarray([[0, 1, 7], [2, 3, 4]], np.int32)}, ValueError, r"\[0, 6\]"),
    ({"block_table": np.asarray([[0, 1, 2], [-1, 3, 4]], np.int32)}, ValueError, r"\[0, 6\]"),
    ({"window": 0}, ValueError, r"window must lie in \[1, "),
    ({"window": -3}, ValueError, r"window must lie in \[1, "),
    ({"window": True}, TypeError, r"window must be an int"),
    ({"softcap": 0.0}, ValueError, r"softcap must be finite and > 0"),
    ({"softcap": -1.0}, ValueError, r"softcap must be finite and > 0"),
    ({"softcap": math.inf}, ValueError, r"softcap must be finite and > 0"),
    ({"n_splits": 13}, ValueError, r"n_splits must be <= 12"),
]


@pytest.mark.parametrize("replace,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_paged_input_raises_and_writes_nothing(replace, error, match):
    a = _valid()
    options = {n: replace.pop(n) for n in ("window", "softcap", "n_splits") if n in replace}
    a.update(replace)
    scratch = xk.allocate_scratchspace(xk.decode_attention_, a["o"], a["q"], n_splits=2)
    for buffer in scratch:
        buffer[...] = 3.0
    with pytest.raises(error, match=match):
        xk.decode_attention_(
            a["o"],
            a["q"],
            a["k_cache"],
            a["v_cache"],
            a["lengths"],
            block_table=a["block_table"],
            scratch=scratch if "n_splits" not in options else None,
            **options,
        )
    assert (a["o"] == 7.0).all()
    assert all((buffer == 3.0).all() for buffer in scratch)


def test_window_and_softcap_on_the_contiguous_cache():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 16))
    k, v = rng.standard_normal((2, 2, 30, 16)), rng.standard_normal((2, 2, 30, 16))
    lengths = np.asarray([30, 11])
    for window, softcap in ((1, None), (7, None), (None, 0.5), (4, 3.0)):
        got = xk.decode_attention(q, k, v, lengths, window=window, softcap=softcap, n_splits=3)
        want = ref.decode_attention(q, k, v, lengths, scale=0.25, softcap=softcap, window=window)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # window 1: the last key alone, so o is its value.
    got = xk.decode_attention(q, k, v, lengths, window=1)
    np.testing.assert_allclose(got[1], np.repeat(v[1, :, 10], 2, axis=0), atol=1e-12)


def test_paged_scratch_allocator_counts_the_logical_keys():
    a = _valid()
    scratch = xk.allocate_scratchspace(
        xk.decode_attention_, a["o"], a["q"], a["k_cache"], block_table=a["block_table"]
    )
    assert scratch.o_partial.shape[:3] == (2, 4, 1)
    with pytest.raises(ValueError, match=r"n_splits must be <= 12"):
        xk.allocate_scratchspace(
            xk.decode_attention_,
            a["o"],
            a["q"],
            a["k_cache"],
            block_table=a["block_table"],
            n_splits=13,
        )


def _torch_inputs():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    a = _valid()
    q, k, v, table = _torch(a["q"], a["k_cache"], a["v_cache"], a["block_table"])
    return torch, q, k, v, torch.tensor([12, 5]), table


def test_torch_op_opcheck_with_block_table_softcap_and_window():
    torch, q, k, v, lengths, table = _torch_inputs()
    import xpkernels.torch  # noqa: F401  (registers the ops)

    ops = torch.ops.xpkernels
    torch.library.opcheck(
        ops.decode_attention, (q, k, v, lengths, table, None, 2.0, 5, 2, "array_api")
    )
    o = q.new_empty(q.shape[:2] + (v.shape[3],))
    torch.library.opcheck(
        ops.decode_attention_,
        (o, q, k, v, lengths, table, None, None, None, None, 2.0, 5, 2, "array_api"),
    )


def test_torch_allocating_front_records_through_the_op_and_compiles():
    torch, q, k, v, lengths, table = _torch_inputs()
    want = xk.decode_attention(q, k, v, lengths, block_table=table, softcap=2.0, window=5)
    q_grad = q.clone().requires_grad_()
    recorded = xk.decode_attention(q_grad, k, v, lengths, block_table=table, softcap=2.0, window=5)
    assert recorded.grad_fn is not None
    torch.testing.assert_close(recorded.detach(), want)

    def step(q, k, v, lengths, table):
        return xk.decode_attention(q, k, v, lengths, block_table=table, softcap=2.0, window=5)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.compile's own notes on CPU
        compiled = torch.compile(step, fullgraph=True)(q, k, v, lengths, table)
    torch.testing.assert_close(compiled, want)


@pytest.mark.parametrize("paged", [False, True])
def test_torch_cpu_tensors_take_the_numpy_path(paged):
    """PyTorch CPU tensors run the NumPy path through zero-copy views: the same output, bit for
    bit, as NumPy arrays (contiguous and paged caches, window, softcap, several splits)."""
    pytest.importorskip("torch", reason="torch is not installed")
    rng = np.random.default_rng(31)
    k_pages, v_pages, table, k, v = _paged(rng, 3, 2, 16, 4)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    lengths = np.asarray([64, 0, 37], dtype=np.int64)
    options = {"window": 20, "softcap": 2.0, "n_splits": 3}
    caches = (k_pages, v_pages, lengths, table) if paged else (k, v, lengths, None)
    want = xk.decode_attention(q, *caches[:3], block_table=caches[3], **options)
    held = _torch(q, *caches[:3]) + ([None] if caches[3] is None else _torch(caches[3]))
    got = xk.decode_attention(*held[:4], block_table=held[4], **options)
    np.testing.assert_array_equal(got.numpy(), want)
