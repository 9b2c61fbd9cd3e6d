//! `tessera train` as one rank of a torchrun or srun job: rank 0 coordinates (and starts an
//! agent of its own for rank 0), the others join it as agents ([`super::role`] says how the
//! role and the trust are found).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::role::{self, LauncherEnv, Trust};
use super::REAP_TIMEOUT_MS;
use super::{drive, hostname, read_token, reap, rendezvous_endpoint, shell_quote, start_agent, write_token_file, AgentStart, DriverOpts};
use crate::cli::{self, CommonArgs};
use crate::engine::{self, AgentArgs, AgentCredentials, TrainOptions};
use tessera_transport::quic::JoinToken;

/// How often a rank looks for rank 0's token file (ms).
const TOKEN_POLL_MS: u64 = 100;

/// `tessera train`'s flags that matter under a launcher.
pub struct UnderLauncher<'a> {
    pub config: &'a Path,
    pub common: &'a CommonArgs,
    pub opts: TrainOptions,
    /// NCCL GPU ranks (`--device cuda`): one launcher rank only (its GPU ranks are threads of it).
    pub gpu: bool,
    /// `--certs DIR`.
    pub certs: Option<PathBuf>,
    /// `--token-file PATH`.
    pub token_file: Option<PathBuf>,
    /// Bound on the wait for every rank (rank 0) or for rank 0 and its token (the others) (ms).
    pub join_timeout_ms: u64,
}

/// Runs this process's part of the launcher's job; returns whether the run finished.
pub fn train_under_launcher(env: &LauncherEnv, u: UnderLauncher<'_>) -> Result<bool> {
    let mut common = u.common.clone();
    if let Some(w) = common.world.filter(|w| *w != env.world) {
        bail!("--world {w}: {} starts {} ranks; drop --world (the launcher's world size is the run's)", env.describe, env.world);
    }
    common.world = Some(env.world);
    if u.gpu {
        if env.world > 1 {
            bail!(
                "--device cuda under {}: the NCCL GPU ranks are threads of one process, one per GPU of its machine; run `tessera train --config {} --device cuda --nprocs {}` once on that machine, without the launcher",
                env.describe,
                u.config.display(),
                env.world
            );
        }
        return cli::train(u.config, &common, u.opts);
    }
    if env.world == 1 {
        tracing::info!("train: {}: the only rank, trained in this process", env.describe);
        return cli::train(u.config, &common, u.opts);
    }
    // Every rank checks the config before anything starts: each reports a mistake at once,
    // instead of rank 0 alone while the others wait for it.
    cli::load_config(u.config, &common)?;
    let command =
        format!("{} … tessera {}", env.launcher.name(), std::env::args().skip(1).map(|a| quoted(&a)).collect::<Vec<_>>().join(" "));
    let trust = role::trust(env, u.certs.as_deref(), u.token_file.as_deref(), &std::env::temp_dir(), &command)?;
    match env.rank {
        0 => coordinate(env, &trust, &u, &common),
        _ => join(env, &trust, &u).map(|()| true),
    }
}

/// `a` as a shell word (quoted only when it needs to be).
fn quoted(a: &str) -> String {
    match a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@".contains(c)) && !a.is_empty() {
        true => a.to_string(),
        false => shell_quote(a),
    }
}

/// Where rank 0 listens: `MASTER_ADDR` itself when it is a loopback address (every rank on
/// this host), else every interface, on `MASTER_PORT` (UDP).
fn listen_addr(env: &LauncherEnv) -> String {
    match env.master_host.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => env.master(),
        _ if env.master_host == "localhost" => env.master(),
        Ok(IpAddr::V6(_)) => format!("[::]:{}", env.master_port),
        _ => format!("0.0.0.0:{}", env.master_port),
    }
}

/// The token file rank 0 wrote, removed when the run ends (unless another run replaced it).
struct TokenFile {
    path: PathBuf,
    text: String,
}

impl Drop for TokenFile {
    fn drop(&mut self) {
        if std::fs::read_to_string(&self.path).is_ok_and(|t| t.trim() == self.text) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Rank 0: the coordinator on `MASTER_PORT`, plus the agent of rank 0.
fn coordinate(env: &LauncherEnv, trust: &Trust, u: &UnderLauncher<'_>, common: &CommonArgs) -> Result<bool> {
    let certs = match trust {
        Trust::Certs(dir) => Some(dir.clone()),
        Trust::TokenFile(_) => None,
    };
    // The token file is written here, once the endpoint listens: `DriverOpts::token_file`
    // would also print where it is, which the other ranks already know.
    let d = DriverOpts { join_timeout_ms: u.join_timeout_ms, certs, token_file: None };
    let listen = listen_addr(env);
    let (endpoint, auth, token) = rendezvous_endpoint(&listen, &d).with_context(|| format!("rank 0 of {}", env.describe))?;
    let at = endpoint.local_addr()?;
    let _file = match (trust, &token) {
        (Trust::TokenFile(path), Some(t)) => {
            write_token_file(path, t)?;
            Some(TokenFile { path: path.clone(), text: t.text() })
        }
        _ => None,
    };
    let how = match trust {
        Trust::Certs(dir) => format!("their certificates in {}", dir.display()),
        Trust::TokenFile(path) => format!("the join token in {}", path.display()),
    };
    let exe = std::env::current_exe().context("finding the tessera executable")?;
    let cwd = std::env::current_dir().context("the current directory")?;
    let own = AgentStart {
        ssh_host: None,
        join: env.master(),
        name: format!("rank0-{}", hostname()),
        rank: 0,
        certs: d.certs.as_deref(),
        token: token.as_ref(),
    };
    let launched = Arc::new(Mutex::new(vec![start_agent(&own, &exe, &cwd, None)?]));
    tracing::info!("train: rank 0 of {}: coordinating at {at}; ranks 1..={} join {} with {how}", env.describe, env.world - 1, env.master());
    let res = drive(u.config, common, u.opts.clone(), (endpoint, auth), env.world, &d, Arc::clone(&launched));
    reap(&launched, if res.is_ok() { REAP_TIMEOUT_MS } else { 0 });
    res
}

/// Ranks 1..: an agent of rank `RANK` joining `MASTER_ADDR:MASTER_PORT`.
fn join(env: &LauncherEnv, trust: &Trust, u: &UnderLauncher<'_>) -> Result<()> {
    let mut args = AgentArgs {
        join: env.master(),
        name: format!("rank{}-{}", env.rank, hostname()),
        rank: Some(env.rank),
        world: Some(env.world),
        advertise: None,
        quic_port: 0,
        credentials: AgentCredentials::Certs(PathBuf::new()),
        connect_timeout_ms: u.join_timeout_ms,
        worker_net: None,
    };
    let path = match trust {
        Trust::Certs(dir) => {
            args.credentials = AgentCredentials::Certs(dir.clone());
            return engine::run_agent(&args, &u.opts.faults);
        }
        Trust::TokenFile(path) => path,
    };
    let deadline = Instant::now() + Duration::from_millis(u.join_timeout_ms);
    let mut stale: Option<String> = None;
    loop {
        let token = wait_for_token(path, stale.as_deref(), deadline, u.join_timeout_ms)?;
        tracing::info!("train: rank {} of {}: joining {} with the join token in {}", env.rank, env.describe, env.master(), path.display());
        args.credentials = AgentCredentials::Token(token.clone());
        args.connect_timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis().max(1) as u64;
        match engine::run_agent(&args, &u.opts.faults) {
            // The file still held an earlier run's token when this rank read it: rank 0 is
            // replacing it.
            Err(e) if e.chain().any(|c| c.is::<engine::WrongCoordinator>()) && Instant::now() < deadline => {
                tracing::info!("train: rank {}: {} holds an earlier run's join token; waiting for rank 0's", env.rank, path.display());
                stale = Some(token);
            }
            r => return r,
        }
    }
}

/// The join token in `path` once it is there and is not `stale`, waiting until `deadline`.
fn wait_for_token(path: &Path, stale: Option<&str>, deadline: Instant, timeout_ms: u64) -> Result<String> {
    loop {
        if let Ok(mut f) = std::fs::File::open(path) {
            let from = path.display().to_string();
            if let Ok(text) = read_token(&mut f, &from) {
                if JoinToken::parse(&text).is_ok() && stale != Some(text.as_str()) {
                    return Ok(text);
                }
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "no join token from rank 0 in {} within {} s: rank 0 writes it once it listens (is it running? with ranks on \
                 several hosts the file must be on storage they share)",
                path.display(),
                timeout_ms / 1000
            );
        }
        std::thread::sleep(Duration::from_millis(TOKEN_POLL_MS));
    }
}
