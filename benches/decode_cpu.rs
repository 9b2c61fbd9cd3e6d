//! CPU decoding benchmark (issue 31): greedy generation of `--batch` sequences together through
//! the paged key/value cache ([`CpuBackend`], f32 and int8 linears; for an MoE model also int8
//! with the experts left f32) against the recomputation `tessera generate` did before it (the
//! whole window through `Model::next_token_logits` for every token; batch 1 only), in one run;
//! and, with `--checkpoint`, the perplexity of a trained model on the shipped corpus's
//! validation split with the same formats.
//!
//! `cargo bench --bench decode_cpu -- [--model gpt2-small] [--experts E --top-k K] [--vocab 256]
//!  [--prompt 16] [--new 200] [--batch 1] [--no-recompute] [--checkpoint DIR] [--windows 8]`
//!
//! The default model is the 86M one: gpt2-small's shape with the byte-level vocabulary
//! (256) of a model trained on the shipped corpus; its weights are the seeded initialisation
//! (speed does not depend on their values). `--experts E` makes every block's MLP E experts of
//! the preset's MLP width, `--top-k` (default 2) of them per token, routed as Mixtral does.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tessera::data::{self, DEFAULT_VAL_FRACTION};
use tessera::infer::{Backend, CpuBackend, CpuOptions, LinearFormat, SeqStep};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace, ParamsAt, QuantScope, QuantWeights};
use tessera_kernels::model::{Model, MoeConfig, Workspace};
use tessera_kernels::ops::paged_attention::PagedSeq;
use tessera_kernels::tensor::Rng;

/// Positions per cache block.
const BLOCK_SIZE: usize = 16;

struct Opts {
    model: String,
    vocab: usize,
    prompt: usize,
    new: usize,
    batch: usize,
    experts: usize,
    top_k: usize,
    recompute: bool,
    checkpoint: Option<PathBuf>,
    windows: usize,
}

fn parse() -> Result<Opts> {
    let mut o = Opts {
        model: "gpt2-small".into(),
        vocab: 256,
        prompt: 16,
        new: 200,
        batch: 1,
        experts: 0,
        top_k: 2,
        recompute: true,
        checkpoint: None,
        windows: 8,
    };
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        let num = |v: String| v.parse::<usize>().with_context(|| format!("{a} {v}: expected a count"));
        match a.as_str() {
            "--model" => o.model = val()?,
            "--vocab" => o.vocab = num(val()?)?,
            "--prompt" => o.prompt = num(val()?)?,
            "--new" => o.new = num(val()?)?,
            "--batch" => o.batch = num(val()?)?,
            "--experts" => o.experts = num(val()?)?,
            "--top-k" => o.top_k = num(val()?)?,
            "--windows" => o.windows = num(val()?)?,
            "--no-recompute" => o.recompute = false,
            "--checkpoint" => o.checkpoint = Some(PathBuf::from(val()?)),
            _ => bail!("unknown argument {a}: see the doc comment of benches/decode_cpu.rs"),
        }
    }
    if o.prompt == 0 || o.new == 0 || o.batch == 0 {
        bail!("--prompt, --new and --batch must be positive");
    }
    if o.experts > 0 && !(1..=o.experts).contains(&o.top_k) {
        bail!("--top-k {}: expected 1 to --experts ({})", o.top_k, o.experts);
    }
    Ok(o)
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Greedy tokens and seconds of the recomputation path (the old `tessera generate`).
fn recompute(model: &Model, params: &[f32], prompt: &[u32], new: usize) -> (Vec<u32>, f64) {
    let (mut tokens, mut ws) = (prompt.to_vec(), Workspace::default());
    let t0 = Instant::now();
    for _ in 0..new {
        let window = &tokens[tokens.len().saturating_sub(model.cfg.max_seq_len)..];
        let next = argmax(&model.next_token_logits(params, window, &mut ws));
        tokens.push(next);
    }
    (tokens[prompt.len()..].to_vec(), t0.elapsed().as_secs_f64())
}

/// Greedy tokens of each of `prompts`, decoded together through a backend (every prompt in the
/// first step, then a row per sequence a step; the cache's blocks split evenly between them),
/// seconds of the first step (prefill) and seconds of the rest.
fn paged(b: &mut CpuBackend, prompts: &[Vec<u32>], new: usize) -> Result<(Vec<Vec<u32>>, f64, f64)> {
    let per = b.num_blocks() / prompts.len();
    let tables: Vec<Vec<u32>> = (0..prompts.len()).map(|i| (i * per..(i + 1) * per).map(|k| k as u32).collect()).collect();
    let t0 = Instant::now();
    let first: Vec<SeqStep> =
        prompts.iter().zip(&tables).map(|(p, t)| SeqStep { tokens: p, start: 0, block_table: t, want_logits: true }).collect();
    let mut out: Vec<Vec<u32>> = b.step(&first)?.iter().map(|l| vec![argmax(l)]).collect();
    let ttft = t0.elapsed().as_secs_f64();
    while out[0].len() < new {
        let logits = {
            let rows = out.iter().zip(prompts).zip(&tables);
            let step: Vec<SeqStep> = rows
                .map(|((o, p), t)| SeqStep { tokens: &o[o.len() - 1..], start: p.len() + o.len() - 1, block_table: t, want_logits: true })
                .collect();
            b.step(&step)?
        };
        out.iter_mut().zip(&logits).for_each(|(o, l)| o.push(argmax(l)));
    }
    Ok((out, ttft, t0.elapsed().as_secs_f64() - ttft))
}

/// The weight formats compared: f32, int8 with the MoE experts f32 (an MoE model only), int8.
fn formats(moe: bool) -> Vec<(&'static str, LinearFormat, QuantScope)> {
    let mut f = vec![("f32", LinearFormat::F32, QuantScope::All)];
    if moe {
        f.push(("int8, experts f32", LinearFormat::Int8, QuantScope::Dense));
    }
    f.push((if moe { "int8, experts int8" } else { "int8" }, LinearFormat::Int8, QuantScope::All));
    f
}

fn speed(o: &Opts) -> Result<()> {
    let mut cfg = tessera::zoo::preset(&o.model).map_err(anyhow::Error::msg)?;
    cfg.vocab_size = o.vocab;
    if o.experts > 0 {
        cfg.moe = Some(MoeConfig::mixtral(o.experts, o.top_k, cfg.d_ff, 0.0));
    }
    let len = o.prompt + o.new;
    if len > cfg.max_seq_len {
        bail!("--prompt {} + --new {} exceed {}'s context of {}", o.prompt, o.new, o.model, cfg.max_seq_len);
    }
    let model = Model::new(cfg.clone()).map_err(anyhow::Error::msg)?;
    let params = model.init_params(1);
    let mut rng = Rng::new(2);
    let prompts: Vec<Vec<u32>> = (0..o.batch).map(|_| (0..o.prompt).map(|_| rng.gen_range(o.vocab as u64) as u32).collect()).collect();
    let threads = rayon::current_num_threads();
    let moe = cfg.moe.as_ref().map_or(String::new(), |m| format!(", {} experts top-{} of width {}", m.num_experts, m.top_k, m.d_expert));
    println!(
        "{}{moe} ({} parameters, vocab {}), prompt {}, {} new tokens, greedy, batch {}, {threads} threads",
        o.model,
        model.num_params(),
        o.vocab,
        o.prompt,
        o.new,
        o.batch
    );
    println!("| path | linears | weights held MB | prefill s | decode s | decode tokens/s | all tokens/s | same tokens as f32 cache |");
    println!("|---|---|---|---|---|---|---|---|");
    let per = len.div_ceil(BLOCK_SIZE);
    let opts = CpuOptions { block_size: BLOCK_SIZE, num_blocks: o.batch * per, weights: LinearFormat::F32 };
    let (total, mut want) = (o.batch * o.new, Vec::new());
    for (k, (name, weights, scope)) in formats(cfg.moe.is_some()).into_iter().enumerate() {
        let model = Model::new(cfg.clone()).map_err(anyhow::Error::msg)?;
        let mut b = CpuBackend::with_scope(model, params.clone(), CpuOptions { weights, ..opts }, scope)?;
        if k == 0 {
            // Warm-up (thread pool, first touch of the cache and the buffers); the timed runs rewrite it all.
            paged(&mut b, &prompts, 2)?;
        }
        let (got, ttft, rest) = paged(&mut b, &prompts, o.new)?;
        if k == 0 {
            want = got.clone();
        }
        let same: usize = got.iter().zip(&want).map(|(g, w)| g.iter().zip(w).take_while(|(a, b)| a == b).count()).sum();
        println!(
            "| paged KV cache | {name} | {:.1} | {ttft:.3} | {rest:.3} | {:.1} | {:.1} | {same} of {total} |",
            b.weight_bytes() as f64 / 1e6,
            (o.batch * (o.new - 1)) as f64 / rest,
            total as f64 / (ttft + rest),
        );
    }
    if o.recompute && o.batch == 1 {
        let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
        let (got, secs) = recompute(&model, &params, &prompts[0], o.new);
        println!(
            "| recompute the window (before) | f32 | {:.1} | – | – | – | {:.1} | {} of {} |",
            4.0 * params.len() as f64 / 1e6,
            o.new as f64 / secs,
            got.iter().zip(&want[0]).take_while(|(a, b)| a == b).count(),
            o.new
        );
        println!("recompute: {secs:.2} s for {} tokens", o.new);
    }
    Ok(())
}

/// Mean cross-entropy (nats) of predicting each next token of `windows` windows of the
/// validation split, through the paged forward (int8 or f32 linears) and, for f32, `Model::loss`.
fn perplexity(o: &Opts, dir: &std::path::Path) -> Result<()> {
    let ck = tessera::checkpoint::resolve_resume(dir).with_context(|| format!("loading checkpoint {}", dir.display()))?.state;
    let (model, params) = tessera::cli::model_from_checkpoint(&ck)?;
    let ds = data::load(&data::default_corpus_path(), None, DEFAULT_VAL_FRACTION)?;
    if ds.vocab_size > model.cfg.vocab_size {
        bail!(
            "the byte-level corpus has {} ids, the checkpoint's model {}: pass a byte-level checkpoint",
            ds.vocab_size,
            model.cfg.vocab_size
        );
    }
    let t = model.cfg.max_seq_len;
    let windows: Vec<&[u32]> = ds.val.chunks_exact(t + 1).take(o.windows).collect();
    if windows.is_empty() {
        bail!("the validation split ({} tokens) holds no window of {} tokens", ds.val.len(), t + 1);
    }
    let all = 0..model.units().len();
    let moe = model.cfg.moe.is_some();
    let quantized: Vec<(&str, Option<QuantWeights>)> = formats(moe)
        .into_iter()
        .map(|(name, w, scope)| {
            (name, (w == LinearFormat::Int8).then(|| model.quantize_int8_scope(&ParamsAt::whole(&params, None), all.clone(), scope)))
        })
        .collect();
    println!(
        "checkpoint {} ({}, {} parameters), {} windows of {t} tokens of the validation split of {}",
        dir.display(),
        ck.model,
        model.num_params(),
        windows.len(),
        ds.source
    );
    println!("f32 parameters: {:.2} MB", 4.0 * params.len() as f64 / 1e6);
    for (name, q) in &quantized {
        if let Some(q) = q {
            let (mb, f32_mb) = (q.bytes() as f64 / 1e6, 4.0 * q.numel() as f64 / 1e6);
            println!("{name}: {} weights in {mb:.2} MB of int8 and scales ({f32_mb:.2} MB as f32)", q.numel());
        }
    }
    let (mut ce_loss, mut ce) = (0f64, vec![0f64; quantized.len()]);
    let mut ws = Workspace::default();
    for w in &windows {
        let (x, y) = (&w[..t], &w[1..]);
        let mut acc = tessera_kernels::model::FlatAccess { params: &params, grads: &mut [], units: model.units() };
        ce_loss += f64::from(model.loss(&mut acc, x, y, 1, t, &mut ws));
        for ((_, q), sum) in quantized.iter().zip(&mut ce) {
            let mut cache = KvCache::new(&model.cfg, t.div_ceil(BLOCK_SIZE), BLOCK_SIZE).map_err(anyhow::Error::msg)?;
            let table: Vec<u32> = (0..cache.num_blocks() as u32).collect();
            let seqs = [PagedSeq { rows: 0..t, start: 0, table: &table }];
            let rows: Vec<usize> = (0..t).collect();
            let logits = model.forward_paged(&params, q.as_ref(), &mut cache, x, &seqs, &rows, &mut PagedWorkspace::default());
            *sum += mean_ce(&logits, y, model.cfg.vocab_size);
        }
    }
    let n = windows.len() as f64;
    println!("| linears | path | mean cross-entropy (nats) | perplexity |");
    println!("|---|---|---|---|");
    println!("| f32 | Model::loss (training forward) | {:.5} | {:.4} |", ce_loss / n, (ce_loss / n).exp());
    for ((name, _), sum) in quantized.iter().zip(&ce) {
        println!("| {name} | paged KV cache | {:.5} | {:.4} |", sum / n, (sum / n).exp());
    }
    Ok(())
}

/// Mean over rows of `logsumexp(logits_r) − logits_r[target_r]`, in f64.
fn mean_ce(logits: &[f32], targets: &[u32], v: usize) -> f64 {
    let sum: f64 = logits
        .chunks_exact(v)
        .zip(targets)
        .map(|(row, &y)| {
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            lse - row[y as usize] as f64
        })
        .sum();
    sum / targets.len() as f64
}

fn main() -> Result<()> {
    let o = parse()?;
    match &o.checkpoint {
        Some(dir) => perplexity(&o, dir),
        None => speed(&o),
    }
}
