//! What the engine's driver (`gpu::compute::GpuRanks`) asks of a rank besides its steps: evaluation, small
//! host-side gathers, and the optimizer state in the CPU checkpoint layout (saved and restored).

use anyhow::{bail, Context, Result};
use tessera_kernels::cuda::gpt;

use super::hooks::Hooks;
use super::{Rank, COMM_TIMEOUT};

/// Which optimizer buffer: the masters, or state buffer `m` (Adam's and Lion's `exp_avg`,
/// SGD's momentum buffer) or `v` (Adam's `exp_avg_sq`).
#[derive(Clone, Copy)]
enum Which {
    Master,
    M,
    V,
}

/// Helpers for the engine's driver (`gpu::compute::GpuRanks`): evaluation, small host-side gathers, and
/// the optimizer state in the CPU checkpoint layout.
impl Rank {
    /// Mean loss of one batch of this rank's micro-batch shape, forward only (evaluation) on the
    /// current bf16 parameters. At stage 3 with several ranks the parameters are gathered unit by
    /// unit, so every rank must call this together, with batches in the same order.
    pub fn forward_loss(&mut self, tokens: &[u32], targets: &[u32]) -> Result<f32> {
        let mut ws = self.ws.take().expect("workspace present between steps");
        let gpu = self.gpu.clone();
        // Forward only: no gradient is written; the hooks still need a buffer to name.
        let grads = self.gbufs[0].ptr();
        let res = {
            let mut hooks = Hooks { r: self, grads, tail: None, early: None, use_idx: 0, uses: Vec::new(), requested: 0 };
            hooks.begin().and_then(|_| gpt::forward_loss(&gpu, &mut hooks, &mut ws, tokens, targets).map_err(anyhow::Error::from))
        };
        let loss = res.and_then(|_| gpt::mean_loss(&gpu, &ws).map_err(anyhow::Error::from));
        self.ws = Some(ws);
        loss
    }

    /// Every rank's `values` (the same count on each), rank-major: `out[r·k + i]` is rank `r`'s
    /// `values[i]`. One rank: `values` itself. A collective: every rank must call it together.
    pub fn gather_host(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        if self.world == 1 || values.is_empty() {
            return Ok(values.to_vec());
        }
        // f64 values travel as pairs of f32 words (a gather moves bits, it adds nothing).
        let words: Vec<f32> = values
            .iter()
            .flat_map(|v| {
                let b = v.to_bits();
                [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
            })
            .collect();
        let send = self.gpu.upload(&words)?;
        let recv = self.gpu.alloc::<f32>(words.len() * self.world)?;
        self.order(&self.gpu.stream, &self.cstream)?;
        self.comm().all_gather_f32(send.ptr(), recv.ptr(), &self.cstream)?;
        self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
        let flat = self.gpu.download(recv.ptr())?;
        Ok(flat.chunks_exact(2).map(|w| f64::from_bits(u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32))).collect())
    }

    /// This rank's bf16 parameters, once its streams are idle: at stage 3 its shard (pieces unit
    /// after unit) wherever it lives (the device, or host memory and NVMe with parameter
    /// offload); otherwise the full padded buffer.
    pub fn params_shard(&mut self) -> Result<Vec<tessera_kernels::cuda::bf16>> {
        self.sync()?;
        if let Some(o) = &self.off {
            o.h2d.synchronize().map_err(tessera_kernels::cuda::drv("waiting for the parameter copies"))?;
        }
        match &self.phost {
            Some(p) => p.read_shard(),
            None => Ok(self.gpu.download(self.params.ptr())?),
        }
    }

    /// Optimizer steps taken so far (Adam's bias-correction clock).
    pub fn optimizer_steps(&self) -> u64 {
        self.step
    }

    /// The optimizer's state buffers in the CPU layout, full length, in `OptimizerKind::
    /// state_names` order (Adam: `exp_avg`, `exp_avg_sq`; Lion: `exp_avg`; SGD with momentum:
    /// `momentum_buffer`; none otherwise), gathered from every rank (a collective at stages 1–3
    /// with several ranks).
    pub fn optimizer_state(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        for which in [Which::M, Which::V].into_iter().take(self.optim.states()) {
            let own = self.shard_vec(which)?;
            out.push(self.gather_cpu_layout(own)?);
        }
        Ok(out)
    }

    /// A shard-shaped f32 vector (this rank's optimizer pieces) of every rank → the CPU layout.
    fn gather_cpu_layout(&mut self, own: Vec<f32>) -> Result<Vec<f32>> {
        if self.world == 1 || self.stage == 0 {
            return Ok(self.layout.unpad(&self.layout_full_from_shards(&[own])));
        }
        let n = own.len();
        let send = self.gpu.upload(&own)?;
        let all = self.gpu.alloc::<f32>(n * self.world)?;
        self.order(&self.gpu.stream, &self.cstream)?;
        self.comm().all_gather_f32(send.ptr(), all.ptr(), &self.cstream)?;
        self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
        let flat = self.gpu.download(all.ptr())?;
        let shards: Vec<Vec<f32>> = (0..self.world).map(|r| flat[r * n..(r + 1) * n].to_vec()).collect();
        Ok(self.layout.unpad(&self.layout_full_from_shards(&shards)))
    }

    /// Restores the optimizer's state buffers (CPU layout, full length, as a checkpoint holds
    /// them, in `OptimizerKind::state_names` order) and the optimizer step count: this rank keeps
    /// its pieces.
    pub fn load_optimizer_state(&mut self, bufs: &[&[f32]], steps: u64) -> Result<()> {
        let n = self.layout.cpu_units.last().map_or(0, |u| u.end);
        let names = self.optim.kind.state_names();
        if bufs.len() != names.len() {
            bail!("{} optimizer buffers given; {} keeps {} ({})", bufs.len(), self.optim.kind.name(), names.len(), names.join(", "));
        }
        for (name, b) in names.iter().zip(bufs) {
            if b.len() != n {
                bail!("optimizer buffer `{name}` has {} values; the model has {n} parameters", b.len());
            }
        }
        let opt_rank = if self.stage == 0 { 0 } else { self.rank };
        let cut = |full: &[f32]| -> Vec<f32> {
            let padded = self.layout.pad(full);
            let mut out = Vec::with_capacity(self.layout.shard_len());
            for u in 0..self.layout.units.len() {
                out.extend_from_slice(&padded[self.layout.piece(u, opt_rank)]);
            }
            out
        };
        let mut host_parts = Vec::new();
        for (k, b) in bufs.iter().enumerate() {
            let (h, d) = self.split.cut(&cut(b));
            self.gpu.write(if k == 0 { &mut self.m } else { &mut self.v }, 0, &d)?;
            host_parts.push(h);
        }
        self.gpu.sync()?;
        if let Some(o) = self.off.as_mut() {
            // The optimizer's state buffers in `state_names` order (none, `m`, or `m` and `v`).
            let host = o.host.as_mut().context("the host optimizer state was lost in an earlier failed step")?;
            match &host.nvme {
                Some(store) => {
                    for (k, (part, name)) in host_parts.iter().zip(names).enumerate() {
                        store.write_buffer(k + 1, part).with_context(|| format!("writing {name} to its swap file"))?;
                    }
                }
                None => {
                    let mut parts = host_parts.into_iter();
                    (host.m, host.v) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
                }
            }
        }
        self.step = steps;
        Ok(())
    }

    /// Every rank's [`Rank::device_bytes`], in rank order (a collective with several ranks).
    pub fn device_bytes_per_rank(&mut self) -> Result<Vec<usize>> {
        let mine = self.device_bytes() as f64;
        Ok(self.gather_host(&[mine])?.into_iter().map(|b| b as usize).collect())
    }

    /// The fp32 master parameters in the CPU layout (gathered from every rank).
    pub fn masters(&mut self) -> Result<Vec<f32>> {
        let shard = self.shard_vec(Which::Master)?;
        self.gather_cpu_layout(shard)
    }

    /// This rank's optimizer shard of one buffer (pieces unit after unit), joining the host and
    /// device parts.
    fn shard_vec(&self, which: Which) -> Result<Vec<f32>> {
        let dev = self.gpu.download(match which {
            Which::Master => self.master.ptr(),
            Which::M => self.m.ptr(),
            Which::V => self.v.ptr(),
        })?;
        let Some(o) = &self.off else { return Ok(dev) };
        let host = o.host.as_ref().context("the host optimizer state was lost in an earlier failed step")?;
        let k = match which {
            Which::Master => 0,
            Which::M => 1,
            Which::V => 2,
        };
        if let Some(store) = &host.nvme {
            let h = store.read_buffer(k).with_context(|| format!("reading the offloaded optimizer buffer {k} from NVMe"))?;
            return Ok(self.split.join(&h, &dev));
        }
        Ok(self.split.join([&host.master, &host.m, &host.v][k], &dev))
    }

    fn layout_full_from_shards(&self, shards: &[Vec<f32>]) -> Vec<f32> {
        let mut full = vec![0f32; self.layout.total];
        for (r, sh) in shards.iter().enumerate() {
            for u in 0..self.layout.units.len() {
                let p = self.layout.piece(u, r);
                let off = self.layout.shard_offset(u);
                full[p.clone()].copy_from_slice(&sh[off..off + p.len()]);
            }
        }
        full
    }
}
