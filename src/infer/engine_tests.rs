//! The engine over the reference backend on a small random model: what continuous batching
//! (chunked prefill, preemption, shared prefixes, requests coming and going) produces is what
//! one request alone produces token by token with `Model::next_token_logits`, on the reference
//! backend and on the paged CPU backend.

use tessera_kernels::model::{Arch, Model, ModelConfig, Workspace};

use super::engine::{Engine, Event, Finish, Request};
use super::recompute::RecomputeBackend;
use super::sample::{Sampler, SamplingParams};
use super::sched::SeqId;

fn model() -> (Model, Vec<f32>) {
    let cfg = ModelConfig { vocab_size: 61, max_seq_len: 48, n_kv_head: 2, tied_head: false, ..super::cpu::tests::dense(Arch::Llama) };
    let m = Model::new(cfg).unwrap();
    let p = m.init_params(5);
    (m, p)
}

fn engine(block_size: usize, num_blocks: usize, max_batch_tokens: usize, max_seqs: usize) -> Engine {
    let (m, p) = model();
    Engine::new(Box::new(RecomputeBackend::new(m, p, block_size, num_blocks).unwrap()), max_batch_tokens, max_seqs).unwrap()
}

/// One request alone, token by token over the whole window.
fn reference(req: &Request) -> Vec<u32> {
    let (m, p) = model();
    let mut ws = Workspace::default();
    let mut tokens = req.prompt.clone();
    let mut sampler = Sampler::new(req.sampling);
    let mut out = Vec::new();
    while out.len() < req.max_tokens {
        let mut logits = m.next_token_logits(&p, &tokens, &mut ws);
        let t = sampler.sample(&mut logits, &tokens);
        out.push(t);
        if req.stop_tokens.contains(&t) {
            break;
        }
        tokens.push(t);
    }
    out
}

fn run_all(e: &mut Engine, reqs: &[Request], stagger: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); reqs.len()];
    let mut next = 0;
    let mut steps = 0;
    loop {
        if next < reqs.len() && steps % stagger.max(1) == 0 {
            e.add(next as SeqId, reqs[next].clone()).unwrap();
            next += 1;
        }
        for Event { id, token, finish } in e.step().unwrap() {
            out[id as usize].push(token);
            if let Some(f) = finish {
                assert_eq!(f == Finish::Stop, reqs[id as usize].stop_tokens.contains(&token));
            }
        }
        steps += 1;
        if next == reqs.len() && e.is_idle() {
            return out;
        }
        assert!(steps < 10_000);
    }
}

fn requests() -> Vec<Request> {
    let shared: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 61).collect();
    (0..6)
        .map(|k| {
            let mut prompt = if k % 2 == 0 { shared.clone() } else { vec![] };
            prompt.extend((0..(3 + 4 * k)).map(|i| ((i * 11 + k * 5) % 61) as u32));
            let sampling = SamplingParams {
                temperature: if k < 3 { 0.0 } else { 0.9 },
                top_k: 20,
                top_p: 0.9,
                repetition_penalty: 1.1,
                seed: k as u64,
            };
            Request { prompt, max_tokens: 6 + k, sampling, stop_tokens: if k == 4 { vec![0, 1, 2, 3, 4, 5] } else { vec![] } }
        })
        .collect()
}

#[test]
fn batched_generation_equals_each_request_alone() {
    let reqs = requests();
    let want: Vec<Vec<u32>> = reqs.iter().map(reference).collect();
    // Ample memory and budget; chunked prefill (5 tokens a step); too few blocks (preemption).
    for (bs, blocks, budget, seqs, stagger) in [(4, 64, 256, 8, 1), (4, 64, 5, 8, 2), (2, 24, 16, 6, 1), (3, 14, 7, 3, 3)] {
        let mut e = engine(bs, blocks, budget, seqs);
        assert_eq!(run_all(&mut e, &reqs, stagger), want, "block {bs}, {blocks} blocks, budget {budget}, {seqs} seqs");
        assert_eq!(e.free_blocks(), blocks, "blocks leaked");
        let st = e.stats();
        if blocks == 14 {
            assert!(st.preemptions > 0, "{st:?}");
        }
        if bs == 4 && stagger == 2 {
            assert!(st.prefix_hit_tokens > 0, "{st:?}");
        }
    }
}

#[test]
fn an_aborted_request_frees_its_blocks_and_the_others_go_on() {
    let reqs = requests();
    let mut e = engine(4, 64, 64, 8);
    for (k, r) in reqs.iter().enumerate() {
        e.add(k as SeqId, r.clone()).unwrap();
    }
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.abort(1));
    assert!(!e.abort(1));
    let mut out = vec![Vec::new(); reqs.len()];
    while !e.is_idle() {
        for ev in e.step().unwrap() {
            out[ev.id as usize].push(ev.token);
        }
    }
    assert_eq!(e.free_blocks(), 64);
    assert_eq!(out[0][..], reference(&reqs[0])[2..]);
}

#[test]
fn bad_requests_are_refused_and_the_engine_goes_on() {
    let mut e = engine(4, 8, 64, 8);
    let req = |prompt: Vec<u32>, max_tokens| Request { prompt, max_tokens, sampling: SamplingParams::default(), stop_tokens: vec![] };
    assert!(e.add(1, req(vec![61], 1)).unwrap_err().to_string().contains("vocabulary of 61"));
    assert!(e.add(1, req(vec![1; 40], 9)).unwrap_err().to_string().contains("context of 32"));
    e.add(1, req(vec![1; 4], 2)).unwrap();
    while !e.is_idle() {
        e.step().unwrap();
    }
}

#[test]
fn the_paged_cpu_backend_under_the_scheduler_generates_what_the_reference_does() {
    use super::cpu::{CpuBackend, CpuOptions, LinearFormat};
    // Greedy only: the paged backend's logits equal the reference's within f32 rounding, which
    // can move a sampled draw but not (here) an argmax.
    let reqs: Vec<Request> =
        requests().into_iter().map(|r| Request { sampling: SamplingParams { temperature: 0.0, ..r.sampling }, ..r }).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(reference).collect();
    for (bs, blocks, budget, seqs, stagger) in [(4, 64, 256, 8, 1), (4, 64, 5, 8, 2), (3, 14, 7, 3, 3)] {
        let (m, p) = model();
        let backend = CpuBackend::new(m, p, CpuOptions { block_size: bs, num_blocks: blocks, weights: LinearFormat::F32 }).unwrap();
        let mut e = Engine::new(Box::new(backend), budget, seqs).unwrap();
        assert_eq!(run_all(&mut e, &reqs, stagger), want, "block {bs}, {blocks} blocks, budget {budget}, {seqs} seqs");
        assert_eq!(e.free_blocks(), blocks);
    }
}

/// A backend that counts which of `step` / `step_greedy` the engine calls, and whose greedy
/// choice is the reference's argmax of the same logits.
struct Counting {
    inner: RecomputeBackend,
    calls: std::sync::Arc<std::sync::Mutex<(usize, usize)>>,
}

impl super::backend::Backend for Counting {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_seq_len(&self) -> usize {
        self.inner.max_seq_len()
    }
    fn step(&mut self, batch: &[super::backend::SeqStep<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        self.calls.lock().unwrap().0 += 1;
        self.inner.step(batch)
    }
    fn step_greedy(&mut self, batch: &[super::backend::SeqStep<'_>]) -> anyhow::Result<Vec<u32>> {
        self.calls.lock().unwrap().1 += 1;
        Ok(self.inner.step(batch)?.iter().map(|l| super::sample::argmax(l)).collect())
    }
}

#[test]
fn greedy_batches_ask_the_backend_for_token_ids_and_sampled_ones_for_logits() {
    use super::backend::Backend;
    // Greedy without a repetition penalty: only ids are needed. With a penalty, or sampled, the
    // logits are (a batch with any such sequence asks for logits).
    let plain = SamplingParams { temperature: 0.0, repetition_penalty: 1.0, ..SamplingParams::default() };
    let all = requests();
    let greedy: Vec<Request> = all.iter().map(|r| Request { sampling: plain, ..r.clone() }).collect();
    for (reqs, want_logits) in [(&greedy, false), (&all, true)] {
        let want: Vec<Vec<u32>> = reqs.iter().map(reference).collect();
        let (m, p) = model();
        let calls = std::sync::Arc::new(std::sync::Mutex::new((0, 0)));
        let backend = Counting { inner: RecomputeBackend::new(m, p, 4, 64).unwrap(), calls: calls.clone() };
        assert_eq!(backend.block_size(), 4);
        let mut e = Engine::new(Box::new(backend), 64, 8).unwrap();
        assert_eq!(run_all(&mut e, reqs, 1), want);
        let (logits, ids) = *calls.lock().unwrap();
        if want_logits {
            // Every request here has a repetition penalty or samples.
            assert_eq!((logits > 0, ids), (true, 0), "sampled requests need logits: {logits} step / {ids} step_greedy");
        } else {
            assert_eq!((logits, ids > 0), (0, true), "greedy requests need only ids: {logits} step / {ids} step_greedy");
        }
    }
}
