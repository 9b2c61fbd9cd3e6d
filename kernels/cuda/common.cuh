// Prelude prepended to every Tessera CUDA source before NVRTC compiles it (see
// kernels/src/cuda/mod.rs). Self-contained on purpose: NVRTC has no built-in CUDA headers and the
// machines that run us need not carry the toolkit's, so bf16 is handled as raw bits here.
//
// Rounding matches the CPU side (`half::bf16::from_f32`): round to nearest, ties to even; NaN
// stays a (quiet) NaN. Bit-identical casts are what let the GPU and CPU paths be compared exactly.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// Two bf16 packed in one 32-bit register (low half = first element), as mma.sync expects.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return ((u32)f2bf(hi) << 16) | (u32)f2bf(lo);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define TESSERA_INF __int_as_float(0x7f800000)
