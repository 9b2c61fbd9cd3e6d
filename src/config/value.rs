//! Raw-JSON helpers of the config layer: strict parsing (line:column errors, duplicate keys
//! rejected as DeepSpeed does), dotted key paths, hjson-style lenient numbers and the
//! canonical (sorted-key) hash.

use std::fmt;

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::config::error::{ConfigErrorKind, KindResult};

/// Parse JSON text into a [`Value`], rejecting duplicate keys; errors carry line:column.
pub(crate) fn parse_text(text: &str) -> KindResult<Value> {
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = StrictValue::deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    parsed.map(|v| v.0).map_err(|e| {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        ConfigErrorKind::Syntax { line: e.line(), column: e.column(), message: full.strip_suffix(&suffix).unwrap_or(&full).to_string() }
    })
}

struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(Number::from_f64(x).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_string()))
    }
    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(A::Error::custom(format!("duplicate key `{key}`")));
            }
            let StrictValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// Short, single-line rendering of a value for error messages.
pub(crate) fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        let head: String = s.chars().take(77).collect();
        format!("{head}...")
    } else {
        s
    }
}

/// Name of a JSON value's type, for "expected …, found …" messages.
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `parent.key`, or `key` at the top level.
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

/// The value at a dotted path, if every step exists and is an object.
pub(crate) fn get_path<'a>(root: &'a Value, path: &str) -> Option<&'a Value> {
    if path.is_empty() {
        return Some(root);
    }
    path.split('.').try_fold(root, |v, key| v.as_object()?.get(key))
}

/// Remove the value at a dotted path (no-op when absent).
pub(crate) fn remove_path(root: &mut Value, path: &str) -> Option<Value> {
    let (parent, key) = match path.rsplit_once('.') {
        Some((p, k)) => (get_path_mut(root, p)?, k),
        None => (root, path),
    };
    parent.as_object_mut()?.shift_remove(key)
}

fn get_path_mut<'a>(root: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    path.split('.').try_fold(root, |v, key| v.as_object_mut()?.get_mut(key))
}

/// Set the value at a dotted path, creating missing intermediate objects. Fails (naming the
/// blocking prefix) when a step exists but is not an object.
pub(crate) fn set_path(root: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let keys: Vec<&str> = path.split('.').collect();
    if keys.iter().any(|k| k.is_empty()) {
        return Err(format!("`{path}` has an empty key"));
    }
    let mut cur = root;
    for (i, key) in keys.iter().enumerate() {
        let prefix = keys[..i].join(".");
        let found = type_name(cur);
        let Some(obj) = cur.as_object_mut() else {
            return Err(format!("`{prefix}` is {found}, not an object"));
        };
        if i + 1 == keys.len() {
            obj.insert((*key).to_string(), value);
            return Ok(());
        }
        cur = obj.entry((*key).to_string()).or_insert_with(|| Value::Object(Map::new()));
    }
    Ok(())
}

/// An integer read leniently, hjson/DeepSpeed style: `5e8`, `5.0e8` and `"5e8"` are
/// 500000000; non-integral or non-numeric values are errors (message says which).
pub(crate) fn lenient_int(v: &Value) -> Result<i128, &'static str> {
    let limit = (1u64 << 63) as f64;
    if let Some(n) = v.as_u64() {
        return Ok(i128::from(n));
    }
    if let Some(n) = v.as_i64() {
        return Ok(i128::from(n));
    }
    let x = match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => {
            let t = s.trim().replace('_', "");
            if let Ok(n) = t.parse::<i128>() {
                return Ok(n);
            }
            t.parse::<f64>().ok()
        }
        _ => None,
    };
    let x = x.ok_or("not a number")?;
    if !x.is_finite() || x.fract() != 0.0 {
        return Err("not an integer");
    }
    if x.abs() >= limit {
        return Err("out of range");
    }
    Ok(x as i128)
}

/// A float read leniently: JSON numbers and numeric strings (`"3e-5"`).
pub(crate) fn lenient_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|x| x.is_finite()),
        _ => None,
    }
}

/// A JSON number for an f64 (finite by construction of every caller).
pub(crate) fn num(x: f64) -> Value {
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Copy of `v` with every object's keys sorted (recursively).
pub(crate) fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let sorted = keys.into_iter().map(|k| (k.clone(), canonical(&map[k.as_str()]))).collect();
            Value::Object(sorted)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// blake3 hex digest of the compact canonical serialisation of `v`.
pub(crate) fn canonical_hash(v: &Value) -> String {
    let text = canonical(v).to_string();
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

/// A JSON number for an f32, written with the f32's shortest decimal form (3e-5, not
/// 2.9999999242136255e-5).
pub(crate) fn num32(x: f32) -> Value {
    x.to_string().parse::<f64>().map_or(Value::Null, num)
}
