"""A policy seen through the interface alone, every answer checked and traced.

A policy seen only through the declared interface (fairness/interface.py), every answer
checked as it is given. The conformance run hands the scheduler and the placement rule this
wrapper instead of the policy, so a policy that works here uses nothing else.

An illegal answer is recorded (`violations`) and replaced by the first-come first-served
default for that question, so that one bad answer does not stop the run; an exception from
the policy is raised again as `PolicyRaised`, naming the method.
"""
from __future__ import annotations

from fairness.interface import Arrival, Placement, QuotaView


class PolicyRaised(Exception):
    def __init__(self, method: str, exc: BaseException) -> None:
        super().__init__(f"{method} raised {type(exc).__name__}: {exc}")
        self.method = method


def _ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


class Guarded:
    """The interface's methods of `inner`, each answer checked; `trace` records every answer
    (request ids and values, in call order) for the determinism check."""

    def __init__(self, inner, trace: list, violations: list) -> None:
        self._inner, self.trace, self.violations = inner, trace, violations
        self.name = str(getattr(inner, "name", "?"))
        self.strict_order = bool(getattr(inner, "strict_order", True))
        self.answers = 0
        self.bad_answers = 0  # illegal answers, every one (violations keeps the first 50)

    def _call(self, method: str, *args):
        try:
            out = getattr(self._inner, method)(*args)
        except Exception as e:
            raise PolicyRaised(method, e) from e
        self.answers += 1
        return out

    def _bad(self, what: str) -> None:
        self.bad_answers += 1
        if len(self.violations) < 50:
            self.violations.append(what)

    def _subset(self, method: str, out, given: list, whole: bool):
        if not isinstance(out, list) or any(s not in given for s in out) or len(set(map(id, out))) != len(out) \
                or (whole and len(out) != len(given)):
            rule = "a reordering of its candidates" if whole else "a subset of the running requests, no repeats"
            self._bad(f"{method} answered {_ids(out) if isinstance(out, list) else out!r}: must be {rule}")
            return list(given) if whole else []
        return out

    # ---- the scheduler's questions ----------------------------------------------------------------
    def refresh(self, running, candidates, state) -> None:
        self._call("refresh", running, candidates, state)

    def reclaim(self, running, candidates, state):
        out = self._subset("reclaim", self._call("reclaim", running, candidates, state), running, False)
        self.trace.append(("reclaim", state.step, _ids(out)))
        return out

    def step_order(self, running, state):
        out = self._subset("step_order", self._call("step_order", running, state), running, False)
        self.trace.append(("step", state.step, _ids(out)))
        return out

    def admission_order(self, candidates, state):
        out = self._subset("admission_order", self._call("admission_order", candidates, state), candidates, True)
        self.trace.append(("order", state.step, _ids(out)))
        return out

    def may_admit(self, seq, need_pages, state) -> bool:
        out = self._call("may_admit", seq, need_pages, state)
        if not isinstance(out, bool):
            self._bad(f"may_admit({seq.request_id}) answered {out!r}: must be a bool")
            out = bool(out)
        self.trace.append(("admit", state.step, seq.request_id, out))
        return out

    def admitted(self, seq, need_pages, state) -> None:
        if hasattr(self._inner, "admitted"):  # (optional: BasePolicy has it)
            self._call("admitted", seq, need_pages, state)

    def pick_victim(self, candidates, requester, state):
        out = self._call("pick_victim", candidates, requester, state)
        if out is None and requester.in_prefill:  # a prompt's chunk waits
            self.trace.append(("victim", state.step, None))
            return None
        if out not in candidates:
            self._bad(f"pick_victim answered {getattr(out, 'request_id', out)!r}: must be one of its candidates")
            out = candidates[-1]
        self.trace.append(("victim", state.step, out.request_id))
        return out

    def chunk_limit(self, seq, budget, state) -> int:
        out = self._call("chunk_limit", seq, budget, state)
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            self._bad(f"chunk_limit({seq.request_id}) answered {out!r}: must be an int >= 1")
            out = budget
        self.trace.append(("chunk", state.step, seq.request_id, out))
        return out

    def on_step(self, chunks, state) -> None:
        self._call("on_step", chunks, state)

    # ---- the decode node's ---------------------------------------------------------------------------
    def place_arrival(self, arrival: Arrival, queued: int, state) -> Placement:
        out = self._call("place_arrival", arrival, queued, state)
        rid = arrival.request_id
        if not isinstance(out, Placement):
            self._bad(f"place_arrival({rid}) answered {out!r}: must be a fairness.Placement")
            out = Placement.DEFER
        elif out is Placement.DEVICE and arrival.num_pages > state.device_free:
            self._bad(f"place_arrival({rid}) put {arrival.num_pages} pages on the device tier with "
                      f"{state.device_free} free: admits beyond free pages")
            out = Placement.DEFER
        elif out is Placement.HOST and arrival.num_pages > state.host_free:
            self._bad(f"place_arrival({rid}) parked {arrival.num_pages} pages with {state.host_free} "
                      f"free in the host tier: admits beyond free pages")
            out = Placement.DEFER
        self.trace.append(("place", state.step, rid, out.value))
        return out

    def waiting_arrivals(self, state) -> list:
        out = self._call("waiting_arrivals", state)
        if not isinstance(out, list) or not all(isinstance(a, Arrival) for a in out):
            self._bad(f"waiting_arrivals answered {out!r}: must be a list of fairness.Arrival")
            return []
        return out

    def forget(self, request_id: str) -> None:
        self._call("forget", request_id)

    def quotas(self) -> QuotaView:
        out = self._call("quotas")
        if not isinstance(out, QuotaView):
            self._bad(f"quotas answered {out!r}: must be a fairness.QuotaView")
            return QuotaView()
        return out
