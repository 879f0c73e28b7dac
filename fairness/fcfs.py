"""`fcfs`: the baseline. Admit in arrival order while pages are free, no quotas, LRU eviction."""
from __future__ import annotations

from fairness.base import BasePolicy


class FcfsPolicy(BasePolicy):
    name = "fcfs"
