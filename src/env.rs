//! Every `TESSERA_*` environment variable, in one table ([`VARS`]): its kind, default, reader,
//! meaning and audience. `main` checks every one that is set once, before a command starts
//! ([`Env::read`]: a bad value is refused naming the variable, the value and what was
//! expected), and `docs/ENV.md` is this table rendered ([`render_markdown`], kept in sync by a
//! test, as `docs/config.md` is with the config keys).
//!
//! What the variables hold reaches the code that uses them in one of two ways:
//! - handed down from [`Env`]: `TESSERA_TEST_FAULTS` becomes the process's fault hooks
//!   (`tessera_actors::faults::Faults`, through `TrainOptions`, the worker's and agent's
//!   arguments) — the runtime itself reads no test knob;
//! - read where they are used, by crates below this one (the transport, the CUDA kernels) or
//!   by tests: the table is still the one place that lists and checks them, and a test fails
//!   when a `TESSERA_` name appears in the source that the table does not list.
//!
//! # Architecture invariant
//! A variable changes how a run goes about its work (threads, kernels, I/O paths, logging), or
//! injects a test fault; none changes what a run computes, which only the config says.

use std::ffi::OsString;

use tessera_chaos::hooks::{FaultSpec, FAULTS_ENV};
use tessera_transport::quic::net::{env_count, LANES_ENV, LANES_MAX, MALLOC_TUNE_ENV, WORKERS_ENV, WORKERS_MAX};

/// What a variable holds, and how its value is checked.
#[derive(Clone, Copy)]
pub enum Kind {
    /// A whole number from `min` to `max` (checked as the transport reads its counts).
    Count { min: usize, max: usize, of: &'static str },
    /// `0` (off) or `1` (on).
    Switch,
    /// Any value turns it on (the value itself is not read).
    Presence,
    /// A file-system path.
    Path,
    /// Free text.
    Text,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// Checked by its reader's own parser; `expected` says what it takes.
    Parsed { expected: &'static str, check: fn(&str) -> Result<(), String> },
    /// Set by `build.rs` when `tessera` is compiled, not read at run time.
    Build,
}

/// Who sets a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    /// A person running tessera (tuning, measurements, credentials).
    User,
    /// tessera itself, for the processes it starts (never set by hand).
    Internal,
    /// Tests and the chaos harness only.
    Test,
    /// The build.
    Build,
}

/// One environment variable.
pub struct Var {
    pub name: &'static str,
    pub kind: Kind,
    /// What holds when it is unset.
    pub default: &'static str,
    /// Where it is read.
    pub reader: &'static str,
    pub what: &'static str,
    pub audience: Audience,
}

fn fusions(v: &str) -> Result<(), String> {
    tessera_kernels::cuda::gpt::Fusions::parse(v).map(drop)
}

fn gpu_tune(v: &str) -> Result<(), String> {
    tessera_kernels::cuda::lt::tune_parse(v).map(drop)
}

fn one_of(v: &str, names: &[&str]) -> Result<(), String> {
    match names.contains(&v.trim()) {
        true => Ok(()),
        false => Err(format!("expected one of {}", names.join(", "))),
    }
}

fn attn_fwd(v: &str) -> Result<(), String> {
    one_of(v, &tessera_kernels::cuda::attention::fwd_names())
}

fn attn_bwd(v: &str) -> Result<(), String> {
    one_of(v, &tessera_kernels::cuda::attention::bwd_names())
}

fn faults(v: &str) -> Result<(), String> {
    FaultSpec::parse(v).map(drop)
}

/// Every `TESSERA_*` variable tessera and its tests read (or its build sets).
pub const VARS: &[Var] = &[
    Var {
        name: "TESSERA_JOIN_TOKEN",
        kind: Kind::Text,
        default: "none",
        reader: "`tessera agent` (src/launch.rs)",
        what: "The coordinator's join token, when neither --token, --token-file nor --certs is given.",
        audience: Audience::User,
    },
    Var {
        name: LANES_ENV,
        kind: Kind::Count { min: 1, max: LANES_MAX, of: "lanes" },
        default: "4 between processes of a host with 8+ cores, else 1",
        reader: "the QUIC transport (transport/src/quic/net.rs)",
        what: "Parallel QUIC connections a rank asks each peer for (a pair uses the smaller number).",
        audience: Audience::User,
    },
    Var {
        name: WORKERS_ENV,
        kind: Kind::Count { min: 1, max: WORKERS_MAX, of: "worker threads" },
        default: "the lanes (at least 2), at most half the cores; 1 below 4 cores",
        reader: "the QUIC transport (transport/src/quic/net.rs)",
        what: "Worker threads of each rank's QUIC runtime (for measurements).",
        audience: Audience::User,
    },
    Var {
        name: tessera_transport::quic::pki::TLS_PROVIDER_ENV,
        kind: Kind::Choice(&["aws-lc-rs", "ring"]),
        default: "aws-lc-rs",
        reader: "the QUIC transport (transport/src/quic/pki.rs)",
        what: "The TLS library's crypto provider.",
        audience: Audience::User,
    },
    Var {
        name: MALLOC_TUNE_ENV,
        kind: Kind::Switch,
        default: "1",
        reader: "every command's start (transport/src/quic/net.rs, `tune_allocator`)",
        what: "`0` leaves glibc's malloc settings as they are (for comparisons).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_AIO",
        kind: Kind::Choice(&["threads", "io_uring"]),
        default: "io_uring (threads where the kernel refuses a ring)",
        reader: "NVMe offload (src/offload/io.rs)",
        what: "The swap files' I/O path: io_uring, or blocking reads and writes on a thread pool.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_ELASTIC_TRACE",
        kind: Kind::Presence,
        default: "off",
        reader: "elastic runs (actors/fleet/src/driver)",
        what: "A trace of the elastic driver's requests and the workers' replica steps, with timings, on standard error.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_KERNEL_CACHE",
        kind: Kind::Path,
        default: "$XDG_CACHE_HOME/tessera/kernels (else ~/.cache/tessera/kernels)",
        reader: "the CUDA kernels (kernels/src/cuda/mod.rs)",
        what: "Where compiled CUDA kernels are cached.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_FUSE",
        kind: Kind::Parsed { expected: "all, none, or a comma list of bias, gelu, dgelu, bgrad, residual", check: fusions },
        default: "bias,gelu,dgelu,residual",
        reader: "the CUDA GPT (kernels/src/cuda/gpt.rs)",
        what: "Which epilogue fusions the GPU GEMMs use.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_TUNE",
        kind: Kind::Parsed { expected: "0, 1, on, off or route", check: gpu_tune },
        default: "1",
        reader: "cuBLASLt GEMMs (kernels/src/cuda/lt.rs)",
        what: "`1`: GEMMs through cuBLASLt, tuned on first use; `route`: untuned; `0`: plain cuBLAS.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_MOE_GEMM",
        kind: Kind::Choice(&["grouped", "loop"]),
        default: "grouped",
        reader: "the CUDA mixture-of-experts (kernels/src/cuda/llama/moe.rs)",
        what: "How the experts' GEMMs run: one grouped cuBLAS call, or one GEMM per expert (each gives its own bits, the same every run).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_LN_FUSED",
        kind: Kind::Switch,
        default: "1",
        reader: "the CUDA LayerNorm backward (kernels/src/cuda/ops/mod.rs)",
        what: "`0` runs the separate LayerNorm backward kernels instead of the one-pass kernel (same bits).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_ATTN_PRECISE",
        kind: Kind::Switch,
        default: "0",
        reader: "the CUDA attention (kernels/src/cuda/attention.rs)",
        what: "`1` runs the attention kernels that keep P and dS as split bf16 hi+lo pairs.",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_ATTN_FWD",
        kind: Kind::Parsed { expected: "wg or mma", check: attn_fwd },
        default: "wg on sm_90, else mma",
        reader: "the CUDA attention (kernels/src/cuda/attention.rs)",
        what: "The attention forward kernel (all give the same bits).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_ATTN_BWD",
        kind: Kind::Parsed { expected: "wg, r2 or full", check: attn_bwd },
        default: "wg on sm_90, else r2",
        reader: "the CUDA attention (kernels/src/cuda/attention.rs)",
        what: "The attention backward kernels' layout (all give the same bits).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_EARLY_ADAM",
        kind: Kind::Switch,
        default: "1",
        reader: "the NCCL GPU trainer (src/gpu/zero/mod.rs)",
        what: "`0` steps the optimizer after the whole backward instead of each unit's as soon as its gradient is final (one GPU, no clipping, no fp16).",
        audience: Audience::User,
    },
    Var {
        name: "TESSERA_GPU_RANK",
        kind: Kind::Count { min: 0, max: usize::MAX, of: "a rank" },
        default: "unset (a process started by hand)",
        reader: "`tessera gpu bench` (src/gpu/mod.rs)",
        what: "The rank a `gpu bench --nprocs N` parent started this process as.",
        audience: Audience::Internal,
    },
    Var {
        name: "TESSERA_GPU_WORLD",
        kind: Kind::Count { min: 1, max: usize::MAX, of: "ranks" },
        default: "unset",
        reader: "`tessera gpu bench` (src/gpu/mod.rs)",
        what: "The number of ranks of the GPU benchmark this process is part of.",
        audience: Audience::Internal,
    },
    Var {
        name: "TESSERA_NCCL_ID",
        kind: Kind::Text,
        default: "unset",
        reader: "`tessera gpu bench` (src/gpu/mod.rs)",
        what: "The NCCL unique id of the GPU benchmark (hex).",
        audience: Audience::Internal,
    },
    Var {
        name: FAULTS_ENV,
        kind: Kind::Parsed {
            expected: "a comma list of kill_in_commit, stop_actor, corrupt_replica_at_step=N, replicate_delay_ms=MS, \
                       offload_fail_write_at_step=N",
            check: faults,
        },
        default: "none (no fault hooks: SIGUSR1 drains an elastic worker)",
        reader: "`main`, into the fault hooks (chaos/src/hooks.rs); set by `tessera chaos run`",
        what: "Injected faults: SIGUSR1 arms kill-in-commit, SIGUSR2 stops an actor, a replica bit flip, a held replica copy, \
               a failed swap write.",
        audience: Audience::Test,
    },
    Var {
        name: "TESSERA_SIM_SEED",
        kind: Kind::Count { min: 0, max: usize::MAX, of: "a seed" },
        default: "7",
        reader: "the seeded simulations' replay tests (actors/src/sim_support.rs)",
        what: "The seed a simulation's replay test runs.",
        audience: Audience::Test,
    },
    Var {
        name: "TESSERA_SIM_SEEDS",
        kind: Kind::Count { min: 0, max: usize::MAX, of: "seeds" },
        default: "each simulation's own",
        reader: "the seeded simulations (actors/src/sim_support.rs)",
        what: "How many seeds a simulation test runs.",
        audience: Audience::Test,
    },
    Var {
        name: "TESSERA_REGEN_DOCS",
        kind: Kind::Presence,
        default: "off",
        reader: "the docs tests (src/config/tests.rs, src/env.rs)",
        what: "Rewrite docs/config.md and docs/ENV.md from their tables instead of only comparing.",
        audience: Audience::Test,
    },
    Var {
        name: "TESSERA_BENCH_DIR",
        kind: Kind::Path,
        default: ".",
        reader: "the offload measurement (src/offload/mod.rs, an ignored test)",
        what: "Where the measurement writes its swap files.",
        audience: Audience::Test,
    },
    Var {
        name: "TESSERA_COMMIT",
        kind: Kind::Build,
        default: "the git commit, else unknown",
        reader: "summary.json's `commit` (src/engine/summary.rs)",
        what: "The commit the binary was built from (build.rs sets it for the compiler).",
        audience: Audience::Build,
    },
];

/// A variable's value refused (the message names the variable, the value and what was expected).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct EnvError(String);

/// What `main` takes from the environment, checked.
#[derive(Debug, Default)]
pub struct Env {
    /// `TESSERA_TEST_FAULTS`: the faults this process's hooks inject (empty: none).
    pub faults: FaultSpec,
}

impl Env {
    /// Checks every variable of [`VARS`] that `get` finds set and takes what is handed down.
    pub fn read(get: &dyn Fn(&str) -> Option<OsString>) -> Result<Env, EnvError> {
        for v in VARS {
            if let Some(value) = get(v.name) {
                check(v, &value)?;
            }
        }
        let faults = match get(FAULTS_ENV).and_then(|v| v.into_string().ok()) {
            Some(v) => FaultSpec::parse(&v).map_err(|e| EnvError(format!("{FAULTS_ENV}={v:?}: {e}")))?,
            None => FaultSpec::default(),
        };
        Ok(Env { faults })
    }

    /// [`Env::read`] of this process's environment.
    pub fn from_process() -> Result<Env, EnvError> {
        Env::read(&|name| std::env::var_os(name))
    }
}

/// Checks one set variable's value against its kind.
fn check(v: &Var, value: &OsString) -> Result<(), EnvError> {
    let name = v.name;
    if let Kind::Count { min, max, of } = v.kind {
        let text = value.clone().into_string().map_err(std::env::VarError::NotUnicode);
        return match env_count(name, text, min..=max, of) {
            Ok(_) => Ok(()),
            Err(e) if max != usize::MAX => Err(EnvError(e)),
            Err(_) => Err(EnvError(format!("{name}={value:?}: expected {}", expected(v.kind)))),
        };
    }
    // Not read as UTF-8 here, nor ever printed: free text (a join token) and on/off switches.
    if matches!(v.kind, Kind::Text | Kind::Presence | Kind::Build) {
        return Ok(());
    }
    let text = match value.to_str() {
        Some(t) => t,
        None => return Err(EnvError(format!("{name}={value:?}: expected {} (UTF-8 text)", expected(v.kind)))),
    };
    let refused = |detail: String| EnvError(format!("{name}={text:?}: {detail}"));
    match v.kind {
        Kind::Switch if !matches!(text.trim(), "0" | "1") => Err(refused(format!("expected {}", expected(v.kind)))),
        Kind::Choice(words) if !words.contains(&text.trim()) => Err(refused(format!("expected {}", expected(v.kind)))),
        Kind::Path if text.is_empty() => Err(refused("expected a path".into())),
        Kind::Parsed { check, .. } => check(text).map_err(refused),
        _ => Ok(()),
    }
}

/// What a kind takes, in words.
fn expected(kind: Kind) -> String {
    match kind {
        Kind::Count { min, max, of } if max == usize::MAX => format!("a number from {min} ({of})"),
        Kind::Count { min, max, of } => format!("a number of {of} from {min} to {max}"),
        Kind::Switch => "0 or 1".into(),
        Kind::Presence => "anything (set: on)".into(),
        Kind::Path => "a path".into(),
        Kind::Text => "text".into(),
        Kind::Choice(words) => match words.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => words.join(""),
        },
        Kind::Parsed { expected, .. } => expected.into(),
        Kind::Build => "(set by the build)".into(),
    }
}

/// docs/ENV.md: the table, by audience.
pub fn render_markdown() -> String {
    let mut out = String::from(
        "# Environment variables\n\n\
         <!-- Generated from src/env.rs (`VARS`); edit the table there, then regenerate with\n\
         `TESSERA_REGEN_DOCS=1 cargo test --release --lib env::tests::docs_in_sync`. -->\n\n\
         Every `TESSERA_*` variable tessera reads. The config file says what a run computes; these only\n\
         change how it goes about it (threads, kernels, I/O, logging) or inject test faults. `tessera`\n\
         checks every one that is set before a command starts: a bad value is refused with an error\n\
         naming the variable, the value and what was expected.\n",
    );
    let sections = [
        (Audience::User, "For users", ""),
        (Audience::Internal, "Set by tessera for the processes it starts", "Never set these by hand.\n\n"),
        (Audience::Test, "Test-only", "For tests and the chaos harness; a run started by a person never needs them.\n\n"),
        (Audience::Build, "Build", ""),
    ];
    for (audience, title, note) in sections {
        out.push_str(&format!("\n## {title}\n\n{note}| Variable | Takes | Default | Read by | What it does |\n|---|---|---|---|---|\n"));
        for v in VARS.iter().filter(|v| v.audience == audience) {
            let cell = |s: &str| s.replace('|', "\\|");
            out.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                v.name,
                cell(&expected(v.kind)),
                cell(v.default),
                cell(v.reader),
                cell(v.what)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests;
