//! Expert parallelism through the CLI, on the Mixtral fixture folder (4 experts, top 2, every
//! block MoE): worker processes over QUIC with `tessera.moe.ep_size` give the bits of one
//! worker, a resume under another `ep_size` (processes or threads, another ZeRO stage) keeps
//! them, and an `ep_size` that cannot split the world or the experts is refused by key.

use std::path::Path;

use crate::common::*;

fn train(out: &Path, steps: &str, more: &[&str]) -> String {
    let cfg = repo().join("configs/gpt-tiny.json");
    let model = repo().join("tests/fixtures/hf/mixtral");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap()];
    a.extend_from_slice(&["--output", out.to_str().unwrap(), "--steps", steps, "--no-progress"]);
    a.extend_from_slice(&["--set", "tessera.seq_len=32", "--set", "tessera.eval_interval=3", "--set", "tessera.checkpoint_interval=3"]);
    a.extend_from_slice(more);
    ok(&a, out.parent().unwrap())
}

fn bits(out: &Path) -> String {
    summary(out)["params_blake3"].as_str().expect("params_blake3").to_string()
}

#[test]
fn four_processes_with_ep_size_2_at_zero_3_give_one_workers_bits_and_resume_under_other_ep_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, ep2) = (tmp.path().join("one"), tmp.path().join("ep2"));
    train(&one, "6", &["--world", "1"]);
    train(&ep2, "6", &["--nprocs", "4", "--set", "tessera.moe.ep_size=2", "--set", "zero_optimization.stage=3"]);
    assert_eq!(bits(&ep2), bits(&one), "--nprocs 4 with ep_size 2 at ZeRO-3 is not one worker's run");
    // The experts' tokens travelled: more bytes a step than the same processes without groups.
    let plain = tmp.path().join("plain");
    train(&plain, "6", &["--nprocs", "4", "--set", "zero_optimization.stage=3"]);
    let sent = |d: &Path| summary(d)["bytes_sent_per_rank_per_step"].as_f64().unwrap();
    assert!(sent(&ep2) > sent(&plain), "ep_size 2 sent {} bytes a step, without it {}", sent(&ep2), sent(&plain));
    // A topology-changing resume: step 3 of the ep_size-2 run, continued with ep_size 4 by
    // processes and with ep_size 2 by two threads at ZeRO-1.
    let at3 = ep2.join("checkpoints/step_00000003");
    for (name, more) in [
        ("ep4", vec!["--nprocs", "4", "--set", "tessera.moe.ep_size=4"]),
        ("threads", vec!["--world", "2", "--set", "tessera.moe.ep_size=2", "--set", "zero_optimization.stage=1"]),
    ] {
        let out = tmp.path().join(name);
        let mut a = vec!["--resume", at3.to_str().unwrap()];
        a.extend(more);
        train(&out, "6", &a);
        assert_eq!(bits(&out), bits(&one), "{name}: the resume under another ep_size changed the bits");
    }
}

#[test]
fn an_ep_size_that_cannot_split_the_world_or_the_experts_is_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let model = repo().join("tests/fixtures/hf/mixtral");
    for (more, want) in [
        (["--world", "2", "--set", "tessera.moe.ep_size=4"], "tessera.moe.ep_size = 4 must divide the world size 2"),
        (["--world", "4", "--set", "tessera.moe.ep_size=3"], "`tessera.moe.ep_size` = 3: it must divide the 4 experts"),
    ] {
        let out = tmp.path().join("out");
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--output", out.to_str().unwrap()];
        a.extend_from_slice(&more);
        let text = fails(&a, tmp.path());
        assert!(text.contains(want), "{more:?}: {text}");
        assert!(!out.exists(), "a refused run left {}", out.display());
    }
}

/// The shipped `configs/gpt-tiny-moe.json` (DeepSpeed's MoE arguments on gpt-tiny: GELU experts,
/// a capacity that drops tokens, RSample noise, random token selection, `ep_size` 2): four
/// worker processes give one worker's bits (noise and slot order are keyed by the micro-batch,
/// never the rank), and the run drops tokens, as the summary says.
#[test]
fn the_shipped_gpt_moe_config_with_drops_and_noise_gives_one_workers_bits_over_processes() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny-moe.json");
    let run = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "6", "--no-progress"];
        a.extend_from_slice(more);
        ok(&a, tmp.path());
        out
    };
    let one = run("one", &["--world", "1", "--set", "tessera.moe.ep_size=1"]);
    let four = run("four", &["--nprocs", "4"]);
    assert_eq!(bits(&four), bits(&one), "gpt-tiny-moe: four processes with ep_size 2 are not one worker's run");
    let dropped = summary(&four)["moe"]["dropped_fraction"].as_f64().expect("moe.dropped_fraction");
    assert!(dropped > 0.0, "a capacity factor of 1.25 dropped nothing");
}
