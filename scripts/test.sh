#!/usr/bin/env bash
# Set up the environment (see _env.sh) and run the test suite. Extra args go to pytest.
#   bash scripts/test.sh [--fast] [PYTEST ARGS...]
# --fast leaves out the tests marked slow: real clusters, node and peer processes, loads held in real time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_env.sh"
cd "$ROOT"
if [ "${1:-}" = --fast ]; then
  shift
  set -- -m "not slow" "$@"
fi
# One torch thread per process unless told otherwise: tests run torch in each pytest worker and
# in the nodes they start, and torch's default of a thread per core in each of them oversubscribes
# the cores (tests/engine on two workers: 360 s against 56 s on a 2-core machine). Tests of the
# multi-threaded paths set their thread count themselves.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Test files run on PDTB_TEST_WORKERS pytest-xdist workers (default 2; 0: one process), each
# file's tests in one worker, where xdist is installed (a GPU machine's own python may lack it).
if [ "${PDTB_TEST_WORKERS:-2}" != 0 ] && python -c "import xdist" 2>/dev/null; then
  set -- -n "${PDTB_TEST_WORKERS:-2}" --dist loadfile "$@"
fi
exec python -m pytest -q "$@"
