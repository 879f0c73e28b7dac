#!/usr/bin/env bash
# Set up the environment (see _env.sh) and run the test suite. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
