"""`python -m pdtb.figures.prefix_report DIR`: the prefix-caching figures of scripts/prefix_results.sh.

Reads DIR/trace-{on,off}.json, DIR/conversation-{on,off}.json, DIR/route-{load,cache}.json and DIR/charge-{split,first,full}.json
(whichever exist), prints one table per experiment and writes them as markdown (--out).
Every ratio is between runs of the same invocation, on the same machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdtb.figures.results import print_markdown


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _kv_bytes(res: dict, kind: str) -> int | None:
    """KV bytes of `kind` summed over the run's requests (their pdtb_timing.kv_bytes, as the
    decode node metered them: "received" was sent, "cached" was left out); None without any."""
    got = [((r.get("server_timing") or {}).get("kv_bytes") or {}).get(kind) for r in res.get("requests", [])]
    got = [g for g in got if g is not None]
    return sum(got) if got else None


def _tenant_mean(res: dict, key: str) -> dict[str, float]:
    """Mean over samples of a per-tenant node figure, summed over nodes."""
    s = res.get("samples") or []
    tenants = sorted({t for x in s for n in x["nodes"] for t in n.get(key) or {}})
    return {t: sum(sum((n.get(key) or {}).get(t, 0) for n in x["nodes"]) for x in s) / max(1, len(s)) for t in tenants}


def trace_table(runs: dict[str, dict]) -> list[str]:
    """`runs`: "on" (required) and "off" (optional) of one trace."""
    on, off = runs["on"], runs.get("off")
    rows = ["| prefix cache | requests ok | hit rate | ideal | TTFT p50 ms | TTFT p99 ms | KV MiB sent | KV MiB left out |",
            "|---|---|---|---|---|---|---|---|"]
    for lab, r in runs.items():
        s = r["summary"]
        sent, kept = _kv_bytes(r, "received"), _kv_bytes(r, "cached")
        rows.append(f"| {lab} | {s['overall']['count'] - s['overall']['failed']} | {_f(s.get('prefix_hit_rate'), 3)} | "
                    f"{_f(s.get('prefix_hit_rate_ideal'), 3)} | {_f(s['overall']['ttft_ms']['p50'])} | "
                    f"{_f(s['overall']['ttft_ms']['p99'])} | {_f(sent and sent / 2**20)} | {_f(kept and kept / 2**20)} |")
    rows.append("")
    so = on["summary"]
    hit, ideal = so.get("prefix_hit_rate"), so.get("prefix_hit_rate_ideal")
    if hit is not None and ideal is not None:
        rows.append(f"- achieved hit rate {hit:.3f} (prompt tokens the prefill node did not compute) against the "
                    f"trace's ideal {ideal:.3f}: {100 * (ideal - hit):.1f} points short")
    if off is not None:
        t_on, t_off = so["overall"]["ttft_ms"]["p50"], off["summary"]["overall"]["ttft_ms"]["p50"]
        if t_on and t_off:
            rows.append(f"- TTFT p50, cache off / on: **{t_off / t_on:.2f}x**")
        b_on, b_off, kept = _kv_bytes(on, "received"), _kv_bytes(off, "received"), _kv_bytes(on, "cached")
        if b_on is not None and b_off:
            rows.append(f"- KV bytes sent, on / off: {b_on / b_off:.3f} (they fell by {1 - b_on / b_off:.3f}; "
                        f"the decode node had {_f(kept / (kept + b_on) if kept is not None and kept + b_on else None, 3)} "
                        "of the hand-off bytes cached: whole pages only, and a prompt's last page is always sent)")
    return rows


def route_table(load: dict, cache: dict) -> list[str]:
    opts = load["meta"].get("options", {})
    rows = [f"{opts.get('num_tenants', '?')} tenants, each with its own {opts.get('system_prompt_tokens', '?')}-token "
            "system prompt and a few requests, over 2 prefill nodes and 1 decode node; the hit rate is the prefill "
            "nodes' (prompt tokens not computed).", "",
            "| --route | requests ok | prefix hit rate | ideal | TTFT p50 ms |", "|---|---|---|---|---|"]
    for lab, r in (("load", load), ("cache", cache)):
        s = r["summary"]
        rows.append(f"| {lab} | {s['overall']['count'] - s['overall']['failed']} | {_f(s.get('prefix_hit_rate'), 3)} | "
                    f"{_f(s.get('prefix_hit_rate_ideal'), 3)} | {_f(s['overall']['ttft_ms']['p50'])} |")
    return rows


def charge_table(runs: dict[str, dict]) -> list[str]:
    rows = ["Per tenant, the mean over the run's /cluster samples of device pages held, of those held together "
            "with another request, and of what the rule charged against its quota.", "",
            "| --charge-shared | tenant | pages held (mean) | shared (mean) | charged (mean) | TTFT p99 ms |",
            "|---|---|---|---|---|---|"]
    for rule, r in runs.items():
        held, shared = _tenant_mean(r, "tenant_pages"), _tenant_mean(r, "tenant_pages_shared")
        charged = _tenant_mean(r, "tenant_pages_charged")
        for t in sorted(held):
            p99 = (r["summary"]["per_tenant"].get(t) or {}).get("ttft_ms", {}).get("p99")
            rows.append(f"| {rule} | {t} | {_f(held.get(t))} | {_f(shared.get(t))} | {_f(charged.get(t))} | {_f(p99)} |")
    rows += ["", "| --charge-shared | minnow TTFT p99 ms | whale TTFT p99 ms | fair-share index (mean) | minnow SLO attainment |",
             "|---|---|---|---|---|"]
    for rule, r in runs.items():
        s = r["summary"]
        m, w = s["per_class"].get("minnow") or {}, s["per_class"].get("whale") or {}
        rows.append(f"| {rule} | {_f((m.get('ttft_ms') or {}).get('p99'))} | {_f((w.get('ttft_ms') or {}).get('p99'))} | "
                    f"{_f(s['fairness'].get('share_jain_mean'), 3)} | {_f(m.get('slo_attainment'), 3)} |")
    return rows


TRACES = (("trace", "Trace replay, 1P+1D: Mooncake synthetic excerpt (multi-turn sharing)"),
          ("conversation", "Trace replay, 1P+1D: Mooncake conversation excerpt (production sharing)"))


def report(d: Path) -> list[str]:
    out: list[str] = []
    for name, title in TRACES:
        runs = {c: x for c in ("on", "off") if (x := _load(d, f"{name}-{c}"))}
        if "on" in runs:
            out += [f"### {title}", "", *trace_table(runs), ""]
    load, cache = _load(d, "route-load"), _load(d, "route-cache")
    if load and cache:
        out += ["### Cache-aware routing (2 prefill nodes)", "", *route_table(load, cache), ""]
    charge = {r: x for r in ("split", "first", "full") if (x := _load(d, f"charge-{r}"))}
    if charge:
        out += ["### Charging shared pages (colocated memfair, one system prompt for every tenant)", "",
                *charge_table(charge), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.figures.prefix_report", description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--out", default=None, help="write the tables here as markdown")
    a = ap.parse_args(argv)
    lines = report(Path(a.dir))
    if not lines:
        print(f"no prefix results in {a.dir}")
        return 1
    print_markdown(lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
