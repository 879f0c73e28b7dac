"""Chained hashes of full KV pages: the identity of a page in every prefix cache.

A page's hash covers its tokens, the hash of every page before it and a namespace (the
model and KV dtype), so two requests share a page only when everything before and in it is
the same and it was computed by the same model. Only full pages are hashed: a partial page is
still being written and is never shared.

Hashes are 64-bit unsigned integers (blake2b, 8-byte digest) so they travel as plain msgpack
integers in hand-off headers and node stats. Two different pages collide with probability
about n^2 / 2^65 for n cached pages (1e-8 at a million pages).
"""
from __future__ import annotations

import hashlib

import numpy as np


def namespace_root(namespace: str) -> int:
    """The parent hash of a sequence's first page under `namespace`."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def page_hashes(token_ids, page_size: int, namespace: str, start_page: int = 0,
                parents: list[int] | None = None) -> list[int]:
    """Hashes of the full pages of `token_ids` (a partial last page is left out).

    `parents`: hashes already known for pages [0, start_page) (extends them without rehashing;
    must hold at least `start_page` entries). Returns the hashes of pages [0, n_full)."""
    if page_size < 1:
        raise ValueError("page_size must be positive")
    n_full = len(token_ids) // page_size
    out = list(parents[:start_page]) if parents is not None else []
    if len(out) != start_page:
        raise ValueError("parents must cover start_page pages")
    if n_full <= start_page:
        return out[:n_full]
    parent = out[-1] if out else namespace_root(namespace)
    arr = np.asarray(token_ids[start_page * page_size:n_full * page_size], dtype=np.int64)
    raw = arr.tobytes()
    step = page_size * 8
    for i in range(n_full - start_page):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(raw[i * step:(i + 1) * step])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
