#!/usr/bin/env bash
# The router at GPU-cluster rates, measured here: CPU per request and per streamed token, variants
# (non-streamed, chat, long prompts, long outputs), saturation against a minimal aiohttp relay and
# the added latency at 25/50/75% of saturation (pdtb bench router, scripted colocated nodes); the
# cost phases again with disaggregated nodes and against a real colocated cluster of the tiny model.
# Replaces the router's section of docs/results.md (its own date and commit).
#
#   scripts/router_results.sh [--quick] [--baseline REF] [--out DIR] [--doc FILE]
#
# --quick: a quarter of the requests of each phase.
# --baseline REF: the real cluster's cost phases also on the router of git commit REF (a worktree in
#   OUT, run with this checkout's environment: REF must have the same pyproject.toml and lock),
#   two runs each, interleaved with this checkout's: the section gives their ratio.
# --out DIR: the bench files (default results/router-DATE).
# --doc FILE: the document whose section is replaced (default docs/results.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=() OUT="" DOC="$ROOT/docs/results.md" BASELINE=""
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:(--quick) --out=OUT --baseline=BASELINE --doc=DOC" -- "$@"
if [ -n "$BASELINE" ] && ! git -C "$ROOT" diff --quiet "$BASELINE" HEAD -- pyproject.toml requirements.lock; then
  echo "router_results: --baseline $BASELINE has another pyproject.toml or lock than this checkout" >&2; exit 2
fi
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
real() {  # SRC LABEL NAME: a colocated cluster of SRC's code, the cost phases against its router
  local src="$1" label="$2" name="$3" run="$OUT/cluster-$3"
  RUNS+=("$run")
  PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" PDTB_VENV="${PDTB_VENV:-$VIRTUAL_ENV}" \
    bash "$src/scripts/launch_cluster.sh" --mode colocated --colocated 1 \
    --policy fcfs --port 0 --run-dir "$run" >&2
  echo "== $label: pdtb bench router --target ... --only cost${VARIANTS}" >&2
  # shellcheck disable=SC2046
  pdtb bench router --target "$(cat "$run/url")" --target-pid $(cat "$run"/router-*.pid) --only "cost$VARIANTS" \
    --label "$label" ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/$name.json" >&2
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$run" >&2
  FILES+=("$OUT/$name.json")
}
RUNS=() FILES=()
trap 'for r in ${RUNS[@]+"${RUNS[@]}"}; do bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$r" >/dev/null 2>&1 || true; done' EXIT
CMDS+=("bash scripts/launch_cluster.sh --mode colocated --colocated 1 --policy fcfs --port 0 --run-dir RUN; pdtb bench router --target URL --target-pid PID --only cost,variants${QUICK[*]+ ${QUICK[*]}}")
if [ -z "$BASELINE" ]; then
  VARIANTS=",variants"; real "$ROOT" "" real
else
  git -C "$ROOT" worktree add --detach --force "$OUT/baseline-src" "$BASELINE" >&2
  trap 'for r in ${RUNS[@]+"${RUNS[@]}"}; do bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$r" >/dev/null 2>&1 || true; done; git -C "$ROOT" worktree remove --force "$OUT/baseline-src" >/dev/null 2>&1 || true' EXIT
  base="$(git -C "$ROOT" rev-parse --short "$BASELINE")" here="$(git -C "$ROOT" rev-parse --short HEAD)"
  CMDS+=("the same against commit $base's router and this one's, interleaved (--baseline $BASELINE)")
  VARIANTS=""
  for i in 1 2; do
    real "$OUT/baseline-src" "before: $base" "before-$i"
    real "$ROOT" "after: $here" "after-$i"
  done
  VARIANTS=",variants"; real "$ROOT" "" real
fi
python -m pdtb.figures.results_doc --section router --router-files "$OUT/colocated.json" "$OUT/disagg.json" \
  "$OUT/routers2.json" "$OUT/interval4.json" "${FILES[@]}" --router-commands "${CMDS[@]}" --commit-file "$OUT/commit" \
  --out "$DOC"
