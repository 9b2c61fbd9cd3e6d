#!/usr/bin/env bash
# The LLaMA family on one GPU, in one call on the GPU machine: `tessera gpu bench` on the two
# shapes of the PyTorch peer (scripts/peers/llama_torch.py, torch.compile) next to the peer
# itself, and a 32k-token context with activation checkpointing. Build and copy the binaries as
# scripts/gpu_verify.sh says, then (LLAMA_ROWS=all adds the 0.85B pair; PROFILE=1 adds one
# profiled step to each Tessera row and prints where its GPU time went; LONG=0 skips the 32k row)
#   run(command="bash scripts/gpu_llama_bench.sh", carry=[".device-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh
P=scripts/peers/llama_torch.py
PROF=${PROFILE:+--profile}
row() { # label, command...
  local label=$1; shift
  local err="$OUT/${label// /_}.err"
  echo "== $label"
  "$@" 2> "$err" | tail -1 || { echo "FAILED: $label"; tail -5 "$err"; }
  grep -A40 "^profile of one step" "$err" | head -40
}
row "tessera llama-1.1b 2x4096" timeout 400 $T gpu bench --model llama-1.1b --micro-batch 2 --seq 4096 --steps 20 --warmup 5 --zero 0 $PROF
row "peer llama-1.1b 2x4096" timeout 400 python3 $P --layers 22 --d 2048 --heads 32 --kv-heads 4 --ffn 5632 --seq 4096 --mb 2
if [ "${LLAMA_ROWS:-}" = all ]; then
  row "tessera llama-0.85b 4x2048" timeout 400 $T gpu bench --model llama-0.85b --micro-batch 4 --seq 2048 --steps 20 --warmup 5 --zero 0 $PROF
  row "peer llama-0.85b 4x2048" timeout 400 python3 $P --layers 16 --d 2048 --heads 32 --kv-heads 8 --ffn 5632 --seq 2048 --mb 4
fi
[ "${LONG:-1}" = 0 ] && exit 0
# 32k tokens: llama-1.1b's folder with its context raised (the way a user raises it).
L=/tmp/llama-32k && rm -rf $L && mkdir -p $L
python3 - <<'PY'
import json
c = json.load(open("configs/models/llama-1.1b/config.json"))
c["max_position_embeddings"] = 32768
json.dump(c, open("/tmp/llama-32k/config.json", "w"), indent=2)
PY
row "tessera llama-1.1b 1x32768 recompute" timeout ${LONG_TIMEOUT:-500} $T gpu bench --model $L --micro-batch 1 --seq 32768 --steps 3 --warmup 1 --zero 0 --recompute
