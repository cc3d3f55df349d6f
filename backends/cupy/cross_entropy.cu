// Cross-entropy of logit rows x (N, vocab) against integer targets t (N,), row by row. With
// z = softcap * tanh(x / softcap) (z = x without a softcap) and eps the label smoothing:
//   lse  = log(sum_j exp(z_j))
//   loss = (1 - eps) (lse - z_t)  [+ eps (lse - mean(z)) when eps > 0]  [+ z_loss lse^2 when
//          z_loss > 0]
//   dx_j = grad (p_j (1 + 2 z_loss lse) - (1 - eps) [j == t] - eps / vocab)
//          [* (1 - tanh(x_j / softcap)^2) under a softcap],   p_j = exp(z_j - lse).
// The bracketed terms are left out, not multiplied by 0, when their factor is 0: a -inf logit
// makes mean(z) -inf (and a row of them makes lse -inf), and 0 * inf is NaN. A row whose target
// is ignore_index loses 0 and gets exact zeros (its lse is written all the same); a target
// outside [0, vocab) that is not ignore_index gives that row a NaN loss and a NaN gradient,
// and is never used as an index.
//
// Geometry: one block per row (blockDim.x a multiple of 32, at most 1024; the blocks stride
// over the rows when there are more rows than blocks). The threads stride over the row in
// vectors of V elements: thread k takes vectors k, k + blockDim.x, ... The forward folds each
// vector into the thread's running max, sum of exp(z - max) and sum of z (one rescale per
// vector whose max is larger), merges them over the block (block_max, then the sums rescaled
// to the row max: block_sum2), and thread 0 reads z_t (one scalar load, only when t is in
// range) and writes the row's loss and lse; the row is read once. The running max starts at
// -FLT_MAX, not -inf, so no exponent is ever -inf - -inf: -inf logits add exp(-inf) = 0, a row
// of -inf logits gets lse = -FLT_MAX + log(0) = -inf, and NaN logits propagate. The backward is
// elementwise given the forward's lse, with no shared memory and no barriers: every element is
// loaded, then stored, by the same thread, so dlogits may be the very same array as logits.
//
// Accesses: 128-bit vectors when the launcher finds every row start 16-byte aligned and V
// dividing vocab, else V = 1. The forward's V is 16 / sizeof(T); the backward's 16 / the
// smaller element size of logits and dlogits, the wider array moved in two 16-byte pieces
// (two 128-bit stores of float32 dlogits per 128-bit load of 16-bit logits). Rows are
// addressed in Vec pointers indexed by vector: a Vec store through a T* at a column offset was
// split into 16-bit stores by NVRTC 13 in these row-striding loops (gated.cuh saw the same).
// Row offsets are int64, vector indices int32 (the launcher bounds vocab). Computation in
// float32. T: the logits' dtype; G: dlogits' (float, __half or __nv_bfloat16, any pairing).
#include "common.cuh"

namespace {

// -FLT_MAX (NVRTC has no <cfloat>).
__device__ __forceinline__ float lowest() { return __int_as_float(static_cast<int>(0xff7fffffu)); }

// A quiet NaN.
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// The target of a row: element `at` of an int32 (bytes == 4) or int64 array.
__device__ __forceinline__ long long target_at(const void* targets, int bytes, long long at) {
    return bytes == 4 ? static_cast<long long>(static_cast<const int*>(targets)[at])
                      : static_cast<const long long*>(targets)[at];
}

// z = softcap tanh(x / softcap) (inv = 1 / softcap) when CAP, else x.
template <bool CAP>
__device__ __forceinline__ float capped(float x, float softcap, float inv) {
    return CAP ? softcap * tanhf(x * inv) : x;
}

// f(j) for each vector j of a row of `vocab` elements (a multiple of V) this thread takes.
template <int V, typename F>
__device__ __forceinline__ void each_vector(int vocab, F f) {
    const int n = vocab / V, step = static_cast<int>(blockDim.x);
    for (int j = static_cast<int>(threadIdx.x); j < n; j += step) f(j);
}

// Elements N moved by one access of a row of T read in vectors of V: V, or 16 bytes' worth.
template <typename T, int V>
struct Piece {
    static constexpr int BYTES = static_cast<int>(sizeof(T));
    static constexpr int N = V * BYTES > 16 ? 16 / BYTES : V;
};

// Vector j (elements j V .. j V + V - 1) of a row, as float.
template <typename T, int V>
__device__ __forceinline__ void load_vector(const T* row, int j, float (&out)[V]) {
    constexpr int N = Piece<T, V>::N;
    const xk::Vec<T, N>* src =
        reinterpret_cast<const xk::Vec<T, N>*>(row) + static_cast<long long>(j) * (V / N);
#pragma unroll
    for (int k = 0; k < V / N; ++k) {
        const xk::Vec<T, N> r = src[k];
#pragma unroll
        for (int e = 0; e < N; ++e) out[k * N + e] = xk::to_float(r.v[e]);
    }
}

// Vector j of a row set to `in`, rounded to T.
template <typename T, int V>
__device__ __forceinline__ void store_vector(T* row, int j, const float (&in)[V]) {
    constexpr int N = Piece<T, V>::N;
    xk::Vec<T, N>* dst =
        reinterpret_cast<xk::Vec<T, N>*>(row) + static_cast<long long>(j) * (V / N);
#pragma unroll
    for (int k = 0; k < V / N; ++k) {
        xk::Vec<T, N> r;
#pragma unroll
        for (int e = 0; e < N; ++e) r.v[e] = xk::from_float<T>(in[k * N + e]);
        dst[k] = r;
    }
}

// Every element of this thread's share of a row of G set to `value`.
template <typename G, int V>
__device__ __forceinline__ void fill_row(G* row, int vocab, float value) {
    float out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = value;
    each_vector<V>(vocab, [&](int j) { store_vector<G, V>(row, j, out); });
}

// This thread's share of a row: its running max `mx`, the sum `s` of exp(z - mx) and the
// sum `zsum` of z over its vectors.
template <typename T, int V, bool CAP>
__device__ __forceinline__ void fold_row(
    const T* row, int vocab, float softcap, float inv, float& mx, float& s, float& zsum) {
    each_vector<V>(vocab, [&](int j) {
        float z[V];
        load_vector<T, V>(row, j, z);
        float top = mx;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            z[i] = capped<CAP>(z[i], softcap, inv);
            top = fmaxf(top, z[i]);
        }
        if (top > mx) {  // the max grows: rescale the sum so far
            s *= __expf(mx - top);
            mx = top;
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
            s += __expf(z[i] - mx);
            zsum += z[i];
        }
    });
}

// dx over this thread's share of a kept row (see the file's head): a = grad (1 + 2 z_loss lse),
// b = grad eps / vocab, c = grad (1 - eps) at the target column t.
template <typename T, typename G, int V, bool CAP>
__device__ __forceinline__ void gradient_row(
    G* drow, const T* row, int vocab, long long t, float lse, float a, float b, float c,
    float softcap, float inv) {
    each_vector<V>(vocab, [&](int j) {
        float x[V];
        load_vector<T, V>(row, j, x);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            float z = x[i], dz = 1.0f;
            if (CAP) {
                const float th = tanhf(x[i] * inv);
                z = softcap * th;
                dz = 1.0f - th * th;
            }
            float d = a * __expf(z - lse) - b;
            if (j * V + i == t) d -= c;
            x[i] = CAP ? d * dz : d;
        }
        store_vector<G, V>(drow, j, x);
    });
}

}  // namespace

// Forward: each row's loss and lse. Block (threads); blocks stride over the rows.
template <typename T, int V>
__global__ void __launch_bounds__(1024) cross_entropy_forward(
    float* loss,                     // (N,) float32 loss of each row
    float* lse,                      // (N,) float32 logsumexp of each row's z (ignored rows too)
    const T* logits,                 // (N, vocab) logits x
    const void* targets,             // (N,) int32 or int64 targets
    int target_bytes,                // bytes per target: 4 or 8
    long long rows,                  // N
    int vocab,                       // the row length (a multiple of V)
    long long stride_loss,           // elements between rows of loss
    long long stride_lse,            // of lse
    long long stride_logits,         // of logits (a multiple of V)
    long long stride_targets,        // of targets
    long long ignore_index,          // the target of rows that lose 0
    float label_smoothing,           // eps in [0, 1]
    float softcap,                   // > 0, or 0 for none
    float z_loss)                    // >= 0
{
    __shared__ float2 scratch[32];
    const float inv = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = logits + row * stride_logits;
        const long long t = target_at(targets, target_bytes, row * stride_targets);
        const bool kept = t != ignore_index, in_range = t >= 0 && t < vocab;
        float zt = 0.0f;
        if (threadIdx.x == 0 && kept && in_range) {
            const float xt = xk::to_float(xr[t]);
            zt = softcap > 0.0f ? capped<true>(xt, softcap, inv) : xt;
        }
        float mx = lowest(), s = 0.0f, zsum = 0.0f;
        if (softcap > 0.0f) {
            fold_row<T, V, true>(xr, vocab, softcap, inv, mx, s, zsum);
        } else {
            fold_row<T, V, false>(xr, vocab, softcap, inv, mx, s, zsum);
        }
        const float row_max = xk::block_max(mx, reinterpret_cast<float*>(scratch));
        float total = s * __expf(mx - row_max);
        xk::block_sum2(total, zsum, scratch);
        if (threadIdx.x == 0) {
            const float l = row_max + logf(total);
            float out = 0.0f;
            if (kept && !in_range) {
                out = quiet_nan();
            } else if (kept) {
                out = (1.0f - label_smoothing) * (l - zt);
                if (label_smoothing > 0.0f) {
                    out += label_smoothing * (l - zsum / static_cast<float>(vocab));
                }
                if (z_loss > 0.0f) out += z_loss * l * l;
            }
            lse[row * stride_lse] = l;
            loss[row * stride_loss] = out;
        }
    }
}

// Backward: dlogits = grad * d loss / d logits, row by row, given the forward's lse. Block
// (threads); blocks stride over the rows.
template <typename T, typename G, int V>
__global__ void __launch_bounds__(1024) cross_entropy_backward(
    G* dlogits,                      // (N, vocab) gradient, overwritten; may be logits itself
    const T* logits,                 // (N, vocab) logits x
    const void* targets,             // (N,) int32 or int64 targets
    int target_bytes,                // bytes per target: 4 or 8
    const float* lse,                // (N,) the forward's lse
    const float* grad,               // (N,) each row's weight (stride 0: one for all)
    long long rows,                  // N
    int vocab,                       // the row length (a multiple of V)
    long long stride_dlogits,        // elements between rows of dlogits (a multiple of V)
    long long stride_logits,         // of logits (a multiple of V)
    long long stride_targets,        // of targets
    long long stride_lse,            // of lse
    long long stride_grad,           // of grad (0: one weight for every row)
    long long ignore_index,          // the target of rows whose gradient is 0
    float label_smoothing,           // eps in [0, 1]
    float softcap,                   // > 0, or 0 for none
    float z_loss)                    // >= 0
{
    const float inv = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        G* dr = dlogits + row * stride_dlogits;
        const long long t = target_at(targets, target_bytes, row * stride_targets);
        if (t == ignore_index) {
            fill_row<G, V>(dr, vocab, 0.0f);
            continue;
        }
        if (t < 0 || t >= vocab) {
            fill_row<G, V>(dr, vocab, quiet_nan());
            continue;
        }
        const T* xr = logits + row * stride_logits;
        const float l = lse[row * stride_lse], g = grad[row * stride_grad];
        const float a = z_loss > 0.0f ? g * (1.0f + 2.0f * z_loss * l) : g;
        const float b = g * label_smoothing / static_cast<float>(vocab);
        const float c = g * (1.0f - label_smoothing);
        if (softcap > 0.0f) {
            gradient_row<T, G, V, true>(dr, xr, vocab, t, l, a, b, c, softcap, inv);
        } else {
            gradient_row<T, G, V, false>(dr, xr, vocab, t, l, a, b, c, softcap, inv);
        }
    }
}
