//! A training run across three network-namespace hosts (veth + bridge, `chaos/src/netns.rs`):
//! a coordinator and an agent per host give the bits of three in-process ranks; then the same
//! with the seeded UDP fault proxy (`chaos/src/proxy.rs`: delay, jitter, loss, reordering,
//! duplication) in front of rank 0's QUIC socket, so every packet between rank 0 and the other
//! hosts crosses it. Needs root and iproute2; without them the test prints why and checks
//! nothing else.
//!
//! The chaos crate's files are compiled in by path (as the fuzzers do with `engine::wire`), so
//! this test can use the root crate's `tessera` binary.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

#[path = "../chaos/src/netns.rs"]
#[allow(dead_code)]
mod netns;
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
    let mut reference = vec!["train".to_string()];
    reference.extend(run_flags(&tmp.path().join("inproc")));
    reference.extend(["--world".to_string(), HOSTS.to_string()]);
    ok(&reference.iter().map(String::as_str).collect::<Vec<_>>(), tmp.path());
    let want = summary(&tmp.path().join("inproc"))["params_blake3"].clone();

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
    let port = 47600u16;
    let faults = LinkFaults { delay_ms: 1, jitter_ms: 2, loss: 0.02, reorder: 0.05, reorder_ms: 5, duplicate: 0.02 };
    let proxy = FaultProxy::start((gw, port).into(), (net.addr(0), port).into(), faults, 2026).expect("starting the fault proxy");
    let join = format!("{gw}:47501");
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
