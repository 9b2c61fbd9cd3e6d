//! Where an MoE block's experts run. The block routes its tokens, gathers each expert's rows
//! (in token order) and combines the outputs; between the two it hands the rows to an
//! [`ExpertRunner`]: [`LocalExperts`] runs every expert here, an engine's runner may send the
//! rows to the rank that holds the expert (expert parallelism) and back. The runner calls the
//! block's [`ExpertMlp`] on one expert's rows at a time, so an expert's output, and its
//! parameter gradient from one micro-batch, are the same function of the same rows wherever
//! it runs.

use std::ops::Range;

use crate::wgrad::WeightGrads;

/// Saved activations of one expert on one set of rows (its MLP's intermediate buffers).
pub type ExpertActs = Vec<Vec<f32>>;

/// The expert MLPs of an MoE block, one expert at a time.
pub trait ExpertMlp {
    /// Experts in the block.
    fn num_experts(&self) -> usize;
    /// Width of a row (the model's `d_model`).
    fn width(&self) -> usize;
    /// Expert `e`'s parameters, relative to the block's unit.
    fn expert_range(&self, e: usize) -> Range<usize>;
    /// `y = expert_e(x)` for the `[n, c]` rows `x`, with `p` expert `e`'s parameters; keeps in
    /// `acts` what [`ExpertMlp::backward`] needs.
    fn forward(&self, e: usize, p: &[f32], x: &[f32], acts: &mut ExpertActs) -> Vec<f32>;
    /// `dx` for `dy`; *adds* the parameter gradient into `g` (expert `e`'s range).
    fn backward(&self, e: usize, p: &[f32], g: &mut [f32], acts: &mut ExpertActs, dy: &[f32]) -> Vec<f32> {
        let base = self.expert_range(e).start;
        self.backward_to(e, p, acts, dy, &mut WeightGrads::Now { g, base })
    }
    /// [`ExpertMlp::backward`] with the parameter gradient sent to `wg`, over the block's unit
    /// (added at once, or recorded for a zero-bubble pipeline's weight pass).
    fn backward_to(&self, e: usize, p: &[f32], acts: &mut ExpertActs, dy: &[f32], wg: &mut WeightGrads<'_>) -> Vec<f32>;
}

/// Runs an MoE block's experts on the rows of one micro-batch.
pub trait ExpertRunner {
    /// Each expert's output rows for `rows[e]` (`[n_e, c]`), with `p` the block's unit.
    fn forward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], rows: Vec<Vec<f32>>) -> Vec<Vec<f32>>;
    /// Each expert's input-row gradient for `d_out[e]`, after a [`ExpertRunner::forward`] of
    /// the same unit; the experts' parameter gradients go where the runner keeps them.
    fn backward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], d_out: Vec<Vec<f32>>) -> Vec<Vec<f32>>;
}

/// Every expert runs here, its gradient sent to the block's `wg` (unit-relative).
pub struct LocalExperts<'a, 'g> {
    pub wg: &'a mut WeightGrads<'g>,
    /// Per expert: the saved activations of the last forward.
    pub acts: &'a mut Vec<ExpertActs>,
}

impl ExpertRunner for LocalExperts<'_, '_> {
    fn forward(&mut self, _unit: usize, mlp: &dyn ExpertMlp, p: &[f32], rows: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        self.acts.resize_with(mlp.num_experts(), Vec::new);
        // An expert without rows is skipped (nothing to compute, nothing to add), as any runner does.
        rows.iter()
            .enumerate()
            .map(|(e, x)| if x.is_empty() { Vec::new() } else { mlp.forward(e, &p[mlp.expert_range(e)], x, &mut self.acts[e]) })
            .collect()
    }

    fn backward(&mut self, _unit: usize, mlp: &dyn ExpertMlp, p: &[f32], d_out: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        d_out
            .iter()
            .enumerate()
            .map(|(e, dy)| {
                if dy.is_empty() {
                    return Vec::new();
                }
                mlp.backward_to(e, &p[mlp.expert_range(e)], &mut self.acts[e], dy, self.wg)
            })
            .collect()
    }
}
