#!/usr/bin/env bash
# Do two revisions decide alike? The quick fairness comparison, simulated (--sim) and, with
# --lockstep, through a real decode node in lockstep, for every built-in policy, at revision
# BASE and at HEAD (or --head REV), each from a clean worktree of its own; then every results
# file of one is compared with the other's, field by field, leaving out what names the run
# (options, wall and CPU time, policy_info, the cost model's description). Exit 0 when every file is the same.
#
#   scripts/same_decisions.sh --base REV [--head REV | --head-tree DIR] [--lockstep] [--policies LIST] [--out DIR]
#
# --head-tree DIR runs the head side in DIR as it stands (a checkout with uncommitted changes,
# e.g. `--head-tree .`), not in a worktree of a revision.
#
# For a change meant to move code, not decisions: both runs are deterministic (the simulator's
# clock and lockstep's fixed order of events), so any difference is a changed decision.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="" HEAD_REV=HEAD HEAD_TREE="" LOCKSTEP=0 POLICIES="fcfs memfair vtc mcsf priority" OUT=""
source "$ROOT/scripts/_opts.sh"
opts_parse "--base=BASE --head=HEAD_REV --head-tree=HEAD_TREE --lockstep=LOCKSTEP:1 --policies=POLICIES --out=OUT" -- "$@"
[ -n "$BASE" ] || { echo "same_decisions: --base REV is required" >&2; exit 2; }
source "$ROOT/scripts/_env.sh"
PY="$(command -v python)"  # this checkout's environment runs both trees, each from its own code
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
trees=()
cleanup() { for t in ${trees[@]+"${trees[@]}"}; do git -C "$ROOT" worktree remove --force "$t" 2>/dev/null || true; done; }
trap cleanup EXIT

run_at() {  # run_at REV NAME [DIR]: the comparisons at REV (or in DIR as it stands), into OUT/NAME-{sim,lockstep}
  local rev="$1" name="$2" tree="${3:-}"
  if [ -n "$tree" ]; then
    tree="$(cd "$tree" && pwd)"
    echo "== $name: $tree as it stands" >&2
  else
    tree="$OUT/tree-$2"
    git -C "$ROOT" worktree add --detach "$tree" "$rev" >/dev/null 2>&1
    trees+=("$tree")
    echo "== $name: $(git -C "$tree" log --oneline -1)" >&2
  fi
  (cd "$tree" && PDTB_SYSTEM_PYTHON=1 PYTHON="$PY" bash scripts/compare_fairness.sh --quick --sim \
     --policies "$POLICIES" --out "$OUT/$name-sim" >/dev/null 2>&1)
  if [ "$LOCKSTEP" = 1 ]; then
    (cd "$tree" && PDTB_SYSTEM_PYTHON=1 PYTHON="$PY" bash scripts/compare_fairness.sh --quick --lockstep \
       --modes disagg --policies "$POLICIES" --out "$OUT/$name-lockstep" >/dev/null 2>&1)
  fi
}

run_at "$BASE" base
run_at "$HEAD_REV" head "$HEAD_TREE"
python - "$OUT" <<'PY'
import glob
import json
import os
import sys

out = sys.argv[1]
SKIP = {"options", "policy_info", "wall_s", "elapsed_s", "cpu_s", "command", "cost_info"}  # what names or times the run


def where(x, y, path=""):
    """The paths (list indexes as []) at which two results differ, each once."""
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in sorted((set(x) | set(y)) - SKIP):
            if k not in x or k not in y:
                out.append(f"{path}/{k} ({'base' if k in x else 'head'} only)")
            else:
                out += where(x[k], y[k], f"{path}/{k}")
        return list(dict.fromkeys(out))
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return list(dict.fromkeys(p for u, v in zip(x, y) for p in where(u, v, f"{path}[]")))
    return [] if x == y else [path]


differ = 0
for kind in ("sim", "lockstep"):
    for a in sorted(glob.glob(f"{out}/base-{kind}/*.json")):
        b = a.replace(f"base-{kind}", f"head-{kind}")
        if not os.path.exists(b):
            print(f"{kind} {os.path.basename(a)}: missing at head")
            differ += 1
            continue
        paths = where(json.load(open(a)), json.load(open(b)))
        differ += bool(paths)
        print(f"{kind} {os.path.basename(a)}: {'DIFFERENT at ' + ', '.join(paths[:4]) if paths else 'same'}")
print("every decision the same" if not differ else f"{differ} files differ")
sys.exit(1 if differ else 0)
PY
