"""`RouterConfig`, `NodeSpec`, `ServedModel` (tokenizer + limits).

Router configuration and the served model (tokenizer plus the limits requests are checked against)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from pdtb.router.cache_route import ROUTES

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class NodeSpec:
    """One configured node: its role and its control (zmq ROUTER) address."""

    role: str  # "prefill" | "decode" | "colocated"
    address: str  # e.g. tcp://127.0.0.1:5555

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"node role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if "://" not in self.address:
            raise ValueError(f"node address must be a zmq endpoint like tcp://host:port, got {self.address!r}")

    @classmethod
    def parse(cls, text: str) -> "NodeSpec":
        """Parse `role=address` (the `--node` flag)."""
        role, sep, address = text.partition("=")
        if not sep:
            raise ValueError(f"--node wants role=address, got {text!r}")
        return cls(role.strip(), address.strip())


@dataclass(frozen=True)
class Fleet:
    """This router's place among the router processes behind one port (SO_REUSEPORT)."""

    index: int = 0  # its place, 0..size-1: index 0 alone runs the pressure and fair rebalancer
    size: int = 1  # router processes behind the port: each sees about 1/size of a client's requests
    peer_dir: str | None = None  # where each publishes its private admin URL (router-I.admin) and reads the others'

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size:
            raise ValueError(f"router index {self.index} out of range for {self.size} router(s)")

    @property
    def admin_file(self) -> str | None:
        """The file this router's private admin URL is written to (None: no peers to reach it)."""
        return None if self.peer_dir is None else str(Path(self.peer_dir) / f"router-{self.index}.admin")


def check_tenant_tiers(tiers: dict) -> None:
    """Refuse a `--tenant-tier` default that is not an SLO tier a request could name."""
    from pdtb.nodes.protocol import SLO_TIER_RE

    for tenant, tier in tiers.items():
        if not tenant or not isinstance(tier, str) or not SLO_TIER_RE.fullmatch(tier):
            raise ValueError(f"--tenant-tier {tenant}={tier}: the tier must be 1-32 characters of letters, "
                             f"digits, '_', '.' or '-' (and the tenant not empty)")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process is configured with. Validated on construction."""

    nodes: tuple[NodeSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks an ephemeral port
    api_key: str | None = None  # when set, /v1/* requires `Authorization: Bearer <key>`
    curve_dir: str | None = None  # ZeroMQ CURVE keys for the node connections (pdtb/security.py)
    request_timeout: float = 600.0  # seconds a request may wait for its next event
    # times a request whose node died is recomputed elsewhere (its prompt plus the tokens already
    # streamed, prefilled anew) before it fails; 0: it fails at once
    recompute_retries: int = 2
    # a request to recompute when no node of a role it needs is healthy waits this long for one
    # (a restarted node, a paused one resumed) before it fails: its stream has begun, so the
    # client cannot simply send it again
    node_wait: float = 30.0
    max_streams_per_tenant: int = 1024  # concurrent requests per tenant (`user`) before 429
    ping_interval: float = 0.5  # seconds between pings to every node
    health_timeout: float = 3.0  # a node silent this long whose connection dropped is down
    # a node silent this long is down even though its connection stands (a hung process, a
    # dead host); until then silence over a live connection is a long step, not a death
    hang_timeout: float = 30.0
    shutdown_timeout: float = 10.0  # grace for in-flight requests on SIGTERM
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    default_page_size: int = 16  # for the pending-pages estimate when a node does not report one
    tenant_tiers: dict = field(default_factory=dict)  # tenant -> SLO tier of its requests that name none
    route: str = "load"  # how the prefill/colocated node is chosen: "load", "cache" (pdtb/router/cache_route.py) or "d2lpm" (fair_route.py)
    rebalance: str = "off"  # live migration between decode nodes: "off" | "pressure" | "fair" (pdtb/router/rebalance.py)
    allow_fault_injection: bool = False  # /admin/migrate may name a fault to inject (tests, chaos runs)
    reuse_port: bool = False  # bind the port with SO_REUSEPORT: several router processes share it
    fleet: Fleet = field(default_factory=Fleet)  # the router processes behind the port (pdtb/router/peers.py)
    metrics_dir: str | None = None  # prometheus_client's multiprocess directory: /metrics sums every router's
    # a stream's chunk carries this many tokens (the first token and the last chunk go at once),
    # vLLM's --stream-interval: fewer writes and wake-ups per token, burstier inter-token gaps
    stream_interval: int = 1

    @property
    def own_rebalance(self) -> str:
        """The rebalance mode this process runs: the configured one on router 0; drains only on
        the others, so that pressure and fair moves are planned once, as with one router."""
        return self.rebalance if self.fleet.index == 0 else "off"

    def __post_init__(self) -> None:
        check_tenant_tiers(self.tenant_tiers)
        if not (isinstance(self.stream_interval, int) and self.stream_interval >= 1):
            raise ValueError(f"--stream-interval must be an integer >= 1, got {self.stream_interval!r}")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if not self.nodes:
            raise ValueError("at least one --node is required")
        roles = {n.role for n in self.nodes}
        if "colocated" not in roles and not {"prefill", "decode"} <= roles:
            raise ValueError("configure prefill and decode nodes (disaggregated) or colocated nodes")
        if len({n.address for n in self.nodes}) != len(self.nodes):
            raise ValueError("node addresses must be distinct")
        if self.recompute_retries < 0:
            raise ValueError("recompute_retries must be >= 0")
        if not 0 <= self.node_wait < float("inf"):
            raise ValueError("node_wait must be >= 0 and finite")
        for name in ("request_timeout", "ping_interval", "health_timeout", "hang_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.hang_timeout < self.health_timeout:
            raise ValueError("hang_timeout must be at least health_timeout")
        if self.max_streams_per_tenant < 1 or self.max_body_bytes < 1 or self.default_page_size < 1:
            raise ValueError("max_streams_per_tenant, max_body_bytes and default_page_size must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")


@dataclass(frozen=True)
class ServedModel:
    """The model the router serves: name, tokenizer and the limits prompts are validated against."""

    name: str  # the `model` clients must send
    tokenizer: object = field(repr=False)  # a HF tokenizer
    max_model_len: int  # prompt + output tokens at most
    vocab_size: int  # valid token ids are [0, vocab_size)
    eos_token_ids: tuple[int, ...] = ()
    max_token_chars: int | None = None  # longest vocabulary entry (None: unknown)
    chat_template: object = field(default=None, repr=False)  # pdtb.router.chat_template.ChatTemplate, or None

    @property
    def max_prompt_chars(self) -> int | None:
        """A text longer than this cannot fit the context: each token covers at most
        `max_token_chars` characters. Checked before tokenizing, which takes seconds for MBs."""
        return None if self.max_token_chars is None else self.max_model_len * self.max_token_chars


def max_token_chars(tokenizer) -> int | None:
    """Characters of the longest vocabulary entry, added tokens included. In byte-level BPE
    vocabularies a character stands for one byte, so this also bounds the text of a token."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    return max((len(t) for t in vocab), default=None)


def load_served_model(model_dir: str, name: str | None = None, chat_template: str | None = None) -> ServedModel:
    """Read the tokenizer, config and chat template of `model_dir` (no weights). The name
    defaults to the directory's base name; `chat_template` (a file or the template text)
    overrides the checkpoint's template."""
    from pdtb.engine.model_info import read_model_info
    from pdtb.engine.tokenizer import load_tokenizer
    from pdtb.router.chat_template import load_chat_template

    logging.getLogger("transformers").setLevel(logging.ERROR)
    info = read_model_info(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos = info.eos_token_ids
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos = eos + (tokenizer.eos_token_id,)
    return ServedModel(name or Path(model_dir).name, tokenizer, info.max_model_len, info.vocab_size, eos,
                       max_token_chars(tokenizer), load_chat_template(model_dir, chat_template))
