"""The session table, walked: every state x direction x command either moves by TRANSITIONS or is refused.

After h2's state-machine tests: Hypothesis drives a strict and a lenient tracker through
random (direction, command) walks and checks both against the table — the strict one
raises IllegalFrame for what the table lacks and stays put, the lenient one counts it
in ``violations`` and stays put, and neither ever moves otherwise.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.protocol.commands import TYPE_NAMES, T
from proxy.protocol.session import (
    TRANSITIONS,
    ConnectionState,
    Direction,
    IllegalFrame,
    SessionTracker,
    watched_types,
)

KINDS = sorted(TYPE_NAMES)
steps = st.lists(st.tuples(st.sampled_from(list(Direction)), st.sampled_from(KINDS)), max_size=40)


def test_every_state_direction_and_command_is_either_in_the_table_or_an_error() -> None:
    for state in ConnectionState:
        for direction in Direction:
            for kind in KINDS:
                tracker = SessionTracker()
                tracker.state = state
                expected = TRANSITIONS.get((state, direction, kind))
                if expected is None:
                    with pytest.raises(IllegalFrame):
                        tracker.advance(kind, direction)
                    assert tracker.state is state
                else:
                    assert tracker.advance(kind, direction) is expected is tracker.state


@settings(max_examples=300)
@given(steps, st.sampled_from(list(ConnectionState)))
def test_a_walk_moves_strict_and_lenient_trackers_only_by_the_table(
        walk: list[tuple[Direction, int]], start: ConnectionState) -> None:
    strict, lenient = SessionTracker(), SessionTracker(strict=False)
    strict.state = lenient.state = start
    state, refused = start, 0
    for direction, kind in walk:
        expected = TRANSITIONS.get((state, direction, kind))
        if expected is None:
            refused += 1
            with pytest.raises(IllegalFrame):
                strict.advance(kind, direction)
        else:
            state = expected
            strict.advance(kind, direction)
        assert lenient.advance(kind, direction) is state is strict.state
    assert lenient.violations == refused and strict.violations == 0


def test_nothing_leaves_closed_and_only_connect_leaves_awaiting_connect() -> None:
    assert not [key for key in TRANSITIONS if key[0] is ConnectionState.CLOSED]
    assert [key[2] for key in TRANSITIONS if key[0] is ConnectionState.AWAITING_CONNECT] == [T.CONNECT]


def test_the_types_a_skipping_user_need_not_see_are_exactly_the_loops_of_the_table() -> None:
    for state in ConnectionState:
        for direction in Direction:
            unseen = set(KINDS) - watched_types(state, direction)
            assert unseen == {kind for kind in KINDS if TRANSITIONS.get((state, direction, kind)) is state}
    # the proxy passes the data path through undecoded once connected
    connected = ConnectionState.CONNECTED
    assert not watched_types(connected, Direction.TO_BROKER) & {T.SEND, T.FLOW, T.ACK, T.PING, T.PONG}
    assert not watched_types(connected, Direction.TO_CLIENT) & {T.MESSAGE, T.SEND_RECEIPT, T.PING, T.PONG}
    assert T.CONNECT in watched_types(connected, Direction.TO_BROKER)
    assert T.MESSAGE in watched_types(connected, Direction.TO_BROKER)


@settings(max_examples=300)
@given(steps, st.sampled_from(list(ConnectionState)))
def test_a_tracker_shown_only_the_watched_types_ends_as_one_shown_everything(
        walk: list[tuple[Direction, int]], start: ConnectionState) -> None:
    """What the proxy relies on to pass most frames through: skipping the others loses nothing."""
    everything, watching = SessionTracker(strict=False), SessionTracker(strict=False)
    everything.state = watching.state = start
    for direction, kind in walk:
        everything.advance(kind, direction)
        if kind in watched_types(watching.state, direction):
            watching.advance(kind, direction)
        assert watching.state is everything.state
    assert watching.violations == everything.violations
