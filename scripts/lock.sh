#!/usr/bin/env bash
# Write requirements.lock: the exact versions of everything the README's two commands install,
# frozen from a venv that passed scripts/check_latest.sh (default .venv-latest; or the venv
# given). scripts/_env.sh installs from this file, so a fresh machine gets what the suite ran on.
#
#   bash scripts/check_latest.sh && bash scripts/lock.sh [VENV]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-latest}"
[ -x "$VENV/bin/python" ] || { echo "[lock] no venv at $VENV: run scripts/check_latest.sh first" >&2; exit 1; }
OUT="$ROOT/requirements.lock"
if "$VENV/bin/python" -m pip freeze --disable-pip-version-check | grep -q -E '^nvidia-|^triton=='; then
  echo "[lock] $VENV holds a CUDA build of torch (nvidia-* packages): the lock is for the CPU build" >&2
  exit 1
fi
{
  echo "# Exact versions installed by scripts/_env.sh (constraints for 'pip install -e .[test,ray]')."
  echo "# Written by scripts/lock.sh from a venv that passed scripts/check_latest.sh; do not edit."
  echo "# torch is the CPU build (local version label dropped: '==' matches it)."
  "$VENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -E '^(-e |pd-testbed|pd_testbed)' | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "[lock] wrote $OUT ($(grep -vc '^#' "$OUT") packages) from $VENV" >&2
