//! What a person reads, and on which stream:
//! - **standard output**: the run's header, its step lines (loss every `steps_per_print`
//!   steps, validation loss), the summary, and what the other commands answer — one line at a
//!   time through [`out`], so `> log`, `| tee log` and `2>&1` keep them. A closed pipe (`| head`)
//!   is no panic: output stops, and a training run stops after its step with a checkpoint
//!   (`crate::signals`);
//! - **standard error**: the logs ([`init_logs`]: `tracing` with a level, an RFC 3339 UTC
//!   timestamp and, in worker processes, who logs, filtered by `RUST_LOG` or `-v`/`-q`), and the
//!   progress bar, drawn only when standard error is a terminal; a log line or step line
//!   suspends the bar while it is written.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use indicatif::ProgressBar;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::signals::{self, StopReason};

/// Set once a write to standard output failed: nothing more is written there.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// The progress bar on screen, suspended while a log line is written.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Writes `text` and a newline to standard output. Returns false, and writes nothing more
/// for the rest of the process, once standard output is closed or failing; a training run is
/// then asked to stop ([`StopReason::StdoutClosed`]).
pub fn out(text: &str) -> bool {
    if STDOUT_GONE.load(Ordering::SeqCst) {
        return false;
    }
    let mut o = std::io::stdout().lock();
    let Err(e) = writeln!(o, "{text}").and_then(|()| o.flush()) else { return true };
    STDOUT_GONE.store(true, Ordering::SeqCst);
    drop(o);
    if signals::installed() && signals::request(StopReason::StdoutClosed) {
        tracing::warn!("standard output: {e}; no more output there, stopping after the current step and saving a checkpoint");
    }
    false
}

/// `println!` through [`out`]: `outln!("step {s}")`.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::console::out(&format!($($arg)*))
    };
}

/// A step line: on standard output, with the progress bar (if any) out of the way meanwhile.
pub fn line(pb: &ProgressBar, text: &str) {
    if pb.is_hidden() {
        out(text);
    } else {
        pb.suspend(|| out(text));
    }
}

/// Makes `pb` the bar that log lines suspend (a hidden one changes nothing).
pub fn show_bar(pb: &ProgressBar) {
    if !pb.is_hidden() {
        *BAR.lock().unwrap_or_else(|p| p.into_inner()) = Some(pb.clone());
    }
}

/// How much to log: `RUST_LOG` when set, else by `-v` (repeatable) and `-q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verbosity {
    pub verbose: u8,
    pub quiet: bool,
}

impl Verbosity {
    /// The filter when `RUST_LOG` is unset: Tessera's own crates at info (warn with `-q`,
    /// debug with `-v`, trace with `-vv`); the libraries underneath at error (warn with `-v`).
    fn directives(self) -> &'static str {
        match (self.quiet, self.verbose) {
            (true, _) => "error,tessera=warn",
            (false, 0) => "error,tessera=info",
            (false, 1) => "warn,tessera=debug",
            (false, _) => "info,tessera=trace",
        }
    }
}

/// Installs the log subscriber on standard error. `who` prefixes every line (a worker
/// process's rank). A bad `RUST_LOG` is an error naming it.
pub fn init_logs(v: Verbosity, who: Option<String>) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.is_empty() => {
            EnvFilter::try_new(&s).map_err(|e| anyhow::anyhow!("RUST_LOG={s}: {e} (expected e.g. `info` or `tessera=debug`)"))?
        }
        _ => EnvFilter::new(v.directives()),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(StderrAroundBar)
        .event_format(Line { who })
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
}

/// One log line: `2026-12-03T16:50:01.123456Z rank 1 warning: message` (the level spelled
/// as compilers spell it, so `warning:` reads as it did before logs had levels).
struct Line {
    who: Option<String>,
}

impl<S, N> FormatEvent<S, N> for Line
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        SystemTime.format_time(&mut w)?;
        if let Some(who) = &self.who {
            write!(w, " {who}")?;
        }
        let level = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        write!(w, " {level}: ")?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// Standard error, with the progress bar suspended around each write (the subscriber writes
/// one whole line per call).
struct StderrAroundBar;

impl<'a> MakeWriter<'a> for StderrAroundBar {
    type Writer = StderrAroundBar;
    fn make_writer(&'a self) -> Self::Writer {
        StderrAroundBar
    }
}

impl Write for StderrAroundBar {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let bar = BAR.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match bar {
            Some(pb) if !pb.is_finished() => pb.suspend(|| std::io::stderr().write_all(buf)).map(|()| buf.len()),
            _ => std::io::stderr().write_all(buf).map(|()| buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}
