"""KV bandwidth metering per request and per tenant.

Counted per step from the scheduler's output: bytes attention reads (every page of a request
that steps is read once per layer pass: pages x page_bytes), and the tier moves (demote,
promote). Bytes received from prefill are added by the decode node.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

KINDS = ("attn_read", "received", "demoted", "promoted")


@dataclass
class KVMeter:
    per_tenant: dict = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(KINDS, 0)))
    per_request: dict = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(KINDS, 0)))
    tenant_of: dict = field(default_factory=dict)  # request id -> tenant (live requests only)
    tenant_key: Callable[[str], str] = lambda t: t  # the per_tenant key of a tenant (a node bounds them)

    def add(self, request_id: str, tenant: str, kind: str, nbytes: int) -> None:
        self.tenant_of[request_id] = tenant
        self.per_request[request_id][kind] += nbytes
        self.per_tenant[self.tenant_key(tenant)][kind] += nbytes

    def on_step(self, out, page_size: int, page_bytes: int) -> None:
        """Account one scheduler step, after the engine ran it (sequences have advanced). The
        pages attention read are those of the tokens computed so far, counted from the token
        count: a request that finished this step has already given its pages back."""
        for c in out.chunks:
            pages = -(-c.seq.num_computed_tokens // page_size)
            self.add(c.seq.request_id, c.seq.tenant, "attn_read", pages * page_bytes)
        for m in out.moves:
            if m.kind in ("demote", "promote"):
                tenant = self.tenant_of.get(m.request_id, "?")
                self.add(m.request_id, tenant, "demoted" if m.kind == "demote" else "promoted", m.num_bytes)

    def finish(self, request_id: str) -> dict:
        """Forget a finished request; return its totals."""
        self.tenant_of.pop(request_id, None)
        return dict(self.per_request.pop(request_id, dict.fromkeys(KINDS, 0)))
