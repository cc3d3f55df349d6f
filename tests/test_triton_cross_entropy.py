"""The Triton cross-entropy kernels (``xpkernels.backends.triton.cross_entropy``) driven directly.

Against the float64 references ``cross_entropy_rows`` and
``cross_entropy_rows_backward`` of ``xpkernels.testing.references``, on the
logits as rounded to their dtype: float32, float16 and bfloat16; ``V`` a
multiple of the chunk and not, across several chunks (the chunk is shrunk to
64 bytes so that the interpreter walks several) and within one (the default
chunk); label smoothing, softcap, z-loss and all three; ``ignore_index`` the
default ``-100`` and a column inside ``[0, V)``; every row ignored (zeros, even
over NaN and infinite logits); ``-inf`` logits (masked vocabulary entries)
without smoothing; an out-of-range target (NaN on its row only); rows whose
maximum grows chunk after chunk, far past ``exp``'s float32 range; logits and
gradients that are row-strided views of NaN-padded buffers (the padding must
survive); int32 and int64 targets, strided; a row weight of stride 0 and per
row; a float32 gradient of bfloat16 logits; the gradient written over the
logits in place; ``N = 0`` launching nothing.

Tolerances, per row, with :math:`A` the largest finite :math:`|z|` of the row
(or the softcap, if larger), :math:`S = A + |L|` and :math:`D = \\lceil\\log_2
V\\rceil + \\lceil V / B\\rceil` the depth of the kernel's float32 sums (a tree
over the :math:`B` lanes of a chunk, then one add per chunk):

- ``lse``: :math:`(8 + D)\\,\\epsilon_{32}\\,S` -- the exponents are known to
  a few :math:`\\epsilon_{32} S`, the sum of positive terms to :math:`D\\,\\epsilon_{32}`;
- ``loss``: :math:`(8 + D)\\,\\epsilon_{32}\\,(2S + 3\\lambda S^2)` (``lse``, the
  target's and the mean logit, and the z-loss's :math:`\\lambda L^2`);
- ``dlogits`` per element: the relative error :math:`2(8 + D)\\,\\epsilon_{32} S` of
  :math:`p` (its exponent holds ``z`` and the forward's ``lse``), plus
  :math:`8\\,\\epsilon_{32}` of each term, times :math:`|g|\\,dz/dx` (whose own
  relative error is :math:`\\epsilon_{32}(8 + 4|x|/c)` with a softcap), plus the
  output's rounding, a whole unit :math:`\\epsilon_{out}|d|` (Triton 3.6's interpreter
  truncates float32 to bfloat16) and its smallest normal.

They run on CUDA when torch sees a GPU, else through the Triton interpreter
(``TRITON_INTERPRET=1`` is set here before the kernels are imported).
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no Triton backend")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: no Triton backend", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for triton", allow_module_level=True)

from xpkernels.backends.triton import cross_entropy as ce

from xpkernels.testing import references as ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS32 = float(torch.finfo(torch.float32).eps)
#: Bytes per chunk in most tests: 16 float32 or 32 16-bit columns, so V = 40 and 64 span
#: several chunks (with and without a masked remainder).
SMALL_CHUNK = 64
#: Option sets: none, each term alone, all three.
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 4.0},
    "zloss": {"z_loss": 1e-2},
    "all": {"label_smoothing": 0.2, "softcap": 4.0, "z_loss": 1e-2},
}


def _dtype_id(d):
    return str(d).removeprefix("torch.")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_BYTES", SMALL_CHUNK)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _options(**kw):
    out = {"ignore_index": -100, "label_smoothing": 0.0, "softcap": None, "z_loss": 0.0}
    out.update(kw)
    return out


def _logits(n, v, dtype, seed, scale=3.0):
    x = scale * torch.randn((n, v), generator=_gen(seed), dtype=torch.float64)
    return x.to(dtype).to(DEVICE)


def _targets(n, v, dtype=torch.int64, seed=1):
    return torch.randint(0, v, (n,), generator=_gen(seed)).to(dtype).to(DEVICE)


def _np(t):
    return t.double().cpu().numpy()


def _run(logits, targets, grad, opts, dlogits=None):
    """``(loss, lse, dlogits)`` of the kernels: the forward, then the backward from its lse."""
    n, _ = logits.shape
    loss = torch.full((n,), float("nan"), device=DEVICE)
    lse = torch.full((n,), float("nan"), device=DEVICE)
    ce.forward(loss, lse, logits, targets, **opts)
    if dlogits is None:
        dlogits = torch.full_like(logits, float("nan"))
    ce.backward(dlogits, logits, targets, lse, grad, **opts)
    return loss, lse, dlogits


def _depth(v, itemsize):
    """``D``: depth of the kernel's float32 sums over a row of ``v`` columns."""
    block, _ = ce.tile_config(v, itemsize)
    return math.ceil(math.log2(max(v, 2))) + -(-v // block)


def _capped(x, softcap):
    if softcap is None:
        return x, np.ones_like(x)
    th = np.tanh(x / softcap)
    return softcap * th, 1 - th * th


def _assert_close(got, want, tol, what):
    err = np.abs(got - want)
    bad = ~(err <= tol)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - tol, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} outside tolerance; got {got[worst]!r}, want "
            f"{want[worst]!r}, error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"
        )


def _check(loss, lse, dlogits, logits, targets, grad, opts, rows=None, kernel_v=None):
    """The kernels' results against the float64 references on ``rows`` (default: all);
    ``kernel_v``: the row length the kernels saw, when the arrays are a subset of columns."""
    x, t, g = _np(logits), targets.cpu().numpy().astype(np.int64), _np(grad)
    if rows is not None:
        x, t, g = x[rows], t[rows], g[rows]
        loss, lse, dlogits = loss[rows], lse[rows], dlogits[rows]
    _, v = x.shape
    kw = {k: opts[k] for k in ("ignore_index", "label_smoothing", "softcap", "z_loss")}
    want_loss, want_lse = ref.cross_entropy_rows(x, t, **kw)
    want_d = ref.cross_entropy_rows_backward(x, t, g, **kw)

    cap, lam, eps = opts["softcap"], opts["z_loss"], opts["label_smoothing"]
    z, dz = _capped(x, cap)
    finite = np.where(np.isfinite(z), np.abs(z), 0.0)
    a_mag = np.maximum(finite.max(axis=1), cap or 0.0)
    s = a_mag + np.abs(want_lse)
    k = 8 + _depth(kernel_v or v, logits.element_size())
    _assert_close(_np(lse), want_lse, k * EPS32 * s, "lse")
    _assert_close(_np(loss), want_loss, k * EPS32 * (2 * s + 3 * lam * s * s), "loss")

    p = np.exp(z - want_lse[:, None])
    a = 1 + 2 * lam * want_lse[:, None]
    rel_p = 2 * k * EPS32 * s[:, None]
    err = p * (np.abs(a) * rel_p + 2 * lam * k * EPS32 * s[:, None]) + 8 * EPS32 * (
        p * np.abs(a) + 1
    )
    rel_dz = 0.0 if cap is None else EPS32 * (8 + 4 * np.abs(x) / cap)
    onehot = np.zeros_like(x)
    kept = np.nonzero(t != opts["ignore_index"])[0]
    onehot[kept, t[kept]] = 1
    inner = np.abs(p * a - (1 - eps) * onehot - eps / v)
    info = torch.finfo(dlogits.dtype)
    tol = (1 + info.eps) * np.abs(g)[:, None] * (err * dz + inner * dz * rel_dz)
    tol = tol + info.eps * np.abs(want_d) + info.tiny
    ignored = t == opts["ignore_index"]
    got_d = _np(dlogits)
    assert (got_d[ignored] == 0).all(), "ignored rows need exact zero gradients"
    _assert_close(got_d, want_d, tol, "dlogits")


# ----------------------------------------------------------------------------- matches


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("v", [40, 64], ids=["V40-tail", "V64-whole"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_both_passes_match_the_reference(dtype, v, name):
    """Several chunks per row (V = 40: full chunks and a masked remainder; V = 64: full
    chunks only), rows of ``-100`` among them, per-row weights."""
    n = 6
    opts = _options(**OPTIONS[name])
    logits = _logits(n, v, dtype, seed=v)
    targets = _targets(n, v, seed=v + 1)
    targets[0] = v - 1  # in the last chunk: the masked remainder at V = 40
    targets[[1, 4]] = -100
    grad = (0.5 + torch.rand(n, generator=_gen(3))).to(DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    _check(loss, lse, d, logits, targets, grad, opts)
    assert (loss[[1, 4]] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("v", [300, 1000], ids=["V300", "V1000"])
def test_default_chunk_one_masked_chunk(dtype, v):
    """The default chunk is wider than these rows: one masked chunk, no full one."""
    block, _ = ce.tile_config(v, torch.finfo(dtype).bits // 8)
    assert block >= v
    n = 3
    opts = _options(**OPTIONS["all"])
    logits = _logits(n, v, dtype, seed=5)
    targets = _targets(n, v, seed=6)
    grad = torch.full((n,), 0.75, device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    _check(loss, lse, d, logits, targets, grad, opts)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("descending", [False, True], ids=["rising", "falling"])
def test_online_max_over_chunks_far_past_exp_range(descending):
    """Each chunk's maximum exceeds the last (or falls), at logits up to 200: exp(200)
    overflows float32, so every chunk's partial sums must be rescaled to the new maximum."""
    n, v = 3, 70
    x = torch.linspace(-40.0, 200.0, v, dtype=torch.float64).repeat(n, 1)
    x = x + torch.randn((n, v), generator=_gen(7), dtype=torch.float64)
    if descending:
        x = x.flip(1)
    logits = x.float().to(DEVICE)
    targets = torch.tensor([0, v // 2, v - 1], device=DEVICE)
    grad = torch.ones(n, device=DEVICE)
    opts = _options(label_smoothing=0.05, z_loss=1e-4)
    loss, lse, d = _run(logits, targets, grad, opts)
    _check(loss, lse, d, logits, targets, grad, opts)


# ----------------------------------------------------------------------------- layouts


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_dtype_id)
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=_dtype_id)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_row_strided_views_of_padded_buffers(dtype, target_dtype, in_place):
    """Logits and gradient are every other row of NaN-padded buffers, offset by 3 columns
    (row strides 2 (V + 11) and 2 (V + 5)); targets and weights strided too. The results
    match the reference and every element outside the views keeps its NaN."""
    n, v = 5, 40
    nan = float("nan")
    buffer = torch.full((2 * n, v + 11), nan, dtype=dtype, device=DEVICE)
    logits = buffer[::2, 3 : 3 + v]
    logits.copy_(_logits(n, v, dtype, seed=8))
    before = logits.clone()
    buffer_before = _bits(buffer).clone()
    t_buffer = torch.full((3 * n,), 7, dtype=target_dtype, device=DEVICE)
    targets = t_buffer[::3]
    targets.copy_(_targets(n, v, target_dtype, seed=9))
    targets[2] = -100
    g_buffer = torch.full((2 * n,), nan, device=DEVICE)
    grad = g_buffer[1::2]
    grad.copy_(0.5 + torch.rand(n, generator=_gen(10)))
    assert logits.stride() == (2 * (v + 11), 1) and targets.stride() == (3,)
    if in_place:
        d_buffer, dlogits = buffer, logits
    else:
        d_buffer = torch.full((2 * n, v + 5), nan, dtype=dtype, device=DEVICE)
        dlogits = d_buffer[::2, 3 : 3 + v]
    opts = _options(**OPTIONS["all"])
    loss, lse, d = _run(logits, targets, grad, opts, dlogits=dlogits)
    _check(loss, lse, d, before, targets, grad, opts)
    outside = torch.ones_like(d_buffer, dtype=torch.bool)
    outside[::2, 3 : 3 + v] = False
    assert torch.isnan(d_buffer[outside].float()).all()
    if not in_place:
        assert torch.equal(_bits(buffer), buffer_before)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("name", ["plain", "all"])
def test_in_place_equals_out_of_place(name):
    """``dlogits`` is ``logits``: bit for bit what a separate gradient gets."""
    n, v = 4, 40
    opts = _options(**OPTIONS[name])
    logits = _logits(n, v, torch.bfloat16, seed=11)
    targets = _targets(n, v, seed=12)
    targets[0] = -100
    grad = torch.tensor([0.3], device=DEVICE).expand(n)
    loss, lse, d = _run(logits, targets, grad, opts)
    inplace = logits.clone()
    ce.backward(inplace, inplace, targets, lse, grad, **opts)
    assert torch.equal(_bits(inplace), _bits(d))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("per_row", [False, True], ids=["grad-stride0", "grad-per-row"])
def test_float32_gradient_of_bfloat16_logits(per_row):
    """A float32 ``dlogits`` of bfloat16 logits, the weight broadcast (stride 0) or per row."""
    n, v = 5, 40
    opts = _options(label_smoothing=0.1, z_loss=1e-3)
    logits = _logits(n, v, torch.bfloat16, seed=13)
    targets = _targets(n, v, torch.int32, seed=14)
    if per_row:
        grad = (0.5 + torch.rand(n, generator=_gen(15))).to(DEVICE)
    else:
        grad = torch.tensor(1.0 / n, device=DEVICE).expand(n)
        assert grad.stride() == (0,)
    dlogits = torch.full((n, v), float("nan"), device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts, dlogits=dlogits)
    _check(loss, lse, d, logits, targets, grad, opts)


# ----------------------------------------------------------------------------- targets


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=_dtype_id)
def test_custom_ignore_index_inside_the_vocabulary(dtype):
    """``ignore_index = 3``, a real column: rows targeting 3 lose 0 and get zeros; the
    others (some with target 3's neighbours) match the reference."""
    n, v = 6, 40
    opts = _options(ignore_index=3, label_smoothing=0.1, softcap=4.0)
    logits = _logits(n, v, dtype, seed=16)
    targets = torch.tensor([3, 2, 4, 3, 0, v - 1], device=DEVICE)
    grad = torch.ones(n, device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    _check(loss, lse, d, logits, targets, grad, opts)
    assert (loss[[0, 3]] == 0).all()


@pytest.mark.usefixtures("small_chunks")
def test_every_row_ignored_gives_zeros_whatever_the_logits():
    """All rows ignored, over logits holding NaN and +-inf: zero losses, exact zero
    gradients (not NaN), ``lse`` still written (NaN where a NaN is in the row)."""
    n, v = 3, 40
    opts = _options(**OPTIONS["all"])
    logits = _logits(n, v, torch.float32, seed=17)
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    logits[2, 9] = float("-inf")
    targets = torch.full((n,), -100, device=DEVICE)
    grad = torch.ones(n, device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(d, torch.zeros_like(d)) and not torch.signbit(d).any()
    assert torch.isnan(lse[0]) and torch.isfinite(lse[1:]).all()


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_minus_inf_logits_without_smoothing_are_finite(dtype):
    """Masked vocabulary entries (``-inf``: whole chunks, a row's first chunks, scattered
    ones): with no smoothing and no softcap the loss is the logsumexp over the other
    columns, finite, and their gradient exactly 0."""
    n, v = 4, 70
    opts = _options(z_loss=1e-3)
    logits = _logits(n, v, dtype, seed=18)
    logits[:, 16:48] = float("-inf")  # whole chunks of either width
    logits[1, ::5] = float("-inf")
    logits[2, :16] = float("-inf")  # the row starts with whole chunks of -inf
    targets = torch.tensor([0, 2, 60, 69], device=DEVICE)
    grad = torch.ones(n, device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    assert torch.isfinite(loss).all() and torch.isfinite(lse).all()
    assert (d[torch.isinf(logits)] == 0).all()
    # the reference's mean logit is -inf and 0 * inf NaN: compare row by row on the kept columns
    for r in range(n):
        cols = torch.nonzero(torch.isfinite(logits[r]))[:, 0]
        t = torch.nonzero(cols == targets[r])[:, 0]
        _check(
            loss[r : r + 1],
            lse[r : r + 1],
            d[r : r + 1, cols],
            logits[r : r + 1, cols],
            t,
            grad[r : r + 1],
            opts,
            kernel_v=v,
        )


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=_dtype_id)
def test_out_of_range_target_gives_nan_on_its_row_only(target_dtype):
    """Targets ``V``, ``-1`` (not ``ignore_index``) and, in int64, ``2**40``: those rows lose
    NaN and get NaN gradients, read nothing outside their row; the others are exact."""
    n, v = 6, 40
    opts = _options(label_smoothing=0.1)
    logits = _logits(n, v, torch.float32, seed=19)
    bad = [v, -1] + ([2**40] if target_dtype == torch.int64 else [2**31 - 1])
    targets = torch.tensor([bad[0], 5, bad[1], 7, bad[2], -100], dtype=target_dtype).to(DEVICE)
    grad = torch.ones(n, device=DEVICE)
    loss, lse, d = _run(logits, targets, grad, opts)
    bad_rows, good_rows = [0, 2, 4], [1, 3, 5]
    assert torch.isnan(loss[bad_rows]).all()
    assert torch.isnan(d[bad_rows]).all()
    assert torch.isfinite(lse).all()
    _check(loss, lse, d, logits, targets, grad, opts, rows=good_rows)


# ----------------------------------------------------------------------------- launches


class _NoLaunch:
    """Stands in for a kernel: fails any launch."""

    def __getitem__(self, grid):
        raise AssertionError(f"launched a grid of {grid}")


def test_no_rows_launch_nothing(monkeypatch):
    monkeypatch.setattr(ce, "_forward_kernel", _NoLaunch())
    monkeypatch.setattr(ce, "_backward_kernel", _NoLaunch())
    logits = torch.zeros((0, 50), device=DEVICE)
    targets = torch.zeros((0,), dtype=torch.int64, device=DEVICE)
    empty = torch.zeros((0,), device=DEVICE)
    opts = _options()
    ce.forward(empty, empty, logits, targets, **opts)
    ce.backward(logits, logits, targets, empty, empty, **opts)


def test_tile_config_spans_one_vector_per_thread():
    assert ce.tile_config(128256, 2) == (4096, 16)
    assert ce.tile_config(128256, 4) == (2048, 16)
    assert ce.tile_config(262144, 2) == (4096, 16)
    for itemsize in (2, 4):
        vector = 16 // itemsize
        for v in (1, 3, 8, 100, 1000, 4096, 50257, 128256):
            block, warps = ce.tile_config(v, itemsize)
            for k in (block, warps):
                assert k & (k - 1) == 0, (v, itemsize, block, warps)
            assert vector <= block <= max(vector, ce.CHUNK_BYTES // itemsize)
            assert block >= min(v, ce.CHUNK_BYTES // itemsize)
            assert 1 <= warps <= 16
            assert warps == 1 or block == 32 * warps * vector * ce.VECTORS_PER_THREAD
