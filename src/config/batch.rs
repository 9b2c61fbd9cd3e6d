//! The DeepSpeed batch rule: train_batch_size = micro batch per worker × gradient
//! accumulation steps × world size, deriving whichever values are missing the way
//! DeepSpeed's `_set_batch_related_parameters` does, with exact-divisibility checks.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};

/// The three batch numbers, all positive and consistent with the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub train_batch_size: usize,
    pub micro_batch_per_gpu: usize,
    pub gradient_accumulation_steps: usize,
}

/// Read the three batch keys of `root` (absent/null = missing) and complete them.
pub(crate) fn derive(root: &Value, world: usize) -> KindResult<Batch> {
    let train = positive(root, "train_batch_size")?;
    let micro = positive(root, "train_micro_batch_size_per_gpu")?;
    let accum = positive(root, "gradient_accumulation_steps")?;
    complete(train, micro, accum, world)
}

/// Complete a partial triple; `world` must be positive.
pub(crate) fn complete(train: Option<usize>, micro: Option<usize>, accum: Option<usize>, world: usize) -> KindResult<Batch> {
    let (t, m, g) = match (train, micro, accum) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => (t, m, split(t, m, world, "train_micro_batch_size_per_gpu")?),
        (Some(t), None, Some(g)) => (t, split(t, g, world, "gradient_accumulation_steps")?, g),
        (None, Some(m), Some(g)) => (m * g * world, m, g),
        (Some(t), None, None) => (t, split(t, 1, world, "1")?, 1),
        (None, Some(m), None) => (m * world, m, 1),
        (None, None, _) => return Err(ConfigErrorKind::BatchMissing),
    };
    if t != m * g * world {
        return Err(ConfigErrorKind::BatchMismatch { train_batch: t, micro_batch: m, grad_accum: g, world_size: world });
    }
    Ok(Batch { train_batch_size: t, micro_batch_per_gpu: m, gradient_accumulation_steps: g })
}

/// `train / (known × world)`, which must divide exactly.
fn split(train: usize, known: usize, world: usize, known_name: &str) -> KindResult<usize> {
    let divisor = known * world;
    if train % divisor != 0 {
        let divisor_expr =
            if known_name == "1" { "the world size".to_string() } else { format!("{known_name} ({known}) × world size ({world})") };
        return Err(ConfigErrorKind::BatchNotDivisible { train_batch: train, divisor, divisor_expr, world_size: world });
    }
    Ok(train / divisor)
}

fn positive(root: &Value, key: &str) -> KindResult<Option<usize>> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ConfigErrorKind::invalid(key, v, "a positive integer")),
    }
}
