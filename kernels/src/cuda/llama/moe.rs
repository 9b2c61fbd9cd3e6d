//! The mixture-of-experts feed-forward of a LLaMA-family block on the GPU (Mixtral semantics,
//! dropless; kernels in `kernels/cuda/moe.cu`), forward and backward side by side:
//!
//! ```text
//! logits = h·Wr (f32)           p = softmax(logits)      (i, w) = top_k(p), w /= Σ w (norm_topk)
//! xs = h[rows grouped by expert, token order]            (a stable counting sort: `perm`)
//! out_e = (silu(xs_e·Wg_e) ∘ (xs_e·Wu_e))·Wd_e           (every expert's rows, one GEMM each)
//! y = x2 + Σ_k w_k · out[slot(t, k)]                     (in k order)
//! aux = E · Σ_e f_e · P_e over every MoE block's tokens  (transformers' load_balancing_loss_func)
//! ```
//!
//! Backward: `dout = w·dy`, `dw = dy·out`; the experts' GEMMs transposed; `dh = Σ_k dxs[slot]`
//! plus the router's `dlogits·Wrᵀ`, where `dlogits` comes through the renormalisation and the
//! softmax, with the load-balancing loss's `d/dp = coef·E·f_e/(L·N)` added. Every reduction has
//! a fixed order; the permutation is a counting sort, no atomics: the same bits every run.
//!
//! The experts' row counts are read back to the host after routing (one wait per MoE block and
//! pass): the GEMMs' shapes depend on them.

use std::ops::Range;
use std::sync::Mutex;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::super::blas::{Dt, GemmDesc, GroupMode, Mat};
use crate::cuda::{bf16, drv, grid_1d, Buf, DPtr, Gpu, GpuError, Result};
use crate::model::{AuxLoss, Gating, ModelConfig, NoisyGate};

/// The most experts a block may have (the routing kernels keep a token's probabilities in
/// registers; `MOE_MAX_EXPERTS` in moe.cu).
pub const MAX_EXPERTS: usize = 64;
/// Threads of the single-block permutation (`MOE_SCAN_THREADS` in moe.cu).
const SCAN_THREADS: u32 = 1024;
const EW_THREADS: u32 = 256;
/// GEMM calls of one block's pass that a pointer table is kept for (forward 3, backward 7).
const GEMM_CALLS: usize = 10;

macro_rules! launch {
    ($gpu:expr, $s:expr, $name:literal, $cfg:expr; $($a:expr),* $(,)?) => {{
        let f = $gpu.func("moe", $name)?;
        let mut lb = $s.launch_builder(&f);
        // Shadowed bindings live to the end of the block, so every argument outlives the launch.
        $( let arg = $a; lb.arg(&arg); )*
        // SAFETY: the argument list matches the kernel's parameters in moe.cu (device pointers
        // as u64, `int` as i32, `u64` as u64), and the wrappers sized every buffer.
        unsafe { lb.launch($cfg) }.map(|_| ()).map_err(drv(concat!("launching moe.cu kernel `", $name, "`")))
    }};
}

/// An MoE block's routing and tensors (unit-local; expert `e`'s tensors are expert 0's shifted
/// by `e·stride`, the layout rule of [`crate::model::MoeConfig`]).
#[derive(Clone, Debug)]
pub struct MoeLayout {
    pub router: Range<usize>,
    pub w_gate: Range<usize>,
    pub w_up: Range<usize>,
    pub w_down: Range<usize>,
    pub stride: usize,
    pub experts: usize,
    pub top_k: usize,
    pub d_expert: usize,
    pub norm_topk: bool,
    pub aux_coef: f32,
}

impl MoeLayout {
    /// From the model's configuration and `b(name)`, block 0's tensor ranges. Refuses, by name,
    /// what the GPU does not run yet.
    pub fn new(cfg: &ModelConfig, b: &dyn Fn(&str) -> Result<Range<usize>>) -> Result<MoeLayout> {
        let m = cfg.moe.as_ref().ok_or_else(|| GpuError::Invalid("not an MoE model".into()))?;
        let refuse = |what: &str| Err(GpuError::Invalid(format!("the GPU mixture-of-experts does not support {what} yet")));
        if m.capacity.is_some() {
            return refuse("expert capacity (capacity_factor / drop_tokens); it is dropless");
        }
        if m.noisy_gate != NoisyGate::None || m.random_token_selection {
            return refuse(&format!(
                "noisy gates or random token selection (noisy_gate {:?}, use_rts {})",
                m.noisy_gate, m.random_token_selection
            ));
        }
        if m.residual {
            return refuse("residual MoE (use_residual)");
        }
        if let Some(w) = m.shared_expert {
            return refuse(&format!("a shared expert (shared_expert_intermediate_size {w})"));
        }
        if m.z_loss_coef != 0.0 {
            return refuse(&format!("the router z-loss (z_loss_coef {})", m.z_loss_coef));
        }
        if m.gating != Gating::SoftmaxThenTopK {
            return refuse(&format!("gating {:?}", m.gating));
        }
        if m.aux_loss != AuxLoss::AcrossLayers && m.aux_loss_coef != 0.0 {
            return refuse(&format!("the load-balancing loss {:?}", m.aux_loss));
        }
        if m.sparse_step != 1 || !m.dense_layers.is_empty() {
            return refuse(&format!("dense blocks between MoE blocks (sparse_step {}, dense_layers {:?})", m.sparse_step, m.dense_layers));
        }
        if m.num_experts == 0 || m.num_experts > MAX_EXPERTS || m.top_k == 0 || m.top_k > m.num_experts {
            return Err(GpuError::Invalid(format!(
                "the GPU mixture-of-experts needs 1 ≤ top_k ≤ num_experts ≤ {MAX_EXPERTS}: num_experts {}, top_k {}",
                m.num_experts, m.top_k
            )));
        }
        let e = |i: usize, t: &str| b(&format!("moe.experts.{i}.{t}.weight"));
        let (w_gate, w_up, w_down) = (e(0, "w_gate")?, e(0, "w_up")?, e(0, "w_down")?);
        let stride = if m.num_experts > 1 { e(1, "w_gate")?.start - w_gate.start } else { 0 };
        for i in 0..m.num_experts {
            let sh = |r: &Range<usize>| r.start + i * stride..r.end + i * stride;
            if e(i, "w_gate")? != sh(&w_gate) || e(i, "w_up")? != sh(&w_up) || e(i, "w_down")? != sh(&w_down) {
                return Err(GpuError::Invalid(format!("expert {i}'s tensors are not expert 0's shifted by {stride}")));
            }
        }
        Ok(MoeLayout {
            router: b("moe.router.weight")?,
            w_gate,
            w_up,
            w_down,
            stride,
            experts: m.num_experts,
            top_k: m.top_k,
            d_expert: m.d_expert,
            norm_topk: m.norm_topk,
            aux_coef: m.aux_loss_coef,
        })
    }

    fn expert<T>(&self, unit: DPtr<T>, r: &Range<usize>, e: usize) -> DPtr<T> {
        unit.slice(r.start + e * self.stride..r.end + e * self.stride)
    }
}

/// One block's routing and expert activations (kept per block, or one shared set when the
/// backward recomputes).
pub struct MoeActs {
    logits: Buf<f32>,
    pub probs: Buf<f32>,
    pub topw: Buf<f32>,
    pub topi: Buf<u32>,
    perm: Buf<u32>,
    pub slot_of: Buf<u32>,
    offsets: Buf<u32>,
    pub xs: Buf<bf16>,
    pub out: Buf<bf16>,
    /// Expert `e`'s slots `[slots[e], slots[e+1])`, read back after routing.
    slots: Mutex<Vec<usize>>,
}

impl MoeActs {
    pub fn new(gpu: &Gpu, ml: &MoeLayout, n: usize, c: usize) -> Result<MoeActs> {
        let (e, nk) = (ml.experts, n * ml.top_k);
        Ok(MoeActs {
            logits: gpu.alloc(n * e)?,
            probs: gpu.alloc(n * e)?,
            topw: gpu.alloc(nk)?,
            topi: gpu.alloc(nk)?,
            perm: gpu.alloc(nk)?,
            slot_of: gpu.alloc(nk)?,
            offsets: gpu.alloc(e + 1)?,
            xs: gpu.alloc(nk * c)?,
            out: gpu.alloc(nk * c)?,
            slots: Mutex::new(Vec::new()),
        })
    }

    pub fn bytes(&self) -> usize {
        4 * (self.logits.len()
            + self.probs.len()
            + self.topw.len()
            + self.topi.len()
            + self.perm.len()
            + self.slot_of.len()
            + self.offsets.len())
            + 2 * (self.xs.len() + self.out.len())
    }

    /// Expert slot ranges of the last routing.
    pub fn slots(&self) -> Vec<usize> {
        self.slots.lock().expect("slots lock").clone()
    }
}

/// The expert MLP's buffers `[n·k, d_expert]` (the dense MLP's, resized) and the backward's
/// scratch, shared by every block.
pub struct MoeScratch {
    dout: Buf<bf16>,
    dw: Buf<f32>,
    dxs: Buf<f32>,
    dlogits: Buf<bf16>,
    /// d(aux)/d(p[t, e]) of the current micro-batch (the same for every token).
    auxg: Buf<f32>,
    /// Per block: Σ_t p[t, e] of the last forward.
    pub psum: Buf<f32>,
    /// Per block: tokens routed to each expert in the last forward.
    pub counts: Mutex<Vec<Vec<usize>>>,
    /// Pointer tables of the grouped GEMMs: [block][call][3·experts].
    table: Buf<u64>,
    pub mode: GroupMode,
}

impl MoeScratch {
    pub fn new(gpu: &Gpu, ml: &MoeLayout, n: usize, c: usize, layers: usize, mode: GroupMode) -> Result<MoeScratch> {
        let (e, nk) = (ml.experts, n * ml.top_k);
        Ok(MoeScratch {
            dout: gpu.alloc(nk * c)?,
            dw: gpu.alloc(nk)?,
            dxs: gpu.alloc(nk * c)?,
            dlogits: gpu.alloc(n * e)?,
            auxg: gpu.alloc(e)?,
            psum: gpu.alloc(layers * e)?,
            counts: Mutex::new(vec![vec![0; e]; layers]),
            table: gpu.alloc(layers * GEMM_CALLS * 3 * 2 * e)?,
            mode,
        })
    }

    pub fn bytes(&self) -> usize {
        2 * (self.dout.len() + self.dlogits.len())
            + 4 * (self.dw.len() + self.dxs.len() + self.auxg.len() + self.psum.len())
            + 8 * self.table.len()
    }

    fn table(&self, layer: usize, call: usize) -> DPtr<u64> {
        let per = self.table.len() / (self.counts.lock().expect("counts lock").len() * GEMM_CALLS);
        self.table.slice((layer * GEMM_CALLS + call) * per..(layer * GEMM_CALLS + call + 1) * per)
    }
}

/// Views of one block's MoE tensors.
#[derive(Clone, Copy, Debug)]
pub struct MoeW<T> {
    pub router: DPtr<T>,
    pub unit: DPtr<T>,
}

fn i32_of(what: &str, v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit the kernels' 32-bit index"))
}

fn bf(p: DPtr<bf16>) -> Mat {
    Mat::new(p.raw, Dt::Bf16)
}
fn bft(p: DPtr<bf16>) -> Mat {
    Mat::tr(p.raw, Dt::Bf16)
}
fn f32m(p: DPtr<f32>) -> Mat {
    Mat::new(p.raw, Dt::F32)
}

/// Rows `[a, b)` of a row-major `[*, w]` buffer.
fn rows<T>(p: DPtr<T>, (a, b): (usize, usize), w: usize) -> DPtr<T> {
    p.slice(a * w..b * w)
}

/// The experts that have rows, with their slot ranges.
fn busy(slots: &[usize]) -> Vec<(usize, (usize, usize))> {
    (0..slots.len() - 1).filter(|&e| slots[e + 1] > slots[e]).map(|e| (e, (slots[e], slots[e + 1]))).collect()
}

/// Routing and permutation of `h` ([n, c] bf16): fills `a`'s logits, probs, top-k, the slot maps
/// and `xs`; returns (and keeps) the experts' slot ranges. Waits for the GPU (the counts).
// Allowed: the GPU, the stream, the layout, the router, input and activations, and the shape.
#[allow(clippy::too_many_arguments)]
pub fn route(
    gpu: &Gpu,
    st: &CudaStream,
    ml: &MoeLayout,
    router: DPtr<bf16>,
    h: DPtr<bf16>,
    a: &MoeActs,
    n: usize,
    c: usize,
) -> Result<Vec<usize>> {
    let (e, k) = (ml.experts, ml.top_k);
    assert!(router.len == c * e && h.len == n * c && a.probs.len() == n * e && a.xs.len() == n * k * c, "moe route: buffer sizes");
    assert!(c % 8 == 0, "moe gather: width {c} is not a multiple of 8");
    gpu.blas.matmul(f32m(a.logits.ptr()), bf(h), bf(router), n, c, e)?;
    gpu.mark("moe router gemm");
    let (nu, nk) = (n as u64, (n * k) as u64);
    let (e_i, k_i, norm) = (i32_of("experts", e), i32_of("top_k", k), i32::from(ml.norm_topk));
    launch!(gpu, st, "moe_route", grid_1d(n, EW_THREADS); a.probs.ptr().raw, a.topw.ptr().raw, a.topi.ptr().raw, a.logits.ptr().raw, nu, e_i, k_i, norm)?;
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (SCAN_THREADS, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, st, "moe_permute", one; a.perm.ptr().raw, a.slot_of.ptr().raw, a.offsets.ptr().raw, a.topi.ptr().raw, nk, e_i)?;
    let c8 = (n * k * c / 8).max(1);
    launch!(gpu, st, "moe_gather", grid_1d(c8, EW_THREADS); a.xs.ptr().raw, h.raw, a.perm.ptr().raw, nk, i32_of("c", c), k_i)?;
    gpu.mark("moe route+permute+gather");
    let slots: Vec<usize> = gpu.download(a.offsets.ptr())?.into_iter().map(|x| x as usize).collect();
    *a.slots.lock().expect("slots lock") = slots.clone();
    Ok(slots)
}

/// The expert MLPs' forward on `a.xs` into `a.out`, through `gate`, `up`, `sw` ([n·k, f]).
// Allowed: the layer's weights, activations and the three MLP buffers are separate things.
#[allow(clippy::too_many_arguments)]
pub fn experts_forward(
    gpu: &Gpu,
    st: &CudaStream,
    ml: &MoeLayout,
    w: &MoeW<bf16>,
    a: &MoeActs,
    (gate, up, sw): (DPtr<bf16>, DPtr<bf16>, DPtr<bf16>),
    scr: &MoeScratch,
    layer: usize,
    c: usize,
) -> Result<()> {
    let f = ml.d_expert;
    let slots = a.slots();
    let bz = busy(&slots);
    let gemm = |c_: Mat, a_: Mat, b_: Mat, m, k, n| GemmDesc { c: c_, a: a_, b: b_, m, k, n, beta: 0.0 };
    let mut gu = Vec::new();
    for &(e, r) in &bz {
        let m = r.1 - r.0;
        gu.push(gemm(bf(rows(gate, r, f)), bf(rows(a.xs.ptr(), r, c)), bf(ml.expert(w.unit, &ml.w_gate, e)), m, c, f));
        gu.push(gemm(bf(rows(up, r, f)), bf(rows(a.xs.ptr(), r, c)), bf(ml.expert(w.unit, &ml.w_up, e)), m, c, f));
    }
    gpu.blas.matmul_grouped(&gu, scr.mode, scr.table(layer, 0))?;
    gpu.mark("moe experts gemm gate+up");
    super::ops::swiglu_forward(gpu, st, sw, gate, up)?;
    gpu.mark("moe swiglu");
    let down: Vec<_> = bz
        .iter()
        .map(|&(e, r)| gemm(bf(rows(a.out.ptr(), r, c)), bf(rows(sw, r, f)), bf(ml.expert(w.unit, &ml.w_down, e)), r.1 - r.0, f, c))
        .collect();
    gpu.blas.matmul_grouped(&down, scr.mode, scr.table(layer, 1))?;
    gpu.mark("moe experts gemm down");
    Ok(())
}

/// `y = x2 + Σ_k w·out[slot]` (f32 [n, c]).
// Allowed: the GPU, the stream, the layout, output, residual, activations and the shape.
#[allow(clippy::too_many_arguments)]
pub fn combine(gpu: &Gpu, st: &CudaStream, ml: &MoeLayout, y: DPtr<f32>, x2: DPtr<f32>, a: &MoeActs, n: usize, c: usize) -> Result<()> {
    assert!(y.len == n * c && x2.len == n * c, "moe combine: y and x2 must be [n, c]");
    launch!(gpu, st, "moe_combine", grid_1d(n * c, EW_THREADS); y.raw, x2.raw, a.out.ptr().raw, a.topw.ptr().raw, a.slot_of.ptr().raw, n as u64, i32_of("c", c), i32_of("top_k", ml.top_k))?;
    gpu.mark("moe combine");
    Ok(())
}

/// Σ_t p[t, e] of block `layer` into the scratch (the aux loss's router-probability term), and
/// the block's expert counts.
pub fn record_load(gpu: &Gpu, st: &CudaStream, ml: &MoeLayout, a: &MoeActs, scr: &MoeScratch, layer: usize, n: usize) -> Result<()> {
    let e = ml.experts;
    let psum = scr.psum.slice(layer * e..(layer + 1) * e);
    let cfg = LaunchConfig { grid_dim: (e as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, st, "moe_prob_sum", cfg; psum.raw, a.probs.ptr().raw, n as u64, i32_of("experts", e))?;
    let slots = a.slots();
    scr.counts.lock().expect("counts lock")[layer] = (0..e).map(|i| slots[i + 1] - slots[i]).collect();
    Ok(())
}

/// The load-balancing loss over every block's routing of the micro-batch (`E · Σ_e f_e·P_e`,
/// f_e the fraction of (token, block) pairs that chose e, counted k times, P_e the mean router
/// probability) and, with `dscale` the micro-batch's loss scale, uploads its gradient
/// `dscale·coef·E·f_e/(L·N)` for the backward. Returns the loss (waits for the GPU).
pub fn aux_loss(gpu: &Gpu, ml: &MoeLayout, scr: &MoeScratch, n: usize, dscale: f32) -> Result<f32> {
    let e = ml.experts;
    let counts = scr.counts.lock().expect("counts lock").clone();
    let tokens = (counts.len() * n) as f64;
    let f: Vec<f64> = (0..e).map(|i| counts.iter().map(|c| c[i] as f64).sum::<f64>() / tokens).collect();
    let psum = gpu.download(scr.psum.ptr())?;
    let p: Vec<f64> = (0..e).map(|i| (0..counts.len()).map(|l| psum[l * e + i] as f64).sum::<f64>() / tokens).collect();
    let aux = e as f64 * f.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>();
    let g: Vec<f32> = f.iter().map(|&fi| (dscale as f64 * ml.aux_coef as f64 * e as f64 * fi / tokens) as f32).collect();
    set_aux_grad(gpu, scr, &g)?;
    Ok(aux as f32)
}

/// Sets d(objective)/d(p[t, e]) of the load-balancing loss, `g[e]` for every token, for the
/// backwards that follow (waits for the GPU first: no kernel is reading it then).
pub fn set_aux_grad(gpu: &Gpu, scr: &MoeScratch, g: &[f32]) -> Result<()> {
    assert_eq!(g.len(), scr.auxg.len(), "one aux-loss gradient per expert");
    gpu.sync()?;
    // SAFETY: auxg holds g.len() f32 and the GPU is idle.
    unsafe { cudarc::driver::result::memcpy_htod_sync(scr.auxg.ptr().raw, g) }.map_err(drv("uploading the aux-loss gradient"))
}

/// One MoE block's backward: `dy` (f32 [n, c]) is d(block output); writes d(h) into `dh`
/// (f32 [n, c]) and the router's and experts' gradients into `gw` (zeroed by the caller, β = 0
/// or added onto zeros). `gate`, `up`, `sw` hold the forward's expert activations; `dgate`,
/// `dup`, `dsw` are scratch of the same size.
// Allowed: the block's weights, gradients, activations and the MLP buffers are separate things.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    gpu: &Gpu,
    st: &CudaStream,
    ml: &MoeLayout,
    (w, gw): (&MoeW<bf16>, &MoeW<f32>),
    h: DPtr<bf16>,
    dy: DPtr<f32>,
    dh: DPtr<f32>,
    a: &MoeActs,
    (gate, up, sw): (DPtr<bf16>, DPtr<bf16>, DPtr<bf16>),
    (dgate, dup, dsw): (DPtr<bf16>, DPtr<bf16>, DPtr<bf16>),
    scr: &MoeScratch,
    layer: usize,
    (n, c): (usize, usize),
) -> Result<()> {
    let (e, k, f) = (ml.experts, ml.top_k, ml.d_expert);
    let (nk, k_i, c_i) = ((n * k) as u64, i32_of("top_k", k), i32_of("c", c));
    let warps = LaunchConfig { grid_dim: (((n * k) as u32).div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (dout, dxs) = (scr.dout.ptr(), scr.dxs.ptr());
    launch!(gpu, st, "moe_combine_bwd", warps; dout.raw, scr.dw.ptr().raw, dy.raw, a.out.ptr().raw, a.topw.ptr().raw, a.slot_of.ptr().raw, nk, c_i, k_i)?;
    gpu.mark("moe combine bwd");
    let bz = busy(&a.slots());
    let g = |c_: Mat, a_: Mat, b_: Mat, m, kk, nn, beta| GemmDesc { c: c_, a: a_, b: b_, m, k: kk, n: nn, beta };
    let (wd, wg, wu) = (|e| ml.expert(w.unit, &ml.w_down, e), |e| ml.expert(w.unit, &ml.w_gate, e), |e| ml.expert(w.unit, &ml.w_up, e));
    let (gd, gg, gu) = (|e| ml.expert(gw.unit, &ml.w_down, e), |e| ml.expert(gw.unit, &ml.w_gate, e), |e| ml.expert(gw.unit, &ml.w_up, e));
    let run = |call: usize, gs: Vec<GemmDesc>| gpu.blas.matmul_grouped(&gs, scr.mode, scr.table(layer, call));
    // Down projection: d(Wd_e) = sw_eᵀ·dout_e, d(sw_e) = dout_e·Wd_eᵀ.
    run(2, bz.iter().map(|&(e, r)| g(f32m(gd(e)), bft(rows(sw, r, f)), bf(rows(dout, r, c)), f, r.1 - r.0, c, 0.0)).collect())?;
    run(3, bz.iter().map(|&(e, r)| g(bf(rows(dsw, r, f)), bf(rows(dout, r, c)), bft(wd(e)), r.1 - r.0, c, f, 0.0)).collect())?;
    gpu.mark("moe experts gemm down bwd");
    super::ops::swiglu_backward(gpu, st, dgate, dup, dsw, gate, up)?;
    gpu.mark("moe swiglu bwd");
    let mut wgrad = Vec::new();
    for &(e, r) in &bz {
        wgrad.push(g(f32m(gg(e)), bft(rows(a.xs.ptr(), r, c)), bf(rows(dgate, r, f)), c, r.1 - r.0, f, 0.0));
        wgrad.push(g(f32m(gu(e)), bft(rows(a.xs.ptr(), r, c)), bf(rows(dup, r, f)), c, r.1 - r.0, f, 0.0));
    }
    run(4, wgrad)?;
    run(5, bz.iter().map(|&(e, r)| g(f32m(rows(dxs, r, c)), bf(rows(dgate, r, f)), bft(wg(e)), r.1 - r.0, f, c, 0.0)).collect())?;
    run(6, bz.iter().map(|&(e, r)| g(f32m(rows(dxs, r, c)), bf(rows(dup, r, f)), bft(wu(e)), r.1 - r.0, f, c, 1.0)).collect())?;
    gpu.mark("moe experts gemm gate+up bwd");
    launch!(gpu, st, "moe_scatter_bwd", grid_1d(n * c, EW_THREADS); dh.raw, dxs.raw, a.slot_of.ptr().raw, n as u64, c_i, k_i)?;
    let norm = i32::from(ml.norm_topk);
    let dl = scr.dlogits.ptr();
    launch!(gpu, st, "moe_router_bwd", grid_1d(n, EW_THREADS); dl.raw, a.probs.ptr().raw, a.topw.ptr().raw, a.topi.ptr().raw, scr.dw.ptr().raw, scr.auxg.ptr().raw, n as u64, i32_of("experts", e), k_i, norm)?;
    // Router: d(Wr) = hᵀ·dlogits, dh += dlogits·Wrᵀ.
    gpu.blas.matmul(f32m(gw.router), bft(h), bf(dl), c, n, e)?;
    gpu.blas.matmul_beta(f32m(dh), bf(dl), bft(w.router), (n, e, c), 1.0)?;
    gpu.mark("moe scatter+router bwd");
    Ok(())
}

/// How the experts' GEMMs are issued: `grouped` (one `cublasGemmGroupedBatchedEx` per
/// projection; the default: the faster or equal of the two in the Mixtral-shaped model's step on
/// the H200, 56.5 against 62.5 ms and 59.2 against 59.2, although alone one 8-expert projection
/// ran at 329 TFLOP/s grouped against 660 looped — docs/PERFORMANCE.md) or
/// `TESSERA_GPU_MOE_GEMM=loop` (one cuBLAS GEMM per expert), read when a workspace is made.
pub fn gemm_mode() -> Result<GroupMode> {
    match std::env::var("TESSERA_GPU_MOE_GEMM").as_deref() {
        Err(_) | Ok("grouped") => Ok(GroupMode::Grouped),
        Ok("loop") => Ok(GroupMode::Loop),
        Ok(v) => Err(GpuError::Invalid(format!("TESSERA_GPU_MOE_GEMM={v}: expected `loop` or `grouped`"))),
    }
}

/// What [`gemm_bench`] measured (TFLOP/s of `2·rows·c·f` per call).
#[derive(Clone, Copy, Debug)]
pub struct GemmBench {
    pub loop_tflops: f64,
    pub grouped_tflops: f64,
    pub dense_tflops: f64,
    /// Whether cuBLAS ran the grouped call (not the loop it falls back to).
    pub grouped_ran: bool,
}

/// Times the experts' forward gate projection `[n_e, c]·[c, f]` for the row split `split`
/// (`iters` calls after 3 warm-ups each): per-expert loop, one grouped call, and one dense GEMM
/// of all `Σ n_e` rows, on random bf16 operands.
pub fn gemm_bench(gpu: &Gpu, split: &[usize], c: usize, f: usize, iters: usize) -> Result<GemmBench> {
    let total: usize = split.iter().sum();
    let e = split.len();
    let mut rng = crate::tensor::Rng::derive(7, &[total as u64, c as u64, f as u64]);
    let mut rand = |n: usize| -> Vec<bf16> {
        let mut v = vec![0f32; n];
        rng.fill_normal(&mut v, 0.02);
        v.into_iter().map(bf16::from_f32).collect()
    };
    let x = gpu.upload(&rand(total * c))?;
    let w = gpu.upload(&rand(e * c * f))?;
    let y = gpu.alloc::<bf16>(total * f)?;
    let table = gpu.alloc::<u64>(3 * e)?;
    let mut gs = Vec::new();
    let mut r0 = 0;
    for (i, &n) in split.iter().enumerate() {
        let r = (r0, r0 + n);
        if n > 0 {
            let wi = w.slice(i * c * f..(i + 1) * c * f);
            gs.push(GemmDesc { c: bf(rows(y.ptr(), r, f)), a: bf(rows(x.ptr(), r, c)), b: bf(wi), m: n, k: c, n: f, beta: 0.0 });
        }
        r0 += n;
    }
    let time = |run: &dyn Fn() -> Result<bool>| -> Result<(f64, bool)> {
        let mut ran = false;
        for _ in 0..3 {
            ran = run()?;
        }
        gpu.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            run()?;
        }
        gpu.sync()?;
        let s = t0.elapsed().as_secs_f64() / iters as f64;
        Ok((2.0 * total as f64 * c as f64 * f as f64 / s / 1e12, ran))
    };
    let (loop_tflops, _) = time(&|| gpu.blas.matmul_grouped(&gs, GroupMode::Loop, table.ptr()))?;
    let (grouped_tflops, grouped_ran) = time(&|| gpu.blas.matmul_grouped(&gs, GroupMode::Grouped, table.ptr()))?;
    let w0 = w.slice(0..c * f);
    let (dense_tflops, _) = time(&|| gpu.blas.matmul(bf(y.ptr()), bf(x.ptr()), bf(w0), total, c, f).map(|_| false))?;
    Ok(GemmBench { loop_tflops, grouped_tflops, dense_tflops, grouped_ran })
}
