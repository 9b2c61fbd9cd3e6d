#!/usr/bin/env bash
# On the GPU machine, from the repository root: the decode checks (kernels/tests/gpu_decode.rs)
# and `tessera gpu decode-bench` for GPT-2 124M and the 1.1B LLaMA, each with the Hugging Face
# generate peer (scripts/peers/generate_hf.py) in the same call.
#   scripts/gpu_decode.sh BIN_DIR [check] [gpt2] [llama] [--no-peer]
# BIN_DIR holds `tessera` and `gpu_decode` (the kernels/tests/gpu_decode.rs test binary built here
# with cargo test --no-run, copied without its hash).
set -uo pipefail
bin=${1:?usage: scripts/gpu_decode.sh BIN_DIR [check] [gpt2] [llama] [--no-peer]}
shift
source scripts/device_env.sh
export TESSERA_KERNEL_CACHE=${TESSERA_KERNEL_CACHE:-/tmp/tessera-kernels} PYTHONUNBUFFERED=1
peer=""
for a in "$@"; do [ "$a" = --no-peer ] && peer=--no-peer; done
status=0
for what in "$@"; do
  case $what in
    check) "$bin"/gpu_decode --nocapture --test-threads 1 || status=1 ;;
    gpt2) "$bin"/tessera gpu decode-bench --model gpt2-small --vocab 50304 --batch 1,32 --prompt 128 --new 256 --profile --weights bf16,int8,fp8 $peer || status=1 ;;
    llama) "$bin"/tessera gpu decode-bench --model llama-1.1b --batch 1,32 --prompt 128 --new 256 --profile --weights bf16,int8,fp8 $peer || status=1 ;;
    --no-peer) ;;
    *) echo "unknown step $what (check, gpt2, llama, --no-peer)"; exit 2 ;;
  esac
done
exit $status
