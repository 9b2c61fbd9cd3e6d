//! `tessera train --device cuda` with NCCL (`tessera.gpu.collective = "nccl"`, the default):
//! the engine's step loop ([`crate::engine`]) over GPU ranks ([`super::compute`], each a
//! [`super::zero::Rank`], NCCL between them), with the same config semantics. This file holds
//! what such a run needs besides the loop: the refusals of what the GPU ranks do not implement,
//! the config the engine's plan is built from, and the ranks' options, checked against the
//! device budget before any GPU is touched.
//!
//! What is shared with the CPU path, so a GPU run and a CPU run of one config see the same
//! numbers wherever the hardware allows:
//! - the model preset with the data's vocabulary, `tessera.seq_len`, the batch triple
//!   (`train_batch_size` / `train_micro_batch_size_per_gpu` → `M` micro-batches per step, rank
//!   `r` of `N` takes the aligned block `r·M/N .. (r+1)·M/N`), via [`Plan`];
//! - the data sampler: global micro-batch `i` of step `s` holds the same tokens as on the CPU;
//! - the LR schedule ([`crate::schedule::lr_at`] on the applied-step clock) and OneCycle's
//!   momentum cycle (the betas of each step), the optimizer (`optimizer.type`: Adam/AdamW with
//!   or without bias correction, SGD, Lion, Adagrad — the CPU optimizer's own scalars on
//!   elementwise GPU kernels, `tessera_kernels::cuda::optim`; LAMB, `cuda::lamb`), `gradient_clipping`,
//!   `zero_optimization.stage`, `tessera.steps`, evaluation on the same validation batches
//!   (`tessera.eval_interval`, `eval_iters`), the monitors, `loss.svg`, `summary.json` (the
//!   keys that apply, plus the device figures) and checkpoints in the CPU format: fp32 masters
//!   as the parameters and the optimizer state as `optim.exp_avg` / `optim.exp_avg_sq` (or
//!   `optim.momentum_buffer`) in the CPU
//!   layout, so `generate`, `export` and `--resume` work across devices both ways.
//!
//! What differs: parameters and activations are bf16 (fp32 masters and moments), whatever the
//! precision section says (with fp16 the gradients are stored in fp16 under the loss scaler); ZeRO's bucket and stage-3 tuning keys have no
//! effect (the GPU reduces and gathers unit by unit). Activation checkpointing (the
//! `activation_checkpointing` section or `tessera.activation_checkpointing`) keeps each block's
//! input only and recomputes its activations in the backward, with the same bits.
//!
//! Ranks: one thread per GPU of this host, in the driver process (NCCL's one-thread-per-rank
//! mode); `--nprocs N` (or `--world N`) asks for N GPUs. Stop requests (SIGTERM, SIGINT,
//! SIGHUP, SIGUSR1: `crate::signals`) stop the run after a step with a checkpoint, as on the
//! CPU. GPU ranks in worker processes or on other hosts are the engine's own GPU ranks
//! (`tessera.gpu.collective = "quic"`, `crate::engine::device`).

use anyhow::{bail, Result};
use tessera_kernels::cuda::gpt;
use tessera_kernels::model::Arch;
use tessera_kernels::optim::OptimizerKind;

use super::compute::GpuRankOptions;
use super::offload;
use super::param_offload::ParamOffloadOptions;
use super::zero::{self, OffloadOptions, OffloadPlanned, Optimizer, StateBytes};
use crate::config::{Config, OffloadDevice, OptimizerConfig, Precision};
use crate::engine::Plan;
use crate::zoo;

/// Whether `cfg` trains on NCCL GPU ranks.
pub fn nccl_run(cfg: &Config) -> bool {
    cfg.tessera.device == crate::config::ComputeDevice::Cuda && cfg.tessera.gpu_collective == crate::config::GpuCollective::Nccl
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
    if cfg.tessera.moe.as_ref().is_some_and(|m| m.ep_size > 1) {
        bail!("tessera.moe.ep_size > 1 on NCCL GPU ranks: expert parallelism runs on CPU ranks; each GPU runs every expert (ep_size 1)");
    }
    let mut notes = Vec::new();
    match cfg.precision {
        Precision::Fp16(_) => {
            notes.push(
                "fp16.enabled: `--device cuda` keeps bf16 parameters and activations (its model kernels are bf16) and stores \
                 each micro-batch's gradient in fp16 under the loss scaler (DeepSpeed's dynamic scaler, the CPU path's): \
                 overflowing steps are skipped and the scale adapts as on the CPU"
                    .to_string(),
            );
        }
        Precision::F32 => notes.push(
            "no bf16/fp16 section (fp32 on the CPU path): `--device cuda` trains with bf16 parameters and activations and \
             fp32 masters, as bf16.enabled=true does"
                .to_string(),
        ),
        Precision::Bf16 => {}
    }
    let lamb = matches!(cfg.optimizer, OptimizerConfig::Lamb { .. });
    zero::refuse_split_lamb(lamb, cfg.zero.stage, cfg.world_size)?;
    check_offload(cfg)?;
    if cfg.zero.offload_optimizer.as_ref().is_some_and(|o| o.device == OffloadDevice::Nvme) {
        let swap_keys = [
            "zero_optimization.offload_optimizer.pipeline_read",
            "zero_optimization.offload_optimizer.pipeline_write",
            "zero_optimization.sub_group_size",
        ];
        for key in cfg.present_keys.iter().filter(|k| swap_keys.contains(&k.as_str())) {
            notes.push(format!(
                "`{key}` has no effect with `--device cuda`: its NVMe offload swaps unit by unit, always reading the next unit ahead \
                 and writing the last one behind the host step"
            ));
        }
    }
    if cfg.present_keys.iter().any(|k| k == "zero_optimization.offload_param.pin_memory") {
        notes.push(
            "`zero_optimization.offload_param.pin_memory` has no effect with `--device cuda`: the GPU ranks' host parameter shard \
             is always page-locked (its copies run beside the compute)"
                .into(),
        );
    }
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

/// Refuses a model the GPU kernels cannot run: GPT-2 heads other than 64 wide (the attention
/// kernel's), LLaMA-family heads other than 64 or 128 (the grouped-query kernels').
fn check_model(name: &str) -> Result<()> {
    let m = zoo::resolve(name).map_err(|e| anyhow::anyhow!("tessera.model: {e}"))?.config().clone();
    let hd = m.d_model.checked_div(m.n_head).unwrap_or(0);
    if m.arch == Arch::Llama && !tessera_kernels::cuda::llama::attention::HEAD_DIMS.contains(&hd) {
        bail!(
            "tessera.model = \"{name}\" has head dimension {hd} (d_model {} / n_head {}); the GPU grouped-query attention \
             kernels run head dimensions 64 and 128: use --device cpu",
            m.d_model,
            m.n_head
        );
    }
    if m.arch == Arch::Gpt && (m.n_head == 0 || m.d_model % m.n_head != 0 || hd != 64) {
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

/// Refuses an offload the GPU trainer cannot do: the optimizer at ZeRO stage 0, with LAMB on NVMe
/// or partly (its host step needs every tensor in host memory), by a share outside 0..=1 (NVMe: other than 1),
/// or NVMe parameters with a partial optimizer share. An NVMe `nvme_path` is checked where the swap site is made ([`nvme_site`]).
fn check_offload(cfg: &Config) -> Result<()> {
    if let Some(o) = cfg.zero.offload_optimizer.as_ref().filter(|o| o.device != OffloadDevice::None) {
        if cfg.zero.stage == 0 {
            bail!(
                "zero_optimization.offload_optimizer.device = \"{}\" needs ZeRO stage 1, 2 or 3 (the optimizer shard moves to the \
                 host); this run has zero_optimization.stage = 0: set a stage, or use --device cpu",
                offload_name(o.device)
            );
        }
        let lamb = matches!(cfg.optimizer, OptimizerConfig::Lamb { .. });
        zero::refuse_partial_lamb_offload(lamb, f64::from(o.ratio), o.device == OffloadDevice::Nvme)?;
        if !(0.0..=1.0).contains(&o.ratio) {
            bail!(
                "zero_optimization.offload_optimizer.ratio = {}: expected the share of the optimizer to offload, from 0 to 1 \
                 (or use --device cpu)",
                o.ratio
            );
        }
        if o.device == OffloadDevice::Nvme && o.ratio < 1.0 {
            bail!(
                "zero_optimization.offload_optimizer.ratio = {} with device = \"nvme\": the swap files hold the whole optimizer \
                 shard; use 1.0, device = \"cpu\" for a partial offload to host memory, or --device cpu",
                o.ratio
            );
        }
    }
    if let Some(p) = cfg.zero.offload_param.as_ref().filter(|o| o.device == OffloadDevice::Nvme) {
        let o = cfg.zero.offload_optimizer.as_ref().filter(|o| o.device != OffloadDevice::None);
        if let Some(o) = o.filter(|o| o.ratio > 0.0 && o.ratio < 1.0) {
            bail!(
                "zero_optimization.offload_param.device = \"{}\" with zero_optimization.offload_optimizer.ratio = {}: on the GPU a \
                 parameter piece on NVMe is written whole, by the host or by the GPU optimizer; use ratio 1, \
                 offload_param.device = \"cpu\", or --device cpu",
                offload_name(p.device),
                o.ratio
            );
        }
    }
    Ok(())
}

/// `offload_param` (stage 3; `OffloadPlan::new` refuses other stages and checks `nvme_path`): the
/// tier of each rank's bf16 shard and its read-ahead bounds.
fn param_offload_options(cfg: &Config) -> Result<Option<ParamOffloadOptions>> {
    let plan = crate::offload::OffloadPlan::new(cfg)?;
    let nvme = match plan.param {
        crate::offload::Tier::Device => return Ok(None),
        crate::offload::Tier::Host => None,
        crate::offload::Tier::Nvme => Some(offload::NvmeSite { dir: plan.param_dir.clone().unwrap_or_default(), aio: plan.aio.clone() }),
    };
    Ok(Some(ParamOffloadOptions {
        nvme,
        max_in_cpu: plan.param_max_in_cpu,
        buffer_count: plan.param_buffer_count,
        buffer_elems: plan.param_buffer_elems,
    }))
}

/// ZeRO tuning keys the CPU engine honours and the GPU path does not read.
const GPU_IGNORED_KEYS: &[&str] = &[
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_prefetch_bucket_size",
];

/// The config the engine's plan of an NCCL GPU run is built from (bf16 where the config says
/// fp16: the ranks keep the loss scaler themselves): the budget and the offload
/// share are checked with the GPU's own counts ([`rank_options`]), not the CPU plan's (CPU
/// layout and dtypes), and the ZeRO tuning keys the GPU does not read (`GPU_IGNORED_KEYS`)
/// take DeepSpeed's defaults, so they cannot refuse the run through the CPU plan either.
pub fn plan_config(cfg: &Config) -> Config {
    let mut cpu_cfg = cfg.clone();
    cpu_cfg.tessera.device_memory_bytes_max = None;
    // fp16 on NCCL GPU ranks is theirs (fp16 gradients, the ranks' loss scaler: rank_options);
    // the plan, which refuses fp16 for the engine's staged GPU ranks, sees their bf16 compute.
    if let Precision::Fp16(_) = cpu_cfg.precision {
        cpu_cfg.precision = Precision::Bf16;
    }
    if let Some(o) = cpu_cfg.zero.offload_optimizer.as_mut() {
        o.ratio = 1.0;
    }
    let (z, d) = (&mut cpu_cfg.zero, crate::config::ZeroConfig::deepspeed_defaults());
    (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) = (d.reduce_bucket_size, d.stage3_prefetch_bucket_size);
    (z.stage3_param_persistence_threshold, z.stage3_max_live_parameters, z.stage3_max_reuse_distance) =
        (d.stage3_param_persistence_threshold, d.stage3_max_live_parameters, d.stage3_max_reuse_distance);
    cpu_cfg
}

/// The GPU ranks' options for `plan` (built from [`plan_config`]) as `cfg` (the user's config)
/// asks, with the batch split and the device budget checked. `abandons`: the run abandons steps
/// (`--abandon-step`), which optimizer offload cannot (its update overlaps the backward).
pub fn rank_options(cfg: &Config, plan: &Plan, abandons: bool) -> Result<GpuRankOptions> {
    let world = plan.world.max(1);
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
    if abandons && offload.is_some() {
        bail!(
            "--abandon-step with zero_optimization.offload_optimizer on the GPU: the host optimizer steps each unit during the \
             backward, so a prepared step cannot be abandoned; drop one of them, or use --device cpu"
        );
    }
    let m_local = plan.micro_batches / world;
    zero::refuse_split_lamb(matches!(plan.optimizer, OptimizerKind::Lamb(_)), plan.stage, world)?;
    let optim = Optimizer { kind: plan.optimizer, clip: plan.clip };
    let n = optim.states();
    let nvme = nvme_site(cfg)?;
    let params_offload = param_offload_options(cfg)?;
    let block = nvme.as_ref().map(|s| s.aio.block);
    let off = OffloadPlanned { ratio: offload.map(|o| o.ratio), nvme_block: block, params: params_offload.as_ref() };
    let states = zero::planned_state_bytes(&plan.model, plan.stage, world, m_local, n, off)?;
    let full = zero::planned_state_bytes(&plan.model, plan.stage, world, m_local, n, OffloadPlanned::default())?.device;
    check_gpu_budget(cfg, &states, offload, params_offload.is_some(), full)?;
    if nvme.is_some() {
        crate::offload::OffloadPlan::new(cfg)?.check_space(states.nvme * world as u64)?;
    }
    if params_offload.as_ref().is_some_and(|p| p.nvme.is_some()) {
        crate::offload::OffloadPlan::new(cfg)?.check_param_space(states.nvme_params * world as u64)?;
    }
    let scaler = crate::bridge::loss_scaler(&cfg.precision)?;
    Ok(GpuRankOptions {
        optim,
        scaler,
        budget: cfg.tessera.device_memory_bytes_max,
        offload,
        nvme,
        params_offload,
        recompute: cfg.activation_checkpointing,
        overlap: plan.overlap_comm,
        states,
        abandons,
    })
}

/// `offload_optimizer.device = "cpu"` or `"nvme"`: the share offloaded and the host threads
/// per rank.
fn offload_options(cfg: &Config) -> Option<OffloadOptions> {
    let o = cfg.zero.offload_optimizer.as_ref().filter(|o| o.device != OffloadDevice::None)?;
    Some(OffloadOptions { ratio: f64::from(o.ratio), threads: offload::default_threads(cfg.world_size) })
}

/// `offload_optimizer.device = "nvme"`: the swap files' directory (`nvme_path`, checked to be an
/// existing writable directory) and the `aio` section's options, as the CPU ranks take them.
fn nvme_site(cfg: &Config) -> Result<Option<offload::NvmeSite>> {
    let plan = crate::offload::OffloadPlan::new(cfg)?;
    Ok(plan.optimizer_dir.filter(|_| plan.optimizer == crate::offload::Tier::Nvme).map(|dir| offload::NvmeSite { dir, aio: plan.aio }))
}

/// `tessera.device_memory_bytes_max` against what a GPU rank holds (the same check and message
/// as the CPU path's, with the GPU's counts: bf16 parameters and stage 3's gather buffers, f32
/// gradient buffers of the micro-batch tree and the reduced shard, fp32 masters, moments and
/// decay mask of the pieces not offloaded).
fn check_gpu_budget(
    cfg: &Config,
    states: &StateBytes,
    offload: Option<OffloadOptions>,
    params_offloaded: bool,
    full: crate::offload::ResidentBytes,
) -> Result<()> {
    let Some(max) = cfg.tessera.device_memory_bytes_max else { return Ok(()) };
    let full_optim = full.optim;
    let params_hint = match (cfg.zero.stage, params_offloaded) {
        (3, false) => format!(
            "; zero_optimization.offload_param.device = \"cpu\" moves the bf16 parameter shard ({} bytes with the gather buffers) \
             to host memory",
            full.params
        ),
        _ => String::new(),
    };
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
    crate::offload::check_resident("each GPU rank", states.device, max, &format!("{hint}{params_hint}"))
}
