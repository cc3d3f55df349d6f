"""The Triton backend: PyTorch tensors on CUDA, and on CPU through the Triton interpreter.

One module per primitive, each providing what ``xpkernels.backends.protocol``
declares for it (``forward``, ``backward`` and the hooks ``BACKEND`` lists).
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

import os

from xpkernels.backends.protocol import Backend, Capability

_DTYPES = ("float32", "float16", "bfloat16")
_NORM = Capability(dtypes=_DTYPES, hooks=("partials", "reduce_partials"))
_ATTENTION_HEAD_DIM = 256


def device_problem(device: str) -> str | None:
    """Why Triton kernels cannot run on torch tensors of this device kind here, or None.

    Imports torch only for ``"cuda"`` (routing asks only for torch calls).
    """
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "torch CPU tensors run Triton kernels only through the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing xpkernels' triton kernels"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "torch reports no CUDA device"
    return None


#: The declaration routing reads (``xpkernels.backends.protocol``). The
#: attention backward computes dQ in its own pass: no ``dq_accum`` scratch.
BACKEND = Backend(
    name="triton",
    namespaces=("torch",),
    devices=("cuda", "cpu"),
    module=__name__,
    requires=("torch", "triton"),
    ops={
        "rms_norm": _NORM,
        "layer_norm": _NORM,
        "softmax": Capability(dtypes=_DTYPES),
        "swiglu": Capability(dtypes=_DTYPES),
        "geglu": Capability(dtypes=_DTYPES),
        "rope": Capability(dtypes=_DTYPES),
        "cross_entropy": Capability(dtypes=_DTYPES),
        "attention": Capability(
            dtypes=_DTYPES, max_head_dim=_ATTENTION_HEAD_DIM, scratch=("delta",)
        ),
        "attention_varlen": Capability(
            dtypes=_DTYPES, max_head_dim=_ATTENTION_HEAD_DIM, scratch=("delta",)
        ),
        "decode_attention": Capability(
            dtypes=_DTYPES, max_head_dim=_ATTENTION_HEAD_DIM, hooks=("default_splits",)
        ),
        "merge_attention_states": Capability(dtypes=_DTYPES, max_head_dim=_ATTENTION_HEAD_DIM),
        "flex_attention": Capability(
            dtypes=_DTYPES,
            max_head_dim=_ATTENTION_HEAD_DIM,
            scratch=("delta",),
            hooks=("default_tiles", "score_mod_workspace"),
        ),
        "flex_attention_varlen": Capability(
            dtypes=_DTYPES,
            max_head_dim=_ATTENTION_HEAD_DIM,
            scratch=("delta",),
            hooks=("default_tiles", "score_mod_workspace"),
        ),
    },
    device_problem=device_problem,
)
