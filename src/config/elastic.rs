//! DeepSpeed's `elasticity` section (version 0.1): the global batch that the most world sizes
//! can keep, the valid world sizes, and the micro-batch a given world size uses — the same
//! choices DeepSpeed's `compute_elastic_config` makes (re-implemented, not copied).
//!
//! DeepSpeed's rule: candidate batches are each micro-batch size and their least common
//! multiple, each scaled by the largest of the first 38 highly composite numbers that keeps it
//! ≤ `max_train_batch_size` (a base above the maximum stays as it is, as in DeepSpeed). A world
//! size `w` in `[min_gpus, max_gpus]` is valid for a batch `B` when some micro-batch size `m`
//! divides `B` and `w` divides `B / m`. The candidate with the most valid world sizes wins;
//! ties go to the larger batch (`prefer_larger_batch`, default) or the smaller. A world size
//! uses the largest micro-batch size dividing `B / w`.

use serde_json::Value;

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::reader::Obj;
pub use tessera_fleet::spec::{ElasticRun, DEFAULT_REBALANCE_THRESHOLD};

/// The 38 smallest highly composite numbers (enough for batches up to 720 720), as DeepSpeed.
const HCN: [usize; 38] = [
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120, 20160, 25200, 27720, 45360,
    50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720,
];

/// The newest elasticity version Tessera implements.
pub const ELASTICITY_VERSION: f64 = 0.1;

/// DeepSpeed's `elasticity` section.
#[derive(Debug, Clone, PartialEq)]
pub struct ElasticityConfig {
    pub enabled: bool,
    pub max_train_batch_size: usize,
    pub micro_batch_sizes: Vec<usize>,
    pub min_gpus: usize,
    pub max_gpus: usize,
    /// Minutes a scheduler should let the job run before rescaling it (a scheduler hint:
    /// Tessera has no scheduler to tell).
    pub min_time: u64,
    pub prefer_larger_batch: bool,
    /// Batch keys outside the section are ignored (else they are an error when enabled).
    pub ignore_non_elastic_batch_info: bool,
    pub version: f64,
}

/// What the elastic rule chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticBatch {
    /// The global batch every valid world size keeps.
    pub train_batch_size: usize,
    /// The valid world sizes, ascending.
    pub world_sizes: Vec<usize>,
}

impl ElasticBatch {
    /// The micro-batch size world size `world` uses (the largest that divides its share), or
    /// the error naming the valid world sizes.
    pub fn micro_batch_for(&self, world: usize, micro_batch_sizes: &[usize]) -> KindResult<usize> {
        if !self.world_sizes.contains(&world) {
            return Err(incompatible(world, self));
        }
        let share = self.train_batch_size / world;
        micro_batch_sizes.iter().copied().filter(|&m| share % m == 0).max().ok_or_else(|| incompatible(world, self))
    }
}

fn incompatible(world: usize, b: &ElasticBatch) -> ConfigErrorKind {
    ConfigErrorKind::Unsupported {
        path: "elasticity".into(),
        value: format!("world size {world}"),
        reason: format!(
            "the elastic global batch {} cannot be kept by {world} workers; valid world sizes: {:?}",
            b.train_batch_size, b.world_sizes
        ),
    }
}

pub(crate) fn parse_elasticity(root: &Value) -> KindResult<Option<ElasticityConfig>> {
    let e = Obj::at(root, "elasticity")?;
    if !e.present() {
        return Ok(None);
    }
    let enabled = e.bool("enabled", false)?;
    let required = |key: &str| -> KindResult<Option<&Value>> {
        match e.get(key) {
            None if enabled => Err(ConfigErrorKind::invalid(&e.path(key), &Value::Null, "a value (required when elasticity is enabled)")),
            v => Ok(v),
        }
    };
    let max_train_batch_size = match required("max_train_batch_size")? {
        Some(v) => positive(&e.path("max_train_batch_size"), v)?,
        None => 2000,
    };
    let micro_batch_sizes = match required("micro_batch_sizes")? {
        Some(Value::Array(items)) if !items.is_empty() => {
            let path = e.path("micro_batch_sizes");
            items.iter().map(|v| positive(&path, v)).collect::<KindResult<Vec<usize>>>()?
        }
        Some(v) => return Err(ConfigErrorKind::invalid(&e.path("micro_batch_sizes"), v, "a non-empty array of positive integers")),
        None => vec![2, 4, 6],
    };
    let min_gpus = usize::try_from(e.positive_u64("min_gpus", 1)?).unwrap_or(usize::MAX);
    let max_gpus = usize::try_from(e.positive_u64("max_gpus", 10_000)?).unwrap_or(usize::MAX);
    if max_gpus < min_gpus {
        let why = format!("min_gpus ({min_gpus}) must not exceed max_gpus ({max_gpus})");
        return Err(ConfigErrorKind::unsupported(&e.path("max_gpus"), &Value::from(max_gpus), &why));
    }
    let version = match e.get("version") {
        None => ELASTICITY_VERSION,
        Some(v) => v
            .as_f64()
            .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            .ok_or_else(|| ConfigErrorKind::invalid(&e.path("version"), v, "a version number such as 0.1"))?,
    };
    if enabled && version != ELASTICITY_VERSION {
        let why = if version > ELASTICITY_VERSION {
            "Tessera implements elasticity version 0.1 (0.2 is DeepSpeed's model-parallel variant, which Tessera has no use for)"
        } else {
            "unknown elasticity version; use 0.1"
        };
        return Err(ConfigErrorKind::unsupported(&e.path("version"), &Value::from(version), why));
    }
    if enabled {
        if let Some(&m) = micro_batch_sizes.iter().find(|&&m| m > max_train_batch_size) {
            let why = format!("every micro-batch size must be ≤ max_train_batch_size ({max_train_batch_size})");
            return Err(ConfigErrorKind::unsupported(&e.path("micro_batch_sizes"), &Value::from(m), &why));
        }
    }
    Ok(Some(ElasticityConfig {
        enabled,
        max_train_batch_size,
        micro_batch_sizes,
        min_gpus,
        max_gpus,
        min_time: e.u64("min_time", 0)?,
        prefer_larger_batch: e.bool("prefer_larger_batch", true)?,
        ignore_non_elastic_batch_info: e.bool("ignore_non_elastic_batch_info", false)?,
        version,
    }))
}

/// Reads `tessera.elastic` (and DeepSpeed's `elasticity`: `enabled` switches the runtime on,
/// `min_gpus`/`max_gpus` bound the members) from a resolved config; off, what a process run's
/// fleet runs with ([`ElasticRun::recovery_off`]).
pub fn elastic_run(cfg: &crate::config::Config) -> Result<ElasticRun, crate::config::ConfigError> {
    let tag = |kind| crate::config::ConfigError::new(cfg.source.clone(), kind);
    let e = Obj::at(&cfg.resolved, "tessera.elastic").map_err(tag)?;
    let d = ElasticRun::default();
    let ds = cfg.elasticity.as_ref().filter(|x| x.enabled);
    let usize_of =
        |key: &str, default: usize| -> KindResult<usize> { Ok(usize::try_from(e.u64(key, default as u64)?).unwrap_or(usize::MAX)) };
    let read = || -> KindResult<ElasticRun> {
        let r = ElasticRun {
            enabled: e.bool("enabled", ds.is_some())?,
            heartbeat_ms: e.positive_u64("heartbeat_ms", d.heartbeat_ms)?,
            heartbeat_timeout_ms: e.positive_u64("heartbeat_timeout_ms", d.heartbeat_timeout_ms)?,
            step_timeout_ms: e.positive_u64("step_timeout_ms", d.step_timeout_ms)?,
            min_workers: usize_of("min_workers", ds.map_or(d.min_workers, |x| x.min_gpus))?.max(1),
            max_workers: usize_of("max_workers", ds.map_or(d.max_workers, |x| x.max_gpus))?,
            replicas: usize_of("replicas", d.replicas)?,
            max_joins: usize_of("max_joins", d.max_joins)?,
            drain_grace_ms: e.u64("drain_grace_ms", d.drain_grace_ms)?,
            join_wait_ms: e.u64("join_wait_ms", d.join_wait_ms)?,
            replica_check_interval: e.u64("replica_check_interval", d.replica_check_interval)?,
            rebalance_threshold: rebalance_threshold(&e)?,
        };
        if r.heartbeat_timeout_ms < 2 * r.heartbeat_ms {
            let why =
                format!("must be at least twice tessera.elastic.heartbeat_ms ({}) so one late heartbeat is not a death", r.heartbeat_ms);
            return Err(ConfigErrorKind::unsupported(&e.path("heartbeat_timeout_ms"), &Value::from(r.heartbeat_timeout_ms), &why));
        }
        if r.max_workers < r.min_workers {
            let why = format!("must not be below tessera.elastic.min_workers ({})", r.min_workers);
            return Err(ConfigErrorKind::unsupported(&e.path("max_workers"), &Value::from(r.max_workers), &why));
        }
        Ok(if r.enabled { r } else { r.recovery_off() })
    };
    read().map_err(tag)
}

/// `rebalance_threshold`: a fraction in [0, 1), or `false` (off) / `true` (the default).
fn rebalance_threshold(e: &Obj<'_>) -> KindResult<f64> {
    let key = "rebalance_threshold";
    match e.get(key) {
        None | Some(Value::Bool(true)) => Ok(DEFAULT_REBALANCE_THRESHOLD),
        Some(Value::Bool(false)) => Ok(0.0),
        Some(v) => v
            .as_f64()
            .filter(|x| (0.0..1.0).contains(x))
            .ok_or_else(|| ConfigErrorKind::invalid(&e.path(key), v, "a fraction in [0, 1) (0 or false: never rebalance)")),
    }
}

fn positive(path: &str, v: &Value) -> KindResult<usize> {
    v.as_u64()
        .filter(|&n| n > 0)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| ConfigErrorKind::invalid(path, v, "a positive integer"))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The largest `base × h` (h highly composite) not above `max`; `base` itself if even that is.
fn scale_up(base: usize, max: usize) -> usize {
    HCN.iter().map(|&h| base.saturating_mul(h)).take_while(|&b| b <= max).last().unwrap_or(base)
}

/// World sizes in `[lo, hi]` that can keep `batch` with some micro-batch size.
fn valid_world_sizes(batch: usize, micro: &[usize], lo: usize, hi: usize) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for &m in micro.iter().filter(|&&m| batch % m == 0) {
        let most = batch / m;
        out.extend((1..=most.min(hi)).filter(|&w| w >= lo && most % w == 0));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// DeepSpeed's elastic batch and valid world sizes for `cfg` (which must be enabled), or why
/// there is none.
pub fn compute_elastic_batch(cfg: &ElasticityConfig) -> KindResult<ElasticBatch> {
    let micro = &cfg.micro_batch_sizes;
    let lcm = micro.iter().fold(1usize, |acc, &m| acc / gcd(acc, m) * m);
    let mut candidates: Vec<usize> = micro.iter().chain(std::iter::once(&lcm)).map(|&b| scale_up(b, cfg.max_train_batch_size)).collect();
    candidates.sort_unstable();
    candidates.dedup();
    let mut best: Option<ElasticBatch> = None;
    for batch in candidates {
        let sizes = valid_world_sizes(batch, micro, cfg.min_gpus, cfg.max_gpus);
        let better = match &best {
            None => true,
            Some(b) => {
                sizes.len() > b.world_sizes.len()
                    || (sizes.len() == b.world_sizes.len()
                        && (if cfg.prefer_larger_batch { batch > b.train_batch_size } else { batch < b.train_batch_size }))
            }
        };
        if better {
            best = Some(ElasticBatch { train_batch_size: batch, world_sizes: sizes });
        }
    }
    match best {
        Some(b) if !b.world_sizes.is_empty() => Ok(b),
        _ => Err(ConfigErrorKind::unsupported(
            "elasticity",
            &Value::Bool(true),
            &format!(
                "no batch ≤ max_train_batch_size ({}) built from micro_batch_sizes {micro:?} can be kept by any world size in [{}, {}]",
                cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus
            ),
        )),
    }
}

/// With elasticity enabled: the batch triple for `world` workers (DeepSpeed's runtime rule),
/// after checking that batch keys outside the section are absent or explicitly ignored.
pub(crate) fn elastic_batch_triple(root: &Value, cfg: &ElasticityConfig, world: usize) -> KindResult<(ElasticBatch, usize, usize)> {
    if !cfg.ignore_non_elastic_batch_info {
        let keys = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"];
        if let Some(key) = keys.iter().find(|k| root.get(**k).is_some_and(|v| !v.is_null())) {
            let why = "elastic training chooses the batch sizes: remove the batch keys, or set \
                       elasticity.ignore_non_elastic_batch_info = true to have them ignored";
            return Err(ConfigErrorKind::unsupported(key, &root[*key], why));
        }
    }
    let batch = compute_elastic_batch(cfg)?;
    let micro = batch.micro_batch_for(world, &cfg.micro_batch_sizes)?;
    let accum = batch.train_batch_size / (micro * world);
    Ok((batch, micro, accum))
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::config::{elastic_world_sizes, from_value, ConfigErrorKind, ResolveContext};

    fn section(v: Value) -> ElasticityConfig {
        parse_elasticity(&json!({ "elasticity": v })).expect("parses").expect("present")
    }

    /// DeepSpeed's own unit-test config (tests/unit/elasticity/test_elastic.py).
    fn ds_10k() -> Value {
        json!({"enabled": true, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
               "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1})
    }

    #[test]
    fn matches_deepspeeds_published_examples() {
        let cfg = section(ds_10k());
        let b = compute_elastic_batch(&cfg).expect("elastic batch");
        assert_eq!((b.train_batch_size, b.world_sizes.len()), (9792, 23), "{b:?}");
        for &w in &b.world_sizes {
            let share = b.train_batch_size / w;
            assert!(b.train_batch_size % w == 0 && cfg.micro_batch_sizes.iter().any(|m| share % m == 0), "world {w}");
        }
        assert_eq!(b.micro_batch_for(64, &cfg.micro_batch_sizes).expect("64 is valid"), 17);
        let e = b.micro_batch_for(128, &cfg.micro_batch_sizes).expect_err("128 is not valid");
        assert!(e.to_string().contains("9792") && e.to_string().contains("128"), "{e}");
        let small = section(json!({"enabled": true, "max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7], "min_gpus": 1,
                                   "max_gpus": 1500}));
        let b = compute_elastic_batch(&small).expect("elastic batch");
        assert_eq!(b.micro_batch_for(7, &small.micro_batch_sizes).expect("7 is valid"), 3);
    }

    #[test]
    fn hand_computed_defaults() {
        // micro [2, 4, 6], max 2000: candidates 2·840 = 1680 and 4·360 = 6·240 = 12·120 = 1440.
        // 1680 is kept by the divisors of 840 (32 world sizes), 1440 by those of 720 (30).
        let cfg = section(json!({"enabled": true, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}));
        let b = compute_elastic_batch(&cfg).expect("elastic batch");
        assert_eq!(b.train_batch_size, 1680);
        let divisors_840: Vec<usize> = (1..=840).filter(|d| 840 % d == 0).collect();
        assert_eq!(b.world_sizes, divisors_840);
        assert_eq!(b.micro_batch_for(8, &cfg.micro_batch_sizes).expect("valid"), 6, "1680 / 8 = 210 = 6 · 35");
        assert_eq!(b.micro_batch_for(5, &cfg.micro_batch_sizes).expect("valid"), 6, "336 = 6 · 56");
        let e = b.micro_batch_for(16, &cfg.micro_batch_sizes).expect_err("16 does not divide 840");
        assert!(e.to_string().contains("valid world sizes"), "{e}");
        assert_eq!(b.micro_batch_for(14, &cfg.micro_batch_sizes).expect("valid"), 6, "120 = 6 · 20");
        assert_eq!(b.micro_batch_for(105, &cfg.micro_batch_sizes).expect("valid"), 4, "16 = 4 · 4");
    }

    #[test]
    fn ties_follow_prefer_larger_batch() {
        // [2, 3], max 7: 2·2 = 4 (worlds 1, 2), 3·2 = 6 (1, 2, 3 via 2; 1, 2 via 3), lcm 6 → 6.
        let b = compute_elastic_batch(&section(json!({"enabled": true, "max_train_batch_size": 7, "micro_batch_sizes": [2, 3]})));
        assert_eq!(b.expect("batch"), ElasticBatch { train_batch_size: 6, world_sizes: vec![1, 2, 3] });
        // [4, 6], max 12: 4·2 = 8 (worlds 1, 2 via 4), 6·2 = 12 (1, 2, 3 via 4; 1, 2 via 6), lcm 12 → 12.
        let b = compute_elastic_batch(&section(json!({"enabled": true, "max_train_batch_size": 12, "micro_batch_sizes": [4, 6]})));
        assert_eq!(b.expect("batch"), ElasticBatch { train_batch_size: 12, world_sizes: vec![1, 2, 3] });
        // [2, 3], max 3: 2 (world 1) and 3 (world 1) tie; the lcm 6 is above the maximum and stays 6
        // (worlds 1, 2, 3 via 2): DeepSpeed keeps a base above max_train_batch_size as it is.
        let above = compute_elastic_batch(&section(json!({"enabled": true, "max_train_batch_size": 3, "micro_batch_sizes": [2, 3]})));
        assert_eq!(above.expect("batch"), ElasticBatch { train_batch_size: 6, world_sizes: vec![1, 2, 3] });
        // [1, 3], max 5, max_gpus 1: 1·4 = 4 and 3 both keep only world 1: the tie rule decides.
        let tie = json!({"enabled": true, "max_train_batch_size": 5, "micro_batch_sizes": [1, 3], "max_gpus": 1});
        assert_eq!(compute_elastic_batch(&section(tie.clone())).expect("batch").train_batch_size, 4);
        let mut smaller = tie;
        smaller["prefer_larger_batch"] = json!(false);
        assert_eq!(compute_elastic_batch(&section(smaller)).expect("batch").train_batch_size, 3);
    }

    #[test]
    fn invalid_sections_are_rejected_with_the_key() {
        let bad = |v: Value| parse_elasticity(&json!({ "elasticity": v })).expect_err("invalid").to_string();
        assert!(bad(json!({"enabled": true, "micro_batch_sizes": [2]})).contains("elasticity.max_train_batch_size"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8})).contains("elasticity.micro_batch_sizes"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [1, -1]})).contains("positive"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [2, 0.5]})).contains("positive"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": 5})).contains("array"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [16]})).contains("≤ max_train_batch_size"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 4, "max_gpus": 2}))
            .contains("min_gpus (4)"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [2], "version": 0.3})).contains("0.1"));
        assert!(bad(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [2], "version": "0.2"})).contains("0.1"));
        // Disabled: DeepSpeed's defaults, nothing required.
        assert_eq!(section(json!({"enabled": false})).micro_batch_sizes, vec![2, 4, 6]);
        let none = compute_elastic_batch(&section(json!({"enabled": true, "max_train_batch_size": 8, "micro_batch_sizes": [8],
                                                         "min_gpus": 2, "max_gpus": 4})));
        assert!(none.expect_err("no world size").to_string().contains("[2, 4]"));
    }

    #[test]
    fn enabled_elasticity_chooses_the_batch_triple() {
        let ctx = |w| ResolveContext::with_world(w);
        let el = json!({"enabled": true, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]});
        let cfg = from_value(json!({ "elasticity": el }), &[], &ctx(8)).expect("loads");
        assert_eq!((cfg.train_batch_size, cfg.micro_batch_per_gpu, cfg.gradient_accumulation_steps), (1680, 6, 35));
        assert_eq!(cfg.resolved["train_batch_size"], json!(1680));
        assert_eq!(elastic_world_sizes(&cfg).len(), 32);
        // A world size that cannot keep the batch is refused, naming the valid ones.
        let e = from_value(json!({ "elasticity": el }), &[], &ctx(9)).expect_err("9 does not divide 840");
        let text = e.to_string();
        assert!(text.contains("world size 9") && text.contains("1680") && text.contains("840"), "{text}");
        // Batch keys outside the section: an error unless explicitly ignored (then overridden).
        let e = from_value(json!({"train_batch_size": 32, "elasticity": el}), &[], &ctx(8)).expect_err("batch keys");
        assert!(matches!(&e.kind, ConfigErrorKind::Unsupported { path, .. } if path == "train_batch_size"), "{e}");
        let mut ignoring = el.clone();
        ignoring["ignore_non_elastic_batch_info"] = json!(true);
        let cfg = from_value(json!({"train_batch_size": 32, "elasticity": ignoring}), &[], &ctx(8)).expect("ignored");
        assert_eq!(cfg.train_batch_size, 1680);
        // Disabled: the section is parsed, the batch keys rule, and only the configured world keeps it.
        let cfg = from_value(json!({"train_batch_size": 32, "elasticity": {"enabled": false}}), &[], &ctx(4)).expect("loads");
        assert_eq!((cfg.train_batch_size, elastic_world_sizes(&cfg)), (32, vec![4]));
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        // min_time is accepted but has no scheduler to inform.
        let mut timed = el.clone();
        timed["min_time"] = json!(20);
        let cfg = from_value(json!({ "elasticity": timed }), &[], &ctx(2)).expect("loads");
        assert!(cfg.warnings.iter().any(|w| w.contains("elasticity.min_time")), "{:?}", cfg.warnings);
    }

    #[test]
    fn the_rebalance_threshold_is_a_fraction_or_off() {
        let run = |v: Value| {
            let cfg = from_value(
                json!({"train_batch_size": 8, "tessera": {"elastic": {"enabled": true, "rebalance_threshold": v}}}),
                &[],
                &ResolveContext::with_world(2),
            )
            .expect("loads");
            elastic_run(&cfg)
        };
        let on = json!({"train_batch_size": 8, "tessera": {"elastic": {"enabled": true}}});
        let cfg = from_value(on, &[], &ResolveContext::with_world(2)).expect("loads");
        assert_eq!(elastic_run(&cfg).expect("default").rebalance_threshold, DEFAULT_REBALANCE_THRESHOLD);
        assert_eq!(run(json!(false)).expect("off").rebalance_threshold, 0.0);
        assert_eq!(run(json!(0)).expect("off").rebalance_threshold, 0.0);
        assert_eq!(run(json!(true)).expect("on").rebalance_threshold, DEFAULT_REBALANCE_THRESHOLD);
        assert_eq!(run(json!(0.35)).expect("a fraction").rebalance_threshold, 0.35);
        for bad in [json!(1.5), json!(-0.1), json!("often")] {
            let e = run(bad.clone()).expect_err("refused").to_string();
            assert!(e.contains("tessera.elastic.rebalance_threshold") && e.contains("a fraction in [0, 1)"), "{bad}: {e}");
        }
    }

    /// Off, a process run's fleet keeps the failure detector's settings and none of recovery's:
    /// no replicas, no joins, no rebalancing, whatever the section says.
    #[test]
    fn without_elasticity_the_fleet_runs_with_recovery_off() {
        let off = json!({"train_batch_size": 8, "tessera": {"elastic": {"replicas": 2, "max_joins": 3, "heartbeat_timeout_ms": 900}}});
        let er = elastic_run(&from_value(off, &[], &ResolveContext::with_world(2)).expect("loads")).expect("reads");
        assert!(!er.enabled);
        assert_eq!((er.replicas, er.max_joins, er.rebalance_threshold, er.replica_check_interval), (0, 0, 0.0, 0));
        assert_eq!(er.heartbeat_timeout_ms, 900, "the failure detector's bound is the configured one");
        let on = json!({"train_batch_size": 8, "tessera": {"elastic": {"enabled": true, "replicas": 2, "max_joins": 3}}});
        let er = elastic_run(&from_value(on, &[], &ResolveContext::with_world(2)).expect("loads")).expect("reads");
        assert_eq!((er.replicas, er.max_joins), (2, 3));
    }
}
