#!/usr/bin/env bash
# The fairness-throughput frontier: a load sweep (pdtb bench sweep) of the same seeded
# whale-minnow workload for each point, a point being (mode, policy, settings), at the same KV
# page budget and the same thread budget; then `pdtb frontier` draws the points.
#
#   scripts/frontier.sh [--quick] [--out DIR] [--points FILE] [--rates LIST] [--until-knee]
#                       [--span S] [--warmup S] [--splits "PREFILL_PAGES ..."] [--seed N] [--model DIR]
#
# Budget, both modes: TOTAL device pages, HOST host pages per node, 2 torch threads in all.
#   colocated: two replicas, each 1 thread and TOTAL/2 pages (the router spreads requests);
#   disagg:    1 prefill node (1 thread, PREFILL pages) + 1 decode node (1 thread, the rest).
# Each point is one line of the points file: LABEL MODE POLICY [NODE FLAGS...], e.g.
#   memfair-request colocated memfair --quota-by request
#   memfair-s5 disagg memfair --policy-arg starve_after_s=5
#   mine disagg ./my_policy.py:MyPolicy --policy-arg horizon_s=2
# (lines starting with # are skipped). POLICY is a reference: a NAME, package.module:Class or
# path/to/file.py:Class (relative to the directory the script runs in); its settings go among
# the node flags as --policy-arg KEY=VALUE. Every point is checked (its mode, its policy with
# the node flags' settings) before the first runs; the results name a reference's policy by
# its class (meta.policy; meta.policy_info has the reference).
# Without --points, in both modes: fcfs, memfair, and memfair with quotas per request and static
# shares; the full run adds quotas per priority class and per SLO tier, vtc, mcsf, priority and
# memfair's knobs, and the page splits 128 and 224 (the prefill node must hold the longest
# prompt: 1984 tokens are 124 pages).
# --quick: loads 1.5,3,6 with 2 s warm-up and 8 s measured (about 7 minutes on 2 cores);
# otherwise 1.5,3,6,9 with 5 s and 20 s. Minnow latencies on the frontier are read at the
# second load. --splits also sweeps the disaggregated cluster's prefill:decode page split under
# memfair and fcfs (one point per PREFILL value, same TOTAL).
# Writes DIR/LABEL-MODE.json per point, DIR/frontier/frontier.md with frontier.png, and the
# sweep plots (pdtb report) in DIR/report.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" POINTS="" RATES="" KNEE=0 SPAN="" WARM="" SPLITS=default SEED=0 MODEL=""
source "$ROOT/scripts/_opts.sh"
opts_parse "--quick=QUICK:1 --out=OUT --points=POINTS --rates=RATES --until-knee=KNEE:1 --span=SPAN --warmup=WARM
  --splits=SPLITS --seed=SEED --model=MODEL" -- "$@"
source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"

PAGE=16 TOTAL=448 PREFILL=160 HOST=512 BUDGET=512
# One 10 s period of the workload: a long-output whale (1024+512 tokens) at 1 s, two long-context
# whales (1984+64, nearly all prompt) at 3 s and 7 s, Poisson minnows (24+8) at 4/s. A rate level
# m sends m periods' arrivals in each 10 s. Whales are batch work (30 s TTFT, 500 ms TPOT),
# priority class 1, SLO tier "batch", two tenants; minnows are interactive (500 ms TTFT, 100 ms
# TPOT), class 0, tier "interactive", four tenants. So a quota per tenant has six owners, one per
# class or per tier two, one per request as many as run. The node SLOs are the minnows'.
WL=(--workload whale-minnow --duration 10 --whales 1 --whale-prompt 1024 --whale-output 512 --whale-start 1
    --context-whales 2 --context-whale-prompt 1984 --context-whale-output 64 --context-whale-start 3
    --context-whale-interval 4 --minnow-rate 4 --minnow-prompt 24 --minnow-output 8 --seed "$SEED"
    --whale-tenants w0,w1 --minnow-tenants m0,m1,m2,m3 --whale-priority 1 --minnow-priority 0
    --slo ttft_ms=500 --slo tpot_ms=100 --slo whale:ttft_ms=30000 --slo whale:tpot_ms=500)
NODE_SLO=(--slo-ttft '*=0.5' --slo-tpot '*=0.1')
TIERS="--tenant-tier w0=batch --tenant-tier w1=batch --tenant-tier m0=interactive --tenant-tier m1=interactive
       --tenant-tier m2=interactive --tenant-tier m3=interactive"
if [ "$QUICK" = 1 ]; then
  RATES="${RATES:-1.5,3,6}" SPAN="${SPAN:-8}" WARM="${WARM:-2}"
  [ "$SPLITS" != default ] || SPLITS=""
else
  RATES="${RATES:-1.5,3,6,9}" SPAN="${SPAN:-20}" WARM="${WARM:-5}"
  [ "$SPLITS" != default ] || SPLITS="128 224"
fi
AT_LOAD="${RATES#*,}" AT_LOAD="${AT_LOAD%%,*}"  # the minnows' latency is read at the second level

# Quotas per tenant and per request, static shares, in both modes (quick); the full run adds the
# quotas per priority and per SLO tier and the other policies.
POINTS_TEXT=""
for mode in colocated disagg; do
  POINTS_TEXT+="fcfs $mode fcfs
memfair $mode memfair
memfair-request $mode memfair --quota-by request
memfair-static $mode memfair --policy-arg quota_shares=static
"
  [ "$QUICK" = 1 ] || POINTS_TEXT+="memfair-priority $mode memfair --quota-by priority
memfair-tier $mode memfair --quota-by slo-tier
vtc $mode vtc
memtime $mode memtime
dlpm $mode dlpm
drr $mode drr
mcsf $mode mcsf
priority $mode priority
"
done
[ -z "$POINTS" ] || POINTS_TEXT="$(cat "$POINTS")"

run_point() {  # run_point LABEL MODE POLICY PREFILL_PAGES [NODE FLAGS...]
  local label="$1" mode="$2" pol="$3" prefill="$4"
  shift 4
  local rd="$OUT/run-$label-$mode" extra=() url rc=0
  if [ "$mode" = colocated ]; then
    extra=(--colocated 2 --kv-pages $(( TOTAL / 2 )) -- --torch-threads 1)
  else
    extra=(--kv-pages $(( TOTAL - prefill )) --prefill-kv-pages "$prefill" -- --torch-threads 1)
  fi
  extra+=(--max-num-batched-tokens "$BUDGET" "${NODE_SLO[@]}" "$@")
  echo "== $label ($mode, $pol $*): pages $TOTAL${prefill:+ (prefill $prefill in disagg)}" >&2
  local named
  named="$(policy_label "$pol")"
  url="$(bash "$ROOT/scripts/launch_cluster.sh" --mode "$mode" --model "$MODEL" --policy "$pol" --port 0 \
        --host-kv-pages "$HOST" --page-size "$PAGE" --run-dir "$rd" --router-args "$(echo $TIERS)" \
        "${extra[@]}" | sed -n 's/^READY //p')"
  local knee=()
  [ "$KNEE" = 0 ] || knee=(--until-knee --max-levels 9)
  pdtb bench sweep --url "$url" "${WL[@]}" --rates "$RATES" --span-s "$SPAN" --warmup-s "$WARM" \
    ${knee[@]+"${knee[@]}"} --label-mode "$mode" --label-policy "$named" --label-config "$label" \
    --sample-interval 1 --quiet --out "$OUT/$label-$mode.json" || rc=$?
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$rd" --timeout 20 >&2
  return $rc
}

P_LABEL=() P_MODE=() P_POL=() P_FLAGS=()
while read -r label mode pol rest; do  # every point checked before the first runs
  case "$label" in ''|'#'*) continue ;; esac
  case "$mode" in colocated|disagg) ;; *) echo "frontier: point $label: mode must be colocated or disagg, got '$mode'" >&2; exit 2 ;; esac
  read -r -a flags <<< "${rest:-}"
  pol="$(policy_check "frontier: point $label" "${pol:-}" ${flags[@]+"${flags[@]}"})" || exit 2
  P_LABEL+=("$label") P_MODE+=("$mode") P_POL+=("$pol") P_FLAGS+=("${rest:-}")
done <<< "$POINTS_TEXT"
OUT="${OUT:-$ROOT/results/frontier-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.engine.model_info import resolve_model_arg; print(resolve_model_arg(None))')"
for i in "${!P_LABEL[@]}"; do
  read -r -a flags <<< "${P_FLAGS[$i]}"
  run_point "${P_LABEL[$i]}" "${P_MODE[$i]}" "${P_POL[$i]}" "$PREFILL" ${flags[@]+"${flags[@]}"}
done
for prefill in $SPLITS; do
  for pol in fcfs memfair; do
    run_point "$pol-split$prefill" disagg "$pol" "$prefill"
  done
done
pdtb frontier "$OUT"/*.json --at-load "$AT_LOAD" --out "$OUT/frontier" | tee "$OUT/frontier.txt"
pdtb report "$OUT"/*.json --out "$OUT/report" >/dev/null
echo "frontier: $OUT/frontier/frontier.md"
