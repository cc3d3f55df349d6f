"""The gated-activation backend modules -- SwiGLU (SiLU) and GeGLU (GELU, exact and tanh form)
on array_api, triton and cupy -- driven directly on 2-D row views.

What the conformance templates cannot see from the fronts: every backend's
module on the ``(rows, M)`` views the fronts pass -- padded row strides (and
nothing written between rows), rows that do not fill the last tile, M odd or
not a multiple of the vector width, M = 1, tiles shrunk so that small rows
cross many row and column tiles, the in-place aliases (``y`` is ``a`` or
``b``, ``da`` or ``db`` is ``dy``), large ``|a|`` without an overflow
warning, NaN / +-inf against ``torch.nn.functional.silu`` / ``gelu``, the
array_api backend's normal CDF against mpmath, the CUDA C compiled by NVRTC,
and bugs planted in each backend that these checks must catch.

Triton runs through its interpreter on CPU tensors (``TRITON_INTERPRET=1`` is
set here before its kernels are imported) or on CUDA when torch sees a GPU;
the CUDA C of the cupy backend runs unchanged through
``xpkernels.testing.cudacpu`` in its default and shuffled schedules, bfloat16
through ``ml_dtypes``.

Tolerances come from the dtypes, per element: the output's rounding
(``2 eps_out |want|``), the computation (``8 eps_acc`` times the magnitude of
the terms the result is made of, :meth:`Gated.scales`) and one smallest
normal of the output (flushed subnormals). The sigmoid gates keep their
relative accuracy in both tails; exact GELU's :math:`\\Phi` is held to an
absolute error (as PyTorch's ``0.5 * (1 + erf(...))``). The float64 oracle of
the sigmoid gates runs in long double with :math:`\\sigma(1 - \\sigma) =
e/(1+e)^2` (the float64 references of ``xpkernels.testing.references`` lose
that to cancellation near :math:`\\sigma = 1`, more than the kernels do).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from _cuda_checks import assert_clean_under_sanitizer, nvrtc_report

from xpkernels.testing import cudacpu
from xpkernels.testing import references as ref

_TORCH = importlib.util.find_spec("torch") is not None
_TRITON = _TORCH and importlib.util.find_spec("triton") is not None
if _TORCH:
    import torch

    _DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    if _DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
_TRITON = _TRITON and (_DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
if _TRITON:
    import triton.language as tl
    from xpkernels.backends.triton import _gated as triton_gated
    from xpkernels.backends.triton import geglu as triton_geglu
    from xpkernels.backends.triton import swiglu as triton_swiglu

from xpkernels.backends.array_api import _gated as array_api_gated
from xpkernels.backends.array_api import _normal_cdf
from xpkernels.backends.array_api import geglu as array_api_geglu
from xpkernels.backends.array_api import swiglu as array_api_swiglu
from xpkernels.backends.cupy import _gated as cupy_gated
from xpkernels.backends.cupy import _rows
from xpkernels.backends.cupy import geglu as cupy_geglu
from xpkernels.backends.cupy import swiglu as cupy_swiglu

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays on NumPy need ml_dtypes")

#: (mantissa bits, smallest normal exponent) of each dtype: its eps and smallest normal.
_FORMAT = {
    "float64": (52, -1022),
    "float32": (23, -126),
    "float16": (10, -14),
    "bfloat16": (7, -126),
}


def _eps(dtype: str) -> float:
    return 2.0 ** -_FORMAT[dtype][0]


def _tiny(dtype: str) -> float:
    return 2.0 ** _FORMAT[dtype][1]


# ---------------------------------------------------------------- the activations

#: :math:`2\sqrt{2/\pi}` and :math:`0.044715`: the tanh form's :math:`z = s\,(a + c\,a^3)`.
_TANH_SCALE, _TANH_CUBE = 2.0 * math.sqrt(2.0 / math.pi), 0.044715


def _sigmoid_oracle(z, dz, a):
    """``(f, f')`` of :math:`f = a\\,\\sigma(z)` in long double, :math:`\\sigma(1 - \\sigma)`
    without cancellation."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-np.abs(z))
        s = np.where(z >= 0, 1 / (1 + e), e / (1 + e))
        return a * s, s + a * (e / (1 + e) ** 2) * dz


@dataclass(frozen=True)
class Gated:
    """One gated activation under test: its primitive, options and oracles."""

    name: str
    primitive: str
    options: dict = field(default_factory=dict)

    def forward(self, module, y, a, b):
        module.forward(y, a, b, **self.options)

    def backward(self, module, dy, a, b, da, db):
        module.backward(dy, a, b, da, db, **self.options)

    def reference(self, a, b, dy):
        """``(y, da, db)`` of the float64 values ``a, b, dy``: exact GELU from
        ``xpkernels.testing.references``, the sigmoid gates in long double."""
        if self.name == "gelu":
            da, db = ref.geglu_backward(a, b, dy, "none")
            return ref.geglu(a, b, "none"), da, db
        x = a.astype(np.longdouble)
        if self.name == "silu":
            f, df = _sigmoid_oracle(x, 1, x)
        else:
            z = _TANH_SCALE * x * (1 + _TANH_CUBE * x * x)
            f, df = _sigmoid_oracle(z, _TANH_SCALE * (1 + 3 * _TANH_CUBE * x * x), x)
        return tuple(np.asarray(v, dtype=np.float64) for v in (f * b, dy * b * df, dy * f))

    def scales(self, a, b, dy):
        """Per element, the magnitudes of the terms ``y``, ``da`` and ``db`` are made of.

        Sigmoid gates: :math:`\\sigma(z)` from ``exp(-|z|)`` is off by about
        :math:`|z|\\,(1 - \\sigma)` units relatively, :math:`\\sigma(1-\\sigma)` by
        :math:`2|z|`. Exact GELU: :math:`\\Phi` is off by a few units
        absolutely, :math:`\\varphi = e^{-a^2/2}/\\sqrt{2\\pi}` by :math:`a^2/2` relatively
        (the rounding of the exponent).
        """
        with np.errstate(over="ignore", invalid="ignore"):
            if self.name == "gelu":
                density = np.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
                slope = 1 + np.abs(a) * density * (2 + a * a)
                return np.abs(a * b), np.abs(dy * b) * slope, np.abs(dy * a)
            if self.name == "silu":
                z, dz = a, np.ones_like(a)
            else:
                z = _TANH_SCALE * a * (1 + _TANH_CUBE * a * a)
                dz = _TANH_SCALE * (1 + 3 * _TANH_CUBE * a * a)
            e = np.exp(-np.abs(z))
            s = np.where(z >= 0, 1 / (1 + e), e / (1 + e))
            amp = 1 + np.abs(z) * (1 - s)
            slope = s * amp + np.abs(a) * (e / (1 + e) ** 2) * dz * (2 + 2 * np.abs(z))
            return np.abs(a * b) * s * amp, np.abs(dy * b) * slope, np.abs(dy * a) * s * amp

    def torch(self, a):
        """The activation on a float64 torch tensor (the oracle of NaN and infinities)."""
        if self.name == "silu":
            return torch.nn.functional.silu(a)
        return torch.nn.functional.gelu(a, approximate=self.options["approximate"])


ACTIVATIONS = [
    Gated("silu", "swiglu"),
    Gated("gelu_tanh", "geglu", {"approximate": "tanh"}),
    Gated("gelu", "geglu", {"approximate": "none"}),
]


@pytest.fixture(params=ACTIVATIONS, ids=[g.name for g in ACTIVATIONS])
def gated(request):
    return request.param


# ---------------------------------------------------------------- the backends under test


class _Runner:
    """One backend on one kind of array: its modules, padded row views, reads back."""

    def __init__(self, name, backend, modules, dtypes, context=contextlib.nullcontext):
        self.name, self.backend, self.dtypes, self.context = name, backend, dtypes, context
        self._modules = modules

    def module(self, gated: Gated):
        return self._modules[gated.primitive]

    def run(self, gated: Gated, a, b, dy, dtype, pad=3):
        """Forward and backward into NaN-filled padded outputs; returns them (backend arrays)."""
        rows, m = a.shape
        y, da, db = (self.empty(rows, m, dtype, pad) for _ in range(3))
        gated.forward(self.module(gated), y, a, b)
        gated.backward(self.module(gated), dy, a, b, da, db)
        return y, da, db

    def rows(self, values, dtype, pad, fill=np.nan):
        """``values`` (2-D float64) as ``dtype``, in a buffer of rows ``pad`` elements longer."""
        raise NotImplementedError

    def empty(self, rows, m, dtype, pad):
        return self.rows(np.full((rows, m), np.nan), dtype, pad)

    def numpy(self, a) -> np.ndarray:
        raise NotImplementedError

    def gap(self, a) -> np.ndarray:
        """The padding past column M of every row of ``a``'s buffer."""
        raise NotImplementedError


class _NumpyRunner(_Runner):
    _TYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}

    def _type(self, dtype):
        return ml_dtypes.bfloat16 if dtype == "bfloat16" else self._TYPES[dtype]

    def rows(self, values, dtype, pad, fill=np.nan):
        rows, m = values.shape
        base = cudacpu.empty((rows, m + pad), self._type(dtype))  # 16-byte aligned data
        base[...] = fill
        base[:, :m] = values
        return base[:, :m]

    def numpy(self, a):
        return np.asarray(a).astype(np.float64)

    def gap(self, a):
        rows, m = a.shape
        pad = a.strides[0] // a.itemsize - m if rows else 0
        whole = np.lib.stride_tricks.as_strided(a, (rows, m + pad), a.strides, writeable=False)
        return whole[:, m:].astype(np.float64)


class _TorchRunner(_Runner):
    def rows(self, values, dtype, pad, fill=np.nan):
        rows, m = values.shape
        base = torch.full((rows, m + pad), fill, dtype=getattr(torch, dtype), device=_DEVICE)
        base[:, :m] = torch.from_numpy(np.asarray(values, dtype=np.float64))
        return base[:, :m]

    def numpy(self, a):
        return a.detach().to("cpu", torch.float64).numpy()

    def gap(self, a):
        return a._base[:, a.shape[1] :].to("cpu", torch.float64).numpy()


_ARRAY_API = {"swiglu": array_api_swiglu, "geglu": array_api_geglu}
_CUPY = {"swiglu": cupy_swiglu, "geglu": cupy_geglu}
_CUPY_DTYPES = ("float32", "float16", "bfloat16")


def _runners():
    """``(runner or None, skip reason or None)`` for each backend and array kind."""
    no_torch = None if _TORCH else "torch is not installed"
    no_triton = None if _TRITON else "triton (with torch) is not installed"
    found = [
        (
            _NumpyRunner(
                "array_api-numpy", "array_api", _ARRAY_API, ("float64", "float32", "float16")
            ),
            None,
        ),
        (
            _TorchRunner(
                "array_api-torch",
                "array_api",
                _ARRAY_API,
                ("float64", "float32", "float16", "bfloat16"),
            )
            if _TORCH
            else None,
            no_torch,
        ),
        (
            _TorchRunner(
                "triton",
                "triton",
                {"swiglu": triton_swiglu, "geglu": triton_geglu},
                _CUPY_DTYPES,
            )
            if _TRITON
            else None,
            no_triton,
        ),
    ]
    for schedule in ("default", "shuffled"):
        found.append(
            (
                _NumpyRunner(
                    f"cupy-{schedule}",
                    "cupy",
                    _CUPY,
                    _CUPY_DTYPES,
                    lambda schedule=schedule: cudacpu.emulate(schedule=schedule),
                ),
                None,
            )
        )
    return found


_IDS = ["array_api-numpy", "array_api-torch", "triton", "cupy-default", "cupy-shuffled"]


def _skip(reason):
    return [pytest.mark.skip(reason=reason)] if reason else []


#: Every backend on its arrays.
RUNNERS = [
    pytest.param(r, id=name, marks=_skip(reason)) for name, (r, reason) in zip(_IDS, _runners())
]
#: Every backend on its arrays, with each dtype it runs.
RUNNER_DTYPES = [
    pytest.param(r, dtype, id=f"{name}-{dtype}", marks=_skip(reason))
    for name, (r, reason) in zip(_IDS, _runners())
    for dtype in (r.dtypes if r is not None else ("float32",))
]


@pytest.fixture(params=RUNNERS)
def runner(request):
    """A backend on its arrays, inside its context (``cudacpu.emulate`` for cupy)."""
    with request.param.context():
        yield request.param


@pytest.fixture(params=["shipped", "small-tiles"])
def variant(request, runner, monkeypatch):
    """The shipped launch geometry, or tiles so small that the test rows cross many of them.

    ``small-tiles``: array_api blocks of 64 elements (many blocks, several
    worker threads on NumPy); Triton tiles of 64 bytes along a row and 256
    (forward) / 128 (backward) in all; cupy blocks of 32 threads, at most two
    blocks along a row, which then stride over the rest of it.
    """
    if request.param == "small-tiles":
        if runner.backend == "array_api":
            monkeypatch.setattr(array_api_gated, "BLOCK_ELEMENTS", 64)
        elif runner.backend == "cupy":
            monkeypatch.setattr(cupy_gated, "THREADS", 32)
            monkeypatch.setattr(cupy_gated, "MAX_COLUMN_BLOCKS", 2)
        else:
            monkeypatch.setattr(triton_gated, "COLUMN_BYTES", 64)
            monkeypatch.setattr(triton_gated, "TILE_BYTES", {"forward": 256, "backward": 128})
    return request.param


# ---------------------------------------------------------------- inputs and checks


def _rng(*seed):
    return np.random.default_rng(zlib.crc32("/".join(map(str, seed)).encode()))


#: Gate values far out in both tails; every fifth input element is one of them.
LARGE_A = (60.0, -60.0, 1e4, -1e4, 30.0, -30.0, 16.0, -16.0, 12.0, 9.0, 6.0, -6.0, -4.0)


def _values(rows, m, seed):
    """Float64 ``a`` (scale 3, with :data:`LARGE_A` spread in), ``b`` and ``dy`` in [-2, 2]."""
    rng = _rng(rows, m, seed)
    a = rng.standard_normal((rows, m)) * 3
    flat = a.reshape(-1)
    flat[::5] = np.resize(LARGE_A, flat[::5].size)
    return a, rng.uniform(-2, 2, (rows, m)), rng.uniform(-2, 2, (rows, m))


def _assert_close(got, want, scale, dtype, what):
    """``|got - want| <= 2 eps_out |want| + 8 eps_acc scale + tiny_out``, element by element."""
    eps_acc = _eps("float64" if dtype == "float64" else "float32")
    bound = 2 * _eps(dtype) * np.abs(want) + 8 * eps_acc * scale + _tiny(dtype)
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / bound, 0)), err.shape)
        pytest.fail(
            f"{what}: {int(bad.sum())} elements off; worst at {i}: got {got[i]!r}, "
            f"want {want[i]!r}, bound {bound[i]:.3g}"
        )


def _check_accuracy(runner, gated, dtype, rows, m, pad):
    """Run both passes on :func:`_values` and hold every element to its bound; nothing may
    be written past column M nor into ``a``."""
    a64, b64, dy64 = _values(rows, m, "accuracy")
    a, b, dy = (runner.rows(v, dtype, pad) for v in (a64, b64, dy64))
    exact = [runner.numpy(v) for v in (a, b, dy)]  # the rounded inputs' float64 values
    y, da, db = runner.run(gated, a, b, dy, dtype)
    wants = gated.reference(*exact)
    scales = gated.scales(*exact)
    for name, got, want, scale in zip(("y", "da", "db"), (y, da, db), wants, scales):
        _assert_close(runner.numpy(got), want, scale, dtype, f"{gated.name} {name}")
        assert np.isnan(runner.gap(got)).all(), f"{name}: a kernel wrote past column M"
    np.testing.assert_array_equal(runner.numpy(a), exact[0], err_msg="a must not be written")


# ---------------------------------------------------------------- accuracy

# (rows, M, row padding): one element; M = 1 over many rows; M odd; rows that do not fill
# a tile; aligned rows (16-byte vectors) with an aligned padding; M not a multiple of the
# vector width; rows wider than one tile along the row (several column tiles or blocks).
SHAPES = [(1, 1, 0), (300, 1, 1), (3, 5, 3), (37, 100, 4), (13, 64, 8), (4, 1001, 3), (3, 2500, 16)]


@pytest.mark.parametrize(("runner", "dtype"), RUNNER_DTYPES, indirect=["runner"])
@pytest.mark.parametrize(("rows", "m", "pad"), SHAPES)
def test_forward_backward_match_float64(runner, variant, gated, dtype, rows, m, pad):
    _check_accuracy(runner, gated, dtype, rows, m, pad)


def test_nan_and_inf_behave_as_torch(runner, gated):
    """NaN in any input propagates and ``a = +-inf`` gives torch's NaN and infinities (float64
    autograd of ``act(a) * b``): ``y(+inf) = +-inf``, ``y(-inf)``, ``da(+-inf)`` and
    ``db(-inf)`` NaN; ``a = +-1e20`` (whose square overflows float32) gives finite gradients.
    The finite results are held to :meth:`Gated.reference` (torch's float64
    GELU loses the lower tail to ``1 + tanh`` / ``1 + erf`` cancelling). ``inf * 0`` is an
    invalid operation to NumPy (the array_api backend, the Triton interpreter), which would
    warn: silenced here, results checked."""
    inf, nan = np.inf, np.nan
    a = np.array(
        [
            [inf, -inf, nan, 60.0, -60.0, 1e4, -1e4, 0.0, -0.0, 1.0, -1.2785, 3.0],
            [-inf, inf, 2.0, -2.0, nan, 0.5, -1e20, 1e20, -0.5, 7.0, -7.0, 0.0],
        ]
    )
    b = np.array(
        [
            [1.5, -1.5, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0, 1.0],
            [-0.5, 0.5, nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0],
        ]
    )
    dy = np.array(
        [
            [1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0],
            [1.0, -2.0, 1.0, 1.0, 1.0, nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    for dtype in runner.dtypes:
        if dtype == "float64":
            continue
        with np.errstate(over="ignore"):  # +-1e20 rounds to +-inf in float16
            ins = [runner.rows(v, dtype, pad=2) for v in (a, b, dy)]
        exact = [runner.numpy(v) for v in ins]
        with np.errstate(invalid="ignore"):
            y, da, db = runner.run(gated, *ins, dtype, pad=2)
            a_t, b_t = (torch.tensor(v, requires_grad=True) for v in exact[:2])
            y_t = gated.torch(a_t) * b_t
            y_t.backward(torch.tensor(exact[2]))
            torch_results = (y_t, a_t.grad, b_t.grad)
            wants = gated.reference(*exact)
            scales = gated.scales(*exact)
        for name, got, torch_result, want, scale in zip(
            ("y", "da", "db"), (y, da, db), torch_results, wants, scales
        ):
            got, oracle = runner.numpy(got), torch_result.detach().numpy()
            what = f"{gated.name} {name} {dtype}"
            np.testing.assert_array_equal(
                np.isnan(got), np.isnan(oracle), err_msg=f"{what}: NaN positions"
            )
            infinite = np.isinf(oracle)
            np.testing.assert_array_equal(
                got[infinite], oracle[infinite], err_msg=f"{what}: infinities"
            )
            finite = np.isfinite(oracle)
            _assert_close(got[finite], want[finite], scale[finite], dtype, what)


def test_large_gates_warn_nothing_and_saturate(runner, gated):
    """``|a|`` up to 1e4 (whose ``exp(|a|)`` overflows every float type; the tanh form's
    ``a^3`` overflows float16), in every dtype: no warning (the test configuration turns
    RuntimeWarning into errors), ``act(a) = a`` for large positive ``a``, ``-0`` for large
    negative ``a``, and the derivative 1 / 0 there."""
    a64 = np.array([[60.0, -60.0, 1e4, -1e4, 100.0, -100.0, 89.0, -89.0]])
    ones = np.ones_like(a64)
    for dtype in runner.dtypes:
        a, b, dy = (runner.rows(v, dtype, pad=0) for v in (a64, ones, ones))
        y, da, db = (runner.numpy(v) for v in runner.run(gated, a, b, dy, dtype, pad=0))
        exact = runner.numpy(a)
        positive = exact > 0
        what = f"{gated.name} {dtype}"
        np.testing.assert_array_equal(y[positive], exact[positive], err_msg=what)
        np.testing.assert_array_equal(da[positive], 1.0, err_msg=what)
        assert np.all(np.abs(y[~positive]) < 1e-24), what
        assert np.all(np.abs(da[~positive]) < 1e-22), what
        np.testing.assert_array_equal(db, y, err_msg=what)


# ---------------------------------------------------------------- aliasing


@pytest.mark.parametrize(("rows", "m", "pad"), [(9, 100, 4), (5, 37, 3), (6, 64, 0)])
def test_in_place_aliases_give_the_unaliased_results(runner, variant, gated, rows, m, pad):
    """``y`` the very same array as ``a`` or as ``b``; ``da`` or ``db`` the very same as ``dy``."""
    dtype = "float32"
    a64, b64, dy64 = _values(rows, m, "alias")
    module = runner.module(gated)

    def fresh():
        return [runner.rows(v, dtype, pad) for v in (a64, b64, dy64)]

    a, b, dy = fresh()
    y, da, db = (runner.numpy(v) for v in runner.run(gated, a, b, dy, dtype, pad))
    a, b, dy = fresh()
    gated.forward(module, a, a, b)
    np.testing.assert_array_equal(runner.numpy(a), y, err_msg="y is a")
    a, b, dy = fresh()
    gated.forward(module, b, a, b)
    np.testing.assert_array_equal(runner.numpy(b), y, err_msg="y is b")
    a, b, dy = fresh()
    db_out = runner.empty(rows, m, dtype, pad)
    gated.backward(module, dy, a, b, dy, db_out)
    np.testing.assert_array_equal(runner.numpy(dy), da, err_msg="da is dy")
    np.testing.assert_array_equal(runner.numpy(db_out), db, err_msg="db beside da is dy")
    a, b, dy = fresh()
    da_out = runner.empty(rows, m, dtype, pad)
    gated.backward(module, dy, a, b, da_out, dy)
    np.testing.assert_array_equal(runner.numpy(dy), db, err_msg="db is dy")
    np.testing.assert_array_equal(runner.numpy(da_out), da, err_msg="da beside db is dy")


def test_no_rows_and_empty_rows_write_nothing(runner, gated):
    module = runner.module(gated)
    for rows, m in ((0, 8), (3, 0)):
        a = runner.rows(np.zeros((rows, m)), "float32", pad=2)
        gated.forward(module, a, a, a)
        gated.backward(module, a, a, a, a, a)
        assert np.isnan(runner.gap(a)).all()


# ---------------------------------------------------------------- the normal CDF of array_api


@pytest.fixture(scope="module")
def mpmath():
    return pytest.importorskip("mpmath", reason="the exact normal CDF comes from mpmath")


def _cdf(a):
    """``normal_cdf`` of the array_api backend on a 1-D NumPy array."""
    scratch = array_api_gated.Scratch(np, 1, a.size, a.dtype)
    return np.array(_normal_cdf.normal_cdf(np, scratch.block(1), a[None, :])[0])


def test_normal_cdf_float32_erf_is_accurate_to_a_few_units(mpmath):
    """float32 (the ``tanh`` form) over a dense grid: ``Phi(a >= 0)`` to 3 units of float32's
    epsilon relatively, ``Phi`` to 3 units absolutely everywhere, and ``erf(x) = 2 Phi(sqrt(2) x)
    - 1`` to 8 units relatively where ``Phi`` does not round it away (``a >= 1/2``); each
    bound with room above the form's fitted error (1.9, 1.8 and 4.7 units) for
    ``exp``/``tanh`` differing by an ulp between NumPy builds."""
    a = np.concatenate([2.0 ** np.arange(-40.0, 0.0, 0.25), np.linspace(0.0, 12.0, 6001)[1:]])
    a = np.concatenate([-a[::-1], a]).astype(np.float32)
    got = _cdf(a).astype(np.float64)
    want = np.array([float(mpmath.ncdf(float(v))) for v in a])
    erf_want = np.array([float(mpmath.erf(float(v) / mpmath.sqrt(2))) for v in a])
    eps = 2.0**-24
    assert np.max(np.abs(got[a >= 0] / want[a >= 0] - 1)) <= 3 * eps
    assert np.max(np.abs(got - want)) <= 3 * eps
    half = a >= 0.5
    assert np.max(np.abs((2 * got[half] - 1) / erf_want[half] - 1)) <= 8 * eps


def test_normal_cdf_float64_tails_are_relative_to_their_size(mpmath):
    """float64 (the tail form) over a dense grid: ``Phi(-|a|)`` within 2.5e-15 relatively for
    ``|a| < 8``, within 10 units of ``eps (1 + a^2/2)`` out to its underflow (the rounding
    of ``a^2/2`` in the exponential), and ``Phi(|a|)`` within 2 units in the last place of 1 (``1 - tail`` rounds once)."""
    a = np.concatenate([np.linspace(0.0, 8.0, 8001), np.linspace(8.0, 38.0, 3001)[1:]])
    got = _cdf(-a)
    want = np.array([float(mpmath.ncdf(-v)) for v in a])
    rel = np.abs(got / want - 1)
    eps = 2.0**-53
    assert np.max(rel[a < 8]) <= 2.5e-15
    assert np.max(rel / (1 + a * a / 2)) <= 10 * eps
    upper = _cdf(a)
    assert np.max(np.abs(upper - (1 - want))) <= 4 * eps


# ---------------------------------------------------------------- planted bugs


def _catches(runner, gated, dtype) -> None:
    """The accuracy check of a mid-sized shape fails on the planted bug."""
    with pytest.raises(pytest.fail.Exception):
        _check_accuracy(runner, gated, dtype, 37, 100, 4)


def _gated(name: str) -> Gated:
    return next(g for g in ACTIVATIONS if g.name == name)


@pytest.mark.parametrize(
    ("old", "new", "activation"),
    [
        ("TANH_CUBE = 0.044715f", "TANH_CUBE = 0.04715f", "gelu_tanh"),  # a wrong tanh constant
        ("erfcf(-a * SQRT_HALF)", "erfcf(a * SQRT_HALF)", "gelu"),  # the erf argument's sign
        ("slope = s * (z >= 0.0f ? e * r : r)", "slope = s * e * r", "silu"),  # one tail only
    ],
)
def test_a_bug_planted_in_the_cuda_c_is_caught(tmp_path, monkeypatch, old, new, activation):
    gated = _gated(activation)
    module = _CUPY[gated.primitive]
    source = module.SOURCE.read_text()
    header = (module.SOURCE.parent / "gated.cuh").read_text()
    if old in source:
        source = source.replace(old, new, 1)
    else:
        assert old in header, f"{old!r} is not in {module.SOURCE.name} nor gated.cuh"
        (tmp_path / "gated.cuh").write_text(header.replace(old, new, 1))
    planted = tmp_path / module.SOURCE.name
    planted.write_text(source)
    monkeypatch.setattr(module, "SOURCE", planted)
    runner = _NumpyRunner("cupy", "cupy", _CUPY, _CUPY_DTYPES)
    with cudacpu.emulate():
        _catches(runner, gated, "float32")


@pytest.mark.skipif(
    not _TRITON or _DEVICE == "cuda", reason="planting by patching a global needs the interpreter"
)
@pytest.mark.parametrize(
    ("name", "value", "activation"),
    [
        ("_SQRT_HALF", 0.7, "gelu"),  # erf's argument scaled wrongly
        ("_TANH_CUBE", 0.04715, "gelu_tanh"),  # a wrong tanh constant
    ],
)
def test_a_bug_planted_in_the_triton_kernels_is_caught(monkeypatch, name, value, activation):
    monkeypatch.setattr(triton_gated, name, tl.constexpr(value))
    runner = _TorchRunner("triton", "triton", {"geglu": triton_geglu}, _CUPY_DTYPES)
    _catches(runner, _gated(activation), "float32")


@pytest.mark.parametrize(
    ("name", "index", "factor", "activation", "dtype"),
    [
        ("_TANH_COEFFICIENTS", 1, 1.0001, "gelu", "float32"),  # a coefficient 1e-4 off
        ("_TAIL_COEFFICIENTS", 10, -1.0, "gelu", "float64"),  # a sign lost
    ],
)
def test_a_bug_planted_in_the_array_api_cdf_is_caught(
    monkeypatch, name, index, factor, activation, dtype
):
    coefficients = list(getattr(_normal_cdf, name))
    coefficients[index] *= factor
    monkeypatch.setattr(_normal_cdf, name, tuple(coefficients))
    runner = _NumpyRunner("array_api", "array_api", _ARRAY_API, ())
    _catches(runner, _gated(activation), dtype)


# ---------------------------------------------------------------- launch geometry


@pytest.mark.skipif(not _TRITON, reason="triton (with torch) is not installed")
@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("m", [1, 5, 64, 100, 1001, 2048, 4096, 65536, 151936])
def test_triton_tile_config(pass_, itemsize, m):
    tile_rows, block_m, warps = triton_gated.tile_config(m, itemsize, pass_)
    for n in (tile_rows, block_m, warps):
        assert n >= 1 and n & (n - 1) == 0, "powers of two"
    assert (block_m * itemsize) % 16 == 0, "a tile's row spans whole 16-byte vectors"
    assert block_m * itemsize <= max(triton_gated.COLUMN_BYTES, 16)
    assert tile_rows * block_m * itemsize == triton_gated.TILE_BYTES[pass_]
    per_thread = tile_rows * block_m * itemsize // (32 * warps)
    assert per_thread == 16 * triton_gated.VECTORS_PER_THREAD[pass_], "whole 16-byte vectors"
    if m * itemsize <= triton_gated.COLUMN_BYTES:
        assert block_m >= m, "a short row fits one tile"


@pytest.mark.parametrize(
    ("rows", "m", "v"),
    [(1, 1, 1), (300, 1, 1), (7, 5, 1), (13, 64, 4), (3, 2500, 8), (2, 10**6, 4)],
)
def test_cupy_geometry_covers_every_element(rows, m, v):
    u = _rows.cache(v)
    (gx, gy), (x, y) = cupy_gated._geometry(rows, m, v, u)
    assert x * y == cupy_gated.THREADS and x & (x - 1) == 0
    assert gx * y >= rows > (gx - 1) * y, "the blocks cover the rows, none idle"
    assert gy <= cupy_gated.MAX_COLUMN_BLOCKS
    steps = -(-m // (v * u))
    assert x * gy >= min(steps, x * cupy_gated.MAX_COLUMN_BLOCKS)
    assert x <= max(steps, 1) * 2, "no more threads along a row than twice its steps"


def test_cupy_takes_128_bit_accesses_where_aligned_and_runs_mixed_dtypes_in_float32():
    runner = _NumpyRunner("cupy", "cupy", _CUPY, ())
    aligned = [runner.rows(np.ones((4, 64)), "bfloat16", pad=8) for _ in range(3)]
    assert _rows.vector(aligned) == 8
    assert _rows.vector([*aligned, runner.rows(np.ones((4, 64)), "bfloat16", pad=3)]) == 1
    assert _rows.vector([runner.rows(np.ones((4, 63)), "bfloat16", pad=1)]) == 1
    assert len(cupy_swiglu.name_expressions()) == 12, "3 dtypes x 2 widths x 2 passes"
    assert len(cupy_geglu.name_expressions()) == 24, "and x 2 GELU forms"
    x32, x16 = np.ones((2, 8), np.float32), np.ones((2, 8), np.float16)
    with cudacpu.emulate():
        mixed, same = np.full((2, 8), np.nan, np.float32), np.full((2, 8), np.nan, np.float32)
        cupy_swiglu.forward(mixed, x16, x32)
        cupy_swiglu.forward(same, x32, x32)
        np.testing.assert_array_equal(mixed, same)  # the float16 gate's values, in float32
        with pytest.raises(TypeError, match="cupy geglu: a has dtype float64"):
            cupy_geglu.backward(*(np.ones((2, 8)),) * 5, approximate="none")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("module", [cupy_swiglu, cupy_geglu], ids=["swiglu", "geglu"])
def test_nvrtc_builds_every_instantiation_with_128_bit_rows(module, arch):
    report = nvrtc_report()
    entry = report.compile_source(module.SOURCE, arch)
    assert entry["ok"], entry["log"]
    assert not entry["warnings"], entry["log"]
    assert set(entry["kernels"]) == set(module.name_expressions())
    for name, k in entry["kernels"].items():
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
        # <T, Act, V, U> with V * sizeof(T) == 16: every row access is 128 bits wide
        if re.search(r"<(float,\w+,4|__(half|nv_bfloat16),\w+,8),\d+>$", name):
            assert k["global_load_bits"] == 128 and k["global_store_bits"] == 128, (name, k)


SANITIZED_RUN = """
import numpy as np, ml_dtypes
from xpkernels.backends.cupy import geglu, swiglu
from xpkernels.testing import cudacpu
rng = np.random.default_rng(0)
forms = [(swiglu, {}), (geglu, {"approximate": "none"}), (geglu, {"approximate": "tanh"})]
with cudacpu.emulate():
    for dtype, m in ((np.float32, 64), (ml_dtypes.bfloat16, 37)):  # vector and scalar paths
        a, b, dy = (cudacpu.empty((3, m), dtype) for _ in range(3))
        for v in (a, b, dy):
            v[...] = rng.standard_normal((3, m))
        for module, options in forms:
            y, da, db = (cudacpu.empty((3, m), dtype) for _ in range(3))
            module.forward(y, a, b, **options)
            module.backward(dy, a, b, da, db, **options)
            aliased = dy.copy()
            module.backward(aliased, a, b, aliased, db, **options)
            assert np.isfinite(y.astype(np.float32)).all()
print("clean")
"""


@pytest.mark.parametrize("kind", ["address", "thread"])
def test_cupy_kernels_run_clean_under_sanitizers(kind):
    assert_clean_under_sanitizer(SANITIZED_RUN, kind)
