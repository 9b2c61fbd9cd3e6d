//! Mixed-precision helpers for fp32 masters with 16-bit model copies: overflow checks, gradient
//! unscaling (combined with clipping as ZeRO does it) and rounding masters to fp16/bf16.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::shard::PAR_CHUNK;
use super::OptimError;

const EXP_MASK: u32 = 0x7f80_0000;

// non_finite(x) ⇔ all exponent bits set (±inf or NaN); branch-free so loops vectorise.
#[inline(always)]
fn non_finite(v: f32) -> bool {
    v.to_bits() & EXP_MASK == EXP_MASK
}

/// Whether any element is `inf` or `NaN`.
pub fn has_non_finite(x: &[f32]) -> bool {
    x.par_chunks(PAR_CHUNK).map(|c| c.iter().fold(false, |bad, &v| bad | non_finite(v))).reduce(|| false, |a, b| a | b)
}

// g ← g·inv_scale; report whether any result is non-finite (an inf/NaN input stays non-finite,
// and a finite input that overflows when inv_scale > 1 is caught too).
/// Multiplies gradients by `inv_scale` in place and returns `true` if any element is non-finite
/// afterwards (the step must then be skipped).
pub fn unscale_and_check(grads: &mut [f32], inv_scale: f32) -> bool {
    grads
        .par_chunks_mut(PAR_CHUNK)
        .map(|c| {
            let mut bad = false;
            for v in c.iter_mut() {
                *v *= inv_scale;
                bad |= non_finite(*v);
            }
            bad
        })
        .reduce(|| false, |a, b| a | b)
}

/// The factor ZeRO multiplies gradients by in `unscale_and_clip_grads`, given the global norm
/// of the still-scaled gradients: `combined = loss_scale·max(1, (norm/loss_scale + 1e-6)/clip)`,
/// returned as `1/combined`. `clip_grad <= 0` disables clipping.
pub fn combined_inv_scale(scaled_global_norm: f64, loss_scale: f32, clip_grad: f32) -> f32 {
    let scale = f64::from(loss_scale);
    let mut combined = scale;
    if clip_grad > 0.0 {
        let clip = (scaled_global_norm / scale + 1e-6) / f64::from(clip_grad);
        if clip > 1.0 {
            combined = clip * scale;
        }
    }
    (1.0 / combined) as f32
}

fn check_len(expected: usize, found: usize) -> Result<(), OptimError> {
    if expected != found {
        return Err(OptimError::LengthMismatch { what: "16-bit output", expected, found });
    }
    Ok(())
}

/// Rounds fp32 masters to fp16 (round-to-nearest-even; overflow gives ±inf) into `out`.
pub fn cast_to_f16(master: &[f32], out: &mut [f16]) -> Result<(), OptimError> {
    check_len(master.len(), out.len())?;
    out.par_chunks_mut(PAR_CHUNK).zip(master.par_chunks(PAR_CHUNK)).for_each(|(o, m)| o.convert_from_f32_slice(m));
    Ok(())
}

/// Rounds fp32 masters to bf16 (round-to-nearest-even) into `out`.
pub fn cast_to_bf16(master: &[f32], out: &mut [bf16]) -> Result<(), OptimError> {
    check_len(master.len(), out.len())?;
    out.par_chunks_mut(PAR_CHUNK).zip(master.par_chunks(PAR_CHUNK)).for_each(|(o, m)| o.convert_from_f32_slice(m));
    Ok(())
}

/// Replaces each value by its nearest fp16 value (as f32): simulates fp16 storage in f32 buffers.
pub fn round_through_f16(x: &mut [f32]) {
    x.par_chunks_mut(PAR_CHUNK).for_each(|c| {
        for v in c {
            *v = f16::from_f32(*v).to_f32();
        }
    });
}

/// Replaces each value by its nearest bf16 value (as f32): simulates bf16 storage in f32 buffers.
pub fn round_through_bf16(x: &mut [f32]) {
    x.par_chunks_mut(PAR_CHUNK).for_each(|c| {
        for v in c {
            *v = bf16::from_f32(*v).to_f32();
        }
    });
}
