"""A torch tensor whose values must not be read on the host: the capture-safety guard.

A launch path that reads a device value on the host (``.item()``, ``bool(t)``,
``.cpu()``, ...) synchronises the stream and cannot be captured in a CUDA
graph, which would freeze the value it read. :func:`no_host_reads` gives a
view of a tensor that raises :class:`HostRead` on any such read; integer and
bool results of operations on it stay guarded, so a value derived from it
(``lengths.max()``) is caught too. Torch is imported when the guard is built.
"""

from __future__ import annotations

import functools

__all__ = ["FORBIDDEN", "HostRead", "no_host_reads"]

#: The tensor methods and conversions that read values on the host.
FORBIDDEN = (
    "item",
    "__bool__",
    "__int__",
    "__index__",
    "__float__",
    "tolist",
    "cpu",
    "numpy",
    "__array__",
)


class HostRead(AssertionError):
    """A device value was read on the host."""


@functools.cache
def _guarded_class():
    import torch

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"host read of a device value: Tensor.{name}")

        return method

    class NoHostReads(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in FORBIDDEN:
                raise HostRead(f"host read of a device value: {func.__name__}")
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))

            def wrap(x):
                if isinstance(x, torch.Tensor) and not x.is_floating_point():
                    return x.as_subclass(cls)
                return x

            return tuple(wrap(x) for x in out) if isinstance(out, tuple) else wrap(out)

    for name in FORBIDDEN:
        setattr(NoHostReads, name, refuse(name))
    return NoHostReads


def no_host_reads(t):
    """``t`` (a torch tensor) as a view whose host reads raise :class:`HostRead`."""
    return t.as_subclass(_guarded_class())
