//! The `tessera` command line: a thin layer over the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use tessera::engine::TrainOptions;
use tessera::{cli, console, outln, signals};
use tessera_actors::faults::Faults;

#[derive(Parser)]
#[command(name = "tessera", version, about = "Elastic, deterministic distributed training, configured by DeepSpeed JSON")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// More log detail on standard error (-v: debug, -vv: trace); `RUST_LOG` wins when set.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only warnings and errors on standard error.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model as the config says.
    Train(TrainArgs),
    /// Sample text from a checkpoint or a Hugging Face model folder.
    Generate(GenerateArgs),
    /// Serve a model folder or checkpoint over HTTP with the OpenAI API (completions, chat,
    /// streaming), batching requests continuously.
    Serve(Box<ServeArgs>),
    /// One rank of `serve --pipeline-parallel-size N --rank-listen ADDR` on this host: join the
    /// server, hold the blocks it assigns and run them until it stops.
    ServeRank(ServeRankArgs),
    /// Load-test an OpenAI-compatible server: Poisson arrivals, random prompt and output
    /// lengths; prints throughput, time to first token and inter-token latency.
    BenchServe(BenchServeArgs),
    /// Write a checkpoint as a Hugging Face model folder (GPT-2, LLaMA, Mistral, Qwen2, Mixtral,
    /// Qwen2-MoE): safetensors, config.json, the tokenizer's files.
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
    /// Train with ranks on other hosts: wait for N `tessera agent`s to join, then run the
    /// training (as `train --nprocs N`, with the agents as the worker processes).
    Coordinator(CoordinatorArgs),
    /// One rank on this host: join a coordinator (`--join`, or torchrun/Slurm's MASTER_ADDR,
    /// MASTER_PORT, RANK, WORLD_SIZE) and train until it says stop.
    Agent(AgentCliArgs),
    /// Start agents on the hosts of a DeepSpeed hostfile (ssh; localhost directly) and
    /// coordinate them from here.
    Launch(Box<LaunchArgs>),
    /// Fault injection: run a training scenario fault-free and with faults, compare the bits.
    #[command(subcommand)]
    Chaos(ChaosCmd),
    /// Cluster certificates for runs whose agents bring their own (`--certs DIR`).
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Print a shell completion script for tessera to standard output, e.g.
    /// `tessera completions bash > ~/.local/share/bash-completion/completions/tessera`.
    Completions {
        /// The shell to write the script for.
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Make DIR: a cluster CA, the coordinator's certificate and node-0 .. node-(N-1), each with
    /// its key. Copy ca.pem and node-<r>.{pem,key} to the host of rank r, ca.pem and
    /// coordinator.{pem,key} to the coordinator's; ca.key signs nothing later and can be kept
    /// offline.
    Init {
        /// The directory to write the CA and certificates into (created if missing).
        dir: PathBuf,
        /// How many node certificates.
        #[arg(long)]
        nodes: usize,
    },
}

#[derive(Subcommand)]
enum ChaosCmd {
    /// Run a scenario (JSON: config, process count, faults) without and with its faults; exits
    /// non-zero unless both runs end with equal params_blake3.
    Run {
        /// The scenario file.
        #[arg(long)]
        scenario: PathBuf,
        /// Picks the ranks (and other choices) the scenario leaves "random".
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Where both runs and report.json go.
        #[arg(long, default_value = "runs/chaos")]
        output: PathBuf,
        /// Hide the progress bar.
        #[arg(long)]
        no_progress: bool,
    },
}

/// What `coordinator` and `launch` share with `train`.
#[derive(Args)]
struct DriverArgs {
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
    /// How long to wait for every agent to join (seconds).
    #[arg(long, value_name = "SECS", default_value_t = tessera::engine::JOIN_TIMEOUT_MS / 1000)]
    join_timeout: u64,
    /// A cluster directory made beforehand (`tessera cluster init`: the CA, the coordinator's
    /// and the node-<rank> certificates): agents present their own certificates.
    #[arg(long, value_name = "DIR")]
    certs: Option<PathBuf>,
    /// Write the agents' join token to this file (mode 0600) instead of printing it.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
}

impl DriverArgs {
    fn split(self, faults: Faults) -> (PathBuf, cli::CommonArgs, TrainOptions, tessera::launch::DriverOpts) {
        let opts = TrainOptions {
            resume: self.resume,
            progress: !self.no_progress,
            abandon_steps: Vec::new(),
            processes: true,
            worker_net: None,
            faults,
            rendezvous: Default::default(),
        };
        let d = tessera::launch::DriverOpts {
            join_timeout_ms: self.join_timeout.saturating_mul(1000),
            certs: self.certs,
            token_file: self.token_file,
        };
        (self.config, self.common, opts, d)
    }
}

#[derive(Args)]
struct CoordinatorArgs {
    #[command(flatten)]
    driver: DriverArgs,
    /// Where agents join, ADDR:PORT (default 0.0.0.0:$MASTER_PORT).
    #[arg(long)]
    listen: Option<String>,
    /// How many agents (the world size; default $WORLD_SIZE).
    #[arg(long)]
    nodes: Option<usize>,
}

#[derive(Args)]
struct AgentCliArgs {
    /// The coordinator, HOST:PORT (default $MASTER_ADDR:$MASTER_PORT).
    #[arg(long)]
    join: Option<String>,
    /// This agent's name in the coordinator's messages (default <hostname>-<pid>).
    #[arg(long)]
    name: Option<String>,
    /// Take this rank (default: $RANK or $SLURM_PROCID without --join, else any free rank).
    #[arg(long)]
    rank: Option<usize>,
    /// The IP the other ranks reach this agent at (default: the local address of the
    /// connection to the coordinator).
    #[arg(long)]
    advertise: Option<std::net::IpAddr>,
    /// The UDP port of this agent's QUIC socket (0 = any).
    #[arg(long, default_value_t = 0)]
    quic_port: u16,
    #[command(flatten)]
    proof: JoinProofArgs,
    /// (`tessera chaos run`) A worker-net file: this agent's QUIC traffic through the fault
    /// link it names (docs/ELASTIC.md).
    #[arg(long, value_name = "FILE", hide = true)]
    worker_net: Option<PathBuf>,
}

#[derive(Args)]
struct LaunchArgs {
    #[command(flatten)]
    driver: DriverArgs,
    /// DeepSpeed hostfile: `HOST slots=N` per line (default: this machine, with --num_gpus
    /// slots).
    #[arg(long, short = 'H')]
    hostfile: Option<PathBuf>,
    /// Only these hosts and slots, DeepSpeed's form: `HOST[:SLOT,SLOT]` joined by `@`, e.g.
    /// `worker-0:0,1@worker-1`.
    #[arg(long, short = 'i', value_name = "SPEC", conflicts_with = "exclude")]
    include: Option<String>,
    /// All but these hosts and slots (same form as --include).
    #[arg(long, short = 'e', value_name = "SPEC")]
    exclude: Option<String>,
    /// Only the first N hosts (after --include/--exclude).
    #[arg(long, alias = "num_nodes", value_name = "N")]
    num_nodes: Option<usize>,
    /// Only the first N slots of each host (after --include/--exclude); without --hostfile, N
    /// agents on this machine.
    #[arg(long, alias = "num_gpus", value_name = "N")]
    num_gpus: Option<usize>,
    /// Where agents join (default 127.0.0.1:0 when every host is local, else 0.0.0.0:0).
    #[arg(long)]
    listen: Option<String>,
    /// The address remote agents dial (default: this machine's address on the route to each).
    #[arg(long)]
    coordinator_addr: Option<std::net::IpAddr>,
    /// tessera's path on the remote hosts (default: this executable's path).
    #[arg(long)]
    remote_exe: Option<String>,
    /// The ssh program for remote hosts.
    #[arg(long, default_value = "ssh")]
    ssh: String,
    /// The port sshd listens on at every remote host (`ssh -p`; DeepSpeed's --ssh_port).
    #[arg(long, alias = "ssh_port", value_name = "PORT")]
    ssh_port: Option<u16>,
    /// The private key ssh logs in with (`ssh -i`).
    #[arg(long, value_name = "FILE")]
    ssh_identity: Option<PathBuf>,
    /// An ssh configuration file read instead of ~/.ssh/config (`ssh -F`).
    #[arg(long, value_name = "FILE")]
    ssh_config: Option<PathBuf>,
    /// An ssh option, KEY=VALUE (`ssh -o`; repeatable), e.g. User=ubuntu.
    #[arg(long, value_name = "KEY=VALUE")]
    ssh_option: Vec<String>,
}

#[derive(Args)]
struct WorkerArgs {
    /// This worker's rank (0-based).
    #[arg(long, required_unless_present = "join")]
    rank: Option<usize>,
    /// The number of ranks of the run.
    #[arg(long, required_unless_present = "join")]
    world: Option<usize>,
    /// The parent's control address (127.0.0.1:PORT).
    #[arg(long, required_unless_present = "join")]
    control: Option<std::net::SocketAddr>,
    /// The run's `procs` directory (resolved config and certificates).
    #[arg(long)]
    dir: PathBuf,
    /// Join the running elastic job whose `procs` directory is --dir (its control address is
    /// in DIR/control); it becomes a member at the next step boundary.
    #[arg(long, conflicts_with_all = ["rank", "world", "control"])]
    join: bool,
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
    /// (Tests) Prepare step N (0-based, below --steps), abandon it, and run it again (exercises
    /// the step transaction; the result must be unchanged). Repeatable.
    #[arg(long = "abandon-step", value_name = "N", hide = true)]
    abandon_steps: Vec<u64>,
    /// Run N worker processes on this machine whose ranks exchange tensors over QUIC with
    /// mutual TLS (sets the world size to N).
    #[arg(long, value_name = "N", conflicts_with = "world")]
    nprocs: Option<usize>,
    /// Where to train (sets `tessera.device`; default: the config's, else cpu): `cpu` (threads,
    /// or worker processes with --nprocs) or `cuda` (NVIDIA GPUs; with the default
    /// `tessera.gpu.collective = "nccl"` one rank per GPU (threads of this process), NCCL between them, the world size —
    /// --nprocs, --world or tessera.world — at most the GPUs present; with "quic" GPU ranks of the
    /// one engine, elastic with `tessera.elastic`: docs/GPU.md).
    #[arg(long, value_enum)]
    device: Option<tessera::serve::model::Device>,
    /// (`tessera chaos run`) A worker-net file: each spawned worker in its own network
    /// namespace, the driver on their bridge (docs/ELASTIC.md).
    #[arg(long, value_name = "FILE", hide = true, requires = "nprocs")]
    worker_net: Option<PathBuf>,
    /// Under torchrun or srun: a cluster directory (`tessera cluster init DIR --nodes
    /// WORLD_SIZE`) every rank reads; rank r proves itself with node-<r> (docs/MULTIHOST.md).
    #[arg(long, value_name = "DIR")]
    certs: Option<PathBuf>,
    /// Under torchrun or srun: rank 0 writes the run's join token to PATH (mode 0600), the other
    /// ranks read it; on several hosts it must be on storage they share (default with every
    /// rank on one host: a private file under $TMPDIR/tessera-<uid>).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Under torchrun or srun: how long rank 0 waits for the other ranks, and they for it
    /// (seconds).
    #[arg(long, value_name = "SECS", default_value_t = tessera::engine::JOIN_TIMEOUT_MS / 1000)]
    join_timeout: u64,
}

#[derive(Args)]
struct ServeArgs {
    /// A Hugging Face model folder (config.json, weights, tokenizer.json) or a checkpoint
    /// directory (a step directory or a checkpoints root; `--checkpoint`, as `generate` names
    /// it, is the same flag).
    #[arg(long, visible_alias = "checkpoint")]
    model: PathBuf,
    /// A checkpoint's tokenizer.json (the one recorded at training when absent).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The model's name in the API (the folder's name when absent).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: std::net::SocketAddr,
    /// The IP to listen on, in place of --addr's (vLLM's `--host`; 0.0.0.0 for every interface).
    #[arg(long)]
    host: Option<std::net::IpAddr>,
    /// The port to listen on, in place of --addr's (vLLM's `--port`).
    #[arg(long)]
    port: Option<u16>,
    /// Key/value cache positions per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Key/value cache blocks (0: enough for --max-seqs sequences of the full context).
    #[arg(long, default_value_t = 0)]
    kv_blocks: usize,
    #[command(flatten)]
    backend: BackendArgs,
    /// Wait for the N ranks at this address (`tessera serve-rank --join HOST:PORT` on any host,
    /// with the join token printed here or --certs) instead of starting them on this machine.
    #[arg(long, value_name = "ADDR:PORT", requires = "pipeline_parallel_size")]
    rank_listen: Option<String>,
    /// With --rank-listen: a cluster directory (`tessera cluster init DIR --nodes N`): ranks
    /// present their own node-<rank> certificates.
    #[arg(long, value_name = "DIR", requires = "rank_listen")]
    certs: Option<PathBuf>,
    /// With --rank-listen: write the ranks' join token to this file (mode 0600) instead of
    /// printing it.
    #[arg(long, value_name = "PATH", requires = "rank_listen")]
    token_file: Option<PathBuf>,
    /// With --rank-listen: how long to wait for every rank to join (seconds).
    #[arg(long, value_name = "SECS", default_value_t = tessera::engine::JOIN_TIMEOUT_MS / 1000)]
    join_timeout: u64,
    /// Sequences in a batch at most.
    #[arg(long, default_value_t = 32)]
    max_seqs: usize,
    /// Tokens run in one step at most (decode tokens and prompt chunks together).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Requests accepted and not finished at most; more are answered 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Prompt tokens at most (also bounded by the model's context).
    #[arg(long, default_value_t = usize::MAX, hide_default_value = true)]
    max_prompt_tokens: usize,
    /// `max_tokens` of a request at most.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Request body bytes at most (413 above).
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
}

#[derive(Args)]
struct ServeRankArgs {
    /// The server's ranks' address, HOST:PORT (its --rank-listen).
    #[arg(long)]
    join: String,
    /// The model the server serves, at this host's path (the same weights: checked).
    #[arg(long)]
    model: PathBuf,
    /// The checkpoint's tokenizer the server was given.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Take this rank (default: any free rank, in join order).
    #[arg(long)]
    rank: Option<usize>,
    /// This rank's name in the server's messages (default <hostname>-<pid>).
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    proof: JoinProofArgs,
}

/// How a joining process proves itself and how long it tries: `tessera agent` to a
/// coordinator, `tessera serve-rank` to a server (`--rank-listen`).
#[derive(Args)]
struct JoinProofArgs {
    /// A cluster directory with ca.pem and node-<rank>.{pem,key} (when the coordinator or
    /// server runs with --certs).
    #[arg(long, value_name = "DIR")]
    certs: Option<PathBuf>,
    /// The join token the coordinator or server printed (`-`: read it from standard input;
    /// default $TESSERA_JOIN_TOKEN).
    #[arg(long, value_name = "TOKEN")]
    token: Option<String>,
    /// A file holding the join token (`tessera coordinator --token-file`, `tessera serve
    /// --token-file`).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// How long to keep trying to reach the coordinator or server (seconds).
    #[arg(long, value_name = "SECS", default_value_t = tessera::engine::AGENT_CONNECT_TIMEOUT_MS / 1000)]
    connect_timeout: u64,
}

#[derive(Args)]
struct BenchServeArgs {
    /// The server: http://HOST:PORT.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model name (the server's first when absent).
    #[arg(long)]
    model: Option<String>,
    /// Requests in all.
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// Mean arrivals a second (Poisson).
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Prompt length range MIN:MAX in tokens (uniform).
    #[arg(long, default_value = "32:256", value_parser = parse_range)]
    prompt_tokens: (usize, usize),
    /// Output length range MIN:MAX in tokens (uniform).
    #[arg(long, default_value = "16:256", value_parser = parse_range)]
    output_tokens: (usize, usize),
    /// Prompt token ids are drawn below this.
    #[arg(long, default_value_t = 256)]
    vocab: u32,
    /// Seed of the arrivals, lengths and prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// `MIN:MAX` (or one number for both).
fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once(':').unwrap_or((s, s));
    let n = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("{s:?}: expected MIN:MAX whole numbers ({e})"));
    Ok((n(a)?, n(b)?))
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (a step directory or a checkpoints root), or a Hugging Face model
    /// folder (`--model`, as `serve` names it, is the same flag).
    #[arg(long, visible_alias = "model")]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "It is a truth universally acknowledged")]
    prompt: String,
    /// Tokens to generate (`--max-new-tokens`, transformers' name, is the same flag).
    #[arg(long, visible_alias = "max-new-tokens", default_value_t = 200)]
    tokens: usize,
    /// Softmax temperature (> 0; 0 or below means greedy: always the most likely token).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample from the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Seed of the sampling (the same seed, prompt and checkpoint give the same text).
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// The tokenizer.json the model was trained with (byte-level if absent).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Where `serve` and `generate` run the model (`serve::model::BackendChoice`).
#[derive(Args)]
struct BackendArgs {
    /// Where the model runs: cpu (the paged CPU backend) or cuda (GPU 0: bf16, fused decode
    /// kernels, CUDA graphs).
    #[arg(long, value_enum, default_value = "cpu")]
    device: tessera::serve::model::Device,
    /// The linear layers' weights (default: f32 on the CPU, bf16 on the GPU): f32 (CPU), bf16
    /// (GPU), int8 (weight-only, per-channel scales; both; on the CPU MoE experts too, routers
    /// and norms stay f32), fp8 (e4m3, per-channel scales; GPU).
    #[arg(long, value_enum)]
    weights: Option<tessera::serve::model::Weights>,
    /// Split the model's blocks over N rank processes (pipeline parallelism, CPU; each holds a
    /// contiguous run of blocks and their part of the key/value cache; QUIC with mutual TLS; on
    /// this machine, or with `serve --rank-listen` joining from others). Absent: this process
    /// runs the whole model.
    #[arg(long, visible_alias = "pp", value_name = "N")]
    pipeline_parallel_size: Option<usize>,
}

impl BackendArgs {
    fn choice(self, ranks_join: Option<tessera::serve::model::RanksJoin>) -> tessera::serve::model::BackendChoice {
        tessera::serve::model::BackendChoice {
            device: self.device,
            weights: self.weights,
            pipeline: self.pipeline_parallel_size,
            ranks_join,
        }
    }
}

#[derive(Args)]
struct ExportArgs {
    /// Checkpoint directory (a step directory or a checkpoints root).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output directory (new or empty) for model.safetensors, config.json, the tokenizer's files
    /// and reference.json.
    #[arg(long)]
    out: PathBuf,
    /// The tokenizer.json the model was trained with (the one the checkpoint records if absent).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Export into a folder that is not empty, replacing only the files export writes.
    #[arg(long)]
    force: bool,
    /// The weights' dtype (default: the model folder's own when it is bfloat16, else float32;
    /// bfloat16 rounds the f32 masters to nearest even).
    #[arg(long, value_enum)]
    dtype: Option<ExportDtype>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExportDtype {
    Float32,
    Bfloat16,
}

#[derive(Subcommand)]
enum GpuCmd {
    /// Every CUDA kernel and the whole GPT model against the CPU reference, on fresh random inputs.
    Check {
        /// Seed of the random inputs and initial parameters the checks use.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Run only the sections whose title contains this text (case-insensitive), e.g. `offload`.
        #[arg(long)]
        only: Option<String>,
    },
    /// GPT-2 training throughput: one process per GPU, NCCL, ZeRO 0–3 (synthetic tokens, bf16).
    Bench(tessera::gpu::BenchArgs),
    /// Greedy decoding throughput over the paged cache (prompt, then new tokens, batch sizes),
    /// with the Hugging Face generate peer run in the same call.
    DecodeBench(tessera::gpu::decode_bench::DecodeBenchArgs),
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Print the resolved config and which keys Tessera honours.
    Check {
        /// The DeepSpeed JSON config file to check.
        file: PathBuf,
        #[command(flatten)]
        common: cli::CommonArgs,
    },
}

/// The exit status of a training command: 0 when it finished, [`signals::EXIT_INTERRUPTED`]
/// when a signal (or standard output closing) stopped it after a checkpoint.
fn trained(finished: bool) -> ExitCode {
    match finished {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(signals::EXIT_INTERRUPTED),
    }
}

/// Who a process's log lines come from, when it is not the one a person started: a worker
/// process's or GPU rank's rank, an agent.
fn log_prefix(cmd: &Cmd) -> Option<String> {
    match cmd {
        Cmd::Worker(a) => Some(a.rank.map_or_else(|| "joining worker".to_string(), |r| format!("rank {r}"))),
        Cmd::Agent(a) => Some(a.name.as_ref().map_or_else(|| "agent".to_string(), |n| format!("agent {n}"))),
        Cmd::Gpu(_) => tessera::gpu::rank_in_env().map(|r| format!("rank {r}")),
        _ => None,
    }
}

/// Whether a command stops after a step with a checkpoint on a stop signal (drivers); the
/// others keep the default actions.
fn stops_after_a_step(cmd: &Cmd) -> bool {
    matches!(cmd, Cmd::Train(_) | Cmd::Coordinator(_) | Cmd::Launch(_))
}

fn run(cli: Cli) -> Result<ExitCode> {
    let done = ExitCode::SUCCESS;
    console::init_logs(console::Verbosity { verbose: cli.verbose, quiet: cli.quiet }, log_prefix(&cli.cmd))?;
    if stops_after_a_step(&cli.cmd) {
        signals::install()?;
    }
    // Every TESSERA_* variable (docs/ENV.md) checked once, before anything starts: a bad value
    // is refused here rather than where a worker or kernel reads it. The test faults become
    // this process's fault hooks (none unless TESSERA_TEST_FAULTS names some).
    let env = tessera::env::Env::from_process()?;
    let faults = env.faults.hooks();
    match cli.cmd {
        Cmd::Train(mut a) => {
            if let Some(d) = a.device {
                let name = if d == tessera::serve::model::Device::Cuda { "cuda" } else { "cpu" };
                a.common.set.push(format!("tessera.device={name}"));
            }
            if let Some(launcher) = tessera::launch::launcher_env(&|k| std::env::var(k).ok())? {
                return train_under_launcher(&launcher, a, faults);
            }
            if let Some(note) = tessera::launch::slurm_batch_note(&|k| std::env::var(k).ok()) {
                eprintln!("warning: {note}");
            }
            if let Some(flag) = [("--certs", &a.certs), ("--token-file", &a.token_file)].iter().find_map(|(f, v)| v.as_ref().map(|_| f)) {
                anyhow::bail!(
                    "{flag} is for `tessera train` started by torchrun or srun (no RANK/WORLD_SIZE or SLURM_PROCID here); for \
                     ranks on several hosts by hand use `tessera coordinator` and `tessera agent`"
                );
            }
            if let Some(n) = a.nprocs {
                anyhow::ensure!(n >= 1, "--nprocs must be at least 1");
                a.common.world = Some(n);
            }
            // NCCL GPU ranks are threads of this process, one per GPU: `--nprocs N` asks for N GPUs.
            let nccl = cli::nccl_gpu_run(&a.config, &a.common)?;
            if let (Some(p), true) = (&a.worker_net, nccl) {
                anyhow::bail!("--worker-net {}: worker namespaces are for CPU `--nprocs` runs, not --device cuda", p.display());
            }
            let processes = a.nprocs.is_some() && !nccl;
            let opts = TrainOptions {
                resume: a.resume,
                progress: !a.no_progress,
                abandon_steps: a.abandon_steps,
                processes,
                worker_net: a.worker_net,
                faults,
                rendezvous: Default::default(),
            };
            Ok(trained(cli::train(&a.config, &a.common, opts)?))
        }
        Cmd::Generate(a) => cli::generate(&cli::GenerateOpts {
            checkpoint: a.checkpoint,
            prompt: a.prompt,
            tokens: a.tokens,
            temperature: a.temperature,
            top_k: a.top_k,
            seed: a.seed,
            tokenizer: a.tokenizer,
            backend: a.backend.choice(None),
        })
        .map(|()| done),
        Cmd::Serve(a) => {
            let (certs, token_file, join_timeout_ms) = (a.certs, a.token_file, a.join_timeout.saturating_mul(1000));
            let ranks_join = a.rank_listen.map(|listen| tessera::serve::model::RanksJoin { listen, certs, token_file, join_timeout_ms });
            let limits = tessera::serve::http::Limits {
                max_queue: a.max_queue,
                max_prompt_tokens: a.max_prompt_tokens,
                max_tokens: a.max_tokens,
                max_body_bytes: a.max_body_bytes,
            };
            tessera::serve::serve(tessera::serve::ServeOpts {
                model: a.model,
                tokenizer: a.tokenizer,
                served_name: a.served_model_name,
                addr: std::net::SocketAddr::new(a.host.unwrap_or(a.addr.ip()), a.port.unwrap_or(a.addr.port())),
                block_size: a.block_size,
                kv_blocks: a.kv_blocks,
                backend: a.backend.choice(ranks_join),
                max_seqs: a.max_seqs,
                max_batch_tokens: a.max_batch_tokens,
                limits,
            })
            .map(|()| done)
        }
        Cmd::ServeRank(a) => {
            let flags = tessera::launch::AgentFlags {
                join: Some(a.join),
                name: a.name,
                rank: a.rank,
                certs: a.proof.certs,
                token: a.proof.token,
                token_file: a.proof.token_file,
                connect_timeout_ms: a.proof.connect_timeout.saturating_mul(1000),
                ..Default::default()
            };
            tessera::serve::serve_rank(&flags, &a.model, a.tokenizer.as_deref()).map(|()| done)
        }
        Cmd::BenchServe(a) => tessera::serve::bench::bench_serve(&tessera::serve::bench::BenchOpts {
            url: a.url,
            model: a.model,
            requests: a.requests,
            rate: a.rate,
            prompt_tokens: a.prompt_tokens,
            output_tokens: a.output_tokens,
            vocab: a.vocab,
            seed: a.seed,
        })
        .map(|()| done),
        Cmd::Export(a) => {
            let dtype = a.dtype.map(|d| match d {
                ExportDtype::Float32 => tessera::checkpoint::TensorDtype::F32,
                ExportDtype::Bfloat16 => tessera::checkpoint::TensorDtype::Bf16,
            });
            let o = cli::ExportOpts { checkpoint: a.checkpoint, out: a.out, tokenizer: a.tokenizer, force: a.force, dtype };
            cli::export(&o).map(|()| done)
        }
        Cmd::Config(ConfigCmd::Check { file, common }) => cli::config_check(&file, &common).map(|()| done),
        Cmd::Models => {
            cli::list_models();
            Ok(done)
        }
        Cmd::Gpu(GpuCmd::Check { seed, only }) => Ok(if tessera::gpu::check(seed, only.as_deref())? { done } else { ExitCode::FAILURE }),
        Cmd::Gpu(GpuCmd::Bench(a)) => tessera::gpu::bench(&a).map(|()| done),
        Cmd::Gpu(GpuCmd::DecodeBench(a)) => tessera::gpu::decode_bench::run(&a).map(|()| done),
        Cmd::Worker(a) => match (a.join, a.rank, a.world, a.control) {
            (true, ..) => tessera::engine::run_joiner(&a.dir, &faults).map(|()| done),
            (false, Some(rank), Some(world), Some(control)) => {
                let args = tessera::engine::WorkerArgs { rank, world, control, dir: a.dir, faults };
                tessera::engine::run_worker(&args).map(|()| done)
            }
            _ => anyhow::bail!("tessera worker needs --rank, --world and --control (or --join)"),
        },
        Cmd::Coordinator(a) => {
            let (config, common, opts, d) = a.driver.split(faults);
            Ok(trained(tessera::launch::coordinator(&config, &common, opts, a.listen.as_deref(), a.nodes, &d)?))
        }
        Cmd::Agent(a) => {
            let flags = tessera::launch::AgentFlags {
                join: a.join,
                name: a.name,
                rank: a.rank,
                advertise: a.advertise,
                quic_port: a.quic_port,
                certs: a.proof.certs,
                token: a.proof.token,
                token_file: a.proof.token_file,
                connect_timeout_ms: a.proof.connect_timeout.saturating_mul(1000),
                worker_net: a.worker_net,
                faults,
            };
            tessera::launch::agent(&flags).map(|()| done)
        }
        Cmd::Chaos(ChaosCmd::Run { scenario, seed, output, no_progress }) => {
            use tessera_chaos::{plan::Scenario, runner};
            let sc = Scenario::load(&scenario)?;
            let base = scenario.parent().map(PathBuf::from).unwrap_or_default();
            let exe = std::env::current_exe()?;
            let opts =
                runner::ChaosOptions { exe, scenario: sc, base, seed, output: output.clone(), progress: !no_progress, faults: env.faults };
            let report = runner::run(&opts)?;
            outln!("{}", report.render().trim_end_matches('\n'));
            outln!("report: {}", output.join("report.json").display());
            Ok(if report.passed() { done } else { ExitCode::FAILURE })
        }
        Cmd::Cluster(ClusterCmd::Init { dir, nodes }) => {
            anyhow::ensure!(nodes >= 1, "--nodes 0: a cluster needs at least one node certificate (one per rank)");
            anyhow::ensure!(
                !dir.exists() || dir.is_dir(),
                "{}: exists and is not a directory (expected a new or existing directory)",
                dir.display()
            );
            let mut names: Vec<String> = (0..nodes).map(|r| format!("node-{r}")).collect();
            names.push(tessera::engine::COORDINATOR_NAME.to_string());
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let files = tessera_transport::quic::cluster_init(&dir, &refs)?;
            outln!("{}: CA, {} and {nodes} node certificates", dir.display(), tessera::engine::COORDINATOR_NAME);
            drop(files);
            Ok(done)
        }
        Cmd::Completions { shell } => {
            cli::completions(shell, &Cli::command(), &mut std::io::stdout());
            Ok(done)
        }
        Cmd::Launch(a) => {
            let a = *a;
            let (config, common, opts, d) = a.driver.split(faults);
            let l = tessera::launch::LaunchOpts {
                hostfile: a.hostfile,
                select: tessera::launch::select::Selection {
                    include: a.include,
                    exclude: a.exclude,
                    num_nodes: a.num_nodes,
                    num_gpus: a.num_gpus,
                },
                listen: a.listen,
                coordinator_addr: a.coordinator_addr,
                remote_exe: a.remote_exe,
                ssh: a.ssh,
                ssh_opts: tessera::launch::SshOpts {
                    port: a.ssh_port,
                    identity: a.ssh_identity,
                    config: a.ssh_config,
                    options: a.ssh_option,
                },
            };
            Ok(trained(tessera::launch::launch(&config, &common, opts, &l, &d)?))
        }
    }
}

/// `tessera train` as one rank of a torchrun or srun job (`tessera::launch::role`).
fn train_under_launcher(env: &tessera::launch::LauncherEnv, a: TrainArgs, faults: Faults) -> Result<ExitCode> {
    if let Some(n) = a.nprocs {
        anyhow::bail!(
            "--nprocs {n} under {}: the launcher already started the ranks; drop --nprocs (or run `tessera train --config {} \
             --nprocs {n}` without the launcher)",
            env.describe,
            a.config.display()
        );
    }
    if let Some(p) = &a.worker_net {
        anyhow::bail!("--worker-net {}: not under a launcher", p.display());
    }
    let gpu = cli::nccl_gpu_run(&a.config, &a.common)?;
    let opts = TrainOptions {
        resume: a.resume,
        progress: !a.no_progress,
        abandon_steps: a.abandon_steps,
        processes: false,
        worker_net: None,
        faults,
        rendezvous: Default::default(),
    };
    let u = tessera::launch::UnderLauncher {
        config: &a.config,
        common: &a.common,
        opts,
        gpu,
        certs: a.certs,
        token_file: a.token_file,
        join_timeout_ms: a.join_timeout.saturating_mul(1000),
    };
    let finished = tessera::launch::train_under_launcher(env, u)?;
    Ok(trained(finished))
}

fn main() -> ExitCode {
    // Before any thread or large buffer exists: the heap settings every command trains with.
    tessera_transport::quic::net::tune_allocator();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            // Not through the log subscriber: this line is the command's answer, and must
            // show even with -q or when the subscriber could not start.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--name` of a flag, or `NAME` of a positional argument, for messages.
    fn arg_name(a: &clap::Arg) -> String {
        a.get_long().map_or_else(|| a.get_id().to_string().to_uppercase(), |l| format!("--{l}"))
    }

    /// The visible arguments below `cmd` (its own and those of its visible subcommands, named by
    /// their command path) that have no help line in `--help`.
    fn missing_help(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments().filter(|a| !a.is_hide_set() && a.get_help().is_none()) {
            out.push(format!("{path} {}", arg_name(a)));
        }
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            if sub.get_about().is_none() {
                out.push(format!("{path} {} (the subcommand itself)", sub.get_name()));
            }
            missing_help(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_visible_argument_and_subcommand_has_help() {
        let mut cmd = Cli::command();
        // Built, the tree also holds the --help and --version arguments clap adds.
        cmd.build();
        let mut missing = Vec::new();
        missing_help(&cmd, "tessera", &mut missing);
        assert!(missing.is_empty(), "arguments without a help line in --help:\n{}", missing.join("\n"));
    }

    #[test]
    fn test_only_flags_are_hidden_from_help() {
        let cmd = Cli::command();
        let sub = |name: &str| cmd.find_subcommand(name).unwrap_or_else(|| panic!("no subcommand {name}")).clone();
        let hidden = |c: &clap::Command, long: &str| {
            let arg = c.get_arguments().find(|a| a.get_long() == Some(long));
            arg.unwrap_or_else(|| panic!("{} has no --{long}", c.get_name())).is_hide_set()
        };
        assert!(sub("worker").is_hide_set(), "`worker` is started by `train --nprocs`, not by hand");
        for (command, long) in [("train", "abandon-step"), ("train", "worker-net"), ("agent", "worker-net")] {
            assert!(hidden(&sub(command), long), "{command} --{long} is for tests and chaos runs: it should be hidden");
        }
    }
}
