#!/usr/bin/env bash
# A/B timing of GPU changes in one GPU-machine call (issue 5's method: several variants of the
# 1-GPU GPT-2 124M step, side by side, in the same invocation as the torch.compile peer).
#
#   here:   scripts/gpu_ab.sh build [REV]   builds `tessera` of the working tree into .device-bin/
#                                           and, with REV, also `tessera` of git revision REV into
#                                           .device-bin/tessera-base (for the "before" rows).
#   there:  bash scripts/gpu_ab.sh run [VARIANT ...]
#           VARIANT = label=BIN[:ENV=VALUE...]  BIN is `tessera` or `tessera-base` under .device-bin/
#           default: base=tessera-base  new=tessera  new-unfused=tessera:TESSERA_GPU_FUSE=none
#
# With the device tool: run(command="bash scripts/gpu_ab.sh run", carry=[".device-bin"]).
# First `tessera gpu check` of the new binary (its rows must pass), then each variant's bench with
# --profile (per-kernel time table on stderr), then the peer, then the table.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
shift || true

if [ "$mode" = build ]; then
    cargo build --release --bin tessera
    mkdir -p .device-bin
    strip -o .device-bin/tessera "${CARGO_TARGET_DIR:-target}/release/tessera"
    if [ -n "${1:-}" ]; then
        wt=$(mktemp -d)
        git worktree add --detach "$wt" "$1" >/dev/null
        (cd "$wt" && CARGO_TARGET_DIR="${BASE_TARGET_DIR:-$wt/target}" cargo build --release --bin tessera)
        strip -o .device-bin/tessera-base "${BASE_TARGET_DIR:-$wt/target}/release/tessera"
        git worktree remove --force "$wt"
    fi
    ls -la .device-bin
    exit 0
fi

source scripts/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
echo "== $(nvidia-smi -L | head -1); $(date -u)"
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=("base=tessera-base" "new=tessera" "new-unfused=tessera:TESSERA_GPU_FUSE=none")

echo "== correctness (new binary): every kernel and the model against the CPU reference"
TESSERA_KERNEL_CACHE=/tmp/k-new timeout 400 ./.device-bin/tessera gpu check > "$OUT/check.txt" 2>&1 || true
grep -E "FAIL|passed|FAILED" "$OUT/check.txt" | tail -15

B="--vocab 50304 --micro-batch 16 --seq 1024 --steps 30 --warmup 10"
results=$OUT/ab.jsonl
: > "$results"
for v in "${variants[@]}"; do
    label=${v%%=*}
    rest=${v#*=}
    bin=${rest%%:*}
    envs=""
    [ "$rest" = "$bin" ] || envs=${rest#*:}
    envs=${envs//:/ }
    echo "== $label ($bin ${envs})"
    if line=$(env $envs TESSERA_KERNEL_CACHE=/tmp/k-$bin timeout 300 ./.device-bin/$bin gpu bench $B --zero 0 --nprocs 1 --profile 2> "$OUT/prof-$label.txt" | tail -1); then
        echo "$line"
        echo "{\"label\": \"$label\", \"r\": $line}" >> "$results"
        head -40 "$OUT/prof-$label.txt" | grep -E "^  |profile" | grep -v "^  gemm" | head -34
        grep -A60 "^GEMM tuning" "$OUT/prof-$label.txt" | head -60 || true
    else
        echo "FAILED: $label"; tail -5 "$OUT/prof-$label.txt"
    fi
done

echo "== pytorch compile 1gpu"
if line=$(python3 scripts/peers/gpt2_torch.py --mode single 2> "$OUT/peer.err" | tail -1); then
    echo "$line"; echo "{\"label\": \"pytorch compile\", \"r\": $line}" >> "$results"
else
    echo "FAILED: peer"; tail -5 "$OUT/peer.err"
fi

echo "== table"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peer = next((x["r"]["tok_per_s"] for x in rows if x["label"] == "pytorch compile"), None)
print(f"| {'variant':<14} | step ms | tokens/s | MFU | vs torch.compile | fusions | params_blake3 |")
print("|---|---|---|---|---|---|---|")
for x in rows:
    r = x["r"]
    rel = f"{r['tok_per_s'] / peer:.3f}x" if peer else "-"
    print(f"| {x['label']:<14} | {r.get('step_ms_median')} | {r.get('tok_per_s'):,.0f} | {r.get('mfu_vs_989T')} | {rel} | {r.get('fusions', '-')} | {(r.get('params_blake3') or '')[:16]} |")
PY
