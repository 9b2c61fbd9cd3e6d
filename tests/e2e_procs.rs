//! Ranks as worker processes (`train --nprocs N`, QUIC with mTLS between them): the same bits
//! as one in-process worker for ZeRO-1 and ZeRO-3, resume across process counts, and a worker
//! killed mid-run ends the run with an error naming its rank, in bounded time, leaving no
//! worker process behind; workers of a killed parent exit on their own. The same with agents:
//! `tessera coordinator` + `tessera agent`, and `tessera launch` with a localhost hostfile.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// gpt-tiny, 12 micro-batches of one 32-token sequence per step; `ranks` is `--world N` or
/// `--nprocs N`.
fn args(out: &Path, ranks: &[&str], stage: u8, steps: u64) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> = ["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--no-progress"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["--steps".to_string(), steps.to_string()]);
    a.extend(ranks.iter().map(|s| s.to_string()));
    for set in [
        format!("zero_optimization.stage={stage}"),
        "train_batch_size=12".into(),
        "train_micro_batch_size_per_gpu=1".into(),
        "tessera.seq_len=32".into(),
        "tessera.eval_iters=1".into(),
        "tessera.eval_interval=0".into(),
        "scheduler.params.warmup_min_ratio=0.5".into(),
    ] {
        a.extend(["--set".to_string(), set]);
    }
    a
}

fn train(dir: &Path, name: &str, ranks: &[&str], stage: u8, steps: u64, extra: &[&str]) -> serde_json::Value {
    let out = dir.join(name);
    let mut a = args(&out, ranks, stage, steps);
    a.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    ok(&refs, dir);
    summary(&out)
}

#[test]
fn worker_processes_give_the_bits_of_one_worker_for_zero_1_and_3() {
    let tmp = tempfile::tempdir().unwrap();
    let one = train(tmp.path(), "w1", &["--world", "1"], 0, 3, &[]);
    for stage in [1u8, 3] {
        let s = train(tmp.path(), &format!("p3s{stage}"), &["--nprocs", "3"], stage, 3, &[]);
        assert_eq!(s["world_size"], 3);
        assert_eq!(s["zero_stage"], stage);
        assert_eq!(s["params_blake3"], one["params_blake3"], "3 processes, ZeRO-{stage} differ from one worker");
        assert_eq!(s["val_loss"], one["val_loss"], "ZeRO-{stage}: evaluation reads the exported masters");
        let ranks = s["model_state_bytes_per_rank"].as_array().unwrap();
        assert_eq!(ranks.len(), 3, "every worker reports its memory");
        assert!(s["bytes_sent_per_rank_per_step"].as_u64().unwrap() > 0, "ranks exchanged tensors");
        let out = tmp.path().join(format!("p3s{stage}"));
        assert!(workers_of(&out).is_empty(), "workers left behind");
        assert!(!out.join("procs").exists(), "the run's keys outlived the workers");
    }
}

/// The three-partial-sum batch of `e2e_zero` (7 micro-batches a rank in 4 processes; 14 a rank
/// in 2) over QUIC: the bits of one in-process worker.
#[test]
fn seven_micro_batches_a_process_give_the_bits_of_one_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let batch = crate::e2e_zero::SEVEN_A_RANK_AT_4;
    let one = train(tmp.path(), "w1", &["--world", "1"], 0, 3, batch);
    assert_eq!(one["tokens"], crate::e2e_zero::SEVEN_A_RANK_TOKENS, "the batch of 28 did not take: {one}");
    for (procs, stage) in [("4", 3u8), ("2", 1)] {
        let s = train(tmp.path(), &format!("p{procs}s{stage}"), &["--nprocs", procs], stage, 3, batch);
        assert_eq!(s["tokens"], one["tokens"]);
        assert_eq!(s["params_blake3"], one["params_blake3"], "28 micro-batches: {procs} processes, ZeRO-{stage} differ from one worker");
    }
}

#[test]
fn a_process_run_resumes_under_another_process_count() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = train(tmp.path(), "whole", &["--world", "1"], 2, 3, &[]);
    train(tmp.path(), "split", &["--nprocs", "2"], 2, 2, &[]);
    let ckpts = tmp.path().join("split/checkpoints");
    let resumed = train(tmp.path(), "split", &["--nprocs", "3"], 2, 3, &["--resume", ckpts.to_str().unwrap()]);
    assert_eq!(resumed["steps"], 3);
    assert_eq!(resumed["params_blake3"], whole["params_blake3"], "resume across process counts changed the bits");
}

#[test]
fn nprocs_and_world_together_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = args(&tmp.path().join("x"), &["--nprocs", "2", "--world", "2"], 0, 1);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let text = fails(&refs, tmp.path());
    assert!(text.contains("--world") && text.contains("--nprocs"), "{text}");
}

/// Starts a long 3-process ZeRO-3 run that checkpoints every step.
fn spawn_long_run(dir: &Path, out: &Path) -> std::process::Child {
    Command::new(bin())
        .args(args(out, &["--nprocs", "3"], 3, 100_000))
        .args(["--set", "tessera.checkpoint_interval=1"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning tessera")
}

/// Waits for the run's first checkpoint and its 3 workers; returns the workers' pids.
fn wait_for_workers(parent: &mut std::process::Child, out: &Path) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pids = workers_of(out);
        if pids.len() == 3 && out.join("checkpoints/latest").exists() {
            return pids;
        }
        if Instant::now() >= deadline {
            let _ = parent.kill();
            let _ = parent.wait();
            panic!("no checkpoint and 3 workers within 60 s (found {pids:?})");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The names of process `pid`'s threads.
fn thread_names(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok()).map(|n| n.trim().to_string()).collect()
}

/// Polls until `f` holds or `bound` passes; returns whether it held.
fn within(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

#[test]
fn a_killed_worker_ends_the_run_naming_its_rank_and_leaves_no_orphans() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut parent = spawn_long_run(tmp.path(), &out);
    let pids = wait_for_workers(&mut parent, &out);
    // A plain `--nprocs` run is the fleet with recovery off: every worker heartbeats on its side
    // connection, and the parent's one failure detector (the fleet's monitor) watches them.
    for pid in &pids {
        let names = thread_names(*pid);
        // `comm` keeps 15 bytes of a thread's name.
        assert!(names.iter().any(|n| n == &"tessera-heartbeat"[..15]), "worker {pid} sends no heartbeats: {names:?}");
    }
    let parent_threads = thread_names(parent.id());
    assert!(parent_threads.iter().any(|n| n == "tessera-monitor"), "no failure detector in the parent: {parent_threads:?}");
    let victim = pids[1];
    let cmd = std::fs::read(format!("/proc/{victim}/cmdline")).unwrap();
    let args: Vec<String> = cmd.split(|b| *b == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect();
    let rank = args.iter().position(|s| s == "--rank").map(|i| args[i + 1].clone()).unwrap();
    assert!(Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    if !within(Duration::from_secs(60), || parent.try_wait().unwrap().is_some()) {
        let _ = parent.kill();
        panic!("the parent did not exit within 60 s of a worker's death");
    }
    let output = parent.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "the run should fail:\n{text}");
    assert!(text.contains(&format!("rank {rank} (pid {victim}) was killed by signal 9")), "error should name rank {rank}:\n{text}");
    assert!(workers_of(&out).is_empty(), "orphan workers: {:?}", workers_of(&out));
}

#[test]
fn workers_exit_when_their_parent_is_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut parent = spawn_long_run(tmp.path(), &out);
    wait_for_workers(&mut parent, &out);
    parent.kill().unwrap();
    parent.wait().unwrap();
    assert!(within(Duration::from_secs(30), || workers_of(&out).is_empty()), "orphan workers: {:?}", workers_of(&out));
}

// ── Agents: `tessera coordinator` + `tessera agent`, and `tessera launch --hostfile` ──────────

/// `args` with `train` replaced by `coordinator --listen 127.0.0.1:0 --nodes N`.
fn coordinator_args(out: &Path, nodes: usize, stage: u8, steps: u64) -> Vec<String> {
    let mut a = args(out, &[], stage, steps);
    a[0] = "coordinator".into();
    a.extend(["--listen".into(), "127.0.0.1:0".into(), "--nodes".into(), nodes.to_string()]);
    a
}

/// A started coordinator: where agents join, the join token it printed (none with `--certs`),
/// and a thread collecting the rest of its stderr (joined by [`finish`]).
struct Coordinator {
    child: std::process::Child,
    addr: String,
    token: Option<String>,
    err: std::thread::JoinHandle<String>,
}

/// Starts a coordinator and reads its listen address and join token off its first line of stderr.
fn spawn_coordinator(dir: &Path, a: &[String]) -> Coordinator {
    use std::io::{BufRead, BufReader, Read};
    let mut c = Command::new(bin()).args(a).current_dir(dir).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning");
    let mut err = BufReader::new(c.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    let addr = first.split(" at ").nth(1).and_then(|s| s.split_whitespace().next()).map(str::to_string);
    let addr = addr.unwrap_or_else(|| panic!("no address in {first:?}"));
    let token = first.split("--token ").nth(1).and_then(|s| s.split(['`', ' ']).next()).map(str::to_string);
    let rest = std::thread::spawn(move || {
        let mut s = first;
        let _ = err.read_to_string(&mut s);
        s
    });
    Coordinator { child: c, addr, token, err: rest }
}

/// `--token T` for an agent of `c` (nothing for a `--certs` coordinator).
fn token_args(c: &Coordinator) -> Vec<String> {
    c.token.iter().flat_map(|t| ["--token".to_string(), t.clone()]).collect()
}

/// Waits (≤ 90 s) for a coordinator; returns (success, stdout + the collected stderr).
fn finish(co: Coordinator) -> (bool, String) {
    let (mut c, err) = (co.child, co.err);
    use std::io::Read;
    if !within(Duration::from_secs(90), || c.try_wait().unwrap().is_some()) {
        let _ = c.kill();
        panic!("the coordinator did not finish within 90 s");
    }
    let ok = c.wait().unwrap().success();
    let mut out = String::new();
    let _ = c.stdout.take().unwrap().read_to_string(&mut out);
    (ok, out + &err.join().unwrap())
}

fn spawn_agent(dir: &Path, c: &Coordinator, name: &str, extra: &[&str]) -> std::process::Child {
    Command::new(bin())
        .args(["agent", "--join", &c.addr, "--name", name])
        .args(token_args(c))
        .args(extra)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning an agent")
}

/// Waits (≤ 30 s) for an agent to end; returns (success, its output). An agent still running
/// then is killed and the test fails: "not success" must mean the agent gave up by itself.
fn agent_result(mut c: std::process::Child) -> (bool, String) {
    let ended = within(Duration::from_secs(30), || c.try_wait().unwrap().is_some());
    if !ended {
        let _ = c.kill();
    }
    let out = c.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(ended, "the agent did not end within 30 s by itself (killed):\n{text}");
    (out.status.success(), text)
}

#[test]
fn agents_joining_a_coordinator_give_the_bits_of_in_process_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let inproc = train(tmp.path(), "w3", &["--world", "3"], 1, 3, &[]);
    let out = tmp.path().join("co");
    let coord = spawn_coordinator(tmp.path(), &coordinator_args(&out, 3, 1, 3));
    let token = coord.token.clone().expect("the coordinator prints a join token");
    // A stranger with the right CA fingerprint but not the secret is refused; the run goes on.
    let (_, fingerprint) = token.rsplit_once('-').unwrap();
    let forged = format!("tsr1-{}-{fingerprint}", "0".repeat(32));
    let stranger = Command::new(bin())
        .args(["agent", "--join", &coord.addr, "--name", "stranger", "--token", &forged, "--connect-timeout", "5"])
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, stext) = agent_result(stranger);
    assert!(!ok, "an agent without the token's secret took part:\n{stext}");
    // One agent asks for rank 0 explicitly; the others take the free ranks in join order.
    let agents: Vec<_> = [("a0", &[][..]), ("a1", &["--rank", "0"][..]), ("a2", &[][..])]
        .iter()
        .map(|(name, extra)| spawn_agent(tmp.path(), &coord, name, extra))
        .collect();
    let (ok, text) = finish(coord);
    assert!(ok, "the coordinator failed:\n{text}");
    assert!(text.contains("refused a connection") && text.contains("did not present this run's join token"), "{text}");
    assert!(!text.contains("stranger at"), "the stranger was counted as joined:\n{text}");
    for (i, a) in agents.into_iter().enumerate() {
        let (ok, atext) = agent_result(a);
        assert!(ok, "agent a{i} failed:\n{atext}");
        if i == 1 {
            assert!(atext.contains("agent a1: rank 0 of 3"), "a1 asked for rank 0:\n{atext}");
        }
    }
    let s = summary(&out);
    assert_eq!(s["world_size"], 3);
    assert_eq!(s["params_blake3"], inproc["params_blake3"], "3 agents differ from 3 in-process ranks");
    assert_eq!(s["val_loss"], inproc["val_loss"]);
    assert!(s["bytes_sent_per_rank_per_step"].as_u64().unwrap() > 0, "ranks exchanged tensors");
    assert!(!out.join("procs").exists(), "the run's keys outlived the agents");
}

/// Strangers that present a forged join token (the CA fingerprint right, the secret wrong) are
/// refused, and the coordinator's log says so in at most one line per interval, with a count of
/// the ones it left out: a flood once wrote one line per connection. The run then goes on.
#[test]
fn a_flood_of_refused_connections_is_logged_at_a_bounded_rate() {
    const STRANGERS: usize = 12;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("co");
    let coord = spawn_coordinator(tmp.path(), &coordinator_args(&out, 2, 1, 2));
    let token = coord.token.clone().expect("the coordinator prints a join token");
    let (_, fingerprint) = token.rsplit_once('-').unwrap();
    let forged = format!("tsr1-{}-{fingerprint}", "0".repeat(32));
    let strangers: Vec<_> = (0..STRANGERS)
        .map(|i| {
            Command::new(bin())
                .args(["agent", "--join", &coord.addr, "--name", &format!("stranger{i}"), "--token", &forged, "--connect-timeout", "5"])
                .current_dir(tmp.path())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for s in strangers {
        let (ok, stext) = agent_result(s);
        assert!(!ok, "an agent without the token's secret took part:\n{stext}");
    }
    let agents: Vec<_> = ["a0", "a1"].iter().map(|name| spawn_agent(tmp.path(), &coord, name, &[])).collect();
    let (ok, text) = finish(coord);
    assert!(ok, "the coordinator failed:\n{text}");
    for a in agents {
        let (ok, atext) = agent_result(a);
        assert!(ok, "an agent failed:\n{atext}");
    }
    let refused = text.lines().filter(|l| l.contains("refused a connection")).count();
    // All strangers knock within seconds of each other; the limit writes one line per
    // REFUSAL_LOG_INTERVAL_MS (10 s), so a slow machine may show a second or third.
    assert!((1..=3).contains(&refused), "{refused} lines for {STRANGERS} refused strangers:\n{text}");
    assert!(!text.contains("stranger0 at") && summary(&out)["world_size"] == 2, "{text}");
}

#[test]
fn launch_with_a_localhost_hostfile_gives_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let inproc = train(tmp.path(), "w3", &["--world", "3"], 3, 3, &[]);
    let hostfile = write(tmp.path(), "hostfile", "# three agents here\n\nlocalhost slots=3  # this machine\n");
    let out = tmp.path().join("la");
    let mut a = args(&out, &[], 3, 3);
    a[0] = "launch".into();
    a.extend(["--hostfile".into(), hostfile.display().to_string()]);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let text = ok(&refs, tmp.path());
    assert!(text.contains("agent localhost-2: rank 2 of 3"), "ranks follow the hostfile:\n{text}");
    let s = summary(&out);
    assert_eq!(s["params_blake3"], inproc["params_blake3"], "launched agents differ from 3 in-process ranks");
    let bad = write(tmp.path(), "bad", "localhost slots=1\nnode2 slots=two\n");
    let mut b = args(&tmp.path().join("bad-run"), &[], 0, 1);
    b[0] = "launch".into();
    b.extend(["--hostfile".into(), bad.display().to_string()]);
    let refs: Vec<&str> = b.iter().map(String::as_str).collect();
    let text = fails(&refs, tmp.path());
    assert!(text.contains(&format!("{}:2: slots=two is not a whole number", bad.display())), "{text}");
}

/// Pids of live processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let mut rest = stat.rsplit(')').next()?.split_whitespace();
            let (state, ppid) = (rest.next()?, rest.next()?.parse::<u32>().ok()?);
            (ppid == parent && state != "Z").then_some(pid)
        })
        .collect()
}

#[test]
fn a_killed_agent_ends_the_launched_run_naming_its_rank_and_leaves_no_orphans() {
    let tmp = tempfile::tempdir().unwrap();
    let hostfile = write(tmp.path(), "hostfile", "localhost slots=3\n");
    let out = tmp.path().join("run");
    let mut a = args(&out, &[], 3, 100_000);
    a[0] = "launch".into();
    a.extend(["--hostfile".into(), hostfile.display().to_string(), "--set".into(), "tessera.checkpoint_interval=1".into()]);
    let mut launch = Command::new(bin()).args(&a).current_dir(tmp.path()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let lpid = launch.id();
    let up = within(Duration::from_secs(60), || children_of(lpid).len() == 3 && out.join("checkpoints/latest").exists());
    if !up {
        let _ = launch.kill();
        panic!("no checkpoint and 3 agents within 60 s");
    }
    // Its agents, by pid: once the launcher is gone a survivor would be re-parented, so the
    // orphan check below looks for these pids, not for children of the launcher.
    let agents = children_of(lpid);
    // Ranks follow the hostfile: the agent started with `--rank 1`.
    let victim = children_of(lpid)
        .into_iter()
        .find(|p| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default().split(|b| *b == 0).any(|w| w == b"localhost-1"))
        .expect("the agent of rank 1");
    assert!(Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    if !within(Duration::from_secs(60), || launch.try_wait().unwrap().is_some()) {
        let _ = launch.kill();
        panic!("launch did not exit within 60 s of an agent's death");
    }
    let output = launch.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "the run should fail:\n{text}");
    assert!(text.contains(&format!("agent of rank 1 (localhost-1 at 127.0.0.1, pid {victim}) was killed by signal 9")), "{text}");
    let alive: Vec<u32> = agents.into_iter().filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists() && !zombie(*p)).collect();
    assert!(alive.is_empty(), "orphan agents still running after launch exited: {alive:?}");
}

#[test]
fn a_coordinator_names_who_joined_when_the_others_do_not_come() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = coordinator_args(&tmp.path().join("co"), 2, 0, 1);
    a.extend(["--join-timeout".into(), "2".into()]);
    let coord = spawn_coordinator(tmp.path(), &a);
    let (addr, token) = (coord.addr.clone(), coord.token.clone().expect("a token"));
    let agent = spawn_agent(tmp.path(), &coord, "lonely", &[]);
    let (ok, text) = finish(coord);
    assert!(!ok, "the run should fail:\n{text}");
    assert!(text.contains("only 1 of 2 agents joined") && text.contains("agent lonely at 127.0.0.1"), "{text}");
    let (ok, atext) = agent_result(agent);
    assert!(!ok, "the agent should fail once the coordinator gives up:\n{atext}");
    // An agent with nobody to join gives up within its connect timeout, naming the address.
    let lost = Command::new(bin())
        .args(["agent", "--join", &addr, "--name", "late", "--token", &token, "--connect-timeout", "1"])
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, ltext) = agent_result(lost);
    assert!(!ok && ltext.contains(&format!("could not reach the coordinator at {addr}")), "{ltext}");
}

/// A coordinator stopped (SIGTERM) while it waits for its agents ends without waiting out its
/// join timeout, naming the signal and who had joined: the stop reaches the rendezvous through
/// the fleet's `Host` (`engine::fleet::SignalHost`).
#[test]
fn a_coordinator_stopped_while_its_agents_join_says_no_step_ran() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = coordinator_args(&tmp.path().join("co"), 2, 0, 1);
    a.extend(["--join-timeout".into(), "60".into()]);
    let coord = spawn_coordinator(tmp.path(), &a);
    // SAFETY: kill(2) on a process this test started.
    assert_eq!(unsafe { libc::kill(coord.child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let (ok, text) = finish(coord);
    assert!(!ok, "the run should fail:\n{text}");
    assert!(text.contains("SIGTERM before every agent joined (0 of 2 joined: none); no step ran, nothing to save"), "{text}");
}

#[test]
fn pre_distributed_certificates_keep_the_keys_on_their_hosts() {
    let tmp = tempfile::tempdir().unwrap();
    let inproc = train(tmp.path(), "w2", &["--world", "2"], 2, 2, &[]);
    let certs = tmp.path().join("cluster");
    let made = ok(&["cluster", "init", certs.to_str().unwrap(), "--nodes", "2"], tmp.path());
    assert!(made.contains("coordinator and 2 node certificates"), "{made}");
    let certs_s = certs.display().to_string();
    let out = tmp.path().join("co");
    let mut a = coordinator_args(&out, 2, 2, 2);
    a.extend(["--certs".into(), certs_s.clone()]);
    let coord = spawn_coordinator(tmp.path(), &a);
    assert!(coord.token.is_none(), "a --certs coordinator issues no token");
    // Each agent presents the certificate of the rank it asks for (the directory holds both).
    let agents: Vec<_> =
        (0..2).map(|i| spawn_agent(tmp.path(), &coord, &format!("c{i}"), &["--certs", &certs_s, "--rank", &i.to_string()])).collect();
    let (ok, text) = finish(coord);
    assert!(ok, "the coordinator failed:\n{text}");
    for a in agents {
        let (ok, atext) = agent_result(a);
        assert!(ok, "an agent failed:\n{atext}");
    }
    assert_eq!(summary(&out)["params_blake3"], inproc["params_blake3"], "agents with their own certificates differ");
    assert!(!out.join("procs").exists(), "no key directory is made with --certs");
    // Without a certificate or a token an agent does not even try, and says what it needs.
    let keyless =
        Command::new(bin()).args(["agent", "--join", "127.0.0.1:9", "--name", "keyless"]).current_dir(tmp.path()).output().unwrap();
    let ktext = String::from_utf8_lossy(&keyless.stderr);
    assert!(!keyless.status.success() && ktext.contains("join token") && ktext.contains("--certs DIR"), "{ktext}");
    // A certificate of another cluster's CA fails the coordinator's mutual TLS.
    let foreign = tmp.path().join("foreign");
    crate::common::ok(&["cluster", "init", foreign.to_str().unwrap(), "--nodes", "1"], tmp.path());
    let mut a = coordinator_args(&tmp.path().join("co2"), 1, 0, 1);
    a.extend(["--certs".into(), certs_s, "--join-timeout".into(), "3".into()]);
    let coord = spawn_coordinator(tmp.path(), &a);
    let agent = spawn_agent(tmp.path(), &coord, "foreigner", &["--certs", foreign.to_str().unwrap(), "--connect-timeout", "2"]);
    let (ok, text) = finish(coord);
    assert!(!ok && text.contains("only 0 of 1 agents joined"), "{text}");
    assert!(!agent_result(agent).0, "the agent with a foreign certificate should fail");
}

#[test]
fn agents_exit_when_their_coordinator_is_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("co");
    let mut a = coordinator_args(&out, 2, 1, 100_000);
    a.extend(["--set".into(), "tessera.checkpoint_interval=1".into()]);
    let coord = spawn_coordinator(tmp.path(), &a);
    let agents: Vec<_> = (0..2).map(|i| spawn_agent(tmp.path(), &coord, &format!("k{i}"), &[])).collect();
    let mut c = coord.child;
    if !within(Duration::from_secs(60), || out.join("checkpoints/latest").exists()) {
        let _ = c.kill();
        panic!("no checkpoint within 60 s");
    }
    c.kill().unwrap();
    c.wait().unwrap();
    drop(coord.err);
    for a in agents {
        let (ok, text) = agent_result(a);
        assert!(!ok && text.contains("error: agent k"), "an agent of a killed coordinator should fail on its own:\n{text}");
    }
}

#[test]
fn launch_starts_remote_agents_through_ssh() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let inproc = train(tmp.path(), "w3", &["--world", "3"], 1, 2, &[]);
    // A stand-in for ssh: records how it was called, then runs the remote command (its last
    // argument) here. `tests/e2e_hosts.rs` runs the real OpenSSH.
    let log = tmp.path().join("ssh.log");
    let script = format!("#!/bin/sh\necho \"$@\" >> '{}'\nfor a; do last=$a; done\nexec sh -c \"$last\"\n", log.display());
    let fake = write(tmp.path(), "fakessh", &script);
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hostfile = write(tmp.path(), "hostfile", "node-a slots=2\nlocalhost slots=1\n");
    let out = tmp.path().join("la");
    let mut a = args(&out, &[], 1, 2);
    a[0] = "launch".into();
    a.extend(
        [
            "--hostfile",
            hostfile.to_str().unwrap(),
            "--ssh",
            fake.to_str().unwrap(),
            "--coordinator-addr",
            "127.0.0.1",
            "--ssh-port",
            "2200",
            "--ssh-option",
            "User=root",
        ]
        .map(String::from),
    );
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let text = ok(&refs, tmp.path());
    assert!(text.contains("agent node-a-1: rank 1 of 3") && text.contains("agent localhost-0: rank 2 of 3"), "{text}");
    let calls = std::fs::read_to_string(&log).unwrap();
    assert_eq!(calls.lines().count(), 2, "one ssh per remote agent:\n{calls}");
    assert!(calls.lines().all(|l| l.starts_with("-o BatchMode=yes -p 2200 -o User=root node-a cd ") && l.contains("agent")), "{calls}");
    assert_eq!(summary(&out)["params_blake3"], inproc["params_blake3"], "agents started through ssh differ");
}
