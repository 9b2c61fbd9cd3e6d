use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::*;

/// The repository root (this file is src/env/tests.rs).
fn root() -> PathBuf {
    let file = Path::new(file!());
    let here = if file.is_absolute() { file.to_path_buf() } else { Path::new(env!("CARGO_MANIFEST_DIR")).join(file) };
    here.ancestors().nth(3).expect("repository root").to_path_buf()
}

fn read(vars: &[(&str, &str)]) -> Result<Env, EnvError> {
    let vars: Vec<(String, OsString)> = vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
    Env::read(&|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
}

/// docs/ENV.md must equal `render_markdown()`.
#[test]
fn docs_in_sync() {
    let doc = root().join("docs").join("ENV.md");
    let want = render_markdown();
    if std::env::var_os("TESSERA_REGEN_DOCS").is_some() {
        std::fs::write(&doc, &want).expect("write docs/ENV.md");
    }
    let have = std::fs::read_to_string(&doc).unwrap_or_default();
    assert!(
        have == want,
        "{} is out of date with the table in src/env.rs; regenerate it with \
         `TESSERA_REGEN_DOCS=1 cargo test --release --lib env::tests::docs_in_sync`",
        doc.display()
    );
}

/// The `TESSERA_*` names in `text` (a name runs on while upper-case letters, digits or `_`).
fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("TESSERA_") {
        let before = rest[..i].chars().next_back();
        let tail = &rest[i..];
        let len = tail.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        let name = tail[..len].trim_end_matches('_');
        // A name inside a longer identifier (`MY_TESSERA_X`) is not one.
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') && name.len() > "TESSERA_".len() {
            out.insert(name.to_string());
        }
        rest = &tail[len.max(1)..];
    }
    out
}

/// Every `.rs` and `.sh` file under `dir` (not `target`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target" && n != ".git") {
                sources(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs" || x == "sh") {
            out.push(p);
        }
    }
}

/// A `TESSERA_*` variable used anywhere in the source (every crate, the tests, the scripts)
/// must be in the table: this fails when one is added without a row, or a row's variable is
/// no longer read anywhere.
#[test]
fn every_variable_in_the_source_is_in_the_table_and_every_row_is_used() {
    let root = root();
    let mut files = vec![root.join("build.rs")];
    for dir in ["src", "actors", "kernels", "transport", "chaos", "tests", "benches", "fuzz", "scripts"] {
        sources(&root.join(dir), &mut files);
    }
    let listed: BTreeSet<&str> = VARS.iter().map(|v| v.name).collect();
    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    for f in &files {
        // This module's own table and tests name every variable; they prove nothing.
        if f.ends_with("src/env.rs") || f.ends_with("src/env/tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for name in names_in(&text) {
            if !listed.contains(name.as_str()) {
                missing.push(format!("{name} ({})", f.strip_prefix(&root).unwrap_or(f).display()));
            }
            used.insert(name);
        }
    }
    assert!(missing.is_empty(), "TESSERA_* variables the table in src/env.rs does not list:\n{}", missing.join("\n"));
    let unused: Vec<&&str> = listed.iter().filter(|n| !used.contains(**n)).collect();
    assert!(unused.is_empty(), "rows of src/env.rs whose variable nothing reads: {unused:?}");
    assert!(files.len() > 100, "the scan found only {} files under {}", files.len(), root.display());
}

#[test]
fn names_are_found_whole() {
    let got = names_in("x TESSERA_QUIC_LANES=3 \"TESSERA_AIO\" MY_TESSERA_NOT, TESSERA_; {TESSERA_GPU_FUSE}");
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["TESSERA_AIO", "TESSERA_GPU_FUSE", "TESSERA_QUIC_LANES"]);
}

#[test]
fn the_table_lists_each_variable_once_with_its_prefix() {
    let mut seen = BTreeSet::new();
    for v in VARS {
        assert!(v.name.starts_with("TESSERA_"), "{}", v.name);
        assert!(seen.insert(v.name), "{} is listed twice", v.name);
        assert!(!v.what.is_empty() && !v.reader.is_empty() && !v.default.is_empty(), "{}: empty cell", v.name);
    }
}

/// A bad value is refused naming the variable, the value and what was expected; good values
/// and unset variables pass.
#[test]
fn bad_values_are_refused_naming_the_variable_the_value_and_what_was_expected() {
    let cases = [
        ("TESSERA_QUIC_LANES", "9", "TESSERA_QUIC_LANES=\"9\": expected a number of lanes from 1 to 8"),
        ("TESSERA_QUIC_WORKERS", "many", "TESSERA_QUIC_WORKERS=\"many\": expected a number of worker threads from 1 to 64"),
        ("TESSERA_TLS_PROVIDER", "openssl", "TESSERA_TLS_PROVIDER=\"openssl\": expected aws-lc-rs or ring"),
        ("TESSERA_MALLOC_TUNE", "no", "TESSERA_MALLOC_TUNE=\"no\": expected 0 or 1"),
        ("TESSERA_AIO", "uring", "TESSERA_AIO=\"uring\": expected threads or io_uring"),
        ("TESSERA_GPU_TUNE", "max", "TESSERA_GPU_TUNE=\"max\": `max` is not 0, 1, on, off or route"),
        ("TESSERA_ATTN_FWD", "flash", "TESSERA_ATTN_FWD=\"flash\": expected one of wg, mma"),
        ("TESSERA_GPU_RANK", "-1", "TESSERA_GPU_RANK=\"-1\": expected a number from 0 (a rank)"),
        ("TESSERA_TEST_FAULTS", "kill", "TESSERA_TEST_FAULTS=\"kill\": unknown fault `kill` (expected a comma list of kill_in_commit"),
    ];
    for (name, value, want) in cases {
        let e = read(&[(name, value)]).expect_err(name).to_string();
        assert!(e.starts_with(want), "{name}={value}: {e}");
    }
    let e = read(&[("TESSERA_GPU_FUSE", "bias,speed")]).unwrap_err().to_string();
    assert!(e.starts_with("TESSERA_GPU_FUSE=\"bias,speed\": unknown fusion `speed`") && e.contains("residual"), "{e}");
    let good = [
        ("TESSERA_QUIC_LANES", "3"),
        ("TESSERA_TLS_PROVIDER", "ring"),
        ("TESSERA_AIO", "threads"),
        ("TESSERA_GPU_FUSE", "none"),
        ("TESSERA_ATTN_BWD", "r2"),
        ("TESSERA_ELASTIC_TRACE", ""),
        ("TESSERA_MALLOC_TUNE", "0"),
    ];
    let env = read(&good).expect("good values");
    assert!(env.faults.is_empty(), "no TESSERA_TEST_FAULTS: no fault hooks");
}

/// `TESSERA_TEST_FAULTS` is handed down parsed: what `main` turns into the fault hooks.
#[test]
fn test_faults_are_handed_down() {
    let env = read(&[("TESSERA_TEST_FAULTS", "kill_in_commit,replicate_delay_ms=1500")]).unwrap();
    assert!(env.faults.kill_in_commit && !env.faults.stop_actor);
    assert_eq!(env.faults.replicate_delay_ms, Some(1500));
}

/// The words a kernel-choice row says it takes are the kernels' own names (the check uses them).
#[test]
fn kernel_choices_say_the_kernels_names() {
    use tessera_kernels::cuda::attention::{bwd_names, fwd_names};
    for (name, names) in [("TESSERA_ATTN_FWD", fwd_names()), ("TESSERA_ATTN_BWD", bwd_names())] {
        let v = VARS.iter().find(|v| v.name == name).expect(name);
        let said = expected(v.kind);
        for n in names {
            assert!(said.contains(n), "{name}: {said:?} does not name {n}");
            assert!(read(&[(name, n)]).is_ok(), "{name}={n}");
        }
    }
}
