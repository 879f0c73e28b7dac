"""The fairness flags every node takes, and what they make: the policy reference with its own
settings (`--policy`, `--policy-arg`) and the shared `FairnessConfig`. The nodes, `pdtb sim`,
`pdtb generate` and the lockstep comparison share them, so every run is configured alike.

A policy's settings are `--policy-arg key=value` (`pdtb policies show NAME` lists them). The
older flags for memfair's and priority's settings (`--starve-after`, `--aging`, ...) each stand
for a `--policy-arg`: they set it for a policy that has the setting, and are refused, naming
the `--policy-arg` spelling, for one that does not.
"""
from __future__ import annotations

import argparse
import dataclasses

from pdtb.common import CliError

# flag -> (the setting it stands for, how its value reads); the value given as on the command line
LEGACY_FLAGS = {
    "--starve-after": ("starve_after_s", float),
    "--aging": ("aging_s", float),
    "--quota-shares": ("quota_shares", str),
    "--static-window": ("static_window_s", float),
}


def add_fairness_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--policy", default="fcfs", metavar="NAME|module:Class|file.py:Class",
                    help="admission/fairness policy: a name (`pdtb policies`), or a class by reference")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the policy's own (repeatable; `pdtb policies show NAME` lists them)")
    ap.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                    help="fairness weight of a tenant (repeatable; default 1)")
    ap.add_argument("--quota-by", choices=["request", "tenant", "priority", "slo-tier"], default="tenant",
                    help="who a memory quota belongs to: each tenant (default), each request, each priority "
                         "class, or each SLO tier (the request's slo_tier, else its tenant's; fairness/owners.py)")
    ap.add_argument("--reserve", action="append", default=[], metavar="PRIORITY=FRAC",
                    help="share of device pages reserved for requests of this priority or more urgent")
    ap.add_argument("--tenant-bw-cap", type=float, default=None, help="KV bytes/s one tenant's attention may read")
    ap.add_argument("--victim", choices=["lru", "newest", "least_progress", "footprint"], default=None,
                    help="eviction victim choice, overriding the policy's own (fairness/eviction.py)")
    ap.add_argument("--slo-ttft", action="append", default=[], metavar="CLASS=S",
                    help="TTFT target in seconds for a priority class ('*' for all)")
    ap.add_argument("--slo-tpot", action="append", default=[], metavar="CLASS=S", help="TPOT target in seconds")
    legacy = ap.add_argument_group("settings of built-in policies, by their older flags (prefer --policy-arg)")
    for flag, (key, kind) in LEGACY_FLAGS.items():
        legacy.add_argument(flag, dest=f"legacy_{key}", type=kind, default=None, help=f"--policy-arg {key}=...")


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


def policy_args(a: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The policy's settings as (key, value) pairs: the older flags' first, then `--policy-arg`s
    (a later one wins). The policy is loaded and the settings checked now, so that a bad
    reference or value stops the command before anything starts."""
    from fairness import PolicyLoadError, SettingsError, resolve
    from fairness.registry import make_settings
    from fairness.settings import parse_pairs

    try:
        entry = resolve(a.policy)
    except PolicyLoadError as e:
        raise CliError(str(e)) from None
    own = {f.name for f in dataclasses.fields(entry.settings_cls)}
    pairs = []
    for flag, (key, _) in LEGACY_FLAGS.items():
        value = getattr(a, f"legacy_{key}", None)
        if value is None:
            continue
        if key not in own:
            raise CliError(f"{flag} is a setting policy {a.policy} does not have; it stands for "
                           f"--policy-arg {key}=VALUE, for a policy with that setting (pdtb policies show NAME)")
        pairs.append((key, str(value)))
    try:
        pairs += parse_pairs(a.policy_arg)
        make_settings(entry, pairs)
    except SettingsError as e:
        raise CliError(str(e)) from None
    return tuple(pairs)


def fairness_config(a: argparse.Namespace):
    from fairness.config import FairnessConfig

    try:
        return FairnessConfig(tenant_weights=_pairs(a.tenant_weight, "--tenant-weight"), quota_by=a.quota_by,
                              class_reservations=_pairs(a.reserve, "--reserve", int), tenant_bw_cap=a.tenant_bw_cap,
                              victim=a.victim, slo_ttft_s=_pairs(a.slo_ttft, "--slo-ttft", int),
                              slo_tpot_s=_pairs(a.slo_tpot, "--slo-tpot", int))
    except ValueError as e:
        raise CliError(str(e)) from None
