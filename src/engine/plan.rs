//! The run's plan: the model, the batch geometry, the ZeRO partition of the flat buffer and the
//! assignment of micro-batch blocks to ranks. Built once from the config; shared read-only.

use std::ops::Range;

use anyhow::{bail, Context, Result};
use tessera_actors::plan::{assign_blocks, partition};
use tessera_kernels::model::Model;
use tessera_kernels::optim::{FlatLayout, OptimizerKind, NORM_BLOCK};

use super::precision::Precision16;
use crate::config::Config;
use crate::data::Dataset;
use crate::schedule::SchedulerConfig;
use crate::{bridge, zoo};

/// Fixed per-run facts, shared by every rank.
pub struct Plan {
    pub model: Model,
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
}

impl Plan {
    pub fn new(cfg: &Config, data: &Dataset) -> Result<Plan> {
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
        let world = cfg.world_size.max(1);
        let optimizer = bridge::optimizer_kind(&cfg.optimizer);
        optimizer.validate().context("optimizer parameters")?;
        let stage = cfg.zero.stage;
        Ok(Plan {
            decay: model.layout().decay_flags(),
            precision: bridge::precision(&cfg.precision),
            optimizer,
            micro: cfg.micro_batch_per_gpu,
            seq_len,
            micro_batches,
            ranges: partition(model.num_params(), world, NORM_BLOCK),
            blocks: assign_blocks(micro_batches, &vec![1.0; world]),
            flat,
            base_lr: bridge::base_lr(&cfg.optimizer),
            world,
            stage,
            clip: cfg.gradient_clipping,
            schedule: cfg.scheduler.clone(),
            model,
        })
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

    /// Leaves (micro-batch indices) of rank `r`, in order.
    pub fn leaves(&self, r: usize) -> Vec<usize> {
        self.blocks[r].iter().flat_map(|&(first, level)| first..(first + (1 << level)).min(self.micro_batches)).collect()
    }

    /// The most leaves any rank has: ZeRO-3 ranks run this many slots in lockstep.
    pub fn max_leaves(&self) -> usize {
        (0..self.world).map(|r| self.leaves(r).len()).max().unwrap_or(0)
    }

    /// First sample index of micro-batch `i` of step `step`: batches depend on nothing else.
    pub fn first_sample(&self, step: u64, i: usize) -> u64 {
        (step * self.micro_batches as u64 + i as u64) * self.micro as u64
    }

    pub fn tokens_per_step(&self) -> u64 {
        (self.micro_batches * self.micro * self.seq_len) as u64
    }
}
