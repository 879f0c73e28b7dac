"""`pdtb report` of sweep files: a table per sweep, attainment and goodput against load.

`pdtb report` for sweep files: a table per sweep and two plots (attainment against load, one
line per class and a panel per sweep; goodput against load, one line per sweep)."""
from __future__ import annotations

from pathlib import Path

from pdtb.figures.results import fmt, md_table

SWEEP_PLOTS = (("attainment.png", "SLO attainment against offered load, per class"),
               ("goodput.png", "goodput against offered load"))


def is_sweep(doc) -> bool:
    meta = doc.get("meta") if isinstance(doc, dict) else None
    return isinstance(meta, dict) and meta.get("kind") == "sweep"


def label(doc: dict) -> str:
    m = doc["meta"]
    return f"{m.get('mode') or '?'}/{m.get('config') or m.get('policy') or '?'}"


def markdown(runs: dict[str, dict]) -> str:
    out = ["# pd-testbed sweep report", ""]
    for lab, doc in runs.items():
        d, classes = doc["derived"], sorted({c for lv in doc["levels"] for c in lv["per_class"]})
        unit = "in flight" if doc["meta"].get("load_kind") == "concurrency" else "x rate"
        out += [f"## {lab}", "",
                f"`{doc['meta'].get('workload')}`; warm-up {doc['meta'].get('warmup_s')} s, measured "
                f"{doc['meta'].get('span_s')} s per level; target {d['target']:.0%} ({d['knee_on']}).  ",
                f"max goodput (every class): **{fmt(d['max_goodput_every_class_rps'], 2)} req/s**; overall "
                f"{fmt(d['max_goodput_rps'], 2)}; knee {fmt(d['knee_rps'], 2)} req/s (bracket "
                f"{' - '.join(fmt(x, 2) for x in d['knee_bracket_rps'])}); saturation "
                f"{fmt(d['saturation_tok_s'], 1)} output tok/s.", ""]
        head = [f"load ({unit})", "offered req/s", "goodput req/s", "output tok/s", "failed"]
        head += [f"{c} attainment" for c in classes] + [f"{c} TTFT p99 (ms)" for c in classes]
        head += [f"{c} ITL p99 (ms)" for c in classes] + ["fair-share Jain (mean)"]
        rows = []
        for lv in doc["levels"]:
            o, pc = lv["overall"], lv["per_class"]
            rows.append([f"{lv['load']:g}", fmt(o["offered_rps"], 2), fmt(o["goodput_rps"], 2), fmt(o["output_tok_s"], 1),
                         str(o["failed"])] + [fmt(pc.get(c, {}).get("attainment"), 2) for c in classes]
                        + [fmt((pc.get(c, {}).get("ttft_ms") or {}).get("p99"), 0) for c in classes]
                        + [fmt((pc.get(c, {}).get("itl_ms") or {}).get("p99"), 1) for c in classes]
                        + [fmt(lv["fairness"].get("share_jain_mean"), 3)])
        out += md_table(head, rows)
        out.append("")
    out += ["## Plots", ""] + [f"### {title}\n\n![{title}]({name})\n" for name, title in SWEEP_PLOTS]
    return "\n".join(out) + "\n"


def plots(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    for ax, (lab, doc) in zip(flat, runs.items()):
        classes = sorted({c for lv in doc["levels"] for c in lv["per_class"]})
        for c in classes:
            pts = [(lv["overall"]["offered_rps"], lv["per_class"][c]["attainment"])
                   for lv in doc["levels"] if c in lv["per_class"] and lv["per_class"][c]["attainment"] is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=c)
        ax.axhline(doc["derived"]["target"], color="grey", lw=0.8, ls="--")
        ax.set_title(lab, fontsize=9)
        ax.set_xlabel("offered req/s (all classes)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("SLO attainment")
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for lab, doc in runs.items():
        pts = [(lv["overall"]["offered_rps"], lv["overall"]["goodput_rps"]) for lv in doc["levels"]]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=lab)
    lim = max([lv["overall"]["offered_rps"] for doc in runs.values() for lv in doc["levels"]] or [1.0])
    ax.plot([0, lim], [0, lim], color="grey", lw=0.8, ls=":", label="goodput = offered")
    ax.set_xlabel("offered req/s")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=90)
    plt.close(fig)


def write(runs: dict[str, dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plots(runs, out)
    report = out / "report.md"
    report.write_text(markdown(runs))
    return report
