//! The training driver: builds the plan and the ranks, starts the actor tree, runs steps as
//! transactions, and around them evaluation, checkpoints, monitors, the progress bar and the
//! final summary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_actors::compute::{MemoryReport, MoeTally, ShardInfo, ShardSpec, WorkerCompute};
use tessera_actors::error::Failures;
use tessera_actors::faults::Faults;
use tessera_actors::recovery::{after_failure, AfterFailure};
use tessera_actors::stepper::{Action, Input, Stepper};
use tessera_actors::{ActorError, Cluster, ClusterOptions, StepResult};
use tessera_fleet::driver::{now_ms, Fleet, Origin};
use tessera_fleet::spec::Placement;
use tessera_fleet::state::Start;
use tessera_kernels::model::{FlatAccess, Workspace};
use tessera_transport::local::LocalGroup;

use super::fleet::{fleet_spec, RunPlanner, SignalHost};
use super::moe_stats::{self, MoeSummary};
use super::pipeline::report::PipelineTally;
use super::plan::Plan;
use super::ranks::{rank_states, Ranks};
use super::summary::{peak_rss_bytes, ElasticSummary, RunRecord, RunStatus, Summary};
use super::zero::ZeroWorker;
use crate::bridge;
use crate::checkpoint::{self, CheckpointState, NamedTensor};
use crate::config::{self, Config, ElasticRun};
use crate::data::{self, Dataset, Sampler, SamplerState};
use crate::gpu::compute::{GpuRankOptions, GpuRanks, GpuStart, GpuWorker};
use crate::monitor::{self, Event, Monitor, MonitorSet};
use crate::offload::OffloadedBytes;
use crate::signals::{self, StopReason};

/// What `tessera train` was asked to do beyond the config.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// A checkpoint directory (a step directory or the checkpoint root) to continue from.
    pub resume: Option<PathBuf>,
    /// Show the progress bar (off for tests and non-interactive runs).
    pub progress: bool,
    /// Steps to prepare and then abandon once before running them again (exercises the step
    /// transaction; the result must not change).
    pub abandon_steps: Vec<u64>,
    /// Run each of the `world` ranks in its own worker process (QUIC between them: the fleet,
    /// see `tessera_fleet::driver`, elastic or with recovery off) instead of as threads of this
    /// process.
    pub processes: bool,
    /// A `--worker-net` file: the spawned workers each in their own network namespace
    /// (see `engine::worker_net`; written by `tessera chaos run`).
    pub worker_net: Option<PathBuf>,
    /// The test-only fault hooks of this process (`tessera_actors::faults`; no-op by default).
    pub faults: Faults,
    /// `tessera coordinator` / `tessera launch`: the agents' rendezvous, which the run's ranks
    /// come from instead of spawned workers (taken once; see `tessera_fleet::rendezvous::RendezvousSlot`).
    pub rendezvous: tessera_fleet::rendezvous::RendezvousSlot,
}

/// What a finished run leaves behind.
#[derive(Debug)]
pub struct TrainOutcome {
    pub summary: Summary,
    pub output_dir: PathBuf,
    /// Whether Ctrl-C stopped the run early.
    pub interrupted: bool,
}

const OPTIM_PREFIX: &str = "optim";

/// How long an elastic run waits, after an operation failed, for the loss that caused it to
/// be noticed (ms).
const SETTLE_MS: u64 = 500;

/// The actor tree's options: the step timeout is the fleet's (`tessera.elastic.step_timeout_ms`,
/// the bound on one worker's reply) when the ranks are worker processes.
fn cluster_options(opts: &TrainOptions, step_timeout_ms: Option<u64>) -> ClusterOptions {
    let mut c = ClusterOptions { abandon_steps: opts.abandon_steps.clone(), ..ClusterOptions::default() };
    if let Some(ms) = step_timeout_ms {
        c.step_timeout_ms = ms;
    }
    c
}

fn fresh_start(cfg: &Config, plan: &Plan) -> Result<Start> {
    let master = plan.initial_params(cfg.tessera.seed).with_context(|| format!("tessera.model = {:?}", cfg.tessera.model))?;
    Ok(Start { step: 0, master, optim: None, applied: 0, skipped: 0, scaler: None })
}

/// Where a resumed run starts: the checkpoint's masters, optimizer buffers and counters, checked
/// against the config (model, tokenizer, seed, step range, data cursor; `verbose`: the
/// checkpoints skipped as damaged are printed), and the step directory `dir` resolved to (`dir` may be a checkpoint
/// root): what an elastic run falls back on when no checkpoint of its own is left.
fn resume_point(cfg: &Config, plan: &Plan, dir: &Path, verbose: bool, data: Option<&serde_json::Value>) -> Result<(Start, PathBuf)> {
    let (start, path) = checkpoint_start(cfg, plan, dir, verbose, data)?;
    if start.step >= cfg.tessera.steps {
        bail!(
            "checkpoint {} is at step {}, and this run stops at step {}: ask for more with --steps",
            path.display(),
            start.step,
            cfg.tessera.steps
        );
    }
    Ok((start, path))
}

/// The state a checkpoint holds (see [`resume_start`], without the check against the run's
/// length) and the step directory it came from. With `data` (this run's [`data::Dataset::record`])
/// and `verbose`, a checkpoint trained on other data is warned of: a resume on new data is a
/// choice DeepSpeed allows (fine-tuning, a new mix), but it is not the run it continues.
fn checkpoint_start(cfg: &Config, plan: &Plan, dir: &Path, verbose: bool, data: Option<&serde_json::Value>) -> Result<(Start, PathBuf)> {
    let resolved = checkpoint::resolve_resume(dir).with_context(|| format!("resuming from {}", dir.display()))?;
    for s in resolved.skipped.iter().filter(|_| verbose) {
        tracing::warn!("skipped checkpoint {}: {}", s.dir.display(), s.error);
    }
    if let (Some((step, newer)), true) = (&resolved.newer, verbose) {
        tracing::warn!(
            "{}/latest names step {}, but {} (step {step}) is newer: resuming from the one `latest` names; pass \
             --resume {} to continue from the newer one",
            dir.display(),
            resolved.state.step,
            newer.display(),
            newer.display()
        );
    }
    let (path, ck) = (resolved.dir, resolved.state);
    if ck.model != cfg.tessera.model {
        bail!("checkpoint {} holds model `{}` but the config asks for `{}`", path.display(), ck.model, cfg.tessera.model);
    }
    if ck.extra.get("model_config").cloned().unwrap_or_default() != plan.model_record() {
        bail!(
            "checkpoint {} was trained with another {}/config.json than the one there now: restore the folder's config, or \
             train the new shape from scratch",
            path.display(),
            cfg.tessera.model
        );
    }
    let (was, now) =
        (ck.extra.get("tokenizer").cloned().unwrap_or_default(), data::tokenizer_record(cfg.tessera.tokenizer.as_deref().map(Path::new))?);
    if was.get("blake3") != now.get("blake3") {
        bail!(
            "checkpoint {} was trained on {}, but this run uses {}",
            path.display(),
            data::describe_record(&was),
            data::describe_record(&now)
        );
    }
    if let (Some(now), Some(was), true) = (data, ck.extra.get("data"), verbose) {
        if now.get("blake3") != was.get("blake3") {
            let describe = |d: &serde_json::Value| {
                format!(
                    "{} (blake3 {:.16}…)",
                    d.get("source").and_then(serde_json::Value::as_str).unwrap_or("?"),
                    d.get("blake3").and_then(serde_json::Value::as_str).unwrap_or("?")
                )
            };
            tracing::warn!(
                "checkpoint {} was trained on {}, and this run's data is {}: the run goes on from its state on the new \
                 data, and its bits will not match a run that never changed data",
                path.display(),
                describe(was),
                describe(now)
            );
        }
    }
    let mut master = vec![0.0; plan.total()];
    for spec in plan.model.layout().specs() {
        let t = ck
            .params
            .iter()
            .find(|t| t.name == spec.name)
            .with_context(|| format!("checkpoint {} lacks parameter `{}`", path.display(), spec.name))?;
        if t.data.len() != spec.numel() {
            bail!(
                "checkpoint {}: parameter `{}` has {} values, the model expects {:?}",
                path.display(),
                spec.name,
                t.data.len(),
                spec.shape
            );
        }
        master[spec.range()].copy_from_slice(&t.data);
    }
    let extra = &ck.extra;
    let get = |k: &str| {
        extra
            .get(k)
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("checkpoint {}: manifest extra lacks `{k}`", path.display()))
    };
    let bufs =
        ck.optim.iter().filter_map(|t| t.name.strip_prefix(&format!("{OPTIM_PREFIX}.")).map(|n| (n.to_string(), t.data.clone()))).collect();
    let cursor = SamplerState::from_json(&ck.data_cursor).with_context(|| format!("checkpoint {}: data cursor", path.display()))?;
    if cursor.seed != cfg.tessera.seed {
        bail!(
            "checkpoint {} was trained with seed {} but this run has tessera.seed = {}: the data order would change; pass --seed {}",
            path.display(),
            cursor.seed,
            cfg.tessera.seed,
            cursor.seed
        );
    }
    // Samples are windows of seq_len tokens: another length is another data order. (Older
    // checkpoints do not record it.)
    if let Some(was) = extra.get("seq_len").and_then(serde_json::Value::as_u64).filter(|&n| n != plan.seq_len as u64) {
        bail!(
            "checkpoint {} was trained with seq_len {was} but this run has {}: the data order would change; resume with \
             --set tessera.seq_len={was}",
            path.display(),
            plan.seq_len
        );
    }
    if cursor.cursor != plan.first_sample(ck.step, 0) {
        let per_step = plan.micro_batches * plan.micro;
        if ck.step > 0 && cursor.cursor % ck.step == 0 {
            let theirs = cursor.cursor / ck.step;
            bail!(
                "checkpoint {} was trained with train_batch_size = {theirs} (its data cursor is at sample {} after step {}) \
                 but this run has {per_step}: the data order would change; resume with train_batch_size = {theirs}",
                path.display(),
                cursor.cursor,
                ck.step
            );
        }
        bail!(
            "checkpoint {}: data cursor {} does not match step {} of this batch geometry ({} samples per step)",
            path.display(),
            cursor.cursor,
            ck.step,
            plan.micro_batches * plan.micro
        );
    }
    if verbose {
        crate::outln!("resuming from checkpoint {} (step {})", path.display(), ck.step);
    }
    let start = Start {
        step: ck.step,
        master,
        optim: Some((get("optimizer_steps")?, bufs)),
        applied: get("applied_steps")?,
        skipped: get("skipped_steps")?,
        scaler: extra.get("loss_scaler").cloned().filter(|v| !v.is_null()),
    };
    Ok((start, path))
}

/// An elastic run's restore path: the newest valid checkpoint under `root` at or before step
/// `at` (damaged ones are skipped), else where the run started (`resume`, or the seeded
/// initial state). Returns the state and a description of it; each checkpoint skipped as
/// damaged is reported to `skipped(dir, why)`. The choice is [`restore_choice`]'s.
fn restore_from_disk(
    cfg: &Config,
    plan: &Plan,
    root: &Path,
    resume: Option<&Path>,
    at: u64,
    skipped: &dyn Fn(&Path, &str),
) -> Result<(Start, String)> {
    let load = |dir: &Path| checkpoint_start(cfg, plan, dir, false, None).map(|(start, _)| (start.step, Ok(start)));
    let (_, start, source) = restore_choice(root, resume, at, &load, &|| fresh_start(cfg, plan), skipped)?;
    Ok((start?, source))
}

/// Which state a restore at or before step `at` loads (what [`restore_from_disk`] does, over
/// any `load`, so that `restore_sim` runs it on small states): the first of `root`'s
/// checkpoints at or before `at` (`checkpoint::list_restorable`), newest first, that `load`
/// accepts and that holds its folder's step (each other one is warned about and reported to
/// `skipped(dir, why)`, and so is a `root` that cannot be listed), else `resume` (the step
/// directory the run resumed from; refused when it is past `at`), else `fresh()` (step 0).
/// Returns the step, the state and where it came from.
pub(crate) fn restore_choice<S>(
    root: &Path,
    resume: Option<&Path>,
    at: u64,
    load: &dyn Fn(&Path) -> Result<(u64, S)>,
    fresh: &dyn Fn() -> S,
    skipped: &dyn Fn(&Path, &str),
) -> Result<(u64, S, String)> {
    let found = checkpoint::list_restorable(root).unwrap_or_else(|e| {
        let why = format!("its checkpoints cannot be listed: {e}");
        tracing::warn!("skipped checkpoint folder {}: {why}", root.display());
        skipped(root, &why);
        Vec::new()
    });
    for (step, dir) in found.into_iter().filter(|(s, _)| *s <= at) {
        let why = match load(&dir) {
            Ok((got, state)) if got == step => return Ok((step, state, format!("checkpoint {}", dir.display()))),
            Ok((got, _)) => format!("it holds step {got}, not {step}"),
            Err(e) => format!("{e:#}"),
        };
        tracing::warn!("skipped checkpoint {}: {why}", dir.display());
        skipped(&dir, &why);
    }
    match resume {
        Some(dir) => {
            let (step, state) = load(dir)?;
            if step > at {
                bail!(
                    "no valid checkpoint at or before step {at} is left: the one the run resumed from, {}, is at step {step}",
                    dir.display()
                );
            }
            Ok((step, state, format!("checkpoint {} (where the run resumed)", dir.display())))
        }
        None => Ok((0, fresh(), "the seeded initial state (step 0)".to_string())),
    }
}

/// Creates the output folder `dir` if missing and locks it for this run (a second run on it is
/// refused, naming the holder's pid); returns the lock and whether the folder was made here.
fn lock_output(dir: &Path) -> Result<(checkpoint::OutputLock, bool)> {
    let made = !dir.exists();
    std::fs::create_dir_all(dir).with_context(|| format!("creating output directory {}", dir.display()))?;
    match checkpoint::OutputLock::acquire(dir) {
        Ok(lock) => Ok((lock, made)),
        Err(e) => {
            if made {
                let _ = std::fs::remove_dir(dir);
            }
            Err(e.into())
        }
    }
}

/// A fresh run never writes over another run's checkpoints: nothing is lost by accident.
fn refuse_to_overwrite(ckpt_root: &Path) -> Result<()> {
    let found = checkpoint::list_checkpoints(ckpt_root).unwrap_or_default();
    if let Some((step, dir)) = found.first() {
        bail!(
            "{} already holds checkpoints (newest: step {step}, {}); continue with --resume {} or start elsewhere with --output DIR",
            ckpt_root.display(),
            dir.display(),
            ckpt_root.display()
        );
    }
    Ok(())
}

/// A checkpoint's tensors: the masters under their parameter names, and the full-length optimizer
/// buffers under `optim.<name>` (shared with the GPU path, so both write the same format).
fn checkpoint_tensors(
    plan: &Plan,
    master: &[f32],
    bufs: impl IntoIterator<Item = (String, Vec<f32>)>,
) -> (Vec<NamedTensor>, Vec<NamedTensor>) {
    let params = plan
        .model
        .layout()
        .specs()
        .iter()
        .map(|s| NamedTensor { name: s.name.clone(), shape: s.shape.clone(), data: master[s.range()].to_vec() })
        .collect();
    let optim = bufs
        .into_iter()
        .map(|(name, data)| NamedTensor { name: format!("{OPTIM_PREFIX}.{name}"), shape: vec![data.len()], data })
        .collect();
    (params, optim)
}

fn save_checkpoint(cfg: &Config, plan: &Plan, ranks: &Ranks, step: u64, root: &Path, data: &serde_json::Value) -> Result<PathBuf> {
    let (master, bufs, c) = ranks.assemble(plan, true)?;
    let (params, optim) = checkpoint_tensors(plan, &master, bufs);
    let state = CheckpointState {
        step,
        config_hash: cfg.hash.clone(),
        model: cfg.tessera.model.clone(),
        data_cursor: SamplerState { seed: cfg.tessera.seed, cursor: plan.first_sample(step, 0) }.to_json(),
        rng: serde_json::json!({ "seed": cfg.tessera.seed }),
        extra: serde_json::json!({
            "optimizer_steps": c.optimizer_steps,
            "applied_steps": c.applied,
            "skipped_steps": c.skipped,
            "loss_scaler": c.scaler,
            "world_size": plan.world,
            "zero_stage": plan.stage,
            "seq_len": plan.seq_len,
            "tokenizer": data::tokenizer_record(cfg.tessera.tokenizer.as_deref().map(Path::new))?,
            "data": data,
            "model_config": plan.model_record(),
            // The `tessera.moe` section as resolved: a dense preset or folder trained with it has
            // experts its own config does not describe (`cli::model_from_checkpoint` applies it).
            "moe": cfg.resolved.pointer("/tessera/moe").cloned().unwrap_or_default(),
            "model_files": plan.model_files(cfg.tessera.tokenizer.as_deref()),
            "data_bos": cfg.tessera.data_bos,
        }),
        params,
        optim,
    };
    checkpoint::save(root, &state, cfg.tessera.keep_last as usize)
        .with_context(|| format!("saving checkpoint of step {step} under {}", root.display()))
}

/// NCCL GPU ranks loaded with the start state: the masters and, on a resume, the optimizer state.
fn gpu_ranks(plan: &Plan, start: &Start, opts: &GpuRankOptions) -> Result<GpuRanks> {
    let moments = match &start.optim {
        None => None,
        Some((steps, bufs)) => {
            let find = |name: &str| -> Result<&[f32]> {
                let (_, b) = bufs.iter().find(|(n, _)| n == name).with_context(|| {
                    let held: Vec<&str> = bufs.iter().map(|(n, _)| n.as_str()).collect();
                    format!(
                        "the checkpoint has no optimizer state `{OPTIM_PREFIX}.{name}` (it holds [{}]): it was trained with another \
                         optimizer than this run's {}",
                        held.join(", "),
                        plan.optimizer.name()
                    )
                })?;
                if b.len() != plan.total() {
                    bail!("the checkpoint's `{OPTIM_PREFIX}.{name}` has {} values, the model has {} parameters", b.len(), plan.total());
                }
                Ok(b)
            };
            let found = plan.optimizer.state_names().iter().map(|n| find(n)).collect::<Result<Vec<_>>>()?;
            Some((*steps, found))
        }
    };
    let from = GpuStart { master: &start.master, moments, applied: start.applied, skipped: start.skipped, scaler: start.scaler.as_ref() };
    crate::gpu::compute::start_ranks(plan, &from, opts)
}

/// Mean validation loss over the fixed validation batches, on the working (rounded) params.
fn evaluate(plan: &Plan, ranks: &Ranks, batches: &data::ValBatches, ws: &mut Workspace) -> Result<f64> {
    if let Ranks::Gpu(g) = ranks {
        // On the ranks' own bf16 parameters, where they are.
        return g.evaluate(batches);
    }
    let (mut params, _, _) = ranks.assemble(plan, false)?;
    plan.precision.round(&mut params);
    if plan.device == crate::config::ComputeDevice::Cuda && super::device::gpu_here() {
        let loss = super::device::gpu_eval_loss(&plan.model, &params, (plan.micro, plan.seq_len), batches.iter());
        return loss.map_err(|e| anyhow::anyhow!("evaluation: {e}"));
    }
    let total: f64 = batches
        .iter()
        .map(|(x, y)| {
            let mut acc = FlatAccess { params: &params, grads: &mut [], units: plan.model.units() };
            f64::from(plan.model.loss(&mut acc, &x, &y, plan.micro, plan.seq_len, ws))
        })
        .sum();
    Ok(total / batches.len().max(1) as f64)
}

/// DeepSpeed's `wall_clock_breakdown` timer tags (ms) for a committed step, as its engine
/// writes them to the monitors from rank 0: rank 0's forward, backward (its computation and
/// its waits on gradient communication, also apart) and the optimizer step (the commit phase,
/// as the ClusterSupervisor timed it). See [`tessera_actors::compute::PhaseTimes`].
fn timer_events(res: &StepResult, samples: u64) -> Vec<Event> {
    let p = res.per_rank.first().map(|p| p.phases).unwrap_or_default();
    let ms = |s: f64| s * 1e3;
    [
        ("forward", ms(p.forward_s)),
        ("backward", ms(p.backward_inner_s + p.backward_allreduce_s)),
        ("backward_inner", ms(p.backward_inner_s)),
        ("backward_allreduce", ms(p.backward_allreduce_s)),
        ("step", ms(res.commit_s)),
    ]
    .into_iter()
    .map(|(name, v)| Event::new(format!("Train/Samples/elapsed_time_ms_{name}"), v, samples))
    .collect()
}

/// A step line (header, loss, validation, elastic events): on standard output, with the
/// progress bar on standard error out of the way meanwhile (`crate::console`).
fn log_line(pb: &ProgressBar, line: String) {
    crate::console::line(pb, &line);
}

/// The training progress bar (hidden when `enabled` is false), shared with the GPU path.
fn progress_bar(total: u64, enabled: bool) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    let style = ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30.cyan/blue}] {msg} eta {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    crate::console::show_bar(&pb);
    pb
}

fn shard_infos(plan: &Plan, ranks: &Ranks) -> Vec<ShardInfo> {
    ranks.memory().iter().enumerate().map(|(r, m)| shard_info(plan, r, m)).collect()
}

/// Rank `r`'s shards for its DeviceWorker's shard actors, with the bytes `m` reports.
pub(super) fn shard_info(plan: &Plan, r: usize, m: &MemoryReport) -> ShardInfo {
    ShardInfo {
        rank: r,
        params: (plan.stage == 3).then(|| ShardSpec { range: plan.ranges[r].clone(), bytes: m.param_bytes }),
        optim: (plan.stage >= 1).then(|| ShardSpec { range: plan.ranges[r].clone(), bytes: m.optim_bytes }),
    }
}

/// Everything the step loop needs.
struct Run<'a> {
    cfg: &'a Config,
    plan: Arc<Plan>,
    /// Declared before `cluster`: on an error, worker processes are killed before the actor
    /// tree is stopped, which releases any compute thread waiting on them.
    ranks: Ranks,
    cluster: Cluster,
    val: data::ValBatches,
    monitors: MonitorSet,
    ws: Workspace,
    out_dir: PathBuf,
    step: u64,
    /// Set when the ranks are an elastic fleet (`Ranks::Fleet` with `tessera.elastic.enabled`).
    elastic: Option<ElasticRunState>,
    /// The data's record ([`data::Dataset::record`]), written into every checkpoint.
    data: serde_json::Value,
    /// The hold on `out_dir` (released when the run ends, or with the process).
    _lock: checkpoint::OutputLock,
}

/// What an elastic run keeps besides its ranks.
struct ElasticRunState {
    er: ElasticRun,
    /// The step directory the run started from (what `--resume` resolved to), the restore
    /// path of last resort.
    resume: Option<PathBuf>,
    stats: ElasticSummary,
    /// The step/commit/recover loop's decisions (`tessera_actors::stepper`).
    stepper: Stepper,
}

/// Running totals for the summary and the loss curve.
#[derive(Default)]
struct Tally {
    steps_run: u64,
    train_s: f64,
    bytes_sent: u64,
    last_loss: f64,
    last_val: Option<f64>,
    initial_val: Option<f64>,
    train_curve: Vec<(u64, f64)>,
    val_curve: Vec<(u64, f64)>,
    last_ckpt: Option<PathBuf>,
    abandoned: u64,
    /// Each rank's `bytes_sent_total` after the previous step.
    rank_bytes: Vec<u64>,
    /// Steps in a row whose loss was not finite (up to the last one).
    nonfinite_steps: u64,
    /// Seconds recoveries waited for workers to join (not training time).
    join_wait_s: f64,
    /// MoE routing over the steps run, and of the last one (models with MoE blocks).
    moe_run: Option<MoeTally>,
    moe_last: Option<MoeTally>,
    /// Pipelined runs: the measured bubbles and the last step's timeline.
    pipeline: PipelineTally,
}

/// Most of what `train` checks before it starts (`tessera config check` runs it): the data
/// loads (and holds a validation set), the ZeRO plan can be built for the world size (buckets, stage-3 limits, offload
/// settings), the sampler and validation batches can be made and the elastic settings hold,
/// through the functions `train` uses. Not checked here: the memory budget and `--device cuda`'s
/// own refusals (both depend on the device).
pub fn validate(cfg: &Config) -> Result<()> {
    check_steps(cfg)?;
    let dataset = super::child::load_dataset(cfg)?;
    // The memory budget depends on the device the run gets (`--device cuda` counts its own
    // bytes), so `config check` leaves it to `train`.
    let mut unbudgeted = super::pipeline::profile::resolve(cfg)?.unwrap_or_else(|| cfg.clone());
    unbudgeted.tessera.device_memory_bytes_max = None;
    let plan = Plan::new(&unbudgeted, &dataset)?;
    run_inputs(cfg, &plan, &dataset).map(drop)
}

fn check_steps(cfg: &Config) -> Result<()> {
    if cfg.tessera.steps == 0 {
        bail!("tessera.steps = 0 (or --steps 0): a run needs at least one optimizer step");
    }
    Ok(())
}

/// What a run reads besides its plan, checked the same way by `train` and by [`validate`]: the
/// training sampler, the validation batches and the elastic settings.
fn run_inputs(cfg: &Config, plan: &Plan, dataset: &Dataset) -> Result<(Arc<Sampler>, data::ValBatches, ElasticRun)> {
    let sampler = Arc::new(Sampler::new(dataset.train.clone(), plan.seq_len, cfg.tessera.seed).context("training data")?);
    let val = data::val_batches(dataset.val.clone(), plan.seq_len, plan.micro, cfg.tessera.eval_iters.max(1)).context("validation data")?;
    Ok((sampler, val, config::elastic_run(cfg)?))
}

/// Starts the run's ranks and actor tree. `nccl`: the user's config of an NCCL GPU run (`cfg`
/// is then [`crate::gpu::train::plan_config`] of it).
fn start_run<'a>(cfg: &'a Config, opts: &TrainOptions, nccl: Option<&Config>) -> Result<(Run<'a>, Dataset)> {
    let dataset = super::child::load_dataset(cfg)?;
    let plan = Arc::new(Plan::new(cfg, &dataset)?);
    let gpu = nccl.map(|user| crate::gpu::train::rank_options(user, &plan, !opts.abandon_steps.is_empty())).transpose()?;
    if plan.device == crate::config::ComputeDevice::Cuda && !opts.rendezvous.is_set() {
        // GPU ranks on this host (threads or worker processes): refused now, after what the
        // config itself gets wrong, rather than at their first step.
        super::device::require_gpu()?;
    }
    let data = dataset.record();
    let out_dir = PathBuf::from(&cfg.tessera.output_dir);
    // Locked before anything in it is read or written: a second run on this output is refused.
    let (lock, made) = lock_output(&out_dir)?;
    // A refused run leaves no empty output directory behind, nor does one whose workers never
    // start (no agent joined): `remove_dir` takes the directory away only while it is empty
    // (the lock file aside), so any log is kept.
    let unmade = |e: anyhow::Error| {
        if made {
            let _ = std::fs::remove_file(lock.path());
            let _ = std::fs::remove_dir(&out_dir);
        }
        e
    };
    // An elastic run falls back on the very checkpoint it resumed from, not on whatever
    // `--resume`'s folder (maybe this run's own checkpoint root) holds newest by then.
    let (start, resumed_from) = match &opts.resume {
        Some(dir) => resume_point(cfg, &plan, dir, true, Some(&data)).map(|(start, path)| (start, Some(path))).map_err(unmade)?,
        None => {
            refuse_to_overwrite(&out_dir.join("checkpoints")).map_err(unmade)?;
            (fresh_start(cfg, &plan).map_err(unmade)?, None)
        }
    };
    let (sampler, val, er) = run_inputs(cfg, &plan, &dataset).map_err(unmade)?;
    let rendezvous = opts.rendezvous.take();
    if let (Some(path), false) = (&opts.worker_net, opts.processes && rendezvous.is_none()) {
        bail!("--worker-net {}: worker namespaces are for the spawned workers of `train --nprocs N`", path.display());
    }
    if er.enabled && !opts.processes {
        tracing::warn!(
            "tessera.elastic applies to worker processes (`train --nprocs N`, `tessera coordinator`, `tessera launch`); this run's ranks are threads of one process: the first rank lost ends it"
        );
    }
    let mut elastic = None;
    let mut step_timeout_ms = None;
    // Worker processes are the fleet, elastic or with recovery off (`config::elastic_run`):
    // then the first loss ends the run (`Run::ended`).
    let (ranks, workers) = if let Some(g) = gpu {
        let ranks = gpu_ranks(&plan, &start, &g).context("starting the GPU ranks").map_err(unmade)?;
        let workers = (ranks.states.iter().enumerate())
            .map(|(r, st)| Box::new(GpuWorker::new(r, Arc::clone(&plan), Arc::clone(&sampler), Arc::clone(st))) as Box<dyn WorkerCompute>)
            .collect();
        (Ranks::Gpu(ranks), workers)
    } else if opts.processes {
        let net = opts.worker_net.as_deref().map(super::worker_net::load).transpose()?;
        let origin = match rendezvous {
            Some(rdv) => Origin::Agents(Box::new(rdv)),
            None => Origin::Spawn { placement: net.as_ref().map(|n| n as &dyn Placement) },
        };
        let spec = fleet_spec(cfg, &er, &out_dir, &dataset);
        let (fleet, workers) =
            Fleet::launch(spec, &plan, &start, origin, &opts.faults, &SignalHost).context("starting the workers").map_err(unmade)?;
        step_timeout_ms = Some(er.step_timeout_ms);
        if er.enabled {
            let stepper = Stepper::new(start.step);
            elastic = Some(ElasticRunState { er, resume: resumed_from, stats: ElasticSummary::default(), stepper });
        }
        (Ranks::Fleet(Box::new(fleet)), workers)
    } else {
        let states = rank_states(cfg, &plan, &start, &opts.faults)?;
        let workers = LocalGroup::new(plan.world)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                Box::new(ZeroWorker::new(r, Arc::clone(&plan), Arc::clone(&sampler), Box::new(comm), Arc::clone(&states[r])))
                    as Box<dyn WorkerCompute>
            })
            .collect();
        (Ranks::InProcess(states), workers)
    };
    let copts = cluster_options(opts, step_timeout_ms);
    let cluster = Cluster::start(workers, shard_infos(&plan, &ranks), copts).context("starting the actor tree")?;
    if let Ranks::Fleet(fleet) = &ranks {
        fleet.set_stopper(cluster.stopper());
    }
    let monitors = bridge::monitors(cfg, &out_dir)?;
    let ws = Workspace::default();
    let run = Run { cfg, plan, ranks, cluster, val, monitors, ws, out_dir, step: start.step, elastic, data, _lock: lock };
    Ok((run, dataset))
}

impl Run<'_> {
    /// Saves a checkpoint of the committed state under the run's `checkpoints/`.
    fn save_checkpoint(&self) -> Result<PathBuf> {
        save_checkpoint(self.cfg, &self.plan, &self.ranks, self.step, &self.out_dir.join("checkpoints"), &self.data)
    }

    /// One committed step plus its logging, evaluation and checkpoint.
    fn step_once(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset) -> Result<()> {
        let cfg = self.cfg;
        let (t0, join_wait_s) = (Instant::now(), t.join_wait_s);
        let res = match self.elastic.is_some() {
            true => self.elastic_run_step(pb, t, dataset)?,
            false => self.cluster.run_step(self.step).with_context(|| format!("step {}", self.step)).map_err(|e| self.ended(e))?,
        };
        self.step += 1;
        if self.elastic.is_some() {
            self.elastic_after_commit(pb, t, dataset)?;
        }
        // Waiting for workers to join is not training: tokens/s leaves it out.
        let step_s = (t0.elapsed().as_secs_f64() - (t.join_wait_s - join_wait_s)).max(0.0);
        t.train_s += step_s;
        t.steps_run += 1;
        t.abandoned += res.abandoned_attempts.len() as u64;
        // After a recovery the plan is the new epoch's.
        let plan = Arc::clone(&self.plan);
        let loss = res.loss_sum / plan.micro_batches as f64;
        // Prepare and commit traffic of the busiest rank (the commit shares parameters).
        let totals = self.ranks.bytes_sent_totals();
        t.bytes_sent += totals.iter().zip(&t.rank_bytes).map(|(now, before)| now.saturating_sub(*before)).max().unwrap_or(0);
        t.rank_bytes = totals;
        let norm = res.grad_norm.unwrap_or(f64::NAN);
        let overflow = res.overflow;
        t.nonfinite_steps = if loss.is_finite() { 0 } else { t.nonfinite_steps + 1 };
        t.last_loss = loss;
        t.train_curve.push((self.step, loss));
        let samples = plan.first_sample(self.step, 0);
        // The rate the commit used: the schedule's clock counts applied (not skipped) steps.
        let (applied, scale) = self.ranks.applied_and_scale();
        let lr = plan.lr_at(applied.saturating_sub(1));
        // OneCycle's momentum: the first beta that update used (DeepSpeed prints it as `mom`).
        let beta1 = plan.optimizer.momentum_cycle().map(|c| c.beta1_at(applied.saturating_sub(1)));
        let mut events =
            vec![Event::new("Train/Samples/train_loss", loss, samples), Event::new("Train/Samples/lr", f64::from(lr), samples)];
        if let Some(b) = beta1 {
            events.push(Event::new("Train/Samples/beta1", f64::from(b), samples));
        }
        if let Some(scale) = scale {
            events.push(Event::new("Train/Samples/loss_scale", f64::from(scale), samples));
        }
        events.push(Event::new("Train/Samples/grad_norm", norm, samples));
        events.push(Event::new("Train/Samples/tokens_per_s", plan.tokens_per_step() as f64 / step_s.max(1e-9), samples));
        if cfg.wall_clock_breakdown {
            events.extend(timer_events(&res, samples));
        }
        if let Some(m) = &res.moe {
            events.extend(moe_stats::step_events(m, samples));
            t.moe_run.get_or_insert_with(MoeTally::default).add(m);
            t.moe_last = Some(m.clone());
        }
        if let Some(pp) = &plan.pipeline {
            t.pipeline.add(pp, &res);
        }
        let tps = (t.steps_run * plan.tokens_per_step()) as f64 / t.train_s.max(1e-9);
        pb.set_message(format!("loss {loss:.4} | {tps:.0} tok/s"));
        pb.set_position(self.step);
        if cfg.steps_per_print > 0 && self.step % cfg.steps_per_print == 0 {
            let skipped = if overflow { " | skipped (overflow)" } else { "" };
            let mom = beta1.map(|b| format!(" | beta1 {b:.4}")).unwrap_or_default();
            log_line(
                pb,
                format!("step {:>6} | loss {loss:.4} | lr {lr:.3e}{mom} | grad norm {norm:.3} | {tps:.0} tok/s{skipped}", self.step),
            );
            if cfg.wall_clock_breakdown {
                let slowest = res.compute_s_max;
                log_line(
                    pb,
                    format!(
                        "  time: step {:.1} ms | slowest prepare {:.1} ms | sent {} KiB/rank",
                        t0.elapsed().as_secs_f64() * 1e3,
                        slowest * 1e3,
                        t.bytes_sent / t.steps_run.max(1) / 1024
                    ),
                );
            }
        }
        let last = self.step == cfg.tessera.steps;
        if (cfg.tessera.eval_interval > 0 && self.step % cfg.tessera.eval_interval == 0) || last {
            let v = self.with_recovery(pb, t, dataset, |run| evaluate(&run.plan, &run.ranks, &run.val, &mut run.ws))?;
            t.last_val = Some(v);
            t.val_curve.push((self.step, v));
            events.push(Event::new("Train/Samples/val_loss", v, samples));
            log_line(pb, format!("step {:>6} | val loss {v:.4}", self.step));
        }
        self.monitors.write(&events).context("writing monitors")?;
        self.stop_if_diverged(t, loss)?;
        let due = (cfg.tessera.checkpoint_interval > 0 && self.step % cfg.tessera.checkpoint_interval == 0) || last;
        if due && !loss.is_finite() {
            log_line(pb, format!("warning: checkpoint of step {} not written: its loss is {loss}", self.step));
        } else if due {
            let saved = self.with_recovery(pb, t, dataset, |run| run.save_checkpoint());
            if let Ranks::Fleet(fleet) = &self.ranks {
                fleet.checkpointed(self.step, saved.as_deref().map_err(|e| format!("{e:#}")));
            }
            match (saved, self.elastic.as_mut()) {
                (Ok(path), _) => t.last_ckpt = Some(path),
                (Err(e), Some(el)) => {
                    // An elastic run outlives a failing disk: the previous checkpoint stays the
                    // restore point.
                    el.stats.checkpoints_failed += 1;
                    log_line(pb, format!("warning: checkpoint of step {} not written: {e:#}; the run goes on", self.step));
                }
                (Err(e), None) => return Err(e),
            }
        }
        Ok(())
    }

    /// Ends the run with an error once the loss has not been finite for
    /// `tessera.nonfinite_loss_steps` steps in a row (`loss` is this step's).
    fn stop_if_diverged(&mut self, t: &Tally, loss: f64) -> Result<()> {
        let limit = self.cfg.tessera.nonfinite_loss_steps;
        if limit == 0 || t.nonfinite_steps < limit {
            return Ok(());
        }
        // Monitors written so far stay readable.
        let _ = self.monitors.flush();
        let kept = match &t.last_ckpt {
            Some(p) => format!("the last checkpoint written, {}, had a finite loss", p.display()),
            None => "no checkpoint was written".to_string(),
        };
        bail!(
            "step {}: the loss is {loss}, and has not been finite for {} steps in a row (from step {}): the run diverged and \
             stops (tessera.nonfinite_loss_steps = {limit}); {kept}. Lower the learning rate, or check the data and the \
             precision settings",
            self.step,
            t.nonfinite_steps,
            self.step + 1 - t.nonfinite_steps
        )
    }

    /// Whether an elastic run has a membership change to handle (waiting up to `settle_ms`
    /// for the monitor to notice a loss). Never without recovery.
    fn change_pending(&self, settle_ms: u64) -> bool {
        self.elastic.is_some() && matches!(&self.ranks, Ranks::Fleet(f) if f.pending(settle_ms))
    }

    /// A fleet without recovery ends at its first loss: an error of its run becomes that loss
    /// (who was lost and how its process ended, `Fleet::first_loss`) once the failure detector
    /// declared it, waiting up to [`SETTLE_MS`] for it (a survivor's collective may fail before
    /// the lost worker is noticed). Any other error stays as it is.
    fn ended(&self, e: anyhow::Error) -> anyhow::Error {
        let Ranks::Fleet(fleet) = &self.ranks else { return e };
        if self.elastic.is_some() {
            return e;
        }
        fleet.pending(SETTLE_MS);
        match fleet.first_loss() {
            Some(loss) => e.context(format!("{loss}; the run ends (tessera.elastic.enabled = false: no recovery)")),
            None => e,
        }
    }

    /// After the actor-layer error `e`, by the kinds of its failures
    /// ([`tessera_actors::recovery::after_failure`]): members whose DeviceWorker actor died (the
    /// tree reports them `Died`, or refuses a step because they are lost) are declared lost
    /// first, like members whose process died (`Fleet::lose_ranks`); failures a loss explains
    /// wait up to `settle_ms` for it ([`Self::change_pending`]); a rank's own failure waits for
    /// nothing: only a change already pending recovers from it.
    fn change_after_actor(&self, e: &ActorError, settle_ms: u64) -> bool {
        if self.elastic.is_none() {
            return false;
        }
        let settle_ms = match after_failure(e) {
            AfterFailure::Lost(ranks) => {
                if let Ranks::Fleet(fleet) = &self.ranks {
                    fleet.lose_ranks(&ranks);
                }
                settle_ms
            }
            AfterFailure::AwaitLoss => settle_ms,
            AfterFailure::Failed => 0,
        };
        self.change_pending(settle_ms)
    }

    /// [`Self::change_after_actor`] for an error that may wrap an actor-layer one.
    fn change_after(&self, e: &anyhow::Error, settle_ms: u64) -> bool {
        match e.chain().find_map(|c| c.downcast_ref::<ActorError>()) {
            Some(a) => self.change_after_actor(a, settle_ms),
            None => self.change_pending(settle_ms),
        }
    }

    /// Runs `f`; when it fails because of a membership change (elastic runs), recovers and
    /// runs it again.
    fn with_recovery<T>(
        &mut self,
        pb: &ProgressBar,
        t: &mut Tally,
        dataset: &Dataset,
        mut f: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        loop {
            match f(self) {
                Ok(v) => return Ok(v),
                Err(e) if self.change_after(&e, SETTLE_MS) => {
                    log_line(pb, format!("elastic: {e:#}; recovering"));
                    self.recover_between_steps(pb, t, dataset)?;
                }
                Err(e) => return Err(self.ended(e)),
            }
        }
    }

    /// Runs step `self.step` until it commits, forming new epochs at the step boundary when
    /// members were lost, asked to drain, or joined. The step machine
    /// (`tessera_actors::stepper`) decides what runs next; this carries it out.
    fn elastic_run_step(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset) -> Result<StepResult> {
        // What the prepare of the last attempt whose commit failed reported.
        let mut prepared = None;
        let mut action = self.stepper(Input::Step)?;
        loop {
            action = match action {
                Action::Attempt { step } => {
                    debug_assert_eq!(step, self.step);
                    if self.change_pending(0) {
                        self.stepper(Input::Change)?
                    } else if let Err(e) = self.rebalance(pb, dataset) {
                        if !self.change_after(&e, SETTLE_MS) {
                            return Err(e);
                        }
                        log_line(pb, format!("elastic: {e:#}; recovering"));
                        self.stepper(Input::Change)?
                    } else {
                        match self.cluster.run_step(step) {
                            Ok(res) => {
                                if let Ranks::Fleet(fleet) = &mut self.ranks {
                                    fleet.observe(&res.per_rank);
                                }
                                self.stepper(Input::Committed)?;
                                return Ok(res);
                            }
                            Err(e) if self.change_after_actor(&e, SETTLE_MS) => {
                                if let ActorError::CommitFailed { step, failures, prepared: p } = e {
                                    // Every rank prepared: the survivors' shards and the lost
                                    // owners' replicas may all have taken the step. Then it
                                    // counts as committed, with what the prepare reported (the
                                    // measured speeds are not taken from it).
                                    log_line(pb, format!("elastic: the commit of step {step} failed: {}; recovering", Failures(&failures)));
                                    prepared = Some(*p);
                                    self.stepper(Input::CommitFailed)?
                                } else {
                                    log_line(pb, format!("elastic: step {} abandoned: {e}", self.step));
                                    self.stepper(Input::Abandoned)?
                                }
                            }
                            Err(e) => return Err(e).with_context(|| format!("step {}", self.step)),
                        }
                    }
                }
                Action::Committed { by_recovery: true, .. } => {
                    return prepared.take().context("a step committed by a recovery without a failed commit");
                }
                a @ (Action::Reconfigure { .. } | Action::Replay { .. } | Action::Resync { .. } | Action::Recovered { .. }) => {
                    self.recover(pb, t, dataset, a)?
                }
                other => bail!("the step machine answered {other:?} while step {} runs", self.step),
            }
        }
    }

    /// Feeds `input` to the step machine and copies its counts into the elastic summary.
    fn stepper(&mut self, input: Input) -> Result<Action> {
        let Some(el) = self.elastic.as_mut() else { bail!("only an elastic run can recover") };
        let action = el.stepper.on(input);
        let c = el.stepper.counts();
        (el.stats.commits_completed, el.stats.steps_rerun, el.stats.steps_replayed) =
            (c.commits_completed, c.steps_rerun, c.steps_replayed);
        Ok(action)
    }

    /// Recovers from a membership change between steps (the machine answers `Ready`).
    fn recover_between_steps(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset) -> Result<()> {
        let action = self.stepper(Input::Change)?;
        match self.recover(pb, t, dataset, action)? {
            Action::Ready => Ok(()),
            other => bail!("the step machine answered {other:?} after a recovery between steps"),
        }
    }

    /// At a step boundary: re-assigns the micro-batch blocks by the members' measured speeds
    /// when that pays (`Fleet::rebalance`); the driver's plan follows.
    fn rebalance(&mut self, pb: &ProgressBar, dataset: &Dataset) -> Result<()> {
        let planner = RunPlanner { cfg: self.cfg, dataset };
        let Ranks::Fleet(fleet) = &mut self.ranks else { return Ok(()) };
        let Some(r) = fleet.rebalance(self.step, &planner)? else { return Ok(()) };
        self.plan = r.plan;
        if let Some(el) = self.elastic.as_mut() {
            el.stats.rebalances += 1;
        }
        log_line(
            pb,
            format!(
                "elastic: step {}: micro-batches per rank {:?} -> {:?} by measured speed (predicted compute {:.0} -> {:.0} ms a step)",
                self.step, r.before, r.after, r.before_ms, r.after_ms
            ),
        );
        Ok(())
    }

    /// After a commit: the replicas followed the owners' gradients during the step; a member
    /// that dropped one gets a full copy (a loss meanwhile is recovered from).
    fn elastic_after_commit(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset) -> Result<()> {
        if let Err(e) = self.resync_replicas(self.step) {
            if !self.change_after(&e, SETTLE_MS) {
                return Err(e);
            }
            log_line(pb, format!("elastic: {e:#}; recovering"));
            self.recover_between_steps(pb, t, dataset)?;
        }
        if let Ranks::Fleet(fleet) = &self.ranks {
            fleet.committed(self.step);
        }
        Ok(())
    }

    /// Sends full replica copies at `step` committed steps when a member reported a replica
    /// dropped (a failed update or a digest that differed from its owner's) or its replicas
    /// behind (more updates waiting than it applied in the background).
    fn resync_replicas(&mut self, step: u64) -> Result<()> {
        let Ranks::Fleet(fleet) = &self.ranks else { return Ok(()) };
        let (dropped, behind) = fleet.stale_replicas();
        if dropped.is_empty() && behind.is_empty() {
            return Ok(());
        }
        fleet.replicas_recopied(step, &dropped, &behind);
        if let Some(el) = self.elastic.as_mut() {
            match dropped.is_empty() {
                false => el.stats.replicas_recopied += 1,
                true => el.stats.replica_catch_up_copies += 1,
            }
        }
        let Ranks::Fleet(fleet) = &self.ranks else { return Ok(()) };
        fleet.replicate(step)
    }

    /// Carries out the step machine's recovery, starting with `action`: forms a new epoch from
    /// the survivors and joiners at the boundary of `self.step` committed steps (or of the step
    /// a replay reached), restarts the actor tree on it, and replays any committed steps the
    /// restored state lacks (see `tessera_fleet::driver`). Returns the machine's first action past the
    /// recovery: the step's attempt (again), the step committed (its failed commit reached every
    /// shard at `self.step + 1`), or `Ready` (a recovery between steps).
    fn recover(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset, mut action: Action) -> Result<Action> {
        let began = now_ms();
        loop {
            action = match action {
                Action::Reconfigure { at } => {
                    let (cfg, root) = (self.cfg, self.out_dir.join("checkpoints"));
                    let resume = self.elastic.as_ref().and_then(|e| e.resume.clone());
                    let plan_now = Arc::clone(&self.plan);
                    let Ranks::Fleet(fleet) = &mut self.ranks else { bail!("only an elastic run can recover") };
                    let event = fleet.event_sink();
                    let skipped = move |dir: &Path, why: &str| {
                        event(serde_json::json!({"event": "checkpoint_skipped", "path": dir.display().to_string(), "why": why}))
                    };
                    let restore = move |at: u64| restore_from_disk(cfg, &plan_now, &root, resume.as_deref(), at, &skipped);
                    // What was written stays: the error says where to continue from.
                    let resume_hint = |e: anyhow::Error| match &t.last_ckpt {
                        Some(last) => anyhow::anyhow!(
                            "{e:#}\nthe run's checkpoints are kept (the last one written: {}); run it again with `--resume {}` to \
                             continue from the newest valid one",
                            last.display(),
                            last.parent().unwrap_or(last).display()
                        ),
                        None => e,
                    };
                    let rec = fleet.reconfigure(&at, &RunPlanner { cfg, dataset }, &restore).map_err(resume_hint)?;
                    self.plan = Arc::clone(&rec.plan);
                    let copts = cluster_options(&TrainOptions::default(), self.elastic.as_ref().map(|e| e.er.step_timeout_ms));
                    let cluster =
                        Cluster::start(rec.computes, shard_infos(&self.plan, &self.ranks), copts).context("restarting the actor tree")?;
                    if let Ranks::Fleet(fleet) = &self.ranks {
                        fleet.set_stopper(cluster.stopper());
                    }
                    if let Err(e) = std::mem::replace(&mut self.cluster, cluster).shutdown() {
                        tracing::warn!("stopping the previous epoch's actor tree: {e}");
                    }
                    t.rank_bytes = vec![0; self.plan.world];
                    t.join_wait_s += rec.join_wait_s;
                    let from_memory = rec.from_memory;
                    if let Some(el) = self.elastic.as_mut() {
                        let s = &mut el.stats;
                        s.recoveries += 1;
                        s.workers_lost += rec.losses as u64;
                        s.workers_joined += rec.joined as u64;
                        s.workers_drained += rec.drained as u64;
                        if from_memory {
                            s.restored_from_memory += 1;
                        } else {
                            s.restored_from_checkpoint += 1;
                        }
                    }
                    log_line(
                        pb,
                        format!(
                            "elastic: {} worker(s) from step {} ({}){}",
                            self.plan.world,
                            rec.step,
                            rec.source,
                            if from_memory { String::new() } else { format!("; replaying steps {}..{}", rec.step, self.step) }
                        ),
                    );
                    // The machine counts a failed commit whose state every shard reached.
                    self.stepper(Input::Restored { step: rec.step })?
                }
                Action::Replay { step } => match self.cluster.run_step(step) {
                    Ok(_) => self.stepper(Input::Committed)?,
                    Err(e) if self.change_after_actor(&e, SETTLE_MS) => match e {
                        ActorError::CommitFailed { .. } => self.stepper(Input::CommitFailed)?,
                        _ => self.stepper(Input::Abandoned)?,
                    },
                    Err(e) => return Err(e).with_context(|| format!("replaying step {step}")),
                },
                Action::Resync { at } => match self.resync_replicas(at) {
                    Ok(()) => self.stepper(Input::Resynced)?,
                    Err(e) if self.change_after(&e, SETTLE_MS) => self.stepper(Input::Change)?,
                    Err(e) => return Err(e),
                },
                Action::Recovered { at } => {
                    if let Ranks::Fleet(fleet) = &self.ranks {
                        fleet.resumed(began, at);
                    }
                    self.stepper(Input::Resumed)?
                }
                other => return Ok(other),
            }
        }
    }

    /// The run's steps from `self.step` (the initial evaluation first on a fresh run) until
    /// the last one, or until a stop is requested (`crate::signals`): then, between steps,
    /// where the ranks hold a committed state, it saves a checkpoint and returns why.
    fn steps(&mut self, pb: &ProgressBar, t: &mut Tally, dataset: &Dataset) -> Result<Option<StopReason>> {
        if self.step == 0 {
            let v = self.with_recovery(pb, t, dataset, |run| evaluate(&run.plan, &run.ranks, &run.val, &mut run.ws))?;
            t.initial_val = Some(v);
            t.val_curve.push((0, v));
        }
        while self.step < self.cfg.tessera.steps {
            if let Some(why) = signals::requested() {
                if t.nonfinite_steps > 0 {
                    log_line(pb, format!("interrupted ({why}): stopped after step {}; not saved: its loss is {}", self.step, t.last_loss));
                    return Ok(Some(why));
                }
                let path = self.with_recovery(pb, t, dataset, |run| run.save_checkpoint())?;
                log_line(pb, format!("interrupted ({why}): stopped after step {}; saved {}", self.step, path.display()));
                t.last_ckpt = Some(path);
                return Ok(Some(why));
            }
            self.step_once(pb, t, dataset)?;
        }
        Ok(None)
    }

    fn summary(&mut self, t: &mut Tally, started: Instant, pb: &ProgressBar, dataset: &Dataset, run: RunRecord) -> Result<Summary> {
        let (master, _, c) = self.with_recovery(pb, t, dataset, |run| run.ranks.assemble(&run.plan, false))?;
        let plan = &self.plan;
        let names: Vec<(&str, &[f32])> = plan.model.layout().specs().iter().map(|s| (s.name.as_str(), &master[s.range()])).collect();
        let tokens = t.steps_run * plan.tokens_per_step();
        let memory = self.cluster.memory().context("asking the ranks for their memory")?;
        Ok(Summary {
            run,
            model: self.cfg.tessera.model.clone(),
            num_params: plan.total(),
            steps: self.step,
            skipped_steps: c.skipped,
            abandoned_attempts: t.abandoned,
            final_loss: t.last_loss,
            val_loss: t.last_val,
            initial_val_loss: t.initial_val,
            tokens,
            tokens_per_s: tokens as f64 / t.train_s.max(1e-9),
            wall_s: started.elapsed().as_secs_f64(),
            flops_per_token: plan.model.cfg.flops_per_token(plan.total(), plan.seq_len),
            params_blake3: checkpoint::params_blake3(&names),
            peak_rss_bytes: peak_rss_bytes(),
            peak_rss_bytes_per_rank: self.ranks.peak_rss_bytes(),
            world_size: plan.world,
            device: match plan.device {
                crate::config::ComputeDevice::Cpu => "cpu".into(),
                crate::config::ComputeDevice::Cuda => "cuda".into(),
            },
            zero_stage: plan.stage,
            precision: match &self.ranks {
                Ranks::Gpu(_) => "bf16".into(),
                _ => format!("{:?}", plan.precision).to_lowercase(),
            },
            config_hash: self.cfg.hash.clone(),
            // (NCCL's traffic is not counted.)
            bytes_sent_per_rank_per_step: (!matches!(self.ranks, Ranks::Gpu(_))).then(|| t.bytes_sent / t.steps_run.max(1)),
            model_state_bytes_per_rank: memory.iter().map(super::summary::MemoryBytes::from).collect(),
            offloaded_bytes_per_rank: match &self.ranks {
                Ranks::Gpu(g) => {
                    g.host_optim_bytes().into_iter().enumerate().map(|(rank, host)| OffloadedBytes { rank, host, nvme: 0 }).collect()
                }
                _ => (0..plan.world).map(|r| plan.offloaded_bytes(r)).collect(),
            },
            last_checkpoint: t.last_ckpt.as_ref().map(|p| p.display().to_string()),
            elastic: self.elastic.as_ref().map(|e| e.stats.clone()),
            moe: t.moe_run.as_ref().zip(t.moe_last.as_ref()).map(|(run, last)| MoeSummary::new(run, last)),
            pipeline: plan.pipeline.as_ref().map(|pp| t.pipeline.summary(pp, plan.micro_batches / pp.replicas)),
            gpu: match &self.ranks {
                Ranks::Gpu(g) => Some(g.figures()),
                _ => None,
            },
        })
    }
}

/// Runs a whole training job as the config says.
pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    check_steps(cfg)?;
    if let Some(&n) = opts.abandon_steps.iter().find(|&&n| n >= cfg.tessera.steps) {
        bail!(
            "--abandon-step {n}: steps are numbered from 0, so this run of {} step(s) has steps 0..={}; step {n} never runs",
            cfg.tessera.steps,
            cfg.tessera.steps - 1
        );
    }
    signals::install()?;
    let (started, started_at) = (Instant::now(), SystemTime::now());
    // The profile partition's costs, measured once here for every rank and re-plan.
    let profiled = super::pipeline::profile::resolve(cfg)?;
    let cfg = profiled.as_ref().unwrap_or(cfg);
    // NCCL GPU ranks: what they do not implement is refused first, what they treat differently
    // is said; the plan comes from the config as the GPU reads it.
    let nccl = crate::gpu::train::nccl_run(cfg);
    let gpu_cfg = match nccl {
        true => {
            for note in crate::gpu::train::check_supported(cfg)? {
                tracing::warn!("{note}");
            }
            Some(crate::gpu::train::plan_config(cfg))
        }
        false => None,
    };
    if !nccl && cfg.tessera.device == config::ComputeDevice::Cuda && matches!(cfg.precision, config::Precision::Fp16(_)) {
        tracing::warn!(
            "fp16.enabled with the engine's GPU ranks: the working parameters are the masters rounded to fp16, and the device \
             computes each micro-batch from them in bf16 (its kernels' type); the gradients come back in f32 and are stored in \
             fp16 under the loss scaler (overflowing steps skipped), as on CPU ranks"
        );
    }
    let (user, cfg) = (cfg, gpu_cfg.as_ref().unwrap_or(cfg));
    let (mut run, dataset) = start_run(cfg, opts, nccl.then_some(user))?;
    // A second signal removes the save it interrupts (the last complete checkpoint stays).
    let _temps = signals::on_forced_exit(signals::Cleanup::SaveTemps(run.out_dir.join("checkpoints")));
    let pb = progress_bar(cfg.tessera.steps, opts.progress);
    pb.set_position(run.step);
    let plan = Arc::clone(&run.plan);
    log_line(
        &pb,
        format!(
            "training {} ({:.2}M params) on {} | world {}{} | ZeRO-{} | batch {} = {} micro-batches × {} × {} tokens | {} steps",
            cfg.tessera.model,
            plan.total() as f64 / 1e6,
            dataset.source,
            plan.world,
            match &run.ranks {
                Ranks::Gpu(g) => g.note.as_str(),
                _ => "",
            },
            plan.stage,
            cfg.train_batch_size,
            plan.micro_batches,
            plan.micro,
            plan.seq_len,
            cfg.tessera.steps
        ),
    );
    if let Some(pp) = &plan.pipeline {
        log_line(&pb, pp.describe());
    }
    let mut t = Tally { rank_bytes: vec![0; plan.world], ..Tally::default() };
    let stopped = match run.steps(&pb, &mut t, &dataset) {
        Ok(stopped) => stopped,
        Err(e) => {
            pb.finish_and_clear();
            let record = RunRecord { error: Some(format!("{e:#}")), ..RunRecord::new(RunStatus::Failed, cfg.tessera.seed, started_at) };
            // What the failed run reached, where its state can still be read.
            match run.summary(&mut t, started, &pb, &dataset, record) {
                Ok(s) => {
                    if let Err(w) = s.write(&run.out_dir.join("summary.json")) {
                        tracing::warn!("summary.json of the failed run not written: {w}");
                    }
                }
                Err(w) => tracing::warn!("summary.json of the failed run not written: {w:#}"),
            }
            return Err(e);
        }
    };
    pb.finish_and_clear();
    run.monitors.flush().context("flushing monitors")?;
    let status = if stopped.is_some() { RunStatus::Interrupted } else { RunStatus::Completed };
    let record = RunRecord { stopped_by: stopped.map(|r| r.to_string()), ..RunRecord::new(status, cfg.tessera.seed, started_at) };
    let summary = run.summary(&mut t, started, &pb, &dataset, record)?;
    summary.write(&run.out_dir.join("summary.json")).context("writing summary.json")?;
    monitor::write_loss_curve_svg(&run.out_dir.join("loss.svg"), &[("train", &t.train_curve), ("val", &t.val_curve)])
        .context("writing loss.svg")?;
    if let Some(pp) = &run.plan.pipeline {
        t.pipeline.write_svg(pp, &run.out_dir.join("pipeline.svg"))?;
    }
    let Run { cluster, ranks, out_dir, .. } = run;
    cluster.shutdown().context("stopping the actor tree")?;
    ranks.close().context("stopping the worker processes")?;
    Ok(TrainOutcome { summary, output_dir: out_dir, interrupted: stopped.is_some() })
}
