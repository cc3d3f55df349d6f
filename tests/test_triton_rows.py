"""The Triton row kernels (rms_norm, layer_norm, softmax) beyond the generic conformance templates.

The templates run the triton backend through the front files; these tests
drive the backend modules directly, on the 2-D views the fronts pass, to pin
down what the templates cannot see: both kernel variants (fused and
streaming, the latter forced on small rows by shrinking the launch table),
row strides, aliasing, the per-program partial sums and their reduction,
the launch-configuration table, and the interpreter guard.

They run on CUDA when torch sees a GPU, else through the Triton interpreter
(``TRITON_INTERPRET=1`` is set here before the kernels are imported).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: no Triton backend")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: no Triton backend", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for triton", allow_module_level=True)

from xpkernels.backends.triton import _common
from xpkernels.backends.triton import layer_norm as ln
from xpkernels.backends.triton import rms_norm as rms
from xpkernels.backends.triton import softmax as sm

from xpkernels.testing import references as ref
from xpkernels.testing.harness import max_error
from xpkernels.testing.tolerances import floor

EPS = 1e-5
DTYPES = ("float32", "bfloat16")


@pytest.fixture(params=["fused", "fused-row-tiles", "streaming"])
def variant(request, monkeypatch):
    """Which kernel family runs on the small test rows.

    ``fused``: the shipped table (several short rows per tile).
    ``fused-row-tiles``: one row per tile, so a backward program loops over
    many tiles. ``streaming``: rows longer than 32 elements are streamed in
    chunks of 32, so the 100-long test rows cross four chunks, the last one partial.
    """
    if request.param == "fused-row-tiles":
        monkeypatch.setitem(_common.TILE_BYTES, "forward", 16)
        monkeypatch.setitem(_common.TILE_BYTES, "backward", 16)
    if request.param == "streaming":
        monkeypatch.setitem(_common.FUSED_LIMIT, "forward", 32)
        monkeypatch.setitem(_common.FUSED_LIMIT, "backward", 32)
        monkeypatch.setitem(_common.STREAM_BLOCK, "forward", 32)
        monkeypatch.setitem(_common.STREAM_BLOCK, "backward", 32)
    for pass_ in ("forward", "backward"):
        config = _common.row_config(100, 4, pass_)
        assert config.streaming == (request.param == "streaming")
        if request.param != "streaming":
            assert (config.rows == 1) == (request.param == "fused-row-tiles")
    return request.param


def _gen(*seed):
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, seed)).encode()))


def _randn(shape, seed, scale=1.0, shift=0.0):
    return torch.randn(shape, generator=_gen(*seed), dtype=torch.float64) * scale + shift


def _strided(values, dtype, pad=3, fill=float("nan")):
    """``values`` (2-D) on the device as ``dtype``, in a buffer of rows ``pad`` elements longer."""
    rows, m = values.shape
    buf = torch.full((rows, m + pad), fill, dtype=getattr(torch, dtype), device=DEVICE)
    view = buf[:, :m]
    view.copy_(values)
    return view


def _empty_strided(rows, m, dtype, pad=5):
    return _strided(torch.full((rows, m), float("nan")), dtype, pad=pad)


def _vector(n, fill=float("nan"), stride=1, dtype=torch.float32):
    """A length-``n`` vector with the given element stride, pre-filled."""
    return torch.full((n * stride,), fill, dtype=dtype, device=DEVICE)[::stride]


def _exact(a):
    return a.detach().to("cpu", torch.float64)


def _numpy(a):
    return _exact(a).numpy()


def _assert_close(got, want, dtype, pass_, what):
    """``got`` within the conformance floor of ``dtype`` (the three row primitives share them).

    These rows are well conditioned: the naive same-dtype error lies below the floors.
    """
    err = max_error(_numpy(got), _numpy(want))
    tol = floor("rms_norm", pass_, dtype)
    assert err <= tol, f"{what}: error {err:.3g} > {tol:.3g}"
    if got.dim() == 2 and got._base is not None:
        gap = got._base[:, got.shape[1] :]
        assert torch.isnan(gap).all(), f"{what}: a kernel wrote between rows, past column M"


# ---------------------------------------------------------------- float64 references
# xpkernels.testing.references on the float64 values of the torch inputs, back as torch.


def _rms_ref(x, w, offset):
    y, rstd = ref.rms_norm(_numpy(x), _numpy(w), eps=EPS, offset=offset)
    return torch.from_numpy(y), torch.from_numpy(rstd)


def _rms_ref_backward(dy, x, w, offset):
    dx, dw = ref.rms_norm_backward(_numpy(x), _numpy(w), _numpy(dy), eps=EPS, offset=offset)
    return torch.from_numpy(dx), torch.from_numpy(dw)


def _ln_ref(x, w, b):
    y, mean, rstd = ref.layer_norm(_numpy(x), _numpy(w), _numpy(b), eps=EPS)
    return torch.from_numpy(y), torch.from_numpy(mean), torch.from_numpy(rstd)


def _ln_ref_backward(dy, x, w):
    dx, dw, db = ref.layer_norm_backward(_numpy(x), _numpy(w), _numpy(dy), eps=EPS)
    return torch.from_numpy(dx), torch.from_numpy(dw), torch.from_numpy(db)


def _softmax_ref(x):
    return torch.from_numpy(ref.softmax(_numpy(x)))


def _softmax_ref_backward(dy, y):
    return torch.from_numpy(ref.softmax_backward(_numpy(y), _numpy(dy)))


SHAPES = [(1, 1), (3, 5), (37, 100)]


# ---------------------------------------------------------------- forward / backward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,m", SHAPES)
def test_rms_norm_forward_backward(variant, dtype, rows, m):
    x = _strided(_randn((rows, m), ("x", m), 2.0), dtype)
    dy = _strided(_randn((rows, m), ("dy", m)), dtype)
    w = _randn((m,), ("w", m)).to(DEVICE, getattr(torch, dtype))
    x64, w64, dy64 = _exact(x), _exact(w), _exact(dy)
    y, rstd = _empty_strided(rows, m, dtype), _vector(rows, stride=2)
    rms.forward(y, x, w, rstd, eps=EPS, offset=1.0)
    y_ref, rstd_ref = _rms_ref(x64, w64, 1.0)
    _assert_close(y, y_ref, dtype, "forward", "y")
    _assert_close(rstd, rstd_ref, "float32", "forward", "rstd")

    dx = _empty_strided(rows, m, dtype)
    partial = torch.full((rms.partials(rows, m, x), m), float("nan"), device=DEVICE)
    dw = torch.full((m,), float("nan"), dtype=w.dtype, device=DEVICE)
    rms.backward(dy, x, w, rstd_ref.float().to(DEVICE), dx, partial, offset=1.0, accumulate=False)
    rms.reduce_partials(partial, dw)
    dx_ref, dw_ref = _rms_ref_backward(dy64, x64, w64, 1.0)
    _assert_close(dx, dx_ref, dtype, "backward", "dx")
    _assert_close(dw, dw_ref, dtype, "backward", "dw")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,m", SHAPES)
@pytest.mark.parametrize("affine", ["w+b", "none"])
def test_layer_norm_forward_backward(variant, dtype, rows, m, affine):
    x64, dy64 = _randn((rows, m), ("x", m), 2.0, 0.5), _randn((rows, m), ("dy", m))
    x, dy = _strided(x64, dtype), _strided(dy64, dtype)
    if affine == "w+b":
        w = _randn((m,), ("w", m)).to(DEVICE, getattr(torch, dtype))
        b = _randn((m,), ("b", m)).to(DEVICE, getattr(torch, dtype))
        w64, b64 = _exact(w), _exact(b)
    else:
        w = b = None
        w64, b64 = torch.ones(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    x64, dy64 = _exact(x), _exact(dy)
    y, mean, rstd = _empty_strided(rows, m, dtype), _vector(rows, stride=3), _vector(rows, stride=2)
    ln.forward(y, x, w, b, mean, rstd, eps=EPS)
    y_ref, mean_ref, rstd_ref = _ln_ref(x64, w64, b64)
    _assert_close(y, y_ref, dtype, "forward", "y")
    _assert_close(mean, mean_ref, "float32", "forward", "mean")
    _assert_close(rstd, rstd_ref, "float32", "forward", "rstd")

    dx = _empty_strided(rows, m, dtype)
    p = ln.partials(rows, m, x)
    dw_partial = None if w is None else torch.full((p, m), float("nan"), device=DEVICE)
    db_partial = torch.full((p, m), float("nan"), device=DEVICE)
    mean32, rstd32 = mean_ref.float().to(DEVICE), rstd_ref.float().to(DEVICE)
    ln.backward(dy, x, w, mean32, rstd32, dx, dw_partial, db_partial, accumulate=False)
    dx_ref, dw_ref, db_ref = _ln_ref_backward(dy64, x64, w64)
    _assert_close(dx, dx_ref, dtype, "backward", "dx")
    db = torch.full((m,), float("nan"), device=DEVICE)
    ln.reduce_partials(db_partial, db)
    _assert_close(db, db_ref, dtype, "backward", "db")
    if w is not None:
        dw = torch.full((m,), float("nan"), dtype=w.dtype, device=DEVICE)
        ln.reduce_partials(dw_partial, dw)
        _assert_close(dw, dw_ref, dtype, "backward", "dw")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,m", SHAPES)
def test_softmax_forward_backward(variant, dtype, rows, m):
    x64, dy64 = _randn((rows, m), ("x", m), 3.0), _randn((rows, m), ("dy", m))
    x, dy = _strided(x64, dtype), _strided(dy64, dtype)
    y = _empty_strided(rows, m, dtype)
    sm.forward(y, x)
    y_ref = _softmax_ref(x)
    _assert_close(y, y_ref, dtype, "forward", "y")
    y_in = _strided(y_ref, dtype)
    dx = _empty_strided(rows, m, dtype)
    sm.backward(y_in, dy, dx)
    _assert_close(dx, _softmax_ref_backward(_exact(dy), _exact(y_in)), dtype, "backward", "dx")


def test_softmax_rows_with_leading_minus_inf(variant):
    """Masked logits: whole leading chunks of ``-inf`` must not poison the running sum."""
    x64 = _randn((6, 100), ("mask",), 2.0)
    x64[:, :40] = float("-inf")
    x64[1, 60:] = float("-inf")
    x = _strided(x64, "float32")
    y = _empty_strided(6, 100, "float32")
    sm.forward(y, x)
    want = _softmax_ref(x)
    assert not torch.isnan(_exact(y)).any()
    _assert_close(y, want, "float32", "forward", "y")


def test_layer_norm_large_mean_keeps_precision(variant):
    """A row mean far above the spread: centred variance, no cancellation."""
    x64 = _randn((4, 100), ("big-mean",), 1.0, 1000.0)
    x = _strided(x64, "float32")
    y, mean, rstd = _empty_strided(4, 100, "float32"), _vector(4), _vector(4)
    ln.forward(y, x, None, None, mean, rstd, eps=EPS)
    _, mean_ref, rstd_ref = _ln_ref(
        x, torch.ones(100, dtype=torch.float64), torch.zeros(100, dtype=torch.float64)
    )
    assert float(((_exact(rstd) - rstd_ref) / rstd_ref).abs().max()) <= 1e-4
    _assert_close(mean, mean_ref, "float32", "forward", "mean")


# ---------------------------------------------------------------- aliasing


def test_outputs_may_alias_inputs(variant):
    """``y`` aliasing ``x`` and ``dx`` aliasing ``dy`` give exactly the unaliased results."""
    rows, m = 9, 100
    x64, dy64, w64 = _randn((rows, m), ("ax",)), _randn((rows, m), ("ady",)), _randn((m,), ("aw",))
    w, b = w64.float().to(DEVICE), (w64 * 0.5).float().to(DEVICE)
    rstd, mean = _vector(rows), _vector(rows)
    for name, run_forward in (
        ("rms_norm", lambda y, x: rms.forward(y, x, w, rstd, eps=EPS, offset=0.0)),
        ("layer_norm", lambda y, x: ln.forward(y, x, w, b, mean, rstd, eps=EPS)),
        ("softmax", lambda y, x: sm.forward(y, x)),
    ):
        x = _strided(x64, "float32")
        y = _empty_strided(rows, m, "float32")
        run_forward(y, x)
        run_forward(x, x)
        assert torch.equal(x, y), f"{name} forward with y aliasing x"
    ck_rstd = torch.from_numpy(ref.rms_norm_rstd(_numpy(x64), EPS)).float().to(DEVICE)
    ck_mean = torch.from_numpy(ref.layer_norm_stats(_numpy(x64), EPS)[0]).float().to(DEVICE)
    y_soft = _softmax_ref(x64).float().to(DEVICE)
    x = _strided(x64, "float32")

    def rms_backward(dy, dx):
        rms.backward(dy, x, w, ck_rstd, dx, None, offset=0.0, accumulate=False)

    def ln_backward(dy, dx):
        ln.backward(dy, x, w, ck_mean, ck_rstd, dx, None, None, accumulate=False)

    def softmax_backward(dy, dx):
        sm.backward(y_soft, dy, dx)

    for run_backward in (rms_backward, ln_backward, softmax_backward):
        dy = _strided(dy64, "float32")
        dx = _empty_strided(rows, m, "float32")
        run_backward(dy, dx)
        run_backward(dy, dy)
        assert torch.equal(dy, dx), f"{run_backward.__name__} with dx aliasing dy"


# ---------------------------------------------------------------- partial sums


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_partials_overwrite_every_row_then_accumulate(variant, op):
    """More partial rows than programs with work: the idle rows are zeroed, and a
    second row group with ``accumulate=True`` adds to the first."""
    m = 100
    first, second = _randn((3, m), ("g1",)), _randn((5, m), ("g2",))
    dy1, dy2 = _randn((3, m), ("d1",)), _randn((5, m), ("d2",))
    w = _randn((m,), ("pw",)).float().to(DEVICE)
    p = 7
    partial = torch.full((p, m), float("nan"), device=DEVICE)
    db_partial = torch.full((p, m), float("nan"), device=DEVICE)
    for k, (x64, dy64) in enumerate(((first, dy1), (second, dy2))):
        x, dy = _strided(x64, "float32"), _strided(dy64, "float32")
        dx = _empty_strided(*x64.shape, "float32")
        rstd = torch.rsqrt(x64.var(-1, correction=0) + EPS).float().to(DEVICE)
        if op == "rms_norm":
            rstd = torch.rsqrt((x64 * x64).mean(-1) + EPS).float().to(DEVICE)
            rms.backward(dy, x, w, rstd, dx, partial, offset=0.0, accumulate=k > 0)
        else:
            mean = x64.mean(-1).float().to(DEVICE)
            ln.backward(dy, x, w, mean, rstd, dx, partial, db_partial, accumulate=k > 0)
        if k == 0:
            assert not torch.isnan(partial).any(), "every partial row must be overwritten"
    x_all, dy_all = torch.cat([first, second]), torch.cat([dy1, dy2])
    dw = torch.full((m,), float("nan"), device=DEVICE)
    rms.reduce_partials(partial, dw)
    if op == "rms_norm":
        _, dw_ref = _rms_ref_backward(dy_all, x_all, _exact(w), 0.0)
    else:
        _, dw_ref, db_ref = _ln_ref_backward(dy_all, x_all, _exact(w))
        db = torch.full((m,), float("nan"), device=DEVICE)
        ln.reduce_partials(db_partial, db)
        _assert_close(db, db_ref, "float32", "backward", "db")
    _assert_close(dw, dw_ref, "float32", "backward", "dw")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_zero_rows_still_overwrite_partials(op):
    """A backward over no rows leaves zero partial sums, so ``dw`` reduces to 0."""
    x = torch.empty((0, 24), device=DEVICE)
    partial = torch.full((3, 24), float("nan"), device=DEVICE)
    none = torch.empty((0,), device=DEVICE)
    w = torch.ones(24, device=DEVICE)
    if op == "rms_norm":
        rms.backward(x, x, w, none, x, partial, offset=0.0, accumulate=False)
    else:
        ln.backward(x, x, w, none, none, x, partial, None, accumulate=False)
    assert torch.equal(partial, torch.zeros_like(partial))


def test_reduce_partials_strided_into_half():
    """Column-strided partials reduce in float32 into a strided float16 ``out``."""
    partial64 = _randn((150, 37), ("red",))
    partial = partial64.t().contiguous().float().to(DEVICE).t()
    assert partial.stride(1) != 1
    out = _vector(150, stride=2, dtype=torch.float16)[:37]
    want = _exact(partial).sum(0)
    rms.reduce_partials(partial, out)
    assert out.dtype == torch.float16
    assert max_error(_numpy(out), _numpy(want)) <= floor("rms_norm", "forward", "float16")


# ---------------------------------------------------------------- launch configuration


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("m", [1, 7, 96, 1000, 4096, 8192, 8193, 16384, 16385, 65536, 151936])
def test_row_config_table(pass_, itemsize, m):
    config = _common.row_config(m, itemsize, pass_)
    assert config.num_warps in (1, 2, 4, 8, 16)
    assert config.block_m & (config.block_m - 1) == 0
    assert config.rows & (config.rows - 1) == 0
    assert (config.block_m * itemsize) % _common.VECTOR_BYTES == 0, "128-bit vector accesses"
    assert config.n_chunks * config.block_m >= m > (config.n_chunks - 1) * config.block_m
    tile = config.rows * config.block_m
    per_thread = tile // (32 * config.num_warps)
    most = 2 * _common.ELEMENTS_PER_THREAD[pass_]
    assert per_thread <= most or config.num_warps == _common.MAX_WARPS
    padded = 1 << max(m - 1, 0).bit_length()
    if padded <= _common.FUSED_LIMIT[pass_]:
        assert not config.streaming and config.block_m >= m
        assert tile * itemsize <= max(_common.TILE_BYTES[pass_], config.block_m * itemsize)
    else:
        assert config.streaming and config.block_m == _common.STREAM_BLOCK[pass_]


def test_bench_shapes_choose_expected_variants():
    """The H200 benchmark rows: 4096 fits in registers, 65536 streams."""
    assert not _common.row_config(4096, 2, "forward").streaming
    assert not _common.row_config(4096, 4, "backward").streaming
    assert _common.row_config(65536, 2, "forward").streaming
    assert _common.row_config(65536, 4, "backward").streaming


@pytest.mark.parametrize("rows,m", [(1, 8), (5, 1000), (10_000, 64), (10_000, 40_000)])
def test_partials_count(rows, m):
    x = torch.empty((1, m), device=DEVICE)
    p = rms.partials(rows, m, x)
    tiles = _common.row_config(m, 4, "backward").tiles(rows)
    assert 1 <= p <= tiles
    assert ln.partials(rows, m, x) == p
    if DEVICE == "cpu":
        assert p == min(tiles, _common.CPU_PROGRAMS)


@pytest.mark.parametrize(
    "registers,warps,resident",
    [(98, 16, 1), (64, 16, 2), (65, 16, 1), (40, 4, 2), (255, 16, 1), (128, 8, 2)],
)
def test_resident_programs_from_registers(registers, warps, resident):
    """Registers round up to units of 8 per thread; 65536 per SM; capped at MAX_PROGRAMS_PER_SM."""
    assert _common.resident_programs(registers, warps) == resident


# ---------------------------------------------------------------- interpreter guard


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter guard concerns CPU tensors")
def test_cpu_tensors_without_interpreter_raise_backend_error():
    """Kernels defined without TRITON_INTERPRET=1 refuse CPU tensors: a BackendError says why."""
    code = (
        "import torch\n"
        "from xpkernels.backends.triton import rms_norm\n"
        "from xpkernels.registry import BackendError\n"
        "x = torch.ones(2, 8)\n"
        "try:\n"
        "    rms_norm.forward(x, x, torch.ones(8), None, eps=1e-6, offset=0.0)\n"
        "except BackendError as e:\n"
        "    print('BackendError:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "BackendError:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_partials_over_several_cast_blocks(dtype):
    """Every column of a row wider than one cast block (and a partial past the last) is its
    float32 sum in ``out``'s dtype: straight into float32, through row 0 of ``partial`` into
    a 16-bit ``out``."""
    m = _common.CAST_BLOCK + 5
    partial = _randn((_common.REDUCE_BLOCK_P + 6, m), ("red-cast", m)).float().to(DEVICE)
    want = _exact(partial).sum(0)
    out = _vector(m, dtype=getattr(torch, dtype))
    rms.reduce_partials(partial, out)
    assert not torch.isnan(out).any()
    assert max_error(_numpy(out), _numpy(want)) <= floor("rms_norm", "forward", dtype)
