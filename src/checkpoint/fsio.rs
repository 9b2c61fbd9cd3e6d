//! Durable file writing for checkpoints: fsync helpers, hashing writer, atomic small files and a
//! streaming f32 safetensors writer, all relative to an open folder ([`Dir`]).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use super::dir::Dir;
use super::{for_each_le_chunk, CheckpointError, NamedTensor};

/// Size and blake3 of a file as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileDigest {
    pub bytes: u64,
    pub blake3: String,
}

#[cfg(test)]
thread_local! {
    /// Test-only fault injection: called with each operation a save is about to make and the
    /// name it acts on (`("write", "optim.safetensors")`, `("rename", "step_00000002")`, …; see
    /// [`fault_point`]'s callers); an error it returns is that operation's failure. It may also
    /// act on the file system itself (move the checkpoint folder away, as the chaos harness does).
    #[allow(clippy::type_complexity)]
    pub(crate) static FAULT_HOOK: std::cell::RefCell<Option<Box<dyn FnMut(&str, &str) -> io::Result<()>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Where a test may inject a failure: `op` on `name` is about to happen (see [`FAULT_HOOK`]).
#[cfg(test)]
pub(crate) fn fault_point(op: &str, name: &str) -> io::Result<()> {
    FAULT_HOOK.with(|h| match h.borrow_mut().as_mut() {
        Some(hook) => hook(op, name),
        None => Ok(()),
    })
}

#[cfg(not(test))]
#[inline(always)]
pub(crate) fn fault_point(_op: &str, _name: &str) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// Test-only fault injection below the buffer, where a file's bytes reach the file system:
    /// called with the file's name, the offset and the length of each write; answers how many
    /// of those bytes go through (fewer: a short write) or the write's error. `Ok(room)` and
    /// then `Err(StorageFull)` is a disk that fills at a given byte. It may also act on the file
    /// system itself (leave it as a crash at that byte would).
    #[allow(clippy::type_complexity)]
    pub(crate) static WRITE_HOOK: std::cell::RefCell<Option<Box<dyn FnMut(&str, u64, usize) -> io::Result<usize>>>> =
        const { std::cell::RefCell::new(None) };
}

/// How many of `len` bytes at `offset` of file `name` a write may pass on (see [`WRITE_HOOK`]).
#[cfg(test)]
fn write_fault(name: &str, offset: u64, len: usize) -> io::Result<usize> {
    WRITE_HOOK.with(|h| match h.borrow_mut().as_mut() {
        Some(hook) => hook(name, offset, len).map(|n| n.min(len)),
        None => Ok(len),
    })
}

#[cfg(not(test))]
#[inline(always)]
fn write_fault(_name: &str, _offset: u64, len: usize) -> io::Result<usize> {
    Ok(len)
}

/// The file a checkpoint writes, with the test-only fault seam [`WRITE_HOOK`] in front of it.
struct FileSink<'a> {
    file: File,
    name: &'a str,
    offset: u64,
}

impl Write for FileSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = write_fault(self.name, self.offset, buf.len())?;
        let n = self.file.write(&buf[..room])?;
        self.offset += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
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

/// What goes into a file: called with the (buffered, hashing) writer.
pub(crate) type Fill<'a> = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()> + 'a>;

/// Let `fill` write the content of the new, empty `file` (at `path`, for messages), flush and
/// fsync it.
fn fill_file(file: File, path: &Path, fill: Fill<'_>) -> Result<FileDigest, CheckpointError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let err = |e| CheckpointError::io("write", path, e);
    fault_point("write", &name).map_err(err)?;
    let sink = FileSink { file, name: &name, offset: 0 };
    let mut w = HashingWriter { inner: BufWriter::with_capacity(1 << 20, sink), hasher: blake3::Hasher::new(), bytes: 0 };
    fill(&mut w).map_err(err)?;
    w.flush().map_err(err)?;
    let file = w.inner.into_inner().map_err(|e| err(e.into_error()))?.file;
    let fsync_err = |e| CheckpointError::io("fsync", path, e);
    fault_point("fsync", &name).map_err(fsync_err)?;
    file.sync_all().map_err(fsync_err)?;
    Ok(FileDigest { bytes: w.bytes, blake3: w.hasher.finalize().to_hex().to_string() })
}

/// Create `name` in `dir` (must not exist), let `fill` write its content, flush and fsync it.
pub(crate) fn write_new_file_in(dir: &Dir, name: &str, fill: Fill<'_>) -> Result<FileDigest, CheckpointError> {
    let path = dir.join(name);
    let file = dir.create_file(name).map_err(|e| CheckpointError::io("create", &path, e))?;
    fill_file(file, &path, fill)
}

/// The content of a small file: `bytes`.
pub(crate) fn bytes_fill(bytes: &[u8]) -> Fill<'_> {
    Box::new(move |w: &mut dyn Write| w.write_all(bytes))
}

/// The temporary name a file `name` is written under before it is renamed into place.
pub(crate) fn temp_name(name: &str) -> String {
    format!(".{name}{TEMP_INFIX}{}", std::process::id())
}

/// What [`temp_name`] puts between a file's name and the writer's pid.
pub(crate) const TEMP_INFIX: &str = ".tmp-";

/// Atomically replace `name` in `dir` with the file `fill` writes: [`temp_name`] written and
/// fsynced, renamed over `name`, `dir` fsynced. Every step is relative to `dir`, the clean-up of
/// the temporary file after an error too, so none is left in the folder whatever its path names
/// meanwhile.
pub(crate) fn write_atomic_in(dir: &Dir, name: &str, fill: Fill<'_>) -> Result<FileDigest, CheckpointError> {
    let tmp = temp_name(name);
    let _ = dir.remove_file(&tmp);
    let path = dir.join(name);
    let installed = write_new_file_in(dir, &tmp, fill).and_then(|digest| {
        fault_point("rename", name)
            .and_then(|()| dir.rename(&tmp, name))
            .map(|()| digest)
            .map_err(|e| CheckpointError::io("rename into place", &path, e))
    });
    let digest = match installed {
        Ok(d) => d,
        Err(e) => {
            let _ = dir.remove_file(&tmp);
            return Err(e);
        }
    };
    dir.sync().map_err(|e| CheckpointError::io("fsync directory", dir.path(), e))?;
    Ok(digest)
}

/// [`write_atomic_in`] of a small file holding `bytes`.
pub(crate) fn write_file_atomic_in(dir: &Dir, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_atomic_in(dir, name, bytes_fill(bytes)).map(drop)
}

/// The safetensors JSON header for `tensors` (all F32, contiguous, in the given order), padded
/// with spaces to a multiple of 8 bytes as the format recommends.
/// How a safetensors file stores its tensors (checkpoints: always f32; an export: f32 or bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorDtype {
    F32,
    /// bfloat16, rounded to nearest even from the f32 values.
    Bf16,
}

impl TensorDtype {
    pub fn bytes(self) -> usize {
        match self {
            TensorDtype::F32 => 4,
            TensorDtype::Bf16 => 2,
        }
    }

    /// The header's name for it.
    fn safetensors(self) -> &'static str {
        match self {
            TensorDtype::F32 => "F32",
            TensorDtype::Bf16 => "BF16",
        }
    }

    /// transformers' `torch_dtype` for it.
    pub fn torch(self) -> &'static str {
        match self {
            TensorDtype::F32 => "float32",
            TensorDtype::Bf16 => "bfloat16",
        }
    }
}

fn safetensors_header(tensors: &[&NamedTensor], metadata: &[(&str, &str)], dtype: TensorDtype) -> Result<Vec<u8>, serde_json::Error> {
    let mut header = String::from("{");
    if !metadata.is_empty() {
        let meta: serde_json::Map<String, serde_json::Value> =
            metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
        header.push_str(&format!("\"__metadata__\":{}", serde_json::to_string(&meta)?));
    }
    let mut offset = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let end = offset + t.data.len() * dtype.bytes();
        let sep = if i == 0 && metadata.is_empty() { "" } else { "," };
        header.push_str(&format!(
            "{sep}{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name)?,
            dtype.safetensors(),
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

/// The content of a safetensors file of `tensors` stored as `dtype` (`path` names it in an
/// error). Tensor data must already be validated (`data.len() == shape product`).
pub(crate) fn safetensors_fill<'a>(
    path: &Path,
    tensors: &'a [&NamedTensor],
    metadata: &[(&str, &str)],
    dtype: TensorDtype,
) -> Result<Fill<'a>, CheckpointError> {
    let header = safetensors_header(tensors, metadata, dtype)
        .map_err(|e| CheckpointError::Safetensors { path: path.to_path_buf(), reason: format!("cannot encode header: {e}") })?;
    Ok(Box::new(move |w: &mut dyn Write| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for t in tensors {
            match dtype {
                TensorDtype::F32 => for_each_le_chunk(&t.data, |b| w.write_all(b))?,
                TensorDtype::Bf16 => {
                    for chunk in t.data.chunks(BF16_CHUNK) {
                        let b: Vec<u8> = chunk.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
                        w.write_all(&b)?;
                    }
                }
            }
        }
        Ok(())
    }))
}

/// Values converted to bf16 at a time while an export streams.
const BF16_CHUNK: usize = 1 << 16;

/// Stream `tensors` as an f32 safetensors file to new file `name` in `dir` (fsynced).
pub(crate) fn write_safetensors_in(
    dir: &Dir,
    name: &str,
    tensors: &[&NamedTensor],
    metadata: &[(&str, &str)],
) -> Result<FileDigest, CheckpointError> {
    write_new_file_in(dir, name, safetensors_fill(&dir.join(name), tensors, metadata, TensorDtype::F32)?)
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
