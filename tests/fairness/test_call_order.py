"""The order in which the real Scheduler asks a policy its questions within one step, as
fairness/interface.py and docs/policies.md state it: reclaim, step_order, per running row its
chunk_limit then any pick_victim, admission_order, per candidate its chunk_limit then may_admit
(and admitted after a yes), on_step. memfair sizes a candidate's chunk before it is asked to admit it, so this order is part
of its rules."""
from __future__ import annotations

from fairness import BasePolicy
from fairness.interface import OPTIONAL_METHODS, REQUIRED_METHODS
from sched_sim import make_request, make_scheduler


class Recording:
    """A first-come first-served policy that logs (method, request id or None) for every call made
    on it from outside (its own calls to itself are not logged)."""

    def __init__(self) -> None:
        self.inner = BasePolicy()
        self.name, self.strict_order = "recording", True
        self.log: list[tuple[str, str | None]] = []

    def __getattr__(self, method):
        if method not in (*REQUIRED_METHODS, *OPTIONAL_METHODS) or method == "on_steps":
            raise AttributeError(method)
        call = getattr(self.inner, method)

        def logged(*args):
            rid = args[0].request_id if method in ("chunk_limit", "may_admit", "admitted") else \
                args[1].request_id if method == "pick_victim" else None
            self.log.append((method, rid))
            return call(*args)
        return logged


def running(sched, rid: str, tenant: str, prompt: int, computed: int, pages: int, arrival: float, decoding: bool):
    seq = make_request(prompt, 20, tenant=tenant, arrival=arrival, rid=rid)
    seq.num_computed_tokens = computed
    if decoding:
        seq.token_ids.append(7)
    sched.pool.allocate(rid, pages)
    sched.add_running(seq)
    return seq


def test_a_step_asks_in_the_documented_order():
    pol = Recording()
    sched = make_scheduler(pol, num_pages=8, budget=64)  # pages of 4 tokens
    # p: a prompt 8 of 24 tokens in, 2 pages; d: decoding, its 3 pages hold its next token; 3 free
    running(sched, "p", "a", 24, 8, 2, arrival=1.0, decoding=False)
    running(sched, "d", "b", 8, 8, 3, arrival=0.0, decoding=True)
    sched.add(make_request(4, 4, tenant="c", arrival=2.0, rid="w"))
    out = sched.schedule()
    # p's chunk (16 tokens: 6 pages, 4 more than it has) lacks pages: a victim is asked for (p
    # itself: d, the oldest, is spared) and p goes back to waiting, not to be admitted again this
    # step; d decodes; w's 4-token chunk is sized, then w is asked in (a page of the 5 free) and
    # told it is in, and the step is told what it served
    assert pol.log == [("reclaim", None), ("step_order", None), ("chunk_limit", "p"), ("pick_victim", "p"),
                       ("admission_order", None), ("chunk_limit", "w"), ("may_admit", "w"), ("admitted", "w"),
                       ("on_step", None)]
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("d", 1), ("w", 4)]
    assert [s.request_id for s in out.preempted] == ["p"]
