//! Typed DeepSpeed sections other than optimizer/scheduler: ZeRO (with offload), precision
//! (fp16 loss scaling, bf16), activation checkpointing, monitors, aio and the `tessera`
//! section, each with DeepSpeed's defaults.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::reader::Obj;

/// Where ZeRO offloads tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadDevice {
    None,
    Cpu,
    Nvme,
}

/// `zero_optimization.offload_optimizer`.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadOptimizerConfig {
    pub device: OffloadDevice,
    pub nvme_path: Option<String>,
    pub pin_memory: bool,
    pub ratio: f32,
    pub buffer_count: u64,
    pub fast_init: bool,
    /// Read the next swapped chunk while the optimizer steps the current one (NVMe).
    pub pipeline_read: bool,
    /// Write a stepped chunk back while the optimizer steps the next one (NVMe).
    pub pipeline_write: bool,
}

/// `zero_optimization.offload_param`.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadParamConfig {
    pub device: OffloadDevice,
    pub nvme_path: Option<String>,
    pub pin_memory: bool,
    pub buffer_count: u64,
    pub buffer_size: u64,
    pub max_in_cpu: u64,
}

/// `zero_optimization`, with DeepSpeed's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ZeroConfig {
    pub stage: u8,
    pub reduce_bucket_size: u64,
    pub allgather_bucket_size: u64,
    pub contiguous_gradients: bool,
    /// DeepSpeed default: true at stage 3, else false.
    pub overlap_comm: bool,
    pub reduce_scatter: bool,
    pub stage3_prefetch_bucket_size: u64,
    pub stage3_param_persistence_threshold: u64,
    pub stage3_max_live_parameters: u64,
    pub stage3_max_reuse_distance: u64,
    /// Elements per optimizer sub-group: the chunk swapped in and out with NVMe offload.
    pub sub_group_size: u64,
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    pub offload_param: Option<OffloadParamConfig>,
}

impl ZeroConfig {
    /// The section as DeepSpeed fills it when the config leaves it out (stage 0).
    pub fn deepspeed_defaults() -> ZeroConfig {
        parse_zero(&Value::Object(serde_json::Map::new())).unwrap_or_else(|e| unreachable!("an empty config is valid: {e}"))
    }
}

pub(crate) fn parse_zero(root: &Value) -> KindResult<ZeroConfig> {
    let z = Obj::at(root, "zero_optimization")?;
    let stage = z.u64("stage", 0)?;
    let stage = u8::try_from(stage)
        .ok()
        .filter(|s| *s <= 3)
        .ok_or_else(|| ConfigErrorKind::invalid("zero_optimization.stage", &Value::from(stage), "0, 1, 2 or 3"))?;
    let offload_optimizer = parse_offload_optimizer(root, stage)?;
    Ok(ZeroConfig {
        stage,
        reduce_bucket_size: z.u64("reduce_bucket_size", 500_000_000)?,
        allgather_bucket_size: z.u64("allgather_bucket_size", 500_000_000)?,
        contiguous_gradients: z.bool("contiguous_gradients", true)?,
        overlap_comm: z.bool("overlap_comm", stage == 3)?,
        reduce_scatter: z.bool("reduce_scatter", true)?,
        stage3_prefetch_bucket_size: z.u64("stage3_prefetch_bucket_size", 50_000_000)?,
        stage3_param_persistence_threshold: z.u64("stage3_param_persistence_threshold", 100_000)?,
        stage3_max_live_parameters: z.u64("stage3_max_live_parameters", 1_000_000_000)?,
        stage3_max_reuse_distance: z.u64("stage3_max_reuse_distance", 1_000_000_000)?,
        sub_group_size: z.u64("sub_group_size", 1_000_000_000)?,
        offload_optimizer,
        offload_param: parse_offload_param(root)?,
    })
}

fn device(o: &Obj<'_>) -> KindResult<OffloadDevice> {
    match o.string("device", "none")?.as_str() {
        "none" => Ok(OffloadDevice::None),
        "cpu" => Ok(OffloadDevice::Cpu),
        "nvme" => Ok(OffloadDevice::Nvme),
        other => Err(ConfigErrorKind::invalid(&o.path("device"), &Value::String(other.to_string()), "\"none\", \"cpu\" or \"nvme\"")),
    }
}

fn parse_offload_optimizer(root: &Value, stage: u8) -> KindResult<Option<OffloadOptimizerConfig>> {
    let o = Obj::at(root, "zero_optimization.offload_optimizer")?;
    if !o.present() {
        return Ok(None);
    }
    let ratio = o.f32("ratio", 1.0)?;
    if !(0.0..=1.0).contains(&ratio) {
        return Err(ConfigErrorKind::invalid(&o.path("ratio"), &Value::from(ratio), "a number in [0, 1]"));
    }
    if ratio < 1.0 && stage != 3 {
        let why = "partial optimizer offload (ratio < 1) needs ZeRO stage 3, as in DeepSpeed";
        return Err(ConfigErrorKind::unsupported(&o.path("ratio"), &Value::from(ratio), why));
    }
    Ok(Some(OffloadOptimizerConfig {
        device: device(&o)?,
        nvme_path: o.opt_string("nvme_path")?,
        pin_memory: o.bool("pin_memory", true)?,
        ratio,
        buffer_count: o.u64("buffer_count", 4)?,
        fast_init: o.bool("fast_init", false)?,
        pipeline_read: o.bool("pipeline_read", false)?,
        pipeline_write: o.bool("pipeline_write", false)?,
    }))
}

fn parse_offload_param(root: &Value) -> KindResult<Option<OffloadParamConfig>> {
    let o = Obj::at(root, "zero_optimization.offload_param")?;
    if !o.present() {
        return Ok(None);
    }
    Ok(Some(OffloadParamConfig {
        device: device(&o)?,
        nvme_path: o.opt_string("nvme_path")?,
        pin_memory: o.bool("pin_memory", true)?,
        buffer_count: o.u64("buffer_count", 5)?,
        buffer_size: o.u64("buffer_size", 100_000_000)?,
        max_in_cpu: o.u64("max_in_cpu", 1_000_000_000)?,
    }))
}

/// fp16 mixed precision with DeepSpeed's loss-scaling parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp16Config {
    pub auto_cast: bool,
    /// 0 = dynamic loss scaling.
    pub loss_scale: f32,
    /// The dynamic scale starts at 2^initial_scale_power.
    pub initial_scale_power: u32,
    pub loss_scale_window: u64,
    pub hysteresis: u32,
    pub consecutive_hysteresis: bool,
    pub min_loss_scale: f32,
}

/// Training precision.
#[derive(Debug, Clone, PartialEq)]
pub enum Precision {
    F32,
    Bf16,
    Fp16(Fp16Config),
}

pub(crate) fn parse_precision(root: &Value) -> KindResult<Precision> {
    let fp16 = Obj::at(root, "fp16")?;
    let bf16 = Obj::at(root, "bf16")?;
    let (fp16_on, bf16_on) = (fp16.bool("enabled", false)?, bf16.bool("enabled", false)?);
    if fp16_on && bf16_on {
        return Err(ConfigErrorKind::PrecisionConflict);
    }
    if bf16_on {
        return Ok(Precision::Bf16);
    }
    if !fp16_on {
        return Ok(Precision::F32);
    }
    let small = |key: &str, default: u64| -> KindResult<u32> {
        let n = fp16.u64(key, default)?;
        u32::try_from(n).map_err(|_| ConfigErrorKind::invalid(&fp16.path(key), &Value::from(n), "an integer below 2^32"))
    };
    let cfg = Fp16Config {
        auto_cast: fp16.bool("auto_cast", false)?,
        loss_scale: fp16.non_negative_f32("loss_scale", 0.0)?,
        initial_scale_power: small("initial_scale_power", 16)?,
        loss_scale_window: fp16.u64("loss_scale_window", 1000)?,
        hysteresis: small("hysteresis", 2)?,
        consecutive_hysteresis: fp16.bool("consecutive_hysteresis", false)?,
        min_loss_scale: fp16.u64("min_loss_scale", 1)? as f32,
    };
    if cfg.loss_scale == 0.0 && cfg.loss_scale_window == 0 {
        let why = "dynamic loss scaling (loss_scale = 0) needs loss_scale_window > 0";
        return Err(ConfigErrorKind::unsupported("fp16.loss_scale_window", &Value::from(0u64), why));
    }
    if cfg.loss_scale == 0.0 && cfg.min_loss_scale <= 0.0 {
        let why = "dynamic loss scaling (loss_scale = 0) needs min_loss_scale > 0";
        return Err(ConfigErrorKind::unsupported("fp16.min_loss_scale", &Value::from(0u64), why));
    }
    Ok(Precision::Fp16(cfg))
}

/// DeepSpeed's `activation_checkpointing` fields (only recomputation itself is honoured).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActivationCheckpointingConfig {
    pub partition_activations: bool,
    pub contiguous_memory_optimization: bool,
    pub cpu_checkpointing: bool,
    pub number_checkpoints: Option<u64>,
    pub synchronize_checkpoint_boundary: bool,
    pub profile: bool,
}

/// The section's fields, and whether the section is present.
pub(crate) fn parse_activation(root: &Value) -> KindResult<(bool, ActivationCheckpointingConfig)> {
    let a = Obj::at(root, "activation_checkpointing")?;
    let cfg = ActivationCheckpointingConfig {
        partition_activations: a.bool("partition_activations", false)?,
        contiguous_memory_optimization: a.bool("contiguous_memory_optimization", false)?,
        cpu_checkpointing: a.bool("cpu_checkpointing", false)?,
        number_checkpoints: a.opt_u64("number_checkpoints")?,
        synchronize_checkpoint_boundary: a.bool("synchronize_checkpoint_boundary", false)?,
        profile: a.bool("profile", false)?,
    };
    Ok((a.present(), cfg))
}

/// One DeepSpeed file monitor (`tensorboard`, `csv_monitor`).
#[derive(Debug, Clone, PartialEq)]
pub struct MonitorTarget {
    pub enabled: bool,
    /// "" = Tessera's output directory.
    pub output_path: String,
    pub job_name: String,
}

/// The monitors Tessera honours (wandb and comet are accepted with a warning).
#[derive(Debug, Clone, PartialEq)]
pub struct MonitorConfig {
    pub tensorboard: MonitorTarget,
    pub csv_monitor: MonitorTarget,
}

pub(crate) fn parse_monitors(root: &Value) -> KindResult<MonitorConfig> {
    let target = |name: &str| -> KindResult<MonitorTarget> {
        let m = Obj::at(root, name)?;
        Ok(MonitorTarget {
            enabled: m.bool("enabled", false)?,
            output_path: m.string("output_path", "")?,
            job_name: m.string("job_name", "DeepSpeedJobName")?,
        })
    };
    Ok(MonitorConfig { tensorboard: target("tensorboard")?, csv_monitor: target("csv_monitor")? })
}

/// DeepSpeed's `aio` section: how NVMe offload reads and writes its swap files.
#[derive(Debug, Clone, PartialEq)]
pub struct AioConfig {
    pub block_size: u64,
    pub queue_depth: u64,
    /// Threads that split one read or write (`thread_count`, older name `intra_op_parallelism`).
    pub intra_op_parallelism: u64,
    pub single_submit: bool,
    pub overlap_events: bool,
    pub use_gds: bool,
}

pub(crate) fn parse_aio(root: &Value) -> KindResult<AioConfig> {
    let a = Obj::at(root, "aio")?;
    let (block_size, queue_depth) = (a.u64("block_size", 1_048_576)?, a.u64("queue_depth", 8)?);
    let threads = match (a.opt_u64("thread_count")?, a.opt_u64("intra_op_parallelism")?) {
        (Some(t), Some(i)) if t != i => {
            let why = "`thread_count` is DeepSpeed's newer name for `intra_op_parallelism`: set one, or both alike";
            return Err(ConfigErrorKind::unsupported(&a.path("thread_count"), &Value::from(t), why));
        }
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => 1,
    };
    Ok(AioConfig {
        block_size,
        queue_depth,
        intra_op_parallelism: threads,
        single_submit: a.bool("single_submit", false)?,
        overlap_events: a.bool("overlap_events", true)?,
        use_gds: a.bool("use_gds", false)?,
    })
}

/// Consecutive steps with a non-finite loss after which a run stops, by default: a diverged run
/// (NaN or infinite loss, every step skipped) ends with an error instead of running on.
pub const NONFINITE_LOSS_STEPS_DEFAULT: u64 = 3;

/// Where a rank's forward and backward run (`tessera.device`; `train --device` sets it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    #[default]
    Cpu,
    Cuda,
}

/// How GPU ranks exchange tensors (`tessera.gpu.collective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuCollective {
    /// NCCL between GPUs, one rank (a thread of the driver) per GPU, parameters and optimizer
    /// on the device: the fastest path (`src/gpu`), not elastic.
    #[default]
    Nccl,
    /// Ranks of the one engine: each computes its micro-batches' forward and backward on its GPU;
    /// gradients are staged to the host and reduced over the run's transport (QUIC between
    /// processes and hosts) by the engine's fixed tree, and the optimizer steps on the host, as
    /// with `offload_optimizer`. Works across hosts NCCL cannot connect, with every ZeRO stage,
    /// and survives losses and joins with `tessera.elastic`.
    Quic,
}

/// Tessera's own keys (the `"tessera"` section).
#[derive(Debug, Clone, PartialEq)]
pub struct TesseraConfig {
    pub model: String,
    pub data: Option<String>,
    pub tokenizer: Option<String>,
    /// The JSON-lines field / Parquet column of the text.
    pub data_field: String,
    /// The tokenizer's end-of-text token; None = detected.
    pub data_eot: Option<String>,
    /// The tokenizer's token before every document; None = none.
    pub data_bos: Option<String>,
    /// Folder of the token cache; None = the default; "off" = none.
    pub data_cache: Option<String>,
    pub seq_len: Option<usize>,
    pub steps: u64,
    pub seed: u64,
    pub eval_interval: u64,
    pub eval_iters: u64,
    /// 0 = checkpoint only at the end.
    pub checkpoint_interval: u64,
    pub keep_last: u64,
    pub output_dir: String,
    pub jsonl_monitor: bool,
    /// Number of workers (the command line's world size wins).
    pub world: usize,
    pub activation_checkpointing: bool,
    /// A run stops (with an error) after this many consecutive steps whose loss is not finite;
    /// 0 = never.
    pub nonfinite_loss_steps: u64,
    /// Per-rank budget, in bytes, for the model states a rank keeps resident ("device"
    /// memory); offloaded states do not count. None = unbounded.
    pub device_memory_bytes_max: Option<u64>,
    /// `tessera.device`.
    pub device: ComputeDevice,
    /// `tessera.gpu.collective`.
    pub gpu_collective: GpuCollective,
    /// `tessera.moe`: mixture-of-experts blocks (docs/MOE.md); `ep_size` is
    /// `moe.as_ref().map_or(1, |m| m.ep_size)`.
    pub moe: Option<crate::config::MoeSection>,
}

impl Default for TesseraConfig {
    fn default() -> Self {
        TesseraConfig {
            model: "gpt-tiny".into(),
            data: None,
            tokenizer: None,
            data_field: "text".into(),
            data_eot: None,
            data_bos: None,
            data_cache: None,
            seq_len: None,
            steps: 200,
            seed: 1234,
            eval_interval: 50,
            eval_iters: 8,
            checkpoint_interval: 0,
            keep_last: 3,
            output_dir: "runs/latest".into(),
            jsonl_monitor: true,
            world: 1,
            activation_checkpointing: false,
            nonfinite_loss_steps: NONFINITE_LOSS_STEPS_DEFAULT,
            device_memory_bytes_max: None,
            device: ComputeDevice::Cpu,
            gpu_collective: GpuCollective::Nccl,
            moe: None,
        }
    }
}

fn compute_device(t: &Obj<'_>) -> KindResult<ComputeDevice> {
    match t.string("device", "cpu")?.as_str() {
        "cpu" => Ok(ComputeDevice::Cpu),
        "cuda" => Ok(ComputeDevice::Cuda),
        other => Err(ConfigErrorKind::invalid(&t.path("device"), &Value::String(other.to_string()), "\"cpu\" or \"cuda\"")),
    }
}

fn gpu_collective(root: &Value) -> KindResult<GpuCollective> {
    let g = Obj::at(root, "tessera.gpu")?;
    match g.string("collective", "nccl")?.as_str() {
        "nccl" => Ok(GpuCollective::Nccl),
        "quic" => Ok(GpuCollective::Quic),
        other => Err(ConfigErrorKind::invalid(&g.path("collective"), &Value::String(other.to_string()), "\"nccl\" or \"quic\"")),
    }
}

pub(crate) fn parse_tessera(root: &Value) -> KindResult<TesseraConfig> {
    let t = Obj::at(root, "tessera")?;
    let d = TesseraConfig::default();
    let usize_of =
        |key: &str, n: u64| usize::try_from(n).map_err(|_| ConfigErrorKind::invalid(&t.path(key), &Value::from(n), "a smaller integer"));
    let seq_len = t.opt_u64("seq_len")?.map(|n| usize_of("seq_len", n)).transpose()?;
    let model = t.string("model", &d.model)?;
    // A model folder brings its tokenizer.
    let tokenizer = t.opt_string("tokenizer")?.or_else(|| crate::hf::folder_tokenizer(&model));
    Ok(TesseraConfig {
        model: model.clone(),
        data: t.opt_string("data")?,
        tokenizer,
        data_field: t.string("data_field", &d.data_field)?,
        data_eot: t.opt_string("data_eot")?.or_else(|| crate::hf::folder_end_of_text(&model)),
        data_bos: match t.opt_string("data_bos")? {
            Some(name) => Some(name).filter(|n| !n.is_empty()),
            None => crate::hf::folder_begin_of_text(&model),
        },
        data_cache: t.opt_string("data_cache")?,
        seq_len,
        steps: t.u64("steps", d.steps)?,
        seed: t.u64("seed", d.seed)?,
        eval_interval: t.u64("eval_interval", d.eval_interval)?,
        eval_iters: t.u64("eval_iters", d.eval_iters)?,
        checkpoint_interval: t.u64("checkpoint_interval", d.checkpoint_interval)?,
        keep_last: t.u64("keep_last", d.keep_last)?,
        output_dir: t.string("output_dir", &d.output_dir)?,
        jsonl_monitor: t.bool("jsonl_monitor", d.jsonl_monitor)?,
        world: usize_of("world", t.positive_u64("world", 1)?)?,
        activation_checkpointing: t.bool("activation_checkpointing", false)?,
        nonfinite_loss_steps: t.u64("nonfinite_loss_steps", d.nonfinite_loss_steps)?,
        device_memory_bytes_max: t.opt_u64("device_memory_bytes_max")?,
        device: compute_device(&t)?,
        gpu_collective: gpu_collective(root)?,
        moe: crate::config::moe::parse_moe(root)?,
    })
}
