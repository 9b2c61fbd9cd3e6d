//! Stage 3's gathers: the step's schedule ([`gather_schedule`], with prefetch) and the release
//! policy it shares with [`super::access`].

use super::super::plan::{Plan, UnitEvent};
use crate::offload::Tier;

/// One stage-3 gather of a step: unit `unit` for its use number `use_at`, queued on the
/// communication lane at use number `issue_at` (≤ `use_at`; earlier = prefetched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gather {
    pub unit: usize,
    pub use_at: usize,
    pub issue_at: usize,
}

/// The step's stage-3 gathers, in order: every use of a non-persistent unit that is not held
/// at that moment under the release policy of [`super::access::StepAccess`] (see [`release`]), each queued as
/// early as `stage3_prefetch_bucket_size` (elements queued ahead and not yet used) and
/// `stage3_max_live_parameters` (elements held, counting those queued ahead) allow. A pure
/// function of the plan, so every rank queues the same collectives at the same points.
pub fn gather_schedule(plan: &Plan) -> Vec<Gather> {
    if !plan.gathers() {
        return Vec::new();
    }
    let units = plan.model.units();
    let uses: Vec<usize> = (0..plan.slots())
        .flat_map(|_| plan.micro_batch_events())
        .filter_map(|e| match e {
            UnitEvent::Use(u) => Some(u),
            UnitEvent::Ready(_) => None,
        })
        .collect();
    // Which uses gather, under the release policy.
    let mut cached = vec![false; units.len()];
    let mut held: Option<usize> = None;
    let mut live_at = Vec::with_capacity(uses.len());
    let mut out = Vec::new();
    for (j, &u) in uses.iter().enumerate() {
        if !cached[u] {
            release(plan, &mut cached, &mut held, u, |c, x| c[x] = false);
            cached[u] = true;
            if !plan.persistent[u] {
                out.push(Gather { unit: u, use_at: j, issue_at: j });
            }
        }
        live_at.push(cached.iter().zip(units).filter(|(c, _)| **c).map(|(_, r)| r.len()).sum::<usize>());
    }
    // When each is queued: after use `j`, the next gathers go ahead while they fit.
    let mut next = 0;
    let mut ahead = 0usize;
    for (j, &live) in live_at.iter().enumerate() {
        while next < out.len() && out[next].use_at <= j {
            // Used now: queued at its use unless queued earlier; no longer ahead.
            if out[next].issue_at < out[next].use_at {
                ahead -= units[out[next].unit].len();
            }
            next += 1;
        }
        let mut k = next;
        while k < out.len() && out[k].issue_at < out[k].use_at {
            k += 1;
        }
        while k < out.len() {
            let len = units[out[k].unit].len();
            // Pieces read from NVMe wait in `offload_param.buffer_count` buffers, one of them
            // the current unit's.
            let buffers_full = plan.offload.param == Tier::Nvme && k - next + 1 >= plan.offload.param_buffer_count;
            if ahead + len > plan.prefetch_elems || live + ahead + len > plan.max_live_elems || buffers_full {
                break;
            }
            out[k].issue_at = j;
            ahead += len;
            k += 1;
        }
    }
    out
}

/// The release policy: what goes before unit `u` is loaded — the previous block, and unit 0
/// too when it may not stay live next to a block (or a block next to it).
pub(super) fn release<C>(plan: &Plan, cache: &mut C, held: &mut Option<usize>, u: usize, drop_unit: impl Fn(&mut C, usize)) {
    if u != 0 {
        if let Some(prev) = held.replace(u) {
            drop_unit(cache, prev);
        }
        if !plan.keep_unit0 {
            drop_unit(cache, 0);
        }
    } else if !plan.keep_unit0 {
        if let Some(prev) = held.take() {
            drop_unit(cache, prev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{plan, plan_error, two_steps, BLOCK, UNIT0};
    use super::*;

    #[test]
    fn the_gather_schedule_prefetches_within_its_bounds() {
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        let units = |p: &Plan| p.model.units().iter().map(|r| r.len()).collect::<Vec<_>>();
        // Without prefetch every gather is queued at its use.
        let p = plan(2, 3, &[no_persist, "zero_optimization.stage3_prefetch_bucket_size=0"]);
        let none = gather_schedule(&p);
        assert!(none.iter().all(|g| g.issue_at == g.use_at), "{none:?}");
        // Per slot (2 slots, 4 blocks): unit 0 once (kept), blocks 1-4 forward, 4 stays held
        // across the head, 3-1 backward; the next slot starts with block 1 still held.
        let order: Vec<usize> = none.iter().map(|g| g.unit).collect();
        assert_eq!(order, [0, 1, 2, 3, 4, 3, 2, 1, 2, 3, 4, 3, 2, 1]);
        for (prefetch, max_live) in [(BLOCK, 1_000_000_000), (2 * BLOCK, 1_000_000_000), (10 * BLOCK, UNIT0 + 3 * BLOCK)] {
            let sets = [
                no_persist.to_string(),
                format!("zero_optimization.stage3_prefetch_bucket_size={prefetch}"),
                format!("zero_optimization.stage3_max_live_parameters={max_live}"),
            ];
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let p = plan(2, 3, &sets);
            let sched = gather_schedule(&p);
            let sizes = units(&p);
            assert_eq!(
                sched.iter().map(|g| (g.unit, g.use_at)).collect::<Vec<_>>(),
                none.iter().map(|g| (g.unit, g.use_at)).collect::<Vec<_>>()
            );
            assert!(sched.iter().any(|g| g.issue_at < g.use_at), "prefetch {prefetch} queued nothing ahead");
            assert!(sched.windows(2).all(|w| w[0].issue_at <= w[1].issue_at), "gathers are queued in order");
            // At every use, what is queued ahead and not yet used fits the prefetch size.
            let last = sched.last().map_or(0, |g| g.use_at);
            for j in 0..=last {
                let ahead: usize = sched.iter().filter(|g| g.issue_at <= j && j < g.use_at).map(|g| sizes[g.unit]).sum();
                assert!(ahead <= prefetch, "use {j}: {ahead} elements ahead > {prefetch}");
                assert!(ahead + UNIT0 <= max_live, "use {j}: {ahead} ahead beside unit 0 exceed {max_live}");
            }
        }
        // A prefetch size below one block queues nothing ahead.
        let p = plan(2, 3, &[no_persist, "zero_optimization.stage3_prefetch_bucket_size=1000"]);
        assert_eq!(gather_schedule(&p), none);
    }

    #[test]
    fn persistent_and_released_units_keep_stage_3_bit_identical() {
        let (one, _) = two_steps(1, 0, &[]);
        for sets in [
            &["zero_optimization.stage3_param_persistence_threshold=0"][..],
            &["zero_optimization.stage3_param_persistence_threshold=1000000"][..],
            &["zero_optimization.stage3_param_persistence_threshold=0", "zero_optimization.stage3_max_live_parameters=200000"][..],
        ] {
            let (two, _) = two_steps(2, 3, sets);
            assert_eq!(one, two, "world 2 stage 3 with {sets:?} differs from one worker");
        }
    }

    #[test]
    fn the_unit_policy_follows_the_keys() {
        let p = plan(4, 3, &[]);
        assert_eq!(p.model.units()[0].len(), UNIT0);
        assert_eq!(p.model.units()[1].len(), BLOCK);
        // DeepSpeed's default threshold (1e5) makes unit 0 persistent, not the blocks.
        assert_eq!(p.persistent, [true, false, false, false, false]);
        assert!(p.keep_unit0);
        // Rank 1 holds its shard and unit 0 whole, merged into disjoint ranges.
        assert_eq!(p.param_ranges(1), vec![0..UNIT0, p.ranges[1].clone()]);
        assert_eq!(p.param_ranges(0), vec![p.ranges[0].clone()]);
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        assert!(plan(4, 3, &[no_persist]).keep_unit0);
        assert!(!plan(4, 3, &[no_persist, "zero_optimization.stage3_max_live_parameters=247679"]).keep_unit0);
        assert!(plan(4, 3, &[no_persist, "zero_optimization.stage3_max_live_parameters=247680"]).keep_unit0);
        assert!(!plan(4, 3, &[no_persist, "zero_optimization.stage3_max_reuse_distance=793087"]).keep_unit0);
        assert!(plan(4, 3, &[no_persist, "zero_optimization.stage3_max_reuse_distance=793088"]).keep_unit0);
        // Without gathering (stages 0-2, or one rank) nothing is persistent or released.
        let p = plan(1, 3, &["zero_optimization.stage3_max_live_parameters=1"]);
        assert!(p.keep_unit0 && p.persistent.iter().all(|x| !x));
    }

    #[test]
    fn impossible_zero_settings_are_refused_naming_key_and_sizes() {
        let e = plan_error(2, 3, &["zero_optimization.stage3_max_live_parameters=100000"]);
        assert!(e.contains("stage3_max_live_parameters = 100000") && e.contains("unit 1 (transformer block 0)"), "{e}");
        assert!(e.contains(&BLOCK.to_string()), "{e}");
        // A unit that persists is never gathered, so the bound does not apply to it.
        assert_eq!(
            plan_error(
                2,
                3,
                &["zero_optimization.stage3_max_live_parameters=100000", "zero_optimization.stage3_param_persistence_threshold=1000000"]
            ),
            ""
        );
    }
}
