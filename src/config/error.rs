//! Errors of the DeepSpeed-JSON config layer: every error names the file and, where one
//! applies, the JSON key path, the offending value and what was expected.

use std::fmt;

/// What went wrong while loading a config; wrapped with the file name by [`ConfigError`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigErrorKind {
    #[error("cannot read the file: {0}")]
    Io(std::io::Error),
    #[error("invalid JSON at {line}:{column}: {message}")]
    Syntax { line: usize, column: usize, message: String },
    #[error("`{path}` = {value}: expected {expected}")]
    InvalidValue { path: String, value: String, expected: String },
    #[error("unknown key `{path}`{}", did_you_mean(.suggestion))]
    UnknownKey { path: String, suggestion: Option<String> },
    #[error(
        "inconsistent batch sizes: train_batch_size ({train_batch}) != \
         train_micro_batch_size_per_gpu ({micro_batch}) × gradient_accumulation_steps \
         ({grad_accum}) × world size ({world_size}) = {product}",
        product = .micro_batch * .grad_accum * .world_size
    )]
    BatchMismatch { train_batch: usize, micro_batch: usize, grad_accum: usize, world_size: usize },
    #[error(
        "train_batch_size ({train_batch}) is not divisible by {divisor_expr} = {divisor} \
         (world size {world_size})"
    )]
    BatchNotDivisible { train_batch: usize, divisor: usize, divisor_expr: String, world_size: usize },
    #[error(
        "neither train_batch_size nor train_micro_batch_size_per_gpu is set; \
         set at least one of them"
    )]
    BatchMissing,
    #[error(
        "unresolved \"auto\" values (set them in the config, or with `--set KEY=VALUE`): \
         {}",
        .paths.join(", ")
    )]
    UnresolvedAuto { paths: Vec<String> },
    #[error("`{path}` = {value}: {reason}")]
    Unsupported { path: String, value: String, reason: String },
    #[error("fp16.enabled and bf16.enabled are both true; enable at most one of them")]
    PrecisionConflict,
    #[error("--set `{arg}`: {reason}")]
    Override { arg: String, reason: String },
}

fn did_you_mean(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(s) => format!(" (did you mean `{s}`?)"),
        None => String::new(),
    }
}

/// A config error together with the file it came from (`<inline>` for [`crate::config::from_value`]).
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub kind: ConfigErrorKind,
    /// The command-line override (`KEY=VALUE`, from `--set` or a flag such as `--steps`) that
    /// set the key the error is about, when one did: the value is then not the file's.
    pub set_by: Option<Box<str>>,
}

impl ConfigError {
    /// An error of `file` that no override is blamed for.
    pub fn new(file: impl Into<String>, kind: ConfigErrorKind) -> Self {
        ConfigError { file: file.into(), kind, set_by: None }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ConfigErrorKind::Syntax { line, column, message } => write!(f, "{}:{line}:{column}: invalid JSON: {message}", self.file)?,
            kind => write!(f, "{}: {kind}", self.file)?,
        }
        match &self.set_by {
            Some(arg) => write!(f, " (from the command line: `{arg}`)"),
            None => Ok(()),
        }
    }
}

impl ConfigErrorKind {
    /// The key path the error is about, where it names one.
    pub(crate) fn path(&self) -> Option<&str> {
        match self {
            ConfigErrorKind::InvalidValue { path, .. }
            | ConfigErrorKind::UnknownKey { path, .. }
            | ConfigErrorKind::Unsupported { path, .. } => Some(path),
            _ => None,
        }
    }

    /// Shorthand for [`ConfigErrorKind::InvalidValue`].
    pub(crate) fn invalid(path: &str, value: &serde_json::Value, expected: &str) -> Self {
        ConfigErrorKind::InvalidValue { path: path.to_string(), value: crate::config::value::show(value), expected: expected.to_string() }
    }

    /// Shorthand for [`ConfigErrorKind::Unsupported`].
    pub(crate) fn unsupported(path: &str, value: &serde_json::Value, reason: &str) -> Self {
        ConfigErrorKind::Unsupported { path: path.to_string(), value: crate::config::value::show(value), reason: reason.to_string() }
    }
}

/// Result type of the config internals (errors not yet tagged with the file).
pub(crate) type KindResult<T> = Result<T, ConfigErrorKind>;
