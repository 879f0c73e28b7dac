"""Trace replay: read a request-length trace and scale it into a `list[RequestSpec]`.

Two formats, told apart by the first non-blank character ('{' = JSON lines, else CSV; a UTF-8
byte-order mark is skipped, and so are JSON-lines lines starting with '#'):
  JSON lines (native; also the Mooncake shape):  {"timestamp": ms from start, "input_length": N,
      "output_length": N, "tenant": optional, "priority": optional, "hash_ids": optional}; other
      keys ignored. `hash_ids` (Mooncake): one id per 512-token block of the prompt, prefix-chained
      (an id names its block with everything before it); requests sharing leading ids share that
      prompt prefix, and replay shares it too (blocks, pdtb/client/prefix.py).
  Azure LLM inference CSV:  TIMESTAMP (wall clock "YYYY-MM-DD HH:MM:SS[.fffffff]", optionally
      with "T" for the space and a UTC offset "+00:00" or "Z", as the 2024 traces have; a time
      without an offset is read as UTC, so no local timezone or daylight-saving change moves
      it), ContextTokens, GeneratedTokens.

Every row is checked: a timestamp must be a finite number >= 0, lengths whole numbers (the
prompt at least 1 token, the output at least 0), a priority a whole number; a row that is not
gives `trace line N: ...` (N counts every line of the file, blank ones included). A file
without a single request is an error. An output length of 0 is replayed as 1 token (a request
must ask for one) and counted in the info dict as `outputs_raised_to_one`.

Scaling, applied in this order and recorded by `trace_specs` in its info dict:
  max_requests   keep the first N rows by time
  length_scale   multiply both lengths, round, at least 1 token; a hash id's block becomes
                 round(512 * length_scale) tokens, at least 1 (or block_tokens when given)
  max_context    clamp prompt + output to this many tokens (the output is kept when it fits)
  time_scale     multiply every offset from the first request (0.1 replays ten times faster)
"""
from __future__ import annotations

import calendar
import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pdtb.client.prefix import TRACE_BLOCK_TOKENS
from pdtb.figures.records import RequestSpec
from pdtb.client.workloads import clamp_to_context


@dataclass(frozen=True)
class TraceRow:
    """One trace request as read, before scaling."""

    timestamp: float  # seconds, any origin
    input_length: int
    output_length: int
    tenant: str = "default"
    priority: int | None = None
    hash_ids: tuple[int, ...] = ()  # one id per 512-token prompt block (Mooncake)


_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(\.\d+)?\s*(Z|[+-]\d{2}:?\d{2})?")


def _azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' or '2024-05-10 00:00:00.009930+00:00' -> seconds since the
    epoch, UTC (no offset: read as UTC; only differences matter)."""
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"TIMESTAMP must look like 'YYYY-MM-DD HH:MM:SS[.fff][+HH:MM]', got {text!r}")
    day, clock, frac, zone = m.groups()
    whole = calendar.timegm(datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S").timetuple())
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        whole -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return whole + (float(frac) if frac else 0.0)


def _whole(value, what: str, least: int, most: int | None = None) -> int:
    """A whole number >= least: ints, integral floats and numeric strings; never a bool."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{what} is out of range: {str(value)[:40]}...") from None
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    if number < least:
        raise ValueError(f"{what} must be at least {least}, got {value!r}")
    if most is not None and number > most:
        raise ValueError(f"{what} must be at most {most}, got {value!r}")
    return int(number)


def _hash_ids(value) -> tuple[int, ...]:
    """A list of whole numbers >= 0 (absent: none)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"hash_ids must be a list of whole numbers, got {type(value).__name__}")
    if all(type(x) is int and 0 <= x < 1 << 63 for x in value):  # the common case, checked fast
        return tuple(value)
    return tuple(_whole(x, "a hash id", 0, (1 << 63) - 1) for x in value)


MAX_SPAN_S = 1e7  # seconds of arrivals a replay may span (about 116 days)


def _row(timestamp_s: float, prompt, output, tenant=None, priority=None, hash_ids=None) -> TraceRow:
    if not math.isfinite(timestamp_s) or timestamp_s < 0:
        raise ValueError(f"timestamp must be a finite number >= 0, got {timestamp_s!r}")
    return TraceRow(timestamp_s, _whole(prompt, "input length", 1), _whole(output, "output length", 0),
                    "default" if tenant is None or tenant == "" else str(tenant),
                    None if priority is None else _whole(priority, "priority", -(1 << 62), 1 << 62),
                    _hash_ids(hash_ids))


def parse_jsonl(lines) -> list[TraceRow]:
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError(f"each line must be one JSON object, got {type(d).__name__}")
            if isinstance(d["timestamp"], bool):
                raise ValueError(f"timestamp must be a number, got {d['timestamp']!r}")
            rows.append(_row(float(d["timestamp"]) / 1000.0, d["input_length"], d["output_length"],
                             d.get("tenant"), d.get("priority"), d.get("hash_ids")))
        except OverflowError:
            raise ValueError(f"trace line {n}: timestamp out of range") from None
        except KeyError as e:
            raise ValueError(f"trace line {n}: no {e.args[0]!r} field") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e!r}") from None
    return rows


def parse_azure_csv(lines) -> list[TraceRow]:
    rows = []
    reader = csv.DictReader(lines)
    for d in _csv_rows(reader):  # reader.line_num: the file's line (DictReader skips blank lines)
        try:
            rows.append(_row(_azure_time(d["TIMESTAMP"]), d["ContextTokens"], d["GeneratedTokens"]))
        except KeyError as e:
            raise ValueError(f"trace line {reader.line_num}: no {e.args[0]!r} column") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"trace line {reader.line_num}: {e!r}") from None
    return rows


def _csv_rows(reader):
    """The reader's rows; a malformed CSV (a field past csv's size limit, a NUL) names its line."""
    try:
        yield from reader
    except csv.Error as e:
        raise ValueError(f"trace line {reader.line_num}: {e}") from None


def read_trace(path: str | Path) -> tuple[list[TraceRow], str]:
    """The rows of a trace file and its format name ("jsonl" or "azure-csv")."""
    text = Path(path).read_text(encoding="utf-8-sig")  # skips a byte-order mark
    lines = text.splitlines()
    first = next((ln.lstrip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), "")
    rows, fmt = (parse_jsonl(lines), "jsonl") if first.startswith(("{", "[")) else (parse_azure_csv(lines), "azure-csv")
    if not rows:
        raise ValueError(f"trace {path}: no requests in it (JSON lines of {{\"timestamp\", \"input_length\", "
                         f"\"output_length\"}}, or an Azure CSV with TIMESTAMP,ContextTokens,GeneratedTokens)")
    return rows, fmt


def trace_specs(rows: list[TraceRow], length_scale: float = 1.0, max_context: int | None = None,
                time_scale: float = 1.0, max_requests: int | None = None,
                block_tokens: int | None = None) -> tuple[list[RequestSpec], dict]:
    """Scaled request list (class "trace") and what was applied. Rows with hash_ids open their
    prompts with those blocks, `block_tokens` each (None: 512 scaled as the lengths are)."""
    if not (0 < length_scale <= 1e6 and 0 <= time_scale < float("inf")):
        raise ValueError("length_scale must be in (0, 1e6] and time_scale finite and >= 0")
    if max_context is not None and max_context < 2:
        raise ValueError(f"max_context must be at least 2 (a prompt and an output token), got {max_context}")
    if block_tokens is not None and block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    block_len = block_tokens or max(1, round(TRACE_BLOCK_TOKENS * length_scale))
    rows = sorted(rows, key=lambda r: r.timestamp)[:max_requests]
    t0 = rows[0].timestamp if rows else 0.0
    span = (rows[-1].timestamp - t0) * time_scale if rows else 0.0
    if span > MAX_SPAN_S:
        raise ValueError(f"the trace spans {span:.3g} s of arrivals after --time-scale, more than {MAX_SPAN_S:.0e} s: "
                         "a timestamp out of place, or a smaller --time-scale or --max-requests is needed")
    specs, clamped = [], 0
    raised = sum(1 for r in rows if r.output_length == 0)
    for r in rows:
        spec = RequestSpec((r.timestamp - t0) * time_scale, r.tenant, "trace",
                           max(1, round(r.input_length * length_scale)),
                           max(1, round(r.output_length * length_scale)), r.priority,
                           blocks=r.hash_ids, block_len=block_len if r.hash_ids else 0)
        if max_context is not None:
            spec, changed = clamp_to_context(spec, max_context)
            clamped += changed
        specs.append(spec)
    with_blocks = sum(1 for r in rows if r.hash_ids)
    info = {"length_scale": length_scale, "max_context": max_context, "time_scale": time_scale,
            "max_requests": max_requests, "requests": len(specs), "clamped_by_max_context": clamped,
            "outputs_raised_to_one": raised,
            "span_s": specs[-1].send_time if specs else 0.0,
            "tenants": len({s.tenant for s in specs}),
            "rows_with_hash_ids": with_blocks, "block_tokens": block_len if with_blocks else None}
    return specs, info
