//! DeepSpeed's `pipeline` section (`stages`, `partition`, `seed_layers`,
//! `activation_checkpoint_interval`, `pipe_partitioned`, `grad_partitioned`) and the
//! `tessera.pipeline` keys (`schedule`, `virtual_stages`, `profile`): pipeline parallelism (docs/PIPELINE.md). DeepSpeed
//! gives the stage count and the partition method to `PipelineModule` in code; here they are
//! keys of the config.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::reader::Obj;
use crate::engine::pipeline::profile::BlockCosts;
use crate::engine::pipeline::{PartitionMethod, Schedule};

/// The pipeline a run asked for (`pipeline.stages` > 1 or the section present).
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSection {
    /// Stages `S`; the data-parallel size is `world / S`.
    pub stages: usize,
    pub partition: PartitionMethod,
    pub schedule: Schedule,
    /// Chunks a stage (`tessera.pipeline.virtual_stages`, the interleaved schedule's; 1 for
    /// the others).
    pub chunks: usize,
    /// `activation_checkpoint_interval`: 0 keeps activations, 1 recomputes every block.
    pub recompute: bool,
}

/// Reads the `pipeline` section and `tessera.pipeline`; `None` when neither is present.
pub(crate) fn parse_pipeline(root: &Value) -> KindResult<Option<PipelineSection>> {
    let p = Obj::at(root, "pipeline")?;
    let t = Obj::at(root, "tessera.pipeline")?;
    if !p.present() && !t.present() {
        return Ok(None);
    }
    let stages = match p.opt_u64("stages")? {
        Some(0) => return Err(ConfigErrorKind::invalid(&p.path("stages"), &Value::from(0), "at least 1 stage")),
        Some(n) => usize::try_from(n).map_err(|_| ConfigErrorKind::invalid(&p.path("stages"), &Value::from(n), "a smaller integer"))?,
        None => 1,
    };
    let partition_text = p.string("partition", "parameters")?;
    let partition = PartitionMethod::parse(&partition_text)
        .map_err(|want| ConfigErrorKind::invalid(&p.path("partition"), &Value::String(partition_text.clone()), &want))?;
    let partition = match (partition, Obj::at(root, "tessera.pipeline.profile")?) {
        (PartitionMethod::Profile(None), prof) if prof.present() => PartitionMethod::Profile(Some(block_costs(&prof)?)),
        (_, prof) if prof.present() => {
            return Err(ConfigErrorKind::invalid(
                &p.path("partition"),
                &Value::String(partition_text.clone()),
                "\"profile\" with tessera.pipeline.profile (the blocks' costs are read only by the profile partition)",
            ))
        }
        (partition, _) => partition,
    };
    let schedule_text = t.string("schedule", Schedule::OneFOneB.name())?;
    let schedule = Schedule::parse(&schedule_text).ok_or_else(|| {
        let names: Vec<String> = Schedule::ALL.iter().map(|s| format!("\"{s}\"")).collect();
        ConfigErrorKind::invalid(&t.path("schedule"), &Value::String(schedule_text.clone()), &names.join(" or "))
    })?;
    let chunks = match (t.opt_u64("virtual_stages")?, schedule.chunked()) {
        (None, true) => 2,
        (None, false) | (Some(1), false) => 1,
        (Some(n), true) if n >= 2 => {
            usize::try_from(n).map_err(|_| ConfigErrorKind::invalid(&t.path("virtual_stages"), &Value::from(n), "a smaller integer"))?
        }
        (Some(n), true) => {
            return Err(ConfigErrorKind::invalid(
                &t.path("virtual_stages"),
                &Value::from(n),
                "at least 2 chunks a stage for the interleaved schedule",
            ))
        }
        (Some(n), false) => {
            return Err(ConfigErrorKind::invalid(
                &t.path("virtual_stages"),
                &Value::from(n),
                &format!("1: the {schedule} schedule runs one chunk a stage (\"interleaved\" runs several)"),
            ))
        }
    };
    let recompute = match p.u64("activation_checkpoint_interval", 0)? {
        0 => false,
        1 => true,
        n => {
            return Err(ConfigErrorKind::invalid(
                &p.path("activation_checkpoint_interval"),
                &Value::from(n),
                "0 (keep activations) or 1 (recompute every block from its input; Tessera keeps every block's input, so \
                 longer intervals would save no memory)",
            ))
        }
    };
    // Checked for their type; DeepSpeed's own meaning needs no work here (see keys.rs).
    for key in ["seed_layers", "pipe_partitioned", "grad_partitioned"] {
        p.bool(key, true)?;
    }
    Ok(Some(PipelineSection { stages, partition, schedule, chunks, recompute }))
}

/// `tessera.pipeline.profile`: `blocks_ms` (a cost per block), `embeddings_ms`, `head_ms`, each
/// a non-negative number (as `tessera train` records them; a user may give their own).
fn block_costs(o: &Obj<'_>) -> KindResult<BlockCosts> {
    o.only_keys(&["blocks_ms", "embeddings_ms", "head_ms"], "tessera.pipeline.profile")?;
    let list = o.get("blocks_ms").cloned().unwrap_or(Value::Null);
    let blocks_ms: Option<Vec<f64>> =
        list.as_array().and_then(|a| a.iter().map(|v| v.as_f64().filter(|x| x.is_finite() && *x >= 0.0)).collect());
    let blocks_ms = blocks_ms
        .filter(|b| !b.is_empty())
        .ok_or_else(|| ConfigErrorKind::invalid(&o.path("blocks_ms"), &list, "a list of non-negative milliseconds, one per block"))?;
    let ms = |key: &str| -> KindResult<f64> {
        match o.get(key) {
            None => Ok(0.0),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| ConfigErrorKind::invalid(&o.path(key), v, "a non-negative number of milliseconds")),
        }
    };
    let (embeddings_ms, head_ms) = (ms("embeddings_ms")?, ms("head_ms")?);
    Ok(BlockCosts { blocks_ms, embeddings_ms, head_ms })
}
