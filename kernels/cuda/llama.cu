// kernels/cuda/llama.cu — the non-GEMM, non-attention kernels of the GPU LLaMA family
// (kernels/src/cuda/llama/ops.rs has the Rust wrappers and the exact contracts): token embedding
// without positions, RMSNorm forward and backward, RoPE (rotate-half, from a host-made cos/sin
// table) and its transpose, SwiGLU forward and backward.
//
// Determinism: no atomics; each output element is written by one thread, and every reduction
// runs in an order fixed by the shapes alone (lane-strided partial sums, then a fixed xor tree;
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
// RMSNorm (one warp per row; blockDim = 32 × rows per block)
// ---------------------------------------------------------------------------------------------

// Σ_i f(i) over a row of c: lane l sums i ≡ l (mod 32) ascending, then the xor tree. Float
// addition is commutative, so every lane ends with the same bits.
template <typename F>
__device__ __forceinline__ float l_row_sum(int c, F f) {
    const int lane = threadIdx.x & 31;
    float a = 0.0f;
    for (int i = lane; i < c; i += 32) a = LFADD(a, f(i));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = LFADD(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// rstd = 1/√(Σx²/c + ε),  out = bf16((x · rstd) · w)   (ops::rmsnorm::rmsnorm_forward).
extern "C" __global__ void rmsnorm_fwd(bf16* __restrict__ out, float* __restrict__ rstd, const float* __restrict__ x, const bf16* __restrict__ w,
                                       int n, int c, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;  // warp-uniform
    const float* xr = x + (u64)row * c;
    const float ss = l_row_sum(c, [&](int i) { return LFMUL(xr[i], xr[i]); });
    const float r = LFDIV(1.0f, __fsqrt_rn(LFADD(LFDIV(ss, (float)c), eps)));
    bf16* o = out + (u64)row * c;
    for (int i = lane; i < c; i += 32) o[i] = f2bf(LFMUL(LFMUL(xr[i], r), bf2f(w[i])));
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
    const float* xr = x + off;
    const float* dr = dout + off;
    const float rs = rstd[row];
    const float dot = l_row_sum(c, [&](int i) { return LFMUL(LFMUL(dr[i], bf2f(w[i])), xr[i]); });
    const float k = LFDIV(LFMUL(LFMUL(rs, rs), dot), (float)c);
    for (int i = lane; i < c; i += 32) {
        const float g = LFMUL(dr[i], bf2f(w[i]));
        const float v = LFADD(dx[off + i], LFMUL(rs, LFSUB(g, LFMUL(xr[i], k))));
        dx[off + i] = v;
        dxb[off + i] = f2bf(v);
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
// bf16 columns; position = row mod t. One thread per rotation pair (x[i], x[i + half]):
//   (a, b) ← (a·cos − b·s, b·cos + a·s),  s = sign · sin   (sign −1: the transpose, for dq/dk)
// cos/sin are the CPU's RopeTable ([t, half] f32), so the rotation is the CPU's, rounded to bf16.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void rope_rotate(bf16* __restrict__ qkv, const float* __restrict__ cosv, const float* __restrict__ sinv, u64 rows,
                                       int t, int row, int heads, int half, float sign) {
    const u64 e = l_gtid();
    const u64 per_row = (u64)heads * half;
    if (e >= rows * per_row) return;
    const u64 r = e / per_row;
    const int rem = (int)(e - r * per_row);
    const int h = rem / half, i = rem - h * half;
    const int pos = (int)(r % (u64)t);
    const float cs = cosv[pos * half + i];
    const float s = LFMUL(sign, sinv[pos * half + i]);
    bf16* p = qkv + r * (u64)row + (u64)h * 2 * half;
    const float a = bf2f(p[i]), b = bf2f(p[i + half]);
    p[i] = f2bf(LFSUB(LFMUL(a, cs), LFMUL(b, s)));
    p[i + half] = f2bf(LFADD(LFMUL(b, cs), LFMUL(a, s)));
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: out = (gate · σ(gate)) · up, σ(x) = 1/(1 + e^{−x}) (ops::swiglu)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float l_sigmoid(float x) { return LFDIV(1.0f, LFADD(1.0f, __expf(-x))); }

extern "C" __global__ void swiglu_fwd(bf16* __restrict__ out, const bf16* __restrict__ gate, const bf16* __restrict__ up, u64 len) {
    const u64 i = l_gtid();
    if (i >= len) return;
    const float g = bf2f(gate[i]);
    out[i] = f2bf(LFMUL(LFMUL(g, l_sigmoid(g)), bf2f(up[i])));
}

// With s = σ(gate):  dgate = ((dout · up) · s) · (1 + gate · (1 − s)),  dup = (dout · gate) · s
// (overwritten, not accumulated: each micro-batch's buffers are fresh).
extern "C" __global__ void swiglu_bwd(bf16* __restrict__ dgate, bf16* __restrict__ dup, const bf16* __restrict__ dout, const bf16* __restrict__ gate,
                                      const bf16* __restrict__ up, u64 len) {
    const u64 i = l_gtid();
    if (i >= len) return;
    const float d = bf2f(dout[i]), g = bf2f(gate[i]), u = bf2f(up[i]);
    const float s = l_sigmoid(g);
    dgate[i] = f2bf(LFMUL(LFMUL(LFMUL(d, u), s), LFADD(1.0f, LFMUL(g, LFSUB(1.0f, s)))));
    dup[i] = f2bf(LFMUL(LFMUL(d, g), s));
}
