"""The fault kinds and the schedule drawn from a seed (a shuffled round of every kind, targets by
role).

The fault schedule of a campaign: kinds, and times and targets drawn from the seed alone, so
that a run is replayed by its seed (the plan is printed and written in the report).

    kind             what happens                                          target
    kill-prefill     SIGKILL; the supervisor restarts it                   a prefill node
    kill-decode      SIGKILL; the supervisor restarts it                   a decode node
    drain            SIGTERM: the node drains and exits; restarted         a prefill or decode node
    pause            SIGSTOP, then SIGCONT after `param` seconds           a prefill or decode node
    migrate          POST /admin/migrate of a decoding request             a decode node (the target)
    transfer-drop    KV sends dropped (drop_prob 0.5) for `param` s        a node that sends KV
    transfer-delay   KV sends delayed (half of them by 0.5 s) for `param` s
    transfer-stall   every KV send held 2 s for `param` s
    router-kill      SIGKILL of the router; the supervisor restarts it     the router
    client-cut       `param` streams in flight closed by their client      the load
"""
from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass


class Kind(str, enum.Enum):
    KILL_PREFILL = "kill-prefill"
    KILL_DECODE = "kill-decode"
    DRAIN = "drain"
    PAUSE = "pause"
    MIGRATE = "migrate"
    TRANSFER_DROP = "transfer-drop"
    TRANSFER_DELAY = "transfer-delay"
    TRANSFER_STALL = "transfer-stall"
    ROUTER_KILL = "router-kill"
    CLIENT_CUT = "client-cut"


KINDS = tuple(k.value for k in Kind)
# what each transfer fault sends to the node (kv_transport FaultConfig fields)
TRANSFER_FAULTS = {Kind.TRANSFER_DROP: {"drop_prob": 0.5}, Kind.TRANSFER_DELAY: {"delay_prob": 0.5, "delay_s": 0.5},
                   Kind.TRANSFER_STALL: {"delay_prob": 1.0, "delay_s": 2.0}}


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds from the campaign's start
    kind: str  # a Kind's value
    target: str  # a node name (ROLE-I), "router" or "client"
    param: float = 0.0  # seconds (pause, transfer windows) or a count (client-cut)

    def to_json(self) -> dict:
        return asdict(self)


def parse_kinds(text: str) -> tuple[str, ...]:
    """A comma-separated list of kinds ("all": every one); ValueError names an unknown one."""
    kinds = KINDS if text.strip() == "all" else tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown fault kind(s) {', '.join(bad) or '(none given)'}; known: {', '.join(KINDS)}, all")
    return kinds


def plan(seed: int, duration_s: float, every: tuple[float, float], kinds: tuple[str, ...],
         prefill: list[str], decode: list[str]) -> list[Fault]:
    """Faults at times drawn uniformly `every` seconds apart, from `kinds` in turn (a shuffled
    round, so every kind comes up once per round), on targets drawn from the cluster's node
    names. A kind with no possible target (no decode node, say) is left out."""
    rng = random.Random(seed)
    senders = prefill + decode  # (decode nodes send KV in migrations)
    targets = {Kind.KILL_PREFILL: prefill, Kind.KILL_DECODE: decode, Kind.DRAIN: prefill + decode,
               Kind.PAUSE: prefill + decode, Kind.MIGRATE: decode if len(decode) > 1 else [],
               Kind.TRANSFER_DROP: prefill or senders, Kind.TRANSFER_DELAY: prefill or senders,
               Kind.TRANSFER_STALL: prefill or senders, Kind.ROUTER_KILL: ["router"], Kind.CLIENT_CUT: ["client"]}
    usable = [k for k in kinds if targets[Kind(k)]]
    out: list[Fault] = []
    t, round_ = rng.uniform(*every), []
    while usable and t < duration_s:
        if not round_:
            round_ = list(usable)
            rng.shuffle(round_)
        kind = Kind(round_.pop())
        param = {Kind.PAUSE: rng.uniform(2.0, 8.0), Kind.CLIENT_CUT: float(rng.randint(1, 4))}.get(
            kind, 5.0 if kind in TRANSFER_FAULTS else 0.0)
        out.append(Fault(round(t, 3), kind.value, rng.choice(targets[kind]), round(param, 3)))
        t += rng.uniform(*every)
    return out
