//! The run's hold on its output folder: an exclusive `flock` on `<output>/.lock`, which holds
//! the holder's pid. Two runs writing one output folder used to corrupt each other silently
//! (each save removes the other's `.tmp-step_*` folders as stale; the checkpoints folder mixed
//! the two runs); now the second is refused, naming the first's pid.
//!
//! The lock is the kernel's: it goes with the process (an exit, a crash, a SIGKILL), so a
//! `.lock` file left behind by a run that died holds nothing and the next run takes it. The
//! file is never removed: a run that removed it could let a third run lock a new file while a
//! second still held the old one (see [`OutputLock::acquire`]).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Name of the lock file in an output folder.
pub const LOCK_FILE: &str = ".lock";

/// Attempts to take a lock whose file was replaced between the open and the lock (at most:
/// a file replaced this often is being fought over).
const LOCK_ATTEMPTS_MAX: usize = 8;

/// Why the output folder could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "output folder {} is in use by another run (pid {pid}, holding {}): two runs on one --output would overwrite each \
         other's checkpoints; wait for it to end, or pick another --output",
        dir.display(),
        lock.display()
    )]
    Held { dir: PathBuf, lock: PathBuf, pid: String },
    /// The I/O error is in the message, not a `source` (`{:#}` would print it twice).
    #[error("{op} `{}`: {err}", path.display())]
    Io { op: &'static str, path: PathBuf, err: io::Error },
}

/// An exclusive hold on an output folder, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct OutputLock {
    /// Holds the `flock`: closing the file releases it.
    _file: File,
    path: PathBuf,
}

impl OutputLock {
    /// Locks the existing folder `dir` for this process, or says which process holds it.
    ///
    /// After the lock is taken the file is checked to still be the one at `<dir>/.lock` (same
    /// device and inode): a file replaced meanwhile is locked again, so two runs never hold
    /// locks on two different files of one name.
    pub fn acquire(dir: &Path) -> Result<OutputLock, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |op: &'static str| {
            let path = path.clone();
            move |err| LockError::Io { op, path, err }
        };
        for _ in 0..LOCK_ATTEMPTS_MAX {
            let mut file =
                OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io("open the lock file"))?;
            // SAFETY: a valid descriptor owned by `file`; flock only reads it.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::WouldBlock {
                    return Err(io("lock")(err));
                }
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = match pid.trim() {
                    "" => "unknown".to_string(),
                    p => p.to_string(),
                };
                return Err(LockError::Held { dir: dir.to_path_buf(), lock: path, pid });
            }
            let held = file.metadata().map_err(io("stat the lock file"))?;
            let now = std::fs::metadata(&path);
            if !now.is_ok_and(|m| m.dev() == held.dev() && m.ino() == held.ino()) {
                continue;
            }
            file.set_len(0).map_err(io("write the lock file"))?;
            file.rewind().map_err(io("write the lock file"))?;
            writeln!(file, "{}", std::process::id()).map_err(io("write the lock file"))?;
            return Ok(OutputLock { _file: file, path });
        }
        Err(io("lock")(io::Error::other(format!("the file was replaced {LOCK_ATTEMPTS_MAX} times while it was being locked"))))
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
