"""The results file and the end-of-run table.

Results JSON (stable top-level keys):
  {"meta": {...}, "requests": [RequestRecord.to_json()...], "summary": summarize(...), "samples": [...]}

`meta.policy` is the run's label ("memfair", "fcfs+prefill-fcfs"); `meta.policy_info`, where the
nodes reported it, is the policy they run: {"name", "source", "settings"} when every node runs
the same one with the same settings, else {"nodes": {node id: {"name", "source", "settings"}}}.
"""
from __future__ import annotations

import json
from pathlib import Path

from pdtb.figures.slo_misses import format_lines
from pdtb.figures.records import RequestRecord

RESULTS_VERSION = 1


def server_labels(nodes: list[dict] | None) -> tuple[str | None, str | None]:
    """(mode, policy) as the server describes itself in `/cluster`: disagg when it has prefill or
    decode nodes, colocated otherwise; the policies nodes report in `extra.policy`."""
    if not nodes:
        return None, None
    roles = {n.get("role") for n in nodes}
    mode = "disagg" if roles & {"prefill", "decode"} else ("colocated" if "colocated" in roles else None)
    policies = sorted({str(p) for n in nodes if (p := (n.get("extra") or {}).get("policy"))})
    return mode, ("+".join(policies) or None)


def server_policy_info(nodes: list[dict] | None) -> dict | None:
    """`meta.policy_info` from `/cluster`: what the nodes report in `extra.policy_info`
    (None when none does, e.g. a server older than that field)."""
    per_node = {}
    for i, n in enumerate(nodes or ()):
        info = (n.get("extra") or {}).get("policy_info")
        if isinstance(info, dict):
            per_node[str(n.get("id") or i)] = info
    return policy_section(per_node)


def policy_section(per_node: dict[str, dict]) -> dict | None:
    """The policy once when every node agrees on it, else per node (see the module's docstring)."""
    if not per_node:
        return None
    first = next(iter(per_node.values()))
    if all(info == first for info in per_node.values()):
        return dict(first)
    return {"nodes": dict(per_node)}


def build_results(meta: dict, records: list[RequestRecord], summary: dict, samples: list[dict]) -> dict:
    return {"meta": {"version": RESULTS_VERSION, **meta}, "requests": [r.to_json() for r in records],
            "summary": summary, "samples": samples}


def write_results(path: str | Path, results: dict, compact: bool = False) -> None:
    """Write a results file; `compact` leaves out the indentation (a simulated hour holds
    millions of token times: one per line would make the file several times larger)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=None if compact else 1, separators=(",", ":") if compact else None)
                    + "\n")


def read_json(path: str | Path):
    """The JSON value in the file at `path`; ValueError naming the file where it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def load_results(path: str | Path) -> dict:
    return check_results(read_json(path), path)


def check_results(data, path: str | Path) -> dict:
    """`data` (read from `path`) if it is a results file, with its samples defaulted."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a results file (not a JSON object)")
    for key, kind in (("meta", dict), ("requests", list), ("summary", dict)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: not a results file (no {key!r} {kind.__name__})")
    if not _policy_info_ok(data["meta"].get("policy_info")):
        raise ValueError(f"{path}: meta.policy_info is neither {{name, source, settings}} nor {{nodes: ...}}")
    data.setdefault("samples", [])
    return data


def _policy_info_ok(info) -> bool:
    if info is None:  # files written before the field, or by a server that does not report it
        return True
    if not isinstance(info, dict):
        return False
    if "nodes" in info:
        return isinstance(info["nodes"], dict) and all(map(_one_policy_ok, info["nodes"].values()))
    return _one_policy_ok(info)


def _one_policy_ok(info) -> bool:
    return (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("source"), str)
            and isinstance(info.get("settings"), dict))


def records_of(results: dict) -> list[RequestRecord]:
    return [RequestRecord.from_json(d) for d in results["requests"]]


def run_label(meta: dict) -> str:
    """'mode/policy' of a run, '?' for what is unknown."""
    return f"{meta.get('mode') or '?'}/{meta.get('policy') or '?'}"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def print_markdown(lines: list[str], out: str | None) -> None:
    """Print a report's markdown lines; with `out`, write them there too (one file, newline-ended)."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


_COLUMNS = ("group", "count", "failed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "E2E p99", "out tok/s")


def _row(name: str, s: dict) -> list[str]:
    return [name, str(s["count"]), str(s["failed"]), fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]),
            fmt(s["itl_ms"]["p50"]), fmt(s["itl_ms"]["p99"]), fmt(s["tpot_ms"]["p50"]), fmt(s["e2e_ms"]["p99"]),
            fmt(s["output_tok_s"])]


def format_table(summary: dict) -> str:
    """Plain-text table (latencies in ms): overall, per class, per tenant, then fairness."""
    rows = [_row("overall", summary["overall"])]
    rows += [_row(f"class {k}", v) for k, v in summary["per_class"].items()]
    rows += [_row(f"tenant {k}", v) for k, v in summary["per_tenant"].items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(_COLUMNS), line(["-" * w for w in widths])] + [line(r) for r in rows]
    f, o = summary["fairness"], summary["overall"]
    # goodput only means something against SLOs (without them it is the request rate), as vLLM prints it
    good = f"goodput {fmt(o['goodput_rps'], 2)} req/s  " if o.get("slo_attainment") is not None else ""
    out.append(f"{good}fair-share Jain {fmt(f.get('share_jain_mean'), 3)} "
               f"(worst window {fmt(f.get('share_jain_min'), 3)})  Jain(completed/demanded) {fmt(f['jain_index'], 3)}  "
               f"max service gap {fmt(f['max_service_gap'], 0)} (window {f['window_s']} s)  "
               f"duration {fmt(summary.get('duration_s'), 1)} s")
    hit, ideal = summary.get("prefix_hit_rate"), summary.get("prefix_hit_rate_ideal")
    if hit is not None or ideal is not None:
        out.append(f"prefix hit rate {fmt(hit, 2)} (ideal {fmt(ideal, 2)})")
    attr = format_lines(summary.get("slo_attribution") or {})
    if attr:
        out += ["SLO attribution by the nodes (pdtb_timing; misses against the nodes' SLO targets):", *attr]
    return "\n".join(out)


def decode_path_label(res: dict) -> str:
    """How a `pdtb bench engine` result's decode steps ran, in words (its `decode_kernel`:
    "c", "triton" or None; a results file may say True for the C kernel)."""
    kernel = "c" if res.get("decode_kernel") is True else res.get("decode_kernel")
    how = {"c": "C paged decode kernel", "triton": "Triton paged decode kernel"}.get(kernel, "torch decode attention")
    return how + (", CUDA graphs" if res.get("cuda_graphs") else "")
