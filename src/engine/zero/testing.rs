//! Helpers shared by the ZeRO engine's tests: a gpt-tiny plan over a synthetic byte stream, and
//! committed steps run on threads.

use std::sync::{Arc, Mutex};

use tessera_actors::compute::{StepOrder, WorkerCompute};
use tessera_transport::collective::Collective;
use tessera_transport::local::{LocalComm, LocalGroup};

use super::super::device::Device;
use super::{lock, Plan, RankState, ZeroWorker};
use crate::config::{from_str_named, Config, ResolveContext};
use crate::data::{Dataset, Sampler};

/// gpt-tiny over bytes: unit 0 holds 49,408 parameters, each of the 4 blocks 198,272.
pub(super) const UNIT0: usize = 49_408;
pub(super) const BLOCK: usize = 198_272;

/// A gpt-tiny config over a synthetic byte stream: 4 micro-batches of 16 tokens per step.
pub(super) fn setup(world: usize, stage: u8, sets: &[&str]) -> (Config, Dataset) {
    let text = r#"{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "tessera": {"model": "gpt-tiny", "seq_len": 16}}"#;
    let mut overrides = vec![format!("zero_optimization.stage={stage}")];
    overrides.extend(sets.iter().map(|s| s.to_string()));
    let cfg = from_str_named(text, "test.json", &overrides, &ResolveContext::with_world(world)).expect("test config");
    let tokens: Vec<u32> = (0..4096u32).map(|i| (i * 37 + i / 7) % 256).collect();
    (cfg, Dataset::from_tokens(tokens.clone(), tokens, 256, "synthetic".into()))
}

pub(super) fn plan(world: usize, stage: u8, sets: &[&str]) -> Plan {
    let (cfg, data) = setup(world, stage, sets);
    Plan::new(&cfg, &data).expect("test plan")
}

pub(super) fn plan_error(world: usize, stage: u8, sets: &[&str]) -> String {
    let (cfg, data) = setup(world, stage, sets);
    Plan::new(&cfg, &data).err().map(|e| format!("{e:#}")).unwrap_or_default()
}

/// Runs two committed steps on `world` threads; returns the full masters and each rank's ops.
pub(super) fn two_steps(world: usize, stage: u8, sets: &[&str]) -> (Vec<f32>, Vec<u64>) {
    two_steps_with(world, stage, sets, None, |c| Box::new(c))
}

thread_local! {
    /// Whether [`two_steps_with`]'s ranks run whole micro-batches through the GPU's staging
    /// (with the CPU's arithmetic) instead of unit by unit.
    pub(super) static STAGED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Expert parallelism for [`two_steps_with`]'s plan (`ep_size`; 1 = none).
    pub(super) static EP_SIZE: std::cell::Cell<usize> = const { std::cell::Cell::new(1) };
}

/// As [`two_steps`] with the micro-batch blocks sized by `speeds` (as the elastic planner
/// does for uneven workers) and each rank's collective wrapped by `wrap`.
pub(super) fn two_steps_with(
    world: usize,
    stage: u8,
    sets: &[&str],
    speeds: Option<&[f64]>,
    wrap: impl Fn(LocalComm) -> Box<dyn Collective>,
) -> (Vec<f32>, Vec<u64>) {
    let mut plan = plan(world, stage, sets);
    if EP_SIZE.get() > 1 {
        plan.experts = Some(crate::engine::experts::ExpertPlan::new(&plan.model, EP_SIZE.get(), world).expect("an expert plan"));
    }
    if let Some(speeds) = speeds {
        plan.blocks = tessera_actors::plan::assign_blocks(plan.micro_batches, speeds);
        assert!((0..world).any(|r| plan.leaves(r).len() < plan.slots()), "speeds {speeds:?} gave even blocks {:?}", plan.blocks);
    }
    let plan = Arc::new(plan);
    let (_, data) = setup(world, stage, sets);
    let sampler = Arc::new(Sampler::new(data.train, plan.seq_len, 7).expect("sampler"));
    let init = plan.model.init_params(7);
    let states: Vec<_> = (0..world).map(|r| Arc::new(Mutex::new(RankState::new(&plan, r, &init, None)))).collect();
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let mut w = ZeroWorker::new(r, Arc::clone(&plan), Arc::clone(&sampler), wrap(comm), Arc::clone(&states[r]));
            if STAGED.get() {
                w.dev = Device::Cuda(Box::new(super::super::device::Staged::new(super::super::device::Whole::Cpu)));
            }
            std::thread::spawn(move || {
                for step in 0..2 {
                    w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                    w.commit(step).expect("commit");
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().expect("rank thread"));
    let owners = if stage == 0 { 1 } else { world };
    let master = (0..owners).flat_map(|r| lock(&states[r]).master.to_vec()).collect();
    (master, states.iter().map(|s| lock(s).ops_total).collect())
}

pub(super) const LAMB: &str = "optimizer.type=Lamb";
/// OneCycle over 4 updates; `cycle_momentum` (DeepSpeed's default) cycles the betas.
pub(super) const ONE_CYCLE: &str = r#"scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.004,
    "cycle_first_step_size": 2}}"#;
