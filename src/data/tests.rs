//! Unit tests of the data layer (fast: small temp files plus one pass over the shipped corpus).

use std::collections::BTreeSet;
use std::path::Path;

use super::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write test file");
}

/// Away from the source tree the compiled-in corpus is written out once, byte for byte.
#[test]
fn the_compiled_in_corpus_is_the_shipped_file() {
    let dir = tmp();
    let path = super::embedded_corpus_in(dir.path()).expect("write the corpus");
    let shipped = std::fs::read(default_corpus_path()).expect("the source tree's corpus");
    assert_eq!(std::fs::read(&path).expect("read it back"), shipped);
    assert_eq!(super::embedded_corpus_in(dir.path()).expect("again"), path, "written once, then reused");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
}

#[test]
fn shipped_corpus_loads_byte_level() {
    let path = default_corpus_path();
    let ds = load(&path, None, DEFAULT_VAL_FRACTION).expect("load shipped corpus");
    let total = ds.train.len() + ds.val.len();
    let on_disk = std::fs::metadata(&path).expect("stat corpus").len() as usize;
    assert_eq!(total, on_disk);
    assert!(total >= 1_000_000, "corpus has only {total} bytes");
    assert_eq!(ds.vocab_size, 256);
    assert_eq!(ds.val.len(), (total as f64 * 0.05).ceil() as usize);
    let head: Vec<u8> = ds.train[..21].iter().map(|&t| t as u8).collect();
    assert_eq!(head, b"SENSE AND SENSIBILITY");
    assert!(ds.source.contains("byte-level"), "{}", ds.source);
}

#[test]
fn text_split_takes_the_tail() {
    let dir = tmp();
    let path = dir.path().join("t.txt");
    write(&path, b"abcdefghij");
    let ds = load(&path, None, 0.25).expect("load");
    assert_eq!(decode_bytes(&ds.train), "abcdefg");
    assert_eq!(decode_bytes(&ds.val), "hij");
    let err = load(&path, None, 1.0).expect_err("fraction 1 rejected");
    assert!(err.to_string().contains("val_fraction"), "{err}");
}

#[test]
fn bin_shard_round_trip() {
    let dir = tmp();
    let path = dir.path().join("x.bin");
    let tokens = vec![0, 1, 255, 256, 50256, 65535];
    write_bin_shard(&path, &tokens).expect("write");
    let bytes = std::fs::read(&path).expect("read");
    assert_eq!(bytes.len(), 1024 + 2 * tokens.len());
    assert_eq!(&bytes[..4], &20240520i32.to_le_bytes());
    let (back, format) = read_bin_shard(&path).expect("read shard");
    assert_eq!(back, tokens);
    assert_eq!(format, ShardFormat::Gpt2U16);
    // 256 is not a byte, and no tokenizer says the vocabulary: refused, naming what a guess would be.
    let err = load(&path, None, 0.0).expect_err("no tokenizer");
    let msg = err.to_string();
    assert!(matches!(err, DataError::ShardsNeedTokenizer { natural_vocab: 50257, .. }), "{msg}");
    assert!(msg.contains("token 256 at index 3") && msg.contains("50257") && msg.contains("--tokenizer"), "{msg}");
}

#[test]
fn bin_single_file_split_and_vocab() {
    let dir = tmp();
    let path = dir.path().join("tok.bin");
    let bytes: Vec<u32> = (0..100).map(|i| i % 200).collect();
    write_bin_shard(&path, &bytes).expect("write");
    let ds = load(&path, None, 0.1).expect("load");
    assert_eq!((ds.train.len(), ds.val.len(), ds.vocab_size), (90, 10, 256));
    assert_eq!(&ds.val[..], &bytes[90..]);
    // Ids beyond a byte need the tokenizer they came from: its vocabulary is the model's.
    write_bin_shard(&path, &[5, 14, 7]).expect("write");
    let tok = dir.path().join("tokenizer.json");
    write(&tok, TINY_BPE.as_bytes());
    let ds = load(&path, Some(&tok), 0.0).expect("load with tokenizer");
    assert_eq!((&ds.train[..], ds.vocab_size), (&[5, 14, 7][..], 15));
    write_bin_shard(&path, &[5, 1000, 7]).expect("write");
    let msg = load(&path, Some(&tok), 0.0).expect_err("beyond the tokenizer").to_string();
    assert!(msg.contains("token 1000 at index 1") && msg.contains("vocabulary size 15"), "{msg}");
    let msg = load(&path, None, 0.0).expect_err("no tokenizer").to_string();
    assert!(msg.contains("token 1000 at index 1") && msg.contains("GPT-2 (u16)") && msg.contains("does not guess"), "{msg}");
}

#[test]
fn bin_writer_rejects_wide_tokens() {
    let dir = tmp();
    let err = write_bin_shard(&dir.path().join("w.bin"), &[1, 65536]).expect_err("too wide");
    let msg = err.to_string();
    assert!(msg.contains("65536") && msg.contains("index 1"), "{msg}");
}

#[test]
fn bin_bad_magic_version_and_size() {
    let dir = tmp();
    let path = dir.path().join("bad.bin");
    write_bin_shard(&path, &[1, 2, 3]).expect("write");
    let good = std::fs::read(&path).expect("read");

    let mut bytes = good.clone();
    bytes[..4].copy_from_slice(&12345i32.to_le_bytes());
    write(&path, &bytes);
    let msg = read_bin_shard(&path).expect_err("bad magic").to_string();
    assert!(msg.contains("bad magic") && msg.contains("20240520") && msg.contains("found 12345"), "{msg}");
    assert!(msg.contains("bad.bin"), "{msg}");

    let mut bytes = good.clone();
    bytes[4..8].copy_from_slice(&2i32.to_le_bytes());
    write(&path, &bytes);
    let msg = read_bin_shard(&path).expect_err("bad version").to_string();
    assert!(msg.contains("bad version: expected 1, found 2"), "{msg}");

    write(&path, &good[..good.len() - 1]);
    let msg = load(&path, None, 0.0).expect_err("truncated").to_string();
    assert!(msg.contains("expected 1030 bytes") && msg.contains("found 1029 bytes"), "{msg}");

    write(&path, &good[..100]);
    let msg = read_bin_shard(&path).expect_err("no header").to_string();
    assert!(msg.contains("expected 1024 bytes") && msg.contains("found 100 bytes"), "{msg}");
}

#[test]
fn shard_directory_uses_names() {
    let dir = tmp();
    write_bin_shard(&dir.path().join("data_train_001.bin"), &[3, 4]).expect("w");
    write_bin_shard(&dir.path().join("data_train_000.bin"), &[1, 2]).expect("w");
    write_bin_shard(&dir.path().join("data_val_000.bin"), &[9, 8, 7]).expect("w");
    write(&dir.path().join("README.md"), b"not data");
    // llm.c keeps the text its shards were made from beside them: the shards win, and it is said.
    write(&dir.path().join("tiny_shakespeare.txt"), b"the source text");
    let ds = load(dir.path(), None, 0.5).expect("load dir");
    assert_eq!(&ds.train[..], &[1, 2, 3, 4]);
    assert_eq!(&ds.val[..], &[9, 8, 7]);
    assert_eq!(ds.vocab_size, 256);
    assert!(ds.source.contains("1 non-shard file(s) ignored"), "{}", ds.source);
}

/// A folder of text files is a collection of documents: end-of-text (256) between them.
#[test]
fn text_directory_puts_end_of_text_between_files() {
    let dir = tmp();
    write(&dir.path().join("b.txt"), b"world");
    write(&dir.path().join("a.txt"), b"hello");
    write(&dir.path().join("LICENSE"), b"ignored");
    write(&dir.path().join("README.md"), b"ignored");
    let ds = load(dir.path(), None, 0.0).expect("load dir");
    assert_eq!(decode_bytes(&ds.train), "hello<|endoftext|>world");
    assert_eq!(ds.train[5], BYTE_END_OF_TEXT);
    assert_eq!((ds.train.len(), ds.vocab_size), (11, 257));
    assert!(ds.source.contains("2 documents"), "{}", ds.source);
    let empty = tmp();
    let msg = load(empty.path(), None, 0.0).expect_err("empty dir").to_string();
    assert!(msg.contains("holds no data files") && msg.contains(".jsonl"), "{msg}");
}

/// A tiny byte-level BPE: "hello" is one token, " wo" merges, the rest are bytes.
const TINY_BPE: &str = include_str!("../../tests/fixtures/tiny_bpe.json");

#[test]
fn tokenizer_json_round_trip() {
    let dir = tmp();
    let tok = dir.path().join("tokenizer.json");
    write(&tok, TINY_BPE.as_bytes());
    let codec = Codec::open(Some(&tok)).expect("load tokenizer");
    assert_eq!(codec.vocab_size(), 15);
    let ids = codec.encode("hello world").expect("encode");
    assert_eq!(ids, vec![12, 14, 6, 2, 7]);
    assert_eq!(codec.decode(&ids), "hello world");

    let text = dir.path().join("c.txt");
    write(&text, b"hello world\nhello hello");
    let ds = load(&text, Some(&tok), 0.0).expect("load with tokenizer");
    assert_eq!(ds.vocab_size, 15);
    assert_eq!(codec.decode(&ds.train), "hello world\nhello hello");
}

#[test]
fn tokenizer_errors_name_the_file() {
    let dir = tmp();
    let tok = dir.path().join("broken.json");
    write(&tok, b"{\"model\": 5}");
    let msg = Codec::open(Some(&tok)).expect_err("broken").to_string();
    assert!(msg.contains("broken.json") && msg.contains("failed to load"), "{msg}");
    let text = dir.path().join("c.txt");
    write(&text, b"abc");
    assert!(matches!(load(&text, Some(&tok), 0.0), Err(DataError::Tokenizer { .. })));
}

/// Pieces cut by `next_cut` on the whole text, as a text file is read.
fn pieces(text: &str, target: usize) -> Vec<(usize, &str)> {
    let (mut out, mut start) = (Vec::new(), 0);
    while let Some(len) = super::docs::next_cut(&text.as_bytes()[start..], target, true).filter(|&n| n > 0) {
        out.push((start, &text[start..start + len]));
        start += len;
    }
    out
}

#[test]
fn encode_chunks_cut_only_before_words() {
    let text = "one two\n three\nfour\n\nfive six\nseven";
    let pieces = pieces(text, 3);
    let joined: String = pieces.iter().map(|(_, p)| *p).collect();
    assert_eq!(joined, text);
    for (start, piece) in &pieces[1..] {
        assert!(text[..*start].ends_with('\n'), "cut at {start}");
        assert!(!piece.starts_with(char::is_whitespace), "piece {piece:?}");
    }
    assert_eq!(pieces.len(), 4);
}

/// A text file read a block at a time is cut where the whole text would be: a cut found in a
/// prefix (more input to come) is the whole text's cut, so the tokens do not depend on how
/// the file was read.
#[test]
fn cuts_do_not_depend_on_how_much_was_read() {
    let text = "ab\ncd\n  ef\n\u{e9}g\nhi jk\nl\n\nmn\n".repeat(3);
    let bytes = text.as_bytes();
    for target in [1, 2, 5, 9] {
        let whole = super::docs::next_cut(bytes, target, true);
        for len in 0..bytes.len() {
            if let Some(cut) = super::docs::next_cut(&bytes[..len], target, false) {
                assert_eq!(Some(cut), whole, "target {target}, prefix {len}");
            }
        }
    }
}

#[test]
fn decode_bytes_is_lossy() {
    assert_eq!(decode_bytes(&[72, 105, 300, 0xE2, 0x82, 0xAC]), "Hi\u{FFFD}€");
    assert_eq!(decode_bytes(&[0xFF]), "\u{FFFD}");
}

fn counting(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn draw(s: &Sampler, first: u64, count: usize) -> (Vec<u32>, Vec<u32>) {
    let t = s.seq_len();
    let (mut x, mut y) = (vec![0; count * t], vec![0; count * t]);
    s.fill(first, count, &mut x, &mut y);
    (x, y)
}

#[test]
fn sampler_targets_are_shifted_inputs() {
    let s = Sampler::new(counting(101), 10, 7).expect("sampler");
    assert_eq!(s.windows(), 10);
    let (x, y) = draw(&s, 0, 10);
    for row in 0..10 {
        let xs = &x[row * 10..(row + 1) * 10];
        let ys = &y[row * 10..(row + 1) * 10];
        assert_eq!(xs[0] % 10, 0, "window starts at a multiple of T");
        assert!(xs.iter().zip(ys).all(|(a, b)| *b == a + 1));
    }
}

#[test]
fn sampler_visits_every_window_once_per_epoch() {
    let s = Sampler::new(counting(1000), 7, 3).expect("sampler");
    let w = s.windows();
    assert_eq!(w, 142);
    let order = |epoch: u64| -> Vec<usize> { (0..w).map(|i| s.window_start(epoch * w + i)).collect() };
    let (e0, e1) = (order(0), order(1));
    let all: BTreeSet<usize> = (0..w as usize).map(|k| k * 7).collect();
    assert_eq!(e0.iter().copied().collect::<BTreeSet<_>>(), all);
    assert_eq!(e1.iter().copied().collect::<BTreeSet<_>>(), all);
    assert_eq!(e0.len(), all.len());
    assert_ne!(e0, e1, "each epoch is reshuffled");
    assert_ne!(e0, all.iter().copied().collect::<Vec<_>>(), "epoch 0 is shuffled");
}

#[test]
fn sampler_is_deterministic_and_world_size_independent() {
    let a = Sampler::new(counting(5000), 16, 42).expect("a");
    let b = Sampler::new(counting(5000), 16, 42).expect("b");
    let c = Sampler::new(counting(5000), 16, 43).expect("c");
    let whole = draw(&a, 300, 8);
    assert_eq!(whole, draw(&b, 300, 8));
    assert_ne!(whole.0, draw(&c, 300, 8).0);
    // Two "ranks" each filling half of the global batch see the same samples.
    let rank0 = draw(&b, 300, 4);
    let rank1 = draw(&Sampler::new(counting(5000), 16, 42).expect("r1"), 304, 4);
    assert_eq!([rank0.0, rank1.0].concat(), whole.0);
    assert_eq!([rank0.1, rank1.1].concat(), whole.1);
    // Crossing an epoch boundary matches sample-by-sample draws in any order.
    let w = a.windows();
    let across = draw(&a, w - 2, 4).0;
    for row in (0..4).rev() {
        let single = draw(&b, 2 * w + 5, 1).0;
        assert_eq!(single, draw(&a, 2 * w + 5, 1).0);
        assert_eq!(across[row * 16..(row + 1) * 16], draw(&b, w - 2 + row as u64, 1).0[..]);
    }
}

#[test]
fn sampler_resumes_from_saved_state() {
    let tokens = counting(3000);
    let mut full = Sampler::new(tokens.clone(), 8, 9).expect("full");
    let mut batches = Vec::new();
    for _ in 0..100 {
        let (mut x, mut y) = (vec![0; 32], vec![0; 32]);
        full.next_batch(4, &mut x, &mut y);
        batches.push((x, y));
    }
    assert_eq!(full.cursor(), 400);
    assert!(full.epoch() >= 1, "run crosses an epoch");

    let mut first = Sampler::new(tokens.clone(), 8, 9).expect("first");
    for _ in 0..37 {
        let (mut x, mut y) = (vec![0; 32], vec![0; 32]);
        first.next_batch(4, &mut x, &mut y);
    }
    let saved = first.state().to_json().to_string();
    let value: serde_json::Value = serde_json::from_str(&saved).expect("json");
    let state = SamplerState::from_json(&value).expect("state");
    assert_eq!(state, SamplerState { seed: 9, cursor: 148 });
    let mut resumed = Sampler::resume(tokens, 8, state).expect("resume");
    for expected in &batches[37..] {
        let (mut x, mut y) = (vec![0; 32], vec![0; 32]);
        resumed.next_batch(4, &mut x, &mut y);
        assert_eq!(&(x, y), expected);
    }
}

#[test]
fn sampler_state_errors_name_the_key() {
    let msg = SamplerState::from_json(&serde_json::json!({"seed": 1, "cursor": -3})).expect_err("negative").to_string();
    assert!(msg.contains("`cursor`") && msg.contains("-3"), "{msg}");
    let msg = SamplerState::from_json(&serde_json::json!({"cursor": 3})).expect_err("missing").to_string();
    assert!(msg.contains("`seed`") && msg.contains("missing"), "{msg}");
}

#[test]
fn val_batches_are_evenly_spaced() {
    let val = counting(1000);
    let batches: Vec<TokenBatch> = val_batches(val.clone(), 10, 2, 3).expect("val").iter().collect();
    assert_eq!(batches.len(), 3);
    let starts: Vec<u32> = batches.iter().flat_map(|(x, _)| [x[0], x[10]]).collect();
    assert_eq!(starts, vec![0, 197, 395, 593, 791, 989]);
    for (x, y) in &batches {
        assert_eq!(x.len(), 20);
        assert!(x.iter().zip(y).all(|(a, b)| *b == a + 1));
    }
    let again: Vec<TokenBatch> = val_batches(val, 10, 2, 3).expect("again").iter().collect();
    assert_eq!(again, batches);
}

/// `tessera.eval_iters = 18446744073709551615` once overflowed a capacity and 1e7 aborted on
/// allocation: the batches are now built when evaluated, and the count has a named limit.
#[test]
fn val_batches_are_bounded_and_lazy() {
    let val = counting(100);
    for huge in [u64::MAX, 10_000_000, VAL_BATCHES_MAX + 1] {
        let err = val_batches(val.clone(), 4, 2, huge).expect_err("over the limit");
        let msg = err.to_string();
        assert!(matches!(err, DataError::TooManyValBatches { .. }), "{msg}");
        assert!(msg.contains("tessera.eval_iters") && msg.contains(&huge.to_string()) && msg.contains("100000"), "{msg}");
    }
    let most = val_batches(val, 4, 2, VAL_BATCHES_MAX).expect("at the limit");
    assert_eq!(most.len(), 100_000);
    let (x, y) = most.get(most.len() - 1);
    assert_eq!((x[4], y[7]), (95, 99), "the last window ends the split");
}

#[test]
fn too_short_and_missing_errors() {
    let msg = Sampler::new(counting(5), 8, 0).expect_err("short").to_string();
    assert!(msg.contains("5 tokens") && msg.contains("need at least 9"), "{msg}");
    let msg = val_batches(counting(3), 4, 1, 1).expect_err("short val").to_string();
    assert!(msg.contains("validation split") && msg.contains("need at least 5"), "{msg}");

    let dir = tmp();
    let missing = dir.path().join("nope.txt");
    let err = load(&missing, None, 0.05).expect_err("missing");
    assert!(matches!(err, DataError::Missing { .. }));
    assert!(err.to_string().contains("nope.txt"), "{err}");
    let msg = Codec::open(Some(&missing)).expect_err("missing tok").to_string();
    assert!(msg.contains("no such file"), "{msg}");
    // A missing tokenizer is called a tokenizer, not a data path.
    assert!(msg.starts_with("tokenizer ") && msg.contains("tokenizer.json"), "{msg}");
    let msg = tokenizer_record(Some(&missing)).expect_err("missing tok").to_string();
    assert!(msg.starts_with("tokenizer ") && msg.contains("nope.txt") && !msg.contains("os error"), "{msg}");

    let empty = dir.path().join("empty.txt");
    write(&empty, b"");
    let msg = load(&empty, None, 0.05).expect_err("empty").to_string();
    assert!(msg.contains("contains no tokens"), "{msg}");
}
