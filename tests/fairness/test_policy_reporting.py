"""Every place a run is described names the policy each node runs, where it came from and its
settings: a node's stats (and so the router's `/cluster`), its Prometheus metrics, and the
results files of `pdtb bench serve` and `pdtb sim`. The policy here is loaded from a file, so
its source is the reference itself and one setting differs from its default."""
from __future__ import annotations

import asyncio
import textwrap

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdtb.figures.results import check_results, load_results, policy_section, server_policy_info
from pdtb.nodes.node_base import NodeConfig
from pdtb.nodes.node_metrics import settings_text
from pdtb.nodes.protocol import decode_message, encode_message
from pdtb.engine.config import EngineConfig

POLICY_FILE = textwrap.dedent('''
    from dataclasses import dataclass

    from fairness import BasePolicy, PolicySettings, setting


    @dataclass(frozen=True)
    class HalfLifeSettings(PolicySettings):
        horizon_s: float = setting(2.0, "seconds a charge is remembered", lo=0, lo_open=True)
        strict: bool = setting(False, "keep arrival order")


    class HalfLife(BasePolicy):
        """First come first served, with settings of its own."""

        name = "halflife"
        Settings = HalfLifeSettings
''')
ARGS = (("horizon_s", "5"),)
SETTINGS = {"horizon_s": 5.0, "strict": False}


@pytest.fixture
def policy_ref(tmp_path) -> str:
    path = tmp_path / "halflife_policy.py"
    path.write_text(POLICY_FILE)
    return f"{path}:HalfLife"


def expected(ref: str) -> dict:
    return {"name": "halflife", "source": ref, "settings": SETTINGS}


def node_config(role: str, node_id: str, ref: str, llama_dir: str) -> NodeConfig:
    return NodeConfig(role, node_id, EngineConfig(llama_dir, num_pages=32), policy=ref, policy_args=ARGS)


def policy_samples(metrics_text: str) -> list:
    return [s for fam in text_string_to_metric_families(metrics_text) if fam.name == "pdtb_policy_info"
            for s in fam.samples]


def test_a_node_names_its_policy_in_stats_and_metrics(llama_dir, policy_ref):
    from pdtb.colocated.node import ColocatedNode

    node = ColocatedNode(node_config("colocated", "c0", policy_ref, llama_dir))
    try:
        extra = node.stats().extra
        assert extra["policy_info"] == expected(policy_ref)
        assert extra["policy"] == "halflife"  # the label the results files' `meta.policy` is made of
        assert decode_message(encode_message(node.stats())).extra["policy_info"] == expected(policy_ref)
        [sample] = policy_samples(node.metrics.render().decode())
        assert sample.value == 1.0
        assert sample.labels == {"role": "colocated", "node": "c0", "policy": "halflife", "source": policy_ref,
                                 "settings": "horizon_s=5.0,strict=false"}
    finally:
        node.ctx.destroy(linger=0)


def test_every_role_names_the_policy_it_was_given(llama_dir, policy_ref):
    """The prefill node runs the policy wrapped (PrefillOrder) and says so in its `policy`
    label; the decode node's is the policy's name. Their `policy_info` is the same as a
    colocated node's, so a disaggregated cluster's results file names one policy."""
    from decode_node.node import DecodeNode
    from prefill_node.node import PrefillNode

    nodes = [PrefillNode(node_config("prefill", "p0", policy_ref, llama_dir)),
             DecodeNode(node_config("decode", "d0", policy_ref, llama_dir))]
    try:
        extras = [n.stats().extra for n in nodes]
        assert [e["policy"] for e in extras] == ["prefill-halflife", "halflife"]
        assert all(e["policy_info"] == expected(policy_ref) for e in extras)
        cluster = [{"id": n.config.node_id, "role": n.config.role, "extra": e} for n, e in zip(nodes, extras)]
        assert server_policy_info(cluster) == expected(policy_ref)
        assert [s.labels["node"] for n in nodes for s in policy_samples(n.metrics.render().decode())] == ["p0", "d0"]
    finally:
        for n in nodes:
            n.ctx.destroy(linger=0)


async def _cluster_through_router(node, served) -> list[dict]:
    """`/cluster` of a router in front of `node`, once the router has the node's stats."""
    from pdtb.router.completions import STATE
    from pdtb.router.config import NodeSpec, RouterConfig
    from pdtb.router.main import start_router

    stop = asyncio.Event()
    serving = asyncio.create_task(node.ctrl.serve(stop, tick_s=0.01))
    runner = None
    try:
        config = RouterConfig((NodeSpec("colocated", node.ctrl.address),), port=0, ping_interval=0.02)
        runner, url = await start_router(config, served)
        registry = runner.app[STATE].registry
        while registry.nodes[0].stats is None:  # (bounded by the caller's wait_for)
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(url + "/cluster") as r:
                assert r.status == 200
                return await r.json()
    finally:
        if runner is not None:
            await asyncio.wait_for(runner.cleanup(), 10)
        stop.set()
        await serving


def test_the_router_lists_the_policy_of_each_node(llama_dir, policy_ref):
    from pdtb.colocated.node import ColocatedNode
    from pdtb.router.main import load_served_model

    node = ColocatedNode(node_config("colocated", "c0", policy_ref, llama_dir))
    try:
        nodes = asyncio.run(asyncio.wait_for(_cluster_through_router(node, load_served_model(llama_dir, "tiny")), 30))
    finally:
        node.ctx.destroy(linger=0)
    [entry] = nodes
    assert entry["id"] == "c0" and entry["extra"]["policy_info"] == expected(policy_ref)
    assert server_policy_info(nodes) == expected(policy_ref)  # what `pdtb bench serve --out` records


def test_nodes_that_differ_are_recorded_one_by_one():
    fcfs = {"name": "fcfs", "source": "built in", "settings": {}}
    mine = {"name": "halflife", "source": "x.py:HalfLife", "settings": SETTINGS}
    assert policy_section({}) is None and server_policy_info(None) is None
    assert server_policy_info([{"id": "old", "extra": {"policy": "fcfs"}}]) is None  # a node without the field
    assert policy_section({"a": fcfs, "b": dict(fcfs)}) == fcfs
    assert policy_section({"a": fcfs, "b": mine}) == {"nodes": {"a": fcfs, "b": mine}}


@pytest.mark.parametrize("info, ok", [
    (None, True),
    ({"name": "fcfs", "source": "built in", "settings": {}}, True),
    ({"nodes": {"a": {"name": "fcfs", "source": "built in", "settings": {}}}}, True),
    ("fcfs", False),
    ({"name": "fcfs", "source": "built in", "settings": "x=1"}, False),
    ({"nodes": {"a": {"name": "fcfs"}}}, False),
])
def test_a_results_file_is_checked_for_the_shape_of_its_policy_info(info, ok):
    data = {"meta": {"policy": "fcfs", "policy_info": info}, "requests": [], "summary": {}}
    if ok:
        assert check_results(data, "r.json")["meta"]["policy_info"] == info
    else:
        with pytest.raises(ValueError, match="policy_info"):
            check_results(data, "r.json")


def test_settings_text_is_sorted_and_spelled_as_policy_arg_takes_it():
    assert settings_text({}) == ""
    assert settings_text({"b": None, "a": True, "c": 0.5, "d": "x"}) == "a=true,b=none,c=0.5,d=x"


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_sim_results_file_names_the_policy(tmp_path, capsys, policy_ref, mode):
    from pdtb.cli import main

    out = tmp_path / "r.json"
    assert main(["sim", "--workload", "whale-minnow", "--duration", "2", "--whales", "1", "--whale-prompt", "128",
                 "--whale-output", "16", "--minnow-rate", "4", "--minnow-prompt", "24", "--minnow-output", "4",
                 "--mode", mode, "--policy", policy_ref, "--policy-arg", "horizon_s=5", "--kv-pages", "256",
                 "--cost", "calibrated", "--out", str(out)]) == 0
    meta = load_results(out)["meta"]
    assert meta["policy"] == "halflife" and meta["policy_info"] == expected(policy_ref)
    assert "results: " in capsys.readouterr().out


def test_a_sim_sweep_file_names_the_policy(tmp_path, policy_ref):
    from pdtb.figures.frontier import load_sweep
    from pdtb.cli import main

    out = tmp_path / "sweep.json"
    assert main(["sim", "--workload", "whale-minnow", "--duration", "2", "--whales", "1", "--whale-prompt", "128",
                 "--whale-output", "16", "--minnow-prompt", "24", "--minnow-output", "4", "--rates", "2",
                 "--warmup-s", "0.5", "--span-s", "1", "--policy", policy_ref, "--policy-arg", "horizon_s=5",
                 "--cost", "calibrated", "--out", str(out)]) == 0
    assert load_sweep(out)["meta"]["policy_info"] == expected(policy_ref)
