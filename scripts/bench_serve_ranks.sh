#!/usr/bin/env bash
# Serving over pipeline ranks against one process: `tessera serve` on MODEL in this process,
# then with its blocks over 1 and 2 rank processes (--pipeline-parallel-size), each under the
# same `tessera bench-serve` load, in one invocation. SERVE_ARGS go to every server (e.g.
# "--max-seqs 1" for batch 1), the rest to bench-serve.
# ORDER (default "0 1 2") is the order of the servers, 0 meaning this process alone.
# Usage: [ORDER="2 1 0"] scripts/bench_serve_ranks.sh MODEL "SERVE_ARGS" [bench-serve args...]
set -euo pipefail
model=$1
serve_args=$2
shift 2
bin=target/release/tessera
for n in ${ORDER:-0 1 2}; do
  pp=${n#0}
  log=$(mktemp)
  # shellcheck disable=SC2086
  "$bin" serve --model "$model" --addr 127.0.0.1:0 --max-queue 100000 $serve_args ${pp:+--pipeline-parallel-size $pp} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do grep -q 'on http://' "$log" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$log" | head -1)
  echo "== tessera serve $serve_args ${pp:+--pipeline-parallel-size $pp}"
  "$bin" bench-serve --url "$url" "$@"
  kill -TERM "$pid"
  wait "$pid" || true
  rm -f "$log"
done
