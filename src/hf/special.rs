//! What a model folder says about tokenizing its training data: its tokenizer, and the special
//! tokens that frame a document — the end-of-sequence token between documents and, where the
//! folder's tokenizer starts every sequence with one, the beginning-of-sequence token before each
//! document. These are the defaults of `tessera.tokenizer`, `tessera.data_eot` and
//! `tessera.data_bos` (`config::sections`); a preset has none.

use std::path::Path;

use serde_json::Value;

use super::{is_folder, CONFIG_FILE, TOKENIZER_FILE};
use crate::checkpoint::TOKENIZER_CONFIG_FILE;

/// `file` of folder `model` as JSON; `None` when it is missing or not JSON (the folder's own
/// checks, and the tokenizer's load, report those).
fn read(model: &str, file: &str) -> Option<Value> {
    std::fs::read(Path::new(model).join(file)).ok().and_then(|b| serde_json::from_slice(&b).ok())
}

/// The content of the added token of `tokenizer` (a `tokenizer.json`) whose id is `config.json`'s
/// `key` (the first, when it is a list).
fn added_token(model: &str, key: &str, tokenizer: &Value) -> Option<String> {
    let config = read(model, CONFIG_FILE)?;
    let id = match &config[key] {
        Value::Array(ids) => ids.first()?.as_u64()?,
        id => id.as_u64()?,
    };
    let added = tokenizer["added_tokens"].as_array()?;
    added.iter().find(|t| t["id"].as_u64() == Some(id)).and_then(|t| t["content"].as_str()).map(str::to_string)
}

/// The end-of-sequence token of model folder `model`, by name: the added token of its
/// `tokenizer.json` whose id is `config.json`'s `eos_token_id` (the first, when it is a list);
/// `None` when `model` is no folder or either file lacks it (what `tessera.data_eot` defaults
/// to, so that the folder's own token separates documents).
pub fn folder_end_of_text(model: &str) -> Option<String> {
    if !is_folder(model) {
        return None;
    }
    added_token(model, "eos_token_id", &read(model, TOKENIZER_FILE)?)
}

/// A token named in `tokenizer_config.json`: a string, or an `AddedToken` object's `content`.
fn token_name(v: &Value) -> Option<String> {
    v.as_str().or_else(|| v["content"].as_str()).map(str::to_string)
}

/// The special token a `tokenizer.json` post-processor puts first in a single sequence: a
/// `TemplateProcessing` whose `single` template starts with a `SpecialToken` (LLaMA 3's
/// `<|begin_of_text|> $A`), also inside a `Sequence` of processors.
fn template_start(post_processor: &Value) -> Option<String> {
    match post_processor["type"].as_str()? {
        "TemplateProcessing" => post_processor["single"].get(0)?["SpecialToken"]["id"].as_str().map(str::to_string),
        "Sequence" => post_processor["processors"].as_array()?.iter().find_map(template_start),
        _ => None,
    }
}

/// The beginning-of-sequence token of model folder `model`, by name, when its tokenizer puts
/// one before every sequence — what `tessera.data_bos` defaults to:
/// - `tokenizer_config.json`'s `add_bos_token`, when it says: `true` → its `bos_token` (else
///   the added token of `config.json`'s `bos_token_id`), `false` → none (transformers' LLaMA
///   and Mistral tokenizers follow this flag);
/// - without that flag, the token `tokenizer.json`'s template post-processor starts a sequence
///   with (LLaMA 3);
/// - none otherwise, and none when it is the end-of-sequence token (GPT-2's `<|endoftext|>` is
///   both; one token between documents is what such models trained on).
pub fn folder_begin_of_text(model: &str) -> Option<String> {
    if !is_folder(model) {
        return None;
    }
    let tokenizer = read(model, TOKENIZER_FILE)?;
    let settings = read(model, TOKENIZER_CONFIG_FILE);
    let bos = match settings.as_ref().and_then(|c| c["add_bos_token"].as_bool()) {
        Some(false) => return None,
        Some(true) => {
            settings.as_ref().and_then(|c| token_name(&c["bos_token"])).or_else(|| added_token(model, "bos_token_id", &tokenizer))?
        }
        None => template_start(&tokenizer["post_processor"])?,
    };
    (folder_end_of_text(model).as_deref() != Some(bos.as_str())).then_some(bos)
}

/// The tokenizer of model folder `model`: its `tokenizer.json`, when `model` is a folder that
/// has one (what `tessera.tokenizer` defaults to).
pub fn folder_tokenizer(model: &str) -> Option<String> {
    let path = Path::new(model).join(TOKENIZER_FILE);
    (is_folder(model) && path.is_file()).then(|| path.display().to_string())
}
