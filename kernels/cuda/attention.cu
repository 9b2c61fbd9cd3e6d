// Fused causal attention (FlashAttention-2 style) over the fused qkv buffer, bf16 in/out with f32
// accumulation on tensor cores (mma.sync.m16n8k16 bf16, fragments loaded with ldmatrix).
//
// Layout (same as kernels/src/ops/attention.rs and, grouped, kernels/src/ops/gqa.rs): qkv
// [B, T, C + 2·KV] with KV = NKV·64; for token (b, t) q = cols 0..C, k = C..C+KV, v = C+KV..C+2KV;
// query head h uses cols h*64..(h+1)*64 of q and key/value head h / (NH/NKV) of k and v (NKV = NH
// is multi-head attention: qkv [B, T, 3C]). y and dy are [B, T, C] with head h at cols h*64. lse
// and delta are [B, NH, T] f32. Head dim is fixed at 64.
//
// Grouped-query attention (NKV < NH): the forward and dQ kernels run per query head, reading its
// group's K/V; the dK/dV kernel runs per key/value head and adds its group's query heads in
// ascending order (head j's query tiles, in order, before head j + 1's) into the same registers,
// so the group sum needs no atomics and no second pass. With NKV = NH the loops are exactly those
// of multi-head attention (same bits).
//
// Every CTA has 4 warps (128 threads) and works on one 64-row tile of one (b, head) (grid.y).
// Each warp owns 16 rows of the tile (the M=16 of the mma). Tiles past T are zero-filled in
// shared memory and masked, so any T >= 1 works. The backward kernels also come in the `_r2`
// layout (the default; TESSERA_ATTN_BWD on the Rust side): each warp owns two blocks of 16 rows
// (128 rows a CTA), so every fragment read from shared memory feeds two mmas, and S/dP are formed
// in 4 column pieces of 16 to fit the registers. It gives the same bits as the 16-row layout: every
// output element sums the same products in the same order (see the RB building blocks below).
//
// Two variants of every kernel (same parameters): the default one feeds P and dS to the tensor
// cores as plain bf16 (one mma per product, as FlashAttention does) and takes delta = rowsum(dy o y)
// from the bf16 output; the `_precise` one (selected on the Rust side by TESSERA_ATTN_PRECISE=1)
// feeds them as two bf16 halves (hi + lo remainder, two mmas per product) and computes delta as
// rowsum(P o dP) in f32 during the dQ pass, which keeps the outputs at f32-reference accuracy.
//
// K/V (forward, dQ) and Q/dY/lse/delta (dK/dV) tiles are double-buffered in shared memory and
// loaded with cp.async: tile i+1 streams in while tile i is computed. One barrier per tile: at the
// top of iteration i every thread has waited for its own copies of tile i, and the barrier makes
// them visible to all and guarantees that nobody still reads the other buffer (tile i-1), which the
// prefetch of tile i+1 issued right after it overwrites.
//
// Determinism: no atomics. Each output element is written by exactly one thread, and every
// reduction (over key tiles, query tiles, the 4 lanes of a quad, a warp) runs in a fixed order.
//
// Softmax runs in the log2 domain: x = s * scale * log2(e), p = exp2(x - m), each as one FFMA
// and one exp2. The saved lse is in the same units, the base-2 log-sum-exp of x: lse = m + log2(l)
// (the natural log-sum-exp of the scaled scores is lse * ln 2).
//
// Masks cost instructions on every element, so only the tiles that need them apply them: the
// diagonal tile (keys above the row) and, in the dK/dV pass, a last query tile cut by T. Every
// other tile is entirely valid.

#define ATT_HD 64        // head dim (the only one supported)
#define ATT_TILE 64      // rows per tile (queries or keys)
#define ATT_LD 72        // shared-memory row stride in bf16: 144 bytes, so the 8 rows one ldmatrix
                         // phase reads fall on 8 distinct groups of 4 banks (no conflicts)
#define ATT_THREADS 128
#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

// ---------------------------------------------------------------------------------------------
// Small PTX helpers
// ---------------------------------------------------------------------------------------------

// 32-bit shared-state-space address of a generic pointer into shared memory (for ldmatrix).
__device__ __forceinline__ u32 att_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Where one (sequence, query head)'s q, k and v columns start in qkv [B, T, C + 2·KV], and the
// row stride: head h reads key/value head h / (nh / nkv).
struct AttHeads {
    size_t q, k, v;  // element offsets of row 0 of this head's columns
    int ld;          // qkv row stride
};
__device__ __forceinline__ AttHeads att_heads(int bi, int h, int t, int c, int nh, int nkv) {
    AttHeads H;
    H.ld = c + 2 * nkv * ATT_HD;
    const size_t row0 = (size_t)bi * t * H.ld;
    const int kvh = h / (nh / nkv);
    H.q = row0 + (size_t)h * ATT_HD;
    H.k = row0 + c + (size_t)kvh * ATT_HD;
    H.v = H.k + (size_t)nkv * ATT_HD;
    return H;
}

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even (same as f2bf for
// finite values).
__device__ __forceinline__ u32 att_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// D(16x8 f32) += A(16x16 bf16, row-major) * B(16x8 bf16, "col": B[k][n]).
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", .bf16), with g = lane / 4 and
// q = lane % 4:
//   A: a[0] = A[g][2q..2q+1], a[1] = A[g+8][2q..2q+1], a[2] = A[g][2q+8..+9], a[3] = A[g+8][2q+8..+9]
//   B: b0 = B[2q..2q+1][g],   b1 = B[2q+8..2q+9][g]
//   C/D: d[0], d[1] = D[g][2q], D[g][2q+1];   d[2], d[3] = D[g+8][2q], D[g+8][2q+1]
__device__ __forceinline__ void att_mma(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix x4: lanes 8i..8i+7 give the 8 row addresses (16 contiguous bytes each) of matrix i;
// r[i] receives matrix i's element [g][2q..2q+1] (or, with .trans, [2q][g] and [2q+1][g]).
__device__ __forceinline__ void att_ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void att_ldsm_x4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// ---------------------------------------------------------------------------------------------
// Fragment loaders from a shared tile s[row][col] (row stride ATT_LD bf16)
// ---------------------------------------------------------------------------------------------

// Shared-memory addresses are 32-bit (the shared state space) and built from a tile's base, this
// lane's offset (computed once per kernel, below) and a compile-time offset that the assembler
// folds into the ldmatrix instruction: no address arithmetic in the inner loops.
#define ATT_OFF(r, col) ((u32)(((r) * ATT_LD + (col)) * 2))
#define ATT_BUF_BYTES ((u32)(ATT_TILE * ATT_LD * 2))

// This lane's byte offsets for the two ldmatrix x4 address patterns (lanes 8i..8i+7 address the
// 8 rows of matrix i):
//   a:  row (lane & 7) + ((lane >> 3) & 1) * 8, col (lane >> 4) * 8   (A fragments, and B from [k][n])
//   nk: row (lane & 7) + (lane >> 4) * 8,       col ((lane >> 3) & 1) * 8   (B from [n][k])
struct AttLane {
    u32 a, nk;
};
__device__ __forceinline__ AttLane att_lane(int lane) {
    AttLane L;
    L.a = ATT_OFF((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);
    L.nk = ATT_OFF((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
    return L;
}

// A fragment of the 16x16 block at (r0, c0) of a row-major tile (A[m][k] = s[r0+m][c0+k]).
// Matrices: 0 = rows r0..+7 / cols c0..+7 (a[0]), 1 = rows +8 (a[1]), 2 = cols +8 (a[2]), 3 = both (a[3]).
__device__ __forceinline__ void att_load_a(u32* a, u32 tile, int r0, int c0, const AttLane& L) {
    att_ldsm_x4(a, tile + L.a + ATT_OFF(r0, c0));
}

// B fragments for two n-tiles (n0..n0+7 and n0+8..n0+15) and k0..k0+15 when the tile is stored
// [n][k] (B[k][n] = s[n][k], e.g. K rows for S = Q K^T). b[0], b[1] = n-tile n0; b[2], b[3] = n0+8.
// Matrices: 0 = rows n0..+7 / cols k0..+7, 1 = cols k0+8, 2 = rows n0+8, 3 = both.
__device__ __forceinline__ void att_load_b_nk(u32* b, u32 tile, int n0, int k0, const AttLane& L) {
    att_ldsm_x4(b, tile + L.nk + ATT_OFF(n0, k0));
}

// B fragments for two n-tiles and k0..k0+15 when the tile is stored [k][n] (B[k][n] = s[k][n],
// e.g. V rows for O = P V), transposed by ldmatrix. b[0], b[1] = n-tile n0; b[2], b[3] = n0+8.
// Matrices: 0 = rows k0..+7 / cols n0..+7, 1 = rows k0+8, 2 = cols n0+8, 3 = both.
__device__ __forceinline__ void att_load_b_kn(u32* b, u32 tile, int k0, int n0, const AttLane& L) {
    att_ldsm_x4_t(b, tile + L.a + ATT_OFF(k0, n0));
}

// Converts a 16x64 f32 accumulator (8 n-tiles of C fragments, row-major in registers) into the A
// fragments of its 16-column chunk kc (columns 16kc..16kc+15) as a bf16 pair hi + lo: hi = bf16(x),
// lo = bf16(x - hi), so hi + lo carries ~16 mantissa bits. The C layout of n-tiles 2kc and 2kc+1 is
// exactly the A layout of that chunk. (A single bf16 P or dS would cost ~3e-3 absolute error on
// outputs that cancel; the second mma per product keeps them at f32-reference accuracy.)
__device__ __forceinline__ void att_split(u32& hi, u32& lo, float x0, float x1) {
    hi = att_pack(x0, x1);
    lo = att_pack(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}
__device__ __forceinline__ void att_c_to_a_split(u32* hi, u32* lo, const float (*c)[4], int kc) {
    att_split(hi[0], lo[0], c[2 * kc][0], c[2 * kc][1]);
    att_split(hi[1], lo[1], c[2 * kc][2], c[2 * kc][3]);
    att_split(hi[2], lo[2], c[2 * kc + 1][0], c[2 * kc + 1][1]);
    att_split(hi[3], lo[3], c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// acc[16x64] += A[16x64] * B where B[k][n] = s[n][k] (s holds 64 rows n, 64 cols k): acc = A s^T.
__device__ __forceinline__ void att_gemm_abt(float (*acc)[4], const u32 (*a)[4], u32 s, const AttLane& L) {
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
#pragma unroll
        for (int np = 0; np < 4; np++) {
            u32 b[4];
            att_load_b_nk(b, s, np * 16, kc * 16, L);
            att_mma(acc[2 * np], a[kc], b[0], b[1]);
            att_mma(acc[2 * np + 1], a[kc], b[2], b[3]);
        }
    }
}

// acc[16x64] += A(chunk kc: 16x16) * s[16kc..16kc+15][0..63] for one 16-wide k chunk, with A taken
// from the f32 accumulator c (columns 16kc..16kc+15): as one bf16 (PRECISE = false) or as the pair
// hi + lo (PRECISE = true, two mmas).
template <bool PRECISE>
__device__ __forceinline__ void att_gemm_cb_chunk(float (*acc)[4], const float (*c)[4], u32 s, int kc, const AttLane& L) {
    u32 hi[4], lo[4];
    if (PRECISE) {
        att_c_to_a_split(hi, lo, c, kc);
    } else {
        hi[0] = att_pack(c[2 * kc][0], c[2 * kc][1]);
        hi[1] = att_pack(c[2 * kc][2], c[2 * kc][3]);
        hi[2] = att_pack(c[2 * kc + 1][0], c[2 * kc + 1][1]);
        hi[3] = att_pack(c[2 * kc + 1][2], c[2 * kc + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < 4; np++) {
        u32 b[4];
        att_load_b_kn(b, s, kc * 16, np * 16, L);
        att_mma(acc[2 * np], hi, b[0], b[1]);
        att_mma(acc[2 * np + 1], hi, b[2], b[3]);
        if (PRECISE) {
            att_mma(acc[2 * np], lo, b[0], b[1]);
            att_mma(acc[2 * np + 1], lo, b[2], b[3]);
        }
    }
}

// Copies rows row0..row0+63 (64 bf16 columns starting at g, global row stride ldg) into the
// shared tile s; rows >= t are zero-filled. 16-byte loads: g and ldg must keep 16-byte alignment.
__device__ __forceinline__ void att_load_tile(bf16* s, const bf16* __restrict__ g, int row0, int t, int ldg) {
#pragma unroll
    for (int k = 0; k < ATT_TILE * 8 / ATT_THREADS; k++) {
        int idx = threadIdx.x + k * ATT_THREADS;
        int r = idx >> 3, ch = idx & 7;
        uint4 v = {0u, 0u, 0u, 0u};
        if (row0 + r < t) v = *(const uint4*)(g + (size_t)(row0 + r) * ldg + ch * 8);
        *(uint4*)(s + r * ATT_LD + ch * 8) = v;
    }
}

// cp.async: 16 (cg, bypassing L1) or 4 (ca) bytes global -> shared; with n = 0 nothing is read and
// the destination is zero-filled (src must still be a valid address).
__device__ __forceinline__ void att_cp16(u32 dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void att_cp4(u32 dst, const void* src, int n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void att_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void att_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// att_load_tile through cp.async into the tile at shared address `tile` (not visible until
// att_cp_commit, att_cp_wait_all, __syncthreads). Thread tid copies 16-byte chunk tid % 8 of rows
// tid / 8 + 16k, k = 0..3. A tile entirely inside T (uniform) is copied without row checks; in a
// tile cut by T, rows >= t are zero-filled, their source clamped to g (valid: t >= 1).
__device__ __forceinline__ void att_load_tile_async(u32 tile, const bf16* __restrict__ g, int row0, int t, int ldg) {
    static_assert(ATT_TILE * 8 == 4 * ATT_THREADS, "4 chunks per thread");
    const int r = threadIdx.x >> 3, ch = threadIdx.x & 7;
    const bf16* src = g + (size_t)(row0 + r) * ldg + ch * 8;
    const u32 dst = tile + ATT_OFF(r, ch * 8);
    if (row0 + ATT_TILE <= t) {
#pragma unroll
        for (int k = 0; k < 4; k++) att_cp16(dst + ATT_OFF(16 * k, 0), src + (size_t)(16 * k) * ldg, 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const bool ok = row0 + r + 16 * k < t;
            att_cp16(dst + ATT_OFF(16 * k, 0), ok ? src + (size_t)(16 * k) * ldg : g, ok ? 16 : 0);
        }
    }
}

template <int N = 8>
__device__ __forceinline__ void att_zero(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// Stores a 16x64 f32 accumulator (times `mul`) as bf16 rows ra (= tile row g) and ra + 8 of a
// [rows, ld] matrix starting at dst; rows >= t are skipped.
__device__ __forceinline__ void att_store_rows(bf16* __restrict__ dst, const float (*acc)[4], float mul, int ra, int t, size_t ld,
                                               int lane) {
    int q = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = ra + half * 8;
        if (r < t) {
            bf16* row = dst + (size_t)r * ld;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                *(u32*)(row + nt * 8 + 2 * q) = att_pack(acc[nt][2 * half] * mul, acc[nt][2 * half + 1] * mul);
            }
        }
    }
}

// Causal and length mask of one score tile (rows ra and ra + 8 of this thread, keys
// col0 + 0..63): raw scores of keys past the row or past T become -inf (probability 0).
__device__ __forceinline__ void att_mask(float (*s)[4], int col0, int ra, int t, int lane) {
    const int q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int col = col0 + nt * 8 + 2 * q + (e & 1);
            const int row = ra + (e >> 1) * 8;
            if (!(col <= row && col < t)) s[nt][e] = -TESSERA_INF;
        }
    }
}

// Online softmax over one tile of raw scores s (rows ra, ra + 8): m (running max, log2 units)
// and l (running sum) are updated, o is rescaled, and s becomes P = exp2(s * scale_log2 - m).
// max(s) * scale_log2 equals max(s * scale_log2) (the scale is positive), so the scores are
// scaled only inside the exponent's FFMA. Key 0 is valid for every row, so m is finite after
// the first tile.
__device__ __forceinline__ void att_softmax_tile(float (*s)[4], float (*o)[4], float* m, float* l, float scale_log2) {
    float mx[2] = {-TESSERA_INF, -TESSERA_INF};
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
    }
    float corr[2], nm[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mnew = fmaxf(m[r], mx[r] * scale_log2);
        corr[r] = exp2f(m[r] - mnew);
        m[r] = mnew;
        nm[r] = -mnew;
        l[r] *= corr[r];
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = exp2f(fmaf(s[nt][e], scale_log2, nm[e >> 1]));
            s[nt][e] = p;
            l[e >> 1] += p;
        }
        o[nt][0] *= corr[0];
        o[nt][1] *= corr[0];
        o[nt][2] *= corr[1];
        o[nt][3] *= corr[1];
    }
}

// The forward's end for this thread's rows ra and ra + 8 of one (b, head): row sums (each lane of
// a quad holds a quarter of the columns), O / l stored as bf16 rows of y (row stride c), and the
// base-2 log-sum-exp m + log2(l) into lse (this head's [T] row). Rows >= t are skipped.
__device__ __forceinline__ void att_fwd_finish(bf16* __restrict__ y, float* __restrict__ lse, float (*o)[4], const float* m, float* l, int ra,
                                               int t, int c, int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const float inv0 = 1.f / l[0], inv1 = 1.f / l[1];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        o[nt][0] *= inv0;
        o[nt][1] *= inv0;
        o[nt][2] *= inv1;
        o[nt][3] *= inv1;
    }
    att_store_rows(y, o, 1.f, ra, t, c, lane);
    if ((lane & 3) == 0) {
        if (ra < t) lse[ra] = m[0] + __log2f(l[0]);
        if (ra + 8 < t) lse[ra + 8] = m[1] + __log2f(l[1]);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward: grid (ceil(T/64), B*NH), 128 threads. y [B,T,C], lse [B,NH,T].
// ---------------------------------------------------------------------------------------------
template <bool PRECISE>
__device__ __forceinline__ void attn_fwd_body(bf16* __restrict__ y, float* __restrict__ lse, const bf16* __restrict__ qkv, int t, int c,
                                              int nh, int nkv, float scale_log2) {
    __shared__ __align__(16) bf16 sK[2][ATT_TILE * ATT_LD];
    __shared__ __align__(16) bf16 sV[2][ATT_TILE * ATT_LD];

    const int qt = gridDim.x - 1 - blockIdx.x;  // heaviest (most key tiles) first
    const int bh = blockIdx.y, bi = bh / nh, h = bh % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const AttHeads H = att_heads(bi, h, t, c, nh, nkv);
    const int ld = H.ld;
    const bf16 *qb = qkv + H.q, *kb = qkv + H.k, *vb = qkv + H.v;

    const AttLane L = att_lane(lane);
    const u32 aK = att_smem_addr(sK[0]), aV = att_smem_addr(sV[0]);  // buffer i at + i·ATT_BUF_BYTES

    // Key tile 0 streams into buffer 0 while Q (this warp's 16 rows) is staged through buffer 1.
    att_load_tile_async(aK, kb, 0, t, ld);
    att_load_tile_async(aV, vb, 0, t, ld);
    att_cp_commit();
    u32 qf[4][4];
    att_load_tile(sK[1], qb, qt * ATT_TILE, t, ld);
    __syncthreads();
#pragma unroll
    for (int kc = 0; kc < 4; kc++) att_load_a(qf[kc], aK + ATT_BUF_BYTES, warp * 16, kc * 16, L);

    float o[8][4];
    att_zero(o);
    float m[2] = {-TESSERA_INF, -TESSERA_INF}, l[2] = {0.f, 0.f};
    const int ra = qt * ATT_TILE + warp * 16 + g;  // this thread's rows: ra and ra + 8

    for (int kt = 0; kt <= qt; kt++) {
        const int cur = kt & 1;
        att_cp_wait_all();  // this thread's copies of tile kt have landed
        __syncthreads();    // everyone's have; nobody still reads buffer cur ^ 1 (tile kt-1 / Q)
        const u32 now = cur * ATT_BUF_BYTES, next = (cur ^ 1) * ATT_BUF_BYTES;
        if (kt < qt) {
            att_load_tile_async(aK + next, kb, (kt + 1) * ATT_TILE, t, ld);
            att_load_tile_async(aV + next, vb, (kt + 1) * ATT_TILE, t, ld);
        }
        att_cp_commit();
        const u32 k_s = aK + now, v_s = aV + now;

        float s[8][4];
        att_zero(s);
        att_gemm_abt(s, qf, k_s, L);

        if (kt == qt) att_mask(s, kt * ATT_TILE, ra, t, lane);  // the diagonal tile
        att_softmax_tile(s, o, m, l, scale_log2);
        // O += P V
#pragma unroll
        for (int kc = 0; kc < 4; kc++) att_gemm_cb_chunk<PRECISE>(o, s, v_s, kc, L);
    }

    att_fwd_finish(y + (size_t)bi * t * c + h * ATT_HD, lse + (size_t)bh * t, o, m, l, ra, t, c, lane);
}

#define ATT_FWD_ARGS bf16 *__restrict__ y, float *__restrict__ lse, const bf16 *__restrict__ qkv, int t, int c, int nh, int nkv, float scale_log2
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_fwd(ATT_FWD_ARGS) { attn_fwd_body<false>(y, lse, qkv, t, c, nh, nkv, scale_log2); }
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_fwd_precise(ATT_FWD_ARGS) {
    attn_fwd_body<true>(y, lse, qkv, t, c, nh, nkv, scale_log2);
}

// delta = rowsum(dY o y) of row i (dy and y [T, c] of one (b, head), 64 columns each) for a pair of
// adjacent lanes: each sums 32 columns (u32 = 2 bf16 loads, y is only 4-byte aligned), then the
// pair combines. Fixed order: deterministic. Rows >= t give 0. Every lane of the warp must call it.
__device__ __forceinline__ float att_delta_row(const bf16* __restrict__ dy, const bf16* __restrict__ y, int i, int t, int c) {
    const int half = threadIdx.x & 1;
    float acc = 0.f;
    if (i < t) {
        const u32* dyr = (const u32*)(dy + (size_t)i * c + half * 32);
        const u32* yr = (const u32*)(y + (size_t)i * c + half * 32);
#pragma unroll
        for (int k = 0; k < 16; k++) {
            u32 a = dyr[k], b = yr[k];
            acc = fmaf(__uint_as_float(a << 16), __uint_as_float(b << 16), acc);
            acc = fmaf(__uint_as_float(a & 0xffff0000u), __uint_as_float(b & 0xffff0000u), acc);
        }
    }
    return acc + __shfl_xor_sync(0xffffffffu, acc, 1);
}

// ---------------------------------------------------------------------------------------------
// Backward building blocks for warps that own RB blocks of 16 rows: each B fragment read from
// shared memory feeds RB mmas (one per row block), so RB = 2 halves the shared-memory reads per
// product. Every accumulator element still sums the same products in the same order as with
// RB = 1, so the row blocking never changes a bit.
// ---------------------------------------------------------------------------------------------

// acc[rb][16 x 16NP] += A_rb[16x64] * s[n0 .. n0 + 16NP)^T (s holds rows n, 64 cols k) for each
// row block rb: the k-chunks in order, as att_gemm_abt.
template <int NP, int RB>
__device__ __forceinline__ void att_gemm_abt_rb(float (&acc)[RB][2 * NP][4], const u32 (&a)[RB][4][4], u32 s, int n0, const AttLane& L) {
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
#pragma unroll
        for (int np = 0; np < NP; np++) {
            u32 b[4];
            att_load_b_nk(b, s, n0 + np * 16, kc * 16, L);
#pragma unroll
            for (int rb = 0; rb < RB; rb++) {
                att_mma(acc[rb][2 * np], a[rb][kc], b[0], b[1]);
                att_mma(acc[rb][2 * np + 1], a[rb][kc], b[2], b[3]);
            }
        }
    }
}

// acc[rb][16x64] += C_rb(chunk kc, 16x16, as bf16 or hi + lo) * s[k0..k0+15][0..63] for each row
// block: att_gemm_cb_chunk with one shared-memory read of s for all RB blocks.
template <bool PRECISE, int RB, int NT>
__device__ __forceinline__ void att_gemm_cb_rb(float (&acc)[RB][8][4], const float (&c)[RB][NT][4], u32 s, int kc, int k0, const AttLane& L) {
    u32 hi[RB][4], lo[RB][4];
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        if (PRECISE) {
            att_c_to_a_split(hi[rb], lo[rb], c[rb], kc);
        } else {
            hi[rb][0] = att_pack(c[rb][2 * kc][0], c[rb][2 * kc][1]);
            hi[rb][1] = att_pack(c[rb][2 * kc][2], c[rb][2 * kc][3]);
            hi[rb][2] = att_pack(c[rb][2 * kc + 1][0], c[rb][2 * kc + 1][1]);
            hi[rb][3] = att_pack(c[rb][2 * kc + 1][2], c[rb][2 * kc + 1][3]);
        }
    }
#pragma unroll
    for (int np = 0; np < 4; np++) {
        u32 b[4];
        att_load_b_kn(b, s, k0, np * 16, L);
#pragma unroll
        for (int rb = 0; rb < RB; rb++) {
            att_mma(acc[rb][2 * np], hi[rb], b[0], b[1]);
            att_mma(acc[rb][2 * np + 1], hi[rb], b[2], b[3]);
            if (PRECISE) {
                att_mma(acc[rb][2 * np], lo[rb], b[0], b[1]);
                att_mma(acc[rb][2 * np + 1], lo[rb], b[2], b[3]);
            }
        }
    }
}

// The A fragments of this warp's RB blocks of 16 rows (rows warp·16·RB + 16rb of the staged tiles
// at shared addresses a and b), all 64 columns.
template <int RB>
__device__ __forceinline__ void att_load_warp_a(u32 (&fa)[RB][4][4], u32 (&fb)[RB][4][4], u32 a, u32 b, int warp, const AttLane& L) {
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            att_load_a(fa[rb][kc], a, warp * 16 * RB + rb * 16, kc * 16, L);
            att_load_a(fb[rb][kc], b, warp * 16 * RB + rb * 16, kc * 16, L);
        }
    }
}

// Stages rows row0 .. row0 + 64·RB of a [rows, ldg] matrix (64 columns at g) into the RB
// consecutive 64-row shared tiles starting at s (synchronous loads; rows >= t zero-filled).
template <int RB>
__device__ __forceinline__ void att_stage_rows(bf16* s, const bf16* __restrict__ g, int row0, int t, int ldg) {
#pragma unroll
    for (int rb = 0; rb < RB; rb++) att_load_tile(s + rb * ATT_TILE * ATT_LD, g, row0 + rb * ATT_TILE, t, ldg);
}

// dK/dV pass, one (keys × queries) piece of NT 8-query n-tiles starting at query qoff of the tile:
// s = S^T and dp = dP^T in, P^T and dS^T out:
// P^T = exp2(S^T * scale_log2 - lse) (lse in log2 units, per query), dS^T = P^T o (dP^T - delta).
// MASK: zero where the query is before the key or past T (the diagonal or a cut last tile).
template <bool MASK, int NT>
__device__ __forceinline__ void att_dkdv_probs(float (*s)[4], float (*dp)[4], const float* l_s, const float* d_s, int q0, int qoff, int ja,
                                               int t, float scale_log2, int lane) {
    const int q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int li = qoff + nt * 8 + 2 * q + (e & 1);
            float p = exp2f(fmaf(s[nt][e], scale_log2, -l_s[li]));
            if (MASK) {
                const int i = q0 + li, j = ja + (e >> 1) * 8;
                if (!(i >= j && i < t)) p = 0.f;  // i >= j and i < t imply j < t
            }
            s[nt][e] = p;
            dp[nt][e] = p * (dp[nt][e] - d_s[li]);
        }
    }
}

// dQ pass, one (queries × keys) piece of NT 8-key n-tiles whose first key is k0: s = S and dp = dP
// in. P = exp2(S * scale_log2 - lse); default: dp becomes dS = P o (dP - delta); PRECISE: dp
// becomes P o dP and rs gathers its row sums (pieces in key order keep the whole tile's order).
// MASK: zero where the key is past the row, or the row past T (the diagonal tile).
template <bool MASK, bool PRECISE, int NT>
__device__ __forceinline__ void att_dq_probs(float (*s)[4], float (*dp)[4], const float* lr, const float* dl, float* rs, int k0, int ra, int t,
                                             float scale_log2, int lane) {
    const int q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = e >> 1;
            float p = exp2f(fmaf(s[nt][e], scale_log2, -lr[r]));
            if (MASK) {
                const int j = k0 + nt * 8 + 2 * q + (e & 1), i = ra + r * 8;
                if (!(j <= i && i < t)) p = 0.f;
            }
            s[nt][e] = p;
            if (PRECISE) {
                dp[nt][e] *= p;
                rs[r] += dp[nt][e];
            } else {
                dp[nt][e] = p * (dp[nt][e] - dl[r]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward, second kernel (after attn_bwd_dq, which writes delta): dK, dV for one tile of 64·RB
// keys (grid.x) of one (b, key/value head) (grid.y: B·NKV). Each warp owns 16·RB keys; for each
// query head of the group in ascending order, loops over 64-query tiles from its diagonal to the
// end in order (one stream of tiles through the double buffer, head after head):
//   S^T = K Q^T, P^T = exp(S^T*scale - lse), dP^T = V dY^T, dS^T = P^T o (dP^T - delta),
//   dV += P^T dY, dK += dS^T Q (times scale at the end).
// The query tiles stream through shared memory for the whole CTA; a warp whose keys lie in the
// CTA's second 64-key tile (RB = 2) skips the first query tile, which is entirely before its keys,
// exactly as the RB = 1 kernel never visits it. Each 64-query tile is computed in PIECES pieces
// of 64/PIECES queries: S^T and dP^T of one piece live at a time (fewer registers); dV and dK
// still add their 16-query chunks in order.
// ---------------------------------------------------------------------------------------------
template <bool PRECISE, int PIECES, int RB>
__device__ __forceinline__ void attn_bwd_dkdv_body(bf16* __restrict__ dqkv, const bf16* __restrict__ dy, const bf16* __restrict__ qkv,
                                                   const float* __restrict__ lse, const float* __restrict__ delta, int t, int c, int nh,
                                                   int nkv, float scale, float scale_log2) {
    constexpr int NT = 8 / PIECES;  // 8-query n-tiles per piece
    __shared__ __align__(16) bf16 sQ[2][ATT_TILE * ATT_LD];
    __shared__ __align__(16) bf16 sDY[2][ATT_TILE * ATT_LD];
    __shared__ __align__(16) float sL[2][ATT_TILE];  // lse (log2 units) of the tile's query rows
    __shared__ __align__(16) float sD[2][ATT_TILE];  // delta of the tile's query rows

    const int key0 = blockIdx.x * ATT_TILE * RB;  // heaviest (most query tiles) first
    const int nq = (t + ATT_TILE - 1) / ATT_TILE;
    const int q_first = key0 / ATT_TILE;  // the CTA's first query tile
    const int grp = nh / nkv, bkv = blockIdx.y, bi = bkv / nkv, h0 = (bkv % nkv) * grp;  // heads h0 .. h0 + grp - 1
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const int wkey0 = key0 + warp * 16 * RB;  // this warp's first key
    const int wt = wkey0 / ATT_TILE;          // its 64-key tile, the first query tile it visits
    const AttHeads H = att_heads(bi, h0, t, c, nh, nkv);
    const int ld = H.ld;
    const int span = nq - q_first;  // query tiles per head; step it is head h0 + it / span, tile q_first + it % span

    const AttLane L = att_lane(lane);
    const u32 aQ = att_smem_addr(sQ[0]), aDY = att_smem_addr(sDY[0]);  // buffer i at + i·ATT_BUF_BYTES

    // Step it's query tile (with its lse and delta) -> buffer buf, asynchronously.
    auto prefetch = [&](int it, int buf) {
        const int h = h0 + it / span, qt = q_first + it % span;
        const size_t bh = (size_t)bi * nh + h;
        att_load_tile_async(aQ + buf * ATT_BUF_BYTES, qkv + H.q + (h - h0) * ATT_HD, qt * ATT_TILE, t, ld);
        att_load_tile_async(aDY + buf * ATT_BUF_BYTES, dy + (size_t)bi * t * c + h * ATT_HD, qt * ATT_TILE, t, c);
        if (threadIdx.x < ATT_TILE) {
            int i = qt * ATT_TILE + threadIdx.x;
            bool ok = i < t;
            att_cp4(att_smem_addr(&sL[buf][threadIdx.x]), lse + bh * t + (ok ? i : 0), ok ? 4 : 0);
            att_cp4(att_smem_addr(&sD[buf][threadIdx.x]), delta + bh * t + (ok ? i : 0), ok ? 4 : 0);
        }
    };

    // K and V fragments (A operands) of this warp's keys, staged through shared memory: with
    // RB = 1 through buffer 1 while query tile q_first streams into buffer 0; with RB = 2 the
    // staging takes both buffers, so the first query tile is fetched after it.
    u32 kf[RB][4][4], vf[RB][4][4];
    const int stage = RB == 1 ? 1 : 0;
    if (RB == 1) {
        prefetch(0, 0);
        att_cp_commit();
    }
    att_stage_rows<RB>(sQ[stage], qkv + H.k, key0, t, ld);
    att_stage_rows<RB>(sDY[stage], qkv + H.v, key0, t, ld);
    __syncthreads();
    att_load_warp_a<RB>(kf, vf, aQ + stage * ATT_BUF_BYTES, aDY + stage * ATT_BUF_BYTES, warp, L);
    if (RB > 1) {
        __syncthreads();  // every warp has its fragments before buffer 0 is overwritten
        prefetch(0, 0);
        att_cp_commit();
    }

    float dk[RB][8][4], dv[RB][8][4];
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        att_zero(dk[rb]);
        att_zero(dv[rb]);
    }

    for (int it = 0; it < grp * span; it++) {
        const int cur = it & 1, qt = q_first + it % span;
        att_cp_wait_all();  // this thread's copies of step it's tile have landed
        __syncthreads();    // everyone's have; nobody still reads buffer cur ^ 1
        if (it + 1 < grp * span) prefetch(it + 1, cur ^ 1);
        att_cp_commit();
        if (qt < wt) continue;  // (warp-uniform) the tile is entirely before this warp's keys
        const u32 q_s = aQ + cur * ATT_BUF_BYTES, dy_s = aDY + cur * ATT_BUF_BYTES;
        const float* l_s = sL[cur];
        const float* d_s = sD[cur];
        // The diagonal tile, or a last tile cut by T, needs the mask; the others are all valid.
        const bool masked = qt == wt || (qt + 1) * ATT_TILE > t;
#pragma unroll
        for (int pc = 0; pc < PIECES; pc++) {
            const int qoff = pc * NT * 8;
            float s[RB][NT][4], dp[RB][NT][4];
#pragma unroll
            for (int rb = 0; rb < RB; rb++) {
                att_zero<NT>(s[rb]);
                att_zero<NT>(dp[rb]);
            }
            att_gemm_abt_rb<NT / 2, RB>(s, kf, q_s, qoff, L);    // S^T [keys x queries]
            att_gemm_abt_rb<NT / 2, RB>(dp, vf, dy_s, qoff, L);  // dP^T [keys x queries]
#pragma unroll
            for (int rb = 0; rb < RB; rb++) {
                const int ja = wkey0 + rb * 16 + g;  // this thread's keys: ja and ja + 8
                if (masked) {
                    att_dkdv_probs<true, NT>(s[rb], dp[rb], l_s, d_s, qt * ATT_TILE, qoff, ja, t, scale_log2, lane);
                } else {
                    att_dkdv_probs<false, NT>(s[rb], dp[rb], l_s, d_s, qt * ATT_TILE, qoff, ja, t, scale_log2, lane);
                }
            }
#pragma unroll
            for (int kc = 0; kc < NT / 2; kc++) {                                        // 16-query chunks
                att_gemm_cb_rb<PRECISE, RB, NT>(dv, s, dy_s, kc, qoff + kc * 16, L);  // dV += P^T dY
                att_gemm_cb_rb<PRECISE, RB, NT>(dk, dp, q_s, kc, qoff + kc * 16, L);  // dK += dS^T Q
            }
        }
    }

#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        const int ja = wkey0 + rb * 16 + g;
        att_store_rows(dqkv + H.k, dk[rb], scale, ja, t, ld, lane);
        att_store_rows(dqkv + H.v, dv[rb], 1.f, ja, t, ld, lane);
    }
}

#define ATT_DKDV_ARGS                                                                                                                 \
    bf16 *__restrict__ dqkv, const bf16 *__restrict__ dy, const bf16 *__restrict__ qkv, const float *__restrict__ lse,                \
        const float *__restrict__ delta, int t, int c, int nh, int nkv, float scale, float scale_log2
#define ATT_DKDV_PASS dqkv, dy, qkv, lse, delta, t, c, nh, nkv, scale, scale_log2
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv(ATT_DKDV_ARGS) { attn_bwd_dkdv_body<false, 1, 1>(ATT_DKDV_PASS); }
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv_precise(ATT_DKDV_ARGS) { attn_bwd_dkdv_body<true, 1, 1>(ATT_DKDV_PASS); }
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dkdv_r2(ATT_DKDV_ARGS) { attn_bwd_dkdv_body<false, 4, 2>(ATT_DKDV_PASS); }

// ---------------------------------------------------------------------------------------------
// Backward, first kernel: dQ and delta for one tile of 64·RB queries (grid.x) of one (b, query
// head) (grid.y: B·NH; K and V of its group). Each warp owns 16·RB queries; one pass over key tiles 0 .. its diagonal in order
// (the key tiles stream through shared memory for the whole CTA; with RB = 2 a warp in the CTA's
// first 64-row tile skips the second one's diagonal key tile, which lies after its rows, as the
// RB = 1 kernel never visits it). Each 64-key tile is computed in PIECES pieces in key order.
//
// Default (PRECISE = false), as FlashAttention-2: delta = rowsum(dY o y) from the bf16 output y,
// computed first for the tile's own rows (and written for the dK/dV kernel); then
//   S = Q K^T, P = exp(S*scale - lse), dP = dY V^T, dS = P o (dP - delta), dQ += dS K
// with dS fed to the tensor cores as one bf16.
//
// PRECISE: y is not read. Per key tile: E = P o dP, delta += rowsum(E), A += E K, B += P K (E and
// P as bf16 pairs); then dS = P o (dP - delta) gives dQ = scale * (A - delta o B) without a second
// pass. delta = rowsum(P o dP) (= rowsum(dY o O) for the f32 O) is written for the dK/dV kernel.
// ---------------------------------------------------------------------------------------------
template <bool PRECISE, int PIECES, int RB>
__device__ __forceinline__ void attn_bwd_dq_body(bf16* __restrict__ dqkv, float* __restrict__ delta, const bf16* __restrict__ dy,
                                                 const bf16* __restrict__ qkv, const bf16* __restrict__ y, const float* __restrict__ lse,
                                                 int t, int c, int nh, int nkv, float scale, float scale_log2) {
    constexpr int NT = 8 / PIECES;  // 8-key n-tiles per piece
    constexpr int ROWS = ATT_TILE * RB;
    __shared__ __align__(16) bf16 sK[2][ATT_TILE * ATT_LD];
    __shared__ __align__(16) bf16 sV[2][ATT_TILE * ATT_LD];
    __shared__ float sDelta[ROWS];

    const int row0 = (gridDim.x - 1 - blockIdx.x) * ROWS;  // heaviest first
    const int bh = blockIdx.y, bi = bh / nh, h = bh % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int wrow0 = row0 + warp * 16 * RB;                                      // this warp's first row
    const int wt = wrow0 / ATT_TILE;                                              // its 64-row tile: its diagonal key tile
    const int k_last = min((row0 + ROWS - 1) / ATT_TILE, (t - 1) / ATT_TILE);  // the CTA's last key tile
    const AttHeads H = att_heads(bi, h, t, c, nh, nkv);
    const int ld = H.ld;
    const bf16 *qb = qkv + H.q, *kb = qkv + H.k, *vb = qkv + H.v;
    const bf16* dybase = dy + (size_t)bi * t * c + h * ATT_HD;
    float* delta_bh = delta + (size_t)bh * t;

    const AttLane L = att_lane(lane);
    const u32 aK = att_smem_addr(sK[0]), aV = att_smem_addr(sV[0]);  // buffer i at + i·ATT_BUF_BYTES

    // Key tile 0 -> buffer 0 asynchronously (RB = 1); Q and dY of this tile staged through buffer 1
    // (RB = 1) or both buffers (RB = 2, key tile 0 fetched after the staging).
    const int stage = RB == 1 ? 1 : 0;
    if (RB == 1) {
        att_load_tile_async(aK, kb, 0, t, ld);
        att_load_tile_async(aV, vb, 0, t, ld);
        att_cp_commit();
    }
    att_stage_rows<RB>(sK[stage], qb, row0, t, ld);
    att_stage_rows<RB>(sV[stage], dybase, row0, t, c);
    if (!PRECISE) {
        // delta of row row0 + 64p + tid/2: two adjacent lanes each sum 32 columns (u32 = 2 bf16
        // loads, y is only 4-byte aligned), then combine. Fixed order: deterministic.
#pragma unroll
        for (int pass = 0; pass < RB; pass++) {
            const int r = pass * ATT_TILE + (threadIdx.x >> 1);
            const float acc = att_delta_row(dybase, y + (size_t)bi * t * c + h * ATT_HD, row0 + r, t, c);
            if ((threadIdx.x & 1) == 0) {
                sDelta[r] = acc;
                if (row0 + r < t) delta_bh[row0 + r] = acc;
            }
        }
    }
    __syncthreads();
    u32 qf[RB][4][4], dyf[RB][4][4];
    att_load_warp_a<RB>(qf, dyf, aK + stage * ATT_BUF_BYTES, aV + stage * ATT_BUF_BYTES, warp, L);
    if (RB > 1) {
        __syncthreads();  // every warp has its fragments before buffer 0 is overwritten
        att_load_tile_async(aK, kb, 0, t, ld);
        att_load_tile_async(aV, vb, 0, t, ld);
        att_cp_commit();
    }

    const int ra = wrow0 + g;  // this thread's rows: ra + 16rb and ra + 16rb + 8
    float lr[RB][2], dl[RB][2];
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int i = ra + rb * 16 + r * 8;
            lr[rb][r] = i < t ? lse[(size_t)bh * t + i] : 0.f;  // log2 units
            dl[rb][r] = PRECISE ? 0.f : sDelta[i - row0];
        }
    }

    // PRECISE: acc_e = A = (P o dP) K, acc_p = B = P K. Default: acc_e = dS K (acc_p unused).
    float acc_e[RB][8][4], acc_p[RB][8][4];
    float rs[RB][2];  // PRECISE: this lane's part of rowsum(P o dP)
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        att_zero(acc_e[rb]);
        att_zero(acc_p[rb]);
        rs[rb][0] = rs[rb][1] = 0.f;
    }

    for (int kt = 0; kt <= k_last; kt++) {
        const int cur = kt & 1;
        att_cp_wait_all();  // this thread's copies of tile kt have landed
        __syncthreads();    // everyone's have; nobody still reads buffer cur ^ 1 (tile kt-1 / Q, dY)
        const u32 now = cur * ATT_BUF_BYTES, next = (cur ^ 1) * ATT_BUF_BYTES;
        if (kt < k_last) {
            att_load_tile_async(aK + next, kb, (kt + 1) * ATT_TILE, t, ld);
            att_load_tile_async(aV + next, vb, (kt + 1) * ATT_TILE, t, ld);
        }
        att_cp_commit();
        if (kt > wt) continue;  // (warp-uniform) the tile lies entirely after this warp's rows
        const u32 k_s = aK + now, v_s = aV + now;
#pragma unroll
        for (int pc = 0; pc < PIECES; pc++) {
            const int koff = pc * NT * 8;
            float s[RB][NT][4], dp[RB][NT][4];
#pragma unroll
            for (int rb = 0; rb < RB; rb++) {
                att_zero<NT>(s[rb]);
                att_zero<NT>(dp[rb]);
            }
            att_gemm_abt_rb<NT / 2, RB>(s, qf, k_s, koff, L);    // S = Q K^T
            att_gemm_abt_rb<NT / 2, RB>(dp, dyf, v_s, koff, L);  // dP = dY V^T
#pragma unroll
            for (int rb = 0; rb < RB; rb++) {
                if (kt == wt) {  // the diagonal tile: keys past the row (and rows past T) masked
                    att_dq_probs<true, PRECISE, NT>(s[rb], dp[rb], lr[rb], dl[rb], rs[rb], kt * ATT_TILE + koff, ra + rb * 16, t, scale_log2,
                                                    lane);
                } else {
                    att_dq_probs<false, PRECISE, NT>(s[rb], dp[rb], lr[rb], dl[rb], rs[rb], kt * ATT_TILE + koff, ra + rb * 16, t, scale_log2,
                                                     lane);
                }
            }
#pragma unroll
            for (int kc = 0; kc < NT / 2; kc++) {                                           // 16-key chunks
                att_gemm_cb_rb<PRECISE, RB, NT>(acc_e, dp, k_s, kc, koff + kc * 16, L);     // A += (P o dP) K, or dQ += dS K
                if (PRECISE) att_gemm_cb_rb<true, RB, NT>(acc_p, s, k_s, kc, koff + kc * 16, L);  // B += P K
            }
        }
    }

#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        const int rr = ra + rb * 16;
        if (PRECISE) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                rs[rb][r] += __shfl_xor_sync(0xffffffffu, rs[rb][r], 1);
                rs[rb][r] += __shfl_xor_sync(0xffffffffu, rs[rb][r], 2);
            }
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) acc_e[rb][nt][e] -= rs[rb][e >> 1] * acc_p[rb][nt][e];
            }
            if (q == 0) {
                if (rr < t) delta_bh[rr] = rs[rb][0];
                if (rr + 8 < t) delta_bh[rr + 8] = rs[rb][1];
            }
        }
        att_store_rows(dqkv + H.q, acc_e[rb], scale, rr, t, ld, lane);
    }
}

#define ATT_DQ_ARGS                                                                                                                   \
    bf16 *__restrict__ dqkv, float *__restrict__ delta, const bf16 *__restrict__ dy, const bf16 *__restrict__ qkv,                    \
        const bf16 *__restrict__ y, const float *__restrict__ lse, int t, int c, int nh, int nkv, float scale, float scale_log2
#define ATT_DQ_PASS dqkv, delta, dy, qkv, y, lse, t, c, nh, nkv, scale, scale_log2
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq(ATT_DQ_ARGS) { attn_bwd_dq_body<false, 1, 1>(ATT_DQ_PASS); }
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_precise(ATT_DQ_ARGS) { attn_bwd_dq_body<true, 1, 1>(ATT_DQ_PASS); }
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dq_r2(ATT_DQ_ARGS) { attn_bwd_dq_body<false, 4, 2>(ATT_DQ_PASS); }
