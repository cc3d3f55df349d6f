"""The debug switch: syncing value checks and NaN-filled fresh buffers.

By default an in-place call that is given every buffer allocates nothing on
the device and reads no device value on the host, so it can be captured in a
CUDA graph (DESIGN section 6). Checks of VALUES held in device arrays
(lengths within range, positions that fit the kernels' index type) would
need such a read; they run only in debug mode, which also fills every buffer
xpkernels allocates with NaN, so a kernel that leaves part of a buffer
unwritten shows it.

Debug mode is on when the environment variable ``XPKERNELS_DEBUG`` is ``1``
(read at each call) or inside ``with xpkernels.debug():``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

__all__ = ["debug", "debug_enabled"]

ENV_VAR = "XPKERNELS_DEBUG"
_SWITCH: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "xpkernels_debug", default=None
)


def debug_enabled() -> bool:
    """True inside ``with debug():`` (unless ``debug(False)`` is innermost) or when ``XPKERNELS_DEBUG=1``."""
    switch = _SWITCH.get()
    if switch is not None:
        return switch
    return os.environ.get(ENV_VAR, "").strip() == "1"


@contextlib.contextmanager
def debug(enabled: bool = True):
    """Turn debug mode on (or, with ``enabled=False``, off) for the calls inside the block.

    In debug mode every call also checks the values of device arrays it is
    given (lengths, positions, captured indices), which reads them on the
    host, and fills the buffers xpkernels allocates with NaN.

    Parameters
    ----------
    enabled : bool
        The state inside the block; it overrides ``XPKERNELS_DEBUG``.
    """
    token = _SWITCH.set(bool(enabled))
    try:
        yield
    finally:
        _SWITCH.reset(token)
