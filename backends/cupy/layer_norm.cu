// LayerNorm kernels. Per row x of length M (w = 1 without a scale, b = 0 without a shift):
//   mean = sum(x) / M,  rstd = (sum((x - mean)^2) / M + eps)^-1/2,  y = (x - mean) * rstd * w + b
//   x_hat = (x - mean) * rstd, g = dy * w,
//   dx = rstd * (g - sum(g) / M - x_hat * sum(g * x_hat) / M),
//   dw = sum over rows of dy * x_hat,  db = sum over rows of dy
//   (dw, db: per-block partials, reduced by rows.cuh's reduce_partials)
// The variance is taken from values centred on a first mean, whose residual
// sum(x - mean0) refines the mean in the same pass: rows whose mean dwarfs
// their spread lose nothing to cancellation.
// T: the dtype of x, y, dy, dx; TW, TB: the dtypes of w, b. Accumulation in float32.
// V: elements per vector access (16 bytes / sizeof(T) when aligned, else 1).
// C: vectors per thread kept in registers between the passes over a row (rows.cuh).
#include "rows.cuh"

namespace {

using xk::load_or;
using xk::load_vec;
using xk::store_vec;

// y = (x - mean) * rstd * w + b over the share's columns of one row (read again in each of
// the three passes where streamed); mean and rstd are returned. The mean mean0 + shift is
// subtracted in two steps: rounded to float32 it would cost a row of mean 1e5 half an ulp
// of 1e5 in every x - mean.
template <typename T, typename TW, typename TB, typename Share>
__device__ __forceinline__ void forward_row(
    const Share& share, T* yr, const T* xr, const TW* w, const TB* b, float eps, float& mean,
    float& rstd) {
    constexpr int V = Share::V;
    const float inv_m = 1.0f / (float)max(share.m, 1);
    float v[Share::C][V];
    float sum = 0.0f;
    share.load(xr, v, [&](int, const float (&u)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) sum += u[i];
    });
    const float mean0 = share.sum(sum) * inv_m;
    float residual = 0.0f, sum_sq = 0.0f;
    share.each(xr, v, [&](int, const float (&u)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float d = u[i] - mean0;
            residual += d;
            sum_sq += d * d;
        }
    });
    share.sum2(residual, sum_sq);
    const float shift = residual * inv_m;
    const float r = rsqrtf(fmaxf(sum_sq * inv_m - shift * shift, 0.0f) + eps);
    share.each(xr, v, [&](int col, const float (&u)[V]) {
        float wv[V], bv[V];
        load_or<TW, V>(w, col, 1.0f, wv);
        load_or<TB, V>(b, col, 0.0f, bv);
#pragma unroll
        for (int i = 0; i < V; ++i) wv[i] = ((u[i] - mean0) - shift) * r * wv[i] + bv[i];
        store_vec<T, V>(yr + col, wv);
    });
    mean = mean0 + shift;
    rstd = r;
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
    const long long row = xk::thread_row();
    if (row >= rows) return;  // the whole warp leaves, before any collective
    float mu, r;
    forward_row<T, TW, TB>(xk::warp_row_share<V, C>(m), y + row * stride_y, x + row * stride_x,
                           w, b, eps, mu, r);
    if (threadIdx.x == 0) {
        if (mean != nullptr) mean[row * stride_mean] = mu;
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
    __shared__ float2 scratch[32];
    const long long row = blockIdx.x;
    float mu, r;
    forward_row<T, TW, TB>(xk::block_row_share<V, C>(m, scratch), y + row * stride_y,
                           x + row * stride_x, w, b, eps, mu, r);
    if (threadIdx.x == 0) {
        if (mean != nullptr) mean[row * stride_mean] = mu;
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
    const auto share = xk::warp_row_share<V, C>(m);
    float wv[C][V], dw[C][V] = {}, db[C][V] = {};
    share.cached([&](int k, int col) { load_or<TW, V>(w, col, 1.0f, wv[k]); });
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = xk::thread_row(); row < rows; row += (long long)gridDim.x * blockDim.y) {
        const float mu = mean[row * stride_mean];
        const float r = rstd[row * stride_rstd];
        float xh[C][V], g[C][V];
        float sum_g = 0.0f, dot = 0.0f;
        share.cached([&](int k, int col) {
            load_vec<T, V>(x + row * stride_x + col, xh[k]);
            load_vec<T, V>(dy + row * stride_dy + col, g[k]);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xh[k][i] = (xh[k][i] - mu) * r;
                dw[k][i] += g[k][i] * xh[k][i];
                db[k][i] += g[k][i];
                g[k][i] *= wv[k][i];
                sum_g += g[k][i];
                dot += g[k][i] * xh[k][i];
            }
        });
        share.sum2(sum_g, dot);
        const float g_mean = sum_g * inv_m, proj = dot * inv_m;
        share.cached([&](int k, int col) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = r * (g[k][i] - g_mean - xh[k][i] * proj);
            store_vec<T, V>(dx + row * stride_dx + col, out);
        });
    }
    if (dw_partial == nullptr && db_partial == nullptr) return;  // uniform over the block
    float* part_w = xk::dynamic_smem<float>();
    float* part_b = dw_partial == nullptr ? part_w : part_w + (long long)blockDim.y * m;
    if (dw_partial != nullptr) xk::stash_warp_sums(share, part_w, dw);
    if (db_partial != nullptr) xk::stash_warp_sums(share, part_b, db);
    __syncthreads();
    if (dw_partial != nullptr)
        xk::flush_warp_sums(part_w, dw_partial + blockIdx.x * stride_dw_p, stride_dw_m, m,
                            accumulate);
    if (db_partial != nullptr)
        xk::flush_warp_sums(part_b, db_partial + blockIdx.x * stride_db_p, stride_db_m, m,
                            accumulate);
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
    const auto share = xk::block_row_share<V, C>(m, scratch);
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
    const xk::ColumnSums dw{dw_row, stride_dw_m, acc_w, acc_w_stride};
    const xk::ColumnSums db{db_row, stride_db_m, acc_b, acc_b_stride};
    xk::start_sums(share, accumulate, dw, db);
    const float inv_m = 1.0f / (float)max(m, 1);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float mu = mean[row * stride_mean];
        const float r = rstd[row * stride_rstd];
        const T* xr = x + row * stride_x;
        const T* dyr = dy + row * stride_dy;
        T* dxr = dx + row * stride_dx;
        float xv[C][V], dv[C][V];
        float sum_g = 0.0f, dot = 0.0f;
        share.load2(xr, xv, dyr, dv, [&](int col, const float (&xs)[V], const float (&ds)[V]) {
            float wv[V];
            load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float g = ds[i] * wv[i];
                sum_g += g;
                dot += g * (xs[i] - mu);
            }
        });
        share.sum2(sum_g, dot);
        const float g_mean = sum_g * inv_m;
        const float proj = dot * r * inv_m;  // sum(g * x_hat) / M
        share.each2(xr, xv, dyr, dv, [&](int col, const float (&xs)[V], const float (&ds)[V]) {
            float wv[V], out[V], xh[V];
            load_or<TW, V>(w, col, 1.0f, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                xh[i] = (xs[i] - mu) * r;
                out[i] = r * (ds[i] * wv[i] - g_mean - xh[i] * proj);
            }
            store_vec<T, V>(dxr + col, out);
            dw.add(col, ds, xh);
            db.add(col, ds);
        });
    }
    xk::finish_sums(share, dw, db);
}
