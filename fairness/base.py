"""The seam between the decode scheduler and the fairness controller."""
from __future__ import annotations

from typing import Protocol

from model_engine.page_pool import PagePool


class AdmissionPolicy(Protocol):
    name: str

    def admit_inherited(self, header, pool: PagePool) -> str | None:
        """Decide on an arriving inherited request from its header alone, before any payload.

        Return None to accept (the transport then reserves the pages), or a refusal reason
        starting with "no_pages" to defer: the prefill side keeps the pages and retries later.
        """
