//! Schema walk over the raw config, driven by the key table: rejects unknown keys (with a
//! did-you-mean), checks and normalises value types (hjson-style integers), lists the keys
//! present and warns about keys Tessera accepts but does not honour yet.

use serde_json::{Map, Number, Value};

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::keys::{self, KeyInfo, KeyKind};
use crate::config::value::{join, lenient_float, lenient_int, num};

/// What the walk found: every known key path present, and "not honoured" warnings.
#[derive(Debug, Default)]
pub(crate) struct Walk {
    pub present: Vec<String>,
    pub warnings: Vec<String>,
}

/// Validate the whole (legacy-rewritten) config in place.
pub(crate) fn check(root: &mut Map<String, Value>) -> KindResult<Walk> {
    let mut walk = Walk::default();
    walk_section(root, "", false, &mut walk)?;
    Ok(walk)
}

fn walk_section(map: &mut Map<String, Value>, section: &str, covered: bool, out: &mut Walk) -> KindResult<()> {
    for (key, value) in map.iter_mut() {
        let path = join(section, key);
        let Some(info) = keys::lookup(&path) else {
            let valid = keys::children(section);
            return Err(ConfigErrorKind::UnknownKey { suggestion: keys::nearest(key, &valid).map(str::to_string), path });
        };
        out.present.push(path.clone());
        let warned = covered || (!info.honoured && is_active(info, value) && warn(info, out));
        check_value(value, info)?;
        if let (KeyKind::Section, Value::Object(obj)) = (info.kind, &mut *value) {
            walk_section(obj, &path, warned, out)?;
        }
    }
    Ok(())
}

fn warn(info: &KeyInfo, out: &mut Walk) -> bool {
    let note = if info.note.is_empty() { String::new() } else { format!(" ({})", info.note) };
    out.warnings.push(format!("`{}` is accepted but not honoured by Tessera yet{note}", info.path));
    true
}

/// Whether a value asks for anything Tessera does not do: `null`, `false`, `{}`,
/// `{"enabled": false}` and `{"device": "none"}` do not, so they draw no "not honoured"
/// warning. For a flag whose DeepSpeed default is true ([`keys::DEFAULT_TRUE`], what Tessera
/// always does) it is the other way round: `false` asks for something else, `true` does not.
fn is_active(info: &KeyInfo, v: &Value) -> bool {
    if keys::DEFAULT_TRUE.contains(&info.path) {
        return v == &Value::Bool(false);
    }
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::Object(obj) => {
            let off = obj.get("enabled") == Some(&Value::Bool(false)) || obj.get("device").and_then(Value::as_str) == Some("none");
            !obj.is_empty() && !off
        }
        _ => true,
    }
}

/// Check `value` against its kind, normalising lenient numbers in place.
fn check_value(value: &mut Value, info: &KeyInfo) -> KindResult<()> {
    let is_auto = value.as_str() == Some("auto");
    let ok_as_is = matches!(value, Value::Null) || info.kind == KeyKind::Opaque || (is_auto && info.kind != KeyKind::Section);
    if ok_as_is {
        return Ok(());
    }
    let bad = |expected: &str| ConfigErrorKind::invalid(info.path, value, expected);
    let normalised = match info.kind {
        KeyKind::Section => value.is_object().then_some(None).ok_or_else(|| bad("an object"))?,
        KeyKind::Bool => value.is_boolean().then_some(None).ok_or_else(|| bad("true or false"))?,
        KeyKind::Str => value.is_string().then_some(None).ok_or_else(|| bad("a string"))?,
        KeyKind::UInt => Some(uint(value, info.path)?),
        KeyKind::Int => Some(int(value, info.path)?),
        KeyKind::Float => Some(num(lenient_float(value).ok_or_else(|| bad("a number"))?)),
        KeyKind::FloatList => Some(float_list(value).ok_or_else(|| bad("an array of numbers"))?),
        KeyKind::Opaque => None,
    };
    if let Some(v) = normalised {
        *value = v;
    }
    Ok(())
}

fn uint(value: &Value, path: &str) -> KindResult<Value> {
    match lenient_int(value) {
        Ok(n) if n >= 0 => {
            u64::try_from(n).map(|n| Value::Number(n.into())).map_err(|_| ConfigErrorKind::invalid(path, value, "an integer below 2^64"))
        }
        Ok(_) => Err(ConfigErrorKind::invalid(path, value, "a non-negative integer")),
        Err(why) => Err(ConfigErrorKind::invalid(path, value, &format!("a non-negative integer such as 500000000 or 5e8 ({why})"))),
    }
}

fn int(value: &Value, path: &str) -> KindResult<Value> {
    match lenient_int(value).map(i64::try_from) {
        Ok(Ok(n)) => Ok(Value::Number(Number::from(n))),
        Ok(Err(_)) => Err(ConfigErrorKind::invalid(path, value, "a 64-bit integer")),
        Err(why) => Err(ConfigErrorKind::invalid(path, value, &format!("an integer ({why})"))),
    }
}

fn float_list(value: &Value) -> Option<Value> {
    let items = value.as_array()?;
    let floats: Option<Vec<Value>> = items.iter().map(|v| lenient_float(v).map(num)).collect();
    floats.map(Value::Array)
}
