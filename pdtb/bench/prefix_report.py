"""`python -m pdtb.bench.prefix_report DIR`: the prefix-caching figures of scripts/prefix_results.sh.

Reads DIR/trace-{on,off}.json, DIR/route-{load,cache}.json and DIR/charge-{split,first,full}.json
(whichever exist), prints one table per experiment and writes them as markdown (--out).
Every ratio is between runs of the same invocation, on the same machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _bytes(res: dict, key: str) -> int | None:
    """Increase of a prefill counter (summed over prefill nodes) from the first sample to the last."""
    s = res.get("samples") or []
    if len(s) < 2:
        return None
    tot = [sum(n.get(key) or 0 for n in x["nodes"] if n["role"] == "prefill") for x in (s[0], s[-1])]
    return tot[1] - tot[0]


def _tenant_mean(res: dict, key: str) -> dict[str, float]:
    """Mean over samples of a per-tenant node figure, summed over nodes."""
    s = res.get("samples") or []
    tenants = sorted({t for x in s for n in x["nodes"] for t in n.get(key) or {}})
    return {t: sum(sum((n.get(key) or {}).get(t, 0) for n in x["nodes"]) for x in s) / max(1, len(s)) for t in tenants}


def trace_table(on: dict, off: dict) -> list[str]:
    so, sf = on["summary"], off["summary"]
    t_on, t_off = so["overall"]["ttft_ms"]["p50"], sf["overall"]["ttft_ms"]["p50"]
    b_on, b_off = _bytes(on, "kv_bytes_sent"), _bytes(off, "kv_bytes_sent")
    ns = _bytes(on, "kv_bytes_not_sent")
    hit, ideal = so.get("prefix_hit_rate"), so.get("prefix_hit_rate_ideal")
    rows = ["| prefix cache | requests ok | hit rate | ideal | TTFT p50 ms | TTFT p99 ms | KV bytes sent |",
            "|---|---|---|---|---|---|---|"]
    for lab, r, b in (("on", on, b_on), ("off", off, b_off)):
        s = r["summary"]
        rows.append(f"| {lab} | {s['overall']['count'] - s['overall']['failed']} | {_f(s.get('prefix_hit_rate'), 3)} | "
                    f"{_f(s.get('prefix_hit_rate_ideal'), 3)} | {_f(s['overall']['ttft_ms']['p50'])} | "
                    f"{_f(s['overall']['ttft_ms']['p99'])} | {b if b is not None else '-'} |")
    rows.append("")
    if hit is not None and ideal is not None:
        rows.append(f"- achieved hit rate {hit:.3f} against the trace's ideal {ideal:.3f}: "
                    f"{100 * (ideal - hit):+.1f} points short")
    if t_on and t_off:
        rows.append(f"- TTFT p50 with the cache off / on: {t_off / t_on:.2f}x")
    if b_on is not None and b_off:
        sent_share = b_on / b_off
        rows.append(f"- KV bytes sent, on / off: {sent_share:.3f} (fell by {1 - sent_share:.3f}); "
                    f"bytes left out / all hand-off bytes: {_f(ns / (ns + b_on) if ns is not None and ns + b_on else None, 3)}")
    return rows


def route_table(load: dict, cache: dict) -> list[str]:
    rows = ["| --route | requests ok | prefix hit rate | ideal | TTFT p50 ms |", "|---|---|---|---|---|"]
    for lab, r in (("load", load), ("cache", cache)):
        s = r["summary"]
        rows.append(f"| {lab} | {s['overall']['count'] - s['overall']['failed']} | {_f(s.get('prefix_hit_rate'), 3)} | "
                    f"{_f(s.get('prefix_hit_rate_ideal'), 3)} | {_f(s['overall']['ttft_ms']['p50'])} |")
    return rows


def charge_table(runs: dict[str, dict]) -> list[str]:
    rows = ["| --charge-shared | tenant | pages held (mean) | shared (mean) | charged (mean) | TTFT p99 ms |",
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


def report(d: Path) -> list[str]:
    out: list[str] = []
    on, off = _load(d, "trace-on"), _load(d, "trace-off")
    if on and off:
        out += ["### Trace replay with shared prefixes (1P+1D, Mooncake excerpt)", "", *trace_table(on, off), ""]
    load, cache = _load(d, "route-load"), _load(d, "route-cache")
    if load and cache:
        out += ["### Cache-aware routing (2 prefill nodes)", "", *route_table(load, cache), ""]
    charge = {r: x for r in ("split", "first", "full") if (x := _load(d, f"charge-{r}"))}
    if charge:
        out += ["### Charging shared pages (colocated memfair, one system prompt for every tenant)", "",
                *charge_table(charge), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.bench.prefix_report", description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--out", default=None, help="write the tables here as markdown")
    a = ap.parse_args(argv)
    lines = report(Path(a.dir))
    if not lines:
        print(f"no prefix results in {a.dir}")
        return 1
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
