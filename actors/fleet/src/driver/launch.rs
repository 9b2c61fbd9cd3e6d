//! How a fleet starts: `<output>/procs` for spawned workers, the first epoch's workers spawned
//! or taken from the agents' rendezvous ([`Origin`]), their start state, and the threads
//! (acceptor, monitor) that watch them.

use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::WorkerCompute;
use tessera_actors::faults::Faults;
use tessera_actors::liveness::Exit;
use tessera_actors::replan::{Rebalancer, Speeds};
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, JoinToken};

use super::monitor::monitor;
use super::proxy::{Link, Member};
use super::rebalance::{REBALANCE_QUIET_MAX_STEPS, REBALANCE_QUIET_STEPS, SPEED_WINDOW_STEPS};
use super::{relock, Beat, Fleet, Shared, EVENTS_FILE, JOIN_TOKEN_FILE};
use crate::join::{self, Admission, Pidfd};
use crate::rendezvous::{self, node_name, send_start, spawn_worker, AgentAuth, Launched, Rendezvous, COORDINATOR_NAME};
use crate::spec::{FleetSpec, Host, Placement};
use crate::state::{FleetPlan, Start};
use crate::wire::{self, Snapshot, ToParent, ToWorker, Wait};

/// Writes `<output>/procs` for spawned workers (emptied first): the resolved config, the run
/// CA's certificate and one identity per first-epoch worker (`node-<r>`; the CA's key stays
/// in memory), and the join token (mode 0600) with which `tessera worker --join` joins.
fn prepare_procs(config: &serde_json::Value, world: usize, dir: &Path, ca: &ClusterCa, token: &JoinToken) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(config).context("serialising the resolved config")?;
    std::fs::write(dir.join("config.json"), text).with_context(|| format!("writing {}/config.json", dir.display()))?;
    for r in 0..world {
        ca.issue_to_dir(&dir.join("pki"), &node_name(r)).with_context(|| format!("the identity of worker {r}"))?;
    }
    let path = dir.join(JOIN_TOKEN_FILE);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    writeln!(f, "{}", token.text()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Where the first epoch's workers come from.
pub enum Origin<'a> {
    /// `train --nprocs N`: spawned here, on loopback or where `placement` puts them (the
    /// chaos harness's network namespaces, `--worker-net`).
    Spawn { placement: Option<&'a dyn Placement> },
    /// `tessera coordinator` / `tessera launch`: agents that join the rendezvous.
    Agents(Box<Rendezvous>),
}

/// A first-epoch worker after its `Hello`: (connection, QUIC address, pid, pidfd when it is a
/// process of this host but not our child, who it is in messages).
type First = (ControlConn, String, u32, Option<Pidfd>, String);

impl<P: FleetPlan> Fleet<P> {
    /// Starts the first epoch's `plan.world()` workers (ids `0..world`) from `start`: spawned
    /// (where `placement` puts them) or agents joining a rendezvous; the driver's side of the
    /// fault hooks (`stop_actor`) is installed first.
    pub fn launch(
        spec: FleetSpec,
        plan: &Arc<P>,
        start: &Start,
        origin: Origin<'_>,
        faults: &Faults,
        host: &dyn Host,
    ) -> Result<(Self, Vec<Box<dyn WorkerCompute>>)> {
        faults.install_driver_signals();
        let world = plan.world();
        let admission = |spec: &FleetSpec, auth: AgentAuth| -> Result<Admission> {
            let config = serde_json::to_string(&spec.config).context("serialising the resolved config")?;
            Ok(Admission { auth, config, data_blake3: spec.data_blake3.clone(), host: join::host_id() })
        };
        match origin {
            Origin::Spawn { placement } => {
                let dir = spec.out_dir.join("procs");
                let ca = ClusterCa::generate()?;
                let token = JoinToken::generate(ca.ca_sha256())?;
                prepare_procs(&spec.config, world, &dir, &ca, &token)?;
                let identity = ca.issue(COORDINATOR_NAME)?;
                let server = rendezvous::control_server_config(&identity, ClientAuth::Optional)?;
                let auth = AgentAuth::Token { ca: Box::new(ca), token };
                let admission = admission(&spec, auth)?;
                let mut fleet = Fleet::new(spec, plan, admission, faults, Arc::default())?;
                fleet.dir = Some(dir.clone());
                fleet.forced_exit = Some(host.remove_at_forced_exit(&dir));
                let control_ip = placement.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |p| p.control_ip());
                let endpoint = ControlEndpoint::bind(SocketAddr::new(control_ip, 0), Some(server))
                    .with_context(|| format!("binding the control endpoint on {control_ip}"))?;
                let control = endpoint.local_addr()?.to_string();
                std::fs::write(dir.join("control"), &control).with_context(|| format!("writing {}/control", dir.display()))?;
                if let Some(p) = placement {
                    p.publish(&dir)?;
                }
                let exe = std::env::current_exe().context("finding the tessera executable")?;
                for r in 0..world {
                    let child = spawn_worker(&exe, r, world, &control, &dir, placement)?;
                    relock(&fleet.shared.children).push((r as u64, child));
                }
                let shared = Arc::clone(&fleet.shared);
                let exited = || {
                    relock(&shared.children)
                        .iter_mut()
                        .find_map(|(id, c)| c.try_wait().ok().flatten().map(|s| format!("worker {id} {}", Exit::of(s))))
                };
                let mut early = Vec::new();
                let hellos = rendezvous::accept_workers(&endpoint, &fleet.spec.config_hash, &exited, world, Some(&mut early))?;
                let firsts = hellos
                    .into_iter()
                    .enumerate()
                    .map(|(r, h)| (h.conn, h.quic_addr, h.pid, None, format!("worker process of rank {r} (pid {})", h.pid)))
                    .collect();
                fleet.start(Arc::new(endpoint), firsts, early, start)
            }
            Origin::Agents(rdv) => {
                let rdv = *rdv;
                let launched = Arc::clone(&rdv.launched);
                let exited = || rendezvous::launched_exited(&launched);
                let started = rendezvous::rendezvous_agents(&spec, world, &rdv, &exited, host)?;
                let Rendezvous { endpoint, auth, .. } = rdv;
                let admission = admission(&spec, auth)?;
                let fleet = Fleet::new(spec, plan, admission, faults, launched)?;
                let host = fleet.shared.admission.host.clone();
                let firsts = started
                    .into_iter()
                    .map(|a| {
                        let local = (!a.host.is_empty() && a.host == host).then(|| Pidfd::open(a.pid)).flatten();
                        (a.conn, a.quic_addr, a.pid, local, a.who)
                    })
                    .collect();
                fleet.start(Arc::new(endpoint), firsts, Vec::new(), start)
            }
        }
    }

    /// A fleet with no workers yet (dropping it ends whatever it started); `launched` are the
    /// processes `tessera launch` started for its agents.
    fn new(spec: FleetSpec, plan: &Arc<P>, admission: Admission, faults: &Faults, launched: Arc<Mutex<Vec<Launched>>>) -> Result<Fleet<P>> {
        let world = plan.world();
        let path = spec.out_dir.join(EVENTS_FILE);
        let events = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let shared = Shared {
            faults: faults.clone(),
            launched,
            ..Shared::new(spec.run.clone(), world as u64, spec.config_hash.clone(), admission, events)
        };
        let shared = Arc::new(shared);
        Ok(Fleet {
            spec,
            shared,
            members: Vec::new(),
            epoch: 0,
            plan: Arc::clone(plan),
            admitted: Vec::new(),
            leavers: Vec::new(),
            installed: None,
            threads: Vec::new(),
            endpoint: None,
            dir: None,
            forced_exit: None,
            speeds: Speeds::new(SPEED_WINDOW_STEPS),
            rebalancer: Rebalancer::new(REBALANCE_QUIET_STEPS, REBALANCE_QUIET_MAX_STEPS),
        })
    }

    /// Sends the first epoch's workers the addresses and their start state, waits for each to
    /// be ready, starts the acceptor (side connections, joins; `early` are joins that came
    /// during the start) and the monitor, and gives the replicas their first full copy.
    fn start(
        mut self,
        endpoint: Arc<ControlEndpoint>,
        firsts: Vec<First>,
        early: Vec<(ControlConn, ToParent)>,
        start: &Start,
    ) -> Result<(Self, Vec<Box<dyn WorkerCompute>>)> {
        let shared = Arc::clone(&self.shared);
        let plan = Arc::clone(&self.plan);
        self.endpoint = Some(Arc::clone(&endpoint));
        let addrs: Vec<String> = firsts.iter().map(|f| f.1.clone()).collect();
        let mut members = Vec::with_capacity(firsts.len());
        let mut who = Vec::with_capacity(firsts.len());
        for (r, (mut conn, _, pid, local, name)) in firsts.into_iter().enumerate() {
            wire::send(&mut conn, &ToWorker::Mesh { addrs: addrs.clone(), names: Vec::new() })
                .with_context(|| format!("sending {name} the addresses"))?;
            send_start(&mut conn, &*plan, start, r).with_context(|| format!("sending {name} its start state"))?;
            relock(&shared.controls).insert(r as u64, conn.clone());
            let beat = Beat::new(pid);
            *relock(&beat.local) = local;
            relock(&shared.beats).insert(r as u64, beat);
            members.push(Arc::new(Member { id: r as u64, pid, link: Mutex::new(Link { stream: conn, snapshot: Snapshot::default() }) }));
            relock(&shared.names).insert(r as u64, name.clone());
            who.push(name);
        }
        let deadline = Instant::now() + Duration::from_millis(rendezvous::STARTUP_TIMEOUT_MS);
        for (r, m) in members.iter().enumerate() {
            let mut link = relock(&m.link);
            let wait = Wait { what: "Ready", deadline: Some(deadline), alive: &|| Ok(()) };
            link.snapshot =
                match wire::recv(&mut link.stream, "Ready", &wait).with_context(|| format!("waiting for {} to start", who[r]))? {
                    ToParent::Ready { snapshot } => snapshot,
                    ToParent::Failed { error } => bail!("{} failed to start: {error}", who[r]),
                    other => bail!("{} answered its start state with {other:?}", who[r]),
                };
            // Heartbeats are due from now on.
            if let Some(b) = relock(&shared.beats).get(&m.id) {
                *relock(&b.last) = Instant::now();
            }
        }
        *relock(&shared.members) = members.iter().map(|m| m.id).collect();
        self.members = members;
        let s = Arc::clone(&shared);
        self.threads.push(std::thread::Builder::new().name("tessera-accept".into()).spawn(move || join::acceptor(s, endpoint, early))?);
        let s = Arc::clone(&shared);
        self.threads.push(std::thread::Builder::new().name("tessera-monitor".into()).spawn(move || monitor(s))?);
        self.log_epoch(start.step, "start");
        match self.replicate(start.step) {
            Ok(()) => {
                self.install();
            }
            // A loss is recovered from at the first step boundary (from the start state: no
            // epoch was installed yet).
            Err(_) if !relock(&shared.losses).is_empty() => {}
            Err(e) => return Err(e.context("the first full copy of the replicas")),
        }
        let computes = self.computes();
        Ok((self, computes))
    }
}
