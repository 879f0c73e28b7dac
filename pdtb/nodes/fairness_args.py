"""The fairness flags every node takes, and the `FairnessConfig` they make (the nodes and
`pdtb sim` share them, so a simulated run is configured exactly as a real one)."""
from __future__ import annotations

import argparse

from pdtb.common import CliError


def add_fairness_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--policy", default="fcfs", help="admission/fairness policy name")
    ap.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                    help="fairness weight of a tenant (repeatable; default 1)")
    ap.add_argument("--request-cap-frac", type=float, default=0.5, help="one request's max share of the device tier")
    ap.add_argument("--prefill-share", type=float, default=1 / 32,
                    help="memfair: in a step with another tenant's requests, a long prompt's chunk takes at most this "
                         "share of the step budget")
    ap.add_argument("--prefill-idle-share", type=float, default=1 / 4,
                    help="memfair: in a step without another tenant's requests, while one is active, this share "
                         "(give it --prefill-share's value for the small chunk whenever another tenant is active)")
    ap.add_argument("--long-prompt", type=float, default=1 / 8,
                    help="memfair: a prompt longer than this share of the step budget is long")
    ap.add_argument("--active-window", type=float, default=1.0, metavar="S",
                    help="memfair: a tenant that had work within S seconds still counts as active")
    ap.add_argument("--long-yield-steps", type=int, default=0, metavar="N",
                    help="memfair: while another tenant has decode rows in the step, a long prompt sits the step "
                         "out, at most N steps in a row (default 0: it takes its small chunk every step)")
    ap.add_argument("--no-read-share", dest="read_share", action="store_false",
                    help="memfair: let a tenant's decode rows read more than its share of the device tier per step "
                         "while other tenants decode (default: they take turns)")
    ap.add_argument("--read-turn-steps", type=int, default=16, help="memfair: steps one turn of the read share lasts")
    ap.add_argument("--starve-after", type=float, default=2.0, metavar="S",
                    help="memfair: a request waiting S seconds for device pages is let in whatever its quota")
    ap.add_argument("--aging", type=float, default=2.0, metavar="S",
                    help="priority: a request gains one class of urgency per S seconds unserved")
    ap.add_argument("--dynamic-quota", action="store_true", help="per-request cap grows with its length")
    ap.add_argument("--quota-by", choices=["request", "tenant", "priority", "slo-tier"], default="tenant",
                    help="memfair: who a memory quota belongs to: each tenant (default), each request, each priority "
                         "class, or each SLO tier (the request's slo_tier, else its tenant's; fairness/owners.py)")
    ap.add_argument("--quota-shares", choices=["dynamic", "static"], default="dynamic",
                    help="memfair: dynamic (default): shares among the owners with work, an idle owner's share lent "
                         "and borrowing while nobody within its share waits; static: shares among every owner seen "
                         "within --static-window, nothing lent, no borrowing")
    ap.add_argument("--static-window", type=float, default=30.0, metavar="S",
                    help="memfair, --quota-shares static: an owner seen with work within S seconds keeps its share")
    ap.add_argument("--reserve", action="append", default=[], metavar="PRIORITY=FRAC",
                    help="share of device pages reserved for requests of this priority or more urgent")
    ap.add_argument("--tenant-bw-cap", type=float, default=None, help="KV bytes/s one tenant's attention may read")
    ap.add_argument("--victim", choices=["lru", "newest", "least_progress", "footprint"], default=None,
                    help="eviction victim choice, overriding the policy's own (fairness/eviction.py)")
    ap.add_argument("--slo-ttft", action="append", default=[], metavar="CLASS=S",
                    help="TTFT target in seconds for a priority class ('*' for all)")
    ap.add_argument("--slo-tpot", action="append", default=[], metavar="CLASS=S", help="TPOT target in seconds")


def _pairs(items: list[str], flag: str, key=str) -> dict:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key(k) if k != "*" else "*"] = float(v)
        except ValueError:
            raise CliError(f"{flag} expects KEY=NUMBER, got {it!r}") from None
    return out


def fairness_config(a: argparse.Namespace):
    from fairness.config import FairnessConfig

    try:
        return FairnessConfig(tenant_weights=_pairs(a.tenant_weight, "--tenant-weight"),
                              request_cap_frac=a.request_cap_frac, dynamic_quota=a.dynamic_quota,
                              quota_by=a.quota_by, quota_shares=a.quota_shares, static_window_s=a.static_window,
                              prefill_share_frac=a.prefill_share,
                              prefill_idle_frac=a.prefill_idle_share, read_share=a.read_share,
                              long_prompt_frac=a.long_prompt, active_window_s=a.active_window,
                              read_turn_steps=a.read_turn_steps, long_yield_steps=a.long_yield_steps,
                              class_reservations=_pairs(a.reserve, "--reserve", int), tenant_bw_cap=a.tenant_bw_cap,
                              victim=a.victim, starve_after_s=a.starve_after, aging_s=a.aging,
                              slo_ttft_s=_pairs(a.slo_ttft, "--slo-ttft", int),
                              slo_tpot_s=_pairs(a.slo_tpot, "--slo-tpot", int))
    except ValueError as e:
        raise CliError(str(e)) from None
