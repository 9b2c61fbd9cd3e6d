//! The command line itself: shell completion scripts that a real shell loads and completes
//! with, and `--help` that shows no test-only flag (each argument's help line is checked by the
//! unit tests in src/main.rs).

use std::process::Command;

use crate::common::*;

/// What bash's completion offers after `words` (the last one being completed), with the
/// script of `tessera completions bash` loaded.
fn bash_completes(script: &str, words: &[&str]) -> Vec<String> {
    let cword = words.len() - 1;
    let (cur, prev) = (words[cword], if cword > 0 { words[cword - 1] } else { "" });
    let call = format!(
        "source {script}\nCOMP_WORDS=({})\nCOMP_CWORD={cword}\n_tessera tessera '{cur}' '{prev}'\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"",
        words.iter().map(|w| format!("'{w}'")).collect::<Vec<_>>().join(" ")
    );
    let out = Command::new("bash").args(["--norc", "--noprofile", "-c", &call]).output().expect("running bash");
    assert!(out.status.success(), "bash failed on the completion script: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

#[test]
fn bash_completion_offers_the_subcommands_and_their_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let script = ok(&["completions", "bash"], tmp.path());
    let path = write(tmp.path(), "tessera.bash", &script);
    let path = path.to_str().unwrap();
    let top = bash_completes(path, &["tessera", ""]);
    for sub in ["train", "generate", "export", "config", "models", "coordinator", "agent", "launch", "chaos", "cluster", "completions"] {
        assert!(top.contains(&sub.to_string()), "`tessera <TAB>` lacks {sub}: {top:?}");
    }
    assert!(!top.contains(&"worker".to_string()), "the hidden `worker` subcommand is offered: {top:?}");
    assert_eq!(bash_completes(path, &["tessera", "gen"]), ["generate"]);
    assert_eq!(bash_completes(path, &["tessera", "train", "--res"]), ["--resume"]);
    let train = bash_completes(path, &["tessera", "train", "--"]);
    assert!(train.contains(&"--nprocs".to_string()) && train.contains(&"--seed".to_string()), "{train:?}");
    for hidden in ["--abandon-step", "--worker-net"] {
        assert!(!train.contains(&hidden.to_string()), "the test-only {hidden} is offered: {train:?}");
    }
    let shells = bash_completes(path, &["tessera", "completions", ""]);
    assert!(shells.contains(&"zsh".to_string()) && shells.contains(&"fish".to_string()), "{shells:?}");
}

#[test]
fn zsh_and_fish_scripts_name_the_subcommands_and_an_unknown_shell_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let zsh = ok(&["completions", "zsh"], tmp.path());
    assert!(zsh.starts_with("#compdef tessera") && zsh.contains("'train:") && !zsh.contains("'worker:"), "{zsh}");
    let fish = ok(&["completions", "fish"], tmp.path());
    assert!(fish.contains("-a \"train\"") && fish.contains("-l resume") && !fish.contains("abandon-step"), "{fish}");
    let text = fails(&["completions", "tcsh"], tmp.path());
    assert!(text.contains("invalid value 'tcsh'") && text.contains("bash") && text.contains("zsh"), "{text}");
}

#[test]
fn help_shows_no_test_only_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let train = ok(&["train", "--help"], tmp.path());
    assert!(train.contains("--nprocs") && train.contains("--seed <SEED>"), "{train}");
    for hidden in ["--abandon-step", "--worker-net"] {
        assert!(!train.contains(hidden), "`train --help` shows {hidden}:\n{train}");
    }
    let agent = ok(&["agent", "--help"], tmp.path());
    assert!(agent.contains("--join") && !agent.contains("--worker-net"), "{agent}");
    let top = ok(&["--help"], tmp.path());
    assert!(top.contains("completions") && !top.lines().any(|l| l.trim_start().starts_with("worker ")), "{top}");
}
