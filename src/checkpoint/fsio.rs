//! Durable file writing for checkpoints: fsync helpers, hashing writer, atomic small files and a
//! streaming f32 safetensors writer.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;

use super::{for_each_le_chunk, CheckpointError, NamedTensor};

/// Size and blake3 of a file as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileDigest {
    pub bytes: u64,
    pub blake3: String,
}

#[cfg(test)]
thread_local! {
    /// Test-only fault injection: writing a file whose name equals this fails with StorageFull.
    pub(crate) static FAIL_WRITE_OF: std::cell::RefCell<Option<String>> =
        const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
fn injected_failure(path: &Path) -> io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    FAIL_WRITE_OF.with(|f| match (&*f.borrow(), name) {
        (Some(target), Some(name)) if *target == name => {
            Err(io::Error::new(io::ErrorKind::StorageFull, "injected: no space left on device"))
        }
        _ => Ok(()),
    })
}

#[cfg(not(test))]
fn injected_failure(_path: &Path) -> io::Result<()> {
    Ok(())
}

/// fsync a directory so that entries created/renamed in it are durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| CheckpointError::io("fsync directory", dir, e))
}

/// A writer that counts bytes and blake3-hashes everything passing through.
struct HashingWriter<W: Write> {
    inner: W,
    hasher: blake3::Hasher,
    bytes: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Create `path` (must not exist), let `fill` write its content, flush and fsync it.
fn write_new_file(path: &Path, fill: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<FileDigest, CheckpointError> {
    let err = |e| CheckpointError::io("write", path, e);
    injected_failure(path).map_err(err)?;
    let file = OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| CheckpointError::io("create", path, e))?;
    let mut w = HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hasher: blake3::Hasher::new(), bytes: 0 };
    fill(&mut w).map_err(err)?;
    w.flush().map_err(err)?;
    let file = w.inner.into_inner().map_err(|e| err(e.into_error()))?;
    file.sync_all().map_err(|e| CheckpointError::io("fsync", path, e))?;
    Ok(FileDigest { bytes: w.bytes, blake3: w.hasher.finalize().to_hex().to_string() })
}

/// Write `bytes` to a new file at `path` and fsync it.
pub(crate) fn write_bytes_synced(path: &Path, bytes: &[u8]) -> Result<FileDigest, CheckpointError> {
    write_new_file(path, |w| w.write_all(bytes))
}

/// Atomically replace `path` with `bytes`: write `path.tmp-<pid>`, fsync, rename, fsync the dir.
pub(crate) fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_atomic_with(path, |tmp| write_bytes_synced(tmp, bytes)).map(|_| ())
}

/// Atomically replace `path` with a file produced by `write` (which must create and fsync the
/// temp path it is given): temp in the same dir, rename over `path`, fsync the dir.
pub(crate) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<FileDigest, CheckpointError>,
) -> Result<FileDigest, CheckpointError> {
    let name = path.file_name().ok_or_else(|| CheckpointError::InvalidState(format!("`{}` has no file name", path.display())))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let digest = match write(&tmp) {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(CheckpointError::io("rename into place", path, e));
    }
    fsync_dir(dir)?;
    Ok(digest)
}

/// The safetensors JSON header for `tensors` (all F32, contiguous, in the given order), padded
/// with spaces to a multiple of 8 bytes as the format recommends.
fn safetensors_header(tensors: &[&NamedTensor], metadata: &[(&str, &str)]) -> Result<Vec<u8>, serde_json::Error> {
    let mut header = String::from("{");
    if !metadata.is_empty() {
        let meta: serde_json::Map<String, serde_json::Value> =
            metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
        header.push_str(&format!("\"__metadata__\":{}", serde_json::to_string(&meta)?));
    }
    let mut offset = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let end = offset + t.data.len() * 4;
        let sep = if i == 0 && metadata.is_empty() { "" } else { "," };
        header.push_str(&format!(
            "{sep}{}:{{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name)?,
            serde_json::to_string(&t.shape)?
        ));
        offset = end;
    }
    header.push('}');
    let mut bytes = header.into_bytes();
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    Ok(bytes)
}

/// Stream `tensors` as an f32 safetensors file to new file `path` (fsynced). Tensor data must
/// already be validated (`data.len() == shape product`).
pub(crate) fn write_safetensors(path: &Path, tensors: &[&NamedTensor], metadata: &[(&str, &str)]) -> Result<FileDigest, CheckpointError> {
    let header = safetensors_header(tensors, metadata)
        .map_err(|e| CheckpointError::Safetensors { path: path.to_path_buf(), reason: format!("cannot encode header: {e}") })?;
    write_new_file(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for t in tensors {
            for_each_le_chunk(&t.data, |b| w.write_all(b))?;
        }
        Ok(())
    })
}

/// Check that every tensor's data length matches its shape and names are unique and non-empty.
pub(crate) fn validate_tensors(kind: &str, tensors: &[NamedTensor]) -> Result<(), CheckpointError> {
    let mut seen = std::collections::HashSet::new();
    for t in tensors {
        if t.name.is_empty() || t.name == "__metadata__" {
            return Err(CheckpointError::InvalidState(format!("{kind} tensor has invalid name `{}`", t.name)));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(CheckpointError::InvalidState(format!("duplicate {kind} tensor name `{}`", t.name)));
        }
        let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if numel != Some(t.data.len()) {
            return Err(CheckpointError::InvalidState(format!(
                "{kind} tensor `{}`: shape {:?} does not match data length {}",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
    }
    Ok(())
}
