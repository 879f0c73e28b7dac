#!/usr/bin/env bash
# Prefix caching, measured on real clusters (CPU, embedded tiny model by default):
#
#   scripts/prefix_results.sh [--quick] [--out DIR] [--model DIR] [--only "trace route charge"]
#
#   trace   the Mooncake synthetic excerpt (hash_ids, pdtb/client/data; multi-turn sharing),
#           lengths scaled by 1/32 (16-token blocks, one KV page each) and clamped to 512 tokens,
#           replayed on 1P+1D with --prefix-cache on and off: achieved hit rate against the
#           trace's ideal, TTFT p50 ratio, KV bytes sent; then the Mooncake conversation excerpt
#           (production sharing, lower), cache on (and off without --quick), at twice the speed
#   route   2 prefill nodes + 1 decode node, 24 tenants with a system prompt each, a few
#           requests per tenant: --route cache against --route load (hit rate)
#   charge  a colocated memfair node under KV pressure, every tenant's prompts opening with one
#           1024-token system prompt, whales and minnows: --charge-shared split, first, full
#           (pages held, shared and charged per tenant, minnow TTFT p99, fair-share index)
#
# Writes DIR/NAME.json per run and DIR/prefix.md (pdtb.figures.prefix_report); prints the ratios.
#
# --quick: route with 16 tenants instead of 24, the conversation excerpt with the cache on only,
# charge for 15 s instead of 30; --out DIR (default results/prefix-DATE); --model DIR (default
# the embedded tiny model); --only: the experiments to run, in order (default all three).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" MODEL="" ONLY="trace route charge"
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:1 --out=OUT --model=MODEL --only=ONLY" -- "$@"
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/prefix-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.engine.model_info import resolve_model_arg; print(resolve_model_arg(None))')"
DATA="$ROOT/pdtb/client/data"
N_TENANTS=24 CONV_MODES="on off"
[ "$QUICK" = 1 ] && N_TENANTS=16 CONV_MODES="on"

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
      # the pools hold the working set (at most 400 requests x 32 pages): nothing cached is evicted
      for c in on off; do
        run "trace-$c" "--mode disagg --kv-pages 8192 --prefill-kv-pages 8192 -- --prefix-cache $c" \
          --workload "trace:$DATA/mooncake_synthetic_excerpt.jsonl" --length-scale 0.03125 --max-context 512 \
          --warmup 8 --label-mode disagg --label-policy "prefix-cache-$c"
      done
      for c in $CONV_MODES; do
        run "conversation-$c" "--mode disagg --kv-pages 16384 --prefill-kv-pages 16384 -- --prefix-cache $c" \
          --workload "trace:$DATA/mooncake_conversation_excerpt.jsonl" --length-scale 0.03125 --max-context 512 \
          --time-scale 0.5 --warmup 8 --label-mode disagg --label-policy "prefix-cache-$c"
      done ;;
    route)
      for r in load cache; do
        run "route-$r" "--mode disagg --prefill 2 --decode 1 --kv-pages 4096 --router-args --route=$r" \
          --workload multi-tenant --num-tenants "$N_TENANTS" --rate 6 --duration "$(( N_TENANTS / 2 ))" \
          --prompt 320 --output 8 --system-prompt-tokens 256 --seed 1 --label-mode disagg --label-policy "route-$r"
      done ;;
    charge)
      # whales and minnows of four tenants open with one 1024-token system prompt (64 pages);
      # a minnow holds it plus 3 pages of its own, a whale 128 more: the pool cannot hold all
      for rule in split first full; do
        run "charge-$rule" "--mode colocated --policy memfair --kv-pages 448 --host-kv-pages 512 -- --charge-shared $rule --max-num-batched-tokens 512" \
          --workload whale-minnow --whales 4 --whale-prompt 2048 --whale-output 512 --whale-start 1 --whale-interval 0.5 \
          --minnow-prompt 1056 --minnow-output 32 --minnow-rate 4 --duration "$([ "$QUICK" = 1 ] && echo 15 || echo 30)" \
          --minnow-tenants m1,m2,m3 --system-prompt-tokens 1024 --shared-system-prompts 1 --seed 2 \
          --slo ttft_ms=1000 --label-mode colocated --label-policy "charge-$rule"
      done ;;
    *) echo "prefix_results: unknown experiment $what" >&2; exit 2 ;;
  esac
done
python -m pdtb.figures.prefix_report "$OUT" --out "$OUT/prefix.md"
echo "report: $OUT/prefix.md"
