//! The replica feed of elastic runs: each rank sends its ring successors its step record and
//! final gradient at the end of prepare, and turns its predecessors' into the updates of the
//! replicas it holds at commit ([`super::super::replica`]).

use tessera_actors::compute::ComputeError;
use tessera_transport::collective::CollectiveError;

use super::super::lane::Ticket;
use super::super::replica::{self, FeedConfig, StepRecord, Update};
use super::{RankState, StepDone, ZeroWorker};

/// What each ring predecessor sent this rank (nearest first): its encoded step record and its
/// packed gradient (empty for a skipped step).
pub(super) type Received = Vec<(Vec<f32>, Vec<f32>)>;

/// The replica update exchange in flight.
type Exchange = Ticket<Result<Received, ComputeError>>;

/// A rank feeding its ring successors' replicas of its shard ([`super::super::replica`]).
pub(super) struct Feed {
    pub(super) cfg: FeedConfig,
    /// What the last commit produced for the replicas this rank holds, or why it could not.
    pub(super) updates: Option<Result<Vec<Update>, String>>,
}

impl ZeroWorker {
    /// Keeps ring successors' replicas of this rank's shard in step ([`super::super::replica`]): each
    /// prepared step sends the step record and the final gradient, and each commit turns the
    /// predecessors' into updates ([`ZeroWorker::take_replica_updates`]). Every rank of the
    /// group must do the same.
    pub fn with_replica_feed(mut self, cfg: FeedConfig) -> Self {
        self.feed = (cfg.successors > 0 && self.plan.stage > 0 && self.plan.world > 1).then_some(Feed { cfg, updates: None });
        self
    }

    /// The updates of the replicas this rank holds from the last commit (in predecessor order,
    /// nearest first), or why the exchange failed; `None` without a feed or before a commit.
    pub fn take_replica_updates(&mut self) -> Option<Result<Vec<Update>, String>> {
        self.feed.as_mut().and_then(|f| f.updates.take())
    }

    /// End of prepare: queues the messages that send this rank's successors its step record and
    /// its final gradient (exactly what the optimizer will read; nothing for a step skipped on
    /// overflow), then receive its predecessors'. Everything in the record is known now: the
    /// step is skipped exactly when the gradient overflowed, the learning rate follows the
    /// applied steps, and the digest (when due) is of the state the step starts from; only
    /// LAMB's reduced norms come later.
    ///
    /// Point-to-point messages, not an all-to-all: a send is delivered into the successor's
    /// mailbox whether or not it is receiving yet (both transports file point-to-point messages
    /// as they arrive), so no rank waits for the whole group to finish its prepare before its
    /// gradient travels, and every send precedes every receive, so a ring of them cannot
    /// deadlock. `fed` is the gradient itself when the store holds it unchanged (f32 at stage
    /// 2/3): sent from where it lies, without packing a copy.
    pub(super) fn send_replica_update(
        &mut self,
        cfg: FeedConfig,
        step: u64,
        st: &RankState,
        overflow: bool,
        fed: Option<Vec<f32>>,
    ) -> Exchange {
        let range = self.plan.optim_range(self.rank);
        let local = if self.plan.stage <= 1 { range } else { 0..range.len() };
        let record = StepRecord {
            step,
            applied: !overflow,
            lr: self.lr_at(st.applied),
            optimizer_steps: st.optim.step_count() + u64::from(!overflow),
            digest: cfg.digest_due(step).then(|| replica::shard_digest(&st.master, &st.optim.state_buffers())),
        };
        let rec = record.encode();
        let grad = match (overflow, fed) {
            (true, _) => Vec::new(),
            (false, Some(g)) if g.len() == local.len() => g,
            (false, _) => {
                let mut out = Vec::with_capacity(replica::packed_len(self.plan.precision.dtype(), local.len()));
                replica::pack_gradient(&st.grads, local, &mut out);
                out
            }
        };
        let (succ, pred) = (cfg.successors_of(self.rank, self.plan.world), cfg.predecessors_of(self.rank, self.plan.world));
        let tag = replica::feed_tag(step);
        self.lane.submit("the replica update exchange", move |c| {
            let fail = |what: &str, peer: usize, e: CollectiveError| {
                ComputeError::from(e).context(format!("the replica update exchange: {what} rank {peer}"))
            };
            for &to in &succ {
                c.send(to, tag, &rec).map_err(|e| fail("sending the step record to", to, e))?;
                c.send(to, tag, &grad).map_err(|e| fail("sending the gradient to", to, e))?;
            }
            drop(grad);
            pred.iter()
                .map(|&from| {
                    let r = c.recv(from, tag).map_err(|e| fail("receiving the step record of", from, e))?;
                    let g = c.recv(from, tag).map_err(|e| fail("receiving the gradient of", from, e))?;
                    Ok((r, g))
                })
                .collect()
        })
    }

    /// End of commit: turns what the predecessors sent at the end of prepare into their
    /// replicas' updates, after checking the records against what this commit did (every
    /// rank takes the same decision). LAMB's replicas replay this rank's own norm reductions:
    /// the all-reduce gave every rank the same bits (each slot has one non-zero contributor, so
    /// its sum is exact in any order), so no further message is needed, and an owner lost
    /// after the reduction still has its replica stepped.
    pub(super) fn finish_replica_updates(&mut self, step: u64, got: Received, done: StepDone) -> Result<Vec<Update>, String> {
        let cfg = self.feed.as_ref().map(|f| f.cfg).ok_or("no replica feed")?;
        let (rank, world) = (self.rank, self.plan.world);
        let preds = cfg.predecessors_of(rank, world);
        if got.len() != preds.len() {
            return Err(format!("the replica update exchange returned {} updates for {} predecessors", got.len(), preds.len()));
        }
        let dtype = self.plan.precision.dtype();
        let mut updates = Vec::new();
        for (owner, (rec, words)) in preds.into_iter().zip(got) {
            let record = StepRecord::decode(&rec).map_err(|e| format!("rank {owner}: {e}"))?;
            if record.step != step || record.applied != done.applied || record.lr.to_bits() != done.lr.to_bits() {
                return Err(format!(
                    "rank {owner}'s record (step {}, applied {}, lr {}) disagrees with this rank's commit (step {step}, applied {}, lr {})",
                    record.step, record.applied, record.lr, done.applied, done.lr
                ));
            }
            let grad = match record.applied {
                true => {
                    replica::unpack_gradient(dtype, words, self.plan.optim_range(owner).len()).map_err(|e| format!("rank {owner}: {e}"))?
                }
                false => Vec::new(),
            };
            updates.push(Update { owner, grad, record, reductions: done.reductions.clone() });
        }
        Ok(updates)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{plan, setup, LAMB, ONE_CYCLE};
    use super::super::{lock, Plan};
    use super::*;
    use crate::data::Sampler;
    use std::sync::{Arc, Mutex};
    use tessera_actors::compute::{StepOrder, WorkerCompute};
    use tessera_transport::local::LocalGroup;

    /// What [`replicated_steps`] leaves: each rank's shard digest, the replicas each rank holds
    /// and (applied, skipped) steps.
    struct Replicated {
        owners: Vec<[u8; 32]>,
        held: Vec<Vec<replica::Replica>>,
        applied: u64,
        skipped: u64,
    }

    /// What the replica tests start from: `world` ranks' plan, sampler and states, and each
    /// rank's replicas of its `k` ring predecessors, copied from the initial state.
    struct ReplicaRig {
        plan: Arc<Plan>,
        sampler: Arc<Sampler>,
        states: Vec<Arc<Mutex<RankState>>>,
        feed: FeedConfig,
        held: Vec<Vec<replica::Replica>>,
    }

    fn replica_rig(world: usize, stage: u8, sets: &[&str], k: usize) -> ReplicaRig {
        let (cfg, data) = setup(world, stage, sets);
        let plan = Arc::new(Plan::new(&cfg, &data).expect("test plan"));
        let sampler = Arc::new(Sampler::new(data.train, plan.seq_len, 7).expect("sampler"));
        let init = plan.model.init_params(7);
        let scaler = || crate::bridge::loss_scaler(&cfg.precision).expect("scaler");
        let states = (0..world).map(|r| Arc::new(Mutex::new(RankState::new(&plan, r, &init, scaler())))).collect();
        let feed = FeedConfig { successors: k, check_every: 1 };
        let copy = |o: usize| {
            let fresh = RankState::new(&plan, o, &init, None);
            let bufs: Vec<(&str, Vec<f32>)> = fresh.optim.state_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect();
            let range = plan.optim_range(o);
            replica::Replica::from_copy(o, range.clone(), 0, plan.optimizer, init[range].to_vec(), 0, &bufs).expect("copy")
        };
        let held = (0..world).map(|r| feed.predecessors_of(r, world).into_iter().map(copy).collect()).collect();
        ReplicaRig { plan, sampler, states, feed, held }
    }

    /// Applies what rank `r`'s commit of `step` produced to the replicas it holds; returns how
    /// many updates there were.
    fn apply_fed(w: &mut ZeroWorker, held: &mut [replica::Replica], plan: &Plan, r: usize, step: u64) -> usize {
        let updates = w.take_replica_updates().expect("a feed").expect("replica updates");
        let n = updates.len();
        for u in updates {
            let rep = held.iter_mut().find(|h| h.owner == u.owner).expect("a replica of the owner");
            rep.apply(plan, u).unwrap_or_else(|e| panic!("rank {r}, step {step}: {e}"));
        }
        n
    }

    /// Runs `steps` committed steps on `world` threads with every rank feeding `k` ring
    /// successors' replicas (started from a full copy of the initial state, a digest in every
    /// record, so each step's replica is checked against its owner).
    fn replicated_steps(world: usize, stage: u8, sets: &[&str], k: usize, steps: u64) -> Replicated {
        let ReplicaRig { plan, sampler, states, feed, held } = replica_rig(world, stage, sets, k);
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .zip(held)
            .enumerate()
            .map(|(r, (comm, mut held))| {
                let (plan, sampler, state) = (Arc::clone(&plan), Arc::clone(&sampler), Arc::clone(&states[r]));
                std::thread::spawn(move || {
                    let mut w = ZeroWorker::new(r, Arc::clone(&plan), sampler, Box::new(comm), state).with_replica_feed(feed);
                    for step in 0..steps {
                        w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                        w.commit(step).expect("commit");
                        assert_eq!(apply_fed(&mut w, &mut held, &plan, r, step), k.min(world - 1));
                    }
                    held
                })
            })
            .collect();
        let held: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
        let owners = states.iter().map(|s| {
            let st = lock(s);
            replica::shard_digest(&st.master, &st.optim.state_buffers())
        });
        let (applied, skipped) = {
            let st = lock(&states[0]);
            (st.applied, st.skipped)
        };
        Replicated { owners: owners.collect(), held, applied, skipped }
    }

    /// Replicas fed by the owners' gradients and step records stay bit-identical to the
    /// owners' shards: ZeRO-1/2/3, f32/bf16/fp16 (with a skipped overflow step), clipping (the
    /// setup clips at 1.0), LAMB's collective norms, overlap, two successors, an owner whose
    /// optimizer state is on NVMe. A flipped
    /// bit is caught by the digest.
    #[test]
    fn gradient_fed_replicas_stay_bit_identical_to_their_owners() {
        let on = "zero_optimization.overlap_comm=true";
        let dir = tempfile::tempdir().expect("tempdir");
        let nvme = format!("zero_optimization.offload_optimizer.nvme_path={}", dir.path().display());
        for (world, stage, sets, k) in [
            (4, 1, vec![], 1),
            (4, 3, vec!["bf16.enabled=true"], 2),
            (2, 3, vec!["bf16.enabled=true", on, "zero_optimization.reduce_bucket_size=70000"], 1),
            (2, 3, vec!["fp16.enabled=true", "fp16.initial_scale_power=18", "fp16.hysteresis=1"], 1),
            (2, 2, vec![LAMB], 1),
            (4, 1, vec![LAMB, "bf16.enabled=true"], 2),
            // OneCycle's momentum cycle: a replica steps with the betas of its own step count.
            (2, 3, vec![ONE_CYCLE], 1),
            (4, 2, vec![ONE_CYCLE, LAMB], 1),
            // The owner steps its NVMe-tier state sub-group by sub-group; the replica in memory.
            (
                2,
                3,
                vec![
                    "zero_optimization.offload_optimizer.device=nvme",
                    &nvme,
                    "aio.block_size=4096",
                    "zero_optimization.sub_group_size=100000",
                ],
                1,
            ),
        ] {
            let fp16 = sets.iter().any(|s| s.starts_with("fp16"));
            let got = replicated_steps(world, stage, &sets, k, if fp16 { 5 } else { 3 });
            let what = format!("world {world} stage {stage} {sets:?} with {k} successor(s)");
            for (r, held) in got.held.iter().enumerate() {
                assert_eq!(held.len(), k.min(world - 1), "{what}");
                for rep in held {
                    assert_eq!(rep.digest(), got.owners[rep.owner], "{what}: rank {r}'s replica of rank {}", rep.owner);
                }
            }
            if fp16 {
                assert!(got.skipped > 0 && got.applied > 0, "{what}: {} skipped, {} applied", got.skipped, got.applied);
            }
        }
        // The check can fail: a replica with one flipped bit no longer has its owner's digest.
        let got = replicated_steps(2, 3, &[], 1, 2);
        let rep = got.held[1][0].clone();
        let check = |rep: &mut replica::Replica| {
            let record = StepRecord { step: 2, applied: false, lr: 0.0, optimizer_steps: 2, digest: Some(got.owners[rep.owner]) };
            let plan = plan(2, 3, &[]);
            rep.apply(&plan, Update { owner: rep.owner, grad: vec![], record, reductions: vec![] })
        };
        check(&mut rep.clone()).expect("the replica has its owner's digest");
        let mut bad = rep;
        bad.master[5] = f32::from_bits(bad.master[5].to_bits() ^ 1);
        let e = check(&mut bad).expect_err("a flipped bit");
        assert!(e.contains("blake3"), "{e}");
    }

    /// A loss inside the commit window, in process: every rank prepares step `at`, then rank
    /// `lost` leaves (its group handle is dropped, so its peers' collectives fail with
    /// `PeerGone`) and the others commit. Their commits fail (the parameters cannot be shared)
    /// after the optimizer step: their error is torn with `stepped = Some(step)` and the replica
    /// updates, received before `Prepared`, are there. With LAMB (`sets` holds [`LAMB`]) they
    /// fail inside the optimizer step, in its norm all-reduce, before anything changed: the
    /// error is not torn and no replica update is made. Returns each survivor's shard digest
    /// and the replicas each holds after applying them (the lost rank's entry is empty).
    fn loss_after_prepared(
        world: usize,
        stage: u8,
        sets: &[&str],
        at: u64,
        lost: usize,
    ) -> (Vec<Option<[u8; 32]>>, Vec<Vec<replica::Replica>>) {
        let lamb = sets.contains(&LAMB);
        let ReplicaRig { plan, sampler, states, feed, held } = replica_rig(world, stage, sets, 1);
        let prepared = Arc::new(std::sync::Barrier::new(world));
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .zip(held)
            .enumerate()
            .map(|(r, (comm, mut held))| {
                let (plan, sampler, state, prepared) =
                    (Arc::clone(&plan), Arc::clone(&sampler), Arc::clone(&states[r]), Arc::clone(&prepared));
                std::thread::spawn(move || {
                    let mut w = ZeroWorker::new(r, Arc::clone(&plan), sampler, Box::new(comm), state).with_replica_feed(feed);
                    for step in 0..=at {
                        w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                        if step == at {
                            prepared.wait();
                            if r == lost {
                                return Vec::new();
                            }
                            let e = w.commit(step).expect_err("a commit with a lost rank");
                            assert!(e.explained_by_loss(), "rank {r}: a lost peer's failure is not a loss: {e:?}");
                            if lamb {
                                // LAMB's norm all-reduce inside the optimizer step fails first.
                                assert!(!matches!(e, ComputeError::Torn { .. }), "rank {r}: the shard should be untouched ({e:?})");
                                assert_eq!(e.state_after_commit(step, Some(step)), Some(step), "rank {r}");
                                assert!(w.take_replica_updates().is_none(), "rank {r}: replica updates without a step");
                                return held;
                            }
                            let stepped = matches!(e, ComputeError::Torn { stepped: Some(s), .. } if s == step);
                            assert!(stepped, "rank {r}: the shard took the step before the failure ({e:?})");
                            assert_eq!(e.state_after_commit(step, Some(step)), Some(step + 1), "rank {r}");
                        } else {
                            w.commit(step).expect("commit");
                        }
                        apply_fed(&mut w, &mut held, &plan, r, step);
                    }
                    held
                })
            })
            .collect();
        let held: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
        let owners = (0..world)
            .map(|r| {
                (r != lost).then(|| {
                    let st = lock(&states[r]);
                    replica::shard_digest(&st.master, &st.optim.state_buffers())
                })
            })
            .collect();
        (owners, held)
    }

    /// Loses each of a few ranks after every rank prepared step 2 (ZeRO-1, 2 and 3, whose
    /// commits share parameters differently; the lost rank in the middle, at the end and at the
    /// start of the ring) and checks that every survivor's shard and the lost owner's replica on
    /// its successor equal a fault-free run's after `at` steps.
    fn check_state_after_a_loss_in_commit(sets: &[&str], at: u64) {
        for (world, stage, lost) in [(4, 1, 1), (4, 3, 3), (2, 2, 0)] {
            let what = format!("{sets:?}, world {world}, stage {stage}, rank {lost} lost after preparing step 2");
            let reference = replicated_steps(world, stage, sets, 1, at);
            let (owners, held) = loss_after_prepared(world, stage, sets, 2, lost);
            for (r, d) in owners.iter().enumerate() {
                if let Some(d) = d {
                    assert_eq!(*d, reference.owners[r], "{what}: rank {r}'s own shard");
                }
            }
            let holder = (lost + 1) % world;
            let rep = held[holder].iter().find(|h| h.owner == lost).unwrap_or_else(|| panic!("{what}: no replica of rank {lost}"));
            assert_eq!(rep.at, at, "{what}");
            assert_eq!(rep.digest(), reference.owners[lost], "{what}: rank {holder}'s replica of the lost rank {lost}");
        }
    }

    /// The state a recovery needs after a loss in the commit window exists in memory at t + 1:
    /// every survivor took step t, and so did the lost owner's replica.
    #[test]
    fn a_loss_after_prepared_leaves_every_shard_at_the_next_step() {
        check_state_after_a_loss_in_commit(&[], 3);
    }

    /// A LAMB commit that loses a member fails in the norm all-reduce with the state at t
    /// whole in memory: every survivor's shard and the lost owner's replica equal a fault-free
    /// run's after t steps (so the recovery restores from memory and reruns step t instead of
    /// loading a checkpoint).
    #[test]
    fn a_lamb_loss_after_prepared_leaves_every_shard_at_the_step_before() {
        check_state_after_a_loss_in_commit(&[LAMB], 2);
    }
}
