//! What a data path holds: its input files, each one's format (by extension, checked against
//! its first bytes) and split (by the words of its name), and the refusal of anything Tessera
//! cannot read. Reads nothing but directory listings and the first bytes of each file.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::DataError;

/// What Tessera reads, for error messages.
pub const ACCEPTED_FORMATS: &str = "text (.txt, .text, .md, or a file with no extension), JSON lines (.jsonl, .ndjson), \
     Parquet (.parquet), llm.c token shards (.bin), or a folder of one of these";

/// Folder levels searched below a data folder (a Hugging Face snapshot keeps its files in
/// `data/`, a parquet conversion in `<config>/<split>/`).
pub const DIR_DEPTH_MAX: usize = 3;

/// Files a data folder may hold.
pub const DIR_FILES_MAX: usize = 100_000;

/// Bytes of a file's start looked at to tell its format.
const SNIFF_BYTES: usize = 16;

/// An input file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Format {
    /// Plain text: one document per file.
    Text,
    /// One JSON object per line, its text in a string field.
    Jsonl,
    /// A Parquet table, its text in a string column.
    Parquet,
    /// llm.c `.bin` token shard: tokens already.
    Shard,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Jsonl => "jsonl",
            Format::Parquet => "parquet",
            Format::Shard => "token shards",
        }
    }

    /// The format a file's extension names; `in_dir` narrows text to `.txt`/`.text` (a
    /// folder's README.md or LICENSE is not training data).
    fn of(path: &Path, in_dir: bool) -> Option<Format> {
        let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("txt" | "text") => Some(Format::Text),
            Some("md") | None if !in_dir => Some(Format::Text),
            Some("jsonl" | "ndjson") => Some(Format::Jsonl),
            Some("parquet") => Some(Format::Parquet),
            Some("bin") => Some(Format::Shard),
            _ => None,
        }
    }
}

/// Which stream an input file feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// One input file.
#[derive(Debug, Clone)]
pub struct Input {
    pub path: PathBuf,
    pub split: Split,
}

/// Everything one data path holds, in reading order (training files, then validation files).
#[derive(Debug, Clone)]
pub struct Inputs {
    pub root: PathBuf,
    pub format: Format,
    /// Sorted by path relative to `root`; training files first.
    pub files: Vec<Input>,
    /// Whether the data is a collection of documents (an end-of-text token between them):
    /// everything but one plain text file and token shards.
    pub documents: bool,
    /// Files left out because their name says they are a test split.
    pub excluded: Vec<PathBuf>,
    /// Document files beside token shards, which are used instead.
    pub ignored: Vec<PathBuf>,
}

impl Inputs {
    /// Whether some files are named as the validation split (else the training stream's tail is).
    pub fn has_val_files(&self) -> bool {
        self.files.iter().any(|f| f.split == Split::Val)
    }

    pub fn count(&self, split: Split) -> usize {
        self.files.iter().filter(|f| f.split == split).count()
    }
}

/// Finds the inputs under `path`: one file, or a folder's data files (up to [`DIR_DEPTH_MAX`]
/// levels down, hidden entries skipped): its token shards if it has any, else its documents,
/// all of one format.
pub fn discover(path: &Path) -> Result<Inputs, DataError> {
    let meta = fs::metadata(path).map_err(|e| DataError::io(path, "stat", e))?;
    if !meta.is_dir() && !meta.is_file() {
        return Err(DataError::Format { path: path.to_path_buf(), problem: "is neither a file nor a folder (a pipe or a device?)".into() });
    }
    if !meta.is_dir() {
        let format = Format::of(path, false).ok_or_else(|| DataError::Format { path: path.to_path_buf(), problem: unknown(path) })?;
        check_magic(path, format)?;
        let files = vec![Input { path: path.to_path_buf(), split: Split::Train }];
        return Ok(Inputs {
            root: path.to_path_buf(),
            format,
            files,
            documents: format == Format::Jsonl || format == Format::Parquet,
            excluded: vec![],
            ignored: vec![],
        });
    }
    let mut found = Vec::new();
    walk(path, path, 0, &mut found)?;
    found.sort_by(|a, b| a.0.cmp(&b.0));
    // Token shards win over the text they were made from (llm.c keeps tiny_shakespeare.txt
    // beside its .bin files), as they always did; the files set aside are counted.
    let mut ignored = Vec::new();
    if found.iter().any(|f| f.2 == Format::Shard) {
        let (shards, others): (Vec<_>, Vec<_>) = found.into_iter().partition(|f| f.2 == Format::Shard);
        (found, ignored) = (shards, others.into_iter().map(|f| f.1).collect());
    }
    let mut formats: Vec<Format> = found.iter().map(|(_, _, f)| *f).collect();
    formats.sort();
    formats.dedup();
    let format = match formats[..] {
        [] => return Err(DataError::EmptyDir { path: path.to_path_buf() }),
        [one] => one,
        _ => {
            let example = |f: Format| found.iter().find(|x| x.2 == f).map(|x| x.0.display().to_string()).unwrap_or_default();
            let kinds: Vec<String> = formats.iter().map(|&f| format!("{} ({})", f.name(), example(f))).collect();
            return Err(DataError::Format {
                path: path.to_path_buf(),
                problem: format!("mixes data formats: {}; point the data path at files of one format", kinds.join(", ")),
            });
        }
    };
    let (mut files, mut excluded) = (Vec::new(), Vec::new());
    for (rel, full, _) in found {
        check_magic(&full, format)?;
        match split_of(&rel) {
            Some(split) => files.push(Input { path: full, split }),
            None => excluded.push(full),
        }
    }
    // Stable: training files first, each split in name order.
    files.sort_by_key(|f| f.split == Split::Val);
    if !files.iter().any(|f| f.split == Split::Train) {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            problem: "holds no training files (only files named as validation or test splits)".into(),
        });
    }
    Ok(Inputs { root: path.to_path_buf(), format, files, documents: format != Format::Shard, excluded, ignored })
}

fn unknown(path: &Path) -> String {
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    match ext.as_str() {
        "json" => "JSON (.json) is not read: for one JSON object per line, name the file .jsonl".into(),
        _ => format!("unknown data format `.{ext}`"),
    }
}

/// Collects `(path relative to root, path, format)` of the data files below `dir`.
fn walk(root: &Path, dir: &Path, depth: usize, out: &mut Vec<(PathBuf, PathBuf, Format)>) -> Result<(), DataError> {
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, "list", e))? {
        let entry = entry.map_err(|e| DataError::io(dir, "list", e))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        // Follows symbolic links: a Hugging Face snapshot's files are links into its blobs.
        if path.is_dir() {
            if depth < DIR_DEPTH_MAX {
                walk(root, &path, depth + 1, out)?;
            }
        } else if let Some(format) = Format::of(&path, true) {
            if out.len() == DIR_FILES_MAX {
                return Err(DataError::Format {
                    path: root.to_path_buf(),
                    problem: format!("holds more than {DIR_FILES_MAX} data files (DIR_FILES_MAX); merge them into fewer"),
                });
            }
            let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            out.push((rel, path, format));
        }
    }
    Ok(())
}

/// The split a file's path (relative to the data folder) names: a word `val`, `valid` or
/// `validation` makes it validation, a word `test` leaves it out (`None`), anything else is
/// training. Words are the runs of letters and digits, so `data_val_000.bin`,
/// `validation-00000-of-00001.parquet` and `default/validation/0000.parquet` are validation.
pub fn split_of(rel: &Path) -> Option<Split> {
    let name = rel.with_extension("").to_string_lossy().to_ascii_lowercase();
    let mut split = Some(Split::Train);
    for word in name.split(|c: char| !c.is_ascii_alphanumeric()) {
        match word {
            "test" => return None,
            "val" | "valid" | "validation" => split = Some(Split::Val),
            _ => {}
        }
    }
    split
}

/// What a file's first bytes say it is, when they say something.
fn magic_kind(head: &[u8]) -> Option<&'static str> {
    const KINDS: &[(&[u8], &str)] = &[
        (b"PAR1", "a Parquet file"),
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"GIF8", "a GIF image"),
        (b"%PDF", "a PDF document"),
        (b"PK\x03\x04", "a zip archive"),
        (b"\x1f\x8b", "gzip-compressed"),
        (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
        (b"BZh", "bzip2-compressed"),
        (b"\xfd7zXZ\x00", "xz-compressed"),
        (b"ARROW1", "an Arrow IPC file"),
        (b"\x93NUMPY", "a NumPy array"),
        (b"\x7fELF", "an executable"),
        (&20240520i32.to_le_bytes(), "an llm.c token shard"),
        (&20240801i32.to_le_bytes(), "an llm.c token shard"),
    ];
    KINDS.iter().find(|(magic, _)| head.starts_with(magic)).map(|(_, kind)| *kind)
}

/// Refuses a file whose first bytes contradict its name (a Parquet file named `.txt`, an image,
/// a compressed file). Text's NUL bytes are found while it is read (`docs.rs`).
fn check_magic(path: &Path, format: Format) -> Result<(), DataError> {
    let mut head = Vec::with_capacity(SNIFF_BYTES);
    let file = fs::File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    file.take(SNIFF_BYTES as u64).read_to_end(&mut head).map_err(|e| DataError::io(path, "read", e))?;
    let kind = magic_kind(&head);
    let problem = match (format, kind) {
        (Format::Parquet, Some("a Parquet file")) | (Format::Shard, _) => return Ok(()),
        (Format::Parquet, Some(kind)) => format!("named .parquet but is {kind}"),
        (Format::Parquet, None) => "named .parquet but does not start with Parquet's magic bytes PAR1".into(),
        (_, Some(kind)) => format!("named as {} but is {kind}", format.name()),
        (_, None) => return Ok(()),
    };
    Err(DataError::Format { path: path.to_path_buf(), problem })
}
