//! Verified checkpoint load: manifest checks, per-file size + blake3 verification before parsing,
//! newest-valid fallback over a checkpoint root, and `--resume DIR` resolution.

use std::fs;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::manifest::{check_digest, FileEntry, Manifest, TensorEntry};
use super::save::old_dir_step_name;
use super::{
    named_params_blake3, parse_step_dir_name, CheckpointError, CheckpointState, NamedTensor, FORMAT_NAME, FORMAT_VERSION, LATEST_FILE,
    MANIFEST_FILE, OPTIM_FILE, PARAMS_FILE,
};

/// A checkpoint directory that [`load_latest_valid`] passed over, and why.
#[derive(Debug)]
pub struct SkippedCheckpoint {
    pub dir: PathBuf,
    pub error: CheckpointError,
}

/// Result of scanning a checkpoint root: the newest valid checkpoint (if any) and every newer
/// candidate that was skipped, newest first.
#[derive(Debug)]
pub struct LatestValid {
    pub found: Option<(PathBuf, CheckpointState)>,
    pub skipped: Vec<SkippedCheckpoint>,
}

/// Outcome of resolving `--resume DIR`.
#[derive(Debug)]
pub struct ResolvedResume {
    pub dir: PathBuf,
    pub state: CheckpointState,
    /// Newer checkpoints under the root that were invalid (empty when DIR was a step dir).
    pub skipped: Vec<SkippedCheckpoint>,
    /// The newest complete step folder under the root when it is newer than `dir` and was not
    /// skipped: the root's `latest` named an older step (another run, or a hand edit, wrote it).
    /// `None` when DIR was a step dir.
    pub newer: Option<(u64, PathBuf)>,
}

/// Load and fully verify the step directory `dir`.
pub fn load(dir: &Path) -> Result<CheckpointState, CheckpointError> {
    let manifest = read_manifest(dir)?;
    let params_bytes = verified_file(dir, PARAMS_FILE, &manifest)?;
    let optim_bytes = verified_file(dir, OPTIM_FILE, &manifest)?;
    let params = read_tensors(&dir.join(PARAMS_FILE), &params_bytes, &manifest.params)?;
    drop(params_bytes);
    let optim = read_tensors(&dir.join(OPTIM_FILE), &optim_bytes, &manifest.optim)?;
    let fingerprint = named_params_blake3(&params);
    if fingerprint != manifest.params_blake3 {
        return Err(CheckpointError::HashMismatch { path: dir.join(PARAMS_FILE), expected: manifest.params_blake3, found: fingerprint });
    }
    Ok(CheckpointState {
        step: manifest.step,
        config_hash: manifest.config_hash,
        model: manifest.model,
        data_cursor: manifest.data_cursor,
        rng: manifest.rng,
        extra: manifest.extra,
        params,
        optim,
    })
}

fn manifest_err(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Manifest { path: path.to_path_buf(), reason: reason.into() }
}

/// Read `dir/manifest.json`, checking format name and version before the full schema.
fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    let text = fs::read(&path).map_err(|e| CheckpointError::io("read", &path, e))?;
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| manifest_err(&path, format!("not valid JSON: {e}")))?;
    let format = value.get("format").and_then(|v| v.as_str());
    if format != Some(FORMAT_NAME) {
        return Err(manifest_err(&path, format!("key `format`: expected \"{FORMAT_NAME}\", found {format:?}")));
    }
    let version = value.get("format_version").and_then(|v| v.as_u64());
    let version = version.ok_or_else(|| manifest_err(&path, "key `format_version`: missing or not an integer"))?;
    match version {
        // Version 1 had no digest of the manifest; one that has it was version 2 before a byte
        // changed.
        1 if value.get("manifest_blake3").is_some() => {
            return Err(manifest_err(&path, "key `format_version`: 1, but the manifest has a `manifest_blake3` (version 2 or later)"))
        }
        1 => {}
        v if v == u64::from(FORMAT_VERSION) => check_digest(&text).map_err(|reason| manifest_err(&path, reason))?,
        _ => {
            return Err(CheckpointError::FormatVersion {
                path,
                found: u32::try_from(version).unwrap_or(u32::MAX),
                expected: FORMAT_VERSION,
            })
        }
    }
    let manifest: Manifest = serde_json::from_value(value).map_err(|e| manifest_err(&path, e.to_string()))?;
    let dir_step = dir.file_name().and_then(|n| parse_step_dir_name(&n.to_string_lossy()));
    if let Some(dir_step) = dir_step.filter(|s| *s != manifest.step) {
        return Err(manifest_err(&path, format!("key `step`: {} but directory is for step {dir_step}", manifest.step)));
    }
    Ok(manifest)
}

/// Read `dir/file` and check its size and blake3 against the manifest before any parsing.
fn verified_file(dir: &Path, file: &str, manifest: &Manifest) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(file);
    let entry: &FileEntry =
        manifest.files.get(file).ok_or_else(|| manifest_err(&dir.join(MANIFEST_FILE), format!("key `files.{file}`: missing")))?;
    let size_mismatch = |found_bytes| CheckpointError::SizeMismatch { path: path.clone(), expected_bytes: entry.bytes, found_bytes };
    let meta = fs::metadata(&path).map_err(|e| CheckpointError::io("stat", &path, e))?;
    if meta.len() != entry.bytes {
        return Err(size_mismatch(meta.len()));
    }
    let bytes = fs::read(&path).map_err(|e| CheckpointError::io("read", &path, e))?;
    if bytes.len() as u64 != entry.bytes {
        return Err(size_mismatch(bytes.len() as u64));
    }
    let found = blake3::hash(&bytes).to_hex().to_string();
    if found != entry.blake3 {
        return Err(CheckpointError::HashMismatch { path, expected: entry.blake3.clone(), found });
    }
    Ok(bytes)
}

/// Parse the f32 tensors listed in `entries` (in that order) out of safetensors `bytes`.
fn read_tensors(path: &Path, bytes: &[u8], entries: &[TensorEntry]) -> Result<Vec<NamedTensor>, CheckpointError> {
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    if st.len() != entries.len() {
        return Err(CheckpointError::Safetensors {
            path: path.to_path_buf(),
            reason: format!("holds {} tensors, manifest lists {}", st.len(), entries.len()),
        });
    }
    let tensor_err = |name: &str, reason: String| CheckpointError::Tensor { path: path.to_path_buf(), name: name.to_string(), reason };
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let view = st.tensor(&entry.name).map_err(|e| tensor_err(&entry.name, e.to_string()))?;
        if view.dtype() != Dtype::F32 {
            return Err(tensor_err(&entry.name, format!("dtype {:?}, expected F32", view.dtype())));
        }
        if view.shape() != entry.shape.as_slice() {
            return Err(tensor_err(&entry.name, format!("shape {:?}, manifest says {:?}", view.shape(), entry.shape)));
        }
        let data = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        out.push(NamedTensor { name: entry.name.clone(), shape: entry.shape.clone(), data });
    }
    Ok(out)
}

/// All `step_*` directories directly under `root`, newest (highest step) first. Temp and
/// replaced dirs (`.tmp-*`, `.old-*`) are not listed. A missing root gives an empty list.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    Ok(scan(root)?.steps)
}

/// What one listing of a checkpoint root finds: its `step_*` folders, newest first, and the
/// `.old-step_N-*` folders whose `step_N` is missing (a same-step re-save moved it aside and
/// crashed, or failed to move it back), newest first, then by path.
struct Scan {
    steps: Vec<(u64, PathBuf)>,
    orphans: Vec<(u64, PathBuf)>,
}

/// Lists `root` once (see [`Scan`]); a missing root gives empty lists.
fn scan(root: &Path) -> Result<Scan, CheckpointError> {
    let mut found = Scan { steps: Vec::new(), orphans: Vec::new() };
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(CheckpointError::io("list", root, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| CheckpointError::io("list", root, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir_name(&name) {
            if entry.path().is_dir() {
                found.steps.push((step, entry.path()));
            }
        } else if let Some(step_name) = old_dir_step_name(&name) {
            if entry.path().is_dir() && !root.join(&step_name).exists() {
                found.orphans.extend(parse_step_dir_name(&step_name).map(|step| (step, entry.path())));
            }
        }
    }
    found.steps.sort_by_key(|e| std::cmp::Reverse(e.0));
    found.orphans.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    Ok(found)
}

/// The step folders a restore may load, newest (highest step) first, then by path: every
/// `step_*` folder, and each `.old-step_N-*` folder whose `step_N` is missing (see [`Scan`]).
/// A missing root gives an empty list.
pub fn list_restorable(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let Scan { mut steps, orphans } = scan(root)?;
    steps.extend(orphans);
    steps.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    Ok(steps)
}

/// Whether `path` is named as a step folder (`step_*`, or `.old-step_*`).
fn is_step_dir(path: &Path) -> bool {
    path.file_name().map(|n| n.to_string_lossy()).is_some_and(|n| parse_step_dir_name(&n).is_some() || old_dir_step_name(&n).is_some())
}

/// Candidate dirs in preference order: the one named by `root/latest`, then `step_*` by step
/// descending, then `.old-step_*` left by a crash during a same-step re-save.
fn candidates(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Ok(text) = fs::read_to_string(root.join(LATEST_FILE)) {
        let name = text.trim();
        if parse_step_dir_name(name).is_some() && root.join(name).is_dir() {
            out.push(root.join(name));
        }
    }
    let Scan { steps, orphans } = scan(root)?;
    for (_, dir) in steps.into_iter().chain(orphans) {
        if !out.contains(&dir) {
            out.push(dir);
        }
    }
    Ok(out)
}

/// Load the newest valid checkpoint under `root` (see [`LatestValid`]). Invalid newer ones are
/// reported in `skipped`; a missing or empty root gives `found: None`.
pub fn load_latest_valid(root: &Path) -> Result<LatestValid, CheckpointError> {
    let mut skipped = Vec::new();
    for dir in candidates(root)? {
        match load(&dir) {
            Ok(state) => return Ok(LatestValid { found: Some((dir, state)), skipped }),
            Err(error) => skipped.push(SkippedCheckpoint { dir, error }),
        }
    }
    Ok(LatestValid { found: None, skipped })
}

/// Resolve `--resume DIR`: a step dir (contains `manifest.json`, or is named `step_*`) is loaded
/// strictly; anything else is treated as a checkpoint root and its newest valid checkpoint is
/// used.
pub fn resolve_resume(path: &Path) -> Result<ResolvedResume, CheckpointError> {
    // A step folder that lost its manifest is a damaged step folder (the error names the
    // manifest), not a checkpoint root without checkpoints.
    if path.join(MANIFEST_FILE).is_file() || (is_step_dir(path) && path.is_dir()) {
        let state = load(path)?;
        return Ok(ResolvedResume { dir: path.to_path_buf(), state, skipped: Vec::new(), newer: None });
    }
    if !path.is_dir() {
        let details = if path.exists() { ": not a directory" } else { ": no such file or directory" };
        return Err(CheckpointError::NotFound { path: path.to_path_buf(), details: details.to_string() });
    }
    let latest = load_latest_valid(path)?;
    match latest.found {
        Some((dir, state)) => {
            let newest = list_checkpoints(path)?.into_iter().find(|(_, d)| d.join(MANIFEST_FILE).is_file());
            let newer = newest.filter(|(step, d)| *step > state.step && !latest.skipped.iter().any(|s| &s.dir == d));
            Ok(ResolvedResume { dir, state, skipped: latest.skipped, newer })
        }
        None if latest.skipped.is_empty() => Err(CheckpointError::NotFound {
            path: path.to_path_buf(),
            details: ": it holds no step_NNNNNNNN folder and no manifest.json (expected a checkpoints root, such as \
                      runs/NAME/checkpoints, or one of its step folders)"
                .to_string(),
        }),
        None => {
            let details: String = latest.skipped.iter().map(|s| format!("; skipped `{}`: {}", s.dir.display(), s.error)).collect();
            Err(CheckpointError::NotFound { path: path.to_path_buf(), details })
        }
    }
}
