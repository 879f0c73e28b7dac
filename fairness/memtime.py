"""`memtime`: a memory-time counter, VTC (fairness/vtc.py) charged in KV page-seconds.

Each tenant's counter grows by the device pages its requests hold (shared pages by the pool's
charge rule) times the seconds they hold them (host-tier pages at `host_weight` of that); admission serves the waiting
tenant with the smallest counter, and the largest counter's newest request gives pages back.
The counter lift of VTC applies: a tenant whose queue turns non-empty starts from the
smallest counter among tenants with waiting work. This prices a request by memory x time, as
Justitia (arXiv 2510.17015) does, in VTC's bookkeeping: the prior work closest to memfair.
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting
from fairness.vtc import VtcPolicy


@dataclass(frozen=True)
class MemTimeSettings(PolicySettings):
    host_weight: float = setting(0.0, "charge of a host-tier page-second against a device one", lo=0.0, hi=1.0)


class MemTimePolicy(VtcPolicy):
    name = "memtime"
    Settings = MemTimeSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.last: float | None = None  # state.now at the previous step

    def on_step(self, chunks, state) -> None:
        BasePolicy.on_step(self, chunks, state)  # the bandwidth cap's bookkeeping, not VTC's token charges
        dt = 0.0 if self.last is None else max(0.0, state.now - self.last)
        self.last = state.now
        if dt <= 0.0:
            return
        w = self.settings.host_weight
        for s in (*self.running, *self.candidates):
            held = state.charge.get(s.request_id, 0) + w * state.host_pages.get(s.request_id, 0)
            if held:
                self.counters[s.tenant] = self.counters.get(s.tenant, 0.0) + held * dt

    def on_steps(self, chunks, state, starts) -> None:
        """As `on_step` at each of `starts`. Nothing waits during such a run: the running rows
        are the only holders, each holding as a step began the pages of its context then (a
        page added every page_size steps), or the pages it ends with if it had more."""
        ps, n, counters, pages = state.page_size, len(starts), self.counters, state.charge
        rows = [(s.tenant, s.num_computed_tokens + 1, pages.get(s.request_id, 0)) for s in self.running]
        for q, t in enumerate(starts):
            dt = 0.0 if self.last is None else max(0.0, t - self.last)
            self.last = t
            if dt <= 0.0:
                continue
            back = n - 1 - q  # steps before the last
            for tenant, ctx, last in rows:
                need = -(-ctx // ps)
                held = last if last != need else -(-(ctx - back) // ps)
                if held:
                    counters[tenant] = counters.get(tenant, 0.0) + held * dt
