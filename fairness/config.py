"""Configuration of the fairness controller: quotas, weights, caps, SLO targets."""
from __future__ import annotations

from dataclasses import dataclass, field

VICTIM_NAMES = ("lru", "newest", "least_progress", "footprint")  # fairness/eviction.py
QUOTA_BY = ("request", "tenant", "priority", "slo-tier")  # who a memory quota belongs to (fairness/owners.py)
QUOTA_SHARES = ("dynamic", "static")  # shares among owners with work (idle shares lent) or among owners seen


@dataclass(frozen=True)
class FairnessConfig:
    tenant_weights: dict = field(default_factory=dict)  # tenant -> weight (absent: 1.0)
    request_cap_frac: float = 0.5  # under contention, one request holds at most this share of the device tier
    borrow_reserve_frac: float = 0.1  # a tenant beyond its share leaves this much free while others have work
    prefill_share_frac: float = 1 / 32  # memfair: beside other tenants' requests, a long prompt's chunk takes at most this share of a step
    prefill_idle_frac: float = 1 / 4  # memfair: ... and while they are active but have none in the step, this share
    long_prompt_frac: float = 1 / 8  # memfair: a prompt longer than this share of the step budget is long
    active_window_s: float = 1.0  # memfair: a tenant with work within this long is still active
    long_yield_steps: int = 0  # memfair: while another tenant has decode rows, a long prompt sits out up to this many steps in a row (0: never)
    read_share: bool = True  # memfair: while other tenants decode, a tenant's decode rows read at most its entitlement of pages per step
    read_turn_steps: int = 16  # memfair: steps a turn of rows chosen by the read share lasts (rotation keeps read caches warm)
    dynamic_quota: bool = False  # per-request cap grows with the request's length, up to the pool
    quota_by: str = "tenant"  # memfair: quota owner granularity, one of QUOTA_BY (fairness/owners.py)
    quota_shares: str = "dynamic"  # memfair: dynamic (idle shares lent, borrowing) or static (no lending)
    static_window_s: float = 30.0  # memfair, static shares: an owner seen within this long keeps its share
    class_reservations: dict = field(default_factory=dict)  # priority -> share of device pages reserved for <= it
    tenant_bw_cap: float | None = None  # KV bytes/s one tenant's attention may read (None: no cap)
    victim: str | None = None  # eviction victim choice overriding the policy's: lru, newest, least_progress, footprint
    bw_window_s: float = 1.0  # window of the bandwidth cap
    starve_after_s: float = 2.0  # memfair: a request waiting this long for device pages is let in whatever its quota (reclaiming other tenants' borrowed pages)
    aging_s: float = 2.0  # priority policy: one class of boost per this many seconds unserved
    vtc_input_weight: float = 1.0  # VTC charge per input token
    vtc_output_weight: float = 2.0  # VTC charge per output token
    slo_ttft_s: dict = field(default_factory=dict)  # class (priority) -> TTFT target (s); "*" for all
    slo_tpot_s: dict = field(default_factory=dict)  # class (priority) -> TPOT target (s); "*" for all

    def __post_init__(self) -> None:
        import math

        numbers = [v for v in vars(self).values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for table in (self.tenant_weights, self.class_reservations, self.slo_ttft_s, self.slo_tpot_s):
            numbers += list(table.values())
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
            raise ValueError("fairness settings must be finite numbers (NaN passed every range check)")
        if any(v < 0 for v in (*self.class_reservations.values(), *self.slo_ttft_s.values(), *self.slo_tpot_s.values())):
            raise ValueError("class reservations and SLO targets must be >= 0")
        if not 0.0 < self.request_cap_frac <= 1.0:
            raise ValueError("request_cap_frac must be in (0, 1]")
        if not 0.0 < self.prefill_share_frac <= 1.0:
            raise ValueError("prefill_share_frac must be in (0, 1]")
        if not 0.0 < self.prefill_idle_frac <= 1.0:
            raise ValueError("prefill_idle_frac must be in (0, 1]")
        if not 0.0 < self.long_prompt_frac <= 1.0:
            raise ValueError("long_prompt_frac must be in (0, 1]")
        if self.active_window_s < 0:
            raise ValueError("active_window_s must be >= 0")
        if self.long_yield_steps < 0:
            raise ValueError("long_yield_steps must be >= 0")
        if self.starve_after_s <= 0:
            raise ValueError("starve_after_s must be positive")
        if self.aging_s <= 0:
            raise ValueError("aging_s must be positive")
        if self.read_turn_steps < 1:
            raise ValueError("read_turn_steps must be at least 1")
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant weights must be positive")
        if sum(self.class_reservations.values()) > 1.0:
            raise ValueError("class reservations add up to more than the pool")
        if self.tenant_bw_cap is not None and self.tenant_bw_cap <= 0:
            raise ValueError("tenant_bw_cap must be positive")
        if self.quota_by not in QUOTA_BY:
            raise ValueError(f"quota_by must be one of {', '.join(QUOTA_BY)}, got {self.quota_by!r}")
        if self.quota_shares not in QUOTA_SHARES:
            raise ValueError(f"quota_shares must be one of {', '.join(QUOTA_SHARES)}, got {self.quota_shares!r}")
        if self.static_window_s <= 0:
            raise ValueError("static_window_s must be positive")
        if self.victim is not None and self.victim not in VICTIM_NAMES:
            raise ValueError(f"victim must be one of {', '.join(VICTIM_NAMES)}, got {self.victim!r}")

    def weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, 1.0))
