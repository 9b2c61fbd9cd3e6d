//! Tests of checkpoint save/load: round trip, pruning, corruption, fallback, atomicity, errors.

use std::fs;
use std::path::Path;

use super::fsio::FAULT_HOOK;
use super::*;

fn tensor(name: &str, shape: &[usize], seed: u32) -> NamedTensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(97));
            f32::from_bits(0x3f00_0000 | (x >> 9)) - 0.75
        })
        .collect();
    NamedTensor { name: name.to_string(), shape: shape.to_vec(), data }
}

fn sample_state(step: u64) -> CheckpointState {
    let seed = step as u32;
    let mut odd = tensor("h.0.ln_1.bias", &[5], seed + 3);
    odd.data[0] = -0.0;
    odd.data[2] = f32::MIN_POSITIVE / 8.0; // subnormal
                                           // A NaN with payload must survive bit-exactly (in optimizer state: a parameter NaN is
                                           // refused).
    let mut odd_optim = tensor("exp_avg_sq/h.0.ln_1.bias", &[5], seed + 7);
    odd_optim.data[1] = f32::from_bits(0x7fc0_1234);
    CheckpointState {
        step,
        config_hash: "cfg-abc123".into(),
        model: "gpt2-tiny".into(),
        data_cursor: serde_json::json!({"epoch": 1, "offset": 4096 + step}),
        rng: serde_json::json!({"seed": 42, "counter": step * 7}),
        extra: serde_json::json!({"loss_scale": 65536.0, "lr_step": step}),
        params: vec![tensor("wte.weight", &[7, 4], seed), tensor("h.0.ln_1.weight", &[4], seed + 1), odd],
        optim: vec![tensor("exp_avg/wte.weight", &[7, 4], seed + 5), tensor("flat", &[13], seed + 6), odd_optim],
    }
}

fn bits(ts: &[NamedTensor]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    ts.iter().map(|t| (t.name.clone(), t.shape.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect()
}

fn assert_same_state(a: &CheckpointState, b: &CheckpointState) {
    assert_eq!(bits(&a.params), bits(&b.params));
    assert_eq!(bits(&a.optim), bits(&b.optim));
    assert_eq!((a.step, &a.config_hash, &a.model), (b.step, &b.config_hash, &b.model));
    assert_eq!((&a.data_cursor, &a.rng, &a.extra), (&b.data_cursor, &b.rng, &b.extra));
}

fn step_names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n != LATEST_FILE).collect();
    v.sort();
    v
}

#[test]
fn round_trip_is_bit_exact_and_manifest_matches_files() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    let state = sample_state(12);
    let dir = save(&root, &state, 0).unwrap();
    assert_eq!(dir, root.join("step_00000012"));
    assert_eq!(fs::read_to_string(root.join(LATEST_FILE)).unwrap().trim(), "step_00000012");
    let loaded = load(&dir).unwrap();
    assert_same_state(&state, &loaded);
    assert_eq!(named_params_blake3(&state.params), named_params_blake3(&loaded.params));

    let manifest: serde_json::Value = serde_json::from_slice(&fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
    assert_eq!(manifest["format_version"], FORMAT_VERSION);
    for file in [PARAMS_FILE, OPTIM_FILE] {
        let bytes = fs::read(dir.join(file)).unwrap();
        assert_eq!(manifest["files"][file]["bytes"], bytes.len() as u64);
        assert_eq!(manifest["files"][file]["blake3"], blake3::hash(&bytes).to_hex().as_str());
    }
    assert_eq!(manifest["params"][0]["name"], "wte.weight");
    assert_eq!(manifest["params"][0]["shape"], serde_json::json!([7, 4]));
}

#[test]
fn params_file_is_standard_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let state = sample_state(1);
    let dir = save(tmp.path(), &state, 0).unwrap();
    let bytes = fs::read(dir.join(PARAMS_FILE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor("wte.weight").unwrap();
    assert_eq!(view.shape(), &[7, 4]);
    assert_eq!(&view.data()[..4], &state.params[0].data[0].to_le_bytes());
}

#[test]
fn params_blake3_matches_definition_and_is_sensitive() {
    let a = [1.0f32, -2.5];
    let b = [0.25f32];
    let mut manual = Vec::new();
    manual.extend_from_slice(b"x");
    a.iter().for_each(|v| manual.extend_from_slice(&v.to_le_bytes()));
    manual.extend_from_slice(b"y");
    b.iter().for_each(|v| manual.extend_from_slice(&v.to_le_bytes()));
    let expect = blake3::hash(&manual).to_hex().to_string();
    assert_eq!(params_blake3(&[("x", &a), ("y", &b)]), expect);
    assert_ne!(params_blake3(&[("y", &b), ("x", &a)]), expect);
    let a2 = [f32::from_bits(1.0f32.to_bits() ^ 1), -2.5];
    assert_ne!(params_blake3(&[("x", &a2), ("y", &b)]), expect);
}

#[test]
fn keep_last_prunes_oldest_and_zero_keeps_all() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    for step in 1..=5 {
        save(&root, &sample_state(step), 2).unwrap();
    }
    assert_eq!(step_names(&root), vec!["step_00000004", "step_00000005"]);
    let all = tmp.path().join("all");
    for step in 1..=3 {
        save(&all, &sample_state(step), 0).unwrap();
    }
    assert_eq!(list_checkpoints(&all).unwrap().len(), 3);
    assert_eq!(list_checkpoints(&all).unwrap()[0].0, 3);
}

#[test]
fn truncated_params_errors_and_latest_valid_falls_back() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save(root, &sample_state(1), 0).unwrap();
    let newest = save(root, &sample_state(2), 0).unwrap();
    let params = newest.join(PARAMS_FILE);
    let len = fs::metadata(&params).unwrap().len();
    fs::OpenOptions::new().write(true).open(&params).unwrap().set_len(len - 10).unwrap();

    let err = load(&newest).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CheckpointError::SizeMismatch { found_bytes, .. } if found_bytes == len - 10));
    assert!(msg.contains("params.safetensors") && msg.contains(&len.to_string()), "{msg}");

    let latest = load_latest_valid(root).unwrap();
    let (dir, state) = latest.found.unwrap();
    assert_eq!((dir, state.step), (root.join("step_00000001"), 1));
    assert_eq!(latest.skipped.len(), 1);
    assert_eq!(latest.skipped[0].dir, newest);
    assert!(latest.skipped[0].error.to_string().contains("params.safetensors"));
}

#[test]
fn corrupted_byte_gives_hash_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save(tmp.path(), &sample_state(3), 0).unwrap();
    let optim = dir.join(OPTIM_FILE);
    let mut bytes = fs::read(&optim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    fs::write(&optim, &bytes).unwrap();
    let err = load(&dir).unwrap_err();
    let found_hash = blake3::hash(&bytes).to_hex().to_string();
    match &err {
        CheckpointError::HashMismatch { path, expected, found } => {
            assert_eq!(path, &optim);
            assert_eq!(found, &found_hash);
            assert_ne!(expected, found);
        }
        other => panic!("expected hash mismatch, got {other}"),
    }
    assert!(err.to_string().contains("optim.safetensors"));
}

#[test]
fn leftover_tmp_dir_is_ignored_then_cleaned() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save(root, &sample_state(1), 0).unwrap();
    let stale = root.join(".tmp-step_00000009-99999");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join(PARAMS_FILE), b"half written").unwrap();
    let stale_latest = root.join(".latest.tmp-99999");
    fs::write(&stale_latest, b"step_0000").unwrap();
    assert_eq!(list_checkpoints(root).unwrap().len(), 1);
    let latest = load_latest_valid(root).unwrap();
    assert_eq!(latest.found.unwrap().1.step, 1);
    assert!(latest.skipped.is_empty());
    save(root, &sample_state(2), 0).unwrap();
    assert!(!stale.exists() && !stale_latest.exists());
    assert_eq!(step_names(root), vec!["step_00000001", "step_00000002"]);
}

#[test]
fn injected_disk_full_cleans_temp_and_keeps_previous() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save(root, &sample_state(1), 0).unwrap();
    let full = |op: &str, name: &str| match (op, name) {
        ("write", OPTIM_FILE) => Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "injected: no space left on device")),
        _ => Ok(()),
    };
    let err = with_fault_hook(full, || save(root, &sample_state(2), 0)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(".tmp-step_00000002") && msg.contains(OPTIM_FILE), "{msg}");
    assert!(matches!(&err, CheckpointError::Io { err, .. } if err.kind() == std::io::ErrorKind::StorageFull));
    assert_eq!(step_names(root), vec!["step_00000001"]);
    assert_eq!(fs::read_to_string(root.join(LATEST_FILE)).unwrap().trim(), "step_00000001");
    assert_eq!(load_latest_valid(root).unwrap().found.unwrap().1.step, 1);
}

#[test]
fn missing_parent_and_file_root_give_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("no_such_parent").join("ckpt");
    let msg = save(&root, &sample_state(1), 0).unwrap_err().to_string();
    assert!(msg.contains("no_such_parent") && msg.contains("parent directory"), "{msg}");
    let file_root = tmp.path().join("a_file");
    fs::write(&file_root, b"x").unwrap();
    let msg = save(&file_root, &sample_state(1), 0).unwrap_err().to_string();
    assert!(msg.contains("a_file") && msg.contains("not a directory"), "{msg}");
}

#[test]
fn read_only_root_gives_error_naming_path() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ro");
    fs::create_dir(&root).unwrap();
    fs::set_permissions(&root, fs::Permissions::from_mode(0o555)).unwrap();
    if fs::write(root.join("probe"), b"x").is_ok() {
        eprintln!("SKIP read_only_root: running with privileges that ignore directory permissions");
        return;
    }
    let err = save(&root, &sample_state(1), 0).unwrap_err();
    fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
    assert!(err.to_string().contains(&root.display().to_string()), "{err}");
    assert!(step_names(&root).is_empty());
}

#[test]
fn same_step_twice_replaces_atomically() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save(root, &sample_state(3), 0).unwrap();
    let mut second = sample_state(3);
    second.params[0].data[0] = 123.0;
    let dir = save(root, &second, 0).unwrap();
    assert_same_state(&second, &load(&dir).unwrap());
    assert_eq!(step_names(root), vec!["step_00000003"]);
}

#[test]
fn crash_during_replace_is_recovered() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let dir = save(root, &sample_state(3), 0).unwrap();
    let aside = root.join(".old-step_00000003-4242");
    fs::rename(&dir, &aside).unwrap(); // as if we crashed between the two renames
    let latest = load_latest_valid(root).unwrap();
    assert_eq!(latest.found.unwrap().0, aside);
    save(root, &sample_state(4), 0).unwrap();
    assert_eq!(step_names(root), vec!["step_00000003", "step_00000004"]);
    assert_eq!(load(&root.join("step_00000003")).unwrap().step, 3);
}

#[test]
fn latest_pointer_is_preferred_over_higher_step() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save(root, &sample_state(5), 0).unwrap();
    save(root, &sample_state(3), 0).unwrap(); // resumed from an earlier point
    assert_eq!(load_latest_valid(root).unwrap().found.unwrap().1.step, 3);
    fs::remove_file(root.join(LATEST_FILE)).unwrap();
    assert_eq!(load_latest_valid(root).unwrap().found.unwrap().1.step, 5);
}

#[test]
fn resolve_resume_accepts_root_or_step_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    save(&root, &sample_state(1), 0).unwrap();
    let d2 = save(&root, &sample_state(2), 0).unwrap();
    assert_eq!(resolve_resume(&root).unwrap().state.step, 2);
    assert_eq!(resolve_resume(&root.join("step_00000001")).unwrap().state.step, 1);
    fs::write(d2.join(PARAMS_FILE), b"junk").unwrap();
    let r = resolve_resume(&root).unwrap();
    assert_eq!((r.state.step, r.skipped.len()), (1, 1));
    assert!(resolve_resume(&d2).is_err());
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let e = resolve_resume(&empty).unwrap_err();
    assert!(matches!(e, CheckpointError::NotFound { .. }), "{e}");
    // What was expected, not only that nothing was found.
    assert!(e.to_string().contains("no step_NNNNNNNN folder") && e.to_string().contains("expected a checkpoints root"), "{e}");
    let e = resolve_resume(&tmp.path().join("nope")).unwrap_err();
    assert!(matches!(e, CheckpointError::NotFound { .. }) && e.to_string().contains("no such file or directory"), "{e}");
}

/// A step folder without its manifest is a damaged step folder: the error names the manifest
/// (it was taken for a checkpoint root and reported as "no valid checkpoint found").
#[test]
fn a_step_folder_without_its_manifest_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save(tmp.path(), &sample_state(2), 0).unwrap();
    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    let msg = resolve_resume(&dir).unwrap_err().to_string();
    assert!(msg.contains(MANIFEST_FILE), "{msg}");
    assert!(resolve_resume(tmp.path()).is_err());
}

#[test]
fn manifest_version_and_step_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save(tmp.path(), &sample_state(7), 0).unwrap();
    let mpath = dir.join(MANIFEST_FILE);
    let original = fs::read_to_string(&mpath).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&original).unwrap();
    m["format_version"] = serde_json::json!(99);
    fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let err = load(&dir).unwrap_err();
    assert!(matches!(err, CheckpointError::FormatVersion { found: 99, .. }), "{err}");
    let mut m: serde_json::Value = serde_json::from_str(&original).unwrap();
    m["step"] = serde_json::json!(8);
    fs::write(&mpath, resign(m)).unwrap();
    let msg = load(&dir).unwrap_err().to_string();
    assert!(msg.contains("manifest.json") && msg.contains("key `step`: 8 but directory is for step 7"), "{msg}");
    fs::write(&mpath, b"{not json").unwrap();
    assert!(matches!(load(&dir), Err(CheckpointError::Manifest { .. })));
}

/// `manifest` (JSON) encoded as `save` writes it, with a digest of its own that matches.
fn resign(mut manifest: serde_json::Value) -> Vec<u8> {
    manifest.as_object_mut().unwrap().remove("manifest_blake3");
    super::manifest::encode(&manifest).unwrap()
}

/// Every field of the manifest is guarded: a digit changed in the data cursor, the counters or
/// the loss scaler (which no file digest covers) is a corrupted manifest, not another state.
/// (Before the manifest had its own digest, such a checkpoint loaded with the changed value;
/// `engine::restore_sim` found it.)
#[test]
fn a_changed_byte_anywhere_in_the_manifest_is_caught() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save(tmp.path(), &sample_state(7), 0).unwrap();
    let mpath = dir.join(MANIFEST_FILE);
    let original = fs::read(&mpath).unwrap();
    assert_eq!(resign(serde_json::from_slice(&original).unwrap()), original, "the test's encoding is save's");
    let at = original.windows(6).position(|w| w == b"\"lr_st").unwrap();
    let digit = at + original[at..].iter().position(u8::is_ascii_digit).unwrap();
    for pos in [digit, 0, original.len() / 2, original.len() - 5, original.len() - 1] {
        let mut bytes = original.clone();
        bytes[pos] = if pos == digit { bytes[pos] ^ 0x01 } else { bytes[pos] ^ 0x21 };
        fs::write(&mpath, &bytes).unwrap();
        let msg = load(&dir).unwrap_err().to_string();
        assert!(msg.contains("manifest.json"), "byte {pos}: {msg}");
    }
    fs::write(&mpath, &original).unwrap();
    assert_same_state(&sample_state(7), &load(&dir).unwrap());
}

/// Version 1 manifests (no digest of their own) still load; a version 2 one that claims to be
/// version 1 does not.
#[test]
fn version_1_manifests_load_without_their_own_digest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save(tmp.path(), &sample_state(4), 0).unwrap();
    let mpath = dir.join(MANIFEST_FILE);
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&mpath).unwrap()).unwrap();
    m["format_version"] = serde_json::json!(1);
    fs::write(&mpath, resign(m.clone())).unwrap();
    let msg = load(&dir).unwrap_err().to_string();
    assert!(msg.contains("manifest.json") && msg.contains("version 2"), "{msg}");
    m.as_object_mut().unwrap().remove("manifest_blake3");
    fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    assert_same_state(&sample_state(4), &load(&dir).unwrap());
}

#[test]
fn invalid_state_is_rejected_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut bad = sample_state(1);
    bad.params[0].shape = vec![3, 3];
    let msg = save(tmp.path(), &bad, 0).unwrap_err().to_string();
    assert!(msg.contains("wte.weight") && msg.contains("[3, 3]"), "{msg}");
    let mut dup = sample_state(1);
    dup.optim[1].name = dup.optim[0].name.clone();
    assert!(matches!(save(tmp.path(), &dup, 0), Err(CheckpointError::InvalidState(_))));
    assert!(list_checkpoints(tmp.path()).unwrap().is_empty());
}

#[test]
fn empty_optimizer_state_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let mut state = sample_state(1);
    state.optim.clear();
    let dir = save(tmp.path(), &state, 0).unwrap();
    assert_same_state(&state, &load(&dir).unwrap());
}

/// Runs `f` with `hook` as this thread's save fault hook (`fsio::FAULT_HOOK`).
fn with_fault_hook<T>(hook: impl FnMut(&str, &str) -> std::io::Result<()> + 'static, f: impl FnOnce() -> T) -> T {
    FAULT_HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    let out = f();
    FAULT_HOOK.with(|h| *h.borrow_mut() = None);
    out
}

/// The chaos harness's `fail_writes`: the folder moves away and a file takes its path, so
/// anything that names the folder by path fails; [`put_back`] undoes it.
fn move_away(root: &Path) {
    fs::rename(root, root.with_extension("held")).unwrap();
    fs::write(root, b"chaos: writes fail here\n").unwrap();
}

fn put_back(root: &Path) {
    fs::remove_file(root).unwrap();
    fs::rename(root.with_extension("held"), root).unwrap();
}

/// What a fault does at the stage it is aimed at.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// The operation fails.
    Fail,
    /// The folder moves away (as `fail_writes` moves it), then the operation fails.
    MoveAndFail,
    /// The folder moves away and the save goes on.
    Move,
}

/// Two saves, each run to completion first to list the operations it makes, then once per
/// operation and fault with that fault injected right before the operation: a new step that
/// prunes the previous one, and a same step saved again. Whatever the stage and whether the
/// checkpoint folder moved away meanwhile (the race of the chaos fault `fail_writes`, where a
/// path-based clean-up missed the moved folder and its `.tmp-…` came back with it), afterwards
/// the folder holds nothing half-written (the harness's own check), every step dir loads,
/// `latest` leads to a valid checkpoint, and a save that kept its folder handle succeeds even
/// though the folder moved. Only a failed removal (of a pruned or replaced step dir) leaves a
/// temporary name, never a partial `step_*`, and the next save removes it.
#[test]
fn a_save_leaves_nothing_half_written_whatever_fails_and_wherever_its_folder_moved() {
    use std::cell::RefCell;
    use std::rc::Rc;
    type Setup = fn(&Path);
    let new_step: (Setup, CheckpointState, usize) = (|r| drop(save(r, &sample_state(1), 0).unwrap()), sample_state(2), 1);
    let mut again = sample_state(2);
    again.params[0].data[0] = 42.0;
    let same_step: (Setup, CheckpointState, usize) = (
        |r| {
            save(r, &sample_state(1), 0).unwrap();
            save(r, &sample_state(2), 0).unwrap();
        },
        again,
        0,
    );
    for (scenario, (setup, state, keep_last)) in [("new step, pruning", new_step), ("same step again", same_step)] {
        let ops = Rc::new(RefCell::new(Vec::new()));
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ckpt");
        setup(&root);
        let seen = Rc::clone(&ops);
        let record = move |op: &str, name: &str| {
            seen.borrow_mut().push((op.to_string(), name.to_string()));
            Ok(())
        };
        with_fault_hook(record, || save(&root, &state, keep_last)).unwrap();
        let ops = ops.borrow().clone();
        let has = |op: &str, name: &str| ops.iter().any(|(o, n)| o == op && n == name);
        assert!(
            has("write", PARAMS_FILE) && has("fsync", OPTIM_FILE) && has("rename", "step_00000002") && has("rename", LATEST_FILE),
            "{ops:?}"
        );
        match keep_last {
            1 => assert!(has("prune", "step_00000001"), "{ops:?}"),
            _ => assert!(has("move aside", "step_00000002"), "{ops:?}"),
        }
        for (k, (op, name)) in ops.iter().enumerate() {
            for fault in [Fault::Fail, Fault::MoveAndFail, Fault::Move] {
                let what = format!("{scenario}: {fault:?} at {op} {name}");
                let tmp = tempfile::tempdir().unwrap();
                let root = tmp.path().join("ckpt");
                setup(&root);
                let (target, calls) = (root.clone(), Rc::new(RefCell::new(0)));
                let count = Rc::clone(&calls);
                let hook = move |_: &str, _: &str| {
                    let mut n = count.borrow_mut();
                    *n += 1;
                    if *n - 1 != k {
                        return Ok(());
                    }
                    if fault != Fault::Fail {
                        move_away(&target);
                    }
                    match fault {
                        Fault::Move => Ok(()),
                        _ => Err(std::io::Error::other("injected")),
                    }
                };
                let res = with_fault_hook(hook, || save(&root, &state, keep_last));
                assert!(*calls.borrow() > k, "{what}: the save stopped before the stage");
                if fault != Fault::Fail {
                    put_back(&root);
                }
                match fault {
                    Fault::Move => {
                        let dir = res.unwrap_or_else(|e| panic!("{what}: the save lost its folder: {e}"));
                        assert_same_state(&state, &load(&dir).unwrap());
                        assert_eq!(fs::read_to_string(root.join(LATEST_FILE)).unwrap(), "step_00000002\n", "{what}");
                    }
                    _ => assert!(res.is_err(), "{what}: the injected failure was not reported"),
                }
                let left = tessera_chaos::disk::checkpoint_leftovers(&root);
                if op == "remove" && fault != Fault::Move {
                    assert!(
                        left.iter().all(|n| n.starts_with(".tmp-step_") || n.starts_with(".old-step_")) && left.len() == 1,
                        "{what}: {left:?}"
                    );
                } else {
                    assert!(left.is_empty(), "{what}: left {left:?}");
                }
                for (step, dir) in list_checkpoints(&root).unwrap() {
                    load(&dir).unwrap_or_else(|e| panic!("{what}: step {step} does not load: {e}"));
                }
                let latest = load_latest_valid(&root).unwrap();
                assert!(latest.skipped.is_empty(), "{what}: {:?}", latest.skipped);
                assert!(matches!(latest.found, Some((_, ref s)) if s.step == 1 || s.step == 2), "{what}");
                save(&root, &sample_state(3), keep_last).unwrap();
                assert_eq!(tessera_chaos::disk::checkpoint_leftovers(&root), Vec::<String>::new(), "{what}: after the next save");
            }
        }
    }
}

#[test]
fn a_nonfinite_parameter_is_refused_and_latest_keeps_the_previous_step() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    save(&root, &sample_state(1), 0).unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut state = sample_state(2);
        state.params[1].data[3] = bad;
        let msg = save(&root, &state, 0).unwrap_err().to_string();
        assert!(msg.contains("`h.0.ln_1.weight`") && msg.contains("index 3") && msg.contains("diverged"), "{msg}");
    }
    assert_eq!(step_names(&root), vec!["step_00000001"], "a refused save leaves nothing behind");
    assert_eq!(fs::read_to_string(root.join(LATEST_FILE)).unwrap().trim(), "step_00000001");
}

#[test]
fn a_second_lock_on_an_output_folder_is_refused_naming_the_holder_and_freed_on_drop() {
    let tmp = tempfile::tempdir().unwrap();
    // A lock file left by a run that died holds no lock: it is taken over.
    fs::write(tmp.path().join(LOCK_FILE), "999999999\n").unwrap();
    let held = OutputLock::acquire(tmp.path()).unwrap();
    assert_eq!(fs::read_to_string(held.path()).unwrap().trim(), std::process::id().to_string());
    // flock locks belong to open files: a second open in this process conflicts like another
    // process would.
    let msg = OutputLock::acquire(tmp.path()).unwrap_err().to_string();
    assert!(msg.contains(&format!("pid {}", std::process::id())) && msg.contains("in use by another run"), "{msg}");
    drop(held);
    OutputLock::acquire(tmp.path()).expect("the lock is free once its holder is gone");
}

#[test]
fn resume_from_a_root_says_when_latest_names_an_older_step() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    save(&root, &sample_state(3), 0).unwrap();
    save(&root, &sample_state(5), 0).unwrap();
    assert_eq!(resolve_resume(&root).unwrap().newer, None, "latest names the newest step");
    fs::write(root.join(LATEST_FILE), "step_00000003\n").unwrap();
    let r = resolve_resume(&root).unwrap();
    assert_eq!(r.state.step, 3, "latest is followed");
    assert_eq!(r.newer, Some((5, root.join("step_00000005"))));
    // A step folder given directly is what the user asked for: nothing to say.
    assert_eq!(resolve_resume(&root.join("step_00000003")).unwrap().newer, None);
}
