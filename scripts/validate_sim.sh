#!/usr/bin/env bash
# The simulator against the testbed on this machine: the quick fairness comparison (fcfs and
# memfair, colocated and disaggregated) on real clusters, the simulator calibrated here, the
# same runs simulated, and the sim/real ratios per class (pdtb sim validate).
#
#   scripts/validate_sim.sh [--out DIR] [--real DIR] [--calibration FILE] [--policies LIST]
#
# 1. real: scripts/compare_fairness.sh --quick (skipped with --real DIR: results already there);
# 2. calibration: pdtb bench steps --grid on this machine, fitted by pdtb sim calibrate
#    (skipped with --calibration FILE);
# 3. sim: scripts/compare_fairness.sh --quick --sim with that calibration: the same workload
#    and node flags;
# 4. pdtb sim validate REAL SIM: DIR/validate.txt and DIR/validate.json.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" REAL="" CAL="" POLICIES="fcfs memfair"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --real) REAL="$2"; shift 2 ;;
    --calibration) CAL="$2"; shift 2 ;;
    --policies) POLICIES="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "validate_sim: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/validate-sim-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
if [ -z "$REAL" ]; then
  REAL="$OUT/real"
  bash "$ROOT/scripts/compare_fairness.sh" --quick --policies "$POLICIES" --out "$REAL" >&2
fi
if [ -z "$CAL" ]; then
  echo "== calibrating the step cost on this machine (pdtb bench steps --grid)" >&2
  pdtb bench steps --grid --json > "$OUT/steps.json"
  CAL="$OUT/calibration.json"
  pdtb sim calibrate --steps "$OUT/steps.json" --out "$CAL" >&2
fi
bash "$ROOT/scripts/compare_fairness.sh" --quick --sim --calibration "$CAL" --policies "$POLICIES" --out "$OUT/sim" >&2
pdtb sim validate "$REAL" "$OUT/sim" --out "$OUT/validate.json" | tee "$OUT/validate.txt"
