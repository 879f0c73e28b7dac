"""Wire format of the KV transport, version 6 (the reference is kv_transport/README.md).

Every message is one multipart message:

    frame 0     msgpack map {"t": MsgType, "v": WIRE_VERSION, <fields of the dataclass>}
    frame 1..n  raw payload bytes (KV pages), sent and received without copies

`encode(msg, payloads)` builds the frame list; `decode(frames, limits)` checks every header
field (types, ranges, version, the receiver's KVSpec, sizes against `WireLimits`) and the
payload frame lengths before anything reads a payload byte. It raises only `WireError`
subclasses, whose `field` names the offending field.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Union

import msgpack
import numpy as np

from kv_transport.admission import Admission
from kv_transport.fail_codes import FailCode
from kv_transport.wire_check import (Fields, WireChecksumError, WireError, WireFieldError,
                                     WireLimits, WireSizeError, WireVersionError, frame_view)

WIRE_VERSION = 7  # 7: KVTransferHeader.source, Ack.link, Ack.ticket; 6: Grant.pages packed; 5: Grant.link, Grant.ticket; 4: mode "shm", Grant, Commit; 3: Nack.code is a FailCode; 2: Credit.upto is cumulative
MODES = ("inline", "chunked", "dist", "shm")  # where a transfer's payload travels
PAGE_IDS = np.dtype("<u4")  # Grant.pages on the wire: little-endian uint32 ids, packed
STREAMED = ("chunked", "shm")  # modes whose payload may come in KVChunks (shm: if not written one-sided)

__all__ = ["WIRE_VERSION", "MODES", "MsgType", "KVTransferHeader", "TransferBatch", "KVChunk",
           "Credit", "Ack", "Nack", "Cancel", "Grant", "Commit", "ReadSource", "Message", "Decoded", "encode", "decode",
           "WireError", "WireVersionError", "WireFieldError", "WireSizeError",
           "WireChecksumError", "WireLimits", "frame_view"]


class MsgType(enum.IntEnum):
    HEADER = 1  # sender -> receiver: announce one transfer (payload inline or to follow)
    BATCH = 2  # sender -> receiver: several inline transfers in one message
    CHUNK = 3  # sender -> receiver: one slice of a chunked payload
    CREDIT = 4  # receiver -> sender: pages reserved; you may send N more chunks
    ACK = 5  # receiver -> sender: these transfers are committed
    NACK = 6  # receiver -> sender: this transfer failed (reason); its pages are freed
    CANCEL = 7  # sender -> receiver: abandon this transfer and free its pages
    GRANT = 8  # receiver -> sender (mode shm): pages reserved; write them yourself, here
    COMMIT = 9  # sender -> receiver (mode shm): rows written so far; check them (the last: commit)


# Messages are plain (not frozen) dataclasses: a frozen 21-field __init__ costs ~12 us, which
# is most of the per-request cost when thousands of small requests are batched. Treat them as
# read-only values.


@dataclass
class KVTransferHeader:
    """Announces one transfer: who it belongs to, the sequence state, and the payload shape."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.HEADER
    transfer_id: str  # unique per sender, chosen by the sender
    request_id: str  # owner of the pages on both sides
    tenant: str  # tenant of the request ("" if none)
    num_tokens: int  # tokens whose K/V are in the pages
    prompt_token_ids: list[int]  # the request's prompt
    output_token_ids: list[int]  # tokens generated so far (prefill: usually the first one)
    num_computed_tokens: int  # tokens whose KV is computed
    extra: dict  # opaque msgpack-safe values for the node layer (sampling params, ...)
    num_pages: int  # pages in the payload, == pages_for(num_tokens)
    page_size: int  # tokens per page (must equal the receiver's)
    dtype: str  # KV dtype name (must equal the receiver's)
    num_layers: int  # per-layer shape (must equal the receiver's) ...
    num_kv_heads: int
    head_dim: int
    payload_bytes: int  # == num_pages * bytes_per_page
    mode: str  # "inline" (frame 1 is the payload), "chunked" (KVChunk follow), "dist", "shm" (read from `source` by the receiver; or Grant, one-sided write, Commit; or chunks)
    chunk_bytes: int  # size of every chunk but the last (chunked); == payload_bytes otherwise
    num_chunks: int  # ceil(payload_bytes / chunk_bytes)
    checksum_algo: str  # "sum64" or "crc32"
    checksum: int | None  # whole payload (inline, dist); None when chunks carry it
    src_rank: int = -1  # dist mode: torch.distributed rank of the sender
    # prefix cache: the leading pages left out of the payload (the receiver shares its cached
    # copies of them, found by page_hashes[:skip_pages]), and the hashes of the request's full
    # pages (pdtb/engine/prefix_hash.py) so the receiver can cache the ones it is sent. The
    # payload holds pages [skip_pages, skip_pages + num_pages) of the request's page table.
    skip_pages: int = 0
    page_hashes: list[int] = field(default_factory=list)
    source: "ReadSource | None" = None  # mode shm: the payload lies in the sender's export arena, readable here


@dataclass(frozen=True)
class ReadSource:
    """Mode shm: where a receiver on the sender's host may read the payload itself
    (shm_backend, the read path): `payload_bytes` at `offset` in the sender's export arena
    (shared_memory.Locator fields `buffer*`), while it holds slot `slot` of the sender's slot
    table at generation `gen` (shm_slots.py). `checksum` is the whole payload's. On the wire:
    a map of these fields, absent when None."""

    host: str  # the sender's boot id
    buffer: str
    buffer_token: str
    slots: str
    slots_token: str
    slot: int
    gen: int
    offset: int
    checksum: int


@dataclass
class TransferBatch:
    """Several inline transfers in one message; frame i+1 is the payload of headers[i]."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.BATCH
    headers: list[KVTransferHeader]  # every header has mode "inline"


@dataclass
class KVChunk:
    """One slice of a chunked payload; frame 1 holds `nbytes` bytes at `offset`."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.CHUNK
    transfer_id: str
    chunk_index: int  # 0-based, sent in order
    offset: int  # == chunk_index * header.chunk_bytes
    nbytes: int  # length of frame 1
    checksum: int  # running checksum of the payload up to and including this chunk


@dataclass
class Credit:
    """Receiver lets the sender send chunks [0, upto); the first credit means the pages are
    reserved. Cumulative, so a duplicated, late or reordered Credit grants nothing new and a
    lost one is made good by the next."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.CREDIT
    transfer_id: str
    upto: int  # chunks with index < upto may be sent (dist mode: 1, "send the payload")
    rank: int = -1  # dist mode: the receiver's rank, send the payload to it
    tag: int = 0  # dist mode: the tag to send the payload with


@dataclass
class Ack:
    """These transfers are verified and committed on the receiver."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.ACK
    transfer_ids: list[str]
    link: str = ""  # shm, the read path: the receiver's local link (as in a Grant), "" for none
    ticket: str = ""


@dataclass
class Nack:
    """This transfer failed on the receiver; every page it reserved there is free again."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.NACK
    transfer_id: str
    code: FailCode  # why (kv_transport/fail_codes.py); travels as its value
    reason: str  # human-readable detail


@dataclass
class Cancel:
    """The sender gave up on this transfer; the receiver frees what it reserved for it."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.CANCEL
    transfer_id: str
    reason: str


@dataclass
class Grant:
    """Mode shm: the receiver reserved `pages` in a pool another process of its host can map
    (shared_memory.Locator fields `buffer*`) and lets the sender write them while it holds
    write slot `slot` at generation `gen` (shm_slots.py). `upto` is a chunk credit, as in a
    Credit, for a sender that cannot map the pool and sends chunks instead."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.GRANT
    transfer_id: str
    upto: int
    host: str  # the receiver's boot id
    buffer: str  # the pool's locator path and token
    buffer_token: str
    slots: str  # the write-slot table's locator path and token
    slots_token: str
    slot: int
    gen: int
    pool_pages: int  # pages in the pool: payload row lk * n + i lands in pool row lk * pool_pages + pages[i]
    pages: list[int]  # the request's reserved pages, in page-table order (on the wire: PAGE_IDS bytes)
    link: str = ""  # the receiver's local link (local_link.py), "" for none: control goes on over it
    ticket: str = ""  # what the sender presents there to speak as the peer this Grant went to


@dataclass
class Commit:
    """Mode shm: payload rows [0, rows) are written into the granted pages; `checksum` is their
    running checksum. Sent after each piece, so the receiver checks a piece while the next is
    written; the one whose rows cover the payload commits the transfer."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.COMMIT
    transfer_id: str
    rows: int  # payload rows: one (layer, k/v, page) slab each
    checksum: int


Message = Union[KVTransferHeader, TransferBatch, KVChunk, Credit, Ack, Nack, Cancel, Grant, Commit]


@dataclass
class Decoded:
    """A validated message and zero-copy views of its payload frames."""

    msg: Message
    payloads: list[memoryview] = field(default_factory=list)


# ---- encode ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def field_names(cls) -> tuple[str, ...]:
    """Wire fields of a message class (its dataclass fields, in order)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(msg) -> dict:
    return {name: getattr(msg, name) for name in field_names(type(msg))}


def _header_fields(h: KVTransferHeader) -> dict:
    body = _fields(h)
    src = body.pop("source")
    if src is not None:
        body["source"] = _fields(src)
    return body


def _body(msg: Message) -> dict:
    if isinstance(msg, KVTransferHeader):
        return _header_fields(msg)
    if isinstance(msg, TransferBatch):
        return {"headers": [_header_fields(h) for h in msg.headers]}
    body = _fields(msg)
    if isinstance(msg, Grant):  # a big request's thousands of page ids: one bytes field, not a msgpack array
        body["pages"] = pack_pages(msg.pages)
    return body


def pack_pages(pages) -> bytes:
    """Page ids as PAGE_IDS bytes; ValueError for an id that is not an int in [0, 2**32)."""
    ids = np.asarray(pages)
    if ids.size and (ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) > np.iinfo(PAGE_IDS).max):
        raise ValueError(f"page ids must be ints in [0, 2**32), got {ids.dtype} ids")
    return ids.astype(PAGE_IDS).tobytes()


def encode(msg: Message, payloads: list | tuple = ()) -> list:
    """Frames of `msg`: [msgpack header, *payloads]. Payloads are passed through, not copied."""
    body = _body(msg)
    body["t"] = int(msg.MSG_TYPE)
    body["v"] = WIRE_VERSION
    return [msgpack.packb(body, use_bin_type=True), *payloads]


# ---- decode ------------------------------------------------------------------------------
def decode(frames: list, limits: WireLimits) -> Decoded:
    """Validate and decode one multipart message. Raises only WireError subclasses."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise WireFieldError("frames", "message has no frames")
    if len(frames) > limits.max_batch + 1:
        raise WireSizeError("frames", f"{len(frames)} frames > {limits.max_batch + 1}")
    views = [frame_view(f) for f in frames]
    if len(views[0]) > limits.max_header_bytes:
        raise WireSizeError("header_bytes", f"{len(views[0])} > {limits.max_header_bytes}")
    total = sum(len(v) for v in views[1:])
    if total > limits.max_message_bytes:
        raise WireSizeError("message_bytes", f"{total} payload bytes > {limits.max_message_bytes}")
    f = Fields.unpack(views[0], limits)
    version = f.int("v", 0, 1 << 31)
    if version != WIRE_VERSION:
        raise WireVersionError("v", f"wire version {version}, this side speaks {WIRE_VERSION}")
    t = f.int("t", 0, 1 << 16)
    try:
        mtype = MsgType(t)
    except ValueError:
        raise WireFieldError("t", f"unknown message type {t}") from None
    try:
        f.only(_ALLOWED[mtype])
    except WireError as e:  # (named, so that the sender hears of it now rather than at its timeout)
        e.transfer_id = f.id_or_none("transfer_id")
        raise
    payloads = views[1:]
    return Decoded(_DECODERS[mtype](f, payloads, limits), payloads)


_H_INTS = ("num_pages", "page_size", "num_layers", "num_kv_heads", "head_dim", "num_tokens",
           "payload_bytes", "chunk_bytes", "num_chunks", "num_computed_tokens", "src_rank")
_H_STRS = ("request_id", "tenant", "dtype", "mode", "checksum_algo")


def _header(f: Fields, limits: WireLimits) -> KVTransferHeader:
    spec, d = limits.spec, f.d
    tid = f.id("transfer_id")
    f.transfer_id = tid
    f.typed(_H_INTS, int)  # every field's type first, then values (one pass each: hot path)
    f.typed(_H_STRS, str)
    for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "dtype"):
        f.equal(name, d[name], getattr(spec, name))
    num_pages = f.within("num_pages", 1, limits.max_pages)
    skip, hashes = _prefix_fields(f, limits, tid)
    num_tokens = f.within("num_tokens", 1, (skip + num_pages) * spec.page_size)
    if spec.pages_for(num_tokens) != skip + num_pages:
        raise WireFieldError("num_pages", f"{skip} skipped + {num_pages} pages for {num_tokens} tokens", tid)
    if len(hashes) > skip + num_pages:
        raise WireFieldError("page_hashes", f"{len(hashes)} hashes for {skip + num_pages} pages", tid)
    payload = d["payload_bytes"]
    f.equal("payload_bytes", payload, num_pages * limits.bytes_per_page)
    if payload > limits.max_transfer_bytes:
        raise WireSizeError("payload_bytes", f"{payload} > {limits.max_transfer_bytes}", tid)
    mode = f.choice("mode", MODES)
    streamed = mode in STREAMED
    chunk = f.within("chunk_bytes", 1, limits.max_message_bytes if streamed else payload)
    if not streamed and chunk != payload:
        raise WireFieldError("chunk_bytes", f"must equal payload_bytes in mode {mode}", tid)
    if streamed and chunk % limits.chunk_align:
        raise WireFieldError("chunk_bytes", f"{chunk} not a multiple of {limits.chunk_align}", tid)
    f.equal("num_chunks", d["num_chunks"], -(-payload // chunk))
    checksum = f.opt_int("checksum", 0, (1 << 64) - 1)
    if (checksum is None) != streamed:
        raise WireFieldError("checksum", f"required in mode {mode} only if not streamed", tid)
    source = _read_source(f, limits, tid)
    if source is not None and mode != "shm":
        raise WireFieldError("source", f"only in mode shm, not {mode}", tid)
    return KVTransferHeader(
        transfer_id=tid, request_id=f.id("request_id"), tenant=f.str("tenant", limits.max_id_len),
        num_tokens=num_tokens, prompt_token_ids=f.tokens("prompt_token_ids"),
        output_token_ids=f.tokens("output_token_ids"),
        num_computed_tokens=f.within("num_computed_tokens", 0, limits.max_tokens),
        extra=f.extra("extra"), num_pages=num_pages, page_size=spec.page_size, dtype=spec.dtype,
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        payload_bytes=payload, mode=mode, chunk_bytes=chunk, num_chunks=d["num_chunks"],
        checksum_algo=f.choice("checksum_algo", ("sum64", "crc32")), checksum=checksum,
        src_rank=f.within("src_rank", -1, 1 << 20), skip_pages=skip, page_hashes=hashes, source=source)


_SOURCE_FIELDS = frozenset(field_names(ReadSource))


def _read_source(f: Fields, limits: WireLimits, tid: str) -> ReadSource | None:
    """The header's optional `source` map (mode shm), every field typed and in range."""
    raw = f.d.get("source")
    if raw is None:
        return None
    if type(raw) is not dict:
        raise WireFieldError("source", f"expected a map, got {type(raw).__name__}", tid)
    s = Fields(raw, limits)
    s.transfer_id = tid
    s.only(_SOURCE_FIELDS)
    source = ReadSource(s.str("host", 128), s.str("buffer", 2048), s.str("buffer_token", 64), s.str("slots", 256),
                        s.str("slots_token", 64), s.int("slot", 0, 1 << 31), s.int("gen", 1, (1 << 64) - 1),
                        s.int("offset", 0, 1 << 62), s.int("checksum", 0, (1 << 64) - 1))
    for name in ("buffer", "slots"):  # paths the receiver opens: /proc/PID/fd/N of the sender
        path = getattr(source, name)
        if not path.startswith("/proc/") or "\0" in path:
            raise WireFieldError(f"source.{name}", f"{path!r} is not a /proc path", tid)
    return source


def _prefix_fields(f: Fields, limits: WireLimits, tid: str) -> tuple[int, list[int]]:
    """(skip_pages, page_hashes), both optional: absent means nothing skipped, no hashes."""
    d = f.d
    skip, hashes = d.get("skip_pages", 0), d.get("page_hashes", [])
    if type(skip) is not int or not 0 <= skip <= limits.max_pages:
        raise WireFieldError("skip_pages", f"{skip!r} is not an int in [0, {limits.max_pages}]", tid)
    if type(hashes) is not list or len(hashes) > limits.max_pages:
        raise WireFieldError("page_hashes", f"must be a list of at most {limits.max_pages} hashes", tid)
    for h in hashes:
        if type(h) is not int or not 0 <= h < (1 << 64):
            raise WireFieldError("page_hashes", f"hash {h!r} is not an int in [0, 2**64)", tid)
    if skip > len(hashes):
        raise WireFieldError("skip_pages", f"{skip} pages skipped, {len(hashes)} hashes given", tid)
    return skip, hashes


def _check_payloads(payloads: list[memoryview], expect: list[int], tid: str | None) -> None:
    if len(payloads) != len(expect):
        raise WireSizeError("payload", f"{len(payloads)} payload frames, expected {len(expect)}",
                            tid)
    for i, (p, n) in enumerate(zip(payloads, expect)):
        if len(p) != n:
            raise WireSizeError("payload", f"frame {i + 1} has {len(p)} bytes, expected {n}", tid)


def _dec_header(f: Fields, payloads: list, limits: WireLimits) -> KVTransferHeader:
    h = _header(f, limits)
    _check_payloads(payloads, [h.payload_bytes] if h.mode == "inline" else [], h.transfer_id)
    return h


def _dec_batch(f: Fields, payloads: list, limits: WireLimits) -> TransferBatch:
    headers = []
    allowed = frozenset(field_names(KVTransferHeader))
    subs = f.sublist("headers", limits.max_batch)
    try:
        for sub in subs:
            sub.only(allowed)
            headers.append(_header(sub, limits))
        for h in headers:
            if h.mode != "inline":
                raise WireFieldError("mode", "batched transfers must be inline", h.transfer_id)
        _check_payloads(payloads, [h.payload_bytes for h in headers], None)
    except WireError as e:  # every transfer it names is NACKed, not left to time out
        e.batch_ids = tuple(t for t in (sub.id_or_none("transfer_id") for sub in subs) if t is not None)
        raise
    return TransferBatch(headers)


def _dec_chunk(f: Fields, payloads: list, limits: WireLimits) -> KVChunk:
    tid = f.id("transfer_id")
    f.transfer_id = tid
    nbytes = f.int("nbytes", 1, limits.max_message_bytes)
    chunk = KVChunk(tid, f.int("chunk_index", 0, 1 << 31), f.int("offset", 0, 1 << 62), nbytes,
                    f.int("checksum", 0, (1 << 64) - 1))
    _check_payloads(payloads, [nbytes], tid)
    return chunk


def _dec_credit(f: Fields, payloads: list, limits: WireLimits) -> Credit:
    _check_payloads(payloads, [], None)
    return Credit(f.id("transfer_id"), f.int("upto", 0, 1 << 31), f.int("rank", -1, 1 << 20),
                  f.int("tag", 0, (1 << 31) - 1))


def _dec_ack(f: Fields, payloads: list, limits: WireLimits) -> Ack:
    _check_payloads(payloads, [], None)
    return Ack(f.id_list("transfer_ids", limits.max_batch), _opt_str(f, "link", 256), _opt_str(f, "ticket", 64))


def _opt_str(f: Fields, name: str, max_len: int) -> str:
    return f.str(name, max_len) if name in f.d else ""


_FAIL_CODES = tuple(c.value for c in FailCode)


def _dec_nack(f: Fields, payloads: list, limits: WireLimits) -> Nack:
    _check_payloads(payloads, [], None)
    return Nack(f.id("transfer_id"), FailCode(f.choice("code", _FAIL_CODES)), f.str("reason", 4096))


def _dec_cancel(f: Fields, payloads: list, limits: WireLimits) -> Cancel:
    _check_payloads(payloads, [], None)
    return Cancel(f.id("transfer_id"), f.str("reason", 4096))


def _dec_grant(f: Fields, payloads: list, limits: WireLimits) -> Grant:
    _check_payloads(payloads, [], None)
    tid = f.id("transfer_id")
    f.transfer_id = tid
    raw = f.d.get("pages")
    size = PAGE_IDS.itemsize
    if type(raw) is not bytes or len(raw) % size or not 0 < len(raw) // size <= limits.max_pages:
        raise WireFieldError("pages", f"expected 1..{limits.max_pages} page ids as {size}-byte words", tid)
    pool_pages = f.int("pool_pages", 1, 1 << 32)
    ids = np.frombuffer(raw, dtype=PAGE_IDS)
    if int(ids.max()) >= pool_pages:
        raise WireFieldError("pages", f"page ids must be in [0, {pool_pages})", tid)
    pages = ids.tolist()
    for name in ("buffer", "slots"):  # what the sender opens (a /proc path, or a CUDA IPC locator)
        if "\0" in f.str(name, 2048):
            raise WireFieldError(name, "a NUL in a locator", tid)
    return Grant(tid, f.int("upto", 0, 1 << 31), f.str("host", 128), f.str("buffer", 2048),
                 f.str("buffer_token", 64), f.str("slots", 256), f.str("slots_token", 64),
                 f.int("slot", 0, 1 << 31), f.int("gen", 1, (1 << 64) - 1), pool_pages, pages,
                 f.str("link", 256), f.str("ticket", 64))


def _dec_commit(f: Fields, payloads: list, limits: WireLimits) -> Commit:
    _check_payloads(payloads, [], None)
    return Commit(f.id("transfer_id"), f.int("rows", 1, 1 << 40), f.int("checksum", 0, (1 << 64) - 1))


_DECODERS = {
    MsgType.HEADER: _dec_header, MsgType.BATCH: _dec_batch, MsgType.CHUNK: _dec_chunk,
    MsgType.CREDIT: _dec_credit, MsgType.ACK: _dec_ack, MsgType.NACK: _dec_nack,
    MsgType.CANCEL: _dec_cancel, MsgType.GRANT: _dec_grant, MsgType.COMMIT: _dec_commit,
}
_ALLOWED = {t: frozenset(field_names(cls)) | {"t", "v"} for t, cls in (
    (MsgType.HEADER, KVTransferHeader), (MsgType.BATCH, TransferBatch), (MsgType.CHUNK, KVChunk),
    (MsgType.CREDIT, Credit), (MsgType.ACK, Ack), (MsgType.NACK, Nack), (MsgType.CANCEL, Cancel),
    (MsgType.GRANT, Grant), (MsgType.COMMIT, Commit))}


# A node's admission check of a transfer header (kv_transport/admission.py has the answers; it
# is named here, beside the header, so that admission.py needs nothing of the wire format).
AdmitFn = Callable[[KVTransferHeader], Admission]
