//! GPU fused attention vs the CPU reference (skips without a GPU).

use tessera_kernels::cuda::{self, attention, Gpu};

#[test]
fn gpu_attention_matches_cpu() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("GPU {} ({})", gpu.name, gpu.arch());
    let rows = attention::check(&gpu, 7).unwrap_or_else(|e| panic!("{e}"));
    for r in &rows {
        println!("{r}");
    }
    let failed: Vec<String> = rows.iter().filter(|r| !r.pass()).map(|r| r.name.clone()).collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
    assert!(rows.len() >= 20, "expected rows for y, lse, dq, dk, dv over several shapes, got {}", rows.len());
}

#[test]
fn gpu_attention_bench_gpt2_shape() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let (b, t, c, nh) = (16, 1024, 768, 12);
    let (fwd, bwd) = attention::bench(&gpu, b, t, c, nh).unwrap_or_else(|e| panic!("{e}"));
    // Causal: half of the 4·b·nh·t²·hd forward FLOPs (two GEMMs); the backward does 7 GEMM-sized products over 2 kernels.
    let fl = 2.0 * (b * nh) as f64 * (t * t) as f64 * (c / nh) as f64;
    println!("attention b={b} t={t} c={c} nh={nh}: forward {fwd:.3} ms ({:.0} TFLOP/s), backward {bwd:.3} ms", 2.0 * fl / fwd / 1e9);
    assert!(fwd > 0.0 && bwd > 0.0 && fwd.is_finite() && bwd.is_finite());
}

#[test]
fn rejects_unsupported_head_dim() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let (b, t, c, nh) = (1, 8, 128, 1); // hd = 128
    let qkv = gpu.alloc::<cuda::bf16>(b * t * 3 * c).unwrap();
    let y = gpu.alloc::<cuda::bf16>(b * t * c).unwrap();
    let lse = gpu.alloc::<f32>(b * nh * t).unwrap();
    let err =
        attention::attention_forward(&gpu, &gpu.stream, y.ptr(), lse.ptr(), qkv.ptr(), attention::AttnShape::mha(b, t, c, nh)).unwrap_err();
    assert!(err.to_string().contains("128"), "{err}");
}

/// The attention source compiles for sm_90 when NVRTC is present (skips otherwise).
#[test]
fn attention_compiles_for_hopper() {
    if let Err(e) = cuda::nvrtc_version() {
        println!("skipped: {e}");
        return;
    }
    let src = cuda::SOURCES.iter().find(|(n, _)| *n == "attention").expect("attention registered").1;
    let cubin = cuda::compile("attention", src, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.len() > 100);
}
