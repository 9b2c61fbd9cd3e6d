//! `--set a.b.c=VALUE` overrides, applied to the raw JSON before legacy rewriting and
//! validation: VALUE is JSON when it parses as JSON, else a plain string; missing
//! intermediate objects are created.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::value::set_path;

/// Apply every override in order (later ones win).
pub(crate) fn apply(root: &mut Value, overrides: &[String]) -> KindResult<()> {
    overrides.iter().try_for_each(|arg| apply_one(root, arg))
}

fn apply_one(root: &mut Value, arg: &str) -> KindResult<()> {
    let fail = |reason: String| ConfigErrorKind::Override { arg: arg.to_string(), reason };
    let (path, text) = arg.split_once('=').ok_or_else(|| fail("expected KEY.PATH=VALUE".to_string()))?;
    let path = path.trim();
    if path.is_empty() {
        return Err(fail("the key path is empty".to_string()));
    }
    let value = serde_json::from_str::<Value>(text).unwrap_or_else(|_| Value::String(text.to_string()));
    set_path(root, path, value).map_err(fail)
}

/// The last of `overrides` (the one applied last, so the one that holds) whose key is `path`
/// or contains it: the override that wrote the value an error about `path` is about. Keys
/// compare by their dot-separated parts.
pub(crate) fn setting<'a>(overrides: &'a [String], path: &str) -> Option<&'a str> {
    let parts: Vec<&str> = path.split('.').collect();
    overrides.iter().rev().map(String::as_str).find(|arg| {
        let Some((key, _)) = arg.split_once('=') else { return false };
        let key: Vec<&str> = key.trim().split('.').collect();
        key.len() <= parts.len() && key[..] == parts[..key.len()]
    })
}
