#!/usr/bin/env python3
"""PyTorch-on-CPU peer of `cargo bench --bench train_step`: times AdamW training steps of the
same model on the same batch and sequence shapes, f32, and prints one JSON line. The model is
GPT-2 (`--arch gpt`: pre-LN blocks, fused qkv, GELU(tanh), tied LM head) or LLaMA (`--arch llama`:
RMSNorm, RoPE in the rotate-half convention with `--rope-theta`, fused qkv with `--n-kv-head`
key/value heads repeated to the query heads, SwiGLU of width `--d-ff`, no biases, the LM head
tied to the embedding or not by `--tie`/`--no-tie`):

    {"system": "pytorch", "torch": ..., "num_params": ..., "step_ms": ..., "tokens_per_s": ...,
     "fwd_ms": ..., "bwd_ms": ..., "opt_ms": ..., ...}

or {"skipped": "<reason>"} when torch is not importable. A step is: zero grads, forward + mean
cross-entropy, backward, clip the global grad norm to 1.0, AdamW step (decay on 2-D weights).
Times are medians over the timed steps (robust to other processes on a shared machine).

    python3 scripts/bench_torch_cpu.py --model gpt-tiny --batch 8 --seq 128 --threads 2
    python3 scripts/bench_torch_cpu.py --model llama-10m --batch 4 --seq 256 --threads 2
"""
import argparse
import json
import math
import statistics
import sys
import time

# Shapes of the bench's cases (the Tessera presets of src/zoo.rs, and llama-10m, which only the
# bench defines) with the byte-level vocabulary; the bench passes every dimension explicitly,
# these are the defaults for standalone use.
GPT = dict(arch="gpt", rope_theta=10000.0, norm_eps=1e-5, tie=True)
LLAMA = dict(arch="llama", rope_theta=10000.0, norm_eps=1e-5, tie=True)
PRESETS = {
    "gpt-tiny": dict(GPT, n_layer=4, n_head=4, n_kv_head=4, d_model=128, d_ff=512, max_seq=128),
    "gpt-10m": dict(GPT, n_layer=6, n_head=6, n_kv_head=6, d_model=384, d_ff=1536, max_seq=256),
    "llama-tiny": dict(LLAMA, n_layer=4, n_head=4, n_kv_head=4, d_model=128, d_ff=344, max_seq=128),
    "llama-10m": dict(LLAMA, n_layer=6, n_head=6, n_kv_head=2, d_model=384, d_ff=1024, max_seq=256),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS))
    p.add_argument("--arch", choices=["gpt", "llama"])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-seq", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-kv-head", type=int, help="key/value heads (llama; gpt has one per query head)")
    p.add_argument("--d-model", type=int)
    p.add_argument("--d-ff", type=int, help="MLP width (llama's SwiGLU; gpt's is 4 * d_model)")
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--norm-eps", type=float)
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, help="LM head tied to the embedding")
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
    if args.arch == "gpt" and (args.n_kv_head != args.n_head or args.d_ff != 4 * args.d_model or not args.tie):
        p.error(f"gpt blocks have n_kv_head = n_head, d_ff = 4 * d_model and a tied head: {vars(args)}")
    if args.arch == "llama" and (args.n_head % args.n_kv_head or (args.d_model // args.n_head) % 2):
        p.error(f"llama needs n_kv_head dividing n_head and an even head dimension: {vars(args)}")
    return args


def lm_loss(F, x, head, targets):
    """Mean cross-entropy of the logits `x @ head.T` against `targets`."""
    logits = x @ head.t()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def init_weights(nn, model, n_layer):
    """GPT-2's initialisation, as Tessera's `Model::init_params`: N(0, 0.02) matrices, the
    residual-output projections scaled by 1/sqrt(2L); norms keep their ones/zeros."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            proj = name.endswith(("proj.weight", "wo.weight", "w_down.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if proj else 0.02)


def build_model(torch, a):
    return build_gpt(torch, a) if a.arch == "gpt" else build_llama(torch, a)


def build_gpt(torch, a):
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
            init_weights(nn, self, a.n_layer)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1])
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            return lm_loss(F, self.ln_f(x), self.wte.weight, targets)  # tied head

    return Gpt()


def rope_tables(torch, a):
    """cos and sin of pos * theta^(-2i/hd) (computed in f64), each [max_seq, hd] with the
    hd/2 frequencies repeated for the two halves that rotate-half pairs."""
    hd = a.d_model // a.n_head
    inv_freq = a.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(a.max_seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def build_llama(torch, a):
    nn, F = torch.nn, torch.nn.functional
    hd = a.d_model // a.n_head
    kv = a.n_kv_head * hd
    group = a.n_head // a.n_kv_head

    def rms_norm(d):
        if hasattr(nn, "RMSNorm"):
            return nn.RMSNorm(d, eps=a.norm_eps)
        return RmsNorm(d)

    class RmsNorm(nn.Module):
        """For torch without nn.RMSNorm (< 2.4)."""

        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a.norm_eps) * self.weight

    def rotate(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = a.d_model
            self.attn_norm, self.mlp_norm = rms_norm(d), rms_norm(d)
            self.wqkv, self.wo = nn.Linear(d, d + 2 * kv, bias=False), nn.Linear(d, d, bias=False)
            self.w_gate, self.w_up = nn.Linear(d, a.d_ff, bias=False), nn.Linear(d, a.d_ff, bias=False)
            self.w_down = nn.Linear(a.d_ff, d, bias=False)

        def forward(self, x, cos, sin):
            b, t, d = x.shape
            q, k, v = self.wqkv(self.attn_norm(x)).split([d, kv, kv], dim=2)
            heads = lambda z, n: z.view(b, t, n, hd).transpose(1, 2)
            q, k, v = rotate(heads(q, a.n_head), cos, sin), rotate(heads(k, a.n_kv_head), cos, sin), heads(v, a.n_kv_head)
            if group > 1:  # query head h reads key/value head h // group
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
            h = self.mlp_norm(x)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.d_model)
            self.h = nn.ModuleList(Block() for _ in range(a.n_layer))
            self.norm_f = rms_norm(a.d_model)
            self.lm_head = None if a.tie else nn.Linear(a.d_model, a.vocab, bias=False)
            cos, sin = rope_tables(torch, a)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            init_weights(nn, self, a.n_layer)

        def forward(self, idx, targets):
            t = idx.shape[1]
            cos, sin = self.cos[:t], self.sin[:t]
            x = self.wte(idx)
            for block in self.h:
                x = block(x, cos, sin)
            head = self.wte.weight if self.lm_head is None else self.lm_head.weight
            return lm_loss(F, self.norm_f(x), head, targets)

    return Llama()


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
        "arch": a.arch,
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
