//! Training monitors (DeepSpeed-style): TensorBoard event files without protobuf, per-tag CSV
//! files, JSON lines, a [`MonitorSet`] fan-out, and an SVG loss-curve writer.

mod csv;
mod jsonl;
mod svg;
mod tensorboard;

#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

pub use csv::CsvMonitor;
pub use jsonl::JsonlMonitor;
pub use svg::write_loss_curve_svg;
pub use tensorboard::{encode_event, masked_crc32c, TensorboardMonitor, TfEventPayload};

/// One scalar sample: `tag` (e.g. "Train/Samples/train_loss") at training `step`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub tag: String,
    pub value: f64,
    pub step: u64,
}

impl Event {
    pub fn new(tag: impl Into<String>, value: f64, step: u64) -> Self {
        Event { tag: tag.into(), value, step }
    }
}

/// A sink for scalar events.
pub trait Monitor {
    fn write(&mut self, events: &[Event]) -> io::Result<()>;
    fn flush(&mut self) -> io::Result<()>;
}

/// Errors creating monitors; each names the path involved.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    /// The I/O error is in the message, not a `source` (`{:#}` would print it twice).
    #[error("monitor: {op} `{path}`: {err}")]
    Io { op: &'static str, path: PathBuf, err: io::Error },
}

pub(crate) fn monitor_io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> MonitorError {
    MonitorError::Io { op, path: path.into(), err: source }
}

/// Wrap an io error with the path it concerns (monitor write paths return plain `io::Result`).
pub(crate) fn with_path(path: &std::path::Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("`{}`: {e}", path.display()))
}

/// Seconds since the Unix epoch as f64 (0.0 if the clock is before 1970).
pub(crate) fn wall_time_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// TensorBoard monitor options: files go to `output_path/job_name/`.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorboardOpts {
    pub output_path: PathBuf,
    pub job_name: String,
}

/// CSV monitor options: one `<tag>.csv` per tag in `output_path/job_name/`.
#[derive(Debug, Clone, PartialEq)]
pub struct CsvOpts {
    pub output_path: PathBuf,
    pub job_name: String,
}

/// JSON-lines monitor options: all events appended to `path`.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonlOpts {
    pub path: PathBuf,
}

/// Which monitors to enable (absent = disabled).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MonitorConfig {
    pub tensorboard: Option<TensorboardOpts>,
    pub csv: Option<CsvOpts>,
    pub jsonl: Option<JsonlOpts>,
}

/// Several monitors written together.
#[derive(Default)]
pub struct MonitorSet {
    monitors: Vec<Box<dyn Monitor + Send>>,
}

impl MonitorSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Create every monitor enabled in `config` (directories are created).
    pub fn from_config(config: &MonitorConfig) -> Result<Self, MonitorError> {
        let mut set = MonitorSet::new();
        if let Some(o) = &config.tensorboard {
            set.push(Box::new(TensorboardMonitor::new(o)?));
        }
        if let Some(o) = &config.csv {
            set.push(Box::new(CsvMonitor::new(o)?));
        }
        if let Some(o) = &config.jsonl {
            set.push(Box::new(JsonlMonitor::new(o)?));
        }
        Ok(set)
    }

    pub fn push(&mut self, monitor: Box<dyn Monitor + Send>) {
        self.monitors.push(monitor);
    }

    pub fn len(&self) -> usize {
        self.monitors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.monitors.is_empty()
    }
}

impl Monitor for MonitorSet {
    /// Writes to every monitor even if one fails; returns the first error.
    fn write(&mut self, events: &[Event]) -> io::Result<()> {
        let mut first_err = None;
        for m in &mut self.monitors {
            if let Err(e) = m.write(events) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut first_err = None;
        for m in &mut self.monitors {
            if let Err(e) = m.flush() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
