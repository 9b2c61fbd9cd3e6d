//! The end-of-run summary: what a user reads at the end and what tests compare
//! (`params_blake3` is the bit-for-bit fingerprint of the parameters).

use std::path::Path;

use serde::Serialize;

/// The model states one rank holds.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryBytes {
    pub rank: usize,
    pub params: u64,
    pub grads: u64,
    pub optimizer_states: u64,
    pub total: u64,
}

impl From<&tessera_actors::compute::MemoryReport> for MemoryBytes {
    fn from(m: &tessera_actors::compute::MemoryReport) -> Self {
        MemoryBytes {
            rank: m.rank,
            params: m.param_bytes,
            grads: m.grad_bytes,
            optimizer_states: m.optim_bytes,
            total: m.param_bytes + m.grad_bytes + m.optim_bytes,
        }
    }
}

/// Written as `summary.json` in the output directory.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub model: String,
    pub num_params: usize,
    pub steps: u64,
    pub skipped_steps: u64,
    /// Step attempts prepared and then abandoned (each was run again).
    pub abandoned_attempts: u64,
    pub final_loss: f64,
    pub val_loss: Option<f64>,
    pub initial_val_loss: Option<f64>,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub wall_s: f64,
    /// Share of the measured GEMM peak reached by training steps (when measured).
    pub flops_per_token: f64,
    pub params_blake3: String,
    pub peak_rss_bytes: u64,
    pub world_size: usize,
    pub zero_stage: u8,
    pub precision: String,
    pub config_hash: String,
    /// Bytes the busiest rank sent through collectives per step (mean over the run).
    pub bytes_sent_per_rank_per_step: u64,
    /// Model states each rank holds, by kind (ZeRO's Ψ accounting).
    pub model_state_bytes_per_rank: Vec<MemoryBytes>,
    /// Model states each rank keeps outside its device budget (offload), by tier.
    pub offloaded_bytes_per_rank: Vec<crate::offload::OffloadedBytes>,
    pub last_checkpoint: Option<String>,
    /// What an elastic run went through (absent when elasticity is off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub elastic: Option<ElasticSummary>,
}

/// An elastic run's membership changes and the work they cost.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ElasticSummary {
    /// Plan epochs formed after the start.
    pub recoveries: u64,
    pub workers_lost: u64,
    pub workers_joined: u64,
    pub workers_drained: u64,
    /// Step attempts abandoned because a member was lost (each ran again).
    pub steps_rerun: u64,
    /// Steps whose commit failed on a lost member after every rank had prepared them, and
    /// which still counted as committed: every shard (the lost owners' in their replicas)
    /// had taken the step, so the new epoch started after it and nothing ran again.
    pub commits_completed: u64,
    /// Committed steps recomputed after a restore from a checkpoint (same bits).
    pub steps_replayed: u64,
    /// Recoveries that took the state from the members' memory (shards and replicas).
    pub restored_from_memory: u64,
    /// Recoveries that loaded a checkpoint and replayed.
    pub restored_from_checkpoint: u64,
    /// Checkpoints that could not be written (the run went on).
    pub checkpoints_failed: u64,
    /// Full replica copies sent because a member dropped a replica that had stopped matching
    /// its owner (a failed update or a differing digest); 0 in a healthy run.
    pub replicas_recopied: u64,
    /// Full replica copies sent because a member's replicas had more updates waiting than its
    /// background thread had applied (no idle CPU for it): a copy costs a transfer, the
    /// updates would have cost optimizer steps.
    pub replica_catch_up_copies: u64,
    /// Times the micro-batch blocks were re-assigned by measured worker speed (stragglers).
    pub rebalances: u64,
}

impl Summary {
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n")?;
        std::fs::rename(&tmp, path)
    }

    /// A few lines for the terminal.
    pub fn render(&self) -> String {
        let val = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        format!(
            "── summary ──────────────────────────────────────────\n\
             model          {} ({:.2}M params, {}, ZeRO-{}, world {})\n\
             steps          {} ({} skipped, {} abandoned and rerun)\n\
             train loss     {:.4}\n\
             val loss       {} (from {})\n\
             throughput     {:.0} tokens/s over {:.1} s\n\
             peak RSS       {:.1} MiB\n\
             params_blake3  {}\n",
            self.model,
            self.num_params as f64 / 1e6,
            self.precision,
            self.zero_stage,
            self.world_size,
            self.steps,
            self.skipped_steps,
            self.abandoned_attempts,
            self.final_loss,
            val(self.val_loss),
            val(self.initial_val_loss),
            self.tokens_per_s,
            self.wall_s,
            self.peak_rss_bytes as f64 / (1024.0 * 1024.0),
            self.params_blake3,
        )
    }
}

/// Peak resident set size of this process (VmHWM), 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
