//! The GPU path: `tessera gpu check` (every kernel and the whole model against the CPU
//! reference) and `tessera gpu bench` (GPT-2 training throughput on 1..N GPUs, one process per
//! GPU, NCCL between them, ZeRO 0–3), the figures `docs/PERFORMANCE.md` records next to the
//! PyTorch and DeepSpeed peers.

mod check_fp16;
pub mod compute;
pub mod decode_bench;
pub mod lamb_host;
pub mod nvme;
pub mod offload;
pub mod param_offload;
pub mod train;
pub mod zero;

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_kernels::cuda::{self, gpt, Gpu};
use tessera_kernels::model::{Model, ModelConfig};
use tessera_kernels::tensor::Rng;
use tessera_transport::nccl::{NcclComm, NcclId};

use crate::zoo;

/// Environment variables a `gpu bench` parent hands its rank processes.
const ENV_RANK: &str = "TESSERA_GPU_RANK";
const ENV_WORLD: &str = "TESSERA_GPU_WORLD";
const ENV_NCCL_ID: &str = "TESSERA_NCCL_ID";

/// The rank a GPU parent started this process as (`TESSERA_GPU_RANK`), if it did.
pub fn rank_in_env() -> Option<usize> {
    std::env::var(ENV_RANK).ok()?.parse().ok()
}

/// Prints which cuBLASLt fused GEMMs this GPU's library runs for GPT-2 124M's shapes (micro-batch
/// 16 × 1024), and which fusions a default workspace uses (`TESSERA_GPU_FUSE` narrows them).
fn fusion_report(gpu: &Gpu) -> Result<()> {
    let model = Model::new(zoo::preset("gpt2-small").map_err(anyhow::Error::msg)?).map_err(anyhow::Error::msg)?;
    let layout = gpt::GpuLayout::new(&model, 1)?;
    let shape = gpt::Shape::new(&model.cfg, 16, 1024)?;
    println!("— cuBLASLt fused GEMMs for GPT-2 124M (micro-batch 16 × 1024)");
    let rows = gpt::fusion_support(gpu, shape, &layout)?;
    if rows.is_empty() {
        println!("  cuBLASLt not loaded: every GEMM runs through cuBLAS with separate elementwise kernels");
    }
    for (what, ok) in rows {
        println!("  {what:<48} {}", if ok { "supported" } else { "not supported" });
    }
    Ok(())
}

/// Runs every GPU correctness check; returns whether all passed.
/// `only`: run just the sections whose title contains it (case-insensitive), e.g. `offload`.
pub fn check(seed: u64, only: Option<&str>) -> Result<bool> {
    let gpu: Arc<Gpu> = Gpu::open(0)?;
    println!("GPU 0: {} ({}), NVRTC {:?}", gpu.name, gpu.arch(), cuda::nvrtc_version()?);
    let t = Instant::now();
    gpu.compile_all()?;
    println!("kernels compiled (or loaded from the cache) in {:.2} s", t.elapsed().as_secs_f64());
    fusion_report(&gpu)?;
    let mut all_ok = true;
    let only = only.map(str::to_lowercase);
    let mut report = |name: &str, rows: &dyn Fn() -> Result<Vec<cuda::CheckRow>>| {
        if only.as_ref().is_some_and(|o| !name.to_lowercase().contains(o.as_str())) {
            return;
        }
        println!("— {name}");
        match rows() {
            Ok(rows) => {
                for r in rows {
                    all_ok &= r.pass();
                    println!("  {r}");
                }
            }
            Err(e) => {
                all_ok = false;
                println!("  FAIL: {e:#}");
            }
        }
    };
    report("ops", &|| cuda::ops::check(&gpu, seed).map_err(Into::into));
    report("optimizers: Adam/AdamW, SGD, Lion and Adagrad kernels against the CPU's OptimizerShard::step, bit for bit", &|| {
        cuda::optim::check(&gpu, seed).map_err(Into::into)
    });
    report(
        "optimizers: LAMB (update, slot sums of squares, trust ratios, commit) against the CPU's OptimizerShard::step, bit for bit",
        &|| cuda::lamb::check(&gpu, seed).map_err(Into::into),
    );
    report("attention", &|| cuda::attention::check(&gpu, seed).map_err(Into::into));
    report("model (2-layer GPT vs CPU f32)", &|| gpt::check(&gpu, seed).map_err(Into::into));
    report("LLaMA family: RMSNorm, RoPE, SwiGLU, grouped-query attention (hd 64, 128) and 2-layer models vs the CPU (f32)", &|| {
        cuda::llama::check(&gpu, seed).map_err(Into::into)
    });
    report(
        "decoding: paged attention, and small GPT-2 / LLaMA models stepped over a paged cache (prefill chunks, shared prefix, CUDA graphs) vs the CPU",
        &|| cuda::decode::check::check(&gpu, seed).map_err(Into::into),
    );
    report("GPT-2 124M: the first training steps on the GPU (bf16) against the CPU model (f32)", &|| check_gpt2_steps(gpu.clone(), seed));
    report("optimizer offload: the GPU adamw kernel against the host step, bit for bit", &|| check_adamw_offload(&gpu, seed));
    report(
        "optimizer offload, parameter offload (ZeRO-3, host memory and NVMe), and the optimizer during the backward (AdamW, \
         Adam, SGD, Lion, Adagrad; offloaded with each): training against the GPU optimizer after the backward with the \
         parameters on the GPU, bit for bit; \
         LAMB through the rank at ZeRO 0-3 on one GPU, and offloaded",
        &|| check_offload_training(gpu.clone(), seed),
    );
    report("fp16: overflow decisions against the CPU gradient stored in fp16, the dynamic loss scaler's skipped steps, and fp16 with the optimizer offloaded", &|| {
        check_fp16::check(gpu.clone(), seed)
    });
    println!("{}", if all_ok { "all GPU checks passed" } else { "SOME GPU CHECKS FAILED" });
    Ok(all_ok)
}

/// GPT-2 124M (vocab 50304): the losses of the first steps on the GPU (bf16 parameters and
/// activations, fp32 masters, AdamW on the GPU) against the CPU model in f32 with the same
/// initial parameters, the same tokens and the same AdamW (a plain f64-coefficient loop here).
/// Step 1's loss checks the forward; later steps check that gradients and updates agree, within
/// bf16 accuracy.
fn check_gpt2_steps(gpu: Arc<Gpu>, seed: u64) -> Result<Vec<cuda::CheckRow>> {
    use tessera_kernels::model::{FlatAccess, MicroBatch, Workspace};
    const STEPS: usize = 4;
    let (b, t, lr) = (2usize, 256usize, 1e-3f32);
    let mut cfg = zoo::preset("gpt2-small").map_err(anyhow::Error::msg)?;
    cfg.vocab_size = 50304;
    let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
    let init = model.init_params(seed);
    let (betas, eps, weight_decay) = ((0.9f32, 0.95f32), 1e-8f32, 0.1f32);
    let optim = zero::Optimizer::adamw(betas, eps, weight_decay, 0.0);
    let shape = gpt::Shape::new(&model.cfg, b, t)?;
    let mut rank = zero::Rank::new(
        gpu,
        None,
        zero::RankSpec {
            model: &model,
            stage: 0,
            shape,
            init: &init,
            optim,
            m_local: 1,
            offload: None,
            recompute: false,
            fp16: false,
            nvme: None,
            params_offload: None,
        },
    )?;
    let (mut p, mut m, mut v) = (init.clone(), vec![0f32; init.len()], vec![0f32; init.len()]);
    let decay = model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.decay, s.numel())).collect::<Vec<bool>>();
    let mut ws = Workspace::default();
    let mut rows = Vec::new();
    for step in 0..STEPS {
        let (tok, tgt) = batch(seed, step, 0, b, t, model.cfg.vocab_size);
        let (gpu_loss, _) = rank.step(&[(tok.clone(), tgt.clone())], lr, 1.0)?;
        let mut g = vec![0f32; p.len()];
        let cpu_loss = {
            let mut acc = FlatAccess { params: &p, grads: &mut g, units: model.units() };
            model.forward_backward(
                &mut acc,
                MicroBatch { tokens: &tok, targets: &tgt, b, t, noise_key: tessera_kernels::model::noise_key_of(seed, step as u64, 0) },
                1.0,
                &mut ws,
            )
        };
        let k = (step + 1) as f64;
        let (b1, b2) = (betas.0 as f64, betas.1 as f64);
        let (bc1, bc2) = (1.0 - b1.powf(k), 1.0 - b2.powf(k));
        for i in 0..p.len() {
            let gi = g[i] as f64;
            let mi = b1 * m[i] as f64 + (1.0 - b1) * gi;
            let vi = b2 * v[i] as f64 + (1.0 - b2) * gi * gi;
            let mut pi = p[i] as f64;
            if decay[i] {
                pi -= lr as f64 * weight_decay as f64 * pi;
            }
            pi -= lr as f64 * (mi / bc1) / ((vi / bc2).sqrt() + eps as f64);
            (p[i], m[i], v[i]) = (pi as f32, mi as f32, vi as f32);
        }
        rows.push(cuda::CheckRow::compare(
            format!("gpt2-small step {} loss (b={b}, t={t})", step + 1),
            &[gpu_loss],
            &[cpu_loss],
            0.0,
            1e-2,
        ));
    }
    Ok(rows)
}

/// A bit-for-bit comparison as a check row: `max_rel` carries the number of differing elements
/// (the tolerance is 0) and the name says where the first one is.
fn bits_row(name: String, gpu: &[u32], host: &[u32]) -> cuda::CheckRow {
    let diff: Vec<usize> = (0..gpu.len().min(host.len())).filter(|&i| gpu[i] != host[i]).collect();
    let len_ok = gpu.len() == host.len();
    let detail = match diff.first() {
        _ if !len_ok => format!(": lengths differ (GPU {}, host {})", gpu.len(), host.len()),
        None => format!(": all {} identical", gpu.len()),
        Some(&i) => format!(": {} of {} differ; first at {i}: GPU {:#010x}, host {:#010x}", diff.len(), gpu.len(), gpu[i], host[i]),
    };
    cuda::CheckRow {
        name: format!("{name}{detail}"),
        max_abs: 0.0,
        max_rel: if len_ok { diff.len() as f64 } else { f64::INFINITY },
        tol: 0.0,
        non_finite: false,
    }
}

fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The inputs of [`check_adamw_offload`]: normal values, and every 16th element at the
/// subnormal edge.
struct AdamInputs {
    master: Vec<f32>,
    grad: Vec<f32>,
    m0: Vec<f32>,
    v0: Vec<f32>,
    decay: Vec<u8>,
}

impl AdamInputs {
    fn new(seed: u64, len: usize) -> AdamInputs {
        let mut rng = Rng::derive(seed, &[0x0ff1_0ad0]);
        let mut normal = |std: f32, n: usize| {
            let mut v = vec![0f32; n];
            rng.fill_normal(&mut v, std);
            v
        };
        let mut master = normal(0.02, len);
        let mut grad = normal(1e-2, len);
        let mut m0 = normal(1e-3, len);
        let mut v0: Vec<f32> = normal(1e-3, len).iter().map(|x| x * x).collect();
        // Every 16th element: values at the subnormal edge (tiny gradients whose squares underflow,
        // subnormal gradients and moments, zeros of both signs).
        let tiny = [1e-39f32, -1e-39, 1e-20, -3e-21, 0.0, -0.0, 1e-44, 2e-38];
        for (k, i) in (0..len).step_by(16).enumerate() {
            grad[i] = tiny[k % tiny.len()];
            m0[i] = tiny[(k / 8) % tiny.len()];
            v0[i] = tiny[(k / 64) % tiny.len()].abs();
            if k % 5 == 0 {
                master[i] = tiny[(k / 3) % tiny.len()];
            }
        }
        let decay: Vec<u8> = (0..len).map(|i| u8::from((i / 4096) % 2 == 0)).collect();
        AdamInputs { master, grad, m0, v0, decay }
    }
}

/// The GPU `adamw` kernel against the host step of optimizer offload on the same inputs, bit
/// for bit: normal values, and elements built to hit subnormals (subnormal gradients, moments
/// and results), at both lerp forms of m (β1 < 0.5 and ≥ 0.5). Where they differ, the last row
/// says whether the GPU then matches IEEE arithmetic without flushing (which would mean the
/// kernel does not flush subnormals as `src/gpu/offload.rs` assumes).
fn check_adamw_offload(gpu: &Gpu, seed: u64) -> Result<Vec<cuda::CheckRow>> {
    use tessera_kernels::cuda::{bf16, ops};
    let len = 1 << 20;
    let AdamInputs { master, grad, m0, v0, decay } = AdamInputs::new(seed, len);
    let mut rows = Vec::new();
    for (betas, grad_scale, step) in [((0.9f32, 0.95f32), 0.37f32, 7u64), ((0.3, 0.999), 1.0, 1)] {
        let hp = ops::AdamStep::new(6e-4, betas, 1e-8, 0.1, step);
        let s = &gpu.stream;
        let (d_master, d_grad, d_m, d_v, d_decay) =
            (gpu.upload(&master)?, gpu.upload(&grad)?, gpu.upload(&m0)?, gpu.upload(&v0)?, gpu.upload(&decay)?);
        let d_param = gpu.alloc::<bf16>(len)?;
        let bufs = ops::OptimBufs {
            master: d_master.ptr(),
            param: d_param.ptr(),
            grad: d_grad.ptr(),
            m: d_m.ptr(),
            v: d_v.ptr(),
            decay: d_decay.ptr(),
        };
        ops::adamw(gpu, s, &bufs, &hp, grad_scale)?;
        let (g_master, g_m, g_v, g_param) =
            (gpu.download(d_master.ptr())?, gpu.download(d_m.ptr())?, gpu.download(d_v.ptr())?, gpu.download(d_param.ptr())?);
        let (mut p, mut m, mut v, mut out) = (master.clone(), m0.clone(), v0.clone(), vec![bf16::ZERO; len]);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(offload::default_threads(1)).build()?;
        let bufs = offload::HostAdamBufs { master: &mut p, m: &mut m, v: &mut v, grad: &grad, decay: &decay, param: &mut out };
        offload::adamw_host_par(&pool, &hp, grad_scale, bufs);
        let tag = format!("β1 {}, grad scale {grad_scale}, step {step}", betas.0);
        rows.push(bits_row(format!("adamw GPU vs host, masters ({tag})"), &f32_bits(&g_master), &f32_bits(&p)));
        rows.push(bits_row(format!("adamw GPU vs host, exp_avg ({tag})"), &f32_bits(&g_m), &f32_bits(&m)));
        rows.push(bits_row(format!("adamw GPU vs host, exp_avg_sq ({tag})"), &f32_bits(&g_v), &f32_bits(&v)));
        let pb = |x: &[bf16]| x.iter().map(|b| u32::from(b.to_bits())).collect::<Vec<u32>>();
        rows.push(bits_row(format!("adamw GPU vs host, bf16 params ({tag})"), &pb(&g_param), &pb(&out)));
        // Diagnosis of any difference: the same expression in plain IEEE f32 (no flushing).
        let bad: Vec<usize> = (0..len)
            .filter(|&i| {
                g_master[i].to_bits() != p[i].to_bits() || g_m[i].to_bits() != m[i].to_bits() || g_v[i].to_bits() != v[i].to_bits()
            })
            .collect();
        if !bad.is_empty() {
            let ieee = |i: usize| -> (f32, f32, f32) {
                let g = grad[i] * grad_scale;
                let pd = master[i] * if decay[i] != 0 { hp.decoupled_factor } else { 1.0 };
                let m1 = if hp.lerp_w < 0.5 { m0[i] + hp.lerp_w * (g - m0[i]) } else { g - (g - m0[i]) * (1.0 - hp.lerp_w) };
                let v1 = v0[i] * hp.beta2 + hp.one_minus_beta2 * g * g;
                let denom = v1.sqrt() / hp.bc2_sqrt + hp.eps;
                (pd - hp.step_size * (m1 / denom), m1, v1)
            };
            let like_ieee = bad.iter().filter(|&&i| {
                let (a, b, c) = ieee(i);
                (a.to_bits(), b.to_bits(), c.to_bits()) == (g_master[i].to_bits(), g_m[i].to_bits(), g_v[i].to_bits())
            });
            let n_ieee = like_ieee.count();
            let subnormal_site = bad.iter().filter(|&&i| i % 16 == 0).count();
            rows.push(cuda::CheckRow {
                name: format!(
                    "adamw diagnosis ({tag}): {} elements differ, {subnormal_site} of them at the subnormal test sites; the GPU equals \
                     unflushed IEEE f32 at {n_ieee} of them{}",
                    bad.len(),
                    if n_ieee == bad.len() {
                        " — the kernel does not flush subnormals: drop the ftz() calls in src/gpu/offload.rs"
                    } else {
                        ""
                    }
                ),
                max_abs: 0.0,
                max_rel: bad.len() as f64,
                tol: 0.0,
                non_finite: false,
            });
        }
    }
    Ok(rows)
}

/// Training with the optimizer offloaded (all of it, and half of each piece) against the GPU
/// optimizer, bit for bit: a small GPT (gpt-mini-gpu), one GPU, 3 micro-batches per step (an
/// uneven micro-batch tree, finished unit by unit in the last backward), 3 steps, ZeRO-2 and
/// ZeRO-3, with and without clipping; the masters, both moments and an evaluation loss after
/// the steps (which reads the parameters copied back) must be identical. The same comparison
/// for AdamW run unit by unit during the backward (`Rank::early_adam`, what one GPU without
/// clipping does by default) against AdamW after it, at ZeRO-0, 2 and 3, with and without
/// offload.
fn check_offload_training(gpu: Arc<Gpu>, seed: u64) -> Result<Vec<cuda::CheckRow>> {
    let (b, t, steps, m_local) = (4usize, 128usize, 3usize, 3usize);
    let mut cfg = zoo::preset("gpt-mini-gpu").map_err(anyhow::Error::msg)?;
    cfg.vocab_size = 256;
    let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
    let init = model.init_params(seed);
    let shape = gpt::Shape::new(&model.cfg, b, t)?;
    let v = model.cfg.vocab_size;
    /// Masters, exp_avg, exp_avg_sq, an evaluation loss, the host optimizer's figures and the
    /// rank's bf16 parameter shard (bits).
    type Outcome = (Vec<f32>, Vec<f32>, Vec<f32>, f32, Option<offload::OffloadStats>, Vec<u32>);
    let run_params = |optim: zero::Optimizer,
                      stage: u8,
                      offload: Option<f64>,
                      (early, nvme): (bool, Option<&offload::NvmeSite>),
                      params_offload: Option<&param_offload::ParamOffloadOptions>|
     -> Result<Outcome> {
        let off = offload.map(|ratio| zero::OffloadOptions { ratio, threads: offload::default_threads(1) });
        let spec = zero::RankSpec {
            model: &model,
            stage,
            shape,
            init: &init,
            optim,
            m_local,
            offload: off,
            recompute: false,
            fp16: false,
            nvme,
            params_offload,
        };
        let mut r = zero::Rank::new(gpu.clone(), None, spec)?;
        r.early_adam = early;
        for step in 0..steps {
            let mbs: Vec<_> = (0..m_local).map(|j| batch(seed, step, j, b, t, v)).collect();
            r.step(&mbs, 2e-3, 1.0 / m_local as f32)?;
        }
        let (x, y) = batch(seed, 99, 0, b, t, v);
        let loss = r.forward_loss(&x, &y)?;
        let mut st = r.optimizer_state()?.into_iter();
        let (mm, vv) = (st.next().unwrap_or_default(), st.next().unwrap_or_default());
        let shard = r.params_shard()?.iter().map(|b| u32::from(b.to_bits())).collect();
        Ok((r.masters()?, mm, vv, loss, r.offload_stats(), shard))
    };
    let run_on = |optim: zero::Optimizer, stage: u8, offload: Option<f64>, early: bool, nvme: Option<&offload::NvmeSite>| {
        run_params(optim, stage, offload, (early, nvme), None)
    };
    let run_with = |optim: zero::Optimizer, stage: u8, offload: Option<f64>, early: bool| run_on(optim, stage, offload, early, None);
    let run = |stage: u8, clip: f32, offload: Option<f64>, early: bool| -> Result<Outcome> {
        run_with(zero::Optimizer::adamw((0.9, 0.95), 1e-8, 0.1, clip), stage, offload, early)
    };
    let mut rows = Vec::new();
    let same = |rows: &mut Vec<cuda::CheckRow>, what: &str, tag: &str, o: &Outcome, base: &Outcome| {
        rows.push(bits_row(format!("{what}, masters ({tag})"), &f32_bits(&o.0), &f32_bits(&base.0)));
        rows.push(bits_row(format!("{what}, exp_avg ({tag})"), &f32_bits(&o.1), &f32_bits(&base.1)));
        rows.push(bits_row(format!("{what}, exp_avg_sq ({tag})"), &f32_bits(&o.2), &f32_bits(&base.2)));
    };
    for (stage, offload) in [(0u8, None), (2, None), (2, Some(0.5)), (3, None)] {
        let (early, late) = (run(stage, 0.0, offload, true)?, run(stage, 0.0, offload, false)?);
        let tag = format!("ZeRO-{stage}, clip 0, offload ratio {}", offload.map_or("none".into(), |r: f64| r.to_string()));
        let what = "AdamW during the backward vs after it";
        same(&mut rows, what, &tag, &early, &late);
        rows.push(bits_row(format!("{what}, eval loss after the steps ({tag})"), &[early.3.to_bits()], &[late.3.to_bits()]));
    }
    for (stage, clip) in [(2u8, 1.0f32), (2, 0.0), (3, 1.0)] {
        let base = run(stage, clip, None, true)?;
        for ratio in [1.0, 0.5] {
            let o = run(stage, clip, Some(ratio), true)?;
            let tag = format!("ZeRO-{stage}, clip {clip}, ratio {ratio}");
            same(&mut rows, "offload vs GPU optimizer", &tag, &o, &base);
            let hidden = o.4.map_or(String::new(), |s| {
                format!(
                    " [host step {:.2} ms/step, {:.0}% hidden]",
                    s.cpu_step_s * 1e3 / s.steps.max(1) as f64,
                    100.0 * s.hidden_fraction()
                )
            });
            rows.push(bits_row(
                format!("offload vs GPU optimizer, eval loss after the steps ({tag}){hidden}"),
                &[o.3.to_bits()],
                &[base.3.to_bits()],
            ));
        }
    }
    // NVMe offload (swap files in the temporary directory, read ahead and written behind the
    // host step) against the GPU optimizer.
    let site = offload::NvmeSite { dir: std::env::temp_dir(), aio: crate::offload::AioOptions::default() };
    for (stage, clip) in [(2u8, 1.0f32), (3, 0.0)] {
        let optim = zero::Optimizer::adamw((0.9, 0.95), 1e-8, 0.1, clip);
        let (o, base) = (run_on(optim, stage, Some(1.0), true, Some(&site))?, run(stage, clip, None, true)?);
        let tag = format!("ZeRO-{stage}, clip {clip}, ratio 1, swap files in {}", site.dir.display());
        same(&mut rows, "NVMe offload vs GPU optimizer", &tag, &o, &base);
        rows.push(bits_row(
            format!("NVMe offload vs GPU optimizer, eval loss after the steps ({tag})"),
            &[o.3.to_bits()],
            &[base.3.to_bits()],
        ));
    }
    rows.extend(check_param_offload(&site, |optim, stage, offload, early, nvme, p| {
        let o = run_params(optim, stage, offload, (early, nvme), p)?;
        Ok(((o.0, o.1, o.2), o.3, o.5))
    })?);
    // The other optimizers through the rank (decay mask, state buffers, the step count): the
    // update during the backward vs after it, at ZeRO-2 and ZeRO-3; Adam with an L2 penalty
    // also offloaded (the host step's L2 term) vs on the GPU.
    for (name, kind) in other_optimizers() {
        let optim = zero::Optimizer { kind, clip: 0.0 };
        for stage in [2u8, 3] {
            let (early, late) = (run_with(optim, stage, None, true)?, run_with(optim, stage, None, false)?);
            let tag = format!("{name}, ZeRO-{stage}");
            same(&mut rows, "optimizer during the backward vs after it", &tag, &early, &late);
            let moved = early.0.iter().zip(&init).any(|(a, b)| a != b);
            rows.push(bits_row(format!("{name}: the masters moved (ZeRO-{stage})"), &[u32::from(moved)], &[1]));
        }
        if optim.offloadable() {
            // Host memory (all of each piece, and half of it beside the GPU kernel), then swap
            // files (the initial accumulator written into them).
            let base = run_with(optim, 2, None, true)?;
            for ratio in [1.0, 0.5] {
                let o = run_with(optim, 2, Some(ratio), true)?;
                same(&mut rows, "offload vs GPU optimizer", &format!("{name}, ZeRO-2, ratio {ratio}"), &o, &base);
            }
            let o = run_on(optim, 2, Some(1.0), true, Some(&site))?;
            same(&mut rows, "NVMe offload vs GPU optimizer", &format!("{name}, ZeRO-2, ratio 1"), &o, &base);
            rows.push(bits_row(format!("offload vs GPU optimizer, eval loss ({name}, NVMe)"), &[o.3.to_bits()], &[base.3.to_bits()]));
        }
    }
    // LAMB through the rank (its update over every tensor at once, `cuda::lamb::step`, whose
    // kernels the optimizer rows compare with the CPU bit for bit): one GPU at ZeRO-1, 2 and 3
    // gives ZeRO-0's bits, with the early-update flag on (LAMB never steps during the backward).
    let lamb = tessera_kernels::optim::LambParams { lr: 2e-3, weight_decay: 0.01, ..Default::default() };
    let optim = zero::Optimizer { kind: tessera_kernels::optim::OptimizerKind::Lamb(lamb), clip: 1.0 };
    let base = run_with(optim, 0, None, false)?;
    let moved = base.0.iter().zip(&init).any(|(a, b)| a != b);
    rows.push(bits_row("LAMB: the masters moved (ZeRO-0, one GPU)".into(), &[u32::from(moved)], &[1]));
    for stage in [1u8, 2, 3] {
        let o = run_with(optim, stage, None, true)?;
        same(&mut rows, "LAMB on one GPU vs ZeRO-0", &format!("ZeRO-{stage}, clip 1"), &o, &base);
        rows.push(bits_row(
            format!("LAMB on one GPU vs ZeRO-0, eval loss after the steps (ZeRO-{stage})"),
            &[o.3.to_bits()],
            &[base.3.to_bits()],
        ));
    }
    // LAMB with the optimizer in host memory (its two-phase host step, `lamb_host`) against the
    // GPU's LAMB at the same stage.
    for (stage, clip) in [(1u8, 1.0f32), (2, 0.0), (3, 1.0)] {
        let optim = zero::Optimizer { kind: tessera_kernels::optim::OptimizerKind::Lamb(lamb), clip };
        let (o, base) = (run_with(optim, stage, Some(1.0), true)?, run_with(optim, stage, None, true)?);
        let tag = format!("LAMB, ZeRO-{stage}, clip {clip}, ratio 1");
        same(&mut rows, "offload vs GPU optimizer", &tag, &o, &base);
        rows.push(bits_row(format!("offload vs GPU optimizer, eval loss after the steps ({tag})"), &[o.3.to_bits()], &[base.3.to_bits()]));
    }
    Ok(rows)
}

/// One training run of [`check_offload_training`]'s: (masters, exp_avg, exp_avg_sq), the
/// evaluation loss after the steps, the bf16 parameter shard's bits.
type ParamRun = ((Vec<f32>, Vec<f32>, Vec<f32>), f32, Vec<u32>);

/// Parameter offload at ZeRO-3 against the parameters on the device, bit for bit: in host
/// memory and on NVMe (every block unit in the swap file, two read buffers), with the GPU
/// optimizer (during the backward and after it), the optimizer offloaded to host memory (whole
/// and half of each piece, with clipping) and to NVMe. Compared: masters, moments, the bf16
/// shard where it lives, and an evaluation loss after the steps (read through the offloaded
/// shard).
fn check_param_offload(
    site: &offload::NvmeSite,
    run: impl Fn(
        zero::Optimizer,
        u8,
        Option<f64>,
        bool,
        Option<&offload::NvmeSite>,
        Option<&param_offload::ParamOffloadOptions>,
    ) -> Result<ParamRun>,
) -> Result<Vec<cuda::CheckRow>> {
    let cpu = param_offload::ParamOffloadOptions { nvme: None, max_in_cpu: 0, buffer_count: 5, buffer_elems: 100_000_000 };
    // Only the embedding unit's piece (the largest) fits the memory part: the blocks are swapped.
    let nvme = param_offload::ParamOffloadOptions { nvme: Some(site.clone()), max_in_cpu: 1 << 20, buffer_count: 2, ..cpu.clone() };
    let mut rows = Vec::new();
    // (tier, clip, optimizer offload ratio, optimizer on NVMe, the optimizer during the backward)
    let cases: [(&param_offload::ParamOffloadOptions, f32, Option<f64>, bool, bool); 8] = [
        (&cpu, 0.0, None, false, true),
        (&cpu, 0.0, None, false, false),
        (&cpu, 1.0, Some(1.0), false, true),
        (&cpu, 0.0, Some(0.5), false, true),
        (&nvme, 0.0, None, false, true),
        (&nvme, 1.0, Some(1.0), false, true),
        (&nvme, 0.0, Some(1.0), true, true),
        (&cpu, 1.0, Some(1.0), true, true),
    ];
    for (p, clip, ratio, opt_nvme, early) in cases {
        let optim = zero::Optimizer::adamw((0.9, 0.95), 1e-8, 0.1, clip);
        let base = run(optim, 3, None, early, None, None)?;
        let o = run(optim, 3, ratio, early, opt_nvme.then_some(site), Some(p))?;
        let tier = if p.nvme.is_some() { "NVMe (blocks swapped)" } else { "host memory" };
        let opt = match (ratio, opt_nvme) {
            (None, _) => "GPU optimizer".to_string(),
            (Some(r), false) => format!("optimizer offload ratio {r}"),
            (Some(_), true) => "optimizer on NVMe".to_string(),
        };
        let tag = format!("ZeRO-3, clip {clip}, {opt}, optimizer during the backward {early}");
        let what = format!("parameters in {tier} vs on the GPU");
        rows.push(bits_row(format!("{what}, masters ({tag})"), &f32_bits(&o.0 .0), &f32_bits(&base.0 .0)));
        rows.push(bits_row(format!("{what}, exp_avg ({tag})"), &f32_bits(&o.0 .1), &f32_bits(&base.0 .1)));
        rows.push(bits_row(format!("{what}, exp_avg_sq ({tag})"), &f32_bits(&o.0 .2), &f32_bits(&base.0 .2)));
        rows.push(bits_row(format!("{what}, bf16 shard ({tag})"), &o.2, &base.2));
        rows.push(bits_row(format!("{what}, eval loss after the steps ({tag})"), &[o.1.to_bits()], &[base.1.to_bits()]));
    }
    Ok(rows)
}

/// The optimizers besides AdamW that [`check_offload_training`] trains with.
fn other_optimizers() -> Vec<(&'static str, tessera_kernels::optim::OptimizerKind)> {
    use tessera_kernels::optim::{AdagradParams, AdamParams, LionParams, OptimizerKind, SgdParams};
    let adam = AdamParams { lr: 2e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, ..AdamParams::default() };
    vec![
        ("Adam (L2 penalty, no bias correction)", OptimizerKind::Adam(AdamParams { adam_w_mode: false, bias_correction: false, ..adam })),
        (
            "SGD (Nesterov momentum)",
            OptimizerKind::Sgd(SgdParams { lr: 2e-3, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true }),
        ),
        ("Lion", OptimizerKind::Lion(LionParams { lr: 2e-3, betas: (0.9, 0.99), weight_decay: 0.1, momentum_cycle: None })),
        (
            "Adagrad (lr_decay, initial accumulator)",
            OptimizerKind::Adagrad(AdagradParams {
                lr: 1e-2,
                lr_decay: 0.1,
                eps: 1e-10,
                weight_decay: 0.01,
                initial_accumulator_value: 0.1,
            }),
        ),
    ]
}

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// Model preset (`tessera models`) or model folder (its shape; the weights are not read).
    #[arg(long, default_value = "gpt2-small")]
    pub model: String,
    /// Override the preset's vocabulary (the peers use 50304, a multiple of 128).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Override the number of layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Make every block of a LLaMA-family model a dropless mixture of this many SwiGLU experts
    /// (Mixtral semantics: softmax router, top-k renormalised, the load-balancing loss across
    /// blocks); needs --expert-ffn.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts each token is routed to (with --experts).
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Hidden width of each expert (with --experts).
    #[arg(long)]
    pub expert_ffn: Option<usize>,
    /// Weight of the load-balancing loss (with --experts; Mixtral's router_aux_loss_coef).
    #[arg(long, default_value_t = 0.02)]
    pub aux_coef: f32,
    /// Instead of training: time the experts' GEMMs for this model's shape (--micro-batch ×
    /// --seq tokens, --experts, --top-k) as a per-expert loop, one grouped call, and one dense
    /// GEMM of the same total size, and print the TFLOP/s of each.
    #[arg(long)]
    pub expert_gemm: bool,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 16)]
    pub micro_batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Micro-batches per optimizer step, over all GPUs (default: one per GPU).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// ZeRO stage 0–3.
    #[arg(long, default_value_t = 2)]
    pub zero: u8,
    /// GPUs (one process each).
    #[arg(long, default_value_t = 1)]
    pub nprocs: usize,
    /// Optimizer steps to run (the first --warmup of them are not timed).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Steps not timed (warm-up).
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Learning rate, the same at every step (no schedule).
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f32,
    /// The optimizer: `adamw` (betas 0.9/0.95, weight decay 0.1), `adam` (the same with an L2
    /// penalty instead of decoupled decay), `sgd` (momentum 0.9, weight decay 0.1), `lion`
    /// (betas 0.9/0.99, weight decay 0.1) or `adagrad` (weight decay 0.1).
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// fp16 (`fp16.enabled` with a static `loss_scale` of this value): each micro-batch's
    /// gradient stored in fp16, the loss scaled, the global norm formed every step; an
    /// overflowing step is skipped (counted in the results' `skipped`).
    #[arg(long)]
    pub fp16_scale: Option<f32>,
    /// With --offload-ratio: keep the offloaded masters and moments in swap files in this
    /// directory instead of host memory (`offload_optimizer.device = "nvme"`, `nvme_path`), read
    /// ahead and written behind the host step (O_DIRECT, io_uring, 1 MiB requests).
    #[arg(long)]
    pub nvme: Option<std::path::PathBuf>,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub clip: f32,
    /// Parameter offload at --zero 3 (`offload_param.device`): `cpu` keeps each rank's bf16
    /// shard in page-locked host memory, `nvme` in a swap file under --param-nvme (all but
    /// --param-max-in-cpu elements); each gather fetches the rank's piece ahead of use.
    #[arg(long)]
    pub offload_param: Option<String>,
    /// With --offload-param nvme: the swap file's directory (`offload_param.nvme_path`).
    #[arg(long)]
    pub param_nvme: Option<std::path::PathBuf>,
    /// With --offload-param nvme: elements of the shard kept in host memory (`max_in_cpu`).
    #[arg(long, default_value_t = 0)]
    pub param_max_in_cpu: usize,
    /// Seed of the initial parameters and the synthetic tokens.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// After the timed steps, run one more with GPU timing marks and print where the time goes
    /// (rank 0, to stderr).
    #[arg(long)]
    pub profile: bool,
    /// Offload this share (0–1) of each rank's optimizer to host memory, stepped by CPU threads
    /// (`zero_optimization.offload_optimizer` with device "cpu" and this ratio); needs --zero ≥ 1.
    #[arg(long)]
    pub offload_ratio: Option<f64>,
    /// Refuse to start when a rank's model states on the GPU exceed this many bytes
    /// (`tessera.device_memory_bytes_max`).
    #[arg(long)]
    pub budget_bytes: Option<u64>,
    /// Make the compute stream wait for every collective as it is issued
    /// (`zero_optimization.overlap_comm = false`); by default they overlap the compute.
    #[arg(long)]
    pub no_overlap: bool,
    /// Activation checkpointing (`activation_checkpointing`): keep only each block's input and
    /// recompute its activations in the backward.
    #[arg(long)]
    pub recompute: bool,
}

/// What the timed steps of `tessera gpu bench` measured on one rank.
struct Timed {
    /// Wall-clock seconds of each step (the compute stream synchronised).
    times: Vec<f64>,
    /// Each step's mean loss.
    losses: Vec<f32>,
    /// The host optimizer's figures at the end of the warm-up (offload only), subtracted from
    /// the final ones so that the timed steps alone are reported.
    warm_stats: Option<offload::OffloadStats>,
    /// Steps skipped on an fp16 overflow (`--fp16-scale`).
    skipped: usize,
}

/// One JSON line of results (rank 0 prints it).
fn report(a: &BenchArgs, model: &Model, world: usize, timed: &Timed, mem: usize, hash: &str, extra: serde_json::Value) -> String {
    let (times, losses) = (&timed.times, &timed.losses);
    let mut steady: Vec<f64> = times.iter().skip(a.warmup.min(times.len().saturating_sub(1))).copied().collect();
    steady.sort_by(|x, y| x.partial_cmp(y).expect("finite times"));
    let med = steady[steady.len() / 2];
    let m = a.micro_batches.unwrap_or(world);
    let tokens = (a.micro_batch * a.seq * m) as f64;
    let tok_s = tokens / med;
    // An MoE model's active parameters (k of the experts); flops_per_token leaves the idle ones out itself.
    let active = model.num_params()
        - model.cfg.moe.as_ref().map_or(0, |m| (m.num_experts - m.top_k) * 3 * model.cfg.d_model * m.d_expert * model.cfg.n_layer);
    let fpt = model.cfg.flops_per_token(model.num_params(), a.seq);
    let mfu = tok_s * fpt / (989e12 * world as f64);
    let mut out = serde_json::json!({
        "system": "tessera", "zero": a.zero, "world": world, "params_M": (model.num_params() as f64 / 1e6 * 10.0).round() / 10.0,
        "active_params_M": (active as f64 / 1e6 * 10.0).round() / 10.0,
        "mb": a.micro_batch, "seq": a.seq, "micro_batches": m,
        "step_ms_median": (med * 1e4).round() / 10.0, "tok_per_s": tok_s.round(), "mfu_vs_989T": (mfu * 1000.0).round() / 1000.0,
        "device_GiB": (mem as f64 / (1u64 << 30) as f64 * 100.0).round() / 100.0,
        "loss_first": losses.first(), "loss_last": losses.last(), "params_blake3": hash,
    });
    if let (Some(o), serde_json::Value::Object(e)) = (out.as_object_mut(), extra) {
        o.extend(e);
    }
    out.to_string()
}

fn bench_model(a: &BenchArgs) -> Result<Model> {
    let mut cfg: ModelConfig = zoo::resolve(&a.model).map_err(anyhow::Error::msg)?.config().clone();
    if let Some(v) = a.vocab {
        cfg.vocab_size = v;
    }
    if let Some(l) = a.layers {
        cfg.n_layer = l;
    }
    match (a.experts, a.expert_ffn) {
        (Some(num_experts), Some(d_expert)) => {
            cfg.moe = Some(tessera_kernels::model::MoeConfig::mixtral(num_experts, a.top_k, d_expert, a.aux_coef));
        }
        (None, None) => {}
        _ => bail!("--experts and --expert-ffn go together (an MoE model needs both)"),
    }
    if a.seq > cfg.max_seq_len {
        let folder = match crate::hf::is_folder(&a.model) {
            true => a.model.clone(),
            false => format!("configs/models/{}", a.model),
        };
        bail!(
            "--seq {} exceeds the model's context {}: copy {folder}, raise the context in its config.json (n_positions or \
             max_position_embeddings) and pass the copy as --model",
            a.seq,
            cfg.max_seq_len
        );
    }
    Model::new(cfg).map_err(anyhow::Error::msg)
}

/// `tessera gpu bench`: the parent spawns one process per GPU (or runs the single rank itself).
pub fn bench(a: &BenchArgs) -> Result<()> {
    if a.expert_gemm {
        return expert_gemm_bench(a);
    }
    if let Ok(rank) = std::env::var(ENV_RANK) {
        let rank: usize = rank.parse().with_context(|| format!("{ENV_RANK}={rank}: expected a rank number"))?;
        let world: usize = std::env::var(ENV_WORLD)?.parse().context(ENV_WORLD)?;
        let id = NcclId::from_hex(&std::env::var(ENV_NCCL_ID).context(ENV_NCCL_ID)?)?;
        return bench_rank(a, rank, world, Some(id));
    }
    if a.nprocs <= 1 {
        return bench_rank(a, 0, 1, None);
    }
    bench_budget(a, &bench_model(a)?, a.nprocs)?;
    let n = cuda::device_count()?;
    if a.nprocs > n {
        bail!("--nprocs {} needs {} GPUs; this machine has {n}", a.nprocs, a.nprocs);
    }
    // The communicator id is created here and handed to every rank (the control plane of a
    // single-host launch is the process environment).
    let id = NcclId::new()?;
    let exe = std::env::current_exe()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for r in 0..a.nprocs {
        let child = Command::new(&exe)
            .args(&args)
            .env(ENV_RANK, r.to_string())
            .env(ENV_WORLD, a.nprocs.to_string())
            .env(ENV_NCCL_ID, id.to_hex())
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting GPU rank {r}"))?;
        children.push(child);
    }
    wait_all(children, Duration::from_secs(900))
}

/// `tessera gpu bench --expert-gemm`: the experts' forward gate projection
/// (`[n_e, c]·[c, f]` for each expert) as a loop, as one grouped call, and one dense GEMM of
/// all the rows; one JSON line.
fn expert_gemm_bench(a: &BenchArgs) -> Result<()> {
    let model = bench_model(a)?;
    let m = model.cfg.moe.as_ref().context("--expert-gemm needs --experts and --expert-ffn")?;
    let gpu: Arc<Gpu> = Gpu::open(0)?;
    let rows = a.micro_batch * a.seq * m.top_k;
    // Balanced, and the skewed split of a router early in training (expert e takes a share ∝ e+1).
    let balanced: Vec<usize> = (0..m.num_experts).map(|e| rows / m.num_experts + usize::from(e < rows % m.num_experts)).collect();
    let w: usize = (1..=m.num_experts).sum();
    let mut skewed: Vec<usize> = (0..m.num_experts).map(|e| rows * (e + 1) / w).collect();
    skewed[m.num_experts - 1] += rows - skewed.iter().sum::<usize>();
    let mut out = serde_json::json!({"system": "tessera-expert-gemm", "rows": rows, "c": model.cfg.d_model, "f": m.d_expert, "experts": m.num_experts});
    for (name, split) in [("balanced", &balanced), ("skewed", &skewed)] {
        let r = cuda::llama::moe::gemm_bench(&gpu, split, model.cfg.d_model, m.d_expert, 20)?;
        out[name] = serde_json::json!({
            "loop_tflops": (r.loop_tflops * 10.0).round() / 10.0, "grouped_tflops": (r.grouped_tflops * 10.0).round() / 10.0,
            "dense_tflops": (r.dense_tflops * 10.0).round() / 10.0, "grouped_ran": r.grouped_ran,
            "best_vs_dense": ((r.loop_tflops.max(r.grouped_tflops) / r.dense_tflops) * 1000.0).round() / 1000.0,
        });
    }
    println!("{out}");
    Ok(())
}

/// Waits for every rank; the first failure kills the others (no orphans), bounded overall.
fn wait_all(mut children: Vec<Child>, limit: Duration) -> Result<()> {
    let start = Instant::now();
    let mut failed: Option<String> = None;
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            if let Some(st) = c.try_wait()? {
                done[r] = true;
                if !st.success() && failed.is_none() {
                    failed = Some(format!("GPU rank {r} failed ({st})"));
                }
            }
        }
        if failed.is_some() || start.elapsed() > limit {
            for (r, c) in children.iter_mut().enumerate() {
                if !done[r] {
                    let _ = c.kill();
                    let _ = c.wait();
                    done[r] = true;
                }
            }
            if failed.is_none() {
                failed = Some(format!("GPU ranks did not finish within {} s", limit.as_secs()));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failed {
        Some(f) => bail!(f),
        None => Ok(()),
    }
}

/// Synthetic tokens of global micro-batch `i` at `step` (uniform ids, as the peers use).
fn batch(seed: u64, step: usize, i: usize, b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::derive(seed, &[step as u64, i as u64]);
    let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
    for _ in 0..b {
        let row: Vec<u32> = (0..=t).map(|_| (rng.next_u64() % v as u64) as u32).collect();
        x.extend_from_slice(&row[..t]);
        y.extend_from_slice(&row[1..]);
    }
    (x, y)
}

/// The model states a bench rank will hold, refused over `--budget-bytes` (before any GPU is
/// touched).
fn bench_budget(a: &BenchArgs, model: &Model, world: usize) -> Result<zero::StateBytes> {
    let m = a.micro_batches.unwrap_or(world);
    if m % world != 0 || m == 0 {
        bail!("--micro-batches {m} must be a positive multiple of the GPU count {world} (each GPU takes an aligned block)");
    }
    let n = bench_optimizer(a)?.states();
    let block = bench_nvme(a)?.map(|s| s.aio.block);
    let params = bench_param_offload(a)?;
    let off = zero::OffloadPlanned { ratio: a.offload_ratio, nvme_block: block, params: params.as_ref() };
    let states = zero::planned_state_bytes(model, a.zero, world, m / world, n, off)?;
    if let Some(max) = a.budget_bytes {
        let hint = if a.offload_ratio.is_some() {
            "the optimizer is offloaded already".to_string()
        } else {
            let all = zero::planned_state_bytes(model, a.zero, world, m / world, n, zero::OffloadPlanned { ratio: Some(1.0), ..off })?;
            format!("--offload-ratio 1 (the optimizer in host memory) brings them to {} bytes", all.device.total())
        };
        crate::offload::check_resident("each GPU rank", states.device, max, &hint)?;
    }
    Ok(states)
}

/// `--offload-param` (with `--param-nvme`, `--param-max-in-cpu`) as a rank's parameter offload.
fn bench_param_offload(a: &BenchArgs) -> Result<Option<param_offload::ParamOffloadOptions>> {
    let Some(dev) = a.offload_param.as_deref() else { return Ok(None) };
    if a.zero != 3 {
        bail!("--offload-param needs --zero 3 (the stage with parameter shards); this bench has --zero {}", a.zero);
    }
    let nvme = match (dev, &a.param_nvme) {
        ("cpu", None) => None,
        ("nvme", Some(dir)) if dir.is_dir() => Some(offload::NvmeSite { dir: dir.clone(), aio: crate::offload::AioOptions::default() }),
        ("nvme", Some(dir)) => bail!("--param-nvme {}: not a directory", dir.display()),
        ("nvme", None) => bail!("--offload-param nvme needs --param-nvme DIR (where the parameter swap file goes)"),
        ("cpu", Some(_)) => bail!("--param-nvme goes with --offload-param nvme"),
        (other, _) => bail!("--offload-param {other:?}: expected cpu or nvme"),
    };
    Ok(Some(param_offload::ParamOffloadOptions { nvme, max_in_cpu: a.param_max_in_cpu, buffer_count: 5, buffer_elems: usize::MAX }))
}

/// `--nvme DIR` as the swap site (the `aio` section's defaults).
fn bench_nvme(a: &BenchArgs) -> Result<Option<offload::NvmeSite>> {
    let Some(dir) = &a.nvme else { return Ok(None) };
    if a.offload_ratio.is_none() {
        bail!("--nvme needs --offload-ratio (the share of the optimizer offloaded, to the swap files)");
    }
    if !dir.is_dir() {
        bail!("--nvme {}: not a directory", dir.display());
    }
    Ok(Some(offload::NvmeSite { dir: dir.clone(), aio: crate::offload::AioOptions::default() }))
}

/// `--optimizer` (and `--clip`) as the rank's optimizer.
fn bench_optimizer(a: &BenchArgs) -> Result<zero::Optimizer> {
    use tessera_kernels::optim::{AdagradParams, AdamParams, LionParams, OptimizerKind, SgdParams};
    let adam = AdamParams { lr: a.lr, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, ..AdamParams::default() };
    let kind = match a.optimizer.as_str() {
        "adamw" => OptimizerKind::Adam(adam),
        "adam" => OptimizerKind::Adam(AdamParams { adam_w_mode: false, ..adam }),
        "sgd" => OptimizerKind::Sgd(SgdParams { lr: a.lr, momentum: 0.9, dampening: 0.0, weight_decay: 0.1, nesterov: false }),
        "lion" => OptimizerKind::Lion(LionParams { lr: a.lr, betas: (0.9, 0.99), weight_decay: 0.1, momentum_cycle: None }),
        "adagrad" => OptimizerKind::Adagrad(AdagradParams { lr: a.lr, weight_decay: 0.1, ..AdagradParams::default() }),
        other => bail!("--optimizer {other:?}: expected adamw, adam, sgd, lion or adagrad"),
    };
    Ok(zero::Optimizer { kind, clip: a.clip })
}

fn bench_rank(a: &BenchArgs, rank: usize, world: usize, id: Option<NcclId>) -> Result<()> {
    let model = bench_model(a)?;
    bench_budget(a, &model, world)?;
    let gpu: Arc<Gpu> = Gpu::open(rank)?;
    gpu.compile_all()?;
    let comm = match id {
        Some(id) if world > 1 => Some(NcclComm::new(gpu.clone(), rank, world, &id)?),
        _ => None,
    };
    let m = a.micro_batches.unwrap_or(world);
    if m % world != 0 {
        bail!("--micro-batches {m} must be a multiple of the GPU count {world} (each GPU takes an aligned block)");
    }
    let m_local = m / world;
    let shape = gpt::Shape::new(&model.cfg, a.micro_batch, a.seq)?;
    let t_init = Instant::now();
    let init = model.init_params(a.seed);
    let init_s = t_init.elapsed().as_secs_f64();
    let optim = bench_optimizer(a)?;
    let nvme = bench_nvme(a)?;
    let offload = a.offload_ratio.map(|ratio| zero::OffloadOptions { ratio, threads: offload::default_threads(world) });
    let states = bench_budget(a, &model, world)?;
    let params_offload = bench_param_offload(a)?;
    let mut r = zero::Rank::new(
        gpu.clone(),
        comm,
        zero::RankSpec {
            model: &model,
            stage: a.zero,
            shape,
            init: &init,
            optim,
            m_local,
            offload,
            recompute: a.recompute,
            fp16: a.fp16_scale.is_some(),
            nvme: nvme.as_ref(),
            params_offload: params_offload.as_ref(),
        },
    )?;
    r.overlap = !a.no_overlap;
    r.sync()?;
    if rank == 0 {
        // Where a large model's start goes (and how much host memory it took), before step 0.
        let rss = crate::engine::peak_rss_bytes() as f64 / 1e9;
        let rank_s = t_init.elapsed().as_secs_f64() - init_s;
        eprintln!("setup: parameters initialised in {init_s:.1} s, the rank built in {rank_s:.1} s; host peak RSS {rss:.1} GB");
    }
    let micro_batches = |step: usize| -> Vec<_> {
        (0..m_local).map(|j| batch(a.seed, step, rank * m_local + j, a.micro_batch, a.seq, model.cfg.vocab_size)).collect()
    };
    let timed = timed_steps(a, &mut r, rank, m, micro_batches)?;
    if a.profile {
        profile_step(&gpu, &mut r, rank, &micro_batches(a.steps), a.lr, m)?;
    }
    if rank == 0 {
        print_tuning(&gpu);
    }
    let masters = r.masters()?;
    let hash = blake3::hash(bytemuck::cast_slice(&masters)).to_hex().to_string();
    if rank == 0 {
        let mut extra = bench_extra(a, &gpu, &r, &states, timed.warm_stats)?;
        extra["skipped"] = timed.skipped.into();
        let line = report(a, &model, world, &timed, r.device_bytes(), &hash, extra);
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `a.steps` steps of `m` micro-batches in all (`micro_batches(step)`: this rank's), each timed
/// from its start to the compute stream's end; rank 0 prints every tenth.
fn timed_steps(
    a: &BenchArgs,
    r: &mut zero::Rank,
    rank: usize,
    m: usize,
    micro_batches: impl Fn(usize) -> Vec<(Vec<u32>, Vec<u32>)>,
) -> Result<Timed> {
    let mut timed = Timed { times: Vec::with_capacity(a.steps), losses: Vec::with_capacity(a.steps), warm_stats: None, skipped: 0 };
    for step in 0..a.steps {
        if step == a.warmup.min(a.steps.saturating_sub(1)) {
            timed.warm_stats = r.offload_stats();
        }
        let mbs = micro_batches(step);
        let t0 = Instant::now();
        let p = r.prepare(&mbs, a.lr, 1.0 / m as f32, a.fp16_scale.unwrap_or(1.0))?;
        if p.overflow {
            r.skip()?;
            timed.skipped += 1;
        } else {
            r.commit()?;
        }
        let loss = p.loss;
        r.sync()?;
        timed.times.push(t0.elapsed().as_secs_f64());
        timed.losses.push(loss);
        if rank == 0 && (step % 10 == 0 || step + 1 == a.steps) {
            eprintln!("step {step:>4}  loss {loss:.4}  {:.1} ms", timed.times[step] * 1e3);
        }
    }
    Ok(timed)
}

/// One more step with GPU timing marks; rank 0 prints where its time went (to stderr).
fn profile_step(gpu: &Gpu, r: &mut zero::Rank, rank: usize, mbs: &[(Vec<u32>, Vec<u32>)], lr: f32, m: usize) -> Result<()> {
    gpu.profile(true)?;
    r.step(mbs, lr, 1.0 / m as f32)?;
    r.sync()?;
    let rows = gpu.profile_report()?;
    if rank == 0 {
        let total: f64 = rows.iter().map(|r| r.1).sum();
        eprintln!("profile of one step (GPU time between marks on the compute stream, rank 0): {total:.2} ms");
        let mut sorted = rows.clone();
        sorted.sort_by(|x, y| y.1.partial_cmp(&x.1).expect("finite"));
        for (what, ms, count) in sorted {
            eprintln!("  {what:<24} {ms:>8.3} ms  {:>5.1} %  ×{count}", 100.0 * ms / total);
        }
    }
    Ok(())
}

/// The GEMMs cuBLASLt tuned (`TESSERA_GPU_TUNE`), to stderr.
fn print_tuning(gpu: &Gpu) {
    if let Some(lt) = gpu.lt.as_ref().filter(|l| l.tuning()) {
        let lines = lt.tune_report();
        eprintln!("GEMM tuning (TESSERA_GPU_TUNE, first call of each shape, rank 0): {} GEMMs", lines.len());
        for l in lines {
            eprintln!("  {l}");
        }
    }
}

/// The report's fields beyond the throughput: memory, fusions, and the host optimizer's
/// figures over the timed steps (offload only).
fn bench_extra(
    a: &BenchArgs,
    gpu: &Gpu,
    r: &zero::Rank,
    states: &zero::StateBytes,
    warm_stats: Option<offload::OffloadStats>,
) -> Result<serde_json::Value> {
    let gib = |b: u64| (b as f64 / (1u64 << 30) as f64 * 1000.0).round() / 1000.0;
    let (free, total) = gpu.ctx.mem_get_info().map_err(cuda::drv("reading the device memory in use"))?;
    let mut extra = serde_json::json!({
        "state_GiB": gib(states.device.total()), "host_state_GiB": gib(states.host_optim),
        "offload_param": a.offload_param, "host_param_GiB": gib(states.host_params), "nvme_param_GiB": gib(states.nvme_params),
        "used_GiB": gib((total - free) as u64), "offload_ratio": a.offload_ratio, "optimizer": a.optimizer,
        "fp16_scale": a.fp16_scale,
        "fusions": r.fusions(), "recompute": a.recompute, "early_adam": r.early_adam_active(),
        "gemm_tune": gpu.lt.as_ref().map_or("off", |l| if l.tuning() { "on" } else if l.routes_plain() { "route" } else { "off" }),
    });
    if let (Some(p), Some(o)) = (r.param_offload_stats(), extra.as_object_mut()) {
        // Over the warm-up and the timed steps.
        o.insert("param_tier".into(), serde_json::to_value(p)?);
    }
    if let (Some(end), Some(o)) = (r.offload_stats(), extra.as_object_mut()) {
        // The timed steps only (the figures at the end of the warm-up are subtracted).
        let w = warm_stats.unwrap_or_default();
        let steps = end.steps.saturating_sub(w.steps).max(1) as f64;
        let (cpu, exposed) = ((end.cpu_step_s - w.cpu_step_s) / steps, (end.exposed_s - w.exposed_s) / steps);
        let hidden = if cpu > 0.0 { (1.0 - exposed / cpu).clamp(0.0, 1.0) } else { 0.0 };
        o.insert("cpu_threads".into(), end.threads.into());
        o.insert("host_adam_ms".into(), ((cpu * 1e4).round() / 10.0).into());
        o.insert("exposed_ms".into(), ((exposed * 1e4).round() / 10.0).into());
        o.insert("hidden".into(), ((hidden * 1000.0).round() / 1000.0).into());
        if end.nvme_bytes > 0 {
            let per = |x: f64, y: f64| (((x - y) / steps) * 1e4).round() / 10.0;
            o.insert("nvme_GiB".into(), gib(states.nvme).into());
            o.insert("nvme_read_ms".into(), per(end.nvme_read_s, w.nvme_read_s).into());
            o.insert("nvme_write_ms".into(), per(end.nvme_write_s, w.nvme_write_s).into());
            o.insert("nvme_wait_ms".into(), per(end.nvme_wait_s, w.nvme_wait_s).into());
            let busy = (end.nvme_read_s - w.nvme_read_s) + (end.nvme_write_s - w.nvme_write_s);
            let gbps = (end.nvme_bytes - w.nvme_bytes) as f64 / busy.max(1e-9) / 1e9;
            o.insert("nvme_GBps".into(), ((gbps * 100.0).round() / 100.0).into());
        }
    }
    Ok(extra)
}
