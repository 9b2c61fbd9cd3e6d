#!/usr/bin/env python3
"""ZeRO communication and memory per rank, measured: runs `tessera train` for worlds 1-4 and
stages 0-3 on one model and prints a markdown table of step time, bytes sent per rank per step
(against ZeRO theory) and model-state bytes per rank.

Usage: python3 scripts/bench_zero.py [--model gpt-10m] [--steps 3] [--bin target/release/tessera]
Each rank runs one micro-batch of one sequence per step (train_batch_size = world), the setting
of ZeRO's communication analysis. Theory per rank per step, Ψ parameters moved as f32 (4 bytes):
  stage 0 (DP all-reduce) and stage 2 (reduce-scatter + parameter all-gather): 2·Ψ·(N-1)/N
  stage 1 (all-reduce of gradients + parameter all-gather): 3·Ψ·(N-1)/N
  stage 3 (gather forward + gather backward + reduce-scatter): 3·Ψ·(N-1)/N = 1.5 × data parallel
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run(binary, model, world, stage, steps, out):
    cmd = [binary, "train", "--config", os.path.join(REPO, "configs", "gpt-tiny.json"), "--model", model,
           "--output", out, "--steps", str(steps), "--no-progress", "--world", str(world),
           "--set", f"zero_optimization.stage={stage}", "--set", f"train_batch_size={world}",
           "--set", "train_micro_batch_size_per_gpu=1", "--set", "tessera.eval_interval=0",
           "--set", "tessera.eval_iters=1", "--set", "tessera.checkpoint_interval=0",
           "--set", "bf16.enabled=true"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def theory_factor(stage):
    return {0: 2.0, 1: 3.0, 2: 2.0, 3: 3.0}[stage]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-10m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--bin", default=os.path.join(REPO, "target", "release", "tessera"))
    ap.add_argument("--worlds", default="1,2,3,4")
    a = ap.parse_args()
    if not os.path.exists(a.bin):
        sys.exit(f"{a.bin} not found: build with `cargo build --release` first")
    print(f"model {a.model}, one micro-batch (1 × seq) per rank per step, bf16 storage, {a.steps} steps per cell")
    print("| world | stage | step ms | tokens/s | sent MiB/rank/step | theory MiB | vs stage-0 same world | model states MiB/rank (p/g/o) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in a.worlds.split(",")]:
            dp = None
            for stage in range(4):
                s = run(a.bin, a.model, world, stage, a.steps, os.path.join(tmp, f"w{world}s{stage}"))
                psi = s["num_params"]
                sent = s["bytes_sent_per_rank_per_step"]
                theory = theory_factor(stage) * psi * 4 * (world - 1) / world
                dp = sent if stage == 0 else dp
                ratio = f"{sent / dp:.2f}×" if dp else "-"
                step_ms = 1000.0 * s["tokens"] / s["tokens_per_s"] / max(s["steps"], 1) if s["tokens_per_s"] else 0
                m = s["model_state_bytes_per_rank"][0]
                mib = lambda b: b / 2**20
                print(f"| {world} | {stage} | {step_ms:.0f} | {s['tokens_per_s']:.0f} | {mib(sent):.1f} | {mib(theory):.1f} | {ratio} | "
                      f"{mib(m['params']):.1f}/{mib(m['grads']):.1f}/{mib(m['optimizer_states']):.1f} |", flush=True)


if __name__ == "__main__":
    main()
