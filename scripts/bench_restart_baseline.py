#!/usr/bin/env python3
"""The checkpoint-restart baseline of issue 6: a `tessera train --nprocs N` run (elasticity off)
whose whole job is SIGKILLed every `--every` seconds and restarted with `--resume` from its
newest checkpoint, until it has done `--steps` steps. Prints the wall time, the tokens/s over
that wall time, the steps redone, and the final params_blake3 (which must equal an unbroken
run's: resume is bit-exact).

Usage: python3 scripts/bench_restart_baseline.py [--bin target/release/tessera] [--model gpt-10m]
       [--nprocs 4] [--steps 900] [--every 60] [--checkpoint-interval 30] [--out DIR]
       [--reference-steps 0]
With --reference-steps K it first runs K steps without faults and without elasticity and prints
that run's tokens/s (the fault-free reference for the baseline's throughput).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def base_cmd(a, out, steps):
    return [a.bin, "train", "--config", os.path.join(REPO, "configs", "gpt-tiny.json"), "--model", a.model,
            "--nprocs", str(a.nprocs), "--steps", str(steps), "--output", out, "--no-progress",
            "--set", "train_batch_size=4", "--set", "train_micro_batch_size_per_gpu=1", "--set", "tessera.seq_len=32",
            "--set", "tessera.eval_iters=1", "--set", "tessera.eval_interval=0",
            "--set", "scheduler.params.warmup_min_ratio=0.5",
            "--set", f"tessera.checkpoint_interval={a.checkpoint_interval}", "--set", "tessera.keep_last=2"]


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default=os.path.join(REPO, "target", "release", "tessera"))
    p.add_argument("--model", default="gpt-10m")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--every", type=float, default=60.0)
    p.add_argument("--checkpoint-interval", type=int, default=30)
    p.add_argument("--reference-steps", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tmp = a.out or tempfile.mkdtemp(prefix="tessera-baseline-")
    if a.reference_steps:
        ref = os.path.join(tmp, "reference")
        t0 = time.time()
        subprocess.run(base_cmd(a, ref, a.reference_steps), check=True, stdout=subprocess.DEVNULL)
        s = summary(ref)
        print(f"reference: {a.reference_steps} steps without faults in {time.time() - t0:.1f} s wall, "
              f"{s['tokens_per_s']:.0f} tokens/s (training time), params_blake3 {s['params_blake3'][:16]}")
    out = os.path.join(tmp, "baseline")
    t0 = time.time()
    kills = 0
    attempt = 0
    while True:
        cmd = base_cmd(a, out, a.steps)
        if attempt > 0:
            cmd += ["--resume", os.path.join(out, "checkpoints")]
        attempt += 1
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=a.every)
        except subprocess.TimeoutExpired:
            # The whole job dies at once (its workers notice their parent is gone and exit).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            print(f"  killed the job after {a.every:.0f} s (attempt {attempt}, {time.time() - t0:.0f} s)", flush=True)
            time.sleep(0.5)
            continue
        if proc.returncode != 0:
            sys.exit(f"attempt {attempt} failed: {err.decode()[-2000:]}")
        break
    wall = time.time() - t0
    s = summary(out)
    tokens = a.steps * 4 * 32
    print(f"baseline: {a.steps} steps in {wall:.1f} s wall with {kills} kill-all restarts "
          f"(checkpoint every {a.checkpoint_interval} steps): {tokens / wall:.0f} tokens/s over the wall time; "
          f"params_blake3 {s['params_blake3'][:16]}")


if __name__ == "__main__":
    main()
