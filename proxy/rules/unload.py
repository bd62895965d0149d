"""The ``close`` action as a topic unload: what the proxy forwards for a producer or consumer it closed.

On a real unload the broker stops taking the producer's messages, answers the SENDs it
already had (their receipts reach the client first), then writes CLOSE_PRODUCER; the
client re-creates the producer (same ``producer_id``) and resends every message it has
no receipt for — nothing is lost, and nothing is stored twice.  A consumer is closed
likewise with CLOSE_CONSUMER; what it had not acknowledged is delivered again after it
subscribes anew.  The proxy plays that unload on one connection
(:class:`ConnectionUnloads`), per producer or consumer id:

``open`` --(rule fires)--> ``closing``: the proxy has sent CLOSE_PRODUCER /
CLOSE_CONSUMER (with its own request id) to the broker.  The client's SENDs (FLOW,
ACK, REDELIVER for a consumer) for that id are swallowed from now on — the client will
resend them, and a broker that no longer knows the id ignores or refuses them
(Pulsar's ServerCnx ignores SENDs of a producer it closed, and closes the connection
for SENDs of one it never knew).  What the broker sends for the id (the receipts of
SENDs it had before the close, messages it had dispatched) still reaches the client.

``closing`` --(the broker answers the close: SUCCESS or ERROR, swallowed)--> ``closed``:
the proxy writes CLOSE_PRODUCER / CLOSE_CONSUMER (request_id -1, as a broker does) to
the client in place of that answer, so the client learns of the unload after
everything the broker sent before it.  Nothing more is forwarded for the id, in
either direction.

``closed`` / ``closing`` --(the client's PRODUCER / SUBSCRIBE, or its own close, for
the id)--> ``open``: the client re-created (or gave up) the producer or consumer;
from then on its frames are its new incarnation's.  If that happens while closing,
the broker's answer to the proxy's close is still swallowed, and no close is written
to the client (it has moved on).

Frames with a ``request_id`` (the client's requests) always pass: the broker answers
them as it answers requests for an id it does not know.  Sans-IO: frames in, a
:class:`~proxy.rules.verdict.Verdict` (or None: not the unload's business) out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.protocol.commands import CONSUMER_NOTICES, PRODUCER_NOTICES, T
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction
from proxy.rules.verdict import Verdict

#: frames of the client that act on a producer / a consumer without asking for an answer
_CLIENT_PRODUCER_DATA: Final = frozenset({T.SEND})
_CLIENT_CONSUMER_DATA: Final = frozenset({T.FLOW, T.ACK, T.REDELIVER_UNACKNOWLEDGED_MESSAGES})
#: frames of the broker that concern one producer / one consumer
_BROKER_PRODUCER_FRAMES: Final = PRODUCER_NOTICES
_BROKER_CONSUMER_FRAMES: Final = CONSUMER_NOTICES | {T.ACK_RESPONSE}
#: the frames an unload must see, per direction (the rules engine adds them to its interest)
UNLOAD_TYPES: Final = {
    Direction.TO_BROKER: _CLIENT_PRODUCER_DATA | _CLIENT_CONSUMER_DATA
    | {T.PRODUCER, T.SUBSCRIBE, T.CLOSE_PRODUCER, T.CLOSE_CONSUMER},
    Direction.TO_CLIENT: _BROKER_PRODUCER_FRAMES | _BROKER_CONSUMER_FRAMES | {T.SUCCESS, T.ERROR},
}


class Phase(enum.Enum):
    CLOSING = "closing"
    CLOSED = "closed"


class Kind(enum.Enum):
    PRODUCER = "producer"
    CONSUMER = "consumer"


@dataclass(slots=True)
class _Close:
    """One close the proxy asked the broker for."""

    kind: Kind
    entity_id: int
    #: what the client is told once the broker answered (None: the client moved on meanwhile)
    to_client: bytes | None
    #: the rule that began the unload (named on every frame the unload acts on)
    rule: str


@dataclass(slots=True)
class ConnectionUnloads:
    """The producers and consumers the proxy is closing, or closed, on one connection."""

    #: (kind, id) -> where its unload stands, and the rule that began it
    phases: dict[tuple[Kind, int], tuple[Phase, str]] = field(default_factory=dict)
    #: request id of a close the proxy sent upstream -> that close
    requests: dict[int, _Close] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.phases or self.requests)

    def phase(self, kind: Kind, entity_id: int) -> Phase | None:
        entry = self.phases.get((kind, entity_id))
        return None if entry is None else entry[0]

    def begin(self, kind: Kind, entity_id: int, request_id: int, to_client: bytes, rule: str) -> None:
        """Rule ``rule`` sent the broker a close (``request_id``); the client will be told ``to_client``."""
        self.phases[(kind, entity_id)] = (Phase.CLOSING, rule)
        self.requests[request_id] = _Close(kind, entity_id, to_client, rule)

    def on_frame(self, frame: Frame, direction: Direction) -> Verdict | None:
        """What the unload does with ``frame``; None when it is not the unload's business."""
        if not self.active:
            return None
        sub: Any = frame.sub
        kind = frame.type
        if direction is Direction.TO_CLIENT:
            if kind in (T.SUCCESS, T.ERROR):
                close = self.requests.pop(sub.request_id, None)
                if close is None:
                    return None
                if close.to_client is None:
                    return Verdict(forward=False, fired=(close.rule,))
                self.phases[(close.kind, close.entity_id)] = (Phase.CLOSED, close.rule)
                return Verdict(forward=False, to_client=(close.to_client,), fired=(close.rule,))
            key = self._key(kind, sub, _BROKER_PRODUCER_FRAMES, _BROKER_CONSUMER_FRAMES)
            entry = None if key is None else self.phases.get(key)
            if entry is not None and entry[0] is Phase.CLOSED:
                return Verdict(forward=False, fired=(entry[1],))
            return None
        if kind in (T.PRODUCER, T.CLOSE_PRODUCER):
            self._reopen((Kind.PRODUCER, sub.producer_id))
            return None
        if kind in (T.SUBSCRIBE, T.CLOSE_CONSUMER):
            self._reopen((Kind.CONSUMER, sub.consumer_id))
            return None
        key = self._key(kind, sub, _CLIENT_PRODUCER_DATA, _CLIENT_CONSUMER_DATA)
        entry = None if key is None else self.phases.get(key)
        if entry is None:
            return None
        if "request_id" in sub.DESCRIPTOR.fields_by_name and sub.HasField("request_id"):
            return None  # a request: the broker answers it as for an id it does not know
        return Verdict(forward=False, fired=(entry[1],))

    @staticmethod
    def _key(kind: int, sub: Any, producer_frames: frozenset[int],
             consumer_frames: frozenset[int]) -> tuple[Kind, int] | None:
        if kind in producer_frames:
            return (Kind.PRODUCER, sub.producer_id)
        if kind in consumer_frames:
            return (Kind.CONSUMER, sub.consumer_id)
        return None

    def _reopen(self, key: tuple[Kind, int]) -> None:
        """The client re-created or closed the id: a close still pending upstream tells the client nothing."""
        if self.phases.pop(key, None) is None:
            return
        for close in self.requests.values():
            if (close.kind, close.entity_id) == key:
                close.to_client = None


__all__ = ["UNLOAD_TYPES", "ConnectionUnloads", "Kind", "Phase"]
