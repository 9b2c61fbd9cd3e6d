//! What a run leaves and how it behaves around its outputs: the output folder's lock, export
//! (refusal of a non-empty folder, `--force`, the tokenizer's files checked by `transformers`),
//! the monitors' timer tags, a diverged run, resume messages and refusals, streamed `generate`.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// The longest a test waits for a process to reach a point it must reach (a bound, not a
/// timing assertion: a build that never reaches it fails instead of hanging).
const REACH_TIMEOUT: Duration = Duration::from_secs(120);

fn train_args<'a>(out: &'a str, steps: &'a str, config: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", "--config", config, "--output", out, "--steps", steps, "--no-progress"];
    a.extend_from_slice(FAST);
    a
}

fn tiny_config() -> String {
    repo().join("configs/gpt-tiny.json").display().to_string()
}

#[test]
fn a_second_run_on_one_output_is_refused_naming_the_first_ones_pid() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    let mut first = Command::new(bin())
        .args(train_args(out.to_str().unwrap(), "100000", &cfg))
        .current_dir(tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning the first run");
    let pid = first.id().to_string();
    let began = Instant::now();
    while std::fs::read_to_string(out.join(".lock")).map(|s| s.trim().to_string()).ok().as_deref() != Some(pid.as_str()) {
        assert!(began.elapsed() < REACH_TIMEOUT, "the first run never wrote its pid into {}/.lock", out.display());
        assert!(first.try_wait().unwrap().is_none(), "the first run ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = fails(&train_args(out.to_str().unwrap(), "2", &cfg), tmp.path());
    assert!(text.contains(&format!("in use by another run (pid {pid}")), "{text}");
    assert!(first.try_wait().unwrap().is_none(), "the refused run must leave the first one running");
    // The lock dies with its holder: after a SIGKILL the folder is free again.
    first.kill().unwrap();
    first.wait().unwrap();
    ok(&train_args(out.to_str().unwrap(), "1", &cfg), tmp.path());
}

/// Whether python3 can import `modules`; prints why the check is skipped when not.
fn python_has(modules: &str, why: &str) -> bool {
    let found = Command::new("python3").args(["-c", &format!("import {modules}")]).output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipping {why}: python3 cannot import {modules} (pip install tokenizers transformers)");
    }
    found
}

/// Runs scripts/check_export.py on `export` and expects its tokenizer check to pass.
fn check_export_tokenizer(export: &Path) {
    if !python_has("tokenizers, transformers", "the transformers check of the exported tokenizer") {
        return;
    }
    let script = repo().join("scripts/check_export.py");
    let out = Command::new("python3").arg(&script).arg(export).output().expect("running check_export.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("OK: tokenizer"), "check_export.py {}:\n{text}", export.display());
}

#[test]
fn export_refuses_a_non_empty_folder_force_replaces_only_its_files_and_the_tokenizer_loads_in_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    ok(&train_args(out.to_str().unwrap(), "1", &cfg), tmp.path());
    let ckpt = out.join("checkpoints");
    let hf = tmp.path().join("hf");
    let export = |force: bool| {
        let mut a = vec!["export", "--checkpoint", ckpt.to_str().unwrap(), "--out", hf.to_str().unwrap()];
        if force {
            a.push("--force");
        }
        a
    };
    ok(&export(false), tmp.path());
    for f in ["model.safetensors", "config.json", "reference.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"] {
        assert!(hf.join(f).exists(), "export lacks {f}");
    }
    // The byte-level run's tokenizer gives each byte as its id.
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(hf.join("reference.json")).unwrap()).unwrap();
    let text = reference["text"].as_str().expect("reference.json has a sample text");
    let ids: Vec<u64> = text.bytes().map(u64::from).collect();
    assert_eq!(reference["text_ids"], serde_json::json!(ids));
    check_export_tokenizer(&hf);
    // A folder with anything in it is refused; --force replaces only the export's files.
    std::fs::write(hf.join("config.json"), "{}").unwrap();
    let mine = write(&hf, "notes.txt", "mine");
    let text = fails(&export(false), tmp.path());
    assert!(text.contains("is not empty") && text.contains("--force"), "{text}");
    assert_eq!(std::fs::read_to_string(hf.join("config.json")).unwrap(), "{}", "a refused export wrote over a file");
    ok(&export(true), tmp.path());
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "mine", "--force touched a file export does not write");
    assert!(std::fs::read_to_string(hf.join("config.json")).unwrap().contains("gpt2"), "--force did not replace config.json");
    // `--dtype bfloat16`: half the bytes, the config says so (a bf16 model folder exports so by itself).
    let bf = tmp.path().join("hf-bf16");
    let text = ok(&["export", "--checkpoint", ckpt.to_str().unwrap(), "--out", bf.to_str().unwrap(), "--dtype", "bfloat16"], tmp.path());
    assert!(text.contains("bfloat16 weights"), "{text}");
    let size = |d: &Path| std::fs::metadata(d.join("model.safetensors")).unwrap().len();
    // (Both files carry the same header of a few kB.)
    assert!(size(&hf) / 2 < size(&bf) && size(&bf) < size(&hf) / 2 + 16_384, "{} vs {} bytes", size(&bf), size(&hf));
    let config = std::fs::read_to_string(bf.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");
    check_export_tokenizer(&bf);
}

/// A tiny byte-level BPE (shared with the data module's tests).
const TINY_BPE: &str = include_str!("fixtures/tiny_bpe.json");

#[test]
fn export_of_a_tokenizer_run_carries_its_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let tok = write(tmp.path(), "tokenizer.json", TINY_BPE);
    let data = write(tmp.path(), "hello.txt", &"hello world\nhello hello world\n".repeat(400));
    let out = tmp.path().join("run");
    let mut a = train_args(out.to_str().unwrap(), "1", &cfg);
    a.extend_from_slice(&["--data", data.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap()]);
    ok(&a, tmp.path());
    let hf = tmp.path().join("hf");
    let ckpt = out.join("checkpoints");
    ok(&["export", "--checkpoint", ckpt.to_str().unwrap(), "--out", hf.to_str().unwrap()], tmp.path());
    assert_eq!(std::fs::read_to_string(hf.join("tokenizer.json")).unwrap(), TINY_BPE, "the run's tokenizer.json, byte for byte");
    check_export_tokenizer(&hf);
    // A tokenizer file changed since training is refused.
    std::fs::write(&tok, TINY_BPE.replace(r#""r": 6, "d": 7"#, r#""r": 7, "d": 6"#)).unwrap();
    let text = fails(&["export", "--checkpoint", ckpt.to_str().unwrap(), "--out", tmp.path().join("hf2").to_str().unwrap()], tmp.path());
    assert!(text.contains("changed since the checkpoint was trained"), "{text}");
}

#[test]
fn monitors_get_deepspeeds_timer_tags_grad_norm_and_tokens_per_s() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    let mut a = train_args(out.to_str().unwrap(), "2", &cfg);
    a.extend_from_slice(&["--set", "wall_clock_breakdown=true"]);
    ok(&a, tmp.path());
    let timers = ["forward", "backward", "backward_inner", "backward_allreduce", "step"];
    for name in timers.iter().map(|t| format!("elapsed_time_ms_{t}")).chain(["grad_norm".into(), "tokens_per_s".into()]) {
        let tag = format!("Train/Samples/{name}");
        let v = metric(&out, &tag);
        assert!(v.len() == 2 && v.iter().all(|x| x.is_finite() && *x >= 0.0), "{tag}: {v:?}");
        let csv = out.join("csv").join(format!("Train_Samples_{name}.csv"));
        assert!(csv.exists(), "the csv monitor lacks {}", csv.display());
    }
    for name in ["forward", "backward_inner", "step"] {
        assert!(metric(&out, &format!("Train/Samples/elapsed_time_ms_{name}")).iter().all(|&ms| ms > 0.0), "{name} was not measured");
    }
    let (b, inner, reduce) = (
        metric(&out, "Train/Samples/elapsed_time_ms_backward"),
        metric(&out, "Train/Samples/elapsed_time_ms_backward_inner"),
        metric(&out, "Train/Samples/elapsed_time_ms_backward_allreduce"),
    );
    for i in 0..2 {
        assert!((b[i] - inner[i] - reduce[i]).abs() < 1e-6 * b[i].max(1.0), "backward = inner + allreduce: {b:?} {inner:?} {reduce:?}");
    }
    assert!(metric(&out, "Train/Samples/grad_norm").iter().all(|&n| n > 0.0));
    let tb = std::fs::read_dir(out.join("tensorboard")).unwrap().next().unwrap().unwrap().path();
    let events = std::fs::read(tb).unwrap();
    let tag = b"Train/Samples/elapsed_time_ms_forward";
    assert!(events.windows(tag.len()).any(|w| w == tag), "tensorboard lacks the forward timer");
    // A dense model reports no mixture-of-experts statistics (e2e_moe_outputs has them).
    assert!(metric(&out, "load_balancing_loss").is_empty() && summary(&out).get("moe").is_none());
    // Without wall_clock_breakdown the timers stay out; grad norm and tokens/s do not.
    let plain = tmp.path().join("plain");
    ok(&train_args(plain.to_str().unwrap(), "1", &cfg), tmp.path());
    assert!(metric(&plain, "Train/Samples/elapsed_time_ms_forward").is_empty());
    assert_eq!(metric(&plain, "Train/Samples/tokens_per_s").len(), 1);
}

#[test]
fn a_diverged_run_exits_non_zero_and_latest_is_never_a_nonfinite_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    let mut a = train_args(out.to_str().unwrap(), "10", &cfg);
    a.extend_from_slice(&["--set", "optimizer.params.lr=1e30", "--set", "tessera.checkpoint_interval=1", "--set", "tessera.keep_last=0"]);
    let text = fails(&a, tmp.path());
    assert!(text.contains("the run diverged") && text.contains("tessera.nonfinite_loss_steps = 3"), "{text}");
    let losses = metric(&out, "Train/Samples/train_loss");
    let first_bad = losses.iter().position(|l| !l.is_finite()).expect("lr 1e30 makes the loss non-finite");
    assert_eq!(losses.len(), first_bad + 3, "the run stops at the third non-finite step: {losses:?}");
    assert!(text.contains(&format!("step {}: the loss is", first_bad + 3)), "the error names the step: {text}");
    let root = out.join("checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).unwrap();
    let ck = tessera::checkpoint::load(&root.join(latest.trim())).expect("latest loads");
    assert!(ck.step as usize <= first_bad, "latest is step {} but the loss was not finite from step {}", ck.step, first_bad + 1);
    assert!(ck.params.iter().all(|t| t.data.iter().all(|x| x.is_finite())), "latest holds a non-finite parameter");
    for (step, _) in tessera::checkpoint::list_checkpoints(&root).unwrap() {
        assert!(step as usize <= first_bad, "a checkpoint of step {step}, whose loss was not finite, was written");
    }
}

#[test]
fn a_resume_names_its_checkpoint_and_refuses_another_seq_len() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    let mut a = train_args(out.to_str().unwrap(), "2", &cfg);
    a.extend_from_slice(&["--set", "tessera.checkpoint_interval=1", "--set", "tessera.keep_last=0"]);
    ok(&a, tmp.path());
    let root = out.join("checkpoints");
    // `latest` names step 1 (a hand edit, another run): the resume says step 2 is newer.
    std::fs::write(root.join("latest"), "step_00000001\n").unwrap();
    let mut r = train_args(out.to_str().unwrap(), "3", &cfg);
    r.extend_from_slice(&["--resume", root.to_str().unwrap()]);
    let text = ok(&r, tmp.path());
    let step1 = root.join("step_00000001");
    assert!(text.contains(&format!("resuming from checkpoint {} (step 1)", step1.display())), "{text}");
    assert!(text.contains("latest names step 1") && text.contains("step_00000002 (step 2) is newer"), "{text}");
    // Samples are windows of seq_len tokens: another length would change the data order.
    let mut r = train_args(out.to_str().unwrap(), "5", &cfg);
    r.extend_from_slice(&["--resume", root.to_str().unwrap(), "--set", "tessera.seq_len=16"]);
    let text = fails(&r, tmp.path());
    assert!(text.contains("trained with seq_len 32 but this run has 16"), "{text}");
}

#[test]
fn generate_streams_its_tokens_and_a_closed_pipe_ends_it_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("run");
    ok(&train_args(out.to_str().unwrap(), "1", &cfg), tmp.path());
    let ckpt = out.join("checkpoints");
    let prompt = "Emma";
    let mut child = Command::new(bin())
        .args(["generate", "--checkpoint", ckpt.to_str().unwrap(), "--prompt", prompt, "--tokens", "10000000"])
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning generate");
    let mut stdout = child.stdout.take().unwrap();
    // Read on a thread, so that a generate that prints only at the end fails the test at the
    // bound instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let (close, closing) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while got.len() < prompt.len() + 32 {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let _ = tx.send(got);
        // Then `stdout` is dropped, which closes the pipe.
        let _ = closing.recv();
    });
    let Ok(got) = rx.recv_timeout(REACH_TIMEOUT) else {
        child.kill().unwrap();
        panic!("generate printed no {} bytes within {REACH_TIMEOUT:?}: it does not stream", prompt.len() + 32);
    };
    assert!(got.starts_with(prompt.as_bytes()) && got.len() >= prompt.len() + 32, "{:?}", String::from_utf8_lossy(&got));
    assert!(child.try_wait().unwrap().is_none(), "the tokens came while generate runs, long before its 10^7th");
    close.send(()).unwrap();
    reader.join().unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "generate should end cleanly when its reader goes away: {status}");
}
