#!/usr/bin/env bash
# The experiments only docs/findings.md needs (results.sh runs this, then draws the page):
#   - OUT/quota-MODE: the essay's setting at H100 scale (Llama-3-8B, one GPU per node, 128K whales
#     among 2K minnows, as the scorecard's sim-essay scenario) with two whale tenants and four
#     minnow tenants, whales of priority 1 and tier batch, minnows 0 and interactive: fcfs, and
#     memfair with its quota per tenant, request, priority and SLO tier, and with static shares;
#     in disagg also memfair on the prefill node with fcfs on the decode node (memfair-fcfs-decode);
#   - OUT/decode-tight: fcfs, memfair and memfair-fcfs-decode in disagg with a decode pool of
#     12,800 pages (200K tokens: one whale and the minnows), where the inherited pages overflow it;
#   - OUT/nodecode: the real disaggregated cluster of compare_fairness.sh --quick with memfair on
#     the prefill node and fcfs on the decode node (its other runs are results.sh's fair/);
#   - OUT/claims: pdtb sim reproduce essay at 8, 14, 20 and 26 minnows/s (rate-R.json); the setting
#     where the largest 5% in memory are whales is the scorecard's (its sim-essay-top5.json).
# About a minute and a half of simulation and one real run (about 40 s) on 2 cores.
#
#   bash scripts/findings.sh --out DIR [--skip-real | --skip-sim]
#
# --skip-sim leaves out the simulated runs, --skip-real the real one (results.sh runs the
# simulated ones beside the scorecard's, the real one alone: a real run shares its cores with nothing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" REAL=1 SIM=1
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --skip-real=REAL:0 --skip-sim=SIM:0" -- "$@"
[ -n "$OUT" ] || { echo "findings: --out DIR is required" >&2; exit 2; }
source "$ROOT/scripts/_env.sh"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true

ESSAY=(--workload whale-minnow --prefill 1 --decode 1 --cost roofline --gpu h100-sxm --model-config llama-3-8b
       --max-model-len 135000 --whales 3 --whale-prompt 131072 --whale-output 256 --whale-start 5 --whale-interval 10
       --minnow-rate 14 --minnow-prompt 2048 --minnow-output 512 --duration 30
       --whale-tenants w0,w1 --minnow-tenants m0,m1,m2,m3 --whale-priority 1 --minnow-priority 0
       --tenant-tier w0=batch --tenant-tier w1=batch --tenant-tier m0=interactive --tenant-tier m1=interactive
       --tenant-tier m2=interactive --tenant-tier m3=interactive --slo ttft_ms=2000 --slo tpot_ms=100)
VARIANTS=("fcfs|--policy fcfs" "memfair|--policy memfair" "memfair-request|--policy memfair --quota-by request"
          "memfair-priority|--policy memfair --quota-by priority" "memfair-tier|--policy memfair --quota-by slo-tier"
          "memfair-static|--policy memfair --policy-arg quota_shares=static")
sims() {
for mode in colocated disagg; do
  mkdir -p "$OUT/quota-$mode"
  runs=("${VARIANTS[@]}")
  [ "$mode" = colocated ] || runs+=("memfair-fcfs-decode|--policy memfair --decode-policy fcfs")
  for v in "${runs[@]}"; do
    label="${v%%|*}" flags=()
    read -r -a flags <<< "${v#*|}"
    echo "== pdtb sim, the essay's setting, $mode: $label" >&2
    pdtb sim "${ESSAY[@]}" --mode "$mode" "${flags[@]}" --label-policy "$label" \
      --out "$OUT/quota-$mode/$label.json" > /dev/null
  done
done

mkdir -p "$OUT/decode-tight"
for v in "fcfs|--policy fcfs" "memfair|--policy memfair" "memfair-fcfs-decode|--policy memfair --decode-policy fcfs"; do
  label="${v%%|*}" flags=()
  read -r -a flags <<< "${v#*|}"
  echo "== pdtb sim, the essay's setting, a decode pool of 12800 pages: $label" >&2
  pdtb sim "${ESSAY[@]}" --mode disagg --decode-kv-pages 12800 "${flags[@]}" --label-policy "$label" \
    --out "$OUT/decode-tight/$label.json" > /dev/null
done

mkdir -p "$OUT/claims"
for rate in 8 14 20 26; do
  echo "== pdtb sim reproduce essay --minnow-rate $rate" >&2
  pdtb sim reproduce essay --minnow-rate "$rate" --json > "$OUT/claims/rate-$rate.json"
done
}
[ "$SIM" = 0 ] || sims

if [ "$REAL" = 1 ]; then
  bash scripts/compare_fairness.sh --quick --modes disagg --policies "memfair-fcfs-decode=memfair" \
    --decode-policy fcfs --out "$OUT/nodecode" >&2
fi
