#!/usr/bin/env bash
# The GPU benchmark of issue 5, in two halves:
#   scripts/gpu_bench.sh build        — here (no GPU needed): builds `tessera` with the CUDA path
#                                       and copies it to .device-bin/ (ignored by git).
#   scripts/gpu_bench.sh run [quick]  — on the GPU machine, in one call: correctness checks
#                                       (`tessera gpu check`, same-bits 1 vs 2 GPUs), Tessera
#                                       throughput on 1 and 2 GPUs (ZeRO-2, ZeRO-3), the PyTorch
#                                       and DeepSpeed peers in the same invocation, and the table.
# With the device tool:  run(command="bash scripts/gpu_bench.sh run", carry=[".device-bin", ".whl"],
#                            kind="nvidia-h200-x2")
# .whl holds DeepSpeed's sdist and the wheels it needs that the GPU image lacks (see
# docs/GPU.md for the pip download line); without it the DeepSpeed rows are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}

if [ "$mode" = build ]; then
    cargo build --release --bin tessera
    mkdir -p .device-bin
    # Stripped: the working tree that travels to the GPU machine is capped at 64 MiB.
    strip -o .device-bin/tessera "${CARGO_TARGET_DIR:-target}/release/tessera"
    echo "built .device-bin/tessera ($(du -h .device-bin/tessera | cut -f1))"
    exit 0
fi

source scripts/device_env.sh
T=./.device-bin/tessera
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TESSERA_KERNEL_CACHE=/tmp/tessera-kernels
NGPU=$(nvidia-smi -L | wc -l)
echo "== $(nvidia-smi -L | head -1), $NGPU GPU(s); $(date -u)"

echo "== correctness: every kernel and the model against the CPU reference"
timeout 300 $T gpu check | tee "$OUT/check.txt" || echo "gpu check FAILED"

results=$OUT/results.jsonl
: > "$results"
bench() { # label, args...
    local label=$1; shift
    echo "== $label"
    if line=$(timeout ${BENCH_TIMEOUT:-300} $T gpu bench "$@" | tail -1); then
        echo "$line"; echo "{\"label\": \"$label\", \"r\": $line}" >> "$results"
    else
        echo "FAILED: $label"
    fi
}

echo "== same bits: 1 GPU × 2 micro-batches vs 2 GPUs (ZeRO-2, ZeRO-3), gpt2-small, 4 steps, clip 1.0"
SB="--vocab 50304 --micro-batch 4 --seq 1024 --steps 4 --warmup 1 --clip 1.0 --micro-batches 2"
bench "same-bits 1gpu" $SB --zero 2 --nprocs 1
if [ "$NGPU" -ge 2 ]; then
    bench "same-bits 2gpu zero2" $SB --zero 2 --nprocs 2
    bench "same-bits 2gpu zero3" $SB --zero 3 --nprocs 2
fi

B="--vocab 50304 --micro-batch 16 --seq 1024 --steps 30 --warmup 10"
bench "tessera 1gpu" $B --zero 0 --nprocs 1 --profile
if [ "$NGPU" -ge 2 ]; then
    bench "tessera 2gpu zero2" $B --zero 2 --nprocs 2
    bench "tessera 2gpu zero3" $B --zero 3 --nprocs 2
fi

if [ "${2:-}" != quick ]; then
    P=scripts/peers/gpt2_torch.py
    peer() { local label=$1; shift; echo "== $label"; if line=$("$@" 2>"$OUT/peer-${label// /_}.err" | tail -1); then echo "$line"; echo "{\"label\": \"$label\", \"r\": $line}" >> "$results"; else echo "FAILED: $label (see peer-*.err)"; tail -5 "$OUT/peer-${label// /_}.err"; fi; }
    peer "pytorch compile 1gpu" python3 $P --mode single
    if [ "$NGPU" -ge 2 ]; then
        peer "pytorch ddp 2gpu" torchrun --nproc_per_node 2 $P --mode ddp
        if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheel install failed"
            DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz || echo "DeepSpeed install failed"
            export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
            peer "deepspeed zero2 2gpu" torchrun --nproc_per_node 2 $P --mode ds --zero 2
            peer "deepspeed zero3 2gpu" torchrun --nproc_per_node 2 $P --mode ds --zero 3
        fi
    fi
fi

echo "== table"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"| {'run':<26} | GPUs | step ms | tokens/s | MFU | GiB/GPU | loss (last) | params_blake3 |")
print("|" + "---|" * 8)
for x in rows:
    r = x["r"]
    gib = r.get("device_GiB", r.get("peak_mem_GiB"))
    h = (r.get("params_blake3") or "")[:16]
    loss = r.get("loss_last", r.get("loss"))
    print(f"| {x['label']:<26} | {r.get('world')} | {r.get('step_ms_median')} | {r.get('tok_per_s'):,} | {r.get('mfu_vs_989T')} | {gib} | {loss if loss is None else round(loss, 4)} | {h} |")
same = [x["r"].get("params_blake3") for x in rows if x["label"].startswith("same-bits")]
if same:
    print("same-bits:", "IDENTICAL" if len(set(same)) == 1 else "DIFFERENT", same)
PY
