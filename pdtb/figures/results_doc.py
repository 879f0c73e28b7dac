"""Renders `docs/results.md` from one `scripts/results.sh` run, stamped with date, commit and
machine.

`python -m pdtb.figures.results_doc`: write docs/results.md from the result files of one
`scripts/results.sh` run. Every table is rendered from those files, stamped with the date,
the commit and the machine; the file is replaced whole. `--section NAME` replaces one section in
place (its own date and commit). Every write passes the document through condense.py (its long
tables in their dense form) and headline.py (the opening summary, drawn from the document's own
tables, and the same lines in the README's headline block); the simulator's validation goes to
sim-validation.md beside the document.

    python -m pdtb.figures.results_doc --fair DIR [--engine E.json] [--transport T.json ...]
                                     [--fair-command CMD] [--frontier DIR --frontier-command CMD]
                                     [--sim DIR] --out docs/results.md [--readme README.md]
    python -m pdtb.figures.results_doc --section summary --out docs/results.md
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pdtb.common import host_facts
from pdtb.figures.compare import markdown_table, rows_of, with_ratios


def machine() -> str:
    """Cores, memory, CPU model, Python and the libraries the figures depend on."""
    h = host_facts()
    libs = ", ".join(f"{n} {v}" for n, v in h["versions"].items())
    mem = f"{h['memory_gib']} GiB" if h["memory_gib"] is not None else "? GiB"
    return f"{h['cores']} cores, {mem}, {h['cpu']}; Python {h['python']}, {libs}"


def commit(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


@dataclass
class Run:
    """One results.sh run's files, each read once."""

    fair_rows: list[dict] | None  # pdtb compare's rows, ratios against fcfs
    fair_command: str
    engine: dict | None  # pdtb bench engine --json
    transports: list[dict]  # pdtb bench transport --json, one per endpoint
    commit: str
    frontier: list[dict] | None = None  # sweep files of a frontier.sh run
    frontier_points: dict | None = None  # its frontier/frontier.json (pdtb frontier)
    frontier_command: str = ""
    engine_beside: dict | None = None  # the same bench with results.sh's background simulations running

    @classmethod
    def load(cls, a: argparse.Namespace, root: Path) -> "Run":
        rows = None
        if a.fair:
            rows = with_ratios(rows_of(sorted(glob.glob(os.path.join(a.fair, "*.json"))), "minnow", "whale"), "fcfs")
        sweeps = front = None
        if a.frontier:
            from pdtb.figures.frontier import load_sweep

            sweeps = [load_sweep(p) for p in sorted(glob.glob(os.path.join(a.frontier, "*.json")))]
            front = json.loads((Path(a.frontier) / "frontier" / "frontier.json").read_text())
        return cls(rows, a.fair_command, json.loads(Path(a.engine).read_text()) if a.engine else None,
                   [json.loads(Path(p).read_text()) for p in a.transport], commit(root), sweeps, front,
                   a.frontier_command, json.loads(Path(a.engine_beside).read_text()) if a.engine_beside else None)


def fairness_section(rows: list[dict], command: str) -> list[str]:
    failed = sum(r["failed"] or 0 for r in rows)
    return ["## Fairness: colocated and disaggregated, policy by policy", "",
            f"`{command}`", "",
            "Minnow class against fcfs in the same mode; whale columns show what the 64x requests paid. "
            f"Failed requests over all runs: {failed}.", "",
            *markdown_table(rows, "minnow", "fcfs", "whale"), ""]


def frontier_section(sweeps: list[dict], front: dict, command: str, images: str | None) -> list[str]:
    """The frontier table as `pdtb frontier` computed it (`front`: its frontier.json), and every
    point's offered load, goodput and attainment per level."""
    from pdtb.figures import frontier
    from pdtb.figures.sweep_report import label

    points = front["points"]
    at = sorted({p["at_load"] for p in points if p["at_load"] is not None})
    m = sweeps[0]["meta"]
    out = ["## Fairness at saturation: load sweeps and the fairness-throughput frontier", "",
           f"`{command}`", "",
           f"Each point is one load sweep of `{m['workload']}` ({m['warmup_s']:g} s warm-up and {m['span_s']:g} s "
           "measured per level; rate multipliers of the workload's arrivals) at the same page and thread budget. "
           "Max goodput: the highest request rate meeting the SLOs at which every class attains 90% (a lower "
           "bound where the highest level still attained it: knee '-' above). Minnow columns are read at load "
           f"{', '.join(f'{x:g}' for x in at)}. Ratios are against fcfs in the same mode. Pareto: no other point "
           f"has more {'saturation output tok/s' if front.get('x') == 'saturation_tok_s' else 'max goodput'} and a "
           "lower minnow p99 TTFT; the knee is the Pareto point farthest from the line between the frontier's "
           "ends.", "",
           *frontier.table(points, front["pareto"], front["knee"], "minnow"), ""]
    if images:
        out += [f"![frontier]({images}/frontier.png) ![attainment against load]({images}/attainment.png)", ""]
    loads = sorted({lv["load"] for d in sweeps for lv in d["levels"]})
    out += ["Per level: offered → goodput req/s (attainment minnow / whale).", "",
            "| point | " + " | ".join(f"load {x:g}" for x in loads) + " |", "|---|" + "---|" * len(loads)]
    for d in sorted(sweeps, key=label):
        by = {lv["load"]: lv for lv in d["levels"]}
        cells = []
        for x in loads:
            lv = by.get(x)
            if lv is None:
                cells.append("-")
                continue
            att = " / ".join(_f(lv["per_class"].get(c, {}).get("attainment")) for c in ("minnow", "whale"))
            cells.append(f"{lv['overall']['offered_rps']:.1f} → {lv['overall']['goodput_rps']:.1f} ({att})")
        out.append(f"| {label(d)} | " + " | ".join(cells) + " |")
    return out + [""]


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def engine_section(r: dict, beside: dict | None = None) -> list[str]:
    from pdtb.figures.results import decode_path_label

    how = decode_path_label(r)
    cost = [] if not beside else [
        f"The same bench with the run's background simulations beside it (the idle scheduling class, "
        f"scripts/results.sh): paged engine {beside['paged_tok_s']:.0f} tok/s, "
        f"**{beside['paged_tok_s'] / r['paged_tok_s']:.2f}x** of its rate alone: what they would cost a "
        "measured process, and why every part whose figures are times runs with them stopped (only parts whose "
        "figures are outcomes run beside them: the fault campaigns, the Ray tests, the transports' lockstep "
        "verdicts).", ""]
    return ["## Paged engine against `transformers.generate`", "",
            f"`pdtb bench engine --batch {r['batch']} --prompt-len {r['prompt_len']} "
            f"--max-tokens {r['max_tokens']} --json` ({r['device']}, {r['dtype']}, {r['torch_threads']} torch "
            f"threads, {how})", "",
            "| paged engine tok/s | generate (padded batch) tok/s | ratio (best/best) | ratio (median of pairs) "
            "| median decode step (ms) |", "|---|---|---|---|---|",
            f"| {r['paged_tok_s']:.0f} | {r['hf_padded_tok_s']:.0f} | **{r['ratio']:.2f}x** | "
            f"{r['ratio_paired_median']:.2f}x | {r['step_ms_median']:.2f} |", "", *cost]


def transport_section(results: list[dict]) -> list[str]:
    out = ["## KV transport against raw pyzmq", "",
           "`pdtb bench transport --endpoint ENDPOINT --json`: one large request's KV (`size`) in chunks, "
           "against raw pyzmq moving the same chunks, and raw pyzmq plus the copy into the pool (best of the "
           "interleaved repetitions; the paired ratio is the median over repetitions).", "",
           "| endpoint | size (MiB) | transport GB/s | raw pyzmq GB/s | ratio | paired ratio | raw + landing GB/s "
           "| small requests (pages/s) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['backend']} {r['endpoint']} | {r['size_mib']} | {r['gbps']:.2f} | {r['raw_zmq_gbps']:.2f} "
                   f"| **{r['ratio_vs_raw_zmq']:.2f}x** | {r['ratio_paired_median']:.2f}x | {r['raw_land_gbps']:.2f} "
                   f"| {r['small_pages_per_s']:.0f} |")
    return out + [""]


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def replace_block(text: str, block: list[str]) -> str:
    """`text` with the lines between the results markers replaced by `block`."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"no {BEGIN} ... {END} block to replace")
    return text[:i + len(BEGIN)] + "\n" + "\n".join(block) + "\n" + text[j:]


MIGRATION_HEADING = "## Moving requests between decode nodes"
TRANSPORTS_HEADING = "## KV transports on one host"


RAY_HEADING = "## Clusters placed by Ray"


def ray_section(junit: str, seconds: int, stamp: str) -> list[str]:
    """What the Ray tests showed, from their JUnit report, and where they ran."""
    import xml.etree.ElementTree as ET

    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    rows = []
    for case in suite.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped")
        outcome = "failed" if failed else f"skipped: {skipped.get('message', '')}" if skipped is not None else "passed"
        rows.append(f"| `{case.get('name')}` | {outcome} | {float(case.get('time', 0)):.0f} |")
    return [RAY_HEADING, "", f"`bash scripts/ray_results.sh`: `tests/clusters/test_ray_cluster.py` {stamp}, {seconds} s in all.", "",
            "Every run so far is on a **local Ray cluster only**: four Ray nodes (`ray.cluster_utils.Cluster`) "
            "on this one machine, on loopback, with the custom resources router, prefill and decode (two). No "
            "cluster has run across separate machines yet; the KV and control paths between hosts are the "
            "ZeroMQ ones the single-host tests cover.", "", "| test | outcome | seconds |", "|---|---|---|", *rows, ""]


def transports_section(shm: list[dict], admissions_dir: str | None, stamp: str | None = None,
                       link: dict | None = None) -> list[str]:
    """The shm backend's read and write against ZeroMQ ipc and a pool copy; control round trips (`link`:
    python -m pdtb.microbench.link --json); admission verdicts per transport."""
    when = f" Measured {stamp}." if stamp else ""
    out = [TRANSPORTS_HEADING, "",
           f"`bash scripts/transport_results.sh`: this machine, tiny-model page geometry (32 KiB pages).{when}", "",
           "`pdtb bench transport --backend shm --size-mib SIZE --json`: one request's KV, send() to ACK, best of "
           "the interleaved repetitions (the median of the per-pair ratios in brackets), to a receiver in another "
           "process, over the shm backend's two ways and over ZeroMQ ipc. **Read**: the export gathered into the "
           "sender's arena, as a node gathers it; the receiver copies it into its pool pages and sums it in the "
           "same pass (two passes over the bytes). **Write**: the same export from outside the arena, written "
           "one-sided into the receiver's shared pool, which reads every piece back against the sender's checksum "
           "(three passes); and that write with the read-back off. Against an in-process copy of the same pages "
           "from one pool into another (two passes, no transport), and for the write an in-process checked copy: "
           "the same pieces copied into a shared pool by one thread while a second reads each back and sums it "
           "(a checked write's three passes with no transport: its bound on this machine's memory).", "",
           "| size (MiB) | read GB/s | x zmq ipc | x pool copy | write GB/s | x zmq ipc | x pool copy "
           "| x checked copy | write, not read back GB/s | x zmq ipc | zmq ipc GB/s | pool copy GB/s "
           "| checked copy GB/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in shm:
        out.append(f"| {r['size_mib']} | {r['shm_gbps']:.2f} | **{r['ratio_vs_zmq_ipc']:.2f}x** "
                   f"({r['ratio_paired_median']:.2f}x) | **{r['ratio_vs_pool_copy']:.2f}x** "
                   f"| {r['shm_write_gbps']:.2f} | {r['write_ratio_vs_zmq_ipc']:.2f}x ({r['write_ratio_paired_median']:.2f}x) "
                   f"| {r['write_ratio_vs_pool_copy']:.2f}x | {r['write_ratio_vs_checked_copy']:.2f}x "
                   f"| {r['shm_unchecked_gbps']:.2f} | {r['unchecked_ratio_vs_zmq_ipc']:.2f}x "
                   f"| {r['zmq_ipc_gbps']:.2f} | {r['pool_copy_gbps']:.2f} | {r['checked_copy_gbps']:.2f} |")
    out.append("")
    if link:
        z, k = link["zmq"], link["link"]
        out += [f"`python -m pdtb.microbench.link --n {link['n']}`: a 64-byte control message's round trip between "
                f"two processes, median (10th percentile): through pyzmq's asyncio sockets over ipc {z['median_us']:.0f} us "
                f"({z['p10_us']:.0f}), over the local link the shm backend switches to after its first Grant (or read) "
                f"{k['median_us']:.0f} us ({k['p10_us']:.0f}): **{link['ratio_median']:.2f}x**.", ""]
    if admissions_dir:
        out += verdicts_lines(Path(admissions_dir))
    return out


def _verdict_dirs(root: Path) -> list[Path]:
    """The transports' result directories under `root`: ZeroMQ first, then its second run."""
    dirs = [d for d in root.iterdir() if d.is_dir() and list(d.glob("disagg-*.json"))]
    return sorted(dirs, key=lambda d: (d.name != "zmq", not d.name.endswith("-again"), d.name))


def verdicts_lines(root: Path) -> list[str]:
    """The verdict tables of scripts/compare_transports.sh's output directory `root`."""
    from pdtb.figures.admissions import table

    out = ["`bash scripts/compare_transports.sh --quick`: the disaggregated quick fairness workload (seeded) over "
           "each transport; the decode node's verdicts on hand-off headers (`defer` counts each deferred request "
           "once, `defer_answers` every deferral as the prefill side retries).", ""]
    if (root / "lockstep").is_dir():
        dirs = _verdict_dirs(root / "lockstep")
        lines, same = table(dirs)
        steps = sorted({json.loads(p.read_text()).get("step_s") for d in dirs for p in d.glob("disagg-*.json")})
        clock = " or ".join(f"{s * 1000:g} ms" for s in steps if s)
        out += ["In lockstep (`pdtb bench lockstep`: the same workload and decode node flags, each request's KV "
                "handed off into a real decode node over the transport in a fixed order of events, on a virtual "
                f"clock of {clock} per engine step): "
                + (f"every request's verdicts, every count and the generated tokens equal {dirs[0].name}'s, over "
                   "every transport." if same else "**the decisions differ between transports** (below)."),
                "", "```", *lines, "```", ""]
    live = _verdict_dirs(root / "live" if (root / "live").is_dir() else root)
    if live:
        lines, _ = table(live)
        out += ["Live (real clusters in real time; `zmq-again` is a second run over ZeroMQ): a verdict depends on "
                "what the decode pool holds at the moment a header arrives, so counts differ between two runs over "
                "one transport as they do between transports.", "", "```", *lines, "```", ""]
    else:
        out += ["Live runs (real clusters in real time, whose verdicts differ from run to run) are in the full run "
                "alone: `bash scripts/transport_results.sh` without --quick.", ""]
    return out


def migration_section(migration_dir: str, command: str, stamp: str | None = None) -> list[str]:
    from pdtb.figures.migration_report import report as migration_report

    when = f" Measured {stamp}." if stamp else ""
    return [MIGRATION_HEADING, "", f"`{command}`: real clusters on this machine, the embedded model; every ratio "
            f"is between runs of the same invocation.{when}", "", *migration_report(Path(migration_dir))]


def replace_section(text: str, heading: str, section: list[str], before: str | None = "## The simulator") -> str:
    """`text` with the section under `heading` (up to the next "## ") replaced by `section`, or
    `section` inserted before the heading starting with `before` (else, or with None, at the end)."""
    lines = text.rstrip("\n").split("\n")
    if heading in lines:
        i = lines.index(heading)
        j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    else:
        i = j = next((k for k, ln in enumerate(lines) if before and ln.startswith(before)), len(lines))
    return "\n".join(lines[:i] + section + lines[j:]) + "\n"


GPU_PAGE = "gpu-results.md"  # the GPU check's figures (scripts/gpu_check.sh), beside the document


def render(run: Run, images: str | None = None, sim_dir: str | None = None, prefix_dir: str | None = None,
           prefix_command: str = "bash scripts/prefix_results.sh --quick", migration_dir: str | None = None,
           migration_command: str = "bash scripts/migration_results.sh --quick") -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Results", "",
             f"Written by `bash scripts/results.sh` on {now}, commit {run.commit}.  ",
             f"Machine: {machine()}.  ",
             "Rerunning the script replaces this file. Absolute figures are noisy on shared machines; "
             "every ratio is taken within one run. How the workloads are built and why: "
             "[method.md](method.md); what the figures answer: [findings.md](findings.md), written by the same run.", ""]
    if run.fair_rows is not None:
        lines += fairness_section(run.fair_rows, run.fair_command)
    if run.frontier:
        lines += frontier_section(run.frontier, run.frontier_points, run.frontier_command, images)
    if run.engine:
        lines += engine_section(run.engine, run.engine_beside)
    if run.transports:
        lines += transport_section(run.transports)
    if prefix_dir:
        from pdtb.figures.prefix_report import report as prefix_report

        lines += ["## Prefix caching", "", f"`{prefix_command}`: real clusters on this machine, the embedded "
                  "model; every ratio is between runs of the same invocation.", "", *prefix_report(Path(prefix_dir))]
    if migration_dir:
        lines += migration_section(migration_dir, migration_command)
    lines += ["## On a GPU", "", "Not measured by this run: `PDTB_SYSTEM_PYTHON=1 bash scripts/gpu_check.sh` measures "
              f"on a machine with a GPU and writes its figures, with their own date and commit, to [{GPU_PAGE}]({GPU_PAGE}).",
              ""]
    if sim_dir:
        from pdtb.figures.sim_section import render as sim_section

        lines += sim_section(sim_dir)
        if (Path(sim_dir) / "speed.json").is_file():
            from pdtb.figures.sim_section import speed_section

            lines += speed_section(json.loads((Path(sim_dir) / "speed.json").read_text()))
    return "\n".join(lines)


def _read(path: str | None) -> str:
    """A small file's text, stripped ("" where there is none)."""
    return Path(path).read_text().strip() if path and Path(path).exists() else ""


def write_doc(path: str | Path, text: str, readme: str | None = None) -> None:
    """Write the document in its dense form (condense.py) with its summary drawn from its own tables,
    and the same summary into the README's headline block: `readme`, or the README.md one folder above
    the document's where it has the block ("" for none)."""
    from pdtb.figures.condense import condense
    from pdtb.figures.headline import readme_block, with_summary

    text = with_summary(condense(text))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    target = Path(readme) if readme else None if readme == "" else out.resolve().parent.parent / "README.md"
    block = readme_block(text)
    if target and block and target.is_file() and BEGIN in target.read_text():
        target.write_text(replace_block(target.read_text(), block))
        print(f"updated the headline in {target}")


def _write_section(path: str, heading: str, section: list[str], what: str, readme: str | None = None, **kw) -> int:
    """Replace (or insert) one section of the document at `path`, the others left as they are."""
    write_doc(path, replace_section(Path(path).read_text(), heading, section, **kw), readme)
    print(f"replaced the {what} section of {path}")
    return 0


def write_validation_page(doc: str | Path, sim_dir: str, stamp: str | None) -> None:
    """The simulator's validation page, beside the document."""
    from pdtb.figures.sim_section import VALIDATION_PAGE, validation_page

    page = validation_page(sim_dir, stamp)
    if page:
        path = Path(doc).parent / VALIDATION_PAGE
        path.write_text("\n".join(page).rstrip("\n") + "\n")
        print(f"wrote {path}")


def _stamp(commit: str) -> str:
    """When a section was measured, and on which commit."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"on {now}, commit {commit or 'unknown'}"


# --section NAME: the option (and what it takes) the section is drawn from
SECTION_NEEDS = {"migration": "--migration DIR", "transports": "--shm FILE...", "ray": "--ray-junit FILE",
                 "gpu": "--gpu DIR", "scorecard": "--scorecard DIR", "sim-speed": "--sim-speed FILE", "sim": "--sim DIR",
                 "chaos": "--chaos DIR", "router": "--router-files FILE...", "vllm": "--vllm DIR",
                 "summary": ""}  # summary: the opening summary (and the README's block) from the document as it is


def _run_stamp(commit_file: str | None, run_dir: str | None = None) -> str:
    """The stamp of a section: the commit in --commit-file, else the one its run wrote in run_dir."""
    return _stamp(_read(commit_file) or (_read(str(Path(run_dir) / "commit")) if run_dir else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.figures.results_doc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fair", help="directory of compare_fairness.sh result JSON files")
    ap.add_argument("--fair-command", default="bash scripts/compare_fairness.sh --quick",
                    help="the command that produced --fair (printed above its table)")
    ap.add_argument("--engine", help="pdtb bench engine --json output")
    ap.add_argument("--engine-beside", help="the same bench run beside results.sh's background simulations")
    ap.add_argument("--transport", nargs="*", default=[], help="pdtb bench transport --json outputs")
    ap.add_argument("--frontier", help="directory of scripts/frontier.sh sweep files (its --out)")
    ap.add_argument("--frontier-command", default="bash scripts/frontier.sh --quick")
    ap.add_argument("--sim", help="directory of scripts/sim_results.sh outputs")
    ap.add_argument("--prefix", help="directory of scripts/prefix_results.sh outputs")
    ap.add_argument("--prefix-command", default="bash scripts/prefix_results.sh --quick")
    ap.add_argument("--migration", help="directory of scripts/migration_results.sh outputs")
    ap.add_argument("--migration-command", default="bash scripts/migration_results.sh --quick")
    ap.add_argument("--shm", nargs="*", default=[], help="pdtb bench transport --backend shm --json outputs")
    ap.add_argument("--admissions", help="directory of scripts/compare_transports.sh outputs")
    ap.add_argument("--link", help="python -m pdtb.microbench.link --json output")
    ap.add_argument("--commit-file", help="file holding the commit the figures were measured on")
    ap.add_argument("--ray-junit", help="JUnit XML of tests/clusters/test_ray_cluster.py (scripts/ray_results.sh)")
    ap.add_argument("--ray-seconds", type=int, default=0)
    ap.add_argument("--gpu", help="directory of a scripts/gpu_check.sh run (its --out)")
    ap.add_argument("--scorecard", help="directory of a scripts/scorecard.sh run (its --out)")
    ap.add_argument("--scorecard-command", default="bash scripts/scorecard.sh --quick")
    ap.add_argument("--sim-speed", help="pdtb sim speed --json output")
    ap.add_argument("--chaos", help="directory of pdtb chaos reports (scripts/chaos_results.sh's --out)")
    ap.add_argument("--router-files", nargs="*", default=[], help="pdtb bench router --out files (scripts/router_results.sh)")
    ap.add_argument("--router-commands", nargs="*", default=[], help="the commands that wrote them, in order")
    ap.add_argument("--vllm", help="directory of a scripts/vs_vllm.sh run (its --out)")
    ap.add_argument("--section", choices=list(SECTION_NEEDS),
                    help="replace only this section of the existing --out (its own date and commit in its first "
                         "line), leaving the others as they are")
    ap.add_argument("--out", required=True)
    ap.add_argument("--readme", help="the README whose headline block is replaced with the document's summary "
                                     "(default: README.md one folder above --out, where it has the block; '' for none)")
    a = ap.parse_args(argv)
    if a.section:
        need = SECTION_NEEDS[a.section]
        if need and not getattr(a, need.split()[0][2:].replace("-", "_")):
            ap.error(f"--section {a.section} needs {need}")
        return _replace_one_section(a)
    run = Run.load(a, Path(__file__).resolve().parents[2])
    images = None
    if a.frontier:  # the frontier's plots go next to the document, under img/
        import shutil

        img = Path(a.out).parent / "img"
        img.mkdir(parents=True, exist_ok=True)
        for src in (Path(a.frontier) / "frontier" / "frontier.png", Path(a.frontier) / "report" / "attainment.png"):
            if src.exists():
                shutil.copyfile(src, img / src.name)
        images = "img"
    text = render(run, images, a.sim, a.prefix, a.prefix_command, a.migration, a.migration_command)
    write_doc(a.out, text, a.readme)
    print(f"wrote {a.out}")
    if a.sim:
        write_validation_page(a.out, a.sim, None)
    return 0


def _replace_one_section(a: argparse.Namespace) -> int:
    """--section: replace that section of the document at a.out, the others left as they are."""
    def write(heading: str, section: list[str], what: str, **kw) -> int:
        return _write_section(a.out, heading, section, what, a.readme, **kw)

    if a.section == "scorecard":
        from pdtb.figures.scorecard import SCORECARD_HEADING, results_section

        section = results_section(a.scorecard, a.scorecard_command, _run_stamp(a.commit_file, a.scorecard))
        return write(SCORECARD_HEADING, section, "scorecard", before="## Fairness at saturation")
    if a.section == "chaos":
        from pdtb.figures.chaos_section import CHAOS_HEADING, render as chaos_section

        return write(CHAOS_HEADING, chaos_section(a.chaos, _run_stamp(a.commit_file, a.chaos)),
                              "fault campaign", before="## Clusters placed by Ray")
    if a.section == "summary":
        write_doc(a.out, Path(a.out).read_text(), a.readme)
        print(f"rewrote the summary of {a.out}")
        return 0
    if a.section == "sim":
        from pdtb.figures.sim_section import SIM_HEADING, SPEED_HEADING, render as sim_section, speed_section

        stamp = _run_stamp(a.commit_file, a.sim)
        write_validation_page(a.out, a.sim, stamp)
        write(SIM_HEADING, sim_section(a.sim, stamp), "simulator", before=None)
        speed = Path(a.sim) / "speed.json"
        if speed.is_file():
            write(SPEED_HEADING, speed_section(json.loads(speed.read_text()), stamp), "simulator speed",
                           before=None)
        return 0
    if a.section == "sim-speed":
        from pdtb.figures.sim_section import SPEED_HEADING, speed_section

        section = speed_section(json.loads(Path(a.sim_speed).read_text()), _run_stamp(a.commit_file))
        return write(SPEED_HEADING, section, "simulator speed", before=None)  # after the simulator's
    if a.section == "vllm":
        from pdtb.figures.vllm_section import VLLM_HEADING, render as vllm_section

        return write(VLLM_HEADING, vllm_section(a.vllm, _run_stamp(a.commit_file, a.vllm)), "vLLM")
    if a.section == "router":
        from pdtb.figures.router_section import ROUTER_HEADING, render as router_section

        section = router_section(a.router_files, a.router_commands, _run_stamp(a.commit_file))
        return write(ROUTER_HEADING, section, "router")
    if a.section == "gpu":  # a page of its own beside the document: results.sh measures where there is no GPU
        from pdtb.figures.gpu_section import gpu_page

        page = Path(a.out).parent / GPU_PAGE
        page.write_text(gpu_page(a.gpu, _run_stamp(a.commit_file, a.gpu)))
        print(f"wrote {page}")
        return 0
    if a.section == "ray":
        section = ray_section(a.ray_junit, a.ray_seconds, _run_stamp(a.commit_file))
        return write(RAY_HEADING, section, "Ray")
    if a.section == "transports":
        shm = [json.loads(Path(f).read_text()) for f in a.shm]
        link = json.loads(Path(a.link).read_text()) if a.link else None
        section = transports_section(shm, a.admissions, _run_stamp(a.commit_file), link)
        return write(TRANSPORTS_HEADING, section, "transports", before="## Prefix caching")
    # the one left, migration: its stamp's commit is the run's own, else this checkout's
    measured = _read(str(Path(a.migration) / "commit"))
    stamp = _stamp(measured or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=Path(__file__).resolve().parents[2]).stdout.strip())
    return write(MIGRATION_HEADING, migration_section(a.migration, a.migration_command, stamp),
                          "migration")


if __name__ == "__main__":
    sys.exit(main())
