// LayerNorm kernels. Per row x of length M (w = 1 without a scale, b = 0 without a shift):
//   mean = sum(x) / M,  rstd = (sum((x - mean)^2) / M + eps)^-1/2,  y = (x - mean) * rstd * w + b
//   x_hat = (x - mean) * rstd, g = dy * w,
//   dx = rstd * (g - sum(g) / M - x_hat * sum(g * x_hat) / M),
//   dw = sum over rows of dy * x_hat,  db = sum over rows of dy
//   (dw, db: per-block partials, reduced by layer_norm_reduce_partials)
// The variance is taken from values centred on a first mean, whose residual
// sum(x - mean0) refines the mean in the same pass: rows whose mean dwarfs
// their spread lose nothing to cancellation.
// T: the dtype of x, y, dy, dx; TW, TB: the dtypes of w, b. Accumulation in float32.
// V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the passes over a row.
#include "common.cuh"

namespace {

using xk::load_or;
using xk::load_vec;
using xk::store_vec;

// y = (x - mean) * rstd * w + b for the V elements at col, with mean = mean0 + shift
// subtracted in two steps: mean0 + shift rounded to float32 would cost a row of mean
// 1e5 half an ulp of 1e5 in every x - mean.
template <typename T, typename TW, typename TB, int V>
__device__ __forceinline__ void store_normalised(T* yr, const TW* w, const TB* b, int col,
                                                 const float (&xv)[V], float mean0, float shift,
                                                 float r) {
    float wv[V], bv[V];
    load_or<TW, V>(w, col, 1.0f, wv);
    load_or<TB, V>(b, col, 0.0f, bv);
#pragma unroll
    for (int i = 0; i < V; ++i) wv[i] = ((xv[i] - mean0) - shift) * r * wv[i] + bv[i];
    store_vec<T, V>(yr + col, wv);
}

// acc[(col + i) * stride] += add[i] for the V columns at col (acc null: nothing).
template <int V>
__device__ __forceinline__ void accumulate_at(float* acc, long long stride, int col,
                                              const float (&add)[V]) {
    if (acc == nullptr) return;
    float* a = acc + col * stride;
#pragma unroll
    for (int i = 0; i < V; ++i) a[i * stride] += add[i];
}

}  // namespace

// Forward, one warp per row: block (32, R) normalises R rows; rows with M <= 32 * V * C.
template <typename T, typename TW, typename TB, int V, int C>
__global__ void __launch_bounds__(256) layer_norm_forward_warp(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    const TW* __restrict__ w,        // (M,) scale, or null (w = 1)
    const TB* __restrict__ b,        // (M,) shift, or null (b = 0)
    float* __restrict__ mean,        // (rows,) checkpoint, or null (inference)
    float* __restrict__ rstd,        // (rows,) checkpoint, or null (inference)
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x,              // elements between rows of x
    long long stride_mean,           // elements between entries of mean
    long long stride_rstd,           // elements between entries of rstd
    float eps)                       // added to the variance
{
    const int lane = threadIdx.x;
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;  // the whole warp leaves, before any collective
    const T* xr = x + row * stride_x;
    const float inv_m = 1.0f / (float)max(m, 1);
    float v[C][V];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) sum += v[k][i];
        }
    }
    const float mean0 = xk::warp_sum(sum) * inv_m;
    float residual = 0.0f, sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float d = v[k][i] - mean0;
                residual += d;
                sum_sq += d * d;
            }
        }
    }
    const float shift = xk::warp_sum(residual) * inv_m;
    const float r = rsqrtf(fmaxf(xk::warp_sum(sum_sq) * inv_m - shift * shift, 0.0f) + eps);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) store_normalised<T, TW, TB, V>(yr, w, b, col, v[k], mean0, shift, r);
    }
    if (lane == 0) {
        if (mean != nullptr) mean[row * stride_mean] = mean0 + shift;
        if (rstd != nullptr) rstd[row * stride_rstd] = r;
    }
}

// Forward, one block per row: C vectors per thread stay in registers, the rest
// of a longer row is streamed (read again in each of the three passes).
template <typename T, typename TW, typename TB, int V, int C>
__global__ void __launch_bounds__(1024, 1) layer_norm_forward_block(
    T* __restrict__ y,               // (rows, M) output, may alias x
    const T* x,                      // (rows, M) input
    const TW* __restrict__ w,        // (M,) scale, or null (w = 1)
    const TB* __restrict__ b,        // (M,) shift, or null (b = 0)
    float* __restrict__ mean,        // (rows,) checkpoint, or null (inference)
    float* __restrict__ rstd,        // (rows,) checkpoint, or null (inference)
    long long rows,                  // number of rows (== gridDim.x)
    int m,                           // row length M
    long long stride_y,              // elements between rows of y
    long long stride_x,              // elements between rows of x
    long long stride_mean,           // elements between entries of mean
    long long stride_rstd,           // elements between entries of rstd
    float eps)                       // added to the variance
{
    __shared__ float scratch[32];
    __shared__ float2 scratch2[32];
    const long long row = blockIdx.x;
    const int t = threadIdx.x, nt = blockDim.x;
    const T* xr = x + row * stride_x;
    const float inv_m = 1.0f / (float)max(m, 1);
    float v[C][V];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
            load_vec<T, V>(xr + col, v[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) sum += v[k][i];
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
#pragma unroll
        for (int i = 0; i < V; ++i) sum += u[i];
    }
    const float mean0 = xk::block_sum(sum, scratch) * inv_m;
    float residual = 0.0f, sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float d = v[k][i] - mean0;
                residual += d;
                sum_sq += d * d;
            }
        }
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float d = u[i] - mean0;
            residual += d;
            sum_sq += d * d;
        }
    }
    xk::block_sum2(residual, sum_sq, scratch2);
    const float shift = residual * inv_m;
    const float r = rsqrtf(fmaxf(sum_sq * inv_m - shift * shift, 0.0f) + eps);
    T* yr = y + row * stride_y;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (t + nt * k) * V;
        if (col < m) store_normalised<T, TW, TB, V>(yr, w, b, col, v[k], mean0, shift, r);
    }
    for (int col = (t + nt * C) * V; col < m; col += nt * V) {
        float u[V];
        load_vec<T, V>(xr + col, u);
        store_normalised<T, TW, TB, V>(yr, w, b, col, u, mean0, shift, r);
    }
    if (t == 0) {
        if (mean != nullptr) mean[row * stride_mean] = mean0 + shift;
        if (rstd != nullptr) rstd[row * stride_rstd] = r;
    }
}

// Backward, one warp per row: block b of (32, R) threads handles rows
// b * R + warp, stepping gridDim.x * R, and writes row b of the dw and db
// partials that are not null (summed over its warps in a fixed order through
// R * M floats of dynamic shared memory per partial).
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(256) layer_norm_backward_warp(
    const T* dy,                     // (rows, M) output gradient
    const T* __restrict__ x,         // (rows, M) forward input
    const TW* __restrict__ w,        // (M,) scale, or null (w = 1)
    const float* __restrict__ mean,  // (rows,) forward checkpoint
    const float* __restrict__ rstd,  // (rows,) forward checkpoint
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    float* __restrict__ dw_partial,  // (gridDim.x, M) partial sums of dy * x_hat, or null
    float* __restrict__ db_partial,  // (gridDim.x, M) partial sums of dy, or null
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_dy,             // elements between rows of dy
    long long stride_x,              // elements between rows of x
    long long stride_dx,             // elements between rows of dx
    long long stride_mean,           // elements between entries of mean
    long long stride_rstd,           // elements between entries of rstd
    long long stride_dw_p,           // elements between rows of dw_partial
    long long stride_dw_m,           // elements between columns of dw_partial
    long long stride_db_p,           // elements between rows of db_partial
    long long stride_db_m,           // elements between columns of db_partial
    int accumulate)                  // 1: add to the partials, 0: overwrite them
{
    const int lane = threadIdx.x;
    float wv[C][V], dw[C][V], db[C][V];
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) load_or<TW, V>(w, col, 1.0f, wv[k]);
#pragma unroll
        for (int i = 0; i < V; ++i) dw[k][i] = db[k][i] = 0.0f;
    }
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y) {
        const float mu = mean[row * stride_mean];
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        float xh[C][V], g[C][V];
        float sum_g = 0.0f, dot = 0.0f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (lane + 32 * k) * V;
            if (col < m) {
                float d[V];
                load_vec<T, V>(xr + col, xh[k]);
                load_vec<T, V>(dyr + col, d);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    xh[k][i] = (xh[k][i] - mu) * r;
                    g[k][i] = d[i] * wv[k][i];
                    sum_g += g[k][i];
                    dot += g[k][i] * xh[k][i];
                    dw[k][i] += d[i] * xh[k][i];
                    db[k][i] += d[i];
                }
            }
        }
        const float g_mean = xk::warp_sum(sum_g) * inv_m;
        const float proj = xk::warp_sum(dot) * inv_m;
        T* dxr = dx + row * stride_dx;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (lane + 32 * k) * V;
            if (col < m) {
                float out[V];
#pragma unroll
                for (int i = 0; i < V; ++i) out[i] = r * (g[k][i] - g_mean - xh[k][i] * proj);
                store_vec<T, V>(dxr + col, out);
            }
        }
    }
    if (dw_partial == nullptr && db_partial == nullptr) return;  // uniform over the block
    const long long span = (long long)blockDim.y * m;  // floats of one partial's shared sums
    float* part_w = xk::dynamic_smem<float>();
    float* part_b = dw_partial == nullptr ? part_w : part_w + span;
    float* mine_w = part_w + (long long)threadIdx.y * m;
    float* mine_b = part_b + (long long)threadIdx.y * m;
#pragma unroll
    for (int k = 0; k < C; ++k) {
        const int col = (lane + 32 * k) * V;
        if (col < m) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                if (dw_partial != nullptr) mine_w[col + i] = dw[k][i];
                if (db_partial != nullptr) mine_b[col + i] = db[k][i];
            }
        }
    }
    __syncthreads();
    for (int col = threadIdx.y * 32 + lane; col < m; col += 32 * blockDim.y) {
        if (dw_partial != nullptr) {
            float* out = dw_partial + blockIdx.x * stride_dw_p + col * stride_dw_m;
            float s = accumulate ? *out : 0.0f;
            for (int j = 0; j < (int)blockDim.y; ++j) s += part_w[(long long)j * m + col];
            *out = s;
        }
        if (db_partial != nullptr) {
            float* out = db_partial + blockIdx.x * stride_db_p + col * stride_db_m;
            float s = accumulate ? *out : 0.0f;
            for (int j = 0; j < (int)blockDim.y; ++j) s += part_b[(long long)j * m + col];
            *out = s;
        }
    }
}

// Backward, one block per row: block b handles rows b, b + gridDim.x, ...;
// thread t owns the same columns in every row, so its dw and db sums need no
// synchronisation. They live in dynamic shared memory (M floats per partial)
// when `smem_acc` is set, else directly in the block's partial rows. At most
// 512 threads, so the x and dy vectors kept per thread fit in registers.
template <typename T, typename TW, int V, int C>
__global__ void __launch_bounds__(512, 1) layer_norm_backward_block(
    const T* dy,                     // (rows, M) output gradient
    const T* __restrict__ x,         // (rows, M) forward input
    const TW* __restrict__ w,        // (M,) scale, or null (w = 1)
    const float* __restrict__ mean,  // (rows,) forward checkpoint
    const float* __restrict__ rstd,  // (rows,) forward checkpoint
    T* dx,                           // (rows, M) input gradient, overwritten; may alias dy
    float* __restrict__ dw_partial,  // (gridDim.x, M) partial sums of dy * x_hat, or null
    float* __restrict__ db_partial,  // (gridDim.x, M) partial sums of dy, or null
    long long rows,                  // number of rows
    int m,                           // row length M
    long long stride_dy,             // elements between rows of dy
    long long stride_x,              // elements between rows of x
    long long stride_dx,             // elements between rows of dx
    long long stride_mean,           // elements between entries of mean
    long long stride_rstd,           // elements between entries of rstd
    long long stride_dw_p,           // elements between rows of dw_partial
    long long stride_dw_m,           // elements between columns of dw_partial
    long long stride_db_p,           // elements between rows of db_partial
    long long stride_db_m,           // elements between columns of db_partial
    int accumulate,                  // 1: add to the partials, 0: overwrite them
    int smem_acc)                    // 1: sum dw / db in M floats each of dynamic shared memory
{
    __shared__ float2 scratch[32];
    const int t = threadIdx.x, nt = blockDim.x;
    float* dw_row = dw_partial == nullptr ? nullptr : dw_partial + blockIdx.x * stride_dw_p;
    float* db_row = db_partial == nullptr ? nullptr : db_partial + blockIdx.x * stride_db_p;
    float* acc_w = dw_row;
    float* acc_b = db_row;
    long long acc_w_stride = stride_dw_m, acc_b_stride = stride_db_m;
    if (smem_acc) {
        float* smem = xk::dynamic_smem<float>();
        if (dw_row != nullptr) {
            acc_w = smem;
            acc_w_stride = 1;
            smem += m;
        }
        if (db_row != nullptr) {
            acc_b = smem;
            acc_b_stride = 1;
        }
    }
    for (int col = t * V; col < m; col += nt * V) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const long long j = (long long)(col + i);
            if (acc_w != nullptr)
                acc_w[j * acc_w_stride] = accumulate ? dw_row[j * stride_dw_m] : 0.0f;
            if (acc_b != nullptr)
                acc_b[j * acc_b_stride] = accumulate ? db_row[j * stride_db_m] : 0.0f;
        }
    }
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float mu = mean[row * stride_mean];
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        float xv[C][V], dv[C][V];
        float sum_g = 0.0f, dot = 0.0f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (t + nt * k) * V;
            if (col < m) {
                float wv[V];
                load_vec<T, V>(xr + col, xv[k]);
                load_vec<T, V>(dyr + col, dv[k]);
                load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    const float g = dv[k][i] * wv[i];
                    sum_g += g;
                    dot += g * (xv[k][i] - mu);
                }
            }
        }
        for (int col = (t + nt * C) * V; col < m; col += nt * V) {
            float xs[V], ds[V], wv[V];
            load_vec<T, V>(xr + col, xs);
            load_vec<T, V>(dyr + col, ds);
            load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float g = ds[i] * wv[i];
                sum_g += g;
                dot += g * (xs[i] - mu);
            }
        }
        xk::block_sum2(sum_g, dot, scratch);
        const float g_mean = sum_g * inv_m;
        const float proj = dot * r * inv_m;  // sum(g * x_hat) / M
        T* dxr = dx + row * stride_dx;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (t + nt * k) * V;
            if (col < m) {
                float wv[V], out[V], xh[V];
                load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    xh[i] = (xv[k][i] - mu) * r;
                    out[i] = r * (dv[k][i] * wv[i] - g_mean - xh[i] * proj);
                }
                store_vec<T, V>(dxr + col, out);
#pragma unroll
                for (int i = 0; i < V; ++i) xh[i] *= dv[k][i];
                accumulate_at<V>(acc_w, acc_w_stride, col, xh);
                accumulate_at<V>(acc_b, acc_b_stride, col, dv[k]);
            }
        }
        for (int col = (t + nt * C) * V; col < m; col += nt * V) {
            float xs[V], ds[V], wv[V], out[V];
            load_vec<T, V>(xr + col, xs);
            load_vec<T, V>(dyr + col, ds);
            load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xs[i] = (xs[i] - mu) * r;
                out[i] = r * (ds[i] * wv[i] - g_mean - xs[i] * proj);
                xs[i] *= ds[i];
            }
            store_vec<T, V>(dxr + col, out);
            accumulate_at<V>(acc_w, acc_w_stride, col, xs);
            accumulate_at<V>(acc_b, acc_b_stride, col, ds);
        }
    }
    if (!smem_acc) return;  // the sums are already in the partial rows
    for (int col = t * V; col < m; col += nt * V) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const long long j = (long long)(col + i);
            if (acc_w != nullptr) dw_row[j * stride_dw_m] = acc_w[j];
            if (acc_b != nullptr) db_row[j * stride_db_m] = acc_b[j];
        }
    }
}

// out[j] = sum over p of partial[p, j], in a fixed order (deterministic), in out's dtype.
template <typename TOut>
__global__ void __launch_bounds__(256) layer_norm_reduce_partials(
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
    out[col * stride_out] =
        xk::from_float<TOut>(xk::sum_partial_column(partial, p, col, stride_p, stride_m));
}
