"""KV transport: moves exported KV pages from a prefill node into a decode node's pool.

Public API (see base.py for the interface, README.md for the wire format and backends):

    make_sender(config, spec, **kw) -> KVSender      make_receiver(config, pool, **kw) -> KVReceiver
    TransportConfig, FaultConfig, TransferMeta, TransferState, TransferStatus, ReceivedTransfer
    Admission, Verdict (admission.py: what the receiving node answers to a transfer header)
    FailCode (fail_codes.py: why a transfer failed)
"""
from __future__ import annotations

import importlib

from kv_transport.admission import Admission, Verdict
from kv_transport.base import (KVReceiver, KVSender, ReceivedTransfer, TransferMeta,
                               TransferState, TransferStatus, TransportError)
from kv_transport.config import FaultConfig, TransportConfig
from kv_transport.fail_codes import FailCode
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

__all__ = ["make_sender", "make_receiver", "TransportConfig", "FaultConfig", "TransferMeta",
           "TransferState", "TransferStatus", "ReceivedTransfer", "TransportError",
           "KVSender", "KVReceiver", "Admission", "FailCode", "Verdict"]


# backend name -> (module, sender class, receiver class); each registered once, imported on use
BACKEND_CLASSES = {
    "zmq": ("kv_transport.zmq_backend", "ZmqSender", "ZmqReceiver"),
    "shm": ("kv_transport.shm_backend", "ShmSender", "ShmReceiver"),  # shm_sender.py, shm_receiver.py
    "auto": ("kv_transport.shm_backend", "ShmSender", "ShmReceiver"),  # shm where it can map, zmq chunks elsewhere
    "torch": ("kv_transport.torch_backend", "TorchSender", "TorchReceiver"),
    "fake": ("kv_transport.fake", "FakeSender", "FakeReceiver"),  # in-process, for tests (network=FakeNetwork)
}


def _backend_class(backend: str, end: int):
    if backend not in BACKEND_CLASSES:
        raise ValueError(f"unknown KV transport backend {backend!r}; one of {', '.join(BACKEND_CLASSES)}")
    module, *classes = BACKEND_CLASSES[backend]
    return getattr(importlib.import_module(module), classes[end])


def make_sender(config: TransportConfig, spec: KVSpec, **kwargs) -> KVSender:
    """A sender for `config.backend` ("fake" needs network=FakeNetwork)."""
    return _backend_class(config.backend, 0)(config, spec, **kwargs)


def make_receiver(config: TransportConfig, pool: PagePool, **kwargs) -> KVReceiver:
    """A receiver for `config.backend` writing into `pool` (kwargs: admit=, network=)."""
    return _backend_class(config.backend, 1)(config, pool, **kwargs)
