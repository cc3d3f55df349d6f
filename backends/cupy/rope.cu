// Rotary position embeddings (RoPE) of x (B, H, S, D) by cosine and sine tables (B, P, R2).
// Query s of batch b takes table row p = position_ids[b, s] (row s without them); each of its
// R2 rotated pairs (x1, x2) -- (x[i], x[i + R2]) in the half layout of Hugging Face models,
// (x[2i], x[2i + 1]) interleaved (GPT-J) -- becomes, with c = cos[b, p, i], s = sin[b, p, i],
//   forward:   (x1 c - x2 s, x2 c + x1 s)
//   backward:  (x1 c + x2 s, x2 c - x1 s)   (the inverse rotation, of the output's gradient)
// One kernel serves both passes: `sign` = -1 negates the sine (exactly). Elements from the
// rotary dim R = 2 R2 up to D are copied bit for bit.
//
// Geometry: block (X, Y) takes Y rows (b, s) of the (B, S) queries; along a row its X threads
// take units, the rotation units first, then the copied tail's vectors of V elements
// (threads stride over rows with more than X units). A rotation unit is, in the half layout,
// vector j of the first half with vector j of the second (V pairs; R2 a multiple of V), and
// interleaved E = max(V, 2) consecutive elements (E / 2 pairs; R a multiple of E). A thread
// loads its unit's cosines and sines once and applies them, head after head, to the heads
// blockIdx.y + k gridDim.y (the launcher sizes the grid's y for a few heads per thread).
// Rows are addressed in vectors (Vec<T, V> pointers, as gated.cuh explains). Every element is
// read and written by one thread only, which loads all of a head's elements of its unit before
// it stores any, so out may be the very same array as x. No shared memory, no barriers, no
// warp collectives. Offsets are int64.
// T: the dtype of x and out; computation in float32. V: elements per access (16 bytes /
// sizeof(T) when every row, stride and the pair layout allow it, else 1). The tables' dtype is
// a run-time kind (0 float, 1 __half, 2 __nv_bfloat16, 3 double; read in accesses of at most
// 16 bytes); the position ids are int32 or int64.
#include "common.cuh"

namespace {

// A table element as float (a double rounded to nearest).
__device__ __forceinline__ float as_float(double v) { return static_cast<float>(v); }
template <typename C>
__device__ __forceinline__ float as_float(C v) { return xk::to_float(v); }

// W elements of a table row from element i (a multiple of W) as float, N per access: W, or
// 16 bytes' worth when W elements span more (the launcher checks the rows' N-alignment).
template <typename C, int W>
__device__ __forceinline__ void load_pieces(const C* row, long long i, float (&out)[W]) {
    constexpr int BYTES = static_cast<int>(sizeof(C));
    constexpr int N = W * BYTES > 16 ? 16 / BYTES : W;
    const xk::Vec<C, N>* pieces = reinterpret_cast<const xk::Vec<C, N>*>(row) + i / N;
#pragma unroll
    for (int k = 0; k < W / N; ++k) {
        const xk::Vec<C, N> r = pieces[k];
#pragma unroll
        for (int e = 0; e < N; ++e) out[k * N + e] = as_float(r.v[e]);
    }
}

// W elements from element i of the table row at element offset `at` of a table of dtype kind.
template <int W>
__device__ __forceinline__ void load_table(
    const void* table, int kind, long long at, long long i, float (&out)[W]) {
    if (kind == 0) {
        load_pieces<float, W>(static_cast<const float*>(table) + at, i, out);
    } else if (kind == 1) {
        load_pieces<__half, W>(static_cast<const __half*>(table) + at, i, out);
    } else if (kind == 2) {
        load_pieces<__nv_bfloat16, W>(static_cast<const __nv_bfloat16*>(table) + at, i, out);
    } else {
        load_pieces<double, W>(static_cast<const double*>(table) + at, i, out);
    }
}

// The table row of query s: the position id at element `at` (int32 when `bytes` is 4, else
// int64) clamped to [0, table_rows - 1] (never a read outside the tables), or s when there
// are none.
__device__ __forceinline__ long long position(
    const void* ids, int bytes, long long at, long long s, long long table_rows) {
    if (ids == nullptr) return s;
    const long long p = bytes == 4 ? static_cast<const int*>(ids)[at]
                                   : static_cast<const long long*>(ids)[at];
    return p < 0 ? 0 : (p >= table_rows ? table_rows - 1 : p);
}

// (x1 c - x2 s, x2 c + x1 s) rounded to T (s already carries the pass's sign).
template <typename T>
__device__ __forceinline__ void rotate(float x1, float x2, float c, float s, T& y1, T& y2) {
    y1 = xk::from_float<T>(x1 * c - x2 * s);
    y2 = xk::from_float<T>(x2 * c + x1 * s);
}

// Half layout, one head: vector j of the row's first half and vector `second` (= R2 / V + j) of
// its second half, both loaded before either is stored.
template <typename T, int V>
__device__ __forceinline__ void rotate_half(
    T* out, const T* x, long long j, long long second, const float (&c)[V], const float (&s)[V]) {
    using VecT = xk::Vec<T, V>;
    const VecT* xv = reinterpret_cast<const VecT*>(x);
    const VecT first_half = xv[j], second_half = xv[second];
    VecT y1, y2;
#pragma unroll
    for (int e = 0; e < V; ++e) {
        rotate<T>(xk::to_float(first_half.v[e]), xk::to_float(second_half.v[e]), c[e], s[e],
                  y1.v[e], y2.v[e]);
    }
    VecT* ov = reinterpret_cast<VecT*>(out);
    ov[j] = y1;
    ov[second] = y2;
}

// Interleaved layout, one head: the Q vectors of the row from vector j, holding Q V / 2 pairs
// (2e, 2e + 1), all loaded before any is stored.
template <typename T, int V, int Q>
__device__ __forceinline__ void rotate_interleaved(
    T* out, const T* x, long long j, const float (&c)[Q * V / 2], const float (&s)[Q * V / 2]) {
    using VecT = xk::Vec<T, V>;
    const VecT* xv = reinterpret_cast<const VecT*>(x) + j;
    VecT v[Q], y[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) v[q] = xv[q];
#pragma unroll
    for (int e = 0; e < Q * V / 2; ++e) {
        const int i1 = 2 * e, i2 = 2 * e + 1;
        rotate<T>(xk::to_float(v[i1 / V].v[i1 % V]), xk::to_float(v[i2 / V].v[i2 % V]), c[e],
                  s[e], y[i1 / V].v[i1 % V], y[i2 / V].v[i2 % V]);
    }
    VecT* ov = reinterpret_cast<VecT*>(out) + j;
#pragma unroll
    for (int q = 0; q < Q; ++q) ov[q] = y[q];
}

}  // namespace

template <typename T, int V, bool INTERLEAVED>
__global__ void __launch_bounds__(256) rope(
    T* out,                          // (B, H, S, D) output; may be the very same array as x
    const T* x,                      // (B, H, S, D) input
    const void* cos_table,           // (B, P, R2) cosines, of dtype table_kind
    const void* sin_table,           // (B, P, R2) sines, of dtype table_kind
    int table_kind,                  // their dtype: 0 float, 1 half, 2 bfloat16, 3 double
    const void* position_ids,        // (B, S) table row of each query, or null: query s takes row s
    int position_bytes,              // bytes per position id: 4 (int32) or 8 (int64)
    long long table_rows,            // P, the rows of the tables (ids are clamped below it)
    float sign,                      // 1: forward; -1: backward (the inverse rotation)
    long long rows,                  // number of rows (b, s): B * S
    long long seq,                   // S
    long long heads,                 // H
    int r2,                          // rotated pairs R2 (a multiple of V; interleaved, of E / 2)
    int d,                           // elements of a row written: D, or 2 R2 when out is x
                                     // (the tail is in place already); a multiple of V
    long long s_out_b, long long s_out_h, long long s_out_s,  // element strides (b, h, s) of
                                                              // out (multiples of V)
    long long s_x_b, long long s_x_h, long long s_x_s,        // of x (multiples of V)
    long long s_cos_b, long long s_cos_p,  // element strides (b, p) of cos_table (0 along b: one
                                           // table for every batch); multiples of its access width
    long long s_sin_b, long long s_sin_p,  // of sin_table
    long long s_pos_b, long long s_pos_s)  // element strides (b, s) of position_ids
{
    constexpr int E = INTERLEAVED ? (V > 2 ? V : 2) : V;  // elements of a rotation unit (a side)
    constexpr int W = INTERLEAVED ? E / 2 : V;            // pairs of a rotation unit
    using VecT = xk::Vec<T, V>;
    const long long row = xk::thread_row();
    if (row >= rows) return;
    const long long b = row / seq, s = row % seq;
    const long long p =
        position(position_ids, position_bytes, b * s_pos_b + s * s_pos_s, s, table_rows);
    const T* xr = x + b * s_x_b + s * s_x_s;  // the row at head 0
    T* outr = out + b * s_out_b + s * s_out_s;
    const long long rotations = INTERLEAVED ? 2LL * r2 / E : static_cast<long long>(r2) / V;
    const long long units = rotations + static_cast<long long>(d - 2 * r2) / V;
    for (long long u = threadIdx.x; u < units; u += blockDim.x) {
        if (u >= rotations) {  // a vector of the tail, copied
            const long long j = 2LL * r2 / V + (u - rotations);
            for (long long h = blockIdx.y; h < heads; h += gridDim.y) {
                reinterpret_cast<VecT*>(outr + h * s_out_h)[j] =
                    reinterpret_cast<const VecT*>(xr + h * s_x_h)[j];
            }
            continue;
        }
        float c[W], sn[W];
        load_table<W>(cos_table, table_kind, b * s_cos_b + p * s_cos_p, u * W, c);
        load_table<W>(sin_table, table_kind, b * s_sin_b + p * s_sin_p, u * W, sn);
#pragma unroll
        for (int e = 0; e < W; ++e) sn[e] *= sign;
        for (long long h = blockIdx.y; h < heads; h += gridDim.y) {
            if constexpr (INTERLEAVED) {
                rotate_interleaved<T, V, E / V>(outr + h * s_out_h, xr + h * s_x_h, u * (E / V),
                                                c, sn);
            } else {
                rotate_half<T, V>(outr + h * s_out_h, xr + h * s_x_h, u, r2 / V + u, c, sn);
            }
        }
    }
}
