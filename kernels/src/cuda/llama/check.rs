//! `tessera gpu check` rows of the LLaMA family: every kernel of [`super::ops`] and
//! [`super::attention`] against the CPU op it mirrors, on fresh random inputs rounded to bf16,
//! and whole small models (grouped-query attention at head dimensions 64 and 128, the Qwen2
//! bias, an untied head, LLaMA 3 RoPE scaling) against the CPU [`Model`]: loss and every
//! gradient, kept and recomputed activations bit for bit, and a rerun bit for bit.

use super::attention::{self as gqa_gpu, GqaShape};
use super::ops;
use crate::cuda::gpt::{GpuLayout, Replicated, Shape};
use crate::cuda::{bf16, CheckRow, Gpu, GpuError, Result};
use crate::gradcheck::randn;
use crate::model::{Arch, FlatAccess, MicroBatch, Model, ModelConfig};
use crate::ops::gqa::{self, Groups};
use crate::ops::rope::{self, RopeScaling, RopeTable};
use crate::ops::{attention, rmsnorm, swiglu};

fn round(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn rms(x: &mut dyn Iterator<Item = f64>) -> f64 {
    let (s, n) = x.fold((0f64, 0usize), |(s, n), v| (s + v * v, n + 1));
    (s / n.max(1) as f64).sqrt()
}

/// Two rows for an output of bf16 accuracy: the norm-wise error rms(gpu − cpu)/rms(cpu) ≤
/// `tol_rms`, and no element off by more than `tol_max` of |cpu| + rms(cpu) (an indexing or
/// masking bug gives O(1)).
pub(crate) fn rows(name: &str, gpu: &[f32], cpu: &[f32], tol_rms: f64, tol_max: f64) -> [CheckRow; 2] {
    let rc = rms(&mut cpu.iter().map(|&x| x as f64)).max(1e-12);
    let mut rel = CheckRow::compare(format!("{name} rms-rel"), gpu, cpu, rc, tol_rms);
    rel.max_rel = rms(&mut gpu.iter().zip(cpu).filter(|(g, _)| g.is_finite()).map(|(&a, &b)| a as f64 - b as f64)) / rc;
    [rel, CheckRow::compare(format!("{name} max-rel, floor rms"), gpu, cpu, rc, tol_max)]
}

/// Every check of the LLaMA family's kernels and model.
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let mut out = check_rmsnorm(gpu, seed)?;
    out.extend(check_rope(gpu, seed)?);
    out.extend(check_swiglu(gpu, seed)?);
    for (i, &(b, t, nh, nkv, hd)) in [(2, 77, 4, 2, 64), (1, 200, 4, 1, 64), (2, 33, 2, 2, 128), (1, 150, 4, 2, 128)].iter().enumerate() {
        out.extend(check_attention(gpu, seed.wrapping_add(i as u64 * 17), GqaShape { b, t, nh, nkv, hd })?);
    }
    out.extend(check_model(gpu, seed, 64)?);
    out.extend(check_model(gpu, seed, 128)?);
    out.extend(super::check_moe::check(gpu, seed)?);
    Ok(out)
}

fn check_rmsnorm(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let (n, c, eps) = (96, 320, 1e-5f32);
    let st = &gpu.stream;
    let x = randn(seed ^ 0x51, n * c, 2.0);
    let w = widen(&round(&randn(seed ^ 0x52, c, 1.0)));
    let dout = randn(seed ^ 0x53, n * c, 1.0);
    let dx0 = randn(seed ^ 0x54, n * c, 1.0);
    let (mut out, mut rstd) = (vec![0f32; n * c], vec![0f32; n]);
    rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &w, n, c, eps);
    let (mut dx, mut dw) = (dx0.clone(), vec![0f32; c]);
    rmsnorm::rmsnorm_backward(&mut dx, &mut dw, &dout, &x, &w, &rstd, n, c);
    let (gx, gw, gdout) = (gpu.upload(&x)?, gpu.upload(&round(&w))?, gpu.upload(&dout)?);
    let (gout, grstd) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(n)?);
    ops::rmsnorm_forward(gpu, st, gout.ptr(), grstd.ptr(), gx.ptr(), gw.ptr(), n, c, eps)?;
    let (gdx, gdxb, gdw) = (gpu.upload(&dx0)?, gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(c)?);
    let scratch = gpu.alloc::<f32>(ops::rmsnorm_backward_scratch(n, c))?;
    let a = ops::RmsBackward {
        dx: gdx.ptr(),
        dx_bf16: gdxb.ptr(),
        dw: gdw.ptr(),
        dout: gdout.ptr(),
        x: gx.ptr(),
        w: gw.ptr(),
        rstd: grstd.ptr(),
        scratch: scratch.ptr(),
        n,
        c,
    };
    ops::rmsnorm_backward(gpu, st, &a)?;
    let tag = format!("[{n}×{c}]");
    let mut r = vec![CheckRow::compare(format!("rmsnorm_forward rstd {tag}"), &gpu.download(grstd.ptr())?, &rstd, 0.0, 1e-5)];
    r.extend(rows(&format!("rmsnorm_forward out (bf16) {tag}"), &widen(&gpu.download(gout.ptr())?), &out, 1e-2, 2e-2));
    // f32 outputs whose row and column sums run in another order than the CPU's: a few ulp of
    // the O(1) scale of the row (measured on H200: 4.8e-7 absolute), hence the floor 1e-2.
    r.push(CheckRow::compare(format!("rmsnorm_backward dx (+=) {tag}"), &gpu.download(gdx.ptr())?, &dx, 1e-2, 1e-4));
    r.push(CheckRow::compare(format!("rmsnorm_backward dw {tag}"), &gpu.download(gdw.ptr())?, &dw, 1e-2, 1e-4));
    Ok(r)
}

fn check_rope(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    // 4 q heads and 2 k/v heads of 64, LLaMA 3 scaling, positions 0..t of two sequences.
    let (b, t, hd, nh, nkv) = (2, 40, 64, 4, 2);
    let row = (nh + 2 * nkv) * hd;
    let rot = (nh + nkv) * hd;
    let scaling = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 16.0 };
    let table = RopeTable::with_inv_freq(t, &rope::inv_freq(hd, 500_000.0, Some(&scaling)));
    let x = widen(&round(&randn(seed ^ 0x61, b * t * row, 1.0)));
    let (cos, sin) = (gpu.upload(table.cos())?, gpu.upload(table.sin())?);
    let dev = ops::RopeDev { cos: cos.ptr(), sin: sin.ptr(), t, half: hd / 2 };
    let mut r = Vec::new();
    for inverse in [false, true] {
        let mut want = x.clone();
        match inverse {
            false => rope::rope_forward_rows(&mut want, t, row, rot, &table),
            true => rope::rope_backward_rows(&mut want, t, row, rot, &table),
        }
        let g = gpu.upload(&round(&x))?;
        ops::rope(gpu, &gpu.stream, g.ptr(), &dev, row, nh + nkv, inverse)?;
        let name = if inverse { "rope_backward (transpose)" } else { "rope_forward" };
        r.extend(rows(
            &format!("{name} [b={b} t={t} hd={hd} heads {nh}+{nkv}, llama3 scaling]"),
            &widen(&gpu.download(g.ptr())?),
            &want,
            1e-2,
            2e-2,
        ));
    }
    Ok(r)
}

fn check_swiglu(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let len = 4096 + 77;
    let st = &gpu.stream;
    let [g, u, d] = [0x71u64, 0x72, 0x73].map(|k| widen(&round(&randn(seed ^ k, len, 2.0))));
    let mut out = vec![0f32; len];
    swiglu::swiglu_forward(&mut out, &g, &u);
    let (mut dg, mut du) = (vec![0f32; len], vec![0f32; len]);
    swiglu::swiglu_backward(&mut dg, &mut du, &d, &g, &u);
    let (gg, gu, gd) = (gpu.upload(&round(&g))?, gpu.upload(&round(&u))?, gpu.upload(&round(&d))?);
    let (go, gdg, gdu) = (gpu.alloc::<bf16>(len)?, gpu.alloc::<bf16>(len)?, gpu.alloc::<bf16>(len)?);
    ops::swiglu_forward(gpu, st, go.ptr(), gg.ptr(), gu.ptr())?;
    ops::swiglu_backward(gpu, st, gdg.ptr(), gdu.ptr(), gd.ptr(), gg.ptr(), gu.ptr())?;
    let mut r = Vec::new();
    for (name, dev, cpu) in [("swiglu_forward out", &go, &out), ("swiglu_backward dgate", &gdg, &dg), ("swiglu_backward dup", &gdu, &du)] {
        r.extend(rows(&format!("{name} [{len}]"), &widen(&gpu.download(dev.ptr())?), cpu, 1e-2, 2e-2));
    }
    Ok(r)
}

/// The GPU kernels against the CPU's grouped attention (repeat_kv, then multi-head attention,
/// then the group sums of the key/value gradients) on the same bf16 inputs.
fn check_attention(gpu: &Gpu, seed: u64, s: GqaShape) -> Result<Vec<CheckRow>> {
    let (b, t, c, n) = (s.b, s.t, s.c(), s.b * s.t);
    let gr = Groups { c, nh: s.nh, nkv: s.nkv };
    let qkv = round(&randn(seed ^ 0x81, n * s.row(), 1.0));
    let dy = round(&randn(seed ^ 0x82, n * c, 1.0));
    let (qkv_f, dy_f) = (widen(&qkv), widen(&dy));
    let mut full = vec![0f32; n * 3 * c];
    gqa::repeat_kv_forward(&mut full, &qkv_f, gr);
    let (mut y, mut att) = (vec![0f32; n * c], vec![0f32; b * s.nh * t * t]);
    attention::attention_forward(&mut y, &mut att, &full, b, t, c, s.nh);
    let mut dfull = vec![0f32; n * 3 * c];
    attention::attention_backward(&mut dfull, &dy_f, &full, &att, b, t, c, s.nh);
    let mut dqkv = vec![0f32; n * s.row()];
    gqa::repeat_kv_backward(&mut dqkv, &dfull, gr);

    let (gqkv, gdy) = (gpu.upload(&qkv)?, gpu.upload(&dy)?);
    let (gy, glse, gdelta) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(b * s.nh * t)?, gpu.alloc::<f32>(b * s.nh * t)?);
    let mut gd = gpu.alloc::<bf16>(n * s.row())?;
    gpu.write(&mut gd, 0, &vec![bf16::NAN; n * s.row()])?; // an element left unwritten shows as non-finite
    let run = || -> Result<(Vec<f32>, Vec<f32>)> {
        gqa_gpu::forward(gpu, &gpu.stream, gy.ptr(), glse.ptr(), gqkv.ptr(), s)?;
        gqa_gpu::backward(gpu, &gpu.stream, gd.ptr(), gdelta.ptr(), gdy.ptr(), gqkv.ptr(), gy.ptr(), glse.ptr(), s)?;
        Ok((widen(&gpu.download(gy.ptr())?), widen(&gpu.download(gd.ptr())?)))
    };
    let (y_gpu, d_gpu) = run()?;
    let tag = format!("[b={b} t={t} nh={} nkv={} hd={}]", s.nh, s.nkv, s.hd);
    let cols = |m: &[f32], lo: usize, hi: usize| -> Vec<f32> { m.chunks_exact(s.row()).flat_map(|r| r[lo..hi].iter().copied()).collect() };
    let kv = s.nkv * s.hd;
    let mut r = Vec::new();
    // bf16 outputs of f32 arithmetic: ~2e-3 norm-wise (the rounding of the outputs themselves).
    // Head dimension 64 runs on the tensor cores with P and dS as plain bf16, whose single
    // roundings reach ~6e-2 of |cpu| + rms on random inputs (the bound of the GPT-2 kernels'
    // rows, crate::cuda::attention); the f32 CUDA-core kernels stay within 5e-2.
    let tol_max = if s.hd == 64 { 1e-1 } else { 5e-2 };
    r.extend(rows(&format!("gqa attention y {tag}"), &y_gpu, &y, 1e-2, tol_max));
    for (name, lo, hi) in [("dq", 0, c), ("dk (group sum)", c, c + kv), ("dv (group sum)", c + kv, c + 2 * kv)] {
        r.extend(rows(&format!("gqa attention {name} {tag}"), &cols(&d_gpu, lo, hi), &cols(&dqkv, lo, hi), 1e-2, tol_max));
    }
    let (y2, d2) = run()?;
    r.push(CheckRow::compare(format!("gqa attention rerun bit-identical {tag}"), &[y2, d2].concat(), &[y_gpu, d_gpu].concat(), 1.0, 0.0));
    Ok(r)
}

/// A 2-layer model of head dimension `hd` with grouped-query attention (2 query heads per
/// key/value head), against the CPU model in f32 on the same bf16 parameters. At 64: tied head,
/// no bias; at 128: the Qwen2 q/k/v bias, an untied head and LLaMA 3 RoPE scaling.
fn check_model(gpu: &Gpu, seed: u64, hd: usize) -> Result<Vec<CheckRow>> {
    use crate::tensor::Rng;
    let (b, t) = (2, 70);
    let wide = hd == 128;
    let cfg = ModelConfig {
        arch: Arch::Llama,
        vocab_size: 320,
        max_seq_len: 96,
        n_layer: 2,
        n_head: 4,
        d_model: 4 * hd,
        // Wider than d_model: the CPU LLaMA block's backward reuses an [n, d_ff] buffer for [n, d_model].
        d_ff: 5 * hd,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 2,
        tied_head: !wide,
        qkv_bias: wide,
        rope_scaling: wide.then_some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        }),
        moe: None,
    };
    let model = Model::new(cfg.clone()).map_err(GpuError::Invalid)?;
    let mut params = model.init_params(seed);
    let mut noise = vec![0f32; params.len()];
    Rng::derive(seed, &[0x11a, hd as u64]).fill_normal(&mut noise, 0.02);
    for (p, n) in params.iter_mut().zip(&noise) {
        *p = bf16::from_f32(*p + n).to_f32();
    }
    let mut rng = Rng::derive(seed, &[0x11b, hd as u64]);
    let seq: Vec<u32> = (0..b * (t + 1)).map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32).collect();
    let tokens: Vec<u32> = (0..b).flat_map(|r| seq[r * (t + 1)..r * (t + 1) + t].to_vec()).collect();
    let targets: Vec<u32> = (0..b).flat_map(|r| seq[r * (t + 1) + 1..(r + 1) * (t + 1)].to_vec()).collect();
    let mut grads = vec![0f32; params.len()];
    let cpu_loss = {
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
        let batch = MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 0 };
        model.forward_backward(&mut acc, batch, 1.0, &mut crate::model::Workspace::default())
    };
    let layout = GpuLayout::new(&model, 1)?;
    let shape = Shape::new(&cfg, b, t)?;
    let dparams = gpu.upload(&layout.pad(&params).iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?;
    let dgrads = gpu.alloc::<f32>(layout.total)?;
    let run = |recompute: bool| -> Result<(f32, Vec<f32>)> {
        let mut ws = super::Workspace::new(gpu, shape, &layout, recompute)?;
        gpu.zero(dgrads.ptr(), &gpu.stream)?;
        let mut hooks = Replicated { layout: &layout, params: dparams.ptr(), grads: dgrads.ptr() };
        super::forward_backward(gpu, &mut hooks, &mut ws, &tokens, &targets, 1.0)?;
        Ok((crate::cuda::gpt::mean_of(gpu, ws.losses.ptr())?, layout.unpad(&gpu.download(dgrads.ptr())?)))
    };
    let (loss, g) = run(false)?;
    let tag = format!(
        "[LLaMA hd={hd}, {} q / {} kv heads{}{}{}]",
        cfg.n_head,
        cfg.n_kv_head,
        if cfg.qkv_bias { ", qkv bias" } else { "" },
        if cfg.tied_head { "" } else { ", untied head" },
        if cfg.rope_scaling.is_some() { ", llama3 rope" } else { "" }
    );
    let mut r = vec![CheckRow::compare(format!("model loss {tag}"), &[loss], &[cpu_loss], 0.0, 1e-2)];
    for spec in model.layout().specs() {
        let range = spec.range();
        // As the GPT model's rows: bf16 activations give ~5e-3 norm-wise per tensor.
        r.extend(rows(&format!("model grad {} {tag}", spec.name), &g[range.clone()], &grads[range], 2e-2, 1.5e-1));
    }
    let (rloss, rg) = run(true)?;
    r.push(CheckRow::compare(
        format!("model loss + grads, activations recomputed = kept (bits) {tag}"),
        &[&[rloss][..], &rg].concat(),
        &[&[loss][..], &g].concat(),
        1.0,
        0.0,
    ));
    let (loss2, g2) = run(false)?;
    r.push(CheckRow::compare(
        format!("model loss + grads, rerun bit-identical {tag}"),
        &[&[loss2][..], &g2].concat(),
        &[&[loss][..], &g].concat(),
        1.0,
        0.0,
    ));
    Ok(r)
}
