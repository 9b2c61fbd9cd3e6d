//! CPU decoding benchmark (issue 31): greedy generation at batch 1 through the paged key/value
//! cache ([`CpuBackend`], f32 and int8 linears) against the recomputation `tessera generate` did
//! before it (the whole window through `Model::next_token_logits` for every token), in one run;
//! and, with `--checkpoint`, the perplexity of a trained model on the shipped corpus's
//! validation split with f32 and with int8 linears.
//!
//! `cargo bench --bench decode_cpu -- [--model gpt2-small] [--vocab 256] [--prompt 16]
//!  [--new 200] [--no-recompute] [--checkpoint DIR] [--windows 8]`
//!
//! The default model is the 86M one: gpt2-small's shape with the byte-level vocabulary
//! (256) of a model trained on the shipped corpus; its weights are the seeded initialisation
//! (speed does not depend on their values).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tessera::data::{self, DEFAULT_VAL_FRACTION};
use tessera::infer::{Backend, CpuBackend, CpuOptions, LinearFormat, SeqStep};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace};
use tessera_kernels::model::{Model, Workspace};
use tessera_kernels::ops::paged_attention::PagedSeq;
use tessera_kernels::tensor::Rng;

/// Positions per cache block.
const BLOCK_SIZE: usize = 16;

struct Opts {
    model: String,
    vocab: usize,
    prompt: usize,
    new: usize,
    recompute: bool,
    checkpoint: Option<PathBuf>,
    windows: usize,
}

fn parse() -> Result<Opts> {
    let mut o = Opts { model: "gpt2-small".into(), vocab: 256, prompt: 16, new: 200, recompute: true, checkpoint: None, windows: 8 };
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        let num = |v: String| v.parse::<usize>().with_context(|| format!("{a} {v}: expected a count"));
        match a.as_str() {
            "--model" => o.model = val()?,
            "--vocab" => o.vocab = num(val()?)?,
            "--prompt" => o.prompt = num(val()?)?,
            "--new" => o.new = num(val()?)?,
            "--windows" => o.windows = num(val()?)?,
            "--no-recompute" => o.recompute = false,
            "--checkpoint" => o.checkpoint = Some(PathBuf::from(val()?)),
            _ => bail!("unknown argument {a}: see the doc comment of benches/decode_cpu.rs"),
        }
    }
    if o.prompt == 0 || o.new == 0 {
        bail!("--prompt and --new must be positive");
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

/// Greedy tokens, seconds to the first token (prefill) and seconds of the rest, through a backend.
fn paged(b: &mut CpuBackend, prompt: &[u32], new: usize) -> Result<(Vec<u32>, f64, f64)> {
    let table: Vec<u32> = (0..b.num_blocks() as u32).collect();
    let t0 = Instant::now();
    let step = |b: &mut CpuBackend, tokens: &[u32], start: usize| -> Result<u32> {
        let out = b.step(&[SeqStep { tokens, start, block_table: &table, want_logits: true }])?;
        Ok(argmax(&out[0]))
    };
    let mut out = vec![step(b, prompt, 0)?];
    let ttft = t0.elapsed().as_secs_f64();
    while out.len() < new {
        let pos = prompt.len() + out.len() - 1;
        out.push(step(b, &out[out.len() - 1..], pos)?);
    }
    Ok((out, ttft, t0.elapsed().as_secs_f64() - ttft))
}

fn speed(o: &Opts) -> Result<()> {
    let mut cfg = tessera::zoo::preset(&o.model).map_err(anyhow::Error::msg)?;
    cfg.vocab_size = o.vocab;
    let len = o.prompt + o.new;
    if len > cfg.max_seq_len {
        bail!("--prompt {} + --new {} exceed {}'s context of {}", o.prompt, o.new, o.model, cfg.max_seq_len);
    }
    let model = Model::new(cfg.clone()).map_err(anyhow::Error::msg)?;
    let params = model.init_params(1);
    let mut rng = Rng::new(2);
    let prompt: Vec<u32> = (0..o.prompt).map(|_| rng.gen_range(o.vocab as u64) as u32).collect();
    let threads = rayon::current_num_threads();
    println!(
        "{} ({} parameters, vocab {}), prompt {}, {} new tokens, greedy, batch 1, {threads} threads",
        o.model,
        model.num_params(),
        o.vocab,
        o.prompt,
        o.new
    );
    println!("| path | linears | prefill s | decode s | decode tokens/s | all tokens/s | same tokens as f32 cache |");
    println!("|---|---|---|---|---|---|---|");
    let opts = CpuOptions { block_size: BLOCK_SIZE, num_blocks: len.div_ceil(BLOCK_SIZE), weights: LinearFormat::F32 };
    let mut f32b = CpuBackend::new(Model::new(cfg.clone()).map_err(anyhow::Error::msg)?, params.clone(), opts)?;
    // Warm-up (thread pool, first touch of the cache and the buffers); the timed run rewrites it all.
    paged(&mut f32b, &prompt, 2)?;
    let (want, ttft, rest) = paged(&mut f32b, &prompt, o.new)?;
    let row = |path: &str, lin: &str, ttft: f64, rest: f64, got: &[u32]| {
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let all = ttft + rest;
        println!(
            "| {path} | {lin} | {ttft:.3} | {rest:.3} | {:.1} | {:.1} | {same} of {} |",
            (o.new - 1) as f64 / rest,
            o.new as f64 / all,
            want.len()
        );
    };
    row("paged KV cache", "f32", ttft, rest, &want);
    drop(f32b);
    let mut int8 = CpuBackend::new(model, params.clone(), CpuOptions { weights: LinearFormat::Int8, ..opts })?;
    let (got, ttft, rest) = paged(&mut int8, &prompt, o.new)?;
    row("paged KV cache", "int8", ttft, rest, &got);
    if o.recompute {
        let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
        let (got, secs) = recompute(&model, &params, &prompt, o.new);
        println!(
            "| recompute the window (before) | f32 | – | – | – | {:.1} | {} of {} |",
            o.new as f64 / secs,
            got.iter().zip(&want).take_while(|(a, b)| a == b).count(),
            want.len()
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
    let int8 = model.quantize_int8(&params);
    println!(
        "checkpoint {} ({}, {} parameters), {} windows of {t} tokens of the validation split of {}",
        dir.display(),
        ck.model,
        model.num_params(),
        windows.len(),
        ds.source
    );
    let (mb, f32_mb) = (int8.bytes() as f64 / 1e6, 4.0 * int8.numel() as f64 / 1e6);
    println!("int8: the linear layers' {} weights in {mb:.1} MB ({f32_mb:.1} MB as f32)", int8.numel());
    let (mut ce_loss, mut ce_f32, mut ce_int8) = (0f64, 0f64, 0f64);
    let mut ws = Workspace::default();
    for w in &windows {
        let (x, y) = (&w[..t], &w[1..]);
        let mut acc = tessera_kernels::model::FlatAccess { params: &params, grads: &mut [], units: model.units() };
        ce_loss += f64::from(model.loss(&mut acc, x, y, 1, t, &mut ws));
        for (q, sum) in [(None, &mut ce_f32), (Some(&int8), &mut ce_int8)] {
            let mut cache = KvCache::new(&model.cfg, t.div_ceil(BLOCK_SIZE), BLOCK_SIZE).map_err(anyhow::Error::msg)?;
            let table: Vec<u32> = (0..cache.num_blocks() as u32).collect();
            let seqs = [PagedSeq { rows: 0..t, start: 0, table: &table }];
            let rows: Vec<usize> = (0..t).collect();
            let logits = model.forward_paged(&params, q, &mut cache, x, &seqs, &rows, &mut PagedWorkspace::default());
            *sum += mean_ce(&logits, y, model.cfg.vocab_size);
        }
    }
    let n = windows.len() as f64;
    println!("| linears | path | mean cross-entropy (nats) | perplexity |");
    println!("|---|---|---|---|");
    for (lin, path, ce) in [
        ("f32", "Model::loss (training forward)", ce_loss / n),
        ("f32", "paged KV cache", ce_f32 / n),
        ("int8", "paged KV cache", ce_int8 / n),
    ] {
        println!("| {lin} | {path} | {ce:.5} | {:.4} |", ce.exp());
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
