"""The typed seam between a KV transfer and the node that receives it.

A receiver asks its node's `admit(header)` before any payload byte, and gets an `Admission`:

    ACCEPT  reserve pages in the device pool and receive
    PARK    reserve pages in `pool` (the host tier: the request arrives parked)
    DEFER   refuse for now with FailCode.NO_PAGES; the sender keeps its pages and retries
    REFUSE  refuse for good with `code` (TOO_LARGE, DRAINING, BAD_METADATA)

DEFER and REFUSE carry a `FailCode` (kv_transport/fail_codes.py), the code the receiver sends in
its `Nack`; `REFUSALS` lists the codes an admission may answer with.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transport.fail_codes import FailCode

if TYPE_CHECKING:
    from pdtb.engine.page_pool import PagePool


REFUSALS = (FailCode.NO_PAGES, FailCode.TOO_LARGE, FailCode.DRAINING, FailCode.BAD_METADATA)


class Verdict(enum.Enum):
    ACCEPT = "accept"
    PARK = "park"
    DEFER = "defer"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    """A node's answer to a transfer header."""

    verdict: Verdict
    code: FailCode | None = None  # DEFER: NO_PAGES; REFUSE: why
    reason: str = ""  # human-readable detail, sent in the Nack
    pool: "PagePool | None" = None  # PARK: the pool (same geometry) to receive into

    @staticmethod
    def accept() -> "Admission":
        return _ACCEPT

    @staticmethod
    def park(pool: "PagePool") -> "Admission":
        return Admission(Verdict.PARK, pool=pool)

    @staticmethod
    def defer(reason: str) -> "Admission":
        return Admission(Verdict.DEFER, FailCode.NO_PAGES, reason)

    @staticmethod
    def refuse(code: FailCode, reason: str) -> "Admission":
        if code not in REFUSALS or code == FailCode.NO_PAGES:
            raise ValueError(f"{code!r} is not a refusal for good (DEFER is NO_PAGES)")
        return Admission(Verdict.REFUSE, code, reason)


_ACCEPT = Admission(Verdict.ACCEPT)
