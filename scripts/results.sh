#!/usr/bin/env bash
# Run the experiments behind docs/results.md and write it anew (date, commit and machine in its
# stamp; nothing of an earlier run is kept):
#   - the fairness comparison, colocated and disaggregated, policy by policy
#     (compare_fairness.sh --quick, or the full run with --full);
#   - load sweeps and the fairness-throughput frontier (frontier.sh --quick, or the full run);
#   - the paged engine against transformers.generate (pdtb bench engine);
#   - the KV transport against raw pyzmq, ipc and tcp (pdtb bench transport);
#   - prefix caching on real clusters (scripts/prefix_results.sh --quick, or the full run);
#   - live migration between decode nodes: downtime, and rebalancing whales and minnows
#     (scripts/migration_results.sh --quick, or the full run);
#   - KV transports on one host: one-sided writes, admission verdicts per transport
#     (scripts/transport_results.sh, after the document is written: it replaces its section);
#   - clusters placed by Ray, and where they ran (scripts/ray_results.sh, the same way);
#   - the simulator (scripts/sim_results.sh): validated against the comparison's real runs,
#     the reproductions, one hour of the Azure trace on 8 GPUs, the H200 grid against the roofline
#     (the validation, the reproductions and the roofline on their own page, docs/sim-validation.md
#     beside the document; a summary of them in it).
# About 40 minutes on a 2-core machine (the frontier: 10). The run's files stay in OUT
# (results/docs-*); the frontier's plots are copied next to the document (docs/img).
#
# --policies and --policy-arg go to compare_fairness.sh: each policy a NAME, module:Class,
# path/to/file.py:Class or LABEL=REF, a setting of its own by --policy-arg [LABEL:]KEY=VALUE
# (repeatable); they are checked before the first run, and a policy file's path made absolute.
#
#   bash scripts/results.sh [--full] [--policies "fcfs memfair vtc mcsf priority"]
#                           [--policy-arg [LABEL:]KEY=VALUE]... [--out DIR]
#                           [--skip-bench] [--skip-frontier] [--skip-prefix] [--skip-migration] [--skip-sim]
#                           [--skip-transports] [--skip-ray]
#                           [--doc docs/results.md]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
unset POLICIES  # unset until --policies: sim_results.sh is handed the list only when one is given
QUICK=(--quick) PITEMS=() OUT="" BENCH=1 FRONTIER=1 SIM=1 PREFIX=1 MIGRATION=1 TRANSPORTS=1 RAY=1 DOC="$ROOT/docs/results.md"
source "$ROOT/scripts/_opts.sh"
opts_parse "--full=QUICK:() --policies=POLICIES --policy-arg=PITEMS+ --out=OUT --skip-bench=BENCH:0
  --skip-frontier=FRONTIER:0 --skip-sim=SIM:0 --skip-transports=TRANSPORTS:0 --skip-ray=RAY:0 --skip-prefix=PREFIX:0
  --skip-migration=MIGRATION:0 --doc=DOC" -- "$@"
SIM_POLICIES=()
[ -z "${POLICIES+set}" ] || SIM_POLICIES=(--policies)
POLICIES="${POLICIES-fcfs memfair vtc mcsf priority}"
source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"
policy_table results.sh "$POLICIES" ${PITEMS[@]+"${PITEMS[@]}"}  # before the cd: a file's path is relative to here
POLICIES="$(policy_list)"
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
cd "$ROOT"
OUT="${OUT:-$ROOT/results/docs-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
FAIR_CMD="bash scripts/compare_fairness.sh ${QUICK[*]+${QUICK[*]} }--step-log --policies \"$POLICIES\""
[ "${#PARGS[@]}" = 0 ] || FAIR_CMD+="$(printf ' %q' "${PARGS[@]}")"
echo "== $FAIR_CMD" >&2
bash scripts/compare_fairness.sh ${QUICK[@]+"${QUICK[@]}"} --step-log --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} \
  --out "$OUT/fair" >&2
args=(--fair "$OUT/fair" --fair-command "$FAIR_CMD")
run_part() {  # run_part NAME SCRIPT: scripts/SCRIPT, quick unless --full, into OUT/NAME; its results_doc flags into args
  local cmd="bash scripts/$2${QUICK[*]+ ${QUICK[*]}}"
  echo "== $cmd" >&2
  bash "scripts/$2" ${QUICK[@]+"${QUICK[@]}"} --out "$OUT/$1" >&2
  args+=("--$1" "$OUT/$1" "--$1-command" "$cmd")
}
if [ "$FRONTIER" = 1 ]; then
  run_part frontier frontier.sh
fi
if [ "$BENCH" = 1 ]; then
  echo "== pdtb bench engine --batch 32" >&2
  pdtb bench engine --batch 32 --json > "$OUT/engine.json"
  for ep in ipc tcp; do
    echo "== pdtb bench transport --endpoint $ep" >&2
    pdtb bench transport --endpoint "$ep" --json > "$OUT/transport-$ep.json"
  done
  args+=(--engine "$OUT/engine.json" --transport "$OUT/transport-ipc.json" "$OUT/transport-tcp.json")
fi
if [ "$PREFIX" = 1 ]; then
  run_part prefix prefix_results.sh
fi
if [ "$MIGRATION" = 1 ]; then
  run_part migration migration_results.sh
fi
if [ "$SIM" = 1 ]; then
  echo "== bash scripts/sim_results.sh" >&2
  real=()  # the quick comparison's real runs serve the validation (a full run has other flags)
  [ "${#QUICK[@]}" = 0 ] || real=(--real "$OUT/fair")
  # the validation simulates the settings the real runs had (and their policies, when given;
  # by default sim_results.sh's own: the five built-in ones of the comparison)
  [ "${#SIM_POLICIES[@]}" = 0 ] || SIM_POLICIES+=("$POLICIES")
  bash scripts/sim_results.sh --out "$OUT/sim" ${real[@]+"${real[@]}"} ${SIM_POLICIES[@]+"${SIM_POLICIES[@]}"} \
    ${PARGS[@]+"${PARGS[@]}"} >&2
  args+=(--sim "$OUT/sim")
fi
python -m pdtb.figures.results_doc "${args[@]}" --out "$DOC" --readme "$ROOT/README.md"
if [ "$TRANSPORTS" = 1 ]; then
  echo "== bash scripts/transport_results.sh" >&2
  bash scripts/transport_results.sh --out "$OUT/transports" --doc "$DOC" >&2
fi
if [ "$RAY" = 1 ]; then
  echo "== bash scripts/ray_results.sh" >&2
  bash scripts/ray_results.sh --doc "$DOC" >&2
fi
