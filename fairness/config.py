"""The fairness settings every policy shares: weights, quota owners, reservations, caps, SLO targets."""
from __future__ import annotations

from dataclasses import dataclass, field

VICTIM_NAMES = ("lru", "newest", "least_progress", "footprint")  # fairness/eviction.py
QUOTA_BY = ("request", "tenant", "priority", "slo-tier")  # who a memory quota belongs to (fairness/owners.py)


@dataclass(frozen=True)
class FairnessConfig:
    """What every policy reads. A policy's own knobs are its `Settings` (fairness/settings.py):
    memfair's in fairness/memfair_settings.py, vtc's and priority's in their files."""

    tenant_weights: dict = field(default_factory=dict)  # tenant -> weight (absent: 1.0)
    quota_by: str = "tenant"  # quota owner granularity, one of QUOTA_BY (fairness/owners.py)
    class_reservations: dict = field(default_factory=dict)  # priority -> share of device pages reserved for <= it
    tenant_bw_cap: float | None = None  # KV bytes/s one tenant's attention may read (None: no cap)
    victim: str | None = None  # eviction victim choice overriding the policy's: lru, newest, least_progress, footprint
    bw_window_s: float = 1.0  # window of the bandwidth cap
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
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant weights must be positive")
        if sum(self.class_reservations.values()) > 1.0:
            raise ValueError("class reservations add up to more than the pool")
        if self.tenant_bw_cap is not None and self.tenant_bw_cap <= 0:
            raise ValueError("tenant_bw_cap must be positive")
        if self.bw_window_s <= 0:
            raise ValueError("bw_window_s must be positive")
        if self.quota_by not in QUOTA_BY:
            raise ValueError(f"quota_by must be one of {', '.join(QUOTA_BY)}, got {self.quota_by!r}")
        if self.victim is not None and self.victim not in VICTIM_NAMES:
            raise ValueError(f"victim must be one of {', '.join(VICTIM_NAMES)}, got {self.victim!r}")

    def weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, 1.0))
