//! Small owned `f32` tensors, the deterministic splittable PRNG used for initialisation and
//! dropout/sampling streams, and the deterministic vector helpers shared by the kernels
//! (lane-ordered sums, fixed-order row and column reductions, a vectorisable `exp`, and the
//! AVX-512 dispatch that elementwise kernels use).

use rayon::prelude::*;
use thiserror::Error;

/// Errors from building a tensor.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TensorError {
    #[error("shape {shape:?} holds {expected} elements but the data has {got}")]
    ShapeMismatch { shape: Vec<usize>, expected: usize, got: usize },
}

/// A row-major owned tensor: `data.len() == shape.iter().product()`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] }
    }

    /// Wraps `data`, checking that its length matches `shape`.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Tensor, TensorError> {
        let expected: usize = shape.iter().product();
        if expected != data.len() {
            return Err(TensorError::ShapeMismatch { shape: shape.to_vec(), expected, got: data.len() });
        }
        Ok(Tensor { shape: shape.to_vec(), data })
    }

    /// A tensor of N(0, std²) samples drawn from `rng`.
    pub fn randn(shape: &[usize], std: f32, rng: &mut Rng) -> Tensor {
        let mut t = Tensor::zeros(shape);
        rng.fill_normal(&mut t.data, std);
        t
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64 finaliser: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256** generator seeded through SplitMix64. Deterministic across platforms; streams for
/// independent purposes are derived from a seed and a key tuple with [`Rng::derive`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream is a function of `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(GOLDEN_GAMMA);
            mix64(sm)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    /// An independent stream keyed by `(seed, key[0], key[1], ...)`, e.g. (seed, step, layer).
    /// Order and length of the key matter: `[1, 2]`, `[2, 1]` and `[1, 2, 0]` differ.
    pub fn derive(seed: u64, key: &[u64]) -> Rng {
        let mut h = mix64(seed ^ 0x7465_7373_6572_6121);
        for (i, &k) in key.iter().enumerate() {
            let salted = k.wrapping_add(GOLDEN_GAMMA.wrapping_mul(i as u64 + 1));
            h = mix64(h.rotate_left(17) ^ mix64(salted));
        }
        Rng::new(mix64(h ^ key.len() as u64))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Box–Muller pair of independent N(0, 1) samples (computed in f64).
    fn normal_pair(&mut self) -> (f64, f64) {
        let u1 = 1.0 - self.next_f64(); // (0, 1], so ln is finite
        let u2 = self.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        (r * c, r * s)
    }

    /// One N(0, 1) sample (uses two uniforms; the pair's second value is discarded).
    pub fn normal(&mut self) -> f32 {
        self.normal_pair().0 as f32
    }

    /// Fills `x` with N(0, std²) samples, two per Box–Muller pair.
    pub fn fill_normal(&mut self, x: &mut [f32], std: f32) {
        let std = std as f64;
        let mut pairs = x.chunks_exact_mut(2);
        for p in &mut pairs {
            let (a, b) = self.normal_pair();
            p[0] = (a * std) as f32;
            p[1] = (b * std) as f32;
        }
        if let [last] = pairs.into_remainder() {
            *last = (self.normal_pair().0 * std) as f32;
        }
    }

    /// Uniform integer in [0, n) without modulo bias (Lemire's method). Panics if `n == 0`.
    pub fn gen_range(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::gen_range needs a non-empty range");
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// The full generator state, for checkpoints.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// Restores a generator from [`Rng::state`]. The all-zero state (which `state()` never
    /// returns, and on which xoshiro would be stuck) is replaced by `Rng::new(0)`.
    pub fn from_state(state: [u64; 4]) -> Rng {
        if state == [0; 4] {
            return Rng::new(0);
        }
        Rng { s: state }
    }
}

/// Σ x in a fixed lane order: 8 interleaved partial sums combined pairwise. Vectorises, and gives
/// the same bits on every run (it never depends on threads).
#[inline]
pub fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    for (l, v) in chunks.remainder().iter().enumerate() {
        acc[l] += v;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Σ a·b in the same fixed lane order as [`sum_f32`].
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 length mismatch");
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// max x (NaN-propagating is not guaranteed; callers feed finite values or check afterwards).
#[inline]
pub fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] = acc[l].max(c[l]);
        }
    }
    for (l, v) in chunks.remainder().iter().enumerate() {
        acc[l] = acc[l].max(*v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v))
}

/// Rows summed into one partial in [`reduce_rows`]: at least this many, and enough that there are
/// at most [`REDUCE_PARTIALS_MAX`] partials. Depends only on the row count, never on threads.
const REDUCE_ROWS_MIN: usize = 16;
const REDUCE_PARTIALS_MAX: usize = 64;

/// dst[j] += Σ_r row_r[j], where `row_fn(r, partial)` adds row r's contribution into `partial`
/// (length `dst.len()`). Rows are split into fixed-size chunks (a function of `n` only); chunks
/// are computed in parallel and their partial sums added to `dst` in chunk order, so the result
/// is bit-identical for any thread count.
pub fn reduce_rows(dst: &mut [f32], n: usize, row_fn: impl Fn(usize, &mut [f32]) + Sync) {
    let width = dst.len();
    if n == 0 || width == 0 {
        return;
    }
    let rows_per = REDUCE_ROWS_MIN.max(n.div_ceil(REDUCE_PARTIALS_MAX));
    let n_chunks = n.div_ceil(rows_per);
    let mut partials = vec![0f32; n_chunks * width];
    partials.par_chunks_mut(width).enumerate().for_each(|(ci, p)| {
        (ci * rows_per..((ci + 1) * rows_per).min(n)).for_each(|r| row_fn(r, p));
    });
    for p in partials.chunks_exact(width) {
        dst.iter_mut().zip(p).for_each(|(d, v)| *d += v);
    }
}

/// Whether this CPU runs AVX-512F (detected once, then a cached load).
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args) -> ret` that runs the `#[inline(always)]` function `$body` compiled
/// with AVX-512F when the CPU has it, else for the baseline target. Only the vector width
/// changes: Rust never contracts `a*b + c` into an FMA or reassociates, so every lane executes
/// the same IEEE operations and both paths give identical bits.
#[macro_export]
macro_rules! simd_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:path) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if $crate::tensor::has_avx512() {
                #[target_feature(enable = "avx512f")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                // SAFETY: `wide` only needs AVX-512F, which the CPU was just found to have.
                return unsafe { wide($($arg),*) };
            }
            $body($($arg),*)
        }
    };
}
pub use simd_dispatch;

/// Columns per task in [`reduce_cols`] (a multiple of every vector width).
const REDUCE_COLS_BLOCK: usize = 64;

/// dst[j] += Σ_r row_r[j] for r = 0, 1, …, n−1 in that order, where `row_fn(r, j0, acc)` adds
/// row r's values of columns `j0..j0 + acc.len()` into `acc`. Blocks of [`REDUCE_COLS_BLOCK`]
/// columns are independent parallel tasks that each sum every row into a zeroed local
/// accumulator and then add it to `dst`, so the result is bit-identical for any thread count,
/// and nothing is allocated.
pub fn reduce_cols(dst: &mut [f32], n: usize, row_fn: impl Fn(usize, usize, &mut [f32]) + Sync) {
    dst.par_chunks_mut(REDUCE_COLS_BLOCK).enumerate().for_each(|(bi, d)| {
        let mut acc = [0f32; REDUCE_COLS_BLOCK];
        let acc = &mut acc[..d.len()];
        (0..n).for_each(|r| row_fn(r, bi * REDUCE_COLS_BLOCK, acc));
        add_assign(d, acc);
    });
}

#[inline(always)]
fn add_assign_body(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}

simd_dispatch!(
    /// dst[i] += src[i] over the common length.
    pub fn add_assign(dst: &mut [f32], src: &[f32]) => add_assign_body
);

/// e^x in f32 with ≲2 ulp error, branch-free so loops over it vectorise. Inputs below −87.33
/// give 0, inputs above 88.37 saturate at e^88.37 (≈2.5e38), NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125: ln 2 split (Cody–Waite)
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 − LN2_HI
    const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5·2^23
    let xc = x.clamp(-87.33, 88.37);
    // Adding 1.5·2^23 rounds to an integer n held in the low mantissa bits (RNE).
    let kf = xc * LOG2E + ROUND_MAGIC;
    let n = kf - ROUND_MAGIC; // n ∈ [−126, 127]
    let r = (xc - n * LN2_HI) - n * LN2_LO; // |r| ≤ ln2/2
                                            // e^r by its degree-7 Taylor polynomial (truncation error < 1e-8 on |r| ≤ 0.35).
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n from the integer bits directly (integer ops vectorise; float→int casts would not).
    let n_bits = kf.to_bits().wrapping_sub(ROUND_MAGIC.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let y = p * scale;
    if x < -87.33 {
        0.0
    } else {
        y
    }
}

/// tanh(x) = 1 − 2/(e^{2x} + 1) via [`exp_f32`]; absolute error ≲ 1e-7, exact ±1 saturation.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    1.0 - 2.0 / (exp_f32(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_shapes() {
        let t = Tensor::zeros(&[2, 3]);
        assert_eq!(t.numel(), 6);
        assert!(Tensor::from_vec(&[2, 2], vec![1.0; 4]).is_ok());
        let err = Tensor::from_vec(&[2, 2], vec![1.0; 3]).unwrap_err();
        assert!(err.to_string().contains("[2, 2]"), "{err}");
        let mut rng = Rng::new(1);
        assert_eq!(Tensor::randn(&[3, 5], 1.0, &mut rng).numel(), 15);
    }

    #[test]
    fn rng_is_reproducible_and_keyed() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let xs: Vec<u64> = (0..10).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..10).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(Rng::new(42).next_u64(), Rng::new(43).next_u64());
        let k = |key: &[u64]| Rng::derive(5, key).next_u64();
        let outs = [k(&[]), k(&[0]), k(&[1, 2]), k(&[2, 1]), k(&[1, 2, 0])];
        for i in 0..outs.len() {
            for j in i + 1..outs.len() {
                assert_ne!(outs[i], outs[j], "keys {i} and {j} collide");
            }
        }
        assert_eq!(k(&[1, 2]), Rng::derive(5, &[1, 2]).next_u64());
        assert_ne!(Rng::derive(6, &[1, 2]).next_u64(), k(&[1, 2]));
    }

    #[test]
    fn rng_state_roundtrip() {
        let mut a = Rng::derive(9, &[3, 4]);
        a.next_u64();
        let mut b = Rng::from_state(a.state());
        assert_eq!(a.next_u64(), b.next_u64());
        assert_eq!(Rng::from_state([0; 4]), Rng::new(0));
    }

    #[test]
    fn rng_distributions() {
        let mut rng = Rng::new(3);
        let n = 20_000;
        let u: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        assert!(u.iter().all(|v| (0.0..1.0).contains(v)));
        let mean_u = u.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        assert!((mean_u - 0.5).abs() < 0.01, "{mean_u}");
        let mut z = vec![0f32; n + 1];
        rng.fill_normal(&mut z, 2.0);
        let mean = z.iter().map(|&v| v as f64).sum::<f64>() / z.len() as f64;
        let var = z.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / z.len() as f64;
        assert!(mean.abs() < 0.05 && (var - 4.0).abs() < 0.15, "{mean} {var}");
        let mut counts = [0usize; 7];
        for _ in 0..7000 {
            counts[rng.gen_range(7) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "{counts:?}");
        let zs: Vec<f32> = (0..1000).map(|_| rng.normal()).collect();
        assert!(zs.iter().all(|v| v.is_finite()) && zs.iter().any(|&v| v < -1.0));
    }

    #[test]
    fn lane_sums_match_f64() {
        let mut rng = Rng::new(11);
        let mut x = vec![0f32; 1003];
        let mut y = vec![0f32; 1003];
        rng.fill_normal(&mut x, 1.0);
        rng.fill_normal(&mut y, 1.0);
        let s: f64 = x.iter().map(|&v| v as f64).sum();
        let d: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!((sum_f32(&x) as f64 - s).abs() < 1e-3);
        assert!((dot_f32(&x, &y) as f64 - d).abs() < 1e-3);
        let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max_f32(&x), m);
        assert_eq!(sum_f32(&[]), 0.0);
    }

    #[test]
    fn reduce_rows_sums_columns_deterministically() {
        let (n, c) = (1000, 7);
        let mut rng = Rng::new(2);
        let mut m = vec![0f32; n * c];
        rng.fill_normal(&mut m, 1.0);
        let run = || {
            let mut dst = vec![1.0f32; c];
            reduce_rows(&mut dst, n, |r, p| p.iter_mut().zip(&m[r * c..(r + 1) * c]).for_each(|(a, b)| *a += b));
            dst
        };
        let a = run();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let b = pool.install(run);
        assert_eq!(a, b);
        for j in 0..c {
            let s: f64 = (0..n).map(|r| m[r * c + j] as f64).sum::<f64>() + 1.0;
            assert!((a[j] as f64 - s).abs() < 1e-3, "{j}: {} vs {s}", a[j]);
        }
    }

    #[test]
    fn reduce_cols_sums_rows_in_order_for_any_thread_count() {
        let (n, c) = (300, 150); // 150 columns: two full blocks and a partial one
        let mut rng = Rng::new(8);
        let mut m = vec![0f32; n * c];
        rng.fill_normal(&mut m, 1.0);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut dst = vec![0.5f32; c];
                reduce_cols(&mut dst, n, |r, j0, acc| add_assign(acc, &m[r * c + j0..][..acc.len()]));
                dst
            })
        };
        let a = run(1);
        for threads in [2, 3] {
            assert_eq!(run(threads), a, "threads={threads}");
        }
        for j in 0..c {
            // The same order by hand: rows summed from zero, then added to dst.
            let col: f32 = (0..n).fold(0.0, |s, r| s + m[r * c + j]);
            assert_eq!(a[j].to_bits(), (0.5 + col).to_bits(), "column {j}");
        }
    }

    #[test]
    fn add_assign_matches_scalar_bits() {
        let mut rng = Rng::new(12);
        let (mut x, mut y) = (vec![0f32; 1001], vec![0f32; 1001]);
        rng.fill_normal(&mut x, 1.0);
        rng.fill_normal(&mut y, 1e-3);
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        add_assign(&mut x, &y);
        assert_eq!(x, want);
    }

    #[test]
    fn exp_and_tanh_are_accurate() {
        let mut worst = 0f64;
        for i in 0..=20_000 {
            let x = -87.0 + i as f64 * (175.0 / 20_000.0);
            let x = x.min(88.3) as f32;
            let want = (x as f64).exp();
            worst = worst.max(((exp_f32(x) as f64) - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(1000.0).is_finite());
        for i in -400..=400 {
            let x = i as f32 * 0.025;
            assert!((tanh_f32(x) as f64 - (x as f64).tanh()).abs() < 2e-7, "{x}");
        }
        assert_eq!(tanh_f32(30.0), 1.0);
        assert_eq!(tanh_f32(-30.0), -1.0);
    }
}
