//! Typed `optimizer` and `scheduler` sections: DeepSpeed's type names (case-insensitive),
//! per-type parameter lists and defaults.

use serde_json::Value;

use crate::config::auto::ResolveContext;
use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::keys;
use crate::config::reader::Obj;
use crate::schedule::{LrRangeTest, OneCycle, SchedulerConfig, WarmupCosineLr, WarmupDecayLr, WarmupLr, WarmupType, ONE_CYCLE_BETA2};

/// A DeepSpeed `optimizer` section, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// "Adam" and "AdamW"; `adam_w_mode` = decoupled weight decay (AdamW).
    Adam {
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        adam_w_mode: bool,
        bias_correction: bool,
    },
    Lamb {
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        bias_correction: bool,
        max_coeff: f32,
        min_coeff: f32,
    },
    Lion {
        lr: f32,
        betas: (f32, f32),
        weight_decay: f32,
    },
    Sgd {
        lr: f32,
        momentum: f32,
        dampening: f32,
        weight_decay: f32,
        nesterov: bool,
    },
    /// torch.optim.Adagrad (what DeepSpeed builds for "Adagrad" without offload).
    Adagrad {
        lr: f32,
        lr_decay: f32,
        eps: f32,
        weight_decay: f32,
        initial_accumulator_value: f32,
    },
}

impl OptimizerConfig {
    /// The configured (base) learning rate.
    pub fn lr(&self) -> f32 {
        match self {
            OptimizerConfig::Adam { lr, .. }
            | OptimizerConfig::Lamb { lr, .. }
            | OptimizerConfig::Lion { lr, .. }
            | OptimizerConfig::Sgd { lr, .. }
            | OptimizerConfig::Adagrad { lr, .. } => *lr,
        }
    }
}

const SUPPORTED: &[&str] = &["Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad"];
const UNSUPPORTED: &[&str] = &["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Muon"];
const ADAM_KEYS: &[&str] = &[
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "bias_correction",
    "torch_adam",
    "amsgrad",
    "set_grad_none",
    "fp32_optimizer_states",
];
const LAMB_KEYS: &[&str] =
    &["lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff", "amsgrad", "eps_inside_sqrt"];
const LION_KEYS: &[&str] = &["lr", "betas", "weight_decay", "set_grad_none"];
const SGD_KEYS: &[&str] = &["lr", "momentum", "dampening", "weight_decay", "nesterov"];
/// torch.optim.Adagrad's parameters, and DeepSpeedCPUAdagrad's `amsgrad` (false only: true is
/// rejected for every type) and `fp32_optimizer_states` (states are always f32).
const ADAGRAD_KEYS: &[&str] =
    &["lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value", "maximize", "amsgrad", "fp32_optimizer_states"];

/// Parse the `optimizer` section; a missing one is AdamW with the context's lr.
pub(crate) fn parse_optimizer(root: &Value, ctx: &ResolveContext) -> KindResult<OptimizerConfig> {
    let section = Obj::at(root, "optimizer")?;
    let d = &ctx.defaults;
    let default_lr = ctx.lr.unwrap_or(d.lr);
    if !section.present() {
        return Ok(OptimizerConfig::Adam {
            lr: default_lr,
            betas: d.betas,
            eps: d.eps,
            weight_decay: d.weight_decay,
            adam_w_mode: true,
            bias_correction: true,
        });
    }
    let name = section.opt_string("type")?.ok_or_else(|| {
        let expected = format!("one of {} (the optimizer type is required)", SUPPORTED.join(", "));
        ConfigErrorKind::invalid("optimizer.type", &Value::Null, &expected)
    })?;
    let p = Obj::at(root, "optimizer.params")?;
    if let Some(v) = p.get("max_grad_norm") {
        let why = "not an optimizer parameter (as in DeepSpeed); use the top-level gradient_clipping";
        return Err(ConfigErrorKind::unsupported("optimizer.params.max_grad_norm", v, why));
    }
    reject_true(&p, "amsgrad", "AMSGrad is not implemented")?;
    reject_true(&p, "eps_inside_sqrt", "eps inside the square root is not implemented")?;
    let lr = p.non_negative_f32("lr", default_lr)?;
    let wd = p.non_negative_f32("weight_decay", d.weight_decay)?;
    match name.to_ascii_lowercase().as_str() {
        kind @ ("adam" | "adamw") => {
            p.only_keys(ADAM_KEYS, &name)?;
            Ok(OptimizerConfig::Adam {
                lr,
                betas: p.betas("betas", d.betas)?,
                eps: p.non_negative_f32("eps", d.eps)?,
                weight_decay: wd,
                adam_w_mode: kind == "adamw" || p.bool("adam_w_mode", true)?,
                bias_correction: p.bool("bias_correction", true)?,
            })
        }
        "lamb" => {
            p.only_keys(LAMB_KEYS, &name)?;
            Ok(OptimizerConfig::Lamb {
                lr,
                betas: p.betas("betas", d.betas)?,
                eps: p.non_negative_f32("eps", d.eps)?,
                weight_decay: wd,
                bias_correction: p.bool("bias_correction", true)?,
                max_coeff: p.non_negative_f32("max_coeff", 10.0)?,
                min_coeff: p.non_negative_f32("min_coeff", 0.01)?,
            })
        }
        "lion" => {
            p.only_keys(LION_KEYS, &name)?;
            Ok(OptimizerConfig::Lion { lr, betas: p.betas("betas", (0.9, 0.999))?, weight_decay: wd })
        }
        "sgd" => parse_sgd(&p, &name, lr, wd),
        "adagrad" => {
            p.only_keys(ADAGRAD_KEYS, &name)?;
            reject_true(&p, "maximize", "maximizing the objective is not implemented")?;
            Ok(OptimizerConfig::Adagrad {
                lr,
                lr_decay: p.non_negative_f32("lr_decay", 0.0)?,
                eps: p.non_negative_f32("eps", 1e-10)?,
                weight_decay: wd,
                initial_accumulator_value: p.non_negative_f32("initial_accumulator_value", 0.0)?,
            })
        }
        _ => Err(unknown_type("optimizer.type", &name, SUPPORTED, UNSUPPORTED)),
    }
}

fn parse_sgd(p: &Obj<'_>, name: &str, lr: f32, wd: f32) -> KindResult<OptimizerConfig> {
    p.only_keys(SGD_KEYS, name)?;
    let momentum = p.non_negative_f32("momentum", 0.0)?;
    let dampening = p.f32("dampening", 0.0)?;
    let nesterov = p.bool("nesterov", false)?;
    if nesterov && (momentum <= 0.0 || dampening != 0.0) {
        let why = "Nesterov momentum needs momentum > 0 and dampening = 0";
        return Err(ConfigErrorKind::unsupported(&p.path("nesterov"), &Value::Bool(true), why));
    }
    Ok(OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay: wd, nesterov })
}

fn reject_true(p: &Obj<'_>, key: &str, why: &str) -> KindResult<()> {
    match p.get(key) {
        Some(v @ Value::Bool(true)) => Err(ConfigErrorKind::unsupported(&p.path(key), v, why)),
        _ => Ok(()),
    }
}

/// Error for an unrecognised type name: "not supported" for known DeepSpeed types Tessera
/// lacks, otherwise the list of valid names and the nearest one.
fn unknown_type(path: &str, name: &str, valid: &[&str], unsupported: &[&str]) -> ConfigErrorKind {
    let shown = Value::String(name.to_string());
    if unsupported.iter().any(|u| u.eq_ignore_ascii_case(name)) {
        let why = format!("`{name}` is a DeepSpeed type that Tessera does not support (supported: {})", valid.join(", "));
        return ConfigErrorKind::unsupported(path, &shown, &why);
    }
    let hint = keys::nearest(name, valid).map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default();
    ConfigErrorKind::invalid(path, &shown, &format!("one of {}{hint}", valid.join(", ")))
}

const SCHEDULERS: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"];
const WARMUP_KEYS: &[&str] = &["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"];
const DECAY_KEYS: &[&str] = &["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"];
const COSINE_KEYS: &[&str] = &["total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"];
const ONE_CYCLE_KEYS: &[&str] = &[
    "cycle_min_lr",
    "cycle_max_lr",
    "decay_lr_rate",
    "cycle_first_step_size",
    "cycle_second_step_size",
    "cycle_first_stair_count",
    "cycle_second_stair_count",
    "decay_step_size",
    "cycle_momentum",
    "cycle_min_mom",
    "cycle_max_mom",
    "decay_mom_rate",
];
const RANGE_KEYS: &[&str] = &["lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase"];

/// Parse the `scheduler` section (`None` when absent). Warnings (e.g. an unknown
/// warmup_type, which DeepSpeed replaces by "log") are appended to `warnings`.
pub(crate) fn parse_scheduler(root: &Value, warnings: &mut Vec<String>) -> KindResult<Option<SchedulerConfig>> {
    let section = Obj::at(root, "scheduler")?;
    if !section.present() {
        return Ok(None);
    }
    let name = section.opt_string("type")?.ok_or_else(|| {
        let expected = format!("one of {} (the scheduler type is required)", SCHEDULERS.join(", "));
        ConfigErrorKind::invalid("scheduler.type", &Value::Null, &expected)
    })?;
    let p = Obj::at(root, "scheduler.params")?;
    let canonical = SCHEDULERS.iter().find(|s| s.eq_ignore_ascii_case(&name));
    let sched = match canonical.copied() {
        Some("WarmupLR") => {
            p.only_keys(WARMUP_KEYS, "WarmupLR")?;
            SchedulerConfig::WarmupLr(WarmupLr {
                warmup_min_lr: p.f32("warmup_min_lr", 0.0)?,
                warmup_max_lr: p.opt_f32("warmup_max_lr")?,
                warmup_num_steps: p.u64("warmup_num_steps", 1000)?,
                warmup_type: warmup_type(&p, warnings)?,
            })
        }
        Some("WarmupDecayLR") => {
            p.only_keys(DECAY_KEYS, "WarmupDecayLR")?;
            SchedulerConfig::WarmupDecayLr(WarmupDecayLr {
                warmup_min_lr: p.f32("warmup_min_lr", 0.0)?,
                warmup_max_lr: p.f32("warmup_max_lr", 0.001)?,
                warmup_num_steps: p.u64("warmup_num_steps", 1000)?,
                warmup_type: warmup_type(&p, warnings)?,
                total_num_steps: required_steps(&p)?,
            })
        }
        Some("WarmupCosineLR") => parse_cosine(&p, warnings)?,
        Some("OneCycle") => {
            let one = parse_one_cycle(&p)?;
            if let SchedulerConfig::OneCycle(o) = &one {
                check_momentum_cycle(root, &p, o, warnings)?;
            }
            one
        }
        Some(_) => {
            p.only_keys(RANGE_KEYS, "LRRangeTest")?;
            SchedulerConfig::LrRangeTest(LrRangeTest {
                lr_range_test_min_lr: p.f32("lr_range_test_min_lr", 1e-3)?,
                lr_range_test_step_size: p.positive_u64("lr_range_test_step_size", 2000)?,
                lr_range_test_step_rate: p.f32("lr_range_test_step_rate", 1.0)?,
                lr_range_test_staircase: p.bool("lr_range_test_staircase", false)?,
            })
        }
        None => return Err(unknown_type("scheduler.type", &name, SCHEDULERS, &[])),
    };
    Ok(Some(sched))
}

/// OneCycle's `cycle_momentum` against the optimizer, as DeepSpeed's scheduler treats it: an
/// optimizer with betas (Adam, AdamW, Lamb, Lion; also the default AdamW) gets
/// `betas = (cycled momentum, 0.99)` every step, so both bounds must be valid betas and
/// explicitly configured betas are replaced (a warning says so); SGD and Adagrad have no betas,
/// and DeepSpeed disables the cycle for them with a warning, as Tessera does.
fn check_momentum_cycle(root: &Value, p: &Obj<'_>, o: &OneCycle, warnings: &mut Vec<String>) -> KindResult<()> {
    if !o.cycle_momentum {
        return Ok(());
    }
    let no_betas = root
        .pointer("/optimizer/type")
        .and_then(Value::as_str)
        .and_then(|t| ["SGD", "Adagrad"].into_iter().find(|n| n.eq_ignore_ascii_case(t)));
    if let Some(name) = no_betas {
        warnings.push(format!(
            "`scheduler.params.cycle_momentum` is true (DeepSpeed's default for OneCycle) but {name} has no betas: as in \
             DeepSpeed, its momentum is not cycled; set cycle_momentum to false to silence this"
        ));
        return Ok(());
    }
    for (key, v) in [("cycle_min_mom", o.cycle_min_mom), ("cycle_max_mom", o.cycle_max_mom)] {
        if !(0.0..1.0).contains(&v) {
            let why = "a number in [0, 1) (with cycle_momentum, OneCycle sets the optimizer's beta1 to it)";
            return Err(ConfigErrorKind::invalid(&p.path(key), &Value::from(v), why));
        }
    }
    if root.pointer("/optimizer/params/betas").is_some() {
        warnings.push(format!(
            "`optimizer.params.betas` is replaced by OneCycle's momentum cycle (`scheduler.params.cycle_momentum` is true, \
             DeepSpeed's default): beta1 moves between {} and {} and beta2 is {ONE_CYCLE_BETA2}, as in DeepSpeed; set \
             cycle_momentum to false to keep the configured betas",
            o.cycle_max_mom, o.cycle_min_mom
        ));
    }
    Ok(())
}

fn parse_cosine(p: &Obj<'_>, warnings: &mut Vec<String>) -> KindResult<SchedulerConfig> {
    p.only_keys(COSINE_KEYS, "WarmupCosineLR")?;
    Ok(SchedulerConfig::WarmupCosineLr(WarmupCosineLr {
        total_num_steps: required_steps(p)?,
        warmup_min_ratio: p.f32("warmup_min_ratio", 0.0)?,
        cos_min_ratio: p.f32("cos_min_ratio", 0.0001)?,
        warmup_num_steps: p.u64("warmup_num_steps", 1000)?,
        warmup_type: warmup_type(p, warnings)?,
    }))
}

fn parse_one_cycle(p: &Obj<'_>) -> KindResult<SchedulerConfig> {
    p.only_keys(ONE_CYCLE_KEYS, "OneCycle")?;
    let first = p.positive_u64("cycle_first_step_size", 2000)?;
    let first_stairs = p.u64("cycle_first_stair_count", 0)?;
    Ok(SchedulerConfig::OneCycle(OneCycle {
        cycle_min_lr: p.required_f32("cycle_min_lr", "required by OneCycle")?,
        cycle_max_lr: p.required_f32("cycle_max_lr", "required by OneCycle")?,
        decay_lr_rate: p.f32("decay_lr_rate", 0.0)?,
        cycle_first_step_size: first,
        cycle_second_step_size: p.u64("cycle_second_step_size", first)?,
        cycle_first_stair_count: first_stairs,
        cycle_second_stair_count: p.u64("cycle_second_stair_count", first_stairs)?,
        decay_step_size: p.u64("decay_step_size", 0)?,
        cycle_momentum: p.bool("cycle_momentum", true)?,
        cycle_min_mom: p.f32("cycle_min_mom", 0.8)?,
        cycle_max_mom: p.f32("cycle_max_mom", 0.9)?,
        decay_mom_rate: p.f32("decay_mom_rate", 0.0)?,
    }))
}

fn required_steps(p: &Obj<'_>) -> KindResult<u64> {
    match p.opt_u64("total_num_steps")? {
        Some(n) if n > 0 => Ok(n),
        other => Err(ConfigErrorKind::invalid(
            &p.path("total_num_steps"),
            &other.map_or(Value::Null, Value::from),
            "a positive integer (required; \"auto\" = the run's step count)",
        )),
    }
}

fn warmup_type(p: &Obj<'_>, warnings: &mut Vec<String>) -> KindResult<WarmupType> {
    let name = p.string("warmup_type", "log")?;
    Ok(match name.as_str() {
        "log" => WarmupType::Log,
        "linear" => WarmupType::Linear,
        other => {
            warnings
                .push(format!("`{}` = \"{other}\" is not \"log\" or \"linear\"; using \"log\" as DeepSpeed does", p.path("warmup_type")));
            WarmupType::Log
        }
    })
}
