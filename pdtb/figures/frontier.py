"""`pdtb frontier SWEEP.json [...] --out DIR`: the fairness-throughput frontier of sweep files.

Each sweep file is one point: a (mode, policy, settings) configuration, labelled by its
`--label-config` (else its policy). Its throughput is `derived.saturation_tok_s` (the most
output tok/s a level delivered) and `derived.max_goodput_every_class_rps` (the highest goodput
at which every class attains the target); its fairness is the protected class's (--klass,
default minnow) p99 TTFT, p99 ITL and attainment at one fixed load (--at-load, default 1: the
level of that load, else the nearest).

A point is Pareto-optimal when no other point has at least its throughput (--x: saturation,
the default, or goodput: max goodput moves in steps of the sweep's levels, so many points tie
on it) and at most its class p99 TTFT, one of them strictly better. The frontier's knee is the
Pareto point farthest from the straight line between the frontier's two ends (both axes scaled
to [0, 1]): where giving up throughput stops buying much fairness. Ratios are against the
baseline point in the same mode (--baseline, default fcfs: the point of that label). A max
goodput reached at the sweep's top level is a bound, not a measurement: it shows as ">=".
Writes DIR/frontier.md, DIR/frontier.json and DIR/frontier.png; prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdtb.figures.results import fmt, md_table
from pdtb.figures.sweep_figures import passes


def load_sweep(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if (doc.get("meta") or {}).get("kind") != "sweep" or "levels" not in doc:
        raise ValueError(f"{path}: not a sweep file (pdtb bench sweep --out)")
    return doc


def _at(levels: list[dict], load: float) -> dict | None:
    return min(levels, key=lambda lv: (abs(lv["load"] - load), lv["load"])) if levels else None


def point(doc: dict, klass: str, at_load: float) -> dict:
    """One configuration's figures."""
    meta, d = doc["meta"], doc["derived"]
    lv = _at(doc["levels"], at_load)
    g = (lv or {}).get("per_class", {}).get(klass) or {}
    return {"label": meta.get("config") or meta.get("policy") or "?", "mode": meta.get("mode") or "?",
            "policy": meta.get("policy") or "?",
            "max_goodput_rps": d["max_goodput_every_class_rps"], "saturation_tok_s": d["saturation_tok_s"],
            "saturation_total_tok_s": d.get("saturation_total_tok_s"),
            "knee_rps": d["knee_rps"], "at_load": lv["load"] if lv else None,
            "ttft_p99_ms": (g.get("ttft_ms") or {}).get("p99"), "itl_p99_ms": (g.get("itl_ms") or {}).get("p99"),
            "attainment": g.get("attainment"), "goodput_at_top": _goodput_at_top(doc)}


def _goodput_at_top(doc: dict) -> bool:
    """Whether the sweep's highest level still attained the target for every class (so the max
    goodput is a lower bound: the knee lies above the grid)."""
    levels, d = doc.get("levels") or [], doc["derived"]
    return bool(levels) and passes(max(levels, key=lambda lv: lv["load"]), d.get("target", 0.9), "every-class")


X_KEYS = {"saturation": "saturation_tok_s", "goodput": "max_goodput_rps"}


def pareto(points: list[dict], x: str = "max_goodput_rps") -> list[bool]:
    """Per point: no other has >= throughput `x` and <= class p99 TTFT, one strictly."""
    def y(p):
        return float("inf") if p["ttft_p99_ms"] is None else p["ttft_p99_ms"]

    def t(p):
        return float("-inf") if p[x] is None else p[x]
    return [not any(q is not p and t(q) >= t(p) and y(q) <= y(p) and (t(q) > t(p) or y(q) < y(p)) for q in points)
            for p in points]


def frontier_knee(points: list[dict], on_front: list[bool], x: str = "max_goodput_rps") -> int | None:
    """Index of the Pareto point farthest from the chord between the frontier's ends."""
    front = [i for i, ok in enumerate(on_front) if ok and points[i]["ttft_p99_ms"] is not None and points[i][x] is not None]
    if len(front) < 3:
        return None
    xs = [points[i][x] for i in front]
    ys = [points[i]["ttft_p99_ms"] for i in front]
    sx, sy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    pts = sorted(((x - min(xs)) / sx, (y - min(ys)) / sy, i) for x, y, i in zip(xs, ys, front))
    (x0, y0, _), (x1, y1, _) = pts[0], pts[-1]
    norm = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5 or 1.0
    dist = [(abs((y1 - y0) * x - (x1 - x0) * y + x1 * y0 - y1 * x0) / norm, i) for x, y, i in pts[1:-1]]
    return max(dist)[1] if dist else None


def ratio_text(v, base) -> str:
    if v is None or base is None:
        return "-"
    if base == 0:
        return "-" if v == 0 else "inf (fcfs 0)"
    return f"{v / base:.2f}"


def table(points: list[dict], on_front: list[bool], knee: int | None, klass: str, baseline: str = "fcfs") -> list[str]:
    base = {p["mode"]: p for p in points
            if p["label"] == baseline or (p["policy"] == baseline and p["label"] == p["policy"])}
    xb = f"x {baseline}"
    head = ["mode", "point", "max goodput, every class >= target (req/s)", xb, "saturation out tok/s", xb,
            "saturation total tok/s", xb, "knee (req/s)", f"{klass} TTFT p99 (ms)", f"{klass} ITL p99 (ms)",
            f"{klass} attainment", "Pareto"]
    rows = []
    order = sorted(range(len(points)), key=lambda i: (points[i]["mode"], -points[i]["max_goodput_rps"], points[i]["label"]))
    for i in order:
        p, b = points[i], base.get(points[i]["mode"])
        mark = ("**knee**" if i == knee else "yes") if on_front[i] else ""
        top = ">= " if p.get("goodput_at_top") else ""
        rows.append([p["mode"], p["label"], top + fmt(p["max_goodput_rps"], 2),
                     ratio_text(p["max_goodput_rps"], b and b["max_goodput_rps"]), fmt(p["saturation_tok_s"], 1),
                     ratio_text(p["saturation_tok_s"], b and b["saturation_tok_s"]),
                     fmt(p["saturation_total_tok_s"], 0),
                     ratio_text(p["saturation_total_tok_s"], b and b["saturation_total_tok_s"]), fmt(p["knee_rps"], 2),
                     fmt(p["ttft_p99_ms"], 0), fmt(p["itl_p99_ms"], 1), fmt(p["attainment"], 2), mark])
    return md_table(head, rows)


def plot(points: list[dict], on_front: list[bool], knee: int | None, path: Path, klass: str,
         x: str = "saturation_tok_s") -> Path:
    """Left: the frontier (throughput `x` against the class's p99 TTFT, Pareto points filled and
    joined, the knee named). Right: the same latency against the other throughput figure.
    Points at the same place share one label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    marker = {"colocated": "o", "disagg": "s"}
    other = "max_goodput_rps" if x == "saturation_tok_s" else "saturation_tok_s"
    for ax, xkey, is_front in ((axes[0], x, True), (axes[1], other, False)):
        spots: dict[tuple, list[str]] = {}
        for i, p in enumerate(points):
            if p[xkey] is None or p["ttft_p99_ms"] is None:
                continue
            filled = is_front and on_front[i]
            ax.scatter(p[xkey], p["ttft_p99_ms"], marker=marker.get(p["mode"], "^"),
                       facecolors="C3" if filled else "none", edgecolors="C3" if filled else "C0", s=46)
            name = f"{p['label']}/{p['mode'][:4]}" + (" (knee)" if is_front and i == knee else "")
            spots.setdefault((round(p[xkey], 2), round(p["ttft_p99_ms"], 1)), []).append(name)
        for (px, py), names in spots.items():
            ax.annotate(", ".join(names), (px, py), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if is_front:
            front = sorted((p[xkey], p["ttft_p99_ms"]) for i, p in enumerate(points)
                           if on_front[i] and p[xkey] is not None and p["ttft_p99_ms"] is not None)
            if front:
                ax.plot([a for a, _ in front], [b for _, b in front], color="C3", lw=1, alpha=0.6)
        ax.set_yscale("log")
        ax.set_xlabel({"max_goodput_rps": "max goodput, every class >= target (req/s)",
                       "saturation_tok_s": "saturation output tok/s"}[xkey])
        ax.set_ylabel(f"{klass} TTFT p99 (ms), log")
        ax.grid(alpha=0.3)
    at = sorted({p["at_load"] for p in points if p["at_load"] is not None})
    fig.suptitle(f"fairness-throughput frontier ({klass} at load {', '.join(f'{v:g}' for v in at)}; "
                 "left: Pareto-optimal filled and joined; o colocated, s disagg)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb frontier", description="The fairness-throughput frontier of sweeps.")
    ap.add_argument("sweeps", nargs="+", help="sweep files (pdtb bench sweep --out)")
    ap.add_argument("--out", required=True, help="directory for frontier.md, frontier.json, frontier.png")
    ap.add_argument("--klass", default="minnow", help="the class whose latency is the fairness axis")
    ap.add_argument("--at-load", type=float, default=1.0, help="the load level its latency is read at")
    ap.add_argument("--x", choices=sorted(X_KEYS), default="saturation", help="the throughput axis of the frontier")
    ap.add_argument("--baseline", default="fcfs", help="the point (label, or policy) the ratios are against")
    a = ap.parse_args(argv)
    try:
        docs = [load_sweep(p) for p in a.sweeps]
    except (OSError, ValueError) as e:
        print(f"pdtb frontier: {e}", file=sys.stderr)
        return 2
    points = [point(d, a.klass, a.at_load) for d in docs]
    x = X_KEYS[a.x]
    on_front = pareto(points, x)
    knee = frontier_knee(points, on_front, x)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = table(points, on_front, knee, a.klass, a.baseline)
    plot(points, on_front, knee, out / "frontier.png", a.klass, x)
    (out / "frontier.json").write_text(json.dumps({"points": points, "pareto": on_front, "knee": knee, "x": x},
                                                  indent=1) + "\n")
    (out / "frontier.md").write_text("# Fairness-throughput frontier\n\n" + "\n".join(lines)
                                     + "\n\n![frontier](frontier.png)\n")
    print("\n".join(lines))
    return 0
