"""The cupy backend's cross-entropy kernels (``cross_entropy.cu``), run unchanged through the CPU
harness (``xpkernels.testing.cudacpu``) in its default and shuffled schedules, and on CuPy
arrays when CuPy sees a GPU (float32 and float16: CuPy has no bfloat16).

Forward and backward against the float64 reference
(``xpkernels.testing.references.cross_entropy_rows`` and ``_backward``) in
float32, float16 and bfloat16 (``ml_dtypes``): the 128-bit and the scalar
paths (a vocabulary not a multiple of the vector width, misaligned row
starts, odd row strides), rows long enough for many strides per thread
(128256 and 50257 logits, and blocks of 32 threads), more rows than blocks
(the blocks stride over the rows), logits in padded buffers whose padding
(NaN sentinels) must stay untouched, int32 and int64 targets with strides,
ignored rows (``-100`` and an ``ignore_index`` inside the vocabulary, all
rows ignored), label smoothing, a softcap, the z-loss and all of them
together, ``-inf`` logits, out-of-range targets (NaN on their rows only),
the in-place backward, a row weight of stride 0, dlogits of another dtype
than the logits, ``N = 0``, the CUDA C compiled by NVRTC, AddressSanitizer,
and bugs planted in the CUDA C that these checks must catch.

Tolerances come from the dtypes, never from a run. With ``u`` float32's
eps and ``c = (4 + 4 sqrt(V)) u`` (the relative error of a float32 sum of
``V`` terms, as ``test_cupy_rows``), per row: ``lse`` within ``err_lse = c
+ 4 u (|lse| + max|z|)`` (the sum of exponentials; the rounding of the log,
of the softcapped ``z`` and of the sum with the max); the loss within
``err_lse (1 + 2 z_loss |lse|) + c eps mean|z| + 4 u (|z_t| + |lse| +
z_loss lse^2)``. Per gradient element, in dlogits' dtype of eps ``e`` and
subnormal spacing ``s``: ``2 e |want| + s + |grad| (|dz| P r + |dz| p 2
z_loss err_lse + 8 u (P + eps / V + 1))`` with ``P = p (1 + 2 z_loss
|lse|)`` and ``r = err_lse + 4 u (1 + |z| + |lse|)``, the relative error of
``p = exp(z - lse)`` from the forward's ``lse`` and the float32 exponent.
"""

from __future__ import annotations

import importlib.util
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report
from xpkernels.backends.cupy import cross_entropy as CE

from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
#: (mantissa bits, smallest subnormal exponent) of each dtype.
_FORMAT = {"float32": (23, -149), "float16": (10, -24), "bfloat16": (7, -133)}
U = 2.0**-23  #: float32's eps, the unit of the float32 computation's errors


def _eps(dtype: str) -> float:
    return 2.0 ** -_FORMAT[dtype][0]


def _spacing(dtype: str) -> float:
    """The spacing of ``dtype``'s subnormals: the most an output near 0 is rounded by, twice over."""
    return 2.0 ** _FORMAT[dtype][1]


def _rng(*seed):
    return np.random.default_rng(zlib.crc32("/".join(map(str, seed)).encode()))


# ---------------------------------------------------------------- where the arrays live


class _Harness:
    """NumPy arrays in 256-byte aligned buffers, launched through the CPU harness."""

    xp = np
    cupy = False

    @staticmethod
    def put(a: np.ndarray):
        out = cudacpu.empty(a.shape, a.dtype)
        out[...] = a
        return out

    @staticmethod
    def get(a) -> np.ndarray:
        return np.array(a)


class _Cupy:
    """CuPy arrays on the GPU, launched through ``cupy.RawModule``."""

    cupy = True

    def __init__(self, cupy):
        self.xp = cupy

    def put(self, a: np.ndarray):
        return self.xp.asarray(a)

    def get(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)


#: The CPU harness's schedules, and CuPy where it is installed (skipped without a GPU).
TARGETS = ["default", "shuffled"] + (["cupy"] if importlib.util.find_spec("cupy") else [])


@pytest.fixture(scope="module", params=TARGETS)
def target(request):
    """The CPU harness in either schedule (each dtype's module compiled once), or CuPy on a GPU."""
    if request.param == "cupy":
        import cupy

        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                pytest.skip("no GPU")
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            pytest.skip(f"no GPU: {exc}")
        yield _Cupy(cupy)
        return
    with cudacpu.emulate(schedule=request.param):
        yield _Harness()


def _skip_bfloat16_on_cupy(target, *dtypes):
    if target.cupy and "bfloat16" in dtypes:
        pytest.skip("CuPy has no bfloat16 arrays")


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One problem: shapes, memory layouts, targets, options and row weights."""

    name: str
    n: int
    vocab: int
    pad: int = 0  #: elements past the vocabulary in each row of the logits' buffer
    offset: int = 0  #: elements before the first row (misaligns the rows)
    targets: str = "int64"
    target_step: int = 1  #: the targets' stride
    ignored: tuple = ()  #: rows whose target is ignore_index
    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0
    scale: float = 3.0  #: the logits' spread
    ramp: float = 0.0  #: added along each row from 0 to ramp (the row max grows as it streams)
    grad: str = "rows"  #: "rows": a strided weight per row (signs mixed); "one": 0.75 of
    #: stride 0; "rows-0.75": 0.75 per row, strided
    neg_inf: float = 0.0  #: the fraction of logits set to -inf (never a target's)
    neg_inf_rows: tuple = ()  #: rows of -inf logits only
    bad_targets: tuple = ()  #: (row, target) pairs replacing the drawn targets
    vector: bool | None = None  #: whether 128-bit accesses are taken

    @property
    def stride(self) -> int:
        return self.vocab + self.pad

    def options(self) -> dict:
        return {
            "ignore_index": self.ignore_index,
            "label_smoothing": self.label_smoothing,
            "softcap": self.softcap,
            "z_loss": self.z_loss,
        }

    def values(self, dtype: str) -> np.ndarray:
        """The logits, float64 values rounded to ``dtype``, seeded by the case and dtype."""
        rng = _rng(self.name, dtype)
        x = rng.standard_normal((self.n, self.vocab)) * self.scale
        x += np.linspace(0.0, self.ramp, self.vocab)
        masked = rng.random(x.shape) < self.neg_inf
        masked[np.arange(self.n), np.clip(self.target_values(), 0, self.vocab - 1)] = False
        masked[list(self.neg_inf_rows)] = True
        x[masked] = -np.inf
        return x.astype(DTYPES[dtype])

    def buffer(self, values: np.ndarray) -> np.ndarray:
        """A NaN-filled buffer holding ``values`` at the case's layout (see :func:`rows_of`)."""
        base = np.full(self.offset + self.n * self.stride, np.nan, values.dtype)
        self.rows_of(base)[...] = values
        return base

    def rows_of(self, base):
        """The ``(n, vocab)`` view of a buffer (NumPy or CuPy)."""
        rows = base[self.offset : self.offset + self.n * self.stride].reshape(self.n, self.stride)
        return rows[:, : self.vocab]

    def target_values(self) -> np.ndarray:
        rng = _rng(self.name, "targets")
        t = rng.integers(0, self.vocab, self.n)
        t[list(self.ignored)] = self.ignore_index
        for row, value in self.bad_targets:
            t[row] = value
        return t.astype(self.targets)

    def grad_values(self) -> np.ndarray:
        if self.grad in ("one", "rows-0.75"):
            return np.full(self.n, 0.75, np.float32)
        rng = _rng(self.name, "grad")
        return (rng.uniform(0.5, 2.0, self.n) * rng.choice([-1.0, 1.0], self.n)).astype(np.float32)


def _strided(target, values: np.ndarray, step: int, fill):
    """``values`` on ``target`` as a view of stride ``step`` into a buffer filled with ``fill``."""
    base = np.full(len(values) * step, fill, values.dtype)
    base[::step] = values
    return target.put(base)[::step]


@dataclass
class Run:
    """One forward and backward of a case on a target, with its inputs and outputs as NumPy."""

    x: np.ndarray  #: the logits (n, vocab) in their dtype
    t: np.ndarray
    grad: np.ndarray
    loss: np.ndarray
    lse: np.ndarray
    dx: np.ndarray  #: the gradient (n, vocab) in its dtype
    logits_base: np.ndarray  #: the logits' buffer after both passes
    logits_base_before: np.ndarray
    dx_base: np.ndarray  #: the gradient's buffer after the backward


def run(target, case: Case, dtype: str, grad_dtype: str | None = None, in_place=False) -> Run:
    """Forward into NaN-filled loss and lse, then backward into a NaN-filled buffer of the
    logits' layout (``grad_dtype``: its dtype, default the logits'), or into the logits
    themselves (``in_place``)."""
    grad_dtype = grad_dtype or dtype
    x = case.values(dtype)
    base_np = case.buffer(x)
    base = target.put(base_np)
    logits = case.rows_of(base)
    t = case.target_values()
    targets = _strided(target, t, case.target_step, -7777)  # an out-of-range decoy between
    g = case.grad_values()
    if case.grad == "one":
        grad = target.xp.broadcast_to(target.put(g[:1]), (case.n,))
    else:
        grad = _strided(target, g, 2, np.nan)
    loss = target.put(np.full(case.n, np.nan, np.float32))
    lse = target.put(np.full(case.n, np.nan, np.float32))
    CE.forward(loss, lse, logits, targets, **case.options())
    if in_place:
        dx_base, dlogits = base, logits
    else:
        dx_base = target.put(case.buffer(np.full(x.shape, np.nan, DTYPES[grad_dtype])))
        dlogits = case.rows_of(dx_base)
    CE.backward(dlogits, logits, targets, lse, grad, **case.options())
    return Run(
        x=x,
        t=t,
        grad=g,
        loss=target.get(loss),
        lse=target.get(lse),
        dx=target.get(dlogits),
        logits_base=target.get(base),
        logits_base_before=base_np,
        dx_base=target.get(dx_base),
    )


# ---------------------------------------------------------------- the bounds


def _capped(x64, softcap):
    """``(z, dz/dx)`` in float64."""
    if softcap is None:
        return x64, np.ones_like(x64)
    th = np.tanh(x64 / softcap)
    return softcap * th, 1 - th * th


def _fail(got, want, bound, what):
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / bound, 0)), err.shape)
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.size} off; worst at {i}: got {got[i]!r}, "
            f"want {want[i]!r}, bound {bound[i]:.3g}"
        )


def _reference_inputs(case: Case, r: Run, rows):
    """``(x, |z|, t)`` of ``rows`` in float64 for the reference and the bounds.

    Without smoothing, a -inf logit is given to the reference as -1e300, which
    gives the very same loss and gradient (``exp`` 0, ``tanh`` -1) where the
    reference's ``0 * (lse - mean(z))`` would be ``0 * inf``, NaN. An infinite
    ``|z|`` enters the bounds as 0, as its exponential enters the sums.
    """
    x64 = r.x.astype(np.float64)[rows]
    if case.label_smoothing == 0:
        x64 = np.where(np.isneginf(x64), -1e300, x64)
    z, _ = _capped(x64, case.softcap)
    z = np.abs(z)
    return x64, np.where(z > 1e200, 0.0, z), r.t[rows]


def check_forward(case: Case, r: Run, rows=None) -> np.ndarray:
    """Loss and lse of ``rows`` (default all) held to the reference; returns ``err_lse``."""
    rows = np.arange(case.n) if rows is None else rows
    x64, z, t = _reference_inputs(case, r, rows)
    want_loss, want_lse = ref.cross_entropy_rows(x64, t, **case.options())
    c = (4 + 4 * np.sqrt(case.vocab)) * U
    a = np.abs(want_lse)
    err_lse = c + 4 * U * (a + np.max(z, axis=1, initial=0.0))
    kept = t != case.ignore_index
    zt = np.take_along_axis(z, np.where(kept, t, 0)[:, None].astype(np.int64), 1)[:, 0]
    eps, zl = case.label_smoothing, case.z_loss
    bound = (
        err_lse * (1 + 2 * zl * a) + c * eps * np.mean(z, axis=1) + 4 * U * (zt + a + zl * a * a)
    )
    _fail(r.lse[rows], want_lse, err_lse, f"{case.name}: lse")
    _fail(r.loss[rows], want_loss, bound, f"{case.name}: loss")
    assert np.all(r.loss[rows][~kept] == 0), f"{case.name}: ignored rows lose exactly 0"
    return err_lse


def check_backward(case: Case, r: Run, err_lse, grad_dtype: str, rows=None) -> None:
    """dlogits of ``rows`` held to the reference; exact zeros on ignored rows."""
    rows = np.arange(case.n) if rows is None else rows
    x64, z_abs, t = _reference_inputs(case, r, rows)
    g = r.grad.astype(np.float64)[rows]
    want = ref.cross_entropy_rows_backward(x64, t, g, **case.options())
    z, dz = _capped(x64, case.softcap)
    _, lse = ref.cross_entropy_rows(x64, t, **case.options())
    p = np.exp(z - lse[:, None])
    eps, zl = case.label_smoothing, case.z_loss
    a, e = np.abs(lse)[:, None], err_lse[:, None]
    big_p = p * (1 + 2 * zl * a)
    rel_p = e + 4 * U * (1 + z_abs + a)
    compute = np.abs(dz) * (big_p * rel_p + p * 2 * zl * e) + 8 * U * (big_p + eps / case.vocab + 1)
    bound = 2 * _eps(grad_dtype) * np.abs(want) + _spacing(grad_dtype)
    bound = bound + np.abs(g)[:, None] * compute
    _fail(r.dx[rows], want, bound, f"{case.name}: dlogits")
    ignored = t == case.ignore_index
    assert np.all(r.dx[rows][ignored].astype(np.float64) == 0), f"{case.name}: ignored rows"


def check_untouched(case: Case, r: Run, in_place=False) -> None:
    """Nothing written outside the views: the logits' buffer unchanged (bit for bit) where the
    backward does not write, and the gradient buffer's padding still NaN."""
    inside = np.zeros(r.logits_base.shape, bool)
    case.rows_of(inside)[...] = True
    bits = np.dtype(f"u{r.x.itemsize}")
    got, before = r.logits_base.view(bits), r.logits_base_before.view(bits)
    if in_place:
        np.testing.assert_array_equal(got[~inside], before[~inside], "logits' padding")
    else:
        np.testing.assert_array_equal(got, before, "the logits must not be written")
        assert np.isnan(r.dx_base[~inside].astype(np.float64)).all(), "dlogits' padding written"


def check(target, case: Case, dtype: str, grad_dtype: str | None = None) -> Run:
    """Both passes of ``case`` held to the reference, nothing written outside the views."""
    grad_dtype = grad_dtype or dtype
    r = run(target, case, dtype, grad_dtype)
    err_lse = check_forward(case, r)
    check_backward(case, r, err_lse, grad_dtype)
    check_untouched(case, r)
    return r


CASES = [
    # aligned rows in a padded buffer: 128-bit; int64 targets; a weight per row
    Case("plain", 6, 1000, pad=8, vector=True),
    # V = 1001: scalar; strided int32 targets; the max grows along the rows
    Case("odd-vocab", 5, 1001, pad=3, targets="int32", target_step=3, ramp=20.0, vector=False),
    # V a multiple of 8, rows start one element off a 16-byte boundary: scalar
    Case("misaligned", 4, 1024, offset=1, vector=False),
    # a row stride of 1025: scalar
    Case("odd-stride", 4, 1024, pad=1, grad="one", vector=False),
    # rows with the default ignore_index
    Case("ignored", 9, 640, pad=8, ignored=(0, 4, 5), vector=True),
    # an ignore_index inside the vocabulary
    Case("ignore-in-vocab", 7, 640, ignored=(1, 2), ignore_index=5, targets="int32"),
    Case("smoothing", 5, 800, label_smoothing=0.1, ramp=10.0),
    # |x| up to ~60 under a softcap of 15: tanh saturates
    Case("softcap", 5, 800, softcap=15.0, scale=20.0),
    Case("z-loss", 5, 800, z_loss=0.01, scale=3.0, ramp=8.0),
    # everything at once, padded, strided int32 targets, one weight for all rows
    Case(
        "combined",
        8,
        1000,
        pad=24,
        targets="int32",
        target_step=2,
        ignored=(3,),
        ignore_index=-1,
        label_smoothing=0.2,
        softcap=10.0,
        z_loss=1e-3,
        scale=8.0,
        ramp=12.0,
        grad="one",
        vector=True,
    ),
    # a Llama 3 vocabulary: 16 vectors per thread of 1024; a GPT-2 one: scalar, 50 per thread
    Case("llama3-vocab", 2, 128256, label_smoothing=0.1, softcap=30.0, z_loss=1e-4, vector=True),
    Case("gpt2-vocab", 2, 50257, ignored=(1,), ramp=5.0, vector=False),
]


@pytest.fixture(params=["shipped", "small-blocks"])
def variant(request, monkeypatch):
    """The shipped geometry, or blocks of 32 threads and at most 3 blocks: each thread strides
    over many vectors of its row and the blocks stride over the rows."""
    if request.param == "small-blocks":
        monkeypatch.setattr(CE, "MAX_THREADS", 32)
        monkeypatch.setattr(CE, "MAX_BLOCKS", 3)
    return request.param


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_reference(target, variant, case, dtype):
    _skip_bfloat16_on_cupy(target, dtype)
    if case.vector is not None:
        x = case.rows_of(target.put(case.buffer(case.values(dtype))))
        assert (CE._vector((x,)) > 1) == case.vector
        assert (CE._vector((x, x)) > 1) == case.vector
    check(target, case, dtype)


# ---------------------------------------------------------------- special values and rows


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_neg_inf_logits_give_a_finite_loss_without_smoothing(target, dtype, softcap, z_loss):
    """30% of the logits -inf (none at a target): finite losses and gradients as the
    reference (exact zeros at the -inf logits without a softcap), with and without the z-loss;
    an ignored row of -inf logits only loses 0 and gets zeros."""
    _skip_bfloat16_on_cupy(target, dtype)
    case = Case(
        "neg-inf",
        6,
        1000,
        pad=8,
        ignored=(5,),
        softcap=softcap,
        z_loss=z_loss,
        neg_inf=0.3,
        neg_inf_rows=(5,),
    )
    r = run(target, case, dtype)
    assert np.isfinite(r.loss).all() and np.isfinite(r.dx.astype(np.float64)).all()
    kept = np.arange(5)
    err_lse = check_forward(case, r, kept)
    check_backward(case, r, err_lse, dtype, kept)
    assert r.loss[5] == 0 and np.all(r.dx[5].astype(np.float64) == 0)
    if softcap is None:
        assert np.all(r.dx[np.isneginf(r.x.astype(np.float64))].astype(np.float64) == 0)


@pytest.mark.parametrize("targets", ["int32", "int64"])
def test_a_target_out_of_range_gives_nan_on_its_row_only(target, targets):
    """Targets V, -1 and far beyond (never read): NaN loss and gradient on those rows; their
    lse and every other row as the reference."""
    far = 2**31 - 1 if targets == "int32" else 2**40
    bad = ((1, 1000), (3, -1), (4, far))
    case = Case(
        "out-of-range",
        6,
        1000,
        targets=targets,
        label_smoothing=0.1,
        z_loss=1e-3,
        bad_targets=bad,
    )
    r = run(target, case, "float32")
    rows = np.array([row for row, _ in bad])
    good = np.setdiff1d(np.arange(case.n), rows)
    assert np.isnan(r.loss[rows]).all() and np.isnan(r.dx[rows]).all()
    assert not np.isnan(r.loss[good]).any() and not np.isnan(r.dx[good]).any()
    err_lse = check_forward(case, r, good)
    check_backward(case, r, err_lse, "float32", good)
    x64 = r.x.astype(np.float64)[rows]
    _, want_lse = ref.cross_entropy_rows(x64, np.zeros(len(rows), np.int64), **case.options())
    _fail(r.lse[rows], want_lse, np.full(len(rows), err_lse.max()), "lse of the NaN rows")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_rows_ignored_give_zeros_not_nan(target, dtype):
    """Every row ignored, under smoothing, a softcap, the z-loss and 20% of the logits -inf:
    losses and gradients exactly 0, lse still every row's."""
    _skip_bfloat16_on_cupy(target, dtype)
    for softcap in (None, 20.0):
        case = Case(
            "all-ignored",
            4,
            1000,
            pad=8,
            ignored=(0, 1, 2, 3),
            label_smoothing=0.3,
            softcap=softcap,
            z_loss=0.1,
            neg_inf=0.2,
        )
        r = run(target, case, dtype)
        assert np.isneginf(r.x.astype(np.float64)).any()
        assert np.all(r.loss == 0)
        assert np.all(r.dx.astype(np.float64) == 0)
        check_forward(case, r)
        check_untouched(case, r)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [CASES[9], CASES[1]], ids=["vector", "scalar"])
def test_in_place_backward_gives_the_out_of_place_gradient(target, case, dtype):
    """``dlogits`` the very same array as ``logits``: bit for bit the out-of-place gradient,
    the padding untouched."""
    _skip_bfloat16_on_cupy(target, dtype)
    want = run(target, case, dtype)
    got = run(target, case, dtype, in_place=True)
    np.testing.assert_array_equal(got.dx.view(np.uint8), want.dx.view(np.uint8))
    np.testing.assert_array_equal(got.loss, want.loss)
    check_untouched(case, got, in_place=True)


@pytest.mark.parametrize("grad_dtype", list(DTYPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dlogits_of_another_dtype(target, dtype, grad_dtype):
    """Every pairing of the logits' and dlogits' dtypes, 128-bit (16 bytes of the narrower;
    float32 dlogits of 16-bit logits move in two pieces) and scalar."""
    _skip_bfloat16_on_cupy(target, dtype, grad_dtype)
    for case in (CASES[9], CASES[3]):
        check(target, case, dtype, grad_dtype)


def test_a_weight_of_stride_0_is_every_row_s(target):
    """``grad`` broadcast (stride 0) gives bit for bit what the same weight per row gives."""
    one = CASES[9]
    a, b = run(target, one, "float32"), run(target, replace(one, grad="rows-0.75"), "float32")
    np.testing.assert_array_equal(a.dx, b.dx)


def test_no_rows_launch_nothing(monkeypatch):
    def no_launch(_):
        raise AssertionError("launched on an empty problem")

    monkeypatch.setattr(CE, "loader_for", no_launch)
    x = np.zeros((0, 1000), np.float32)
    t = np.zeros(0, np.int64)
    out = np.zeros(0, np.float32)
    options = {"ignore_index": -100, "label_smoothing": 0.1, "softcap": 3.0, "z_loss": 0.1}
    CE.forward(out, out, x, t, **options)
    CE.backward(x, x, t, out, out, **options)
    CE.backward(x.astype(np.float16), x, t, out, np.broadcast_to(out[:0], (0,)), **options)


def test_dtypes_are_checked():
    x, t, f = np.zeros((2, 8), np.float32), np.zeros(2, np.int64), np.zeros(2, np.float32)
    options = {"ignore_index": -100, "label_smoothing": 0.0, "softcap": None, "z_loss": 0.0}
    with pytest.raises(TypeError, match="logits has dtype float64"):
        CE.forward(f, f, x.astype(np.float64), t, **options)
    with pytest.raises(TypeError, match="targets has dtype int16"):
        CE.forward(f, f, x, t.astype(np.int16), **options)
    with pytest.raises(TypeError, match="loss must be float32"):
        CE.forward(f.astype(np.float16), f, x, t, **options)
    with pytest.raises(TypeError, match="dlogits has dtype float64"):
        CE.backward(x.astype(np.float64), x, t, f, f, **options)
    with pytest.raises(TypeError, match="grad must be float32"):
        CE.backward(x, x, t, f, f.astype(np.float64), **options)


# ---------------------------------------------------------------- access width and geometry


def test_access_width_follows_every_row_start():
    def rows(dtype, vocab=1024, pad=0, offset=0, n=3):
        case = Case("width", n, vocab, pad=pad, offset=offset)
        return case.rows_of(cudacpu.zeros(offset + n * case.stride, dtype))

    f32, bf16 = np.float32, ml_dtypes.bfloat16
    assert CE._vector((rows(f32),)) == 4 and CE._vector((rows(bf16),)) == 8
    assert CE._vector((rows(bf16), rows(f32))) == 8, "16 bytes of the narrower"
    assert CE._vector((rows(f32), rows(bf16))) == 8
    assert CE._vector((rows(bf16, vocab=1004),)) == 1, "V not a multiple of 8"
    assert CE._vector((rows(f32, vocab=1004),)) == 4
    assert CE._vector((rows(bf16, vocab=1004), rows(f32, vocab=1004))) == 1
    assert CE._vector((rows(f32, offset=2),)) == 1, "not 16-byte aligned"
    assert CE._vector((rows(f32, pad=2),)) == 1, "a row stride of 1026 float32"
    assert CE._vector((rows(f32, pad=2, n=1),)) == 4, "one row: its stride is never taken"
    assert CE._vector((rows(f32, pad=4),)) == 4, "a row stride of 1028 float32: 16 bytes"
    assert CE._vector((rows(bf16), rows(f32, pad=2))) == 1, "the dlogits' rows too"
    assert CE._vector((rows(bf16, pad=4), rows(f32))) == 1, "1028 bfloat16: 8 bytes"


@pytest.mark.parametrize(("vocab", "v", "threads"), [(1, 1, 32), (100, 4, 32), (1000, 8, 128)])
def test_threads_cover_a_row_in_one_vector_each_up_to_the_limit(vocab, v, threads):
    assert CE._threads(vocab, v) == threads
    assert CE._threads(128256, 8) == CE._threads(262144, 1) == CE.MAX_THREADS == 1024


def test_the_grid_is_capped_and_long_rows_refused(monkeypatch):
    assert CE._geometry(5, 1000, 8) == ((5,), (128,))
    assert CE._geometry(2**33, 64, 1)[0] == (2**31 - 1,), "the blocks stride beyond"
    with pytest.raises(ValueError, match="rows of 2147483647 logits"):
        CE._geometry(1, 2**31 - 1, 1)


# ---------------------------------------------------------------- NVRTC and sanitizers


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_builds_every_instantiation_with_128_bit_rows(arch):
    report = nvrtc_report()
    entry = report.compile_source(CE.SOURCE, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(CE.name_expressions())
    assert len(entry["kernels"]) == 24, "3 x 2 forwards, 3 x 3 x 2 backwards"
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        if not name.endswith(",1>"):  # the 128-bit instantiations
            assert k["global_load_bits"] == 128, (name, k)
            if "backward" in name:
                assert k["global_store_bits"] == 128, (name, k)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import cross_entropy as CE
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
options = dict(ignore_index=-100, label_smoothing=0.1, softcap=10.0, z_loss=1e-3)
with cudacpu.emulate():
    for vocab in (1000, 1001):  # 128-bit, scalar
        x = cudacpu.empty((3, vocab), ml_dtypes.bfloat16)
        x[...] = rng.standard_normal(x.shape)
        t = np.array([0, vocab - 1, vocab], np.int64)  # the last out of range: never read
        loss, lse = cudacpu.empty(3), cudacpu.empty(3)
        CE.forward(loss, lse, x, t, **options)
        dx = cudacpu.empty((3, vocab), np.float32)
        CE.backward(dx, x, t, lse, np.ones(3, np.float32), **options)
        CE.backward(x, x, t, lse, np.broadcast_to(np.ones(1, np.float32), (3,)), **options)
        assert np.isfinite(loss[:2]).all() and np.isnan(loss[2])
print("clean")
"""


def test_runs_clean_under_address_sanitizer():
    assert_clean_under_sanitizer(SANITIZED_RUN, "address")


# ---------------------------------------------------------------- planted bugs


@pytest.mark.parametrize(
    ("old", "new", "case"),
    [
        # the smoothing term dropped
        ("out += label_smoothing * (l - zsum", "out += 0.0f * (l - zsum", "smoothing"),
        # the running sum not rescaled when the max grows
        ("s *= __expf(mx - top);", "", "odd-vocab"),
        # the block's sums not rescaled to the row max
        ("float total = s * __expf(mx - row_max);", "float total = s;", "plain"),
        # the softcap's derivative left out
        ("x[i] = CAP ? d * dz : d;", "x[i] = d;", "softcap"),
        # the z-loss left out of the gradient
        ("g * (1.0f + 2.0f * z_loss * l)", "g", "z-loss"),
        # ignored rows not zeroed in the backward
        ("if (t == ignore_index) {", "if (false) {", "ignored"),
        # the target column's one-hot at the wrong element of its vector
        ("if (j * V + i == t) d -= c;", "if (j * V == t) d -= c;", "combined"),
    ],
)
def test_a_bug_planted_in_the_cuda_c_is_caught(tmp_path, monkeypatch, old, new, case):
    source = CE.SOURCE.read_text()
    assert old in source
    planted = tmp_path / CE.SOURCE.name
    planted.write_text(source.replace(old, new, 1))
    monkeypatch.setattr(CE, "SOURCE", planted)
    monkeypatch.setattr(CE, "MAX_THREADS", 32)  # many vectors per thread: the max grows
    chosen = next(c for c in CASES if c.name == case)
    with cudacpu.emulate(), pytest.raises(pytest.fail.Exception):
        for dtype in ("float32", "bfloat16"):
            check(_Harness(), chosen, dtype)
