//! Weight files of a model folder: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names. Headers are checked against the model first (names,
//! dtypes, shapes: nothing unexpected, nothing missing); data is read shard by shard into the
//! flat buffer. f32, bf16 and f16 tensors are read (bf16 and f16 widen to f32 exactly).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tessera_kernels::model::Model;

use super::config::Family;
use super::names::{matrix, pieces, place};
use super::HfError;

/// The single-file weights' name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded weights' index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Largest safetensors header read (transformers' own limit is 100 MB).
pub const HEADER_BYTES_MAX: u64 = 100 << 20;

/// Weight files found in formats Tessera does not read, so the folder is refused rather than
/// taken for a config without weights.
const UNREAD_FORMATS: &[&str] = &["pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack"];

/// Buffers some transformers versions saved beside the weights and Tessera recomputes.
const RECOMPUTED_SUFFIXES: &[&str] = &[".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"];

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    file: usize,
}

/// The folder's weight files and every tensor they hold.
#[derive(Clone, Debug)]
pub struct WeightFiles {
    pub files: Vec<PathBuf>,
    tensors: BTreeMap<String, Entry>,
}

/// Bytes before a safetensors file's JSON header: its length, u64 little-endian.
const LENGTH_PREFIX_BYTES: u64 = 8;

/// Reads the JSON header of a safetensors file (without its data), and checks that the file
/// is as long as the header says: a file cut short (a download or copy that stopped) is
/// refused here, naming the tensor whose data it lacks, before any training starts.
fn read_header(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>, HfError> {
    let file = || path.display().to_string();
    let truncated = |what: String| HfError::Config { file: file(), reason: format!("truncated: {what}") };
    let mut f = std::fs::File::open(path).map_err(|e| HfError::io("open", path, e))?;
    let file_bytes = f.metadata().map_err(|e| HfError::io("read the size of", path, e))?.len();
    let mut len = [0u8; LENGTH_PREFIX_BYTES as usize];
    if file_bytes < LENGTH_PREFIX_BYTES {
        return Err(truncated(format!("{file_bytes} bytes, shorter than the {LENGTH_PREFIX_BYTES}-byte header length")));
    }
    f.read_exact(&mut len).map_err(|e| HfError::io("read the header of", path, e))?;
    let len = u64::from_le_bytes(len);
    if len > HEADER_BYTES_MAX {
        return Err(HfError::Config { file: file(), reason: format!("header of {len} bytes (at most {HEADER_BYTES_MAX})") });
    }
    if file_bytes < LENGTH_PREFIX_BYTES + len {
        return Err(truncated(format!("{file_bytes} bytes, but its header alone is {len} bytes")));
    }
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).map_err(|e| HfError::io("read the header of", path, e))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&buf).map_err(|e| HfError::Config { file: file(), reason: format!("invalid safetensors header: {e}") })?;
    let data_bytes = file_bytes - LENGTH_PREFIX_BYTES - len;
    let end_of = |v: &serde_json::Value| v.get("data_offsets").and_then(|o| o.get(1)).and_then(serde_json::Value::as_u64);
    let last = header.iter().filter(|(n, _)| *n != "__metadata__").filter_map(|(n, v)| end_of(v).map(|end| (end, n))).max();
    if let Some((end, name)) = last.filter(|(end, _)| *end > data_bytes) {
        return Err(HfError::tensor(
            file(),
            name,
            format!("its data ends at byte {end} of the data section, which has {data_bytes} bytes: the file is truncated"),
        ));
    }
    Ok(header)
}

impl WeightFiles {
    /// The weights of `dir`: the index's shards, or the single file, or `None` when the folder
    /// holds neither (a config to initialise from). Weights in other formats are refused.
    pub fn find(dir: &Path) -> Result<Option<WeightFiles>, HfError> {
        let index = dir.join(INDEX_FILE);
        let files: Vec<PathBuf> = if index.is_file() {
            let text = std::fs::read(&index).map_err(|e| HfError::io("read", &index, e))?;
            let doc: serde_json::Value = serde_json::from_slice(&text)
                .map_err(|e| HfError::Config { file: index.display().to_string(), reason: format!("not JSON: {e}") })?;
            let map = doc.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
                HfError::config(
                    &index.display().to_string(),
                    "weight_map",
                    doc.get("weight_map").unwrap_or(&serde_json::Value::Null),
                    "an object of tensor name to shard file",
                )
            })?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().filter(|f| !f.contains('/') && !f.contains('\\') && f.ends_with(".safetensors"));
                let file = file.ok_or_else(|| {
                    HfError::config(
                        &index.display().to_string(),
                        &format!("weight_map.{tensor}"),
                        &map[tensor],
                        "a .safetensors file name in this folder",
                    )
                })?;
                if !names.iter().any(|n| n == file) {
                    names.push(file.to_string());
                }
            }
            names.sort();
            if let Some(missing) = names.iter().find(|n| !dir.join(n).is_file()) {
                let tensor = map.iter().find(|(_, f)| f.as_str() == Some(missing.as_str())).map_or("", |(t, _)| t.as_str());
                return Err(HfError::config(
                    &index.display().to_string(),
                    &format!("weight_map.{tensor}"),
                    &serde_json::Value::from(missing.as_str()),
                    &format!("a shard in this folder, but {} is missing", dir.join(missing).display()),
                ));
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join(SINGLE_FILE).is_file() {
            vec![dir.join(SINGLE_FILE)]
        } else {
            if let Some(other) = UNREAD_FORMATS.iter().find(|f| dir.join(f).exists()) {
                return Err(HfError::Config {
                    file: dir.join(other).display().to_string(),
                    reason: format!("Tessera reads weights from {SINGLE_FILE} or {INDEX_FILE} only; convert them to safetensors"),
                });
            }
            return Ok(None);
        };
        let mut tensors = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            for (name, v) in read_header(path)? {
                if name == "__metadata__" {
                    continue;
                }
                let dtype = v.get("dtype").and_then(|d| d.as_str()).unwrap_or("?").to_string();
                let shape = v
                    .get("shape")
                    .and_then(|s| s.as_array())
                    .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
                    .unwrap_or_default();
                if let Some(old) = tensors.insert(name.clone(), Entry { dtype, shape, file: i }) {
                    return Err(HfError::tensor(path.display(), &name, format!("also in {}", files[old.file].display())));
                }
            }
        }
        Ok(Some(WeightFiles { files, tensors }))
    }

    /// Checks that the files hold exactly the tensors of `model` (family `family`), each in a
    /// dtype Tessera reads and the shape the config implies.
    pub fn check(&self, family: Family, model: &Model) -> Result<(), HfError> {
        let mut wanted: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for spec in model.layout().specs() {
            let ps =
                pieces(family, &model.cfg, spec).ok_or_else(|| HfError::tensor("the model", &spec.name, "has no Hugging Face name"))?;
            wanted.extend(ps.into_iter().map(|p| (p.name, p.shape)));
        }
        for (name, shape) in &wanted {
            let Some(e) = self.tensors.get(name) else {
                let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
                return Err(HfError::tensor(files.join(", "), name, format!("missing (expected shape {shape:?})")));
            };
            let file = self.files[e.file].display();
            if !matches!(e.dtype.as_str(), "F32" | "BF16" | "F16") {
                return Err(HfError::tensor(file, name, format!("dtype {}, expected F32, BF16 or F16", e.dtype)));
            }
            if &e.shape != shape {
                return Err(HfError::tensor(file, name, format!("shape {:?}, the config implies {shape:?}", e.shape)));
            }
        }
        for (name, e) in &self.tensors {
            let tied_copy = name == "lm_head.weight" && model.cfg.tied_head;
            if !wanted.contains_key(name) && !tied_copy && !RECOMPUTED_SUFFIXES.iter().any(|s| name.ends_with(s)) {
                return Err(HfError::tensor(
                    self.files[e.file].display(),
                    name,
                    "not a tensor of this model (the config describes another shape or family)",
                ));
            }
        }
        Ok(())
    }
}

/// Widens one tensor's data to f32.
fn to_f32(view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    let b = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|x| half::bf16::from_le_bytes([x[0], x[1]]).to_f32()).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32()).collect(),
        other => return Err(format!("dtype {other:?}, expected F32, BF16 or F16")),
    })
}

/// The flat parameter buffer of `model` read from `w` (checked with [`WeightFiles::check`]
/// first), shard by shard. A tied model's `lm_head.weight`, when a file holds one, must equal
/// the embedding.
pub fn read_params(w: &WeightFiles, family: Family, model: &Model) -> Result<Vec<f32>, HfError> {
    read_params_in(w, family, model, 0..model.num_params())
}

/// The parameters of the flat range `within` only (whole parameters: a range of units, as a
/// pipeline rank holds), as `read_params` places them, `within.len()` values. Files are mapped,
/// not read: only the tensors of the range are touched.
pub fn read_params_in(w: &WeightFiles, family: Family, model: &Model, within: std::ops::Range<usize>) -> Result<Vec<f32>, HfError> {
    w.check(family, model)?;
    let mut flat = vec![0.0f32; within.len()];
    let mut where_: BTreeMap<String, (usize, &tessera_kernels::layer::ParamSpec, super::names::Piece)> = BTreeMap::new();
    let inside = |r: &std::ops::Range<usize>| r.start >= within.start && r.end <= within.end;
    for spec in model.layout().specs().iter().filter(|s| inside(&s.range())) {
        for p in pieces(family, &model.cfg, spec).unwrap_or_default() {
            let file = w.tensors.get(&p.name).map_or(0, |e| e.file);
            where_.insert(p.name.clone(), (file, spec, p));
        }
    }
    let wte = model.layout().specs().first().map(|s| s.range()).filter(|r| inside(r));
    let mut tied_copy = None;
    for (i, path) in w.files.iter().enumerate() {
        let tied_here = wte.is_some() && model.cfg.tied_head && w.tensors.get("lm_head.weight").is_some_and(|e| e.file == i);
        if !tied_here && !where_.values().any(|(f, _, _)| *f == i) {
            continue;
        }
        let file = std::fs::File::open(path).map_err(|e| HfError::io("open", path, e))?;
        // SAFETY: the mapping is read while this function runs; a weight file rewritten
        // meanwhile by another program would give wrong values, as a read racing a write would.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| HfError::io("map", path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| HfError::Config { file: path.display().to_string(), reason: format!("invalid safetensors file: {e}") })?;
        for (name, (_, spec, piece)) in where_.iter().filter(|(_, (f, _, _))| *f == i) {
            let view = st.tensor(name).map_err(|e| HfError::tensor(path.display(), name, e.to_string()))?;
            let data = to_f32(&view).map_err(|e| HfError::tensor(path.display(), name, e))?;
            let r = spec.range();
            place(&mut flat[r.start - within.start..r.end - within.start], matrix(spec), piece, &data);
        }
        if tied_here {
            let view = st.tensor("lm_head.weight").map_err(|e| HfError::tensor(path.display(), "lm_head.weight", e.to_string()))?;
            tied_copy = Some((path.clone(), to_f32(&view).map_err(|e| HfError::tensor(path.display(), "lm_head.weight", e))?));
        }
    }
    if let (Some((path, head)), Some(r)) = (tied_copy, wte) {
        if flat[r.start - within.start..r.end - within.start] != *head.as_slice() {
            return Err(HfError::tensor(
                path.display(),
                "lm_head.weight",
                "differs from the embedding, but the config ties them (tie_word_embeddings)",
            ));
        }
    }
    Ok(flat)
}
