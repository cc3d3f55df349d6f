"""Linear cross-entropy (the logits of a linear layer formed chunk by chunk; bias, every
option and reduction) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from .cross_entropy import allocate_loss, draw_targets, loss_cotangents, lse, options

#: ``(id, N, H, V, interpreter)``: one class, odd extents, more classes than the default
#: chunk holds rows of (several chunks), a long vocabulary.
_SHAPES = (
    ("1x1x1", 1, 1, 1, True),
    ("5x8x7", 5, 8, 7, True),
    ("9x16x300", 9, 16, 300, True),
    ("40x32x3001", 40, 32, 3001, False),
)
_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("mean", {}),
    ("sum-bias", {"reduction": "sum", "bias": True, "targets": "int32"}),
    ("ignored-bias", {"ignored": 2, "bias": True}),
    ("all-ignored", {"ignored": -1, "bias": True}),
    (
        "all-none",
        {
            "reduction": "none",
            "label_smoothing": 0.1,
            "softcap": 3.0,
            "z_loss": 1e-3,
            "ignored": 1,
            "bias": True,
        },
    ),
)


def _cases():
    return [
        Case(
            f"{name}-{how}",
            {"N": n, "H": h, "V": v, **extra},
            interpreter=interpreter,
            quick=name == "5x8x7" and how == "mean",
        )
        for name, n, h, v, interpreter in _SHAPES
        for how, extra in _VARIANTS
    ]


def _inputs(case, rng):
    p = case.params
    n, h, v = p["N"], p["H"], p["V"]
    ids = draw_targets(case, rng)
    out = {
        "x": rng.standard_normal((n, h)),
        "weight": rng.standard_normal((v, h)) / np.sqrt(h),
        "targets": ids,
    }
    if p.get("bias"):
        out["bias"] = rng.standard_normal(v)
    return out


def _args(inputs):
    return inputs["x"], inputs["weight"], inputs["targets"], inputs.get("bias")


def _reference(case, inputs):
    loss = ref.linear_cross_entropy(*_args(inputs), **options(case))
    x, weight, _, bias = _args(inputs)
    logits = x @ weight.T if bias is None else x @ weight.T + bias
    return {"loss": np.asarray(loss)}, {"lse": lse(case, logits, inputs["targets"])}


def _grads(dx, dweight, dbias):
    """The gradients by name; ``bias`` only where the case has one."""
    grads = {"x": dx, "weight": dweight}
    if dbias is not None:
        grads["bias"] = dbias
    return grads


def _reference_backward(case, inputs, cotangents):
    x, weight, targets, bias = _args(inputs)
    dx, dweight, dbias = ref.linear_cross_entropy_backward(
        x, weight, targets, cotangents["loss"], bias, **options(case)
    )
    return _grads(dx, dweight, dbias)


def _torch_reference(case, inputs, cotangents):
    """The logits through ``torch.nn.functional.linear``, then the cross-entropy spec's
    PyTorch reference (``F.cross_entropy`` and the terms PyTorch has no option for)."""
    import torch

    from .cross_entropy import _torch_reference as rows_reference

    x = torch.tensor(inputs["x"], requires_grad=True)
    weight = torch.tensor(inputs["weight"], requires_grad=True)
    bias = None if "bias" not in inputs else torch.tensor(inputs["bias"], requires_grad=True)
    logits = torch.nn.functional.linear(x, weight, bias)
    outs, grads = rows_reference(
        case, {"logits": logits.detach().numpy(), "targets": inputs["targets"]}, cotangents
    )
    logits.backward(torch.tensor(grads["logits"]))
    result = {"x": x.grad.numpy(), "weight": weight.grad.numpy()}
    if bias is not None:
        result["bias"] = bias.grad.numpy()
    return outs, result


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(
        xk.linear_cross_entropy_, arrays["x"], arrays["weight"], arrays["targets"]
    )


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.linear_cross_entropy_(
        outs["loss"],
        *_args(arrays),
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    loss = xk.linear_cross_entropy(
        *_args(arrays), **options(case), checkpoints=checkpoints, backend=backend
    )
    return {"loss": loss}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    bias = arrays.get("bias")
    xk.linear_cross_entropy_backward_(
        Duplicated(outs["loss"], cotangents["loss"]),
        Duplicated(arrays["x"], grads["x"]),
        Duplicated(arrays["weight"], grads["weight"]),
        arrays["targets"],
        None if bias is None else Duplicated(bias, grads["bias"]),
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    dx, dweight, dbias = xk.linear_cross_entropy_backward(
        cotangents["loss"],
        *_args(arrays),
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )
    return _grads(dx, dweight, dbias)


def _errors():
    """What the declaration cannot say: a bias of another dtype, a too-small scratch, a
    backward without the forward's bias."""
    n, h, v = 4, 3, 6

    def arrays(t):
        x, w = t.full((n, h), 0.5, "float32"), t.full((v, h), 0.25, "float32")
        return t.full((), 7.0, "float32"), x, w, t.asarray(np.arange(n, dtype=np.int64))

    def bias_dtype(t):
        loss, x, w, ids = arrays(t)
        try:
            xk.linear_cross_entropy_(loss, x, w, ids, t.full((v,), 1.0, "float64"))
        except TypeError:
            assert np.all(t.to_numpy(loss) == 7.0), "a refused call wrote"
            raise

    def scratch_vocab(t):
        loss, x, w, ids = arrays(t)
        other = t.full((v + 1, h), 0.25, "float32")
        scratch = xk.allocate_scratchspace(xk.linear_cross_entropy_, x, other, ids)
        xk.linear_cross_entropy_(loss, x, w, ids, scratch=scratch)

    def no_bias_backward(t):
        loss, x, w, ids = arrays(t)
        bias = t.full((v,), 1.0, "float32")
        ck = xk.allocate_checkpoints(xk.linear_cross_entropy_, x, w, ids)
        xk.linear_cross_entropy_(loss, x, w, ids, bias, checkpoints=ck)
        xk.linear_cross_entropy_backward_(
            Duplicated(loss, t.full((), 1.0, "float32")),
            Duplicated(x),
            Duplicated(w),
            ids,
            checkpoints=ck,
        )

    values = {"targets": lambda e: np.zeros((e["T"],))}
    return [
        *declared_errors("linear_cross_entropy", values=values),
        ErrorCase("bias-dtype", bias_dtype, TypeError, r"bias must have x's dtype float32"),
        ErrorCase(
            "scratch-vocab", scratch_vocab, ValueError, r"scratch.logits must be \(C, V = 6\)"
        ),
        ErrorCase("no-bias-backward", no_bias_backward, ValueError, r"bias='none' differs"),
    ]


SPEC = OpSpec(
    name="linear_cross_entropy",
    outputs=("loss",),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=allocate_loss,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    checkpoint_names=("lse",),
    allocate_checkpoints=_allocate_checkpoints,
    backward=Backward(
        grad_names=("x", "weight", "bias"),
        cotangents=loss_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
