"""A step log of a policy run inside another engine's scheduler (PDTB_STEP_LOG=FILE): one JSON
line per step with what it served, for finding where a policy's time and throughput go.

Each line: `t` (the wall clock at the step's scheduling), `step`, `prefill_tokens` and
`prefill_rows` (prompt chunks), `decode_rows`, `waiting` (queued after the step's admission),
`sitting` (running rows the policy left out), `chunk_cap` (the step's bound on a prompt chunk,
null: none), `sched_ms` (the scheduler's own time, the policy's included), `vllm_ms` (of that,
the engine's own `schedule()`, the policy's admission answers included), `preempted` and
`lost_tokens` (requests preempted for recompute this step, the tokens they had computed, the
policy's reclaim included), `reclaimed` (of those, the policy's), `free` (free blocks at the
step's start).
"""
from __future__ import annotations

import json
import time

STEP_LOG_ENV = "PDTB_STEP_LOG"


class StepLog:
    """Appends a step's line to a file, line-buffered (a crash loses no finished step)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = open(path, "a", buffering=1)

    @classmethod
    def open(cls, environ) -> "StepLog | None":
        path = (environ.get(STEP_LOG_ENV) or "").strip()
        return cls(path) if path else None

    def write(self, step: int, chunks: list, waiting: int, sitting: int, chunk_cap: int | None, sched_s: float,
              preempted: list = (), now: float | None = None, reclaimed: int = 0, free: int | None = None,
              vllm_s: float | None = None) -> dict:
        """`chunks`: the step's ScheduledChunks (a view and its token count); `preempted`: the
        views of the requests preempted, as they stood at the step's start."""
        prefill = [c for c in chunks if c.seq.num_computed_tokens < c.seq.num_prompt_tokens]
        line = {"t": round(time.time() if now is None else now, 6), "step": step,
                "prefill_tokens": sum(c.num_new_tokens for c in prefill), "prefill_rows": len(prefill),
                "decode_rows": len(chunks) - len(prefill), "waiting": waiting, "sitting": sitting,
                "chunk_cap": chunk_cap, "sched_ms": round(sched_s * 1000, 3),
                "preempted": len(preempted), "lost_tokens": sum(v.num_computed_tokens for v in preempted),
                "reclaimed": reclaimed, "free": free,
                "vllm_ms": None if vllm_s is None else round(vllm_s * 1000, 3)}
        self.f.write(json.dumps(line) + "\n")
        return line

    def close(self) -> None:
        self.f.close()
