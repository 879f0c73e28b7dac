"""`pdtb prefill|decode|colocated`: start one node process (one uvloop event loop)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pdtb.common import CliError, freeze_heap
from pdtb.engine.loader import resolve_model_arg
from pdtb.generate import add_engine_args, engine_config
from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args


def parse(role: str, argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"pdtb {role}", description=f"Start a {role} node.")
    add_engine_args(ap)
    ap.add_argument("--node-id", default=None, help=f"default: {role}-<pid>")
    ap.add_argument("--host", default="127.0.0.1", help="interface every socket binds to (default loopback)")
    ap.add_argument("--ctrl-port", type=int, default=0, help="control socket port (0: ephemeral)")
    ap.add_argument("--metrics-port", type=int, default=0, help="/metrics HTTP port (0: ephemeral)")
    ap.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: ephemeral)")
    ap.add_argument("--transport", choices=["zmq", "torch", "shm", "auto"], default="zmq",
                    help="KV transport: zmq; torch (torch.distributed payloads); shm (one-sided writes "
                         "into the decode node's shared-memory pool, peers on one host); auto (shm where "
                         "the peer's pool can be mapped, else zmq)")
    ap.add_argument("--dist-init-method", default=None,
                    help="--transport torch: process-group rendezvous, file:///shared/path or tcp://HOST:PORT")
    ap.add_argument("--dist-rank", type=int, default=-1, help="--transport torch: this node's rank")
    ap.add_argument("--dist-world-size", type=int, default=0, help="--transport torch: prefill + decode nodes")
    add_fairness_args(ap)
    ap.add_argument("--host-kv-pages", type=int, default=0, help="host-tier KV pages (decode/colocated)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds to finish in-flight work")
    ap.add_argument("--router-lease", type=float, default=10.0, metavar="S",
                    help="a router silent this long (routers ping every node twice a second) is taken for dead: "
                         "its requests here end and their pages are freed")
    ap.add_argument("--migration-timeout", type=float, default=5.0, metavar="S",
                    help="decode: seconds each phase of a live migration out of this node may take before the "
                         "request goes on here (default 5)")
    ap.add_argument("--hold-timeout", type=float, default=120.0,
                    help="prefill: seconds a hand-off refused for lack of decode pages keeps retrying")
    ap.add_argument("--transfer-timeout", type=float, default=30.0, metavar="S",
                    help="seconds a whole KV transfer may take, on both sides (the idle timeout is at most this); "
                         "bounds how long a lost transport message holds a request")
    ap.add_argument("--transport-fault", action="append", default=[], metavar="NAME=VALUE",
                    help="chaos runs only: inject faults into this node's outgoing KV transport messages "
                         "(repeatable). Probabilities per message: drop, delay, duplicate, corrupt, truncate "
                         "(e.g. drop=0.1); delay_s=S (latency of a delayed message); disconnect=N (drop the "
                         "link once after N chunks); kinds=K,K (message kinds hit; default header,batch,chunk, what a "
                         "prefill node sends; a decode node sends credit,ack,nack); max_faults=N (stop after N); "
                         "seed=N. See kv_transport/faults.py")
    ap.add_argument("--addr-file", default=None, help="write the bound addresses here as JSON when ready")
    ap.add_argument("--check-pages", action="store_true", help="verify page states after every step")
    ap.add_argument("--step-log", default=None, metavar="FILE",
                    help="append one JSON line per engine step: what ran, how long, tier moves "
                         "('{node}' in FILE becomes the node id)")
    ap.add_argument("--curve-dir", default=None, help="ZeroMQ CURVE keys (pdtb keys --out DIR) for every socket")
    ap.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return ap.parse_args(argv)


FAULT_PROBS = {"drop": "drop_prob", "delay": "delay_prob", "duplicate": "duplicate_prob",
               "corrupt": "corrupt_prob", "truncate": "truncate_prob"}
FAULT_INTS = {"disconnect": "disconnect_after_chunks", "max_faults": "max_faults", "seed": "seed"}


def fault_config(items: list[str]):
    """`--transport-fault NAME=VALUE` flags as a kv_transport FaultConfig."""
    from kv_transport.config import FaultConfig

    kw: dict = {}
    for it in items:
        name, sep, v = it.partition("=")
        try:
            if not sep:
                raise ValueError("expects NAME=VALUE")
            if name in FAULT_PROBS:
                kw[FAULT_PROBS[name]] = float(v)
            elif name == "delay_s":
                kw[name] = float(v)
            elif name in FAULT_INTS:
                kw[FAULT_INTS[name]] = int(v)
            elif name == "kinds":
                kw[name] = tuple(k.strip() for k in v.split(",") if k.strip())
            else:
                known = ", ".join([*FAULT_PROBS, "delay_s", *FAULT_INTS, "kinds"])
                raise ValueError(f"unknown name {name!r}; known: {known}")
            FaultConfig(**kw)  # validate as we go, so that the error names the flag at fault
        except ValueError as e:
            raise CliError(f"--transport-fault {it!r}: {e}") from None
    return FaultConfig(**kw)


def _write_addr(path: str | None, addrs: dict) -> None:
    line = json.dumps(addrs)
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(line)
        os.replace(tmp, path)  # readers never see a half-written file
    print(f"NODE READY {line}", flush=True)


def node_config(role: str, a: argparse.Namespace, model_dir: str):
    """The NodeConfig of a node started with the flags `a` (`parse(role, ...)`); CliError if they
    do not make one."""
    import dataclasses

    from pdtb.nodes.node_base import NodeConfig

    if a.torch_threads < 1:
        raise CliError("--torch-threads must be at least 1")
    node_id = a.node_id or f"{role}-{os.getpid()}"
    try:
        return NodeConfig(role=role, node_id=node_id,
                          engine=dataclasses.replace(engine_config(a, model_dir), torch_threads=a.torch_threads,
                                                     host_kv_pages=0 if role == "prefill" else a.host_kv_pages,
                                                     shared_kv=role == "decode" and a.transport in ("shm", "auto")),
                          host=a.host, ctrl_port=a.ctrl_port, metrics_port=a.metrics_port, kv_port=a.kv_port,
                          transport=a.transport, policy=a.policy, policy_args=policy_args(a), fairness=fairness_config(a),
                          drain_timeout_s=a.drain_timeout, hold_timeout_s=a.hold_timeout, curve_dir=a.curve_dir,
                          migration_timeout_s=a.migration_timeout, router_lease_s=a.router_lease, check_pages=a.check_pages,
                          step_log=a.step_log and a.step_log.replace("{node}", node_id),
                          transfer_timeout_s=a.transfer_timeout, transport_faults=fault_config(a.transport_fault),
                          dist_init_method=a.dist_init_method, dist_rank=a.dist_rank,
                          dist_world_size=a.dist_world_size)
    except ValueError as e:
        raise CliError(str(e)) from None


def main(role: str, argv: list[str]) -> int:
    a = parse(role, argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    import torch
    import uvloop

    cfg = node_config(role, a, resolve_model_arg(a.model))
    torch.set_num_threads(a.torch_threads)
    if cfg.transport_faults.enabled:
        logging.getLogger("pdtb.node").warning("KV transport fault injection is on: %s", cfg.transport_faults)
    if role == "prefill":
        from prefill_node.node import PrefillNode as cls
    elif role == "decode":
        from decode_node.node import DecodeNode as cls
    else:
        from pdtb.colocated.node import ColocatedNode as cls

    async def run() -> None:
        try:
            node = cls(cfg)
        except ValueError as e:
            raise CliError(str(e)) from None
        except OSError as e:  # --step-log names a file that cannot be opened
            raise CliError(f"cannot open {e.filename}: {e.strerror}") from None
        freeze_heap()
        await node.run(on_ready=lambda addrs: _write_addr(a.addr_file, addrs))

    uvloop.run(run())
    return 0
