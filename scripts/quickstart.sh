#!/usr/bin/env bash
# Set up the environment (see _env.sh) and run the main job on the embedded default model:
# an offline batched generation that ends with a throughput line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
pdtb generate --max-tokens 48 --ignore-eos \
  --prompt "In a shared inference pool" \
  --prompt "Prefill runs the prompt once and writes keys and values into pages of a pool." \
  --prompt "Tenants share the pool" \
  --prompt "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
