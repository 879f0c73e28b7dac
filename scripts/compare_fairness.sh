#!/usr/bin/env bash
# Colocated vs disaggregated serving, policy by policy, on the same seeded whale-minnow workload.
#
#   scripts/compare_fairness.sh [--quick] [--out DIR] [--policies LIST] [--policy-arg [LABEL:]KEY=VALUE]...
#                               [--modes "colocated disagg"] [--model DIR] [--seed N] [--device cpu|cuda[:N]] [--step-log]
#                               [--node-args "ARGS"] [--context-whales N] [--minnow-rate R] [--workload whale-minnow|tenants]
#                               [--transport zmq|torch|shm|auto] [--decode-policy REF]
#                               [--sim [--calibration FILE] [--sim-args "ARGS"]] [--lockstep [--step-ms MS]] [--dry-run]
#
# --policies (spaces or commas; default fcfs memfair vtc mcsf priority, --quick fcfs memfair):
# each a policy reference, NAME, package.module:Class or path/to/file.py:Class, or LABEL=REF.
# LABEL names the policy's runs (files, labels in the results); a name is its own label, a
# module:Class or file.py:Class the class's own `name` (else the class's name), unless LABEL= gives another (the same
# reference twice, with different settings, needs it). --policy-arg KEY=VALUE sets a setting of
# every policy's, LABEL:KEY=VALUE of that one's only (repeatable), e.g.
#   --policies "fcfs memfair memfair-s5=memfair mine=./my_policy.py:MyPolicy"
#   --policy-arg memfair-s5:starve_after_s=5 --policy-arg mine:horizon_s=2
# Every policy, with its settings and --node-args, is checked before the first run (status 2
# and the reason otherwise); a file's path is made absolute. --dry-run stops there and prints
# one line per policy: LABEL, the reference and its settings.
#
# Same KV page budget in both modes: the colocated node gets TOTAL device pages; the
# disaggregated cluster splits them, PREFILL pages on the prefill node and the rest on the
# decode node. Both get the same host tier. Compute: every node runs 1 torch thread (the
# disaggregated cluster has two nodes, the colocated twin one). On 2-core machines a second
# thread in the colocated node makes its steps slower, not faster (the embedded model is tiny),
# and noisier: it fights the router and the load client for the cores.
# Two kinds of whale, each 64 times a minnow's footprint: 6 with long outputs (1024+1024 tokens)
# arrive close together, need more than the decode pool and hold it (KV pressure); then
# long-context whales (1984+64 tokens, nearly all prompt, as the longest requests of the Azure
# conversation trace) arrive every half second from t = 4 s and load the prefill side and the
# steps a colocated node shares with decoding minnows. --context-whales N sets their number
# (default 16 quick, 26 full; 0 leaves only the long-output whales). --minnow-rate sets the
# minnows' load (requests/s, default 4): the frontier's quick sweep reads loads 1.5, 3 and 6.
# --workload tenants replaces the whale-minnow workload by a multi-tenant one
# (pdtb/client/data/cpu_tenants.json: one tenant of long requests, class whale, and two of chat
# and short ones, class minnow, each arriving as its own Poisson process, for the file's 20 s) on
# the same budget; the whale-minnow flags (--minnow-rate, --context-whales) are refused with it.
# The long outputs hold the whales' footprint for many decode steps, so the pressure lasts
# long enough to show even with the fast steps of the C decode kernel.
# Writes DIR/MODE-LABEL.json for each run and DIR/report/report.md with plots. With --step-log,
# every node also writes one JSON line per engine step to DIR/run-MODE-LABEL/steps-NODE.jsonl.
# --node-args passes more flags to every node of every policy (split on spaces, no quoting),
# e.g. "--quota-by request"; a policy's own settings go by --policy-arg.
# --transport picks the disaggregated clusters' KV transport (default zmq).
# --decode-policy REF runs the decode node of every disaggregated cluster under REF at its
# defaults, the prefill node under the run's policy: with fcfs, a cluster whose decode side
# re-admits nothing of its own (colocated runs are refused with it).
# --sim runs every configuration through the simulator (pdtb sim, calibrated cost model: FILE
# from `pdtb sim calibrate`, default the shipped one) with exactly the same workload and node
# flags, instead of real clusters; scripts/validate_sim.sh compares the two. --sim-args passes
# more flags to every simulated run (split on spaces), e.g. "--routers 2".
# --lockstep (disaggregated mode only) hands the same workload off into a real decode node with
# the same flags over --transport, in a fixed order of events on a virtual clock of MS per
# engine step (pdtb bench lockstep, default 20): its admission verdicts, every request's and in
# all, do not depend on timing, so transports can be compared decision by decision
# (scripts/compare_transports.sh). Writes DIR/disagg-LABEL.json (lockstep results).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 OUT="" POLICIES="" MODES="colocated disagg" MODEL="" SEED=0 DEVICE=cpu STEPLOG=0 NODE_ARGS="" CTX=""
DECODE_POLICY="" SIM=0 CALIBRATION="" SIM_ARGS="" TRANSPORT=zmq LOCKSTEP=0 STEP_MS=20 PARGS=() DRY=0 MRATE=4 WORKLOAD=whale-minnow CTX_SET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --policies) POLICIES="$2"; shift 2 ;;
    --policy-arg) PARGS+=("$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --modes) MODES="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --step-log) STEPLOG=1; shift ;;
    --node-args) NODE_ARGS="$2"; shift 2 ;;
    --context-whales) CTX="$2" CTX_SET=1; shift 2 ;;
    --minnow-rate) MRATE="$2"; shift 2 ;;
    --workload) WORKLOAD="$2"; shift 2 ;;
    --sim) SIM=1; shift ;;
    --calibration) CALIBRATION="$2"; shift 2 ;;
    --sim-args) SIM_ARGS="$2"; shift 2 ;;
    --transport) TRANSPORT="$2"; shift 2 ;;
    --decode-policy) DECODE_POLICY="$2"; shift 2 ;;
    --lockstep) LOCKSTEP=1; shift ;;
    --step-ms) STEP_MS="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "compare_fairness: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
source "$ROOT/scripts/_policy.sh"

# Workload and budget. Whale footprint = 64 x minnow footprint (1024+1024 or 1984+64 vs 24+8 tokens).
PAGE=16 TOTAL=448 PREFILL=160 HOST=512
# Whales arrive close together so they overlap and, growing, need more than the decode pool.
WL=(--workload whale-minnow --whales 6 --whale-prompt 1024 --whale-output 1024 --whale-start 1
    --whale-interval 0.5 --minnow-prompt 24 --minnow-output 8 --minnow-rate "$MRATE" --duration 30 --seed "$SEED"
    --slo ttft_ms=500 --slo tpot_ms=100)
CTX_DEFAULT=26
if [ "$QUICK" = 1 ]; then
  # The same whales and KV budget, 20 s of minnows instead of 30. 6 whales, so that the 5th
  # and 6th are admitted late, while minnows decode, as in the full run: fcfs's minnows then
  # share steps with a whale's 512-token prefill chunk, which the ITL comparison measures.
  POLICIES="${POLICIES:-fcfs memfair}"
  WL=(--workload whale-minnow --whales 6 --whale-prompt 1024 --whale-output 1024 --whale-start 1
      --whale-interval 0.5 --minnow-prompt 24 --minnow-output 8 --minnow-rate "$MRATE" --duration 20 --seed "$SEED"
      --slo ttft_ms=500 --slo tpot_ms=100)
  CTX_DEFAULT=16
fi
CTX="${CTX:-$CTX_DEFAULT}"
case "$CTX" in ''|*[!0-9]*) echo "compare_fairness: --context-whales wants a count, got $CTX" >&2; exit 2 ;; esac
WL+=(--context-whales "$CTX" --context-whale-prompt 1984 --context-whale-output 64 --context-whale-start 4
     --context-whale-interval 0.5)
case "$MRATE" in ''|*[!0-9.]*|*.*.*|.) MRATE_OK=0 ;; *) MRATE_OK="$(awk -v r="$MRATE" 'BEGIN {print (r > 0)}')" ;; esac
[ "$MRATE_OK" = 1 ] || { echo "compare_fairness: --minnow-rate wants requests/s above 0, got $MRATE" >&2; exit 2; }
case "$WORKLOAD" in
  whale-minnow) ;;
  tenants)
    [ "$MRATE" = 4 ] && [ -z "$CTX_SET" ] || { echo "compare_fairness: --workload tenants takes no --minnow-rate or --context-whales" >&2; exit 2; }
    WL=(--workload multi-tenant --tenants-file "$ROOT/pdtb/client/data/cpu_tenants.json" --seed "$SEED"
               --slo ttft_ms=500 --slo tpot_ms=100) ;;
  *) echo "compare_fairness: --workload is whale-minnow or tenants, got $WORKLOAD" >&2; exit 2 ;;
esac
BUDGET=512  # per-step token budget: whale prompts prefill in chunks, interleaved with decode
# The nodes attribute each request's misses of the same SLOs as the client's goodput uses (the
# client then reports the causes per class: `SLO attribution` under each run's table).
NODE_SLO=(--slo-ttft '*=0.5' --slo-tpot '*=0.1')
POLICIES="${POLICIES:-fcfs memfair vtc mcsf priority}"
read -r -a NODE_ARGV <<< "$NODE_ARGS"
read -r -a SIM_ARGV <<< "$SIM_ARGS"
# every policy and its settings checked now: a typo found before the runs, not after those before it
policy_table compare_fairness "$POLICIES" ${PARGS[@]+"${PARGS[@]}"} -- "${NODE_SLO[@]}" \
  ${NODE_ARGV[@]+"${NODE_ARGV[@]}"}
if [ "$DRY" = 1 ]; then
  for i in "${!POLICY_LABELS[@]}"; do
    echo "${POLICY_LABELS[$i]} ${POLICY_REFS[$i]}${POLICY_ARGS[$i]:+ ${POLICY_ARGS[$i]//$'\t'/ }}"
  done
  exit 0
fi
OUT="${OUT:-$ROOT/results/compare-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # nodes may run elsewhere: --step-log paths must be absolute
[ -n "$MODEL" ] || MODEL="$(python -c 'from pdtb.engine.model_info import resolve_model_arg; print(resolve_model_arg(None))')"

sim_one() {  # sim_one MODE LABEL: the same flags through the simulator (POLICY_FLAGS: the policy's)
  local mode="$1" pol="$2" pages=()
  if [ "$mode" = colocated ]; then pages=(--kv-pages "$TOTAL"); else
    pages=(--prefill-kv-pages "$PREFILL" --decode-kv-pages "$(( TOTAL - PREFILL ))" ${DECODE_POLICY:+--decode-policy "$DECODE_POLICY"}); fi
  echo "== $mode / $pol simulated: device pages ${pages[*]}, host $HOST" >&2
  pdtb sim "${WL[@]}" --mode "$mode" "${POLICY_FLAGS[@]}" "${pages[@]}" --host-kv-pages "$HOST" --page-size "$PAGE" \
    --max-num-batched-tokens "$BUDGET" "${NODE_SLO[@]}" --cost calibrated ${CALIBRATION:+--calibration "$CALIBRATION"} \
    ${NODE_ARGV[@]+"${NODE_ARGV[@]}"} ${SIM_ARGV[@]+"${SIM_ARGV[@]}"} --label-mode "$mode" --label-policy "$pol" \
    --out "$OUT/$mode-$pol.json" >/dev/null
}

lockstep_one() {  # lockstep_one MODE LABEL: the decode node's flags, in lockstep (disagg only)
  local pol="$2"
  echo "== disagg / $pol in lockstep over $TRANSPORT: decode pages $(( TOTAL - PREFILL )), host $HOST" >&2
  pdtb bench lockstep "${WL[@]}" --step-ms "$STEP_MS" --label-policy "$pol" --out "$OUT/disagg-$pol.json" -- \
    --model "$MODEL" "${POLICY_FLAGS[@]}" --transport "$TRANSPORT" --kv-pages "$(( TOTAL - PREFILL ))" \
    --host-kv-pages "$HOST" --page-size "$PAGE" --torch-threads 1 --max-num-batched-tokens "$BUDGET" \
    --device "$DEVICE" "${NODE_SLO[@]}" ${NODE_ARGV[@]+"${NODE_ARGV[@]}"} ${DECODE_POLICY:+--policy "$DECODE_POLICY"}
}

run_one() {  # run_one MODE LABEL (POLICY_FLAGS: the policy's --policy and --policy-arg flags)
  [ "$SIM" = 0 ] || { sim_one "$@"; return; }
  [ "$LOCKSTEP" = 0 ] || { lockstep_one "$@"; return; }
  local mode="$1" pol="$2" rd="$OUT/run-$1-$2" extra=() pages
  if [ "$mode" = colocated ]; then
    pages="$TOTAL"; extra=(-- --torch-threads 1 --max-num-batched-tokens "$BUDGET" --device "$DEVICE")
  else
    pages=$(( TOTAL - PREFILL )); extra=(--prefill-kv-pages "$PREFILL" --transport "$TRANSPORT"
                                         ${DECODE_POLICY:+--decode-args "--policy $DECODE_POLICY"}
                                         -- --max-num-batched-tokens "$BUDGET" --device "$DEVICE")
  fi
  extra+=("${NODE_SLO[@]}")
  [ "$STEPLOG" = 0 ] || extra+=(--step-log "$rd/steps-{node}.jsonl")
  extra+=(${NODE_ARGV[@]+"${NODE_ARGV[@]}"})
  echo "== $mode / $pol on $DEVICE: device pages $pages${PREFILL:+ (prefill $PREFILL in disagg)}, host $HOST" >&2
  local url
  url="$(bash "$ROOT/scripts/launch_cluster.sh" --mode "$mode" --model "$MODEL" "${POLICY_FLAGS[@]}" --port 0 \
        --kv-pages "$pages" --host-kv-pages "$HOST" --page-size "$PAGE" --run-dir "$rd" "${extra[@]}" \
        | sed -n 's/^READY //p')"
  local rc=0
  pdtb bench serve --url "$url" "${WL[@]}" --label-mode "$mode" --label-policy "$pol" \
    --out "$OUT/$mode-$pol.json" --quiet || rc=$?
  bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$rd" --timeout 20 >&2
  return $rc
}

if [ -n "$DECODE_POLICY" ]; then
  [ "$MODES" = disagg ] || { echo "compare_fairness: --decode-policy is for the disaggregated mode only (--modes disagg)" >&2; exit 2; }
  DECODE_POLICY="$(policy_check compare_fairness "$DECODE_POLICY")"
fi
if [ "$LOCKSTEP" = 1 ] && [ "$MODES" != disagg ]; then
  echo "compare_fairness: --lockstep runs the disaggregated mode only (--modes disagg)" >&2; exit 2
fi
for mode in $MODES; do
  for i in "${!POLICY_LABELS[@]}"; do
    policy_flags "$i"
    run_one "$mode" "${POLICY_LABELS[$i]}"
  done
done
echo
[ "$LOCKSTEP" = 0 ] || exit 0  # lockstep results are verdicts, not request records: python -m pdtb.figures.admissions
pdtb compare "$OUT"/*.json | tee "$OUT/compare.txt"
pdtb report "$OUT"/*.json --out "$OUT/report" >/dev/null
echo "report: $OUT/report/report.md"
