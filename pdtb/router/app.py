"""The router's aiohttp application.

    POST /v1/completions   OpenAI completions, JSON or SSE (pdtb/router/completions.py)
    POST /v1/chat/completions   the same for conversations, by the model's chat template (pdtb/router/chat_api.py)
    GET  /v1/models        the served model, with max_model_len and vocab_size
    GET  /health           200 when every configured node answered recently, else 503 naming the others
    GET  /metrics          Prometheus text (router-side TTFT/ITL/E2E, requests by status, tokens)
    GET  /cluster          one JSON entry per node: role, id, address, pages, running/waiting, healthy,
                           migrations in flight from or to it, and what the node reports in `extra`
                           (among it `policy_info`: the policy it runs, {name, source, settings})
    GET  /cluster/migrations   live migrations in flight and the last ones done, with bytes and downtime
    GET  /cluster/latency  each tenant's TTFT and ITL at this router process over the last minute
                           (n, mean, p50, p90, p99 seconds; pdtb/router/tenant_latency.py)
    POST /admin/migrate    {"request_id", "to"}: move a decoding request to decode node "to" (pdtb/router/admin.py)
    POST /admin/drain      {"node"}: the node takes no new work; a decode node's requests move away
    POST /admin/nodes      {"role", "address"}: a node joins (a replacement a supervisor started)
    GET  /router           the process that answered: router_id, index among the routers behind the
                           port, requests it dispatched, its private admin address (pdtb/router/peers.py)

Every response carries X-Pdtb-Router: the router_id of the process that answered it.

With an API key configured, /v1/* and /admin/* require `Authorization: Bearer <key>`; /health,
/metrics and /cluster* stay open. Every error is OpenAI-shaped: {"error": {"message", "type", "code", "param"}}.
"""
from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web

from pdtb.router.admin import handle_add_node, handle_drain, handle_faults, handle_migrate, handle_migrations
from pdtb.router.cluster_metrics import ClusterCollector
from pdtb.router.completions import STATE, RouterState, handle_chat_completion, handle_completion
from pdtb.router.config import RouterConfig, ServedModel
from pdtb.router.metrics import RouterMetrics
from pdtb.router.peers import PEERS, Peers, handle_router, stamp_router
from pdtb.router.registry import NodeRegistry
from pdtb.router.openai_api import ApiError
from pdtb.router.tenant_latency import HORIZON_S

log = logging.getLogger("pdtb.router")


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn ApiError, aiohttp HTTP errors (404, 405, 413) and crashes into OpenAI-shaped errors."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return _error_response(ApiError(e.status, e.reason if e.status != 413 else e.text or e.reason,
                                        "invalid_request_error", code))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(ApiError(500, "internal server error", "server_error"))


def auth_middleware(api_key: str):
    """Require `Authorization: Bearer <api_key>` on /v1/* and /admin/*."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(("/v1/", "/admin/")):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error_response(ApiError(401, "Incorrect or missing API key.", "invalid_request_error",
                                                "invalid_api_key"))
        return await handler(request)

    return check


async def handle_models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    model = request.app[STATE].model
    return web.json_response({"object": "list", "data": [{
        "id": model.name, "object": "model", "created": int(request.app[STATE].started), "owned_by": "pd-testbed",
        "max_model_len": model.max_model_len, "vocab_size": model.vocab_size}]})


async def handle_health(request: web.Request) -> web.Response:
    """GET /health: 200 only when every configured node answered within the health timeout."""
    state = request.app[STATE]
    if state.shutting_down:
        return web.json_response({"status": "shutting down"}, status=503)
    registry = state.registry
    missing = [{"role": n.spec.role, "address": n.spec.address} for n in registry.nodes
               if not n.retired and not registry.is_healthy(n)]
    if missing:
        return web.json_response({"status": "unhealthy", "missing": missing}, status=503)
    return web.json_response({"status": "ok", "nodes": len(registry.nodes)})


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics."""
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def handle_cluster(request: web.Request) -> web.Response:
    """GET /cluster: the latest NodeStats of every node (zeros before the first answer). A node
    not healthy now is `stale`: its figures are those of its last answer, `seconds_since_seen`
    ago, not what it holds now (a dead node holds nothing)."""
    registry = request.app[STATE].registry
    now = time.monotonic()
    out = []
    for n in registry.nodes:
        s = n.stats
        healthy = registry.is_healthy(n, now)
        out.append({
            "role": n.spec.role, "id": n.node_id, "address": n.spec.address,
            "pages_total": s.pages_total if s else 0, "pages_free": s.pages_free if s else 0,
            "host_pages_total": s.host_pages_total if s else 0, "host_pages_free": s.host_pages_free if s else 0,
            "running": s.running if s else 0, "waiting": s.waiting if s else 0,
            "queued_tokens": s.queued_tokens if s else 0, "kv_addr": s.kv_addr if s else "",
            "metrics_addr": s.metrics_addr if s else "",
            "draining": s.draining if s else False, "healthy": healthy, "stale": not healthy, "retired": n.retired,
            "seconds_since_seen": None if n.last_seen is None else round(now - n.last_seen, 3),
            "prefix_ns": s.prefix_ns if s else "", "prefix_cached_hashes": len(s.prefix_summary) if s else 0,
            "prefix_query_tokens": s.prefix_query_tokens if s else 0,
            "prefix_hit_tokens": s.prefix_hit_tokens if s else 0,
            "migrations_in_flight": [m.migration_id for m in registry.book.in_flight.values()
                                     if n.node_id in (m.source, m.target)],
            "extra": s.extra if s else {}})
    return web.json_response(out)


async def handle_latency(request: web.Request) -> web.Response:
    """GET /cluster/latency: {"window_s", "tenants": {tenant: {"ttft": figures, "itl": figures}}}."""
    tenants = request.app[STATE].metrics.tenants.summary(time.monotonic())
    return web.json_response({"window_s": HORIZON_S, "tenants": tenants})


def node_reports(registry: NodeRegistry) -> list[tuple[str, str, dict]]:
    """(role, node id, NodeStats.extra) of each healthy node that has reported."""
    now = time.monotonic()
    return [(n.spec.role, n.node_id, n.stats.extra) for n in registry.nodes
            if n.stats is not None and not n.retired and registry.is_healthy(n, now)]


def make_registry(config: RouterConfig, on_fatal=None) -> NodeRegistry:
    """The node registry `config` describes (this process's rebalance mode: RouterConfig.own_rebalance)."""
    return NodeRegistry(config.nodes, ping_interval=config.ping_interval, health_timeout=config.health_timeout,
                        hang_timeout=config.hang_timeout, default_page_size=config.default_page_size,
                        route=config.route, rebalance=config.own_rebalance, on_fatal=on_fatal,
                        curve_dir=config.curve_dir, num_routers=config.fleet.size)


def build_app(config: RouterConfig, model: ServedModel, registry: NodeRegistry | None = None) -> web.Application:
    """The router application. The registry is started with the app and closed after the last
    in-flight request ended (aiohttp's cleanup runs after the handlers' shutdown grace)."""
    registry = registry or make_registry(config)
    middlewares = [error_middleware] + ([auth_middleware(config.api_key)] if config.api_key else [])
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[STATE] = RouterState(config, model, registry, RouterMetrics(config.metrics_dir))
    app[STATE].metrics.attach_cluster(ClusterCollector(lambda: node_reports(registry)))
    app[PEERS] = Peers(config.fleet, registry.router_id)
    app.on_response_prepare.append(stamp_router)

    async def registry_ctx(app: web.Application):
        await registry.start()
        yield
        await registry.close()

    app.cleanup_ctx.append(registry_ctx)
    app.router.add_post("/v1/completions", handle_completion)
    app.router.add_post("/v1/chat/completions", handle_chat_completion)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/cluster", handle_cluster)
    app.router.add_get("/cluster/migrations", handle_migrations)
    app.router.add_get("/cluster/latency", handle_latency)
    app.router.add_post("/admin/migrate", handle_migrate)
    app.router.add_post("/admin/drain", handle_drain)
    app.router.add_post("/admin/nodes", handle_add_node)
    app.router.add_post("/admin/faults", handle_faults)
    app.router.add_get("/router", handle_router)
    registry.book.on_end = app[STATE].metrics.observe_migration
    registry.follower.on_downtime = app[STATE].metrics.migration_downtime.observe
    return app
