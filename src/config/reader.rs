//! Typed reads from one (already validated) config section, with defaults and errors that
//! name the full key path.

use serde_json::{Map, Value};

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::keys;
use crate::config::value::{get_path, join, lenient_float, lenient_int};

/// A view of the object at `path` (absent or null = empty section).
pub(crate) struct Obj<'a> {
    map: Option<&'a Map<String, Value>>,
    path: String,
}

impl<'a> Obj<'a> {
    /// The section at dotted `path` of `root`; it must be an object when present.
    pub(crate) fn at(root: &'a Value, path: &str) -> KindResult<Self> {
        let map = match get_path(root, path) {
            None | Some(Value::Null) => None,
            Some(Value::Object(map)) => Some(map),
            Some(other) => return Err(ConfigErrorKind::invalid(path, other, "an object")),
        };
        Ok(Obj { map, path: path.to_string() })
    }

    /// Whether the section is present (and not null).
    pub(crate) fn present(&self) -> bool {
        self.map.is_some()
    }

    pub(crate) fn path(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// The raw value of `key` (null counts as absent).
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map?.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, v: &Value, expected: &str) -> ConfigErrorKind {
        ConfigErrorKind::invalid(&self.path(key), v, expected)
    }

    pub(crate) fn bool(&self, key: &str, default: bool) -> KindResult<bool> {
        self.get(key).map_or(Ok(default), |v| v.as_bool().ok_or_else(|| self.bad(key, v, "true or false")))
    }

    pub(crate) fn opt_u64(&self, key: &str) -> KindResult<Option<u64>> {
        self.get(key)
            .map(|v| lenient_int(v).ok().and_then(|n| u64::try_from(n).ok()).ok_or_else(|| self.bad(key, v, "a non-negative integer")))
            .transpose()
    }

    pub(crate) fn u64(&self, key: &str, default: u64) -> KindResult<u64> {
        Ok(self.opt_u64(key)?.unwrap_or(default))
    }

    /// A strictly positive integer (DeepSpeed rejects 0 for step sizes).
    pub(crate) fn positive_u64(&self, key: &str, default: u64) -> KindResult<u64> {
        let n = self.u64(key, default)?;
        if n == 0 {
            let shown = self.get(key).cloned().unwrap_or(Value::from(0));
            return Err(self.bad(key, &shown, "a positive integer"));
        }
        Ok(n)
    }

    pub(crate) fn opt_f32(&self, key: &str) -> KindResult<Option<f32>> {
        self.get(key)
            .map(|v| lenient_float(v).map(|x| x as f32).filter(|x| x.is_finite()).ok_or_else(|| self.bad(key, v, "a finite number")))
            .transpose()
    }

    pub(crate) fn f32(&self, key: &str, default: f32) -> KindResult<f32> {
        Ok(self.opt_f32(key)?.unwrap_or(default))
    }

    /// A number that must be ≥ 0.
    pub(crate) fn non_negative_f32(&self, key: &str, default: f32) -> KindResult<f32> {
        let x = self.f32(key, default)?;
        match self.get(key) {
            Some(v) if x < 0.0 => Err(self.bad(key, v, "a number ≥ 0")),
            _ => Ok(x),
        }
    }

    /// A required number: a missing key is an error.
    pub(crate) fn required_f32(&self, key: &str, why: &str) -> KindResult<f32> {
        self.opt_f32(key)?.ok_or_else(|| self.bad(key, &Value::Null, &format!("a number ({why})")))
    }

    pub(crate) fn opt_string(&self, key: &str) -> KindResult<Option<String>> {
        self.get(key).map(|v| v.as_str().map(str::to_string).ok_or_else(|| self.bad(key, v, "a string"))).transpose()
    }

    pub(crate) fn string(&self, key: &str, default: &str) -> KindResult<String> {
        Ok(self.opt_string(key)?.unwrap_or_else(|| default.to_string()))
    }

    /// A pair of numbers in [0, 1), e.g. Adam betas.
    pub(crate) fn betas(&self, key: &str, default: (f32, f32)) -> KindResult<(f32, f32)> {
        let Some(v) = self.get(key) else {
            return Ok(default);
        };
        let pair: Option<Vec<f32>> = v.as_array().map(|a| a.iter().filter_map(lenient_float).map(|x| x as f32).collect());
        match pair.as_deref() {
            Some(&[b1, b2]) if (0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2) => Ok((b1, b2)),
            _ => Err(self.bad(key, v, "two numbers in [0, 1), e.g. [0.9, 0.999]")),
        }
    }

    /// Reject keys of this section that are not in `allowed` (for per-type parameter lists).
    pub(crate) fn only_keys(&self, allowed: &[&str], owner: &str) -> KindResult<()> {
        let Some(map) = self.map else {
            return Ok(());
        };
        for (key, value) in map {
            if allowed.contains(&key.as_str()) {
                continue;
            }
            let path = self.path(key);
            if keys::lookup(&path).is_none() {
                let suggestion = keys::nearest(key, allowed).map(str::to_string);
                return Err(ConfigErrorKind::UnknownKey { path, suggestion });
            }
            let reason = format!("not a parameter of {owner} (its parameters: {})", allowed.join(", "));
            return Err(ConfigErrorKind::unsupported(&path, value, &reason));
        }
        Ok(())
    }
}
