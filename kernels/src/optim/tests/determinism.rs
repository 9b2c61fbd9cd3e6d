//! Property tests: norms and optimizer results are bit-identical for any block-aligned
//! partition of the flat buffer into 1..=5 shards.

use std::ops::Range;

use super::super::{
    AdagradParams, AdamParams, FlatLayout, LambParams, LionParams, LocalReduce, NormAllReduce, OptimizerKind, OptimizerShard, SgdParams,
    StepContext, NORM_BLOCK,
};
use super::{assert_bits_eq, Rng, SharedSum, ThreadReduce};

/// A random layout: a mix of tiny, medium and multi-block tensors (some empty).
fn random_layout(rng: &mut Rng) -> FlatLayout {
    let count = 1 + rng.below(12);
    let sizes: Vec<usize> = (0..count)
        .map(|_| match rng.below(4) {
            0 => rng.below(40),
            1 => 1 + rng.below(3000),
            2 => 1 + rng.below(NORM_BLOCK + 500),
            _ => 1 + rng.below(3 * NORM_BLOCK),
        })
        .collect();
    FlatLayout::from_sizes(&sizes).expect("layout")
}

/// 1..=5 contiguous shards with block-aligned cuts (empty shards allowed).
fn random_partition(rng: &mut Rng, total: usize) -> Vec<Range<usize>> {
    let shards = 1 + rng.below(5);
    let blocks = total.div_ceil(NORM_BLOCK);
    let mut cuts: Vec<usize> = (0..shards - 1).map(|_| (rng.below(blocks + 1) * NORM_BLOCK).min(total)).collect();
    cuts.sort_unstable();
    let mut bounds = vec![0];
    bounds.extend(cuts);
    bounds.push(total);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

#[test]
fn partial_sums_are_partition_independent() {
    let mut rng = Rng::new(7);
    for case in 0..30 {
        let layout = random_layout(&mut rng);
        let x = rng.wide_vec(layout.total());
        let mut whole = vec![0.0f64; layout.slots()];
        layout.partial_sumsq(&x, 0..layout.total(), &mut whole).expect("whole");

        let parts = random_partition(&mut rng, layout.total());
        let mut per_shard: Vec<Vec<f64>> = parts
            .iter()
            .map(|r| {
                let mut out = vec![0.0f64; layout.slots()];
                layout.partial_sumsq(&x[r.clone()], r.clone(), &mut out).expect("shard");
                out
            })
            .collect();
        // Sum across shards in a shuffled order: any order must give the same bits.
        for i in (1..per_shard.len()).rev() {
            per_shard.swap(i, rng.below(i + 1));
        }
        let mut summed = vec![0.0f64; layout.slots()];
        for s in &per_shard {
            summed.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        }
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&summed), bits(&whole), "case {case}: slots differ for {parts:?}");
        let (ga, gb) = (layout.global_norm(&summed), layout.global_norm(&whole));
        assert_eq!(ga.to_bits(), gb.to_bits(), "case {case}: global norm");
        assert_eq!(bits(&layout.segment_sumsq(&summed)), bits(&layout.segment_sumsq(&whole)));

        let naive: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
        assert!((ga - naive).abs() <= 1e-12 * naive.max(1.0), "case {case}: {ga} vs {naive}");
    }
}

const STEPS: usize = 3;

/// Steps every shard of `parts` in its own thread (collective reduce through `SharedSum`) and
/// returns the concatenated weights.
fn run_sharded(
    kind: OptimizerKind,
    layout: &FlatLayout,
    decay: &[bool],
    parts: &[Range<usize>],
    p0: &[f32],
    grads: &[Vec<f32>],
) -> Vec<f32> {
    let shared = SharedSum::new(parts.len());
    let mut master = p0.to_vec();
    let mut chunks: Vec<&mut [f32]> = Vec::new();
    let mut rest = master.as_mut_slice();
    for r in parts {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
        chunks.push(head);
        rest = tail;
    }
    std::thread::scope(|s| {
        for (r, p) in parts.iter().zip(chunks) {
            let shared = &shared;
            s.spawn(move || {
                let mut shard = OptimizerShard::new(kind, r.len());
                let ctx = StepContext { shard_range: r.clone(), layout, decay };
                let (mut reduce, mut local) = (ThreadReduce(shared), LocalReduce);
                let reducer: &mut dyn NormAllReduce = if parts.len() == 1 { &mut local } else { &mut reduce };
                for (t, g) in grads.iter().enumerate() {
                    let lr = 1e-2 / (1.0 + t as f32);
                    shard.step(p, &g[r.clone()], lr, &ctx, reducer).expect("step");
                }
            });
        }
    });
    master
}

#[test]
fn optimizers_are_bit_identical_across_partitions() {
    let kinds = [
        OptimizerKind::Lamb(LambParams { weight_decay: 0.01, ..LambParams::default() }),
        OptimizerKind::Adam(AdamParams { weight_decay: 0.1, ..AdamParams::default() }),
        OptimizerKind::Lion(LionParams { weight_decay: 0.1, ..LionParams::default() }),
        OptimizerKind::Sgd(SgdParams { momentum: 0.9, weight_decay: 0.1, ..SgdParams::default() }),
        OptimizerKind::Adagrad(AdagradParams {
            lr_decay: 0.1,
            weight_decay: 0.1,
            initial_accumulator_value: 0.1,
            ..AdagradParams::default()
        }),
    ];
    let mut rng = Rng::new(11);
    let mut multi_shard_cases = 0;
    for case in 0..8 {
        let layout = random_layout(&mut rng);
        let n = layout.total();
        let decay: Vec<bool> = (0..layout.segments().len()).map(|_| rng.below(2) == 0).collect();
        // Unit-range weights keep LAMB trust ratios unclamped, so shard-local norms would show.
        let p0 = rng.vec(n);
        let grads: Vec<Vec<f32>> = (0..STEPS).map(|_| rng.wide_vec(n)).collect();
        let parts = random_partition(&mut rng, n);
        multi_shard_cases += usize::from(parts.iter().filter(|r| !r.is_empty()).count() > 1);
        for kind in kinds {
            let whole = run_sharded(kind, &layout, &decay, std::slice::from_ref(&(0..n)), &p0, &grads);
            let split = run_sharded(kind, &layout, &decay, &parts, &p0, &grads);
            assert_bits_eq(&split, &whole, &format!("case {case} {} {parts:?}", kind.name()));
        }
    }
    assert!(multi_shard_cases >= 3, "too few real partitions: {multi_shard_cases}");
}
