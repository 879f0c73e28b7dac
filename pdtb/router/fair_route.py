"""D²LPM routing (`--route d2lpm`): the distributed form of DLPM (Cao et al., arXiv 2501.14312).

The router keeps a credit per (client, worker), a worker being a prefill or colocated node. A
request of client c goes, among the candidates on which c's credit is positive, to the one whose
cache holds the longest prefix of its prompt (pdtb/router/cache_route.py's overlap), ties by the
load rule's order. When c's credit is positive on none, every candidate's credit for c gains
`quantum` as many times as it takes for one to turn positive (a deficit round, as DLPM's local
counters refill). The chosen worker's credit for c is charged `input_weight` per prompt token it
does not hold cached, at dispatch, and `output_weight` per token the request generated, when it
ends. Locality is followed only as far as the client has paid for it on that worker: a client
that keeps hitting one worker's cache spends its credit there and spills to the others, instead
of piling onto one node while the rest idle. Each node runs its own policy (dlpm pairs with it).

Several router processes behind one port (pdtb/router/peers.py) each keep their own credits and
see about 1/N of a client's requests: each charges `charge_scale` = N times what a request costs,
so that a client's credit on a worker runs out after the same share of the cluster's requests as
with one router, and the deficit rounds come as often.

Pure: no sockets, no clock. The router's placement (pdtb/router/placement.py) asks `pick`, which
writes nothing, and its dispatcher writes the credit the choice costs; the simulator's router
(pdtb/sim/cluster.py) calls `choose`, which does both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RouteCandidate:
    """One worker as D²LPM sees it for one request."""

    node_id: str
    overlap_tokens: int  # prompt tokens the router believes the worker holds cached
    tie: tuple  # the load rule's order among equal overlaps, lower first


@dataclass(frozen=True)
class D2lpmPick:
    """One D²LPM decision before it is charged."""

    index: int  # position of the chosen candidate
    credit: dict[tuple[str, str], float]  # (client, node id) -> its credit once charged for this request


@dataclass
class D2lpmRouter:
    quantum: float = 2048.0  # credit a client gains on every worker per deficit round
    input_weight: float = 1.0  # charge per uncached prompt token dispatched
    output_weight: float = 2.0  # charge per generated token
    charge_scale: float = 1.0  # every charge times this: N with N routers, each seeing 1/N of the requests
    credit: dict[tuple[str, str], float] = field(default_factory=dict)  # (client, node id) -> credit

    def __post_init__(self) -> None:
        if not (self.quantum > 0 and math.isfinite(self.quantum)):
            raise ValueError(f"quantum must be a positive number, got {self.quantum!r}")
        for name in ("input_weight", "output_weight"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not (self.charge_scale > 0 and math.isfinite(self.charge_scale)):
            raise ValueError(f"charge_scale must be a positive number, got {self.charge_scale!r}")

    def choose(self, client: str, prompt_tokens: int, cands: Sequence[RouteCandidate]) -> int | None:
        """Index of the chosen candidate (charged for the prompt tokens it must prefill); None
        when there are none."""
        pick = self.pick(client, prompt_tokens, cands)
        if pick is None:
            return None
        self.credit.update(pick.credit)
        return pick.index

    def pick(self, client: str, prompt_tokens: int, cands: Sequence[RouteCandidate]) -> D2lpmPick | None:
        """`choose`'s answer and the credits it writes, with nothing written; None when there
        are no candidates."""
        if not cands:
            return None
        credits = [self.credit.get((client, c.node_id), 0.0) for c in cands]
        writes = {}
        top = max(credits)
        if top <= 0:
            rounds = math.floor(-top / self.quantum) + 1
            credits = [x + rounds * self.quantum for x in credits]
            writes = {(client, c.node_id): x for c, x in zip(cands, credits)}
        best = min((i for i, x in enumerate(credits) if x > 0),
                   key=lambda i: (-cands[i].overlap_tokens, cands[i].tie, i))
        chosen = cands[best]
        writes[(client, chosen.node_id)] = credits[best] - self.charge_scale * self.input_weight * max(
            0, prompt_tokens - chosen.overlap_tokens)
        return D2lpmPick(best, writes)

    def charge_output(self, client: str, node_id: str, tokens: int) -> None:
        """A request of `client` that `node_id` took generated `tokens` tokens."""
        key = (client, node_id)
        self.credit[key] = self.credit.get(key, 0.0) - self.charge_scale * self.output_weight * tokens
