//! Each optimizer against a plain f64 for-loop reference over several steps.

use super::super::{
    AdamParams, FlatLayout, LambParams, LionParams, LocalReduce, NormAllReduce, OptimError, OptimizerKind, OptimizerShard, SgdParams,
    StepContext,
};
use super::{assert_close, element_decay, Rng};

const SIZES: [usize; 5] = [37, 1000, 5, 20000, 300];
const DECAY: [bool; 5] = [true, false, true, true, false];
const LRS: [f32; 4] = [1e-2, 5e-3, 2e-2, 1e-2];

struct Case {
    layout: FlatLayout,
    p0: Vec<f32>,
    grads: Vec<Vec<f32>>,
}

fn case(seed: u64) -> Case {
    let layout = FlatLayout::from_sizes(&SIZES).expect("layout");
    let mut rng = Rng::new(seed);
    let n = layout.total();
    let p0 = rng.vec(n);
    let grads = LRS.iter().map(|_| rng.vec(n)).collect();
    Case { layout, p0, grads }
}

/// Runs all steps on one shard covering everything; returns the final weights and the shard.
fn run(kind: OptimizerKind, c: &Case) -> (Vec<f32>, OptimizerShard) {
    let n = c.layout.total();
    let mut shard = OptimizerShard::new(kind, n);
    let mut p = c.p0.clone();
    let ctx = StepContext { shard_range: 0..n, layout: &c.layout, decay: &DECAY };
    for (g, &lr) in c.grads.iter().zip(&LRS) {
        shard.step(&mut p, g, lr, &ctx, &mut LocalReduce).expect("step");
    }
    assert_eq!(shard.step_count(), LRS.len() as u64);
    (p, shard)
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn adam_ref(hp: &AdamParams, c: &Case) -> Vec<f64> {
    let mut p = f64s(&c.p0);
    let n = p.len();
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let dec = element_decay(c.layout.segments(), &DECAY);
    let (b1, b2) = (f64::from(hp.betas.0), f64::from(hp.betas.1));
    let (eps, wd) = (f64::from(hp.eps), f64::from(hp.weight_decay));
    for (t, (g, &lr)) in c.grads.iter().zip(&LRS).enumerate() {
        let lr = f64::from(lr);
        let step = (t + 1) as i32;
        let (bc1, bc2) = if hp.bias_correction { (1.0 - b1.powi(step), 1.0 - b2.powi(step)) } else { (1.0, 1.0) };
        for i in 0..n {
            let mut gi = f64::from(g[i]);
            let wdi = if dec[i] { wd } else { 0.0 };
            if hp.adam_w_mode {
                p[i] *= 1.0 - lr * wdi;
            } else {
                gi += wdi * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            p[i] -= lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
        }
    }
    p
}

#[test]
fn adam_matches_reference_in_all_modes() {
    let c = case(1);
    let variants = [
        AdamParams { lr: 123.0, weight_decay: 0.1, ..AdamParams::default() },
        AdamParams { weight_decay: 0.1, adam_w_mode: false, ..AdamParams::default() },
        AdamParams { bias_correction: false, weight_decay: 0.05, ..AdamParams::default() },
        AdamParams { betas: (0.3, 0.5), eps: 1e-6, ..AdamParams::default() },
    ];
    for hp in variants {
        let (p, shard) = run(OptimizerKind::Adam(hp), &c);
        assert_close(&p, &adam_ref(&hp, &c), 2e-6, 2e-6, &format!("adam {hp:?}"));
        let names: Vec<_> = shard.state_buffers().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["exp_avg", "exp_avg_sq"]);
    }
}

#[test]
fn adamw_decay_is_decoupled_and_adam_decay_is_l2() {
    let layout = FlatLayout::from_sizes(&[4, 4]).expect("layout");
    let p0 = [0.5f32, -2.0, 1.0, 3.0, 0.5, -2.0, 1.0, 3.0];
    let zero = [0.0f32; 8];
    let decay = [true, false];
    let ctx = StepContext { shard_range: 0..8, layout: &layout, decay: &decay };
    let (lr, wd) = (0.1f32, 0.5f32);
    for adam_w_mode in [true, false] {
        let hp = AdamParams { weight_decay: wd, adam_w_mode, ..AdamParams::default() };
        let mut shard = OptimizerShard::new(OptimizerKind::Adam(hp), 8);
        let mut p = p0;
        shard.step(&mut p, &zero, lr, &ctx, &mut LocalReduce).expect("step");
        for i in 0..4 {
            let p = f64::from(p[i]);
            let x = f64::from(p0[i]);
            // AdamW: zero gradient keeps the moments at 0, only the decay shrinks p.
            // Adam (L2): the decay term wd·p is the gradient, normalised by Adam to ±1.
            let want = if adam_w_mode { x * (1.0 - f64::from(lr * wd)) } else { x - f64::from(lr) * x.signum() };
            assert!((p - want).abs() < 1e-6, "mode {adam_w_mode} elem {i}: {p} vs {want}");
        }
        assert_eq!(p[4..], p0[4..], "no decay on the second tensor");
    }
}

fn lamb_ref(hp: &LambParams, c: &Case) -> Vec<f64> {
    let mut p = f64s(&c.p0);
    let n = p.len();
    let (mut m, mut v, mut u) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let (b1, b2) = (f64::from(hp.betas.0), f64::from(hp.betas.1));
    for (t, (g, &lr)) in c.grads.iter().zip(&LRS).enumerate() {
        let step = (t + 1) as i32;
        let (bc1, bc2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        let step_size = f64::from(lr) * bc2.sqrt() / bc1;
        for (seg, &dec) in c.layout.segments().iter().zip(&DECAY) {
            let wd = if dec { f64::from(hp.weight_decay) } else { 0.0 };
            let (mut wn, mut un) = (0.0, 0.0);
            for i in seg.clone() {
                let gi = f64::from(g[i]);
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                u[i] = m[i] / (v[i].sqrt() + f64::from(hp.eps)) + wd * p[i];
                wn += p[i] * p[i];
                un += u[i] * u[i];
            }
            let (wn, un) = (wn.sqrt(), un.sqrt());
            let ratio = if wn == 0.0 || un == 0.0 { 1.0 } else { (wn / un).clamp(f64::from(hp.min_coeff), f64::from(hp.max_coeff)) };
            for i in seg.clone() {
                p[i] -= step_size * ratio * u[i];
            }
        }
    }
    p
}

#[test]
fn lamb_matches_reference() {
    let c = case(2);
    let hp = LambParams { weight_decay: 0.01, ..LambParams::default() };
    let (p, _) = run(OptimizerKind::Lamb(hp), &c);
    assert_close(&p, &lamb_ref(&hp, &c), 2e-6, 2e-6, "lamb");
}

#[test]
fn lamb_trust_ratio_is_clamped_per_tensor() {
    // Tensor 0: huge weights → ratio above max_coeff. Tensor 1: tiny weights → below min_coeff.
    // Tensor 2: zero weights → ratio 1. Tensor 3: O(1) weights → unclamped.
    let mut c = case(3);
    let segs = c.layout.segments().to_vec();
    for i in segs[0].clone() {
        c.p0[i] = 100.0;
    }
    for i in segs[1].clone() {
        c.p0[i] = 1e-4;
    }
    for i in segs[2].clone() {
        c.p0[i] = 0.0;
    }
    let hp = LambParams::default();
    let mut shard = OptimizerShard::new(OptimizerKind::Lamb(hp), c.layout.total());
    let mut p = c.p0.clone();
    let ctx = StepContext { shard_range: 0..c.layout.total(), layout: &c.layout, decay: &DECAY };
    shard.step(&mut p, &c.grads[0], LRS[0], &ctx, &mut LocalReduce).expect("step");
    let r = shard.last_trust_ratios();
    assert_eq!(r[0], hp.max_coeff);
    assert_eq!(r[1], hp.min_coeff);
    assert_eq!(r[2], 1.0);
    assert!(r[3] > hp.min_coeff && r[3] < hp.max_coeff, "unclamped ratio {}", r[3]);
    let one = Case { layout: c.layout.clone(), p0: c.p0.clone(), grads: vec![c.grads[0].clone()] };
    assert_close(&p, &lamb_ref(&hp, &one), 2e-6, 2e-6, "lamb clamp step");
}

/// A norm all-reduce whose peer is gone.
struct LostPeer;

impl NormAllReduce for LostPeer {
    fn all_reduce_sum(&mut self, _v: &mut [f64]) -> Result<(), String> {
        Err("rank 2 is gone".into())
    }
}

/// A LAMB step whose norm all-reduce fails changes nothing (masters, moments, trust ratios,
/// step count), and running it again gives exactly the bits of a step that never failed: an
/// elastic run restores such a shard from memory and reruns the step.
#[test]
fn a_failed_lamb_norm_reduction_leaves_the_shard_untouched() {
    let c = case(4);
    let hp = LambParams { weight_decay: 0.01, ..LambParams::default() };
    let n = c.layout.total();
    let ctx = StepContext { shard_range: 0..n, layout: &c.layout, decay: &DECAY };
    let mut shard = OptimizerShard::new(OptimizerKind::Lamb(hp), n);
    let mut p = c.p0.clone();
    shard.step(&mut p, &c.grads[0], LRS[0], &ctx, &mut LocalReduce).expect("step 1");
    let bits = |p: &[f32], s: &OptimizerShard| {
        let mut all: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
        for (_, b) in s.state_buffers() {
            all.extend(b.iter().map(|x| x.to_bits()));
        }
        all.extend(s.last_trust_ratios().iter().map(|x| x.to_bits()));
        (all, s.step_count())
    };
    let before = bits(&p, &shard);
    let e = shard.step(&mut p, &c.grads[1], LRS[1], &ctx, &mut LostPeer).expect_err("the reduction failed");
    assert!(matches!(&e, OptimError::NormReduce(m) if m == "rank 2 is gone"), "{e}");
    assert!(e.to_string().contains("norm all-reduce failed"), "{e}");
    assert_eq!(bits(&p, &shard), before, "a failed step changed the shard");
    shard.step(&mut p, &c.grads[1], LRS[1], &ctx, &mut LocalReduce).expect("step 2 again");

    let mut clean = OptimizerShard::new(OptimizerKind::Lamb(hp), n);
    let mut q = c.p0.clone();
    for (g, &lr) in c.grads.iter().zip(&LRS).take(2) {
        clean.step(&mut q, g, lr, &ctx, &mut LocalReduce).expect("clean step");
    }
    assert_eq!(bits(&p, &shard), bits(&q, &clean), "the rerun step differs from a fault-free one");
}

fn lion_ref(hp: &LionParams, c: &Case) -> Vec<f64> {
    let mut p = f64s(&c.p0);
    let mut m = vec![0.0; p.len()];
    let dec = element_decay(c.layout.segments(), &DECAY);
    let (b1, b2) = (f64::from(hp.betas.0), f64::from(hp.betas.1));
    for (g, &lr) in c.grads.iter().zip(&LRS) {
        let lr = f64::from(lr);
        for i in 0..p.len() {
            let gi = f64::from(g[i]);
            let cc = b1 * m[i] + (1.0 - b1) * gi;
            let s = if cc > 0.0 {
                1.0
            } else if cc < 0.0 {
                -1.0
            } else {
                0.0
            };
            let wd = if dec[i] { f64::from(hp.weight_decay) } else { 0.0 };
            p[i] = p[i] * (1.0 - lr * wd) - lr * s;
            m[i] = b2 * m[i] + (1.0 - b2) * gi;
        }
    }
    p
}

#[test]
fn lion_matches_reference() {
    let c = case(4);
    let hp = LionParams { weight_decay: 0.1, ..LionParams::default() };
    let (p, shard) = run(OptimizerKind::Lion(hp), &c);
    assert_close(&p, &lion_ref(&hp, &c), 1e-6, 1e-6, "lion");
    assert_eq!(shard.state_buffers()[0].0, "exp_avg");
}

fn sgd_ref(hp: &SgdParams, c: &Case) -> Vec<f64> {
    let mut p = f64s(&c.p0);
    let mut b = vec![0.0; p.len()];
    let dec = element_decay(c.layout.segments(), &DECAY);
    let (mu, damp) = (f64::from(hp.momentum), f64::from(hp.dampening));
    for (t, (g, &lr)) in c.grads.iter().zip(&LRS).enumerate() {
        for i in 0..p.len() {
            let wd = if dec[i] { f64::from(hp.weight_decay) } else { 0.0 };
            let mut d = f64::from(g[i]) + wd * p[i];
            if mu != 0.0 {
                b[i] = if t == 0 { d } else { mu * b[i] + (1.0 - damp) * d };
                d = if hp.nesterov { d + mu * b[i] } else { b[i] };
            }
            p[i] -= f64::from(lr) * d;
        }
    }
    p
}

#[test]
fn sgd_matches_reference() {
    let c = case(5);
    let variants = [
        SgdParams { weight_decay: 0.1, ..SgdParams::default() },
        SgdParams { momentum: 0.9, dampening: 0.1, weight_decay: 0.01, ..SgdParams::default() },
        SgdParams { momentum: 0.9, nesterov: true, weight_decay: 0.01, ..SgdParams::default() },
    ];
    for hp in variants {
        let (p, shard) = run(OptimizerKind::Sgd(hp), &c);
        assert_close(&p, &sgd_ref(&hp, &c), 1e-6, 1e-6, &format!("sgd {hp:?}"));
        let want: &[&str] = if hp.momentum != 0.0 { &["momentum_buffer"] } else { &[] };
        let names: Vec<_> = shard.state_buffers().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, want);
    }
}

#[test]
fn invalid_params_are_rejected() {
    let bad = [
        OptimizerKind::Adam(AdamParams { betas: (1.0, 0.999), ..AdamParams::default() }),
        OptimizerKind::Adam(AdamParams { lr: -1.0, ..AdamParams::default() }),
        OptimizerKind::Lamb(LambParams { min_coeff: 2.0, max_coeff: 1.0, ..LambParams::default() }),
        OptimizerKind::Lion(LionParams { weight_decay: f32::NAN, ..LionParams::default() }),
        OptimizerKind::Sgd(SgdParams { nesterov: true, ..SgdParams::default() }),
    ];
    for k in bad {
        assert!(k.validate().is_err(), "{k:?} should be invalid");
    }
    let good = [
        OptimizerKind::Adam(AdamParams::default()),
        OptimizerKind::Lamb(LambParams::default()),
        OptimizerKind::Lion(LionParams::default()),
        OptimizerKind::Sgd(SgdParams { momentum: 0.9, nesterov: true, ..SgdParams::default() }),
    ];
    for k in good {
        assert_eq!(k.validate(), Ok(()), "{k:?}");
    }
}
