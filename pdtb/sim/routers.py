"""The router processes of a simulated cluster, charged for their CPU work.

`--routers N` processes share one port. With SO_REUSEPORT the kernel spreads connections by a
hash of their addresses; here a request goes to router crc32(its id) mod N, and a recomputed
request stays on its router (its client's connection). Each router is one asyncio loop on one
core: a single server with a FIFO of CPU work.

    request arrives   -> request_s (parse, tokenize, pick a node) -> dispatched to its node
    token leaves node -> token_s x tokens (detokenize, an SSE frame) -> on its way to the client

A piece ends at max(its arrival, the end of the piece before it) + its work (Lindley's
recursion), which holds only if each router takes its pieces in order of arrival. Runs of
decode steps (pdtb/sim/coast.py) hand their tokens over late, stamped with their own times, so
pieces wait in `pending` and are served in arrival order at `commit`, which the cluster calls
only after bringing every node's run up to now: no piece still to come arrives before a served
one. A token joins its router's queue as it leaves its node; the rpc latency is added after the
router, with the client's leg (so a token's place in the queue against a request arriving
within one rpc latency may differ from a real router's).
"""
from __future__ import annotations

import itertools
import math
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_TARGET = 0.7  # a router's busy share the plan keeps under (`--router-target`)


@dataclass(frozen=True)
class RouterCost:
    """One router process's CPU work (a calibration's "router" section, or the flags)."""

    request_s: float = 0.0  # per request: parse, tokenize, pick a node, dispatch
    token_s: float = 0.0  # per token relayed: detokenize, frame, write to the client's stream
    measured_by: str = ""  # the command that measured them ("" given by flags, or none)

    def __post_init__(self) -> None:
        if not (self.request_s >= 0 and self.token_s >= 0) or math.isinf(self.request_s + self.token_s):
            raise ValueError("a router's request and token costs must be finite and >= 0")

    @classmethod
    def from_json(cls, doc: dict, where: str = "calibration") -> "RouterCost":
        """A calibration's "router" section: {"request_s", "token_s", "measured_by"}."""
        try:
            return cls(float(doc["request_s"]), float(doc["token_s"]), str(doc.get("measured_by", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad router section ({type(e).__name__}: {e})") from None

    def load_s(self, requests_per_s: float, tokens_per_s: float) -> float:
        """CPU seconds a second that this much traffic costs the routers together."""
        return requests_per_s * self.request_s + tokens_per_s * self.token_s


def routers_needed(load_s: float, target: float = DEFAULT_TARGET) -> int:
    """Router processes that keep each one's busy share at or under `target` with `load_s` CPU
    seconds a second spread evenly: ceil(load / target), at least one."""
    if not 0 < target <= 1:
        raise ValueError(f"a router's target busy share must be in (0, 1], got {target}")
    return max(1, math.ceil(round(load_s / target, 9)))  # (round: 1.4 / 0.7 is two routers, not three)


def router_names(n: int) -> list[str]:
    """"router" alone, else router-0 .."""
    return ["router"] if n == 1 else [f"router-{j}" for j in range(n)]


def pick(rid: str, n: int) -> int:
    """The router of request `rid` (its first id) among `n`."""
    return zlib.crc32(rid.encode()) % n if n > 1 else 0


class Waits:
    """Seconds a router's queue held pieces back. Most pieces wait for nothing: zeros are
    counted, the rest kept."""

    def __init__(self) -> None:
        self.zeros = 0
        self.rest = array("d")

    def add(self, wait_s: float) -> None:
        if wait_s <= 0:
            self.zeros += 1
        else:
            self.rest.append(wait_s)

    def quantiles_ms(self) -> dict:
        """p50, p99 and max in ms (nearest rank), over every piece."""
        n, rest = self.zeros + len(self.rest), sorted(self.rest)

        def q(p: float) -> float:
            i = max(0, math.ceil(p * n) - 1)
            return 0.0 if i < self.zeros or not rest else rest[i - self.zeros] * 1e3

        return {"p50": round(q(0.50), 4), "p99": round(q(0.99), 4), "max": round(rest[-1] * 1e3, 4) if rest else 0.0,
                "pieces": n}


@dataclass
class Router:
    """One router process: its queue's state and what it held back."""

    name: str  # router_names'
    free_at: float = 0.0  # when the work queued so far ends
    busy_s: float = 0.0  # seconds of work served
    dispatch_waits: Waits = field(default_factory=Waits)  # requests' waits before their work began
    token_waits: Waits = field(default_factory=Waits)  # tokens' waits before their work began

    def serve(self, arrival: float, work_s: float) -> tuple[float, float]:
        """(wait, end) of a piece arriving at `arrival`, after every piece served before it."""
        start = max(arrival, self.free_at)
        self.free_at = start + work_s
        self.busy_s += work_s
        return start - arrival, self.free_at


class Routers:
    """The cluster's router processes (see the module doc). `request` and `token` queue a piece;
    its callback runs as `fn(*args, t)` at `t`, the end of the piece's work."""

    def __init__(self, cost: RouterCost, n: int, loop) -> None:
        if n < 1:
            raise ValueError(f"--routers must be at least 1, got {n}")
        self.cost, self.loop = cost, loop
        self.servers = [Router(name) for name in router_names(n)]
        self.pending: list[tuple] = []  # (arrival, order, router, work_s, is_token, fn, args)
        self._order = itertools.count()
        self._of: dict[str, Router] = {}  # request -> its router, picked once

    def of(self, rid: str) -> Router:
        r = self._of.get(rid)
        if r is None:
            r = self._of[rid] = self.servers[pick(rid, len(self.servers))]
        return r

    def request(self, rid: str, fn: Callable, *args) -> None:
        """Request `rid` arrives now: dispatched once parsed and tokenized."""
        self._offer(self.of(rid), self.loop.now, self.cost.request_s, False, fn, args)

    def token(self, rid: str, t: float, fn: Callable, *args) -> None:
        """A token of request `rid` (its first id) left its node at `t` (<= now)."""
        self._offer(self.of(rid), t, self.cost.token_s, True, fn, args)

    def tokens(self, rid: str, times: list[float], fn: Callable, *args) -> None:
        """Tokens of request `rid` that left their node at `times` (a run of decode steps)."""
        r, work_s, order = self.of(rid), self.cost.token_s, self._order
        self.pending.extend((t, next(order), r, work_s, True, fn, args) for t in times)

    def _offer(self, r: Router, arrival: float, work_s: float, is_token: bool, fn: Callable, args: tuple) -> None:
        self.pending.append((arrival, next(self._order), r, work_s, is_token, fn, args))

    def commit(self) -> None:
        """Serve every pending piece in order of arrival (the caller has every node's run up to
        now, so none still to come arrives earlier); a piece done by now calls back at once
        with its time, a later one at its end."""
        if not self.pending:
            return
        items, self.pending = sorted(self.pending), []  # (a callback may queue more)
        now, at = self.loop.now, self.loop.at
        for arrival, _, r, work_s, is_token, fn, args in items:
            wait, end = r.serve(arrival, work_s)
            (r.token_waits if is_token else r.dispatch_waits).add(wait)
            if end <= now:
                fn(*args, end)
            else:
                at(end, fn, *args, end)


def streamed(records: list) -> tuple[int, int]:
    """(tokens the clients received, the most received in any one second of the run)."""
    per_second: Counter = Counter()
    for r in records:
        per_second.update(int(t) for t in r.token_times)
    return sum(per_second.values()), max(per_second.values(), default=0)


def router_figures(routers: Routers | None, n: int, cost: RouterCost, records: list, span_s: float,
                   target: float = DEFAULT_TARGET) -> dict:
    """What the router processes carried (the request at index i is `sim-i`) and, charged
    (`routers` given), how busy they were and what their queues added to dispatch and tokens."""
    span_s = max(span_s, 1e-9)
    total, peak = streamed(records)
    mine = Counter(pick(f"sim-{i}", n) for i in range(len(records)))
    tokens = Counter()
    for i, r in enumerate(records):
        tokens[pick(f"sim-{i}", n)] += len(r.token_times)
    load, peak_load = cost.load_s(len(records) / span_s, total / span_s), cost.load_s(len(records) / span_s, peak)
    per = [{"id": name, "requests": mine[j], "tokens": tokens[j], "busy_share": 0.0}
           for j, name in enumerate(router_names(n))]
    for row, s in zip(per, routers.servers if routers is not None else []):
        row.update(busy_share=round(s.busy_s / span_s, 4), dispatch_wait_ms=s.dispatch_waits.quantiles_ms(),
                   token_wait_ms=s.token_waits.quantiles_ms())
    return {"routers": n, "pick": "crc32(request id) mod routers", "charged": routers is not None,
            "request_s": cost.request_s, "token_s": cost.token_s, "measured_by": cost.measured_by,
            "streamed_tok_s_mean": round(total / span_s, 2), "streamed_tok_s_peak_1s": peak,
            "cpu_load_s_per_s": round(load, 4), "target_busy_share": target,
            "routers_needed": routers_needed(load, target), "routers_needed_at_peak": routers_needed(peak_load, target),
            "per_router": per}
