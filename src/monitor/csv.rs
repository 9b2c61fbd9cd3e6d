//! CSV monitor in DeepSpeed's `csv_monitor` layout: one `<tag>.csv` per tag (with `/` and spaces
//! turned into `_`) under `output_path/job_name/`, header `step,<last tag component>`.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::PathBuf;

use super::{monitor_io, with_path, CsvOpts, Event, Monitor, MonitorError};

/// Appends `step,value` rows to one CSV file per tag.
pub struct CsvMonitor {
    dir: PathBuf,
    files: HashMap<String, (PathBuf, BufWriter<File>)>,
}

/// File stem for a tag: `Train/Samples/loss` -> `Train_Samples_loss`.
pub(crate) fn csv_file_stem(tag: &str) -> String {
    tag.replace(['/', ' '], "_")
}

/// Quote a CSV field if it contains a separator, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

impl CsvMonitor {
    /// Create `output_path/job_name/`.
    pub fn new(opts: &CsvOpts) -> Result<Self, MonitorError> {
        let dir = opts.output_path.join(&opts.job_name);
        std::fs::create_dir_all(&dir).map_err(|e| monitor_io("create directory", &dir, e))?;
        Ok(CsvMonitor { dir, files: HashMap::new() })
    }

    /// Open (append) the file for `tag`, writing the header if the file is new or empty.
    fn open_tag(&mut self, tag: &str) -> io::Result<&mut (PathBuf, BufWriter<File>)> {
        if !self.files.contains_key(tag) {
            let path = self.dir.join(format!("{}.csv", csv_file_stem(tag)));
            let file = OpenOptions::new().create(true).append(true).open(&path).map_err(|e| with_path(&path, e))?;
            let empty = file.metadata().map_err(|e| with_path(&path, e))?.len() == 0;
            let mut out = BufWriter::new(file);
            if empty {
                let header = tag.rsplit('/').next().unwrap_or(tag);
                writeln!(out, "step,{}", csv_field(header)).map_err(|e| with_path(&path, e))?;
            }
            self.files.insert(tag.to_string(), (path, out));
        }
        self.files.get_mut(tag).ok_or_else(|| io::Error::other(format!("csv monitor: no file for tag `{tag}`")))
    }
}

impl Monitor for CsvMonitor {
    fn write(&mut self, events: &[Event]) -> io::Result<()> {
        for ev in events {
            let (path, out) = self.open_tag(&ev.tag)?;
            writeln!(out, "{},{}", ev.step, ev.value).map_err(|e| with_path(path, e))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        for (path, out) in self.files.values_mut() {
            out.flush().map_err(|e| with_path(path, e))?;
        }
        Ok(())
    }
}
