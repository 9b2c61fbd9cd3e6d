// kernels/cuda/llama.cu — the non-GEMM, non-attention kernels of the GPU LLaMA family
// (kernels/src/cuda/llama/ops.rs has the Rust wrappers and the exact contracts): token embedding
// without positions, RMSNorm forward and backward, RoPE (rotate-half, from a host-made cos/sin
// table) and its transpose, SwiGLU forward and backward.
//
// Determinism: no atomics; each output element is written by one thread, and every reduction
// runs in an order fixed by the shapes alone (lane-strided partial sums of 4-column chunks, then a fixed xor tree;
// column sums per row block in ascending rows, then ops.cu's colsum_finish).
//
// Matching the CPU ops (kernels/src/ops/{rmsnorm,rope,swiglu}.rs): the module is compiled with
// --use_fast_math, so the elementwise formulas go through explicit round-to-nearest intrinsics in
// the CPU's operation order; the row sums differ from the CPU's by their order (a few ulp), and
// outputs are rounded to bf16 where the GPU model keeps bf16 activations.

#define LFADD(a, b) __fadd_rn((a), (b))
#define LFSUB(a, b) __fsub_rn((a), (b))
#define LFMUL(a, b) __fmul_rn((a), (b))
#define LFDIV(a, b) __fdiv_rn((a), (b))
#define LNAN __int_as_float(0x7fc00000)

__device__ __forceinline__ u64 l_gtid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }

// ---------------------------------------------------------------------------------------------
// Embedding (no positions: RoPE rotates q and k instead)
// ---------------------------------------------------------------------------------------------

// x[r, j] = wte[tokens[r], j] (f32). A token ≥ vocab gives a NaN row (no stray read).
extern "C" __global__ void embed_tokens(float* __restrict__ x, const u32* __restrict__ tokens, const bf16* __restrict__ wte, u64 rows,
                                        int c, u32 vocab) {
    const u64 i = l_gtid();
    if (i >= rows * (u64)c) return;
    const u64 r = i / (u64)c;
    const int j = (int)(i - r * (u64)c);
    const u32 tok = tokens[r];
    x[i] = tok >= vocab ? LNAN : bf2f(wte[(u64)tok * c + j]);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (one warp per row; blockDim = 32 × rows per block). Rows are c f32 with c a multiple of
// 4 and 16-byte aligned (the wrappers check), read and written 4 columns at a time: lane l takes
// the 4-column chunks q ≡ l (mod 32), ascending.
// ---------------------------------------------------------------------------------------------

// Σ_i f(i) over a row of c: lane l sums its chunks ascending (the 4 columns of a chunk in order),
// then the xor tree. Float addition is commutative, so every lane ends with the same bits.
// f(q) gives chunk q's 4 terms.
template <typename F>
__device__ __forceinline__ float l_row_sum4(int c, F f) {
    const int lane = threadIdx.x & 31;
    float a = 0.0f;
    for (int q = lane; q < (c >> 2); q += 32) {
        const float4 v = f(q);
        a = LFADD(LFADD(LFADD(LFADD(a, v.x), v.y), v.z), v.w);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = LFADD(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

__device__ __forceinline__ float4 l_w4(const bf16* __restrict__ w, int q) {
    return make_float4(bf2f(w[4 * q]), bf2f(w[4 * q + 1]), bf2f(w[4 * q + 2]), bf2f(w[4 * q + 3]));
}

// Four bf16 (one 8-byte store) from four floats.
__device__ __forceinline__ void l_store_bf16x4(bf16* p, float a, float b, float c, float d) {
    *(uint2*)p = make_uint2(((u32)f2bf(b) << 16) | f2bf(a), ((u32)f2bf(d) << 16) | f2bf(c));
}

// One warp's row of RMSNorm: rstd = 1/√(Σx²/c + ε) (returned), o = bf16((x · rstd) · w).
// The one implementation of the row, for training (rmsnorm_fwd) and decoding (decode.cu).
__device__ __forceinline__ float l_rmsnorm_row(bf16* __restrict__ o, const float4* xr, const bf16* __restrict__ w, int c, float eps, int lane) {
    const float ss = l_row_sum4(c, [&](int q) {
        const float4 v = xr[q];
        return make_float4(LFMUL(v.x, v.x), LFMUL(v.y, v.y), LFMUL(v.z, v.z), LFMUL(v.w, v.w));
    });
    const float r = LFDIV(1.0f, __fsqrt_rn(LFADD(LFDIV(ss, (float)c), eps)));
    for (int q = lane; q < (c >> 2); q += 32) {
        const float4 v = xr[q], wv = l_w4(w, q);
        l_store_bf16x4(o + 4 * q, LFMUL(LFMUL(v.x, r), wv.x), LFMUL(LFMUL(v.y, r), wv.y), LFMUL(LFMUL(v.z, r), wv.z),
                       LFMUL(LFMUL(v.w, r), wv.w));
    }
    return r;
}

// rstd = 1/√(Σx²/c + ε),  out = bf16((x · rstd) · w)   (ops::rmsnorm::rmsnorm_forward).
extern "C" __global__ void rmsnorm_fwd(bf16* __restrict__ out, float* __restrict__ rstd, const float* __restrict__ x, const bf16* __restrict__ w,
                                       int n, int c, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;  // warp-uniform
    const float4* xr = (const float4*)(x + (u64)row * c);
    const float r = l_rmsnorm_row(out + (u64)row * c, xr, w, c, eps, lane);
    if (lane == 0) rstd[row] = r;
}

// With g = dout · w and k = (rstd² · Σ g·x) / c:  dx += rstd · (g − x · k),  dxb = bf16(dx)
// (ops::rmsnorm::rmsnorm_backward's input gradient; `dxb` is the bf16 copy the next linear
// layer's GEMMs read).
extern "C" __global__ void rmsnorm_bwd_dx(float* __restrict__ dx, bf16* __restrict__ dxb, const float* __restrict__ dout,
                                          const float* __restrict__ x, const bf16* __restrict__ w, const float* __restrict__ rstd, int n, int c) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;  // warp-uniform
    const u64 off = (u64)row * c;
    const float4* xr = (const float4*)(x + off);
    const float4* dr = (const float4*)(dout + off);
    float4* dxr = (float4*)(dx + off);
    const float rs = rstd[row];
    const float dot = l_row_sum4(c, [&](int q) {
        const float4 d = dr[q], v = xr[q], wv = l_w4(w, q);
        return make_float4(LFMUL(LFMUL(d.x, wv.x), v.x), LFMUL(LFMUL(d.y, wv.y), v.y), LFMUL(LFMUL(d.z, wv.z), v.z),
                           LFMUL(LFMUL(d.w, wv.w), v.w));
    });
    const float k = LFDIV(LFMUL(LFMUL(rs, rs), dot), (float)c);
    for (int q = lane; q < (c >> 2); q += 32) {
        const float4 d = dr[q], v = xr[q], wv = l_w4(w, q), o = dxr[q];
        float4 nv;
        nv.x = LFADD(o.x, LFMUL(rs, LFSUB(LFMUL(d.x, wv.x), LFMUL(v.x, k))));
        nv.y = LFADD(o.y, LFMUL(rs, LFSUB(LFMUL(d.y, wv.y), LFMUL(v.y, k))));
        nv.z = LFADD(o.z, LFMUL(rs, LFSUB(LFMUL(d.z, wv.z), LFMUL(v.z, k))));
        nv.w = LFADD(o.w, LFMUL(rs, LFSUB(LFMUL(d.w, wv.w), LFMUL(v.w, k))));
        dxr[q] = nv;
        l_store_bf16x4(dxb + off + 4 * q, nv.x, nv.y, nv.z, nv.w);
    }
}

// dweight pass 1: scratch[rb, j] = Σ_{rows r of block rb, ascending} (dout[r, j] · x[r, j]) · rstd[r]
// (ops::rmsnorm's weight gradient term); ops.cu's colsum_finish adds the blocks in its fixed order.
extern "C" __global__ void rmsnorm_bwd_dw_partial(float* __restrict__ scratch, const float* __restrict__ dout, const float* __restrict__ x,
                                                  const float* __restrict__ rstd, int n, int c, int rows_per) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    const int rb = blockIdx.y;
    const int r0 = rb * rows_per;
    const int r1 = min(r0 + rows_per, n);
    float a = 0.0f;
    for (int r = r0; r < r1; r++) a = LFADD(a, LFMUL(LFMUL(dout[(u64)r * c + j], x[(u64)r * c + j]), rstd[r]));
    scratch[(u64)rb * c + j] = a;
}

// ---------------------------------------------------------------------------------------------
// RoPE: in place on the first `heads` head vectors (q heads, then k heads) of each row of `row`
// bf16 columns; position = row mod t. Each rotation pair (x[i], x[i + half]) becomes
//   (a, b) ← (a·cos − b·s, b·cos + a·s),  s = sign · sin   (sign −1: the transpose, for dq/dk)
// cos/sin are the CPU's RopeTable ([t, half] f32), so the rotation is the CPU's, rounded to bf16.
// One block per row (grid.x = rows); a thread takes two adjacent pairs (i, i + 1) at a time, as
// 4-byte loads and stores (`row` and `half` even: the wrapper checks).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void l_rot(float a, float b, float cs, float s, float& na, float& nb) {
    na = LFSUB(LFMUL(a, cs), LFMUL(b, s));
    nb = LFADD(LFMUL(b, cs), LFMUL(a, s));
}

extern "C" __global__ void rope_rotate(bf16* __restrict__ qkv, const float* __restrict__ cosv, const float* __restrict__ sinv, int t, int row,
                                       int heads, int half, float sign) {
    const u64 r = blockIdx.x;
    const int pos = (int)(r % (u64)t);
    const int hp = half >> 1;  // pairs of adjacent rotations a head
    const float2* cr = (const float2*)(cosv + (u64)pos * half);
    const float2* sr = (const float2*)(sinv + (u64)pos * half);
    bf16* base = qkv + r * (u64)row;
    for (int e = threadIdx.x; e < heads * hp; e += blockDim.x) {
        const int h = e / hp, j = e - h * hp;  // rotations 2j, 2j + 1 of head h
        u32* pa = (u32*)(base + (u64)h * 2 * half) + j;
        u32* pb = (u32*)(base + (u64)h * 2 * half + half) + j;
        const u32 va = *pa, vb = *pb;
        const float2 cs = cr[j], sn = sr[j];
        const float s0 = LFMUL(sign, sn.x), s1 = LFMUL(sign, sn.y);
        float a0, b0, a1, b1;
        l_rot(__uint_as_float(va << 16), __uint_as_float(vb << 16), cs.x, s0, a0, b0);
        l_rot(__uint_as_float(va & 0xffff0000u), __uint_as_float(vb & 0xffff0000u), cs.y, s1, a1, b1);
        *pa = ((u32)f2bf(a1) << 16) | f2bf(a0);
        *pb = ((u32)f2bf(b1) << 16) | f2bf(b0);
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: out = (gate · σ(gate)) · up, σ(x) = 1/(1 + e^{−x}) (ops::swiglu). A thread takes 8
// elements (16-byte loads and stores; the wrappers check the buffers are 16-byte aligned), the
// last, partial group of 8 element by element.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float l_sigmoid(float x) { return LFDIV(1.0f, LFADD(1.0f, __expf(-x))); }

// 8 bf16 in a uint4 <-> element k (0..7).
__device__ __forceinline__ float l_lane8(const uint4& v, int k) {
    const u32 w = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
    return (k & 1) ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
}
__device__ __forceinline__ void l_set8(uint4& v, int k, float f) {
    u32& w = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
    const u32 b = f2bf(f);
    w = (k & 1) ? ((w & 0xffffu) | (b << 16)) : ((w & 0xffff0000u) | b);
}

__device__ __forceinline__ float l_swiglu(float g, float u) { return LFMUL(LFMUL(g, l_sigmoid(g)), u); }

extern "C" __global__ void swiglu_fwd(bf16* __restrict__ out, const bf16* __restrict__ gate, const bf16* __restrict__ up, u64 len) {
    const u64 i0 = l_gtid() * 8;
    if (i0 >= len) return;
    if (i0 + 8 <= len) {
        const uint4 g = *(const uint4*)(gate + i0), u = *(const uint4*)(up + i0);
        uint4 o = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < 8; k++) l_set8(o, k, l_swiglu(l_lane8(g, k), l_lane8(u, k)));
        *(uint4*)(out + i0) = o;
    } else {
        for (u64 i = i0; i < len; i++) out[i] = f2bf(l_swiglu(bf2f(gate[i]), bf2f(up[i])));
    }
}

// With s = σ(gate):  dgate = ((dout · up) · s) · (1 + gate · (1 − s)),  dup = (dout · gate) · s
// (overwritten, not accumulated: each micro-batch's buffers are fresh).
__device__ __forceinline__ void l_swiglu_bwd(float d, float g, float u, float& dg, float& du) {
    const float s = l_sigmoid(g);
    dg = LFMUL(LFMUL(LFMUL(d, u), s), LFADD(1.0f, LFMUL(g, LFSUB(1.0f, s))));
    du = LFMUL(LFMUL(d, g), s);
}

extern "C" __global__ void swiglu_bwd(bf16* __restrict__ dgate, bf16* __restrict__ dup, const bf16* __restrict__ dout, const bf16* __restrict__ gate,
                                      const bf16* __restrict__ up, u64 len) {
    const u64 i0 = l_gtid() * 8;
    if (i0 >= len) return;
    if (i0 + 8 <= len) {
        const uint4 d = *(const uint4*)(dout + i0), g = *(const uint4*)(gate + i0), u = *(const uint4*)(up + i0);
        uint4 og = make_uint4(0u, 0u, 0u, 0u), ou = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float dg, du;
            l_swiglu_bwd(l_lane8(d, k), l_lane8(g, k), l_lane8(u, k), dg, du);
            l_set8(og, k, dg);
            l_set8(ou, k, du);
        }
        *(uint4*)(dgate + i0) = og;
        *(uint4*)(dup + i0) = ou;
    } else {
        for (u64 i = i0; i < len; i++) {
            float dg, du;
            l_swiglu_bwd(bf2f(dout[i]), bf2f(gate[i]), bf2f(up[i]), dg, du);
            dgate[i] = f2bf(dg);
            dup[i] = f2bf(du);
        }
    }
}
