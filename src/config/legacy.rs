//! Legacy DeepSpeed keys still accepted by DeepSpeed, rewritten to their current form before
//! validation (each rewrite is reported in `Config::warnings`).

use serde_json::{json, Map, Value};

use crate::config::error::{ConfigErrorKind, KindResult};

/// Legacy spellings and what they become; rendered into docs/config.md.
pub static LEGACY_KEYS: &[(&str, &str)] = &[
    ("bfloat16", "renamed to `bf16`"),
    ("cpu_offload (top level)", "`zero_optimization.offload_optimizer.device = \"cpu\"`"),
    ("zero_optimization: true / false", "`{\"stage\": 1}` / `{\"stage\": 0}`; top-level `allgather_size` becomes `allgather_bucket_size`"),
    ("zero_optimization.cpu_offload", "`offload_optimizer.device = \"cpu\"`"),
    ("zero_optimization.cpu_offload_param", "`offload_param.device = \"cpu\"`"),
    ("zero_optimization.cpu_offload_use_pin_memory", "`pin_memory` of the offload sections"),
    ("zero_optimization.stage3_gather_fp16_weights_on_model_save", "`stage3_gather_16bit_weights_on_model_save`"),
    ("zero_optimization.<field> (pydantic field names)", "`prefetch_bucket_size`, `param_persistence_threshold`, `model_persistence_threshold`, `max_live_parameters`, `max_reuse_distance`, `gather_16bit_weights_on_model_save`, `module_granularity_threshold`, `use_all_reduce_for_fetch_params`, `allgather_sequential` get their `stage3_` prefix"),
];

/// ZeRO fields DeepSpeed also accepts under their pydantic field name (no `stage3_` prefix).
const STAGE3_ALIASES: &[&str] = &[
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
];

/// Rewrite every legacy key of the top-level object in place.
pub(crate) fn rewrite(root: &mut Map<String, Value>, warnings: &mut Vec<String>) -> KindResult<()> {
    rename(root, "", "bfloat16", "bf16", warnings)?;
    if let Some(Value::Bool(on)) = root.get("zero_optimization").cloned() {
        let mut zero = json!({ "stage": u8::from(on) });
        if let Some(size) = root.shift_remove("allgather_size").filter(|_| on) {
            zero["allgather_bucket_size"] = size;
        }
        root.insert("zero_optimization".into(), zero);
        warnings.push(format!("legacy `\"zero_optimization\": {on}` rewritten to `{{\"stage\": {}}}`", u8::from(on)));
    }
    if take_bool(root, "", "cpu_offload")? == Some(true) {
        let zero = zero_section(root)?;
        enable_offload(zero, "offload_optimizer", "cpu_offload", warnings)?;
    }
    if let Some(zero) = root.get_mut("zero_optimization").and_then(Value::as_object_mut) {
        rewrite_zero(zero, warnings)?;
    }
    Ok(())
}

fn rewrite_zero(zero: &mut Map<String, Value>, warnings: &mut Vec<String>) -> KindResult<()> {
    const P: &str = "zero_optimization";
    if take_bool(zero, P, "cpu_offload")? == Some(true) {
        enable_offload(zero, "offload_optimizer", "zero_optimization.cpu_offload", warnings)?;
    }
    if take_bool(zero, P, "cpu_offload_param")? == Some(true) {
        enable_offload(zero, "offload_param", "zero_optimization.cpu_offload_param", warnings)?;
    }
    if let Some(pin) = take_bool(zero, P, "cpu_offload_use_pin_memory")? {
        for section in ["offload_optimizer", "offload_param"] {
            if let Some(obj) = zero.get_mut(section).and_then(Value::as_object_mut) {
                obj.entry("pin_memory").or_insert(Value::Bool(pin));
            }
        }
        warnings.push(format!(
            "legacy `zero_optimization.cpu_offload_use_pin_memory` rewritten to \
             `pin_memory: {pin}` of the offload sections"
        ));
    }
    let old = "stage3_gather_fp16_weights_on_model_save";
    rename(zero, P, old, "stage3_gather_16bit_weights_on_model_save", warnings)?;
    for alias in STAGE3_ALIASES {
        rename(zero, P, alias, &format!("stage3_{alias}"), warnings)?;
    }
    Ok(())
}

/// The `zero_optimization` object, created when absent.
fn zero_section(root: &mut Map<String, Value>) -> KindResult<&mut Map<String, Value>> {
    let zero = root.entry("zero_optimization").or_insert_with(|| json!({}));
    let shown = zero.clone();
    zero.as_object_mut().ok_or_else(|| ConfigErrorKind::invalid("zero_optimization", &shown, "an object"))
}

/// Remove `key` from `map`, requiring a boolean (null counts as absent).
fn take_bool(map: &mut Map<String, Value>, parent: &str, key: &str) -> KindResult<Option<bool>> {
    match map.shift_remove(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(other) => {
            let path = crate::config::value::join(parent, key);
            Err(ConfigErrorKind::invalid(&path, &other, "true or false"))
        }
    }
}

/// Turn on CPU offload for `section` (`offload_optimizer` / `offload_param`) of the ZeRO map.
fn enable_offload(zero: &mut Map<String, Value>, section: &str, legacy: &str, warnings: &mut Vec<String>) -> KindResult<()> {
    match zero.get(section) {
        None | Some(Value::Null) => {
            zero.insert(section.to_string(), json!({ "device": "cpu" }));
        }
        Some(existing) if existing.get("device") == Some(&json!("cpu")) => {}
        Some(existing) => {
            let path = format!("zero_optimization.{section}");
            let reason = format!("conflicts with the legacy `{legacy}: true`, which also sets it");
            return Err(ConfigErrorKind::unsupported(&path, existing, &reason));
        }
    }
    warnings.push(format!("legacy `{legacy}: true` rewritten to `zero_optimization.{section}.device = \"cpu\"`"));
    Ok(())
}

/// Rename `old` to `new` within `map`; both present is an error.
fn rename(map: &mut Map<String, Value>, parent: &str, old: &str, new: &str, warnings: &mut Vec<String>) -> KindResult<()> {
    let Some(value) = map.shift_remove(old) else {
        return Ok(());
    };
    let old_path = crate::config::value::join(parent, old);
    let new_path = crate::config::value::join(parent, new);
    if map.contains_key(new) {
        let reason = format!("`{new_path}` is also set; keep only one of the two");
        return Err(ConfigErrorKind::unsupported(&old_path, &value, &reason));
    }
    map.insert(new.to_string(), value);
    warnings.push(format!("legacy key `{old_path}` rewritten to `{new_path}`"));
    Ok(())
}
