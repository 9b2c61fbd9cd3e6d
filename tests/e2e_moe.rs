//! Mixture-of-experts models through the CLI: a Mixtral folder trains to the same bits on one
//! rank, two ranks under ZeRO-2 and two worker processes under ZeRO-3, a resume under another
//! world size continues them, and its export reads back as the trained parameters and loads in
//! transformers with the same loss; the shipped `configs/mixtral-tiny.json` trains its preset
//! to the same bits on one and two ranks, and exports; a dense preset trained with a
//! `tessera.moe` section generates from its checkpoint (which records the section).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

fn mixtral() -> PathBuf {
    repo().join("tests/fixtures/hf/mixtral")
}

fn text(dir: &Path) -> PathBuf {
    let line = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n";
    write(dir, "austen.txt", &line.repeat(60))
}

/// Trains `model` on `data` into `out` for `steps` (the learning rate warms up over 2 steps, so
/// every step but the first moves the parameters).
fn train(model: &Path, data: &Path, out: &Path, steps: &str, more: &[&str]) -> String {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
    a.extend_from_slice(&["--output", out.to_str().unwrap(), "--steps", steps, "--no-progress"]);
    a.extend_from_slice(&["--set", "scheduler.params.warmup_num_steps=2"]);
    a.extend_from_slice(FAST);
    a.extend_from_slice(more);
    ok(&a, out.parent().unwrap())
}

#[test]
fn a_mixtral_folder_trains_to_the_same_bits_on_ranks_and_processes_resumes_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data) = (mixtral(), text(tmp.path()));
    let run = |name: &str| tmp.path().join(name);
    let (one, two, procs, split, frozen) = (run("one"), run("two"), run("procs"), run("split"), run("frozen"));
    let stage = |s: &'static str| ["--set", s];
    train(&model, &data, &one, "4", &["--world", "1"]);
    train(&model, &data, &two, "4", &[&["--world", "2"][..], &stage("zero_optimization.stage=2")].concat());
    train(&model, &data, &procs, "4", &[&["--nprocs", "2"][..], &stage("zero_optimization.stage=3")].concat());
    train(&model, &data, &split, "2", &[&["--world", "2"][..], &stage("zero_optimization.stage=1")].concat());
    let ckpt = split.join("checkpoints");
    train(&model, &data, &split, "4", &["--world", "1", "--resume", ckpt.to_str().unwrap()]);
    train(&model, &data, &frozen, "4", &["--world", "1", "--set", "optimizer.params.lr=0"]);
    let bits = summary(&one)["params_blake3"].clone();
    assert_eq!(bits.as_str().map(str::len), Some(64), "{}", summary(&one));
    assert_ne!(summary(&frozen)["params_blake3"], bits, "training did not move the parameters");
    assert_eq!(summary(&two)["params_blake3"], bits, "two ranks under ZeRO-2 differ from one");
    assert_eq!(summary(&procs)["params_blake3"], bits, "two worker processes under ZeRO-3 differ from one rank");
    assert_eq!(summary(&split)["params_blake3"], bits, "2 steps on two ranks + a resume on one differ from 4 straight");

    // The export holds the trained parameters under transformers' names and config.
    let export = run("export");
    let c = one.join("checkpoints");
    let said = ok(&["export", "--checkpoint", c.to_str().unwrap(), "--out", export.to_str().unwrap()], tmp.path());
    assert!(said.contains("MixtralForCausalLM"), "{said}");
    let hf = tessera::hf::HfModel::open(&export).unwrap();
    let ck = tessera::checkpoint::resolve_resume(&c).unwrap().state;
    let (m, trained) = tessera::cli::model_from_checkpoint(&ck).unwrap();
    let exported = tessera::hf::read_params(hf.weights.as_ref().unwrap(), hf.config.family, &m).unwrap();
    assert!(exported == trained, "the export does not hold the trained parameters");
    assert_eq!(hf.config.model, m.cfg);
    check_export(&export);
}

/// scripts/check_export.py loads `export` with transformers and finds Tessera's loss.
fn check_export(export: &Path) {
    let found = Command::new("python3").args(["-c", "import torch, transformers"]).output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipping the transformers check of the export: python3 cannot import torch, transformers");
        return;
    }
    let script = repo().join("scripts/check_export.py");
    let out = Command::new("python3").arg(&script).arg(export).output().expect("running check_export.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("loaded MixtralForCausalLM"), "check_export.py {}:\n{text}", export.display());
}

#[test]
fn the_shipped_mixtral_tiny_config_trains_its_preset_to_the_same_bits_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/mixtral-tiny.json");
    let data = text(tmp.path());
    let train = |name: &str, world: &str| {
        let out = tmp.path().join(name);
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output", out.to_str().unwrap()];
        a.extend_from_slice(&["--steps", "3", "--world", world, "--no-progress", "--set", "scheduler.params.warmup_num_steps=1"]);
        a.extend_from_slice(FAST);
        ok(&a, tmp.path());
        out
    };
    // The config's ZeRO-2 on two ranks, and one rank.
    let (two, one) = (train("two", "2"), train("one", "1"));
    let s = summary(&two);
    assert_eq!(s["model"], "mixtral-tiny");
    assert_eq!(s["zero_stage"], 2);
    assert_eq!(s["moe"]["blocks"].as_array().map(Vec::len), Some(4), "every block of the preset is MoE: {s}");
    assert!(s["final_loss"].as_f64().is_some_and(f64::is_finite), "{s}");
    assert_eq!(summary(&one)["params_blake3"], s["params_blake3"], "one rank differs from two under ZeRO-2");
    let export = tmp.path().join("export");
    let c = one.join("checkpoints");
    let said = ok(&["export", "--checkpoint", c.to_str().unwrap(), "--out", export.to_str().unwrap()], tmp.path());
    assert!(said.contains("MixtralForCausalLM"), "{said}");
    check_export(&export);
}

/// A dense preset given experts by a `tessera.moe` section: its checkpoint records the section
/// (`extra.moe`), so `generate` rebuilds the experts (before, it rebuilt the dense preset and
/// found no tensor for its MLPs).
#[test]
fn a_dense_preset_trained_with_a_moe_section_generates_from_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = text(tmp.path());
    let out = tmp.path().join("run");
    train(Path::new("gpt-tiny"), &data, &out, "2", &["--set", r#"tessera.moe={"num_experts": 4, "k": 2, "drop_tokens": false}"#]);
    let ck = out.join("checkpoints");
    let said =
        ok(&["generate", "--checkpoint", ck.to_str().unwrap(), "--tokens", "4", "--temperature", "0", "--prompt", "It is"], tmp.path());
    assert!(said.starts_with("It is"), "{said}");
}
