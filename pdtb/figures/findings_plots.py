"""The plots of docs/findings.md (matplotlib, Agg backend), each drawn from results files and
written as a small PNG: who holds the KV pool over time, the decode pool's inherited pages
against its shares, the TTFT distributions, every policy on the fairness-throughput plane, the
quota variants beside fcfs, and the essay's claims across load."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from pdtb.figures.results import records_of  # noqa: E402
from pdtb.figures.summary import ttft_s  # noqa: E402

DPI = 72  # small files: the plots are read on a page, not printed
SERVING = ("colocated", "decode")  # the pools a request decodes from (a prefill node's pages pass through)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def share_series(doc: dict, roles: tuple[str, ...] = SERVING) -> tuple[list[float], dict[str, list[float]]]:
    """Sample times and each tenant's share (0-1) of the device pages of the nodes of `roles`."""
    times, shares = [], {}
    samples = doc.get("samples") or []
    tenants = sorted({t for s in samples for n in s["nodes"] if n.get("role") in roles for t in n["tenant_pages"]})
    for s in samples:
        nodes = [n for n in s["nodes"] if n.get("role") in roles and not n.get("stale")]
        total = sum(n.get("pages_total") or 0 for n in nodes)
        if not total:
            continue
        times.append(s["t"])
        for t in tenants:
            shares.setdefault(t, []).append(sum(n["tenant_pages"].get(t, 0) for n in nodes) / total)
    return times, shares


def kv_share(panels: dict[str, dict], path: Path, cols: int = 2) -> Path:
    """One panel per run ({title: results}): each tenant's share of the serving pool's device pages,
    stacked, over the run."""
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for ax, (title, doc) in zip(axes.flat, panels.items()):
        times, shares = share_series(doc)
        if times:
            ax.stackplot(times, *shares.values(), labels=list(shares), alpha=0.85)
        ax.set(title=title, xlabel="s since start", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("share of device KV")
    if axes.flat[0].get_legend_handles_labels()[0]:
        axes.flat[0].legend(loc="upper left", fontsize="x-small", ncol=3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    return _save(fig, path)


def decode_quota(panels: dict[str, dict], path: Path) -> Path:
    """One panel per disaggregated run: each tenant's device pages on the decode nodes (solid)
    against its share as the decode node's policy states it (dashed), and the pool's size."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 2.8), squeeze=False, sharey=True)
    for ax, (title, doc) in zip(axes[0], panels.items()):
        samples = [s for s in doc.get("samples") or [] if any(n.get("role") == "decode" for n in s["nodes"])]
        times = [s["t"] for s in samples]
        dec = [[n for n in s["nodes"] if n.get("role") == "decode" and not n.get("stale")] for s in samples]
        tenants = sorted({t for nodes in dec for n in nodes for t in n["tenant_pages"]})
        for i, t in enumerate(tenants):
            color = f"C{i}"
            ax.plot(times, [sum(n["tenant_pages"].get(t, 0) for n in nodes) for nodes in dec], color=color, label=t)
            quota = [sum((n.get("quota") or {}).get(t, 0) for n in nodes) for nodes in dec]
            if any(quota):
                ax.plot(times, quota, color=color, linestyle="--", label=f"{t}'s share")
        if dec:
            ax.plot(times, [sum(n.get("pages_total") or 0 for n in nodes) for nodes in dec], color="grey",
                    linestyle=":", label="pool")
        ax.set(title=title, xlabel="s since start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    axes[0][0].set_ylabel("decode device pages")
    return _save(fig, path)


def ttft_cdfs(runs: dict[str, dict], path: Path, classes: tuple[str, ...] = ("minnow", "whale")) -> Path:
    """TTFT CDFs on a log axis, one panel per class, one line per run ({label: results})."""
    fig, axes = plt.subplots(1, len(classes), figsize=(4.4 * len(classes), 2.8), squeeze=False)
    for ax, klass in zip(axes[0], classes):
        for i, (label, doc) in enumerate(runs.items()):
            ms = sorted(ttft_s(r) * 1000 for r in records_of(doc)
                        if r.klass == klass and r.status == "ok" and ttft_s(r) is not None)
            if ms:
                ax.step([ms[0]] + ms, [0.0] + [(k + 1) / len(ms) for k in range(len(ms))], where="post",
                        label=label, color=f"C{i // 2}", linestyle="-" if i % 2 else "--")
        ax.set(title=f"TTFT, {klass}s", xlabel="ms (log)", ylabel="fraction of requests", xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def policy_plane(cards: list[dict], path: Path, cols: int = 3) -> Path:
    """Every policy of every run scenario on the fairness-throughput plane: output tok/s against
    minnow TTFT p99, both as ratios to fcfs of the same scenario; filled: on the Pareto front."""
    cards = [c for c in cards if c["kind"] == "run" and any(r["label"] == "fcfs" for r in c["rows"])]
    rows = max(1, (len(cards) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, card in zip(axes.flat, cards):
        for r in card["rows"]:
            x, y = r["ratio"].get("out_tok_s"), r["ratio"].get("minnow_ttft_p99")
            if x is None or y is None:
                continue
            ax.scatter([x], [y], marker="o", s=28, facecolors=None if r["pareto"] else "none",
                       edgecolors="C0", color="C0" if r["pareto"] else None)
            ax.annotate(r["label"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.axvline(1.0, color="grey", lw=0.6)
        ax.set(title=card["name"], yscale="log", xlabel="output tok/s, x fcfs", ylabel="minnow TTFT p99, x fcfs")
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cards):]:
        ax.axis("off")
    return _save(fig, path)


def variant_bars(groups: dict[str, dict[str, dict]], path: Path, keys: dict[str, str]) -> Path:
    """One panel per group ({group: {variant: {key: ratio to fcfs}}}): a bar per variant and figure."""
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 2.9), squeeze=False)
    for ax, (title, variants) in zip(axes[0], groups.items()):
        names = list(variants)
        width = 0.8 / max(len(keys), 1)
        for j, (k, label) in enumerate(keys.items()):
            ys = [variants[n].get(k) or 0.0 for n in names]
            ax.bar([i + j * width for i in range(len(names))], ys, width, label=label)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(names))], names, rotation=25,
                      fontsize=7, ha="right")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set(title=title, ylabel="x fcfs", yscale="log")
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def claims_by_load(points: list[dict], path: Path) -> Path:
    """The essay's claims across the minnows' load (pdtb sim reproduce essay at several rates):
    minnow evictions per request with and without whales, and the top 5%'s share of HBM."""
    xs = [p["rate"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(8.8, 2.8), squeeze=False)
    ax = axes[0][0]
    for i, pol in enumerate(("fcfs", "memfair")):
        ax.plot(xs, [p["evictions"][pol]["with_whales"] for p in points], marker="o", color=f"C{i}",
                label=f"{pol}, with whales")
        ax.plot(xs, [p["evictions"][pol]["alone"] for p in points], marker="x", color=f"C{i}", linestyle="--",
                label=f"{pol}, minnows alone")
    ax.set(title="minnow evictions per minnow", xlabel="minnows/s", ylabel="evictions per request", yscale="symlog")
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
    ax = axes[0][1]
    ax.plot(xs, [100 * p["top5"]["pool_mean"] for p in points], marker="o", label="top 5%, share of HBM (mean)")
    ax.plot(xs, [100 * p["top5"]["pool_max"] for p in points], marker="^", label="... (max)")
    ax.plot(xs, [100 * p["top5"]["used_mean"] for p in points], marker="s", label="top 5%, share of KV in use")
    ax.axhline(80, color="grey", lw=0.8, linestyle=":", label="the essay's ~80%")
    ax.set(title="the largest 5% of requests in memory (fcfs)", xlabel="minnows/s", ylabel="%", ylim=(0, 100))
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
    return _save(fig, path)
