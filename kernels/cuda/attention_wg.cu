// Hopper (sm_90a) attention kernels on warpgroup MMAs (wgmma.mma_async), appended to
// attention.cu (kernels/src/cuda/mod.rs builds the `attention_wg` module from both files and
// compiles it for sm_90a; wgmma exists only there). Same interface, same math and the same loop
// orders as the mma.sync kernels above: each output element sums the same products in the same
// order (the k-chunks of 16 in order, the tiles in order), so they differ only in how the tensor
// cores are driven. `gpu check` compares both.
//
// One CTA is one warpgroup (4 warps, 128 threads) and owns 64 rows: warp w the rows 16w..16w+15,
// exactly the rows it owns in the mma.sync kernels, and a wgmma m64n64k16 accumulator holds, for
// each thread, the same elements as the `float [8][4]` accumulators there (n-tile j = columns
// 8j..8j+7: [j][0..1] row g, columns 8j + 2q + 0..1; [j][2..3] row g + 8). So the masks, the
// softmax and the stores of attention.cu apply unchanged, and an accumulator converts to an A
// operand in registers by packing pairs (the A fragment of k-chunk kc is n-tiles 2kc and 2kc+1).
//
// Shared tiles are 64 rows × 64 bf16 (128 bytes a row) in the 128-byte swizzle of the tensor
// cores: 16-byte chunk ch of row r lies at r·128 + ((ch ^ (r % 8)) · 16), the tile 1024-byte
// aligned. The same bytes serve as a K-major operand (a row is the contiguous K dimension: Q and
// K in S = Q Kᵀ) and as an MN-major one (a row is 64 contiguous N elements, K runs down the rows:
// V in O = P V, K in dQ = dS K). Descriptors (PTX ISA, "Matrix Descriptor Format"): start address,
// 8-row groups 1024 bytes apart (stride byte offset), swizzle mode 1 (128 bytes). A k-step of 16
// advances a K-major operand by 32 bytes along its rows and an MN-major one by 16 rows (2048 bytes).
//
// Tiles arrive by cp.async (generic proxy), so each thread fences them into the async proxy
// (fence.proxy.async) before the barrier after which wgmma reads them.
//
// The backward's A operands that stay in registers for the whole kernel (Q and dY in dQ, K and V
// in dK/dV) are loaded straight from global memory. A first version staged them through the
// shared buffer that the second tile then streams into (cp.async, ldmatrix, barrier, cp.async of
// the next tile, fence, barrier, wgmma): on the H200 every tile from the second on then gave
// deterministically wrong dQ, dK and dV (t = 64 was right, t = 77, 200 and 1024 were not), while
// the forward, whose buffers are never read by ldmatrix, was right. The cause was not pinned
// down; without the staging the kernels match the mma.sync ones bit for bit (`gpu check`).

#define WG_TILE_BYTES 8192u

// Byte offset of 16-byte chunk ch of row r in a swizzled tile.
__device__ __forceinline__ u32 wg_sw(int r, int ch) { return (u32)(r * 128 + ((ch ^ (r & 7)) << 4)); }

// Descriptors of a swizzled tile at shared address addr: K-major (leading byte offset unused,
// 1 by convention) and MN-major (the leading byte offset would step between 64-element column
// blocks, of which a 64-wide tile has one; set to the stride too).
__device__ __forceinline__ u64 wg_desc_k(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ u64 wg_desc_mn(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(1024 >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
// Descriptor offsets (in 16-byte units) of k-step kk.
#define WG_K_STEP(kk) ((u64)(2 * (kk)))
#define WG_MN_STEP(kk) ((u64)(128 * (kk)))

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across a wgmma wait.
__device__ __forceinline__ void wg_fence_acc(float (*d)[4]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[j][e])::"memory");
    }
}

// The same for A fragments in registers. Both are called right before wg_fence(): the registers
// a wgmma reads must be written before its wgmma.fence, and the compiler is otherwise free to sink
// their last writes (a zeroing, a rescale, a conversion) past it — NVRTC's PTX did put the
// accumulators' zeroing between the fence and the wgmma before these were added.
__device__ __forceinline__ void wg_fence_a(u32 (*a)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[j][e])::"memory");
    }
}

#define WG_D32                                                                                                                        \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),           \
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),       \
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),       \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WG_D32_LIST                                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, " \
    "%27, %28, %29, %30, %31}"

// d[64x64 f32] = (acc ? d : 0) + A[64x16] · B[16x64], A and B in shared memory (descriptors);
// TB = 0: B K-major (stored [n][k]), TB = 1: B MN-major (stored [k][n]). A is K-major.
template <int TB>
__device__ __forceinline__ void wg_mma_ss(float (*d)[4], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32_LIST ", %32, %33, p, 1, 1, 0, %35;\n}\n"
        : WG_D32
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

// The same with A in registers: this thread's A fragment of its warp's 16 rows (as mma.sync's
// m16n8k16 A fragment).
template <int TB>
__device__ __forceinline__ void wg_mma_rs(float (*d)[4], const u32* a, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WG_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

// Rows row0..row0+63 (64 bf16 columns at g, global row stride ldg) into the swizzled tile at
// shared address `tile` by cp.async (rows >= t zero-filled, their source clamped to g). Thread tid
// copies chunk tid % 8 of rows tid / 8 + 16k; rows 16 apart share their swizzle, 2048 bytes apart.
__device__ __forceinline__ void wg_load_tile_async(u32 tile, const bf16* __restrict__ g, int row0, int t, int ldg) {
    const int r = threadIdx.x >> 3, ch = threadIdx.x & 7;
    const bf16* src = g + (size_t)(row0 + r) * ldg + ch * 8;
    const u32 dst = tile + wg_sw(r, ch);
    if (row0 + ATT_TILE <= t) {
#pragma unroll
        for (int k = 0; k < 4; k++) att_cp16(dst + 2048u * k, src + (size_t)(16 * k) * ldg, 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const bool ok = row0 + r + 16 * k < t;
            att_cp16(dst + 2048u * k, ok ? src + (size_t)(16 * k) * ldg : g, ok ? 16 : 0);
        }
    }
}

// A fragment of the 16x16 block at (r0, c0) of a swizzled tile (as att_load_a: matrix 0 = rows
// r0..+7 / cols c0..+7, 1 = rows +8, 2 = cols +8, 3 = both).
__device__ __forceinline__ void wg_load_a(u32* a, u32 tile, int r0, int c0, int lane) {
    const int r = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    att_ldsm_x4(a, tile + wg_sw(r, (c0 >> 3) + (lane >> 4)));
}

// The A fragments (k-chunks 0..3, all 64 columns) of rows r0..r0+15 of a [rows, ldg] bf16 matrix
// (64 columns at g) straight from global memory: a[kc][0] = row r0+g, columns 16kc+2q..+1; [1] row
// r0+g+8; [2], [3] the same 8 columns on (as att_load_a). Rows >= t are zero.
__device__ __forceinline__ void wg_load_a_global(u32 (*a)[4], const bf16* __restrict__ g, int r0, int t, int ldg, int lane) {
    const int rg = r0 + (lane >> 2), q = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rg + 8 * h;
        const u32* row = (const u32*)(g + (size_t)r * ldg + 2 * q);
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            a[kc][h] = r < t ? row[8 * kc] : 0u;
            a[kc][h + 2] = r < t ? row[8 * kc + 4] : 0u;
        }
    }
}

// The A fragments (k-chunks 0..3) of a [8][4] accumulator as plain bf16 pairs.
__device__ __forceinline__ void wg_acc_to_a(u32 (*a)[4], const float (*c)[4]) {
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
        a[kc][0] = att_pack(c[2 * kc][0], c[2 * kc][1]);
        a[kc][1] = att_pack(c[2 * kc][2], c[2 * kc][3]);
        a[kc][2] = att_pack(c[2 * kc + 1][0], c[2 * kc + 1][1]);
        a[kc][3] = att_pack(c[2 * kc + 1][2], c[2 * kc + 1][3]);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward: grid (ceil(T/64), B*NH), 128 threads, as attn_fwd. Q, K and V tiles in shared memory
// (K/V double-buffered), S = Q Kᵀ from two descriptors, O += P V with P from registers.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_fwd_wg(ATT_FWD_ARGS) {
    __shared__ __align__(1024) unsigned char smem[5 * WG_TILE_BYTES];  // Q, K[2], V[2]

    const int qt = gridDim.x - 1 - blockIdx.x;  // heaviest (most key tiles) first
    const int bh = blockIdx.y, bi = bh / nh, h = bh % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const AttHeads H = att_heads(bi, h, t, c, nh, nkv);
    const int ld = H.ld;
    const bf16 *qb = qkv + H.q, *kb = qkv + H.k, *vb = qkv + H.v;

    const u32 sQ = att_smem_addr(smem), sK = sQ + WG_TILE_BYTES, sV = sQ + 3 * WG_TILE_BYTES;
    wg_load_tile_async(sQ, qb, qt * ATT_TILE, t, ld);
    wg_load_tile_async(sK, kb, 0, t, ld);
    wg_load_tile_async(sV, vb, 0, t, ld);
    att_cp_commit();
    const u64 dq = wg_desc_k(sQ);

    float o[8][4];
    att_zero(o);
    float m[2] = {-TESSERA_INF, -TESSERA_INF}, l[2] = {0.f, 0.f};
    const int ra = qt * ATT_TILE + warp * 16 + g;  // this thread's rows: ra and ra + 8

    for (int kt = 0; kt <= qt; kt++) {
        const int cur = kt & 1;
        att_cp_wait_all();  // this thread's copies of tile kt (and Q) have landed
        wg_proxy_fence();   // ... and are visible to the tensor cores' reads
        __syncthreads();    // everyone's are; nobody still reads buffer cur ^ 1 (tile kt-1)
        if (kt < qt) {
            wg_load_tile_async(sK + (cur ^ 1) * WG_TILE_BYTES, kb, (kt + 1) * ATT_TILE, t, ld);
            wg_load_tile_async(sV + (cur ^ 1) * WG_TILE_BYTES, vb, (kt + 1) * ATT_TILE, t, ld);
        }
        att_cp_commit();
        const u64 dk = wg_desc_k(sK + cur * WG_TILE_BYTES), dv = wg_desc_mn(sV + cur * WG_TILE_BYTES);

        float s[8][4];
        att_zero(s);
        wg_fence_acc(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_ss<0>(s, dq + WG_K_STEP(kk), dk + WG_K_STEP(kk), 1);
        wg_commit();
        wg_wait0();
        wg_fence_acc(s);

        if (kt == qt) att_mask(s, kt * ATT_TILE, ra, t, lane);  // the diagonal tile
        att_softmax_tile(s, o, m, l, scale_log2);
        u32 pa[4][4];
        wg_acc_to_a(pa, s);
        wg_fence_a(pa);
        wg_fence_acc(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<1>(o, pa[kk], dv + WG_MN_STEP(kk), 1);
        wg_commit();
        wg_wait0();
        wg_fence_acc(o);
    }

    att_fwd_finish(y + (size_t)bi * t * c + h * ATT_HD, lse + (size_t)bh * t, o, m, l, ra, t, c, lane);
}

// ---------------------------------------------------------------------------------------------
// Backward, first kernel: dQ and delta for 64 queries (grid.x, heaviest first) of one (b, head),
// as attn_bwd_dq: delta = rowsum(dY o y) first; then per key tile 0 .. the diagonal, in order,
//   S = Q Kᵀ, dP = dY Vᵀ (Q, dY in registers; K, V K-major), P = exp2(S·scale_log2 − lse),
//   dS = P o (dP − delta), dQ += dS K (dS in registers, K MN-major).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dq_wg(ATT_DQ_ARGS) {
    __shared__ __align__(1024) unsigned char smem[4 * WG_TILE_BYTES];  // K[2], V[2]
    __shared__ float sDelta[ATT_TILE];

    const int qt = gridDim.x - 1 - blockIdx.x;
    const int row0 = qt * ATT_TILE;
    const int bh = blockIdx.y, bi = bh / nh, h = bh % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const AttHeads H = att_heads(bi, h, t, c, nh, nkv);
    const int ld = H.ld;
    const bf16 *qb = qkv + H.q, *kb = qkv + H.k, *vb = qkv + H.v;
    const bf16* dybase = dy + (size_t)bi * t * c + h * ATT_HD;
    float* delta_bh = delta + (size_t)bh * t;

    const u32 sK = att_smem_addr(smem), sV = sK + 2 * WG_TILE_BYTES;
    // Key tile 0 -> buffers 0; this warp's Q and dY fragments straight from global memory.
    wg_load_tile_async(sK, kb, 0, t, ld);
    wg_load_tile_async(sV, vb, 0, t, ld);
    att_cp_commit();
    u32 qf[4][4], dyf[4][4];
    wg_load_a_global(qf, qb, row0 + warp * 16, t, ld, lane);
    wg_load_a_global(dyf, dybase, row0 + warp * 16, t, c, lane);
    {
        // delta of row row0 + tid/2 (two adjacent lanes, 32 columns each; fixed order).
        const int r = threadIdx.x >> 1;
        const float acc = att_delta_row(dybase, y + (size_t)bi * t * c + h * ATT_HD, row0 + r, t, c);
        if ((threadIdx.x & 1) == 0) {
            sDelta[r] = acc;
            if (row0 + r < t) delta_bh[row0 + r] = acc;
        }
    }
    __syncthreads();  // sDelta

    const int ra = row0 + warp * 16 + g;  // this thread's rows: ra and ra + 8
    float lr[2], dl[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = ra + r * 8;
        lr[r] = i < t ? lse[(size_t)bh * t + i] : 0.f;  // log2 units
        dl[r] = sDelta[i - row0];
    }

    float dqa[8][4];
    att_zero(dqa);
    for (int kt = 0; kt <= qt; kt++) {
        const int cur = kt & 1;
        att_cp_wait_all();
        wg_proxy_fence();
        __syncthreads();
        if (kt < qt) {
            wg_load_tile_async(sK + (cur ^ 1) * WG_TILE_BYTES, kb, (kt + 1) * ATT_TILE, t, ld);
            wg_load_tile_async(sV + (cur ^ 1) * WG_TILE_BYTES, vb, (kt + 1) * ATT_TILE, t, ld);
        }
        att_cp_commit();
        const u32 k_s = sK + cur * WG_TILE_BYTES, v_s = sV + cur * WG_TILE_BYTES;
        const u64 dk = wg_desc_k(k_s), dv = wg_desc_k(v_s), dkn = wg_desc_mn(k_s);

        float s[8][4], dp[8][4];
        att_zero(s);
        att_zero(dp);
        wg_fence_acc(s);
        wg_fence_acc(dp);
        wg_fence_a(qf);
        wg_fence_a(dyf);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<0>(s, qf[kk], dk + WG_K_STEP(kk), 1);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<0>(dp, dyf[kk], dv + WG_K_STEP(kk), 1);
        wg_commit();
        wg_wait0();
        wg_fence_acc(s);
        wg_fence_acc(dp);
        if (kt == qt) {
            att_dq_probs<true, false, 8>(s, dp, lr, dl, rs, kt * ATT_TILE, ra, t, scale_log2, lane);
        } else {
            att_dq_probs<false, false, 8>(s, dp, lr, dl, rs, kt * ATT_TILE, ra, t, scale_log2, lane);
        }
        u32 da[4][4];
        wg_acc_to_a(da, dp);
        wg_fence_a(da);
        wg_fence_acc(dqa);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<1>(dqa, da[kk], dkn + WG_MN_STEP(kk), 1);
        wg_commit();
        wg_wait0();
        wg_fence_acc(dqa);
    }
    att_store_rows(dqkv + H.q, dqa, scale, ra, t, ld, lane);
}

// ---------------------------------------------------------------------------------------------
// Backward, second kernel (after attn_bwd_dq_wg, which writes delta): dK, dV for 64 keys
// (grid.x, heaviest first) of one (b, key/value head), as attn_bwd_dkdv: for each query head of
// the group in ascending order, per query tile from the diagonal to the end, in order,
//   Sᵀ = K Qᵀ, dPᵀ = V dYᵀ (K, V in registers; Q, dY K-major), Pᵀ = exp2(Sᵀ·scale_log2 − lse),
//   dSᵀ = Pᵀ o (dPᵀ − delta), dV += Pᵀ dY, dK += dSᵀ Q (Pᵀ, dSᵀ in registers; dY, Q MN-major).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dkdv_wg(ATT_DKDV_ARGS) {
    __shared__ __align__(1024) unsigned char smem[4 * WG_TILE_BYTES];  // Q[2], dY[2]
    __shared__ __align__(16) float sL[2][ATT_TILE];                   // lse (log2 units) of the tile's queries
    __shared__ __align__(16) float sD[2][ATT_TILE];                   // delta of the tile's queries

    const int key0 = blockIdx.x * ATT_TILE;  // heaviest (most query tiles) first
    const int q_first = blockIdx.x;          // the diagonal query tile
    const int nq = (t + ATT_TILE - 1) / ATT_TILE;
    const int grp = nh / nkv, bkv = blockIdx.y, bi = bkv / nkv, h0 = (bkv % nkv) * grp;  // heads h0 .. h0 + grp - 1
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const AttHeads H = att_heads(bi, h0, t, c, nh, nkv);
    const int ld = H.ld;
    const int span = nq - q_first;  // query tiles per head; step it is head h0 + it / span, tile q_first + it % span

    const u32 sQ = att_smem_addr(smem), sDY = sQ + 2 * WG_TILE_BYTES;
    auto prefetch = [&](int it, int buf) {
        const int h = h0 + it / span, qt = q_first + it % span;
        const size_t bh = (size_t)bi * nh + h;
        wg_load_tile_async(sQ + buf * WG_TILE_BYTES, qkv + H.q + (h - h0) * ATT_HD, qt * ATT_TILE, t, ld);
        wg_load_tile_async(sDY + buf * WG_TILE_BYTES, dy + (size_t)bi * t * c + h * ATT_HD, qt * ATT_TILE, t, c);
        if (threadIdx.x < ATT_TILE) {
            const int i = qt * ATT_TILE + threadIdx.x;
            const bool ok = i < t;
            att_cp4(att_smem_addr(&sL[buf][threadIdx.x]), lse + bh * t + (ok ? i : 0), ok ? 4 : 0);
            att_cp4(att_smem_addr(&sD[buf][threadIdx.x]), delta + bh * t + (ok ? i : 0), ok ? 4 : 0);
        }
    };
    // The first head's diagonal query tile -> buffers 0; this warp's K and V fragments from global memory.
    prefetch(0, 0);
    att_cp_commit();
    u32 kf[4][4], vf[4][4];
    wg_load_a_global(kf, qkv + H.k, key0 + warp * 16, t, ld, lane);
    wg_load_a_global(vf, qkv + H.v, key0 + warp * 16, t, ld, lane);

    const int ja = key0 + warp * 16 + g;  // this thread's keys: ja and ja + 8
    float dka[8][4], dva[8][4];
    att_zero(dka);
    att_zero(dva);
    for (int it = 0; it < grp * span; it++) {
        const int cur = it & 1, qt = q_first + it % span;
        att_cp_wait_all();
        wg_proxy_fence();
        __syncthreads();
        if (it + 1 < grp * span) prefetch(it + 1, cur ^ 1);
        att_cp_commit();
        const u32 q_s = sQ + cur * WG_TILE_BYTES, dy_s = sDY + cur * WG_TILE_BYTES;
        const u64 dq = wg_desc_k(q_s), ddy = wg_desc_k(dy_s);

        float s[8][4], dp[8][4];
        att_zero(s);
        att_zero(dp);
        wg_fence_acc(s);
        wg_fence_acc(dp);
        wg_fence_a(kf);
        wg_fence_a(vf);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<0>(s, kf[kk], dq + WG_K_STEP(kk), 1);  // Sᵀ [keys x queries]
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<0>(dp, vf[kk], ddy + WG_K_STEP(kk), 1);  // dPᵀ
        wg_commit();
        wg_wait0();
        wg_fence_acc(s);
        wg_fence_acc(dp);
        if (qt == q_first || (qt + 1) * ATT_TILE > t) {
            att_dkdv_probs<true, 8>(s, dp, sL[cur], sD[cur], qt * ATT_TILE, 0, ja, t, scale_log2, lane);
        } else {
            att_dkdv_probs<false, 8>(s, dp, sL[cur], sD[cur], qt * ATT_TILE, 0, ja, t, scale_log2, lane);
        }
        u32 pa[4][4], da[4][4];
        wg_acc_to_a(pa, s);
        wg_acc_to_a(da, dp);
        wg_fence_a(pa);
        wg_fence_a(da);
        wg_fence_acc(dva);
        wg_fence_acc(dka);
        wg_fence();
        const u64 dyn = wg_desc_mn(dy_s), qn = wg_desc_mn(q_s);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            wg_mma_rs<1>(dva, pa[kk], dyn + WG_MN_STEP(kk), 1);  // dV += Pᵀ dY
            wg_mma_rs<1>(dka, da[kk], qn + WG_MN_STEP(kk), 1);   // dK += dSᵀ Q
        }
        wg_commit();
        wg_wait0();
        wg_fence_acc(dva);
        wg_fence_acc(dka);
    }

    att_store_rows(dqkv + H.k, dka, scale, ja, t, ld, lane);
    att_store_rows(dqkv + H.v, dva, 1.f, ja, t, ld, lane);
}

// ---------------------------------------------------------------------------------------------
// Operand-layout probe (gpu check): one CTA, a [64][64] and b [64][64] bf16 row-major in global
// memory, out [64][64] f32:
//   mode 0: out = a · bᵀ, both from shared memory (K-major descriptors), as S = Q Kᵀ;
//   mode 1: out = a · b, a from registers, b MN-major, as O = P V;
//   mode 2: out = a · bᵀ, a from registers, b K-major, as S = Q Kᵀ in the backward.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_wg_probe(float* __restrict__ out, const bf16* __restrict__ a,
                                                                         const bf16* __restrict__ b, int mode) {
    __shared__ __align__(1024) unsigned char smem[2 * WG_TILE_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32 sA = att_smem_addr(smem), sB = sA + WG_TILE_BYTES;
    wg_load_tile_async(sA, a, 0, ATT_TILE, ATT_HD);
    wg_load_tile_async(sB, b, 0, ATT_TILE, ATT_HD);
    att_cp_commit();
    att_cp_wait_all();
    wg_proxy_fence();
    __syncthreads();
    u32 af[4][4];
#pragma unroll
    for (int kc = 0; kc < 4; kc++) wg_load_a(af[kc], sA, warp * 16, kc * 16, lane);
    float d[8][4];
    att_zero(d);
    wg_fence_acc(d);
    wg_fence_a(af);
    wg_fence();
    if (mode == 0) {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_ss<0>(d, wg_desc_k(sA) + WG_K_STEP(kk), wg_desc_k(sB) + WG_K_STEP(kk), kk > 0);
    } else if (mode == 1) {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<1>(d, af[kk], wg_desc_mn(sB) + WG_MN_STEP(kk), 1);
    } else {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_mma_rs<0>(d, af[kk], wg_desc_k(sB) + WG_K_STEP(kk), 1);
    }
    wg_commit();
    wg_wait0();
    wg_fence_acc(d);
#pragma unroll
    for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) out[(warp * 16 + g + (e >> 1) * 8) * 64 + 8 * j + 2 * q + (e & 1)] = d[j][e];
    }
}
