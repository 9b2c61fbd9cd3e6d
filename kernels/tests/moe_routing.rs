//! MoE routing against DeepSpeed itself (`scripts/gen_fixtures.py moe-routing`: its
//! `top1gating` / `top2gating` in float64): capacity, drops, the renormalisation over the kept
//! choices, the per-block `l_aux`, and the gradient of all of it with respect to the logits.

use std::collections::HashMap;

use safetensors::SafeTensors;
use tessera_kernels::gradcheck::rel_err;
use tessera_kernels::model::{Capacity, Gating};
use tessera_kernels::ops::moe::{aux_per_layer, route_backward, route_with, RouteSpec};

fn load(name: &str) -> (HashMap<String, Vec<f32>>, HashMap<String, String>) {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("fixture header");
    let st = SafeTensors::deserialize(&bytes).expect("fixture");
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
        .collect();
    (tensors, meta.metadata().clone().unwrap_or_default())
}

#[test]
fn routing_matches_deepspeeds_gating() {
    let (fx, meta) = load("moe_routing_ds.safetensors");
    let (s, e) = (meta["tokens"].parse::<usize>().unwrap(), meta["experts"].parse::<usize>().unwrap());
    let aux_weight: f32 = meta["aux_weight"].parse().unwrap();
    for case in ["top1", "top2", "top2_nodrop"] {
        let m = |k: &str| meta[&format!("{case}.{k}")].clone();
        let k: usize = m("k").parse().unwrap();
        let cf: f32 = m("capacity_factor").parse().unwrap();
        let cap = Capacity {
            train_factor: cf,
            eval_factor: cf,
            min_capacity: m("min_capacity").parse().unwrap(),
            drop_tokens: m("drop_tokens") == "1",
        };
        // DeepSpeed's top-1 keeps the raw probability; its top-2 renormalises over the kept pair.
        let spec =
            RouteSpec { e, k, gating: Gating::SoftmaxThenTopK, norm_topk: k == 2, capacity: Some((cap, cf)), gumbel: None, rts: None };
        let t = |n: &str| &fx[&format!("{case}.{n}")];
        let r = route_with(t("logits"), s, &spec);
        let mut w = vec![0f32; s * e];
        for i in 0..s * k {
            w[(i / k) * e + r.idx[i]] += r.w[i];
        }
        let werr = rel_err(&w, t("weights"));
        assert!(werr < 1e-6, "{case}: combine weights differ from DeepSpeed's: rel err {werr:e}");
        let kept_ds = t("weights").iter().filter(|&&v| v > 0.0).count();
        assert_eq!(s * k - r.dropped(), kept_ds, "{case}: kept (token, choice) pairs");
        let (l_aux, dp) = aux_per_layer(&r);
        assert!((l_aux - t("l_aux")[0]).abs() < 1e-6 * t("l_aux")[0].abs(), "{case}: l_aux {l_aux} vs {}", t("l_aux")[0]);
        let dw: Vec<f32> = (0..s * k).map(|i| t("upstream")[(i / k) * e + r.idx[i]]).collect();
        let dp: Vec<f32> = dp.iter().map(|v| v * aux_weight).collect();
        let mut dl = vec![0f32; s * e];
        route_backward(&mut dl, &r, &dw, Some(&dp), Gating::SoftmaxThenTopK, k == 2);
        let gerr = rel_err(&dl, t("grad_logits"));
        assert!(gerr < 1e-5, "{case}: d(logits) differs from DeepSpeed's autograd: rel err {gerr:e}");
        eprintln!("{case}: {} of {} choices dropped; weights rel err {werr:e}, d(logits) rel err {gerr:e}", r.dropped(), s * k);
    }
}
