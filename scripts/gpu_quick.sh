#!/usr/bin/env bash
# The GPU checks that matter after a merge, in one short call: tests/e2e_gpu.rs, the kernels'
# tests, `tessera gpu check`, then scripts/gpu_llama_bench.sh's 1.1B rows and its 32k row
# (LLAMA_ROWS=all for the 0.85B pair too). Build and copy as scripts/gpu_verify.sh says.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh
echo "== tests/e2e_gpu.rs"
timeout 300 .device-bin/tests e2e_gpu --test-threads 1 2>&1 | tee "$OUT/e2e_gpu.txt" | grep -E "^test |test result|skipped|panicked" | head -30
echo "== kernels: gpu_ops, gpu_attention"
(cd kernels && timeout 60 ../.device-bin/gpu_ops 2>&1 && timeout 60 ../.device-bin/gpu_attention 2>&1) | grep -E "test result"
echo "== tessera gpu check"
timeout 120 $T gpu check > "$OUT/check.txt" 2>&1; echo "exit $?"; grep -ciE " ok" "$OUT/check.txt"; grep -iE "fail|all GPU checks" "$OUT/check.txt" | head -10
