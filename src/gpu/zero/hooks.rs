//! The hooks of one micro-batch (`gpt::forward_backward` calls them per unit): stage 3's
//! gathers into the rotating buffers with their prefetch, and, in the last micro-batch, finishing
//! each unit's gradient as the backward completes it (the micro-batch tree's adds, its reduction,
//! the copy to the host, the early optimizer step).

use anyhow::Result;
use tessera_kernels::cuda::gpt::{Phase, UnitHooks};
use tessera_kernels::cuda::{self, bf16, ops, DPtr};

use super::{record, Rank, Tail};

/// The hooks of one micro-batch.
pub(super) struct Hooks<'a> {
    pub(super) r: &'a mut Rank,
    pub(super) grads: DPtr<f32>,
    /// The last micro-batch of a step: the tree's adds, reduction and host copy per unit.
    pub(super) tail: Option<&'a Tail>,
    /// Step each unit's optimizer on the optimizer stream once its gradient is final (one GPU,
    /// no clipping; see the module notes).
    pub(super) early: Option<&'a tessera_kernels::cuda::optim::OptimStep>,
    /// Stage 3: index of the next block use, and the uses in order (unit, phase).
    pub(super) use_idx: usize,
    pub(super) uses: Vec<(usize, Phase)>,
    /// Parameters on NVMe: uses whose piece the swap reader was asked for.
    pub(super) requested: usize,
}

impl Hooks<'_> {
    /// Stage 3: starts gathering the embedding unit and the first two block uses.
    pub(super) fn begin(&mut self) -> Result<()> {
        if self.r.stage != 3 {
            return Ok(());
        }
        let l = self.r.layout.units.len() - 1;
        self.uses = (1..=l).map(|u| (u, Phase::Forward)).chain((1..=l).rev().map(|u| (u, Phase::Backward))).collect();
        self.use_idx = 0;
        // Gathers read the parameter shard the last optimizer step wrote.
        self.r.order(&self.r.gpu.stream, &self.r.cstream)?;
        if let Some(ph) = self.r.phost.as_mut() {
            // Parameter offload: reads a forward's evaluation left unused are dropped, then the
            // swap reader is asked for the embedding unit and the first uses.
            ph.drain()?;
            ph.request(0)?;
        }
        self.requested = 0;
        self.request_ahead(0)?;
        let u0 = self.r.u0.as_ref().expect("stage 3 has a unit-0 buffer").ptr();
        self.gather(0, u0, 0)?;
        self.r.ready[0] = Some(record(&self.r.cstream)?);
        for k in 0..2.min(self.uses.len()) {
            self.gather_use(k)?;
        }
        Ok(())
    }

    /// Gathers unit `u` into `dst` on the communication stream. With parameter offload the
    /// rank's piece first comes host → device on that stream: straight into `dst` with one rank,
    /// else into piece buffer `slot` (free: its previous gather was issued before on this stream).
    fn gather(&mut self, u: usize, dst: DPtr<bf16>, slot: usize) -> Result<()> {
        let off = self.r.layout.shard_offset(u);
        let len = self.r.layout.units[u].len() / self.r.world;
        let r = &mut *self.r;
        let mine = match r.phost.as_mut() {
            Some(ph) if r.world == 1 => {
                ph.fetch(u, dst, &r.cstream)?;
                return r.comm_issued();
            }
            Some(ph) => {
                let piece = r.dpiece[slot].slice(0..len);
                ph.fetch(u, piece, &r.cstream)?;
                piece
            }
            None => r.params.slice(off..off + len),
        };
        if self.r.world == 1 {
            self.r.gpu.copy(dst.cast(), mine.cast(), &self.r.cstream)?;
        } else {
            self.r.comm().all_gather_bf16(mine, dst, &self.r.cstream)?;
        }
        self.r.comm_issued()
    }

    /// Parameters on NVMe: asks the swap reader for every use up to `k` + `buffer_count` − 1
    /// not asked for yet (the reads it holds and those in flight stay within `buffer_count`
    /// pieces, the one in use included).
    fn request_ahead(&mut self, k: usize) -> Result<()> {
        let Some(ph) = self.r.phost.as_mut() else { return Ok(()) };
        let end = (k + ph.depth()).min(self.uses.len());
        while self.requested < end {
            ph.request(self.uses[self.requested].0)?;
            self.requested += 1;
        }
        Ok(())
    }

    /// Gathers block use `k` into pool slot `k % 2` and records its ready event.
    fn gather_use(&mut self, k: usize) -> Result<()> {
        let (u, _) = self.uses[k];
        self.request_ahead(k)?;
        let dst = self.r.pool[k % 2].ptr();
        self.gather(u, dst, k % 2)?;
        let ev = record(&self.r.cstream)?;
        self.r.pool_ready.insert(k, ev);
        Ok(())
    }
}

impl Hooks<'_> {
    /// Unit `u`'s gradient of the last micro-batch is complete: the tree's adds over the unit
    /// (the same adds, in the same order, as over the whole buffer), then its reduction (stage 1:
    /// every unit's, after the whole backward) and the copy of its host part to the host.
    fn finish_unit(&mut self, u: usize, tail: &Tail) -> Result<()> {
        let r = &mut *self.r;
        let unit = r.layout.units[u].clone();
        if r.fp16 {
            // fp16 storage of the last micro-batch's gradient, before the tree adds it.
            ops::round_f16(&r.gpu, &r.gpu.stream, self.grads.slice(unit.clone()))?;
        }
        for &(dst, src) in &tail.merges {
            ops::add_f32(&r.gpu, &r.gpu.stream, r.gbufs[dst].slice(unit.clone()), r.gbufs[src].slice(unit.clone()))?;
            if r.fp16 {
                // Every node of the micro-batch tree is stored in fp16, as the CPU's tree rounds it.
                ops::round_f16(&r.gpu, &r.gpu.stream, r.gbufs[dst].slice(unit.clone()))?;
            }
        }
        let fin = r.gbufs[tail.fin].ptr();
        if r.world == 1 {
            if let Some(hp) = self.early {
                // Nothing later in this backward reads unit u's parameters or writes its
                // gradient: the forward and backward of the blocks below use their own.
                r.order(&r.gpu.stream, &r.ostream)?;
                let os = r.ostream.clone();
                r.optim_unit(u, fin, hp, 1.0, &os)?;
                r.stepped[u] = true;
            }
            return r.send_grad(u, tail.fin);
        }
        if r.stage != 1 {
            r.reduce_unit(u, fin)?;
            r.send_grad(u, tail.fin)?;
        } else if u == 0 {
            // Stage 1 reduces after the whole backward.
            for uu in (0..r.layout.units.len()).rev() {
                r.reduce_unit(uu, fin)?;
                r.send_grad(uu, tail.fin)?;
            }
        }
        Ok(())
    }
}

impl UnitHooks for Hooks<'_> {
    fn params(&mut self, u: usize, phase: Phase) -> tessera_kernels::cuda::Result<DPtr<bf16>> {
        let r = &mut *self.r;
        if r.stage == 3 {
            if u == 0 {
                if phase == Phase::Forward {
                    if let Some(ev) = r.ready[0].take() {
                        r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for the embedding gather"))?;
                    }
                }
                return Ok(r.u0.as_ref().expect("stage 3 has a unit-0 buffer").ptr());
            }
            let k = self.use_idx;
            debug_assert_eq!(self.uses[k], (u, phase), "stage-3 use order");
            let ev = r.pool_ready.remove(&k).ok_or_else(|| cuda::GpuError::Invalid(format!("stage 3: unit {u} was not prefetched")))?;
            r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for a parameter gather"))?;
            return Ok(r.pool[k % 2].ptr());
        }
        if let Some(ev) = r.ready[u].take() {
            r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for a parameter gather"))?;
        }
        Ok(r.params.slice(r.layout.units[u].clone()))
    }

    fn params_done(&mut self, u: usize, _phase: Phase) -> tessera_kernels::cuda::Result<()> {
        if self.r.stage != 3 || u == 0 {
            return Ok(());
        }
        let k = self.use_idx;
        self.use_idx += 1;
        if k + 2 < self.uses.len() {
            // Slot k % 2 is free once the compute stream is past this use.
            self.r.order(&self.r.gpu.stream, &self.r.cstream).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
            self.gather_use(k + 2).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    fn grads(&mut self, u: usize) -> tessera_kernels::cuda::Result<DPtr<f32>> {
        Ok(self.grads.slice(self.r.layout.units[u].clone()))
    }

    fn grads_done(&mut self, u: usize) -> tessera_kernels::cuda::Result<()> {
        let Some(tail) = self.tail else { return Ok(()) };
        self.finish_unit(u, tail).map_err(|e| cuda::GpuError::Invalid(format!("{e:#}")))
    }
}
