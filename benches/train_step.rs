//! Training-step benchmark (issues 2, 28): tokens/s and the share of this machine's measured
//! f32 GEMM FLOP/s that one AdamW training step reaches on CPU, for two GPT-2 shapes (`gpt-tiny`,
//! `gpt-10m`) and two LLaMA shapes (`llama-tiny`, and `llama-10m`: `gpt-10m`'s width, depth and
//! context with grouped-query attention and SwiGLU), with PyTorch on CPU
//! (`scripts/bench_torch_cpu.py`) measured on the same shapes in the same run.
//!
//! `cargo bench --bench train_step [-- --quick] [-- --no-torch] [-- --models gpt-tiny,llama-10m,...]`
//!
//! A step is what the engine does per optimizer step with one micro-batch: zero the gradients,
//! `Model::forward_backward`, the global gradient norm and clipping, `OptimizerShard::step`.
//! Achieved FLOP/s use `ModelConfig::flops_per_token` (6·N + 12·L·d·T per token; for LLaMA N
//! holds SwiGLU's three matrices and the narrower grouped k/v, and the attention term is the
//! same because every query head still attends over T keys of its head dimension).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tessera_kernels::gemm::gemm_peak_flops;
use tessera_kernels::model::{Arch, FlatAccess, MicroBatch, Model, ModelConfig, Workspace};
use tessera_kernels::optim::{
    clip_coefficient, global_grad_norm, AdamParams, FlatLayout, LocalReduce, OptimizerKind, OptimizerShard, StepContext,
};
use tessera_kernels::tensor::Rng;

/// Side of the square GEMM whose throughput is the yardstick.
const PEAK_N: usize = 2048;
const VOCAB: usize = 256;
const CLIP_NORM: f64 = 1.0;

/// One benchmarked shape: a preset (`resize: None`), or a preset with other dimensions.
#[derive(Clone, Debug)]
struct Case {
    model: &'static str,
    batch: usize,
    seq_len: usize,
    resize: Option<Resize>,
}

/// The dimensions a case replaces in the preset `base` (the rest, e.g. RoPE θ, norm ε, a tied
/// head, stay the preset's).
#[derive(Clone, Copy, Debug)]
struct Resize {
    base: &'static str,
    n_layer: usize,
    n_head: usize,
    n_kv_head: usize,
    d_model: usize,
    d_ff: usize,
    max_seq_len: usize,
}

#[derive(Debug)]
struct Opts {
    quick: bool,
    torch: bool,
    cases: Vec<Case>,
}

/// Per-step milliseconds: whole step and its parts (forward, backward, optimizer incl. norm).
#[derive(Clone, Copy, Debug, Default)]
struct StepMs {
    step: f64,
    fwd: f64,
    bwd: f64,
    opt: f64,
}

/// One row of the result table.
#[derive(Debug)]
struct Row {
    system: String,
    case: Case,
    threads: usize,
    ms: StepMs,
    flops_per_token: f64,
}

impl Row {
    fn tokens_per_s(&self) -> f64 {
        (self.case.batch * self.case.seq_len) as f64 / (self.ms.step / 1e3)
    }
    fn flops(&self) -> f64 {
        self.tokens_per_s() * self.flops_per_token
    }
}

/// Every case, in the order they run; each is 1024 tokens a step.
fn all_cases() -> Vec<Case> {
    let preset = |model, batch, seq_len| Case { model, batch, seq_len, resize: None };
    // gpt-10m's 6 layers of width 384 and context 256, with 2 key/value heads for the 6 query
    // heads and SwiGLU's 8/3 width (1024): ~9.5M parameters.
    let llama_10m = Resize { base: "llama-tiny", n_layer: 6, n_head: 6, n_kv_head: 2, d_model: 384, d_ff: 1024, max_seq_len: 256 };
    vec![
        preset("gpt-tiny", 8, 128),
        preset("gpt-10m", 4, 256),
        preset("llama-tiny", 8, 128),
        Case { model: "llama-10m", batch: 4, seq_len: 256, resize: Some(llama_10m) },
    ]
}

/// The cases named in the comma-separated `list`, in [`all_cases`]' order; an unknown name is
/// an error listing the valid ones.
fn select_cases(list: &str) -> Result<Vec<Case>> {
    let all = all_cases();
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(bad) = names.iter().find(|n| !all.iter().any(|c| c.model == **n)) {
        let valid: Vec<&str> = all.iter().map(|c| c.model).collect();
        bail!("--models {list}: unknown model `{bad}`; expected a comma-separated list of: {}", valid.join(", "));
    }
    Ok(all.into_iter().filter(|c| names.contains(&c.model)).collect())
}

/// `cargo bench` passes `--bench`; everything unknown is an error so typos do not go unnoticed.
fn parse_args() -> Result<Opts> {
    let mut opts = Opts { quick: false, torch: true, cases: all_cases() };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--quick" => opts.quick = true,
            "--no-torch" => opts.torch = false,
            "--models" => {
                let list = args.next().context("--models needs a comma-separated list")?;
                opts.cases = select_cases(&list)?;
            }
            other => bail!("unknown argument `{other}`; expected --quick, --no-torch, --models LIST"),
        }
    }
    Ok(opts)
}

/// (warm-up, timed) step counts.
fn step_counts(case: &Case, quick: bool) -> (usize, usize) {
    match (quick, case.model) {
        (true, _) => (1, 3),
        (false, "gpt-tiny" | "llama-tiny") => (3, 20),
        (false, _) => (2, 10),
    }
}

/// The case's model shape: its preset (or its resize's base, resized), byte vocabulary.
fn model_config(case: &Case) -> Result<ModelConfig> {
    let base = case.resize.map_or(case.model, |r| r.base);
    let mut cfg = tessera::zoo::preset(base).map_err(anyhow::Error::msg)?;
    if let Some(r) = case.resize {
        (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_model) = (r.n_layer, r.n_head, r.n_kv_head, r.d_model);
        (cfg.d_ff, cfg.max_seq_len) = (r.d_ff, r.max_seq_len);
    }
    cfg.vocab_size = VOCAB;
    Ok(cfg)
}

fn build_model(case: &Case) -> Result<Model> {
    let cfg = model_config(case)?;
    if case.seq_len > cfg.max_seq_len {
        bail!("{}: seq_len {} exceeds the context {}", case.model, case.seq_len, cfg.max_seq_len);
    }
    Model::new(cfg).map_err(anyhow::Error::msg)
}

/// Random byte tokens; targets are the inputs shifted by one, as in language modelling.
fn batch_tokens(case: &Case, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let n = case.batch * case.seq_len;
    let stream: Vec<u32> = (0..=n).map(|_| rng.gen_range(VOCAB as u64) as u32).collect();
    (stream[..n].to_vec(), stream[1..].to_vec())
}

/// Median of `xs` (mean of the middle two for an even count).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => xs[n / 2],
        _ => 0.5 * (xs[n / 2 - 1] + xs[n / 2]),
    }
}

/// Per-step samples of [`StepMs`]'s fields, reduced by [`median`].
#[derive(Default)]
struct Samples {
    step: Vec<f64>,
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    opt: Vec<f64>,
}

impl Samples {
    fn medians(self) -> StepMs {
        StepMs { step: median(self.step), fwd: median(self.fwd), bwd: median(self.bwd), opt: median(self.opt) }
    }
}

/// Everything one step of our trainer needs, built like the engine builds it.
struct Trainer {
    model: Model,
    flat: FlatLayout,
    decay: Vec<bool>,
    adam: AdamParams,
    optim: OptimizerShard,
    params: Vec<f32>,
    grads: Vec<f32>,
    ws: Workspace,
}

impl Trainer {
    fn new(case: &Case) -> Result<Self> {
        let model = build_model(case)?;
        let flat = FlatLayout::new(model.layout().segments()).context("parameter layout")?;
        let adam = AdamParams { lr: 3e-4, betas: (0.9, 0.95), weight_decay: 0.1, ..AdamParams::default() };
        let n = model.num_params();
        Ok(Trainer {
            decay: model.layout().decay_flags(),
            optim: OptimizerShard::new(OptimizerKind::Adam(adam), n),
            params: model.init_params(1234),
            grads: vec![0f32; n],
            ws: Workspace::default(),
            model,
            flat,
            adam,
        })
    }

    /// Zero grads + forward_backward; returns the loss.
    fn forward_backward(&mut self, tokens: &[u32], targets: &[u32], b: usize, t: usize) -> f32 {
        self.grads.fill(0.0);
        let mut acc = FlatAccess { params: &self.params, grads: &mut self.grads, units: self.model.units() };
        self.model.forward_backward(&mut acc, MicroBatch { tokens, targets, b, t, noise_key: 0 }, 1.0, &mut self.ws)
    }

    /// Global gradient norm, clipping, AdamW.
    fn optimizer_step(&mut self) -> Result<()> {
        let norm = global_grad_norm(&self.flat, &self.grads, 0..self.grads.len(), &mut LocalReduce).context("gradient norm")?;
        if let Some(coef) = clip_coefficient(norm, CLIP_NORM) {
            self.grads.iter_mut().for_each(|g| *g *= coef);
        }
        let ctx = StepContext { shard_range: 0..self.params.len(), layout: &self.flat, decay: &self.decay };
        self.optim.step(&mut self.params, &self.grads, self.adam.lr, &ctx, &mut LocalReduce).context("optimizer step")?;
        Ok(())
    }

    /// Forward + loss only.
    fn forward(&mut self, tokens: &[u32], targets: &[u32], b: usize, t: usize) -> f32 {
        let mut acc = FlatAccess { params: &self.params, grads: &mut [], units: self.model.units() };
        self.model.loss(&mut acc, tokens, targets, b, t, &mut self.ws)
    }
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// Runs warm-up + timed steps of our trainer's step on `case`; returns the median times and
/// the model's training FLOPs per token.
fn bench_ours(case: &Case, quick: bool) -> Result<(StepMs, f64)> {
    let mut tr = Trainer::new(case)?;
    let (warm, timed) = step_counts(case, quick);
    let (tokens, targets) = batch_tokens(case, 7);
    let (b, t) = (case.batch, case.seq_len);
    let mut s = Samples::default();
    for i in 0..warm + timed {
        let t0 = Instant::now();
        let loss = tr.forward_backward(&tokens, &targets, b, t);
        let fb_ms = ms_since(t0);
        let t1 = Instant::now();
        tr.optimizer_step()?;
        let opt_ms = ms_since(t1);
        if !loss.is_finite() {
            bail!("{}: loss became {loss} at step {i}", case.model);
        }
        // Forward alone (outside the step's time) splits forward_backward into its halves.
        let t2 = Instant::now();
        tr.forward(&tokens, &targets, b, t);
        let fwd_ms = ms_since(t2);
        if i >= warm {
            s.step.push(fb_ms + opt_ms);
            s.fwd.push(fwd_ms);
            s.bwd.push(fb_ms - fwd_ms);
            s.opt.push(opt_ms);
        }
    }
    Ok((s.medians(), tr.model.cfg.flops_per_token(tr.model.num_params(), t)))
}

/// Runs the PyTorch peer on the same shape; `Ok(None)` (with the reason printed) when python3
/// or torch is unavailable.
fn bench_torch(case: &Case, quick: bool, threads: usize, num_params: usize) -> Result<Option<StepMs>> {
    let model = build_model(case)?;
    let c = &model.cfg;
    // The checkout's script when run from its root (also a copied binary), else the built one's.
    let local = Path::new("scripts/bench_torch_cpu.py");
    let script = if local.is_file() { local.to_path_buf() } else { Path::new(env!("CARGO_MANIFEST_DIR")).join(local) };
    let (warm, timed) = step_counts(case, quick);
    let mut args: Vec<String> = [
        ("--model", case.model.to_string()),
        ("--vocab", c.vocab_size.to_string()),
        ("--max-seq", c.max_seq_len.to_string()),
        ("--n-layer", c.n_layer.to_string()),
        ("--n-head", c.n_head.to_string()),
        ("--d-model", c.d_model.to_string()),
        ("--batch", case.batch.to_string()),
        ("--seq", case.seq_len.to_string()),
        ("--warmup", warm.to_string()),
        ("--steps", timed.to_string()),
        ("--threads", threads.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    args.extend(arch_args(c)?);
    let out = match Command::new("python3").arg(&script).args(&args).output() {
        Ok(out) => out,
        Err(e) => {
            println!("  pytorch peer skipped: cannot run python3 ({e})");
            return Ok(None);
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    // A missing torch is a skip the script reports; a peer that fails is an error, not a skip.
    let Some(line) = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')) else {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{} failed ({}): {}", script.display(), out.status, err.lines().last().unwrap_or("no output"));
    };
    let v: Value = serde_json::from_str(line).with_context(|| format!("parsing the peer's JSON line `{line}`"))?;
    if let Some(reason) = v.get("skipped").and_then(Value::as_str) {
        println!("  pytorch peer skipped: {reason}");
        return Ok(None);
    }
    let num = |key: &str| v.get(key).and_then(Value::as_f64).with_context(|| format!("peer JSON lacks number `{key}`: {line}"));
    let peer_params = num("num_params")? as usize;
    if peer_params != num_params {
        bail!("the PyTorch model has {peer_params} parameters, ours {num_params}: the architectures differ");
    }
    Ok(Some(StepMs { step: num("step_ms")?, fwd: num("fwd_ms")?, bwd: num("bwd_ms")?, opt: num("opt_ms")? }))
}

/// The peer's arguments for the block design: `--arch gpt`, or `--arch llama` and its options.
fn arch_args(c: &ModelConfig) -> Result<Vec<String>> {
    if c.arch == Arch::Gpt {
        return Ok(vec!["--arch".into(), "gpt".into()]);
    }
    if c.qkv_bias || c.rope_scaling.is_some() {
        bail!("the PyTorch peer's LLaMA has no q/k/v bias and no RoPE scaling: qkv_bias {}, rope_scaling {:?}", c.qkv_bias, c.rope_scaling);
    }
    let head = if c.tied_head { "--tie" } else { "--no-tie" };
    let pairs = [
        ("--arch", "llama".to_string()),
        ("--n-kv-head", c.n_kv_head.to_string()),
        ("--d-ff", c.d_ff.to_string()),
        ("--rope-theta", c.rope_theta.to_string()),
        ("--norm-eps", c.norm_eps.to_string()),
    ];
    Ok(pairs.into_iter().flat_map(|(k, v)| [k.to_string(), v]).chain([head.to_string()]).collect())
}

fn print_table(rows: &[Row], peak_flops: f64) {
    println!();
    println!(
        "| {:<8} | {:<10} | {:>9} | {:>3} | {:>8} | {:>9} | {:>7} | {:>6} | {:>15} |",
        "system", "model", "batch×seq", "thr", "step ms", "tokens/s", "TFLOP/s", "% peak", "fwd/bwd/opt ms"
    );
    println!("|{}|", ["----------"; 9].join("|"));
    for r in rows {
        let split = format!("{:.1}/{:.1}/{:.1}", r.ms.fwd, r.ms.bwd, r.ms.opt);
        println!(
            "| {:<8} | {:<10} | {:>9} | {:>3} | {:>8.1} | {:>9.0} | {:>7.3} | {:>5.1}% | {:>15} |",
            r.system,
            r.case.model,
            format!("{}×{}", r.case.batch, r.case.seq_len),
            r.threads,
            r.ms.step,
            r.tokens_per_s(),
            r.flops() / 1e12,
            100.0 * r.flops() / peak_flops,
            split
        );
    }
}

fn main() -> Result<()> {
    let opts = parse_args()?;
    let threads = rayon::current_num_threads();
    let peak = gemm_peak_flops(PEAK_N, if opts.quick { 2 } else { 5 });
    println!("train_step bench: {threads} threads; f32 GEMM peak ({PEAK_N}³, best of runs) = {:.3} TFLOP/s", peak / 1e12);
    let mut rows = Vec::new();
    for case in &opts.cases {
        println!("running {} (batch {} × seq {}) ...", case.model, case.batch, case.seq_len);
        let (ms, fpt) = bench_ours(case, opts.quick)?;
        rows.push(Row { system: "tessera".into(), case: case.clone(), threads, ms, flops_per_token: fpt });
        if opts.torch {
            let num_params = build_model(case)?.num_params();
            if let Some(ms) = bench_torch(case, opts.quick, threads, num_params)? {
                rows.push(Row { system: "pytorch".into(), case: case.clone(), threads, ms, flops_per_token: fpt });
            }
        }
    }
    print_table(&rows, peak);
    println!("\nFLOP/s = tokens/s × (6·N + 12·L·d·T); % peak is of the measured GEMM peak above.");
    println!("fwd = forward+loss, bwd = backward, opt = grad norm + clip + AdamW.");
    Ok(())
}
