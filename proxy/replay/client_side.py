"""Client-side replay without the I/O: step order, the account of answers, the diff.

``pulsar-tap replay REC --upstream URL`` re-issues every frame the recorded clients
sent, in capture order across connections (:func:`steps_in_order`), and compares
each request's answer with the recorded one by outcome only (``ok``,
``error:CODE``, ``unanswered``; :data:`NOT_SENT` when the producer or consumer it
needs could not be created): message ids, generated names and timing are not
differences.  :class:`ReplayScore` keeps that account while the replay runs and
turns it into :class:`ReplayDiff` lines at the end.  The Trio edge that talks to the
broker is :class:`proxy.replay.replayer.ClientReplayer`; nothing here waits.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from proxy.protocol.commands import T
from proxy.protocol.frame import Frame
from proxy.replay.conversation import OK, UNANSWERED, Conversation, Exchange, Step

if TYPE_CHECKING:
    from proxy.recording.reader import ReadReport

NOT_SENT: Final = "not-sent"


class TxnIds:
    """The live transaction coordinator's ids for the recorded ones, learnt from the NEW_TXN answers.

    A transaction id (PulsarApi.proto ``txnid_most_bits``: the coordinator, ``txnid_least_bits``:
    its counter) is the coordinator's, as a producer id is the client's: the live coordinator
    numbers the replayed transactions anew, so every frame that names a recorded transaction
    (SEND and its MessageMetadata, ACK, ADD_PARTITION_TO_TXN, ADD_SUBSCRIPTION_TO_TXN, END_TXN)
    must name the live one instead.  An id no NEW_TXN of the recording answered is left as it is.
    """

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: dict[tuple[int, int], tuple[int, int]] = {}

    def learn(self, recorded: Frame | None, live: Frame) -> None:
        """The recorded NEW_TXN_RESPONSE ``recorded`` is the live ``live`` (no-op unless both are)."""
        if recorded is not None and recorded.type == live.type == T.NEW_TXN_RESPONSE:
            self._live[_txnid(recorded.sub)] = _txnid(live.sub)

    def translate(self, message: Any) -> bool:
        """Give ``message`` (a command or MessageMetadata) the live id of the transaction it names; whether
        that changed it."""
        fields = message.DESCRIPTOR.fields_by_name
        if "txnid_least_bits" not in fields or not (
                message.HasField("txnid_least_bits") or message.HasField("txnid_most_bits")):
            return False
        recorded = _txnid(message)
        live = self._live.get(recorded, recorded)
        if live == recorded:
            return False
        message.txnid_most_bits, message.txnid_least_bits = live
        return True


def _txnid(message: Any) -> tuple[int, int]:
    return int(message.txnid_most_bits), int(message.txnid_least_bits)


@dataclass(frozen=True, slots=True)
class ReplayDiff:
    """One request whose replayed answer differs from the recorded one."""

    conn: int
    command: str
    topic: str | None
    recorded: str
    replayed: str

    def format(self) -> str:
        return (f"DIFF conn={self.conn} {self.command} topic={self.topic or '-'} "
                f"recorded={self.recorded} replayed={self.replayed}")


@dataclass(slots=True)
class ReplayResult:
    requests: int = 0
    frames_sent: int = 0
    #: recorded requests the proxy answered or swallowed: not replayed, not compared
    proxy_handled: int = 0
    diffs: list[ReplayDiff] = field(default_factory=list)
    #: stopped before the end (SIGINT/SIGTERM): only the requests replayed so far were compared
    stopped: bool = False


def steps_in_order(conversations: dict[int, Conversation]) -> Iterator[tuple[Conversation, Step]]:
    """Every recorded step of every connection, in capture order (ties: connection, then step)."""
    streams = [((step.ts_ns, conv.conn, i), conv, step) for conv in conversations.values()
               for i, step in enumerate(conv.steps)]
    heapq.heapify(streams)
    while streams:
        _, conv, step = heapq.heappop(streams)
        yield conv, step


def recorded_producer_name(conv: Conversation, producer_id: int) -> str | None:
    """The name the recorded broker gave producer ``producer_id`` of ``conv`` (PRODUCER_SUCCESS)."""
    recorded = next((e.response for e in conv.exchanges
                     if e.response is not None and e.response.type == T.PRODUCER_SUCCESS
                     and e.request.type == T.PRODUCER
                     and e.request.command.producer.producer_id == producer_id), None)
    if recorded is None:
        return None
    name: str = recorded.command.producer_success.producer_name
    return name


def live_producer_name(answer: Frame) -> str | None:
    """The name a live broker gave in its answer to PRODUCER (None: it refused)."""
    if answer.type != T.PRODUCER_SUCCESS:
        return None
    name: str = answer.command.producer_success.producer_name
    return name


class ReplayScore:
    """What a replay issued and what each request got, to compare with the recording."""

    def __init__(self, conversations: dict[int, Conversation]) -> None:
        self.conversations = conversations
        self.result = ReplayResult()
        #: id(exchange) -> the outcome the live broker gave
        self.outcomes: dict[int, str] = {}
        #: ids of the exchanges whose request was issued (the ones compared when stopped early)
        self._issued: set[int] = set()

    def issued(self, exchange: Exchange) -> None:
        self.result.requests += 1
        self._issued.add(id(exchange))

    def answered(self, exchange: Exchange, outcome: str) -> None:
        self.outcomes[id(exchange)] = outcome

    def diffs(self) -> list[ReplayDiff]:
        """Compare every replayed request with the recording; also kept in ``result.diffs``."""
        for conv in sorted(self.conversations.values(), key=lambda c: c.conn):
            for exchange in conv.exchanges:
                if exchange.proxy_handled or (self.result.stopped and id(exchange) not in self._issued):
                    continue
                replayed = self.outcomes.get(id(exchange), UNANSWERED)
                if exchange.abandoned and OK not in (replayed, exchange.outcome):
                    continue  # a SEND abandoned with its producer: unanswered and error:CODE are the same
                if replayed != exchange.outcome:
                    self.result.diffs.append(ReplayDiff(conv.conn, exchange.command, exchange.topic,
                                                        exchange.outcome, replayed))
        return self.result.diffs


def load_conversations(path: str) -> tuple[dict[int, Conversation], ReadReport]:
    """The recorded conversations at ``path``, and what the reader skipped (damaged records)."""
    from proxy.recording.reader import open_recordings
    from proxy.replay.conversation import build_conversations

    recordings = open_recordings(path)
    conversations = build_conversations(recordings.frames())
    return conversations, recordings.report


__all__ = ["NOT_SENT", "ReplayDiff", "ReplayResult", "ReplayScore", "TxnIds", "live_producer_name",
           "load_conversations", "recorded_producer_name", "steps_in_order"]
