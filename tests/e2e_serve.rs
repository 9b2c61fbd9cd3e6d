//! `tessera serve` run as a user runs it, on a copy of the LLaMA fixture folder given a chat
//! template: the official `openai` Python client against it (scripts/check_serve_openai.py),
//! raw HTTP bad input (malformed JSON, invalid UTF-8, a body over the limit, unknown routes), a
//! client that disconnects mid-stream, 1,000 concurrent connections, and SIGTERM finishing the
//! request in flight.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{bin, repo};

/// A chat template with Python string methods, short enough for the fixture's 64-token context
/// (its tokenizer has no ChatML tokens: `<|im_start|>` would cost a dozen tokens).
const TEMPLATE: &str =
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}";

/// The LLaMA fixture folder with a chat template, in `dir`.
pub fn model_folder(dir: &Path) -> std::path::PathBuf {
    let src = repo().join("tests/fixtures/hf/llama");
    let dst = dir.join("tiny-llama");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let settings = serde_json::json!({"chat_template": TEMPLATE, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"});
    std::fs::write(dst.join("tokenizer_config.json"), settings.to_string()).unwrap();
    dst
}

pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(model: &Path, extra: &[&str]) -> Server {
    let mut child = Command::new(bin())
        .args(["serve", "--model", model.to_str().unwrap(), "--addr", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning tessera serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split("http://").nth(1).unwrap_or_else(|| panic!("no address in {line:?}")).trim().to_string();
    Server { child, addr }
}

/// Sends raw bytes as one request; the status and the body (read to the end).
pub fn raw(addr: &str, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!("{head}\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string()))
}

pub fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    raw(addr, &format!("POST {path} HTTP/1.1"), body.as_bytes())
}

fn metric(addr: &str, name: &str) -> f64 {
    let (_, text) = raw(addr, "GET /metrics HTTP/1.1", b"");
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(f64::NAN)
}

#[test]
fn serve_answers_the_openai_client() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = start(&model_folder(tmp.path()), &[]);
    let ok = Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipping the openai client check: python3 cannot import openai (pip install openai)");
        return;
    }
    let out = Command::new("python3")
        .arg(repo().join("scripts/check_serve_openai.py"))
        .args([&format!("http://{}", srv.addr), "tiny-llama"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("OK: "), "check_serve_openai.py:\n{text}");
}

#[test]
fn serve_refuses_bad_input_clearly_and_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = start(&model_folder(tmp.path()), &["--max-body-bytes", "4096"]);
    let a = &srv.addr;
    let cases: [(&str, &[u8], u16, &str); 6] = [
        ("POST /v1/completions HTTP/1.1", b"{\"model\": ", 400, "not valid JSON"),
        ("POST /v1/completions HTTP/1.1", b"{\"model\": \"tiny-llama\", \"prompt\": \"\xff\xfe\"}", 400, "not UTF-8"),
        ("POST /v1/completions HTTP/1.1", &[b' '; 5000], 413, "larger than 4096 bytes"),
        (
            "POST /v1/chat/completions HTTP/1.1",
            b"{\"model\": \"tiny-llama\", \"messages\": [{\"role\": \"user\"}]}",
            400,
            "messages[0].content",
        ),
        ("POST /v1/completions HTTP/1.1", b"{\"model\": \"tiny-llama\", \"prompt\": \"x\", \"max_tokens\": 1e9}", 400, "max_tokens"),
        ("GET /v2/nothing HTTP/1.1", b"", 404, "no route /v2/nothing"),
    ];
    for (head, body, status, fragment) in cases {
        let (got, text) = raw(a, head, body);
        assert_eq!(got, status, "{head} {:?}: {text}", String::from_utf8_lossy(body));
        assert!(text.contains(fragment), "{head}: {text}");
    }
    let (code, text) = raw(a, "GET /health HTTP/1.1", b"");
    assert_eq!((code, text.contains("ok")), (200, true), "{text}");
    let (code, text) = post(a, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 3}"#);
    assert_eq!(code, 200, "{text}");
    assert!(metric(a, "tessera_serve_http_responses_total{endpoint=\"completions\",code=\"400\"}") >= 3.0);
}

#[test]
fn a_client_gone_mid_stream_is_cancelled_and_many_connections_are_answered() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = start(&model_folder(tmp.path()), &["--max-queue", "64"]);
    let a = srv.addr.clone();
    // A stream read to its first event, then dropped. The tiny model's 50 tokens take a few
    // milliseconds, so on a loaded machine the request can end before the drop is seen; then it
    // counts as finished, not cancelled, and the test tries again (at most 10 times).
    let body = r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 50, "stream": true, "ignore_eos": true}"#;
    let finished = "tessera_serve_requests_finished_length_total";
    let mut cancelled = false;
    for attempt in 0..10 {
        let done_before = metric(&a, finished);
        let mut s = TcpStream::connect(&a).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut first = [0u8; 256];
        let n = s.read(&mut first).unwrap();
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&first[..n]));
        drop(s);
        let began = Instant::now();
        loop {
            if metric(&a, "tessera_serve_requests_cancelled_total") >= 1.0 {
                cancelled = true;
                break;
            }
            if metric(&a, finished) > done_before {
                eprintln!("attempt {attempt}: the stream ended before its drop was seen; again");
                break;
            }
            assert!(began.elapsed() < Duration::from_secs(60), "the dropped stream was neither cancelled nor finished");
            std::thread::sleep(Duration::from_millis(50));
        }
        if cancelled {
            break;
        }
    }
    assert!(cancelled, "no dropped stream was cancelled in 10 attempts");
    // 1,000 connections at once: each gets an answer, 200 or 429 (queue full), none is dropped.
    let req = r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 2}"#;
    let conns: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
            write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{req}", req.len()).unwrap();
            s
        })
        .collect();
    let mut by_code = std::collections::BTreeMap::new();
    for mut s in conns {
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let code: u16 = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        *by_code.entry(code).or_insert(0) += 1;
    }
    let answered: usize = by_code.iter().filter(|(c, _)| [200u16, 429].contains(c)).map(|(_, n)| n).sum();
    assert_eq!(answered, 1000, "answers by status: {by_code:?}");
    assert!(by_code.get(&200).is_some_and(|&n| n >= 64), "{by_code:?}");
    let (code, _) = post(&a, "/v1/completions", req);
    assert_eq!(code, 200, "still serving");
}

#[test]
fn sigterm_finishes_the_requests_in_flight_then_exits() {
    let tmp = tempfile::tempdir().unwrap();
    // One sequence at a time: at the signal, most of the 16 streams are still queued in the engine.
    let mut srv = start(&model_folder(tmp.path()), &["--max-seqs", "1"]);
    let body = r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 50, "stream": true, "ignore_eos": true}"#;
    let mut streams: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut s = TcpStream::connect(&srv.addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
            write!(
                s,
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            s
        })
        .collect();
    let mut first = [0u8; 64];
    assert!(streams[0].read(&mut first).unwrap() > 0);
    // Every request accepted (read and queued) before the signal: a request the server has not
    // read yet when SIGTERM comes is not in flight, and is refused like any new one. (On a loaded
    // machine the last of the 16 may still be unread when the first token arrives.)
    let began = Instant::now();
    while metric(&srv.addr, "tessera_serve_in_flight") < 16.0 {
        assert!(began.elapsed() < Duration::from_secs(60), "the server did not accept all 16 requests");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling the child this test started.
    assert_eq!(unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) }, 0);
    for (i, s) in streams.iter_mut().enumerate() {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let text = String::from_utf8_lossy(&got);
        assert!(text.contains("data: [DONE]") && text.contains("\"finish_reason\":\"length\""), "stream {i} was cut: {text}");
    }
    let began = Instant::now();
    let status = loop {
        if let Some(st) = srv.child.try_wait().unwrap() {
            break st;
        }
        assert!(began.elapsed() < Duration::from_secs(60), "serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(TcpStream::connect(&srv.addr).is_err(), "still listening after exit");
}

/// `--weights` a device cannot hold is refused naming the flag; `--device cuda` without a GPU is
/// refused naming the flag (the error is the driver's sentence), and with one it generates;
/// `--pipeline-parallel-size 2` generates the one-process text.
#[test]
fn the_device_and_weights_flags_are_honoured_or_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_folder(tmp.path());
    let generate = |extra: &[&str]| {
        Command::new(bin())
            .args(["generate", "--checkpoint", model.to_str().unwrap(), "--prompt", "It is", "--tokens", "8", "--temperature", "0"])
            .args(extra)
            .output()
            .expect("running tessera generate")
    };
    let err = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
    for (extra, fragments) in [
        (&["--weights", "fp8"][..], &["--weights fp8", "--device cuda"][..]),
        (&["--weights", "bf16"][..], &["--weights bf16", "CPU backend holds f32 or int8"][..]),
        (&["--device", "cuda", "--weights", "f32"][..], &["--weights f32", "GPU backend holds bf16, int8 or fp8"][..]),
    ] {
        let out = generate(extra);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(fragments.iter().all(|f| err(&out).contains(f)), "{extra:?}: {}", err(&out));
    }
    let cpu = generate(&["--weights", "int8"]);
    assert!(cpu.status.success(), "{}", err(&cpu));
    // Over two pipeline ranks `generate` prints the one-process text, for both formats.
    for extra in [&[][..], &["--weights", "int8"][..]] {
        let one = generate(extra);
        let two = generate(&[extra, &["--pipeline-parallel-size", "2"][..]].concat());
        assert!(one.status.success() && two.status.success(), "{}{}", err(&one), err(&two));
        assert_eq!(String::from_utf8_lossy(&two.stdout), String::from_utf8_lossy(&one.stdout), "{extra:?}");
    }
    let gpu = generate(&["--device", "cuda"]);
    if gpu.status.success() {
        assert!(gpu.stdout.len() > "It is".len(), "{:?}", String::from_utf8_lossy(&gpu.stdout));
    } else {
        println!("no GPU here: {}", err(&gpu));
        assert!(err(&gpu).contains("--device cuda"), "{}", err(&gpu));
    }
}

/// The pids of the serve-rank processes `server` started (its children).
fn rank_pids(server: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{server}/task")).unwrap().flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        pids.extend(children.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
    }
    pids.retain(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("serve-rank")));
    pids.sort_unstable();
    pids
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// `serve --pipeline-parallel-size 2`: two rank processes hold the blocks; the openai client's
/// checks pass; greedy and seeded answers are the one-process server's, text for text; a rank
/// killed with a request in flight answers that request and every later one 503 naming the rank
/// (no hang), `/health` says so, and the other rank is stopped.
#[test]
fn serve_over_two_pipeline_ranks_answers_as_one_process_and_503s_when_a_rank_dies() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = model_folder(tmp.path());
    let (one, two) = (start(&folder, &[]), start(&folder, &["--pipeline-parallel-size", "2"]));
    let ranks = rank_pids(two.child.id());
    assert_eq!(ranks.len(), 2, "rank processes: {ranks:?}");
    answers_as_one_process(&one, &two);
    openai_checks_pass(&two.addr, "two ranks");
    // Rank 1 stops (SIGSTOP), a request comes and waits on it, then rank 1 is killed.
    // SAFETY: signalling processes this test's server started.
    assert_eq!(unsafe { libc::kill(ranks[1], libc::SIGSTOP) }, 0);
    let addr = two.addr.clone();
    let in_flight = std::thread::spawn(move || {
        post(&addr, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 5, "stream": true}"#)
    });
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(ranks[1], libc::SIGKILL) }, 0);
    let began = Instant::now();
    let (code, text) = in_flight.join().unwrap();
    assert!(began.elapsed() < Duration::from_secs(30), "the request in flight hung {:?}", began.elapsed());
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("backend_lost") && text.contains("rank 1 (blocks 1..2"), "the stream's end: {text}");
    let (code, text) = post(&two.addr, "/v1/completions", r#"{"model": "tiny-llama", "prompt": "It is", "max_tokens": 3}"#);
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("backend_lost") && text.contains("rank 1 (blocks 1..2") && text.contains("killed by signal 9"), "{text}");
    let (code, text) = raw(&two.addr, "GET /health HTTP/1.1", b"");
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("unavailable"), "{text}");
    let began = Instant::now();
    while alive(ranks[0]) {
        assert!(began.elapsed() < Duration::from_secs(20), "rank 0 still runs after the pipeline was lost");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Greedy, seeded and chat requests get the same answers from `two` (a server over ranks) as
/// from `one` (one process).
pub fn answers_as_one_process(one: &Server, two: &Server) {
    for body in [
        r#"{"model": "tiny-llama", "prompt": "It is a truth", "max_tokens": 20, "temperature": 0, "ignore_eos": true}"#,
        r#"{"model": "tiny-llama", "prompt": "Once", "max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 5}"#,
        r#"{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "seed": 3}"#,
    ] {
        let path = if body.contains("messages") { "/v1/chat/completions" } else { "/v1/completions" };
        let (a, b) = (post(&one.addr, path, body), post(&two.addr, path, body));
        let text = |s: &str| {
            let v: serde_json::Value = serde_json::from_str(s).unwrap();
            let c = &v["choices"][0];
            c["text"].as_str().or(c["message"]["content"].as_str()).map(str::to_string).unwrap_or_else(|| panic!("{s}"))
        };
        assert_eq!((a.0, b.0), (200, 200), "{a:?} {b:?}");
        assert_eq!(text(&b.1), text(&a.1), "{body}");
    }
}

/// The official `openai` client's checks (scripts/check_serve_openai.py) against `addr`, when
/// python3 can import it (else a printed skip); `what` names the server in the message.
pub fn openai_checks_pass(addr: &str, what: &str) {
    if !Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success()) {
        eprintln!("skipping the openai client check over {what}: python3 cannot import openai (pip install openai)");
        return;
    }
    let out = Command::new("python3")
        .arg(repo().join("scripts/check_serve_openai.py"))
        .args([&format!("http://{addr}"), "tiny-llama"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("OK: "), "check_serve_openai.py over {what}:\n{text}");
}
