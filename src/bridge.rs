//! Translates the typed config into the kernel and monitor types that do the work (the config
//! layer stays the one place that reads JSON; the kernels never see it).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tessera_kernels::optim::{
    AdagradParams, AdamParams, DynamicLossScaler, LambParams, LionParams, LossScaler, LossScalerState, OptimError, OptimizerKind, SgdParams,
};

use crate::config::{Config, OptimizerConfig, Precision, SchedulerConfig};
use crate::engine::Precision16;
use crate::monitor::{CsvOpts, JsonlOpts, MonitorConfig, MonitorSet, TensorboardOpts};
use crate::schedule;

pub fn precision(p: &Precision) -> Precision16 {
    match p {
        Precision::F32 => Precision16::F32,
        Precision::Bf16 => Precision16::Bf16,
        Precision::Fp16(_) => Precision16::Fp16,
    }
}

/// The optimizer with its hyper-parameters. Under OneCycle with `cycle_momentum` the
/// optimizers that have betas (Adam, AdamW, Lamb, Lion) carry the momentum cycle, which
/// replaces their configured betas step by step as DeepSpeed's scheduler does; SGD and Adagrad
/// have no betas and DeepSpeed does not cycle them (the config layer warns).
pub fn optimizer_kind(o: &OptimizerConfig, sched: Option<&SchedulerConfig>) -> OptimizerKind {
    let momentum_cycle = schedule::momentum_cycle(sched);
    match *o {
        OptimizerConfig::Adam { lr, betas, eps, weight_decay, adam_w_mode, bias_correction } => {
            OptimizerKind::Adam(AdamParams { lr, betas, eps, weight_decay, adam_w_mode, bias_correction, momentum_cycle })
        }
        OptimizerConfig::Lamb { lr, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff } => {
            OptimizerKind::Lamb(LambParams { lr, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff, momentum_cycle })
        }
        OptimizerConfig::Lion { lr, betas, weight_decay } => OptimizerKind::Lion(LionParams { lr, betas, weight_decay, momentum_cycle }),
        OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov } => {
            OptimizerKind::Sgd(SgdParams { lr, momentum, dampening, weight_decay, nesterov })
        }
        OptimizerConfig::Adagrad { lr, lr_decay, eps, weight_decay, initial_accumulator_value } => {
            OptimizerKind::Adagrad(AdagradParams { lr, lr_decay, eps, weight_decay, initial_accumulator_value })
        }
    }
}

/// An invalid optimizer or loss-scaler parameter as the config key it came from
/// (`section.name`); the kernels name parameters, not config paths.
pub fn keyed(e: OptimError, section: &str) -> anyhow::Error {
    match e {
        OptimError::InvalidParam { name, value, expected, .. } => {
            anyhow::anyhow!("{section}.{name} = {value} is invalid: expected {expected}")
        }
        other => anyhow::Error::new(other),
    }
}

/// The fp16 loss scaler (`None` for f32 and bf16, which need none).
pub fn loss_scaler(p: &Precision) -> Result<Option<LossScaler>> {
    let Precision::Fp16(f) = p else { return Ok(None) };
    if f.loss_scale > 0.0 {
        return Ok(Some(LossScaler::Static(f.loss_scale)));
    }
    let d = DynamicLossScaler::new(f.initial_scale_power, f.loss_scale_window, f.min_loss_scale, f.hysteresis)
        .map_err(|e| keyed(e, "fp16"))?
        .with_consecutive_hysteresis(f.consecutive_hysteresis);
    Ok(Some(LossScaler::Dynamic(d)))
}

pub fn scaler_to_json(s: &LossScaler) -> serde_json::Value {
    let st = s.state();
    serde_json::json!({
        "cur_scale": st.cur_scale,
        "cur_iter": st.cur_iter,
        "last_overflow_iter": st.last_overflow_iter,
        "cur_hysteresis": st.cur_hysteresis,
    })
}

pub fn scaler_from_json(s: &mut LossScaler, v: &serde_json::Value) -> Result<()> {
    let f = |k: &str| v.get(k).with_context(|| format!("loss scaler state lacks `{k}`"));
    let st = LossScalerState {
        cur_scale: f("cur_scale")?.as_f64().context("cur_scale is not a number")? as f32,
        cur_iter: f("cur_iter")?.as_u64().context("cur_iter is not an integer")?,
        last_overflow_iter: f("last_overflow_iter")?.as_i64().context("last_overflow_iter is not an integer")?,
        cur_hysteresis: f("cur_hysteresis")?.as_u64().context("cur_hysteresis is not an integer")? as u32,
    };
    s.load_state(&st).context("loss scaler state")?;
    Ok(())
}

fn monitor_dir(path: &str, out_dir: &Path) -> PathBuf {
    if path.is_empty() {
        out_dir.to_path_buf()
    } else {
        PathBuf::from(path)
    }
}

/// The monitors the config enables; an empty `output_path` means the run's output directory.
pub fn monitors(cfg: &Config, out_dir: &Path) -> Result<MonitorSet> {
    let m = &cfg.monitors;
    let mc = MonitorConfig {
        tensorboard: m.tensorboard.enabled.then(|| TensorboardOpts {
            output_path: monitor_dir(&m.tensorboard.output_path, out_dir),
            job_name: m.tensorboard.job_name.clone(),
        }),
        csv: m
            .csv_monitor
            .enabled
            .then(|| CsvOpts { output_path: monitor_dir(&m.csv_monitor.output_path, out_dir), job_name: m.csv_monitor.job_name.clone() }),
        jsonl: cfg.tessera.jsonl_monitor.then(|| JsonlOpts { path: out_dir.join("metrics.jsonl") }),
    };
    MonitorSet::from_config(&mc).context("creating monitors")
}
