#!/usr/bin/env python3
"""Generates the PyTorch reference fixtures for Tessera's model tests (run once; outputs committed).

Two sets, one subcommand each:

`kernels` -- for a 2-layer GPT-2-style model and a 2-layer LLaMA-style model (tiny shapes), this builds the
model from explicit tensors named exactly as Tessera names them (linear weights laid out
[in, out] like Hugging Face's GPT-2 Conv1D), runs forward + cross-entropy + backward in float64
and writes params, tokens, targets, the loss and every gradient to a safetensors file (f32).

`hf` -- tiny Hugging Face model folders made by `transformers` itself (`GPT2LMHeadModel`,
`LlamaForCausalLM` with grouped-query attention, LLaMA 3 RoPE scaling and an untied head, the same
tied and saved as shards, `MistralForCausalLM`, `Qwen2ForCausalLM` with its q/k/v biases), each with
the same small byte-level BPE `tokenizer.json` (trained here with `tokenizers` on
scripts/gen_fixtures.py itself), and next to each folder a `reference.safetensors`: tokens,
targets, the logits, the mean cross-entropy and the gradient of every parameter (by its Hugging
Face name), computed in float64 from the saved float32 weights. Nothing is downloaded.

`hf-moe` (also run by `hf`) -- `mixtral` (a MixtralForCausalLM, 4 experts top-2, `output_router_logits`
with a nonzero `router_aux_loss_coef`, so its reference gradients are of cross-entropy + coef * aux) and
`qwen2-moe` (a Qwen2MoeForCausalLM with a dense block (`mlp_only_layers`), a shared expert, q/k/v biases
and `norm_topk_prob` false), with the `llama` folder's tokenizer.json; their reference files add `aux_loss`
(transformers' `load_balancing_loss_func` over every MoE block's routing) and `objective`.

`moe-ds` -- `gpt_moe_ds.safetensors` (kernels/tests/fixtures): a 3-layer GPT-2-style model whose blocks 1 and 2
are DeepSpeed MoE layers (4 GELU experts with biases, top-2, a capacity that drops (token, choice) pairs,
`use_residual`), built like `kernels` from tensors under Tessera's names, its gating done by DeepSpeed's own
`deepspeed.moe.sharded_moe.top2gating` (`DS_BUILD_OPS=0 pip install deepspeed`; no second-expert sampling,
so deterministic), its experts run on DeepSpeed's dispatch and combine tensors, and the residual MLP mixed by
`softmax(coefficient(h))` as `deepspeed.moe.layer.MoE` does. Objective: mean cross-entropy + aux_coef * (sum
of the blocks' `l_aux`) + z_coef * (sum of the blocks' mean logsumexp(logits)^2); the file holds the
training-mode loss, aux, z, objective and every gradient, and the evaluation-mode loss (its own capacity
factor, no drops).

`hf-gpu` -- `llama-gpu`, a LlamaForCausalLM of head dimension 64 with grouped-query attention and an
untied head (what the GPU kernels run), for tests/e2e_gpu.rs; no reference file.

`hf-generate` -- `generate.json` beside the folders: for each of gpt2, llama, mistral, qwen2, mixtral and
qwen2-moe (made by `hf`/`hf-moe`), a prompt of seeded random ids and what transformers' `generate` makes of
it greedily (float64, its own key/value cache, `do_sample=False`), with the smallest gap between the two
best logits over the steps: of GENERATE_SEEDS prompts, those whose every gap is at least GENERATE_MIN_GAP
(so an f32 run must choose the same tokens), the one whose output has the most distinct tokens.

`adagrad` -- `adagrad.json` (kernels/tests/fixtures): torch.optim.Adagrad itself (float64 tensors,
foreach=False) over two param groups (weight decay 0.05 and 0) with lr_decay and an initial
accumulator, the group lr written before each step as a scheduler does; float32-representable
inputs, the parameters and the `sum` state after each step.

Usage: python3 scripts/gen_fixtures.py kernels [OUT_DIR]   (default kernels/tests/fixtures)
       python3 scripts/gen_fixtures.py hf [OUT_DIR]        (default tests/fixtures/hf)
       python3 scripts/gen_fixtures.py moe-routing [OUT_DIR] (default kernels/tests/fixtures; DeepSpeed's
                                                            top1gating/top2gating on random logits)
       python3 scripts/gen_fixtures.py hf-moe [OUT_DIR]    (default tests/fixtures/hf)
       python3 scripts/gen_fixtures.py hf-gpu [OUT_DIR]    (default tests/fixtures/hf)
       python3 scripts/gen_fixtures.py hf-generate [DIR]   (default tests/fixtures/hf; reads the folders there)
       python3 scripts/gen_fixtures.py moe-ds [OUT_DIR]    (default kernels/tests/fixtures)
       python3 scripts/gen_fixtures.py adagrad [OUT_DIR]   (default kernels/tests/fixtures)
Needs: torch, safetensors; `hf` also transformers and tokenizers.
"""
import copy
import math
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

torch.manual_seed(20261129)
DT = torch.float64


def rand(*shape, std=0.1, mean=0.0):
    return (torch.randn(*shape, dtype=DT) * std + mean)


def attention(qkv, B, T, C, NH):
    q, k, v = qkv.split(C, dim=2)
    hd = C // NH
    q = q.view(B, T, NH, hd).transpose(1, 2)
    k = k.view(B, T, NH, hd).transpose(1, 2)
    v = v.view(B, T, NH, hd).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


def rope(x, B, T, C, NH, theta):
    """HF LLaMA rotate_half convention on x [B, T, C] viewed as [B, T, NH, hd]."""
    hd = C // NH
    inv = theta ** (-torch.arange(0, hd // 2, dtype=DT) * 2.0 / hd)
    ang = torch.arange(T, dtype=DT)[:, None] * inv[None, :]  # [T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1)[None, :, None, :]
    x = x.view(B, T, NH, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rot * sin).reshape(B, T, C)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gpt(P, tokens, B, T, C, NH, L):
    x = P["wte.weight"][tokens] + P["wpe.weight"][:T][None]
    for i in range(L):
        p = lambda s: P[f"h.{i}.{s}"]
        h = torch.nn.functional.layer_norm(x, (C,), p("ln_1.weight"), p("ln_1.bias"), 1e-5)
        qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        x = x + attention(qkv, B, T, C, NH) @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = torch.nn.functional.layer_norm(x, (C,), p("ln_2.weight"), p("ln_2.bias"), 1e-5)
        h = torch.nn.functional.gelu(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"), approximate="tanh")
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = torch.nn.functional.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
    return x @ P["wte.weight"].T


def llama(P, tokens, B, T, C, NH, L, theta=10000.0, eps=1e-5):
    x = P["wte.weight"][tokens]
    for i in range(L):
        p = lambda s: P[f"h.{i}.{s}"]
        h = rmsnorm(x, p("attn_norm.weight"), eps)
        qkv = h @ p("attn.wqkv.weight")
        q, k, v = qkv.split(C, dim=2)
        qkv = torch.cat([rope(q, B, T, C, NH, theta), rope(k, B, T, C, NH, theta), v], dim=2)
        x = x + attention(qkv, B, T, C, NH) @ p("attn.wo.weight")
        h = rmsnorm(x, p("mlp_norm.weight"), eps)
        h = torch.nn.functional.silu(h @ p("mlp.w_gate.weight")) * (h @ p("mlp.w_up.weight"))
        x = x + h @ p("mlp.w_down.weight")
    x = rmsnorm(x, P["norm_f.weight"], eps)
    return x @ P["wte.weight"].T


def make(arch, V=64, maxT=16, C=32, NH=4, L=2, B=3, T=12, F=None):
    P = {"wte.weight": rand(V, C, std=0.3)}
    if arch == "gpt":
        F = F or 4 * C
        P["wpe.weight"] = rand(maxT, C, std=0.1)
        P["ln_f.weight"] = rand(C, mean=1.0)
        P["ln_f.bias"] = rand(C)
        for i in range(L):
            P.update({
                f"h.{i}.ln_1.weight": rand(C, mean=1.0), f"h.{i}.ln_1.bias": rand(C),
                f"h.{i}.attn.c_attn.weight": rand(C, 3 * C, std=0.2), f"h.{i}.attn.c_attn.bias": rand(3 * C),
                f"h.{i}.attn.c_proj.weight": rand(C, C, std=0.2), f"h.{i}.attn.c_proj.bias": rand(C),
                f"h.{i}.ln_2.weight": rand(C, mean=1.0), f"h.{i}.ln_2.bias": rand(C),
                f"h.{i}.mlp.c_fc.weight": rand(C, F, std=0.2), f"h.{i}.mlp.c_fc.bias": rand(F),
                f"h.{i}.mlp.c_proj.weight": rand(F, C, std=0.2), f"h.{i}.mlp.c_proj.bias": rand(C),
            })
    else:
        F = F or 88
        P["norm_f.weight"] = rand(C, mean=1.0)
        for i in range(L):
            P.update({
                f"h.{i}.attn_norm.weight": rand(C, mean=1.0),
                f"h.{i}.attn.wqkv.weight": rand(C, 3 * C, std=0.2),
                f"h.{i}.attn.wo.weight": rand(C, C, std=0.2),
                f"h.{i}.mlp_norm.weight": rand(C, mean=1.0),
                f"h.{i}.mlp.w_gate.weight": rand(C, F, std=0.2),
                f"h.{i}.mlp.w_up.weight": rand(C, F, std=0.2),
                f"h.{i}.mlp.w_down.weight": rand(F, C, std=0.2),
            })
    # Round to f32 first so both sides start from the same numbers.
    P = {k: v.float().double().requires_grad_(True) for k, v in P.items()}
    tokens = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    logits = (gpt if arch == "gpt" else llama)(P, tokens, B, T, C, NH, L)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    out = {k: v.detach().float().contiguous() for k, v in P.items()}
    out.update({"grad." + k: v.grad.float().contiguous() for k, v in P.items()})
    out["tokens"] = tokens.reshape(-1).to(torch.int32)
    out["targets"] = targets.reshape(-1).to(torch.int32)
    out["loss"] = loss.detach().float().reshape(1)
    meta = {"arch": arch, "vocab_size": str(V), "max_seq_len": str(maxT), "d_model": str(C),
            "n_head": str(NH), "n_layer": str(L), "d_ff": str(F), "batch": str(B), "seq_len": str(T),
            "torch": torch.__version__, "generator": "scripts/gen_fixtures.py"}
    return out, meta


def kernels_main(out_dir):
    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "kernels", "tests", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    for arch in ("gpt", "llama"):
        tensors, meta = make(arch)
        path = os.path.join(out_dir, f"{arch}2l.safetensors")
        save_file(tensors, path, metadata=meta)
        print(f"wrote {path}: loss {tensors['loss'].item():.6f}, {len(tensors)} tensors")


HF_VOCAB = 320
HF_EOT = "<|endoftext|>"


def hf_tokenizer():
    """A byte-level BPE of HF_VOCAB tokens (GPT-2's pre-tokenizer), `<|endoftext|>` its last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=HF_VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(__file__) as f:
        text = f.read()
    tok.train_from_iterator([text], trainer=trainer)
    tok.add_special_tokens([HF_EOT])
    assert tok.get_vocab_size() == HF_VOCAB, tok.get_vocab_size()
    return tok


def hf_models():
    """(folder name, model, save_pretrained kwargs) of every family, seeded."""
    import transformers as tf

    eot = HF_VOCAB - 1
    common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, bos_token_id=eot, eos_token_id=eot,
                  rms_norm_eps=1e-5)
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
    out = []
    torch.manual_seed(20261203)
    out.append(("gpt2", tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=HF_VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot)), {}))
    out.append(("llama", tf.LlamaForCausalLM(tf.LlamaConfig(
        **common, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=llama3_rope, tie_word_embeddings=False)), {}))
    out.append(("llama-sharded", tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True)),
                {"max_shard_size": "100KB"}))
    out.append(("mistral", tf.MistralForCausalLM(tf.MistralConfig(
        **common, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False)), {}))
    out.append(("qwen2", tf.Qwen2ForCausalLM(tf.Qwen2Config(
        **common, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)), {}))
    return out


def hf_reference(model, B=2, T=24):
    """Tokens, targets, logits, loss and gradients of `model` (float64 copy), HF names."""
    ref = copy.deepcopy(model).double().eval()
    tokens = torch.randint(0, HF_VOCAB, (B, T))
    targets = torch.randint(0, HF_VOCAB, (B, T))
    logits = ref(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, HF_VOCAB), targets.reshape(-1))
    loss.backward()
    out = {"tokens": tokens.reshape(-1).to(torch.int32), "targets": targets.reshape(-1).to(torch.int32),
           "logits": logits.detach().float().reshape(B * T, HF_VOCAB).contiguous(),
           "loss": loss.detach().float().reshape(1)}
    for name, p in ref.named_parameters():
        out["grad." + name] = p.grad.float().contiguous()
    return out, {"batch": str(B), "seq_len": str(T)}


def hf_main(out_dir):
    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    import transformers

    tok = hf_tokenizer()
    for name, model, kwargs in hf_models():
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        model.config._attn_implementation = "eager"
        model.save_pretrained(folder, **kwargs)
        tok.save(os.path.join(folder, "tokenizer.json"))
        tensors, meta = hf_reference(model)
        meta.update({"torch": torch.__version__, "transformers": transformers.__version__,
                     "generator": "scripts/gen_fixtures.py hf"})
        save_file(tensors, os.path.join(out_dir, f"{name}.reference.safetensors"), metadata=meta)
        print(f"wrote {folder}: loss {tensors['loss'].item():.6f}, {sorted(os.listdir(folder))}")
    hf_moe_main(out_dir)


def hf_moe_models():
    """(folder name, model) of the mixture-of-experts families, seeded on their own."""
    import transformers as tf

    eot = HF_VOCAB - 1
    common = dict(vocab_size=HF_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=eot, eos_token_id=eot,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2)
    torch.manual_seed(20261204)
    mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(
        **common, intermediate_size=32, num_local_experts=4, output_router_logits=True, router_aux_loss_coef=0.02,
        router_jitter_noise=0.0, sliding_window=None, rope_theta=1000000.0))
    qwen = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **common, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0], output_router_logits=False,
        router_aux_loss_coef=0.001, rope_theta=1000000.0))
    return [("mixtral", mixtral), ("qwen2-moe", qwen)]


def hf_moe_reference(model, B=2, T=24):
    """`hf_reference` for an MoE model: also the load-balancing loss `aux_loss` of the routing and the
    objective (cross-entropy, plus `router_aux_loss_coef` * aux when `output_router_logits`, as
    transformers adds it to its `loss`), whose gradients these are."""
    ref = copy.deepcopy(model).double().eval()
    ref.config._experts_implementation = "eager"  # grouped_mm has no float64
    tokens = torch.randint(0, HF_VOCAB, (B, T))
    targets = torch.randint(0, HF_VOCAB, (B, T))
    out = ref(input_ids=tokens, output_router_logits=True)
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, HF_VOCAB), targets.reshape(-1))
    aux = out.aux_loss
    coef = ref.config.router_aux_loss_coef if ref.config.output_router_logits else 0.0
    objective = ce + coef * aux
    objective.backward()
    res = {"tokens": tokens.reshape(-1).to(torch.int32), "targets": targets.reshape(-1).to(torch.int32),
           "logits": logits.detach().float().reshape(B * T, HF_VOCAB).contiguous(),
           "loss": ce.detach().float().reshape(1), "aux_loss": aux.detach().float().reshape(1),
           "objective": objective.detach().float().reshape(1)}
    for name, p in ref.named_parameters():
        for saved, g in saved_pieces(model, name, p.grad):
            res["grad." + saved] = g.float().contiguous()
    return res, {"batch": str(B), "seq_len": str(T), "aux_loss_coef": str(coef)}


def saved_pieces(model, name, t):
    """(saved name, tensor) of in-memory parameter `name` (value or gradient `t`): transformers 5
    keeps a block's experts fused (`mlp.experts.gate_up_proj` [E, 2f, c], `mlp.experts.down_proj`
    [E, c, f]) and saves them per expert under the family's names (Mixtral:
    `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down), its router
    `block_sparse_moe.gate`; Qwen2-MoE: `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`)."""
    mixtral = model.config.model_type == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if name.endswith(".mlp.experts.gate_up_proj"):
        layer = name[: -len(".mlp.experts.gate_up_proj")]
        f = t.shape[1] // 2
        return [x for e in range(t.shape[0]) for x in (
            (f"{layer}.{block}.experts.{e}.{gate}.weight", t[e, :f]), (f"{layer}.{block}.experts.{e}.{up}.weight", t[e, f:]))]
    if name.endswith(".mlp.experts.down_proj"):
        layer = name[: -len(".mlp.experts.down_proj")]
        return [(f"{layer}.{block}.experts.{e}.{down}.weight", t[e]) for e in range(t.shape[0])]
    if mixtral and name.endswith(".mlp.gate.weight"):
        return [(name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight"), t)]
    return [(name, t)]


def check_saved_names(model, folder):
    """Every in-memory parameter, split by `saved_pieces`, is in the saved file with its values."""
    from safetensors.torch import load_file
    saved = load_file(os.path.join(folder, "model.safetensors"))
    names = set()
    for name, p in model.named_parameters():
        for n, v in saved_pieces(model, name, p.detach()):
            assert torch.equal(saved[n], v), n
            names.add(n)
    assert names == set(saved), sorted(set(saved) ^ names)


def hf_moe_main(out_dir):
    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    import transformers

    for name, model in hf_moe_models():
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        model.config._attn_implementation = "eager"
        model.save_pretrained(folder)
        # The tokenizer of the other folders (trained by `hf` on this script's text as it was then).
        shutil.copy(os.path.join(out_dir, "llama", "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
        check_saved_names(model, folder)
        tensors, meta = hf_moe_reference(model)
        meta.update({"torch": torch.__version__, "transformers": transformers.__version__,
                     "generator": "scripts/gen_fixtures.py hf-moe"})
        save_file(tensors, os.path.join(out_dir, f"{name}.reference.safetensors"), metadata=meta)
        print(f"wrote {folder}: loss {tensors['loss'].item():.6f}, aux {tensors['aux_loss'].item():.6f}, "
              f"{sorted(os.listdir(folder))}")


def hf_gpu_main(out_dir):
    """`llama-gpu`: a LlamaForCausalLM the GPU kernels run (head dimension 64, grouped-query
    attention with 2 query heads per key/value head, an untied head), for tests/e2e_gpu.rs."""
    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    import transformers as tf

    eot = HF_VOCAB - 1
    torch.manual_seed(20261204)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, bos_token_id=eot, eos_token_id=eot,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False))
    folder = os.path.join(out_dir, "llama-gpu")
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    # The tokenizer of the other folders (trained by `hf` on this script's text as it was then).
    shutil.copy(os.path.join(out_dir, "llama", "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    print(f"wrote {folder}: {sorted(os.listdir(folder))}, transformers {tf.__version__}")


GENERATE_MIN_GAP = 1e-3
GENERATE_NEW_TOKENS = 24
GENERATE_SEEDS = 24


def hf_generate_main(out_dir):
    import json
    import transformers as tf

    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    out = {}
    for name in ["gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen2-moe"]:
        model = tf.AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, name), dtype=torch.float64).eval()
        model.config._experts_implementation = "eager"  # grouped_mm has no float64
        vocab = model.config.vocab_size
        best = None
        for seed in range(GENERATE_SEEDS):
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, vocab - 1, (1, 9), generator=g)
            with torch.no_grad():
                res = model.generate(prompt, max_new_tokens=GENERATE_NEW_TOKENS, min_new_tokens=GENERATE_NEW_TOKENS,
                                     do_sample=False, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=vocab - 1)
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in res.scores]
            new = res.sequences[0, prompt.shape[1]:].tolist()
            # Random tiny models often repeat one token: keep the prompt whose output varies most.
            if min(gaps) >= GENERATE_MIN_GAP and (best is None or len(set(new)) > len(set(best[1]))):
                best = (prompt[0].tolist(), new, min(gaps), seed)
        if best is None:
            sys.exit(f"{name}: no prompt of {GENERATE_SEEDS} seeds keeps every greedy gap above {GENERATE_MIN_GAP}")
        prompt, new, gap, seed = best
        out[name] = {"prompt": prompt, "generated": new, "min_gap": gap, "seed": seed}
        print(f"{name}: seed {seed}, min gap {gap:.4g}, generated {new}")
    out["generator"] = f"scripts/gen_fixtures.py hf-generate (torch {torch.__version__}, transformers {tf.__version__})"
    with open(os.path.join(out_dir, "generate.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def ds_moe_block(h, p, E, k, cap_factor, min_cap):
    """One DeepSpeed MoE feed-forward (training or evaluation by `cap_factor`) on h [S, C]: the
    router, DeepSpeed's top-2 gating, the GELU experts on the dispatched rows, the combine, the
    residual mix. Returns (output, l_aux, z, dropped pairs)."""
    import deepspeed.moe.sharded_moe as ds
    assert k == 2
    # DeepSpeed gates in float32 (its masks are `.float()`); its einsum is promoted so the
    # reference stays float64 (the same contractions).
    if not getattr(ds, "_f64", False):
        ds.einsum = lambda rule, a, b: torch.einsum(rule, a.double(), b.double())
        ds._f64 = True
    top2gating = ds.top2gating
    gelu = lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    logits = h @ p("moe.router.weight")
    l_aux, combine, dispatch, _ = top2gating(logits, cap_factor, min_cap, drop_tokens=True,
                                             top2_2nd_expert_sampling=False)
    dispatched = torch.einsum("sec,sm->ecm", dispatch.to(h.dtype), h)
    outs = []
    for e in range(E):
        x = dispatched[e]
        q = lambda s: p(f"moe.experts.{e}.{s}")
        outs.append(gelu(x @ q("c_fc.weight") + q("c_fc.bias")) @ q("c_proj.weight") + q("c_proj.bias"))
    y = torch.einsum("sec,ecm->sm", combine.to(h.dtype), torch.stack(outs))
    r = gelu(h @ p("moe.residual.c_fc.weight") + p("moe.residual.c_fc.bias")) @ p("moe.residual.c_proj.weight") \
        + p("moe.residual.c_proj.bias")
    coef = torch.softmax(h @ p("moe.coefficient.weight") + p("moe.coefficient.bias"), dim=-1)
    y = y * coef[..., 0:1] + r * coef[..., 1:]
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    dropped = 2 * h.shape[0] - int(dispatch.any(dim=2).sum())
    return y, l_aux, z, dropped


def ds_gpt_moe(P, tokens, B, T, C, NH, L, moe_layers, E, k, cap_factor, min_cap):
    x = P["wte.weight"][tokens] + P["wpe.weight"][:T][None]
    aux, z, dropped = 0.0, 0.0, []
    for i in range(L):
        p = lambda s: P[f"h.{i}.{s}"]
        h = torch.nn.functional.layer_norm(x, (C,), p("ln_1.weight"), p("ln_1.bias"), 1e-5)
        qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        x = x + attention(qkv, B, T, C, NH) @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = torch.nn.functional.layer_norm(x, (C,), p("ln_2.weight"), p("ln_2.bias"), 1e-5)
        if i in moe_layers:
            y, l_aux, zi, d = ds_moe_block(h.reshape(B * T, C), p, E, k, cap_factor, min_cap)
            x = x + y.reshape(B, T, C)
            aux, z = aux + l_aux, z + zi
            dropped.append(d)
        else:
            h = torch.nn.functional.gelu(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"), approximate="tanh")
            x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = torch.nn.functional.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
    return x @ P["wte.weight"].T, aux, z, dropped


def moe_ds_main(out_dir):
    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "kernels", "tests", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(20261204)
    V, maxT, C, NH, L, B, T, F = 32, 8, 16, 2, 3, 2, 8, 24
    E, k, DF, moe_layers = 4, 2, 12, [1, 2]
    train_cf, eval_cf, min_cap, aux_coef, z_coef = 0.75, 2.0, 2, 0.05, 0.01
    P = {"wte.weight": rand(V, C, std=0.3), "wpe.weight": rand(maxT, C, std=0.1),
         "ln_f.weight": rand(C, mean=1.0), "ln_f.bias": rand(C)}
    for i in range(L):
        n = lambda s: f"h.{i}.{s}"
        P.update({n("ln_1.weight"): rand(C, mean=1.0), n("ln_1.bias"): rand(C),
                  n("attn.c_attn.weight"): rand(C, 3 * C, std=0.2), n("attn.c_attn.bias"): rand(3 * C),
                  n("attn.c_proj.weight"): rand(C, C, std=0.2), n("attn.c_proj.bias"): rand(C),
                  n("ln_2.weight"): rand(C, mean=1.0), n("ln_2.bias"): rand(C)})
        if i in moe_layers:
            P[n("moe.router.weight")] = rand(C, E, std=0.5)
            for prefix in [f"moe.experts.{e}" for e in range(E)] + ["moe.residual"]:
                P.update({n(f"{prefix}.c_fc.weight"): rand(C, DF, std=0.2), n(f"{prefix}.c_fc.bias"): rand(DF),
                          n(f"{prefix}.c_proj.weight"): rand(DF, C, std=0.2), n(f"{prefix}.c_proj.bias"): rand(C)})
            P[n("moe.coefficient.weight")] = rand(C, 2, std=0.3)
            P[n("moe.coefficient.bias")] = rand(2)
        else:
            P.update({n("mlp.c_fc.weight"): rand(C, F, std=0.2), n("mlp.c_fc.bias"): rand(F),
                      n("mlp.c_proj.weight"): rand(F, C, std=0.2), n("mlp.c_proj.bias"): rand(C)})
    P = {k_: v.float().double().requires_grad_(True) for k_, v in P.items()}
    tokens = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    ce = lambda logits: torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    logits, aux, z, dropped = ds_gpt_moe(P, tokens, B, T, C, NH, L, moe_layers, E, k, train_cf, min_cap)
    loss = ce(logits)
    objective = loss + aux_coef * aux + z_coef * z
    objective.backward()
    with torch.no_grad():
        eval_logits, _, _, eval_dropped = ds_gpt_moe(P, tokens, B, T, C, NH, L, moe_layers, E, k, eval_cf, min_cap)
        eval_loss = ce(eval_logits)
    assert sum(dropped) > 0 and sum(eval_dropped) == 0, (dropped, eval_dropped)
    out = {k_: v.detach().float().contiguous() for k_, v in P.items()}
    out.update({"grad." + k_: v.grad.float().contiguous() for k_, v in P.items()})
    out["tokens"] = tokens.reshape(-1).to(torch.int32)
    out["targets"] = targets.reshape(-1).to(torch.int32)
    out["dropped"] = torch.tensor(dropped, dtype=torch.int32)
    for name, v in [("loss", loss), ("aux_loss", aux), ("z_loss", z), ("objective", objective),
                    ("eval_loss", eval_loss)]:
        out[name] = v.detach().float().reshape(1)
    import deepspeed
    meta = {"arch": "gpt", "vocab_size": str(V), "max_seq_len": str(maxT), "d_model": str(C), "n_head": str(NH),
            "n_layer": str(L), "d_ff": str(F), "batch": str(B), "seq_len": str(T), "num_experts": str(E),
            "top_k": str(k), "d_expert": str(DF), "dense_layers": "0", "capacity_factor": str(train_cf),
            "eval_capacity_factor": str(eval_cf), "min_capacity": str(min_cap), "aux_loss_coef": str(aux_coef),
            "z_loss_coef": str(z_coef), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "generator": "scripts/gen_fixtures.py moe-ds"}
    path = os.path.join(out_dir, "gpt_moe_ds.safetensors")
    save_file(out, path, metadata=meta)
    print(f"wrote {path}: loss {loss.item():.6f}, aux {aux.item():.6f}, z {z.item():.6f}, dropped {dropped}, "
          f"eval loss {eval_loss.item():.6f}, {len(out)} tensors, deepspeed {deepspeed.__version__}")


def moe_routing_main(out_dir):
    """DeepSpeed's own gating functions (deepspeed.moe.sharded_moe.top1gating / top2gating, as
    installed) on random router logits in float64: per case the logits, an upstream weight `A`
    on each (token, expert) combine weight, DeepSpeed's l_aux, its combine weights summed over
    the capacity slots `[s, e]` (0 where dropped), and d(Σ A·weights + 0.3·l_aux)/d(logits).
    Cases: top-1 (no renormalisation, the first choice's l_aux) with a capacity that drops
    nothing — without RTS `top1gating` keeps an expert's tokens by `torch.topk` of a 0/1 mask,
    whose ties come out in an unspecified order, so which tokens it drops is not a rule Tessera
    can follow; Tessera's token-order rule is DeepSpeed's `top2gating` one, checked here — top-2
    with drops (renormalised over the kept choices), top-2 with drop_tokens false. Noise off (no RSample, no RTS, no
    second-expert sampling): noise cannot match bit for bit; kernels/src/ops/moe/tests.rs tests
    its properties instead."""
    import deepspeed
    import deepspeed.moe.sharded_moe as ds

    out_dir = out_dir or os.path.join(os.path.dirname(__file__), "..", "kernels", "tests", "fixtures")
    # DeepSpeed's top-2 casts its 0/1 masks with `.float()`; promoting its einsum keeps the
    # reference float64 (the masks are exact in either type).
    if not getattr(ds, "_f64", False):
        ds.einsum = lambda rule, a, b: torch.einsum(rule, a.double(), b.double())
        ds._f64 = True
    torch.manual_seed(20261205)
    S, E = 24, 4
    cases = [("top1", 1, 2.0, 2, True), ("top2", 2, 0.75, 2, True), ("top2_nodrop", 2, 0.75, 2, False)]
    out, meta = {}, {"tokens": str(S), "experts": str(E), "aux_weight": "0.3", "deepspeed": deepspeed.__version__,
                     "torch": torch.__version__, "generator": "scripts/gen_fixtures.py moe-routing"}
    for name, k, cf, min_cap, drop in cases:
        logits = (torch.randn(S, E, dtype=DT) * 1.5).float().double().requires_grad_(True)
        A = torch.randn(S, E, dtype=DT).float().double()
        if k == 1:
            l_aux, combine, _, _ = ds.top1gating(logits, cf, min_cap, noisy_gate_policy=None, drop_tokens=drop, use_rts=False)
        else:
            l_aux, combine, _, _ = ds.top2gating(logits.clone(), cf, min_cap, drop_tokens=drop, top2_2nd_expert_sampling=False)
        w = combine.sum(dim=2)
        ((A * w).sum() + 0.3 * l_aux).backward()
        out.update({f"{name}.logits": logits.detach().float(), f"{name}.upstream": A.float(),
                    f"{name}.weights": w.detach().float().contiguous(), f"{name}.l_aux": l_aux.detach().float().reshape(1),
                    f"{name}.grad_logits": logits.grad.float().contiguous()})
        meta.update({f"{name}.k": str(k), f"{name}.capacity_factor": repr(cf), f"{name}.min_capacity": str(min_cap),
                     f"{name}.drop_tokens": str(int(drop))})
        print(f"{name}: l_aux {l_aux.item():.6f}, kept weights {(w > 0).sum().item()} of {S * k}")
    path = os.path.join(out_dir, "moe_routing_ds.safetensors")
    save_file(out, path, metadata=meta)
    print(f"wrote {path}: {len(out)} tensors, {os.path.getsize(path)} bytes, deepspeed {deepspeed.__version__}")


ADAGRAD = dict(lr_decay=0.1, eps=1e-10, initial_accumulator_value=0.1)
ADAGRAD_SIZES = [7, 5]
ADAGRAD_DECAY = [0.05, 0.0]
ADAGRAD_LRS = [0.05, 0.04, 0.03, 0.05, 0.02, 0.01]


def adagrad_main(out_dir):
    import json

    out_dir = out_dir or "kernels/tests/fixtures"
    n = sum(ADAGRAD_SIZES)
    f32 = lambda t: t.to(torch.float32).to(DT)
    p0 = f32(torch.rand(n, dtype=DT) * 2 - 1)
    grads = [f32((torch.rand(n, dtype=DT) * 2 - 1) * 10.0 ** torch.randint(-2, 2, (n,)).to(DT)) for _ in ADAGRAD_LRS]
    params = [t.clone().requires_grad_(True) for t in torch.split(p0, ADAGRAD_SIZES)]
    groups = [{"params": [t], "weight_decay": wd} for t, wd in zip(params, ADAGRAD_DECAY)]
    opt = torch.optim.Adagrad(groups, lr=ADAGRAD_LRS[0], foreach=False, **ADAGRAD)
    steps = []
    for g, lr in zip(grads, ADAGRAD_LRS):
        for t, gt in zip(params, torch.split(g, ADAGRAD_SIZES)):
            t.grad = gt.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        flat = lambda ts: [x for t in ts for x in t.detach().tolist()]
        steps.append({"p": flat(params), "sum": flat(opt.state[t]["sum"] for t in params)})
    fixture = {
        "about": f"torch {torch.__version__} torch.optim.Adagrad (float64, foreach=False); scripts/gen_fixtures.py adagrad",
        "sizes": ADAGRAD_SIZES,
        "weight_decay": ADAGRAD_DECAY,
        **ADAGRAD,
        "lr": ADAGRAD_LRS,
        "p0": p0.tolist(),
        "grads": [g.tolist() for g in grads],
        "steps": steps,
    }
    path = os.path.join(out_dir, "adagrad.json")
    with open(path, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(ADAGRAD_LRS)} steps of {n} parameters, torch {torch.__version__}")


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    out_dir = sys.argv[2] if len(sys.argv) > 2 else None
    if what == "kernels":
        kernels_main(out_dir)
    elif what == "hf":
        hf_main(out_dir)
    elif what == "hf-moe":
        hf_moe_main(out_dir)
    elif what == "hf-gpu":
        hf_gpu_main(out_dir)
    elif what == "moe-routing":
        moe_routing_main(out_dir)
    elif what == "moe-ds":
        moe_ds_main(out_dir)
    elif what == "hf-generate":
        hf_generate_main(out_dir)
    elif what == "adagrad":
        adagrad_main(out_dir)
    else:
        sys.exit("usage: gen_fixtures.py kernels|hf|hf-moe|hf-gpu|hf-generate|moe-ds|moe-routing|adagrad [OUT_DIR]")


if __name__ == "__main__":
    main()
