//! The `tessera.moe` section: DeepSpeed's mixture of experts, which DeepSpeed configures in code
//! (`deepspeed.moe.layer.MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor,
//! eval_capacity_factor, min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts)`
//! plus DeepSpeed-Megatron's `--expert-interval` and `--moe-loss-coeff`), as keys of the config.
//!
//! On a dense model (a preset, a GPT-2/LLaMA/Mistral/Qwen2 folder) the section turns it into its
//! MoE variant ([`MoeSection::apply`]): every `expert_interval`-th block's MLP becomes `num_experts`
//! experts of the block's own MLP kind and width. On a model that already is one (a Mixtral or
//! Qwen2-MoE folder, the `mixtral-tiny` preset) the architecture comes from its `config.json`:
//! a key that contradicts it, or that those dropless families do not have, is refused by name;
//! the loss weights and `ep_size` apply. docs/MOE.md has the mapping.

use serde_json::Value;
use tessera_kernels::model::{AuxLoss, Capacity, Gating, ModelConfig, MoeConfig, NoisyGate};

use crate::config::error::{ConfigErrorKind, KindResult};
use crate::config::reader::Obj;

/// DeepSpeed's `MoE(min_capacity=4)`.
pub const MIN_CAPACITY_DEFAULT: usize = 4;
/// DeepSpeed-Megatron's `--expert-interval` default: every other block is MoE.
pub const EXPERT_INTERVAL_DEFAULT: usize = 2;
/// The load-balancing loss weight when none is given (Switch Transformer's 1e-2; DeepSpeed returns
/// `l_aux` and leaves its weight to the caller, DeepSpeed-Megatron's `--moe-loss-coeff`).
pub const AUX_LOSS_COEF_DEFAULT: f32 = 0.01;

/// The `tessera.moe` section as written: `None` where a key is absent (the model's own value, or
/// DeepSpeed's default when the section creates the experts).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeSection {
    pub num_experts: Option<usize>,
    /// Expert-parallel group size (DeepSpeed's `ep_size`): ranks that split a block's experts;
    /// at least 1 and dividing `num_experts` (checked in [`MoeSection::apply`]); default 1.
    pub ep_size: usize,
    pub k: Option<usize>,
    pub capacity_factor: Option<f32>,
    pub eval_capacity_factor: Option<f32>,
    pub min_capacity: Option<usize>,
    /// `Some(policy)` when `noisy_gate_policy` is given (`null` = `NoisyGate::None`).
    pub noisy_gate_policy: Option<NoisyGate>,
    pub drop_tokens: Option<bool>,
    pub use_residual: Option<bool>,
    pub use_rts: Option<bool>,
    pub expert_interval: Option<usize>,
    pub aux_loss_coef: Option<f32>,
    pub z_loss_coef: Option<f32>,
}

const SECTION: &str = "tessera.moe";

fn key(k: &str) -> String {
    format!("{SECTION}.{k}")
}

/// Reads `tessera.moe`; `None` when absent.
pub(crate) fn parse_moe(root: &Value) -> KindResult<Option<MoeSection>> {
    let m = Obj::at(root, SECTION)?;
    if !m.present() {
        return Ok(None);
    }
    let count = |k: &str| -> KindResult<Option<usize>> {
        match m.opt_u64(k)? {
            Some(0) => Err(ConfigErrorKind::invalid(&key(k), &Value::from(0), "a positive integer")),
            Some(n) => usize::try_from(n).map(Some).map_err(|_| ConfigErrorKind::invalid(&key(k), &Value::from(n), "a smaller integer")),
            None => Ok(None),
        }
    };
    let factor = |k: &str| -> KindResult<Option<f32>> {
        match m.opt_f32(k)? {
            Some(x) if x <= 0.0 => Err(ConfigErrorKind::invalid(&key(k), &Value::from(x), "a positive number")),
            x => Ok(x),
        }
    };
    let weight = |k: &str| -> KindResult<Option<f32>> {
        match m.opt_f32(k)? {
            Some(x) if x < 0.0 => Err(ConfigErrorKind::invalid(&key(k), &Value::from(x), "a number ≥ 0")),
            x => Ok(x),
        }
    };
    let flag = |k: &str| -> KindResult<Option<bool>> { m.get(k).map(|_| m.bool(k, false)).transpose() };
    let noisy_gate_policy = match root.pointer("/tessera/moe/noisy_gate_policy") {
        None => None,
        Some(Value::Null) => Some(NoisyGate::None),
        Some(v) => Some(match v.as_str() {
            Some("Jitter") => NoisyGate::Jitter,
            Some("RSample") => NoisyGate::RSample,
            Some("None") => NoisyGate::None,
            _ => return Err(ConfigErrorKind::invalid(&key("noisy_gate_policy"), v, "null, \"Jitter\" or \"RSample\"")),
        }),
    };
    Ok(Some(MoeSection {
        num_experts: count("num_experts")?,
        ep_size: count("ep_size")?.unwrap_or(1),
        k: count("k")?,
        capacity_factor: factor("capacity_factor")?,
        eval_capacity_factor: factor("eval_capacity_factor")?,
        min_capacity: m.opt_u64("min_capacity")?.map(|n| n as usize),
        noisy_gate_policy,
        drop_tokens: flag("drop_tokens")?,
        use_residual: flag("use_residual")?,
        use_rts: flag("use_rts")?,
        expert_interval: count("expert_interval")?,
        aux_loss_coef: weight("aux_loss_coef")?,
        z_loss_coef: weight("z_loss_coef")?,
    }))
}

impl MoeSection {
    /// The model `base` with the section applied (`model` is `tessera.model`, for messages):
    /// a dense model gains its experts; an MoE model keeps its architecture, takes the loss
    /// weights, and refuses keys that contradict it or that its dropless routing does not have.
    /// Either way `ep_size` must divide the experts, and the kernels must build the result.
    pub fn apply(&self, base: &ModelConfig, model: &str) -> KindResult<ModelConfig> {
        let mut out = base.clone();
        let moe = match &base.moe {
            Some(own) => self.onto_moe(own, model)?,
            None => self.create(base)?,
        };
        if moe.num_experts % self.ep_size != 0 {
            return Err(ConfigErrorKind::unsupported(
                &key("ep_size"),
                &Value::from(self.ep_size),
                &format!("it must divide the {} experts of each MoE block", moe.num_experts),
            ));
        }
        out.moe = Some(moe);
        out.validate().map_err(|e| {
            ConfigErrorKind::unsupported(
                SECTION,
                &Value::from(format!("on `{model}`")),
                &format!("the kernels cannot build the model: {e}"),
            )
        })?;
        Ok(out)
    }

    /// A Mixtral / Qwen2-MoE model: its `config.json` is the architecture.
    fn onto_moe(&self, own: &MoeConfig, model: &str) -> KindResult<MoeConfig> {
        let from = format!("from the model `{model}`'s config.json");
        let same = |k: &str, set: Option<usize>, have: usize| match set {
            Some(n) if n != have => Err(ConfigErrorKind::unsupported(&key(k), &Value::from(n), &format!("the model has {have} ({from})"))),
            _ => Ok(()),
        };
        same("num_experts", self.num_experts, own.num_experts)?;
        same("k", self.k, own.top_k)?;
        let present = |k: &str, set: Option<Value>, why: &str| match set {
            Some(v) => Err(ConfigErrorKind::unsupported(&key(k), &v, why)),
            None => Ok(()),
        };
        let dropless = "the model's routing is dropless (every token reaches its top-k experts), as transformers computes it; \
                        capacity keys would change its outputs";
        present("capacity_factor", self.capacity_factor.map(Value::from), dropless)?;
        present("eval_capacity_factor", self.eval_capacity_factor.map(Value::from), dropless)?;
        present("min_capacity", self.min_capacity.map(Value::from), dropless)?;
        present("drop_tokens", self.drop_tokens.map(Value::from), dropless)?;
        present("use_rts", self.use_rts.map(Value::from), dropless)?;
        let arch = format!("the architecture comes {from}");
        let policy = self.noisy_gate_policy.filter(|p| *p != NoisyGate::None).map(|p| Value::from(format!("{p:?}")));
        present("noisy_gate_policy", policy, &arch)?;
        present("use_residual", self.use_residual.filter(|r| *r).map(Value::from), &arch)?;
        present("expert_interval", self.expert_interval.map(Value::from), &arch)?;
        let mut m = own.clone();
        if let Some(c) = self.aux_loss_coef {
            m.aux_loss_coef = c;
        }
        if let Some(c) = self.z_loss_coef {
            m.z_loss_coef = c;
        }
        Ok(m)
    }

    /// A dense model turned into its MoE variant with DeepSpeed's defaults.
    fn create(&self, base: &ModelConfig) -> KindResult<MoeConfig> {
        let num_experts = self
            .num_experts
            .ok_or_else(|| ConfigErrorKind::invalid(&key("num_experts"), &Value::Null, "the number of experts per MoE block"))?;
        let top_k = self.k.unwrap_or(1);
        if top_k > num_experts {
            return Err(ConfigErrorKind::invalid(&key("k"), &Value::from(top_k), &format!("at most num_experts = {num_experts}")));
        }
        let interval = self.expert_interval.unwrap_or(EXPERT_INTERVAL_DEFAULT);
        if interval > base.n_layer {
            return Err(ConfigErrorKind::invalid(
                &key("expert_interval"),
                &Value::from(interval),
                &format!("at most the model's {} blocks (block l is MoE when (l + 1) % expert_interval == 0)", base.n_layer),
            ));
        }
        // DeepSpeed's drop_tokens = false gives every expert all the tokens routed to it: no
        // capacity, so its factors and the random token selection that fills it change nothing.
        let drop_tokens = self.drop_tokens.unwrap_or(true);
        let capacity = if drop_tokens {
            Some(Capacity {
                train_factor: self.capacity_factor.unwrap_or(1.0),
                eval_factor: self.eval_capacity_factor.unwrap_or(1.0),
                min_capacity: self.min_capacity.unwrap_or(MIN_CAPACITY_DEFAULT),
                drop_tokens,
            })
        } else {
            let inert = |k: &str, v: Option<Value>| match v {
                Some(v) => Err(ConfigErrorKind::unsupported(
                    &key(k),
                    &v,
                    "it changes nothing with drop_tokens = false (every token reaches its experts; no capacity)",
                )),
                None => Ok(()),
            };
            inert("capacity_factor", self.capacity_factor.map(Value::from))?;
            inert("eval_capacity_factor", self.eval_capacity_factor.map(Value::from))?;
            inert("min_capacity", self.min_capacity.map(Value::from))?;
            inert("use_rts", self.use_rts.map(Value::from))?;
            None
        };
        Ok(MoeConfig {
            num_experts,
            top_k,
            d_expert: base.d_ff,
            sparse_step: interval,
            dense_layers: Vec::new(),
            gating: Gating::SoftmaxThenTopK,
            // DeepSpeed's top-1 weighs by the softmax probability; top-2 and top-k renormalise.
            norm_topk: top_k > 1,
            capacity,
            noisy_gate: self.noisy_gate_policy.unwrap_or(NoisyGate::None),
            random_token_selection: drop_tokens && self.use_rts.unwrap_or(true),
            aux_loss_coef: self.aux_loss_coef.unwrap_or(AUX_LOSS_COEF_DEFAULT),
            z_loss_coef: self.z_loss_coef.unwrap_or(0.0),
            aux_loss: AuxLoss::PerLayer,
            shared_expert: None,
            residual: self.use_residual.unwrap_or(false),
        })
    }
}
