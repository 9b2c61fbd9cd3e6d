//! Ctrl-C: a process-wide "stop requested" flag that the engine polls between steps.
//!
//! Built on the `ctrlc` crate (SIGINT/SIGTERM on Unix, console events on Windows). The first
//! Ctrl-C only sets the flag, so the engine finishes or abandons the current step and shuts the
//! cluster down cleanly; a second Ctrl-C while the flag is still set exits the process at once
//! with status 130 (the escape hatch when a step is wedged). `ctrlc` handles signals on one
//! process-lifetime thread of its own, which waits on a pipe and touches nothing of ours; it is
//! the one thread this crate does not join.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::ActorError;

/// Exit status after a second Ctrl-C (128 + SIGINT, the shell convention).
pub const FORCED_EXIT_CODE: i32 = 130;

static FLAG: OnceLock<Result<Arc<AtomicBool>, String>> = OnceLock::new();

/// Installs the handler once per process and returns the shared flag (later calls return the
/// same flag). Fails if another handler was installed through `ctrlc` elsewhere.
pub fn install_ctrl_c() -> Result<Arc<AtomicBool>, ActorError> {
    let installed = FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&flag);
        ctrlc::set_handler(move || {
            if seen.swap(true, Ordering::SeqCst) {
                std::process::exit(FORCED_EXIT_CODE);
            }
        })
        .map(|()| flag)
        .map_err(|e| e.to_string())
    });
    installed.clone().map_err(ActorError::Signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_is_shared_and_starts_clear() {
        let a = install_ctrl_c().expect("first install");
        let b = install_ctrl_c().expect("second call returns the same flag");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!a.load(Ordering::SeqCst));
    }
}
