//! `"auto"` resolution: what the command line and the model give the config (the
//! [`ResolveContext`]), the default table, and the per-key rules that fill `"auto"` values
//! the way the Hugging Face DeepSpeed integration does.

use serde_json::{json, Map, Value};

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::keys;
use crate::config::value::{get_path, join, num32, remove_path, set_path};

/// Fallback values for `"auto"` keys the command line did not give.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoDefaults {
    /// Optimizer learning rate (DeepSpeed's FusedAdam default).
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    pub gradient_clipping: f32,
    pub warmup_min_lr: f32,
    /// `None`: a `"auto"` warmup_num_steps needs `ResolveContext::warmup_steps`.
    pub warmup_num_steps: Option<u64>,
    pub fp16_enabled: bool,
    pub bf16_enabled: bool,
}

impl Default for AutoDefaults {
    fn default() -> Self {
        AutoDefaults {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            gradient_clipping: 1.0,
            warmup_min_lr: 0.0,
            warmup_num_steps: None,
            fp16_enabled: false,
            bf16_enabled: false,
        }
    }
}

/// What the caller knows outside the JSON: command-line values and the model's shape.
/// Command-line values fill `"auto"` keys only (and `lr` also fills a missing optimizer lr);
/// explicit numbers in the config win.
#[derive(Debug, Clone, Default)]
pub struct ResolveContext {
    /// Number of workers from the command line; `None` = `tessera.world` (default 1).
    pub world_size: Option<usize>,
    /// Model hidden size, for the ZeRO bucket-size autos.
    pub hidden_size: Option<usize>,
    /// Hidden size of a model preset by name, used when `hidden_size` is `None`
    /// (the preset is `tessera.model`, default "gpt-tiny").
    pub hidden_size_for_model: Option<fn(&str) -> Option<usize>>,
    pub lr: Option<f32>,
    pub micro_batch: Option<usize>,
    pub grad_accum: Option<usize>,
    /// Total optimizer steps; `None` = `tessera.steps`.
    pub steps: Option<u64>,
    pub warmup_steps: Option<u64>,
    pub defaults: AutoDefaults,
}

impl ResolveContext {
    /// A context with only the world size set.
    pub fn with_world(world_size: usize) -> Self {
        ResolveContext { world_size: Some(world_size), ..Default::default() }
    }
}

/// Where a `"auto"` value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoSource {
    TrainBatch,
    MicroBatch,
    GradAccum,
    Lr,
    Betas,
    Eps,
    WeightDecay,
    GradientClipping,
    WarmupMinLr,
    WarmupMaxLr,
    WarmupNumSteps,
    TotalNumSteps,
    HiddenSquared,
    HiddenSquared09,
    Hidden10,
    Fp16Enabled,
    Bf16Enabled,
}

impl AutoSource {
    /// One line for the docs table.
    pub fn describe(self) -> &'static str {
        match self {
            AutoSource::TrainBatch => "derived by the batch rule",
            AutoSource::MicroBatch => "derived by the batch rule",
            AutoSource::GradAccum => "derived by the batch rule",
            AutoSource::Lr => "1e-3",
            AutoSource::Betas => "[0.9, 0.999]",
            AutoSource::Eps => "1e-8",
            AutoSource::WeightDecay => "0",
            AutoSource::GradientClipping => "1.0",
            AutoSource::WarmupMinLr => "0",
            AutoSource::WarmupMaxLr => "the optimizer lr",
            AutoSource::WarmupNumSteps => "not resolved: give a number (in the file or with `--set`)",
            AutoSource::TotalNumSteps => "`--steps`, else tessera.steps",
            AutoSource::HiddenSquared => "hidden × hidden",
            AutoSource::HiddenSquared09 => "⌊0.9 × hidden × hidden⌋",
            AutoSource::Hidden10 => "10 × hidden",
            AutoSource::Fp16Enabled | AutoSource::Bf16Enabled => "false",
        }
    }

    fn is_batch(self) -> bool {
        matches!(self, AutoSource::TrainBatch | AutoSource::MicroBatch | AutoSource::GradAccum)
    }
}

/// The keys that may be `"auto"`, in resolution order (the optimizer lr before the
/// scheduler's warmup_max_lr, which copies it).
pub static AUTO_RULES: &[(&str, AutoSource)] = &[
    ("train_batch_size", AutoSource::TrainBatch),
    ("train_micro_batch_size_per_gpu", AutoSource::MicroBatch),
    ("gradient_accumulation_steps", AutoSource::GradAccum),
    ("optimizer.params.lr", AutoSource::Lr),
    ("optimizer.params.betas", AutoSource::Betas),
    ("optimizer.params.eps", AutoSource::Eps),
    ("optimizer.params.weight_decay", AutoSource::WeightDecay),
    ("gradient_clipping", AutoSource::GradientClipping),
    ("scheduler.params.warmup_min_lr", AutoSource::WarmupMinLr),
    ("scheduler.params.warmup_max_lr", AutoSource::WarmupMaxLr),
    ("scheduler.params.warmup_num_steps", AutoSource::WarmupNumSteps),
    ("scheduler.params.total_num_steps", AutoSource::TotalNumSteps),
    ("zero_optimization.reduce_bucket_size", AutoSource::HiddenSquared),
    ("zero_optimization.stage3_prefetch_bucket_size", AutoSource::HiddenSquared09),
    ("zero_optimization.stage3_param_persistence_threshold", AutoSource::Hidden10),
    ("fp16.enabled", AutoSource::Fp16Enabled),
    ("bf16.enabled", AutoSource::Bf16Enabled),
];

/// Replace every `"auto"` in honoured keys; all that cannot be resolved are reported in one
/// error. `"auto"` inside keys Tessera does not honour is left as written.
pub(crate) fn resolve(root: &mut Value, ctx: &ResolveContext) -> KindResult<()> {
    let mut unresolved = Vec::new();
    let mut batch_dropped = Vec::new();
    for (path, source) in AUTO_RULES {
        if get_path(root, path).and_then(Value::as_str) != Some("auto") {
            continue;
        }
        match compute(*source, root, ctx) {
            Some(v) => set_path(root, path, v).map_err(|reason| ConfigErrorKind::Override { arg: (*path).to_string(), reason })?,
            None if source.is_batch() => {
                remove_path(root, path);
                batch_dropped.push((*path).to_string());
            }
            None => unresolved.push((*path).to_string()),
        }
    }
    // Batch autos are left to the batch rule, which needs the train or micro batch size.
    let derivable = ["train_batch_size", "train_micro_batch_size_per_gpu"].iter().any(|k| root.get(k).is_some_and(|v| !v.is_null()));
    if !derivable {
        unresolved.extend(batch_dropped);
    }
    if let Some(map) = root.as_object() {
        collect_autos(map, "", &mut unresolved);
    }
    if unresolved.is_empty() {
        Ok(())
    } else {
        Err(ConfigErrorKind::UnresolvedAuto { paths: unresolved })
    }
}

/// Every remaining `"auto"` (in honoured keys) without a rule.
fn collect_autos(map: &Map<String, Value>, section: &str, out: &mut Vec<String>) {
    for (key, value) in map {
        let path = join(section, key);
        if !keys::effectively_honoured(&path) {
            continue;
        }
        match value {
            Value::String(s) if s == "auto" && !out.contains(&path) => out.push(path),
            Value::Object(obj) => collect_autos(obj, &path, out),
            Value::Array(items) if items.iter().any(|v| v == "auto") => out.push(path),
            _ => {}
        }
    }
}

fn compute(source: AutoSource, root: &Value, ctx: &ResolveContext) -> Option<Value> {
    let d = &ctx.defaults;
    let lr = ctx.lr.unwrap_or(d.lr);
    let hidden = hidden_size(root, ctx).map(|h| h as u64);
    match source {
        AutoSource::TrainBatch => None,
        AutoSource::MicroBatch => ctx.micro_batch.map(|n| json!(n)),
        AutoSource::GradAccum => ctx.grad_accum.map(|n| json!(n)),
        AutoSource::Lr => Some(num32(lr)),
        AutoSource::Betas => Some(json!([num32(d.betas.0), num32(d.betas.1)])),
        AutoSource::Eps => Some(num32(d.eps)),
        AutoSource::WeightDecay => Some(num32(d.weight_decay)),
        AutoSource::GradientClipping => Some(num32(d.gradient_clipping)),
        AutoSource::WarmupMinLr => Some(num32(d.warmup_min_lr)),
        AutoSource::WarmupMaxLr => get_path(root, "optimizer.params.lr").filter(|v| v.is_number()).cloned().or(Some(num32(lr))),
        AutoSource::WarmupNumSteps => ctx.warmup_steps.or(d.warmup_num_steps).map(|n| json!(n)),
        AutoSource::TotalNumSteps => Some(json!(total_steps(root, ctx))),
        AutoSource::HiddenSquared => hidden.map(|h| json!(h * h)),
        AutoSource::HiddenSquared09 => hidden.map(|h| json!((0.9 * (h * h) as f64) as u64)),
        AutoSource::Hidden10 => hidden.map(|h| json!(10 * h)),
        AutoSource::Fp16Enabled => Some(json!(d.fp16_enabled)),
        AutoSource::Bf16Enabled => Some(json!(d.bf16_enabled)),
    }
}

fn total_steps(root: &Value, ctx: &ResolveContext) -> u64 {
    let from_config = get_path(root, "tessera.steps").and_then(Value::as_u64);
    ctx.steps.or(from_config).unwrap_or(crate::config::TesseraConfig::default().steps)
}

fn hidden_size(root: &Value, ctx: &ResolveContext) -> Option<usize> {
    ctx.hidden_size.or_else(|| {
        let default_model = crate::config::TesseraConfig::default().model;
        let model = get_path(root, "tessera.model").and_then(Value::as_str).unwrap_or(&default_model);
        ctx.hidden_size_for_model.and_then(|f| f(model))
    })
}
