// Causal grouped-query attention for the LLaMA family on CUDA cores, bf16 in/out, f32 arithmetic.
// The head dimension is a template parameter; only 128 is instantiated: head dimension 64 runs on
// the tensor-core kernels of attention.cu / attention_wg.cu, which take the same layout.
//
// Layout (the grouped projection of kernels/src/ops/gqa.rs): qkv [B, T, R] with R = C + 2·KV and
// KV = NKV·HD; for token (b, t) query head h is at cols h·HD, key head j at C + j·HD, value head j
// at C + KV + j·HD. Query head h reads key/value head h / (NH / NKV). y and dy are [B, T, C] (head
// h at cols h·HD), lse and delta [B, NH, T] f32 (lse in log2 units: lse·ln 2 is the natural
// log-sum-exp of the scaled scores). dqkv has qkv's layout and is written, not accumulated.
//
// Structure (FlashAttention-2's loops on CUDA cores): a block of 4 warps takes 16 query rows of
// one (b, head) (forward, dQ) or 32 keys of one (b, key/value head) (dK/dV). Keys come in tiles of
// 32 (one a lane) through shared memory; a lane forms its key's score with a sequential dot
// product over the head dimension, softmax statistics are warp reductions, and each lane
// accumulates HD/32 output columns over the tile's keys in ascending order (the weights passed by
// shuffles). The dK/dV kernel walks the query heads of its group in ascending order, and for each
// the query rows in ascending order: that sum over a group's heads is what GQA's key/value
// gradient is, formed in one fixed order by one thread per element.
//
// Determinism: no atomics; each output element is written by one thread; every sum runs in an
// order fixed by the shapes (xor trees give every lane the same bits: float addition commutes).

#define GQA_ROWS 16   // query rows per block (forward, dQ): 4 per warp
#define GQA_KEYS 32   // keys per tile: one per lane
#define GQA_THREADS 128

// Rows r0..r0+31 (HD bf16 columns at g, row stride R) into s (row stride HD + 2: an odd number of
// 4-byte words, so lane j reading row j hits bank (j + w) mod 32); rows ≥ t are zero.
template <int HD>
__device__ __forceinline__ void gqa_load_keys(bf16* s, const bf16* __restrict__ g, int r0, int t, int R) {
    constexpr int WORDS = HD / 2;
    for (int idx = threadIdx.x; idx < GQA_KEYS * WORDS; idx += GQA_THREADS) {
        const int r = idx / WORDS, w = idx - r * WORDS;
        u32 v = 0u;
        if (r0 + r < t) v = reinterpret_cast<const u32*>(g + (u64)(r0 + r) * R)[w];
        reinterpret_cast<u32*>(s + r * (HD + 2))[w] = v;
    }
}

// Rows r0..r0+n-1 (HD bf16 columns at g, row stride ld) into the f32 rows s[n][HD]; rows ≥ t are zero.
template <int HD>
__device__ __forceinline__ void gqa_load_rows(float* s, const bf16* __restrict__ g, int r0, int n, int t, u64 ld) {
    for (int idx = threadIdx.x; idx < n * HD; idx += GQA_THREADS) {
        const int r = idx / HD, d = idx - r * HD;
        s[idx] = (r0 + r < t) ? bf2f(g[(u64)(r0 + r) * ld + d]) : 0.0f;
    }
}

// Σ_d a[d] · k[d], d ascending (a: f32 row in shared memory, read by every lane at once; k: one
// key row of a tile, read as bf16 pairs).
template <int HD>
__device__ __forceinline__ float gqa_dot(const float* a, const bf16* k) {
    const u32* k2 = reinterpret_cast<const u32*>(k);
    float s = 0.0f;
#pragma unroll 8
    for (int w = 0; w < HD / 2; w++) {
        const u32 u = k2[w];
        s = fmaf(a[2 * w], __uint_as_float(u << 16), s);
        s = fmaf(a[2 * w + 1], __uint_as_float(u & 0xffff0000u), s);
    }
    return s;
}

__device__ __forceinline__ float gqa_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float gqa_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// acc[e] += Σ_{jj < n} w_jj · s[jj][lane + 32e], jj ascending; w_jj is lane jj's `w`.
template <int HD>
__device__ __forceinline__ void gqa_accumulate(float* acc, float w, const bf16* s, int n, int lane) {
    for (int jj = 0; jj < n; jj++) {
        const float wj = __shfl_sync(0xffffffffu, w, jj);
#pragma unroll
        for (int e = 0; e < HD / 32; e++) acc[e] = fmaf(wj, bf2f(s[jj * (HD + 2) + lane + 32 * e]), acc[e]);
    }
}

// y = softmax(q kᵀ / √HD + causal mask) v per query head, online over key tiles; lse saved.
template <int HD>
__device__ __forceinline__ void gqa_fwd_t(bf16* __restrict__ y, float* __restrict__ lse, const bf16* __restrict__ qkv, int t, int c, int nh,
                                          int nkv, float scale_log2) {
    constexpr int PER = HD / 32;
    __shared__ __align__(16) bf16 ks[GQA_KEYS * (HD + 2)];
    __shared__ __align__(16) bf16 vs[GQA_KEYS * (HD + 2)];
    __shared__ float qs[GQA_ROWS * HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int kv = nkv * HD, R = c + 2 * kv;
    const bf16* base = qkv + (u64)b * t * R;
    const int q0 = blockIdx.x * GQA_ROWS;
    gqa_load_rows<HD>(qs, base + h * HD, q0, GQA_ROWS, t, (u64)R);
    float m[4], l[4], o[4][PER];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        m[k] = -TESSERA_INF;
        l[k] = 0.0f;
#pragma unroll
        for (int e = 0; e < PER; e++) o[k][e] = 0.0f;
    }
    const int last = min(q0 + GQA_ROWS, t) - 1;
    for (int k0 = 0; k0 <= last; k0 += GQA_KEYS) {
        __syncthreads();  // every warp is done with the previous tile (and qs is loaded)
        gqa_load_keys<HD>(ks, base + c + g * HD, k0, t, R);
        gqa_load_keys<HD>(vs, base + c + kv + g * HD, k0, t, R);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int rr = warp * 4 + k, i = q0 + rr;
            if (i >= t || k0 > i) continue;  // warp-uniform
            const float s = (k0 + lane <= i) ? gqa_dot<HD>(qs + rr * HD, ks + lane * (HD + 2)) * scale_log2 : -TESSERA_INF;
            const float mnew = fmaxf(m[k], gqa_warp_max(s));
            const float corr = exp2f(m[k] - mnew);
            const float p = exp2f(s - mnew);
            l[k] = l[k] * corr + gqa_warp_sum(p);
#pragma unroll
            for (int e = 0; e < PER; e++) o[k][e] *= corr;
            gqa_accumulate<HD>(o[k], p, vs, min(GQA_KEYS, i - k0 + 1), lane);
            m[k] = mnew;
        }
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = q0 + warp * 4 + k;
        if (i >= t) continue;
        const float inv = 1.0f / l[k];
        bf16* yr = y + ((u64)b * t + i) * c + h * HD;
#pragma unroll
        for (int e = 0; e < PER; e++) yr[lane + 32 * e] = f2bf(o[k][e] * inv);
        if (lane == 0) lse[(u64)bh * t + i] = m[k] + log2f(l[k]);
    }
}

// dQ and delta: delta_i = Σ_d dy_i[d] · y_i[d]; for keys j ≤ i, p_ij = 2^(s_ij·scale_log2 − lse_i),
// dp_ij = dy_i · v_j, ds_ij = p_ij (dp_ij − delta_i); dq_i = scale · Σ_j ds_ij k_j (j ascending).
template <int HD>
__device__ __forceinline__ void gqa_bwd_dq_t(bf16* __restrict__ dqkv, float* __restrict__ delta, const bf16* __restrict__ dy,
                                             const bf16* __restrict__ qkv, const bf16* __restrict__ y, const float* __restrict__ lse, int t,
                                             int c, int nh, int nkv, float scale, float scale_log2) {
    constexpr int PER = HD / 32;
    __shared__ __align__(16) bf16 ks[GQA_KEYS * (HD + 2)];
    __shared__ __align__(16) bf16 vs[GQA_KEYS * (HD + 2)];
    __shared__ float qs[GQA_ROWS * HD];
    __shared__ float dys[GQA_ROWS * HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int kv = nkv * HD, R = c + 2 * kv;
    const bf16* base = qkv + (u64)b * t * R;
    const int q0 = blockIdx.x * GQA_ROWS;
    gqa_load_rows<HD>(qs, base + h * HD, q0, GQA_ROWS, t, (u64)R);
    gqa_load_rows<HD>(dys, dy + (u64)b * t * c + h * HD, q0, GQA_ROWS, t, (u64)c);
    __syncthreads();
    float dl[4], L[4], dq[4][PER];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int rr = warp * 4 + k, i = q0 + rr;
        dl[k] = 0.0f;
        L[k] = 0.0f;
#pragma unroll
        for (int e = 0; e < PER; e++) dq[k][e] = 0.0f;
        if (i >= t) continue;
        const bf16* yr = y + ((u64)b * t + i) * c + h * HD;
        float a = 0.0f;
#pragma unroll
        for (int e = 0; e < PER; e++) a = fmaf(dys[rr * HD + lane + 32 * e], bf2f(yr[lane + 32 * e]), a);
        dl[k] = gqa_warp_sum(a);
        L[k] = lse[(u64)bh * t + i];
        if (lane == 0) delta[(u64)bh * t + i] = dl[k];
    }
    const int last = min(q0 + GQA_ROWS, t) - 1;
    for (int k0 = 0; k0 <= last; k0 += GQA_KEYS) {
        __syncthreads();
        gqa_load_keys<HD>(ks, base + c + g * HD, k0, t, R);
        gqa_load_keys<HD>(vs, base + c + kv + g * HD, k0, t, R);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int rr = warp * 4 + k, i = q0 + rr;
            if (i >= t || k0 > i) continue;  // warp-uniform
            float ds = 0.0f;
            if (k0 + lane <= i) {
                const float p = exp2f(gqa_dot<HD>(qs + rr * HD, ks + lane * (HD + 2)) * scale_log2 - L[k]);
                const float dp = gqa_dot<HD>(dys + rr * HD, vs + lane * (HD + 2));
                ds = p * (dp - dl[k]);
            }
            gqa_accumulate<HD>(dq[k], ds, ks, min(GQA_KEYS, i - k0 + 1), lane);
        }
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = q0 + warp * 4 + k;
        if (i >= t) continue;
        bf16* dr = dqkv + ((u64)b * t + i) * R + h * HD;
#pragma unroll
        for (int e = 0; e < PER; e++) dr[lane + 32 * e] = f2bf(dq[k][e] * scale);
    }
}

// dK and dV of 32 keys of one (b, key/value head g): for each query head h of the group
// (ascending) and each query row i ≥ the tile's first key (ascending, 16 at a time),
//   dv_j += p_ij dy_i,  dk_j += ds_ij q_i   (j ≤ i),  dk scaled by `scale` at the end.
// Thread (warp w, lane j) owns key j's columns w·HD/4 .. (w+1)·HD/4 of dk and dv; warp w forms
// p and ds of rows w, w+4, w+8, w+12 of each chunk (lane = key) into shared memory first.
template <int HD>
__device__ __forceinline__ void gqa_bwd_dkdv_t(bf16* __restrict__ dqkv, const bf16* __restrict__ dy, const bf16* __restrict__ qkv,
                                               const float* __restrict__ lse, const float* __restrict__ delta, int t, int c, int nh, int nkv,
                                               float scale, float scale_log2) {
    constexpr int Q = HD / 4;  // columns a thread owns
    __shared__ __align__(16) bf16 ks[GQA_KEYS * (HD + 2)];
    __shared__ __align__(16) bf16 vs[GQA_KEYS * (HD + 2)];
    __shared__ float qs[GQA_ROWS * HD];
    __shared__ float dys[GQA_ROWS * HD];
    __shared__ float ps[GQA_ROWS][GQA_KEYS];
    __shared__ float dss[GQA_ROWS][GQA_KEYS];
    __shared__ float ls[GQA_ROWS], dls[GQA_ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bg = blockIdx.y, b = bg / nkv, g = bg - b * nkv, group = nh / nkv;
    const int kv = nkv * HD, R = c + 2 * kv;
    const bf16* base = qkv + (u64)b * t * R;
    const int k0 = blockIdx.x * GQA_KEYS;
    gqa_load_keys<HD>(ks, base + c + g * HD, k0, t, R);
    gqa_load_keys<HD>(vs, base + c + kv + g * HD, k0, t, R);
    float dk[Q], dv[Q];
#pragma unroll
    for (int e = 0; e < Q; e++) dk[e] = dv[e] = 0.0f;
    const int key = k0 + lane;
    for (int h = g * group; h < (g + 1) * group; h++) {
        const u64 bh = (u64)b * nh + h;
        for (int i0 = k0; i0 < t; i0 += GQA_ROWS) {
            __syncthreads();  // the previous chunk's rows are no longer read (and ks, vs are loaded)
            gqa_load_rows<HD>(qs, base + h * HD, i0, GQA_ROWS, t, (u64)R);
            gqa_load_rows<HD>(dys, dy + (u64)b * t * c + h * HD, i0, GQA_ROWS, t, (u64)c);
            if (threadIdx.x < GQA_ROWS) {
                const int i = i0 + threadIdx.x;
                ls[threadIdx.x] = i < t ? lse[bh * t + i] : 0.0f;
                dls[threadIdx.x] = i < t ? delta[bh * t + i] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int rr = warp + 4 * k, i = i0 + rr;
                float p = 0.0f, ds = 0.0f;
                if (i < t && key <= i) {
                    p = exp2f(gqa_dot<HD>(qs + rr * HD, ks + lane * (HD + 2)) * scale_log2 - ls[rr]);
                    const float dp = gqa_dot<HD>(dys + rr * HD, vs + lane * (HD + 2));
                    ds = p * (dp - dls[rr]);
                }
                ps[rr][lane] = p;
                dss[rr][lane] = ds;
            }
            __syncthreads();
            for (int rr = 0; rr < GQA_ROWS; rr++) {
                const float p = ps[rr][lane], ds = dss[rr][lane];
                const float* dyr = dys + rr * HD + warp * Q;
                const float* qr = qs + rr * HD + warp * Q;
#pragma unroll
                for (int e = 0; e < Q; e++) {
                    dv[e] = fmaf(p, dyr[e], dv[e]);
                    dk[e] = fmaf(ds, qr[e], dk[e]);
                }
            }
        }
    }
    if (key < t) {
        bf16* row = dqkv + ((u64)b * t + key) * R;
#pragma unroll
        for (int e = 0; e < Q; e++) {
            row[c + g * HD + warp * Q + e] = f2bf(dk[e] * scale);
            row[c + kv + g * HD + warp * Q + e] = f2bf(dv[e]);
        }
    }
}

#define GQA_KERNELS(HD)                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GQA_THREADS)                                                                              \
        gqa_fwd_##HD(bf16* __restrict__ y, float* __restrict__ lse, const bf16* __restrict__ qkv, int t, int c, int nh, int nkv,           \
                     float scale_log2) {                                                                                                   \
        gqa_fwd_t<HD>(y, lse, qkv, t, c, nh, nkv, scale_log2);                                                                             \
    }                                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(GQA_THREADS)                                                                              \
        gqa_bwd_dq_##HD(bf16* __restrict__ dqkv, float* __restrict__ delta, const bf16* __restrict__ dy, const bf16* __restrict__ qkv,     \
                        const bf16* __restrict__ y, const float* __restrict__ lse, int t, int c, int nh, int nkv, float scale,             \
                        float scale_log2) {                                                                                                \
        gqa_bwd_dq_t<HD>(dqkv, delta, dy, qkv, y, lse, t, c, nh, nkv, scale, scale_log2);                                                  \
    }                                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(GQA_THREADS)                                                                              \
        gqa_bwd_dkdv_##HD(bf16* __restrict__ dqkv, const bf16* __restrict__ dy, const bf16* __restrict__ qkv, const float* __restrict__ lse, \
                          const float* __restrict__ delta, int t, int c, int nh, int nkv, float scale, float scale_log2) {                 \
        gqa_bwd_dkdv_t<HD>(dqkv, dy, qkv, lse, delta, t, c, nh, nkv, scale, scale_log2);                                                   \
    }

GQA_KERNELS(128)
