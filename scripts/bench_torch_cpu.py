#!/usr/bin/env python3
"""PyTorch-on-CPU peer of `cargo bench --bench train_step`: times AdamW training steps of the
same GPT-2 model (pre-LN blocks, fused qkv, GELU(tanh), tied LM head, f32) on the same batch and
sequence shapes, and prints one JSON line:

    {"system": "pytorch", "torch": ..., "num_params": ..., "step_ms": ..., "tokens_per_s": ...,
     "fwd_ms": ..., "bwd_ms": ..., "opt_ms": ..., ...}

or {"skipped": "<reason>"} when torch is not importable. A step is: zero grads, forward + mean
cross-entropy, backward, clip the global grad norm to 1.0, AdamW step (decay on 2-D weights).
Times are medians over the timed steps (robust to other processes on a shared machine).

    python3 scripts/bench_torch_cpu.py --model gpt-tiny --batch 8 --seq 128 --threads 2
"""
import argparse
import json
import math
import statistics
import sys
import time

# Shapes of the Tessera presets (src/zoo.rs) with the byte-level vocabulary; the bench passes
# every dimension explicitly, these are the defaults for standalone use.
PRESETS = {
    "gpt-tiny": dict(n_layer=4, n_head=4, d_model=128, max_seq=128),
    "gpt-10m": dict(n_layer=6, n_head=6, d_model=384, max_seq=256),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS))
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-seq", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.seq is None:
        args.seq = args.max_seq
    if args.seq > args.max_seq or args.d_model % args.n_head:
        p.error(f"bad shape: seq {args.seq} (max {args.max_seq}), d_model {args.d_model}, n_head {args.n_head}")
    return args


def build_model(torch, a):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = a.d_model
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            heads = lambda z: z.view(b, t, a.n_head, d // a.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.d_model)
            self.wpe = nn.Embedding(a.max_seq, a.d_model)
            self.h = nn.ModuleList(Block() for _ in range(a.n_layer))
            self.ln_f = nn.LayerNorm(a.d_model)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * a.n_layer) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, std=std)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1])
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
            return F.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))

    return Gpt()


def make_optimizer(torch, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8), "default"


def run(torch, a):
    torch.manual_seed(1234)
    model = build_model(torch, a)
    opt, opt_impl = make_optimizer(torch, model)
    data = torch.randint(0, a.vocab, (a.batch * a.seq + 1,))
    idx, targets = data[:-1].view(a.batch, a.seq), data[1:].view(a.batch, a.seq)
    samples = {"step": [], "fwd": [], "bwd": [], "opt": []}
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = model(idx, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            for key, dt in (("step", t3 - t0), ("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2)):
                samples[key].append(dt * 1e3)
    return model, opt_impl, {key: statistics.median(v) for key, v in samples.items()}


def main():
    a = parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"skipped": f"torch is not importable ({e})"}))
        return 0
    torch.set_num_threads(a.threads)
    model, opt_impl, ms = run(torch, a)
    out = {
        "system": "pytorch",
        "torch": torch.__version__,
        "model": a.model,
        "batch": a.batch,
        "seq": a.seq,
        "threads": torch.get_num_threads(),
        "num_params": sum(p.numel() for p in model.parameters()),
        "adamw": opt_impl,
        "step_ms": ms["step"],
        "fwd_ms": ms["fwd"],
        "bwd_ms": ms["bwd"],
        "opt_ms": ms["opt"],
        "tokens_per_s": a.batch * a.seq / (ms["step"] / 1e3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
