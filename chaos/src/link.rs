//! Elastic worker processes on a chaos test network: the file through which `tessera chaos run`
//! tells an elastic `train --nprocs N` run where its workers live ([`WorkerNet`]: one network
//! namespace per worker, the driver's address on their bridge), and the fault link a worker
//! puts in front of its QUIC traffic ([`WorkerLink`]).
//!
//! # The fault link
//! With [`WorkerNet::links`] set, each worker binds every epoch's QUIC endpoint on its
//! namespace's loopback and a [`FaultProxy`] on its namespace address, advertises the proxy, and
//! dials each peer through the proxy's alias for that peer ([`FaultProxy::alias`]). So every
//! datagram the worker sends or receives over QUIC — connections it accepts and connections it
//! dials — crosses the proxy, whose faults the harness sets at any time by writing
//! `<links>/<id>.json` (a [`LinkSetting`]); the worker polls it every [`LINK_POLL_MS`] and writes
//! what its proxies did to `<links>/<id>.stats.json`. A clean setting relays untouched.

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::proxy::{FaultProxy, LinkFaults, ProxyOptions, ProxyStats};

/// The name of the copy of the [`WorkerNet`] file in a run's `procs` folder (workers and
/// joiners read it from there).
pub const WORKER_NET_FILE: &str = "worker_net.json";
/// How often a worker looks at its link file (ms).
pub const LINK_POLL_MS: u64 = 20;
/// Epoch proxies a worker keeps alive: the current one and the ones before it, whose groups may
/// still be saying goodbye (older ones are dropped).
const PROXIES_KEPT: usize = 3;
/// A worker reports its link's stats every this many polls (when they changed).
const STATS_EVERY_POLLS: u64 = 10;

/// Where the workers of an elastic run live (written by the chaos harness, read by the driver
/// through `tessera train --worker-net FILE`, copied into `<output>/procs/`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerNet {
    /// The driver's address on the workers' bridge: its control listener binds it.
    pub control_ip: IpAddr,
    /// The network namespace of spawned worker `i` (ranks `0..N` of the first epoch); joiners
    /// run where their starter put them.
    pub netns: Vec<String>,
    /// When set, every worker's QUIC traffic crosses a fault proxy in its own process,
    /// controlled through this folder (see the module doc).
    #[serde(default)]
    pub links: Option<PathBuf>,
}

/// What went wrong with a worker-net or link file.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// (`err`, not `source`: the message carries it, so a context chain says it once.)
    #[error("{what} {path}: {err}")]
    Io { what: &'static str, path: PathBuf, err: io::Error },
    #[error("{path}: {detail}")]
    Invalid { path: PathBuf, detail: String },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LinkError + 'a {
    move |err| LinkError::Io { what, path: path.to_path_buf(), err }
}

/// Writes `text` to `path` through a temporary file and a rename: a reader never sees half.
fn write_atomic(path: &Path, text: &str) -> Result<(), LinkError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(io_err("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("renaming into place", path))
}

impl WorkerNet {
    /// Reads and checks a worker-net file: every namespace must exist (`ip netns add` makes
    /// `/run/netns/<name>`).
    pub fn load(path: &Path) -> Result<WorkerNet, LinkError> {
        let text = std::fs::read_to_string(path).map_err(io_err("reading", path))?;
        let bad = |detail: String| LinkError::Invalid { path: path.to_path_buf(), detail };
        let net: WorkerNet = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if net.netns.is_empty() {
            return Err(bad("netns lists no namespace".into()));
        }
        for ns in &net.netns {
            if ns.is_empty() || ns.contains('/') {
                return Err(bad(format!("netns {ns:?} is not a namespace name")));
            }
            if !Path::new("/run/netns").join(ns).exists() {
                return Err(bad(format!("network namespace {ns:?} does not exist (no /run/netns/{ns}; make it with `ip netns add`)")));
            }
        }
        Ok(net)
    }

    pub fn write(&self, path: &Path) -> Result<(), LinkError> {
        let text =
            serde_json::to_string_pretty(self).map_err(|e| LinkError::Invalid { path: path.to_path_buf(), detail: e.to_string() })?;
        write_atomic(path, &text)
    }

    /// The setting file of worker `id`'s fault link.
    pub fn link_file(links: &Path, id: u64) -> PathBuf {
        links.join(format!("{id}.json"))
    }

    /// Where worker `id` reports what its fault link did.
    pub fn stats_file(links: &Path, id: u64) -> PathBuf {
        links.join(format!("{id}.stats.json"))
    }
}

/// The faults of one worker's link and the seed their draws start from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSetting {
    pub faults: LinkFaults,
    pub seed: u64,
}

impl LinkSetting {
    /// Writes the setting for a worker to pick up (atomically).
    pub fn write(&self, path: &Path) -> Result<(), LinkError> {
        let text = serde_json::to_string(self).map_err(|e| LinkError::Invalid { path: path.to_path_buf(), detail: e.to_string() })?;
        write_atomic(path, &text)
    }

    /// Reads a setting; a missing file is a clean link.
    pub fn read(path: &Path) -> Result<LinkSetting, LinkError> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| LinkError::Invalid { path: path.to_path_buf(), detail: e.to_string() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(LinkSetting::default()),
            Err(err) => Err(LinkError::Io { what: "reading", path: path.to_path_buf(), err }),
        }
    }
}

/// Reads what a worker's fault link reported (none yet: zeros).
pub fn read_stats(path: &Path) -> ProxyStats {
    std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
}

struct Inner {
    file: PathBuf,
    stats_file: PathBuf,
    setting: Mutex<LinkSetting>,
    /// The epochs' proxies, oldest first.
    proxies: Mutex<VecDeque<FaultProxy>>,
    /// What dropped proxies did.
    retired: Mutex<ProxyStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn stats(&self) -> ProxyStats {
        let mut s = *lock(&self.retired);
        for p in lock(&self.proxies).iter() {
            s.add(&p.stats());
        }
        s
    }

    /// Follows the link file and reports the stats, for the life of the process.
    fn watch(&self) {
        let mut reported = None;
        let mut last_error = String::new();
        let mut rounds: u64 = 0;
        loop {
            rounds += 1;
            match LinkSetting::read(&self.file) {
                Ok(new) => {
                    let mut cur = lock(&self.setting);
                    if *cur != new {
                        *cur = new;
                        for p in lock(&self.proxies).iter() {
                            p.set_faults(new.faults, new.seed);
                        }
                    }
                }
                // A file being replaced is never half-written (rename); anything else is the
                // harness's mistake: say so once per change and keep the last good setting.
                Err(e) => {
                    let e = e.to_string();
                    if e != last_error {
                        eprintln!("fault link: {e}; keeping the previous setting");
                        last_error = e;
                    }
                }
            }
            let s = self.stats();
            if reported != Some(s) && rounds % STATS_EVERY_POLLS == 0 {
                if let Ok(text) = serde_json::to_string(&s) {
                    if write_atomic(&self.stats_file, &text).is_ok() {
                        reported = Some(s);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(LINK_POLL_MS));
        }
    }
}

/// A worker process's fault link (see the module doc).
#[derive(Clone)]
pub struct WorkerLink {
    inner: Arc<Inner>,
}

impl WorkerLink {
    /// Starts following `<links>/<id>.json`.
    pub fn start(links: &Path, id: u64) -> Result<WorkerLink, LinkError> {
        let file = WorkerNet::link_file(links, id);
        let setting = LinkSetting::read(&file)?;
        let inner = Arc::new(Inner {
            file,
            stats_file: WorkerNet::stats_file(links, id),
            setting: Mutex::new(setting),
            proxies: Mutex::new(VecDeque::new()),
            retired: Mutex::new(ProxyStats::default()),
        });
        let watcher = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("tessera-fault-link".into())
            .spawn(move || watcher.watch())
            .map_err(io_err("starting the fault link's thread", links))?;
        Ok(WorkerLink { inner })
    }

    /// Binds one epoch's QUIC endpoint on loopback behind a new proxy listening on `ip`;
    /// returns the endpoint's socket and the address to advertise (the proxy's).
    pub fn bind_epoch(&self, ip: IpAddr) -> io::Result<(UdpSocket, SocketAddr)> {
        let endpoint = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
        let s = *lock(&self.inner.setting);
        let proxy = FaultProxy::start_with(ProxyOptions {
            listen: SocketAddr::new(ip, 0),
            upstream: endpoint.local_addr()?,
            faults: s.faults,
            seed: s.seed,
            back_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            no_fragment: true,
        })?;
        let advertised = proxy.addr();
        let mut proxies = lock(&self.inner.proxies);
        proxies.push_back(proxy);
        while proxies.len() > PROXIES_KEPT {
            if let Some(old) = proxies.pop_front() {
                lock(&self.inner.retired).add(&old.stats());
            }
        }
        Ok((endpoint, advertised))
    }

    /// The addresses the newest endpoint dials its peers at: each peer's alias on the newest
    /// proxy (`own`, this worker's rank, keeps its advertised address).
    pub fn aliases(&self, addrs: &[SocketAddr], own: usize) -> io::Result<Vec<SocketAddr>> {
        let proxies = lock(&self.inner.proxies);
        let Some(p) = proxies.back() else { return Err(io::Error::other("no epoch socket was bound behind the fault link")) };
        addrs.iter().enumerate().map(|(r, a)| if r == own { Ok(*a) } else { p.alias(*a) }).collect()
    }

    /// What the link's proxies did so far.
    pub fn stats(&self) -> ProxyStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn worker_net_files_round_trip_and_name_a_missing_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("net.json");
        let net = WorkerNet { control_ip: "10.231.9.254".parse().unwrap(), netns: vec!["tsr-no-such-ns".into()], links: None };
        net.write(&path).unwrap();
        let e = WorkerNet::load(&path).expect_err("no such namespace").to_string();
        assert!(e.contains("net.json") && e.contains("\"tsr-no-such-ns\" does not exist"), "{e}");
        std::fs::write(&path, r#"{"control_ip": "10.0.0.1", "netns": ["a"], "extra": 1}"#).unwrap();
        let e = WorkerNet::load(&path).expect_err("unknown field").to_string();
        assert!(e.contains("extra"), "{e}");
        std::fs::write(&path, r#"{"control_ip": "10.0.0.1", "netns": ["../x"]}"#).unwrap();
        assert!(WorkerNet::load(&path).expect_err("a path").to_string().contains("not a namespace name"));
    }

    #[test]
    fn a_worker_link_follows_its_setting_file_and_reports_what_it_did() {
        let dir = tempfile::tempdir().unwrap();
        let remote = UdpSocket::bind("127.0.0.1:0").unwrap();
        remote.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let link = WorkerLink::start(dir.path(), 7).unwrap();
        let (endpoint, advertised) = link.bind_epoch(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let peers = link.aliases(&[advertised, remote.local_addr().unwrap()], 0).unwrap();
        assert_eq!(peers[0], advertised, "its own address stays");
        let through = |n: usize| -> usize {
            let mut buf = [0u8; 8];
            (0..n)
                .filter(|_| {
                    endpoint.send_to(b"ping", peers[1]).unwrap();
                    // The remote sees the advertised address: the proxy's listening socket.
                    matches!(remote.recv_from(&mut buf), Ok((4, from)) if from == advertised)
                })
                .count()
        };
        assert_eq!(through(10), 10, "no setting file: a clean link");
        let file = WorkerNet::link_file(dir.path(), 7);
        LinkSetting { faults: LinkFaults { loss: 1.0, ..Default::default() }, seed: 1 }.write(&file).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while through(1) == 1 {
            assert!(Instant::now() < deadline, "the link never picked up its setting");
        }
        assert_eq!(through(5), 0, "a link that drops everything");
        let stats = WorkerNet::stats_file(dir.path(), 7);
        let deadline = Instant::now() + Duration::from_secs(5);
        while read_stats(&stats).dropped < 5 {
            assert!(Instant::now() < deadline, "no stats reported: {:?}", read_stats(&stats));
            std::thread::sleep(Duration::from_millis(LINK_POLL_MS));
        }
        assert!(read_stats(&stats).relayed >= 10);
    }
}
