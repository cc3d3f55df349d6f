"""The CuPy backend: CUDA C kernels (``<primitive>.cu``, shared device code in ``.cuh``).

Launchers (``<primitive>.py``) are written against the small module-loader
interface of :mod:`._loader`, so the same launchers and ``.cu`` files run on
a GPU through ``cupy.RawModule`` (NVRTC) and on the CPU through
:mod:`xpkernels.testing.cudacpu` (``with cudacpu.emulate(): ...``). Only CuPy
is imported on the GPU path: no torch, no triton.
"""
