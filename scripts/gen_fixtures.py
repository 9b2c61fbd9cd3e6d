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

`hf-gpu` -- `llama-gpu`, a LlamaForCausalLM of head dimension 64 with grouped-query attention and an
untied head (what the GPU kernels run), for tests/e2e_gpu.rs; no reference file.

Usage: python3 scripts/gen_fixtures.py kernels [OUT_DIR]   (default kernels/tests/fixtures)
       python3 scripts/gen_fixtures.py hf [OUT_DIR]        (default tests/fixtures/hf)
       python3 scripts/gen_fixtures.py hf-moe [OUT_DIR]    (default tests/fixtures/hf)
       python3 scripts/gen_fixtures.py hf-gpu [OUT_DIR]    (default tests/fixtures/hf)
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
        res["grad." + name] = p.grad.float().contiguous()
    return res, {"batch": str(B), "seq_len": str(T), "aux_loss_coef": str(coef)}


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
    else:
        sys.exit("usage: gen_fixtures.py kernels|hf|hf-moe|hf-gpu [OUT_DIR]")


if __name__ == "__main__":
    main()
