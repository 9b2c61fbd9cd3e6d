//! Turning a data path's inputs into one token stream: units read in order, tokenized in
//! parallel batches (rayon), documents joined by the end-of-text token (each opened by the
//! begin-of-text token where the tokenizer has one, `tessera.data_bos`), and written to a
//! [`Sink`] (memory, or the token-cache file) with a running count, blake3 and range check.
//!
//! The stream holds the training files' tokens, then the validation files'; with no
//! validation file its last `val_fraction` is validation. Tokens do not depend on the batch
//! size or the thread count: units are cut by content alone and reassembled in order.

use std::path::PathBuf;

use rayon::prelude::*;

use super::codec::BYTE_VOCAB_SIZE;
use super::docs::{encode_unit, read_jsonl, read_text, Unit};
use super::parquet::read_parquet;
use super::shard::read_bin_shard;
use super::source::{Format, Inputs, Split};
use super::{Codec, DataError};

/// Bytes of text read ahead and tokenized in parallel at a time.
pub const BATCH_BYTES: usize = 32 << 20;

/// Everything that decides a data path's tokens (and so the token cache's key).
pub(super) struct Spec {
    pub inputs: Inputs,
    pub codec: Codec,
    pub tokenizer: Option<PathBuf>,
    /// The id between documents, for a collection of documents.
    pub end_of_text: Option<u32>,
    /// The id before every document, for a collection of documents.
    pub begin_of_text: Option<u32>,
    pub vocab_size: usize,
    /// The JSON field or Parquet column holding the text.
    pub field: String,
    pub val_fraction: f64,
}

/// Where the stream's tokens go.
pub(super) trait Sink {
    fn write(&mut self, tokens: &[u32]) -> Result<(), DataError>;
}

impl Sink for Vec<u32> {
    fn write(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        self.extend_from_slice(tokens);
        Ok(())
    }
}

/// What [`build`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Built {
    pub train: u64,
    pub val: u64,
    /// Documents in the training and validation files (0 for token shards).
    pub docs: [u64; 2],
    /// blake3 of the tokens (u32 little-endian, training then validation): `Dataset::record`'s.
    pub blake3: [u8; 32],
}

/// The sink behind a running count, hash and vocabulary check.
struct Stream<'a> {
    sink: &'a mut dyn Sink,
    hasher: blake3::Hasher,
    count: u64,
    vocab_size: usize,
}

impl Stream<'_> {
    fn push(&mut self, tokens: &[u32], what: &dyn Fn() -> String) -> Result<(), DataError> {
        if let Some(i) = tokens.iter().position(|&t| t as usize >= self.vocab_size) {
            let index = self.count as usize + i;
            return Err(DataError::TokenOutOfRange { source_desc: what(), index, token: tokens[i], vocab_size: self.vocab_size });
        }
        hash_tokens(&mut self.hasher, tokens);
        self.sink.write(tokens)?;
        self.count += tokens.len() as u64;
        Ok(())
    }
}

/// Feeds `tokens` to `hasher` as u32 little-endian.
pub(super) fn hash_tokens(hasher: &mut blake3::Hasher, tokens: &[u32]) {
    if cfg!(target_endian = "little") {
        hasher.update(bytemuck::cast_slice(tokens));
    } else {
        for piece in tokens.chunks(1 << 14) {
            let bytes: Vec<u8> = piece.iter().flat_map(|t| t.to_le_bytes()).collect();
            hasher.update(&bytes);
        }
    }
}

/// Writes the tokens of `spec`'s inputs to `sink`.
pub(super) fn build(spec: &Spec, sink: &mut dyn Sink) -> Result<Built, DataError> {
    let mut out = Stream { sink, hasher: blake3::Hasher::new(), count: 0, vocab_size: spec.vocab_size };
    let (mut counts, mut docs) = ([0u64; 2], [0u64; 2]);
    for (i, split) in [Split::Train, Split::Val].into_iter().enumerate() {
        let start = out.count;
        docs[i] = match spec.inputs.format {
            Format::Shard => shards(spec, split, &mut out).map(|()| 0)?,
            _ => documents(spec, split, &mut out)?,
        };
        counts[i] = out.count - start;
    }
    if counts[0] == 0 {
        return Err(DataError::Empty { path: spec.inputs.root.clone() });
    }
    let (train, val) = match spec.inputs.has_val_files() {
        true => (counts[0], counts[1]),
        false => {
            // The last ceil(len * frac) tokens (at most len - 1) become validation.
            let total = counts[0];
            let n_val = ((total as f64 * spec.val_fraction).ceil() as u64).min(total - 1);
            (total - n_val, n_val)
        }
    };
    Ok(Built { train, val, docs, blake3: *out.hasher.finalize().as_bytes() })
}

/// Documents of one split; returns how many (empty ones are skipped).
fn documents(spec: &Spec, split: Split, out: &mut Stream<'_>) -> Result<u64, DataError> {
    let mut joiner = Joiner { end_of_text: spec.end_of_text, begin_of_text: spec.begin_of_text, docs: 0, open: false };
    let (mut batch, mut bytes) = (Vec::new(), 0usize);
    for (index, input) in spec.inputs.files.iter().enumerate().filter(|(_, f)| f.split == split) {
        let mut emit = |unit: Unit| {
            bytes += unit.len();
            batch.push(unit);
            if bytes < BATCH_BYTES {
                return Ok(());
            }
            bytes = 0;
            tokenize_batch(spec, &mut batch, &mut joiner, out)
        };
        match spec.inputs.format {
            Format::Text => read_text(&input.path, index, &mut emit),
            Format::Jsonl => read_jsonl(&input.path, index, &mut emit),
            Format::Parquet => read_parquet(&input.path, index, &spec.field, &mut emit),
            Format::Shard => unreachable!("token shards are not documents"),
        }?;
    }
    tokenize_batch(spec, &mut batch, &mut joiner, out)?;
    Ok(joiner.docs)
}

/// Tokenizes `batch` in parallel and appends the tokens in order; empties `batch`.
fn tokenize_batch(spec: &Spec, batch: &mut Vec<Unit>, joiner: &mut Joiner, out: &mut Stream<'_>) -> Result<(), DataError> {
    let path_of = |u: &Unit| &spec.inputs.files[u.origin().file].path;
    let encoded: Vec<Result<Vec<u32>, DataError>> =
        batch.par_iter().map(|u| encode_unit(u, &spec.codec, &spec.field, path_of(u))).collect();
    for (unit, tokens) in batch.iter().zip(encoded) {
        if unit.starts_doc() {
            joiner.open = false;
        }
        joiner.push(&tokens?, out, &|| path_of(unit).display().to_string())?;
    }
    batch.clear();
    Ok(())
}

/// Puts the end-of-text id between documents (not before the first, nor after the last), and
/// the begin-of-text id, when there is one, before every document: `B d1 E B d2 … E B dn`.
struct Joiner {
    end_of_text: Option<u32>,
    begin_of_text: Option<u32>,
    docs: u64,
    /// Whether the current document has tokens yet.
    open: bool,
}

impl Joiner {
    fn push(&mut self, tokens: &[u32], out: &mut Stream<'_>, what: &dyn Fn() -> String) -> Result<(), DataError> {
        if tokens.is_empty() {
            return Ok(());
        }
        if !self.open {
            if let (Some(eot), true) = (self.end_of_text, self.docs > 0) {
                out.push(&[eot], what)?;
            }
            if let Some(bos) = self.begin_of_text {
                out.push(&[bos], what)?;
            }
            self.docs += 1;
            self.open = true;
        }
        out.push(tokens, what)
    }
}

/// Token shards of one split, in name order. Without a tokenizer only byte ids are accepted:
/// a shard's vocabulary is not in the file, and guessing it from the format would size the
/// model silently.
fn shards(spec: &Spec, split: Split, out: &mut Stream<'_>) -> Result<(), DataError> {
    for input in spec.inputs.files.iter().filter(|f| f.split == split) {
        let (tokens, format) = read_bin_shard(&input.path)?;
        if spec.tokenizer.is_none() {
            if let Some(index) = tokens.iter().position(|&t| t as usize >= BYTE_VOCAB_SIZE) {
                return Err(DataError::ShardsNeedTokenizer {
                    path: input.path.clone(),
                    index,
                    token: tokens[index],
                    format: format.name(),
                    natural_vocab: format.natural_vocab_size(),
                });
            }
        }
        out.push(&tokens, &|| format!("token shard {}", input.path.display()))?;
    }
    Ok(())
}
