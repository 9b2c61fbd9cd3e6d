"""Peer baseline: a Mixtral-style mixture-of-experts LM training on one GPU in PyTorch (torch.compile, bf16
autocast, SDPA flash attention with grouped-query heads, RoPE, RMSNorm, untied embeddings, fused AdamW). Each
block's feed-forward is a dropless MoE: a linear router, softmax over the experts in f32, top-k renormalised,
SwiGLU experts, the weighted sum of the k outputs, and transformers' load-balancing loss across the blocks.
The experts run on their rows after a stable sort by expert: `--impl loop` (one matmul per expert, the
row counts read back to the host, as Mixtral's reference code does) or `--impl grouped` (torch._grouped_mm,
one grouped GEMM per projection, no host sync). Synthetic tokens. Prints one JSON line like llama_torch.py.
  python moe_torch.py --layers 6 --d 2048 --heads 32 --kv-heads 4 --experts 8 --top-k 2 --expert-ffn 2816 --seq 2048 --mb 4
"""
import argparse, json, time
import torch, torch.nn as nn, torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=6)
p.add_argument("--d", type=int, default=2048)
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--experts", type=int, default=8)
p.add_argument("--top-k", type=int, default=2)
p.add_argument("--expert-ffn", type=int, default=2816)
p.add_argument("--aux-coef", type=float, default=0.02)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--mb", type=int, default=4)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--compile", type=int, default=1)
p.add_argument("--impl", default="loop", choices=["loop", "grouped"])
p.add_argument("--theta", type=float, default=10000.0)
p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
a = p.parse_args()
E, K, FF = a.experts, a.top_k, a.expert_ffn

def rope_cache(T, hd, theta, dev):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    f = torch.outer(torch.arange(T, device=dev).float(), inv)
    return torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()

def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)

class Attention(nn.Module):
    def __init__(s, d, h, kvh):
        super().__init__(); s.h, s.kvh, s.hd = h, kvh, d // h
        s.n1 = nn.RMSNorm(d, eps=1e-5)
        s.q = nn.Linear(d, d, bias=False); s.kv = nn.Linear(d, 2 * kvh * s.hd, bias=False); s.o = nn.Linear(d, d, bias=False)
    def forward(s, x, cos, sin):
        B, T, C = x.shape
        h = s.n1(x)
        q = s.q(h).view(B, T, s.h, s.hd).transpose(1, 2)
        k, v = s.kv(h).view(B, T, 2, s.kvh, s.hd).permute(2, 0, 3, 1, 4)
        q = q * cos + rotate_half(q) * sin; k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + s.o(y.transpose(1, 2).reshape(B, T, C))

class Router(nn.Module):
    """h -> (probs [N, E] f32, top-k weights [N, K] renormalised, top-k experts [N, K])."""
    def __init__(s, d):
        super().__init__(); s.n2 = nn.RMSNorm(d, eps=1e-5); s.gate = nn.Linear(d, E, bias=False)
    def forward(s, x):
        h = s.n2(x).reshape(-1, x.shape[-1])
        probs = F.softmax(s.gate(h).float(), dim=-1)
        w, i = torch.topk(probs, K, dim=-1)
        return h, probs, w / w.sum(-1, keepdim=True), i

class Experts(nn.Module):
    def __init__(s, d):
        super().__init__()
        s.w_gu = nn.Parameter(torch.randn(E, d, 2 * FF) * 0.02)
        s.w_down = nn.Parameter(torch.randn(E, FF, d) * 0.02)
    def forward(s, xs, counts):
        """xs: [N·K, d] rows sorted by expert; counts: [E] rows per expert (device)."""
        if a.impl == "grouped":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            g, u = torch._grouped_mm(xs, s.w_gu.to(xs.dtype), offs=offs).chunk(2, -1)
            return torch._grouped_mm(F.silu(g) * u, s.w_down.to(xs.dtype), offs=offs)
        outs = []
        for e, rows in enumerate(torch.split(xs, counts.tolist())):  # the host reads the counts
            g, u = (rows @ s.w_gu[e].to(rows.dtype)).chunk(2, -1)
            outs.append((F.silu(g) * u) @ s.w_down[e].to(rows.dtype))
        return torch.cat(outs)

class Block(nn.Module):
    def __init__(s, d, h, kvh):
        super().__init__(); s.attn = Attention(d, h, kvh); s.router = Router(d); s.experts = Experts(d)
    def forward(s, x, cos, sin):
        x = s.attn(x, cos, sin)
        h, probs, w, i = s.router(x)
        flat = i.reshape(-1)
        order = torch.argsort(flat, stable=True)                 # rows grouped by expert, token order
        counts = torch.bincount(flat, minlength=E)
        out = s.experts(h[order // K].to(torch.bfloat16), counts)
        y = torch.empty_like(out).index_copy_(0, order, out)    # back to (token, k) order
        y = (y.view(-1, K, h.shape[-1]).float() * w.unsqueeze(-1)).sum(1)
        return x + y.view_as(x).to(x.dtype), probs, i

def load_balancing(probs, idx):
    """transformers' load_balancing_loss_func over every block's tokens together."""
    probs, idx = torch.cat(probs), torch.cat(idx)
    f = F.one_hot(idx, E).float().mean(0).sum(0)     # [E], counted k times
    return E * (f * probs.mean(0)).sum()

class Moe(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(a.vocab, a.d)
        s.blocks = nn.ModuleList([Block(a.d, a.heads, a.kv_heads) for _ in range(a.layers)])
        s.norm = nn.RMSNorm(a.d, eps=1e-5); s.head = nn.Linear(a.d, a.vocab, bias=False)
    def forward(s, idx, tgt, cos, sin):
        x = s.emb(idx); ps, ids = [], []
        for b in s.blocks:
            x, pr, i = b(x, cos, sin); ps.append(pr); ids.append(i)
        logits = s.head(s.norm(x))
        ce = F.cross_entropy(logits.reshape(-1, a.vocab).float(), tgt.reshape(-1))
        return ce + a.aux_coef * load_balancing(ps, ids), ce

dev = torch.device(a.device); torch.manual_seed(0)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
torch.backends.cuda.matmul.allow_tf32 = True
model = Moe().to(dev)
nparams = sum(p.numel() for p in model.parameters())
active = nparams - a.layers * (E - K) * 3 * a.d * FF
flops_per_tok = 6 * (active - a.vocab * a.d) + 12 * a.layers * a.d * a.seq // 2
cos, sin = rope_cache(a.seq, a.d // a.heads, a.theta, dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
step_model = torch.compile(model) if a.compile else model
g = torch.Generator(device=dev).manual_seed(1234)
times = []
for step in range(a.steps):
    x = torch.randint(0, a.vocab, (a.mb, a.seq + 1), device=dev, generator=g)
    sync(); t = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss, ce = step_model(x[:, :-1], x[:, 1:], cos, sin)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    sync(); times.append(time.perf_counter() - t)
steady = sorted(times[min(10, len(times) - 1):])[len(times[min(10, len(times) - 1):]) // 2]
tok = a.mb * a.seq / steady
print(json.dumps({"system": f"pytorch-compile-moe-{a.impl}", "torch": torch.__version__, "params_M": round(nparams / 1e6, 1),
    "active_params_M": round(active / 1e6, 1), "layers": a.layers, "d": a.d, "experts": E, "top_k": K, "expert_ffn": FF,
    "mb": a.mb, "seq": a.seq, "step_ms_median": round(steady * 1e3, 1), "tok_per_s": round(tok),
    "mfu_vs_989T": round(tok * flops_per_tok / 989e12, 3), "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
    "loss": loss.item(), "ce": ce.item()}))
