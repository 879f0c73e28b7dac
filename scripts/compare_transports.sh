#!/usr/bin/env bash
# The same seeded disaggregated fairness workload over several KV transports, and the decode
# nodes' admission verdicts side by side (accept, park, defer, refuse), two ways:
#
#   scripts/compare_transports.sh [--quick] [--out DIR] [--transports "zmq shm torch"]
#                                 [--policies "fcfs memfair"] [--policy-arg [LABEL:]KEY=VALUE]...
#                                 [--seed N] [--no-live] [--no-lockstep]
#
# - live (OUT/live/TRANSPORT/): scripts/compare_fairness.sh --modes disagg, real clusters in
#   real time, once per transport and once more over the first (named FIRST-again). A verdict
#   depends on what the decode pool holds at the moment a header arrives, so counts differ from
#   run to run, over one transport as over two: the -again column shows by how much.
# - lockstep (OUT/lockstep/TRANSPORT/): compare_fairness.sh --lockstep, the same workload and
#   decode node flags handed off into a real decode node over each transport in a fixed order
#   of events on a virtual clock (pdtb bench lockstep): every request's verdicts, the counts
#   and the generated tokens must equal the first transport's (exit status 1 otherwise).
#
# python -m pdtb.figures.admissions prints each table (OUT/live.txt, OUT/lockstep.txt).
#
# --policies and --policy-arg are compare_fairness.sh's: each policy a NAME, module:Class,
# path/to/file.py:Class or LABEL=REF, its settings by --policy-arg (all of them checked before
# the first run; results are named by each policy's label).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=() OUT="" TRANSPORTS="zmq shm torch" POLICIES="fcfs memfair" SEED=0 LIVE=1 LOCKSTEP=1 PITEMS=()
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:(--quick) --out=OUT --transports=TRANSPORTS --policies=POLICIES --policy-arg=PITEMS+ --seed=SEED
  --no-live=LIVE:0 --no-lockstep=LOCKSTEP:0" -- "$@"
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
source "$ROOT/scripts/_env.sh"
read -r -a TS <<< "$TRANSPORTS"
[ "${#TS[@]}" -gt 0 ] || { echo "compare_transports: --transports names none" >&2; exit 2; }
# the policies checked once, before the first run (compare_fairness.sh names what is wrong)
bash "$ROOT/scripts/compare_fairness.sh" --dry-run --policies "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} >/dev/null
OUT="${OUT:-$ROOT/results/transports-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
run() {  # run KIND NAME TRANSPORT [compare_fairness flags...]
  local kind="$1" name="$2" t="$3"
  shift 3
  echo "== $kind: transport $t" >&2
  bash "$ROOT/scripts/compare_fairness.sh" ${QUICK[@]+"${QUICK[@]}"} --modes disagg --policies "$POLICIES" \
    ${PARGS[@]+"${PARGS[@]}"} --seed "$SEED" --transport "$t" --out "$OUT/$kind/$name" "$@" >&2
}
rc=0
if [ "$LIVE" = 1 ]; then
  DIRS=()
  for t in "${TS[@]}"; do run live "$t" "$t"; DIRS+=("$OUT/live/$t"); done
  run live "${TS[0]}-again" "${TS[0]}"
  DIRS=("${DIRS[0]}" "$OUT/live/${TS[0]}-again" "${DIRS[@]:1}")
  echo "live runs (real time):"
  python -m pdtb.figures.admissions "${DIRS[@]}" | tee "$OUT/live.txt"
fi
if [ "$LOCKSTEP" = 1 ]; then
  DIRS=()
  for t in "${TS[@]}"; do run lockstep "$t" "$t" --lockstep; DIRS+=("$OUT/lockstep/$t"); done
  echo "lockstep (a fixed order of events):"
  python -m pdtb.figures.admissions --check "${DIRS[@]}" | tee "$OUT/lockstep.txt" || rc=$?
  [ "$rc" = 0 ] || echo "compare_transports: the lockstep decisions differ between transports" >&2
fi
exit "$rc"
