// kernels/cuda/moe.cu — the mixture-of-experts feed-forward's non-GEMM kernels (Rust wrappers and
// contracts in kernels/src/cuda/llama/moe.rs): routing (softmax over experts, top-k with ties to
// the lower index, renormalisation), the deterministic permutation that groups each expert's rows
// in token order, gather, weighted combine in k order, and their backwards, including the
// router's and the load-balancing loss's (transformers' `load_balancing_loss_func`).
//
// Determinism: no atomics. Every output element is written by one thread; every reduction runs in
// an order fixed by the shapes alone (k order, ascending experts, lane-strided sums then a fixed
// xor tree, a block scan over fixed chunks).
//
// Shapes: n tokens, E experts (E ≤ MOE_MAX_EXPERTS), K chosen per token, c the row width, an
// "assignment" a = t·K + j is token t's j-th choice, a "slot" s is its row in the expert-sorted
// order (slot_of[a] = s, perm[s] = a).

#define MOE_MAX_EXPERTS 64
#define MOE_SCAN_THREADS 1024

__device__ __forceinline__ u64 m_gtid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }

// One thread per token: probs[t,:] = softmax(logits[t,:]) (f32), then the K largest (a strictly
// larger value wins, so ties go to the lower index), their weights renormalised to sum to one when
// `norm` (summed in k order).
extern "C" __global__ void moe_route(float* __restrict__ probs, float* __restrict__ topw, u32* __restrict__ topi,
                                     const float* __restrict__ logits, u64 n, int E, int K, int norm) {
    const u64 t = m_gtid();
    if (t >= n) return;
    const float* l = logits + t * E;
    float* p = probs + t * E;
    float mx = l[0];
    for (int e = 1; e < E; e++) mx = fmaxf(mx, l[e]);
    float s = 0.0f;
    for (int e = 0; e < E; e++) {
        const float v = expf(__fsub_rn(l[e], mx));
        p[e] = v;
        s = __fadd_rn(s, v);
    }
    for (int e = 0; e < E; e++) p[e] = __fdiv_rn(p[e], s);
    u64 taken = 0;
    float sel = 0.0f;
    for (int j = 0; j < K; j++) {
        int best = -1;
        float bv = 0.0f;
        for (int e = 0; e < E; e++) {
            if ((taken >> e) & 1ull) continue;
            if (best < 0 || p[e] > bv) { best = e; bv = p[e]; }
        }
        taken |= 1ull << best;
        topi[t * K + j] = (u32)best;
        topw[t * K + j] = bv;
        sel = __fadd_rn(sel, bv);
    }
    if (norm)
        for (int j = 0; j < K; j++) topw[t * K + j] = __fdiv_rn(topw[t * K + j], sel);
}

// Exclusive block scan of one u32 per thread (blockDim = MOE_SCAN_THREADS); returns the total.
__device__ u32 m_block_scan(u32 v, u32* excl) {
    __shared__ u32 warp_tot[MOE_SCAN_THREADS / 32];
    __shared__ u32 total;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u32 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) warp_tot[w] = inc;
    __syncthreads();
    if (w == 0) {
        const u32 x = lane < (int)(blockDim.x >> 5) ? warp_tot[lane] : 0u;
        u32 xi = x;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, xi, o);
            if (lane >= o) xi += y;
        }
        warp_tot[lane] = xi - x;  // exclusive prefix of the warps' totals
    }
    __syncthreads();
    *excl = warp_tot[w] + inc - v;
    if (threadIdx.x == blockDim.x - 1) total = *excl + v;
    __syncthreads();
    const u32 tot = total;
    __syncthreads();
    return tot;
}

// One block: a stable counting sort of the n·K assignments by expert. Thread i owns the
// contiguous chunk [i·chunk, (i+1)·chunk); for each expert in turn, a block scan of the chunks'
// match counts places each match after the earlier chunks' ones. offsets[e] is expert e's first
// slot, offsets[E] = n·K.
extern "C" __global__ void moe_permute(u32* __restrict__ perm, u32* __restrict__ slot_of, u32* __restrict__ offsets,
                                       const u32* __restrict__ topi, u64 nk, int E) {
    const u64 chunk = (nk + blockDim.x - 1) / blockDim.x;
    const u64 lo = min(nk, (u64)threadIdx.x * chunk), hi = min(nk, lo + chunk);
    u32 base = 0;
    for (int e = 0; e < E; e++) {
        u32 cnt = 0;
        for (u64 a = lo; a < hi; a++) cnt += topi[a] == (u32)e;
        u32 excl;
        const u32 tot = m_block_scan(cnt, &excl);
        u32 s = base + excl;
        for (u64 a = lo; a < hi; a++)
            if (topi[a] == (u32)e) {
                perm[s] = (u32)a;
                slot_of[a] = s;
                s++;
            }
        if (threadIdx.x == 0) offsets[e] = base;
        base += tot;
    }
    if (threadIdx.x == 0) offsets[E] = base;
}

// xs[s, :] = h[perm[s] / K, :] (bf16 rows; 8 elements a thread, c a multiple of 8).
extern "C" __global__ void moe_gather(bf16* __restrict__ xs, const bf16* __restrict__ h, const u32* __restrict__ perm, u64 nk, int c,
                                      int K) {
    const u64 i = m_gtid();
    const int c8 = c >> 3;
    if (i >= nk * (u64)c8) return;
    const u64 s = i / c8;
    const int q = (int)(i - s * c8);
    const u64 t = perm[s] / (u32)K;
    reinterpret_cast<uint4*>(xs + s * c)[q] = reinterpret_cast<const uint4*>(h + t * c)[q];
}

// y[t, j] = x2[t, j] + Σ_k topw[t,k] · out[slot_of[t·K + k], j], the sum in k order (f32).
extern "C" __global__ void moe_combine(float* __restrict__ y, const float* __restrict__ x2, const bf16* __restrict__ out,
                                       const float* __restrict__ topw, const u32* __restrict__ slot_of, u64 n, int c, int K) {
    const u64 i = m_gtid();
    if (i >= n * (u64)c) return;
    const u64 t = i / c;
    const int j = (int)(i - t * c);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) {
        const u64 s = slot_of[t * K + k];
        acc = __fadd_rn(acc, __fmul_rn(topw[t * K + k], bf2f(out[s * c + j])));
    }
    y[i] = __fadd_rn(x2[i], acc);
}

// One warp per assignment a = t·K + k (s = slot_of[a]): dout[s, :] = bf16(topw[a] · dy[t, :]) and
// dw[a] = Σ_j dy[t, j] · out[s, j] (lane-strided, then the xor tree).
extern "C" __global__ void moe_combine_bwd(bf16* __restrict__ dout, float* __restrict__ dw, const float* __restrict__ dy,
                                           const bf16* __restrict__ out, const float* __restrict__ topw,
                                           const u32* __restrict__ slot_of, u64 nk, int c, int K) {
    const u64 a = m_gtid() >> 5;
    const int lane = threadIdx.x & 31;
    if (a >= nk) return;
    const u64 t = a / K, s = slot_of[a];
    const float w = topw[a];
    const float* d = dy + t * c;
    float acc = 0.0f;
    for (int j = lane; j < c; j += 32) {
        const float g = d[j];
        dout[s * c + j] = f2bf(__fmul_rn(w, g));
        acc = __fadd_rn(acc, __fmul_rn(g, bf2f(out[s * c + j])));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) dw[a] = acc;
}

// dh[t, j] = Σ_k dxs[slot_of[t·K + k], j], in k order (the gather's transpose).
extern "C" __global__ void moe_scatter_bwd(float* __restrict__ dh, const float* __restrict__ dxs, const u32* __restrict__ slot_of,
                                           u64 n, int c, int K) {
    const u64 i = m_gtid();
    if (i >= n * (u64)c) return;
    const u64 t = i / c;
    const int j = (int)(i - t * c);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc = __fadd_rn(acc, dxs[(u64)slot_of[t * K + k] * c + j]);
    dh[i] = acc;
}

// One thread per token: d(logits)[t, :] (bf16, the router GEMMs' operand) from d(topw) through the
// renormalisation (when `norm`: w_j = p_j / S, dp_j = (dw_j − Σ_i dw_i w_i) / S) and the softmax
// (dl_e = p_e (dp_e − Σ_e' p_e' dp_e')), plus auxg[e], the load-balancing loss's d/dp[t, e] (the
// same for every token).
extern "C" __global__ void moe_router_bwd(bf16* __restrict__ dlogits, const float* __restrict__ probs, const float* __restrict__ topw,
                                          const u32* __restrict__ topi, const float* __restrict__ dw, const float* __restrict__ auxg,
                                          u64 n, int E, int K, int norm) {
    const u64 t = m_gtid();
    if (t >= n) return;
    const float* p = probs + t * E;
    float dp[MOE_MAX_EXPERTS];
    for (int e = 0; e < E; e++) dp[e] = auxg[e];
    float sel = 0.0f, dot = 0.0f;
    for (int k = 0; k < K; k++) {
        sel = __fadd_rn(sel, p[topi[t * K + k]]);
        dot = __fadd_rn(dot, __fmul_rn(dw[t * K + k], topw[t * K + k]));
    }
    for (int k = 0; k < K; k++) {
        const u32 e = topi[t * K + k];
        const float g = norm ? __fdiv_rn(__fsub_rn(dw[t * K + k], dot), sel) : dw[t * K + k];
        dp[e] = __fadd_rn(dp[e], g);
    }
    float pd = 0.0f;
    for (int e = 0; e < E; e++) pd = __fadd_rn(pd, __fmul_rn(p[e], dp[e]));
    for (int e = 0; e < E; e++) dlogits[t * E + e] = f2bf(__fmul_rn(p[e], __fsub_rn(dp[e], pd)));
}

// One block of 256 per expert: psum[e] = Σ_t probs[t, e] (thread-strided ascending, then a fixed
// shared-memory tree) — the router-probability half of the load-balancing loss.
extern "C" __global__ void moe_prob_sum(float* __restrict__ psum, const float* __restrict__ probs, u64 n, int E) {
    __shared__ float part[256];
    const int e = blockIdx.x;
    float acc = 0.0f;
    for (u64 t = threadIdx.x; t < n; t += blockDim.x) acc = __fadd_rn(acc, probs[t * E + e]);
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) part[threadIdx.x] = __fadd_rn(part[threadIdx.x], part[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) psum[e] = part[0];
}
