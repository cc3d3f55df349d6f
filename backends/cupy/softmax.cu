// Softmax kernels over rows x of length M:
//   y = exp(x - max(x)) / sum(exp(x - max(x))),   dx = y * (dy - sum(y * dy))
// -inf logits (masked entries) give y = 0. Each thread folds its elements into a
// running (max, sum of exp(x - max)) pair, rescaled when the max grows, so the
// streamed part of a wide row is read once for the statistics; the pairs are
// merged over the warp or block. T: the dtype of x, y, dy, dx. Accumulation in
// float32. V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the passes over a row (rows.cuh).
#include "rows.cuh"

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

// dx = y * (dy - sum(y * dy)) over the share's columns of one row.
template <typename T, typename Share>
__device__ __forceinline__ void backward_row(const Share& share, T* dxr, const T* yr, const T* dyr) {
    constexpr int V = Share::V;
    float yv[Share::C][V], dv[Share::C][V];
    float dot = 0.0f;
    share.load2(yr, yv, dyr, dv, [&](int, const float (&ys)[V], const float (&ds)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) dot += ys[i] * ds[i];
    });
    dot = share.sum(dot);
    share.each2(yr, yv, dyr, dv, [&](int col, const float (&ys)[V], const float (&ds)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = ys[i] * (ds[i] - dot);
        store_vec<T, V>(dxr + col, out);
    });
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
    const long long row = xk::thread_row();
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const auto share = xk::warp_row_share<V, C>(m);
    float v[C][V];
    float mx = xk::neg_inf();
    share.load(x + row * stride_x, v, [&](int, const float (&u)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) mx = fmaxf(mx, u[i]);
    });
    mx = share.maximum(mx);
    float s = 0.0f;
    share.cached([&](int k, int) {
#pragma unroll
        for (int i = 0; i < V; ++i) s += __expf(v[k][i] - mx);
    });
    const float inv_sum = 1.0f / share.sum(s);
    share.cached([&](int k, int col) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = __expf(v[k][i] - mx) * inv_sum;
        store_vec<T, V>(y + row * stride_y + col, out);
    });
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
    const auto share = xk::block_row_share<V, C>(m, scratch);
    const long long row = blockIdx.x;
    const T* xr = x + row * stride_x;
    float v[C][V];
    float mx = xk::neg_inf(), s = 0.0f;
    share.cached([&](int k, int col) {
        load_vec<T, V>(xr + col, v[k]);
#pragma unroll
        for (int i = 0; i < V; ++i) mx = fmaxf(mx, v[k][i]);
    });
    share.streamed_loads(xr, [&](int, const float (&u)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) fold(u[i], mx, s);
    });
    if (mx != xk::neg_inf()) {
        share.cached([&](int k, int) {
#pragma unroll
            for (int i = 0; i < V; ++i) s += __expf(v[k][i] - mx);
        });
    }
    const float row_max = share.maximum(mx);
    const float inv_sum = 1.0f / share.sum(rescaled(mx, s, row_max));
    share.each(xr, v, [&](int col, const float (&u)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = __expf(u[i] - row_max) * inv_sum;
        store_vec<T, V>(y + row * stride_y + col, out);
    });
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
    const long long row = xk::thread_row();
    if (row >= rows) return;  // the whole warp leaves, before any collective
    backward_row<T>(xk::warp_row_share<V, C>(m), dx + row * stride_dx, y + row * stride_y,
                    dy + row * stride_dy);
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
    backward_row<T>(xk::block_row_share<V, C>(m, scratch), dx + row * stride_dx,
                    y + row * stride_y, dy + row * stride_dy);
}
