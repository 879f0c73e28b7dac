#!/usr/bin/env bash
# Stop a cluster started by launch_cluster.sh: SIGTERM the routers (every router-I of --routers N,
# each finishing its own requests), prefill and colocated nodes, and once they have exited the
# decode nodes (each drains what it has in flight); SIGKILL whatever is left --timeout seconds
# (default 40) after its SIGTERM.
# Leaves no process behind; removes the pid files. A cluster placed by Ray (its run dir has
# ray.json) is stopped by pdtb cluster down: every actor and placement group goes.
# With --node NAME (e.g. decode-1) only that node is stopped: a decode node drains, and the router
# moves its decoding requests to the other decode nodes (live migration) while it does.
# A supervisor (launch_cluster.sh --restart-failed) is stopped first; a node stopped by --node
# is marked NAME.stopping, so that the supervisor leaves it stopped.
# A pid file's process is signalled only if it is this cluster's (launch_cluster.sh puts
# PDTB_RUN_DIR=<run dir> in its environment): a pid reused by another process since is left alone.
set -euo pipefail
RUN_DIR="" TIMEOUT=40 NODE=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
      echo "usage: stop_cluster.sh --run-dir DIR [--timeout S] [--node NAME]"; exit 0 ;;
    --run-dir|--timeout|--node) [ $# -ge 2 ] || { echo "stop_cluster: $1 needs a value" >&2; exit 2; }
      case "$1" in --run-dir) RUN_DIR="$2" ;; --timeout) TIMEOUT="$2" ;; *) NODE="$2" ;; esac; shift 2 ;;
    *) echo "stop_cluster: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$RUN_DIR" ] || { echo "stop_cluster: --run-dir DIR is required" >&2; exit 2; }
case "$TIMEOUT" in ''|*[!0-9]*) echo "stop_cluster: --timeout wants a whole number of seconds, got '$TIMEOUT'" >&2; exit 2 ;; esac
[ -d "$RUN_DIR" ] || { echo "stop_cluster: no such run dir: $RUN_DIR" >&2; exit 2; }
if [ -f "$RUN_DIR/ray.json" ]; then  # placed by Ray (launch_cluster.sh --ray): its actors and groups go
  [ -z "$NODE" ] || { echo "stop_cluster: --node on a Ray cluster: POST /admin/drain {\"node\": ...} to the router" >&2; exit 2; }
  source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/_env.sh"
  exec pdtb cluster down --run-dir "$RUN_DIR" --timeout "$TIMEOUT"
fi

# Two phases, so that nothing in flight is lost to the order of shutdown. First the router
# (it stops accepting and waits out its grace period for the requests it has), the prefill
# nodes (they finish their prompts and hand the pages off) and colocated nodes; then, once
# those have exited, the decode nodes, which until then keep taking hand-offs and serving the
# router's streams. A decode node that drained first would refuse the last hand-offs.
# Each phase gets --timeout seconds: the decode nodes' drain does not lose its time to a
# router that used all of the first phase's.
RUN_DIR_P="$(cd "$RUN_DIR" && pwd -P)"
ours() {  # ours PID: the process was started by launch_cluster.sh for this run dir
  tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qxF "PDTB_RUN_DIR=$RUN_DIR_P"
}
pids=()
gone_or_wait() {  # PID...: wait (at most 5 s) until each is gone or a zombie: a SIGKILLed process
  local pid deadline=$(( SECONDS + 5 ))  # takes a moment to go, and whoever checks next must not see it
  for pid in "$@"; do
    while kill -0 "$pid" 2>/dev/null && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null || echo Z)" != Z ] \
          && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
  done
}
term_and_wait() {  # role...: SIGTERM their processes, wait (up to --timeout) until they exit
  local role f pid phase=() deadline=$(( SECONDS + TIMEOUT ))
  for role in "$@"; do
    for f in "$RUN_DIR/$role".pid "$RUN_DIR/$role"-*.pid; do  # (one node by name, or every node of a role)
      [ -f "$f" ] || continue
      pid="$(cat "$f")"
      kill -0 "$pid" 2>/dev/null || continue  # gone already
      if ! ours "$pid"; then
        echo "stop_cluster: pid $pid of $(basename "$f") is not this cluster's process now: left alone" >&2
      else
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
      gone_or_wait "$pid"
    fi
  done
}
if [ -n "$NODE" ]; then
  case "$NODE" in */*|.*|'') echo "stop_cluster: bad node name $NODE" >&2; exit 2 ;; esac
  [ -f "$RUN_DIR/$NODE.pid" ] || { echo "stop_cluster: no $NODE.pid in $RUN_DIR" >&2; exit 2; }
  : > "$RUN_DIR/$NODE.stopping"
  term_and_wait "$NODE"
  for pid in ${pids[@]+"${pids[@]}"}; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  rm -f "$RUN_DIR/$NODE.pid"
  echo "stopped $NODE in $RUN_DIR"
  exit 0
fi
term_and_wait supervisor
term_and_wait router prefill colocated
term_and_wait decode
for pid in ${pids[@]+"${pids[@]}"}; do
  kill -KILL -- "-$pid" 2>/dev/null || true  # anything it started (its process group)
done
gone_or_wait ${pids[@]+"${pids[@]}"}
rm -f "$RUN_DIR"/*.pid
echo "stopped ${#pids[@]} process(es) in $RUN_DIR"
