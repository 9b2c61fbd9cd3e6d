#!/usr/bin/env bash
# NCCL GPU ranks through `tessera train` (the engine's step loop) against the same shape in
# `tessera gpu bench` (the rank driven directly) and the PyTorch peer, in one call on the GPU
# machine. With a gzipped older binary at .device-bin/tessera-old.gz the train rows run it too
# (before/after a change, same call). Build and copy the binaries as scripts/gpu_verify.sh says,
#   run(command="bash scripts/gpu_train_bench.sh", carry=[".device-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh
echo "== gpu bench: GPT-2 124M (vocab 50304), 16 × 1024 tokens a step, ZeRO-0, 30 steps"
timeout 300 $T gpu bench --vocab 50304 --micro-batch 16 --seq 1024 --steps 30 --warmup 10 --zero 0 --nprocs 1 | tail -1
echo "== peer: scripts/peers/gpt2_torch.py --mode single (torch.compile)"
timeout 300 python3 scripts/peers/gpt2_torch.py --mode single 2> "$OUT/peer.err" | tail -1
W=/tmp/gtb && rm -rf $W && mkdir -p $W
cat > $W/s.json <<'JSON'
{ "train_batch_size": 16, "train_micro_batch_size_per_gpu": 16,
  "optimizer": { "type": "AdamW", "params": { "lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "bf16": { "enabled": true }, "zero_optimization": { "stage": 0 }, "steps_per_print": 10,
  "tessera": { "model": "gpt2-small", "seq_len": 1024, "steps": 40, "eval_interval": 0, "eval_iters": 1, "checkpoint_interval": 0 } }
JSON
bins="new:$T"
if [ -f .device-bin/tessera-old.gz ]; then
  gunzip -c .device-bin/tessera-old.gz > $W/tessera-old && chmod +x $W/tessera-old && bins="old:$W/tessera-old $bins new2:$T"
fi
echo "== train --device cuda: gpt2-small shape (byte-level vocab 256 on the shipped corpus), 16 × 1024, ZeRO-0, 40 steps"
for b in $bins; do
  name=${b%%:*}; bin=${b#*:}
  timeout 300 $bin train --config $W/s.json --device cuda --output $W/$name --no-progress > $W/$name.log 2>&1
  tps=$(grep -o '"tokens_per_s": [0-9.]*' $W/$name/summary.json | grep -o '[0-9.]*$')
  echo "$name: exit $? tokens/s $tps ms/step $(python3 -c "print(round(16384/$tps*1e3, 2))" 2>/dev/null) $(grep -o '"params_blake3": "[0-9a-f]\{16\}' $W/$name/summary.json)"
done
cp $W/*.log "$OUT/" 2>/dev/null
