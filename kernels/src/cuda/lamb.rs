//! LAMB on the device, bit-identical to the CPU engine's `OptimizerShard::step` (`optim::lamb`,
//! `optim::shard::lamb_step`) over one buffer that holds every tensor of the CPU's flat layout:
//! one GPU, or ZeRO-0 where each rank holds everything.
//!
//! The CPU step runs in two phases around the trust ratios: (1) the update `u` of every element
//! (moments recomputed, not stored), (2) per tensor `ratio = ‖p‖/‖u‖` from sums of squares over
//! the layout's fixed *slots* (tensor ∩ 16384-element block; 8 interleaved f64 lanes a slot,
//! slots added per tensor in slot order), then the moments stored and `p ← p − (step_size·ratio)·u`.
//! The device does the same: `lamb_update` (ops.cu) writes `u` into a scratch buffer,
//! `lamb_sumsq_slots` sums the same slots in the same lane order with explicit round-to-nearest
//! f64 operations (the slots mapped to where each tensor sits in the device buffer, which may pad
//! between tensors: [`LambSlots`]), the host combines the partials with the CPU's own
//! `FlatLayout::segment_sumsq` and `LambParams::trust_ratio`, and `lamb_commit` steps each tensor
//! with its `step_size·ratio` (one f32 product on the host, as the CPU forms it). Elementwise
//! operations are the CPU's, one explicit rounding each, so on normal values the masters, the
//! moments and the ratios are the CPU's bits (`check`).
//!
//! Where ZeRO pieces of several ranks would split one slot, the slot's partial sum would have to
//! be exchanged between ranks; that case is not run here (GPU ranks refuse LAMB at ZeRO 1–3 on
//! several GPUs, see docs/GPU.md; a design for the exchange is in the gpuoptim session notes).

use std::ops::Range;

use cudarc::driver::{CudaStream, PushKernelArg};

use super::ops::{launch, OptimBufs};
use super::optim::{bits, LambStep};
use super::{bf16, drv, grid_1d, Buf, CheckRow, DPtr, Gpu, GpuError, Result};
use crate::optim::{FlatLayout, LambParams, LocalReduce, OptimizerKind, OptimizerShard, StepContext};

/// The CPU layout's slots in device coordinates, uploaded once, with each tensor's device range.
pub struct LambSlots {
    layout: FlatLayout,
    starts: Buf<u64>,
    lens: Buf<u32>,
    partials: Buf<f64>,
    /// Per segment of the layout: its range in the device buffer.
    dev: Vec<Range<usize>>,
}

/// Host tables of [`LambSlots`].
#[derive(Debug, Clone, PartialEq)]
pub struct SlotTable {
    /// Per slot: its first element in the device buffer.
    pub starts: Vec<u64>,
    /// Per slot: its length.
    pub lens: Vec<u32>,
    /// Per segment: its device range.
    pub dev: Vec<Range<usize>>,
}

/// The [`SlotTable`] of `layout` where segment `k` starts at `dev_start[k]` of the device buffer.
pub fn slot_table(layout: &FlatLayout, dev_start: &[usize]) -> Result<SlotTable> {
    let segs = layout.segments();
    if dev_start.len() != segs.len() {
        return Err(GpuError::Invalid(format!("LAMB slots: {} device starts for {} tensors", dev_start.len(), segs.len())));
    }
    let dev: Vec<Range<usize>> = segs.iter().zip(dev_start).map(|(s, &d)| d..d + s.len()).collect();
    for (k, w) in dev.windows(2).enumerate() {
        if w[1].start < w[0].end {
            return Err(GpuError::Invalid(format!("LAMB slots: tensor {} starts at {} inside tensor {k} ({:?})", k + 1, w[1].start, w[0])));
        }
    }
    let (mut starts, mut lens) = (Vec::new(), Vec::new());
    for (seg, r) in layout.slot_ranges() {
        starts.push((dev[seg].start + (r.start - segs[seg].start)) as u64);
        lens.push(u32::try_from(r.len()).expect("a slot is at most one norm block"));
    }
    Ok(SlotTable { starts, lens, dev })
}

impl LambSlots {
    /// The slots of `layout` with tensor `k` at `dev_start[k]` of the device buffers (ascending,
    /// not overlapping).
    pub fn new(gpu: &Gpu, layout: &FlatLayout, dev_start: &[usize]) -> Result<LambSlots> {
        let SlotTable { starts, lens, dev } = slot_table(layout, dev_start)?;
        let partials = gpu.alloc::<f64>(2 * starts.len())?;
        Ok(LambSlots { layout: layout.clone(), starts: gpu.upload(&starts)?, lens: gpu.upload(&lens)?, partials, dev })
    }

    /// Number of elements the device buffers must hold (the end of the last tensor).
    pub fn dev_len(&self) -> usize {
        self.dev.last().map_or(0, |r| r.end)
    }
}

/// One LAMB update (`hp.step`, 1-based, at learning rate `hp.lr`) over `bufs` laid out as `slots` says,
/// with `u` as scratch (as long as `bufs.master`); the gradient is multiplied by `grad_scale`
/// first. Waits for `s` once (the ratios are formed on the host). Returns each tensor's trust
/// ratio (the CPU's `last_trust_ratios`).
pub fn step(
    gpu: &Gpu,
    s: &CudaStream,
    slots: &mut LambSlots,
    bufs: &OptimBufs,
    u: DPtr<f32>,
    hp: &LambStep,
    grad_scale: f32,
) -> Result<Vec<f32>> {
    let LambStep { params: hp, lr, step } = *hp;
    let OptimBufs { master, param, grad, m, v, decay } = *bufs;
    let len = master.len;
    for (what, n) in [("param", param.len), ("grad", grad.len), ("m", m.len), ("v", v.len), ("decay mask", decay.len), ("u", u.len)] {
        if n != len {
            return Err(GpuError::Invalid(format!("LAMB step: {what} has {n} elements, the masters {len}")));
        }
    }
    if slots.dev_len() > len {
        return Err(GpuError::Invalid(format!("LAMB step: the layout needs {} elements, the buffers hold {len}", slots.dev_len())));
    }
    if step == 0 {
        return Err(GpuError::Invalid("an optimizer update is numbered from 1; got update 0".into()));
    }
    let c = hp.coeffs(lr, step);
    let (b1, omb1, b2, omb2) = (c.beta1, c.one_minus_beta1, c.beta2, c.one_minus_beta2);
    if len > 0 {
        let len_u = len as u64;
        launch!(gpu, s, "lamb_update", grid_1d(len, 256); u.raw, master.raw, grad.raw, m.raw, v.raw, decay.raw, len_u,
            b1, omb1, b2, omb2, c.eps, c.weight_decay, grad_scale)?;
    }
    let n = slots.starts.len();
    if n > 0 {
        let n_u = n as u64;
        let (out, st, ln) = (slots.partials.ptr(), slots.starts.ptr(), slots.lens.ptr());
        launch!(gpu, s, "lamb_sumsq_slots", grid_1d(8 * n, 256); out.raw, master.raw, u.raw, st.raw, ln.raw, n_u)?;
    }
    s.synchronize().map_err(drv("waiting for LAMB's sums of squares"))?;
    let partials = if n > 0 { gpu.download(slots.partials.ptr())? } else { Vec::new() };
    let w_sq = slots.layout.segment_sumsq(&partials[..n]);
    let u_sq = slots.layout.segment_sumsq(&partials[n..]);
    let ratios: Vec<f32> = w_sq.iter().zip(&u_sq).map(|(w, q)| hp.trust_ratio(w.sqrt(), q.sqrt())).collect();
    for (r, &ratio) in slots.dev.iter().zip(&ratios) {
        if r.is_empty() {
            continue;
        }
        let step_ratio = c.step_size * ratio;
        let t_len = r.len() as u64;
        let (pm, pp, pg, p_m, p_v, pu) = (
            master.slice(r.clone()),
            param.slice(r.clone()),
            grad.slice(r.clone()),
            m.slice(r.clone()),
            v.slice(r.clone()),
            u.slice(r.clone()),
        );
        launch!(gpu, s, "lamb_commit", grid_1d(r.len(), 256); pm.raw, pp.raw, pg.raw, p_m.raw, p_v.raw, pu.raw, t_len,
            b1, omb1, b2, omb2, step_ratio, grad_scale)?;
    }
    Ok(ratios)
}

// ---------------------------------------------------------------------------------------------
// `tessera gpu check`: LAMB against `OptimizerShard::step`
// ---------------------------------------------------------------------------------------------

/// Steps of each configuration compared.
const CHECK_STEPS: u64 = 3;

/// The configurations [`check`] runs (ratios inside the clamp, clamped from above and below, no
/// bias correction, OneCycle's momentum cycle).
fn check_kinds() -> Vec<(&'static str, LambParams)> {
    use crate::optim::{CycleShape, MomentumCycle};
    let base = LambParams { lr: 2e-3, betas: (0.9, 0.999), eps: 1e-6, weight_decay: 0.01, ..LambParams::default() };
    let shape = CycleShape { first_step_size: 2, second_step_size: 2, first_stair_count: 0, second_stair_count: 0 };
    let cycle = MomentumCycle { shape, decay_step_size: 0, min_mom: 0.85, max_mom: 0.95, decay_mom_rate: 0.0 };
    vec![
        ("LAMB", base),
        ("LAMB clamped to [0.2, 0.5], no bias correction", LambParams { max_coeff: 0.5, min_coeff: 0.2, bias_correction: false, ..base }),
        ("LAMB with OneCycle's momentum cycle", LambParams { momentum_cycle: Some(cycle), ..base }),
    ]
}

/// Tensor sizes of the check: small ones, two crossing norm blocks (several slots each), one
/// empty; tensor `k`'s weights have scale 0.02·10^(k mod 4) (trust ratios from about 0.006 to 6)
/// and tensor 3 is all zeros (ratio 1).
fn check_sizes() -> Vec<usize> {
    let mut sizes: Vec<usize> = (0..24).map(|k| 500 + 7919 * k % 5000).collect();
    sizes[5] = 40_000;
    sizes[11] = 0;
    sizes[17] = 20_000;
    sizes
}

/// Each configuration of [`check_kinds`]: [`CHECK_STEPS`] updates on the GPU (tensors placed in
/// the device buffer with gaps, as a padded GPU layout places them) and by the CPU's
/// `OptimizerShard::step` from the same masters and gradients; masters, bf16 parameters, both
/// moments and the trust ratios must be the CPU's bits after each step.
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let sizes = check_sizes();
    let layout = FlatLayout::from_sizes(&sizes).map_err(|e| GpuError::Invalid(format!("check layout: {e}")))?;
    let len = layout.total();
    let decay: Vec<bool> = (0..sizes.len()).map(|k| k % 3 != 1).collect();
    let mut dev_start = Vec::new();
    let mut at = 0usize;
    for &n in &sizes {
        at = (at + 37).next_multiple_of(64);
        dev_start.push(at);
        at += n;
    }
    let dev_len = at;
    let mut master0 = Vec::with_capacity(len);
    for (k, &n) in sizes.iter().enumerate() {
        let scale = if k == 3 { 0.0 } else { 0.02 * 10f32.powi(k as i32 % 4) };
        master0.extend(super::optim::normal(seed, 90 + k as u64, n, 1.0).into_iter().map(|x| x * scale));
    }
    let place = |host: &[f32], fill: f32| {
        let mut d = vec![fill; dev_len];
        for (seg, &s) in layout.segments().iter().zip(&dev_start) {
            d[s..s + seg.len()].copy_from_slice(&host[seg.clone()]);
        }
        d
    };
    let take = |dev: &[f32]| -> Vec<f32> {
        layout.segments().iter().zip(&dev_start).flat_map(|(seg, &s)| dev[s..s + seg.len()].to_vec()).collect()
    };
    let mut mask = vec![0u8; dev_len];
    for ((seg, &s), &d) in layout.segments().iter().zip(&dev_start).zip(&decay) {
        mask[s..s + seg.len()].fill(u8::from(d));
    }
    let mut rows = Vec::new();
    for (name, hp) in check_kinds() {
        let mut slots = LambSlots::new(gpu, &layout, &dev_start)?;
        let mut cpu = OptimizerShard::new(OptimizerKind::Lamb(hp), len);
        let mut p = master0.clone();
        let (d_master, d_mask) = (gpu.upload(&place(&master0, 0.5))?, gpu.upload(&mask)?);
        let d_param = gpu.alloc::<bf16>(dev_len)?;
        let (d_m, d_v, d_u) = (gpu.alloc::<f32>(dev_len)?, gpu.alloc::<f32>(dev_len)?, gpu.alloc::<f32>(dev_len)?);
        let mut equal = true;
        for step in 1..=CHECK_STEPS {
            let grad = super::optim::normal(seed, 100 + step, len, 1e-2);
            let lr = 0.7f32.powi(step as i32 - 1) * hp.lr;
            let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &decay };
            cpu.step(&mut p, &grad, lr, &ctx, &mut LocalReduce).map_err(|e| GpuError::Invalid(format!("CPU {name} step: {e}")))?;
            let d_grad = gpu.upload(&place(&grad, 0.0))?;
            let bufs = OptimBufs {
                master: d_master.ptr(),
                param: d_param.ptr(),
                grad: d_grad.ptr(),
                m: d_m.ptr(),
                v: d_v.ptr(),
                decay: d_mask.ptr(),
            };
            let ratios = self::step(gpu, &gpu.stream, &mut slots, &bufs, d_u.ptr(), &LambStep { params: hp, lr, step }, 1.0)?;
            let gm = take(&gpu.download(d_master.ptr())?);
            let gp: Vec<f32> = gpu.download(d_param.ptr())?.iter().map(|b| b.to_f32()).collect();
            let mut same =
                bits(&gm) == bits(&p) && bits(&take(&gp)) == bits(&p.iter().map(|&x| bf16::from_f32(x).to_f32()).collect::<Vec<_>>());
            same &= bits(&ratios) == bits(cpu.last_trust_ratios());
            let states = [take(&gpu.download(d_m.ptr())?), take(&gpu.download(d_v.ptr())?)];
            for ((_, want), got) in cpu.state_buffers().into_iter().zip(&states) {
                same &= bits(got) == bits(want);
            }
            equal &= same;
        }
        rows.push(CheckRow {
            name: format!(
                "{name}: {CHECK_STEPS} steps, masters, bf16 params, exp_avg, exp_avg_sq, trust ratios = CPU OptimizerShard::step (bits)"
            ),
            max_abs: 0.0,
            max_rel: f64::from(u8::from(!equal)),
            tol: 0.0,
            non_finite: false,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device slot table covers exactly the CPU's slots, at each tensor's device place, and
    /// summing them in the kernel's lane order gives `FlatLayout::partial_sumsq`'s bits (no GPU
    /// needed: the kernel's order replayed on the host).
    #[test]
    fn device_slots_are_the_cpu_slots_at_the_device_places() {
        let sizes = check_sizes();
        let layout = FlatLayout::from_sizes(&sizes).unwrap();
        let starts: Vec<usize> = (0..sizes.len())
            .scan(0, |at, k| {
                let s = (*at + 37usize).next_multiple_of(64);
                *at = s + sizes[k];
                Some(s)
            })
            .collect();
        let SlotTable { starts: dstarts, lens, dev } = slot_table(&layout, &starts).unwrap();
        assert_eq!(dstarts.len(), layout.slots());
        assert!(layout.slots() > sizes.len(), "the big tensors span several slots");
        let host: Vec<f32> = (0..layout.total()).map(|i| ((i * 2654435761) % 1000) as f32 * 1e-3 - 0.5).collect();
        let mut dbuf = vec![7.0f32; dev.last().unwrap().end];
        for (seg, r) in layout.segments().iter().zip(&dev) {
            dbuf[r.clone()].copy_from_slice(&host[seg.clone()]);
        }
        let mut want = vec![0.0f64; layout.slots()];
        layout.partial_sumsq(&host, 0..layout.total(), &mut want).unwrap();
        for (k, (&s, &n)) in dstarts.iter().zip(&lens).enumerate() {
            let mut lanes = [0.0f64; 8];
            for p in 0..n as usize {
                let x = f64::from(dbuf[s as usize + p]);
                lanes[p % 8] += x * x;
            }
            let got = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            assert_eq!(got.to_bits(), want[k].to_bits(), "slot {k}");
        }
        let overlapping = [0usize; 24];
        assert!(slot_table(&layout, &overlapping).unwrap_err().to_string().contains("inside tensor"));
        assert!(slot_table(&layout, &starts[1..]).is_err(), "one start per tensor");
    }
}
