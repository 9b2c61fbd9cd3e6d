//! Tests of the token cache: built once, then hit and memory-mapped; the same tokens and
//! fingerprint as a load without it; a corrupt, truncated or foreign file rebuilt, never used.

use std::path::{Path, PathBuf};

use super::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn cached(cache: &Path) -> LoadOptions {
    LoadOptions { cache_dir: Some(cache.to_path_buf()), ..LoadOptions::default() }
}

fn cache_files(cache: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache).expect("list cache").flatten().map(|e| e.path()).collect();
    v.sort();
    v
}

/// The old `Dataset::record` hash, recomputed from the tokens: checkpoints stay comparable.
fn record_hash(train: &[u32], val: &[u32]) -> String {
    let bytes: Vec<u8> = train.iter().chain(val).flat_map(|t| t.to_le_bytes()).collect();
    blake3::hash(&bytes).to_hex().to_string()
}

fn assert_same_tokens(a: &Dataset, b: &Dataset) {
    assert_eq!(a.train, b.train);
    assert_eq!(a.val, b.val);
    assert_eq!(a.vocab_size, b.vocab_size);
    assert_eq!(a.record()["blake3"], b.record()["blake3"]);
    assert_eq!(a.record()["tokens"], b.record()["tokens"]);
}

#[test]
fn second_load_hits_the_cache_with_the_same_tokens() {
    let (dir, cache) = (tmp(), tmp());
    let path = dir.path().join("docs.jsonl");
    std::fs::write(&path, b"{\"text\": \"first document\"}\n{\"text\": \"second one\"}\n").expect("write");
    let memory = load_with(&path, &LoadOptions::default()).expect("in memory");
    assert_eq!(memory.cache, CacheUse::Off);
    assert!(!memory.train.is_mapped());

    let built = load_with(&path, &cached(cache.path())).expect("build");
    let files = cache_files(cache.path());
    assert_eq!(files.len(), 1, "one cache file and no temporary one: {files:?}");
    assert_eq!(built.cache, CacheUse::Built(files[0].clone()));
    assert!(built.source.contains("tokenized into cache"), "{}", built.source);
    assert!(built.train.is_mapped() && built.val.is_mapped());
    assert_same_tokens(&memory, &built);
    assert_eq!(memory.record()["blake3"], record_hash(&memory.train, &memory.val));

    let mtime = std::fs::metadata(&files[0]).and_then(|m| m.modified()).expect("mtime");
    let hit = load_with(&path, &cached(cache.path())).expect("hit");
    assert_eq!(hit.cache, CacheUse::Hit(files[0].clone()));
    assert!(hit.source.contains("token cache hit"), "{}", hit.source);
    assert_same_tokens(&memory, &hit);
    assert_eq!(std::fs::metadata(&files[0]).and_then(|m| m.modified()).expect("mtime"), mtime, "a hit does not rewrite");

    // Changed data is a new key, never a stale hit.
    std::fs::write(&path, b"{\"text\": \"first document\"}\n{\"text\": \"second One\"}\n").expect("rewrite");
    let changed = load_with(&path, &cached(cache.path())).expect("changed");
    assert!(matches!(changed.cache, CacheUse::Built(_)), "{:?}", changed.cache);
    assert_ne!(changed.record()["blake3"], hit.record()["blake3"]);
    assert_eq!(cache_files(cache.path()).len(), 2);
}

/// The shipped corpus (the README job's data) gives the same tokens through the cache.
#[test]
fn shipped_corpus_is_the_same_through_the_cache() {
    let cache = tmp();
    let path = default_corpus_path();
    let memory = load(&path, None, DEFAULT_VAL_FRACTION).expect("in memory");
    let built = load_with(&path, &cached(cache.path())).expect("cached");
    assert_same_tokens(&memory, &built);
    let bytes = std::fs::read(&path).expect("corpus");
    assert!(memory.train.iter().chain(memory.val.iter()).map(|&t| t as u8).eq(bytes.iter().copied()), "one token per byte");
}

#[test]
fn a_corrupt_cache_file_is_rebuilt_not_used() {
    let (dir, cache) = (tmp(), tmp());
    let path = dir.path().join("t.txt");
    std::fs::write(&path, "some text to tokenize, long enough to corrupt".repeat(20)).expect("write");
    // In memory: the cache file is rewritten in place below, which a mapping would see.
    let good = load(&path, None, DEFAULT_VAL_FRACTION).expect("in memory");
    drop(load_with(&path, &cached(cache.path())).expect("build"));
    let file = cache_files(cache.path()).remove(0);
    let bytes = std::fs::read(&file).expect("read cache");

    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x01; // a token's bit: only the blake3 check sees it
    let mut wrong_key = bytes.clone();
    wrong_key[20] ^= 0xff;
    let mut wrong_count = bytes.clone();
    wrong_count[56] ^= 0x01;
    let cases: [(&str, Vec<u8>, &str); 5] = [
        ("flipped token bit", flipped, "do not match their blake3"),
        ("truncated", bytes[..bytes.len() - 4].to_vec(), "bytes where the header"),
        ("short", bytes[..100].to_vec(), "shorter than the 128-byte header"),
        ("other key", wrong_key, "key"),
        ("other count", wrong_count, "bytes where the header"),
    ];
    for (what, content, reason) in cases {
        std::fs::write(&file, &content).expect("corrupt");
        let ds = load_with(&path, &cached(cache.path())).expect(what);
        match &ds.cache {
            CacheUse::Rebuilt { path: p, reason: r } => {
                assert_eq!(p, &file, "{what}");
                assert!(r.contains(reason), "{what}: {r}");
            }
            other => panic!("{what}: expected a rebuild, got {other:?}"),
        }
        assert!(ds.cache.warning().is_some_and(|w| w.contains("rebuilt")), "{what}");
        assert_same_tokens(&good, &ds);
        assert_eq!(std::fs::read(&file).expect("rebuilt"), bytes, "{what}: the file is whole again");
        drop(ds); // unmapped before the next in-place write
    }
}

/// A cache folder that cannot be written is no reason to stop: the tokens go to memory, and
/// the warning says so.
#[test]
fn an_unwritable_cache_falls_back_to_memory() {
    let dir = tmp();
    let path = dir.path().join("t.txt");
    std::fs::write(&path, b"hello hello hello").expect("write");
    let blocker = dir.path().join("not-a-folder");
    std::fs::write(&blocker, b"a file").expect("write");
    let ds = load_with(&path, &cached(&blocker.join("tokens"))).expect("load");
    assert!(matches!(ds.cache, CacheUse::Unavailable { .. }), "{:?}", ds.cache);
    assert!(ds.cache.warning().is_some_and(|w| w.contains("into memory")), "{:?}", ds.cache);
    assert_same_tokens(&load(&path, None, DEFAULT_VAL_FRACTION).expect("memory"), &ds);
}

/// Bad data is the data's error even with a cache, and leaves no file behind.
#[test]
fn bad_data_leaves_no_cache_file() {
    let (dir, cache) = (tmp(), tmp());
    let path = dir.path().join("bad.jsonl");
    std::fs::write(&path, b"{\"text\": \"a\"}\n{\"nope\": 1}\n").expect("write");
    let msg = load_with(&path, &cached(cache.path())).expect_err("bad line").to_string();
    assert!(msg.contains("line 2"), "{msg}");
    assert_eq!(cache_files(cache.path()), Vec::<PathBuf>::new());
}
