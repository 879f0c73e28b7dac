#!/usr/bin/env bash
# Stop a cluster started by launch_cluster.sh: SIGTERM the router, prefill and colocated nodes,
# and once they have exited the decode nodes (each drains what it has in flight); SIGKILL
# whatever is left --timeout seconds (default 40) after its SIGTERM.
# Leaves no process behind; removes the pid files.
set -euo pipefail
RUN_DIR="" TIMEOUT=40
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,5p' "$0"; echo "usage: stop_cluster.sh --run-dir DIR [--timeout S]"; exit 0 ;;
    --run-dir|--timeout) [ $# -ge 2 ] || { echo "stop_cluster: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --run-dir ]; then RUN_DIR="$2"; else TIMEOUT="$2"; fi; shift 2 ;;
    *) echo "stop_cluster: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$RUN_DIR" ] || { echo "stop_cluster: --run-dir DIR is required" >&2; exit 2; }
case "$TIMEOUT" in ''|*[!0-9]*) echo "stop_cluster: --timeout wants a whole number of seconds, got '$TIMEOUT'" >&2; exit 2 ;; esac
[ -d "$RUN_DIR" ] || { echo "stop_cluster: no such run dir: $RUN_DIR" >&2; exit 2; }

# Two phases, so that nothing in flight is lost to the order of shutdown. First the router
# (it stops accepting and waits out its grace period for the requests it has), the prefill
# nodes (they finish their prompts and hand the pages off) and colocated nodes; then, once
# those have exited, the decode nodes, which until then keep taking hand-offs and serving the
# router's streams. A decode node that drained first would refuse the last hand-offs.
# Each phase gets --timeout seconds: the decode nodes' drain does not lose its time to a
# router that used all of the first phase's.
pids=()
term_and_wait() {  # role...: SIGTERM their processes, wait (up to --timeout) until they exit
  local role f pid phase=() deadline=$(( SECONDS + TIMEOUT ))
  for role in "$@"; do
    for f in "$RUN_DIR/$role"-*.pid; do
      [ -f "$f" ] || continue
      pid="$(cat "$f")"
      if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid")
        phase+=("$pid")
      fi
    done
    [ "$role" = router ] && sleep 0.2  # let the router stop accepting before nodes drain
  done
  for pid in ${phase[@]+"${phase[@]}"}; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
  done
  for pid in ${phase[@]+"${phase[@]}"}; do  # this phase's leftovers go before the next phase starts
    if kill -0 "$pid" 2>/dev/null; then
      echo "stop_cluster: pid $pid did not exit within ${TIMEOUT}s of its SIGTERM, killing" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}
term_and_wait router prefill colocated
term_and_wait decode
for pid in ${pids[@]+"${pids[@]}"}; do
  kill -KILL -- "-$pid" 2>/dev/null || true  # anything it started (its process group)
done
rm -f "$RUN_DIR"/*.pid
echo "stopped ${#pids[@]} process(es) in $RUN_DIR"
