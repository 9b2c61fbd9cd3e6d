//! Layer math in llm.c style: each op's forward and backward sit side by side in one file,
//! over plain row-major `f32` slices with explicit shapes. Backward functions *accumulate* (`+=`)
//! into their gradient outputs so that callers can sum contributions without extra buffers.

pub mod attention;
pub mod crossentropy;
pub mod embedding;
pub mod gelu;
pub mod gqa;
pub mod layernorm;
pub mod linear;
pub mod moe;
pub mod paged_attention;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
