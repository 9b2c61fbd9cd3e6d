//! Token (+ learned position) embedding lookup and its deterministic scatter-add backward.

use rayon::prelude::*;

/// Rows of `wte` per rayon task in the backward scatter (most rows get few or no tokens).
const ROWS_PER_TASK: usize = 64;

fn check_tokens(tokens: &[u32], vocab: usize) {
    if let Some(bad) = tokens.iter().find(|&&tok| tok as usize >= vocab) {
        panic!("embedding: token id {bad} is outside the vocabulary of {vocab}");
    }
}

/// out[bt, :] = wte[tokens[bt], :] + wpe[bt mod T, :]   (wpe absent for LLaMA)
/// Shapes: out [B·T, C], tokens [B·T], wte [V, C], wpe [maxT ≥ T, C].
/// Panics if a token id is ≥ V (loaders validate ids first).
pub fn embedding_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: Option<&[f32]>, b: usize, t: usize, c: usize) {
    assert_eq!(tokens.len(), b * t, "embedding_forward: tokens must be [B*T]");
    embedding_forward_at(out, tokens, |bt| bt % t, wte, wpe, c);
}

/// out[r, :] = wte[tokens[r], :] + wpe[pos(r), :]: [`embedding_forward`] with each row's
/// position given (rows of several sequences at their own offsets, as a decoding step has).
/// Panics if a token id is ≥ V or a position is past `wpe`'s rows.
pub fn embedding_forward_at(
    out: &mut [f32],
    tokens: &[u32],
    pos: impl Fn(usize) -> usize + Sync,
    wte: &[f32],
    wpe: Option<&[f32]>,
    c: usize,
) {
    assert_eq!(out.len(), tokens.len() * c, "embedding_forward: out must be [N, C]");
    assert!(c > 0 && wte.len() % c == 0, "embedding_forward: wte must be [V, C]");
    check_tokens(tokens, wte.len() / c);
    out.par_chunks_mut(c).zip(tokens.par_iter()).enumerate().for_each(|(r, (o, &tok))| {
        let e = &wte[tok as usize * c..][..c];
        match wpe {
            Some(wpe) => {
                let p = wpe.get(pos(r) * c..(pos(r) + 1) * c).expect("embedding_forward: a position past wpe's rows");
                o.iter_mut().zip(e.iter().zip(p)).for_each(|(o, (e, p))| *o = e + p);
            }
            None => o.copy_from_slice(e),
        }
    });
}

/// dwte[v, :] += Σ_{bt: tokens[bt]=v} dout[bt, :];  dwpe[t, :] += Σ_b dout[b, t, :]
/// Deterministic: the occurrences of each token are summed in increasing bt order (a counting
/// sort groups them), and rows of dwte / dwpe are independent parallel tasks.
pub fn embedding_backward(dwte: &mut [f32], dwpe: Option<&mut [f32]>, dout: &[f32], tokens: &[u32], b: usize, t: usize, c: usize) {
    assert_eq!(dout.len(), b * t * c, "embedding_backward: dout must be [B*T, C]");
    assert_eq!(tokens.len(), b * t, "embedding_backward: tokens must be [B*T]");
    assert!(c > 0 && dwte.len() % c == 0, "embedding_backward: dwte must be [V, C]");
    let vocab = dwte.len() / c;
    check_tokens(tokens, vocab);
    // Counting sort: order[start[v]..start[v+1]] lists the bt with tokens[bt] == v, ascending.
    let mut start = vec![0usize; vocab + 1];
    tokens.iter().for_each(|&tok| start[tok as usize + 1] += 1);
    (0..vocab).for_each(|v| start[v + 1] += start[v]);
    let mut fill = start.clone();
    let mut order = vec![0usize; tokens.len()];
    for (bt, &tok) in tokens.iter().enumerate() {
        order[fill[tok as usize]] = bt;
        fill[tok as usize] += 1;
    }
    dwte.par_chunks_mut(c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(v, row)| {
        for &bt in &order[start[v]..start[v + 1]] {
            let d = &dout[bt * c..][..c];
            row.iter_mut().zip(d).for_each(|(r, d)| *r += d);
        }
    });
    if let Some(dwpe) = dwpe {
        assert!(dwpe.len() >= t * c, "embedding_backward: dwpe has fewer than T rows");
        dwpe[..t * c].par_chunks_mut(c).enumerate().for_each(|(tt, row)| {
            for bb in 0..b {
                let d = &dout[(bb * t + tt) * c..][..c];
                row.iter_mut().zip(d).for_each(|(r, d)| *r += d);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn forward_looks_up_rows() {
        let wte = vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]; // V=3, C=2
        let wpe = vec![0.5, 0.25, 100.0, 200.0]; // maxT=2
        let mut out = vec![0f32; 8];
        embedding_forward(&mut out, &[2, 0, 1, 1], &wte, Some(&wpe), 2, 2, 2);
        assert_eq!(out, vec![20.5, 21.25, 100.0, 201.0, 10.5, 11.25, 110.0, 211.0]);
        let mut out = vec![0f32; 4];
        embedding_forward(&mut out, &[1, 2], &wte, None, 1, 2, 2);
        assert_eq!(out, vec![10.0, 11.0, 20.0, 21.0]);
    }

    #[test]
    #[should_panic(expected = "outside the vocabulary")]
    fn bad_token_panics_with_context() {
        let mut out = vec![0f32; 2];
        embedding_forward(&mut out, &[3], &[0.0; 6], None, 1, 1, 2);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, v) = (2, 3, 4, 5);
        let tokens = [1u32, 4, 1, 0, 1, 3];
        let wte = randn(1, v * c, 1.0);
        let wpe = randn(2, t * c, 1.0);
        let w = randn(3, b * t * c, 1.0);
        let mut dwte = vec![0f32; v * c];
        let mut dwpe = vec![0f32; t * c];
        embedding_backward(&mut dwte, Some(&mut dwpe), &w, &tokens, b, t, c);
        let loss = |wte: &[f32], wpe: &[f32]| {
            let mut out = vec![0f32; b * t * c];
            embedding_forward(&mut out, &tokens, wte, Some(wpe), b, t, c);
            weighted_sum(&out, &w)
        };
        check_grad(|x| loss(x, &wpe), &wte, &dwte, 1e-2, 1e-3).unwrap();
        check_grad(|x| loss(&wte, x), &wpe, &dwpe, 1e-2, 1e-3).unwrap();
    }

    #[test]
    fn backward_accumulates_and_is_deterministic() {
        let (b, t, c, v) = (4, 64, 16, 7);
        let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 7919) % v) as u32).collect();
        let dout = randn(5, b * t * c, 1.0);
        // Serial reference in bt order: must agree bit for bit.
        let mut want = vec![1.0f32; v * c];
        for (bt, &tok) in tokens.iter().enumerate() {
            for j in 0..c {
                want[tok as usize * c + j] += dout[bt * c + j];
            }
        }
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| {
                let mut dwte = vec![1.0f32; v * c];
                embedding_backward(&mut dwte, None, &dout, &tokens, b, t, c);
                dwte
            });
            assert_eq!(got, want, "threads={threads}");
        }
    }
}
