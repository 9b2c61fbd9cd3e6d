//! tessera-kernels: tensors, dtypes and the CPU math of training and inference — GEMM, every
//! layer's forward and backward side by side, the model stack over one flat parameter buffer,
//! optimizer math, and the decoding forward over a paged key/value cache with int8 linears.
//!
//! Everything here is deterministic: no reduction depends on thread scheduling, so the same
//! inputs give the same bits on every run.

pub mod cuda;
pub mod dtype;
pub mod experts;
pub mod gemm;
pub mod gradcheck;
pub mod layer;
pub mod model;
pub mod moe_ffn;
pub mod ops;
pub mod optim;
pub mod quant;
pub mod tensor;
pub mod wgrad;
