#!/usr/bin/env bash
# Set up the environment (see _env.sh), then the main job on the embedded default model:
# launch a small disaggregated cluster (1 prefill + 1 decode + router), send a few streaming
# requests, print their outputs and latency, stop the cluster.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
RUN_DIR="$ROOT/runs/quickstart-$$"
cleanup() { bash "$ROOT/scripts/stop_cluster.sh" --run-dir "$RUN_DIR" --timeout 20 >/dev/null 2>&1 || true; }
trap cleanup EXIT
bash scripts/launch_cluster.sh --mode disagg --prefill 1 --decode 1 --port 0 --run-dir "$RUN_DIR"
pdtb demo --url "$(cat "$RUN_DIR/url")"
