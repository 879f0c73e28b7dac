#!/usr/bin/env bash
# KV transports on one host, measured here: one-sided writes against ZeroMQ ipc, an in-process
# pool copy and an in-process checked copy (pdtb bench transport --backend shm, 64 and 256 MiB), a control
# message's round trip over ZeroMQ and over the local link (python -m pdtb.microbench.link), and the decode
# nodes' admission verdicts of the same seeded fairness workload over zmq, shm and torch (gloo),
# live and in lockstep (scripts/compare_transports.sh). Replaces the "KV transports on one host"
# section of docs/results.md (its own date and commit); exits 1 if the lockstep decisions differ.
#
#   scripts/transport_results.sh [--quick] [--out DIR] [--doc FILE] [--only "bench verdicts"]
#
# --quick: 5 reps of each size instead of 10, memfair's runs alone (fcfs's too without it), and
# the lockstep runs alone (no live runs); the fairness runs are the quick ones either way.
# --out DIR: the bench files and verdicts (default results/transports-DATE).
# --doc FILE: the document whose section is replaced (default docs/results.md).
# --only: the parts to run (default both): bench, the timed copies and round trips; verdicts, the
# fairness runs (lockstep verdicts do not depend on timing). The section is written once OUT holds
# both parts' files, from this call or an earlier one into the same OUT.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" DOC="$ROOT/docs/results.md" ONLY="bench verdicts"
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:1 --out=OUT --doc=DOC --only=ONLY" -- "$@"
for part in $ONLY; do
  case "$part" in
    bench|verdicts) ;;
    *) echo "transport_results: --only takes bench and verdicts, got '$part'" >&2; exit 2 ;;
  esac
done
REPS=10 TPOLICIES="fcfs memfair"
LIVE=()
[ "$QUICK" = 0 ] || REPS=5 TPOLICIES=memfair LIVE=(--no-live)
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/transports-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
git -C "$ROOT" rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true  # what the figures were measured on
rc=0  # (lockstep decisions that differ between transports: recorded, then the exit status)
if [[ " $ONLY " == *" bench "* ]]; then
  for size in 64 256; do
    echo "== pdtb bench transport --backend shm --size-mib $size --reps $REPS" >&2
    pdtb bench transport --backend shm --size-mib "$size" --reps "$REPS" --json > "$OUT/shm-$size.json"
  done
  echo "== python -m pdtb.microbench.link" >&2
  python -m pdtb.microbench.link --n 2000 --json > "$OUT/link.json"
fi
if [[ " $ONLY " == *" verdicts "* ]]; then
  bash "$ROOT/scripts/compare_transports.sh" --quick --policies "$TPOLICIES" ${LIVE[@]+"${LIVE[@]}"} --out "$OUT/verdicts" >&2 || rc=$?
fi
[ -f "$OUT/shm-256.json" ] && [ -d "$OUT/verdicts" ] || exit "$rc"  # (the other part still to come)
python -m pdtb.figures.results_doc --section transports --shm "$OUT"/shm-64.json "$OUT"/shm-256.json \
  --link "$OUT/link.json" --admissions "$OUT/verdicts" --commit-file "$OUT/commit" --out "$DOC"
exit "$rc"
