#!/usr/bin/env python3
"""Pipeline bubble and throughput on CPU processes over QUIC (docs/PERFORMANCE.md).

Runs `tessera train` on gpt-tiny with 8 blocks (a model folder written here, so 4 stages can hold
2 chunks each) for each (stages, micro-batches per step, schedule: gpipe, 1f1b, interleaved with 2
chunks a stage, zb-h1) and, in
the same invocation, the unpipelined data-parallel run over the same number of processes as
the peer row; prints one Markdown table: tokens/s, the schedule's bubble in unit time, the
measured bubble (replica 0's idle share of its stages, steps after the first), the peak
micro-batches in flight and the peak activation bytes of stage 0, and whether the parameters
are the plain run's bits.

    python3 scripts/bench_pipeline.py [--tessera target/release/tessera] [--steps 6] [--procs 4]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--tessera", default="target/release/tessera")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--procs", type=int, default=4)
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
args = ap.parse_args()
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cfg = os.path.join(repo, "configs/gpt-tiny.json")


def run(out, procs, stages, m_total, schedule):
    batch = args.micro * m_total
    cmd = [args.tessera, "train", "--config", cfg, "--model", model, "--output", out, "--steps", str(args.steps), "--no-progress",
           "--nprocs", str(procs), "--set", f"train_batch_size={batch}", "--set", f"train_micro_batch_size_per_gpu={args.micro}",
           "--set", f"tessera.seq_len={args.seq_len}", "--set", "tessera.eval_interval=0", "--set", "tessera.eval_iters=1",
           "--set", "tessera.checkpoint_interval=0", "--set", "zero_optimization.stage=1"]
    if stages > 1:
        cmd += ["--set", f"pipeline.stages={stages}", "--set", f"tessera.pipeline.schedule={schedule}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


rows = []
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(repo, "configs/models/gpt-tiny/config.json")) as f:
        mcfg = json.load(f)
    mcfg["n_layer"] = 8
    model = os.path.join(tmp, "gpt-tiny-8")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(mcfg, f)
    for m in (8, 16):
        # The peer: the same processes, unpipelined (each a data-parallel rank), same global batch.
        base = run(os.path.join(tmp, f"plain{m}"), args.procs, 1, m, None)
        rows.append((1, m, "data parallel", base, base))
        for stages in (2, 4):
            if args.procs % stages:
                continue
            for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
                s = run(os.path.join(tmp, f"s{stages}m{m}{schedule}"), args.procs, stages, m, schedule)
                rows.append((stages, m, schedule, s, base))

print(f"gpt-tiny with 8 blocks, {args.procs} worker processes (QUIC, mTLS), micro-batch {args.micro}×{args.seq_len} tokens, "
      f"ZeRO-1, {args.steps} steps\n")
print("| stages | micro-batches (per replica) | schedule | tokens/s | bubble (theory) | bubble (measured) | in flight, stage 0 | activations, stage 0 | bits = plain |")
print("|---|---|---|---|---|---|---|---|---|")
for stages, m, sched, s, base in rows:
    p = s.get("pipeline")
    theory = f"{100 * p['bubble_theory']:.1f} %" if p else "—"
    measured = f"{100 * p['bubble_measured']:.1f} %" if p else "—"
    flight = p["peak_in_flight_per_stage"][0] if p else "—"
    act = f"{p['peak_activation_bytes_per_stage'][0] / 2**20:.1f} MiB" if p else "—"
    same = "yes" if s["params_blake3"] == base["params_blake3"] else "NO"
    per = m // (args.procs // stages)
    print(f"| {stages} | {m} ({per}) | {sched} | {s['tokens_per_s']:.0f} | {theory} | {measured} | {flight} | {act} | {same} |")
