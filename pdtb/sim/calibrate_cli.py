"""`pdtb sim calibrate`: fit a step-cost model to measured steps and write a calibration file.

    pdtb sim calibrate --steps FILE [--steps FILE ...] [--step-log FILE ...] --out FILE
                       [--fit all|steps|logs] [--page-bytes N] [--node-overhead-ms X] [--b2b-ms 5]
                       [--transfer-gb-per-s X] [--transfer-latency-us X] [--results FILE ...]
                       [--draw-loop-gaps] [--draw-step-spread] [--contention] [--draw-handoff]
                       [--draw-delivery] [--scale-grid]
                       [--tier-gb-per-s X] [--tier-latency-us X] [--label NAME] [--json]

`--steps` takes `pdtb bench steps --grid --json` output, `--step-log` a node's `--step-log`
file; each may repeat, and the samples of every file go into one fit (`--fit steps`: only the
--steps files', the step logs then give the node overhead and tier rate alone). The node's overhead per
step comes from `--node-overhead-ms`, else from the step logs (idle time between back-to-back
steps), else 0. The hand-off link defaults to this CPU machine's figures, the tier link to the
step logs' demotions and promotions where they have any, else this machine's copy figure.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pdtb.common import CliError
from pdtb.sim import contention
from pdtb.sim.calibrate import CPU_TIER, CPU_TRANSFER, TERMS, CalibratedCost, fit
from pdtb.sim.cost import LinkModel
from pdtb.sim.delivery import MIN_TOKENS, fit_delivery
from pdtb.sim.landing_fit import fit_landing, landing_stamps, landings_in
from pdtb.sim.path_fit import Cover
from pdtb.sim.step_samples import (SampleError, StepSample, node_overhead_s, overhead_quantiles, read_samples, read_step_log,
                                   step_log_role, step_spread, tier_link)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb sim calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", action="append", default=[], help="pdtb bench steps --grid --json output (repeatable)")
    ap.add_argument("--step-log", action="append", default=[], help="a node's --step-log file (repeatable)")
    ap.add_argument("--out", help="calibration file to write")
    ap.add_argument("--fit", choices=["all", "steps", "logs"], default="all", help="which files' samples the fit takes")
    ap.add_argument("--note", help="free text kept in the file (how its inputs were made)")
    ap.add_argument("--page-bytes", type=int, help="KV bytes of one page (default: from the --steps files)")
    ap.add_argument("--node-overhead-ms", type=float, help="the node's own work per step (default: from step logs, else 0)")
    ap.add_argument("--b2b-ms", type=float, default=5.0, help="idle gap under which logged steps ran back to back")
    ap.add_argument("--transfer-gb-per-s", type=float, help=f"hand-off link (default {CPU_TRANSFER.bytes_per_s / 1e9:g})")
    ap.add_argument("--transfer-latency-us", type=float, help=f"(default {CPU_TRANSFER.latency_s * 1e6:g})")
    ap.add_argument("--tier-gb-per-s", type=float, help=f"tier-move link (default: step logs, else {CPU_TIER.bytes_per_s / 1e9:g})")
    ap.add_argument("--tier-latency-us", type=float, help=f"(default {CPU_TIER.latency_s * 1e6:g})")
    ap.add_argument("--draw-loop-gaps", action="store_true",
                    help="the node loop's gap before each step drawn from the step logs' gaps between steps that "
                         "decoded (every level, the tail too), instead of their median after every step")
    ap.add_argument("--draw-step-spread", action="store_true",
                    help="each simulated step's time multiplied by a draw from its role's logged steps' measured / "
                         "fitted time (the step logs' file names say the role: steps-decode-0.jsonl), instead of "
                         "the fitted time alone")
    ap.add_argument("--contention", action="store_true",
                    help="each role's step stretch beside the run's other nodes' steps, fitted from step logs "
                         "of whole runs (one folder's logs are one run's nodes: pdtb/sim/contention.py); with "
                         "--draw-step-spread the spread is what the stretch leaves")
    ap.add_argument("--draw-handoff", action="store_true",
                    help="each simulated hand-off's fixed latency drawn from the --results runs' hand-offs "
                         "(first token to landing, less the decode node's steps and the bytes' time: "
                         "pdtb/sim/path_fit.py), instead of their median")
    ap.add_argument("--draw-delivery", action="store_true",
                    help="each simulated token's delay to the client drawn from the --results runs' tokens, "
                         "timed against their decode-side nodes' --step-log steps (pdtb/sim/delivery.py), "
                         "above or below the fitted latencies, instead of those alone")
    ap.add_argument("--scale-grid", action="store_true",
                    help="with --fit all: the --steps files' samples scaled to the step logs' speed before the "
                         "fit (the median logged step over what the grid alone fits for it), so a grid measured "
                         "at another time than the logged runs, on a host whose speed drifts, keeps its shape "
                         "and takes the runs' level")
    ap.add_argument("--results", action="append", default=[],
                    help="a real run's results file (repeatable): the request path's latencies are fitted to its "
                         "requests' stamps (pdtb/sim/path_fit.py), the hand-off link's latency too unless given; "
                         "with --step-log files of its runs, the decode loop's work per hand-off landed "
                         "(pdtb/sim/landing_fit.py)")
    ap.add_argument("--label", help="name of the calibration (default: --out's file name)")
    ap.add_argument("--json", action="store_true", help="print the calibration as JSON")
    a = ap.parse_args(argv)
    if not (a.steps or a.step_log):
        ap.error("give --steps and/or --step-log files")
    if (a.fit == "steps" and not a.steps) or (a.fit == "logs" and not a.step_log):
        ap.error(f"--fit {a.fit} needs --{'steps' if a.fit == 'steps' else 'step-log'} files")
    positive = [v for v in (a.page_bytes, a.transfer_gb_per_s, a.tier_gb_per_s, a.b2b_ms) if v is not None]
    non_negative = [v for v in (a.node_overhead_ms, a.transfer_latency_us, a.tier_latency_us) if v is not None]
    if any(v <= 0 for v in positive) or any(v < 0 for v in non_negative):
        ap.error("sizes and rates must be positive, overheads and latencies non-negative")
    return a


def _link(gb_per_s: float | None, latency_us: float | None, default: LinkModel) -> LinkModel:
    return LinkModel(default.bytes_per_s if gb_per_s is None else gb_per_s * 1e9,
                     default.latency_s if latency_us is None else latency_us * 1e-6)


@dataclass
class Inputs:
    """What the input files give, for one calibration."""

    samples: list = field(default_factory=list)  # the steps to fit: the --steps files' first, then the logs'
    grid: int = 0  # how many of `samples` the --steps files gave
    headers: list[dict] = field(default_factory=list)  # the --steps files' headers
    sources: list[dict] = field(default_factory=list)  # each file, as the calibration records it
    gaps: list[float] = field(default_factory=list)  # idle gaps between back-to-back steps (s)
    moves: list = field(default_factory=list)  # tier moves
    busy: list = field(default_factory=list)  # the loop's gaps between steps with work: (s, window, role)
    windows: list = field(default_factory=list)  # the decode nodes' such gaps' windows
    by_role: dict = field(default_factory=dict)  # each role's logged samples
    spans: list = field(default_factory=list)  # the decode nodes' logged steps' (start, end)
    logs: list = field(default_factory=list)  # (path, role, StepLogRead) of each --step-log, in order


def _read(a: argparse.Namespace) -> Inputs:
    got = Inputs()
    for path in a.steps:
        samples, head = read_samples(path)
        if a.fit in ("all", "steps"):
            got.samples += samples
            got.grid += len(samples)
        got.headers.append(head)
        got.sources.append({"file": path, "kind": "step-samples", "samples": len(samples), "fitted": a.fit != "logs",
                            **{k: head[k] for k in ("device", "model", "threads", "dtype", "command") if k in head}})
    for path in a.step_log:
        log = read_step_log(path, a.b2b_ms)
        got.samples += log.samples if a.fit in ("all", "logs") else []
        got.gaps += log.gaps_s
        got.moves += log.moves
        role = step_log_role(path)
        got.busy += [(g, w, role) for g, w in zip(log.busy_gaps_s, log.busy_windows)]
        if role == "decode":  # hand-offs land on decode nodes only, and wait for their steps (path_fit.py)
            got.windows += log.busy_windows
            got.spans += log.spans
        if role:
            got.by_role.setdefault(role, []).extend(log.samples)
        got.logs.append((path, role, log))
        got.sources.append({"file": path, "kind": "step-log", "samples": len(log.samples),
                            "b2b_gaps": len(log.gaps_s), "fitted": a.fit != "steps"})
    return got


def _page_bytes(a: argparse.Namespace, headers: list[dict]) -> int:
    if a.page_bytes:
        return a.page_bytes
    seen = {h.get("page_bytes") for h in headers} - {None}
    if len(seen) > 1:
        raise CliError(f"the --steps files measured different page sizes ({sorted(seen)} bytes): calibrate them apart")
    if not seen:
        raise CliError("give --page-bytes: step logs do not record the KV bytes of a page")
    return int(seen.pop())


def _command(a: argparse.Namespace, argv: list[str], sources: list[dict]) -> str:
    """The shell line that makes this calibration again: the benches that wrote the inputs
    (as recorded in them), then this command."""
    made = [f"{s['command']} > {shlex.quote(s['file'])}" for s in sources if s.get("command")]
    drop = {i for i, x in enumerate(argv) if x == "--note"} | {i + 1 for i, x in enumerate(argv) if x == "--note"}
    own = [x for i, x in enumerate(argv) if i not in drop and not x.startswith("--note=")]  # the note is kept apart
    return " && ".join(made + ["pdtb sim calibrate " + shlex.join(own)])


def build(a: argparse.Namespace, argv: list[str]) -> tuple[CalibratedCost, object]:
    """The calibration the arguments ask for, and its fit."""
    got = _read(a)
    sources, busy = got.sources, got.busy
    page_bytes = _page_bytes(a, got.headers)
    if a.scale_grid:
        _scale_grid(a, got)
    f = fit(got.samples)
    overhead = a.node_overhead_ms / 1e3 if a.node_overhead_ms is not None else (node_overhead_s(got.gaps) or 0.0)
    tier_default = tier_link(got.moves, page_bytes) or CPU_TIER
    head = got.headers[0] if got.headers else {}
    transfer = _link(a.transfer_gb_per_s, a.transfer_latency_us, CPU_TRANSFER)
    docs = _results(a.results)
    path = _path(docs, a.results, transfer.bytes_per_s, got.spans)
    handoff_q = tuple((path or {}).pop("transfer_latency_q", None) or ())  # (the file keeps them once)
    if a.draw_handoff and not handoff_q:
        raise CliError("--draw-handoff: the --results runs hold fewer than 20 hand-offs to draw from")
    if a.draw_delivery:
        _delivery(path, docs, got.logs)
    stamps = landing_stamps(docs)
    landing = fit_landing(got.windows, stamps) if stamps and got.windows else None
    if path and "transfer_latency_s" in path and a.transfer_latency_us is None:
        transfer = LinkModel(transfer.bytes_per_s, path["transfer_latency_s"])
    meta = {"command": _command(a, argv, sources), **({"note": a.note} if a.note else {}),
            **({"path": path} if path else {}), **({"landing": landing} if landing else {}),
            **{k: head[k] for k in ("device", "model", "threads", "dtype", "page_size", "machine") if k in head},
            "fit": {"samples": f.samples, "r2": round(f.r2, 6), "max_rel_err": round(f.max_rel_err, 6),
                    "sources": sources}}
    label = a.label or (a.out.rsplit("/", 1)[-1].removesuffix(".json") if a.out else "calibrated")
    if landing:  # a landing's work is land_s's: the drawn gaps leave out the decode gaps holding one
        busy = [(g, w, r) for g, w, r in busy if r != "decode" or not landings_in(w, stamps)]
    busy_s = [g for g, _, _ in busy]
    levels = tuple(overhead_quantiles(busy_s) or ()) if a.draw_loop_gaps and a.node_overhead_ms is None else ()
    contention, stretch, us = _contention(a, got.logs, f) if a.contention else ({}, None, None)
    cost = CalibratedCost(f.coef, page_bytes, transfer,
                          _link(a.tier_gb_per_s, a.tier_latency_us, tier_default), overhead, label, meta, levels,
                          landing["land_s"] if landing else 0.0,
                          _step_spread(a, got.by_role, f, stretch, us), handoff_q if a.draw_handoff else (), contention)
    return cost, f


def _scale_grid(a: argparse.Namespace, got: Inputs) -> None:
    """The grid's samples in `got.samples` times the step logs' median ratio to the grid's own
    fit (recorded with the grid's sources as `scaled`)."""
    grid, logged = got.samples[:got.grid], got.samples[got.grid:]
    if a.fit != "all" or not grid or not logged:
        raise CliError("--scale-grid: takes --fit all with --steps and --step-log files")
    own = fit(grid).coef
    k = statistics.median(s.ms / m for s in logged if (m := own.ms(s.shape)) > 0)
    got.samples = [StepSample(s.shape, s.ms * k) for s in grid] + logged
    for src in got.sources:
        if src["kind"] == "step-samples":
            src["scaled"] = round(k, 6)


def _delivery(path: dict | None, docs: list[dict], logs: list) -> None:
    """Each token's delay to the client (pdtb/sim/delivery.py) into `path`: every run's, and each
    mode's apart where the path has that mode."""
    ends = [log.decode_ends for _, role, log in logs if role in ("colocated", "decode")]
    got = fit_delivery([(d, ends) for d in docs]) if path else None
    if got is None:
        raise CliError("--draw-delivery: the --results runs and their decode-side --step-log files match fewer "
                       f"than {MIN_TOKENS} first and {MIN_TOKENS} later tokens")
    path["delivery"] = got
    for mode, fitted in (path.get("modes") or {}).items():
        mine = fit_delivery([(d, ends) for d in docs if (d.get("meta") or {}).get("mode") == mode])
        if mine:
            fitted["delivery"] = mine


def _contention(a: argparse.Namespace, logs: list, f) -> tuple[dict, dict, dict]:
    """Each role's (a, b) beside its run's other nodes (pdtb/sim/contention.py), and per role
    each logged sample's stretch under it and its neighbours' `u` (in `Inputs.by_role` order)."""
    runs = contention.runs_of([p for p, _, _ in logs])
    spans = {p: Cover(log.spans) for p, _, log in logs}
    points, us = {}, {}
    for path, role, log in logs:
        if not role:
            continue
        run = runs[str(Path(path).resolve().parent)]
        others = [spans[o] for o in run if o != path]
        u = [contention.neighbours_busy(others, t) for t in log.starts] if others else [0.0] * len(log.samples)
        us.setdefault(role, []).extend(u)
        points.setdefault(role, []).extend((x, s.ms / p, p) for x, s in zip(u, log.samples)
                                           if (p := f.coef.ms(s.shape)) > 0)
    fitted = {r: ab for r, pts in points.items() if (ab := contention.fit_role(pts))}
    if not fitted:
        raise CliError("--contention: no role has 100 logged steps beside another node of its run "
                       "(give every node's step log of a run, from one folder)")
    return fitted, {r: [contention.factor(fitted[r], x) for x in us[r]] for r in fitted}, us


def _step_spread(a: argparse.Namespace, by_role: dict, f, stretch: dict | None = None, us: dict | None = None) -> dict:
    """The roles' spreads; with --contention (`stretch`, `us`) each stretched role's apart alone
    and beside busy neighbours (contention.spread_keys), each step weighing its fitted time."""
    if not a.draw_step_spread:
        return {}
    if stretch:
        by_role, stretch = contention.split_by_neighbours(by_role, stretch, us)
    got = step_spread(by_role, f.coef.ms, stretch, by_time=bool(stretch))
    if not got:
        raise CliError("--draw-step-spread: no role has 100 logged steps in step logs named by it "
                       "(steps-decode-0.jsonl, steps-prefill-0.jsonl, steps-colocated-0.jsonl)")
    return got


def _results(files: list[str]) -> list[dict]:
    docs = []
    for path in files:
        try:
            docs.append(json.loads(open(path).read()))
        except (OSError, ValueError) as e:
            raise CliError(f"--results {path}: {e}") from None
    return docs


def _path(docs: list[dict], files: list[str], bytes_per_s: float, spans: list) -> dict | None:
    """The request path fitted to the results files' requests (with the files named), the time
    the decode nodes spent in steps left out of the hand-offs' (pdtb/sim/path_fit.py)."""
    from pdtb.sim.path_fit import fit_path

    if not docs:
        return None
    got = fit_path(docs, bytes_per_s, spans)
    if got is None:
        raise CliError("--results: too few finished requests with the nodes' stamps to fit the request path")
    return {**got, "files": files}


def report(cost: CalibratedCost, f) -> str:
    c = cost.coef
    lines = [f"fit of {f.samples} steps: R^2 {f.r2:.4f}, max relative error {100 * f.max_rel_err:.1f}%",
             "  step ms = " + " + ".join(f"{getattr(c, t):.4g}{'' if t == 'c0' else ' * ' + t}" for t in TERMS),
             f"  node overhead {cost.node_overhead_s * 1e3:.3f} ms/step; a hand-off landing {cost.land_s * 1e3:.3f} ms "
             f"of the decode loop; page {cost.page_bytes} B",
             f"  hand-off {cost.transfer.bytes_per_s / 1e9:.3g} GB/s + {cost.transfer.latency_s * 1e6:.0f} us; "
             f"tier move {cost.tier.bytes_per_s / 1e9:.3g} GB/s + {cost.tier.latency_s * 1e6:.0f} us"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse(argv)
    try:
        cost, f = build(a, argv)
    except SampleError as e:
        raise CliError(str(e)) from None
    doc = cost.to_json()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    print(json.dumps(doc) if a.json else report(cost, f) + (f"\nwrote {a.out}" if a.out else ""))
    return 0
