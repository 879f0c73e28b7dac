#!/usr/bin/env bash
# The simulator against the testbed on this machine: the quick fairness comparison (every
# policy, colocated and disaggregated) on real clusters, the simulator calibrated here, the
# same runs simulated, and the sim/real ratios per class (pdtb sim validate).
#
#   scripts/validate_sim.sh [--out DIR] [--real DIR] [--policies LIST] [--policy-arg [LABEL:]KEY=VALUE]...
#                           [--sets "quick load1.5 load3 load6 tenants"] [--skip-prefix]
#                           [--repeat | --repeat-sets LIST] [--without]
#                           [--steps FILE] [--prefix-real DIR]
#
# --steps FILE: a `pdtb bench steps --grid --json` output measured on this machine already (else
# measured here, step 2); --prefix-real DIR: step 5's real runs, a prefix_results.sh --quick
# folder (else REAL/prefix, else made here).
#
# --policies and --policy-arg are compare_fairness.sh's (default every built-in policy, as
# fairness/registry.py lists them): each policy a
# NAME, module:Class, path/to/file.py:Class or LABEL=REF, its settings by --policy-arg; checked
# before anything runs. Real and simulated runs are paired by mode and label. With --real DIR,
# give the policies and settings its runs had.
#
# --sets (default quick) names the workloads, each a compare_fairness.sh --quick run of every
# policy in both modes: quick (whale-minnow, minnows at 4/s), loadR (the same, minnows at R/s:
# load1.5 load3 load6 are the frontier's quick sweep loads) and tenants (--workload tenants, the
# multi-tenant workload). The calibrations are fitted to the fcfs runs of the first set alone:
# every other run, of every set, is held out. Real runs of set S are in BASE (the first set) or
# BASE-S, BASE being --real DIR or DIR/real, made where absent; simulated ones in DIR/sim-KIND
# and DIR/sim-S-KIND, their comparison in DIR/validate-KIND.* and DIR/validate-S-KIND.*; the
# summary over every set (pdtb sim validate-sets) in DIR/validate-sets.{txt,json}.
#
# 1. real: scripts/compare_fairness.sh --quick --step-log (skipped with --real DIR: results,
#    and step logs where it has them, already there); with --repeat, the same command again into
#    REAL-rep for each set's REAL (made where absent), compared with the first as a simulated run
#    would be (DIR/validate-[SET-]repeat.*): the figures on which the testbed repeats itself, the
#    ceiling of any simulator judged against one real run; --repeat-sets LIST repeats those sets
#    alone; each calibration of a repeated set is also compared with the two real runs'
#    geometric mean (DIR/validate-[SET-]KIND-mean.*, pdtb sim validate --also-real);
# 2. calibration on this machine (pdtb/sim/calibration/), two ways, each with the request path's
#    latencies (router dispatch and its cost per prompt token, the client's leg, the hand-off's
#    fixed cost) fitted to the fcfs runs' requests, each mode's apart, and the node's own time per
#    step (idle gaps between back-to-back steps) from the fcfs runs' step logs:
#    grid: pdtb bench steps --grid (one quiet process) fitted by pdtb sim calibrate;
#    logs: the same grid scaled to the logged steps' level (--scale-grid: this host's speed drifts
#          by 10-25% over hours, and the grid is measured now, the runs maybe earlier), and every
#          step the fcfs runs logged, in one fit: steps as they ran beside the router, the client
#          and the other node on the same cores. The calibration the simulator keeps;
#    with --without also logs-path (logs without the request path: the simulator's default
#    latencies) and logs-overhead (logs with no node overhead per step): what each kept quantity
#    adds (docs/sim.md, "What the calibration holds"); the other policies' runs are used by
#    none: they are held out;
# 3. sim: scripts/compare_fairness.sh --quick --sim with each calibration: the same workload and
#    node flags;
# 4. pdtb sim validate REAL SIM for each: DIR/validate-KIND.{txt,json}, and the
#    other sets' the same way; then pdtb sim validate-sets over every set;
# 5. prefix sharing: the Mooncake excerpts replayed on 1P+1D (scripts/prefix_results.sh --quick
#    --only trace; with --real DIR, its prefix/ folder where it has one) and simulated with the
#    same flags for each calibration, against the targets (pdtb sim validate-prefix):
#    DIR/validate-prefix-KIND.{txt,json}.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
unset POLICIES  # unset until --policies: the default is every built-in, listed once the env is up
OUT="" REAL="" PITEMS=() PREFIX=1 SETS=quick REPEAT_OPT=() STEPS="" PREAL_ARG="" WITHOUT=0
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --real=REAL --policies=POLICIES --policy-arg=PITEMS+ --sets=SETS --skip-prefix=PREFIX:0
  --repeat=REPEAT_OPT:(--repeat) --repeat-sets=REPEAT_OPT(--repeat-sets) --steps=STEPS --prefix-real=PREAL_ARG
  --without=WITHOUT:1" -- "$@"
[ -z "$STEPS" ] || [ -f "$STEPS" ] || { echo "validate_sim: no --steps file $STEPS" >&2; exit 2; }
[ -z "$PREAL_ARG" ] || [ -f "$PREAL_ARG/conversation-on.json" ] \
  || { echo "validate_sim: --prefix-real $PREAL_ARG holds no conversation-on.json (prefix_results.sh --quick)" >&2; exit 2; }
REPEAT=0 REPEAT_SETS=""  # REPEAT_SETS empty: every set (--repeat); else --repeat-sets LIST, the later one given wins
if [ "${#REPEAT_OPT[@]}" -gt 0 ]; then
  REPEAT=1 REPEAT_SETS="${REPEAT_OPT[1]-}"
  REPEAT_SETS="${REPEAT_SETS//,/ }"
  [ "${REPEAT_OPT[0]}" = --repeat ] || [ -n "${REPEAT_SETS// /}" ] || { echo "validate_sim: --repeat-sets is empty" >&2; exit 2; }
fi
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
source "$ROOT/scripts/_env.sh"
POLICIES="${POLICIES-$(python -c "from fairness.registry import built_ins; print(' '.join(built_ins()))")}"
# the policies checked before the calibration and the runs (compare_fairness.sh names what is wrong);
# each label's reference kept for the speed-matched runs, one policy at a time
DRY="$(bash "$ROOT/scripts/compare_fairness.sh" --dry-run --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"})"
declare -A REF_OF
while read -r label ref _; do REF_OF[$label]="$ref"; done <<< "$DRY"
OUT="${OUT:-$ROOT/results/validate-sim-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
set_args() {  # set_args SET: its compare_fairness.sh flags, in SET_ARGS
  case "$1" in
    quick) SET_ARGS=() ;;
    tenants) SET_ARGS=(--workload tenants) ;;
    load*) SET_ARGS=(--minnow-rate "${1#load}") ;;
    *) echo "validate_sim: unknown set $1 (quick, loadR, tenants)" >&2; exit 2 ;;
  esac
}
read -r -a SET_LIST <<< "$SETS"
[ "${#SET_LIST[@]}" -gt 0 ] || { echo "validate_sim: --sets is empty" >&2; exit 2; }
BASE="${REAL:-$OUT/real}"
BASE="${BASE%/}"
FIRST="${SET_LIST[0]}"
real_of() { [ "$1" = "$FIRST" ] && echo "$BASE" || echo "$BASE-$1"; }
read -r -a REP_LIST <<< "$([ "$REPEAT" = 1 ] && echo "${REPEAT_SETS:-$SETS}")"
for s in ${REP_LIST[@]+"${REP_LIST[@]}"}; do
  [[ " ${SET_LIST[*]} " == *" $s "* ]] || { echo "validate_sim: --repeat-sets names $s, not one of --sets" >&2; exit 2; }
done
repeated() { [[ " ${REP_LIST[*]-} " == *" $1 "* ]]; }  # repeated SET: whether its real runs are made twice
runs_of() { RUNS=("$(real_of "$1")"); if repeated "$1"; then RUNS+=("${RUNS[0]}-rep"); fi; }  # SET's real folders, in RUNS
for s in "${SET_LIST[@]}"; do  # every set checked before the first run: its name, its flags, its folder
  set_args "$s"
  bash "$ROOT/scripts/compare_fairness.sh" --dry-run --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} \
    ${SET_ARGS[@]+"${SET_ARGS[@]}"} >/dev/null
  runs_of "$s"
  for f in "${RUNS[@]}"; do
    if [ -e "$f" ] && [ ! -f "$f/compare.txt" ]; then  # (a node's step log appends: a second run would mix in)
      echo "validate_sim: $f holds no finished comparison (no compare.txt): remove it or give another --real" >&2
      exit 2
    fi
  done
done
for s in "${SET_LIST[@]}"; do
  set_args "$s"
  runs_of "$s"
  for f in "${RUNS[@]}"; do
    [ -f "$f/compare.txt" ] && continue  # made already (compare_fairness.sh writes it last)
    bash "$ROOT/scripts/compare_fairness.sh" --quick --step-log --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} \
      ${SET_ARGS[@]+"${SET_ARGS[@]}"} --out "$f" >&2
  done
done
REAL="$BASE"
if [ -n "$STEPS" ]; then
  cp "$STEPS" "$OUT/steps.json"
else
  echo "== calibrating the step cost on this machine (pdtb bench steps --grid)" >&2
  pdtb bench steps --grid --json > "$OUT/steps.json"
fi
logs=() path=()
for f in "$REAL"/run-*-fcfs/steps-*.jsonl; do [ -f "$f" ] && logs+=(--step-log "$f"); done
for f in "$REAL"/*-fcfs.json; do [ -f "$f" ] && path+=(--results "$f"); done  # the request path, fcfs's runs only
pdtb sim calibrate --steps "$OUT/steps.json" ${logs[@]+"${logs[@]}"} ${path[@]+"${path[@]}"} --fit steps --label grid \
  --out "$OUT/calibration-grid.json" >&2
kinds=(grid)
if [ "${#logs[@]}" -gt 0 ]; then
  pdtb sim calibrate --steps "$OUT/steps.json" "${logs[@]}" ${path[@]+"${path[@]}"} --fit all --scale-grid --label logs \
    --out "$OUT/calibration-logs.json" >&2
  kinds+=(logs logs-speed)
  if [ "$WITHOUT" = 1 ]; then
    pdtb sim calibrate --steps "$OUT/steps.json" "${logs[@]}" --fit all --scale-grid --label logs-path \
      --out "$OUT/calibration-logs-path.json" >&2
    pdtb sim calibrate --steps "$OUT/steps.json" "${logs[@]}" ${path[@]+"${path[@]}"} --fit all --scale-grid \
      --node-overhead-ms 0 --label logs-overhead --out "$OUT/calibration-logs-overhead.json" >&2
    kinds+=(logs-path logs-overhead)
  fi
fi
for s in "${SET_LIST[@]}"; do
  set_args "$s"
  tag="$([ "$s" = "$FIRST" ] || echo "$s-")"
  for k in "${kinds[@]}"; do
    if [ "$k" = logs-speed ]; then  # each run at the host's speed its own step logs measured
      rm -rf "$OUT/sim-$tag$k" && mkdir -p "$OUT/sim-$tag$k"
      pdtb sim step-check "$(real_of "$s")" --calibration "$OUT/calibration-logs.json" --sim-args |
        while read -r mode label flags; do
          own=()  # the settings of this label's policy: those for every policy and its own
          for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do
            { [[ "${kv%%=*}" != *:* ]] || [ "${kv%%:*}" = "$label" ]; } && own+=(--policy-arg "$kv")
          done
          bash "$ROOT/scripts/compare_fairness.sh" --quick --sim --calibration "$OUT/calibration-logs.json" \
            --sim-args "$flags" --modes "$mode" --policies "$label=${REF_OF[$label]}" ${own[@]+"${own[@]}"} \
            ${SET_ARGS[@]+"${SET_ARGS[@]}"} --out "$OUT/sim-$tag$k/$mode-$label" >&2
          cp "$OUT/sim-$tag$k/$mode-$label/$mode-$label.json" "$OUT/sim-$tag$k/"
        done
    else
      bash "$ROOT/scripts/compare_fairness.sh" --quick --sim --calibration "$OUT/calibration-$k.json" \
        --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} ${SET_ARGS[@]+"${SET_ARGS[@]}"} \
        --out "$OUT/sim-$tag$k" >&2
    fi
    echo "== set: $s, calibration: $k"
    pdtb sim validate "$(real_of "$s")" "$OUT/sim-$tag$k" --out "$OUT/validate-$tag$k.json" | tee "$OUT/validate-$tag$k.txt"
    if repeated "$s"; then
      echo "== set: $s, calibration: $k, against the geometric mean of the two real runs"
      pdtb sim validate "$(real_of "$s")" "$OUT/sim-$tag$k" --also-real "$(real_of "$s")-rep" \
        --out "$OUT/validate-$tag$k-mean.json" | tee "$OUT/validate-$tag$k-mean.txt"
    fi
  done
done
if [ "$REPEAT" = 1 ]; then
  for s in "${REP_LIST[@]}"; do
    tag="$([ "$s" = "$FIRST" ] || echo "$s-")"
    echo "== set: $s, the testbed against itself (a second real run as the simulated one)"
    pdtb sim validate "$(real_of "$s")" "$(real_of "$s")-rep" --out "$OUT/validate-${tag}repeat.json" \
      | tee "$OUT/validate-${tag}repeat.txt"
  done
fi
set_kinds=("${kinds[@]}")
if [ "$REPEAT" = 1 ]; then
  for k in "${kinds[@]}"; do set_kinds+=("$k-mean"); done
  set_kinds+=(repeat)
fi
pdtb sim validate-sets "$OUT" --sets "$SETS" --kinds "${set_kinds[*]}" --fitted fcfs --out "$OUT/validate-sets.json" \
  | tee "$OUT/validate-sets.txt"
[ "$PREFIX" = 1 ] || exit 0
PREAL="${PREAL_ARG:-$REAL/prefix}"
if [ ! -f "$PREAL/conversation-on.json" ]; then
  PREAL="$OUT/prefix-real"
  bash "$ROOT/scripts/prefix_results.sh" --quick --only trace --out "$PREAL" >&2
fi
DATA="$ROOT/pdtb/client/data"
for k in "${kinds[@]}"; do
  [ "$k" = grid ] || [ "$k" = logs ] || continue  # (the calibrations without a quantity: the sets alone)
  mkdir -p "$OUT/prefix-sim-$k"
  pairs=()
  for run in trace-on:mooncake_synthetic_excerpt.jsonl:8192:1 conversation-on:mooncake_conversation_excerpt.jsonl:16384:0.5; do
    IFS=: read -r name file pages scale <<< "$run"
    [ -f "$PREAL/$name.json" ] || continue
    pdtb sim --workload "trace:$DATA/$file" --length-scale 0.03125 --max-context 512 --time-scale "$scale" \
      --mode disagg --kv-pages "$pages" --prefill-kv-pages "$pages" --cost calibrated \
      --calibration "$OUT/calibration-$k.json" --label-mode disagg \
      --label-policy "prefix-cache-on" --quiet --out "$OUT/prefix-sim-$k/$name.json" >/dev/null
    pairs+=("$PREAL/$name.json" "$OUT/prefix-sim-$k/$name.json")
  done
  echo "== prefix sharing, calibration: $k"
  pdtb sim validate-prefix "${pairs[@]}" --out "$OUT/validate-prefix-$k.json" | tee "$OUT/validate-prefix-$k.txt"
done
