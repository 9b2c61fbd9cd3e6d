//! `tessera gpu check`'s rows for the kernels of [`super`]: each kernel against the CPU ops
//! (`crate::ops`, `crate::optim`) on fresh random inputs, and the fused kernels against the
//! separate ones they replace, bit for bit.

use cudarc::driver::CudaStream;

use super::*;
use crate::cuda::CheckRow;
use crate::tensor::Rng;

/// GPT-2 small's sizes: rows (tokens), width, MLP width.
const SIZES: (usize, usize, usize) = (4096, 768, 3072);

const F32_FLOOR: f64 = 1e-3;
const F32_TOL: f64 = 1e-5;
const BF16_FLOOR: f64 = 1e-2;
const BF16_TOL: f64 = 1e-2;

fn randv(seed: u64, key: u64, len: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; len];
    Rng::derive(seed, &[0x006f_7073, key]).fill_normal(&mut v, std);
    v
}

fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn bf_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The CPU f32 reference rounded to bf16 (what a bf16 output can at best be).
fn round_bf(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn row_f32(name: String, gpu: &[f32], cpu: &[f32]) -> CheckRow {
    CheckRow::compare(name, gpu, cpu, F32_FLOOR, F32_TOL)
}

fn row_bf(name: String, gpu: &[bf16], cpu_f32: &[f32]) -> CheckRow {
    CheckRow::compare(name, &bf_to_f32(gpu), &round_bf(cpu_f32), BF16_FLOOR, BF16_TOL)
}

/// dst[j] + Σ_r term(r, j) in the GPU's two-pass order — f32 on the host: row blocks of
/// [`colsum_rows_per`] rows summed ascending from 0; then partial rows ≡ w (mod
/// [`COLSUM_WARPS`]) summed ascending per w, combined ((w0+w1)+(w2+w3))+((w4+w5)+(w6+w7)), added
/// to dst.
fn colsum_blocked_ref(dst: &[f32], n: usize, c: usize, term: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let rows_per = colsum_rows_per(n);
    let nb = colsum_blocks(n);
    let mut partials = vec![0f32; nb * c];
    for rb in 0..nb {
        for r in rb * rows_per..((rb + 1) * rows_per).min(n) {
            for j in 0..c {
                partials[rb * c + j] += term(r, j);
            }
        }
    }
    (0..c)
        .map(|j| {
            let mut w = [0f32; COLSUM_WARPS];
            for (rb, p) in partials.chunks_exact(c).enumerate() {
                w[rb % COLSUM_WARPS] += p[j];
            }
            dst[j] + (((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7])))
        })
        .collect()
}

/// GPU vs CPU on fresh random inputs (`seed`): every kernel above at GPT-2 small sizes (n = 4096
/// rows, c = 768, f = 3072; cross-entropy n = 512, v = 50257, vp = 50304; embedding B=4, T=1024,
/// V=50257 with many repeated tokens). One [`CheckRow`] per output tensor.
///
/// References: the CPU ops in `crate::ops` / `crate::optim` on the same (bf16-valued) inputs.
/// f32 outputs: tol 1e-5 relative with floor 1e-3. bf16 outputs: the CPU's f32 result rounded to
/// bf16, tol 1e-2 with floor 1e-2. Exceptions, each named in its row:
/// * column sums (LayerNorm dweight/dbias, bias_grad): the reference is the same f32 sum in the
///   GPU's documented blocked order (the CPU sums all rows sequentially, whose own rounding error
///   on 4096-row sums exceeds 1e-5 relative for columns that nearly cancel);
/// * LayerNorm backward uses the GPU's saved mean/rstd on both sides (isolates the backward);
/// * cross-entropy gradients (≈1e-5·dscale each) use floor = 1e-2 · max|reference|;
/// * sums of squares are f64 and compared at 1e-12.
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    let mut rng = Rng::derive(seed, &[0x006f_7073]);
    check_embedding(gpu, seed, &mut rng, &mut rows)?;
    check_layernorm(gpu, seed, &mut rows)?;
    check_layernorm_one_pass(gpu, seed, &mut rows)?;
    check_bias_gelu(gpu, seed, &mut rows)?;
    check_residual(gpu, seed, &mut rows)?;
    check_casts(gpu, seed, &mut rows)?;
    check_crossentropy(gpu, seed, &mut rng, &mut rows)?;
    check_sum_squares(gpu, seed, &mut rows)?;
    check_adamw(gpu, seed, &mut rows)?;
    Ok(rows)
}

/// Embedding forward and backward (B=4, T=1024, V=50257, many repeated tokens).
fn check_embedding(gpu: &Gpu, seed: u64, rng: &mut Rng, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let c = SIZES.1;
    let (b, t, vocab) = (4usize, 1024usize, 50257usize);
    let tokens: Vec<u32> = (0..b * t)
        .map(|i| if i % 3 == 0 { rng.gen_range(vocab as u64) as u32 } else { rng.gen_range(40) as u32 * 997 % vocab as u32 })
        .collect();
    let wte = round_bf(&randv(seed, 1, vocab * c, 0.02));
    let wpe = round_bf(&randv(seed, 2, t * c, 0.01));
    let (d_wte, d_wpe, d_tok) = (gpu.upload(&to_bf(&wte))?, gpu.upload(&to_bf(&wpe))?, gpu.upload(&tokens)?);
    let d_x = gpu.alloc::<f32>(b * t * c)?;
    embedding_forward(gpu, s, d_x.ptr(), d_tok.ptr(), d_wte.ptr(), d_wpe.ptr(), b, t, c)?;
    let mut want = vec![0f32; b * t * c];
    crate::ops::embedding::embedding_forward(&mut want, &tokens, &wte, Some(&wpe), b, t, c);
    rows.push(row_f32(format!("embedding_forward x [{}×{c}]", b * t), &gpu.download(d_x.ptr())?, &want));

    let dx = randv(seed, 3, b * t * c, 1.0);
    let dwte0 = randv(seed, 4, vocab * c, 0.1);
    let dwpe0 = randv(seed, 5, t * c, 0.1);
    let idx = TokenIndex::new(&tokens, vocab);
    let (d_dx, d_dwte, d_dwpe) = (gpu.upload(&dx)?, gpu.upload(&dwte0)?, gpu.upload(&dwpe0)?);
    let (d_u, d_o, d_p) = (gpu.upload(&idx.uniq)?, gpu.upload(&idx.offsets)?, gpu.upload(&idx.positions)?);
    embedding_backward(gpu, s, d_dwte.ptr(), d_dwpe.ptr(), d_dx.ptr(), d_u.ptr(), d_o.ptr(), d_p.ptr(), b, t, c)?;
    let (mut dwte, mut dwpe) = (dwte0, dwpe0);
    crate::ops::embedding::embedding_backward(&mut dwte, Some(&mut dwpe), &dx, &tokens, b, t, c);
    rows.push(row_f32(format!("embedding_backward dwte [{vocab}×{c}] ({} uniq)", idx.uniq.len()), &gpu.download(d_dwte.ptr())?, &dwte));
    rows.push(row_f32(format!("embedding_backward dwpe [{t}×{c}]"), &gpu.download(d_dwpe.ptr())?, &dwpe));
    Ok(())
}

/// LayerNorm forward and backward at GPT-2's width, and at 2048 (the wide register path).
fn check_layernorm(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, c, _) = SIZES;
    for (n, c) in [(n, c), (1024usize, 2048usize)] {
        let x: Vec<f32> = randv(seed, 10, n * c, 1.0).iter().map(|v| v + 0.3).collect();
        let w = round_bf(&randv(seed, 11, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>());
        let bias = round_bf(&randv(seed, 12, c, 0.1));
        let (d_x, d_w, d_b) = (gpu.upload(&x)?, gpu.upload(&to_bf(&w))?, gpu.upload(&to_bf(&bias))?);
        let (d_out, d_mean, d_rstd) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?);
        layernorm_forward(gpu, s, d_out.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_w.ptr(), d_b.ptr(), n, c)?;
        let (mut out, mut mean, mut rstd) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        crate::ops::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bias, n, c);
        rows.push(row_bf(format!("layernorm_forward out [{n}×{c}] (bf16)"), &gpu.download(d_out.ptr())?, &out));
        let g_mean = gpu.download(d_mean.ptr())?;
        let g_rstd = gpu.download(d_rstd.ptr())?;
        rows.push(row_f32(format!("layernorm_forward mean [{n}]"), &g_mean, &mean));
        rows.push(row_f32(format!("layernorm_forward rstd [{n}]"), &g_rstd, &rstd));

        let dout = round_bf(&randv(seed, 13, n * c, 1.0));
        let (dx0, dw0, db0) = (randv(seed, 14, n * c, 0.5), randv(seed, 15, c, 0.5), randv(seed, 16, c, 0.5));
        let (d_dout, d_dx, d_dw, d_db) = (gpu.upload(&to_bf(&dout))?, gpu.upload(&dx0)?, gpu.upload(&dw0)?, gpu.upload(&db0)?);
        let d_scratch = gpu.alloc::<f32>(layernorm_backward_scratch(n, c))?;
        let d_dxb = gpu.alloc::<bf16>(n * c)?;
        let a = LnBackward {
            dx: d_dx.ptr(),
            dx_bf16: Some(d_dxb.ptr()),
            dx_bf16_sums: None,
            dw: d_dw.ptr(),
            db: d_db.ptr(),
            dout: d_dout.ptr(),
            x: d_x.ptr(),
            w: d_w.ptr(),
            mean: d_mean.ptr(),
            rstd: d_rstd.ptr(),
            scratch: d_scratch.ptr(),
            n,
            c,
        };
        layernorm_backward(gpu, s, &a)?;
        let (mut dx, mut dw_seq, mut db_seq) = (dx0.clone(), dw0.clone(), db0.clone());
        crate::ops::layernorm::layernorm_backward(&mut dx, &mut dw_seq, &mut db_seq, &dout, &x, &w, &g_mean, &g_rstd, n, c);
        // Row sums run lane-parallel on the GPU (sequential on the CPU): compare relative to the
        // tensor's scale.
        let rms = (dx.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dx.len() as f64).sqrt();
        let g_dx = gpu.download(d_dx.ptr())?;
        rows.push(CheckRow::compare(format!("layernorm_backward dx [{n}×{c}] (+=, rms-relative)"), &g_dx, &dx, rms, F32_TOL));
        rows.push(row_bf(format!("layernorm_backward dx copy [{n}×{c}] (bf16)"), &gpu.download(d_dxb.ptr())?, &g_dx));
        let dw = colsum_blocked_ref(&dw0, n, c, |r, j| dout[r * c + j] * (x[r * c + j] - g_mean[r]) * g_rstd[r]);
        let db = colsum_blocked_ref(&db0, n, c, |r, j| dout[r * c + j]);
        rows.push(row_f32(format!("layernorm_backward dweight [{c}] (+=, blocked-order ref)"), &gpu.download(d_dw.ptr())?, &dw));
        rows.push(row_f32(format!("layernorm_backward dbias [{c}] (+=, blocked-order ref)"), &gpu.download(d_db.ptr())?, &db));
    }
    Ok(())
}

// The one-pass LayerNorm backward gives the separate kernels' bits (dx, its bf16 copy, dweight,
// dbias and the bf16 dx's column sums), at GPT-2's width (also with a ragged last row block)
// and on the wide register path.
// (4133 rows: a last row block of 5 rows and a column-sum finish with a ragged tail.)
fn check_layernorm_one_pass(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, c, _) = SIZES;
    for (n, c) in [(n, c), (4133usize, c), (1024usize, 2048usize)] {
        let x = randv(seed, 40, n * c, 1.0);
        let dout = to_bf(&round_bf(&randv(seed, 41, n * c, 1.0)));
        let lw = to_bf(&round_bf(&randv(seed, 42, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>()));
        let lb = to_bf(&round_bf(&randv(seed, 43, c, 0.1)));
        let (dx0, dw0, db0, bb0) = (randv(seed, 44, n * c, 0.5), randv(seed, 45, c, 0.5), randv(seed, 46, c, 0.5), randv(seed, 47, c, 0.5));
        let (d_x, d_w, d_b, d_dout) = (gpu.upload(&x)?, gpu.upload(&lw)?, gpu.upload(&lb)?, gpu.upload(&dout)?);
        let (d_mean, d_rstd, d_ln) = (gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?, gpu.alloc::<bf16>(n * c)?);
        layernorm_forward(gpu, s, d_ln.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_w.ptr(), d_b.ptr(), n, c)?;
        // `None` when the one-pass kernel does not fit the run's own buffers.
        let run = |fused: bool| -> Result<Option<Vec<u32>>> {
            let (d_dx, d_dw, d_db, d_bb) = (gpu.upload(&dx0)?, gpu.upload(&dw0)?, gpu.upload(&db0)?, gpu.upload(&bb0)?);
            let (d_dxb, d_scratch) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(layernorm_backward_scratch(n, c))?);
            let d_sums = gpu.alloc::<f32>(bias_grad_scratch(n, c))?;
            let a = LnBackward {
                dx: d_dx.ptr(),
                dx_bf16: Some(d_dxb.ptr()),
                dx_bf16_sums: Some(d_sums.ptr()),
                dw: d_dw.ptr(),
                db: d_db.ptr(),
                dout: d_dout.ptr(),
                x: d_x.ptr(),
                w: d_w.ptr(),
                mean: d_mean.ptr(),
                rstd: d_rstd.ptr(),
                scratch: d_scratch.ptr(),
                n,
                c,
            };
            if fused && !a.one_pass_fits() {
                return Ok(None);
            }
            layernorm_backward_with(gpu, s, &a, fused)?;
            colsum_finish(gpu, s, d_bb.ptr(), d_sums.ptr(), n, c)?;
            let mut bits: Vec<u32> = gpu.download(d_dx.ptr())?.iter().map(|v| v.to_bits()).collect();
            bits.extend(gpu.download(d_dxb.ptr())?.iter().map(|v| v.to_bits() as u32));
            for p in [d_dw.ptr(), d_db.ptr(), d_bb.ptr()] {
                bits.extend(gpu.download(p)?.iter().map(|v| v.to_bits()));
            }
            Ok(Some(bits))
        };
        let same_bits = matches!((run(true)?, run(false)?), (Some(one), Some(separate)) if one == separate);
        rows.push(CheckRow::same_bits(
            format!("layernorm_backward one pass = dx + column-sum kernels + bias_grad of the bf16 dx [{n}×{c}] (bits)"),
            same_bits,
        ));
    }
    Ok(())
}

/// Bias, bias + GELU (and the variants that leave the GEMM output unbiased), GELU backward,
/// bias_grad.
fn check_bias_gelu(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, _, f) = SIZES;
    let y = round_bf(&randv(seed, 20, n * f, 1.0));
    let bias = round_bf(&randv(seed, 21, f, 0.5));
    let d_bias = gpu.upload(&to_bf(&bias))?;
    let biased = round_bf(&(0..n * f).map(|i| y[i] + bias[i % f]).collect::<Vec<_>>());

    let d_y = gpu.upload(&to_bf(&y))?;
    bias_add(gpu, s, d_y.ptr(), d_bias.ptr(), n, f)?;
    rows.push(row_bf(format!("bias_add y [{n}×{f}] (bf16)"), &gpu.download(d_y.ptr())?, &biased));

    let d_pre = gpu.upload(&to_bf(&y))?;
    let d_act = gpu.alloc::<bf16>(n * f)?;
    bias_gelu_forward(gpu, s, d_pre.ptr(), d_act.ptr(), d_bias.ptr(), n, f)?;
    let mut act = vec![0f32; n * f];
    crate::ops::gelu::gelu_forward(&mut act, &biased);
    rows.push(row_bf(format!("bias_gelu_forward pre [{n}×{f}] (bf16)"), &gpu.download(d_pre.ptr())?, &biased));
    rows.push(row_bf(format!("bias_gelu_forward out [{n}×{f}] (bf16)"), &gpu.download(d_act.ptr())?, &act));

    let dout = round_bf(&randv(seed, 22, n * f, 1.0));
    let d_dout = gpu.upload(&to_bf(&dout))?;
    let d_dpre = gpu.alloc::<bf16>(n * f)?;
    gelu_backward(gpu, s, d_dpre.ptr(), d_dout.ptr(), d_pre.ptr(), n * f)?;
    let mut dpre = vec![0f32; n * f];
    crate::ops::gelu::gelu_backward(&mut dpre, &biased, &dout);
    let g_dpre = gpu.download(d_dpre.ptr())?;
    rows.push(row_bf(format!("gelu_backward dpre [{n}×{f}] (bf16)"), &g_dpre, &dpre));
    // The variants that leave the GEMM output unbiased must give the very same bits.
    let (d_raw, d_act2, d_dpre2) = (gpu.upload(&to_bf(&y))?, gpu.alloc::<bf16>(n * f)?, gpu.alloc::<bf16>(n * f)?);
    bias_gelu_forward_out(gpu, s, d_raw.ptr(), d_act2.ptr(), d_bias.ptr(), n, f)?;
    gelu_backward_bias(gpu, s, d_dpre2.ptr(), d_dout.ptr(), d_raw.ptr(), d_bias.ptr(), n, f)?;
    let same = |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let (out1, out2) = (gpu.download(d_act.ptr())?, gpu.download(d_act2.ptr())?);
    let (dp2, raw) = (gpu.download(d_dpre2.ptr())?, gpu.download(d_raw.ptr())?);
    let untouched = same(&raw, &to_bf(&y));
    rows.push(CheckRow::same_bits("bias_gelu_forward_out = bias_gelu_forward out (bits)", same(&out1, &out2)));
    rows.push(CheckRow::same_bits("bias_gelu_forward_out leaves pre unbiased (bits)", untouched));
    rows.push(CheckRow::same_bits("gelu_backward_bias = gelu_backward (bits)", same(&g_dpre, &dp2)));

    let db0 = randv(seed, 23, f, 0.5);
    let d_db = gpu.upload(&db0)?;
    let d_scratch = gpu.alloc::<f32>(bias_grad_scratch(n, f))?;
    bias_grad(gpu, s, d_db.ptr(), d_dout.ptr(), d_scratch.ptr(), n, f)?;
    let db = colsum_blocked_ref(&db0, n, f, |r, j| dout[r * f + j]);
    rows.push(row_f32(format!("bias_grad db [{f}] (+=, blocked-order ref)"), &gpu.download(d_db.ptr())?, &db));
    Ok(())
}

/// The residual add, and the fused residual + LayerNorm against the two kernels.
fn check_residual(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, c, _) = SIZES;
    let x = randv(seed, 24, n * c, 1.0);
    let yc = round_bf(&randv(seed, 25, n * c, 1.0));
    let bc = round_bf(&randv(seed, 26, c, 0.5));
    let (d_x, d_yc, d_bc) = (gpu.upload(&x)?, gpu.upload(&to_bf(&yc))?, gpu.upload(&to_bf(&bc))?);
    residual_bias_add(gpu, s, d_x.ptr(), d_x.ptr(), d_yc.ptr(), d_bc.ptr(), n, c)?;
    let want: Vec<f32> = (0..n * c).map(|i| x[i] + (yc[i] + bc[i % c])).collect();
    rows.push(row_f32(format!("residual_bias_add out=x [{n}×{c}] (in place)"), &gpu.download(d_x.ptr())?, &want));

    // The fused residual + LayerNorm gives the two kernels' bits (in place, as the model runs
    // it), at GPT-2's width and on the wide register path.
    for (n, c) in [(n, c), (1024usize, 2048usize)] {
        let x = randv(seed, 24, n * c, 1.0);
        let yc = round_bf(&randv(seed, 25, n * c, 1.0));
        let bc = round_bf(&randv(seed, 26, c, 0.5));
        let (d_yc, d_bc) = (gpu.upload(&to_bf(&yc))?, gpu.upload(&to_bf(&bc))?);
        let lw = round_bf(&randv(seed, 27, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>());
        let lb = round_bf(&randv(seed, 28, c, 0.1));
        let (d_lw, d_lb) = (gpu.upload(&to_bf(&lw))?, gpu.upload(&to_bf(&lb))?);
        // Every output's bits, concatenated.
        let two = |fused: bool| -> Result<Vec<u32>> {
            let d_x = gpu.upload(&x)?;
            let (d_out, d_mean, d_rstd) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?);
            if fused {
                let a = ResidualLn {
                    xo: d_x.ptr(),
                    out: d_out.ptr(),
                    mean: d_mean.ptr(),
                    rstd: d_rstd.ptr(),
                    x: d_x.ptr(),
                    y: d_yc.ptr(),
                    yb: d_bc.ptr(),
                    w: d_lw.ptr(),
                    b: d_lb.ptr(),
                    n,
                    c,
                };
                residual_layernorm_forward(gpu, s, &a)?;
            } else {
                residual_bias_add(gpu, s, d_x.ptr(), d_x.ptr(), d_yc.ptr(), d_bc.ptr(), n, c)?;
                layernorm_forward(gpu, s, d_out.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_lw.ptr(), d_lb.ptr(), n, c)?;
            }
            let mut bits: Vec<u32> = gpu.download(d_x.ptr())?.iter().map(|v| v.to_bits()).collect();
            bits.extend(gpu.download(d_out.ptr())?.iter().map(|v| v.to_bits() as u32));
            bits.extend(gpu.download(d_mean.ptr())?.iter().map(|v| v.to_bits()));
            bits.extend(gpu.download(d_rstd.ptr())?.iter().map(|v| v.to_bits()));
            Ok(bits)
        };
        let same_bits = two(true)? == two(false)?;
        rows.push(CheckRow::same_bits(
            format!("residual_layernorm_forward = residual_bias_add + layernorm_forward [{n}×{c}] (bits)"),
            same_bits,
        ));
    }
    Ok(())
}

/// Casts, add, scale.
fn check_casts(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, c, _) = SIZES;
    let len = n * c + 5; // a ragged tail exercises the scalar path
    let x = randv(seed, 30, len, 3.0);
    let d_x = gpu.upload(&x)?;
    let d_b = gpu.alloc::<bf16>(len)?;
    cast_f32_to_bf16(gpu, s, d_b.ptr(), d_x.ptr())?;
    rows.push(row_bf(format!("cast_f32_to_bf16 [{len}]"), &gpu.download(d_b.ptr())?, &x));
    let xb = to_bf(&x);
    let d_xb = gpu.upload(&xb)?;
    let d_f = gpu.alloc::<f32>(len)?;
    cast_bf16_to_f32(gpu, s, d_f.ptr(), d_xb.ptr())?;
    rows.push(row_f32(format!("cast_bf16_to_f32 [{len}]"), &gpu.download(d_f.ptr())?, &bf_to_f32(&xb)));

    let y = randv(seed, 31, len, 1.0);
    let d_y = gpu.upload(&y)?;
    add_f32(gpu, s, d_y.ptr(), d_x.ptr())?;
    let want: Vec<f32> = y.iter().zip(&x).map(|(a, b)| a + b).collect();
    rows.push(row_f32(format!("add_f32 [{len}]"), &gpu.download(d_y.ptr())?, &want));
    scale_f32(gpu, s, d_y.ptr(), 0.37)?;
    let want: Vec<f32> = want.iter().map(|a| a * 0.37).collect();
    rows.push(row_f32(format!("scale_f32 [{len}]"), &gpu.download(d_y.ptr())?, &want));
    check_round_f16(gpu, seed, rows)
}

/// fp16 storage (`round_f16`) against the `half` crate bit for bit: normal values over fp16's
/// whole range, halfway cases, overflow to ±inf, fp16 subnormals, f32 subnormals, ±0, ±inf, NaN.
fn check_round_f16(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let mut x: Vec<f32> = randv(seed, 32, 1 << 16, 1.0).iter().enumerate().map(|(i, v)| v * 2f32.powi((i % 48) as i32 - 30)).collect();
    let edge = [65504.0f32, 65519.99, 65520.0, -65520.0, 1e6, 6.1e-5, 5.96e-8, 2.98e-8, 3.0e-8, 1e-40, -1e-40, 0.0, -0.0];
    x.extend_from_slice(&edge);
    x.extend_from_slice(&[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let d = gpu.upload(&x)?;
    round_f16(gpu, &gpu.stream, d.ptr())?;
    let got = gpu.download(d.ptr())?;
    let key = |v: f32| if v.is_nan() { u32::MAX } else { v.to_bits() };
    let differ = got.iter().zip(&x).filter(|(g, w)| key(**g) != key(half::f16::from_f32(**w).to_f32())).count();
    rows.push(CheckRow {
        name: format!("round_f16 [{}] = half::f16 round trip (bits; {differ} differ)", x.len()),
        max_abs: 0.0,
        max_rel: differ as f64,
        tol: 0.0,
        non_finite: false,
    });
    Ok(())
}

/// Fused softmax cross-entropy, without and with the backward (n = 512, V = 50257, Vp = 50304).
fn check_crossentropy(gpu: &Gpu, seed: u64, rng: &mut Rng, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let (n, v, vp) = (512usize, 50257usize, 50304usize);
    let logits = round_bf(&randv(seed, 40, n * v, 2.0));
    let targets: Vec<u32> = (0..n).map(|_| rng.gen_range(v as u64) as u32).collect();
    // Padding columns hold large values: if they leaked into the softmax, losses would show it.
    let mut padded = vec![bf16::from_f32(100.0); n * vp];
    for r in 0..n {
        padded[r * vp..r * vp + v].copy_from_slice(&to_bf(&logits[r * v..(r + 1) * v]));
    }
    let (d_logits, d_tg, d_loss) = (gpu.upload(&padded)?, gpu.upload(&targets)?, gpu.alloc::<f32>(n)?);
    let (mut losses, mut probs) = (vec![0f32; n], vec![0f32; n * v]);
    crate::ops::crossentropy::crossentropy_forward(&mut losses, &mut probs, &logits, &targets, n, v);

    crossentropy(gpu, s, d_loss.ptr(), d_logits.ptr(), d_tg.ptr(), n, v, vp, 0.0)?;
    rows.push(row_f32(format!("crossentropy losses [{n}] (dscale=0)"), &gpu.download(d_loss.ptr())?, &losses));
    let untouched = gpu.download(d_logits.ptr())?;
    rows.push(CheckRow::compare(
        "crossentropy dscale=0 leaves logits unchanged",
        &bf_to_f32(&untouched),
        &bf_to_f32(&padded),
        BF16_FLOOR,
        0.0,
    ));

    let dscale = 1.0 / n as f32;
    gpu.zero(d_loss.ptr(), s)?;
    crossentropy(gpu, s, d_loss.ptr(), d_logits.ptr(), d_tg.ptr(), n, v, vp, dscale)?;
    rows.push(row_f32(format!("crossentropy losses [{n}] (with backward)"), &gpu.download(d_loss.ptr())?, &losses));
    let mut dl = vec![0f32; n * v];
    crate::ops::crossentropy::crossentropy_backward(&mut dl, &probs, &targets, n, v, 1.0);
    let mut want = vec![0f32; n * vp];
    for r in 0..n {
        want[r * vp..r * vp + v].copy_from_slice(&dl[r * v..(r + 1) * v]);
    }
    let floor = 1e-2 * want.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let got = bf_to_f32(&gpu.download(d_logits.ptr())?);
    rows.push(CheckRow::compare(
        format!("crossentropy dlogits [{n}×{vp}] (bf16, floor 1e-2·max)"),
        &got,
        &round_bf(&want),
        floor,
        BF16_TOL,
    ));
    Ok(())
}

/// Per-block sums of squares (f64) for the gradient norm.
fn check_sum_squares(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let block = crate::optim::norm::NORM_BLOCK;
    let len = 3 * block + 1003;
    let x = randv(seed, 50, len, 1.0);
    let d_x = gpu.upload(&x)?;
    let nb = len.div_ceil(block);
    let d_out = gpu.alloc::<f64>(nb)?;
    sum_squares_blocks(gpu, s, d_out.ptr(), d_x.ptr(), block)?;
    let got = gpu.download(d_out.ptr())?;
    let layout = crate::optim::norm::FlatLayout::from_sizes(&[len]).expect("one-segment layout");
    let mut want = vec![0f64; layout.slots()];
    layout.partial_sumsq(&x, 0..len, &mut want).expect("aligned full shard");
    let (mut max_abs, mut max_rel, mut non_finite) = (0f64, 0f64, false);
    for (g, w) in got.iter().zip(&want) {
        non_finite |= !g.is_finite();
        max_abs = max_abs.max((g - w).abs());
        max_rel = max_rel.max((g - w).abs() / (w.abs() + 1e-30));
    }
    rows.push(CheckRow { name: format!("sum_squares_blocks [{nb}] of [{len}] (f64)"), max_abs, max_rel, tol: 1e-12, non_finite });
    Ok(())
}

/// Fused AdamW over tensors alternating decay / no decay.
fn check_adamw(gpu: &Gpu, seed: u64, rows: &mut Vec<CheckRow>) -> Result<()> {
    let s: &CudaStream = &gpu.stream;
    let len = (1usize << 20) + 37;
    let master = randv(seed, 60, len, 0.02);
    let grad = randv(seed, 61, len, 0.01);
    let m0 = randv(seed, 62, len, 1e-3);
    let v0: Vec<f32> = randv(seed, 63, len, 1e-3).iter().map(|x| x * x).collect();
    // Tensors of varying sizes alternating decay / no decay.
    let mut decay = vec![0u8; len];
    let mut segs = Vec::new();
    let (mut at, mut k) = (0usize, 0usize);
    while at < len {
        let sz = (1000 + 7919 * k % 5000).min(len - at);
        let on = k % 2 == 0;
        decay[at..at + sz].iter_mut().for_each(|d| *d = on as u8);
        segs.push((at..at + sz, on));
        at += sz;
        k += 1;
    }
    let (lr, betas, eps, wd, step, grad_scale) = (6e-4f32, (0.9f32, 0.95f32), 1e-8f32, 0.1f32, 7u64, 0.5f32);
    let hp = AdamStep::new(lr, betas, eps, wd, step);
    let (d_master, d_grad, d_m, d_v, d_decay) =
        (gpu.upload(&master)?, gpu.upload(&grad)?, gpu.upload(&m0)?, gpu.upload(&v0)?, gpu.upload(&decay)?);
    let d_param = gpu.alloc::<bf16>(len)?;
    let bufs =
        OptimBufs { master: d_master.ptr(), param: d_param.ptr(), grad: d_grad.ptr(), m: d_m.ptr(), v: d_v.ptr(), decay: d_decay.ptr() };
    adamw(gpu, s, &bufs, &hp, grad_scale)?;
    let params =
        crate::optim::AdamParams { lr, betas, eps, weight_decay: wd, adam_w_mode: true, bias_correction: true, momentum_cycle: None };
    let coeffs = params.coeffs(lr, step);
    let g: Vec<f32> = grad.iter().map(|x| x * grad_scale).collect();
    let (mut p, mut m, mut v) = (master.clone(), m0.clone(), v0.clone());
    for (r, on) in segs {
        crate::optim::adam::adam_kernel(&coeffs, on, &mut p[r.clone()], &g[r.clone()], &mut m[r.clone()], &mut v[r]);
    }
    rows.push(row_f32(format!("adamw master [{len}]"), &gpu.download(d_master.ptr())?, &p));
    rows.push(row_bf(format!("adamw param [{len}] (bf16)"), &gpu.download(d_param.ptr())?, &p));
    rows.push(row_f32(format!("adamw m [{len}]"), &gpu.download(d_m.ptr())?, &m));
    rows.push(row_f32(format!("adamw v [{len}]"), &gpu.download(d_v.ptr())?, &v));
    Ok(())
}
