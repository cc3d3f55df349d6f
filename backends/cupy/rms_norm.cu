// RMSNorm kernels. Per row x of length M, with w' = w + offset (w' = 1 + offset without w):
//   rstd = (sum(x^2) / M + eps)^-1/2,  y = x * rstd * w'
//   x_hat = x * rstd, g = dy * w',  dx = rstd * (g - x_hat * sum(g * x_hat) / M),
//   dw = sum over rows of dy * x_hat   (per-block partials, reduced by rows.cuh's reduce_partials)
// T: the dtype of x, y, dy, dx; TW: the dtype of w. Accumulation in float32.
// V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the two passes over a row (rows.cuh).
#include "rows.cuh"

namespace {

using xk::load_vec;
using xk::store_vec;

template <typename TW, int V>
__device__ __forceinline__ void load_weight(const TW* w, int col, float offset, float (&out)[V]) {
    xk::load_or<TW, V>(w, col, 1.0f, out);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] += offset;
}

// y = x * rstd * w' over the share's columns of one row; returns rstd.
template <typename T, typename TW, typename Share>
__device__ __forceinline__ float forward_row(
    const Share& share, T* yr, const T* xr, const TW* w, float eps, float offset) {
    constexpr int V = Share::V;
    float v[Share::C][V];
    float sum_sq = 0.0f;
    share.load(xr, v, [&](int, const float (&u)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) sum_sq += u[i] * u[i];
    });
    const float r = rsqrtf(share.sum(sum_sq) / (float)max(share.m, 1) + eps);
    share.each(xr, v, [&](int col, const float (&u)[V]) {
        float wv[V];
        load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
        for (int i = 0; i < V; ++i) wv[i] *= u[i] * r;
        store_vec<T, V>(yr + col, wv);
    });
    return r;
}

}  // namespace

// Forward, one warp per row: block (32, R) normalises R rows; rows with M <= 32 * V * C.
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(256) rms_norm_forward_warp(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    const TW* __restrict__ w,        // (M,) weight, or null (w = 1)
    float* __restrict__ rstd,        // (rows,) checkpoint, or null (inference)
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x,              // elements between rows of x
    long long stride_rstd,           // elements between entries of rstd
    float eps,                       // added to the mean square
    float offset)                    // added to w
{
    const long long row = xk::thread_row();
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const float r = forward_row<T, TW>(
        xk::warp_row_share<V, C>(m), y + row * stride_y, x + row * stride_x, w, eps, offset);
    if (rstd != nullptr && threadIdx.x == 0) rstd[row * stride_rstd] = r;
}

// Forward, one block per row: C vectors per thread stay in registers, the rest
// of a longer row is read again in the second pass.
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(1024, 1) rms_norm_forward_block(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    const TW* __restrict__ w,        // (M,) weight, or null (w = 1)
    float* __restrict__ rstd,        // (rows,) checkpoint, or null (inference)
    long long rows,                  // number of rows (== gridDim.x)
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x,              // elements between rows of x
    long long stride_rstd,           // elements between entries of rstd
    float eps,                       // added to the mean square
    float offset)                    // added to w
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float r = forward_row<T, TW>(
        xk::block_row_share<V, C>(m, scratch), y + row * stride_y, x + row * stride_x, w, eps,
        offset);
    if (rstd != nullptr && threadIdx.x == 0) rstd[row * stride_rstd] = r;
}

// Backward, one warp per row: block b of (32, R) threads handles rows
// b * R + warp, stepping gridDim.x * R, and writes dw partial row b (summed
// over its warps in a fixed order through R * M floats of dynamic shared memory).
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(256) rms_norm_backward_warp(
    const T* dy,                     // (rows, M) output gradient
    const T* __restrict__ x,         // (rows, M) forward input
    const TW* __restrict__ w,        // (M,) weight, or null (w = 1)
    const float* __restrict__ rstd,  // (rows,) forward checkpoint
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    float* __restrict__ dw_partial,  // (gridDim.x, M) partial sums of dy * x_hat, or null
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_dy,             // elements between rows of dy
    long long stride_x,              // elements between rows of x
    long long stride_dx,             // elements between rows of dx
    long long stride_rstd,           // elements between entries of rstd
    long long stride_partial_p,      // elements between rows of dw_partial
    long long stride_partial_m,      // elements between columns of dw_partial
    float offset,                    // added to w
    int accumulate)                  // 1: add to dw_partial, 0: overwrite it
{
    const auto share = xk::warp_row_share<V, C>(m);
    float wv[C][V], dw[C][V] = {};
    share.cached([&](int k, int col) { load_weight<TW, V>(w, col, offset, wv[k]); });
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = xk::thread_row(); row < rows; row += (long long)gridDim.x * blockDim.y) {
        const float r = rstd[row * stride_rstd];
        float xh[C][V], g[C][V];
        float dot = 0.0f;
        share.cached([&](int k, int col) {
            load_vec<T, V>(x + row * stride_x + col, xh[k]);
            load_vec<T, V>(dy + row * stride_dy + col, g[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xh[k][i] *= r;
                dw[k][i] += g[k][i] * xh[k][i];
                g[k][i] *= wv[k][i];
                dot += g[k][i] * xh[k][i];
            }
        });
        const float proj = xk::warp_sum(dot) * inv_m;
        share.cached([&](int k, int col) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = r * (g[k][i] - xh[k][i] * proj);
            store_vec<T, V>(dx + row * stride_dx + col, out);
        });
    }
    if (dw_partial == nullptr) return;  // uniform over the block
    float* part = xk::dynamic_smem<float>();
    xk::stash_warp_sums(share, part, dw);
    __syncthreads();
    xk::flush_warp_sums(part, dw_partial + blockIdx.x * stride_partial_p, stride_partial_m, m,
                        accumulate);
}

// Backward, one block per row: block b handles rows b, b + gridDim.x, ...;
// thread t owns the same columns in every row, so its dw sums need no
// synchronisation. They live in dynamic shared memory (M floats) when
// `smem_acc` is set, else directly in the block's dw_partial row. At most 512
// threads, so the x and dy vectors kept per thread fit in registers.
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(512, 1) rms_norm_backward_block(
    const T* dy,                     // (rows, M) output gradient
    const T* __restrict__ x,         // (rows, M) forward input
    const TW* __restrict__ w,        // (M,) weight, or null (w = 1)
    const float* __restrict__ rstd,  // (rows,) forward checkpoint
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    float* __restrict__ dw_partial,  // (gridDim.x, M) partial sums of dy * x_hat, or null
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_dy,             // elements between rows of dy
    long long stride_x,              // elements between rows of x
    long long stride_dx,             // elements between rows of dx
    long long stride_rstd,           // elements between entries of rstd
    long long stride_partial_p,      // elements between rows of dw_partial
    long long stride_partial_m,      // elements between columns of dw_partial (1 unless smem_acc)
    float offset,                    // added to w
    int accumulate,                  // 1: add to dw_partial, 0: overwrite it
    int smem_acc)                    // 1: sum dw in M floats of dynamic shared memory
{
    __shared__ float scratch[32];
    const auto share = xk::block_row_share<V, C>(m, scratch);
    float* partial_row = dw_partial == nullptr ? nullptr : dw_partial + blockIdx.x * stride_partial_p;
    float* acc = partial_row;
    long long acc_stride = stride_partial_m;
    if (partial_row != nullptr && smem_acc) {
        acc = xk::dynamic_smem<float>();
        acc_stride = 1;
    }
    const xk::ColumnSums dw{partial_row, stride_partial_m, acc, acc_stride};
    xk::start_sums(share, accumulate, dw);
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        T* dxr = dx + row * stride_dx;
        float xv[C][V], dv[C][V];
        float dot = 0.0f;
        share.load2(xr, xv, dyr, dv, [&](int col, const float (&xs)[V], const float (&ds)[V]) {
            float wv[V];
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) dot += ds[i] * wv[i] * xs[i];
        });
        const float proj = share.sum(dot) * r * inv_m;  // sum(g * x_hat) / M
        share.each2(xr, xv, dyr, dv, [&](int col, const float (&xs)[V], const float (&ds)[V]) {
            float wv[V], out[V], xh[V];
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xh[i] = xs[i] * r;
                out[i] = r * (ds[i] * wv[i] - xh[i] * proj);
            }
            dw.add(col, ds, xh);
            store_vec<T, V>(dxr + col, out);
        });
    }
    xk::finish_sums(share, dw);
}
