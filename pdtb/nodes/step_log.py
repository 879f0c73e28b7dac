"""Per-step log of a node's engine (`--step-log FILE`): one JSON object per line, per step.

What a step ran and what it cost, for finding which steps make a tail: a minnow's 40 ms gap is
a step that carried a whale's prefill chunk, a long decode batch, or a tier move. Keys:

  t        wall-clock start of the step (s, time.time(), comparable with the client's stamps)
  ms       duration of engine.step() (scheduling, forward pass, sampling)
  decode   [[tenant, rows, context tokens read], ...]  decode rows per tenant
  prefill  [[tenant, request id, tokens, offset], ...] prefill chunks
  moves    [[kind, request id, pages, ms], ...]         demote / promote / preempt
  unserved rows resident but not served this step (a policy's turn or cap)

Off by default; the write is one short line per step, flushed every 64 steps and at close.
"""
from __future__ import annotations

import json

FLUSH_EVERY = 64


class StepLog:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1 << 16)
        self._n = 0

    def write(self, t: float, seconds: float, out) -> None:
        decode: dict[str, list[int]] = {}
        prefill = []
        for c in out.chunks:
            s = c.seq
            start = s.num_computed_tokens - c.num_new_tokens  # the engine has advanced it already
            if start < s.num_prompt_tokens or c.num_new_tokens > 1:  # a prompt, or a recompute
                prefill.append([s.tenant, s.request_id, c.num_new_tokens, start])
            else:
                d = decode.setdefault(s.tenant, [0, 0])
                d[0] += 1
                d[1] += s.num_computed_tokens
        rec = {"t": round(t, 6), "ms": round(seconds * 1e3, 3),
               "decode": [[k, *v] for k, v in decode.items()], "prefill": prefill,
               "moves": [[m.kind, m.request_id, m.num_pages, round(m.seconds * 1e3, 3)] for m in out.moves],
               "unserved": len(out.unserved)}
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._n += 1
        if self._n % FLUSH_EVERY == 0:
            self._f.flush()

    def close(self) -> None:
        self._f.close()
