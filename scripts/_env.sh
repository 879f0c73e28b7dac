#!/usr/bin/env bash
# Sourced by quickstart.sh and test.sh: create .venv if missing (torch first, so pip takes the
# CPU wheel instead of a multi-GB CUDA build), install the project, and activate the venv.
# Idempotent: a stamp file keyed on pyproject.toml skips the installs when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PDTB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${PDTB_TORCH_SPEC:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[pdtb] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.pdtb-installed"
want="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[pdtb] installing $TORCH_SPEC" >&2
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -c "import torch" || { echo "[pdtb] torch install failed" >&2; exit 1; }
  fi
  echo "[pdtb] installing pd-testbed and test dependencies" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import model_engine, transformers, zmq, msgpack, uvloop, aiohttp, pytest" \
    || { echo "[pdtb] project install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export TOKENIZERS_PARALLELISM=false
