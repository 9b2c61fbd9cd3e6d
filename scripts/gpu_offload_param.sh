#!/usr/bin/env bash
# Issue 32 on one GPU: parameter offload (ZeRO-3 `offload_param`) — its bits and its measurement,
# with the DeepSpeed ZeRO-3 offload peer in the same call. Two halves:
#   scripts/gpu_offload_param.sh build — here (no GPU): the stripped `tessera` and integration-test
#       binaries into .device-bin/ (ignored; `built_at` names this checkout, as scripts/device_run.sh
#       expects), plus the DeepSpeed sdist and the wheels it needs (pip download; .device-bin/whl).
#   scripts/gpu_offload_param.sh run [checks|bench] — on the device, from the checkout's root
#       (run(command="bash scripts/gpu_offload_param.sh run bench", carry=[".device-bin"])): `checks`
#       is 1–2 (~3 min), `bench` is 3–5 (up to ~9 min: give it its own call); both when omitted.
#       1. `tessera gpu check --only offload` (optimizer and parameter offload rows, bit for bit);
#       2. tests/e2e_gpu.rs gpu_parameter_offload_gives_the_same_bits;
#       3. `gpu bench`, GPT 1.3B at ZeRO-3 (micro-batch 8 × 1024, activation checkpointing):
#          parameters + optimizer in host memory under a 6 GB budget of model states (the model
#          states need 25.4 GB), the unbudgeted run (same params_blake3), the optimizer on NVMe;
#          each bench prints its `setup:` line (initialisation and rank build times, host peak RSS)
#          and, when it fails, its exit status;
#       4. DeepSpeed 0.19.8 ZeRO-3 with offload_param and offload_optimizer (cpu), same model
#          shape and tokens per step (scripts/peers/gpt2_torch.py --mode ds).
# Results under $OUT (check.txt, e2e.txt, bench.jsonl, <label>.out/.err, ds.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
part=${2:-all}

if [ "$mode" = build ]; then
    set -e
    cargo build --release -p tessera
    cargo test --release --test tests --no-run
    mkdir -p .device-bin/whl
    strip -o .device-bin/tessera "${CARGO_TARGET_DIR:-target}/release/tessera"
    bin=$(ls -t "${CARGO_TARGET_DIR:-target}"/release/deps/tests-* | grep -v '\.d$' | head -1)
    strip -o .device-bin/tests "$bin"
    echo "$PWD" > .device-bin/built_at
    P="--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    python3 -m pip download -q --no-deps deepspeed==0.19.8 --no-binary :all: -d .device-bin/whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .device-bin/whl \
        hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection "typing_extensions>=4.16" ninja psutil py-cpuinfo msgpack einops
    ls -la .device-bin .device-bin/whl
    exit 0
fi

source scripts/device_run.sh
SRC=$PWD/.device-bin
echo "== $(nproc) CPU cores, $(free -g | awk '/Mem/ {print $2}') GiB"

if [ "$part" != bench ]; then
echo "== 1. gpu check --only offload"
timeout 150 $T gpu check --only offload 2>&1 | tee "$OUT/check.txt" | grep -E "FAIL|parameters in|passed|FAILED" | head -60

echo "== 2. e2e: gpu_parameter_offload_gives_the_same_bits"
timeout 170 .device-bin/tests e2e_gpu::gpu_parameter_offload --nocapture --test-threads 1 > "$OUT/e2e.txt" 2>&1
echo "e2e exit $?"; tail -5 "$OUT/e2e.txt"

fi
[ "$part" = checks ] && exit 0

echo "== 3. gpu bench: GPT 1.3B, ZeRO-3, under a 6 GB budget of model states"
B="--model gpt2-1.3b --vocab 50304 --zero 3 --micro-batch 8 --seq 1024 --micro-batches 1 --recompute"
# One call may run 600 s: each step's limit is cut to what is left of 570 s, and skipped under 30.
limit_left() { local l=$((570 - SECONDS)); [ "$1" -lt "$l" ] && l=$1; echo "$l"; }
bench() { # label, timeout, args...
    local label=$1 limit; limit=$(limit_left "$2"); shift 2
    if [ "$limit" -lt 30 ]; then echo "-- $label: skipped, the call's time is spent"; return; fi
    echo "-- $label: tessera gpu bench $* ($(date -u +%T))"
    timeout "$limit" $T gpu bench "$@" >"$OUT/$label.out" 2>"$OUT/$label.err"
    local rc=$? line
    line=$(tail -1 "$OUT/$label.out")
    if [ $rc -eq 0 ] && [ -n "$line" ]; then
        grep '^setup:' "$OUT/$label.err"; echo "$line"; echo "{\"label\": \"$label\", \"r\": $line}" >> "$OUT/bench.jsonl"
    else
        # 124: the limit; 137: SIGKILL (the kernel's OOM killer among others); 139: SIGSEGV.
        echo "FAILED: $label exit $rc after $(date -u +%T); $(free -g | awk '/Mem/ {print $3 " of " $2 " GiB used"}')"
        tail -4 "$OUT/$label.err"
    fi
}
: > "$OUT/bench.jsonl"
timeout 20 $T gpu bench $B --budget-bytes 6000000000 --steps 1 --warmup 0 2>&1 | tail -1
bench host 150 $B --budget-bytes 6000000000 --offload-ratio 1 --offload-param cpu --steps 4 --warmup 1
bench device 120 $B --steps 4 --warmup 1
echo "== 4. DeepSpeed ZeRO-3, offload_param + offload_optimizer (cpu)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$SRC"/whl/*.whl > "$OUT/pip.txt" 2>&1
DS_BUILD_OPS=0 TORCH_CUDA_ARCH_LIST=9.0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target /tmp/site "$SRC"/whl/deepspeed-*.tar.gz >> "$OUT/pip.txt" 2>&1 || { echo "deepspeed install failed"; tail -5 "$OUT/pip.txt"; }
# ninja (DeepSpeedCPUAdam is built just in time through torch.utils.cpp_extension) on the PATH.
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
DS="--mode ds --zero 3 --offload 1 --offload-param 1 --layers 24 --d 2048 --heads 32 --mb 8 --seq 1024 --steps 4 --warmup 1 --compile 0"
ONE="env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511"
# (torchrun would read the script's --d as an abbreviation of its own options.)
timeout "$(limit_left 180)" $ONE python3 scripts/peers/gpt2_torch.py $DS > "$OUT/ds.txt" 2>&1
echo "deepspeed exit $?"; grep -E '^\{|Error|error:' "$OUT/ds.txt" | tail -4
if ! grep -q '^{' "$OUT/ds.txt" && [ "$(limit_left 150)" -gt 120 ]; then
    echo "-- again with torch's AdamW on the CPU (torch_adam)"
    timeout "$(limit_left 150)" $ONE python3 scripts/peers/gpt2_torch.py $DS --torch-adam 1 > "$OUT/ds_torch_adam.txt" 2>&1
    echo "deepspeed (torch_adam) exit $?"; grep -E '^\{|Error' "$OUT/ds_torch_adam.txt" | tail -3
fi
echo "== 5. optimizer on NVMe"
mkdir -p /tmp/swap
bench nvme 200 $B --budget-bytes 6000000000 --offload-ratio 1 --offload-param cpu --nvme /tmp/swap --steps 2 --warmup 1
echo "== done $(date -u)"
