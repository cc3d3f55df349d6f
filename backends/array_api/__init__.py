"""The portable fallback, written against the Array API standard.

Runs unchanged on NumPy, PyTorch (any device), CuPy and array_api_strict
arrays. Rows and attention tiles are processed in blocks so the extra memory
of a call is bounded by ``_blocks.BLOCK_ELEMENTS``, not by the input size.
"""
