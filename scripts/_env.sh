#!/usr/bin/env bash
# Sourced by quickstart.sh and test.sh: create .venv if missing (torch first, so pip takes the
# CPU wheel instead of a multi-GB CUDA build), install the project with the exact versions of
# requirements.lock, and activate the venv. Idempotent: a stamp file keyed on pyproject.toml and
# the lock skips the installs when nothing changed; a venv stamped "unmanaged" (the ones
# scripts/check_latest.sh builds) is used as it is.
# PDTB_SYSTEM_PYTHON=1 skips the venv and uses python3 as it is (GPU machines: see README).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PDTB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
LOCK="$ROOT/requirements.lock"
TORCH_SPEC="${PDTB_TORCH_SPEC:-$(grep -E '^torch==' "$LOCK")}"

if [ "${PDTB_SYSTEM_PYTHON:-0}" = 1 ]; then
  # Use the Python already there (a GPU machine's CUDA build of torch, say): no venv, no installs.
  # The project runs from this checkout; `pdtb` and `python` come from a shim directory.
  "$PY" -c "import torch, transformers, tokenizers, zmq, msgpack, uvloop, aiohttp, numpy, psutil" \
    || { echo "[pdtb] PDTB_SYSTEM_PYTHON=1: $PY lacks a dependency (see pyproject.toml)" >&2; exit 1; }
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p "$ROOT/.pdtb-bin"
  for name in pdtb python; do
    if [ "$name" = pdtb ]; then args='-m pdtb'; else args=''; fi
    printf '#!/bin/sh\nexec %s %s "$@"\n' "$(command -v "$PY")" "$args" > "$ROOT/.pdtb-bin/$name"
    chmod +x "$ROOT/.pdtb-bin/$name"
  done
  export PATH="$ROOT/.pdtb-bin:$PATH" TOKENIZERS_PARALLELISM=false
  return 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[pdtb] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.pdtb-installed"
want="$(cat "$ROOT/pyproject.toml" "$LOCK" | sha1sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$have" != unmanaged ] && [ "$have" != "$want" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[pdtb] installing $TORCH_SPEC" >&2
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -c "import torch" || { echo "[pdtb] torch install failed" >&2; exit 1; }
  fi
  echo "[pdtb] installing pd-testbed and test dependencies (versions of requirements.lock)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test,ray]" -c "$LOCK" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import pdtb.engine, transformers, zmq, msgpack, uvloop, aiohttp, pytest" \
    || { echo "[pdtb] project install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export TOKENIZERS_PARALLELISM=false
