//! Embeds the git commit the binary is built from (`TESSERA_COMMIT`, recorded in
//! `summary.json`): `git rev-parse` when the source is a git checkout, else "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=TESSERA_COMMIT={commit}");
    // Built again when HEAD moves: the file HEAD, the branch it names, and packed refs.
    for path in [Some("HEAD".to_string()), git(&["symbolic-ref", "-q", "HEAD"]), Some("packed-refs".to_string())].into_iter().flatten() {
        // A path that does not exist would make Cargo run this script on every build.
        if let Some(p) = git(&["rev-parse", "--git-path", &path]).filter(|p| std::path::Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
