"""KV bandwidth metering per request and per tenant.

Counted per step from the scheduler's output: bytes attention reads (every page of a request
that steps is read once per layer pass: pages x page_bytes), and the tier moves (demote,
promote). Bytes received from prefill are added by the decode node.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

# "cached" (decode side) and "not_sent" (prefill side): KV of a hand-off's leading pages that the
# decode node had in its prefix cache, so they were not sent; "migrated_in" / "migrated_out": KV
# a live migration between decode nodes moved (decode_node/migration.py)
KINDS = ("attn_read", "received", "demoted", "promoted", "cached", "not_sent", "migrated_in", "migrated_out")


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

    def on_step(self, out, page_size: int, page_bytes: int) -> dict[tuple[str, str], int]:
        """Account one scheduler step, after the engine ran it (sequences have advanced). The
        pages attention read are those of the tokens computed so far, counted from the token
        count: a request that finished this step has already given its pages back. Returns
        the step's bytes per (tenant key, kind)."""
        step: dict[tuple[str, str], int] = {}
        by_tenant: dict[str, int] = {}
        per_request, tenant_of = self.per_request, self.tenant_of
        for c in out.chunks:  # per row only what is per request; tenants summed once below
            seq = c.seq
            nbytes = -(-seq.num_computed_tokens // page_size) * page_bytes
            tenant_of[seq.request_id] = seq.tenant
            per_request[seq.request_id]["attn_read"] += nbytes
            by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + nbytes
        for tenant, nbytes in by_tenant.items():
            key = self.tenant_key(tenant)
            self.per_tenant[key]["attn_read"] += nbytes
            step[(key, "attn_read")] = step.get((key, "attn_read"), 0) + nbytes
        for m in out.moves:
            if m.kind in ("demote", "promote"):
                tenant, kind = self.tenant_of.get(m.request_id, "?"), "demoted" if m.kind == "demote" else "promoted"
                self.add(m.request_id, tenant, kind, m.num_bytes)
                key = (self.tenant_key(tenant), kind)
                step[key] = step.get(key, 0) + m.num_bytes
        return step

    def add_reads(self, reads) -> dict[str, int]:
        """Attention reads of several steps at once ((sequence, bytes) pairs: each the sum of
        what `on_step` would count for it over those steps); returns bytes per tenant key."""
        by_key: dict[str, int] = {}
        per_request, tenant_of = self.per_request, self.tenant_of
        for seq, nbytes in reads:
            tenant_of[seq.request_id] = seq.tenant
            per_request[seq.request_id]["attn_read"] += nbytes
            key = self.tenant_key(seq.tenant)
            by_key[key] = by_key.get(key, 0) + nbytes
        for key, nbytes in by_key.items():
            self.per_tenant[key]["attn_read"] += nbytes
        return by_key

    def finish(self, request_id: str) -> dict:
        """Forget a finished request; return its totals."""
        self.tenant_of.pop(request_id, None)
        return dict(self.per_request.pop(request_id, dict.fromkeys(KINDS, 0)))
