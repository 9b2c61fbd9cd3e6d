//! Atomic checkpoint save: temp dir + fsync + rename, `latest` pointer, pruning, stale-temp cleanup.
//!
//! A save opens the checkpoint folder once ([`Dir`]) and does everything else relative to that
//! handle: the temporary step folder and its files, the renames into place, `latest`, pruning,
//! and the removal of its temporary names when a step fails. Naming them by path broke when
//! the folder's path stopped leading to it while a save ran (the chaos fault `fail_writes`
//! moves the folder away, puts a file in its place and later moves it back): the save's writes
//! failed, its clean-up by path missed the moved folder, and the temporary folder came back
//! with it. Through the handle a save that began keeps writing into the folder wherever it is,
//! and one that fails removes what it made there; a save that begins while the path leads to
//! something else than a folder fails before it writes anything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::dir::{Dir, Kind};
use super::fsio::{bytes_fill, fault_point, validate_tensors, write_file_atomic_in, write_new_file_in, write_safetensors_in, TEMP_INFIX};
use super::manifest::{FileEntry, Manifest, TensorEntry};
use super::{
    named_params_blake3, parse_step_dir_name, step_dir_name, CheckpointError, CheckpointState, NamedTensor, FORMAT_NAME, FORMAT_VERSION,
    LATEST_FILE, MANIFEST_FILE, OPTIM_FILE, PARAMS_FILE,
};

/// Prefix of in-progress save directories (`.tmp-step_XXXXXXXX-<pid>`) and of step directories
/// being pruned (`.tmp-step_XXXXXXXX-<pid>-pruned`).
pub(crate) const TMP_PREFIX: &str = ".tmp-step_";
/// Prefix of a step directory being replaced by a re-save of the same step.
pub(crate) const OLD_PREFIX: &str = ".old-step_";

/// Save `state` as `root/step_{step:08}/`, atomically (refused when a parameter is not
/// finite); update `root/latest`; then keep only the
/// newest `keep_last` step dirs (0 = keep all). Returns the final step directory.
///
/// A crash at any point leaves the previous complete checkpoints and possibly the new complete
/// one, never a partial directory under a `step_*` name (what a crash leaves under a temporary
/// name, the next save removes). An error leaves no temporary name behind either: the
/// temporary step dir or `latest` file is removed and a step dir moved aside is moved back,
/// in the folder the save opened, wherever it is by then. Only a removal that itself fails
/// (of a pruned or replaced step dir, or of the temporary dir after an error) leaves a
/// temporary name, which the next save removes.
/// `root` is created if missing, but its parent must exist (guards against path typos).
pub fn save(root: &Path, state: &CheckpointState, keep_last: usize) -> Result<PathBuf, CheckpointError> {
    validate_tensors("param", &state.params)?;
    validate_tensors("optim", &state.optim)?;
    refuse_nonfinite(&state.params)?;
    ensure_root(root)?;
    let dir = Dir::open(root).map_err(|e| CheckpointError::io("open checkpoint root", root, e))?;
    clean_stale_temps(&dir)?;
    let name = step_dir_name(state.step);
    let tmp = format!(".tmp-{name}-{}", std::process::id());
    fault_point("mkdir", &tmp)
        .and_then(|()| dir.create_dir(&tmp))
        .map_err(|e| CheckpointError::io("create temp dir", dir.join(&tmp), e))?;
    if let Err(e) = write_step_files(&dir, &tmp, state).and_then(|()| install(&dir, &tmp, &name)) {
        let _ = dir.remove_tree(&tmp);
        return Err(e);
    }
    write_file_atomic_in(&dir, LATEST_FILE, format!("{name}\n").as_bytes())?;
    prune(&dir, keep_last, state.step)?;
    Ok(root.join(&name))
}

/// A diverged state (a parameter NaN or infinite) is never checkpointed: `latest` would lead a
/// resume, `generate` and `export` to it.
fn refuse_nonfinite(params: &[NamedTensor]) -> Result<(), CheckpointError> {
    for t in params {
        if let Some(i) = t.data.iter().position(|x| !x.is_finite()) {
            return Err(CheckpointError::InvalidState(format!(
                "parameter `{}` holds {} at index {i}: a diverged state is not checkpointed",
                t.name, t.data[i]
            )));
        }
    }
    Ok(())
}

fn ensure_root(root: &Path) -> Result<(), CheckpointError> {
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(CheckpointError::io("use as checkpoint root", root, std::io::Error::other("exists but is not a directory"))),
        Err(_) => {
            std::fs::create_dir(root).map_err(|e| CheckpointError::io("create checkpoint root (its parent directory must exist)", root, e))
        }
    }
}

/// Write params, optim and manifest into the folder `tmp` of `root` (each fsynced, then the
/// folder).
fn write_step_files(root: &Dir, tmp: &str, state: &CheckpointState) -> Result<(), CheckpointError> {
    let dir = root.open_dir(tmp).map_err(|e| CheckpointError::io("open temp dir", root.join(tmp), e))?;
    let mut files = BTreeMap::new();
    for (file, tensors) in [(PARAMS_FILE, &state.params), (OPTIM_FILE, &state.optim)] {
        let refs: Vec<&NamedTensor> = tensors.iter().collect();
        let digest = write_safetensors_in(&dir, file, &refs, &[("format", "pt")])?;
        files.insert(file.to_string(), FileEntry { bytes: digest.bytes, blake3: digest.blake3 });
    }
    let entries = |ts: &[NamedTensor]| -> Vec<TensorEntry> {
        ts.iter().map(|t| TensorEntry { name: t.name.clone(), shape: t.shape.clone() }).collect()
    };
    let manifest = Manifest {
        format: FORMAT_NAME.to_string(),
        format_version: FORMAT_VERSION,
        step: state.step,
        config_hash: state.config_hash.clone(),
        model: state.model.clone(),
        data_cursor: state.data_cursor.clone(),
        rng: state.rng.clone(),
        extra: state.extra.clone(),
        params_blake3: named_params_blake3(&state.params),
        files,
        params: entries(&state.params),
        optim: entries(&state.optim),
    };
    let json = super::manifest::encode(&manifest)
        .map_err(|e| CheckpointError::Manifest { path: dir.join(MANIFEST_FILE), reason: format!("cannot encode: {e}") })?;
    write_new_file_in(&dir, MANIFEST_FILE, bytes_fill(&json))?;
    fault_point("fsync", tmp).and_then(|()| dir.sync()).map_err(|e| CheckpointError::io("fsync directory", dir.path(), e))
}

/// Move the finished temp dir `tmp` to `name`. If `name` exists (same step saved again) it is
/// first moved aside to `.old-step_*` and deleted after the new one is in place; when the new
/// one cannot be put in place the old one is moved back.
fn install(dir: &Dir, tmp: &str, name: &str) -> Result<(), CheckpointError> {
    let io = |op: &'static str, n: &str| {
        let path = dir.join(n);
        move |e| CheckpointError::io(op, path, e)
    };
    let old = format!(".old-{name}-{}", std::process::id());
    let replacing = dir.kind(name).map_err(io("look up", name))?.is_some();
    if replacing {
        if dir.kind(&old).map_err(io("look up", &old))?.is_some() {
            dir.remove_tree(&old).map_err(io("remove", &old))?;
        }
        fault_point("move aside", name).and_then(|()| dir.rename(name, &old)).map_err(io("move aside", name))?;
    }
    if let Err(e) = fault_point("rename", name).and_then(|()| dir.rename(tmp, name)) {
        if replacing {
            let _ = dir.rename(&old, name);
        }
        return Err(io("rename temp dir into place", name)(e));
    }
    dir.sync().map_err(|e| CheckpointError::io("fsync directory", dir.path(), e))?;
    if replacing {
        fault_point("remove", &old).and_then(|()| dir.remove_tree(&old)).map_err(io("remove replaced", &old))?;
    }
    Ok(())
}

/// Remove what interrupted saves left: `.tmp-step_*` dirs (a save's temporary dir, or a step
/// dir being pruned) and the temporary files of `latest`. A `.old-step_N-*` dir whose `step_N`
/// is missing (crash during a same-step replace) is renamed back; otherwise it is removed.
fn clean_stale_temps(dir: &Dir) -> Result<(), CheckpointError> {
    let latest_temp = format!(".{LATEST_FILE}{TEMP_INFIX}");
    for (entry, _) in dir.entries().map_err(|e| CheckpointError::io("list", dir.path(), e))? {
        let name = entry.to_string_lossy().into_owned();
        let path = dir.join(&entry);
        let io = |op: &'static str| {
            let path = path.clone();
            move |e| CheckpointError::io(op, path, e)
        };
        if name.starts_with(TMP_PREFIX) || name.starts_with(&latest_temp) {
            dir.remove_tree(&entry).map_err(io("remove stale temp"))?;
        } else if let Some(step_name) = old_dir_step_name(&name) {
            match dir.kind(&step_name).map_err(io("look up"))? {
                Some(_) => dir.remove_tree(&entry).map_err(io("remove"))?,
                None => dir.rename(&entry, &step_name).map_err(io("restore"))?,
            }
        }
    }
    Ok(())
}

/// `.old-step_00000005-1234` -> `step_00000005`.
pub(crate) fn old_dir_step_name(name: &str) -> Option<String> {
    let rest = name.strip_prefix(OLD_PREFIX)?;
    let (digits, _pid) = rest.split_once('-')?;
    let step_name = format!("step_{digits}");
    super::parse_step_dir_name(&step_name).map(|_| step_name)
}

/// Delete all but the newest `keep_last` step dirs (by step number); never deletes `just_saved`.
/// Each goes to a temporary name first, so a deletion that fails half-way never leaves a
/// partial step dir under its `step_*` name (the next save removes the rest).
fn prune(dir: &Dir, keep_last: usize, just_saved: u64) -> Result<(), CheckpointError> {
    if keep_last == 0 {
        return Ok(());
    }
    let entries = dir.entries().map_err(|e| CheckpointError::io("list", dir.path(), e))?;
    let mut steps: Vec<(u64, String)> = entries
        .into_iter()
        .filter(|(_, kind)| *kind == Kind::Folder)
        .filter_map(|(n, _)| n.to_str().and_then(|n| parse_step_dir_name(n).map(|s| (s, n.to_string()))))
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (step, name) in steps.into_iter().skip(keep_last) {
        if step == just_saved {
            continue;
        }
        let doomed = format!(".tmp-{name}-{}-pruned", std::process::id());
        fault_point("prune", &name)
            .and_then(|()| dir.rename(&name, &doomed))
            .map_err(|e| CheckpointError::io("prune", dir.join(&name), e))?;
        fault_point("remove", &doomed)
            .and_then(|()| dir.remove_tree(&doomed))
            .map_err(|e| CheckpointError::io("prune", dir.join(&name), e))?;
    }
    Ok(())
}
