//! What a run reports of its mixture-of-experts routing: each rank sums the statistics of its
//! micro-batches ([`tally_of`], into `Prepared::moe`), the actors add the ranks' in rank order
//! (`StepResult::moe`), and the driver turns a step's tally into monitor events
//! ([`step_events`]) and the run's into `summary.json`'s `moe` object and the console's line
//! ([`MoeSummary`]). Dense models report nothing: their outputs are unchanged.

use serde::Serialize;
use tessera_actors::compute::{MoeBlockTally, MoeTally};
use tessera_kernels::model::{MoeBlockStats, MoeStats};

use crate::monitor::Event;

/// The kernels' statistics of one micro-batch as a tally of one micro-batch; `None` for a
/// dense model.
pub fn tally_of(s: &MoeStats) -> Option<MoeTally> {
    if s.blocks.is_empty() {
        return None;
    }
    let block = |b: &MoeBlockStats| MoeBlockTally {
        block: b.block,
        tokens_per_expert: b.tokens_per_expert.iter().map(|&n| u64::from(n)).collect(),
        dropped: b.dropped as u64,
    };
    Some(MoeTally {
        blocks: s.blocks.iter().map(block).collect(),
        aux_sum: f64::from(s.aux_loss),
        z_sum: s.blocks.iter().map(|b| f64::from(b.z)).sum(),
        micro_batches: 1,
    })
}

/// A step's monitor events (TensorBoard, CSV, `metrics.jsonl`) at `samples`: the mean
/// load-balancing loss and z-loss per micro-batch under Megatron-LM's tags
/// (`load_balancing_loss`, `z_loss`: the objective's terms before their coefficients), the
/// share of (token, choice) pairs dropped for capacity, and the most and least loaded expert
/// of any block (its share of the block's pairs times the number of experts: 1 is even).
pub fn step_events(m: &MoeTally, samples: u64) -> Vec<Event> {
    let mut events = vec![
        Event::new("load_balancing_loss", m.aux_mean(), samples),
        Event::new("z_loss", m.z_mean(), samples),
        Event::new("moe/dropped_fraction", m.dropped_fraction(), samples),
    ];
    if let Some((hi, lo)) = m.load_range() {
        events.push(Event::new("moe/expert_load_max", hi, samples));
        events.push(Event::new("moe/expert_load_min", lo, samples));
    }
    events
}

/// `summary.json`'s `moe` object: the routing over the steps this run ran (a resumed run's
/// from its resume on).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MoeSummary {
    /// Per MoE block: each expert's share of the block's kept (token, choice) pairs, and the
    /// share of its pairs dropped for capacity.
    pub blocks: Vec<MoeBlockSummary>,
    /// Pairs dropped for capacity over every block.
    pub dropped_fraction: f64,
    /// The most and least loaded expert of any block over the run (its share of the block's
    /// pairs times the number of experts: 1 is even); absent when no pair was kept.
    pub expert_load_max: Option<f64>,
    pub expert_load_min: Option<f64>,
    /// The last step's mean load-balancing loss and z-loss per micro-batch.
    pub final_aux_loss: f64,
    pub final_z_loss: f64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MoeBlockSummary {
    pub block: usize,
    pub token_share: Vec<f64>,
    pub dropped_fraction: f64,
}

impl MoeSummary {
    /// From the run's tally and its last step's.
    pub fn new(run: &MoeTally, last: &MoeTally) -> Self {
        let block = |b: &MoeBlockTally| MoeBlockSummary { block: b.block, token_share: b.shares(), dropped_fraction: b.dropped_fraction() };
        let range = run.load_range();
        MoeSummary {
            blocks: run.blocks.iter().map(block).collect(),
            dropped_fraction: run.dropped_fraction(),
            expert_load_max: range.map(|r| r.0),
            expert_load_min: range.map(|r| r.1),
            final_aux_loss: last.aux_mean(),
            final_z_loss: last.z_mean(),
        }
    }

    /// The console summary's line.
    pub fn line(&self) -> String {
        let load = match (self.expert_load_min, self.expert_load_max) {
            (Some(lo), Some(hi)) => format!("{lo:.2}–{hi:.2}"),
            _ => "-".to_string(),
        };
        format!(
            "moe            {} blocks | aux {:.4} | z {:.4} | dropped {:.2}% | expert load {load} (1 = even)\n",
            self.blocks.len(),
            self.final_aux_loss,
            self.final_z_loss,
            100.0 * self.dropped_fraction
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(tokens: [[u64; 2]; 2], dropped: u64, aux: f64) -> MoeTally {
        let block = |(i, t): (usize, [u64; 2])| MoeBlockTally { block: 2 * i + 1, tokens_per_expert: t.to_vec(), dropped };
        MoeTally { blocks: tokens.into_iter().enumerate().map(block).collect(), aux_sum: aux, z_sum: 2.0 * aux, micro_batches: 2 }
    }

    #[test]
    fn a_steps_events_and_the_runs_summary_say_what_the_router_did() {
        let step = tally([[6, 2], [4, 4]], 2, 3.0);
        let tags: Vec<(String, f64)> = step_events(&step, 64).into_iter().map(|e| (e.tag, e.value)).collect();
        assert_eq!(
            tags,
            vec![
                ("load_balancing_loss".to_string(), 1.5),
                ("z_loss".to_string(), 3.0),
                ("moe/dropped_fraction".to_string(), 4.0 / 20.0),
                ("moe/expert_load_max".to_string(), 1.5),
                ("moe/expert_load_min".to_string(), 0.5),
            ]
        );
        let mut run = step.clone();
        run.add(&tally([[2, 6], [4, 4]], 0, 1.0));
        let s = MoeSummary::new(&run, &tally([[2, 6], [4, 4]], 0, 1.0));
        assert_eq!(s.blocks[0], MoeBlockSummary { block: 1, token_share: vec![0.5, 0.5], dropped_fraction: 2.0 / 18.0 });
        assert_eq!((s.dropped_fraction, s.final_aux_loss, s.final_z_loss), (4.0 / 36.0, 0.5, 1.0));
        assert_eq!((s.expert_load_max, s.expert_load_min), (Some(1.0), Some(1.0)));
        assert_eq!(s.line(), "moe            2 blocks | aux 0.5000 | z 1.0000 | dropped 11.11% | expert load 1.00–1.00 (1 = even)\n");
    }
}
