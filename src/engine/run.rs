//! The training loop: data → micro-batches → tree-summed gradients → optimizer, with
//! evaluation, checkpoints, monitors, a progress bar and the final summary.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_kernels::model::{FlatAccess, Model, Workspace};
use tessera_kernels::optim::{
    clip_coefficient, global_grad_norm, FlatLayout, LocalReduce, LossScaler, OptimizerShard, StepContext, StepOutcome,
};
use tessera_transport::tree::TreeSum;

use super::precision::Precision16;
use super::summary::{peak_rss_bytes, Summary};
use crate::checkpoint::{self, CheckpointState, NamedTensor};
use crate::config::Config;
use crate::data::{self, Dataset, Sampler, SamplerState};
use crate::monitor::{self, Event, Monitor};
use crate::{bridge, schedule, zoo};

/// What `tessera train` was asked to do beyond the config.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// A checkpoint directory (a step directory or the checkpoint root) to continue from.
    pub resume: Option<PathBuf>,
    /// Show the progress bar (off for tests and non-interactive runs).
    pub progress: bool,
}

/// What a finished run leaves behind.
#[derive(Debug)]
pub struct TrainOutcome {
    pub summary: Summary,
    pub output_dir: PathBuf,
}

/// Everything mutable across steps.
struct State {
    master: Vec<f32>,
    working: Vec<f32>,
    optim: OptimizerShard,
    scaler: Option<LossScaler>,
    sampler: Sampler,
    step: u64,
    /// Optimizer steps actually applied (the LR schedule's clock).
    applied: u64,
    skipped: u64,
}

/// Fixed per-run facts.
struct Plan {
    model: Model,
    precision: Precision16,
    micro: usize,
    seq_len: usize,
    /// Micro-batches per step (global batch / micro-batch; independent of world size).
    micro_batches: usize,
    flat: FlatLayout,
    decay: Vec<bool>,
    base_lr: f32,
}

fn build_plan(cfg: &Config, data: &Dataset) -> Result<Plan> {
    let mut mcfg = zoo::preset(&cfg.tessera.model).map_err(anyhow::Error::msg)?;
    mcfg.vocab_size = data.vocab_size;
    let seq_len = cfg.tessera.seq_len.unwrap_or(mcfg.max_seq_len);
    if seq_len == 0 || seq_len > mcfg.max_seq_len {
        bail!("tessera.seq_len = {seq_len} is out of range: the model `{}` takes 1..={}", cfg.tessera.model, mcfg.max_seq_len);
    }
    let mut model = Model::new(mcfg).map_err(anyhow::Error::msg)?;
    model.checkpoint_activations = cfg.activation_checkpointing;
    let flat = FlatLayout::new(model.layout().segments()).context("parameter layout")?;
    let micro_batches = cfg.train_batch_size / cfg.micro_batch_per_gpu;
    Ok(Plan {
        decay: model.layout().decay_flags(),
        precision: bridge::precision(&cfg.precision),
        micro: cfg.micro_batch_per_gpu,
        seq_len,
        micro_batches,
        flat,
        base_lr: bridge::base_lr(&cfg.optimizer),
        model,
    })
}

fn fresh_state(cfg: &Config, plan: &Plan, data: &Dataset) -> Result<State> {
    let master = plan.model.init_params(cfg.tessera.seed);
    let mut working = Vec::new();
    plan.precision.working_params(&master, &mut working);
    let kind = bridge::optimizer_kind(&cfg.optimizer);
    kind.validate().context("optimizer parameters")?;
    Ok(State {
        optim: OptimizerShard::new(kind, master.len()),
        master,
        working,
        scaler: bridge::loss_scaler(&cfg.precision)?,
        sampler: Sampler::new(data.train.clone(), plan.seq_len, cfg.tessera.seed).context("training data")?,
        step: 0,
        applied: 0,
        skipped: 0,
    })
}

/// Per-step results.
struct StepStats {
    loss: f64,
    grad_norm: f64,
    lr: f32,
    skipped: bool,
    /// Forward+backward, reduction and optimizer time, seconds.
    times_s: [f64; 3],
}

/// One step: every micro-batch's gradient, summed by the fixed tree; then the optimizer.
fn train_step(cfg: &Config, plan: &Plan, st: &mut State, ws: &mut Workspace, pool: &mut Vec<Vec<f32>>) -> Result<StepStats> {
    let (mb, t, m) = (plan.micro, plan.seq_len, plan.micro_batches);
    let scale = st.scaler.as_ref().map_or(1.0, LossScaler::scale);
    let dloss = scale / m as f32;
    let mut inputs = vec![0u32; mb * t];
    let mut targets = vec![0u32; mb * t];
    let mut tree = TreeSum::new();
    let mut loss_sum = 0.0f64;
    let t0 = Instant::now();
    for i in 0..m {
        st.sampler.fill(st.sampler.cursor() + (i * mb) as u64, mb, &mut inputs, &mut targets);
        let mut grads = pool.pop().unwrap_or_default();
        grads.clear();
        grads.resize(st.master.len(), 0.0);
        let mut acc = FlatAccess { params: &st.working, grads: &mut grads, units: plan.model.units() };
        loss_sum += f64::from(plan.model.forward_backward(&mut acc, &inputs, &targets, mb, t, dloss, ws));
        plan.precision.round(&mut grads);
        tree.push_leaf(grads).context("gradient tree")?;
    }
    st.sampler.advance((m * mb) as u64);
    let t1 = Instant::now();
    let mut grads = tree.finish().context("empty batch")?;
    let t2 = Instant::now();
    let lr = cfg.scheduler.as_ref().map_or(plan.base_lr, |s| schedule::lr_at(s, plan.base_lr, st.applied));
    let outcome = finish_grads(cfg, plan, st, &mut grads, scale)?;
    let skipped = matches!(outcome, GradOutcome::Overflow);
    let grad_norm = match outcome {
        GradOutcome::Ready(n) => n,
        GradOutcome::Overflow => f64::INFINITY,
    };
    if !skipped {
        let ctx = StepContext { shard_range: 0..st.master.len(), layout: &plan.flat, decay: &plan.decay };
        st.optim.step(&mut st.master, &grads, lr, &ctx, &mut LocalReduce).context("optimizer step")?;
        plan.precision.working_params(&st.master, &mut st.working);
        st.applied += 1;
    } else {
        st.skipped += 1;
    }
    pool.push(grads);
    st.step += 1;
    let t3 = Instant::now();
    let times_s = [(t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64(), (t3 - t2).as_secs_f64()];
    Ok(StepStats { loss: loss_sum / m as f64, grad_norm, lr, skipped, times_s })
}

enum GradOutcome {
    Ready(f64),
    Overflow,
}

/// Unscales (fp16), checks for overflow, measures the global norm and clips.
fn finish_grads(cfg: &Config, plan: &Plan, st: &mut State, grads: &mut [f32], scale: f32) -> Result<GradOutcome> {
    if let Some(scaler) = st.scaler.as_mut() {
        let overflow = tessera_kernels::optim::mixed::unscale_and_check(grads, 1.0 / scale);
        if let StepOutcome::SkippedOverflow { .. } = scaler.update(overflow).context("loss scaler")? {
            return Ok(GradOutcome::Overflow);
        }
    }
    let norm = global_grad_norm(&plan.flat, grads, 0..grads.len(), &mut LocalReduce).context("gradient norm")?;
    if let Some(coef) = clip_coefficient(norm, f64::from(cfg.gradient_clipping)) {
        grads.iter_mut().for_each(|g| *g *= coef);
    }
    Ok(GradOutcome::Ready(norm))
}

/// Mean validation loss over the fixed validation batches.
fn evaluate(plan: &Plan, params: &[f32], batches: &[data::TokenBatch], ws: &mut Workspace) -> f64 {
    let mut unused = Vec::new();
    let total: f64 = batches
        .iter()
        .map(|(x, y)| {
            let mut acc = FlatAccess { params, grads: &mut unused, units: plan.model.units() };
            f64::from(plan.model.loss(&mut acc, x, y, plan.micro, plan.seq_len, ws))
        })
        .sum();
    total / batches.len().max(1) as f64
}

fn progress_bar(cfg: &Config, enabled: bool) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(cfg.tessera.steps);
    let style = ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30.cyan/blue}] {msg} eta {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb
}

/// Runs a whole training job as the config says.
pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let started = Instant::now();
    let data_path = cfg.tessera.data.as_ref().map_or_else(data::default_corpus_path, PathBuf::from);
    let dataset = data::load(&data_path, cfg.tessera.tokenizer.as_deref().map(Path::new), data::DEFAULT_VAL_FRACTION)
        .with_context(|| format!("loading data from {}", data_path.display()))?;
    let plan = build_plan(cfg, &dataset)?;
    let out_dir = PathBuf::from(&cfg.tessera.output_dir);
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating output directory {}", out_dir.display()))?;
    let ckpt_root = out_dir.join("checkpoints");
    let mut st = match &opts.resume {
        Some(dir) => resume_state(cfg, &plan, &dataset, dir)?,
        None => fresh_state(cfg, &plan, &dataset)?,
    };
    let val =
        data::val_batches(&dataset.val, plan.seq_len, plan.micro, cfg.tessera.eval_iters.max(1) as usize).context("validation data")?;
    let mut monitors = bridge::monitors(cfg, &out_dir)?;
    let pb = progress_bar(cfg, opts.progress);
    pb.set_position(st.step);
    let mut ws = Workspace::default();
    let mut pool = Vec::new();
    let tokens_per_step = (plan.micro_batches * plan.micro * plan.seq_len) as u64;
    let initial_val = (st.step == 0).then(|| evaluate(&plan, &st.working, &val, &mut ws));
    let mut curve: (Vec<(u64, f64)>, Vec<(u64, f64)>) = (Vec::new(), Vec::new());
    if let Some(v) = initial_val {
        curve.1.push((0, v));
    }
    let (mut last_loss, mut last_val) = (f64::NAN, initial_val);
    let (mut train_s, mut steps_run, mut breakdown) = (0.0f64, 0u64, [0.0f64; 3]);
    let mut last_ckpt = None;
    pb.println(format!(
        "training {} ({:.2}M params) on {} | batch {} = {} micro-batches × {} × {} tokens | {} steps",
        cfg.tessera.model,
        plan.model.num_params() as f64 / 1e6,
        dataset.source,
        cfg.train_batch_size,
        plan.micro_batches,
        plan.micro,
        plan.seq_len,
        cfg.tessera.steps
    ));
    while st.step < cfg.tessera.steps {
        let t0 = Instant::now();
        let s = train_step(cfg, &plan, &mut st, &mut ws, &mut pool)?;
        train_s += t0.elapsed().as_secs_f64();
        steps_run += 1;
        breakdown.iter_mut().zip(s.times_s).for_each(|(a, b)| *a += b);
        last_loss = s.loss;
        curve.0.push((st.step, s.loss));
        let samples = st.step * (plan.micro_batches * plan.micro) as u64;
        let mut events =
            vec![Event::new("Train/Samples/train_loss", s.loss, samples), Event::new("Train/Samples/lr", f64::from(s.lr), samples)];
        if let Some(sc) = &st.scaler {
            events.push(Event::new("Train/Samples/loss_scale", f64::from(sc.scale()), samples));
        }
        let tps = (steps_run * tokens_per_step) as f64 / train_s.max(1e-9);
        pb.set_message(format!("loss {:.4} | {:.0} tok/s", s.loss, tps));
        pb.set_position(st.step);
        if cfg.steps_per_print > 0 && st.step % cfg.steps_per_print as u64 == 0 {
            pb.println(format!(
                "step {:>6} | loss {:.4} | lr {:.3e} | grad norm {:.3} | {:.0} tok/s{}",
                st.step,
                s.loss,
                s.lr,
                s.grad_norm,
                tps,
                if s.skipped { " | skipped (overflow)" } else { "" }
            ));
            if cfg.wall_clock_breakdown {
                let n = steps_run as f64;
                pb.println(format!(
                    "  time/step: fwd+bwd {:.1} ms | tree reduce {:.1} ms | optimizer {:.1} ms",
                    breakdown[0] / n * 1e3,
                    breakdown[1] / n * 1e3,
                    breakdown[2] / n * 1e3
                ));
            }
        }
        let eval_now = cfg.tessera.eval_interval > 0 && st.step % cfg.tessera.eval_interval == 0;
        if eval_now || st.step == cfg.tessera.steps {
            let v = evaluate(&plan, &st.working, &val, &mut ws);
            last_val = Some(v);
            curve.1.push((st.step, v));
            events.push(Event::new("Train/Samples/val_loss", v, samples));
            pb.println(format!("step {:>6} | val loss {v:.4}", st.step));
        }
        monitors.write(&events).context("writing monitors")?;
        let ckpt_now = cfg.tessera.checkpoint_interval > 0 && st.step % cfg.tessera.checkpoint_interval == 0;
        if ckpt_now || st.step == cfg.tessera.steps {
            last_ckpt = Some(save_checkpoint(cfg, &plan, &st, &ckpt_root)?);
        }
    }
    pb.finish_and_clear();
    monitors.flush().context("flushing monitors")?;
    let names: Vec<(&str, &[f32])> = plan.model.layout().specs().iter().map(|s| (s.name.as_str(), &st.master[s.range()])).collect();
    let summary = Summary {
        model: cfg.tessera.model.clone(),
        num_params: plan.model.num_params(),
        steps: st.step,
        skipped_steps: st.skipped,
        final_loss: last_loss,
        val_loss: last_val,
        initial_val_loss: initial_val,
        tokens: steps_run * tokens_per_step,
        tokens_per_s: (steps_run * tokens_per_step) as f64 / train_s.max(1e-9),
        wall_s: started.elapsed().as_secs_f64(),
        flops_per_token: plan.model.cfg.flops_per_token(plan.model.num_params(), plan.seq_len),
        params_blake3: checkpoint::params_blake3(&names),
        peak_rss_bytes: peak_rss_bytes(),
        world_size: cfg.world_size,
        zero_stage: cfg.zero.stage,
        precision: format!("{:?}", plan.precision).to_lowercase(),
        config_hash: cfg.hash.clone(),
        last_checkpoint: last_ckpt.map(|p: PathBuf| p.display().to_string()),
    };
    summary.write(&out_dir.join("summary.json")).context("writing summary.json")?;
    monitor::write_loss_curve_svg(&out_dir.join("loss.svg"), &[("train", &curve.0), ("val", &curve.1)]).context("writing loss.svg")?;
    Ok(TrainOutcome { summary, output_dir: out_dir })
}

const OPTIM_PREFIX: &str = "optim";

fn save_checkpoint(cfg: &Config, plan: &Plan, st: &State, root: &Path) -> Result<PathBuf> {
    let params = plan
        .model
        .layout()
        .specs()
        .iter()
        .map(|s| NamedTensor { name: s.name.clone(), shape: s.shape.clone(), data: st.master[s.range()].to_vec() })
        .collect();
    let optim = st
        .optim
        .state_buffers()
        .into_iter()
        .map(|(name, buf)| NamedTensor { name: format!("{OPTIM_PREFIX}.{name}"), shape: vec![buf.len()], data: buf.to_vec() })
        .collect();
    let state = CheckpointState {
        step: st.step,
        config_hash: cfg.hash.clone(),
        model: cfg.tessera.model.clone(),
        data_cursor: st.sampler.state().to_json(),
        rng: serde_json::json!({ "seed": cfg.tessera.seed }),
        extra: serde_json::json!({
            "optimizer_steps": st.optim.step_count(),
            "applied_steps": st.applied,
            "skipped_steps": st.skipped,
            "loss_scaler": st.scaler.as_ref().map(bridge::scaler_to_json),
        }),
        params,
        optim,
    };
    checkpoint::save(root, &state, cfg.tessera.keep_last as usize)
        .with_context(|| format!("saving checkpoint of step {} under {}", st.step, root.display()))
}

fn resume_state(cfg: &Config, plan: &Plan, data: &Dataset, dir: &Path) -> Result<State> {
    let resolved = checkpoint::resolve_resume(dir).with_context(|| format!("resuming from {}", dir.display()))?;
    for s in &resolved.skipped {
        eprintln!("warning: skipped checkpoint {}: {}", s.dir.display(), s.error);
    }
    let (path, ck) = (resolved.dir, resolved.state);
    if ck.model != cfg.tessera.model {
        bail!("checkpoint {} holds model `{}` but the config asks for `{}`", path.display(), ck.model, cfg.tessera.model);
    }
    let mut st = fresh_state(cfg, plan, data)?;
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
        st.master[spec.range()].copy_from_slice(&t.data);
    }
    plan.precision.working_params(&st.master, &mut st.working);
    let bufs: Vec<(&str, Vec<f32>)> =
        ck.optim.iter().filter_map(|t| t.name.strip_prefix(&format!("{OPTIM_PREFIX}.")).map(|n| (n, t.data.clone()))).collect();
    let extra = &ck.extra;
    let get = |k: &str| {
        extra
            .get(k)
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("checkpoint {}: manifest extra lacks `{k}`", path.display()))
    };
    st.optim.load_state(get("optimizer_steps")?, &bufs).with_context(|| format!("checkpoint {}: optimizer state", path.display()))?;
    st.applied = get("applied_steps")?;
    st.skipped = get("skipped_steps")?;
    if let (Some(sc), Some(v)) = (st.scaler.as_mut(), extra.get("loss_scaler")) {
        bridge::scaler_from_json(sc, v).with_context(|| format!("checkpoint {}: loss scaler state", path.display()))?;
    }
    let sampler_state = SamplerState::from_json(&ck.data_cursor).with_context(|| format!("checkpoint {}: data cursor", path.display()))?;
    st.sampler.restore(sampler_state);
    st.step = ck.step;
    Ok(st)
}
