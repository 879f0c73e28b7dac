"""The process a Ray actor runs (pdtb/ray_cluster/process.py), without Ray: it reports what its
READY line says, stops on SIGTERM, dies with its parent, and a start that fails says why."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from cluster_util import alive, wait_until
from pdtb.ray_cluster.process import NodeProcess


def test_a_router_process_reports_its_url_and_stops(tmp_path):
    p = NodeProcess("router", ["--port", "0", "--host", "127.0.0.1", "--node", "colocated=tcp://127.0.0.1:9"],
                    log_dir=str(tmp_path))
    info = p.start(timeout=60)
    try:
        assert info["url"].startswith("http://127.0.0.1:") and alive(info["pid"]) and p.alive()
    finally:
        code = p.stop(10)
    assert code is not None and not p.alive()


def test_a_start_that_fails_says_why(tmp_path):
    p = NodeProcess("decode", ["--kv-pages", "-3"], log_dir=str(tmp_path))
    try:
        p.start(timeout=60)
    except RuntimeError as e:
        assert "exited" in str(e) and "num_pages must be >= 1" in str(e)  # the log's tail
    else:
        raise AssertionError("a node with -3 pages started")


def test_the_process_dies_with_the_one_that_started_it(tmp_path):
    """Its parent (a Ray worker, here a plain Python process) is killed with SIGKILL: the kernel
    ends the node process too (the parent-death signal), so no process outlives its actor."""
    script = textwrap.dedent(f"""
        import json, sys, time
        from pdtb.ray_cluster.process import NodeProcess
        p = NodeProcess("router", ["--port", "0", "--host", "127.0.0.1", "--node", "colocated=tcp://127.0.0.1:9"],
                        log_dir={str(tmp_path)!r})
        print(json.dumps(p.start(timeout=60)), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(parent.stdout.readline())
        assert alive(info["pid"])
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not alive(info["pid"]), 15, what="the router process gone with its parent")
    finally:
        parent.kill()


def test_a_replacement_takes_a_new_node_id():
    from pdtb.ray_cluster.process import with_node_id

    args = ["--node-id", "decode-0", "--kv-pages", "64", "--node-id=mine", "--policy", "memfair"]
    assert with_node_id(args, "decode-0~123") == ["--kv-pages", "64", "--policy", "memfair", "--node-id", "decode-0~123"]
    assert args[1] == "decode-0"  # the lost member's own arguments are kept as they were
    assert with_node_id(["--kv-pages", "64"], "d~1") == ["--kv-pages", "64", "--node-id", "d~1"]


def test_a_cluster_name_cannot_hold_the_separators_of_its_actors_names():
    import pytest

    from pdtb.common import CliError
    from pdtb.ray_cluster.cli import parse_up, spec_of

    assert spec_of(parse_up(["--ray", "auto", "--name", "exp-1.a_b"])).name == "exp-1.a_b"
    for bad in ("a:b", "a~b", ""):
        with pytest.raises(CliError, match="--name"):
            spec_of(parse_up(["--ray", "auto", "--name", bad]))


def test_routers_behind_one_port_get_their_place_and_router_0s_port():
    """`pdtb cluster up --routers 3`: router 0 binds --port, the others join the port it bound,
    each with its index, the count and the directory where they find each other; one router
    gets the flags as given."""
    from pdtb.ray_cluster.cli import parse_up, spec_of
    from pdtb.ray_cluster.launch import router_args

    from pdtb.router.main import parse_args

    spec = spec_of(parse_up(["--ray", "auto", "--port", "0", "--routers", "3", "--router-args", "--route cache"]))
    first, third = (parse_args(router_args(spec, i, port, "/tmp/peers")) for i, port in ((0, None), (2, 41234)))
    assert (first.port, first.router_index, first.routers) == (0, 0, 3)
    assert (third.port, third.router_index, third.routers) == (41234, 2, 3)
    assert third.reuse_port and third.route == "cache" and third.peer_dir == "/tmp/peers"
    assert third.metrics_dir == "/tmp/peers/metrics"
    one = spec_of(parse_up(["--ray", "auto", "--port", "0"]))
    assert router_args(one, 0, None, "/tmp/peers") == one.router_args and "--reuse-port" not in one.router_args


def test_a_router_with_peers_reports_its_admin_address_too(tmp_path):
    p = NodeProcess("router", ["--port", "0", "--host", "127.0.0.1", "--node", "colocated=tcp://127.0.0.1:9",
                               "--reuse-port", "--peer-dir", str(tmp_path / "peers")], log_dir=str(tmp_path))
    info = p.start(timeout=60)
    try:
        assert info["admin_url"] == (tmp_path / "peers" / "router-0.admin").read_text().strip() != info["url"]
    finally:
        p.stop(10)
    assert not (tmp_path / "peers" / "router-0.admin").exists()
