#!/usr/bin/env bash
# Live migration between decode nodes, measured on real clusters (CPU, embedded tiny model by default):
#
#   scripts/migration_results.sh [--quick] [--out DIR] [--model DIR] [--only "downtime rebalance"]
#
#   downtime   1 prefill + 2 decode nodes, 16 greedy streams of 512-token prompts; `pdtb bench
#              migration` moves 12 of them, one every 0.25 s: downtime p50/p99 against the run's
#              ITL, bytes and seconds of each phase; then the same with the decode nodes'
#              prefix cache off (no page hashes to stage by: one stop-and-copy transfer)
#   rebalance  1 prefill + 2 decode nodes (fcfs, 100 pages each) replaying pdtb.client.rebalance_trace:
#              three whales with short prompts and long outputs arrive while a batch request
#              holds the first decode node, so the router (which cannot see output lengths)
#              places all three on the second one, where they outgrow its pool; minnows of
#              another tenant stream throughout. The router's --rebalance off, pressure and fair,
#              on the same trace, once per seed of the minnow arrivals
#
# Writes DIR/NAME.json per run (and NAME.migrations.json: /cluster/migrations at its end) and
# DIR/migration.md (pdtb.figures.migration_report); prints the tables.
#
# --quick: seed 1 of the minnow arrivals alone instead of 1 2 3, and 20 s of trace instead of 25;
# --out DIR (default results/migration-DATE); --model DIR (default the embedded tiny model);
# --only: the experiments to run, in order (default both).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" MODEL="" ONLY="downtime rebalance"
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:1 --out=OUT --model=MODEL --only=ONLY" -- "$@"
source "$ROOT/scripts/_env.sh"
OUT="${OUT:-$ROOT/results/migration-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
git -C "$ROOT" rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true  # what the figures were measured on
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.engine.model_info import resolve_model_arg; print(resolve_model_arg(None))')"
SEEDS="1 2 3"
[ "$QUICK" = 1 ] && SEEDS="1"

launch() {  # launch NAME "LAUNCH ARGS": prints the router URL
  local launch=()
  read -r -a launch <<< "$2"
  bash "$ROOT/scripts/launch_cluster.sh" --model "$MODEL" --port 0 --run-dir "$OUT/run-$1" "${launch[@]}" \
    | sed -n 's/^READY //p'
}

stop() {  # stop NAME URL: keeps the router's migration records, then stops the cluster
  curl -s --max-time 10 "$2/cluster/migrations" > "$OUT/$1.migrations.json" || true
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$OUT/run-$1" --timeout 20 >&2
}

for what in $ONLY; do
  case "$what" in
    downtime)
      for kind in precopy stopcopy; do
        cache=on
        [ "$kind" = stopcopy ] && cache=off
        name="downtime-$kind"
        url="$(launch "$name" "--mode disagg --prefill 1 --decode 2 --kv-pages 4096 --decode-args --prefix-cache=$cache")"
        echo "== $name" >&2
        rc=0
        pdtb bench migration --url "$url" --streams 16 --prompt 512 --max-tokens 128 --moves 12 --every 0.25 \
          --label "$kind" --out "$OUT/$name.json" || rc=$?
        stop "$name" "$url"
        [ "$rc" = 0 ] || exit "$rc"
      done ;;
    rebalance)
      for seed in $SEEDS; do
        python -m pdtb.client.rebalance_trace "$OUT/rebalance-trace-s$seed.jsonl" --seed "$seed" \
          --duration "$([ "$QUICK" = 1 ] && echo 20 || echo 25)"
        for mode in off pressure fair; do
          name="rebalance-$mode-s$seed"
          url="$(launch "$name" "--mode disagg --prefill 1 --decode 2 --kv-pages 100 --prefill-kv-pages 2048 --router-args --rebalance=$mode")"
          echo "== $name" >&2
          rc=0
          pdtb bench serve --url "$url" --workload "trace:$OUT/rebalance-trace-s$seed.jsonl" \
            --label-mode disagg --label-policy "rebalance-$mode" --out "$OUT/$name.json" --quiet || rc=$?
          stop "$name" "$url"
          [ "$rc" = 0 ] || exit "$rc"
        done
      done ;;
    *) echo "migration_results: unknown experiment $what" >&2; exit 2 ;;
  esac
done
python -m pdtb.figures.migration_report "$OUT" --out "$OUT/migration.md"
echo "report: $OUT/migration.md"
