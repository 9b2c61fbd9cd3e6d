//! A pipeline stage's share of one micro-batch ([`StageSpan`]): the same embeddings, blocks
//! and head as [`Model::forward_backward`], cut where the stages meet. A stage's forward takes
//! the previous stage's output stream (or the tokens) and hands its own to the next; its
//! backward takes d(its output) from the next stage (or the loss) and hands d(its input) back.
//! The embeddings' backward runs where unit 0's gradients are summed, after the head's
//! ([`Model::stage_embed_backward`]): the same additions in the same order as one worker
//! makes, so a pipelined micro-batch's gradients are the unpipelined one's bits.

use std::ops::Range;

use super::{AuxLoss, MicroBatch, Model, UnitAccess, Workspace};

/// What one pipeline stage runs of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpan {
    /// The transformer blocks, in order.
    pub blocks: Range<usize>,
    /// Whether it starts from the tokens (the embeddings' forward: the first stage).
    pub embeds: bool,
    /// Whether it ends with the final norm, the head and the loss (the last stage).
    pub head: bool,
}

impl StageSpan {
    /// The whole model as one stage.
    pub fn whole(model: &Model) -> StageSpan {
        StageSpan { blocks: 0..model.blocks.len(), embeds: true, head: true }
    }
}

impl Model {
    /// Why the model cannot be cut into stages, if it cannot: transformers' load-balancing loss
    /// over every block together (`AuxLoss::AcrossLayers` with a coefficient) makes every
    /// block's backward need every block's routing counts.
    pub fn stage_refusal(&self) -> Option<String> {
        let m = self.cfg.moe.as_ref()?;
        (m.aux_loss == AuxLoss::AcrossLayers && m.aux_loss_coef != 0.0).then(|| {
            format!(
                "its load-balancing loss is taken over every MoE block together (transformers' load_balancing_loss_func, \
                 coefficient {}): each block's backward needs every stage's routing",
                m.aux_loss_coef
            )
        })
    }

    /// Forward of one micro-batch through `span`: from `batch.tokens` (`span.embeds`) or from
    /// `input`, the previous stage's output stream `[b·t, c]`, through the span's blocks, and
    /// with `span.head` through the head to the loss (returned: the mean cross-entropy). The
    /// activations stay in `ws`, one workspace per micro-batch in flight, for
    /// [`Model::stage_backward`].
    ///
    /// # Panics
    /// If the batch is malformed, or `input` is missing or of the wrong length for a stage
    /// without the embeddings.
    pub fn stage_forward(
        &self,
        acc: &mut dyn UnitAccess,
        span: &StageSpan,
        batch: MicroBatch<'_>,
        input: Option<&[f32]>,
        ws: &mut Workspace,
    ) -> Option<f32> {
        let MicroBatch { tokens, targets, b, t, noise_key } = batch;
        self.check_batch(tokens, b, t);
        let d = self.dims(b, t);
        ws.begin(span.blocks.len(), d.n() * d.c);
        if span.embeds {
            self.embed(acc, tokens, d, &mut ws.xs[0]);
        } else {
            let x = input.expect("a stage without the embeddings takes the previous stage's output");
            ws.xs[0].copy_from_slice(x);
        }
        self.forward_blocks(acc, span.blocks.clone(), d, ws, !self.checkpoint_activations, Some(noise_key));
        span.head.then(|| {
            let (p0, _) = acc.unit(0);
            let loss = self.head_forward(p0, targets, d, ws);
            ws.loss_at = Some(std::time::Instant::now());
            loss
        })
    }

    /// The stream a stage hands the next one, after [`Model::stage_forward`].
    pub fn stage_output<'w>(&self, ws: &'w Workspace) -> &'w [f32] {
        ws.xs.last().expect("a stage forward ran")
    }

    /// Backward of one micro-batch through `span` after its [`Model::stage_forward`] on `ws`:
    /// with `span.head` from the loss (scaled by `dloss`), else from `dy`, d(the stage's output)
    /// from the next stage. Accumulates the span's gradients (marking each block ready) and
    /// returns d(the stage's input): what the previous stage's backward takes, or for the first
    /// stage d(the embeddings' output), for [`Model::stage_embed_backward`].
    pub fn stage_backward<'w>(
        &self,
        acc: &mut dyn UnitAccess,
        span: &StageSpan,
        batch: MicroBatch<'_>,
        dy: Option<&[f32]>,
        dloss: f32,
        ws: &'w mut Workspace,
    ) -> &'w [f32] {
        let d = self.dims(batch.b, batch.t);
        if span.head {
            let (p0, g0) = acc.unit(0);
            self.head_backward(p0, g0, batch.targets, d, ws, dloss);
        } else {
            let dy = dy.expect("a stage without the head takes d(its output) from the next stage");
            ws.dx.clear();
            ws.dx.extend_from_slice(dy);
        }
        self.backward_blocks(acc, span.blocks.clone(), d, ws, batch.noise_key, dloss);
        &ws.dx
    }

    /// The embeddings' backward of one micro-batch from `dx`, d(the embeddings' output) that
    /// the first stage's backward returned: accumulates into unit 0's gradients and marks them
    /// ready. Runs after the head's backward of the same micro-batch, as in one worker's pass.
    pub fn stage_embed_backward(&self, acc: &mut dyn UnitAccess, tokens: &[u32], b: usize, t: usize, dx: &[f32]) {
        self.check_batch(tokens, b, t);
        self.embed_backward(acc, tokens, self.dims(b, t), dx);
    }
}
