"""The hand-off state machine (pdtb/nodes/handoff.py) against a brute-force reading of its
diagram: every (state, event) pair is either the diagram's arrow or refused."""
from __future__ import annotations

import itertools

import pytest

from pdtb.nodes.handoff import HandoffEvent as E
from pdtb.nodes.handoff import HandoffState as S
from pdtb.nodes.handoff import IllegalTransition, advance

# the diagram in the module docstring, written out by hand
ARROWS = {
    (S.BOUND, E.SEND): S.SENDING, (S.MOVED, E.SEND): S.SENDING, (S.HELD, E.SEND): S.SENDING,
    (S.SENDING, E.DEFERRED): S.HELD,
    (S.BOUND, E.MOVE): S.MOVED, (S.SENDING, E.MOVE): S.MOVED, (S.HELD, E.MOVE): S.MOVED, (S.MOVED, E.MOVE): S.MOVED,
    (S.BOUND, E.LANDED): S.DELIVERED, (S.SENDING, E.LANDED): S.DELIVERED, (S.HELD, E.LANDED): S.DELIVERED,
    (S.MOVED, E.LANDED): S.DELIVERED,
    (S.BOUND, E.FAIL): S.FAILED, (S.SENDING, E.FAIL): S.FAILED, (S.HELD, E.FAIL): S.FAILED, (S.MOVED, E.FAIL): S.FAILED,
}


@pytest.mark.parametrize("state,event", list(itertools.product(S, E)))
def test_every_pair(state, event):
    if (state, event) in ARROWS:
        assert advance(state, event) is ARROWS[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            advance(state, event)


def test_final_states_take_nothing():
    for state in (S.DELIVERED, S.FAILED):
        assert state.final
        for event in E:
            with pytest.raises(IllegalTransition):
                advance(state, event)


def test_a_held_hand_off_moves_then_lands():
    s = S.BOUND
    for event in (E.SEND, E.DEFERRED, E.SEND, E.DEFERRED, E.MOVE, E.SEND, E.LANDED):
        s = advance(s, event)
    assert s is S.DELIVERED
