// Decoding over a paged key/value cache (kernels/src/cuda/decode/). Compiled after llama.cu (its
// RMSNorm row sums and SwiGLU helpers are reused, see cuda::SOURCES).
//
// A step runs `n` tokens of any number of sequences. Per token the step inputs (int32, written by
// the host each step) give its position `pos`, its cache slot `slot` (block · bs + offset) and its
// sequence `seq`; `tables[seq · max_blocks + i]` is the i-th cache block of that sequence.
// The cache of one layer is K and V, each [num_blocks · bs, nkv, hd] bf16: a position's heads
// sit together, positions of a block are contiguous.

// ---------------------------------------------------------------------------------------------
// Embedding with positions (GPT-2): x[r, j] = wte[tok[r], j] + wpe[pos[r], j]   (f32)
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void dec_embed_pos(float* __restrict__ x, const bf16* __restrict__ wte, const bf16* __restrict__ wpe,
                                         const int* __restrict__ tok, const int* __restrict__ pos, int n, int c, int vocab) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const int t = tok[r], p = pos[r];
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        x[(u64)r * c + j] = (t < 0 || t >= vocab) ? __int_as_float(0x7fc00000) : bf2f(wte[(u64)t * c + j]) + bf2f(wpe[(u64)p * c + j]);
    }
}

// ---------------------------------------------------------------------------------------------
// QKV epilogue: bias, RoPE, and the store of k and v into the cache
// ---------------------------------------------------------------------------------------------
// qkv [n, (nh + 2·nkv)·hd] is the QKV GEMM's product (q | k | v). With s = qkv + bias (f32;
// `bias` may be null) and, where `inv_freq` is not null, each q and k head rotated by RoPE
// (rotate_half pairing i with i + hd/2, angle pos · inv_freq[i] in f64 as ops::rope's table):
//   q_out[r, h·hd + d] = bf16(s_q),  K[slot[r], g, d] = bf16(s_k),  V[slot[r], g, d] = bf16(s_v).
// One block per token; a thread per pair (head, i < hd/2).
extern "C" __global__ void dec_qkv_store(bf16* __restrict__ q_out, bf16* __restrict__ kc, bf16* __restrict__ vc,
                                         const bf16* __restrict__ qkv, const bf16* __restrict__ bias, const double* __restrict__ inv_freq,
                                         const int* __restrict__ pos, const int* __restrict__ slot, int n, int nh, int nkv, int hd) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const int half = hd >> 1, heads = nh + 2 * nkv, row = heads * hd;
    const bf16* src = qkv + (u64)r * row;
    const double p = (double)pos[r];
    const u64 s = (u64)slot[r];
    for (int w = threadIdx.x; w < heads * half; w += blockDim.x) {
        const int h = w / half, i = w - h * half;
        const int c0 = h * hd + i, c1 = c0 + half;
        float a = bf2f(src[c0]), b = bf2f(src[c1]);
        if (bias) {
            a += bf2f(bias[c0]);
            b += bf2f(bias[c1]);
        }
        if (inv_freq && h < nh + nkv) {
            double sn, cs;
            sincos(p * inv_freq[i], &sn, &cs);
            const float cf = (float)cs, sf = (float)sn;
            const float a2 = a * cf - b * sf, b2 = b * cf + a * sf;
            a = a2;
            b = b2;
        }
        bf16* dst;
        if (h < nh) {
            dst = q_out + (u64)r * nh * hd + h * hd;
        } else if (h < nh + nkv) {
            dst = kc + (s * nkv + (h - nh)) * hd;
        } else {
            dst = vc + (s * nkv + (h - nh - nkv)) * hd;
        }
        dst[i] = f2bf(a);
        dst[i + half] = f2bf(b);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention of one query over its sequence's paged cache
// ---------------------------------------------------------------------------------------------
// y[r, h·hd + d] = Σ_{j ≤ pos[r]} softmax_j(scale · q_h · k_j) · v_j[d], k and v of key/value head
// g = h / (nh / nkv), position j in block tables[seq[r]·max_blocks + j / bs], offset j % bs.
// One block (DEC_ATT_THREADS) per (token, head): a thread per key for the scores (dynamic shared
// memory holds them: max_len floats), the softmax's max and sum by a fixed tree, then for the
// output thread (part, d8) sums keys j ≡ part (mod parts) over 8 dimensions and the parts are
// added in ascending order. f32 throughout, bf16 out; deterministic.
#define DEC_ATT_THREADS 256

__device__ __forceinline__ float dec_block_reduce(float v, float* red, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = red[0];
    for (int k = 1; k < nw; k++) t = is_max ? fmaxf(t, red[k]) : t + red[k];
    return t;
}

__device__ __forceinline__ const bf16* dec_kv_row(const bf16* cache, const int* table, int j, int bs, int nkv, int g, int hd) {
    const u64 s = (u64)table[j / bs] * bs + (j % bs);
    return cache + (s * nkv + g) * hd;
}

extern "C" __global__ void dec_paged_attention(bf16* __restrict__ y, const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                               const bf16* __restrict__ vc, const int* __restrict__ pos, const int* __restrict__ seq,
                                               const int* __restrict__ tables, int max_blocks, int nh, int nkv, int hd, int bs, float scale) {
    extern __shared__ float sm[];
    const int r = blockIdx.x, h = blockIdx.y, g = h / (nh / nkv);
    const int len = pos[r] + 1;
    const int* table = tables + (u64)seq[r] * max_blocks;
    float* qs = sm;                 // [hd]
    float* red = qs + hd;           // [32]
    float* sc = red + 32;           // [len]
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = bf2f(q[(u64)r * nh * hd + h * hd + d]) * scale;
    __syncthreads();
    float mx = -TESSERA_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const uint4* k4 = (const uint4*)dec_kv_row(kc, table, j, bs, nkv, g, hd);
        float acc = 0.0f;
#pragma unroll 8
        for (int v = 0; v < (hd >> 3); v++) {
            const uint4 kv = k4[v];
            const float* qq = qs + 8 * v;
            acc += qq[0] * bf2f((bf16)(kv.x & 0xffffu)) + qq[1] * bf2f((bf16)(kv.x >> 16));
            acc += qq[2] * bf2f((bf16)(kv.y & 0xffffu)) + qq[3] * bf2f((bf16)(kv.y >> 16));
            acc += qq[4] * bf2f((bf16)(kv.z & 0xffffu)) + qq[5] * bf2f((bf16)(kv.z >> 16));
            acc += qq[6] * bf2f((bf16)(kv.w & 0xffffu)) + qq[7] * bf2f((bf16)(kv.w >> 16));
        }
        sc[j] = acc;
        mx = fmaxf(mx, acc);
    }
    mx = dec_block_reduce(mx, red, true);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float e = __expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = dec_block_reduce(sum, red, false);  // ends with a barrier: every score is written
    // Thread (part, d8) sums keys j ≡ part (mod parts) over dimensions 8·d8 .. 8·d8 + 7 (one
    // 16-byte load a key), the parts are then added in ascending order.
    const int d8n = hd >> 3, parts = blockDim.x / d8n;
    const int part = threadIdx.x / d8n, d8 = threadIdx.x - part * d8n;
    float a[8];
#pragma unroll
    for (int e = 0; e < 8; e++) a[e] = 0.0f;
    if (part < parts) {
#pragma unroll 4
        for (int j = part; j < len; j += parts) {
            const uint4 vv = ((const uint4*)dec_kv_row(vc, table, j, bs, nkv, g, hd))[d8];
            const float p = sc[j];
            const u32 vs[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                a[2 * e] += p * bf2f((bf16)(vs[e] & 0xffffu));
                a[2 * e + 1] += p * bf2f((bf16)(vs[e] >> 16));
            }
        }
    }
    __syncthreads();
    float* acc = sc;  // reuse: [parts, hd] (parts · hd ≤ 8 · DEC_ATT_THREADS)
    if (part < parts) {
#pragma unroll
        for (int e = 0; e < 8; e++) acc[part * hd + 8 * d8 + e] = a[e];
    }
    __syncthreads();
    const float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float t = 0.0f;
        for (int k = 0; k < parts; k++) t += acc[k * hd + d];
        y[(u64)r * nh * hd + h * hd + d] = f2bf(t * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// Residual add and RMSNorm (the LLaMA blocks' joins): x += y (f32 + bf16), then
// out = bf16((x · rstd) · w) with rstd = 1/√(Σx²/c + ε), as rmsnorm_fwd. One warp per row,
// c % 4 == 0, rows 16-byte aligned (the wrapper checks).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void dec_residual_rmsnorm(float* __restrict__ x, bf16* __restrict__ out, const bf16* __restrict__ y,
                                                const bf16* __restrict__ w, int n, int c, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;  // warp-uniform
    float4* xr = (float4*)(x + (u64)row * c);
    const bf16* yr = y + (u64)row * c;
    for (int q = lane; q < (c >> 2); q += 32) {
        float4 v = xr[q];
        v.x += bf2f(yr[4 * q]);
        v.y += bf2f(yr[4 * q + 1]);
        v.z += bf2f(yr[4 * q + 2]);
        v.w += bf2f(yr[4 * q + 3]);
        xr[q] = v;
    }
    __syncwarp();
    l_rmsnorm_row(out + (u64)row * c, xr, w, c, eps, lane);
}

// out[r, i] = silu(gu[r, i]) · gu[r, f + i]: SwiGLU over the fused gate|up GEMM's rows [n, 2f].
extern "C" __global__ void dec_swiglu_rows(bf16* __restrict__ out, const bf16* __restrict__ gu, int n, int f) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * f) return;
    const u64 r = i / f, k = i - r * f;
    out[i] = f2bf(l_swiglu(bf2f(gu[r * 2 * f + k]), bf2f(gu[r * 2 * f + f + k])));
}

// dst[i, :] = src[rows[i], :]   (bf16 rows of c: the normed rows of the tokens whose logits are wanted).
extern "C" __global__ void dec_gather_rows(bf16* __restrict__ dst, const bf16* __restrict__ src, const int* __restrict__ rows, int m, int c) {
    const int i = blockIdx.x;
    if (i >= m) return;
    const bf16* s = src + (u64)rows[i] * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) dst[(u64)i * c + j] = s[j];
}

// out[i] = the lowest index of the largest of logits[i, :v] (greedy decoding on the device).
// One block per row; a fixed tree (ties to the lower index).
extern "C" __global__ void dec_argmax(int* __restrict__ out, const float* __restrict__ logits, int m, int v) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const int i = blockIdx.x;
    if (i >= m) return;
    const float* l = logits + (u64)i * v;
    float best = -TESSERA_INF;
    int arg = 0x7fffffff;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        const float x = l[j];
        if (x > best) {
            best = x;
            arg = j;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, arg, o);
        if (ob > best || (ob == best && oi < arg)) {
            best = ob;
            arg = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = arg;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); k++) {
            if (bv[k] > best || (bv[k] == best && bi[k] < arg)) {
                best = bv[k];
                arg = bi[k];
            }
        }
        out[i] = arg;
    }
}

// ---------------------------------------------------------------------------------------------
// Linear layers of few rows (decode steps): bf16 weights, or weight-only quantized int8 or fp8
// (e4m3) with one f32 scale per output channel; bf16 activations, f32 accumulation.
// ---------------------------------------------------------------------------------------------
// fp8 e4m3 (OCP: bias 7, no infinities, S.1111.111 is NaN) to f32.
__device__ __forceinline__ float dec_e4m3(u32 b) {
    const u32 s = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 0) return __uint_as_float(s) + (s ? -1.0f : 1.0f) * (float)m * 0.001953125f;  // m · 2^-9
    if (e == 15 && m == 7) return __int_as_float(0x7fc00000);
    return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

// The 4 weights packed in one 32-bit word, as f32 (FMT 0: int8, 1: e4m3).
template <int FMT>
__device__ __forceinline__ void dec_unpack4(u32 w, float* o) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 b = (w >> (8 * i)) & 0xffu;
        o[i] = FMT == 0 ? (float)(signed char)b : dec_e4m3(b);
    }
}

// GELU (tanh form), ops::gelu's formula.
__device__ __forceinline__ float dec_gelu(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

#define DEC_WQ_ROWS 8
// Chunks of 16 weights each lane loads before it computes with them (loads in flight per lane).
#define DEC_GEMV_AHEAD 4

// acc[r] += Σ over chunk q (16 weights from k = 16q) of x[r0 + r, k] · w[k] (unscaled), for the
// rows r0 + r < m. `wa` (and for bf16 `wb`) hold the chunk's weights.
template <int FMT>
__device__ __forceinline__ void dec_gemv_chunk(float (&acc)[DEC_WQ_ROWS], const bf16* __restrict__ x, uint4 wa, uint4 wb, int q, int r0,
                                               int m, int k) {
    float wf[16];
    if (FMT == 2) {
        const u32 ws[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            wf[2 * i] = bf2f((bf16)(ws[i] & 0xffffu));
            wf[2 * i + 1] = bf2f((bf16)(ws[i] >> 16));
        }
    } else {
        dec_unpack4<FMT>(wa.x, wf);
        dec_unpack4<FMT>(wa.y, wf + 4);
        dec_unpack4<FMT>(wa.z, wf + 8);
        dec_unpack4<FMT>(wa.w, wf + 12);
    }
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) {
        if (r0 + r < m) {
            const uint4* xr = (const uint4*)(x + (u64)(r0 + r) * k + 16 * q);
            const uint4 a = xr[0], b = xr[1];
            const u32 xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float t = acc[r];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                t += bf2f((bf16)(xs[i] & 0xffffu)) * wf[2 * i] + bf2f((bf16)(xs[i] >> 16)) * wf[2 * i + 1];
            }
            acc[r] = t;
        }
    }
}

// The dot products of output channel j (w's row j of k weights) with rows r0.. of x, each lane's
// part: lane takes chunks q ≡ lane (mod 32) ascending, loading DEC_GEMV_AHEAD chunks before
// computing with them (the same order of additions as one chunk at a time). Not yet reduced
// over the warp.
template <int FMT>
__device__ __forceinline__ void dec_gemv_dot(float (&acc)[DEC_WQ_ROWS], const bf16* __restrict__ x, const unsigned char* __restrict__ w,
                                             int j, int lane, int r0, int m, int k) {
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) acc[r] = 0.0f;
    const int k16 = k >> 4;
    const uint4* wr = (const uint4*)(w + (u64)j * k * (FMT == 2 ? 2 : 1));
    for (int q0 = lane; q0 < k16; q0 += 32 * DEC_GEMV_AHEAD) {
        uint4 wa[DEC_GEMV_AHEAD], wb[DEC_GEMV_AHEAD];
#pragma unroll
        for (int u = 0; u < DEC_GEMV_AHEAD; u++) {
            const int q = q0 + 32 * u;
            wa[u] = make_uint4(0u, 0u, 0u, 0u);
            wb[u] = wa[u];
            if (q < k16) {
                wa[u] = FMT == 2 ? wr[2 * q] : wr[q];
                if (FMT == 2) wb[u] = wr[2 * q + 1];
            }
        }
#pragma unroll
        for (int u = 0; u < DEC_GEMV_AHEAD; u++) {
            const int q = q0 + 32 * u;
            if (q < k16) dec_gemv_chunk<FMT>(acc, x, wa[u], wb[u], q, r0, m, k);
        }
    }
}

// y[r, j] = epilogue(Σ_k x[r, k] · w[j, k] · s[j])  with w [n, k] (output channel j's row) of
// int8 (FMT 0), e4m3 (1) or bf16 (2; `s` null), x [m, k] bf16. The product is rounded to bf16
// (as a GEMM's output), then with `bias` (may be null): y = bf16(product + bias), and with `gelu`
// y = bf16(gelu(that)) — the bits of a GEMM followed by ops.cu's bias (+ GELU) kernel up to the
// GELU's exponential. One warp per output channel (blockDim = 32 · channels per block); lanes
// take 16 weights at a time (k % 16 == 0), ascending, then a fixed xor tree; blockIdx.y picks
// DEC_WQ_ROWS rows.
// The GEMV's epilogue for output channel j (see dec_gemv_t): reduces each row's lane parts over
// the warp and stores bf16(product · s[j]) (+ bias, GELU) to the rows r0 + r < m.
__device__ __forceinline__ void dec_gemv_store(bf16* __restrict__ y, const float (&acc)[DEC_WQ_ROWS], const float* __restrict__ s,
                                               const bf16* __restrict__ bias, int gelu, int j, int lane, int r0, int m, int n) {
    const float sj = s ? s[j] : 1.0f;
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) {
        const float t = warp_sum(acc[r]);
        if (lane == 0 && r0 + r < m) {
            float v = bf2f(f2bf(t * sj));
            if (bias) v = bf2f(f2bf(v + bf2f(bias[j])));
            if (gelu) v = dec_gelu(v);
            y[(u64)(r0 + r) * n + j] = f2bf(v);
        }
    }
}

// y[r, j] = epilogue(Σ_k x[r, k] · w[j, k] · s[j])  with w [n, k] (output channel j's row) of
// int8 (FMT 0), e4m3 (1) or bf16 (2; `s` null), x [m, k] bf16. The product is rounded to bf16
// (as a GEMM's output), then with `bias` (may be null): y = bf16(product + bias), and with `gelu`
// y = bf16(gelu(that)) — the bits of a GEMM followed by ops.cu's bias (+ GELU) kernel up to the
// GELU's exponential. One warp per output channel (blockDim = 32 · channels per block); lanes
// take 16 weights at a time (k % 16 == 0), ascending, then a fixed xor tree; blockIdx.y picks
// DEC_WQ_ROWS rows.
template <int FMT>
__device__ __forceinline__ void dec_gemv_t(bf16* __restrict__ y, const bf16* __restrict__ x, const unsigned char* __restrict__ w,
                                           const float* __restrict__ s, const bf16* __restrict__ bias, int gelu, int m, int k, int n) {
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, r0 = blockIdx.y * DEC_WQ_ROWS;
    if (j >= n) return;  // warp-uniform
    float acc[DEC_WQ_ROWS];
    dec_gemv_dot<FMT>(acc, x, w, j, lane, r0, m, k);
    dec_gemv_store(y, acc, s, bias, gelu, j, lane, r0, m, n);
}

// ---------------------------------------------------------------------------------------------
// GPT-2's joins folded into the next GEMV: the residual add and LayerNorm as its prologue
// ---------------------------------------------------------------------------------------------
// Rows r0 .. r0 + DEC_WQ_ROWS - 1 (those < m) of xo = x + (y + yb) and hs = LN(xo)·lw + lb, the
// arithmetic of ops.cu's residual_layernorm_fwd_vec (residual_row_regs, then ln_row_regs), so
// the same bits: warp w takes row r0 + w (blockDim ≥ 32 · DEC_WQ_ROWS). hs [DEC_WQ_ROWS, c] bf16
// in shared memory (16-byte aligned); only blocks with blockIdx.x == 0 store xo (which must not
// alias x: the other blocks still read x). c % 128 == 0, c ≤ 128 · LN_MAXV. Ends with a barrier.
__device__ __forceinline__ void dec_ln_prologue(bf16* hs, float* xo, const float* __restrict__ x, const bf16* __restrict__ y,
                                                const bf16* __restrict__ yb, const bf16* __restrict__ lw, const bf16* __restrict__ lb, int r0,
                                                int m, int c) {
    __shared__ float stats[2][DEC_WQ_ROWS];  // mean and rstd (not needed by decoding)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = r0 + warp;
    if (warp < DEC_WQ_ROWS && row < m) {
        const int nv = c >> 7;
        float4 xv[LN_MAXV];
        float* dst = blockIdx.x == 0 ? xo + (u64)row * c : nullptr;
        residual_row_regs<LN_MAXV>(xv, nv, lane, dst, x + (u64)row * c, y + (u64)row * c, yb);
        ln_row_regs<LN_MAXV>(xv, nv, warp, lane, hs, stats[0], stats[1], lw, lb, c);
    }
    __syncthreads();
}

// dec_gemv_t on the rows dec_ln_prologue makes (k = c): the residual + LayerNorm kernel and the
// GEMV in one launch. Dynamic shared memory: DEC_WQ_ROWS · k bf16.
template <int FMT>
__device__ __forceinline__ void dec_gemv_ln_t(bf16* __restrict__ y, float* xo, const float* __restrict__ x, const bf16* __restrict__ ry,
                                              const bf16* __restrict__ ryb, const bf16* __restrict__ lw, const bf16* __restrict__ lb,
                                              const unsigned char* __restrict__ w, const float* __restrict__ s, const bf16* __restrict__ bias,
                                              int gelu, int m, int k, int n) {
    extern __shared__ __align__(16) unsigned char dec_dsm[];
    bf16* hs = reinterpret_cast<bf16*>(dec_dsm);
    const int r0 = blockIdx.y * DEC_WQ_ROWS;
    dec_ln_prologue(hs, xo, x, ry, ryb, lw, lb, r0, m, k);
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (j >= n) return;  // warp-uniform
    float acc[DEC_WQ_ROWS];
    dec_gemv_dot<FMT>(acc, hs, w, j, lane, 0, m - r0, k);
    dec_gemv_store(y, acc, s, bias, gelu, j, lane, r0, m, n);
}

#define DEC_GEMV_LN(NAME, FMT)                                                                                                          \
    extern "C" __global__ void NAME(bf16* __restrict__ y, float* xo, const float* __restrict__ x, const bf16* __restrict__ ry,          \
                                    const bf16* __restrict__ ryb, const bf16* __restrict__ lw, const bf16* __restrict__ lb,             \
                                    const unsigned char* __restrict__ w, const float* __restrict__ s, const bf16* __restrict__ bias,    \
                                    int gelu, int m, int k, int n) {                                                                    \
        dec_gemv_ln_t<FMT>(y, xo, x, ry, ryb, lw, lb, w, s, bias, gelu, m, k, n);                                                      \
    }
DEC_GEMV_LN(dec_gemv_ln_i8, 0)
DEC_GEMV_LN(dec_gemv_ln_e4m3, 1)
DEC_GEMV_LN(dec_gemv_ln_bf16, 2)

extern "C" __global__ void dec_gemv_i8(bf16* __restrict__ y, const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ s,
                                       const bf16* __restrict__ bias, int gelu, int m, int k, int n) {
    dec_gemv_t<0>(y, x, w, s, bias, gelu, m, k, n);
}
extern "C" __global__ void dec_gemv_e4m3(bf16* __restrict__ y, const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ s,
                                         const bf16* __restrict__ bias, int gelu, int m, int k, int n) {
    dec_gemv_t<1>(y, x, w, s, bias, gelu, m, k, n);
}
extern "C" __global__ void dec_gemv_bf16(bf16* __restrict__ y, const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ s,
                                         const bf16* __restrict__ bias, int gelu, int m, int k, int n) {
    dec_gemv_t<2>(y, x, w, s, bias, gelu, m, k, n);
}

// y[r, j] = Σ_k x[r, k] · w[j, k] in f32, not rounded (the LM head's logits of a few rows; w
// bf16 [n, k]); the GEMV above otherwise.
extern "C" __global__ void dec_gemv_f32out(float* __restrict__ y, const bf16* __restrict__ x, const unsigned char* __restrict__ w, int m, int k,
                                           int n) {
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31, r0 = blockIdx.y * DEC_WQ_ROWS;
    if (j >= n) return;  // warp-uniform
    float acc[DEC_WQ_ROWS];
    dec_gemv_dot<2>(acc, x, w, j, lane, r0, m, k);
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) {
        const float t = warp_sum(acc[r]);
        if (lane == 0 && r0 + r < m) y[(u64)(r0 + r) * n + j] = t;
    }
}

// The QKV projection of a few rows with dec_qkv_store's epilogue: for each pair (head h, i <
// hd/2) of columns c0 = h·hd + i, c1 = c0 + hd/2 of the product [m, (nh + 2·nkv)·hd], the
// product rounded to bf16 (the GEMV's output), then + bias (f32), RoPE where `inv_freq` is not
// null, q to q_out and k, v into the cache at each row's slot — the bits of the GEMV followed by
// dec_qkv_store. A block of 8 warps takes 4 pairs: warp w < 4 computes c0 of pair 4·blockIdx.x + w,
// warp w + 4 its c1 (handed over in shared memory); blockIdx.y picks DEC_WQ_ROWS rows.
// `xr0`: the row of `x` that holds row r0 (r0 itself for x in global memory, 0 for rows staged
// in shared memory by dec_ln_prologue).
template <int FMT>
__device__ __forceinline__ void dec_gemv_qkv_t(bf16* __restrict__ q_out, bf16* __restrict__ kc, bf16* __restrict__ vc,
                                               const bf16* __restrict__ x, int xr0, const unsigned char* __restrict__ w,
                                               const float* __restrict__ s, const bf16* __restrict__ bias, const double* __restrict__ inv_freq,
                                               const int* __restrict__ pos, const int* __restrict__ slot, int m, int k, int nh, int nkv, int hd) {
    __shared__ float other[4][DEC_WQ_ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.y * DEC_WQ_ROWS;
    const int half = hd >> 1, pair = blockIdx.x * 4 + (warp & 3), h = pair / half, i = pair - h * half;
    const int c0 = h * hd + i, j = c0 + (warp >> 2) * half;
    float acc[DEC_WQ_ROWS];
    dec_gemv_dot<FMT>(acc, x, w, j, lane, xr0, m - r0 + xr0, k);
    const float sj = s ? s[j] : 1.0f;
    float mine[DEC_WQ_ROWS];
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) mine[r] = bf2f(f2bf(warp_sum(acc[r]) * sj));
    if (warp >= 4 && lane == 0) {
#pragma unroll
        for (int r = 0; r < DEC_WQ_ROWS; r++) other[warp - 4][r] = mine[r];
    }
    __syncthreads();
    if (warp >= 4 || lane != 0) return;
    const float b0 = bias ? bf2f(bias[c0]) : 0.0f, b1 = bias ? bf2f(bias[c0 + half]) : 0.0f;
#pragma unroll
    for (int r = 0; r < DEC_WQ_ROWS; r++) {
        if (r0 + r >= m) break;
        const int row = r0 + r;
        float a = mine[r], b = other[warp][r];
        if (bias) {
            a += b0;
            b += b1;
        }
        if (inv_freq && h < nh + nkv) {
            double sn, cs;
            sincos((double)pos[row] * inv_freq[i], &sn, &cs);
            const float cf = (float)cs, sf = (float)sn;
            const float a2 = a * cf - b * sf, b2 = b * cf + a * sf;
            a = a2;
            b = b2;
        }
        const u64 sl = (u64)slot[row];
        bf16* dst;
        if (h < nh) {
            dst = q_out + (u64)row * nh * hd + h * hd;
        } else if (h < nh + nkv) {
            dst = kc + (sl * nkv + (h - nh)) * hd;
        } else {
            dst = vc + (sl * nkv + (h - nh - nkv)) * hd;
        }
        dst[i] = f2bf(a);
        dst[i + half] = f2bf(b);
    }
}

#define DEC_GEMV_QKV(NAME, FMT)                                                                                                          \
    extern "C" __global__ void NAME(bf16* __restrict__ q_out, bf16* __restrict__ kc, bf16* __restrict__ vc, const bf16* __restrict__ x, \
                                    const unsigned char* __restrict__ w, const float* __restrict__ s, const bf16* __restrict__ bias,    \
                                    const double* __restrict__ inv_freq, const int* __restrict__ pos, const int* __restrict__ slot,     \
                                    int m, int k, int nh, int nkv, int hd) {                                                            \
        dec_gemv_qkv_t<FMT>(q_out, kc, vc, x, blockIdx.y * DEC_WQ_ROWS, w, s, bias, inv_freq, pos, slot, m, k, nh, nkv, hd);            \
    }
DEC_GEMV_QKV(dec_gemv_qkv_i8, 0)
DEC_GEMV_QKV(dec_gemv_qkv_e4m3, 1)
DEC_GEMV_QKV(dec_gemv_qkv_bf16, 2)

// dec_gemv_qkv_t on the rows dec_ln_prologue makes (k = c): GPT-2's residual + LayerNorm, the
// QKV GEMV and its epilogue in one launch. Dynamic shared memory: DEC_WQ_ROWS · k bf16.
template <int FMT>
__device__ __forceinline__ void dec_gemv_qkv_ln_t(bf16* __restrict__ q_out, bf16* __restrict__ kc, bf16* __restrict__ vc, float* xo,
                                                  const float* __restrict__ x, const bf16* __restrict__ ry, const bf16* __restrict__ ryb,
                                                  const bf16* __restrict__ lw, const bf16* __restrict__ lb, const unsigned char* __restrict__ w,
                                                  const float* __restrict__ s, const bf16* __restrict__ bias, const double* __restrict__ inv_freq,
                                                  const int* __restrict__ pos, const int* __restrict__ slot, int m, int k, int nh, int nkv,
                                                  int hd) {
    extern __shared__ __align__(16) unsigned char dec_dsm[];
    bf16* hs = reinterpret_cast<bf16*>(dec_dsm);
    dec_ln_prologue(hs, xo, x, ry, ryb, lw, lb, blockIdx.y * DEC_WQ_ROWS, m, k);
    dec_gemv_qkv_t<FMT>(q_out, kc, vc, hs, 0, w, s, bias, inv_freq, pos, slot, m, k, nh, nkv, hd);
}

#define DEC_GEMV_QKV_LN(NAME, FMT)                                                                                                       \
    extern "C" __global__ void NAME(bf16* __restrict__ q_out, bf16* __restrict__ kc, bf16* __restrict__ vc, float* xo,                  \
                                    const float* __restrict__ x, const bf16* __restrict__ ry, const bf16* __restrict__ ryb,             \
                                    const bf16* __restrict__ lw, const bf16* __restrict__ lb, const unsigned char* __restrict__ w,      \
                                    const float* __restrict__ s, const bf16* __restrict__ bias, const double* __restrict__ inv_freq,    \
                                    const int* __restrict__ pos, const int* __restrict__ slot, int m, int k, int nh, int nkv, int hd) { \
        dec_gemv_qkv_ln_t<FMT>(q_out, kc, vc, xo, x, ry, ryb, lw, lb, w, s, bias, inv_freq, pos, slot, m, k, nh, nkv, hd);              \
    }
DEC_GEMV_QKV_LN(dec_gemv_qkv_ln_i8, 0)
DEC_GEMV_QKV_LN(dec_gemv_qkv_ln_e4m3, 1)
DEC_GEMV_QKV_LN(dec_gemv_qkv_ln_bf16, 2)

// wd[k', j] = bf16(s[j] · w[j, k'])  ([k, n], the layout cuBLAS takes): the quantized weight
// widened for a step of many rows (prefill), where the GEMM is compute-bound.
extern "C" __global__ void dec_wq_dequant(bf16* __restrict__ wd, const unsigned char* __restrict__ w, const float* __restrict__ s, int k, int n,
                                          int fmt) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)k * n) return;
    const u64 kk = i / n, j = i - kk * n;
    const u32 b = w[j * k + kk];
    const float v = fmt == 0 ? (float)(signed char)b : dec_e4m3(b);
    wd[i] = f2bf(v * s[j]);
}
