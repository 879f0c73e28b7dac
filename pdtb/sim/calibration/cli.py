"""`pdtb sim calibrate`: fit the step cost to measured steps and write a calibration file.

    pdtb sim calibrate --steps FILE [--steps FILE ...] [--step-log FILE ...] --out FILE
                       [--fit all|steps|logs] [--scale-grid] [--results FILE ...] [--page-bytes N]
                       [--node-overhead-ms X] [--b2b-ms 5] [--transfer-gb-per-s X] [--transfer-latency-us X]
                       [--tier-gb-per-s X] [--tier-latency-us X] [--label NAME] [--note TEXT] [--json]

`--steps` takes `pdtb bench steps --grid --json` output, `--step-log` a node's `--step-log` file;
each may repeat, and the samples of every file go into one fit (`--fit steps`: the --steps files'
alone, the step logs then give the node overhead and the tier rate). The node's overhead per step
comes from `--node-overhead-ms`, else the step logs (idle time between back-to-back steps), else
0. The hand-off link defaults to this CPU machine's figures, the tier link to the step logs'
demotions and promotions where they have any, else this machine's copy figure. The machine is
the --steps files' record of theirs, else this host's.
"""
from __future__ import annotations

import argparse
import json
import shlex

from pdtb.common import CliError
from pdtb.sim.calibration.fit import TERMS, fit, scaled_to
from pdtb.sim.calibration.path import fit_path
from pdtb.sim.calibration.record import CPU_TIER, CPU_TRANSFER, SOURCE_KEYS, Calibration
from pdtb.sim.calibration.samples import SampleError, node_overhead_s, read_samples, read_step_log, step_log_role, \
    tier_link
from pdtb.sim.cost import LinkModel


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb sim calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", action="append", default=[], help="pdtb bench steps --grid --json output (repeatable)")
    ap.add_argument("--step-log", action="append", default=[], help="a node's --step-log file (repeatable)")
    ap.add_argument("--out", help="calibration file to write")
    ap.add_argument("--fit", choices=["all", "steps", "logs"], default="all", help="which files' samples the fit takes")
    ap.add_argument("--scale-grid", action="store_true",
                    help="with --fit all: the --steps files' samples scaled to the step logs' level first (the "
                         "median logged step over what the grid alone fits for it): a host's speed drifts")
    ap.add_argument("--results", action="append", default=[],
                    help="a real run's results file (repeatable): the request path's latencies are fitted to its "
                         "requests' stamps (pdtb/sim/calibration/path.py), the hand-off's latency too unless given")
    ap.add_argument("--note", help="free text kept in the file (how its inputs were made)")
    ap.add_argument("--page-bytes", type=int, help="KV bytes of one page (default: from the --steps files)")
    ap.add_argument("--node-overhead-ms", type=float, help="the node's own work per step (default: step logs, else 0)")
    ap.add_argument("--b2b-ms", type=float, default=5.0, help="idle gap under which logged steps ran back to back")
    ap.add_argument("--transfer-gb-per-s", type=float, help=f"hand-off link (default {CPU_TRANSFER.bytes_per_s / 1e9:g})")
    ap.add_argument("--transfer-latency-us", type=float, help=f"(default {CPU_TRANSFER.latency_s * 1e6:g})")
    ap.add_argument("--tier-gb-per-s", type=float, help=f"tier-move link (default: step logs, else {CPU_TIER.bytes_per_s / 1e9:g})")
    ap.add_argument("--tier-latency-us", type=float, help=f"(default {CPU_TIER.latency_s * 1e6:g})")
    ap.add_argument("--label", help="name of the calibration (default: --out's file name)")
    ap.add_argument("--json", action="store_true", help="print the calibration as JSON")
    a = ap.parse_args(argv)
    if not (a.steps or a.step_log):
        ap.error("give --steps and/or --step-log files")
    if (a.fit == "steps" and not a.steps) or (a.fit == "logs" and not a.step_log):
        ap.error(f"--fit {a.fit} needs --{'steps' if a.fit == 'steps' else 'step-log'} files")
    if a.scale_grid and not (a.fit == "all" and a.steps and a.step_log):
        ap.error("--scale-grid: takes --fit all with --steps and --step-log files")
    positive = [v for v in (a.page_bytes, a.transfer_gb_per_s, a.tier_gb_per_s, a.b2b_ms) if v is not None]
    non_negative = [v for v in (a.node_overhead_ms, a.transfer_latency_us, a.tier_latency_us) if v is not None]
    if any(v <= 0 for v in positive) or any(v < 0 for v in non_negative):
        ap.error("sizes and rates must be positive, overheads and latencies non-negative")
    return a


def _link(gb_per_s: float | None, latency_us: float | None, default: LinkModel) -> LinkModel:
    return LinkModel(default.bytes_per_s if gb_per_s is None else gb_per_s * 1e9,
                     default.latency_s if latency_us is None else latency_us * 1e-6)


def _page_bytes(a: argparse.Namespace, headers: list[dict]) -> int:
    if a.page_bytes:
        return a.page_bytes
    seen = {h.get("page_bytes") for h in headers} - {None}
    if len(seen) > 1:
        raise CliError(f"the --steps files measured different page sizes ({sorted(seen)} bytes): calibrate them apart")
    if not seen:
        raise CliError("give --page-bytes: step logs do not record the KV bytes of a page")
    return int(seen.pop())


def _command(argv: list[str], sources: list[dict]) -> str:
    """The shell line that makes this calibration again: the benches that wrote the inputs (as
    recorded in them), then this command without its note (the file keeps that apart)."""
    made = [f"{s['command']} > {shlex.quote(s['file'])}" for s in sources if s.get("command")]
    drop = {i for i, x in enumerate(argv) if x == "--note"} | {i + 1 for i, x in enumerate(argv) if x == "--note"}
    own = [x for i, x in enumerate(argv) if i not in drop and not x.startswith("--note=")]
    return " && ".join(made + ["pdtb sim calibrate " + shlex.join(own)])


def _results(files: list[str]) -> list[dict]:
    docs = []
    for path in files:
        try:
            docs.append(json.loads(open(path).read()))
        except (OSError, ValueError) as e:
            raise CliError(f"--results {path}: {e}") from None
    return docs


def build(a: argparse.Namespace, argv: list[str]) -> tuple[Calibration, object]:
    """The calibration the arguments ask for, and its fit."""
    grid, logged, headers, sources, gaps, moves, spans = [], [], [], [], [], [], []
    for path in a.steps:
        samples, head = read_samples(path)
        grid += samples if a.fit != "logs" else []
        headers.append(head)
        sources.append({"file": path, "kind": "step-samples", "samples": len(samples), "fitted": a.fit != "logs",
                        **{k: head[k] for k in ("device", "model", "threads", "dtype", "command") if k in head}})
    for path in a.step_log:
        log = read_step_log(path, a.b2b_ms)
        logged += log.samples if a.fit != "steps" else []
        gaps, moves = gaps + log.gaps_s, moves + log.moves
        spans += log.spans if step_log_role(path) == "decode" else []  # (hand-offs land on decode nodes)
        sources.append({"file": path, "kind": "step-log", "samples": len(log.samples),
                        "b2b_gaps": len(log.gaps_s), "fitted": a.fit != "steps"})
    if a.scale_grid:
        grid, k = scaled_to(grid, logged)
        for src in (x for x in sources if x["kind"] == "step-samples"):
            src["scaled"] = round(k, 6)
    f = fit(grid + logged)
    page_bytes = _page_bytes(a, headers)
    transfer = _link(a.transfer_gb_per_s, a.transfer_latency_us, CPU_TRANSFER)
    path = None
    if a.results:
        if (path := fit_path(_results(a.results), transfer.bytes_per_s, spans)) is None:
            raise CliError("--results: too few finished requests with the nodes' stamps to fit the request path")
        path["files"] = a.results
        if "transfer_latency_s" in path and a.transfer_latency_us is None:
            transfer = LinkModel(transfer.bytes_per_s, path["transfer_latency_s"])
    head = headers[0] if headers else {}
    if not (machine := head.get("machine")):
        from pdtb.common import host_facts

        machine = {"accelerator": None, **host_facts(), "recorded_by": "pdtb sim calibrate (the step logs' host)"}
    overhead = a.node_overhead_ms / 1e3 if a.node_overhead_ms is not None else (node_overhead_s(gaps) or 0.0)
    source = {"command": _command(argv, sources), **({"note": a.note} if a.note else {}),
              **{k: head[k] for k in SOURCE_KEYS[2:] if k in head}}
    label = a.label or (a.out.rsplit("/", 1)[-1].removesuffix(".json") if a.out else "calibrated")
    cal = Calibration(f.coef, page_bytes, transfer, _link(a.tier_gb_per_s, a.tier_latency_us,
                                                          tier_link(moves, page_bytes) or CPU_TIER),
                      overhead, label, machine, source,
                      {"samples": f.samples, "r2": round(f.r2, 6), "max_rel_err": round(f.max_rel_err, 6),
                       "sources": sources}, path)
    return cal, f


def report(cal: Calibration, f) -> str:
    c = cal.coef
    return "\n".join([
        f"fit of {f.samples} steps: R^2 {f.r2:.4f}, max relative error {100 * f.max_rel_err:.1f}%",
        "  step ms = " + " + ".join(f"{getattr(c, t):.4g}{'' if t == 'c0' else ' * ' + t}" for t in TERMS),
        f"  node overhead {cal.node_overhead_s * 1e3:.3f} ms/step; page {cal.page_bytes} B",
        f"  hand-off {cal.transfer.bytes_per_s / 1e9:.3g} GB/s + {cal.transfer.latency_s * 1e6:.0f} us; "
        f"tier move {cal.tier.bytes_per_s / 1e9:.3g} GB/s + {cal.tier.latency_s * 1e6:.0f} us",
        f"  {cal.describe()}"])


def main(argv: list[str]) -> int:
    a = parse(argv)
    try:
        cal, f = build(a, argv)
    except SampleError as e:
        raise CliError(str(e)) from None
    doc = cal.to_json()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    print(json.dumps(doc) if a.json else report(cal, f) + (f"\nwrote {a.out}" if a.out else ""))
    return 0
