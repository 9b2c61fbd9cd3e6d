//! Reading documents: a text file as pieces of about [`ENCODE_CHUNK_BYTES`], a JSON-lines
//! file line by line, a Parquet file row by row ([`super::parquet`]), each handed on as a
//! [`Unit`] that [`encode_unit`] turns into tokens (on any thread).

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::{Codec, DataError};

/// Text is handed to a tokenizer in pieces of about this many bytes, cut after
/// a newline that precedes a non-space, so no pre-token straddles a cut.
pub const ENCODE_CHUNK_BYTES: usize = 1 << 18;

/// Bytes read from a text file at a time.
const READ_BYTES: usize = 1 << 22;

/// Where a unit came from, for error messages: the input file's index and a position in it.
#[derive(Debug, Clone, Copy)]
pub struct Origin {
    pub file: usize,
    pub at: At,
}

#[derive(Debug, Clone, Copy)]
pub enum At {
    /// Byte offset in a text file.
    Byte(u64),
    /// 1-based line of a JSON-lines file.
    Line(u64),
    /// 0-based row of a Parquet file.
    Row(u64),
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Byte(b) => write!(f, "byte {b}"),
            At::Line(l) => write!(f, "line {l}"),
            At::Row(r) => write!(f, "row {r}"),
        }
    }
}

/// A piece of work for the tokenizer.
#[derive(Debug)]
pub enum Unit {
    /// Bytes of a text file; `starts_doc` on a file's first piece.
    Text { bytes: Vec<u8>, origin: Origin, starts_doc: bool },
    /// One JSON-lines line (a document, once its field is looked up).
    JsonLine { line: Vec<u8>, origin: Origin },
    /// One Parquet string value (a document).
    Value { bytes: Vec<u8>, origin: Origin },
}

impl Unit {
    pub fn len(&self) -> usize {
        match self {
            Unit::Text { bytes, .. } | Unit::JsonLine { line: bytes, .. } | Unit::Value { bytes, .. } => bytes.len(),
        }
    }

    pub fn starts_doc(&self) -> bool {
        match self {
            Unit::Text { starts_doc, .. } => *starts_doc,
            Unit::JsonLine { .. } | Unit::Value { .. } => true,
        }
    }

    pub fn origin(&self) -> Origin {
        match self {
            Unit::Text { origin, .. } | Unit::JsonLine { origin, .. } | Unit::Value { origin, .. } => *origin,
        }
    }
}

/// Where the next piece of `buf` (which starts at a piece boundary) ends: at least `target`
/// bytes on, just after a '\n' that is followed by a non-whitespace character (so, in UTF-8,
/// at a character boundary); the whole of `buf` at end of input. `None`: more input is needed.
pub fn next_cut(buf: &[u8], target: usize, eof: bool) -> Option<usize> {
    let mut end = target.max(1);
    while end < buf.len() {
        if buf[end - 1] == b'\n' && !buf[end].is_ascii_whitespace() {
            return Some(end);
        }
        end += 1;
    }
    eof.then_some(buf.len())
}

/// Reads text file `path` (input `file`) as pieces cut by [`next_cut`].
pub fn read_text(path: &Path, file: usize, emit: &mut dyn FnMut(Unit) -> Result<(), DataError>) -> Result<(), DataError> {
    let mut reader = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let (mut buf, mut offset, mut eof, mut first) = (Vec::new(), 0u64, false, true);
    loop {
        let mut start = 0;
        while let Some(len) = next_cut(&buf[start..], ENCODE_CHUNK_BYTES, eof) {
            if len == 0 {
                return Ok(());
            }
            let bytes = buf[start..start + len].to_vec();
            start += len;
            if let Some(nul) = bytes.iter().position(|&b| b == 0) {
                let problem = format!("holds a NUL byte at byte {}: binary data, not text", offset + nul as u64);
                return Err(DataError::Format { path: path.to_path_buf(), problem });
            }
            let origin = Origin { file, at: At::Byte(offset) };
            offset += len as u64;
            emit(Unit::Text { bytes, origin, starts_doc: std::mem::take(&mut first) })?;
        }
        buf.drain(..start);
        let n = (&mut reader).take(READ_BYTES as u64).read_to_end(&mut buf).map_err(|e| DataError::io(path, "read", e))?;
        eof = n == 0;
    }
}

/// Reads JSON-lines file `path` (input `file`): every line that is not blank is a unit.
pub fn read_jsonl(path: &Path, file: usize, emit: &mut dyn FnMut(Unit) -> Result<(), DataError>) -> Result<(), DataError> {
    let mut reader = BufReader::new(File::open(path).map_err(|e| DataError::io(path, "open", e))?);
    let mut line_no = 0u64;
    loop {
        let mut line = Vec::new();
        if reader.read_until(b'\n', &mut line).map_err(|e| DataError::io(path, "read", e))? == 0 {
            return Ok(());
        }
        line_no += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        emit(Unit::JsonLine { line, origin: Origin { file, at: At::Line(line_no) } })?;
    }
}

/// The tokens of one unit; an empty document (a JSON `null` or `""`) gives none.
pub fn encode_unit(unit: &Unit, codec: &Codec, field: &str, path: &Path) -> Result<Vec<u32>, DataError> {
    let origin = unit.origin();
    let text: &[u8] = match unit {
        Unit::Text { bytes, .. } | Unit::Value { bytes, .. } => bytes,
        Unit::JsonLine { line, .. } => {
            return match json_field(line, field).map_err(|problem| DataError::Document {
                path: path.to_path_buf(),
                at: origin.at,
                problem,
            })? {
                Some(text) => encode_text(text.as_bytes(), codec, path, origin),
                None => Ok(Vec::new()),
            }
        }
    };
    encode_text(text, codec, path, origin)
}

fn encode_text(bytes: &[u8], codec: &Codec, path: &Path, origin: Origin) -> Result<Vec<u32>, DataError> {
    if let Codec::Bytes = codec {
        return Ok(bytes.iter().map(|&b| u32::from(b)).collect());
    }
    let text = std::str::from_utf8(bytes).map_err(|e| match origin.at {
        At::Byte(start) => DataError::NotUtf8 { path: path.to_path_buf(), offset: start as usize + e.valid_up_to() },
        at => DataError::Document { path: path.to_path_buf(), at, problem: format!("not valid UTF-8 at byte {}", e.valid_up_to()) },
    })?;
    codec.encode(text).map_err(|e| match e {
        DataError::Encode { message, .. } => DataError::Encode { what: format!("{} at {}", path.display(), origin.at), message },
        other => other,
    })
}

/// The string in `field` of a JSON object line; `None` for `null`.
fn json_field(line: &[u8], field: &str) -> Result<Option<String>, String> {
    let value: serde_json::Value = serde_json::from_slice(line).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(mut object) = value else {
        return Err(format!("expected a JSON object, found {}", kind(&value)));
    };
    match object.remove(field) {
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(serde_json::Value::Null) => Ok(None),
        Some(other) => Err(format!("field `{field}` is {}, not a string", kind(&other))),
        None => {
            let fields: Vec<&str> = object.keys().map(String::as_str).take(8).collect();
            Err(format!("has no field `{field}` (its fields: {}); tessera.data_field names the text's field", fields.join(", ")))
        }
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
