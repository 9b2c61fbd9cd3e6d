//! The token cache: a data path's tokens, written once to `<cache dir>/<key>.tok` and
//! memory-mapped by every rank and every later run, instead of each process reading and
//! tokenizing the data into its own memory.
//!
//! The key is the blake3 of everything the tokens depend on ([`key`]: the format version,
//! each input file's bytes and split, the tokenizer file's bytes, the end-of-text id, the
//! text field, the validation fraction), so a changed input is a new key, never a stale hit.
//! A file is written to a temporary name and renamed into place ([`super::atomic`]): a reader
//! sees a whole file or none. A file is checked before use (magic, version, key, counts,
//! length, and the blake3 of its tokens); one that fails is rebuilt, never trained on.
//!
//! Layout (little-endian): `[0, 8)` magic `TSRTOKEN`, `[8, 12)` version, `[12, 16)` header
//! bytes (128), `[16, 48)` key, `[48, 56)` vocabulary size, `[56, 64)` training tokens,
//! `[64, 72)` validation tokens, `[72, 80)` training documents, `[80, 88)` validation
//! documents, `[88, 120)` blake3 of the tokens, zero to 128; then the tokens as u32.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::atomic::TempFile;
use super::build::{build, Built, Sink, Spec};
use super::{DataError, Tokens};

const MAGIC: &[u8; 8] = b"TSRTOKEN";
/// Bumped whenever the layout or the tokens a spec gives change.
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 128;

/// A cache file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    key: [u8; 32],
    vocab_size: u64,
    built: Built,
}

impl Header {
    fn to_bytes(self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        h[16..48].copy_from_slice(&self.key);
        let b = self.built;
        for (at, v) in [(48, self.vocab_size), (56, b.train), (64, b.val), (72, b.docs[0]), (80, b.docs[1])] {
            h[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        h[88..120].copy_from_slice(&b.blake3);
        h
    }

    /// Parses and checks a header against the key expected; the error says what is wrong.
    fn parse(bytes: &[u8], key: &[u8; 32]) -> Result<Header, String> {
        let h = bytes.get(..HEADER_BYTES).ok_or_else(|| format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", bytes.len()))?;
        let u32_at = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if &h[0..8] != MAGIC {
            return Err("bad magic (not a token-cache file)".into());
        }
        if u32_at(8) != FORMAT_VERSION || u32_at(12) != HEADER_BYTES as u32 {
            return Err(format!("format version {} (header {} bytes); this build writes version {FORMAT_VERSION}", u32_at(8), u32_at(12)));
        }
        if &h[16..48] != key {
            return Err("its key is not the file name's".into());
        }
        let mut blake3 = [0u8; 32];
        blake3.copy_from_slice(&h[88..120]);
        let built = Built { train: u64_at(56), val: u64_at(64), docs: [u64_at(72), u64_at(80)], blake3 };
        Ok(Header { key: *key, vocab_size: u64_at(48), built })
    }
}

/// How a load used the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheUse {
    /// No cache (`tessera.data_cache = "off"`, or a direct `data::load`).
    Off,
    /// The tokens were already there.
    Hit(PathBuf),
    /// Tokenized now and written there.
    Built(PathBuf),
    /// The file there failed its check (`reason`) and was written anew.
    Rebuilt { path: PathBuf, reason: String },
    /// The cache could not be written (`reason`); the tokens are in memory.
    Unavailable { dir: PathBuf, reason: String },
}

impl CacheUse {
    /// A warning to show, for the outcomes that deserve one.
    pub fn warning(&self) -> Option<String> {
        match self {
            CacheUse::Rebuilt { path, reason } => Some(format!("token cache {} was invalid ({reason}) and was rebuilt", path.display())),
            CacheUse::Unavailable { dir, reason } => {
                Some(format!("token cache in {} unavailable ({reason}): the data is tokenized into memory", dir.display()))
            }
            _ => None,
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            CacheUse::Off => "no token cache".into(),
            CacheUse::Hit(p) => format!("token cache hit {}", p.display()),
            CacheUse::Built(p) => format!("tokenized into cache {}", p.display()),
            CacheUse::Rebuilt { path, .. } => format!("token cache rebuilt {}", path.display()),
            CacheUse::Unavailable { .. } => "token cache unavailable, in memory".into(),
        }
    }
}

/// The cache key of `spec`: blake3 over the format version and everything that decides the
/// tokens, each input file by its bytes (so a moved or copied data set still hits).
pub(super) fn key(spec: &Spec) -> Result<[u8; 32], DataError> {
    let mut h = blake3::Hasher::new();
    h.update(b"tessera token cache");
    h.update(&FORMAT_VERSION.to_le_bytes());
    h.update(spec.inputs.format.name().as_bytes());
    h.update(&[u8::from(spec.inputs.documents)]);
    match &spec.tokenizer {
        None => h.update(b"byte-level"),
        Some(path) => h.update(blake3::hash(&std::fs::read(path).map_err(|e| DataError::io(path, "read", e))?).as_bytes()),
    };
    h.update(&spec.end_of_text.map_or(u64::MAX, u64::from).to_le_bytes());
    // Only when set, so that the caches of runs without one keep their keys.
    if let Some(bos) = spec.begin_of_text {
        h.update(b"begin-of-text");
        h.update(&u64::from(bos).to_le_bytes());
    }
    h.update(&(spec.vocab_size as u64).to_le_bytes());
    h.update(&(spec.field.len() as u64).to_le_bytes());
    h.update(spec.field.as_bytes());
    h.update(&spec.val_fraction.to_bits().to_le_bytes());
    h.update(&(spec.inputs.files.len() as u64).to_le_bytes());
    for input in &spec.inputs.files {
        let mut file_hash = blake3::Hasher::new();
        file_hash.update_mmap_rayon(&input.path).map_err(|e| DataError::io(&input.path, "read", e))?;
        h.update(&[u8::from(input.split == super::source::Split::Val)]);
        h.update(&file_hash.count().to_le_bytes());
        h.update(file_hash.finalize().as_bytes());
    }
    Ok(*h.finalize().as_bytes())
}

/// The cache file of `key` in `dir`.
pub(super) fn path_of(dir: &Path, key: &[u8; 32]) -> PathBuf {
    dir.join(format!("{}.tok", &blake3::Hash::from_bytes(*key).to_hex()[..32]))
}

/// A checked cache file's tokens: (training, validation, what was built).
pub(super) type Mapped = (Tokens, Tokens, Built);

/// Opens and checks the cache file at `path`. `Ok(None)`: there is none; `Err(reason)`: it
/// is there but fails a check.
pub(super) fn open(path: &Path, key: &[u8; 32], vocab_size: usize) -> Result<Option<Mapped>, String> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("opening it failed: {e}")),
    };
    // SAFETY: cache files are never written in place (see `Tokens`' `Store::Mapped`): a new
    // one is renamed over the name, so these bytes do not change while mapped.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("mapping it failed: {e}"))?;
    let header = Header::parse(&map, key)?;
    let b = header.built;
    if header.vocab_size != vocab_size as u64 {
        return Err(format!("vocabulary {} where {vocab_size} was expected", header.vocab_size));
    }
    let tokens = b.train.checked_add(b.val).and_then(|n| n.checked_mul(4)).and_then(|n| n.checked_add(HEADER_BYTES as u64));
    if tokens != Some(map.len() as u64) {
        return Err(format!("{} bytes where the header's {} + {} tokens need {tokens:?}", map.len(), b.train, b.val));
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update_rayon(&map[HEADER_BYTES..]);
    if hasher.finalize().as_bytes() != &b.blake3 {
        return Err("its tokens do not match their blake3 (corrupted)".into());
    }
    let (train, val) = Tokens::mapped(map, HEADER_BYTES, b.train as usize).ok_or("its tokens cannot be mapped as u32 here")?;
    Ok(Some((train, val, b)))
}

/// Writes the cache file of `spec` at `path` (whole, or not at all), tokenizing its inputs.
/// A [`DataError::CacheIo`] is the cache's fault; any other error is the data's.
pub(super) fn write(path: &Path, key: &[u8; 32], spec: &Spec) -> Result<(), DataError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let io = |action: &'static str| move |err: std::io::Error| DataError::CacheIo { path: path.to_path_buf(), action, err };
    std::fs::create_dir_all(dir).map_err(io("creating its folder"))?;
    let mut tmp = TempFile::create(dir, "tokens").map_err(io("creating a temporary file"))?;
    {
        let mut sink = FileSink { out: BufWriter::with_capacity(1 << 20, tmp.file()), path };
        sink.out.write_all(&[0u8; HEADER_BYTES]).map_err(io("writing"))?;
        let built = build(spec, &mut sink)?;
        sink.out.flush().map_err(io("writing"))?;
        let header = Header { key: *key, vocab_size: spec.vocab_size as u64, built };
        let out = sink.out.get_mut();
        out.seek(SeekFrom::Start(0)).and_then(|_| out.write_all(&header.to_bytes())).map_err(io("writing the header"))?;
    }
    tmp.commit(path).map_err(io("renaming into place"))
}

struct FileSink<'a> {
    out: BufWriter<&'a mut File>,
    path: &'a Path,
}

impl Sink for FileSink<'_> {
    fn write(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let written = if cfg!(target_endian = "little") {
            self.out.write_all(bytemuck::cast_slice(tokens))
        } else {
            tokens.iter().try_for_each(|t| self.out.write_all(&t.to_le_bytes()))
        };
        written.map_err(|err| DataError::CacheIo { path: self.path.to_path_buf(), action: "writing", err })
    }
}
