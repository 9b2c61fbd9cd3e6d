//! Dense f32 matrix multiply over row-major slices (and strided views), backed by the `gemm`
//! crate, plus a measurement of this machine's f32 GEMM peak used as the benchmark's yardstick.
//!
//! Determinism: the `gemm` crate splits work across threads by output tiles only; every output
//! element is reduced over k in the same order whatever the thread count (tested below).
// Allowed: `matmul` keeps BLAS's argument list (out, a, b, m, k, n, transposes, beta), the one
// every GEMM reader knows.
#![allow(clippy::too_many_arguments)]

use std::time::Instant;

use gemm::Parallelism;

use crate::tensor::Rng;

/// Problems with fewer multiply-adds than this run single-threaded.
const PAR_MIN_MACS: usize = 1 << 18;

/// A read-only strided matrix view: element (i, j) is `data[i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// Panics unless every element (i, j) lies inside `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < data.len(),
            "MatRef {rows}x{cols} (rs {rs}, cs {cs}) overruns a slice of {}",
            data.len()
        );
        MatRef { data, rows, cols, rs, cs }
    }

    /// A row-major `rows × cols` view of a contiguous slice.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// Rows `r0..r1` of this view (no copy). Panics if the range is out of bounds.
    pub fn rows(self, r0: usize, r1: usize) -> Self {
        assert!(r0 <= r1 && r1 <= self.rows, "MatRef rows {r0}..{r1} of {}", self.rows);
        let data = if r0 == r1 || self.cols == 0 { &self.data[..0] } else { &self.data[r0 * self.rs..] };
        MatRef { data, rows: r1 - r0, ..self }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }
}

/// A mutable strided matrix view. One of the strides must be 1 and the other at least the
/// extent it steps over, so distinct elements never share memory.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatMut<'a> {
    /// Panics unless the view is in bounds and non-self-overlapping.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        let empty = rows == 0 || cols == 0;
        assert!(
            empty || (rows - 1) * rs + (cols - 1) * cs < data.len(),
            "MatMut {rows}x{cols} (rs {rs}, cs {cs}) overruns a slice of {}",
            data.len()
        );
        let row_major = cs == 1 && (rows <= 1 || rs >= cols);
        let col_major = rs == 1 && (cols <= 1 || cs >= rows);
        assert!(empty || row_major || col_major, "MatMut {rows}x{cols} strides ({rs}, {cs}) would alias elements");
        MatMut { data, rows, cols, rs, cs }
    }

    /// A row-major `rows × cols` view of a contiguous slice.
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }
}

/// dst = beta·dst + alpha·(a·b) on strided views; `beta == 0` overwrites (dst may hold NaN).
/// `parallel` lets the `gemm` crate use the current rayon pool; pass `false` inside a parallel
/// loop. Panics on shape mismatch.
pub fn gemm_strided(dst: MatMut, a: MatRef, b: MatRef, beta: f32, alpha: f32, parallel: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(b.rows == k && dst.rows == m && dst.cols == n, "gemm shapes: dst {}x{}, a {m}x{k}, b {}x{n}", dst.rows, dst.cols, b.rows);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let d = &mut dst.data[i * dst.rs + j * dst.cs];
                *d = if beta == 0.0 { 0.0 } else { beta * *d };
            }
        }
        return;
    }
    let par = if parallel && m * n * k >= PAR_MIN_MACS { Parallelism::Rayon(rayon::current_num_threads()) } else { Parallelism::None };
    // SAFETY: MatRef/MatMut::new checked that every addressed element lies inside its slice and
    // that dst's elements are pairwise distinct; dst is a unique borrow, so it aliases neither
    // input. The gemm crate computes dst := alpha'·dst + beta'·lhs·rhs (its names are swapped
    // relative to ours) and reads dst only when read_dst is true.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            dst.cs as isize,
            dst.rs as isize,
            beta != 0.0,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            beta,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// out[m×n] = beta*out + a·b where a is [m×k] (or stored [k×m] if trans_a) and b is [k×n]
/// (or stored [n×k] if trans_b); beta is 0.0 (overwrite) or 1.0 (accumulate).
/// Large problems use all threads of the current rayon pool. Panics if a slice length differs
/// from its shape.
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, trans_a: bool, trans_b: bool, beta: f32) {
    assert_eq!(out.len(), m * n, "matmul: out must be {m}x{n}");
    assert_eq!(a.len(), m * k, "matmul: a must hold {m}x{k}");
    assert_eq!(b.len(), k * n, "matmul: b must hold {k}x{n}");
    let av = if trans_a { MatRef::row_major(a, k, m).t() } else { MatRef::row_major(a, m, k) };
    let bv = if trans_b { MatRef::row_major(b, n, k).t() } else { MatRef::row_major(b, k, n) };
    gemm_strided(MatMut::row_major(out, m, n), av, bv, beta, 1.0, true);
}

/// Measured f32 GEMM throughput (FLOP/s, 2·n³ per product) of [`matmul`] on an n×n×n problem:
/// one warm-up, then the best of `reps` timed runs.
pub fn gemm_peak_flops(n: usize, reps: usize) -> f64 {
    let mut rng = Rng::new(0x7065_616b);
    let mut a = vec![0f32; n * n];
    let mut b = vec![0f32; n * n];
    rng.fill_normal(&mut a, 1.0);
    rng.fill_normal(&mut b, 1.0);
    let mut out = vec![0f32; n * n];
    matmul(&mut out, &a, &b, n, n, n, false, false, 0.0);
    let mut best_s = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        matmul(&mut out, &a, &b, n, n, n, false, false, 0.0);
        best_s = best_s.min(t0.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best_s.max(1e-12)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| {
                        let x = if ta { a[p * m + i] } else { a[i * k + p] };
                        let y = if tb { b[j * k + p] } else { b[p * n + j] };
                        x as f64 * y as f64
                    })
                    .sum();
            }
        }
        out
    }

    fn randv(rng: &mut Rng, len: usize) -> Vec<f32> {
        let mut v = vec![0f32; len];
        rng.fill_normal(&mut v, 1.0);
        v
    }

    #[test]
    fn matmul_matches_naive_all_transposes() {
        let mut rng = Rng::new(1);
        for &(m, k, n) in &[(3, 5, 4), (17, 33, 9), (1, 8, 6), (70, 65, 80)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = randv(&mut rng, m * k);
                let b = randv(&mut rng, k * n);
                let want = naive(&a, &b, m, k, n, ta, tb);
                let mut out = vec![f32::NAN; m * n];
                matmul(&mut out, &a, &b, m, k, n, ta, tb, 0.0);
                let mut acc = vec![1.0f32; m * n];
                matmul(&mut acc, &a, &b, m, k, n, ta, tb, 1.0);
                for i in 0..m * n {
                    assert!((out[i] as f64 - want[i]).abs() < 1e-4 * (k as f64), "{m} {k} {n}");
                    assert!((acc[i] as f64 - want[i] - 1.0).abs() < 1e-4 * (k as f64));
                }
            }
        }
    }

    #[test]
    fn k_zero_scales_or_clears() {
        let mut out = vec![f32::NAN; 6];
        matmul(&mut out, &[], &[], 2, 0, 3, false, false, 0.0);
        assert_eq!(out, vec![0.0; 6]);
        let mut acc = vec![2.0f32; 6];
        matmul(&mut acc, &[], &[], 2, 0, 3, false, false, 1.0);
        assert_eq!(acc, vec![2.0; 6]);
    }

    #[test]
    fn strided_views_and_alpha() {
        let mut rng = Rng::new(4);
        // a is the middle 3 columns of a 4×7 buffer.
        let buf = randv(&mut rng, 28);
        let b = randv(&mut rng, 3 * 2);
        let mut out = vec![0f32; 4 * 2];
        let av = MatRef::new(&buf[2..], 4, 3, 7, 1);
        gemm_strided(MatMut::row_major(&mut out, 4, 2), av, MatRef::row_major(&b, 3, 2), 0.0, 0.5, false);
        for i in 0..4 {
            for j in 0..2 {
                let want: f32 = (0..3).map(|p| buf[2 + i * 7 + p] * b[p * 2 + j]).sum::<f32>() * 0.5;
                assert!((out[i * 2 + j] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    #[should_panic(expected = "alias")]
    fn aliasing_dst_is_rejected() {
        let mut buf = vec![0f32; 16];
        let _ = MatMut::new(&mut buf, 4, 4, 2, 1);
    }

    #[test]
    fn matmul_is_bitwise_deterministic_across_thread_counts() {
        let mut rng = Rng::new(9);
        for &(m, k, n) in &[(256, 384, 200), (130, 1000, 300), (513, 96, 257)] {
            let a = randv(&mut rng, m * k);
            let b = randv(&mut rng, k * n);
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        let mut out = vec![0f32; m * n];
                        matmul(&mut out, &a, &b, m, k, n, ta, tb, 0.0);
                        out
                    })
                };
                let serial = {
                    let mut out = vec![0f32; m * n];
                    let av = if ta { MatRef::row_major(&a, k, m).t() } else { MatRef::row_major(&a, m, k) };
                    let bv = if tb { MatRef::row_major(&b, n, k).t() } else { MatRef::row_major(&b, k, n) };
                    gemm_strided(MatMut::row_major(&mut out, m, n), av, bv, 0.0, 1.0, false);
                    out
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for threads in [1, 2, 3, 4] {
                    assert_eq!(bits(&run(threads)), bits(&serial), "{m}x{k}x{n} t={threads}");
                }
                assert_eq!(bits(&run(2)), bits(&run(2)));
            }
        }
    }

    #[test]
    fn peak_flops_is_positive() {
        // A measurement, not a speed bound: only that it produced a rate.
        let f = gemm_peak_flops(64, 2);
        assert!(f.is_finite() && f > 0.0, "{f}");
    }
}
