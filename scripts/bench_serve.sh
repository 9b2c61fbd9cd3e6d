#!/usr/bin/env bash
# The serving benchmark: `tessera serve` on MODEL (a model folder or checkpoint) under the same
# Poisson load (`tessera bench-serve`) with continuous batching (--max-seqs 32) and with one
# sequence at a time (--max-seqs 1, the peer: what serving without a batching scheduler gives),
# in one invocation. Extra arguments go to bench-serve (e.g. --requests 500 --rate 8
# --prompt-tokens 8:24 --output-tokens 8:32).
# Environment: SERVE_BIN (default target/release/tessera); SERVE_ARGS, more arguments of
# `tessera serve` (e.g. "--device cuda"); SEQS, the --max-seqs values to run (default "32 1").
# Usage: scripts/bench_serve.sh MODEL [bench-serve args...]
set -euo pipefail
model=$1
shift
bin=${SERVE_BIN:-target/release/tessera}
for seqs in ${SEQS:-32 1}; do
  log=$(mktemp)
  # shellcheck disable=SC2086 # SERVE_ARGS is a list of words
  "$bin" serve --model "$model" --addr 127.0.0.1:0 --max-seqs "$seqs" --max-queue 100000 ${SERVE_ARGS:-} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    grep -q 'on http://' "$log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.1
  done
  url=$(grep -o 'http://[0-9.:]*' "$log" | head -1)
  echo "== tessera serve --max-seqs $seqs ${SERVE_ARGS:-}"
  "$bin" bench-serve --url "$url" "$@"
  kill -TERM "$pid"
  wait "$pid" || true
  rm -f "$log"
done
