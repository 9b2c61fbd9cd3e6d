//! The end-of-run summary: what a user reads at the end and what tests compare
//! (`params_blake3` is the bit-for-bit fingerprint of the parameters).

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Every step of `tessera.steps` ran.
    Completed,
    /// A signal (or standard output closing) stopped it early, after a checkpoint.
    Interrupted,
    /// An error ended it (`error` says which).
    Failed,
}

/// What every `summary.json` (CPU and GPU) says about the run itself: how it ended, which
/// build ran it, with which seed, and when.
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub status: RunStatus,
    /// What stopped an interrupted run (`SIGTERM`, `standard output closed`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<String>,
    /// What ended a failed run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The `tessera` version and the git commit it was built from ("unknown" outside git).
    pub version: String,
    pub commit: String,
    pub seed: u64,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub ended_at: String,
}

impl RunRecord {
    /// A run that started at `started` and ends now.
    pub fn new(status: RunStatus, seed: u64, started: SystemTime) -> Self {
        RunRecord {
            status,
            stopped_by: None,
            error: None,
            version: env!("CARGO_PKG_VERSION").to_string(),
            commit: env!("TESSERA_COMMIT").to_string(),
            seed,
            started_at: rfc3339(started),
            ended_at: rfc3339(SystemTime::now()),
        }
    }
}

/// `t` as RFC 3339 in UTC with milliseconds, e.g. `2026-12-03T16:50:01.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (secs, ms) = (d.as_secs(), d.subsec_millis());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar, in eras of
    // 400 years = 146097 days, years starting in March so the leap day comes last).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

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
    #[serde(flatten)]
    pub run: RunRecord,
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
    /// Peak resident set size of the driver process (with thread ranks, of every rank).
    pub peak_rss_bytes: u64,
    /// Each rank's own process's peak resident set size, when ranks are processes (absent
    /// when they are threads of the driver: `peak_rss_bytes` is theirs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes_per_rank: Option<Vec<u64>>,
    pub world_size: usize,
    /// Where the ranks computed: "cpu", or "cuda" (GPU ranks of the engine, `tessera.device`).
    pub device: String,
    pub zero_stage: u8,
    pub precision: String,
    pub config_hash: String,
    /// Bytes the busiest rank sent through collectives per step (mean over the run); absent
    /// where the collectives are NCCL's (not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_sent_per_rank_per_step: Option<u64>,
    /// Model states each rank holds, by kind (ZeRO's Ψ accounting).
    pub model_state_bytes_per_rank: Vec<MemoryBytes>,
    /// Model states each rank keeps outside its device budget (offload), by tier.
    pub offloaded_bytes_per_rank: Vec<crate::offload::OffloadedBytes>,
    pub last_checkpoint: Option<String>,
    /// What an elastic run went through (absent when elasticity is off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub elastic: Option<ElasticSummary>,
    /// The mixture-of-experts routing over the run (absent for dense models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<super::moe_stats::MoeSummary>,
    /// The pipeline's stages and measured bubble (absent without pipeline stages).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<super::pipeline::report::PipelineSummary>,
    /// The NCCL GPU trainer's device figures (absent elsewhere).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuFigures>,
}

/// What the NCCL GPU trainer adds to the summary.
#[derive(Clone, Debug, Serialize)]
pub struct GpuFigures {
    /// The GPU model (rank 0's).
    pub gpu: String,
    /// Device memory each rank allocated (parameters, gradients, optimizer, activations).
    pub device_bytes_per_rank: Vec<u64>,
    /// Optimizer offload figures of rank 0, when offloaded.
    pub offload: Option<HostOptimizerFigures>,
}

/// What the NCCL GPU trainer's host optimizer did (rank 0).
#[derive(Clone, Debug, Serialize)]
pub struct HostOptimizerFigures {
    /// `offload_optimizer.ratio`: the share of each unit's optimizer piece stepped on the host.
    pub ratio: f64,
    pub cpu_threads: usize,
    /// Page-locked staging buffers (gradients in, bf16 parameters out).
    pub pinned_bytes: u64,
    /// Mean per step: host AdamW compute, and the part of it not hidden behind the GPU.
    pub cpu_step_ms: f64,
    pub exposed_ms: f64,
    pub hidden_fraction: f64,
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
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let where_ = match &self.gpu {
            Some(g) => format!("{} × {}", self.world_size, g.gpu),
            None => format!("world {}, {}", self.world_size, self.device),
        };
        let mut device = String::new();
        if let Some(g) = &self.gpu {
            let max_dev = g.device_bytes_per_rank.iter().copied().max().unwrap_or(0);
            device += &format!("device memory  {:.1} MiB per rank\n", mib(max_dev));
            if let Some(m) = self.model_state_bytes_per_rank.first() {
                device += &format!(
                    "model states   {:.1} MiB per rank on the GPU (params {:.1}, grads {:.1}, optimizer {:.1})\n",
                    mib(m.total),
                    mib(m.params),
                    mib(m.grads),
                    mib(m.optimizer_states)
                );
            }
            if let (Some(o), Some(b)) = (&g.offload, self.offloaded_bytes_per_rank.first()) {
                device += &format!(
                    "offload        {:.1} MiB per rank in host memory (ratio {}), {} CPU threads: host AdamW {:.1} ms/step, {:.0}% hidden\n",
                    mib(b.host),
                    o.ratio,
                    o.cpu_threads,
                    o.cpu_step_ms,
                    100.0 * o.hidden_fraction
                );
            }
        }
        let moe = self.moe.as_ref().map(|m| m.line()).unwrap_or_default() + &self.pipeline.as_ref().map(|p| p.line()).unwrap_or_default();
        format!(
            "── summary ──────────────────────────────────────────\n\
             model          {} ({:.2}M params, {}, ZeRO-{}, {where_})\n\
             steps          {} ({} skipped, {} abandoned and rerun)\n\
             train loss     {:.4}\n\
             val loss       {} (from {})\n\
             throughput     {:.0} tokens/s over {:.1} s\n\
             peak RSS       {:.1} MiB\n\
             {moe}{device}params_blake3  {}\n",
            self.model,
            self.num_params as f64 / 1e6,
            self.precision,
            self.zero_stage,
            self.steps,
            self.skipped_steps,
            self.abandoned_attempts,
            self.final_loss,
            val(self.val_loss),
            val(self.initial_val_loss),
            self.tokens_per_s,
            self.wall_s,
            mib(self.peak_rss_bytes),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let at = |s: u64, ms: u64| rfc3339(UNIX_EPOCH + Duration::from_secs(s) + Duration::from_millis(ms));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a year divisible by 400) and the day after.
        assert_eq!(at(951_782_400 + 3_723, 45), "2000-02-29T01:02:03.045Z");
        assert_eq!(at(951_868_800, 0), "2000-03-01T00:00:00.000Z");
        assert_eq!(at(1_798_761_599, 999), "2026-12-31T23:59:59.999Z");
    }
}
