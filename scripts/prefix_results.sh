#!/usr/bin/env bash
# Prefix caching, measured on real clusters (CPU, embedded tiny model by default):
#
#   scripts/prefix_results.sh [--quick] [--out DIR] [--model DIR] [--only "trace route charge"]
#
#   trace   the Mooncake conversation excerpt (hash_ids, pdtb/bench/data), lengths scaled by
#           1/32 (16-token blocks, one KV page each), replayed on 1P+1D with --prefix-cache on
#           and off: achieved hit rate against the trace's ideal, TTFT p50 ratio, KV bytes sent
#   route   2 prefill nodes + 1 decode node, 24 tenants with a system prompt each, a few
#           requests per tenant: --route cache against --route load (hit rate)
#   charge  a colocated memfair node under KV pressure, every tenant's prompts starting with
#           one shared system prompt, whales and minnows: --charge-shared split, first, full
#           (pages charged per tenant, minnow TTFT p99, fair-share index)
#
# Writes DIR/NAME.json per run and DIR/prefix.md (pdtb.bench.prefix_report); prints the ratios.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" MODEL="" ONLY="trace route charge"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "prefix_results: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/prefix-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.common import resolve_model; print(resolve_model(None))')"
TRACE="$ROOT/pdtb/bench/data/mooncake_conversation_excerpt.jsonl"
N_TRACE=240 N_TENANTS=24
[ "$QUICK" = 1 ] && N_TRACE=80 N_TENANTS=12

run() {  # run NAME "LAUNCH ARGS" BENCH ARGS...
  local name="$1" launch=() url rc=0
  read -r -a launch <<< "$2"
  shift 2
  url="$(bash "$ROOT/scripts/launch_cluster.sh" --model "$MODEL" --port 0 --run-dir "$OUT/run-$name" "${launch[@]}" \
        | sed -n 's/^READY //p')"
  echo "== $name" >&2
  pdtb bench serve --url "$url" "$@" --out "$OUT/$name.json" --quiet || rc=$?
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$OUT/run-$name" --timeout 20 >&2
  return $rc
}

for what in $ONLY; do
  case "$what" in
    trace)
      # pools hold the working set (240 requests x about 24 pages): nothing cached is evicted
      for c in on off; do
        run "trace-$c" "--mode disagg --kv-pages 8192 --prefill-kv-pages 8192 -- --prefix-cache $c" \
          --workload "trace:$TRACE" --length-scale 0.03125 --time-scale 0.25 --max-requests "$N_TRACE" \
          --label-mode disagg --label-policy "prefix-cache-$c"
      done ;;
    route)
      for r in load cache; do
        run "route-$r" "--mode disagg --prefill 2 --decode 1 --kv-pages 4096 --router-args --route=$r" \
          --workload multi-tenant --num-tenants "$N_TENANTS" --rate 6 --duration "$(( N_TENANTS / 3 ))" \
          --prompt 320 --output 8 --system-prompt-tokens 256 --seed 1 --label-mode disagg --label-policy "route-$r"
      done ;;
    charge)
      for rule in split first full; do
        run "charge-$rule" "--mode colocated --policy memfair --kv-pages 448 --host-kv-pages 512 -- --charge-shared $rule --max-num-batched-tokens 512" \
          --workload whale-minnow --whales 4 --whale-prompt 768 --whale-output 512 --whale-start 1 --whale-interval 0.5 \
          --minnow-prompt 320 --minnow-output 8 --minnow-rate 3 --duration "$([ "$QUICK" = 1 ] && echo 12 || echo 20)" \
          --minnow-tenants m1,m2,m3 --system-prompt-tokens 256 --shared-system-prompts 1 --seed 2 \
          --slo ttft_ms=1000 --label-mode colocated --label-policy "charge-$rule"
      done ;;
    *) echo "prefix_results: unknown experiment $what" >&2; exit 2 ;;
  esac
done
python -m pdtb.bench.prefix_report "$OUT" --out "$OUT/prefix.md"
echo "report: $OUT/prefix.md"
