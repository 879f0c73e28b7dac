"""Decode-side fairness controller: admission of inherited pages against memory quotas,
victim choice for eviction to the host tier, bandwidth caps, SLO attribution.

A policy answers the declared interface (fairness/interface.py); `BasePolicy` gives
first-come first-served defaults. Built-in policies are registered by name; any other is
loaded by reference (`--policy module:Class`, `file.py:Class`, or an entry point of the
`pd_testbed.policies` group: fairness/registry.py).
"""
from __future__ import annotations

from types import MappingProxyType

from fairness.base import BasePolicy
from fairness.config import FairnessConfig
from fairness.interface import Arrival, Placement, Policy, QuotaView
from fairness.registry import PolicyInfo, PolicyLoadError, built_ins, make_policy, policy_info, resolve
from fairness.settings import NoSettings, PolicySettings, SettingsError, setting

# the built-in policies by name, read-only: others are loaded by reference (fairness/registry.py)
POLICIES = MappingProxyType(built_ins())

__all__ = ["POLICIES", "make_policy", "resolve", "policy_info", "PolicyInfo", "PolicyLoadError", "FairnessConfig",
           "BasePolicy", "Policy", "Placement", "Arrival", "QuotaView", "PolicySettings", "NoSettings", "setting",
           "SettingsError"]
