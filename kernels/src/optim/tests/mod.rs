//! Tests of the optimizer module: scalar f64 references, sharding determinism, loss scaling.

mod adagrad;
mod cycle;
mod determinism;
mod misc;
mod optimizers;
mod scaler;

use std::ops::Range;
use std::sync::{Barrier, Mutex};

use super::norm::NormAllReduce;

/// SplitMix64: small deterministic generator so tests need no extra crates.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// Values spread over several orders of magnitude (makes summation order visible).
    pub fn wide(&mut self) -> f32 {
        let e = self.below(7) as i32 - 3;
        self.unit() * 10f32.powi(e)
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }

    pub fn wide_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.wide()).collect()
    }
}

/// An all-reduce between scoped threads: every participant adds its vector into a shared
/// accumulator (in arrival order, i.e. any order) and reads back the sum.
pub(crate) struct SharedSum {
    acc: Mutex<Vec<f64>>,
    barrier: Barrier,
}

impl SharedSum {
    pub fn new(workers: usize) -> Self {
        Self { acc: Mutex::new(Vec::new()), barrier: Barrier::new(workers) }
    }
}

pub(crate) struct ThreadReduce<'a>(pub &'a SharedSum);

impl NormAllReduce for ThreadReduce<'_> {
    fn all_reduce_sum(&mut self, v: &mut [f64]) -> Result<(), String> {
        let s = self.0;
        {
            let mut acc = s.acc.lock().expect("reduce lock");
            if acc.is_empty() {
                acc.resize(v.len(), 0.0);
            }
            for (a, x) in acc.iter_mut().zip(v.iter()) {
                *a += *x;
            }
        }
        s.barrier.wait();
        v.copy_from_slice(&s.acc.lock().expect("reduce lock"));
        if s.barrier.wait().is_leader() {
            s.acc.lock().expect("reduce lock").clear();
        }
        s.barrier.wait();
        Ok(())
    }
}

/// Per-element decay flag expanded from per-segment flags.
pub(crate) fn element_decay(segments: &[Range<usize>], decay: &[bool]) -> Vec<bool> {
    let mut out = Vec::new();
    for (seg, &d) in segments.iter().zip(decay) {
        out.extend(std::iter::repeat_n(d, seg.len()));
    }
    out
}

/// Asserts `got` (f32) is within `atol + rtol·|want|` of the f64 reference everywhere.
pub(crate) fn assert_close(got: &[f32], want: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= atol + rtol * w.abs(), "{what}: element {i}: got {g}, reference {w}, error {err}");
    }
}

/// Bitwise equality of f32 buffers with the first differing index on failure.
pub(crate) fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}
