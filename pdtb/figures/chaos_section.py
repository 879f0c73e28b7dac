"""docs/results.md's fault-campaign section, from `pdtb chaos` reports (scripts/chaos_results.sh)."""
from __future__ import annotations

import json
from pathlib import Path

CHAOS_HEADING = "## Fault campaigns (`pdtb chaos`)"
ORDER = ("zmq", "shm", "torch")


def _row(name: str, r: dict) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()))
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items(), key=lambda kv: -kv[1]))
    growth = max((v["growth"] for v in r.get("rss", {}).values()), default=None)
    quiet = r.get("quiet", {})
    calm = f"{quiet['seconds']:.1f} s" if quiet.get("quiet") else "no"
    return (f"| {name} | {r['duration_s']:.0f} s, seed {r['seed']} | {sum(r['faults'].values())}: {faults} | "
            f"{r['requests']}: {outcomes} | {len(r['violations'])} | "
            f"{'-' if growth is None else f'{growth:.3f}x'} | "
            f"{calm} |")


def render(chaos_dir: str, stamp: str | None = None) -> list[str]:
    files = sorted(Path(chaos_dir).glob("*.json"), key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else 9, p.stem))
    reports = [(p.stem, json.loads(p.read_text())) for p in files]
    when = f" Measured {stamp}." if stamp else ""
    lines = [CHAOS_HEADING, "",
             "`bash scripts/chaos_results.sh`: a steady greedy load of 4 tenants on 2P+2D (the embedded model, "
             "this machine) while faults come every 10-20 s, drawn from the seed; every stream checked against "
             f"`transformers.generate` (docs/faults.md).{when}", "",
             "| transport | campaign | faults carried out | requests by outcome | violations | largest node RSS growth "
             "| quiet after |",
             "|---|---|---|---|---|---|---|"]
    lines += [_row(name, r) for name, r in reports]
    for name, r in reports:
        lines += ["", f"{name}: `{r['command']}`"]
        for v in r["violations"][:5]:
            lines.append(f"- violation, {v['kind']}: {v['what']}")
    return lines + [""]
