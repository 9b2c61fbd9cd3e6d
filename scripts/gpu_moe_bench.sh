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
# (CHECK=0 skips the check; TRAIN=0 the `tessera train` pair; BENCH=0 the rows after it; PEERS=0 the peers; PROFILE=1 adds one profiled step to the Tessera MoE row). From a
# helper's worktree, whose files do not travel: copy the stripped `tessera`, this script and
# scripts/peers/moe_torch.py into one folder D under the session's checkout that git ignores,
# carry it, and run `MOE_DIR=D bash D/gpu_moe_bench.sh` from the checkout's root.
set -uo pipefail
if [ -n "${MOE_DIR:-}" ]; then
  source scripts/device_env.sh
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export TESSERA_KERNEL_CACHE=/tmp/tessera-kernels
  T=$PWD/$MOE_DIR/tessera; PEER=$MOE_DIR/moe_torch.py
  echo "== $(nvidia-smi -L | head -1); $(date -u)"
else
  cd "$(dirname "$0")/.."
  source scripts/device_run.sh
  PEER=scripts/peers/moe_torch.py
fi
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
if [ "${TRAIN:-1}" = 1 ]; then
  # `tessera train --device cuda` on a small Mixtral folder (64-wide heads, 8 experts, top 2, the
  # aux loss at 0.02), against the same run on the CPU: the losses should track.
  W=/tmp/moe-train && rm -rf $W && mkdir -p $W/mixtral-tiny-gpu
  cat > $W/mixtral-tiny-gpu/config.json <<'JSON'
{ "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 320, "hidden_size": 256,
  "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": true, "router_aux_loss_coef": 0.02,
  "router_jitter_noise": 0.0, "max_position_embeddings": 512, "hidden_act": "silu", "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false }
JSON
  cat > $W/s.json <<JSON
{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
  "optimizer": { "type": "AdamW", "params": { "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "bf16": { "enabled": true }, "zero_optimization": { "stage": 1 }, "steps_per_print": 10,
  "tessera": { "model": "$W/mixtral-tiny-gpu", "seq_len": 256, "steps": 30, "eval_interval": 0, "eval_iters": 1, "checkpoint_interval": 0 } }
JSON
  for dev in cuda cpu; do
    echo "== train --device $dev: Mixtral folder (4 blocks of 8 experts, top 2), 8 × 256, ZeRO-1, 30 steps"
    timeout 200 $T train --config $W/s.json --device $dev --output $W/$dev --no-progress > $W/$dev.log 2>&1; echo "exit $?"
    grep -iE "loss|error|refus" $W/$dev.log | tail -4
    python3 -c "import json; s=json.load(open('$W/$dev/summary.json')); print({k: s.get(k) for k in ('final_loss','loss','tokens_per_s','params_blake3')})" 2>/dev/null
  done
  cp $W/*.log "$OUT/" 2>/dev/null
fi
MODEL="--model llama-1.1b --layers 6 --micro-batch 4 --seq 2048"
MOE="--experts 8 --top-k 2 --expert-ffn 2816"
BENCH="--steps 20 --warmup 5 --zero 0"
[ "${BENCH:-1}" = 0 ] && exit 0
row "tessera expert GEMMs 16384 rows" timeout 120 $T gpu bench $MODEL $MOE --expert-gemm
row "tessera moe grouped" timeout 300 $T gpu bench $MODEL $MOE $BENCH $PROF
TESSERA_GPU_MOE_GEMM=loop row "tessera moe loop" timeout 300 $T gpu bench $MODEL $MOE $BENCH
row "tessera moe grouped recompute" timeout 300 $T gpu bench $MODEL $MOE $BENCH --recompute
row "tessera dense same active" timeout 300 $T gpu bench $MODEL $BENCH
[ "${PEERS:-1}" = 0 ] && exit 0
P="python3 $PEER --layers 6 --d 2048 --heads 32 --kv-heads 4 --experts 8 --top-k 2 --expert-ffn 2816 --seq 2048 --mb 4"
row "peer moe loop" timeout 400 $P --impl loop
row "peer moe grouped_mm" timeout 400 $P --impl grouped
row "peer dense same active" timeout 400 python3 scripts/peers/llama_torch.py --layers 6 --d 2048 --heads 32 --kv-heads 4 --ffn 5632 --seq 2048 --mb 4
python3 -c "import deepspeed" 2>/dev/null && echo "deepspeed present (not measured here)" || echo "== DeepSpeed MoE: not installed on this machine (no registry): not measured"
