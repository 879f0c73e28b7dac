"""memfair's own settings (`--policy memfair --policy-arg key=value`; fairness/memfair.py).

Everything else memfair decides is derived from the node it runs on (the pool's pages, the
step's token budget, each owner's request sizes), so the same defaults hold from one CPU core
to an H100 cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.settings import PolicySettings, setting

QUOTA_SHARES = ("dynamic", "static")  # shares among owners with work (idle shares lent) or among owners seen
RECLAIM_DROP = ("off", "prompts", "any")  # which borrowers reclaim drops for recompute without host room


@dataclass(frozen=True)
class MemFairSettings(PolicySettings):
    quota_shares: str = setting("dynamic", "dynamic: idle shares lent, borrowing; static: shares among every owner "
                                           "seen within static_window_s, no lending", choices=QUOTA_SHARES)
    static_window_s: float = setting(30.0, "static shares: an owner seen with work within this long keeps its share",
                                     lo=0.0, lo_open=True)
    starve_after_s: float = setting(2.0, "a request waiting this long for device pages is let in whatever its quota; "
                                         "a request moved between tiers stays put at least this long",
                                    lo=0.0, lo_open=True)
    reclaim_drop: str = setting("off", "without host room, reclaim drops borrowers for recompute: off (the waiter "
                                       "waits for free pages), prompts (those that streamed nothing), any (those "
                                       "first); a drop never leaves the borrower's owner below its share",
                                choices=RECLAIM_DROP)
