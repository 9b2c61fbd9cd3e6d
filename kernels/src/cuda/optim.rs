//! The CPU engine's optimizers ([`crate::optim`]) on the device: one update's scalars
//! ([`OptimStep`], made by the CPU optimizer's own coefficient code, so both sides round the
//! same f64 values to f32 once) and one launch over a run of a flat shard ([`step`]):
//! Adam/AdamW (the `adamw` kernel: AdamW's decoupled decay or Adam's L2 penalty, bias
//! correction on or off), SGD (momentum, dampening, Nesterov, or none), Lion and Adagrad
//! (`lr_decay`, initial accumulator), each in `cuda/ops.cu` beside the CPU kernel's formula.
//!
//! Every kernel is elementwise — one thread an element, no reduction, no atomics — so a step
//! gives the same bits on every run and for any split of the shard, and on normal values the
//! same bits as `OptimizerShard::step` on the CPU (the operations are the CPU's, one explicit
//! round-to-nearest each, never contracted). The module is compiled with fast math, which flushes
//! subnormal inputs and results to zero where the CPU keeps them. [`check`] compares several
//! consecutive steps of each configuration with the CPU optimizer bit for bit.
//!
//! LAMB is not elementwise (its trust ratios need per-tensor norms of the weights and of the
//! updates): [`OptimStep::Lamb`] carries its scalars and `cuda::lamb::step` runs it over a buffer
//! holding every tensor; [`step`] refuses it.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::ops::{adamw, AdamStep, OptimBufs};
use super::{bf16, drv, grid_1d, CheckRow, DPtr, Gpu, GpuError, Result};
use crate::optim::{AdagradCoeffs, FlatLayout, LambParams, LocalReduce, OptimizerKind, OptimizerShard, StepContext};

/// SGD's scalars of one update (`optim::sgd`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    pub lr: f32,
    /// L2 weight decay, applied where the decay mask is set.
    pub weight_decay: f32,
    pub momentum: f32,
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    /// The first update: the momentum buffer starts as the (decayed) gradient.
    pub first: bool,
    /// Whether a momentum buffer is kept (momentum ≠ 0).
    pub has_momentum: bool,
}

/// Lion's scalars of one update (`optim::lion`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionStep {
    pub lr: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// 1 − lr·wd, applied where the decay mask is set.
    pub after_decay: f32,
}

/// LAMB's update: its hyper-parameters, the learning rate and the 1-based update number
/// (`cuda::lamb::step` forms the scalars with the CPU's own `LambParams` code).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambStep {
    pub params: LambParams,
    pub lr: f32,
    pub step: u64,
}

/// One update's scalars, by optimizer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimStep {
    Adam(AdamStep),
    Sgd(SgdStep),
    Lion(LionStep),
    Lamb(LambStep),
    /// Adagrad's scalars (`optim::adagrad`: −lr/(1 + (t−1)·lr_decay), eps, weight decay).
    Adagrad(AdagradCoeffs),
}

impl OptimStep {
    /// The scalars of update `step` (1-based) of `kind` at learning rate `lr` (this step's
    /// betas under OneCycle's momentum cycle).
    pub fn new(kind: &OptimizerKind, lr: f32, step: u64) -> Result<OptimStep> {
        if step == 0 {
            return Err(GpuError::Invalid("an optimizer update is numbered from 1; got update 0".into()));
        }
        Ok(match kind {
            OptimizerKind::Adam(p) => OptimStep::Adam(AdamStep::of(p, lr, step)),
            OptimizerKind::Sgd(p) => OptimStep::Sgd(SgdStep {
                lr,
                weight_decay: p.weight_decay,
                momentum: p.momentum,
                one_minus_dampening: (1.0 - f64::from(p.dampening)) as f32,
                nesterov: p.nesterov,
                first: step == 1,
                has_momentum: p.has_momentum(),
            }),
            OptimizerKind::Lion(p) => {
                let c = p.coeffs(lr, step);
                OptimStep::Lion(LionStep {
                    lr: c.lr,
                    beta1: c.beta1,
                    one_minus_beta1: c.one_minus_beta1,
                    beta2: c.beta2,
                    one_minus_beta2: c.one_minus_beta2,
                    after_decay: c.after_decay,
                })
            }
            OptimizerKind::Lamb(p) => OptimStep::Lamb(LambStep { params: *p, lr, step }),
            OptimizerKind::Adagrad(p) => OptimStep::Adagrad(p.coeffs(lr, step)),
        })
    }

    /// The learning rate of this update (Adagrad's after its `lr_decay`).
    pub fn lr(&self) -> f32 {
        match self {
            OptimStep::Adam(a) => a.lr,
            OptimStep::Sgd(s) => s.lr,
            OptimStep::Lion(l) => l.lr,
            OptimStep::Lamb(l) => l.lr,
            OptimStep::Adagrad(a) => -a.neg_clr,
        }
    }

    /// How many f32 state buffers (`m`, then `v`) the optimizer keeps per element.
    pub fn states(&self) -> usize {
        match self {
            OptimStep::Adam(_) | OptimStep::Lamb(_) => 2,
            OptimStep::Sgd(s) => usize::from(s.has_momentum),
            OptimStep::Lion(_) | OptimStep::Adagrad(_) => 1,
        }
    }
}

/// Whether `kind` runs unit by unit through [`step`] (everything but LAMB, which needs every
/// tensor's norms first: `cuda::lamb::step`).
pub fn elementwise(kind: &OptimizerKind) -> bool {
    !matches!(kind, OptimizerKind::Lamb(_))
}

fn check_len<T>(what: &str, p: DPtr<T>, len: usize) {
    assert!(p.len == len, "{what}: {} elements, expected {len}", p.len);
}

/// One update of `hp`'s optimizer over `bufs` (gradient multiplied by `grad_scale` first: the
/// clipping coefficient). `bufs.m` / `bufs.v` must be as long as `master` where the optimizer
/// keeps that state ([`OptimStep::states`]) and are not touched otherwise. LAMB is an error:
/// it is not elementwise (`cuda::lamb::step`).
pub fn step(gpu: &Gpu, s: &CudaStream, bufs: &OptimBufs, hp: &OptimStep, grad_scale: f32) -> Result<()> {
    let OptimBufs { master, param, grad, m, v: _, decay } = *bufs;
    let len = master.len;
    let (lr, wd_or_b1) = match hp {
        OptimStep::Adam(a) => return adamw(gpu, s, bufs, a, grad_scale),
        OptimStep::Sgd(c) => (c.lr, c.weight_decay),
        OptimStep::Lion(c) => (c.lr, c.beta1),
        OptimStep::Adagrad(c) => (c.neg_clr, c.wd),
        OptimStep::Lamb(_) => {
            return Err(GpuError::Invalid("LAMB is not elementwise: it runs over every tensor at once (cuda::lamb::step)".into()))
        }
    };
    check_len("optimizer param", param, len);
    check_len("optimizer grad", grad, len);
    check_len("optimizer decay mask", decay, len);
    if hp.states() > 0 {
        check_len("optimizer state m", m, len);
    }
    if len == 0 {
        return Ok(());
    }
    assert!(len.div_ceil(256) <= i32::MAX as usize, "optimizer step: {len} elements exceed the grid limit");
    let (len_u, cfg) = (len as u64, grid_1d(len, 256));
    match hp {
        OptimStep::Sgd(c) => {
            let f = gpu.func("ops", "sgd")?;
            let (nesterov, first, has_m) = (i32::from(c.nesterov), i32::from(c.first), i32::from(c.has_momentum));
            let mut lb = s.launch_builder(&f);
            lb.arg(&master.raw).arg(&param.raw).arg(&grad.raw).arg(&m.raw).arg(&decay.raw).arg(&len_u);
            lb.arg(&lr).arg(&wd_or_b1).arg(&c.momentum).arg(&c.one_minus_dampening);
            lb.arg(&nesterov).arg(&first).arg(&has_m).arg(&grad_scale);
            // SAFETY: the arguments match `sgd` in ops.cu (pointers as u64, `int` as i32, `u64`,
            // `float` as f32); every buffer the kernel touches was checked to hold `len` elements
            // (`m` only read or written when the optimizer keeps it).
            unsafe { lb.launch(cfg) }.map(|_| ()).map_err(drv("launching ops.cu kernel `sgd`"))
        }
        OptimStep::Lion(c) => {
            let f = gpu.func("ops", "lion")?;
            let mut lb = s.launch_builder(&f);
            lb.arg(&master.raw).arg(&param.raw).arg(&grad.raw).arg(&m.raw).arg(&decay.raw).arg(&len_u);
            lb.arg(&lr).arg(&wd_or_b1).arg(&c.one_minus_beta1).arg(&c.beta2).arg(&c.one_minus_beta2).arg(&c.after_decay);
            lb.arg(&grad_scale);
            // SAFETY: as above, for `lion` in ops.cu.
            unsafe { lb.launch(cfg) }.map(|_| ()).map_err(drv("launching ops.cu kernel `lion`"))
        }
        OptimStep::Adagrad(c) => {
            let f = gpu.func("ops", "adagrad")?;
            let mut lb = s.launch_builder(&f);
            lb.arg(&master.raw).arg(&param.raw).arg(&grad.raw).arg(&m.raw).arg(&decay.raw).arg(&len_u);
            lb.arg(&lr).arg(&c.eps).arg(&wd_or_b1).arg(&grad_scale);
            // SAFETY: as above, for `adagrad` in ops.cu (`m` is the accumulator `sum`).
            unsafe { lb.launch(cfg) }.map(|_| ()).map_err(drv("launching ops.cu kernel `adagrad`"))
        }
        OptimStep::Adam(_) | OptimStep::Lamb(_) => unreachable!("returned above"),
    }
}

// ---------------------------------------------------------------------------------------------
// `tessera gpu check`: each configuration against `OptimizerShard::step`
// ---------------------------------------------------------------------------------------------

/// Steps of each configuration compared (SGD's first update differs from the later ones).
const CHECK_STEPS: u64 = 3;

/// The configurations [`check`] runs: each optimizer, with its less common options.
fn check_kinds() -> Vec<(&'static str, OptimizerKind)> {
    use crate::optim::{AdagradParams, AdamParams, CycleShape, LionParams, MomentumCycle, SgdParams};
    let adam = AdamParams { lr: 6e-4, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, ..AdamParams::default() };
    let shape = CycleShape { first_step_size: 2, second_step_size: 2, first_stair_count: 0, second_stair_count: 0 };
    let cycle = MomentumCycle { shape, decay_step_size: 0, min_mom: 0.85, max_mom: 0.95, decay_mom_rate: 0.0 };
    let sgd = SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, nesterov: false };
    vec![
        ("AdamW", OptimizerKind::Adam(adam)),
        ("Adam (L2 penalty)", OptimizerKind::Adam(AdamParams { adam_w_mode: false, ..adam })),
        ("Adam without bias correction", OptimizerKind::Adam(AdamParams { bias_correction: false, ..adam })),
        ("AdamW with OneCycle's momentum cycle", OptimizerKind::Adam(AdamParams { momentum_cycle: Some(cycle), ..adam })),
        ("SGD", OptimizerKind::Sgd(SgdParams { momentum: 0.0, dampening: 0.0, ..sgd })),
        ("SGD with momentum and dampening", OptimizerKind::Sgd(sgd)),
        ("SGD with Nesterov momentum", OptimizerKind::Sgd(SgdParams { dampening: 0.0, nesterov: true, ..sgd })),
        ("Lion", OptimizerKind::Lion(LionParams { lr: 1e-4, betas: (0.9, 0.99), weight_decay: 0.1, momentum_cycle: None })),
        ("Adagrad", OptimizerKind::Adagrad(AdagradParams { lr: 1e-2, weight_decay: 0.01, ..AdagradParams::default() })),
        (
            "Adagrad with lr_decay and an initial accumulator",
            OptimizerKind::Adagrad(AdagradParams { lr: 5e-2, lr_decay: 0.1, eps: 1e-8, weight_decay: 0.0, initial_accumulator_value: 0.1 }),
        ),
    ]
}

/// Each configuration of [`check_kinds`]: [`CHECK_STEPS`] updates on the GPU and by the CPU's
/// `OptimizerShard::step` from the same masters with the same gradients, over tensors
/// alternating decay / no decay; the masters, the bf16 parameters and every state buffer must
/// be bit-identical after each step. Values stay normal (no subnormals, see the module notes).
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let sizes: Vec<usize> = (0..40).map(|k| 1000 + 7919 * k % 5000).collect();
    let layout = FlatLayout::from_sizes(&sizes).map_err(|e| GpuError::Invalid(format!("check layout: {e}")))?;
    let len = layout.total();
    let decay: Vec<bool> = (0..sizes.len()).map(|k| k % 2 == 0).collect();
    let mask: Vec<u8> = sizes.iter().zip(&decay).flat_map(|(&n, &d)| std::iter::repeat_n(u8::from(d), n)).collect();
    let master0 = normal(seed, 70, len, 0.02);
    let mut rows = Vec::new();
    for (name, kind) in check_kinds() {
        let mut cpu = OptimizerShard::new(kind, len);
        let mut p = master0.clone();
        let (d_master, d_mask) = (gpu.upload(&master0)?, gpu.upload(&mask)?);
        let d_param = gpu.alloc::<bf16>(len)?;
        let init = vec![kind.state_init(); len];
        let (d_m, d_v) = (gpu.upload(&init)?, gpu.upload(&init)?);
        let mut equal = true;
        for step in 1..=CHECK_STEPS {
            let grad = normal(seed, 80 + step, len, 1e-2);
            let lr = 0.7f32.powi(step as i32 - 1) * kind.lr();
            let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &decay };
            cpu.step(&mut p, &grad, lr, &ctx, &mut LocalReduce).map_err(|e| GpuError::Invalid(format!("CPU {name} step: {e}")))?;
            let d_grad = gpu.upload(&grad)?;
            let hp = OptimStep::new(&kind, lr, step)?;
            let bufs = OptimBufs {
                master: d_master.ptr(),
                param: d_param.ptr(),
                grad: d_grad.ptr(),
                m: d_m.ptr(),
                v: d_v.ptr(),
                decay: d_mask.ptr(),
            };
            self::step(gpu, &gpu.stream, &bufs, &hp, 1.0)?;
            let (gm, gp) = (gpu.download(d_master.ptr())?, gpu.download(d_param.ptr())?);
            let mut same = bits(&gm) == bits(&p) && gp.iter().zip(&p).all(|(g, c)| g.to_bits() == bf16::from_f32(*c).to_bits());
            let states = [gpu.download(d_m.ptr())?, gpu.download(d_v.ptr())?];
            for ((_, want), got) in cpu.state_buffers().into_iter().zip(&states) {
                same &= bits(got) == bits(want);
            }
            equal &= same;
        }
        let what = kind.state_names().join(", ");
        rows.push(CheckRow {
            name: format!(
                "{name}: {CHECK_STEPS} steps, masters, bf16 params{} = CPU OptimizerShard::step (bits)",
                if what.is_empty() { String::new() } else { format!(", {what}") }
            ),
            max_abs: 0.0,
            max_rel: f64::from(u8::from(!equal)),
            tol: 0.0,
            non_finite: false,
        });
    }
    Ok(rows)
}

pub(crate) fn normal(seed: u64, key: u64, len: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; len];
    crate::tensor::Rng::derive(seed, &[0x6f70_7469, key]).fill_normal(&mut v, std);
    // Keep every value normal: the GPU flushes subnormals, the CPU does not.
    v.iter_mut().filter(|x| x.abs() < 1e-30).for_each(|x| *x = 1e-30f32.copysign(*x));
    v
}

/// Every value's bits (the check rows compare them).
pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamParams, SgdParams};

    /// The scalars each optimizer's kernel receives (no GPU needed).
    #[test]
    fn each_update_takes_the_cpu_optimizers_scalars() {
        let adam = AdamParams { lr: 1e-3, weight_decay: 0.1, ..AdamParams::default() };
        let OptimStep::Adam(w) = OptimStep::new(&OptimizerKind::Adam(adam), 1e-3, 1).unwrap() else { panic!("Adam") };
        assert_eq!((w.l2, w.decoupled_factor), (0.0, (1.0 - f64::from(1e-3f32) * f64::from(0.1f32)) as f32));
        let l2 = AdamParams { adam_w_mode: false, bias_correction: false, ..adam };
        let OptimStep::Adam(a) = OptimStep::new(&OptimizerKind::Adam(l2), 2e-3, 5).unwrap() else { panic!("Adam") };
        assert_eq!((a.l2, a.decoupled_factor, a.step_size, a.bc2_sqrt), (0.1, 1.0, 2e-3, 1.0));
        let sgd = SgdParams { lr: 0.1, momentum: 0.9, dampening: 0.25, weight_decay: 0.0, nesterov: false };
        let first = OptimStep::new(&OptimizerKind::Sgd(sgd), 0.05, 1).unwrap();
        let OptimStep::Sgd(s) = first else { panic!("SGD") };
        assert!(s.first && s.has_momentum && s.lr == 0.05 && s.one_minus_dampening == 0.75);
        let OptimStep::Sgd(s) = OptimStep::new(&OptimizerKind::Sgd(sgd), 0.05, 2).unwrap() else { panic!("SGD") };
        assert!(!s.first);
        assert_eq!(first.states(), 1);
        let plain = OptimStep::new(&OptimizerKind::Sgd(SgdParams { momentum: 0.0, ..sgd }), 0.05, 1).unwrap();
        assert_eq!(plain.states(), 0);
        let lamb = OptimizerKind::Lamb(LambParams::default());
        assert!(!elementwise(&lamb) && elementwise(&OptimizerKind::Adam(adam)));
        let l = OptimStep::new(&lamb, 2e-3, 4).unwrap();
        assert_eq!(l, OptimStep::Lamb(LambStep { params: LambParams::default(), lr: 2e-3, step: 4 }));
        assert_eq!((l.lr(), l.states()), (2e-3, 2));
        assert!(OptimStep::new(&OptimizerKind::Adam(adam), 1e-3, 0).is_err(), "updates are numbered from 1");
        let ada = crate::optim::AdagradParams { lr: 0.1, lr_decay: 0.5, eps: 1e-10, weight_decay: 0.01, initial_accumulator_value: 0.0 };
        let OptimStep::Adagrad(a) = OptimStep::new(&OptimizerKind::Adagrad(ada), 0.1, 3).unwrap() else { panic!("Adagrad") };
        // Step 3: lr / (1 + 2·0.5), formed in f64 and rounded once.
        assert_eq!((a.neg_clr, a.eps, a.wd), ((-(f64::from(0.1f32) / 2.0)) as f32, 1e-10, 0.01));
        assert!(elementwise(&OptimizerKind::Adagrad(ada)));
    }
}
