#!/usr/bin/env bash
# The router at GPU-cluster rates, measured here: CPU per request and per streamed token, variants
# (non-streamed, chat, long prompts, long outputs), saturation against a minimal aiohttp relay and
# the added latency at 25/50/75% of saturation (pdtb bench router, scripted colocated nodes); the
# cost phases again with disaggregated nodes and against a real colocated cluster of the tiny model.
# Replaces the router's section of docs/results.md (its own date and commit).
#
#   scripts/router_results.sh [--quick] [--out DIR] [--doc FILE]
#
# --quick: a quarter of the requests of each phase.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=() OUT="" DOC="$ROOT/docs/results.md"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=(--quick); shift ;;
    --out) OUT="$2"; shift 2 ;;
    --doc) DOC="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "router_results: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
OUT="${OUT:-$ROOT/results/router-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
git -C "$ROOT" rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true  # what the figures were measured on
CMDS=()
bench() {  # NAME ARGS...: one bench run into OUT/NAME.json, its command kept for the document
  local name="$1"; shift
  local shown="" arg
  for arg in "$@" ${QUICK[@]+"${QUICK[@]}"}; do  # (an argument with a space shown in quotes)
    case "$arg" in *" "*) shown+=" \"$arg\"" ;; *) shown+=" $arg" ;; esac
  done
  CMDS+=("pdtb bench router$shown")
  echo "== ${CMDS[-1]}" >&2
  pdtb bench router "$@" ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/$name.json" >&2
}
bench colocated --mode colocated
bench disagg --mode disagg --nodes 1 --only cost,saturation
bench routers2 --mode colocated --routers 2 --only saturation
bench interval4 --mode colocated --only cost --router-args "--stream-interval 4"
RUN="$OUT/cluster"
trap 'bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$RUN" >/dev/null 2>&1 || true' EXIT
bash scripts/launch_cluster.sh --mode colocated --colocated 1 --policy fcfs --port 0 --run-dir "$RUN" >&2
CMDS+=("bash scripts/launch_cluster.sh --mode colocated --colocated 1 --policy fcfs --port 0 --run-dir RUN; pdtb bench router --target URL --target-pid PID --only cost,variants${QUICK[*]+ ${QUICK[*]}}")
echo "== ${CMDS[-1]}" >&2
pdtb bench router --target "$(cat "$RUN/url")" --target-pid $(cat "$RUN"/router-*.pid) --only cost,variants \
  ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/real.json" >&2
bash scripts/stop_cluster.sh --run-dir "$RUN" >&2
python -m pdtb.figures.results_doc --section router --router-files "$OUT/colocated.json" "$OUT/disagg.json" \
  "$OUT/routers2.json" "$OUT/interval4.json" "$OUT/real.json" --router-commands "${CMDS[@]}" --commit-file "$OUT/commit" --out "$DOC"
