#!/usr/bin/env bash
# Soak: launch a 1 prefill + 1 decode cluster (embedded model unless --model), send N short
# requests closed-loop (prompts 16-64 tokens, outputs 4-16), then check: zero failed requests,
# every node's pages free, each process's RSS at the end within --rss-tolerance of its level
# after the first --warmup requests. Prints the figures; exits non-zero when a check fails.
# The cluster is stopped in all cases.
#
#   scripts/soak.sh [--requests N] [--concurrency C] [--run-dir DIR] [--warmup W]
#                   [--rss-tolerance F] [--model DIR] [--kv-pages P] [-- extra node flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

N=10000 C=8 RUN_DIR="" WARMUP=1000 TOL=0.10 MODEL="" KV_PAGES=1024 QUIET=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) N="$2"; shift 2 ;;
    --concurrency) C="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --rss-tolerance) TOL="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --kv-pages) KV_PAGES="$2"; shift 2 ;;
    --quiet) QUIET=--quiet; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "soak: unknown option $1" >&2; exit 2 ;;
  esac
done

source "$ROOT/scripts/_env.sh"
RUN_DIR="${RUN_DIR:-$ROOT/runs/soak-$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"

stop() { bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$RUN_DIR" --timeout 20 >&2 || true; }
trap stop EXIT
trap 'exit 130' INT TERM

MODEL_ARGS=()
[ -n "$MODEL" ] && MODEL_ARGS=(--model "$MODEL")
bash "$ROOT/scripts/launch_cluster.sh" --mode disagg --prefill 1 --decode 1 --port 0 --run-dir "$RUN_DIR" \
  --kv-pages "$KV_PAGES" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} -- ${EXTRA[@]+"${EXTRA[@]}"} >&2
URL="$(cat "$RUN_DIR/url")"
echo "soak: cluster at $URL (run dir $RUN_DIR)"
rc=0
python -m pdtb.client.soak --url "$URL" --run-dir "$RUN_DIR" --requests "$N" --concurrency "$C" \
  --warmup "$WARMUP" --rss-tolerance "$TOL" $QUIET || rc=$?
exit "$rc"
