"""The simulator's part of docs/results.md, and its validation page docs/sim-validation.md.

From the files `scripts/sim_results.sh` writes: validate/validate-{grid,logs}.json,
validate-sets.json and validate-prefix-KIND.json, repro-{mcsf,vtc}.json and roofline-h200.json go to
the validation page (the simulator against the testbed, the papers it reproduces and the roofline),
summarised in at most ten lines of results.md drawn from the page's own tables; repro-essay.json and
azure-hour-POLICY.json (+ .cpu_s, .command) stay in results.md, and speed.json is a section of its
own. A file that is absent leaves its part out."""
from __future__ import annotations

import json
import re
from pathlib import Path

from pdtb.figures.results import fmt, md_table


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


CALIBRATIONS = {
    "grid": "calibrated on `pdtb bench steps --grid` (one quiet process), the node's own time per step from the "
            "fcfs runs' step logs",
    "logs": "calibrated on the same grid scaled to the logged steps' level and every step the fcfs runs logged "
            "(steps as they ran beside the router, the client and the other node on the same two cores): the "
            "calibration the simulator keeps; the other policies' runs are held out",
    "logs-path": "calibrated as *logs* without the request path's latencies",
    "logs-overhead": "calibrated as *logs* with no node overhead per step",
}


def validation_part(doc: dict, kind: str = "grid") -> list[str]:
    rows = []
    for r in doc["runs"]:
        for c in r["classes"]:
            def cell(k):
                x = c[k]
                mark = "" if "ok" not in x else ("" if x["ok"] else " (off)")
                return f"{fmt(x['real'])} / {fmt(x['sim'])} = {fmt(x['ratio'], 2)}{mark}"
            rows.append([r["mode"], r["policy"], c["class"], *(cell(k) for k in
                         ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s"))])
    out = [f"### Against the testbed: {kind} calibration", "",
           "`bash scripts/validate_sim.sh`: the quick comparison on real clusters of this machine, then the "
           f"same runs simulated, {CALIBRATIONS.get(kind, kind)}. Cells: real / sim = ratio (ms; tok/s). "
           f"Targets: p50 within 15%, p99 within 30%. On target: {doc['on_target']} of {doc['checks']}"
           + ("; by policy (fcfs fitted, the others held out): " + ", ".join(
               f"{p} {v['on_target']}/{v['checks']}" for p, v in doc["by_policy"].items()) if doc.get("by_policy") else "")
           + ".", ""]
    out += md_table(["mode", "policy", "class", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "out tok/s"], rows)
    out.append("")
    for o in doc["orderings"]:
        verdict = "same" if o["same"] else ("same beyond ties" if o.get("consistent") else "different")
        out.append(f"- order by {o['figure']} ({o['mode']}): real {' < '.join(o['real'])}; sim "
                   f"{' < '.join(o['sim'])}: {verdict}")
    return out + [""]


def sets_part(doc: dict) -> list[str]:
    """validate-sets.json: every workload set, per calibration (pdtb sim validate-sets)."""
    sets = doc["sets"]
    rows = []
    for kind, k in doc["kinds"].items():
        ok, n = k["held_out"]
        pols = sorted({p for v in k["by_set"].values() for p in v})
        for p in pols:
            rows.append([kind, p, *(("{}/{}".format(*k["by_set"][s][p]) if p in k["by_set"].get(s, {}) else "-")
                                    for s in sets)])
        rep = k.get("held_out_repeatable")
        rows.append([kind, (f"**held out: {ok}/{n} = {fmt(100 * k['held_out_share'], 1)}%**"
                            if k["held_out_share"] is not None else "held out: -")
                     + (f"; where the testbed repeats itself {rep[0]}/{rep[1]}"
                        + (f" = {fmt(100 * rep[0] / rep[1], 1)}%" if rep[1] else "") if rep else ""),
                     *([""] * (len(sets) - 1)),
                     f"orders same {k['orders_same']}, beyond ties {k['orders_consistent']} of {len(k['orders'])}"
                     + (f"; pairs apart the same {k['pairs'][0]} of {k['pairs'][1]}" if k.get("pairs") else "")])
    off = [f"- {kind}, {o['set']} {o['mode']} {o['figure']}: real {' < '.join(o['real'])}; sim {' < '.join(o['sim'])}"
           for kind, k in doc["kinds"].items() for o in k["orders"] if not o["consistent"]]
    return ["### Against the testbed, every workload", "",
            f"`bash scripts/validate_sim.sh --sets \"{' '.join(sets)}\""
            + (f" --repeat-sets \"{' '.join(doc['repeat_sets'])}\"" if "repeat" in doc["kinds"] else "")
            + "`: each set the quick comparison on real "
            "clusters (quick: whale-minnow, minnows at 4/s; loadR: minnows at R/s, the frontier's quick loads; "
            "tenants: the multi-tenant workload), every policy in both modes, and the same runs simulated. Each "
            f"calibration is fitted to the {doc['fitted']} runs of {sets[0]} alone; every other run is held out. "
            "Cells: figures on target (p50 within 15%, p99 within 30%). Orders: policies by minnow TTFT p99 and "
            f"ITL p99 per set and mode; beyond ties, real p99s within 30% of each other are tied. Bar: "
            f"{fmt(100 * doc['bar'], 0)}% held out."
            + (" *repeat*: each set's real runs made a second time and compared with the first as a simulated "
               "run is: the figures on which the testbed repeats itself, the ceiling of any simulator judged "
               "against one real run; each calibration's *where the testbed repeats itself* counts its held-out "
               f"figures among those, in the sets run twice ({', '.join(doc.get('repeat_sets', []))}); "
               "*KIND-mean*: the calibration against the geometric mean of the two real runs of those sets."
               if "repeat" in doc["kinds"] else ""), "",
            *md_table(["calibration", "policy", *sets], rows), "",
            *(["Orders that differ beyond ties:", "", *off, ""] if off else [])]


def prefix_validation_part(docs: dict[str, dict]) -> list[str]:
    """validate-prefix-KIND.json per calibration: the Mooncake replays, real against simulated."""
    rows = []
    for kind, doc in docs.items():
        for r in doc["rows"]:
            h, t = r["hit_rate"], r["ttft_p50_ms"]
            name = str(r["workload"]).rsplit("/", 1)[-1]
            rows.append([kind, name, f"{fmt(h['real'], 3)} / {fmt(h['sim'], 3)}",
                         f"{fmt(100 * h['points'], 1) if h['points'] is not None else '-'}{'' if h['ok'] else ' (off)'}",
                         f"{fmt(t['real'])} / {fmt(t['sim'])} = {fmt(t['ratio'], 2)}{'' if t['ok'] else ' (off)'}"])
    return ["### Prefix sharing against the testbed", "",
            "`bash scripts/validate_sim.sh` (step 5): the Mooncake excerpts replayed on a real 1P+1D cluster "
            "(`scripts/prefix_results.sh --quick --only trace`) and simulated with the same flags "
            "(`pdtb sim validate-prefix`). Targets: the hit rate within 2 points, TTFT p50 within 15%.", "",
            *md_table(["calibration", "trace", "hit rate real / sim", "points", "TTFT p50 ms real / sim"], rows), ""]


def mcsf_part(d: dict) -> list[str]:
    c = d["config"]
    return ["### MC-SF against the hindsight optimum (arXiv 2502.07115)", "",
            f"`pdtb sim reproduce mcsf`: {d['instances']} instances of {c['requests']} requests, memory {c['memory']}, "
            f"arrivals {c['arrivals']}; the real scheduler and `fairness/mcsf.py` against an integer program (HiGHS), "
            f"{d['solved']} solved to optimality.", "",
            *md_table(["figure", "this run", "paper"],
                      [["mean MC-SF / optimum", fmt(d["mean_ratio"], 4), fmt(d["paper_mean_ratio"], 3)],
                       ["median", fmt(d["median_ratio"], 4), "-"], ["max", fmt(d["max_ratio"], 4), "-"]]), ""]


def vtc_part(d: dict) -> list[str]:
    c, v, f, p = d["config"], d["runs"]["vtc"], d["runs"]["fcfs"], d["paper"]
    half, end = round(c["duration"] / 2), round(c["duration"])
    rows = [["bound 2 max(w_in L_in, w_out M)", fmt(d["bound"], 0), fmt(p.get("bound"), 0)],
            ["VTC max difference (the artifact's measure)", fmt(v["artifact_max_diff"], 0), fmt(p.get("vtc_max"), 0)],
            ["VTC max difference (every token)", fmt(v["max_abs_diff"], 0), "-"],
            ["FCFS difference at half time", fmt(f["half_diff"], 0), fmt(p.get("fcfs_at", {}).get(str(half)), 0)],
            ["FCFS difference at the end", fmt(f["end_diff"], 0), fmt(p.get("fcfs_at", {}).get(str(end)), 0)],
            ["FCFS end / half", fmt(f["end_over_half"], 2), fmt(p.get("fcfs_end_over_half"), 2)]]
    return ["### VTC: two backlogged tenants (Sheng et al., OSDI'24)", "",
            f"`pdtb sim reproduce vtc`: rates {c['rates'][0]:g}/s and {c['rates'][1]:g}/s, {c['prompt']}+{c['output']} "
            f"tokens, {c['kv_tokens']:,} KV tokens, {c['duration']:g} s; service in weighted tokens "
            f"({c['w_in']:g} in, {c['w_out']:g} out). VTC within the bound: {d['vtc_within_bound']}; "
            f"FCFS past it at the end: {d['fcfs_end_exceeds_bound']}. The paper's column is the bound of its "
            "setting and the artifact's published results through its own measure.", "",
            *md_table(["figure", "this run", "paper"], rows), ""]


def essay_part(d: dict) -> list[str]:
    c, pg, t5, ev, mo = d["config"], d["pages"], d["top5"], d["evictions"], d["memfair_over_fcfs"]
    pct = (lambda x: "-" if x is None else f"{100 * x:.0f}%")  # noqa: E731
    times = (lambda e: fmt(e["ratio"], 2) + "x" if e["ratio"] is not None else  # noqa: E731
             ("inf (none without whales)" if e["with_whales"] else "- (none either way)"))
    rows = [[f"pages, {c['whale_prompt']:,} vs {c['minnow_prompt']:,} tokens", f"{pg['page_ratio']:g}x", "64x"],
            ["top-5% share of HBM, mean / max (fcfs)", f"{pct(t5['pool_mean'])} / {pct(t5['pool_max'])}", "~80%"],
            ["top-5% share of the KV in use, mean", pct(t5["used_mean"]), f"{pct(t5['by_hand_used'])} by hand"],
            ["minnow evictions, with / without whales (fcfs)", times(ev["fcfs"]), "2-4x"],
            ["same, memfair", times(ev["memfair"]), ""],
            ["memfair / fcfs, minnow TTFT p99", fmt(mo["minnow_ttft_p99"], 2) + "x", ""],
            ["memfair / fcfs, minnow ITL p99", fmt(mo["minnow_itl_p99"], 2) + "x", ""]]
    return ["### The mission's claims at H100 scale (Llama-3-8B, 128K whales)", "",
            f"`pdtb sim reproduce essay`: {d['cost']}, colocated; {c['whales']} whales of "
            f"{c['whale_prompt']:,}+{c['whale_output']} tokens every {c['whale_interval']:g} s, minnows "
            f"{c['minnow_prompt']:,}+{c['minnow_output']} at {c['minnow_rate']:g}/s for {c['duration']:g} s.", "",
            *md_table(["claim", "this run", "essay"], rows), "", *(f"- {n}" for n in d.get("notes", [])), ""]


def azure_part(runs: list[tuple[dict, str | None, str | None]]) -> list[str]:
    """One row per policy: (results, whole-command CPU seconds, command)."""
    rows = []
    for res, cpu, _ in runs:
        s, sim = res["summary"]["overall"], res["meta"]["sim"]
        rows.append([res["meta"].get("policy") or "?", str(s["count"]), fmt(sim["simulated_s"], 0),
                     fmt(sim.get("cpu_s", sim["wall_s"]), 1),
                     cpu or "?", fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]),
                     fmt(s["itl_ms"]["p99"]), fmt(s["output_tok_s"]), str(s["failed"]),
                     f"{fmt(sim['top5_share_pool_mean'], 3)} / {fmt(sim['top5_share_pool_max'], 3)}"])
    return ["### One hour of the Azure conversation trace, 8 GPUs", "",
            f"`{runs[0][2] or 'pdtb sim ...'}` (and the same with each other policy). Simulation: the event "
            "loop's CPU time; command: the whole command's, summary and results file included (CPU seconds of the "
            "processes themselves: what a run costs, whatever else the machine runs meanwhile).", "",
            *md_table(["policy", "requests", "simulated s", "simulation s", "command s", "TTFT p50 ms", "TTFT p99 ms",
                       "ITL p50 ms", "ITL p99 ms", "out tok/s", "failed", "top-5% pool share mean / max"], rows), ""]


def roofline_part(d: dict) -> list[str]:
    rows = [[k, str(v["steps"]), fmt(v["geomean_ratio"], 2), f"{fmt(v['min_ratio'], 2)} .. {fmt(v['max_ratio'], 2)}"]
            for k, v in d["by_kind"].items()]
    return ["### The GPU engine against the roofline (H200)", "",
            f"`pdtb sim roofline --steps pdtb/sim/calibrations/samples/h200-llama-3-8b-bf16.json --gpu h200 "
            f"--model-config llama-3-8b`: steps of {d['model']} measured on one H200 with `pdtb bench steps --grid` "
            "against the roofline of the same shape. The shipped calibration `h200-llama-3-8b-bf16` keeps the "
            "measured times; `--cost roofline` models an engine at the roofline.", "",
            *md_table(["steps", "n", "measured / roofline (geometric mean)", "range"], rows), ""]


SIM_HEADING = "## The simulator (`pdtb sim`)"
VALIDATION_PAGE = "sim-validation.md"  # beside results.md
VALIDATION_TITLE = "# The simulator checked: against the testbed, the papers it reproduces, the roofline"
KINDS = ("grid", "logs")


def validation_parts(d: Path) -> list[str]:
    """The comparisons of the validation page, each under a "### " heading."""
    out = []
    sets = _load(d / "validate", "validate-sets.json")
    if sets:
        out += sets_part(sets)
    for kind in KINDS:
        v = _load(d / "validate", f"validate-{kind}.json")
        if v:
            out += validation_part(v, kind)
    pv = {k: x for k in KINDS if (x := _load(d / "validate", f"validate-prefix-{k}.json"))}
    if pv:
        out += prefix_validation_part(pv)
    for name, part in (("mcsf", mcsf_part), ("vtc", vtc_part)):
        x = _load(d, f"repro-{name}.json")
        if x:
            out += part(x)
    r = _load(d, "roofline-h200.json")
    if r:
        out += roofline_part(r)
    return out


def as_page(parts: list[str], stamp: str | None = None) -> list[str]:
    """The validation page: a title, where it comes from, and the parts with their headings one level up."""
    if not parts:
        return []
    when = f" ({stamp})" if stamp else ""
    return [VALIDATION_TITLE, "", f"`bash scripts/sim_results.sh`{when}; summarised in "
            "[results.md](results.md#the-simulator-pdtb-sim), which holds the simulator's other figures.", "",
            *(x[1:] if x.startswith("### ") else x for x in parts)]


def validation_page(d: str | Path, stamp: str | None = None) -> list[str]:
    return as_page(validation_parts(Path(d)), stamp)


def validation_summary(page: list[str]) -> list[str]:
    """At most ten lines for results.md from the validation page's own tables ([] for an empty page)."""
    from pdtb.figures.mdtables import blocks, table

    if not page:
        return []
    tables = [t for b in blocks(page) if (t := table(b))]
    kinds = {}  # calibration -> (held out on target, where the testbed repeats itself, orders beyond ties)
    for head, rows in tables:
        if head[:2] == ["calibration", "policy"]:
            for r in rows:
                m = re.match(r"\*\*held out: (.+?)\*\*(?:; where the testbed repeats itself (.+))?$", r[1])
                if m and not r[0].endswith("-mean"):
                    ties = re.search(r"beyond ties (\d+ of \d+)", r[-1])
                    pairs = re.search(r"pairs apart the same (\d+ of \d+)", r[-1])
                    kinds[r[0]] = (m.group(1), m.group(2) or "-", ties.group(1) if ties else "-",
                                   pairs.group(1) if pairs else "-")
    if not kinds:  # no sets: each calibration's own quick comparison
        for i, line in enumerate(page):
            m = re.match(r"## Against the testbed: (\w+) calibration", line)
            got = m and re.search(r"On target: (\d+) of (\d+)", "\n".join(page[i:i + 3]))
            if got:
                kinds[m.group(1)] = (f"{got.group(1)}/{got.group(2)}", "-", "-", "-")
    out = [f"Checked against the testbed, the papers it reproduces and the roofline: "
           f"[{VALIDATION_PAGE}]({VALIDATION_PAGE}).", ""]
    if kinds:
        out[0] += " Figures of held-out runs on target (p50 within 15%, p99 within 30%), per calibration:"
        # (the share where the testbed repeats itself stays on the validation page: ten lines here)
        rows = [[name, *(v[k] for v in kinds.values())] for k, name in
                ((0, "held out on target"), (2, "orders the same beyond ties"),
                 (3, "pairs of policies apart, ordered the same"))]
        out += md_table(["calibration", *kinds], [r for r in rows if set(r[1:]) != {"-"}])
        out.append("")
    notes = _other_checks(tables)
    return out + ([notes, ""] if notes else [])


def _other_checks(tables: list[tuple[list[str], list[list[str]]]]) -> str:
    """One sentence on prefix sharing, the reproductions and the roofline, from their tables."""
    out = []
    for head, rows in tables:
        if head[:2] == ["calibration", "trace"]:
            hits = sum("(off)" not in r[3] for r in rows)
            ttft = sum("(off)" not in r[4] for r in rows)
            out.append(f"prefix sharing, hit rate within 2 points in {hits} of {len(rows)} and TTFT p50 within 15% "
                       f"in {ttft} of {len(rows)}")
        by = {r[0]: r for r in rows}
        if head == ["figure", "this run", "paper"] and "mean MC-SF / optimum" in by:
            r = by["mean MC-SF / optimum"]
            out.append(f"MC-SF at {r[1]} of the hindsight optimum on average (paper {r[2]})")
        if head == ["figure", "this run", "paper"] and "VTC max difference (the artifact's measure)" in by:
            r, b = by["VTC max difference (the artifact's measure)"], by.get("bound 2 max(w_in L_in, w_out M)")
            out.append(f"VTC's largest service difference {r[1]} (paper {r[2]})"
                       + (f" within the bound {b[1]}" if b else ""))
        if head[:3] == ["steps", "n", "measured / roofline (geometric mean)"]:
            out.append("H200 steps at " + ", ".join(f"{r[2]}x ({r[0]})" for r in rows) + " the roofline's time")
    return (out[0][0].upper() + "; ".join(out)[1:] + ".") if out else ""


def with_stamp(summary: list[str], stamp: str | None) -> list[str]:
    """The summary's first paragraph opened with the command and its stamp."""
    line = f"`bash scripts/sim_results.sh` ({stamp})." if stamp else ""
    if not summary:
        return [line, ""] if line else []
    return [f"{line} {summary[0]}".strip(), *summary[1:]]


def render(d: str | Path, stamp: str | None = None) -> list[str]:
    """results.md's simulator section: the validation page's summary, the mission's claims at scale, the
    Azure hour."""
    d = Path(d)
    out = [SIM_HEADING, "", *with_stamp(validation_summary(validation_page(d, stamp)), stamp)]
    x = _load(d, "repro-essay.json")
    if x:
        out += essay_part(x)
    runs = []
    for path in sorted(d.glob("azure-hour-*.json")):  # one per policy sim_results.sh ran
        pol = path.stem[len("azure-hour-"):]
        az = _load(d, path.name)
        if az:
            text = {ext: (d / f"azure-hour-{pol}.{ext}").read_text().strip()
                    if (d / f"azure-hour-{pol}.{ext}").is_file() else None for ext in ("cpu_s", "command")}
            runs.append((az, text["cpu_s"], text["command"]))
    if runs:
        out += azure_part(runs)
    return out


SPEED_HEADING = "## How fast the simulator runs (`pdtb sim speed`)"


def speed_section(d: dict, stamp: str | None = None) -> list[str]:
    """`pdtb sim speed --json`: the Azure hour per policy, and the slice against one event per step."""
    rows = d["rows"]
    n = rows[0]["slice"]["requests"] if rows else 0
    hour = rows[0]["hour"] if rows else {}
    return [SPEED_HEADING, "",
            f"`pdtb sim speed --json`{f' ({stamp})' if stamp else ''}: `pdtb sim --workload trace:{d['trace']} "
            f"{d['shape']} --policy P`, an hour of the trace ({hour.get('simulated_s', '?')} s simulated), each "
            "policy in a process of its own. Seconds are CPU seconds of the process itself (what a run costs, "
            "whatever else the machine runs meanwhile). *command s*: the whole command (start, workload, simulation, "
            "summary, results file); *simulation s*: the event loop alone. The baseline is measured in the same command: "
            f"the trace's first {n} requests with one event per engine step (`--every-step`) against runs of "
            "identical decode steps taken at once (pdtb/sim/coast.py); *identical*: the two results files hold the "
            "same requests, token times and samples. The bound is the events that can change a decision: "
            "*steps in runs* of *steps* were taken without an event of their own.", "",
            *speed_table(rows), ""]


def speed_table(rows: list[dict]) -> list[str]:
    head = ["policy", "hour: command s", "simulation s", "events", "steps", "steps in runs",
            "slice: every step s", "runs s", "speed-up", "identical"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        h, s = r["hour"], r["slice"]
        out.append("| " + " | ".join(str(v) for v in (
            r["policy"], h["command_s"], h["simulation_s"], h["events"], h["steps"], h["steps_in_runs"],
            s["every_step"]["simulation_s"], s["runs"]["simulation_s"], f"{s['speedup']}x",
            "yes" if s["identical"] else "NO")) + " |")
    return out
