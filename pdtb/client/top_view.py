"""`pdtb top`'s frame: text lines from a router's `/cluster` and `/cluster/latency` and the poll before them (pure
functions: no sockets, no clock).

    pdtb top http://127.0.0.1:8000   every 1 s   14:02:03   rates over 1.01 s
    de-0  decode  ok  memfair  device 60/200  host 24/100  running 3  waiting 1
      inherited: placed 9 (2.0/s)  parked 2 (1.0/s)  deferred 2 (0.5/s, 7 answers)  refused 1  landing 4 pages
      tenant  device  share  of share  host  running  waiting  demote/s  promote/s  preempt/s
      minnow      12    100       12%     0        2        1       0.0        0.0        1.0
      whale       48    100       48%    24        1        0       2.0        0.5        0.0
    pr-0  prefill  ok  prefill-memfair  device 7/400  host 0/0  running 0  waiting 2
      hand-offs: 2 in flight, holding 7 pages
      ...
    TTFT and ITL at the router, last 60 s
      tenant  requests  TTFT p50  TTFT p99  tokens  ITL p50  ITL p99
      minnow         4    12.3ms   500.0ms      40    4.0ms    1.50s

A rate is a counter's difference between the two polls over the seconds between them; a
counter that went down (its node restarted) or a poll without the counter gives "-", as does
any field a node or router does not report."""
from __future__ import annotations

from dataclasses import dataclass, field

DASH = "-"
MOVES = ("demote", "promote", "preempt")  # tier moves by kind (NodeStats.extra["evictions"])
VERDICTS = (("placed", "accept"), ("parked", "park"), ("deferred", "defer"))  # label, extra["admissions"] key


@dataclass(frozen=True)
class Snapshot:
    """One poll of a router."""

    nodes: list  # GET /cluster: one dict per node
    latency: dict | None = None  # GET /cluster/latency (None: the router has none)
    at: float = 0.0  # monotonic seconds of the poll, for rates
    clock: str = ""  # wall-clock time of the poll, as shown
    url: str = ""  # the router polled
    interval: float | None = None  # seconds between polls
    notes: list = field(default_factory=list)  # lines shown under the header (a poll that failed)


def frame(snap: Snapshot, prev: Snapshot | None = None) -> list[str]:
    """Every line of one frame: the header, each node with its tenants, the router's latency."""
    dt = snap.at - prev.at if prev is not None else 0.0
    rates = f"rates over {dt:.2f} s" if dt > 0 else "rates after the next poll"
    every = DASH if snap.interval is None else f"{snap.interval:g} s"
    out = [f"pdtb top {snap.url}   every {every}   {snap.clock}   {rates}", *snap.notes]
    before = {n.get("id"): n for n in prev.nodes if isinstance(n, dict)} if prev is not None and dt > 0 else {}
    for node in snap.nodes:
        if isinstance(node, dict):
            out += node_lines(node, before.get(node.get("id")), dt)
    if not snap.nodes:
        out.append("(no nodes)")
    return out + latency_lines(snap.latency)


def node_lines(node: dict, prev: dict | None, dt: float) -> list[str]:
    """A node's line, its inherited or handed-off pages, and its tenants' table."""
    extra = _dict(node.get("extra"))
    before = _dict(prev.get("extra")) if prev is not None else None
    dev = _used(node.get("pages_total"), node.get("pages_free"))
    host = _used(node.get("host_pages_total"), node.get("host_pages_free"))
    lines = [f"{_s(node.get('id'))}  {_s(node.get('role'))}  {health(node)}  {_s(extra.get('policy'))}  "
             f"device {dev}  host {host}  running {_s(node.get('running'))}  waiting {_s(node.get('waiting'))}"]
    if "admissions" in extra or "reserved_pages" in extra:
        lines.append("  inherited: " + inherited(extra, before, dt))
    if "handoffs" in extra:
        lines.append(f"  hand-offs: {_s(extra.get('handoffs'))} in flight, holding {_s(extra.get('held_pages'))} pages")
    return lines + ["  " + row for row in tenant_table(extra, before, dt)]


def health(node: dict) -> str:
    if node.get("retired"):
        return "retired"
    if node.get("stale") or node.get("healthy") is False:
        since = node.get("seconds_since_seen")
        return f"stale {since:.1f}s" if isinstance(since, (int, float)) else "stale"
    if node.get("draining"):
        return "draining"
    return "ok" if node.get("healthy") else DASH


def inherited(extra: dict, prev: dict | None, dt: float) -> str:
    """A decode node's hand-off headers by verdict (requests, and per second), the deferrals' answers,
    the refusals, and the pages reserved for transfers still landing."""
    adm = _dict(extra.get("admissions"))
    before = _dict(prev.get("admissions")) if prev is not None and "admissions" in prev else None

    def count(key: str):  # (a verdict not given yet is absent from the counter)
        return adm.get(key, 0) if "admissions" in extra else None

    parts = []
    for label, key in VERDICTS:
        r = rate(count(key), None if before is None else before.get(key, 0), dt)
        more = f", {_s(count('defer_answers'))} answers" if key == "defer" else ""
        parts.append(f"{label} {_s(count(key))} ({r}/s{more})")
    parts.append(f"refused {_s(count('refuse'))}")
    parts.append(f"landing {_s(extra.get('reserved_pages'))} pages")
    return "  ".join(parts)


def tenant_table(extra: dict, prev: dict | None, dt: float) -> list[str]:
    """One row per tenant the node reports anything of: pages held in each tier against the tenant's
    share, requests running (of the largest a decode node lists) and waiting, tier moves per second."""
    def per_tenant(key: str) -> dict | None:  # None: the node does not report it
        return _dict(extra.get(key)) if key in extra else None

    pages, host, quota, waiting = (per_tenant(k) for k in ("tenant_pages", "tenant_host_pages", "quota",
                                                           "tenant_waiting"))
    moves = split_moves(extra["evictions"]) if "evictions" in extra else None
    before = split_moves(prev["evictions"]) if prev is not None and "evictions" in prev else None
    running = None
    if isinstance(extra.get("requests"), list):  # [request id, tenant, pages] of its largest requests
        running = {}
        for r in extra["requests"]:
            if isinstance(r, list) and len(r) >= 2:
                running[r[1]] = running.get(r[1], 0) + 1
    tenants = sorted(set().union(*(d for d in (pages, host, quota, waiting, moves, running) if d)), key=str)
    if not tenants:
        return ["(no tenant)"]
    rows = []
    for t in tenants:
        dev, share = _get(pages, t), _get(quota, t, None)
        row = [str(t), _s(dev), _num(share), percent(dev, share), _s(_get(host, t)), _s(_get(running, t)),
               _s(_get(waiting, t))]
        for kind in MOVES:
            row.append(rate(None if moves is None else moves.get(t, {}).get(kind, 0),
                            None if before is None else before.get(t, {}).get(kind, 0), dt))
        rows.append(row)
    return table(["tenant", "device", "share", "of share", "host", "running", "waiting",
                  *(f"{k}/s" for k in MOVES)], rows)


def latency_lines(latency: dict | None) -> list[str]:
    """The router's recent TTFT and ITL per tenant (GET /cluster/latency)."""
    window = _dict(latency).get("window_s")
    out = [f"TTFT and ITL at the router, last {_num(window)} s"]
    tenants = _dict(_dict(latency).get("tenants"))
    if not tenants:
        return out + ["  " + ("(no recent tokens)" if latency is not None else DASH)]
    rows = []
    for t, v in sorted(tenants.items(), key=lambda kv: str(kv[0])):
        ttft, itl = _dict(_dict(v).get("ttft")), _dict(_dict(v).get("itl"))
        rows.append([str(t), _s(ttft.get("n")), duration(ttft.get("p50")), duration(ttft.get("p99")),
                     _s(itl.get("n")), duration(itl.get("p50")), duration(itl.get("p99"))])
    return out + ["  " + r for r in table(["tenant", "requests", "TTFT p50", "TTFT p99", "tokens", "ITL p50",
                                           "ITL p99"], rows)]


# ---- figures -------------------------------------------------------------------------------------
def rate(cur, before, dt: float) -> str:
    """(cur - before) / dt with one decimal; "-" without both counters, a positive dt, or when the
    counter went down."""
    if not isinstance(cur, (int, float)) or not isinstance(before, (int, float)) or dt <= 0 or cur < before:
        return DASH
    return f"{(cur - before) / dt:.1f}"


def split_moves(evictions) -> dict:
    """{"tenant/kind": n} as {tenant: {kind: n}} (a tenant's name may hold "/"; a kind does not)."""
    out: dict = {}
    for key, n in _dict(evictions).items():
        tenant, _, kind = str(key).rpartition("/")
        out.setdefault(tenant, {})[kind] = n
    return out


def percent(held, share) -> str:
    if not isinstance(held, (int, float)) or not isinstance(share, (int, float)) or share <= 0:
        return DASH
    return f"{100 * held / share:.0f}%"


def duration(seconds) -> str:
    """Milliseconds under a second, seconds from there."""
    if not isinstance(seconds, (int, float)):
        return DASH
    return f"{seconds * 1000:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned columns: the first to the left, the others to the right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [header, *rows]]


def _get(d: dict | None, key, absent=0):
    """`d[key]`, `absent` for a key it lacks (nothing held), None when `d` is not reported."""
    return None if d is None else d.get(key, absent)


def _used(total, free) -> str:
    if not isinstance(total, int) or not isinstance(free, int):
        return DASH
    return f"{total - free}/{total}"


def _num(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return DASH
    return f"{v:g}" if isinstance(v, int) or v == int(v) else f"{v:.1f}"


def _s(v) -> str:
    return DASH if v is None or isinstance(v, (dict, list)) else str(v)


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}
