"""Decode-side fairness controller: admission of inherited pages, quotas, eviction policies.

Policies are small objects behind `fairness.base.AdmissionPolicy`, registered by name.
"""
from __future__ import annotations

from fairness.base import AdmissionPolicy
from fairness.fcfs import FcfsPolicy

POLICIES: dict[str, type] = {"fcfs": FcfsPolicy}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
