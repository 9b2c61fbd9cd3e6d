//! What the seeded simulations share in their tests (this crate's `stepper_sim`, `txn_sim`,
//! `loop_sim`, `liveness_sim`, `worker_sim`, `formation_sim`, and the `tessera` crate's `restore_sim`): running many seeds, replaying one seed with its trace, and checking that
//! a seed gives the same outcome and trace every time. A simulation exposes `build(seed)` (the world it draws)
//! and `run_seed(seed, trace)` (its outcome, or the broken rule).

use std::fmt::Debug;

/// `run_seed` of a simulation: the outcome of one seed, writing its trace when asked.
pub type RunSeed<T> = fn(u64, Option<&mut Vec<String>>) -> Result<T, String>;

/// Runs the seed `TESSERA_SIM_SEED` names (7 when unset) and prints its world, its trace and its
/// outcome; panics with the broken rule when it fails. Failing seeds replay exactly this way.
pub fn replay<B: Debug, T: Debug>(build: fn(u64) -> B, run_seed: RunSeed<T>) {
    let seed = std::env::var("TESSERA_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    println!("seed {seed}: {:#?}", build(seed));
    let mut trace = Vec::new();
    let got = run_seed(seed, Some(&mut trace));
    for line in &trace {
        println!("  {line}");
    }
    match got {
        Ok(t) => println!("seed {seed}: {t:?}"),
        Err(e) => panic!("{e}"),
    }
}

/// Seeds 1, 2 and 3, each run twice, give the same outcome and the same trace.
pub fn assert_deterministic<T: Debug>(run_seed: RunSeed<T>) {
    for seed in [1, 2, 3] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (x, y) = (run_seed(seed, Some(&mut a)), run_seed(seed, Some(&mut b)));
        assert_eq!((format!("{x:?}"), a), (format!("{y:?}"), b), "seed {seed}");
    }
}

/// Runs seeds `0..n` (`n` from `TESSERA_SIM_SEEDS`, else `default`) and hands each outcome to
/// `add`; a seed that breaks a rule, or whose machine panics, fails the test with the command
/// that replays it (`replay_test`: the package and the simulation's replay test, as `cargo test
/// --release` takes them, e.g. `-p tessera-actors txn_replay`). Returns `n`.
pub fn many_seeds<T>(what: &str, replay_test: &str, default: u64, run_seed: RunSeed<T>, mut add: impl FnMut(T)) -> u64 {
    let n = std::env::var("TESSERA_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let start = std::time::Instant::now();
    for seed in 0..n {
        // A machine that panics (an input its phase does not expect) fails the seed too.
        let got = std::panic::catch_unwind(|| run_seed(seed, None)).unwrap_or_else(|_| Err("a machine panicked".into()));
        match got {
            Ok(t) => add(t),
            Err(e) => {
                panic!("{what} simulation failed: {e}\n\nreplay: TESSERA_SIM_SEED={seed} cargo test --release {replay_test} -- --nocapture")
            }
        }
    }
    println!("{n} seeds in {:.2} s", start.elapsed().as_secs_f64());
    n
}
