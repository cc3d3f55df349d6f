"""FlexAttention's banded NumPy forward: exact bands, their batches, results against float64."""

from __future__ import annotations

import importlib
import tracemalloc
import warnings

import numpy as np
import pytest

from xpkernels import mods as xm
from xpkernels.buffers import allocate_checkpoints
from xpkernels.flex_attention import flex_attention, flex_attention_
from xpkernels.mods.bands import exact_band
from xpkernels.testing import references as ref
from xpkernels.testing.harness import max_error
from xpkernels.testing.tolerances import floor

backend = importlib.import_module("xpkernels.backends.array_api.flex_attention")
band = importlib.import_module("xpkernels.backends.array_api._flex_band")


def kept_pairs(mask, n_q, n_kv, position):
    """``(n_q, n_kv)`` booleans of ``mask`` evaluated pair by pair (queries at ``position``)."""
    q_idx = np.arange(n_q)[:, None] + position
    kv_idx = np.arange(n_kv)[None, :]
    return np.broadcast_to(np.asarray(mask(0, 0, q_idx, kv_idx), dtype=bool), (n_q, n_kv))


@pytest.mark.parametrize(
    "mask",
    [
        xm.SlidingWindowMask(5),
        xm.SlidingWindowMask(0),
        xm.CausalMask(),
        xm.PrefixMask(3),
        xm.FullMask(),
        xm.prefix_lm(3),
        xm.CausalMask() & xm.SlidingWindowMask(4),
        xm.DocumentMask(np.repeat(np.arange(5), [7, 1, 20, 2, 20])),
        xm.DocumentMask(np.repeat(np.arange(5), [7, 1, 20, 2, 20])) & xm.CausalMask(),
    ],
    ids=lambda m: m.label,
)
@pytest.mark.parametrize("position", [0, 7, 30])
def test_exact_bands_are_the_pairs_the_mask_keeps(mask, position):
    lo, hi = exact_band(mask, position, 20, 50)
    columns = np.arange(50)[None, :]
    got = (columns >= lo[:, None]) & (columns <= hi[:, None])
    np.testing.assert_array_equal(got, kept_pairs(mask, 20, 50, position))


@pytest.mark.parametrize(
    "mask, position",
    [
        (xm.DocumentMask(np.array([0, 1] * 10)), 0),  # documents that are no interval
        (xm.DocumentMask(np.repeat(np.arange(4), 5).reshape(1, 20)), 0),  # ids per batch
        (xm.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 2 == 0), 0),  # none declared
        (xm.SlidingWindowMask(2) | xm.PrefixMask(3), 0),  # a union that is no interval
        (xm.CausalMask(), -5),  # the first rows keep no key
        (xm.SlidingWindowMask(3), 30),  # the last rows keep no key: keys end at 20
    ],
)
def test_masks_without_an_exact_nonempty_band_have_none(mask, position):
    assert exact_band(mask, position, 20, 20) is None


def test_document_bands_hold_the_kept_keys_when_documents_recur():
    """Ids that recur apart: every kept key lies within the id's first and last position, and
    the query's own run of equal ids is surely kept (so tiles skip soundly)."""
    ids = np.array([0, 0, 1, 1, 1, 0, 2, 2, 1, 3])
    positions = np.arange(10)
    lo, hi, full_lo, full_hi = xm.DocumentMask(ids)._band(positions, 10)
    kept = kept_pairs(xm.DocumentMask(ids), 10, 10, 0)
    columns = np.arange(10)[None, :]
    assert not np.any(kept & ((columns < lo[:, None]) | (columns > hi[:, None])))
    assert np.all(kept[(columns >= full_lo[:, None]) & (columns <= full_hi[:, None])])
    np.testing.assert_array_equal(full_lo, [0, 0, 2, 2, 2, 5, 6, 6, 8, 9])


def test_plans_carry_bands_only_where_tiles_come_from_them():
    window = xm.SlidingWindowMask(4)
    options = dict(n_q=40, n_kv=50, tile_m=8, tile_n=8)
    plan = xm.plan_tiles(window, None, block_sparse=True, positions=(0, 5, 0), **options)
    assert len(plan.bands) == 3 and plan.bands[0] is plan.bands[2]
    np.testing.assert_array_equal(plan.bands[1][1], np.arange(40) + 5)
    assert xm.plan_tiles(window, None, block_sparse=False, positions=(0,), **options).bands is None
    block_mask = xm.build_block_mask(window, 40, 50, tile_m=8, tile_n=8)
    assert (
        xm.plan_tiles(window, block_mask, block_sparse=True, positions=(0,), **options).bands
        is None
    )


@pytest.mark.parametrize(
    "mask, n_q, n_kv, position",
    [
        (xm.SlidingWindowMask(256), 2048, 2048, 0),
        (xm.SlidingWindowMask(100), 1000, 1300, 300),
        (xm.SlidingWindowMask(40), 333, 400, 60),
        (xm.PrefixMask(50), 500, 500, 0),
        (xm.CausalMask() & xm.SlidingWindowMask(7), 130, 130, 0),
        (xm.DocumentMask(np.repeat(np.arange(4), [47, 1325, 276, 400])), 2048, 2048, 0),
    ],
)
@pytest.mark.parametrize("group", [1, 3])
def test_batches_cover_every_row_once_with_spans_holding_its_keys(mask, n_q, n_kv, position, group):
    lo, hi = exact_band(mask, position, n_q, n_kv)
    batches = band.band_batches(lo, hi, n_kv, group, tile_elements=group * n_q * n_kv)
    assert batches is not None
    row = 0
    for batch in batches:
        assert batch.r0 == row and batch.step >= 0
        assert batch.count * group * batch.rows * batch.keys <= band.BAND_ELEMENTS
        for c in range(batch.count):
            first = batch.key0 + c * batch.step
            rows = slice(row, row + batch.rows)
            assert 0 <= first and first + batch.keys <= n_kv
            assert np.all(lo[rows] >= first) and np.all(hi[rows] < first + batch.keys)
            row += batch.rows
    assert row == n_q


@pytest.mark.parametrize("n", [2048, 1900])
def test_the_band_does_not_run_where_it_saves_too_few_scores(n):
    """A causal mask's chunks grow one after the other: batched, they compute about the scores
    of the plan's tiles below the diagonal (fewer at 1900 rows, not multiple of the tiles),
    where the two ran level; the band runs only at BAND_GAIN of the tiles' scores or less."""
    lo, hi = exact_band(xm.CausalMask(), 0, n, n)
    sizes = dict(n_q=n, n_kv=n, positions=(0,), tile_m=256, tile_n=256)
    plan = xm.plan_tiles(xm.CausalMask(), None, block_sparse=True, **sizes)
    tiles = band.tile_elements(plan.group(0, 0, 1), 256, 256, n, n, 1)
    if n == 2048:
        assert tiles == 2048 * 2048 // 2 + 8 * 256 * 256 // 2
    assert band.band_batches(lo, hi, n, 1, tiles) is None
    assert band.band_batches(lo, hi, n, 1, int(1.2 * tiles)) is not None


class BatchCounter:
    """Counts the banded forward's batches, per kv head."""

    def __init__(self, monkeypatch):
        self.heads: list[int] = []
        self.steps: set[int] = set()
        run = band.forward_batch

        def counting(t, o, q, k, v, m, l, b, g, heads, batch, *rest):
            self.heads.append(g)
            self.steps.add(batch.step if batch.count > 1 else -1)
            return run(t, o, q, k, v, m, l, b, g, heads, batch, *rest)

        monkeypatch.setattr(backend, "forward_batch", counting)


def _reference(q, k, v, mask, input_pos):
    batch, _, n_q, d = q.shape
    keep = np.stack([kept_pairs(mask, n_q, k.shape[2], p) for p in input_pos])
    as64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    return ref.attention(*as64, scale=d**-0.5, keep=keep)[:3]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("checkpoints", [True, False])
def test_banded_forward_against_float64(monkeypatch, dtype, checkpoints):
    """Two batches at different positions (bands of their own), GQA, a window whose chunks
    batch with a stride of one chunk and, at the start of each sequence, of 0 keys."""
    counter = BatchCounter(monkeypatch)
    rng = np.random.default_rng(0)
    n_q, n_kv, d, input_pos = 700, 760, 32, [60, 0]
    q = rng.standard_normal((2, 4, n_q, d)).astype(dtype)
    k = rng.standard_normal((2, 2, n_kv, d)).astype(dtype)
    v = rng.standard_normal((2, 2, n_kv, d)).astype(dtype)
    mask = xm.SlidingWindowMask(90)
    ck = allocate_checkpoints(flex_attention_, q, k, v) if checkpoints else None
    o = flex_attention(q, k, v, mask_mod=mask, input_pos=input_pos, checkpoints=ck)
    assert sorted(set(counter.heads)) == [0, 1] and {0, band.BAND_ROWS} <= counter.steps
    want_o, want_m, want_l = _reference(q, k, v, mask, input_pos)
    assert max_error(o, want_o) <= floor("flex_attention", "forward", dtype)
    if checkpoints:
        for got, want in ((ck.m, want_m), (ck.l, want_l)):
            assert max_error(got, want) <= floor("flex_attention", "checkpoints", dtype)


@pytest.mark.parametrize("checkpoints", [True, False])
def test_banded_documents_against_float64(monkeypatch, checkpoints):
    """Documents shorter and longer than a chunk, GQA: the chunks inside a document keep their
    whole span (not masked), those across a boundary are masked."""
    counter = BatchCounter(monkeypatch)
    unmasked = []
    batch_mask = band.BandWorkspace.batch_mask

    def recording(self, lo, hi, batch):
        mask = batch_mask(self, lo, hi, batch)
        unmasked.append(mask is None)
        return mask

    monkeypatch.setattr(band.BandWorkspace, "batch_mask", recording)
    rng = np.random.default_rng(4)
    n, d = 600, 16
    q = rng.standard_normal((1, 4, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for _ in range(2))
    mask = xm.DocumentMask(np.repeat(np.arange(5), [20, 5, 300, 75, 200]))
    ck = allocate_checkpoints(flex_attention_, q, k, v) if checkpoints else None
    o = flex_attention(q, k, v, mask_mod=mask, checkpoints=ck)
    assert counter.heads and any(unmasked) and not all(unmasked)
    want_o, want_m, want_l = _reference(q, k, v, mask, [0])
    assert max_error(o, want_o) <= floor("flex_attention", "forward", "float32")
    if checkpoints:
        for got, want in ((ck.m, want_m), (ck.l, want_l)):
            assert max_error(got, want) <= floor("flex_attention", "checkpoints", "float32")


def test_a_head_with_a_non_finite_value_or_key_runs_on_tiles(monkeypatch):
    """Only the kv heads whose values are finite and whose scores are bounded take the band;
    the others give exactly what the tiles give."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 300, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 4, 300, 16)).astype(np.float32) for _ in range(2))
    v[0, 1, 100, 3] = np.nan
    k[0, 2, 7, 0] = 1e30  # finite, but scores past SAFE_EXPONENT
    q[0, 3, 50, 1] = np.inf
    mask = xm.SlidingWindowMask(40)
    counter = BatchCounter(monkeypatch)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        o = flex_attention(q, k, v, mask_mod=mask, checkpoints=ck)
        assert set(counter.heads) == {0}
        monkeypatch.setattr(backend, "_band_batches", lambda t, plan, b: None)
        want_ck = allocate_checkpoints(flex_attention_, q, k, v)
        want = flex_attention(q, k, v, mask_mod=mask, checkpoints=want_ck)
    np.testing.assert_array_equal(o[:, 1:], want[:, 1:])
    np.testing.assert_array_equal(ck.m[:, 1:], want_ck.m[:, 1:])
    np.testing.assert_array_equal(ck.l[:, 1:], want_ck.l[:, 1:])
    assert max_error(o[:, :1], want[:, :1]) <= floor("flex_attention", "forward", "float32")


@pytest.mark.parametrize("masking", ["window", "documents"])
def test_torch_cpu_tensors_take_the_band_with_numpy_results(monkeypatch, masking):
    """PyTorch CPU tensors -- and document ids held in one -- take the band, with the NumPy
    arrays' results bit for bit."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    counter = BatchCounter(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 500, 16)).astype(np.float32) for _ in range(3))
    ids = np.repeat(np.arange(3), [100, 250, 150])

    def run(convert):
        qs, ks, vs = (convert(a) for a in (q, k, v))
        mask = xm.SlidingWindowMask(30) if masking == "window" else xm.DocumentMask(convert(ids))
        ck = allocate_checkpoints(flex_attention_, qs, ks, vs)
        o = flex_attention(qs, ks, vs, mask_mod=mask, checkpoints=ck)
        return [np.asarray(a) for a in (o, *ck)]

    got = run(torch.from_numpy)
    assert counter.heads
    for g, w in zip(got, run(np.copy), strict=True):
        np.testing.assert_array_equal(g, w)


def test_document_ids_in_tensors_that_must_not_be_read_are_not():
    """Ids recording autograd, or in a tensor subclass (fake or guarded under tracing), are not
    read on the host (no band: every key possible); plain CPU tensors are, without a copy."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from xpkernels.mods.library import _host_ids

    class Guarded(torch.Tensor):
        pass

    ids = torch.arange(20) // 5
    assert np.shares_memory(_host_ids(ids), ids.numpy())
    assert _host_ids(ids.as_subclass(Guarded)) is None
    assert _host_ids((ids * 1.0).requires_grad_()) is None
    assert exact_band(xm.DocumentMask(ids.as_subclass(Guarded)), 0, 20, 20) is None


def test_memory_is_bounded_by_the_band_budget_at_8192(monkeypatch):
    """Sq = Sk = 8192 under a 256-key window: the banded forward's extra memory stays a few
    batches' worth per worker thread, whatever the sequence length."""
    blocks = importlib.import_module("xpkernels.backends.array_api._blocks")
    monkeypatch.setattr(blocks, "_cores", lambda: 2)
    counter = BatchCounter(monkeypatch)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 8192, 16)).astype(np.float32) for _ in range(3))
    o = np.empty_like(q)
    ck = allocate_checkpoints(flex_attention_, q, k, v)
    mask = xm.SlidingWindowMask(256)
    tracemalloc.start()
    try:
        flex_attention_(o, q, k, v, mask_mod=mask, checkpoints=ck)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counter.heads
    assert peak <= 2 * 3 * band.BAND_ELEMENTS * 4, f"peak {peak} bytes"  # 2 workers
    for first in (0, 8000):  # the sequence's start (a stride-0 batch) and its end
        want = _reference(q[:, :, first : first + 192], k, v, mask, [first])[0]
        got = o[:, :, first : first + 192]
        assert max_error(got, want) <= floor("flex_attention", "forward", "float32")
