"""A Hugging Face model folder with random bf16 weights for the GPU serving benchmark
(scripts/gpu_serve.sh): GPT-2 124M or the 1.1B LLaMA of the decode peer, with the byte-level BPE
tokenizer of tests/fixtures/hf/gpt2 grown to the model's vocabulary (ids past the fixture's are
plain tokens "t<id>", so every generated id decodes to text).
  python3 scripts/gpu_serve_model.py --arch gpt2|llama --out DIR
"""
import argparse, json, os
import torch
import transformers as tf

p = argparse.ArgumentParser()
p.add_argument("--arch", choices=["gpt2", "llama"], required=True)
p.add_argument("--out", required=True)
p.add_argument("--tokenizer", default="tests/fixtures/hf/gpt2/tokenizer.json")
a = p.parse_args()
tok = json.load(open(a.tokenizer))
eos = tok["added_tokens"][0]["id"]
if a.arch == "gpt2":
    cfg = tf.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, n_positions=1024, bos_token_id=eos, eos_token_id=eos)
    make = tf.GPT2LMHeadModel
else:
    cfg = tf.LlamaConfig(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                         intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, bos_token_id=eos, eos_token_id=eos)
    make = tf.LlamaForCausalLM
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = make(cfg).to(torch.bfloat16)
os.makedirs(a.out, exist_ok=True)
model.save_pretrained(a.out)
vocab = tok["model"]["vocab"]
taken = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
for i in range(cfg.vocab_size):
    if i not in taken:
        vocab[f"t{i}"] = i
json.dump(tok, open(os.path.join(a.out, "tokenizer.json"), "w"))
print(f"{a.out}: {a.arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary {cfg.vocab_size}")
