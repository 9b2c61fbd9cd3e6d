//! Absurd values of the config keys that size memory (a typo's 1e7, 1e14, u64::MAX) are refused
//! by both `config check` and `train` with an error naming the key, the value and the limit —
//! never a capacity-overflow panic or an allocation abort — and `config check` says `plan: OK`
//! only where `train` starts.

use crate::common::*;

/// The batch keys, set consistently so that only the size is wrong: (what, `--set`s for `V`,
/// the limit the error must name).
const BATCH_KEYS: &[(&str, &[&str], &str)] = &[
    (
        "train_micro_batch_size_per_gpu",
        &["train_batch_size=V", "train_micro_batch_size_per_gpu=V", "gradient_accumulation_steps=1"],
        "MICRO_BATCH_TOKENS_MAX",
    ),
    (
        "gradient_accumulation_steps",
        &["train_batch_size=V", "train_micro_batch_size_per_gpu=1", "gradient_accumulation_steps=V"],
        "MICRO_BATCHES_PER_STEP_MAX",
    ),
];

#[test]
fn memory_sizing_keys_with_absurd_values_are_refused_by_config_check_and_train() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("out");
    for (key, sets, limit) in BATCH_KEYS {
        for v in ["10000000", "1e14", "18446744073709551615"] {
            let mut common: Vec<String> =
                ["--output", out.to_str().unwrap(), "--world", "1", "--set", "tessera.seq_len=32"].iter().map(|s| s.to_string()).collect();
            for s in *sets {
                common.extend(["--set".to_string(), s.replace('V', v)]);
            }
            let mut check: Vec<String> = vec!["config".into(), "check".into(), cfg.display().to_string()];
            check.extend(common.iter().cloned());
            let mut train: Vec<String> = vec!["train".into(), "--config".into(), cfg.display().to_string(), "--steps".into(), "1".into()];
            train.extend(common.iter().cloned());
            for args in [&check, &train] {
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let o = run(&refs, tmp.path());
                let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
                assert_eq!(o.status.code(), Some(1), "{key}={v}: `tessera {}` must fail cleanly:\n{text}", args[0]);
                assert!(text.contains("error: ") && text.contains(key) && text.contains(limit), "{key}={v}:\n{text}");
                assert!(!text.contains("plan: OK") && !text.contains("panicked"), "{key}={v}:\n{text}");
            }
            assert!(!out.exists(), "{key}={v}: a refused run made its output directory");
        }
    }
    // DeepSpeed's `reduce_bucket_size: 0` (one bucket per parameter) is accepted by both.
    let a = ["config", "check", cfg.to_str().unwrap(), "--set", "zero_optimization.reduce_bucket_size=0"];
    assert!(ok(&a, tmp.path()).contains("plan: OK"));
}
