"""kv_transport/torch_ranks.py on torch itself (2.13.0): a rank's token is published in the
group's store, its sockets' routing ids carry it, and only they speak for the rank; a group
made anew gets a new token."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from kv_transport import torch_ranks


@pytest.fixture
def group():
    """A one-rank gloo group over a TCPStore on an ephemeral port."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_routing_ids_carry_the_token_the_rank_published(group):
    a, b = torch_ranks.routing_id(), torch_ranks.routing_id()
    assert a != b and a[:torch_ranks.TOKEN_BYTES] == b[:torch_ranks.TOKEN_BYTES]
    assert a[0] != 0 and len(a) <= 255  # libzmq: an id starting with 0 is its own; at most 255 bytes
    # in the group's store, where another rank reads it (tests/transport/test_transport_procs.py
    # has a second process do so)
    from torch.distributed import distributed_c10d
    assert distributed_c10d._get_default_store().get("pdtb-kv/peer/0") == a[:torch_ranks.TOKEN_BYTES]


def test_only_the_ranks_own_sockets_speak_for_it(group):
    mine = torch_ranks.routing_id()
    assert torch_ranks.known_verdict(mine, 0) is None  # not looked up yet
    assert torch_ranks.speaks_for(mine, 0)
    assert torch_ranks.known_verdict(mine, 0) and torch_ranks.known_verdict(b"\x01" * len(mine), 0) is False
    assert not torch_ranks.speaks_for(b"\x01" * len(mine), 0)  # someone else's id
    assert not torch_ranks.speaks_for(mine[:4], 0)  # too short to carry a token
    assert not torch_ranks.speaks_for(None, 0)
    assert not torch_ranks.speaks_for(mine, 1)  # a rank that published nothing


def test_a_group_made_anew_gets_a_new_token(group):
    first = torch_ranks.routing_id()[:torch_ranks.TOKEN_BYTES]
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    again = torch_ranks.routing_id()
    assert again[:torch_ranks.TOKEN_BYTES] != first and torch_ranks.speaks_for(again, 0)
