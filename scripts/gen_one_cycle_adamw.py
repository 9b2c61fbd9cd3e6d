#!/usr/bin/env python3
"""Generates the reference fixture for AdamW under DeepSpeed's OneCycle with cycle_momentum.

Reproduces, in float64 and without torch or DeepSpeed installed:
- DeepSpeed's OneCycle (deepspeed/runtime/lr_schedules.py): at construction it writes
  lr = cycle_min_lr and betas = (cycle_min_mom, 0.99) into every param group; after every
  optimizer step, scheduler.step() advances last_batch_iteration and writes the new lr and
  betas = (momentum, 0.99) (the second beta is always 0.99);
- torch.optim.AdamW's single-tensor step, which reads lr and betas from the group afresh each
  step: p *= 1 - lr*wd; m = lerp(m, g, 1 - beta1); v = beta2*v + (1 - beta2)*g*g;
  bc1 = 1 - beta1**t and bc2 = 1 - beta2**t with the *current* betas and the step number t;
  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).

Two param groups: a decayed tensor (weight_decay 0.1) and one without decay. The inputs are
float32 values (so the Rust test starts from the same numbers); the outputs are float64.

Where torch is importable, the same steps also run through torch.optim.AdamW itself (float64
tensors, foreach=False, lr and betas written into the param groups before each step as
DeepSpeed's OneCycle does); the fixture then holds torch's results, and the script fails if the
standard-library steps differ from them by more than 1e-12.

Usage: python3 scripts/gen_one_cycle_adamw.py [OUT]
       (default kernels/tests/fixtures/adamw_one_cycle.json)
Needs: nothing beyond the standard library (torch, where present, for the torch run).
"""
import json
import math
import random
import struct
import sys

STEPS = 10
SIZES = [5, 3]
DECAY = [0.1, 0.0]
EPS = 1e-8
ONE_CYCLE = dict(
    cycle_min_lr=0.01,
    cycle_max_lr=0.1,
    decay_lr_rate=0.5,
    cycle_first_step_size=4,
    cycle_second_step_size=2,
    decay_step_size=2,
    cycle_min_mom=0.8,
    cycle_max_mom=0.9,
    decay_mom_rate=0.05,
)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


class OneCycle:
    """DeepSpeed's OneCycle, continuous (no stairs), one param group's lr and betas."""

    def __init__(self, p):
        self.p = p
        self.total = float(p["cycle_first_step_size"] + p["cycle_second_step_size"])
        self.ratio = p["cycle_first_step_size"] / self.total
        self.last_batch_iteration = -1
        self.lr = p["cycle_min_lr"]
        self.betas = (p["cycle_min_mom"], 0.99)

    def scale(self):
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total)
        x = 1.0 + b / self.total - cycle
        return x / self.ratio if x <= self.ratio else (x - 1) / (self.ratio - 1)

    def step(self):
        p = self.p
        self.last_batch_iteration += 1
        it = self.last_batch_iteration
        if it < self.total:
            s = self.scale()
            self.lr = p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * s
            mom = p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * s
        else:
            interval = (it - self.total + 1) / p["decay_step_size"]
            self.lr = p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * interval)
            mom = p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * interval)
        self.betas = (mom, 0.99)


def lerp(a, b, w):
    return a + w * (b - a) if w < 0.5 else b - (b - a) * (1 - w)


def run_torch(p0, grads, wd, lrs, betas):
    """The same steps through torch.optim.AdamW, or None without torch: (version, (p, m, v))."""
    try:
        import torch
    except ImportError:
        return None
    params, groups, start = [], [], 0
    for size, decay in zip(SIZES, DECAY):
        t = torch.tensor(p0[start : start + size], dtype=torch.float64, requires_grad=True)
        params.append(t)
        groups.append({"params": [t], "weight_decay": decay})
        start += size
    opt = torch.optim.AdamW(groups, lr=lrs[0], betas=tuple(betas[0]), eps=EPS, foreach=False)
    for step, (lr, b) in enumerate(zip(lrs, betas)):
        start = 0
        for t, size in zip(params, SIZES):
            t.grad = torch.tensor(grads[step][start : start + size], dtype=torch.float64)
            start += size
        for g in opt.param_groups:
            g["lr"], g["betas"] = lr, tuple(b)
        opt.step()
    flat = lambda ts: [x for t in ts for x in t.detach().tolist()]
    state = [opt.state[t] for t in params]
    return torch.__version__, (flat(params), flat(s["exp_avg"] for s in state), flat(s["exp_avg_sq"] for s in state))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "kernels/tests/fixtures/adamw_one_cycle.json"
    rng = random.Random(20250601)
    n = sum(SIZES)
    p0 = [f32(rng.uniform(-1, 1)) for _ in range(n)]
    grads = [[f32(rng.uniform(-1, 1) * 10 ** rng.randint(-2, 1)) for _ in range(n)] for _ in range(STEPS)]
    wd = [w for w, size in zip(DECAY, SIZES) for _ in range(size)]
    sched = OneCycle(ONE_CYCLE)
    p, m, v = list(p0), [0.0] * n, [0.0] * n
    lrs, betas = [], []
    for t in range(1, STEPS + 1):
        lr, (b1, b2) = sched.lr, sched.betas
        lrs.append(lr)
        betas.append([b1, b2])
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for i in range(n):
            g = grads[t - 1][i]
            p[i] *= 1 - lr * wd[i]
            m[i] = lerp(m[i], g, 1 - b1)
            v[i] = b2 * v[i] + (1 - b2) * g * g
            p[i] -= (lr / bc1) * m[i] / (math.sqrt(v[i]) / math.sqrt(bc2) + EPS)
        sched.step()
    about = "AdamW (torch semantics, standard-library float64) under DeepSpeed OneCycle with cycle_momentum"
    torch_run = run_torch(p0, grads, wd, lrs, betas)
    if torch_run is not None:
        version, (tp, tm, tv) = torch_run
        diff = max(abs(a - b) for a, b in zip(p + m + v, tp + tm + tv))
        print(f"torch {version}: max |standard library - torch| = {diff:.3e}")
        if diff > 1e-12:
            sys.exit("the standard-library AdamW disagrees with torch's")
        p, m, v = tp, tm, tv
        about = f"torch {version} torch.optim.AdamW (float64) under DeepSpeed OneCycle with cycle_momentum"
    fixture = {
        "about": about + "; scripts/gen_one_cycle_adamw.py",
        "one_cycle": ONE_CYCLE,
        "sizes": SIZES,
        "weight_decay": DECAY,
        "eps": EPS,
        "p0": p0,
        "grads": grads,
        "lr": lrs,
        "betas": betas,
        "p": p,
        "exp_avg": m,
        "exp_avg_sq": v,
    }
    with open(out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
