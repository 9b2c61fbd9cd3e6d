//! Optimizer math for ZeRO-style sharded training over flat `f32` buffers: Adam/AdamW, LAMB,
//! Lion, SGD and Adagrad shards, partition-independent deterministic norms, loss scaling and fp16/bf16
//! mixed-precision helpers, all matching DeepSpeed / PyTorch semantics.
//!
//! An [`OptimizerShard`] owns the fp32 optimizer state (moments) for one contiguous range
//! `[lo, hi)` of the global flat parameter buffer; the caller owns the fp32 master weights of that
//! range and passes them to [`OptimizerShard::step`] with the matching gradients. Tensor
//! boundaries inside the flat buffer are described by a [`FlatLayout`]; per-tensor quantities
//! (LAMB trust ratios, gradient norms) are reduced across shards through [`NormAllReduce`] in a
//! way that yields identical bits for every world size (see [`norm`]).

pub mod adagrad;
pub mod adam;
pub mod cycle;
mod elementwise;
mod error;
pub mod lamb;
pub mod lion;
pub mod loss_scale;
pub mod mixed;
pub mod norm;
mod pieces;
pub mod sgd;
mod shard;

#[cfg(test)]
mod tests;

pub use self::adagrad::{AdagradCoeffs, AdagradParams};
pub use self::adam::AdamParams;
pub use self::cycle::{CycleShape, MomentumCycle, ONE_CYCLE_BETA2};
pub use self::elementwise::ElementwiseStep;
pub use self::error::OptimError;
pub use self::lamb::LambParams;
pub use self::lion::LionParams;
pub use self::loss_scale::{DynamicLossScaler, LossScaler, LossScalerState, StepOutcome};
pub use self::norm::{clip_coefficient, global_grad_norm, FlatLayout, LocalReduce, NormAllReduce, NORM_BLOCK};
pub use self::sgd::SgdParams;
pub use self::shard::{OptimizerKind, OptimizerShard, StepContext, PAR_CHUNK};
