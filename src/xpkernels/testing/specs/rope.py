"""RoPE (rotary position embeddings of q and k, both layouts, partial rotary) conformance
declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._shared import bshd

#: ``(id, B, H, Hkv, S, D, R2, interpreter, quick)``: a partial and a full rotary dim, GQA,
#: odd extents, a long sequence.
_SHAPES = (
    ("1x1x1x1x2-full", 1, 1, 1, 1, 2, 1, True, False),
    ("2x4x2x7x16-partial", 2, 4, 2, 7, 16, 6, True, True),
    ("1x3x1x5x8-full", 1, 3, 1, 5, 8, 4, True, False),
    ("2x2x2x9x64-quarter", 2, 2, 2, 9, 64, 8, True, False),
    ("1x8x2x300x128-full", 1, 8, 2, 300, 128, 64, False, False),
)
#: ``(id, params)``: how positions reach the tables.
_POSITIONS: tuple[tuple[str, dict], ...] = (
    ("rows", {}),
    ("ids-int64", {"ids": "int64"}),
    ("ids-int32-per-batch", {"ids": "int32", "per_batch": True}),
    ("bshd", {"bshd": True}),
)


def _cases():
    cases = []
    for layout in ("half", "interleaved"):
        for name, b, h, hkv, s, d, r2, interpreter, quick in _SHAPES:
            for how, extra in _POSITIONS:
                shape = {"B": b, "H": h, "Hkv": hkv, "S": s, "D": d, "R2": r2}
                cases.append(
                    Case(
                        f"{layout}-{name}-{how}",
                        {**shape, **extra, "interleaved": layout == "interleaved"},
                        interpreter=interpreter,
                        quick=quick and how == "rows",
                    )
                )
    return cases


def _table_rows(p) -> int:
    return p["S"] + 3


def _inputs(case, rng):
    p = case.params
    b, s, r2 = p["B"], p["S"], p["R2"]
    rows = _table_rows(p)
    theta = 10000.0 ** (-np.arange(r2) / r2)
    batches = (b,) if p.get("per_batch") else ()
    angles = (np.arange(rows)[:, None] * theta) + rng.uniform(0, 0.1, (*batches, rows, r2))
    out = {
        "q": rng.standard_normal((b, p["H"], s, p["D"])),
        "k": rng.standard_normal((b, p["Hkv"], s, p["D"])),
        "cos": np.cos(angles),
        "sin": np.sin(angles),
    }
    if "ids" in p:
        out["position_ids"] = rng.integers(0, rows, (b, s)).astype(p["ids"])
    return out


def _arrange(case, arrays, target):
    if not case.params.get("bshd"):
        return arrays
    return {name: bshd(target, a) if name in ("q", "k") else a for name, a in arrays.items()}


def _cotangents(case, rng):
    p = case.params
    return {
        "q_out": rng.standard_normal((p["B"], p["H"], p["S"], p["D"])),
        "k_out": rng.standard_normal((p["B"], p["Hkv"], p["S"], p["D"])),
    }


def _rotated(case, inputs, names, inverse: bool) -> list:
    kw = {"position_ids": inputs.get("position_ids"), "interleaved": case.params["interleaved"]}
    return [ref.rope(x, inputs["cos"], inputs["sin"], inverse=inverse, **kw) for x in names]


def _reference(case, inputs):
    q_out, k_out = _rotated(case, inputs, (inputs["q"], inputs["k"]), False)
    return {"q_out": q_out, "k_out": k_out}, {}


def _reference_backward(case, inputs, cotangents):
    dq, dk = _rotated(case, inputs, (cotangents["q_out"], cotangents["k_out"]), True)
    return {"q": dq, "k": dk}


def _torch_reference(case, inputs, cotangents):
    """Hugging Face's formula (``x * cos + rotate_half(x) * sin`` over the first ``R`` features,
    the tables repeated over both halves; GPT-J's pairs through a permutation), in float64."""
    import torch

    p = case.params
    r2 = p["R2"]
    cos, sin = torch.tensor(inputs["cos"]), torch.tensor(inputs["sin"])
    if cos.ndim == 2:
        cos, sin = cos.expand(p["B"], *cos.shape), sin.expand(p["B"], *sin.shape)
    ids = inputs.get("position_ids")
    rows = torch.arange(p["S"]).expand(p["B"], -1) if ids is None else torch.tensor(ids).long()
    gather = torch.arange(p["B"])[:, None]
    c = torch.cat([cos[gather, rows]] * 2, -1)[:, None]
    s = torch.cat([sin[gather, rows]] * 2, -1)[:, None]
    half = torch.cat([torch.arange(0, 2 * r2, 2), torch.arange(1, 2 * r2, 2)])
    order = half if p["interleaved"] else torch.arange(2 * r2)

    def apply(x):
        rot = x[..., order]
        turned = torch.cat([-rot[..., r2:], rot[..., :r2]], -1)
        y = x.clone()
        y[..., order] = rot * c + turned * s
        return y

    q = torch.tensor(inputs["q"], requires_grad=True)
    k = torch.tensor(inputs["k"], requires_grad=True)
    q_out, k_out = apply(q), apply(k)
    torch.autograd.backward(
        (q_out, k_out), (torch.tensor(cotangents["q_out"]), torch.tensor(cotangents["k_out"]))
    )
    outs = {"q_out": q_out.detach().numpy(), "k_out": k_out.detach().numpy()}
    return outs, {"q": q.grad.numpy(), "k": k.grad.numpy()}


def _allocate_outputs(case, arrays, target, dtype):
    return {
        "q_out": target.full(tuple(arrays["q"].shape), np.nan, dtype),
        "k_out": target.full(tuple(arrays["k"].shape), np.nan, dtype),
    }


def _tables(case, arrays) -> dict:
    return {
        "position_ids": arrays.get("position_ids"),
        "interleaved": case.params["interleaved"],
    }


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.rope_(
        outs["q_out"],
        outs["k_out"],
        arrays["q"],
        arrays["k"],
        arrays["cos"],
        arrays["sin"],
        **_tables(case, arrays),
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    q_out, k_out = xk.rope(
        arrays["q"],
        arrays["k"],
        arrays["cos"],
        arrays["sin"],
        **_tables(case, arrays),
        backend=backend,
    )
    return {"q_out": q_out, "k_out": k_out}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    xk.rope_backward_(
        Duplicated(outs["q_out"], cotangents["q_out"]),
        Duplicated(outs["k_out"], cotangents["k_out"]),
        Duplicated(arrays["q"], grads["q"]),
        Duplicated(arrays["k"], grads["k"]),
        arrays["cos"],
        arrays["sin"],
        **_tables(case, arrays),
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    dq, dk = xk.rope_backward(
        cotangents["q_out"],
        cotangents["k_out"],
        arrays["cos"],
        arrays["sin"],
        **_tables(case, arrays),
        backend=backend,
    )
    return {"q": dq, "k": dk}


def _errors():
    """What the declaration cannot say: devices, rotary dims, table rows, position values,
    per-batch tables, table dtypes."""
    shape, table = (2, 4, 3, 8), (5, 2)

    def arrays(t, cos_shape=table):
        q = t.full(shape, 1.0, "float32")
        k = t.full((2, 2, 3, 8), 1.0, "float32")
        cos = t.full(cos_shape, 0.5, "float32")
        return q, k, cos, t.full(cos_shape, 0.5, "float32")

    def outputs(t):
        return t.full(shape, 7.0, "float32"), t.full((2, 2, 3, 8), 7.0, "float32")

    def unwritten(t, q_out, k_out):
        for out in (q_out, k_out):
            assert np.all(t.to_numpy(out) == 7.0), "a refused call wrote"

    def call(cos_shape=table, ids=None, **kw):
        def run(t):
            q, k, cos, sin = arrays(t, cos_shape)
            q_out, k_out = outputs(t)
            position_ids = None if ids is None else t.asarray(np.asarray(ids))
            try:
                xk.rope_(q_out, k_out, q, k, cos, sin, position_ids, **kw)
            except (TypeError, ValueError):
                unwritten(t, q_out, k_out)
                raise

        return run

    def mixed_devices(t):
        q, k, cos, sin = arrays(t)
        xk.rope_(other_device(t, shape), outputs(t)[1], q, k, cos, sin)

    def sin_dtype(t):
        q, k, cos, _ = arrays(t)
        q_out, k_out = outputs(t)
        try:
            xk.rope_(q_out, k_out, q, k, cos, t.full(table, 0.5, "float64"))
        except TypeError:
            unwritten(t, q_out, k_out)
            raise

    ids_high = np.full((2, 3), 5, np.int64)
    ids_negative = np.full((2, 3), -1, np.int32)
    return [
        *declared_errors("rope", values={"position_ids": lambda e: np.zeros((e["B"], e["S"]))}),
        ErrorCase("mixed-devices", mixed_devices, TypeError, r"q_out is on device .* but q is on"),
        ErrorCase("rotary-dim-over-D", call((5, 5)), ValueError, r"cos and sin must hold R2"),
        ErrorCase("no-pairs", call((5, 0)), ValueError, r"cos and sin must hold R2"),
        ErrorCase("too-few-rows", call((2, 2)), ValueError, r"Pmax >= S = 3"),
        ErrorCase("per-batch-B", call((3, 5, 2)), ValueError, r"must have B = 2"),
        ErrorCase("table-rank-4", call((1, 2, 5, 2)), ValueError, r"cos must have shape"),
        ErrorCase(
            "ids-high",
            call(ids=ids_high),
            ValueError,
            r"position_ids must lie in \[0, 4\] \(the rows of cos and sin\), got values in \[5, 5\]",
            values=True,
        ),
        ErrorCase(
            "ids-negative",
            call(ids=ids_negative),
            ValueError,
            r"position_ids must lie in",
            values=True,
        ),
        ErrorCase("sin-dtype", sin_dtype, TypeError, r"sin must have cos's dtype"),
        ErrorCase("interleaved-int", call(interleaved=1), TypeError, r"interleaved must be a bool"),
        ErrorCase(
            "interleaved-numpy-bool",
            call(interleaved=np.True_),
            TypeError,
            r"interleaved must be a bool, got numpy\.bool",
        ),
    ]


SPEC = OpSpec(
    name="rope",
    outputs=("q_out", "k_out"),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=_arrange,
    backward=Backward(
        grad_names=("q", "k"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
