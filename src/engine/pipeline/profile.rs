//! The `profile` partition (`pipeline.partition = "profile"`, the method DeepSpeed's
//! `PipelineModule` names and leaves unimplemented): the stages are cut by the measured time of
//! each block's forward and backward on one micro-batch of the run's shape, with the embeddings'
//! time on the first stage and the head's (final norm, tied head, loss) on the last.
//!
//! The driver measures once at the start of `tessera train` ([`resolve`]) and records the costs
//! in the resolved config (`tessera.pipeline.profile`), so every worker process and every
//! elastic re-plan cuts the same way; a user may give the costs instead (from an earlier run's
//! `summary.json`, or their own profiler) and nothing is measured. The cut changes where blocks
//! run, never the bits: any cut gives the unpipelined run's parameters.

use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use tessera_kernels::model::{FlatAccess, MicroBatch, Model, StageSpan, Workspace};

use super::PartitionMethod;
use crate::config::Config;

/// Measured (or given) costs in milliseconds of one micro-batch's forward and backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BlockCosts {
    /// Per transformer block, in order.
    pub blocks_ms: Vec<f64>,
    /// The embeddings' forward and backward (on the first stage).
    pub embeddings_ms: f64,
    /// The final norm, head and loss, forward and backward (on the last stage).
    pub head_ms: f64,
}

impl BlockCosts {
    /// As `tessera.pipeline.profile` holds them.
    pub fn to_json(&self) -> Value {
        json!({ "blocks_ms": self.blocks_ms, "embeddings_ms": self.embeddings_ms, "head_ms": self.head_ms })
    }
}

/// Timed rounds a cost is the median of (after one untimed round).
const ROUNDS: usize = 5;

/// Times every block of `model`, the embeddings and the head on a micro-batch of `b` rows of
/// `t` tokens, with the model's recomputation setting: each a forward and a backward, in
/// rounds over all of them (so a burst of load on the machine falls on every part alike), the
/// median of [`ROUNDS`] rounds each, on this thread.
pub fn measure(model: &Model, b: usize, t: usize) -> BlockCosts {
    let params = model.init_params(0x7072_6f66);
    let mut grads = vec![0.0f32; params.len()];
    let n = b * t;
    let vocab = model.cfg.vocab_size as u64;
    let tokens: Vec<u32> = (0..n as u64).map(|i| (i.wrapping_mul(2_654_435_761) % vocab) as u32).collect();
    let targets: Vec<u32> = tokens.iter().rev().copied().collect();
    let batch = MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 1 };
    let x: Vec<f32> = (0..n * model.cfg.d_model).map(|i| ((i % 17) as f32 - 8.0) * 0.02).collect();
    let dloss = 1.0 / n as f32;
    let l = model.cfg.n_layer;
    // The blocks one by one, then the embeddings, then the head.
    let spans: Vec<StageSpan> = (0..l)
        .map(|i| StageSpan { blocks: i..i + 1, embeds: false, head: false })
        .chain([StageSpan { blocks: 0..0, embeds: true, head: false }, StageSpan { blocks: l..l, embeds: false, head: true }])
        .collect();
    let mut ws = Workspace::default();
    let mut runs = vec![Vec::with_capacity(ROUNDS); spans.len()];
    for round in 0..=ROUNDS {
        for (span, times) in spans.iter().zip(&mut runs) {
            let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
            let start = Instant::now();
            model.stage_forward(&mut acc, span, batch, (!span.embeds).then_some(&x[..]), &mut ws);
            let dx = model.stage_backward(&mut acc, span, batch, (!span.head).then_some(&x[..]), dloss, &mut ws).to_vec();
            if span.embeds {
                model.stage_embed_backward(&mut acc, &tokens, b, t, &dx);
            }
            if round > 0 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let mut medians: Vec<f64> = runs
        .into_iter()
        .map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[r.len() / 2]
        })
        .collect();
    let head_ms = medians.pop().expect("the head");
    let embeddings_ms = medians.pop().expect("the embeddings");
    BlockCosts { blocks_ms: medians, embeddings_ms, head_ms }
}

/// The run's config with the `profile` partition's costs measured and recorded, when it asks
/// for that partition without giving them; `None` otherwise.
pub fn resolve(cfg: &Config) -> Result<Option<Config>> {
    let Some(p) = cfg.pipeline.as_ref().filter(|p| p.stages > 1 && p.partition == PartitionMethod::Profile(None)) else {
        return Ok(None);
    };
    let dataset = crate::engine::child::load_dataset(cfg)?;
    let (mut model, seq_len) = crate::engine::plan::model_of(cfg, &dataset)?;
    model.checkpoint_activations |= p.recompute;
    tracing::info!("pipeline.partition = \"profile\": timing {} blocks' forward and backward on one micro-batch", model.cfg.n_layer);
    let costs = measure(&model, cfg.micro_batch_per_gpu, seq_len);
    tracing::info!(
        "pipeline.partition = \"profile\": blocks {:?} ms, embeddings {:.3} ms, head {:.3} ms",
        costs.blocks_ms.iter().map(|c| (c * 1e3).round() / 1e3).collect::<Vec<_>>(),
        costs.embeddings_ms,
        costs.head_ms
    );
    let mut resolved = cfg.resolved.clone();
    let tessera = resolved.as_object_mut().context("the resolved config is an object")?.entry("tessera").or_insert_with(|| json!({}));
    let pipe = tessera.as_object_mut().context("`tessera` is an object")?.entry("pipeline").or_insert_with(|| json!({}));
    pipe.as_object_mut().context("`tessera.pipeline` is an object")?.insert("profile".into(), costs.to_json());
    // Parsed again as the workers parse it, so the hash and every field agree with theirs.
    let again = crate::config::from_str_named(&resolved.to_string(), &cfg.source, &[], &crate::config::ResolveContext::default())
        .context("the resolved config with the measured costs")?;
    Ok(Some(again))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block, the embeddings and the head get a positive, finite time, for a dense and an
    /// MoE model.
    #[test]
    fn measured_costs_are_positive() {
        for name in ["gpt-tiny", "llama-tiny"] {
            let model = Model::new(crate::zoo::preset(name).expect("a preset")).expect("a model");
            let costs = measure(&model, 2, 32);
            assert_eq!(costs.blocks_ms.len(), model.cfg.n_layer, "{name}");
            assert!(
                costs.blocks_ms.iter().chain([&costs.embeddings_ms, &costs.head_ms]).all(|&c| c > 0.0 && c.is_finite()),
                "{name}: {costs:?}"
            );
        }
    }
}
