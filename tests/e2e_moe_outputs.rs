//! The MoE statistics a run writes (a Mixtral folder): each step's load-balancing loss,
//! z-loss, dropped share and expert loads in the monitors (metrics.jsonl, TensorBoard, CSV),
//! the run's per-block expert shares in `summary.json`'s `moe` object and the console's `moe`
//! line; the token counts are exact, so one rank and two worker processes report the same
//! shares.

use std::path::{Path, PathBuf};

use crate::common::*;

fn mixtral_run(tmp: &Path, name: &str, more: &[&str]) -> (PathBuf, String) {
    let cfg = repo().join("configs/gpt-tiny.json");
    let model = repo().join("tests/fixtures/hf/mixtral");
    let line = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n";
    let data = write(tmp, "austen.txt", &line.repeat(60));
    let out = tmp.join(name);
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
    a.extend_from_slice(&["--output", out.to_str().unwrap(), "--steps", "2", "--no-progress"]);
    a.extend_from_slice(FAST);
    a.extend_from_slice(more);
    let said = ok(&a, tmp);
    (out, said)
}

#[test]
fn an_moe_run_reports_its_routing_in_the_monitors_the_summary_and_the_console() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, said) = mixtral_run(tmp.path(), "one", &["--world", "1"]);
    // Two worker processes: the ranks' tallies cross the fleet's wire.
    let (two, _) = mixtral_run(tmp.path(), "two", &["--nprocs", "2", "--set", "zero_optimization.stage=2"]);

    // Each step: the fixture's 2 MoE blocks of 4 experts, top 2, dropless.
    let aux = metric(&one, "load_balancing_loss");
    assert!(aux.len() == 2 && aux.iter().all(|a| a.is_finite() && *a > 0.0), "{aux:?}");
    assert!(metric(&one, "z_loss").iter().all(|z| z.is_finite() && *z > 0.0));
    assert_eq!(metric(&one, "moe/dropped_fraction"), vec![0.0, 0.0], "dropless routing drops nothing");
    let (hi, lo) = (metric(&one, "moe/expert_load_max"), metric(&one, "moe/expert_load_min"));
    assert!(hi.len() == 2 && (0..2).all(|i| hi[i] >= 1.0 && lo[i] <= 1.0 && lo[i] >= 0.0), "{hi:?} {lo:?}");
    assert!(one.join("csv").join("moe_dropped_fraction.csv").exists(), "the csv monitor lacks the MoE tags");
    let tb = std::fs::read_dir(one.join("tensorboard")).unwrap().next().unwrap().unwrap().path();
    let events = std::fs::read(tb).unwrap();
    assert!(events.windows(19).any(|w| w == b"load_balancing_loss"), "tensorboard lacks the load-balancing loss");

    let m = &summary(&one)["moe"];
    let blocks = m["blocks"].as_array().expect("summary.json has an moe object");
    assert_eq!(blocks.iter().map(|b| b["block"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1]);
    for b in blocks {
        let share: Vec<f64> = b["token_share"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).collect();
        assert!(share.len() == 4 && (share.iter().sum::<f64>() - 1.0).abs() < 1e-12, "{share:?}");
        assert_eq!(b["dropped_fraction"].as_f64(), Some(0.0));
    }
    assert_eq!(m["final_aux_loss"].as_f64(), aux.last().copied(), "the summary's final aux loss is the last step's");
    assert!(said.contains("moe            2 blocks | aux "), "{said}");
    // The shares come from exact counts: two processes route the same tokens the same way.
    assert_eq!(summary(&two)["moe"]["blocks"], m["blocks"]);
    assert_eq!(metric(&two, "moe/expert_load_max"), hi);
}
