//! llm.c-compatible `.bin` token shards: a header of 256 little-endian i32
//! (`[0]` magic, `[1]` version, `[2]` token count, rest zero) followed by the
//! tokens, little-endian u16 (GPT-2 format) or u32 (Llama-3 format).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::DataError;

/// Number of i32 values in a shard header.
pub const SHARD_HEADER_INTS: usize = 256;
const HEADER_BYTES: usize = SHARD_HEADER_INTS * 4;
const GPT2_MAGIC: i32 = 20240520;
const GPT2_VERSION: i32 = 1;
const LLAMA3_MAGIC: i32 = 20240801;
const LLAMA3_VERSION: i32 = 7;

/// The two token layouts llm.c writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardFormat {
    /// magic 20240520, version 1, u16 tokens.
    Gpt2U16,
    /// magic 20240801, version 7, u32 tokens.
    Llama3U32,
}

impl ShardFormat {
    /// Bytes per stored token.
    pub fn token_bytes(self) -> usize {
        match self {
            ShardFormat::Gpt2U16 => 2,
            ShardFormat::Llama3U32 => 4,
        }
    }

    /// The format's name for messages.
    pub fn name(self) -> &'static str {
        match self {
            ShardFormat::Gpt2U16 => "GPT-2 (u16)",
            ShardFormat::Llama3U32 => "Llama-3 (u32)",
        }
    }

    /// Vocabulary of the tokenizer this format was made for (GPT-2: 50257, Llama-3: 128256).
    pub fn natural_vocab_size(self) -> usize {
        match self {
            ShardFormat::Gpt2U16 => 50257,
            ShardFormat::Llama3U32 => 128256,
        }
    }

    fn from_header(path: &Path, magic: i32, version: i32) -> Result<Self, DataError> {
        let (format, want_version) = match magic {
            GPT2_MAGIC => (ShardFormat::Gpt2U16, GPT2_VERSION),
            LLAMA3_MAGIC => (ShardFormat::Llama3U32, LLAMA3_VERSION),
            other => return Err(bad_header(path, "magic", format!("{GPT2_MAGIC} (GPT-2) or {LLAMA3_MAGIC} (Llama-3)"), other)),
        };
        if version != want_version {
            return Err(bad_header(path, "version", want_version.to_string(), version));
        }
        Ok(format)
    }
}

fn bad_header(path: &Path, field: &'static str, expected: String, found: i32) -> DataError {
    DataError::BadHeader { path: path.to_path_buf(), field, expected, found: found.to_string() }
}

fn header_int(bytes: &[u8], index: usize) -> i32 {
    let at = index * 4;
    i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Reads one shard, checking magic, version and that the file size matches the header.
pub fn read_bin_shard(path: &Path) -> Result<(Vec<u32>, ShardFormat), DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, "read", e))?;
    if bytes.len() < HEADER_BYTES {
        return Err(DataError::BadSize {
            path: path.to_path_buf(),
            tokens: 0,
            token_bytes: 0,
            expected_bytes: HEADER_BYTES as u64,
            found_bytes: bytes.len() as u64,
        });
    }
    let format = ShardFormat::from_header(path, header_int(&bytes, 0), header_int(&bytes, 1))?;
    let count = header_int(&bytes, 2);
    if count < 0 {
        return Err(bad_header(path, "token count", "a count >= 0".into(), count));
    }
    let width = format.token_bytes();
    let expected = HEADER_BYTES as u64 + count as u64 * width as u64;
    if bytes.len() as u64 != expected {
        return Err(DataError::BadSize {
            path: path.to_path_buf(),
            tokens: count as u64,
            token_bytes: width,
            expected_bytes: expected,
            found_bytes: bytes.len() as u64,
        });
    }
    let body = &bytes[HEADER_BYTES..];
    let tokens = match format {
        ShardFormat::Gpt2U16 => body.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
        ShardFormat::Llama3U32 => body.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    };
    Ok((tokens, format))
}

/// Writes `tokens` as a version-1 (GPT-2, u16) shard that llm.c can read.
pub fn write_bin_shard(path: &Path, tokens: &[u32]) -> Result<(), DataError> {
    if let Some((index, &token)) = tokens.iter().enumerate().find(|(_, &t)| t > 0xFFFF) {
        return Err(DataError::TokenTooWide { path: path.to_path_buf(), index, token });
    }
    let count = i32::try_from(tokens.len()).map_err(|_| DataError::TooManyTokens {
        path: path.to_path_buf(),
        count: tokens.len(),
        max: i32::MAX as u64,
    })?;
    let mut header = [0i32; SHARD_HEADER_INTS];
    header[0] = GPT2_MAGIC;
    header[1] = GPT2_VERSION;
    header[2] = count;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + tokens.len() * 2);
    header.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
    // Narrowing is lossless: every token was checked to be <= 0xFFFF above.
    tokens.iter().for_each(|&t| bytes.extend_from_slice(&(t as u16).to_le_bytes()));
    let file = File::create(path).map_err(|e| DataError::io(path, "create", e))?;
    let mut out = BufWriter::new(file);
    out.write_all(&bytes).and_then(|()| out.flush()).map_err(|e| DataError::io(path, "write", e))
}
