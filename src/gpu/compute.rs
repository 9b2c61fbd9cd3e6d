//! NCCL GPU ranks as ranks of the one engine: each GPU's [`Rank`] (device-resident bf16
//! parameters, fp32 masters and optimizer state, NCCL between the GPUs) behind the engine's compute
//! boundary ([`WorkerCompute`]: prepare / commit / abandon), driven by `engine::run`'s step loop
//! like the CPU `ZeroWorker` — one step transaction, one checkpoint writer, one evaluation
//! path, one `summary.json`.
//!
//! The ranks are threads of the driver process, one per GPU of this host (NCCL's
//! one-thread-per-rank mode); [`GpuRanks`] is how the driver reads their state between steps
//! (checkpoints, evaluation, the summary's device figures). Every read that gathers over NCCL
//! runs on every rank at once, one scoped thread each.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{ComputeError, MemoryReport, Prepared, StepOrder, WorkerCompute};
use tessera_kernels::cuda::{self, gpt, Gpu};
use tessera_kernels::optim::{LossScaler, StepOutcome};
use tessera_transport::nccl::{NcclComm, NcclId};

use super::offload::OffloadStats;
use super::zero::{OffloadOptions, Optimizer, Rank, RankSpec, StateBytes};
use crate::data::{self, Sampler};
use crate::engine::{GpuFigures, HostOptimizerFigures, Plan};

/// What the GPU ranks are built with besides the plan and the start state (checked against the
/// device budget before any GPU is touched: [`super::train::GpuSetup`]).
#[derive(Clone, Debug)]
pub struct GpuRankOptions {
    pub optim: Optimizer,
    pub offload: Option<OffloadOptions>,
    /// Activation checkpointing (`Workspace::with_options`).
    pub recompute: bool,
    /// `zero_optimization.overlap_comm`.
    pub overlap: bool,
    /// The model states each rank was planned to hold (the budget was checked against them).
    pub states: StateBytes,
    /// Steps the run abandons once (`--abandon-step`): the update then never overlaps the
    /// backward, so an abandoned step leaves the state as it was.
    pub abandons: bool,
    /// `offload_optimizer.device = "nvme"`: the swap files' directory and I/O options.
    pub nvme: Option<super::offload::NvmeSite>,
    /// `offload_param` (stage 3): where the bf16 parameter shard lives.
    pub params_offload: Option<super::param_offload::ParamOffloadOptions>,
    /// `tessera.device_memory_bytes_max`: the model states were checked against it before any
    /// GPU was touched; each rank checks everything it allocated (activations and scratch too)
    /// once built, before the first step ([`check_device_total`]).
    pub budget: Option<u64>,
    /// fp16: the loss scaler the config asks for (`bridge::loss_scaler`), as at step 0; the
    /// ranks store their gradients in fp16 ([`RankSpec::fp16`]).
    pub scaler: Option<LossScaler>,
}

/// The start state a GPU rank loads (full length, CPU layout).
pub struct GpuStart<'a> {
    pub master: &'a [f32],
    /// (optimizer steps, the optimizer's state buffers in `OptimizerKind::state_names` order).
    pub moments: Option<(u64, Vec<&'a [f32]>)>,
    pub applied: u64,
    pub skipped: u64,
    /// The checkpoint's loss-scaler state (`bridge::scaler_to_json`), on a resume of an fp16 run.
    pub scaler: Option<&'a serde_json::Value>,
}

/// One GPU rank's state, shared by its compute thread and the driver's reads between steps.
pub struct GpuRankState {
    pub rank: Rank,
    /// Optimizer steps applied (the LR schedule's clock) and skipped (fp16 overflows).
    pub applied: u64,
    pub skipped: u64,
    /// fp16's loss scaler: every rank holds one and feeds it the same overflow flags (the
    /// global norm is the same on every rank), so the scales agree.
    pub scaler: Option<LossScaler>,
    /// The prepared step overflowed (fp16).
    overflow: bool,
}

impl GpuRankState {
    /// Makes this rank's GPU context current on the calling thread.
    fn bind(&self) -> Result<()> {
        let gpu = &self.rank.gpu;
        gpu.ctx.bind_to_thread().map_err(cuda::drv(format!("making GPU {}'s context current", gpu.ordinal)))?;
        Ok(())
    }
}

fn lock(st: &Mutex<GpuRankState>) -> MutexGuard<'_, GpuRankState> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

/// Builds the `world` GPU ranks of this host (rank `r` on GPU `r`), their communicator formed
/// together, each loaded with `start`.
pub fn start_ranks(plan: &Plan, start: &GpuStart<'_>, opts: &GpuRankOptions) -> Result<GpuRanks> {
    let world = plan.world;
    let count = cuda::device_count()?;
    if world > count {
        bail!(
            "tessera.world = {world} asks for {world} GPUs (one rank per GPU); this machine has {count}: pass --nprocs N (or \
             --world N) with N ≤ {count}; the batch rule then sets the gradient accumulation"
        );
    }
    let id = if world > 1 { Some(NcclId::new()?) } else { None };
    // The communicator forms only once every rank has joined: each rank is built on a thread.
    let built: Vec<Result<GpuRankState>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world).map(|r| s.spawn(move || build_rank(plan, start, opts, r, id.as_ref()))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("building a GPU rank panicked")))).collect()
    });
    let states: Vec<_> = built.into_iter().map(|b| b.map(|st| Arc::new(Mutex::new(st)))).collect::<Result<_>>()?;
    let gpu = states.first().map_or_else(String::new, |s| lock(s).rank.gpu.name.clone());
    Ok(GpuRanks { note: describe(world, &gpu, opts), moment_names: plan.optimizer.state_names(), states })
}

fn build_rank(plan: &Plan, start: &GpuStart<'_>, opts: &GpuRankOptions, r: usize, id: Option<&NcclId>) -> Result<GpuRankState> {
    let gpu = Gpu::open(r)?;
    gpu.compile_all()?;
    let comm = id.map(|id| NcclComm::new(gpu.clone(), r, plan.world, id)).transpose()?;
    let spec = RankSpec {
        model: &plan.model,
        stage: plan.stage,
        shape: gpt::Shape::new(&plan.model.cfg, plan.micro, plan.seq_len)?,
        init: start.master,
        optim: opts.optim,
        m_local: plan.micro_batches / plan.world,
        offload: opts.offload,
        recompute: opts.recompute,
        fp16: opts.scaler.is_some(),
        nvme: opts.nvme.as_ref(),
        params_offload: opts.params_offload.as_ref(),
    };
    let mut rank = Rank::new(gpu, comm, spec).with_context(|| format!("building GPU rank {r}"))?;
    rank.overlap = opts.overlap;
    rank.early_adam &= !opts.abandons;
    if rank.state_bytes() != opts.states {
        bail!("GPU rank {r}: the model states allocated ({:?}) differ from those planned at start ({:?})", rank.state_bytes(), opts.states);
    }
    if let Some(max) = opts.budget {
        check_device_total(r, &rank, max, opts.recompute)?;
    }
    if let Some((steps, bufs)) = &start.moments {
        rank.load_optimizer_state(bufs, *steps).context("restoring the optimizer state from the checkpoint")?;
    }
    rank.sync()?;
    let mut scaler = opts.scaler.clone();
    if let (Some(sc), Some(v)) = (scaler.as_mut(), start.scaler) {
        crate::bridge::scaler_from_json(sc, v).context("restoring the loss scaler from the checkpoint")?;
    }
    Ok(GpuRankState { rank, applied: start.applied, skipped: start.skipped, scaler, overflow: false })
}

/// Everything rank `r` holds on its device — model states, activations and scratch (the
/// workspace of one micro-batch, cuBLASLt's scratch, norm and loss buffers) — against the budget
/// `max`: over it, the run stops before its first step naming each part and what would shrink it.
fn check_device_total(r: usize, rank: &Rank, max: u64, recompute: bool) -> Result<()> {
    let total = rank.device_bytes() as u64;
    if total <= max {
        return Ok(());
    }
    let states = rank.state_bytes().device;
    let (st, act) = (states.total(), total.saturating_sub(states.total()));
    let params = param_offload_hint(rank);
    let ac = if recompute {
        "activation checkpointing is on already"
    } else {
        "activation checkpointing (`activation_checkpointing` or `tessera.activation_checkpointing`) keeps only each block's input"
    };
    bail!(
        "GPU rank {r} holds {total} bytes on its device but tessera.device_memory_bytes_max = {max} ({} bytes over): model \
         states {st} (params {}, grads {}, fp32 masters and optimizer state {}), activations and scratch {act} for one \
         micro-batch; a smaller train_micro_batch_size_per_gpu or tessera.seq_len shrinks the activations, {ac}, \
         zero_optimization.offload_optimizer moves the {} bytes of optimizer state to host memory{params}",
        total - max,
        states.params,
        states.grads,
        states.optim,
        states.optim
    )
}

/// The device-total hint's words on parameter offload: at stage 3 with the shard on the device.
fn param_offload_hint(rank: &Rank) -> String {
    let b = rank.state_bytes();
    match (rank.stage, b.host_params + b.nvme_params) {
        (3, 0) => ", zero_optimization.offload_param.device = \"cpu\" moves the bf16 parameter shard to host memory".into(),
        _ => String::new(),
    }
}

/// Rank `rank`'s compute: its block of each step's micro-batches through its [`Rank`].
pub struct GpuWorker {
    rank: usize,
    plan: Arc<Plan>,
    sampler: Arc<Sampler>,
    state: Arc<Mutex<GpuRankState>>,
    /// The step prepared and not yet committed or abandoned.
    staged: Option<u64>,
}

impl GpuWorker {
    pub fn new(rank: usize, plan: Arc<Plan>, sampler: Arc<Sampler>, state: Arc<Mutex<GpuRankState>>) -> Self {
        GpuWorker { rank, plan, sampler, state, staged: None }
    }

    /// This rank's micro-batches of `step`: the aligned block `rank·m … rank·m + m − 1` of the
    /// step's `M = world·m` (what makes 1 and N GPUs give the same bits).
    fn micro_batches(&self, step: u64) -> Vec<data::TokenBatch> {
        let plan = &self.plan;
        let (m_local, n) = (plan.micro_batches / plan.world, plan.micro * plan.seq_len);
        (0..m_local)
            .map(|j| {
                let (mut x, mut y) = (vec![0u32; n], vec![0u32; n]);
                self.sampler.fill(plan.first_sample(step, self.rank * m_local + j), plan.micro, &mut x, &mut y);
                (x, y)
            })
            .collect()
    }
}

fn failed(rank: usize, e: anyhow::Error) -> ComputeError {
    ComputeError::failed(format!("GPU rank {rank}: {e:#}"))
}

impl WorkerCompute for GpuWorker {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError> {
        let t0 = Instant::now();
        let mbs = self.micro_batches(order.step);
        let state = Arc::clone(&self.state);
        let mut st = lock(&state);
        st.bind().map_err(|e| failed(self.rank, e))?;
        let plan = &self.plan;
        let lr = plan.lr_at(st.applied);
        self.staged = None;
        let scale = st.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let p = st.rank.prepare(&mbs, lr, 1.0 / plan.micro_batches as f32, scale).map_err(|e| failed(self.rank, e))?;
        st.overflow = p.overflow;
        self.staged = Some(order.step);
        let compute_s = t0.elapsed().as_secs_f64();
        Ok(Prepared {
            loss_sum: f64::from(p.loss) * mbs.len() as f64,
            micro_batches: mbs.len(),
            grad_norm: p.norm,
            overflow: p.overflow,
            compute_s,
            busy_s: compute_s,
            busy_micro_batches: mbs.len(),
            ..Prepared::default()
        })
    }

    fn commit(&mut self, step: u64) -> Result<(), ComputeError> {
        match self.staged.take() {
            Some(s) if s == step => {}
            staged => return Err(ComputeError::failed(format!("GPU rank {}: commit of step {step} but staged {staged:?}", self.rank))),
        }
        let mut st = lock(&self.state);
        st.bind().map_err(|e| failed(self.rank, e))?;
        // The loss scaler's decision (DeepSpeed's, the CPU ranks' `LossScaler`): an overflow
        // skips the update; the scaler changes only once the step is decided.
        let overflow = st.overflow;
        let mut scaler = st.scaler.clone();
        let outcome = match scaler.as_mut() {
            Some(sc) => sc.update(overflow).map_err(|e| failed(self.rank, e.into()))?,
            None => StepOutcome::Applied,
        };
        if let StepOutcome::SkippedOverflow { .. } = outcome {
            st.rank.skip().map_err(|e| failed(self.rank, e).torn(None))?;
            (st.scaler, st.skipped) = (scaler, st.skipped + 1);
            return Ok(());
        }
        // A failed update leaves the optimizer state part-way (the rank refuses later steps).
        st.rank.commit().map_err(|e| failed(self.rank, e).torn(None))?;
        (st.scaler, st.applied) = (scaler, st.applied + 1);
        Ok(())
    }

    fn abandon(&mut self, _step: u64) {
        self.staged = None;
        lock(&self.state).rank.abandon();
    }

    fn memory(&self) -> MemoryReport {
        report(self.rank, &lock(&self.state).rank)
    }
}

/// The driver's view of the GPU ranks between steps.
pub struct GpuRanks {
    pub states: Vec<Arc<Mutex<GpuRankState>>>,
    /// The optimizer's state buffers as checkpoints name them (`OptimizerKind::state_names`).
    moment_names: &'static [&'static str],
    /// What the run's header line says of them (`| 2 × NVIDIA H200 | bf16 …`).
    pub note: String,
}

/// Full-length masters (CPU layout), the optimizer's buffers when asked, rank 0's counters
/// (optimizer steps, applied, skipped) and its loss scaler's state (fp16).
pub type Assembled = (Vec<f32>, Vec<(String, Vec<f32>)>, (u64, u64, u64), Option<serde_json::Value>);

impl GpuRanks {
    /// Runs `f` on every rank at once (the NCCL gathers need every rank), each on its own
    /// thread with its GPU current; returns rank 0's result.
    fn on_every_rank<T: Send>(&self, f: impl Fn(&mut GpuRankState) -> Result<T> + Sync) -> Result<T> {
        let mut results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .states
                .iter()
                .map(|st| {
                    let f = &f;
                    s.spawn(move || {
                        let mut g = lock(st);
                        g.bind()?;
                        f(&mut g)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a GPU rank's read panicked")))).collect()
        });
        for (r, res) in results.iter().enumerate().skip(1) {
            if let Err(e) = res {
                bail!("GPU rank {r}: {e:#}");
            }
        }
        results.swap_remove(0)
    }

    /// The masters and, with `with_optim`, the optimizer's state buffers, gathered from every rank.
    pub fn assemble(&self, with_optim: bool) -> Result<Assembled> {
        let names = self.moment_names;
        self.on_every_rank(|st| {
            let master = st.rank.masters().context("gathering the masters")?;
            let optim = match with_optim {
                true => {
                    let bufs = st.rank.optimizer_state().context("gathering the optimizer state")?;
                    names.iter().map(|n| n.to_string()).zip(bufs).collect()
                }
                false => Vec::new(),
            };
            let scaler = st.scaler.as_ref().map(crate::bridge::scaler_to_json);
            Ok((master, optim, (st.rank.optimizer_steps(), st.applied, st.skipped), scaler))
        })
    }

    /// Mean loss of the validation batches on the ranks' bf16 working parameters (at stage 3
    /// with several ranks every rank takes part: the parameters are gathered unit by unit).
    pub fn evaluate(&self, batches: &data::ValBatches) -> Result<f64> {
        self.on_every_rank(|st| {
            let mut total = 0f64;
            for (x, y) in batches.iter() {
                total += f64::from(st.rank.forward_loss(&x, &y).context("evaluating on the validation batches")?);
            }
            Ok(total / batches.len().max(1) as f64)
        })
    }

    /// Every rank's model states on its device, in rank order.
    pub fn memory(&self) -> Vec<MemoryReport> {
        self.states.iter().enumerate().map(|(r, st)| report(r, &lock(st).rank)).collect()
    }

    /// Rank 0's applied-step count and loss scale (fp16; alike on every rank).
    pub fn applied_and_scale(&self) -> (u64, Option<f32>) {
        self.states.first().map_or((0, None), |st| {
            let st = lock(st);
            (st.applied, st.scaler.as_ref().map(LossScaler::scale))
        })
    }

    /// Each rank's model-state bytes in host memory (optimizer offload, and the parameter
    /// shard of parameter offload).
    pub fn host_optim_bytes(&self) -> Vec<u64> {
        self.states
            .iter()
            .map(|st| {
                let b = lock(st).rank.state_bytes();
                b.host_optim + b.host_params
            })
            .collect()
    }

    /// The summary's device figures: the GPU, each rank's device memory, rank 0's offload.
    pub fn figures(&self) -> GpuFigures {
        let device_bytes_per_rank = self.states.iter().map(|st| lock(st).rank.device_bytes() as u64).collect();
        let st = self.states.first().map(|s| lock(s));
        let gpu = st.as_ref().map_or_else(String::new, |s| s.rank.gpu.name.clone());
        let offload = st.and_then(|s| {
            let pinned = s.rank.state_bytes().host_staging;
            Some(host_optimizer_figures(s.rank.offload_ratio()?, pinned, &s.rank.offload_stats()?))
        });
        GpuFigures { gpu, device_bytes_per_rank, offload }
    }
}

/// Rank `r`'s model states on its device.
fn report(r: usize, rank: &Rank) -> MemoryReport {
    let d = rank.state_bytes().device;
    MemoryReport { rank: r, param_bytes: d.params, grad_bytes: d.grads, optim_bytes: d.optim }
}

/// The header line's words for GPU ranks built with `opts`: the GPUs, bf16, and the offload.
pub fn describe(world: usize, gpu: &str, opts: &GpuRankOptions) -> String {
    let to = if opts.nvme.is_some() { "NVMe swap files" } else { "host memory" };
    let off = opts.offload.map_or(String::new(), |o| {
        format!(
            " | optimizer offloaded to {to} (ratio {}, {} CPU threads per rank; {:.1} MiB of model states on the GPU)",
            o.ratio,
            o.threads,
            opts.states.device.total() as f64 / (1u64 << 20) as f64
        )
    });
    let fp16 = if opts.scaler.is_some() { " (fp16 gradients, loss scaling)" } else { "" };
    let params = opts.params_offload.as_ref().map_or(String::new(), |p| {
        let to = if p.nvme.is_some() { "an NVMe swap file" } else { "page-locked host memory" };
        format!(
            " | bf16 parameter shard offloaded to {to} ({:.1} MiB of host memory)",
            opts.states.host_params as f64 / (1u64 << 20) as f64
        )
    });
    format!(" | {world} × {gpu} (NCCL) | bf16{fp16} | {}{off}{params}", opts.optim.kind.name())
}

/// `offload`'s figures for the summary.
fn host_optimizer_figures(ratio: f64, pinned_bytes: u64, st: &OffloadStats) -> HostOptimizerFigures {
    let per = |s: f64| s * 1e3 / st.steps.max(1) as f64;
    HostOptimizerFigures {
        ratio,
        cpu_threads: st.threads,
        pinned_bytes,
        cpu_step_ms: per(st.cpu_step_s),
        exposed_ms: per(st.exposed_s),
        hidden_fraction: st.hidden_fraction(),
    }
}
