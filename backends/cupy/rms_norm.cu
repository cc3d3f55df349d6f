// RMSNorm kernels. Per row x of length M, with w' = w + offset (w' = 1 + offset without w):
//   rstd = (sum(x^2) / M + eps)^-1/2,  y = x * rstd * w'
//   x_hat = x * rstd, g = dy * w',  dx = rstd * (g - x_hat * sum(g * x_hat) / M),
//   dw = sum over rows of dy * x_hat   (per-block partials, reduced by reduce_partials)
// T: the dtype of x, y, dy, dx; TW: the dtype of w. Accumulation in float32.
// V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the two passes over a row.
#include "common.cuh"

namespace {

using xk::load_or;
using xk::load_vec;
using xk::store_vec;

template <typename TW, int V>
__device__ __forceinline__ void load_weight(const TW* w, int col, float offset, float (&out)[V]) {
    load_or<TW, V>(w, col, 1.0f, out);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] += offset;
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
    const int lane = threadIdx.x;
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const T* xr = x + row * stride_x;
    float v[C][V];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) sum_sq += v[k][i] * v[k][i];
        }
    }
    const float r = rsqrtf(xk::warp_sum(sum_sq) / (float)max(m, 1) + eps);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            float wv[V];
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) wv[i] *= v[k][i] * r;
            store_vec<T, V>(yr + col, wv);
        }
    }
    if (rstd != nullptr && lane == 0) rstd[row * stride_rstd] = r;
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
    const int t = threadIdx.x, nt = blockDim.x;
    const T* xr = x + row * stride_x;
    float v[C][V];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) sum_sq += v[k][i] * v[k][i];
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
#pragma unroll
        for (int i = 0; i < V; ++i) sum_sq += u[i] * u[i];
    }
    const float r = rsqrtf(xk::block_sum(sum_sq, scratch) / (float)max(m, 1) + eps);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            float wv[V];
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) wv[i] *= v[k][i] * r;
            store_vec<T, V>(yr + col, wv);
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V], wv[V];
        load_vec<T, V>(xr + col, u);
        load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
        for (int i = 0; i < V; ++i) wv[i] *= u[i] * r;
        store_vec<T, V>(yr + col, wv);
    }
    if (rstd != nullptr && t == 0) rstd[row * stride_rstd] = r;
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
    const int lane = threadIdx.x;
    float wv[C][V], dw[C][V];
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) load_weight<TW, V>(w, col, offset, wv[k]);
#pragma unroll
        for (int i = 0; i < V; ++i) dw[k][i] = 0.0f;
    }
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y) {
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        float xh[C][V], g[C][V];
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (lane + 32 * k) * V;
            if (col < m) {
                float d[V];
                load_vec<T, V>(xr + col, xh[k]);
                load_vec<T, V>(dyr + col, d);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    xh[k][i] *= r;
                    g[k][i] = d[i] * wv[k][i];
                    dot += g[k][i] * xh[k][i];
                    dw[k][i] += d[i] * xh[k][i];
                }
            }
        }
        const float proj = xk::warp_sum(dot) * inv_m;
        T* dxr = dx + row * stride_dx;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (lane + 32 * k) * V;
            if (col < m) {
                float out[V];
#pragma unroll
                for (int i = 0; i < V; ++i) out[i] = r * (g[k][i] - xh[k][i] * proj);
                store_vec<T, V>(dxr + col, out);
            }
        }
    }
    if (dw_partial == nullptr) return;  // uniform over the block
    float* part = xk::dynamic_smem<float>();
    float* mine = part + (long long)threadIdx.y * m;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
#pragma unroll
            for (int i = 0; i < V; ++i) mine[col + i] = dw[k][i];
        }
    }
    __syncthreads();
    float* out = dw_partial + blockIdx.x * stride_partial_p;
    for (int col = threadIdx.y * 32 + lane; col < m; col += 32 * blockDim.y) {
        float s = accumulate ? out[col * stride_partial_m] : 0.0f;
        for (int j = 0; j < (int)blockDim.y; ++j) s += part[(long long)j * m + col];
        out[col * stride_partial_m] = s;
    }
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
    const int t = threadIdx.x, nt = blockDim.x;
    float* partial_row = dw_partial == nullptr ? nullptr : dw_partial + blockIdx.x * stride_partial_p;
    float* acc = partial_row;
    long long acc_stride = stride_partial_m;
    if (partial_row != nullptr && smem_acc) {
        acc = xk::dynamic_smem<float>();
        acc_stride = 1;
    }
    if (acc != nullptr) {
        for (int col = t * V; col < m; col += nt * V) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const long long j = (long long)(col + i);
                acc[j * acc_stride] = accumulate ? partial_row[j * stride_partial_m] : 0.0f;
            }
        }
    }
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        float xv[C][V], dv[C][V];
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (t + nt * k) * V;
            if (col < m) {
                float wv[V];
                load_vec<T, V>(xr + col, xv[k]);
                load_vec<T, V>(dyr + col, dv[k]);
                load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
                for (int i = 0; i < V; ++i) dot += dv[k][i] * wv[i] * xv[k][i];
            }
        }
        for (int col = (t + nt * C) * V; col < m; col += nt * V) {
            float xs[V], ds[V], wv[V];
            load_vec<T, V>(xr + col, xs);
            load_vec<T, V>(dyr + col, ds);
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) dot += ds[i] * wv[i] * xs[i];
        }
        const float proj = xk::block_sum(dot, scratch) * r * inv_m;  // sum(g * x_hat) / M
        T* dxr = dx + row * stride_dx;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (t + nt * k) * V;
            if (col < m) {
                float wv[V], out[V];
                load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    const float xh = xv[k][i] * r;
                    out[i] = r * (dv[k][i] * wv[i] - xh * proj);
                    if (acc != nullptr) acc[(long long)(col + i) * acc_stride] += dv[k][i] * xh;
                }
                store_vec<T, V>(dxr + col, out);
            }
        }
        for (int col = (t + nt * C) * V; col < m; col += nt * V) {
            float xs[V], ds[V], wv[V], out[V];
            load_vec<T, V>(xr + col, xs);
            load_vec<T, V>(dyr + col, ds);
            load_weight<TW, V>(w, col, offset, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float xh = xs[i] * r;
                out[i] = r * (ds[i] * wv[i] - xh * proj);
                if (acc != nullptr) acc[(long long)(col + i) * acc_stride] += ds[i] * xh;
            }
            store_vec<T, V>(dxr + col, out);
        }
    }
    if (acc != nullptr && acc != partial_row) {
        for (int col = t * V; col < m; col += nt * V) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const long long j = (long long)(col + i);
                partial_row[j * stride_partial_m] = acc[j];
            }
        }
    }
}

// out[j] = sum over p of partial[p, j], in a fixed order (deterministic), in out's dtype.
template <typename TOut>
__global__ void __launch_bounds__(256) rms_norm_reduce_partials(
    const float* __restrict__ partial,  // (P, M) float32 partial sums
    TOut* __restrict__ out,             // (M,) result
    int p,                              // rows P of partial
    int m,                              // columns M
    long long stride_p,                 // elements between rows of partial
    long long stride_m,                 // elements between columns of partial
    long long stride_out)               // elements between entries of out
{
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= m) return;
    float s = 0.0f;
    for (int i = 0; i < p; ++i) s += partial[i * stride_p + col * stride_m];
    out[col * stride_out] = xk::from_float<TOut>(s);
}
