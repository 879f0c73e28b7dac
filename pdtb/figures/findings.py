"""docs/findings.md: what the testbed found, one section for each of the essay's claims and open
questions, each with its answer, the figures behind it, a plot and the command that reproduces
it. Written by `bash scripts/results.sh` from one run's folders (scripts/findings.sh runs the
experiments that only this page needs); every sentence's figures come from those files.

    python -m pdtb.figures.findings --runs DIR --out docs/findings.md [--results docs/results.md]

DIR (results.sh's --out) holds: fair/ (compare_fairness.sh --quick, every policy, both modes),
frontier/ (frontier.sh --quick), scorecard/ (scorecard.sh with the real quick runs of fair/),
findings/quota-MODE/ (the essay's setting at H100 scale: fcfs and memfair at each quota
granularity, static shares, and in disagg memfair with fcfs decode nodes), findings/nodecode/
(the real disaggregated cluster with memfair prefill and fcfs decode nodes), findings/claims/
(pdtb sim reproduce essay across the minnows' load; the setting with 5% whales in memory is the
scorecard's sim-essay-top5.json). A part that is absent leaves its figures out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdtb.figures import findings_plots as fp
from pdtb.figures.scorecard import run_figures, scenario

MODES = ("colocated", "disagg")
VARIANTS = {"memfair": "per tenant", "memfair-request": "per request", "memfair-priority": "per priority",
            "memfair-tier": "per SLO tier"}
NAMES = {"memfair-fcfs-decode": "memfair prefill, fcfs decode", "fcfs": "fcfs on both sides",
         "memfair": "memfair on both sides"}
CLOSE = 1.25  # a policy "comes near" memfair when its minnow TTFT p99 is within this factor of memfair's


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f} ms" if v >= 100 else f"{v:.1f} ms"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ratio(a, b):
    return a / b if a is not None and b else None


class Runs:
    """The folders of one results.sh run, read once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fair = {m: {f.stem[len(m) + 1:]: _load(f) for f in sorted((root / "fair").glob(f"{m}-*.json"))}
                     for m in MODES}
        self.figs = {m: {p: run_figures(d) for p, d in runs.items()} for m, runs in self.fair.items()}
        nd = sorted((root / "findings" / "nodecode").glob("disagg-*.json"))
        self.nodecode = _load(nd[0]) if nd else None
        self.quota = {m: scenario(root / "findings" / f"quota-{m}") for m in MODES
                      if (root / "findings" / f"quota-{m}").is_dir()}
        tight = root / "findings" / "decode-tight"
        self.tight = scenario(tight) if tight.is_dir() else None
        self.moves = {}  # (folder, label) -> a simulated run's minnow preemptions and demotions per minnow
        for f in sorted(f for d in ("quota-colocated", "quota-disagg", "decode-tight")
                        for f in (root / "findings" / d).glob("*.json")):
            doc = _load(f) or {}
            ev = (((doc.get("meta") or {}).get("sim") or {}).get("evictions") or {}).get("minnow")
            if ev is not None:
                n = sum(1 for q in doc["requests"] if q.get("class") == "minnow")
                self.moves[(f.parent.name, f.stem)] = (ev.get("preempt", 0) + ev.get("demote", 0)) / max(n, 1)
        sc = root / "scorecard"
        self.cards = [scenario(f) for f in sorted(sc.iterdir()) if f.is_dir() and any(f.glob("*.json"))] \
            if sc.is_dir() else []
        self.claims = sorted((d for f in sorted((root / "findings" / "claims").glob("rate-*.json"))
                              if (d := _load(f))), key=lambda d: d["config"]["minnow_rate"])
        self.top5 = _load(sc / "sim-essay-top5.json")  # (the scorecard's run of the 5%-whales setting)
        self.noise = None  # the largest run-to-run spread of the quick comparison's minnow TTFT p99 (scorecard repeats)
        if sc.is_dir():
            from pdtb.figures.scorecard import repeats_table

            for row in repeats_table(sc)[2:]:
                cells = [c.strip() for c in row.strip("|").split("|")]
                if cells[1] == "minnow TTFT p99 ms" and cells[3].endswith("x"):
                    self.noise = max(self.noise or 0.0, float(cells[3][:-1]))
        self.sweeps = {}
        from pdtb.figures.frontier import point

        for f in sorted((root / "frontier").glob("*.json")):
            doc = _load(f)
            if isinstance(doc, dict) and (doc.get("meta") or {}).get("kind") == "sweep":
                levels = sorted({lv["load"] for lv in doc["levels"]})
                at = levels[1] if len(levels) > 1 else levels[0]
                self.sweeps[f.stem] = point(doc, "minnow", at)

    def fig(self, mode: str, policy: str, key: str):
        return (self.figs.get(mode, {}).get(policy) or {}).get(key)

    def vs_fcfs(self, mode: str, policy: str, key: str):
        return _ratio(self.fig(mode, policy, key), self.fig(mode, "fcfs", key))


def whale_share(doc: dict) -> float | None:
    """The whales' mean share of the serving pool's device pages over the samples that hold any."""
    times, shares = fp.share_series(doc)
    whales = {str(q.get("tenant")) for q in doc.get("requests", []) if q.get("class") == "whale"}
    used = [sum(s[i] for s in shares.values()) for i in range(len(times))]
    pts = [sum(shares[t][i] for t in whales if t in shares) for i in range(len(times)) if used[i] > 0]
    return sum(pts) / len(pts) if pts else None


def _section(title: str, answer: list[str], body: list[str], img: str | None, command: str) -> list[str]:
    out = [f"## {title}", "", " ".join(answer), "", *body]
    if img:
        out += ["", f"![{title}](img/{img})"]
    return out + ["", f"Reproduce: `{command}`", ""]


def claim_64x(r: Runs, img: Path) -> list[str]:
    fcfs = {m: whale_share(r.fair[m]["fcfs"]) for m in MODES if "fcfs" in r.fair[m]}
    mem = {m: whale_share(r.fair[m]["memfair"]) for m in MODES if "memfair" in r.fair[m]}
    docs = r.fair["colocated"].get("fcfs")
    n = len(docs["requests"]) if docs else 0
    whales = sum(1 for q in (docs or {}).get("requests", []) if q.get("class") == "whale")
    pages = r.claims[0]["pages"]["page_ratio"] if r.claims else None
    answer = [f"Yes, by construction of the paged pool: a 131,072-token prompt takes {pages:g} times the pages of a "
              "2,048-token one at H100 scale, and the CPU testbed's whales (1,024+1,024 or 1,984+64 tokens) take "
              "64 times its minnows' (24+8)." if pages else "The page ratio is the pool's arithmetic: 64x.",
              f"The cost is not only arithmetic: whales are {whales} of the {n} requests of the quick comparison, "
              f"yet under fcfs they hold {_pct(fcfs.get('colocated'))} of the colocated node's device KV on "
              f"average and {_pct(fcfs.get('disagg'))} of the decode node's;"
              f" under memfair {_pct(mem.get('colocated'))} and {_pct(mem.get('disagg'))}."]
    if all(mem.get(m) is not None and fcfs.get(m) is not None and mem[m] >= fcfs[m] - 0.05 for m in fcfs):
        answer.append("memfair does not take that memory from the whales: it changes who waits and who is moved, "
                      "not who holds the pool (the minnows' share is small either way; their cost is time).")
    panels = {f"{m} / {p}": r.fair[m][p] for m in MODES for p in ("fcfs", "memfair") if p in r.fair[m]}
    name = None
    if panels:
        fp.kv_share(panels, img / "findings-kv-share.png")
        name = "findings-kv-share.png"
    body = ["| mode | whales' mean share of device KV, fcfs | memfair | requests that are whales |", "|---|---|---|---|"]
    body += [f"| {m} | {_pct(fcfs.get(m))} | {_pct(mem.get(m))} | {whales} of {n} |" for m in fcfs]
    return _section("A long request holds 64 times the memory", answer, body, name,
                    "bash scripts/compare_fairness.sh --quick --policies \"fcfs memfair\"")


def claims_hbm_evictions(r: Runs, img: Path) -> list[list[str]]:
    if not r.claims:
        return []
    pts = [{"rate": d["config"]["minnow_rate"], "top5": d["top5"], "evictions": d["evictions"]} for d in r.claims]
    fp.claims_by_load(pts, img / "findings-claims.png")
    rows = ["| minnows/s | top 5%: share of HBM mean / max | share of KV in use | requests in memory | "
            "minnow evictions per request, fcfs: with / without whales (ratio) | memfair: with / without | "
            "memfair / fcfs, minnow TTFT p99 / ITL p99 |", "|---|---|---|---|---|---|---|"]
    for p, d in zip(pts, r.claims):
        ev = p["evictions"]
        rows.append(f"| {p['rate']:g} | {_pct(p['top5']['pool_mean'])} / {_pct(p['top5']['pool_max'])} | "
                    f"{_pct(p['top5']['used_mean'])} | {p['top5']['requests_in_pool_mean']:.0f} | "
                    f"{ev['fcfs']['with_whales']:.3f} / {ev['fcfs']['alone']:.3f} ({_x(ev['fcfs']['ratio'])}) | "
                    f"{ev['memfair']['with_whales']:.3f} / {ev['memfair']['alone']:.3f} | "
                    f"{_x((d.get('memfair_over_fcfs') or {}).get('minnow_ttft_p99'))} / "
                    f"{_x((d.get('memfair_over_fcfs') or {}).get('minnow_itl_p99'))} |")
    t5 = r.top5
    means = [p["top5"]["pool_mean"] for p in pts]
    maxes = [p["top5"]["pool_max"] for p in pts]
    hbm = [f"No, not in the essay's own setting: across {len(pts)} loads of 128K whales among 2K minnows on one "
           f"H100, the largest 5% of the requests in memory hold {_pct(min(means))} to {_pct(max(means))} of HBM on "
           f"average (at most {_pct(max(maxes))}), because a pool that fits three 128K prompts holds about a hundred "
           "minnows beside them, so the top 5% is one whale or none and a few minnows."]
    if t5:
        hbm.append(f"The essay's ~80% is what the arithmetic gives when 5% of the requests in memory are whales: "
                   f"with {t5['config']['whales']} whales every {t5['config']['whale_interval']:g} s among "
                   f"{t5['config']['minnow_rate']:g} minnows/s the top 5% hold {_pct(t5['top5']['used_mean'])} of the "
                   f"KV in use ({_pct(t5['top5']['by_hand_used'])} by hand) and {_pct(t5['top5']['pool_mean'])} of "
                   "HBM on average.")
    hbm.append("The claim describes a pool where whales are resident long enough to be the 5%, not every pool.")
    finite = [(p["rate"], p["evictions"]["fcfs"]["ratio"]) for p in pts if p["evictions"]["fcfs"]["ratio"]]
    none = [p["rate"] for p in pts if not p["evictions"]["fcfs"]["alone"]]
    ev = []
    if none:
        ev.append(f"Only where minnows are evicted on their own can the ratio exist: at {', '.join(f'{x:g}' for x in none)} "
                  "minnows/s they never are, and every eviction with whales is theirs.")
    if finite:
        ev.append("Where they are, whales multiply the minnows' evictions by "
                  + ", ".join(f"{v:.2f}x at {x:g}/s" for x, v in finite)
                  + (" -- the essay's 2-4x at the load where minnows first overflow the pool, less above it, where "
                     "they overflow it by themselves." if any(2 <= v <= 4 for _, v in finite) else "."))
    mem = [(p["rate"], p["evictions"]["memfair"]["with_whales"], p["evictions"]["fcfs"]["with_whales"]) for p in pts]
    worse = [(x, m, f) for x, m, f in mem if m > 2 * f and m > 0.05]
    if worse:
        ev.append("memfair does not lower this figure, it raises it: "
                  + ", ".join(f"{m:.2f} moves per minnow against fcfs's {f:.2f} at {x:g}/s" for x, m, f in worse)
                  + " (demotions to the host tier and preemptions together).")
    cmd = "pdtb sim reproduce essay --minnow-rate R --json"
    return [_section("The top 5% of requests hold about 80% of HBM", hbm, rows, "findings-claims.png", cmd),
            _section("Whales raise minnow evictions 2-4x", ev or ["No run evicted a minnow."],
                     ["The figures: the table of the section above."], "findings-claims.png", cmd)]


def _variant_row(card: dict | None, label: str) -> dict:
    row = next((x for x in (card or {}).get("rows", []) if x["label"] == label), None)
    return row["ratio"] if row else {}


def quota_questions(r: Runs, img: Path) -> list[list[str]]:
    keys = {"minnow_ttft_p99": "minnow TTFT p99", "out_tok_s": "output tok/s", "whale_e2e_p50": "whale E2E p50"}
    out = []
    for title, variants, fname in (
            ("Quota granularity: per tenant, request, priority or SLO tier", VARIANTS, "findings-granularity.png"),
            ("Static against dynamic quotas", {"memfair": "dynamic (borrowing)", "memfair-static": "static"},
             "findings-static.png")):
        groups, rows = {}, ["| variant | setting | minnow TTFT p99 x fcfs | output tok/s x fcfs | whale E2E p50 x fcfs | "
                            "max goodput req/s (fcfs's) |", "|---|---|---|---|---|---|"]
        for m in MODES:
            cpu = {}
            fc = r.sweeps.get(f"fcfs-{m}")
            for v in variants:
                s = r.sweeps.get(f"{v}-{m}")
                if s and fc:
                    ratio = {"minnow_ttft_p99": _ratio(s["ttft_p99_ms"], fc["ttft_p99_ms"]),
                             "out_tok_s": _ratio(s["saturation_tok_s"], fc["saturation_tok_s"])}
                    cpu[variants[v]] = ratio
                    bound = ">= " if s["goodput_at_top"] else ""
                    rows.append(f"| {variants[v]} | CPU {m}, load {s['at_load']:g} (saturation tok/s) | "
                                f"{_x(ratio['minnow_ttft_p99'])} | {_x(ratio['out_tok_s'])} | - | "
                                f"{bound}{s['max_goodput_rps']:.2f} ({fc['max_goodput_rps']:.2f}) |")
            if cpu:
                groups[f"CPU {m} (frontier, x fcfs)"] = cpu
            h100 = {}
            for v in variants:
                ratio = _variant_row(r.quota.get(m), v)
                if ratio:
                    h100[variants[v]] = ratio
                    rows.append(f"| {variants[v]} | H100 {m}, essay setting | {_x(ratio.get('minnow_ttft_p99'))} | "
                                f"{_x(ratio.get('out_tok_s'))} | {_x(ratio.get('whale_e2e_p50'))} | - |")
            if h100:
                groups[f"H100 {m} (essay setting, x fcfs)"] = h100
        if groups:
            fp.variant_bars(groups, img / fname, keys)
        answer = _quota_answer(groups, variants, r.noise)
        out.append(_section(title, answer, rows, fname if groups else None,
                            "bash scripts/frontier.sh --quick; bash scripts/findings.sh --out DIR"))
    return out


def _quota_answer(groups: dict, variants: dict, noise: float | None = None) -> list[str]:
    """Which variant gave the minnows the lowest tail, setting by setting, and what it cost."""
    lines = []
    for g, vs in groups.items():
        scored = [(v, x.get("minnow_ttft_p99"), x.get("out_tok_s")) for v, x in vs.items()
                  if x.get("minnow_ttft_p99") is not None]
        if not scored:
            continue
        best = min(scored, key=lambda t: t[1])
        worst = max(scored, key=lambda t: t[1])
        spread = worst[1] / best[1] if best[1] else None
        head = (f"{g.split(' (')[0]}: every variant within 10% of the others, minnow TTFT p99 {_x(best[1])} to "
                f"{_x(worst[1])} fcfs's" if spread is not None and spread < 1.1 else
                f"{g.split(' (')[0]}: {best[0]} gives the minnows' lowest TTFT p99 ({_x(best[1])} fcfs's), "
                f"{worst[0]} the highest ({_x(worst[1])})" + (f", a spread of {spread:.1f}x" if spread else ""))
        lines.append(head
                     + (f"; output tok/s {min(t[2] for t in scored if t[2]):.2f}x to {max(t[2] for t in scored if t[2]):.2f}x"
                        if any(t[2] for t in scored) else "") + ".")
    if not lines:
        return ["No run of this part."]
    tail = "Every variant is read beside fcfs in the same run; a CPU figure is one sweep per point"
    tail += (f", and the quick comparison's minnow TTFT p99 moves by up to {noise:.2f}x between runs (results.md, the "
             "scorecard's repeats): a CPU difference below that is noise." if noise else ".")
    return lines + [tail]


def _past_capacity(claims: list[dict]) -> list[str]:
    """Where memfair's minnow tail loses to fcfs's in the essay reproduction: how far past capacity
    the node is there (fcfs's minnow TTFT p99 with whales against the minnows alone), and what
    memfair changes below the tail (the median TTFT, the ITL p99)."""
    out = []
    for d in claims:
        mo, runs = d.get("memfair_over_fcfs") or {}, d.get("runs") or {}
        f, a, m = runs.get("fcfs") or {}, runs.get("fcfs_alone") or {}, runs.get("memfair") or {}
        need = (mo.get("minnow_ttft_p99"), f.get("minnow_ttft_p99_ms"), a.get("minnow_ttft_p99_ms"),
                f.get("minnow_ttft_p50_ms"), m.get("minnow_ttft_p50_ms"))
        if None in need or need[0] <= 1.0 or not need[3]:
            continue
        out.append(f"At {d['config']['minnow_rate']:g} minnows/s the node is past its capacity with the whales: "
                   f"fcfs's minnow TTFT p99 is {_ms(need[1])} against {_ms(need[2])} with the minnows alone, the "
                   "backlog of whale prefill that every order must serve; memfair moves the minnows ahead of it "
                   f"(TTFT p50 {need[4] / need[3]:.2f}x fcfs's"
                   + (f", ITL p99 {mo['minnow_itl_p99']:.2f}x" if mo.get("minnow_itl_p99") is not None else "")
                   + ") but not the last of them.")
        break  # (the lowest such load: the others read the same way)
    return out


def frontier_question(r: Runs, img: Path, vllm_line: str | None) -> list[str]:
    rows = ["| scenario | on the Pareto front | memfair: minnow TTFT p99 / tok/s x fcfs | "
            f"within {CLOSE}x of memfair's minnow TTFT p99, at >= 0.95x its tok/s |", "|---|---|---|---|"]
    near_all = []
    for c in r.cards:
        if c["kind"] != "run":
            continue
        mf = next((x for x in c["rows"] if x["label"] == "memfair"), None)
        front = [x["label"] for x in c["rows"] if x["pareto"]]
        near = []
        if mf and mf["minnow_ttft_p99"]:
            near = [x["label"] for x in c["rows"] if x["label"] not in ("memfair", "fcfs")
                    and x["minnow_ttft_p99"] is not None and x["minnow_ttft_p99"] <= CLOSE * mf["minnow_ttft_p99"]
                    and (x["out_tok_s"] or 0) >= 0.95 * (mf["out_tok_s"] or 0)]
            near_all += [(c["name"], n) for n in near]
        rows.append(f"| {c['name']} | {', '.join(front)} | "
                    f"{_x((mf or {}).get('ratio', {}).get('minnow_ttft_p99'))} / "
                    f"{_x((mf or {}).get('ratio', {}).get('out_tok_s'))} | {', '.join(near) or '-'} |")
    name = None
    if r.cards:
        fp.policy_plane(r.cards, img / "findings-frontier.png")
        name = "findings-frontier.png"
    runs = [c for c in r.cards if c["kind"] == "run"]
    on = sum(1 for c in runs if any(x["label"] == "memfair" and x["pareto"] for x in c["rows"]))
    kept = [c for c in runs if any(x["label"] == "memfair" and (x["ratio"].get("out_tok_s") or 0) >= 0.95
                                   for x in c["rows"])]
    crowded = [c["name"] for c in runs if sum(x["pareto"] for x in c["rows"]) >= len(c["rows"]) - 1 > 1]
    answer = [f"memfair is on the fairness-throughput front in {on} of {len(runs)} scenarios, and keeps at least 0.95x "
              f"fcfs's output tok/s in {len(kept)} of them."]
    if crowded:
        answer.append(f"The front separates little in {', '.join(crowded)}: nearly every policy is on it, each "
                      "trading one figure for another (the minnows' tail, the whales' E2E, throughput).")
    scale = [(d["config"]["minnow_rate"], d["memfair_over_fcfs"]["minnow_ttft_p99"]) for d in r.claims
             if d.get("memfair_over_fcfs")]
    if scale:
        lost = [f"{x:g}/s" for x, v in scale if v > 1.0]
        answer.append("Its gain depends on load: in the essay's setting memfair's minnow TTFT p99 is "
                      + ", ".join(f"{v:.2f}x fcfs's at {x:g} minnows/s" for x, v in scale)
                      + (f"; at {', '.join(lost)} it is worse than fcfs, a case the policy does not yet win."
                         if lost else "."))
        answer += _past_capacity(r.claims)
    if near_all:
        by = {}
        for sc, p in near_all:
            by.setdefault(p, []).append(sc)
        answer.append("It is not alone: " + "; ".join(f"{p} comes within {CLOSE}x of its minnow TTFT p99 in "
                                                       f"{', '.join(s)}" for p, s in sorted(by.items()))
                      + ". Where a simpler policy does as well, the essay's claim that memory-fair admission is "
                        "needed holds only for the scenarios it does not reach.")
    for m in MODES:
        s, f = r.sweeps.get(f"memfair-{m}"), r.sweeps.get(f"fcfs-{m}")
        if s and f:
            bound = ">= " if s["goodput_at_top"] else ""
            answer.append(f"On the real CPU cluster ({m}) memfair's max goodput is {bound}{s['max_goodput_rps']:.2f} "
                          f"req/s against fcfs's {f['max_goodput_rps']:.2f}"
                          + (" (the top of the grid: a lower bound)" if s["goodput_at_top"] else "") + ".")
    body = rows + ([f"", f"Beside vLLM: {vllm_line.lstrip('- ')}"] if vllm_line else [])
    return _section("The fairness-throughput frontier", answer, body, name,
                    "bash scripts/scorecard.sh --quick; bash scripts/frontier.sh --quick")


def disagg_question(r: Runs, img: Path) -> list[str]:
    keys = (("minnow_ttft_p99", "minnow TTFT p99"), ("minnow_itl_p99", "minnow ITL p99"),
            ("whale_e2e_p50", "whale E2E p50"), ("out_tok_s", "output tok/s"))
    configs = [("colocated", "fcfs", r.figs["colocated"].get("fcfs")),
               ("colocated", "memfair", r.figs["colocated"].get("memfair")),
               ("disagg", "fcfs", r.figs["disagg"].get("fcfs")),
               ("disagg", "memfair prefill, fcfs decode", run_figures(r.nodecode) if r.nodecode else None),
               ("disagg", "memfair", r.figs["disagg"].get("memfair"))]
    rows = ["| setting | mode | cluster | " + " | ".join(h for _, h in keys) + " | minnows preempted or demoted, "
            "per minnow |", "|---|---|---|" + "---|" * (len(keys) + 1)]
    for mode, label, f in configs:
        if f:
            rows.append(f"| CPU | {mode} | {label} | " + " | ".join(
                _ms(f[k]) if k != "out_tok_s" else f"{f[k]:.0f}" for k, _ in keys) + " | - |")
    sims = [(f"quota-{m}", m, "", r.quota.get(m)) for m in MODES] + [("decode-tight", "disagg", ", 12,800 decode pages",
                                                                        r.tight)]
    for folder, m, note, card in sims:
        for x in (card or {}).get("rows", []):
            if x["label"] in ("fcfs", "memfair", "memfair-fcfs-decode"):
                moves = r.moves.get((folder, x["label"]))
                rows.append(f"| H100 | {m}{note} | {NAMES.get(x['label'], x['label'])} | " + " | ".join(
                    (_ms(x[k]) if k != "out_tok_s" else f"{x[k]:.0f}") if x[k] is not None else "-" for k, _ in keys)
                    + f" | {'-' if moves is None else f'{moves:.3f}'} |")
    answer = []
    fc, fd = r.figs["colocated"].get("fcfs"), r.figs["disagg"].get("fcfs")
    if fc and fd:
        answer.append(f"Inheriting pages hurts a decode pool that does not re-admit them: under fcfs the minnows' ITL "
                      f"p99 is {_ms(fd['minnow_itl_p99'])} disaggregated against {_ms(fc['minnow_itl_p99'])} "
                      f"colocated on the CPU cluster: the decode node, which took no part in admitting the whales, "
                      f"holds their pages while the minnows handed to it wait (its pages over time: the plot below).")
    nd, md = (run_figures(r.nodecode) if r.nodecode else None), r.figs["disagg"].get("memfair")
    if nd and md and fd:
        answer.append(f"Fair admission at the prefill side alone does not fix it: memfair prefill with fcfs decode gives "
                      f"minnow ITL p99 {_ms(nd['minnow_itl_p99'])} and TTFT p99 {_ms(nd['minnow_ttft_p99'])}; with "
                      f"re-admission at the decode side {_ms(md['minnow_itl_p99'])} and {_ms(md['minnow_ttft_p99'])}.")
    mc = r.figs["colocated"].get("memfair")
    if md and mc:
        answer.append(f"With it, the disaggregated cluster's minnows see TTFT p99 {_ms(md['minnow_ttft_p99'])} "
                      f"against {_ms(mc['minnow_ttft_p99'])} colocated, at {md['out_tok_s']:.0f} against "
                      f"{mc['out_tok_s']:.0f} output tok/s.")
    answer += _h100_disagg(r)
    panels = {}
    if "memfair" in r.fair["disagg"]:
        panels["memfair on both sides"] = r.fair["disagg"]["memfair"]
    if r.nodecode:
        panels["memfair prefill, fcfs decode"] = r.nodecode
    if "fcfs" in r.fair["disagg"]:
        panels["fcfs on both sides"] = r.fair["disagg"]["fcfs"]
    name = None
    if panels:
        fp.decode_quota(panels, img / "findings-decode-quota.png")
        name = "findings-decode-quota.png"
    cdf = {f"{m} {p}": r.fair[m][p] for m in MODES for p in ("fcfs", "memfair") if p in r.fair[m]}
    body = list(rows)
    if cdf:
        fp.ttft_cdfs(cdf, img / "findings-ttft-cdf.png")
        body += ["", "![TTFT CDFs](img/findings-ttft-cdf.png)"]
    return _section("Disaggregation: inherited pages and re-admission at the decode side",
                    answer or ["No run of this part."], body, name,
                    "bash scripts/compare_fairness.sh --quick --modes disagg --policies memfair-fcfs-decode=memfair "
                    "--decode-policy fcfs")


def _h100_disagg(r: Runs) -> list[str]:
    """What decode-side re-admission changes at H100 scale, with the essay's decode pool and a tight one."""
    def row(card, label):
        return next((x for x in (card or {}).get("rows", []) if x["label"] == label), None)
    out = []
    wide, nd = row(r.quota.get("disagg"), "memfair"), row(r.quota.get("disagg"), "memfair-fcfs-decode")
    if wide and nd:
        same = abs((nd["minnow_ttft_p99"] or 0) - (wide["minnow_ttft_p99"] or 0)) <= 0.05 * (wide["minnow_ttft_p99"] or 1)
        out.append(f"At H100 scale with one GPU's decode pool (the essay's setting) the decode side's policy "
                   + ("hardly matters" if same else "matters") + f": minnow TTFT p99 {_ms(nd['minnow_ttft_p99'])} with "
                   f"fcfs decode against {_ms(wide['minnow_ttft_p99'])} with memfair on both sides, since the inherited "
                   "pages fit; the gain over fcfs there is the prefill side's split of each step.")
    t_m, t_nd = row(r.tight, "memfair"), row(r.tight, "memfair-fcfs-decode")
    if t_m and t_nd:
        mv_m, mv_nd = r.moves.get(("decode-tight", "memfair")), r.moves.get(("decode-tight", "memfair-fcfs-decode"))
        out.append(f"With a decode pool that the inherited whales overflow (12,800 pages), re-admission shows: fcfs decode "
                   f"preempts or demotes {mv_nd or 0:.3f} minnows per minnow, memfair's decode side {mv_m or 0:.3f}; "
                   + ("the whales pay for it" if (t_m["whale_e2e_p50"] or 0) > 1.1 * (t_nd["whale_e2e_p50"] or 0)
                      else "at no cost to the whales") + f": whale E2E p50 {_ms(t_m['whale_e2e_p50'])} against "
                   f"{_ms(t_nd['whale_e2e_p50'])}, output tok/s {t_m['out_tok_s']:.0f} against {t_nd['out_tok_s']:.0f}.")
    return out


def render(r: Runs, img: Path, stamp: str, vllm_line: str | None = None) -> str:
    img.mkdir(parents=True, exist_ok=True)
    lines = ["# Findings", "",
             f"Written by `bash scripts/results.sh` {stamp}, beside [results.md](results.md) from the same run. "
             "One section for each of the essay's claims and open questions: the answer, the figures behind it "
             "(the real CPU cluster; the simulator at H100 scale, Llama-3-8B with 128K whales among 2K minnows; "
             "vLLM where it was run), a plot, and the command that reproduces it. Where the testbed disagrees "
             "with the essay, or a simple baseline does as well as memfair, the section says so.", ""]
    lines += claim_64x(r, img)
    for s in claims_hbm_evictions(r, img):
        lines += s
    for s in quota_questions(r, img):
        lines += s
    lines += frontier_question(r, img, vllm_line)
    lines += disagg_question(r, img)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.figures.findings", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="a results.sh run's folder (its --out)")
    ap.add_argument("--out", required=True, help="the page to write (its plots go to img/ beside it)")
    ap.add_argument("--results", help="the results document of the same run, for its vLLM line")
    ap.add_argument("--stamp", default="", help="when and at which commit the run was made")
    a = ap.parse_args(argv)
    vllm_line = None
    if a.results and Path(a.results).is_file():
        from pdtb.figures import headline

        secs = headline.sections(Path(a.results).read_text())
        lines = headline._section(secs, "## Beside vLLM")
        vllm_line = headline.vllm(lines, headline._commit(lines, "")) if lines else None
    out = Path(a.out)
    out.write_text(render(Runs(Path(a.runs)), out.parent / "img", a.stamp, vllm_line))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
