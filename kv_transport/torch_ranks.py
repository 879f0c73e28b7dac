"""A torch.distributed rank bound to the ZeroMQ peers that speak for it.

A torch-backend header names its sender's rank (`src_rank`) and the receiver posts its recv for
that rank. Each process publishes a random token under its rank in the process group's own
store (the one every rank joined through) and starts its DEALER sockets' routing ids with it;
a receiver takes a header's `src_rank` only from a peer whose routing id starts with that
rank's token. A peer let onto the control plane (CURVE keys and all) that is not that rank
cannot speak for it. The store is torch's own: whoever can reach it is in the group's trust.

torch internals, here only: `distributed_c10d._get_default_store()` (the store
init_process_group made or was given). Checked on torch 2.13.0 (tests/transport/test_torch_ranks.py).
"""
from __future__ import annotations

import itertools
import secrets

import torch.distributed as dist
from torch.distributed import distributed_c10d

TOKEN_BYTES = 16
_KEY = "pdtb-kv/peer/{}"
_published: dict = {}  # "store", "token": this process's token in the current group's store
_known: dict = {"store": None, "tokens": {}}  # the current group's store; rank -> its token
_ids = itertools.count()


def _store():
    return distributed_c10d._get_default_store()


def _token() -> bytes:
    """This rank's token, published in the group's store the first time it is asked for (a
    round trip: TorchSender.start asks off the event loop, before any socket needs it)."""
    store = _store()
    if _published.get("store") is not store:
        # the first byte is not 0: libzmq keeps routing ids that start with 0 for its own
        token = bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(TOKEN_BYTES - 1)
        store.set(_KEY.format(dist.get_rank()), token)
        _published.update(store=store, token=token)
    return _published["token"]


def routing_id() -> bytes:
    """A fresh routing id for a DEALER socket of this rank (unique: a ROUTER refuses a second
    connection under an id in use)."""
    return _token() + next(_ids).to_bytes(8, "big")


def _tokens() -> tuple:
    """(the current group's store, the ranks' tokens looked up in it); the store is held, so
    that `is` stays sound."""
    store = _store()
    if _known["store"] is not store:
        _known.update(store=store, tokens={})
    return store, _known["tokens"]


def known_verdict(peer: bytes | None, rank: int) -> bool | None:
    """speaks_for's answer where it needs no store lookup (a rank seen before); else None."""
    if peer is None or len(peer) < TOKEN_BYTES:
        return False
    token = _tokens()[1].get(rank)
    return None if token is None else peer[:TOKEN_BYTES] == token


def speaks_for(peer: bytes | None, rank: int) -> bool:
    """Whether the ZeroMQ peer `peer` (its routing id) is one of `rank`'s sockets. Blocking: a
    store lookup the first time a rank is asked about (run it off the event loop)."""
    if (known := known_verdict(peer, rank)) is not None:
        return known
    store, tokens = _tokens()
    key = _KEY.format(rank)
    if not store.check([key]):
        return False  # that rank published nothing: no pdtb sender there yet
    tokens[rank] = store.get(key)
    return peer[:TOKEN_BYTES] == tokens[rank]
