//! Layout validation, norm edge cases, checkpoint state errors, clipping and mixed precision.

use half::{bf16, f16};

use super::super::mixed::{
    cast_to_bf16, cast_to_f16, combined_inv_scale, has_non_finite, round_through_bf16, round_through_f16, unscale_and_check,
};
use super::super::{
    clip_coefficient, global_grad_norm, AdamParams, FlatLayout, LocalReduce, OptimError, OptimizerKind, OptimizerShard, SgdParams,
    StepContext, NORM_BLOCK,
};
use super::{assert_bits_eq, Rng};

#[test]
fn layout_validation_and_slots() {
    let gap = FlatLayout::new(vec![0..4, 5..9]);
    assert!(matches!(gap, Err(OptimError::LayoutNotContiguous { index: 1, expected_start: 4, .. })));
    assert!(FlatLayout::new(std::iter::once(2..4).collect()).is_err());
    let l = FlatLayout::from_sizes(&[10, 0, NORM_BLOCK, 2 * NORM_BLOCK + 3]).expect("layout");
    // seg0: block0; seg1: empty; seg2: blocks 0,1; seg3: blocks 1,2,3.
    assert_eq!(l.slots(), 6);
    assert_eq!(l.total(), 3 * NORM_BLOCK + 13);
    assert_eq!(l.segment_of(9), Some(0));
    assert_eq!(l.segment_of(10), Some(2));
    assert_eq!(l.segment_of(l.total()), None);
}

#[test]
fn partial_sumsq_touches_only_owned_slots_and_checks_alignment() {
    let l = FlatLayout::from_sizes(&[100, 2 * NORM_BLOCK]).expect("layout");
    let x = vec![2.0f32; l.total()];
    let mut out = vec![f64::NAN; l.slots()];
    let r = NORM_BLOCK..l.total();
    l.partial_sumsq(&x[r.clone()], r, &mut out).expect("aligned");
    assert!(out[0].is_nan() && out[1].is_nan(), "block 0 slots untouched: {out:?}");
    assert_eq!(out[2..], [4.0 * NORM_BLOCK as f64, 4.0 * 100.0]);

    let unaligned = 1..l.total();
    let err = l.partial_sumsq(&x[1..], unaligned, &mut out);
    assert!(matches!(err, Err(OptimError::ShardRangeUnaligned { .. })));
    let err = l.partial_sumsq(&x, 0..l.total() + 1, &mut out);
    assert!(matches!(err, Err(OptimError::ShardRangeOutOfBounds { .. })));
    let err = l.partial_sumsq(&x[..5], 0..l.total(), &mut out);
    assert!(matches!(err, Err(OptimError::LengthMismatch { what: "x_shard", .. })));
}

#[test]
fn clipping_follows_deepspeed() {
    let l = FlatLayout::from_sizes(&[3, 1]).expect("layout");
    let norm = global_grad_norm(&l, &[3.0, 0.0, 0.0, 4.0], 0..4, &mut LocalReduce).expect("norm");
    assert_eq!(norm, 5.0);
    assert_eq!(clip_coefficient(norm, 1.0), Some((1.0 / (5.0 + 1e-6)) as f32));
    assert_eq!(clip_coefficient(norm, 10.0), None);
    assert_eq!(clip_coefficient(norm, 0.0), None, "max_norm 0 disables clipping");
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0), None);
    // ZeRO: combined scale = loss_scale · max(1, (norm/loss_scale + 1e-6)/clip).
    let inv = combined_inv_scale(5.0 * 1024.0, 1024.0, 1.0);
    let want = 1.0 / (1024.0 * (5.0 + 1e-6));
    assert!((f64::from(inv) - want).abs() < 1e-7 * want, "{inv} vs {want}");
    assert_eq!(combined_inv_scale(0.5 * 1024.0, 1024.0, 1.0), 1.0 / 1024.0);
    assert_eq!(combined_inv_scale(1e9, 8.0, 0.0), 0.125);
}

fn adam_shard_after_steps(steps: usize) -> (OptimizerShard, FlatLayout) {
    let l = FlatLayout::from_sizes(&[64]).expect("layout");
    let mut shard = OptimizerShard::new(OptimizerKind::Adam(AdamParams::default()), 64);
    let mut rng = Rng::new(3);
    let mut p = rng.vec(64);
    let ctx = StepContext { shard_range: 0..64, layout: &l, decay: &[true] };
    for _ in 0..steps {
        shard.step(&mut p, &rng.vec(64), 1e-3, &ctx, &mut LocalReduce).expect("step");
    }
    (shard, l)
}

#[test]
fn load_state_round_trip_and_errors() {
    let (src, l) = adam_shard_after_steps(3);
    let saved: Vec<(&str, Vec<f32>)> = src.state_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect();
    let mut dst = OptimizerShard::new(src.kind(), 64);
    dst.load_state(src.step_count(), &saved).expect("load");
    assert_eq!(dst.step_count(), 3);
    // Both continue identically.
    let (mut a, mut b) = (src.clone(), dst.clone());
    let mut rng = Rng::new(9);
    let (mut pa, g) = (rng.vec(64), rng.vec(64));
    let mut pb = pa.clone();
    let ctx = StepContext { shard_range: 0..64, layout: &l, decay: &[true] };
    a.step(&mut pa, &g, 1e-3, &ctx, &mut LocalReduce).expect("a");
    b.step(&mut pb, &g, 1e-3, &ctx, &mut LocalReduce).expect("b");
    assert_bits_eq(&pa, &pb, "resumed step");

    let fresh = OptimizerShard::new(src.kind(), 64);
    let mut t = fresh.clone();
    let missing = t.load_state(3, &saved[..1]);
    assert!(matches!(missing, Err(OptimError::MissingStateBuffer { name: "exp_avg_sq", .. })));
    let short = [("exp_avg", vec![0.0; 64]), ("exp_avg_sq", vec![0.0; 63])];
    let err = t.load_state(3, &short);
    assert!(matches!(&err, Err(OptimError::StateBufferLength { name, found: 63, .. }) if name == "exp_avg_sq"), "{err:?}");
    let extra = [("exp_avg", vec![0.0; 64]), ("exp_avg_sq", vec![0.0; 64]), ("momentum_buffer", vec![0.0; 64])];
    assert!(matches!(t.load_state(3, &extra), Err(OptimError::UnexpectedStateBuffer { .. })));
    let dup = [("exp_avg", vec![0.0; 64]), ("exp_avg", vec![0.0; 64])];
    assert!(matches!(t.load_state(3, &dup), Err(OptimError::UnexpectedStateBuffer { .. })));
    assert_eq!(t.step_count(), 0, "failed loads change nothing");
    assert!(t.state_buffers().iter().all(|(_, b)| b.iter().all(|&v| v == 0.0)));

    let mut plain = OptimizerShard::new(OptimizerKind::Sgd(SgdParams::default()), 64);
    plain.load_state(5, &[]).expect("sgd without momentum has no buffers");
    assert_eq!(plain.step_count(), 5);
}

#[test]
fn step_rejects_bad_inputs() {
    let l = FlatLayout::from_sizes(&[NORM_BLOCK, 10]).expect("layout");
    let n = l.total();
    let mut shard = OptimizerShard::new(OptimizerKind::Lamb(Default::default()), n - 5);
    let (mut p, g) = (vec![1.0f32; n - 5], vec![1.0f32; n - 5]);
    let ctx = StepContext { shard_range: 5..n, layout: &l, decay: &[true, true] };
    let err = shard.step(&mut p, &g, 1e-3, &ctx, &mut LocalReduce);
    assert!(matches!(err, Err(OptimError::ShardRangeUnaligned { .. })), "{err:?}");
    let ctx = StepContext { shard_range: 0..n - 5, layout: &l, decay: &[true] };
    let err = shard.step(&mut p, &g, 1e-3, &ctx, &mut LocalReduce);
    assert!(matches!(err, Err(OptimError::LengthMismatch { .. })), "{err:?}");
    let ctx = StepContext { shard_range: 0..n - 5, layout: &l, decay: &[true, true] };
    let err = shard.step(&mut p[..3], &g, 1e-3, &ctx, &mut LocalReduce);
    assert!(matches!(err, Err(OptimError::LengthMismatch { what: "master", .. })), "{err:?}");
    assert_eq!(shard.step_count(), 0);
}

#[test]
fn unscale_detects_non_finite() {
    let mut g = vec![2.0f32; 100_000];
    assert!(!unscale_and_check(&mut g, 0.25));
    assert!(g.iter().all(|&v| v == 0.5));
    g[77_777] = f32::INFINITY;
    assert!(unscale_and_check(&mut g, 0.5));
    g[77_777] = f32::NAN;
    assert!(has_non_finite(&g));
    let mut big = vec![3e38f32; 10];
    assert!(unscale_and_check(&mut big, 4.0), "overflow caused by inv_scale > 1");
    assert!(!has_non_finite(&[f32::MAX, -f32::MAX, 0.0, -0.0, f32::MIN_POSITIVE]));
}

#[test]
fn casts_round_to_nearest_even() {
    let one = 1.0f32;
    // bf16 keeps 7 fraction bits: 1 + 2^-7 is exact, 1 + 2^-9 rounds to 1, 1 + 3·2^-8 ties to even.
    let x = [one + 2f32.powi(-7), one + 2f32.powi(-9), one + 3.0 * 2f32.powi(-8), 1e30];
    let mut b = vec![bf16::ZERO; 4];
    cast_to_bf16(&x, &mut b).expect("bf16");
    let got: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got[..3], [one + 2f32.powi(-7), one, one + 2f32.powi(-6)]);
    assert!((got[3] / 1e30 - 1.0).abs() < 1e-2);
    // f16: 10 fraction bits, max 65504; 65520 rounds to inf.
    let y = [one + 2f32.powi(-11), 65504.0, 65520.0];
    let mut h = vec![f16::ZERO; 3];
    cast_to_f16(&y, &mut h).expect("f16");
    assert_eq!(h.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), [one, 65504.0, f32::INFINITY]);
    let mut yr = y.to_vec();
    round_through_f16(&mut yr);
    assert_eq!(yr, [one, 65504.0, f32::INFINITY]);
    let mut xr = x[..3].to_vec();
    round_through_bf16(&mut xr);
    assert_eq!(xr, got[..3]);
    let err = cast_to_f16(&y, &mut h[..2]);
    assert!(matches!(err, Err(OptimError::LengthMismatch { expected: 3, found: 2, .. })));
}
