#!/bin/bash
# Instructions the exposing side (the server, in the default server-exposes mode) spends per
# bulk transfer, counted by callgrind: what the local-invalidation fallback adds over remote
# invalidation, size by size. Counts are stable where wall time on this VM is not.
#
#   bench/bulk_exposing_cost.sh [sizes...]      (default: 4096 65536 1048576)
#
# The server runs under callgrind, collecting only inside the worker's message and completion
# handling and its doorbells (HandleRecv, HandleSendCompletion, FlushSends, RepostRecvs: where
# a bind, an ack, a LOCAL_INV and its completion are paid for), not its idle polling or the
# timers; the client runs natively for 3 s at depth 8. The count is divided by the number of
# requests the server dispatched (callgrind's call count of Worker::DispatchCall).
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build -c opt //bench:rpc_perf >/dev/null 2>&1
B=bazel-out/k8-opt/bin/bench/rpc_perf
SIZES=("$@"); [ ${#SIZES[@]} -eq 0 ] && SIZES=(4096 65536 1048576)
T=$(mktemp -d); trap 'pkill -f "rpc_perf --server --port_file $T" 2>/dev/null; rm -rf "$T"' EXIT

calls() {  # calls() FILE FUNCTION: how many times FUNCTION was called, from callgrind's output
  python3 - "$1" "$2" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
names, cur, total = {}, None, 0
for l in lines:
    m = re.match(r'c?fn=\((\d+)\)(?: (.*))?', l)
    if m and m.group(2): names[m.group(1)] = m.group(2)
for l in lines:
    m = re.match(r'cfn=\((\d+)\)', l)
    if m: cur = names.get(m.group(1), '')
    m = re.match(r'calls=(\d+)', l)
    if m and cur and '::' + sys.argv[2] + '(' in cur: total += int(m.group(1))
print(total)
PY
}

run() {  # run TEST SIZE MODE: instructions per transfer, or "n/a" if the mode did not hold
  # The mode must be the one asked for: under valgrind the server's capability self-test can
  # time out, and the connection then falls back to local invalidation (tried 3 times).
  local want=INVALIDATION_REMOTE attempt
  case "$3" in *+local-inv) want=INVALIDATION_LOCAL ;; esac
  for attempt in 1 2 3; do
    if one_run "$@" && grep -q "\"invalidation\":\"$want\"" "$T"/client.json; then
      echo "$RESULT"
      return
    fi
  done
  echo n/a
}

one_run() {  # one_run TEST SIZE MODE: sets RESULT
  rm -f "$T"/pf "$T"/cg*
  valgrind --tool=callgrind --separate-threads=yes \
    --toggle-collect='swirl::internal::Worker::HandleRecv*' \
    --toggle-collect='swirl::internal::Worker::HandleSendCompletion*' \
    --toggle-collect='swirl::internal::Worker::FlushSends*' \
    --toggle-collect='swirl::internal::Worker::RepostRecvs*' \
    --callgrind-out-file="$T"/cg $B --server --port_file "$T"/pf --server_core -1 \
    >"$T"/server.log 2>&1 &
  for _ in $(seq 300); do [ -s "$T"/pf ] && break; sleep 0.1; done
  $B --connect "localhost:$(cat "$T"/pf)" --test "$1" --size "$2" --bulk_mode "$3" --depth 8 \
    --seconds 3 --client_core 0 --json >"$T"/client.json 2>/dev/null
  pkill -INT -f "rpc_perf --server --port_file $T"
  for _ in $(seq 150); do pgrep -f "rpc_perf --server --port_file $T" >/dev/null || break; sleep 0.2; done
  local ir=0 worker n
  for f in "$T"/cg-*; do ir=$((ir + $(grep -h '^totals:' "$f" | awk '{print $2}'))); done
  worker=$(ls -S "$T"/cg-* | head -1)
  n=$(calls "$worker" DispatchCall)
  [ "$n" -gt 0 ] || return 1
  RESULT=$((ir / n))
}

printf '%-10s %8s %12s %12s %8s\n' test size remote-inv local-inv extra
for test in bulk_read bulk_write; do
  for size in "${SIZES[@]}"; do
    r=$(run "$test" "$size" server-exposes)
    l=$(run "$test" "$size" server-exposes+local-inv)
    extra=n/a
    [ "$r" != n/a ] && [ "$l" != n/a ] && extra=$((l - r))
    printf '%-10s %8s %12s %12s %8s\n' "$test" "$size" "$r" "$l" "$extra"
  done
done
