//! Bad input gives a clear error naming the problem and a non-zero exit; nothing is lost.

use std::path::Path;

use crate::common::*;

#[test]
fn misspelt_key_is_rejected_with_a_suggestion() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "bad.json", r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_sise": 5e8}}"#);
    let text = fails(&["config", "check", cfg.to_str().unwrap()], tmp.path());
    assert!(text.contains("zero_optimization.reduce_bucket_sise"), "{text}");
    assert!(text.contains("reduce_bucket_size"), "{text}");
}

#[test]
fn inconsistent_batch_shows_the_three_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg =
        write(tmp.path(), "bad.json", r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}"#);
    let text = fails(&["config", "check", cfg.to_str().unwrap()], tmp.path());
    for n in ["10", "4", "2"] {
        assert!(text.contains(n), "{text}");
    }
}

#[test]
fn missing_data_path_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let text = fails(
        &[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--data",
            "/nonexistent/corpus.txt",
            "--no-progress",
        ],
        tmp.path(),
    );
    assert!(text.contains("/nonexistent/corpus.txt"), "{text}");
}

#[test]
fn corrupted_checkpoint_is_reported_and_the_previous_one_still_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = vec![
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--steps",
        "4",
        "--no-progress",
        "--set",
        "tessera.checkpoint_interval=2",
    ];
    a.extend_from_slice(FAST);
    ok(&a, tmp.path());
    let ckpts = out.join("checkpoints");
    let newest = ckpts.join("step_00000004");
    let params = newest.join("params.safetensors");
    let bytes = std::fs::read(&params).unwrap();
    std::fs::write(&params, &bytes[..bytes.len() / 2]).unwrap();
    // Loading that step directly names the file.
    let text = fails(&["generate", "--checkpoint", newest.to_str().unwrap(), "--tokens", "2"], tmp.path());
    assert!(text.contains("params.safetensors"), "{text}");
    // The root falls back to step 2, with a warning about step 4.
    let text = ok(&["generate", "--checkpoint", ckpts.to_str().unwrap(), "--tokens", "2"], tmp.path());
    assert!(text.contains("step_00000004"), "{text}");
}

/// A bad value of a QUIC transport variable (and of any `TESSERA_*` variable: docs/ENV.md) is
/// refused at start-up, naming the variable, the value and what was expected — not ignored
/// (`TESSERA_QUIC_WORKERS` used to fall back to the default in silence) and not left to each
/// worker process to fail on when it connects.
#[test]
fn bad_quic_variables_are_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut args = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--nprocs", "2"];
    args.extend_from_slice(&["--steps", "1", "--no-progress"]);
    args.extend_from_slice(FAST);
    let cases = [
        ("TESSERA_QUIC_WORKERS", "0", "expected a number of worker threads from 1 to 64"),
        ("TESSERA_QUIC_WORKERS", "many", "expected a number of worker threads from 1 to 64"),
        ("TESSERA_QUIC_LANES", "9", "expected a number of lanes from 1 to 8"),
        // Every TESSERA_* variable is checked at start-up (src/env.rs), not the transport's only.
        ("TESSERA_AIO", "uring", "expected threads or io_uring"),
        ("TESSERA_TEST_FAULTS", "kill", "unknown fault `kill`"),
    ];
    for (name, value, expected) in cases {
        let res = std::process::Command::new(bin()).args(&args).env(name, value).current_dir(tmp.path()).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
        assert!(!res.status.success(), "{name}={value} was accepted:\n{text}");
        assert!(text.contains(&format!("{name}=\"{value}\": {expected}")), "{name}={value}:\n{text}");
        assert!(!out.join("procs").exists() && !out.join("summary.json").exists(), "{name}={value}: the run started:\n{text}");
    }
}

/// A run refused before it starts leaves no output directory behind: a config file that is not
/// a JSON object (the message used to blame `--output`, which is a `--set` underneath), a
/// `--resume` that holds no checkpoint, and elastic settings that contradict each other (they
/// were checked after the output directory was made).
#[test]
fn a_refused_run_leaves_no_output_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let array = write(tmp.path(), "array.json", "[1, 2]");
    let elastic = write(
        tmp.path(),
        "elastic.json",
        r#"{"train_batch_size": 8, "tessera": {"elastic": {"enabled": true, "min_workers": 5, "max_workers": 2}}}"#,
    );
    let missing = tmp.path().join("no-such-checkpoints");
    let cases: [(&str, &[&str], &[&str]); 3] = [
        ("array", &["--config", array.to_str().unwrap()], &["array.json", "(top level)", "expected a JSON object"]),
        (
            "resume",
            &["--config", cfg.to_str().unwrap(), "--resume", missing.to_str().unwrap()],
            &["no-such-checkpoints", "no valid checkpoint"],
        ),
        ("elastic", &["--config", elastic.to_str().unwrap()], &["elastic.json", "tessera.elastic.max_workers", "min_workers (5)"]),
    ];
    for (name, args, expected) in cases {
        let out = tmp.path().join(format!("out-{name}"));
        let mut a = vec!["train", "--output", out.to_str().unwrap(), "--steps", "2", "--world", "1", "--no-progress"];
        a.extend_from_slice(args);
        let text = fails(&a, tmp.path());
        for e in expected {
            assert!(text.contains(e), "{name}: no {e:?} in:\n{text}");
        }
        assert!(!text.contains("--set"), "{name}: blames an override:\n{text}");
        assert!(!out.exists(), "{name}: {} was left behind:\n{text}", out.display());
    }
}

/// An absurd world size is refused before anything starts (`--nprocs 100000` used to start
/// worker processes until the machine gave out; `--world 100000` ran 100000 threads; a
/// hostfile's `slots=100000` started 100000 agents).
#[test]
fn an_absurd_number_of_local_ranks_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let batch = ["--set", "train_batch_size=100000", "--set", "train_micro_batch_size_per_gpu=1"];
    for (flag, expected) in
        [("--nprocs", "--nprocs 100000: at most 1024 ranks"), ("--world", "world size 100000 (--world or tessera.world)")]
    {
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), flag, "100000", "--no-progress"];
        a.extend_from_slice(&batch);
        let text = fails(&a, tmp.path());
        assert!(text.contains(expected), "{flag}:\n{text}");
        assert!(!out.exists(), "{flag}: the run started:\n{text}");
    }
    let hosts = write(tmp.path(), "hosts", "localhost slots=100000\n");
    let mut a = vec!["launch", "--config", cfg.to_str().unwrap(), "--hostfile", hosts.to_str().unwrap(), "--output", out.to_str().unwrap()];
    a.extend_from_slice(&batch);
    let text = fails(&a, tmp.path());
    assert!(text.contains("hosts:1: host localhost has slots=100000"), "{text}");
    assert!(!out.exists(), "launch started:\n{text}");
}

/// A malformed `--join` fails at once, naming the flag and HOST:PORT, instead of being retried
/// for the whole connect timeout (120 s by default) as if the coordinator were down.
#[test]
fn a_malformed_join_address_fails_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let token = "tsr1-00000000000000000000000000000000-0000000000000000000000000000000000000000000000000000000000000000";
    for join in ["127.0.0.1", "127.0.0.1:notaport"] {
        let t0 = std::time::Instant::now();
        let text = fails(&["agent", "--join", join, "--token", token], tmp.path());
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "{join}: took {:?}", t0.elapsed());
        assert!(text.contains(&format!("--join {join:?}")) && text.contains("expected HOST:PORT"), "{join}:\n{text}");
    }
}

/// `cluster init` refuses a cluster of no nodes and a path that is a file, and an I/O error is
/// printed once (the cause used to be repeated: "File exists (os error 17): File exists (os
/// error 17)"); a missing tokenizer is called a tokenizer, not a data path.
#[test]
fn cluster_init_export_and_tokenizer_mistakes_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let text = fails(&["cluster", "init", "certs", "--nodes", "0"], tmp.path());
    assert!(text.contains("--nodes 0"), "{text}");
    assert!(!tmp.path().join("certs").exists(), "{text}");
    let file = write(tmp.path(), "file", "x");
    let text = fails(&["cluster", "init", file.to_str().unwrap(), "--nodes", "1"], tmp.path());
    assert!(text.contains("is not a directory"), "{text}");
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--world", "1", "--steps", "1"];
    a.extend_from_slice(&["--no-progress", "--tokenizer", "/nonexistent/tokenizer.json"]);
    let text = fails(&a, tmp.path());
    assert!(text.contains("tokenizer /nonexistent/tokenizer.json: no such file") && !text.contains("data path"), "{text}");
    a.truncate(a.len() - 2);
    a.extend_from_slice(FAST);
    ok(&a, tmp.path());
    let ckpts = out.join("checkpoints");
    let text = fails(&["export", "--checkpoint", ckpts.to_str().unwrap(), "--out", file.to_str().unwrap()], tmp.path());
    assert!(text.contains("file") && text.matches("os error 17").count() == 1, "{text}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x", "the file was written over");
}

/// A chaos scenario whose `config` names no file is refused before anything runs, saying where a
/// relative path is looked for, and leaves no output folder.
#[test]
fn a_chaos_scenario_without_its_config_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let sc = write(tmp.path(), "s.json", r#"{"config": "nope.json", "nprocs": 2, "steps": 3, "faults": []}"#);
    let out = tmp.path().join("chaos");
    let text = fails(&["chaos", "run", "--scenario", sc.to_str().unwrap(), "--output", out.to_str().unwrap(), "--no-progress"], tmp.path());
    assert!(text.contains("nope.json") && text.contains("scenario file's folder"), "{text}");
    assert!(!out.exists(), "{text}");
}

/// An agent the coordinator turns away hears why (the close frame's reason), not only "the peer
/// closed the control connection": a token with the right CA but a wrong secret.
#[test]
fn an_agent_with_a_wrong_join_token_is_told_so() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let tok = tmp.path().join("token");
    let mut coord = std::process::Command::new(bin())
        .args(["coordinator", "--config", cfg.to_str().unwrap(), "--listen", "127.0.0.1:0", "--nodes", "1"])
        .args(["--join-timeout", "60", "--token-file", tok.to_str().unwrap(), "--output", "run", "--no-progress"])
        .current_dir(tmp.path())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(coord.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let at = first.split(" at ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_else(|| panic!("{first}")).to_string();
    let good = std::fs::read_to_string(&tok).unwrap().trim().to_string();
    // Another secret (its first hex digit changed), the same CA fingerprint.
    let (head, rest) = good.split_at(5);
    let flipped = if rest.starts_with('0') { '1' } else { '0' };
    let bad = format!("{head}{flipped}{}", &rest[1..]);
    let agent = |token: &str| {
        let t0 = std::time::Instant::now();
        let out = std::process::Command::new(bin())
            .args(["agent", "--join", &at, "--token", token, "--connect-timeout", "60"])
            .current_dir(tmp.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{text}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "took {:?}: {text}", t0.elapsed());
        text
    };
    let text = agent(&bad);
    // The same secret, another CA fingerprint (its last hex digit changed): refused by the
    // agent's own TLS check, which used to be retried for the whole connect timeout.
    let last = if good.ends_with('0') { '1' } else { '0' };
    let other_ca = agent(&format!("{}{last}", &good[..good.len() - 1]));
    let _ = coord.kill();
    let _ = coord.wait();
    assert!(text.contains("wrong join token"), "{text}");
    assert!(other_ca.contains("is not the one this join token was made for"), "{other_ca}");
}

/// Resuming with another global batch names the checkpoint's batch size and what to pass (it
/// used to say only "data cursor 16 does not match step 2 of this batch geometry"); nothing is
/// written.
#[test]
fn resuming_with_another_batch_size_names_the_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--world", "1", "--no-progress"];
    a.extend_from_slice(FAST);
    let mut first = a.clone();
    first.extend_from_slice(&["--steps", "2"]);
    ok(&first, tmp.path());
    let ckpts = out.join("checkpoints");
    let before: Vec<_> = std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name()).collect();
    a.extend_from_slice(&["--steps", "4", "--resume", ckpts.to_str().unwrap(), "--set", "train_batch_size=16"]);
    let text = fails(&a, tmp.path());
    assert!(text.contains("trained with train_batch_size = 8") && text.contains("this run has 16"), "{text}");
    assert!(text.contains("resume with train_batch_size = 8"), "{text}");
    let after: Vec<_> = std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(before, after, "{text}");
}

/// `launch` and `coordinator` check the config before they start agents or print a join token
/// (`launch` used to start its agents, over ssh too, and only then find `stage` = 9); a
/// coordinator's bad `MASTER_PORT` is named; the one-machine bound on ranks does not apply to
/// agents, which bring hosts of their own.
#[test]
fn drivers_check_the_config_before_agents_start() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let hosts = write(tmp.path(), "hosts", "localhost slots=2\n");
    let bad = ["--set", "zero_optimization.stage=9", "--no-progress", "--output", "run"];
    let mut a = vec!["launch", "--config", cfg.to_str().unwrap(), "--hostfile", hosts.to_str().unwrap()];
    a.extend_from_slice(&bad);
    let text = fails(&a, tmp.path());
    assert!(text.contains("`zero_optimization.stage` = 9") && !text.contains("started") && !text.contains("agent"), "{text}");
    let mut a = vec!["coordinator", "--config", cfg.to_str().unwrap(), "--nodes", "2", "--listen", "127.0.0.1:0"];
    a.extend_from_slice(&bad);
    let text = fails(&a, tmp.path());
    assert!(text.contains("`zero_optimization.stage` = 9") && !text.contains("tsr1-"), "{text}");
    let res = std::process::Command::new(bin())
        .args(["coordinator", "--config", cfg.to_str().unwrap(), "--no-progress"])
        .env("MASTER_PORT", "abc")
        .env("WORLD_SIZE", "2")
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success() && text.contains("MASTER_PORT=\"abc\" is not a port number"), "{text}");
    let mut a = vec!["coordinator", "--config", cfg.to_str().unwrap(), "--nodes", "2000", "--listen", "127.0.0.1:0"];
    a.extend_from_slice(&["--join-timeout", "1", "--no-progress", "--output", "run"]);
    a.extend_from_slice(&["--set", "train_batch_size=2000", "--set", "train_micro_batch_size_per_gpu=1"]);
    let text = fails(&a, tmp.path());
    assert!(text.contains("only 0 of 2000 agents joined") && !text.contains("at most 1024"), "{text}");
    // No agent joined, so nothing was written: the output folder the run made is gone again.
    assert!(!tmp.path().join("run").exists(), "a coordinator that started no worker left its output folder");
}

/// A resume on other data than the checkpoint was trained on is warned of, naming both (a choice
/// DeepSpeed allows: the run goes on, from its state, on the new data); a resume on the same data
/// is not. The data is recorded in every checkpoint's manifest (`extra.data`: source, tokens,
/// blake3).
#[test]
fn resuming_on_other_data_is_warned_of() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--world", "1", "--no-progress"];
    a.extend_from_slice(FAST);
    let mut first = a.clone();
    first.extend_from_slice(&["--steps", "2"]);
    ok(&first, tmp.path());
    let ckpts = out.join("checkpoints");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpts.join("step_00000002/manifest.json")).unwrap()).unwrap();
    let recorded = &manifest["extra"]["data"];
    assert!(recorded["blake3"].as_str().is_some_and(|h| h.len() == 64) && recorded["tokens"].as_u64() > Some(0), "{manifest:#}");
    let mut same = a.clone();
    same.extend_from_slice(&["--steps", "3", "--resume", ckpts.to_str().unwrap()]);
    let text = ok(&same, tmp.path());
    assert!(!text.contains("was trained on"), "the same data: no warning\n{text}");
    // The corpus's second half: same tokenizer (bytes), other tokens.
    let corpus = std::fs::read(repo().join("data/corpus/austen.txt")).unwrap();
    let other = write(tmp.path(), "other.txt", &String::from_utf8_lossy(&corpus[corpus.len() / 2..]));
    let mut moved = a.clone();
    moved.extend_from_slice(&["--steps", "4", "--resume", ckpts.to_str().unwrap(), "--data", other.to_str().unwrap()]);
    let text = ok(&moved, tmp.path());
    assert!(text.contains("warning: checkpoint") && text.contains("step_00000003 was trained on"), "{text}");
    assert!(text.contains("austen.txt") && text.contains("other.txt"), "both data named: {text}");
    assert_eq!(summary(&out)["steps"], 4, "the run goes on: {text}");
}

/// `tessera.eval_iters = 2^64 - 1` panicked (capacity overflow) and 1e7 aborted on allocation
/// while `config check` said OK: both now refuse it, naming the key, the value and the limit.
#[test]
fn eval_iters_beyond_the_limit_is_refused_by_train_and_config_check() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let cache = format!("tessera.data_cache={}", tmp.path().join("cache").display());
    for value in ["18446744073709551615", "1e7"] {
        let set = format!("tessera.eval_iters={value}");
        let check = fails(&["config", "check", cfg.to_str().unwrap(), "--set", &set, "--set", &cache], tmp.path());
        let out = tmp.path().join("run");
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "1", "--no-progress"];
        a.extend_from_slice(&["--set", &set, "--set", &cache]);
        let train = fails(&a, tmp.path());
        let shown = if value == "1e7" { "10000000" } else { value };
        for text in [&check, &train] {
            assert!(text.contains(&format!("tessera.eval_iters = {shown}")) && text.contains("limit of 100000"), "{text}");
            assert!(!text.contains("panicked") && !text.contains("plan: OK"), "{text}");
        }
    }
}

/// llm.c shards with GPT-2 ids and no tokenizer once set the vocabulary to 50257 silently
/// (about 7x gpt-tiny's parameters): refused, stating the vocabulary and the parameter count.
#[test]
fn bin_shards_without_a_tokenizer_are_refused_with_the_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let shard = tmp.path().join("fineweb_train_000001.bin");
    let tokens: Vec<u32> = (0..4000).map(|i| (i * 7919) % 50257).collect();
    tessera::data::write_bin_shard(&shard, &tokens).unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let cache = format!("tessera.data_cache={}", tmp.path().join("cache").display());
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "1", "--no-progress"];
    a.extend_from_slice(&["--data", shard.to_str().unwrap(), "--set", &cache]);
    let text = fails(&a, tmp.path());
    for w in ["fineweb_train_000001.bin", "50257", "--tokenizer", "parameters", "gpt-tiny"] {
        assert!(text.contains(w), "{w}: {text}");
    }
    assert!(!out.join("checkpoints").exists(), "a refused run wrote nothing");
}

/// Binary or unknown data is refused by name, with the formats Tessera reads.
#[test]
fn binary_data_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let cache = format!("tessera.data_cache={}", tmp.path().join("cache").display());
    for (name, bytes) in [("scan.png", &b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"[..]), ("notes.txt", &b"PAR1\x15\x04\x15\0"[..])] {
        let data = tmp.path().join(name);
        std::fs::write(&data, bytes).unwrap();
        let text = fails(&["config", "check", cfg.to_str().unwrap(), "--data", data.to_str().unwrap(), "--set", &cache], tmp.path());
        assert!(text.contains(name) && text.contains("Tessera reads") && text.contains(".parquet"), "{text}");
    }
}

/// Flips the lowest bit of the last byte of `path` (tensor data, after the safetensors header):
/// the file keeps its size, so only its blake3 can tell.
fn flip_last_bit(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let before = bytes.len();
    *bytes.last_mut().expect("a non-empty checkpoint file") ^= 1;
    std::fs::write(path, &bytes).unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().len() as usize, before, "the flip must keep the size");
}

/// One flipped bit in checkpoint file `file` of the same size (the truncation test above is
/// stopped by the size check before any hash is compared): `--resume` of that step folder
/// refuses it, naming the file and the blake3 mismatch, and writes nothing; `--resume` of the
/// checkpoints root warns and falls back to the step before, and the run then ends on the bits of
/// the run that wrote the checkpoints.
fn a_flipped_bit_is_refused_or_skipped_on_resume(file: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let cfg = cfg.to_str().unwrap();
    let train = |out: &Path, steps: &str, extra: &[&str]| -> Vec<String> {
        let mut a = vec!["train", "--config", cfg, "--output", out.to_str().unwrap(), "--world", "2", "--steps", steps, "--no-progress"];
        a.extend_from_slice(&["--set", "tessera.checkpoint_interval=2"]);
        a.extend_from_slice(FAST);
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect()
    };
    let listing = |dir: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        names
    };
    let run = tmp.path().join("run");
    ok(&strs(&train(&run, "4", &[])), tmp.path());
    let ckpts = run.join("checkpoints");
    let newest = ckpts.join("step_00000004");
    let damaged = newest.join(file);
    flip_last_bit(&damaged);
    let before = (listing(&ckpts), listing(&newest));
    // The damaged step itself (with steps left to run): refused, naming the file and the
    // mismatch, and nothing written.
    let strict = tmp.path().join("strict");
    let text = fails(&strs(&train(&strict, "6", &["--resume", newest.to_str().unwrap()])), tmp.path());
    let named = damaged.display().to_string();
    assert!(text.contains(&named) && text.contains("blake3 mismatch") && text.contains("file corrupted"), "{text}");
    assert!(!strict.join("checkpoints").exists(), "a refused resume wrote checkpoints:\n{text}");
    assert_eq!((listing(&ckpts), listing(&newest)), before, "a refused resume changed the checkpoints");
    // The root: step 4 is skipped with a warning naming the file, and step 2 is resumed.
    let fallback = tmp.path().join("fallback");
    let text = ok(&strs(&train(&fallback, "4", &["--resume", ckpts.to_str().unwrap()])), tmp.path());
    let warned = text.contains("warning: skipped checkpoint") && text.contains(&named) && text.contains("blake3 mismatch");
    assert!(warned, "{text}");
    let (resumed, original) = (summary(&fallback), summary(&run));
    assert_eq!(resumed["tokens"].as_u64().unwrap() * 2, original["tokens"].as_u64().unwrap(), "steps 3-4 only:\n{text}");
    assert_eq!(resumed["params_blake3"], original["params_blake3"], "resumed from step 2, the run should end on the same bits");
}

#[test]
fn a_flipped_bit_in_optim_safetensors_is_refused_or_skipped_on_resume() {
    a_flipped_bit_is_refused_or_skipped_on_resume("optim.safetensors");
}

#[test]
fn a_flipped_bit_in_params_safetensors_is_refused_or_skipped_on_resume() {
    a_flipped_bit_is_refused_or_skipped_on_resume("params.safetensors");
}
