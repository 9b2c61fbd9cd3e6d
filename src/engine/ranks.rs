//! Where the driver's ranks live and how it reads their state between steps: threads of this
//! process sharing `RankState`s ([`Ranks::InProcess`]) or worker processes, the fleet, reached
//! over their control connections ([`Ranks::Fleet`], see [`tessera_fleet::driver`]; elastic or with
//! recovery off). Also a rank's state from its cut of the start state, which both kinds use, and
//! a worker process's rank state on the wire: received from the start state, exported, and its
//! snapshot.

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::MemoryReport;
use tessera_actors::faults::Faults;

use super::plan::Plan;
use super::zero::RankState;
use crate::bridge;
use crate::config::Config;
use crate::gpu::compute::GpuRanks;
use tessera_fleet::driver::Fleet;
use tessera_fleet::state::{master_window, OptimBuffers, RankCounters, Start, StartCut};
use tessera_fleet::wire::{self, ControlIo, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireError};

/// Rank `r`'s state from full-length masters (only [`tessera_fleet::state::master_window`] is read) and its cut;
/// its swap files (NVMe offload) fail where `faults` says.
pub fn rank_state(cfg: &Config, plan: &Plan, r: usize, master: &[f32], cut: &StartCut, faults: &Faults) -> Result<RankState> {
    let mut scaler = bridge::loss_scaler(&cfg.precision)?;
    if let (Some(sc), Some(v)) = (scaler.as_mut(), &cut.scaler) {
        bridge::scaler_from_json(sc, v)?;
    }
    let mut st = RankState::new(plan, r, master, scaler);
    st.optim.set_faults(faults.clone());
    st.applied = cut.applied;
    st.skipped = cut.skipped;
    if let Some((steps, bufs)) = &cut.optim {
        let mine: Vec<(&str, Vec<f32>)> = bufs.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
        st.optim.load_state(*steps, &mine).context("checkpoint optimizer state")?;
    }
    Ok(st)
}

/// Receives the start state and builds this rank's state from it; also the committed steps
/// the state holds.
pub fn recv_start(
    stream: &mut (impl ControlIo + ?Sized),
    cfg: &Config,
    plan: &Plan,
    rank: usize,
    faults: &Faults,
    wait: &Wait<'_>,
) -> Result<(RankState, u64)> {
    let (master_start, counters, descs, step) = match wire::recv(stream, "Start", wait)? {
        ToWorker::Start { master_start, counters, buffers, step } => (master_start, counters, buffers, step),
        other => bail!("expected the start state, got {other:?}"),
    };
    let window = master_window(plan, rank);
    if master_start != window.start as u64 || descs.first().is_none_or(|d| d.len != window.len() as u64) {
        bail!("start state: masters at {master_start} of {:?} values, this rank needs {window:?}", descs.first().map(|d| d.len));
    }
    let mut bufs = wire::recv_bulk(stream, &descs, window.len(), wait)?;
    // Transient: the full-length buffer `RankState::new` indexes; only the window is read.
    let mut master = vec![0.0f32; plan.total()];
    master[window].copy_from_slice(&bufs.remove(0));
    let optim = counters.optimizer_steps.map(|steps| (steps, descs[1..].iter().map(|d| d.name.clone()).zip(bufs).collect()));
    let cut = StartCut { optim, applied: counters.applied, skipped: counters.skipped, scaler: counters.scaler };
    Ok((rank_state(cfg, plan, rank, &master, &cut, faults)?, step))
}

/// Sends this rank's masters, its optimizer buffers when asked, and counters.
pub fn export(stream: &mut (impl ControlIo + ?Sized), st: &RankState, optim: bool) -> Result<(), WireError> {
    let mut bufs: Vec<(&str, &[f32])> = vec![("master", &st.master)];
    if optim {
        bufs.extend(st.optim.state_buffers());
    }
    let counters = StateCounters {
        optimizer_steps: Some(st.optim.step_count()),
        applied: st.applied,
        skipped: st.skipped,
        scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
    };
    wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
    wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())
}

/// This rank's snapshot for the driver (replica flags unset: the elastic worker sets them).
pub fn snapshot(st: &RankState, rank: usize) -> Snapshot {
    Snapshot {
        memory: wire::WireMemory::from_report(&st.memory(rank)),
        applied: st.applied,
        skipped: st.skipped,
        scale_bits: st.scaler.as_ref().map(|s| s.scale().to_bits()),
        bytes_sent_total: st.bytes_sent_total,
        replica_stale: false,
        replica_behind: false,
        peak_rss_bytes: super::summary::peak_rss_bytes(),
    }
}

/// One `RankState` per rank, cut from the full-length start buffers.
pub fn rank_states(cfg: &Config, plan: &Plan, start: &Start, faults: &Faults) -> Result<Vec<Arc<Mutex<RankState>>>> {
    (0..plan.world).map(|r| Ok(Arc::new(Mutex::new(rank_state(cfg, plan, r, &start.master, &start.cut(plan, r), faults)?)))).collect()
}

/// The ranks of a run, as the driver sees them between steps.
pub enum Ranks {
    InProcess(Vec<Arc<Mutex<RankState>>>),
    /// Worker processes or agents ([`tessera_fleet::driver`]): the members of the current epoch.
    Fleet(Box<Fleet<Plan>>),
    /// NCCL GPU ranks, threads of this process (`crate::gpu::compute`).
    Gpu(GpuRanks),
}

fn lock(st: &Mutex<RankState>) -> MutexGuard<'_, RankState> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

/// The ranks whose masters, concatenated in rank order, make the full buffer.
fn owners(plan: &Plan) -> Vec<usize> {
    if plan.stage == 0 {
        vec![0]
    } else {
        (0..plan.world).collect()
    }
}

impl Ranks {
    /// Full-length masters and, with `with_optim`, optimizer buffers (empty otherwise: evaluation
    /// and the final hash need only the masters), gathered from the ranks between steps.
    pub fn assemble(&self, plan: &Plan, with_optim: bool) -> Result<(Vec<f32>, OptimBuffers, RankCounters)> {
        let mut master = Vec::with_capacity(plan.total());
        let mut bufs: OptimBuffers = Vec::new();
        let mut append = |m: &[f32], optim: Vec<(&str, &[f32])>| {
            master.extend_from_slice(m);
            for (i, (name, b)) in optim.into_iter().enumerate() {
                if bufs.len() <= i {
                    bufs.push((name.to_string(), Vec::with_capacity(plan.total())));
                }
                bufs[i].1.extend_from_slice(b);
            }
        };
        let counters = match self {
            Ranks::InProcess(states) => {
                for r in owners(plan) {
                    let st = lock(&states[r]);
                    append(&st.master, if with_optim { st.optim.state_buffers() } else { Vec::new() });
                }
                let st = lock(&states[0]);
                RankCounters {
                    optimizer_steps: st.optim.step_count(),
                    applied: st.applied,
                    skipped: st.skipped,
                    scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
                }
            }
            Ranks::Fleet(fleet) => {
                let mut first = None;
                for r in owners(plan) {
                    let (m, optim, c) = fleet.export(r, plan, with_optim)?;
                    append(&m, optim.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect());
                    first.get_or_insert(c);
                }
                first.context("no rank exported its state")?
            }
            // Gathered whole over NCCL (the GPU's own layout), not shard by shard.
            Ranks::Gpu(g) => {
                let (m, optim, (optimizer_steps, applied, skipped), scaler) = g.assemble(with_optim)?;
                return Ok((m, optim, RankCounters { optimizer_steps, applied, skipped, scaler }));
            }
        };
        Ok((master, bufs, counters))
    }

    /// Every rank's collective bytes sent so far.
    pub fn bytes_sent_totals(&self) -> Vec<u64> {
        match self {
            Ranks::InProcess(states) => states.iter().map(|st| lock(st).bytes_sent_total).collect(),
            Ranks::Fleet(fleet) => fleet.snapshots().iter().map(|s| s.bytes_sent_total).collect(),
            // NCCL's traffic is not counted.
            Ranks::Gpu(g) => vec![0; g.states.len()],
        }
    }

    /// Rank 0's applied-step count and loss scale (alike on every rank).
    pub fn applied_and_scale(&self) -> (u64, Option<f32>) {
        match self {
            Ranks::InProcess(states) => {
                let st = lock(&states[0]);
                (st.applied, st.scaler.as_ref().map(|s| s.scale()))
            }
            Ranks::Fleet(fleet) => {
                let s = fleet.snapshots().first().copied().unwrap_or_default();
                (s.applied, s.scale_bits.map(f32::from_bits))
            }
            Ranks::Gpu(g) => g.applied_and_scale(),
        }
    }

    /// Each rank's process's peak resident set size, in rank order, as its last reply reported
    /// it; `None` when the ranks are threads of this process.
    pub fn peak_rss_bytes(&self) -> Option<Vec<u64>> {
        match self {
            Ranks::InProcess(_) | Ranks::Gpu(_) => None,
            Ranks::Fleet(fleet) => Some(fleet.snapshots().iter().map(|s| s.peak_rss_bytes).collect()),
        }
    }

    /// Every rank's memory report, in rank order.
    pub fn memory(&self) -> Vec<MemoryReport> {
        match self {
            Ranks::InProcess(states) => states.iter().enumerate().map(|(r, st)| lock(st).memory(r)).collect(),
            Ranks::Fleet(fleet) => fleet.snapshots().iter().enumerate().map(|(r, s)| s.memory.report(r)).collect(),
            Ranks::Gpu(g) => g.memory(),
        }
    }

    /// Ends the ranks: worker processes leave their group and exit (checked); threads need nothing.
    pub fn close(self) -> Result<()> {
        match self {
            Ranks::InProcess(_) | Ranks::Gpu(_) => Ok(()),
            Ranks::Fleet(fleet) => fleet.close(),
        }
    }
}
