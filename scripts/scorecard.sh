#!/usr/bin/env bash
# Every policy, at its defaults, through five scenarios; one table per scenario, each figure
# beside fcfs's in the same run and the Pareto points marked (pdtb scorecard, see
# pdtb/figures/scorecard.py for the figures):
#   real-quick-MODE        1. the real CPU cluster, quick whale-minnow (compare_fairness.sh --quick), both modes
#   real-MODE-frontier     2. the real CPU cluster at saturation (frontier.sh --quick sweeps; not with --quick)
#   sim-essay-MODE         3. Llama-3-8B on one H100 per node, 128K whales among 2K minnows (the essay's setting)
#   sim-70b-tenants        4. Llama-3-70B at TP 4 on 8 H100s (1P+1D), five tenants of their own rates,
#                             bursts and length distributions (pdtb/client/data/scorecard_tenants_70b.json)
#   sim-mooncake           5. the Mooncake conversation excerpt on Llama-3-8B (1P+1D H100), four tenants
#                             made from groups of its hash_id prefixes (a conversation is one tenant's)
#   sim-4-decode           shares across decode nodes: 2 prefill and 4 decode nodes (1,000 pages each, 4,000 host),
#                             four tenants of different request sizes, each wanting more than its share
#                             (pdtb/client/data/scorecard_tenants_4decode.json); read its Jain column. With
#                             dlpm in the list it has a d2lpm row too: dlpm with the router's --route d2lpm
# and the essay's claims where their conditions hold: pdtb sim reproduce essay with about two
# whales among forty minnows in memory, so the largest 5% are whales (sim-essay-top5.json).
#
#   bash scripts/scorecard.sh [--quick] [--out DIR] [--policies LIST] [--policy-arg [LABEL:]KEY=VALUE]...
#                             [--skip-real | --skip-sim] [--repeats N] [--real-quick DIR]
#
# --policies: as compare_fairness.sh takes them (NAME, module:Class, file.py:Class, LABEL=REF;
# default: every built-in policy). --quick leaves out the frontier (scenario 2): about 15 minutes
# on 2 cores. --skip-real leaves out scenarios 1 and 2 (the simulator's only: about 3 minutes);
# --skip-sim the simulated ones (a second call into the same DIR adds the real ones to them).
# --repeats N runs the real quick comparison of fcfs and memfair N more times (DIR/repeats/rK,
# about 2 minutes each): the run-to-run noise a real figure is read against.
# --real-quick DIR takes scenario 1 from a compare_fairness.sh --quick run already made (its --out,
# e.g. results.sh's fair/) instead of running it: the policies it holds, and its fcfs and memfair
# runs as the first repeat (DIR/repeats/r0).
# Writes DIR/SCENARIO/LABEL.json, DIR/scorecard.md and DIR/scorecard.json; then
#   python -m pdtb.figures.results_doc --section scorecard --scorecard DIR --out docs/results.md
# puts the tables in docs/results.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" QUICK=0 REAL=1 SIMS=1 REPEATS=0 REAL_QUICK="" POLICIES="fcfs memfair vtc memtime dlpm drr mcsf priority" PITEMS=()
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --quick=QUICK:1 --skip-real=REAL:0 --skip-sim=SIMS:0 --repeats=REPEATS --policies=POLICIES --policy-arg=PITEMS+
  --real-quick=REAL_QUICK" -- "$@"
[ -z "$REAL_QUICK" ] || REAL_QUICK="$(cd "$REAL_QUICK" && pwd)" || { echo "scorecard: no folder $REAL_QUICK" >&2; exit 2; }
[[ "$REPEATS" =~ ^[0-9]+$ ]] || { echo "scorecard: --repeats wants a whole number, got '$REPEATS'" >&2; exit 2; }
source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"
policy_table scorecard "$POLICIES" ${PITEMS[@]+"${PITEMS[@]}"}
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
OUT="${OUT:-$ROOT/results/scorecard-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
DATA="$ROOT/pdtb/client/data"
SLO=(--slo ttft_ms=2000 --slo tpot_ms=100)
H100_8B=(--cost roofline --gpu h100-sxm --model-config llama-3-8b --max-model-len 135000)
FOUR_DECODE=(--workload multi-tenant --tenants-file "$DATA/scorecard_tenants_4decode.json" --mode disagg --prefill 2
             --decode 4 --decode-kv-pages 1000 --host-kv-pages 4000 "${H100_8B[@]}")

sim_one() {  # sim_one SCENARIO INDEX ARGS...: one policy through one simulated scenario
  local sc="$1" i="$2"
  shift 2
  policy_flags "$i"
  mkdir -p "$OUT/$sc"
  pdtb sim "$@" "${POLICY_FLAGS[@]}" --label-policy "${POLICY_LABELS[$i]}" "${SLO[@]}" \
    --out "$OUT/$sc/${POLICY_LABELS[$i]}.json" > /dev/null
}

if [ "$SIMS" = 1 ]; then
python -m pdtb.client.scorecard_data prefix-tenants "$DATA/mooncake_conversation_excerpt.jsonl" \
  "$OUT/mooncake-tenants.jsonl" --tenants 4
for i in "${!POLICY_LABELS[@]}"; do
  echo "== simulator: ${POLICY_LABELS[$i]}" >&2
  for mode in colocated disagg; do
    sim_one "sim-essay-$mode" "$i" --workload whale-minnow --mode "$mode" --prefill 1 --decode 1 "${H100_8B[@]}" \
      --whales 3 --whale-prompt 131072 --whale-output 256 --whale-start 5 --whale-interval 10 \
      --minnow-rate 14 --minnow-prompt 2048 --minnow-output 512 --duration 30
  done
  sim_one sim-70b-tenants "$i" --workload multi-tenant --tenants-file "$DATA/scorecard_tenants_70b.json" \
    --mode disagg --prefill 1 --decode 1 --tp 4 --cost roofline --gpu h100-sxm --model-config llama-3-70b \
    --max-model-len 131072
  sim_one sim-4-decode "$i" "${FOUR_DECODE[@]}"
  sim_one sim-mooncake "$i" --workload "trace:$OUT/mooncake-tenants.jsonl" --time-scale 2 \
    --mode disagg --prefill 1 --decode 1 "${H100_8B[@]}"
done
if [[ " $POLICIES " == *" dlpm "* ]]; then  # D2LPM: dlpm on every node, the router's credit per (client, node)
  echo "== simulator: d2lpm" >&2           # (only sim-4-decode has more than one prefill node to choose from)
  pdtb sim "${FOUR_DECODE[@]}" --policy dlpm --route d2lpm --label-policy d2lpm "${SLO[@]}" \
    --out "$OUT/sim-4-decode/d2lpm.json" > /dev/null
fi
echo "== pdtb sim reproduce essay, 5% whales in memory" >&2
pdtb sim reproduce essay --minnow-rate 4 --whale-interval 5 --whales 5 --json > "$OUT/sim-essay-top5.json"
fi

if [ "$REAL" = 1 ]; then
  RAW="$OUT/raw/quick"
  if [ -n "$REAL_QUICK" ]; then
    RAW="$REAL_QUICK"
    mkdir -p "$OUT/repeats/r0"
    cp "$RAW"/*-fcfs.json "$RAW"/*-memfair.json "$OUT/repeats/r0/"
  else
    bash scripts/compare_fairness.sh --quick --policies "$(policy_list)" ${PARGS[@]+"${PARGS[@]}"} \
      --out "$RAW" >&2
  fi
  for mode in colocated disagg; do
    mkdir -p "$OUT/real-quick-$mode"
    for pol in "${POLICY_LABELS[@]}"; do
      [ ! -f "$RAW/$mode-$pol.json" ] || cp "$RAW/$mode-$pol.json" "$OUT/real-quick-$mode/$pol.json"
    done
  done
  for k in $(seq 1 "$REPEATS"); do
    bash scripts/compare_fairness.sh --quick --policies "fcfs memfair" --out "$OUT/repeats/r$k" >&2
  done
  if [ "$QUICK" = 0 ]; then
    : > "$OUT/points.txt"
    for mode in colocated disagg; do
      for i in "${!POLICY_LABELS[@]}"; do
        policy_flags "$i"
        echo "${POLICY_LABELS[$i]} $mode ${POLICY_FLAGS[*]:1}" >> "$OUT/points.txt"
      done
    done
    bash scripts/frontier.sh --quick --points "$OUT/points.txt" --out "$OUT/raw/frontier" >&2
    for mode in colocated disagg; do
      mkdir -p "$OUT/real-$mode-frontier"
      for pol in "${POLICY_LABELS[@]}"; do
        cp "$OUT/raw/frontier/$pol-$mode.json" "$OUT/real-$mode-frontier/$pol.json"
      done
    done
  fi
fi
pdtb scorecard "$OUT"
echo "scorecard: $OUT/scorecard.md" >&2
