"""Block budget and accumulation dtype shared by the array_api kernels."""

from __future__ import annotations

#: Elements per temporary of one row block (float32: 1 MiB). Every kernel's
#: extra memory is a small multiple of this, whatever the input size.
BLOCK_ELEMENTS = 1 << 18


def row_blocks(rows: int, m: int):
    """``(start, stop)`` ranges covering ``rows`` rows of length ``m`` within the block budget."""
    step = max(1, BLOCK_ELEMENTS // max(m, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def acc_dtype(xp, dtype):
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def to(xp, a, dtype):
    """``a`` as ``dtype`` without a copy when it already is."""
    return a if a.dtype == dtype else xp.astype(a, dtype)


def reduce_partials(partial, out) -> None:
    """``out[:] = sum(partial, axis=0)`` in ``out``'s dtype."""
    import array_api_compat

    xp = array_api_compat.array_namespace(partial, out)
    out[...] = to(xp, xp.sum(partial, axis=0), out.dtype)
