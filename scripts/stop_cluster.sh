#!/usr/bin/env bash
# Stop a cluster started by launch_cluster.sh: SIGTERM (router first, then prefill, decode,
# colocated nodes drain), then SIGKILL whatever is left after --timeout seconds (default 40).
# Leaves no process behind; removes the pid files.
set -euo pipefail
RUN_DIR="" TIMEOUT=40
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,4p' "$0"; echo "usage: stop_cluster.sh --run-dir DIR [--timeout S]"; exit 0 ;;
    --run-dir|--timeout) [ $# -ge 2 ] || { echo "stop_cluster: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --run-dir ]; then RUN_DIR="$2"; else TIMEOUT="$2"; fi; shift 2 ;;
    *) echo "stop_cluster: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$RUN_DIR" ] || { echo "stop_cluster: --run-dir DIR is required" >&2; exit 2; }
[ -d "$RUN_DIR" ] || { echo "stop_cluster: no such run dir: $RUN_DIR" >&2; exit 2; }

pids=()
for role in router prefill decode colocated; do
  for f in "$RUN_DIR/$role"-*.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  [ "$role" = router ] && sleep 0.2  # let the router stop accepting before nodes drain
done
deadline=$(( SECONDS + TIMEOUT ))
for pid in ${pids[@]+"${pids[@]}"}; do
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
done
for pid in ${pids[@]+"${pids[@]}"}; do
  if kill -0 "$pid" 2>/dev/null; then
    echo "stop_cluster: pid $pid did not exit after ${TIMEOUT}s, killing" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  kill -KILL -- "-$pid" 2>/dev/null || true  # anything it started (its own session)
done
rm -f "$RUN_DIR"/*.pid
echo "stopped ${#pids[@]} process(es) in $RUN_DIR"
