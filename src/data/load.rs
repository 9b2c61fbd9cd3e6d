//! Loading a data path into a [`Dataset`]: find its inputs ([`super::source`]), settle the
//! codec, the end-of-text id and the vocabulary, then take the tokens from the token cache
//! ([`super::cache`]) or tokenize them ([`super::build`]) into it, or into memory.

use std::path::{Path, PathBuf};

use super::build::{build, Built, Spec};
use super::cache::{self, CacheUse};
use super::source::{discover, Format, Inputs, Split};
use super::{Codec, DataError, Dataset, Tokens, DEFAULT_VAL_FRACTION};

/// How to load a data path.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// A Hugging Face `tokenizer.json`; `None` = byte-level.
    pub tokenizer: Option<PathBuf>,
    /// Share of the token stream held out for validation when no file is named as validation.
    pub val_fraction: f64,
    /// The JSON field or Parquet column that holds a document's text.
    pub text_field: String,
    /// The tokenizer's token put between documents; `None` = detected.
    pub end_of_text: Option<String>,
    /// The tokenizer's token put before every document; `None` = none.
    pub begin_of_text: Option<String>,
    /// Folder of the token cache; `None` = tokenize into memory.
    pub cache_dir: Option<PathBuf>,
}

/// Default of [`LoadOptions::text_field`] (what Hugging Face data sets call it).
pub const DEFAULT_TEXT_FIELD: &str = "text";

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            tokenizer: None,
            val_fraction: DEFAULT_VAL_FRACTION,
            text_field: DEFAULT_TEXT_FIELD.into(),
            end_of_text: None,
            begin_of_text: None,
            cache_dir: None,
        }
    }
}

/// Loads `path` into memory, without the token cache; see [`load_with`].
pub fn load(path: &Path, tokenizer: Option<&Path>, val_fraction: f64) -> Result<Dataset, DataError> {
    load_with(path, &LoadOptions { tokenizer: tokenizer.map(Path::to_path_buf), val_fraction, ..LoadOptions::default() })
}

/// Loads `path`: a text file (one document), a JSON-lines or Parquet file (a document per line
/// or row), an llm.c `.bin` shard, or a folder of files of one of these formats.
///
/// Text is tokenized byte-level, or with `opts.tokenizer`. Between documents goes an
/// end-of-text id: byte-level, 256 (so a collection of documents has a vocabulary of 257,
/// while one text file keeps 256); with a tokenizer, its end-of-text token
/// ([`Codec::end_of_text`]), refused if it has none. In a folder, files whose name has the
/// word `val`, `valid` or `validation` are validation, `test` ones are left out, the rest
/// train; with no validation file the last `val_fraction` of the stream is validation.
pub fn load_with(path: &Path, opts: &LoadOptions) -> Result<Dataset, DataError> {
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(DataError::BadArgument { what: "val_fraction", expected: "in [0, 1)", found: opts.val_fraction.to_string() });
    }
    let inputs = discover(path)?;
    let codec = Codec::open(opts.tokenizer.as_deref())?;
    let (end_of_text, begin_of_text, vocab_size) = match inputs.documents {
        true => {
            let (eot, vocab) = codec.end_of_text(opts.end_of_text.as_deref(), opts.tokenizer.as_deref())?;
            (Some(eot), codec.begin_of_text(opts.begin_of_text.as_deref(), opts.tokenizer.as_deref())?, vocab)
        }
        false => (None, None, codec.vocab_size()),
    };
    let spec = Spec {
        inputs,
        codec,
        tokenizer: opts.tokenizer.clone(),
        end_of_text,
        begin_of_text,
        vocab_size,
        field: opts.text_field.clone(),
        val_fraction: opts.val_fraction,
    };
    let (train, val, built, cache) = match &opts.cache_dir {
        None => in_memory(&spec).map(|(t, v, b)| (t, v, b, CacheUse::Off))?,
        Some(dir) => cached(&spec, dir)?,
    };
    let source = describe(&spec, &built, &cache);
    Ok(Dataset { train, val, vocab_size, source, cache, blake3: blake3::Hash::from_bytes(built.blake3) })
}

fn in_memory(spec: &Spec) -> Result<(Tokens, Tokens, Built), DataError> {
    let mut tokens = Vec::new();
    let built = build(spec, &mut tokens)?;
    let val = tokens.split_off(built.train as usize);
    Ok((tokens.into(), val.into(), built))
}

/// The tokens from the cache in `dir`, built into it first when missing or invalid; in memory
/// when the cache cannot be written.
fn cached(spec: &Spec, dir: &Path) -> Result<(Tokens, Tokens, Built, CacheUse), DataError> {
    let key = cache::key(spec)?;
    let path = cache::path_of(dir, &key);
    let stale = match cache::open(&path, &key, spec.vocab_size) {
        Ok(Some((train, val, built))) => return Ok((train, val, built, CacheUse::Hit(path))),
        Ok(None) => None,
        Err(reason) => Some(reason),
    };
    let unavailable = |reason: String| {
        let (train, val, built) = in_memory(spec)?;
        Ok((train, val, built, CacheUse::Unavailable { dir: dir.to_path_buf(), reason }))
    };
    match cache::write(&path, &key, spec) {
        Ok(()) => {}
        Err(DataError::CacheIo { action, err, .. }) => return unavailable(format!("{action} {} failed: {err}", path.display())),
        Err(e) => return Err(e),
    }
    let use_ = match stale {
        None => CacheUse::Built(path.clone()),
        Some(reason) => CacheUse::Rebuilt { path: path.clone(), reason },
    };
    match cache::open(&path, &key, spec.vocab_size) {
        Ok(Some((train, val, built))) => Ok((train, val, built, use_)),
        // Just written: gone or unusable only through another writer's failure, or a machine
        // that cannot map the ids (big-endian).
        Ok(None) => unavailable(format!("{} vanished once written", path.display())),
        Err(reason) => unavailable(format!("{} failed its check once written: {reason}", path.display())),
    }
}

/// `Dataset::source`: the path, format, codec, counts and cache use.
fn describe(spec: &Spec, built: &Built, cache: &CacheUse) -> String {
    let Inputs { root, format, .. } = &spec.inputs;
    let files = match (root.is_dir(), spec.inputs.has_val_files()) {
        (false, _) => String::new(),
        (true, false) => format!("{} files, ", spec.inputs.count(Split::Train)),
        (true, true) => format!("{} train + {} val files, ", spec.inputs.count(Split::Train), spec.inputs.count(Split::Val)),
    };
    let excluded = match (spec.inputs.excluded.len(), spec.inputs.ignored.len()) {
        (0, 0) => String::new(),
        (n, 0) => format!(", {n} test-split file(s) left out"),
        (0, m) => format!(", {m} non-shard file(s) ignored"),
        (n, m) => format!(", {n} test-split file(s) left out, {m} non-shard file(s) ignored"),
    };
    let codec = match (format, spec.end_of_text) {
        (Format::Shard, _) => format!("vocab {}", spec.vocab_size),
        (_, Some(eot)) => {
            let bos = spec.begin_of_text.map_or(String::new(), |bos| format!("begin-of-text {bos}, "));
            format!("{}, {bos}end-of-text {eot}, vocab {}", spec.codec.describe(), spec.vocab_size)
        }
        (_, None) => spec.codec.describe(),
    };
    let docs = match spec.inputs.documents {
        true => format!("{} documents, ", built.docs[0] + built.docs[1]),
        false => String::new(),
    };
    let total = built.train + built.val;
    format!(
        "{} {} ({files}{codec}{excluded}): {docs}{total} tokens, {} train / {} val; {}",
        format.name(),
        root.display(),
        built.train,
        built.val,
        cache.describe()
    )
}
