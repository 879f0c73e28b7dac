"""Several router processes behind one port: each one's private admin address, and the admin
requests one router passes to the others.

    clients ──▶ shared port (SO_REUSEPORT: the kernel gives each connection to one router)
                  ├─ router 0 ── private admin address on loopback, ephemeral port ─▶ RUN_DIR/router-0.admin
                  └─ router 1 ── ...                                               ─▶ RUN_DIR/router-1.admin

Each router serves the same application on both addresses. A request reaches one router over
the shared port; what only another router can do is forwarded to the others' private addresses:

    POST /admin/migrate   a request is followed by the router that dispatched it (its stream, its
                          node connections): a router that does not hold it asks the others (each
                          answers 404 for a request not its own) and answers with the one that
                          holds it (409 when none does)
    POST /admin/nodes     per process: a supervisor adds a replacement to each router at its
                          private address (pdtb/local_cluster/supervise.py, pdtb/ray_cluster/actors.py)

A forwarded request carries FORWARDED_HEADER and is never forwarded again. A drain needs no
forwarding: the node itself reports `draining` to every router, and each moves its own requests.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from pdtb.router.config import Fleet

log = logging.getLogger("pdtb.router.peers")
FORWARDED_HEADER = "X-Pdtb-Forwarded"  # set on a request one router passes to another
ROUTER_HEADER = "X-Pdtb-Router"  # on every response: the router_id of the process that answered
FORWARD_TIMEOUT_S = 10.0  # one peer's answer to a forwarded admin request


@dataclass
class Peers:
    """This router's view of the others behind its port (module docstring)."""

    fleet: Fleet
    router_id: str  # this process's DEALER identity
    admin_url: str = ""  # this router's private admin address, once bound
    forwarded: dict[str, int] = field(default_factory=dict)  # path -> admin requests answered by another router

    def publish(self, url: str) -> None:
        """Write this router's private admin URL where the others look (atomically: a reader
        never sees half a URL)."""
        self.admin_url = url
        path = self.fleet.admin_file
        if path is None:
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(url + "\n")
        os.replace(tmp, path)

    def unpublish(self) -> None:
        """Remove the admin file if it still names this process's address (a restarted router
        may have written its own since)."""
        path = self.fleet.admin_file
        try:
            if path is not None and Path(path).read_text().strip() == self.admin_url:
                Path(path).unlink()
        except OSError:
            pass

    def others(self) -> list[str]:
        """The other routers' private admin URLs, as their files say now (a restarted router
        rewrites its own)."""
        if self.fleet.peer_dir is None:
            return []
        own = self.fleet.admin_file
        urls = []
        for p in sorted(Path(self.fleet.peer_dir).glob("router-*.admin")):
            try:
                url = p.read_text().strip()
            except OSError:
                continue
            if str(p) != own and url and url != self.admin_url:
                urls.append(url)
        return urls

    async def forward(self, request: web.Request, body: dict) -> web.Response | None:
        """POST `body` to the same path at each other router until one answers other than 404
        (404: not that router's either); that answer, or None when none did."""
        headers = {FORWARDED_HEADER: self.router_id, "Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        timeout = aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for url in self.others():
                answer = await _post(session, f"{url}{request.path}", body, headers)
                if answer is not None and answer[0] != 404:
                    self.forwarded[request.path] = self.forwarded.get(request.path, 0) + 1
                    return web.json_response(answer[1], status=answer[0])
        return None


def is_forwarded(request: web.Request) -> bool:
    """Whether another router passed this request on (it is answered here, never passed again)."""
    return FORWARDED_HEADER in request.headers


async def _post(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> tuple[int, dict] | None:
    """(status, JSON body) of one peer's answer; None when it could not be reached (a router
    restarting, a stale admin file)."""
    try:
        async with session.post(url, data=json.dumps(body), headers=headers) as r:
            return r.status, await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, json.JSONDecodeError) as e:
        log.info("peer %s did not answer: %r", url, e)
        return None


PEERS = web.AppKey("peers", Peers)


async def handle_router(request: web.Request) -> web.Response:
    """GET /router: which process answered, and what it alone holds."""
    from pdtb.router.completions import STATE

    state, peers = request.app[STATE], request.app[PEERS]
    registry = state.registry
    return web.json_response({
        "router_id": registry.router_id, "index": peers.fleet.index, "routers": peers.fleet.size,
        "pid": os.getpid(), "admin_url": peers.admin_url, "peers": peers.others(),
        "requests_submitted": registry.num_submitted, "open_requests": registry.num_open_requests,
        "forwarded": dict(peers.forwarded), "rebalance": registry.rebalancer.mode})


async def stamp_router(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response names the router process that answered it."""
    response.headers[ROUTER_HEADER] = request.app[PEERS].router_id
