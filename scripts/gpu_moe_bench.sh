#!/usr/bin/env bash
# The mixture-of-experts feed-forward on one GPU, in one call on the GPU machine: `tessera gpu
# check` (the MoE rows among them), the experts' GEMMs (per-expert loop vs one grouped call vs one
# dense GEMM of the same rows), then a Mixtral-shaped model (8 experts, top-2, ~1B parameters:
# llama-1.1b's attention and vocabulary, 6 blocks, experts of width 2816) trained by Tessera (grouped
# and loop expert GEMMs) and by the PyTorch peer (scripts/peers/moe_torch.py, torch.compile; its
# expert loop and torch._grouped_mm), and the dense model with the same active parameters (FFN
# 5632 = 2 × 2816) by both. DeepSpeed is not installed on the GPU machine (no registry there): its
# MoE is not measured. Build and copy the binaries as scripts/gpu_verify.sh says, then
#   run(command="bash scripts/gpu_moe_bench.sh", carry=[".device-bin"])
# (CHECK=0 skips the check; PROFILE=1 adds one profiled step to the Tessera MoE row).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh
PROF=${PROFILE:+--profile}
row() { # label, command...
  local label=$1; shift
  local err="$OUT/${label// /_}.err"
  echo "== $label"
  "$@" 2> "$err" | tail -1 || { echo "FAILED: $label"; tail -5 "$err"; }
  grep -A40 "^profile of one step" "$err" | head -40
}
if [ "${CHECK:-1}" = 1 ]; then
  echo "== tessera gpu check"
  timeout 150 $T gpu check > "$OUT/check.txt" 2>&1; echo "exit $?"
  grep -ciE " ok" "$OUT/check.txt"; grep -iE "moe|fail|all GPU checks" "$OUT/check.txt" | head -40
fi
MODEL="--model llama-1.1b --layers 6 --micro-batch 4 --seq 2048"
MOE="--experts 8 --top-k 2 --expert-ffn 2816"
BENCH="--steps 20 --warmup 5 --zero 0"
row "tessera expert GEMMs 16384 rows" timeout 120 $T gpu bench $MODEL $MOE --expert-gemm
row "tessera moe grouped" timeout 300 $T gpu bench $MODEL $MOE $BENCH $PROF
TESSERA_GPU_MOE_GEMM=loop row "tessera moe loop" timeout 300 $T gpu bench $MODEL $MOE $BENCH
row "tessera moe grouped recompute" timeout 300 $T gpu bench $MODEL $MOE $BENCH --recompute
row "tessera dense same active" timeout 300 $T gpu bench $MODEL $BENCH
P="python3 scripts/peers/moe_torch.py --layers 6 --d 2048 --heads 32 --kv-heads 4 --experts 8 --top-k 2 --expert-ffn 2816 --seq 2048 --mb 4"
row "peer moe loop" timeout 400 $P --impl loop
row "peer moe grouped_mm" timeout 400 $P --impl grouped
row "peer dense same active" timeout 400 python3 scripts/peers/llama_torch.py --layers 6 --d 2048 --heads 32 --kv-heads 4 --ffn 5632 --seq 2048 --mb 4
python3 -c "import deepspeed" 2>/dev/null && echo "deepspeed present (not measured here)" || echo "== DeepSpeed MoE: not installed on this machine (no registry): not measured"
