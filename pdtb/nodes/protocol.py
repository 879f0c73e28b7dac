"""Control-plane messages between the router and the nodes (ZeroMQ, msgpack, no pickle).

Sockets: every node binds one ROUTER socket (its control address); the router connects one
DEALER per node with identity `router_id`. Requests flow router -> node; events flow node ->
router on the same connection. The decode node learns the router identity from the
request's `router_id`, carried through the KV transfer.

    router --GenerateRequest--> prefill | colocated
    router --AbortRequest-----> any node
    router --Ping-------------> any node     --NodeStats--> router
    router --NodeDown---------> prefill      (a decode node stopped answering: move hand-offs off it)
    router --Migrate----------> decode       (move one decoding request to another decode node)
    router --Drain------------> any node     (refuse new work; a decode node's requests are moved away)
    router --SetFaults--------> any node     (chaos runs: faults on the node's KV sends for a while)
    node   --TokenBatch-------> router       (first token from prefill, the rest from decode, and
                                              HandoffNotices: moved to a fallback, delivered; see handoff.py;
                                              MigrationReports: how a move between decode nodes ended)

Every message is one frame: a msgpack map with "type" (class name) and "v" (PROTOCOL_VERSION).
`decode_message` validates type, version and every field's type before building the dataclass
and raises ProtocolError naming the field otherwise.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Callable

import msgpack

from pdtb.engine.timeline import Earlier, Timeline

PROTOCOL_VERSION = 1
MAX_CONTROL_BYTES = 64 << 20  # a request carries its prompt ids: up to millions of tokens
SLO_TIER_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # an SLO tier's name ("" on the wire: none)


class ProtocolError(ValueError):
    """A control message that cannot be trusted; `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class Params:
    """Sampling parameters as they travel (mirror of pdtb.engine.sequence.SamplingParams)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # output index of this request's first token: a request recomputed after the router already
    # streamed N of its tokens samples as tokens N, N+1, ... (seeded sampling goes on unchanged)
    first_index: int = 0


@dataclass
class Target:
    """A decode node a hand-off may go to."""

    node_id: str
    kv_addr: str  # its KV transport endpoint


@dataclass
class HandoffMeta:
    """What a KV hand-off tells the decode node about its request beyond tokens and tenant.
    Travels in TransferMeta.extra (`to_extra`), sealed by pdtb.nodes.kv_meta; read back with
    `handoff_meta` (ProtocolError when it does not validate)."""

    router_id: str  # DEALER identity the decode node sends events to
    params: Params
    priority: int = 0
    timeline: Timeline = field(default_factory=Timeline)  # stamps and waits so far
    attempts: int = 0  # transfers started for it before this one
    fallbacks: list[Target] = field(default_factory=list)  # decode nodes after this one, in order
    slo_tier: str = ""  # the request's SLO tier ("": none; absent from older senders)
    # live migration between decode nodes (decode_node/migration.py): "" for a hand-off from
    # prefill, "precopy" (full pages, staged at the target while the source decodes on), "final"
    # (the rest; the source has paused the request)
    migration: str = ""
    migration_id: str = ""
    migration_from: str = ""  # node id of the source decode node
    paused_at: float = 0.0  # wall clock: the source stopped stepping the request (final)
    precopy_bytes: int = 0  # payload bytes the precopy moved (final)
    precopy_s: float = 0.0  # seconds the precopy took (final)
    inject: str = ""  # a fault the target injects on purpose (decode_node/migration.py; tests)
    age_s: float = 0.0  # seconds since the request arrived at the source (keeps its age for victim choice)


@dataclass
class HandoffNotice:
    """Node -> router, not output: the hand-off of `request_id` goes to decode node
    `decode_node` now (prefill node: moved to a fallback), or `delivered`: its KV landed there
    (prefill node: the transfer ended DONE; decode node: it adopted the KV and holds it)."""

    request_id: str
    decode_node: str
    delivered: bool = False
    # a decode node that adopted a migrated request: the migration, and the output tokens the
    # request had when the source paused it (the router has them all, or they are on their way)
    migration_id: str = ""
    output_tokens: int = -1


@dataclass
class MigrationReport:
    """Node -> router: how a migration ended at the source (`ok`: the target confirmed, the
    source freed the pages; else the request goes on at the source, or failed with `reason`),
    or, from the target (`downtime_s` > 0), the pause the request saw: from the source's last
    step to the target's first token."""

    migration_id: str
    request_id: str
    source: str
    target: str
    ok: bool
    reason: str = ""
    phase: str = ""  # where it ended: "precopy" | "final" | "resumed"
    precopy_bytes: int = 0
    final_bytes: int = 0
    precopy_s: float = 0.0
    final_s: float = 0.0  # the final transfer's time (part of the downtime)
    downtime_s: float = 0.0
    pages: int = 0  # pages the request held when it moved
    output_tokens: int = -1  # ok: output tokens the request had when the source paused it


# the steps of a live migration a `Migrate` may make fail on purpose (decode_node/migration.py)
MIGRATE_INJECT = ("lose_precopy", "lose_final", "refuse_final", "target_exits", "exit_after_final")


@dataclass
class Migrate:
    """Router -> the decode node holding `request_id`: move it to `target` (live migration)."""

    request_id: str
    migration_id: str
    target: Target
    reason: str = ""
    inject: str = ""  # make one step fail on purpose (one of MIGRATE_INJECT; tests, chaos runs)
    target_prefix_ns: str = ""  # the target's page-hash namespace ("": no prefix cache: no precopy to stage by)


@dataclass
class Drain:
    """Router -> a node: refuse new work from now on (its requests are moved away or finish)."""

    reason: str = ""


@dataclass
class SetFaults:
    """Router -> a node (routers started with --allow-fault-injection only): inject these faults
    into the node's outgoing KV transport messages for `for_s` seconds, then go back to the
    faults it was started with. `faults` holds kv_transport FaultConfig fields by name."""

    faults: dict[str, float] = field(default_factory=dict)
    for_s: float = 0.0


@dataclass
class GenerateRequest:
    request_id: str  # unique per router
    prompt_token_ids: list[int]
    params: Params
    tenant: str = "default"  # OpenAI `user`
    priority: int = 0  # lower runs first
    slo_tier: str = ""  # SLO tier: the request's, else its tenant's default at the router ("": none)
    router_id: str = ""  # DEALER identity events go back to
    decode_node: str = ""  # disaggregated: node id of the chosen decode node
    decode_kv_addr: str = ""  # disaggregated: KV transport endpoint of that node
    # disaggregated: other decode nodes the prefill node may hand the request to, in order, when
    # the chosen one cannot take it (draining, dead, full)
    fallbacks: list[Target] = field(default_factory=list)
    arrival_time: float = 0.0  # router wall-clock time.time() when the request arrived
    earlier: Earlier | None = None  # recomputed after a node loss: what its lost attempts took


@dataclass
class AbortRequest:
    request_id: str
    reason: str = "aborted by client"
    # The router ended the request itself (a stop string matched): the node holding it answers
    # with a final event, finish_reason "stop", carrying its timeline (pdtb_timing) as a node-
    # finished request's last event does, instead of dropping it silently.
    final: bool = False


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]  # new tokens since the last event
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None  # why it failed, when finish_reason == "error"
    timing: dict = field(default_factory=dict)  # server timeline (final event), seconds
    retry: bool = False  # failed before any work (a draining node refused it): another node may take it
    # prompt tokens whose KV the request's first prefill took from the prefix cache (not computed);
    # set on the event with its first output token, which the node that computed the prompt sends
    # (prefill or colocated, never decode): the router reads it there, with no hand-off field
    cached_tokens: int = 0


@dataclass
class TokenBatch:
    """One flush of a node's events to one router; notices are applied before the events."""

    node_id: str
    events: list[TokenEvent]
    notices: list[HandoffNotice] = field(default_factory=list)
    migrations: list[MigrationReport] = field(default_factory=list)


@dataclass
class Ping:
    seq: int
    router_id: str = ""
    # the pool's other decode and colocated nodes as the router last saw them (fairness/cluster.py):
    # their device pages in all, and each tenant's device pages there; 0: no other node
    other_pages: int = 0
    elsewhere: dict[str, int] = field(default_factory=dict)


@dataclass
class NodeDown:
    """Router -> prefill nodes: decode node `node_id` stopped answering; hand-offs bound to it
    move to their fallbacks (or fail) now, instead of at their transfer timeout."""

    node_id: str
    reason: str = ""


@dataclass
class NodeStats:
    node_id: str
    role: str  # "prefill" | "decode" | "colocated"
    seq: int  # echoes Ping.seq
    pages_total: int
    pages_free: int
    host_pages_total: int = 0
    host_pages_free: int = 0
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0  # prompt tokens not yet prefilled
    kv_addr: str = ""  # KV transport endpoint (decode nodes)
    metrics_addr: str = ""  # http://host:port/metrics
    draining: bool = False
    extra: dict = field(default_factory=dict)
    incarnation: str = ""  # random per process start: a change means the node restarted
    # prefix cache (pdtb/engine/page_pool.py, prefix_hash.py); prefix_ns "" means the node caches nothing
    page_size: int = 0  # tokens per KV page (the unit of every page hash and of the router's page counts)
    prefix_ns: str = ""  # namespace of the node's page hashes (prefix_hash.page_hashes)
    prefix_summary: list[int] = field(default_factory=list)  # cached page hashes, most recent first (bounded)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the cache (cumulative)
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache: not computed (prefill) or not sent (decode)


MESSAGES: dict[str, type] = {c.__name__: c for c in (GenerateRequest, AbortRequest, TokenBatch, Ping, NodeStats, NodeDown,
                                                      Migrate, Drain, SetFaults)}
_NESTED = {"Params": Params, "TokenEvent": TokenEvent, "Target": Target, "HandoffNotice": HandoffNotice,
           "MigrationReport": MigrationReport}


def _to_plain(obj):
    if hasattr(type(obj), "__dataclass_fields__"):
        return {name: _to_plain(getattr(obj, name)) for name in _field_names(type(obj))}
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    return obj


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def encode_message(msg) -> bytes:
    d = _to_plain(msg)
    d["type"] = type(msg).__name__
    d["v"] = PROTOCOL_VERSION
    return msgpack.packb(d, use_bin_type=True)


def _check(value, tp, name: str):
    """Return `value` converted to `tp` (dataclasses built), or raise ProtocolError."""
    return _checker(tp)(value, name)


@functools.cache
def _checker(tp) -> Callable:
    """The conversion of a value to `tp`, worked out once per type: a router reads thousands of
    TokenEvents a second, and working out the type hints per message cost more than the rest of
    its path together."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in typing.get_args(tp)
        inner = _checker([a for a in typing.get_args(tp) if a is not type(None)][0])
        return lambda value, name: None if value is None and optional else inner(value, name)
    if origin is list:
        (item,) = typing.get_args(tp)
        each = _checker(item)
        exact = item if item in (int, str) else None  # lists of these pass whole when every item is one

        def check_list(value, name):
            if not isinstance(value, list):
                raise ProtocolError(f"field {name!r} must be a list", name)
            if exact is not None and all(type(v) is exact for v in value):  # (a bool is no int here)
                return value
            return [each(v, f"{name}[]") for v in value]
        return check_list
    if tp in (dict,) or origin is dict:
        args = typing.get_args(tp)
        key, val = (_checker(args[0]), _checker(args[1])) if args else (None, None)

        def check_dict(value, name):
            if not isinstance(value, dict):
                raise ProtocolError(f"field {name!r} must be a map", name)
            if key is None:
                return value
            return {key(k, f"{name}{{}}"): val(v, f"{name}.{k}") for k, v in value.items()}  # every key and value
        return check_dict
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        def check_dataclass(value, name):
            if not isinstance(value, dict):
                raise ProtocolError(f"field {name!r} must be a map", name)
            return _build(tp, value, prefix=f"{name}.")
        return check_dataclass
    return functools.partial(_check_scalar, tp=tp)


def _check_scalar(value, name: str, tp):
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"field {name!r} must be a number", name)
        return float(value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"field {name!r} must be an integer", name)
    if tp in (str, bool) and not isinstance(value, tp):
        raise ProtocolError(f"field {name!r} must be {tp.__name__}", name)
    return value


@functools.cache
def _schema(cls) -> tuple[tuple[str, Callable, bool], ...]:
    """(name, conversion, required) of each field of a message dataclass."""
    hints = typing.get_type_hints(cls, globalns={**globals(), **_NESTED})
    return tuple((f.name, _checker(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _build(cls, d: dict, prefix: str = ""):
    kwargs = {}
    for name, check, required in _schema(cls):
        if name not in d:
            if required:
                raise ProtocolError(f"missing field {prefix}{name!r}", prefix + name)
            continue
        kwargs[name] = check(d[name], prefix + name)
    tier = kwargs.get("slo_tier")
    if tier and not SLO_TIER_RE.fullmatch(tier):  # the one field whose value, not only type, is checked here
        raise ProtocolError(f"field {prefix}slo_tier {tier[:40]!r} is not 1-32 characters of [A-Za-z0-9_.-]",
                            prefix + "slo_tier")
    return cls(**kwargs)


def decode_message(data: bytes):
    """Parse and validate one control frame. Raises ProtocolError on anything untrusted."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}", "size")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack control message: {type(e).__name__}", "frame") from None
    if not isinstance(d, dict):
        raise ProtocolError("control message must be a map", "frame")
    if d.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {d.get('v')!r} not supported (want {PROTOCOL_VERSION})", "v")
    cls = MESSAGES.get(d.get("type"))
    if cls is None:
        raise ProtocolError(f"unknown message type {d.get('type')!r}", "type")
    return _build(cls, d)


def to_extra(meta: HandoffMeta) -> dict:
    """`meta` as TransferMeta.extra (msgpack-safe plain values)."""
    return _to_plain(meta)


def handoff_meta(extra: dict) -> HandoffMeta:
    """The HandoffMeta in a transfer header's `extra` (other keys, such as the seal, ignored).
    Raises ProtocolError naming the field that does not validate."""
    if not isinstance(extra, dict):
        raise ProtocolError("hand-off metadata must be a map", "extra")
    return _build(HandoffMeta, extra, prefix="extra.")
