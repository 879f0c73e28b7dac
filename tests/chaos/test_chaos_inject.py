"""The injector's guard for nodes that are not restarted (a torch-transport cluster's): a kill or
drain goes ahead while another node of its role is healthy, and is skipped, saying why, when
it would leave the role empty for good; a restartable node is never held back."""
from __future__ import annotations

import pathlib

from aiohttp import web

from app_thread import app_in_thread
from pdtb.chaos.inject import Injector


def argv_file(run_dir: pathlib.Path, name: str, *words: str) -> None:
    (run_dir / f"{name}.argv").write_bytes(b"".join(w.encode() + b"\0" for w in words))


def cluster_app(nodes: list[dict]) -> web.Application:
    async def cluster(_request):
        return web.json_response(nodes)

    app = web.Application()
    app.router.add_get("/cluster", cluster)
    return app


def node(nid: str, healthy: bool = True) -> dict:
    return {"id": nid, "role": nid.rsplit("-", 1)[0].split("~")[0], "healthy": healthy}


def test_the_last_healthy_node_of_a_role_that_would_not_come_back_is_spared(tmp_path):
    torch = ("python", "-m", "pdtb", "node", "--role", "decode", "--transport", "torch", "--dist-rank", "2")
    argv_file(tmp_path, "decode-0", *torch)
    argv_file(tmp_path, "decode-1", *torch[:-1], "3")
    argv_file(tmp_path, "prefill-0", "python", "-m", "pdtb", "node", "--role", "prefill")
    for nodes, ended, target, spared in [
        ([node("decode-0"), node("decode-1")], (), "decode-0", False),  # the other one serves on
        ([node("decode-0"), node("decode-1", healthy=False)], (), "decode-0", True),
        ([node("decode-0")], (), "decode-0", True),  # decode-1 gone from the list
        ([node("decode-1"), node("decode-0~1")], (), "decode-0", False),  # (a restarted id of another node)
        ([node("prefill-0")], (), "prefill-0", False),  # restartable: its supervisor brings it back
        ([node("decode-0"), {**node("decode-1"), "draining": True}], (), "decode-0", True),  # leaving
        ([node("decode-0"), node("decode-1")], ("decode-1",), "decode-0", True),  # ended here, not yet noticed
    ]:
        with app_in_thread(cluster_app(nodes)) as url:
            inj = Injector(url, tmp_path, load=None, seed=1)
            inj.ended.update(ended)
            why = inj.last_of_its_role(target)
        assert (why is not None) is spared, (nodes, target, why)
        if spared:
            assert why.startswith("the last healthy decode node") and "cannot rejoin" in why
