//! `tessera gpu check` rows for fp16 on GPU ranks (`zero::RankSpec::fp16`): the overflow
//! decisions against the CPU model's gradient stored in fp16, a run under DeepSpeed's dynamic
//! loss scaler whose skipped steps leave the state bit for bit as it was, and the same run with
//! the optimizer offloaded (host memory, a partial share, NVMe) against the GPU optimizer.

use std::sync::Arc;

use anyhow::Result;
use tessera_kernels::cuda::{self, gpt, Gpu};
use tessera_kernels::model::{FlatAccess, MicroBatch, Model, Workspace};
use tessera_kernels::optim::{DynamicLossScaler, StepOutcome};

use super::{batch, bits_row, f32_bits, offload, zero};
use crate::zoo;

/// fp16's threshold: an f32 at or beyond it rounds to ±inf in fp16 (65504 + half an ulp).
const F16_OVERFLOW: f64 = 65520.0;

/// Loss scales probed: 2^0 … 2^40.
const SCALE_POWERS: std::ops::RangeInclusive<i32> = 0..=40;

/// The rows: see the module notes.
pub fn check(gpu: Arc<Gpu>, seed: u64) -> Result<Vec<cuda::CheckRow>> {
    let (b, t) = (4usize, 128usize);
    let mut cfg = zoo::preset("gpt-mini-gpu").map_err(anyhow::Error::msg)?;
    cfg.vocab_size = 256;
    let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
    let init = model.init_params(seed);
    let shape = gpt::Shape::new(&model.cfg, b, t)?;
    let optim = zero::Optimizer::adamw((0.9, 0.95), 1e-8, 0.1, 0.0);
    let spec = |stage| zero::RankSpec {
        model: &model,
        stage,
        shape,
        init: &init,
        optim,
        m_local: 1,
        offload: None,
        recompute: false,
        fp16: true,
        nvme: None,
        params_offload: None,
    };
    let mut rows = overflow_decisions(&gpu, &model, spec(0), seed, b, t)?;
    let v = model.cfg.vocab_size;
    rows.extend(dynamic_scaler_run(&gpu, spec(2), seed, b, t, v)?);
    // The optimizer offloaded: the host worker waits for the scaler's verdict and hands an
    // overflowing step's units back unstepped.
    let on_gpu = scaler_steps(&gpu, spec(2), seed, b, t, v)?;
    let site = offload::NvmeSite { dir: std::env::temp_dir(), aio: crate::offload::AioOptions::default() };
    for (ratio, nvme) in [(1.0, None), (0.5, None), (1.0, Some(&site))] {
        let off = zero::OffloadOptions { ratio, threads: offload::default_threads(1) };
        let o = scaler_steps(&gpu, zero::RankSpec { offload: Some(off), nvme, ..spec(2) }, seed, b, t, v)?;
        let tier = if nvme.is_some() { "NVMe" } else { "host memory" };
        let tag = format!("fp16 with the optimizer offloaded ({tier}, ratio {ratio}, ZeRO-2) vs on the GPU");
        rows.push(bits_row(format!("{tag}: steps skipped ({} of {SCALER_STEPS}) and loss scales", o.1), &o.2, &on_gpu.2));
        rows.push(bits_row(format!("{tag}: masters and moments after {SCALER_STEPS} steps"), &o.0, &on_gpu.0));
    }
    // LAMB's two-phase host step under the scaler (an overflow hands every held unit back).
    let lamb = tessera_kernels::optim::LambParams { lr: 2e-3, weight_decay: 0.01, ..Default::default() };
    let lamb = zero::Optimizer { kind: tessera_kernels::optim::OptimizerKind::Lamb(lamb), clip: 0.0 };
    let on_gpu = scaler_steps(&gpu, zero::RankSpec { optim: lamb, ..spec(2) }, seed, b, t, v)?;
    let off = zero::OffloadOptions { ratio: 1.0, threads: offload::default_threads(1) };
    let o = scaler_steps(&gpu, zero::RankSpec { optim: lamb, offload: Some(off), ..spec(2) }, seed, b, t, v)?;
    let tag = "fp16 with LAMB offloaded (host memory, ratio 1, ZeRO-2, one GPU) vs on the GPU";
    rows.push(bits_row(format!("{tag}: steps skipped ({} of {SCALER_STEPS}) and loss scales", o.1), &o.2, &on_gpu.2));
    rows.push(bits_row(format!("{tag}: masters and moments after {SCALER_STEPS} steps"), &o.0, &on_gpu.0));
    Ok(rows)
}

/// Steps of [`scaler_steps`] and [`dynamic_scaler_run`].
const SCALER_STEPS: usize = 12;

/// Every bit of the masters and the optimizer state, in order.
fn state_bits(r: &mut zero::Rank) -> Result<Vec<u32>> {
    let mut bits = f32_bits(&r.masters()?);
    r.optimizer_state()?.iter().for_each(|b| bits.extend(f32_bits(b)));
    Ok(bits)
}

/// [`SCALER_STEPS`] steps from 2^24 under DeepSpeed's dynamic scaler (as [`dynamic_scaler_run`]):
/// the state's bits after them, how many were skipped, and the scale after each step's bits.
fn scaler_steps(gpu: &Arc<Gpu>, spec: zero::RankSpec<'_>, seed: u64, b: usize, t: usize, v: usize) -> Result<(Vec<u32>, usize, Vec<u32>)> {
    let mut rank = zero::Rank::new(gpu.clone(), None, spec)?;
    let mut scaler = DynamicLossScaler::new(24, 2, 1.0, 1)?;
    let (mut skipped, mut scales) = (0, Vec::new());
    for step in 0..SCALER_STEPS {
        let p = rank.prepare(&[batch(seed, step, 0, b, t, v)], 1e-3, 1.0, scaler.scale())?;
        if let StepOutcome::SkippedOverflow { .. } = scaler.update(p.overflow)? {
            rank.skip()?;
            skipped += 1;
        } else {
            rank.commit()?;
        }
        scales.push(scaler.scale().to_bits());
    }
    Ok((state_bits(&mut rank)?, skipped, scales))
}

/// At each scale of [`SCALE_POWERS`], whether the GPU rank reports an overflow against whether
/// the CPU model's f32 gradient of the same micro-batch, times the scale, has an element that
/// fp16 storage makes infinite. Scales whose largest scaled element lies within 2 % of the
/// threshold are left out (the GPU's bf16 gradient differs from the CPU's in its low bits).
fn overflow_decisions(
    gpu: &Arc<Gpu>,
    model: &Model,
    spec: zero::RankSpec<'_>,
    seed: u64,
    b: usize,
    t: usize,
) -> Result<Vec<cuda::CheckRow>> {
    let init = spec.init.to_vec();
    let mut rank = zero::Rank::new(gpu.clone(), None, spec)?;
    let (tok, tgt) = batch(seed, 0, 0, b, t, model.cfg.vocab_size);
    let mut g = vec![0f32; init.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params: &init, grads: &mut g, units: model.units() };
    let noise_key = tessera_kernels::model::noise_key_of(seed, 0, 0);
    model.forward_backward(&mut acc, MicroBatch { tokens: &tok, targets: &tgt, b, t, noise_key }, 1.0, &mut ws);
    let max_abs = g.iter().fold(0f64, |m, x| m.max(f64::from(x.abs())));
    let (mut agree, mut disagree, mut near) = (0, Vec::new(), 0);
    for k in SCALE_POWERS {
        let scale = 2f32.powi(k);
        let p = rank.prepare(&[(tok.clone(), tgt.clone())], 1e-3, 1.0, scale)?;
        rank.skip()?;
        let ratio = max_abs * f64::from(scale) / F16_OVERFLOW;
        if (ratio.log2()).abs() < (1.02f64).log2() {
            near += 1;
        } else if p.overflow == (ratio >= 1.0) {
            agree += 1;
        } else {
            disagree.push(k);
        }
    }
    let masters_kept = rank.masters()?;
    Ok(vec![
        cuda::CheckRow {
            name: format!(
                "fp16 overflow at loss scales 2^0…2^40 = the CPU gradient stored in fp16 (max |g| {max_abs:.3e}): {agree} agree, \
                 {near} within 2 % of the threshold not compared, disagreeing at 2^{disagree:?}"
            ),
            max_abs: 0.0,
            max_rel: disagree.len() as f64,
            tol: 0.0,
            non_finite: false,
        },
        bits_row("fp16: skipped steps leave the masters as they were".into(), &f32_bits(&masters_kept), &f32_bits(&init)),
    ])
}

/// Twelve steps from a scale of 2^24 (overflowing: the model's gradient fits below about 2^19)
/// under DeepSpeed's dynamic scaler (window 2, hysteresis 1; the CPU ranks' `DynamicLossScaler`, as the GPU workers hold it): the scale
/// halves on each overflow until the gradient fits, skipped steps leave masters and moments bit
/// for bit, and applied ones move them.
fn dynamic_scaler_run(gpu: &Arc<Gpu>, spec: zero::RankSpec<'_>, seed: u64, b: usize, t: usize, v: usize) -> Result<Vec<cuda::CheckRow>> {
    let mut rank = zero::Rank::new(gpu.clone(), None, spec)?;
    let mut scaler = DynamicLossScaler::new(24, 2, 1.0, 1)?;
    let (mut skipped, mut applied, mut kept_bits, mut moved, mut scales) = (0, 0, true, true, Vec::new());
    for step in 0..SCALER_STEPS {
        let before = state_bits(&mut rank)?;
        let p = rank.prepare(&[batch(seed, step, 0, b, t, v)], 1e-3, 1.0, scaler.scale())?;
        let outcome = scaler.update(p.overflow)?;
        if let StepOutcome::SkippedOverflow { .. } = outcome {
            rank.skip()?;
            skipped += 1;
            kept_bits &= state_bits(&mut rank)? == before;
        } else {
            rank.commit()?;
            applied += 1;
            moved &= state_bits(&mut rank)? != before;
        }
        scales.push(scaler.scale());
    }
    let flag = |ok: bool| u32::from(ok);
    Ok(vec![
        bits_row(
            format!(
                "fp16 dynamic scaler from 2^24: {skipped} steps skipped, then scales {scales:?}; skipped steps kept masters and moments"
            ),
            &[flag(kept_bits)],
            &[1],
        ),
        bits_row(
            format!("fp16 dynamic scaler: the {applied} applied steps moved the masters"),
            &[flag(moved && applied > 0 && skipped > 0)],
            &[1],
        ),
    ])
}
