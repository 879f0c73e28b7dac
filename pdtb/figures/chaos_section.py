"""docs/results.md's fault-campaign section from `pdtb chaos` reports.

docs/results.md's fault-campaign section, from `pdtb chaos` reports (scripts/chaos_results.sh)."""
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
    reports = [(p.stem, json.loads(p.read_text())) for p in files if p.stem != "drill"]
    drill = Path(chaos_dir) / "drill.json"
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
    if drill.is_file():
        d = json.loads(drill.read_text())
        lines += ["", f"**The router killed under {d.get('streams', '?')} streams** (`{d['command']}`): "
                      f"{d.get('cut_at_client', '?')} streams ended at the client with a connection error; every node "
                      f"held no page {d.get('seconds_to_zero_pages', '?')} s after the kill (bound 10 s); the router was "
                      f"back {d.get('seconds_to_router_back', '?')} s after it, and its completions "
                      f"{'equal' if d.get('probes_identical_to_generate') else 'DIFFER FROM'} `generate`'s. "
                      f"Violations: {len(d['violations'])}."]
        lines += [f"- {v}" for v in d["violations"]]
    return lines + [""]
