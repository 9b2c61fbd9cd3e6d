#!/usr/bin/env bash
# The GPU measurement of issue 32's first half (every optimizer and fp16 on GPU ranks), in two
# halves like scripts/gpu_bench.sh:
#   scripts/gpu_parity.sh build DEST  — here (no GPU needed): builds `tessera` and the test binary,
#                                       copies them stripped into DEST with `git archive HEAD`
#                                       (commit first) as DEST/tree.tar.
#   scripts/gpu_parity.sh run         — on the GPU machine, from the extracted tree with the
#                                       binaries in target/release: `tessera gpu check` (the
#                                       optimizer and fp16 rows among them), the e2e GPU tests of
#                                       the optimizers and fp16 against the CPU, and GPT-2 124M's
#                                       step with each optimizer and with fp16 against bf16/AdamW
#                                       (with `--profile`: the optimizer's own GPU time); the table.
# The tree must sit at the absolute path it was built at (the test binary runs the `tessera` it
# was built beside).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}

if [ "$mode" = build ]; then
    dest=${2:?usage: scripts/gpu_parity.sh build DEST}
    set -e
    cargo build --release -p tessera --bin tessera
    bin=$(cargo test --release -p tessera --test tests --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "tests" and m.get("executable"): print(m["executable"])' | tail -1)
    mkdir -p "$dest"
    strip -o "$dest/tessera" target/release/tessera
    strip -o "$dest/tests" "$bin"
    git archive HEAD -o "$dest/tree.tar"
    echo "built into $dest: tessera, tests ($(basename "$bin")), tree.tar"
    exit 0
fi

source scripts/device_env.sh
export TESSERA_KERNEL_CACHE=${TESSERA_KERNEL_CACHE:-/tmp/tessera-kernels}
T=./target/release/tessera
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ERR=${ERR:-/tmp/parity-err}   # each bench's stderr (the device tool returns few files: a digest goes to $OUT)
mkdir -p "$ERR"
echo "== $(nvidia-smi -L | head -1), $(nproc) CPU cores; $(date -u)"

echo "== gpu check (optimizer, fp16 and round_f16 rows shown; the summary line last)"
timeout 400 $T gpu check > "$OUT/check.txt" 2>&1
echo "gpu check exit $?"
grep -E "^— |OptimizerShard|optimizer during|offload vs GPU optimizer \(|round_f16|fp16|moved|FAIL" "$OUT/check.txt" | grep -vE "^— (attention|model|LLaMA|GPT-2)" | cut -c1-260
tail -1 "$OUT/check.txt"

echo "== e2e: the optimizers and fp16 against the CPU; the refusals"
timeout 400 ./target/release/tests e2e_gpu::gpu_optimizers_and_fp16_train_like_the_cpu e2e_gpu::device_cuda_refuses_unsupported_options_naming_the_key \
    --nocapture --test-threads 1 > "$OUT/e2e.txt" 2>&1
echo "e2e exit $?"
grep -E "GPU val loss|test result|panicked|FAILED|^test " "$OUT/e2e.txt" | cut -c1-300

results=$OUT/parity.jsonl
: > "$results"
bench() { # label, args...
    local label=$1; shift
    if line=$(timeout 300 $T gpu bench "$@" 2>"$ERR/${label// /_}.err" | tail -1) && [ -n "$line" ]; then
        local opt
        opt=$(grep -E '^  optimizer ' "$ERR/${label// /_}.err" | awk '{print $2}' | head -1)
        echo "{\"label\": \"$label\", \"r\": $line, \"opt_ms\": ${opt:-null}}" >> "$results"
        echo "$label: $line"
    else
        echo "FAILED: $label"; tail -5 "$ERR/${label// /_}.err"
    fi
}
B="--vocab 50304 --micro-batch 16 --seq 1024 --zero 1 --clip 1.0 --steps 25 --warmup 5 --profile"
bench "adamw bf16" $B --optimizer adamw
bench "adam (L2) bf16" $B --optimizer adam
bench "sgd bf16" $B --optimizer sgd --lr 0.01
bench "lion bf16" $B --optimizer lion --lr 1e-4
bench "adamw fp16" $B --optimizer adamw --fp16-scale 1024
bench "sgd fp16" $B --optimizer sgd --lr 0.01 --fp16-scale 1024

# Optimizer offload of a 1.3B GPT (gpt2-1.3b: GPT-3 XL's shape) under a device budget for its
# model states that only the offloaded runs meet: on the device (no budget), to host memory, to
# NVMe swap files under /tmp; the same params_blake3 for all three.
if [ "${PARITY_OFFLOAD:-1}" = 1 ]; then
    O="--model gpt2-1.3b --vocab 50304 --micro-batch 8 --seq 1024 --zero 2 --clip 1.0 --steps 5 --warmup 2"
    BUDGET=${BUDGET:-9000000000}
    mkdir -p /tmp/tessera-swap
    bench "1.3b on the device" $O
    bench "1.3b over budget" $O --budget-bytes $BUDGET
    bench "1.3b host offload" $O --budget-bytes $BUDGET --offload-ratio 1
    bench "1.3b nvme offload" $O --budget-bytes $BUDGET --offload-ratio 1 --nvme /tmp/tessera-swap
    df -h /tmp | tail -1
fi

for f in "$ERR"/*.err; do echo "### $f"; grep -vE "^step " "$f" | tail -n 25; done > "$OUT/bench_err.txt" 2>&1

echo "== table"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = next((x for x in rows if x["label"] == "adamw bf16"), None)
offl = [x for x in rows if x["label"].startswith("1.3b")]
rows = [x for x in rows if not x["label"].startswith("1.3b")]
print("| run | step ms (median) | tokens/s | vs bf16/AdamW | optimizer GPU ms | states GiB | skipped | loss first → last | params_blake3 |")
print("|---|---|---|---|---|---|---|---|---|")
for x in rows:
    r = x["r"]
    rel = f"{r['tok_per_s'] / base['r']['tok_per_s']:.3f}" if base else "-"
    loss = f"{r.get('loss_first'):.4f} → {r.get('loss_last'):.4f}"
    print(f"| {x['label']} | {r['step_ms_median']} | {r['tok_per_s']:.0f} | {rel} | {x.get('opt_ms')} | {r.get('state_GiB')} | {r.get('skipped')} | {loss} | {str(r.get('params_blake3'))[:16]} |")
print()
print("| 1.3B run | step ms (median) | tokens/s | model states on GPU GiB | host GiB | NVMe GiB | host Adam ms | not hidden ms | hidden | NVMe read/write/wait ms | NVMe GB/s | params_blake3 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for x in offl:
    r = x["r"]
    io = f"{r.get('nvme_read_ms')}/{r.get('nvme_write_ms')}/{r.get('nvme_wait_ms')}" if r.get("nvme_GiB") is not None else "-"
    print(f"| {x['label']} | {r['step_ms_median']} | {r['tok_per_s']:.0f} | {r.get('state_GiB')} | {r.get('host_state_GiB')} | {r.get('nvme_GiB', '-')} | {r.get('host_adam_ms', '-')} | {r.get('exposed_ms', '-')} | {r.get('hidden', '-')} | {io} | {r.get('nvme_GBps', '-')} | {str(r.get('params_blake3'))[:16]} |")
PY

if [ "${PARITY_OFFLOAD_E2E:-1}" = 1 ]; then
    echo "== e2e: optimizer offload (host memory and NVMe) gives the same bits; the whole-device budget"
    timeout 300 ./target/release/tests e2e_gpu::gpu_optimizer_offload_gives_the_same_bits --nocapture --test-threads 1 > "$OUT/e2e_offload.txt" 2>&1
    echo "e2e offload exit $?"
    grep -E "test result|panicked|FAILED|^test " "$OUT/e2e_offload.txt" | cut -c1-300
fi
