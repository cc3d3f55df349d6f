// Merging two attention states (o, m, l) over disjoint key sets, and its backward:
//   m = max(m_a, m_b),   l = l_a e^(m_a - m) + l_b e^(m_b - m),
//   o = w_a o_a + w_b o_b,   w_a = l_a e^(m_a - m) / l   (w_b likewise);
//   do_a = w_a do,   dlse_a = w_a (rowsum(do * (o_a - o)) + dlse)   (b likewise).
// A row is one (b, h, s) of the (B, H, S) states, found from its flat index; every stride
// is an argument and offsets are int64. G lanes of a warp (G a power of two, at most 32)
// share a row, each taking V consecutive columns of the o-shaped arrays per step (one
// access of V elements; the launcher picks V = 1 unless every row allows it).
// Aliasing: the row's first lane alone reads the row's statistics, hands them to the
// others by shuffle and writes the row's statistics last, and every element of an
// o-shaped output is read and written by one thread, so an output may be the very same
// array as an input (m is m_a, dlse_a is dlse, o is o_a, do_a is do).
// Empty rows (m = -inf) are shifted by 0 before exp, 1 / l is taken only where l != 0, and a
// side of weight w == 0 contributes exactly 0 (selected, never multiplied), whatever its o
// holds: no -inf - -inf, no 0 / 0. NaN as on the array_api backend: it reaches exactly the
// rows whose statistics hold it. The max propagates it, a NaN weight is not 0 (so it is
// multiplied in: o, l, do_a, do_b, dlse_a, dlse_b of the row are NaN), an l that is
// negative or +inf counts as NaN, and m = +inf gives NaN through exp(inf - inf).
// The o-shaped arrays may each be float, __half or __nv_bfloat16 (kinds 0, 1, 2; o_a and
// o_b share one); the statistics are float32. Accumulation in float32.
#include "common.cuh"

namespace {

// V elements at p[at] of dtype `kind`, as float.
template <int V>
__device__ __forceinline__ void load_kind(const void* p, int kind, long long at, float (&out)[V]) {
    if (kind == 0) {
        xk::load_vec<float, V>(static_cast<const float*>(p) + at, out);
    } else if (kind == 1) {
        xk::load_vec<__half, V>(static_cast<const __half*>(p) + at, out);
    } else {
        xk::load_vec<__nv_bfloat16, V>(static_cast<const __nv_bfloat16*>(p) + at, out);
    }
}

// V floats stored at p[at], rounded to dtype `kind`.
template <int V>
__device__ __forceinline__ void store_kind(void* p, int kind, long long at, const float (&in)[V]) {
    if (kind == 0) {
        xk::store_vec<float, V>(static_cast<float*>(p) + at, in);
    } else if (kind == 1) {
        xk::store_vec<__half, V>(static_cast<__half*>(p) + at, in);
    } else {
        xk::store_vec<__nv_bfloat16, V>(static_cast<__nv_bfloat16*>(p) + at, in);
    }
}

// One row's (b, h, s), and its element offset in an array of element strides (sb, sh, ss).
struct Row {
    long long b, h, s;
    __device__ __forceinline__ long long at(long long sb, long long sh, long long ss) const {
        return b * sb + h * sh + s * ss;
    }
};

// Flat row r of a (B, H, S) layout.
__device__ __forceinline__ Row row_of(long long r, long long heads, long long seq) {
    const long long bh = r / seq;
    return Row{bh / heads, bh % heads, r % seq};
}

// max(a, b), NaN when either is NaN (NumPy's maximum).
__device__ __forceinline__ float max_nan(float a, float b) { return a > b || a != a ? a : b; }

// exp(m_side - m), an empty merged row (m = -inf) shifted by 0: never -inf - -inf.
__device__ __forceinline__ float shifted_exp(float m_side, float m) {
    return expf(m_side - (m == xk::neg_inf() ? 0.0f : m));
}

// 1 / l, and 0 where l == 0 (an empty merged row): never 0 / 0; NaN stays NaN.
__device__ __forceinline__ float inverse(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// A row sum l as read: NaN where it is negative, +inf or NaN (no attention state has such an l).
__device__ __forceinline__ float valid_sum(float l) {
    return l >= 0.0f && l < __int_as_float(0x7f800000) ? l : __int_as_float(0x7fc00000);
}

// v of the first lane of this lane's group of `group` lanes (all 32 lanes call it).
__device__ __forceinline__ float from_leader(float v, int group) {
    return __shfl_sync(xk::FULL_MASK, v, 0, group);
}

// Sum over this lane's group of `group` lanes, in a fixed order (all 32 lanes call it).
__device__ __forceinline__ float group_sum(float v, int group) {
    for (int o = group >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(xk::FULL_MASK, v, o, group);
    return v;
}

}  // namespace

// Forward: blocks of 256 threads, 256 / G rows each; no thread leaves early (shuffles).
template <int V>
__global__ void __launch_bounds__(256) merge_attention_states_forward(
    void* o, int o_kind,                      // (B, H, S, Dv) merged output; may be o_a or o_b
    float* m,                                 // (B, H, S) merged row max; may be m_a or m_b
    float* l,                                 // (B, H, S) merged row sum; may be l_a or l_b
    const void* o_a, const void* o_b, int in_kind,  // (B, H, S, Dv) each side's output
    const float* m_a, const float* l_a,       // (B, H, S) side a's checkpoints
    const float* m_b, const float* l_b,       // (B, H, S) side b's checkpoints
    long long rows, long long heads, long long seq,  // B * H * S, H, S
    int dv, int group,                        // head dim Dv, lanes per row G
    long long s_o_b, long long s_o_h, long long s_o_s,  // element strides (b, h, s) of o
    long long s_m_b, long long s_m_h, long long s_m_s,  // of m
    long long s_l_b, long long s_l_h, long long s_l_s,  // of l
    long long s_oa_b, long long s_oa_h, long long s_oa_s,  // of o_a
    long long s_ma_b, long long s_ma_h, long long s_ma_s,  // of m_a
    long long s_la_b, long long s_la_h, long long s_la_s,  // of l_a
    long long s_ob_b, long long s_ob_h, long long s_ob_s,  // of o_b
    long long s_mb_b, long long s_mb_h, long long s_mb_s,  // of m_b
    long long s_lb_b, long long s_lb_h, long long s_lb_s)  // of l_b
{
    const int lane = static_cast<int>(threadIdx.x) & (group - 1);
    const long long r =
        static_cast<long long>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
    const bool active = r < rows;
    const Row row = row_of(active ? r : 0, heads, seq);
    float ma = 0.0f, la = 0.0f, mb = 0.0f, lb = 0.0f;
    if (active && lane == 0) {
        ma = m_a[row.at(s_ma_b, s_ma_h, s_ma_s)];
        la = l_a[row.at(s_la_b, s_la_h, s_la_s)];
        mb = m_b[row.at(s_mb_b, s_mb_h, s_mb_s)];
        lb = l_b[row.at(s_lb_b, s_lb_h, s_lb_s)];
    }
    ma = from_leader(ma, group);
    la = from_leader(la, group);
    mb = from_leader(mb, group);
    lb = from_leader(lb, group);
    if (!active) return;  // after the last shuffle
    const float mx = max_nan(ma, mb);
    const float scaled_a = valid_sum(la) * shifted_exp(ma, mx);
    const float scaled_b = valid_sum(lb) * shifted_exp(mb, mx);
    const float sum = scaled_a + scaled_b;
    const float inv = inverse(sum);
    const float wa = scaled_a * inv, wb = scaled_b * inv;
    const long long at_o = row.at(s_o_b, s_o_h, s_o_s);
    const long long at_a = row.at(s_oa_b, s_oa_h, s_oa_s);
    const long long at_b = row.at(s_ob_b, s_ob_h, s_ob_s);
    for (int c = lane * V; c < dv; c += group * V) {
        float va[V], vb[V], out[V];
        load_kind<V>(o_a, in_kind, at_a + c, va);
        load_kind<V>(o_b, in_kind, at_b + c, vb);
#pragma unroll
        for (int i = 0; i < V; ++i)
            out[i] = (wa != 0.0f ? wa * va[i] : 0.0f) + (wb != 0.0f ? wb * vb[i] : 0.0f);
        store_kind<V>(o, o_kind, at_o + c, out);
    }
    if (lane == 0) {
        m[row.at(s_m_b, s_m_h, s_m_s)] = mx;
        l[row.at(s_l_b, s_l_h, s_l_s)] = sum;
    }
}

// Backward: geometry as the forward's. dlse may be null (zero).
template <int V>
__global__ void __launch_bounds__(256) merge_attention_states_backward(
    const void* d_o, int do_kind,             // (B, H, S, Dv) merged output gradient
    const float* dlse,                        // (B, H, S) merged lse gradient, or null
    const void* o, int o_kind,                // (B, H, S, Dv) merged output
    const float* m, const float* l,           // (B, H, S) merged checkpoints
    const void* o_a, const void* o_b, int in_kind,  // (B, H, S, Dv) each side's output
    const float* m_a, const float* l_a,       // (B, H, S) side a's checkpoints
    const float* m_b, const float* l_b,       // (B, H, S) side b's checkpoints
    void* do_a, int do_a_kind,                // (B, H, S, Dv) side a's output gradient; may be d_o
    float* dlse_a,                            // (B, H, S) side a's lse gradient; may be dlse
    void* do_b, int do_b_kind,                // (B, H, S, Dv) side b's output gradient; may be d_o
    float* dlse_b,                            // (B, H, S) side b's lse gradient; may be dlse
    long long rows, long long heads, long long seq,  // B * H * S, H, S
    int dv, int group,                        // head dim Dv, lanes per row G
    long long s_do_b, long long s_do_h, long long s_do_s,  // element strides (b, h, s) of d_o
    long long s_dl_b, long long s_dl_h, long long s_dl_s,  // of dlse
    long long s_o_b, long long s_o_h, long long s_o_s,  // of o
    long long s_m_b, long long s_m_h, long long s_m_s,  // of m
    long long s_l_b, long long s_l_h, long long s_l_s,  // of l
    long long s_oa_b, long long s_oa_h, long long s_oa_s,  // of o_a
    long long s_ma_b, long long s_ma_h, long long s_ma_s,  // of m_a
    long long s_la_b, long long s_la_h, long long s_la_s,  // of l_a
    long long s_ob_b, long long s_ob_h, long long s_ob_s,  // of o_b
    long long s_mb_b, long long s_mb_h, long long s_mb_s,  // of m_b
    long long s_lb_b, long long s_lb_h, long long s_lb_s,  // of l_b
    long long s_doa_b, long long s_doa_h, long long s_doa_s,  // of do_a
    long long s_dla_b, long long s_dla_h, long long s_dla_s,  // of dlse_a
    long long s_dob_b, long long s_dob_h, long long s_dob_s,  // of do_b
    long long s_dlb_b, long long s_dlb_h, long long s_dlb_s)  // of dlse_b
{
    const int lane = static_cast<int>(threadIdx.x) & (group - 1);
    const long long r =
        static_cast<long long>(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
    const bool active = r < rows;
    const Row row = row_of(active ? r : 0, heads, seq);
    float mx = 0.0f, sum = 0.0f, ma = 0.0f, la = 0.0f, mb = 0.0f, lb = 0.0f, d_lse = 0.0f;
    if (active && lane == 0) {
        mx = m[row.at(s_m_b, s_m_h, s_m_s)];
        sum = l[row.at(s_l_b, s_l_h, s_l_s)];
        ma = m_a[row.at(s_ma_b, s_ma_h, s_ma_s)];
        la = l_a[row.at(s_la_b, s_la_h, s_la_s)];
        mb = m_b[row.at(s_mb_b, s_mb_h, s_mb_s)];
        lb = l_b[row.at(s_lb_b, s_lb_h, s_lb_s)];
        if (dlse != nullptr) d_lse = dlse[row.at(s_dl_b, s_dl_h, s_dl_s)];
    }
    mx = from_leader(mx, group);
    sum = from_leader(sum, group);
    ma = from_leader(ma, group);
    la = from_leader(la, group);
    mb = from_leader(mb, group);
    lb = from_leader(lb, group);
    const float inv = inverse(valid_sum(sum));
    const float wa = valid_sum(la) * shifted_exp(ma, mx) * inv;
    const float wb = valid_sum(lb) * shifted_exp(mb, mx) * inv;
    // rowsum(do * (o_side - o)); a side with w == 0 drops it below (selected, never multiplied).
    float dot_a = 0.0f, dot_b = 0.0f;
    if (active) {
        const long long at_do = row.at(s_do_b, s_do_h, s_do_s);
        const long long at_o = row.at(s_o_b, s_o_h, s_o_s);
        const long long at_a = row.at(s_oa_b, s_oa_h, s_oa_s);
        const long long at_b = row.at(s_ob_b, s_ob_h, s_ob_s);
        const long long at_da = row.at(s_doa_b, s_doa_h, s_doa_s);
        const long long at_db = row.at(s_dob_b, s_dob_h, s_dob_s);
        for (int c = lane * V; c < dv; c += group * V) {
            float g[V], ov[V], va[V], vb[V];
            load_kind<V>(d_o, do_kind, at_do + c, g);
            load_kind<V>(o, o_kind, at_o + c, ov);
            load_kind<V>(o_a, in_kind, at_a + c, va);
            load_kind<V>(o_b, in_kind, at_b + c, vb);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                dot_a = fmaf(g[i], va[i] - ov[i], dot_a);
                dot_b = fmaf(g[i], vb[i] - ov[i], dot_b);
                va[i] = wa * g[i];
                vb[i] = wb * g[i];
            }
            store_kind<V>(do_a, do_a_kind, at_da + c, va);
            store_kind<V>(do_b, do_b_kind, at_db + c, vb);
        }
    }
    dot_a = group_sum(dot_a, group);
    dot_b = group_sum(dot_b, group);
    if (active && lane == 0) {
        dlse_a[row.at(s_dla_b, s_dla_h, s_dla_s)] = wa != 0.0f ? wa * (dot_a + d_lse) : 0.0f;
        dlse_b[row.at(s_dlb_b, s_dlb_h, s_dlb_s)] = wb != 0.0f ? wb * (dot_b + d_lse) : 0.0f;
    }
}
