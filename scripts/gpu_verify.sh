#!/usr/bin/env bash
# What CI cannot run, run on the GPU machine in one call: the GPU tests (tests/e2e_gpu.rs, the
# kernels' gpu_ops/gpu_attention), a SIGTERM to a `--device cuda` run (exit 75, a checkpoint
# that resumes to the uninterrupted bits), a real `torchrun --no-python tessera train` job of
# two ranks against `--world 2`, an export checked by scripts/check_export.py with torch +
# transformers, and issue 28's run: a transformers-made LLaMA folder fine-tuned on the GPU from
# the shipped corpus as Parquet, exported, and loaded by transformers with the same loss.
#
# Here (no GPU needed): build, then copy the stripped binaries into .device-bin/ (ignored):
#   cargo test --workspace --release --no-run
#   strip -o .device-bin/tessera target/release/tessera
#   strip -o .device-bin/tests target/release/deps/tests-<hash>   (likewise gpu_ops, gpu_attention)
#   echo "$PWD" > .device-bin/built_at    # the test binaries look for the repo where they were built
#   python3 scripts/corpus_parquet.py .device-bin/corpus.parquet   # (pyarrow) the shipped corpus as Parquet
# With the device tool: run(command="bash scripts/gpu_verify.sh", carry=[".device-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_run.sh

echo "== tests/e2e_gpu.rs"
timeout 560 .device-bin/tests e2e_gpu --test-threads 1 2>&1 | tee "$OUT/e2e_gpu.txt" | grep -E "^test |test result|skipped"
echo "== kernels: gpu_ops, gpu_attention"
(cd kernels && timeout 120 ../.device-bin/gpu_ops 2>&1 && timeout 120 ../.device-bin/gpu_attention 2>&1) | tee "$OUT/gpu_kernels.txt" | grep -E "^test |test result"

echo "== SIGTERM to a --device cuda run, then resume"
W=/tmp/gv && rm -rf $W && mkdir -p $W
cat > $W/gpu.json <<'EOF'
{
  "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
  "optimizer": { "type": "AdamW", "params": { "lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "gradient_clipping": 1.0, "bf16": { "enabled": true }, "zero_optimization": { "stage": 2 },
  "steps_per_print": 50,
  "tessera": { "model": "gpt-mini-gpu", "seq_len": 64, "steps": 3000, "eval_interval": 1000, "eval_iters": 2,
               "checkpoint_interval": 1000, "keep_last": 3 }
}
EOF
timeout 240 $T train --config $W/gpu.json --device cuda --output $W/full --no-progress > $W/full.log 2>&1
echo "uninterrupted: exit $? $(grep -o '"params_blake3": "[0-9a-f]*' $W/full/summary.json)"
$T train --config $W/gpu.json --device cuda --output $W/cut --no-progress > $W/cut.log 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q "^step  *[0-9]" $W/cut.log 2>/dev/null && break; sleep 0.2; done
sleep 1; kill -TERM $pid; wait $pid; code=$?
echo "after SIGTERM: exit $code; $(grep -o '"status": "[a-z]*"' $W/cut/summary.json) $(grep -o '"steps": [0-9]*' $W/cut/summary.json)"
grep -E "interrupted|warning|error" $W/cut.log | head -5
timeout 240 $T train --config $W/gpu.json --device cuda --output $W/resumed --resume $W/cut/checkpoints --no-progress > $W/resumed.log 2>&1
echo "resumed: exit $? $(grep -o '"params_blake3": "[0-9a-f]*' $W/resumed/summary.json)"
cp $W/*.log "$OUT/" 2>/dev/null

echo "== real torchrun: one job of two ranks against --world 2 (CPU, gpt-tiny, 30 steps)"
C=$PWD/configs/gpt-tiny.json
(cd $W && timeout 300 torchrun --nproc_per_node 2 --no-python $T train --config $C --steps 30 --output $W/tr --no-progress > $W/torchrun.log 2>&1; echo "torchrun exit $?")
timeout 300 $T train --config $C --world 2 --steps 30 --output $W/w2 --no-progress > $W/w2.log 2>&1; echo "--world 2 exit $?"
echo "torchrun: $(grep -o '"params_blake3": "[0-9a-f]*' $W/tr/summary.json) world_size $(grep -o '"world_size": [0-9]*' $W/tr/summary.json)"
echo "world 2:  $(grep -o '"params_blake3": "[0-9a-f]*' $W/w2/summary.json)"
cp $W/torchrun.log "$OUT/"

echo "== export checked with torch + transformers"
timeout 120 $T export --checkpoint $W/w2/checkpoints --out $W/hf && timeout 300 python3 scripts/check_export.py $W/hf 2>&1 | tail -8

echo "== a transformers-made LLaMA folder fine-tuned on the GPU from Parquet, exported, loaded by transformers"
if [ -f .device-bin/corpus.parquet ]; then
  cat > $W/ft.json <<'EOF'
{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
  "optimizer": { "type": "AdamW", "params": { "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 } },
  "bf16": { "enabled": true }, "zero_optimization": { "stage": 1 }, "steps_per_print": 5,
  "tessera": { "seq_len": 64, "steps": 20, "eval_interval": 10, "eval_iters": 1 } }
EOF
  timeout 240 $T train --config $W/ft.json --model tests/fixtures/hf/llama-gpu --data .device-bin/corpus.parquet --device cuda \
    --output $W/llama --no-progress > $W/llama.log 2>&1
  echo "train --device cuda: exit $?; $(grep -E '^val loss|^throughput' $W/llama.log | tr '\n' ' ')"
  timeout 120 $T export --checkpoint $W/llama/checkpoints --out $W/llama-hf 2>&1 | head -1
  timeout 300 python3 scripts/check_export.py $W/llama-hf 2>&1 | grep -E "^(OK|FAIL|SKIP)"
  cp $W/llama.log "$OUT/" 2>/dev/null
else
  echo "skipped: no .device-bin/corpus.parquet (python3 scripts/corpus_parquet.py .device-bin/corpus.parquet here)"
fi
