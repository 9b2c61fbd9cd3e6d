//! OneCycle's momentum cycle in the optimizers: AdamW against an independent torch/DeepSpeed
//! reference (`scripts/gen_one_cycle_adamw.py`), every optimizer with betas against fixed-beta
//! steps, resume mid-cycle, and betas that leave [0, 1).

use serde_json::Value;

use super::super::{
    AdamParams, CycleShape, FlatLayout, LambParams, LionParams, LocalReduce, MomentumCycle, OptimError, OptimizerKind, OptimizerShard,
    StepContext, ONE_CYCLE_BETA2,
};
use super::{assert_bits_eq, assert_close, Rng};

const FIXTURE: &str = include_str!("../../../tests/fixtures/adamw_one_cycle.json");

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().expect("an array").iter().map(|x| x.as_f64().expect("a number") as f32).collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().expect("an array").iter().map(|x| x.as_f64().expect("a number")).collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("fixture lacks {key}"))
}

/// The fixture's OneCycle momentum settings as a cycle.
fn fixture_cycle(f: &Value) -> MomentumCycle {
    let o = &f["one_cycle"];
    let int = |k: &str| o[k].as_u64().unwrap_or_else(|| panic!("fixture lacks {k}"));
    MomentumCycle {
        shape: CycleShape {
            first_step_size: int("cycle_first_step_size"),
            second_step_size: int("cycle_second_step_size"),
            first_stair_count: 0,
            second_stair_count: 0,
        },
        decay_step_size: int("decay_step_size"),
        min_mom: num(o, "cycle_min_mom") as f32,
        max_mom: num(o, "cycle_max_mom") as f32,
        decay_mom_rate: num(o, "decay_mom_rate") as f32,
    }
}

/// Runs the fixture's steps with AdamW (configured betas (0.9, 0.999), which the cycle
/// replaces when there is one); returns masters, exp_avg, exp_avg_sq.
fn fixture_run(f: &Value, cycle: Option<MomentumCycle>) -> [Vec<f32>; 3] {
    let sizes: Vec<usize> = f["sizes"].as_array().expect("sizes").iter().map(|s| s.as_u64().expect("size") as usize).collect();
    let layout = FlatLayout::from_sizes(&sizes).expect("layout");
    let wd = f64s(&f["weight_decay"]);
    let decay: Vec<bool> = wd.iter().map(|&w| w != 0.0).collect();
    let params =
        AdamParams { lr: 1.0, eps: num(f, "eps") as f32, weight_decay: wd[0] as f32, momentum_cycle: cycle, ..AdamParams::default() };
    let kind = OptimizerKind::Adam(params);
    let n = layout.total();
    let mut shard = OptimizerShard::new(kind, n);
    let mut p = f32s(&f["p0"]);
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &decay };
    let lrs = f64s(&f["lr"]);
    let betas = f["betas"].as_array().expect("betas");
    for (t, g) in f["grads"].as_array().expect("grads").iter().enumerate() {
        if cycle.is_some() {
            let (b1, b2) = kind.betas_at(t as u64).expect("adam has betas");
            let want = f64s(&betas[t]);
            assert!((f64::from(b1) - want[0]).abs() < 1e-7, "step {}: beta1 {b1}, DeepSpeed {}", t + 1, want[0]);
            assert_eq!(f64::from(b2), f64::from(want[1] as f32), "step {}: beta2", t + 1);
        }
        shard.step(&mut p, &f32s(g), lrs[t] as f32, &ctx, &mut LocalReduce).expect("step");
    }
    let bufs = shard.state_buffers();
    [p, bufs[0].1.to_vec(), bufs[1].1.to_vec()]
}

/// The DeepSpeed OneCycle + torch AdamW reference: betas (cycled β1, 0.99) from the
/// scheduler each step, bias corrections `1 − β^t` with the current betas.
#[test]
fn adamw_under_one_cycle_momentum_matches_the_torch_reference() {
    let f: Value = serde_json::from_str(FIXTURE).expect("fixture JSON");
    let [p, m, v] = fixture_run(&f, Some(fixture_cycle(&f)));
    assert_close(&p, &f64s(&f["p"]), 2e-6, 2e-5, "masters");
    assert_close(&m, &f64s(&f["exp_avg"]), 2e-6, 2e-5, "exp_avg");
    assert_close(&v, &f64s(&f["exp_avg_sq"]), 2e-6, 2e-5, "exp_avg_sq");
    // The comparison can fail: the configured betas alone end far from the reference.
    let [fixed, _, _] = fixture_run(&f, None);
    let want = f64s(&f["p"]);
    let off = fixed.iter().zip(&want).map(|(&a, &b)| (f64::from(a) - b).abs()).fold(0.0, f64::max);
    assert!(off > 1e-3, "fixed betas came within {off} of the cycled reference");
}

fn cycle(decay_mom_rate: f32) -> MomentumCycle {
    MomentumCycle {
        shape: CycleShape { first_step_size: 3, second_step_size: 2, first_stair_count: 0, second_stair_count: 0 },
        decay_step_size: 2,
        min_mom: 0.85,
        max_mom: 0.95,
        decay_mom_rate,
    }
}

/// The optimizers with betas (and what they are without the cycle's betas).
fn cycled_kinds() -> Vec<(OptimizerKind, OptimizerKind)> {
    let c = Some(cycle(0.01));
    let adam = AdamParams { weight_decay: 0.1, adam_w_mode: false, ..AdamParams::default() };
    let lamb = LambParams { weight_decay: 0.01, ..LambParams::default() };
    let lion = LionParams { weight_decay: 0.1, ..LionParams::default() };
    vec![
        (OptimizerKind::Adam(AdamParams { momentum_cycle: c, ..adam }), OptimizerKind::Adam(adam)),
        (OptimizerKind::Lamb(LambParams { momentum_cycle: c, ..lamb }), OptimizerKind::Lamb(lamb)),
        (OptimizerKind::Lion(LionParams { momentum_cycle: c, ..lion }), OptimizerKind::Lion(lion)),
    ]
}

/// The same kind with fixed betas.
fn with_betas(kind: OptimizerKind, betas: (f32, f32)) -> OptimizerKind {
    match kind {
        OptimizerKind::Adam(p) => OptimizerKind::Adam(AdamParams { betas, ..p }),
        OptimizerKind::Lamb(p) => OptimizerKind::Lamb(LambParams { betas, ..p }),
        OptimizerKind::Lion(p) => OptimizerKind::Lion(LionParams { betas, ..p }),
        other => other,
    }
}

const SIZES: [usize; 3] = [300, 17, 1000];
const DECAY: [bool; 3] = [true, false, true];
const STEPS: usize = 9;

fn saved(s: &OptimizerShard) -> Vec<(&'static str, Vec<f32>)> {
    s.state_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect()
}

/// Each step of a cycled shard is the step a shard with that step's betas fixed takes from
/// the same state: Adam (L2 mode), Lamb and Lion all read the cycle, on their own step count,
/// with bias corrections from the current betas. Through the cycle's rise, fall and decay.
#[test]
fn every_optimizer_with_betas_steps_with_the_cycles_betas() {
    let layout = FlatLayout::from_sizes(&SIZES).expect("layout");
    let n = layout.total();
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &DECAY };
    for (kind, plain) in cycled_kinds() {
        let mut rng = Rng::new(11);
        let (mut p, mut q) = (rng.vec(n), Vec::new());
        q.clone_from(&p);
        let mut cycled = OptimizerShard::new(kind, n);
        let mut fixed = OptimizerShard::new(plain, n);
        let mut betas_seen = Vec::new();
        for k in 0..STEPS as u64 {
            let g = rng.vec(n);
            let betas = kind.betas_at(k).expect("betas");
            assert_eq!(betas.1, ONE_CYCLE_BETA2, "{}", kind.name());
            betas_seen.push(betas.0);
            let mut one = OptimizerShard::new(with_betas(plain, betas), n);
            one.load_state(k, &saved(&fixed)).expect("load");
            one.step(&mut q, &g, 1e-2, &ctx, &mut LocalReduce).expect("fixed step");
            fixed = one;
            cycled.step(&mut p, &g, 1e-2, &ctx, &mut LocalReduce).expect("cycled step");
            assert_bits_eq(&p, &q, &format!("{} step {}", kind.name(), k + 1));
            for ((_, a), (_, b)) in cycled.state_buffers().into_iter().zip(fixed.state_buffers()) {
                assert_bits_eq(a, b, &format!("{} state after step {}", kind.name(), k + 1));
            }
        }
        // The minimum first, again at the lr's peak, the maximum at the cycle's end, then the decay.
        assert_eq!(betas_seen[0], 0.85);
        assert!(betas_seen[3] < betas_seen[4] && betas_seen[5] == 0.95 && betas_seen[6] > 0.95, "{betas_seen:?}");
        // The cycle changes the result: the configured betas alone give other bits.
        let mut rng = Rng::new(11);
        let mut r = rng.vec(n);
        let mut plain_shard = OptimizerShard::new(plain, n);
        for _ in 0..STEPS {
            plain_shard.step(&mut r, &rng.vec(n), 1e-2, &ctx, &mut LocalReduce).expect("plain step");
        }
        assert!(r.iter().zip(&p).any(|(a, b)| a.to_bits() != b.to_bits()), "{}: the cycle changed nothing", kind.name());
    }
}

/// A shard restored mid-cycle from its step count and buffers (a checkpoint, a replica's full
/// copy) continues with the same betas: the bits of an uninterrupted run.
#[test]
fn a_shard_restored_mid_cycle_continues_bit_exactly() {
    let layout = FlatLayout::from_sizes(&SIZES).expect("layout");
    let n = layout.total();
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &DECAY };
    for (kind, _) in cycled_kinds() {
        let mut rng = Rng::new(5);
        let p0 = rng.vec(n);
        let grads: Vec<Vec<f32>> = (0..STEPS).map(|_| rng.vec(n)).collect();
        let (mut straight, mut p) = (OptimizerShard::new(kind, n), p0.clone());
        for g in &grads {
            straight.step(&mut p, g, 3e-3, &ctx, &mut LocalReduce).expect("step");
        }
        let (mut first, mut q) = (OptimizerShard::new(kind, n), p0);
        for g in &grads[..4] {
            first.step(&mut q, g, 3e-3, &ctx, &mut LocalReduce).expect("step");
        }
        let mut resumed = OptimizerShard::new(kind, n);
        resumed.load_state(first.step_count(), &saved(&first)).expect("load");
        for g in &grads[4..] {
            resumed.step(&mut q, g, 3e-3, &ctx, &mut LocalReduce).expect("step");
        }
        assert_bits_eq(&p, &q, &format!("{}: resumed at step 4", kind.name()));
    }
}

/// A post-cycle decay that takes β1 to 1 or beyond is refused at that step, before anything
/// changes; bounds outside [0, 1) are refused by `validate`.
#[test]
fn cycled_betas_outside_the_unit_interval_are_refused() {
    let layout = FlatLayout::from_sizes(&[8]).expect("layout");
    let ctx = StepContext { shard_range: 0..8, layout: &layout, decay: &[true] };
    // The cycle is 5 updates long; update 7 is the first decay step: 0.95·(1 + 0.2·1/2) > 1.
    let kind = OptimizerKind::Adam(AdamParams { momentum_cycle: Some(cycle(0.2)), ..AdamParams::default() });
    let mut shard = OptimizerShard::new(kind, 8);
    let mut p = vec![0.5f32; 8];
    for _ in 0..6 {
        shard.step(&mut p, &[0.1; 8], 1e-2, &ctx, &mut LocalReduce).expect("inside the cycle");
    }
    assert!(kind.betas_at(6).expect("betas").0 >= 1.0);
    let (before, state) = (p.clone(), saved(&shard));
    let err = shard.step(&mut p, &[0.1; 8], 1e-2, &ctx, &mut LocalReduce).expect_err("beta1 >= 1");
    assert!(matches!(err, OptimError::InvalidParam { name: "betas.0", .. }), "{err:?}");
    assert!(err.to_string().contains("decay_mom_rate"), "{err}");
    assert_eq!(shard.step_count(), 6);
    assert_bits_eq(&p, &before, "masters after a refused step");
    assert_eq!(saved(&shard), state, "state after a refused step");
    let bad = MomentumCycle { max_mom: 1.0, ..cycle(0.0) };
    let err = OptimizerKind::Lion(LionParams { momentum_cycle: Some(bad), ..LionParams::default() }).validate();
    assert!(matches!(err, Err(OptimError::InvalidParam { name: "cycle_max_mom", .. })), "{err:?}");
}
