// Device code shared by the cupy backend's kernels. NVRTC-clean: no system headers.
//
// Rules every kernel of this backend follows (DESIGN section 12):
//   - only *_sync warp intrinsics, with explicit masks;
//   - __syncthreads only in block-uniform control flow;
//   - a warp leaves only as a whole, before any warp collective;
//   - dynamic shared memory only through xk::dynamic_smem<T>() below.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace xk {

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// V consecutive elements moved by one load or store (128 bits when V * sizeof(T) == 16).
template <typename T, int V> struct alignas(sizeof(T) * V) Vec { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
    const Vec<T, V> r = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_float(r.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
    Vec<T, V> r;
#pragma unroll
    for (int i = 0; i < V; ++i) r.v[i] = from_float<T>(in[i]);
    *reinterpret_cast<Vec<T, V>*>(p) = r;
}

// V elements of the vector p at col, or `fill` in each when p is null.
template <typename T, int V>
__device__ __forceinline__ void load_or(const T* p, int col, float fill, float (&out)[V]) {
    if (p != nullptr) {
        load_vec<T, V>(p + col, out);
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = fill;
    }
}

// Sum over the 32 lanes of a full warp; every lane gets the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, blockDim.y == 1).
// Every thread of the block calls it; `scratch` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // an earlier call may still read scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// Sums of two values over a block, as block_sum (one pair of barriers for both);
// `scratch` is 32 float2 of shared memory.
__device__ __forceinline__ void block_sum2(float& a, float& b, float2* scratch) {
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // an earlier call may still read scratch
    if (lane == 0) scratch[warp] = make_float2(a, b);
    __syncthreads();
    const float2 mine = lane < warps ? scratch[lane] : make_float2(0.0f, 0.0f);
    a = warp_sum(mine.x);
    b = warp_sum(mine.y);
}

// The row of the calling thread when a block (X, R) takes R rows: blockIdx.x * R + threadIdx.y.
__device__ __forceinline__ long long thread_row() {
    return (long long)blockIdx.x * blockDim.y + threadIdx.y;
}

// -infinity (NVRTC has no INFINITY macro).
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// Maximum over the 32 lanes of a full warp; every lane gets the same bits.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Maximum over a block, with the calling rules of block_sum; `scratch` is 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // an earlier call may still read scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : neg_inf());
}

// The launch's dynamic shared memory (16-byte aligned), declared in this one place.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
    extern __shared__ __align__(16) unsigned char xk_dynamic_smem[];
    return reinterpret_cast<T*>(xk_dynamic_smem);
}

}  // namespace xk
