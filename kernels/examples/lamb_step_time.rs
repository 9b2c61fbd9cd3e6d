//! Times one LAMB optimizer step (`OptimizerShard::step`, one shard, `LocalReduce`) over a flat
//! buffer of 20 matrices of 512×512 and 20 vectors of 1024: best and mean of 20 steps after 3
//! warm-up steps, and one output value's bits to compare builds. Run on two commits to compare
//! the step's cost: `cargo run --release -p tessera-kernels --example lamb_step_time`.

use std::time::Instant;

use tessera_kernels::optim::{FlatLayout, LambParams, LocalReduce, OptimizerKind, OptimizerShard, StepContext};

fn main() {
    let sizes: Vec<usize> = (0..40).map(|i| if i % 2 == 0 { 512 * 512 } else { 1024 }).collect();
    let layout = FlatLayout::from_sizes(&sizes).expect("layout");
    let n = layout.total();
    let decay: Vec<bool> = (0..sizes.len()).map(|i| i % 2 == 0).collect();
    let mut p: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let g: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) * 1e-4).collect();
    let mut shard = OptimizerShard::new(OptimizerKind::Lamb(LambParams::default()), n);
    let ctx = StepContext { shard_range: 0..n, layout: &layout, decay: &decay };
    for _ in 0..3 {
        shard.step(&mut p, &g, 1e-3, &ctx, &mut LocalReduce).expect("step");
    }
    let reps = 20;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        shard.step(&mut p, &g, 1e-3, &ctx, &mut LocalReduce).expect("step");
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let best = times.iter().copied().fold(f64::MAX, f64::min);
    let mean = times.iter().sum::<f64>() / reps as f64;
    println!("| parameters | threads | best ms | mean ms | p[7] bits |");
    println!("|---|---|---|---|---|");
    println!("| {n} | {} | {best:.2} | {mean:.2} | {:08x} |", rayon::current_num_threads(), p[7].to_bits());
}
