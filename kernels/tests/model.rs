//! Whole-model checks: loss and every parameter gradient against PyTorch fixtures
//! (`scripts/gen_fixtures.py`), finite differences through the full stack, and activation
//! recomputation giving bit-identical gradients.

use std::collections::HashMap;

use safetensors::SafeTensors;
use tessera_kernels::gradcheck::{check_grad, rel_err};
use tessera_kernels::model::{Arch, FlatAccess, MicroBatch, Model, ModelConfig, Workspace};

struct Fixture {
    tensors: HashMap<String, Vec<f32>>,
    ints: HashMap<String, Vec<u32>>,
    meta: HashMap<String, String>,
}

fn load_fixture(name: &str) -> Fixture {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("fixture header");
    let st = SafeTensors::deserialize(&bytes).expect("fixture");
    let mut tensors = HashMap::new();
    let mut ints = HashMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        match view.dtype() {
            safetensors::Dtype::F32 => {
                tensors.insert(name, data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
            }
            safetensors::Dtype::I32 => {
                ints.insert(name, data.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect());
            }
            other => panic!("unexpected dtype {other:?} in fixture"),
        }
    }
    let meta = meta.metadata().clone().unwrap_or_default();
    Fixture { tensors, ints, meta }
}

fn cfg_from(meta: &HashMap<String, String>) -> ModelConfig {
    let n = |k: &str| meta[k].parse::<usize>().expect("fixture metadata");
    let arch = if meta["arch"] == "gpt" { Arch::Gpt } else { Arch::Llama };
    ModelConfig {
        arch,
        vocab_size: n("vocab_size"),
        max_seq_len: n("max_seq_len"),
        n_layer: n("n_layer"),
        n_head: n("n_head"),
        d_model: n("d_model"),
        d_ff: n("d_ff"),
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: n("n_head"),
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: None,
    }
}

fn flat_params(model: &Model, fx: &Fixture) -> Vec<f32> {
    let mut flat = vec![0.0; model.num_params()];
    for spec in model.layout().specs() {
        let src = fx.tensors.get(&spec.name).unwrap_or_else(|| panic!("fixture lacks {}", spec.name));
        assert_eq!(src.len(), spec.numel(), "{}", spec.name);
        flat[spec.range()].copy_from_slice(src);
    }
    flat
}

fn run(model: &Model, params: &[f32], tokens: &[u32], targets: &[u32], b: usize, t: usize) -> (f32, Vec<f32>) {
    let mut grads = vec![0.0; params.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params, grads: &mut grads, units: model.units() };
    let loss = model.forward_backward(&mut acc, MicroBatch { tokens, targets, b, t, noise_key: 0 }, 1.0, &mut ws);
    (loss, grads)
}

fn check_against_pytorch(file: &str) {
    let fx = load_fixture(file);
    let cfg = cfg_from(&fx.meta);
    let model = Model::new(cfg).expect("model");
    let params = flat_params(&model, &fx);
    let (b, t) = (fx.meta["batch"].parse().unwrap(), fx.meta["seq_len"].parse().unwrap());
    let (loss, grads) = run(&model, &params, &fx.ints["tokens"], &fx.ints["targets"], b, t);
    let want = fx.tensors["loss"][0];
    let loss_rel = ((loss - want) / want).abs();
    assert!(loss_rel < 1e-5, "{file}: loss {loss} vs PyTorch {want} (rel {loss_rel:e})");
    let mut worst = (0.0f64, String::new());
    for spec in model.layout().specs() {
        let want = &fx.tensors[&format!("grad.{}", spec.name)];
        let e = rel_err(&grads[spec.range()], want);
        assert!(e < 1e-5, "{file}: gradient of {} differs from PyTorch: rel err {e:e}", spec.name);
        if e > worst.0 {
            worst = (e, spec.name.clone());
        }
    }
    eprintln!("{file}: loss rel err {loss_rel:e}; worst gradient rel err {:e} ({})", worst.0, worst.1);
}

#[test]
fn gpt_two_layers_matches_pytorch() {
    check_against_pytorch("gpt2l.safetensors");
}

#[test]
fn llama_two_layers_matches_pytorch() {
    check_against_pytorch("llama2l.safetensors");
}

fn tiny(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 11,
        max_seq_len: 6,
        n_layer: 2,
        n_head: 2,
        d_model: 8,
        d_ff: 16,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 2,
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: None,
    }
}

/// Finite differences through the whole stack (embeddings, blocks, tied head, loss). The loss is
/// evaluated in f32, so the step is large and the tolerance loose; the PyTorch fixtures above are
/// the tight check.
#[test]
fn whole_model_gradients_match_finite_differences() {
    // (The third: a LLaMA MLP narrower than the model, whose backward reuses its buffers.)
    for cfg in [tiny(Arch::Gpt), tiny(Arch::Llama), ModelConfig { d_ff: 4, ..tiny(Arch::Llama) }] {
        let (arch, d_ff) = (cfg.arch, cfg.d_ff);
        let model = Model::new(cfg).unwrap();
        // Weights of order one (not the GPT-2 init's 0.02) so that a finite step of 1e-2 is
        // small against every activation it moves, norms included.
        let mut params = tessera_kernels::gradcheck::randn(7, model.num_params(), 0.5);
        params.iter_mut().zip(model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.init, s.numel()))).for_each(|(p, init)| {
            if init == tessera_kernels::layer::Init::Ones {
                *p += 1.0;
            }
        });
        let (b, t) = (2, 5);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % 11) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 11) as u32).collect();
        let (_, grads) = run(&model, &params, &tokens, &targets, b, t);
        let f = |p: &[f32]| {
            let mut ws = Workspace::default();
            let mut unused = vec![0.0; p.len()];
            let mut acc = FlatAccess { params: p, grads: &mut unused, units: model.units() };
            model.loss(&mut acc, &tokens, &targets, b, t, &mut ws) as f64
        };
        check_grad(f, &params, &grads, 1e-2, 5e-2).unwrap_or_else(|e| panic!("{arch:?}, d_ff {d_ff}: {e}"));
    }
}

#[test]
fn activation_recomputation_gives_identical_gradients() {
    for arch in [Arch::Gpt, Arch::Llama] {
        let mut model = Model::new(tiny(arch)).unwrap();
        let params = model.init_params(3);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 2 % 11) as u32).collect();
        let (l1, g1) = run(&model, &params, &tokens, &targets, 2, 6);
        model.checkpoint_activations = true;
        let (l2, g2) = run(&model, &params, &tokens, &targets, 2, 6);
        assert_eq!(l1.to_bits(), l2.to_bits());
        assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()), "{arch:?}: recomputation changed gradients");
    }
}

fn tiny_moe(shared: Option<usize>, gating: tessera_kernels::model::Gating) -> ModelConfig {
    use tessera_kernels::model::{AuxLoss, MoeConfig, NoisyGate};
    ModelConfig {
        n_kv_head: 1,
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            d_expert: 6,
            sparse_step: 1,
            dense_layers: vec![0],
            gating,
            norm_topk: true,
            capacity: None,
            noisy_gate: NoisyGate::None,
            random_token_selection: false,
            aux_loss_coef: 0.3,
            z_loss_coef: 0.05,
            aux_loss: AuxLoss::AcrossLayers,
            shared_expert: shared,
            residual: false,
        }),
        n_layer: 3,
        ..tiny(Arch::Llama)
    }
}

/// The training objective of an MoE model: the mean cross-entropy plus its router losses.
fn objective(model: &Model, p: &[f32], tokens: &[u32], targets: &[u32], b: usize, t: usize) -> f64 {
    let mut ws = Workspace::default();
    let mut unused = vec![0.0; p.len()];
    let mut acc = FlatAccess { params: p, grads: &mut unused, units: model.units() };
    let ce = model.loss(&mut acc, tokens, targets, b, t, &mut ws) as f64;
    let m = model.cfg.moe.as_ref().unwrap();
    let st = ws.moe_stats();
    ce + f64::from(m.aux_loss_coef) * f64::from(st.aux_loss) + f64::from(m.z_loss_coef) * f64::from(st.z_loss)
}

/// Finite differences through an MoE model: router (with the load-balancing and z-losses),
/// experts, shared expert. A step moves no token to another expert (checked: the routing of
/// the perturbed points is compared), else its difference quotient means nothing.
#[test]
fn moe_model_gradients_match_finite_differences() {
    use tessera_kernels::model::Gating;
    for (shared, gating) in [(None, Gating::SoftmaxThenTopK), (Some(5), Gating::SoftmaxThenTopK), (None, Gating::TopKThenSoftmax)] {
        let model = Model::new(tiny_moe(shared, gating)).unwrap();
        let mut params = tessera_kernels::gradcheck::randn(11, model.num_params(), 0.5);
        params.iter_mut().zip(model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.init, s.numel()))).for_each(|(p, init)| {
            if init == tessera_kernels::layer::Init::Ones {
                *p += 1.0;
            }
        });
        let (b, t) = (2, 5);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % 11) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 11) as u32).collect();
        let (_, grads) = run(&model, &params, &tokens, &targets, b, t);
        let counts = |p: &[f32]| {
            let mut ws = Workspace::default();
            let mut unused = vec![0.0; p.len()];
            let mut acc = FlatAccess { params: p, grads: &mut unused, units: model.units() };
            model.loss(&mut acc, &tokens, &targets, b, t, &mut ws);
            ws.moe_stats().blocks.iter().map(|s| (s.block, s.tokens_per_expert.clone())).collect::<Vec<_>>()
        };
        let base = counts(&params);
        assert_eq!(base.len(), 2, "blocks 1 and 2 are MoE, block 0 dense");
        // Coordinates whose ±step keeps every routing: the check runs on those.
        let eps = 4e-3f32;
        let stable: Vec<usize> = (0..params.len())
            .filter(|&i| {
                let mut q = params.clone();
                q[i] += eps;
                let up = counts(&q);
                q[i] -= 2.0 * eps;
                up == base && counts(&q) == base
            })
            .collect();
        assert!(stable.len() * 10 > params.len() * 9, "{} of {} coordinates keep the routing", stable.len(), params.len());
        let mut x = params.clone();
        let analytic: Vec<f32> = stable.iter().map(|&i| grads[i]).collect();
        let sub: Vec<f32> = stable.iter().map(|&i| params[i]).collect();
        let f = |s: &[f32]| {
            stable.iter().zip(s).for_each(|(&i, &v)| x[i] = v);
            objective(&model, &x, &tokens, &targets, b, t)
        };
        check_grad(f, &sub, &analytic, f64::from(eps), 5e-2).unwrap_or_else(|e| {
            let at: usize = e.split("coordinate ").nth(1).and_then(|s| s.split(':').next()).and_then(|s| s.parse().ok()).unwrap_or(0);
            let i = stable.get(at).copied().unwrap_or(0);
            let name = model.layout().specs().iter().find(|s| s.range().contains(&i)).map(|s| s.name.clone());
            panic!("shared {shared:?}, {gating:?}: {e} (flat {i}, {name:?})")
        });
    }
}

#[test]
fn moe_recomputation_and_a_delegating_runner_give_identical_gradients() {
    recomputation_and_a_delegating_runner_give_identical_gradients(tiny_moe(Some(3), tessera_kernels::model::Gating::SoftmaxThenTopK));
    // GPT experts, a capacity that drops, random token selection, Gumbel noise, the residual MLP.
    recomputation_and_a_delegating_runner_give_identical_gradients(tiny_gpt_moe(true));
}

fn recomputation_and_a_delegating_runner_give_identical_gradients(cfg: ModelConfig) {
    use tessera_kernels::experts::{ExpertMlp, ExpertRunner, LocalExperts};
    use tessera_kernels::model::UnitAccess;
    use tessera_kernels::wgrad::WeightGrads;
    let mut model = Model::new(cfg).unwrap();
    let params = model.init_params(3);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| (i * 2 % 11) as u32).collect();
    let (l1, g1) = run(&model, &params, &tokens, &targets, 2, 6);
    model.checkpoint_activations = true;
    let (l2, g2) = run(&model, &params, &tokens, &targets, 2, 6);
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()), "recomputation changed gradients");

    /// Runs the experts one at a time through `LocalExperts`, into a gradient it owns, and
    /// counts the calls: the seam expert parallelism uses.
    struct Recording {
        grads: Vec<f32>,
        acts: Vec<Vec<tessera_kernels::experts::ExpertActs>>,
        calls: usize,
        units: Vec<std::ops::Range<usize>>,
    }
    impl ExpertRunner for Recording {
        fn forward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], rows: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
            self.calls += 1;
            let g = &mut self.grads[self.units[unit].clone()];
            LocalExperts { wg: &mut WeightGrads::now(g), acts: &mut self.acts[unit] }.forward(unit, mlp, p, rows)
        }
        fn backward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], d_out: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
            self.calls += 1;
            let g = &mut self.grads[self.units[unit].clone()];
            LocalExperts { wg: &mut WeightGrads::now(g), acts: &mut self.acts[unit] }.backward(unit, mlp, p, d_out)
        }
    }
    struct Access<'a> {
        flat: FlatAccess<'a>,
        runner: Recording,
    }
    impl UnitAccess for Access<'_> {
        fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
            self.flat.unit(u)
        }
        fn unit_with_experts(&mut self, u: usize) -> (&[f32], &mut [f32], Option<Box<dyn ExpertRunner + '_>>) {
            let (p, g) = self.flat.unit(u);
            (p, g, Some(Box::new(&mut self.runner)))
        }
    }
    impl ExpertRunner for &mut Recording {
        fn forward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], rows: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
            (**self).forward(unit, mlp, p, rows)
        }
        fn backward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], d_out: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
            (**self).backward(unit, mlp, p, d_out)
        }
    }
    for recompute in [false, true] {
        model.checkpoint_activations = recompute;
        let mut grads = vec![0.0; params.len()];
        let units = model.units().to_vec();
        let runner = Recording { grads: vec![0.0; params.len()], acts: vec![Vec::new(); units.len()], calls: 0, units };
        let mut acc = Access { flat: FlatAccess { params: &params, grads: &mut grads, units: model.units() }, runner };
        let mut ws = Workspace::default();
        let l3 =
            model.forward_backward(&mut acc, MicroBatch { tokens: &tokens, targets: &targets, b: 2, t: 6, noise_key: 0 }, 1.0, &mut ws);
        let Access { runner, .. } = acc;
        // Two MoE blocks: a forward and a backward each, and with recomputation another forward.
        assert_eq!(runner.calls, if recompute { 6 } else { 4 });
        // The block's gradient holds all but the experts', which the runner holds.
        let g3: Vec<f32> = grads.iter().zip(&runner.grads).map(|(a, b)| a + b).collect();
        assert_eq!(l3.to_bits(), l1.to_bits());
        assert!(g1.iter().zip(&g3).all(|(a, b)| a.to_bits() == b.to_bits()), "a runner changed the gradients (recompute {recompute})");
    }
}

#[test]
fn unsupported_moe_settings_are_refused_by_name() {
    use tessera_kernels::model::{Capacity, Gating, NoisyGate};
    let base = tiny_moe(None, Gating::SoftmaxThenTopK);
    let with = |f: &dyn Fn(&mut tessera_kernels::model::MoeConfig)| {
        let mut c = base.clone();
        f(c.moe.as_mut().unwrap());
        Model::new(c).err().unwrap_or_default()
    };
    assert!(with(&|m| m.top_k = 5).contains("top_k 5 must be 1..=4"));
    let cap = Capacity { train_factor: 1.0, eval_factor: 1.0, min_capacity: 4, drop_tokens: true };
    // Capacity, the noisy gates and random token selection are built; their bad values are not.
    assert_eq!(with(&|m| m.capacity = Some(cap)), "");
    assert_eq!(with(&|m| m.noisy_gate = NoisyGate::RSample), "");
    assert!(with(&|m| m.capacity = Some(Capacity { eval_factor: 0.0, ..cap })).contains("eval_capacity_factor 0"));
    assert!(with(&|m| m.random_token_selection = true).contains("use_rts"));
    assert!(with(&|m| {
        m.random_token_selection = true;
        m.capacity = Some(Capacity { drop_tokens: false, ..cap });
    })
    .contains("drop_tokens"));
    assert!(with(&|m| m.z_loss_coef = -1.0).contains("z_loss_coef must be finite and non-negative, got -1"));
    // GPT blocks have experts (GELU, with biases), and either family the residual MLP.
    assert_eq!(with(&|m| m.residual = true), "");
    let gpt = Model::new(ModelConfig { moe: base.moe.clone(), ..tiny(Arch::Gpt) }).expect("a GPT MoE model");
    assert!(gpt.expert_mlp(1).is_some() && gpt.expert_mlp(0).is_none(), "block 0 is dense, block 1 has experts");
}

/// A 3-block GPT model whose blocks 1 and 2 are DeepSpeed-style MoE blocks: GELU experts with
/// biases, top-2, a capacity of 4 slots for 10 tokens' 20 choices (so some are dropped; the
/// same factor in training and evaluation), the per-block load-balancing loss, the residual
/// MLP; `noisy`: also Gumbel noise on the choice and random token selection.
fn tiny_gpt_moe(noisy: bool) -> ModelConfig {
    use tessera_kernels::model::{AuxLoss, Capacity, Gating, MoeConfig, NoisyGate};
    ModelConfig {
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            d_expert: 6,
            sparse_step: 1,
            dense_layers: vec![0],
            gating: Gating::SoftmaxThenTopK,
            norm_topk: true,
            capacity: Some(Capacity { train_factor: 0.75, eval_factor: 0.75, min_capacity: 1, drop_tokens: true }),
            noisy_gate: if noisy { NoisyGate::RSample } else { NoisyGate::None },
            random_token_selection: noisy,
            aux_loss_coef: 0.3,
            z_loss_coef: 0.05,
            aux_loss: AuxLoss::PerLayer,
            shared_expert: None,
            residual: true,
        }),
        n_layer: 3,
        ..tiny(Arch::Gpt)
    }
}

/// Finite differences through a GPT MoE model with dropped choices, the per-block aux loss,
/// the z-loss and the residual MLP (evaluation routes like training here: same capacity
/// factor, no noise). Only coordinates whose ±step keeps every block's routing are checked.
#[test]
fn gpt_moe_model_gradients_match_finite_differences() {
    let model = Model::new(tiny_gpt_moe(false)).unwrap();
    let params = tessera_kernels::gradcheck::randn(12, model.num_params(), 0.5);
    let params: Vec<f32> = params
        .iter()
        .zip(model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.init, s.numel())))
        .map(|(p, init)| if init == tessera_kernels::layer::Init::Ones { p + 1.0 } else { *p })
        .collect();
    let (b, t) = (2, 5);
    let tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % 11) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 11) as u32).collect();
    let (_, grads) = run(&model, &params, &tokens, &targets, b, t);
    let routing = |p: &[f32]| {
        let mut ws = Workspace::default();
        let mut unused = vec![0.0; p.len()];
        let mut acc = FlatAccess { params: p, grads: &mut unused, units: model.units() };
        model.loss(&mut acc, &tokens, &targets, b, t, &mut ws);
        ws.moe_stats().blocks.iter().map(|s| (s.block, s.tokens_per_expert.clone(), s.dropped)).collect::<Vec<_>>()
    };
    let base = routing(&params);
    assert_eq!(base.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!(base.iter().all(|r| r.2 > 0), "the capacity drops choices: {base:?}");
    let eps = 4e-3f32;
    let stable: Vec<usize> = (0..params.len())
        .filter(|&i| {
            let mut q = params.clone();
            q[i] += eps;
            let up = routing(&q);
            q[i] -= 2.0 * eps;
            up == base && routing(&q) == base
        })
        .collect();
    assert!(stable.len() * 10 > params.len() * 9, "{} of {} coordinates keep the routing", stable.len(), params.len());
    let mut x = params.clone();
    let analytic: Vec<f32> = stable.iter().map(|&i| grads[i]).collect();
    let sub: Vec<f32> = stable.iter().map(|&i| params[i]).collect();
    let f = |s: &[f32]| {
        stable.iter().zip(s).for_each(|(&i, &v)| x[i] = v);
        objective(&model, &x, &tokens, &targets, b, t)
    };
    check_grad(f, &sub, &analytic, f64::from(eps), 5e-2).unwrap_or_else(|e| {
        let at: usize = e.split("coordinate ").nth(1).and_then(|s| s.split(':').next()).and_then(|s| s.parse().ok()).unwrap_or(0);
        let i = stable.get(at).copied().unwrap_or(0);
        let name = model.layout().specs().iter().find(|s| s.range().contains(&i)).map(|s| s.name.clone());
        panic!("{e} (flat {i}, {name:?})")
    });
}

/// A GPT model with DeepSpeed MoE blocks (GELU experts with biases, top-2 with a capacity that
/// drops, the per-block `l_aux`, the residual MLP) against the float64 reference of
/// `scripts/gen_fixtures.py moe-ds`, whose gating is DeepSpeed's own `top2gating`: the
/// training loss, aux and z-losses, the dropped choices, every gradient (of the objective),
/// and the evaluation loss at the evaluation capacity factor.
#[test]
fn gpt_moe_matches_deepspeed() {
    use tessera_kernels::model::{AuxLoss, Capacity, Gating, MoeConfig, NoisyGate};
    let fx = load_fixture("gpt_moe_ds.safetensors");
    let m = &fx.meta;
    let num = |k: &str| m[k].parse::<f32>().unwrap_or_else(|_| panic!("fixture metadata {k}"));
    let int = |k: &str| num(k) as usize;
    let cfg = ModelConfig {
        moe: Some(MoeConfig {
            num_experts: int("num_experts"),
            top_k: int("top_k"),
            d_expert: int("d_expert"),
            sparse_step: 1,
            dense_layers: vec![int("dense_layers")],
            gating: Gating::SoftmaxThenTopK,
            norm_topk: true,
            capacity: Some(Capacity {
                train_factor: num("capacity_factor"),
                eval_factor: num("eval_capacity_factor"),
                min_capacity: int("min_capacity"),
                drop_tokens: true,
            }),
            noisy_gate: NoisyGate::None,
            random_token_selection: false,
            aux_loss_coef: num("aux_loss_coef"),
            z_loss_coef: num("z_loss_coef"),
            aux_loss: AuxLoss::PerLayer,
            shared_expert: None,
            residual: true,
        }),
        ..cfg_from(m)
    };
    let model = Model::new(cfg).expect("model");
    let params = flat_params(&model, &fx);
    let (b, t): (usize, usize) = (m["batch"].parse().unwrap(), m["seq_len"].parse().unwrap());
    let (tokens, targets) = (&fx.ints["tokens"], &fx.ints["targets"]);
    let mut grads = vec![0.0; params.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
    let loss = model.forward_backward(&mut acc, MicroBatch { tokens, targets, b, t, noise_key: 0 }, 1.0, &mut ws);
    let st = ws.moe_stats().clone();
    let close = |what: &str, got: f32, want: f32| {
        let rel = ((got - want) / want).abs();
        assert!(rel < 2e-5, "{what}: {got} vs DeepSpeed reference {want} (rel {rel:e})");
    };
    close("cross-entropy", loss, fx.tensors["loss"][0]);
    close("aux loss", st.aux_loss, fx.tensors["aux_loss"][0]);
    close("z loss", st.z_loss, fx.tensors["z_loss"][0]);
    let dropped: Vec<u32> = st.blocks.iter().map(|s| s.dropped as u32).collect();
    assert_eq!(dropped, fx.ints["dropped"], "dropped (token, choice) pairs per block");
    let mut worst = (0.0f64, String::new());
    for spec in model.layout().specs() {
        let want = &fx.tensors[&format!("grad.{}", spec.name)];
        let e = rel_err(&grads[spec.range()], want);
        assert!(e < 1e-4, "gradient of {} differs from the DeepSpeed reference: rel err {e:e}", spec.name);
        if e > worst.0 {
            worst = (e, spec.name.clone());
        }
    }
    eprintln!("gpt_moe_ds: worst gradient rel err {:e} ({})", worst.0, worst.1);
    let mut unused = vec![0.0; params.len()];
    let mut acc = FlatAccess { params: &params, grads: &mut unused, units: model.units() };
    let eval = model.loss(&mut acc, tokens, targets, b, t, &mut ws);
    close("evaluation cross-entropy", eval, fx.tensors["eval_loss"][0]);
    assert!(ws.moe_stats().blocks.iter().all(|s| s.dropped == 0), "the evaluation factor keeps every choice");
}

/// `flops_per_token` leaves out exactly the idle experts' parameters, as the layout has them
/// (SwiGLU experts in LLaMA blocks, GELU experts with biases in GPT blocks).
#[test]
fn moe_flops_count_the_active_experts_only() {
    for cfg in [tiny_moe(Some(3), tessera_kernels::model::Gating::SoftmaxThenTopK), tiny_gpt_moe(false)] {
        let model = Model::new(cfg.clone()).unwrap();
        let m = cfg.moe.as_ref().unwrap();
        let idle: usize = (0..cfg.n_layer)
            .filter_map(|l| model.expert_mlp(l))
            .map(|x| (m.top_k..m.num_experts).map(|e| x.expert_range(e).len()).sum::<usize>())
            .sum();
        let attn = 12.0 * cfg.n_layer as f64 * cfg.d_model as f64 * 5.0;
        let want = 6.0 * (model.num_params() - idle) as f64 + attn;
        assert_eq!(cfg.flops_per_token(model.num_params(), 5), want, "{:?}", cfg.arch);
    }
}

/// A router that sends every token to the same experts (equal logits: ties go to the lower
/// index) leaves the others without rows: the step still runs, their gradient is exactly zero,
/// and the rest of the model still learns.
#[test]
fn experts_without_tokens_get_no_gradient() {
    for cfg in [tiny_moe(None, tessera_kernels::model::Gating::SoftmaxThenTopK), tiny_gpt_moe(false)] {
        let model = Model::new(cfg.clone()).unwrap();
        let mut params = model.init_params(5);
        for spec in model.layout().specs().iter().filter(|s| s.name.ends_with("moe.router.weight")) {
            params[spec.range()].fill(0.0);
        }
        let tokens: Vec<u32> = (0..10).map(|i| (i * 3 % 11) as u32).collect();
        let (loss, grads) = run(&model, &params, &tokens, &tokens, 2, 5);
        assert!(loss.is_finite());
        let m = cfg.moe.as_ref().unwrap();
        for l in 0..cfg.n_layer {
            let Some(x) = model.expert_mlp(l) else { continue };
            let unit = model.units()[l + 1].start;
            for e in 0..m.num_experts {
                let r = x.expert_range(e);
                let g = &grads[unit + r.start..unit + r.end];
                let zero = g.iter().all(|&v| v == 0.0);
                assert_eq!(zero, e >= m.top_k, "{:?} block {l} expert {e}: zero gradient {zero}", cfg.arch);
            }
        }
    }
}

/// The noise keys of a run: a pure function of (seed, step, micro-batch index), each part
/// mattering.
#[test]
fn noise_keys_depend_on_seed_step_and_micro_batch() {
    use tessera_kernels::model::noise_key_of;
    let k = noise_key_of(7, 3, 2);
    assert_eq!(k, noise_key_of(7, 3, 2));
    let others = [noise_key_of(8, 3, 2), noise_key_of(7, 4, 2), noise_key_of(7, 3, 3), noise_key_of(7, 2, 3)];
    assert!(others.iter().all(|&o| o != k), "{k} vs {others:?}");
}

/// Training routes with the micro-batch's noise (Gumbel choice, random token order): the same
/// key gives the same bits, other keys other routings; evaluation has no noise (the noisy
/// model evaluates exactly as its noise-free twin).
#[test]
fn noisy_routing_follows_the_noise_key_in_training_only() {
    let noisy = Model::new(tiny_gpt_moe(true)).unwrap();
    let quiet = Model::new(tiny_gpt_moe(false)).unwrap();
    let params = noisy.init_params(9);
    let tokens: Vec<u32> = (0..10).map(|i| (i * 7 % 11) as u32).collect();
    let train = |key: u64| {
        let mut grads = vec![0.0; params.len()];
        let mut ws = Workspace::default();
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: noisy.units() };
        let loss =
            noisy.forward_backward(&mut acc, MicroBatch { tokens: &tokens, targets: &tokens, b: 2, t: 5, noise_key: key }, 1.0, &mut ws);
        let routing: Vec<_> = ws.moe_stats().blocks.iter().map(|s| (s.tokens_per_expert.clone(), s.dropped)).collect();
        (loss.to_bits(), grads.iter().map(|g| g.to_bits()).collect::<Vec<_>>(), routing)
    };
    let a = train(1);
    assert_eq!(a, train(1), "the same noise key gives the same bits");
    let differ = (2..6).filter(|&k| train(k) != a).count();
    assert!(differ > 0, "no other noise key changed the step");
    let eval = |model: &Model| {
        let mut ws = Workspace::default();
        let mut acc = FlatAccess { params: &params, grads: &mut [], units: model.units() };
        model.loss(&mut acc, &tokens, &tokens, 2, 5, &mut ws).to_bits()
    };
    assert_eq!(eval(&noisy), eval(&quiet), "evaluation routes without noise");
}

/// The zero-bubble split of every stage's backward: an input-gradient pass `B` (d(input) only:
/// it adds no gradient and marks no unit ready) and, later, a weight pass `W` from `B`'s stash
/// (it marks the stage's blocks ready, last to first). Three micro-batches in flight, `B` of the
/// next before `W` of the last, each workspace reused for another forward right after its `B`,
/// a spent stash's memory reused by a later `B`:
/// every micro-batch's gradients are its fused pass's bit for bit. GPT, LLaMA with grouped-query
/// attention and q/k/v biases, GPT and LLaMA MoE (per-block loss, noise, drops, shared expert,
/// residual MLP), untied heads, with and without recomputation, cut at every place.
#[test]
fn split_backward_gives_the_fused_bits_at_every_cut() {
    use tessera_kernels::model::{AuxLoss, NoisyGate, StageSpan, UnitAccess, WStash};
    /// A flat access that records which units were marked ready.
    struct Marks<'a> {
        flat: FlatAccess<'a>,
        ready: Vec<usize>,
    }
    impl UnitAccess for Marks<'_> {
        fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
            self.flat.unit(u)
        }
        fn grads_ready(&mut self, u: usize) {
            self.ready.push(u);
        }
    }
    // A stash travels with its micro-batch (an engine may hand it to another thread).
    fn sendable<T: Send + 'static>() {}
    sendable::<WStash>();
    let mut gpt4 = tiny(Arch::Gpt);
    gpt4.n_layer = 4;
    let llama = ModelConfig { n_kv_head: 1, qkv_bias: true, tied_head: false, n_layer: 3, ..tiny(Arch::Llama) };
    let mut llama_moe = tiny_moe(Some(3), tessera_kernels::model::Gating::SoftmaxThenTopK);
    if let Some(m) = llama_moe.moe.as_mut() {
        (m.aux_loss, m.noisy_gate, m.residual) = (AuxLoss::PerLayer, NoisyGate::Jitter, true);
    }
    let gpt_moe = ModelConfig { tied_head: false, ..tiny_gpt_moe(true) };
    for (name, cfg) in [("gpt", gpt4), ("llama", llama), ("gpt-moe", gpt_moe), ("llama-moe", llama_moe)] {
        for recompute in [false, true] {
            let mut model = Model::new(cfg.clone()).expect("model");
            assert_eq!(model.stage_refusal(), None, "{name}");
            model.checkpoint_activations = recompute;
            let params = model.init_params(7);
            let (b, t, mbs) = (2, 5, 3);
            let data: Vec<(Vec<u32>, Vec<u32>)> = (0..mbs as u32)
                .map(|m| ((0..b * t).map(|i| (i as u32 * 7 + m) % 11).collect(), (0..b * t).map(|i| (i as u32 * 3 + 2 * m) % 11).collect()))
                .collect();
            let batch = |m: usize| MicroBatch { tokens: &data[m].0, targets: &data[m].1, b, t, noise_key: 40 + m as u64 };
            let fused: Vec<(u32, Vec<f32>)> = (0..mbs)
                .map(|m| {
                    let mut g = vec![0.0; params.len()];
                    let mut acc = FlatAccess { params: &params, grads: &mut g, units: model.units() };
                    (model.forward_backward(&mut acc, batch(m), 0.5, &mut Workspace::default()).to_bits(), g)
                })
                .collect();
            let l = cfg.n_layer;
            for cut in (0..=l).map(|c| vec![0, c, l]).chain([vec![0, 1, l - 1, l]]) {
                let what = format!("{name} recompute {recompute} cut {cut:?}");
                let spans: Vec<StageSpan> = cut
                    .windows(2)
                    .enumerate()
                    .map(|(s, w)| StageSpan { blocks: w[0]..w[1], embeds: s == 0, head: s + 2 == cut.len() })
                    .collect();
                let mut grads = vec![vec![0.0f32; params.len()]; mbs];
                let mut wss: Vec<Vec<Workspace>> = spans.iter().map(|_| (0..mbs).map(|_| Workspace::default()).collect()).collect();
                let mut flow: Vec<Option<Vec<f32>>> = vec![None; mbs];
                for m in 0..mbs {
                    for (span, ws) in spans.iter().zip(&mut wss) {
                        let mut acc = FlatAccess { params: &params, grads: &mut grads[m], units: model.units() };
                        let got = model.stage_forward(&mut acc, span, batch(m), flow[m].as_deref(), &mut ws[m]);
                        flow[m] = Some(model.stage_output(&ws[m]).to_vec());
                        if span.head {
                            assert_eq!(got.map(f32::to_bits), Some(fused[m].0), "{what}: loss of micro-batch {m}");
                            flow[m] = None;
                        }
                    }
                }
                for (s, span) in spans.iter().enumerate().rev() {
                    let mut stashes: Vec<Option<WStash>> = (0..mbs).map(|_| None).collect();
                    // B0 B1 W0 B2 W1 W2: B of the next micro-batch before W of the previous.
                    for (is_b, m) in [(true, 0), (true, 1), (false, 0), (true, 2), (false, 1), (false, 2)] {
                        let before = grads[m].clone();
                        let mut acc =
                            Marks { flat: FlatAccess { params: &params, grads: &mut grads[m], units: model.units() }, ready: vec![] };
                        if is_b {
                            let (dx, stash) = model.stage_backward_input(&mut acc, span, batch(m), flow[m].as_deref(), 0.5, &mut wss[s][m]);
                            flow[m] = Some(dx.to_vec());
                            assert!(acc.ready.is_empty(), "{what}: B marked {:?} ready", acc.ready);
                            let want: Vec<usize> =
                                span.head.then_some(0).into_iter().chain(span.blocks.clone().rev().map(|i| i + 1)).collect();
                            assert_eq!(stash.units().collect::<Vec<_>>(), want, "{what}: the stash's units");
                            stashes[m] = Some(stash);
                            // The workspace is free: another micro-batch's forward overwrites it.
                            let stream = vec![0.25; b * t * cfg.d_model];
                            let input = (!span.embeds).then_some(&stream[..]);
                            model.stage_forward(&mut acc, span, batch((m + 1) % mbs), input, &mut wss[s][m]);
                            let same = grads[m].iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{what}: B of micro-batch {m} added gradients");
                        } else {
                            let spent = model.stage_backward_weight(&mut acc, stashes[m].take().expect("B ran"));
                            let want: Vec<usize> = span.blocks.clone().rev().map(|i| i + 1).collect();
                            assert_eq!(acc.ready, want, "{what}: W's ready units");
                            // Its memory serves a later B (W0's: B2's, on another workspace).
                            wss[s][(m + 2) % mbs].recycle(spent);
                        }
                    }
                }
                for m in 0..mbs {
                    let mut acc = FlatAccess { params: &params, grads: &mut grads[m], units: model.units() };
                    model.stage_embed_backward(&mut acc, &data[m].0, b, t, flow[m].as_deref().expect("d(embeddings)"));
                    let same = grads[m].iter().zip(&fused[m].1).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: micro-batch {m}'s gradients differ from the fused pass");
                }
            }
        }
    }
}

/// What the zero-bubble stash costs: per micro-batch of `n` tokens, each dense block keeps what
/// its weight pass reads — a GPT block `n·(12c + 2f + 4)` floats (each linear's input and output
/// gradient, each LayerNorm's input, mean, rstd and output gradient), a LLaMA block
/// `n·(9c + q + 3f + 2)` (`q` the q/k/v row; the two MLP inputs share one copy) — and the last
/// stage's head `n·(v + 3c + 2)` (LayerNorm) or `n·(v + 3c + 1)` (RMSNorm): d(logits) is `n·v`.
#[test]
fn the_stash_holds_what_the_weight_pass_reads() {
    use tessera_kernels::model::StageSpan;
    let llama = ModelConfig { n_kv_head: 1, ..tiny(Arch::Llama) };
    for cfg in [tiny(Arch::Gpt), llama] {
        let model = Model::new(cfg.clone()).expect("model");
        let params = model.init_params(5);
        let (b, t) = (2, 5);
        let n = b * t;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % 11) as u32).collect();
        let batch = MicroBatch { tokens: &tokens, targets: &tokens, b, t, noise_key: 0 };
        let mut grads = vec![0.0; params.len()];
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
        let (c, f, v, l) = (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layer);
        let (block, head) = match cfg.arch {
            Arch::Gpt => (n * (12 * c + 2 * f + 4), n * (v + 3 * c + 2)),
            Arch::Llama => (n * (9 * c + (c + 2 * c / cfg.n_head * cfg.n_kv_head) + 3 * f + 2), n * (v + 3 * c + 1)),
        };
        for span in [StageSpan::whole(&model), StageSpan { blocks: 1..l, embeds: false, head: false }] {
            let mut ws = Workspace::default();
            let input = tessera_kernels::gradcheck::randn(8, n * c, 1.0);
            model.stage_forward(&mut acc, &span, batch, (!span.embeds).then_some(&input[..]), &mut ws);
            let dy = tessera_kernels::gradcheck::randn(9, n * c, 1.0);
            let (_, stash) = model.stage_backward_input(&mut acc, &span, batch, (!span.head).then_some(&dy[..]), 1.0, &mut ws);
            let want = 4 * (span.blocks.len() * block + if span.head { head } else { 0 });
            assert_eq!(stash.bytes(), want, "{:?} {span:?}", cfg.arch);
        }
    }
}

/// One micro-batch cut into pipeline stages (each stage's forward handing its stream to the
/// next, the backwards handing d(stream) back, the embeddings' backward after the head's) gives
/// the loss and every gradient of the uncut pass bit for bit: GPT, LLaMA, an MoE model with the
/// per-block loss and noise, with and without recomputation, cut at every place.
#[test]
fn stages_cut_anywhere_give_the_uncut_bits() {
    use tessera_kernels::model::{FlatAccess, MicroBatch, StageSpan, Workspace};
    let mut gpt4 = tiny(Arch::Gpt);
    gpt4.n_layer = 4;
    for (name, cfg) in [("gpt", gpt4), ("llama", tiny(Arch::Llama)), ("gpt-moe", tiny_gpt_moe(true))] {
        for recompute in [false, true] {
            let mut model = Model::new(cfg.clone()).expect("model");
            model.checkpoint_activations = recompute;
            let params = model.init_params(7);
            let (b, t) = (2, 5);
            let tokens: Vec<u32> = (0..b * t).map(|i| (i * 7 % 11) as u32).collect();
            let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 11) as u32).collect();
            let batch = MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 42 };
            let mut whole = vec![0.0; params.len()];
            let mut acc = FlatAccess { params: &params, grads: &mut whole, units: model.units() };
            let loss = model.forward_backward(&mut acc, batch, 0.5, &mut Workspace::default());
            let l = cfg.n_layer;
            // Every cut into two stages, and (four blocks) into 1+2+1.
            let mut cuts: Vec<Vec<usize>> = (0..=l).map(|c| vec![0, c, l]).collect();
            if l == 4 {
                cuts.push(vec![0, 1, 3, 4]);
            }
            for cut in cuts {
                let spans: Vec<StageSpan> = cut
                    .windows(2)
                    .enumerate()
                    .map(|(s, w)| StageSpan { blocks: w[0]..w[1], embeds: s == 0, head: s + 2 == cut.len() })
                    .collect();
                let mut grads = vec![0.0; params.len()];
                let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
                let mut wss: Vec<Workspace> = spans.iter().map(|_| Workspace::default()).collect();
                let mut stream: Option<Vec<f32>> = None;
                let mut got = None;
                for (span, ws) in spans.iter().zip(&mut wss) {
                    got = model.stage_forward(&mut acc, span, batch, stream.as_deref(), ws);
                    stream = Some(model.stage_output(ws).to_vec());
                }
                let mut dy: Option<Vec<f32>> = None;
                for (span, ws) in spans.iter().zip(&mut wss).rev() {
                    dy = Some(model.stage_backward(&mut acc, span, batch, dy.as_deref(), 0.5, ws).to_vec());
                }
                model.stage_embed_backward(&mut acc, &tokens, b, t, dy.as_deref().expect("d(embeddings)"));
                assert_eq!(got.map(f32::to_bits), Some(loss.to_bits()), "{name} recompute {recompute} cut {cut:?}: loss");
                let same = grads.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name} recompute {recompute} cut {cut:?}: gradients differ");
            }
        }
    }
}
