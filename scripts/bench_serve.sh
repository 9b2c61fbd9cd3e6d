#!/usr/bin/env bash
# The serving benchmark: `tessera serve` on MODEL (a model folder or checkpoint) under the same
# Poisson load (`tessera bench-serve`) with continuous batching (--max-seqs 32) and with one
# sequence at a time (--max-seqs 1, the peer: what serving without a batching scheduler gives),
# in one invocation. Extra arguments go to bench-serve (e.g. --requests 500 --rate 8
# --prompt-tokens 8:24 --output-tokens 8:32).
# Usage: scripts/bench_serve.sh MODEL [bench-serve args...]
set -euo pipefail
model=$1
shift
bin=target/release/tessera
for seqs in 32 1; do
  log=$(mktemp)
  "$bin" serve --model "$model" --addr 127.0.0.1:0 --max-seqs "$seqs" --max-queue 100000 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q 'on http://' "$log" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$log" | head -1)
  echo "== tessera serve --max-seqs $seqs"
  "$bin" bench-serve --url "$url" "$@"
  kill -TERM "$pid"
  wait "$pid" || true
  rm -f "$log"
done
