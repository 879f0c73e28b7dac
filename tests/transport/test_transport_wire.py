"""Wire format: round trips, every rejection naming its field, and a fuzzed decoder."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transport.fail_codes import FailCode
from kv_transport.testing import TINY_SPEC
from kv_transport.wire import (WIRE_VERSION, Ack, Cancel, Credit, KVChunk, KVTransferHeader, Nack,
                               TransferBatch, WireError, WireFieldError, WireLimits,
                               WireSizeError, WireVersionError, decode, encode)

PAGE = TINY_SPEC.bytes_per_page  # 32 KiB
LIMITS = WireLimits(spec=TINY_SPEC, max_pages=64, max_message_bytes=4 * PAGE,
                    max_header_bytes=1 << 16, max_tokens=1000, max_batch=8)


def make_header(num_pages: int = 1, mode: str = "inline", **kw) -> KVTransferHeader:
    payload = num_pages * PAGE
    chunk = 2 * PAGE if mode == "chunked" else payload
    fields = dict(
        transfer_id="tx-1", request_id="req-1", tenant="t0",
        num_tokens=num_pages * TINY_SPEC.page_size - 3, prompt_token_ids=[1, 2, 3],
        output_token_ids=[7], num_computed_tokens=3, extra={"temperature": 0.5, "k": [1, "x"]},
        num_pages=num_pages, page_size=16, dtype="float32", num_layers=4, num_kv_heads=2,
        head_dim=32, payload_bytes=payload, mode=mode, chunk_bytes=chunk,
        num_chunks=-(-payload // chunk), checksum_algo="sum64",
        checksum=None if mode == "chunked" else 12345)
    fields.update(kw)
    return KVTransferHeader(**fields)


def payload(num_pages: int) -> bytes:
    return bytes(range(256)) * (num_pages * PAGE // 256)


def raw_body(msg) -> dict:
    return msgpack.unpackb(encode(msg)[0])


def frames_with(body: dict, *payloads) -> list:
    return [msgpack.packb(body, use_bin_type=True), *payloads]


def expect_reject(frames: list, err: type, field: str) -> WireError:
    with pytest.raises(err) as info:
        decode(frames, LIMITS)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    return info.value


# ---- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("msg,payloads", [
    (make_header(1), [payload(1)]),
    (make_header(3, mode="chunked"), []),
    (make_header(2, mode="dist", src_rank=1), []),
    (TransferBatch([make_header(1, transfer_id="a"), make_header(2, transfer_id="b")]),
     [payload(1), payload(2)]),
    (KVChunk("tx-1", 1, 2 * PAGE, PAGE, (1 << 64) - 1), [payload(1)]),
    (Credit("tx-1", 4), []),
    (Credit("tx-1", 1, rank=1, tag=77), []),
    (Ack(["a", "b"]), []),
    (Nack("tx-1", FailCode.NO_PAGES, "need 3 pages, 1 free"), []),
    (Cancel("tx-1", "request aborted"), []),
])
def test_round_trip(msg, payloads):
    frames = encode(msg, payloads)
    assert isinstance(frames[0], bytes) and frames[1:] == payloads  # payloads are not copied
    got = decode([bytes(f) for f in frames], LIMITS)
    assert got.msg == msg
    assert [bytes(p) for p in got.payloads] == payloads


def test_header_carries_type_and_version():
    body = raw_body(make_header())
    assert body["v"] == WIRE_VERSION and body["t"] == 1


# ---- rejections ----------------------------------------------------------------------------
def test_garbage_bytes():
    expect_reject([b"\xc1\xff garbage"], WireFieldError, "frame0")
    expect_reject([msgpack.packb([1, 2, 3])], WireFieldError, "frame0")
    expect_reject([], WireFieldError, "frames")


def test_future_version():
    body = raw_body(make_header())
    body["v"] = WIRE_VERSION + 1
    expect_reject(frames_with(body, payload(1)), WireVersionError, "v")


def test_unknown_message_type_and_fields():
    body = raw_body(Credit("x", 1))
    expect_reject(frames_with({**body, "t": 99}), WireFieldError, "t")
    expect_reject(frames_with({**body, "bogus": 1}), WireFieldError, "bogus")
    del body["upto"]
    err = expect_reject(frames_with(body), WireFieldError, "upto")
    assert "missing" in str(err)


def test_wrong_dtype():
    err = expect_reject(encode(make_header(dtype="float16"), [payload(1)]), WireFieldError,
                        "dtype")
    assert err.transfer_id == "tx-1"  # the receiver can NACK this transfer


@pytest.mark.parametrize("field,value", [("num_layers", 8), ("num_kv_heads", 4),
                                         ("head_dim", 64), ("page_size", 32)])
def test_wrong_shape(field, value):
    expect_reject(encode(make_header(**{field: value}), [payload(1)]), WireFieldError, field)


def test_truncated_payload():
    err = expect_reject(encode(make_header(2), [payload(2)[:-1]]), WireSizeError, "payload")
    assert err.transfer_id == "tx-1"
    expect_reject(encode(make_header(1), []), WireSizeError, "payload")
    chunk = KVChunk("tx-1", 0, 0, PAGE, 0)
    expect_reject(encode(chunk, [payload(1)[:100]]), WireSizeError, "payload")


def test_oversize_message_and_header():
    big = make_header(5, mode="inline")  # 5 pages > max_message_bytes (4 pages)
    expect_reject(encode(big, [payload(5)]), WireSizeError, "message_bytes")
    expect_reject(encode(make_header(65, mode="chunked"), []), WireFieldError, "num_pages")
    huge = make_header(extra={"blob": b"x" * (1 << 16)})
    expect_reject(encode(huge, [payload(1)]), WireSizeError, "header_bytes")
    expect_reject([b"x"] * (LIMITS.max_batch + 2), WireSizeError, "frames")


@pytest.mark.parametrize("change,field", [
    (dict(num_pages=True), "num_pages"),  # bool is not an int here
    (dict(num_tokens=40), "num_tokens"),  # more tokens than 1 page holds
    (dict(num_pages=2, payload_bytes=2 * PAGE, num_tokens=5), "num_pages"),  # 5 need 1 page
    (dict(payload_bytes=PAGE + 1), "payload_bytes"),
    (dict(prompt_token_ids=[1, -2]), "prompt_token_ids"),
    (dict(output_token_ids=[1.5]), "output_token_ids"),
    (dict(num_computed_tokens=-1), "num_computed_tokens"),
    (dict(transfer_id=""), "transfer_id"),
    (dict(checksum=None), "checksum"),
    (dict(checksum_algo="md5"), "checksum_algo"),
    (dict(mode="carrier-pigeon"), "mode"),
    (dict(extra={"a": {1, 2}}), None),  # not msgpack-encodable at all: the sender refuses
])
def test_bad_header_fields(change, field):
    h = make_header(**change)
    if field is None:
        with pytest.raises(TypeError):
            encode(h)
        return
    expect_reject(encode(h, [payload(1)]), WireFieldError, field)


def test_extra_must_be_plain():
    body = raw_body(make_header())
    body["extra"] = {b"k": 1}
    expect_reject(frames_with(body, payload(1)), WireFieldError, "extra")
    body["extra"] = {"k": msgpack.ExtType(5, b"x")}
    expect_reject(frames_with(body, payload(1)), WireFieldError, "frame0")


def test_chunked_geometry():
    expect_reject(encode(make_header(3, mode="chunked", chunk_bytes=PAGE + 8, num_chunks=3)),
                  WireFieldError, "chunk_bytes")
    expect_reject(encode(make_header(3, mode="chunked", num_chunks=5)), WireFieldError,
                  "num_chunks")
    expect_reject(encode(make_header(3, mode="chunked", checksum=5)), WireFieldError, "checksum")


def test_batch_rules():
    inline, chunked = make_header(1, transfer_id="a"), make_header(3, mode="chunked")
    expect_reject(encode(TransferBatch([inline, chunked]), [payload(1)]), WireFieldError, "mode")
    expect_reject(encode(TransferBatch([inline]), []), WireSizeError, "payload")
    # one bad header in a batch fails the batch: every transfer it names is NACKed, not left to time out
    e = expect_reject(encode(TransferBatch([inline, chunked, make_header(1, transfer_id="c")]), [payload(1)] * 2),
                      WireFieldError, "mode")
    assert e.batch_ids == ("a", "tx-1", "c")
    bad = raw_body(TransferBatch([inline, make_header(1, transfer_id="b")]))
    bad["headers"][1]["num_pages"] = 10 ** 6
    e = expect_reject(frames_with(bad, payload(1), payload(1)), WireFieldError, "num_pages")
    assert e.batch_ids == ("a", "b")


def test_a_header_with_a_prompt_past_the_limit_is_refused_under_its_transfer_id():
    body = raw_body(make_header(3, mode="chunked", transfer_id="t8"))
    e = expect_reject(frames_with({**body, "prompt_token_ids": [1] * (LIMITS.max_tokens + 5)}), WireSizeError, "frame0")
    assert e.transfer_id == "t8"
    e = expect_reject([msgpack.packb([[0] * (LIMITS.max_tokens + 5)])], WireSizeError, "frame0")
    assert e.transfer_id is None  # (no map: no id)


def test_a_header_with_an_unknown_field_is_refused_under_its_transfer_id():
    body = raw_body(make_header(3, mode="chunked", transfer_id="t9"))
    e = expect_reject(frames_with({**body, "surprise": 1}), WireFieldError, "surprise")
    assert e.transfer_id == "t9"


# ---- fuzzing -------------------------------------------------------------------------------
def decode_or_wire_error(frames: list) -> None:
    try:
        decode(frames, LIMITS)
    except WireError:
        pass  # anything else escapes and fails the test


_VALID = [encode(make_header(1), [payload(1)]), encode(make_header(3, mode="chunked")),
          encode(KVChunk("tx-1", 0, 0, PAGE, 9), [payload(1)]), encode(Ack(["a"])),
          encode(TransferBatch([make_header(1, transfer_id="a")]), [payload(1)])]
_FUZZ = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_fuzz_random_frames(frames):
    decode_or_wire_error(frames)


@_FUZZ
@given(st.sampled_from(range(len(_VALID))), st.data())
def test_fuzz_mutated_valid_messages(which, data):
    frames = [bytearray(f) for f in _VALID[which]]
    head = frames[0]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(head) - 1))
        head[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()) and len(frames) > 1:
        frames[-1] = frames[-1][:data.draw(st.integers(0, len(frames[-1])))]
    decode_or_wire_error([bytes(f) for f in frames])


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=3), max_leaves=10)
_header_keys = [f.name for f in dataclasses.fields(KVTransferHeader)]


@_FUZZ
@given(st.dictionaries(st.sampled_from(_header_keys + ["t", "v", "headers", "transfer_ids",
                                                      "credits", "nbytes"]), _values),
       st.sampled_from([1, 2, 3, 4, 5, 6, 7]), st.lists(st.binary(max_size=64), max_size=2))
def test_fuzz_structured_maps(body, mtype, payloads):
    base = raw_body(make_header(1))
    base.update(body)
    base["t"], base["v"] = mtype, WIRE_VERSION
    decode_or_wire_error([msgpack.packb(base, use_bin_type=True), *payloads])
