"""The request timeline: waits open and close once, only what is set is reported, and it
crosses the hand-off (protocol.HandoffMeta) unchanged and validated."""
from __future__ import annotations

import msgpack
import pytest

from pdtb.engine.timeline import Timeline
from pdtb.nodes.protocol import HandoffMeta, Params, ProtocolError, handoff_meta, to_extra


def test_waits_accumulate_and_stamps_are_set_once():
    tl = Timeline(prefill_queued=1.0)
    tl.stamp_once("prefill_start", 2.0)
    tl.stamp_once("prefill_start", 3.0)  # a later chunk does not move it
    tl.start_wait("held", 4.0)
    tl.start_wait("held", 4.5)  # already open: kept at 4.0
    tl.end_wait("held", 6.0)
    tl.end_wait("held", 9.0)  # closed: nothing more added
    tl.start_wait("held", 10.0)
    tl.end_wait("held", 10.5)
    assert tl.prefill_start == 2.0 and tl.held_s == pytest.approx(2.5) and tl.held_since is None
    assert tl.span("prefill_queued", "prefill_start") == 1.0 and tl.span("prefill_start", "first_token") is None
    assert tl.to_dict() == {"prefill_queued": 1.0, "prefill_start": 2.0, "held_s": 2.5}


def test_a_zero_stamp_is_reported_a_zero_wait_is_not():
    assert Timeline(router_arrival=0.0, parked_since=0.0).to_dict() == {"router_arrival": 0.0, "parked_since": 0.0}


def test_the_timeline_crosses_the_hand_off_unchanged():
    tl = Timeline(router_arrival=1.5, first_token=2.25, held_s=0.125, num_preemptions=2)
    tl.start_wait("parked", 3.0)
    extra = msgpack.unpackb(msgpack.packb(to_extra(HandoffMeta("r", Params(max_tokens=3), timeline=tl))))
    assert handoff_meta(extra).timeline == tl
    for bad in ({"first_token": "x"}, {"num_preemptions": 1.5}, []):
        with pytest.raises(ProtocolError):
            handoff_meta({**extra, "timeline": bad})
