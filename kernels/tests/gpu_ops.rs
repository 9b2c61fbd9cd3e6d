//! GPU kernels of `cuda::ops` against the CPU ops (skips without a GPU), and the host-side
//! token index of the deterministic embedding backward (always runs).

use tessera_kernels::cuda::ops::{self, TokenIndex};
use tessera_kernels::cuda::Gpu;

#[test]
fn gpu_ops_match_cpu() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("GPU: {} ({})", gpu.name, gpu.arch());
    let rows = ops::check(&gpu, 1234).unwrap_or_else(|e| panic!("{e}"));
    for r in &rows {
        println!("{r}");
    }
    let failed: Vec<&str> = rows.iter().filter(|r| !r.pass()).map(|r| r.name.as_str()).collect();
    assert!(failed.is_empty(), "GPU ops differ from the CPU: {failed:?}");
    assert!(rows.len() >= 28, "expected a row per output tensor, got {}", rows.len());
}

#[test]
fn token_index_groups_positions_by_id() {
    let tokens = [5u32, 2, 5, 0, 2, 5, 9];
    let idx = TokenIndex::new(&tokens, 10);
    assert_eq!(idx.uniq, vec![0, 2, 5, 9]);
    assert_eq!(idx.offsets, vec![0, 1, 3, 6, 7]);
    assert_eq!(idx.positions, vec![3, 1, 4, 0, 2, 5, 6]);
}

#[test]
fn token_index_is_a_permutation_in_ascending_order() {
    let vocab = 97usize;
    let tokens: Vec<u32> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab as u32 % 13).collect();
    let idx = TokenIndex::new(&tokens, vocab);
    assert_eq!(idx.offsets.len(), idx.uniq.len() + 1);
    assert_eq!(*idx.offsets.last().unwrap() as usize, tokens.len());
    assert!(idx.uniq.windows(2).all(|w| w[0] < w[1]), "uniq ascending");
    let mut seen = vec![false; tokens.len()];
    for (u, &tok) in idx.uniq.iter().enumerate() {
        let ps = &idx.positions[idx.offsets[u] as usize..idx.offsets[u + 1] as usize];
        assert!(!ps.is_empty(), "token {tok} listed without positions");
        assert!(ps.windows(2).all(|w| w[0] < w[1]), "positions of {tok} ascending");
        for &p in ps {
            assert_eq!(tokens[p as usize], tok);
            assert!(!seen[p as usize], "position {p} listed twice");
            seen[p as usize] = true;
        }
    }
    assert!(seen.iter().all(|&s| s), "every position listed");
}

#[test]
fn token_index_of_nothing_is_empty() {
    let idx = TokenIndex::new(&[], 10);
    assert!(idx.uniq.is_empty() && idx.positions.is_empty());
    assert_eq!(idx.offsets, vec![0]);
}

#[test]
#[should_panic(expected = "outside the vocabulary")]
fn token_index_rejects_bad_ids() {
    TokenIndex::new(&[1, 10], 10);
}

#[test]
fn colsum_blocking_fits_the_grid() {
    for n in [0usize, 1, 31, 32, 33, 4096, 1 << 20, 1 << 24] {
        let (per, nb) = (ops::colsum_rows_per(n), ops::colsum_blocks(n));
        assert!(per >= 32 && nb <= 4096 && nb * per >= n, "n={n}: {per} rows × {nb} blocks");
        assert_eq!(ops::layernorm_backward_scratch(n, 768), 2 * nb * 768);
        assert_eq!(ops::bias_grad_scratch(n, 3072), nb * 3072);
    }
}

/// Rough timings of the kernels at GPT-2 small sizes (run with `--ignored --nocapture` on a GPU).
#[test]
#[ignore]
fn gpu_ops_timing() {
    use tessera_kernels::cuda::bf16;
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let s = &gpu.stream;
    let (n, c, f) = (4096usize, 768usize, 3072usize);
    let time = |name: &str, bytes: usize, run: &mut dyn FnMut()| {
        run();
        gpu.sync().unwrap();
        let iters = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            run();
        }
        gpu.sync().unwrap();
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        println!("{name:<32} {us:>9.1} us  {:>7.0} GB/s", bytes as f64 / us / 1e3);
    };
    let x = gpu.alloc::<f32>(n * c).unwrap();
    let xb = gpu.alloc::<bf16>(n * c).unwrap();
    let wc = gpu.upload(&vec![bf16::ONE; c]).unwrap();
    let (mean, rstd) = (gpu.alloc::<f32>(n).unwrap(), gpu.alloc::<f32>(n).unwrap());
    let (dw, db) = (gpu.alloc::<f32>(c).unwrap(), gpu.alloc::<f32>(c).unwrap());
    let dx = gpu.alloc::<f32>(n * c).unwrap();
    let scratch = gpu.alloc::<f32>(ops::layernorm_backward_scratch(n, c).max(ops::bias_grad_scratch(n, f))).unwrap();
    ops::layernorm_forward(&gpu, s, xb.ptr(), mean.ptr(), rstd.ptr(), x.ptr(), wc.ptr(), wc.ptr(), n, c).unwrap();
    time("layernorm_forward", n * c * 6, &mut || {
        ops::layernorm_forward(&gpu, s, xb.ptr(), mean.ptr(), rstd.ptr(), x.ptr(), wc.ptr(), wc.ptr(), n, c).unwrap()
    });
    time("layernorm_backward", n * c * 18, &mut || {
        let a = ops::LnBackward {
            dx: dx.ptr(),
            dx_bf16: None,
            dx_bf16_sums: None,
            dw: dw.ptr(),
            db: db.ptr(),
            dout: xb.ptr(),
            x: x.ptr(),
            w: wc.ptr(),
            mean: mean.ptr(),
            rstd: rstd.ptr(),
            scratch: scratch.ptr(),
            n,
            c,
        };
        ops::layernorm_backward(&gpu, s, &a).unwrap()
    });
    let h = gpu.alloc::<bf16>(n * f).unwrap();
    let h2 = gpu.alloc::<bf16>(n * f).unwrap();
    let bf = gpu.upload(&vec![bf16::ZERO; f]).unwrap();
    let dbf = gpu.alloc::<f32>(f).unwrap();
    time("bias_gelu_forward", n * f * 6, &mut || ops::bias_gelu_forward(&gpu, s, h.ptr(), h2.ptr(), bf.ptr(), n, f).unwrap());
    time("gelu_backward", n * f * 6, &mut || ops::gelu_backward(&gpu, s, h2.ptr(), h2.ptr(), h.ptr(), n * f).unwrap());
    time("bias_grad [n×f]", n * f * 2, &mut || ops::bias_grad(&gpu, s, dbf.ptr(), h.ptr(), scratch.ptr(), n, f).unwrap());
    time("residual_bias_add", n * c * 10, &mut || ops::residual_bias_add(&gpu, s, x.ptr(), x.ptr(), xb.ptr(), wc.ptr(), n, c).unwrap());
    let (nv, v, vp) = (512usize, 50257usize, 50304usize);
    let logits = gpu.alloc::<bf16>(nv * vp).unwrap();
    let tg = gpu.alloc::<u32>(nv).unwrap();
    let losses = gpu.alloc::<f32>(nv).unwrap();
    time("crossentropy (fwd+bwd)", nv * vp * 4, &mut || {
        ops::crossentropy(&gpu, s, losses.ptr(), logits.ptr(), tg.ptr(), nv, v, vp, 1.0 / nv as f32).unwrap()
    });
    let len = 124_475_904usize;
    let (master, grad, m, vv) =
        (gpu.alloc::<f32>(len).unwrap(), gpu.alloc::<f32>(len).unwrap(), gpu.alloc::<f32>(len).unwrap(), gpu.alloc::<f32>(len).unwrap());
    let param = gpu.alloc::<bf16>(len).unwrap();
    let mask = gpu.upload(&vec![1u8; len]).unwrap();
    let hp = ops::AdamStep::new(6e-4, (0.9, 0.95), 1e-8, 0.1, 1);
    time("adamw [124M]", len * 27, &mut || {
        let bufs =
            ops::OptimBufs { master: master.ptr(), param: param.ptr(), grad: grad.ptr(), m: m.ptr(), v: vv.ptr(), decay: mask.ptr() };
        ops::adamw(&gpu, s, &bufs, &hp, 1.0).unwrap()
    });
    let blocks = len.div_ceil(16384);
    let sq = gpu.alloc::<f64>(blocks).unwrap();
    time("sum_squares_blocks [124M]", len * 4, &mut || ops::sum_squares_blocks(&gpu, s, sq.ptr(), grad.ptr(), 16384).unwrap());
    time("add_f32 [124M]", len * 12, &mut || ops::add_f32(&gpu, s, grad.ptr(), m.ptr()).unwrap());
    let (b, t) = (4usize, 1024usize);
    let wte = gpu.alloc::<bf16>(50257 * c).unwrap();
    let toks = gpu.alloc::<u32>(b * t).unwrap();
    time("embedding_forward", b * t * c * 8, &mut || {
        ops::embedding_forward(&gpu, s, x.ptr(), toks.ptr(), wte.ptr(), wte.slice(0..t * c), b, t, c).unwrap()
    });
}
