//! The pipeline backend against the one-process backend: the same steps give the same logits,
//! bit for bit, for every block family, every cut and both weight formats; greedy decoding of
//! the transformers-made folders gives transformers' tokens; the engine over ranks generates
//! what it generates over one process; a lost rank fails the step, and every later one, by name.
//! Ranks here are threads with their own QUIC endpoints and certificates (the same
//! `serve_rank` a `tessera serve-rank` process runs); `tests/e2e_serve.rs` runs processes.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Result;
use tessera_kernels::model::{Arch, Model, ModelConfig};
use tessera_kernels::tensor::Rng;
use tessera_transport::quic::ControlConn;

use tessera_fleet::agent::{AgentArgs, AgentCredentials};

use super::rank::{connect, serve_rank};
use super::{PipelineBackend, PipelineOptions, RankProcess, RankSource};
use crate::infer::backend::{Backend, BackendLost, SeqStep};
use crate::infer::cpu::{CpuBackend, CpuOptions, LinearFormat};

/// Each rank's connection, once it has one (to crash it).
type RankConns = Vec<Arc<Mutex<Option<ControlConn>>>>;

/// A rank on a thread: `stop` (and a test's `crash`) aborts its connection.
struct ThreadRank {
    handle: Option<JoinHandle<Result<()>>>,
    conn: Arc<Mutex<Option<ControlConn>>>,
}

impl ThreadRank {
    fn crash(conn: &Mutex<Option<ControlConn>>) {
        if let Some(c) = conn.lock().unwrap().as_ref() {
            c.abort("crashed on purpose");
        }
    }
}

impl RankProcess for ThreadRank {
    fn exited(&mut self) -> Option<String> {
        self.handle.as_ref().filter(|h| h.is_finished()).map(|_| "ended".to_string())
    }

    fn stop(&mut self) {
        ThreadRank::crash(&self.conn);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A pipeline of `ranks` thread ranks loading `cfg` with `params`; the connections of the ranks
/// (to crash them).
fn pipeline(
    cfg: &ModelConfig,
    params: &[f32],
    ranks: usize,
    weights: LinearFormat,
) -> (PipelineBackend, Vec<Arc<Mutex<Option<ControlConn>>>>) {
    pipeline_loading(cfg, params, ranks, weights, &|_| cfg.clone()).unwrap()
}

/// A rank as `tessera serve-rank` runs it, on a thread: joins at `join` (`rank`, with
/// `credentials`), loads `cfg` with `params` (the model's own initialisation when they do not
/// fit it) and serves; its connection goes into `slot` once it has one.
fn thread_rank(
    name: &str,
    join: SocketAddr,
    rank: Option<usize>,
    credentials: AgentCredentials,
    cfg: ModelConfig,
    params: Vec<f32>,
    slot: Arc<Mutex<Option<ControlConn>>>,
) -> JoinHandle<Result<()>> {
    let name = name.to_string();
    std::thread::spawn(move || {
        let args = AgentArgs {
            join: join.to_string(),
            name,
            rank,
            world: None,
            advertise: None,
            quic_port: 0,
            credentials,
            connect_timeout_ms: 10_000,
            worker_net: None,
        };
        let (_endpoint, conn) = connect(&args)?;
        *slot.lock().unwrap() = Some(conn.clone());
        let model = Model::new(cfg).map_err(anyhow::Error::msg)?;
        let p = if params.len() == model.num_params() { params } else { model.init_params(1) };
        serve_rank(conn, model, &move |_: &Model, range: std::ops::Range<usize>| Ok(p[range].to_vec()))
    })
}

/// As [`pipeline`], rank `r` loading the model `loads(r)`.
fn pipeline_loading(
    cfg: &ModelConfig,
    params: &[f32],
    ranks: usize,
    weights: LinearFormat,
    loads: &dyn Fn(usize) -> ModelConfig,
) -> Result<(PipelineBackend, RankConns)> {
    pipeline_with(cfg, params, ranks, PipelineOptions { ranks, block_size: 4, num_blocks: 32, weights }, &|r| (loads(r), params.to_vec()))
}

/// As [`pipeline`], with `opts`, rank `r` loading the model and parameters `loads(r)`.
fn pipeline_with(
    cfg: &ModelConfig,
    params: &[f32],
    ranks: usize,
    opts: PipelineOptions,
    loads: &dyn Fn(usize) -> (ModelConfig, Vec<f32>),
) -> Result<(PipelineBackend, RankConns)> {
    let mut conns = Vec::new();
    let mut start = |r: usize, control: SocketAddr, pki: &Path| -> Result<Box<dyn RankProcess>> {
        let (cfg, p) = loads(r);
        let slot = Arc::new(Mutex::new(None));
        conns.push(Arc::clone(&slot));
        let handle =
            thread_rank(&format!("local-{r}"), control, Some(r), AgentCredentials::Certs(pki.to_path_buf()), cfg, p, Arc::clone(&slot));
        Ok(Box::new(ThreadRank { handle: Some(handle), conn: slot }))
    };
    let model = Model::new(cfg.clone()).unwrap();
    let unreachable = |_: &Model, r: std::ops::Range<usize>| -> Result<Vec<f32>> { anyhow::bail!("{r:?} is held") };
    let b = PipelineBackend::launch(model, params, 0, &unreachable, PipelineOptions { ranks, ..opts }, RankSource::Spawn(&mut start))?;
    Ok((b, conns))
}

fn one_process(cfg: &ModelConfig, params: &[f32], weights: LinearFormat) -> CpuBackend {
    let model = Model::new(cfg.clone()).unwrap();
    CpuBackend::new(model, params.to_vec(), CpuOptions { block_size: 4, num_blocks: 32, weights }).unwrap()
}

/// A dense model of `arch` with three blocks (the CPU backend's tests' model).
fn dense(arch: Arch) -> ModelConfig {
    ModelConfig { n_layer: 3, ..crate::infer::cpu::tests::dense(arch) }
}

/// One model of each block family the CPU serves (the CPU backend's tests' models), three
/// blocks each.
fn families() -> Vec<(&'static str, ModelConfig)> {
    crate::infer::cpu::tests::families().into_iter().map(|(name, cfg)| (name, ModelConfig { n_layer: 3, ..cfg })).collect()
}

fn params(n: usize, seed: u64) -> Vec<f32> {
    let mut p = vec![0.0; n];
    Rng::new(seed).fill_normal(&mut p, 0.2);
    p
}

fn step<'a>(tokens: &'a [u32], start: usize, block_table: &'a [u32], want_logits: bool) -> SeqStep<'a> {
    SeqStep { tokens, start, block_table, want_logits }
}

/// What a server does to a cache: a prompt in two chunks, a second prompt sharing its first
/// block, both decoding in the same steps; every step's logits, in order.
fn scenario(b: &mut dyn Backend) -> Vec<Vec<Vec<f32>>> {
    let a: Vec<u32> = (0..11).map(|i| (i * 5 + 2) % 37).collect();
    let c: Vec<u32> = a[..4].iter().copied().chain((0..5).map(|i| (i * 3 + 1) % 37)).collect();
    let (ta, tc): (&[u32], &[u32]) = (&[3, 9, 17, 4, 5], &[3, 20, 21, 22]);
    let mut out = vec![b.step(&[step(&a[..6], 0, ta, false)]).unwrap()];
    out.push(b.step(&[step(&a[6..], 6, ta, true), step(&c[4..], 4, tc, true)]).unwrap());
    for i in 0..5u32 {
        let (pa, pc) = (11 + i as usize, 9 + i as usize);
        out.push(b.step(&[step(&[(i * 7) % 37], pa, ta, true), step(&[(i * 11 + 1) % 37], pc, tc, true)]).unwrap());
    }
    out
}

fn bits(logits: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    logits.iter().map(|s| s.iter().map(|l| l.iter().map(|x| x.to_bits()).collect()).collect()).collect()
}

#[test]
fn pipeline_ranks_give_the_one_process_bits_for_every_family_cut_and_format() {
    for (name, cfg) in families() {
        let p = params(Model::new(cfg.clone()).unwrap().num_params(), 7);
        for weights in [LinearFormat::F32, LinearFormat::Int8] {
            let want = bits(&scenario(&mut one_process(&cfg, &p, weights)));
            for ranks in 1..=cfg.n_layer {
                let (mut b, _) = pipeline(&cfg, &p, ranks, weights);
                assert_eq!(b.spans().len(), ranks);
                assert_eq!(bits(&scenario(&mut b)), want, "{name}, {weights:?}, {ranks} ranks ({:?})", b.spans());
            }
        }
    }
}

/// A transformers-made folder's model.
fn folder(name: &str) -> (ModelConfig, Vec<f32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name);
    let hf = crate::hf::HfModel::open(&dir).unwrap();
    let model = Model::new(hf.config.model.clone()).unwrap();
    let params = crate::hf::read_params(hf.weights.as_ref().unwrap(), hf.config.family, &model).unwrap();
    (hf.config.model.clone(), params)
}

/// Greedy decoding over two ranks of the GPT-2 and LLaMA folders: transformers' `generate`
/// tokens (`generate.json`), and the one-process backend's logits bit for bit at every step.
#[test]
fn greedy_decoding_over_ranks_gives_transformers_tokens_and_the_one_process_bits() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/generate.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let argmax = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32;
    for name in ["gpt2", "llama", "mixtral"] {
        let (cfg, p) = folder(name);
        let (prompt, want) = (ids(&fixture[name]["prompt"]), ids(&fixture[name]["generated"]));
        let (mut one, (mut two, _)) = (one_process(&cfg, &p, LinearFormat::F32), pipeline(&cfg, &p, 2, LinearFormat::F32));
        let table: Vec<u32> = (0..32).rev().collect();
        let mut got: Vec<u32> = Vec::new();
        while got.len() < want.len() {
            let (run, pos): (&[u32], usize) =
                if got.is_empty() { (&prompt, 0) } else { (&got[got.len() - 1..], prompt.len() + got.len() - 1) };
            let (a, b) = (one.step(&[step(run, pos, &table, true)]).unwrap(), two.step(&[step(run, pos, &table, true)]).unwrap());
            assert_eq!(bits(std::slice::from_ref(&b)), bits(&[a]), "{name}: logits at position {pos}");
            got.push(argmax(&b[0]));
        }
        assert_eq!(got, want, "{name}: greedy tokens over two ranks against transformers' generate");
    }
}

/// The scheduler and sampler over two ranks (continuous batching, chunked prefill, shared
/// prefixes, sampled and greedy requests) generate the one-process engine's tokens.
#[test]
fn the_engine_over_ranks_generates_what_it_generates_in_one_process() {
    use crate::infer::{Engine, Request, SamplingParams};
    let cfg = ModelConfig { n_kv_head: 2, vocab_size: 61, max_seq_len: 48, ..dense(Arch::Llama) };
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 3);
    let shared: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % 61).collect();
    let reqs: Vec<Request> = (0..5)
        .map(|k| {
            let mut prompt = if k % 2 == 0 { shared.clone() } else { vec![] };
            prompt.extend((0..(2 + 3 * k)).map(|i| ((i * 11 + k * 5) % 61) as u32));
            let sampling = SamplingParams {
                temperature: if k < 2 { 0.0 } else { 0.9 },
                top_k: 20,
                top_p: 0.9,
                repetition_penalty: 1.1,
                seed: k as u64,
            };
            Request { prompt, max_tokens: 5 + k, sampling, stop_tokens: vec![] }
        })
        .collect();
    let run = |b: Box<dyn Backend>| {
        let mut e = Engine::new(b, 7, 4).unwrap();
        for (i, r) in reqs.iter().enumerate() {
            e.add(i as u64, r.clone()).unwrap();
        }
        let mut out = vec![Vec::new(); reqs.len()];
        while !e.is_idle() {
            for ev in e.step().unwrap() {
                out[ev.id as usize].push(ev.token);
            }
        }
        out
    };
    let want = run(Box::new(one_process(&cfg, &p, LinearFormat::F32)));
    assert_eq!(run(Box::new(pipeline(&cfg, &p, 2, LinearFormat::F32).0)), want);
}

#[test]
fn a_lost_rank_fails_the_step_and_every_later_one_by_name() {
    let cfg = dense(Arch::Gpt);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 7);
    let (mut b, conns) = pipeline(&cfg, &p, 3, LinearFormat::F32);
    let t: Vec<u32> = vec![1, 2, 3];
    b.step(&[step(&t, 0, &[0], true)]).unwrap();
    ThreadRank::crash(&conns[1]);
    let e = b.step(&[step(&t[..1], 3, &[0], true)]).unwrap_err();
    let lost = e.downcast_ref::<BackendLost>().unwrap_or_else(|| panic!("not a lost backend: {e:#}"));
    assert!(lost.0.starts_with("rank 1 (blocks 1..2, pid "), "{lost}");
    let again = b.step(&[step(&t[..1], 3, &[0], true)]).unwrap_err();
    assert_eq!(again.downcast_ref::<BackendLost>(), Some(lost));
}

#[test]
fn a_rank_that_loaded_another_model_is_refused_at_start() {
    let cfg = dense(Arch::Gpt);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 7);
    let other = |r: usize| if r == 1 { ModelConfig { d_ff: 64, ..cfg.clone() } } else { cfg.clone() };
    let e = pipeline_loading(&cfg, &p, 2, LinearFormat::F32, &other).err().expect("a rank with another model");
    let e = format!("{e:#}");
    assert!(
        e.contains("serve-rank local-1 at 127.0.0.1 (pid ")
            && e.contains("loaded another model than this server's: d_ff: 64 (the server's: d_ff: 48)"),
        "{e}"
    );
    let e = pipeline_loading(&cfg, &p, 4, LinearFormat::F32, &|_| cfg.clone()).err().expect("more ranks than blocks");
    assert!(format!("{e:#}").contains("--pipeline-parallel-size 4: expected 1 to the model's 3 blocks"), "{e:#}");
}

/// A server's ranks' endpoint on loopback with a join token, as `tessera serve --rank-listen`
/// opens it: the source to launch with, and the token's credentials.
fn join_door() -> (SocketAddr, RankSource<'static>, AgentCredentials) {
    join_door_for(20_000)
}

/// As [`join_door`], waiting `join_timeout_ms` for the ranks.
fn join_door_for(join_timeout_ms: u64) -> (SocketAddr, RankSource<'static>, AgentCredentials) {
    let d = crate::launch::DriverOpts { join_timeout_ms, certs: None, token_file: None };
    let (endpoint, auth, token) = crate::launch::rendezvous_endpoint("127.0.0.1:0", &d).unwrap();
    let at = endpoint.local_addr().unwrap();
    (at, RankSource::Join { endpoint: Box::new(endpoint), auth, join_timeout_ms }, AgentCredentials::Token(token.unwrap().text()))
}

fn slot() -> Arc<Mutex<Option<ControlConn>>> {
    Arc::new(Mutex::new(None))
}

/// Ranks that join with the server's token (one asking for rank 1, one for any) serve with the
/// one-process bits; once both are held, a third asking for rank 1 is refused, told who holds
/// the ranks.
#[test]
fn ranks_joining_with_a_token_serve_and_a_late_claim_hears_who_holds_the_ranks() {
    let cfg = dense(Arch::Llama);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 5);
    let (at, source, token) = join_door();
    let late = thread_rank("b", at, Some(1), token.clone(), cfg.clone(), p.clone(), slot());
    let any = thread_rank("a", at, None, token.clone(), cfg.clone(), p.clone(), slot());
    let model = Model::new(cfg.clone()).unwrap();
    let opts = PipelineOptions { ranks: 2, block_size: 4, num_blocks: 32, weights: LinearFormat::F32 };
    let unreachable = |_: &Model, r: std::ops::Range<usize>| -> Result<Vec<f32>> { anyhow::bail!("{r:?} is held") };
    let mut b = PipelineBackend::launch(model, &p, 0, &unreachable, opts, source).unwrap();
    assert_eq!(bits(&scenario(&mut b)), bits(&scenario(&mut one_process(&cfg, &p, LinearFormat::F32))));
    let third = thread_rank("c", at, Some(1), token, cfg.clone(), p.clone(), slot()).join().unwrap().unwrap_err();
    let e = format!("{third:#}");
    assert!(e.contains("every rank of this server is held") && e.contains("rank 1 (blocks 1..3, pid "), "{e}");
    drop(b);
    late.join().unwrap().unwrap();
    any.join().unwrap().unwrap();
}

/// Two ranks asking for the same rank: the start fails naming both, and both hear why.
#[test]
fn two_ranks_asking_for_one_rank_fail_the_start_naming_both() {
    let cfg = dense(Arch::Gpt);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 5);
    let (at, source, token) = join_door();
    let first = thread_rank("first", at, Some(1), token.clone(), cfg.clone(), p.clone(), slot());
    std::thread::sleep(std::time::Duration::from_millis(300));
    let second = thread_rank("second", at, Some(1), token, cfg.clone(), p.clone(), slot());
    let opts = PipelineOptions { ranks: 2, block_size: 4, num_blocks: 32, weights: LinearFormat::F32 };
    let unreachable = |_: &Model, r: std::ops::Range<usize>| -> Result<Vec<f32>> { anyhow::bail!("{r:?} is held") };
    let e = PipelineBackend::launch(Model::new(cfg).unwrap(), &p, 0, &unreachable, opts, source).err().expect("two claims of rank 1");
    let e = format!("{e:#}");
    assert!(e.contains("serve-rank second at 127.0.0.1") && e.contains("asks for rank 1, which serve-rank first at 127.0.0.1"), "{e}");
    for h in [first, second] {
        let why = format!("{:#}", h.join().unwrap().unwrap_err());
        assert!(why.contains("asks for rank 1"), "{why}");
    }
}

/// A rank whose blocks hold other weights than the server's model (the same shapes) is refused
/// by name at start.
#[test]
fn a_rank_with_other_weights_is_refused_at_start() {
    let cfg = dense(Arch::Gpt);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 7);
    let mut other = p.clone();
    let last = other.len() - 1;
    other[last] += 1e-3;
    let opts = PipelineOptions { ranks: 2, block_size: 4, num_blocks: 32, weights: LinearFormat::F32 };
    let loads = |r: usize| (cfg.clone(), if r == 1 { other.clone() } else { p.clone() });
    let e = pipeline_with(&cfg, &p, 2, opts, &loads).err().expect("a rank with other weights");
    let e = format!("{e:#}");
    assert!(e.contains("rank 1 (blocks 1..3") && e.contains("loaded other weights for its blocks than this server's model"), "{e}");
}

/// Six sequences decoding at position 60,000 with one-position blocks: 360,006 table entries in
/// a step, more than a 1 MiB frame holds (the old step frame carried every table whole and the
/// backend was lost). They cross as table changes in bounded frames, then one entry a sequence,
/// and the logits are the one-process backend's bits.
#[test]
fn long_contexts_of_many_sequences_cross_in_bounded_frames_with_the_one_process_bits() {
    let cfg = ModelConfig { max_seq_len: 70_000, ..dense(Arch::Llama) };
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 9);
    let opts = PipelineOptions { ranks: 2, block_size: 1, num_blocks: 16, weights: LinearFormat::F32 };
    let (mut two, _) = pipeline_with(&cfg, &p, 2, opts, &|_| (cfg.clone(), p.clone())).unwrap();
    let mut one = CpuBackend::new(
        Model::new(cfg.clone()).unwrap(),
        p.clone(),
        CpuOptions { block_size: 1, num_blocks: 16, weights: LinearFormat::F32 },
    )
    .unwrap();
    let pos = 60_000;
    let mut tables: Vec<Vec<u32>> = (0..6u32).map(|i| [vec![0; pos], vec![1 + i]].concat()).collect();
    let whole_tables_bytes: usize = tables.iter().map(|t| 4 * t.len()).sum();
    assert!(whole_tables_bytes > tessera_fleet::wire::FRAME_BYTES_MAX, "the step's tables fit one frame: {whole_tables_bytes} bytes");
    for k in 0..2 {
        let tokens: Vec<[u32; 1]> = (0..6u32).map(|i| [(i * 5 + k) % 37]).collect();
        let batch: Vec<SeqStep> = tables.iter().zip(&tokens).map(|(t, tok)| step(tok, pos + k as usize, t, true)).collect();
        assert_eq!(bits(&[two.step(&batch).unwrap()]), bits(&[one.step(&batch).unwrap()]), "step {k}");
        for (i, t) in tables.iter_mut().enumerate() {
            t.push(7 + i as u32);
        }
    }
}

/// A rank that never comes: the start fails after the join timeout naming who joined, and the
/// rank that did hears why.
#[test]
fn a_missing_rank_fails_the_start_after_the_join_timeout_naming_who_joined() {
    let cfg = dense(Arch::Gpt);
    let p = params(Model::new(cfg.clone()).unwrap().num_params(), 5);
    let (at, source, token) = join_door_for(1_500);
    let only = thread_rank("only", at, None, token, cfg.clone(), p.clone(), slot());
    let opts = PipelineOptions { ranks: 2, block_size: 4, num_blocks: 32, weights: LinearFormat::F32 };
    let unreachable = |_: &Model, r: std::ops::Range<usize>| -> Result<Vec<f32>> { anyhow::bail!("{r:?} is held") };
    let e = PipelineBackend::launch(Model::new(cfg).unwrap(), &p, 0, &unreachable, opts, source).err().expect("one rank of two");
    let e = format!("{e:#}");
    assert!(e.contains(&format!("only 1 of 2 ranks joined {at} within 1500 ms (joined: serve-rank only at 127.0.0.1 (pid ")), "{e}");
    let why = format!("{:#}", only.join().unwrap().unwrap_err());
    assert!(why.contains("only 1 of 2 ranks joined"), "{why}");
}
