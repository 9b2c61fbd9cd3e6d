//! `tessera serve --pipeline-parallel-size 2 --rank-listen` with its two ranks (`tessera
//! serve-rank --join`) on two network-namespace hosts joined by veth to a bridge
//! (`chaos/src/netns.rs`), the server in this process's namespace attached to it: the official
//! `openai` client's checks pass and greedy and seeded answers are the one-process server's, text
//! for text; a rank asking for a rank already held, a rank of another model and a server nobody
//! listens at are refused by name; a rank whose link is cut, and (with `--certs`) a rank
//! SIGKILLed, give 503 naming the rank within QUIC's idle timeout, not a hang. Needs root and
//! iproute2; without them the test prints why and checks nothing else.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{bin, repo};
use crate::e2e_serve::{answers_as_one_process, model_folder, openai_checks_pass, post, raw, start, Server};

use crate::e2e_hosts::netns::TestNet;

/// 10.231.<SUBNET>.0/24 (77: chaos/tests/netns.rs, 78–80: e2e_hosts.rs).
const SUBNET: u8 = 81;
const HOSTS: usize = 2;

/// A rank on host `i` joining `join` with `proof` (`--token-file F` or `--certs DIR --rank R`).
fn rank(net: &TestNet, i: usize, join: &str, model: &Path, proof: &[&str]) -> Child {
    let mut c = net.command(i, bin().to_str().unwrap());
    c.args(["serve-rank", "--join", join, "--model", model.to_str().unwrap(), "--name", &format!("host{i}")]);
    if !proof.contains(&"--connect-timeout") {
        c.args(["--connect-timeout", "20"]);
    }
    c.args(proof).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning serve-rank")
}

/// Waits for `c` (at most 60 s) and returns its output.
fn finish(mut c: Child) -> Output {
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = c.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    c.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `tessera serve --pp 2 --rank-listen join extra…` started, `ranks(join)` started once it
/// listens (its token file exists, with a token), and its address once it serves.
fn serve_over_hosts(
    model: &Path,
    join: &str,
    extra: &[&str],
    token: Option<&Path>,
    ranks: &dyn Fn() -> Vec<Child>,
) -> (Server, Vec<Child>) {
    let mut child = Command::new(bin())
        .args(["serve", "--model", model.to_str().unwrap(), "--addr", "127.0.0.1:0", "--pipeline-parallel-size", "2"])
        .args(["--rank-listen", join, "--join-timeout", "60"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning tessera serve");
    let began = Instant::now();
    while token.is_some_and(|t| !t.exists()) {
        assert!(began.elapsed() < Duration::from_secs(30), "no token file");
        std::thread::sleep(Duration::from_millis(20));
    }
    if token.is_none() {
        std::thread::sleep(Duration::from_millis(500));
    }
    let started = ranks();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split("http://").nth(1).unwrap_or_else(|| panic!("no address in {line:?}")).trim().to_string();
    (Server { child, addr }, started)
}

/// The request waits on the lost rank, then is answered 503 naming it (within 40 s: QUIC's
/// 10 s idle timeout, not a hang); `/health` says so too.
fn answers_503_naming(addr: &str, who: &str) {
    let began = Instant::now();
    let (code, body) = post(addr, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 3}"#);
    assert!(began.elapsed() < Duration::from_secs(40), "the request hung {:?}", began.elapsed());
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("backend_lost") && body.contains(who), "{body}");
    let (code, body) = raw(addr, "GET /health HTTP/1.1", b"");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains(who), "{body}");
    eprintln!("503 after {:?}: {body}", began.elapsed());
}

#[test]
fn serve_ranks_on_namespace_hosts_answer_as_one_process_and_503_when_cut_off_or_killed() {
    let mut net = match TestNet::new(HOSTS, SUBNET) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP: cannot make network namespaces here: {why}");
            return;
        }
    };
    let gw = net.attach_root().expect("attaching the root namespace to the test bridge");
    let tmp = tempfile::tempdir().unwrap();
    let folder = model_folder(tmp.path());
    let token = tmp.path().join("token");
    // The server listens in the root namespace, where other tests' sockets take ephemeral ports
    // (32768–60999): fixed ports below that range cannot collide with them.
    let join = format!("{gw}:29700");
    let tf = ["--token-file", token.to_str().unwrap()];
    let (two, ranks) = serve_over_hosts(&folder, &join, &tf, Some(&token), &|| {
        vec![rank(&net, 1, &join, &folder, &[&tf[..], &["--rank", "1"]].concat()), rank(&net, 0, &join, &folder, &tf)]
    });
    let one = start(&folder, &[]);
    answers_as_one_process(&one, &two);
    openai_checks_pass(&two.addr, "two namespace hosts");
    // A third rank asking for rank 1 hears who holds the ranks; the server keeps serving.
    let third = finish(rank(&net, 1, &join, &folder, &[&tf[..], &["--rank", "1"]].concat()));
    assert!(!third.status.success() && text(&third).contains("every rank of this server is held (rank 0 (blocks 0..1"), "{}", text(&third));
    assert_eq!(post(&two.addr, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It", "max_tokens": 2}"#).0, 200);
    // Nobody listens at this port of host 1: a clear error, not a hang.
    let nobody = finish(rank(&net, 0, &format!("{}:47799", net.addr(1)), &folder, &[&tf[..], &["--connect-timeout", "2"]].concat()));
    assert!(
        !nobody.status.success()
            && text(&nobody).contains(&format!("could not reach the coordinator at {}:47799 within 2000 ms", net.addr(1))),
        "{}",
        text(&nobody)
    );
    // Host 1's cable is cut.
    net.set_link(1, false).unwrap();
    answers_503_naming(&two.addr, "rank 1 (blocks 1..2, pid ");
    net.set_link(1, true).unwrap();
    drop(two);
    for r in ranks {
        let _ = finish(r);
    }

    // A rank of another model is refused at start, by the key that differs.
    let gpt2 = repo().join("tests/fixtures/hf/gpt2");
    let join = format!("{gw}:29701");
    let token = tmp.path().join("token2");
    let tf = ["--token-file", token.to_str().unwrap()];
    let mut server = Command::new(bin())
        .args([
            "serve",
            "--model",
            folder.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
            "--pp",
            "2",
            "--rank-listen",
            &join,
            "--join-timeout",
            "60",
        ])
        .args(tf)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while !token.exists() {
        assert!(server.try_wait().unwrap().is_none(), "the server ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    let other = finish(rank(&net, 0, &join, &gpt2, &tf));
    let _ = server.kill();
    let srv = finish(server);
    for (who, out) in [("the server", &srv), ("the rank", &other)] {
        assert!(
            text(out).contains("serve-rank host0 at ")
                && text(out).contains("loaded another model than this server's: arch: Gpt (the server's: arch: Llama)"),
            "{who}:\n{}",
            text(out)
        );
    }

    // With a cluster directory: mutual TLS; rank 0 killed.
    let certs = tmp.path().join("certs");
    let init = Command::new(bin()).args(["cluster", "init", certs.to_str().unwrap(), "--nodes", "2"]).output().unwrap();
    assert!(init.status.success(), "{}", text(&init));
    let join = format!("{gw}:29702");
    let c = certs.to_str().unwrap();
    let (two, mut ranks) = serve_over_hosts(&folder, &join, &["--certs", c], None, &|| {
        (0..HOSTS).map(|i| rank(&net, i, &join, &folder, &["--certs", c, "--rank", &i.to_string()])).collect()
    });
    let (code, body) = post(&two.addr, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 4}"#);
    assert_eq!(code, 200, "{body}");
    ranks[0].kill().unwrap();
    answers_503_naming(&two.addr, "rank 0 (blocks 0..1, pid ");
    drop(two);
    for r in ranks {
        let _ = finish(r);
    }
}
