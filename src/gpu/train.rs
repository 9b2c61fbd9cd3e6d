//! `tessera train --device cuda`: the training loop of the CPU path ([`crate::engine`]) on
//! NVIDIA GPUs, one process per GPU ([`super::zero::Rank`], NCCL between them), with the same
//! config semantics.
//!
//! What is shared with the CPU path, so a GPU run and a CPU run of one config see the same
//! numbers wherever the hardware allows:
//! - the model preset with the data's vocabulary, `tessera.seq_len`, the batch triple
//!   (`train_batch_size` / `train_micro_batch_size_per_gpu` → `M` micro-batches per step, rank
//!   `r` of `N` takes the aligned block `r·M/N .. (r+1)·M/N`), via [`Plan`];
//! - the data sampler: global micro-batch `i` of step `s` holds the same tokens as on the CPU;
//! - the LR schedule ([`crate::schedule::lr_at`] on the applied-step clock) and OneCycle's
//!   momentum cycle (the AdamW betas of each step, [`super::zero::AdamW::betas_at`]), `gradient_clipping`,
//!   `zero_optimization.stage`, `tessera.steps`, evaluation on the same validation batches
//!   (`tessera.eval_interval`, `eval_iters`), the monitors, `loss.svg`, `summary.json` (the
//!   keys that apply, plus the device figures) and checkpoints in the CPU format: fp32 masters
//!   as the parameters and the Adam moments as `optim.exp_avg` / `optim.exp_avg_sq` in the CPU
//!   layout, so `generate`, `export` and `--resume` work across devices both ways.
//!
//! What differs: parameters and activations are bf16 (fp32 masters and moments), whatever the
//! precision section says (fp16 is refused); ZeRO's bucket and stage-3 tuning keys have no
//! effect (the GPU reduces and gathers unit by unit). Activation checkpointing (the
//! `activation_checkpointing` section or `tessera.activation_checkpointing`) keeps each block's
//! input only and recomputes its activations in the backward, with the same bits.
//!
//! Processes: with `N > 1` GPUs this process (the parent) validates the run, creates the NCCL
//! id and starts itself once per GPU with the rank in the environment (as `gpu bench` does);
//! rank 0 writes every output. The ranks run in their own process groups; the parent forwards
//! its first stop request (SIGTERM, SIGINT, SIGHUP, SIGUSR1: `crate::signals`) to them as
//! SIGTERM, and a rank that gets one directly (Slurm signals every process of a step) stops the
//! same way. The ranks agree to stop after the same step (the flag travels with the per-step
//! loss gather), save a checkpoint and the summary, and the parent reports the interruption. A
//! second signal to the parent kills the ranks and exits at once; a rank leaves that to its
//! parent (`signals::Mode::FollowParent`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use tessera_kernels::cuda::{self, gpt, Gpu};
use tessera_kernels::model::Arch;
use tessera_kernels::optim::MomentumCycle;
use tessera_transport::nccl::{NcclComm, NcclId};

use super::offload::{self, OffloadStats};
use super::zero::{self, AdamW, OffloadOptions, Rank, RankSpec, StateBytes};
use super::{wait_all, ENV_NCCL_ID, ENV_RANK, ENV_WORLD};
use crate::checkpoint::{self, CheckpointState};
use crate::cli::{self, CommonArgs};
use crate::config::{Config, OffloadDevice, OptimizerConfig, Precision};
use crate::data::{self, Dataset, Sampler, SamplerState, TokenBatch};
use crate::engine::{self, peak_rss_bytes, GpuFigures, HostOptimizerFigures, MemoryBytes, Plan, RunRecord, RunStatus, Summary};
use crate::monitor::{self, Event, Monitor, MonitorSet};
use crate::offload::OffloadedBytes;
use crate::outln;
use crate::signals::{self, Cleanup};
use crate::{bridge, zoo};

const OPTIM_PREFIX: &str = "optim";
/// Adam's checkpointed buffers, as the CPU optimizer names them.
const ADAM_BUFFERS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// What `tessera train --device cuda` was asked to do beyond the config.
#[derive(Clone, Debug, Default)]
pub struct GpuTrainOptions {
    /// A checkpoint directory (a step directory or the checkpoint root) to continue from.
    pub resume: Option<PathBuf>,
    /// Show the progress bar.
    pub progress: bool,
}

/// `tessera train --device cuda`: the GPU count is the config's world size (`--nprocs N`,
/// `--world N` or `tessera.world`). Returns whether the run finished (false when Ctrl-C
/// stopped it).
pub fn train(config_path: &Path, common: &CommonArgs, opts: &GpuTrainOptions) -> Result<bool> {
    let cfg = cli::load_config(config_path, common)?;
    let child = rank_from_env()?;
    let notes = check_supported(&cfg)?;
    let world = cfg.world_size;
    if let Some((rank, env_world, id)) = child {
        if env_world != world {
            bail!("GPU rank {rank} was started for {env_world} ranks ({ENV_WORLD}), but its config resolves to tessera.world = {world}");
        }
        // A rank never reports the interruption itself: the parent does (exit status 130).
        run_rank(&cfg, opts, rank, world, Some(id), None)?;
        return Ok(true);
    }
    for w in cfg.warnings.iter().chain(&notes) {
        tracing::warn!("{w}");
    }
    // Validate everything a rank would (data, batch geometry, the device budget, resume, output
    // directory) once, here, so a mistake is reported once and before any GPU is touched.
    let prepared = prepare(&cfg, opts, true)?;
    let count = cuda::device_count()?;
    if count == 0 {
        bail!("the CUDA driver reports no GPU on this machine: `--device cuda` needs an NVIDIA GPU; use `--device cpu` here");
    }
    if world > count {
        bail!(
            "tessera.world = {world} asks for {world} GPUs (one rank per GPU); this machine has {count}: \
             pass --nprocs N (or --world N) with N ≤ {count}; the batch rule then sets the gradient accumulation"
        );
    }
    if world == 1 {
        return Ok(!run_rank(&cfg, opts, 0, 1, None, Some(prepared))?);
    }
    drop(prepared);
    let id = NcclId::new()?;
    let exe = std::env::current_exe().context("locating the tessera executable")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::with_capacity(world);
    // The ranks run in their own process groups, so a terminal's Ctrl-C reaches this process
    // only; it forwards its first stop request to them (SIGTERM) and kills them on a second.
    let mut guards = Vec::with_capacity(2 * world);
    for r in 0..world {
        let spawned = Command::new(&exe)
            .args(&args)
            .env(ENV_RANK, r.to_string())
            .env(ENV_WORLD, world.to_string())
            .env(ENV_NCCL_ID, id.to_hex())
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting GPU rank {r}"));
        match spawned {
            Ok(c) => {
                guards.push(signals::on_forced_exit(Cleanup::Kill(c.id())));
                guards.push(signals::forward_stop(c.id()));
                children.push(c);
            }
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    wait_all(children, Duration::MAX)?;
    Ok(signals::requested().is_none())
}

/// `(rank, world, NCCL id)` when this process is a rank started by a parent.
fn rank_from_env() -> Result<Option<(usize, usize, NcclId)>> {
    let Ok(rank) = std::env::var(ENV_RANK) else { return Ok(None) };
    let rank: usize = rank.parse().with_context(|| format!("{ENV_RANK}={rank}: expected a rank number"))?;
    let world = std::env::var(ENV_WORLD).with_context(|| format!("{ENV_RANK} is set but {ENV_WORLD} is not"))?;
    let world: usize = world.parse().with_context(|| format!("{ENV_WORLD}={world}: expected a rank count"))?;
    let id = NcclId::from_hex(&std::env::var(ENV_NCCL_ID).with_context(|| format!("{ENV_RANK} is set but {ENV_NCCL_ID} is not"))?)?;
    Ok(Some((rank, world, id)))
}

fn offload_name(d: OffloadDevice) -> &'static str {
    match d {
        OffloadDevice::None => "none",
        OffloadDevice::Cpu => "cpu",
        OffloadDevice::Nvme => "nvme",
    }
}

/// Refuses what the GPU path does not implement (naming the key and its value); returns notes
/// on keys it treats differently from the CPU path.
pub fn check_supported(cfg: &Config) -> Result<Vec<String>> {
    check_model(&cfg.tessera.model)?;
    let mut notes = Vec::new();
    match cfg.precision {
        Precision::Fp16(_) => bail!(
            "fp16.enabled = true: `--device cuda` trains in bf16 (bf16 parameters and activations, fp32 masters, no loss \
             scaling); set bf16.enabled=true instead, or use --device cpu"
        ),
        Precision::F32 => notes.push(
            "no bf16/fp16 section (fp32 on the CPU path): `--device cuda` trains with bf16 parameters and activations and \
             fp32 masters, as bf16.enabled=true does"
                .to_string(),
        ),
        Precision::Bf16 => {}
    }
    match cfg.optimizer {
        OptimizerConfig::Adam { adam_w_mode: false, .. } => bail!(
            "optimizer.params.adam_w_mode = false (Adam with an L2 penalty): the GPU optimizer is AdamW (decoupled weight \
             decay); use optimizer.type = \"AdamW\" or --device cpu"
        ),
        OptimizerConfig::Adam { bias_correction: false, .. } => bail!(
            "optimizer.params.bias_correction = false: the GPU optimizer always applies Adam's bias correction; drop the key \
             or use --device cpu"
        ),
        OptimizerConfig::Adam { .. } => {}
        ref other => {
            let t = match other {
                OptimizerConfig::Lamb { .. } => "Lamb",
                OptimizerConfig::Lion { .. } => "Lion",
                _ => "SGD",
            };
            bail!("optimizer.type = \"{t}\": `--device cuda` implements Adam/AdamW only; use --device cpu for {t}");
        }
    }
    check_offload(cfg)?;
    // Honoured on the CPU path, without effect here: say so rather than ignore them silently.
    for key in cfg.present_keys.iter().filter(|k| GPU_IGNORED_KEYS.contains(&k.as_str())) {
        notes.push(format!("`{key}` has no effect with `--device cuda`: the GPU reduces and gathers the parameters unit by unit"));
        // (`"auto"` resolves to a value too: Hugging Face configs set these keys that way.)
    }
    let elastic = crate::config::elastic_run(cfg)?;
    if elastic.enabled {
        bail!(
            "tessera.elastic is on, and the NCCL GPU trainer (tessera.gpu.collective = \"nccl\", the default) is not elastic: \
             set tessera.gpu.collective = \"quic\" for elastic GPU ranks (docs/GPU.md), or turn tessera.elastic off"
        );
    }
    if cfg.present_keys.iter().any(|k| k.starts_with("tessera.elastic.")) {
        notes.push("`tessera.elastic` settings have no effect with the NCCL GPU trainer (elastic is off)".into());
    }
    Ok(notes)
}

/// Refuses a model the GPU trainer cannot run: a model folder, a LLaMA-style preset, or heads
/// other than 64 wide (the attention kernel's).
fn check_model(name: &str) -> Result<()> {
    if crate::hf::is_folder(name) {
        bail!("tessera.model = \"{name}\" is a model folder; the NCCL GPU trainer runs the presets only: use --device cpu");
    }
    let m = zoo::preset(name).map_err(anyhow::Error::msg)?;
    if m.arch != Arch::Gpt {
        bail!("tessera.model = \"{name}\" is a LLaMA-style model; `--device cuda` runs GPT-2-style models only: use --device cpu");
    }
    if m.n_head == 0 || m.d_model % m.n_head != 0 || m.d_model / m.n_head != 64 {
        bail!(
            "tessera.model = \"{name}\" has head dimension {} (d_model {} / n_head {}); the GPU attention kernel needs 64: \
             pick a preset with 64-wide heads (gpt-mini-gpu, gpt-10m, gpt2-small; see `tessera models`) or use --device cpu",
            m.d_model.checked_div(m.n_head).unwrap_or(0),
            m.d_model,
            m.n_head
        );
    }
    Ok(())
}

/// Refuses an offload the GPU trainer cannot do: the optimizer to NVMe, at ZeRO stage 0, by a
/// share outside 0..=1, or the parameters at all.
fn check_offload(cfg: &Config) -> Result<()> {
    if let Some(o) = cfg.zero.offload_optimizer.as_ref().filter(|o| o.device != OffloadDevice::None) {
        if o.device == OffloadDevice::Nvme {
            bail!(
                "zero_optimization.offload_optimizer.device = \"nvme\": `--device cuda` offloads the optimizer to host memory \
                 only; use \"cpu\" (host memory), or --device cpu for NVMe swap files"
            );
        }
        if cfg.zero.stage == 0 {
            bail!(
                "zero_optimization.offload_optimizer.device = \"{}\" needs ZeRO stage 1, 2 or 3 (the optimizer shard moves to the \
                 host); this run has zero_optimization.stage = 0: set a stage, or use --device cpu",
                offload_name(o.device)
            );
        }
        if !(0.0..=1.0).contains(&o.ratio) {
            bail!(
                "zero_optimization.offload_optimizer.ratio = {}: expected the share of the optimizer to offload, from 0 to 1 \
                 (or use --device cpu)",
                o.ratio
            );
        }
    }
    if let Some(o) = cfg.zero.offload_param.as_ref().filter(|o| o.device != OffloadDevice::None) {
        bail!(
            "zero_optimization.offload_param.device = \"{}\": `--device cuda` keeps parameters on the GPU (no offload); drop \
             the section or use --device cpu",
            offload_name(o.device)
        );
    }
    Ok(())
}

/// ZeRO tuning keys the CPU engine honours and the GPU path does not read.
const GPU_IGNORED_KEYS: &[&str] = &[
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_prefetch_bucket_size",
];

/// Where training starts, as full-length buffers in the CPU layout.
struct Start {
    step: u64,
    master: Vec<f32>,
    /// (optimizer steps, exp_avg, exp_avg_sq) from a checkpoint.
    moments: Option<(u64, Vec<f32>, Vec<f32>)>,
    applied: u64,
    skipped: u64,
}

/// Data, plan and start state, validated.
struct Prepared {
    dataset: Dataset,
    /// The data's record (`Dataset::record`), computed once: checked on resume, written into
    /// every checkpoint.
    data: serde_json::Value,
    plan: Plan,
    start: Start,
    /// Optimizer offload to host memory, if asked.
    offload: Option<OffloadOptions>,
    /// The model states each rank holds (the budget was checked against them).
    states: StateBytes,
}

/// `offload_optimizer.device = "cpu"`: the share offloaded and the host threads per rank.
fn offload_options(cfg: &Config) -> Option<OffloadOptions> {
    let o = cfg.zero.offload_optimizer.as_ref().filter(|o| o.device == OffloadDevice::Cpu)?;
    Some(OffloadOptions { ratio: f64::from(o.ratio), threads: offload::default_threads(cfg.world_size) })
}

/// `tessera.device_memory_bytes_max` against what a GPU rank holds (the same check and message
/// as the CPU path's, with the GPU's counts: bf16 parameters and stage 3's gather buffers, f32
/// gradient buffers of the micro-batch tree and the reduced shard, fp32 masters, moments and
/// decay mask of the pieces not offloaded).
fn check_gpu_budget(cfg: &Config, states: &StateBytes, offload: Option<OffloadOptions>, full_optim: u64) -> Result<()> {
    let Some(max) = cfg.tessera.device_memory_bytes_max else { return Ok(()) };
    let hint = match offload {
        None => format!(
            "zero_optimization.offload_optimizer.device = \"cpu\" moves the {full_optim} bytes of fp32 masters and moments to host \
             memory; a higher ZeRO stage or more GPUs also shrink each rank's share"
        ),
        Some(o) if o.ratio < 1.0 => format!(
            "offload_optimizer.ratio = {} keeps {} bytes of optimizer state on the GPU: a higher ratio (up to 1) moves more to the host",
            o.ratio, states.device.optim
        ),
        Some(_) => "the optimizer is already offloaded: use a higher ZeRO stage, more GPUs or fewer micro-batches per GPU (each level \
                    of the micro-batch tree holds a full gradient buffer)"
            .to_string(),
    };
    crate::offload::check_resident("each GPU rank", states.device, max, &hint)
}

fn prepare(cfg: &Config, opts: &GpuTrainOptions, lead: bool) -> Result<Prepared> {
    let dataset = crate::engine::load_dataset(cfg)?;
    // The budget and the offload share are checked below with the GPU's own counts; the CPU
    // plan's checks of them (CPU layout and dtypes) do not apply here.
    let mut cpu_cfg = cfg.clone();
    cpu_cfg.tessera.device_memory_bytes_max = None;
    if let Some(o) = cpu_cfg.zero.offload_optimizer.as_mut() {
        o.ratio = 1.0;
    }
    // The ZeRO tuning keys the GPU does not read (GPU_IGNORED_KEYS) must not refuse its run
    // through the CPU plan either: DeepSpeed's defaults there.
    let (z, d) = (&mut cpu_cfg.zero, crate::config::ZeroConfig::deepspeed_defaults());
    (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) = (d.reduce_bucket_size, d.stage3_prefetch_bucket_size);
    (z.stage3_param_persistence_threshold, z.stage3_max_live_parameters, z.stage3_max_reuse_distance) =
        (d.stage3_param_persistence_threshold, d.stage3_max_live_parameters, d.stage3_max_reuse_distance);
    let plan = Plan::new(&cpu_cfg, &dataset)?;
    let data = dataset.record();
    let world = cfg.world_size.max(1);
    if plan.micro_batches % world != 0 {
        bail!(
            "train_batch_size {} / train_micro_batch_size_per_gpu {} = {} micro-batches per step do not split evenly over {world} \
             GPUs (each GPU takes an aligned block): make the micro-batch count a multiple of {world}",
            cfg.train_batch_size,
            plan.micro,
            plan.micro_batches
        );
    }
    gpt::Shape::new(&plan.model.cfg, plan.micro, plan.seq_len)?;
    let offload = offload_options(cfg);
    let m_local = plan.micro_batches / world;
    let states = zero::planned_state_bytes(&plan.model, plan.stage, world, m_local, offload.map(|o| o.ratio))?;
    let full_optim = zero::planned_state_bytes(&plan.model, plan.stage, world, m_local, None)?.device.optim;
    check_gpu_budget(cfg, &states, offload, full_optim)?;
    let out_dir = PathBuf::from(&cfg.tessera.output_dir);
    let start = match &opts.resume {
        Some(dir) => resume_start(cfg, &plan, dir, lead, &data)?,
        None => {
            if lead {
                engine::refuse_to_overwrite(&out_dir.join("checkpoints"))?;
            }
            Start { step: 0, master: plan.model.init_params(cfg.tessera.seed), moments: None, applied: 0, skipped: 0 }
        }
    };
    Ok(Prepared { dataset, data, plan, start, offload, states })
}

/// The checkpoint's masters, Adam moments and counters, with the CPU path's checks (model,
/// tokenizer, seed, step range, data cursor): the CPU driver's resume, then the Adam buffers.
fn resume_start(cfg: &Config, plan: &Plan, dir: &Path, lead: bool, data: &serde_json::Value) -> Result<Start> {
    let st = engine::resume_start(cfg, plan, dir, lead, data)?;
    let (steps, bufs) = st.optim.context("the checkpoint has no optimizer state")?;
    let buffer = |name: &str| -> Result<Vec<f32>> {
        let (_, data) = bufs.iter().find(|(n, _)| n == name).with_context(|| {
            let held: Vec<&str> = bufs.iter().map(|(n, _)| n.as_str()).collect();
            format!(
                "checkpoint {} has no Adam state `{OPTIM_PREFIX}.{name}` (it holds [{}]): it was trained with another optimizer; the GPU \
                 path resumes Adam/AdamW checkpoints",
                dir.display(),
                held.join(", ")
            )
        })?;
        if data.len() != plan.total() {
            bail!(
                "checkpoint {}: `{OPTIM_PREFIX}.{name}` has {} values, the model has {} parameters",
                dir.display(),
                data.len(),
                plan.total()
            );
        }
        Ok(data.clone())
    };
    let moments = (steps, buffer(ADAM_BUFFERS[0])?, buffer(ADAM_BUFFERS[1])?);
    Ok(Start { step: st.step, master: st.master, moments: Some(moments), applied: st.applied, skipped: st.skipped })
}

/// Mean validation loss over the fixed validation batches (the CPU path's), on the bf16
/// working parameters.
fn evaluate(r: &mut Rank, batches: &data::ValBatches) -> Result<f64> {
    let mut total = 0f64;
    for (x, y) in batches.iter() {
        total += f64::from(r.forward_loss(&x, &y).context("evaluating on the validation batches")?);
    }
    Ok(total / batches.len().max(1) as f64)
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

/// Running totals for the summary and the loss curve.
#[derive(Default)]
struct Tally {
    steps_run: u64,
    train_s: f64,
    last_loss: f64,
    last_val: Option<f64>,
    initial_val: Option<f64>,
    train_curve: Vec<(u64, f64)>,
    val_curve: Vec<(u64, f64)>,
    last_ckpt: Option<PathBuf>,
    /// Steps in a row whose loss was not finite (up to the last one).
    nonfinite_steps: u64,
}

/// One rank's run; rank 0 (`lead`) writes every output.
struct RankRun<'a> {
    cfg: &'a Config,
    plan: Plan,
    r: Rank,
    lead: bool,
    rank: usize,
    world: usize,
    /// OneCycle's momentum cycle, when the scheduler has one (the betas of each update).
    momentum_cycle: Option<MomentumCycle>,
    step: u64,
    applied: u64,
    skipped: u64,
    out_dir: PathBuf,
    /// The data's record, written into every checkpoint (as the CPU path does).
    data: serde_json::Value,
}

impl RankRun<'_> {
    /// Saves a checkpoint of the current state in the CPU format (every rank takes part in
    /// the gathers; rank 0 writes). Returns the masters and, on rank 0, the checkpoint path.
    fn save_checkpoint(&mut self) -> Result<(Vec<f32>, Option<PathBuf>)> {
        let master = self.r.masters().context("gathering the masters for a checkpoint")?;
        let (m, v) = self.r.moments().context("gathering the Adam moments for a checkpoint")?;
        if !self.lead {
            return Ok((master, None));
        }
        let (cfg, plan) = (self.cfg, &self.plan);
        let (params, optim) = engine::checkpoint_tensors(plan, &master, ADAM_BUFFERS.iter().map(|n| n.to_string()).zip([m, v]));
        let state = CheckpointState {
            step: self.step,
            config_hash: cfg.hash.clone(),
            model: cfg.tessera.model.clone(),
            data_cursor: SamplerState { seed: cfg.tessera.seed, cursor: plan.first_sample(self.step, 0) }.to_json(),
            rng: serde_json::json!({ "seed": cfg.tessera.seed }),
            extra: serde_json::json!({
                "optimizer_steps": self.r.optimizer_steps(),
                "applied_steps": self.applied,
                "skipped_steps": self.skipped,
                "loss_scaler": serde_json::Value::Null,
                "world_size": self.world,
                "zero_stage": plan.stage,
                "seq_len": plan.seq_len,
                "device": "cuda",
                "tokenizer": data::tokenizer_record(cfg.tessera.tokenizer.as_deref().map(Path::new))?,
                "data": self.data,
            }),
            params,
            optim,
        };
        let root = self.out_dir.join("checkpoints");
        let path = checkpoint::save(&root, &state, cfg.tessera.keep_last as usize)
            .with_context(|| format!("saving checkpoint of step {} under {}", self.step, root.display()))?;
        Ok((master, Some(path)))
    }

    /// Evaluation gathers parameters at stage 3 with several ranks: then every rank evaluates.
    fn evaluates(&self) -> bool {
        self.lead || (self.plan.stage == 3 && self.world > 1)
    }

    /// Runs step `self.step + 1` on this rank's block of micro-batches and gathers every rank's
    /// loss and stop flag; counts it in `t`.
    fn train_step(&mut self, sampler: &Sampler, t: &mut Tally) -> Result<Stepped> {
        let (step, plan, rank) = (self.step, &self.plan, self.rank);
        let m = plan.micro_batches;
        let m_local = m / self.world;
        let n = plan.micro * plan.seq_len;
        let mbs: Vec<TokenBatch> = (0..m_local)
            .map(|j| {
                let (mut x, mut y) = (vec![0u32; n], vec![0u32; n]);
                sampler.fill(plan.first_sample(step, rank * m_local + j), plan.micro, &mut x, &mut y);
                (x, y)
            })
            .collect();
        // The rate of update number `applied + 1` (the schedule's clock counts applied steps).
        let lr = plan.schedule.as_ref().map_or(plan.base_lr, |s| crate::schedule::lr_at(s, plan.base_lr, self.applied));
        // OneCycle's momentum: that update's first beta (DeepSpeed prints it as `mom`).
        let beta1 = self.momentum_cycle.map(|c| c.beta1_at(self.applied));
        let t0 = Instant::now();
        let (local_loss, norm) = self.r.step(&mbs, lr, 1.0 / m as f32).with_context(|| format!("step {step}"))?;
        let asked = if signals::requested().is_some() { 1.0 } else { 0.0 };
        let all = self.r.gather_host(&[f64::from(local_loss), asked]).context("gathering the step's losses")?;
        let step_s = t0.elapsed().as_secs_f64();
        t.train_s += step_s;
        t.steps_run += 1;
        self.step += 1;
        self.applied += 1;
        let loss = all.chunks_exact(2).map(|c| c[0]).sum::<f64>() / self.world as f64;
        let stopping = all.chunks_exact(2).any(|c| c[1] != 0.0);
        // Every rank has the same loss, so every rank decides alike.
        t.nonfinite_steps = if loss.is_finite() { 0 } else { t.nonfinite_steps + 1 };
        t.last_loss = loss;
        t.train_curve.push((self.step, loss));
        Ok(Stepped { loss, norm, lr, beta1, stopping, t0, step_s })
    }

    /// After a step: its events (to the monitors, on rank 0), the progress bar and the printed
    /// line, the evaluation when one is due, and the stop when the loss stayed non-finite.
    fn report_step(
        &mut self,
        s: &Stepped,
        t: &mut Tally,
        val: &data::ValBatches,
        monitors: &mut MonitorSet,
        pb: &ProgressBar,
    ) -> Result<()> {
        let (cfg, lead) = (self.cfg, self.lead);
        let (loss, lr, beta1, norm) = (s.loss, s.lr, s.beta1, s.norm);
        let plan = &self.plan;
        let samples = plan.first_sample(self.step, 0);
        let mut events =
            vec![Event::new("Train/Samples/train_loss", loss, samples), Event::new("Train/Samples/lr", f64::from(lr), samples)];
        if let Some(b) = beta1 {
            events.push(Event::new("Train/Samples/beta1", f64::from(b), samples));
        }
        if let Some(n) = norm {
            events.push(Event::new("Train/Samples/grad_norm", n, samples));
        }
        events.push(Event::new("Train/Samples/tokens_per_s", plan.tokens_per_step() as f64 / s.step_s.max(1e-9), samples));
        let tps = (t.steps_run * plan.tokens_per_step()) as f64 / t.train_s.max(1e-9);
        if lead {
            pb.set_message(format!("loss {loss:.4} | {tps:.0} tok/s"));
            pb.set_position(self.step);
            if cfg.steps_per_print > 0 && self.step % cfg.steps_per_print == 0 {
                let norm = norm.unwrap_or(f64::NAN);
                let mom = beta1.map(|b| format!(" | beta1 {b:.4}")).unwrap_or_default();
                engine::log_line(
                    pb,
                    format!("step {:>6} | loss {loss:.4} | lr {lr:.3e}{mom} | grad norm {norm:.3} | {tps:.0} tok/s", self.step),
                );
                if cfg.wall_clock_breakdown {
                    engine::log_line(pb, format!("  time: step {:.1} ms", s.t0.elapsed().as_secs_f64() * 1e3));
                }
            }
        }
        let last = self.step == cfg.tessera.steps;
        let eval_due = (cfg.tessera.eval_interval > 0 && self.step % cfg.tessera.eval_interval == 0) || last;
        if eval_due && self.evaluates() {
            let v = evaluate(&mut self.r, val)?;
            t.last_val = Some(v);
            t.val_curve.push((self.step, v));
            events.push(Event::new("Train/Samples/val_loss", v, samples));
            if lead {
                engine::log_line(pb, format!("step {:>6} | val loss {v:.4}", self.step));
            }
        }
        if lead {
            monitors.write(&events).context("writing monitors")?;
        }
        let limit = cfg.tessera.nonfinite_loss_steps;
        if limit > 0 && t.nonfinite_steps >= limit {
            let _ = monitors.flush();
            bail!(
                "step {}: the loss is {loss}, and has not been finite for {} steps in a row: the run diverged and stops \
                 (tessera.nonfinite_loss_steps = {limit}); lower the learning rate",
                self.step,
                t.nonfinite_steps
            );
        }
        Ok(())
    }

    /// After a step: a checkpoint when one is due (every `checkpoint_interval` steps, after the
    /// last step, and when stopping; never of a step whose loss is not finite), its masters kept
    /// in `saved` for the summary. Returns whether the run stops here (a stop was asked before
    /// the last step).
    fn checkpoint_or_stop(&mut self, s: &Stepped, t: &mut Tally, saved: &mut Option<(u64, Vec<f32>)>, pb: &ProgressBar) -> Result<bool> {
        let (cfg, lead) = (self.cfg, self.lead);
        let (loss, last) = (s.loss, self.step == cfg.tessera.steps);
        let interval = cfg.tessera.checkpoint_interval > 0 && self.step % cfg.tessera.checkpoint_interval == 0;
        if (interval || last || s.stopping) && !loss.is_finite() {
            if lead {
                engine::log_line(pb, format!("warning: checkpoint of step {} not written: its loss is {loss}", self.step));
            }
        } else if interval || last || s.stopping {
            let (master, path) = self.save_checkpoint()?;
            *saved = Some((self.step, master));
            if path.is_some() {
                t.last_ckpt = path;
            }
        }
        if s.stopping && !last {
            if let (true, Some(p)) = (lead, &t.last_ckpt) {
                let why = signals::requested().map_or_else(|| "another rank asked".to_string(), |r| r.to_string());
                engine::log_line(pb, format!("interrupted ({why}): stopped after step {}; saved {}", self.step, p.display()));
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Every rank's device memory, model states, offloaded bytes and peak RSS (each rank takes
    /// part in the gathers), and this rank's host optimizer figures.
    fn gather_figures(&mut self) -> Result<RankFigures> {
        let device_bytes = self.r.device_bytes_per_rank().context("gathering the device memory figures")?;
        let sb = self.r.state_bytes();
        let d = sb.device;
        let figures = self
            .r
            .gather_host(&[d.params as f64, d.grads as f64, d.optim as f64, sb.host_optim as f64, peak_rss_bytes() as f64])
            .context("gathering the model-state figures")?;
        let model_states: Vec<MemoryBytes> = figures
            .chunks_exact(5)
            .enumerate()
            .map(|(r, c)| {
                let (params, grads, optimizer_states) = (c[0] as u64, c[1] as u64, c[2] as u64);
                MemoryBytes { rank: r, params, grads, optimizer_states, total: params + grads + optimizer_states }
            })
            .collect();
        let offloaded: Vec<OffloadedBytes> =
            figures.chunks_exact(5).enumerate().map(|(r, c)| OffloadedBytes { rank: r, host: c[3] as u64, nvme: 0 }).collect();
        let offload = match (self.r.offload_ratio(), self.r.offload_stats()) {
            (Some(ratio), Some(st)) => Some(host_optimizer_figures(ratio, sb.host_staging, &st)),
            _ => None,
        };
        Ok(RankFigures {
            device_bytes: device_bytes.iter().map(|&b| b as u64).collect(),
            model_states,
            offloaded,
            peak_rss_bytes: figures.chunks_exact(5).map(|c| c[4] as u64).collect(),
            offload,
        })
    }

    /// The run's `summary.json` (rank 0): `master` the final parameters, `started` when the
    /// rank started.
    fn summary(
        &self,
        t: &Tally,
        master: &[f32],
        interrupted: bool,
        figures: RankFigures,
        gpu_name: &str,
        (started, started_at): (Instant, SystemTime),
    ) -> Summary {
        let (cfg, plan) = (self.cfg, &self.plan);
        let names: Vec<(&str, &[f32])> = plan.model.layout().specs().iter().map(|s| (s.name.as_str(), &master[s.range()])).collect();
        let tokens = t.steps_run * plan.tokens_per_step();
        let status = if interrupted { RunStatus::Interrupted } else { RunStatus::Completed };
        let stopped_by = interrupted.then(|| signals::requested().map_or_else(|| "another rank asked".to_string(), |r| r.to_string()));
        Summary {
            run: RunRecord { stopped_by, ..RunRecord::new(status, cfg.tessera.seed, started_at) },
            model: cfg.tessera.model.clone(),
            num_params: plan.total(),
            steps: self.step,
            skipped_steps: self.skipped,
            abandoned_attempts: 0,
            final_loss: t.last_loss,
            val_loss: t.last_val,
            initial_val_loss: t.initial_val,
            tokens,
            tokens_per_s: tokens as f64 / t.train_s.max(1e-9),
            wall_s: started.elapsed().as_secs_f64(),
            flops_per_token: plan.model.cfg.flops_per_token(plan.total(), plan.seq_len),
            params_blake3: checkpoint::params_blake3(&names),
            peak_rss_bytes: peak_rss_bytes(),
            peak_rss_bytes_per_rank: Some(figures.peak_rss_bytes),
            world_size: self.world,
            device: "cuda".into(),
            zero_stage: plan.stage,
            precision: "bf16".into(),
            config_hash: cfg.hash.clone(),
            bytes_sent_per_rank_per_step: None,
            model_state_bytes_per_rank: figures.model_states,
            offloaded_bytes_per_rank: figures.offloaded,
            last_checkpoint: t.last_ckpt.as_ref().map(|p| p.display().to_string()),
            elastic: None,
            gpu: Some(GpuFigures { gpu: gpu_name.to_string(), device_bytes_per_rank: figures.device_bytes, offload: figures.offload }),
        }
    }
}

/// Runs rank `rank` of `world` (with what the parent already prepared, when it is this
/// process); returns whether Ctrl-C stopped the run.
fn run_rank(
    cfg: &Config,
    opts: &GpuTrainOptions,
    rank: usize,
    world: usize,
    id: Option<NcclId>,
    prepared: Option<Prepared>,
) -> Result<bool> {
    let started = (Instant::now(), SystemTime::now());
    let lead = rank == 0;
    let prepared = match prepared {
        Some(p) => p,
        None => prepare(cfg, opts, lead && id.is_none())?,
    };
    let out_dir = PathBuf::from(&cfg.tessera.output_dir);
    // Rank 0 writes the output folder: it holds the folder's lock (a second run is refused).
    let _lock = if lead { Some(engine::lock_output(&out_dir)?.0) } else { None };
    let (gpu, r) = open_rank(cfg, &prepared, rank, world, id)?;
    let (dataset, plan) = (&prepared.dataset, &prepared.plan);
    let sampler = Sampler::new(dataset.train.clone(), plan.seq_len, cfg.tessera.seed).context("training data")?;
    let val = data::val_batches(dataset.val.clone(), plan.seq_len, plan.micro, cfg.tessera.eval_iters.max(1)).context("validation data")?;
    let mut monitors = if lead { bridge::monitors(cfg, &out_dir)? } else { MonitorSet::new() };
    let steps = cfg.tessera.steps;
    let pb = engine::progress_bar(steps, opts.progress && lead);
    pb.set_position(prepared.start.step);
    if lead {
        engine::log_line(&pb, start_line(cfg, &prepared, &gpu.name, world));
    }
    let Prepared { data, plan, start, .. } = prepared;
    let mut run = RankRun {
        cfg,
        plan,
        r,
        lead,
        rank,
        world,
        momentum_cycle: crate::schedule::momentum_cycle(cfg.scheduler.as_ref()),
        step: start.step,
        applied: start.applied,
        skipped: start.skipped,
        out_dir: out_dir.clone(),
        data,
    };
    drop(start);
    let mut t = Tally::default();
    if run.step == 0 && run.evaluates() {
        let v = evaluate(&mut run.r, &val)?;
        t.initial_val = Some(v);
        t.val_curve.push((0, v));
    }
    let mut interrupted = false;
    // The masters of the checkpoint just saved (the summary hashes them without a new gather).
    let mut saved: Option<(u64, Vec<f32>)> = None;
    while run.step < steps {
        let s = run.train_step(&sampler, &mut t)?;
        run.report_step(&s, &mut t, &val, &mut monitors, &pb)?;
        if run.checkpoint_or_stop(&s, &mut t, &mut saved, &pb)? {
            interrupted = true;
            break;
        }
    }
    pb.finish_and_clear();
    let master = match saved {
        Some((s, m)) if s == run.step => m,
        _ => run.r.masters().context("gathering the masters for the summary")?,
    };
    let figures = run.gather_figures()?;
    if !lead {
        return Ok(interrupted);
    }
    monitors.flush().context("flushing monitors")?;
    let summary = run.summary(&t, &master, interrupted, figures, &gpu.name, started);
    summary.write(&out_dir.join("summary.json")).context("writing summary.json")?;
    monitor::write_loss_curve_svg(&out_dir.join("loss.svg"), &[("train", &t.train_curve), ("val", &t.val_curve)])
        .context("writing loss.svg")?;
    outln!("{}", summary.render());
    outln!("wrote {}/summary.json and {}/loss.svg", out_dir.display(), out_dir.display());
    Ok(interrupted)
}

/// Opens rank `rank`'s GPU, joins the NCCL group (with several ranks) and builds the rank's
/// model states from the start state (and the Adam moments, when resuming), checked against
/// the states planned at start.
fn open_rank(cfg: &Config, p: &Prepared, rank: usize, world: usize, id: Option<NcclId>) -> Result<(Arc<Gpu>, Rank)> {
    let (plan, start) = (&p.plan, &p.start);
    let gpu = Gpu::open(rank)?;
    gpu.compile_all()?;
    let comm = match id {
        Some(id) if world > 1 => Some(NcclComm::new(gpu.clone(), rank, world, &id)?),
        _ => None,
    };
    let shape = gpt::Shape::new(&plan.model.cfg, plan.micro, plan.seq_len)?;
    let OptimizerConfig::Adam { betas, eps, weight_decay, .. } = cfg.optimizer else {
        bail!("the GPU path runs Adam/AdamW only (checked before)");
    };
    let momentum_cycle = crate::schedule::momentum_cycle(cfg.scheduler.as_ref());
    let adam = AdamW { betas, eps, weight_decay, clip: plan.clip, momentum_cycle };
    let spec = RankSpec {
        model: &plan.model,
        stage: plan.stage,
        shape,
        init: &start.master,
        adam,
        m_local: plan.micro_batches / world,
        offload: p.offload,
        recompute: cfg.activation_checkpointing,
    };
    let mut r = Rank::new(gpu.clone(), comm, spec)?;
    r.overlap = plan.overlap_comm;
    let states = p.states;
    if r.state_bytes() != states {
        bail!("GPU rank {rank}: the model states allocated ({:?}) differ from those planned at start ({states:?})", r.state_bytes());
    }
    if let Some((steps, mm, vv)) = &start.moments {
        r.load_moments(mm, vv, *steps).context("restoring the Adam moments from the checkpoint")?;
    }
    r.sync()?;
    Ok((gpu, r))
}

/// Rank 0's first line: the model, the data, the GPUs, the ZeRO stage, the batch and the
/// optimizer offload.
fn start_line(cfg: &Config, p: &Prepared, gpu_name: &str, world: usize) -> String {
    let plan = &p.plan;
    let off = p.offload.map_or(String::new(), |o| {
        format!(
            " | optimizer offloaded to host memory (ratio {}, {} CPU threads per rank; {:.1} MiB of model states on the GPU)",
            o.ratio,
            o.threads,
            p.states.device.total() as f64 / (1u64 << 20) as f64
        )
    });
    format!(
        "training {} ({:.2}M params) on {} | {world} × {} | ZeRO-{} | bf16 | batch {} = {} micro-batches × {} × {} tokens | {} steps{off}",
        cfg.tessera.model,
        plan.total() as f64 / 1e6,
        p.dataset.source,
        gpu_name,
        plan.stage,
        cfg.train_batch_size,
        plan.micro_batches,
        plan.micro,
        plan.seq_len,
        cfg.tessera.steps
    )
}

/// What one training step gave: the same on every rank (the loss and the stop flag are
/// gathered), but for `norm`, this rank's report.
struct Stepped {
    /// The mean loss over the ranks.
    loss: f64,
    /// The global gradient norm, when the optimizer computed one.
    norm: Option<f64>,
    /// The learning rate of the update.
    lr: f32,
    /// OneCycle's first beta of the update (DeepSpeed prints it as `mom`).
    beta1: Option<f32>,
    /// Some rank was asked to stop: every rank stops after this step.
    stopping: bool,
    /// When the step began, and its seconds up to the gather of the losses.
    t0: Instant,
    step_s: f64,
}

/// What every rank reports for the summary (gathered: every rank takes part), by rank.
struct RankFigures {
    device_bytes: Vec<u64>,
    model_states: Vec<MemoryBytes>,
    offloaded: Vec<OffloadedBytes>,
    peak_rss_bytes: Vec<u64>,
    /// This rank's host optimizer, when the optimizer is offloaded.
    offload: Option<HostOptimizerFigures>,
}
