// Tiles, staging and warp-level products shared by the attention kernels (attention.cu) and
// the FlexAttention kernels (flex_attention.cuh). NVRTC-clean; the rules of common.cuh hold.
//
// A block has WARPS warps; warp w owns rows 16w .. 16w + 15 of the block's BM-row tile, and
// lane (r, half) of a warp row r of the warp's 16 and half `half` of its columns.
// Layout / BackwardLayout give the shared memory of the forward and backward blocks
// (ForwardTiles, DkdvTiles, DqTiles: its pointers), WarpMma the two products of a warp (wmma
// for __half / __nv_bfloat16, SIMT for float), stage / stage_kind copy a tile of a global
// array into shared memory; forward_tile, dkdv_tile and dq_tile are a warp's steps on one
// staged tile, the mask and the score's function left to their caller.
#pragma once
#include "common.cuh"
#include <mma.h>

namespace {

constexpr int WARPS = 4;
constexpr int BM = 16 * WARPS;
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;
constexpr int NO_BAD_KEY = 0x7fffffff;

// Shared memory of one block, in elements of each array (row strides padded by 16 bytes).
template <typename T, int BN, int DMAX>
struct Layout {
    static constexpr int PAD = 16 / static_cast<int>(sizeof(T));
    static constexpr int LD_T = DMAX + PAD;     // Q, K, V rows (T)
    static constexpr int LD_S = BN + 4;         // scores (float)
    static constexpr int LD_P = BN + PAD;       // probabilities (T)
    static constexpr int LD_O = DMAX + 4;       // output accumulator (float)
    static constexpr unsigned long long round32(unsigned long long n) { return (n + 31) / 32 * 32; }
    static constexpr unsigned long long Q = 0;
    static constexpr unsigned long long K = Q + round32(sizeof(T) * BM * LD_T);
    static constexpr unsigned long long V = K + round32(sizeof(T) * BN * LD_T);
    static constexpr unsigned long long S = V + round32(sizeof(T) * BN * LD_T);
    static constexpr unsigned long long P = S + round32(sizeof(float) * BM * LD_S);
    static constexpr unsigned long long O = P + round32(sizeof(T) * BM * LD_P);
    static constexpr unsigned long long BAD = O + round32(sizeof(float) * BM * LD_O);
    // + 32: the base is aligned up to 32 bytes (wmma's pointer alignment) inside the kernel.
    static constexpr unsigned long long BYTES = BAD + round32(sizeof(int) * DMAX) + 32;
};

// Warp-level products over shared memory; s, q, o, p point at the warp's 16 rows.
template <typename T, int BN, int DMAX>
struct WarpMma {
    // s (16 x BN, float) = q (16 x DMAX) . k (BN x DMAX)^T
    static __device__ __forceinline__ void scores(
        float* s, int lds, const T* q, int ldq, const T* k, int ldk) {
        using namespace nvcuda;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BN / 16];
#pragma unroll
        for (int n = 0; n < BN / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
        for (int kk = 0; kk < DMAX / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
            wmma::load_matrix_sync(a, q + kk * 16, ldq);
#pragma unroll
            for (int n = 0; n < BN / 16; ++n) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                wmma::load_matrix_sync(b, k + n * 16 * ldk + kk * 16, ldk);
                wmma::mma_sync(acc[n], a, b, acc[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < BN / 16; ++n)
            wmma::store_matrix_sync(s + n * 16, acc[n], lds, wmma::mem_row_major);
    }

    // o (16 x DMAX, float) += p (16 x BN) . v (BN x DMAX)
    static __device__ __forceinline__ void accumulate(
        float* o, int ldo, const T* p, int ldp, const T* v, int ldv) {
        using namespace nvcuda;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[BN / 16];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wmma::load_matrix_sync(a[kk], p + kk * 16, ldp);
#pragma unroll
        for (int n = 0; n < DMAX / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, o + n * 16, ldo, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(b, v + kk * 16 * ldv + n * 16, ldv);
                wmma::mma_sync(acc, a[kk], b, acc);
            }
            wmma::store_matrix_sync(o + n * 16, acc, ldo, wmma::mem_row_major);
        }
    }
};

// float32: the SIMT path (every product in float32 FMAs).
template <int BN, int DMAX>
struct WarpMma<float, BN, DMAX> {
    static __device__ __forceinline__ void scores(
        float* s, int lds, const float* q, int ldq, const float* k, int ldk) {
        const int lane = threadIdx.x & 31;
        for (int j = lane; j < BN; j += 32) {
            float acc[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) acc[r] = 0.0f;
            for (int d = 0; d < DMAX; ++d) {
                const float kd = k[j * ldk + d];
#pragma unroll
                for (int r = 0; r < 16; ++r) acc[r] = fmaf(q[r * ldq + d], kd, acc[r]);
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) s[r * lds + j] = acc[r];
        }
    }

    static __device__ __forceinline__ void accumulate(
        float* o, int ldo, const float* p, int ldp, const float* v, int ldv) {
        const int lane = threadIdx.x & 31;
        for (int c = lane; c < DMAX; c += 32) {
            float acc[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) acc[r] = o[r * ldo + c];
            for (int j = 0; j < BN; ++j) {
                const float vj = v[j * ldv + c];
#pragma unroll
                for (int r = 0; r < 16; ++r) acc[r] = fmaf(p[r * ldp + j], vj, acc[r]);
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) o[r * ldo + c] = acc[r];
        }
    }
};

// Element b of a (B,) int32 (width 4) or int64 (width 8) array; `fallback` when width is 0.
__device__ __forceinline__ long long batch_value(
    const void* p, long long stride, int width, long long b, long long fallback) {
    if (width == 0) return fallback;
    if (width == 8) return static_cast<const long long*>(p)[b * stride];
    return static_cast<long long>(static_cast<const int*>(p)[b * stride]);
}

__device__ __forceinline__ long long clamp(long long v, long long lo, long long hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= 3.402823466e38f; }

// dst (ROWS x DMAX, row stride ld) = src rows [0, rows) x columns [0, cols), zeros elsewhere.
// vec: 16-byte accesses (cols, the row stride and src are multiples of 16 bytes). With
// `clean`, a non-finite element is staged as 0 and (unless bad is null) bad[c] lowered to
// its key first + r.
template <typename T, int ROWS, int DMAX>
__device__ __forceinline__ void stage(
    T* dst, int ld, const T* src, long long stride, int rows, int cols, bool vec, bool clean,
    int* bad, int first) {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const T zero = xk::from_float<T>(0.0f);
    if (vec) {
        for (int e = threadIdx.x; e < ROWS * (DMAX / V); e += blockDim.x) {
            const int r = e / (DMAX / V), c = e % (DMAX / V) * V;
            xk::Vec<T, V> val;
            if (r < rows && c < cols) {
                val = *reinterpret_cast<const xk::Vec<T, V>*>(src + r * stride + c);
            } else {
#pragma unroll
                for (int i = 0; i < V; ++i) val.v[i] = zero;
            }
            if (clean) {
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    if (!finite(xk::to_float(val.v[i]))) {
                        val.v[i] = zero;
                        if (bad != nullptr) atomicMin(bad + c + i, first + r);
                    }
                }
            }
            *reinterpret_cast<xk::Vec<T, V>*>(dst + r * ld + c) = val;
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * DMAX; e += blockDim.x) {
            const int r = e / DMAX, c = e % DMAX;
            T val = r < rows && c < cols ? src[r * stride + c] : zero;
            if (clean && !finite(xk::to_float(val))) {
                val = zero;
                if (bad != nullptr) atomicMin(bad + c, first + r);
            }
            dst[r * ld + c] = val;
        }
    }
}

__device__ __forceinline__ void store_out(void* o, int kind, long long at, float value) {
    if (kind == 0) {
        static_cast<float*>(o)[at] = value;
    } else if (kind == 1) {
        static_cast<__half*>(o)[at] = xk::from_float<__half>(value);
    } else {
        static_cast<__nv_bfloat16*>(o)[at] = xk::from_float<__nv_bfloat16>(value);
    }
}

__device__ __forceinline__ float load_kind(const void* p, int kind, long long at) {
    if (kind == 0) return static_cast<const float*>(p)[at];
    if (kind == 1) return xk::to_float(static_cast<const __half*>(p)[at]);
    return xk::to_float(static_cast<const __nv_bfloat16*>(p)[at]);
}

// dst (ROWS x DMAX of T, row stride ld) = src (of `kind`) rows [0, rows) x columns [0, cols),
// zeros elsewhere (scalar loads: src's dtype may differ from T).
template <typename T, int ROWS, int DMAX>
__device__ __forceinline__ void stage_kind(
    T* dst, int ld, const void* src, int kind, long long at, long long stride, int rows, int cols) {
    for (int e = threadIdx.x; e < ROWS * DMAX; e += blockDim.x) {
        const int r = e / DMAX, c = e % DMAX;
        const float val = r < rows && c < cols ? load_kind(src, kind, at + r * stride + c) : 0.0f;
        dst[r * ld + c] = xk::from_float<T>(val);
    }
}

// Shared memory of a backward block: A rows of the block's own side (keys for dK/dV, queries
// for dQ) and N rows of the side it walks; accumulators X and Y (16 x DMAX per warp, float).
// TILES tiles of T (A x N) from the element-wise step (dK/dV: P and dS; dQ: dS), and
// ROW_VALUES 4-byte values per walked row (dK/dV: its key limit, lse2 and delta). For float
// those tiles are the scores' and dP's own storage (the element-wise step runs in place).
template <typename T, int A, int N, int DMAX, int ACCS, int TILES, int ROW_VALUES>
struct BackwardLayout {
    static constexpr bool ALIAS = sizeof(T) == sizeof(float);
    static constexpr int PAD = 16 / static_cast<int>(sizeof(T));
    static constexpr int LD_T = DMAX + PAD;     // staged rows (T)
    static constexpr int LD_S = N + 4;          // scores and dP (float)
    static constexpr int LD_P = N + PAD;        // P and dS (T)
    static constexpr int LD_O = DMAX + 4;       // accumulators (float)
    static constexpr unsigned long long round32(unsigned long long n) { return (n + 31) / 32 * 32; }
    static constexpr unsigned long long OWN1 = 0;                                   // K or Q
    static constexpr unsigned long long OWN2 = OWN1 + round32(sizeof(T) * A * LD_T); // V or dO
    static constexpr unsigned long long WALK1 = OWN2 + round32(sizeof(T) * A * LD_T);  // Q or K
    static constexpr unsigned long long WALK2 = WALK1 + round32(sizeof(T) * N * LD_T); // dO or V
    static constexpr unsigned long long S = WALK2 + round32(sizeof(T) * N * LD_T);
    static constexpr unsigned long long DP = S + round32(sizeof(float) * A * LD_S);
    static constexpr unsigned long long PT = DP + round32(sizeof(float) * A * LD_S);
    static constexpr unsigned long long ACC =
        ALIAS ? PT : PT + TILES * round32(sizeof(T) * A * LD_P);
    static constexpr int LD_PS = ALIAS ? LD_S : LD_P;  // row stride of those tiles (elements)
    // Tile n (< TILES) of the element-wise step.
    static constexpr unsigned long long tile(int n) {
        return ALIAS ? (n == 0 ? S : DP) : PT + n * round32(sizeof(T) * A * LD_P);
    }
    static constexpr unsigned long long ROWS = ACC + round32(sizeof(float) * ACCS * A * LD_O);
    // + 32: the base is aligned up to 32 bytes (wmma's pointer alignment) inside the kernel.
    static constexpr unsigned long long BYTES = ROWS + round32(ROW_VALUES * sizeof(float) * N) + 32;
};

// The block's dynamic shared memory for layout L, aligned up to 32 bytes.
template <typename L>
__device__ __forceinline__ unsigned char* block_smem(unsigned long long shared_bytes) {
    if (shared_bytes < L::BYTES) __trap();  // the launcher's layout must match this one
    unsigned char* base = xk::dynamic_smem<unsigned char>();
    return base + (32 - reinterpret_cast<unsigned long long>(base) % 32) % 32;
}

// lse_i = m_i + ln l_i of checkpoints (m, l), in base 2.
__device__ __forceinline__ float lse2_of(float m, float l) { return m * LOG2E + log2f(l); }

// Zeros the lane's half of row r of a 16 x DMAX float accumulator (row stride ld).
template <int DMAX>
__device__ __forceinline__ void zero_row(float* acc, int ld, int r, int half) {
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2); ++c) acc[r * ld + c] = 0.0f;
}

// A forward block's shared memory (Layout): the Q, K and V tiles, the warp's 16 rows of S, P
// and the output accumulator O, and bad: per V column its first non-finite key.
template <typename T, int BN, int DMAX>
struct ForwardTiles {
    using L = Layout<T, BN, DMAX>;
    T *q, *k, *v;
    float* s;
    T* p;
    float* o;
    int* bad;
    __device__ __forceinline__ ForwardTiles(unsigned char* base, int warp)
        : q(reinterpret_cast<T*>(base + L::Q)),
          k(reinterpret_cast<T*>(base + L::K)),
          v(reinterpret_cast<T*>(base + L::V)),
          s(reinterpret_cast<float*>(base + L::S) + warp * 16 * L::LD_S),
          p(reinterpret_cast<T*>(base + L::P) + warp * 16 * L::LD_P),
          o(reinterpret_cast<float*>(base + L::O) + warp * 16 * L::LD_O),
          bad(reinterpret_cast<int*>(base + L::BAD)) {}
};

// A forward warp's step on a staged key tile: S_w = Q_w K^T; lane (r, half) maps its half
// row of S through score(c, s) (key j0 + c, raw score s: its base-2 score, -inf when masked),
// runs the online softmax (m, l: the base-2 running max and sum), writes P_w = exp2(s - m)
// and rescales its row of O_w; then O_w += P_w V.
template <typename T, int BN, int DMAX, typename Score>
__device__ __forceinline__ void forward_tile(
    const ForwardTiles<T, BN, DMAX>& t, int warp, int r, int half, float& m, float& l, Score score) {
    using L = Layout<T, BN, DMAX>;
    WarpMma<T, BN, DMAX>::scores(t.s, L::LD_S, t.q + warp * 16 * L::LD_T, L::LD_T, t.k, L::LD_T);
    __syncwarp(xk::FULL_MASK);
    float top = xk::neg_inf();
    for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
        const float s = score(c, t.s[r * L::LD_S + c]);
        t.s[r * L::LD_S + c] = s;
        top = fmaxf(top, s);
    }
    top = fmaxf(top, __shfl_xor_sync(xk::FULL_MASK, top, 16));
    const float m_new = fmaxf(m, top);
    const float shift = m_new == xk::neg_inf() ? 0.0f : m_new;  // no -inf - -inf
    const float alpha = exp2f(m - shift);
    float sum = 0.0f;
    for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
        const float p = exp2f(t.s[r * L::LD_S + c] - shift);
        sum += p;
        t.p[r * L::LD_P + c] = xk::from_float<T>(p);
    }
    sum += __shfl_xor_sync(xk::FULL_MASK, sum, 16);
    l = l * alpha + sum;
    m = m_new;
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2); ++c) t.o[r * L::LD_O + c] *= alpha;
    __syncwarp(xk::FULL_MASK);
    WarpMma<T, BN, DMAX>::accumulate(t.o, L::LD_O, t.p, L::LD_P, t.v, L::LD_T);
    __syncwarp(xk::FULL_MASK);
}

// Row r of O_w / l into o at `at` (the lane's half of the columns below dv; NaN in those
// where poisoned(c)) and, unless m_out is null, the checkpoints m (natural log; -inf when
// l = 0, NaN when `nan`) and l at at_m, at_l.
template <typename T, int BN, int DMAX, typename Poisoned>
__device__ __forceinline__ void write_output(
    const ForwardTiles<T, BN, DMAX>& t, int r, int half, float m, float l, bool nan, void* o,
    int o_kind, long long at, int dv, float* m_out, long long at_m, float* l_out, long long at_l,
    Poisoned poisoned) {
    using L = Layout<T, BN, DMAX>;
    // l >= 1 on a row that kept a key (its max contributes exp2(0)): the fast division is
    // exact enough there, and IEEE division's slow path is an ABI call ptxas counts as spills.
    const float inv = l == 0.0f ? 0.0f : __fdividef(1.0f, l);
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2) && c < dv; ++c) {
        const float value = poisoned(c) ? __int_as_float(0x7fc00000) : t.o[r * L::LD_O + c] * inv;
        store_out(o, o_kind, at + c, value);
    }
    if (m_out != nullptr && half == 0) {
        m_out[at_m] = nan ? __int_as_float(0x7fc00000) : l == 0.0f ? xk::neg_inf() : m * LN2;
        l_out[at_l] = l;
    }
}

// A dK/dV block's shared memory (BackwardLayout): its K and V tiles, the walked Q and dO
// tiles, the warp's 16 rows of S^T, dP^T, P^T, dS^T and of the dK and dV accumulators, and
// per walked query its key limit (or whether it keeps a key), lse2 and delta.
template <typename T, int BQ, int DMAX>
struct DkdvTiles {
    using L = BackwardLayout<T, BM, BQ, DMAX, 2, 2, 3>;
    T *k, *v, *q, *d_o;
    float *s, *dp;
    T *p, *ds;
    float *dk, *dv;
    int* limit;
    float *lse2, *delta;
    __device__ __forceinline__ DkdvTiles(unsigned char* base, int warp)
        : k(reinterpret_cast<T*>(base + L::OWN1)),
          v(reinterpret_cast<T*>(base + L::OWN2)),
          q(reinterpret_cast<T*>(base + L::WALK1)),
          d_o(reinterpret_cast<T*>(base + L::WALK2)),
          s(reinterpret_cast<float*>(base + L::S) + warp * 16 * L::LD_S),
          dp(reinterpret_cast<float*>(base + L::DP) + warp * 16 * L::LD_S),
          p(reinterpret_cast<T*>(base + L::tile(0)) + warp * 16 * L::LD_PS),
          ds(reinterpret_cast<T*>(base + L::tile(1)) + warp * 16 * L::LD_PS),
          dk(reinterpret_cast<float*>(base + L::ACC) + warp * 16 * L::LD_O),
          dv(dk + BM * L::LD_O),
          limit(reinterpret_cast<int*>(base + L::ROWS)),
          lse2(reinterpret_cast<float*>(limit + BQ)),
          delta(lse2 + BQ) {}
};

// A dK/dV warp's step on a staged query tile: S^T_w = K_w Q^T, dP^T_w = V_w dO^T; lane
// (r, half) gets p and ds of its half row from grads(c, s, dp, p, ds) (query i0 + c, raw
// score s, dp), rounded to T; then dV_w += P^T dO and dK_w += dS^T Q.
template <typename T, int BQ, int DMAX, typename Grads>
__device__ __forceinline__ void dkdv_tile(
    const DkdvTiles<T, BQ, DMAX>& t, int warp, int r, int half, Grads grads) {
    using L = BackwardLayout<T, BM, BQ, DMAX, 2, 2, 3>;
    WarpMma<T, BQ, DMAX>::scores(t.s, L::LD_S, t.k + warp * 16 * L::LD_T, L::LD_T, t.q, L::LD_T);
    WarpMma<T, BQ, DMAX>::scores(t.dp, L::LD_S, t.v + warp * 16 * L::LD_T, L::LD_T, t.d_o,
                                 L::LD_T);
    __syncwarp(xk::FULL_MASK);
    for (int c = half * (BQ / 2); c < (half + 1) * (BQ / 2); ++c) {
        float p, ds;
        grads(c, t.s[r * L::LD_S + c], t.dp[r * L::LD_S + c], p, ds);
        t.p[r * L::LD_PS + c] = xk::from_float<T>(p);
        t.ds[r * L::LD_PS + c] = xk::from_float<T>(ds);
    }
    __syncwarp(xk::FULL_MASK);
    WarpMma<T, BQ, DMAX>::accumulate(t.dv, L::LD_O, t.p, L::LD_PS, t.d_o, L::LD_T);
    WarpMma<T, BQ, DMAX>::accumulate(t.dk, L::LD_O, t.ds, L::LD_PS, t.q, L::LD_T);
    __syncwarp(xk::FULL_MASK);
}

// A dQ block's shared memory (BackwardLayout): its Q and dO tiles, the walked K and V tiles,
// the warp's 16 rows of S, dP, dS and of the dQ accumulator.
template <typename T, int BN, int DMAX>
struct DqTiles {
    using L = BackwardLayout<T, BM, BN, DMAX, 1, 1, 0>;
    T *q, *d_o, *k, *v;
    float *s, *dp;
    T* ds;
    float* dq;
    __device__ __forceinline__ DqTiles(unsigned char* base, int warp)
        : q(reinterpret_cast<T*>(base + L::OWN1)),
          d_o(reinterpret_cast<T*>(base + L::OWN2)),
          k(reinterpret_cast<T*>(base + L::WALK1)),
          v(reinterpret_cast<T*>(base + L::WALK2)),
          s(reinterpret_cast<float*>(base + L::S) + warp * 16 * L::LD_S),
          dp(reinterpret_cast<float*>(base + L::DP) + warp * 16 * L::LD_S),
          ds(reinterpret_cast<T*>(base + L::tile(0)) + warp * 16 * L::LD_PS),
          dq(reinterpret_cast<float*>(base + L::ACC) + warp * 16 * L::LD_O) {}
};

// A dQ warp's step on a staged key tile: S_w = Q_w K^T, dP_w = dO_w V^T; lane (r, half)
// gets ds of its half row from grads(c, s, dp) (key j0 + c, raw score s, dp), rounded to T;
// then dQ_w += dS K.
template <typename T, int BN, int DMAX, typename Grads>
__device__ __forceinline__ void dq_tile(
    const DqTiles<T, BN, DMAX>& t, int warp, int r, int half, Grads grads) {
    using L = BackwardLayout<T, BM, BN, DMAX, 1, 1, 0>;
    WarpMma<T, BN, DMAX>::scores(t.s, L::LD_S, t.q + warp * 16 * L::LD_T, L::LD_T, t.k, L::LD_T);
    WarpMma<T, BN, DMAX>::scores(t.dp, L::LD_S, t.d_o + warp * 16 * L::LD_T, L::LD_T, t.v,
                                 L::LD_T);
    __syncwarp(xk::FULL_MASK);
    // Two columns a step: unrolled in full, the float dQ kernel takes ~20 more registers.
#pragma unroll 2
    for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c)
        t.ds[r * L::LD_PS + c] = xk::from_float<T>(grads(c, t.s[r * L::LD_S + c], t.dp[r * L::LD_S + c]));
    __syncwarp(xk::FULL_MASK);
    WarpMma<T, BN, DMAX>::accumulate(t.dq, L::LD_O, t.ds, L::LD_PS, t.k, L::LD_T);
    __syncwarp(xk::FULL_MASK);
}

}  // namespace
