//! Where a rank's forward and backward run: on the CPU (the model's kernels, unit by unit), or on
//! a GPU (`tessera.device = "cuda"` with `tessera.gpu.collective = "quic"`).
//!
//! A GPU rank is a rank of the one engine like any other: the same [`super::zero::ZeroWorker`],
//! the same step transaction, plan epochs, replicas, checkpoints and recovery. Only the
//! micro-batch's forward and backward move to the device. The engine hands the model its
//! parameters and takes its gradients unit by unit ([`UnitAccess`]), in the fixed order of the
//! plan's unit events (stage 3 gathers a unit at its use); the GPU runs the whole micro-batch at
//! once. [`Staged`] reconciles the two: it takes every unit's parameters at its forward use (the
//! gathers happen then, as on the CPU), runs the micro-batch on the device, and hands each unit's
//! gradient back at its backward use, in the same order, so every rank issues the same
//! collectives in the same order as a CPU rank would. The gradients then leave through the
//! engine's buckets, owners and fixed tree over the run's transport (QUIC between processes and
//! hosts, threads in one process): the host-staged collective of GPU ranks.
//!
//! Bits: the device's kernels are deterministic and a micro-batch's gradient does not depend on
//! which rank computes it, so a GPU run gives the same `params_blake3` for every world size,
//! ZeRO stage and membership history — as a CPU run does, though not the CPU's bits (bf16
//! activations, other kernels).
//!
//! One process holds one device context ([`GpuExec`], shared by the ranks of the process:
//! `--world N` threads take turns on it; it is held only while the device computes, never
//! across a collective).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use rayon::prelude::*;
use tessera_actors::compute::MoeTally;
use tessera_kernels::cuda::{self, bf16, gpt, Buf, DPtr, Gpu};
#[cfg(test)]
use tessera_kernels::model::FlatAccess;
use tessera_kernels::model::{MicroBatch, Model, UnitAccess, Workspace};

use crate::config::ComputeDevice;

/// A rank's device for forward and backward.
pub enum Device {
    /// The model's CPU kernels, unit by unit.
    Cpu(Box<Workspace>),
    /// Whole micro-batches on a GPU, staged through the host.
    Cuda(Box<Staged>),
}

impl Device {
    pub fn new(kind: ComputeDevice) -> Device {
        match kind {
            ComputeDevice::Cpu => Device::Cpu(Box::default()),
            ComputeDevice::Cuda => Device::Cuda(Box::new(Staged::new(Whole::Gpu))),
        }
    }

    /// A new prepare begins: the parameters may have changed since the last one.
    pub fn begin_step(&mut self) {
        if let Device::Cuda(s) = self {
            s.generation += 1;
        }
    }

    /// One micro-batch's forward and backward (gradients of `dloss ×` its mean loss through
    /// `acc`); returns its mean loss. `rank` picks the GPU (`rank % count`) when the process
    /// opens one.
    pub fn forward_backward(
        &mut self,
        model: &Model,
        acc: &mut dyn UnitAccess,
        batch: MicroBatch<'_>,
        dloss: f32,
        rank: usize,
    ) -> Result<f32, String> {
        match self {
            Device::Cpu(ws) => Ok(model.forward_backward(acc, batch, dloss, ws)),
            Device::Cuda(s) => s.forward_backward(model, acc, batch, dloss, rank),
        }
    }

    /// The MoE routing statistics of the last micro-batch as a tally of one micro-batch
    /// (`None` for dense models, and on the GPU, whose kernels have no MoE blocks).
    pub fn moe_tally(&self) -> Option<MoeTally> {
        match self {
            Device::Cpu(ws) => super::moe_stats::tally_of(ws.moe_stats()),
            Device::Cuda(_) => None,
        }
    }

    /// When the last micro-batch's forward ended (the CPU marks it; the GPU runs the whole
    /// micro-batch at once and does not).
    pub fn take_loss_instant(&mut self) -> Option<Instant> {
        match self {
            Device::Cpu(ws) => ws.take_loss_instant(),
            Device::Cuda(_) => None,
        }
    }
}

/// What runs a whole micro-batch over full-length parameters and gradients (CPU layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whole {
    /// The process's GPU ([`GpuExec`]).
    Gpu,
    /// The CPU model over the full buffers: the staging with the CPU's arithmetic, which the
    /// tests compare with the unit-by-unit path bit for bit.
    #[cfg(test)]
    Cpu,
}

/// Every staging gets its own id: the device's parameter buffer remembers whose it holds.
static NEXT_STAGING: AtomicU64 = AtomicU64::new(1);

/// One rank's host side of whole-micro-batch compute: the full parameters as the engine handed
/// them out this step, and the full gradient of the last micro-batch.
pub struct Staged {
    whole: Whole,
    id: u64,
    /// Bumped at every prepare: parameters are constant within one.
    generation: u64,
    /// The generation `params` holds.
    filled: Option<u64>,
    params: Vec<f32>,
    grads: Vec<f32>,
    #[cfg(test)]
    cpu_ws: Workspace,
}

impl Staged {
    pub fn new(whole: Whole) -> Staged {
        Staged {
            whole,
            id: NEXT_STAGING.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            filled: None,
            params: Vec::new(),
            grads: Vec::new(),
            #[cfg(test)]
            cpu_ws: Workspace::default(),
        }
    }

    /// The engine's unit events of one micro-batch, in the model's order (`Plan::unit_events`):
    /// forward uses 0..=L and the head's use of unit 0 (parameters taken: stage 3 gathers them
    /// here), the whole micro-batch on the device, then the backward uses L..=1 and 0, each
    /// handed its unit's gradient and marked ready. A device error still completes the events
    /// (with zero gradients), so this rank's collectives stay in step with its peers', and is
    /// returned after them.
    fn forward_backward(
        &mut self,
        model: &Model,
        acc: &mut dyn UnitAccess,
        batch: MicroBatch<'_>,
        dloss: f32,
        rank: usize,
    ) -> Result<f32, String> {
        let units = model.units();
        let n = model.num_params();
        if self.params.len() != n {
            (self.params, self.grads, self.filled) = (vec![0.0; n], vec![0.0; n], None);
        }
        let fill = self.filled != Some(self.generation);
        for (u, r) in units.iter().enumerate() {
            let (p, _) = acc.unit(u);
            if fill {
                self.params[r.clone()].copy_from_slice(p);
            }
        }
        self.filled = Some(self.generation);
        // The head's use of the tied embedding (its gradient arrives with unit 0's, below).
        let _ = acc.unit(0);
        self.grads.fill(0.0);
        let loss = match self.whole {
            Whole::Gpu => {
                let key = Loaded { staging: self.id, generation: self.generation };
                gpu_forward_backward(model, &self.params, key, &mut self.grads, batch, dloss, rank)
            }
            #[cfg(test)]
            Whole::Cpu => {
                let mut flat = FlatAccess { params: &self.params, grads: &mut self.grads, units };
                Ok(model.forward_backward(&mut flat, batch, dloss, &mut self.cpu_ws))
            }
        };
        if loss.is_err() {
            self.grads.fill(0.0);
        }
        for u in (1..units.len()).rev().chain([0]) {
            let (_, g) = acc.unit(u);
            g.par_iter_mut().zip(&self.grads[units[u].clone()]).with_min_len(1 << 16).for_each(|(d, s)| *d += s);
            acc.grads_ready(u);
        }
        loss
    }
}

/// Which parameters the device buffer holds: a staging's generation (or an evaluation's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loaded {
    staging: u64,
    generation: u64,
}

/// What a device context was built for: the model's size and one micro-batch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ExecKey {
    params: usize,
    b: usize,
    t: usize,
    recompute: bool,
}

/// The process's GPU: its context, a workspace for one micro-batch shape, and full-length bf16
/// parameters and f32 gradients in the GPU's padded layout (one piece per unit).
struct GpuExec {
    key: ExecKey,
    gpu: Arc<Gpu>,
    layout: gpt::GpuLayout,
    ws: gpt::Workspace,
    params: Buf<bf16>,
    grads: Buf<f32>,
    loaded: Option<Loaded>,
}

static EXEC: Mutex<Option<GpuExec>> = Mutex::new(None);

fn exec_lock() -> MutexGuard<'static, Option<GpuExec>> {
    EXEC.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu_err(e: impl std::fmt::Display) -> String {
    format!("GPU: {e}")
}

/// Checks that `model` with micro-batches of `b × t` tokens can run on the GPU path (GPT-2 with
/// head dimension 64, or the LLaMA family with head dimension 64 or 128; `t` within the
/// context), without touching a GPU.
pub fn check_model(model: &Model, b: usize, t: usize) -> Result<(), String> {
    gpt::GpuLayout::new(model, 1).map_err(|e| e.to_string())?;
    gpt::Shape::new(&model.cfg, b, t).map_err(|e| e.to_string())?;
    Ok(())
}

/// The process's GPU context for `model` and `b × t` micro-batches, built on first use (and
/// rebuilt for another shape).
fn exec_for<'a>(slot: &'a mut Option<GpuExec>, model: &Model, (b, t): (usize, usize), rank: usize) -> Result<&'a mut GpuExec, String> {
    let key = ExecKey { params: model.num_params(), b, t, recompute: model.checkpoint_activations };
    if slot.as_ref().is_none_or(|e| e.key != key) {
        let gpu = match slot.take() {
            Some(e) => e.gpu,
            None => {
                let count = cuda::device_count().map_err(gpu_err)?;
                if count == 0 {
                    return Err("tessera.device = \"cuda\": the CUDA driver reports no GPU on this host".into());
                }
                Gpu::open(rank % count).map_err(gpu_err)?
            }
        };
        gpu.ctx.bind_to_thread().map_err(|e| gpu_err(format!("binding the context: {e:?}")))?;
        let layout = gpt::GpuLayout::new(model, 1).map_err(gpu_err)?;
        let shape = gpt::Shape::new(&model.cfg, b, t).map_err(gpu_err)?;
        let fusions = gpt::Fusions::requested().map_err(gpu_err)?;
        let ws = gpt::Workspace::with_options(&gpu, shape, &layout, fusions, key.recompute).map_err(gpu_err)?;
        let params = gpu.alloc::<bf16>(layout.total).map_err(gpu_err)?;
        let grads = gpu.alloc::<f32>(layout.total).map_err(gpu_err)?;
        *slot = Some(GpuExec { key, gpu, layout, ws, params, grads, loaded: None });
    }
    let e = slot.as_mut().expect("built above");
    e.gpu.ctx.bind_to_thread().map_err(|err| gpu_err(format!("binding the context: {err:?}")))?;
    Ok(e)
}

impl GpuExec {
    /// Makes the device parameters `params` (CPU layout, f32) unless they are `key`'s already.
    fn load(&mut self, params: &[f32], key: Loaded) -> Result<(), String> {
        if self.loaded == Some(key) {
            return Ok(());
        }
        self.loaded = None;
        let padded: Vec<bf16> = self.layout.pad(params).par_iter().map(|&x| bf16::from_f32(x)).collect();
        self.gpu.write(&mut self.params, 0, &padded).map_err(gpu_err)?;
        self.loaded = Some(key);
        Ok(())
    }
}

/// The hooks of a whole micro-batch over full device buffers: nothing to gather or reduce.
struct FullHooks<'a> {
    layout: &'a gpt::GpuLayout,
    params: DPtr<bf16>,
    grads: DPtr<f32>,
}

impl gpt::UnitHooks for FullHooks<'_> {
    fn params(&mut self, u: usize, _phase: gpt::Phase) -> cuda::Result<DPtr<bf16>> {
        Ok(self.params.slice(self.layout.units[u].clone()))
    }
    fn params_done(&mut self, _u: usize, _phase: gpt::Phase) -> cuda::Result<()> {
        Ok(())
    }
    fn grads(&mut self, u: usize) -> cuda::Result<DPtr<f32>> {
        Ok(self.grads.slice(self.layout.units[u].clone()))
    }
    fn grads_done(&mut self, _u: usize) -> cuda::Result<()> {
        Ok(())
    }
}

/// One micro-batch on this process's GPU (`rank % count`) with the parameters `params` (loaded
/// unless `key` says the device holds them); its gradient overwrites `grads`.
fn gpu_forward_backward(
    model: &Model,
    params: &[f32],
    key: Loaded,
    grads: &mut [f32],
    batch: MicroBatch<'_>,
    dloss: f32,
    rank: usize,
) -> Result<f32, String> {
    let MicroBatch { tokens, targets, b, t, .. } = batch;
    let mut slot = exec_lock();
    let e = exec_for(&mut slot, model, (b, t), rank)?;
    e.load(params, key)?;
    e.gpu.zero(e.grads.ptr(), &e.gpu.stream).map_err(gpu_err)?;
    let mut hooks = FullHooks { layout: &e.layout, params: e.params.ptr(), grads: e.grads.ptr() };
    gpt::forward_backward(&e.gpu, &mut hooks, &mut e.ws, tokens, targets, dloss).map_err(gpu_err)?;
    let loss = gpt::mean_loss(&e.gpu, &e.ws).map_err(gpu_err)?;
    let g = e.gpu.download(e.grads.ptr()).map_err(gpu_err)?;
    grads.copy_from_slice(&e.layout.unpad(&g));
    Ok(loss)
}

/// Refuses GPU ranks on a host without a GPU.
pub fn require_gpu() -> anyhow::Result<()> {
    if cuda::device_count()? == 0 {
        anyhow::bail!(
            "the CUDA driver reports no GPU on this machine: tessera.device = \"cuda\" needs an NVIDIA GPU; use --device cpu here"
        );
    }
    Ok(())
}

/// Whether this host has a GPU to evaluate on. A driver without one (a coordinator whose GPU
/// ranks are agents on other hosts) evaluates on its CPU — f32 activations, so the validation
/// loss differs from a GPU evaluation in the last digits — and says so once.
pub fn gpu_here() -> bool {
    static HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HERE.get_or_init(|| {
        let here = cuda::device_count().is_ok_and(|n| n > 0);
        if !here {
            tracing::warn!(
                "tessera.device = \"cuda\": this host has no GPU, so the driver evaluates on its CPU (f32 activations; the \
                 ranks train on their GPUs)"
            );
        }
        here
    })
}

/// Evaluations load their parameters under this staging id (never a rank's).
const EVAL_STAGING: u64 = 0;
static EVAL_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Mean loss of `batches` (forward only) on the process's GPU over `params` (CPU layout, the
/// working parameters).
pub fn gpu_eval_loss(
    model: &Model,
    params: &[f32],
    (b, t): (usize, usize),
    batches: impl Iterator<Item = (Vec<u32>, Vec<u32>)>,
) -> Result<f64, String> {
    let mut slot = exec_lock();
    let e = exec_for(&mut slot, model, (b, t), 0)?;
    let key = Loaded { staging: EVAL_STAGING, generation: EVAL_GENERATION.fetch_add(1, Ordering::Relaxed) };
    e.load(params, key)?;
    let (mut sum, mut count) = (0.0f64, 0usize);
    for (x, y) in batches {
        let mut hooks = FullHooks { layout: &e.layout, params: e.params.ptr(), grads: e.grads.ptr() };
        gpt::forward_loss(&e.gpu, &mut hooks, &mut e.ws, &x, &y).map_err(gpu_err)?;
        sum += f64::from(gpt::mean_loss(&e.gpu, &e.ws).map_err(gpu_err)?);
        count += 1;
    }
    Ok(sum / count.max(1) as f64)
}
