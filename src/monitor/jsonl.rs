//! JSON-lines monitor: one `{"step":..,"tag":..,"value":..,"wall_time":..}` object per line,
//! appended to a single file (non-finite values are written as `null`).

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{monitor_io, wall_time_s, with_path, Event, JsonlOpts, Monitor, MonitorError};

/// Appends events as JSON lines to one file.
pub struct JsonlMonitor {
    path: PathBuf,
    out: BufWriter<File>,
}

impl JsonlMonitor {
    /// Open `opts.path` for appending (parent directories are created).
    pub fn new(opts: &JsonlOpts) -> Result<Self, MonitorError> {
        if let Some(parent) = opts.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| monitor_io("create directory", parent, e))?;
        }
        let file = OpenOptions::new().create(true).append(true).open(&opts.path).map_err(|e| monitor_io("open", &opts.path, e))?;
        Ok(JsonlMonitor { path: opts.path.clone(), out: BufWriter::new(file) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Monitor for JsonlMonitor {
    fn write(&mut self, events: &[Event]) -> io::Result<()> {
        let now = wall_time_s();
        for ev in events {
            let line = serde_json::json!({
                "step": ev.step,
                "tag": ev.tag,
                "value": ev.value,
                "wall_time": now,
            });
            writeln!(self.out, "{line}").map_err(|e| with_path(&self.path, e))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush().map_err(|e| with_path(&self.path, e))
    }
}
