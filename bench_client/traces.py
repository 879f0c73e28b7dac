"""Trace replay: read a request-length trace and scale it into a `list[RequestSpec]`.

Two formats, told apart by the first non-blank character ('{' = JSON lines, else CSV):
  JSON lines (native; also the Mooncake shape):  {"timestamp": ms from start, "input_length": N,
      "output_length": N, "tenant": optional, "priority": optional}; other keys (hash_ids) ignored.
  Azure LLM inference CSV:  TIMESTAMP (wall clock "YYYY-MM-DD HH:MM:SS.fffffff"), ContextTokens,
      GeneratedTokens.

Scaling, applied in this order and recorded by `trace_specs` in its info dict:
  max_requests   keep the first N rows by time
  length_scale   multiply both lengths, round, at least 1 token
  max_context    clamp prompt + output to this many tokens (the output is kept when it fits)
  time_scale     multiply every offset from the first request (0.1 replays ten times faster)
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench_client.records import RequestSpec
from bench_client.workloads import clamp_to_context


@dataclass(frozen=True)
class TraceRow:
    """One trace request as read, before scaling."""

    timestamp: float  # seconds, any origin
    input_length: int
    output_length: int
    tenant: str = "default"
    priority: int | None = None


def _azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> seconds (naive clock; only differences matter)."""
    base, _, frac = text.strip().partition(".")
    whole = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return whole + (float("0." + frac) if frac else 0.0)


def parse_jsonl(lines) -> list[TraceRow]:
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rows.append(TraceRow(float(d["timestamp"]) / 1000.0, int(d["input_length"]), int(d["output_length"]),
                                 str(d.get("tenant") or "default"),
                                 None if d.get("priority") is None else int(d["priority"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e!r}") from None
    return rows


def parse_azure_csv(lines) -> list[TraceRow]:
    rows = []
    for n, d in enumerate(csv.DictReader(lines), 2):
        try:
            rows.append(TraceRow(_azure_time(d["TIMESTAMP"]), int(d["ContextTokens"]), int(d["GeneratedTokens"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e!r}") from None
    return rows


def read_trace(path: str | Path) -> tuple[list[TraceRow], str]:
    """The rows of a trace file and its format name ("jsonl" or "azure-csv")."""
    text = Path(path).read_text()
    lines = text.splitlines()
    if text.lstrip().startswith("{"):
        return parse_jsonl(lines), "jsonl"
    return parse_azure_csv(lines), "azure-csv"


def trace_specs(rows: list[TraceRow], length_scale: float = 1.0, max_context: int | None = None,
                time_scale: float = 1.0, max_requests: int | None = None) -> tuple[list[RequestSpec], dict]:
    """Scaled request list (class "trace") and what was applied."""
    if length_scale <= 0 or time_scale < 0:
        raise ValueError("length_scale must be > 0 and time_scale >= 0")
    rows = sorted(rows, key=lambda r: r.timestamp)[:max_requests]
    t0 = rows[0].timestamp if rows else 0.0
    specs, clamped = [], 0
    for r in rows:
        spec = RequestSpec((r.timestamp - t0) * time_scale, r.tenant, "trace",
                           max(1, round(r.input_length * length_scale)),
                           max(1, round(r.output_length * length_scale)), r.priority)
        if max_context:
            spec, changed = clamp_to_context(spec, max_context)
            clamped += changed
        specs.append(spec)
    info = {"length_scale": length_scale, "max_context": max_context, "time_scale": time_scale,
            "max_requests": max_requests, "requests": len(specs), "clamped_by_max_context": clamped,
            "span_s": specs[-1].send_time if specs else 0.0,
            "tenants": len({s.tenant for s in specs})}
    return specs, info
