//! The tokenizer files of a Hugging Face export (`tokenizer.json`, `tokenizer_config.json`,
//! `special_tokens_map.json`), so that `AutoTokenizer.from_pretrained(export)` gives the ids the
//! model was trained on.
//!
//! A run with a `tokenizer.json` exports that file's bytes. A byte-level run (token `i` is byte
//! `i`, vocabulary 256) exports [`byte_level_tokenizer_json`]: a BPE model without merges whose
//! 256 symbols are the bytes in GPT-2's byte-to-character alphabet (the `ByteLevel`
//! pre-tokenizer turns every byte of the text into one such character, without splitting the
//! text into words; the `ByteLevel` decoder turns them back), the symbol of byte `i` having id
//! `i`. So every text encodes to its UTF-8 bytes, one id per byte, and decodes back.
//!
//! `tokenizer_config.json` names `PreTrainedTokenizerFast` (without it `transformers` would pick
//! the GPT-2 tokenizer class from `config.json` and add its `<|endoftext|>` token to a
//! vocabulary that lacks it) and keeps the text as it decodes
//! (`clean_up_tokenization_spaces: false`). Special tokens are named only when the tokenizer
//! has them: GPT-2's `<|endoftext|>` as an added token becomes bos, eos and unk, as GPT-2's own
//! files say; a byte-level run has none.
//!
//! These two are only written when the run had no settings of its own: a run from a model
//! folder with its own `tokenizer_config.json` / `special_tokens_map.json` (and its chat
//! template) exports those, byte for byte (`hf::companions`, `cli::carry_model_files`).

use super::CheckpointError;

/// File names of the tokenizer part of an export.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const SPECIAL_TOKENS_FILE: &str = "special_tokens_map.json";

/// GPT-2's end-of-text token, named as bos/eos/unk when a tokenizer has it as an added token.
const END_OF_TEXT: &str = "<|endoftext|>";

/// The character GPT-2's byte-level alphabet writes byte `b` as: printable Latin-1 bytes
/// (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves, the other 68 bytes take the code
/// points from U+0100 on, in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + shift).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The `tokenizer.json` of byte-level tokens (see the module's documentation).
pub fn byte_level_tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8).map(|b| (byte_char(b).to_string(), b.into())).collect();
    let byte_level = serde_json::json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false });
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    })
}

/// The three tokenizer files of an export, as (name, bytes): `tokenizer_json` is the run's
/// `tokenizer.json` bytes, or `None` for a byte-level run; `model_max_length` is the model's
/// context.
pub fn tokenizer_files(tokenizer_json: Option<&[u8]>, model_max_length: usize) -> Result<Vec<(&'static str, Vec<u8>)>, CheckpointError> {
    let encode = |what: &str, v: &serde_json::Value| {
        serde_json::to_vec_pretty(v).map_err(|e| CheckpointError::Export(format!("cannot encode {what}: {e}")))
    };
    let (tokenizer, specials) = match tokenizer_json {
        Some(bytes) => {
            let doc: serde_json::Value = serde_json::from_slice(bytes)
                .map_err(|e| CheckpointError::Export(format!("the run's {TOKENIZER_FILE} is not JSON: {e}")))?;
            let has_eot = doc["added_tokens"].as_array().is_some_and(|a| a.iter().any(|t| t["content"] == END_OF_TEXT));
            (bytes.to_vec(), has_eot)
        }
        None => (encode(TOKENIZER_FILE, &byte_level_tokenizer_json())?, false),
    };
    let mut config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": false,
    });
    let mut map = serde_json::json!({});
    if specials {
        for key in ["bos_token", "eos_token", "unk_token"] {
            config[key] = END_OF_TEXT.into();
            map[key] = END_OF_TEXT.into();
        }
    }
    Ok(vec![
        (TOKENIZER_FILE, tokenizer),
        (TOKENIZER_CONFIG_FILE, encode(TOKENIZER_CONFIG_FILE, &config)?),
        (SPECIAL_TOKENS_FILE, encode(SPECIAL_TOKENS_FILE, &map)?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_is_a_bijection_onto_gpt2s_characters() {
        let chars: std::collections::BTreeSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_char(b'A'), 'A');
        assert_eq!(byte_char(b' '), 'Ġ', "GPT-2 writes the space as U+0120");
        assert_eq!(byte_char(b'\n'), 'Ċ', "GPT-2 writes the newline as U+010A");
        assert_eq!(byte_char(0), '\u{100}');
    }

    #[test]
    fn the_byte_level_tokenizer_gives_the_bytes_as_ids_and_decodes_back() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(TOKENIZER_FILE);
        std::fs::write(&path, serde_json::to_vec(&byte_level_tokenizer_json()).unwrap()).unwrap();
        let codec = crate::data::Codec::from_tokenizer_file(&path).unwrap();
        assert_eq!(codec.vocab_size(), 256);
        let text = "Emma Woodhouse, handsome,\tclever 'n rich — café ☕ 😀\r\n  end";
        let ids = codec.encode(text).unwrap();
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>(), "one id per byte, the byte's value");
        assert_eq!(codec.decode(&ids), text);
    }
}
