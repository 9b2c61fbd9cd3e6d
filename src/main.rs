//! The `tessera` command line: a thin layer over the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use tessera::cli;
use tessera::engine::TrainOptions;

#[derive(Parser)]
#[command(name = "tessera", version, about = "Elastic, deterministic distributed training, configured by DeepSpeed JSON")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model as the config says.
    Train(TrainArgs),
    /// Sample text from a checkpoint.
    Generate(GenerateArgs),
    /// Write a checkpoint as Hugging Face GPT-2 safetensors + config.json.
    Export(ExportArgs),
    /// Inspect configs.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// List the model presets.
    Models,
    /// The GPU path: correctness checks and throughput benchmarks (needs NVIDIA GPUs).
    #[command(subcommand)]
    Gpu(GpuCmd),
    /// One rank of `train --nprocs` (started by the parent process, not by hand).
    #[command(hide = true)]
    Worker(WorkerArgs),
}

#[derive(Args)]
struct WorkerArgs {
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    world: usize,
    /// The parent's control address (127.0.0.1:PORT).
    #[arg(long)]
    control: std::net::SocketAddr,
    /// The run's `procs` directory (resolved config and certificates).
    #[arg(long)]
    dir: PathBuf,
}

#[derive(Args)]
struct TrainArgs {
    /// DeepSpeed JSON config.
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    common: cli::CommonArgs,
    /// Continue from this checkpoint (a step directory or a checkpoints root).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Prepare step N, abandon it, and run it again (exercises the step transaction; the result
    /// must be unchanged). Repeatable.
    #[arg(long = "abandon-step", value_name = "N")]
    abandon_steps: Vec<u64>,
    /// Run N worker processes on this machine whose ranks exchange tensors over QUIC with
    /// mutual TLS (sets the world size to N).
    #[arg(long, value_name = "N", conflicts_with = "world")]
    nprocs: Option<usize>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (a step directory or a checkpoints root).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "It is a truth universally acknowledged")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample from the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// The tokenizer.json the model was trained with (byte-level if absent).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

#[derive(Args)]
struct ExportArgs {
    /// Checkpoint directory (a step directory or a checkpoints root).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output directory for model.safetensors and config.json.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Subcommand)]
enum GpuCmd {
    /// Every CUDA kernel and the whole GPT model against the CPU reference, on fresh random inputs.
    Check {
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// GPT-2 training throughput: one process per GPU, NCCL, ZeRO 0–3 (synthetic tokens, bf16).
    Bench(tessera::gpu::BenchArgs),
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Print the resolved config and which keys Tessera honours.
    Check {
        file: PathBuf,
        #[command(flatten)]
        common: cli::CommonArgs,
    },
}

/// Exit status of a run that Ctrl-C stopped (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;

fn run(cli: Cli) -> Result<ExitCode> {
    let done = ExitCode::SUCCESS;
    match cli.cmd {
        Cmd::Train(mut a) => {
            let processes = a.nprocs.is_some();
            if let Some(n) = a.nprocs {
                anyhow::ensure!(n >= 1, "--nprocs must be at least 1");
                a.common.world = Some(n);
            }
            let opts = TrainOptions { resume: a.resume, progress: !a.no_progress, abandon_steps: a.abandon_steps, processes };
            let finished = cli::train(&a.config, &a.common, opts)?;
            Ok(if finished { done } else { ExitCode::from(EXIT_INTERRUPTED) })
        }
        Cmd::Generate(a) => cli::generate(&cli::GenerateOpts {
            checkpoint: a.checkpoint,
            prompt: a.prompt,
            tokens: a.tokens,
            temperature: a.temperature,
            top_k: a.top_k,
            seed: a.seed,
            tokenizer: a.tokenizer,
        })
        .map(|()| done),
        Cmd::Export(a) => cli::export(&a.checkpoint, &a.out).map(|()| done),
        Cmd::Config(ConfigCmd::Check { file, common }) => cli::config_check(&file, &common).map(|()| done),
        Cmd::Models => {
            cli::list_models();
            Ok(done)
        }
        Cmd::Gpu(GpuCmd::Check { seed }) => Ok(if tessera::gpu::check(seed)? { done } else { ExitCode::FAILURE }),
        Cmd::Gpu(GpuCmd::Bench(a)) => tessera::gpu::bench(&a).map(|()| done),
        Cmd::Worker(a) => {
            let args = tessera::engine::WorkerArgs { rank: a.rank, world: a.world, control: a.control, dir: a.dir };
            tessera::engine::run_worker(&args).map(|()| done)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
