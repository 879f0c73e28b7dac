"""Command line of `pdtb cluster` (see pdtb/ray_cluster/launch.py for what each does)."""
from __future__ import annotations

import argparse
import json
import re
import secrets
import shlex
import sys
from pathlib import Path

from pdtb.common import CliError

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a cluster's name


def _resources(text: str) -> dict:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"resources {text!r}: not JSON ({e})") from None
    if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in d.items()):
        raise CliError(f"resources {text!r}: want a JSON object of positive numbers, e.g. '{{\"GPU\": 1}}'")
    return d


def parse_up(argv: list[str]) -> argparse.Namespace:
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="pdtb cluster up")
    ap.add_argument("--ray", required=True, metavar="ADDRESS", help="the Ray cluster's address (ray start --head prints it), or auto")
    ap.add_argument("--name", default=None, help="the cluster's name on the Ray cluster (default: pdtb-RANDOM)")
    ap.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--colocated", type=int, default=1)
    ap.add_argument("--node-resources", action="append", default=[], metavar="ROLE=JSON",
                    help='a role\'s bundle, e.g. decode=\'{"GPU": 1}\' or prefill=\'{"prefill": 1}\' (default one CPU)')
    ap.add_argument("--router-resources", default="{}", metavar="JSON", help="where the router may run (default anywhere)")
    ap.add_argument("--placement", choices=["spread", "pack"], default="spread")
    ap.add_argument("--restart-failed", action="store_true", help="replace a lost node and add it to the router")
    ap.add_argument("--model", default=None, help="checkpoint dir, the same path on every Ray node (default: the embedded model)")
    ap.add_argument("--policy", default="fcfs", metavar="NAME|module:Class|file.py:Class",
                    help="every node's policy; a file is looked for at the same path on every Ray node")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the policy's own, for every node (repeatable)")
    ap.add_argument("--transport", choices=["zmq", "shm", "auto"], default="zmq")
    ap.add_argument("--kv-pages", type=int, default=4096)
    ap.add_argument("--prefill-kv-pages", type=int, default=None)
    ap.add_argument("--host-kv-pages", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--port", type=int, default=8000, help="router port (0: a free one)")
    ap.add_argument("--routers", type=int, default=1, metavar="N",
                    help="router processes behind the port (SO_REUSEPORT), all on one Ray node (default 1)")
    ap.add_argument("--router-args", default="", help="more router flags (split on spaces)")
    ap.add_argument("--prefill-args", default="", help="more flags for the prefill nodes (split on spaces)")
    ap.add_argument("--decode-args", default="", help="more flags for the decode nodes (split on spaces)")
    ap.add_argument("--curve-dir", default=None, help="ZeroMQ CURVE keys, the same path on every Ray node")
    ap.add_argument("--api-key", default=None, help="the router's API key (its /admin/* needs it)")
    ap.add_argument("--run-dir", default=None, help="write ray.json and url here (for pdtb cluster down --run-dir)")
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args(argv)
    a.extra = extra
    if min(a.prefill, a.decode, a.colocated, a.routers) < 1:
        ap.error("--prefill, --decode, --colocated and --routers want at least 1")
    return a


def policy_flags(a: argparse.Namespace) -> list[str]:
    """The nodes' policy flags, checked here first: a bad reference or setting stops `up`
    before anything is placed, with the message a node would give."""
    from pdtb.nodes.fairness_args import policy_args

    from fairness.registry import absolute_ref

    ref = absolute_ref(a.policy)  # nodes start in a Ray worker's directory, not this one
    policy_args(argparse.Namespace(policy=ref, policy_arg=list(a.policy_arg)))
    return ["--policy", ref, *(x for item in a.policy_arg for x in ("--policy-arg", item))]


def spec_of(a: argparse.Namespace):
    from pdtb.ray_cluster.launch import ROLES, ClusterSpec

    resources = {}
    for item in a.node_resources:
        role, sep, text = item.partition("=")
        if not sep or role not in ROLES:
            raise CliError(f"--node-resources {item!r}: want ROLE=JSON with ROLE one of {', '.join(ROLES)}")
        resources[role] = _resources(text)
    counts = {"prefill": a.prefill, "decode": a.decode} if a.mode == "disagg" else {"colocated": a.colocated}
    common = [*(["--model", a.model] if a.model else []), "--page-size", str(a.page_size), *policy_flags(a)]
    node_args = {}
    for role in counts:
        pages = a.prefill_kv_pages if role == "prefill" and a.prefill_kv_pages else a.kv_pages
        args = [*common, "--kv-pages", str(pages)]
        if role != "colocated":
            args += ["--transport", a.transport]
        if role != "prefill":
            args += ["--host-kv-pages", str(a.host_kv_pages)]
        if a.curve_dir:
            args += ["--curve-dir", a.curve_dir]
        own = {"prefill": a.prefill_args, "decode": a.decode_args}.get(role, "")
        node_args[role] = args + a.extra + shlex.split(own)
    router_args = [*(["--model", a.model] if a.model else []), "--port", str(a.port), *shlex.split(a.router_args),
                   *(["--api-key", a.api_key] if a.api_key else []), *(["--curve-dir", a.curve_dir] if a.curve_dir else [])]
    if a.name is not None and not NAME_RE.fullmatch(a.name):
        # (actors are named NAME:ROLE-I and replacements NAME:ROLE-I~N: the name must not hold ':' or '~')
        raise CliError(f"--name {a.name!r}: letters, digits, '.', '_' and '-' only (at most 64)")
    return ClusterSpec(address=a.ray, name=a.name or f"pdtb-{secrets.token_hex(3)}", counts=counts,
                       resources=resources, router_resources=_resources(a.router_resources), placement=a.placement,
                       restart_failed=a.restart_failed, node_args=node_args, router_args=router_args,
                       timeout=a.timeout, api_key=a.api_key, routers=a.routers)


def _target(argv: list[str], prog: str) -> tuple[str, str, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--ray", default=None, metavar="ADDRESS")
    ap.add_argument("--name", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args(argv)
    if a.run_dir:
        path = Path(a.run_dir) / "ray.json"
        if not path.exists():
            raise CliError(f"{path} does not exist: not a run dir of pdtb cluster up")
        rec = json.loads(path.read_text())
        return a.ray or rec["address"], a.name or rec["name"], a
    if not (a.ray and a.name):
        raise CliError(f"{prog}: give --run-dir, or --ray ADDRESS and --name NAME")
    return a.ray, a.name, a


def main(argv: list[str]) -> int:
    from pdtb.ray_cluster import launch

    if not argv or argv[0] not in ("up", "down", "status"):
        raise CliError("pdtb cluster up|down|status ... (see pdtb cluster up --help)")
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        a = parse_up(rest)
        spec = spec_of(a)
        try:
            res = launch.up(spec)
        except RuntimeError as e:
            print(f"pdtb cluster up: {e}", file=sys.stderr)
            return 1
        if a.run_dir:
            d = Path(a.run_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / "ray.json").write_text(json.dumps({"address": spec.address, "name": spec.name, "url": res["url"],
                                                    "members": res["members"]}, indent=1) + "\n")
            (d / "url").write_text(res["url"] + "\n")
        for m in res["members"]:
            print(f"  {m['name']:<28} {m['host']:<16} ray node {m['ray_node'][:12]}", file=sys.stderr)
        print(f"READY {res['url']}", flush=True)
        return 0
    address, name, a = _target(rest, f"pdtb cluster {cmd}")
    if cmd == "down":
        res = launch.down(address, name, a.timeout)
        print(json.dumps(res) if a.json else f"cluster {name}: removed {len(res['actors'])} actor(s) and "
              f"{res['groups']} placement group(s)" + (f"; still listed: {res['left']}" if res["left"] else ""))
        return 0 if not res["left"] else 1
    res = launch.status(address, name)
    if a.json:
        print(json.dumps(res))
    else:
        for m in res["members"]:
            print(f"{m['name']:<28} {'up' if m.get('alive') else 'DOWN':<5} {m.get('host', '?'):<16} {m.get('ray_node', '?')[:12]}")
        for lost in res["lost"]:
            print(f"lost {lost['name']}: {lost['why']}" + (f" (replaced by {lost['replaced_by']})" if lost["replaced_by"] else ""))
    return 0
