//! Whole MoE models with DeepSpeed-style routing (capacity with drops, random token selection,
//! Jitter or RSample, the per-block load-balancing loss, the z-loss): finite differences of the
//! training objective for a fixed noise key, activation recomputation giving the same bits,
//! the noise a function of the key alone, and evaluation without noise at its own capacity.

use tessera_kernels::gradcheck::{check_grad, randn};
use tessera_kernels::layer::Init;
use tessera_kernels::model::{
    Arch, AuxLoss, Capacity, FlatAccess, Gating, MicroBatch, Model, ModelConfig, MoeConfig, NoisyGate, Workspace,
};

fn model(noisy: NoisyGate, aux: AuxLoss, gating: Gating) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 11,
        max_seq_len: 6,
        n_layer: 2,
        n_head: 2,
        d_model: 8,
        d_ff: 16,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 1,
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            d_expert: 6,
            sparse_step: 1,
            dense_layers: vec![],
            gating,
            norm_topk: true,
            capacity: Some(Capacity { train_factor: 0.75, eval_factor: 2.0, min_capacity: 1, drop_tokens: true }),
            noisy_gate: noisy,
            random_token_selection: true,
            aux_loss_coef: 0.1,
            z_loss_coef: 0.01,
            aux_loss: aux,
            shared_expert: None,
            residual: false,
        }),
    }
}

fn configs() -> Vec<ModelConfig> {
    vec![
        model(NoisyGate::Jitter, AuxLoss::PerLayer, Gating::SoftmaxThenTopK),
        model(NoisyGate::RSample, AuxLoss::PerLayer, Gating::TopKThenSoftmax),
        model(NoisyGate::None, AuxLoss::AcrossLayers, Gating::SoftmaxThenTopK),
    ]
}

const B: usize = 2;
const T: usize = 5;

fn batch() -> (Vec<u32>, Vec<u32>) {
    ((0..B * T).map(|i| (i * 5 % 11) as u32).collect(), (0..B * T).map(|i| (i * 3 % 11) as u32).collect())
}

/// A training pass with noise key `key`: (mean cross-entropy, gradients, workspace).
fn train(model: &Model, params: &[f32], key: u64) -> (f32, Vec<f32>, Workspace) {
    let (tokens, targets) = batch();
    let mut grads = vec![0.0; params.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params, grads: &mut grads, units: model.units() };
    let ce = model.forward_backward(&mut acc, MicroBatch { tokens: &tokens, targets: &targets, b: B, t: T, noise_key: key }, 1.0, &mut ws);
    (ce, grads, ws)
}

fn order_one_params(model: &Model) -> Vec<f32> {
    let mut params = randn(7, model.num_params(), 0.5);
    params.iter_mut().zip(model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.init, s.numel()))).for_each(|(p, init)| {
        if init == Init::Ones {
            *p += 1.0;
        }
    });
    params
}

#[test]
fn noisy_dropping_models_match_finite_differences_for_a_fixed_key() {
    for cfg in configs() {
        let model = Model::new(cfg.clone()).unwrap();
        let params = order_one_params(&model);
        let (_, grads, ws) = train(&model, &params, 42);
        let st = ws.moe_stats();
        assert_eq!(st.blocks.len(), 2);
        assert!(st.blocks.iter().any(|b| b.dropped > 0), "capacity 0.75 drops some choices: {st:?}");
        let m = cfg.moe.as_ref().unwrap();
        let objective = |p: &[f32]| {
            let (ce, _, ws) = train(&model, p, 42);
            let st = ws.moe_stats();
            f64::from(ce) + f64::from(m.aux_loss_coef) * f64::from(st.aux_loss) + f64::from(m.z_loss_coef) * f64::from(st.z_loss)
        };
        // A step that moves a routing choice or a capacity slot makes the objective jump (the
        // noise itself is fixed by the key), so the check runs on the coordinates whose ±step
        // keeps the routing: the same rows per expert and drops, and one-sided differences
        // that agree (a choice that moves between two tokens keeps the counts, not the slope).
        let routing = |p: &[f32]| {
            let (_, _, ws) = train(&model, p, 42);
            ws.moe_stats().blocks.iter().map(|b| (b.tokens_per_expert.clone(), b.dropped)).collect::<Vec<_>>()
        };
        let base = routing(&params);
        let f0 = objective(&params);
        let eps = 3e-3f32;
        let stable: Vec<usize> = (0..params.len())
            .filter(|&i| {
                let mut q = params.clone();
                q[i] += eps;
                let (up, f_up) = (routing(&q), objective(&q));
                q[i] -= 2.0 * eps;
                let (dn, f_dn) = (routing(&q), objective(&q));
                let (a, b) = (f_up - f0, f0 - f_dn);
                up == base && dn == base && (a - b).abs() <= 0.2 * a.abs().max(b.abs()) + 1e-5
            })
            .collect();
        assert!(stable.len() * 10 > params.len() * 8, "{} of {} coordinates keep the routing", stable.len(), params.len());
        let mut x = params.clone();
        let analytic: Vec<f32> = stable.iter().map(|&i| grads[i]).collect();
        let sub: Vec<f32> = stable.iter().map(|&i| params[i]).collect();
        let f = |s: &[f32]| {
            stable.iter().zip(s).for_each(|(&i, &v)| x[i] = v);
            objective(&x)
        };
        check_grad(f, &sub, &analytic, f64::from(eps), 5e-2).unwrap_or_else(|e| panic!("{m:?}: {e}"));
    }
}

#[test]
fn recomputation_gives_the_same_bits_and_the_key_alone_fixes_the_noise() {
    for cfg in configs() {
        let mut model = Model::new(cfg.clone()).unwrap();
        let params = model.init_params(3);
        let (l1, g1, w1) = train(&model, &params, 9);
        model.checkpoint_activations = true;
        let (l2, g2, w2) = train(&model, &params, 9);
        assert_eq!(l1.to_bits(), l2.to_bits());
        assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()), "recomputation changed the gradients");
        assert_eq!(w1.moe_stats(), w2.moe_stats());
        if cfg.moe.as_ref().unwrap().noisy_gate != NoisyGate::None || cfg.moe.as_ref().unwrap().random_token_selection {
            // Another key, other noise: some gradient moves.
            let (_, g3, _) = train(&model, &params, 10);
            assert!(g1.iter().zip(&g3).any(|(a, b)| a.to_bits() != b.to_bits()), "the noise key changes nothing");
        }
    }
}

#[test]
fn evaluation_draws_no_noise_and_uses_the_eval_capacity() {
    for cfg in configs() {
        let model = Model::new(cfg).unwrap();
        let params = model.init_params(5);
        let (tokens, targets) = batch();
        let mut ws = Workspace::default();
        let mut acc = FlatAccess { params: &params, grads: &mut [], units: model.units() };
        let e1 = model.loss(&mut acc, &tokens, &targets, B, T, &mut ws);
        let st = ws.moe_stats().clone();
        // Capacity factor 2 of top-2 over 4 experts: ceil(10/4·2·2) = 10 slots, nothing dropped.
        assert!(st.blocks.iter().all(|b| b.dropped == 0 && b.capacity == Some(10)), "{st:?}");
        let e2 = model.loss(&mut acc, &tokens, &targets, B, T, &mut ws);
        assert_eq!(e1.to_bits(), e2.to_bits());
        // Training at factor 0.75: ceil(10/4·0.75·2) = 4 slots.
        let (_, _, tw) = train(&model, &params, 1);
        assert!(tw.moe_stats().blocks.iter().all(|b| b.capacity == Some(4)));
    }
}
