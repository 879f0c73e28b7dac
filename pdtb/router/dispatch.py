"""`Dispatcher`: the open requests: each one placed (pdtb/router/placement.py) and sent, its
events to the caller, abort and release."""
from __future__ import annotations

import asyncio
import logging
import time

from pdtb.nodes.handoff import HandoffState
from pdtb.nodes.protocol import AbortRequest, GenerateRequest, Target, TokenEvent
from pdtb.router.fair_route import D2lpmRouter
from pdtb.router.node_set import NodeSet
from pdtb.router.node_state import RequestFailed, RequestHandle
from pdtb.router.placement import FALLBACKS, Ask, pages_for, place  # noqa: F401 (FALLBACKS: the simulator's router)

log = logging.getLogger("pdtb.router.registry")


class Dispatcher:
    """Places and sends requests and keeps the open ones (`requests`, by id), what each caller
    waits on. Runs on the router's loop and never blocks: a full node queue is a refusal."""

    def __init__(self, node_set: NodeSet, *, route: str = "load", d2lpm: D2lpmRouter | None = None) -> None:
        self.node_set = node_set
        self.route = route
        self.d2lpm = d2lpm if d2lpm is not None else D2lpmRouter()  # route "d2lpm": this process's credit
        self.requests: dict[str, RequestHandle] = {}
        self.num_submitted = 0  # requests this process sent to a node (GET /router)

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Choose nodes, fill the routing fields of `req`, send it; a node that cannot take it
        (its queue is full: it stopped reading) is skipped and another tried. Raises
        RequestFailed(503) when none can."""
        ask = Ask(req.prompt_token_ids, req.params.max_tokens, req.tenant)
        tried: set[int] = set()
        while True:
            snapshot = self.node_set.snapshot(frozenset(tried))
            where = place(snapshot, ask, self.route, self.d2lpm)
            self.d2lpm.credit.update(where.credit)  # charged at each choice, sent or not
            nodes = self.node_set.nodes
            entry, decode = nodes[where.entry], None if where.decode is None else nodes[where.decode]
            req.router_id = self.node_set.router_id
            req.decode_node, req.decode_kv_addr = (decode.node_id, decode.stats.kv_addr) if decode else ("", "")
            req.fallbacks = [Target(snapshot[i].node_id, snapshot[i].kv_addr) for i in where.fallbacks]
            # the decode nodes that may come to hold it: the chosen one and its fallbacks (none without fallbacks)
            handle = RequestHandle(req.request_id, entry, decode, tenant=req.tenant,
                                   handoff=HandoffState.BOUND if decode is not None else None,
                                   fallbacks=[decode.node_id, *(t.node_id for t in req.fallbacks)]
                                   if where.fallbacks else [])
            if self.node_set.send(entry, req):
                if where.cached is not None:  # it will hold these pages once prefilled: the next ones follow
                    entry.prefix_view.insert(where.cached.hashes, time.monotonic())
                    handle.prefix_overlap_tokens = where.cached.overlap_tokens
                break
            entry.refused_at = time.monotonic()
            tried.add(id(entry))
            log.warning("%s node %s is not accepting requests; trying another", entry.spec.role, entry.node_id)
        entry.pending_tokens[req.request_id] = ask.prompt_tokens
        pages_at = where.entry if where.decode is None else where.decode
        nodes[pages_at].pending_pages[req.request_id] = pages_for(ask.prompt_tokens + 1, snapshot[pages_at].page_size)
        self.requests[req.request_id] = handle
        self.num_submitted += 1
        return handle

    def largest_pool_tokens(self) -> int | None:
        """Tokens the largest pool of an available decode or colocated node holds (prompt and
        output together: what placement lets a request reach); None when none has answered yet."""
        return max((v.pages_total * v.page_size for v in self.node_set.snapshot()
                    if v.available and v.role in ("decode", "colocated")), default=None)

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
        send = self.node_set.send
        for node in (handle.entry, handle.decode):
            if node is not None:
                send(node, AbortRequest(handle.request_id, reason, final))
        m = handle.migration
        if m is not None:  # the other end of a move under way lets go too
            other = self.node_set.by_id(m.target if handle.decode.node_id == m.source else m.source, "decode")
            if other is not None:
                send(other, AbortRequest(handle.request_id, reason))
        if not handle.handed_off and handle.fallbacks:  # a move may be under way: the new holder drops it too
            for node in self.node_set.nodes:
                if node.spec.role == "decode" and node is not handle.decode and node.node_id in handle.fallbacks:
                    send(node, AbortRequest(handle.request_id, reason))

    def release(self, handle: RequestHandle) -> None:
        """Forget the request: later events for it are dropped."""
        if self.requests.pop(handle.request_id, None) is not None and self.route == "d2lpm":
            self.d2lpm.charge_output(handle.tenant, handle.entry.node_id, handle.tokens)
        for node in (handle.entry, handle.decode):
            if node is not None:
                node.pending_pages.pop(handle.request_id, None)
                node.pending_tokens.pop(handle.request_id, None)

    def fail_all(self, reason: str) -> int:
        """Fail every open request with a 503 `reason` (its handler reports it to the client and
        aborts it at its nodes). Returns how many there were."""
        handles = list(self.requests.values())
        for handle in handles:
            handle.queue.put_nowait(RequestFailed(503, reason))
        return len(handles)


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
