//! GPU decoding over a paged cache vs the CPU model (skips without a GPU).

use tessera_kernels::cuda::{decode, Gpu};

#[test]
fn gpu_decode_matches_cpu() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("GPU {} ({})", gpu.name, gpu.arch());
    let rows = decode::check::check(&gpu, 7).unwrap_or_else(|e| panic!("{e}"));
    for r in &rows {
        println!("{r}");
    }
    let failed: Vec<String> = rows.iter().filter(|r| !r.pass()).map(|r| r.name.clone()).collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
    // 2 attention shapes × 2 rows; GEMV: 3 formats × 2 shapes × 2 rows, and 2 quantized formats
    // × 2 shapes × 1 widening row; 3 weight formats × 2 models × (21 logits rows: 3 prefill, 6
    // decode steps of 3 sequences; 2 check rows each, and the graph-vs-eager bits row); GPT-2 in
    // 3 formats × 2 rows: the residual + LayerNorm folded into the GEMVs vs the separate kernels.
    assert_eq!(rows.len(), 4 + 12 + 4 + 6 * (2 * 21 + 1) + 3 * 2, "rows");
}
