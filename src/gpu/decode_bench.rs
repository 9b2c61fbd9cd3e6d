//! `tessera gpu decode-bench`: greedy generation throughput of [`GpuBackend`] — every sequence's
//! prompt in one prefill step, then one decode step per new token (CUDA graphs) — for each batch
//! size, and the Hugging Face `generate` peer (`scripts/peers/generate_hf.py`) on the same shape
//! in the same call. Prints one JSON line per row as it is measured, then a table.
//!
//! Counting follows the peer: the time from the prompts to the last new token (prefill
//! included), new tokens = batch × `--new`, "ms a step" = that time / `--new`.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_kernels::cuda::decode::{DecodeOptions, WeightFormat};
use tessera_kernels::model::{Arch, Model, ModelConfig};
use tessera_kernels::tensor::Rng;

use crate::infer::{Backend, GpuBackend, SeqStep};
use crate::zoo::{self, ModelSource};

#[derive(Args, Debug, Clone)]
pub struct DecodeBenchArgs {
    /// A preset name or a Hugging Face folder (its weights when it has them, else seeded ones).
    #[arg(long, default_value = "gpt2-small")]
    pub model: String,
    /// Vocabulary size (overrides the model's; the peer's default is 50304).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Weight formats of the blocks' linear layers to measure, comma-separated (bf16, int8, fp8).
    #[arg(long, default_value = "bf16")]
    pub weights: String,
    /// Batch sizes, comma-separated.
    #[arg(long, default_value = "1,32")]
    pub batch: String,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub new: usize,
    /// Positions per cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of the prompts (and of the parameters when the model has no weights).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Timed generations per batch size (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The peer script; run with `python3` on the same shape (static cache + torch.compile).
    #[arg(long, default_value = "scripts/peers/generate_hf.py")]
    pub peer: String,
    /// Skip the peer.
    #[arg(long)]
    pub no_peer: bool,
    /// After the timed runs, time one decode step's kernels (run one by one, not as a graph)
    /// and print where its time goes (to stderr).
    #[arg(long)]
    pub profile: bool,
}

/// One measured row.
struct Row {
    system: String,
    /// For a quantized format: the prefill logits' rms error relative to bf16's, and the share of
    /// sequences whose first greedy token agrees.
    quality: Option<(f64, f64)>,
    batch: usize,
    seconds: f64,
    tok_s: f64,
    ms_step: f64,
}

/// `tessera gpu decode-bench`.
pub fn run(a: &DecodeBenchArgs) -> Result<()> {
    let batches: Vec<usize> = a
        .batch
        .split(',')
        .map(|b| b.trim().parse::<usize>().ok().filter(|&b| b > 0))
        .collect::<Option<_>>()
        .with_context(|| format!("--batch {}: expected positive batch sizes separated by commas, e.g. 1,32", a.batch))?;
    if a.prompt == 0 || a.new == 0 {
        bail!("--prompt {} --new {}: both must be positive", a.prompt, a.new);
    }
    let formats: Vec<WeightFormat> = a
        .weights
        .split(',')
        .map(|w| w.trim().parse::<WeightFormat>())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("--weights {}: {e}", a.weights))?;
    let (model, params) = load(a)?;
    let cfg = model.cfg.clone();
    if a.prompt + a.new > cfg.max_seq_len {
        bail!("--prompt {} + --new {} exceeds the model's context of {}", a.prompt, a.new, cfg.max_seq_len);
    }
    let mut rows = Vec::new();
    for &b in &batches {
        let mut bf16_logits = None;
        for &fmt in &formats {
            let (row, logits) = ours(a, &model, &params, b, fmt, bf16_logits.as_ref())?;
            println!("{}", json(a, &row));
            rows.push(row);
            if fmt == WeightFormat::Bf16 {
                bf16_logits = Some(logits);
            }
        }
    }
    drop(params);
    if !a.no_peer {
        rows.extend(peer(a, &cfg, &batches)?);
    }
    print_table(a, &cfg, model.num_params(), &rows);
    Ok(())
}

fn load(a: &DecodeBenchArgs) -> Result<(Model, Vec<f32>)> {
    let src = zoo::resolve(&a.model).map_err(anyhow::Error::msg).with_context(|| format!("--model {}", a.model))?;
    let mut cfg: ModelConfig = src.config().clone();
    let weights = match &src {
        ModelSource::Folder(f) => f.weights.clone().map(|w| (w, f.config.family)),
        ModelSource::Preset(_) => None,
    };
    if let Some(v) = a.vocab {
        if weights.is_some() && v != cfg.vocab_size {
            bail!("--vocab {v}: the folder's weights have a vocabulary of {}", cfg.vocab_size);
        }
        cfg.vocab_size = v;
    }
    let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
    let params = match weights {
        Some((w, family)) => crate::hf::read_params(&w, family, &model)?,
        None => model.init_params(a.seed),
    };
    Ok((model, params))
}

/// Greedy generation at batch `b` with the linear layers in `fmt`: one warm-up (captures the
/// graphs), then `repeats` timed runs. Also returns the prompts' logits (for the quality column of
/// the quantized formats, measured against `bf16`'s).
fn ours(
    a: &DecodeBenchArgs,
    model: &Model,
    params: &[f32],
    b: usize,
    fmt: WeightFormat,
    bf16: Option<&Vec<Vec<f32>>>,
) -> Result<(Row, Vec<Vec<f32>>)> {
    let per_seq = (a.prompt + a.new).div_ceil(a.block_size);
    let opts = DecodeOptions {
        num_blocks: b * per_seq,
        block_size: a.block_size,
        max_tokens: b * a.prompt,
        max_seqs: b,
        graph_max: b,
        weights: fmt,
    };
    let mut be = GpuBackend::new(0, model, params, opts)?;
    let (wb, kvb, wsb) = be.decoder().bytes();
    eprintln!(
        "batch {b}: parameters {:.2} GiB, cache {:.2} GiB, workspace {:.2} GiB on {}",
        gib(wb),
        gib(kvb),
        gib(wsb),
        be.decoder().gpu.name
    );
    let mut rng = Rng::derive(a.seed, &[b as u64]);
    let prompts: Vec<Vec<u32>> =
        (0..b).map(|_| (0..a.prompt).map(|_| rng.gen_range(model.cfg.vocab_size as u64) as u32).collect()).collect();
    let tables: Vec<Vec<u32>> = (0..b).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
    let mut times = Vec::new();
    let mut first: Option<Vec<Vec<u32>>> = None;
    for r in 0..=a.repeats {
        let t = Instant::now();
        let out = generate(&mut be, &prompts, &tables, a.new)?;
        let s = t.elapsed().as_secs_f64();
        match &first {
            None => first = Some(out),
            Some(f) if *f != out => bail!("greedy generation {r} differs from the first at batch {b}: decoding is not deterministic"),
            Some(_) => times.push(s),
        }
    }
    if a.profile {
        let last: Vec<[u32; 1]> = prompts.iter().map(|p| [p[0]]).collect();
        let step: Vec<SeqStep> =
            last.iter().zip(&tables).map(|(l, t)| SeqStep { tokens: &l[..], start: a.prompt, block_table: t, want_logits: true }).collect();
        eprintln!("batch {b}: one decode step at position {}, kernel by kernel:", a.prompt);
        for (what, ms, count) in be.profile_step(&step)? {
            eprintln!("  {what:<32} {:>8.1} µs  ({count} launches)", ms * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let prefill: Vec<SeqStep> =
        prompts.iter().zip(&tables).map(|(p, t)| SeqStep { tokens: p, start: 0, block_table: t, want_logits: true }).collect();
    let logits = crate::infer::Backend::step(&mut be, &prefill)?;
    let quality = bf16.filter(|_| fmt != WeightFormat::Bf16).map(|r| quality(&logits, r));
    let system = format!("tessera GpuBackend ({fmt} linears, paged, CUDA graphs)");
    Ok((Row { system, quality, batch: b, seconds: med, tok_s: (b * a.new) as f64 / med, ms_step: med * 1e3 / a.new as f64 }, logits))
}

/// (rms(q − r) / rms(r), share of rows with the same argmax) over rows of logits.
fn quality(q: &[Vec<f32>], r: &[Vec<f32>]) -> (f64, f64) {
    let (mut d2, mut r2, mut same) = (0f64, 0f64, 0usize);
    let argmax =
        |v: &[f32]| v.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0;
    for (qr, rr) in q.iter().zip(r) {
        for (&x, &y) in qr.iter().zip(rr) {
            d2 += (x as f64 - y as f64).powi(2);
            r2 += (y as f64).powi(2);
        }
        same += usize::from(argmax(qr) == argmax(rr));
    }
    ((d2 / r2.max(1e-30)).sqrt(), same as f64 / q.len().max(1) as f64)
}

/// The prompts in one prefill step, then `new - 1` decode steps; returns every sequence's new
/// tokens.
fn generate(be: &mut GpuBackend, prompts: &[Vec<u32>], tables: &[Vec<u32>], new: usize) -> Result<Vec<Vec<u32>>> {
    let prefill: Vec<SeqStep> =
        prompts.iter().zip(tables).map(|(p, t)| SeqStep { tokens: p, start: 0, block_table: t, want_logits: true }).collect();
    let mut out: Vec<Vec<u32>> = be.step_greedy(&prefill)?.into_iter().map(|t| vec![t]).collect();
    for k in 1..new {
        let last: Vec<[u32; 1]> = out.iter().map(|o| [o[k - 1]]).collect();
        let step: Vec<SeqStep> = last
            .iter()
            .zip(prompts.iter().zip(tables))
            .map(|(l, (p, t))| SeqStep { tokens: &l[..], start: p.len() + k - 1, block_table: t, want_logits: true })
            .collect();
        for (o, t) in out.iter_mut().zip(be.step_greedy(&step)?) {
            o.push(t);
        }
    }
    Ok(out)
}

/// The peer on the same shape: `python3 PEER … --static 1`, its JSON lines.
fn peer(a: &DecodeBenchArgs, cfg: &ModelConfig, batches: &[usize]) -> Result<Vec<Row>> {
    let arch = match cfg.arch {
        Arch::Gpt => "gpt2",
        Arch::Llama => "llama",
    };
    let batch = batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
    let args = [
        ("--arch", arch.to_string()),
        ("--layers", cfg.n_layer.to_string()),
        ("--d", cfg.d_model.to_string()),
        ("--heads", cfg.n_head.to_string()),
        ("--kv-heads", cfg.n_kv_head.to_string()),
        ("--ffn", cfg.d_ff.to_string()),
        ("--vocab", cfg.vocab_size.to_string()),
        ("--batch", batch),
        ("--prompt", a.prompt.to_string()),
        ("--new", a.new.to_string()),
        ("--static", "1".to_string()),
    ];
    let mut cmd = Command::new("python3");
    cmd.arg(&a.peer);
    for (k, v) in &args {
        cmd.arg(k).arg(v);
    }
    eprintln!("peer: {cmd:?}");
    // Its lines are read as they come (a row measured before a time limit stops the peer stays).
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .with_context(|| format!("running the peer `python3 {}`", a.peer))?;
    let stdout = child.stdout.take().context("the peer's standard output")?;
    let mut rows = Vec::new();
    for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
        let line = line.context("reading the peer's output")?;
        if !line.starts_with('{') {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("the peer printed `{line}`: expected JSON"))?;
        let num = |k: &str| v[k].as_f64().with_context(|| format!("the peer's line `{line}` has no number `{k}`"));
        let row = Row {
            quality: None,
            system: format!("HF transformers {} generate, static cache + compile", v["transformers"].as_str().unwrap_or("?")),
            batch: num("batch")? as usize,
            seconds: num("s")?,
            tok_s: num("new_tok_per_s")?,
            ms_step: num("ms_per_step")?,
        };
        println!("{}", json(a, &row));
        rows.push(row);
    }
    let status = child.wait().context("waiting for the peer")?;
    if !status.success() {
        bail!("the peer `python3 {}` failed ({status}; its messages are above)", a.peer);
    }
    Ok(rows)
}

fn print_table(a: &DecodeBenchArgs, cfg: &ModelConfig, params: usize, rows: &[Row]) {
    println!(
        "\n{:?} {:.1}M params, {} layers, d {}, {} / {} heads, vocab {}; prompt {}, {} new tokens, greedy, bf16",
        cfg.arch,
        params as f64 / 1e6,
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.vocab_size,
        a.prompt,
        a.new
    );
    println!("| system | batch | s | new tokens/s | ms a step | vs peer | prompt logits vs bf16 (rms rel, same argmax) |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let peer = rows.iter().find(|p| p.batch == r.batch && p.system.starts_with("HF"));
        let vs = peer.map_or("".to_string(), |p| format!("{:.2}×", r.tok_s / p.tok_s));
        let q = r.quality.map_or("".to_string(), |(e, s)| format!("{e:.2e}, {:.0} %", s * 100.0));
        println!("| {} | {} | {:.3} | {:.0} | {:.3} | {vs} | {q} |", r.system, r.batch, r.seconds, r.tok_s, r.ms_step);
    }
}

/// One row as a JSON line (printed as soon as it is measured).
fn json(a: &DecodeBenchArgs, r: &Row) -> serde_json::Value {
    serde_json::json!({"system": r.system, "model": a.model, "batch": r.batch, "prompt": a.prompt, "new": a.new, "s": r.seconds,
        "new_tok_per_s": r.tok_s.round(), "ms_per_step": (r.ms_step * 1e3).round() / 1e3,
        "logits_rms_rel_vs_bf16": r.quality.map(|q| q.0), "same_argmax_vs_bf16": r.quality.map(|q| q.1)})
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}
