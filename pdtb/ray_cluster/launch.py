"""`pdtb cluster up|down|status --ray ADDRESS`: a cluster placed and supervised by Ray.

    pdtb cluster up --ray ADDRESS|auto [--name NAME] [--mode disagg|colocated] [--prefill N] [--decode M]
                    [--colocated K] [--node-resources ROLE=JSON ...] [--router-resources JSON]
                    [--placement spread|pack] [--restart-failed] [--model DIR]
                    [--policy NAME|module:Class|file.py:Class] [--policy-arg KEY=VALUE ...]
                    [--transport zmq|shm|auto] [--kv-pages N] [--prefill-kv-pages N] [--host-kv-pages N]
                    [--page-size T] [--port P] [--routers N] [--router-args "..."] [--run-dir DIR] [--timeout S]
                    [-- flags for every node]
    pdtb cluster down (--run-dir DIR | --ray ADDRESS --name NAME)
    pdtb cluster status (--run-dir DIR | --ray ADDRESS --name NAME) [--json]

`up` makes one placement group per role, starts each node as a detached Ray actor in its
bundle (the node binds its Ray node's address and reports its ports), then the router (an
actor too, placed by `--router-resources`), given the addresses the node actors returned, and
a supervisor actor. With `--routers N`, N router actors on the first one's Ray node share its
port (SO_REUSEPORT; peer files and the summed metrics in a directory of that host's temp dir,
pdtb/router/peers.py), and the supervisor adds a replacement node to each at its private admin
address (it runs beside them). It prints `READY URL`; with `--run-dir` it also writes DIR/ray.json (the
Ray address and the cluster's name, for `down`) and DIR/url. `down` stops the nodes (SIGTERM:
they drain), then the router, kills every actor of the cluster and removes its placement
groups. Every actor and group is named `NAME:...` in the namespace `pdtb`.

`--policy` and its `--policy-arg`s go to every node, checked first (a bad reference or setting
stops `up` before anything is placed). A policy file's path is made absolute; the file, like
`--model`, must be at that path on every Ray node (a module:Class, importable there).
"""
from __future__ import annotations

import os
import secrets
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

NAMESPACE = "pdtb"
ROLES = ("decode", "prefill", "colocated")  # (the router lists nodes in this order, as launch_cluster.sh does)


@dataclass
class ClusterSpec:
    address: str  # Ray address, or "auto"
    name: str
    counts: dict[str, int]  # role -> nodes
    resources: dict[str, dict] = field(default_factory=dict)  # role -> bundle resources
    router_resources: dict = field(default_factory=dict)
    placement: str = "spread"
    restart_failed: bool = False
    node_args: dict[str, list[str]] = field(default_factory=dict)  # role -> its nodes' flags
    router_args: list[str] = field(default_factory=list)
    timeout: float = 180.0
    api_key: str | None = None
    routers: int = 1  # router processes behind the one port, all on the first one's Ray node


def router_args(spec: ClusterSpec, index: int, port: int | None, peer_dir: str) -> list[str]:
    """Router `index`'s flags: the spec's, and with several routers its place among them and
    the port router 0 bound (argparse keeps the last --port)."""
    if spec.routers == 1:
        return list(spec.router_args)
    return [*spec.router_args, "--reuse-port", "--router-index", str(index), "--routers", str(spec.routers),
            "--peer-dir", peer_dir, "--metrics-dir", os.path.join(peer_dir, "metrics"),
            *(["--port", str(port)] if port is not None else [])]


def connect(address: str) -> None:
    """Join the Ray cluster as a driver (Ray replaces a loopback address by this machine's
    outward one, unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 says the cluster is this host's)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")


def _members(spec: ClusterSpec) -> dict[str, dict]:
    from pdtb.ray_cluster.groups import actor_options, bundle_for, group_name

    out = {}
    for role in ROLES:
        bundle = bundle_for(spec.resources.get(role))
        for i in range(spec.counts.get(role, 0)):
            out[f"{spec.name}:{role}-{i}"] = {
                "role": role, "pg": group_name(spec.name, role), "bundle": i, "options": actor_options(bundle),
                "args": ["--node-id", f"{role}-{i}", *spec.node_args.get(role, [])]}
    return out


def up(spec: ClusterSpec) -> dict:
    """Start the cluster; on any failure, remove what was made and raise RuntimeError."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdtb.ray_cluster.actors import ProcessActor, Supervisor
    from pdtb.ray_cluster.actors import start_members
    from pdtb.ray_cluster.groups import bundle_for, make_group

    connect(spec.address)
    if _names(spec.name):
        raise RuntimeError(f"a cluster named {spec.name!r} is up on this Ray cluster: pdtb cluster down it first")
    members = _members(spec)
    try:
        for role in ROLES:
            if spec.counts.get(role):
                make_group(spec.name, role, spec.counts[role], bundle_for(spec.resources.get(role)), spec.placement,
                           spec.timeout)
        infos = start_members(members, NAMESPACE, spec.timeout)
        nodes = [f"--node={m['role']}={infos[n]['ctrl']}" for n, m in members.items()]
        peer_dir = os.path.join(tempfile.gettempdir(), f"pdtb-{spec.name}-{secrets.token_hex(4)}")  # (fresh metrics)
        router = ProcessActor.options(name=f"{spec.name}:router", namespace=NAMESPACE, lifetime="detached",
                                      num_cpus=0, resources=spec.router_resources).remote("router", f"{spec.name}:router")
        rinfo = ray.get(router.start.remote([*nodes, *router_args(spec, 0, None, peer_dir)], spec.timeout),
                        timeout=spec.timeout + 60)
        url = rinfo["url"]
        beside_router = NodeAffinitySchedulingStrategy(node_id=rinfo["ray_node"], soft=False)  # (not on a node it watches)
        rinfos = [rinfo, *_more_routers(spec, nodes, int(url.rsplit(":", 1)[1]), peer_dir, beside_router)]
        for r in rinfos:
            _wait_health(r.get("admin_url", url), spec.timeout)
        sup = Supervisor.options(name=f"{spec.name}:supervisor", namespace=NAMESPACE, lifetime="detached",
                                 scheduling_strategy=beside_router).remote(
            spec.name, NAMESPACE, url, spec.restart_failed, spec.timeout, spec.api_key,
            [r["admin_url"] for r in rinfos if "admin_url" in r])
        ray.get([sup.watch.remote(n, {**m, "ctrl": infos[n]["ctrl"]}) for n, m in members.items()], timeout=30)
    except BaseException as e:
        down(spec.address, spec.name)
        if isinstance(e, (RuntimeError, ray.exceptions.RayError)):
            raise RuntimeError(f"cluster {spec.name} did not start: {e}") from None
        raise
    return {"name": spec.name, "address": spec.address, "url": url,
            "members": [infos[n] for n in members] + rinfos}


def _more_routers(spec: ClusterSpec, nodes: list[str], port: int, peer_dir: str, beside) -> list[dict]:
    """Routers 1..N-1, on router 0's Ray node (SO_REUSEPORT shares a port within one host), all
    started at once; what each reported."""
    import ray

    from pdtb.ray_cluster.actors import ProcessActor

    starts = []
    for i in range(1, spec.routers):
        name = f"{spec.name}:router-{i}"
        actor = ProcessActor.options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                                     scheduling_strategy=beside).remote("router", name)
        starts.append(actor.start.remote([*nodes, *router_args(spec, i, port, peer_dir)], spec.timeout))
    return ray.get(starts, timeout=spec.timeout + 60) if starts else []


def _wait_health(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not 200 after {timeout:.0f}s")
        time.sleep(0.3)


def _names(cluster: str) -> list[str]:
    """Named actors of `cluster`, alive or not yet cleaned up."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(f"{cluster}:"))


def _groups(cluster: str) -> list:
    import ray
    from ray.util.placement_group import PlacementGroup

    out = []
    for pg_id, entry in ray.util.placement_group_table().items():
        if entry.get("name", "").startswith(f"{cluster}:") and entry.get("state") != "REMOVED":
            out.append(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    return out


def down(address: str, cluster: str, timeout: float = 20.0) -> dict:
    """Stop the processes (nodes first, drained; then the router), kill every actor, remove the
    groups. Returns what it found and removed."""
    import ray

    connect(address)
    names = _names(cluster)
    handles = {}
    for n in names:
        try:
            handles[n] = ray.get_actor(n, namespace=NAMESPACE)
        except ValueError:
            pass
    sup = handles.pop(f"{cluster}:supervisor", None)
    if sup is not None:
        _quietly(lambda: ray.get(sup.shutdown.remote(), timeout=10))
    # As stop_cluster.sh: the router, prefill and colocated nodes first (prompts in flight are
    # handed off), then the decode nodes, which drain what they hold.
    decode = [n for n in handles if n.split(":", 1)[1].startswith("decode")]
    for phase in ([n for n in handles if n not in decode], decode):
        stops = [handles[n].stop.remote(timeout) for n in phase]
        _quietly(lambda: ray.get(stops, timeout=timeout + 15))
    for h in [*handles.values(), sup]:
        if h is not None:
            _quietly(lambda h=h: ray.kill(h))
    groups = _groups(cluster)
    for pg in groups:
        _quietly(lambda pg=pg: ray.util.remove_placement_group(pg))
    deadline = time.monotonic() + 30
    while _names(cluster) and time.monotonic() < deadline:  # kill is asynchronous
        time.sleep(0.2)
    return {"actors": names, "groups": len(groups), "left": _names(cluster)}


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a member already gone is what a stop wants
        pass


def status(address: str, cluster: str) -> dict:
    import ray

    connect(address)
    out = {"name": cluster, "members": [], "lost": []}
    for n in _names(cluster):
        try:
            h = ray.get_actor(n, namespace=NAMESPACE)
            if n.endswith(":supervisor"):
                out["lost"] = ray.get(h.report.remote(), timeout=10)["lost"]
                continue
            out["members"].append({"name": n, **ray.get(h.info.remote(), timeout=10)})
        except (ValueError, ray.exceptions.RayError) as e:
            out["members"].append({"name": n, "alive": False, "error": type(e).__name__})
    out["groups"] = [pg.id.hex() for pg in _groups(cluster)]
    return out
