"""Backend implementations, one subpackage per backend and one module per primitive.

Backends receive validated arrays from the front files in ``xpkernels`` and
never allocate what the caller can own. See ``xpkernels.registry`` for the
declared table of backends and their capabilities.
"""
