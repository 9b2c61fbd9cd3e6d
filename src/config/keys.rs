//! The key table: the single source of truth for which DeepSpeed (and `tessera`) keys exist,
//! their JSON type, and whether Tessera honours them yet. It drives unknown-key detection,
//! "not honoured" warnings, `tessera config check` and docs/config.md.

/// JSON type of a key, used to validate and normalise values before typed parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// An object whose children are listed in the table.
    Section,
    /// Any JSON value; accepted as-is and not looked into.
    Opaque,
    Bool,
    /// Non-negative integer (hjson-style `5e8` accepted).
    UInt,
    /// Signed integer.
    Int,
    Float,
    Str,
    /// Array of numbers (e.g. `betas`).
    FloatList,
}

impl KeyKind {
    /// Human name used in the docs and in error messages.
    pub fn describe(self) -> &'static str {
        match self {
            KeyKind::Section => "object",
            KeyKind::Opaque => "any",
            KeyKind::Bool => "bool",
            KeyKind::UInt => "integer ≥ 0",
            KeyKind::Int => "integer",
            KeyKind::Float => "number",
            KeyKind::Str => "string",
            KeyKind::FloatList => "array of numbers",
        }
    }
}

/// One known key: its dotted path, type, whether Tessera honours it, and a note.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyInfo {
    pub path: &'static str,
    pub kind: KeyKind,
    pub honoured: bool,
    pub note: &'static str,
}

/// Not-honoured flags whose DeepSpeed default is `true`, where that default is what Tessera
/// does or changes nothing in Tessera's math (gradients in one flat buffer, reduced to their
/// owners, masters loaded as fp32, its own CPU optimizer under offload, …): only `false` asks
/// for something Tessera does not do, so only `false` draws the warning.
pub const DEFAULT_TRUE: &[&str] = &[
    "optimizer.params.set_grad_none",
    "optimizer.params.fp32_optimizer_states",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter",
    "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_optimization.allgather_partitions",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.override_module_apply",
    "zero_force_ds_cpu_optimizer",
];

const fn k(path: &'static str, kind: KeyKind, honoured: bool, note: &'static str) -> KeyInfo {
    KeyInfo { path, kind, honoured, note }
}

use KeyKind::{Bool, Float, FloatList, Int, Opaque, Section, Str, UInt};
const H: bool = true;
const N: bool = false;

static BATCH_AND_OPTIMIZER: &[KeyInfo] = &[
    k("train_batch_size", UInt, H, "= micro batch × grad-accum × world; derived when missing; at most 2^20 micro-batches per step (MICRO_BATCHES_PER_STEP_MAX)"),
    k("train_micro_batch_size_per_gpu", UInt, H, "per worker; derived when missing; × tessera.seq_len at most 2^20 tokens (MICRO_BATCH_TOKENS_MAX)"),
    k("gradient_accumulation_steps", UInt, H, "derived when missing (1 if only one batch key is set)"),
    k("optimizer", Section, H, "missing section = AdamW with lr 1e-3"),
    k("optimizer.type", Str, H, "Adam, AdamW, Lamb, Lion, SGD, Adagrad (case-insensitive)"),
    k("optimizer.params", Section, H, "keys checked per optimizer type"),
    k("optimizer.params.lr", Float, H, "all; default 1e-3"),
    k("optimizer.params.betas", FloatList, H, "Adam, AdamW, Lamb, Lion; default [0.9, 0.999]"),
    k("optimizer.params.eps", Float, H, "Adam, AdamW, Lamb; default 1e-8 (Adagrad: 1e-10)"),
    k("optimizer.params.weight_decay", Float, H, "all; default 0"),
    k("optimizer.params.adam_w_mode", Bool, H, "Adam; default true (decoupled decay, as DeepSpeed); AdamW forces true"),
    k("optimizer.params.bias_correction", Bool, H, "Adam, AdamW, Lamb; default true"),
    k("optimizer.params.max_coeff", Float, H, "Lamb; default 10.0"),
    k("optimizer.params.min_coeff", Float, H, "Lamb; default 0.01"),
    k("optimizer.params.momentum", Float, H, "SGD; default 0"),
    k("optimizer.params.dampening", Float, H, "SGD; default 0"),
    k("optimizer.params.nesterov", Bool, H, "SGD; default false"),
    k("optimizer.params.lr_decay", Float, H, "Adagrad; default 0: step t's lr is lr / (1 + (t − 1)·lr_decay), as torch.optim.Adagrad"),
    k("optimizer.params.initial_accumulator_value", Float, H, "Adagrad; default 0: where every element's sum of squared gradients starts"),
    k("optimizer.params.maximize", Bool, N, "Adagrad; true is rejected"),
    k("optimizer.params.torch_adam", Bool, N, "Adam, AdamW; Tessera has a single Adam implementation"),
    k("optimizer.params.amsgrad", Bool, N, "Adam, AdamW, Lamb, Adagrad; true is rejected"),
    k("optimizer.params.eps_inside_sqrt", Bool, N, "Lamb; true is rejected"),
    k("optimizer.params.set_grad_none", Bool, N, "Adam, AdamW, Lion; no effect in Tessera"),
    k("optimizer.params.fp32_optimizer_states", Bool, N, "Adam, AdamW, Adagrad (DeepSpeed's CPU optimizers); states are always f32"),
    k("optimizer.params.max_grad_norm", Float, N, "rejected, as DeepSpeed does: use gradient_clipping"),
    k("optimizer.legacy_fusion", Bool, N, ""),
    k("scheduler", Section, H, "missing section = constant lr"),
    k("scheduler.type", Str, H, "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    k("scheduler.params", Section, H, "keys checked per scheduler type"),
    k("scheduler.params.warmup_min_lr", Float, H, "WarmupLR, WarmupDecayLR; default 0"),
    k("scheduler.params.warmup_max_lr", Float, H, "WarmupLR (default: optimizer lr), WarmupDecayLR (default 0.001)"),
    k("scheduler.params.warmup_num_steps", UInt, H, "Warmup*; default 1000; values below 2 act as 2"),
    k("scheduler.params.warmup_type", Str, H, "Warmup*; log | linear; default log"),
    k("scheduler.params.total_num_steps", UInt, H, "WarmupDecayLR, WarmupCosineLR; required"),
    k("scheduler.params.warmup_min_ratio", Float, H, "WarmupCosineLR; default 0"),
    k("scheduler.params.cos_min_ratio", Float, H, "WarmupCosineLR; default 0.0001"),
    k("scheduler.params.cycle_min_lr", Float, H, "OneCycle; required"),
    k("scheduler.params.cycle_max_lr", Float, H, "OneCycle; required"),
    k("scheduler.params.decay_lr_rate", Float, H, "OneCycle; default 0"),
    k("scheduler.params.cycle_first_step_size", UInt, H, "OneCycle; default 2000"),
    k("scheduler.params.cycle_second_step_size", UInt, H, "OneCycle; default cycle_first_step_size"),
    k("scheduler.params.cycle_first_stair_count", UInt, H, "OneCycle; default 0 (no stairs)"),
    k("scheduler.params.cycle_second_stair_count", UInt, H, "OneCycle; default cycle_first_stair_count"),
    k("scheduler.params.decay_step_size", UInt, H, "OneCycle; default 0 (no decay)"),
    k("scheduler.params.cycle_momentum", Bool, H, "OneCycle; default true: betas = (cycled beta1, 0.99) each step, replacing optimizer.params.betas (Adam, AdamW, Lamb, Lion); SGD is not cycled, as in DeepSpeed; the step log and the monitors (`Train/Samples/beta1`) show each step's beta1"),
    k("scheduler.params.cycle_min_mom", Float, H, "OneCycle; default 0.8; in [0, 1): beta1 of the first step and at the lr's peak"),
    k("scheduler.params.cycle_max_mom", Float, H, "OneCycle; default 0.9; in [0, 1): beta1 at the cycle's ends"),
    k("scheduler.params.decay_mom_rate", Float, H, "OneCycle; default 0; after the cycle beta1 = cycle_max_mom·(1 + rate·d/decay_step_size), d steps in (a run whose beta1 would leave [0, 1) is refused)"),
    k("scheduler.params.lr_range_test_min_lr", Float, H, "LRRangeTest; default 1e-3"),
    k("scheduler.params.lr_range_test_step_size", UInt, H, "LRRangeTest; default 2000"),
    k("scheduler.params.lr_range_test_step_rate", Float, H, "LRRangeTest; default 1.0"),
    k("scheduler.params.lr_range_test_staircase", Bool, H, "LRRangeTest; default false"),
];

static PRECISION_AND_MISC: &[KeyInfo] = &[
    k("fp16", Section, H, ""),
    k("fp16.enabled", Bool, H, "default false; exclusive with bf16.enabled"),
    k("fp16.auto_cast", Bool, N, "inputs are not cast; fp16 is parameter and gradient storage"),
    k("fp16.loss_scale", Float, H, "0 = dynamic (default)"),
    k("fp16.initial_scale_power", UInt, H, "dynamic scale starts at 2^this; default 16"),
    k("fp16.loss_scale_window", UInt, H, "default 1000"),
    k("fp16.hysteresis", UInt, H, "default 2"),
    k("fp16.consecutive_hysteresis", Bool, H, "default false"),
    k("fp16.min_loss_scale", UInt, H, "default 1"),
    k("fp16.fp16_master_weights_and_grads", Bool, N, ""),
    k("bf16", Section, H, "legacy name `bfloat16` accepted"),
    k("bf16.enabled", Bool, H, "default false"),
    k("bf16.immediate_grad_update", Bool, N, ""),
    k("bf16.check_grad_overflow", Bool, N, ""),
    k("bf16.check_overflow", Bool, N, "older name of check_grad_overflow"),
    k("bf16.bf16_master_weights_and_grads", Bool, N, ""),
    k("bf16.bf16_optimizer_states", Bool, N, ""),
    k("amp", Opaque, N, "NVIDIA Apex AMP"),
    k("torch_autocast", Opaque, N, ""),
    k("gradient_clipping", Float, H, "max global grad norm; 0 = off (the default, as DeepSpeed's); \"auto\" = 1.0"),
    k("steps_per_print", UInt, H, "default 10"),
    k(
        "wall_clock_breakdown",
        Bool,
        H,
        "default false; CPU runs write DeepSpeed's `Train/Samples/elapsed_time_ms_*` tags to the monitors, `--device cuda` prints each step's time only",
    ),
    k("memory_breakdown", Bool, N, ""),
    k("activation_checkpointing", Section, H, "present = activation recomputation on"),
    k("activation_checkpointing.partition_activations", Bool, N, ""),
    k("activation_checkpointing.contiguous_memory_optimization", Bool, N, ""),
    k("activation_checkpointing.cpu_checkpointing", Bool, N, ""),
    k("activation_checkpointing.number_checkpoints", UInt, N, ""),
    k("activation_checkpointing.synchronize_checkpoint_boundary", Bool, N, ""),
    k("activation_checkpointing.profile", Bool, N, ""),
    k("tensorboard", Section, H, ""),
    k("tensorboard.enabled", Bool, H, "default false"),
    k("tensorboard.output_path", Str, H, "default \"\" (= tessera.output_dir)"),
    k("tensorboard.job_name", Str, H, "default \"DeepSpeedJobName\""),
    k("csv_monitor", Section, H, ""),
    k("csv_monitor.enabled", Bool, H, "default false"),
    k("csv_monitor.output_path", Str, H, "default \"\" (= tessera.output_dir)"),
    k("csv_monitor.job_name", Str, H, "default \"DeepSpeedJobName\""),
    k("wandb", Section, N, "no network logging"),
    k("wandb.enabled", Bool, N, ""),
    k("wandb.group", Str, N, ""),
    k("wandb.team", Str, N, ""),
    k("wandb.project", Str, N, ""),
    k("comet", Section, N, "no network logging"),
    k("comet.enabled", Bool, N, ""),
    k("comet.samples_log_interval", UInt, N, ""),
    k("comet.project", Str, N, ""),
    k("comet.workspace", Str, N, ""),
    k("comet.api_key", Str, N, ""),
    k("comet.experiment_name", Str, N, ""),
    k("comet.experiment_key", Str, N, ""),
    k("comet.online", Bool, N, ""),
    k("comet.mode", Str, N, ""),
    k("aio", Section, H, "async I/O of NVMe offload (the optimizer swap files)"),
    k("aio.block_size", UInt, H, "bytes; alignment of O_DIRECT buffers and file offsets, and the size of one I/O request; a power of two from 4096 to 2^30; default 1048576"),
    k("aio.queue_depth", UInt, H, "I/O requests in flight per thread (io_uring submission queue); default 8"),
    k("aio.thread_count", UInt, H, "threads splitting each read or write (DeepSpeed's newer name of intra_op_parallelism); default 1"),
    k("aio.intra_op_parallelism", UInt, H, "older name of thread_count; default 1"),
    k("aio.single_submit", Bool, H, "io_uring: one submit call per request instead of one per batch; no effect on the thread-pool fallback; default false"),
    k("aio.overlap_events", Bool, H, "io_uring: refill the queue as requests complete (false: submit a batch, wait for all of it); no effect on the thread-pool fallback; default true"),
    k("aio.use_gds", Bool, N, "GPUDirect Storage: no GPU path reads swap files; default false"),
];

static ZERO: &[KeyInfo] = &[
    k("zero_optimization", Section, H, "legacy `true`/`false` form accepted"),
    k("zero_optimization.stage", UInt, H, "0–3: what each of the --world ranks holds (docs/ARCHITECTURE.md)"),
    k("zero_optimization.contiguous_gradients", Bool, N, "no effect: gradients are always one flat buffer"),
    k("zero_optimization.reduce_scatter", Bool, N, "default true; ranks always reduce to the owners; false is not honoured"),
    k("zero_optimization.reduce_bucket_size", UInt, H, "elements; 0 = one all-to-all per parameter tensor (DeepSpeed's meaning: each parameter's gradient reduced on its own); gradients go to their partition owners in all-to-alls of at most this many, each sent once the backward has finished every unit it covers (stages 2-3 every micro-batch, 0-1 each block's sum); default 5e8"),
    k("zero_optimization.use_multi_rank_bucket_allreduce", Bool, N, ""),
    k("zero_optimization.allgather_partitions", Bool, N, ""),
    k("zero_optimization.allgather_bucket_size", UInt, N, "any value, 0 included, as DeepSpeed (which ignores it where torch has all_gather_into_tensor); default 5e8"),
    k("zero_optimization.overlap_comm", Bool, H, "CPU ranks: gradient buckets (and stage-3 gathers) run on a per-rank communication thread while the rank computes; off: the rank waits for each. GPU ranks: NCCL on a communication stream overlapping the compute stream; off: the compute stream waits for each collective as it is issued. Default: on at stage 3, else off"),
    k("zero_optimization.load_from_fp32_weights", Bool, N, ""),
    k("zero_optimization.elastic_checkpoint", Bool, N, "deprecated in DeepSpeed"),
    k("zero_optimization.offload_optimizer", Section, H, "fp32 masters and optimizer moments of each rank's shard leave its device budget (tessera.device_memory_bytes_max)"),
    k("zero_optimization.offload_optimizer.device", Str, H, "none | cpu (host-tier memory, reported as offloaded_bytes_per_rank.host) | nvme (one swap file per rank and buffer under nvme_path, read before and written after each optimizer step). --device cuda (ZeRO 1-3, every optimizer (Lamb: cpu, ratio 1, one GPU), bf16 or fp16): cpu (masters and moments in host memory, the optimizer on CPU threads per unit as its gradient arrives, same bits; with fp16 or clipping after the global norm, an overflowing step skipped) or nvme (the same with masters and moments in three swap files per rank under nvme_path, each unit read ahead and written behind the host step; ratio 1.0)"),
    k("zero_optimization.offload_optimizer.nvme_path", Str, H, "device = nvme: an existing writable directory; checked at start"),
    k("zero_optimization.offload_optimizer.buffer_count", UInt, N, "Tessera keeps 1 to 3 chunk buffers (current, read-ahead, write-behind) as pipeline_read/pipeline_write ask; default 4"),
    k("zero_optimization.offload_optimizer.pin_memory", Bool, N, "no page-locked host memory on CPU ranks; GPU ranks always stage gradients and parameters through page-locked memory; default false"),
    k("zero_optimization.offload_optimizer.pipeline_read", Bool, H, "nvme: read the next sub-group while the optimizer steps the current one; default false"),
    k("zero_optimization.offload_optimizer.pipeline_write", Bool, H, "nvme: write a stepped sub-group back while the optimizer steps the next one; default false"),
    k("zero_optimization.offload_optimizer.fast_init", Bool, N, "swap files are always written whole at start; default false"),
    k("zero_optimization.offload_optimizer.ratio", Float, H, "--device cuda (ZeRO-3, as in DeepSpeed): the share of each unit's optimizer piece stepped on the host, the rest on the GPU (same bits). CPU ranks with device = cpu: that share of the masters and moments leaves the device budget (offloaded_bytes_per_rank.host), the rest stays resident; nvme needs 1.0; default 1.0"),
    k("zero_optimization.offload_optimizer.super_offload", Bool, N, ""),
    k("zero_optimization.offload_optimizer.cpuadam_cores_perc", Float, N, ""),
    k("zero_optimization.offload_param", Section, H, "stage 3 only: each rank's parameter shard leaves its device budget"),
    k("zero_optimization.offload_param.device", Str, H, "none | cpu (the shard lives in host-tier memory; units are fetched from it before use) | nvme (the shard, less persistent units, in one swap file per rank under nvme_path, in the storage type; read by each gather, ahead of use with stage-3 prefetch; written at commit)"),
    k("zero_optimization.offload_param.nvme_path", Str, H, "device = nvme: an existing writable directory; checked at start, with its free space"),
    k("zero_optimization.offload_param.buffer_count", UInt, H, "nvme: parameter pieces read from the swap file and not yet used (the current one included) fit in this many buffers, bounding stage-3 prefetch; default 5"),
    k("zero_optimization.offload_param.buffer_size", UInt, H, "nvme: elements per buffer; a rank's piece of a gathered unit larger than it is refused at start; default 1e8"),
    k("zero_optimization.offload_param.max_in_cpu", UInt, H, "nvme: this many elements of each shard stay in host memory (out of the device budget, offloaded_bytes_per_rank.host), the rest go to the swap file; default 1e9"),
    k("zero_optimization.offload_param.pin_memory", Bool, N, "no page-locked host memory on CPU ranks; GPU ranks (--device cuda) keep their host shard page-locked whatever it says (said at start); default false"),
    k("zero_optimization.zenflow", Opaque, N, ""),
    k("zero_optimization.sub_group_size", UInt, H, "elements per optimizer sub-group: with offload_optimizer.device = nvme, the chunk swapped in and out (rounded up to aio.block_size, so 0 — DeepSpeed's sub-group per parameter — swaps one block at a time); no effect otherwise (the step is elementwise); default 1e9"),
    k("zero_optimization.stage3_prefetch_bucket_size", UInt, H, "stage 3, CPU ranks: elements of upcoming units gathered ahead of use on the communication thread, within stage3_max_live_parameters; 0 = gather each unit at its use. GPU ranks prefetch the next unit. Default 5e7"),
    k("zero_optimization.stage3_param_persistence_threshold", UInt, H, "stage 3, per unit (embeddings+head, or one block): a unit with fewer elements is kept whole by every rank and never gathered; optimizer state stays partitioned; default 1e5"),
    k("zero_optimization.stage3_model_persistence_threshold", UInt, N, ""),
    k("zero_optimization.stage3_max_live_parameters", UInt, H, "stage 3: bound on gathered elements; a non-persistent unit above it is refused; unit 0 is released between uses unless it fits beside the largest block; default 1e9"),
    k("zero_optimization.stage3_max_reuse_distance", UInt, H, "stage 3: unit 0 (the one reused unit) stays gathered only if the blocks gathered before its reuse total at most this many elements; default 1e9"),
    k("zero_optimization.stage3_gather_16bit_weights_on_model_save", Bool, N, "checkpoints are always gathered"),
    k("zero_optimization.stage3_module_granularity_threshold", UInt, N, ""),
    k("zero_optimization.stage3_use_all_reduce_for_fetch_params", Bool, N, ""),
    k("zero_optimization.stage3_allgather_sequential", Bool, N, ""),
    k("zero_optimization.ignore_unused_parameters", Bool, N, ""),
    k("zero_optimization.legacy_stage1", Bool, N, ""),
    k("zero_optimization.round_robin_gradients", Bool, N, ""),
    k("zero_optimization.zero_hpz_partition_size", UInt, N, "ZeRO++"),
    k("zero_optimization.zero_quantized_weights", Bool, N, "ZeRO++"),
    k("zero_optimization.zero_quantized_nontrainable_weights", Bool, N, "ZeRO++"),
    k("zero_optimization.zero_quantized_gradients", Bool, N, "ZeRO++"),
    k("zero_optimization.zeropp_loco_param", Opaque, N, "ZeRO++"),
    k("zero_optimization.mics_shard_size", Int, N, "MiCS"),
    k("zero_optimization.mics_hierarchical_params_gather", Bool, N, "MiCS"),
    k("zero_optimization.memory_efficient_linear", Bool, N, ""),
    k("zero_optimization.pipeline_loading_checkpoint", Bool, N, ""),
    k("zero_optimization.override_module_apply", Bool, N, ""),
    k("zero_optimization.log_trace_cache_warnings", Bool, N, ""),
    k("zero_optimization.enable_sanity_checks", Bool, N, ""),
    k("zero_optimization.save_muon_momentum_buffer_in_memory", Bool, N, ""),
    k("zero_optimization.leaf_module", Opaque, N, ""),
];

static OTHER_DEEPSPEED: &[KeyInfo] = &[
    k("allgather_size", UInt, N, "legacy; read only with \"zero_optimization\": true"),
    k("communication_data_type", Str, N, ""),
    k("seq_parallel_communication_data_type", Str, N, ""),
    k("prescale_gradients", Bool, N, ""),
    k("gradient_predivide_factor", Float, N, ""),
    k("gradient_allreduce_op", Str, N, ""),
    k("disable_allgather", Bool, N, ""),
    k("dump_state", Bool, N, ""),
    k("vocabulary_size", UInt, N, ""),
    k("graph_harvesting", Bool, N, ""),
    k("dataloader_drop_last", Bool, N, ""),
    k("log_level", Str, N, ""),
    k("managed_gradient_accumulation", Bool, N, ""),
    k("sparse_gradients", Bool, N, ""),
    k("zero_allow_untested_optimizer", Bool, N, ""),
    k("zero_force_ds_cpu_optimizer", Bool, N, ""),
    k("sequence_parallel_size", UInt, N, ""),
    k("use_data_before_expert_parallelism", Bool, N, "MoE"),
    k("expert_parallel", Opaque, N, "MoE"),
    k("flops_profiler", Opaque, N, ""),
    k("autotuning", Opaque, N, ""),
    k("elasticity", Section, H, "DeepSpeed's elastic batch rule, version 0.1 (docs/ELASTIC.md)"),
    k("elasticity.enabled", Bool, H, "default false; true: the rule sets the batch triple"),
    k("elasticity.max_train_batch_size", UInt, H, "required when enabled"),
    k("elasticity.micro_batch_sizes", Opaque, H, "array of positive integers; required when enabled"),
    k("elasticity.min_gpus", UInt, H, "default 1"),
    k("elasticity.max_gpus", UInt, H, "default 10000"),
    k("elasticity.min_time", UInt, N, "scheduler hint; no scheduler"),
    k("elasticity.prefer_larger_batch", Bool, H, "default true"),
    k("elasticity.ignore_non_elastic_batch_info", Bool, H, "default false"),
    k("elasticity.version", Float, H, "0.1 (the default) only"),
    k("elasticity.model_parallel_size", UInt, N, "version 0.2 only"),
    k("elasticity.num_gpus_per_node", UInt, N, "version 0.2 only"),
    k("pipeline", Section, H, "pipeline parallelism (docs/PIPELINE.md): the model's blocks cut into stages over world / stages data-parallel replicas; the parameters are the unpipelined run's bits"),
    k("pipeline.stages", UInt, H, "stages S, at least 1 and at most the model's blocks, dividing the world; the batch rule's world is world / S (DeepSpeed's data-parallel size); default 1 (\"auto\" is refused: DeepSpeed takes it from PipelineModule, which a config-only run has not)"),
    k("pipeline.partition", Str, H, "how blocks are split into stages (DeepSpeed's partition_method): \"parameters\" (default: balance parameter counts), \"uniform\" (balance block counts), \"type:REGEX\" (balance the blocks whose kind — gpt-block, llama-block, moe — matches, case-insensitive) or \"profile\" (balance each block's measured forward and backward time, the embeddings' on the first stage and the head's on the last; measured once at the start of `tessera train` and recorded as tessera.pipeline.profile)"),
    k("pipeline.activation_checkpoint_interval", UInt, H, "0 (default) keeps activations; 1 recomputes every block in the backward from its input (as activation_checkpointing does); larger intervals are refused"),
    k("pipeline.seed_layers", Bool, N, "DeepSpeed's per-layer init seeds: Tessera's initialisation is keyed per parameter already, the same for every cut into stages"),
    k("pipeline.pipe_partitioned", Bool, N, "splits activations over the tensor-parallel group, which Tessera does not have (DeepSpeed with model-parallel size 1 does the same: nothing)"),
    k("pipeline.grad_partitioned", Bool, N, "splits activation gradients over the tensor-parallel group, which Tessera does not have (DeepSpeed with model-parallel size 1 does the same: nothing)"),
    k("sparse_attention", Opaque, N, ""),
    k("eigenvalue", Opaque, N, ""),
    k("progressive_layer_drop", Opaque, N, ""),
    k("checkpoint", Opaque, N, "Tessera checkpoints via tessera.checkpoint_interval"),
    k("data_types", Opaque, N, ""),
    k("comms_logger", Opaque, N, ""),
    k("hybrid_engine", Opaque, N, ""),
    k("curriculum_learning", Opaque, N, ""),
    k("data_efficiency", Opaque, N, ""),
    k("compression_training", Opaque, N, ""),
    k("quantize_training", Opaque, N, ""),
    k("weight_quantization", Opaque, N, ""),
    k("nebula", Opaque, N, ""),
    k("datastates_ckpt", Opaque, N, ""),
    k("compile", Opaque, N, ""),
    k("timers", Opaque, N, ""),
    k("tensor_parallel", Opaque, N, ""),
];

static TESSERA: &[KeyInfo] = &[
    k("tessera", Section, H, "Tessera's own keys"),
    k("tessera.model", Str, H, "model preset (`tessera models`), or a Hugging Face model folder (a path: config.json of GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM, weights from model.safetensors or a sharded index, none: initialised from the seed; other architectures and keys are refused by name); default \"gpt-tiny\""),
    k("tessera.data", Str, H, "training data path; default: the shipped corpus (data/corpus/austen.txt, also compiled into the binary)"),
    k("tessera.tokenizer", Str, H, "tokenizer path; default: a model folder's tokenizer.json, else byte-level"),
    k("tessera.data_field", Str, H, "the JSON-lines field or Parquet column holding each document's text; default \"text\""),
    k("tessera.data_eot", Str, H, "the tokenizer's token put between documents (JSON lines, Parquet, a folder); default: a model folder's end-of-sequence token (config.json's eos_token_id), else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> the tokenizer has (none: refused); byte-level data uses id 256 (vocabulary 257)"),
    k("tessera.data_bos", Str, H, "the tokenizer's token put before every document (JSON lines, Parquet, a folder; after the end-of-text token between documents); default: a model folder's beginning-of-sequence token when its tokenizer starts every sequence with one (tokenizer_config.json's add_bos_token with its bos_token, else tokenizer.json's template post-processor) and it is not the end-of-sequence token, else none; \"\" = none"),
    k("tessera.data_cache", Str, H, "folder of the token cache (data tokenized once, memory-mapped by every rank); default $XDG_CACHE_HOME/tessera/tokens, else ~/.cache/tessera/tokens; \"off\" = tokenize into memory; files are never removed (4 bytes a token): delete the folder to reclaim the space"),
    k("tessera.seq_len", UInt, H, "default: the model's context (a preset's, or a folder's n_positions / max_position_embeddings)"),
    k("tessera.steps", UInt, H, "optimizer steps; default 200"),
    k("tessera.seed", UInt, H, "default 1234"),
    k("tessera.eval_interval", UInt, H, "default 50"),
    k("tessera.eval_iters", UInt, H, "validation batches per evaluation; default 8; 0 acts as 1; at most 100000"),
    k("tessera.checkpoint_interval", UInt, H, "default 0 = only at the end"),
    k("tessera.keep_last", UInt, H, "checkpoints kept; default 3; 0 keeps every one"),
    k("tessera.output_dir", Str, H, "default \"runs/latest\""),
    k("tessera.jsonl_monitor", Bool, H, "default true"),
    k("tessera.world", UInt, H, "number of workers, at least 1; default 1 (`--world` or `--nprocs` wins)"),
    k("tessera.activation_checkpointing", Bool, H, "default false; recompute activations"),
    k("tessera.nonfinite_loss_steps", UInt, H, "a run whose loss is NaN or infinite this many steps in a row stops with an error naming the step (no checkpoint of a non-finite loss is written); default 3; 0 = never stops"),
    k("tessera.elastic", Section, H, "the fleet of worker processes: `train --nprocs N`, `tessera coordinator`, `tessera launch` (docs/ELASTIC.md); recovery is on with `enabled` (`elasticity.enabled` also switches it on); the heartbeat and step timeouts apply to every process run"),
    k("tessera.elastic.enabled", Bool, H, "default false (= elasticity.enabled): recovery off — no replicas, joins or rebalancing; the first lost worker ends the run"),
    k("tessera.elastic.heartbeat_ms", UInt, H, "worker heartbeat period, at least 1; default 100"),
    k("tessera.elastic.heartbeat_timeout_ms", UInt, H, "a worker silent this long is dead (hung, SIGSTOPped); at least 1; default 2000"),
    k("tessera.elastic.step_timeout_ms", UInt, H, "bound on one worker reply, at least 1; default 600000"),
    k("tessera.elastic.min_workers", UInt, H, "below it the run waits for joins; default elasticity.min_gpus or 1"),
    k("tessera.elastic.max_workers", UInt, H, "joins beyond it wait; default elasticity.max_gpus or 64"),
    k("tessera.elastic.replicas", UInt, H, "ring successors holding each rank's shard in memory; 0 = restore from the newest checkpoint and replay; default 1"),
    k("tessera.elastic.max_joins", UInt, H, "processes that may join after the start (one certificate each); default 8"),
    k("tessera.elastic.drain_grace_ms", UInt, H, "a SIGTERMed worker hands over its shard within it, else it is lost; default 30000"),
    k("tessera.elastic.join_wait_ms", UInt, H, "how long a run below min_workers waits for joins; default 60000"),
    k("tessera.elastic.rebalance_threshold", Opaque, H, "re-assign micro-batch blocks by measured worker speed when the predicted step gets this fraction shorter; 0 or false = never; true or absent = 0.2"),
    k("tessera.elastic.replica_check_interval", UInt, H, "every this many steps each replica's blake3 is compared with its owner's shard (a mismatch forces a full copy); 0 = never; default 50"),
    k("tessera.device", Str, H, "where each rank computes its forward and backward: \"cpu\" (default) or \"cuda\" (`train --device cuda` sets it; docs/GPU.md)"),
    k("tessera.gpu", Section, H, "GPU ranks (docs/GPU.md)"),
    k("tessera.gpu.collective", Str, H, "\"nccl\" (default): one rank per GPU of this host (threads of the driver, the engine's step loop), NCCL, parameters and optimizer on the GPU, not elastic; \"quic\": GPU ranks of the one engine — forward and backward on the GPU, gradients staged to the host and reduced over the run's transport (QUIC between processes and hosts) by the fixed tree, the optimizer on the host; every ZeRO stage, `tessera.elastic`, hosts NCCL cannot connect"),
    k("tessera.pipeline", Section, H, "Tessera's pipeline keys beside DeepSpeed's pipeline section"),
    k("tessera.pipeline.schedule", Str, H, "\"1f1b\" (default: PipeDream-flush, DeepSpeed's TrainSchedule; at most S − p micro-batches in flight on stage p), \"gpipe\" (every forward, then every backward), \"interleaved\" (Megatron-LM's interleaved 1F1B: each stage runs virtual_stages chunks of the model; the bubble shrinks by that factor) or \"zb-h1\" (zero bubble: each backward split into its input-gradient half and its weight-gradient half, which fills the cool-down; 1F1B's memory)"),
    k("tessera.pipeline.virtual_stages", UInt, H, "chunks a stage for the interleaved schedule (Megatron-LM's virtual_pipeline_model_parallel_size): stage p runs the model's spans c·S + p; at least 2, default 2; other schedules take only 1"),
    k("tessera.pipeline.profile", Section, H, "the profile partition's costs in milliseconds of one micro-batch's forward and backward: what `tessera train` measured (recorded in the resolved config and summary.json), or given to skip the measurement; read only with pipeline.partition = \"profile\""),
    k("tessera.pipeline.profile.blocks_ms", FloatList, H, "one cost per transformer block, in order"),
    k("tessera.pipeline.profile.embeddings_ms", Float, H, "the embeddings' forward and backward (on the first stage); default 0"),
    k("tessera.pipeline.profile.head_ms", Float, H, "the final norm, head and loss, forward and backward (on the last stage); default 0"),
    k("tessera.moe", Section, H, "mixture-of-experts blocks: DeepSpeed's deepspeed.moe.layer.MoE arguments (DeepSpeed sets them in code; docs/MOE.md). On a dense model (a preset, a GPT-2/LLaMA/Mistral/Qwen2 folder) it makes every expert_interval-th block's MLP num_experts experts of the block's MLP kind and width; on a Mixtral / Qwen2-MoE model the architecture is its config.json's: contradicting keys and capacity keys are refused by name"),
    k("tessera.moe.num_experts", UInt, H, "experts per MoE block, at least 1 (DeepSpeed's num_experts); required on a dense model; on an MoE model it must equal its config.json's"),
    k("tessera.moe.ep_size", UInt, H, "expert-parallel group size (DeepSpeed's ep_size): ranks that split each MoE block's experts; at least 1, must divide num_experts; default 1 (docs/MOE.md, \"Expert parallelism\")"),
    k("tessera.moe.k", UInt, H, "experts per token, top-k (DeepSpeed's k), at most num_experts; default 1 on a dense model (the weights renormalised when above 1, as DeepSpeed's top-2); on an MoE model it must equal its num_experts_per_tok"),
    k("tessera.moe.capacity_factor", Float, H, "training capacity: max(min_capacity, ceil(capacity_factor · k · tokens / num_experts)) slots per expert and micro-batch; default 1.0; refused on a (dropless) Mixtral / Qwen2-MoE model"),
    k("tessera.moe.eval_capacity_factor", Float, H, "the same in evaluation; default 1.0; refused on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.min_capacity", UInt, H, "least slots per expert; default 4; refused on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.noisy_gate_policy", Str, H, "null (default), \"Jitter\" (router input times seeded uniform noise in [0.99, 1.01], training) or \"RSample\" (seeded Gumbel noise on the logits when choosing, training); the noise is keyed by the seed and the micro-batch, so it does not depend on world size; refused (non-null) on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.drop_tokens", Bool, H, "default true: tokens beyond an expert's capacity skip it (their residual passes); false keeps every token (dropless: no capacity, so capacity_factor, eval_capacity_factor, min_capacity and use_rts are refused beside it); refused on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.use_residual", Bool, H, "PR-MoE (DeepSpeed's use_residual): a dense MLP beside the experts, mixed by a learned two-way softmax; default false; refused (true) on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.use_rts", Bool, H, "random token selection: capacity slots go to tokens in a seeded random order; default true (DeepSpeed's); refused on a Mixtral / Qwen2-MoE model"),
    k("tessera.moe.expert_interval", UInt, H, "block l (from 0) is MoE when (l + 1) % expert_interval == 0 (DeepSpeed-Megatron's --expert-interval); default 2; refused on a Mixtral / Qwen2-MoE model (decoder_sparse_step / mlp_only_layers say it)"),
    k("tessera.moe.aux_loss_coef", Float, H, "weight of the load-balancing loss in the objective (DeepSpeed's l_aux, per MoE block, summed; DeepSpeed-Megatron's --moe-loss-coeff); default 0.01; on a Mixtral / Qwen2-MoE model it replaces router_aux_loss_coef (0 there unless output_router_logits)"),
    k("tessera.moe.z_loss_coef", Float, H, "weight of the router z-loss (ST-MoE: mean of logsumexp(router logits)^2); default 0"),
    k("tessera.device_memory_bytes_max", UInt, H, "per-rank budget for resident model states (params, grads, fp32 masters and moments, as model_state_bytes_per_rank counts them; offloaded states excluded, activations not counted); a run over it is refused at start. GPU ranks count their device states: bf16 params (+ stage-3 gather buffers), f32 gradient buffers (micro-batch tree + reduced shard), fp32 masters, moments and decay mask not offloaded; default: none"),
];

/// Every known key, in documentation order.
pub fn key_table() -> &'static [KeyInfo] {
    use std::sync::OnceLock;
    static ALL: OnceLock<Vec<KeyInfo>> = OnceLock::new();
    ALL.get_or_init(|| [BATCH_AND_OPTIMIZER, ZERO, PRECISION_AND_MISC, OTHER_DEEPSPEED, TESSERA].concat())
}

/// The table entry for an exact dotted path.
pub fn lookup(path: &str) -> Option<&'static KeyInfo> {
    key_table().iter().find(|k| k.path == path)
}

/// Direct child key names of a section path (`""` = top level).
pub(crate) fn children(section: &str) -> Vec<&'static str> {
    key_table()
        .iter()
        .filter_map(|k| match section {
            "" => Some(k.path).filter(|p| !p.contains('.')),
            s => k.path.strip_prefix(s).and_then(|rest| rest.strip_prefix('.')).filter(|rest| !rest.contains('.')),
        })
        .collect()
}

/// Whether `path` is honoured, taking every enclosing section into account.
pub fn effectively_honoured(path: &str) -> bool {
    let mut prefix = String::new();
    for part in path.split('.') {
        prefix = crate::config::value::join(&prefix, part);
        if lookup(&prefix).is_some_and(|k| !k.honoured) {
            return false;
        }
    }
    lookup(path).is_some()
}

/// Levenshtein edit distance between two strings (by chars).
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `word`, when it is close enough to be a plausible typo
/// (distance ≤ max(2, len/3)) or one contains the other.
pub(crate) fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = 2.max(word.chars().count() / 3);
    let lower = word.to_lowercase();
    candidates
        .iter()
        .map(|c| (edit_distance(&lower, &c.to_lowercase()), *c))
        .filter(|(d, c)| *d <= limit || (lower.len() >= 4 && c.contains(lower.as_str())))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}
