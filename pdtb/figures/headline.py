"""The results document's opening summary and the README's headline block, drawn from the document's own tables.

Each line takes its figures from the text of a table further down docs/results.md, as the document
stands when it is written (sections come from several scripts and commits), and names the commit
its section was measured on. The README's block between its results markers is the same lines, so
the two always agree. A section that is absent, or whose table is not found, leaves its line out.

    with_summary(text) -> text    the block between SUMMARY_BEGIN and SUMMARY_END, before the first section
    readme_block(text) -> lines   the README's block for that document
"""
from __future__ import annotations

import re
from collections.abc import Callable

from pdtb.figures.mdtables import blocks, table

SUMMARY_BEGIN, SUMMARY_END = "<!-- summary:begin -->", "<!-- summary:end -->"
COMMIT = re.compile(r"commit ([0-9a-f]{7,40})")


def sections(text: str) -> dict[str, list[str]]:
    """Each "## " section's lines by its heading; "" holds the lines before the first."""
    out: dict[str, list[str]] = {"": []}
    cur = ""
    for line in text.split("\n"):
        if line.startswith("## "):
            cur = line
            out[cur] = []
        out[cur].append(line)
    return out


def _section(secs: dict[str, list[str]], start: str) -> list[str]:
    """The lines of the section whose heading starts with `start` ([] if none)."""
    return next((v for k, v in secs.items() if k and k.startswith(start)), [])


def _tables(lines: list[str]) -> list[tuple[list[str], list[list[str]]]]:
    return [t for b in blocks(lines) if (t := table(b))]


def _plain(cell: str) -> str:
    return cell.replace("**", "").strip()


def _commit(lines: list[str], default: str) -> str:
    m = COMMIT.search("\n".join(lines))
    return m.group(1) if m else default


# one function a line: the section's lines and the commit it was measured on in, the line out (None: left out)

def fairness(lines: list[str], commit: str, noise: list[str] = ()) -> str | None:
    for head, rows in _tables(lines):
        mf = next((r for r in rows if r[0] == "memfair"), None)
        if head[0] == "policy" and mf and any("minnow TTFT p99" in h for h in head):
            modes = [h.split(":")[0] for h in head if ": " in h]

            def ratios(name: str, bold: bool = False) -> str:
                vals = [re.search(r"\(([^)]*)\)", mf[k]).group(1).replace("**", "") + "x"
                        for k, h in enumerate(head) if name in h]
                return " / ".join(f"**{v}**" if bold else v for v in vals)
            return (f"- Quick comparison (`compare_fairness.sh --quick`), memfair against fcfs, {' / '.join(modes)}: "
                    f"minnow TTFT p99 {ratios('minnow TTFT p99', True)}, minnow ITL p99 {ratios('minnow ITL p99')}, "
                    f"output tok/s {ratios('output tok/s')}{spread(noise, modes)} (commit {commit}).")
    return None


def spread(noise: list[str], modes: list[str]) -> str:
    """The run-to-run range of memfair's ratios in the scorecard's repeats, per mode, and which leave
    fcfs's own spread ("" without the repeats' table)."""
    for head, rows in _tables(noise):
        if head and head[0].startswith("mode: memfair / fcfs, each repeat"):
            by = {r[0]: r for r in rows}
            parts, beyond = [], []
            for fig in ("minnow TTFT p99 ms", "minnow ITL p99 ms", "out tok/s"):
                if fig not in head:
                    continue
                k = head.index(fig)
                cells = []
                for m in modes:
                    if m not in by:
                        continue
                    vals = [float(x) for x in re.findall(r"([\d.]+)x", by[m][k].split("(")[0])]
                    if vals:
                        cells.append(f"{min(vals):.2f}-{max(vals):.2f}x")
                    if "beyond noise" in by[m][k]:
                        beyond.append(f"{fig.replace(' ms', '')} {m}")
                if cells:
                    parts.append(f"{fig.replace(' ms', '')} {' / '.join(cells)}")
            n = max((len(re.findall(r"[\d.]+x", r[1].split("(")[0])) for r in rows), default=0)
            if parts:
                return (f"; over {n} runs {', '.join(parts)}, beyond the run-to-run spread: "
                        f"{', '.join(beyond) or 'none'}")
    return ""


def frontier(lines: list[str], commit: str) -> str | None:
    cmd = next((x.strip("`") for x in lines if x.startswith("`bash scripts/frontier.sh")), "load sweeps")
    for head, rows in _tables(lines):
        if head[:2] == ["mode", "point"]:
            parts, bounds = [], []
            for mode in dict.fromkeys(r[0] for r in rows):
                by = {r[1]: r for r in rows if r[0] == mode}
                mf, base = by.get("memfair"), by.get("fcfs")
                if not (mf and base):
                    continue
                good, good_base = mf[2].replace(">= ", ""), base[2].replace(">= ", "")  # a bound: said below
                parts.append(f"{mode}: memfair's max goodput with every class at 90% attainment {good} req/s "
                             f"against fcfs's {good_base} (**{mf[3]}** x fcfs); saturation {mf[5]} x fcfs")
                bounds += [mode] if mf[2].startswith(">=") else []
            if parts:
                note = f" (memfair's goodput a lower bound in {', '.join(bounds)}: reached at the sweep's top)" \
                    if bounds else ""
                return f"- `{cmd}`, " + "; ".join(parts) + f"{note} (commit {commit})."
    return None


def vllm(lines: list[str], commit: str) -> str | None:
    offline, ttft, tok = [], [], []
    for head, rows in _tables(lines):
        if "identical outputs" in head and "ratio" in head:
            offline += [(_plain(r[head.index("ratio")]), _plain(r[head.index("identical outputs")])) for r in rows]
        if "minnow TTFT p99 (x vLLM)" in head and "system" in head:  # (pdtb/figures/vllm_section.py)
            j, k = head.index("minnow TTFT p99 (x vLLM)"), head.index("system")
            t = head.index("output tok/s (x vLLM)") if "output tok/s (x vLLM)" in head else None
            for r in rows:
                if r[k] == "memfair":
                    ttft += [float(x) for x in _plain(r[j]).split(" / ") if re.fullmatch(r"[\d.]+", x)]
                    tok += [float(x) for x in _plain(r[t]).split(" / ") if t is not None and re.fullmatch(r"[\d.]+", x)]
    parts = []
    if offline:
        parts.append(f"offline {', '.join(f'**{r}**' for r, _ in offline)} its tokens/s, outputs identical in "
                     f"{', '.join(i for _, i in offline)}")
    if ttft:
        parts.append(f"serving, memfair's minnow TTFT p99 {min(ttft):.2f}x to {max(ttft):.2f}x vLLM's"
                     + (f", its output tok/s {min(tok):.2f}x to {max(tok):.2f}x" if tok else ""))
    if not parts:
        return None
    return f"- Beside vLLM's CPU build, same checkpoint and budgets: {'; '.join(parts)} (commit {commit})."


def engine(lines: list[str], commit: str, gpu: list[str], gpu_commit: str) -> str | None:
    cpu = next((r[0][2] for h, r in _tables(lines) if "ratio (best/best)" in h), None)
    out = [f"**{_plain(cpu)}** `transformers.generate`'s tokens/s on this CPU (commit {commit})"] if cpu else []
    for head, rows in _tables(gpu):
        if head[0] == "engine" and "ratio" in head:
            r = next((r for r in rows if r[0] == "bfloat16, CUDA graphs"), None)
            if r:
                out.append(f"on an H200 **{_plain(r[head.index('ratio')])}** in bfloat16 with CUDA graphs")
        if head[0] == "batch" and "**fraction**" in head:
            fr = [_plain(r[head.index("**fraction**")]) for r in rows]
            out.append(f"decode steps at {fr[0]} to {fr[-1]} of the roofline (commit {gpu_commit})")
    return "- Paged engine: " + ", ".join(out) + "." if out else None


def transports(lines: list[str], commit: str, shm: list[str], shm_commit: str) -> str | None:
    out = []
    for head, rows in _tables(shm):
        if head[:2] == ["size (MiB)", "read GB/s"]:
            out.append(f"the shm backend reads at {' and '.join(_plain(r[2]).split()[0] for r in rows)} ZeroMQ ipc's "
                       f"GB/s ({' and '.join(r[0] for r in rows)} MiB; commit {shm_commit})")
    for head, rows in _tables(lines):
        if head[:2] == ["endpoint", "size (MiB)"]:
            out.append(f"the zmq transport at {' and '.join(_plain(r[4]) for r in rows)} raw pyzmq's GB/s "
                       f"({', '.join(r[0].split()[-1] for r in rows)}; commit {commit})")
    return "- KV transports: " + "; ".join(out) + "." if out else None


def prefix(lines: list[str], commit: str) -> str | None:
    for head, rows in _tables(lines):
        if head[:2] == ["trace", "prefix cache"]:
            on = next((r for r in rows if r[:2] == ["synthetic", "on"]), None)
            off = next((r for r in rows if r[:2] == ["synthetic", "off"]), None)
            if on and off:
                h, t = head.index("hit rate"), head.index("TTFT p50 ms")
                return (f"- Prefix caching, the Mooncake synthetic excerpt: hit rate {on[h]} of the trace's ideal "
                        f"{on[h + 1]}, TTFT p50 {on[t]} ms against {off[t]} ms without the cache (commit {commit}).")
    return None


def migration(lines: list[str], commit: str) -> str | None:
    for head, rows in _tables(lines):
        if head[0] == "transfer" and "downtime p50 ms" in head:
            by = {r[0]: r[head.index("downtime p50 ms")] for r in rows}
            if "precopy + final" in by and "stop-and-copy" in by:
                return (f"- Live migration: downtime p50 {by['precopy + final']} ms with precopy against "
                        f"{by['stop-and-copy']} ms stop-and-copy (commit {commit}).")
    return None


def chaos(lines: list[str], commit: str) -> str | None:
    for head, rows in _tables(lines):
        if head[:2] == ["transport", "campaign"] and "violations" in head:
            v = head.index("violations")
            viol = sum(int(r[v]) for r in rows if r[v].isdigit())
            return (f"- Fault campaigns ({', '.join(r[1] for r in rows[:1])}) over {', '.join(r[0] for r in rows)}: "
                    f"{viol} violations in {', '.join(r[3].split(':')[0] for r in rows)} requests (commit {commit}).")
    return None


def router(lines: list[str], commit: str) -> str | None:
    for head, rows in _tables(lines):
        if head[:2] == ["run", "target"] and "CPU per request" in head and rows:
            r = rows[0]
            req, tok = r[head.index("CPU per request")], r[head.index("CPU per streamed token")]
            if r[1].startswith("router / relay"):
                (a, b), (c, d) = req.removesuffix(" ms").split(" / "), tok.removesuffix(" us").split(" / ")
                return (f"- Router, {r[0]}: {a} ms of CPU per request and {c} us per streamed token (the relay's "
                        f"bound {b} ms, {d} us) (commit {commit}).")
            return f"- Router, {r[0]}: {req} of CPU per request and {tok} per streamed token (commit {commit})."
    return None


def simulator(lines: list[str], commit: str) -> str | None:
    out = []
    for head, rows in _tables(lines):
        if head and head[0] == "calibration" and rows and rows[0][0] == "held out on target":
            kept = head.index("logs") if "logs" in head else max(
                range(1, len(head)), key=lambda k: float(rows[0][k].split("= ")[-1].rstrip("%"))
                if head[k] not in ("repeat", "logs-speed") and "=" in rows[0][k] else -1)
            line = f"{rows[0][kept].split('= ')[-1]} of held-out figures on target against the testbed " \
                   f"({head[kept]} calibration)"
            pairs = next((r for r in rows if r[0].startswith("pairs of policies")), None)
            if pairs and "logs-speed" in head and "repeat" in head:
                k, rep = head.index("logs-speed"), head.index("repeat")
                line += (f"; pairs of policies ordered as the real run orders them {pairs[kept]}, {pairs[k]} with "
                         f"each run at its measured host speed, {pairs[rep]} for a second real run")
            out.append(line)
        if head and head[0] == "" and any("minnow TTFT p99" in h for h in head):
            r = next((r for r in rows if r[0] == "this run"), None)
            t = next((k for k, h in enumerate(head) if h == "memfair / fcfs, minnow TTFT p99"), None)
            i = next((k for k, h in enumerate(head) if h == "memfair / fcfs, minnow ITL p99"), None)
            if r and t and i:
                out.append(f"at H100 scale with 128K whales memfair's minnow TTFT p99 {r[t]} and ITL p99 {r[i]} fcfs's")
    return "- Simulator: " + "; ".join(out) + f" (commit {commit})." if out else None


def summary(text: str, link: str | None = None) -> list[str]:
    """The headline lines of the document `text` (its summary block ignored), pointing at `link` (None: at
    the tables below); [] when none is found."""
    secs = sections(strip_summary(text))
    top = _commit(secs[""], "unknown")

    def sec(start: str) -> tuple[list[str], str]:
        lines = _section(secs, start)
        return lines, _commit(lines, top)
    items: list[Callable[[], str | None]] = [
        lambda: fairness(*sec("## Fairness: colocated"), _section(secs, "## Scorecard")),
        lambda: frontier(*sec("## Fairness at saturation")),
        lambda: vllm(*sec("## Beside vLLM")),
        lambda: engine(*sec("## Paged engine"), *sec("## On a GPU")),
        lambda: transports(*sec("## KV transport against raw pyzmq"), *sec("## KV transports on one host")),
        lambda: prefix(*sec("## Prefix caching")), lambda: migration(*sec("## Moving requests")),
        lambda: chaos(*sec("## Fault campaigns")), lambda: router(*sec("## The router")),
        lambda: simulator(*sec("## The simulator"))]
    lines = []
    for item in items:
        try:
            line = item()
        except (ValueError, IndexError, KeyError):  # a table of another shape: its line left out
            line = None
        if line:
            lines.append(line)
    if not lines:
        return []
    where = "a table below" if link is None else f"a table of [{link}]({link})"
    return [f"Headline figures, each from {where} (every row and column there); the commit beside each is the "
            "one its section was measured on.", "", *lines]


def strip_summary(text: str) -> str:
    """`text` without its summary block."""
    i, j = text.find(SUMMARY_BEGIN), text.find(SUMMARY_END)
    if i < 0 or j < i:
        return text
    return text[:i].rstrip("\n") + "\n\n" + text[j + len(SUMMARY_END):].lstrip("\n")


def with_summary(text: str) -> str:
    """`text` with its summary block rewritten from its own tables, before its first section."""
    body = strip_summary(text)
    lines = summary(body)
    if not lines:
        return body
    head, sep, rest = body.partition("\n## ")
    return head.rstrip("\n") + "\n\n" + "\n".join([SUMMARY_BEGIN, *lines, SUMMARY_END]) + "\n" + \
        (("\n## " + rest) if sep else "")


def readme_block(text: str) -> list[str]:
    """The README's headline lines for the document `text`: its summary, linked from the README."""
    return summary(text, link="docs/results.md")
