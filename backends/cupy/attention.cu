// Attention forward and (below the forward) backward in CUDA C.
//
// Forward, FA2-style: o = softmax(scale * q k^T + mask) v, with the checkpoints
//   m = max_j s_j (natural-log units),  l = sum_j e^(s_j - m)   (m = -inf, l = 0, o = 0 on a
//   fully masked row).
//
// A block of WARPS warps per (query tile of BM = 16 * WARPS rows, batch, query head); warp w
// owns the tile's rows 16w .. 16w + 15. Q is staged in shared memory once (zeros past
// q_lengths[b]); the block then walks the key tiles of BN keys it can see (a warp none of
// whose rows sees a key of a tile skips its steps 2-4 there):
//   1. all threads stage K and V of the tile in shared memory (zeros past k_lengths[b] and
//      past the head dims), between two __syncthreads;
//   2. each warp computes its scores S_w = Q_w K^T into shared memory (float32);
//   3. each warp's lanes run the online softmax on S_w row by row (lane l: row l % 16, half
//      l / 16 of the columns), in base 2 (scale * log2 e is folded into one multiply), write
//      P_w = exp2(s - m_new) in T to shared memory and rescale their row of the float32
//      output accumulator O_w (in shared memory) by exp2(m_old - m_new);
//   4. each warp adds P_w V to O_w.
// Steps 2 and 4 run on tensor cores through nvcuda::wmma (16x16x16 fragments, float32
// accumulate) for __half and __nv_bfloat16; for float they are a SIMT loop (lane j: key j
// of the scores; lane c: output column c), as TF32 would not keep float32's accuracy.
// Fragments are never indexed by element: every per-row step goes through shared memory.
//
// Masks: key j is visible to query i when i < q_lengths[b], j < k_lengths[b] and, if causal,
// j <= input_pos + i. Masked scores are selected to -inf (never added to), so a NaN score
// reaches only the rows that see it; the row max ignores NaN (fmaxf), and a row whose sum is
// NaN writes o, m, l NaN. In tiles crossing the causal diagonal a non-finite value of V
// would reach rows that cannot see it through 0 * NaN: it is staged as 0, and its column's
// first such key is kept (bad[c]) so that the rows that do see it get NaN in that column.
//
// Offsets are int64; lengths and positions are read at their width (int32/int64) and
// clamped (lengths to [0, S], input_pos to [-Sq, Sk], where clamping changes nothing).
// T: the dtype of q, k, v; BN: keys per tile (a multiple of 32); DMAX: head dims D and Dv
// rounded up to it (a multiple of 32). o is float, __half or __nv_bfloat16 (o_kind 0, 1, 2).
#include "attention_tiles.cuh"

template <typename T, int BN, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) attention_forward(
    void* __restrict__ o,             // (B, H, Sq, Dv), float / __half / __nv_bfloat16
    int o_kind,                       // 0: float, 1: __half, 2: __nv_bfloat16
    float* __restrict__ m_out,        // (B, H, Sq) or null (no checkpoints)
    float* __restrict__ l_out,        // (B, H, Sq) or null
    const T* q,                       // (B, H, Sq, D)
    const T* k,                       // (B, Hkv, Sk, D)
    const T* v,                       // (B, Hkv, Sk, Dv)
    const void* q_lengths, long long stride_qlen, int width_qlen,   // width 0: none
    const void* k_lengths, long long stride_klen, int width_klen,
    const void* input_pos, long long stride_pos, int width_pos,     // width 0: pos_value
    long long pos_value,
    int heads, int group,             // H, H / Hkv
    int sq, int sk, int d, int dv,
    int q_tiles,                      // ceil(Sq / BM)
    int causal,
    float scale_log2,                 // scale * log2(e)
    int vec_q, int vec_k, int vec_v,  // 16-byte loads allowed for q / k / v
    unsigned long long shared_bytes,  // dynamic shared memory of the launch
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
    // 32-bit index arithmetic (the grid stays below 2**31): 64-bit division is an ABI call.
    const int block = static_cast<int>(blockIdx.x);
    const int i0 = (q_tiles - 1 - block % q_tiles) * BM;  // the longest causal tiles first
    const int bh = block / q_tiles;
    const long long b = bh / heads, h = bh % heads, g = (bh % heads) / group;

    const long long nk = clamp(batch_value(k_lengths, stride_klen, width_klen, b, sk), 0, sk);
    const long long nq = clamp(batch_value(q_lengths, stride_qlen, width_qlen, b, sq), 0, sq);
    const long long pos =
        causal ? clamp(batch_value(input_pos, stride_pos, width_pos, b, pos_value), -sq, sk) : 0;
    const int rows = static_cast<int>(clamp(nq - i0, 0, BM));  // valid query rows of the tile
    const int k_end =
        rows == 0 ? 0 : causal ? static_cast<int>(clamp(pos + i0 + rows, 0, nk)) : static_cast<int>(nk);

    // Lane (r, half): row r of the warp's 16, columns half * BN/2 .. of S, half * DMAX/2 .. of O.
    const int r = lane & 15, half = lane >> 4;
    const int row = i0 + warp * 16 + r;           // query index
    const long long qpos = pos + row;
    // Keys [0, limit) are visible to this row.
    const long long limit = row >= nq ? 0 : causal ? clamp(qpos + 1, 0, nk) : nk;
    const int warp_first = i0 + warp * 16;
    const long long warp_last_pos = pos + clamp(nq - 1, 0, warp_first + 15);
    float m = xk::neg_inf(), l = 0.0f;                 // base-2 running max and sum
    int* bad = t.bad;

    zero_row<DMAX>(t.o, L::LD_O, r, half);
    for (int c = threadIdx.x; c < DMAX; c += blockDim.x) bad[c] = NO_BAD_KEY;
    stage<T, BM, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs, stride_qs,
                       rows, d, vec_q != 0, false, bad, 0);

    for (int j0 = 0; j0 < k_end; j0 += BN) {
        __syncthreads();  // the previous tile's K and V are no longer read (Q, bad staged)
        const int keys = static_cast<int>(nk - j0 < BN ? nk - j0 : BN);
        // Some staged key is masked for some row: non-finite values of V are kept out of P V.
        const bool diagonal = causal && j0 + keys - 1 > pos + i0;
        stage<T, BN, DMAX>(t.k, L::LD_T, k + b * stride_kb + g * stride_kh + j0 * stride_ks,
                           stride_ks, keys, d, vec_k != 0, false, bad, j0);
        stage<T, BN, DMAX>(t.v, L::LD_T, v + b * stride_vb + g * stride_vh + j0 * stride_vs,
                           stride_vs, keys, dv, vec_v != 0, diagonal, bad, j0);
        __syncthreads();
        // A warp none of whose rows sees a key of this tile skips it (warp-uniform).
        if (warp_first >= nq || (causal && j0 > warp_last_pos)) continue;
        forward_tile(t, warp, r, half, m, l, [&](int c, const float& s) {
            return j0 + c < limit ? s * scale_log2 : xk::neg_inf();
        });
    }

    if (row >= sq) return;
    // A row whose sum is NaN writes m NaN; a column whose first non-finite key it sees, NaN.
    write_output(t, r, half, m, l, l != l, o, o_kind, b * stride_ob + h * stride_oh + row * stride_os,
                 dv, m_out, b * stride_mb + h * stride_mh + row * stride_ms, l_out,
                 b * stride_lb + h * stride_lh + row * stride_ls,
                 [&](int c) { return l != 0.0f && bad[c] <= qpos; });
}

// ------------------------------------------------------------------------------------------
// Backward, FA2-style, from the forward's checkpoints: with lse_i = m_i + ln l_i (in base 2,
// lse2_i = lse_i log2 e), p_ij = 2^(scale_log2 s_ij - lse2_i) on the visible pairs (0 on the
// others, by selection), delta_i = rowsum(do_i * o_i) and ds_ij = p_ij (do_i . v_j - delta_i):
//   dv_j = sum_i p_ij do_i,  dk_j = scale sum_i ds_ij q_i,  dq_i = scale sum_j ds_ij k_j.
// Three kernels, launched in this order:
//   attention_backward_delta: delta (caller scratch, float32) of every query row (0 past
//     q_lengths[b]), one warp per row;
//   attention_backward_dkdv: one block per (batch, kv head, tile of BM = 16 * WARPS keys;
//     warp w owns keys 16w .. 16w + 15), K and V staged once; it walks every query head of
//     the kv head's group and their query tiles of BQ rows that see a key of the tile, in the
//     transposed form (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q), so dk and dv
//     are written once, without atomics, summed over the group;
//   attention_backward_dq: one block per (query tile of BM rows, batch, query head), as the
//     forward, walking the key tiles it sees (S = Q K^T, dP = dO V^T, dQ += dS K): dq is a
//     separate deterministic pass.
// Products run as the forward's (WarpMma: wmma for __half/__nv_bfloat16, SIMT for float);
// P and dS are rounded to T before their products, as FA2 does. A row with l = 0 sees no
// key (p = 0). A key past k_lengths[b] and a query past q_lengths[b] get zero gradients.
// In tiles crossing the causal diagonal, the right operand of a product whose left operand
// is zero on masked pairs (Q in dK += dS^T Q, K in dQ += dS K) is staged with non-finite
// values as 0, so a NaN of q, k or v reaches only the gradients of the rows and keys that
// see it (those get it through p, whose lse is NaN on a row that saw a NaN score in the
// forward).
// do and o may be float, __half or __nv_bfloat16 (kinds 0, 1, 2), as may dq, dk and dv.
namespace {

// Keys [0, limit) are visible to query `row` (0 past q_lengths and on a row with l = 0).
__device__ __forceinline__ int key_limit(
    long long row, long long nq, long long nk, long long pos, int causal, float l) {
    if (row >= nq || l == 0.0f) return 0;
    return static_cast<int>(causal ? clamp(pos + row + 1, 0, nk) : nk);
}

// p and ds of one visible-or-not pair, by selection (never 0 * NaN on a masked pair).
__device__ __forceinline__ void pair_grads(
    bool visible, float s, float dp, float lse2, float delta, float scale_log2, float& p,
    float& ds) {
    p = visible ? exp2f(s * scale_log2 - lse2) : 0.0f;
    ds = visible ? p * (dp - delta) : 0.0f;
}

}  // namespace

template <int ROWS_PER_BLOCK>
__global__ void __launch_bounds__(32 * ROWS_PER_BLOCK) attention_backward_delta(
    float* __restrict__ delta,        // (B, H, Sq)
    const void* d_o, int do_kind,     // (B, H, Sq, Dv)
    const void* o, int o_kind,        // (B, H, Sq, Dv)
    const void* q_lengths, long long stride_qlen, int width_qlen,
    int heads, int sq, int dv, int rows_total,   // rows_total = B * H * Sq
    long long stride_db, long long stride_dh, long long stride_ds,
    long long stride_dob, long long stride_doh, long long stride_dos,
    long long stride_ob, long long stride_oh, long long stride_os)
{
    const int lane = threadIdx.x & 31;
    const int row = static_cast<int>(blockIdx.x) * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= rows_total) return;  // the whole warp leaves
    const int i = row % sq, bh = row / sq;
    const long long b = bh / heads, h = bh % heads;
    const long long nq = clamp(batch_value(q_lengths, stride_qlen, width_qlen, b, sq), 0, sq);
    float sum = 0.0f;
    if (i < nq) {
        const long long at_do = b * stride_dob + h * stride_doh + i * stride_dos;
        const long long at_o = b * stride_ob + h * stride_oh + i * stride_os;
        for (int c = lane; c < dv; c += 32)
            sum = fmaf(load_kind(d_o, do_kind, at_do + c), load_kind(o, o_kind, at_o + c), sum);
    }
    sum = xk::warp_sum(sum);
    if (lane == 0) delta[b * stride_db + h * stride_dh + i * stride_ds] = sum;
}

template <typename T, int BQ, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) attention_backward_dkdv(
    void* __restrict__ dk, int dk_kind,   // (B, Hkv, Sk, D)
    void* __restrict__ dv, int dv_kind,   // (B, Hkv, Sk, Dv)
    const T* q, const T* k, const T* v,
    const void* d_o, int do_kind,         // (B, H, Sq, Dv)
    const float* m, const float* l, const float* delta,   // (B, H, Sq)
    const void* q_lengths, long long stride_qlen, int width_qlen,
    const void* k_lengths, long long stride_klen, int width_klen,
    const void* input_pos, long long stride_pos, int width_pos,
    long long pos_value,
    int kv_heads, int group, int sq, int sk, int d, int d_v,
    int kv_tiles,                         // ceil(Sk / BM)
    int causal, float scale, float scale_log2,
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
    const int j0 = block % kv_tiles * BM;  // the keys of the first tiles see the most queries
    const int bg = block / kv_tiles;
    const long long b = bg / kv_heads, g = bg % kv_heads;

    const long long nk = clamp(batch_value(k_lengths, stride_klen, width_klen, b, sk), 0, sk);
    const long long nq = clamp(batch_value(q_lengths, stride_qlen, width_qlen, b, sq), 0, sq);
    const long long pos =
        causal ? clamp(batch_value(input_pos, stride_pos, width_pos, b, pos_value), -sq, sk) : 0;
    const int keys = static_cast<int>(clamp(nk - j0, 0, BM));  // valid keys of the tile
    // Queries [q_first, nq) see a key of the tile (the first sees key j0 when causal).
    const int q_first = keys == 0 ? static_cast<int>(nq)
                        : causal  ? static_cast<int>(clamp(j0 - pos, 0, nq))
                                  : 0;
    int* lim = t.limit;
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
    const int q_start = q_first / BQ * BQ;

    for (int hh = 0; hh < group; ++hh) {
        const long long h = g * group + hh;
        for (int i0 = q_start; i0 < nq; i0 += BQ) {
            __syncthreads();  // the previous tile's Q, dO and row values are no longer read
            const int rows = static_cast<int>(clamp(nq - i0, 0, BQ));
            const bool diagonal = causal && j0 + keys - 1 > pos + i0;
            stage<T, BQ, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs,
                               stride_qs, rows, d, vec_q != 0, diagonal, nullptr, 0);
            stage_kind<T, BQ, DMAX>(t.d_o, L::LD_T, d_o, do_kind,
                                    b * stride_dob + h * stride_doh + i0 * stride_dos, stride_dos,
                                    rows, d_v);
            for (int c = threadIdx.x; c < BQ; c += blockDim.x) {
                const long long i = i0 + c;
                float li = 0.0f, mi = 0.0f, di = 0.0f;
                if (i < nq) {
                    li = l[b * stride_lb + h * stride_lh + i * stride_ls];
                    mi = m[b * stride_mb + h * stride_mh + i * stride_ms];
                    di = delta[b * stride_db + h * stride_dh + i * stride_ds];
                }
                lim[c] = key_limit(i, nq, nk, pos, causal, li);
                lse2[c] = lse2_of(mi, li);
                dl[c] = di;
            }
            __syncthreads();
            dkdv_tile(t, warp, r, half, [&](int c, const float& s, const float& dp, float& p, float& ds) {
                pair_grads(key < lim[c], s, dp, lse2[c], dl[c], scale_log2, p, ds);
            });
        }
    }

    if (key >= sk) return;
    const long long at_k = b * stride_dkb + g * stride_dkh + key * stride_dks;
    const long long at_v = b * stride_dvb + g * stride_dvh + key * stride_dvs;
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2); ++c) {
        if (c < d) store_out(dk, dk_kind, at_k + c, key < nk ? t.dk[r * L::LD_O + c] * scale : 0.0f);
        if (c < d_v) store_out(dv, dv_kind, at_v + c, key < nk ? t.dv[r * L::LD_O + c] : 0.0f);
    }
}

template <typename T, int BN, int DMAX>
__global__ void __launch_bounds__(32 * WARPS, 1) attention_backward_dq(
    void* __restrict__ dq, int dq_kind,   // (B, H, Sq, D)
    const T* q, const T* k, const T* v,
    const void* d_o, int do_kind,         // (B, H, Sq, Dv)
    const float* m, const float* l, const float* delta,   // (B, H, Sq)
    const void* q_lengths, long long stride_qlen, int width_qlen,
    const void* k_lengths, long long stride_klen, int width_klen,
    const void* input_pos, long long stride_pos, int width_pos,
    long long pos_value,
    int heads, int group, int sq, int sk, int d, int d_v,
    int q_tiles,                          // ceil(Sq / BM)
    int causal, float scale, float scale_log2,
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
    const int i0 = (q_tiles - 1 - block % q_tiles) * BM;  // the longest causal tiles first
    const int bh = block / q_tiles;
    const long long b = bh / heads, h = bh % heads, g = (bh % heads) / group;

    const long long nk = clamp(batch_value(k_lengths, stride_klen, width_klen, b, sk), 0, sk);
    const long long nq = clamp(batch_value(q_lengths, stride_qlen, width_qlen, b, sq), 0, sq);
    const long long pos =
        causal ? clamp(batch_value(input_pos, stride_pos, width_pos, b, pos_value), -sq, sk) : 0;
    const int rows = static_cast<int>(clamp(nq - i0, 0, BM));
    const int k_end =
        rows == 0 ? 0 : causal ? static_cast<int>(clamp(pos + i0 + rows, 0, nk)) : static_cast<int>(nk);

    // Lane (r, half): query row r of the warp's 16, half of the columns.
    const int r = lane & 15, half = lane >> 4;
    const int row = i0 + warp * 16 + r;
    float l_row = 0.0f, m_row = 0.0f, delta_row = 0.0f;
    if (row < nq) {
        l_row = l[b * stride_lb + h * stride_lh + row * stride_ls];
        m_row = m[b * stride_mb + h * stride_mh + row * stride_ms];
        delta_row = delta[b * stride_db + h * stride_dh + row * stride_ds];
    }
    const int limit = key_limit(row, nq, nk, pos, causal, l_row);
    const float lse2 = lse2_of(m_row, l_row);
    const int warp_first = i0 + warp * 16;
    const long long warp_last_pos = pos + clamp(nq - 1, 0, warp_first + 15);

    zero_row<DMAX>(t.dq, L::LD_O, r, half);
    stage<T, BM, DMAX>(t.q, L::LD_T, q + b * stride_qb + h * stride_qh + i0 * stride_qs, stride_qs,
                       rows, d, vec_q != 0, false, nullptr, 0);
    stage_kind<T, BM, DMAX>(t.d_o, L::LD_T, d_o, do_kind,
                            b * stride_dob + h * stride_doh + i0 * stride_dos, stride_dos, rows,
                            d_v);

    for (int j0 = 0; j0 < k_end; j0 += BN) {
        __syncthreads();  // the previous tile's K and V are no longer read (Q, dO staged)
        const int keys = static_cast<int>(nk - j0 < BN ? nk - j0 : BN);
        const bool diagonal = causal && j0 + keys - 1 > pos + i0;
        stage<T, BN, DMAX>(t.k, L::LD_T, k + b * stride_kb + g * stride_kh + j0 * stride_ks,
                           stride_ks, keys, d, vec_k != 0, diagonal, nullptr, 0);
        stage<T, BN, DMAX>(t.v, L::LD_T, v + b * stride_vb + g * stride_vh + j0 * stride_vs,
                           stride_vs, keys, d_v, vec_v != 0, false, nullptr, 0);
        __syncthreads();
        if (warp_first >= nq || (causal && j0 > warp_last_pos)) continue;  // warp-uniform
        dq_tile(t, warp, r, half, [&](int c, const float& s, const float& dp) {
            float p, ds;
            pair_grads(j0 + c < limit, s, dp, lse2, delta_row, scale_log2, p, ds);
            return ds;
        });
    }

    if (row >= sq) return;
    const long long at = b * stride_dqb + h * stride_dqh + row * stride_dqs;
    for (int c = half * (DMAX / 2); c < (half + 1) * (DMAX / 2) && c < d; ++c)
        store_out(dq, dq_kind, at + c, limit > 0 ? t.dq[r * L::LD_O + c] * scale : 0.0f);
}
