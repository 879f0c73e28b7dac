"""Denser forms of the results document's long sections: tables pivoted, grouped or transposed.

The renderers write every row and column (each run's own report keeps them: scorecard.md, prefix.md,
migration.md, the router's bench files); docs/results.md shows the dense form. This module holds the
policy comparisons' forms and the registry; condense_systems.py the systems sections'. `condense(text)`
rewrites the sections named in CONDENSERS and leaves every other line as it is. Each rewrite works
on the rendered markdown and is idempotent: a section already in its dense form comes back
unchanged, so the document can be passed through it on every write.

    blocks(lines) -> [[heading], [paragraph], [| table |], ...]   (blank lines between blocks)
    condenser(blocks) -> blocks                                     one per section heading
"""
from __future__ import annotations

import re
from collections.abc import Callable

from pdtb.figures import condense_systems as systems
from pdtb.figures.mdtables import (Block, blocks, find, grouped, join, lead_ins, md, prose, ratio, table,
                                  transpose_claims)


def fairness(bs: list[Block]) -> list[Block]:
    """The comparison with one row a policy and the modes side by side: each figure with its ratio to fcfs
    in brackets, the whales' TTFT and TPOT in one cell, and no failed column where none failed."""
    out = []
    for b in bs:
        t = table(b)
        if t and t[0][:2] == ["mode", "policy"]:
            b = _by_policy(*t)
        out.append(b)
    return out


def _by_policy(head: list[str], rows: list[list[str]]) -> Block:
    """`| mode | policy | figure | x fcfs | ... |` rows as one row a policy, the modes' columns side by side."""
    cols, names, k = [], [], 2  # cols: per output column, the input columns it joins
    while k < len(head):
        if k + 1 < len(head) and head[k + 1].startswith("x "):
            cols.append((k, k + 1, "({})"))
            names.append(f"{head[k].replace(' (ms)', ' ms')} ({head[k + 1]})")
            k += 2
        elif head[k] == "failed" and all(r[k] == "0" for r in rows):
            k += 1
        elif head[k].startswith("whale TTFT p50") and k + 1 < len(head) and head[k + 1].startswith("whale TPOT p50"):
            cols.append((k, k + 1, "/ {}"))
            names.append("whale TTFT / TPOT p50 ms")
            k += 2
        else:
            cols.append((k, None, ""))
            names.append(head[k])
            k += 1
    modes = list(dict.fromkeys(r[0] for r in rows))
    by = {(r[0], r[1]): r for r in rows}
    new_head = ["policy"] + [f"{m}: {n}" if i == 0 else n for m in modes for i, n in enumerate(names)]
    out = []
    for p in dict.fromkeys(r[1] for r in rows):
        row = [p]
        for m in modes:
            r = by.get((m, p))
            row += [("-" if r is None else r[a] + (" " + fmt.format(r[b]) if b else "")) for a, b, fmt in cols]
        out.append(row)
    return md(new_head, out)


def frontier(bs: list[Block]) -> list[Block]:
    """The two plots on one line."""
    out: list[Block] = []
    for b in bs:
        if out and len(b) == 1 and b[0].startswith("![") and len(out[-1]) == 1 and out[-1][0].startswith("!["):
            out[-1] = [out[-1][0] + " " + b[0]]
            continue
        out.append(b)
    return out


# --- the scorecard ----------------------------------------------------------------------------------

# the five figures of a scorecard cell, as the scenario tables name them (run scenarios / load sweeps)
SCORE_SLOTS = (("minnow TTFT p99 ms",), ("minnow ITL p99 ms",), ("whale E2E p50 ms",),
               ("out tok/s", "saturation tok/s"), ("goodput req/s", "max goodput req/s"))


def scorecard(bs: list[Block]) -> list[Block]:
    """The scenario tables as one: a row per scenario, a column per policy, five figures a cell."""
    scen, at, keep = [], None, []
    for i, b in enumerate(bs):
        if b[0].startswith("### Scenario ") and i + 1 < len(bs) and table(bs[i + 1]):
            at = len(keep) if at is None else at
            scen.append((b[0][len("### Scenario "):], *table(bs[i + 1])))
            continue
        if i and bs[i - 1][0].startswith("### Scenario ") and table(b):
            continue
        keep.append(b)
    if scen:
        pols = ["fcfs"] + sorted({r[0] for _, _, rows in scen for r in rows} - {"fcfs"})
        rows = []
        for name, head, rs in scen:
            by = {r[0]: r for r in rs}
            row = [name]
            for p in pols:
                r = by.get(p)
                if r is None:
                    row.append("-")
                    continue
                figs = []
                for names in SCORE_SLOTS:
                    j = next((head.index(n) for n in names if n in head), None)
                    figs.append("-" if j is None else r[j] if p == "fcfs" else ratio(r[j]))
                row.append(" / ".join(figs) + (" **yes**" if "yes" in r[head.index("Pareto")] else ""))
            rows.append(row)
        legend = ["Cells: minnow TTFT p99 / minnow ITL p99 / whale E2E p50 / output tok/s / goodput; fcfs's in ms, "
                  "tok/s and req/s, every other policy's x fcfs; in the frontier scenarios the last two are saturation "
                  "tok/s and max goodput. Whale TPOT, Jain index of page-seconds, moves and sim ms per step: the "
                  "run's scorecard.md."]
        if at and prose(keep[at - 1]):
            keep[at - 1] = [keep[at - 1][0] + " " + legend[0]]
            keep.insert(at, md(["scenario", *pols], rows))
        else:
            keep[at:at] = [legend, md(["scenario", *pols], rows)]
    i = find(keep, ["mode", "figure"])
    if i is not None:  # run-to-run noise: one row per mode
        head, rs = table(keep[i])
        figs = list(dict.fromkeys(r[1] for r in rs))
        by = {(r[0], r[1]): r for r in rs}
        modes = list(dict.fromkeys(r[0] for r in rs))
        def cell(r: list[str]) -> str:  # ratios (fcfs's spread), marked where they leave that spread
            return f"{r[2]} ({r[3]})" + (" **beyond noise**" if len(r) > 4 and r[4] == "beyond noise" else "")
        keep[i] = md([f"mode: {head[2]} (own spread, the larger of the two)", *figs],
                     [[m, *(cell(by[m, f]) if (m, f) in by else "-" for f in figs)] for m in modes])
    return lead_ins(transpose_claims(keep))


# --- the simulator ------------------------------------------------------------------------------------

def simulator(bs: list[Block]) -> list[Block]:
    """The reproductions' tables one row a source, their notes one paragraph; the Azure hour one row per
    set of equal figures."""
    out = []
    for b in transpose_claims(bs):
        t = table(b)
        if t and t[0][:2] == ["policy", "requests"] and len(t[1]) > 1 and "," not in t[1][0][0]:
            b = grouped(*t, vary=("simulation s", "command s"))
        elif len(b) > 1 and all(re.match(r"- \([a-z]\) ", x) for x in b):
            b = ["Notes: " + "; ".join(x[2:] for x in b) + "."]
        out.append(b)
    return lead_ins(out)


def speed(bs: list[Block]) -> list[Block]:
    """The policies with equal event and step counts in one row, their times listed in the same order."""
    out = []
    for b in bs:
        t = table(b)
        if t and t[0][:2] == ["policy", "hour: command s"] and len(t[1]) > 1 and "," not in t[1][0][0]:
            b = grouped(*t, vary=("hour: command s", "simulation s", "slice: every step s", "runs s", "speed-up"))
        out.append(b)
    return out


# section heading (its start) -> its condenser
CONDENSERS: dict[str, Callable[[list[Block]], list[Block]]] = {
    "## Fairness: colocated and disaggregated": fairness, "## Fairness at saturation": frontier,
    "## Scorecard": scorecard, "## The router": systems.router, "## Prefix caching": systems.prefix,
    "## Moving requests between decode nodes": systems.migration, "## Fault campaigns": systems.chaos,
    "## KV transports on one host": systems.transports, "## On a GPU": systems.gpu,
    "## Clusters placed by Ray": systems.ray, "## The simulator": simulator, "## How fast the simulator runs": speed,
}


def condense(text: str) -> str:
    """`text` with each section named in CONDENSERS in its dense form, every other line as it was."""
    lines = text.rstrip("\n").split("\n")
    starts = [i for i, x in enumerate(lines) if x.startswith("## ")] + [len(lines)]
    out = lines[:starts[0]]
    for i, j in zip(starts, starts[1:]):
        fn = next((f for h, f in CONDENSERS.items() if lines[i].startswith(h)), None)
        out += join(fn(blocks(lines[i:j]))) if fn else lines[i:j]
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"
