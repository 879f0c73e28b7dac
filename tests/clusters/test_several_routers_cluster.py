"""Two router processes behind one port (`launch_cluster.sh --routers 2 --restart-failed`, real
processes on loopback, 1 prefill + 2 decode nodes): greedy outputs equal transformers.generate
and both routers serve some of them; /metrics from either is the sum of both; a migration asked
of the router that does not hold the request is forwarded to the one that does; a drain asked
through the shared port moves the requests of both routers off the node; a killed router is
restarted on the shared port, and a killed node's replacement is added to both routers; the stop
leaves no process. See docs/cluster.md, "Several routers"."""
from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import pytest

from chaos_util import prompt
from cluster_util import alive, get_json, kill9, launched, router_healthy, vocab_of, wait_until
from conftest import assert_greedy_matches, hf_greedy
from pdtb.client.sse import SSEParser
from pdtb.router.peers import ROUTER_HEADER

pytestmark = pytest.mark.slow
END_S = 120.0  # every stream ends within this bound


@dataclass
class Routed:
    """One streamed completion, with the router process that served it."""

    router: str = ""  # X-Pdtb-Router of the response
    request_id: str = ""  # the router's request id (the chunks' id)
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    done: bool = False  # data: [DONE] came
    error: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)  # three tokens arrived

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


async def stream(http: aiohttp.ClientSession, url: str, prompt_ids: list[int], max_tokens: int,
                 out: Routed | None = None) -> Routed:
    """One streamed completion into `out` (the caller may watch it while it runs)."""
    out = out or Routed()
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0}
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            out.status, out.router = resp.status, resp.headers.get(ROUTER_HEADER, "")
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                for data in parser.feed(chunk):
                    read_event(out, data)
    finally:
        out.started.set()  # (ended: whoever waits for its start stops waiting)
    return out


def read_event(out: Routed, data: str) -> None:
    if data == "[DONE]":
        out.done = True
        return
    obj = json.loads(data)
    out.request_id = out.request_id or obj.get("id", "")
    out.error = out.error or (obj.get("error") or {}).get("message")
    for ch in obj.get("choices") or []:
        out.token_ids += ch.get("token_ids") or []
    if len(out.token_ids) >= 3:
        out.started.set()


def fresh_connections() -> aiohttp.ClientSession:
    """A client that opens a new connection per request: the kernel gives each to one of the routers."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=END_S + 60, sock_read=END_S),
                                 connector=aiohttp.TCPConnector(force_close=True, limit=0))


def admin_urls(run_dir) -> list[str]:
    return [(run_dir / f"router-{i}.admin").read_text().strip() for i in range(2)]


def router_info(url: str) -> dict:
    return get_json(f"{url}/router")


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def requests_ok(url: str) -> float:
    m = re.search(r'^pdtb_router_requests_total\{status="200"\} (\S+)$', urllib.request.urlopen(
        f"{url}/metrics", timeout=10).read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


async def streams(url: str, prompts: list[list[int]], max_tokens: int) -> list[Routed]:
    async with fresh_connections() as http:
        return await asyncio.wait_for(asyncio.gather(*(stream(http, url, p, max_tokens) for p in prompts)), END_S)


@pytest.fixture(scope="module")
def two_routers(llama_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("routers")
    with launched(run_dir, llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2", "--routers", "2",
                  "--kv-pages", "800", "--restart-failed") as (url, rd):
        yield url, rd
        pids = [int(p.read_text()) for p in rd.glob("*.pid")]
    assert not [p for p in pids if alive(p)], "processes left after stop_cluster.sh"
    assert not list(run_dir.glob("router-*.admin"))  # each router removed its own at its stop


def test_outputs_equal_generate_and_both_routers_serve(two_routers, hf_models):
    url, run_dir = two_routers
    admin = admin_urls(run_dir)
    rng = random.Random(1)
    prompts = [prompt(vocab_of(url), rng.choice((5, 30, 90)), rng) for _ in range(24)]
    before = requests_ok(url)
    outs = asyncio.run(streams(url, prompts, 8))
    assert all(o.ok for o in outs), [o for o in outs if not o.ok][:3]
    assert [o.token_ids for o in outs] == [hf_greedy(hf_models["llama"], p, 8, ignore_eos=True) for p in prompts]
    ids = {info["router_id"]: info["requests_submitted"] for info in map(router_info, admin)}
    assert len(ids) == 2 and all(n > 0 for n in ids.values()), ids  # each process dispatched some
    assert {o.router for o in outs} == set(ids)  # and answered its clients itself
    # /metrics, from either router, is the sum over both (prometheus_client's multiprocess mode)
    wait_until(lambda: requests_ok(admin[0]) - before == len(prompts) == requests_ok(admin[1]) - before, 10,
               what="both routers' /metrics to count every request")


def holder_of(url: str, request_id: str) -> str | None:
    """The decode node whose stats list `request_id` as decoding there."""
    return next((n["id"] for n in get_json(f"{url}/cluster") if n["role"] == "decode"
                 and any(r[0] == request_id for r in n["extra"].get("requests", []))), None)


def test_a_migration_asked_of_the_other_router_is_forwarded_to_the_one_holding_the_request(two_routers, hf_models):
    url, run_dir = two_routers
    by_id = {router_info(a)["router_id"]: a for a in admin_urls(run_dir)}
    p = prompt(vocab_of(url), 20, random.Random(2))

    async def scenario():
        async with fresh_connections() as http:
            routed = Routed()
            task = asyncio.ensure_future(stream(http, url, p, 1000, routed))
            await asyncio.wait_for(routed.started.wait(), END_S)
            source = await asyncio.to_thread(wait_until, lambda: holder_of(url, routed.request_id), 10,
                                             what="the request listed by its decode node")
            other = next(a for rid, a in by_id.items() if rid != routed.router)
            target = "decode-1" if source == "decode-0" else "decode-0"
            ask = {"request_id": routed.request_id, "to": target}
            answer = await asyncio.to_thread(post, other, "/admin/migrate", ask)
            await asyncio.wait_for(task, END_S)
            return routed, answer, target

    routed, (status, body), target = asyncio.run(scenario())
    assert status == 202 and body["target"] == target, body
    assert routed.ok
    assert_greedy_matches(hf_models["llama"], p, routed.token_ids, 1000)  # (a tie may fall either way past the move)
    owner = by_id[routed.router]
    # 1,000 tokens leave the move time to finish before the request does, on a loaded machine too
    ended = wait_until(lambda: [m for m in get_json(f"{owner}/cluster/migrations")["done"]
                                if m["request_id"] == routed.request_id], 10, what="the migration ended")
    assert ended[0]["state"] == "done", ended
    other = next(a for rid, a in by_id.items() if rid != routed.router)
    assert router_info(other)["forwarded"] == {"/admin/migrate": 1}


def test_a_drain_through_the_shared_port_moves_both_routers_requests(two_routers, hf_models):
    """Streams of both routers decode on decode-0; a drain of decode-0 reaches one router over
    the shared port. The node reports draining to both, and each moves its own requests to
    decode-1: every stream ends with generate's tokens, decode-0 holds none, and both routers
    count drain migrations of their own."""
    url, run_dir = two_routers
    by_id = {router_info(a)["router_id"]: a for a in admin_urls(run_dir)}
    rng = random.Random(3)
    prompts = [prompt(vocab_of(url), 24, rng) for _ in range(10)]

    def on_decode_0(outs: list[Routed]) -> set[str]:
        d0 = next(n for n in get_json(f"{url}/cluster") if n["id"] == "decode-0")
        listed = {r[0] for r in d0["extra"].get("requests", [])}
        return {o.router for o in outs if o.request_id in listed}

    async def scenario():
        async with fresh_connections() as http:
            outs = [Routed() for _ in prompts]
            tasks = [asyncio.ensure_future(stream(http, url, p, 400, o)) for p, o in zip(prompts, outs)]
            await asyncio.wait_for(asyncio.gather(*(o.started.wait() for o in outs)), END_S)
            await asyncio.to_thread(wait_until, lambda: on_decode_0(outs) == set(by_id), 20,
                                    what="requests of both routers decoding on decode-0")
            answer = await asyncio.to_thread(post, url, "/admin/drain", {"node": "decode-0"})
            await asyncio.wait_for(asyncio.gather(*tasks), END_S)
            return outs, answer

    outs, (status, _) = asyncio.run(scenario())
    assert status == 202
    assert all(o.ok for o in outs), [o for o in outs if not o.ok][:3]
    assert [o.token_ids for o in outs] == [hf_greedy(hf_models["llama"], p, 400, ignore_eos=True) for p in prompts]
    for rid, admin in by_id.items():
        drained = [m for m in get_json(f"{admin}/cluster/migrations")["done"]
                   if m["reason"] == "drain" and m["state"] == "done"]
        assert drained and all(m["source"] == "decode-0" for m in drained), (rid, drained)
    d0 = next(n for n in get_json(f"{url}/cluster") if n["id"] == "decode-0")
    assert d0["draining"] and d0["running"] == 0


def test_a_killed_router_comes_back_on_the_port_and_a_replacement_node_joins_both(two_routers):
    """router-1 killed: the supervisor starts it again beside router-0 on the shared port.
    decode-0 (drained above) killed: its replacement decode-0~1 is added to both routers, each
    at its own admin address, and both send it work."""
    url, run_dir = two_routers
    old = kill9(run_dir, "router-1")
    wait_until(lambda: (run_dir / "router-1.pid").read_text().strip() != str(old)
               and (run_dir / "router-1.admin").exists() and router_healthy(admin_urls(run_dir)[1]), 120,
               what="router-1 restarted and healthy")
    assert router_info(admin_urls(run_dir)[1])["index"] == 1
    kill9(run_dir, "decode-0")

    def listed_healthy(admin: str) -> bool:
        return any(n["id"] == "decode-0~1" and n["healthy"] for n in get_json(f"{admin}/cluster"))

    wait_until(lambda: all(listed_healthy(a) and router_healthy(a) for a in admin_urls(run_dir)), 180,
               what="decode-0~1 listed healthy by both routers, decode-0 retired")
    rng = random.Random(4)
    outs = asyncio.run(streams(url, [prompt(vocab_of(url), 12, rng) for _ in range(12)], 6))
    assert all(o.ok and len(o.token_ids) == 6 for o in outs), [o for o in outs if not o.ok][:3]
    assert len({o.router for o in outs}) == 2
