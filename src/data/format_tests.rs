//! Tests of the input formats: JSON lines, Parquet (written here with the crate's writer, and
//! the pyarrow fixtures of `scripts/make_parquet_fixtures.py`), folders in the Hugging Face
//! layout, the end-of-text token, and the refusal of what Tessera cannot read.

use std::path::Path;
use std::sync::Arc;

use ::parquet::basic::{Compression, ZstdLevel};
use ::parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use ::parquet::file::properties::WriterProperties;
use ::parquet::file::writer::SerializedFileWriter;
use ::parquet::schema::parser::parse_message_type;

use super::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn write(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create folder");
    }
    std::fs::write(path, bytes).expect("write test file");
}

/// Byte-level tokens of `docs` joined by the byte-level end-of-text id.
fn byte_docs(docs: &[&str]) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.push(BYTE_END_OF_TEXT);
        }
        out.extend(d.bytes().map(u32::from));
    }
    out
}

fn all(ds: &Dataset) -> Vec<u32> {
    [&ds.train[..], &ds.val[..]].concat()
}

/// The tiny BPE of `tests/fixtures`, with `<|endoftext|>` added as id 15 when `eot`.
fn tiny_bpe(dir: &Path, eot: bool) -> std::path::PathBuf {
    let mut json: serde_json::Value = serde_json::from_str(include_str!("../../tests/fixtures/tiny_bpe.json")).expect("fixture");
    if eot {
        json["added_tokens"] = serde_json::json!([{
            "id": 15, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true
        }]);
    }
    let path = dir.join(if eot { "tokenizer-eot.json" } else { "tokenizer.json" });
    write(&path, json.to_string().as_bytes());
    path
}

/// A Parquet file with a nullable string column `text` and an `id` column, `rows_per_group`
/// rows a row group.
fn write_parquet(path: &Path, rows: &[Option<&str>], compression: Compression, rows_per_group: usize) {
    let schema = Arc::new(parse_message_type("message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }").expect("schema"));
    let props = Arc::new(WriterProperties::builder().set_compression(compression).build());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create folder");
    }
    let file = std::fs::File::create(path).expect("create parquet");
    let mut writer = SerializedFileWriter::new(file, schema, props).expect("writer");
    for (g, group) in rows.chunks(rows_per_group).enumerate() {
        let mut rg = writer.next_row_group().expect("row group");
        let mut col = rg.next_column().expect("id").expect("id column");
        let ids: Vec<i64> = (0..group.len() as i64).map(|i| (g * rows_per_group) as i64 + i).collect();
        col.typed::<Int64Type>().write_batch(&ids, None, None).expect("ids");
        col.close().expect("close id");
        let mut col = rg.next_column().expect("text").expect("text column");
        let values: Vec<ByteArray> = group.iter().flatten().map(|s| ByteArray::from(*s)).collect();
        let levels: Vec<i16> = group.iter().map(|r| i16::from(r.is_some())).collect();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&levels), None).expect("texts");
        col.close().expect("close text");
        rg.close().expect("close row group");
    }
    writer.close().expect("close parquet");
}

#[test]
fn jsonl_documents_are_their_text_field_joined_by_end_of_text() {
    let dir = tmp();
    let path = dir.path().join("corpus.jsonl");
    let lines = [
        r#"{"text": "Hello \"world\"\n", "id": 1}"#,
        "",
        r#"{"id": 2, "text": "caf\u00e9"}"#,
        r#"{"text": null}"#,
        r#"{"text": ""}"#,
        "   ",
        r#"{"text": "third", "meta": {"x": [1, 2]}}"#,
    ];
    write(&path, lines.join("\n").as_bytes());
    let ds = load(&path, None, 0.0).expect("load jsonl");
    // The strings' characters, not the JSON's quotes and escapes; null, "" and blank lines are no documents.
    assert_eq!(all(&ds), byte_docs(&["Hello \"world\"\n", "café", "third"]));
    assert_eq!(ds.vocab_size, 257);
    assert!(ds.source.starts_with("jsonl ") && ds.source.contains("3 documents"), "{}", ds.source);

    // Another field, by option.
    write(&path, b"{\"content\": \"ab\"}\n{\"content\": \"cd\"}\n");
    let opts = LoadOptions { text_field: "content".into(), val_fraction: 0.0, ..LoadOptions::default() };
    assert_eq!(all(&load_with(&path, &opts).expect("content field")), byte_docs(&["ab", "cd"]));
}

#[test]
fn jsonl_errors_name_the_file_line_and_field() {
    let dir = tmp();
    let path = dir.path().join("bad.jsonl");
    let cases: [(&str, &[&str]); 4] = [
        (
            "{\"text\": \"a\"}\n{\"body\": \"b\", \"id\": 3}\n",
            &["bad.jsonl", "line 2", "no field `text`", "body, id", "tessera.data_field"],
        ),
        ("{\"text\": \"a\"}\n\n[1, 2]\n", &["line 3", "expected a JSON object, found an array"]),
        ("{\"text\": 5}\n", &["line 1", "field `text` is a number, not a string"]),
        ("{\"text\": \"a\"\n", &["line 1", "not JSON"]),
    ];
    for (content, wanted) in cases {
        write(&path, content.as_bytes());
        let msg = load(&path, None, 0.0).expect_err(content).to_string();
        for w in wanted {
            assert!(msg.contains(w), "{content:?}: {msg:?} lacks {w:?}");
        }
    }
}

#[test]
fn documents_with_a_tokenizer_use_its_end_of_text_token() {
    let dir = tmp();
    let path = dir.path().join("c.jsonl");
    write(&path, b"{\"text\": \"hello world\"}\n{\"text\": \"hello\"}\n");
    let tok = tiny_bpe(dir.path(), true);
    let opts = LoadOptions { tokenizer: Some(tok.clone()), val_fraction: 0.0, ..LoadOptions::default() };
    let ds = load_with(&path, &opts).expect("load with tokenizer");
    assert_eq!(all(&ds), vec![12, 14, 6, 2, 7, 15, 12]);
    assert_eq!(ds.vocab_size, 16);

    // A tokenizer without one is refused for documents (not for one text file), unless named.
    let plain = tiny_bpe(dir.path(), false);
    let opts = LoadOptions { tokenizer: Some(plain.clone()), val_fraction: 0.0, ..LoadOptions::default() };
    let msg = load_with(&path, &opts).expect_err("no end-of-text").to_string();
    assert!(msg.contains("tokenizer.json") && msg.contains("<|endoftext|>") && msg.contains("tessera.data_eot"), "{msg}");
    let named = LoadOptions { end_of_text: Some("hello".into()), ..opts.clone() };
    assert_eq!(all(&load_with(&path, &named).expect("named end-of-text")), vec![12, 14, 6, 2, 7, 12, 12]);
    let missing = LoadOptions { end_of_text: Some("<eot>".into()), ..opts };
    let msg = load_with(&path, &missing).expect_err("absent token").to_string();
    assert!(msg.contains("has no token \"<eot>\""), "{msg}");
    let text = dir.path().join("one.txt");
    write(&text, b"hello world");
    assert_eq!(load(&text, Some(&plain), 0.0).expect("one text file").vocab_size, 15);
    let bytes_named = LoadOptions { end_of_text: Some("<|endoftext|>".into()), ..LoadOptions::default() };
    let msg = load_with(&path, &bytes_named).expect_err("byte-level has no named token").to_string();
    assert!(msg.contains("byte-level") && msg.contains("256"), "{msg}");
}

/// `tessera.data_bos`: its token opens every document, after the end-of-text token between
/// them; it keys the token cache apart; a byte-level run or a tokenizer without it is refused.
#[test]
fn a_begin_of_text_token_opens_every_document() {
    let dir = tmp();
    let path = dir.path().join("c.jsonl");
    write(&path, b"{\"text\": \"hello world\"}\n{\"text\": \"\"}\n{\"text\": \"hello\"}\n");
    let tok = tiny_bpe(dir.path(), true);
    let cache = dir.path().join("cache");
    let plain = LoadOptions { tokenizer: Some(tok.clone()), val_fraction: 0.0, cache_dir: Some(cache.clone()), ..LoadOptions::default() };
    let framed = LoadOptions { begin_of_text: Some("hello".into()), ..plain.clone() };
    let ds = load_with(&path, &framed).expect("load with a begin-of-text token");
    assert_eq!(all(&ds), vec![12, 12, 14, 6, 2, 7, 15, 12, 12], "B d1 E B d2, the empty document skipped");
    assert!(ds.source.contains("begin-of-text 12, end-of-text 15"), "{}", ds.source);
    let without = load_with(&path, &plain).expect("load without");
    assert_eq!(all(&without), vec![12, 14, 6, 2, 7, 15, 12]);
    assert_eq!(std::fs::read_dir(&cache).expect("cache folder").count(), 2, "the begin-of-text token keys its own cache file");
    assert_eq!(all(&load_with(&path, &framed).expect("from the cache")), all(&ds));

    let missing = LoadOptions { begin_of_text: Some("<s>".into()), ..plain };
    let msg = load_with(&path, &missing).expect_err("absent token").to_string();
    assert!(msg.contains(&format!("tokenizer {}: has no token \"<s>\" (tessera.data_bos)", tok.display())), "{msg}");
    let bytes = LoadOptions { begin_of_text: Some("<s>".into()), ..LoadOptions::default() };
    let msg = load_with(&path, &bytes).expect_err("byte-level has no named token").to_string();
    assert!(msg.contains("tessera.data_bos") && msg.contains("byte-level"), "{msg}");
}

#[test]
fn parquet_rows_are_documents_in_every_codec() {
    let dir = tmp();
    let rows = [Some("Hello \"world\"\n"), None, Some("Second doc: café"), Some(""), Some("third")];
    let want = byte_docs(&["Hello \"world\"\n", "Second doc: café", "third"]);
    for (name, codec) in
        [("plain", Compression::UNCOMPRESSED), ("snappy", Compression::SNAPPY), ("zstd", Compression::ZSTD(ZstdLevel::default()))]
    {
        let path = dir.path().join(format!("{name}.parquet"));
        write_parquet(&path, &rows, codec, 2);
        let ds = load(&path, None, 0.0).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(all(&ds), want, "{name}");
        assert_eq!(ds.vocab_size, 257);
        assert!(ds.source.contains("3 documents"), "{}", ds.source);
    }
    // A column that is not there, or not strings, is named with the file.
    let path = dir.path().join("snappy.parquet");
    let opts = LoadOptions { text_field: "body".into(), ..LoadOptions::default() };
    let msg = load_with(&path, &opts).expect_err("no column").to_string();
    assert!(msg.contains("snappy.parquet") && msg.contains("no column `body`") && msg.contains("id, text"), "{msg}");
    let opts = LoadOptions { text_field: "id".into(), ..LoadOptions::default() };
    let msg = load_with(&path, &opts).expect_err("ints").to_string();
    assert!(msg.contains("column `id` holds INT64") && msg.contains("not strings"), "{msg}");
}

/// Files written by pyarrow as Hugging Face `datasets` writes them (scripts/make_parquet_fixtures.py).
#[test]
fn pyarrow_parquet_fixtures_load() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let want = byte_docs(&["Hello \"world\"\n", "Second doc: café", "third"]);
    for codec in ["snappy", "zstd"] {
        let ds = load(&fixtures.join(format!("hf_tiny_{codec}.parquet")), None, 0.0).unwrap_or_else(|e| panic!("{codec}: {e}"));
        assert_eq!(all(&ds), want, "{codec}");
    }
    let msg = load(&fixtures.join("hf_tiny_gzip.parquet"), None, 0.0).expect_err("gzip is not built in").to_string();
    assert!(msg.contains("hf_tiny_gzip.parquet") && msg.to_ascii_lowercase().contains("gzip"), "{msg}");
}

/// A Hugging Face snapshot: `data/{split}-0000N-of-0000M.parquet` beside a README; the
/// validation file is validation, the test file is left out.
#[test]
fn hugging_face_folder_layout_loads_by_split() {
    let dir = tmp();
    let root = dir.path();
    write(&root.join("README.md"), b"---\nlicense: mit\n---\n");
    write(&root.join(".gitattributes"), b"*.parquet filter=lfs");
    write_parquet(&root.join("data/train-00001-of-00002.parquet"), &[Some("c"), Some("d")], Compression::SNAPPY, 8);
    write_parquet(&root.join("data/train-00000-of-00002.parquet"), &[Some("a"), Some("b")], Compression::SNAPPY, 8);
    write_parquet(&root.join("data/validation-00000-of-00001.parquet"), &[Some("v1"), Some("v2")], Compression::SNAPPY, 8);
    write_parquet(&root.join("data/test-00000-of-00001.parquet"), &[Some("TEST")], Compression::SNAPPY, 8);
    let ds = load(root, None, 0.5).expect("load snapshot");
    assert_eq!(&ds.train[..], &byte_docs(&["a", "b", "c", "d"])[..]);
    assert_eq!(&ds.val[..], &byte_docs(&["v1", "v2"])[..]);
    assert!(ds.source.contains("2 train + 1 val files") && ds.source.contains("1 test-split file(s) left out"), "{}", ds.source);

    // The same for a folder of JSON lines, without a validation file: the tail is validation.
    let jsonl = tmp();
    write(&jsonl.path().join("part-b.jsonl"), b"{\"text\": \"cd\"}\n");
    write(&jsonl.path().join("part-a.jsonl"), b"{\"text\": \"ab\"}\n");
    let ds = load(jsonl.path(), None, 0.2).expect("jsonl folder");
    assert_eq!(all(&ds), byte_docs(&["ab", "cd"]));
    assert_eq!(ds.val.len(), 1);
}

#[test]
fn unknown_and_binary_formats_are_refused_by_name() {
    let dir = tmp();
    let png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR";
    let parquet = {
        let p = dir.path().join("real.parquet");
        write_parquet(&p, &[Some("x")], Compression::SNAPPY, 8);
        std::fs::read(&p).expect("read")
    };
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("image.png", png.to_vec(), &["image.png", "unknown data format `.png`"]),
        ("image.txt", png.to_vec(), &["image.txt", "named as text but is a PNG image"]),
        ("data.txt", parquet.clone(), &["data.txt", "is a Parquet file"]),
        ("corpus.txt.gz", vec![0x1f, 0x8b, 8, 0], &["unknown data format `.gz`"]),
        ("nul.txt", b"abc\0def".to_vec(), &["nul.txt", "NUL byte at byte 3", "binary"]),
        ("fake.parquet", b"just text".to_vec(), &["fake.parquet", "PAR1"]),
        ("docs.json", b"[{\"text\": \"a\"}]".to_vec(), &["docs.json", ".jsonl"]),
        ("zipped.jsonl", b"PK\x03\x04....".to_vec(), &["zipped.jsonl", "zip archive"]),
    ];
    for (name, bytes, wanted) in cases {
        let path = dir.path().join(name);
        write(&path, &bytes);
        let msg = load(&path, None, 0.0).expect_err(name).to_string();
        for w in wanted.iter().chain(&["Tessera reads"]) {
            assert!(msg.contains(w), "{name}: {msg:?} lacks {w:?}");
        }
    }
    // A folder of two formats is refused, naming both.
    let mixed = tmp();
    write(&mixed.path().join("a.txt"), b"text");
    write(&mixed.path().join("b.jsonl"), b"{\"text\": \"x\"}\n");
    let msg = load(mixed.path(), None, 0.0).expect_err("mixed").to_string();
    assert!(msg.contains("mixes data formats") && msg.contains("a.txt") && msg.contains("b.jsonl"), "{msg}");
    let msg = load(Path::new("/dev/null"), None, 0.0).expect_err("a device").to_string();
    assert!(msg.contains("/dev/null") && msg.contains("neither a file nor a folder"), "{msg}");
}
