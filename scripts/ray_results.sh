#!/usr/bin/env bash
# Clusters placed by Ray, as run here: tests/clusters/test_ray_cluster.py on a local Ray cluster of four
# Ray nodes on this machine (placement by role, outputs equal generate through the router, a
# Ray node removed under load with --restart-failed, a stop that leaves nothing), and what that
# says about multi-host runs. Replaces the "Clusters placed by Ray" section of docs/results.md.
#
#   scripts/ray_results.sh [--doc FILE]
#
# --doc FILE: the document whose section is replaced (default docs/results.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DOC="$ROOT/docs/results.md"
source "$ROOT/scripts/_opts.sh"
opts_parse "--doc=DOC" -- "$@"
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
t0=$(date +%s)
rc=0
python -m pytest -q -p no:cacheprovider tests/clusters/test_ray_cluster.py --junitxml "$OUT/ray.xml" > "$OUT/ray.log" 2>&1 || rc=$?
tail -n 3 "$OUT/ray.log" >&2
python -m pdtb.figures.results_doc --section ray --ray-junit "$OUT/ray.xml" --ray-seconds "$(( $(date +%s) - t0 ))" \
  --commit-file <(git rev-parse --short HEAD) --out "$DOC"
exit $rc
