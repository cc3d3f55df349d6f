"""The Triton backend: PyTorch tensors on CUDA, and on CPU through the Triton interpreter.

One module per primitive, each exposing the functions the front files call
(``forward``, ``backward``, ``partials``, ``reduce_partials`` for the norms).
Kernels take 2-D ``(rows, M)`` views with a contiguous last axis; every other
stride is passed to the kernel, never copied, and row offsets are computed in
int64. Accumulation is float32 whatever the input dtype; outputs are written
in their buffer's dtype.

CPU tensors run only through the Triton interpreter, which Triton chooses
when a kernel is defined: set ``TRITON_INTERPRET=1`` in the environment
before importing ``xpkernels.backends.triton`` (routing then accepts
``backend="triton"`` for CPU tensors; otherwise ``BackendError`` says so).
The interpreter is for testing: it is orders of magnitude slower than the
array_api backend.
"""
