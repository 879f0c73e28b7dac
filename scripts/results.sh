#!/usr/bin/env bash
# Run every experiment behind docs/results.md and docs/findings.md at this checkout's commit, and
# write both anew, with the README's headline block (date, commit and machine in the stamp;
# nothing of an earlier run is kept, every section is measured here and now):
#   - the fairness comparison, colocated and disaggregated, every built-in policy
#     (compare_fairness.sh --quick, or the full run with --full);
#   - load sweeps and the fairness-throughput frontier (frontier.sh --quick, or the full run);
#   - the paged engine against transformers.generate (pdtb bench engine);
#   - the KV transport against raw pyzmq, ipc and tcp (pdtb bench transport);
#   - prefix caching on real clusters (scripts/prefix_results.sh --quick, or the full run);
#   - live migration between decode nodes (scripts/migration_results.sh --quick, or the full run);
#   - the simulator (scripts/sim_results.sh, --quick unless --full): validated against the
#     comparison's real runs, the reproductions, one hour of the Azure trace, how fast it runs (the
#     validation on its own page, docs/sim-validation.md, a summary of it in the document);
#   - the scorecard (scripts/scorecard.sh --quick, its real quick scenario the comparison's runs,
#     --repeats more of fcfs and memfair for the run-to-run spread: 1, or 3 with --full);
#   - the experiments of the findings (scripts/findings.sh), then docs/findings.md and its plots;
#   - fault campaigns (scripts/chaos_results.sh: 30 s over zmq and torch, 1200 s over every transport with --full);
#   - the router's CPU per request and per token (scripts/router_results.sh --quick, or the full run);
#   - KV transports on one host (scripts/transport_results.sh, --quick unless --full) and clusters placed by Ray
#     (scripts/ray_results.sh);
#   - with --vllm, the project beside vLLM's CPU build (scripts/vs_vllm.sh: its quick and
#     overload workloads, one round, or every workload in two rounds with --full; --vllm-venv DIR
#     names vLLM's environment, default .venv-vllm, built when absent).
# The GPU figures are not measured here: scripts/gpu_check.sh writes them, at their own commit, to
# docs/gpu-results.md. About 45 minutes on a 2-core machine with --quick (the default), 3 hours
# with --full. The run's files stay in OUT (results/docs-*); the plots go next to the document
# (docs/img).
#
# The simulations run in the background (OUT/lane-*.log), at the idle scheduling class, but
# only while no measured part runs: every part whose figures are times (the comparison, the
# frontier, the benches, prefix caching, migration, the router, the transports, the scorecard's
# and the findings' real runs, vLLM) runs with them stopped (SIGSTOP). Beside the real clusters,
# even at the idle class, a node's median step was 4.3 or 5.9 ms with two of them and 10.4 ms
# with three in measured runs (docs/method.md), and not the same for every policy of a table. They
# run on during the parts whose figures are outcomes (the fault campaigns, the Ray tests and, quick,
# the transports' lockstep verdicts, which do not depend on timing), and the run waits for them at
# its end. Their own figures are in simulated time, and the simulator's speed in its processes' CPU
# seconds.
#
# --reuse DIR takes the parts that a run of the same code already made in DIR (its --out, e.g. a
# run cut short) instead of running them again: the comparison, the frontier, the engine and
# transport benches, prefix caching, migration; the rest runs anew.
#
# --policies and --policy-arg go to compare_fairness.sh: each policy a NAME, module:Class,
# path/to/file.py:Class or LABEL=REF, a setting of its own by --policy-arg [LABEL:]KEY=VALUE
# (repeatable); they are checked before the first run, and a policy file's path made absolute.
#
#   bash scripts/results.sh [--full] [--policies "fcfs memfair vtc ..."] [--policy-arg [LABEL:]KEY=VALUE]...
#                           [--out DIR] [--repeats N] [--vllm] [--vllm-venv DIR] [--reuse DIR]
#                           [--skip-bench] [--skip-frontier] [--skip-prefix] [--skip-migration] [--skip-sim]
#                           [--skip-scorecard] [--skip-findings] [--skip-chaos] [--skip-router]
#                           [--skip-transports] [--skip-ray] [--doc docs/results.md]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
unset POLICIES  # unset until --policies: sim_results.sh is handed the list only when one is given
QUICK=(--quick) PITEMS=() OUT="" BENCH=1 FRONTIER=1 SIM=1 PREFIX=1 MIGRATION=1 TRANSPORTS=1 RAY=1 DOC="$ROOT/docs/results.md"
SCORECARD=1 FINDINGS=1 CHAOS=1 ROUTER=1 VLLM=0 VVENV="" REPEATS="" REUSE=""
source "$ROOT/scripts/_opts.sh"
opts_parse "--full=QUICK:() --policies=POLICIES --policy-arg=PITEMS+ --out=OUT --skip-bench=BENCH:0
  --skip-frontier=FRONTIER:0 --skip-sim=SIM:0 --skip-transports=TRANSPORTS:0 --skip-ray=RAY:0 --skip-prefix=PREFIX:0
  --skip-migration=MIGRATION:0 --doc=DOC --skip-scorecard=SCORECARD:0 --skip-findings=FINDINGS:0 --skip-chaos=CHAOS:0
  --skip-router=ROUTER:0 --vllm=VLLM:1 --vllm-venv=VVENV --repeats=REPEATS --reuse=REUSE" -- "$@"
[ -z "$REUSE" ] || REUSE="$(cd "$REUSE" && pwd)" || { echo "results: no folder $REUSE" >&2; exit 2; }
[ -n "$REPEATS" ] || { [ "${#QUICK[@]}" = 0 ] && REPEATS=3 || REPEATS=1; }
[[ "$REPEATS" =~ ^[0-9]+$ ]] || { echo "results: --repeats wants a whole number, got '$REPEATS'" >&2; exit 2; }
[ -z "$VVENV" ] || { d="$(cd "$(dirname "$VVENV")" && pwd)" && VVENV="$d/$(basename "$VVENV")"; }
mkdir -p "$(dirname "$DOC")"
DOC="$(cd "$(dirname "$DOC")" && pwd)/$(basename "$DOC")"
SIM_POLICIES=()
[ -z "${POLICIES+set}" ] || SIM_POLICIES=(--policies)
POLICIES="${POLICIES-fcfs memfair vtc memtime dlpm drr mcsf priority}"
source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"
policy_table results.sh "$POLICIES" ${PITEMS[@]+"${PITEMS[@]}"}  # before the cd: a file's path is relative to here
POLICIES="$(policy_list)"
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
cd "$ROOT"
OUT="${OUT:-$ROOT/results/docs-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
mark() {  # mark PART: in OUT/timings.tsv, the seconds since the start (set-up included) at which PART ends
  printf '%s\t%d\n' "$1" "$SECONDS" >> "$OUT/timings.tsv"
  echo "== $1 done at $(( SECONDS / 60 )) min $(( SECONDS % 60 )) s" >&2
}
mark setup
# a part that reports a failure (a chaos violation, a failed Ray test, lockstep verdicts that differ)
# still leaves its section written and the run goes on; the exit says so
rc=0
IDLE=(nice -n 19)
chrt --idle 0 true 2>/dev/null && IDLE=(chrt --idle 0)
LANES=() LANE_NAMES=()
lane() {  # lane NAME CMD...: CMD in the background, at the idle class, in a process group of its own
  local name="$1"
  shift
  echo "== in the background ($name, log OUT/lane-$name.log): $*" >&2
  setsid "${IDLE[@]}" "$@" > "$OUT/lane-$name.log" 2>&1 &
  local pid=$! i
  # until it leads its own group: a signal to the group sent before that would find no group
  for i in $(seq 100); do
    [ "$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" != "$pid" ] || break
    kill -0 "$pid" 2>/dev/null || break  # (ended already)
    sleep 0.05
  done
  LANES+=("$pid") LANE_NAMES+=("$name")
}
lanes_signal() {  # lanes_signal SIG: to every lane's process group
  local p
  for p in ${LANES[@]+"${LANES[@]}"}; do kill "-$1" -- "-$p" 2>/dev/null || true; done
}
timed() {  # timed CMD...: CMD alone on the machine, the lanes stopped meanwhile
  lanes_signal STOP
  local r=0
  "$@" || r=$?
  lanes_signal CONT
  return "$r"
}
beside() {  # beside CMD...: CMD with the lanes running, its figures outcomes, at one torch thread: the
  # chaos checker's generate reference for 30 prompts took 5.4 s alone at one thread or two; beside two
  # idle-class busy loops 5.9 s at one and 15.7 s at two (and the engine bench, two threads, kept 0.11x
  # of its rate beside the simulations in a quick run)
  OMP_NUM_THREADS=1 "$@"
}
lanes_running() {  # whether any lane has work left
  local p
  for p in ${LANES[@]+"${LANES[@]}"}; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}
LANES_DONE=" "
lane_wait() {  # lane_wait NAME: until that lane ends (at once if it was waited for); a failed lane ends the run
  local i
  for i in "${!LANE_NAMES[@]}"; do
    [ "${LANE_NAMES[$i]}" = "$1" ] && [[ "$LANES_DONE" != *" $1 "* ]] || continue
    wait "${LANES[$i]}" || { echo "results: the background part $1 failed (its log: $OUT/lane-$1.log)" >&2; exit 1; }
    LANES_DONE+="$1 "
  done
}
trap 'lanes_signal TERM; lanes_signal CONT' EXIT  # (a run cut short leaves no simulation behind)
# the simulated parts start now, beside everything real
if [ "$SCORECARD" = 1 ]; then
  lane scorecard bash scripts/scorecard.sh --skip-real --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} --out "$OUT/scorecard"
fi
SIM_ARGS=(${QUICK[@]+"${QUICK[@]}"} --out "$OUT/sim")
# the validation simulates the settings the real runs had (and their policies, when given;
# by default sim_results.sh's own: the five built-in ones of the comparison)
[ "${#SIM_POLICIES[@]}" = 0 ] || SIM_ARGS+=("${SIM_POLICIES[@]}" "$POLICIES")
SIM_ARGS+=(${PARGS[@]+"${PARGS[@]}"})
# the findings' simulations, then the simulator's reproductions, Azure hour and speed run, one
# after the other in one lane
if [ "$FINDINGS" = 1 ] || [ "$SIM" = 1 ]; then
  lane sims bash -c '[ "$1" = 0 ] || bash scripts/findings.sh --skip-real --out "$3/findings" || exit 1
    [ "$2" = 0 ] || bash scripts/sim_results.sh "${@:4}" --skip-validate' _ "$FINDINGS" "$SIM" "$OUT" "${SIM_ARGS[@]}"
fi
reuse() {  # reuse NAME...: with --reuse DIR holding every NAME, each copied into OUT (and true)
  [ -n "$REUSE" ] || return 1
  local n
  for n in "$@"; do [ -e "$REUSE/$n" ] || return 1; done
  for n in "$@"; do cp -r "$REUSE/$n" "$OUT/"; done
  echo "== reused from $REUSE: $*" >&2
}
FAIR_CMD="bash scripts/compare_fairness.sh ${QUICK[*]+${QUICK[*]} }--step-log --policies \"$POLICIES\""
[ "${#PARGS[@]}" = 0 ] || FAIR_CMD+="$(printf ' %q' "${PARGS[@]}")"
echo "== $FAIR_CMD" >&2
reuse fair || timed bash scripts/compare_fairness.sh ${QUICK[@]+"${QUICK[@]}"} --step-log --policies "$POLICIES" \
  ${PARGS[@]+"${PARGS[@]}"} --out "$OUT/fair" >&2
mark comparison
args=(--fair "$OUT/fair" --fair-command "$FAIR_CMD")
run_part() {  # run_part NAME SCRIPT: scripts/SCRIPT, quick unless --full, into OUT/NAME; its results_doc flags into args
  local cmd="bash scripts/$2${QUICK[*]+ ${QUICK[*]}}"
  echo "== $cmd" >&2
  reuse "$1" || timed bash "scripts/$2" ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/$1" >&2
  args+=("--$1" "$OUT/$1" "--$1-command" "$cmd")
  mark "$1"
}
if [ "$FRONTIER" = 1 ]; then
  run_part frontier frontier.sh
fi
if [ "$BENCH" = 1 ]; then
  if ! reuse engine.json transport-ipc.json transport-tcp.json; then
    echo "== pdtb bench engine --batch 32" >&2
    timed pdtb bench engine --batch 32 --json > "$OUT/engine.json"
    for ep in ipc tcp; do
      echo "== pdtb bench transport --endpoint $ep" >&2
      timed pdtb bench transport --endpoint "$ep" --json > "$OUT/transport-$ep.json"
    done
  fi
  args+=(--engine "$OUT/engine.json" --transport "$OUT/transport-ipc.json" "$OUT/transport-tcp.json")
  if lanes_running; then  # what the background costs a foreground process: the engine bench again, beside it
    echo "== pdtb bench engine --batch 32, the background simulations running" >&2
    pdtb bench engine --batch 32 --json > "$OUT/engine-beside.json"
    args+=(--engine-beside "$OUT/engine-beside.json")
  fi
  mark benches
fi
if [ "$PREFIX" = 1 ]; then
  run_part prefix prefix_results.sh
fi
if [ "$MIGRATION" = 1 ]; then
  run_part migration migration_results.sh
fi
python -m pdtb.figures.results_doc "${args[@]}" --commit-file "$OUT/commit" --out "$DOC" --readme "$ROOT/README.md"
section() {  # section NAME ARGS...: replace one section of the document, stamped with this run's commit
  python -m pdtb.figures.results_doc --section "$@" --commit-file "$OUT/commit" --out "$DOC" --readme "$ROOT/README.md" >&2
}
if [ "$SIM" = 1 ]; then
  echo "== bash scripts/sim_results.sh${QUICK[*]+ ${QUICK[*]}}: the validation" >&2
  if [ "${#QUICK[@]}" != 0 ]; then
    # the quick comparison's real runs serve the validation, and prefix caching's runs its prefix
    # part; the step grid is measured now, alone, and the rest simulated in the background
    echo "== pdtb bench steps --grid" >&2
    timed pdtb bench steps --grid --json > "$OUT/steps.json"
    vargs=(--real "$OUT/fair" --steps "$OUT/steps.json")
    [ ! -f "$OUT/prefix/conversation-on.json" ] || vargs+=(--prefix-real "$OUT/prefix")
    mark "step grid"
    lane validate bash scripts/sim_results.sh "${SIM_ARGS[@]}" --validate-only "${vargs[@]}"
  else  # (a full run's validation runs real clusters of its own: in the foreground)
    bash scripts/sim_results.sh "${SIM_ARGS[@]}" --validate-only >&2
  fi
fi
if [ "${#QUICK[@]}" != 0 ] && [ "$SCORECARD" = 1 ]; then
  SC_REAL=(--quick --skip-sim --real-quick "$OUT/fair")
  sc_cmd="bash scripts/scorecard.sh --quick --repeats $REPEATS --policies \"$POLICIES\" (the real quick scenario: the comparison's runs)"
else  # (a full comparison is not the quick scenario: the scorecard runs its own, and its frontier)
  SC_REAL=(--skip-sim)
  sc_cmd="bash scripts/scorecard.sh --repeats $REPEATS --policies \"$POLICIES\""
fi
if [ "$CHAOS" = 1 ]; then
  # quick: 30 s over zmq and torch (shm's control path is zmq's, and its KV path is checked by
  # the transports' lockstep runs); full: 1200 s over each transport
  secs=30 cts="zmq torch"
  [ "${#QUICK[@]}" != 0 ] || secs=1200 cts="zmq shm torch"
  echo "== bash scripts/chaos_results.sh --duration $secs --transports \"$cts\"" >&2
  beside bash scripts/chaos_results.sh --duration "$secs" --transports "$cts" --out "$OUT/chaos" --doc "$DOC" >&2 || rc=1
  mark chaos
fi
if [ "$ROUTER" = 1 ]; then
  echo "== bash scripts/router_results.sh${QUICK[*]+ ${QUICK[*]}}" >&2
  timed bash scripts/router_results.sh ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/router" --doc "$DOC" >&2
  mark router
fi
if [ "$VLLM" = 1 ]; then
  vargs=(--workloads "quick overload" --rounds 1 --reps 1)
  [ "${#QUICK[@]}" != 0 ] || vargs=()
  echo "== bash scripts/vs_vllm.sh ${vargs[*]}" >&2
  timed bash scripts/vs_vllm.sh ${vargs[@]+"${vargs[@]}"} ${VVENV:+--venv "$VVENV"} --out "$OUT/vllm" --doc "$DOC" >&2
  mark vllm
fi
if [ "$TRANSPORTS" = 1 ]; then
  echo "== bash scripts/transport_results.sh${QUICK[*]+ ${QUICK[*]}}" >&2
  if [ "${#QUICK[@]}" != 0 ]; then  # the lockstep verdicts (no live runs in quick) beside the simulations
    timed bash scripts/transport_results.sh --quick --only bench --out "$OUT/transports" --doc "$DOC" >&2 || rc=1
    beside bash scripts/transport_results.sh --quick --only verdicts --out "$OUT/transports" --doc "$DOC" >&2 || rc=1
  else
    timed bash scripts/transport_results.sh --out "$OUT/transports" --doc "$DOC" >&2 || rc=1
  fi
  mark transports
fi
if [ "$RAY" = 1 ]; then
  echo "== bash scripts/ray_results.sh" >&2
  beside bash scripts/ray_results.sh --doc "$DOC" >&2 || rc=1
  mark ray
fi
if [ "$FINDINGS" = 1 ]; then
  echo "== bash scripts/findings.sh --skip-sim" >&2
  timed bash scripts/findings.sh --skip-sim --out "$OUT/findings" >&2
  mark "findings (real)"
fi
if [ "$SCORECARD" = 1 ]; then
  lane_wait scorecard
  mark "scorecard (simulated)"
  echo "== $sc_cmd" >&2
  timed bash scripts/scorecard.sh "${SC_REAL[@]}" --repeats "$REPEATS" --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} \
    --out "$OUT/scorecard" >&2
  mark "scorecard (real)"
  section scorecard --scorecard "$OUT/scorecard" --scorecard-command "$sc_cmd"
fi
if [ "$SIM" = 1 ]; then
  lane_wait sims
  lane_wait validate
  mark simulator
  section sim --sim "$OUT/sim"
fi
if [ "$FINDINGS" = 1 ]; then
  lane_wait sims
  python -m pdtb.figures.findings --runs "$OUT" --out "$(dirname "$DOC")/findings.md" --results "$DOC" \
    --stamp "on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(cat "$OUT/commit")"
fi
section summary
mark all
exit "$rc"
