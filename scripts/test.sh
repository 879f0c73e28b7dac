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
# Test files run on PDTB_TEST_WORKERS pytest-xdist workers (default 3; 0: one process), each
# file's tests in one worker, where xdist is installed (a GPU machine's own python may lack it).
# Three on two cores: the cluster tests wait on the processes they start, so two workers kept
# one core busy on average (the whole suite on a 2-core machine: 1,200 s of wall time for
# 1,200 s of CPU; with three workers, 980 s).
if [ "${PDTB_TEST_WORKERS:-3}" != 0 ] && python -c "import xdist" 2>/dev/null; then
  set -- -n "${PDTB_TEST_WORKERS:-3}" --dist loadfile "$@"
fi
exec python -m pytest -q "$@"
