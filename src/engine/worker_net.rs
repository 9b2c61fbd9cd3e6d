//! Where an elastic run's worker processes live on the network, and how each binds its QUIC
//! socket.
//!
//! By default the driver listens on 127.0.0.1 and spawns its workers next to it. With
//! `tessera train --worker-net FILE` (hidden; written by `tessera chaos run`, format
//! [`tessera_chaos::link::WorkerNet`]) the driver's control listener binds the file's
//! `control_ip` and spawned worker `i` runs in network namespace `netns[i]` (`ip netns exec`,
//! which execs: the child's pid is the worker's). The file is copied to
//! `<output>/procs/worker_net.json`, where workers and joiners read it.
//!
//! A worker binds every epoch's QUIC socket on the local address of its control connection:
//! 127.0.0.1 next to the driver, its namespace's own address in a namespace — so the mesh runs
//! over the namespaces' links. With the file's `links` set, the socket is instead put behind the
//! worker's fault link ([`tessera_chaos::link::WorkerLink`]): the endpoint on the namespace's
//! loopback, a seeded fault proxy on the namespace address (advertised), and every peer dialled
//! through the proxy, so all of the worker's QUIC datagrams cross it.
//!
//! An agent (`tessera agent --join`) started by the chaos harness in a namespace gets the same
//! file through the hidden `agent --worker-net FILE` and puts its QUIC socket behind its fault
//! link the same way, once the driver has told it its id (its rank, or the id of a late join).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result};
use tessera_chaos::link::{WorkerLink, WorkerNet, WORKER_NET_FILE};
use tessera_fleet::spec::Placement;
use tessera_fleet::worker::{Plain, Sockets};

/// This worker process's fault link, when its run has one (set once, at start-up).
static LINK: OnceLock<FaultLink> = OnceLock::new();

/// A worker's fault link as the fleet's [`Sockets`].
struct FaultLink(WorkerLink);

/// The driver side: the spawned workers' namespaces, as the fleet's [`Placement`].
pub(super) struct Namespaces(WorkerNet);

/// Reads and checks a `--worker-net` file.
pub(super) fn load(path: &Path) -> Result<Namespaces> {
    WorkerNet::load(path).map(Namespaces).with_context(|| format!("--worker-net {}", path.display()))
}

impl Placement for Namespaces {
    fn control_ip(&self) -> IpAddr {
        self.0.control_ip
    }

    /// Copies the file where the workers find it.
    fn publish(&self, procs: &Path) -> Result<()> {
        self.0.write(&procs.join(WORKER_NET_FILE)).context("copying the worker-net file into the run's procs folder")
    }

    /// `exe` in spawned worker `id`'s namespace (`ip netns exec`).
    fn command(&self, exe: &Path, id: usize) -> Result<Command> {
        let net = &self.0;
        let ns = net.netns.get(id).with_context(|| {
            format!("the worker-net file names {} namespace(s); spawned worker {id} needs one of its own", net.netns.len())
        })?;
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(exe);
        Ok(c)
    }
}

/// The worker side, once its id is known: starts the fault link when the run's `procs` folder
/// `dir` asks for one.
pub(super) fn init_worker(dir: &Path, id: u64) -> Result<()> {
    let path = dir.join(WORKER_NET_FILE);
    if !path.exists() {
        return Ok(());
    }
    start_link(&path, id)
}

/// Starts worker `id`'s fault link when the worker-net file `path` has one (`links`); an
/// agent given `--worker-net FILE` calls it once it has its id, a spawned worker through
/// [`init_worker`].
pub(super) fn start_link(path: &Path, id: u64) -> Result<()> {
    let net = WorkerNet::load(path).with_context(|| format!("worker {id}"))?;
    if let Some(links) = &net.links {
        let link = WorkerLink::start(links, id).with_context(|| format!("worker {id}: starting its fault link"))?;
        let _ = LINK.set(FaultLink(link));
    }
    Ok(())
}

/// How this worker process binds its QUIC sockets and dials its peers: behind its fault link
/// when it has one (started by [`init_worker`] or [`start_link`] first), else plainly.
pub(super) fn sockets() -> &'static dyn Sockets {
    match LINK.get() {
        Some(link) => link,
        None => &Plain,
    }
}

impl Sockets for FaultLink {
    fn bind_epoch(&self, local_ip: IpAddr) -> Result<(UdpSocket, SocketAddr)> {
        self.0.bind_epoch(local_ip).with_context(|| format!("binding the QUIC socket behind the fault link on {local_ip}"))
    }

    fn peer_addrs(&self, addrs: Vec<SocketAddr>, own: usize) -> Result<Vec<SocketAddr>> {
        self.0.aliases(&addrs, own).context("the fault link's addresses for the peers")
    }
}
