"""Dense forms of the results document's systems sections: router, prefix caching, migration, faults, transports.

Each takes a section's blocks as rendered (router_section.py, prefix_report.py, migration_report.py,
chaos_section.py, results_doc.py's transports and Ray sections, gpu_section.py) and returns them in
the form docs/results.md shows; each is idempotent (condense.py).
"""
from __future__ import annotations

import re

from pdtb.figures.mdtables import Block, find, lead_ins, md, prose, table


# --- the router ---------------------------------------------------------------------------------------

def _pivot_targets(head: list[str], rows: list[list[str]], units: tuple[str, ...] = ()) -> Block:
    """Rows of one run and several targets (router, relay, ...) as one row a run, `a / b` a cell."""
    groups: list[tuple[str, list[list[str]]]] = []
    for r in rows:
        if groups and groups[-1][0] == r[0] and all(x[1] != r[1] for x in groups[-1][1]):
            groups[-1][1].append(r)
        else:
            groups.append((r[0], [r]))
    out = []
    for run, rs in groups:
        row = [run]
        for j in range(2, len(head)):
            vals = [x[j] for x in rs]
            unit = units[j - 2] if j - 2 < len(units) else ""
            vals = [v[:-len(unit)] if unit and v.endswith(unit) else v for v in vals]
            row.append(" / ".join(vals) + unit)
        out.append([run, " / ".join(x[1] for x in rs), *row[1:]])
    return md(head, _rounds(out, units))


def _rounds(rows: list[list[str]], units: tuple[str, ...]) -> list[list[str]]:
    """Rows of one run and one target made in several rounds as one row, the rounds' cells joined by ", "."""
    by: dict[tuple[str, str], list[list[str]]] = {}
    for r in rows:
        by.setdefault((r[0], r[1]) if " / " not in r[1] else (r[0], r[1], id(r)), []).append(r)
    out = []
    for rs in by.values():
        row = list(rs[0][:2])
        for j in range(2, len(rs[0])):
            unit = units[j - 2] if j - 2 < len(units) else ""
            row.append(", ".join(x[j][:-len(unit)] if unit and x[j].endswith(unit) else x[j] for x in rs) + unit)
        out.append(row)
    return out


def router(bs: list[Block]) -> list[Block]:
    """Commands in one paragraph; router and relay side by side; the phases as columns."""
    out: list[Block] = []
    for b in bs:
        if out and out[-1] == ["Commands, in order:"] and all(x.startswith("- ") for x in b):
            out[-1] = ["Commands, in order: " + "; ".join(x[2:] for x in b) + "."]
            if len(out) > 2 and len(out[-2]) == 1 and out[-2][0].startswith("on ") and not out[-2][0].endswith("."):
                out[-2:] = [[out[-2][0] + ". " + out[-1][0]]]  # the stamp and the commands: one paragraph
            continue
        t = table(b)
        if t and t[0][:2] == ["run", "target"]:
            b = _pivot_targets(*t, units=(" ms", " us") if "CPU per request" in t[0] else
                               ("", "", " us") if "req/s" in t[0] else ())
        elif t and t[0][:2] == ["run", "phase"]:
            b = _pivot_phases(*t)
        elif prose(b) and out and prose(out[-1]) and (
                (b[0].startswith("CPU from the router") and "Commands, in order:" in out[-1][0])
                or (b[0].startswith("The same real cluster's router") and out[-1][0].startswith("One router's"))):
            out[-1] = [out[-1][0] + " " + b[0]]
            continue
        elif (len(b) == 1 and b[0].startswith("scripted ") and out and len(out[-1]) >= 1
              and (out[-1][-1].startswith("- scripted ") or out[-1][-1].startswith("scripted "))
              and not table(out[-1])):
            out[-1] = [x if x.startswith("- ") else "- " + x for x in out[-1]] + ["- " + b[0]]
            continue
        out.append(b)
    return out


def _pivot_phases(head: list[str], rows: list[list[str]]) -> Block:
    """`| run | phase | prompt tokens | output tokens | CPU per request | CPU per streamed token |` as one row a
    run and one column a phase (prompt+output tokens), `per request / per token` a cell."""
    phases = list(dict.fromkeys((r[1], r[2], r[3]) for r in rows))
    runs = list(dict.fromkeys(r[0] for r in rows))
    by = {(r[0], r[1]): r for r in rows}
    return md([f"run: {head[4]} / {head[5]}", *(f"{p} ({i}+{o})" for p, i, o in phases)],
              [[run, *(f"{by[run, p][4]} / {by[run, p][5]}" if (run, p) in by else "-" for p, _, _ in phases)]
               for run in runs])



TRACE = re.compile(r"### Trace replay, 1P\+1D: Mooncake (\w+) excerpt \((.+)\)$")


def prefix(bs: list[Block]) -> list[Block]:
    """The trace replays in one table; the shared-page charges with a column per rule."""
    out: list[Block] = []
    traces: list[tuple[str, str, list[str], list[list[str]], Block]] = []
    i = 0
    while i < len(bs):
        m = TRACE.match(bs[i][0])
        t = table(bs[i + 1]) if m and i + 1 < len(bs) else None
        if m and t:
            notes = bs[i + 2] if i + 2 < len(bs) and bs[i + 2][0].startswith("- ") else []
            if not traces:
                out.append([])  # where the merged table goes
            traces.append((m.group(1), m.group(2), *t, notes))
            i += 2 + bool(notes)
            continue
        out.append(bs[i])
        i += 1
    if traces:
        at = out.index([])
        head = traces[0][2]
        desc = "; ".join(f"{n}: {d}" for n, d, *_ in traces)
        out[at:at + 1] = [[f"### Trace replay, 1P+1D: Mooncake excerpts ({desc})"],
                          md(["trace", *head], [[n, *r] for n, _, _, rs, _ in traces for r in rs]),
                          [f"- {n}: {x[2:]}" for n, _, _, _, notes in traces for x in notes]]
    i = find(out, ["--charge-shared", "tenant"])
    j = find(out, ["--charge-shared", "minnow TTFT p99 ms"])
    if i is not None:
        head, rs = table(out[i])
        rules = list(dict.fromkeys(r[0] for r in rs))
        tenants = list(dict.fromkeys(r[1] for r in rs))
        by = {(r[0], r[1]): r for r in rs}
        rows = [[t, *(f"{by[r, t][2]} / {by[r, t][3]} / {by[r, t][4]} ({by[r, t][5]})" if (r, t) in by else "-"
                      for r in rules)] for t in tenants]
        if j is not None:
            h2, rs2 = table(out[j])
            by2 = {r[0]: r for r in rs2}
            rows += [[h, *(by2[r][k] if r in by2 else "-" for r in rules)] for k, h in enumerate(h2[1:], 1)]
            del out[j]
        if i and out[i - 1][0].startswith("Per tenant, the mean"):
            out[i - 1] = [out[i - 1][0] + " Tenant rows: pages held / shared / charged (TTFT p99 ms); then the "
                          "classes' figures."]
        out[i] = md(["--charge-shared", *rules], rows)
    return lead_ins([b for b in out if b])


def migration(bs: list[Block]) -> list[Block]:
    """The rebalancing runs with one row a setting (seeds side by side) and one line a setting against off."""
    out: list[Block] = []
    for b in bs:
        t = table(b)
        if t and t[0][:2] == ["--rebalance", "seed"]:
            head, rs = t
            seeds = list(dict.fromkeys(r[1] for r in rs))
            by = {(r[0], r[1]): r for r in rs}
            b = md([f"--rebalance (seed {' / '.join(seeds)})", *head[2:]],
                   [[s, *(" / ".join(by[s, x][k] for x in seeds if (s, x) in by) for k in range(2, len(head)))]
                    for s in dict.fromkeys(r[0] for r in rs)])
        elif b and all(re.match(r"- seed \S+: \w+ against \w+: ", x) for x in b):
            b = _by_setting(b)
        out.append(b)
    return out


def _by_setting(b: Block) -> Block:
    """"- seed 1: pressure against off: a **1.5x**, b 1.0x" lines as one line a setting, seeds joined by " / "."""
    groups: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {}
    for x in b:
        m = re.match(r"- seed (\S+): (\w+ against \w+): (.*)$", x)
        figs = [re.match(r"(.*) (\S+)$", f).groups() for f in m.group(3).split(", ")]
        groups.setdefault(m.group(2), []).append((m.group(1), figs))
    out = []
    for what, runs in groups.items():
        names = [n for n, _ in runs[0][1]]
        vals = [" / ".join(dict(figs).get(n, "-") for _, figs in runs) for n in names]
        seeds = " / ".join(s for s, _ in runs)
        out.append(f"- {what}, seed {seeds}: " + ", ".join(f"{n} {v}" for n, v in zip(names, vals)))
    return out


def chaos(bs: list[Block]) -> list[Block]:
    """The transports' commands in one paragraph."""
    out: list[Block] = []
    for b in bs:
        if prose(b) and re.match(r"\w+: `pdtb chaos ", b[0]):
            if out and out[-1][0].startswith("Commands: "):
                out[-1] = [out[-1][0][:-1] + "; " + b[0] + "."]
            else:
                out.append(["Commands: " + b[0] + "."])
            continue
        out.append(b)
    return out


def transports(bs: list[Block]) -> list[Block]:
    """The verdict listings, in lockstep and live, as one table: a row per verdict, a column per policy and
    transport (one column a policy where every transport counted the same); their paragraphs as one."""
    out: list[Block] = []
    parts = []  # (label, heads, counts per verdict, notes) per listing
    for b in bs:
        if b[0] == "```" and b[-1] == "```" and len(b) > 3 and b[1].split()[:2] == ["policy", "verdict"]:
            lock = bool(out) and out[-1][0].startswith("In lockstep")
            parts.append(("lockstep" if lock else "live", *_verdicts(b[1:-1], same=lock and "equal" in out[-1][0])))
            out.append(["<verdicts>"])
            continue
        out.append(b)
    if not parts:
        return out
    first, last = out.index(["<verdicts>"]), len(out) - 1 - out[::-1].index(["<verdicts>"])
    start = first
    while start > 0 and prose(out[start - 1]) and not out[start - 1][0].startswith("`python -m"):
        start -= 1
    paragraph = " ".join(b[0] for b in out[start:last] if b != ["<verdicts>"])
    verdicts = list(dict.fromkeys(v for _, _, rows, _ in parts for v in rows))
    head = ["verdict"] + [f"{lab} {h}" if len(parts) > 1 else h for lab, hs, _, _ in parts for h in hs]
    rows = [[v, *(c for _, hs, rs, _ in parts for c in rs.get(v, ["-"] * len(hs)))] for v in verdicts]
    notes = [n for *_, ns in parts for n in ns]
    return out[:start] + [[paragraph], md(head, rows)] + ([notes] if notes else []) + out[last + 1:]


def _verdicts(lines: list[str], same: bool) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """An admissions listing's column heads, its counts per verdict and its "vs zmq" lines worth keeping
    (none where the paragraph says every transport agreed; those on counts alone say what the table shows)."""
    transports_ = lines[0].split()[2:]
    counts: dict[str, dict[str, list[str]]] = {}
    notes = []
    for x in lines[1:]:
        pol, rest = x.split(None, 1)
        if rest.startswith("vs "):
            if not same and ("verdicts" in rest or "tokens" in rest):
                notes.append(f"- {pol} {rest}")
            continue
        verdict, *vals = rest.split()
        counts.setdefault(pol, {})[verdict] = vals
    head, cols = [], []
    for pol, c in counts.items():
        if all(len(set(v)) == 1 for v in c.values()):
            head.append(f"{pol} ({', '.join(transports_)})")
            cols.append((pol, 0))
        else:
            head += [f"{pol} {t}" for t in transports_]
            cols += [(pol, k) for k in range(len(transports_))]
    verdicts = list(dict.fromkeys(v for c in counts.values() for v in c))
    return head, {v: [counts[p].get(v, ["-"] * len(transports_))[k] for p, k in cols] for v in verdicts}, notes


def gpu(bs: list[Block]) -> list[Block]:
    """The run's stamp and the GPU tests' outcome in one paragraph."""
    if len(bs) > 2 and "gpu_check.sh` on " in bs[1][0] and bs[2][0].startswith("GPU tests ") and len(bs[1]) == 1:
        bs = [bs[0], [bs[1][0] + " " + bs[2][0]], *bs[3:]]
    return bs


def ray(bs: list[Block]) -> list[Block]:
    """The run's stamp and where it ran in one paragraph."""
    if len(bs) > 2 and prose(bs[1]) and prose(bs[2]) and bs[2][0].startswith("Every run so far"):
        bs = [bs[0], [bs[1][0] + " " + bs[2][0]], *bs[3:]]
    return bs
