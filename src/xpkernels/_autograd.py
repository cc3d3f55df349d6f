"""Where the fronts meet PyTorch's autograd (imports no torch).

Two hooks, each a couple of lines in every front file:

- :func:`record`: the allocating fronts (``rms_norm(x, w)``, ``attention(q, k, v)``...)
  call it first. On torch tensors, when grad mode is on and an input (or an
  array a score mod captures) requires grad, or while ``torch.compile``
  traces, it runs the call through the ``xpkernels`` ``torch.library`` op
  instead (:mod:`xpkernels.torch`), which records xpkernels' own backward
  for ``loss.backward()``, and returns that op's result. Otherwise it
  returns :data:`NOT_RECORDED` and the front carries on as for any array.
- :func:`check_inplace`: the in-place fronts (``rms_norm_``...) call it
  before anything is written. An in-place call records no autograd, so a
  torch tensor that requires grad in grad mode is refused, naming it,
  instead of dropping its gradient silently (as torch's ``out=`` ops do).

Both refuse meta tensors (they hold no data for a kernel to read), naming
the argument. Torch is detected through ``sys.modules``: when the caller
never imported torch, nothing here imports it.

Layering: this module sits below the torch integration and never imports
it. The torch layer files its recorders in :data:`RECORDERS` when it loads
(:mod:`xpkernels.torch._fronts` registers its ``FRONTS``). When torch
tensors need recording, :func:`record` first imports
:mod:`xpkernels._torch_plugin`, which loads that plug-in by its module name
(:mod:`importlib`) the first time -- the one plug-in load of the core, so a
NumPy or CuPy caller never pays for the torch layer and the core never
depends on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from .buffers import Duplicated

__all__ = [
    "NOT_RECORDED",
    "RECORDERS",
    "record",
    "NO_BACKWARD",
    "check_inplace",
    "needs_grad",
    "register_recorders",
    "requires_grad_error",
]

#: What :func:`record` returns when the call is not for autograd; the front proceeds as usual.
NOT_RECORDED = object()

#: Primitive (``"rms_norm"``...) -> its recorder ``(op, arrays, options) -> result``: the
#: call of the autograd-recording torch op. Filled by the torch layer (:func:`register_recorders`)
#: when :mod:`xpkernels._torch_plugin` loads it.
RECORDERS: dict[str, Callable[[str, dict, dict], Any]] = {}


def register_recorders(recorders: Mapping[str, Callable[[str, dict, dict], Any]]) -> None:
    """File the torch layer's recorders (primitive -> recorder) for :func:`record`."""
    RECORDERS.update(recorders)


def _torch_tensors(arrays):
    """``(name, tensor)`` for each torch tensor of ``arrays`` (name -> array, Duplicated or None)."""
    torch = sys.modules["torch"]
    found = []
    for name, a in arrays.items():
        if isinstance(a, Duplicated):
            found.extend((f"{name}.{part}", getattr(a, part)) for part in ("primal", "shadow"))
        else:
            found.append((name, a))
    return [(name, a) for name, a in found if isinstance(a, torch.Tensor)]


def _call_tensors(arrays, score_mod):
    """The torch tensors among a call's primals and its score mod's captured arrays."""
    primals = {name: a.primal if isinstance(a, Duplicated) else a for name, a in arrays.items()}
    return _torch_tensors({**primals, **_mod_arrays(score_mod)})


def _requires_grad(torch, tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors)


def needs_grad(arrays: dict, score_mod=None) -> bool:
    """Whether autograd records a call over ``arrays`` (name -> array, Duplicated or None):
    grad mode is on and a torch primal, or an array ``score_mod`` captures, requires grad."""
    torch = sys.modules.get("torch")
    return torch is not None and _requires_grad(torch, _call_tensors(arrays, score_mod))


def _check_meta(fn, tensors) -> None:
    real = [(name, t) for name, t in tensors if not t.is_meta]
    for name, t in tensors:
        if t.is_meta:
            where = (
                f"is on device meta but {real[0][0]} is on {real[0][1].device}"
                if real
                else ("is a meta tensor")
            )
            raise TypeError(
                f"{fn}: {name} {where}: a meta tensor holds no data for a kernel to read; "
                "pass tensors on one real device (cpu or cuda)"
            )


def _mod_arrays(score_mod):
    """The arrays a score mod (a ScoreMod or a plain function) captures, by label."""
    if score_mod is None:
        return {}
    from .mods import as_score_mod

    try:
        mod = as_score_mod(score_mod)
    except TypeError:  # not a score mod: the front's own validation says so
        return {}
    return {f"score_mod {s.label}": s.array for s in mod.graph.slots}


#: Forward-only primitive -> why it has no backward, and what to use instead.
NO_BACKWARD = {
    "decode_attention": (
        "it is the forward-only kernel for generation: run it under torch.no_grad(), or train "
        "with xpkernels.attention(q, k, v, causal=True, input_pos=...), whose backward "
        "xpkernels provides"
    ),
}


def requires_grad_error(fn: str, name: str) -> ValueError:
    """The error of an in-place call given a tensor that requires grad in grad mode."""
    front = fn.rstrip("_").replace("_backward", "")
    if front in NO_BACKWARD:
        return ValueError(
            f"{fn}: {name} requires grad, but xpkernels.{front} has no backward "
            f"({NO_BACKWARD[front]})"
        )
    return ValueError(
        f"{fn}: {name} requires grad, but the in-place {fn} records no autograd, so its "
        f"gradient would be lost; call the allocating xpkernels.{front}(...) (which records "
        f"xpkernels' backward for loss.backward()), or run {fn} under torch.no_grad()"
    )


def _check_no_tangent(torch, fn: str, tensors) -> None:
    """NotImplementedError for a dual tensor (forward-mode AD): its tangent would be dropped."""
    forward_ad = torch.autograd.forward_ad
    if forward_ad._current_level < 0:  # no dual level open: no tensor carries a tangent
        return
    for name, t in tensors:
        if forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{fn}: {name} carries a forward-mode AD tangent, but xpkernels implements "
                "reverse mode only (loss.backward(), torch.autograd.grad); the tangent would be "
                "lost"
            )


def check_inplace(fn: str, arrays: dict, score_mod=None) -> None:
    """Refuse an in-place call that would drop a gradient or read a meta tensor.

    Parameters
    ----------
    fn : str
        The front's name, for messages.
    arrays : dict
        Argument name -> array, Duplicated or None: every array the call
        reads or writes.
    score_mod : ScoreMod or callable, optional
        Its captured arrays are checked too.

    Raises
    ------
    ValueError
        A torch tensor requires grad while grad mode is on (names it).
    TypeError
        A torch tensor is a meta tensor (names it).
    NotImplementedError
        A torch tensor carries a forward-mode AD tangent (names it).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    tensors = _torch_tensors({**arrays, **_mod_arrays(score_mod)})
    _check_meta(fn, tensors)
    _check_no_tangent(torch, fn, tensors)
    if torch.is_grad_enabled():
        for name, t in tensors:
            if t.requires_grad:
                raise requires_grad_error(fn, name)


def record(op: str, arrays: dict, options: dict):
    """Run an allocating front through its autograd-recording torch op when that applies.

    Parameters
    ----------
    op : str
        The primitive (``"rms_norm"``...).
    arrays : dict
        Argument name -> array, Duplicated or None, in the front's order.
    options : dict
        The front's keyword options.

    Returns
    -------
    The op's result (what the front returns), or :data:`NOT_RECORDED` when
    the arrays are not torch tensors or nothing needs a gradient.

    Raises
    ------
    TypeError, NotImplementedError
        As :func:`check_inplace`: a meta tensor, a forward-mode AD tangent.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return NOT_RECORDED
    tensors = _call_tensors(arrays, options.get("score_mod"))
    if not tensors:
        return NOT_RECORDED
    _check_meta(op, tensors)
    _check_no_tangent(torch, op, tensors)
    if not _requires_grad(torch, tensors) and not torch.compiler.is_compiling():
        return NOT_RECORDED
    # Loads the torch plug-in by name on first use (it registers the ops and files its
    # recorders here); read RECORDERS only after it, so torch.compile sees it filled.
    from . import _torch_plugin  # noqa: F401

    return RECORDERS[op](op, arrays, options)
