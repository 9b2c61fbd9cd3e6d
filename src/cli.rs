//! What each `tessera` subcommand does, callable from tests as well as from `main`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_kernels::model::{Model, Workspace};
use tessera_kernels::tensor::Rng;

use crate::checkpoint::{self, CheckpointState, TensorDtype};
use crate::config::{self, Config, ResolveContext};
use crate::data::{self, Codec};
use crate::engine::{self, TrainOptions};
use crate::hf;
use crate::outln;
use crate::zoo;

/// Flags shared by `train` and `config check`; each becomes a `--set` override applied after
/// the user's own `--set`s, so flags win.
#[derive(Args, Clone, Debug, Default)]
pub struct CommonArgs {
    /// Model preset (`tessera models` lists them), or a Hugging Face model folder (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    pub model: Option<String>,
    /// Training data: a text file, JSON lines (.jsonl), Parquet, llm.c .bin shards, or a folder of them.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json (byte-level when absent).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps to run.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Output directory (checkpoints, summary.json, monitors).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Seed of the initial parameters and the data order (`tessera.seed`; a resume must keep it).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Number of workers.
    #[arg(long)]
    pub world: Option<usize>,
    /// Override any config key by dotted path, e.g. `--set zero_optimization.stage=2`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl CommonArgs {
    fn overrides(&self) -> Vec<String> {
        let mut o = self.set.clone();
        let json_str = |s: &str| serde_json::Value::String(s.to_string()).to_string();
        if let Some(m) = &self.model {
            o.push(format!("tessera.model={}", json_str(m)));
        }
        if let Some(d) = &self.data {
            o.push(format!("tessera.data={}", json_str(&d.display().to_string())));
        }
        if let Some(t) = &self.tokenizer {
            o.push(format!("tessera.tokenizer={}", json_str(&t.display().to_string())));
        }
        if let Some(s) = self.steps {
            o.push(format!("tessera.steps={s}"));
        }
        if let Some(p) = &self.output {
            o.push(format!("tessera.output_dir={}", json_str(&p.display().to_string())));
        }
        if let Some(s) = self.seed {
            o.push(format!("tessera.seed={s}"));
        }
        if let Some(w) = self.world {
            o.push(format!("tessera.world={w}"));
        }
        o
    }
}

/// `tessera completions SHELL`: the completion script for `cmd` (the whole `tessera` command
/// tree), written to `out`. Hidden subcommands and arguments (`worker`, the flags tests and
/// chaos runs pass) are left out, as they are of `--help`; clap_complete would offer them.
pub fn completions(shell: clap_complete::Shell, cmd: &clap::Command, out: &mut dyn std::io::Write) {
    clap_complete::generate(shell, &mut visible_only(cmd), cmd.get_name().to_string(), out);
}

/// `cmd` with only what completion needs of it (names, about lines, version, arguments, and
/// subcommands), less every hidden argument and subcommand.
fn visible_only(cmd: &clap::Command) -> clap::Command {
    let mut c = clap::Command::new(cmd.get_name().to_string())
        .args(cmd.get_arguments().filter(|a| !a.is_hide_set()).cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).map(visible_only));
    if let Some(about) = cmd.get_about() {
        c = c.about(about.clone());
    }
    if let Some(version) = cmd.get_version() {
        c = c.version(version.to_string());
    }
    c
}

fn hidden_size_of(name: &str) -> Option<usize> {
    zoo::resolve(name).ok().map(|m| m.config().d_model)
}

/// Loads and resolves a config file with the command-line flags applied.
pub fn load_config(path: &Path, common: &CommonArgs) -> Result<Config> {
    let ctx =
        ResolveContext { world_size: common.world, steps: common.steps, hidden_size_for_model: Some(hidden_size_of), ..Default::default() };
    Ok(config::load(path, &common.overrides(), &ctx)?)
}

fn print_warnings(cfg: &Config) {
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
}

/// The most ranks `train` runs on one machine, as threads (`--world`) or as processes
/// (`--nprocs`; also the most agents `launch` starts on one host): a bound on typos, not a
/// resource check — 100000 used to start 100000 processes.
pub const LOCAL_RANKS_MAX: usize = 1024;

/// Refuses a world larger than [`LOCAL_RANKS_MAX`] for ranks of one machine.
fn check_local_ranks(cfg: &Config, processes: bool) -> Result<()> {
    if cfg.world_size <= LOCAL_RANKS_MAX {
        return Ok(());
    }
    let what = match processes {
        true => format!("--nprocs {}", cfg.world_size),
        false => format!("world size {} (--world or tessera.world)", cfg.world_size),
    };
    bail!(
        "{what}: at most {LOCAL_RANKS_MAX} ranks run on one machine; spread a larger world over hosts (`tessera launch \
         --hostfile`, `tessera coordinator`)"
    );
}

/// `tessera train`.
/// Returns whether the run finished (false when Ctrl-C stopped it).
pub fn train(config_path: &Path, common: &CommonArgs, opts: TrainOptions) -> Result<bool> {
    train_ranks(config_path, common, opts, true)
}

/// `tessera coordinator` and `launch`: `train` whose ranks are agents, on hosts of their own.
pub fn train_agents(config_path: &Path, common: &CommonArgs, opts: TrainOptions) -> Result<bool> {
    train_ranks(config_path, common, opts, false)
}

/// Whether `train` runs NCCL GPU ranks (`tessera.device = "cuda"` with the default
/// `tessera.gpu.collective = "nccl"`, `crate::gpu::train`): threads of this process, one per GPU.
pub fn nccl_gpu_run(config_path: &Path, common: &CommonArgs) -> Result<bool> {
    Ok(crate::gpu::train::nccl_run(&load_config(config_path, common)?))
}

fn train_ranks(config_path: &Path, common: &CommonArgs, opts: TrainOptions, local: bool) -> Result<bool> {
    let cfg = load_config(config_path, common)?;
    if !local && crate::gpu::train::nccl_run(&cfg) {
        bail!(
            "{}: tessera.device = \"cuda\" with tessera.gpu.collective = \"nccl\" runs one rank per GPU of this host \
             (`tessera train --device cuda`); ranks that are agents, on other hosts, need tessera.gpu.collective = \"quic\"",
            cfg.source
        );
    }
    if local {
        check_local_ranks(&cfg, opts.processes)?;
    }
    print_warnings(&cfg);
    let out = engine::train(&cfg, &opts)?;
    outln!("{}", out.summary.render());
    let dir = out.output_dir.display();
    let pictures =
        if out.summary.pipeline.is_some() { format!(", {dir}/loss.svg and {dir}/pipeline.svg") } else { format!(" and {dir}/loss.svg") };
    outln!("wrote {dir}/summary.json{pictures}");
    Ok(!out.interrupted)
}

/// `tessera config check`.
pub fn config_check(path: &Path, common: &CommonArgs) -> Result<()> {
    let cfg = load_config(path, common)?;
    outln!("{}", config::render_check(&cfg).trim_end_matches('\n'));
    print_warnings(&cfg);
    // What `train` checks before it starts (the ranks of one machine, the data, the plan for
    // this world size, the sampler and validation batches, the elastic settings), through the
    // same functions; the memory budget and the GPU path's refusals are checked when it starts.
    check_local_ranks(&cfg, false).context("the config parses, but a run could not start")?;
    engine::validate(&cfg).context("the config parses, but a run could not start")?;
    outln!(
        "plan: OK (as `train` checks them: the data, the ZeRO plan for {} worker(s), the batch and validation sizes, the \
         elastic settings; the memory budget and the GPU path's refusals are checked when `train` starts on its device)",
        cfg.world_size
    );
    Ok(())
}

/// `tessera models`.
pub fn list_models() {
    for p in zoo::presets() {
        outln!("{:<12} {}", p.name, p.about());
    }
    outln!(
        "\neach preset is configs/models/<name>/config.json (a Hugging Face config); `--model DIR` trains a folder like it \
         (its own vocabulary and context: copy one and change it), or a Hugging Face model folder with its weights"
    );
}

/// The model folder's config a checkpoint recorded (`extra.model_config`), parsed; `None` for
/// a preset's checkpoint.
pub fn checkpoint_hf_config(ck: &CheckpointState) -> Result<Option<hf::HfConfig>> {
    match ck.extra.get("model_config").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(doc) => {
            let what = format!("the checkpoint's record of {}/config.json (manifest `extra.model_config`)", ck.model);
            Ok(Some(hf::parse(&what, doc)?))
        }
    }
}

/// A model rebuilt from a checkpoint: the model folder's config it recorded, or the preset
/// named in the manifest with the vocabulary read off `wte.weight`, then the `tessera.moe`
/// section the run had (`extra.moe`) as training applied it; parameters copied into a flat
/// buffer in layout order.
pub fn model_from_checkpoint(ck: &CheckpointState) -> Result<(Model, Vec<f32>)> {
    let mut mcfg = match checkpoint_hf_config(ck)? {
        Some(h) => h.model,
        None => {
            let mut mcfg = zoo::preset(&ck.model).map_err(anyhow::Error::msg)?;
            let wte = ck.params.iter().find(|t| t.name == "wte.weight").context("checkpoint has no `wte.weight`")?;
            mcfg.vocab_size = *wte.shape.first().context("`wte.weight` has no shape")?;
            mcfg
        }
    };
    if let Some(moe) = ck.extra.get("moe").filter(|v| !v.is_null()) {
        let what = "the checkpoint's record of the run's `tessera.moe` section (manifest `extra.moe`)";
        let root = serde_json::json!({ "tessera": { "moe": moe } });
        let section = crate::config::moe::parse_moe(&root).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        if let Some(section) = section {
            mcfg = section.apply(&mcfg, &ck.model).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        }
    }
    let model = Model::new(mcfg).map_err(anyhow::Error::msg)?;
    let mut flat = vec![0.0; model.num_params()];
    for spec in model.layout().specs() {
        let t = ck.params.iter().find(|t| t.name == spec.name).with_context(|| missing_tensor(ck, &spec.name))?;
        if t.shape != spec.shape {
            bail!("checkpoint tensor `{}` has shape {:?}, model `{}` expects {:?}", spec.name, t.shape, ck.model, spec.shape);
        }
        flat[spec.range()].copy_from_slice(&t.data);
    }
    Ok((model, flat))
}

/// Why `ck` lacks the rebuilt model's tensor `name`: said plainly when the checkpoint's blocks
/// hold experts the rebuilt (dense) preset does not have — a preset trained with a
/// `tessera.moe` section, whose manifest records the preset's name and not that section.
fn missing_tensor(ck: &CheckpointState, name: &str) -> String {
    if !name.contains(".moe.") && ck.params.iter().any(|t| t.name.contains(".moe.")) {
        return format!(
            "checkpoint lacks `{name}`: its blocks hold experts (`….moe.…` tensors) but its manifest records only the preset \
             `{}` and no MoE configuration (a preset trained with a `tessera.moe` section by a Tessera older than \
             `extra.moe`), so the model cannot be rebuilt from it; train it again, or serve a model whose config.json has \
             the experts (e.g. `mixtral-tiny`, or a model folder)",
            ck.model
        );
    }
    format!("checkpoint lacks `{name}`")
}

pub(crate) fn load_checkpoint(path: &Path) -> Result<CheckpointState> {
    let r = checkpoint::resolve_resume(path).with_context(|| format!("loading checkpoint {}", path.display()))?;
    for s in &r.skipped {
        tracing::warn!("skipped checkpoint {}: {}", s.dir.display(), s.error);
    }
    Ok(r.state)
}

/// Options of `tessera generate`.
pub struct GenerateOpts {
    pub checkpoint: PathBuf,
    pub prompt: String,
    pub tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
    pub tokenizer: Option<PathBuf>,
    /// The device and the linear layers' format.
    pub backend: crate::serve::model::BackendChoice,
}

/// The tokenizer to decode a checkpoint's tokens with: the one it was trained with (recorded in
/// the manifest) unless `given`, which must then be the same file (by blake3).
pub(crate) fn tokenizer_for(ck: &CheckpointState, given: Option<&Path>) -> Result<Option<PathBuf>> {
    let recorded = ck.extra.get("tokenizer").cloned().unwrap_or_default();
    let Some(given) = given else {
        let path = recorded.get("path").and_then(serde_json::Value::as_str).map(PathBuf::from);
        if let Some(p) = &path {
            if !p.exists() {
                bail!(
                    "the checkpoint was trained with {}, which is gone; pass --tokenizer with a copy of it",
                    data::describe_record(&recorded)
                );
            }
        }
        return Ok(path);
    };
    let now = data::tokenizer_record(Some(given))?;
    if recorded.get("blake3") != now.get("blake3") {
        bail!("--tokenizer {} is not what the checkpoint was trained with ({})", given.display(), data::describe_record(&recorded));
    }
    Ok(Some(given.to_path_buf()))
}

/// Refuses a tokenizer whose ids do not all fit the checkpoint's model, naming the tokenizer
/// file and the model's `vocab_size`.
pub(crate) fn check_vocab(
    codec: &Codec,
    tokenizer: Option<&Path>,
    model: &tessera_kernels::model::ModelConfig,
    ck: &CheckpointState,
) -> Result<()> {
    if codec.vocab_size() > model.vocab_size {
        let file = tokenizer.map_or("the byte-level tokens".to_string(), |p| format!("tokenizer {}", p.display()));
        bail!(
            "{file}: a vocabulary of {} ids is larger than the model's `vocab_size` = {} (checkpoint of `{}`): pass the tokenizer it was trained with",
            codec.vocab_size(),
            model.vocab_size,
            ck.model
        );
    }
    Ok(())
}

/// The token a prompt starts with, as the model trained on documents: the begin-of-text token
/// when the run put one before every document (`extra.data_bos`, `tessera.data_bos`), as the
/// model folder's tokenizer does for a sequence.
pub(crate) fn checkpoint_bos(ck: &CheckpointState, codec: &Codec, tokenizer: Option<&Path>) -> Result<Option<u32>> {
    let named = ck.extra.get("data_bos").and_then(serde_json::Value::as_str);
    codec.begin_of_text(named, tokenizer).context("the checkpoint's begin-of-text token (manifest `extra.data_bos`)")
}

/// The prompt's tokens ([`checkpoint_bos`] first) and the index the shown text starts at.
#[cfg(test)]
fn prompt_tokens(ck: &CheckpointState, codec: &Codec, tokenizer: Option<&Path>, prompt: &str) -> Result<(Vec<u32>, usize)> {
    let bos = checkpoint_bos(ck, codec, tokenizer)?;
    let tokens: Vec<u32> = bos.into_iter().chain(codec.encode(prompt)?).collect();
    Ok((tokens, usize::from(bos.is_some())))
}

/// `tessera generate`: one request through the inference engine ([`crate::infer::Engine`]), its
/// text streamed to standard output. It generates `--tokens` tokens whatever they are (the
/// end-of-text token included); past the model's context it goes on from the last half-context of
/// tokens (a new request: the cache is rebuilt from them).
pub fn generate(o: &GenerateOpts) -> Result<()> {
    if !o.temperature.is_finite() {
        bail!("--temperature {}: expected a finite number (> 0 samples; 0 or below is greedy)", o.temperature);
    }
    // Over pipeline ranks this process holds the embeddings and the head only.
    let mut m = crate::serve::model::LoadedModel::load_with(&o.checkpoint, o.tokenizer.as_deref(), o.backend.pipeline.is_some())?;
    let shown = usize::from(m.bos.is_some());
    let mut tokens = m.encode_prompt(&o.prompt).context("encoding the prompt")?;
    let codec = std::mem::replace(&mut m.codec, Codec::Bytes);
    if tokens.len() == shown {
        bail!("the prompt encodes to no tokens; give --prompt some text");
    }
    let ctx = m.model.cfg.max_seq_len;
    let mut engine = crate::serve::engine_for(m, 16, 0, o.backend.clone(), 1, 512)?;
    let mut out = std::io::stdout();
    let streamed = show(&mut out, &codec.decode(&tokens[shown..])).and_then(|()| {
        let mut text = crate::infer::text::TextOut::new(Vec::new());
        let (mut left, mut segment) = (o.tokens, 0u64);
        while left > 0 {
            let keep = if segment == 0 { ctx - 1 } else { ctx / 2 };
            let window = tokens[tokens.len().saturating_sub(keep)..].to_vec();
            let n = left.min(ctx - window.len());
            let seed = if segment == 0 { o.seed } else { Rng::derive(o.seed, &[segment]).next_u64() };
            let sampling = crate::infer::SamplingParams {
                temperature: o.temperature.max(0.0),
                top_k: o.top_k,
                top_p: 1.0,
                repetition_penalty: 1.0,
                seed,
            };
            let req = crate::infer::Request { prompt: window, max_tokens: n, sampling, stop_tokens: Vec::new() };
            engine.add(segment, req).map_err(std::io::Error::other)?;
            while !engine.is_idle() {
                for ev in engine.step().map_err(std::io::Error::other)? {
                    tokens.push(ev.token);
                    show(&mut out, &text.push(&codec, ev.token))?;
                }
            }
            left -= n;
            segment += 1;
        }
        show(&mut out, &format!("{}\n", text.finish(&codec)))
    });
    match streamed {
        // The reader went away (`generate … | head`): it has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing the generated text to standard output"),
    }
}

/// Writes and flushes `text` (nothing when empty).
fn show(out: &mut std::io::Stdout, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    if text.is_empty() {
        return Ok(());
    }
    let mut lock = out.lock();
    lock.write_all(text.as_bytes())?;
    lock.flush()
}

/// Options of `tessera export`.
pub struct ExportOpts {
    pub checkpoint: PathBuf,
    pub out: PathBuf,
    /// The tokenizer.json the model was trained with (the recorded one when absent).
    pub tokenizer: Option<PathBuf>,
    /// Write into a folder that is not empty (replacing only the files export writes).
    pub force: bool,
    /// The weights' dtype; `None`: the model folder's own when it is bf16, else f32.
    pub dtype: Option<crate::checkpoint::TensorDtype>,
}

/// The files `tessera export` writes (and, with `--force`, replaces); a model over
/// [`hf::SHARD_BYTES_MAX`] is written as `model-0000i-of-0000n.safetensors` shards and their
/// index instead of `model.safetensors`.
pub const EXPORT_FILES: &[&str] = &[
    "model.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "reference.json",
    checkpoint::TOKENIZER_FILE,
    checkpoint::TOKENIZER_CONFIG_FILE,
    checkpoint::SPECIAL_TOKENS_FILE,
    // Only when the model folder trained from had them (`hf::companions`).
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// The text whose ids an export's `reference.json` records: the exported tokenizer must give
/// the same (`scripts/check_export.py`). Spaces, a line break, punctuation and multi-byte
/// characters.
const TOKENIZER_SAMPLE: &str = "It is a truth universally acknowledged, that a single man in possession of a good fortune — café ☕\n";

/// Refuses an export into a folder that holds anything, unless `force`.
fn refuse_non_empty(out: &Path, force: bool) -> Result<()> {
    let mut entries = match std::fs::read_dir(out) {
        Ok(rd) => rd,
        // Missing, or not a folder: the export's own creation of it says why.
        Err(_) => return Ok(()),
    };
    if entries.next().is_some() && !force {
        bail!(
            "--out {} is not empty: export writes {} there; pass --force to replace those files (the folder's other files \
             stay as they are), or export into a new or empty folder",
            out.display(),
            EXPORT_FILES.join(", ")
        );
    }
    Ok(())
}

/// The bytes of the tokenizer a checkpoint was trained with (`None`: byte-level), checked
/// against the manifest's record: a file changed since is refused.
fn training_tokenizer_bytes(ck: &CheckpointState, given: Option<&Path>) -> Result<Option<(PathBuf, Vec<u8>)>> {
    let Some(path) = tokenizer_for(ck, given)? else { return Ok(None) };
    let bytes = std::fs::read(&path).with_context(|| format!("reading the tokenizer {}", path.display()))?;
    let recorded = ck.extra.get("tokenizer").and_then(|t| t.get("blake3")).and_then(serde_json::Value::as_str);
    if recorded != Some(blake3::hash(&bytes).to_hex().as_str()) {
        bail!(
            "{} changed since the checkpoint was trained with it (blake3 {}); pass --tokenizer with a copy of the original",
            path.display(),
            recorded.unwrap_or("not recorded")
        );
    }
    Ok(Some((path, bytes)))
}

/// Puts the model folder's own tokenizer and generation files a checkpoint recorded
/// (`extra.model_files`, `hf::companions`) into an export's `files`, byte for byte, in place of
/// the generated ones of the same name.
fn carry_model_files(ck: &CheckpointState, files: &mut Vec<(&'static str, Vec<u8>)>) -> Result<()> {
    let Some(recorded) = ck.extra.get("model_files").filter(|v| !v.is_null()) else { return Ok(()) };
    let what = "the checkpoint's manifest, key `extra.model_files`";
    let recorded = recorded.as_object().with_context(|| format!("{what}: expected an object of file name to text"))?;
    for (name, text) in recorded {
        let (Some(name), Some(text)) = (hf::companions::known(name), text.as_str()) else {
            bail!("{what}: `{name}` is not a model folder file Tessera carries, or its value is not text");
        };
        let bytes = text.as_bytes().to_vec();
        match files.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = bytes,
            None => files.push((name, bytes)),
        }
    }
    Ok(())
}

/// `tessera export`: a Hugging Face folder of the model's family (the folder it came from, or
/// GPT-2 / LLaMA for a preset; `hf::export`): safetensors + config.json, the tokenizer's files
/// (`AutoTokenizer.from_pretrained` gives the ids the model was trained on) and
/// `reference.json` (the loss Tessera computes on a fixed token sequence, and a sample text's
/// ids) for `scripts/check_export.py`.
pub fn export(o: &ExportOpts) -> Result<()> {
    let out = o.out.as_path();
    refuse_non_empty(out, o.force)?;
    let ck = load_checkpoint(&o.checkpoint)?;
    let (model, params) = model_from_checkpoint(&ck)?;
    let c = &model.cfg;
    let recorded = checkpoint_hf_config(&ck)?;
    let family = recorded.as_ref().map_or(hf::default_family(c), |h| h.family);
    let dtype = o.dtype.unwrap_or_else(|| hf::recorded_dtype(recorded.as_ref().map(|h| &h.doc)));
    let doc = hf::config_doc(family, c, recorded.as_ref().map(|h| &h.doc), dtype);
    let tokenizer = training_tokenizer_bytes(&ck, o.tokenizer.as_deref())?;
    let codec = Codec::open(tokenizer.as_ref().map(|(p, _)| p.as_path())).context("opening the tokenizer")?;
    check_vocab(&codec, tokenizer.as_ref().map(|(p, _)| p.as_path()), c, &ck)?;
    let text_ids = codec.encode(TOKENIZER_SAMPLE).context("encoding the tokenizer sample")?;
    let mut files = checkpoint::tokenizer_files(tokenizer.as_ref().map(|(_, b)| b.as_slice()), c.max_seq_len)?;
    carry_model_files(&ck, &mut files)?;
    // t + 1 tokens go through transformers (labels = inputs), within the context.
    let t = c.max_seq_len.saturating_sub(1).clamp(1, 64);
    let tokens: Vec<u32> = (0..=t).map(|i| ((i * 37 + 11) % c.vocab_size) as u32).collect();
    // The reference loss is the written weights' (bf16 ones widen exactly back to f32).
    let written_params: Vec<f32> = match dtype {
        TensorDtype::F32 => params.clone(),
        TensorDtype::Bf16 => params.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
    };
    let mut ws = Workspace::default();
    let mut unused = Vec::new();
    let mut acc = tessera_kernels::model::FlatAccess { params: &written_params, grads: &mut unused, units: model.units() };
    let loss = model.loss(&mut acc, &tokens[..t], &tokens[1..], 1, t, &mut ws);
    let decoded = codec.decode(&text_ids);
    let sample = checkpoint::TokenizerSample { text: TOKENIZER_SAMPLE, ids: &text_ids, decoded: &decoded };
    let reference = checkpoint::ExportReference { tokens: &tokens, loss, text: Some(sample) };
    files.push(("reference.json", checkpoint::reference_json(&reference, c.vocab_size)?));
    let format = hf::WeightFormat { dtype, shard_bytes_max: hf::SHARD_BYTES_MAX };
    let written =
        hf::export(out, family, (&model, &params), &doc, &files, format).with_context(|| format!("exporting to {}", out.display()))?;
    outln!(
        "wrote {} ({}, {} weights): {} (loss {loss:.6} on {} tokens; tokenizer: {})",
        out.display(),
        family.architecture(),
        dtype.torch(),
        written.files.join(", "),
        tokens.len(),
        codec.describe()
    );
    outln!("check with: python3 scripts/check_export.py {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(extra: serde_json::Value) -> CheckpointState {
        let (data_cursor, rng) = (serde_json::Value::Null, serde_json::Value::Null);
        CheckpointState { step: 1, config_hash: String::new(), model: "m".into(), data_cursor, rng, extra, params: vec![], optim: vec![] }
    }

    /// A recorded folder file replaces the generated one of its name byte for byte, a new one
    /// is added; a name that is not a model folder file Tessera carries (a path, say) is refused.
    #[test]
    fn recorded_model_files_replace_the_generated_ones_and_nothing_else_is_written() {
        let generated = || vec![("tokenizer.json", b"T".to_vec()), ("tokenizer_config.json", b"generated".to_vec())];
        let mut files = generated();
        let ck = state(
            serde_json::json!({"model_files": {"tokenizer_config.json": "{\"chat_template\": \"x\"}\n", "generation_config.json": "{}"}}),
        );
        carry_model_files(&ck, &mut files).unwrap();
        let want = vec![
            ("tokenizer.json", b"T".to_vec()),
            ("tokenizer_config.json", b"{\"chat_template\": \"x\"}\n".to_vec()),
            ("generation_config.json", b"{}".to_vec()),
        ];
        assert_eq!(files, want);
        let mut files = generated();
        carry_model_files(&state(serde_json::json!({"model_files": null})), &mut files).unwrap();
        assert_eq!(files, generated(), "a preset's checkpoint records none");
        for bad in [serde_json::json!({"../config.json": "{}"}), serde_json::json!({"tokenizer_config.json": 3})] {
            let e = carry_model_files(&state(serde_json::json!({ "model_files": bad })), &mut generated()).unwrap_err().to_string();
            assert!(e.contains("extra.model_files") && e.contains("not a model folder file Tessera carries"), "{e}");
        }
    }

    /// A preset trained with experts its manifest does not record is refused saying so; a
    /// checkpoint merely missing a tensor names it.
    #[test]
    fn a_checkpoint_with_experts_of_a_dense_preset_is_refused_saying_why() {
        let tensor = |name: &str| crate::checkpoint::NamedTensor { name: name.into(), shape: vec![256, 128], data: vec![0.0; 256 * 128] };
        let mut ck = state(serde_json::json!({}));
        ck.model = "gpt-tiny".into();
        ck.params = vec![tensor("wte.weight"), tensor("h.0.moe.router.weight")];
        let e = model_from_checkpoint(&ck).err().expect("refused").to_string();
        assert!(e.contains("its blocks hold experts"), "{e}");
        assert!(e.contains("preset `gpt-tiny` and no MoE configuration"), "{e}");
        ck.params.pop();
        let e = model_from_checkpoint(&ck).err().expect("refused").to_string();
        assert!(e.starts_with("checkpoint lacks `") && !e.contains("experts"), "{e}");
    }

    /// A prompt opens with the begin-of-text token the run framed its documents with, and only
    /// then; the shown text leaves it out.
    #[test]
    fn a_prompt_opens_with_the_runs_begin_of_text_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, include_str!("../tests/fixtures/tiny_bpe.json")).unwrap();
        let codec = Codec::open(Some(&path)).unwrap();
        let plain = codec.encode("hello world").unwrap();
        let (tokens, shown) = prompt_tokens(&state(serde_json::json!({"data_bos": "hello"})), &codec, Some(&path), "hello world").unwrap();
        assert_eq!((tokens[0], &tokens[1..], shown), (codec.encode("hello").unwrap()[0], &plain[..], 1));
        for extra in [serde_json::json!({"data_bos": null}), serde_json::json!({})] {
            assert_eq!(prompt_tokens(&state(extra), &codec, Some(&path), "hello world").unwrap(), (plain.clone(), 0));
        }
        let e = prompt_tokens(&state(serde_json::json!({"data_bos": "<s>"})), &codec, Some(&path), "hello").unwrap_err();
        assert!(format!("{e:#}").contains("extra.data_bos") && format!("{e:#}").contains("has no token \"<s>\""), "{e:#}");
    }
}
