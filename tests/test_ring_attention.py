"""Ring attention over torch.distributed: 2 and 4 gloo processes on CPU equal one process.

Each world size is one spawn (interpreter and torch start-up dominate); its
workers run every configuration -- float64 and float32, causal and not,
multi-head and grouped-query -- and compare, on every rank, the output and
the q/k/v gradients of its shard with single-process xpkernels attention and
with torch's float64 scaled_dot_product_attention over the whole sequence.
A spawn that does not finish in time is killed and fails the test, so a
hang in the ring cannot block CI.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="ring attention runs on torch.distributed")
dist = pytest.importorskip("torch.distributed", reason="ring attention needs torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import xpkernels as xk  # noqa: E402
from xpkernels.testing.harness import max_error  # noqa: E402
from xpkernels.testing.tolerances import floor  # noqa: E402
from xpkernels.torch.distributed import (  # noqa: E402
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

#: Seconds a spawn of workers may take (start-up included) before it counts as a hang.
_DEADLINE = 120.0

#: (dtype, causal, heads, kv_heads, kv_seq): every dtype x causal pair, grouped-query and
#: multi-head, over 16 queries and as many keys -- and, without causal, half as many keys
#: (shards of two different sequences, as in cross-attention).
_CONFIGS = [
    (dtype, causal, heads, kv_heads, 16)
    for dtype in ("float64", "float32")
    for causal in (False, True)
    for heads, kv_heads in ((4, 2), (2, 2))
] + [("float32", False, 4, 1, 8)]


def _floor(pass_: str, dtype: str) -> float:
    """The attention floor of ``pass_`` in ``dtype``.

    Float64 forward: the ring merges partial outputs with weights built from
    the float32 checkpoints ``(m, l)`` (the contract's), so its output
    carries their rounding; the checkpoints' floor is the one that applies.
    """
    if pass_ == "forward" and dtype == "float64":
        return floor("attention", "checkpoints", dtype)
    return floor("attention", pass_, dtype)


def _problem(seed, dtype, heads, kv_heads, kv_seq, seq=16, batch=2, d=8, dv=6):
    """Whole-sequence q, k, v and the output cotangent, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, d), (batch, kv_heads, kv_seq, d), (batch, kv_heads, kv_seq, dv)]
    shapes.append((batch, heads, seq, dv))
    return [
        torch.randn(s, generator=g, dtype=torch.float64).to(getattr(torch, dtype)) for s in shapes
    ]


def _sdpa_float64(q, k, v, do, causal):
    """Torch's float64 attention over the whole sequence: the output and the q/k/v gradients."""
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    o.backward(do.to(torch.float64))
    return [o.detach()] + [t.grad for t in leaves]


def _single_process(q, k, v, do, causal):
    """xpkernels attention over the whole sequence, in the inputs' dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = xk.attention(*leaves, causal=causal)
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


def _check_config(seed, dtype, causal, heads, kv_heads, kv_seq, group=None):
    """Ring attention over ``group`` equals whole-sequence attention on this rank's shard."""
    q, k, v, do = _problem(seed, dtype, heads, kv_heads, kv_seq)
    want = _sdpa_float64(q, k, v, do, causal)
    single = _single_process(q, k, v, do, causal)
    # The ring's shards come from shard_sequence on whole-sequence leaves: their gradients
    # (zero outside this rank's shard) check that the layout helpers are differentiable.
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    layout = {"group": group, "causal": causal}
    o_shard = ring_attention(*(shard_sequence(t, **layout) for t in leaves), **layout)
    o_shard.backward(shard_sequence(do, **layout))
    got = [unshard_sequence(o_shard.detach(), **layout)]
    got += [shard_sequence(t.grad, **layout) for t in leaves]
    want = [want[0]] + [shard_sequence(g, **layout) for g in want[1:]]
    single = [single[0]] + [shard_sequence(g, **layout) for g in single[1:]]
    for name, ring, exact, same_dtype in zip(("o", "dq", "dk", "dv"), got, want, single):
        assert ring.dtype == getattr(torch, dtype), (name, ring.dtype)
        pass_ = "forward" if name == "o" else "backward"
        single_error = max_error(same_dtype.numpy(), exact.numpy())
        allowed = max(_floor(pass_, dtype), 2 * single_error)
        ring_error = max_error(ring.numpy(), exact.numpy())
        label = f"{name} {dtype} causal={causal} H={heads} Hkv={kv_heads} Sk={kv_seq}"
        assert ring_error <= allowed, f"{label}: error {ring_error:.3g} > allowed {allowed:.3g}"
        assert max_error(ring.numpy(), same_dtype.numpy()) <= allowed, label
    for t in leaves:  # the whole-sequence leaves' gradients are 0 outside this rank's shard
        positions = shard_sequence(torch.arange(t.shape[2]), dim=0, **layout)
        outside = t.grad.clone()
        outside[:, :, positions] = 0
        assert not outside.any()


def _check_layout():
    """``unshard_sequence`` undoes ``shard_sequence``, and the causal layout is the documented one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).reshape(2, 4 * world, 3)
    for causal in (False, True):
        shard = shard_sequence(x, dim=1, causal=causal)
        assert torch.equal(unshard_sequence(shard, dim=1, causal=causal), x)
    chunk = 2  # 4 W positions in 2 W chunks
    front, back = rank * chunk, (2 * world - 1 - rank) * chunk
    expected = torch.cat([x[:, front : front + chunk], x[:, back : back + chunk]], dim=1)
    assert torch.equal(shard_sequence(x, dim=1, causal=True), expected)
    assert torch.equal(shard_sequence(x, dim=-2), x[:, rank * 4 : rank * 4 + 4])
    # unshard's gradient: every rank's copy counts, so each shard gets the sum over ranks.
    leaf = shard_sequence(x, dim=1, causal=True).clone().requires_grad_()
    unshard_sequence(leaf, dim=1, causal=True).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, float(world)))


def _check_errors():
    """Errors that need an initialized group: devices the group cannot send, bad shards, a
    bad group, double backward."""
    q = torch.zeros(1, 2, 4, 8)
    meta = torch.zeros(1, 2, 4, 8, device="meta")
    with pytest.raises(TypeError, match=r"ring_attention: q is on device type 'meta'.*gloo"):
        ring_attention(meta, meta, meta)
    with pytest.raises(TypeError, match="ring_attention: k is on meta but q is on cpu"):
        ring_attention(q, meta, q)
    with pytest.raises(
        ValueError, match=r"shard_sequence: x has 6 positions .* not a multiple of 4"
    ):
        shard_sequence(torch.zeros(1, 1, 6, 1), causal=True)
    with pytest.raises(ValueError, match="unshard_sequence: x has 3 positions .* must be even"):
        unshard_sequence(torch.zeros(1, 1, 3, 1), causal=True)
    with pytest.raises(TypeError, match="ring_attention: group must be a torch.distributed"):
        ring_attention(q, q, q, group="world")
    leaf = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    (dq,) = torch.autograd.grad(ring_attention(leaf, leaf, leaf).sum(), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match=r"xpkernels\.ring_attention: double backward"):
        dq.sum().backward()
    shard = torch.ones(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.ones(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)  # dy needs grad
    loss = (unshard_sequence(shard) * weight).sum()
    (ds,) = torch.autograd.grad(loss, shard, create_graph=True)
    with pytest.raises(RuntimeError, match=r"xpkernels\.unshard_sequence: double backward"):
        ds.sum().backward()


def _worker(rank, world, store, checks):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        if "layout" in checks:
            _check_layout()
        if "errors" in checks:
            _check_errors()
        for seed, config in enumerate(_CONFIGS):
            if "multi-head" in checks or config[2] != config[3]:
                _check_config(seed, *config)
        if "subgroups" in checks:  # rings over ranks {0, 2} and {1, 3}: group ranks != global
            pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            for causal in (False, True):
                _check_config(7, "float64", causal, 4, 2, 16, group=pairs[rank % 2])
            q = torch.zeros(1, 2, 4, 8)
            with pytest.raises(ValueError, match="ring_attention: group: this process is not a"):
                ring_attention(q, q, q, group=pairs[(rank + 1) % 2])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world, tmp_path, checks=()):
    """Run ``_worker`` on ``world`` processes; a worker's exception fails here, a hang times out."""
    context = mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "store"), tuple(checks)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + _DEADLINE
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ring attention over {world} processes did not finish in {_DEADLINE} s")


def test_two_processes_equal_one(tmp_path):
    _spawn(2, tmp_path, checks=("layout", "errors", "multi-head"))


def test_four_processes_equal_one(tmp_path):
    _spawn(4, tmp_path, checks=("layout", "subgroups"))  # grouped-query configurations only


# --------------------------------------------------------------------------- local checks


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="ring_attention: group: no torch.distributed process"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="shard_sequence: group: no torch.distributed process"):
        shard_sequence(q)
    with pytest.raises(ValueError, match="unshard_sequence: group: no torch.distributed process"):
        unshard_sequence(q)


def test_bad_shards_are_refused_before_any_communication():
    q = torch.zeros(1, 4, 6, 8)
    k = torch.zeros(1, 2, 6, 8)
    with pytest.raises(TypeError, match="ring_attention: v must be a torch.Tensor, got ndarray"):
        ring_attention(q, k, k.numpy())
    with pytest.raises(TypeError, match="ring_attention: k must have q's dtype"):
        ring_attention(q, k.double(), k)
    with pytest.raises(ValueError, match=r"ring_attention: k must have shape \(1, 2, 6, 8\)"):
        ring_attention(q, k[..., :4], k)
    with pytest.raises(ValueError, match="multiple of the Hkv=3 kv heads"):
        ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8))
    with pytest.raises(TypeError, match="ring_attention: causal must be a bool"):
        ring_attention(q, k, k, causal=1)
    with pytest.raises(ValueError, match="ring_attention: scale must be finite"):
        ring_attention(q, k, k, scale=float("inf"))
    with pytest.raises(ValueError, match="ring_attention: k must hold as many positions as q"):
        ring_attention(q, k[:, :, :4], k[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="ring_attention: q must have an even shard length"):
        ring_attention(q[:, :, :5], k[:, :, :5], k[:, :, :5], causal=True)
    with pytest.raises(TypeError, match="shard_sequence: dim must be an int"):
        shard_sequence(q, dim=2.0)
    with pytest.raises(ValueError, match=r"shard_sequence: dim must be in \[-4, 4\)"):
        shard_sequence(q, dim=4)
