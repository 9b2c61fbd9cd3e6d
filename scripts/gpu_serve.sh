#!/usr/bin/env bash
# On the GPU machine, from the repository root: issue 31's GPU measurements in one call, each
# step under its own time limit so a slow one leaves the others their turn; logs go to OUT_DIR.
#   scripts/gpu_serve.sh BIN_DIR OUT_DIR [steps...]   (default: check gpt2 serve-gpt2 llama serve-llama)
# check:       kernels/tests/gpu_decode.rs (the decode kernels against the CPU model)
# gpt2, llama: `tessera gpu decode-bench` with the Hugging Face generate peer in the same call
# serve-*:     `tessera serve --device cuda` on a random-weight folder (scripts/gpu_serve_model.py)
#              under `tessera bench-serve` (scripts/bench_serve.sh): 500 requests, Poisson arrivals
# BIN_DIR holds `tessera` and `gpu_decode` (the test binary, copied without its hash).
set -uo pipefail
bin=${1:?usage: scripts/gpu_serve.sh BIN_DIR OUT_DIR [steps...]}
out=${2:?usage: scripts/gpu_serve.sh BIN_DIR OUT_DIR [steps...]}
shift 2
source scripts/device_env.sh
export TESSERA_KERNEL_CACHE=${TESSERA_KERNEL_CACHE:-/tmp/tessera-kernels} PYTHONUNBUFFERED=1
steps=${*:-check gpt2 serve-gpt2 llama serve-llama}
serve() { # ARCH LIMIT RATE
  timeout 60 python3 scripts/gpu_serve_model.py --arch "$1" --out "/tmp/serve-$1" || return 1
  SERVE_BIN="$bin/tessera" SERVE_ARGS="--device cuda" SEQS=64 timeout "$2" scripts/bench_serve.sh "/tmp/serve-$1" \
    --requests 500 --rate "$3" --prompt-tokens 32:256 --output-tokens 16:256
}
status=0
for s in $steps; do
  echo "=== $s $(date -u +%T)"
  case $s in
    check) timeout 90 "$bin"/gpu_decode --nocapture --test-threads 1 ;;
    gpt2) timeout 150 "$bin"/tessera gpu decode-bench --model gpt2-small --vocab 50304 --batch 1,32 --prompt 128 --new 256 --profile --weights bf16,int8 ;;
    llama) timeout 170 "$bin"/tessera gpu decode-bench --model llama-1.1b --batch 1,32 --prompt 128 --new 256 --weights bf16 ;;
    serve-gpt2) serve gpt2 80 40 ;;
    serve-llama) serve llama 80 20 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac 2>&1 | tee "$out/$s.log"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "=== $s failed"; status=1; }
done
exit $status
