"""The command's cluster, node, fairness and cost flags to a `ClusterShape`, a page geometry and a
cost model.

From `pdtb sim`'s flags to a cost model, a page geometry and a cluster shape: the flags of
the nodes (page budgets, limits, every fairness flag) and of the deployment being modelled."""
from __future__ import annotations

import argparse

from pdtb.common import CliError
from pdtb.engine.kv_spec import KVSpec
from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args
from pdtb.sim.faults import Kill
from pdtb.sim.cluster import ClusterShape
from pdtb.sim.node import NodeShape
from pdtb.sim.routers import DEFAULT_TARGET, RouterCost

DEFAULT_CALIBRATION = "cpu-tiny-2core"  # shipped in pdtb/sim/calibrations


def add_sim_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("cluster (as the nodes' and router's flags)")
    g.add_argument("--mode", choices=("colocated", "disagg"), default="disagg")
    g.add_argument("--prefill", type=int, default=1, help="disagg: prefill nodes")
    g.add_argument("--decode", type=int, default=1, help="disagg: decode nodes")
    g.add_argument("--replicas", type=int, default=1, help="colocated: nodes behind the router")
    g.add_argument("--kv-pages", type=int, help="device pages per node (default: the roofline's pool, else 4096)")
    g.add_argument("--prefill-kv-pages", type=int, help="device pages per prefill node (default --kv-pages)")
    g.add_argument("--decode-kv-pages", type=int, help="device pages per decode node (default --kv-pages)")
    g.add_argument("--decode-policy", metavar="NAME|module:Class|file.py:Class",
                   help="the decode nodes' policy at its defaults (default --policy with its settings): e.g. "
                        "fcfs, for a cluster whose decode side re-admits nothing of its own")
    g.add_argument("--host-kv-pages", type=int, default=0, help="host-tier pages per decode/colocated node")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    g.add_argument("--context", type=int, help="nodes' max_model_len (default: --max-model-len, else 4096; "
                                                "roofline: the model's max_position_embeddings)")
    g.add_argument("--hold-timeout", type=float, default=120.0, help="prefill: s a deferred hand-off keeps retrying")
    g.add_argument("--tenant-tier", action="append", default=[], metavar="TENANT=TIER", help="router default tier")
    g.add_argument("--step-scale", action="append", default=[], metavar="ROLE=X",
                   help="every step of ROLE's nodes (prefill, decode, colocated) takes X times the cost model's "
                        "time: the host's speed during one real run, as `pdtb sim step-check` measures it "
                        "(repeatable; default 1)")
    g.add_argument("--routers", type=int, default=1, metavar="N",
                   help="router processes behind one port, a request to one of them by a hash of its id "
                        "(pdtb/sim/routers.py)")
    g.add_argument("--router-request-us", type=float, metavar="US",
                   help="a router's CPU microseconds per request (parse, tokenize, dispatch): a busy router "
                        "delays dispatch (default: the router section of --router-calibration, else of a "
                        "--cost calibrated calibration, else 0)")
    g.add_argument("--router-token-us", type=float, metavar="US",
                   help="a router's CPU microseconds per token it relays: a busy router delays tokens "
                        "(default as --router-request-us)")
    g.add_argument("--router-calibration", metavar="NAME|PATH",
                   help="take the routers' costs from this calibration's router section, whatever --cost")
    g.add_argument("--router-target", type=float, default=DEFAULT_TARGET, metavar="SHARE",
                   help="the busy share a router is kept under when counting the routers needed "
                        f"(results and pdtb sim plan; default {DEFAULT_TARGET})")
    g.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="prefill and colocated nodes reuse cached pages of shared prompt blocks, as real nodes "
                        "do (only for workloads whose prompts share blocks: trace hash_ids, system prompts; "
                        "other prompts are unique)")
    g.add_argument("--kill", action="append", default=[], metavar="NODE@S",
                   help="the node's process dies at S simulated seconds (repeatable; nodes are prefill-0.., "
                        "decode-N.. after the prefill nodes, colocated-0..): the router finds it silent after "
                        "--health-timeout and recomputes what depended on it (pdtb/sim/faults.py)")
    g.add_argument("--health-timeout", type=float, default=3.0, help="router: s a silent node is still up")
    g.add_argument("--recompute-retries", type=int, default=2, help="router: times a request is recomputed")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="a KV transfer longer than this fails")
    g.add_argument("--every-step", action="store_true",
                   help="every engine step an event of its own: runs of identical decode steps are not taken "
                        "at once (pdtb/sim/coast.py). The same results, more slowly: for comparing the two")
    g.add_argument("--route", choices=("load", "d2lpm"), default="load",
                   help="the router's choice of prefill (or colocated) node: by load, or D2LPM's per-(client, "
                        "node) credit (pdtb/router/fair_route.py; the simulated router sees no node's cache, so no "
                        "node has an overlap)")
    g.add_argument("--rpc-latency-ms", type=float,
                   help="one message between processes (default: the calibration's, fitted to real runs, else 0.1)")
    g.add_argument("--client-latency-ms", type=float,
                   help="client <-> router, each way (default: the calibration's, fitted to real runs, else 0.5)")
    g.add_argument("--horizon-s", type=float, help="end the simulation here; requests still open are cut off (default: an hour after the last arrival)")
    add_fairness_args(ap)
    g = ap.add_argument_group("cost model")
    g.add_argument("--cost", choices=("roofline", "calibrated"), default="calibrated")
    g.add_argument("--gpu", default="h100-sxm", help="roofline: h100-sxm | h200 | a100-80gb")
    g.add_argument("--model-config", default="llama-3-8b",
                   help="roofline: a config.json path, a checkpoint dir, or a shipped name (llama-3-8b, llama-3-70b, ...)")
    g.add_argument("--tp", type=int, default=1, help="roofline: tensor-parallel GPUs per node")
    g.add_argument("--overhead-ms", type=float, help="roofline: fixed time per step (default the model's, 1 ms)")
    g.add_argument("--kv-link-gbps", type=float, help="roofline: prefill->decode link per GPU, Gbit/s (default 400)")
    g.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help="calibrated: a `pdtb sim calibrate` file, or a shipped name")


def build_cost(a: argparse.Namespace):
    """The cost model the flags name."""
    try:
        if a.cost == "calibrated":
            from pdtb.sim.calibration.record import Calibration

            return Calibration.load(a.calibration)
        from pdtb.shapes.accelerators import kv_link
        from pdtb.sim.roofline import RooflineCost

        kw = {"tp": a.tp, "page_size": a.page_size}
        if a.overhead_ms is not None:
            kw["overhead_s"] = a.overhead_ms / 1e3
        if a.kv_link_gbps is not None:
            kw["link"] = kv_link(a.kv_link_gbps)
        return RooflineCost.of(a.gpu, a.model_config, **kw)
    except (ValueError, OSError, KeyError) as e:
        raise CliError(f"pdtb sim: {e}") from None


RPC_S, CLIENT_S = 1e-4, 5e-4  # the request path's latencies without a calibration that has them


def page_spec(page_bytes: int, page_size: int) -> KVSpec:
    """A page geometry of exactly `page_bytes` bytes (the simulated pools hold no bytes: only the
    size matters, to policies' bandwidth figures and to metering)."""
    per_token = 2 * page_size * 2  # K and V, two bytes an element
    if page_bytes % per_token:
        raise CliError(f"pdtb sim: a page of {page_bytes} bytes is not whole bf16 K/V rows of {page_size} tokens")
    return KVSpec(1, 1, page_bytes // per_token, page_size, "bfloat16")


def _tiers(items: list[str]) -> dict[str, str]:
    """`--tenant-tier TENANT=TIER` as the router reads and checks it."""
    from pdtb.router.config import check_tenant_tiers
    from pdtb.router.main import tenant_tiers

    try:
        tiers = tenant_tiers(items)
        check_tenant_tiers(tiers)
    except ValueError as e:
        raise CliError(f"pdtb sim: {e}") from None
    return tiers


def context_of(a: argparse.Namespace) -> int:
    """The nodes' context: --context, else the client's --max-model-len, else (roofline) the
    model's max_position_embeddings, else 4096."""
    if a.context or a.max_model_len:
        return a.context or a.max_model_len
    if a.cost == "roofline":
        from pdtb.shapes.model_shape import load_config

        return int(load_config(a.model_config).get("max_position_embeddings") or 4096)
    return 4096


def decode_policy(a: argparse.Namespace, common: dict) -> dict:
    """The decode nodes' settings: --decode-policy at its defaults where given, else the common ones."""
    if not getattr(a, "decode_policy", None):
        return common
    if a.mode == "colocated":
        raise CliError("pdtb sim: --decode-policy is for --mode disagg (a colocated node has no decode side)")
    return {**common, "policy": a.decode_policy, "policy_args": {}}


def cluster_shape(a: argparse.Namespace, cost) -> ClusterShape:
    """The nodes and the router's settings the flags describe."""
    default = a.kv_pages or (cost.pool_pages() if hasattr(cost, "pool_pages") else 4096)
    if default < 1:
        raise CliError("pdtb sim: no KV page fits the device after the weights (a larger --tp, or --kv-pages)")
    common = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                  max_model_len=context_of(a), policy=a.policy, policy_args=policy_args(a), fairness=fairness_config(a),
                  hold_timeout_s=a.hold_timeout)
    decoding = decode_policy(a, common)
    try:
        scale = step_scales(a.step_scale)
        if a.mode == "colocated":
            if a.replicas < 1:
                raise ValueError("--replicas must be at least 1")
            nodes = [NodeShape("colocated", default, a.host_kv_pages, step_scale=scale.get("colocated", 1.0),
                               **common)] * a.replicas
        else:
            if a.prefill < 1 or a.decode < 1:
                raise ValueError("--prefill and --decode must be at least 1")
            nodes = [NodeShape("prefill", a.prefill_kv_pages or default, 0, step_scale=scale.get("prefill", 1.0),
                               **common)] * a.prefill + \
                    [NodeShape("decode", a.decode_kv_pages or default, a.host_kv_pages,
                               step_scale=scale.get("decode", 1.0), **decoding)] * a.decode
        path = getattr(cost, "path", None) or {}  # a calibration fitted to real runs' request path
        path = {**path, **((path.get("modes") or {}).get(a.mode) or {})}  # this mode's, where fitted apart
        rpc = a.rpc_latency_ms / 1e3 if a.rpc_latency_ms is not None else path.get("rpc_latency_s", RPC_S)
        client = a.client_latency_ms / 1e3 if a.client_latency_ms is not None else path.get("client_latency_s", CLIENT_S)
        per_token = 0.0 if a.rpc_latency_ms is not None else path.get("dispatch_s_per_token", 0.0)
        router = router_cost(a, cost)
        if not 0 < a.router_target <= 1:
            raise ValueError(f"--router-target must be in (0, 1], got {a.router_target:g}")
        return ClusterShape(tuple(nodes), rpc, client, dispatch_s_per_token=per_token,
                            tenant_tiers=_tiers(a.tenant_tier), route=a.route,
                            routers=a.routers, router_request_s=router.request_s, router_token_s=router.token_s,
                            coast=not a.every_step, kills=tuple(Kill.parse(k) for k in a.kill),
                            health_timeout_s=a.health_timeout, recompute_retries=a.recompute_retries,
                            transfer_timeout_s=a.transfer_timeout)
    except ValueError as e:
        raise CliError(f"pdtb sim: {e}") from None


def step_scales(items: list[str]) -> dict[str, float]:
    """`--step-scale ROLE=X` items as {role: X}."""
    out = {}
    for item in items:
        role, _, x = item.partition("=")
        try:
            out[role] = float(x)
        except ValueError:
            raise ValueError(f"--step-scale {item!r}: give ROLE=X, X a number") from None
        if role not in ("prefill", "decode", "colocated") or not out[role] > 0:
            raise ValueError(f"--step-scale {item!r}: ROLE is prefill, decode or colocated, X positive")
    return out


def router_cost(a: argparse.Namespace, cost) -> RouterCost:
    """The routers' CPU costs: each flag given, else the router section of --router-calibration,
    else of the calibration the cost model is (`--cost calibrated`), else none."""
    where, section = "the calibration", getattr(cost, "router", None)
    if a.router_calibration:
        from pdtb.sim.calibration.record import Calibration

        where, section = a.router_calibration, Calibration.load(a.router_calibration).router
        if section is None:
            raise ValueError(f"--router-calibration {where}: no router section")
    base = RouterCost.from_json(section, where) if section else RouterCost()
    req, tok = a.router_request_us, a.router_token_us
    if req is None and tok is None:
        return base
    given = " and ".join(f for f, v in (("--router-request-us", req), ("--router-token-us", tok)) if v is not None)
    source = f"{base.measured_by}; {given} by flag" if base.measured_by and (req is None or tok is None) else ""
    return RouterCost(base.request_s if req is None else req / 1e6, base.token_s if tok is None else tok / 1e6, source)
