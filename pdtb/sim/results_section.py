"""The simulator's section of docs/results.md, from the files `scripts/sim_results.sh` writes:
validate/validate.json, repro-{mcsf,vtc,essay}.json, azure-hour.json (+ .wall_s, .command) and
roofline-h200.json. A file that is absent leaves its part out."""
from __future__ import annotations

import json
from pathlib import Path

from pdtb.bench.results import fmt, md_table


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


def validation_part(doc: dict) -> list[str]:
    rows = []
    for r in doc["runs"]:
        for c in r["classes"]:
            def cell(k):
                x = c[k]
                mark = "" if "ok" not in x else ("" if x["ok"] else " (off)")
                return f"{fmt(x['real'])} / {fmt(x['sim'])} = {fmt(x['ratio'], 2)}{mark}"
            rows.append([r["mode"], r["policy"], c["class"], *(cell(k) for k in
                         ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s"))])
    out = ["### Against the testbed", "",
           "`bash scripts/validate_sim.sh`: the quick comparison on real clusters of this machine, the "
           "simulator calibrated here (`pdtb bench steps --grid`, `pdtb sim calibrate`), the same runs "
           f"simulated. Cells: real / sim = ratio (ms; tok/s). Targets: p50 within 15%, p99 within 30%. "
           f"On target: {doc['on_target']} of {doc['checks']}.", ""]
    out += md_table(["mode", "policy", "class", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "out tok/s"], rows)
    out.append("")
    for o in doc["orderings"]:
        out.append(f"- order by {o['figure']} ({o['mode']}): real {' < '.join(o['real'])}; sim "
                   f"{' < '.join(o['sim'])}: {'same' if o['same'] else 'different'}")
    return out + [""]


def mcsf_part(d: dict) -> list[str]:
    c = d["config"]
    return ["### MC-SF against the hindsight optimum (arXiv 2502.07115)", "",
            f"`pdtb sim reproduce mcsf`: {d['instances']} instances of {c['requests']} requests, memory {c['memory']}, "
            f"arrivals {c['arrivals']}; the real scheduler and `fairness/mcsf.py` against an integer program (HiGHS), "
            f"{d['solved']} solved to optimality.", "",
            *md_table(["figure", "this run", "paper"],
                      [["mean MC-SF / optimum", fmt(d["mean_ratio"], 4), fmt(d["paper_mean_ratio"], 3)],
                       ["median", fmt(d["median_ratio"], 4), "-"], ["max", fmt(d["max_ratio"], 4), "-"]]), ""]


def generic_part(title: str, command: str, d: dict) -> list[str]:
    """A reproduction that lists its figures as [{"figure", "this_run", "paper"}] under "figures"."""
    rows = [[f.get("figure", "?"), fmt(f.get("this_run"), 3), str(f.get("paper", "-"))] for f in d.get("figures", [])]
    out = [f"### {title}", "", f"`{command}`", ""]
    if rows:
        out += md_table(["figure", "this run", "paper / essay"], rows)
    return out + [f"- {n}" for n in d.get("notes_short", [])] + [""]


def azure_part(res: dict, wall: str | None, command: str | None) -> list[str]:
    s, sim = res["summary"]["overall"], res["meta"]["sim"]
    return ["### One hour of the Azure conversation trace, 8 GPUs", "",
            f"`{command or 'pdtb sim ...'}`", "",
            f"{s['count']} requests, {fmt(sim['simulated_s'], 0)} s simulated in {fmt(sim['wall_s'], 1)} s of "
            f"simulation ({sim['events']} events; the whole command, summary and file included: {wall or '?'} s).", "",
            *md_table(["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "out tok/s", "failed", "top-5% pool share (mean, max)"],
                      [[fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]), fmt(s["itl_ms"]["p99"]),
                        fmt(s["output_tok_s"]), str(s["failed"]),
                        f"{fmt(sim['top5_share_pool_mean'], 3)}, {fmt(sim['top5_share_pool_max'], 3)}"]]), ""]


def roofline_part(d: dict) -> list[str]:
    rows = [[k, str(v["steps"]), fmt(v["geomean_ratio"], 2), f"{fmt(v['min_ratio'], 2)} .. {fmt(v['max_ratio'], 2)}"]
            for k, v in d["by_kind"].items()]
    return ["### The GPU engine against the roofline (H200)", "",
            f"`pdtb sim roofline --steps pdtb/sim/calibrations/samples/h200-llama-3-8b-bf16.json --gpu h200 "
            f"--model-config llama-3-8b`: steps of {d['model']} measured on one H200 with `pdtb bench steps --grid` "
            "against the roofline of the same shape. The shipped calibration `h200-llama-3-8b-bf16` keeps the "
            "measured times; `--cost roofline` models an engine at the roofline.", "",
            *md_table(["steps", "n", "measured / roofline (geometric mean)", "range"], rows), ""]


def render(d: str | Path) -> list[str]:
    d = Path(d)
    out = ["## The simulator (`pdtb sim`)", ""]
    v = _load(d / "validate", "validate.json")
    if v:
        out += validation_part(v)
    m = _load(d, "repro-mcsf.json")
    if m:
        out += mcsf_part(m)
    for name, title in (("vtc", "VTC: two backlogged tenants (OSDI'24)"),
                        ("essay", "The mission's claims at H100 scale (Llama-3-8B, 128K whales)")):
        x = _load(d, f"repro-{name}.json")
        if x:
            out += generic_part(title, f"pdtb sim reproduce {name}", x)
    az = _load(d, "azure-hour.json")
    if az:
        wall = (d / "azure-hour.wall_s").read_text().strip() if (d / "azure-hour.wall_s").is_file() else None
        cmd = (d / "azure-hour.command").read_text().strip() if (d / "azure-hour.command").is_file() else None
        out += azure_part(az, wall, cmd)
    r = _load(d, "roofline-h200.json")
    if r:
        out += roofline_part(r)
    return out
