#!/usr/bin/env bash
# Serving over pipeline ranks on two network-namespace hosts against one process and against two
# ranks on this machine: `tessera serve` on MODEL alone ("one"), with --pipeline-parallel-size 2
# (ranks started here, "local"), and with --pipeline-parallel-size 2 --rank-listen (the ranks
# `tessera serve-rank --join` in two network namespaces joined by veth to a bridge, the server
# attached to it, "hosts"), each under the same `tessera bench-serve` load, in one invocation.
# SERVE_ARGS go to every server (e.g. "--max-seqs 1" for batch 1), the rest to bench-serve.
# ORDER (default "one local hosts") is the order of the servers. Needs root and iproute2.
# Usage: [ORDER="hosts local one"] scripts/bench_serve_hosts.sh MODEL "SERVE_ARGS" [bench-serve args...]
set -euo pipefail
model=$1
serve_args=$2
shift 2
bin=target/release/tessera
p=tsrb$$
net=10.231.82
tmp=$(mktemp -d)
cleanup() {
  ip link del "${p}r" 2>/dev/null || true
  for ns in "${p}h0" "${p}h1" "${p}br"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
ip netns add "${p}br"
ip -n "${p}br" link add br0 type bridge
ip -n "${p}br" link set br0 up
for i in 0 1; do
  ip netns add "${p}h$i"
  ip -n "${p}h$i" link set lo up
  ip -n "${p}h$i" link add eth0 type veth peer name "v$i" netns "${p}br"
  ip -n "${p}br" link set "v$i" master br0
  ip -n "${p}br" link set "v$i" up
  ip -n "${p}h$i" addr add "$net.$((i + 1))/24" dev eth0
  ip -n "${p}h$i" link set eth0 up
done
ip link add "${p}r" type veth peer name vroot netns "${p}br"
ip -n "${p}br" link set vroot master br0
ip -n "${p}br" link set vroot up
ip addr add "$net.254/24" dev "${p}r"
ip link set "${p}r" up
port=47800
for mode in ${ORDER:-one local hosts}; do
  log=$tmp/serve.log
  extra=()
  case $mode in
    one) ;;
    local) extra=(--pipeline-parallel-size 2) ;;
    hosts)
      port=$((port + 1))
      extra=(--pipeline-parallel-size 2 --rank-listen "$net.254:$port" --token-file "$tmp/token")
      rm -f "$tmp/token" ;;
    *) echo "unknown server $mode (one, local, hosts)" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  "$bin" serve --model "$model" --addr 127.0.0.1:0 --max-queue 100000 $serve_args "${extra[@]}" >"$log" 2>&1 &
  pid=$!
  if [ "$mode" = hosts ]; then
    for _ in $(seq 600); do [ -s "$tmp/token" ] && break; sleep 0.1; done
    for i in 0 1; do
      ip netns exec "${p}h$i" "$bin" serve-rank --join "$net.254:$port" --token-file "$tmp/token" --model "$model" --rank "$i" --name "host$i" >"$tmp/rank$i.log" 2>&1 &
    done
  fi
  for _ in $(seq 1200); do grep -q 'on http://' "$log" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$log" | head -1)
  echo "== $mode: tessera serve $serve_args ${extra[*]}"
  "$bin" bench-serve --url "$url" "$@"
  kill -TERM "$pid"
  wait "$pid" || true
  wait
done
