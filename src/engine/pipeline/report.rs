//! What a pipelined run reports: per step the measured bubble of replica 0's stages (from the
//! workers' timed instructions, [`tessera_actors::compute::Prepared::timeline`]), the run's
//! mean against the theory in `summary.json` and on the console ([`PipelineSummary`]), and the
//! last step's picture, `pipeline.svg` beside `loss.svg` ([`super::timeline::svg`]).

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use tessera_actors::compute::StepResult;

use super::schedule::{self, peak_in_flight};
use super::timeline::{self, Timed};
use super::PipePlan;

/// The pipeline in `summary.json`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PipelineSummary {
    pub stages: usize,
    pub replicas: usize,
    pub schedule: String,
    /// Chunks a stage (the interleaved schedule's virtual stages; 1 for the others).
    pub chunks_per_stage: usize,
    /// The `profile` partition's costs the stages were cut by.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<super::profile::BlockCosts>,
    /// Each stage's blocks `[first, end)`, per chunk.
    pub blocks_per_stage: Vec<Vec<[usize; 2]>>,
    /// Micro-batches per replica and step.
    pub micro_batches_per_replica: usize,
    /// The schedule's bubble in unit time ([`schedule::bubble_in_theory`]): `(S − 1)/(M + S − 1)`
    /// for GPipe and 1F1B.
    pub bubble_theory: f64,
    /// Replica 0's measured idle share of its stages between the step's first forward and
    /// last backward, averaged over the steps after the first (the first too when it is the
    /// only one).
    pub bubble_measured: f64,
    /// The most micro-batch chunks each stage holds activations of at once.
    pub peak_in_flight_per_stage: Vec<usize>,
    /// The most weight stashes each stage holds at once (ZB-H1's; 0 for the other schedules).
    pub peak_weight_stashes_per_stage: Vec<usize>,
    /// The most activation bytes any rank of each stage held at once, over the run.
    pub peak_activation_bytes_per_stage: Vec<u64>,
}

/// The run's pipeline figures, added to step by step.
#[derive(Debug, Default)]
pub struct PipelineTally {
    bubbles: Vec<f64>,
    last: Vec<Timed>,
    activation_peak: Vec<u64>,
}

impl PipelineTally {
    /// Takes replica 0's timed instructions of a committed step.
    pub fn add(&mut self, pp: &PipePlan, res: &StepResult) {
        self.activation_peak.resize(pp.stages, 0);
        // (A step committed just before a recovery re-planned the world may have more ranks.)
        for (r, p) in res.per_rank.iter().enumerate().take(pp.stages * pp.replicas) {
            let s = pp.stage_of(r);
            self.activation_peak[s] = self.activation_peak[s].max(p.activation_bytes_peak);
        }
        let ops: Vec<Timed> = (0..pp.stages)
            .filter_map(|p| res.per_rank.get(pp.rank(p, 0)).map(|r| (p, r)))
            .flat_map(|(p, r)| r.timeline.iter().map(move |o| Timed::from_op(p, o)))
            .collect();
        if ops.is_empty() {
            return;
        }
        self.bubbles.push(timeline::bubble(&ops, pp.stages));
        self.last = ops;
    }

    pub fn summary(&self, pp: &PipePlan, micro_batches_per_replica: usize) -> PipelineSummary {
        let m = micro_batches_per_replica.max(1);
        let s = pp.stages;
        let measured = match self.bubbles.len() {
            0 => f64::NAN,
            1 => self.bubbles[0],
            n => self.bubbles[1..].iter().sum::<f64>() / (n - 1) as f64,
        };
        let streams = schedule::streams(pp.schedule, s, pp.chunks, m);
        PipelineSummary {
            stages: s,
            replicas: pp.replicas,
            schedule: pp.schedule.name().to_string(),
            chunks_per_stage: pp.chunks,
            profile: match &pp.method {
                super::PartitionMethod::Profile(c) => c.clone(),
                _ => None,
            },
            blocks_per_stage: pp.blocks_per_stage(),
            micro_batches_per_replica: m,
            bubble_theory: schedule::bubble_in_theory(pp.schedule, s, pp.chunks, m),
            bubble_measured: measured,
            peak_in_flight_per_stage: streams.iter().map(|st| peak_in_flight(st)).collect(),
            peak_weight_stashes_per_stage: streams.iter().map(|st| schedule::peak_weight_stashes(st)).collect(),
            peak_activation_bytes_per_stage: (0..s).map(|p| self.activation_peak.get(p).copied().unwrap_or(0)).collect(),
        }
    }

    /// Writes the last step's picture to `path` (nothing when no step ran).
    pub fn write_svg(&self, pp: &PipePlan, path: &Path) -> Result<()> {
        if self.last.is_empty() {
            return Ok(());
        }
        // Times in milliseconds.
        let ms: Vec<Timed> = self.last.iter().map(|t| Timed { start_s: t.start_s * 1e3, end_s: t.end_s * 1e3, ..*t }).collect();
        let title = format!("last step, replica 0: {} stages, {}", pp.stages, pp.schedule);
        std::fs::write(path, timeline::svg(&ms, pp.stages, &title, "ms")).with_context(|| format!("writing {}", path.display()))
    }
}

impl PipelineSummary {
    /// The console's line.
    pub fn line(&self) -> String {
        format!(
            "pipeline       {} stages × {} replicas, {}, bubble {:.1} % measured ({:.1} % in theory)\n",
            self.stages,
            self.replicas,
            self.schedule,
            100.0 * self.bubble_measured,
            100.0 * self.bubble_theory
        )
    }
}
