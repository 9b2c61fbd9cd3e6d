//! A training run across three network-namespace hosts (veth + bridge, `chaos/src/netns.rs`):
//! a coordinator and an agent per host give the bits of three in-process ranks; then the same
//! with the seeded UDP fault proxy (`chaos/src/proxy.rs`: delay, jitter, loss, reordering,
//! duplication) in front of rank 0's QUIC socket, so every packet between rank 0 and the other
//! hosts crosses it. An elastic job across namespace hosts (each agent also in a pid namespace
//! of its own): one host's agent SIGKILLed mid-run, another joining from a fourth host with the
//! join token, the fault-free run's bits. Needs root and iproute2; without them the tests print
//! why and check nothing else.
//!
//! The chaos crate's files are compiled in by path (as the fuzzers do with `tessera_fleet::wire`), so
//! this test can use the root crate's `tessera` binary.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

#[path = "../chaos/src/netns.rs"]
#[allow(dead_code)]
pub mod netns;
#[path = "../chaos/src/proxy.rs"]
#[allow(dead_code)]
mod proxy;

use netns::TestNet;
use proxy::{FaultProxy, LinkFaults};

const HOSTS: usize = 3;
/// 10.231.<SUBNET>.0/24 (chaos/tests/netns.rs uses 77).
const SUBNET: u8 = 78;

/// gpt-tiny, 3 steps of 12 one-sequence micro-batches, ZeRO-1: `train` flags after the command.
fn run_flags(out: &Path) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> =
        ["--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--no-progress", "--steps", "3"].map(String::from).to_vec();
    for set in [
        "zero_optimization.stage=1",
        "train_batch_size=12",
        "train_micro_batch_size_per_gpu=1",
        "tessera.seq_len=32",
        "tessera.eval_iters=1",
        "tessera.eval_interval=0",
        "scheduler.params.warmup_min_ratio=0.5",
    ] {
        a.extend(["--set".to_string(), set.to_string()]);
    }
    a
}

/// Waits for every process up to `bound` (killing stragglers); returns (success, output) each.
fn wait_all(children: Vec<Child>, bound: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + bound;
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let killed = c.try_wait().ok().flatten().is_none();
            if killed {
                let _ = c.kill();
            }
            let out = c.wait_with_output().expect("reaping");
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            match killed {
                true => (false, format!("still running after {bound:?}; killed\n{text}")),
                false => (out.status.success(), text),
            }
        })
        .collect()
}

fn piped(mut c: Command) -> Child {
    c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning tessera")
}

/// Runs a coordinator (`coord`, with its listen address `join`) that writes its join token to
/// `token` and, once it has, one agent per host with `agent_extra(i)`; returns the
/// coordinator's output and asserts everyone succeeded.
fn run_cluster(net: &TestNet, mut coord: Command, join: &str, token: &Path, agent_extra: &dyn Fn(usize) -> Vec<String>) -> String {
    let bin = bin();
    coord.args(["--token-file", token.to_str().unwrap()]);
    let mut children = vec![piped(coord)];
    let deadline = Instant::now() + Duration::from_secs(30);
    while !token.exists() && Instant::now() < deadline && children[0].try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in 0..HOSTS {
        let mut c = net.command(i, bin.to_str().unwrap());
        c.args(["agent", "--join", join, "--name", &format!("host{i}"), "--token-file", token.to_str().unwrap()]).args(agent_extra(i));
        children.push(piped(c));
    }
    let results = wait_all(children, Duration::from_secs(60));
    for (i, (ok, text)) in results.iter().enumerate() {
        let who = if i == 0 { "the coordinator".to_string() } else { format!("the agent on host {}", i - 1) };
        assert!(ok, "{who} failed:\n{text}");
    }
    results[0].1.clone()
}

/// Runs `tessera train FLAGS WORLD_FLAG HOSTS` (in `dir`) as the reference and returns the
/// `params_blake3` of its summary in `out`.
fn reference_hash(dir: &Path, flags: Vec<String>, world_flag: &str, out: &Path) -> serde_json::Value {
    let mut reference = vec!["train".to_string()];
    reference.extend(flags);
    reference.extend([world_flag.to_string(), HOSTS.to_string()]);
    ok(&reference.iter().map(String::as_str).collect::<Vec<_>>(), dir);
    summary(out)["params_blake3"].clone()
}

#[test]
fn training_across_namespace_hosts_clean_and_through_a_fault_proxy() {
    let mut net = match TestNet::new(HOSTS, SUBNET) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP: cannot make network namespaces here: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path(), run_flags(&tmp.path().join("inproc")), "--world", &tmp.path().join("inproc"));

    // Clean: the coordinator runs on host 0 next to its agent.
    let join = format!("{}:47500", net.addr(0));
    let mut coord = net.command(0, bin().to_str().unwrap());
    coord.arg("coordinator").args(run_flags(&tmp.path().join("clean"))).args(["--listen", &join, "--nodes", "3"]);
    let started = Instant::now();
    let text = run_cluster(&net, coord, &join, &tmp.path().join("token-clean"), &|_| Vec::new());
    eprintln!("clean: {:?}", started.elapsed());
    for i in 0..HOSTS {
        assert!(text.contains(&format!("{}:", net.addr(i))), "host {i}'s address is not in the mesh:\n{text}");
    }
    assert_eq!(summary(&tmp.path().join("clean"))["params_blake3"], want, "namespace hosts differ from in-process ranks");

    // Faults: the coordinator and the proxy run in this process's namespace, attached to the
    // bridge. Rank 0 (host 0) advertises the proxy's address; rank 0 dials nobody (higher ranks
    // dial lower ones), so all of its traffic crosses the proxy.
    let gw = match net.attach_root() {
        Ok(a) => a,
        Err(why) => panic!("attaching the root namespace to the test bridge: {why}"),
    };
    // Root-namespace ports below the ephemeral range (32768–60999), where other tests' sockets
    // cannot take them.
    let port = 29610u16;
    let faults = LinkFaults { delay_ms: 1, jitter_ms: 2, loss: 0.02, reorder: 0.05, reorder_ms: 5, duplicate: 0.02 };
    let proxy = FaultProxy::start((gw, port).into(), (net.addr(0), port).into(), faults, 2026).expect("starting the fault proxy");
    let join = format!("{gw}:29511");
    let mut coord = Command::new(bin());
    coord.arg("coordinator").args(run_flags(&tmp.path().join("faults"))).args(["--listen", &join, "--nodes", "3"]);
    let started = Instant::now();
    let text = run_cluster(&net, coord, &join, &tmp.path().join("token-faults"), &|i| match i {
        0 => ["--rank", "0", "--advertise", &gw.to_string(), "--quic-port", &port.to_string()].map(String::from).to_vec(),
        _ => Vec::new(),
    });
    let stats = proxy.stats();
    eprintln!("faults: {:?}, proxy {stats:?}", started.elapsed());
    assert!(text.contains(&format!("rank 0 at {gw}:{port}")), "rank 0 is not behind the proxy:\n{text}");
    assert!(stats.relayed > 0 && stats.dropped > 0 && stats.reordered > 0 && stats.duplicated > 0, "the proxy saw too little: {stats:?}");
    assert_eq!(summary(&tmp.path().join("faults"))["params_blake3"], want, "a lossy, reordering link changed the bits");
}

// ── `tessera launch --hostfile` over real OpenSSH ────────────────────────────────────────────

/// 10.231.<SSH_SUBNET>.0/24 for the ssh test (77: chaos/tests/netns.rs, 78: the test above).
const SSH_SUBNET: u8 = 79;
/// The port every test sshd listens on (each namespace has its own ports).
const SSH_PORT: u16 = 2222;
/// sshd's privilege-separation directory; made (and removed again) when the system has none.
const PRIVSEP_DIR: &str = "/run/sshd";

/// An sshd in each namespace host, configured only by files in a temporary directory: its own
/// host key, an authorized key made by the test, no PAM, no passwords. Killed (by pid) on drop.
struct TestSshd {
    daemons: Vec<Child>,
    made_privsep_dir: bool,
}

impl Drop for TestSshd {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
        if self.made_privsep_dir {
            let _ = std::fs::remove_dir(PRIVSEP_DIR);
        }
    }
}

/// Why this machine cannot run the ssh test, if it cannot.
fn ssh_missing() -> Option<String> {
    let found = |p: &str| Command::new(p).arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    if !Path::new("/usr/sbin/sshd").is_file() {
        return Some("no /usr/sbin/sshd (Debian package openssh-server)".into());
    }
    if !found("ssh") {
        return Some("no ssh client (Debian package openssh-client)".into());
    }
    let keygen = Command::new("ssh-keygen").arg("-?").stdout(Stdio::null()).stderr(Stdio::null()).status();
    keygen.is_err().then(|| "no ssh-keygen (Debian package openssh-client)".into())
}

fn keygen(path: &Path) {
    let st = Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-C", "tessera-test", "-f"]).arg(path).status();
    assert!(st.is_ok_and(|s| s.success()), "ssh-keygen -f {} failed", path.display());
}

/// Starts the daemons and writes the client's files: returns them and the ssh config file the
/// client uses (user, known hosts with the test host key, strict host-key checking).
fn start_sshd(net: &TestNet, dir: &Path) -> (TestSshd, std::path::PathBuf) {
    let (host_key, id) = (dir.join("host_key"), dir.join("id"));
    keygen(&host_key);
    keygen(&id);
    std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).expect("authorized_keys");
    let host_pub = std::fs::read_to_string(dir.join("host_key.pub")).expect("host key");
    let known: String = (0..HOSTS).map(|i| format!("[{}]:{SSH_PORT} {}", net.addr(i), host_pub.trim())).collect::<Vec<_>>().join("\n");
    write(dir, "known_hosts", &(known + "\n"));
    let made_privsep_dir = !Path::new(PRIVSEP_DIR).exists();
    if made_privsep_dir {
        std::fs::create_dir(PRIVSEP_DIR).expect("creating sshd's privilege-separation directory");
    }
    let mut sshd = TestSshd { daemons: Vec::new(), made_privsep_dir };
    for i in 0..HOSTS {
        let cfg = format!(
            "Port {SSH_PORT}\nListenAddress {addr}\nHostKey {key}\nAuthorizedKeysFile {dir}/authorized_keys\nPidFile {dir}/sshd-{i}.pid\n\
             PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nLogLevel ERROR\n",
            addr = net.addr(i),
            key = host_key.display(),
            dir = dir.display(),
        );
        let cfg = write(dir, &format!("sshd-{i}.conf"), &cfg);
        let mut c = net.command(i, "/usr/sbin/sshd");
        c.args(["-D", "-e", "-f"]).arg(&cfg).stdout(Stdio::null()).stderr(Stdio::piped());
        sshd.daemons.push(c.spawn().expect("starting sshd"));
    }
    for i in 0..HOSTS {
        let addr = std::net::SocketAddr::from((net.addr(i), SSH_PORT));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "sshd on host {i} ({addr}) does not accept connections");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let client = format!(
        "Host *\n  User root\n  IdentitiesOnly yes\n  UserKnownHostsFile {}/known_hosts\n  GlobalKnownHostsFile /dev/null\n  \
         StrictHostKeyChecking yes\n  LogLevel ERROR\n",
        dir.display()
    );
    (sshd, write(dir, "ssh_config", &client))
}

#[test]
fn launch_over_real_ssh_into_namespace_hosts_gives_the_in_process_bits() {
    if let Some(why) = ssh_missing() {
        eprintln!("SKIP: {why}");
        return;
    }
    let mut net = match TestNet::new(HOSTS, SSH_SUBNET) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP: cannot make network namespaces here: {why}");
            return;
        }
    };
    // The launcher (this namespace) reaches the hosts over the bridge, as a head node would.
    if let Err(why) = net.attach_root() {
        panic!("attaching the root namespace to the test bridge: {why}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("ssh");
    std::fs::create_dir(&keys).unwrap();
    let (sshd, ssh_config) = start_sshd(&net, &keys);
    let mut reference = vec!["train".to_string()];
    reference.extend(run_flags(&tmp.path().join("inproc")));
    reference.extend(["--world".to_string(), HOSTS.to_string()]);
    ok(&reference.iter().map(String::as_str).collect::<Vec<_>>(), tmp.path());
    let want = summary(&tmp.path().join("inproc"))["params_blake3"].clone();

    let hosts: String = (0..HOSTS).map(|i| format!("{} slots=1\n", net.addr(i))).collect();
    let hostfile = write(tmp.path(), "hostfile", &hosts);
    let mut launch = Command::new(bin());
    launch.current_dir(tmp.path()).arg("launch").args(run_flags(&tmp.path().join("ssh-run")));
    launch.args(["--hostfile", hostfile.to_str().unwrap(), "--ssh-port", &SSH_PORT.to_string()]);
    launch.args(["--ssh-identity", keys.join("id").to_str().unwrap(), "--ssh-config", ssh_config.to_str().unwrap()]);
    let started = Instant::now();
    let results = wait_all(vec![piped(launch)], Duration::from_secs(120));
    let (ok, text) = &results[0];
    eprintln!("launch over ssh: {:?}", started.elapsed());
    assert!(*ok, "tessera launch over ssh failed:\n{text}");
    for i in 0..HOSTS {
        assert!(text.contains(&format!("agent {}-0: rank {i} of {HOSTS}", net.addr(i))), "host {i}'s agent:\n{text}");
        assert!(text.contains(&format!("rank {i} at {}:", net.addr(i))), "rank {i} is not on its host:\n{text}");
    }
    assert_eq!(summary(&tmp.path().join("ssh-run"))["params_blake3"], want, "agents started over ssh differ from in-process ranks");
    drop(sshd);
}

// ── An elastic job across namespace hosts ────────────────────────────────────────────────────

/// 10.231.<ELASTIC_SUBNET>.0/24 (77–79: chaos/tests/netns.rs and the tests above).
const ELASTIC_SUBNET: u8 = 80;
/// Steps of the elastic run.
const ELASTIC_STEPS: u64 = 8;
/// Bound on each wait for the elastic run to get somewhere (a step, a loss).
const ELASTIC_WAIT: Duration = Duration::from_secs(60);

/// [`run_flags`] for an elastic run of [`ELASTIC_STEPS`] that needs 3 workers (after a loss it
/// waits for a join) and declares a silent worker lost after 1 s.
fn elastic_flags(out: &Path) -> Vec<String> {
    let mut a = run_flags(out);
    let at = a.iter().position(|x| x == "--steps").expect("--steps") + 1;
    a[at] = ELASTIC_STEPS.to_string();
    for set in ["tessera.elastic.enabled=true", "tessera.elastic.min_workers=3", "tessera.elastic.heartbeat_timeout_ms=1000"] {
        a.extend(["--set".to_string(), set.to_string()]);
    }
    a
}

/// `tessera agent` on host `i`, also in a pid namespace of its own (`unshare --pid`), as on a
/// machine of its own: the driver can neither watch nor signal its pid, so it has to notice a
/// loss over the network (heartbeats), and fence it by closing its connections.
fn host_agent(net: &TestNet, i: usize, join: &str, token: &Path, extra: &[&str]) -> Command {
    let mut c = net.command(i, "unshare");
    c.args(["--pid", "--fork", "--kill-child"]).arg(bin());
    c.args(["agent", "--join", join, "--name", &format!("host{i}"), "--token-file", token.to_str().unwrap()]).args(extra);
    c
}

/// The pid (in this namespace) of the live `tessera` process that is `pid` or below it
/// (`ip netns exec` and `unshare` fork it); zombies do not count.
fn tessera_below(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ...": comm may hold spaces, the state follows its closing parenthesis.
    let (comm, rest) = stat.split_once('(').and_then(|(_, r)| r.rsplit_once(')'))?;
    if comm == "tessera" {
        return (!rest.trim_start().starts_with('Z')).then_some(pid);
    }
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()).find_map(tessera_below)
}

/// SIGKILLs the `tessera` processes below each of `procs` (`ip netns exec` forks, so killing
/// the child alone would orphan them) and reaps everything within `bound`.
fn end_all(procs: Vec<Child>, bound: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + bound;
    for c in &procs {
        while let Some(pid) = tessera_below(c.id()) {
            // SAFETY: kill(2) on a process this test started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    wait_all(procs, bound)
}

/// Ends its processes (SIGCONT, then as [`end_all`]) if a failing assertion unwinds past it
/// before they were handed on: no stopped coordinator or stray agent outlives a failed test.
struct EndOnDrop(Option<Vec<Child>>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        if let Some(procs) = self.0.take() {
            for c in &procs {
                if let Some(pid) = tessera_below(c.id()) {
                    // SAFETY: kill(2) on a process this test started.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
                }
            }
            let _ = end_all(procs, Duration::from_secs(5));
        }
    }
}

/// Waits (≤ `bound`) for every process, then ends what is left as [`end_all`] does.
fn end_all_after(procs: Vec<Child>, bound: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline && procs.iter().any(|c| tessera_below(c.id()).is_some()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    end_all(procs, Duration::from_secs(5))
}

/// The events the driver logged so far.
fn events(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("elastic_events.jsonl")).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Waits (≤ [`ELASTIC_WAIT`]) for an event that `pred` accepts while the coordinator (the
/// first of `procs`) runs; otherwise kills them all and fails with their output.
fn wait_event(out: &Path, procs: &mut Vec<Child>, what: &str, pred: &dyn Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + ELASTIC_WAIT;
    let why = loop {
        if let Some(e) = events(out).into_iter().find(|e| pred(e)) {
            return e;
        }
        if procs[0].try_wait().ok().flatten().is_some() {
            break format!("the coordinator ended before {what}");
        }
        if Instant::now() >= deadline {
            break format!("no {what} within {ELASTIC_WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let texts: Vec<String> = end_all(std::mem::take(procs), Duration::from_secs(5)).into_iter().map(|(_, t)| t).collect();
    panic!("{why}; events: {:?}\noutputs (coordinator first):\n{}", events(out), texts.join("\n-----\n"));
}

/// An elastic job whose three workers are agents on three namespace hosts (each its own pid
/// namespace too): the agent of host 1 is SIGKILLed mid-run, the driver finds it by the
/// heartbeat timeout, and an agent that joins from a fourth host with the join token takes its
/// place; the run ends with the fault-free run's bits and every step committed.
#[test]
fn an_elastic_job_across_namespace_hosts_survives_a_killed_host_and_takes_a_joining_agent() {
    let net = match TestNet::new(HOSTS + 1, ELASTIC_SUBNET) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP: cannot make network namespaces here: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path(), elastic_flags(&tmp.path().join("fault-free")), "--nprocs", &tmp.path().join("fault-free"));
    assert!(want.is_string(), "no params_blake3 in the fault-free run");

    let out = tmp.path().join("elastic");
    let (join, token) = (format!("{}:47700", net.addr(0)), tmp.path().join("token"));
    let mut coord = net.command(0, bin().to_str().unwrap());
    coord.arg("coordinator").args(elastic_flags(&out)).args(["--listen", &join, "--nodes", &HOSTS.to_string()]);
    coord.args(["--token-file", token.to_str().unwrap()]);
    let mut driver = piped(coord);
    let deadline = Instant::now() + ELASTIC_WAIT;
    while !token.exists() {
        assert!(Instant::now() < deadline && driver.try_wait().ok().flatten().is_none(), "the coordinator wrote no join token");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut guard = EndOnDrop(Some(vec![driver]));
    let all = guard.0.as_mut().expect("set above");
    all.extend((0..HOSTS).map(|i| piped(host_agent(&net, i, &join, &token, &["--rank", &i.to_string()]))));

    // Mid-run, SIGKILL host 1's worker (rank 1 = worker 1). The driver is held (SIGSTOP) from
    // the first committed step until the kill is done, so the run cannot end before it.
    wait_event(&out, all, "a committed step", &|e| e["event"] == "step");
    let driver_pid = tessera_below(all[0].id()).expect("the coordinator's tessera process") as libc::pid_t;
    let victim = tessera_below(all[2].id()).expect("the tessera process of host 1's agent");
    // SAFETY: kill(2) on processes this test started (through ip netns, and unshare).
    unsafe {
        assert_eq!(libc::kill(driver_pid, libc::SIGSTOP), 0, "SIGSTOP to the coordinator");
        assert_eq!(libc::kill(victim as libc::pid_t, libc::SIGKILL), 0, "SIGKILL to pid {victim}");
        assert_eq!(libc::kill(driver_pid, libc::SIGCONT), 0, "SIGCONT to the coordinator");
    }
    let committed = events(&out).iter().filter(|e| e["event"] == "step").count() as u64;
    assert!(committed < ELASTIC_STEPS, "the run was over before the kill ({committed} steps)");
    let lost = wait_event(&out, all, "the loss of worker 1", &|e| e["event"] == "lost");
    assert_eq!(lost["id"], 1, "{lost}");
    let why = lost["why"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("no heartbeat") || why.contains("connection closed"), "not found over the network: {why}");

    // The run waits for a third worker (min_workers): an agent joins from host 3.
    all.push(piped(host_agent(&net, HOSTS, &join, &token, &[])));
    let results = end_all_after(guard.0.take().expect("set above"), Duration::from_secs(120));
    let text = |i: usize| results[i].1.clone();
    assert!(results[0].0, "the coordinator failed:\n{}", text(0));
    for (i, (ok, t)) in results.iter().enumerate().skip(1) {
        if i != 2 {
            assert!(ok, "agent {} failed:\n{t}", i - 1);
        }
    }
    assert!(!results[2].0, "the killed agent exited successfully:\n{}", text(2));
    assert!(text(4).contains("joins the running job as worker 3"), "{}", text(4));

    let log = events(&out);
    let lines: Vec<String> = log.iter().filter(|e| e["event"] != "step").map(|e| e.to_string()).collect();
    eprintln!("elastic across hosts: coordinator:\n{}\njoiner:\n{}\nevents:\n{}", text(0), text(4), lines.join("\n"));
    let s = summary(&out);
    assert_eq!(s["params_blake3"], want, "the elastic run across hosts differs from the fault-free run:\n{}", text(0));
    assert_eq!(s["steps"], ELASTIC_STEPS, "committed steps lost:\n{}", text(0));
    assert_eq!(s["elastic"]["workers_lost"], 1, "{s:#}");
    assert_eq!(s["elastic"]["workers_joined"], 1, "{s:#}");
    let joined = log.iter().find(|e| e["event"] == "join_requested").unwrap_or_else(|| panic!("no join: {log:?}"));
    assert!(joined["id"] == 3 && joined["name"] == "host3", "{joined}");
    let after: Vec<u64> = log
        .iter()
        .rev()
        .find(|e| e["event"] == "epoch")
        .map(|e| e["members"].as_array().unwrap().iter().map(|m| m["id"].as_u64().unwrap()).collect())
        .unwrap_or_default();
    assert_eq!(after, vec![0, 2, 3], "the last epoch's members: {log:?}");
}
