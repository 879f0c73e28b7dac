"""memfair's own settings (`--policy memfair --policy-arg key=value`; fairness/memfair.py)."""
from __future__ import annotations

from dataclasses import dataclass

from fairness.settings import PolicySettings, setting

QUOTA_SHARES = ("dynamic", "static")  # shares among owners with work (idle shares lent) or among owners seen


@dataclass(frozen=True)
class MemFairSettings(PolicySettings):
    request_cap_frac: float = setting(0.5, "under contention, one request holds at most this share of the device tier",
                                      lo=0.0, hi=1.0, lo_open=True)
    dynamic_quota: bool = setting(False, "the per-request cap grows with the request's length, up to the pool")
    borrow_reserve_frac: float = setting(0.1, "a tenant beyond its share leaves this much of the pool free while "
                                              "others have work", lo=0.0, hi=1.0)
    prefill_share_frac: float = setting(1 / 32, "beside other tenants' requests, a long prompt's chunk takes at most "
                                                "this share of a step", lo=0.0, hi=1.0, lo_open=True)
    prefill_idle_frac: float = setting(1 / 4, "while other tenants are active but have no row in the step, a long "
                                              "prompt's chunk takes this share", lo=0.0, hi=1.0, lo_open=True)
    long_prompt_frac: float = setting(1 / 8, "a prompt longer than this share of the step budget is long",
                                      lo=0.0, hi=1.0, lo_open=True)
    active_window_s: float = setting(1.0, "a tenant with work within this many seconds is still active", lo=0.0)
    long_yield_steps: int = setting(0, "while another tenant has decode rows, a long prompt sits out up to this many "
                                       "steps in a row (0: never)", lo=0)
    read_share: bool = setting(True, "while other tenants decode, a tenant's decode rows read at most its "
                                     "entitlement of pages per step")
    read_turn_steps: int = setting(16, "steps a turn of rows chosen by the read share lasts", lo=1)
    quota_shares: str = setting("dynamic", "dynamic: idle shares lent, borrowing; static: shares among every owner "
                                           "seen within static_window_s, no lending", choices=QUOTA_SHARES)
    static_window_s: float = setting(30.0, "static shares: an owner seen with work within this long keeps its share",
                                     lo=0.0, lo_open=True)
    starve_after_s: float = setting(2.0, "a request waiting this long for device pages is let in whatever its quota",
                                    lo=0.0, lo_open=True)
