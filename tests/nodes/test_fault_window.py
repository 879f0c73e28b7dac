"""A fault window (SetFaults, what POST /admin/faults sends): the node's KV senders, started and
yet to start, inject the faults for `for_s` seconds and then go back to the faults the node was
started with; a message that does not make a FaultConfig changes nothing."""
from __future__ import annotations

import asyncio

import pytest

from async_case import async_test
from kv_transport import FaultConfig
from kv_transport.config import fault_config_from


def test_fault_settings_from_numbers():
    assert fault_config_from({"drop_prob": 0.5, "seed": 3.0}) == FaultConfig(drop_prob=0.5, seed=3)
    for bad, says in (({"nope": 1}, "unknown fault setting"), ({"drop_prob": 2}, r"must be in \[0, 1\]"),
                      ({"seed": 1.5}, "whole number"), ({"delay_s": float("inf")}, "finite")):
        with pytest.raises(ValueError, match=says):
            fault_config_from(bad)


@async_test
async def test_a_fault_window_reaches_every_sender_and_ends(llama_dir):
    from pdtb.engine.config import EngineConfig
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import SetFaults, decode_message, encode_message
    from prefill_node.node import PrefillNode

    base = FaultConfig(delay_prob=0.1, delay_s=0.01)
    node = PrefillNode(NodeConfig("prefill", "p0", EngineConfig(llama_dir, num_pages=32), transport_faults=base))
    try:
        early = await node.senders.get("tcp://127.0.0.1:1")  # started before the window (never connects)
        msg = decode_message(encode_message(SetFaults({"drop_prob": 1.0}, 0.2)))  # as it travels
        node._on_message(b"r1", msg)
        late = await node.senders.get("tcp://127.0.0.1:2")  # started within it
        for s in (early, late):
            assert s.config.faults == FaultConfig(drop_prob=1.0) and s.faults.decide("chunk") is not None
        node._on_message(b"r1", SetFaults({"bogus": 1.0}, 5.0))  # refused: the window stays as it was
        node._on_message(b"r1", SetFaults({"drop_prob": 0.5}, 0.0))  # refused: no end
        assert early.config.faults == FaultConfig(drop_prob=1.0)
        ended = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, ended.set)  # (after the window's timer, 0.2 s)
        await ended.wait()
        for s in (early, late, await node.senders.get("tcp://127.0.0.1:3")):
            assert s.config.faults == base
    finally:
        await node.senders.close()
        node.ctx.destroy(linger=0)
