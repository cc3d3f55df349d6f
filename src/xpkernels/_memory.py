"""Memory layouts of arrays of any namespace, for overlap and identity checks (host-side only).

:func:`layout` gives a NumPy array with another array's byte layout
(address, shape, strides) without touching its memory, so ``np.shares_memory``
compares device arrays exactly; :func:`same_memory` says whether two arrays
are views of the very same elements, whatever Python objects hold them;
:func:`self_overlapping` whether two elements of one array share memory (a
broadcast view's zero strides, rows closer than their length).
"""

from __future__ import annotations

import array_api_compat
import numpy as np

__all__ = ["identical", "layout", "same_memory", "self_overlapping", "torch_numpy_view"]


# A stand-in for the whole address space: NumPy views of it reproduce any array's byte layout
# (address, shape, strides) without touching memory, so np.shares_memory can compare the
# layouts of device arrays exactly. Nothing ever reads through it.
_ADDRESS_SPACE = np.lib.stride_tricks.as_strided(
    np.zeros(1, np.uint8), shape=(2**62,), strides=(1,)
)


def layout(a):
    """A NumPy array with ``a``'s memory layout, or None when ``a`` has no inspectable memory."""
    raw = getattr(a, "_array", a)
    if isinstance(raw, np.ndarray):
        return raw if raw.size else None
    if array_api_compat.is_torch_array(a):
        if a.device.type == "meta" or a.numel() == 0:
            return None
        try:
            address = a.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake tensors under torch.compile
            return None
        itemsize = a.element_size()
        byte_strides = tuple(st * itemsize for st in a.stride())
    elif array_api_compat.is_cupy_array(a):
        if a.size == 0:
            return None
        address, itemsize, byte_strides = a.data.ptr, a.itemsize, tuple(a.strides)
    else:
        return None
    if address == 0:
        return None
    return np.lib.stride_tricks.as_strided(
        _ADDRESS_SPACE[address:], shape=(*a.shape, itemsize), strides=(*byte_strides, 1)
    )


def torch_numpy_view(a):
    """A zero-copy NumPy view of ``a`` when it is a plain ``torch.Tensor`` on the CPU that
    NumPy holds (float32/float64, int32/int64, bool) with no autograd record and no conj/neg
    bit; else None. Subclasses (fake, functional, guarded tensors) are never read."""
    if not array_api_compat.is_torch_array(a):
        return None
    import torch

    held = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)
    if type(a) is not torch.Tensor or a.device.type != "cpu" or a.dtype not in held:
        return None
    if a.requires_grad or a.is_conj() or a.is_neg():
        return None
    return a.numpy()


def identical(u, v) -> bool:
    return (
        u.__array_interface__["data"][0] == v.__array_interface__["data"][0]
        and u.shape == v.shape
        and u.strides == v.strides
    )


def same_memory(a, b) -> bool:
    """True when ``a`` and ``b`` are the same array or views of the very same elements (same
    address, shape, strides and dtype), e.g. two slices ``p[0]`` of one parameter buffer."""
    if a is b:
        return True
    if getattr(a, "dtype", None) != getattr(b, "dtype", None):
        return False
    u, v = layout(a), layout(b)
    return u is not None and v is not None and identical(u, v)


#: Work bound of the exact overlap solver (``np.shares_memory``) for tangled layouts.
_MAX_WORK = 100_000


def self_overlapping(a) -> bool:
    """True when two elements of ``a`` share memory (False when ``a`` has no inspectable memory).

    Decided from the strides alone, nothing is read. Axes of length 1 never
    overlap; a zero stride on a longer axis always does. When each axis,
    sorted by stride, steps past everything the shorter-stride axes span
    (any dense or padded layout, permuted or not), nothing overlaps. The
    remaining tangled layouts are decided exactly: two elements that first
    differ in axis ``k`` (equal indices before it) overlap, after a shift,
    as the slab at index 0 of axis ``k`` and the slabs past it, so ``a``
    overlaps itself when ``s[:1]`` and ``s[1:]`` share memory for the slab
    ``s`` of some axis (``np.shares_memory`` with bounded work; a layout too
    hard for it counts as overlapping).
    """
    u = layout(a)
    if u is None:
        return False
    axes = [(abs(st), n) for st, n in zip(u.strides, u.shape) if n > 1]
    if any(st == 0 for st, _ in axes):
        return True
    span = 0
    for st, n in sorted(axes):
        if st <= span:
            return _tangled(u)
        span += st * (n - 1)
    return False


def _tangled(u) -> bool:
    """Exact internal overlap of the layout ``u`` (see :func:`self_overlapping`). Only views
    are taken (indexing one element would read it: ``u`` may describe device memory)."""
    for axis in reversed(range(u.ndim)):
        slab = u[(0,) * axis]
        if slab.shape[0] < 2:
            continue
        try:
            if np.shares_memory(slab[:1], slab[1:], max_work=_MAX_WORK):  # type: ignore[arg-type]  # stubs list only -1, 0
                return True
        except np.exceptions.TooHardError:
            return True
    return False
