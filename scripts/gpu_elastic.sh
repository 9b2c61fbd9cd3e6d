#!/usr/bin/env bash
# GPU ranks of the one engine on the GPU machine (`tessera.gpu.collective = "quic"`), in one call:
# the world/stage bit comparison and the elastic chaos scenario from tests/e2e_gpu.rs, and the
# scenario once more with its report kept in $OUT (detection and recovery times for
# docs/PERFORMANCE.md). Build and copy the binaries as scripts/gpu_verify.sh says, then
#   run(command="bash scripts/gpu_elastic.sh", carry=[".device-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # (scripts/gpu_verify.sh runs all of tests/e2e_gpu.rs)
  echo "== tests/e2e_gpu.rs: the one engine's GPU ranks"
  timeout 500 .device-bin/tests e2e_gpu::gpu_ranks_of_the_one_engine e2e_gpu::an_elastic_gpu_run --test-threads 1 2>&1 \
    | tee "$OUT/e2e_gpu_engine.txt" | grep -E "^test |test result|skipped|panicked|assert" | head -20
fi
echo "== chaos/scenarios/gpt-mini-gpu-elastic.json, report kept"
timeout 500 $T chaos run --scenario chaos/scenarios/gpt-mini-gpu-elastic.json --seed 1 --output "$OUT/chaos-gpu" --no-progress 2>&1 | tail -40
rm -rf "$OUT/chaos-gpu/clean/checkpoints" "$OUT/chaos-gpu/faulted/checkpoints"

echo "== throughput: gpt2-small (byte-level vocab 256, 16 × 1024 tokens a step, bf16, AdamW, ZeRO-0), 12 steps"
W=/tmp/ge && rm -rf $W && mkdir -p $W
cat > $W/s.json <<'JSON'
{ "train_batch_size": 16, "train_micro_batch_size_per_gpu": 16,
  "optimizer": { "type": "AdamW", "params": { "lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "bf16": { "enabled": true }, "zero_optimization": { "stage": 0 }, "steps_per_print": 4,
  "tessera": { "model": "gpt2-small", "seq_len": 1024, "steps": 12, "eval_interval": 0, "eval_iters": 1, "checkpoint_interval": 0 } }
JSON
for mode in nccl quic; do
  timeout 400 $T train --config $W/s.json --device cuda --set tessera.gpu.collective=$mode --output $W/$mode --no-progress > $W/$mode.log 2>&1
  echo "$mode: exit $? $(grep -o '"tokens_per_s": [0-9.]*' $W/$mode/summary.json) $(grep -o '"wall_s": [0-9.]*' $W/$mode/summary.json)"
  grep -E "^step" $W/$mode.log | tail -3
done
cp $W/*.log "$OUT/" 2>/dev/null
