"""PNG plots of one or more runs (matplotlib, Agg backend). Every function takes `runs`:
{label: results dict} in display order and writes one file."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from pdtb.figures.results import records_of  # noqa: E402
from pdtb.figures.samples import tenant_pages_series, used_pages_series  # noqa: E402
from pdtb.figures.service import ServiceWeights, service_curves  # noqa: E402
from pdtb.figures.summary import itls_s, ttft_s  # noqa: E402


def _classes(runs: dict) -> list[str]:
    return sorted({c for res in runs.values() for c in res["summary"]["per_class"]})


def _grid(n: int, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width * max(n, 1), height), squeeze=False)
    return fig, list(axes[0])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def latency_cdfs(runs: dict, path: Path, which: str) -> Path:
    """CDF of TTFT (`which`="ttft") or ITL ("itl") in ms, one panel per class, one line per run."""
    classes = _classes(runs)
    fig, axes = _grid(len(classes))
    for ax, klass in zip(axes, classes):
        for label, res in runs.items():
            ok = [r for r in records_of(res) if r.klass == klass and r.status == "ok"]
            if which == "ttft":
                values = [ttft_s(r) * 1000 for r in ok if ttft_s(r) is not None]
            else:
                values = [g * 1000 for r in ok for g in itls_s(r)]
            if values:  # a step from 0 to 1, so that even a single sample shows
                values.sort()
                ax.step([values[0]] + values, [0.0] + [(i + 1) / len(values) for i in range(len(values))],
                        where="post", label=label)
        ax.set(title=f"{which.upper()} CDF: {klass}", xlabel="ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def service_over_time(runs: dict, path: Path) -> Path:
    """Accumulated service per tenant over time, one panel per run."""
    fig, axes = _grid(len(runs))
    for ax, (label, res) in zip(axes, runs.items()):
        fair = res["summary"].get("fairness", {})
        w = ServiceWeights(**fair.get("weights", {}))
        for tenant, (times, acc) in sorted(service_curves(records_of(res), w).items()):
            if times:
                ax.step([0.0] + times, [0.0] + acc, where="post", label=tenant)
        ax.set(title=f"accumulated service: {label}", xlabel="s since start", ylabel=f"service (in x{w.input}, out x{w.output})")
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def kv_pages_over_time(runs: dict, path: Path) -> Path:
    """KV pages held per tenant over time (summed over nodes), or pages in use per node role when
    no node reports per-tenant pages; one panel per run."""
    fig, axes = _grid(len(runs))
    for ax, (label, res) in zip(axes, runs.items()):
        samples = res.get("samples") or []
        series, what = tenant_pages_series(samples), "per tenant"
        if not series:
            series, what = used_pages_series(samples), "in use per role"
        for name, (times, pages) in series.items():
            ax.plot(times, pages, label=name)
        ax.set(title=f"KV pages {what}: {label}", xlabel="s since start", ylabel="pages")
        if not samples:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def p99_bars(runs: dict, path: Path) -> Path:
    """p99 TTFT and p99 ITL per class, one bar per run."""
    classes = _classes(runs)
    fig, axes = _grid(2)
    width = 0.8 / max(len(runs), 1)
    for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
        for j, (label, res) in enumerate(runs.items()):
            per_class = res["summary"]["per_class"]
            ys = [(per_class.get(c, {}).get(metric) or {}).get("p99") or 0.0 for c in classes]
            ax.bar([i + j * width for i in range(len(classes))], ys, width, label=label)
        ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(classes))], classes)
        ax.set(title=f"p99 {metric.split('_')[0].upper()} per class", ylabel="ms")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
    return _save(fig, path)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small", ncol=2 if len(ax.get_legend_handles_labels()[0]) > 8 else 1)
