// Gated activations (swiglu.cu, geglu.cu), elementwise over rows of length M, with an
// activation f(a) = a * g(a) of the gate a:
//   y = f(a) * b,   da = dy * b * f'(a),   db = dy * f(a)
// (f and f' recomputed by the backward). The kernels take the activation as a template
// parameter Act, a type with two static device functions:
//   float value(float a)                                   f(a)
//   void value_and_slope(float a, float& f, float& df)     f(a) and f'(a)
// defined by the .cu that includes this header (the only difference between the primitives).
// Sigmoid gates use sigmoid() below: from e = exp(-|z|), which never overflows.
//
// Geometry: block (X, Y) covers Y rows; along a row its X threads take U vectors of
// V elements each (X * U vectors per step: consecutive threads, consecutive vectors),
// and the grid's y blocks stride over the row. Rows are addressed in vectors
// (Vec<T, V> pointers, so every access keeps its 16-byte alignment: a vector
// store through a T* at a column offset was split into 32-bit stores by NVRTC 13). Every
// thread loads all of its elements before it stores any, so an output may be the very same
// array as an input. No shared memory, no barriers, no warp collectives.
// T: the dtype of every array. Computation in float32. V: elements per vector access
// (16 bytes / sizeof(T) when aligned, else 1). U: vectors per thread per step.
#pragma once
#include "common.cuh"

namespace xk {

// sigmoid(z) and sigmoid(z) * (1 - sigmoid(z)) = sigmoid(z) * sigmoid(-z), from e = exp(-|z|)
// (sigmoid(|z|) = 1 / (1 + e), sigmoid(-|z|) = e / (1 + e)): no overflow for any |z|, no
// cancellation near sigmoid(z) = 1 (1 + e lies in [1, 2]: the fast division is exact to 2 ulp
// there, and NaN stays NaN).
__device__ __forceinline__ float sigmoid(float z, float& slope) {
    const float e = expf(-fabsf(z));
    const float r = __fdividef(1.0f, 1.0f + e);
    const float s = z >= 0.0f ? r : e * r;
    slope = s * (z >= 0.0f ? e * r : r);
    return s;
}

// Vector j of the row `row` (V elements) as float32.
template <typename T, int V>
__device__ __forceinline__ void load_at(const Vec<T, V>* row, long long j, float (&out)[V]) {
    const Vec<T, V> r = row[j];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_float(r.v[i]);
}

// Store `in` as vector j of the row `row`, in T.
template <typename T, int V>
__device__ __forceinline__ void store_at(Vec<T, V>* row, long long j, const float (&in)[V]) {
    Vec<T, V> r;
#pragma unroll
    for (int i = 0; i < V; ++i) r.v[i] = from_float<T>(in[i]);
    row[j] = r;
}

// The vectors j < n of a row this thread takes, U per step: load(k, j) for the step's
// vectors k, then store(k, j) for the same (all loads before any store).
template <int U, typename Load, typename Store>
__device__ __forceinline__ void steps(long long n, Load load, Store store) {
    const long long step = (long long)gridDim.y * blockDim.x * U;
    for (long long base = (long long)blockIdx.y * blockDim.x * U + threadIdx.x; base < n;
         base += step) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const long long j = base + (long long)k * blockDim.x;
            if (j < n) load(k, j);
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const long long j = base + (long long)k * blockDim.x;
            if (j < n) store(k, j);
        }
    }
}

}  // namespace xk

template <typename T, typename Act, int V, int U>
__global__ void __launch_bounds__(256) gated_forward(
    T* y,                            // (rows, M) output; may be the very same array as a or b
    const T* a,                      // (rows, M) gate
    const T* b,                      // (rows, M) gated values
    long long rows,                  // number of rows
    int m,                           // row length M (a multiple of V)
    long long stride_y,              // elements between rows of y (a multiple of V)
    long long stride_a,              // elements between rows of a (a multiple of V)
    long long stride_b)              // elements between rows of b (a multiple of V)
{
    using VecT = xk::Vec<T, V>;
    const long long row = xk::thread_row();
    if (row >= rows) return;
    const VecT* ar = reinterpret_cast<const VecT*>(a + row * stride_a);
    const VecT* br = reinterpret_cast<const VecT*>(b + row * stride_b);
    VecT* yr = reinterpret_cast<VecT*>(y + row * stride_y);
    float av[U][V], bv[U][V];
    xk::steps<U>(
        m / V,
        [&](int k, long long j) {
            xk::load_at<T, V>(ar, j, av[k]);
            xk::load_at<T, V>(br, j, bv[k]);
        },
        [&](int k, long long j) {
            float out[V];
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = Act::value(av[k][i]) * bv[k][i];
            xk::store_at<T, V>(yr, j, out);
        });
}

template <typename T, typename Act, int V, int U>
__global__ void __launch_bounds__(256) gated_backward(
    const T* dy,                     // (rows, M) output gradient
    const T* __restrict__ a,         // (rows, M) gate
    const T* __restrict__ b,         // (rows, M) gated values
    T* da,                           // (rows, M) gate gradient, overwritten; may be dy
    T* db,                           // (rows, M) gated-value gradient, overwritten; may be dy
    long long rows,                  // number of rows
    int m,                           // row length M (a multiple of V)
    long long stride_dy,             // elements between rows of dy (a multiple of V)
    long long stride_a,              // elements between rows of a (a multiple of V)
    long long stride_b,              // elements between rows of b (a multiple of V)
    long long stride_da,             // elements between rows of da (a multiple of V)
    long long stride_db)             // elements between rows of db (a multiple of V)
{
    using VecT = xk::Vec<T, V>;
    const long long row = xk::thread_row();
    if (row >= rows) return;
    const VecT* dyr = reinterpret_cast<const VecT*>(dy + row * stride_dy);
    const VecT* ar = reinterpret_cast<const VecT*>(a + row * stride_a);
    const VecT* br = reinterpret_cast<const VecT*>(b + row * stride_b);
    VecT* dar = reinterpret_cast<VecT*>(da + row * stride_da);
    VecT* dbr = reinterpret_cast<VecT*>(db + row * stride_db);
    float dv[U][V], av[U][V], bv[U][V];
    xk::steps<U>(
        m / V,
        [&](int k, long long j) {
            xk::load_at<T, V>(dyr, j, dv[k]);
            xk::load_at<T, V>(ar, j, av[k]);
            xk::load_at<T, V>(br, j, bv[k]);
        },
        [&](int k, long long j) {
            float ga[V], gb[V];
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float f, df;
                Act::value_and_slope(av[k][i], f, df);
                ga[i] = dv[k][i] * bv[k][i] * df;
                gb[i] = dv[k][i] * f;
            }
            xk::store_at<T, V>(dar, j, ga);
            xk::store_at<T, V>(dbr, j, gb);
        });
}
