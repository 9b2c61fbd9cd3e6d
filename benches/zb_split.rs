//! The zero-bubble split of a stage's backward (issue 30, kernels half): time and memory of the
//! input-gradient pass `B` (`Model::stage_backward_input`) and the deferred weight pass `W`
//! (`Model::stage_backward_weight`) against the fused `Model::stage_backward` they replace, in
//! the same invocation, on one stage holding every block and the head (the last stage of a
//! one-stage pipeline: the head's `W` included).
//!
//! `cargo bench --bench zb_split [-- --quick]`
//!
//! Each repetition runs the stage's forward, then either the fused backward or `B` then `W`
//! (alternating, fresh gradients each time); the table shows the median of the repetitions.
//! The stash is what `B` keeps for `W` (`WStash::bytes`); the workspace is the forward's
//! activations (`Workspace::bytes`, after the backward; with the split, the recycled stash's
//! buffers waiting for the next `B` too). After the first split repetition, `B` copies into the
//! previous stash's recycled buffers (`Workspace::recycle`), as a steady pipeline would.

use std::time::Instant;

use anyhow::{bail, Result};
use tessera::zoo::preset;
use tessera_kernels::model::{FlatAccess, MicroBatch, Model, ModelConfig, StageSpan, Workspace};

/// One benchmarked shape: a preset with the vocabulary (and for LLaMA the width) changed.
struct Case {
    name: &'static str,
    cfg: ModelConfig,
    batch: usize,
    seq_len: usize,
}

fn cases() -> Result<Vec<Case>> {
    let gpt = preset("gpt-10m").map_err(anyhow::Error::msg)?;
    let llama_tiny = preset("llama-tiny").map_err(anyhow::Error::msg)?;
    // train_step's llama-10m: gpt-10m's depth, width and context with GQA and SwiGLU.
    let llama =
        ModelConfig { n_layer: 6, n_head: 6, n_kv_head: 2, d_model: 384, d_ff: 1024, max_seq_len: 256, vocab_size: 256, ..llama_tiny };
    Ok(vec![
        Case { name: "gpt-10m", cfg: gpt.clone(), batch: 4, seq_len: 256 },
        Case { name: "gpt-10m, vocab 8192", cfg: ModelConfig { vocab_size: 8192, ..gpt }, batch: 4, seq_len: 256 },
        Case { name: "llama-10m", cfg: llama, batch: 4, seq_len: 256 },
    ])
}

/// Medians over the repetitions, milliseconds; bytes of the last repetition.
struct Row {
    fused_ms: f64,
    b_ms: f64,
    w_ms: f64,
    stash_bytes: usize,
    ws_bytes: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(case: &Case, reps: usize) -> Result<Row> {
    let model = Model::new(case.cfg.clone()).map_err(anyhow::Error::msg)?;
    let params = model.init_params(1);
    let (b, t) = (case.batch, case.seq_len);
    let tokens: Vec<u32> = (0..b * t).map(|i| (i * 7919 % case.cfg.vocab_size) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 104_729 % case.cfg.vocab_size) as u32).collect();
    let batch = MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 0 };
    let span = StageSpan::whole(&model);
    let mut ws = Workspace::default();
    let (mut fused, mut bs, mut wps) = (Vec::new(), Vec::new(), Vec::new());
    let (mut want, mut stash_bytes) = (Vec::new(), 0);
    for rep in 0..2 * reps {
        let mut grads = vec![0.0; params.len()];
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
        model.stage_forward(&mut acc, &span, batch, None, &mut ws);
        if rep % 2 == 0 {
            let start = Instant::now();
            model.stage_backward(&mut acc, &span, batch, None, 1.0, &mut ws);
            fused.push(start.elapsed().as_secs_f64() * 1e3);
        } else {
            let start = Instant::now();
            let (_, stash) = model.stage_backward_input(&mut acc, &span, batch, None, 1.0, &mut ws);
            bs.push(start.elapsed().as_secs_f64() * 1e3);
            stash_bytes = stash.bytes();
            let start = Instant::now();
            let spent = model.stage_backward_weight(&mut acc, stash);
            wps.push(start.elapsed().as_secs_f64() * 1e3);
            // As a steady pipeline does: the next B copies into this stash's memory.
            ws.recycle(spent);
        }
        // Both ways give the same gradients (the tests check every family and cut; here the
        // benchmarked shapes).
        let bits: Vec<u32> = grads.iter().map(|g| g.to_bits()).collect();
        if want.is_empty() {
            want = bits;
        } else if bits != want {
            bail!("{}: the split backward's gradients differ from the fused one's", case.name);
        }
    }
    Ok(Row { fused_ms: median(fused), b_ms: median(bs), w_ms: median(wps), stash_bytes, ws_bytes: ws.bytes() })
}

fn main() -> Result<()> {
    let mut quick = false;
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--bench" => {}
            "--quick" => quick = true,
            other => bail!("unknown argument `{other}`; expected --quick"),
        }
    }
    let reps = if quick { 1 } else { 5 };
    println!("zb_split bench: {} threads, median of {reps} repetitions each way", rayon::current_num_threads());
    println!();
    println!("| model | tokens | fused backward ms | B ms | W ms | B + W ms | B + W vs fused | stash MiB | workspace MiB |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for case in cases()? {
        let r = bench(&case, reps)?;
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let split = r.b_ms + r.w_ms;
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1} % | {:.1} | {:.1} |",
            case.name,
            case.batch * case.seq_len,
            r.fused_ms,
            r.b_ms,
            r.w_ms,
            split,
            100.0 * (split / r.fused_ms - 1.0),
            mib(r.stash_bytes),
            mib(r.ws_bytes),
        );
    }
    println!();
    println!("One stage with every block and the head; B = stage_backward_input, W = stage_backward_weight.");
    Ok(())
}
