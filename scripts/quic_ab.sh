#!/bin/bash
# Alternates collective_bench configurations, round by round, for A/B measurements of the QUIC
# transport (docs/PERFORMANCE.md, "QUIC collectives between processes").
#   BIN_DIR  where the binaries are (default .device-bin: stripped collective_bench builds, e.g.
#            cb_base from main and cb_new from a change, copied there and carried to the GPU machine)
#   CFGS     words "bin" or "bin:VAR=V,VAR=V" (environment for that run), default "cb_base cb_new"
#   ROUNDS   default 3; ARGS default "--procs 2,3,4 --mib 64 --reps 5"
# Appends the table rows of every run, under a "=== round R CFG" line, to ${OUT:-/tmp}/ab.txt.
set -euo pipefail
cd "${BIN_DIR:-.device-bin}"
ROUNDS=${ROUNDS:-3}; ARGS=${ARGS:---procs 2,3,4 --mib 64 --reps 5}; CFGS=${CFGS:-cb_base cb_new}
o=${OUT:-/tmp}/ab.txt
echo "# $(date -u +%FT%TZ) $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); CFGS=\"$CFGS\" ARGS=\"$ARGS\"" | tee -a "$o"
for r in $(seq "$ROUNDS"); do
  for c in $CFGS; do
    b=${c%%:*}; e=""
    [ "$c" != "$b" ] && e=$(echo "${c#*:}" | tr ',' ' ')
    echo "=== round $r $c" | tee -a "$o"
    # shellcheck disable=SC2086
    env $e "./$b" $ARGS 2>&1 | grep -E '^\|' | grep -vE 'op \||---' | tee -a "$o"
  done
done
