#!/usr/bin/env bash
# The same seeded disaggregated fairness runs over several KV transports, and the decode
# nodes' admission verdicts side by side (accept, park, defer, refuse).
#
#   scripts/compare_transports.sh [--quick] [--out DIR] [--transports "zmq shm torch"]
#                                 [--policies "fcfs memfair"] [--seed N]
#
# Runs scripts/compare_fairness.sh --modes disagg once per transport (OUT/TRANSPORT/), then
# python -m pdtb.bench.admissions over them: per policy, the verdict counts of each transport
# and whether they equal the first transport's. The workload is seeded, but a verdict depends
# on what the decode pool holds when a header arrives, so a transport that moves bytes faster or
# slower can tip a request that arrives at the edge of a full pool the other way.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=() OUT="" TRANSPORTS="zmq shm torch" POLICIES="fcfs memfair" SEED=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=(--quick); shift ;;
    --out) OUT="$2"; shift 2 ;;
    --transports) TRANSPORTS="$2"; shift 2 ;;
    --policies) POLICIES="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "compare_transports: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/transports-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
DIRS=()
for t in $TRANSPORTS; do
  echo "== transport $t" >&2
  bash "$ROOT/scripts/compare_fairness.sh" ${QUICK[@]+"${QUICK[@]}"} --modes disagg --policies "$POLICIES" \
    --seed "$SEED" --transport "$t" --out "$OUT/$t" >&2
  DIRS+=("$OUT/$t")
done
python -m pdtb.bench.admissions "${DIRS[@]}" | tee "$OUT/admissions.txt"
