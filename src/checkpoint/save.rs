//! Atomic checkpoint save: temp dir + fsync + rename, `latest` pointer, pruning, stale-temp cleanup.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::fsio::{fsync_dir, validate_tensors, write_bytes_synced, write_file_atomic, write_safetensors};
use super::load::list_checkpoints;
use super::manifest::{FileEntry, Manifest, TensorEntry};
use super::{
    named_params_blake3, step_dir_name, CheckpointError, CheckpointState, NamedTensor, FORMAT_NAME, FORMAT_VERSION, LATEST_FILE,
    MANIFEST_FILE, OPTIM_FILE, PARAMS_FILE,
};

/// Prefix of in-progress save directories (`.tmp-step_XXXXXXXX-<pid>`).
pub(crate) const TMP_PREFIX: &str = ".tmp-step_";
/// Prefix of a step directory being replaced by a re-save of the same step.
pub(crate) const OLD_PREFIX: &str = ".old-step_";

/// Save `state` as `root/step_{step:08}/`, atomically; update `root/latest`; then keep only the
/// newest `keep_last` step dirs (0 = keep all). Returns the final step directory.
///
/// A crash at any point leaves the previous complete checkpoints and possibly the new complete
/// one, never a partial directory under a `step_*` name. On error the temp dir is removed.
/// `root` is created if missing, but its parent must exist (guards against path typos).
pub fn save(root: &Path, state: &CheckpointState, keep_last: usize) -> Result<PathBuf, CheckpointError> {
    validate_tensors("param", &state.params)?;
    validate_tensors("optim", &state.optim)?;
    ensure_root(root)?;
    clean_stale_temps(root)?;
    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| CheckpointError::io("remove stale temp dir", &tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| CheckpointError::io("create temp dir", &tmp, e))?;
    let final_dir = root.join(&name);
    let installed = write_step_files(&tmp, state).and_then(|()| fsync_dir(&tmp)).and_then(|()| install(root, &tmp, &final_dir, &name));
    if let Err(e) = installed {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    write_file_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    prune(root, keep_last, state.step)?;
    Ok(final_dir)
}

fn ensure_root(root: &Path) -> Result<(), CheckpointError> {
    match fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(CheckpointError::io("use as checkpoint root", root, std::io::Error::other("exists but is not a directory"))),
        Err(_) => {
            fs::create_dir(root).map_err(|e| CheckpointError::io("create checkpoint root (its parent directory must exist)", root, e))
        }
    }
}

/// Write params, optim and manifest into `dir` (each fsynced).
fn write_step_files(dir: &Path, state: &CheckpointState) -> Result<(), CheckpointError> {
    let mut files = BTreeMap::new();
    for (file, tensors) in [(PARAMS_FILE, &state.params), (OPTIM_FILE, &state.optim)] {
        let refs: Vec<&NamedTensor> = tensors.iter().collect();
        let digest = write_safetensors(&dir.join(file), &refs, &[("format", "pt")])?;
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
    let path = dir.join(MANIFEST_FILE);
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| CheckpointError::Manifest { path: path.clone(), reason: format!("cannot encode: {e}") })?;
    write_bytes_synced(&path, &json).map(|_| ())
}

/// Move the finished temp dir to `final_dir`. If `final_dir` exists (same step saved again) it
/// is first moved aside to `.old-step_*` and deleted after the new one is in place.
fn install(root: &Path, tmp: &Path, final_dir: &Path, name: &str) -> Result<(), CheckpointError> {
    let old = root.join(format!(".old-{name}-{}", std::process::id()));
    let replacing = final_dir.exists();
    if replacing {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| CheckpointError::io("remove", &old, e))?;
        }
        fs::rename(final_dir, &old).map_err(|e| CheckpointError::io("move aside", final_dir, e))?;
    }
    if let Err(e) = fs::rename(tmp, final_dir) {
        if replacing {
            let _ = fs::rename(&old, final_dir);
        }
        return Err(CheckpointError::io("rename temp dir into place", final_dir, e));
    }
    fsync_dir(root)?;
    if replacing {
        fs::remove_dir_all(&old).map_err(|e| CheckpointError::io("remove replaced", &old, e))?;
    }
    Ok(())
}

/// Remove leftover `.tmp-step_*` dirs (interrupted saves). A `.old-step_N-*` dir whose `step_N`
/// is missing (crash during a same-step replace) is renamed back; otherwise it is removed.
fn clean_stale_temps(root: &Path) -> Result<(), CheckpointError> {
    let rd = fs::read_dir(root).map_err(|e| CheckpointError::io("list", root, e))?;
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(TMP_PREFIX) {
            fs::remove_dir_all(&path).map_err(|e| CheckpointError::io("remove stale temp dir", &path, e))?;
        } else if let Some(step_name) = old_dir_step_name(&name) {
            let target = root.join(&step_name);
            if target.exists() {
                fs::remove_dir_all(&path).map_err(|e| CheckpointError::io("remove", &path, e))?;
            } else {
                fs::rename(&path, &target).map_err(|e| CheckpointError::io("restore", &path, e))?;
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
fn prune(root: &Path, keep_last: usize, just_saved: u64) -> Result<(), CheckpointError> {
    if keep_last == 0 {
        return Ok(());
    }
    let all = list_checkpoints(root)?;
    for (step, dir) in all.into_iter().skip(keep_last) {
        if step != just_saved {
            fs::remove_dir_all(&dir).map_err(|e| CheckpointError::io("prune", &dir, e))?;
        }
    }
    Ok(())
}
