"""The CUDA-C-on-CPU harness: execution model, error detection, sanitizers, compile errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _cuda_checks import nvrtc_report

from xpkernels.testing import cudacpu

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="cudacpu needs Linux (ucontext, GNU ld)"
)

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

extern "C" __global__ void reverse_sum(float* out, const float* in) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = in[blockIdx.x * 64 + t];
    __syncthreads();
    float v = buf[63 - t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[blockIdx.x * 64 + t] = v;
}

// Block 0 writes shared memory; every later block reads it without writing.
extern "C" __global__ void stale_shared(float* out) {
    __shared__ float buf[32];
    extern __shared__ __align__(16) float dyn[];
    const int t = threadIdx.x;
    if (blockIdx.x == 0) { buf[t] = 42.0f; dyn[t] = 42.0f; }
    out[blockIdx.x * 64 + t] = buf[t];
    out[blockIdx.x * 64 + 32 + t] = dyn[t];
}

extern "C" __global__ void shuffles(int* out) {
    const int lane = threadIdx.x;
    int* o = out + 8 * lane;
    o[0] = __shfl_sync(0xffffffffu, lane * 10, 3);
    o[1] = __shfl_down_sync(0xffffffffu, lane, 4, 16);
    o[2] = __shfl_up_sync(0xffffffffu, lane, 1);
    o[3] = __shfl_xor_sync(0xffffffffu, lane, 1);
    o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    o[5] = __all_sync(0xffffffffu, lane < 32) + 2 * __any_sync(0xffffffffu, lane == 7);
    o[6] = -1;
    if (lane < 16) o[6] = __shfl_sync(0x0000ffffu, lane, 15 - lane);  // a half warp, mask says so
    __syncwarp(0xffffffffu);
    o[7] = __shfl_sync(0xffffffffu, 1.5f, 0) == 1.5f;
}

extern "C" __global__ void partial_warp(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // lanes 16..31 never arrive
    __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" __global__ void after_return(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

extern "C" __global__ void divergent_barrier(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void atomics(float* fsum, int* isum, int* imax, int* cas_count) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(fsum, 0.5f);
    atomicAdd(isum, g);
    atomicMax(imax, (g * 37) % 101);
    int old = *cas_count, seen;
    while ((seen = atomicCAS(cas_count, old, old + 1)) != old) old = seen;
}

extern "C" __global__ void convert(const float* in, __half* h, __nv_bfloat16* b, float* h_back,
                                   float* b_back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = __float2half_rn(in[i]);
    b[i] = __float2bfloat16_rn(in[i]);
    h_back[i] = __half2float(h[i]);
    b_back[i] = __bfloat162float(b[i]);
}

extern "C" __global__ void scalars(float* out, int i, long long j, float f, double d) {
    out[0] = i; out[1] = (float)j; out[2] = f; out[3] = (float)d;
}

// One warp: C (16 x 16, float) = A (16 x 32) @ B (32 x 16), fragments opaque.
template <typename T>
__global__ void wmma_gemm(const T* a, const T* b, float* c, float scale) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < 32; k += 16) {
        wmma::load_matrix_sync(fa, a + k, 32);
        wmma::load_matrix_sync(fb, b + k, 32);  // b is (16 x 32) row-major == B^T
        wmma::mma_sync(acc, fa, fb, acc);
    }
    for (int e = 0; e < acc.num_elements; ++e) acc.x[e] *= scale;
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}
"""

EXPRESSIONS = [
    "reverse_sum",
    "stale_shared",
    "shuffles",
    "partial_warp",
    "after_return",
    "divergent_barrier",
    "atomics",
    "convert",
    "scalars",
    "wmma_gemm<__half>",
    "wmma_gemm<__nv_bfloat16>",
]


@pytest.fixture(scope="module")
def module():
    return cudacpu.RawModule(code=SOURCE, name_expressions=EXPRESSIONS)


def test_barrier_shared_and_butterfly(module):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(128, np.float32)
    module.get_function("reverse_sum")((2,), (64,), (y, x))
    expected = np.concatenate(
        [np.full(32, x[b * 64 + 32 : b * 64 + 64].sum()) for b in (0, 1)]
        + [np.full(32, x[b * 64 : b * 64 + 32].sum()) for b in (0, 1)]
    )
    np.testing.assert_array_equal(y.reshape(2, 2, 32)[:, 0], expected[:64].reshape(2, 32))
    np.testing.assert_array_equal(y.reshape(2, 2, 32)[:, 1], expected[64:].reshape(2, 32))


def test_shared_memory_is_garbage_in_every_block(module):
    out = np.zeros((4, 64), np.float32)
    module.get_function("stale_shared")((4,), (32,), (out,), shared_mem=32 * 4)
    np.testing.assert_array_equal(out[0], 42.0)
    assert not np.any(out[1:] == 42.0), "a later block saw block 0's shared memory"
    assert len(np.unique(out[1:, :32])) > 16, "static shared memory was not refilled with garbage"
    assert len(np.unique(out[1:, 32:])) > 16, "dynamic shared memory was not refilled with garbage"


def test_shuffles_and_votes_with_masks(module):
    out = np.zeros((32, 8), np.int32)
    module.get_function("shuffles")((1,), (32,), (out,))
    lane = np.arange(32)
    np.testing.assert_array_equal(out[:, 0], 30)
    np.testing.assert_array_equal(out[:, 1], np.where(lane % 16 + 4 < 16, lane + 4, lane))
    np.testing.assert_array_equal(out[:, 2], np.where(lane >= 1, lane - 1, lane))
    np.testing.assert_array_equal(out[:, 3], lane ^ 1)
    ballot = sum(1 << int(i) for i in lane if i % 3 == 0)
    np.testing.assert_array_equal(out[:, 4].view(np.uint32), ballot)
    np.testing.assert_array_equal(out[:, 5], 3)
    np.testing.assert_array_equal(out[:, 6], np.where(lane < 16, 15 - lane, -1))
    np.testing.assert_array_equal(out[:, 7], 1)


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        ("partial_warp", "deadlock"),
        ("after_return", "returned"),
        ("divergent_barrier", "divergent __syncthreads"),
    ],
)
@pytest.mark.parametrize("mode", ["fibers", "threads"])
def test_collective_errors_are_reported_not_hung(module, kernel, message, mode):
    m = (
        module
        if mode == "fibers"
        else cudacpu.RawModule(code=SOURCE, name_expressions=EXPRESSIONS, mode=mode)
    )
    out = np.zeros(32, np.float32)
    with pytest.raises(cudacpu.LaunchError, match=message) as info:
        m.get_function(kernel)((1,), (32,), (out,))
    assert re.search(r"code_\w+\.cu:\d+", str(info.value)), "the message names the source line"


def test_atomics(module):
    fsum, isum = np.zeros(1, np.float32), np.zeros(1, np.int32)
    imax, count = np.zeros(1, np.int32), np.zeros(1, np.int32)
    module.get_function("atomics")((3,), (64,), (fsum, isum, imax, count))
    g = np.arange(192)
    assert fsum[0] == 96.0 and isum[0] == g.sum() and imax[0] == ((g * 37) % 101).max()
    assert count[0] == 192


def test_half_and_bfloat16_conversions(module):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 reference needs ml_dtypes")
    rng = np.random.default_rng(0)
    specials = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        65520.0,
        1e-8,
        6e-8,
        2.0**-24 * 1.5,
        np.inf,
        -np.inf,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        1.0 + 2.0**-8,
        3.0e38,
        np.nan,
    ]
    x = np.concatenate(
        [np.array(specials, np.float32), rng.standard_normal(200).astype(np.float32) * 1000]
    ).astype(np.float32)
    n = x.size
    h, b = np.empty(n, np.float16), np.empty(n, np.uint16)
    h_back, b_back = np.empty(n, np.float32), np.empty(n, np.float32)
    module.get_function("convert")((2,), (128,), (x, h, b, h_back, b_back, np.int32(n)))
    with np.errstate(over="ignore"):  # 65520 and 3e38 round to inf in float16, as on the GPU
        ref_h = x.astype(np.float16)
    np.testing.assert_array_equal(h, ref_h)
    np.testing.assert_array_equal(
        b.view(ml_dtypes.bfloat16).astype(np.float32),
        x.astype(ml_dtypes.bfloat16).astype(np.float32),
    )
    np.testing.assert_array_equal(h_back, ref_h.astype(np.float32))
    np.testing.assert_array_equal(b_back, x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_scalar_arguments_must_have_the_parameter_type(module):
    out = np.zeros(4, np.float32)
    k = module.get_function("scalars")
    k((1,), (1,), (out, np.int32(3), np.int64(1 << 40), np.float32(2.5), np.float64(0.25)))
    np.testing.assert_array_equal(out, [3, 2.0**40, 2.5, 0.25])
    with pytest.raises(TypeError, match="NumPy scalars"):
        k((1,), (1,), (out, 3, np.int64(1), np.float32(0), np.float64(0)))
    with pytest.raises(TypeError, match="takes np.int32, got np.int64"):
        k((1,), (1,), (out, np.int64(3), np.int64(1), np.float32(0), np.float64(0)))
    with pytest.raises(TypeError, match="0xffffffff"):
        k((1,), (1,), (None, np.int32(3), np.int64(1), np.float32(0), np.float64(0)))
    with pytest.raises(TypeError, match="takes 5 arguments"):
        k((1,), (1,), (out,))


@pytest.mark.parametrize("ctype", ["__half", "__nv_bfloat16"])
def test_wmma_matches_numpy_matmul(module, ctype):
    if ctype == "__half":
        dtype, bits = np.float16, np.float16
    else:
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 inputs need ml_dtypes")
        dtype, bits = ml_dtypes.bfloat16, np.uint16
    rng = np.random.default_rng(1)
    a = cudacpu.empty((16, 32), dtype)
    b = cudacpu.empty((16, 32), dtype)
    a[...] = rng.standard_normal((16, 32))
    b[...] = rng.standard_normal((16, 32))
    c = cudacpu.empty((16, 16), np.float32)
    module.get_function(f"wmma_gemm<{ctype}>")(
        (1,), (32,), (a.view(bits), b.view(bits), c, np.float32(2.0))
    )
    expected = 2.0 * a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4)


def test_wmma_refuses_misaligned_matrices(module):
    raw = cudacpu.empty((16 * 32 + 8,), np.float16)
    a = raw[8:].reshape(16, 32)  # 16 bytes past a 256-byte boundary
    b = cudacpu.empty((16, 32), np.float16)
    c = cudacpu.empty((16, 16), np.float32)
    with pytest.raises(cudacpu.LaunchError, match="32-byte"):
        module.get_function("wmma_gemm<__half>")((1,), (32,), (a, b, c, np.float32(1.0)))


def test_aligned_allocator():
    for shape, dtype in [((3, 5), np.float16), ((7,), np.float32), ((0,), np.float32)]:
        a = cudacpu.empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % cudacpu.ALIGNMENT == 0
    np.testing.assert_array_equal(cudacpu.zeros((4, 4)), 0)


def test_compile_error_names_the_source_and_carries_the_log(tmp_path):
    bad = tmp_path / "broken_kernel.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(cudacpu.CompileError) as info:
        cudacpu.RawModule(path=str(bad))
    text = str(info.value)
    assert "broken_kernel.cu" in text and "undefined_name" in text and "error" in text


def test_unknown_kernel_and_options_are_refused(module):
    with pytest.raises(KeyError, match="no kernel 'missing'"):
        module.get_function("missing")
    with pytest.raises(ValueError, match="not understood"):
        cudacpu.RawModule(code=SOURCE, options=("--frobnicate",))


def test_dynamic_shared_memory_limit_needs_opt_in(module):
    k = cudacpu.RawModule(code=SOURCE, name_expressions=EXPRESSIONS).get_function("stale_shared")
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(cudacpu.LaunchError, match="max_dynamic_shared_size_bytes"):
        k((1,), (32,), (out,), shared_mem=64 * 1024)
    k.max_dynamic_shared_size_bytes = 64 * 1024
    k((1,), (32,), (out,), shared_mem=64 * 1024)


def test_cache_dir_is_overridable_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XPKERNELS_CUDACPU_CACHE", str(tmp_path))
    code = 'extern "C" __global__ void one(float* x) { x[threadIdx.x] = 1.0f; }\n'
    cudacpu.RawModule(code=code)
    modules = sorted(p.name for p in tmp_path.glob("module_*.so"))
    assert len(modules) == 1
    cudacpu.RawModule(code=code, options=("--use_fast_math",))
    assert sorted(p.name for p in tmp_path.glob("module_*.so")) == modules


# ---------------------------------------------------------------- planted bugs

RACE = r"""
extern "C" __global__ void shift(float* out, const float* in) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = in[t];
    out[t] = t > 0 ? buf[t - 1] : 0.0f;  // planted bug: no __syncthreads() before reading
}
extern "C" __global__ void past_the_end(float* out, int n) {
    const int t = threadIdx.x;
    if (t <= n) out[t] = 1.0f;  // planted bug: should be t < n
}
"""


def _expected_shift(x):
    return np.concatenate([[0.0], x[:-1]]).astype(np.float32)


def test_missing_syncthreads_is_caught_by_the_shuffled_schedule():
    x = np.arange(1, 65, dtype=np.float32)
    y = np.empty(64, np.float32)
    cudacpu.RawModule(code=RACE, schedule="default").get_function("shift")((1,), (64,), (y, x))
    np.testing.assert_array_equal(y, _expected_shift(x))  # index order hides the race
    cudacpu.RawModule(code=RACE, schedule="shuffled").get_function("shift")((1,), (64,), (y, x))
    assert not np.array_equal(y, _expected_shift(x)), "the shuffled schedule exposes the race"


def _run_sanitized(kind: str, kernel: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "planted.py"
    script.write_text(
        textwrap.dedent(f"""
        import numpy as np
        from xpkernels.testing import cudacpu
        RACE = {RACE!r}
        m = cudacpu.RawModule(code=RACE)
        x = cudacpu.empty(64, np.float32); x[:] = 1.0
        y = cudacpu.empty(64, np.float32)
        if {kernel!r} == "shift":
            m.get_function("shift")((1,), (64,), (y, x))
        else:
            m.get_function("past_the_end")((1,), (65,), (y, np.int32(64)))
        print("finished without a report")
    """)
    )
    env = {**os.environ, **cudacpu.sanitizer_env(kind)}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )


def test_missing_syncthreads_is_caught_by_thread_sanitizer(tmp_path):
    proc = _run_sanitized("thread", "shift", tmp_path)
    assert "ThreadSanitizer: data race" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"\.cu:5\b", proc.stderr) and re.search(
        r"\.cu:6\b", proc.stderr
    )  # write, read
    assert "finished without a report" not in proc.stdout


def test_out_of_bounds_write_is_caught_by_address_sanitizer(tmp_path):
    proc = _run_sanitized("address", "past_the_end", tmp_path)
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"\.cu:10\b", proc.stderr)
    assert proc.returncode != 0


def test_sanitized_module_needs_its_runtime():
    with pytest.raises(RuntimeError, match="sanitizer_env"):
        cudacpu.RawModule(code=RACE, sanitize="thread")


# ---------------------------------------------------------------- NVRTC (issue 13, item 5a)


def test_every_cupy_source_compiles_with_nvrtc_without_warnings_or_spills():
    report = nvrtc_report()
    assert report.sources(), "backends/cupy has .cu sources"
    for cu in report.sources():
        expected = set(report.name_expressions(cu))
        for arch in report.ARCHES:
            entry = report.compile_source(cu, arch)
            assert entry["ok"], f"{cu.name} {arch}:\n{entry['log']}"
            assert not entry["warnings"], f"{cu.name} {arch}: NVRTC warnings:\n{entry['log']}"
            assert expected <= set(entry["kernels"]), (
                f"{cu.name} {arch}: kernels missing from ptxas -v"
            )
            for name, k in entry["kernels"].items():
                assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (
                    f"{arch} {name}: {k}"
                )
                # row kernels with 16-byte vectors: <T, ..., V, C> with V * sizeof(T) == 16
                # (decode reads a row as 32 coalesced elements per instruction, no vectors)
                row_kernel = name.startswith(("rms_norm_", "layer_norm_", "softmax_"))
                if row_kernel and re.search(
                    r"<(float,(\w+,)*4|__(half|nv_bfloat16),(\w+,)*8),\d+>$", name
                ):
                    assert k["global_load_bits"] == 128 and k["global_store_bits"] == 128, (
                        f"{name}: {k}"
                    )
