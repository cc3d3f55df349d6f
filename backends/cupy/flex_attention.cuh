// FlexAttention forward and backward in CUDA C: the attention kernels' tiles (attention_tiles.cuh)
// with generated mod functions called per (query, key) pair.
//
// This header is not compiled alone: flex_attention.py writes one unit per mod structure that
// defines, before including it (xpkernels.mods.codegen_cuda, or identity stubs without a mod),
//   bool  flex_mask(b, h, q_idx, kv_idx, q_row, const ModArgs&)              the mask mod;
//   float flex_score(score, b, h, q_idx, kv_idx, q_row, const ModArgs&)      the score mod;
//   float flex_dscore(score, ..., float g, const ModArgs&)  d score for cotangent g (no array
//                                                            gradients: the dQ pass);
//   float flex_vjp(score, ..., float g, const ModArgs&)     the same, adding the captured arrays'
//                                                            gradients (float32 atomicAdd: the
//                                                            dK/dV pass visits each pair once).
//
// Kernels walk tile lists built on the host from the call's tile plan (xpkernels.mods.bands):
// per (batch, head, tile of the block's own axis), `count` entries `tile * 4 + state`, the
// SKIP tiles left out. A pair of a FULL tile is kept; a pair of a PARTIAL tile is kept when
// the mask keeps it, after (plans whose tiles the kernel's do not divide: `exact` 0) the
// pair's own plan state. Per kept pair, with the raw score s = scale * q.k:
//   forward:  online softmax in base 2 of flex_score(s) (masked pairs are -inf, never added);
//   backward: p = 2^(flex_score(s) log2 e - lse2), ds = vjp(s, p (dp - delta)),
//             dv_j = sum_i p_ij do_i, dk_j = scale sum_i ds_ij q_i, dq_i = scale sum_j ds_ij k_j.
// The checkpoints are attention's natural-log (m, l); a row keeping no key gets o = 0,
// m = -inf, l = 0 and zero gradients. q_idx = input_pos[b] + row, q_row = row, h the query
// head (GQA: kv head h / group). Offsets are int64; T: the dtype of q, k and v.
#pragma once
#include "attention_tiles.cuh"

namespace {

constexpr int FLEX_SKIP = 0, FLEX_PARTIAL = 1, FLEX_FULL = 2;

// The tile plan as the kernels read it per pair (only where `exact` is 0).
struct FlexPlan {
    const signed char* states;   // (Bp, Hp, NQp, NKp); strides 0 on broadcast batch / head axes
    long long stride_b, stride_h, stride_i;
    int tile_m, tile_n, exact;
};

// Whether pair (row, key) of a tile in `state` is kept (row and key in range).
__device__ __forceinline__ bool flex_keep(
    int state, const FlexPlan& plan, long long b, long long h, long long pos, long long row,
    long long key, const ModArgs& mask_args) {
    if (state == FLEX_FULL) return true;
    if (!plan.exact) {
        state = plan.states[b * plan.stride_b + h * plan.stride_h + row / plan.tile_m * plan.stride_i +
                            key / plan.tile_n];
        if (state != FLEX_PARTIAL) return state == FLEX_FULL;
    }
    return flex_mask(b, h, pos + row, key, row, mask_args);
}

}  // namespace

template <typename T, int BN, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) flex_forward(
    void* __restrict__ o, int o_kind,  // (B, H, Sq, Dv), float / __half / __nv_bfloat16
    float* __restrict__ m_out,        // (B, H, Sq) or null (no checkpoints)
    float* __restrict__ l_out,        // (B, H, Sq) or null
    const T* q, const T* k, const T* v,
    const void* input_pos, long long stride_pos, int width_pos,  // width 0: pos_value
    long long pos_value,
    const int* counts, const int* entries,  // (Bp, Hp, NQ), (Bp, Hp, NQ, NK): BM x BN tiles
    long long stride_cb, long long stride_ch,
    long long stride_eb, long long stride_eh, long long stride_ei,
    const signed char* states, long long stride_sb, long long stride_sh, long long stride_si,
    int tile_m, int tile_n, int exact,
    const unsigned long long* score_ptrs, const long long* score_ints, const float* score_floats,
    const unsigned long long* mask_ptrs, const long long* mask_ints, const float* mask_floats,
    int heads, int group, int sq, int sk, int d, int dv,
    int q_tiles,                      // ceil(Sq / BM)
    float scale,
    int vec_q, int vec_k, int vec_v,
    unsigned long long shared_bytes,
    long long stride_qb, long long stride_qh, long long stride_qs,
    long long stride_kb, long long stride_kh, long long stride_ks,
    long long stride_vb, long long stride_vh, long long stride_vs,
    long long stride_ob, long long stride_oh, long long stride_os,
    long long stride_mb, long long stride_mh, long long stride_ms,
    long long stride_lb, long long stride_lh, long long stride_ls)
{
    using L = Layout<T, BN, DMAX>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const ForwardTiles<T, BN, DMAX> t(block_smem<L>(shared_bytes), warp);
    const int block = static_cast<int>(blockIdx.x);
    const int qt = block % q_tiles, i0 = qt * BM;
    const int bh = block / q_tiles;
    const long long b = bh / heads, h = bh % heads, g = (bh % heads) / group;
    const long long pos = batch_value(input_pos, stride_pos, width_pos, b, pos_value);
    const int rows = static_cast<int>(clamp(sq - i0, 0, BM));
    const FlexPlan plan{states, stride_sb, stride_sh, stride_si, tile_m, tile_n, exact};
    const ModArgs score_args{score_ptrs, score_ints, score_floats};
    const ModArgs mask_args{mask_ptrs, mask_ints, mask_floats};
    const int count = counts[b * stride_cb + h * stride_ch + qt];
    const int* list = entries + b * stride_eb + h * stride_eh + qt * stride_ei;

    // Lane (r, half): row r of the warp's 16, columns half * BN/2 .. of S, half * DMAX/2 .. of O.
    const int r = lane & 15, half = lane >> 4;
    const int row = i0 + warp * 16 + r;
    const bool live = row < sq;
    const bool warp_live = i0 + warp * 16 < sq;
    float m = xk::neg_inf(), l = 0.0f;  // base-2 running max and sum

    zero_row<DMAX>(t.o, L::LD_O, r, half);
    stage<T, BM, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs, stride_qs,
                       rows, d, vec_q != 0, false, nullptr, 0);

    for (int n = 0; n < count; ++n) {
        const int entry = list[n];
        const int j0 = (entry >> 2) * BN, state = entry & 3;
        __syncthreads();  // the previous tile's K and V are no longer read (Q staged)
        const int keys = sk - j0 < BN ? sk - j0 : BN;
        stage<T, BN, DMAX>(t.k, L::LD_T, k + b * stride_kb + g * stride_kh + j0 * stride_ks,
                           stride_ks, keys, d, vec_k != 0, false, nullptr, 0);
        stage<T, BN, DMAX>(t.v, L::LD_T, v + b * stride_vb + g * stride_vh + j0 * stride_vs,
                           stride_vs, keys, dv, vec_v != 0, false, nullptr, 0);
        __syncthreads();
        if (!warp_live) continue;  // warp-uniform
        forward_tile(t, warp, r, half, m, l, [&](int c, const float& s) {
            const long long key = j0 + c;
            if (!live || c >= keys || !flex_keep(state, plan, b, h, pos, row, key, mask_args))
                return xk::neg_inf();
            return flex_score(s * scale, b, h, pos + row, key, row, score_args) * LOG2E;
        });
    }

    if (!live) return;
    write_output(t, r, half, m, l, false, o, o_kind, b * stride_ob + h * stride_oh + row * stride_os,
                 dv, m_out, b * stride_mb + h * stride_mh + row * stride_ms, l_out,
                 b * stride_lb + h * stride_lh + row * stride_ls, [](int) { return false; });
}

template <typename T, int BQ, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) flex_backward_dkdv(
    void* __restrict__ dk, int dk_kind,   // (B, Hkv, Sk, D)
    void* __restrict__ dv, int dv_kind,   // (B, Hkv, Sk, Dv)
    const T* q, const T* k, const T* v,
    const void* d_o, int do_kind,         // (B, H, Sq, Dv)
    const float* m, const float* l, const float* delta,   // (B, H, Sq)
    const void* input_pos, long long stride_pos, int width_pos,
    long long pos_value,
    const int* counts, const int* entries,  // (Bp, Hp, NK), (Bp, Hp, NK, NQ): BQ x BM tiles
    long long stride_cb, long long stride_ch,
    long long stride_eb, long long stride_eh, long long stride_ei,
    const signed char* states, long long stride_sb, long long stride_sh, long long stride_si,
    int tile_m, int tile_n, int exact,
    const unsigned long long* score_ptrs, const long long* score_ints, const float* score_floats,
    const unsigned long long* mask_ptrs, const long long* mask_ints, const float* mask_floats,
    int kv_heads, int group, int sq, int sk, int d, int d_v,
    int kv_tiles,                         // ceil(Sk / BM)
    float scale,
    int vec_q, int vec_k, int vec_v,
    unsigned long long shared_bytes,
    long long stride_qb, long long stride_qh, long long stride_qs,
    long long stride_kb, long long stride_kh, long long stride_ks,
    long long stride_vb, long long stride_vh, long long stride_vs,
    long long stride_dob, long long stride_doh, long long stride_dos,
    long long stride_mb, long long stride_mh, long long stride_ms,
    long long stride_lb, long long stride_lh, long long stride_ls,
    long long stride_db, long long stride_dh, long long stride_ds,
    long long stride_dkb, long long stride_dkh, long long stride_dks,
    long long stride_dvb, long long stride_dvh, long long stride_dvs)
{
    using L = typename DkdvTiles<T, BQ, DMAX>::L;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const DkdvTiles<T, BQ, DMAX> t(block_smem<L>(shared_bytes), warp);
    const int block = static_cast<int>(blockIdx.x);
    const int kt = block % kv_tiles, j0 = kt * BM;
    const int bg = block / kv_tiles;
    const long long b = bg / kv_heads, g = bg % kv_heads;
    const long long pos = batch_value(input_pos, stride_pos, width_pos, b, pos_value);
    const int keys = static_cast<int>(clamp(sk - j0, 0, BM));
    const FlexPlan plan{states, stride_sb, stride_sh, stride_si, tile_m, tile_n, exact};
    const ModArgs score_args{score_ptrs, score_ints, score_floats};
    const ModArgs mask_args{mask_ptrs, mask_ints, mask_floats};
    int* alive = t.limit;  // the query keeps some key
    float* lse2 = t.lse2;
    float* dl = t.delta;

    // Lane (r, half): key row r of the warp's 16, half of the columns.
    const int r = lane & 15, half = lane >> 4;
    const int key = j0 + warp * 16 + r;
    zero_row<DMAX>(t.dk, L::LD_O, r, half);
    zero_row<DMAX>(t.dv, L::LD_O, r, half);
    stage<T, BM, DMAX>(t.k, L::LD_T, k + b * stride_kb + g * stride_kh + j0 * stride_ks, stride_ks,
                       keys, d, vec_k != 0, false, nullptr, 0);
    stage<T, BM, DMAX>(t.v, L::LD_T, v + b * stride_vb + g * stride_vh + j0 * stride_vs, stride_vs,
                       keys, d_v, vec_v != 0, false, nullptr, 0);

    for (int hh = 0; hh < group; ++hh) {
        const long long h = g * group + hh;
        const int count = counts[b * stride_cb + h * stride_ch + kt];
        const int* list = entries + b * stride_eb + h * stride_eh + kt * stride_ei;
        for (int n = 0; n < count; ++n) {
            const int entry = list[n];
            const int i0 = (entry >> 2) * BQ, state = entry & 3;
            __syncthreads();  // the previous tile's Q, dO and row values are no longer read
            const int rows = static_cast<int>(clamp(sq - i0, 0, BQ));
            stage<T, BQ, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs,
                               stride_qs, rows, d, vec_q != 0, false, nullptr, 0);
            stage_kind<T, BQ, DMAX>(t.d_o, L::LD_T, d_o, do_kind,
                                    b * stride_dob + h * stride_doh + i0 * stride_dos, stride_dos,
                                    rows, d_v);
            for (int c = threadIdx.x; c < BQ; c += blockDim.x) {
                const long long i = i0 + c;
                float li = 0.0f, mi = 0.0f, di = 0.0f;
                if (i < sq) {
                    li = l[b * stride_lb + h * stride_lh + i * stride_ls];
                    mi = m[b * stride_mb + h * stride_mh + i * stride_ms];
                    di = delta[b * stride_db + h * stride_dh + i * stride_ds];
                }
                alive[c] = i < sq && li != 0.0f;
                lse2[c] = lse2_of(mi, li);
                dl[c] = di;
            }
            __syncthreads();
            dkdv_tile(t, warp, r, half, [&](int c, const float& s_raw, const float& dp, float& p, float& ds) {
                const long long i = i0 + c;
                p = ds = 0.0f;
                if (key < sk && alive[c] && flex_keep(state, plan, b, h, pos, i, key, mask_args)) {
                    const float s = s_raw * scale;
                    p = exp2f(flex_score(s, b, h, pos + i, key, i, score_args) * LOG2E - lse2[c]);
                    ds = flex_vjp(s, b, h, pos + i, key, i, p * (dp - dl[c]), score_args);
                }
            });
        }
    }

    if (key >= sk) return;
    const long long at_k = b * stride_dkb + g * stride_dkh + key * stride_dks;
    const long long at_v = b * stride_dvb + g * stride_dvh + key * stride_dvs;
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2); ++c) {
        if (c < d) store_out(dk, dk_kind, at_k + c, t.dk[r * L::LD_O + c] * scale);
        if (c < d_v) store_out(dv, dv_kind, at_v + c, t.dv[r * L::LD_O + c]);
    }
}

template <typename T, int BN, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) flex_backward_dq(
    void* __restrict__ dq, int dq_kind,   // (B, H, Sq, D)
    const T* q, const T* k, const T* v,
    const void* d_o, int do_kind,         // (B, H, Sq, Dv)
    const float* m, const float* l, const float* delta,   // (B, H, Sq)
    const void* input_pos, long long stride_pos, int width_pos,
    long long pos_value,
    const int* counts, const int* entries,  // (Bp, Hp, NQ), (Bp, Hp, NQ, NK): BM x BN tiles
    long long stride_cb, long long stride_ch,
    long long stride_eb, long long stride_eh, long long stride_ei,
    const signed char* states, long long stride_sb, long long stride_sh, long long stride_si,
    int tile_m, int tile_n, int exact,
    const unsigned long long* score_ptrs, const long long* score_ints, const float* score_floats,
    const unsigned long long* mask_ptrs, const long long* mask_ints, const float* mask_floats,
    int heads, int group, int sq, int sk, int d, int d_v,
    int q_tiles,                          // ceil(Sq / BM)
    float scale,
    int vec_q, int vec_k, int vec_v,
    unsigned long long shared_bytes,
    long long stride_qb, long long stride_qh, long long stride_qs,
    long long stride_kb, long long stride_kh, long long stride_ks,
    long long stride_vb, long long stride_vh, long long stride_vs,
    long long stride_dob, long long stride_doh, long long stride_dos,
    long long stride_mb, long long stride_mh, long long stride_ms,
    long long stride_lb, long long stride_lh, long long stride_ls,
    long long stride_db, long long stride_dh, long long stride_ds,
    long long stride_dqb, long long stride_dqh, long long stride_dqs)
{
    using L = typename DqTiles<T, BN, DMAX>::L;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const DqTiles<T, BN, DMAX> t(block_smem<L>(shared_bytes), warp);
    const int block = static_cast<int>(blockIdx.x);
    const int qt = block % q_tiles, i0 = qt * BM;
    const int bh = block / q_tiles;
    const long long b = bh / heads, h = bh % heads, g = (bh % heads) / group;
    const long long pos = batch_value(input_pos, stride_pos, width_pos, b, pos_value);
    const int rows = static_cast<int>(clamp(sq - i0, 0, BM));
    const FlexPlan plan{states, stride_sb, stride_sh, stride_si, tile_m, tile_n, exact};
    const ModArgs score_args{score_ptrs, score_ints, score_floats};
    const ModArgs mask_args{mask_ptrs, mask_ints, mask_floats};
    const int count = counts[b * stride_cb + h * stride_ch + qt];
    const int* list = entries + b * stride_eb + h * stride_eh + qt * stride_ei;

    // Lane (r, half): query row r of the warp's 16, half of the columns.
    const int r = lane & 15, half = lane >> 4;
    const int row = i0 + warp * 16 + r;
    float l_row = 0.0f, m_row = 0.0f, delta_row = 0.0f;
    if (row < sq) {
        l_row = l[b * stride_lb + h * stride_lh + row * stride_ls];
        m_row = m[b * stride_mb + h * stride_mh + row * stride_ms];
        delta_row = delta[b * stride_db + h * stride_dh + row * stride_ds];
    }
    const bool live = row < sq && l_row != 0.0f;
    const float lse2 = lse2_of(m_row, l_row);
    const bool warp_live = i0 + warp * 16 < sq;

    zero_row<DMAX>(t.dq, L::LD_O, r, half);
    stage<T, BM, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs, stride_qs,
                       rows, d, vec_q != 0, false, nullptr, 0);
    stage_kind<T, BM, DMAX>(t.d_o, L::LD_T, d_o, do_kind,
                            b * stride_dob + h * stride_doh + i0 * stride_dos, stride_dos, rows,
                            d_v);

    for (int n = 0; n < count; ++n) {
        const int entry = list[n];
        const int j0 = (entry >> 2) * BN, state = entry & 3;
        __syncthreads();  // the previous tile's K and V are no longer read (Q, dO staged)
        const int keys = sk - j0 < BN ? sk - j0 : BN;
        stage<T, BN, DMAX>(t.k, L::LD_T, k + b * stride_kb + g * stride_kh + j0 * stride_ks,
                           stride_ks, keys, d, vec_k != 0, false, nullptr, 0);
        stage<T, BN, DMAX>(t.v, L::LD_T, v + b * stride_vb + g * stride_vh + j0 * stride_vs,
                           stride_vs, keys, d_v, vec_v != 0, false, nullptr, 0);
        __syncthreads();
        if (!warp_live) continue;  // warp-uniform
        dq_tile(t, warp, r, half, [&](int c, const float& s_raw, const float& dp) {
            const long long key = j0 + c;
            if (!live || c >= keys || !flex_keep(state, plan, b, h, pos, row, key, mask_args))
                return 0.0f;
            const float s = s_raw * scale;
            const float p = exp2f(flex_score(s, b, h, pos + row, key, row, score_args) * LOG2E - lse2);
            return flex_dscore(s, b, h, pos + row, key, row, p * (dp - delta_row), score_args);
        });
    }

    if (row >= sq) return;
    const long long at = b * stride_dqb + h * stride_dqh + row * stride_dqs;
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2) && c < d; ++c)
        store_out(dq, dq_kind, at + c, live ? t.dq[r * L::LD_O + c] * scale : 0.0f);
}
