//! Collectives over QUIC between processes on three network-namespace hosts: the same bits as
//! the in-process backend on a clean link and on a throttled one (`tc tbf`); with a host's link
//! cut (`ip link set down`), every process gives up within its timeout instead of hanging.
//! Needs root and iproute2; without them the test prints why and checks nothing else.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_chaos::exercise::{fingerprint, run_exercise};
use tessera_chaos::netns::TestNet;
use tessera_transport::local::LocalGroup;
use tessera_transport::quic::cluster_init;

const HOSTS: usize = 3;
const PORT: u16 = 47_310;

fn local_fingerprint() -> String {
    let handles: Vec<_> =
        LocalGroup::new(HOSTS).into_iter().map(|mut c| std::thread::spawn(move || run_exercise(&mut c).unwrap())).collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let fps: Vec<String> = results.iter().map(|r| fingerprint(r)).collect();
    assert!(fps.windows(2).all(|w| w[0] == w[1]));
    fps[0].clone()
}

fn spawn_ranks(net: &TestNet, certs: &std::path::Path, timeout_ms: u64) -> Vec<Child> {
    let addrs: Vec<String> = (0..HOSTS).map(|i| format!("{}:{PORT}", net.addr(i))).collect();
    (0..HOSTS)
        .map(|i| {
            net.command(i, env!("CARGO_BIN_EXE_quic_rank"))
                .args([i.to_string(), certs.display().to_string(), addrs.join(","), timeout_ms.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawning quic_rank")
        })
        .collect()
}

/// Waits for every child up to `bound`; kills stragglers. Returns (success, stdout+stderr).
fn wait_all(children: Vec<Child>, bound: Duration) -> Vec<(bool, String)> {
    let deadline = Instant::now() + bound;
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
                let out = c.wait_with_output().expect("reaping");
                return (false, format!("still running after {bound:?}; killed\n{}", String::from_utf8_lossy(&out.stderr)));
            }
            let out = c.wait_with_output().expect("reaping");
            (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
        })
        .collect()
}

#[test]
fn three_namespace_hosts_clean_throttled_and_cut() {
    let net = match TestNet::new(HOSTS, 77) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP: cannot make network namespaces here: {why}");
            return;
        }
    };
    let certs = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..HOSTS).map(|r| format!("rank{r}")).collect();
    cluster_init(certs.path(), &names.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let want = format!("fingerprint {}", local_fingerprint());

    // A clean network, then host 0 throttled to 20 Mbit/s: the same bits.
    for phase in ["clean", "throttled"] {
        if phase == "throttled" {
            net.throttle(0, 20).unwrap();
        }
        let results = wait_all(spawn_ranks(&net, certs.path(), 30_000), Duration::from_secs(60));
        for (i, (ok, text)) in results.iter().enumerate() {
            assert!(ok, "{phase}: host {i} failed:\n{text}");
            assert!(text.contains(&want), "{phase}: host {i} computed different bits ({want} expected):\n{text}");
        }
    }

    // Host 2's cable cut: nobody hangs; every rank fails within its timeout.
    net.set_link(2, false).unwrap();
    let started = Instant::now();
    let results = wait_all(spawn_ranks(&net, certs.path(), 3_000), Duration::from_secs(30));
    for (i, (ok, text)) in results.iter().enumerate() {
        assert!(!ok, "host {i} should have failed with host 2 cut off:\n{text}");
        assert!(!text.contains("killed"), "host {i} hung instead of timing out:\n{text}");
    }
    eprintln!("with host 2 cut off, all ranks gave up after {:?}", started.elapsed());
}
