"""KV transport: moves exported KV pages from a prefill node into a decode node's pool.

Public API (see base.py for the interface, README.md for the wire format and backends):

    make_sender(config, spec, **kw) -> KVSender      make_receiver(config, pool, **kw) -> KVReceiver
    TransportConfig, FaultConfig, TransferMeta, TransferState, TransferStatus, ReceivedTransfer
    Admission, Verdict, FailCode (admission.py: what the receiving node answers, why a transfer failed)
"""
from __future__ import annotations

from kv_transport.admission import Admission, FailCode, Verdict
from kv_transport.base import (KVReceiver, KVSender, ReceivedTransfer, TransferMeta,
                               TransferState, TransferStatus, TransportError)
from kv_transport.config import FaultConfig, TransportConfig
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

__all__ = ["make_sender", "make_receiver", "TransportConfig", "FaultConfig", "TransferMeta",
           "TransferState", "TransferStatus", "ReceivedTransfer", "TransportError",
           "KVSender", "KVReceiver", "Admission", "FailCode", "Verdict"]


def make_sender(config: TransportConfig, spec: KVSpec, **kwargs) -> KVSender:
    """A sender for `config.backend` ("fake" needs network=FakeNetwork)."""
    if config.backend == "zmq":
        from kv_transport.zmq_backend import ZmqSender
        return ZmqSender(config, spec, **kwargs)
    if config.backend in ("shm", "auto"):
        from kv_transport.shm_backend import ShmSender
        return ShmSender(config, spec, **kwargs)
    if config.backend == "torch":
        from kv_transport.torch_backend import TorchSender
        return TorchSender(config, spec, **kwargs)
    from kv_transport.fake import FakeSender
    return FakeSender(config, spec, **kwargs)


def make_receiver(config: TransportConfig, pool: PagePool, **kwargs) -> KVReceiver:
    """A receiver for `config.backend` writing into `pool` (kwargs: admit=, network=)."""
    if config.backend == "zmq":
        from kv_transport.zmq_backend import ZmqReceiver
        return ZmqReceiver(config, pool, **kwargs)
    if config.backend in ("shm", "auto"):
        from kv_transport.shm_backend import ShmReceiver
        return ShmReceiver(config, pool, **kwargs)
    if config.backend == "torch":
        from kv_transport.torch_backend import TorchReceiver
        return TorchReceiver(config, pool, **kwargs)
    from kv_transport.fake import FakeReceiver
    return FakeReceiver(config, pool, **kwargs)
