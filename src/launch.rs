//! Multi-host runs: `tessera coordinator` (the driver, waiting for agents), `tessera agent` (one
//! rank on any host) and `tessera launch` (agents on the hosts of a DeepSpeed hostfile, started
//! over ssh, with the coordinator in this process). The rendezvous and the agents' life are
//! described in `tessera_fleet::rendezvous` and `engine::child`; this module reads hostfiles and the
//! torchrun/Slurm variables and starts the processes.
//!
//! # Hostfile (DeepSpeed's format)
//! One host per line, `HOST slots=N` (N agents on that host); `#` starts a comment; blank lines
//! are ignored. A host listed twice, a missing or zero `slots`, or anything else on a line is an
//! error naming `file:line`. `localhost`, `127.*` and `::1` are started directly (no ssh); any
//! other host (`HOST` or `USER@HOST`) runs `cd <this directory> && exec <this tessera> agent
//! --join …` through `ssh -o BatchMode=yes [SSH OPTIONS] HOST`, so every host needs tessera and
//! the data at the same paths. The ssh options ([`SshOpts`]: `--ssh-port` like DeepSpeed's
//! `--ssh_port`, `--ssh-identity`, `--ssh-config`, `--ssh-option KEY=VALUE`) come on top of the
//! ssh configuration, which stays the place for per-host users, ports and keys
//! (`~/.ssh/config`, or the `--ssh-config` file).
//! Ranks follow the file: the first host's agents are ranks 0..slots, and so on.
//!
//! # Joining
//! Without `--certs`, the coordinator makes a CA for the run (in memory), its own certificate
//! and a join token (`tsr1-<secret>-<SHA-256 of the CA>`), printed on its start line or written
//! to `--token-file`. An agent given the token (`--token`, `--token -` for standard input,
//! `--token-file`, or `$TESSERA_JOIN_TOKEN`) verifies the coordinator's TLS chain against the
//! pinned CA, proves itself with the secret over that encrypted connection and sends a public key
//! it generated; the coordinator certifies that key for the agent's rank. No private key leaves
//! its host. `tessera launch` hands its agents the token on standard input (through ssh).
//! With `--certs DIR` (made by `tessera cluster init`), the agents present their own
//! certificates (mutual TLS) and nothing is issued.
//!
//! # torchrun / Slurm variables (`tessera agent` without `--join`)
//! `MASTER_ADDR` and `MASTER_PORT` name the coordinator; the rank is `RANK`, else
//! `SLURM_PROCID`; the world size `WORLD_SIZE`, else `SLURM_NTASKS` (checked against the
//! coordinator's). `tessera coordinator` takes `--nodes` from `WORLD_SIZE` and `--listen` from
//! `0.0.0.0:$MASTER_PORT` when they are not given.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cli::{self, CommonArgs};
use crate::engine::{self, AgentArgs, AgentAuth, AgentCredentials, Launched, Rendezvous, RendezvousSlot, TrainOptions};
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlEndpoint, JoinToken, NodeTls};

mod nodelist;
mod role;
pub mod select;
mod under;

pub use role::{detect as launcher_env, slurm_batch_note, LauncherEnv};
pub use under::{train_under_launcher, UnderLauncher};

/// The environment variables torchrun and Slurm set that this module reads (launch removes them
/// from the agents it starts, whose ranks come from the coordinator).
pub const RANK_ENV: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
];

/// Bound on the launched agents' exit once the run is over (ms).
const REAP_TIMEOUT_MS: u64 = 15_000;
/// The environment variable an agent reads its join token from (when no flag gives one).
pub const TOKEN_ENV: &str = "TESSERA_JOIN_TOKEN";
/// Longest join token line read from standard input or a file (bytes).
const TOKEN_BYTES_MAX: usize = 256;

/// One line of a hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    pub host: String,
    pub slots: usize,
    /// 1-based line number in the file.
    pub line: usize,
}

/// Parses a DeepSpeed hostfile; `source` names it in errors (`source:line: …`).
pub fn parse_hostfile(text: &str, source: &str) -> Result<Vec<HostEntry>> {
    let mut hosts: Vec<HostEntry> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let at = |what: String| anyhow::anyhow!("{source}:{line}: {what} (expected `HOST slots=N`, got {:?})", raw.trim());
        let mut words = content.split_whitespace();
        let host = words.next().ok_or_else(|| at("no host".into()))?;
        if host.contains('=') {
            return Err(at(format!("{host:?} is not a host name")));
        }
        let slots = match words.next() {
            None => return Err(at(format!("host {host} has no slots"))),
            Some(w) => {
                let n = w.strip_prefix("slots=").ok_or_else(|| at(format!("unknown field {w:?}")))?;
                n.parse::<usize>().map_err(|_| at(format!("slots={n} is not a whole number")))?
            }
        };
        if slots == 0 {
            return Err(at(format!("host {host} has slots=0")));
        }
        if slots > crate::cli::LOCAL_RANKS_MAX {
            return Err(at(format!("host {host} has slots={slots}, more than the {} agents one host runs", crate::cli::LOCAL_RANKS_MAX)));
        }
        if let Some(w) = words.next() {
            return Err(at(format!("unexpected {w:?} after slots")));
        }
        if let Some(prev) = hosts.iter().find(|h| h.host == host) {
            return Err(at(format!("host {host} is already listed on line {}", prev.line)));
        }
        hosts.push(HostEntry { host: host.to_string(), slots, line });
    }
    if hosts.is_empty() {
        bail!("{source}: no hosts (expected lines of `HOST slots=N`)");
    }
    Ok(hosts)
}

/// Reads and parses a hostfile.
pub fn read_hostfile(path: &Path) -> Result<Vec<HostEntry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
    parse_hostfile(&text, &path.display().to_string())
}

/// Whether `host` is this machine without ssh: `localhost`, `127.*`, `::1` (a host with a
/// user, `USER@HOST`, always goes through ssh).
pub fn is_local(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The host part of a hostfile entry `[USER@]HOST`.
pub fn host_name(entry: &str) -> &str {
    entry.rsplit_once('@').map_or(entry, |(_, h)| h)
}

/// The first of `names` that is set, parsed as a whole number, with its name.
fn env_number(get: &dyn Fn(&str) -> Option<String>, names: &[&'static str]) -> Result<Option<(usize, &'static str)>> {
    for name in names {
        if let Some(v) = get(name) {
            let n = v.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a whole number"))?;
            return Ok(Some((n, *name)));
        }
    }
    Ok(None)
}

/// `HOST:PORT` with IPv6 literals bracketed.
fn host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

/// What the torchrun/Slurm variables say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvJoin {
    /// `MASTER_ADDR:MASTER_PORT`.
    pub join: String,
    /// `RANK`, else `SLURM_PROCID`.
    pub rank: Option<usize>,
    /// `WORLD_SIZE`, else `SLURM_NTASKS`.
    pub world: Option<usize>,
}

/// Where the torchrun/Slurm variables say to join; `None` when neither `MASTER_ADDR` nor
/// `MASTER_PORT` is set.
pub fn join_from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<EnvJoin>> {
    let (addr, port) = match (get("MASTER_ADDR"), get("MASTER_PORT")) {
        (None, None) => return Ok(None),
        (Some(_), None) => bail!("MASTER_ADDR is set but MASTER_PORT is not: both name the coordinator"),
        (None, Some(_)) => bail!("MASTER_PORT is set but MASTER_ADDR is not: both name the coordinator"),
        (Some(a), Some(p)) => (a, p),
    };
    let port: u16 = match port.trim().parse() {
        Ok(p) if p > 0 => p,
        _ => bail!("MASTER_PORT={port:?} is not a port number (expected 1 to 65535)"),
    };
    if addr.trim().is_empty() {
        bail!("MASTER_ADDR is empty");
    }
    let rank = env_number(get, &["RANK", "SLURM_PROCID"])?;
    let world = env_number(get, &["WORLD_SIZE", "SLURM_NTASKS"])?;
    if let (Some((r, rn)), Some((w, wn))) = (rank, world) {
        if r >= w {
            bail!("{rn}={r} is not a rank of {wn}={w}");
        }
    }
    if world.is_some_and(|(w, _)| w == 0) {
        bail!("the world size in the environment is 0");
    }
    Ok(Some(EnvJoin { join: host_port(addr.trim(), port), rank: rank.map(|r| r.0), world: world.map(|w| w.0) }))
}

/// The command-line flags of `tessera agent`.
#[derive(Debug, Clone, Default)]
pub struct AgentFlags {
    pub join: Option<String>,
    pub name: Option<String>,
    pub rank: Option<usize>,
    pub advertise: Option<IpAddr>,
    pub quic_port: u16,
    pub certs: Option<PathBuf>,
    /// The join token (`-`: read one line from standard input).
    pub token: Option<String>,
    /// A file holding the join token (as `tessera coordinator --token-file` writes it).
    pub token_file: Option<PathBuf>,
    pub connect_timeout_ms: u64,
    /// (`tessera chaos run`) A worker-net file whose fault link this agent's QUIC traffic
    /// crosses ([`AgentArgs::worker_net`]).
    pub worker_net: Option<PathBuf>,
    /// The process's test-only fault hooks (no-op unless a test or the chaos harness asked).
    pub faults: tessera_actors::faults::Faults,
}

/// Reads a join token: the first line of `r`, at most [`TOKEN_BYTES_MAX`] bytes.
pub fn read_token(r: &mut impl std::io::Read, from: &str) -> Result<String> {
    use std::io::{BufRead, Read};
    let mut text = String::new();
    std::io::BufReader::new(r.take(TOKEN_BYTES_MAX as u64))
        .read_line(&mut text)
        .with_context(|| format!("reading the join token from {from}"))?;
    let line = text.trim().to_string();
    if line.is_empty() {
        bail!("{from} holds no join token");
    }
    Ok(line)
}

/// How the agent proves it belongs to the run: `--certs DIR`, else the token from `--token`,
/// `--token-file` or `$TESSERA_JOIN_TOKEN` (`--token -` was already read from standard input).
fn agent_credentials(f: &AgentFlags, get: &dyn Fn(&str) -> Option<String>) -> Result<AgentCredentials> {
    if let Some(dir) = &f.certs {
        if f.token.is_some() || f.token_file.is_some() {
            bail!("give --certs DIR or a join token, not both");
        }
        return Ok(AgentCredentials::Certs(dir.clone()));
    }
    let token = match (&f.token, &f.token_file) {
        (Some(t), None) => t.clone(),
        (None, Some(path)) => {
            let mut file = std::fs::File::open(path).with_context(|| format!("--token-file {}", path.display()))?;
            read_token(&mut file, &format!("--token-file {}", path.display()))?
        }
        (Some(_), Some(_)) => bail!("give --token or --token-file, not both"),
        (None, None) => match get(TOKEN_ENV) {
            Some(t) if !t.trim().is_empty() => t.trim().to_string(),
            _ => bail!(
                "tessera agent needs the coordinator's join token (--token TOKEN, --token - to read it from standard input, --token-file PATH or ${TOKEN_ENV}) or a cluster directory (--certs DIR)"
            ),
        },
    };
    JoinToken::parse(&token)?;
    Ok(AgentCredentials::Token(token))
}

/// This host's name (for agents' default names).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "agent".to_string())
}

/// `--join`'s HOST:PORT, checked before any attempt to connect: a malformed address would
/// otherwise be retried for the whole `--connect-timeout`.
fn check_join(j: &str) -> Result<String> {
    let j = j.trim();
    let expected = "expected HOST:PORT, e.g. 10.0.0.1:29500 or [fd00::1]:29500";
    let Some((host, port)) = j.rsplit_once(':') else { bail!("--join {j:?}: no port ({expected})") };
    if host.trim_start_matches('[').trim_end_matches(']').is_empty() {
        bail!("--join {j:?}: no host ({expected})");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(j.to_string()),
        _ => bail!("--join {j:?}: {port:?} is not a port number from 1 to 65535 ({expected})"),
    }
}

/// Resolves `tessera agent`'s arguments: `--join` (and `--rank`) as given, else the
/// torchrun/Slurm variables read through `get`; the default name is `<hostname>-<pid>`.
pub fn agent_args(f: &AgentFlags, get: &dyn Fn(&str) -> Option<String>) -> Result<AgentArgs> {
    let (join, rank, world) = match &f.join {
        Some(j) => (check_join(j)?, f.rank, None),
        None => match join_from_env(get)? {
            Some(e) => (e.join, f.rank.or(e.rank), e.world),
            None => bail!("tessera agent needs --join HOST:PORT, or MASTER_ADDR and MASTER_PORT in the environment (torchrun, Slurm)"),
        },
    };
    if let (Some(r), Some(w)) = (rank, world) {
        if r >= w {
            bail!("rank {r} is not a rank of a world of {w}");
        }
    }
    if let (Some(net), true) = (&f.worker_net, f.advertise.is_some() || f.quic_port != 0) {
        bail!(
            "--worker-net {}: the fault link binds the QUIC socket itself (on the route to the coordinator); not with --advertise or --quic-port",
            net.display()
        );
    }
    let name = f.name.clone().unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    Ok(AgentArgs {
        join,
        name,
        rank,
        world,
        advertise: f.advertise,
        quic_port: f.quic_port,
        credentials: agent_credentials(f, get)?,
        connect_timeout_ms: f.connect_timeout_ms,
        worker_net: f.worker_net.clone(),
    })
}

/// `tessera agent`.
pub fn agent(f: &AgentFlags) -> Result<()> {
    let mut f = f.clone();
    if f.token.as_deref() == Some("-") {
        f.token = Some(read_token(&mut std::io::stdin().lock(), "standard input")?);
    }
    let args = agent_args(&f, &|k| std::env::var(k).ok())?;
    engine::run_agent(&args, &f.faults)
}

/// The rendezvous settings shared by `tessera coordinator` and `tessera launch`.
#[derive(Debug, Clone)]
pub struct DriverOpts {
    pub join_timeout_ms: u64,
    /// A pre-distributed cluster directory (`ca.pem`, `coordinator.{pem,key}`, `node-<r>.*`):
    /// agents present their own certificates and nothing is issued.
    pub certs: Option<PathBuf>,
    /// Write the join token here (mode 0600) instead of printing it.
    pub token_file: Option<PathBuf>,
}

/// The coordinator's control endpoint on `listen` and how agents join it: with `--certs`, mutual
/// TLS with the directory's certificates; otherwise a CA made for this run (in memory), a
/// certificate for the coordinator and a join token pinning that CA. Returns also the token.
/// (Also where `tessera serve --rank-listen` waits for its `serve-rank`s.)
pub fn rendezvous_endpoint(listen: &str, d: &DriverOpts) -> Result<(ControlEndpoint, AgentAuth, Option<JoinToken>)> {
    if let (Some(dir), Some(file)) = (&d.certs, &d.token_file) {
        bail!(
            "--token-file {} with --certs {}: agents of a cluster directory join with their own certificates, there is no \
             token to write; drop one of the two",
            file.display(),
            dir.display()
        );
    }
    let addr: SocketAddr = listen
        .to_socket_addrs()
        .with_context(|| format!("the listen address {listen:?}"))?
        .next()
        .with_context(|| format!("{listen:?} resolves to no address"))?;
    let (identity, auth, token, client_auth) = match &d.certs {
        Some(dir) => {
            let identity = NodeTls::load(dir, engine::COORDINATOR_NAME).with_context(|| {
                format!("--certs {}: the coordinator's identity (make the directory with `tessera cluster init`)", dir.display())
            })?;
            (identity, AgentAuth::Certs { dir: dir.clone() }, None, ClientAuth::Required)
        }
        None => {
            let ca = ClusterCa::generate()?;
            let identity = ca.issue(engine::COORDINATOR_NAME)?;
            let token = JoinToken::generate(ca.ca_sha256())?;
            (identity, AgentAuth::Token { ca: Box::new(ca), token: token.clone() }, Some(token), ClientAuth::Optional)
        }
    };
    let server = engine::control_server_config(&identity, client_auth)?;
    let endpoint = ControlEndpoint::bind(addr, Some(server)).with_context(|| format!("listening for agents on {listen}"))?;
    Ok((endpoint, auth, token))
}

/// Writes the join token to `path` (mode 0600): whole, to a new private file next to it, then
/// renamed into place, so whoever waits for the file never reads half a token, and an existing
/// file (or a symlink planted there) is replaced, not written through.
fn write_token_file(path: &Path, t: &JoinToken) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp_name = path.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "token".into());
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("--token-file {}: creating {}", path.display(), tmp.display()))?;
    writeln!(f, "{}", t.text()).with_context(|| format!("writing the join token to {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| format!("--token-file {}: renaming {} into place", path.display(), tmp.display()))
}

/// How the coordinator's start line tells its joiners (`command`: `tessera agent`, `tessera
/// serve-rank --model DIR`) to join, and where the token is (written to `--token-file` here).
pub fn join_hint(command: &str, at: SocketAddr, d: &DriverOpts, token: Option<&JoinToken>) -> Result<String> {
    Ok(match (token, &d.token_file) {
        (None, _) => format!("`{command} --join {at} --certs DIR`"),
        (Some(t), Some(path)) => {
            write_token_file(path, t)?;
            format!("`{command} --join {at} --token-file {}`", path.display())
        }
        (Some(t), None) => format!("`{command} --join {at} --token {}`", t.text()),
    })
}

/// `--nodes`, else `WORLD_SIZE` from `get`; checked against `--world`.
pub fn resolve_nodes(nodes: Option<usize>, world: Option<usize>, get: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let n = match nodes {
        Some(n) => n,
        None => match env_number(get, &["WORLD_SIZE"])? {
            Some((n, _)) => n,
            None => bail!("how many agents? give --nodes N (or WORLD_SIZE in the environment)"),
        },
    };
    if n == 0 {
        bail!("the coordinator needs at least one agent (--nodes 0)");
    }
    if let Some(w) = world.filter(|w| *w != n) {
        bail!("--world {w} disagrees with {n} agents: the world size is the number of agents");
    }
    Ok(n)
}

/// Trains with the ranks joining at `listener` (after `launched` were started for them).
fn drive(
    config: &Path,
    common: &CommonArgs,
    mut opts: TrainOptions,
    (endpoint, auth): (ControlEndpoint, AgentAuth),
    nodes: usize,
    d: &DriverOpts,
    launched: Arc<Mutex<Vec<Launched>>>,
) -> Result<bool> {
    let mut common = common.clone();
    common.world = Some(nodes);
    opts.processes = true;
    opts.rendezvous = RendezvousSlot::new(Rendezvous { endpoint, auth, nodes, join_timeout_ms: d.join_timeout_ms, launched });
    // A run that fails before starting its ranks drops the rendezvous unused with `opts`.
    cli::train_agents(config, &common, opts)
}

/// The config with the world size `nodes`, checked before the join token is printed or any
/// agent started: a mistake in it would otherwise end the run only once the agents are up.
fn check_config(config: &Path, common: &CommonArgs, nodes: usize) -> Result<()> {
    let mut common = common.clone();
    common.world = Some(nodes);
    cli::load_config(config, &common).map(drop)
}

/// `tessera coordinator`: waits for `nodes` agents at `listen` and trains.
pub fn coordinator(
    config: &Path,
    common: &CommonArgs,
    opts: TrainOptions,
    listen: Option<&str>,
    nodes: Option<usize>,
    d: &DriverOpts,
) -> Result<bool> {
    let get = |k: &str| std::env::var(k).ok();
    let nodes = resolve_nodes(nodes, common.world, &get)?;
    check_config(config, common, nodes)?;
    let listen = match (listen, get("MASTER_PORT")) {
        (Some(l), _) => l.to_string(),
        (None, Some(p)) => match p.trim().parse::<u16>() {
            Ok(port) => format!("0.0.0.0:{port}"),
            Err(_) => bail!("MASTER_PORT={p:?} is not a port number (expected 0 to 65535; or give --listen ADDR:PORT)"),
        },
        (None, None) => bail!("where should agents join? give --listen ADDR:PORT (or MASTER_PORT in the environment)"),
    };
    let (endpoint, auth, token) = rendezvous_endpoint(&listen, d)?;
    let at = endpoint.local_addr()?;
    let hint = join_hint("tessera agent", at, d, token.as_ref())?;
    // The command's answer (how to join), not a log line: shown even with -q.
    eprintln!("coordinator: waiting for {nodes} agents at {at} (join with {hint})");
    drive(config, common, opts, (endpoint, auth), nodes, d, Arc::new(Mutex::new(Vec::new())))
}

/// Quotes `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The local address this machine uses to reach `host` (no packet is sent).
fn route_to(host: &str) -> Result<IpAddr> {
    let addr: SocketAddr = (host, 9).to_socket_addrs().with_context(|| format!("resolving host {host}"))?.next().context("no address")?;
    tessera_fleet::agent::route_to(addr).with_context(|| format!("host {host}"))
}

/// The options of `tessera launch`.
#[derive(Debug, Clone)]
pub struct LaunchOpts {
    /// DeepSpeed's hostfile; `None`: `localhost` with `--num_gpus` slots.
    pub hostfile: Option<PathBuf>,
    /// DeepSpeed's `--include`, `--exclude`, `--num_nodes`, `--num_gpus`.
    pub select: select::Selection,
    /// The coordinator's listen address; default 127.0.0.1:0 when every host is local, else
    /// 0.0.0.0:0.
    pub listen: Option<String>,
    /// The address remote agents dial; default the local address on the route to each host.
    pub coordinator_addr: Option<IpAddr>,
    /// tessera's path on the remote hosts (default: this executable's path).
    pub remote_exe: Option<String>,
    /// The ssh program.
    pub ssh: String,
    /// How ssh reaches the remote hosts (port, identity, config file, options).
    pub ssh_opts: SshOpts,
}

/// ssh settings of `tessera launch`, on top of what the ssh configuration (`~/.ssh/config`, or
/// the file given with `config`) says for each host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SshOpts {
    /// `-p PORT` (DeepSpeed's `--ssh_port`).
    pub port: Option<u16>,
    /// `-i FILE`: the private key to log in with.
    pub identity: Option<PathBuf>,
    /// `-F FILE`: an ssh configuration read instead of `~/.ssh/config`.
    pub config: Option<PathBuf>,
    /// `-o KEY=VALUE` each, in order (e.g. `User=ubuntu`, `StrictHostKeyChecking=accept-new`).
    pub options: Vec<String>,
}

impl SshOpts {
    /// Checks the options (each `KEY=VALUE`) and the files (they exist).
    pub fn check(&self) -> Result<()> {
        for o in &self.options {
            let key = o.split('=').next().unwrap_or("");
            if !o.contains('=') || key.trim().is_empty() || key.contains(char::is_whitespace) {
                bail!("--ssh-option {o:?}: expected KEY=VALUE, e.g. StrictHostKeyChecking=accept-new");
            }
        }
        for (flag, file) in [("--ssh-identity", &self.identity), ("--ssh-config", &self.config)] {
            if let Some(f) = file.as_ref().filter(|f| !f.is_file()) {
                bail!("{flag} {}: no such file", f.display());
            }
        }
        Ok(())
    }

    /// The arguments of `ssh` that run the shell command `line` on `host` (`[USER@]HOST`):
    /// `-o BatchMode=yes` (never prompt: a missing key fails the start instead of hanging it),
    /// then port, identity, config file and options as given, then the host and the command.
    pub fn args(&self, host: &str, line: &str) -> Vec<String> {
        let mut a: Vec<String> = vec!["-o".into(), "BatchMode=yes".into()];
        if let Some(p) = self.port {
            a.extend(["-p".into(), p.to_string()]);
        }
        if let Some(i) = &self.identity {
            a.extend(["-i".into(), i.display().to_string()]);
        }
        if let Some(f) = &self.config {
            a.extend(["-F".into(), f.display().to_string()]);
        }
        for o in &self.options {
            a.extend(["-o".into(), o.clone()]);
        }
        a.extend([host.to_string(), line.to_string()]);
        a
    }
}

/// Ends the processes `launched` (waiting up to `bound_ms` for each to exit by itself).
fn reap(launched: &Mutex<Vec<Launched>>, bound_ms: u64) {
    let deadline = Instant::now() + Duration::from_millis(bound_ms);
    for l in launched.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
        while matches!(l.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = l.child.try_wait() {
            tracing::info!("launch: {} still running after the run; killing it", l.label);
            let _ = l.child.kill();
        }
        let _ = l.child.wait();
    }
}

/// One agent for `launch` (or for rank 0 of a torchrun/Slurm job) to start.
struct AgentStart<'a> {
    /// `None`: this machine, directly; else `[USER@]HOST` through ssh.
    ssh_host: Option<&'a str>,
    join: String,
    name: String,
    rank: usize,
    certs: Option<&'a Path>,
    token: Option<&'a JoinToken>,
}

/// Starts `a` (locally, or through `l`'s ssh), in its own process group.
fn start_agent(a: &AgentStart<'_>, exe: &Path, cwd: &Path, l: Option<&LaunchOpts>) -> Result<Launched> {
    use std::os::unix::process::CommandExt;
    let mut agent_args =
        vec!["agent".to_string(), "--join".into(), a.join.clone(), "--name".into(), a.name.clone(), "--rank".into(), a.rank.to_string()];
    match a.certs {
        Some(c) => agent_args.extend(["--certs".to_string(), c.display().to_string()]),
        // The token goes on standard input: never on a command line (`ps`) or in an
        // environment that outlives the agent.
        None => agent_args.extend(["--token".to_string(), "-".to_string()]),
    }
    let (mut cmd, label, program) = match (a.ssh_host, l) {
        (Some(host), Some(l)) => {
            let remote_exe = l.remote_exe.clone().unwrap_or_else(|| exe.display().to_string());
            let mut line = format!("cd {} && exec {}", shell_quote(&cwd.display().to_string()), shell_quote(&remote_exe));
            for w in &agent_args {
                line.push(' ');
                line.push_str(&shell_quote(w));
            }
            let mut c = Command::new(&l.ssh);
            c.args(l.ssh_opts.args(host, &line));
            (c, format!("agent {} (ssh {host})", a.name), l.ssh.clone())
        }
        _ => {
            let mut c = Command::new(exe);
            c.args(&agent_args).current_dir(cwd);
            (c, format!("agent {} (local)", a.name), exe.display().to_string())
        }
    };
    for v in RANK_ENV {
        cmd.env_remove(v);
    }
    cmd.env_remove(TOKEN_ENV);
    // Own process group: a terminal's Ctrl-C reaches only this process, which stops between
    // steps and then ends the agents.
    let mut child = cmd
        .stdin(if a.token.is_some() { Stdio::piped() } else { Stdio::null() })
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {label} ({program})"))?;
    if let (Some(t), Some(mut stdin)) = (a.token, child.stdin.take()) {
        // An agent that dies first is noticed by the run; its broken pipe is not news.
        let _ = writeln!(stdin, "{}", t.text());
    }
    Ok(Launched { label, child })
}

/// `tessera launch`: starts one agent per selected slot of each hostfile host (DeepSpeed's
/// `--include`/`--exclude`/`--num_nodes`/`--num_gpus`; without a hostfile, `localhost` with
/// `--num_gpus` slots) and coordinates them from here.
pub fn launch(config: &Path, common: &CommonArgs, opts: TrainOptions, l: &LaunchOpts, d: &DriverOpts) -> Result<bool> {
    l.ssh_opts.check()?;
    let (offered, source) = match &l.hostfile {
        Some(path) => (read_hostfile(path)?, path.display().to_string()),
        None => match l.select.num_gpus {
            Some(n) if (1..=crate::cli::LOCAL_RANKS_MAX).contains(&n) => {
                (vec![HostEntry { host: "localhost".into(), slots: n, line: 0 }], "the local host (no --hostfile)".to_string())
            }
            _ => bail!(
                "tessera launch needs --hostfile FILE (lines of `HOST slots=N`), or --num_gpus N (1 to {}) for N agents on this machine",
                crate::cli::LOCAL_RANKS_MAX
            ),
        },
    };
    let hosts = select::select(&offered, &l.select, &source)?;
    let nodes: usize = hosts.iter().map(|h| h.slots.len()).sum();
    let nodes = resolve_nodes(Some(nodes), common.world, &|_| None)?;
    check_config(config, common, nodes)?;
    let all_local = hosts.iter().all(|h| is_local(&h.host));
    let listen = l.listen.clone().unwrap_or_else(|| if all_local { "127.0.0.1:0" } else { "0.0.0.0:0" }.to_string());
    let (endpoint, auth, token) = rendezvous_endpoint(&listen, d)?;
    let at = endpoint.local_addr()?;
    if d.token_file.is_some() {
        // The launched agents get the token over ssh; the file is for agents started by hand
        // (an elastic run's joins).
        // The command's answer (how to join), not a log line: shown even with -q.
        eprintln!("launch: more agents can join with {}", join_hint("tessera agent", at, d, token.as_ref())?);
    }
    let exe = std::env::current_exe().context("finding the tessera executable")?;
    let cwd = std::env::current_dir().context("the current directory")?;
    let launched: Arc<Mutex<Vec<Launched>>> = Arc::new(Mutex::new(Vec::new()));
    let started = (|| -> Result<()> {
        for h in &hosts {
            let local = is_local(&h.host);
            // Local agents of a hostfile with remote hosts must be reachable from those hosts:
            // they join (and so bind their QUIC socket) on the route to the first remote host.
            let via = match local {
                true => hosts.iter().find(|r| !is_local(&r.host)).unwrap_or(h),
                false => h,
            };
            let join_ip = match (l.coordinator_addr, at.ip()) {
                (Some(ip), _) => ip,
                (None, ip) if !ip.is_unspecified() => ip,
                (None, _) if is_local(&via.host) => IpAddr::from([127, 0, 0, 1]),
                (None, _) => route_to(host_name(&via.host))
                    .with_context(|| format!("{source}:{}: the address {} can reach this machine at", via.line, via.host))?,
            };
            let join = SocketAddr::new(join_ip, at.port()).to_string();
            for slot in &h.slots {
                let name: String = format!("{}-{slot}", h.host)
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '-' })
                    .collect();
                // Ranks follow the file, as DeepSpeed's launcher numbers them.
                let rank = launched.lock().unwrap_or_else(|p| p.into_inner()).len();
                let a = AgentStart {
                    ssh_host: (!local).then_some(h.host.as_str()),
                    join: join.clone(),
                    name,
                    rank,
                    certs: d.certs.as_deref(),
                    token: token.as_ref(),
                };
                let agent = start_agent(&a, &exe, &cwd, Some(l))?;
                launched.lock().unwrap_or_else(|p| p.into_inner()).push(agent);
            }
        }
        Ok(())
    })();
    if let Err(e) = started {
        reap(&launched, 0);
        return Err(e);
    }
    tracing::info!("launch: started {nodes} agents on {} hosts; coordinating at {at}", hosts.len());
    let res = drive(config, common, opts, (endpoint, auth), nodes, d, Arc::clone(&launched));
    reap(&launched, if res.is_ok() { REAP_TIMEOUT_MS } else { 0 });
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| m.get(k).cloned()
    }

    #[test]
    fn hostfiles_parse_with_comments_and_blank_lines() {
        let text = "# cluster\n\nworker-1 slots=4   # big box\n  10.0.0.2 slots=1\nlocalhost\tslots=2\n";
        let h = parse_hostfile(text, "hf").unwrap();
        let got: Vec<(&str, usize, usize)> = h.iter().map(|e| (e.host.as_str(), e.slots, e.line)).collect();
        assert_eq!(got, vec![("worker-1", 4, 3), ("10.0.0.2", 1, 4), ("localhost", 2, 5)]);
    }

    #[test]
    fn bad_hostfile_lines_are_named_by_file_and_line() {
        for (text, line, what) in [
            ("a slots=1\nb\n", 2, "no slots"),
            ("a slots=x\n", 1, "not a whole number"),
            ("a slots=0\n", 1, "slots=0"),
            ("a slots=100000\n", 1, "slots=100000, more than the 1024 agents"),
            ("a slots=1\n\na slots=2\n", 3, "already listed on line 1"),
            ("a gpus=2\n", 1, "unknown field"),
            ("a slots=1 b\n", 1, "unexpected"),
            ("slots=2\n", 1, "not a host name"),
        ] {
            let e = parse_hostfile(text, "hosts.txt").unwrap_err().to_string();
            assert!(e.starts_with(&format!("hosts.txt:{line}: ")) && e.contains(what), "{text:?}: {e}");
        }
        assert!(parse_hostfile("# nothing\n\n", "h").unwrap_err().to_string().contains("no hosts"));
    }

    /// A malformed `--join` is refused at once, not retried for the whole connect timeout.
    #[test]
    fn a_malformed_join_address_is_refused_before_connecting() {
        let flags = |join: &str| AgentFlags { join: Some(join.to_string()), token: Some("x".into()), ..Default::default() };
        for (join, what) in [
            ("127.0.0.1", "no port"),
            ("127.0.0.1:notaport", "\"notaport\" is not a port number"),
            ("host:0", "\"0\" is not a port number"),
            ("host:70000", "\"70000\" is not a port number"),
            (":29500", "no host"),
            ("[]:29500", "no host"),
        ] {
            let e = agent_args(&flags(join), &|_| None).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--join {join:?}: ")) && e.contains(what) && e.contains("HOST:PORT"), "{join}: {e}");
        }
        for join in ["10.0.0.1:29500", "head:1", "[fd00::1]:29500"] {
            assert_eq!(check_join(join).unwrap(), join);
        }
    }

    #[test]
    fn local_hosts_are_recognised() {
        assert!(is_local("localhost") && is_local("127.0.0.1") && is_local("127.1.2.3") && is_local("::1"));
        assert!(!is_local("10.0.0.1") && !is_local("node1") && !is_local("localhost.example"));
    }

    fn ej(join: &str, rank: Option<usize>, world: Option<usize>) -> EnvJoin {
        EnvJoin { join: join.to_string(), rank, world }
    }

    #[test]
    fn torchrun_and_slurm_variables_resolve() {
        assert_eq!(join_from_env(&env(&[])).unwrap(), None);
        let t = env(&[("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "29500"), ("RANK", "2"), ("WORLD_SIZE", "4")]);
        assert_eq!(join_from_env(&t).unwrap(), Some(ej("10.1.2.3:29500", Some(2), Some(4))));
        let s = env(&[("MASTER_ADDR", "head"), ("MASTER_PORT", "7000"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "3")]);
        assert_eq!(join_from_env(&s).unwrap(), Some(ej("head:7000", Some(1), Some(3))));
        // torchrun's variables win over Slurm's; IPv6 literals are bracketed.
        let both = env(&[("MASTER_ADDR", "fd00::1"), ("MASTER_PORT", "1"), ("RANK", "0"), ("SLURM_PROCID", "5"), ("WORLD_SIZE", "2")]);
        assert_eq!(join_from_env(&both).unwrap(), Some(ej("[fd00::1]:1", Some(0), Some(2))));
        let no_rank = env(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]);
        assert_eq!(join_from_env(&no_rank).unwrap(), Some(ej("h:1", None, None)));
    }

    #[test]
    fn bad_variables_are_named() {
        for (pairs, what) in [
            (&[("MASTER_ADDR", "h")][..], "MASTER_PORT is not"),
            (&[("MASTER_PORT", "1")][..], "MASTER_ADDR is not"),
            (&[("MASTER_ADDR", "h"), ("MASTER_PORT", "x")][..], "MASTER_PORT=\"x\""),
            (&[("MASTER_ADDR", "h"), ("MASTER_PORT", "0")][..], "MASTER_PORT=\"0\" is not a port number"),
            (&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "-1")][..], "RANK=\"-1\""),
            (&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "3"), ("WORLD_SIZE", "3")][..], "RANK=3 is not a rank of WORLD_SIZE=3"),
            (&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("SLURM_PROCID", "4"), ("SLURM_NTASKS", "2")][..], "SLURM_PROCID=4"),
        ] {
            let e = join_from_env(&env(pairs)).unwrap_err().to_string();
            assert!(e.contains(what), "{pairs:?}: {e}");
        }
    }

    const TOKEN: &str = "tsr1-000102030405060708090a0b0c0d0e0f-00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn agents_take_a_token_from_a_flag_a_file_or_the_environment_or_else_certificates() {
        let from_env = env(&[(TOKEN_ENV, TOKEN)]);
        let creds = |f: AgentFlags, get: &dyn Fn(&str) -> Option<String>| agent_credentials(&f, get);
        assert_eq!(creds(AgentFlags::default(), &from_env).unwrap(), AgentCredentials::Token(TOKEN.into()));
        let f = AgentFlags { token: Some(TOKEN.into()), ..AgentFlags::default() };
        assert_eq!(creds(f, &env(&[])).unwrap(), AgentCredentials::Token(TOKEN.into()));
        let dir = tempfile_dir();
        let path = dir.join("token");
        std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
        let f = AgentFlags { token_file: Some(path.clone()), ..AgentFlags::default() };
        assert_eq!(creds(f, &env(&[])).unwrap(), AgentCredentials::Token(TOKEN.into()));
        let f = AgentFlags { certs: Some(dir.clone()), ..AgentFlags::default() };
        assert_eq!(creds(f, &from_env).unwrap(), AgentCredentials::Certs(dir.clone()));
        let e = creds(AgentFlags::default(), &env(&[])).unwrap_err().to_string();
        assert!(e.contains("--token") && e.contains(TOKEN_ENV) && e.contains("--certs"), "{e}");
        let e = creds(AgentFlags { token: Some("tsr1-xyz".into()), ..AgentFlags::default() }, &env(&[])).unwrap_err().to_string();
        assert!(e.contains("not a join token"), "{e}");
        let both = AgentFlags { token: Some(TOKEN.into()), certs: Some(dir.clone()), ..AgentFlags::default() };
        assert!(creds(both, &env(&[])).unwrap_err().to_string().contains("not both"));
        let mut line = &b"  tsr1-abc  \nrest"[..];
        assert_eq!(read_token(&mut line, "x").unwrap(), "tsr1-abc");
        assert!(read_token(&mut &b"\n"[..], "stdin").unwrap_err().to_string().contains("stdin holds no join token"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tessera-launch-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn agent_flags_win_over_the_environment() {
        let t = env(&[("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "29500"), ("RANK", "2"), ("WORLD_SIZE", "4"), (TOKEN_ENV, TOKEN)]);
        let f = AgentFlags { name: Some("n".into()), ..AgentFlags::default() };
        let a = agent_args(&f, &t).unwrap();
        assert_eq!((a.join.as_str(), a.rank, a.world, a.name.as_str()), ("10.1.2.3:29500", Some(2), Some(4), "n"));
        // --join ignores the variables (a launcher's own RANK must not leak into its agents).
        let f = AgentFlags { join: Some("127.0.0.1:5".into()), ..AgentFlags::default() };
        let a = agent_args(&f, &t).unwrap();
        assert_eq!((a.join.as_str(), a.rank, a.world), ("127.0.0.1:5", None, None));
        assert!(!a.name.is_empty());
        let e = agent_args(&AgentFlags::default(), &env(&[(TOKEN_ENV, TOKEN)])).unwrap_err().to_string();
        assert!(e.contains("--join") && e.contains("MASTER_ADDR"), "{e}");
        let f = AgentFlags { rank: Some(7), ..AgentFlags::default() };
        assert!(agent_args(&f, &t).unwrap_err().to_string().contains("rank 7"));
        // The fault link binds the QUIC socket itself.
        let net = Some(PathBuf::from("net.json"));
        let f = AgentFlags { worker_net: net.clone(), ..AgentFlags::default() };
        assert_eq!(agent_args(&f, &t).unwrap().worker_net, net);
        let f = AgentFlags { worker_net: net.clone(), advertise: Some([10, 0, 0, 1].into()), ..AgentFlags::default() };
        assert!(agent_args(&f, &t).unwrap_err().to_string().contains("--advertise"));
        let f = AgentFlags { worker_net: net, quic_port: 4000, ..AgentFlags::default() };
        assert!(agent_args(&f, &t).unwrap_err().to_string().contains("--quic-port"));
    }

    #[test]
    fn nodes_come_from_the_flag_or_world_size() {
        assert_eq!(resolve_nodes(Some(3), None, &env(&[("WORLD_SIZE", "5")])).unwrap(), 3);
        assert_eq!(resolve_nodes(None, None, &env(&[("WORLD_SIZE", "5")])).unwrap(), 5);
        assert!(resolve_nodes(None, None, &env(&[])).unwrap_err().to_string().contains("--nodes"));
        assert!(resolve_nodes(Some(3), Some(2), &env(&[])).unwrap_err().to_string().contains("--world 2"));
        assert!(resolve_nodes(Some(0), None, &env(&[])).is_err());
    }

    #[test]
    fn ssh_arguments_carry_port_identity_config_and_options_before_the_host() {
        let plain = SshOpts::default();
        assert_eq!(plain.args("h1", "cmd"), ["-o", "BatchMode=yes", "h1", "cmd"]);
        let o = SshOpts {
            port: Some(2222),
            identity: Some(PathBuf::from("/k/id")),
            config: Some(PathBuf::from("/k/cfg")),
            options: vec!["User=root".into(), "StrictHostKeyChecking=yes".into()],
        };
        let want = [
            "-o",
            "BatchMode=yes",
            "-p",
            "2222",
            "-i",
            "/k/id",
            "-F",
            "/k/cfg",
            "-o",
            "User=root",
            "-o",
            "StrictHostKeyChecking=yes",
            "ubuntu@h2",
            "cd /x && exec t",
        ];
        assert_eq!(o.args("ubuntu@h2", "cd /x && exec t"), want);
        for bad in ["User", "=x", "Strict HostKeyChecking=no"] {
            let e = SshOpts { options: vec![bad.into()], ..SshOpts::default() }.check().unwrap_err().to_string();
            assert!(e.contains("--ssh-option") && e.contains("KEY=VALUE"), "{bad}: {e}");
        }
        let e = SshOpts { identity: Some(PathBuf::from("/no/such/key")), ..SshOpts::default() }.check().unwrap_err().to_string();
        assert!(e.contains("--ssh-identity /no/such/key: no such file"), "{e}");
        assert_eq!((host_name("u@h"), host_name("h"), is_local("root@localhost")), ("h", "h", false));
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
