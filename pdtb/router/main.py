"""`pdtb router`: the HTTP front door.

    pdtb router [--model DIR] --node prefill=tcp://H:P --node decode=tcp://H:P [--node colocated=...]
                [--host 127.0.0.1] [--port 8000] [--served-model-name NAME] [--api-key KEY]
                [--request-timeout S] [--max-streams-per-tenant N] [--tenant-tier TENANT=TIER]...
                [--route load|cache|d2lpm] [--rebalance off|pressure|fair]
                [--reuse-port --router-index I --routers N --peer-dir DIR --metrics-dir DIR]
                [--log-level LEVEL]

Loads only the tokenizer and config of the model. Prints `router listening on http://HOST:PORT`
once it accepts connections (with --peer-dir, `router admin on http://...` before it: its
private admin address on loopback, also written to DIR/router-I.admin; pdtb/router/peers.py).
SIGTERM/SIGINT: stop accepting, give in-flight requests `shutdown_timeout` seconds, abort the
rest at their nodes, exit 0.

Programmatic use (inside a running loop):
    runner, url = await start_router(config, load_served_model(model_dir))
    ...
    await runner.cleanup()
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from pdtb.router.cache_route import ROUTES
from pdtb.router.config import Fleet, NodeSpec, RouterConfig, ServedModel, load_served_model

# (the application's modules, which import prometheus_client, are imported once main() has set
# PROMETHEUS_MULTIPROC_DIR from --metrics-dir: prometheus_client reads it at its import)
if TYPE_CHECKING:
    from aiohttp import web

    from pdtb.router.registry import NodeRegistry

log = logging.getLogger("pdtb.router")


async def start_router(config: RouterConfig, model: ServedModel,
                       registry: NodeRegistry | None = None) -> tuple[web.AppRunner, str]:
    """Start serving on config.host:config.port (0: ephemeral; with config.reuse_port, beside
    the other routers on that port) and, with a peer dir, on a private admin address on
    loopback. Returns the runner (stop it with `await runner.cleanup()`) and the base URL,
    e.g. http://127.0.0.1:8000."""
    from aiohttp import web

    from pdtb.router.app import build_app
    from pdtb.router.half_close import make_runner
    from pdtb.router.peers import PEERS

    app = build_app(config, model, registry)
    runner = make_runner(app, handler_cancellation=True, shutdown_timeout=config.shutdown_timeout,
                         access_log=logging.getLogger("aiohttp.access"))
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None).start()
        url = _url(runner.addresses[0])
        if config.fleet.peer_dir is not None:
            await web.TCPSite(runner, _loopback(config.host), 0).start()
            app[PEERS].publish(_url(runner.addresses[-1]))
    except BaseException:
        await runner.cleanup()
        raise
    return runner, url


def _url(address) -> str:
    host, port = address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _loopback(host: str) -> str:
    """The loopback address of `host`'s family: a router's private admin address is for the
    processes of its own host (its peers, its supervisor)."""
    return "::1" if ":" in host else "127.0.0.1"


async def serve(config: RouterConfig, model: ServedModel) -> int:
    """Run until SIGTERM/SIGINT (exit code 0) or a failed router task (exit code 1)."""
    stop = asyncio.Event()
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        stop.set()

    from pdtb.router.app import make_registry
    from pdtb.router.completions import STATE, drain
    from pdtb.router.peers import PEERS

    registry = make_registry(config, on_fatal)
    runner, url = await start_router(config, model, registry)
    peers = runner.app[PEERS]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if peers.admin_url:
        print(f"router admin on {peers.admin_url}", flush=True)
    print(f"router listening on {url}", flush=True)
    log.info("router %s (%d of %d) serving %s over %d node(s)", registry.router_id, config.fleet.index,
             config.fleet.size, model.name, len(config.nodes))
    try:
        await stop.wait()
    finally:
        log.info("router shutting down (grace %.1f s)", config.shutdown_timeout)
        for site in list(runner.sites):
            await site.stop()  # stop accepting connections
        peers.unpublish()
        cancelled = await drain(runner.app[STATE], config.shutdown_timeout)
        if cancelled:
            log.warning("failed %d request(s) still running after the grace period (503)", cancelled)
        await asyncio.wait_for(runner.cleanup(), 10.0)
        if config.metrics_dir is not None:  # its in-flight gauge leaves the sum; its counters stay
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), config.metrics_dir)
    log.info("router stopped")
    return 1 if fatal else 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb router", description="OpenAI-compatible front door to the nodes")
    ap.add_argument("--model", help="HF checkpoint directory (tokenizer and config only); "
                                    "default: the embedded tiny model")
    ap.add_argument("--node", action="append", default=[], metavar="ROLE=ADDR",
                    help="a node's control address, role prefill|decode|colocated (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", help="the model name clients send (default: the model directory name)")
    ap.add_argument("--chat-template", help="chat template for /v1/chat/completions: a Jinja file or the template "
                                            "text (default: the checkpoint's own, if it has one)")
    ap.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*")
    ap.add_argument("--curve-dir", help="ZeroMQ CURVE keys (pdtb keys --out DIR) for the node connections")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may wait for its next token before it fails")
    ap.add_argument("--max-streams-per-tenant", type=int, default=1024)
    ap.add_argument("--tenant-tier", action="append", default=[], metavar="TENANT=TIER",
                    help="SLO tier of a tenant's requests that name none in their slo_tier field (repeatable); "
                         "nodes can key memfair's quotas by tier (--quota-by slo-tier)")
    ap.add_argument("--recompute-retries", type=int, default=2, metavar="N",
                    help="times a request whose node died is sent anew (its prompt plus the tokens already "
                         "streamed) to live nodes before it fails (default 2; 0: fail at once)")
    ap.add_argument("--node-wait", type=float, default=30.0, metavar="S",
                    help="a request to recompute when no healthy node can take it waits up to S seconds for "
                         "one (a restarted node) before it fails (default 30; 0: fail at once)")
    ap.add_argument("--route", choices=list(ROUTES), default="load",
                    help="choose the prefill (or colocated) node by load alone, by cached prompt prefix "
                         "against load (nodes with a prefix cache report what they hold), or by D2LPM: "
                         "longest cached prefix among the nodes where the client has credit left")
    ap.add_argument("--rebalance", choices=["off", "pressure", "fair"], default="off",
                    help="move decoding requests between decode nodes (live migration): 'pressure' evens out "
                         "free pages, 'fair' moves whales away from nodes where other tenants' requests wait; "
                         "every mode moves requests off a draining decode node (default off)")
    ap.add_argument("--allow-fault-injection", action="store_true",
                    help="let /admin/migrate name a fault to inject at one step of the migration (tests, chaos "
                         "runs: one of them ends a node's process)")
    ap.add_argument("--health-timeout", type=float, default=3.0, metavar="S",
                    help="a node silent S seconds whose connection dropped is down: its requests fail")
    ap.add_argument("--hang-timeout", type=float, default=30.0, metavar="S",
                    help="a node silent S seconds is down even while connected (hung, or its host died); "
                         "shorter silences over a live connection are long engine steps")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="tokens per streamed chunk (the first token and the last chunk go at once); as vLLM's "
                         "--stream-interval: fewer writes per token, burstier gaps (default 1)")
    ap.add_argument("--reuse-port", action="store_true",
                    help="bind --port with SO_REUSEPORT: several router processes share it, the kernel giving "
                         "each connection to one of them (scripts/launch_cluster.sh --routers N)")
    ap.add_argument("--router-index", type=int, default=0, metavar="I",
                    help="this router's place among those behind the port (0: the one that runs the pressure "
                         "and fair rebalancer; the others move requests off draining nodes only)")
    ap.add_argument("--routers", type=int, default=1, metavar="N",
                    help="router processes behind the port: each sees about 1/N of a client's requests "
                         "(--route d2lpm charges N times)")
    ap.add_argument("--peer-dir", metavar="DIR",
                    help="serve a private admin address on loopback too, written to DIR/router-I.admin; "
                         "admin requests for another router's requests go to the other routers' addresses there")
    ap.add_argument("--metrics-dir", metavar="DIR",
                    help="prometheus_client's multiprocess directory, shared by the routers behind the port: "
                         "/metrics answers with the sum over them (empty it before the first router starts)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap.parse_args(argv)


def tenant_tiers(items: list[str]) -> dict[str, str]:
    """`--tenant-tier TENANT=TIER` flags as a dict (the tiers are checked by RouterConfig)."""
    out = {}
    for it in items:
        tenant, sep, tier = it.partition("=")
        if not sep or not tenant:
            raise ValueError(f"--tenant-tier wants TENANT=TIER, got {it!r}")
        out[tenant] = tier
    return out


def multiprocess_metrics(path: str) -> None:
    """Put prometheus_client in multiprocess mode over `path` (its documented switch: the
    environment variable, read when prometheus_client is first imported). ValueError when it
    was imported already in single-process mode."""
    os.makedirs(path, exist_ok=True)
    values = sys.modules.get("prometheus_client.values")
    if values is not None and not getattr(values.ValueClass, "_multiprocess", True):
        raise ValueError("--metrics-dir: prometheus_client was imported before the flag was read")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdtb router`; returns the exit code."""
    import uvloop

    from pdtb.common import CliError, die, freeze_heap
    from pdtb.engine.model_info import resolve_model_arg

    a = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if a.log_level == "debug" else logging.WARNING)
    try:
        config = RouterConfig(tuple(NodeSpec.parse(n) for n in a.node), host=a.host, port=a.port,
                              api_key=a.api_key, curve_dir=a.curve_dir, request_timeout=a.request_timeout,
                              recompute_retries=a.recompute_retries, node_wait=a.node_wait,
                              max_streams_per_tenant=a.max_streams_per_tenant,
                              shutdown_timeout=a.shutdown_timeout, health_timeout=a.health_timeout,
                              hang_timeout=a.hang_timeout, tenant_tiers=tenant_tiers(a.tenant_tier),
                              route=a.route, rebalance=a.rebalance, allow_fault_injection=a.allow_fault_injection,
                              reuse_port=a.reuse_port, fleet=Fleet(a.router_index, a.routers, a.peer_dir),
                              metrics_dir=a.metrics_dir, stream_interval=a.stream_interval)
        if a.metrics_dir is not None:
            multiprocess_metrics(a.metrics_dir)
        model = load_served_model(resolve_model_arg(a.model), a.served_model_name, a.chat_template)
    except (ValueError, OSError, CliError) as e:
        return die(str(e))
    freeze_heap()
    try:
        return uvloop.run(serve(config, model))
    except OSError as e:  # e.g. the port is taken
        return die(f"cannot serve on {a.host}:{a.port}: {e}")


if __name__ == "__main__":
    sys.exit(main())
