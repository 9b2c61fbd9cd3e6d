//! A pipeline stage's share of one micro-batch ([`StageSpan`]): the same embeddings, blocks
//! and head as [`Model::forward_backward`], cut where the stages meet. A stage's forward takes
//! the previous stage's output stream (or the tokens) and hands its own to the next; its
//! backward takes d(its output) from the next stage (or the loss) and hands d(its input) back.
//! The embeddings' backward runs where unit 0's gradients are summed, after the head's
//! ([`Model::stage_embed_backward`]): the same additions in the same order as one worker
//! makes, so a pipelined micro-batch's gradients are the unpipelined one's bits.
//!
//! A zero-bubble schedule (ZB-H1) splits a stage's backward in two: the input-gradient pass
//! `B` ([`Model::stage_backward_input`]: d(stage input), what the previous stage waits for) and
//! the weight-gradient pass `W` ([`Model::stage_backward_weight`]: the linears' `Xᵀ·dY`, the
//! biases' and norm gains' sums), run later from what `B` kept ([`WStash`], one per
//! micro-batch, so `B` of micro-batch `m + 1` may run before `W` of `m`). `B` then `W` adds
//! the fused [`Model::stage_backward`]'s gradients bit for bit ([`crate::wgrad`]).

use std::ops::Range;

use super::{AuxLoss, MicroBatch, Model, UnitAccess, Workspace};
use crate::wgrad::{UnitStash, WeightGrads};

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

/// What a stage's weight-gradient pass needs of one micro-batch, from its input-gradient pass
/// ([`Model::stage_backward_input`]): per unit (unit 0's head and final norm on the last stage,
/// then the span's blocks last to first) the deferred ops and copies of the operands they read
/// (each linear's input and output gradient, each norm's input, statistics and output
/// gradient). It borrows nothing: the micro-batch's workspace is free once `B` returns.
///
/// Spent (returned by [`Model::stage_backward_weight`]), it holds only its buffers, which
/// [`Workspace::recycle`] hands to the next `B` on that workspace, so a steady pipeline copies
/// into memory it already has instead of allocating (and faulting in) a stash per micro-batch.
#[derive(Debug, Default)]
pub struct WStash {
    units: Vec<UnitStash>,
    /// Buffers to copy operands into: during `B` the workspace's, when spent its own.
    spare: Vec<Vec<f32>>,
}

impl WStash {
    /// A fresh record for unit `u`.
    pub(super) fn unit(&mut self, u: usize) -> WeightGrads<'_> {
        self.units.push(UnitStash::new(u));
        let stash = self.units.last_mut().expect("just pushed");
        WeightGrads::Later { stash, spare: &mut self.spare }
    }

    /// Bytes held: the operands, and a spent stash's buffers.
    pub fn bytes(&self) -> usize {
        self.units.iter().map(UnitStash::bytes).sum::<usize>() + self.spare.iter().map(|b| b.capacity() * 4).sum::<usize>()
    }

    /// Its buffers, for the next `B` ([`Workspace::recycle`]).
    pub(super) fn into_buffers(self) -> Vec<Vec<f32>> {
        let mut bufs = self.spare;
        bufs.extend(self.units.into_iter().flat_map(UnitStash::into_buffers));
        bufs
    }

    /// The units whose gradients the weight pass adds, in the order it adds them.
    pub fn units(&self) -> impl Iterator<Item = usize> + '_ {
        self.units.iter().map(|u| u.unit)
    }
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
        self.stage_backward_pass(acc, span, batch, dy, dloss, ws, None);
        &ws.dx
    }

    /// The input-gradient half of [`Model::stage_backward`] (zero-bubble `B`): the same
    /// arguments and the same d(the stage's input), but no parameter gradient is added and no
    /// unit marked ready; the weight gradients wait in the returned [`WStash`] for
    /// [`Model::stage_backward_weight`]. (An MoE block whose experts an [`crate::experts::ExpertRunner`]
    /// runs still leaves their gradients with the runner, as the fused backward does.)
    pub fn stage_backward_input<'w>(
        &self,
        acc: &mut dyn UnitAccess,
        span: &StageSpan,
        batch: MicroBatch<'_>,
        dy: Option<&[f32]>,
        dloss: f32,
        ws: &'w mut Workspace,
    ) -> (&'w [f32], WStash) {
        let mut stash = WStash { units: Vec::new(), spare: std::mem::take(&mut ws.spare) };
        self.stage_backward_pass(acc, span, batch, dy, dloss, ws, Some(&mut stash));
        ws.spare = std::mem::take(&mut stash.spare);
        (&ws.dx, stash)
    }

    /// The weight-gradient half (zero-bubble `W`) of the micro-batch whose
    /// [`Model::stage_backward_input`] returned `stash`: adds the deferred gradients into `acc`'s
    /// units and marks each block's unit ready (unit 0 is marked by
    /// [`Model::stage_embed_backward`], which on the last stage must come after this, as one
    /// worker adds the tied head's gradient before the embeddings'). Any passes of other
    /// micro-batches may run in between; micro-batches accumulating into one gradient buffer
    /// give the fused bits when their weight passes run in the fused order.
    ///
    /// Returns the spent stash: drop it, or hand its memory to the next `B` with
    /// [`Workspace::recycle`].
    pub fn stage_backward_weight(&self, acc: &mut dyn UnitAccess, stash: WStash) -> WStash {
        for u in &stash.units {
            let (_, g) = acc.unit(u.unit);
            u.apply(g);
            if u.unit != 0 {
                acc.grads_ready(u.unit);
            }
        }
        WStash { units: Vec::new(), spare: stash.into_buffers() }
    }

    /// [`Model::stage_backward`] with `stash` (the input-gradient pass, the weight gradients
    /// recorded) or without (fused).
    #[allow(clippy::too_many_arguments)]
    fn stage_backward_pass(
        &self,
        acc: &mut dyn UnitAccess,
        span: &StageSpan,
        batch: MicroBatch<'_>,
        dy: Option<&[f32]>,
        dloss: f32,
        ws: &mut Workspace,
        mut stash: Option<&mut WStash>,
    ) {
        let d = self.dims(batch.b, batch.t);
        if span.head {
            let (p0, g0) = acc.unit(0);
            let mut wg = match stash.as_deref_mut() {
                Some(s) => s.unit(0),
                None => WeightGrads::now(g0),
            };
            self.head_backward(p0, &mut wg, batch.targets, d, ws, dloss);
        } else {
            let dy = dy.expect("a stage without the head takes d(its output) from the next stage");
            ws.dx.clear();
            ws.dx.extend_from_slice(dy);
        }
        self.backward_blocks(acc, span.blocks.clone(), d, ws, batch.noise_key, dloss, stash);
    }

    /// The embeddings' backward of one micro-batch from `dx`, d(the embeddings' output) that
    /// the first stage's backward returned: accumulates into unit 0's gradients and marks them
    /// ready. Runs after the head's backward of the same micro-batch, as in one worker's pass.
    pub fn stage_embed_backward(&self, acc: &mut dyn UnitAccess, tokens: &[u32], b: usize, t: usize, dx: &[f32]) {
        self.check_batch(tokens, b, t);
        self.embed_backward(acc, tokens, self.dims(b, t), dx);
    }
}
