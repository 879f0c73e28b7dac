"""The end-to-end digest sealing a KV hand-off's request metadata.

The request state a KV hand-off carries (prefill -> decode), sealed with an end-to-end digest.

The transport checksums the payload bytes, not the header's metadata. A flipped byte there (a
router id, the first token, max_tokens) can still decode cleanly and would send the request's
tokens to no router (the client waits until its timeout) or make them wrong. The prefill node
seals what it sends; the decode node refuses a header whose seal does not match, and the prefill
node then fails the request with the reason. (A corrupted transfer id is not covered: its ACK
goes unanswered and the sender times out, which also ends the request with a reason.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from kv_transport import TransferMeta

DIGEST_KEY = "meta_digest"  # in TransferMeta.extra / KVTransferHeader.extra


def _digest(request_id: str, tenant: str, prompt: list, output: list, num_computed: int, num_tokens: int,
            num_pages: int, extra: dict, skip_pages: int = 0, page_hashes: list | tuple = ()) -> str:
    body = {k: v for k, v in extra.items() if k != DIGEST_KEY}
    # the page hashes choose which cached pages the receiver reads as this request's prefix:
    # sealed like the tokens they stand for
    text = json.dumps([request_id, tenant, prompt, output, num_computed, num_tokens, num_pages, body,
                       skip_pages, list(page_hashes)],
                      sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def seal(meta: TransferMeta, request_id: str, num_tokens: int, num_pages: int, skip_pages: int = 0) -> TransferMeta:
    """`meta` with the digest of everything the decode node will trust added to its extra."""
    d = _digest(request_id, meta.tenant, list(meta.prompt_token_ids), list(meta.output_token_ids),
                meta.num_computed_tokens, num_tokens, num_pages, meta.extra, skip_pages, meta.page_hashes)
    return dataclasses.replace(meta, extra={**meta.extra, DIGEST_KEY: d})


def check(header) -> str | None:
    """Why a KVTransferHeader's metadata cannot be trusted, or None when its seal matches."""
    got = header.extra.get(DIGEST_KEY)
    want = _digest(header.request_id, header.tenant, header.prompt_token_ids, header.output_token_ids,
                   header.num_computed_tokens, header.num_tokens, header.num_pages, header.extra,
                   header.skip_pages, header.page_hashes)
    if got != want:
        return f"request metadata digest {got!r} does not match (corrupted in transit)"
    return None
