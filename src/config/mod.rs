//! The DeepSpeed-JSON config layer: loads an unmodified DeepSpeed config (plus Tessera's own
//! `"tessera"` section), applies `--set` overrides, rewrites legacy keys, validates every key
//! against the key table, resolves `"auto"`, applies the batch rule and yields a typed
//! [`Config`] with warnings, the resolved JSON and its hash.

mod auto;
mod batch;
mod elastic;
mod error;
mod keys;
mod legacy;
pub(crate) mod moe;
mod optim;
mod overrides;
mod pipeline;
mod reader;
mod render;
mod schema;
mod sections;
pub(crate) mod value;

#[cfg(test)]
mod tests;

use std::path::Path;

use serde_json::{json, Value};

pub use auto::{AutoDefaults, AutoSource, ResolveContext, AUTO_RULES};
pub use batch::Batch;
pub use elastic::{compute_elastic_batch, elastic_run, ElasticBatch, ElasticRun, ElasticityConfig, ELASTICITY_VERSION};
pub use error::{ConfigError, ConfigErrorKind};
pub use keys::{effectively_honoured, key_table, lookup, KeyInfo, KeyKind};
pub use legacy::LEGACY_KEYS;
pub use moe::{MoeSection, AUX_LOSS_COEF_DEFAULT, EXPERT_INTERVAL_DEFAULT, MIN_CAPACITY_DEFAULT};
pub use optim::OptimizerConfig;
pub use pipeline::PipelineSection;
pub use render::{render_check, render_markdown_table};
pub use sections::{
    ActivationCheckpointingConfig, AioConfig, ComputeDevice, Fp16Config, GpuCollective, MonitorConfig, MonitorTarget, OffloadDevice,
    OffloadOptimizerConfig, OffloadParamConfig, Precision, TesseraConfig, ZeroConfig,
};

pub use crate::schedule::SchedulerConfig;

use error::KindResult;

/// A fully validated and resolved training config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Where the config came from (the file path, or `<inline>`).
    pub source: String,
    pub train_batch_size: usize,
    pub micro_batch_per_gpu: usize,
    pub gradient_accumulation_steps: usize,
    /// Number of workers the batch rule used.
    pub world_size: usize,
    pub optimizer: OptimizerConfig,
    pub scheduler: Option<SchedulerConfig>,
    pub precision: Precision,
    /// Max global gradient norm; 0 = no clipping.
    pub gradient_clipping: f32,
    pub zero: ZeroConfig,
    /// Recompute activations in backward (`tessera.activation_checkpointing`, or the
    /// DeepSpeed `activation_checkpointing` section being present).
    pub activation_checkpointing: bool,
    pub activation_checkpointing_config: ActivationCheckpointingConfig,
    /// DeepSpeed's `pipeline` section with `tessera.pipeline` (docs/PIPELINE.md); `None`: no
    /// pipeline section.
    pub pipeline: Option<PipelineSection>,
    pub steps_per_print: u64,
    pub wall_clock_breakdown: bool,
    pub monitors: MonitorConfig,
    pub aio: AioConfig,
    /// DeepSpeed's `elasticity` section, when present. Enabled, it chose the batch triple.
    pub elasticity: Option<ElasticityConfig>,
    pub tessera: TesseraConfig,
    /// Legacy rewrites, keys accepted but not honoured yet, and other notices.
    pub warnings: Vec<String>,
    /// Dotted paths of the known keys present in the user's config (after legacy rewrites).
    pub present_keys: Vec<String>,
    /// The resolved JSON: overrides applied, legacy keys rewritten, `"auto"` filled,
    /// integers normalised and the batch triple completed.
    pub resolved: Value,
    /// blake3 hex of the canonical (sorted-key, compact) serialisation of `resolved`.
    pub hash: String,
}

/// Load the config file at `path`, apply `overrides` (`"a.b.c=VALUE"`) and resolve it.
pub fn load(path: &Path, overrides: &[String], ctx: &ResolveContext) -> Result<Config, ConfigError> {
    let source = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => from_str_named(&text, &source, overrides, ctx),
        Err(e) => Err(ConfigError::new(source, ConfigErrorKind::Io(e))),
    }
}

/// Parse config text; `source` names it in errors.
pub fn from_str_named(text: &str, source: &str, overrides: &[String], ctx: &ResolveContext) -> Result<Config, ConfigError> {
    let raw = value::parse_text(text).map_err(|kind| ConfigError::new(source, kind))?;
    build(raw, source, overrides, ctx).map_err(|kind| blame(source, overrides, kind))
}

/// `kind` as an error of `source`, naming the override that set the key it is about, if any.
fn blame(source: &str, overrides: &[String], kind: ConfigErrorKind) -> ConfigError {
    let set_by = kind.path().and_then(|path| overrides::setting(overrides, path)).map(Box::from);
    ConfigError { file: source.to_string(), kind, set_by }
}

/// Resolve an in-memory config (errors name the file `<inline>`).
pub fn from_value(raw: Value, overrides: &[String], ctx: &ResolveContext) -> Result<Config, ConfigError> {
    build(raw, "<inline>", overrides, ctx).map_err(|kind| blame("<inline>", overrides, kind))
}

/// The whole pipeline: overrides → legacy → schema → auto → batch → typed sections.
fn build(mut root: Value, source: &str, overrides: &[String], ctx: &ResolveContext) -> KindResult<Config> {
    // Checked before the overrides: a file that is not an object is the file's fault, not the
    // first `--set`'s (train's own flags are `--set`s too).
    if !root.is_object() {
        return Err(ConfigErrorKind::invalid("(top level)", &root, "a JSON object"));
    }
    overrides::apply(&mut root, overrides)?;
    let Value::Object(map) = &mut root else {
        return Err(ConfigErrorKind::invalid("(top level)", &root, "a JSON object"));
    };
    let mut warnings = Vec::new();
    legacy::rewrite(map, &mut warnings)?;
    let walk = schema::check(map)?;
    warnings.extend(walk.warnings);
    auto::resolve(&mut root, ctx)?;
    let mut tessera = sections::parse_tessera(&root)?;
    let world = ctx.world_size.unwrap_or(tessera.world);
    if world == 0 {
        return Err(ConfigErrorKind::invalid("tessera.world", &json!(0), "at least 1 worker"));
    }
    tessera.world = world;
    let pipeline = pipeline::parse_pipeline(&root)?;
    // The batch rule counts data-parallel ranks: with pipeline stages, world / stages.
    let stages = pipeline.as_ref().map_or(1, |p| p.stages);
    if world % stages != 0 {
        return Err(ConfigErrorKind::invalid(
            "pipeline.stages",
            &json!(stages),
            &format!("a divisor of the world size {world} (each data-parallel replica is a whole pipeline)"),
        ));
    }
    let dp = world / stages;
    let elasticity = elastic::parse_elasticity(&root)?;
    let batch = match elasticity.as_ref().filter(|e| e.enabled) {
        Some(e) => {
            let (elastic, micro, accum) = elastic::elastic_batch_triple(&root, e, dp)?;
            Batch { train_batch_size: elastic.train_batch_size, micro_batch_per_gpu: micro, gradient_accumulation_steps: accum }
        }
        None => batch::derive(&root, dp)?,
    };
    fill_resolved(&mut root, &batch, ctx.world_size);
    let optimizer = optim::parse_optimizer(&root, ctx)?;
    let scheduler = optim::parse_scheduler(&root, &mut warnings)?;
    let (ac_present, activation_checkpointing_config) = sections::parse_activation(&root)?;
    let top = reader::Obj::at(&root, "")?;
    Ok(Config {
        source: source.to_string(),
        train_batch_size: batch.train_batch_size,
        micro_batch_per_gpu: batch.micro_batch_per_gpu,
        gradient_accumulation_steps: batch.gradient_accumulation_steps,
        world_size: world,
        optimizer,
        scheduler,
        precision: sections::parse_precision(&root)?,
        gradient_clipping: top.non_negative_f32("gradient_clipping", 0.0)?,
        zero: sections::parse_zero(&root)?,
        activation_checkpointing: tessera.activation_checkpointing || ac_present || pipeline.as_ref().is_some_and(|p| p.recompute),
        pipeline,
        activation_checkpointing_config,
        steps_per_print: top.u64("steps_per_print", 10)?,
        wall_clock_breakdown: top.bool("wall_clock_breakdown", false)?,
        monitors: sections::parse_monitors(&root)?,
        aio: sections::parse_aio(&root)?,
        elasticity,
        tessera,
        warnings,
        present_keys: walk.present,
        hash: value::canonical_hash(&root),
        resolved: root,
    })
}

/// The world sizes this run's global batch can be kept with: DeepSpeed's elastic list when
/// `elasticity.enabled`, else only the configured world size (the batch triple fixes it).
pub fn elastic_world_sizes(cfg: &Config) -> Vec<usize> {
    match cfg.elasticity.as_ref().filter(|e| e.enabled) {
        // `build` already computed it once, so it cannot fail here.
        Some(e) => compute_elastic_batch(e).map(|b| b.world_sizes).unwrap_or_default(),
        None => vec![cfg.world_size],
    }
}

/// Write the completed batch triple (and a command-line world size) into the resolved JSON.
fn fill_resolved(root: &mut Value, batch: &Batch, cli_world: Option<usize>) {
    root["train_batch_size"] = json!(batch.train_batch_size);
    root["train_micro_batch_size_per_gpu"] = json!(batch.micro_batch_per_gpu);
    root["gradient_accumulation_steps"] = json!(batch.gradient_accumulation_steps);
    if let Some(world) = cli_world {
        if !root.get("tessera").is_some_and(Value::is_object) {
            root["tessera"] = json!({});
        }
        root["tessera"]["world"] = json!(world);
    }
}
