//! DeepSpeed's `pipeline` section (`stages`, `partition`, `seed_layers`,
//! `activation_checkpoint_interval`, `pipe_partitioned`, `grad_partitioned`) and the
//! `tessera.pipeline` keys (`schedule`): pipeline parallelism (docs/PIPELINE.md). DeepSpeed
//! gives the stage count and the partition method to `PipelineModule` in code; here they are
//! keys of the config.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::reader::Obj;
use crate::engine::pipeline::{PartitionMethod, Schedule};

/// The pipeline a run asked for (`pipeline.stages` > 1 or the section present).
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSection {
    /// Stages `S`; the data-parallel size is `world / S`.
    pub stages: usize,
    pub partition: PartitionMethod,
    pub schedule: Schedule,
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
    let schedule_text = t.string("schedule", Schedule::OneFOneB.name())?;
    let schedule = Schedule::parse(&schedule_text).ok_or_else(|| {
        let names: Vec<String> = Schedule::ALL.iter().map(|s| format!("\"{s}\"")).collect();
        ConfigErrorKind::invalid(&t.path("schedule"), &Value::String(schedule_text.clone()), &names.join(" or "))
    })?;
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
    Ok(Some(PipelineSection { stages, partition, schedule, recompute }))
}
