"""Configuration of one transport endpoint: one frozen dataclass, validated on construction.

Per-instance copies are made with `dataclasses.replace(config, endpoint=...)`. No setting is
read from the environment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20

BACKENDS = ("zmq", "torch", "fake", "shm", "auto")  # shm: one-sided writes (same host); auto: shm, else zmq
CHECKSUMS = ("sum64", "crc32")
# Message kinds a fault can hit (see wire.MsgType): data path of the sender, control of either.
FAULT_KINDS = ("header", "batch", "chunk", "credit", "ack", "nack", "cancel", "grant", "commit")


@dataclass(frozen=True)
class FaultConfig:
    """Faults injected into the messages this endpoint sends (tests and chaos runs only).

    At most one fault hits a message; they are tried in the order of the fields below. The
    random stream is seeded, so a run is reproducible for a given message order.
    """

    drop_prob: float = 0.0  # message is silently not sent
    delay_prob: float = 0.0  # message is sent after `delay_s` (order is kept)
    delay_s: float = 0.0  # the added latency
    duplicate_prob: float = 0.0  # message is sent twice
    corrupt_prob: float = 0.0  # one payload byte is flipped (frame 0 if there is no payload)
    truncate_prob: float = 0.0  # the last frame loses its second half
    disconnect_after_chunks: int | None = None  # after N chunks: drop the link, reconnect (once)
    kinds: tuple[str, ...] = ("header", "batch", "chunk")  # message kinds faults may hit
    max_faults: int | None = None  # stop drawing random faults after this many (None: unlimited); the disconnect is extra
    shm_delay_s: float = 0.0  # shm sender: wait this long after a Grant before writing (a late writer); shm receiver: before reading an offered payload (a late reader)
    shm_stall_s: float = 0.0  # shm sender (receiver): after the first piece, hold the write (read) slot this long, blocked (stalled mid-write, mid-read)
    seed: int = 0  # seed of the fault random stream

    def __post_init__(self) -> None:
        for name in ("drop_prob", "delay_prob", "duplicate_prob", "corrupt_prob", "truncate_prob"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"FaultConfig.{name} must be in [0, 1], got {p}")
        if self.delay_s < 0 or self.shm_delay_s < 0 or self.shm_stall_s < 0:
            raise ValueError("FaultConfig.delay_s, shm_delay_s and shm_stall_s must be >= 0")
        if self.disconnect_after_chunks is not None and self.disconnect_after_chunks < 0:
            raise ValueError("FaultConfig.disconnect_after_chunks must be >= 0")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError("FaultConfig.max_faults must be >= 0")
        bad = [k for k in self.kinds if k not in FAULT_KINDS]
        if bad:
            raise ValueError(f"FaultConfig.kinds has unknown kinds {bad}; known: {FAULT_KINDS}")

    @property
    def enabled(self) -> bool:
        probs = (self.drop_prob, self.delay_prob, self.duplicate_prob, self.corrupt_prob,
                 self.truncate_prob)
        return any(p > 0 for p in probs) or self.disconnect_after_chunks is not None \
            or self.shm_delay_s > 0 or self.shm_stall_s > 0


@dataclass(frozen=True)
class TransportConfig:
    """Settings of a KV sender or receiver. Sizes in bytes, times in seconds."""

    backend: str = "zmq"  # "zmq", "torch" (payload over torch.distributed), "shm", "auto" or "fake"
    endpoint: str = "tcp://127.0.0.1:0"  # receiver binds it (port 0 / ipc://*: ephemeral)
    chunk_bytes: int = 4 * MiB  # large payloads move in chunks of about this size
    window: int = 4  # chunk credits a receiver grants per transfer (chunks in flight)
    inline_max_bytes: int = 256 * 1024  # payloads up to this ride inside the header message
    max_batch: int = 64  # inline transfers packed into one message at most
    max_active_transfers: int = 4  # chunked transfers a sender streams at once
    hwm: int = 64  # ZeroMQ send/receive high-water marks, in messages
    socket_buffer_bytes: int = 0  # kernel SO_SNDBUF/SO_RCVBUF for zmq sockets; 0: OS default
    tune_malloc: bool = True  # receiver: keep freed zmq buffers mapped (see malloc_tuning.py)
    max_message_bytes: int = 8 * MiB  # largest frame/message a receiver accepts
    max_header_bytes: int = 1 * MiB  # largest msgpack header frame a receiver accepts
    max_pages_per_transfer: int = 1 << 16  # receiver refuses larger transfers
    max_tokens: int = 1 << 20  # receiver refuses longer token lists
    checksum: str = "sum64"  # "sum64" (uint64 word sum, fast) or "crc32" (zlib)
    send_timeout_s: float = 5.0  # one socket send may wait this long (HWM full)
    transfer_timeout_s: float = 30.0  # a whole transfer, on both sides
    idle_timeout_s: float = 10.0  # receiver: a started transfer with no progress this long
    tick_s: float = 0.02  # period of timeout checks and of every idle wait
    close_timeout_s: float = 2.0  # close() waits this long for tasks to stop
    history: int = 4096  # finished transfers remembered for poll() and late messages
    faults: FaultConfig = field(default_factory=FaultConfig)
    dist_init_method: str | None = None  # torch backend: init_process_group(init_method=...)
    dist_rank: int = -1  # torch backend: this process's rank (with dist_init_method)
    dist_world_size: int = 0  # torch backend: world size (with dist_init_method)
    dist_backend: str = "auto"  # "auto" (nccl on CUDA pools, else gloo), "gloo" or "nccl"
    curve_dir: str | None = None  # ZeroMQ CURVE keys (see pdtb/security.py); None: no encryption
    # shm receiver: read every one-sided piece back from the pages and check it against the
    # sender's running checksum (False: take the sender's word for it, as an RDMA write does)
    shm_verify: bool = True
    # shm sender: an export gathered into its arena (export_buffer) of this many bytes is
    # offered to the receiver to read itself, one pass that copies and checks (0: no arena)
    shm_arena_bytes: int = 1 << 30
    # shm receiver: read the payloads offered so (False: grant writes for them instead)
    shm_read: bool = True
    # shm backend: once a peer has a Grant, control messages between the two go over a Unix
    # socket read by the event loop (local_link.py) instead of ZeroMQ's I/O threads
    local_link: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"TransportConfig.backend must be one of {BACKENDS}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"TransportConfig.checksum must be one of {CHECKSUMS}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://", "fake://")):
            raise ValueError(f"TransportConfig.endpoint {self.endpoint!r}: need tcp://, ipc://")
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith(("ipc:///",
                                                                                "ipc://@")):
            # libzmq resolves relative ipc paths (and "ipc://*") against each process's cwd
            raise ValueError(f"TransportConfig.endpoint {self.endpoint!r}: ipc needs an "
                             "absolute path (ipc:///run/x.sock) or an abstract name (ipc://@x)")
        for name in ("chunk_bytes", "window", "inline_max_bytes", "max_batch",
                     "max_active_transfers", "hwm", "max_message_bytes", "max_header_bytes",
                     "max_pages_per_transfer", "max_tokens", "history"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransportConfig.{name} must be positive")
        for name in ("send_timeout_s", "transfer_timeout_s", "idle_timeout_s", "tick_s",
                     "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TransportConfig.{name} must be positive")
        if self.shm_arena_bytes < 0 or 0 < self.shm_arena_bytes < 4096:
            raise ValueError("TransportConfig.shm_arena_bytes must be 0 (no arena) or at least 4096")
        if self.socket_buffer_bytes < 0:
            raise ValueError("TransportConfig.socket_buffer_bytes must be >= 0")
        if self.chunk_bytes > self.max_message_bytes:
            raise ValueError("TransportConfig.chunk_bytes must be <= max_message_bytes")
        if self.inline_max_bytes > self.chunk_bytes:
            raise ValueError("TransportConfig.inline_max_bytes must be <= chunk_bytes")
        if self.tick_s > min(self.transfer_timeout_s, self.idle_timeout_s):
            raise ValueError("TransportConfig.tick_s must be <= the transfer and idle timeouts")
        if self.hwm < self.window:
            raise ValueError("TransportConfig.hwm must be >= window (credits must fit the queue)")
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError("TransportConfig.dist_backend must be auto, gloo or nccl")


FAULT_INT_FIELDS = ("disconnect_after_chunks", "max_faults", "seed")


def fault_config_from(numbers: dict[str, float]) -> FaultConfig:
    """A FaultConfig from its numeric fields by name (as a control message carries them);
    ValueError names an unknown field or a value out of range."""
    import dataclasses
    import math

    known = {f.name for f in dataclasses.fields(FaultConfig)} - {"kinds"}
    kw = {}
    for name, v in numbers.items():
        if name not in known:
            raise ValueError(f"unknown fault setting {name!r}; known: {', '.join(sorted(known))}")
        if not math.isfinite(v):
            raise ValueError(f"fault setting {name!r} must be finite, got {v}")
        if name in FAULT_INT_FIELDS:
            if v != int(v):
                raise ValueError(f"fault setting {name!r} must be a whole number, got {v}")
            v = int(v)
        kw[name] = v
    return FaultConfig(**kw)
