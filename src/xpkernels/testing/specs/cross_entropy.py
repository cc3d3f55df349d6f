"""Cross-entropy (ignore_index, label smoothing, softcap, z-loss, every reduction)
conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

#: ``(id, N, V, interpreter, quick)``: one class, odd extents, a vocabulary over many
#: kernel blocks, GPT-2's (not a power of two).
_SHAPES = (
    ("1x1", 1, 1, True, False),
    ("5x7", 5, 7, True, True),
    ("9x1000", 9, 1000, True, False),
    ("3x50257", 3, 50257, False, False),
)
#: ``(id, params)``: the options and layouts a case runs with.
_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("mean", {}),
    ("sum-int32", {"reduction": "sum", "targets": "int32"}),
    ("none-strided", {"reduction": "none", "strided": True}),
    ("ignored", {"ignored": 2}),
    ("all-ignored", {"ignored": -1}),
    ("ignore-inside", {"ignore_index": 2, "ignored": 2}),
    ("smoothing", {"label_smoothing": 0.1, "ignored": 1}),
    ("softcap", {"softcap": 4.0, "scale": 6.0}),
    ("z-loss", {"z_loss": 1e-2, "reduction": "none"}),
    (
        "all",
        {
            "label_smoothing": 0.2,
            "softcap": 5.0,
            "z_loss": 1e-3,
            "scale": 4.0,
            "ignored": 1,
            "strided": True,
        },
    ),
)
_OPTIONS = ("ignore_index", "label_smoothing", "softcap", "reduction", "z_loss")


def _cases():
    cases = []
    for name, n, v, interpreter, quick in _SHAPES:
        for how, extra in _VARIANTS:
            cases.append(
                Case(
                    f"{name}-{how}",
                    {"N": n, "V": v, **extra},
                    interpreter=interpreter,
                    quick=quick and how == "mean",
                )
            )
    return cases


def options(case) -> dict:
    """The case's options, with their defaults."""
    p = case.params
    defaults: dict = {"ignore_index": -100, "label_smoothing": 0.0, "softcap": None}
    defaults.update({"reduction": "mean", "z_loss": 0.0})
    return {k: p.get(k, d) for k, d in defaults.items()}


def draw_targets(case, rng):
    """``N`` class ids of ``V`` in the case's dtype; ``ignored`` of them (never all, unless
    ``ignored`` is -1: every one) are ``ignore_index``."""
    p = case.params
    n = p["N"]
    ids = rng.integers(0, p["V"], n).astype(p.get("targets", "int64"))
    ignored = p.get("ignored", 0)
    ignore_index = options(case)["ignore_index"]
    if ignored < 0:
        ids[:] = ignore_index
    elif ignored:
        ids[rng.permutation(n)[: min(ignored, n - 1)]] = ignore_index
    return ids


def _inputs(case, rng):
    p = case.params
    ids = draw_targets(case, rng)
    return {"logits": p.get("scale", 1.0) * rng.standard_normal((p["N"], p["V"])), "targets": ids}


def _arrange(case, arrays, target):
    """A ``strided`` case's logits are the first columns' view of a wider buffer."""
    if not case.params.get("strided"):
        return arrays
    xp = target.xp
    logits = arrays["logits"]
    n, v = logits.shape
    wide = xp.concat([logits, xp.zeros_like(logits[:, :1]), logits[:, :1]], axis=1)
    return {**arrays, "logits": wide[:, :v]}


def _loss_shape(case) -> tuple:
    return (case.params["N"],) if options(case)["reduction"] == "none" else ()


def loss_cotangents(case, rng):
    """``dloss``: one per row with ``reduction='none'``, else a scalar."""
    return {"loss": np.asarray(rng.standard_normal(_loss_shape(case)))}


def lse(case, logits, targets):
    """The reference checkpoint: every row's logsumexp under the case's options."""
    rows = {k: v for k, v in options(case).items() if k != "reduction"}
    return ref.cross_entropy_rows(logits, targets, **rows)[1]


def _reference(case, inputs):
    opts = options(case)
    loss = ref.cross_entropy(inputs["logits"], inputs["targets"], **opts)
    return {"loss": np.asarray(loss)}, {"lse": lse(case, inputs["logits"], inputs["targets"])}


def _reference_backward(case, inputs, cotangents):
    opts = options(case)
    grad = ref.cross_entropy_backward(
        inputs["logits"], inputs["targets"], cotangents["loss"], **opts
    )
    return {"logits": grad}


def _torch_reference(case, inputs, cotangents):
    """``torch.nn.functional.cross_entropy`` in float64 on the soft-capped logits, plus the
    z-loss term and the mean over kept rows (0 when none is kept) written out where PyTorch
    has no option for them."""
    import torch
    import torch.nn.functional as F

    opts = options(case)
    x = torch.tensor(inputs["logits"], requires_grad=True)
    t = torch.tensor(inputs["targets"]).long()
    z = x if opts["softcap"] is None else opts["softcap"] * torch.tanh(x / opts["softcap"])
    kw = {"ignore_index": opts["ignore_index"], "label_smoothing": opts["label_smoothing"]}
    kept = t != opts["ignore_index"]
    plain = opts["z_loss"] == 0 and bool(kept.any())
    if plain:
        loss = F.cross_entropy(z, t, reduction=opts["reduction"], **kw)
    else:
        rows = F.cross_entropy(z, t, reduction="none", **kw)
        rows = rows + torch.where(kept, opts["z_loss"] * torch.logsumexp(z, -1) ** 2, 0)
        if opts["reduction"] == "none":
            loss = rows
        else:
            loss = rows.sum()
            if opts["reduction"] == "mean":
                loss = loss / kept.sum().clamp(min=1)
    loss.backward(torch.tensor(cotangents["loss"]))
    return {"loss": loss.detach().numpy()}, {"logits": x.grad.numpy()}


def allocate_loss(case, arrays, target, dtype):
    """The loss: float32 (float64 for float64 inputs), what the allocating forms return."""
    stat = "float64" if dtype == "float64" else "float32"
    return {"loss": target.full(_loss_shape(case), np.nan, stat)}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.cross_entropy_, arrays["logits"], arrays["targets"])


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.cross_entropy_(
        outs["loss"],
        arrays["logits"],
        arrays["targets"],
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    loss = xk.cross_entropy(
        arrays["logits"],
        arrays["targets"],
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )
    return {"loss": loss}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    xk.cross_entropy_backward_(
        Duplicated(outs["loss"], cotangents["loss"]),
        Duplicated(arrays["logits"], grads["logits"]),
        arrays["targets"],
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    dlogits = xk.cross_entropy_backward(
        cotangents["loss"],
        arrays["logits"],
        arrays["targets"],
        **options(case),
        checkpoints=checkpoints,
        backend=backend,
    )
    return {"logits": dlogits}


def _errors():
    """What the declaration cannot say: target values, the loss's shape per reduction, option
    values, checkpoints of another forward, devices."""
    n, v = 4, 6

    def arrays(t, targets=(0, 1, 2, 3), loss_shape=()):
        logits = t.full((n, v), 0.5, "float32")
        ids = t.asarray(np.asarray(targets, np.int64))
        return t.full(loss_shape, 7.0, "float32"), logits, ids

    def call(targets=(0, 1, 2, 3), loss_shape=(), **kw):
        def run(t):
            loss, logits, ids = arrays(t, targets, loss_shape)
            try:
                xk.cross_entropy_(loss, logits, ids, **kw)
            except (TypeError, ValueError):
                assert np.all(t.to_numpy(loss) == 7.0), "a refused call wrote"
                raise

        return run

    def mixed_devices(t):
        _, logits, ids = arrays(t)
        xk.cross_entropy_(other_device(t, ()), logits, ids)

    def other_options(t):
        loss, logits, ids = arrays(t)
        ck = xk.allocate_checkpoints(xk.cross_entropy_, logits, ids)
        xk.cross_entropy_(loss, logits, ids, checkpoints=ck, label_smoothing=0.1)
        grad = t.full((n, v), 7.0, "float32")
        xk.cross_entropy_backward_(
            Duplicated(loss, t.full((), 1.0, "float32")),
            Duplicated(logits, grad),
            ids,
            checkpoints=ck,
        )

    values = {"targets": lambda e: np.zeros((e["T"],))}
    return [
        # V is the logits' own extent: no other array has it to disagree with.
        *(e for e in declared_errors("cross_entropy", values=values) if "extent-V" not in e.id),
        ErrorCase("mixed-devices", mixed_devices, TypeError, r"loss is on device .* but"),
        ErrorCase(
            "target-high",
            call(targets=(0, 1, 6, 3)),
            ValueError,
            r"targets must lie in \[0, 5\] \(the logits' V columns\) or be ignore_index = -100",
            values=True,
        ),
        ErrorCase("target-negative", call(targets=(0, -1, 2, 3)), ValueError, r"targets", True),
        ErrorCase(
            "loss-rows-mean", call(loss_shape=(n,)), ValueError, r"loss must have shape \(\)"
        ),
        ErrorCase(
            "loss-scalar-none",
            call(reduction="none"),
            ValueError,
            r"loss must have shape \(4,\), \(N,\) with reduction='none'",
        ),
        ErrorCase("reduction", call(reduction="avg"), ValueError, r"reduction must be one of"),
        ErrorCase("smoothing", call(label_smoothing=1.5), ValueError, r"label_smoothing"),
        ErrorCase("softcap", call(softcap=0.0), ValueError, r"softcap must be"),
        ErrorCase("z-loss", call(z_loss=-1.0), ValueError, r"z_loss must be >= 0"),
        ErrorCase(
            "ignore-float", call(ignore_index=1.5), TypeError, r"ignore_index must be an int"
        ),
        ErrorCase(
            "other-options",
            other_options,
            ValueError,
            r"label_smoothing=0.0 differs from the forward",
        ),
    ]


SPEC = OpSpec(
    name="cross_entropy",
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
    arrange=_arrange,
    backward=Backward(
        grad_names=("logits",),
        cotangents=loss_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
