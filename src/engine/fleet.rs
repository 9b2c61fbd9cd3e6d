//! The front crate's side of the process runtime ([`tessera_fleet`]): the plan as the fleet sees
//! it ([`FleetPlan`] for [`Plan`]), how a fleet re-plans ([`RunPlanner`]: the config's plan for
//! another world, over the loaded data), the fleet's spec built from the config
//! ([`fleet_spec`]), and the driver process's signal handling as the fleet's [`Host`].

use std::any::Any;
use std::ops::Range;
use std::path::Path;

use anyhow::Result;
use tessera_fleet::spec::{ElasticRun, FleetSpec, Host};
use tessera_fleet::state::{FleetPlan, Planner};

use super::plan::Plan;
use crate::config::Config;
use crate::data::Dataset;
use crate::signals;

impl FleetPlan for Plan {
    fn world(&self) -> usize {
        self.world
    }

    fn total(&self) -> usize {
        Plan::total(self)
    }

    fn optim_range(&self, r: usize) -> Range<usize> {
        Plan::optim_range(self, r)
    }

    fn sharded(&self) -> bool {
        self.stage != 0
    }

    fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    fn counts(&self) -> Vec<usize> {
        Plan::counts(self)
    }
}

/// Re-plans a run for its fleet: `cfg`'s plan for another world size, over `dataset`.
pub struct RunPlanner<'a> {
    pub cfg: &'a Config,
    pub dataset: &'a Dataset,
}

impl Planner<Plan> for RunPlanner<'_> {
    fn plan(&self, world: usize) -> Result<Plan> {
        let (cfg, notes) = config_for_world(self.cfg, world);
        for note in notes {
            eprintln!("[elastic] {note}");
        }
        Plan::new(&cfg, self.dataset)
    }

    fn with_blocks(&self, world: usize, blocks: Vec<Vec<(usize, u32)>>) -> Result<Plan> {
        self.plan(world)?.with_blocks(blocks).map_err(anyhow::Error::msg)
    }
}

/// `cfg` for a fleet of `world` ranks (a new epoch's, after losses or joins), and what it had to
/// change, one line each: with expert parallelism a world that `tessera.moe.ep_size` does not
/// divide runs with the largest divisor of it that divides the world; with pipeline stages, a
/// world that `pipeline.stages` does not divide runs with the largest divisor of it that does
/// (fewer, longer stages). Experts and stages are placed, not stored (their parameters follow
/// the ZeRO partition), so the groups re-form at once and the bits do not change. The driver
/// and every worker re-plan through this.
pub fn config_for_world(cfg: &Config, world: usize) -> (Config, Vec<String>) {
    let mut cfg = cfg.clone();
    cfg.world_size = world;
    let mut notes = Vec::new();
    if let Some(moe) = cfg.tessera.moe.as_mut() {
        let asked = moe.ep_size;
        moe.ep_size = (1..=asked).rev().find(|d| asked % d == 0 && world % d == 0).unwrap_or(1);
        if moe.ep_size != asked {
            notes.push(format!(
                "tessera.moe.ep_size = {asked} does not divide {world} ranks: expert groups of {} until it does",
                moe.ep_size
            ));
        }
    }
    if let Some(p) = cfg.pipeline.as_mut() {
        let asked = p.stages;
        p.stages = (1..=asked).rev().find(|d| world % d == 0).unwrap_or(1);
        if p.stages != asked {
            notes.push(format!("pipeline.stages = {asked} does not divide {world} ranks: {} stages until it does", p.stages));
        }
    }
    (cfg, notes)
}

/// What a run's fleet runs with: the elastic runtime's knobs `er` (`config::elastic_run`), the
/// resolved config and its hash, the hash of the loaded data, and the output folder.
pub fn fleet_spec(cfg: &Config, er: &ElasticRun, out_dir: &Path, dataset: &Dataset) -> FleetSpec {
    FleetSpec {
        run: er.clone(),
        config: cfg.resolved.clone(),
        config_hash: cfg.hash.clone(),
        data_blake3: super::child::data_blake3(dataset),
        out_dir: out_dir.to_path_buf(),
    }
}

/// The driver process as the fleet's host: a stop asked for by a signal, and the cleanup of a
/// forced exit (`crate::signals`).
pub struct SignalHost;

impl Host for SignalHost {
    fn stop_requested(&self) -> Option<String> {
        signals::requested().map(|why| why.to_string())
    }

    fn remove_at_forced_exit(&self, dir: &Path) -> Box<dyn Any + Send + Sync> {
        Box::new(signals::on_forced_exit(signals::Cleanup::Dir(dir.to_path_buf())))
    }
}
