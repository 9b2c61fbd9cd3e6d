//! TensorBoard event-file writer with hand-encoded protobuf and TFRecord framing (no protobuf
//! dependency). Layout as DeepSpeed: `output_path/job_name/events.out.tfevents.<secs>.<host>`.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{monitor_io, wall_time_s, with_path, Event, Monitor, MonitorError, TensorboardOpts};

/// TFRecord checksum: crc32c rotated right by 15 bits plus a constant (wrapping):
/// masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// What an Event record carries besides wall time and step.
#[derive(Debug, Clone, PartialEq)]
pub enum TfEventPayload<'a> {
    /// `file_version` (field 3), e.g. "brain.Event:2" in the first record of a file.
    FileVersion(&'a str),
    /// `summary` (field 5) with one `value {tag, simple_value}`.
    Scalar { tag: &'a str, value: f32 },
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Length-delimited field (wire type 2).
fn put_bytes_field(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(buf, u64::from(field << 3 | 2));
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// Serialize a `tensorflow.Event` proto: wall_time (1, double), step (2, int64),
/// file_version (3, string) or summary (5, Summary{value (1): {tag (1), simple_value (2, float)}}).
pub fn encode_event(wall_time_s: f64, step: i64, payload: &TfEventPayload) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    buf.push(1 << 3 | 1);
    buf.extend_from_slice(&wall_time_s.to_le_bytes());
    buf.push(2 << 3);
    put_varint(&mut buf, step as u64);
    match payload {
        TfEventPayload::FileVersion(v) => put_bytes_field(&mut buf, 3, v.as_bytes()),
        TfEventPayload::Scalar { tag, value } => {
            let mut val = Vec::with_capacity(tag.len() + 8);
            put_bytes_field(&mut val, 1, tag.as_bytes());
            val.push(2 << 3 | 5);
            val.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::with_capacity(val.len() + 4);
            put_bytes_field(&mut summary, 1, &val);
            put_bytes_field(&mut buf, 5, &summary);
        }
    }
    buf
}

/// TFRecord framing: u64 LE length, masked crc of those 8 bytes, data, masked crc of data.
pub(crate) fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Host name for the file name: kernel hostname, then `$HOSTNAME`, then "localhost"; reduced
/// to `[A-Za-z0-9._-]`.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").ok().or_else(|| std::env::var("HOSTNAME").ok()).unwrap_or_default();
    let clean: String = raw.trim().chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    if clean.is_empty() {
        "localhost".to_string()
    } else {
        clean
    }
}

/// Create a fresh events file in `dir` (suffix `.N` if the name is taken).
fn create_event_file(dir: &Path) -> Result<(PathBuf, File), MonitorError> {
    let secs = wall_time_s() as u64;
    let base = format!("events.out.tfevents.{secs:010}.{}", hostname());
    for n in 0..1000 {
        let name = if n == 0 { base.clone() } else { format!("{base}.{n}") };
        let path = dir.join(name);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(monitor_io("create", path, e)),
        }
    }
    Err(monitor_io("create", dir.join(base), io::Error::from(io::ErrorKind::AlreadyExists)))
}

/// Writes scalar events as a TensorBoard event file.
pub struct TensorboardMonitor {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorboardMonitor {
    /// Create `output_path/job_name/` and a new events file starting with the version record.
    pub fn new(opts: &TensorboardOpts) -> Result<Self, MonitorError> {
        let dir = opts.output_path.join(&opts.job_name);
        std::fs::create_dir_all(&dir).map_err(|e| monitor_io("create directory", &dir, e))?;
        let (path, file) = create_event_file(&dir)?;
        let mut mon = TensorboardMonitor { path, out: BufWriter::new(file) };
        let version = encode_event(wall_time_s(), 0, &TfEventPayload::FileVersion("brain.Event:2"));
        mon.out.write_all(&frame_record(&version)).and_then(|()| mon.out.flush()).map_err(|e| monitor_io("write", &mon.path, e))?;
        Ok(mon)
    }

    /// Path of the events file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Monitor for TensorboardMonitor {
    fn write(&mut self, events: &[Event]) -> io::Result<()> {
        let now = wall_time_s();
        for ev in events {
            let payload = TfEventPayload::Scalar { tag: &ev.tag, value: ev.value as f32 };
            let step = i64::try_from(ev.step).unwrap_or(i64::MAX);
            let record = frame_record(&encode_event(now, step, &payload));
            self.out.write_all(&record).map_err(|e| with_path(&self.path, e))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush().map_err(|e| with_path(&self.path, e))
    }
}
