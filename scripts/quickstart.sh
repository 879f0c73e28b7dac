#!/usr/bin/env bash
# Set up the environment (see _env.sh), then the project's main job on the embedded tiny model:
# the quick colocated-vs-disaggregated fairness comparison (fcfs vs memfair on the same seeded
# whale-minnow workload and KV page budget). Ends with the comparison table and the report path.
# Extra arguments go to compare_fairness.sh (e.g. --policies "fcfs memfair vtc", or a policy of
# your own by reference: --policies "fcfs mine=./my_policy.py:MyPolicy" --policy-arg mine:KEY=VALUE;
# paths are relative to the directory this runs in).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_env.sh"
OUT="$ROOT/results/quickstart-$(date +%Y%m%d-%H%M%S)"
echo "== quick fairness comparison; the summary (minnow class; ratios against fcfs in the same mode) and"
echo "   the report's path are printed at the end"
bash "$ROOT/scripts/compare_fairness.sh" --quick --out "$OUT" "$@"
