//! `tessera gpu check` rows of GPU decoding: the paged attention kernel against the CPU's causal
//! attention (a cache with scrambled block tables, grouped-query heads), and whole small models
//! (GPT-2; LLaMA with grouped-query attention, the Qwen2 bias, an untied head and LLaMA 3 RoPE)
//! stepped through prompt chunks, a shared prefix block, mixed prefill/decode batches and decode
//! steps replayed from CUDA graphs, every step's logits against the CPU [`Model`] recomputing
//! the window ([`Model::next_token_logits`]) on the same bf16-rounded parameters; and the graph
//! replay against the same steps run kernel by kernel, bit for bit. The same with the linear
//! layers in int8 and fp8 (the CPU on the dequantized weights), and the quantized GEMV alone.

use std::sync::Arc;

use super::launch::{self, Heads, StepPtrs};
use super::quant::{self, WeightFormat};
use super::weights::reference_params;
use super::{DecodeOptions, Decoder, StepBatch, StepSeq};
use crate::cuda::llama::check::rows;
use crate::cuda::{bf16, CheckRow, Gpu, GpuError, Result};
use crate::gradcheck::randn;
use crate::model::{Arch, Model, ModelConfig, Workspace};
use crate::ops::gqa::{self, Groups};
use crate::ops::rope::RopeScaling;
use crate::tensor::Rng;

/// Every decoding check.
pub fn check(gpu: &Arc<Gpu>, seed: u64) -> Result<Vec<CheckRow>> {
    let mut out = check_attention(gpu, seed, Heads { nh: 4, nkv: 4, hd: 64 })?;
    out.extend(check_attention(gpu, seed ^ 1, Heads { nh: 8, nkv: 2, hd: 128 })?);
    for fmt in [WeightFormat::Bf16, WeightFormat::Int8, WeightFormat::Fp8] {
        for (m, k, n, gelu) in [(1, 256, 768, false), (11, 1024, 256, true)] {
            out.extend(check_gemv(gpu, seed, fmt, (m, k, n), gelu)?);
        }
    }
    for fmt in [WeightFormat::Bf16, WeightFormat::Int8, WeightFormat::Fp8] {
        out.extend(check_model(gpu, seed, small(Arch::Gpt), fmt)?);
        out.extend(check_model(gpu, seed, small(Arch::Llama), fmt)?);
    }
    Ok(out)
}

fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn widen(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Three sequences of lengths 70, 33, 1 whose keys and values sit in the cache under scrambled
/// block tables; the queries of their last 5, 2 and 1 positions (the kernel sees each as a token
/// at its position) against the CPU's causal attention over the sequence.
fn check_attention(gpu: &Gpu, seed: u64, h: Heads) -> Result<Vec<CheckRow>> {
    let (bs, lens, last) = (16usize, [70usize, 33, 1], [5usize, 2, 1]);
    let (c, kv) = (h.nh * h.hd, h.nkv * h.hd);
    let gr = Groups { c, nh: h.nh, nkv: h.nkv };
    let num_blocks = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 3;
    // Blocks handed out from the top down, so no table is in order.
    let mut next = num_blocks;
    let tables: Vec<Vec<u32>> = lens
        .iter()
        .map(|l| {
            (0..l.div_ceil(bs))
                .map(|_| {
                    next -= 1;
                    next as u32
                })
                .collect()
        })
        .collect();
    let mb = tables.iter().map(|t| t.len()).max().unwrap_or(1);
    let (mut kc, mut vc) = (vec![0f32; num_blocks * bs * kv], vec![0f32; num_blocks * bs * kv]);
    let (mut q, mut cpu_y, mut packed) = (Vec::new(), Vec::new(), vec![Vec::new(); 4]);
    for (s, &len) in lens.iter().enumerate() {
        let qkv = widen(&randn(seed ^ (s as u64 + 7), len * gr.row(), 1.0));
        for p in 0..len {
            let slot = tables[s][p / bs] as usize * bs + p % bs;
            kc[slot * kv..][..kv].copy_from_slice(&qkv[p * gr.row() + c..][..kv]);
            vc[slot * kv..][..kv].copy_from_slice(&qkv[p * gr.row() + c + kv..][..kv]);
        }
        let mut full = vec![0f32; len * 3 * c];
        gqa::repeat_kv_forward(&mut full, &qkv, gr);
        let (mut y, mut att) = (vec![0f32; len * c], vec![0f32; h.nh * len * len]);
        crate::ops::attention::attention_forward(&mut y, &mut att, &full, 1, len, c, h.nh);
        for p in len - last[s]..len {
            q.extend_from_slice(&qkv[p * gr.row()..][..c]);
            cpu_y.extend_from_slice(&y[p * c..][..c]);
            let slot = tables[s][p / bs] as usize * bs + p % bs;
            for (k, v) in [0, p as i32, slot as i32, s as i32].into_iter().enumerate() {
                packed[k].push(v);
            }
        }
    }
    let n = q.len() / c;
    let mut tab = vec![0i32; lens.len() * mb];
    for (s, t) in tables.iter().enumerate() {
        for (k, &b) in t.iter().enumerate() {
            tab[s * mb + k] = b as i32;
        }
    }
    let ints: Vec<i32> = packed.concat().into_iter().chain(tab).collect();
    let di = gpu.upload(&ints)?;
    let i = di.ptr();
    let p = StepPtrs {
        tok: i.slice(0..n),
        pos: i.slice(n..2 * n),
        slot: i.slice(2 * n..3 * n),
        seq: i.slice(3 * n..4 * n),
        rows: i.slice(4 * n..4 * n),
        tables: i.slice(4 * n..ints.len()),
        max_blocks: mb,
    };
    let (dq, dk, dv, dy) = (gpu.upload(&bf(&q))?, gpu.upload(&bf(&kc))?, gpu.upload(&bf(&vc))?, gpu.alloc::<bf16>(n * c)?);
    launch::paged_attention(gpu, &gpu.stream, dy.ptr(), dq.ptr(), (dk.ptr(), dv.ptr()), &p, h, bs, 96)?;
    let gy: Vec<f32> = gpu.download(dy.ptr())?.iter().map(|x| x.to_f32()).collect();
    let name = format!("paged attention [{} q / {} kv heads, hd {}, 3 seqs, scrambled blocks]", h.nh, h.nkv, h.hd);
    Ok(rows(&name, &gy, &cpu_y, 1e-2, 5e-2).to_vec())
}

/// The decode GEMV (bf16, int8, fp8 weights; with the bias + GELU epilogue when `gelu`) against
/// `x · W` on the CPU with the weight the kernel computes with; for the quantized formats also
/// the widening for cuBLAS.
fn check_gemv(gpu: &Gpu, seed: u64, fmt: WeightFormat, (m, k, n): (usize, usize, usize), gelu: bool) -> Result<Vec<CheckRow>> {
    let w = randn(seed ^ 0x9e, k * n, 0.05);
    let x = widen(&randn(seed ^ 0x9f, m * k, 1.0));
    let bias = widen(&randn(seed ^ 0xa0, n, 0.5));
    let (bytes, scales, wd) = match fmt {
        WeightFormat::Bf16 => {
            let wt: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(w[(i % k) * n + i / k])).collect();
            (wt.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect::<Vec<u8>>(), None, widen(&w))
        }
        _ => {
            let t = quant::quantize(&w, k, n, fmt);
            let wd = quant::dequantize(&t, fmt);
            (t.q, Some(t.s), wd)
        }
    };
    let mut cpu = vec![0f32; m * n];
    crate::ops::linear::linear_forward(&mut cpu, &x, &wd, None, m, k, n);
    if gelu {
        let pre: Vec<f32> =
            cpu.iter().enumerate().map(|(i, &v)| bf16::from_f32(bf16::from_f32(v).to_f32() + bias[i % n]).to_f32()).collect();
        crate::ops::gelu::gelu_forward(&mut cpu, &pre);
    }
    let (dw, dx, dy, db) = (gpu.upload(&bytes)?, gpu.upload(&bf(&x))?, gpu.alloc::<bf16>(m * n)?, gpu.upload(&bf(&bias))?);
    let ds = scales.as_ref().map(|s| gpu.upload(s)).transpose()?;
    let gw = launch::GemvW { w: dw.ptr().raw, s: ds.as_ref().map(|s| s.ptr()), fmt };
    launch::gemv(gpu, &gpu.stream, dy.ptr(), launch::GemvIn::Rows(dx.ptr()), gw, gelu.then(|| db.ptr()), gelu, m, (k, n))?;
    let gy: Vec<f32> = gpu.download(dy.ptr())?.iter().map(|v| v.to_f32()).collect();
    let what = if gelu { " + bias + GELU" } else { "" };
    let mut out = rows(&format!("{fmt} decode GEMV{what} [{m}×{k}]·[{k}×{n}]"), &gy, &cpu, 1e-2, 5e-2).to_vec();
    if let Some(ds) = &ds {
        let dwd = gpu.alloc::<bf16>(k * n)?;
        let int8 = fmt == WeightFormat::Int8;
        let dq = dw.ptr().cast::<u8>();
        launch::wq_dequant(gpu, &gpu.stream, dwd.ptr(), (dq, ds.ptr()), int8, (k, n))?;
        let gwd: Vec<f32> = gpu.download(dwd.ptr())?.iter().map(|v| v.to_f32()).collect();
        out.push(CheckRow::compare(format!("{fmt} weight widened to bf16 [{k}×{n}]"), &gwd, &widen(&wd), 1e-6, 4e-3));
    }
    Ok(out)
}

/// A 2-layer model: GPT-2-shaped, or LLaMA with grouped-query heads, the Qwen2 q/k/v bias, an
/// untied head and LLaMA 3 RoPE scaling.
fn small(arch: Arch) -> ModelConfig {
    let llama = arch == Arch::Llama;
    ModelConfig {
        arch,
        vocab_size: 384,
        max_seq_len: 96,
        n_layer: 2,
        n_head: 4,
        d_model: 256,
        d_ff: if llama { 640 } else { 1024 },
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: if llama { 2 } else { 4 },
        tied_head: !llama,
        qkv_bias: llama,
        rope_scaling: llama.then_some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        }),
        moe: None,
    }
}

/// Every logits row of a schedule: the decoder's, and the CPU model's for the same sequences.
struct Outputs {
    gpu: Vec<Vec<f32>>,
    cpu: Vec<Vec<f32>>,
}

/// One sequence of the model check: its tokens so far and its block table.
struct Seq {
    tokens: Vec<u32>,
    table: Vec<u32>,
}

/// The schedule of [`check_model`]: sequence 0's 37-token prompt in chunks of 20 and 17,
/// sequence 1's 5-token prompt beside the first chunk, sequence 2 sharing sequence 0's first
/// block (16 tokens) and running its own 4 beside the second chunk, then 6 decode steps of all
/// three. Returns each step's logits (GPU) and the CPU's.
fn run_schedule(dec: &mut Decoder, model: &Model, params: &[f32], seed: u64) -> Result<Outputs> {
    let v = model.cfg.vocab_size as u64;
    let mut rng = Rng::derive(seed, &[0xdec]);
    let mut draw = |k: usize| -> Vec<u32> { (0..k).map(|_| rng.gen_range(v) as u32).collect() };
    let p0 = draw(37);
    let mut p2 = p0[..16].to_vec();
    p2.extend(draw(4));
    // Blocks from the top down; sequence 2's first block is sequence 0's.
    let mut seqs = [
        Seq { tokens: p0, table: vec![20, 17, 9, 3] },
        Seq { tokens: draw(5), table: vec![15, 1] },
        Seq { tokens: p2, table: vec![20, 11, 6] },
    ];
    let (mut gpu_out, mut cpu_out) = (Vec::new(), Vec::new());
    // (sequence, start, end, want logits) per step.
    let prefill: [&[(usize, usize, usize, bool)]; 2] = [&[(0, 0, 20, false), (1, 0, 5, true)], &[(0, 20, 37, true), (2, 16, 20, true)]];
    let mut ws = Workspace::default();
    for step in prefill {
        let batch: Vec<StepSeq> = step
            .iter()
            .map(|&(s, a, b, want)| StepSeq { tokens: &seqs[s].tokens[a..b], start: a, block_table: &seqs[s].table, want_logits: want })
            .collect();
        let sb = StepBatch::pack(dec, &batch)?;
        dec.run(&sb)?;
        gpu_out.extend(dec.logits(&sb)?);
        for &(s, _, b, want) in step {
            if want {
                cpu_out.push(model.next_token_logits(params, &seqs[s].tokens[..b], &mut ws));
            }
        }
    }
    for _ in 0..6 {
        for s in seqs.iter_mut() {
            s.tokens.extend(draw(1));
        }
        let batch: Vec<StepSeq> = seqs
            .iter()
            .map(|s| StepSeq {
                tokens: &s.tokens[s.tokens.len() - 1..],
                start: s.tokens.len() - 1,
                block_table: &s.table,
                want_logits: true,
            })
            .collect();
        let sb = StepBatch::pack(dec, &batch)?;
        dec.run(&sb)?;
        gpu_out.extend(dec.logits(&sb)?);
        for s in &seqs {
            cpu_out.push(model.next_token_logits(params, &s.tokens, &mut ws));
        }
    }
    Ok(Outputs { gpu: gpu_out, cpu: cpu_out })
}

/// The model check in weight format `fmt`: the CPU reference runs on the parameters the decoder
/// computes with ([`reference_params`]). Quantized decoders run their prompt steps through the
/// widened-weight GEMMs and their decode steps through the GEMV kernel.
fn check_model(gpu: &Arc<Gpu>, seed: u64, cfg: ModelConfig, fmt: WeightFormat) -> Result<Vec<CheckRow>> {
    let model = Model::new(cfg.clone()).map_err(GpuError::Invalid)?;
    let mut params = model.init_params(seed);
    let mut noise = vec![0f32; params.len()];
    Rng::derive(seed, &[0xdec0]).fill_normal(&mut noise, 0.02);
    for (p, n) in params.iter_mut().zip(&noise) {
        *p = bf16::from_f32(*p + n).to_f32();
    }
    let reference = reference_params(&model, &params, fmt);
    let opts = |graph_max| DecodeOptions { num_blocks: 24, block_size: 16, max_tokens: 64, max_seqs: 4, graph_max, weights: fmt };
    let tag = match cfg.arch {
        Arch::Gpt => format!("[GPT-2, 2 layers, {fmt}]"),
        Arch::Llama => {
            format!("[LLaMA, 2 layers, {} q / {} kv heads, qkv bias, untied head, llama3 rope, {fmt}]", cfg.n_head, cfg.n_kv_head)
        }
    };
    let mut graphs = Decoder::new(gpu.clone(), &model, &params, opts(8))?;
    graphs.set_gemv_rows_max(8);
    let Outputs { gpu: g, cpu } = run_schedule(&mut graphs, &model, &reference, seed)?;
    let mut out = Vec::new();
    for (i, (g, c)) in g.iter().zip(&cpu).enumerate() {
        let what = if i < 3 { "prefill" } else { "decode (graph)" };
        out.extend(rows(&format!("decode logits {i:>2} {what} {tag}"), g, c, 2e-2, 1e-1));
    }
    let mut eager = Decoder::new(gpu.clone(), &model, &params, opts(0))?;
    eager.set_gemv_rows_max(8);
    let e = run_schedule(&mut eager, &model, &reference, seed)?.gpu;
    let same = g.iter().zip(&e).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    out.push(CheckRow::same_bits(format!("decode: CUDA graph replay = kernel by kernel, bits {tag}"), same));
    if cfg.arch == Arch::Gpt {
        out.extend(check_unfolded(gpu, &model, &params, &reference, &g, opts(0), &tag, seed)?);
    }
    Ok(out)
}

/// GPT-2's residual + LayerNorm folded into the next GEMV's prologue (the decode steps above)
/// against the same schedule with the separate kernels: the prologue repeats
/// `residual_layernorm_forward`'s arithmetic, so the logits should agree to the bit; the row
/// passes within 1e-3 rms-relative (a wrong row, bias or weight is ~1e-1) and says in its name
/// whether every bit agreed.
#[allow(clippy::too_many_arguments)]
fn check_unfolded(
    gpu: &Arc<Gpu>,
    model: &Model,
    params: &[f32],
    reference: &[f32],
    folded: &[Vec<f32>],
    opts: DecodeOptions,
    tag: &str,
    seed: u64,
) -> Result<Vec<CheckRow>> {
    let mut plain = Decoder::new(gpu.clone(), model, params, opts)?;
    plain.set_gemv_rows_max(8);
    plain.set_fold_norms(false);
    let u = run_schedule(&mut plain, model, reference, seed)?.gpu;
    let (f, u): (Vec<f32>, Vec<f32>) = (folded.concat(), u.concat());
    let same = f.iter().zip(&u).all(|(a, b)| a.to_bits() == b.to_bits());
    let bits = if same { "every bit equal" } else { "NOT bit-equal" };
    Ok(rows(&format!("decode: residual + LayerNorm folded into the GEMVs = separate kernels ({bits}) {tag}"), &f, &u, 1e-3, 1e-2).to_vec())
}
