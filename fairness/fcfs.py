"""`fcfs`: admit inherited requests in arrival order while pages are free; no quotas."""
from __future__ import annotations

from model_engine.page_pool import PagePool


class FcfsPolicy:
    name = "fcfs"

    def admit_inherited(self, header, pool: PagePool) -> str | None:
        if header.num_pages > pool.num_free:
            return f"no_pages: need {header.num_pages}, {pool.num_free} free"
        return None
