"""The Triton RoPE kernel (``xpkernels.backends.triton.rope``) driven directly on ``(B, H, S, D)`` views.

Against the float64 reference ``xpkernels.testing.references.rope``: float32,
float16 and bfloat16; both pair layouts (half rotation, interleaved); partial
(``R < D``, an odd number of pairs) and full rotary dims; odd ``S`` and ``H``;
one table broadcast over the batch (batch stride 0) and per-batch tables of
another dtype; ``position_ids`` None, int32 and int64; BSHD views of padded
buffers, whose NaN sentinels must survive; in place; forward then backward
giving ``x`` back; launch tiles shrunk so that queries and heads cross many
partial tiles; empty arrays launching nothing.

Tolerances, per element of a rotated pair: twice the bound of the float32
rotation and the output's rounding, :math:`(4\\,\\epsilon_{32} + 2\\,\\epsilon_{out})
(|x_1| + |x_2|)(|c| + |s|)`, plus the output's smallest normal (flushed
subnormals); the columns past the rotary dim are copies, held to equality.

They run on CUDA when torch sees a GPU, else through the Triton interpreter
(``TRITON_INTERPRET=1`` is set here before the kernels are imported).
"""

from __future__ import annotations

import importlib.util
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

import triton
from xpkernels.backends.triton import rope

from xpkernels.testing import references as ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POSITIONS = (None, torch.int32, torch.int64)
EPS32 = torch.finfo(torch.float32).eps


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _np(t):
    return None if t is None else t.double().cpu().numpy()


def _index(t):
    return None if t is None else t.cpu().numpy().astype(np.int64)


def _x(shape, dtype, seed):
    return torch.randn(shape, generator=_gen(seed), dtype=torch.float64).to(dtype).to(DEVICE)


def _tables(batch, p, r2, *, per_batch, dtype, seed=1):
    """``(B, P, R2)`` cos and sin of the angles ``p * theta_i``: one table expanded over the
    batch (batch stride 0), or a table per batch, each turned by its own random offsets."""
    theta = 10000.0 ** (-torch.arange(r2, dtype=torch.float64) / max(r2, 1))
    angles = torch.arange(p, dtype=torch.float64)[:, None] * theta
    if per_batch:
        angles = angles + 6.0 * torch.rand((batch, 1, r2), generator=_gen(seed), dtype=angles.dtype)
    else:
        angles = angles[None]
    cos, sin = (f(angles).to(dtype).to(DEVICE).expand(batch, p, r2) for f in (torch.cos, torch.sin))
    return cos, sin


def _positions(batch, seq, p, dtype, seed=2):
    if dtype is None:
        return None
    return torch.randint(0, p, (batch, seq), generator=_gen(seed), dtype=dtype).to(DEVICE)


def _scale(x, cos, sin, position_ids, interleaved):
    """``(|x1| + |x2|)(|c| + |s|)`` at each rotated column of ``x`` (float64 arrays)."""
    b, _, s, _ = x.shape
    r2 = cos.shape[-1]
    pos = np.broadcast_to(np.arange(s), (b, s)) if position_ids is None else position_ids
    rows = np.arange(b)[:, None]
    table = (np.abs(cos[rows, pos]) + np.abs(sin[rows, pos]))[:, None]
    pairs = np.arange(r2)
    first, second = (2 * pairs, 2 * pairs + 1) if interleaved else (pairs, pairs + r2)
    magnitude = (np.abs(x[..., first]) + np.abs(x[..., second])) * table
    out = np.empty((*x.shape[:-1], 2 * r2))
    out[..., first] = magnitude
    out[..., second] = magnitude
    return out


def _check(got, x, cos, sin, position_ids, *, interleaved, inverse):
    """``got`` (``rope`` of ``x``, or its inverse) against the float64 reference."""
    x64, cos64, sin64, pos = _np(x), _np(cos), _np(sin), _index(position_ids)
    want = ref.rope(x64, cos64, sin64, position_ids=pos, interleaved=interleaved, inverse=inverse)
    r = 2 * cos.shape[-1]
    got64 = _np(got)
    np.testing.assert_array_equal(got64[..., r:], x64[..., r:])
    info = torch.finfo(got.dtype)
    tol = (4 * EPS32 + 2 * info.eps) * _scale(x64, cos64, sin64, pos, interleaved) + info.tiny
    err = np.abs(got64[..., :r] - want[..., :r])
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("positions", POSITIONS, ids=["pos-none", "pos-int32", "pos-int64"])
@pytest.mark.parametrize(
    ("per_batch", "table_dtype"),
    [(False, torch.float32), (True, torch.bfloat16)],
    ids=["shared-f32-table", "per-batch-bf16-table"],
)
@pytest.mark.parametrize("r2", [8, 3], ids=["full", "partial"])
def test_both_passes_match_the_reference(dtype, interleaved, positions, per_batch, table_dtype, r2):
    B, H, S, D, P = 2, 3, 5, 16, 7
    x = _x((B, H, S, D), dtype, seed=0)
    cos, sin = _tables(B, P, r2, per_batch=per_batch, dtype=table_dtype)
    pos = _positions(B, S, P, positions)
    out = torch.full_like(x, float("nan"))
    rope.forward(out, x, cos, sin, pos, interleaved=interleaved)
    _check(out, x, cos, sin, pos, interleaved=interleaved, inverse=False)
    dx = torch.full_like(x, float("nan"))
    rope.backward(dx, x, cos, sin, pos, interleaved=interleaved)
    _check(dx, x, cos, sin, pos, interleaved=interleaved, inverse=True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("r2", [4, 3], ids=["full", "partial"])
def test_small_tiles_cross_partial_tiles_of_queries_and_heads(monkeypatch, interleaved, r2):
    """Two queries x two heads per tile: ``S = 7`` and ``H = 5`` end in partial tiles."""
    monkeypatch.setattr(rope, "tile_config", lambda *args: (2, 2, 1))
    B, H, S, D, P = 3, 5, 7, 8, 9
    x = _x((B, H, S, D), torch.bfloat16, seed=3)
    cos, sin = _tables(B, P, r2, per_batch=True, dtype=torch.float32)
    pos = _positions(B, S, P, torch.int64)
    out = torch.full_like(x, float("nan"))
    rope.forward(out, x, cos, sin, pos, interleaved=interleaved)
    _check(out, x, cos, sin, pos, interleaved=interleaved, inverse=False)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_bshd_views_of_padded_buffers(interleaved, in_place, pass_):
    """``x`` and ``out`` are BSHD views of NaN-padded ``(B, S, H + 1, D + 8)`` buffers, the
    tables views of padded buffers with different row strides, the positions a transpose:
    the result matches the reference and every element outside the views keeps its NaN."""
    B, H, S, D, R2, P = 2, 3, 5, 12, 5, 6
    dtype = torch.float16
    nan = float("nan")

    def padded():
        buffer = torch.full((B, S, H + 1, D + 8), nan, dtype=dtype, device=DEVICE)
        return buffer, buffer[:, :, :H, :D].transpose(1, 2)

    x_buffer, x = padded()
    x.copy_(_x((B, H, S, D), dtype, seed=4))
    x_before = x.clone()
    cos_rows, sin_rows = _tables(1, P, R2, per_batch=False, dtype=torch.float32)
    cos = torch.full((1, P + 2, R2 + 3), nan, device=DEVICE)
    sin = torch.full((1, P, R2 + 6), nan, device=DEVICE)
    cos[:, :P, :R2], sin[:, :, :R2] = cos_rows, sin_rows
    cos, sin = cos[:, :P, :R2].expand(B, P, R2), sin[:, :, :R2].expand(B, P, R2)
    pos = _positions(S, B, P, torch.int32).T
    assert x.stride() != x.contiguous().stride() and pos.stride() == (1, B)
    out_buffer, out = (x_buffer, x) if in_place else padded()
    reference_buffer = _bits(x_buffer).clone()
    getattr(rope, pass_)(out, x, cos, sin, pos, interleaved=interleaved)
    _check(out, x_before, cos, sin, pos, interleaved=interleaved, inverse=pass_ == "backward")
    outside = torch.ones_like(out_buffer, dtype=torch.bool)
    outside[:, :, :H, :D] = False
    assert torch.isnan(out_buffer[outside]).all()
    if not in_place:
        assert torch.equal(_bits(x_buffer), reference_buffer)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_in_place_equals_out_of_place(interleaved, pass_):
    B, H, S, D, R2, P = 2, 3, 5, 16, 3, 5
    x = _x((B, H, S, D), torch.bfloat16, seed=5)
    cos, sin = _tables(B, P, R2, per_batch=True, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    getattr(rope, pass_)(out, x, cos, sin, None, interleaved=interleaved)
    getattr(rope, pass_)(x, x, cos, sin, None, interleaved=interleaved)
    assert torch.equal(_bits(x), _bits(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_backward_of_forward_gives_x_back(dtype, interleaved):
    """The backward rotates back: ``backward(forward(x)) = x`` up to the roundings of the
    float32 table (:math:`c^2 + s^2 = 1 + 2\\epsilon_{32}`), the rotations and ``out``."""
    B, H, S, D, R2, P = 2, 5, 3, 16, 6, 8
    x = _x((B, H, S, D), dtype, seed=6)
    cos, sin = _tables(B, P, R2, per_batch=True, dtype=torch.float32)
    pos = _positions(B, S, P, torch.int64)
    y = torch.empty_like(x)
    rope.forward(y, x, cos, sin, pos, interleaved=interleaved)
    back = torch.empty_like(x)
    rope.backward(back, y, cos, sin, pos, interleaved=interleaved)
    x64, back64 = _np(x), _np(back)
    np.testing.assert_array_equal(back64[..., 2 * R2 :], x64[..., 2 * R2 :])
    eps = torch.finfo(dtype).eps
    scale = _scale(x64, _np(cos), _np(sin), _index(pos), interleaved)
    tol = (8 * EPS32 + 4 * eps) * scale + torch.finfo(dtype).tiny
    assert (np.abs(back64[..., : 2 * R2] - x64[..., : 2 * R2]) <= tol).all()


def test_no_pairs_copies_the_rest():
    """``R2 = 0``: ``out`` is a copy of ``x``, and nothing is launched in place."""
    x = _x((2, 3, 5, 8), torch.float32, seed=7)
    cos, sin = _tables(2, 5, 0, per_batch=False, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    rope.forward(out, x, cos, sin, None, interleaved=False)
    assert torch.equal(out, x)


class _NoLaunch:
    """Stands in for the kernel: fails any launch."""

    def __getitem__(self, grid):
        raise AssertionError(f"launched a grid of {grid}")


@pytest.mark.parametrize(
    ("shape", "r2", "in_place"),
    [((0, 3, 5, 8), 2, False), ((2, 0, 5, 8), 2, False), ((2, 3, 0, 8), 2, False),
     ((2, 3, 5, 8), 0, True)],
    ids=["B0", "H0", "S0", "R2-0-in-place"],
)  # fmt: skip
def test_nothing_to_do_launches_nothing(monkeypatch, shape, r2, in_place):
    monkeypatch.setattr(rope, "_rope_kernel", _NoLaunch())
    x = torch.zeros(shape, device=DEVICE)
    cos, sin = _tables(shape[0], 5, r2, per_batch=False, dtype=torch.float32)
    for launch in (rope.forward, rope.backward):
        launch(x if in_place else torch.empty_like(x), x, cos, sin, None, interleaved=True)


def test_tile_config_fills_tiles_with_heads_first():
    assert rope.tile_config(32, 4096, 128, 2) == (1, 32, 4)
    assert rope.tile_config(8, 4096, 128, 2) == (4, 8, 4)
    assert rope.tile_config(8, 1, 128, 2) == (1, 8, 1)
    for itemsize in (2, 4):
        for heads in (1, 3, 8, 32, 64, 128):
            for width in (2, 24, 128, 144, 512, 4096):
                block_s, block_h, warps = rope.tile_config(heads, 4096, width, itemsize)
                for n in (block_s, block_h, warps):
                    assert n & (n - 1) == 0, (heads, width, block_s, block_h, warps)
                assert block_h <= triton.next_power_of_2(heads)
                assert block_s == 1 or block_h >= heads
                tile = block_s * block_h * width * itemsize
                assert tile <= max(rope.TILE_BYTES, width * itemsize)
