//! The faulted run's test network, for scenarios with network faults: one network namespace
//! per worker (the first epoch's ranks, then one per planned join) on a bridge, with the harness
//! — and so the training driver it starts — attached to the bridge at `10.231.<s>.254`. The
//! driver gets a [`WorkerNet`] file (`tessera train --worker-net`; an agents launch hands it to
//! each agent, `agent --worker-net`, when it has fault links); with link faults in the
//! scenario every worker also runs its QUIC traffic through its fault link, whose settings this
//! module writes ([`LinkSetting`]; several link faults on one worker combine).

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::link::{read_stats, LinkSetting, WorkerNet};
use crate::netns::TestNet;
use crate::proxy::{LinkFaults, ProxyStats};

/// The subnets (10.231.<s>.0/24) the harness picks from; the repository's tests use 77 and 78.
const SUBNETS: RangeInclusive<u8> = 100..=249;

/// What the network faults need: root and iproute2 (and `tc` for throttles). `Err` says why
/// they cannot run here.
pub fn preflight(needs_tc: bool) -> Result<(), String> {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("they need root (network namespaces, veth links, tc)".into());
    }
    let tools: &[&str] = if needs_tc { &["ip", "tc"] } else { &["ip"] };
    for tool in tools {
        match Command::new(tool).arg("-V").output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => return Err(format!("`{tool} -V` failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
            Err(e) => return Err(format!("`{tool}` (iproute2) is not available: {e}")),
        }
    }
    Ok(())
}

/// Whether the root namespace already routes 10.231.<s>.0/24 (another test network is there).
fn subnet_taken(s: u8) -> bool {
    let out = Command::new("ip").args(["route", "show", &format!("10.231.{s}.0/24")]).output();
    out.map_or(true, |o| !o.stdout.is_empty())
}

/// The test network of one faulted run (removed on drop).
pub struct Hosts {
    net: TestNet,
    subnet: u8,
    /// The worker-net file for `tessera train --worker-net`.
    pub file: PathBuf,
    links: Option<PathBuf>,
    /// Spawned workers (ids `0..initial`) live on hosts `0..initial`.
    initial: usize,
    hosts: usize,
    /// Joiners started: (pid, host).
    joiners: Vec<(u32, usize)>,
    /// Link faults in force per worker id: (fault number, faults, seed).
    active: BTreeMap<u64, Vec<(usize, LinkFaults, u64)>>,
}

impl Hosts {
    /// Makes `initial + joins` namespaces and the worker-net file under `dir`; `with_links`
    /// puts every worker's QUIC traffic behind its fault link.
    pub fn new(initial: usize, joins: usize, with_links: bool, dir: &Path) -> Result<Hosts, String> {
        let hosts = initial + joins;
        let span = (SUBNETS.end() - SUBNETS.start()) as u32 + 1;
        let first = (std::process::id() % span) as u8;
        let subnet = (0..span as u8)
            .map(|k| SUBNETS.start() + ((first as u32 + k as u32) % span) as u8)
            .find(|s| !subnet_taken(*s))
            .ok_or_else(|| format!("every test subnet 10.231.{{{}..{}}}.0/24 is in use", SUBNETS.start(), SUBNETS.end()))?;
        let mut net = TestNet::new(hosts, subnet)?;
        let control_ip = net.attach_root()?;
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let links = with_links.then(|| dir.join("links"));
        if let Some(l) = &links {
            if l.exists() {
                std::fs::remove_dir_all(l).map_err(|e| format!("clearing {}: {e}", l.display()))?;
            }
            std::fs::create_dir_all(l).map_err(|e| format!("creating {}: {e}", l.display()))?;
        }
        let file = dir.join("worker_net.json");
        let wn = WorkerNet { control_ip: control_ip.into(), netns: (0..initial).map(|i| net.host_ns(i)).collect(), links: links.clone() };
        wn.write(&file).map_err(|e| e.to_string())?;
        Ok(Hosts { net, subnet, file, links, initial, hosts, joiners: Vec::new(), active: BTreeMap::new() })
    }

    /// For the report: where the workers ran.
    pub fn describe(&self) -> String {
        format!(
            "{} network namespaces on 10.231.{}.0/24 (driver at {}){}",
            self.hosts,
            self.subnet,
            self.net.root_addr(),
            if self.links.is_some() { ", each worker's QUIC traffic through its seeded fault proxy" } else { "" }
        )
    }

    /// The host of worker `id`; `join_pid` gives a joined worker's pid.
    pub fn host_of(&self, id: u64, join_pid: impl Fn(u64) -> Option<u32>) -> Option<usize> {
        if (id as usize) < self.initial {
            return Some(id as usize);
        }
        let pid = join_pid(id)?;
        self.joiners.iter().find(|(p, _)| *p == pid).map(|(_, h)| *h)
    }

    /// "10.231.120.3": host `h`'s address.
    pub fn addr(&self, h: usize) -> String {
        self.net.addr(h).to_string()
    }

    /// A command that runs `exe` on host `h` (one of the first `initial`: the agents of an
    /// agents launch, which the harness starts itself).
    pub fn command(&self, h: usize, exe: &Path) -> Command {
        self.net.command(h, &exe.display().to_string())
    }

    /// The worker-net file when it gives the workers fault links: an agent gets it
    /// (`agent --worker-net`) and puts its QUIC traffic behind its link, as spawned workers do.
    pub fn link_file(&self) -> Option<&Path> {
        self.links.as_ref().map(|_| self.file.as_path())
    }

    /// The harness's address on the bridge (where a coordinator listens for agents).
    pub fn root_addr(&self) -> String {
        self.net.root_addr().to_string()
    }

    /// A command that runs `exe` on the next free host, and that host.
    pub fn join_command(&self, exe: &Path) -> Result<(Command, usize), String> {
        let used = self.initial + self.joiners.len();
        if used >= self.hosts {
            return Err(format!("all {} test hosts are taken", self.hosts));
        }
        Ok((self.net.command(used, &exe.display().to_string()), used))
    }

    /// Records that the joiner with `pid` runs on host `h`.
    pub fn joined(&mut self, pid: u32, h: usize) {
        self.joiners.push((pid, h));
    }

    pub fn set_link(&self, h: usize, up: bool) -> Result<(), String> {
        self.net.set_link(h, up)
    }

    pub fn throttle(&self, h: usize, rate_mbit: u32) -> Result<(), String> {
        self.net.throttle(h, rate_mbit)
    }

    pub fn unthrottle(&self, h: usize) -> Result<(), String> {
        self.net.unthrottle(h)
    }

    /// Puts link fault number `fault` on worker `id`'s link (with the others in force there).
    pub fn add_link(&mut self, id: u64, fault: usize, faults: LinkFaults, seed: u64) -> Result<(), String> {
        self.active.entry(id).or_default().push((fault, faults, seed));
        self.write_link(id)
    }

    /// Ends link fault number `fault` on worker `id`'s link.
    pub fn clear_link(&mut self, id: u64, fault: usize) -> Result<(), String> {
        if let Some(v) = self.active.get_mut(&id) {
            v.retain(|(f, _, _)| *f != fault);
        }
        self.write_link(id)
    }

    fn write_link(&self, id: u64) -> Result<(), String> {
        let links = self.links.as_ref().ok_or("this run has no fault links")?;
        let on = self.active.get(&id).map(Vec::as_slice).unwrap_or_default();
        let setting = LinkSetting { faults: combine(on.iter().map(|(_, f, _)| f)), seed: on.last().map_or(0, |(_, _, s)| *s) };
        setting.write(&WorkerNet::link_file(links, id)).map_err(|e| e.to_string())
    }

    /// What worker `id`'s fault link reported over its life.
    pub fn link_stats(&self, id: u64) -> Option<ProxyStats> {
        self.links.as_ref().map(|l| read_stats(&WorkerNet::stats_file(l, id)))
    }
}

/// Several link faults at once: the longest delays, and independent chances of loss,
/// reordering and duplication.
pub fn combine<'a>(faults: impl Iterator<Item = &'a LinkFaults>) -> LinkFaults {
    let either = |a: f64, b: f64| 1.0 - (1.0 - a) * (1.0 - b);
    faults.fold(LinkFaults::default(), |acc, f| LinkFaults {
        delay_ms: acc.delay_ms.max(f.delay_ms),
        jitter_ms: acc.jitter_ms.max(f.jitter_ms),
        loss: either(acc.loss, f.loss),
        reorder: either(acc.reorder, f.reorder),
        reorder_ms: acc.reorder_ms.max(f.reorder_ms),
        duplicate: either(acc.duplicate, f.duplicate),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_faults_on_one_worker_combine() {
        let a = LinkFaults { delay_ms: 2, loss: 0.5, ..Default::default() };
        let b = LinkFaults { jitter_ms: 3, loss: 0.5, reorder: 0.1, reorder_ms: 20, ..Default::default() };
        let c = combine([a, b].iter());
        assert_eq!((c.delay_ms, c.jitter_ms, c.reorder_ms), (2, 3, 20));
        assert_eq!(c.loss, 0.75);
        assert!((c.reorder - 0.1).abs() < 1e-12, "{c:?}");
        assert!(combine(std::iter::empty()).is_clean(), "no fault in force: a clean link");
    }
}
