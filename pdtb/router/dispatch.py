"""Placing a request (load, cached prefix or D²LPM credit; fallback decode nodes), sending it, its
events to the caller, abort and release.

Dispatch: where a request goes (placement by load, cached prefix or D2LPM credit, fallbacks) and
sending it, its events to the caller, abort and release. Part of NodeRegistry (registry.py)."""
from __future__ import annotations

import asyncio
import logging
import math
import time

import zmq

from pdtb.nodes.handoff import HandoffState
from pdtb.nodes.protocol import AbortRequest, GenerateRequest, Target, TokenEvent, encode_message
from pdtb.router.cache_route import CacheChoice, candidates_of, pick_by_cache, score_all
from pdtb.router.fair_route import RouteCandidate
from pdtb.router.node_state import NodeState, Placement, RequestFailed, RequestHandle, load_order, pick_most_free, pick_prefill

log = logging.getLogger("pdtb.router.registry")
FALLBACKS = 3  # other decode nodes a disaggregated request may be handed to


class Dispatch:
    """Placing and sending requests, and what a request's caller waits on (a NodeRegistry part).

    Uses the registry's nodes, route, d2lpm and default_page_size, its `_available` (health) and
    `_requests`; runs on the router's loop, never blocks (a full node queue is a refusal)."""

    def _send(self, node: NodeState, msg) -> bool:
        """Queue one message without blocking; False when the node is unreachable or its queue full."""
        if node.socket is None:
            return False
        try:
            node.socket.send(encode_message(msg), zmq.NOBLOCK).result()  # completed future, see _reader
            return True
        except zmq.Again:
            return False

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Choose nodes, fill the routing fields of `req`, send it; a node that cannot take it
        (its queue is full: it stopped reading) is skipped and another tried. Raises
        RequestFailed(503) when none can."""
        tried: set[int] = set()
        while True:
            where = self._place(len(req.prompt_token_ids), len(req.prompt_token_ids) + req.params.max_tokens,
                                frozenset(tried), req.prompt_token_ids, req.tenant)
            entry, decode = where.entry, where.decode
            req.router_id = self.router_id
            req.decode_node, req.decode_kv_addr = (decode.node_id, decode.stats.kv_addr) if decode else ("", "")
            others = self._fallbacks(decode, len(req.prompt_token_ids) + req.params.max_tokens) if decode else []
            req.fallbacks = [Target(n.node_id, n.stats.kv_addr) for n in others]
            # the decode nodes that may come to hold it: the chosen one and its fallbacks (none without fallbacks)
            handle = RequestHandle(req.request_id, entry, decode, tenant=req.tenant,
                                   handoff=HandoffState.BOUND if decode is not None else None,
                                   fallbacks=[decode.node_id, *(t.node_id for t in req.fallbacks)] if others else [])
            if self._send(entry, req):
                if where.cached is not None:  # it will hold these pages once prefilled: the next ones follow
                    entry.prefix_view.insert(where.cached.hashes, time.monotonic())
                    handle.prefix_overlap_tokens = where.cached.overlap_tokens
                break
            entry.refused_at = time.monotonic()
            tried.add(id(entry))
            log.warning("%s node %s is not accepting requests; trying another", entry.spec.role, entry.node_id)
        entry.pending_tokens[req.request_id] = len(req.prompt_token_ids)
        pages_node = decode or entry
        pages_node.pending_pages[req.request_id] = self._pages_for(pages_node, len(req.prompt_token_ids) + 1)
        self._requests[req.request_id] = handle
        self.num_submitted += 1
        return handle

    def largest_pool_tokens(self) -> int | None:
        """Tokens the largest pool of an available decode or colocated node holds (prompt and
        output together: what `_place` lets a request reach); None when none has answered yet."""
        sizes = [n.stats.pages_total * self._page_size(n) for role in ("decode", "colocated")
                 for n in self._available(role) if n.stats is not None]
        return max(sizes, default=None)

    def _fallbacks(self, chosen: NodeState, peak_tokens: int) -> list[NodeState]:
        """Up to FALLBACKS other available decode nodes that could hold the request, most free first."""
        others = [n for n in self._available("decode") if n is not chosen and n.stats.kv_addr
                  and self._pages_for(n, peak_tokens) <= n.stats.pages_total]
        return sorted(others, key=lambda n: -n.free_pages_estimate())[:FALLBACKS]

    def _page_size(self, node: NodeState) -> int:
        return node.stats.page_size or self.default_page_size

    def _pages_for(self, node: NodeState, tokens: int) -> int:
        return math.ceil(tokens / self._page_size(node))

    def _pick_entry(self, nodes: list[NodeState], prompt_ids: list[int] | None, tenant: str,
                    by_load) -> tuple[NodeState | None, CacheChoice | None]:
        """The prefill or colocated node of a request, by the route (`by_load`: the load rule)."""
        if prompt_ids is None or self.route == "load":
            return by_load(nodes), None
        if self.route == "cache":
            return pick_by_cache(nodes, prompt_ids)
        cands = candidates_of(nodes)
        scores = score_all(cands, prompt_ids)
        i = self.d2lpm.choose(tenant, len(prompt_ids), [RouteCandidate(n.node_id, sc.overlap_tokens, load_order(n))
                                                         for n, sc in zip(nodes, scores)])
        return (None, None) if i is None else (nodes[i], scores[i])

    def _place(self, prompt_tokens: int, peak_tokens: int, exclude: frozenset = frozenset(),
               prompt_ids: list[int] | None = None, tenant: str = "") -> Placement:
        """Entry node and decode node (None: colocated). A request that no available pool could ever hold
        (prefill: its prompt; decode or colocated: prompt + max_tokens) is a 400, not a node's
        failure after the fact."""
        fits = {role: [n for n in self._available(role, exclude) if self._pages_for(n, need) <= n.stats.pages_total]
                for role, need in (("prefill", prompt_tokens), ("decode", peak_tokens), ("colocated", peak_tokens))}
        decode = pick_most_free(fits["decode"])
        if decode is not None and fits["prefill"]:
            prefill, cached = self._pick_entry(fits["prefill"], prompt_ids, tenant, pick_prefill)
            return Placement(prefill, decode, cached)
        prefill = pick_prefill(fits["prefill"])  # (for the refusal below: no entry is charged)
        colocated, cached = self._pick_entry(fits["colocated"], prompt_ids, tenant, pick_most_free)
        if colocated:
            return Placement(colocated, None, cached)
        too_small = [(role, n) for role in ("prefill", "decode", "colocated") for n in self._available(role, exclude)
                     if n not in fits[role]]
        if too_small:
            role, n = max(too_small, key=lambda rn: rn[1].stats.pages_total)
            need = self._pages_for(n, prompt_tokens if role == "prefill" else peak_tokens)
            what = "its prompt" if role == "prefill" else "prompt + max_tokens"
            raise RequestFailed(400, f"request needs up to {need} KV pages for {what}; the largest {role} "
                                     f"node's pool has {n.stats.pages_total}",
                                param="prompt" if role == "prefill" else "max_tokens")
        missing = [r for r, n in (("prefill", prefill), ("decode", decode)) if n is None]
        roles = {n.spec.role for n in self.nodes}
        what = "colocated" if "colocated" in roles and not {"prefill", "decode"} <= roles else " or ".join(missing)
        raise RequestFailed(503, f"no healthy {what} node available")

    async def next_event(self, handle: RequestHandle, timeout: float, merge: bool = True) -> TokenEvent:
        """The request's next event, with the plain events queued behind it when `merge`
        (merge_queued). Raises RequestFailed when it failed or nothing came in `timeout`."""
        try:
            item = await handle.queue.get(timeout)
        except asyncio.TimeoutError:
            raise RequestFailed(503, f"no response from the nodes for {timeout:g} s") from None
        if isinstance(item, RequestFailed):
            raise item
        return merge_queued(item, handle.queue) if merge else item

    def abort(self, handle: RequestHandle, reason: str, final: bool = False) -> None:
        """Tell every node involved to drop the request (best effort, never blocks). With
        `final`, the node holding it first sends a last event with its timeline."""
        for node in (handle.entry, handle.decode):
            if node is not None:
                self._send(node, AbortRequest(handle.request_id, reason, final))
        m = handle.migration
        if m is not None:  # the other end of a move under way lets go too
            other = self.decode_node(m.target if handle.decode.node_id == m.source else m.source)
            if other is not None:
                self._send(other, AbortRequest(handle.request_id, reason))
        if not handle.handed_off and handle.fallbacks:  # a move may be under way: the new holder drops it too
            for node in self.nodes:
                if node.spec.role == "decode" and node is not handle.decode and node.node_id in handle.fallbacks:
                    self._send(node, AbortRequest(handle.request_id, reason))

    def release(self, handle: RequestHandle) -> None:
        """Forget the request: later events for it are dropped."""
        if self._requests.pop(handle.request_id, None) is not None and self.route == "d2lpm":
            self.d2lpm.charge_output(handle.tenant, handle.entry.node_id, handle.tokens)
        for node in (handle.entry, handle.decode):
            if node is not None:
                node.pending_pages.pop(handle.request_id, None)
                node.pending_tokens.pop(handle.request_id, None)

    @property
    def num_open_requests(self) -> int:
        return len(self._requests)

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is one of this router's open requests (another router behind
        the same port answers for the rest)."""
        return request_id in self._requests


def plain(ev) -> bool:
    """A TokenEvent of tokens alone: no error, no word to retry elsewhere."""
    return isinstance(ev, TokenEvent) and not ev.error and not ev.retry and ev.finish_reason != "error"


def merge_queued(ev: TokenEvent, queue) -> TokenEvent:
    """`ev` with the plain events already queued behind it, as one: a handler that fell behind
    its node sends one chunk for them instead of one each (vLLM's output collector merges the
    same way). The merged event ends where the last one taken ends; its `cached_tokens` is the
    largest taken (only the event with a request's first output token sets one)."""
    if ev.finished or not plain(ev) or queue.empty():
        return ev
    ids, cached = list(ev.token_ids), ev.cached_tokens
    while not queue.empty() and plain(queue.peek()):
        nxt = queue.get_nowait()
        ids += nxt.token_ids
        cached = max(cached, nxt.cached_tokens)
        if nxt.finished:
            return TokenEvent(ev.request_id, ids, True, nxt.finish_reason, timing=nxt.timing, cached_tokens=cached)
    return TokenEvent(ev.request_id, ids, cached_tokens=cached)
