//! Property tests of the scheduler over random workloads (arrivals, prompt and output lengths,
//! shared prefixes, cancellations) against a simulated cache that records which token each
//! position of each block holds: every step, every sequence must read its own tokens back
//! through its block table (so a shared block is never overwritten and a preempted sequence is
//! computed again), a written block must not be shared, the blocks held never exceed the pool,
//! and every request finishes within a bound (nothing starves).

use tessera_kernels::tensor::Rng;

use super::blocks::BlockPool;
use super::sched::{AdmitError, SchedConfig, Scheduler, SeqId};

struct Sim {
    sched: Scheduler,
    /// The token at each position of each block.
    cache: Vec<Vec<Option<u32>>>,
    bs: usize,
}

impl Sim {
    fn new(num_blocks: usize, bs: usize, cfg: SchedConfig) -> Sim {
        Sim { sched: Scheduler::new(cfg, BlockPool::new(num_blocks, bs)), cache: vec![vec![None; bs]; num_blocks], bs }
    }

    /// One step; the sequences that got a token, with their lengths after it, and the plan.
    fn step(&mut self, rng: &mut Rng) -> (Vec<(SeqId, usize)>, super::sched::Plan) {
        let plan = self.sched.schedule();
        let total: usize = plan.work.iter().map(|w| w.len).sum();
        assert!(total <= self.sched.config().max_batch_tokens, "budget exceeded: {total}");
        assert!(plan.work.len() <= self.sched.config().max_seqs);
        for w in &plan.work {
            let tokens = self.sched.tokens(w.id).to_vec();
            let table = self.sched.block_table(w.id);
            assert!(w.len > 0 && w.start + w.len <= tokens.len());
            assert_eq!(w.want_logits, w.start + w.len == tokens.len());
            assert!(table.len() * self.bs >= w.start + w.len, "table too short");
            for (p, &want) in tokens.iter().enumerate().take(w.start) {
                let got = self.cache[table[p / self.bs] as usize][p % self.bs];
                assert_eq!(got, Some(want), "seq {} position {p} reads another token", w.id);
            }
            for (p, &t) in tokens.iter().enumerate().skip(w.start).take(w.len) {
                let b = table[p / self.bs];
                assert_eq!(self.sched.pool().refs(b), 1, "seq {} writes shared block {b}", w.id);
                self.cache[b as usize][p % self.bs] = Some(t);
            }
        }
        let got = plan.work.iter().filter(|w| w.want_logits).map(|w| (w.id, self.sched.tokens(w.id).len() + 1)).collect();
        self.sched.complete(&plan, |_| Some((rng.next_u64() % 7) as u32));
        self.sched.check();
        (got, plan)
    }
}

/// A prompt of `len` tokens: one of a few shared prefixes, then random tokens.
fn prompt(rng: &mut Rng, len: usize) -> Vec<u32> {
    let base = (rng.next_u64() % 3) as u32;
    (0..len).map(|i| if i < len * 3 / 4 { base * 100 + (i as u32 % 50) } else { (rng.next_u64() % 7) as u32 }).collect()
}

/// Runs a random workload to its end, checking the invariants every step.
fn workload(seed: u64) {
    let mut rng = Rng::new(seed);
    let bs = 1 + (rng.next_u64() % 8) as usize;
    let num_blocks = 4 + (rng.next_u64() % 40) as usize;
    let cfg =
        SchedConfig { max_batch_tokens: 1 + (rng.next_u64() % 64) as usize, max_seqs: 1 + (rng.next_u64() % 8) as usize, max_seq_len: 64 };
    let mut sim = Sim::new(num_blocks, bs, cfg);
    let capacity = cfg.max_seq_len.min(num_blocks * bs);
    let n = 40;
    let mut want = std::collections::HashMap::new();
    let mut arrived = 0;
    let mut done = 0;
    let mut step = 0;
    let mut first_run = Vec::new();
    while done < n {
        // Poisson-like arrivals: up to two a step.
        for _ in 0..(rng.next_u64() % 3) {
            if arrived < n {
                let plen = 1 + (rng.next_u64() % 40) as usize;
                let max_tokens = 1 + (rng.next_u64() % 20) as usize;
                let id = arrived as SeqId;
                arrived += 1;
                match sim.sched.add(id, prompt(&mut rng, plen), max_tokens) {
                    Ok(()) => {
                        want.insert(id, plen + max_tokens);
                    }
                    Err(AdmitError::TooLong { .. }) => {
                        assert!(plen + max_tokens > capacity, "refused a request that fits");
                        done += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        let (got, plan) = sim.step(&mut rng);
        for w in &plan.work {
            if !first_run.contains(&w.id) {
                first_run.push(w.id);
            }
        }
        for (id, len) in got {
            // Cancel a few; finish the rest at their length.
            if len >= want[&id] || rng.next_u64() % 50 == 0 {
                assert!(sim.sched.remove(id));
                want.remove(&id);
                done += 1;
            }
        }
        step += 1;
        assert!(step < 20_000, "seed {seed}: requests starve: {} running, {} waiting", sim.sched.num_running(), sim.sched.num_waiting());
    }
    assert!(sim.sched.is_idle());
    assert_eq!(sim.sched.pool().num_free(), num_blocks, "seed {seed}: blocks leaked");
    // The queue is served in arrival order.
    let mut sorted = first_run.clone();
    sorted.sort_unstable();
    assert_eq!(first_run, sorted, "seed {seed}: first steps out of arrival order");
}

#[test]
fn random_workloads_keep_every_invariant_and_finish() {
    for seed in 0..300 {
        workload(seed);
    }
}

#[test]
fn a_shared_prefix_is_computed_once_and_its_blocks_are_shared() {
    let cfg = SchedConfig { max_batch_tokens: 64, max_seqs: 4, max_seq_len: 64 };
    let mut sim = Sim::new(16, 4, cfg);
    let mut rng = Rng::new(1);
    let p: Vec<u32> = (0..10).collect();
    sim.sched.add(1, p.clone(), 4).unwrap();
    let _ = sim.step(&mut rng);
    sim.sched.add(2, p.clone(), 4).unwrap();
    let plan = sim.sched.schedule();
    // Two full blocks (8 positions) are cached; seq 2 computes only positions 8 and 9.
    let w2 = plan.work.iter().find(|w| w.id == 2).unwrap();
    assert_eq!((w2.start, w2.len, plan.cached_tokens), (8, 2, 8));
    assert_eq!(sim.sched.block_table(1)[..2], sim.sched.block_table(2)[..2]);
    assert_ne!(sim.sched.block_table(1)[2], sim.sched.block_table(2)[2]);
}

#[test]
fn memory_pressure_preempts_the_newest_and_it_resumes_with_its_tokens() {
    // 4 blocks of 2: two sequences of 3 prompt + 4 output tokens cannot both fit.
    let cfg = SchedConfig { max_batch_tokens: 16, max_seqs: 4, max_seq_len: 8 };
    let mut sim = Sim::new(4, 2, cfg);
    let mut rng = Rng::new(3);
    sim.sched.add(1, vec![1, 2, 3], 4).unwrap();
    sim.sched.add(2, vec![4, 5, 6], 4).unwrap();
    let mut preempted = Vec::new();
    for _ in 0..30 {
        preempted.extend(sim.step(&mut rng).1.preempted);
        for id in [1, 2] {
            if sim.sched.is_running(id) && sim.sched.tokens(id).len() == 7 {
                sim.sched.remove(id);
            }
        }
    }
    assert!(!preempted.is_empty() && preempted.iter().all(|&id| id == 2), "preempted: {preempted:?}");
    assert!(sim.sched.is_idle(), "both finish");
}

#[test]
fn requests_that_can_never_run_are_refused() {
    let cfg = SchedConfig { max_batch_tokens: 8, max_seqs: 2, max_seq_len: 100 };
    let mut s = Scheduler::new(cfg, BlockPool::new(4, 4));
    assert_eq!(s.add(1, vec![], 1), Err(AdmitError::EmptyPrompt));
    assert_eq!(s.add(1, vec![1], 0), Err(AdmitError::NoTokens));
    // 16 positions in the pool, though the model takes 100.
    assert_eq!(s.add(1, vec![1; 10], 7), Err(AdmitError::TooLong { prompt: 10, max_tokens: 7, max_seq_len: 16 }));
    s.add(1, vec![1; 10], 6).unwrap();
    assert_eq!(s.add(1, vec![1], 1), Err(AdmitError::DuplicateId(1)));
}
