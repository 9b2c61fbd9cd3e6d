//! Text <-> token conversion: raw bytes (vocab 256) or a Hugging Face
//! `tokenizer.json` loaded through the `tokenizers` crate.

use std::path::Path;

use tokenizers::Tokenizer;

use super::DataError;

/// Size of the byte-level vocabulary.
pub const BYTE_VOCAB_SIZE: usize = 256;

/// Byte-level end-of-text id: one past the bytes, so a collection of documents trained
/// byte-level has a vocabulary of 257 (a single text file keeps 256).
pub const BYTE_END_OF_TEXT: u32 = 256;

/// A tokenizer's end-of-text token is the first of these it has (GPT-2 and most BPEs, Llama 3,
/// SentencePiece models such as Llama 2 and Mistral, Gemma), unless `tessera.data_eot` names one.
pub const END_OF_TEXT_NAMES: &[&str] = &["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// Turns text into token ids and back.
pub enum Codec {
    /// One token per byte.
    Bytes,
    /// A Hugging Face tokenizer (boxed: it is large).
    Hf(Box<Tokenizer>),
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::Bytes => write!(f, "Codec::Bytes"),
            Codec::Hf(t) => write!(f, "Codec::Hf(vocab {})", t.get_vocab_size(true)),
        }
    }
}

/// Decodes byte tokens to text; the end-of-text id becomes `<|endoftext|>`, other ids above
/// 255 and invalid UTF-8 become U+FFFD.
pub fn decode_bytes(tokens: &[u32]) -> String {
    let mut out = String::with_capacity(tokens.len());
    let mut run: Vec<u8> = Vec::new();
    for &t in tokens {
        match u8::try_from(t) {
            Ok(b) => run.push(b),
            Err(_) => {
                out.push_str(&String::from_utf8_lossy(&run));
                run.clear();
                match t {
                    BYTE_END_OF_TEXT => out.push_str(END_OF_TEXT_NAMES[0]),
                    _ => out.push(char::REPLACEMENT_CHARACTER),
                }
            }
        }
    }
    out.push_str(&String::from_utf8_lossy(&run));
    out
}

impl Codec {
    /// `Bytes` when `tokenizer` is `None`, else the tokenizer loaded from that file.
    pub fn open(tokenizer: Option<&Path>) -> Result<Self, DataError> {
        match tokenizer {
            None => Ok(Codec::Bytes),
            Some(path) => Self::from_tokenizer_file(path),
        }
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_tokenizer_file(path: &Path) -> Result<Self, DataError> {
        if !path.exists() {
            return Err(DataError::TokenizerMissing { path: path.to_path_buf() });
        }
        Tokenizer::from_file(path)
            .map(|t| Codec::Hf(Box::new(t)))
            .map_err(|e| DataError::Tokenizer { path: path.to_path_buf(), message: e.to_string() })
    }

    /// Number of distinct token ids (including a tokenizer's added tokens).
    pub fn vocab_size(&self) -> usize {
        match self {
            Codec::Bytes => BYTE_VOCAB_SIZE,
            Codec::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Encodes `text` without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Codec::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Codec::Hf(t) => t
                .encode(text, false)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| DataError::Encode { what: format!("{} bytes of text", text.len()), message: e.to_string() }),
        }
    }

    /// Decodes ids to text, lossily: unknown ids are dropped by the tokenizer, and
    /// if its decoder fails the raw token strings are concatenated instead.
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Codec::Bytes => decode_bytes(tokens),
            Codec::Hf(t) => {
                t.decode(tokens, false).unwrap_or_else(|_| tokens.iter().filter_map(|&id| t.id_to_token(id)).collect::<String>())
            }
        }
    }

    /// The id that separates documents and the vocabulary size that holds it: byte-level,
    /// [`BYTE_END_OF_TEXT`] (vocabulary 257); with a tokenizer, its token `named`, else the
    /// first of [`END_OF_TEXT_NAMES`] it has. `tokenizer` names the file in errors.
    pub fn end_of_text(&self, named: Option<&str>, tokenizer: Option<&Path>) -> Result<(u32, usize), DataError> {
        let path = tokenizer.map(Path::to_path_buf).unwrap_or_default();
        match (self, named) {
            (Codec::Bytes, None) => Ok((BYTE_END_OF_TEXT, BYTE_VOCAB_SIZE + 1)),
            (Codec::Bytes, Some(name)) => Err(DataError::FramingToken {
                path,
                problem: format!("tessera.data_eot = {name:?} names a tokenizer's token, but the data is byte-level (no tokenizer): its end-of-text id is {BYTE_END_OF_TEXT}; unset tessera.data_eot or set tessera.tokenizer"),
            }),
            (Codec::Hf(t), Some(name)) => match t.token_to_id(name) {
                Some(id) => Ok((id, self.vocab_size())),
                None => Err(DataError::FramingToken { path, problem: format!("has no token {name:?} (tessera.data_eot)") }),
            },
            (Codec::Hf(t), None) => match END_OF_TEXT_NAMES.iter().find_map(|n| t.token_to_id(n)) {
                Some(id) => Ok((id, self.vocab_size())),
                None => {
                    let mut special: Vec<String> =
                        t.get_added_tokens_decoder().values().filter(|a| a.special).map(|a| format!("{:?}", a.content)).collect();
                    special.sort();
                    special.truncate(8);
                    let has = match special.is_empty() {
                        true => "it has no special tokens".to_string(),
                        false => format!("its special tokens: {}", special.join(", ")),
                    };
                    Err(DataError::FramingToken {
                        path,
                        problem: format!(
                            "has none of the end-of-text tokens {} to put between documents ({has}); set tessera.data_eot to the token that ends a document",
                            END_OF_TEXT_NAMES.join(", ")
                        ),
                    })
                }
            },
        }
    }

    /// The id put before every document: `None` unless `named` (`tessera.data_bos`, which a
    /// model folder's tokenizer settings default), then that token of the tokenizer, refused
    /// when it lacks it or the data is byte-level. `tokenizer` names the file in errors.
    pub fn begin_of_text(&self, named: Option<&str>, tokenizer: Option<&Path>) -> Result<Option<u32>, DataError> {
        let path = tokenizer.map(Path::to_path_buf).unwrap_or_default();
        match (self, named) {
            (_, None) => Ok(None),
            (Codec::Bytes, Some(name)) => Err(DataError::FramingToken {
                path,
                problem: format!("tessera.data_bos = {name:?} names a tokenizer's token, but the data is byte-level (no tokenizer); unset tessera.data_bos or set tessera.tokenizer"),
            }),
            (Codec::Hf(t), Some(name)) => match t.token_to_id(name) {
                Some(id) => Ok(Some(id)),
                None => Err(DataError::FramingToken { path, problem: format!("has no token {name:?} (tessera.data_bos)") }),
            },
        }
    }

    /// Short description for `Dataset::source`.
    pub fn describe(&self) -> String {
        match self {
            Codec::Bytes => "byte-level".to_string(),
            Codec::Hf(t) => format!("tokenizer.json, vocab {}", t.get_vocab_size(true)),
        }
    }
}

/// What a checkpoint records about the token source: `null` for byte-level text, else the
/// tokenizer file's absolute path and blake3 (so `generate` and `--resume` use the same one).
pub fn tokenizer_record(tokenizer: Option<&Path>) -> Result<serde_json::Value, DataError> {
    let Some(path) = tokenizer else { return Ok(serde_json::Value::Null) };
    let bytes = std::fs::read(path).map_err(|err| match err.kind() {
        std::io::ErrorKind::NotFound => DataError::TokenizerMissing { path: path.to_path_buf() },
        _ => DataError::Io { path: path.to_path_buf(), action: "reading the tokenizer", err },
    })?;
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(serde_json::json!({ "path": abs.display().to_string(), "blake3": blake3::hash(&bytes).to_hex().to_string() }))
}

/// Describes a [`tokenizer_record`] for error messages.
pub fn describe_record(v: &serde_json::Value) -> String {
    match v.get("path").and_then(serde_json::Value::as_str) {
        Some(p) => format!("tokenizer {p}"),
        None => "byte-level tokens (no tokenizer)".to_string(),
    }
}
