#!/usr/bin/env bash
# Launch a pd-testbed cluster: nodes + router, on loopback by default.
#
#   scripts/launch_cluster.sh --mode disagg|colocated [--prefill N] [--decode M] [--colocated K]
#       [--model DIR] [--policy NAME|module:Class|path/to/file.py:Class] [--policy-arg KEY=VALUE]...
#       [--transport zmq|torch|shm|auto] [--dist-init-method URL]
#       [--kv-pages N] [--host-kv-pages N] [--routers N]
#       [--prefill-kv-pages N] [--page-size T] [--port P] [--run-dir DIR] [--host IFACE] [--hosts-file FILE]
#       [--router-args "..."] [--prefill-args "..."] [--decode-args "..."] [--curve-dir DIR] [--timeout S]
#       [--ray ADDRESS|auto [--ray-name NAME] [--node-resources ROLE=JSON]... [--router-resources JSON]
#        [--placement spread|pack]] [--restart-failed]
#       [-- extra node flags]
#
# Flags after "--" go to every node; --prefill-args / --decode-args (split on spaces, like
# --router-args) go to the nodes of that role only, after them (e.g. --prefill-args
# "--transport-fault drop=0.1" injects faults on the prefill nodes' KV senders).
#
# --policy picks every node's policy by reference (fairness/registry.py); --policy-arg (repeatable)
# sets one of its own settings on every node. Both are checked before anything starts: a
# reference that does not load, or a setting it does not have or out of its range, stops the
# script with the reason (status 2). A policy file's relative path is made absolute here (nodes
# run elsewhere: over ssh in the checkout, under Ray in a worker's directory); on other hosts
# the file must be at that same path, as the model is.
#
# --routers N: N router processes behind the one port (SO_REUSEPORT: the kernel gives each
# connection to one of them), router-I.{log,pid,argv}; router-0 binds --port (0: a free one),
# the others join it. Each also serves a private admin address on loopback, written to
# router-I.admin (an admin request for another router's request is forwarded there), and they
# share router-metrics/ (prometheus_client's multiprocess mode: /metrics is their sum). Only
# router-0 runs the pressure or fair rebalancer; every router moves its own requests off a
# draining node. See "Several routers" in docs/cluster.md.
#
# Nodes bind ephemeral ports and report them ("NODE READY {json}" in their log), so two clusters
# never collide; the router listens on --port (default 8000; 0 picks a free one). Logs and pid
# files go to the run dir as ROLE-INDEX.log / ROLE-INDEX.pid. Prints "READY http://HOST:PORT"
# once /health is 200. On any failure: prints the failing log's tail, stops what it started,
# exits non-zero.
#
# --transport torch: KV payloads by torch.distributed (gloo on CPU, NCCL on GPUs); every prefill
# and decode node joins one process group (decode nodes rank 0..M-1, prefill nodes after them),
# rendezvous at --dist-init-method (default file://RUN_DIR/dist-init; tcp://HOST:PORT across hosts).
#
# --transport shm: prefill nodes write KV straight into the decode nodes' pools (shared memory,
# one host, CPU pools); --transport auto: the same where a decode pool can be mapped, ZeroMQ
# otherwise (other hosts, GPU pools).
#
# --ray ADDRESS: the nodes and the router are placed by Ray on the Ray cluster at ADDRESS (`ray
# start --head` prints it; auto: the one this host belongs to), as `pdtb cluster up` does (see
# pdtb/ray_cluster/launch.py): each node is a Ray actor in its role's placement group, bound to
# its Ray node's address; stop_cluster.sh --run-dir removes every actor and group. Needs the
# ray extra (pip install 'pd-testbed[ray]') and the project on every Ray node.
#
# --restart-failed: a process that exits is started again in place (pdtb supervise, its pid in
# supervisor.pid, its log supervisor.log; pdtb/local_cluster/supervise.py): a node under a new
# node id ROLE-I~N, added to the router; the router on its port over the live nodes. Every
# process's command line is in ROLE-I.argv for it. Under Ray, Ray's supervisor does the same.
#
# Multi-host without Ray (a thin fallback: no placement, no supervision, never run in CI):
# --hosts-file lines "ROLE HOST" (e.g. "decode 10.0.0.2"); nodes of that role are
# started there over ssh (same checkout path, its .venv), bound to HOST. See README.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

MODE=disagg NP=1 ND=1 NC=1 NR=1 MODEL="" POLICY=fcfs TRANSPORT=zmq KV_PAGES=4096 HOST_KV_PAGES=0
CURVE_DIR="" PREFILL_KV_PAGES="" PAGE_SIZE=16 PORT=8000 RUN_DIR="" HOST=127.0.0.1 HOSTS_FILE="" TIMEOUT=180 ROUTER_ARGS=""
PREFILL_ARGS="" DECODE_ARGS="" DIST_INIT="" RAY="" RAY_ARGS=() POLICY_ARGS=() RESTART=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in  # every option but --, -h, --help and --restart-failed takes a value
    --|-h|--help|--restart-failed) ;;
    --router-args|--prefill-args|--decode-args)  # (their values are flags)
      [ $# -ge 2 ] || { echo "launch_cluster: $1 needs a value" >&2; exit 2; } ;;
    -*) [ $# -ge 2 ] && [ "${2#--}" = "$2" ] || { echo "launch_cluster: $1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --mode) MODE="$2"; shift 2 ;;
    --prefill) NP="$2"; shift 2 ;;
    --decode) ND="$2"; shift 2 ;;
    --colocated) NC="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --policy) POLICY="$2"; shift 2 ;;
    --policy-arg) POLICY_ARGS+=(--policy-arg "$2"); shift 2 ;;
    --transport) TRANSPORT="$2"; shift 2 ;;
    --dist-init-method) DIST_INIT="$2"; shift 2 ;;
    --kv-pages) KV_PAGES="$2"; shift 2 ;;
    --host-kv-pages) HOST_KV_PAGES="$2"; shift 2 ;;
    --prefill-kv-pages) PREFILL_KV_PAGES="$2"; shift 2 ;;
    --page-size) PAGE_SIZE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --hosts-file) HOSTS_FILE="$2"; shift 2 ;;
    --router-args) ROUTER_ARGS="$2"; shift 2 ;;
    --prefill-args) PREFILL_ARGS="$2"; shift 2 ;;
    --decode-args) DECODE_ARGS="$2"; shift 2 ;;
    --curve-dir) CURVE_DIR="$(cd "$2" && pwd)"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --routers) NR="$2"; shift 2 ;;
    --ray) RAY="$2"; shift 2 ;;
    --ray-name) RAY_ARGS+=(--name "$2"); shift 2 ;;
    --node-resources|--router-resources|--placement) RAY_ARGS+=("$1" "$2"); shift 2 ;;
    --restart-failed) RAY_ARGS+=(--restart-failed); RESTART=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "launch_cluster: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$MODE" in disagg|colocated) ;; *) echo "launch_cluster: --mode must be disagg or colocated" >&2; exit 2 ;; esac
whole() {  # whole FLAG VALUE MIN [MAX]: a whole number in range, checked before anything starts
  case "$2" in ''|*[!0-9]*) echo "launch_cluster: $1 wants a whole number, got '$2'" >&2; exit 2 ;; esac
  if [ -n "${4:-}" ] && { [ "$2" -lt "$3" ] || [ "$2" -gt "$4" ]; }; then
    echo "launch_cluster: $1 must be between $3 and $4, got $2" >&2; exit 2
  elif [ "$2" -lt "$3" ]; then
    echo "launch_cluster: $1 must be at least $3, got $2" >&2; exit 2
  fi
}
if [ "$MODE" = disagg ]; then whole --prefill "$NP" 1; whole --decode "$ND" 1; else whole --colocated "$NC" 1; fi
whole --kv-pages "$KV_PAGES" 1; whole --host-kv-pages "$HOST_KV_PAGES" 0; whole --page-size "$PAGE_SIZE" 1
[ -z "$PREFILL_KV_PAGES" ] || whole --prefill-kv-pages "$PREFILL_KV_PAGES" 1
whole --port "$PORT" 0 65535; whole --timeout "$TIMEOUT" 1; whole --routers "$NR" 1

source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"
POLICY="$(policy_check launch_cluster "$POLICY" ${POLICY_ARGS[@]+"${POLICY_ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"})" \
  || exit 2
RUN_DIR="${RUN_DIR:-$ROOT/runs/cluster-$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$RUN_DIR" 2>/dev/null && [ -w "$RUN_DIR" ] || { echo "launch_cluster: cannot use $RUN_DIR as a run dir" >&2; exit 2; }
case "$TRANSPORT" in zmq|torch|shm|auto) ;; *) echo "launch_cluster: --transport must be zmq, torch, shm or auto" >&2; exit 2 ;; esac
if [ -n "$RAY" ]; then  # Ray places and supervises: pdtb cluster up does the rest
  [ -z "$HOSTS_FILE" ] || { echo "launch_cluster: --ray and --hosts-file exclude each other" >&2; exit 2; }
  [ "$TRANSPORT" != torch ] || { echo "launch_cluster: --transport torch is not placed by Ray yet (zmq, shm or auto)" >&2; exit 2; }
  source "$ROOT/scripts/_env.sh"
  args=(--ray "$RAY" --mode "$MODE" --prefill "$NP" --decode "$ND" --colocated "$NC" --policy "$POLICY"
        ${POLICY_ARGS[@]+"${POLICY_ARGS[@]}"}
        --transport "$TRANSPORT" --kv-pages "$KV_PAGES" --host-kv-pages "$HOST_KV_PAGES" --page-size "$PAGE_SIZE"
        --port "$PORT" --routers "$NR" --timeout "$TIMEOUT" --router-args "$ROUTER_ARGS" --prefill-args "$PREFILL_ARGS"
        --decode-args "$DECODE_ARGS" ${MODEL:+--model "$MODEL"} ${PREFILL_KV_PAGES:+--prefill-kv-pages "$PREFILL_KV_PAGES"}
        ${RUN_DIR:+--run-dir "$RUN_DIR"} ${CURVE_DIR:+--curve-dir "$CURVE_DIR"} ${RAY_ARGS[@]+"${RAY_ARGS[@]}"})
  exec pdtb cluster up "${args[@]}" -- ${EXTRA[@]+"${EXTRA[@]}"}
fi
RUN_DIR="$(cd "$RUN_DIR" && pwd -P)"
[ -z "$RESTART" ] || [ -z "$HOSTS_FILE" ] || { echo "launch_cluster: --restart-failed restarts processes on this host only (not with --hosts-file)" >&2; exit 2; }
if ls "$RUN_DIR"/*.pid >/dev/null 2>&1; then
  echo "launch_cluster: $RUN_DIR already has pid files; stop that cluster first" >&2; exit 2
fi
if [ "$TRANSPORT" = torch ] && [ -z "$DIST_INIT" ]; then
  DIST_INIT="file://$RUN_DIR/dist-init"  # single host; several hosts: --dist-init-method tcp://HOST:PORT
  rm -f "${DIST_INIT#file://}"  # a file left by an earlier run would confuse the rendezvous
fi
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.engine.model_info import resolve_model_arg; print(resolve_model_arg(None))')"
export PDTB_RUN_DIR="$RUN_DIR"  # in every process started here: stop_cluster.sh signals only those
PDTB_BIN="$(command -v pdtb)"
rm -f "$RUN_DIR"/*.argv "$RUN_DIR"/*.stopping "$RUN_DIR/supervisor.jsonl"

STARTED=() CLEANED=""
cleanup() {  # stop whatever was started here (once)
  [ -z "$CLEANED" ] || return 0
  CLEANED=1
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$RUN_DIR" --timeout 5 >&2 || true
}
fail() {
  echo "launch_cluster: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then echo "---- tail of $2 ----" >&2; tail -n 30 "$2" >&2; fi
  cleanup
  exit 1
}
trap 'fail "interrupted"' INT TERM HUP
trap 'rc=$?; [ "$rc" -eq 0 ] || cleanup' EXIT  # any other way out (an error under set -e) leaves nothing running

host_for() {  # host_for ROLE INDEX -> host (hosts file round-robin, else --host)
  if [ -n "$HOSTS_FILE" ]; then
    mapfile -t hs < <(awk -v r="$1" '$1==r {print $2}' "$HOSTS_FILE")
    if [ "${#hs[@]}" -gt 0 ]; then echo "${hs[$(( $2 % ${#hs[@]} ))]}"; return; fi
  fi
  echo "$HOST"
}

is_local() {  # loopback, or --host with no hosts file
  case "$1" in 127.*|localhost|::1) return 0 ;; esac
  [ -z "$HOSTS_FILE" ]
}

start_node() {  # start_node ROLE INDEX
  local role="$1" idx="$2" h log pidf
  h="$(host_for "$role" "$idx")"
  log="$RUN_DIR/$role-$idx.log"; pidf="$RUN_DIR/$role-$idx.pid"
  local pages="$KV_PAGES"
  [ "$role" = prefill ] && [ -n "$PREFILL_KV_PAGES" ] && pages="$PREFILL_KV_PAGES"
  local role_args=()
  [ "$role" = prefill ] && read -r -a role_args <<< "$PREFILL_ARGS"
  [ "$role" = decode ] && read -r -a role_args <<< "$DECODE_ARGS"
  local args=(--model "$MODEL" --node-id "$role-$idx" --host "$h" --page-size "$PAGE_SIZE"
              --kv-pages "$pages" --transport "$TRANSPORT" --policy "$POLICY" ${POLICY_ARGS[@]+"${POLICY_ARGS[@]}"}
              --host-kv-pages "$HOST_KV_PAGES"
              ${CURVE_DIR:+--curve-dir "$CURVE_DIR"} ${EXTRA[@]+"${EXTRA[@]}"} ${role_args[@]+"${role_args[@]}"})
  if [ "$TRANSPORT" = torch ] && [ "$MODE" = disagg ]; then  # one process group: decode ranks first
    local rank=$idx
    [ "$role" = prefill ] && rank=$(( ND + idx ))
    args+=(--dist-init-method "$DIST_INIT" --dist-rank "$rank" --dist-world-size "$(( NP + ND ))")
  fi
  : > "$log"  # (emptied here, before the wait reads it: an earlier run's READY line is not this one's)
  printf '%s\0' "$PDTB_BIN" "$role" "${args[@]}" > "$RUN_DIR/$role-$idx.argv"  # (pdtb supervise restarts from it)
  if is_local "$h"; then
    setsid pdtb "$role" "${args[@]}" > "$log" 2>&1 < /dev/null &
  else
    setsid ssh -o BatchMode=yes "$h" "cd '$ROOT' && exec .venv/bin/pdtb $role $(printf '%q ' "${args[@]}")" \
      > "$log" 2>&1 < /dev/null &
  fi
  echo $! > "$pidf"
  STARTED+=("$role-$idx")
}

wait_ready() {  # wait_ready ROLE-INDEX: until its log has the NODE READY line (runs in this shell)
  local log="$RUN_DIR/$1.log" pid deadline=$(( SECONDS + TIMEOUT ))
  pid="$(cat "$RUN_DIR/$1.pid")"
  while ! grep -q '^NODE READY ' "$log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || fail "$1 exited during start-up" "$log"
    local other  # any node dying at start names itself (a torch group would otherwise time out on it)
    for other in ${STARTED[@]+"${STARTED[@]}"}; do
      kill -0 "$(cat "$RUN_DIR/$other.pid")" 2>/dev/null || grep -q '^NODE READY ' "$RUN_DIR/$other.log" \
        || fail "$other exited during start-up" "$RUN_DIR/$other.log"
    done
    [ $SECONDS -lt $deadline ] || fail "$1 not ready after ${TIMEOUT}s" "$log"
    sleep 0.2
  done
}

node_addr() {  # node_addr ROLE-INDEX KEY -> value from its NODE READY line
  grep -m1 '^NODE READY ' "$RUN_DIR/$1.log" | sed 's/^NODE READY //' \
    | python -c "import json,sys; print(json.load(sys.stdin)['$2'])"
}

NODE_ARGS=()
if [ "$MODE" = disagg ]; then
  for i in $(seq 0 $(( ND - 1 ))); do start_node decode "$i"; done
  for i in $(seq 0 $(( NP - 1 ))); do start_node prefill "$i"; done
  for i in $(seq 0 $(( ND - 1 ))); do wait_ready "decode-$i"; NODE_ARGS+=(--node "decode=$(node_addr "decode-$i" ctrl)"); done
  for i in $(seq 0 $(( NP - 1 ))); do wait_ready "prefill-$i"; NODE_ARGS+=(--node "prefill=$(node_addr "prefill-$i" ctrl)"); done
else
  for i in $(seq 0 $(( NC - 1 ))); do start_node colocated "$i"; done
  for i in $(seq 0 $(( NC - 1 ))); do wait_ready "colocated-$i"; NODE_ARGS+=(--node "colocated=$(node_addr "colocated-$i" ctrl)"); done
fi

nodes_alive() {  # every node started here still runs (one that dies while the router starts is named)
  local n
  for n in ${STARTED[@]+"${STARTED[@]}"}; do
    kill -0 "$(cat "$RUN_DIR/$n.pid")" 2>/dev/null || fail "$n exited while the router started" "$RUN_DIR/$n.log"
  done
}

read -r -a router_extra <<< "$ROUTER_ARGS"
rm -rf "$RUN_DIR/url" "$RUN_DIR/router-metrics" "$RUN_DIR"/router-*.admin
start_router() {  # start_router INDEX PORT: router-INDEX on PORT (with --routers N > 1, beside the others)
  local i="$1" fleet=()
  [ "$NR" -eq 1 ] || fleet=(--reuse-port --router-index "$i" --routers "$NR" --peer-dir "$RUN_DIR"
                            --metrics-dir "$RUN_DIR/router-metrics")
  local argv=("$PDTB_BIN" router --model "$MODEL" --host "$HOST" --port "$2" "${NODE_ARGS[@]}"
              ${router_extra[@]+"${router_extra[@]}"} ${CURVE_DIR:+--curve-dir "$CURVE_DIR"} ${fleet[@]+"${fleet[@]}"})
  : > "$RUN_DIR/router-$i.log"
  printf '%s\0' "${argv[@]}" > "$RUN_DIR/router-$i.argv"
  setsid "${argv[@]}" > "$RUN_DIR/router-$i.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/router-$i.pid"
}
router_alive() {  # router_alive INDEX WHAT: it still runs, and so does every node
  kill -0 "$(cat "$RUN_DIR/router-$1.pid")" 2>/dev/null || fail "router exited $2 (router-$1)" "$RUN_DIR/router-$1.log"
  nodes_alive
}
wait_listening() {  # wait_listening INDEX: until its log says it accepts connections
  while ! grep -q 'router listening on ' "$RUN_DIR/router-$1.log" 2>/dev/null; do
    router_alive "$1" "during start-up"
    [ $SECONDS -lt $deadline ] || fail "router-$1 not listening after ${TIMEOUT}s" "$RUN_DIR/router-$1.log"
    sleep 0.2
  done
}
deadline=$(( SECONDS + TIMEOUT ))
start_router 0 "$PORT"
wait_listening 0
URL="$(grep -m1 -o 'listening on http://[^ ]*' "$RUN_DIR/router-0.log" | sed 's/^listening on //')"
for i in $(seq 1 $(( NR - 1 ))); do start_router "$i" "${URL##*:}"; done  # (they join router-0's port)
for i in $(seq 1 $(( NR - 1 ))); do wait_listening "$i"; done
for i in $(seq 0 $(( NR - 1 ))); do  # each router's own /health: at its admin address when there are several
  own="$URL"
  [ "$NR" -eq 1 ] || own="$(cat "$RUN_DIR/router-$i.admin")"
  until python -c "import sys,urllib.request; sys.exit(0 if urllib.request.urlopen('$own/health', timeout=2).status == 200 else 1)" 2>/dev/null; do
    router_alive "$i" "before /health was 200"
    [ $SECONDS -lt $deadline ] || fail "router-$i: /health not 200 after ${TIMEOUT}s" "$RUN_DIR/router-$i.log"
    sleep 0.3
  done
done
echo "$URL" > "$RUN_DIR/url"
if [ -n "$RESTART" ]; then
  setsid pdtb supervise --run-dir "$RUN_DIR" > "$RUN_DIR/supervisor.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/supervisor.pid"
fi
echo "READY $URL"
