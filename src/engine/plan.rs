//! The run's plan: the model, the batch geometry, the ZeRO partition of the flat buffer, the
//! assignment of micro-batch blocks to ranks and the ZeRO communication policy (reduce buckets,
//! stage-3 persistent units, how long gathered units stay live). Built once from the config;
//! shared read-only, so every rank takes the same decisions.

use std::ops::Range;

use anyhow::{bail, Context, Result};
use tessera_actors::plan::{assign_blocks, partition};
use tessera_kernels::model::Model;
use tessera_kernels::optim::{FlatLayout, OptimizerKind, NORM_BLOCK};

use super::experts::ExpertPlan;
use super::pipeline::PipePlan;
use super::precision::Precision16;
use crate::config::{ComputeDevice, Config, ZeroConfig};
use crate::data::{self, Dataset};
use crate::offload::{OffloadPlan, OffloadedBytes, ResidentBytes, Tier};
use crate::schedule::SchedulerConfig;
use crate::{bridge, zoo};

/// Fixed per-run facts, shared by every rank.
pub struct Plan {
    pub model: Model,
    /// Where the model came from: a preset, or a model folder (its config is what checkpoints
    /// record; its weights, when it has any, are the initial parameters).
    pub source: zoo::ModelSource,
    pub precision: Precision16,
    pub optimizer: OptimizerKind,
    pub micro: usize,
    pub seq_len: usize,
    /// Micro-batches per step (global batch / micro-batch; independent of world size).
    pub micro_batches: usize,
    pub flat: FlatLayout,
    pub decay: Vec<bool>,
    pub base_lr: f32,
    pub world: usize,
    pub stage: u8,
    /// ZeRO partition: rank r owns `ranges[r]` of the flat buffer (aligned to `NORM_BLOCK`).
    pub ranges: Vec<Range<usize>>,
    /// Rank r's micro-batch blocks `(first, level)`, aligned dyadic, in increasing order.
    pub blocks: Vec<Vec<(usize, u32)>>,
    /// Max global gradient norm (0 = no clipping).
    pub clip: f32,
    pub schedule: Option<SchedulerConfig>,
    /// Gradients move to their owners in all-to-alls of at most this many elements
    /// (`zero_optimization.reduce_bucket_size`).
    pub reduce_bucket_elems: usize,
    /// Per unit: kept whole by every rank and never gathered (stage 3 with several ranks, unit
    /// smaller than `stage3_param_persistence_threshold`). Its optimizer state stays partitioned.
    pub persistent: Vec<bool>,
    /// Whether a gathered unit 0 stays live for the whole step (else it is released whenever a
    /// block is gathered and gathered again at its next use), from `stage3_max_live_parameters`
    /// and `stage3_max_reuse_distance`.
    pub keep_unit0: bool,
    /// Where model states live (offload) and the per-rank device budget.
    pub offload: OffloadPlan,
    /// Collectives run on a communication thread beside the compute
    /// (`zero_optimization.overlap_comm`).
    pub overlap_comm: bool,
    /// Stage 3: elements of the units ahead of use that may be gathered in advance
    /// (`stage3_prefetch_bucket_size`; 0 = gather each unit when it is used).
    pub prefetch_elems: usize,
    /// Stage 3: bound on gathered elements live at once, prefetched ones included
    /// (`stage3_max_live_parameters`).
    pub max_live_elems: usize,
    /// Where ranks run their forward and backward (`tessera.device`, [`super::device`]).
    pub device: ComputeDevice,
    /// Expert parallelism (`tessera.moe.ep_size` > 1): which rank runs which experts.
    pub experts: Option<ExpertPlan>,
    /// Pipeline parallelism (`pipeline.stages` > 1): which rank runs which stage.
    pub pipeline: Option<PipePlan>,
}

/// `ranges` minus `cut` (both sorted, disjoint), in order.
pub fn subtract(ranges: &[Range<usize>], cut: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for r in ranges {
        let mut lo = r.start;
        for c in cut.iter().filter(|c| c.start < r.end && c.end > r.start) {
            if c.start > lo {
                out.push(lo..c.start);
            }
            lo = lo.max(c.end);
        }
        if lo < r.end {
            out.push(lo..r.end);
        }
    }
    out
}

/// The micro-batch blocks of a pipelined run: replica `d`'s (the plan's usual equal cut over
/// the replicas) held by its last stage's rank, which computes their losses; the other stages
/// run the same micro-batches and supply their gradients ([`PipePlan::suppliers`]).
fn pipeline_blocks(pp: &PipePlan, micro_batches: usize) -> Vec<Vec<(usize, u32)>> {
    let per_replica = assign_blocks(micro_batches, &vec![1.0; pp.replicas]);
    let mut blocks = vec![Vec::new(); pp.stages * pp.replicas];
    for (d, b) in per_replica.into_iter().enumerate() {
        blocks[pp.last_rank(d)] = b;
    }
    blocks
}

/// What a rank sends to the partition owners in one micro-batch slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSend {
    /// The micro-batch computed in this slot.
    pub leaf: usize,
    /// The aligned dyadic block `(first, level)` it belongs to.
    pub block: (usize, u32),
    /// Whether the values are the whole block's tree sum (stages 0–1, sent with the block's
    /// last micro-batch) or this one micro-batch's gradient (stages 2–3).
    pub block_sum: bool,
}

/// One use of a unit's parameters by `Model::forward_backward`, or the moment its gradients
/// are final (`UnitAccess::grads_ready`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitEvent {
    Use(usize),
    Ready(usize),
}

/// Where stage 3 keeps and releases units.
struct UnitPolicy {
    persistent: Vec<bool>,
    keep_unit0: bool,
}

fn unit_name(u: usize) -> String {
    if u == 0 {
        "unit 0 (embeddings, final norm and tied head)".to_string()
    } else {
        format!("unit {u} (transformer block {})", u - 1)
    }
}

fn to_elems(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Decides, from the plan alone, which units persist and whether unit 0 stays live.
/// Gathering happens only at stage 3 with several ranks; otherwise every unit is local.
fn unit_policy(units: &[Range<usize>], zero: &ZeroConfig, gathers: bool) -> Result<UnitPolicy> {
    let threshold = to_elems(zero.stage3_param_persistence_threshold);
    let persistent: Vec<bool> = units.iter().map(|u| gathers && u.len() < threshold).collect();
    if !gathers {
        return Ok(UnitPolicy { persistent, keep_unit0: true });
    }
    let max_live = to_elems(zero.stage3_max_live_parameters);
    for (u, range) in units.iter().enumerate() {
        if !persistent[u] && range.len() > max_live {
            bail!(
                "zero_optimization.stage3_max_live_parameters = {max_live} is smaller than {}, which has {n} parameters \
                 and is gathered whole at stage 3: raise the bound to at least {n}, or make the unit persistent \
                 (stage3_param_persistence_threshold > {n})",
                unit_name(u),
                n = range.len()
            );
        }
    }
    let gathered_blocks = || units.iter().zip(&persistent).skip(1).filter(|(_, p)| !**p).map(|(r, _)| r.len());
    // Between two uses of unit 0 (embeddings, then the head) every gathered block is fetched once.
    let reuse_distance: usize = gathered_blocks().sum();
    let fits = units[0].len() + gathered_blocks().max().unwrap_or(0) <= max_live;
    let keep_unit0 = persistent[0] || (fits && reuse_distance <= to_elems(zero.stage3_max_reuse_distance));
    Ok(UnitPolicy { persistent, keep_unit0 })
}

/// The most tokens in one micro-batch of one rank (`train_micro_batch_size_per_gpu` ×
/// `tessera.seq_len`): its token, activation and logit buffers are sized by it. A bound on
/// typos (16× the largest micro-batches trained in practice), not a memory budget.
pub const MICRO_BATCH_TOKENS_MAX: usize = 1 << 20;
/// The most micro-batches in one step (`train_batch_size` / `train_micro_batch_size_per_gpu`,
/// = gradient accumulation × world): the step's schedules and per-micro-batch records are
/// sized by it. A bound on typos.
pub const MICRO_BATCHES_PER_STEP_MAX: usize = 1 << 20;

/// Refuses batch settings past [`MICRO_BATCH_TOKENS_MAX`] or [`MICRO_BATCHES_PER_STEP_MAX`],
/// naming the keys, the values and the limit, before anything is sized by them.
/// The run's model (with its recomputation setting) and sequence length, as the config and
/// the data ask for them; what [`Plan::new`] builds on, and what the pipeline's `profile`
/// partition times.
pub(crate) fn model_of(cfg: &Config, data: &Dataset) -> Result<(Model, usize)> {
    model_source(cfg, data).map(|(_, m, t)| (m, t)).with_context(|| format!("config {}", cfg.source))
}

fn model_source(cfg: &Config, data: &Dataset) -> Result<(zoo::ModelSource, Model, usize)> {
    let source = zoo::resolve(&cfg.tessera.model).map_err(|e| anyhow::anyhow!("tessera.model: {e}"))?;
    let mut mcfg = source.config().clone();
    let folder_config = source.folder().map(|f| f.dir.join(crate::hf::CONFIG_FILE).display().to_string());
    match &folder_config {
        None => mcfg.vocab_size = data.vocab_size,
        Some(file) if data.vocab_size > mcfg.vocab_size => bail!(
            "{file}: key `vocab_size` = {}, but the data's tokens need {} ({}): use the folder's own tokenizer.json, whose ids fit",
            mcfg.vocab_size,
            data.vocab_size,
            cfg.tessera.tokenizer.as_deref().map_or("byte-level, with the end-of-text id".to_string(), |t| format!("tokenizer {t}"))
        ),
        Some(_) => {}
    }
    let seq_len = cfg.tessera.seq_len.unwrap_or(mcfg.max_seq_len);
    if seq_len == 0 || seq_len > mcfg.max_seq_len {
        let bound = match (&folder_config, source.folder()) {
            (Some(file), Some(f)) => format!(" ({file}: {})", f.config.family.context_keys()),
            _ => String::new(),
        };
        bail!("tessera.seq_len = {seq_len} is out of range: the model `{}` takes 1..={}{bound}", cfg.tessera.model, mcfg.max_seq_len);
    }
    if cfg.tessera.eval_iters > data::VAL_BATCHES_MAX {
        return Err(data::DataError::TooManyValBatches { found: cfg.tessera.eval_iters, max: data::VAL_BATCHES_MAX }.into());
    }
    check_batch_bounds(cfg, seq_len)?;
    if let Some(moe) = &cfg.tessera.moe {
        mcfg = moe.apply(&mcfg, &cfg.tessera.model)?;
    }
    if cfg.tessera.moe.as_ref().is_some_and(|m| m.ep_size > 1) && cfg.tessera.device == ComputeDevice::Cuda {
        bail!("tessera.moe.ep_size > 1 with tessera.device = \"cuda\": expert parallelism runs on CPU ranks; a GPU runs every expert (ep_size 1)");
    }
    let mut model = Model::new(mcfg).map_err(anyhow::Error::msg)?;
    model.checkpoint_activations = cfg.activation_checkpointing;
    Ok((source, model, seq_len))
}

fn check_batch_bounds(cfg: &Config, seq_len: usize) -> Result<()> {
    let micro = cfg.micro_batch_per_gpu;
    let tokens = micro.checked_mul(seq_len).filter(|t| *t <= MICRO_BATCH_TOKENS_MAX);
    if tokens.is_none() {
        bail!(
            "train_micro_batch_size_per_gpu = {micro} sequences of tessera.seq_len = {seq_len} tokens is more than the \
             {MICRO_BATCH_TOKENS_MAX} tokens a rank's micro-batch may hold (MICRO_BATCH_TOKENS_MAX): lower the micro-batch \
             and raise gradient_accumulation_steps"
        );
    }
    let micro_batches = cfg.train_batch_size / micro.max(1);
    if micro_batches > MICRO_BATCHES_PER_STEP_MAX {
        bail!(
            "train_batch_size = {} is {micro_batches} micro-batches per step (train_micro_batch_size_per_gpu = {micro}, \
             gradient_accumulation_steps = {} × world {}), more than {MICRO_BATCHES_PER_STEP_MAX} (MICRO_BATCHES_PER_STEP_MAX)",
            cfg.train_batch_size,
            cfg.gradient_accumulation_steps,
            cfg.world_size
        );
    }
    Ok(())
}

/// OneCycle's post-cycle momentum decay scales beta1 by a factor without bound: a run whose last
/// update's beta1 would leave [0, 1) is refused now rather than at that step (the optimizer
/// checks every step too). Inside the cycle beta1 stays between the two bounds, already checked,
/// and after it moves one way only, so the last update is the one to check.
fn check_momentum_decay(cfg: &Config, optimizer: &OptimizerKind) -> Result<()> {
    let Some(cycle) = crate::schedule::momentum_cycle(cfg.scheduler.as_ref()) else { return Ok(()) };
    if optimizer.betas_at(0).is_none() {
        return Ok(());
    }
    let last = cfg.tessera.steps.saturating_sub(1);
    let beta1 = cycle.beta1_at(last);
    if !(0.0..1.0).contains(&beta1) {
        bail!(
            "scheduler.params.decay_mom_rate = {} takes OneCycle's momentum (the optimizer's beta1) to {beta1} by step {}, \
             outside [0, 1): lower decay_mom_rate, raise decay_step_size, train fewer steps or set cycle_momentum to false",
            cycle.decay_mom_rate,
            last + 1
        );
    }
    Ok(())
}

impl Plan {
    /// The parameters a fresh run starts from: the model folder's weights, or (a preset, or a
    /// folder without weights) the seeded initialisation.
    pub fn initial_params(&self, seed: u64) -> Result<Vec<f32>> {
        match self.source.folder() {
            Some(f) if f.weights.is_some() => {
                let w = f.weights.as_ref().expect("checked above");
                Ok(crate::hf::read_params(w, f.config.family, &self.model)?)
            }
            _ => Ok(self.model.init_params(seed)),
        }
    }

    /// What a checkpoint records of the model beyond its name: the folder's config.json, so
    /// that the checkpoint alone rebuilds the model (`cli::model_from_checkpoint`).
    pub fn model_record(&self) -> serde_json::Value {
        self.source.folder().map_or(serde_json::Value::Null, |f| f.config.doc.clone())
    }

    /// What a checkpoint records of the model folder's tokenizer and generation settings
    /// (`extra.model_files`, which `tessera export` writes back byte for byte); `Null` for a
    /// preset. `tokenizer` is the run's `tessera.tokenizer`.
    pub fn model_files(&self, tokenizer: Option<&str>) -> serde_json::Value {
        self.source.folder().map_or(serde_json::Value::Null, |f| f.recorded_files(tokenizer))
    }

    /// The plan of `cfg` for its world size; an error names the config file and the key.
    pub fn new(cfg: &Config, data: &Dataset) -> Result<Plan> {
        Plan::build(cfg, data).with_context(|| format!("config {}", cfg.source))
    }

    fn build(cfg: &Config, data: &Dataset) -> Result<Plan> {
        let (source, model, seq_len) = model_source(cfg, data)?;
        let flat = FlatLayout::new(model.layout().segments()).context("parameter layout")?;
        let micro_batches = cfg.train_batch_size / cfg.micro_batch_per_gpu;
        let world = cfg.world_size.max(1);
        let optimizer = bridge::optimizer_kind(&cfg.optimizer, cfg.scheduler.as_ref());
        optimizer.validate().map_err(|e| bridge::keyed(e, "optimizer.params"))?;
        check_momentum_decay(cfg, &optimizer)?;
        // The loss scaler is built per rank later; its settings are checked here, with the file.
        bridge::loss_scaler(&cfg.precision)?;
        let stage = cfg.zero.stage;
        let policy = unit_policy(model.units(), &cfg.zero, stage == 3 && world > 1)?;
        let offload = OffloadPlan::new(cfg)?;
        if offload.param == Tier::Nvme && stage == 3 && world > 1 {
            let ranges = partition(model.num_params(), world, NORM_BLOCK);
            for (u, unit) in model.units().iter().enumerate().filter(|(u, _)| !policy.persistent[*u]) {
                let piece = ranges.iter().map(|r| r.end.min(unit.end).saturating_sub(r.start.max(unit.start))).max().unwrap_or(0);
                if piece > offload.param_buffer_elems {
                    bail!(
                        "zero_optimization.offload_param.buffer_size = {} is smaller than a rank's piece of {} ({piece} elements), \
                         which is read from NVMe into one buffer: raise it to at least {piece}",
                        offload.param_buffer_elems,
                        unit_name(u)
                    );
                }
            }
        }
        if cfg.tessera.device == ComputeDevice::Cuda {
            super::device::check_model(&model, cfg.micro_batch_per_gpu, seq_len)
                .map_err(|e| anyhow::anyhow!("tessera.device = \"cuda\": {e}"))?;
        }
        let pipeline = match cfg.pipeline.as_ref().filter(|p| p.stages > 1) {
            None => None,
            Some(p) => {
                if cfg.tessera.moe.as_ref().is_some_and(|m| m.ep_size > 1) {
                    bail!("pipeline.stages = {} with tessera.moe.ep_size > 1: expert parallelism inside pipeline stages is not built yet; use ep_size 1 (every stage runs its blocks' experts)", p.stages);
                }
                if cfg.tessera.device == ComputeDevice::Cuda {
                    bail!("pipeline.stages = {} with tessera.device = \"cuda\": pipeline stages run on CPU ranks so far", p.stages);
                }
                let plan = PipePlan::new(&model, p.stages, p.chunks, world, p.schedule, p.partition.clone())
                    .map_err(|e| anyhow::anyhow!("pipeline.stages = {}: {e}", p.stages))?;
                Some(plan)
            }
        };
        let blocks = match &pipeline {
            None => assign_blocks(micro_batches, &vec![1.0; world]),
            Some(pp) => pipeline_blocks(pp, micro_batches),
        };
        let plan = Plan {
            pipeline,
            source,
            device: cfg.tessera.device,
            decay: model.layout().decay_flags(),
            precision: bridge::precision(&cfg.precision),
            optimizer,
            micro: cfg.micro_batch_per_gpu,
            seq_len,
            micro_batches,
            ranges: partition(model.num_params(), world, NORM_BLOCK),
            blocks,
            flat,
            base_lr: cfg.optimizer.lr(),
            world,
            stage,
            clip: cfg.gradient_clipping,
            schedule: cfg.scheduler.clone(),
            reduce_bucket_elems: to_elems(cfg.zero.reduce_bucket_size),
            persistent: policy.persistent,
            keep_unit0: policy.keep_unit0,
            offload,
            overlap_comm: cfg.zero.overlap_comm,
            prefetch_elems: to_elems(cfg.zero.stage3_prefetch_bucket_size),
            max_live_elems: to_elems(cfg.zero.stage3_max_live_parameters),
            experts: match cfg.tessera.moe.as_ref().map_or(1, |m| m.ep_size) {
                1 => None,
                ep => Some(ExpertPlan::new(&model, ep, world).map_err(anyhow::Error::msg)?),
            },
            model,
        };
        for r in 0..plan.world {
            plan.offload.check_budget(r, plan.resident_bytes(r), plan.model_state_bytes(r))?;
        }
        let buffers = 1 + plan.optimizer.state_names().len();
        plan.offload.check_space((0..plan.world).map(|r| plan.offload.swap_bytes(plan.optim_range(r).len(), buffers)).sum())?;
        let es = plan.precision.dtype().size_bytes() as u64;
        let block = plan.offload.aio.block as u64;
        plan.offload.check_param_space((0..plan.world).map(|r| (plan.ranges[r].len() as u64 * es).div_ceil(block).max(1) * block).sum())?;
        Ok(plan)
    }

    /// Bytes of each kind of model state rank `r` holds, wherever they live (`RankState::memory`
    /// counts the same, less what is offloaded).
    pub fn model_state_bytes(&self, r: usize) -> ResidentBytes {
        let d = self.precision.dtype().size_bytes() as u64;
        let held = |ranges: &[Range<usize>]| ranges.iter().map(|x| x.len() as u64).sum::<u64>();
        let grads = if self.stage <= 1 { self.total() } else { self.ranges[r].len() };
        let buffers = 1 + self.optimizer.state_names().len() as u64;
        ResidentBytes {
            params: held(&self.param_ranges(r)) * d,
            grads: grads as u64 * d,
            optim: self.optim_range(r).len() as u64 * 4 * buffers,
        }
    }

    /// Bytes of rank `r`'s parameter shard that `offload_param` moves out (stage 3).
    fn offloaded_param_bytes(&self, r: usize) -> u64 {
        if self.stage == 3 && self.offload.param != Tier::Device {
            self.ranges[r].len() as u64 * self.precision.dtype().size_bytes() as u64
        } else {
            0
        }
    }

    /// With `offload_param.device = nvme`: the flat ranges of rank `r`'s stage-3 shard kept in
    /// its swap file — the shard less the persistent units (held whole in memory by every rank)
    /// and less its first `offload_param.max_in_cpu` elements (kept in host memory). Empty
    /// otherwise.
    pub fn param_swap_ranges(&self, r: usize) -> Vec<Range<usize>> {
        if self.offload.param != Tier::Nvme || self.stage != 3 {
            return Vec::new();
        }
        let persistent: Vec<Range<usize>> =
            self.model.units().iter().zip(&self.persistent).filter(|(_, p)| **p).map(|(u, _)| u.clone()).collect();
        let mut swapped = subtract(std::slice::from_ref(&self.ranges[r]), &persistent);
        let mut keep = self.offload.param_max_in_cpu;
        while keep > 0 && !swapped.is_empty() {
            let first = swapped[0].clone();
            if first.len() <= keep {
                keep -= first.len();
                swapped.remove(0);
            } else {
                swapped[0] = first.start + keep..first.end;
                keep = 0;
            }
        }
        swapped
    }

    /// What rank `r` keeps resident: its model states less what is offloaded.
    pub fn resident_bytes(&self, r: usize) -> ResidentBytes {
        let all = self.model_state_bytes(r);
        ResidentBytes {
            params: all.params - self.offloaded_param_bytes(r),
            grads: all.grads,
            optim: all.optim - self.offloaded_optim_bytes(r),
        }
    }

    /// Bytes of rank `r`'s fp32 masters and optimizer moments out of its budget: all of them
    /// on NVMe, the first `offload_optimizer.ratio` of its shard (whole elements) in the host
    /// tier, none on the device.
    pub fn offloaded_optim_bytes(&self, r: usize) -> u64 {
        let buffers = 1 + self.optimizer.state_names().len() as u64;
        let elems = self.optim_range(r).len() as u64;
        match self.offload.optimizer {
            Tier::Device => 0,
            Tier::Nvme => elems * 4 * buffers,
            Tier::Host => (elems as f64 * self.offload.optimizer_ratio).floor() as u64 * 4 * buffers,
        }
    }

    /// What rank `r` keeps outside its device budget, by tier.
    pub fn offloaded_bytes(&self, r: usize) -> OffloadedBytes {
        let mut out = OffloadedBytes { rank: r, host: 0, nvme: 0 };
        let optim = self.offloaded_optim_bytes(r);
        match self.offload.optimizer {
            Tier::Device => {}
            Tier::Host => out.host += optim,
            Tier::Nvme => out.nvme += optim,
        }
        let swapped = self.param_swap_ranges(r).iter().map(|x| x.len() as u64).sum::<u64>() * self.precision.dtype().size_bytes() as u64;
        let swapped = swapped.min(self.offloaded_param_bytes(r));
        out.nvme += swapped;
        out.host += self.offloaded_param_bytes(r) - swapped;
        out
    }

    pub fn total(&self) -> usize {
        self.model.num_params()
    }

    /// The range of the flat buffer whose fp32 master and optimizer state rank `r` holds.
    pub fn optim_range(&self, r: usize) -> Range<usize> {
        if self.stage == 0 {
            0..self.total()
        } else {
            self.ranges[r].clone()
        }
    }

    /// Whether stage-3 ranks gather units from each other's shards.
    pub fn gathers(&self) -> bool {
        self.stage == 3 && self.world > 1
    }

    /// The flat ranges whose working parameters rank `r` holds, sorted and disjoint: the whole
    /// buffer (stages 0–2), or its shard plus every persistent unit (stage 3).
    pub fn param_ranges(&self, r: usize) -> Vec<Range<usize>> {
        if self.stage < 3 {
            return std::iter::once(0..self.total()).collect();
        }
        let units = self.model.units().iter().zip(&self.persistent).filter(|(_, p)| **p).map(|(u, _)| u.clone());
        let mut all: Vec<Range<usize>> = std::iter::once(self.ranges[r].clone()).chain(units).filter(|x| !x.is_empty()).collect();
        all.sort_by_key(|x| x.start);
        let mut merged: Vec<Range<usize>> = Vec::new();
        for x in all {
            match merged.last_mut() {
                Some(last) if x.start <= last.end => last.end = last.end.max(x.end),
                _ => merged.push(x),
            }
        }
        merged
    }

    /// The successive ranges of the flat buffer that one gradient all-to-all moves: fixed
    /// buckets of `reduce_bucket_elems`, or with 0 one per parameter tensor (DeepSpeed's
    /// `reduce_bucket_size: 0` flushes its bucket before every parameter, so each parameter's
    /// gradient is reduced on its own). The bits are the same either way.
    pub fn reduce_buckets(&self) -> Vec<Range<usize>> {
        let (total, b) = (self.total(), self.reduce_bucket_elems);
        match b {
            0 => self.flat.segments().iter().filter(|s| !s.is_empty()).cloned().collect(),
            b => (0..total.div_ceil(b)).map(|k| k * b..((k + 1) * b).min(total)).collect(),
        }
    }

    /// This plan with rank `r`'s micro-batch blocks `blocks[r]`, checked to be the aligned cut
    /// of contiguous runs covering every micro-batch in rank order (so the bits stay the same).
    /// A pipelined plan keeps its blocks (every stage of a replica runs the same micro-batches).
    pub fn with_blocks(mut self, blocks: Vec<Vec<(usize, u32)>>) -> Result<Plan, String> {
        if self.pipeline.is_some() {
            return Err("a pipelined run keeps its micro-batch blocks (speed-weighted blocks would split a pipeline)".into());
        }
        tessera_actors::check_blocks(self.micro_batches, self.world, &blocks)?;
        self.blocks = blocks;
        Ok(self)
    }

    /// Micro-batches per rank.
    pub fn counts(&self) -> Vec<usize> {
        (0..self.world).map(|r| self.leaves(r).len()).collect()
    }

    /// Leaves (micro-batch indices) of rank `r`, in order.
    pub fn leaves(&self, r: usize) -> Vec<usize> {
        self.blocks[r].iter().flat_map(|&(first, level)| first..(first + (1 << level)).min(self.micro_batches)).collect()
    }

    /// The most leaves any rank has: ZeRO-3 ranks run this many slots in lockstep.
    pub fn max_leaves(&self) -> usize {
        (0..self.world).map(|r| self.leaves(r).len()).max().unwrap_or(0)
    }

    /// Micro-batch slots of a step: every rank runs this many in lockstep (a rank with fewer
    /// micro-batches replays the communication of the missing ones without computing).
    pub fn slots(&self) -> usize {
        self.max_leaves()
    }

    /// Whether gradients travel to their owners once per micro-batch (stages 2–3, as
    /// DeepSpeed's ZeRO-2 reduces at every micro-step: no full-length gradient is kept) or
    /// once per block as the block's tree sum (stages 0–1, whose gradients are full-length).
    ///
    /// Pipelined runs send block sums at every stage: a stage's gradients reach their owners
    /// after the step's schedule, the exchange being one of the whole world.
    pub fn reduces_per_micro_batch(&self) -> bool {
        self.stage >= 2 && self.pipeline.is_none()
    }

    /// What rank `r` sends in slot `s`, if anything.
    pub fn slot_send(&self, r: usize, s: usize) -> Option<SlotSend> {
        let leaf = *self.leaves(r).get(s)?;
        let block = *self.blocks[r].iter().find(|&&(first, level)| first <= leaf && leaf < first + (1 << level))?;
        let last = (block.0 + (1 << block.1)).min(self.micro_batches) - 1;
        let block_sum = !self.reduces_per_micro_batch();
        (!block_sum || leaf == last).then_some(SlotSend { leaf, block, block_sum })
    }

    /// Who supplies rank `q`'s micro-batch values over flat `range` in the gradient exchange,
    /// cut where the supplier changes: `q` itself, or with expert parallelism the member of its
    /// group that ran the experts there ([`ExpertPlan::suppliers`]).
    pub fn suppliers(&self, q: usize, range: Range<usize>) -> Vec<(Range<usize>, usize)> {
        match (&self.experts, &self.pipeline) {
            _ if range.is_empty() => Vec::new(),
            (_, Some(pp)) => pp.suppliers(q, range),
            (None, None) => vec![(range, q)],
            (Some(ep), None) => ep.suppliers(q, range),
        }
    }

    /// Whether any rank computes a micro-batch in slot `s`: with expert parallelism every rank
    /// takes part in such a slot (it runs its experts on the others' tokens).
    pub fn slot_computes(&self, s: usize) -> bool {
        (0..self.world).any(|r| self.leaves(r).len() > s)
    }

    /// Whether any rank sends gradients in slot `s` (else the slot has no gradient traffic).
    pub fn slot_active(&self, s: usize) -> bool {
        (0..self.world).any(|r| self.slot_send(r, s).is_some())
    }

    /// The unit events of one `Model::forward_backward`, in order: the embeddings and every
    /// block forward, the head (unit 0 again; forward and backward), every block backward, the
    /// embeddings backward. `zero::tests` checks it against the model's real calls.
    pub fn micro_batch_events(&self) -> Vec<UnitEvent> {
        let l = self.model.units().len() - 1;
        let mut ev: Vec<UnitEvent> = (0..=l).map(UnitEvent::Use).collect();
        ev.push(UnitEvent::Use(0));
        for u in (1..=l).rev() {
            ev.extend([UnitEvent::Use(u), UnitEvent::Ready(u)]);
        }
        ev.extend([UnitEvent::Use(0), UnitEvent::Ready(0)]);
        ev
    }

    /// First sample index of micro-batch `i` of step `step`: batches depend on nothing else.
    pub fn first_sample(&self, step: u64, i: usize) -> u64 {
        (step * self.micro_batches as u64 + i as u64) * self.micro as u64
    }

    /// The learning rate of update number `applied + 1` (the schedule's clock counts applied,
    /// not skipped, steps).
    pub fn lr_at(&self, applied: u64) -> f32 {
        self.schedule.as_ref().map_or(self.base_lr, |s| crate::schedule::lr_at(s, self.base_lr, applied))
    }

    pub fn tokens_per_step(&self) -> u64 {
        (self.micro_batches * self.micro * self.seq_len) as u64
    }
}
