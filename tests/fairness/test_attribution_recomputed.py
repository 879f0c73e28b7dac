"""SLO attribution of a request recomputed after a node loss: judged whole from its first
arrival, its lost attempts' time counted by hand; the figures travel in the protocol and a
node refuses ones no router could have measured."""
from __future__ import annotations

import math

import pytest

from fairness import FairnessConfig
from fairness.attribution import attribute, components
from pdtb.engine.timeline import Earlier, Timeline
from pdtb.nodes.protocol import GenerateRequest, Params, ProtocolError, decode_message, encode_message


def attempt(t0: float = 0.0, **kw) -> Timeline:
    """This attempt: arrives at t0, first token 0.2 s later, then 9 more tokens over 0.9 s."""
    return Timeline(router_arrival=t0, prefill_queued=t0 + 0.05, prefill_start=t0 + 0.1, first_token=t0 + 0.2,
                    decode_admit=t0 + 0.2, last_token=t0 + 1.1, **kw)


def test_a_loss_before_the_first_token_is_part_of_the_ttft():
    tl = attempt(earlier=Earlier(lost_s=4.0))
    comp = components(tl, num_output=10)
    assert comp["ttft"]["node_lost"] == 4.0
    assert comp["ttft_s"] == pytest.approx(4.2)  # 4 s lost, then this attempt's 0.2 s
    assert comp["tpot_s"] == pytest.approx(0.1)  # its decode is this attempt's alone
    got = attribute(tl, 10, 0, FairnessConfig(slo_ttft_s={"*": 1.0}))
    assert got["missed"] == ["ttft"] and got["cause"] == "node_lost"
    # the same attempt without its history meets the target: the loss was what made the miss
    assert attribute(attempt(), 10, 0, FairnessConfig(slo_ttft_s={"*": 1.0}))["missed"] == []


def test_a_loss_after_tokens_is_part_of_the_decode_phase():
    # first token at 0.3 s, 5 tokens until 0.7 s, node lost; this attempt sent at 3.5 s
    tl = attempt(earlier=Earlier(lost_s=3.5, tokens=5, first_token_s=0.3, last_token_s=0.7))
    comp = components(tl, num_output=10)
    assert comp["ttft"] == {"lost_attempt": 0.3} and comp["ttft_s"] == 0.3
    assert comp["tpot"]["lost_attempt_decode"] == pytest.approx(0.4)
    assert comp["tpot"]["node_lost"] == pytest.approx(3.5 - 0.7 + 0.2)  # to this attempt's first token
    # 15 tokens from 0.3 s to 3.5 + 1.1 s: 14 gaps
    assert comp["tpot_s"] == pytest.approx((3.5 + 1.1 - 0.3) / 14)
    got = attribute(tl, 10, 0, FairnessConfig(slo_ttft_s={"*": 1.0}, slo_tpot_s={"*": 0.1}))
    assert got["missed"] == ["tpot"] and got["causes"] == {"tpot": "node_lost"}


def test_the_figures_travel_with_the_request():
    e = Earlier(lost_s=2.5, tokens=3, first_token_s=0.5, last_token_s=1.0)
    req = GenerateRequest("r.r1", [5, 6, 7, 40, 41, 42], Params(max_tokens=3, first_index=3), earlier=e)
    assert decode_message(encode_message(req)).earlier == e
    assert decode_message(encode_message(GenerateRequest("r", [5], Params(max_tokens=1)))).earlier is None
    with pytest.raises(ProtocolError, match="earlier.lost_s"):
        decode_message(encode_message(GenerateRequest("r", [5], Params(max_tokens=1), earlier=Earlier("x"))))
    assert Timeline(earlier=e).to_dict() == {"earlier": {"lost_s": 2.5, "tokens": 3, "first_token_s": 0.5,
                                                         "last_token_s": 1.0}}


@pytest.mark.parametrize("e,ok", [
    (Earlier(2.0), True),
    (Earlier(2.0, 3, 0.5, 1.0), True),
    (Earlier(-1.0), False),  # before the request arrived
    (Earlier(math.nan), False),
    (Earlier(2.0, 0, 0.5, 1.0), False),  # token times without tokens
    (Earlier(2.0, 3), False),  # tokens without their times
    (Earlier(2.0, 3, 1.0, 0.5), False),  # last before first
    (Earlier(2.0, 3, 0.5, 2.5), False),  # a token after the new attempt was sent
    (Earlier(2.0, 3, 0.5, math.inf), False),
])
def test_only_figures_a_router_could_have_measured_are_taken(e, ok):
    assert e.valid() is ok
