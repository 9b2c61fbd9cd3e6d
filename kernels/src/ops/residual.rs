//! Residual connection: out = a + b, and its backward (the gradient flows to both branches).

use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// out = a + b   elementwise (all shapes equal).
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(out.len() == a.len() && b.len() == a.len(), "residual_forward: out, a and b differ in length");
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(|(o, (a, b))| {
        o.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (a, b))| *o = a + b);
    });
}

/// da += dout,  db += dout
pub fn residual_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    assert!(da.len() == dout.len() && db.len() == dout.len(), "residual_backward: da, db and dout differ in length");
    da.par_chunks_mut(CHUNK).zip(db.par_chunks_mut(CHUNK)).zip(dout.par_chunks(CHUNK)).for_each(|((da, db), d)| {
        for ((a, b), d) in da.iter_mut().zip(db.iter_mut()).zip(d) {
            *a += d;
            *b += d;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn forward_and_backward() {
        let mut out = vec![0f32; 2];
        residual_forward(&mut out, &[1.0, 2.0], &[0.5, -4.0]);
        assert_eq!(out, vec![1.5, -2.0]);
        let (a, b, w) = (randn(1, 30, 1.0), randn(2, 30, 1.0), randn(3, 30, 1.0));
        let (mut da, mut db) = (vec![0f32; 30], vec![1f32; 30]);
        residual_backward(&mut da, &mut db, &w);
        let loss = |a: &[f32], b: &[f32]| {
            let mut out = vec![0f32; 30];
            residual_forward(&mut out, a, b);
            weighted_sum(&out, &w)
        };
        check_grad(|x| loss(x, &b), &a, &da, 1e-2, 1e-3).unwrap();
        let db0: Vec<f32> = db.iter().map(|v| v - 1.0).collect();
        check_grad(|x| loss(&a, x), &b, &db0, 1e-2, 1e-3).unwrap();
    }
}
