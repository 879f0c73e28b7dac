"""What a prefill node believes each decode node caches (the pages a hand-off leaves out; a
`cache_miss` clears it).

What a prefill node believes each decode node holds in its prefix cache: the page hashes
of the hand-offs that landed there, most recent last, bounded per node.

The belief only decides which leading pages a hand-off leaves out. A decode node that no
longer caches one of them refuses the header with `cache_miss` and every page is sent again,
so a wrong belief costs one round trip, never a wrong token.
"""
from __future__ import annotations

from collections import OrderedDict

MAX_PAGES_PER_PEER = 1 << 16


class PeerPages:
    def __init__(self, limit: int = MAX_PAGES_PER_PEER) -> None:
        self.limit = limit
        self._by_peer: dict[str, OrderedDict[int, None]] = {}

    def leading(self, peer: str, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, `peer` is believed to hold."""
        held = self._by_peer.get(peer)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def add(self, peer: str, hashes: list[int]) -> None:
        held = self._by_peer.setdefault(peer, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.limit:
            held.popitem(last=False)

    def forget(self, peer: str) -> None:
        """`peer` lacked pages it was believed to hold (evicted, restarted, or it caches
        nothing): believe nothing of it until hand-offs land there again."""
        self._by_peer.pop(peer, None)
