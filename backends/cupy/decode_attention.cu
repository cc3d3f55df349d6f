// Split-KV decode attention: one query per (batch, head) against the first lengths[b]
// keys of a contiguous or paged cache, cut into n_splits slices, then combined.
//
//   s_j = scale * q . k_j  (then softcap * tanh(s_j / softcap) when softcap > 0),
//   keys j in [lo, len): len = lengths[b] clamped to [0, Smax], lo = max(0, len - window)
//   (lo = 0 without a window);  o = sum_j e^(s_j - m) v_j / sum_j e^(s_j - m).
//
// decode_split: a block of WARPS warps per (batch x split, kv head x head chunk) reads each
// key and value of its slice once for up to G query heads of the kv head's group (GQA by
// index; a group of more than G heads is served by ceil(group / G) chunks).
// A key's row is spread over the 32 lanes of a warp, element e on lane e % 32 (coalesced);
// the warps take the slice's keys in turn, each with its own online-softmax state, and
// merge the states through shared memory at the end. Writes the split's unnormalised
// output, its max m (-inf: no key) and its sum l = sum e^(s - m) (0: no key), float32.
//
// decode_combine: a block per (batch x head) merges the splits:
//   M = max_s m_s,  o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s   (o = 0 when no key).
//
// Paged caches (block_table != null): key j of batch b sits in page
// block_table[b, j / page_size] (clamped into [0, num_pages)), slot j % page_size; the
// k/v "batch" stride is then the page stride and Smax = max_pages * page_size.
// Offsets are int64. T: the dtype of q, k, v, o; I: the dtype of lengths.
#include "common.cuh"

namespace {

constexpr int WARPS = 4;

// Pointer to row `j` (a key position) of batch `b`, kv head `g` of a cache.
// Positions are int (the launcher keeps Smax below 2**31): 64-bit division is an ABI call.
template <typename T>
__device__ __forceinline__ const T* cache_row(
    const T* base, long long b, long long g, int j, long long stride_b, long long stride_h,
    long long stride_n, const int* block_table, long long stride_tb, long long stride_tp,
    int page_size, long long num_pages) {
    if (block_table == nullptr) return base + b * stride_b + g * stride_h + j * stride_n;
    long long page = block_table[b * stride_tb + static_cast<long long>(j / page_size) * stride_tp];
    page = page < 0 ? 0 : page >= num_pages ? num_pages - 1 : page;
    return base + page * stride_b + g * stride_h + static_cast<long long>(j % page_size) * stride_n;
}

// cap * tanh(s / cap), through one exponential and a fast division (1 + e lies in [1, 2]):
// tanhf's and IEEE division's slow paths are ABI calls, whose register saves ptxas counts
// as spills. Absolute error a few ulp of cap. inv_cap = 1 / cap.
__device__ __forceinline__ float soft_cap(float s, float cap, float inv_cap) {
    const float x = s * inv_cap;
    const float e = __expf(-2.0f * fabsf(x));
    return cap * copysignf(__fdividef(1.0f - e, 1.0f + e), x);
}

// This lane's DPL elements lane, lane + 32, ... of a row of n, as float (0 past n): each
// load instruction of the warp reads 32 consecutive elements.
template <typename T, int DPL>
__device__ __forceinline__ void lane_elements(const T* row, int lane, int n, float (&out)[DPL]) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int e = lane + 32 * i;
        out[i] = e < n ? xk::to_float(row[e]) : 0.0f;
    }
}

}  // namespace

// G: query heads per block, a power of two (a chunk's heads past the group are skipped);
// DPL: elements of a head-dim row per lane (D, Dv <= 32 * DPL).
template <typename T, typename I, int G, int DPL>
__global__ void __launch_bounds__(32 * WARPS, 1) decode_split(
    float* __restrict__ o_partial,   // (B, H, n_splits, Dv) unnormalised split outputs
    float* __restrict__ m_partial,   // (B, H, n_splits) split maxima
    float* __restrict__ l_partial,   // (B, H, n_splits) split sums
    const T* q,                      // (B, H, D)
    const T* k,                      // (B, Hkv, Smax, D), or pages (num_pages, Hkv, page_size, D)
    const T* v,                      // as k with Dv
    const I* lengths,                // (B,) valid keys per batch
    const int* block_table,          // (B, max_pages) pages, or null (contiguous cache)
    int group,                       // query heads per kv head
    int chunks,                      // head chunks per kv head, ceil(group / G)
    int n_splits,                    // slices of each cache
    int d, int dv,                   // head dims of q/k and v/o
    int smax,                        // cache positions per batch (< 2**31)
    int page_size, long long num_pages,
    float scale, float softcap,      // softcap <= 0: none
    float inv_softcap,               // 1 / softcap
    int window,                      // keys a query sees at most; <= 0: all
    long long stride_qb, long long stride_qh,
    long long stride_kb, long long stride_kh, long long stride_kn,
    long long stride_vb, long long stride_vh, long long stride_vn,
    long long stride_tb, long long stride_tp,
    long long stride_lb,
    long long stride_pb, long long stride_ph, long long stride_ps,   // o_partial (last contiguous)
    long long stride_mb, long long stride_mh, long long stride_ms,   // m_partial and l_partial
    long long stride_lpb, long long stride_lph, long long stride_lps)
{
    const int split = blockIdx.x % n_splits;
    const long long b = blockIdx.x / n_splits, g = blockIdx.y / chunks;
    const int h0 = (blockIdx.y % chunks) * G;                // first head of the chunk in the group
    const int heads = group - h0 < G ? group - h0 : G;      // heads of this chunk
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long raw = static_cast<long long>(lengths[b * stride_lb]);
    const int len = raw < 0 ? 0 : raw > smax ? smax : static_cast<int>(raw);
    if (len == 0) return;  // the whole block: combine writes o = 0 without reading the splits
    const int lo = window > 0 && len > window ? len - window : 0;
    const int chunk = (len - lo + n_splits - 1) / n_splits;
    const long long first = lo + static_cast<long long>(split) * chunk;  // may pass len
    const int start = first < len ? static_cast<int>(first) : len;
    const int end = len - start < chunk ? len : start + chunk;

    float qv[G][DPL], acc[G][DPL], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = xk::neg_inf();
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[h][i] = 0.0f;
        if (h < heads) {
            lane_elements<T, DPL>(
                q + b * stride_qb + (g * group + h0 + h) * stride_qh, lane, d, qv[h]);
        } else {
#pragma unroll
            for (int i = 0; i < DPL; ++i) qv[h][i] = 0.0f;
        }
    }
    for (int j = start + warp; j < end; j += WARPS) {
        float kk[DPL], vv[DPL];
        lane_elements<T, DPL>(
            cache_row(k, b, g, j, stride_kb, stride_kh, stride_kn, block_table, stride_tb,
                      stride_tp, page_size, num_pages),
            lane, d, kk);
        lane_elements<T, DPL>(
            cache_row(v, b, g, j, stride_vb, stride_vh, stride_vn, block_table, stride_tb,
                      stride_tp, page_size, num_pages),
            lane, dv, vv);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (h >= heads) continue;
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) dot += qv[h][i] * kk[i];
            float s = xk::warp_sum(dot) * scale;  // the same bits on every lane
            if (softcap > 0.0f) s = soft_cap(s, softcap, inv_softcap);
            if (s > m[h]) {
                const float alpha = m[h] == xk::neg_inf() ? 0.0f : __expf(m[h] - s);
                l[h] = l[h] * alpha + 1.0f;
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[h][i] = acc[h][i] * alpha + vv[i];
                m[h] = s;
            } else if (m[h] != xk::neg_inf() || s != s) {
                // s <= m, or s is NaN (which must reach the output); a -inf score with
                // m = -inf adds nothing
                const float p = __expf(s - m[h]);
                l[h] += p;
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[h][i] += p * vv[i];
                if (s != s) m[h] = s;
            }
        }
    }

    // Merge the warps' states: warp w's (m, l) and acc rows in shared memory.
    float* smem = xk::dynamic_smem<float>();
    float* sm_m = smem;                          // [WARPS][G]
    float* sm_l = sm_m + WARPS * G;              // [WARPS][G]
    float* sm_acc = sm_l + WARPS * G;            // [WARPS][G][32 * DPL]
    if (lane == 0) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            sm_m[warp * G + h] = m[h];
            sm_l[warp * G + h] = l[h];
        }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
        for (int i = 0; i < DPL; ++i) sm_acc[(warp * G + h) * 32 * DPL + lane + 32 * i] = acc[h][i];
    }
    __syncthreads();
    const int width = 32 * DPL;
    for (int e = threadIdx.x; e < heads * width; e += 32 * WARPS) {
        const int h = e / width, c = e % width;
        float top = xk::neg_inf();
        bool nan = false;
        for (int w = 0; w < WARPS; ++w) {
            const float mw = sm_m[w * G + h];
            nan = nan || mw != mw;
            top = fmaxf(top, mw);
        }
        float sum = 0.0f, out = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float mw = sm_m[w * G + h];
            if (mw == xk::neg_inf()) continue;  // this warp saw no key
            const float weight = nan ? __int_as_float(0x7fc00000) : __expf(mw - top);
            sum += weight * sm_l[w * G + h];
            out += weight * sm_acc[(w * G + h) * width + c];
        }
        const long long head = g * group + h0 + h;
        if (c < dv) o_partial[b * stride_pb + head * stride_ph + split * stride_ps + c] = out;
        if (c == 0) {
            m_partial[b * stride_mb + head * stride_mh + split * stride_ms] =
                nan ? __int_as_float(0x7fc00000) : top;
            l_partial[b * stride_lpb + head * stride_lph + split * stride_lps] = sum;
        }
    }
}

// One block per (batch x head): o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
template <typename T, typename I>
__global__ void __launch_bounds__(128) decode_combine(
    T* __restrict__ o,               // (B, H, Dv) output
    const float* o_partial,          // (B, H, n_splits, Dv)
    const float* m_partial,          // (B, H, n_splits)
    const float* l_partial,          // (B, H, n_splits)
    const I* lengths,                // (B,)
    int heads,                       // H
    int n_splits, int dv, int smax,
    long long stride_ob, long long stride_oh,
    long long stride_lb,
    long long stride_pb, long long stride_ph, long long stride_ps,
    long long stride_mb, long long stride_mh, long long stride_ms,
    long long stride_lpb, long long stride_lph, long long stride_lps)
{
    const long long h = blockIdx.x % heads, b = blockIdx.x / heads;
    T* out = o + b * stride_ob + h * stride_oh;
    long long len = static_cast<long long>(lengths[b * stride_lb]);
    if (len <= 0 || smax == 0) {
        for (int c = threadIdx.x; c < dv; c += blockDim.x) out[c] = xk::from_float<T>(0.0f);
        return;
    }
    const float* ms = m_partial + b * stride_mb + h * stride_mh;
    const float* ls = l_partial + b * stride_lpb + h * stride_lph;
    const float* os = o_partial + b * stride_pb + h * stride_ph;
    float top = xk::neg_inf();
    bool nan = false;
    for (int s = 0; s < n_splits; ++s) {
        const float m = ms[s * stride_ms];
        nan = nan || m != m;
        top = fmaxf(top, m);
    }
    float total = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        const float m = ms[s * stride_ms];
        if (m != xk::neg_inf()) total += __expf(m - top) * ls[s * stride_lps];
    }
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float m = ms[s * stride_ms];
            if (m != xk::neg_inf()) acc += __expf(m - top) * os[s * stride_ps + c];
        }
        out[c] = xk::from_float<T>(nan ? __int_as_float(0x7fc00000) : acc / total);
    }
}
