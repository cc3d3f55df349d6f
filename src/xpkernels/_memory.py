"""Memory layouts of arrays of any namespace, for overlap and identity checks (host-side only).

:func:`layout` gives a NumPy array with another array's byte layout
(address, shape, strides) without touching its memory, so ``np.shares_memory``
compares device arrays exactly; :func:`same_memory` says whether two arrays
are views of the very same elements, whatever Python objects hold them.
"""

from __future__ import annotations

import array_api_compat
import numpy as np

__all__ = ["identical", "layout", "same_memory", "torch_numpy_view"]


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
