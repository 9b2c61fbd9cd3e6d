"""GEMM layout probe (issue 5): times GPT-2 124M's block GEMMs in PyTorch (cuBLAS/cuBLASLt, bf16,
f32 accumulation) with the weight stored [in, out] (Tessera's layout: the forward is an "NN"
product) and [out, in] (nn.Linear's: "TN"), forward (with bias), input gradient and weight
gradient. Usage: python3 gemm_layouts.py [--tokens 16384] [--d 768]"""
import argparse, torch

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=16384)
p.add_argument("--d", type=int, default=768)
a = p.parse_args()
dev, bf = "cuda", torch.bfloat16
n, d = a.tokens, a.d

def bench(f, reps=50):
    for _ in range(5): f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

print(f"| GEMM ({n} tokens) | W [in,out] ms | W [out,in] ms | TFLOP/s [in,out] | TFLOP/s [out,in] |")
print("|---|---|---|---|---|")
for name, k, m in [("qkv", d, 3 * d), ("proj", d, d), ("fc", d, 4 * d), ("fc2", 4 * d, d)]:
    x = torch.randn(n, k, device=dev, dtype=bf)
    dy = torch.randn(n, m, device=dev, dtype=bf)
    w_io = torch.randn(k, m, device=dev, dtype=bf)      # [in, out]
    w_oi = w_io.t().contiguous()                          # [out, in]
    b = torch.randn(m, device=dev, dtype=bf)
    fl = 2 * n * k * m
    rows = [
        ("fwd+bias", lambda: torch.addmm(b, x, w_io), lambda: torch.addmm(b, x, w_oi.t())),
        ("dgrad", lambda: dy @ w_io.t(), lambda: dy @ w_oi),
        ("wgrad (f32 out)", lambda: torch.mm(x.t(), dy, out_dtype=torch.float32), lambda: torch.mm(dy.t(), x, out_dtype=torch.float32)),
    ]
    for what, f1, f2 in rows:
        try:
            t1, t2 = bench(f1), bench(f2)
            print(f"| {name} {what} | {t1:.4f} | {t2:.4f} | {fl / t1 / 1e9:.0f} | {fl / t2 / 1e9:.0f} |")
        except Exception as ex:  # out_dtype needs a recent PyTorch
            print(f"| {name} {what} | failed: {type(ex).__name__}: {str(ex)[:80]} | | | |")
