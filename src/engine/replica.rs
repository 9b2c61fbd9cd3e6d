//! In-memory replicas kept in step by the owner's reduced gradient (elastic runs).
//!
//! A rank's optimizer shard (fp32 masters and moments of `Plan::optim_range(r)`) is held, besides
//! by its owner, by its `tessera.elastic.replicas` ring successors. A new epoch starts each
//! replica with one full copy of the shard; after that the owner sends, for every committed
//! step, only what a successor needs to apply the *identical* optimizer step to its replica:
//!
//! - at the end of `prepare`, as soon as it is final, the reduced gradient of the owner's range
//!   exactly as the optimizer will read it (unscaled, clipped, rounded to the storage type; 16-bit
//!   storage travels as its 16-bit patterns, two to a word), or nothing for a step skipped on
//!   overflow — [`pack_gradient`] — behind a [`StepRecord`]: whether the step is applied or
//!   skipped (the loss scaler skips exactly the steps whose gradient overflowed), the learning
//!   rate (a function of the applied steps), the optimizer's step count after it, and every
//!   `replica_check_interval` steps the blake3 of the owner's shard the step starts from;
//! - LAMB only: the results of the norm all-reduce inside the optimizer step (the per-tensor
//!   trust ratios need the global weight and update norms). These are not sent: the all-reduce
//!   gives every rank the same bits, so the successor replays its own reduced values
//!   ([`Update::reductions`], which the holder fills in from its own commit).
//!
//! The update travels as point-to-point messages (record, then gradient; [`feed_tag`]) queued in
//! the rank's ordered collective lane, all sends before all receives: each lands in the
//! successor's mailbox as it arrives, so a rank's gradient travels as soon as its own prepare
//! ends (no wait for the slowest rank, as an all-to-all would) and a ring of them cannot
//! deadlock; the rank answers `Prepared` only once it has received its predecessors' (so a
//! loss while the step commits cannot leave a replica behind its owner).
//! The commit checks each record against its own
//! decision (every rank takes the same). The successor applies the step with the same optimizer
//! code ([`Replica::apply`], on a background thread); where the record carries a digest the
//! replica's blake3 must first be the owner's, and the step count must agree after it. A replica
//! that disagrees is dropped and reported, and the driver sends a fresh full copy
//! (`docs/ELASTIC.md`).
//!
//! Abandoned steps need nothing: the gradient exchange of a prepared step completes on every
//! rank (all of them issued it) and is only turned into replica updates by the commit.

use std::ops::Range;

use tessera_kernels::dtype::DType;
use tessera_kernels::optim::{NormAllReduce, OptimizerKind, OptimizerShard, StepContext};

use super::plan::Plan;
use super::store::Store;

/// First word of an encoded [`StepRecord`] ("RPL2"; "RPL1" records also carried the owner's
/// norm reductions, always empty once holders replayed their own).
const RECORD_MAGIC: u32 = 0x5250_4C32;
/// Words of an encoded record: magic, step (2), flags, lr, optimizer steps (2), digest (8).
const RECORD_WORDS: usize = 15;
/// Tag space of the point-to-point replica update messages (the step is added; the full
/// copies use another, `elastic_worker`'s `REPLICA_TAG`).
const FEED_TAG: u64 = 0x5246_0000_0000_0000;

/// The tag of step `step`'s replica update messages (a record, then the packed gradient).
pub fn feed_tag(step: u64) -> u64 {
    FEED_TAG + (step & 0x0000_FFFF_FFFF_FFFF)
}

/// How a rank feeds its replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedConfig {
    /// Ring successors that hold this rank's shard (already capped at `world - 1`; 0 = off).
    pub successors: usize,
    /// Every this many committed steps the record carries the owner's shard digest (0 = never).
    pub check_every: u64,
}

impl FeedConfig {
    /// The ring successors of `rank` in a world of `world` ranks, nearest first.
    pub fn successors_of(&self, rank: usize, world: usize) -> Vec<usize> {
        (1..=self.successors.min(world.saturating_sub(1))).map(|j| (rank + j) % world).collect()
    }

    /// The ring predecessors of `rank` (the owners whose replicas `rank` holds), nearest first.
    pub fn predecessors_of(&self, rank: usize, world: usize) -> Vec<usize> {
        (1..=self.successors.min(world.saturating_sub(1))).map(|j| (rank + world - j) % world).collect()
    }

    /// Whether the record of step `step` carries the digest of the state it starts from.
    pub fn digest_due(&self, step: u64) -> bool {
        self.check_every > 0 && step % self.check_every == 0
    }
}

/// What an owner's optimizer did in one committed step, besides the gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// The step committed (the replica goes from `step` to `step + 1` committed steps).
    pub step: u64,
    /// False for a step skipped on overflow (no optimizer step).
    pub applied: bool,
    /// The learning rate the optimizer step used.
    pub lr: f32,
    /// The optimizer's step count after the step.
    pub optimizer_steps: u64,
    /// blake3 of the owner's shard at `step` committed steps, before the step
    /// ([`shard_digest`]), when due.
    pub digest: Option<[u8; 32]>,
}

impl StepRecord {
    /// The record as f32 words (bit patterns; the transport moves bytes, never arithmetic).
    pub fn encode(&self) -> Vec<f32> {
        let mut w: Vec<u32> = Vec::with_capacity(RECORD_WORDS);
        w.push(RECORD_MAGIC);
        w.extend([self.step as u32, (self.step >> 32) as u32]);
        w.push(u32::from(self.applied) | (u32::from(self.digest.is_some()) << 1));
        w.push(self.lr.to_bits());
        w.extend([self.optimizer_steps as u32, (self.optimizer_steps >> 32) as u32]);
        let digest = self.digest.unwrap_or([0; 32]);
        w.extend(digest.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        debug_assert_eq!(w.len(), RECORD_WORDS);
        w.into_iter().map(f32::from_bits).collect()
    }

    /// Parses what a peer sent; anything malformed is an error naming the problem.
    pub fn decode(words: &[f32]) -> Result<StepRecord, String> {
        let w: Vec<u32> = words.iter().map(|x| x.to_bits()).collect();
        if w.first() != Some(&RECORD_MAGIC) {
            return Err(format!("a replica step record of {} words without its header", w.len()));
        }
        if w.len() != RECORD_WORDS {
            return Err(format!("a replica step record of {} words, expected {RECORD_WORDS}", w.len()));
        }
        let u64_at = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
        let flags = w[3];
        let mut digest = [0u8; 32];
        for (k, word) in w[7..15].iter().enumerate() {
            digest[4 * k..4 * k + 4].copy_from_slice(&word.to_le_bytes());
        }
        Ok(StepRecord {
            step: u64_at(1),
            applied: flags & 1 != 0,
            lr: f32::from_bits(w[4]),
            optimizer_steps: u64_at(5),
            digest: (flags & 2 != 0).then_some(digest),
        })
    }
}

/// The reduced gradient of `range` (indices into `grads`) as it travels, appended to `out`:
/// f32 values, or for 16-bit storage the 16-bit patterns two to a word (lossless: the store
/// holds them).
pub fn pack_gradient(grads: &Store, range: Range<usize>, out: &mut Vec<f32>) {
    let pairs = |bits: &[u16], out: &mut Vec<f32>| {
        out.extend(bits.chunks(2).map(|p| f32::from_bits(u32::from(p[0]) | (u32::from(p.get(1).copied().unwrap_or(0)) << 16))));
    };
    match grads {
        Store::F32(v) => out.extend_from_slice(&v[range]),
        Store::Bf16(v) => pairs(bytemuck::cast_slice(&v[range]), out),
        Store::F16(v) => pairs(bytemuck::cast_slice(&v[range]), out),
    }
}

/// Words a packed gradient of `len` values of `dtype` takes.
pub fn packed_len(dtype: DType, len: usize) -> usize {
    match dtype {
        DType::F32 => len,
        DType::BF16 | DType::F16 => len.div_ceil(2),
    }
}

/// [`pack_gradient`]'s words back to `len` f32 values of storage type `dtype`.
pub fn unpack_gradient(dtype: DType, words: Vec<f32>, len: usize) -> Result<Vec<f32>, String> {
    let want = packed_len(dtype, len);
    if words.len() != want {
        return Err(format!("a replica gradient of {} words, expected {want} for {len} {} values", words.len(), dtype.name()));
    }
    let half = |i: usize| -> u16 {
        let w = words[i / 2].to_bits();
        if i % 2 == 0 {
            w as u16
        } else {
            (w >> 16) as u16
        }
    };
    Ok(match dtype {
        DType::F32 => words,
        DType::BF16 => (0..len).map(|i| half::bf16::from_bits(half(i)).to_f32()).collect(),
        DType::F16 => (0..len).map(|i| half::f16::from_bits(half(i)).to_f32()).collect(),
    })
}

/// blake3 of a shard: the masters' bytes, then each optimizer buffer's, in order.
pub fn shard_digest(master: &[f32], bufs: &[(&str, &[f32])]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(bytemuck::cast_slice(master));
    for (_, b) in bufs {
        h.update(bytemuck::cast_slice(b));
    }
    *h.finalize().as_bytes()
}

/// One owner's step for a replica: its gradient (already unpacked) and record, and the
/// results of the optimizer's norm all-reduces in call order (LAMB's), which [`Replica::apply`]
/// replays: the holder's own from its commit of the same step, which the all-reduce gave every
/// rank bit for bit — they never travel.
#[derive(Debug, Clone)]
pub struct Update {
    pub owner: usize,
    pub grad: Vec<f32>,
    pub record: StepRecord,
    pub reductions: Vec<Vec<f64>>,
}

/// Replays the holder's own all-reduce results of the step, in order.
struct Replay {
    results: std::vec::IntoIter<Vec<f64>>,
}

impl NormAllReduce for Replay {
    fn all_reduce_sum(&mut self, v: &mut [f64]) -> Result<(), String> {
        match self.results.next() {
            Some(r) if r.len() == v.len() => {
                v.copy_from_slice(&r);
                Ok(())
            }
            Some(r) => Err(format!("this rank's norm reduction has {} values, the replica's step needs {}", r.len(), v.len())),
            None => Err("the replica's step made more norm reductions than this rank's commit of the step".into()),
        }
    }
}

/// A ring predecessor's optimizer shard, as of `at` committed steps.
#[derive(Debug, Clone)]
pub struct Replica {
    pub owner: usize,
    /// The owner's range of the flat buffer (`Plan::optim_range(owner)`).
    pub range: Range<usize>,
    pub at: u64,
    pub master: Vec<f32>,
    pub optim: OptimizerShard,
}

impl Replica {
    /// A replica from a full copy of the owner's shard: masters and the optimizer's buffers by
    /// name, at `optimizer_steps` optimizer steps and `at` committed steps.
    pub fn from_copy(
        owner: usize,
        range: Range<usize>,
        at: u64,
        kind: OptimizerKind,
        master: Vec<f32>,
        optimizer_steps: u64,
        bufs: &[(&str, Vec<f32>)],
    ) -> Result<Replica, String> {
        if master.len() != range.len() {
            return Err(format!(
                "the copy of rank {owner}'s masters has {} values, its range {range:?} holds {}",
                master.len(),
                range.len()
            ));
        }
        let mut optim = OptimizerShard::new(kind, range.len());
        optim.load_state(optimizer_steps, bufs).map_err(|e| format!("the copy of rank {owner}'s optimizer state: {e}"))?;
        Ok(Replica { owner, range, at, master, optim })
    }

    /// blake3 of the replica, comparable with the owner's [`shard_digest`].
    pub fn digest(&self) -> [u8; 32] {
        shard_digest(&self.master, &self.optim.state_buffers())
    }

    /// Applies the owner's step `u` exactly as the owner's optimizer did (same kernels, same
    /// gradient, same scalars, and the reduced norms `u.reductions`, which the holder set
    /// from its own commit: the same bits as the owner's), after checking the digest when the
    /// record carries one, and then the step count. On an error the replica must be discarded.
    pub fn apply(&mut self, plan: &Plan, u: Update) -> Result<(), String> {
        let owner = self.owner;
        if u.owner != owner {
            return Err(format!("an update of rank {} applied to the replica of rank {owner}", u.owner));
        }
        if u.record.step != self.at {
            return Err(format!("rank {owner}'s update is for step {}, its replica holds {} committed steps", u.record.step, self.at));
        }
        if let Some(d) = u.record.digest {
            let mine = self.digest();
            if mine != d {
                return Err(format!(
                    "rank {owner}'s replica at {} committed steps has blake3 {}, the owner's shard {}",
                    self.at,
                    hex(&mine),
                    hex(&d)
                ));
            }
        }
        if u.record.applied {
            if u.grad.len() != self.master.len() {
                return Err(format!("rank {owner}'s gradient has {} values, its range {}", u.grad.len(), self.master.len()));
            }
            let ctx = StepContext { shard_range: self.range.clone(), layout: &plan.flat, decay: &plan.decay };
            let mut replay = Replay { results: u.reductions.into_iter() };
            let step = u.record.step;
            self.optim
                .step(&mut self.master, &u.grad, u.record.lr, &ctx, &mut replay)
                .map_err(|e| format!("rank {owner}'s step {step}: {e}"))?;
            if replay.results.len() > 0 {
                return Err(format!("rank {owner}'s step {step}: this rank's commit made more norm reductions than the replica's step"));
            }
        }
        self.at += 1;
        if self.optim.step_count() != u.record.optimizer_steps {
            return Err(format!(
                "rank {owner}'s replica is at {} optimizer steps after step {}, the owner at {}",
                self.optim.step_count(),
                u.record.step,
                u.record.optimizer_steps
            ));
        }
        Ok(())
    }
}

/// Lowercase hex of a digest.
pub fn hex(d: &[u8; 32]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_reject_malformed_words() {
        let r = StepRecord {
            step: (7 << 32) + 3,
            applied: true,
            lr: f32::from_bits(0x7fc0_1234), // a NaN with a payload keeps its bits
            optimizer_steps: (5 << 32) + 12,
            digest: Some([9; 32]),
        };
        let words = r.encode();
        assert_eq!(words.len(), RECORD_WORDS);
        let back = StepRecord::decode(&words).expect("decodes");
        assert_eq!(
            (back.step, back.applied, back.lr.to_bits(), back.optimizer_steps),
            (r.step, r.applied, r.lr.to_bits(), r.optimizer_steps)
        );
        assert_eq!(back.digest, r.digest);
        let skipped = StepRecord { applied: false, digest: None, lr: 1.5e-3, ..r.clone() };
        assert_eq!(StepRecord::decode(&skipped.encode()).expect("decodes"), skipped);
        assert!(StepRecord::decode(&words[..words.len() - 1]).unwrap_err().contains("14 words, expected 15"));
        assert!(StepRecord::decode(&[]).unwrap_err().contains("header"));
        let mut extra = words.clone();
        extra.push(0.0);
        assert!(StepRecord::decode(&extra).unwrap_err().contains("16 words, expected 15"));
        // The old layout (RPL1, with a count of reductions) is named as foreign, not misread.
        let mut old = words;
        old[0] = f32::from_bits(0x5250_4C31);
        old.push(0.0);
        assert!(StepRecord::decode(&old).unwrap_err().contains("without its header"));
    }

    #[test]
    fn sixteen_bit_gradients_travel_as_their_bits() {
        let x: Vec<f32> = (0..7).map(|i| (i as f32 * 0.77).sin() * 3.0).collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut s = Store::zeros(dtype, 9);
            s.write(1, &x);
            let mut packed = Vec::new();
            pack_gradient(&s, 1..8, &mut packed);
            assert_eq!(packed.len(), if dtype == DType::F32 { 7 } else { 4 });
            let mut want = vec![0.0; 7];
            s.read(1, &mut want);
            let got = unpack_gradient(dtype, packed.clone(), 7).expect("unpacks");
            assert_eq!(bytemuck::cast_slice::<f32, u32>(&got), bytemuck::cast_slice::<f32, u32>(&want), "{dtype:?}");
            assert!(unpack_gradient(dtype, packed, 12).is_err());
        }
    }
}
