#!/usr/bin/env bash
# The simulator's figures, each from one command whose output lands in OUT; written by
# `python -m pdtb.figures.results_doc --section sim --sim OUT --out docs/results.md` (results.sh: its --sim):
# the validation against the testbed, the reproductions and the roofline on their own page,
# docs/sim-validation.md beside results.md, summarised in results.md with the rest.
#   - validation against the testbed: scripts/validate_sim.sh over the workload sets --sets
#     (default "quick load1.5 load3 load6 tenants"; with --real DIR: real runs of
#     compare_fairness.sh --quick already made, e.g. by results.sh, for the first set, and
#     DIR-SET for the others where they are there; else it makes them); --repeat and
#     --repeat-sets LIST are its own: a second real run of each set, or of those (DIR-rep,
#     DIR-SET-rep), the testbed against itself;
#   - the reproductions: pdtb sim reproduce mcsf|vtc|essay --json;
#   - one hour of the Azure conversation trace on an 8-GPU disaggregated shape (Llama-3-70B,
#     tensor parallel 4, one prefill and one decode node on H100s), each policy's CPU seconds
#     counted, with their pdtb report;
#   - how fast the simulator runs: the Azure hour on 4P+4D Llama-3-8B under every built-in
#     policy, against one event per step on a slice of it (pdtb sim speed);
#   - the H200 step grid (shipped samples) against the roofline: pdtb sim roofline.
#
#   bash scripts/sim_results.sh --out DIR [--quick] [--real DIR] [--sets LIST] [--skip-validate | --validate-only] [--skip-speed]
#                               [--repeat | --repeat-sets LIST] [--trace FILE] [--steps FILE] [--prefix-real DIR]
#                               [--policies LIST] [--policy-arg [LABEL:]KEY=VALUE]...
#
# --policies (default every built-in policy, as fairness/registry.py lists them) and --policy-arg serve the validation and the Azure hour,
# as compare_fairness.sh takes them: each policy a NAME, module:Class, path/to/file.py:Class or
# LABEL=REF, its settings by --policy-arg; checked before anything runs, a policy file's path
# made absolute. The Azure hour's files are named azure-hour-LABEL.*.
# --skip-validate, --skip-speed: the validation, the speed run left out; --validate-only: the
# validation alone (results.sh runs it apart from the timed parts). --steps FILE and
# --prefix-real DIR are validate_sim.sh's: the step grid and the real prefix runs made already. --trace FILE: the Azure
# conversation trace (default ../shared/traces/azure_llm_conv_2023.csv from the project root;
# without it the Azure hour and the speed run are left out). --quick: the validation's first set
# alone (unless --sets), the Azure hour with fcfs and memfair only (of the policies), the speed
# run with memfair only and a baseline slice of 1000 requests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
unset POLICIES  # unset until --policies: the default is every built-in, listed once the env is up
OUT="" REAL="" SETS="" QUICK=0 VALIDATE=1 SPEED=1 VONLY=0 STEPS="" PREAL="" REPEAT=() PITEMS=() TRACE_ARG="" TRACE="../shared/traces/azure_llm_conv_2023.csv"  # from the project root
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --quick=QUICK:1 --real=REAL --sets=SETS --skip-validate=VALIDATE:0 --skip-speed=SPEED:0 --repeat=REPEAT:(--repeat)
  --repeat-sets=REPEAT(--repeat-sets) --policies=POLICIES --policy-arg=PITEMS+ --trace=TRACE_ARG --validate-only=VONLY:1
  --steps=STEPS --prefix-real=PREAL" -- "$@"
[ "$VONLY" = 0 ] || [ "$VALIDATE" = 1 ] || { echo "sim_results: --validate-only and --skip-validate exclude each other" >&2; exit 2; }
for v in STEPS PREAL REAL; do  # relative to where the script was called from, not to ROOT
  [ -z "${!v}" ] || [[ "${!v}" = /* ]] || printf -v "$v" '%s' "$PWD/${!v}"
done
if [ -n "$TRACE_ARG" ]; then  # relative to where the script was called from, not to ROOT
  TRACE="$(cd "$(dirname "$TRACE_ARG")" && pwd)/$(basename "$TRACE_ARG")"
fi
[ -n "$OUT" ] || { echo "sim_results: --out DIR is required" >&2; exit 2; }
[ -n "$SETS" ] || { [ "$QUICK" = 1 ] && SETS=quick || SETS="quick load1.5 load3 load6 tenants"; }
SPEED_POLICIES=()
[ "$QUICK" = 0 ] || SPEED_POLICIES=(--policies memfair --slice 1000)
source "$ROOT/scripts/_env.sh"
POLICIES="${POLICIES-$(python -c "from fairness.registry import built_ins; print(' '.join(built_ins()))")}"
source "$ROOT/scripts/_policy.sh"
policy_table sim_results "$POLICIES" ${PITEMS[@]+"${PITEMS[@]}"}  # before the cd: a file's path is relative to here
PARGS=()
for kv in ${PITEMS[@]+"${PITEMS[@]}"}; do PARGS+=(--policy-arg "$kv"); done
cd "$ROOT"
mkdir -p "$OUT"
git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
if [ "$VALIDATE" = 1 ]; then
  bash scripts/validate_sim.sh --out "$OUT/validate" ${REAL:+--real "$REAL"} --sets "$SETS" ${REPEAT[@]+"${REPEAT[@]}"} \
    --policies "$(policy_list)" ${PARGS[@]+"${PARGS[@]}"} ${STEPS:+--steps "$STEPS"} ${PREAL:+--prefix-real "$PREAL"} >&2
fi
[ "$VONLY" = 0 ] || exit 0
for r in mcsf vtc essay; do
  echo "== pdtb sim reproduce $r" >&2
  pdtb sim reproduce "$r" --json > "$OUT/repro-$r.json"
done
if [ -f "$TRACE" ]; then
  for i in "${!POLICY_LABELS[@]}"; do
    pol="${POLICY_LABELS[$i]}"
    [ "$QUICK" = 0 ] || [ "$pol" = fcfs ] || [ "$pol" = memfair ] || continue
    policy_flags "$i"
    [ "$pol" = "${POLICY_REFS[$i]}" ] || POLICY_FLAGS+=(--label-policy "$pol")  # (a name labels itself)
    AZ=(pdtb sim --workload "trace:$TRACE" --mode disagg --prefill 1 --decode 1 --cost roofline --gpu h100-sxm
        --model-config llama-3-70b --tp 4 "${POLICY_FLAGS[@]}" --slo ttft_ms=2000 --slo tpot_ms=100)
    echo "== ${AZ[*]}" >&2
    # the command's CPU seconds, its own (what the run costs, whatever else the machine runs)
    python -m pdtb.cputime "$OUT/azure-hour-$pol.cpu_s" -- "${AZ[@]}" --out "$OUT/azure-hour-$pol.json" \
      > "$OUT/azure-hour-$pol.txt"
    echo "${AZ[*]} --out azure-hour-$pol.json" > "$OUT/azure-hour-$pol.command"
  done
  pdtb report "$OUT"/azure-hour-*.json --out "$OUT/azure-report" >/dev/null
else
  echo "sim_results: no trace at $TRACE: the Azure hour is left out" >&2
fi
if [ -f "$TRACE" ] && [ "$SPEED" = 1 ]; then
  echo "== pdtb sim speed --json" >&2
  pdtb sim speed --trace "$TRACE" ${SPEED_POLICIES[@]+"${SPEED_POLICIES[@]}"} --json > "$OUT/speed.json"
fi
pdtb sim roofline --steps pdtb/sim/calibrations/samples/h200-llama-3-8b-bf16.json --gpu h200 \
  --model-config llama-3-8b --json > "$OUT/roofline-h200.json"
