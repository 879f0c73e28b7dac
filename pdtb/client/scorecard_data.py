"""Workload files the scorecard derives (scripts/scorecard.sh).

  python -m pdtb.client.scorecard_data prefix-tenants IN.jsonl OUT.jsonl --tenants K

prefix-tenants: a Mooncake trace with a tenant per row, made from its hash_id prefixes. The
first block of every row is the shared system prompt (id 0 in the conversation excerpt); the
second opens the conversation, and every turn of a conversation repeats it. Rows whose second
block is the same are one group, and the groups are dealt to K tenants by that block's id
(modulo K), so a conversation stays with one tenant and a tenant holds many conversations.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def prefix_tenants(rows: list[dict], tenants: int) -> list[dict]:
    """Each row with a "tenant": "t<k>", k = its second hash id modulo `tenants` (its first when
    it has one block only)."""
    if tenants < 1:
        raise ValueError(f"tenants must be at least 1, got {tenants}")
    out = []
    for r in rows:
        ids = r.get("hash_ids") or []
        if not ids:
            raise ValueError("prefix-tenants: every row needs hash_ids (a Mooncake trace)")
        key = ids[1] if len(ids) > 1 else ids[0]
        out.append({**r, "tenant": f"t{key % tenants}"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.client.scorecard_data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prefix-tenants", help="tenants from groups of hash_id prefixes")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tenants", type=int, default=4)
    a = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(a.src).read_text().splitlines() if line.strip()]
    try:
        out = prefix_tenants(rows, a.tenants)
    except ValueError as e:
        print(f"scorecard_data: {e}", file=sys.stderr)
        return 2
    Path(a.dst).write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
