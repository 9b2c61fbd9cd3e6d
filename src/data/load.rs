//! Loading a file or directory into a [`Dataset`]: text (bytes or tokenizer),
//! single `.bin` shards, and directories of shards or `.txt` files.

use std::fs;
use std::path::{Path, PathBuf};

use super::codec::BYTE_VOCAB_SIZE;
use super::shard::{read_bin_shard, ShardFormat};
use super::{Codec, DataError, Dataset};

/// Text is handed to a tokenizer in pieces of about this many bytes, cut after
/// a newline that precedes a non-space, so no pre-token straddles a cut.
const ENCODE_CHUNK_BYTES: usize = 1 << 18;

/// Loads `path` (a text file, a `.bin` shard, or a directory of either).
///
/// Text is tokenized byte-level, or with `tokenizer` (a `tokenizer.json`) when
/// given; the last `val_fraction` of the stream becomes validation. In a
/// directory of `.bin` shards (sorted by name) those whose name contains "val"
/// are validation and the rest training; with no "val" shard the training
/// stream is split by `val_fraction`. A directory without shards uses its
/// `.txt` files, sorted by name and joined with newlines.
pub fn load(path: &Path, tokenizer: Option<&Path>, val_fraction: f64) -> Result<Dataset, DataError> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(DataError::BadArgument { what: "val_fraction", expected: "in [0, 1)", found: val_fraction.to_string() });
    }
    let meta = fs::metadata(path).map_err(|e| DataError::io(path, "stat", e))?;
    let codec = Codec::open(tokenizer)?;
    let with_tokenizer = tokenizer.is_some();
    if meta.is_dir() {
        load_dir(path, &codec, with_tokenizer, val_fraction)
    } else if is_bin(path) {
        load_shards(path, &[path.to_path_buf()], &[], &codec, with_tokenizer, val_fraction)
    } else {
        load_text(path, &[path.to_path_buf()], &codec, val_fraction)
    }
}

fn is_bin(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "bin")
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn load_dir(dir: &Path, codec: &Codec, with_tokenizer: bool, frac: f64) -> Result<Dataset, DataError> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, "list", e))? {
        let entry = entry.map_err(|e| DataError::io(dir, "list", e))?;
        let path = entry.path();
        if path.is_file() && !file_name(&path).starts_with('.') {
            files.push(path);
        }
    }
    files.sort_by_key(|p| file_name(p));
    let bins: Vec<PathBuf> = files.iter().filter(|p| is_bin(p)).cloned().collect();
    if !bins.is_empty() {
        let (val, train): (Vec<PathBuf>, Vec<PathBuf>) = bins.into_iter().partition(|p| file_name(p).contains("val"));
        return load_shards(dir, &train, &val, codec, with_tokenizer, frac);
    }
    let texts: Vec<PathBuf> = files.into_iter().filter(|p| p.extension().is_some_and(|e| e == "txt")).collect();
    if texts.is_empty() {
        return Err(DataError::EmptyDir { path: dir.to_path_buf() });
    }
    load_text(dir, &texts, codec, frac)
}

fn load_text(path: &Path, files: &[PathBuf], codec: &Codec, frac: f64) -> Result<Dataset, DataError> {
    let mut tokens = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let bytes = fs::read(file).map_err(|e| DataError::io(file, "read", e))?;
        if i > 0 {
            tokens.extend(codec.encode("\n")?);
        }
        tokens.extend(encode_file(file, bytes, codec)?);
    }
    if tokens.is_empty() {
        return Err(DataError::Empty { path: path.to_path_buf() });
    }
    let total = tokens.len();
    let (train, val) = split_tail(tokens, frac);
    let source = format!("text {} ({}): {total} tokens, {} train / {} val", path.display(), codec.describe(), train.len(), val.len());
    Ok(Dataset { train, val, vocab_size: codec.vocab_size(), source })
}

fn encode_file(path: &Path, bytes: Vec<u8>, codec: &Codec) -> Result<Vec<u32>, DataError> {
    if let Codec::Bytes = codec {
        return Ok(bytes.into_iter().map(u32::from).collect());
    }
    let text =
        String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 { path: path.to_path_buf(), offset: e.utf8_error().valid_up_to() })?;
    let mut tokens = Vec::new();
    for (start, piece) in chunks(&text, ENCODE_CHUNK_BYTES) {
        let ids = codec.encode(piece).map_err(|e| match e {
            DataError::Encode { message, .. } => DataError::Encode { what: format!("{} at byte {start}", path.display()), message },
            other => other,
        })?;
        tokens.extend(ids);
    }
    let vocab_size = codec.vocab_size();
    check_range(&tokens, vocab_size, &path.display().to_string())?;
    Ok(tokens)
}

/// Splits `text` into `(byte offset, piece)` of about `target` bytes, each cut
/// just after a '\n' that is followed by a non-whitespace character.
fn chunks(text: &str, target: usize) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + target.max(1)).min(text.len());
        while end < text.len() {
            let cut = bytes[end - 1] == b'\n' && !bytes[end].is_ascii_whitespace();
            if cut && text.is_char_boundary(end) {
                break;
            }
            end += 1;
        }
        out.push((start, &text[start..end]));
        start = end;
    }
    out
}

fn load_shards(
    path: &Path,
    train_files: &[PathBuf],
    val_files: &[PathBuf],
    codec: &Codec,
    with_tokenizer: bool,
    frac: f64,
) -> Result<Dataset, DataError> {
    let (mut train, train_fmt) = read_all(train_files)?;
    let (mut val, val_fmt) = read_all(val_files)?;
    if train.is_empty() {
        return Err(DataError::Empty { path: path.to_path_buf() });
    }
    if val_files.is_empty() {
        (train, val) = split_tail(train, frac);
    }
    let max_token = train.iter().chain(&val).copied().max().unwrap_or(0);
    let natural = train_fmt.into_iter().chain(val_fmt).map(ShardFormat::natural_vocab_size).max();
    let vocab_size = match (with_tokenizer, natural) {
        (true, _) => codec.vocab_size(),
        (false, _) if (max_token as usize) < BYTE_VOCAB_SIZE => BYTE_VOCAB_SIZE,
        (false, natural) => natural.unwrap_or(BYTE_VOCAB_SIZE),
    };
    let desc = format!("token shards {}", path.display());
    check_range(&train, vocab_size, &format!("{desc} (train)"))?;
    check_range(&val, vocab_size, &format!("{desc} (val)"))?;
    let source = format!(
        "{desc} ({} train + {} val files, vocab {vocab_size}): {} train / {} val tokens",
        train_files.len(),
        val_files.len(),
        train.len(),
        val.len()
    );
    Ok(Dataset { train, val, vocab_size, source })
}

fn read_all(files: &[PathBuf]) -> Result<(Vec<u32>, Option<ShardFormat>), DataError> {
    let mut tokens = Vec::new();
    let mut widest: Option<ShardFormat> = None;
    for file in files {
        let (shard, format) = read_bin_shard(file)?;
        tokens.extend(shard);
        if widest.is_none_or(|w| w.natural_vocab_size() < format.natural_vocab_size()) {
            widest = Some(format);
        }
    }
    Ok((tokens, widest))
}

fn check_range(tokens: &[u32], vocab_size: usize, source_desc: &str) -> Result<(), DataError> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        None => Ok(()),
        Some(index) => Err(DataError::TokenOutOfRange { source_desc: source_desc.to_string(), index, token: tokens[index], vocab_size }),
    }
}

/// The last `ceil(len * frac)` tokens (at most `len - 1`) become validation.
fn split_tail(mut tokens: Vec<u32>, frac: f64) -> (Vec<u32>, Vec<u32>) {
    let len = tokens.len();
    let n_val = ((len as f64 * frac).ceil() as usize).min(len.saturating_sub(1));
    let val = tokens.split_off(len - n_val);
    (tokens, val)
}

#[cfg(test)]
pub(super) fn chunks_for_test(text: &str, target: usize) -> Vec<(usize, &str)> {
    chunks(text, target)
}
