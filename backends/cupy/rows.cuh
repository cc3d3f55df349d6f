// The row machinery of the row kernels (rms_norm.cu, layer_norm.cu, softmax.cu): the columns
// of a row each thread takes, the sums over the threads sharing the row, and the backward's
// per-block column sums. NVRTC-clean; the rules of common.cuh hold.
//
// A row of M elements is read in vectors of V elements; the thread at `first` of the `step`
// threads sharing it takes vectors first, first + step, ...: the first C of them stay in
// registers between the passes over the row ("cached"), the rest of a longer row is read
// again in each pass ("streamed"). A warp shares a row of at most 32 * V * C elements
// (WarpRow: nothing streamed), a block a row of any length (BlockRow).
#pragma once
#include "common.cuh"

namespace xk {

template <int V_, int C_, bool STREAMED>
struct RowShare {
    static constexpr int V = V_, C = C_;
    int first, step, m;

    // f(k, col) for each cached vector k (elements col .. col + V - 1 of the row).
    template <typename F>
    __device__ __forceinline__ void cached(F f) const {
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int col = (first + step * k) * V;
            if (col < m) f(k, col);
        }
    }

    // f(col) for each streamed vector.
    template <typename F>
    __device__ __forceinline__ void streamed(F f) const {
        if constexpr (STREAMED) {
            for (int col = (first + step * C) * V; col < m; col += step * V) f(col);
        }
    }

    // f(col) for each vector, cached or streamed.
    template <typename F>
    __device__ __forceinline__ void columns(F f) const {
        for (int col = first * V; col < m; col += step * V) f(col);
    }

    // The first pass over a row: loads the cached vectors of `src` into v; f(col, values) for
    // every vector (v[k], or the streamed vector loaded).
    template <typename T, typename F>
    __device__ __forceinline__ void load(const T* src, float (&v)[C][V], F f) const {
        cached([&](int k, int col) {
            load_vec<T, V>(src + col, v[k]);
            f(col, v[k]);
        });
        streamed_loads(src, f);
    }

    // A later pass: f(col, values) for every vector (v[k], or the streamed vector loaded again).
    template <typename T, typename F>
    __device__ __forceinline__ void each(const T* src, const float (&v)[C][V], F f) const {
        cached([&](int k, int col) { f(col, v[k]); });
        streamed_loads(src, f);
    }

    // f(col, values) for every streamed vector, loaded from src.
    template <typename T, typename F>
    __device__ __forceinline__ void streamed_loads(const T* src, F f) const {
        streamed([&](int col) {
            float u[V];
            load_vec<T, V>(src + col, u);
            f(col, u);
        });
    }

    // load() over two rows at once: f(col, values of a, values of b).
    template <typename T, typename F>
    __device__ __forceinline__ void load2(
        const T* a, float (&va)[C][V], const T* b, float (&vb)[C][V], F f) const {
        cached([&](int k, int col) {
            load_vec<T, V>(a + col, va[k]);
            load_vec<T, V>(b + col, vb[k]);
            f(col, va[k], vb[k]);
        });
        streamed2(a, b, f);
    }

    // each() over two rows at once.
    template <typename T, typename F>
    __device__ __forceinline__ void each2(
        const T* a, const float (&va)[C][V], const T* b, const float (&vb)[C][V], F f) const {
        cached([&](int k, int col) { f(col, va[k], vb[k]); });
        streamed2(a, b, f);
    }

    // streamed_loads() over two rows at once.
    template <typename T, typename F>
    __device__ __forceinline__ void streamed2(const T* a, const T* b, F f) const {
        streamed([&](int col) {
            float ua[V], ub[V];
            load_vec<T, V>(a + col, ua);
            load_vec<T, V>(b + col, ub);
            f(col, ua, ub);
        });
    }
};

// A warp per row (block (32, R): rows blockIdx.x * R + threadIdx.y); sums over the warp.
template <int V, int C>
struct WarpRow : RowShare<V, C, false> {
    __device__ __forceinline__ float sum(float x) const { return warp_sum(x); }
    __device__ __forceinline__ void sum2(float& a, float& b) const {
        a = warp_sum(a);
        b = warp_sum(b);
    }
    __device__ __forceinline__ float maximum(float x) const { return warp_max(x); }
};

// A block per row (blockDim.y == 1); sums over the block through `scratch`: 32 S of shared
// memory, S float (sum, maximum) or float2 (also sum2).
template <int V, int C, typename S>
struct BlockRow : RowShare<V, C, true> {
    S* scratch;
    __device__ __forceinline__ float sum(float x) const {
        return block_sum(x, reinterpret_cast<float*>(scratch));
    }
    __device__ __forceinline__ void sum2(float& a, float& b) const { block_sum2(a, b, scratch); }
    __device__ __forceinline__ float maximum(float x) const {
        return block_max(x, reinterpret_cast<float*>(scratch));
    }
};

template <int V, int C>
__device__ __forceinline__ WarpRow<V, C> warp_row_share(int m) {
    return {{static_cast<int>(threadIdx.x), 32, m}};
}

template <int V, int C, typename S>
__device__ __forceinline__ BlockRow<V, C, S> block_row_share(int m, S* scratch) {
    return {{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), m}, scratch};
}

// A warp-per-row backward's column sums, acc (the cached vectors of `share`), into row
// threadIdx.y of `part` (R x M floats of shared memory) for flush_warp_sums.
template <int V, int C>
__device__ __forceinline__ void stash_warp_sums(
    const WarpRow<V, C>& share, float* part, const float (&acc)[C][V]) {
    float* mine = part + (long long)threadIdx.y * share.m;
    share.cached([&](int k, int col) {
#pragma unroll
        for (int i = 0; i < V; ++i) mine[col + i] = acc[k][i];
    });
}

// Column col of row blockIdx.x of a (P, M) partial (out: that row, stride_m between its
// columns) = the block's R warps' stashed sums added in order (to out's own when accumulate).
// After a barrier that follows every warp's stash_warp_sums.
__device__ __forceinline__ void flush_warp_sums(
    const float* part, float* out, long long stride_m, int m, int accumulate) {
    for (int col = threadIdx.y * 32 + threadIdx.x; col < m; col += 32 * blockDim.y) {
        float s = accumulate ? out[col * stride_m] : 0.0f;
        for (int j = 0; j < (int)blockDim.y; ++j) s += part[(long long)j * m + col];
        out[col * stride_m] = s;
    }
}

// The column sums of a block-per-row backward (dw, db): thread t adds to its own columns
// only, so no barrier. They are kept in M floats of shared memory or directly in the block's
// row of the (P, M) partial (start_sums, add, finish_sums).
struct ColumnSums {
    float* row;            // row blockIdx.x of the partial, or null (no sums)
    long long stride;      // elements between its columns
    float* acc;            // where the sums are kept: row, or shared memory
    long long acc_stride;  // elements between columns of acc

    // Column j of the sums starts from the row's value (accumulate) or 0.
    __device__ __forceinline__ void start_at(long long j, int accumulate) const {
        if (acc != nullptr) acc[j * acc_stride] = accumulate ? row[j * stride] : 0.0f;
    }

    // Column j of the sums kept in shared memory into the row.
    __device__ __forceinline__ void finish_at(long long j) const {
        if (acc != row) row[j * stride] = acc[j];
    }

    // sums[col + i] += a[i] for the V columns at col.
    template <int V>
    __device__ __forceinline__ void add(int col, const float (&a)[V]) const {
        if (acc == nullptr) return;
        float* s = acc + col * acc_stride;
#pragma unroll
        for (int i = 0; i < V; ++i) s[i * acc_stride] += a[i];
    }

    // sums[col + i] += a[i] * b[i] for the V columns at col.
    template <int V>
    __device__ __forceinline__ void add(int col, const float (&a)[V], const float (&b)[V]) const {
        if (acc == nullptr) return;
        float* s = acc + col * acc_stride;
#pragma unroll
        for (int i = 0; i < V; ++i) s[i * acc_stride] += a[i] * b[i];
    }
};

// Every ColumnSums of a block-per-row backward starts over the share's columns.
template <typename Share, typename... Sums>
__device__ __forceinline__ void start_sums(const Share& share, int accumulate, const Sums&... sums) {
    share.columns([&](int col) {
#pragma unroll
        for (int i = 0; i < Share::V; ++i) (sums.start_at(col + i, accumulate), ...);
    });
}

// Every ColumnSums kept in shared memory into its row.
template <typename Share, typename... Sums>
__device__ __forceinline__ void finish_sums(const Share& share, const Sums&... sums) {
    if (((sums.acc == sums.row) && ...)) return;
    share.columns([&](int col) {
#pragma unroll
        for (int i = 0; i < Share::V; ++i) (sums.finish_at(col + i), ...);
    });
}

}  // namespace xk

// out[j] = sum over p of partial[p, j], in a fixed order (deterministic), in out's dtype: the
// norms' dw / db from their backward's partials.
template <typename TOut>
__global__ void __launch_bounds__(256) reduce_partials(
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
