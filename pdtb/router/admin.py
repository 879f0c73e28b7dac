"""Operator endpoints: move a decoding request, drain a node, list migrations.

    POST /admin/migrate {"request_id": ID, "to": NODE_ID[, "inject": FAULT]}
         202 {"migration_id", "request_id", "source", "target"}; 409 when the request is not
         decoding on a decode node, is moving already, or the target cannot take it; 400 on a
         malformed body. `inject` makes one step of the protocol fail on purpose
         (pdtb/nodes/protocol.py MIGRATE_INJECT: fault-injection tests and chaos runs), only on a router
         started with --allow-fault-injection (403 otherwise). With several routers behind one
         port, a router that does not hold the request asks the others (pdtb/router/peers.py)
         and answers with the one that does.
    POST /admin/drain {"node": NODE_ID}
         202 {"node", "draining": true}: the node refuses new work from now on; the router moves
         a decode node's requests to the others (pdtb/router/rebalance.py, in every --rebalance mode)
    POST /admin/faults {"node": NODE_ID, "faults": {FIELD: NUMBER, ...}, "for_s": S}
         202 {"node", "faults", "for_s"}: the node injects these faults (kv_transport FaultConfig
         fields: drop_prob, delay_prob, delay_s, ...) into its KV sends for S seconds, then goes
         back to those it was started with (pdtb chaos); only on a router started with
         --allow-fault-injection (403 otherwise); 409 for an unknown or unreachable node
    POST /admin/nodes {"role": ROLE, "address": tcp://HOST:PORT[, "replaces": NODE_ID or ADDRESS]}
         200 {"role", "address"}: the router connects to the node and sends it work once it answers
         pings (the supervisors add the replacements they start); with "replaces", the node it
         replaces is retired: /health no longer waits for it (409 unless the router has judged
         it lost, or it never answered this router); 409 when a node at that address is listed already; 400 on a malformed body
    GET  /cluster/migrations
         {"in_flight": [...], "done": [...], "counts": {...}}: each with source, target, reason,
         pages, precopy and final bytes and seconds, and the downtime the request saw

Request ids are the router's (those `/cluster` lists per decode node in `extra.requests`).
Behind the API key when one is set (app.auth_middleware).
"""
from __future__ import annotations

import json
import time

from aiohttp import web

from pdtb.nodes.protocol import MIGRATE_INJECT as INJECT
from pdtb.router.completions import STATE
from pdtb.router.openai_api import ApiError, bad_request
from pdtb.router.peers import PEERS, is_forwarded


async def _body(request: web.Request, *keys: str) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for k in keys:
        if not isinstance(body.get(k), str) or not body[k]:
            raise bad_request(f"{k!r} must be a non-empty string", k)
    return body


def _conflict(message: str) -> ApiError:
    return ApiError(409, message, "invalid_request_error", "conflict")


async def handle_migrate(request: web.Request) -> web.Response:
    body = await _body(request, "request_id", "to")
    inject = body.get("inject", "")
    if inject not in ("", *INJECT):
        raise bad_request(f"'inject' must be one of {', '.join(INJECT)}", "inject")
    if inject and not request.app[STATE].config.allow_fault_injection:
        raise ApiError(403, "fault injection is off (pdtb router --allow-fault-injection)", "invalid_request_error",
                       "forbidden", "inject")
    registry, peers = request.app[STATE].registry, request.app[PEERS]
    if not registry.owns(body["request_id"]):
        if is_forwarded(request):  # the asking router tries the next one
            raise ApiError(404, f"request {body['request_id']!r} is not this router's", "invalid_request_error",
                           "not_found", "request_id")
        answer = await peers.forward(request, body)  # another router dispatched it
        if answer is not None:
            return answer
    try:
        m = registry.migrate(body["request_id"], body["to"], "admin", inject)
    except ValueError as e:
        raise _conflict(str(e)) from None
    return web.json_response({"migration_id": m.migration_id, "request_id": m.request_id, "source": m.source,
                              "target": m.target}, status=202)


async def handle_drain(request: web.Request) -> web.Response:
    body = await _body(request, "node")
    try:
        node = request.app[STATE].registry.drain(body["node"])
    except ValueError as e:
        raise _conflict(str(e)) from None
    return web.json_response({"node": node.node_id, "draining": True}, status=202)


async def handle_faults(request: web.Request) -> web.Response:
    from kv_transport.config import fault_config_from

    body = await _body(request, "node")
    if not request.app[STATE].config.allow_fault_injection:
        raise ApiError(403, "fault injection is off (pdtb router --allow-fault-injection)", "invalid_request_error",
                       "forbidden", "faults")
    faults, for_s = body.get("faults"), body.get("for_s")
    if not isinstance(faults, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in faults.values()):
        raise bad_request("'faults' must be an object of numbers", "faults")
    if isinstance(for_s, bool) or not isinstance(for_s, (int, float)) or not 0 < for_s <= 3600:
        raise bad_request("'for_s' must be a number of seconds in (0, 3600]", "for_s")
    try:
        fault_config_from(faults)
    except ValueError as e:
        raise bad_request(str(e), "faults") from None
    try:
        node = request.app[STATE].registry.set_faults(body["node"], faults, for_s)
    except ValueError as e:
        raise _conflict(str(e)) from None
    return web.json_response({"node": node.node_id, "faults": faults, "for_s": for_s}, status=202)


async def handle_add_node(request: web.Request) -> web.Response:
    from pdtb.router.config import NodeSpec

    body = await _body(request, "role", "address")
    try:
        spec = NodeSpec(body["role"], body["address"])
    except ValueError as e:
        raise bad_request(str(e), "role" if "role" in str(e) else "address") from None
    replaces = body.get("replaces")
    if replaces is not None and (not isinstance(replaces, str) or not replaces):
        raise bad_request("'replaces' must be a non-empty string", "replaces")
    registry = request.app[STATE].registry
    try:
        if replaces is not None:
            registry.retire(replaces)
        registry.add(spec)
    except ValueError as e:
        raise _conflict(str(e)) from None
    return web.json_response({"role": spec.role, "address": spec.address})


async def handle_migrations(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].registry.book.summary(time.monotonic()))
