"""The functional ops on the Triton backend trace into their kernels (``torch.library.triton_op``).

No GPU runs here. A subprocess imports the Triton kernels compiled (no
``TRITON_INTERPRET``), lets routing accept fake CPU tensors for the Triton
backend (the one thing a GPU would provide: a device to run on), and exports
each functional forward and backward op with
``run_decompositions(decompose_custom_triton_ops=True)`` -- the functional
decomposition ``torch.compile``'s AOTAutograd applies. The graph must hold
only aten ops and ``triton_kernel_wrapper_functional`` nodes: every launch
went through ``wrap_triton``, and the implementation ran on fake tensors (no
``.item()``, NumPy or device query could have run). Calls that route
elsewhere must stay the opaque custom op.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="the torch ops need torch")
# Looked up, not imported: importing triton here, while tests are collected, would define
# Triton kernels before another module's select_triton_interpreter() sets TRITON_INTERPRET.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the triton_op twins need triton"
)

_SCRIPT = textwrap.dedent(
    r"""
    import dataclasses, json, sys, warnings
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    import xpkernels.torch  # noqa: F401  (defines the ops)
    from xpkernels import registry
    from xpkernels.backends.triton import _attn_common

    spec = registry._BY_NAME["triton"]
    registry._BY_NAME["triton"] = dataclasses.replace(spec, device_problem=lambda device: None)
    ops = torch.ops.xpkernels
    T = "triton"

    def rms(x, w, dy):
        y, rstd = ops.rms_norm(x, w, 1e-6, 0.5, T)
        return (y, *ops.rms_norm_backward(dy, x, w, rstd, 0.5, True, T))

    def rms_no_weight(x, dy):
        y, rstd = ops.rms_norm(x, None, 1e-6, 0.0, T)
        return (y, *ops.rms_norm_backward(dy, x, None, rstd, 0.0, False, T))

    def ln(x, w, b, dy):
        y, mean, rstd = ops.layer_norm(x, w, b, 1e-5, T)
        return (y, *ops.layer_norm_backward(dy, x, w, b, mean, rstd, True, True, T))

    def smax(x, dy):
        y = ops.softmax(x, T)
        return y, ops.softmax_backward(dy, y, T)

    def attn(q, k, v, do, k_lengths, pos):
        o, m, l = ops.attention(q, k, v, pos, None, k_lengths, True, None, 0, T)
        dq, dk, dv = ops.attention_backward(do, q, k, v, o, pos, None, k_lengths, m, l, True, None, 0, T)
        return o, dq, dk, dv

    def decode(q, k_cache, v_cache, lengths):
        return ops.decode_attention(q, k_cache, v_cache, lengths, None, None, None, None, 2, T)

    def merge(o_a, m_a, l_a, o_b, m_b, l_b, do, dm, dl):
        o, m, l = ops.merge_attention_states(o_a, m_a, l_a, o_b, m_b, l_b, T)
        return (o, m, l, *ops.merge_attention_states_backward(
            do, dm, dl, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, T))

    def opaque(x, w):
        return ops.rms_norm(x, w, 1e-6, 0.0, None)

    cases = {
        "rms_norm": (rms, lambda: (f(6, 96), f(96), f(6, 96))),
        "rms_norm_wide_bf16": (rms, lambda: (f(3, 40000, bf16), f(40000, bf16), f(3, 40000, bf16))),
        "rms_norm_no_weight": (rms_no_weight, lambda: (f(2, 3, 64), f(2, 3, 64))),
        "layer_norm": (ln, lambda: (f(5, 80), f(80), f(80), f(5, 80))),
        "softmax": (smax, lambda: (f(7, 33), f(7, 33))),
        "attention": (attn, lambda: (f(2, 4, 40, 32), f(2, 2, 56, 32), f(2, 2, 56, 16), f(2, 4, 40, 16),
                                     i((2,)), i((2,)))),
        "attention_autotuned_bf16": (attn, lambda: (f(1, 2, 64, 64, bf16), f(1, 1, 64, 64, bf16),
                                                    f(1, 1, 64, 64, bf16), f(1, 2, 64, 64, bf16),
                                                    i((1,)), i((1,)))),
        "decode_attention": (decode, lambda: (f(2, 4, 64), f(2, 2, 80, 64), f(2, 2, 80, 64), i((2,)))),
        "merge_attention_states": (merge, lambda: (f(2, 3, 16, 32), f(2, 3, 16), f(2, 3, 16),
                                                  f(2, 3, 16, 32), f(2, 3, 16), f(2, 3, 16),
                                                  f(2, 3, 16, 32), f(2, 3, 16), f(2, 3, 16))),
        "array_api_stays_opaque": (opaque, lambda: (f(4, 32), f(32))),
    }

    bf16 = torch.bfloat16

    def f(*shape_dtype):
        *shape, dtype = shape_dtype if isinstance(shape_dtype[-1], torch.dtype) else (*shape_dtype, torch.float32)
        return torch.empty(shape, dtype=dtype)

    def i(shape):
        return torch.empty(shape, dtype=torch.int32)

    class Wrap(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, *args):
            return self.fn(*args)

    # On a GPU, 2-byte attention on large problems launches the autotuned kernels.
    untuned = _attn_common.use_autotune
    result = {}
    for name, (fn, make) in cases.items():
        _attn_common.use_autotune = (lambda work, like: True) if "autotuned" in name else untuned
        mode = FakeTensorMode()
        try:
            with mode, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                args = make()
                ep = torch.export.export(Wrap(fn), args, strict=False)
                ep = ep.run_decompositions(decompose_custom_triton_ops=True)
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {error}"[-2000:]}
            continue
        targets = [str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"]
        result[name] = {
            "kernels": sum("triton_kernel_wrapper_functional" in t for t in targets),
            "xpkernels_ops": sorted({t for t in targets if "xpkernels" in t}),
            "xpkernels_warnings": [str(w.message) for w in caught if "xpkernels" in w.filename],
        }
    json.dump(result, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def traced():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Launches per case: forward (+ backward kernels: delta, dK/dV, dQ; dW/dB reductions, and
# for a 16-bit dW the cast of the reduced float32 row).
_KERNELS = {
    "rms_norm": 3,
    "rms_norm_wide_bf16": 4,
    "rms_norm_no_weight": 2,
    "layer_norm": 4,
    "softmax": 2,
    "attention": 4,
    "attention_autotuned_bf16": 4,
    "decode_attention": 2,
    "merge_attention_states": 2,
}


@pytest.mark.parametrize("case", sorted(_KERNELS))
def test_triton_ops_trace_into_their_kernels(traced, case):
    got = traced[case]
    assert "error" not in got, got.get("error")
    assert got["xpkernels_ops"] == [], f"{case}: opaque ops left in the graph"
    assert got["kernels"] == _KERNELS[case]
    assert got["xpkernels_warnings"] == []


def test_calls_routed_elsewhere_stay_opaque(traced):
    got = traced["array_api_stays_opaque"]
    assert got["kernels"] == 0
    assert got["xpkernels_ops"] == ["xpkernels.rms_norm.default"]


def test_importing_xpkernels_torch_imports_no_triton():
    """TRITON_INTERPRET may be set after ``import xpkernels.torch``: triton must not be imported yet."""
    code = "import sys, xpkernels.torch; print(sorted(m for m in sys.modules if m.startswith('triton')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
