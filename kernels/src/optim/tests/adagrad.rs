//! Adagrad against torch.optim.Adagrad itself (`scripts/gen_fixtures.py adagrad`) and against a
//! plain f64 loop over a multi-tensor layout; its state, checkpoint names and parameter checks.

use serde_json::Value;

use super::super::{AdagradParams, FlatLayout, LocalReduce, OptimizerKind, OptimizerShard, StepContext};
use super::{assert_close, element_decay, Rng};

const FIXTURE: &str = include_str!("../../../tests/fixtures/adagrad.json");

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().expect("an array").iter().map(|x| x.as_f64().expect("a number")).collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("fixture lacks {key}"))
}

/// Every step's parameters and `sum` against torch's (float64 there, f32 here), with the
/// group lr changed each step, `lr_decay`, an initial accumulator and weight decay on one of
/// the two tensors.
#[test]
fn adagrad_matches_torch_step_by_step() {
    let f: Value = serde_json::from_str(FIXTURE).expect("fixture JSON");
    let sizes: Vec<usize> = f["sizes"].as_array().expect("sizes").iter().map(|s| s.as_u64().expect("size") as usize).collect();
    let layout = FlatLayout::from_sizes(&sizes).expect("layout");
    let wd = f64s(&f["weight_decay"]);
    assert!(wd[0] > 0.0 && wd[1] == 0.0, "the fixture decays the first tensor only");
    let decay = [true, false];
    let hp = AdagradParams {
        lr: 1.0,
        lr_decay: num(&f, "lr_decay") as f32,
        eps: num(&f, "eps") as f32,
        weight_decay: wd[0] as f32,
        initial_accumulator_value: num(&f, "initial_accumulator_value") as f32,
    };
    let n = layout.total();
    let mut shard = OptimizerShard::new(OptimizerKind::Adagrad(hp), n);
    assert!(shard.state_buffers()[0].1.iter().all(|&s| s == hp.initial_accumulator_value));
    let mut p: Vec<f32> = f64s(&f["p0"]).iter().map(|&x| x as f32).collect();
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &decay };
    let lrs = f64s(&f["lr"]);
    let steps = f["steps"].as_array().expect("steps");
    for (t, g) in f["grads"].as_array().expect("grads").iter().enumerate() {
        let g: Vec<f32> = f64s(g).iter().map(|&x| x as f32).collect();
        shard.step(&mut p, &g, lrs[t] as f32, &ctx, &mut LocalReduce).expect("step");
        let what = format!("step {}", t + 1);
        assert_close(&p, &f64s(&steps[t]["p"]), 1e-6, 1e-5, &format!("{what}: parameters"));
        let bufs = shard.state_buffers();
        assert_eq!(bufs[0].0, "sum", "torch's state name");
        assert_close(bufs[0].1, &f64s(&steps[t]["sum"]), 1e-6, 1e-5, &format!("{what}: sum"));
    }
    // The comparison can fail: without lr_decay the same run ends elsewhere.
    let mut plain = OptimizerShard::new(OptimizerKind::Adagrad(AdagradParams { lr_decay: 0.0, ..hp }), n);
    let mut q: Vec<f32> = f64s(&f["p0"]).iter().map(|&x| x as f32).collect();
    for (t, g) in f["grads"].as_array().expect("grads").iter().enumerate() {
        let g: Vec<f32> = f64s(g).iter().map(|&x| x as f32).collect();
        plain.step(&mut q, &g, lrs[t] as f32, &ctx, &mut LocalReduce).expect("step");
    }
    let want = f64s(&steps[steps.len() - 1]["p"]);
    let off = q.iter().zip(&want).map(|(&a, &b)| (f64::from(a) - b).abs()).fold(0.0, f64::max);
    assert!(off > 1e-4, "without lr_decay the run came within {off} of torch's");
}

/// A plain f64 loop over a layout with multi-chunk tensors (the parallel pieces) and mixed
/// decay flags.
#[test]
fn adagrad_matches_an_f64_loop_over_many_tensors() {
    let sizes = [37, 1000, 5, 40000, 300];
    let decay = [true, false, true, true, false];
    let lrs = [1e-2f32, 5e-3, 2e-2, 1e-2];
    let layout = FlatLayout::from_sizes(&sizes).expect("layout");
    let n = layout.total();
    let mut rng = Rng::new(9);
    let p0 = rng.vec(n);
    let grads: Vec<Vec<f32>> = lrs.iter().map(|_| rng.vec(n)).collect();
    let hp = AdagradParams { lr: 1.0, lr_decay: 0.05, eps: 1e-10, weight_decay: 0.1, initial_accumulator_value: 0.01 };
    let mut shard = OptimizerShard::new(OptimizerKind::Adagrad(hp), n);
    let mut p = p0.clone();
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &decay };
    for (g, &lr) in grads.iter().zip(&lrs) {
        shard.step(&mut p, g, lr, &ctx, &mut LocalReduce).expect("step");
    }
    let dec = element_decay(layout.segments(), &decay);
    let mut want: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let mut sum = vec![f64::from(hp.initial_accumulator_value); n];
    for (t, (g, &lr)) in grads.iter().zip(&lrs).enumerate() {
        let clr = f64::from(lr) / (1.0 + t as f64 * f64::from(hp.lr_decay));
        for i in 0..n {
            let wd = if dec[i] { f64::from(hp.weight_decay) } else { 0.0 };
            let gi = f64::from(g[i]) + wd * want[i];
            sum[i] += gi * gi;
            want[i] -= clr * gi / (sum[i].sqrt() + f64::from(hp.eps));
        }
    }
    assert_close(&p, &want, 1e-6, 1e-5, "adagrad");
    assert_eq!(shard.kind().state_names(), ["sum"]);
}

/// torch's constructor checks: every value finite and non-negative.
#[test]
fn adagrad_params_are_checked() {
    for bad in [
        AdagradParams { lr: -1.0, ..AdagradParams::default() },
        AdagradParams { lr_decay: -0.1, ..AdagradParams::default() },
        AdagradParams { eps: f32::NAN, ..AdagradParams::default() },
        AdagradParams { weight_decay: -1.0, ..AdagradParams::default() },
        AdagradParams { initial_accumulator_value: -1.0, ..AdagradParams::default() },
    ] {
        assert!(OptimizerKind::Adagrad(bad).validate().is_err(), "{bad:?} should be invalid");
    }
    assert_eq!(OptimizerKind::Adagrad(AdagradParams::default()).validate(), Ok(()));
}
