//! The model `tessera serve` and `tessera generate` run: a Hugging Face model folder (its
//! weights, `tokenizer.json`, special tokens and chat template) or a Tessera checkpoint (the
//! tokenizer it was trained with, its recorded model files), with what text generation needs of
//! its tokenizer: the token a prompt starts with, the tokens that end a text, the chat template.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use tessera_kernels::cuda::decode::{DecodeOptions, WeightFormat};
use tessera_kernels::model::Model;

use super::chat::ChatTemplate;
use crate::data::Codec;
use crate::hf;
use crate::infer::ranks::rank::WeightLoader;
use crate::infer::ranks::{ModelSource, PipelineBackend, PipelineOptions, RankSource};
use crate::infer::{Backend, CpuBackend, CpuOptions, GpuBackend, LinearFormat};

/// A model ready to generate with.
pub struct LoadedModel {
    /// Its name in the API (`/v1/models`, the requests' `model`).
    pub name: String,
    pub model: Model,
    /// The parameters of the flat range `held`: every one, or unit 0's only for a server
    /// whose blocks live on pipeline ranks ([`LoadedModel::load_with`]).
    pub params: Vec<f32>,
    pub held: std::ops::Range<usize>,
    pub codec: Codec,
    /// Put before a completion prompt (the tokenizer's begin-of-sequence token, when it adds one).
    pub bos: Option<u32>,
    /// Sampling one of these ends a text (the end-of-sequence tokens).
    pub eos: Vec<u32>,
    pub chat: Option<ChatTemplate>,
    /// Where it was loaded from (what pipeline ranks load).
    pub source: ModelSource,
}

impl LoadedModel {
    /// Loads a model folder (it has `config.json`) or a checkpoint (a run's checkpoint folder or
    /// one step of it); `tokenizer` overrides a checkpoint's recorded one (same file only).
    pub fn load(path: &Path, tokenizer: Option<&Path>) -> Result<LoadedModel> {
        LoadedModel::load_with(path, tokenizer, false)
    }

    /// As [`LoadedModel::load`]; with `head_only`, a model folder's unit 0 (embeddings, final
    /// norm, head) is all that is read (a checkpoint is read whole): what the serving process
    /// of a pipeline holds.
    pub fn load_with(path: &Path, tokenizer: Option<&Path>, head_only: bool) -> Result<LoadedModel> {
        let source = ModelSource { model: path.to_path_buf(), tokenizer: tokenizer.map(Path::to_path_buf) };
        if path.join(hf::CONFIG_FILE).is_file() {
            if tokenizer.is_some() {
                bail!("--tokenizer: a model folder is served with its own {} ({})", hf::TOKENIZER_FILE, path.display());
            }
            return load_folder(path, source, head_only);
        }
        load_checkpoint(path, tokenizer, source)
    }

    /// A completion prompt's tokens: the begin-of-sequence token, then the text's.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.bos.into_iter().chain(self.codec.encode(text)?).collect())
    }

    /// The backend the engine runs this model on (the one place a backend is chosen): the paged
    /// CPU backend, its blocks split over `--pipeline-parallel-size` CPU rank processes, or the
    /// GPU backend on CUDA device 0 (`--device cuda`), with `num_blocks` cache blocks of
    /// `block_size` positions, steps of up to `max_tokens` tokens of `max_seqs` sequences (every
    /// decode step of up to `max_seqs` sequences replays a CUDA graph).
    pub fn backend(
        self,
        b: BackendChoice,
        block_size: usize,
        num_blocks: usize,
        max_seqs: usize,
        max_tokens: usize,
    ) -> Result<Box<dyn Backend>> {
        match b.device {
            Device::Cpu => {
                let weights = match b.weights.unwrap_or(Weights::F32) {
                    Weights::F32 => LinearFormat::F32,
                    Weights::Int8 => LinearFormat::Int8,
                    w @ (Weights::Bf16 | Weights::Fp8) => {
                        bail!("--weights {w}: the CPU backend holds f32 or int8 weights; {w} runs on the GPU (--device cuda)")
                    }
                };
                match b.pipeline {
                    None => {
                        ensure!(self.held == (0..self.model.num_params()), "the model was loaded without its blocks (for pipeline ranks)");
                        ensure!(b.ranks_join.is_none(), "--rank-listen needs --pipeline-parallel-size N: how many ranks to wait for");
                        Ok(Box::new(CpuBackend::new(self.model, self.params, CpuOptions { block_size, num_blocks, weights })?))
                    }
                    Some(ranks) => {
                        let opts = PipelineOptions { ranks, block_size, num_blocks, weights };
                        Ok(Box::new(self.pipeline(b.ranks_join.as_ref(), opts)?))
                    }
                }
            }
            Device::Cuda => {
                if let Some(n) = b.pipeline {
                    bail!("--pipeline-parallel-size {n} with --device cuda: pipeline ranks run on the CPU; the GPU backend holds the whole model on one device");
                }
                let weights = match b.weights.unwrap_or(Weights::Bf16) {
                    Weights::Bf16 => WeightFormat::Bf16,
                    Weights::Int8 => WeightFormat::Int8,
                    Weights::Fp8 => WeightFormat::Fp8,
                    Weights::F32 => bail!("--weights f32: the GPU backend holds bf16, int8 or fp8 weights (f32 is the CPU's)"),
                };
                let opts = DecodeOptions { num_blocks, block_size, max_tokens, max_seqs, graph_max: max_seqs, weights };
                Ok(Box::new(GpuBackend::new(0, &self.model, &self.params, opts).context("--device cuda")?))
            }
        }
    }
}

impl LoadedModel {
    /// The model over pipeline ranks: spawned here, or joining at `join` from other hosts. The
    /// ranks' blocks are checked against this model's parameters: those held, else read again
    /// from the folder (a range at a time).
    fn pipeline(self, join: Option<&RanksJoin>, opts: PipelineOptions) -> Result<PipelineBackend> {
        let all = self.held == (0..self.model.num_params());
        let load: Box<WeightLoader> = match all {
            true => Box::new(|_: &Model, r: std::ops::Range<usize>| bail!("parameters {r:?} are held already")),
            false => open_for_rank(&self.source.model, self.source.tokenizer.as_deref())?.1,
        };
        let Some(j) = join else {
            return PipelineBackend::spawn(self.model, &self.params, self.held.start, &*load, &self.source, opts);
        };
        let d = crate::launch::DriverOpts { join_timeout_ms: j.join_timeout_ms, certs: j.certs.clone(), token_file: j.token_file.clone() };
        let (endpoint, auth, token) = crate::launch::rendezvous_endpoint(&j.listen, &d).context("--rank-listen")?;
        let at = endpoint.local_addr()?;
        let command = format!("tessera serve-rank --model {}", self.source.model.display());
        let hint = crate::launch::join_hint(&command, at, &d, token.as_ref())?;
        // The command's answer (how to join), not a log line: shown even with -q.
        eprintln!("serve: waiting for {} ranks at {at} (join with {hint})", opts.ranks);
        let source = RankSource::Join { endpoint: Box::new(endpoint), auth, join_timeout_ms: j.join_timeout_ms };
        PipelineBackend::launch(self.model, &self.params, self.held.start, &*load, opts, source)
    }
}

/// Where the engine's model runs and how its linear layers are held (`--device`, `--weights`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendChoice {
    pub device: Device,
    /// None: the device's own (f32 on the CPU, bf16 on the GPU).
    pub weights: Option<Weights>,
    /// Rank processes holding the model's blocks (`--pipeline-parallel-size`, CPU); none: this
    /// process runs the whole model.
    pub pipeline: Option<usize>,
    /// The ranks join from other hosts (`--rank-listen`); none: this process starts them.
    pub ranks_join: Option<RanksJoin>,
}

/// `tessera serve --rank-listen ADDR`: where `tessera serve-rank --join` processes join, and how
/// they prove they belong (as `tessera coordinator`'s agents: a join token, printed or written
/// to `token_file`, or a cluster directory's certificates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RanksJoin {
    pub listen: String,
    pub certs: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub join_timeout_ms: u64,
}

/// `--device` of `train`, `serve` and `generate`: the CPU or NVIDIA GPUs (`serve` and
/// `generate` run on the first one `CUDA_VISIBLE_DEVICES` shows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

/// `serve --weights`, `generate --weights`: the linear layers' format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Weights {
    /// The parameters as they are (CPU).
    F32,
    /// bf16 (GPU).
    Bf16,
    /// Int8 with one scale per output channel (CPU and GPU).
    Int8,
    /// fp8 e4m3 with one scale per output channel (GPU).
    Fp8,
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Weights::F32 => "f32",
            Weights::Bf16 => "bf16",
            Weights::Int8 => "int8",
            Weights::Fp8 => "fp8",
        })
    }
}

/// What a pipeline rank opens of `path`: the model, and how to read the parameters of a flat
/// range of it — from a model folder only that range's tensors (the files are mapped); a
/// checkpoint is read whole and the range cut from it.
pub fn open_for_rank(path: &Path, tokenizer: Option<&Path>) -> Result<(Model, Box<crate::infer::ranks::rank::WeightLoader>)> {
    if path.join(hf::CONFIG_FILE).is_file() {
        let folder = hf::HfModel::open(path)?;
        let model = Model::new(folder.config.model.clone()).map_err(anyhow::Error::msg)?;
        let Some(weights) = folder.weights else { bail!("{}: the model folder has no weights", path.display()) };
        let family = folder.config.family;
        let load = move |m: &Model, r: std::ops::Range<usize>| Ok(hf::read_params_in(&weights, family, m, r)?);
        return Ok((model, Box::new(load)));
    }
    let LoadedModel { model, params, .. } = LoadedModel::load(path, tokenizer)?;
    Ok((model, Box::new(move |_: &Model, r: std::ops::Range<usize>| Ok(params[r].to_vec()))))
}

/// The name a path is served under: its last component, past a checkpoint's own directories
/// (`run/checkpoints` and `run/checkpoints/step_00000400` are served as `run`).
fn served_name(path: &Path) -> String {
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let own = |n: &str| n == "checkpoints" || n == "latest" || n.starts_with("step_");
    let name = canon.ancestors().filter_map(Path::file_name).map(|n| n.to_string_lossy()).find(|n| !own(n));
    name.map_or_else(|| path.display().to_string(), |n| n.into_owned())
}

fn load_folder(dir: &Path, source: ModelSource, head_only: bool) -> Result<LoadedModel> {
    let folder = hf::HfModel::open(dir)?;
    let Some(weights) = &folder.weights else {
        bail!("{}: the model folder has no weights (model.safetensors or an index); a trained model is needed to generate", dir.display())
    };
    let model = Model::new(folder.config.model.clone()).map_err(anyhow::Error::msg)?;
    let held = if head_only { model.units_range(0..1) } else { 0..model.num_params() };
    let params = hf::read_params_in(weights, folder.config.family, &model, held.clone())?;
    let tok_path = dir.join(hf::TOKENIZER_FILE);
    let codec = Codec::from_tokenizer_file(&tok_path)?;
    let name = dir.display().to_string();
    let id_of = |token: &str, what: &str| -> Result<u32> {
        match &codec {
            Codec::Hf(t) => t.token_to_id(token).with_context(|| format!("{}: has no token {token:?} ({what})", tok_path.display())),
            Codec::Bytes => unreachable!("a folder's tokenizer"),
        }
    };
    let bos = hf::folder_begin_of_text(&name).map(|t| id_of(&t, "the begin-of-sequence token")).transpose()?;
    let mut eos: Vec<u32> =
        hf::folder_end_of_text(&name).map(|t| id_of(&t, "the end-of-sequence token")).transpose()?.into_iter().collect();
    eos.extend(generation_eos(&folder.companions)?);
    eos.sort_unstable();
    eos.dedup();
    let chat = ChatTemplate::from_files(&folder.companions)?;
    Ok(LoadedModel { name: served_name(dir), model, params, held, codec, bos, eos, chat, source })
}

/// `generation_config.json`'s `eos_token_id` (a number or a list of them).
fn generation_eos(files: &BTreeMap<String, String>) -> Result<Vec<u32>> {
    let Some(text) = files.get("generation_config.json") else { return Ok(Vec::new()) };
    let doc: serde_json::Value = serde_json::from_str(text).context("generation_config.json: not JSON")?;
    let ids = match &doc["eos_token_id"] {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Array(a) => a.clone(),
        v => vec![v.clone()],
    };
    ids.iter()
        .map(|v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).with_context(|| {
                format!("generation_config.json: key `eos_token_id` = {}: expected a token id or a list of them", doc["eos_token_id"])
            })
        })
        .collect()
}

fn load_checkpoint(path: &Path, tokenizer: Option<&Path>, source: ModelSource) -> Result<LoadedModel> {
    let ck = crate::cli::load_checkpoint(path)?;
    let (model, params) = crate::cli::model_from_checkpoint(&ck)?;
    let tok: Option<PathBuf> = crate::cli::tokenizer_for(&ck, tokenizer)?;
    let codec = Codec::open(tok.as_deref()).context("opening the tokenizer")?;
    crate::cli::check_vocab(&codec, tok.as_deref(), &model.cfg, &ck)?;
    let named = |k: &str| ck.extra.get(k).and_then(serde_json::Value::as_str);
    let bos = crate::cli::checkpoint_bos(&ck, &codec, tok.as_deref())?;
    // The token that separated documents in training ends a text; a tokenizer without one
    // generates to the length asked for.
    let eos = codec.end_of_text(named("data_eot"), tok.as_deref()).map(|(id, _)| vec![id]).unwrap_or_default();
    let files: BTreeMap<String, String> = match ck.extra.get("model_files") {
        Some(serde_json::Value::Object(m)) => m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect(),
        _ => BTreeMap::new(),
    };
    let chat = ChatTemplate::from_files(&files).context("the checkpoint's recorded tokenizer settings (`extra.model_files`)")?;
    let held = 0..model.num_params();
    Ok(LoadedModel { name: served_name(path), model, params, held, codec, bos, eos, chat, source })
}

#[cfg(test)]
mod tests {
    use super::served_name;

    #[test]
    fn a_checkpoint_is_served_under_its_run_s_name() {
        let tmp = tempfile::tempdir().unwrap();
        let step = tmp.path().join("my-run/checkpoints/step_00000004");
        std::fs::create_dir_all(&step).unwrap();
        assert_eq!(served_name(&step), "my-run");
        assert_eq!(served_name(&tmp.path().join("my-run/checkpoints")), "my-run");
        std::fs::create_dir_all(tmp.path().join("Llama-3-8B")).unwrap();
        assert_eq!(served_name(&tmp.path().join("Llama-3-8B")), "Llama-3-8B");
    }
}
