#!/usr/bin/env bash
# The engine-equivalence and cluster tests against the newest releases pyproject.toml allows
# (default), or with every direct dependency at the lower bound pyproject.toml declares
# (--lowest), each in a venv of its own (.venv-latest, .venv-lowest), built afresh. Prints the
# versions it ran on. torch stays at the lock's CPU build in both: the newest torch on PyPI is a
# multi-GB CUDA build, and torch is not what these checks are about.
#
#   bash scripts/check_latest.sh [--lowest | --with SPEC ...] [pytest args...]
#   --with SPEC: the newest releases except SPEC (e.g. --with transformers==5.23.0), in .venv-with
#   Refreshing the lock:  bash scripts/check_latest.sh && bash scripts/lock.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=latest WITH=()
if [ "${1:-}" = --lowest ]; then MODE=lowest; shift; fi
while [ "${1:-}" = --with ]; do MODE=with; WITH+=("$2"); shift 2; done
VENV="$ROOT/.venv-$MODE"
PY="${PYTHON:-python3}"
TORCH_SPEC="$(grep -E '^torch==' "$ROOT/requirements.lock")"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)

echo "[check] building $VENV ($MODE)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"${PIP[@]}" "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" >&2 || true
if [ "$MODE" = lowest ]; then
  # name>=X in pyproject.toml's dependencies and test extra -> name==X (torch: the lock's)
  "$VENV/bin/python" - "$ROOT/pyproject.toml" > "$VENV/lower-bounds.txt" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
test = re.search(r"^test = \[(.*?)\]", text, re.M).group(1)
for name, low in re.findall(r'"([A-Za-z0-9_.\-]+)>=([0-9][0-9.]*)', deps + test):
    if name != "torch":
        print(f"{name}=={low}")
PYEOF
  cat "$VENV/lower-bounds.txt" >&2
  "${PIP[@]}" -e "$ROOT[test,ray]" -c "$VENV/lower-bounds.txt" 2>&1 | grep -v "^WARNING: Location" >&2 || true
else
  # torch named with its pin: an eager upgrade would otherwise replace the CPU build
  "${PIP[@]}" --upgrade --upgrade-strategy eager -e "$ROOT[test,ray]" "$TORCH_SPEC" ${WITH[@]+"${WITH[@]}"} 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
fi
"$VENV/bin/python" -c "import pdtb.engine, transformers, zmq, msgpack, uvloop, aiohttp, pytest" \
  || { echo "[check] install failed" >&2; exit 1; }
echo unmanaged > "$VENV/.pdtb-installed"  # scripts/_env.sh uses this venv as it is
echo "== versions ($MODE)"
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
for n in ["torch", "transformers", "tokenizers", "huggingface_hub", "pyzmq", "msgpack", "uvloop", "aiohttp",
          "numpy", "psutil", "prometheus-client", "matplotlib", "jinja2", "pytest", "hypothesis", "openai"]:
    print(f"  {n}=={md.version(n)}")
PYEOF
cd "$ROOT"
export PDTB_VENV="$VENV" TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engine/test_engine_equivalence.py tests/engine/test_hf_compat.py \
  tests/clusters/test_cluster.py "$@"
