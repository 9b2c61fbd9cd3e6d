//! Rate-limited logging of refused connections. Anyone who can send a UDP datagram to an
//! endpoint can make it refuse a connection (a forged QUIC Initial fails its handshake), and a
//! line per refusal let such datagrams fill the log; now a refusal is written at most once per
//! [`REFUSAL_LOG_INTERVAL_MS`], with the count of the ones left out since the last line.
//!
//! [`RefusalLog::line`] is the rule, fed the time in ms (no clock: tests drive it);
//! [`RefusalLog::refused`] feeds it this process's monotonic clock and writes to stderr.

use std::time::Instant;

/// The least time between two lines about refusals (ms).
pub const REFUSAL_LOG_INTERVAL_MS: u64 = 10_000;

/// The refusals of one accept loop (see the module's documentation).
#[derive(Debug)]
pub struct RefusalLog {
    /// Starts each line, e.g. "coordinator: refused a connection".
    what: String,
    began: Instant,
    last_ms: Option<u64>,
    suppressed: u64,
}

impl RefusalLog {
    /// A log whose lines start with `what` (followed by `: <why>`).
    pub fn new(what: impl Into<String>) -> Self {
        RefusalLog { what: what.into(), began: Instant::now(), last_ms: None, suppressed: 0 }
    }

    /// The line to write for a refusal at `now_ms` (ms on any clock that does not go back), or
    /// `None` when one was written less than [`REFUSAL_LOG_INTERVAL_MS`] ago (the refusal is
    /// counted, and the next line says how many were left out).
    pub fn line(&mut self, now_ms: u64, why: &str) -> Option<String> {
        if self.last_ms.is_some_and(|last| now_ms.saturating_sub(last) < REFUSAL_LOG_INTERVAL_MS) {
            self.suppressed += 1;
            return None;
        }
        self.last_ms = Some(now_ms);
        let more = match std::mem::take(&mut self.suppressed) {
            0 => String::new(),
            n => format!(" ({n} more refused since the last such line, not shown)"),
        };
        Some(format!("{}: {why}{more}", self.what))
    }

    /// Writes the refusal to stderr unless the rate limit holds it back.
    pub fn refused(&mut self, why: &str) {
        let now_ms = self.began.elapsed().as_millis() as u64;
        if let Some(line) = self.line(now_ms, why) {
            eprintln!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_then_the_count_of_those_left_out() {
        let mut log = RefusalLog::new("coordinator: refused a connection");
        assert_eq!(log.line(0, "a").as_deref(), Some("coordinator: refused a connection: a"));
        // A flood within the interval writes nothing.
        for ms in 1..1000 {
            assert_eq!(log.line(ms, "b"), None);
        }
        assert_eq!(log.line(REFUSAL_LOG_INTERVAL_MS - 1, "c"), None);
        let line = log.line(REFUSAL_LOG_INTERVAL_MS, "d").expect("a line once the interval passed");
        assert_eq!(line, "coordinator: refused a connection: d (1000 more refused since the last such line, not shown)");
        // The count starts again.
        let line = log.line(3 * REFUSAL_LOG_INTERVAL_MS, "e").expect("a line");
        assert_eq!(line, "coordinator: refused a connection: e");
    }
}
