"""The bound beside the router in `pdtb bench router`: a minimal aiohttp SSE relay.

What any Python front door over these nodes must do, and nothing more: read the JSON body, send
a GenerateRequest to a node (round robin) over the same zmq protocol, and relay each TokenEvent
as one SSE chunk. No tokenization (the prompt's length stands in for its ids), no
detokenization (a token is the text " x"), no validation, metrics, stop strings or recompute.

    python -m pdtb.microbench.sse_relay --node tcp://127.0.0.1:P [--node ...]
    (prints `relay listening on http://127.0.0.1:PORT`)
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import uuid

import zmq
import zmq.asyncio
from aiohttp import web

from pdtb.nodes.protocol import GenerateRequest, Params, ProtocolError, TokenBatch, decode_message, encode_message


class Relay:
    def __init__(self, addresses: list[str]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.identity = f"relay-{os.getpid()}"
        self.socks = []
        for addr in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, self.identity.encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            self.socks.append(s)
        self.next_sock = itertools.cycle(self.socks)
        self.queues: dict[str, asyncio.Queue] = {}

    async def reader(self, sock) -> None:
        while True:
            try:
                msg = decode_message(await sock.recv())
            except ProtocolError:
                continue  # (the scripted nodes send none; a bad frame is dropped, as the router drops it)
            if isinstance(msg, TokenBatch):
                for ev in msg.events:
                    q = self.queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        rid = f"cmpl-{uuid.uuid4().hex}"
        q = self.queues[rid] = asyncio.Queue()
        prompt = body.get("prompt") or ""
        req = GenerateRequest(rid, [len(prompt) + 1], Params(int(body.get("max_tokens", 16))), router_id=self.identity)
        try:
            await next(self.next_sock).send(encode_message(req))
            if not body.get("stream"):
                n = 0
                while True:
                    ev = await q.get()
                    n += len(ev.token_ids)
                    if ev.finished:
                        return web.json_response({"id": rid, "choices": [{"index": 0, "text": " x" * n}],
                                                  "usage": {"completion_tokens": n}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                ev = await q.get()
                chunk = {"id": rid, "choices": [{"index": 0, "text": " x" * len(ev.token_ids)}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if ev.finished:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            del self.queues[rid]


async def serve(addresses: list[str], host: str, port: int) -> None:
    relay = Relay(addresses)
    readers = [asyncio.create_task(relay.reader(s)) for s in relay.socks]
    app = web.Application()
    app.router.add_post("/v1/completions", relay.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"relay listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for t in readers:
        t.cancel()
    await runner.cleanup()
    for s in relay.socks:
        s.close(linger=0)
    relay.ctx.term()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.microbench.sse_relay", description=__doc__.split("\n")[0])
    ap.add_argument("--node", action="append", required=True, help="a scripted node's control address (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    import uvloop

    uvloop.run(serve(a.node, a.host, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
