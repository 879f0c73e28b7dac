#!/usr/bin/env bash
# The GPU paths end to end, on a machine with a CUDA device. Each step is time-bounded and
# logged; a failing step does not stop the others, and the exit code says whether all passed.
#
#   PDTB_SYSTEM_PYTHON=1 bash scripts/gpu_check.sh [--out DIR] [--device cuda[:N]] [--skip-tests]
#                                                  [--skip-bench] [--skip-transport] [--skip-compare]
#                                                  [--steps-grid]
#
# 1. the GPU tests: the Triton paged decode kernels against a float64 reference, the fused
#    RMSNorm against transformers' own, the engine (Triton kernels, CUDA graphs) token-identical
#    to transformers.generate, exports across devices, tier moves to the pinned host tier,
#    ZeroMQ transfers between CUDA pools of two processes, one-sided writes into a GPU pool over
#    CUDA IPC (and a 1P+1D cluster on one GPU that way, token-identical to generate);
# 2. pdtb bench decode-kernel (the Triton kernel's launch settings); pdtb bench roofline of a
#    Llama-3-8B shape in bfloat16 at the setting fastest at 64 rows, every decode path timed;
#    pdtb bench engine on the GPU: float32 and bfloat16 with CUDA graphs, bfloat16 without;
# 3. pdtb bench transport with both pools on the GPU (ipc and tcp), and CPU pools beside it
#    (zmq ipc, and one-sided shm);
# 4. scripts/compare_fairness.sh --quick (fcfs, memfair) with every node on the GPU;
# 5. with --steps-grid: pdtb bench steps --grid on the GPU, the tiny model (float32) and a
#    Llama-3-8B shape with random weights (bfloat16), samples for pdtb sim calibrate.
# Writes DIR/<step>.log and DIR/<step>.json; prints one line per step. The figures go into
# docs/gpu-results.md with: python -m pdtb.figures.results_doc --section gpu --gpu DIR --out docs/results.md
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="" DEVICE=cuda COMPARE=1 BENCH=1 TESTS=1 GRID=0 TRANSPORT=1
source "$ROOT/scripts/_opts.sh"
opts_parse "--out=OUT --device=DEVICE --skip-compare=COMPARE:0 --skip-bench=BENCH:0 --skip-transport=TRANSPORT:0
  --skip-tests=TESTS:0 --steps-grid=GRID:1" -- "$@"
source "$ROOT/scripts/_env.sh" || exit 1
set +e  # _env.sh sets -e: here a failing step must not stop the others
OUT="${OUT:-$ROOT/results/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
cd "$ROOT"
git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
failed=0

step() {  # step NAME SECONDS CMD...
  local name="$1" limit="$2" t0 rc
  shift 2
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))"
  [ "$rc" = 0 ] || { failed=1; tail -n 25 "$OUT/$name.log" | sed "s/^/  [$name] /"; }
}

python - <<'EOF' | tee "$OUT/env.txt"
import torch, transformers, zmq
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "pyzmq", zmq.__version__)
for i in range(torch.cuda.device_count()):
    print("device", i, torch.cuda.get_device_name(i))
EOF
[ "$TESTS" = 1 ] && step tests 420 python -m pytest -q -x -p no:cacheprovider tests/engine/test_triton_decode.py \
  tests/engine/test_fused_norm.py tests/engine/test_cuda_graphs.py tests/engine/test_cuda_ipc.py tests/engine/test_cuda.py
if [ "$BENCH" = 1 ]; then
  step decode-kernel 240 sh -c "pdtb bench decode-kernel --device $DEVICE --json > $OUT/kernel.json"
  # the roofline runs the kernel at the launch setting the sweep found fastest at 64 rows (and a
  # span rule that picks its span count there); KernelConfig's defaults where the sweep did not run
  KC="$(python -m pdtb.microbench.decode_kernel --pick 64 < "$OUT/kernel.json" 2>/dev/null || true)"
  # decode steps of a Llama-3-8B shape (random weights, bfloat16) against the HBM roofline
  step roofline-llama-3-8b 300 pdtb bench roofline --device "$DEVICE" --random-init llama-3-8b --compare --json \
    ${KC:+--kernel-config "$KC"}
  step engine-fp32 150 pdtb bench engine --device "$DEVICE" --batch 32 --json
  step engine-bf16 150 pdtb bench engine --device "$DEVICE" --dtype bfloat16 --batch 32 --json
  step engine-bf16-eager 150 pdtb bench engine --device "$DEVICE" --dtype bfloat16 --batch 32 --cuda-graphs off --json
fi
if [ "$TRANSPORT" = 1 ]; then
  step transport-ipc 120 pdtb bench transport --device "$DEVICE" --endpoint ipc --json
  step transport-tcp 120 pdtb bench transport --device "$DEVICE" --endpoint tcp --json
  step transport-ipc-cpu 120 pdtb bench transport --device cpu --endpoint ipc --json  # same host, CPU pools
  step transport-shm-cpu 120 pdtb bench transport --backend shm --json  # one-sided, CPU pools
fi
if [ "$GRID" = 1 ]; then
  # Each under ~90 s on an H100: the 8B grid holds 32 rows of 4096 tokens (11k pages of 2 MiB
  # beside 16 GB of weights) and prefill chunks up to 2048 tokens at offset 2048.
  step steps-grid-tiny 150 pdtb bench steps --grid --json --device "$DEVICE" --dtype float32 --reps 5
  step steps-grid-llama-3-8b 150 pdtb bench steps --grid --json --device "$DEVICE" --dtype bfloat16 \
    --random-init llama-3-8b --reps 5 --grid-rows 1,8,32 --grid-ctx 128,1024,4096 \
    --grid-chunks 128,512,2048 --grid-offsets 0,2048 --grid-chunk-counts 1,2
fi
if [ "$COMPARE" = 1 ]; then
  step compare 420 bash scripts/compare_fairness.sh --quick --device "$DEVICE" --out "$OUT/compare"
  [ -f "$OUT/compare/compare.txt" ] && cat "$OUT/compare/compare.txt"
fi
for f in "$OUT"/engine-*.log "$OUT"/transport-*.log "$OUT"/steps-grid-*.log "$OUT"/roofline-*.log; do
  [ -f "$f" ] && grep -h '^{' "$f" | tail -n 1 > "${f%.log}.json"
done
exit $failed
