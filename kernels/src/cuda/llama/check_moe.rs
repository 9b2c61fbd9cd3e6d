//! `tessera gpu check` rows of the GPU mixture-of-experts ([`super::moe`]) against the CPU's
//! [`MoeFfn`]: one MoE feed-forward on the same bf16 inputs (so both route the same way) —
//! routing, output, d(input), the router's and every expert's gradient with the
//! load-balancing loss's gradient in — with the experts' GEMMs as a loop and as one grouped call,
//! and a rerun bit for bit; then a whole Mixtral-shaped model (loss, aux loss, every gradient,
//! recomputed = kept activations, rerun bits).

use super::moe::{self as moe_gpu, MoeActs, MoeLayout, MoeScratch, MoeW};
use crate::cuda::blas::GroupMode;
use crate::cuda::gpt::{GpuLayout, Replicated, Shape};
use crate::cuda::{bf16, CheckRow, Gpu, GpuError, Result};
use crate::gradcheck::randn;
use crate::layer::ParamLayout;
use crate::model::{Arch, FlatAccess, MicroBatch, Model, ModelConfig, MoeConfig};
use crate::moe_ffn::MoeFfn;

fn bf_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Mixtral's routing with `e` experts, top `k`, experts of width `f`.
pub fn mixtral(e: usize, k: usize, f: usize, aux_loss_coef: f32) -> MoeConfig {
    MoeConfig::mixtral(e, k, f, aux_loss_coef)
}

pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let mut r = check_ffn(gpu, seed)?;
    r.extend(check_model(gpu, seed)?);
    Ok(r)
}

/// What one GPU run of the MoE FFN gave: the chosen experts, the output, d(input) and the
/// unit's gradient.
struct FfnRun {
    topi: Vec<u32>,
    y: Vec<f32>,
    dh: Vec<f32>,
    g: Vec<f32>,
}

/// One MoE FFN (8 experts, top 2; c = 256, f = 192, 300 tokens) on the GPU and the CPU.
fn check_ffn(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let (e, k, c, f, n) = (8, 2, 256, 192, 300);
    let cfg = mixtral(e, k, f, 0.02);
    let mut layout = ParamLayout::new();
    let (ffn, _) = MoeFfn::new(&cfg, crate::model::Arch::Llama, 0, c, &mut layout, 0, 0.02);
    let spec =
        |name: &str| layout.get(&format!("h.0.moe.{name}")).map(|s| s.range()).ok_or_else(|| GpuError::Invalid(format!("no {name}")));
    let (router, w_gate, w_up, w_down) =
        (spec("router.weight")?, spec("experts.0.w_gate.weight")?, spec("experts.0.w_up.weight")?, spec("experts.0.w_down.weight")?);
    let ml = MoeLayout {
        router: router.clone(),
        stride: spec("experts.1.w_gate.weight")?.start - w_gate.start,
        w_gate,
        w_up,
        w_down,
        experts: e,
        top_k: k,
        d_expert: f,
        norm_topk: true,
        aux_coef: 0.02,
    };
    // Router weights large enough that the softmax is far from uniform.
    let mut p = bf_round(&randn(seed ^ 0x301, layout.total(), 0.05));
    p[router.clone()].iter_mut().for_each(|x| *x = bf16::from_f32(*x * 4.0).to_f32());
    let h = bf_round(&randn(seed ^ 0x302, n * c, 1.0));
    let dy = randn(seed ^ 0x303, n * c, 1.0);
    let dprob: Vec<f32> = randn(seed ^ 0x304, e, 0.01);
    // CPU.
    let mut y = vec![0f32; n * c];
    let mut acts = None;
    ffn.forward(&p, &h, &mut y, &mut acts, None);
    if let Some(a) = acts.as_mut() {
        a.dprob = Some(dprob.clone());
    }
    let cpu_idx = acts.as_ref().map(|a| a.routing.idx.clone()).unwrap_or_default();
    let (mut g, mut dh) = (vec![0f32; layout.total()], vec![0f32; n * c]);
    ffn.backward(&p, &mut crate::wgrad::WeightGrads::now(&mut g), &h, &dy, &mut dh, &mut acts, None);
    // GPU.
    let st = &gpu.stream;
    let (dp, dgr) = (gpu.upload(&to_bf(&p))?, gpu.alloc::<f32>(layout.total())?);
    let (dh_in, x2, yg, ddy, ddh) =
        (gpu.upload(&to_bf(&h))?, gpu.alloc::<f32>(n * c)?, gpu.alloc::<f32>(n * c)?, gpu.upload(&dy)?, gpu.alloc::<f32>(n * c)?);
    let nf = n * k * f;
    let bufs: Vec<_> = (0..6).map(|_| gpu.alloc::<bf16>(nf)).collect::<Result<_>>()?;
    let a = MoeActs::new(gpu, &ml, n, c)?;
    let w = MoeW { router: dp.ptr().slice(router.clone()), unit: dp.ptr() };
    let gw = MoeW { router: dgr.ptr().slice(router.clone()), unit: dgr.ptr() };
    let run = |mode: GroupMode| -> Result<FfnRun> {
        let scr = MoeScratch::new(gpu, &ml, n, c, 1, mode)?;
        gpu.zero(dgr.ptr(), st)?;
        moe_gpu::route(gpu, st, &ml, w.router, dh_in.ptr(), &a, n, c)?;
        let mlp = (bufs[0].ptr(), bufs[1].ptr(), bufs[2].ptr());
        moe_gpu::experts_forward(gpu, st, &ml, &w, &a, mlp, &scr, 0, c)?;
        moe_gpu::combine(gpu, st, &ml, yg.ptr(), x2.ptr(), &a, n, c)?;
        moe_gpu::set_aux_grad(gpu, &scr, &dprob)?;
        let d = (bufs[3].ptr(), bufs[4].ptr(), bufs[5].ptr());
        moe_gpu::backward(gpu, st, &ml, (&w, &gw), dh_in.ptr(), ddy.ptr(), ddh.ptr(), &a, mlp, d, &scr, 0, (n, c))?;
        Ok(FfnRun {
            topi: gpu.download(a.topi.ptr())?,
            y: gpu.download(yg.ptr())?,
            dh: gpu.download(ddh.ptr())?,
            g: gpu.download(dgr.ptr())?,
        })
    };
    let tag = format!("[MoE FFN {e} experts top {k}, c {c}, f {f}, {n} tokens]");
    let mut r = Vec::new();
    for mode in [GroupMode::Loop, GroupMode::Grouped] {
        let FfnRun { topi, y: yv, dh: dhv, g: gv } = run(mode)?;
        let m = format!("{tag} {mode:?}");
        let agree = topi.iter().zip(&cpu_idx).filter(|(a, b)| **a as usize == **b).count();
        r.push(CheckRow::same_bits(
            format!("moe routing: top-k experts = CPU's ({agree} of {}) {m}", cpu_idx.len()),
            agree == cpu_idx.len(),
        ));
        r.extend(super::check::rows(&format!("moe forward y {m}"), &yv, &y, 2e-2, 1.5e-1));
        r.extend(super::check::rows(&format!("moe backward dh {m}"), &dhv, &dh, 2e-2, 1.5e-1));
        r.extend(super::check::rows(&format!("moe backward d(router) {m}"), &gv[router.clone()], &g[router.clone()], 2e-2, 1.5e-1));
        let ex = router.end..layout.total();
        r.extend(super::check::rows(&format!("moe backward d(experts) {m}"), &gv[ex.clone()], &g[ex], 2e-2, 1.5e-1));
        let again = run(mode)?;
        r.push(CheckRow::same_bits(
            format!("moe forward + backward rerun bit-identical {m}"),
            again.y == yv && again.dh == dhv && again.g == gv,
        ));
    }
    Ok(r)
}

/// A 2-block Mixtral-shaped model (4 experts, top 2, the load-balancing loss at 0.02) against the
/// CPU model. Few tokens: the model's bf16 activations can flip a near-tied routing, which the
/// routing row reports (the seed is fixed, so the rows are too).
fn check_model(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    use crate::tensor::Rng;
    let (b, t, hd) = (1, 48, 64);
    let cfg = ModelConfig {
        arch: Arch::Llama,
        vocab_size: 320,
        max_seq_len: 64,
        n_layer: 2,
        n_head: 4,
        d_model: 4 * hd,
        d_ff: 5 * hd,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 2,
        tied_head: false,
        qkv_bias: false,
        rope_scaling: None,
        moe: Some(mixtral(4, 2, 3 * hd, 0.02)),
    };
    let model = Model::new(cfg.clone()).map_err(GpuError::Invalid)?;
    let mut params = model.init_params(seed);
    let mut noise = vec![0f32; params.len()];
    Rng::derive(seed, &[0x3a0]).fill_normal(&mut noise, 0.02);
    for (p, n) in params.iter_mut().zip(&noise) {
        *p = bf16::from_f32(*p + n).to_f32();
    }
    // Decisive routers (far from uniform), as after some training.
    for s in model.layout().specs().iter().filter(|s| s.name.ends_with("moe.router.weight")) {
        params[s.range()].iter_mut().for_each(|x| *x = bf16::from_f32(*x * 8.0).to_f32());
    }
    let mut rng = Rng::derive(seed, &[0x3a1]);
    let seq: Vec<u32> = (0..b * (t + 1)).map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32).collect();
    let tokens: Vec<u32> = seq[..t].to_vec();
    let targets: Vec<u32> = seq[1..].to_vec();
    let mut grads = vec![0f32; params.len()];
    let mut cws = crate::model::Workspace::default();
    let cpu_loss = {
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
        model.forward_backward(&mut acc, MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 0 }, 1.0, &mut cws)
    };
    let cpu_aux = cws.moe_stats().aux_loss;
    let cpu_counts: Vec<usize> = cws.moe_stats().blocks.iter().flat_map(|b| b.tokens_per_expert.iter().map(|&x| x as usize)).collect();
    let layout = GpuLayout::new(&model, 1)?;
    let shape = Shape::new(&cfg, b, t)?;
    let dparams = gpu.upload(&layout.pad(&params).iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?;
    let dgrads = gpu.alloc::<f32>(layout.total)?;
    let run = |recompute: bool| -> Result<(f32, f32, Vec<usize>, Vec<f32>)> {
        let mut ws = super::Workspace::new(gpu, shape, &layout, recompute)?;
        gpu.zero(dgrads.ptr(), &gpu.stream)?;
        let mut hooks = Replicated { layout: &layout, params: dparams.ptr(), grads: dgrads.ptr() };
        super::forward_backward(gpu, &mut hooks, &mut ws, &tokens, &targets, 1.0)?;
        let counts = ws.moe.as_ref().map(|m| m.counts.lock().expect("counts lock").concat()).unwrap_or_default();
        let loss = crate::cuda::gpt::mean_of(gpu, ws.losses.ptr())?;
        Ok((loss, ws.aux_loss.unwrap_or(f32::NAN), counts, layout.unpad(&gpu.download(dgrads.ptr())?)))
    };
    let (loss, aux, counts, g) = run(false)?;
    let tag = "[Mixtral-shaped LLaMA, 2 blocks of 4 experts top 2, aux 0.02]";
    let mut r = vec![
        CheckRow::same_bits(format!("moe model: expert loads = CPU's {counts:?} {tag}"), counts == cpu_counts),
        CheckRow::compare(format!("moe model loss {tag}"), &[loss], &[cpu_loss], 0.0, 1e-2),
        CheckRow::compare(format!("moe model aux loss {tag}"), &[aux], &[cpu_aux], 0.0, 1e-2),
    ];
    for spec in model.layout().specs() {
        let range = spec.range();
        r.extend(super::check::rows(&format!("moe model grad {} {tag}", spec.name), &g[range.clone()], &grads[range], 2e-2, 1.5e-1));
    }
    let (rl, ra, _, rg) = run(true)?;
    r.push(CheckRow::compare(
        format!("moe model loss + grads, activations recomputed = kept (bits) {tag}"),
        &[&[rl, ra][..], &rg].concat(),
        &[&[loss, aux][..], &g].concat(),
        1.0,
        0.0,
    ));
    let (l2, a2, _, g2) = run(false)?;
    r.push(CheckRow::compare(
        format!("moe model loss + grads, rerun bit-identical {tag}"),
        &[&[l2, a2][..], &g2].concat(),
        &[&[loss, aux][..], &g].concat(),
        1.0,
        0.0,
    ));
    Ok(r)
}
