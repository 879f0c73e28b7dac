#!/usr/bin/env bash
# The fault campaigns behind docs/results.md's "Fault campaigns" section: pdtb chaos on 2P+2D
# over each KV transport, then the section rewritten from their reports.
#
#   scripts/chaos_results.sh [--out DIR] [--duration S] [--seed N] [--transports "zmq shm torch"] [--doc FILE]
#
# Every fault kind on every transport. On torch a node whose process ends stays down (it cannot
# rejoin the process group it joined at start-up, so the supervisor does not restart it:
# docs/faults.md): the campaign kills or drains one only while another of its role is healthy,
# and skips, saying why, the faults that would leave a role empty. Then the router killed under 32
# streams (pdtb chaos --router-drill 32). Reports: DIR/TRANSPORT.json, DIR/drill.json; exit 1
# if any had a violation.
#
# --out DIR: the reports and runs (default results/chaos-DATE); --duration S: each transport's
# campaign (default 1200); --seed N (default 1); --transports: which, in order (default all
# three); --doc FILE: the document whose section is rewritten (default docs/results.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" DURATION=1200 SEED=1 TRANSPORTS="zmq shm torch" DOC="$ROOT/docs/results.md"
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --duration=DURATION --seed=SEED --transports=TRANSPORTS --doc=DOC" -- "$@"
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/chaos-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
git -C "$ROOT" rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
rc=0
for t in $TRANSPORTS; do
  faults=all
  echo "== $t: $DURATION s, seed $SEED, faults $faults" >&2
  pdtb chaos --duration "$DURATION" --seed "$SEED" --faults "$faults" --run-dir "$OUT/run-$t" \
    --report "$OUT/$t.json" --launch "--mode disagg --prefill 2 --decode 2 --kv-pages 600 --transport $t \
      --router-args '--rebalance pressure --recompute-retries 4' -- --transfer-timeout 5" || rc=1
done
echo "== the router killed under 32 streams" >&2
pdtb chaos --router-drill 32 --seed "$SEED" --run-dir "$OUT/run-drill" --report "$OUT/drill.json" \
  --launch "--mode disagg --prefill 2 --decode 2 --kv-pages 600" || rc=1
python -m pdtb.figures.results_doc --section chaos --chaos "$OUT" --out "$DOC"
exit "$rc"
