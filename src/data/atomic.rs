//! Files written whole or not at all: a temporary file of its own beside the target, synced and
//! renamed over it once complete, so a reader (another rank, a later run) never sees half of
//! one; dropped before [`TempFile::commit`], the temporary file is removed.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A temporary file in the folder of the file it will become.
pub(crate) struct TempFile {
    path: PathBuf,
    file: File,
    committed: bool,
}

impl TempFile {
    /// Creates `dir/.{stem}.{pid}.{n}.{nanos}.tmp`, new: pid, this process's count and the
    /// clock keep writers apart (threads, or processes of other pid namespaces sharing the
    /// folder), and `create_new` refuses if two picked the same name anyway.
    pub(crate) fn create(dir: &Path, stem: &str) -> io::Result<TempFile> {
        static CREATED: AtomicU64 = AtomicU64::new(0);
        let n = CREATED.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let path = dir.join(format!(".{stem}.{}.{n}.{nanos}.tmp", std::process::id()));
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        Ok(TempFile { path, file, committed: false })
    }

    pub(crate) fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// Syncs the file and renames it to `to`, replacing what was there.
    pub(crate) fn commit(mut self, to: &Path) -> io::Result<()> {
        self.file.sync_all()?;
        std::fs::rename(&self.path, to)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
