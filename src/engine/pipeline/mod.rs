//! Pipeline parallelism's plan ([`PipePlan`]): the model cut into `S` stages of contiguous
//! blocks, `D = world / S` data-parallel replicas of the pipeline, which rank runs which stage,
//! and who supplies each micro-batch's gradients to the partition owners.
//!
//! Ranks follow DeepSpeed's `PipeDataParallelTopology` (axes pipe, then data): rank
//! `p·D + d` is stage `p` of replica `d`. Replica `d` runs the micro-batches the plan's blocks
//! give its last stage (the one computing the loss); every stage of the replica runs them in
//! the schedule's order ([`schedule`]). A stage computes the gradients of its blocks; the last
//! stage also those of unit 0 (embeddings, final norm, tied head: the head's backward there,
//! then the embeddings' with d(embeddings) from the first stage, in one worker's order), so tied
//! weights are one tensor with one gradient, never two copies to keep equal.
//!
//! Each stage adds its micro-batches' gradients with the same fixed tree as one worker (leaf by
//! leaf, block by block) and, after the step's schedule, sends the block sums to the owners of
//! the ZeRO partition, which stays over the whole world and combines them in leaf order
//! ([`PipePlan::suppliers`]). So the parameters do not depend on `S`, the schedule, `D` or the
//! ZeRO stage: they are the unpipelined run's bits.

pub mod profile;
pub mod report;
pub mod schedule;
pub mod timeline;

use std::ops::Range;

use tessera_kernels::model::{Model, StageSpan};

pub use schedule::Schedule;

/// How the blocks are split into stages (DeepSpeed's `PipelineModule(partition_method=…)`).
#[derive(Clone, Debug, PartialEq)]
pub enum PartitionMethod {
    /// Balance the blocks' parameter counts (DeepSpeed's default).
    Parameters,
    /// Balance the number of blocks.
    Uniform,
    /// Balance the number of blocks whose kind matches the pattern (case-insensitive):
    /// `gpt-block`, `llama-block`, and `moe` for blocks with experts.
    Type(String),
    /// Balance the measured time of each block's forward and backward, the embeddings' on the
    /// first stage and the head's on the last ([`profile`]); `None` until measured.
    Profile(Option<profile::BlockCosts>),
}

impl PartitionMethod {
    /// Parses `parameters`, `uniform` or `type:REGEX`.
    pub fn parse(s: &str) -> Result<PartitionMethod, String> {
        match s.to_ascii_lowercase().as_str() {
            "parameters" => Ok(PartitionMethod::Parameters),
            "uniform" => Ok(PartitionMethod::Uniform),
            "profile" => Ok(PartitionMethod::Profile(None)),
            _ => match s.split_once(':') {
                Some((t, re)) if t.eq_ignore_ascii_case("type") => {
                    regex::RegexBuilder::new(re)
                        .case_insensitive(true)
                        .build()
                        .map_err(|e| format!("type:{re}: not a regular expression: {e}"))?;
                    Ok(PartitionMethod::Type(re.to_string()))
                }
                _ => Err("\"parameters\", \"uniform\", \"type:REGEX\" or \"profile\"".to_string()),
            },
        }
    }

    /// As the config names it.
    pub fn name(&self) -> String {
        match self {
            PartitionMethod::Parameters => "parameters".into(),
            PartitionMethod::Uniform => "uniform".into(),
            PartitionMethod::Type(re) => format!("type:{re}"),
            PartitionMethod::Profile(_) => "profile".into(),
        }
    }

    /// The weight of each block of `model` under this method, and the extra weights of the
    /// first and the last span (the embeddings and the head, measured by `profile`).
    fn weights(&self, model: &Model) -> Result<(Vec<f64>, (f64, f64)), String> {
        let l = model.cfg.n_layer;
        let blocks = match self {
            PartitionMethod::Parameters => (0..l).map(|i| model.units()[i + 1].len() as f64).collect(),
            PartitionMethod::Uniform => vec![1.0; l],
            PartitionMethod::Type(re) => {
                let re = regex::RegexBuilder::new(re).case_insensitive(true).build().expect("checked when parsed");
                (0..l).map(|i| f64::from(u8::from(block_kinds(model, i).iter().any(|k| re.is_match(k))))).collect()
            }
            PartitionMethod::Profile(costs) => {
                let c = costs.as_ref().ok_or("the blocks' costs are not measured yet (`tessera train` measures them at its start)")?;
                if c.blocks_ms.len() != l {
                    return Err(format!("tessera.pipeline.profile.blocks_ms has {} costs, the model has {l} blocks", c.blocks_ms.len()));
                }
                if let Some(bad) = c.blocks_ms.iter().chain([&c.embeddings_ms, &c.head_ms]).find(|x| !(x.is_finite() && **x >= 0.0)) {
                    return Err(format!("tessera.pipeline.profile: the cost {bad} is not a non-negative number of milliseconds"));
                }
                return Ok((c.blocks_ms.clone(), (c.embeddings_ms, c.head_ms)));
            }
        };
        Ok((blocks, (0.0, 0.0)))
    }
}

/// The names a `type:` pattern matches for block `l`.
fn block_kinds(model: &Model, l: usize) -> Vec<&'static str> {
    let mut kinds = vec![model.block_kind(l)];
    if model.expert_mlp(l).is_some() {
        kinds.push("moe");
    }
    kinds
}

/// Cuts `weights` into `parts` contiguous non-empty runs whose heaviest run is as light as can
/// be (ties: the earliest cut points), returning the cut points `0 = c₀ < c₁ < … < c_parts = n`;
/// `ends` are extra weights of the first and the last run. Exact: dynamic programming over
/// (run count, prefix), summed in f64.
pub fn balanced_cuts(weights: &[f64], parts: usize, ends: (f64, f64)) -> Vec<usize> {
    let n = weights.len();
    assert!(parts >= 1 && parts <= n, "{parts} parts of {n} weights");
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(weights.iter().scan(0.0, |s, w| {
            *s += w;
            Some(*s)
        }))
        .collect();
    // best[k][i]: the lightest heaviest run cutting the first i weights into k runs.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut from = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let extra = if j == 0 { ends.0 } else { 0.0 } + if i == n { ends.1 } else { 0.0 };
                let cost = best[k - 1][j].max(prefix[i] - prefix[j] + extra);
                if cost < best[k][i] {
                    (best[k][i], from[k][i]) = (cost, j);
                }
            }
        }
    }
    let mut cuts = vec![n];
    let mut i = n;
    for k in (1..=parts).rev() {
        i = from[k][i];
        cuts.push(i);
    }
    cuts.reverse();
    cuts
}

/// Pipeline parallelism of a run (`pipeline.stages` > 1).
#[derive(Clone, Debug, PartialEq)]
pub struct PipePlan {
    /// Stages `S`.
    pub stages: usize,
    /// Data-parallel replicas of the pipeline, `D = world / S`.
    pub replicas: usize,
    pub schedule: Schedule,
    /// Chunks a stage (the interleaved schedule's virtual stages; 1 for the others).
    pub chunks: usize,
    pub method: PartitionMethod,
    /// The model cut into `S·v` spans; stage `p` runs spans `c·S + p` ([`PipePlan::span`]).
    pub spans: Vec<StageSpan>,
    /// Per unit: the stage computing its gradients.
    unit_stage: Vec<usize>,
    /// The units' flat ranges (a copy of the model's, for [`PipePlan::suppliers`]).
    units: Vec<Range<usize>>,
}

impl PipePlan {
    /// The plan of `stages` stages of `chunks` chunks each (the interleaved schedule's
    /// virtual stages; 1 for the others) over `world` ranks of `model`; errors say which of the
    /// numbers does not fit (the caller names the keys).
    pub fn new(
        model: &Model,
        stages: usize,
        chunks: usize,
        world: usize,
        schedule: Schedule,
        method: PartitionMethod,
    ) -> Result<PipePlan, String> {
        let l = model.cfg.n_layer;
        if stages == 0 || stages > l {
            return Err(format!("{stages} stages for a model of {l} blocks: each stage needs at least one block"));
        }
        if world % stages != 0 {
            return Err(format!("{stages} stages do not divide the world of {world} ranks into whole pipelines"));
        }
        if let Some(why) = model.stage_refusal() {
            return Err(format!("the model cannot be cut into stages: {why}"));
        }
        // One stage runs its chunks as one span: nothing to interleave.
        let chunks = if stages == 1 { 1 } else { chunks };
        if chunks == 0 || (chunks > 1 && !schedule.chunked()) {
            return Err(format!("{chunks} chunks a stage with the {schedule} schedule: only \"interleaved\" runs several"));
        }
        let n_spans = stages * chunks;
        if n_spans > l {
            return Err(format!("{stages} stages × {chunks} chunks for a model of {l} blocks: each chunk needs at least one block"));
        }
        let (weights, ends) = method.weights(model)?;
        if matches!(method, PartitionMethod::Type(_)) && weights.iter().filter(|w| **w > 0.0).count() < n_spans {
            return Err(format!(
                "the partition {} weighs fewer than {n_spans} blocks: every stage's chunk would not get one",
                method.name()
            ));
        }
        let cuts = balanced_cuts(&weights, n_spans, ends);
        let spans: Vec<StageSpan> =
            cuts.windows(2).enumerate().map(|(j, w)| StageSpan { blocks: w[0]..w[1], embeds: j == 0, head: j + 1 == n_spans }).collect();
        let mut unit_stage = vec![stages - 1; l + 1];
        for (j, span) in spans.iter().enumerate() {
            span.blocks.clone().for_each(|b| unit_stage[b + 1] = j % stages);
        }
        Ok(PipePlan { stages, chunks, replicas: world / stages, schedule, method, spans, unit_stage, units: model.units().to_vec() })
    }

    /// Chunk `c` of stage `p`: the model's span `c·S + p`.
    pub fn span(&self, p: usize, c: usize) -> &StageSpan {
        &self.spans[c * self.stages + p]
    }

    /// The stage and chunk before chunk `c` of stage `p` in the model (`None` for the first
    /// span).
    pub fn before(&self, p: usize, c: usize) -> Option<(usize, usize)> {
        match (p, c) {
            (0, 0) => None,
            (0, c) => Some((self.stages - 1, c - 1)),
            (p, c) => Some((p - 1, c)),
        }
    }

    /// The stage and chunk after chunk `c` of stage `p` (`None` for the last span).
    pub fn after(&self, p: usize, c: usize) -> Option<(usize, usize)> {
        if p + 1 < self.stages {
            Some((p + 1, c))
        } else if c + 1 < self.chunks {
            Some((0, c + 1))
        } else {
            None
        }
    }

    pub fn stage_of(&self, rank: usize) -> usize {
        rank / self.replicas
    }

    pub fn replica_of(&self, rank: usize) -> usize {
        rank % self.replicas
    }

    pub fn rank(&self, stage: usize, replica: usize) -> usize {
        stage * self.replicas + replica
    }

    /// The rank of replica `d`'s last stage, whose blocks in the plan are the replica's
    /// micro-batches.
    pub fn last_rank(&self, d: usize) -> usize {
        self.rank(self.stages - 1, d)
    }

    /// The units whose gradients stage `p` computes, in order.
    pub fn grad_units(&self, p: usize) -> Vec<usize> {
        (0..self.unit_stage.len()).filter(|&u| self.unit_stage[u] == p).collect()
    }

    /// The units whose parameters stage `p` reads: its chunks' blocks, and unit 0 on the
    /// first stage (the embeddings) and the last (the head).
    pub fn param_units(&self, p: usize) -> Vec<usize> {
        let chunks: Vec<&StageSpan> = (0..self.chunks).map(|c| self.span(p, c)).collect();
        let unit0 = chunks.iter().any(|s| s.embeds || s.head).then_some(0);
        unit0.into_iter().chain(chunks.iter().flat_map(|s| s.blocks.clone().map(|b| b + 1))).collect()
    }

    /// Who supplies rank `q`'s micro-batch values over flat `range` (rank `q` a last stage; its
    /// replica's block sums): the rank of the same replica at the stage computing each unit's
    /// gradients, cut where that changes.
    pub fn suppliers(&self, q: usize, range: Range<usize>) -> Vec<(Range<usize>, usize)> {
        let d = self.replica_of(q);
        let mut out: Vec<(Range<usize>, usize)> = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            let (lo, hi) = (range.start.max(unit.start), range.end.min(unit.end));
            if lo >= hi {
                continue;
            }
            let who = self.rank(self.unit_stage[u], d);
            match out.last_mut() {
                Some((r, w)) if *w == who && r.end == lo => r.end = hi,
                _ => out.push((lo..hi, who)),
            }
        }
        out
    }

    /// Each stage's blocks, `[first, end)` per chunk.
    pub fn blocks_per_stage(&self) -> Vec<Vec<[usize; 2]>> {
        (0..self.stages).map(|p| (0..self.chunks).map(|c| self.span(p, c)).map(|s| [s.blocks.start, s.blocks.end]).collect()).collect()
    }

    /// One line for the console: stages, replicas, schedule, blocks per stage.
    pub fn describe(&self) -> String {
        let stages: Vec<String> = self
            .blocks_per_stage()
            .iter()
            .map(|chunks| chunks.iter().map(|[a, b]| format!("{a}..{b}")).collect::<Vec<_>>().join("+"))
            .collect();
        let chunks = if self.chunks > 1 { format!(" ({} chunks a stage)", self.chunks) } else { String::new() };
        format!(
            "pipeline: {} stages × {} replicas, schedule {}{chunks}, blocks per stage [{}] (partition {})",
            self.stages,
            self.replicas,
            self.schedule,
            stages.join(", "),
            self.method.name()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_cuts_minimise_the_heaviest_stage() {
        let none = (0.0, 0.0);
        assert_eq!(balanced_cuts(&[1.0; 8], 4, none), vec![0, 2, 4, 6, 8]);
        assert_eq!(balanced_cuts(&[1.0; 7], 3, none), vec![0, 2, 4, 7]);
        assert_eq!(balanced_cuts(&[5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2, none), vec![0, 1, 6]);
        assert_eq!(balanced_cuts(&[1.0, 0.0, 0.0, 1.0], 2, none), vec![0, 1, 4]);
        // A heavy head moves blocks off the last stage.
        assert_eq!(balanced_cuts(&[1.0; 8], 2, (0.0, 4.0)), vec![0, 6, 8]);
        // Every cut is non-empty and the heaviest run is the least possible (brute force).
        let w = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        for (parts, ends) in (1..=w.len()).flat_map(|p| [(p, none), (p, (2.0, 7.0))]) {
            let cuts = balanced_cuts(&w, parts, ends);
            assert!(cuts.windows(2).all(|c| c[0] < c[1]));
            let heaviest = |c: &[usize]| {
                c.windows(2)
                    .map(|x| {
                        w[x[0]..x[1]].iter().sum::<f64>()
                            + if x[0] == 0 { ends.0 } else { 0.0 }
                            + if x[1] == w.len() { ends.1 } else { 0.0 }
                    })
                    .fold(0.0, f64::max)
            };
            let mut best = f64::INFINITY;
            for mask in 0u32..(1 << (w.len() - 1)) {
                if mask.count_ones() as usize + 1 != parts {
                    continue;
                }
                let c: Vec<usize> =
                    std::iter::once(0).chain((1..w.len()).filter(|i| mask & (1 << (i - 1)) != 0)).chain([w.len()]).collect();
                best = best.min(heaviest(&c));
            }
            assert_eq!(heaviest(&cuts), best, "{parts} parts, ends {ends:?}");
        }
    }

    #[test]
    fn partition_methods_parse_and_refuse_by_name() {
        assert_eq!(PartitionMethod::parse("parameters"), Ok(PartitionMethod::Parameters));
        assert_eq!(PartitionMethod::parse("Uniform"), Ok(PartitionMethod::Uniform));
        assert_eq!(PartitionMethod::parse("type:moe"), Ok(PartitionMethod::Type("moe".into())));
        assert!(PartitionMethod::parse("type:(").unwrap_err().contains("not a regular expression"));
        assert_eq!(PartitionMethod::parse("profile"), Ok(PartitionMethod::Profile(None)));
        assert!(PartitionMethod::parse("measured").unwrap_err().contains("type:REGEX"));
    }
}
