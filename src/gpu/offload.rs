//! ZeRO-Offload on the GPU (`zero_optimization.offload_optimizer.device = "cpu"` with
//! `--device cuda`): the rank's fp32 masters and optimizer state live in host memory and the
//! optimizer step runs on CPU cores, unit by unit, as each unit's reduced gradient arrives.
//! Every elementwise optimizer runs there ([`HostStep`]): Adam/AdamW through [`adamw_host`], SGD,
//! Lion and Adagrad through the CPU engine's own kernels ([`ElementwiseStep`], what
//! `OptimizerShard::step` runs). LAMB is not elementwise (its trust ratios need every tensor's
//! norms before any update): with the whole shard on the host of one rank its host step runs in
//! two phases around the norms ([`super::lamb_host`]: each unit's update as its gradient arrives,
//! every unit stepped once all are in); other LAMB offloads are refused at start.
//!
//! The pipeline of one step (driven by [`super::zero::Rank::step`] through [`run_step`]):
//! 1. during the backward of the last micro-batch, as unit `u`'s gradient is final (after the
//!    micro-batch tree's adds for that unit and its reduce-scatter), its host part is copied
//!    device → host into a page-locked staging buffer on a copy stream (`d2h`);
//! 2. a worker thread waits for each unit's copy, then runs the [`HostStep`] over the unit's host
//!    part on a pool of CPU threads, writing the new fp32 masters and moments in place and the
//!    bf16 parameters into a page-locked staging buffer — with `gradient_clipping` off this
//!    overlaps the rest of the backward; with clipping on it starts once the global norm (on the
//!    GPU, from the device gradient shard) is known, and overlaps the copies and gathers of the
//!    units stepped before; with fp16 it waits the same way for the loss scaler's verdict, and
//!    on an overflow hands every unit back unstepped (the step is skipped; with NVMe each unit's
//!    state is read and written back unchanged, keeping the swap pipeline's order);
//! 3. the new bf16 parameters go host → device on a second copy stream (`h2d`) and are
//!    all-gathered on the communication stream as without offload; the next forward waits per
//!    unit (events).
//!
//! `offload_optimizer.ratio` (DeepSpeed's partial offload): the first `ratio` of each unit's
//! piece is stepped on the host, the rest by the GPU kernel as without offload ([`Split`]).
//!
//! `offload_optimizer.device = "nvme"`: the host parts' masters and moments live in swap files
//! instead of host memory ([`super::nvme`]); the worker gets each unit's from a reader thread
//! reading ahead and hands it to a writer thread after the step — the same host step, the same
//! bits.
//!
//! The host AdamW's loop is branch-free and runs 16 lanes a block (AVX-512 where the CPU has it,
//! `simd_dispatch!`): on the H200 machine's 16 cores it steps a 1.3B model's 1.31 G parameters
//! in ~0.45 s (memory-bound, ~90 GB/s), where the scalar loop took ~1.28 s.
//!
//! Same bits as the GPU optimizer: SGD, Lion and Adagrad run the CPU's kernels, which the GPU
//! kernels reproduce operation by operation on normal values (`tessera gpu check`'s optimizer
//! rows); a subnormal input or result, which the GPU flushes to zero, is kept here. Adam:
//! [`adamw_host`] evaluates the GPU `adamw` kernel's expression (kernels/cuda/ops.cu)
//! in the same order with the same f32 roundings. The kernel's module is compiled with
//! `--use_fast_math`, so its explicit round-to-nearest operations (`__fadd_rn`, `__fmul_rn`,
//! `__fdiv_rn`, `__fsqrt_rn`: never contracted into FMAs) flush subnormal inputs and results to
//! sign-preserving zero; the host step does the same after every operation ([`ftz`]). Rust
//! never contracts `a * b + c`, so no FMA appears on the host either. `tessera gpu check`
//! compares the two bit for bit on random inputs, subnormal cases included.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use half::bf16;
use rayon::prelude::*;
use tessera_kernels::cuda::ops::{AdamStep, EventFlags, PinnedHostSlice};
use tessera_kernels::cuda::optim::LambStep;
use tessera_kernels::cuda::{self, CudaEvent, CudaStream, Gpu};
use tessera_kernels::optim::ElementwiseStep;

use super::lamb_host::{LambHost, State as LambState, StateMut as LambStateMut};
use super::nvme::{NvmeStore, UnitState};
use super::zero::OffloadOptions;

/// Elements per task of the host step (a few hundred KiB of each stream per task).
pub(super) const CHUNK: usize = 1 << 15;

/// Flush a subnormal to a zero of the same sign (the GPU's `.ftz` arithmetic).
#[inline(always)]
pub fn ftz(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(if b & 0x7fff_ffff < 0x0080_0000 { b & 0x8000_0000 } else { b })
}

/// The scalars of one AdamW step as the kernel receives them (flushed as the kernel reads them).
#[derive(Clone, Copy, Debug)]
struct Coeffs {
    lerp_w: f32,
    one_minus_lerp_w: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    decoupled_factor: f32,
    grad_scale: f32,
    l2: f32,
}

impl Coeffs {
    fn new(hp: &AdamStep, grad_scale: f32) -> Coeffs {
        let lerp_w = ftz(hp.lerp_w);
        Coeffs {
            lerp_w,
            // FSUB(1.0f, lerp_w), evaluated per element by the kernel: a constant here.
            one_minus_lerp_w: ftz(1.0 - lerp_w),
            beta2: ftz(hp.beta2),
            one_minus_beta2: ftz(hp.one_minus_beta2),
            step_size: ftz(hp.step_size),
            bc2_sqrt: ftz(hp.bc2_sqrt),
            eps: ftz(hp.eps),
            decoupled_factor: ftz(hp.decoupled_factor),
            grad_scale: ftz(grad_scale),
            l2: ftz(hp.l2),
        }
    }
}

/// The kernel's body for one element, operation by operation (`F*` = one rounding + flush).
/// Branch-free (the decay and L2 choices are selects, the bf16 rounding is [`to_bf16`]) so the
/// loop in [`run_body`] compiles to vector instructions: each lane does the same IEEE operations.
#[inline(always)]
fn elem<const SMALL_W: bool>(c: &Coeffs, master: &mut f32, m: &mut f32, v: &mut f32, grad: f32, decay: u32) -> bf16 {
    let decays = decay != 0;
    let g0 = ftz(ftz(grad) * c.grad_scale);
    let factor = if decays { c.decoupled_factor } else { 1.0 };
    let pd = ftz(ftz(*master) * factor);
    let with_l2 = ftz(g0 + ftz(c.l2 * pd));
    let g = if decays && c.l2 != 0.0 { with_l2 } else { g0 };
    let m0 = ftz(*m);
    let m1 = if SMALL_W { ftz(m0 + ftz(c.lerp_w * ftz(g - m0))) } else { ftz(g - ftz(ftz(g - m0) * c.one_minus_lerp_w)) };
    let v1 = ftz(ftz(ftz(*v) * c.beta2) + ftz(ftz(c.one_minus_beta2 * g) * g));
    let denom = ftz(ftz(ftz(v1.sqrt()) / c.bc2_sqrt) + c.eps);
    let p1 = ftz(pd - ftz(c.step_size * ftz(m1 / denom)));
    *m = m1;
    *v = v1;
    *master = p1;
    to_bf16(p1)
}

/// `bf16::from_f32` (round to nearest even; a NaN stays a quiet NaN with its high bits), as
/// selects instead of branches so that it vectorizes.
#[inline(always)]
fn to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let nan = b & 0x7fff_ffff > 0x7f80_0000;
    let up = (b & 0x8000 != 0) & (b & 0x17fff != 0);
    let rounded = ((b >> 16) + u32::from(up)) as u16;
    bf16::from_bits(if nan { ((b >> 16) | 0x40) as u16 } else { rounded })
}

/// Lanes a block of [`run_lanes`]: one 512-bit vector of f32.
const LANES: usize = 16;

/// [`elem`] over the slices, [`LANES`] elements at a time (the decay flags widened and the bf16
/// results narrowed around the arithmetic, so every step is a whole-vector operation), then the
/// tail one by one.
#[inline(always)]
fn run_lanes<const SMALL_W: bool>(
    c: &Coeffs,
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    decay: &[u8],
    param: &mut [bf16],
) {
    let n = master.len();
    let (m, v, grad, decay, param) = (&mut m[..n], &mut v[..n], &grad[..n], &decay[..n], &mut param[..n]);
    let whole = n - n % LANES;
    for i in (0..whole).step_by(LANES) {
        let (mut p, mut mm, mut vv, mut g, mut d, mut out) =
            ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES], [0u32; LANES], [0u32; LANES]);
        p.copy_from_slice(&master[i..i + LANES]);
        mm.copy_from_slice(&m[i..i + LANES]);
        vv.copy_from_slice(&v[i..i + LANES]);
        g.copy_from_slice(&grad[i..i + LANES]);
        let flags: &[u8; LANES] = decay[i..i + LANES].try_into().expect("a whole block");
        for j in 0..LANES {
            d[j] = u32::from(flags[j]);
        }
        for j in 0..LANES {
            out[j] = u32::from(elem::<SMALL_W>(c, &mut p[j], &mut mm[j], &mut vv[j], g[j], d[j]).to_bits());
        }
        master[i..i + LANES].copy_from_slice(&p);
        m[i..i + LANES].copy_from_slice(&mm);
        v[i..i + LANES].copy_from_slice(&vv);
        for j in 0..LANES {
            param[i + j] = bf16::from_bits(out[j] as u16);
        }
    }
    for i in whole..n {
        param[i] = elem::<SMALL_W>(c, &mut master[i], &mut m[i], &mut v[i], grad[i], u32::from(decay[i]));
    }
}

#[inline(always)]
fn run_body(c: &Coeffs, master: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32], decay: &[u8], param: &mut [bf16]) {
    if c.lerp_w < 0.5 {
        run_lanes::<true>(c, master, m, v, grad, decay, param)
    } else {
        run_lanes::<false>(c, master, m, v, grad, decay, param)
    }
}

tessera_kernels::simd_dispatch!(fn run(c: &Coeffs, master: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32], decay: &[u8], param: &mut [bf16]) => run_body);

/// What [`adamw_host`] reads and writes, all as long as `master` (the host twin of
/// [`tessera_kernels::cuda::ops::OptimBufs`]): the fp32 masters and moments (updated in place),
/// the gradient, the decay mask (1 where weight decay applies) and the bf16 parameters (written:
/// the new masters rounded).
pub struct HostAdamBufs<'a> {
    pub master: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub grad: &'a [f32],
    pub decay: &'a [u8],
    pub param: &'a mut [bf16],
}

impl HostAdamBufs<'_> {
    /// Panics naming `what` unless every buffer has the masters' length.
    fn same_lengths(&self, what: &str) {
        let n = self.master.len();
        let HostAdamBufs { m, v, grad, decay, param, .. } = self;
        assert!(m.len() == n && v.len() == n && grad.len() == n && decay.len() == n && param.len() == n, "{what}: lengths differ");
    }
}

/// One AdamW step over a run of elements on this thread, bit-identical to the GPU `adamw`
/// kernel ([`tessera_kernels::cuda::ops::adamw`]) with the same arguments: `param` receives the
/// bf16 rounding of the new masters.
pub fn adamw_host(hp: &AdamStep, grad_scale: f32, bufs: HostAdamBufs<'_>) {
    bufs.same_lengths("adamw_host");
    let HostAdamBufs { master, m, v, grad, decay, param } = bufs;
    run(&Coeffs::new(hp, grad_scale), master, m, v, grad, decay, param)
}

/// [`adamw_host`] split into chunks over `pool`'s threads (elementwise: the same bits).
pub fn adamw_host_par(pool: &rayon::ThreadPool, hp: &AdamStep, grad_scale: f32, bufs: HostAdamBufs<'_>) {
    bufs.same_lengths("adamw_host_par");
    let HostAdamBufs { master, m, v, grad, decay, param } = bufs;
    pool.install(|| {
        master
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(grad.par_chunks(CHUNK))
            .zip(decay.par_chunks(CHUNK))
            .zip(param.par_chunks_mut(CHUNK))
            .for_each(|(((((master, m), v), grad), decay), param)| {
                adamw_host(hp, grad_scale, HostAdamBufs { master, m, v, grad, decay, param })
            });
    });
}

/// One update of the host step's optimizer.
#[derive(Clone, Copy, Debug)]
pub enum HostStep {
    /// Adam/AdamW: the GPU `adamw` kernel's expression with its flushes ([`adamw_host`]).
    Adam(AdamStep),
    /// SGD, Lion, Adagrad: the CPU engine's kernels.
    Cpu(ElementwiseStep),
    /// LAMB: two phases around the trust ratios ([`super::lamb_host`]), not unit by unit.
    Lamb(LambStep),
}

/// [`HostStep`] over `bufs` on `pool`'s threads: the gradient multiplied by `grad_scale` (the
/// clipping coefficient, one f32 rounding as the GPU kernels do it), then the optimizer over each
/// run of elements with one decay flag. `bufs.m` / `bufs.v` are as long as the masters where the
/// optimizer keeps that buffer and may be empty otherwise.
pub fn host_step_par(pool: &rayon::ThreadPool, hp: &HostStep, grad_scale: f32, bufs: HostAdamBufs<'_>) {
    let step = match hp {
        HostStep::Adam(a) => return adamw_host_par(pool, a, grad_scale, bufs),
        HostStep::Cpu(step) => step,
        HostStep::Lamb(_) => unreachable!("LAMB is not elementwise: the worker steps it through lamb_host"),
    };
    let HostAdamBufs { master, m, v, grad, decay, param } = bufs;
    let n = master.len();
    assert!(grad.len() == n && decay.len() == n && param.len() == n, "host_step_par: lengths differ");
    let (mc, vc) = (state_chunks(m, n), state_chunks(v, n));
    pool.install(|| {
        let jobs = master.par_chunks_mut(CHUNK).zip(mc).zip(vc).zip(grad.par_chunks(CHUNK));
        jobs.zip(decay.par_chunks(CHUNK)).zip(param.par_chunks_mut(CHUNK)).for_each(|(((((p, m), v), g), d), out)| {
            let g: Vec<f32> = g.iter().map(|&x| x * grad_scale).collect();
            let mut at = 0;
            while at < p.len() {
                let end = at + d[at..].iter().position(|&x| x != d[at]).unwrap_or(p.len() - at);
                let (mr, vr) = (state_run(m, at..end), state_run(v, at..end));
                step.run(d[at] != 0, &mut p[at..end], &g[at..end], mr, vr);
                at = end;
            }
            out.iter_mut().zip(p.iter()).for_each(|(o, &x)| *o = bf16::from_f32(x));
        });
    });
}

/// A state buffer of `n` values in [`CHUNK`]s, or one empty slice a chunk where the optimizer
/// does not keep it.
fn state_chunks(b: &mut [f32], n: usize) -> Vec<&mut [f32]> {
    if b.is_empty() {
        return (0..n.div_ceil(CHUNK)).map(|_| <&mut [f32]>::default()).collect();
    }
    assert!(b.len() == n, "host step: a state buffer of {} values for {n} masters", b.len());
    b.chunks_mut(CHUNK).collect()
}

/// Range `r` of a state buffer, or the empty buffer itself where the optimizer does not keep it.
fn state_run(b: &mut [f32], r: std::ops::Range<usize>) -> &mut [f32] {
    if b.is_empty() {
        b
    } else {
        &mut b[r]
    }
}

/// Where each unit's optimizer piece is stepped: its first `host[u]` elements on the host, the
/// rest on the GPU. Pieces are laid out unit after unit in both places.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Per unit: the piece's length, its host part's length, and where each part starts in the
    /// host and the device arrays.
    pub piece: Vec<usize>,
    pub host: Vec<usize>,
    pub host_off: Vec<usize>,
    pub dev_off: Vec<usize>,
    pub host_total: usize,
    pub dev_total: usize,
}

impl Split {
    /// `ratio` of every piece on the host (rounded to whole elements); 0 = nothing offloaded.
    pub fn new(piece: Vec<usize>, ratio: f64) -> Split {
        let r = ratio.clamp(0.0, 1.0);
        let host: Vec<usize> = piece.iter().map(|&p| ((p as f64 * r).round() as usize).min(p)).collect();
        let (mut host_off, mut dev_off) = (Vec::with_capacity(piece.len()), Vec::with_capacity(piece.len()));
        let (mut h, mut d) = (0, 0);
        for (&p, &hl) in piece.iter().zip(&host) {
            host_off.push(h);
            dev_off.push(d);
            h += hl;
            d += p - hl;
        }
        Split { piece, host, host_off, dev_off, host_total: h, dev_total: d }
    }

    pub fn units(&self) -> usize {
        self.piece.len()
    }

    /// Unit `u`'s host part in the host arrays.
    pub fn host_range(&self, u: usize) -> std::ops::Range<usize> {
        self.host_off[u]..self.host_off[u] + self.host[u]
    }

    /// Unit `u`'s device part in the device arrays.
    pub fn dev_range(&self, u: usize) -> std::ops::Range<usize> {
        self.dev_off[u]..self.dev_off[u] + self.piece[u] - self.host[u]
    }

    /// A shard-shaped vector (pieces unit after unit) cut into its host and device parts.
    pub fn cut<T: Copy>(&self, shard: &[T]) -> (Vec<T>, Vec<T>) {
        let (mut h, mut d) = (Vec::with_capacity(self.host_total), Vec::with_capacity(self.dev_total));
        let mut at = 0;
        for (&p, &hl) in self.piece.iter().zip(&self.host) {
            h.extend_from_slice(&shard[at..at + hl]);
            d.extend_from_slice(&shard[at + hl..at + p]);
            at += p;
        }
        (h, d)
    }

    /// The inverse of [`Split::cut`].
    pub fn join<T: Copy>(&self, host: &[T], dev: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.host_total + self.dev_total);
        for u in 0..self.units() {
            out.extend_from_slice(&host[self.host_range(u)]);
            out.extend_from_slice(&dev[self.dev_range(u)]);
        }
        out
    }
}

/// The host side's figures of one or more steps.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct OffloadStats {
    pub steps: u64,
    /// CPU threads of the host step.
    pub threads: usize,
    /// Seconds of host AdamW compute (wall time of the parallel step, summed over units).
    pub cpu_step_s: f64,
    /// Seconds from every gradient being on the host (the GPU's backward, reductions and
    /// copies done) to the last unit stepped: the host step's time not hidden behind the GPU.
    pub exposed_s: f64,
    /// NVMe: seconds the swap reader and writer were busy, bytes they moved, and seconds the
    /// host step waited for a read.
    pub nvme_read_s: f64,
    pub nvme_write_s: f64,
    pub nvme_bytes: u64,
    pub nvme_wait_s: f64,
}

impl OffloadStats {
    /// Share of the host step hidden behind GPU work.
    pub fn hidden_fraction(&self) -> f64 {
        if self.cpu_step_s <= 0.0 {
            0.0
        } else {
            (1.0 - self.exposed_s / self.cpu_step_s).clamp(0.0, 1.0)
        }
    }

    pub fn add(&mut self, o: &OffloadStats) {
        self.steps += o.steps;
        self.cpu_step_s += o.cpu_step_s;
        self.exposed_s += o.exposed_s;
        self.nvme_read_s += o.nvme_read_s;
        self.nvme_write_s += o.nvme_write_s;
        self.nvme_bytes += o.nvme_bytes;
        self.nvme_wait_s += o.nvme_wait_s;
    }
}

/// The host optimizer state of a rank's pieces (their host parts): in host memory, or with
/// `nvme` in its swap files (then `master`, `m` and `v` are empty). `m` and `v` are the
/// optimizer's state buffers in `state_names` order, empty where it keeps fewer.
pub struct HostState {
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub nvme: Option<NvmeStore>,
    pub decay: Vec<u8>,
    pub pool: rayon::ThreadPool,
    pub threads: usize,
    /// LAMB's norm layout and scratch (LAMB only).
    pub lamb: Option<LambHost>,
}

/// Page-locked staging of one unit's host part: the reduced gradient in, the bf16 parameters
/// out. They travel between the issuing thread and the worker with the unit's turn.
///
/// (cudarc's own events on page-locked memory are only recorded when it tracks streams, which
/// the GPU path turns off: the copies are awaited through the events here.)
pub struct Staging {
    pub u: usize,
    pub grad: PinnedHostSlice<f32>,
    pub param: PinnedHostSlice<bf16>,
    /// Recorded after the copy of the gradient into `grad`.
    pub grad_ready: Option<CudaEvent>,
    /// Recorded after the last copy out of `param` (the parameters of the previous step).
    pub param_free: Option<CudaEvent>,
}

/// An event on `s` that a host thread can wait on without spinning.
pub fn blocking_event(s: &CudaStream) -> cuda::Result<CudaEvent> {
    s.record_event(Some(EventFlags::CU_EVENT_BLOCKING_SYNC)).map_err(cuda::drv("recording a copy event"))
}

impl Staging {
    pub fn new(gpu: &Gpu, u: usize, len: usize) -> cuda::Result<Staging> {
        // Flags 0: cached page-locked memory (write-combined memory reads slowly on the CPU).
        // SAFETY: the contents are only read after a device copy has filled them (gradients) or
        // after the host step has written them (parameters).
        let grad = unsafe { gpu.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }
            .map_err(cuda::drv(format!("allocating {} bytes of page-locked host memory for unit {u}'s gradient", len * 4)))?;
        let param = unsafe { gpu.ctx.alloc_pinned_with_flags::<bf16>(len.max(1), 0) }
            .map_err(cuda::drv(format!("allocating {} bytes of page-locked host memory for unit {u}'s parameters", len * 2)))?;
        Ok(Staging { u, grad, param, grad_ready: None, param_free: None })
    }

    pub fn bytes(&self) -> usize {
        self.grad.num_bytes() + self.param.num_bytes()
    }
}

/// CPU threads for one rank's host step: this machine's cores shared by the `local_ranks` GPU
/// ranks on it.
pub fn default_threads(local_ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_ranks.max(1)).max(1)
}

/// What the worker is told for one step.
pub struct StepOrder {
    pub hp: HostStep,
    /// Units whose host part is non-empty: how many staging buffers will arrive.
    pub expected: usize,
}

/// The worker of one step: steps each unit's host part as its staging buffer arrives (in
/// arrival order) and sends it back with the new bf16 parameters. `scale` delivers the
/// gradient's multiplier (the clipping coefficient over the loss scale) before the first unit is
/// stepped, or `None` for an fp16 overflow: then every unit goes back unstepped. With NVMe the units' states
/// come from the swap pipeline (read ahead in the backward's order: last unit first) and go back
/// to it. Returns its figures, or why the swap files could not be written back.
pub fn worker(
    host: &mut HostState,
    split: &Split,
    order: StepOrder,
    units: Receiver<Staging>,
    scale: Receiver<Option<f32>>,
    done: Sender<Result<Staging, String>>,
) -> Result<OffloadStats, String> {
    let mut st = OffloadStats { steps: 1, threads: host.threads, ..OffloadStats::default() };
    let ch = Channels { order, units, scale, done };
    let Some(store) = host.nvme.take() else {
        step_units(host, split, &ch, &mut st, None);
        return Ok(st);
    };
    let seq: Vec<usize> = (0..split.units()).rev().filter(|&u| split.host[u] > 0).collect();
    let ((), io) = store.pipeline(&seq, |next, put| step_units(host, split, &ch, &mut st, Some((next, put))));
    host.nvme = Some(store);
    let io = io.map_err(|e| format!("the optimizer swap files: {e}"))?;
    (st.nvme_read_s, st.nvme_write_s, st.nvme_bytes, st.nvme_wait_s) = (io.read_s, io.write_s, io.bytes, io.wait_s);
    Ok(st)
}

/// What the worker receives and sends during one step.
struct Channels {
    order: StepOrder,
    units: Receiver<Staging>,
    scale: Receiver<Option<f32>>,
    done: Sender<Result<Staging, String>>,
}

/// NVMe: the swap pipeline's `next` (unit `u`'s state) and `put` (a stepped unit's, to write).
type Swap<'a> = (&'a mut dyn FnMut(usize) -> std::io::Result<UnitState>, &'a mut dyn FnMut(UnitState) -> std::io::Result<()>);

/// The worker's loop over the step's units (see [`worker`]); stops at the first failure, which
/// it reports through `done`.
fn step_units(host: &mut HostState, split: &Split, ch: &Channels, st: &mut OffloadStats, mut swap: Option<Swap<'_>>) {
    if let HostStep::Lamb(hp) = ch.order.hp {
        if swap.is_some() {
            let _ = ch.done.send(Err("LAMB's host step keeps its state in host memory (NVMe is refused at start)".into()));
            return;
        }
        return lamb_units(host, split, ch, st, &hp);
    }
    // `Some(None)`: the step overflowed (fp16) and is skipped.
    let mut coeff: Option<Option<f32>> = None;
    for _ in 0..ch.order.expected {
        let Ok(mut s) = ch.units.recv() else { return };
        let u = s.u;
        let res = (|| -> Result<(), String> {
            wait_copies(&mut s)?;
            let grad = s.grad.as_slice().map_err(|e| format!("reading unit {u}'s gradient staging: {e:?}"))?;
            let Some(k) = multiplier(&mut coeff, ch)? else {
                st.steps = 0;
                if let Some((next, put)) = swap.as_mut() {
                    // Skipped: the state goes back as it was read (the pipeline reads every unit ahead).
                    let state = next(u).map_err(|e| format!("reading unit {u}'s optimizer state from NVMe: {e}"))?;
                    put(state).map_err(|e| format!("queueing unit {u}'s optimizer state for NVMe: {e}"))?;
                }
                return Ok(());
            };
            let param = s.param.as_mut_slice().map_err(|e| format!("reading unit {u}'s parameter staging: {e:?}"))?;
            let r = split.host_range(u);
            let decay = &host.decay[r.clone()];
            let (grad, param) = (&grad[..r.len()], &mut param[..r.len()]);
            match swap.as_mut() {
                None => {
                    // A state buffer the optimizer does not keep is empty (`state_run`).
                    let (m, v) = (state_run(&mut host.m, r.clone()), state_run(&mut host.v, r.clone()));
                    let master = &mut host.master[r.clone()];
                    let t = Instant::now();
                    host_step_par(&host.pool, &ch.order.hp, k, HostAdamBufs { master, m, v, grad, decay, param });
                    st.cpu_step_s += t.elapsed().as_secs_f64();
                }
                Some((next, put)) => {
                    let mut state = next(u).map_err(|e| format!("reading unit {u}'s optimizer state from NVMe: {e}"))?;
                    let (master, m, v) = state.slices();
                    let t = Instant::now();
                    host_step_par(&host.pool, &ch.order.hp, k, HostAdamBufs { master, m, v, grad, decay, param });
                    st.cpu_step_s += t.elapsed().as_secs_f64();
                    put(state).map_err(|e| format!("queueing unit {u}'s optimizer state for NVMe: {e}"))?;
                }
            }
            Ok(())
        })();
        let failed = res.is_err();
        if ch.done.send(res.map(|()| s)).is_err() || failed {
            return;
        }
    }
}

/// Waits for unit `s.u`'s gradient copy to the host and for its previous parameter copy to the
/// GPU (the staging buffers are the worker's from then on).
fn wait_copies(s: &mut Staging) -> Result<(), String> {
    let u = s.u;
    if let Some(ev) = s.grad_ready.take() {
        ev.synchronize().map_err(|e| format!("waiting for unit {u}'s gradient copy to the host: {e:?}"))?;
    }
    if let Some(ev) = s.param_free.take() {
        ev.synchronize().map_err(|e| format!("waiting for unit {u}'s previous parameter copy to the GPU: {e:?}"))?;
    }
    Ok(())
}

/// The step's gradient multiplier, received once (`None`: an fp16 overflow, skip the step).
fn multiplier(coeff: &mut Option<Option<f32>>, ch: &Channels) -> Result<Option<f32>, String> {
    match *coeff {
        Some(k) => Ok(k),
        None => Ok(*coeff.insert(ch.scale.recv().map_err(|_| "the step ended before the gradient's multiplier was known".to_string())?)),
    }
}

/// LAMB's host step (see [`super::lamb_host`]): phase 1 for each unit as it arrives, holding its
/// staging; once all are in, the trust ratios, then each unit committed and handed back in
/// arrival order. An fp16 overflow hands every unit back unstepped.
fn lamb_units(host: &mut HostState, split: &Split, ch: &Channels, st: &mut OffloadStats, hp: &LambStep) {
    let HostState { master, m, v, decay, pool, lamb, .. } = host;
    let Some(lamb) = lamb.as_mut() else {
        let _ = ch.done.send(Err("LAMB's host step has no norm layout (the rank was built for another optimizer)".into()));
        return;
    };
    let c = hp.params.coeffs(hp.lr, hp.step);
    let (mut coeff, mut held) = (None, Vec::with_capacity(ch.order.expected));
    let mut skip = false;
    for _ in 0..ch.order.expected {
        let Ok(mut s) = ch.units.recv() else { return };
        let u = s.u;
        let res = (|| -> Result<(), String> {
            wait_copies(&mut s)?;
            let Some(k) = multiplier(&mut coeff, ch)? else {
                (skip, st.steps) = (true, 0);
                return Ok(());
            };
            let r = split.host_range(u);
            let grad = s.grad.as_mut_slice().map_err(|e| format!("reading unit {u}'s gradient staging: {e:?}"))?;
            let grad = &mut grad[..r.len()];
            let t = Instant::now();
            // The multiplier applied once, as the GPU kernels apply it (one f32 rounding).
            pool.install(|| grad.par_chunks_mut(CHUNK).for_each(|g| g.iter_mut().for_each(|x| *x *= k)));
            let state = LambState { master, m, v, decay };
            lamb.update(pool, &c, u, r.start, state, grad);
            st.cpu_step_s += t.elapsed().as_secs_f64();
            Ok(())
        })();
        if let Err(e) = res {
            let _ = ch.done.send(Err(e));
            return;
        }
        held.push(s);
    }
    if skip {
        for s in held {
            if ch.done.send(Ok(s)).is_err() {
                return;
            }
        }
        return;
    }
    let t = Instant::now();
    let ratios = lamb.ratios(pool, hp, master);
    st.cpu_step_s += t.elapsed().as_secs_f64();
    for mut s in held {
        let u = s.u;
        let res = (|| -> Result<(), String> {
            let r = split.host_range(u);
            let grad = s.grad.as_slice().map_err(|e| format!("reading unit {u}'s gradient staging: {e:?}"))?;
            let t = Instant::now();
            lamb.commit(pool, &c, &ratios, u, r.start, LambStateMut { master, m, v }, &grad[..r.len()]);
            let param = s.param.as_mut_slice().map_err(|e| format!("reading unit {u}'s parameter staging: {e:?}"))?;
            let src = &master[r.clone()];
            pool.install(|| {
                param[..r.len()].par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(o, p)| {
                    o.iter_mut().zip(p).for_each(|(o, &x)| *o = bf16::from_f32(x));
                })
            });
            st.cpu_step_s += t.elapsed().as_secs_f64();
            Ok(())
        })();
        let failed = res.is_err();
        if ch.done.send(res.map(|()| s)).is_err() || failed {
            return;
        }
    }
}

/// How long the issuing thread waits for one unit's host step before giving up.
pub const HOST_STEP_TIMEOUT: Duration = Duration::from_secs(300);

/// The host side of optimizer offload: what a GPU rank ([`super::zero::Rank`]) keeps of it.
pub struct Offload {
    /// Lent to the worker thread during a step; `None` only if a step failed.
    pub host: Option<HostState>,
    /// Per unit (host part non-empty): page-locked staging, lent to the worker during a step.
    pub staging: Vec<Option<Staging>>,
    /// Copy streams: gradients device → host, parameters host → device.
    pub d2h: Arc<CudaStream>,
    pub h2d: Arc<CudaStream>,
    /// During a step: hands each unit's staging (gradient copy enqueued) to the worker.
    pub tx: Option<Sender<Staging>>,
    pub ratio: f64,
    pub stats: OffloadStats,
}

impl Offload {
    /// Rank `rank`'s host side: the host parts (`master_host`, `mask_host`) of its optimizer
    /// pieces as `split` cuts them, fresh state (`states` buffers at `init`, in swap files under
    /// `nvme`'s directory when given), `threads` CPU threads, a staging pair per unit with a host
    /// part, and the two copy streams; `lamb`: LAMB's norm layout (LAMB only).
    pub fn new(
        gpu: &Gpu,
        rank: usize,
        split: &Split,
        (master_host, mask_host): (Vec<f32>, Vec<u8>),
        (states, init): (usize, f32),
        o: OffloadOptions,
        (nvme, lamb): (Option<&NvmeSite>, Option<LambHost>),
    ) -> Result<Offload> {
        let threads = o.threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("tessera-cpu-adam-{rank}-{i}"))
            .build()
            .context("starting the host optimizer's threads")?;
        let n = split.host_total;
        let host = match nvme {
            None => {
                let buf = |k: usize| if states > k { vec![init; n] } else { Vec::new() };
                HostState { master: master_host, m: buf(0), v: buf(1), nvme: None, decay: mask_host, pool, threads, lamb }
            }
            Some(site) => {
                let store = NvmeStore::create(&site.dir, rank, &site.aio, split, &master_host)?;
                if init != 0.0 {
                    // The files start zero-filled; Adagrad's accumulator starts at its value.
                    store.write_buffer(1, &vec![init; n]).context("writing the initial accumulator to its swap file")?;
                }
                HostState { master: Vec::new(), m: Vec::new(), v: Vec::new(), nvme: Some(store), decay: mask_host, pool, threads, lamb }
            }
        };
        let mut staging = Vec::with_capacity(split.units());
        for (u, &h) in split.host.iter().enumerate() {
            staging.push(if h > 0 { Some(Staging::new(gpu, u, h)?) } else { None });
        }
        let d2h = gpu.ctx.new_stream().map_err(cuda::drv("creating the device → host copy stream"))?;
        let h2d = gpu.ctx.new_stream().map_err(cuda::drv("creating the host → device copy stream"))?;
        Ok(Offload { host: Some(host), staging, d2h, h2d, tx: None, ratio: o.ratio, stats: OffloadStats { threads, ..Default::default() } })
    }
}

/// Where NVMe optimizer offload keeps a rank's swap files (`offload_optimizer.nvme_path`) and how
/// it reads and writes them (the `aio` section).
#[derive(Clone, Debug)]
pub struct NvmeSite {
    pub dir: std::path::PathBuf,
    pub aio: crate::offload::AioOptions,
}

/// What the issuing thread keeps of one step's host pipeline.
pub struct Pipe {
    /// The gradient's multiplier for the host step, or `None`: the step overflowed, skip it.
    pub scale: Sender<Option<f32>>,
    pub done: Receiver<Result<Staging, String>>,
    pub expected: usize,
}

/// Runs one step with its host pipeline: starts [`worker`] over `host` on a scoped thread, then
/// `step` with the sender the rank hands each unit's staging to and the issuing side's [`Pipe`].
/// `step` must drop the sender before it returns (the worker waits for units that will not
/// come otherwise). `known_scale`: the gradient's multiplier when it is known before the
/// backward (1 without clipping and fp16); otherwise `step` sends it through [`Pipe::scale`].
/// Returns `step`'s result and the worker's figures (`None` if it could not start).
pub fn run_step<T>(
    host: &mut HostState,
    split: &Split,
    hp: HostStep,
    rank: usize,
    known_scale: Option<f32>,
    step: impl FnOnce(Sender<Staging>, Pipe) -> Result<T>,
) -> (Result<T>, Option<std::thread::Result<Result<OffloadStats, String>>>) {
    let expected = split.host.iter().filter(|&&h| h > 0).count();
    let (unit_tx, unit_rx) = mpsc::channel();
    let (scale_tx, scale_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    if let Some(k) = known_scale {
        // Each unit can be stepped as soon as its gradient arrives.
        let _ = scale_tx.send(Some(k));
    }
    std::thread::scope(|s| {
        let order = StepOrder { hp, expected };
        let worker = std::thread::Builder::new()
            .name(format!("tessera-offload-{rank}"))
            .spawn_scoped(s, move || worker(host, split, order, unit_rx, scale_rx, done_tx));
        let res = match &worker {
            Ok(_) => step(unit_tx, Pipe { scale: scale_tx, done: done_rx, expected }),
            Err(e) => Err(anyhow::anyhow!("starting the host optimizer thread: {e}")),
        };
        let stats = worker.ok().map(|h| h.join());
        (res, stats)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::optim::{AdamParams, FlatLayout, LocalReduce, OptimizerKind, OptimizerShard, StepContext};
    use tessera_kernels::tensor::Rng;

    fn randv(seed: u64, key: u64, len: usize, std: f32) -> Vec<f32> {
        let mut v = vec![0f32; len];
        Rng::derive(seed, &[key]).fill_normal(&mut v, std);
        v
    }

    /// With no subnormal anywhere, the host step is the CPU optimizer's Adam (the same
    /// operation order), and its bf16 output is the rounding of the new masters; at both lerp
    /// forms of m (β1 < 0.5 and ≥ 0.5), in AdamW mode and with an L2 penalty, with and without
    /// bias correction (`AdamStep::of` the CPU params; `AdamStep::new` is AdamW's).
    #[test]
    fn host_adamw_matches_the_cpu_optimizer_on_normal_values() {
        let len = 10_000;
        let (lr, eps, wd, grad_scale) = (6e-4f32, 1e-8f32, 0.1f32, 0.5f32);
        let master = randv(1, 0, len, 0.02);
        let grad = randv(1, 1, len, 1e-2);
        let m0 = randv(1, 2, len, 1e-3);
        let v0: Vec<f32> = randv(1, 3, len, 1e-3).iter().map(|x| x * x).collect();
        // Two tensors: the first decays, the second does not.
        let cut = 6_000;
        let decay: Vec<u8> = (0..len).map(|i| u8::from(i < cut)).collect();
        let layout = FlatLayout::new(vec![0..cut, cut..len]).unwrap();
        let flags = [true, false];
        let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &flags };
        let g_scaled: Vec<f32> = grad.iter().map(|g| g * grad_scale).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let modes = [(true, true), (false, true), (true, false), (false, false)];
        for (betas, (adam_w_mode, bias_correction)) in [(0.9f32, 0.95f32), (0.3, 0.999)].into_iter().flat_map(|b| modes.map(|m| (b, m))) {
            let params = AdamParams { lr, betas, eps, weight_decay: wd, adam_w_mode, bias_correction, momentum_cycle: None };
            let mut shard = OptimizerShard::new(OptimizerKind::Adam(params), len);
            // Step the CPU optimizer to step 3 from the same moments.
            shard.load_state(2, &[("exp_avg", m0.clone()), ("exp_avg_sq", v0.clone())]).unwrap();
            let mut p_cpu = master.clone();
            shard.step(&mut p_cpu, &g_scaled, lr, &ctx, &mut LocalReduce).unwrap();
            let hp = AdamStep::of(&params, lr, 3);
            if adam_w_mode && bias_correction {
                assert_eq!(hp, AdamStep::new(lr, betas, eps, wd, 3));
            }
            let (mut p, mut m, mut v) = (master.clone(), m0.clone(), v0.clone());
            let mut out = vec![bf16::ZERO; len];
            let bufs = HostAdamBufs { master: &mut p, m: &mut m, v: &mut v, grad: &grad, decay: &decay, param: &mut out };
            adamw_host_par(&pool, &hp, grad_scale, bufs);
            let bufs = shard.state_buffers();
            let betas = (betas, adam_w_mode, bias_correction);
            assert_eq!(bits(&p), bits(&p_cpu), "masters, betas {betas:?}");
            assert_eq!(bits(&m), bits(bufs[0].1), "exp_avg, betas {betas:?}");
            assert_eq!(bits(&v), bits(bufs[1].1), "exp_avg_sq, betas {betas:?}");
            assert!(out.iter().zip(&p).all(|(b, x)| *b == bf16::from_f32(*x)));
            assert_ne!(bits(&p), bits(&master), "the step changed nothing");
        }
    }

    /// SGD (with and without momentum: no state buffer at all), Lion and Adagrad (from its
    /// initial accumulator) through the host step: the CPU optimizer's bits over three steps,
    /// with a clipping coefficient, decay runs that cross the host step's chunks, and bf16
    /// parameters that are the new masters rounded.
    #[test]
    fn the_host_step_of_the_other_optimizers_is_the_cpu_optimizers() {
        use tessera_kernels::optim::{AdagradParams, ElementwiseStep, LionParams, SgdParams};
        let len = 3 * CHUNK + 1000;
        let cuts = [0, 5000, CHUNK + 7, 2 * CHUNK + 300, len];
        let layout = FlatLayout::new(cuts.windows(2).map(|w| w[0]..w[1]).collect()).unwrap();
        let flags = [true, false, true, false];
        let decay: Vec<u8> = layout.segments().iter().zip(&flags).flat_map(|(r, &d)| std::iter::repeat_n(u8::from(d), r.len())).collect();
        let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &flags };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let sgd = SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, nesterov: false };
        for kind in [
            OptimizerKind::Sgd(sgd),
            OptimizerKind::Sgd(SgdParams { momentum: 0.0, dampening: 0.0, ..sgd }),
            OptimizerKind::Lion(LionParams { lr: 1e-3, betas: (0.9, 0.99), weight_decay: 0.1, momentum_cycle: None }),
            OptimizerKind::Adagrad(AdagradParams {
                lr: 0.05,
                lr_decay: 0.1,
                eps: 1e-10,
                weight_decay: 0.01,
                initial_accumulator_value: 0.1,
            }),
        ] {
            let mut shard = OptimizerShard::new(kind, len);
            let mut p_cpu = randv(2, 0, len, 0.02);
            let mut p = p_cpu.clone();
            let states = kind.state_names().len();
            let buf = |k: usize| if states > k { vec![kind.state_init(); len] } else { Vec::new() };
            let (mut m, mut v) = (buf(0), buf(1));
            let mut out = vec![bf16::ZERO; len];
            for step in 1..=3u64 {
                let grad = randv(2, step, len, 1e-2);
                let (k, lr) = (0.75f32, 0.05 / step as f32);
                let scaled: Vec<f32> = grad.iter().map(|g| g * k).collect();
                shard.step(&mut p_cpu, &scaled, lr, &ctx, &mut LocalReduce).unwrap();
                let hp = HostStep::Cpu(ElementwiseStep::new(&kind, lr, step).unwrap());
                let bufs = HostAdamBufs { master: &mut p, m: &mut m, v: &mut v, grad: &grad, decay: &decay, param: &mut out };
                host_step_par(&pool, &hp, k, bufs);
                assert_eq!(bits(&p), bits(&p_cpu), "{} step {step}: masters", kind.name());
            }
            for ((name, want), got) in shard.state_buffers().into_iter().zip([&m, &v]) {
                assert_eq!(bits(got), bits(want), "{}: {name}", kind.name());
            }
            assert!(out.iter().zip(&p).all(|(b, x)| *b == bf16::from_f32(*x)), "{}: bf16 parameters", kind.name());
        }
    }

    /// Subnormal inputs read as zeros and subnormal results become zeros, as the GPU's
    /// fast-math arithmetic does.
    #[test]
    fn subnormals_are_flushed_like_the_gpu() {
        assert_eq!(ftz(1e-40).to_bits(), 0);
        assert_eq!(ftz(-1e-40).to_bits(), 0x8000_0000);
        assert_eq!(ftz(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
        assert!(ftz(f32::NAN).is_nan());
        assert_eq!(ftz(f32::INFINITY), f32::INFINITY);
        let hp = AdamStep::new(1e-3, (0.9, 0.999), 1e-8, 0.0, 1);
        // A subnormal gradient is a zero gradient: m and v stay exactly zero.
        let (mut p, mut m, mut v, mut out) = ([0.5f32], [0f32], [0f32], [bf16::ZERO]);
        adamw_host(&hp, 1.0, HostAdamBufs { master: &mut p, m: &mut m, v: &mut v, grad: &[1e-39], decay: &[0], param: &mut out });
        assert_eq!((m[0].to_bits(), v[0].to_bits(), p[0]), (0, 0, 0.5));
        // A tiny gradient whose square underflows: v is flushed to zero, m is not.
        let (mut p, mut m, mut v) = ([0.5f32], [0f32], [0f32]);
        adamw_host(&hp, 1.0, HostAdamBufs { master: &mut p, m: &mut m, v: &mut v, grad: &[1e-20], decay: &[0], param: &mut out });
        assert_eq!(v[0].to_bits(), 0);
        assert!(m[0] > 0.0);
    }

    /// `to_bf16` is `bf16::from_f32` on every 251st bit pattern and at the rounding edges.
    #[test]
    fn branch_free_bf16_rounding_is_the_half_crates() {
        let edges = [0u32, 0x8000, 0x8001, 0x18000, 0x7f7f_ffff, 0x7f80_0000, 0x7f80_0001, 0x7fc0_0000, 0xffff_ffff, 0x8000_8000];
        for b in (0..=u32::MAX).step_by(251).chain(edges) {
            let x = f32::from_bits(b);
            assert_eq!(to_bf16(x).to_bits(), bf16::from_f32(x).to_bits(), "bits {b:#010x}");
        }
    }

    /// The vectorized host step gives, element by element, what the kernel's expression written
    /// with branches gives (the form it had before it was made branch-free), on blocks and a tail,
    /// with subnormal, zero, huge, infinite and NaN inputs among normal ones, decayed and not, at
    /// both lerp forms, with and without an L2 penalty.
    #[test]
    fn the_vector_path_gives_the_branchy_scalar_bits() {
        fn reference(c: &Coeffs, small_w: bool, master: &mut f32, m: &mut f32, v: &mut f32, grad: f32, decay: u8) -> bf16 {
            let g0 = ftz(ftz(grad) * c.grad_scale);
            let factor = if decay != 0 { c.decoupled_factor } else { 1.0 };
            let pd = ftz(ftz(*master) * factor);
            let g = if decay != 0 && c.l2 != 0.0 { ftz(g0 + ftz(c.l2 * pd)) } else { g0 };
            let m0 = ftz(*m);
            let m1 = if small_w { ftz(m0 + ftz(c.lerp_w * ftz(g - m0))) } else { ftz(g - ftz(ftz(g - m0) * c.one_minus_lerp_w)) };
            let v1 = ftz(ftz(ftz(*v) * c.beta2) + ftz(ftz(c.one_minus_beta2 * g) * g));
            let denom = ftz(ftz(ftz(v1.sqrt()) / c.bc2_sqrt) + c.eps);
            let p1 = ftz(pd - ftz(c.step_size * ftz(m1 / denom)));
            (*m, *v, *master) = (m1, v1, p1);
            bf16::from_f32(p1)
        }
        let len = 16 * 64 + 7;
        let odd = [1e-40f32, -1e-39, 0.0, -0.0, 3e38, -3e38, f32::INFINITY, f32::NAN, f32::MIN_POSITIVE, 1e-20];
        let spice = |v: &mut Vec<f32>, k: usize| (0..len).step_by(13 + k).enumerate().for_each(|(j, i)| v[i] = odd[(j + k) % odd.len()]);
        for (betas, wd, adam_w) in [((0.9, 0.95), 0.1, true), ((0.3, 0.999), 0.01, false)] {
            let mut hp = AdamStep::new(1e-3, betas, 1e-8, wd, 3);
            if !adam_w {
                (hp.decoupled_factor, hp.l2) = (1.0, wd);
            }
            let (mut master, mut grad, mut m) = (randv(7, 0, len, 0.02), randv(7, 1, len, 1e-2), randv(7, 2, len, 1e-3));
            let mut v: Vec<f32> = randv(7, 3, len, 1e-3).iter().map(|x| x * x).collect();
            for (k, buf) in [&mut master, &mut grad, &mut m, &mut v].into_iter().enumerate() {
                spice(buf, k);
            }
            let decay: Vec<u8> = (0..len).map(|i| u8::from(i % 5 != 0)).collect();
            let (mut em, mut ev, mut ep) = (m.clone(), v.clone(), master.clone());
            let c = Coeffs::new(&hp, 0.75);
            let want: Vec<bf16> =
                (0..len).map(|i| reference(&c, c.lerp_w < 0.5, &mut ep[i], &mut em[i], &mut ev[i], grad[i], decay[i])).collect();
            let mut out = vec![bf16::ZERO; len];
            adamw_host(&hp, 0.75, HostAdamBufs { master: &mut master, m: &mut m, v: &mut v, grad: &grad, decay: &decay, param: &mut out });
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&master), bits(&ep), "masters, betas {betas:?}");
            assert_eq!(bits(&m), bits(&em), "m, betas {betas:?}");
            assert_eq!(bits(&v), bits(&ev), "v, betas {betas:?}");
            assert_eq!(out.iter().map(|b| b.to_bits()).collect::<Vec<_>>(), want.iter().map(|b| b.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn split_cuts_and_joins_pieces() {
        let s = Split::new(vec![8, 4, 0, 6], 0.5);
        assert_eq!(s.host, vec![4, 2, 0, 3]);
        assert_eq!((s.host_total, s.dev_total), (9, 9));
        let shard: Vec<u32> = (0..18).collect();
        let (h, d) = s.cut(&shard);
        assert_eq!(h, vec![0, 1, 2, 3, 8, 9, 12, 13, 14]);
        assert_eq!(d, vec![4, 5, 6, 7, 10, 11, 15, 16, 17]);
        assert_eq!(s.join(&h, &d), shard);
        let all = Split::new(vec![8, 4], 1.0);
        assert_eq!((all.host_total, all.dev_total, all.dev_range(1)), (12, 0, 0..0));
        let none = Split::new(vec![8, 4], 0.0);
        assert_eq!((none.host_total, none.dev_total, none.dev_range(1)), (0, 12, 8..12));
    }
}
