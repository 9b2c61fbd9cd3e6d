//! Mixed precision on the CPU path: 16-bit parameter and gradient *storage* with fp32 compute
//! and fp32 master weights.
//!
//! The working parameters are the masters rounded to the 16-bit type after every step, and every
//! micro-batch gradient is rounded to it as it would be stored in 16 bits (so an fp16 gradient
//! beyond 65504 becomes infinite, which the dynamic loss scaler detects). Arithmetic inside the
//! kernels stays f32; this reproduces the numerics of 16-bit storage, not its speed.

use tessera_kernels::dtype::{round_to, DType};

/// Which 16-bit type parameters and gradients are stored in, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision16 {
    F32,
    Bf16,
    Fp16,
}

impl Precision16 {
    pub fn dtype(self) -> DType {
        match self {
            Precision16::F32 => DType::F32,
            Precision16::Bf16 => DType::BF16,
            Precision16::Fp16 => DType::F16,
        }
    }

    /// Rounds values to the storage type in place (no-op for f32).
    pub fn round(self, x: &mut [f32]) {
        round_to(self.dtype(), x);
    }
}
