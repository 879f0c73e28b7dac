"""The decode loop's own work per hand-off landed (`land_s`), from a real decode node's gaps
between steps against the runs' landing stamps.

The decode loop's own work for each hand-off that lands, read from real runs: a decode node's
step log (the gaps between two steps that both decoded, `StepLogRead.busy_windows`) against the
results files' hand-offs (each request's `transfer_end` stamp, taken where the node adopts it,
between two steps; wall clock, every process on one host).

    land_s = median(gaps in which exactly one hand-off landed) - median(gaps in which none did)

Only decode nodes' logs give windows (pdtb sim calibrate), and each run is taken to have one
decode node: landings on another decode node of the same run would count as this one's.

What the difference holds: the header's placement, the pages reserved and written, the
request adopted, and the other processes' work at that moment (the prefill node sending, the
router streaming the first token) on the cores the decode node shares with them. The simulator
charges it to the decode node's next step (pdtb/sim/roles.py `SimDecode.on_landed`).
"""
from __future__ import annotations

import bisect
import statistics

MIN_GAPS = 5  # fewer gaps with one landing: nothing is fitted


def landing_stamps(results: list[dict]) -> list[float]:
    """Every handed-off request's transfer_end stamp in the results files' objects, sorted."""
    out = []
    for doc in results:
        for r in doc.get("requests", []):
            s = (r.get("server_timing") or {}).get("stamps") or {}
            if isinstance(s.get("transfer_end"), (int, float)):
                out.append(float(s["transfer_end"]))
    return sorted(out)


def fit_landing(windows: list[tuple[float, float]], stamps: list[float]) -> dict | None:
    """{"land_s", "gaps_one", "gaps_none"} from the gaps' (start, end) windows and the sorted
    landing stamps, or None with fewer than MIN_GAPS gaps holding exactly one landing."""
    one, none = [], []
    for w in windows:
        n = landings_in(w, stamps)
        if n == 0:
            none.append(w[1] - w[0])
        elif n == 1:
            one.append(w[1] - w[0])
    if len(one) < MIN_GAPS or not none:
        return None
    land = max(0.0, statistics.median(one) - statistics.median(none))
    return {"land_s": round(land, 7), "gaps_one": len(one), "gaps_none": len(none)}


def landings_in(window: tuple[float, float], stamps: list[float]) -> int:
    """How many hand-offs landed within the gap `window` (stamps sorted)."""
    return bisect.bisect_right(stamps, window[1]) - bisect.bisect_left(stamps, window[0])
