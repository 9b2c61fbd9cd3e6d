#!/usr/bin/env python3
"""overlap_comm and stage-3 prefetch, measured: runs `tessera train --nprocs N` (worker processes,
QUIC between them) with each setting, alternating the settings run by run so that a busy machine
slows them alike, and prints a markdown table of the median tokens/s and whether every run ended
with the same params_blake3.

Usage: python3 scripts/bench_overlap.py [--model gpt-tiny] [--nprocs 2] [--steps 20] [--reps 3]
       [--bucket 100000] [--bin target/release/tessera]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SETTINGS = [
    ("stage 2, overlap off", 2, ["zero_optimization.overlap_comm=false"]),
    ("stage 2, overlap on", 2, ["zero_optimization.overlap_comm=true"]),
    ("stage 3, overlap off, no prefetch", 3, ["zero_optimization.overlap_comm=false", "zero_optimization.stage3_prefetch_bucket_size=0"]),
    ("stage 3, overlap off, prefetch", 3, ["zero_optimization.overlap_comm=false"]),
    ("stage 3, overlap on, prefetch", 3, ["zero_optimization.overlap_comm=true"]),
]


def run(args, stage, sets, out):
    cmd = [args.bin, "train", "--config", os.path.join(REPO, "configs", "gpt-tiny.json"), "--model", args.model,
           "--output", out, "--steps", str(args.steps), "--no-progress", "--nprocs", str(args.nprocs),
           "--set", f"zero_optimization.stage={stage}", "--set", f"zero_optimization.reduce_bucket_size={args.bucket}",
           "--set", "zero_optimization.stage3_param_persistence_threshold=0",
           "--set", "tessera.eval_interval=0", "--set", "tessera.checkpoint_interval=0"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket", type=int, default=100000)
    p.add_argument("--bin", default=os.path.join(REPO, "target", "release", "tessera"))
    args = p.parse_args()
    speeds = {name: [] for name, _, _ in SETTINGS}
    hashes = set()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for k, (name, stage, sets) in enumerate(SETTINGS):
                s = run(args, stage, sets, os.path.join(tmp, f"r{rep}-{k}"))
                speeds[name].append(s["tokens_per_s"])
                hashes.add(s["params_blake3"])
    print(f"model {args.model}, --nprocs {args.nprocs}, {args.steps} steps a run, reduce_bucket_size {args.bucket}, "
          f"stage-3 blocks not persistent; median of {args.reps} alternating runs")
    print("| setting | tokens/s (median) | runs |")
    print("|---|---|---|")
    for name, _, _ in SETTINGS:
        v = speeds[name]
        print(f"| {name} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    print(f"params_blake3 identical across all {args.reps * len(SETTINGS)} runs: {len(hashes) == 1}")
    if len(hashes) != 1:
        raise SystemExit(f"different parameters: {sorted(hashes)}")


if __name__ == "__main__":
    main()
