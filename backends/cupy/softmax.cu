// Softmax kernels over rows x of length M:
//   y = exp(x - max(x)) / sum(exp(x - max(x))),   dx = y * (dy - sum(y * dy))
// -inf logits (masked entries) give y = 0. Each thread folds its elements into a
// running (max, sum of exp(x - max)) pair, rescaled when the max grows, so the
// streamed part of a wide row is read once for the statistics; the pairs are
// merged over the warp or block. T: the dtype of x, y, dy, dx. Accumulation in
// float32. V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the passes over a row.
#include "common.cuh"

namespace {

using xk::load_vec;
using xk::store_vec;

// Fold the value u into the running pair (mx, s): s = sum of exp(x - mx) so far.
__device__ __forceinline__ void fold(float u, float& mx, float& s) {
    if (u > mx) {
        s = s * __expf(mx - u) + 1.0f;
        mx = u;
    } else if (mx != xk::neg_inf()) {
        s += __expf(u - mx);
    }
}

// This thread's share of the row sum, rescaled to the row max `row_max`.
__device__ __forceinline__ float rescaled(float mx, float s, float row_max) {
    return mx == xk::neg_inf() ? 0.0f : s * __expf(mx - row_max);
}

}  // namespace

// Forward, one warp per row: block (32, R) handles R rows; rows with M <= 32 * V * C.
template <typename T, int V, int C>
__global__ void __launch_bounds__(256) softmax_forward_warp(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x)              // elements between rows of x
{
    const int lane = threadIdx.x;
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const T* xr = x + row * stride_x;
    float v[C][V];
    float mx = xk::neg_inf();
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) mx = fmaxf(mx, v[k][i]);
        }
    }
    mx = xk::warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
#pragma unroll
            for (int i = 0; i < V; ++i) s += __expf(v[k][i] - mx);
        }
    }
    const float inv_sum = 1.0f / xk::warp_sum(s);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = __expf(v[k][i] - mx) * inv_sum;
            store_vec<T, V>(yr + col, out);
        }
    }
}

// Forward, one block per row: C vectors per thread stay in registers; the rest
// of a longer row is folded into the thread's running pair as it streams by,
// then read again for the output.
template <typename T, int V, int C>
__global__ void __launch_bounds__(1024, 1) softmax_forward_block(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    long long rows,                  // number of rows (== gridDim.x)
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x)              // elements between rows of x
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const int t = threadIdx.x, nt = blockDim.x;
    const T* xr = x + row * stride_x;
    float v[C][V];
    float mx = xk::neg_inf(), s = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) mx = fmaxf(mx, v[k][i]);
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
#pragma unroll
        for (int i = 0; i < V; ++i) fold(u[i], mx, s);
    }
    if (mx != xk::neg_inf()) {
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (t + nt * k) * V;
            if (col < m) {
#pragma unroll
                for (int i = 0; i < V; ++i) s += __expf(v[k][i] - mx);
            }
        }
    }
    const float row_max = xk::block_max(mx, scratch);
    const float inv_sum = 1.0f / xk::block_sum(rescaled(mx, s, row_max), scratch);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = __expf(v[k][i] - row_max) * inv_sum;
            store_vec<T, V>(yr + col, out);
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
#pragma unroll
        for (int i = 0; i < V; ++i) u[i] = __expf(u[i] - row_max) * inv_sum;
        store_vec<T, V>(yr + col, u);
    }
}

// Backward, one warp per row: block (32, R) handles R rows; rows with M <= 32 * V * C.
template <typename T, int V, int C>
__global__ void __launch_bounds__(256) softmax_backward_warp(
    const T* __restrict__ y,         // (rows, M) forward output
    const T* dy,                     // (rows, M) output gradient
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_dy,             // elements between rows of dy
    long long stride_dx)             // elements between rows of dx
{
    const int lane = threadIdx.x;
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const T* yr = y + row * stride_y;
    const T* dyr = dy + row * stride_dy;
    float yv[C][V], dv[C][V];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            load_vec<T, V>(yr + col, yv[k]);
            load_vec<T, V>(dyr + col, dv[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) dot += yv[k][i] * dv[k][i];
        }
    }
    dot = xk::warp_sum(dot);
    T* dxr = dx + row * stride_dx;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = yv[k][i] * (dv[k][i] - dot);
            store_vec<T, V>(dxr + col, out);
        }
    }
}

// Backward, one block per row: C vectors of y and dy per thread stay in
// registers, the rest of a longer row is read again. At most 512 threads.
template <typename T, int V, int C>
__global__ void __launch_bounds__(512, 1) softmax_backward_block(
    const T* __restrict__ y,         // (rows, M) forward output
    const T* dy,                     // (rows, M) output gradient
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    long long rows,                  // number of rows (== gridDim.x)
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_dy,             // elements between rows of dy
    long long stride_dx)             // elements between rows of dx
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const int t = threadIdx.x, nt = blockDim.x;
    const T* yr = y + row * stride_y;
    const T* dyr = dy + row * stride_dy;
    float yv[C][V], dv[C][V];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            load_vec<T, V>(yr + col, yv[k]);
            load_vec<T, V>(dyr + col, dv[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) dot += yv[k][i] * dv[k][i];
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float ys[V], ds[V];
        load_vec<T, V>(yr + col, ys);
        load_vec<T, V>(dyr + col, ds);
#pragma unroll
        for (int i = 0; i < V; ++i) dot += ys[i] * ds[i];
    }
    dot = xk::block_sum(dot, scratch);
    T* dxr = dx + row * stride_dx;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = yv[k][i] * (dv[k][i] - dot);
            store_vec<T, V>(dxr + col, out);
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float ys[V], ds[V];
        load_vec<T, V>(yr + col, ys);
        load_vec<T, V>(dyr + col, ds);
#pragma unroll
        for (int i = 0; i < V; ++i) ys[i] *= ds[i] - dot;
        store_vec<T, V>(dxr + col, ys);
    }
}
